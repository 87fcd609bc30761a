//! ferry-core's modules form no import cycle (issue 43, item 3): the graph
//! of `crate::…` paths between the top-level modules of `src/`, read from
//! the sources, has no strongly connected component of more than one
//! module, and `error` names only leaf modules (modules that name no
//! other). Test code (from a file's first `#[cfg(test)]` on, and `tests.rs`
//! files) and comments do not count; a path through a re-export of the
//! crate root (`crate::Error`) counts as an edge to the module that defines
//! the item.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

fn ident(s: &str) -> &str {
    let end = s
        .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .unwrap_or(s.len());
    &s[..end]
}

/// The first identifiers of the paths after each `crate::` in `code`
/// (`crate::a::b` gives `a`; `crate::{a::x, b}` gives `a` and `b`).
fn crate_paths(code: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = code;
    while let Some(i) = rest.find("crate::") {
        rest = &rest[i + "crate::".len()..];
        if let Some(group) = rest.strip_prefix('{') {
            let mut depth = 1;
            let mut item = String::new();
            let mut items = Vec::new();
            for c in group.chars() {
                match c {
                    '{' => depth += 1,
                    '}' => depth -= 1,
                    ',' if depth == 1 => items.push(std::mem::take(&mut item)),
                    _ => {}
                }
                if depth == 0 {
                    break;
                }
                if depth == 1 && c != ',' {
                    item.push(c);
                }
            }
            items.push(item);
            out.extend(items.iter().map(|i| ident(i.trim()).to_owned()));
        } else {
            out.push(ident(rest).to_owned());
        }
    }
    out.retain(|s| !s.is_empty());
    out
}

/// Code lines of a file: no comments, nothing from `#[cfg(test)]` on.
fn code_of(text: &str) -> String {
    let mut code = String::new();
    for line in text.lines() {
        let t = line.trim_start();
        if t.starts_with("#[cfg(test)]") {
            break;
        }
        if t.starts_with("//") {
            continue;
        }
        code.push_str(line);
        code.push('\n');
    }
    code
}

/// Names the crate root re-exports (`pub use m::{A, B}` in lib.rs), and
/// the module each comes from.
fn root_exports(lib: &str) -> BTreeMap<String, String> {
    let mut map = BTreeMap::new();
    let code = code_of(lib);
    let mut rest = code.as_str();
    while let Some(i) = rest.find("pub use ") {
        rest = &rest[i + "pub use ".len()..];
        let stmt = &rest[..rest.find(';').unwrap_or(rest.len())];
        let module = ident(stmt).to_owned();
        let names = match stmt.find('{') {
            Some(b) => stmt[b + 1..].trim_end_matches('}').to_owned(),
            None => stmt.rsplit("::").next().unwrap_or("").to_owned(),
        };
        for n in names.split(',') {
            let n = n.trim();
            let name = n.rsplit(" as ").next().unwrap_or(n);
            let name = ident(name.rsplit("::").next().unwrap_or(name).trim());
            if !name.is_empty() {
                map.entry(name.to_owned()).or_insert_with(|| module.clone());
            }
        }
    }
    map
}

fn module_of(src: &Path, file: &Path) -> String {
    let rel = file.strip_prefix(src).expect("under src");
    let first = rel
        .components()
        .next()
        .expect("a path")
        .as_os_str()
        .to_string_lossy()
        .into_owned();
    first.trim_end_matches(".rs").to_owned()
}

fn files(dir: &Path, out: &mut Vec<std::path::PathBuf>) {
    for e in std::fs::read_dir(dir).expect("read src") {
        let p = e.expect("entry").path();
        if p.is_dir() {
            files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs")
            && p.file_name().is_some_and(|n| n != "tests.rs")
        {
            out.push(p);
        }
    }
}

fn graph() -> BTreeMap<String, BTreeSet<String>> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut all = Vec::new();
    files(&src, &mut all);
    let modules: BTreeSet<String> = all.iter().map(|f| module_of(&src, f)).collect();
    let lib = std::fs::read_to_string(src.join("lib.rs")).expect("lib.rs");
    let exports = root_exports(&lib);
    let mut edges: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for f in &all {
        let from = module_of(&src, f);
        let text = std::fs::read_to_string(f).expect("source");
        for name in crate_paths(&code_of(&text)) {
            let to = if modules.contains(&name) {
                Some(name)
            } else {
                exports.get(&name).cloned()
            };
            if let Some(to) = to.filter(|t| *t != from && *t != "lib" && from != "lib") {
                edges.entry(from.clone()).or_default().insert(to);
            }
        }
        edges.entry(from).or_default();
    }
    edges
}

/// Strongly connected components of more than one node (Tarjan).
fn cycles(g: &BTreeMap<String, BTreeSet<String>>) -> Vec<Vec<String>> {
    struct T<'a> {
        g: &'a BTreeMap<String, BTreeSet<String>>,
        index: BTreeMap<&'a str, usize>,
        low: BTreeMap<&'a str, usize>,
        stack: Vec<&'a str>,
        on: BTreeSet<&'a str>,
        out: Vec<Vec<String>>,
    }
    impl<'a> T<'a> {
        fn visit(&mut self, v: &'a str) {
            let n = self.index.len();
            self.index.insert(v, n);
            self.low.insert(v, n);
            self.stack.push(v);
            self.on.insert(v);
            for w in self.g.get(v).into_iter().flatten() {
                let w = w.as_str();
                if !self.index.contains_key(w) {
                    self.visit(w);
                    let l = self.low[v].min(self.low[w]);
                    self.low.insert(v, l);
                } else if self.on.contains(w) {
                    let l = self.low[v].min(self.index[w]);
                    self.low.insert(v, l);
                }
            }
            if self.low[v] == self.index[v] {
                let mut comp = Vec::new();
                while let Some(w) = self.stack.pop() {
                    self.on.remove(w);
                    comp.push(w.to_owned());
                    if w == v {
                        break;
                    }
                }
                if comp.len() > 1 {
                    comp.sort();
                    self.out.push(comp);
                }
            }
        }
    }
    let mut t = T {
        g,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on: BTreeSet::new(),
        out: Vec::new(),
    };
    for v in g.keys() {
        if !t.index.contains_key(v.as_str()) {
            t.visit(v);
        }
    }
    t.out
}

#[test]
fn the_reader_finds_paths_and_cycles() {
    assert_eq!(
        crate_paths("use crate::{a::x, b, c::{d, e}}; let y = crate::f::g();"),
        ["a", "b", "c", "f"]
    );
    let g: BTreeMap<String, BTreeSet<String>> = [("a", "b"), ("b", "c"), ("c", "a"), ("d", "a")]
        .into_iter()
        .fold(BTreeMap::new(), |mut g, (f, t)| {
            g.entry(f.to_owned())
                .or_insert_with(BTreeSet::new)
                .insert(t.to_owned());
            g
        });
    assert_eq!(cycles(&g), vec![vec!["a", "b", "c"]]);
    let exports = root_exports("pub use types::{Notification, SegmentId as Id};\n");
    assert_eq!(
        exports.get("Notification").map(String::as_str),
        Some("types")
    );
    assert_eq!(exports.get("Id").map(String::as_str), Some("types"));
}

#[test]
fn ferry_core_modules_form_no_cycle() {
    let g = graph();
    assert!(g.len() > 10, "the sources were read: {g:?}");
    let found = cycles(&g);
    assert!(
        found.is_empty(),
        "import cycles between ferry-core modules: {found:?}\n(edges: {g:#?})"
    );
    let leaves: BTreeSet<&String> = g
        .iter()
        .filter(|(_, to)| to.is_empty())
        .map(|(m, _)| m)
        .collect();
    let error = &g["error"];
    assert!(
        error.iter().all(|m| leaves.contains(m)),
        "`error` names only leaf modules, but names {error:?} (leaves: {leaves:?})"
    );
}

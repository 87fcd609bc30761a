#!/usr/bin/env python3
"""The public API of Ferry's library crates, as a sorted listing checked in
under docs/public-api/<crate>.txt, so that a change to it shows in review.

    python3 scripts/public-api.py            # write the listings
    python3 scripts/public-api.py --check    # compare; exit 1 with a diff

The listing comes from rustdoc's JSON output (`cargo rustdoc -- -Z
unstable-options --output-format json`, run with RUSTC_BOOTSTRAP=1 on the
stable toolchain). Every item a user can name is listed at each public path
that names it (re-exports included): modules, types with their public
fields, variants, inherent methods with their signatures and the traits they
implement (auto traits and blanket impls left out), traits with their items,
functions, constants and type aliases. Rendering is this script's own, kept
to what matters for review; rustdoc's JSON format changes between Rust
releases, and the script reads it defensively (an unknown type renders as
`_`).
"""

import difflib
import json
import os
import subprocess
import sys

CRATES = [
    "ferry",
    "ferry-core",
    "ferry-tcp",
    "ferry-tcp-proto",
    "ferry-mooncake",
    "ferry-nixl",
    "ferry-verbs",
    "ferry-discovery",
]
# Features listed beyond the defaults: public surface other crates build on.
FEATURES = {"ferry-core": ["dlopen"]}
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "docs", "public-api")


def rustdoc_json(crate, target):
    env = dict(os.environ, RUSTC_BOOTSTRAP="1", CARGO_TERM_COLOR="never")
    subprocess.run(
        ["cargo", "rustdoc", "-q", "-p", crate, "--lib", "--target-dir", target]
        + (["--features", ",".join(FEATURES[crate])] if crate in FEATURES else [])
        + ["--", "-Z", "unstable-options", "--output-format", "json", "--cap-lints", "allow"],
        cwd=ROOT, env=env, check=True)
    path = os.path.join(target, "doc", crate.replace("-", "_") + ".json")
    with open(path) as f:
        return json.load(f)


def args_of(a):
    if not a:
        return ""
    ab = a.get("angle_bracketed")
    if ab:
        parts = []
        for x in ab.get("args", []):
            if "type" in x:
                parts.append(ty(x["type"]))
            elif "lifetime" in x:
                parts.append(x["lifetime"])
            elif "const" in x:
                parts.append(str(x["const"].get("expr", "_")))
            else:
                parts.append("_")
        for c in ab.get("constraints", []) or ab.get("bindings", []):
            b = c.get("binding", {})
            if "equality" in b and "type" in b["equality"]:
                parts.append(f"{c.get('name')} = {ty(b['equality']['type'])}")
            else:
                parts.append(str(c.get("name")))
        return "<" + ", ".join(parts) + ">" if parts else ""
    p = a.get("parenthesized")
    if p:
        out = ty(p["output"]) if p.get("output") else None
        return "(" + ", ".join(ty(t) for t in p.get("inputs", [])) + ")" + (f" -> {out}" if out else "")
    return ""


def bound(b):
    tb = b.get("trait_bound")
    if tb:
        return tb["trait"]["path"] + args_of(tb["trait"].get("args"))
    if "outlives" in b:
        return b["outlives"]
    return "_"


def ty(t):
    if t is None:
        return "()"
    if not isinstance(t, dict):
        return str(t)
    if "primitive" in t:
        return t["primitive"]
    if "generic" in t:
        return t["generic"]
    if "resolved_path" in t:
        r = t["resolved_path"]
        return r["path"] + args_of(r.get("args"))
    if "borrowed_ref" in t:
        r = t["borrowed_ref"]
        lt = (r.get("lifetime") + " ") if r.get("lifetime") else ""
        return "&" + lt + ("mut " if r.get("is_mutable") else "") + ty(r["type"])
    if "raw_pointer" in t:
        r = t["raw_pointer"]
        return ("*mut " if r.get("is_mutable") else "*const ") + ty(r["type"])
    if "slice" in t:
        return "[" + ty(t["slice"]) + "]"
    if "array" in t:
        return "[" + ty(t["array"]["type"]) + "; " + str(t["array"].get("len")) + "]"
    if "tuple" in t:
        return "(" + ", ".join(ty(x) for x in t["tuple"]) + ")"
    if "impl_trait" in t:
        return "impl " + " + ".join(bound(b) for b in t["impl_trait"])
    if "dyn_trait" in t:
        traits = [x["trait"]["path"] + args_of(x["trait"].get("args")) for x in t["dyn_trait"].get("traits", [])]
        return "dyn " + " + ".join(traits)
    if "qualified_path" in t:
        q = t["qualified_path"]
        return f"<{ty(q.get('self_type'))}>::{q.get('name')}"
    if "function_pointer" in t:
        f = t["function_pointer"]
        return "fn" + sig(f.get("sig") or f.get("decl") or {})
    return "_"


def sig(s):
    inputs = []
    for name, t in s.get("inputs", []):
        if name != "self":
            inputs.append(f"{name}: {ty(t)}")
        elif t == {"generic": "Self"}:
            inputs.append("self")
        elif "borrowed_ref" in t and t["borrowed_ref"].get("type") == {"generic": "Self"}:
            inputs.append("&mut self" if t["borrowed_ref"].get("is_mutable") else "&self")
        else:
            inputs.append(f"self: {ty(t)}")
    out = s.get("output")
    return "(" + ", ".join(inputs) + ")" + (f" -> {ty(out)}" if out else "")


def fn_line(path, f):
    h = f.get("header", {})
    quals = ("const " if h.get("is_const") else "") + ("async " if h.get("is_async") else "") + (
        "unsafe " if h.get("is_unsafe") else "")
    return f"{quals}fn {path}{sig(f.get('sig') or f.get('decl') or {})}"


class Lister:
    def __init__(self, doc):
        self.doc = doc
        self.index = doc["index"]
        self.lines = set()
        self.seen = set()

    def item(self, id_):
        return self.index.get(str(id_))

    def list_item(self, id_, path):
        if (str(id_), path) in self.seen:
            return
        self.seen.add((str(id_), path))
        it = self.item(id_)
        if it is None:
            ext = self.doc.get("paths", {}).get(str(id_))
            if ext:
                self.lines.add(f"pub use {path} = {'::'.join(ext['path'])}")
            return
        kind, inner = next(iter(it["inner"].items()))
        if kind == "module":
            self.lines.add(f"mod {path}")
            for child in inner.get("items", []):
                self.child(child, path)
        elif kind == "use":
            target = inner.get("id")
            name = inner.get("name")
            if inner.get("is_glob"):
                t = self.item(target) if target is not None else None
                if t and "module" in t["inner"]:
                    for child in t["inner"]["module"].get("items", []):
                        self.child(child, path)
                return
            if target is not None:
                self.list_item(target, path)
            else:
                self.lines.add(f"pub use {path} = {inner.get('source')}")
        elif kind == "struct":
            self.lines.add(f"struct {path}")
            k = inner.get("kind", {})
            fields = []
            if isinstance(k, dict):
                fields = (k.get("plain", {}) or {}).get("fields", []) or k.get("tuple", []) or []
            for fid in fields:
                f = self.item(fid) if fid is not None else None
                if f and f.get("visibility") == "public":
                    self.lines.add(f"field {path}.{f['name']}: {ty(f['inner']['struct_field'])}")
            self.impls(inner.get("impls", []), path)
        elif kind == "enum":
            self.lines.add(f"enum {path}")
            for vid in inner.get("variants", []):
                v = self.item(vid)
                if v:
                    self.lines.add(f"variant {path}::{v['name']}")
            self.impls(inner.get("impls", []), path)
        elif kind == "trait":
            self.lines.add(f"trait {path}")
            for mid in inner.get("items", []):
                m = self.item(mid)
                if not m:
                    continue
                mk, mi = next(iter(m["inner"].items()))
                if mk == "function":
                    self.lines.add(fn_line(f"{path}::{m['name']}", mi))
                else:
                    self.lines.add(f"{mk} {path}::{m['name']}")
        elif kind == "function":
            self.lines.add(fn_line(path, inner))
        elif kind == "constant":
            self.lines.add(f"const {path}: {ty(inner.get('type'))}")
        elif kind == "static":
            self.lines.add(f"static {path}: {ty(inner.get('type'))}")
        elif kind == "type_alias":
            self.lines.add(f"type {path} = {ty(inner.get('type'))}")
        elif kind == "macro":
            self.lines.add(f"macro {path}")
        else:
            self.lines.add(f"{kind} {path}")

    def child(self, cid, parent):
        c = self.item(cid)
        if c is None:
            return
        if c.get("visibility") != "public":
            return
        kind, inner = next(iter(c["inner"].items()))
        if kind == "impl":
            return
        name = c.get("name") or (inner.get("name") if kind == "use" else None)
        if kind == "use" and inner.get("is_glob"):
            self.list_item(cid, parent)
            return
        if name is None:
            return
        self.list_item(cid, f"{parent}::{name}")

    def impls(self, ids, path):
        for iid in ids:
            im = self.item(iid)
            if not im:
                continue
            i = im["inner"]["impl"]
            if i.get("is_synthetic") or i.get("blanket_impl") is not None:
                continue
            tr = i.get("trait")
            if tr:
                self.lines.add(f"impl {tr['path']}{args_of(tr.get('args'))} for {path}")
                continue
            for mid in i.get("items", []):
                m = self.item(mid)
                if not m or m.get("visibility") != "public":
                    continue
                mk, mi = next(iter(m["inner"].items()))
                if mk == "function":
                    self.lines.add(fn_line(f"{path}::{m['name']}", mi))
                elif mk in ("constant", "assoc_const"):
                    self.lines.add(f"const {path}::{m['name']}")
                else:
                    self.lines.add(f"{mk} {path}::{m['name']}")


def listing(crate, target):
    doc = rustdoc_json(crate, target)
    lister = Lister(doc)
    root = doc["root"]
    name = crate.replace("-", "_")
    lister.seen.add((str(root), name))
    for child in lister.item(root)["inner"]["module"].get("items", []):
        lister.child(child, name)
    head = f"# public API of {crate} (scripts/public-api.py; regenerate after a deliberate change)\n"
    return head + "".join(line + "\n" for line in sorted(lister.lines))


def main():
    check = "--check" in sys.argv[1:]
    target = os.path.join(ROOT, "target", "public-api")
    os.makedirs(OUT, exist_ok=True)
    changed = []
    for crate in CRATES:
        text = listing(crate, target)
        path = os.path.join(OUT, crate + ".txt")
        old = open(path).read() if os.path.exists(path) else ""
        if old != text:
            changed.append(crate)
            if check:
                sys.stdout.writelines(difflib.unified_diff(
                    old.splitlines(True), text.splitlines(True),
                    f"docs/public-api/{crate}.txt (checked in)", f"{crate} (this tree)"))
            else:
                with open(path, "w") as f:
                    f.write(text)
    if check and changed:
        print(f"\nthe public API of {', '.join(changed)} changed: if that is meant, run "
              "`python3 scripts/public-api.py` and commit docs/public-api/", file=sys.stderr)
        sys.exit(1)
    print(("public API unchanged: " if check else "public API listed: ") + ", ".join(CRATES))


if __name__ == "__main__":
    main()

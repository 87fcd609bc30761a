//! Mixed versions keep serving (issue 22): this build's `ferry` against a
//! `ferry` built from a pinned older commit of this repository, both ways
//! — old `serve` / new `bench --peer` and new `serve` / old `bench --peer`
//! — on the socket path and on the same-host path, every point verified by
//! reading bytes back, the target's region checked for what was written.
//!
//! The old binary is built once from `git archive PINNED` (the same tree a
//! `git worktree` would check out, without registering a worktree in the
//! repository) into `target/compat/PINNED/` and reused while it exists.
//! The pinned commit advances as `crates/backend-tcp/PROTOCOL.md` §0 says
//! (never to the commit under test). The test skips, printing why, only
//! where git or the pinned commit is unavailable (a shallow clone, a
//! source tarball); `FERRY_REQUIRE_BACKENDS` listing `compat` makes that
//! a failure.
#![cfg(all(feature = "tcp", target_os = "linux"))]

use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;

use transport_core::conformance::{backend_required, report_skip};

/// The older build this one must interoperate with: main at the last
/// protocol change before negotiation (ferry-tcp protocol 5).
const PINNED: &str = "7c3e5e6";

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .ancestors()
        .nth(2)
        .expect("crates/ferry-cli has a workspace root")
        .to_path_buf()
}

fn target_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace_root().join("target"))
}

/// The pinned `ferry`, built if not cached; `Err(reason)` to skip.
fn pinned_ferry() -> Result<PathBuf, String> {
    static BUILT: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    BUILT.get_or_init(build_pinned).clone()
}

fn build_pinned() -> Result<PathBuf, String> {
    let root = workspace_root();
    let compat = target_dir().join("compat").join(PINNED);
    let bin = compat.join("target").join("debug").join("ferry");
    if bin.exists() {
        return Ok(bin);
    }
    let git = |args: &[&str]| Command::new("git").arg("-C").arg(&root).args(args).output();
    match git(&["cat-file", "-e", &format!("{PINNED}^{{commit}}")]) {
        Err(e) => return Err(format!("git is not available: {e}")),
        Ok(o) if !o.status.success() => {
            return Err(format!(
                "the pinned commit {PINNED} is not in this clone's history (shallow clone?): {}",
                String::from_utf8_lossy(&o.stderr).trim()
            ))
        }
        Ok(_) => {}
    }
    // From here on every failure is a failure, not a skip.
    let src = compat.join("src");
    if !src.join("Cargo.toml").exists() {
        std::fs::create_dir_all(&src).expect("creating the pinned source directory");
        let tar = compat.join("src.tar");
        let archived = Command::new("git")
            .arg("-C")
            .arg(&root)
            .args(["archive", "--format=tar", "-o"])
            .arg(&tar)
            .arg(PINNED)
            .status()
            .expect("git archive");
        assert!(archived.success(), "git archive {PINNED}");
        let unpacked = Command::new("tar")
            .arg("-xf")
            .arg(&tar)
            .arg("-C")
            .arg(&src)
            .status()
            .expect("tar");
        assert!(
            unpacked.success(),
            "unpacking {PINNED} into {}",
            src.display()
        );
    }
    eprintln!(
        "building ferry at {PINNED} into {} (once)",
        compat.display()
    );
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let out = Command::new(cargo)
        .current_dir(&src)
        .args([
            "build",
            "--locked",
            "-p",
            "ferry-cli",
            "--bin",
            "ferry",
            "--target-dir",
        ])
        .arg(compat.join("target"))
        .env_remove("CARGO_TARGET_DIR")
        .env_remove("RUSTFLAGS")
        .output()
        .expect("running cargo for the pinned build");
    assert!(
        out.status.success(),
        "building ferry at {PINNED} failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(bin.exists(), "{} was not built", bin.display());
    Ok(bin)
}

/// The pinned binary, or `None` after printing why the test skips.
fn old_or_skip(test: &str) -> Option<PathBuf> {
    match pinned_ferry() {
        Ok(p) => Some(p),
        Err(reason) if backend_required("compat") => {
            panic!("{test}: FERRY_REQUIRE_BACKENDS lists compat, but: {reason}")
        }
        Err(reason) => {
            report_skip(&format!("{test}: {reason}"));
            None
        }
    }
}

fn new_ferry() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_ferry"))
}

fn cmd(bin: &Path) -> Command {
    let mut c = Command::new(bin);
    c.env_remove("RUST_LOG");
    c
}

/// A running `ferry serve` and what it printed.
struct Serve {
    child: Child,
    segment: String,
    remote: (String, String),
    /// Drains its stdout until it exits; returns what came after the banner.
    rest: std::thread::JoinHandle<String>,
}

fn serve(bin: &Path, backend: &str) -> Serve {
    let mut child = cmd(bin)
        .args(["serve", "--size", "8MiB", "--backend", backend])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("ferry serve");
    let mut lines = BufReader::new(child.stdout.take().expect("stdout")).lines();
    let (mut segment, mut remote) = (None, None);
    while segment.is_none() || remote.is_none() {
        let line = lines.next().expect("serve's banner").expect("line");
        if let Some(rest) = line.split("segment ").nth(1) {
            segment = Some(rest.trim().to_owned());
        }
        if line.starts_with("drive it with:") {
            let w: Vec<&str> = line.split_whitespace().collect();
            let after = |flag: &str| {
                let i = w.iter().position(|x| *x == flag).expect(flag);
                w[i + 1].to_owned()
            };
            remote = Some((after("--remote-addr"), after("--remote-len")));
        }
    }
    // Keep its stdout drained until it exits; the summary is read at stop.
    let rest = std::thread::spawn(move || {
        let mut s = String::new();
        for l in lines.map_while(Result::ok) {
            s.push_str(&l);
            s.push('\n');
        }
        s
    });
    Serve {
        child,
        segment: segment.expect("segment"),
        remote: remote.expect("remote region"),
        rest,
    }
}

/// Stops `serve` with SIGINT (its Ctrl-C path) and returns the summary.
fn stop(mut s: Serve) -> String {
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(s.child.id() as i32),
        nix::sys::signal::Signal::SIGINT,
    )
    .expect("SIGINT");
    let status = s.child.wait().expect("serve exits");
    assert!(status.success(), "serve exited with {status}");
    s.rest.join().expect("serve's reader")
}

/// `ferry bench --peer` of `bin` against `s`; asserts every point was
/// verified and returns the rows.
fn bench(bin: &Path, s: &Serve, backend: &str) -> Vec<serde_json::Value> {
    let out = cmd(bin)
        .args(["bench", "--peer", &s.segment, "--remote-addr", &s.remote.0])
        .args(["--remote-len", &s.remote.1, "--backend", backend])
        .args([
            "--blocks",
            "4KiB,1MiB",
            "--batches",
            "1,4",
            "--duration",
            "30ms",
        ])
        .args([
            "--warmup",
            "5ms",
            "--region-size",
            "8MiB",
            "--no-baselines",
            "--json",
        ])
        .output()
        .expect("ferry bench");
    let so = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "bench {} against {}: {so}\n{}",
        bin.display(),
        s.segment,
        String::from_utf8_lossy(&out.stderr)
    );
    let rows: Vec<serde_json::Value> = serde_json::from_str(&so).expect("bench JSON");
    assert_eq!(rows.len(), 8, "2 blocks x 2 batches x (write, read): {so}");
    for r in &rows {
        assert_eq!(r["verified"], true, "{r}");
    }
    rows
}

/// `ferry caps --peer` of `bin` against `s` (text).
fn caps(bin: &Path, s: &Serve, backend: &str) -> String {
    let out = cmd(bin)
        .args(["caps", "--backend", backend, "--peer", &s.segment])
        .output()
        .expect("ferry caps");
    let so = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{so}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    so
}

/// The number of bytes the summary says differ from the initial pattern.
fn changed(summary: &str) -> u64 {
    let tail = summary
        .split("region: ")
        .nth(1)
        .unwrap_or_else(|| panic!("no region line in {summary}"));
    tail.split_whitespace()
        .next()
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no count in {summary}"))
}

/// One direction: `server` serves, `client` benches and asks `caps`, on
/// the same-host path and on the socket.
fn pair(server: &Path, client: &Path, client_is_new: bool) {
    let s = serve(server, "tcp://127.0.0.1:0");
    // Same host: the same-host path is chosen (`cma`: no note means the
    // staging area and the control channel were taken too).
    let report = caps(client, &s, "tcp://127.0.0.1:0");
    assert!(
        report.contains(&format!("peer {}: path: cma", s.segment)),
        "{report}"
    );
    if client_is_new {
        assert!(report.contains("version in use: 5"), "{report}");
        assert!(report.contains("does not negotiate"), "{report}");
        for f in ["same-host", "control-channel", "staging-area", "ack-lane"] {
            assert!(
                report
                    .lines()
                    .any(|l| l.split_whitespace().collect::<Vec<_>>() == [f, "on"]),
                "{f} on: {report}"
            );
        }
        assert!(report.contains("path: same-host staged"), "{report}");
    }
    bench(client, &s, "tcp://127.0.0.1:0");
    // The socket path, between the same two builds.
    let off = "tcp://127.0.0.1:0?same_host=off";
    let report = caps(client, &s, off);
    assert!(
        report.contains(&format!("peer {}: path: tcp (same_host=off)", s.segment)),
        "{report}"
    );
    bench(client, &s, off);
    let summary = stop(s);
    assert!(changed(&summary) > 0, "the writes landed: {summary}");
    assert!(
        !summary.contains("received: 0 notifications"),
        "bench sends a notification per point: {summary}"
    );
}

#[test]
fn old_serve_new_bench() {
    let Some(old) = old_or_skip("old_serve_new_bench") else {
        return;
    };
    pair(&old, &new_ferry(), true);
}

#[test]
fn new_serve_old_bench() {
    let Some(old) = old_or_skip("new_serve_old_bench") else {
        return;
    };
    pair(&new_ferry(), &old, false);
}

#[test]
fn the_pinned_build_is_older() {
    let Some(old) = old_or_skip("the_pinned_build_is_older") else {
        return;
    };
    // The old build announces one protocol version; this one a range.
    let mut v = String::new();
    cmd(&new_ferry())
        .arg("--version")
        .stdout(Stdio::piped())
        .spawn()
        .expect("ferry --version")
        .stdout
        .expect("stdout")
        .read_to_string(&mut v)
        .expect("read");
    assert!(v.contains("ferry-tcp 4..=6"), "{v}");
    let s = serve(&old, "tcp://127.0.0.1:0");
    let report = caps(&old, &s, "tcp://127.0.0.1:0");
    stop(s);
    assert!(report.contains("ferry-tcp v5"), "{report}");
}

//! Mixed versions keep serving (issue 22): this build's `ferry` against
//! `ferry` built from pinned older commits of this repository (7c3e5e6,
//! protocol 5; 4b6cd43, protocol 4), both ways
//! — old `serve` / new `bench --peer` and new `serve` / old `bench --peer`
//! — on the socket path and on the same-host path, every point verified by
//! reading bytes back, the target's region checked for what was written.
//!
//! Each old binary is built once from `git archive COMMIT` (the same tree
//! a `git worktree` would check out, without registering a worktree in the
//! repository, which would go stale whenever `target/` is cleaned) into
//! `target/compat/COMMIT/` and reused while it exists. The pinned commits
//! advance as `crates/ferry-tcp/PROTOCOL.md` §0 says
//! (never to the commit under test). The test skips, printing why, only
//! where git or the pinned commit is unavailable (a shallow clone, a
//! source tarball); `FERRY_REQUIRE_BACKENDS` listing `compat` makes that
//! a failure.
#![cfg(all(feature = "tcp", target_os = "linux"))]

use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;

use ferry_core::conformance::{backend_required, report_skip};

/// The older builds this one must interoperate with (PROTOCOL.md §0):
/// main at the last protocol change before negotiation (ferry-tcp
/// protocol 5, the full same-host path), and the oldest build the policy
/// covers (protocol 4: no staging area). Each is built once (about two
/// minutes each on a quiet machine, more under load).
const PINNED: &str = "7c3e5e6";
/// See [`PINNED`].
const PINNED_V4: &str = "4b6cd43";
/// The last build whose TLS records were rustls's own (after it, Ferry
/// moves TLS 1.3 records itself once rustls's handshake is done): with
/// `tls=require` both ways, the proof that the wire did not change.
const PINNED_TLS: &str = "6c4d298";

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
fn pinned_ferry(commit: &'static str) -> Result<PathBuf, String> {
    static BUILT: [OnceLock<Result<PathBuf, String>>; 3] =
        [OnceLock::new(), OnceLock::new(), OnceLock::new()];
    let slot = match commit {
        PINNED_V4 => 1,
        PINNED_TLS => 2,
        _ => 0,
    };
    BUILT[slot].get_or_init(|| build_pinned(commit)).clone()
}

fn build_pinned(commit: &str) -> Result<PathBuf, String> {
    // The builds share the machine: one at a time.
    static ONE: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _one = ONE.lock().unwrap_or_else(|e| e.into_inner());
    let root = workspace_root();
    let compat = target_dir().join("compat").join(commit);
    let bin = compat.join("target").join("debug").join("ferry");
    if bin.exists() {
        return Ok(bin);
    }
    let git = |args: &[&str]| Command::new("git").arg("-C").arg(&root).args(args).output();
    match git(&["cat-file", "-e", &format!("{commit}^{{commit}}")]) {
        Err(e) => return Err(format!("git is not available: {e}")),
        Ok(o) if !o.status.success() => {
            return Err(format!(
                "the pinned commit {commit} is not in this clone's history (shallow clone?): {}",
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
            .arg(commit)
            .status()
            .expect("git archive");
        assert!(archived.success(), "git archive {commit}");
        let unpacked = Command::new("tar")
            .arg("-xf")
            .arg(&tar)
            .arg("-C")
            .arg(&src)
            .status()
            .expect("tar");
        assert!(
            unpacked.success(),
            "unpacking {commit} into {}",
            src.display()
        );
    }
    eprintln!(
        "building ferry at {commit} into {} (once)",
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
        "building ferry at {commit} failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(bin.exists(), "{} was not built", bin.display());
    Ok(bin)
}

/// The pinned binary, or `None` after printing why the test skips.
fn old_or_skip(test: &str, commit: &'static str) -> Option<PathBuf> {
    match pinned_ferry(commit) {
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
    serve_with(bin, backend, None)
}

/// [`serve`] with a shared secret (from `FERRY_SECRET`).
fn serve_with(bin: &Path, backend: &str, secret: Option<&str>) -> Serve {
    let mut c = cmd(bin);
    if let Some(s) = secret {
        c.env("FERRY_SECRET", s);
    }
    let mut child = c
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

/// What the new build must report against an old one of `version`.
fn expect_negotiated(report: &str, version: u16) {
    assert!(
        report.contains(&format!("version in use: {version}")),
        "{report}"
    );
    assert!(report.contains("does not negotiate"), "{report}");
    let on: &[&str] = match version {
        5 => &["same-host", "control-channel", "staging-area", "ack-lane"],
        _ => &["same-host", "control-channel"],
    };
    for f in ["same-host", "control-channel", "staging-area", "ack-lane"] {
        let line = report
            .lines()
            .find(|l| l.split_whitespace().next() == Some(f))
            .unwrap_or_else(|| panic!("{f} in {report}"));
        if on.contains(&f) {
            assert_eq!(line.split_whitespace().nth(1), Some("on"), "{report}");
        } else {
            assert!(line.contains("off: the peer lacks it"), "{report}");
        }
    }
    let path = if version >= 5 {
        "path: same-host staged"
    } else {
        "path: same-host cma"
    };
    assert!(report.contains(path), "{report}");
}

/// One direction: `server` serves, `client` benches and asks `caps`, on
/// the same-host path and on the socket. `old_version`: the protocol of
/// the old build of the pair; `client_is_new`: which one is the client.
fn pair(server: &Path, client: &Path, client_is_new: bool, old_version: u16) {
    let s = serve(server, "tcp://127.0.0.1:0");
    // Same host: a new initiator gets the same-host path from an old
    // target; a new target refuses it to an old initiator, which cannot
    // prove its credentials (same-host-cred, issue 41), with one generic
    // refusal (code 8, unknown to the old build): the pair uses the socket.
    let report = caps(client, &s, "tcp://127.0.0.1:0");
    if client_is_new {
        assert!(
            report.contains(&format!("peer {}: path: cma", s.segment)),
            "{report}"
        );
        expect_negotiated(&report, old_version);
    } else {
        assert!(
            report.contains(&format!(
                "peer {}: path: tcp (refused by the peer (code 8",
                s.segment
            )),
            "{report}"
        );
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
    let Some(old) = old_or_skip("old_serve_new_bench", PINNED) else {
        return;
    };
    pair(&old, &new_ferry(), true, 5);
}

#[test]
fn new_serve_old_bench() {
    let Some(old) = old_or_skip("new_serve_old_bench", PINNED) else {
        return;
    };
    pair(&new_ferry(), &old, false, 5);
}

#[test]
fn v4_serve_new_bench() {
    let Some(old) = old_or_skip("v4_serve_new_bench", PINNED_V4) else {
        return;
    };
    pair(&old, &new_ferry(), true, 4);
}

#[test]
fn new_serve_v4_bench() {
    let Some(old) = old_or_skip("new_serve_v4_bench", PINNED_V4) else {
        return;
    };
    pair(&new_ferry(), &old, false, 4);
}

#[test]
fn authenticated_pairs_prove_themselves_across_versions() {
    let Some(old) = old_or_skip("authenticated_pairs", PINNED) else {
        return;
    };
    let new = new_ferry();
    for (server, client) in [(&old, &new), (&new, &old)] {
        let s = serve_with(server, "tcp://127.0.0.1:0", Some("s3cret"));
        bench(client, &s, "tcp://127.0.0.1:0?secret=s3cret");
        let out = cmd(client)
            .args(["caps", "--backend", "tcp://127.0.0.1:0?secret=wrong"])
            .args(["--peer", &s.segment])
            .output()
            .expect("ferry caps");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && err.contains("authentication"),
            "a wrong secret is refused: {err}"
        );
        stop(s);
    }
}

#[test]
fn tls_records_interoperate_with_the_rustls_build_both_ways() {
    let Some(old) = old_or_skip("tls_records_interoperate", PINNED_TLS) else {
        return;
    };
    let new = new_ferry();
    let tls = "tcp://127.0.0.1:0?secret=s3cret&same_host=off&tls=require";
    for (server, client) in [(&old, &new), (&new, &old)] {
        let s = serve_with(
            server,
            "tcp://127.0.0.1:0?same_host=off&tls=require",
            Some("s3cret"),
        );
        // Every point is read back and compared (4 KiB and 1 MiB, writes
        // and reads: records cut by either side's rules).
        bench(client, &s, tls);
        let report = caps(client, &s, tls);
        assert!(report.contains("on: TLS13_"), "TLS ran: {report}");
        stop(s);
    }
}

#[test]
fn the_pinned_builds_are_older() {
    let Some(old) = old_or_skip("the_pinned_builds_are_older", PINNED) else {
        return;
    };
    // The old builds announce one protocol version; this one a range.
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

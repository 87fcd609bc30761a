//! Ferry against **real** Mooncake Transfer Engine builds.
//!
//! `FERRY_MOONCAKE_REAL_LIBS=/path/a/libtransfer_engine.so[,/path/b/…]`
//! names C-API libraries built from Mooncake's sources (see
//! `crates/ferry-mooncake/README.md`, "Real builds"). For each library,
//! these tests run:
//!
//! - the whole conformance suite, raw and through the adapter, with the
//!   URL's defaults (`P2PHANDSHAKE` where the build has it, else a
//!   `ferry metadata-server` on loopback);
//! - `ferry serve` in one process driven by the `ferry bench --peer` command
//!   it prints, in another;
//! - the `kv_handoff` example, where the build has notifications.
//!
//! Without the variable every test prints `skipped: …` with the reason; with
//! it set nothing skips: a library that cannot be loaded fails the test.
//! CI cannot build Mooncake, so it does not set the variable.

use ferry_core::DynTransferEngine;
use std::panic::AssertUnwindSafe;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use ferry::mooncake::{Generation, MooncakeConfig, MooncakeEngine, MooncakeLibrary};
use ferry::{Result, TransferEngine};
use ferry_core::conformance::{report_skip, run_check, EngineFactory, Outcome, CHECKS};

#[allow(dead_code)]
#[path = "../../ferry/examples/kv_handoff.rs"]
mod kv_handoff;

mod common;
use common::Proc;

/// The variable naming the real libraries.
const REAL_LIBS_ENV: &str = "FERRY_MOONCAKE_REAL_LIBS";

/// The libraries to test, or `None` after printing the skip line.
fn real_libs(test: &str) -> Option<Vec<PathBuf>> {
    match std::env::var(REAL_LIBS_ENV) {
        Ok(v) if !v.trim().is_empty() => Some(
            v.split(',')
                .map(str::trim)
                .filter(|p| !p.is_empty())
                .map(PathBuf::from)
                .collect(),
        ),
        _ => {
            report_skip(&format!(
                "{test}: {REAL_LIBS_ENV} names no real Mooncake library (build them with \
                 shared/tools/mooncake-capi.sh; see crates/ferry-mooncake/README.md)"
            ));
            None
        }
    }
}

/// The generation of `lib`, from its symbols.
fn generation(lib: &Path) -> Generation {
    // SAFETY: the test runs code from a library its operator named in
    // FERRY_MOONCAKE_REAL_LIBS on purpose: a Mooncake C-API build.
    let loaded = unsafe { MooncakeLibrary::load(lib) };
    loaded
        .unwrap_or_else(|e| panic!("{}: cannot load it: {e}", lib.display()))
        .generation()
}

fn ferry() -> Command {
    let mut c = common::ferry();
    // Metadata-server mode on ≥ v0.3.0 announces MC_TCP_BIND_ADDRESS (else
    // the first LAN address): keep every byte on loopback.
    c.env("MC_TCP_BIND_ADDRESS", "127.0.0.1");
    c
}

/// `ferry metadata-server` on a free loopback port; its URL.
fn metadata_server() -> (Proc, String) {
    let mut cmd = ferry();
    cmd.args(["metadata-server", "--listen", "127.0.0.1:0"]);
    let mut p = Proc::spawn(cmd);
    let url = p.line_after("metadata server listening on ");
    (p, url)
}

/// The URL a user would write for `lib`: the defaults, plus a metadata
/// server where the build has no `P2PHANDSHAKE`.
fn url_for(lib: &Path, metadata: Option<&str>) -> String {
    match metadata {
        Some(m) => format!("mooncake://?lib={}&metadata={m}", lib.display()),
        None => format!("mooncake://?lib={}", lib.display()),
    }
}

/// Raw engines (no adapter: the suite adds it for the adapted runs).
struct RealFactory {
    url: String,
    p2p: bool,
}

#[async_trait::async_trait]
impl EngineFactory for RealFactory {
    async fn create(&self) -> Result<Arc<dyn DynTransferEngine>> {
        let cfg = MooncakeConfig::from_url(&self.url)?;
        // SAFETY: the libraries FERRY_MOONCAKE_REAL_LIBS names are Mooncake
        // C-API builds, chosen by whoever runs the test.
        Ok(Arc::new(unsafe { MooncakeEngine::start(cfg) }.await?))
    }

    fn unknown_segment_name(&self) -> String {
        if self.p2p {
            let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
            let a = l.local_addr().expect("addr");
            drop(l);
            a.to_string()
        } else {
            "ferry-real-no-such-segment".to_owned()
        }
    }
}

fn panic_text(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<String>()
        .cloned()
        .or_else(|| p.downcast_ref::<&str>().map(|s| (*s).to_owned()))
        .unwrap_or_else(|| "(no message)".to_owned())
}

#[test]
fn conformance_suite_on_every_real_build() {
    let Some(libs) = real_libs("conformance_suite_on_every_real_build") else {
        return;
    };
    // Metadata-server mode on ≥ v0.3.0 engines in this process: loopback.
    std::env::set_var("MC_TCP_BIND_ADDRESS", "127.0.0.1");
    // A real library named here must run: an engine that cannot start fails
    // the check instead of skipping it.
    std::env::set_var(ferry_core::conformance::REQUIRE_BACKENDS_ENV, "mooncake");
    let mut failures = Vec::new();
    for lib in &libs {
        let gen = generation(lib);
        let p2p = gen >= Generation::V0_3_0;
        let server = (!p2p).then(metadata_server);
        let url = url_for(lib, server.as_ref().map(|(_, u)| u.as_str()));
        let factory: Arc<dyn EngineFactory> = Arc::new(RealFactory {
            url: url.clone(),
            p2p,
        });
        let (mut passed, mut skipped) = (0, 0);
        for adapted in [false, true] {
            let mode = if adapted { "adapted" } else { "raw" };
            for name in CHECKS {
                let rt = tokio::runtime::Builder::new_multi_thread()
                    .worker_threads(2)
                    .enable_all()
                    .build()
                    .expect("runtime");
                let f = Arc::clone(&factory);
                let got = std::panic::catch_unwind(AssertUnwindSafe(|| {
                    rt.block_on(run_check(name, f, adapted))
                }));
                match got {
                    Ok(Outcome::Passed) => passed += 1,
                    Ok(Outcome::Skipped(why)) => {
                        skipped += 1;
                        report_skip(&format!("{} {gen} {name} ({mode}): {why}", lib.display()));
                    }
                    Err(p) => failures.push(format!(
                        "{} ({gen}) {name} ({mode}): {}",
                        lib.display(),
                        panic_text(&*p)
                    )),
                }
            }
        }
        eprintln!(
            "real build {} ({gen}, {}): conformance {passed} passed, {skipped} skipped \
             (capabilities the build lacks), {} failed of {}",
            lib.display(),
            if p2p {
                "P2PHANDSHAKE"
            } else {
                "metadata server"
            },
            2 * CHECKS.len() - passed - skipped,
            2 * CHECKS.len()
        );
    }
    assert!(
        failures.is_empty(),
        "{} conformance checks failed on real builds:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

#[test]
fn serve_and_bench_peer_across_processes_on_every_real_build() {
    let Some(libs) = real_libs("serve_and_bench_peer_across_processes_on_every_real_build") else {
        return;
    };
    for lib in &libs {
        let gen = generation(lib);
        let server = (gen < Generation::V0_3_0).then(metadata_server);
        let url = url_for(lib, server.as_ref().map(|(_, u)| u.as_str()));
        let mut cmd = ferry();
        cmd.args(["serve", "--size", "8MiB", "--backend", &url]);
        let mut serve = Proc::spawn(cmd);
        let drive = serve.line_after("drive it with: ");
        let words: Vec<String> = drive
            .split_whitespace()
            .map(|w| w.trim_matches('\'').to_owned())
            .collect();
        assert_eq!(&words[..2], ["ferry", "bench"], "{drive}");
        let mut bench = ferry();
        bench.args(&words[1..]).args([
            "--json",
            "--no-baselines",
            "--blocks",
            "4KiB,1MiB",
            "--batches",
            "1,8",
            "--duration",
            "200ms",
            "--warmup",
            "20ms",
        ]);
        let out = bench.output().expect("run ferry bench");
        assert!(
            out.status.success(),
            "{} ({gen}): `{drive}` failed: {}",
            lib.display(),
            String::from_utf8_lossy(&out.stderr)
        );
        let v: serde_json::Value =
            serde_json::from_slice(&out.stdout).expect("bench --json output");
        let points = v.as_array().expect("an array of points");
        assert!(!points.is_empty(), "{}: no points", lib.display());
        for p in points {
            assert_eq!(p["verified"], true, "{} ({gen}): {p}", lib.display());
        }
        let summary: Vec<String> = points
            .iter()
            .map(|p| {
                format!(
                    "{} {}×{}: {} GB/s",
                    p["op"], p["block"], p["batch"], p["gbps"]
                )
            })
            .collect();
        eprintln!(
            "real build {} ({gen}): serve + bench --peer: {}",
            lib.display(),
            summary.join("; ")
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_handoff_on_every_real_build_with_notifications() {
    let Some(libs) = real_libs("kv_handoff_on_every_real_build_with_notifications") else {
        return;
    };
    for lib in &libs {
        let gen = generation(lib);
        let server = (gen < Generation::V0_3_0).then(metadata_server);
        let url = url_for(lib, server.as_ref().map(|(_, u)| u.as_str()));
        let engine = ferry::Engine::open(&url)
            .await
            .unwrap_or_else(|e| panic!("{} ({gen}): {e}", lib.display()));
        let report = engine.report();
        drop(engine);
        if !report.effective.notify {
            // The build cannot notify: the hand-off must be refused up front,
            // saying why and which release fixes it.
            let ferry::Support::Unsupported(why) = report.support(ferry::Operation::Notify) else {
                panic!(
                    "{} ({gen}): notify neither available nor unsupported",
                    lib.display()
                );
            };
            assert!(why.min_version.is_some(), "{}: {why}", lib.display());
            let e = kv_handoff::run(&url)
                .await
                .expect_err("kv_handoff on a build without notifications");
            assert!(
                matches!(
                    e,
                    ferry::Error::MissingCapabilities { .. } | ferry::Error::Unsupported { .. }
                ),
                "{} ({gen}): kv_handoff failed otherwise: {e}",
                lib.display()
            );
            eprintln!(
                "real build {} ({gen}): kv_handoff refused up front as it must: {e}",
                lib.display()
            );
            continue;
        }
        let s = kv_handoff::run(&url)
            .await
            .unwrap_or_else(|e| panic!("{} ({gen}): kv_handoff failed: {e}", lib.display()));
        assert_eq!(s.notification.name, "prefill-0", "{}", lib.display());
        eprintln!(
            "real build {} ({gen}): kv_handoff {} requests, every byte checked",
            lib.display(),
            s.requests
        );
    }
}

/// A `ferry serve` peer in its own process: its segment and region.
struct ServedPeer {
    proc: Proc,
    segment: String,
    addr: u64,
    len: u64,
}

fn serve_peer(url: &str, size: &str) -> ServedPeer {
    let mut cmd = ferry();
    cmd.args([
        "serve",
        "--size",
        size,
        "--raw-listen",
        "off",
        "--backend",
        url,
    ]);
    let mut proc = Proc::spawn(cmd);
    let drive = proc.line_after("drive it with: ");
    let words: Vec<&str> = drive.split_whitespace().collect();
    let after = |flag: &str| {
        let i = words.iter().position(|w| *w == flag).expect(flag);
        words[i + 1].trim_matches('\'').to_owned()
    };
    let addr = u64::from_str_radix(after("--remote-addr").trim_start_matches("0x"), 16)
        .expect("--remote-addr");
    let len = after("--remote-len").parse().expect("--remote-len");
    ServedPeer {
        segment: after("--peer"),
        addr,
        len,
        proc,
    }
}

fn signal(p: &Proc, sig: &str) {
    let ok = Command::new("kill")
        .args([sig, &p.child.id().to_string()])
        .status()
        .expect("run kill")
        .success();
    assert!(ok, "kill {sig} failed");
}

/// Liveness bound for the error paths: a deadline plus generous slack (the
/// machines are shared; this catches hangs, it does not time anything).
const HANG: Duration = Duration::from_secs(60);

async fn bounded<T>(what: &str, f: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(HANG, f)
        .await
        .unwrap_or_else(|_| panic!("{what}: no answer within {HANG:?} (a hang)"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn error_paths_against_a_peer_process_on_every_real_build() {
    let Some(libs) = real_libs("error_paths_against_a_peer_process_on_every_real_build") else {
        return;
    };
    std::env::set_var("MC_TCP_BIND_ADDRESS", "127.0.0.1");
    for lib in &libs {
        let gen = generation(lib);
        let server = (gen < Generation::V0_3_0).then(metadata_server);
        let base = url_for(lib, server.as_ref().map(|(_, u)| u.as_str()));
        let url = format!("{base}&timeout_ms=3000");
        let what = |s: &str| format!("{} ({gen}): {s}", lib.display());
        let engine = ferry::Engine::open(&url)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        let report = engine.report();
        const LEN: usize = 4 << 20;
        let buf = ferry::HostBuffer::new(LEN).expect("buffer");
        let pattern: Vec<u8> = (0..LEN).map(|i| (i * 7 + 3) as u8).collect();
        // SAFETY: `buf` is LEN bytes, ours, not yet registered.
        unsafe { std::ptr::copy_nonoverlapping(pattern.as_ptr(), buf.as_ptr(), LEN) };
        engine
            // SAFETY: the buffer outlives its registration (unregistered below, before it is dropped).
            .register(unsafe { buf.region(ferry::Location::cpu(0)) })
            .await
            .unwrap_or_else(|e| panic!("{}", what(&format!("register: {e}"))));

        // Unknown segment: a typed error, no hang.
        let unknown = if gen >= Generation::V0_3_0 {
            let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
            let a = l.local_addr().expect("addr").to_string();
            drop(l);
            a
        } else {
            "ferry-real-no-such-segment".to_owned()
        };
        let r = bounded(&what("open unknown segment"), engine.open_segment(&unknown)).await;
        assert!(
            r.is_err(),
            "{}",
            what(&format!("opening {unknown} succeeded"))
        );
        eprintln!(
            "{}",
            what(&format!("unknown segment refused: {}", r.unwrap_err()))
        );

        // A peer process with 8 MiB registered.
        let peer = serve_peer(&base, "8MiB");
        let seg = bounded(&what("open peer"), engine.open_segment(&peer.segment))
            .await
            .unwrap_or_else(|e| panic!("{}", what(&format!("open {}: {e}", peer.segment))));
        let write = |remote: u64, len: u64| ferry::TransferRequest::write(buf.addr(), remote, len);
        bounded(
            &what("write in region"),
            engine.transfer(seg, write(peer.addr, LEN as u64)),
        )
        .await
        .unwrap_or_else(|e| panic!("{}", what(&format!("write inside the region: {e}"))));

        // Unmapped peer address: refused or failed, never "completed".
        let r = bounded(
            &what("unmapped write"),
            engine.transfer(seg, write(0x1000, 4096)),
        )
        .await;
        assert!(
            r.is_err(),
            "{}",
            what("a write to unmapped peer memory completed")
        );
        std::thread::sleep(Duration::from_millis(500));
        let mut peer = peer;
        let mut seg = seg;
        if let Ok(Some(st)) = peer.proc.child.try_wait() {
            // Mooncake v0.3.6–v0.3.8 log a failed TCP session's address as
            // a C string, so the peer itself crashes (fixed in v0.3.9); the
            // capability report says so. Any other build must survive.
            assert_eq!(
                gen,
                Generation::V0_3_6,
                "{}",
                what(&format!(
                    "the peer died after a write to unmapped memory: {st}"
                ))
            );
            assert!(
                report.to_string().contains("crashes the peer"),
                "{}",
                what("the report does not warn that bad addresses crash the peer")
            );
            eprintln!(
                "{}",
                what(&format!(
                    "the peer crashed ({st}), as this build does; restarting it"
                ))
            );
            let _ = engine.close_segment(seg).await;
            peer = serve_peer(&base, "8MiB");
            seg = bounded(&what("open peer"), engine.open_segment(&peer.segment))
                .await
                .unwrap_or_else(|e| panic!("{}", what(&format!("open {}: {e}", peer.segment))));
            bounded(
                &what("write in region"),
                engine.transfer(seg, write(peer.addr, LEN as u64)),
            )
            .await
            .unwrap_or_else(|e| panic!("{}", what(&format!("write inside the region: {e}"))));
        }
        eprintln!(
            "{}",
            what(&format!(
                "write to unmapped peer memory: {}",
                r.unwrap_err()
            ))
        );

        // Mapped but outside the region: only builds that check addresses
        // at the peer can refuse it; the others must say so.
        if report.effective.peer_validation {
            let past = peer.addr + peer.len;
            let r = bounded(
                &what("out-of-region write"),
                engine.transfer(seg, write(past, 64)),
            )
            .await;
            assert!(r.is_err(), "{}", what("a write past the region completed"));
            eprintln!(
                "{}",
                what(&format!("write past the region: {}", r.unwrap_err()))
            );
        } else {
            match report.support(ferry::Operation::PeerValidation) {
                ferry::Support::Unsupported(m) => assert_eq!(
                    m.min_version.as_deref(),
                    Some("Mooncake v0.3.12"),
                    "{}",
                    what("peer validation reason")
                ),
                other => panic!("{}", what(&format!("peer validation: {other:?}"))),
            }
            eprintln!("{}", what("peer address validation: no, as reported"));
        }
        // The region still holds what was written (read back).
        let back = ferry::HostBuffer::new(LEN).expect("buffer");
        engine
            // SAFETY: the buffer outlives its registration (unregistered below, before it is dropped).
            .register(unsafe { back.region(ferry::Location::cpu(0)) })
            .await
            .expect("register");
        let read = ferry::TransferRequest::read(back.addr(), peer.addr, LEN as u64);
        bounded(&what("read back"), engine.transfer(seg, read))
            .await
            .unwrap_or_else(|e| panic!("{}", what(&format!("read back: {e}"))));
        // SAFETY: `back` is LEN bytes, the read finished.
        let got = unsafe { std::slice::from_raw_parts(back.as_ptr(), LEN) };
        assert!(got == &pattern[..], "{}", what("peer region changed"));

        // Frozen peer: the deadline (3 s) gives a typed error.
        signal(&peer.proc, "-STOP");
        let started = std::time::Instant::now();
        let r = bounded(
            &what("frozen peer"),
            engine.transfer(seg, write(peer.addr, LEN as u64)),
        )
        .await;
        signal(&peer.proc, "-CONT");
        assert!(r.is_err(), "{}", what("a write to a frozen peer completed"));
        eprintln!(
            "{}",
            what(&format!(
                "frozen peer: {} after {:?}",
                r.unwrap_err(),
                started.elapsed()
            ))
        );

        // Peer killed mid-batch: every request answers, none hangs.
        let reqs: Vec<ferry::TransferRequest> = (0..8)
            .map(|i| {
                let off = (i % 2) * (LEN as u64);
                ferry::TransferRequest::write(buf.addr(), peer.addr + off, LEN as u64)
            })
            .collect();
        let id = engine.submit(seg, &reqs, None).await.expect("submit");
        std::thread::sleep(Duration::from_millis(2));
        let _ = peer.proc.child.kill();
        let _ = peer.proc.child.wait();
        let report = bounded(&what("batch after peer killed"), engine.wait(id))
            .await
            .unwrap_or_else(|e| panic!("{}", what(&format!("wait: {e}"))));
        let failed = report.results.iter().filter(|r| r.is_err()).count();
        eprintln!(
            "{}",
            what(&format!(
                "peer killed mid-batch: {failed} of {} requests failed, the rest landed before",
                reqs.len()
            ))
        );
        // After the peer is gone, new transfers fail with a typed error.
        let r = bounded(
            &what("after kill"),
            engine.transfer(seg, write(peer.addr, 4096)),
        )
        .await;
        assert!(r.is_err(), "{}", what("a write to a dead peer completed"));
        engine.unregister(back.addr()).await.expect("unregister");
        engine.unregister(buf.addr()).await.expect("unregister");
    }
}

/// Which builds' TCP transports send data to the same place (the test's own
/// statement of the matrix in the backend's README, "Mixed builds"): v0.2.x
/// to the RPC port, v0.3.0–v0.3.4 to the RPC port + 1, v0.3.5 and later to
/// the `tcp_data_port` they publish.
fn wire_family(g: Generation) -> u8 {
    match g {
        Generation::V0_2_0 => 0,
        Generation::V0_3_0 => 1,
        _ => 2,
    }
}

/// How the refusal names a peer of generation `g`.
fn wire_releases(g: Generation) -> &'static str {
    match g {
        Generation::V0_2_0 => "Mooncake v0.2.x",
        Generation::V0_3_0 => "Mooncake v0.3.0–v0.3.4",
        Generation::V0_3_12 => "Mooncake v0.3.12 or later",
        _ => "Mooncake v0.3.5–v0.3.11",
    }
}

/// Wall-clock bound of one `ferry bench` of the matrix (its batches have a
/// 5 s deadline): beyond it the pair is recorded as a hang.
const PAIR_BOUND: Duration = Duration::from_secs(120);

/// The outcome of one `ferry bench --peer` run.
struct PairRun {
    success: bool,
    stdout: Vec<u8>,
    stderr: String,
    elapsed: Duration,
    hung: bool,
}

fn run_bounded(mut cmd: Command) -> PairRun {
    let started = std::time::Instant::now();
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn ferry bench");
    let mut out = child.stdout.take().expect("stdout");
    let mut err = child.stderr.take().expect("stderr");
    let o = std::thread::spawn(move || {
        let mut v = Vec::new();
        let _ = std::io::Read::read_to_end(&mut out, &mut v);
        v
    });
    let e = std::thread::spawn(move || {
        let mut v = Vec::new();
        let _ = std::io::Read::read_to_end(&mut err, &mut v);
        v
    });
    let mut hung = false;
    let status = loop {
        if let Some(st) = child.try_wait().expect("wait ferry bench") {
            break st;
        }
        if started.elapsed() > PAIR_BOUND {
            hung = true;
            let _ = child.kill();
            break child.wait().expect("reap ferry bench");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let elapsed = started.elapsed();
    PairRun {
        success: status.success() && !hung,
        stdout: o.join().unwrap_or_default(),
        stderr: String::from_utf8_lossy(&e.join().unwrap_or_default()).into_owned(),
        elapsed,
        hung,
    }
}

/// The last `error: …` line of a failed run, or its last line.
fn error_line(stderr: &str) -> String {
    let lines: Vec<&str> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
    lines
        .iter()
        .rev()
        .find(|l| l.starts_with("error"))
        .or(lines.last())
        .map_or_else(|| "(no output)".to_owned(), |l| (*l).to_owned())
}

/// Every ordered pair of the real builds: `ferry serve` of one (the target)
/// and `ferry bench --peer` of another (the initiator), each Ferry's
/// Mooncake backend in its own process, writes and reads byte-checked.
/// `P2PHANDSHAKE` where both builds have it, else one `ferry metadata-server`
/// for both. Builds of one wire family must exchange bytes; builds of
/// different families must be refused by `open_segment` fast, with an error
/// naming both generations. With `FERRY_MOONCAKE_PEER_CHECK=0` (the check
/// off) incompatible pairs are only recorded, to show what the library does
/// on its own.
#[test]
fn mixed_builds_serve_and_bench_peer_every_pair() {
    let Some(libs) = real_libs("mixed_builds_serve_and_bench_peer_every_pair") else {
        return;
    };
    let checking = std::env::var("FERRY_MOONCAKE_PEER_CHECK").map_or(true, |v| v != "0");
    let gens: Vec<Generation> = libs.iter().map(|l| generation(l)).collect();
    let label = |i: usize| {
        let name = libs[i].parent().and_then(Path::file_name).map_or_else(
            || libs[i].display().to_string(),
            |n| n.to_string_lossy().into_owned(),
        );
        format!("{name} ({})", gens[i])
    };
    let mut cells = Vec::new();
    let mut failures = Vec::new();
    for t in 0..libs.len() {
        for i in 0..libs.len() {
            let (gt, gi) = (gens[t], gens[i]);
            let p2p = gt >= Generation::V0_3_0 && gi >= Generation::V0_3_0;
            let server = (!p2p).then(metadata_server);
            let md = server.as_ref().map(|(_, u)| u.as_str());
            let peer = serve_peer(&url_for(&libs[t], md), "8MiB");
            let bench_run = |ops: &str, blocks: &str, batches: &str| {
                let mut bench = ferry();
                bench.args([
                    "bench",
                    "--peer",
                    &peer.segment,
                    "--remote-addr",
                    &format!("{:#x}", peer.addr),
                    "--remote-len",
                    &peer.len.to_string(),
                    "--backend",
                    &format!("{}&timeout_ms=5000", url_for(&libs[i], md)),
                    "--json",
                    "--no-baselines",
                    "--ops",
                    ops,
                    "--blocks",
                    blocks,
                    "--batches",
                    batches,
                    "--duration",
                    "200ms",
                    "--warmup",
                    "20ms",
                ]);
                // Mooncake's log lines (glog, on stderr) would interleave
                // with the bench's error message.
                if std::env::var_os("FERRY_REAL_PEER_LOGS").is_none() {
                    bench.env("GLOG_minloglevel", "3");
                }
                run_bounded(bench)
            };
            let run = bench_run("write,read", "4KiB,1MiB", "1,8");
            let pair = format!(
                "target {} <- initiator {} ({})",
                label(t),
                label(i),
                if p2p {
                    "P2PHANDSHAKE"
                } else {
                    "metadata server"
                }
            );
            // The bench notifies the peer after each point it verified; a
            // TCP engine of v0.3.5–v0.3.7 rejects notifications. Then every
            // point is run on its own: verified, then the notification
            // refused, is bytes exchanged.
            let notify_refused = |r: &PairRun| {
                !r.success
                    && r.stderr.contains("sending the end-of-point notification")
                    && r.stderr.contains("genNotifyInEngine")
            };
            let mut data_ok = run.success;
            let cell = if run.success {
                let v: serde_json::Value =
                    serde_json::from_slice(&run.stdout).unwrap_or(serde_json::Value::Null);
                let points = v.as_array().cloned().unwrap_or_default();
                let unverified = points.iter().filter(|p| p["verified"] != true).count();
                if points.is_empty() || unverified > 0 {
                    data_ok = false;
                    failures.push(format!(
                        "{pair}: {unverified} of {} points not verified",
                        points.len()
                    ));
                }
                format!("works ({} points verified)", points.len() - unverified)
            } else if notify_refused(&run) {
                let mut verified = 0;
                let mut other = Vec::new();
                for op in ["write", "read"] {
                    for block in ["4KiB", "1MiB"] {
                        for batch in ["1", "8"] {
                            let r = bench_run(op, block, batch);
                            if r.success || notify_refused(&r) {
                                verified += 1;
                            } else {
                                other.push(format!(
                                    "{op} {block}×{batch}: {}",
                                    error_line(&r.stderr)
                                ));
                            }
                        }
                    }
                }
                data_ok = other.is_empty();
                if !data_ok {
                    failures.push(format!("{pair}: points failed: {}", other.join("; ")));
                }
                format!(
                    "bytes move ({verified} of 8 points verified); the end-of-point \
                     notification is refused: {}",
                    error_line(&run.stderr)
                )
            } else if run.hung {
                format!("hangs (killed after {:?})", run.elapsed)
            } else {
                format!(
                    "fails after {:.1?}: {}",
                    run.elapsed,
                    error_line(&run.stderr)
                )
            };
            // A ≥ v0.3.12 initiator and a v0.3.5–v0.3.11 target: the target
            // neither acknowledges writes nor checks addresses, so the
            // initiator must confirm its writes (and say so), and a refused
            // notification must say why.
            if gi >= Generation::V0_3_12 && (Generation::V0_3_5..Generation::V0_3_12).contains(&gt)
            {
                if !run
                    .stderr
                    .contains("Ferry confirms writes to it by reading them back")
                {
                    failures.push(format!(
                        "{pair}: the initiator did not say it confirms writes to the older peer"
                    ));
                }
                if notify_refused(&run) && !run.stderr.contains("rejected the notification") {
                    failures.push(format!(
                        "{pair}: the notification refusal does not say why: {cell}"
                    ));
                }
            }
            let compatible = wire_family(gt) == wire_family(gi);
            if compatible && !data_ok {
                failures.push(format!("{pair}: builds of one family must work: {cell}"));
            }
            if !compatible && checking {
                let e = &run.stderr;
                let named = e.contains("protocol error")
                    && e.contains(&format!("this engine is {}", gi.mooncake_version()))
                    && e.contains(&format!("the peer is {}", wire_releases(gt)));
                if run.success || !named || run.elapsed > Duration::from_secs(30) {
                    failures.push(format!(
                        "{pair}: must be refused fast, naming both generations: {cell}"
                    ));
                }
            }
            eprintln!("mixed builds: {pair}: {cell}");
            cells.push((t, i, cell));
            // The target must have survived its peer.
            let mut peer = peer;
            if let Ok(Some(st)) = peer.proc.child.try_wait() {
                eprintln!("mixed builds: {pair}: the target exited: {st}");
            }
        }
    }
    eprintln!("mixed builds matrix (rows: target, columns: initiator):");
    for t in 0..libs.len() {
        let row: Vec<String> = (0..libs.len())
            .map(|i| {
                cells
                    .iter()
                    .find(|(a, b, _)| *a == t && *b == i)
                    .map_or_else(String::new, |(_, _, c)| c.clone())
            })
            .collect();
        eprintln!("| {} | {} |", label(t), row.join(" | "));
    }
    assert!(
        failures.is_empty(),
        "mixed builds:\n{}",
        failures.join("\n")
    );
}

//! Ferry against **real** Mooncake Transfer Engine builds.
//!
//! `FERRY_MOONCAKE_REAL_LIBS=/path/a/libtransfer_engine.so[,/path/b/…]`
//! names C-API libraries built from Mooncake's sources (see
//! `crates/backend-mooncake/README.md`, "Real builds"). For each library,
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

use std::io::{BufRead, BufReader};
use std::panic::AssertUnwindSafe;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{mpsc, Arc};
use std::time::Duration;

use ferry::backend_mooncake::{Generation, MooncakeConfig, MooncakeEngine, MooncakeLibrary};
use ferry::conformance::{report_skip, run_check, EngineFactory, Outcome, CHECKS};
use ferry::{Result, TransferEngine};

#[allow(dead_code)]
#[path = "../../ferry/examples/kv_handoff.rs"]
mod kv_handoff;

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
                 shared/tools/mooncake-capi.sh; see crates/backend-mooncake/README.md)"
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
    let mut c = Command::new(env!("CARGO_BIN_EXE_ferry"));
    // Metadata-server mode on ≥ v0.3.0 announces MC_TCP_BIND_ADDRESS (else
    // the first LAN address): keep every byte on loopback.
    c.env("MC_TCP_BIND_ADDRESS", "127.0.0.1");
    c
}

/// A child process killed (and reaped) on drop, with its stdout as lines.
struct Proc {
    child: Child,
    lines: mpsc::Receiver<String>,
}

impl Proc {
    fn spawn(mut cmd: Command) -> Proc {
        let mut child = cmd
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn ferry");
        let stdout = child.stdout.take().expect("stdout");
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Proc { child, lines }
    }

    /// The rest of the first line starting with `prefix` (liveness bound of
    /// a minute: not a timing assertion).
    fn line_after(&self, prefix: &str) -> String {
        let mut seen = Vec::new();
        loop {
            let line = self
                .lines
                .recv_timeout(Duration::from_secs(60))
                .unwrap_or_else(|e| panic!("no line starting {prefix:?} ({e}); got {seen:?}"));
            if let Some(rest) = line.strip_prefix(prefix) {
                return rest.to_owned();
            }
            seen.push(line);
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `ferry metadata-server` on a free loopback port; its URL.
fn metadata_server() -> (Proc, String) {
    let mut cmd = ferry();
    cmd.args(["metadata-server", "--listen", "127.0.0.1:0"]);
    let p = Proc::spawn(cmd);
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
    async fn create(&self) -> Result<Arc<dyn TransferEngine>> {
        let cfg = MooncakeConfig::from_url(&self.url)?;
        Ok(Arc::new(MooncakeEngine::start(cfg).await?))
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
    std::env::set_var(ferry::conformance::REQUIRE_BACKENDS_ENV, "mooncake");
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
        let serve = Proc::spawn(cmd);
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
        if gen < Generation::V0_3_5 {
            // Not a skip of the backend: the build has no notifications,
            // which the capability tests check.
            eprintln!(
                "real build {} ({gen}): kv_handoff needs notifications (Mooncake v0.3.5)",
                lib.display()
            );
            continue;
        }
        let url = url_for(lib, None);
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

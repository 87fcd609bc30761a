//! A NIXL request that stays in progress fails at its batch's deadline, and
//! its memory stays registered (unregister waits) until NIXL reports the
//! request finished — on the real library, with a real stall: the target
//! is another process, UCX is restricted to its TCP transport (whose RMA
//! needs the target to make progress), and the target is stopped with
//! SIGSTOP while the write is in flight, then resumed with SIGCONT.
//!
//! The target process is this test binary itself, running the ignored
//! `child_target` test (`FERRY_NIXL_CHILD=1`).

mod common;

use ferry_core::DynTransferEngine;
use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ferry_core::conformance::skip_unavailable;
use ferry_core::{Error, HostBuffer, Location, RegisteredBuffer, TransferEngine, TransferRequest};

const CHILD_ENV: &str = "FERRY_NIXL_CHILD";
const LEN: usize = 64 << 20;

/// The target: an engine with one registered region of `LEN` bytes,
/// announced on stdout as `READY <segment> <addr>`; it runs until its
/// standard input closes.
#[test]
#[ignore = "helper process of stuck_request_fails_at_deadline_and_keeps_its_memory"]
fn child_target() {
    if std::env::var_os(CHILD_ENV).is_none() {
        return;
    }
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    rt.block_on(async {
        let e: Arc<dyn DynTransferEngine> = common::engine().await.expect("child engine");
        let buf = RegisteredBuffer::new(Arc::clone(&e), LEN)
            .await
            .expect("child register");
        println!("READY {} {}", e.segment_name(), buf.addr());
        std::io::stdout().flush().expect("flush");
        let _ = tokio::task::spawn_blocking(|| {
            let mut s = String::new();
            let _ = std::io::stdin().read_line(&mut s);
        })
        .await;
        buf.release().await.expect("child release");
    });
}

/// `f()` once it equals `want`, or its last value after 5 s.
async fn settle(f: impl Fn() -> usize, want: usize) -> usize {
    let start = Instant::now();
    loop {
        let v = f();
        if v == want || start.elapsed() > Duration::from_secs(5) {
            return v;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

fn signal(pid: u32, sig: &str) {
    let ok = Command::new("kill")
        .args([sig, &pid.to_string()])
        .status()
        .expect("running kill")
        .success();
    assert!(ok, "kill {sig} {pid} failed");
}

#[test]
fn stuck_request_fails_at_deadline_and_keeps_its_memory() {
    if let Err(e) = common::nixl_library() {
        skip_unavailable("stuck_request_fails_at_deadline_and_keeps_its_memory", &e);
        return;
    }
    // Only UCX's TCP transport, here and in the child: its RMA completes
    // only while the target progresses, so a stopped target stalls it.
    std::env::set_var("UCX_TLS", "tcp");
    let mut child = Command::new(std::env::current_exe().expect("test binary"))
        .args(["--ignored", "--exact", "child_target", "--nocapture"])
        .env(CHILD_ENV, "1")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawning the target process");
    let pid = child.id();
    let mut lines = BufReader::new(child.stdout.take().expect("stdout")).lines();
    let (segment, remote) = loop {
        let line = lines
            .next()
            .expect("the target process ended before announcing itself")
            .expect("reading the target's output");
        if let Some(rest) = line.strip_prefix("READY ") {
            let mut it = rest.split_whitespace();
            let seg = it.next().expect("segment").to_owned();
            let addr: u64 = it.next().expect("addr").parse().expect("addr number");
            break (seg, addr);
        }
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let outcome = rt.block_on(async {
        let mut cfg = common::config().expect("config");
        cfg.timeout = Duration::from_millis(300);
        cfg.timeout_ns_per_byte = 0;
        let nixl = Arc::new(common::start(cfg).await.expect("engine"));
        let a: Arc<dyn DynTransferEngine> = nixl.clone();
        let src = HostBuffer::new(LEN).expect("buffer");
        src.fill(0x5a);
        // SAFETY: `src` outlives its registration (unregistered below,
        // before it is dropped).
        let region = unsafe { src.region(Location::cpu(0)) };
        a.register(region).await.expect("register");
        let seg = a.open_segment(&segment).await.expect("open the child");
        // The path works while the target runs.
        a.transfer(seg, TransferRequest::write(src.addr(), remote, 4096))
            .await
            .expect("a small write to the running target");

        signal(pid, "-STOP");
        let started = Instant::now();
        let r = a
            .transfer(seg, TransferRequest::write(src.addr(), remote, LEN as u64))
            .await;
        let waited = started.elapsed();
        assert!(
            matches!(r, Err(Error::Timeout { .. })),
            "a write to a stopped target over UCX tcp should time out, got {r:?}"
        );
        assert!(
            waited >= Duration::from_millis(300),
            "failed early: {waited:?}"
        );
        // The poller counts held requests once per round.
        let held = settle(|| nixl.held_requests(), 1).await;
        assert_eq!(
            held, 1,
            "the timed-out request must be held until NIXL finishes it"
        );
        // Unregistering the source waits for the held request.
        let a2 = Arc::clone(&a);
        let addr = src.addr();
        let unreg = tokio::spawn(async move { a2.unregister(addr).await });
        tokio::time::sleep(Duration::from_millis(500)).await;
        let blocked = !unreg.is_finished();
        signal(pid, "-CONT");
        let unreg = tokio::time::timeout(Duration::from_secs(60), unreg).await;
        let held_after = settle(|| nixl.held_requests(), 0).await;
        a.close_segment(seg).await.expect("close");
        (blocked, unreg.map(|j| j.map(|r| r.is_ok())), held_after)
    });
    // Let the child finish whatever happens above.
    signal(pid, "-CONT");
    drop(child.stdin.take());
    let status = child.wait().expect("waiting for the target");
    let (blocked, unreg, held_after) = outcome;
    assert!(
        blocked,
        "unregister returned while NIXL still held a request on the region"
    );
    assert!(
        matches!(unreg, Ok(Ok(true))),
        "unregister did not succeed once the target resumed: {unreg:?}"
    );
    assert_eq!(
        held_after, 0,
        "the request was not released after it finished"
    );
    assert!(status.success(), "the target process failed: {status}");
}

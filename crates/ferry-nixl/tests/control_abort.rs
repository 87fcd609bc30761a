//! An initiator whose control connection is lost while a NIXL request is
//! in flight aborts it (the batch fails with `PeerLost`, the request's
//! memory stays registered), and the target does not take the lost
//! connection as "nothing in flight" (its `unregister` answers
//! `RegionHeld`) — on the real library, with a real request in flight: the
//! target is another process (this binary's ignored `child_target`,
//! `FERRY_NIXL_LOSS_CHILD=1`), UCX is restricted to its TCP transport, and
//! the target is stopped (SIGSTOP) while the write is in flight; the
//! control connection goes through a relay in the test, which resets it.

mod common;

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use ferry_core::conformance::skip_unavailable;
use ferry_core::{
    BatchReport, Error, HostBuffer, Location, MemoryRegion, TransferEngine, TransferRequest,
};
use tokio::net::{TcpListener, TcpStream};

const CHILD_ENV: &str = "FERRY_NIXL_LOSS_CHILD";
const LEN: usize = 64 << 20;

fn region(b: &HostBuffer) -> MemoryRegion {
    // SAFETY: every buffer of these tests outlives its registration, or is
    // leaked when it stays registered.
    unsafe { b.region(Location::cpu(0)) }
}

/// The target: an engine with one registered region of `LEN` bytes,
/// announced on stdout as `READY <segment> <addr>`; on the input line
/// `UNREG` it unregisters the region and prints `UNREG <outcome>`; it
/// ends when its standard input closes.
#[test]
#[ignore = "helper process of lost_control_connection_aborts_in_flight_requests"]
fn child_target() {
    if std::env::var_os(CHILD_ENV).is_none() {
        return;
    }
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    rt.block_on(async {
        let e = common::engine().await.expect("child engine");
        let buf = HostBuffer::new(LEN).expect("buffer");
        e.register(region(&buf)).await.expect("child register");
        println!("READY {} {}", e.segment_name(), buf.addr());
        std::io::stdout().flush().expect("flush");
        let mut held = false;
        loop {
            let line = tokio::task::spawn_blocking(|| {
                let mut s = String::new();
                std::io::stdin().read_line(&mut s).map(|n| (n, s))
            })
            .await
            .expect("stdin task");
            match line {
                Ok((n, s)) if n > 0 && s.trim() == "UNREG" => {
                    let r = e.unregister(buf.addr()).await;
                    held = matches!(r, Err(Error::RegionHeld { .. }));
                    let outcome = match r {
                        Ok(()) => "ok".to_owned(),
                        Err(Error::RegionHeld { .. }) => "held".to_owned(),
                        Err(other) => format!("error {other:?}"),
                    };
                    println!("UNREG {outcome}");
                    std::io::stdout().flush().expect("flush");
                }
                _ => break,
            }
        }
        drop(e);
        if held {
            // A peer may still write it: never freed.
            std::mem::forget(buf);
        }
    });
}

fn signal(pid: u32, sig: &str) {
    let ok = Command::new("kill")
        .args([sig, &pid.to_string()])
        .status()
        .expect("running kill")
        .success();
    assert!(ok, "kill {sig} {pid} failed");
}

/// A relay for one connection to `upstream`; resetting both sides when
/// `cut` fires.
async fn relay(upstream: String) -> (String, tokio::sync::oneshot::Sender<()>) {
    let l = TcpListener::bind("127.0.0.1:0").await.expect("relay bind");
    let addr = l.local_addr().expect("relay addr").to_string();
    let (cut, on_cut) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(async move {
        let (mut down, _) = l.accept().await.expect("relay accept");
        let mut up = TcpStream::connect(&upstream).await.expect("relay connect");
        down.set_zero_linger().expect("linger");
        up.set_zero_linger().expect("linger");
        tokio::select! {
            _ = tokio::io::copy_bidirectional(&mut down, &mut up) => {}
            _ = on_cut => {}
        }
        // Dropped with SO_LINGER 0: both ends see a reset.
    });
    (addr, cut)
}

#[test]
fn lost_control_connection_aborts_in_flight_requests() {
    if let Err(e) = common::nixl_library() {
        skip_unavailable("lost_control_connection_aborts_in_flight_requests", &e);
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
    let mut stdin = child.stdin.take().expect("stdin");
    let mut lines = BufReader::new(child.stdout.take().expect("stdout")).lines();
    let mut next_line = |prefix: &str| loop {
        let line = lines
            .next()
            .expect("the target process ended early")
            .expect("reading the target's output");
        if let Some(rest) = line.strip_prefix(prefix) {
            break rest.to_owned();
        }
    };
    let ready = next_line("READY ");
    let mut it = ready.split_whitespace();
    let segment = it.next().expect("segment").to_owned();
    let remote: u64 = it.next().expect("addr").parse().expect("addr number");

    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let (report, aborted, local_unreg) = rt.block_on(async {
        let mut cfg = common::config().expect("config");
        // Long enough that only an abort ends the write before it.
        cfg.timeout = Duration::from_secs(20);
        cfg.timeout_ns_per_byte = 0;
        let nixl = Arc::new(common::start(cfg).await.expect("engine"));
        let src = HostBuffer::new(LEN).expect("buffer");
        src.fill(0x5a);
        nixl.register(region(&src)).await.expect("register");
        let (via, cut) = relay(segment.clone()).await;
        let seg = nixl.open_segment(&via).await.expect("open the child");
        nixl.transfer(seg, TransferRequest::write(src.addr(), remote, 4096))
            .await
            .expect("a small write to the running target");

        signal(pid, "-STOP");
        let batch = nixl
            .submit(
                seg,
                &[TransferRequest::write(src.addr(), remote, LEN as u64)],
                None,
            )
            .await
            .expect("submit");
        // The control connection is reset while the write is in flight.
        let _ = cut.send(());
        let report: Result<ferry_core::Result<BatchReport>, _> =
            tokio::time::timeout(Duration::from_secs(60), nixl.wait(batch)).await;
        let aborted = nixl.aborted_requests();
        // Bounded: a request still held would make it wait until the
        // target resumes (below).
        let local_unreg =
            tokio::time::timeout(Duration::from_secs(5), nixl.unregister(src.addr())).await;
        drop(nixl);
        // Whatever happened, the source may still be read by UCX.
        std::mem::forget(src);
        (report, aborted, local_unreg)
    });
    signal(pid, "-CONT");
    writeln!(stdin, "UNREG").expect("asking the target to unregister");
    let target_unreg = next_line("UNREG ");
    drop(stdin);
    let status = child.wait().expect("waiting for the target");

    let mut wrong = Vec::new();
    match &report {
        Ok(Ok(r)) if matches!(r.results.first(), Some(Err(Error::PeerLost { .. }))) => {}
        other => wrong.push(format!(
            "the initiator did not abort its in-flight request when its control connection \
             was lost (want PeerLost): {other:?}"
        )),
    }
    if aborted != 1 {
        wrong.push(format!("aborted_requests() = {aborted}, want 1"));
    }
    if !matches!(local_unreg, Ok(Err(Error::RegionHeld { .. }))) {
        wrong.push(format!(
            "the initiator's source of an aborted request must stay registered: {local_unreg:?}"
        ));
    }
    if target_unreg != "held" {
        wrong.push(format!(
            "the target took a reset control connection as 'nothing in flight': its unregister \
             answered {target_unreg}, want held (RegionHeld)"
        ));
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
    assert!(status.success(), "the target process failed: {status}");
}

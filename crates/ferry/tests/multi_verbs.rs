//! `multi://` over a real verbs stack (issue 45, item 3; the design's §6):
//! multi engines of verbs (`FERRY_VERBS_URL`, default `verbs://`) and TCP
//! (the socket path on loopback), run on soft-RoCE in the guest of
//! `scripts/verbs-tests.sh`:
//!
//! - (a) against a TCP-only peer the multi engine goes over TCP and its
//!   report says so and why;
//! - (b) the link under the verbs device goes down during a batch of
//!   256 × 1 MiB writes: the batch finishes over TCP, every byte checked, the
//!   notification delivered once, and no byte of a request verbs reported
//!   failed lands later (the design's §8 question);
//! - (c) the link restored, after the back-off a later batch goes over verbs
//!   again;
//! - (d) a deadline shorter than the failover: a typed `Timeout`, and no
//!   byte of the destination changes once `unregister` returned.
//!
//! Without a verbs device (or without the `verbs` feature) each test prints
//! `skipped: <test>: … the verbs backend is unavailable …` and passes, unless
//! `FERRY_REQUIRE_BACKENDS` lists `verbs`. (b)-(d) take the link down
//! (`ip link set <netdev> down`): only with `FERRY_TEST_BREAK_LINK=1`, as
//! root (see `tests/rxe_link`), else they skip the same way.
#![cfg(feature = "tcp")]

#[path = "rxe_link/mod.rs"]
mod rxe_link;

use std::sync::Arc;
use std::time::{Duration, Instant};

use ferry::multi::MultiEngine;
use ferry::{
    Engine, Error, HostBuffer, Location, Notification, RegisteredBuffer, TransferEngine,
    TransferEngineExt, TransferRequest,
};
use ferry_core::conformance::{backend_required, report_skip, skip_unavailable};
use ferry_core::Inbound;
use rxe_link::Link;

const MIB: usize = 1 << 20;
/// TCP on loopback, the socket path: every byte crosses the socket.
const TCP: &str = "tcp://127.0.0.1:0?same_host=off";

/// One link under every test that takes it down.
static LINK: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn verbs_url() -> String {
    std::env::var("FERRY_VERBS_URL").unwrap_or_else(|_| "verbs://".to_owned())
}

/// A multi engine of verbs and TCP, verbs first; `None` (after printing
/// why) where verbs is unavailable and not required.
async fn verbs_and_tcp(test: &str) -> Option<Arc<Engine>> {
    match Engine::open_multi(&[&verbs_url(), TCP]).await {
        Ok(e) => Some(Arc::new(e)),
        Err(e) => {
            skip_unavailable(test, &e);
            None
        }
    }
}

/// The link under the verbs device, where this process may take it down;
/// else a skip (a failure where verbs is required).
fn link(test: &str) -> Option<Link> {
    match Link::find(&verbs_url()) {
        Ok(l) => Some(l),
        Err(why) if backend_required("verbs") => {
            panic!("{test}: FERRY_REQUIRE_BACKENDS lists verbs, but {why}")
        }
        Err(why) => {
            report_skip(&format!("{test}: {why}"));
            None
        }
    }
}

/// A line for the guest's log: standard error written directly, past the
/// harness's capture (the figures show in CI's log of a passing run).
fn say(line: &str) {
    use std::io::Write as _;
    let _ = writeln!(std::io::stderr().lock(), "{line}");
}

fn multi(e: &Engine) -> &MultiEngine {
    e.backend::<MultiEngine>().expect("a multi engine")
}

/// What the TCP transport of multi engine `e` (its second) has served.
fn tcp_inbound(e: &Engine) -> Inbound {
    let (scheme, tcp) = multi(e).transports().nth(1).expect("two transports");
    assert_eq!(scheme, "tcp");
    tcp.inbound().expect("TCP counts what it serves")
}

fn data(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) ^ (i >> 9) as u8)
        .collect()
}

/// `n` blocks of 1 MiB, each a copy of one pattern with its index written
/// over its first and last 8 bytes (cheap in a debug build under
/// emulation, and a block in the wrong place still shows).
fn blocks(n: usize, seed: u8) -> Vec<u8> {
    let one = data(MIB, seed);
    let mut all = Vec::with_capacity(n * MIB);
    for i in 0..n {
        let at = all.len();
        all.extend_from_slice(&one);
        let tag = (i as u64 + 1).to_le_bytes();
        all[at..at + 8].copy_from_slice(&tag);
        all[at + MIB - 8..at + MIB].copy_from_slice(&tag);
    }
    all
}

/// Whether every byte of `mem` is zero (a comparison, not a loop: the
/// tests run as debug builds under emulation).
fn all_zero(mem: &HostBuffer) -> bool {
    mem.to_vec() == vec![0u8; mem.len()]
}

async fn within<T>(what: &str, f: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(300), f)
        .await
        .unwrap_or_else(|_| panic!("{what} took more than 300 s"))
}

/// Waits until the byte at `at` of `mem` is no longer zero.
async fn landed(mem: &HostBuffer, at: usize) {
    within("the first bytes landing", async {
        let mut b = [0u8];
        loop {
            mem.read(at, &mut b).expect("read");
            if b[0] != 0 {
                return;
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    })
    .await;
}

/// Waits until the TCP transport has served more than `before` bytes.
async fn tcp_moved(tcp: &Inbound, before: u64) {
    within("the first byte over TCP", async {
        while tcp.snapshot().served_bytes() <= before {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    })
    .await;
}

/// `n` writes of 1 MiB: block `i` of `src` to block `n-1-i` of `dst` (a
/// misplaced block shows).
fn reversed(src: u64, dst: u64, n: usize) -> Vec<TransferRequest> {
    (0..n)
        .map(|i| {
            TransferRequest::write(
                src + (i * MIB) as u64,
                dst + ((n - 1 - i) * MIB) as u64,
                MIB as u64,
            )
        })
        .collect()
}

fn check_reversed(got: &[u8], want: &[u8], n: usize) {
    for i in 0..n {
        let at = (n - 1 - i) * MIB;
        assert!(
            got[at..at + MIB] == want[i * MIB..(i + 1) * MIB],
            "block {i} differs"
        );
    }
}

/// (a) A verbs + TCP engine against a plain TCP engine and against a
/// TCP-only multi engine: TCP, said so and why; against another verbs +
/// TCP engine: verbs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verbs_and_tcp_against_tcp_only_goes_over_tcp_and_says_why() {
    let test = "verbs_and_tcp_against_tcp_only_goes_over_tcp_and_says_why";
    let Some(a) = verbs_and_tcp(test).await else {
        return;
    };
    let Some(both) = verbs_and_tcp(test).await else {
        return;
    };
    let plain = Arc::new(Engine::open(TCP).await.unwrap());
    let tcp_multi = Arc::new(Engine::open_multi(&[TCP]).await.unwrap());
    const LEN: usize = MIB;
    let src = RegisteredBuffer::new(a.clone(), LEN).await.unwrap();
    let back = RegisteredBuffer::new(a.clone(), LEN).await.unwrap();
    let bytes = data(LEN, 3);
    src.memory().write(0, &bytes).unwrap();

    for (peer, transport, says) in [
        (&plain, "tcp", "single-transport peer"),
        (&tcp_multi, "tcp", "tcp: both sides have it"),
        (&both, "verbs", "verbs: both sides have it"),
    ] {
        let dst = RegisteredBuffer::new(peer.clone(), LEN).await.unwrap();
        let name = peer.segment_name();
        let seg = a.open_segment(name).await.unwrap();
        let choice = a.transport_choice(name).expect("a choice");
        say(&format!("{test}: {choice}"));
        assert_eq!(choice.transport, transport, "{choice}");
        assert_eq!(choice.ours, ["verbs", "tcp"], "{choice}");
        assert!(choice.reason.contains(says), "{choice}");
        assert_eq!(
            choice.single_transport_peer,
            transport == "tcp" && says.contains("single")
        );
        if transport == "tcp" {
            assert_eq!(choice.theirs, ["tcp"], "{choice}");
        }
        let served = if Arc::ptr_eq(peer, &plain) {
            plain.inbound().expect("TCP counts what it serves")
        } else if Arc::ptr_eq(peer, &tcp_multi) {
            let (_, t) = multi(&tcp_multi).transports().next().unwrap();
            t.inbound().expect("TCP counts what it serves")
        } else {
            tcp_inbound(&both)
        };
        let before = served.snapshot().served_bytes();
        let note = Notification::new("a", name);
        a.batch_transfer(
            seg,
            &[TransferRequest::write(src.addr(), dst.addr(), LEN as u64)],
            Some(&note),
        )
        .await
        .unwrap()
        .into_result()
        .unwrap();
        assert!(dst.memory().to_vec() == bytes, "{transport}: bytes written");
        back.memory().fill(0);
        a.transfer(
            seg,
            TransferRequest::read(back.addr(), dst.addr(), LEN as u64),
        )
        .await
        .unwrap();
        assert!(back.memory().to_vec() == bytes, "{transport}: bytes read");
        let over_tcp = served.snapshot().served_bytes() - before;
        if transport == "tcp" {
            assert!(over_tcp >= 2 * LEN as u64, "TCP served {over_tcp} bytes");
        } else {
            assert_eq!(over_tcp, 0, "verbs chosen, yet TCP served bytes");
        }
        let n = within("the notification", peer.next_notification(Some("a")))
            .await
            .unwrap();
        assert_eq!(n, note);
        assert!(peer.take_notifications().await.unwrap().is_empty(), "once");
        a.close_segment(seg).await.unwrap();
        dst.release().await.unwrap();
    }
    src.release().await.unwrap();
    back.release().await.unwrap();
}

/// (b) The link under verbs goes down once the first block of a batch of
/// 256 × 1 MiB writes has landed over verbs: the batch finishes over TCP,
/// every byte checked, the notification once. Then the §8 question: no
/// byte of a request verbs reported failed lands later (the destination
/// zeroed, the link up again, still zero).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn link_down_mid_batch_finishes_over_tcp_every_byte_one_notification() {
    let test = "link_down_mid_batch_finishes_over_tcp_every_byte_one_notification";
    const N: usize = 256;
    let Some(a) = verbs_and_tcp(test).await else {
        return;
    };
    let Some(b) = verbs_and_tcp(test).await else {
        return;
    };
    let _one = LINK.lock().await;
    let Some(link) = link(test) else { return };
    let src = RegisteredBuffer::new(a.clone(), N * MIB).await.unwrap();
    let dst = RegisteredBuffer::new(b.clone(), N * MIB).await.unwrap();
    let bytes = blocks(N, 11);
    src.memory().write(0, &bytes).unwrap();
    let seg = a.open_segment(b.segment_name()).await.unwrap();
    assert_eq!(multi(&a).choice(seg).unwrap().transport, "verbs");
    let tcp = tcp_inbound(&b);
    let reqs = reversed(src.addr(), dst.addr(), N);
    let note = Notification::new("failover", "256 x 1 MiB");
    let batch = tokio::spawn({
        let (a, reqs, note) = (a.clone(), reqs.clone(), note.clone());
        async move { a.batch_transfer(seg, &reqs, Some(&note)).await }
    });
    // Block 0 lands at the end of `dst`.
    landed(dst.memory(), (N - 1) * MIB).await;
    assert_eq!(tcp.snapshot().served_bytes(), 0, "verbs carries it first");
    let issued = Instant::now();
    link.down().await;
    let t0 = Instant::now();
    tcp_moved(&tcp, 0).await;
    let to_tcp = t0.elapsed();
    let report = within("the batch", batch).await.unwrap().unwrap();
    let took = t0.elapsed();
    assert!(report.is_success(), "{:?}", report.failures().next());
    check_reversed(&dst.memory().to_vec(), &bytes, N);
    let over_tcp = tcp.snapshot().served_bytes();
    let choice = multi(&a).choice(seg).unwrap();
    say(&format!(
        "{test}: the link went down (`ip` took {:.0} ms) once the first block had landed over \
         verbs; first byte over TCP {:.0} ms after; batch done {:.0} ms after; TCP carried {} \
         MiB of 256; {choice}",
        (t0 - issued).as_secs_f64() * 1e3,
        to_tcp.as_secs_f64() * 1e3,
        took.as_secs_f64() * 1e3,
        over_tcp / MIB as u64
    ));
    assert_eq!(choice.transport, "tcp", "{choice}");
    assert!(choice.failovers >= 1, "{choice:?}");
    assert!(
        choice.reason.contains("failed over from verbs"),
        "{}",
        choice.reason
    );
    let (what, why) = choice
        .failed
        .iter()
        .find(|(what, _)| what.starts_with("verbs"))
        .expect("the verbs failure is reported");
    say(&format!(
        "{test}: verbs failed: {what}: {why} (kind {:?})",
        why.kind()
    ));
    let n = within("the notification", b.next_notification(Some("failover")))
        .await
        .unwrap();
    assert_eq!(n, note);
    assert!(
        b.take_notifications().await.unwrap().is_empty(),
        "the notification came twice"
    );

    // §8: verbs reported its requests failed; none lands later, even with
    // the link back. (A wait for nothing to happen: a late write of the
    // old queue pair would come within its retry window, ≈ 2.1 s.)
    dst.memory().fill(0);
    link.up().await;
    tokio::time::sleep(Duration::from_millis(2500)).await;
    assert!(
        all_zero(dst.memory()),
        "a byte of a request verbs reported failed landed after the failure"
    );
    src.release().await.unwrap();
    dst.release().await.unwrap();
}

/// (c) The link goes down: a transfer fails over to TCP; it comes back:
/// once the back-off (1 s) is over, a batch of 16 × 1 MiB with a
/// notification goes over verbs again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_link_restored_a_later_batch_goes_over_verbs_again() {
    let test = "the_link_restored_a_later_batch_goes_over_verbs_again";
    const N: usize = 16;
    let Some(a) = verbs_and_tcp(test).await else {
        return;
    };
    let Some(b) = verbs_and_tcp(test).await else {
        return;
    };
    let _one = LINK.lock().await;
    let Some(link) = link(test) else { return };
    let src = RegisteredBuffer::new(a.clone(), N * MIB).await.unwrap();
    let dst = RegisteredBuffer::new(b.clone(), N * MIB).await.unwrap();
    let bytes = blocks(N, 17);
    src.memory().write(0, &bytes).unwrap();
    let seg = a.open_segment(b.segment_name()).await.unwrap();
    let tcp = tcp_inbound(&b);
    let one = TransferRequest::write(src.addr(), dst.addr(), MIB as u64);
    a.transfer(seg, one).await.unwrap();
    assert_eq!(multi(&a).choice(seg).unwrap().transport, "verbs");
    assert_eq!(tcp.snapshot().served_bytes(), 0);

    link.down().await;
    dst.memory().fill(0);
    a.transfer(seg, one).await.unwrap();
    let failed_at = Instant::now();
    assert!(dst.memory().to_vec()[..MIB] == bytes[..MIB]);
    let c = multi(&a).choice(seg).unwrap();
    assert_eq!((c.transport.as_str(), c.failovers), ("tcp", 1), "{c}");
    let carried = tcp.snapshot().served_bytes();
    assert!(carried >= MIB as u64, "TCP served {carried}");

    link.up().await;
    // The back-off is a time: wait it out.
    let backoff = Duration::from_millis(1100);
    tokio::time::sleep(backoff.saturating_sub(failed_at.elapsed())).await;
    dst.memory().fill(0);
    let note = Notification::new("verbs-again", "16 x 1 MiB");
    let t0 = Instant::now();
    a.batch_transfer(seg, &reversed(src.addr(), dst.addr(), N), Some(&note))
        .await
        .unwrap()
        .into_result()
        .unwrap();
    let took = t0.elapsed();
    check_reversed(&dst.memory().to_vec(), &bytes, N);
    let c = multi(&a).choice(seg).unwrap();
    say(&format!(
        "{test}: 16 MiB in {:.0} ms after the link came back: {c}",
        took.as_secs_f64() * 1e3
    ));
    assert_eq!((c.transport.as_str(), c.failovers), ("verbs", 2), "{c}");
    // The batch's data went over verbs; only the notification (sent alone
    // after the data, over the transport that carried the end) may not.
    assert_eq!(
        tcp.snapshot().served_bytes(),
        carried,
        "TCP carried bytes of the batch"
    );
    let n = within("the notification", b.next_notification(Some("verbs-again")))
        .await
        .unwrap();
    assert_eq!(n, note);
    assert!(b.take_notifications().await.unwrap().is_empty(), "once");
    src.release().await.unwrap();
    dst.release().await.unwrap();
}

/// (d) The link goes down under a batch whose deadline is shorter than the
/// failover (the rest of 256 MiB over TCP): a typed `Timeout`; once both
/// sides' `unregister` returned, no byte of the destination changes, the
/// link back up or not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deadline_shorter_than_the_failover_is_a_timeout_and_nothing_lands_after_unregister() {
    let test =
        "a_deadline_shorter_than_the_failover_is_a_timeout_and_nothing_lands_after_unregister";
    const N: usize = 256;
    // Plain memory registered by hand, still readable after `unregister`;
    // declared before the engines, so that it outlives them (dropped after
    // them) even when an assertion fails in between; made once they exist.
    let (src, dst): (HostBuffer, HostBuffer);
    let Some(a) = verbs_and_tcp(test).await else {
        return;
    };
    let Some(b) = verbs_and_tcp(test).await else {
        return;
    };
    let _one = LINK.lock().await;
    let Some(link) = link(test) else { return };
    (src, dst) = (
        HostBuffer::new(N * MIB).unwrap(),
        HostBuffer::new(N * MIB).unwrap(),
    );
    src.write(0, &blocks(N, 23)).unwrap();
    // SAFETY: both buffers outlive the engines they are registered with
    // (declared before them, so dropped after them, on every path).
    a.register(unsafe { src.region(Location::cpu(0)) })
        .await
        .unwrap();
    // SAFETY: as above.
    b.register(unsafe { dst.region(Location::cpu(0)) })
        .await
        .unwrap();
    let seg = a.open_segment(b.segment_name()).await.unwrap();
    let reqs = reversed(src.addr(), dst.addr(), N);
    let deadline = Duration::from_millis(500);
    let t0 = Instant::now();
    let batch = tokio::spawn({
        let (a, reqs) = (a.clone(), reqs.clone());
        async move { a.batch_transfer_within(seg, &reqs, None, deadline).await }
    });
    landed(&dst, (N - 1) * MIB).await;
    link.down().await;
    let r = within("the batch", batch).await.unwrap();
    say(&format!(
        "{test}: {:.0} ms: {r:?}",
        t0.elapsed().as_secs_f64() * 1e3
    ));
    assert!(matches!(r, Err(Error::Timeout { .. })), "{r:?}");
    a.unregister(src.addr()).await.unwrap();
    b.unregister(dst.addr()).await.unwrap();
    let before = dst.to_vec();
    link.up().await;
    // A wait for nothing to happen: the old queue pair's retry window.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    assert!(
        dst.to_vec() == before,
        "a byte of the destination changed after unregister"
    );
    a.shutdown().await.unwrap();
    b.shutdown().await.unwrap();
}

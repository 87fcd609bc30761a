//! `multi://` (issue 45, item 1): one engine over several TCP engines on
//! loopback, against another multi engine and a plain TCP engine; the
//! choice and its report; registration in every transport; the
//! conformance suite on the multi engine, raw and adapted.
#![cfg(feature = "tcp")]

use std::sync::Arc;
use std::time::Duration;

use ferry::multi::{MultiEngine, SEGMENT_PREFIX};
use ferry::{Engine, Error, HostBuffer, Location, Notification, RegisteredBuffer, TransferEngine};
use ferry::{MemoryRegion, TransferRequest};

/// Two TCP transports on loopback (socket path: every byte crosses the wire).
const TWO_TCP: [&str; 2] = [
    "tcp://127.0.0.1:0?same_host=off",
    "tcp://127.0.0.1:0?same_host=off",
];

fn multi(e: &Engine) -> &MultiEngine {
    e.backend::<MultiEngine>().expect("a multi engine")
}

/// The inner engines' segment names, best first.
fn inner_names(e: &Engine) -> Vec<String> {
    multi(e)
        .transports()
        .map(|(_, t)| t.segment_name().to_owned())
        .collect()
}

fn data(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) ^ (i >> 9) as u8)
        .collect()
}

async fn within<T>(what: &str, f: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(60), f)
        .await
        .unwrap_or_else(|_| panic!("{what} took more than 60 s"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_multi_engines_choose_their_first_common_transport_and_move_bytes() {
    // The URL form and the Rust form give the same engine.
    let url = format!(
        "multi://?transports=tcp,second&tcp.url={}&second.url={}",
        "tcp%3A%2F%2F127.0.0.1%3A0%3Fsame_host%3Doff",
        "tcp%3A%2F%2F127.0.0.1%3A0%3Fsame_host%3Doff"
    );
    let a = Arc::new(Engine::open(&url).await.unwrap());
    let b = Arc::new(Engine::open_multi(&TWO_TCP).await.unwrap());
    assert_eq!(a.scheme(), "multi");
    assert_eq!(a.backend_name(), "multi");
    let names = inner_names(&b);
    assert_eq!(
        b.segment_name(),
        format!("{SEGMENT_PREFIX}tcp={};tcp={}", names[0], names[1])
    );

    const LEN: usize = 1 << 20;
    let src = RegisteredBuffer::new(a.clone(), LEN).await.unwrap();
    let back = RegisteredBuffer::new(a.clone(), LEN).await.unwrap();
    let dst = RegisteredBuffer::new(b.clone(), LEN).await.unwrap();
    let bytes = data(LEN, 7);
    src.memory().write(0, &bytes).unwrap();

    let seg = a.open_segment(b.segment_name()).await.unwrap();
    let choice = a.transport_choice(b.segment_name()).expect("a choice");
    assert_eq!(choice, multi(&a).choice(seg).unwrap());
    assert_eq!((choice.transport.as_str(), choice.index), ("tcp", 0));
    assert_eq!(choice.address, names[0], "the peer's first TCP transport");
    assert_eq!(choice.ours, ["tcp", "tcp"]);
    assert_eq!(choice.theirs, ["tcp", "tcp"]);
    assert!(!choice.single_transport_peer);
    assert!(choice.failed.is_empty());
    assert!(
        choice.reason.contains("both sides have it"),
        "{}",
        choice.reason
    );
    let report = a
        .peer_report(b.segment_name())
        .expect("the TCP transport's report");
    assert_eq!(report.path, "socket");

    a.transfer(
        seg,
        TransferRequest::write(src.addr(), dst.addr(), LEN as u64),
    )
    .await
    .unwrap();
    assert!(
        dst.memory().to_vec() == bytes,
        "bytes written over the multi engine"
    );
    a.transfer(
        seg,
        TransferRequest::read(back.addr(), dst.addr(), LEN as u64),
    )
    .await
    .unwrap();
    assert!(back.memory().to_vec() == bytes, "bytes read back");

    // A batch with a notification: delivered once, to the multi engine.
    dst.memory().fill(0);
    let half = (LEN / 2) as u64;
    let reqs = [
        TransferRequest::write(src.addr(), dst.addr() + half, half),
        TransferRequest::write(src.addr() + half, dst.addr(), half),
    ];
    let note = Notification::new("kv-ready", "batch 1");
    a.batch_transfer(seg, &reqs, Some(&note))
        .await
        .unwrap()
        .into_result()
        .unwrap();
    let got = within("the notification", b.next_notification(Some("kv-ready")))
        .await
        .unwrap();
    assert_eq!(got.message, "batch 1");
    let moved = dst.memory().to_vec();
    assert!(moved[..LEN / 2] == bytes[LEN / 2..] && moved[LEN / 2..] == bytes[..LEN / 2]);
    assert!(b.take_notifications().await.unwrap().is_empty(), "once");

    // submit / status / wait through the multi engine's own batch ids.
    let id = a.submit(seg, &reqs, None).await.unwrap();
    let report = a.wait(id).await.unwrap();
    assert!(report.is_success());
    assert!(matches!(a.status(id), Err(Error::UnknownBatch(i)) if i == id));
    assert_eq!(a.live_batches(), Some(0));

    // The memory is registered in every inner engine: a plain TCP engine
    // writes into it through the second transport.
    let c = Arc::new(
        Engine::open("tcp://127.0.0.1:0?same_host=off")
            .await
            .unwrap(),
    );
    let csrc = RegisteredBuffer::new(c.clone(), 4096).await.unwrap();
    csrc.memory().fill(0xC3);
    let cseg = c.open_segment(&names[1]).await.unwrap();
    c.transfer(cseg, TransferRequest::write(csrc.addr(), dst.addr(), 4096))
        .await
        .unwrap();
    assert!(dst.memory().to_vec()[..4096].iter().all(|&x| x == 0xC3));

    a.close_segment(seg).await.unwrap();
    assert!(matches!(
        a.transfer(seg, TransferRequest::write(src.addr(), dst.addr(), 8)).await,
        Err(Error::UnknownSegment(s)) if s == seg
    ));
    for buf in [src, back] {
        buf.release().await.unwrap();
    }
    dst.release().await.unwrap();
    csrc.release().await.unwrap();
    a.shutdown().await.unwrap();
    b.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plain_tcp_peer_is_reached_over_tcp_and_reported_as_single_transport() {
    let a = Arc::new(Engine::open_multi(&TWO_TCP).await.unwrap());
    let p = Arc::new(
        Engine::open("tcp://127.0.0.1:0?same_host=off")
            .await
            .unwrap(),
    );
    let src = RegisteredBuffer::new(a.clone(), 65536).await.unwrap();
    let dst = RegisteredBuffer::new(p.clone(), 65536).await.unwrap();
    let bytes = data(65536, 3);
    src.memory().write(0, &bytes).unwrap();
    let seg = a.open_segment(p.segment_name()).await.unwrap();
    let choice = a.transport_choice(p.segment_name()).unwrap();
    assert!(choice.single_transport_peer);
    assert_eq!(choice.transport, "tcp");
    assert_eq!(choice.address, p.segment_name());
    assert_eq!(choice.theirs, ["tcp"]);
    assert!(
        choice.reason.contains("single-transport peer"),
        "{}",
        choice.reason
    );
    assert!(choice.to_string().starts_with("tcp to "), "{choice}");
    a.batch_transfer(
        seg,
        &[TransferRequest::write(src.addr(), dst.addr(), 65536)],
        Some(&Notification::new("plain", "")),
    )
    .await
    .unwrap()
    .into_result()
    .unwrap();
    assert!(dst.memory().to_vec() == bytes);
    within(
        "the plain peer's notification",
        p.next_notification(Some("plain")),
    )
    .await
    .unwrap();

    // The other way: the plain engine reaches the multi engine through one
    // of its transports, and the multi engine receives its notification.
    let pseg = p.open_segment(&inner_names(&a)[1]).await.unwrap();
    p.batch_transfer(
        pseg,
        &[TransferRequest::read(dst.addr(), src.addr(), 65536)],
        Some(&Notification::new("from-plain", "x")),
    )
    .await
    .unwrap()
    .into_result()
    .unwrap();
    let n = within(
        "a notification over the second transport",
        a.next_notification(None),
    )
    .await
    .unwrap();
    assert_eq!(n.name, "from-plain");
    src.release().await.unwrap();
    dst.release().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_common_transport_is_a_typed_error_naming_both_lists() {
    let a = Engine::open_multi(&TWO_TCP).await.unwrap();
    let e = a
        .open_segment(&format!("{SEGMENT_PREFIX}nixl=agent-7;verbs=rxe0%3B1"))
        .await
        .unwrap_err();
    match &e {
        Error::Unavailable { backend, reason } => {
            assert_eq!(backend, "multi");
            assert!(reason.contains("ours: tcp, tcp"), "{reason}");
            assert!(reason.contains("the peer's: nixl, verbs"), "{reason}");
        }
        other => panic!("expected Unavailable, got {other:?}"),
    }
    assert_eq!(e.kind(), ferry::ErrorKind::Unavailable);
    let e = a.open_segment("not-an-address").await.unwrap_err();
    assert!(
        matches!(&e, Error::Unavailable { reason, .. } if reason.contains("the peer's: none")),
        "{e:?}"
    );
    // A malformed list is an argument error, not a transport's.
    assert!(matches!(
        a.open_segment(&format!("{SEGMENT_PREFIX}tcp")).await,
        Err(Error::InvalidArgument(_))
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_transport_falls_to_the_next_and_the_report_says_so() {
    let a = Arc::new(Engine::open_multi(&TWO_TCP).await.unwrap());
    let b = Arc::new(Engine::open_multi(&TWO_TCP).await.unwrap());
    let names = inner_names(&b);
    let src = RegisteredBuffer::new(a.clone(), 8192).await.unwrap();
    let dst = RegisteredBuffer::new(b.clone(), 8192).await.unwrap();
    // The peer's first transport stops: its listener and connections go
    // (a register would now be refused: it registers in every transport).
    let (_, first) = multi(&b).transports().next().unwrap();
    first.shutdown().await.unwrap();
    src.memory().fill(0x5A);
    let seg = a.open_segment(b.segment_name()).await.unwrap();
    let choice = multi(&a).choice(seg).unwrap();
    assert_eq!(choice.address, names[1], "{choice}");
    assert_eq!(choice.failed.len(), 1, "{choice:?}");
    assert!(choice.failed[0].0.contains(&names[0]), "{choice:?}");
    assert!(choice.reason.contains("failed first"), "{}", choice.reason);
    a.transfer(seg, TransferRequest::write(src.addr(), dst.addr(), 8192))
        .await
        .unwrap();
    assert!(dst.memory().to_vec().iter().all(|&x| x == 0x5A));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registration_is_all_or_nothing_and_unregister_covers_every_transport() {
    let a = Arc::new(Engine::open_multi(&TWO_TCP).await.unwrap());
    let inner: Vec<Arc<Engine>> = multi(&a).transports().map(|(_, e)| e.clone()).collect();
    let mem = HostBuffer::new(8192).unwrap();
    let region = |off: usize, len: usize| -> MemoryRegion {
        // SAFETY: `mem` outlives every engine here, and every registration
        // is undone (or the engines shut down) before the test ends.
        unsafe { MemoryRegion::from_raw_parts(mem.as_ptr().add(off), len, Location::cpu(0)) }
    };
    // The second transport holds part of it already: the multi register
    // fails and leaves nothing in the first.
    inner[1].register(region(4096, 4096)).await.unwrap();
    let e = a.register(region(0, 8192)).await.unwrap_err();
    assert!(matches!(e, Error::RegionOverlap { .. }), "{e:?}");
    inner[0]
        .register(region(0, 8192))
        .await
        .expect("undone in the first");
    inner[0].unregister(mem.addr()).await.unwrap();
    inner[1].unregister(mem.addr() + 4096).await.unwrap();

    // Registered through the multi engine: in both; unregistered: in none.
    a.register(region(0, 8192)).await.unwrap();
    for e in &inner {
        assert!(matches!(
            e.register(region(0, 8192)).await,
            Err(Error::RegionOverlap { .. })
        ));
    }
    a.unregister(mem.addr()).await.unwrap();
    for e in &inner {
        assert!(matches!(
            e.unregister(mem.addr()).await,
            Err(Error::RegionNotRegistered { .. })
        ));
    }
    assert!(matches!(
        a.unregister(mem.addr()).await,
        Err(Error::RegionNotRegistered { .. })
    ));

    // A batch: all or nothing in every transport too.
    inner[1].register(region(4096, 4096)).await.unwrap();
    let e = a
        .batch_register(vec![region(0, 4096), region(4096, 4096)])
        .await
        .unwrap_err();
    assert!(
        matches!(e.kind(), ferry::ErrorKind::AlreadyRegistered),
        "{e:?}"
    );
    inner[0]
        .register(region(0, 8192))
        .await
        .expect("undone in the first");
    inner[0].unregister(mem.addr()).await.unwrap();
    inner[1].unregister(mem.addr() + 4096).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn multi_urls_are_checked() {
    for (url, says) in [
        ("multi://", "transports="),
        ("multi://?transports=tcp,tcp", "listed twice"),
        ("multi://host?transports=tcp", "parameters"),
        ("multi://?transports=tcp&colour=blue", "colour"),
        (
            "multi://?transports=t&t.url=tcp%3A%2F%2F127.0.0.1%3A0%3Fsecret%3Dx",
            "give the secret to the multi URL",
        ),
        (
            "multi://?transports=m&m.url=multi%3A%2F%2F",
            "cannot be a multi",
        ),
    ] {
        let e = Engine::open(url).await.unwrap_err();
        assert!(matches!(e, Error::InvalidArgument(_)), "{url}: {e:?}");
        assert!(e.to_string().contains(says), "{url}: {e}");
        assert!(!e.to_string().contains("secret%3Dx"), "{url}: {e}");
    }
    // The secret given once reaches every transport: two multi engines
    // with it talk, one without it is refused.
    let s = "multi://?transports=tcp,t2&tcp.url=tcp%3A%2F%2F127.0.0.1%3A0&t2.url=tcp%3A%2F%2F127.0.0.1%3A0&secret=s3";
    let (a, b) = (
        Engine::open(s).await.unwrap(),
        Engine::open(s).await.unwrap(),
    );
    a.open_segment(b.segment_name()).await.unwrap();
    let c = Engine::open_multi(&["tcp://127.0.0.1:0"]).await.unwrap();
    let e = c.open_segment(b.segment_name()).await.unwrap_err();
    assert_eq!(e.kind(), ferry::ErrorKind::Authentication, "{e:?}");
}

/// The TCP backend under transport `i` of the multi engine `e`.
fn tcp_of(e: &Engine, i: usize) -> &ferry::tcp::TcpEngine {
    let (_, inner) = multi(e).transports().nth(i).expect("transport");
    inner
        .backend::<ferry::tcp::TcpEngine>()
        .expect("a TCP transport")
}

/// Issue 45 §6 on the host: a batch of 256 × 1 MiB with a notification,
/// over the first of the peer's two TCP transports; once bytes land, that
/// transport's backend stops at once (listener and connections gone). The
/// batch finishes over the other, every byte checked, the notification
/// delivered once; while the failed transport backs off, later transfers go
/// straight over the other.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_finishes_over_the_next_transport_when_its_transport_dies() {
    const N: usize = 256;
    const MIB: usize = 1 << 20;
    let a = Arc::new(Engine::open_multi(&TWO_TCP).await.unwrap());
    let b = Arc::new(Engine::open_multi(&TWO_TCP).await.unwrap());
    let names = inner_names(&b);
    let src = RegisteredBuffer::new(a.clone(), N * MIB).await.unwrap();
    let dst = RegisteredBuffer::new(b.clone(), N * MIB).await.unwrap();
    let bytes = data(N * MIB, 11);
    src.memory().write(0, &bytes).unwrap();
    let seg = a.open_segment(b.segment_name()).await.unwrap();
    assert_eq!(multi(&a).choice(seg).unwrap().address, names[0]);
    // Block i to block N-1-i: a misplaced block shows.
    let reqs: Vec<TransferRequest> = (0..N)
        .map(|i| {
            TransferRequest::write(
                src.addr() + (i * MIB) as u64,
                dst.addr() + ((N - 1 - i) * MIB) as u64,
                MIB as u64,
            )
        })
        .collect();
    let note = Notification::new("failover", "256 x 1 MiB");
    let batch = tokio::spawn({
        let (a, reqs, note) = (a.clone(), reqs.clone(), note.clone());
        async move { a.batch_transfer(seg, &reqs, Some(&note)).await }
    });
    let served = multi(&b)
        .transports()
        .next()
        .unwrap()
        .1
        .inbound()
        .expect("TCP counts what it serves");
    within("the first bytes landing", async {
        while served.snapshot().served_bytes() == 0 {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    })
    .await;
    tcp_of(&b, 0).shutdown_now();
    let report = within("the batch", batch).await.unwrap().unwrap();
    assert!(report.is_success(), "{:?}", report.failures().next());
    let carried_first = served.snapshot().served_bytes();
    assert!(
        carried_first < (N * MIB) as u64,
        "the first transport carried all {carried_first} bytes: nothing failed over"
    );
    let got = dst.memory().to_vec();
    for i in 0..N {
        let at = (N - 1 - i) * MIB;
        assert!(
            got[at..at + MIB] == bytes[i * MIB..(i + 1) * MIB],
            "block {i} differs"
        );
    }
    let choice = multi(&a).choice(seg).unwrap();
    assert!(choice.failovers >= 1, "{choice:?}");
    assert_eq!(choice.address, names[1], "{choice}");
    assert!(
        choice.reason.contains("failed over from"),
        "{}",
        choice.reason
    );
    assert!(
        choice
            .failed
            .iter()
            .any(|(what, _)| what.contains(&names[0])),
        "{choice:?}"
    );
    let n = within("the notification", b.next_notification(Some("failover")))
        .await
        .unwrap();
    assert_eq!(n, note);
    assert!(
        b.take_notifications().await.unwrap().is_empty(),
        "the notification came twice"
    );

    // The next transfers go over the second transport, by transfer and by
    // submit; the dead one is tried again only once its back-off (1 s) is
    // over, and fails again: every failure names it, none the other.
    dst.memory().fill(0);
    a.transfer(
        seg,
        TransferRequest::write(src.addr(), dst.addr(), MIB as u64),
    )
    .await
    .unwrap();
    let id = a.submit(seg, &reqs[..8], None).await.unwrap();
    assert!(a.wait(id).await.unwrap().is_success());
    let after = multi(&a).choice(seg).unwrap();
    assert_eq!(after.address, names[1], "{after}");
    assert!(
        after
            .failed
            .iter()
            .all(|(what, _)| what.contains(&names[0])),
        "{after:?}"
    );
    assert!(dst.memory().to_vec()[..MIB] == bytes[..MIB]);
    src.release().await.unwrap();
    dst.release().await.unwrap();
}

/// `submit` and `transfer` fail over too: the peer's first transport is
/// gone before they start.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn submit_and_transfer_fail_over() {
    const N: usize = 16;
    const MIB: usize = 1 << 20;
    let a = Arc::new(Engine::open_multi(&TWO_TCP).await.unwrap());
    let b = Arc::new(Engine::open_multi(&TWO_TCP).await.unwrap());
    let src = RegisteredBuffer::new(a.clone(), N * MIB).await.unwrap();
    let dst = RegisteredBuffer::new(b.clone(), N * MIB).await.unwrap();
    let bytes = data(N * MIB, 5);
    src.memory().write(0, &bytes).unwrap();
    let seg = a.open_segment(b.segment_name()).await.unwrap();
    tcp_of(&b, 0).shutdown_now();
    let reqs: Vec<TransferRequest> = (0..N)
        .map(|i| {
            let at = (i * MIB) as u64;
            TransferRequest::write(src.addr() + at, dst.addr() + at, MIB as u64)
        })
        .collect();
    let note = Notification::new("submitted", "");
    let id = a.submit(seg, &reqs, Some(&note)).await.unwrap();
    let report = within("the submitted batch", a.wait(id)).await.unwrap();
    assert!(report.is_success(), "{:?}", report.failures().next());
    assert!(dst.memory().to_vec() == bytes);
    within("its notification", b.next_notification(Some("submitted")))
        .await
        .unwrap();
    assert!(b.take_notifications().await.unwrap().is_empty());
    assert_eq!(a.live_batches(), Some(0));
    assert_eq!(multi(&a).choice(seg).unwrap().failovers, 1);

    // A fresh segment's first transfer fails over by itself.
    let seg2 = a.open_segment(b.segment_name()).await.unwrap();
    let c2 = multi(&a).choice(seg2).unwrap();
    dst.memory().fill(0);
    a.transfer(seg2, reqs[3]).await.unwrap();
    assert!(dst.memory().to_vec()[3 * MIB..4 * MIB] == bytes[3 * MIB..4 * MIB]);
    assert_ne!(multi(&a).choice(seg2).unwrap().address, c2.address);

    // The segment report lists the failover; the metrics count both (two
    // TCP transports on each side: labelled by our index and the peer's).
    let names = inner_names(&b);
    let choice = multi(&a).choice(seg).unwrap();
    let moved = (
        format!("tcp to {}", names[0]),
        format!("tcp to {}", names[1]),
        1,
    );
    assert_eq!(
        choice.failed_over,
        std::slice::from_ref(&moved),
        "{choice:?}"
    );
    let shown = choice.to_string();
    assert!(
        shown.contains(&format!("failed over: {} -> {} (1x)", moved.0, moved.1)),
        "{shown}"
    );
    let ours = |family: &str| -> Vec<String> {
        let text = a.metrics_registry().expect("metrics on").encode();
        text.lines()
            .filter(|l| {
                l.starts_with(&format!("{family}{{"))
                    && l.contains(&format!("engine=\"{}\"", a.segment_name()))
            })
            .map(str::to_owned)
            .collect()
    };
    let peer = b.segment_name();
    assert_eq!(
        ours("ferry_failovers_total"),
        [format!(
            "ferry_failovers_total{{engine=\"{}\",peer=\"{peer}\",from=\"tcp#0.0\",to=\"tcp#0.1\"}} 2",
            a.segment_name()
        )]
    );
    assert_eq!(
        ours("ferry_transport_chosen"),
        [format!(
            "ferry_transport_chosen{{engine=\"{}\",peer=\"{peer}\",transport=\"tcp#0.1\"}} 2",
            a.segment_name()
        )]
    );
    a.close_segment(seg2).await.unwrap();
    let chosen = ours("ferry_transport_chosen");
    assert!(
        chosen.len() == 1 && chosen[0].ends_with("transport=\"tcp#0.1\"} 1"),
        "a closed segment is not carried: {chosen:?}"
    );
}

/// A deadline shorter than the failover (the next transport is a listener
/// that never answers, so its handshake waits): a typed `Timeout`, and
/// once `unregister` returned no byte of either memory changes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deadline_shorter_than_the_failover_is_a_timeout() {
    use ferry::TransferEngineExt;
    const LEN: usize = 8 << 20;
    let a = Arc::new(Engine::open_multi(&TWO_TCP).await.unwrap());
    let b = Arc::new(Engine::open_multi(&TWO_TCP[..1]).await.unwrap());
    let hole = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let peer = format!(
        "{SEGMENT_PREFIX}tcp={};tcp={}",
        inner_names(&b)[0],
        hole.local_addr().unwrap()
    );
    let (src, dst) = (HostBuffer::new(LEN).unwrap(), HostBuffer::new(LEN).unwrap());
    src.write(0, &data(LEN, 9)).unwrap();
    // SAFETY: both buffers outlive the engines' use of them: they are
    // unregistered (and the engines shut down) before the test ends.
    let region = |m: &HostBuffer| unsafe {
        MemoryRegion::from_raw_parts(m.as_ptr(), m.len(), Location::cpu(0))
    };
    a.register(region(&src)).await.unwrap();
    b.register(region(&dst)).await.unwrap();
    let seg = a.open_segment(&peer).await.unwrap();
    tcp_of(&b, 0).shutdown_now();
    let reqs = [
        TransferRequest::write(src.addr(), dst.addr(), LEN as u64),
        TransferRequest::read(src.addr(), dst.addr(), LEN as u64),
    ];
    let r = a
        .batch_transfer_within(seg, &reqs[..1], None, Duration::from_millis(300))
        .await;
    assert!(matches!(r, Err(Error::Timeout { .. })), "{r:?}");
    let r = a
        .transfer_within(seg, reqs[1], Duration::from_millis(300))
        .await;
    assert!(matches!(r, Err(Error::Timeout { .. })), "{r:?}");
    a.unregister(src.addr()).await.unwrap();
    b.unregister(dst.addr()).await.unwrap();
    let (s0, d0) = (src.to_vec(), dst.to_vec());
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(
        src.to_vec() == s0 && dst.to_vec() == d0,
        "a byte changed after unregister"
    );
    a.shutdown().await.unwrap();
    b.shutdown().await.unwrap();
    drop(hole);
}

/// A TCP forwarder standing for a link: stopping it resets every
/// connection through it and refuses new ones; it can start again on the
/// same port.
struct Link {
    accept: tokio::task::JoinHandle<()>,
    conns: Arc<std::sync::Mutex<Vec<tokio::task::JoinHandle<()>>>>,
}

impl Link {
    async fn up(at: std::net::SocketAddr, to: String) -> Link {
        let l = tokio::net::TcpListener::bind(at)
            .await
            .expect("bind the link");
        let conns = Arc::new(std::sync::Mutex::new(Vec::new()));
        let accept = tokio::spawn({
            let conns = Arc::clone(&conns);
            async move {
                while let Ok((mut near, _)) = l.accept().await {
                    let to = to.clone();
                    let h = tokio::spawn(async move {
                        if let Ok(mut far) = tokio::net::TcpStream::connect(&to).await {
                            let _ = tokio::io::copy_bidirectional(&mut near, &mut far).await;
                        }
                    });
                    conns.lock().unwrap().push(h);
                }
            }
        });
        Link { accept, conns }
    }

    async fn down(self) {
        self.accept.abort();
        let _ = self.accept.await;
        let conns: Vec<_> = std::mem::take(&mut *self.conns.lock().unwrap());
        for h in conns {
            h.abort();
            let _ = h.await;
        }
    }
}

/// The link under the preferred transport goes down: transfers fail over
/// to the other; it comes back: after its back-off (1 s) the next
/// transfer goes over it again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_transport_is_used_again_once_it_works_after_its_back_off() {
    const LEN: usize = 1 << 20;
    let a = Arc::new(Engine::open_multi(&TWO_TCP[..1]).await.unwrap());
    let b = Arc::new(Engine::open_multi(&TWO_TCP).await.unwrap());
    let names = inner_names(&b);
    let at = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap()
    };
    let link = Link::up(at, names[0].clone()).await;
    let peer = format!("{SEGMENT_PREFIX}tcp={at};tcp={}", names[1]);
    let src = RegisteredBuffer::new(a.clone(), LEN).await.unwrap();
    let dst = RegisteredBuffer::new(b.clone(), LEN).await.unwrap();
    let bytes = data(LEN, 21);
    src.memory().write(0, &bytes).unwrap();
    let whole = TransferRequest::write(src.addr(), dst.addr(), LEN as u64);
    let seg = a.open_segment(&peer).await.unwrap();
    a.transfer(seg, whole).await.unwrap();
    assert_eq!(multi(&a).choice(seg).unwrap().address, at.to_string());

    link.down().await;
    dst.memory().fill(0);
    a.transfer(seg, whole).await.unwrap();
    assert!(dst.memory().to_vec() == bytes);
    let c = multi(&a).choice(seg).unwrap();
    assert_eq!(
        (c.address.as_str(), c.failovers),
        (names[1].as_str(), 1),
        "{c}"
    );

    let link = Link::up(at, names[0].clone()).await;
    // The back-off is a time: wait it out.
    tokio::time::sleep(Duration::from_millis(1100)).await;
    dst.memory().fill(0);
    let note = Notification::new("back", "");
    a.batch_transfer(seg, &[whole], Some(&note))
        .await
        .unwrap()
        .into_result()
        .unwrap();
    assert!(dst.memory().to_vec() == bytes);
    let c = multi(&a).choice(seg).unwrap();
    assert_eq!(
        (c.address.as_str(), c.failovers),
        (at.to_string().as_str(), 2),
        "{c}"
    );
    // The reason names the return, not a back-off of the one it left.
    assert!(
        c.reason.contains("back after its back-off") && !c.reason.contains("was backing off"),
        "{c}"
    );
    within("the notification", b.next_notification(Some("back")))
        .await
        .unwrap();
    link.down().await;
}

/// A TCP relay to one address that can hold back the replies (the
/// target's acknowledgements) of the connections made so far, and then
/// cut them: a send that was delivered and never confirmed (ambiguous,
/// `MaybeApplied`). New connections pass both ways.
struct Relay {
    addr: std::net::SocketAddr,
    conns: Arc<std::sync::Mutex<Vec<RelayConn>>>,
    accept: tokio::task::JoinHandle<()>,
}

struct RelayConn {
    task: tokio::task::JoinHandle<()>,
    mute: Arc<std::sync::atomic::AtomicBool>,
}

impl Relay {
    async fn up(to: String) -> Relay {
        use std::sync::atomic::{AtomicBool, Ordering};
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let l = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind the relay");
        let addr = l.local_addr().unwrap();
        let conns = Arc::new(std::sync::Mutex::new(Vec::new()));
        let accept = tokio::spawn({
            let conns = Arc::clone(&conns);
            async move {
                while let Ok((near, _)) = l.accept().await {
                    let to = to.clone();
                    let mute = Arc::new(AtomicBool::new(false));
                    let muted = Arc::clone(&mute);
                    let task = tokio::spawn(async move {
                        let Ok(far) = tokio::net::TcpStream::connect(&to).await else {
                            return;
                        };
                        let (mut near_r, mut near_w) = near.into_split();
                        let (mut far_r, mut far_w) = far.into_split();
                        let up = async {
                            let _ = tokio::io::copy(&mut near_r, &mut far_w).await;
                        };
                        let down = async {
                            let mut buf = vec![0u8; 64 << 10];
                            while let Ok(n) = far_r.read(&mut buf).await {
                                if n == 0 {
                                    break;
                                }
                                // Muted: the reply is read and dropped.
                                if !muted.load(Ordering::Acquire)
                                    && near_w.write_all(&buf[..n]).await.is_err()
                                {
                                    break;
                                }
                            }
                        };
                        tokio::join!(up, down);
                    });
                    conns.lock().unwrap().push(RelayConn { task, mute });
                }
            }
        });
        Relay {
            addr,
            conns,
            accept,
        }
    }

    /// The replies of every connection made so far are dropped from now on.
    fn mute(&self) {
        for c in self.conns.lock().unwrap().iter() {
            c.mute.store(true, std::sync::atomic::Ordering::Release);
        }
    }

    /// Closes every connection made so far.
    async fn cut(&self) {
        let conns: Vec<_> = std::mem::take(&mut *self.conns.lock().unwrap());
        for c in conns {
            c.task.abort();
            let _ = c.task.await;
        }
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.accept.abort();
        for c in self.conns.lock().unwrap().iter() {
            c.task.abort();
        }
    }
}

/// The error of a batch of no requests whose notification failed.
fn notify_error(r: ferry::Result<ferry::BatchReport>) -> Error {
    match r {
        Err(e) => e,
        Ok(report) => report
            .into_result()
            .expect_err("the notification was to fail"),
    }
}

/// Issue 45 item 2 (the design's §4): between two multi engines the
/// notification sent alone after the data carries a tag; when its send is
/// ambiguous (delivered, the acknowledgement lost, the connection cut) it
/// is resent over the next transport and the receiving multi engine drops
/// the copy: delivered exactly once, untouched. Twice, once over each
/// transport: the copy is dropped by `take_notifications`, then by
/// `next_notification`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ambiguous_notification_is_resent_tagged_and_delivered_once() {
    let a = Arc::new(Engine::open_multi(&TWO_TCP[..1]).await.unwrap());
    let b = Arc::new(Engine::open_multi(&TWO_TCP).await.unwrap());
    let names = inner_names(&b);
    let relays = [
        Relay::up(names[0].clone()).await,
        Relay::up(names[1].clone()).await,
    ];
    let peer = format!(
        "{SEGMENT_PREFIX}tcp={};tcp={}",
        relays[0].addr, relays[1].addr
    );
    let seg = a.open_segment(&peer).await.unwrap();
    let first = Notification::new("first", "through the relay");
    a.batch_transfer(seg, &[], Some(&first))
        .await
        .unwrap()
        .into_result()
        .unwrap();
    let got = within("the first notification", b.next_notification(Some("first")))
        .await
        .unwrap();
    assert_eq!(got, first, "the tag is stripped");

    for (round, relay) in relays.iter().enumerate() {
        relay.mute();
        let note = Notification::new("once", format!("round {round}"));
        let batch = tokio::spawn({
            let (a, note) = (a.clone(), note.clone());
            async move { a.batch_transfer(seg, &[], Some(&note)).await }
        });
        let got = within(
            "the notification through the muted relay",
            b.next_notification(Some("once")),
        )
        .await
        .unwrap();
        assert_eq!(got, note);
        relay.cut().await;
        let report = within("the batch", batch).await.unwrap();
        assert!(
            report.as_ref().is_ok_and(|r| r.is_success()),
            "round {round}: the notification was not resent: {report:?}"
        );
        // The copy went over the other transport (the batch succeeded
        // there; the one cut is backing off, so it is tried first only
        // in the second round, when the other was cut).
        let choice = multi(&a).choice(seg).unwrap();
        let other = relays[1 - round].addr.to_string();
        assert_eq!(choice.address, other, "round {round}: {choice}");
        assert!(
            choice.failed.iter().any(|(what, e)| {
                what.contains(&relay.addr.to_string()) && e.retry() == ferry::Retry::MaybeApplied
            }),
            "round {round}: {choice:?}"
        );
        if round == 0 {
            assert_eq!(
                b.take_notifications().await.unwrap(),
                [],
                "the notification came twice (take_notifications)"
            );
        }
        // A later notification (a new tag) passes; in the second round
        // the copy waits before it in an inner queue and
        // `next_notification` drops it.
        let next = Notification::new("next", format!("after round {round}"));
        a.batch_transfer(seg, &[], Some(&next))
            .await
            .unwrap()
            .into_result()
            .unwrap();
        assert_eq!(
            within("a later notification", b.next_notification(None))
                .await
                .unwrap(),
            next,
            "the notification came twice (next_notification)"
        );
    }
    assert_eq!(b.take_notifications().await.unwrap(), []);
}

/// A single-transport peer (a plain TCP engine) is reached over either of
/// our two TCP transports, so the notification goes alone, untagged: it
/// sees exactly what was sent. Ambiguous, it is not resent (nothing would
/// drop the copy): the batch fails typed, `MaybeApplied`, and the peer has
/// it once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_single_transport_peer_gets_no_tag_and_no_resend() {
    let a = Arc::new(Engine::open_multi(&TWO_TCP).await.unwrap());
    let p = Arc::new(
        Engine::open("tcp://127.0.0.1:0?same_host=off")
            .await
            .unwrap(),
    );
    let relay = Relay::up(p.segment_name().to_owned()).await;
    let seg = a.open_segment(&relay.addr.to_string()).await.unwrap();
    assert!(multi(&a).choice(seg).unwrap().single_transport_peer);
    let plain = Notification::new("plain", "as sent");
    a.batch_transfer(seg, &[], Some(&plain))
        .await
        .unwrap()
        .into_result()
        .unwrap();
    let got = within("the notification", p.next_notification(None))
        .await
        .unwrap();
    assert_eq!(got, plain, "a single-transport peer saw a tag");

    relay.mute();
    let note = Notification::new("ambiguous", "");
    let batch = tokio::spawn({
        let (a, note) = (a.clone(), note.clone());
        async move { a.batch_transfer(seg, &[], Some(&note)).await }
    });
    let got = within("the notification", p.next_notification(None))
        .await
        .unwrap();
    assert_eq!(got, note);
    relay.cut().await;
    let e = notify_error(within("the batch", batch).await.unwrap());
    assert_eq!(e.retry(), ferry::Retry::MaybeApplied, "{e:?}");
    // Our second transport reaches the peer through the relay (which
    // passes new connections): a resend would have arrived by now.
    assert_eq!(p.take_notifications().await.unwrap(), [], "resent untagged");
}

/// The conformance suite on the multi engine: through the facade (raw: the
/// `Engine`; adapted: under every layer again) and bare (`MultiEngine`
/// without its stack).
mod conformance {
    use super::*;
    use ferry::DynTransferEngine;
    use ferry_core::conformance::EngineFactory;
    use std::collections::HashMap;
    use std::sync::Mutex;

    fn dead_address() -> String {
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = l.local_addr().expect("addr");
        drop(l);
        addr.to_string()
    }

    /// The inner engines of every engine made, by segment name: what
    /// `refuse_notifications` reaches.
    type Made = Mutex<HashMap<String, Vec<Arc<Engine>>>>;

    /// What a factory's `create` makes: the engine under test, and the
    /// multi engine's inner engines.
    type Created = ferry::Result<(Arc<dyn DynTransferEngine>, Vec<Arc<Engine>>)>;

    fn inner(m: &MultiEngine) -> Vec<Arc<Engine>> {
        m.transports().map(|(_, e)| Arc::clone(e)).collect()
    }

    /// A factory of multi engines: they differ in how they are opened
    /// (`create`) and in the name of a peer that is not there.
    struct Factory {
        made: Made,
        create: fn() -> std::pin::Pin<Box<dyn std::future::Future<Output = Created> + Send>>,
        unknown: fn() -> String,
    }

    impl Factory {
        fn new(
            create: fn() -> std::pin::Pin<Box<dyn std::future::Future<Output = Created> + Send>>,
            unknown: fn() -> String,
        ) -> Self {
            Factory {
                made: Made::default(),
                create,
                unknown,
            }
        }
    }

    #[async_trait::async_trait]
    impl EngineFactory for Factory {
        async fn create(&self) -> ferry::Result<Arc<dyn DynTransferEngine>> {
            let (e, inner) = (self.create)().await?;
            self.made
                .lock()
                .unwrap()
                .insert(e.segment_name().to_owned(), inner);
            Ok(e)
        }
        fn unknown_segment_name(&self) -> String {
            (self.unknown)()
        }
        async fn refuse_notifications(
            &self,
            engine: &Arc<dyn DynTransferEngine>,
        ) -> ferry::Result<bool> {
            let made = self.made.lock().unwrap();
            let Some(inner) = made.get(engine.segment_name()) else {
                return Ok(false);
            };
            for e in inner {
                let tcp = e
                    .backend::<ferry::tcp::TcpEngine>()
                    .expect("a TCP transport");
                tcp.set_refuse_notifications(true);
            }
            Ok(true)
        }
    }

    /// Through the facade: two TCP transports.
    fn facade() -> Factory {
        Factory::new(
            || {
                Box::pin(async {
                    let e = Engine::open_multi(&["tcp://127.0.0.1:0", "tcp://127.0.0.1:0"]).await?;
                    let inner = inner(multi(&e));
                    Ok((e.into_dyn(), inner))
                })
            },
            || {
                format!(
                    "{SEGMENT_PREFIX}tcp={};tcp={}",
                    dead_address(),
                    dead_address()
                )
            },
        )
    }

    /// Bare: `MultiEngine` without its stack.
    fn bare() -> Factory {
        Factory::new(
            || {
                Box::pin(async {
                    let e = MultiEngine::start(&["tcp://127.0.0.1:0", "tcp://127.0.0.1:0"]).await?;
                    let inner = inner(&e);
                    Ok((Arc::new(e) as Arc<dyn DynTransferEngine>, inner))
                })
            },
            dead_address,
        )
    }

    /// One transport on each side: one candidate, so a notification goes
    /// with its data (nothing to fail over to).
    fn one() -> Factory {
        Factory::new(
            || {
                Box::pin(async {
                    let e =
                        Engine::open("multi://?transports=tcp&tcp.url=tcp%3A%2F%2F127.0.0.1%3A0")
                            .await?;
                    let inner = inner(multi(&e));
                    Ok((e.into_dyn(), inner))
                })
            },
            dead_address,
        )
    }

    mod facade {
        use super::*;
        ferry_core::conformance_tests!(facade());
    }

    mod bare {
        use super::*;
        ferry_core::conformance_tests!(bare());
    }

    mod one {
        use super::*;
        ferry_core::conformance_tests!(one());
    }
}

//! Hostile and slow peers (issue 12): floods of unauthenticated and idle
//! connections, notification floods, trickling payloads, frames aimed at
//! re-registered memory, large batches and stuck requests, malformed
//! segment tables, stalled handshakes. Each test measures availability or
//! checks a bound; timings are only ever liveness bounds, with generous
//! margins for a noisy machine.

mod common;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{engine, gen_of, mem, raw_handshake, raw_handshake_gens};
use ferry_core::{Error, Notification, TransferEngine, TransferRequest};
use ferry_tcp::test_support::frame::{
    Hello, Request, Response, Segment, Status, TableEntry, HEADER_LEN, HELLO_FIXED, REJECT,
    VERSION, WELCOME,
};
use ferry_tcp::{TcpConfig, TcpEngine, MAX_QUEUED_NOTIFICATION_BYTES};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpSocket, TcpStream};

const MIB: usize = 1 << 20;

fn secret(s: &str) -> TcpConfig {
    TcpConfig::builder().secret(s).build().unwrap()
}

/// Opens a connection to `target` from `source` (an address of the
/// loopback network) and sends nothing.
async fn silent_conn(source: &str, target: SocketAddr) -> Option<TcpStream> {
    let sock = TcpSocket::new_v4().ok()?;
    sock.bind(format!("{source}:0").parse().ok()?).ok()?;
    sock.connect(target).await.ok()
}

/// `tries` legitimate handshakes in a row (open, then close so that the
/// next one connects again), each within the normal deadline; returns how
/// many succeeded.
async fn legit_handshakes(a: &TcpEngine, target: &str, tries: usize) -> usize {
    let mut ok = 0;
    for _ in 0..tries {
        let deadline = a.config().connect_timeout + Duration::from_secs(1);
        match tokio::time::timeout(deadline, a.open_segment(target)).await {
            Ok(Ok(seg)) => {
                ok += 1;
                a.close_segment(seg).await.expect("close");
            }
            Ok(Err(e)) => eprintln!("legitimate handshake failed: {e}"),
            Err(_) => eprintln!("legitimate handshake exceeded its deadline"),
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    ok
}

/// Row 1: 2,000 unauthenticated connections held open (re-opened as soon
/// as the target drops them) from another address do not keep legitimate
/// peers out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flood_of_unauthenticated_connections_keeps_legitimate_handshakes_available() {
    let b = engine(secret("s3cret")).await;
    let target: SocketAddr = b.segment_name().parse().unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let opened = Arc::new(AtomicUsize::new(0));
    // 2,000 held connections from 127.0.0.2; each one the target closes
    // is replaced (at most ~1,000 new connections/s).
    let mut held = Vec::with_capacity(2000);
    for _ in 0..2000 {
        if let Some(s) = silent_conn("127.0.0.2", target).await {
            held.push(s);
        }
    }
    assert!(
        held.len() >= 1900,
        "could open only {} connections",
        held.len()
    );
    opened.fetch_add(held.len(), Ordering::Relaxed);
    let flood = {
        let (stop, opened) = (Arc::clone(&stop), Arc::clone(&opened));
        tokio::spawn(async move {
            let mut i = 0;
            while !stop.load(Ordering::Relaxed) {
                i = (i + 1) % held.len();
                let mut probe = [0u8; 64];
                // Anything but "nothing to read yet" means the target
                // refused or closed it.
                let closed = !matches!(
                    held[i].try_read(&mut probe),
                    Err(ref e) if e.kind() == std::io::ErrorKind::WouldBlock
                );
                if closed {
                    if let Some(s) = silent_conn("127.0.0.2", target).await {
                        held[i] = s;
                        opened.fetch_add(1, Ordering::Relaxed);
                    }
                    tokio::time::sleep(Duration::from_millis(1)).await;
                } else if i == 0 {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
            }
            held.len()
        })
    };
    let a = engine(secret("s3cret")).await;
    let tries = 40;
    let ok = legit_handshakes(&a, b.segment_name(), tries).await;
    stop.store(true, Ordering::Relaxed);
    let held = flood.await.unwrap();
    eprintln!(
        "legitimate handshakes {ok}/{tries} with {held} unauthenticated connections held \
         ({} opened in all)",
        opened.load(Ordering::Relaxed)
    );
    assert!(
        ok * 100 >= tries * 95,
        "only {ok}/{tries} legitimate handshakes succeeded during the flood"
    );
}

/// Row 2: a flood of ~300 new unauthenticated connections/s from the same
/// address as the legitimate peer, all held open.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn steady_flood_from_the_same_address_keeps_legitimate_handshakes_available() {
    let b = engine(secret("s3cret")).await;
    let target: SocketAddr = b.segment_name().parse().unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let flood = {
        let stop = Arc::clone(&stop);
        tokio::spawn(async move {
            let mut held = Vec::new();
            while !stop.load(Ordering::Relaxed) {
                for _ in 0..3 {
                    if let Some(s) = silent_conn("127.0.0.1", target).await {
                        held.push(s);
                    }
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            held.len()
        })
    };
    tokio::time::sleep(Duration::from_millis(500)).await;
    let a = engine(secret("s3cret")).await;
    let tries = 40;
    let ok = legit_handshakes(&a, b.segment_name(), tries).await;
    stop.store(true, Ordering::Relaxed);
    let opened = flood.await.unwrap();
    eprintln!("legitimate handshakes {ok}/{tries}; {opened} flood connections opened and held");
    assert!(
        ok * 100 >= tries * 95,
        "only {ok}/{tries} legitimate handshakes succeeded during the flood"
    );
}

/// Waits until `s` is closed by the other side (EOF or reset), up to
/// `limit`.
async fn closed_within(s: &mut TcpStream, limit: Duration) -> bool {
    let mut sink = vec![0u8; 4096];
    let r = tokio::time::timeout(limit, async {
        loop {
            match s.read(&mut sink).await {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
        }
    })
    .await;
    r.is_ok()
}

/// Row 3: without a secret, idle connections that completed the handshake
/// fill `max_inbound`; they are closed at the idle deadline, new peers are
/// refused with a retryable `Busy` meanwhile and get in afterwards.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_connections_are_closed_and_do_not_lock_peers_out() {
    let b = engine(
        TcpConfig::builder()
            .max_inbound(32)
            .idle_timeout(Duration::from_millis(1500))
            .evict_idle(Duration::from_secs(3600))
            .build()
            .unwrap(),
    )
    .await;
    let _m = mem(&b, 4096, 0).await;
    let mut idle = Vec::new();
    for _ in 0..32 {
        idle.push(raw_handshake(b.segment_name()).await.0);
    }
    let a = engine(TcpConfig::default()).await;
    let start = Instant::now();
    let mut refused = 0;
    let seg = loop {
        match a.open_segment(b.segment_name()).await {
            Ok(seg) => break seg,
            Err(e) => {
                assert!(e.is_retryable(), "refusal is not retryable: {e:?}");
                assert!(e.to_string().contains("busy"), "not a Busy refusal: {e}");
                refused += 1;
                assert!(
                    start.elapsed() < Duration::from_secs(20),
                    "idle connections still lock peers out after 20 s"
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    };
    eprintln!(
        "refused {refused} times, admitted after {:?}",
        start.elapsed()
    );
    for s in &mut idle {
        assert!(
            closed_within(s, Duration::from_secs(20)).await,
            "an idle connection was not closed"
        );
    }
    a.close_segment(seg).await.unwrap();
}

/// Row 3 with the default (long) idle deadline: `max_inbound` idle
/// connections from another address are evicted, oldest first, for new
/// peers, so they cannot lock anyone out for the idle deadline either.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_connections_are_evicted_for_new_peers() {
    let b = engine(TcpConfig::builder().max_inbound(32).build().unwrap()).await;
    let _m = mem(&b, 4096, 0).await;
    let target: SocketAddr = b.segment_name().parse().unwrap();
    let mut idle = Vec::new();
    for _ in 0..32 {
        let s = silent_conn("127.0.0.2", target).await.expect("connect");
        idle.push(common::raw_handshake_on(s).await.0);
    }
    // Idle long enough to be evictable.
    tokio::time::sleep(TcpConfig::default().evict_idle + Duration::from_millis(200)).await;
    let a = engine(TcpConfig::default()).await;
    let tries = 20;
    let ok = legit_handshakes(&a, b.segment_name(), tries).await;
    eprintln!("legitimate handshakes {ok}/{tries} with max_inbound held by idle connections");
    assert!(ok * 100 >= tries * 95, "only {ok}/{tries} got in");
    let mut closed = 0;
    for s in &mut idle {
        if closed_within(s, Duration::from_millis(100)).await {
            closed += 1;
        }
    }
    assert!(closed >= 1, "no idle connection was evicted");
}

/// Row 3, the legitimate side: an initiator's connection that idles past
/// the target's idle deadline is retired by the initiator first, so the
/// next transfer works at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn initiators_retire_idle_connections_before_the_target_closes_them() {
    let b = engine(
        TcpConfig::builder()
            .idle_timeout(Duration::from_millis(600))
            .build()
            .unwrap(),
    )
    .await;
    let a = engine(TcpConfig::default()).await;
    let dst = mem(&b, 4096, 0).await;
    let src = mem(&a, 4096, 0x42).await;
    let seg = a.open_segment(b.segment_name()).await.unwrap();
    for round in 0..4 {
        a.transfer(seg, TransferRequest::write(src.addr(), dst.addr(), 4096))
            .await
            .unwrap_or_else(|e| panic!("round {round}: {e}"));
        tokio::time::sleep(Duration::from_millis(900)).await;
    }
    assert_eq!(dst.to_vec(), vec![0x42; 4096]);
}

/// Row 4: a flood of 64 KiB notifications: the queue holds at most
/// `MAX_QUEUED_NOTIFICATION_BYTES` counted in allocated bytes (string
/// capacities included), the sender gets a typed, retryable error when it
/// is full, and a drain frees the queue.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn notification_flood_is_bounded_in_allocated_bytes() {
    let b = engine(TcpConfig::default()).await;
    let a = engine(TcpConfig::default()).await;
    let seg = a.open_segment(b.segment_name()).await.unwrap();
    let msg = "x".repeat(ferry_core::MAX_NOTIFICATION_MESSAGE);
    let n = Notification::new("flood", msg.as_str());
    let mut sent = 0usize;
    let full = loop {
        match a.batch_transfer(seg, &[], Some(&n)).await {
            Ok(_) => sent += 1,
            Err(e) => break e,
        }
        assert!(sent < 10_000, "the notification queue never filled");
    };
    assert!(
        full.is_retryable(),
        "a full queue is not retryable: {full:?}"
    );
    assert!(full.to_string().contains("full"), "{full}");
    let taken = b.take_notifications().await.unwrap();
    assert_eq!(taken.len(), sent);
    let allocated: usize = taken
        .iter()
        .map(|n| n.name.capacity() + n.message.capacity())
        .sum::<usize>()
        + taken.len() * std::mem::size_of::<Notification>();
    eprintln!(
        "{sent} notifications queued, {allocated} bytes allocated, bound {MAX_QUEUED_NOTIFICATION_BYTES}"
    );
    assert!(
        allocated <= MAX_QUEUED_NOTIFICATION_BYTES,
        "{allocated} bytes allocated for queued notifications, above the bound"
    );
    // Drained: the sender may go on.
    a.batch_transfer(seg, &[], Some(&n))
        .await
        .expect("notification after a drain");
}

/// Row 5: a peer trickles a 1 MiB WRITE's payload (one byte every 200 ms,
/// never stalling long enough for the stall deadline): the minimum rate
/// cuts it, so `unregister` of the region finishes in bounded time; the
/// same after `shutdown`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn trickling_payload_cannot_hold_unregister_forever() {
    for shutdown_first in [false, true] {
        let b = engine(
            TcpConfig::builder()
                .stall_timeout(Duration::from_secs(1))
                .min_rate(512 * 1024)
                .build()
                .unwrap(),
        )
        .await;
        let target = mem(&b, MIB, 0).await;
        let (mut s, table) = raw_handshake_gens(b.segment_name()).await;
        let w = Request::Write {
            id: 1,
            addr: target.addr(),
            len: MIB as u64,
            gen: gen_of(&table, target.addr()),
        };
        s.write_all(&w.encode()).await.unwrap();
        let trickle = tokio::spawn(async move {
            for _ in 0..600 {
                if s.write_all(&[0x77]).await.is_err() {
                    return true;
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            false
        });
        tokio::time::sleep(Duration::from_millis(300)).await;
        if shutdown_first {
            b.shutdown_now();
        }
        let start = Instant::now();
        // Bound: stall (1 s) + 1 MiB / 512 KiB/s (2 s), with a wide margin.
        let r = tokio::time::timeout(Duration::from_secs(30), b.unregister(target.addr())).await;
        assert!(
            matches!(r, Ok(Ok(()))),
            "unregister did not finish within 30 s (shutdown first: {shutdown_first}): {r:?}"
        );
        eprintln!(
            "unregister returned after {:?} (shutdown first: {shutdown_first})",
            start.elapsed()
        );
        assert!(
            trickle.await.unwrap(),
            "the trickling connection was not dropped"
        );
    }
}

/// Row 6: a WRITE sent with the generation of a region that was since
/// unregistered and registered again at the same address is refused; the
/// new region is untouched. Through the engine, a stale table is refreshed
/// and the request retried.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn frames_never_land_in_memory_registered_after_they_were_sent() {
    let b = engine(TcpConfig::default()).await;
    let buf = mem(&b, 4096, 0).await;
    let (mut s, table) = raw_handshake_gens(b.segment_name()).await;
    let old = gen_of(&table, buf.addr());
    // Re-registered at the same address (the same buffer).
    b.unregister(buf.addr()).await.unwrap();
    // SAFETY: the buffer outlives its registration (the test's transfers finish first).
    b.register(unsafe { buf.region(ferry_core::Location::cpu(0)) })
        .await
        .unwrap();
    let w = Request::Write {
        id: 1,
        addr: buf.addr(),
        len: 64,
        gen: old,
    };
    s.write_all(&w.encode()).await.unwrap();
    s.write_all(&[0xab; 64]).await.unwrap();
    let mut hdr = [0u8; HEADER_LEN];
    s.read_exact(&mut hdr).await.unwrap();
    assert!(
        matches!(
            Response::decode(&hdr).unwrap(),
            Response::Err {
                id: 1,
                status: Status::StaleRegion,
                ..
            }
        ),
        "{:?}",
        Response::decode(&hdr)
    );
    // WRITEV and READ with the old generation: refused too.
    let wv = Request::WriteV {
        id: 2,
        count: 1,
        total: 8,
    };
    s.write_all(&wv.encode()).await.unwrap();
    s.write_all(&ferry_tcp::test_support::frame::encode_segments(&[
        Segment {
            addr: buf.addr(),
            len: 8,
            gen: old,
        },
    ]))
    .await
    .unwrap();
    s.write_all(&[0xcd; 8]).await.unwrap();
    s.read_exact(&mut hdr).await.unwrap();
    assert_eq!(
        Response::decode(&hdr).unwrap(),
        Response::ErrV {
            id: 2,
            status: Status::StaleRegion,
            count: 1
        }
    );
    let mut idx = [0u8; 4];
    s.read_exact(&mut idx).await.unwrap();
    let r = Request::Read {
        id: 3,
        addr: buf.addr(),
        len: 8,
        gen: old,
    };
    s.write_all(&r.encode()).await.unwrap();
    s.read_exact(&mut hdr).await.unwrap();
    assert!(matches!(
        Response::decode(&hdr).unwrap(),
        Response::Err {
            id: 3,
            status: Status::StaleRegion,
            ..
        }
    ));
    assert_eq!(buf.to_vec(), vec![0; 4096], "a stale frame landed");

    // Through the engine: the initiator's table is stale; the target
    // refuses the frames, the initiator refreshes and retries.
    let a = engine(TcpConfig::default()).await;
    let src = mem(&a, 4096, 0x5e).await;
    let seg = a.open_segment(b.segment_name()).await.unwrap();
    b.unregister(buf.addr()).await.unwrap();
    // SAFETY: the buffer outlives its registration (the test's transfers finish first).
    b.register(unsafe { buf.region(ferry_core::Location::cpu(0)) })
        .await
        .unwrap();
    let reqs = [
        TransferRequest::write(src.addr(), buf.addr(), 64),
        TransferRequest::write(src.addr(), buf.addr() + 1024, 2048),
    ];
    let report = a.batch_transfer(seg, &reqs, None).await.unwrap();
    assert!(report.results.iter().all(Result::is_ok), "{report:?}");
    let mut expect = vec![0u8; 4096];
    expect[..64].fill(0x5e);
    expect[1024..3072].fill(0x5e);
    assert_eq!(buf.to_vec(), expect);
}

/// A fake target: answers the v2 handshake with a table of one region of
/// generation 1 covering `[0x1000, 0x1000 + 1 GiB)`, accepts exactly one
/// connection, then runs `then` on it.
async fn fake_target<F, Fut>(then: F) -> String
where
    F: FnOnce(TcpStream) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = ()> + Send,
{
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap().to_string();
    tokio::spawn(async move {
        let (mut s, _) = l.accept().await.unwrap();
        drop(l);
        let mut fixed = [0u8; HELLO_FIXED];
        s.read_exact(&mut fixed).await.unwrap();
        let (_, n) = Hello::decode_fixed(&fixed).unwrap();
        let mut name = vec![0u8; n];
        s.read_exact(&mut name).await.unwrap();
        let hello = Hello {
            version: VERSION,
            flags: 0,
            nonce: [2; 32],
            name: "fake".into(),
        };
        s.write_all(&hello.encode()).await.unwrap();
        let mut proof = [0u8; 32];
        s.read_exact(&mut proof).await.unwrap();
        let mut w = vec![WELCOME];
        w.extend_from_slice(&[0u8; 32]);
        w.extend_from_slice(&600_000u32.to_le_bytes());
        w.extend_from_slice(&1u32.to_le_bytes());
        w.extend_from_slice(&ferry_tcp::test_support::frame::encode_table(&[
            TableEntry {
                addr: 0x1000,
                len: 1 << 30,
                gen: 1,
            },
        ]));
        s.write_all(&w).await.unwrap();
        common::refuse_same_host(&mut s).await;
        then(s).await;
    });
    addr
}

const STUCK: u64 = 0x1000;

/// A fake target for the deadline tests. READ: answered with DATA at
/// ~2 MiB/s. WRITE: payload read and acknowledged, except writes to
/// `STUCK`, never answered.
async fn slow_target() -> String {
    fake_target(|mut s| async move {
        let mut hdr = [0u8; HEADER_LEN];
        while s.read_exact(&mut hdr).await.is_ok() {
            match Request::decode(&hdr).unwrap() {
                Request::Read { id, len, .. } => {
                    s.write_all(&Response::Data { id, len }.encode())
                        .await
                        .unwrap();
                    let chunk = vec![0x3c; 64 * 1024];
                    let mut left = len as usize;
                    while left > 0 {
                        let n = left.min(chunk.len());
                        s.write_all(&chunk[..n]).await.unwrap();
                        left -= n;
                        tokio::time::sleep(Duration::from_millis(30)).await;
                    }
                }
                Request::Write { id, addr, len, .. } => {
                    let mut p = vec![0u8; len as usize];
                    s.read_exact(&mut p).await.unwrap();
                    if addr != STUCK {
                        s.write_all(&Response::Ok { id }.encode()).await.unwrap();
                    }
                }
                other => panic!("unexpected {other:?}"),
            }
        }
    })
    .await
}

/// Row 7: a batch of large READs answered steadily but slower than the
/// base request timeout completes (its deadline scales with its bytes);
/// a batch that never completes fails alone, with `Timeout`, while other
/// batches on the same connection go on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deadlines_scale_with_bytes_and_expire_per_batch() {
    let target = slow_target().await;
    let a = engine(
        TcpConfig::builder()
            .request_timeout(Duration::from_millis(500))
            .min_rate(512 * 1024)
            .chunk_size(4 * MIB)
            .build()
            .unwrap(),
    )
    .await;
    let local = mem(&a, 4 * MIB, 0).await;
    let seg = a.open_segment(&target).await.unwrap();
    // 2 × 1 MiB of reads at ~2 MiB/s: about 1 s, twice the base timeout,
    // well within 0.5 s + 2 MiB / 512 KiB/s = 4.5 s.
    let reqs = [
        TransferRequest::read(local.addr(), 0x10_0000, MIB as u64),
        TransferRequest::read(local.addr() + MIB as u64, 0x20_0000, MIB as u64),
    ];
    let start = Instant::now();
    let report = a.batch_transfer(seg, &reqs, None).await.unwrap();
    eprintln!("2 MiB of slow reads took {:?}", start.elapsed());
    assert!(report.results.iter().all(Result::is_ok), "{report:?}");
    assert_eq!(&local.to_vec()[..2 * MIB], &vec![0x3c; 2 * MIB][..]);

    // A batch that is never answered expires alone; meanwhile unregistering
    // its source waits for it, within the batch deadline. (A new target
    // and a longer base timeout, so that a descheduled test machine does
    // not make the connection look silent.)
    let target = slow_target().await;
    let a = engine(
        TcpConfig::builder()
            .request_timeout(Duration::from_millis(1500))
            .build()
            .unwrap(),
    )
    .await;
    let local = mem(&a, 4096, 0).await;
    let seg = a.open_segment(&target).await.unwrap();
    let a2 = Arc::clone(&a);
    let la = local.addr();
    let stuck_src = mem(&a, 4096, 0x11).await;
    let sa = stuck_src.addr();
    let stuck = tokio::spawn(async move {
        a2.transfer(seg, TransferRequest::write(sa, STUCK, 16))
            .await
    });
    tokio::time::sleep(Duration::from_millis(50)).await;
    let a3 = Arc::clone(&a);
    let unreg = tokio::spawn(async move { a3.unregister(sa).await });
    let mut others = 0;
    while !stuck.is_finished() {
        a.transfer(seg, TransferRequest::write(la, 0x4000, 16))
            .await
            .expect("a batch sharing the connection failed");
        others += 1;
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(others < 2000, "the stuck batch never expired");
    }
    let e = stuck.await.unwrap().unwrap_err();
    assert!(matches!(e, Error::Timeout { .. }), "{e:?}");
    tokio::time::timeout(Duration::from_secs(30), unreg)
        .await
        .expect("unregister of the stuck batch's source did not return")
        .unwrap()
        .expect("unregister");
    // The same connection (the fake target accepts only one) still works.
    a.transfer(seg, TransferRequest::write(la, 0x4000, 16))
        .await
        .expect("the connection survived the expired batch");
    eprintln!("{others} other batches completed while the stuck one waited");
}

/// Row 11: a malformed segment table gets the `Malformed` error frame
/// PROTOCOL.md promises, after the acknowledgements already due.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_segment_table_is_answered_before_closing() {
    let b = engine(TcpConfig::default()).await;
    let target = mem(&b, 4096, 0).await;
    let (mut s, table) = raw_handshake_gens(b.segment_name()).await;
    let gen = gen_of(&table, target.addr());
    let w = Request::Write {
        id: 1,
        addr: target.addr(),
        len: 8,
        gen,
    };
    let mut frames = w.encode().to_vec();
    frames.extend_from_slice(&[1; 8]);
    // Segments adding up to 20, header says 10.
    frames.extend_from_slice(
        &Request::WriteV {
            id: 2,
            count: 1,
            total: 10,
        }
        .encode(),
    );
    frames.extend_from_slice(&ferry_tcp::test_support::frame::encode_segments(&[
        Segment {
            addr: target.addr(),
            len: 20,
            gen,
        },
    ]));
    s.write_all(&frames).await.unwrap();
    let mut got = Vec::new();
    let r = tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut got)).await;
    assert!(r.is_ok(), "the target kept a malformed connection open");
    let hdrs: Vec<Response> = got
        .chunks_exact(HEADER_LEN)
        .map(|c| Response::decode(c.try_into().unwrap()).unwrap())
        .collect();
    assert_eq!(
        hdrs,
        vec![
            Response::Ok { id: 1 },
            Response::Err {
                id: 2,
                status: Status::Malformed,
                addr: 0,
                len: 0
            }
        ]
    );
    assert_eq!(&target.to_vec()[..8], &[1; 8]);
    assert_eq!(&target.to_vec()[8..], &[0; 4088][..]);
}

/// Row 12: a handshake that times out names the deadline that passed; a
/// target that stalls the handshake is dropped at its handshake deadline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handshake_timeouts_name_their_deadline() {
    // A "target" that accepts and says nothing.
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let _hold = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((s, _)) = l.accept().await {
            held.push(s);
        }
    });
    let a = engine(
        TcpConfig::builder()
            .connect_timeout(Duration::from_millis(300))
            .build()
            .unwrap(),
    )
    .await;
    let e = a.open_segment(&addr).await.unwrap_err();
    match &e {
        Error::Timeout { after, .. } => assert_eq!(*after, Duration::from_millis(300), "{e}"),
        other => panic!("expected Timeout, got {other:?}"),
    }
    assert!(!e.to_string().contains("after 0ns"), "{e}");
    // The target side: a silent initiator is dropped at the handshake
    // deadline.
    let b = engine(
        TcpConfig::builder()
            .handshake_timeout(Duration::from_millis(300))
            .build()
            .unwrap(),
    )
    .await;
    let mut s = TcpStream::connect(b.segment_name()).await.unwrap();
    assert!(closed_within(&mut s, Duration::from_secs(10)).await);
}

/// Busy is a typed rejection the initiator reports as retryable.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_initiators_get_a_retryable_busy() {
    let b = engine(
        TcpConfig::builder()
            .max_inbound(1)
            .evict_idle(Duration::from_secs(3600))
            .build()
            .unwrap(),
    )
    .await;
    let _first = raw_handshake(b.segment_name()).await;
    let a = engine(TcpConfig::default()).await;
    let e = a.open_segment(b.segment_name()).await.unwrap_err();
    assert!(
        matches!(&e, Error::SegmentUnavailable { reason, .. } if reason.contains("busy")),
        "{e:?}"
    );
    assert!(e.is_retryable());
    // The raw bytes: REJECT, Busy, reason.
    let mut s = TcpStream::connect(b.segment_name()).await.unwrap();
    let mut got = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut got)).await;
    assert_eq!(got.get(..2), Some(&[REJECT, Status::Busy as u8][..]));
}

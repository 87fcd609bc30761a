//! Failure behaviour over real loopback sockets: dead peers (a killed child
//! process and a dropped engine), wrong secrets, peers speaking garbage,
//! stalled peers and unregister during transfers. Each test asserts the
//! typed error and that nothing else was lost or corrupted.

mod common;

use ferry_core::DynTransferEngine;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use common::{engine, mem, pattern, raw_handshake};
use ferry_core::{Error, Side, TransferEngine, TransferRequest, TransferState};
use ferry_tcp::test_support::frame::{Request, Response, Status, HEADER_LEN};
use ferry_tcp::TcpConfig;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpListener;

const MIB: usize = 1 << 20;

/// WRITEV/READV segments, all in regions of generation `gen`.
fn segments(segs: &[(u64, u64)], gen: u32) -> Vec<u8> {
    let segs: Vec<ferry_tcp::test_support::frame::Segment> = segs
        .iter()
        .map(|&(addr, len)| ferry_tcp::test_support::frame::Segment { addr, len, gen })
        .collect();
    ferry_tcp::test_support::frame::encode_segments(&segs)
}

fn secret(s: &str) -> TcpConfig {
    TcpConfig::builder().secret(s).build().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_secret_is_refused_before_memory_is_touched() {
    let b = engine(secret("right")).await;
    let target = mem(&b, 4096, 0x11).await;
    for (who, cfg) in [
        ("wrong secret", secret("wrong")),
        ("no secret", TcpConfig::default()),
    ] {
        let a = engine(cfg).await;
        let e = a.open_segment(b.segment_name()).await.unwrap_err();
        assert!(
            matches!(&e, Error::Authentication { peer, .. } if peer == b.segment_name()),
            "{who}: expected Authentication naming the peer, got {e:?}"
        );
    }
    // A raw peer that ignores the refusal and sends a WRITE anyway.
    {
        let mut s = tokio::net::TcpStream::connect(b.segment_name())
            .await
            .unwrap();
        let hello = ferry_tcp::test_support::frame::Hello {
            version: ferry_tcp::test_support::frame::VERSION,
            flags: 0,
            nonce: [0; 32],
            name: "intruder".into(),
        };
        s.write_all(&hello.encode()).await.unwrap();
        s.write_all(&[0u8; 32]).await.unwrap();
        let w = Request::Write {
            id: 1,
            addr: target.addr(),
            len: 4096,
            gen: 1,
        };
        let _ = s.write_all(&w.encode()).await;
        let _ = s.write_all(&[0xee; 4096]).await;
        let mut sink = Vec::new();
        let _ = tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut sink)).await;
        assert!(
            sink.contains(&ferry_tcp::test_support::frame::REJECT),
            "the target did not send a rejection"
        );
    }
    assert_eq!(
        target.to_vec(),
        vec![0x11; 4096],
        "target memory changed after refused peers"
    );
    // The target proves itself too: an initiator with a secret refuses an
    // unauthenticated target.
    let open = engine(TcpConfig::default()).await;
    let a = engine(secret("right")).await;
    let e = a.open_segment(open.segment_name()).await.unwrap_err();
    assert!(matches!(e, Error::Authentication { .. }), "got {e:?}");
    // The right secret works.
    let src = mem(&a, 4096, 0x22).await;
    let seg = a
        .open_segment(b.segment_name())
        .await
        .expect("right secret");
    a.transfer(seg, TransferRequest::write(src.addr(), target.addr(), 4096))
        .await
        .expect("authenticated write");
    assert_eq!(target.to_vec(), vec![0x22; 4096]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_from_an_initiator_is_refused_and_nothing_else_changes() {
    let b = engine(TcpConfig::default()).await;
    let target = mem(&b, 64 * 1024, 0x33).await;
    let mut expect = vec![0x33u8; 64 * 1024];

    // Pure garbage instead of a hello: closed.
    let mut s = tokio::net::TcpStream::connect(b.segment_name())
        .await
        .unwrap();
    let _ = s.write_all(&pattern(9, 8192)).await;
    let mut sink = Vec::new();
    let r = tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut sink)).await;
    assert!(r.is_ok(), "the target kept a garbage connection open");

    // A valid handshake, then requests.
    let (mut s, table) = common::raw_handshake_gens(b.segment_name()).await;
    let gen = common::gen_of(&table, target.addr());
    let table: Vec<(u64, u64)> = table.iter().map(|e| (e.addr, e.len)).collect();
    assert_eq!(table, vec![(target.addr(), 64 * 1024)], "advertised table");
    // Out of bounds (straddles the end): ERR AddressNotRegistered, payload
    // skipped, connection still usable.
    let oob = Request::Write {
        id: 7,
        addr: target.addr() + 60 * 1024,
        len: 20_000,
        gen,
    };
    s.write_all(&oob.encode()).await.unwrap();
    s.write_all(&[0xee; 20_000]).await.unwrap();
    let mut hdr = [0u8; HEADER_LEN];
    s.read_exact(&mut hdr).await.unwrap();
    assert_eq!(
        Response::decode(&hdr).unwrap(),
        Response::Err {
            id: 7,
            status: Status::AddressNotRegistered,
            addr: target.addr() + 60 * 1024,
            len: 20_000
        }
    );
    // A valid write on the same connection lands.
    let ok = Request::Write {
        id: 8,
        addr: target.addr() + 100,
        len: 10,
        gen,
    };
    s.write_all(&ok.encode()).await.unwrap();
    s.write_all(&[0x44; 10]).await.unwrap();
    s.read_exact(&mut hdr).await.unwrap();
    assert_eq!(Response::decode(&hdr).unwrap(), Response::Ok { id: 8 });
    expect[100..110].fill(0x44);
    // A READ that straddles: refused.
    let rd = Request::Read {
        id: 9,
        addr: target.addr() - 1,
        len: 2,
        gen,
    };
    s.write_all(&rd.encode()).await.unwrap();
    s.read_exact(&mut hdr).await.unwrap();
    assert!(matches!(
        Response::decode(&hdr).unwrap(),
        Response::Err {
            id: 9,
            status: Status::AddressNotRegistered,
            ..
        }
    ));
    // A header with an absurd length, then garbage: the connection is
    // closed without touching memory.
    let mut huge = Request::Write {
        id: 10,
        addr: target.addr(),
        len: 1,
        gen,
    }
    .encode();
    huge[24..32].copy_from_slice(&u64::MAX.to_le_bytes());
    s.write_all(&huge).await.unwrap();
    let _ = s.write_all(&[0x55; 4096]).await;
    let mut rest = Vec::new();
    let r = tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut rest)).await;
    assert!(r.is_ok(), "the target kept a malformed connection open");
    // Unknown frame kind on a fresh connection: closed too.
    let (mut s, _) = raw_handshake(b.segment_name()).await;
    let _ = s.write_all(&[0x7f; HEADER_LEN]).await;
    let mut rest = Vec::new();
    let r = tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut rest)).await;
    assert!(r.is_ok(), "the target kept a garbage connection open");

    assert_eq!(target.to_vec(), expect, "target memory corrupted");
    // The engine still serves a proper peer.
    let a = engine(TcpConfig::default()).await;
    let src = mem(&a, 4096, 0x66).await;
    let seg = a.open_segment(b.segment_name()).await.unwrap();
    common::assert_tls(&a, b.segment_name());
    a.transfer(seg, TransferRequest::write(src.addr(), target.addr(), 4096))
        .await
        .expect("engine still serves after garbage");
    expect[..4096].fill(0x66);
    assert_eq!(target.to_vec(), expect);
}

/// A fake target: answers the handshake, then runs `then` on the stream.
async fn fake_target<F, Fut>(then: F) -> String
where
    F: FnOnce(tokio::net::TcpStream) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = ()> + Send,
{
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap().to_string();
    tokio::spawn(async move {
        let (mut s, _) = l.accept().await.unwrap();
        let mut fixed = [0u8; ferry_tcp::test_support::frame::HELLO_FIXED];
        s.read_exact(&mut fixed).await.unwrap();
        let (_, n) = ferry_tcp::test_support::frame::Hello::decode_fixed(&fixed).unwrap();
        let mut name = vec![0u8; n];
        s.read_exact(&mut name).await.unwrap();
        let hello = ferry_tcp::test_support::frame::Hello {
            version: ferry_tcp::test_support::frame::VERSION,
            flags: 0,
            nonce: [2; 32],
            name: "fake".into(),
        };
        s.write_all(&hello.encode()).await.unwrap();
        let mut proof = [0u8; 32];
        s.read_exact(&mut proof).await.unwrap();
        // Welcome with a table covering everything the test uses.
        let mut w = vec![ferry_tcp::test_support::frame::WELCOME];
        w.extend_from_slice(&[0u8; 32]);
        w.extend_from_slice(&60_000u32.to_le_bytes());
        w.extend_from_slice(&1u32.to_le_bytes());
        w.extend_from_slice(&ferry_tcp::test_support::frame::encode_table(&[
            ferry_tcp::test_support::frame::TableEntry {
                addr: 0x1000,
                len: u64::MAX / 2,
                gen: 1,
            },
        ]));
        s.write_all(&w).await.unwrap();
        common::refuse_same_host(&mut s).await;
        then(s).await;
    });
    addr
}

/// A long send keeps only a window of its slices unanswered: with a target
/// that reads every frame but answers none, the sender stops after four
/// 1 MiB slices (instead of pushing the whole batch into the kernel's
/// socket buffers, where a small call written between slices would queue
/// behind all of it); once answered, the rest follows and the batch
/// succeeds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_send_waits_for_answers_to_its_earlier_slices() {
    const BLOCKS: u64 = 16;
    let (seen_tx, seen_rx) = tokio::sync::oneshot::channel::<usize>();
    let addr = fake_target(move |mut s| async move {
        async fn frame(s: &mut tokio::net::TcpStream) -> u64 {
            let mut hdr = [0u8; HEADER_LEN];
            s.read_exact(&mut hdr).await.unwrap();
            let Ok(Request::Write { id, len, .. }) = Request::decode(&hdr) else {
                panic!("not a WRITE");
            };
            let mut payload = vec![0u8; len as usize];
            s.read_exact(&mut payload).await.unwrap();
            id
        }
        // Read without answering until nothing more comes.
        let mut ids = Vec::new();
        while let Ok(id) = tokio::time::timeout(Duration::from_millis(500), frame(&mut s)).await {
            ids.push(id);
        }
        let _ = seen_tx.send(ids.len());
        // Then answer those, and every later frame as it comes.
        for id in &ids {
            s.write_all(&Response::Ok { id: *id }.encode())
                .await
                .unwrap();
        }
        for _ in ids.len()..BLOCKS as usize {
            let id = frame(&mut s).await;
            s.write_all(&Response::Ok { id }.encode()).await.unwrap();
        }
        tokio::time::sleep(Duration::from_secs(5)).await;
    })
    .await;
    let a = engine(TcpConfig::builder().connections(1).build().unwrap()).await;
    let local = mem(&a, BLOCKS as usize * MIB, 0x5a).await;
    let seg = a.open_segment(&addr).await.unwrap();
    let reqs: Vec<TransferRequest> = (0..BLOCKS)
        .map(|i| {
            let off = i * MIB as u64;
            TransferRequest::write(local.addr() + off, 0x10_0000 + off, MIB as u64)
        })
        .collect();
    let batch = {
        let a = Arc::clone(&a);
        tokio::spawn(async move { a.batch_transfer(seg, &reqs, None).await })
    };
    let seen = seen_rx.await.unwrap();
    assert!(
        (1..=5).contains(&seen),
        "{seen} slices of 1 MiB were sent before any was answered (at most 5 expected)"
    );
    let report = tokio::time::timeout(Duration::from_secs(30), batch)
        .await
        .expect("the batch went on once answered")
        .unwrap()
        .unwrap();
    report.into_result().unwrap();
}

/// A target that reads everything and never answers: a long send waiting
/// for its window (FAIR_WINDOW) must not wait past the batch's deadline;
/// the batch fails with a timeout, as it did before the window.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_send_to_a_target_that_never_answers_times_out() {
    const BLOCKS: u64 = 16;
    let addr = fake_target(move |mut s| async move {
        // Read whatever comes, answer nothing, until the initiator closes.
        let mut sink = vec![0u8; 1 << 20];
        while let Ok(Ok(n)) = tokio::time::timeout(Duration::from_secs(60), s.read(&mut sink)).await
        {
            if n == 0 {
                break;
            }
        }
    })
    .await;
    let a = engine(
        TcpConfig::builder()
            .connections(1)
            .request_timeout(Duration::from_millis(500))
            .min_rate(1 << 30)
            .build()
            .unwrap(),
    )
    .await;
    let local = mem(&a, BLOCKS as usize * MIB, 0x3c).await;
    let seg = a.open_segment(&addr).await.unwrap();
    let reqs: Vec<TransferRequest> = (0..BLOCKS)
        .map(|i| {
            let off = i * MIB as u64;
            TransferRequest::write(local.addr() + off, 0x10_0000 + off, MIB as u64)
        })
        .collect();
    let outcome = tokio::time::timeout(Duration::from_secs(20), a.batch_transfer(seg, &reqs, None))
        .await
        .expect("the batch waited past its deadline for answers that never came");
    let e = match outcome {
        Ok(report) => report.into_result().unwrap_err(),
        Err(e) => e,
    };
    let first = match &e {
        Error::BatchFailed { first, .. } => first.as_ref(),
        e => e,
    };
    assert!(
        matches!(first, Error::Timeout { .. }),
        "expected a timeout, got {e:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_from_a_target_fails_only_its_requests() {
    let a = engine(TcpConfig::builder().connections(1).build().unwrap()).await;
    let local = mem(&a, 64 * 1024, 0x77).await;
    let good = engine(TcpConfig::default()).await;
    let good_mem = mem(&good, 4096, 0).await;
    let good_seg = a.open_segment(good.segment_name()).await.unwrap();

    // A target that garbles its hello.
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap().to_string();
    tokio::spawn(async move {
        let (mut s, _) = l.accept().await.unwrap();
        let _ = s.write_all(&pattern(3, 4096)).await;
        tokio::time::sleep(Duration::from_secs(5)).await;
    });
    let e = a.open_segment(&addr).await.unwrap_err();
    assert!(matches!(e, Error::Protocol { .. }), "got {e:?}");

    // A target that answers a READ with DATA for another id and another
    // length: the request fails with Protocol and local memory is intact.
    let addr = fake_target(|mut s| async move {
        let mut hdr = [0u8; HEADER_LEN];
        s.read_exact(&mut hdr).await.unwrap();
        let bogus = Response::Data {
            id: 999_999,
            len: 1 << 20,
        };
        let _ = s.write_all(&bogus.encode()).await;
        let _ = s.write_all(&vec![0xab; 1 << 20]).await;
        tokio::time::sleep(Duration::from_secs(5)).await;
    })
    .await;
    let seg = a.open_segment(&addr).await.unwrap();
    let e = a
        .transfer(seg, TransferRequest::read(local.addr(), 0x2000, 4096))
        .await
        .unwrap_err();
    assert!(matches!(e, Error::Protocol { .. }), "got {e:?}");
    assert_eq!(
        local.to_vec(),
        vec![0x77; 64 * 1024],
        "local memory changed"
    );

    // A target that claims an impossible ack count.
    let addr = fake_target(|mut s| async move {
        let mut hdr = [0u8; HEADER_LEN];
        let _ = s.read_exact(&mut hdr).await;
        let mut bad = Response::OkMany { count: 1 }.encode();
        bad[4..8].copy_from_slice(&u32::MAX.to_le_bytes());
        let _ = s.write_all(&bad).await;
        tokio::time::sleep(Duration::from_secs(5)).await;
    })
    .await;
    let seg = a.open_segment(&addr).await.unwrap();
    let e = a
        .transfer(seg, TransferRequest::write(local.addr(), 0x2000, 4096))
        .await
        .unwrap_err();
    assert!(matches!(e, Error::Protocol { .. }), "got {e:?}");

    // The healthy peer was not affected.
    a.transfer(
        good_seg,
        TransferRequest::write(local.addr(), good_mem.addr(), 4096),
    )
    .await
    .expect("other peer still works");
    assert_eq!(good_mem.to_vec(), vec![0x77; 4096]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalled_target_times_out_and_others_keep_working() {
    let a = engine(
        TcpConfig::builder()
            .request_timeout(Duration::from_millis(300))
            .build()
            .unwrap(),
    )
    .await;
    let local = mem(&a, 4096, 0x12).await;
    let addr = fake_target(|s| async move {
        // Read nothing, answer nothing.
        tokio::time::sleep(Duration::from_secs(30)).await;
        drop(s);
    })
    .await;
    let seg = a.open_segment(&addr).await.unwrap();
    let e = a
        .transfer(seg, TransferRequest::write(local.addr(), 0x2000, 64))
        .await
        .unwrap_err();
    assert!(
        matches!(&e, Error::Timeout { peer: Some(p), .. } if *p == addr),
        "expected Timeout naming the peer, got {e:?}"
    );
    assert!(e.is_retryable());
    let good = engine(TcpConfig::default()).await;
    let gm = mem(&good, 4096, 0).await;
    let gs = a.open_segment(good.segment_name()).await.unwrap();
    a.transfer(gs, TransferRequest::write(local.addr(), gm.addr(), 4096))
        .await
        .unwrap();
    assert_eq!(gm.to_vec(), vec![0x12; 4096]);
}

/// Target side: a region cannot be unregistered while a peer's WRITE into
/// it is half received; once the frame completes, unregister returns and
/// later requests are refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unregister_waits_for_an_inbound_write() {
    let b = engine(TcpConfig::default()).await;
    let target = mem(&b, MIB, 0).await;
    let (mut s, table) = common::raw_handshake_gens(b.segment_name()).await;
    let gen = common::gen_of(&table, target.addr());
    let w = Request::Write {
        id: 1,
        addr: target.addr(),
        len: MIB as u64,
        gen,
    };
    s.write_all(&w.encode()).await.unwrap();
    s.write_all(&vec![0x99; MIB / 2]).await.unwrap();
    // Let the target start receiving into the region.
    tokio::time::sleep(Duration::from_millis(100)).await;
    let b2 = b.clone();
    let addr = target.addr();
    let unreg = tokio::spawn(async move { b2.unregister(addr).await });
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(
        !unreg.is_finished(),
        "unregister returned while a WRITE into the region was in flight"
    );
    s.write_all(&vec![0x99; MIB / 2]).await.unwrap();
    let mut hdr = [0u8; HEADER_LEN];
    s.read_exact(&mut hdr).await.unwrap();
    assert_eq!(Response::decode(&hdr).unwrap(), Response::Ok { id: 1 });
    unreg.await.unwrap().expect("unregister");
    assert_eq!(
        target.to_vec(),
        vec![0x99; MIB],
        "the write did not fully land"
    );
    // The region is gone: a new write is refused.
    let w = Request::Write {
        id: 2,
        addr: target.addr(),
        len: 16,
        gen,
    };
    s.write_all(&w.encode()).await.unwrap();
    s.write_all(&[1; 16]).await.unwrap();
    s.read_exact(&mut hdr).await.unwrap();
    assert!(matches!(
        Response::decode(&hdr).unwrap(),
        Response::Err {
            id: 2,
            status: Status::AddressNotRegistered,
            ..
        }
    ));
    assert_eq!(target.to_vec(), vec![0x99; MIB]);
}

/// Initiator side: unregistering the local source during a large write
/// returns only after the write finished, and the write is complete.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unregister_waits_for_an_outbound_transfer() {
    let a = engine(TcpConfig::default()).await;
    let b = engine(TcpConfig::default()).await;
    let len = 64 * MIB;
    let src = mem(&a, len, 0).await;
    src.write(0, &pattern(5, len)).unwrap();
    let dst = mem(&b, len, 0).await;
    let seg = a.open_segment(b.segment_name()).await.unwrap();
    common::assert_tls(&a, b.segment_name());
    common::assert_path(&a, b.segment_name());
    let a2 = a.clone();
    let (sa, da) = (src.addr(), dst.addr());
    let xfer = tokio::spawn(async move {
        a2.transfer(seg, TransferRequest::write(sa, da, len as u64))
            .await
    });
    tokio::time::sleep(Duration::from_millis(5)).await;
    a.unregister(src.addr()).await.expect("unregister");
    // What the destination holds the moment unregister returned.
    let snapshot = dst.to_vec();
    match xfer.await.unwrap() {
        Ok(()) => assert!(
            snapshot == pattern(5, len),
            "unregister returned before the transfer that succeeded had landed"
        ),
        // The unregister won the race: refused up front, nothing moved.
        Err(Error::AddressNotRegistered {
            side: Side::Local, ..
        }) => assert!(snapshot.iter().all(|b| *b == 0)),
        Err(e) => panic!("unexpected error {e:?}"),
    }
    let e = a
        .transfer(seg, TransferRequest::write(sa, da, 16))
        .await
        .unwrap_err();
    assert!(matches!(
        e,
        Error::AddressNotRegistered {
            side: Side::Local,
            ..
        }
    ));
}

/// A dropped target engine mid-batch: its requests fail with typed,
/// retryable errors; another peer is unaffected; the next use of the dead
/// segment reconnects (and fails cleanly, nobody listens).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_target_engine_mid_batch() {
    let a = engine(TcpConfig::default()).await;
    let b = engine(TcpConfig::default()).await;
    let c = engine(TcpConfig::default()).await;
    let src = mem(&a, 4 * MIB, 0).await;
    src.write(0, &pattern(7, 4 * MIB)).unwrap();
    let bm = mem(&b, 64 * MIB, 0).await;
    let cm = mem(&c, 4 * MIB, 0).await;
    let sb = a.open_segment(b.segment_name()).await.unwrap();
    let sc = a.open_segment(c.segment_name()).await.unwrap();
    common::assert_tls(&a, c.segment_name());
    // 4 GiB: same-host copies run at several GB/s, and the batch must
    // still be running when the target goes.
    let reqs: Vec<_> = (0..1024)
        .map(|i| {
            TransferRequest::write(src.addr(), bm.addr() + ((i % 16) * 4 * MIB) as u64, 4 << 20)
        })
        .collect();
    let batch = a.submit(sb, &reqs, None).await.unwrap();
    wait_until_some_completed(&*a, batch).await;
    let name = b.segment_name().to_owned();
    drop(b);
    let report = a.wait(batch).await.unwrap();
    check_failures(&report, &name);
    // The other peer works, during and after.
    a.transfer(sc, TransferRequest::write(src.addr(), cm.addr(), 4 << 20))
        .await
        .unwrap();
    assert!(cm.to_vec() == pattern(7, 4 * MIB));
    assert!(src.to_vec() == pattern(7, 4 * MIB), "source corrupted");
    // Next use reconnects: nobody listens any more.
    let e = a
        .transfer(sb, TransferRequest::write(src.addr(), bm.addr(), 16))
        .await
        .unwrap_err();
    assert!(e.is_retryable(), "got {e:?}");
    assert!(
        matches!(
            e,
            Error::SegmentUnavailable { .. } | Error::PeerLost { .. } | Error::Timeout { .. }
        ),
        "got {e:?}"
    );
}

async fn wait_until_some_completed(a: &dyn DynTransferEngine, batch: ferry_core::BatchId) {
    loop {
        let st = a.status(batch).unwrap();
        if st
            .states
            .iter()
            .any(|s| matches!(s, TransferState::Completed))
        {
            return;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

fn check_failures(report: &ferry_core::BatchReport, peer: &str) {
    let failed: Vec<_> = report.failures().collect();
    assert!(
        !failed.is_empty(),
        "every request succeeded although the peer died mid-batch"
    );
    assert!(report.results.iter().any(Result::is_ok));
    for (i, e) in failed {
        let names_peer = match e {
            Error::PeerLost { peer: p, .. } => p == peer,
            Error::Timeout { peer: Some(p), .. } => p == peer,
            Error::SegmentUnavailable { name, .. } => name == peer,
            Error::Canceled(_) => true,
            _ => false,
        };
        assert!(
            (names_peer && e.is_retryable()) || matches!(e, Error::Canceled(_)),
            "request {i}: unexpected error {e:?}"
        );
    }
}

const CHILD_ENV: &str = "FERRY_TCP_TEST_CHILD";

/// Helper process for `killed_peer_process_mid_batch`: an engine with a
/// 64 MiB region that prints its name and address, then serves until
/// killed.
#[test]
#[ignore = "helper process spawned by killed_peer_process_mid_batch"]
fn child_engine_process() {
    if std::env::var(CHILD_ENV).is_err() {
        // Not a test of its own: only the parent test runs it, as a child.
        return;
    }
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let e = engine(TcpConfig::default()).await;
        let m = mem(&e, 64 * MIB, 0).await;
        println!("READY {} {}", e.segment_name(), m.addr());
        tokio::time::sleep(Duration::from_secs(600)).await;
        drop(m);
    });
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_peer_process_mid_batch() {
    let exe = std::env::current_exe().unwrap();
    let mut child = Command::new(exe)
        .args([
            "--exact",
            "child_engine_process",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_ENV, "1")
        .envs(common::child_env())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let stdout = tokio::process::ChildStdout::from_std(child.stdout.take().unwrap()).unwrap();
    let mut lines = BufReader::new(stdout).lines();
    let (name, addr) = loop {
        let line = tokio::time::timeout(Duration::from_secs(60), lines.next_line())
            .await
            .expect("child did not start")
            .unwrap()
            .expect("child exited early");
        if let Some(pos) = line.find("READY ") {
            let rest = &line[pos + 6..];
            let mut it = rest.split_whitespace();
            let name = it.next().unwrap().to_owned();
            let addr: u64 = it.next().unwrap().parse().unwrap();
            break (name, addr);
        }
    };
    let a = engine(TcpConfig::default()).await;
    let c = engine(TcpConfig::default()).await;
    let src = mem(&a, 4 * MIB, 0).await;
    src.write(0, &pattern(8, 4 * MIB)).unwrap();
    let cm = mem(&c, 4 * MIB, 0).await;
    let seg = a.open_segment(&name).await.unwrap();
    let sc = a.open_segment(c.segment_name()).await.unwrap();
    // Two processes: the cross-memory path unless FERRY_TEST_SAME_HOST=off.
    common::assert_path(&a, &name);
    let reqs: Vec<_> = (0..256)
        .map(|i| TransferRequest::write(src.addr(), addr + ((i % 16) * 4 * MIB) as u64, 4 << 20))
        .collect();
    let batch = a.submit(seg, &reqs, None).await.unwrap();
    wait_until_some_completed(&*a, batch).await;
    child.kill().unwrap();
    let _ = child.wait();
    let report = a.wait(batch).await.unwrap();
    check_failures(&report, &name);
    a.transfer(sc, TransferRequest::write(src.addr(), cm.addr(), 4 << 20))
        .await
        .unwrap();
    assert!(
        cm.to_vec() == pattern(8, 4 * MIB),
        "other peer's data wrong"
    );
    assert!(src.to_vec() == pattern(8, 4 * MIB), "source corrupted");
    let e = a
        .transfer(seg, TransferRequest::write(src.addr(), addr, 16))
        .await
        .unwrap_err();
    // Refused (nothing listens), or lost. Or `Protocol`: the dead peer's
    // port is free, and another engine of this test binary, binding port
    // 0 at the same moment, may have been given it (seen once in a CI run
    // with TLS on: that listener reset our hello) — a typed "not the peer
    // you meant", which is also a clean failure.
    assert!(
        matches!(
            e,
            Error::SegmentUnavailable { .. } | Error::PeerLost { .. } | Error::Protocol { .. }
        ),
        "after the kill, next use should reconnect and fail cleanly: {e:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reconnects_after_connection_loss() {
    // Engine b is replaced by a new engine on the same port: the next use
    // of the old handle reconnects and works.
    let b = engine(TcpConfig::default()).await;
    let port_name = b.segment_name().to_owned();
    let a = engine(TcpConfig::default()).await;
    let src = mem(&a, 4096, 0x5c).await;
    let seg = a.open_segment(&port_name).await.unwrap();
    drop(b);
    tokio::time::sleep(Duration::from_millis(50)).await;
    let b2 = engine(
        TcpConfig::builder()
            .listen(port_name.clone())
            .build()
            .unwrap(),
    )
    .await;
    let m = mem(&b2, 4096, 0).await;
    // The first use may still see the dead connection; it must not panic
    // and the one after must succeed.
    let first = a
        .transfer(seg, TransferRequest::write(src.addr(), m.addr(), 4096))
        .await;
    if let Err(e) = &first {
        assert!(e.is_retryable(), "got {e:?}");
        a.transfer(seg, TransferRequest::write(src.addr(), m.addr(), 4096))
            .await
            .expect("reconnected");
    }
    assert_eq!(m.to_vec(), vec![0x5c; 4096]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn too_many_inbound_connections_are_refused() {
    let b = engine(
        TcpConfig::builder()
            .max_inbound(2)
            // All from one source here: the per-source share is not the bound
            // under test (see tests/admission.rs).
            .max_per_source(2)
            .evict_idle(Duration::from_secs(3600))
            .build()
            .unwrap(),
    )
    .await;
    let _c1 = raw_handshake(b.segment_name()).await;
    let _c2 = raw_handshake(b.segment_name()).await;
    let mut s = tokio::net::TcpStream::connect(b.segment_name())
        .await
        .unwrap();
    let mut buf = Vec::new();
    let r = tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut buf)).await;
    assert!(matches!(r, Ok(Ok(_))), "third connection not closed: {r:?}");
    // Refused with Busy, not silently.
    assert_eq!(
        buf.get(..2),
        Some(&[ferry_tcp::test_support::frame::REJECT, Status::Busy as u8][..]),
        "third connection not refused with Busy: {buf:?}"
    );
}

/// WRITEV from a raw peer: refused segments are listed in ERRV and only
/// they are skipped; overlapping segments land in order; a segment table
/// that does not add up closes the connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writev_segments_are_checked_one_by_one() {
    let b = engine(TcpConfig::default()).await;
    let target = mem(&b, 4096, 0).await;
    let (mut s, table) = common::raw_handshake_gens(b.segment_name()).await;
    let gen = common::gen_of(&table, target.addr());
    let encode_table = |segs: &[(u64, u64)]| segments(segs, gen);
    let t = target.addr();
    let segs = [(t, 100u64), (t + 4000, 200), (t + 200, 50)];
    let w = Request::WriteV {
        id: 1,
        count: 3,
        total: 350,
    };
    s.write_all(&w.encode()).await.unwrap();
    s.write_all(&encode_table(&segs)).await.unwrap();
    s.write_all(&[0x11; 100]).await.unwrap();
    s.write_all(&[0x22; 200]).await.unwrap();
    s.write_all(&[0x33; 50]).await.unwrap();
    let mut hdr = [0u8; HEADER_LEN];
    s.read_exact(&mut hdr).await.unwrap();
    assert_eq!(
        Response::decode(&hdr).unwrap(),
        Response::ErrV {
            id: 1,
            status: Status::AddressNotRegistered,
            count: 1
        }
    );
    let mut idx = [0u8; 4];
    s.read_exact(&mut idx).await.unwrap();
    assert_eq!(u32::from_le_bytes(idx), 1);
    let mut expect = vec![0u8; 4096];
    expect[..100].fill(0x11);
    expect[200..250].fill(0x33);
    assert_eq!(target.to_vec(), expect);
    // Overlapping segments: applied in order.
    let segs = [(t + 1000, 100u64), (t + 1050, 100)];
    let w = Request::WriteV {
        id: 2,
        count: 2,
        total: 200,
    };
    s.write_all(&w.encode()).await.unwrap();
    s.write_all(&encode_table(&segs)).await.unwrap();
    s.write_all(&[0x44; 100]).await.unwrap();
    s.write_all(&[0x55; 100]).await.unwrap();
    s.read_exact(&mut hdr).await.unwrap();
    assert_eq!(Response::decode(&hdr).unwrap(), Response::Ok { id: 2 });
    expect[1000..1050].fill(0x44);
    expect[1050..1150].fill(0x55);
    assert_eq!(target.to_vec(), expect);
    // Lengths that do not add up to the header's total: closed, untouched.
    let w = Request::WriteV {
        id: 3,
        count: 1,
        total: 10,
    };
    s.write_all(&w.encode()).await.unwrap();
    s.write_all(&encode_table(&[(t, 20)])).await.unwrap();
    let _ = s.write_all(&[0x66; 20]).await;
    let mut rest = Vec::new();
    let r = tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut rest)).await;
    assert!(r.is_ok(), "the target kept a malformed connection open");
    assert_eq!(target.to_vec(), expect);
}

/// The initiator's copy of the target's table is stale (a region was
/// unregistered since): the target refuses exactly the affected requests
/// of a gathered batch and the others land.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stale_table_fails_only_the_affected_requests() {
    let a = engine(TcpConfig::default()).await;
    let b = engine(TcpConfig::default()).await;
    let src = mem(&a, 4096, 0x7a).await;
    let r1 = mem(&b, 4096, 0).await;
    let r2 = mem(&b, 4096, 0).await;
    let seg = a.open_segment(b.segment_name()).await.unwrap();
    common::assert_tls(&a, b.segment_name());
    b.unregister(r2.addr()).await.unwrap();
    let reqs = [
        TransferRequest::write(src.addr(), r1.addr(), 64),
        TransferRequest::write(src.addr(), r2.addr(), 64),
        TransferRequest::write(src.addr(), r1.addr() + 128, 64),
    ];
    let report = a.batch_transfer(seg, &reqs, None).await.unwrap();
    assert!(
        report.results[0].is_ok() && report.results[2].is_ok(),
        "{report:?}"
    );
    assert!(
        matches!(
            &report.results[1],
            Err(Error::AddressNotRegistered { side: Side::Remote, addr, len: 64, peer: Some(p) })
                if *addr == r2.addr() && p == b.segment_name()
        ),
        "{report:?}"
    );
    let mut expect = vec![0u8; 4096];
    expect[..64].fill(0x7a);
    expect[128..192].fill(0x7a);
    assert_eq!(r1.to_vec(), expect);
    assert_eq!(r2.to_vec(), vec![0u8; 4096], "unregistered region written");
}

/// READV: refused segments are listed in DATAV and the data of the others
/// follows (raw peer); through the engine, a stale table fails only the
/// affected reads of a gathered batch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readv_reports_refused_segments_and_returns_the_rest() {
    let b = engine(TcpConfig::default()).await;
    let target = mem(&b, 4096, 0).await;
    target.write(0, &pattern(3, 4096)).unwrap();
    let (mut s, table) = common::raw_handshake_gens(b.segment_name()).await;
    let gen = common::gen_of(&table, target.addr());
    let encode_table = |segs: &[(u64, u64)]| segments(segs, gen);
    let t = target.addr();
    let segs = [(t + 10, 20u64), (t + 4090, 20), (t + 100, 30)];
    let r = Request::ReadV {
        id: 5,
        count: 3,
        total: 70,
    };
    s.write_all(&r.encode()).await.unwrap();
    s.write_all(&encode_table(&segs)).await.unwrap();
    let mut hdr = [0u8; HEADER_LEN];
    s.read_exact(&mut hdr).await.unwrap();
    assert_eq!(
        Response::decode(&hdr).unwrap(),
        Response::DataV {
            id: 5,
            status: Some(Status::AddressNotRegistered),
            failed: 1,
            len: 50
        }
    );
    let mut idx = [0u8; 4];
    s.read_exact(&mut idx).await.unwrap();
    assert_eq!(u32::from_le_bytes(idx), 1);
    let mut data = vec![0u8; 50];
    s.read_exact(&mut data).await.unwrap();
    let p = pattern(3, 4096);
    assert_eq!(&data[..20], &p[10..30]);
    assert_eq!(&data[20..], &p[100..130]);

    // Through the engine, with a stale table.
    let a = engine(TcpConfig::default()).await;
    let dst = mem(&a, 4096, 0).await;
    let gone = mem(&b, 4096, 0x99).await;
    let seg = a.open_segment(b.segment_name()).await.unwrap();
    common::assert_tls(&a, b.segment_name());
    b.unregister(gone.addr()).await.unwrap();
    let reqs = [
        TransferRequest::read(dst.addr(), t, 64),
        TransferRequest::read(dst.addr() + 64, gone.addr(), 64),
        TransferRequest::read(dst.addr() + 128, t + 64, 64),
    ];
    let report = a.batch_transfer(seg, &reqs, None).await.unwrap();
    assert!(
        report.results[0].is_ok() && report.results[2].is_ok(),
        "{report:?}"
    );
    assert!(
        matches!(
            &report.results[1],
            Err(Error::AddressNotRegistered { side: Side::Remote, addr, .. }) if *addr == gone.addr()
        ),
        "{report:?}"
    );
    let got = dst.to_vec();
    assert_eq!(&got[..64], &p[..64]);
    assert_eq!(&got[64..128], &[0u8; 64][..], "refused read wrote memory");
    assert_eq!(&got[128..192], &p[64..128]);
}

/// `shutdown` with an asynchronous batch in flight to a silent target: the
/// batch finishes with its requests failed (no waiter hangs), and a
/// `submit` dropped while it delivers a notification leaves no batch
/// behind (`live_batches` counts the batches callers hold ids for).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_and_dropped_submits_leave_no_batch_hanging() {
    let a = engine(TcpConfig::default()).await;
    let local = mem(&a, 4096, 0x34).await;
    let addr = fake_target(|s| async move {
        // Read nothing, answer nothing.
        tokio::time::sleep(Duration::from_secs(60)).await;
        drop(s);
    })
    .await;
    let seg = a.open_segment(&addr).await.unwrap();
    assert_eq!(a.live_batches(), Some(0));

    // A notification-only submit waits for the silent target; dropping it
    // takes its id back.
    let note = ferry_core::Notification::new("t", "never acknowledged");
    let dropped =
        tokio::time::timeout(Duration::from_millis(200), a.submit(seg, &[], Some(&note))).await;
    assert!(dropped.is_err(), "the silent target answered: {dropped:?}");
    assert_eq!(a.live_batches(), Some(0), "a dropped submit left its batch");

    let reqs = [
        TransferRequest::write(local.addr(), 0x2000, 64),
        TransferRequest::write(local.addr() + 64, 0x3000, 64),
    ];
    let id = a.submit(seg, &reqs, None).await.unwrap();
    assert_eq!(a.live_batches(), Some(1));
    assert!(!a.status(id).unwrap().is_finished());
    a.shutdown_now();
    let report = tokio::time::timeout(Duration::from_secs(30), a.wait(id))
        .await
        .expect("wait hung after shutdown")
        .unwrap();
    assert_eq!(report.len(), 2);
    assert!(
        report.results.iter().all(|r| r.is_err()),
        "requests to a silent target succeeded: {report:?}"
    );
    assert_eq!(a.live_batches(), Some(0));
}

/// Once `shutdown` returns, the engine acts on no request any more: a peer
/// with an established connection sees that connection end (a retryable
/// error), never an answer from the stopped engine — not a write that
/// lands, not a table without regions — on the socket and the same-host
/// path alike. (A stopped engine's same-host thread once answered a table
/// refresh with an empty table, and the initiator failed with
/// `AddressNotRegistered` instead of reconnecting.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shut_down_engine_answers_no_more_requests() {
    for same_host in [ferry_tcp::SameHost::Auto, ferry_tcp::SameHost::Off] {
        for round in 0..10 {
            let b = engine(TcpConfig::builder().same_host(same_host).build().unwrap()).await;
            let a = engine(
                TcpConfig::builder()
                    .same_host(same_host)
                    .connect_timeout(Duration::from_secs(1))
                    .build()
                    .unwrap(),
            )
            .await;
            let before = mem(&a, 4096, 0x11).await;
            let after = mem(&a, 4096, 0x22).await;
            let m = mem(&b, 4096, 0).await;
            let seg = a.open_segment(b.segment_name()).await.unwrap();
            a.transfer(seg, TransferRequest::write(before.addr(), m.addr(), 4096))
                .await
                .expect("write before shutdown");
            b.shutdown_now();
            let r = a
                .transfer(seg, TransferRequest::write(after.addr(), m.addr(), 4096))
                .await;
            let e = r.expect_err("a shut-down engine took a write");
            assert!(
                e.is_retryable() && !matches!(e, Error::AddressNotRegistered { .. }),
                "{same_host:?} round {round}: {e:?}"
            );
            assert_eq!(m.to_vec(), vec![0x11; 4096], "{same_host:?} round {round}");
        }
    }
}

/// A batch spread over two connections still lands whole when the second
/// cannot be opened (here the target admits one connection; on a loaded
/// host, a handshake slower than its timeout): the requests meant for it
/// go over the live one instead of failing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_that_cannot_be_opened_does_not_fail_requests() {
    for same_host in [ferry_tcp::SameHost::Auto, ferry_tcp::SameHost::Off] {
        let b = engine(
            TcpConfig::builder()
                .same_host(same_host)
                .max_inbound(1)
                .max_per_source(1)
                .evict_idle(Duration::from_secs(3600))
                .build()
                .unwrap(),
        )
        .await;
        let a = engine(
            TcpConfig::builder()
                .same_host(same_host)
                .connections(2)
                .connect_timeout(Duration::from_secs(2))
                // Requests larger than a chunk are split over the connections.
                .chunk_size(1 << 20)
                .same_host_chunk(1 << 20)
                .build()
                .unwrap(),
        )
        .await;
        const BLOCK: usize = 2 << 20;
        let data = pattern(7, 8 * BLOCK);
        let src = mem(&a, 8 * BLOCK, 0).await;
        src.write(0, &data).unwrap();
        let dst = mem(&b, 16 * BLOCK, 0).await;
        let seg = a.open_segment(b.segment_name()).await.unwrap();
        let reqs = ferry_core::conformance::scattered_writes(src.addr(), dst.addr(), BLOCK, 8);
        let report = a.batch_transfer(seg, &reqs, None).await.expect("batch");
        assert!(
            report.results.iter().all(|r| r.is_ok()),
            "{same_host:?}: {:?}",
            report.results
        );
        let got = dst.to_vec();
        for i in 0..8 {
            assert_eq!(
                &got[2 * i * BLOCK..(2 * i + 1) * BLOCK],
                &data[i * BLOCK..(i + 1) * BLOCK],
                "{same_host:?}: block {i}"
            );
        }
    }
}

/// `close_segment` dropped while it waits for the handle's transfers in
/// flight changes nothing: the handle still works and closes later, and
/// once it is closed the engine holds no connection to the peer (before,
/// the handle left the table first, so the dropped close leaked the peer
/// and its tasks until shutdown: `peer_report` still saw it open).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_close_segment_leaves_no_peer_behind() {
    const LEN: usize = 32 << 20;
    let b = engine(TcpConfig::default()).await;
    let a = engine(TcpConfig::default()).await;
    let src = mem(&a, LEN, 0x5a).await;
    let dst = mem(&b, LEN, 0).await;
    for round in 0..3 {
        let seg = a.open_segment(b.segment_name()).await.expect("open");
        let write = TransferRequest::write(src.addr(), dst.addr(), LEN as u64);
        let moving = {
            let a = Arc::clone(&a);
            tokio::spawn(async move { a.transfer(seg, write).await })
        };
        // Let the write take the handle's gate, then start closing and
        // drop the close while it waits for the write.
        tokio::time::sleep(Duration::from_millis(2)).await;
        let dropped = tokio::time::timeout(Duration::from_micros(200), a.close_segment(seg)).await;
        moving.await.expect("join").expect("the write in flight");
        if dropped.is_err() {
            // The handle was not closed: it still moves bytes.
            a.transfer(seg, TransferRequest::write(src.addr(), dst.addr(), 64))
                .await
                .unwrap_or_else(|e| panic!("round {round}: the handle after a dropped close: {e}"));
            a.close_segment(seg)
                .await
                .unwrap_or_else(|e| panic!("round {round}: closing after a dropped close: {e}"));
        }
        assert!(
            a.peer_report(b.segment_name()).is_none(),
            "round {round}: every handle is closed, yet the engine still holds its peer"
        );
    }
    a.unregister(src.addr()).await.expect("unregister");
    b.unregister(dst.addr()).await.expect("unregister");
}

//! The Mooncake backend against the faithful C-ABI test libraries (NOT
//! Mooncake) of every generation: loading, refusal, bytes moved, address
//! checks, async batches, deadlines, notifications.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{config, detected, metadata_for, start, start_engine, SUPPORTED};
use ferry_core::{
    Error, HostBuffer, Location, Notification, Operation, Side, TransferEngine, TransferRequest,
    TransferState,
};
use ferry_mooncake::MooncakeConfig;
use mooncake_testlibs::{broken_library_path, library_path, Broken, Generation as Lib};

fn buffer(len: usize, fill: u8) -> HostBuffer {
    let b = HostBuffer::new(len).unwrap();
    b.fill(fill);
    b
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_supported_generation_is_detected_and_moves_bytes() {
    for gen in SUPPORTED {
        let meta = metadata_for(gen);
        let a = start(gen, &meta).await;
        let b = start(gen, &meta).await;
        assert_eq!(a.generation(), detected(gen), "{gen}");
        if gen.has_p2p_handshake() {
            assert!(
                b.segment_name().starts_with("127.0.0.1:"),
                "{gen}: P2P segment name is host:port, got {}",
                b.segment_name()
            );
        } else {
            assert_eq!(b.segment_name(), b.server_name(), "{gen}");
        }
        let src = buffer(64 << 10, 0);
        for (i, chunk) in (0..src.len()).step_by(251).enumerate() {
            let n = 251.min(src.len() - chunk);
            src.write(chunk, &vec![(i % 251) as u8 + 1; n]).unwrap();
        }
        let dst = buffer(64 << 10, 0xEE);
        let back = buffer(64 << 10, 0);
        // SAFETY: test buffers outlive their registrations: each test's transfers have finished before its engines and buffers are dropped.
        a.register(unsafe { src.region(Location::cpu(0)) })
            .await
            .unwrap();
        // SAFETY: test buffers outlive their registrations: each test's transfers have finished before its engines and buffers are dropped.
        a.register(unsafe { back.region(Location::cpu(0)) })
            .await
            .unwrap();
        // SAFETY: test buffers outlive their registrations: each test's transfers have finished before its engines and buffers are dropped.
        b.register(unsafe { dst.region(Location::cpu(0)) })
            .await
            .unwrap();
        let seg = a.open_segment(b.segment_name()).await.unwrap();

        // Write 40000 bytes at dst+1000, then read them back into `back`.
        a.transfer(
            seg,
            TransferRequest::write(src.addr(), dst.addr() + 1000, 40_000),
        )
        .await
        .unwrap();
        a.transfer(
            seg,
            TransferRequest::read(back.addr(), dst.addr() + 1000, 40_000),
        )
        .await
        .unwrap();
        let d = dst.to_vec();
        assert!(
            d[..1000].iter().all(|&x| x == 0xEE),
            "{gen}: bytes before the target"
        );
        assert_eq!(&d[1000..41_000], &src.to_vec()[..40_000], "{gen}");
        assert!(
            d[41_000..].iter().all(|&x| x == 0xEE),
            "{gen}: bytes after the target"
        );
        assert_eq!(&back.to_vec()[..40_000], &src.to_vec()[..40_000], "{gen}");

        a.close_segment(seg).await.unwrap();
        a.unregister(src.addr()).await.unwrap();
        a.unregister(back.addr()).await.unwrap();
        b.unregister(dst.addr()).await.unwrap();
        assert_eq!(a.library_batches_in_use(), 0, "{gen}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pre_v0_2_0_is_refused_with_a_clear_error() {
    let err = start_engine(
        MooncakeConfig::builder()
            .library(library_path(Lib::PreV0_2_0))
            .build()
            .unwrap(),
    )
    .await
    .unwrap_err();
    match err {
        Error::Unavailable { backend, reason } => {
            assert_eq!(backend, "mooncake");
            assert!(reason.contains("before v0.2.0"), "{reason}");
            assert!(reason.contains("install Mooncake ≥ v0.2.0"), "{reason}");
            assert!(
                reason.contains(&library_path(Lib::PreV0_2_0).display().to_string()),
                "{reason}"
            );
        }
        other => panic!("expected Unavailable, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn missing_required_symbol_is_a_typed_error() {
    let path = broken_library_path(Broken::MissingSubmitTransfer);
    let err = start_engine(
        MooncakeConfig::builder()
            .library(path.clone())
            .build()
            .unwrap(),
    )
    .await
    .unwrap_err();
    assert_eq!(
        err,
        Error::MissingSymbol {
            library: path.display().to_string(),
            symbol: "submitTransfer".into(),
            min_version: Some("Mooncake v0.2.0".into()),
        }
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_library_that_is_not_mooncake_is_refused() {
    let path = broken_library_path(Broken::NotMooncake);
    let err = start_engine(
        MooncakeConfig::builder()
            .library(path.clone())
            .build()
            .unwrap(),
    )
    .await
    .unwrap_err();
    match err {
        Error::Unavailable { reason, .. } => {
            assert!(
                reason.contains("is not a Mooncake Transfer Engine library"),
                "{reason}"
            );
            assert!(reason.contains(&path.display().to_string()), "{reason}");
        }
        other => panic!("expected Unavailable, got {other:?}"),
    }
    let missing = std::env::temp_dir().join("ferry-no-such-dir/libtransfer_engine.so");
    match start_engine(
        MooncakeConfig::builder()
            .library(missing.clone())
            .build()
            .unwrap(),
    )
    .await
    .unwrap_err()
    {
        Error::Unavailable { reason, .. } => {
            assert!(reason.contains(&missing.display().to_string()), "{reason}");
            assert!(reason.contains("FERRY_MOONCAKE_LIB"), "{reason}");
        }
        other => panic!("expected Unavailable, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn p2p_metadata_on_v0_2_0_is_refused_up_front() {
    let err = start_engine(config(Lib::V0_2_0, "P2PHANDSHAKE", ""))
        .await
        .unwrap_err();
    match err {
        Error::Unavailable { reason, .. } => {
            assert!(reason.contains("needs Mooncake ≥ v0.3.0"), "{reason}")
        }
        other => panic!("expected Unavailable, got {other:?}"),
    }
}

/// Old generations report a write to an unregistered remote address as
/// completed without writing; the backend checks in-process peers' regions
/// before submitting, so every generation fails it the same way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unregistered_remote_address_fails_on_every_generation() {
    for gen in SUPPORTED {
        let meta = metadata_for(gen);
        let a = start(gen, &meta).await;
        let b = start(gen, &meta).await;
        let src = buffer(4096, 1);
        let dst = buffer(4096, 0);
        let elsewhere = buffer(4096, 9);
        // SAFETY: test buffers outlive their registrations: each test's transfers have finished before its engines and buffers are dropped.
        a.register(unsafe { src.region(Location::cpu(0)) })
            .await
            .unwrap();
        // SAFETY: test buffers outlive their registrations: each test's transfers have finished before its engines and buffers are dropped.
        b.register(unsafe { dst.region(Location::cpu(0)) })
            .await
            .unwrap();
        let seg = a.open_segment(b.segment_name()).await.unwrap();
        let peer = b.segment_name().to_owned();
        for (req, addr, len) in [
            (
                TransferRequest::write(src.addr(), elsewhere.addr(), 16),
                elsewhere.addr(),
                16,
            ),
            (
                TransferRequest::write(src.addr(), dst.addr() + 4090, 16),
                dst.addr() + 4090,
                16,
            ),
            (
                TransferRequest::read(src.addr(), elsewhere.addr(), 16),
                elsewhere.addr(),
                16,
            ),
        ] {
            let err = a.transfer(seg, req).await.unwrap_err();
            assert_eq!(
                err,
                Error::AddressNotRegistered {
                    side: Side::Remote,
                    addr,
                    len,
                    peer: Some(peer.clone())
                },
                "{gen}"
            );
        }
        let err = a
            .transfer(
                seg,
                TransferRequest::write(elsewhere.addr(), dst.addr(), 16),
            )
            .await
            .unwrap_err();
        assert!(
            matches!(
                err,
                Error::AddressNotRegistered {
                    side: Side::Local,
                    ..
                }
            ),
            "{gen}: {err:?}"
        );
        assert!(elsewhere.to_vec().iter().all(|&x| x == 9), "{gen}");
        assert!(dst.to_vec().iter().all(|&x| x == 0), "{gen}");

        // A batch mixing good and bad requests reports each.
        let report = a
            .batch_transfer(
                seg,
                &[
                    TransferRequest::write(src.addr(), dst.addr(), 100),
                    TransferRequest::write(src.addr(), elsewhere.addr(), 100),
                    TransferRequest::write(src.addr(), dst.addr() + 200, 0),
                ],
                None,
            )
            .await
            .unwrap();
        assert!(report.results[0].is_ok(), "{gen}");
        assert!(
            matches!(report.results[1], Err(Error::AddressNotRegistered { .. })),
            "{gen}"
        );
        assert!(report.results[2].is_ok(), "{gen}");
        assert!(dst.to_vec()[..100].iter().all(|&x| x == 1), "{gen}");
        a.unregister(src.addr()).await.unwrap();
        b.unregister(dst.addr()).await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn async_batches_poll_wait_and_refuse_busy_release() {
    let gen = Lib::Current;
    let meta = metadata_for(gen);
    let a = start(gen, &meta).await;
    // The peer stalls every read/write it serves by 300 ms (test-library
    // convention), so the batch is certainly still pending when released.
    let b = start_engine(config(gen, &meta, "@stall=300"))
        .await
        .unwrap();
    let src = buffer(8192, 3);
    let dst = buffer(8192, 0);
    // SAFETY: test buffers outlive their registrations: each test's transfers have finished before its engines and buffers are dropped.
    a.register(unsafe { src.region(Location::cpu(0)) })
        .await
        .unwrap();
    // SAFETY: test buffers outlive their registrations: each test's transfers have finished before its engines and buffers are dropped.
    b.register(unsafe { dst.region(Location::cpu(0)) })
        .await
        .unwrap();
    let seg = a.open_segment(b.segment_name()).await.unwrap();
    let reqs = [
        TransferRequest::write(src.addr(), dst.addr(), 4096),
        TransferRequest::write(src.addr() + 4096, dst.addr() + 4096, 4096),
    ];
    let id = a.submit(seg, &reqs, None).await.unwrap();
    let st = a.status(id).unwrap();
    assert_eq!(st.states.len(), 2);
    assert!(!st.is_finished(), "stalled batch finished at once: {st:?}");
    assert_eq!(a.release_batch(id).await, Err(Error::BatchBusy(id)));
    let report = a.wait(id).await.unwrap();
    assert!(report.is_success(), "{report:?}");
    assert_eq!(dst.to_vec(), src.to_vec());
    assert_eq!(a.status(id), Err(Error::UnknownBatch(id)));
    assert_eq!(a.wait(id).await, Err(Error::UnknownBatch(id)));
    assert_eq!(a.library_batches_in_use(), 0);

    // status() until finished, then release_batch.
    let id = a.submit(seg, &reqs[..1], None).await.unwrap();
    loop {
        let st = a.status(id).unwrap();
        if st.is_finished() {
            assert_eq!(st.states, vec![TransferState::Completed]);
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    a.release_batch(id).await.unwrap();
    assert_eq!(a.library_batches_in_use(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deadline_fails_the_batch_and_the_library_batch_is_still_freed() {
    for gen in [Lib::V0_2_0, Lib::Current] {
        let meta = metadata_for(gen);
        let mut cfg = config(gen, &meta, "");
        cfg.timeout = Duration::from_millis(50);
        cfg.timeout_ns_per_byte = 0;
        let a = start_engine(cfg).await.unwrap();
        let b = start_engine(config(gen, &meta, "@stall=600"))
            .await
            .unwrap();
        let src = buffer(4096, 5);
        let dst = buffer(4096, 0);
        // SAFETY: test buffers outlive their registrations: each test's transfers have finished before its engines and buffers are dropped.
        a.register(unsafe { src.region(Location::cpu(0)) })
            .await
            .unwrap();
        // SAFETY: test buffers outlive their registrations: each test's transfers have finished before its engines and buffers are dropped.
        b.register(unsafe { dst.region(Location::cpu(0)) })
            .await
            .unwrap();
        let seg = a.open_segment(b.segment_name()).await.unwrap();
        let err = a
            .transfer(seg, TransferRequest::write(src.addr(), dst.addr(), 4096))
            .await
            .unwrap_err();
        assert_eq!(
            err,
            Error::Timeout {
                operation: "mooncake batch".into(),
                peer: Some(b.segment_name().to_owned()),
                after: Duration::from_millis(50)
            },
            "{gen}"
        );
        // The library is still writing: unregistering the source waits for
        // the reaper, which frees the library batch once it is terminal.
        a.unregister(src.addr()).await.unwrap();
        b.unregister(dst.addr()).await.unwrap();
        let mut spins = 0;
        while a.library_batches_in_use() != 0 {
            spins += 1;
            assert!(spins < 12_000, "{gen}: the reaper never freed the batch");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        if gen.has_old_tcp_transport() {
            // Ferry probes the target before writing on builds whose writes
            // complete when sent; the probe used up the deadline against the
            // stalled peer, so the write was never sent.
            assert_eq!(dst.to_vec(), vec![0u8; 4096], "{gen}: nothing was sent");
        } else {
            assert_eq!(dst.to_vec(), src.to_vec(), "{gen}: the late write landed");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unregister_waits_for_a_transfer_in_flight() {
    let gen = Lib::V0_3_6;
    let meta = metadata_for(gen);
    let a = Arc::new(start(gen, &meta).await);
    let b = start_engine(config(gen, &meta, "@stall=300"))
        .await
        .unwrap();
    let src = buffer(4096, 8);
    let dst = buffer(4096, 0);
    // SAFETY: test buffers outlive their registrations: each test's transfers have finished before its engines and buffers are dropped.
    a.register(unsafe { src.region(Location::cpu(0)) })
        .await
        .unwrap();
    // SAFETY: test buffers outlive their registrations: each test's transfers have finished before its engines and buffers are dropped.
    b.register(unsafe { dst.region(Location::cpu(0)) })
        .await
        .unwrap();
    let seg = a.open_segment(b.segment_name()).await.unwrap();
    let id = a
        .submit(
            seg,
            &[TransferRequest::write(src.addr(), dst.addr(), 4096)],
            None,
        )
        .await
        .unwrap();
    // Unregistering the peer's target region must wait for the batch.
    b.unregister(dst.addr()).await.unwrap();
    let st = a.status(id).unwrap();
    assert!(
        st.is_finished(),
        "unregister returned while the write was in flight"
    );
    assert_eq!(dst.to_vec(), src.to_vec());
    a.wait(id).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn notifications_where_the_library_has_them() {
    // (generation, test-library arguments, why notify is refused or None).
    let cases: [(Lib, &str, Option<&str>); 6] = [
        (Lib::V0_2_0, "", Some("has no submitTransferWithNotify")),
        (Lib::V0_3_0, "", Some("has no submitTransferWithNotify")),
        (Lib::V0_3_5, "", Some("strings it has already freed")),
        // v0.3.6/v0.3.7 TCP engines reject notifications; the start-up
        // probe finds out.
        (Lib::V0_3_6, "", Some("rejected (ERR_METADATA)")),
        // v0.3.8–v0.3.10 (same symbols) accept them.
        (Lib::V0_3_6, "@notify=accept", None),
        (Lib::Current, "", None),
    ];
    for (gen, args, refused) in cases {
        let meta = metadata_for(gen);
        let a = start_engine(config(gen, &meta, args)).await.unwrap();
        let b = start_engine(config(gen, &meta, args)).await.unwrap();
        let src = buffer(4096, 4);
        let dst = buffer(4096, 0);
        // SAFETY: test buffers outlive their registrations: each test's transfers have finished before its engines and buffers are dropped.
        a.register(unsafe { src.region(Location::cpu(0)) })
            .await
            .unwrap();
        // SAFETY: test buffers outlive their registrations: each test's transfers have finished before its engines and buffers are dropped.
        b.register(unsafe { dst.region(Location::cpu(0)) })
            .await
            .unwrap();
        let seg = a.open_segment(b.segment_name()).await.unwrap();
        let note = Notification::new("req-17", "kv blocks 0..4 landed");
        let reqs = [TransferRequest::write(src.addr(), dst.addr(), 4096)];
        let got = a.batch_transfer(seg, &reqs, Some(&note)).await;
        if let Some(why) = refused {
            assert!(!a.capabilities().notify, "{gen} {args}");
            match got {
                Err(Error::Unsupported {
                    operation: Operation::Notify,
                    reason,
                    min_version,
                    ..
                }) => {
                    assert!(reason.contains(why), "{gen}: {reason}");
                    assert_eq!(min_version.as_deref(), Some("Mooncake v0.3.8"), "{gen}");
                }
                other => panic!("{gen} {args}: expected Unsupported, got {other:?}"),
            }
            // Refused up front: nothing moved.
            assert_eq!(dst.to_vec(), vec![0u8; 4096], "{gen}");
            assert!(matches!(
                b.take_notifications().await,
                Err(Error::Unsupported { .. })
            ));
            continue;
        }
        assert!(a.capabilities().notify, "{gen} {args}");
        assert!(got.unwrap().is_success(), "{gen}");
        // Delivered after the data; a zero-request batch sends one alone.
        a.batch_transfer(seg, &[], Some(&Notification::new("solo", "")))
            .await
            .unwrap();
        let mut seen = Vec::new();
        for _ in 0..1000 {
            seen.extend(b.take_notifications().await.unwrap());
            if seen.len() >= 2 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        assert_eq!(
            seen,
            vec![note.clone(), Notification::new("solo", "")],
            "{gen}"
        );
        assert_eq!(dst.to_vec(), src.to_vec(), "{gen}");
        assert!(b.take_notifications().await.unwrap().is_empty());
        // A batch with a failed request sends no notification.
        let bad = [TransferRequest::write(src.addr(), 0x10, 8)];
        let r = a.batch_transfer(seg, &bad, Some(&note)).await.unwrap();
        assert!(!r.is_success());
        a.batch_transfer(seg, &[], Some(&Notification::new("after", "")))
            .await
            .unwrap();
        let mut later = Vec::new();
        for _ in 0..1000 {
            later.extend(b.take_notifications().await.unwrap());
            if !later.is_empty() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        assert_eq!(later, vec![Notification::new("after", "")], "{gen}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batch_register_is_all_or_nothing() {
    for gen in SUPPORTED {
        let a = start(gen, &metadata_for(gen)).await;
        let x = buffer(8192, 0);
        let y = buffer(4096, 0);
        let overlapping = {
            // SAFETY: a sub-range of `x`, never accessed through this region.
            unsafe {
                ferry_core::MemoryRegion::from_raw_parts(
                    (x.addr() + 4096) as usize as *mut u8,
                    4096,
                    Location::cpu(0),
                )
            }
        };
        let err = a
            .batch_register(vec![
                // SAFETY: test buffers outlive their registrations: each test's transfers have finished before its engines and buffers are dropped.
                unsafe { x.region(Location::cpu(0)) },
                // SAFETY: test buffers outlive their registrations: each test's transfers have finished before its engines and buffers are dropped.
                unsafe { y.region(Location::cpu(0)) },
                overlapping,
            ])
            .await
            .unwrap_err();
        assert!(
            matches!(err, Error::BatchRegisterFailed { index: 2, .. }),
            "{gen}: {err:?}"
        );
        // Nothing stayed registered: registering each alone works.
        // SAFETY: test buffers outlive their registrations: each test's transfers have finished before its engines and buffers are dropped.
        a.batch_register(vec![unsafe { x.region(Location::cpu(0)) }, unsafe {
            y.region(Location::cpu(0))
        }])
        .await
        .unwrap();
        a.batch_unregister(&[x.addr(), y.addr()]).await.unwrap();
        assert_eq!(
            a.unregister(x.addr()).await,
            Err(Error::RegionNotRegistered { addr: x.addr() })
        );
        let cuda = a
            // SAFETY: test buffers outlive their registrations: each test's transfers have finished before its engines and buffers are dropped.
            .register(unsafe { y.region(Location::cuda(0)) })
            .await
            .unwrap_err();
        assert!(matches!(cuda, Error::InvalidArgument(_)), "{cuda:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn segments_refcount_and_unknown_ones_fail() {
    let gen = Lib::V0_3_0;
    let meta = metadata_for(gen);
    let a = start(gen, &meta).await;
    let b = start(gen, &meta).await;
    let src = buffer(4096, 6);
    let dst = buffer(4096, 0);
    // SAFETY: test buffers outlive their registrations: each test's transfers have finished before its engines and buffers are dropped.
    a.register(unsafe { src.region(Location::cpu(0)) })
        .await
        .unwrap();
    // SAFETY: test buffers outlive their registrations: each test's transfers have finished before its engines and buffers are dropped.
    b.register(unsafe { dst.region(Location::cpu(0)) })
        .await
        .unwrap();
    let s1 = a.open_segment(b.segment_name()).await.unwrap();
    let s2 = a.open_segment(b.segment_name()).await.unwrap();
    assert_ne!(s1, s2, "each open returns its own handle");
    a.close_segment(s1).await.unwrap();
    assert_eq!(a.close_segment(s1).await, Err(Error::UnknownSegment(s1)));
    let req = TransferRequest::write(src.addr(), dst.addr(), 64);
    assert_eq!(a.transfer(s1, req).await, Err(Error::UnknownSegment(s1)));
    // The other handle still reaches the shared library segment.
    a.transfer(s2, req).await.unwrap();
    assert_eq!(&dst.to_vec()[..64], &[6; 64]);
    a.close_segment(s2).await.unwrap();
    assert_eq!(a.transfer(s2, req).await, Err(Error::UnknownSegment(s2)));
    let err = a.open_segment("127.0.0.1:1").await.unwrap_err();
    assert!(matches!(err, Error::SegmentUnavailable { .. }), "{err:?}");
}

/// A library error surfaces with its raw code and the same name whatever
/// the sign: the test libraries return negative codes up to v0.3.0 and
/// positive ones from v0.3.5 (a NULL address is refused by the library,
/// not by Ferry's own checks).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn library_error_codes_of_both_signs_have_one_name() {
    for gen in SUPPORTED {
        let a = start(gen, &metadata_for(gen)).await;
        // SAFETY: the library refuses this region, so nothing ever accesses
        // address 0 (and Ferry removes it from its table again).
        let null = unsafe {
            ferry_core::MemoryRegion::from_raw_parts(std::ptr::null_mut(), 4096, Location::cpu(0))
        };
        let err = a.register(null).await.unwrap_err();
        let code = if gen.negative_error_codes() { -1 } else { 1 };
        assert_eq!(
            err,
            Error::Backend {
                backend: "mooncake".into(),
                operation: "registerLocalMemory".into(),
                code,
                name: "ERR_INVALID_ARGUMENT".into()
            },
            "{gen}"
        );
        // The failed region is not left in Ferry's table.
        assert_eq!(
            a.unregister(0).await,
            Err(Error::RegionNotRegistered { addr: 0 }),
            "{gen}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transport_the_library_cannot_install_is_unavailable() {
    let mut cfg = config(Lib::Current, "P2PHANDSHAKE", "");
    cfg.protocol = "rdma".into();
    cfg.device = Some("mlx5_0,mlx5_1".into());
    match start_engine(cfg).await.unwrap_err() {
        Error::Unavailable { reason, .. } => {
            assert!(
                reason.starts_with("installTransport(\"rdma\") returned NULL"),
                "{reason}"
            );
            assert!(reason.contains("v0.3.12"), "{reason}");
        }
        other => panic!("expected Unavailable, got {other:?}"),
    }
}

/// Dropping an engine with a batch still in the library: the poller
/// finishes it, keeps the memory registered until then, and only then
/// destroys the C engine.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_an_engine_with_a_batch_in_flight_finishes_it_first() {
    let gen = Lib::V0_3_5;
    let meta = metadata_for(gen);
    let a = start(gen, &meta).await;
    let b = start_engine(config(gen, &meta, "@stall=300"))
        .await
        .unwrap();
    let src = buffer(4096, 0x5A);
    let dst = buffer(4096, 0);
    // SAFETY: test buffers outlive their registrations: each test's transfers have finished before its engines and buffers are dropped.
    a.register(unsafe { src.region(Location::cpu(0)) })
        .await
        .unwrap();
    // SAFETY: test buffers outlive their registrations: each test's transfers have finished before its engines and buffers are dropped.
    b.register(unsafe { dst.region(Location::cpu(0)) })
        .await
        .unwrap();
    let seg = a.open_segment(b.segment_name()).await.unwrap();
    let id = a
        .submit(
            seg,
            &[TransferRequest::write(src.addr(), dst.addr(), 4096)],
            None,
        )
        .await
        .unwrap();
    assert!(!a.status(id).unwrap().is_finished());
    drop(a);
    // The peer's region is held by the batch until the library is done.
    b.unregister(dst.addr()).await.unwrap();
    assert_eq!(dst.to_vec(), src.to_vec());
}

/// P2PHANDSHAKE (≥ v0.3.0): Mooncake names the segment `<host>:<port it
/// picks>` from the host part of `local_server_name` (real builds ignore
/// `ip_or_host_name`), so Ferry passes the host and refuses `name=` and
/// `port=`, which would publish a name no peer can open.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn p2p_segments_are_named_host_port_and_name_or_port_are_refused() {
    for gen in [Lib::V0_3_0, Lib::V0_3_6, Lib::Current] {
        let e = start(gen, "P2PHANDSHAKE").await;
        let (host, port) = e.segment_name().rsplit_once(':').expect("host:port");
        assert_eq!(host, "127.0.0.1", "{gen}");
        assert!(port.parse::<u16>().is_ok_and(|p| p != 0), "{gen}: {port}");
        for (what, cfg) in [
            ("name=", {
                let mut cfg_ = config(gen, "P2PHANDSHAKE", "");
                cfg_.name = Some("prefill-0".into());
                cfg_
            }),
            ("port=", {
                let mut cfg_ = config(gen, "P2PHANDSHAKE", "");
                cfg_.port = 15000;
                cfg_
            }),
        ] {
            match start_engine(cfg).await {
                Err(Error::InvalidArgument(m)) => assert!(m.contains(what), "{gen}: {m}"),
                other => panic!(
                    "{gen}: {what} with P2PHANDSHAKE: expected InvalidArgument, got {other:?}"
                ),
            }
        }
    }
}

/// v0.2.0 era with a metadata service: a port that is in use would make the
/// library throw through its C API (process abort; the test library aborts
/// too), so Ferry refuses it first; and a name a live engine of this
/// process uses is refused (it would overwrite that engine's metadata entry).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_busy_port_or_a_live_name_is_refused_before_the_library_sees_it() {
    let gen = Lib::V0_2_0;
    let meta = metadata_for(gen);
    let busy = std::net::TcpListener::bind("0.0.0.0:0").expect("bind");
    let port = busy.local_addr().expect("addr").port();
    let cfg = {
        let mut cfg_ = config(gen, &meta, "");
        cfg_.port = port;
        cfg_
    };
    match start_engine(cfg).await {
        Err(Error::InvalidArgument(m)) => {
            assert!(m.contains(&format!("port {port}")), "{m}")
        }
        other => panic!("busy port: expected InvalidArgument, got {other:?}"),
    }
    drop(busy);

    let first = config(gen, &meta, "");
    let e = start_engine(first.clone()).await.expect("first engine");
    match start_engine(first.clone()).await {
        Err(Error::InvalidArgument(m)) => assert!(m.contains("in use by a live engine"), "{m}"),
        other => panic!("reused name: expected InvalidArgument, got {other:?}"),
    }
    // Port 0 on this generation: Ferry picked a real port for the library to
    // publish (the library would publish 0), so a peer can reach it.
    let b = start(gen, &meta).await;
    b.open_segment(e.segment_name())
        .await
        .expect("the segment of an engine started with port 0");
    drop(e);
    // Once the engine is gone its name is free again (its C engine is
    // destroyed on the poller thread; wait for it, bounded).
    let start = std::time::Instant::now();
    loop {
        match start_engine(first.clone()).await {
            Ok(_) => break,
            Err(Error::InvalidArgument(_)) if start.elapsed() < Duration::from_secs(30) => {
                tokio::time::sleep(Duration::from_millis(10)).await
            }
            Err(e) => panic!("the name of a dropped engine stayed taken: {e}"),
        }
    }
}

/// On builds whose TCP writes complete when sent, a completed write has
/// landed only because Ferry confirms it: with `confirm_writes` off the
/// bytes are not there yet when the write completes (the library's own
/// semantics, reported as such), with it on they are.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_are_landed_when_completed_only_with_confirmation() {
    for gen in [Lib::V0_2_0, Lib::V0_3_6] {
        let meta = metadata_for(gen);
        // The peer lands each write 300 ms after receiving it.
        let b = start_engine(config(gen, &meta, "@land_delay=300"))
            .await
            .unwrap();
        let dst = buffer(1 << 20, 0);
        // SAFETY: test buffers outlive their registrations: each test's transfers have finished before its engines and buffers are dropped.
        b.register(unsafe { dst.region(Location::cpu(0)) })
            .await
            .unwrap();
        for confirm in [false, true] {
            let mut cfg = config(gen, &meta, "");
            cfg.confirm_writes = Some(confirm);
            let a = start_engine(cfg).await.unwrap();
            assert_eq!(a.capabilities().landed_writes, confirm, "{gen}");
            let fill = if confirm { 2 } else { 1 };
            let src = buffer(1 << 20, fill);
            // SAFETY: test buffers outlive their registrations: each test's transfers have finished before its engines and buffers are dropped.
            a.register(unsafe { src.region(Location::cpu(0)) })
                .await
                .unwrap();
            let seg = a.open_segment(b.segment_name()).await.unwrap();
            a.transfer(seg, TransferRequest::write(src.addr(), dst.addr(), 1 << 20))
                .await
                .unwrap();
            let right_after = dst.to_vec();
            if confirm {
                assert_eq!(
                    right_after,
                    src.to_vec(),
                    "{gen}: confirmed write not landed"
                );
            } else {
                assert_ne!(
                    right_after[(1 << 20) - 1],
                    fill,
                    "{gen}: an unconfirmed write landed within 300 ms of its delay"
                );
                // It lands later all the same.
                let mut waited = 0;
                while dst.to_vec() != src.to_vec() {
                    waited += 1;
                    assert!(waited < 6000, "{gen}: the write never landed");
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
            }
            a.unregister(src.addr()).await.unwrap();
        }
        b.unregister(dst.addr()).await.unwrap();
    }
}

/// A `transfer` or `batch_transfer` future dropped mid-flight leaves no
/// batch behind in the engine's table, and the library batch is still
/// freed once the library is done with it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_transfer_futures_leave_no_batch_behind() {
    for gen in [Lib::V0_3_0, Lib::Current] {
        let meta = metadata_for(gen);
        let a = start(gen, &meta).await;
        let b = start_engine(config(gen, &meta, "@stall=200"))
            .await
            .unwrap();
        let src = buffer(4096, 3);
        let dst = buffer(4096, 0);
        // SAFETY: test buffers outlive their registrations: each test's transfers have finished before its engines and buffers are dropped.
        a.register(unsafe { src.region(Location::cpu(0)) })
            .await
            .unwrap();
        // SAFETY: test buffers outlive their registrations: each test's transfers have finished before its engines and buffers are dropped.
        b.register(unsafe { dst.region(Location::cpu(0)) })
            .await
            .unwrap();
        let seg = a.open_segment(b.segment_name()).await.unwrap();
        let w = TransferRequest::write(src.addr(), dst.addr(), 4096);
        for _ in 0..3 {
            let r = tokio::time::timeout(Duration::from_millis(20), a.transfer(seg, w)).await;
            assert!(
                r.is_err(),
                "{gen}: the stalled transfer finished within 20 ms"
            );
            let r = tokio::time::timeout(
                Duration::from_millis(20),
                a.batch_transfer(seg, &[w, w], None),
            )
            .await;
            assert!(r.is_err(), "{gen}: the stalled batch finished within 20 ms");
        }
        assert_eq!(
            a.live_batches(),
            Some(0),
            "{gen}: dropped futures left batches"
        );
        // Unregistering the source waits for the library to be done with it.
        a.unregister(src.addr()).await.unwrap();
        let mut spins = 0;
        while a.library_batches_in_use() != 0 {
            spins += 1;
            assert!(spins < 12_000, "{gen}: library batches never freed");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        b.unregister(dst.addr()).await.unwrap();
    }
}

/// Overlapping writes of one batch on a build that reports writes sent, not
/// landed: when the batch is reported, every write has landed, including
/// those whose range other writes of the batch cover (two identical writes,
/// a write inside another): none lands later, after `unregister` returned.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overlapping_writes_have_all_landed_when_the_batch_is_reported() {
    for gen in [Lib::V0_2_0, Lib::V0_3_6] {
        let meta = metadata_for(gen);
        let a = start(gen, &meta).await;
        let b = start_engine(config(gen, &meta, "@land_delay=300"))
            .await
            .unwrap();
        let src = buffer(8192, 0);
        let fill: Vec<u8> = (0..8192).map(|i| (i % 251) as u8 + 1).collect();
        src.write(0, &fill).unwrap();
        let dst = buffer(8192, 0);
        // SAFETY: test buffers outlive their registrations: each test's transfers have finished before its engines and buffers are dropped.
        a.register(unsafe { src.region(Location::cpu(0)) })
            .await
            .unwrap();
        // SAFETY: test buffers outlive their registrations: each test's transfers have finished before its engines and buffers are dropped.
        b.register(unsafe { dst.region(Location::cpu(0)) })
            .await
            .unwrap();
        let seg = a.open_segment(b.segment_name()).await.unwrap();
        let whole = TransferRequest::write(src.addr(), dst.addr(), 8192);
        let inner = TransferRequest::write(src.addr() + 100, dst.addr() + 100, 50);
        for reqs in [
            vec![whole, whole],
            vec![whole, inner],
            vec![inner, whole, inner],
        ] {
            dst.fill(0);
            let report = a.batch_transfer(seg, &reqs, None).await.unwrap();
            assert!(report.is_success(), "{gen}: {:?}", report.results);
            assert!(
                dst.to_vec() == src.to_vec(),
                "{gen}: the batch was reported before every write landed: {reqs:?}"
            );
            // Unregistering waits for nothing: no write is still on its way.
            b.unregister(dst.addr()).await.unwrap();
            // SAFETY: as above.
            b.register(unsafe { dst.region(Location::cpu(0)) })
                .await
                .unwrap();
        }
        a.unregister(src.addr()).await.unwrap();
        b.unregister(dst.addr()).await.unwrap();
    }
}

/// Writes of concurrent batches to the same bytes, on a build that reports
/// writes sent, not landed: a write is confirmed by its last byte showing
/// the written value, so another batch's write putting the same value there
/// must not confirm it before it lands. Batches A, B, C: A and B write the
/// same bytes, C other bytes with the same last byte; none may land after
/// every batch is reported and the peer's `unregister` returned.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_batches_writing_the_same_bytes_have_landed_when_reported() {
    for gen in [Lib::V0_2_0, Lib::V0_3_6] {
        let meta = metadata_for(gen);
        let a = start(gen, &meta).await;
        // The peer lands each write 100 ms after receiving it.
        let b = start_engine(config(gen, &meta, "@land_delay=100"))
            .await
            .unwrap();
        let src = buffer(8192, 0);
        let p: Vec<u8> = (0..4096).map(|i| (i % 251) as u8 + 1).collect();
        let mut q: Vec<u8> = p.iter().map(|x| x.wrapping_add(7)).collect();
        q[4095] = p[4095];
        src.write(0, &p).unwrap();
        src.write(4096, &q).unwrap();
        let dst = buffer(4096, 0);
        // SAFETY: test buffers outlive their registrations: each test's transfers have finished before its engines and buffers are dropped.
        a.register(unsafe { src.region(Location::cpu(0)) })
            .await
            .unwrap();
        // SAFETY: as above.
        b.register(unsafe { dst.region(Location::cpu(0)) })
            .await
            .unwrap();
        let seg = a.open_segment(b.segment_name()).await.unwrap();
        let wp = TransferRequest::write(src.addr(), dst.addr(), 4096);
        let wq = TransferRequest::write(src.addr() + 4096, dst.addr(), 4096);
        let mut ids = Vec::new();
        // 40 ms apart: each lands 40 ms after the one before.
        for w in [wp, wp, wq] {
            ids.push(a.submit(seg, &[w], None).await.unwrap());
            tokio::time::sleep(Duration::from_millis(40)).await;
        }
        for id in ids {
            let report = a.wait(id).await.unwrap();
            assert!(report.is_success(), "{gen}: {report:?}");
        }
        b.unregister(dst.addr()).await.unwrap();
        let reported = dst.to_vec();
        tokio::time::sleep(Duration::from_millis(400)).await;
        assert!(
            dst.to_vec() == reported,
            "{gen}: a write landed after every batch was reported and unregister returned"
        );
        a.unregister(src.addr()).await.unwrap();
    }
}

/// On a build that reports writes sent, not landed: a batch whose deadline
/// passes while a write (or the complement written before it, where the
/// target already holds the written value) is sent but not seen to land
/// still keeps the peer's memory until it lands, so nothing lands after
/// the peer's `unregister` returned.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_sent_past_the_deadline_land_before_unregister_returns() {
    for gen in [Lib::V0_2_0, Lib::V0_3_6] {
        let meta = metadata_for(gen);
        let mut cfg = config(gen, &meta, "");
        cfg.timeout = Duration::from_millis(30);
        cfg.timeout_ns_per_byte = 0;
        let a = start_engine(cfg).await.unwrap();
        // The peer lands each write 200 ms after receiving it, well past
        // the batches' 30 ms deadline.
        let b = start_engine(config(gen, &meta, "@land_delay=200"))
            .await
            .unwrap();
        let src = buffer(4096, 5);
        let dst = buffer(4096, 0);
        // SAFETY: test buffers outlive their registrations: each test's transfers have finished before its engines and buffers are dropped.
        a.register(unsafe { src.region(Location::cpu(0)) })
            .await
            .unwrap();
        let seg = a.open_segment(b.segment_name()).await.unwrap();
        // First the target differs (the write itself is late), then it
        // already holds the bytes (the complement is late).
        for (what, fill) in [("write", 0u8), ("complement", 5u8)] {
            dst.fill(fill);
            // SAFETY: as above.
            b.register(unsafe { dst.region(Location::cpu(0)) })
                .await
                .unwrap();
            let w = TransferRequest::write(src.addr(), dst.addr(), 4096);
            let _ = a.transfer(seg, w).await;
            b.unregister(dst.addr()).await.unwrap();
            let reported = dst.to_vec();
            tokio::time::sleep(Duration::from_millis(400)).await;
            assert!(
                dst.to_vec() == reported,
                "{gen}: a late {what} landed after unregister returned"
            );
        }
        a.unregister(src.addr()).await.unwrap();
    }
}

//! Identity, registration, a round trip, and honest capabilities.

use super::harness::*;
use super::*;
use crate::DynTransferEngine;

/// Engines have a backend name and distinct, non-empty segment names;
/// capabilities are stable across calls.
pub async fn check_identity(factory: Arc<dyn EngineFactory>, adapted: bool) -> Outcome {
    let p = match pair(&factory, adapted).await {
        Ok(p) => p,
        Err(o) => return o,
    };
    assert!(!p.a.backend_name().is_empty(), "backend_name is empty");
    assert!(!p.a.segment_name().is_empty(), "segment_name is empty");
    assert_eq!(p.a.capabilities(), p.a.capabilities());
    assert_eq!(p.a.backend_info().backend, p.a.backend_name());
    p.a.close_segment(p.seg)
        .await
        .unwrap_or_else(|e| panic!("close_segment failed: {e}"));
    Outcome::Passed
}

/// Register / unregister one region; double unregister and empty regions
/// are refused; a peer cannot reach a region after it is unregistered.
pub async fn check_register_unregister(factory: Arc<dyn EngineFactory>, adapted: bool) -> Outcome {
    let p = match pair(&factory, adapted).await {
        Ok(p) => p,
        Err(o) => return o,
    };
    let src = Mem::new(&p.a, 4096, 1).await;
    let mut dst = Mem::new(&p.b, 8192, 0).await;
    let addr = dst.addr();
    p.a.transfer(p.seg, TransferRequest::write(src.addr(), addr, 4096))
        .await
        .unwrap_or_else(|e| panic!("write into a registered region failed: {e}"));
    dst.unregister(0).await;
    match p.b.unregister(addr).await {
        Err(Error::RegionNotRegistered { addr: a }) if a == addr => {}
        other => panic!("second unregister: expected RegionNotRegistered, got {other:?}"),
    }
    match p.b.unregister(addr + 16).await {
        Err(Error::RegionNotRegistered { .. }) => {}
        other => panic!("unregister of an address where no region starts: expected RegionNotRegistered, got {other:?}"),
    }
    let before = dst.bytes();
    expect_addr_err(
        p.a.transfer(p.seg, TransferRequest::write(src.addr(), addr, 4096))
            .await,
        Some(Side::Remote),
        "write into an unregistered region",
    );
    assert_bytes(&dst.bytes(), &before, "an unregistered region was written");
    // SAFETY: a zero-length region; nothing is ever accessed through it.
    let empty = unsafe { MemoryRegion::from_raw_parts(dst.buf().as_ptr(), 0, Location::cpu(0)) };
    match p.b.register(empty).await {
        Err(Error::InvalidArgument(_)) => {}
        other => panic!("register of an empty region: expected InvalidArgument, got {other:?}"),
    }
    // Registering again after unregister works.
    dst.register(0, 8192).await;
    p.a.transfer(p.seg, TransferRequest::write(src.addr(), addr + 4096, 4096))
        .await
        .unwrap_or_else(|e| panic!("write after re-register failed: {e}"));
    assert_bytes(
        &dst.bytes()[4096..],
        &src.bytes(),
        "write after re-register",
    );
    src.release().await;
    dst.release().await;
    Outcome::Passed
}

/// A region that shares a byte with a registered one is refused with
/// `RegionOverlap`; adjacent regions are fine.
pub async fn check_overlap_refused(factory: Arc<dyn EngineFactory>, adapted: bool) -> Outcome {
    let e = match engine(&factory, adapted).await {
        Ok(e) => e,
        Err(o) => return o,
    };
    let mut m = Mem::unregistered(&e, 4 * 4096, 0);
    m.register(4096, 8192).await;
    for (off, len, what) in [
        (4096, 8192, "the same region"),
        (0, 4097, "a region overlapping its first byte"),
        (12287, 4097, "a region overlapping its last byte"),
        (6000, 100, "a region inside it"),
        (0, 16384, "a region containing it"),
    ] {
        match e.register(m.region(off, len)).await {
            Err(Error::RegionOverlap {
                existing_addr,
                existing_len,
                ..
            }) => {
                assert_eq!(
                    existing_addr,
                    m.at(4096),
                    "RegionOverlap names the wrong region"
                );
                assert_eq!(existing_len, 8192, "RegionOverlap names the wrong length");
            }
            other => panic!("register of {what}: expected RegionOverlap, got {other:?}"),
        }
    }
    m.register(0, 4096).await;
    m.register(12288, 4096).await;
    m.release().await;
    Outcome::Passed
}

/// Writes land byte for byte in the peer's memory; reads bring them back.
pub async fn check_write_read_round_trip(
    factory: Arc<dyn EngineFactory>,
    adapted: bool,
) -> Outcome {
    let p = match pair(&factory, adapted).await {
        Ok(p) => p,
        Err(o) => return o,
    };
    const N: usize = 256 * 1024;
    let src = Mem::new(&p.a, N, 11).await;
    let back = Mem::new(&p.a, N, 0).await;
    let dst = Mem::new(&p.b, N, 0).await;
    p.a.transfer(
        p.seg,
        TransferRequest::write(src.addr(), dst.addr(), N as u64),
    )
    .await
    .unwrap_or_else(|e| panic!("write of {N} bytes failed: {e}"));
    assert_bytes(&dst.bytes(), &src.bytes(), "peer memory after a write");
    // Overwrite a middle part with a different part of the source.
    p.a.transfer(
        p.seg,
        TransferRequest::write(src.at(1000), dst.at(50_000), 70_000),
    )
    .await
    .unwrap_or_else(|e| panic!("write at an offset failed: {e}"));
    let mut model = src.bytes();
    model.copy_within(1000..71_000, 50_000);
    assert_bytes(
        &dst.bytes(),
        &model,
        "peer memory after a write at an offset",
    );
    p.a.transfer(
        p.seg,
        TransferRequest::read(back.addr(), dst.addr(), N as u64),
    )
    .await
    .unwrap_or_else(|e| panic!("read of {N} bytes failed: {e}"));
    assert_bytes(&back.bytes(), &model, "local memory after a read");
    // The source was never changed by any of this.
    assert_bytes(&src.bytes(), &pattern(11, N), "source memory");
    src.release().await;
    back.release().await;
    dst.release().await;
    Outcome::Passed
}

/// What a default adapter must report over each native capability set a
/// backend of this workspace declares, written out by hand rather than
/// computed by the adapter's own rules, so that the check can disagree with
/// the adapter.
///
/// Columns, in [`Operation::OPTIONAL`] order: batch_register,
/// batch_unregister, batch_transfer, async_batch, batch_wait, notify (`y` =
/// available, `-` = not). The adapter emulates every batch operation; it
/// cannot add notifications, and keeps them only when a native batch path
/// (batch_transfer or async_batch) exists to carry them.
pub(super) const EXPECTED_EFFECTIVE: &[(&str, &str)] = &[
    // inproc `none`; nothing native.
    ("------", "yyyyy-"),
    // inproc `all`, tcp, Mooncake ≥ v0.3.5.
    ("yyyyyy", "yyyyyy"),
    // Mooncake v0.2.0 and v0.3.0: every batch call, no notify.
    ("yyyyy-", "yyyyy-"),
    // verbs: batches and notify, registration one region at a time.
    ("--yyyy", "yyyyyy"),
    // inproc `async_notify`.
    ("---y-y", "yyyyyy"),
    // inproc `only_*`.
    ("y-----", "yyyyy-"),
    ("-y----", "yyyyy-"),
    ("--y---", "yyyyy-"),
    ("---y--", "yyyyy-"),
    ("----y-", "yyyyy-"),
    // notify without any native batch path to carry it is dropped.
    ("-----y", "yyyyy-"),
];

/// The six optional-operation flags of `caps` as in `EXPECTED_EFFECTIVE`.
pub(super) fn caps_flags(caps: &Capabilities) -> String {
    Operation::OPTIONAL
        .iter()
        .map(|op| if caps.supports(*op) { 'y' } else { '-' })
        .collect()
}

/// The effective set `EXPECTED_EFFECTIVE` gives for `native`: its flags,
/// no batch-length limit (the adapter splits batches), the same memory kinds.
///
/// # Panics
///
/// When the table has no row for `native`: add one, worked out by hand.
pub(super) fn expected_effective(native: &Capabilities) -> Capabilities {
    let key = caps_flags(native);
    let Some((_, flags)) = EXPECTED_EFFECTIVE.iter().find(|(n, _)| *n == key) else {
        panic!(
            "conformance::EXPECTED_EFFECTIVE has no row for native capabilities {key}: \
             add one, worked out by hand"
        )
    };
    // Guarantees pass through the adapter unchanged: it cannot add them.
    let mut eff = Capabilities {
        max_batch_len: None,
        memory: native.memory,
        landed_writes: native.landed_writes,
        peer_validation: native.peer_validation,
        ..Capabilities::default()
    };
    for (op, flag) in Operation::OPTIONAL.iter().zip(flags.chars()) {
        eff.set(*op, flag == 'y');
    }
    eff
}

/// Every declared optional operation works (never `Unsupported`); every
/// undeclared one answers `Unsupported`. Through the adapter the declared set
/// is the effective one, which must equal the hand-written
/// `EXPECTED_EFFECTIVE` row of the native set.
pub async fn check_capability_honesty(factory: Arc<dyn EngineFactory>, adapted: bool) -> Outcome {
    let (a_raw, b_raw) = match (factory.create().await, factory.create().await) {
        (Ok(a), Ok(b)) => (a, b),
        (Err(e), _) | (_, Err(e)) => return factory_failed(&e),
    };
    let native = a_raw.capabilities();
    let (a, b): (Arc<dyn DynTransferEngine>, Arc<dyn DynTransferEngine>) = if adapted {
        (full_stack(a_raw), full_stack(b_raw))
    } else {
        (a_raw, b_raw)
    };
    let caps = a.capabilities();
    if adapted {
        let expected = expected_effective(&native);
        assert_eq!(
            caps,
            expected,
            "the default stack (layers over a default adapter) over native {} reports {} instead of {}",
            caps_flags(&native),
            caps_flags(&caps),
            caps_flags(&expected)
        );
    }
    let seg = a
        .open_segment(b.segment_name())
        .await
        .unwrap_or_else(|e| panic!("open_segment failed: {e}"));
    let src = Mem::new(&a, 4096, 5).await;
    let dst = Mem::new(&b, 4096, 0).await;
    let one = [TransferRequest::write(src.addr(), dst.addr(), 64)];

    #[track_caller]
    fn honest<T: std::fmt::Debug>(declared: bool, r: &Result<T>, op: Operation, call: &str) {
        if declared {
            assert!(
                !is_unsupported(r),
                "{op} is declared but {call} answered Unsupported: {r:?}"
            );
        } else {
            match r {
                Err(Error::Unsupported { operation, .. }) => assert_eq!(
                    *operation, op,
                    "{call}: Unsupported names the wrong operation"
                ),
                other => {
                    panic!("{op} is not declared but {call} did not answer Unsupported: {other:?}")
                }
            }
        }
    }

    // batch_register / batch_unregister
    let extra = Mem::unregistered(&a, 8192, 0);
    let regions = [extra.region(0, 4096), extra.region(4096, 4096)];
    let addrs = [regions[0].addr(), regions[1].addr()];
    let r = a.batch_register(Vec::from(regions)).await;
    honest(
        caps.batch_register,
        &r,
        Operation::BatchRegister,
        "batch_register",
    );
    if let Err(e) = &r {
        if caps.batch_register {
            panic!("batch_register of two fresh regions failed: {e}");
        }
    }
    if caps.batch_register {
        let r = a.batch_unregister(&addrs).await;
        honest(
            caps.batch_unregister,
            &r,
            Operation::BatchUnregister,
            "batch_unregister",
        );
        if r.is_err() {
            for addr in addrs {
                a.unregister(addr)
                    .await
                    .unwrap_or_else(|e| panic!("unregister failed: {e}"));
            }
        }
    } else {
        let r = a.batch_unregister(&addrs).await;
        // Nothing is registered: a declared batch_unregister answers
        // RegionNotRegistered, an undeclared one Unsupported.
        honest(
            caps.batch_unregister,
            &r,
            Operation::BatchUnregister,
            "batch_unregister",
        );
    }
    drop(extra);

    // batch_transfer
    let r = a.batch_transfer(seg, &one, None).await;
    honest(
        caps.batch_transfer,
        &r,
        Operation::BatchTransfer,
        "batch_transfer",
    );
    if caps.batch_transfer {
        assert_all_ok(&r.expect("checked above"), "batch_transfer of one request");
    }

    // submit / status / release_batch / wait
    let r = a.submit(seg, &one, None).await;
    honest(caps.async_batch, &r, Operation::AsyncBatch, "submit");
    let never = BatchId(u64::MAX);
    honest(
        caps.async_batch,
        &a.status(never),
        Operation::AsyncBatch,
        "status",
    );
    if let Ok(id) = r {
        let st = a.status(id);
        assert!(st.is_ok(), "status of a fresh batch failed: {st:?}");
        let w = a.wait(id).await;
        honest(caps.batch_wait, &w, Operation::BatchWait, "wait");
        match w {
            Ok(report) => assert_all_ok(&report, "waited batch of one request"),
            Err(_) => {
                let report = finish(&a, id).await;
                assert_all_ok(&report, "polled batch of one request");
            }
        }
    } else {
        honest(
            caps.async_batch,
            &a.release_batch(never).await,
            Operation::AsyncBatch,
            "release_batch",
        );
        // wait without async batches must not pretend to work.
        assert!(
            a.wait(never).await.is_err(),
            "wait on a never-issued batch succeeded"
        );
    }

    // notifications
    let r = b.take_notifications().await;
    honest(caps.notify, &r, Operation::Notify, "take_notifications");
    let note = Notification::new("honesty", "n");
    if caps.batch_transfer {
        let r = a.batch_transfer(seg, &one, Some(&note)).await;
        honest(
            caps.notify,
            &r,
            Operation::Notify,
            "batch_transfer with a notification",
        );
    }
    if caps.async_batch {
        let r = a.submit(seg, &one, Some(&note)).await;
        honest(
            caps.notify,
            &r,
            Operation::Notify,
            "submit with a notification",
        );
        if let Ok(id) = r {
            finish(&a, id).await;
        }
    }
    a.close_segment(seg)
        .await
        .unwrap_or_else(|e| panic!("close_segment failed: {e}"));
    src.release().await;
    dst.release().await;
    Outcome::Passed
}

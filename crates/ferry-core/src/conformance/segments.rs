//! All-or-nothing batch registration and unknown segments.

use super::harness::*;
use super::*;

/// `batch_register` is all-or-nothing: when one region fails, the error
/// names its index and nothing of the call stays registered.
pub async fn check_batch_register_rollback(
    factory: Arc<dyn EngineFactory>,
    adapted: bool,
) -> Outcome {
    let p = match pair(&factory, adapted).await {
        Ok(p) => p,
        Err(o) => return o,
    };
    if !p.b.capabilities().batch_register {
        return Outcome::Skipped("needs batch_register".to_owned());
    }
    const PAGE: usize = 4096;
    let src = Mem::new(&p.a, PAGE, 101).await;
    let mut m = Mem::unregistered(&p.b, 6 * PAGE, 0);
    m.register(3 * PAGE, PAGE).await; // the obstacle
    let attempts: [(Vec<(usize, usize)>, usize); 3] = [
        // The third overlaps the obstacle.
        (
            vec![
                (0, PAGE),
                (PAGE, PAGE),
                (2 * PAGE, 2 * PAGE),
                (4 * PAGE, PAGE),
            ],
            2,
        ),
        // The same region twice.
        (vec![(0, PAGE), (0, PAGE)], 1),
        // An empty region last.
        (vec![(0, PAGE), (PAGE, PAGE), (5 * PAGE, 0)], 2),
    ];
    for (ranges, bad) in attempts {
        let regions: Vec<MemoryRegion> = ranges.iter().map(|&(o, l)| m.region(o, l)).collect();
        let addrs: Vec<u64> = regions.iter().map(|r| r.addr()).collect();
        match p.b.batch_register(regions).await {
            Err(Error::BatchRegisterFailed { index, addr, .. }) => {
                assert_eq!(index, bad, "BatchRegisterFailed names the wrong index");
                assert_eq!(addr, addrs[bad], "BatchRegisterFailed names the wrong address");
            }
            other => panic!("batch_register with a bad region {bad}: expected BatchRegisterFailed, got {other:?}"),
        }
        for (i, &(o, l)) in ranges.iter().enumerate() {
            if l == 0 || o == 3 * PAGE {
                continue;
            }
            let r =
                p.a.transfer(p.seg, TransferRequest::write(src.addr(), m.at(o), 64))
                    .await;
            expect_addr_err(
                r,
                Some(Side::Remote),
                &format!("region {i} after a failed batch_register"),
            );
        }
        assert_bytes(
            &m.bytes(),
            &vec![0; 6 * PAGE],
            "memory of a rolled-back batch_register",
        );
    }
    // The obstacle is still registered and a good batch works.
    p.a.transfer(
        p.seg,
        TransferRequest::write(src.addr(), m.at(3 * PAGE), 64),
    )
    .await
    .unwrap_or_else(|e| panic!("the region registered before the failed batch is gone: {e}"));
    let good: Vec<MemoryRegion> = [0, PAGE, 2 * PAGE]
        .iter()
        .map(|&o| m.region(o, PAGE))
        .collect();
    let good_addrs: Vec<u64> = good.iter().map(|r| r.addr()).collect();
    p.b.batch_register(good)
        .await
        .unwrap_or_else(|e| panic!("batch_register of three free regions failed: {e}"));
    for o in [0, PAGE, 2 * PAGE] {
        m.registered.push(m.at(o));
        p.a.transfer(p.seg, TransferRequest::write(src.addr(), m.at(o), 64))
            .await
            .unwrap_or_else(|e| panic!("write into a batch-registered region failed: {e}"));
    }
    if p.b.capabilities().batch_unregister {
        let addrs = good_addrs.clone();
        p.b.batch_unregister(&addrs)
            .await
            .unwrap_or_else(|e| panic!("batch_unregister failed: {e}"));
        for o in [0, PAGE, 2 * PAGE] {
            m.forget_registration(o);
        }
        let r =
            p.a.transfer(p.seg, TransferRequest::write(src.addr(), m.at(0), 64))
                .await;
        expect_addr_err(r, Some(Side::Remote), "write after batch_unregister");
    }
    src.release().await;
    m.release().await;
    Outcome::Passed
}

/// Transfers on a handle that was never opened, was closed, or belongs to
/// another engine of the process fail with `UnknownSegment` and move
/// nothing.
pub async fn check_unknown_segment(factory: Arc<dyn EngineFactory>, adapted: bool) -> Outcome {
    let p = match pair(&factory, adapted).await {
        Ok(p) => p,
        Err(o) => return o,
    };
    let local = Mem::new(&p.a, 4096, 111).await;
    let remote = Mem::new(&p.b, 4096, 0).await;
    let bogus = SegmentId(u64::MAX - 1);
    let req = TransferRequest::write(local.addr(), remote.addr(), 64);
    let caps = p.a.capabilities();
    let check = |r: Result<()>, what: &str| match r {
        Err(Error::UnknownSegment(s)) => s,
        other => panic!("{what}: expected UnknownSegment, got {other:?}"),
    };
    // Open another handle to close it.
    let closed =
        p.a.open_segment(p.b.segment_name())
            .await
            .unwrap_or_else(|e| panic!("open_segment failed: {e}"));
    p.a.close_segment(closed)
        .await
        .unwrap_or_else(|e| panic!("close_segment failed: {e}"));
    for (seg, what) in [(bogus, "never opened"), (closed, "closed")] {
        assert_eq!(
            check(
                p.a.transfer(seg, req).await,
                &format!("transfer on a {what} handle")
            ),
            seg
        );
        assert_eq!(
            check(
                p.a.close_segment(seg).await,
                &format!("close_segment of a {what} handle")
            ),
            seg
        );
        if caps.batch_transfer {
            let r = p.a.batch_transfer(seg, &[req], None).await.map(drop);
            check(r, &format!("batch_transfer on a {what} handle"));
        }
        if caps.async_batch {
            match p.a.submit(seg, &[req], None).await {
                Err(Error::UnknownSegment(_)) => {}
                Ok(id) => {
                    // Accepted, but every request must fail with UnknownSegment.
                    let report = finish(&p.a, id).await;
                    for r in report.results {
                        check(r, &format!("request submitted on a {what} handle"));
                    }
                }
                Err(e) => panic!("submit on a {what} handle: expected UnknownSegment, got {e}"),
            }
        }
    }
    assert_bytes(
        &remote.bytes(),
        &[0; 4096],
        "peer memory after transfers on bad handles",
    );
    // The good handle still works.
    p.a.transfer(p.seg, req)
        .await
        .unwrap_or_else(|e| panic!("transfer on the open handle failed: {e}"));
    // Handles of another engine: `c` opens a peer `d` of its own. Each
    // engine's handle used on the other is UnknownSegment there, and no
    // peer's memory changes (with handles numbered per engine both would be
    // #1, and `c` would write to `d`'s... or `a` to `b` through `c`'s).
    let c = match engine(&factory, adapted).await {
        Ok(e) => e,
        Err(o) => return o,
    };
    let d = match engine(&factory, adapted).await {
        Ok(e) => e,
        Err(o) => return o,
    };
    let c_local = Mem::new(&c, 4096, 112).await;
    let d_remote = Mem::new(&d, 4096, 0).await;
    let c_seg = c
        .open_segment(d.segment_name())
        .await
        .unwrap_or_else(|e| panic!("open_segment failed: {e}"));
    assert_ne!(c_seg, p.seg, "two engines issued the same segment handle");
    let before = remote.bytes();
    let cross = TransferRequest::write(c_local.addr(), d_remote.addr(), 64);
    check(
        c.transfer(p.seg, cross).await,
        "transfer on another engine's handle",
    );
    check(
        p.a.transfer(c_seg, req).await,
        "transfer on another engine's handle",
    );
    assert_bytes(
        &d_remote.bytes(),
        &[0; 4096],
        "a peer's memory after a transfer on another engine's handle",
    );
    assert_bytes(
        &remote.bytes(),
        &before,
        "a peer's memory after a transfer on another engine's handle",
    );
    c_local.release().await;
    d_remote.release().await;
    local.release().await;
    remote.release().await;
    Outcome::Passed
}

/// Opening a segment name no engine answers to fails with a typed error
/// (`SegmentUnavailable`, or for malformed names `InvalidArgument`).
pub async fn check_open_unknown_segment(factory: Arc<dyn EngineFactory>, adapted: bool) -> Outcome {
    let e = match engine(&factory, adapted).await {
        Ok(e) => e,
        Err(o) => return o,
    };
    let name = factory.unknown_segment_name();
    match e.open_segment(&name).await {
        Err(
            Error::SegmentUnavailable { .. }
            | Error::InvalidArgument(_)
            | Error::PeerLost { .. }
            | Error::Io { .. }
            | Error::Timeout { .. },
        ) => {}
        other => panic!("open_segment({name:?}): expected SegmentUnavailable, got {other:?}"),
    }
    Outcome::Passed
}

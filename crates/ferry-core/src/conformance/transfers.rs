//! Single transfers: address checks on both sides, zero length, unaligned ranges, unregister while transfers are in flight.

use super::harness::*;
use super::*;

/// A remote range outside the peer's registered regions (straddling an end,
/// before, after, wrapping, straddling two adjacent regions) fails with
/// `AddressNotRegistered` and changes no byte on either side.
pub async fn check_remote_out_of_bounds(factory: Arc<dyn EngineFactory>, adapted: bool) -> Outcome {
    let p = match pair(&factory, adapted).await {
        Ok(p) => p,
        Err(o) => return o,
    };
    let local = Mem::new(&p.a, 8192, 21).await;
    // Remote: 3 pages; pages 0 and 1 registered as two adjacent regions,
    // page 2 unregistered.
    let mut remote = Mem::unregistered(&p.b, 3 * 4096, 22);
    remote.register(0, 4096).await;
    remote.register(4096, 4096).await;
    let r0 = remote.addr();
    let cases: [(u64, u64, &str); 7] = [
        (r0 + 8192 - 8, 16, "straddling the end of the last region"),
        (r0 + 8192, 8, "just past the last region"),
        (r0.wrapping_sub(8), 16, "straddling the start"),
        (r0 + 4096 - 8, 16, "straddling two adjacent regions"),
        (u64::MAX - 4, 16, "wrapping around the address space"),
        (0, 16, "at address 0"),
        (r0 + 100, 8192, "starting inside but longer than the region"),
    ];
    let local_before = local.bytes();
    let remote_before = remote.bytes();
    for (addr, len, what) in cases {
        let w =
            p.a.transfer(p.seg, TransferRequest::write(local.addr(), addr, len))
                .await;
        expect_addr_err(w, Some(Side::Remote), &format!("write {what}"));
        let r =
            p.a.transfer(p.seg, TransferRequest::read(local.addr(), addr, len))
                .await;
        expect_addr_err(r, Some(Side::Remote), &format!("read {what}"));
        assert_bytes(
            &remote.bytes(),
            &remote_before,
            &format!("peer memory after a write {what}"),
        );
        assert_bytes(
            &local.bytes(),
            &local_before,
            &format!("local memory after a read {what}"),
        );
    }
    // A length that overflows: refused (on either side), nothing changes.
    let w =
        p.a.transfer(p.seg, TransferRequest::write(local.addr(), r0, u64::MAX))
            .await;
    expect_addr_err(w, None, "write of u64::MAX bytes");
    assert_bytes(
        &remote.bytes(),
        &remote_before,
        "peer memory after an overflowing write",
    );
    // Batches report the failure per request and still move the good ones.
    let caps = p.a.capabilities();
    if batch_path(&caps).is_some() {
        let reqs = [
            TransferRequest::write(local.addr(), r0, 64),
            TransferRequest::write(local.addr(), r0 + 8192 - 8, 16),
            TransferRequest::write(local.at(64), r0 + 4096, 64),
        ];
        let report = batch(&p.a, p.seg, &reqs, None)
            .await
            .unwrap_or_else(|e| panic!("a batch with one bad request was refused whole: {e}"));
        assert!(
            report.results[0].is_ok(),
            "request 0: {:?}",
            report.results[0]
        );
        expect_addr_err(
            report.results[1].clone(),
            Some(Side::Remote),
            "batched bad request",
        );
        assert!(
            report.results[2].is_ok(),
            "request 2: {:?}",
            report.results[2]
        );
        let mut model = remote_before.clone();
        model[..64].copy_from_slice(&local_before[..64]);
        model[4096..4160].copy_from_slice(&local_before[64..128]);
        assert_bytes(
            &remote.bytes(),
            &model,
            "peer memory after a partly failing batch",
        );
    }
    local.release().await;
    remote.release().await;
    Outcome::Passed
}

/// A local range that is not registered fails with `AddressNotRegistered`
/// (local side); neither memory changes.
pub async fn check_local_unregistered(factory: Arc<dyn EngineFactory>, adapted: bool) -> Outcome {
    let p = match pair(&factory, adapted).await {
        Ok(p) => p,
        Err(o) => return o,
    };
    let stray = Mem::unregistered(&p.a, 4096, 31);
    let mut local = Mem::unregistered(&p.a, 8192, 32);
    local.register(0, 4096).await;
    let remote = Mem::new(&p.b, 4096, 33).await;
    let stray_before = stray.bytes();
    let local_before = local.bytes();
    let remote_before = remote.bytes();
    let cases: [(u64, u64, &str); 3] = [
        (stray.addr(), 64, "in unregistered memory"),
        (
            local.at(4096 - 8),
            16,
            "straddling the end of a local region",
        ),
        (local.at(4096), 64, "just past a local region"),
    ];
    for (addr, len, what) in cases {
        let w =
            p.a.transfer(p.seg, TransferRequest::write(addr, remote.addr(), len))
                .await;
        expect_addr_err(w, Some(Side::Local), &format!("write from {what}"));
        let r =
            p.a.transfer(p.seg, TransferRequest::read(addr, remote.addr(), len))
                .await;
        expect_addr_err(r, Some(Side::Local), &format!("read into {what}"));
        assert_bytes(&remote.bytes(), &remote_before, "peer memory");
        assert_bytes(&stray.bytes(), &stray_before, "unregistered local memory");
        assert_bytes(&local.bytes(), &local_before, "local memory");
    }
    stray.release().await;
    local.release().await;
    remote.release().await;
    Outcome::Passed
}

/// A zero-length request succeeds, moves nothing and checks no address.
pub async fn check_zero_length(factory: Arc<dyn EngineFactory>, adapted: bool) -> Outcome {
    let p = match pair(&factory, adapted).await {
        Ok(p) => p,
        Err(o) => return o,
    };
    let local = Mem::new(&p.a, 4096, 41).await;
    let remote = Mem::new(&p.b, 4096, 0).await;
    let before = remote.bytes();
    for (l, r) in [
        (local.addr(), remote.addr()),
        (local.end(), remote.end()),
        (0, 0),
        (u64::MAX, u64::MAX),
    ] {
        for req in [
            TransferRequest::write(l, r, 0),
            TransferRequest::read(l, r, 0),
        ] {
            p.a.transfer(p.seg, req)
                .await
                .unwrap_or_else(|e| panic!("zero-length {req:?} failed: {e}"));
        }
    }
    assert_bytes(
        &remote.bytes(),
        &before,
        "peer memory after zero-length writes",
    );
    assert_bytes(
        &local.bytes(),
        &pattern(41, 4096),
        "local memory after zero-length reads",
    );
    if batch_path(&p.a.capabilities()).is_some() {
        let reqs = [
            TransferRequest::write(0, 0, 0),
            TransferRequest::write(local.addr(), remote.addr(), 100),
            TransferRequest::write(local.at(100), remote.at(100), 0),
            TransferRequest::write(local.at(100), remote.at(100), 28),
        ];
        let report = batch(&p.a, p.seg, &reqs, None)
            .await
            .unwrap_or_else(|e| panic!("batch with zero-length requests refused: {e}"));
        assert_all_ok(&report, "batch with zero-length requests");
        let mut model = before.clone();
        model[..128].copy_from_slice(&pattern(41, 128));
        assert_bytes(
            &remote.bytes(),
            &model,
            "peer memory after a batch with zero-length requests",
        );
        let empty = batch(&p.a, p.seg, &[], None)
            .await
            .unwrap_or_else(|e| panic!("an empty batch was refused: {e}"));
        assert!(empty.is_empty(), "an empty batch reported results");
    }
    local.release().await;
    remote.release().await;
    Outcome::Passed
}

/// Odd offsets and lengths (1, 3, 7, page ± 1 …) move exactly those bytes.
pub async fn check_unaligned(factory: Arc<dyn EngineFactory>, adapted: bool) -> Outcome {
    let p = match pair(&factory, adapted).await {
        Ok(p) => p,
        Err(o) => return o,
    };
    const N: usize = 5 * 4096;
    let local = Mem::new(&p.a, N, 51).await;
    let back = Mem::new(&p.a, N, 0).await;
    let remote = Mem::new(&p.b, N, 52).await;
    let src = pattern(51, N);
    let mut model = pattern(52, N);
    let cases: [(usize, usize, usize); 8] = [
        (1, 3, 1),
        (7, 13, 3),
        (5, 4097, 4095),
        (333, 8191, 7),
        (4095, 1, 4097),
        (8193, 12287, 4097),
        (3, 16383, 4001),
        (N - 1, N - 1, 1),
    ];
    for (lo, ro, len) in cases {
        p.a.transfer(
            p.seg,
            TransferRequest::write(local.at(lo), remote.at(ro), len as u64),
        )
        .await
        .unwrap_or_else(|e| panic!("unaligned write {lo}->{ro} len {len} failed: {e}"));
        model[ro..ro + len].copy_from_slice(&src[lo..lo + len]);
        assert_bytes(
            &remote.bytes(),
            &model,
            &format!("peer memory after unaligned write {lo}->{ro} len {len}"),
        );
    }
    let mut back_model = vec![0u8; N];
    for (lo, ro, len) in cases {
        p.a.transfer(
            p.seg,
            TransferRequest::read(back.at(ro), remote.at(lo), len as u64),
        )
        .await
        .unwrap_or_else(|e| panic!("unaligned read {lo}->{ro} len {len} failed: {e}"));
        back_model[ro..ro + len].copy_from_slice(&model[lo..lo + len]);
        assert_bytes(
            &back.bytes(),
            &back_model,
            &format!("local memory after unaligned read {lo}->{ro} len {len}"),
        );
    }
    if batch_path(&p.a.capabilities()).is_some() {
        // Unaligned, scattered requests in one batch; destinations never
        // overlap (the trait leaves overlapping destinations unspecified).
        let reqs: Vec<TransferRequest> = (0..40)
            .map(|i| {
                let len = 1 + (i * 37) % 301;
                let lo = 1 + i * 311;
                let ro = if i % 3 == 0 { 3 + i * 400 } else { 7 + i * 400 };
                TransferRequest::write(local.at(lo), remote.at(ro), len as u64)
            })
            .collect();
        for r in &reqs {
            let lo = (r.local_addr - local.addr()) as usize;
            let ro = (r.remote_addr - remote.addr()) as usize;
            let len = r.len as usize;
            model[ro..ro + len].copy_from_slice(&src[lo..lo + len]);
        }
        let report = batch(&p.a, p.seg, &reqs, None)
            .await
            .unwrap_or_else(|e| panic!("unaligned batch refused: {e}"));
        assert_all_ok(&report, "unaligned batch");
        assert_bytes(
            &remote.bytes(),
            &model,
            "peer memory after an unaligned batch",
        );
    }
    local.release().await;
    back.release().await;
    remote.release().await;
    Outcome::Passed
}

/// Unregistering a region while transfers use it (as remote target, as local
/// destination) returns only when they have finished or failed: no byte of
/// it changes after `unregister` returns, a transfer that reports success has
/// moved all its bytes, and new transfers are refused.
///
/// The check proves that the transfers really were in flight: right before
/// `unregister` is called, part of the bytes have landed and the end of at
/// least one transfer has not. A round that cannot show that (the transfers
/// were too fast) is repeated with more bytes (`IN_FLIGHT_SIZES`); failing
/// to catch a transfer in flight at all fails the check, so it can never
/// quietly test the idle case.
pub async fn check_unregister_in_flight(factory: Arc<dyn EngineFactory>, adapted: bool) -> Outcome {
    let p = match pair(&factory, adapted).await {
        Ok(p) => p,
        Err(o) => return o,
    };
    for remote_side in [true, false] {
        let side = if remote_side { "remote" } else { "local" };
        let mut caught = false;
        for n in IN_FLIGHT_SIZES {
            if unregister_round(&p, remote_side, n).await {
                caught = true;
                break;
            }
        }
        assert!(
            caught,
            "unregister_in_flight ({side} side): in {} rounds of up to {} MiB, every transfer \
             had finished before unregister could be called; the check could not catch a \
             transfer in flight",
            IN_FLIGHT_SIZES.len(),
            IN_FLIGHT_SIZES[IN_FLIGHT_SIZES.len() - 1] >> 20
        );
    }
    p.a.close_segment(p.seg)
        .await
        .unwrap_or_else(|e| panic!("close_segment failed: {e}"));
    Outcome::Passed
}

/// The region sizes of the rounds of [`check_unregister_in_flight`], until
/// one catches a transfer in flight. Later rounds repeat the largest size: on
/// a busy machine the checking thread can lose the processor for the whole of
/// a fast transfer.
pub(super) const IN_FLIGHT_SIZES: [usize; 8] = [
    4 << 20,
    16 << 20,
    64 << 20,
    64 << 20,
    64 << 20,
    64 << 20,
    64 << 20,
    64 << 20,
];

/// One round of [`check_unregister_in_flight`] with a victim region of `n`
/// bytes; returns whether a transfer was shown to be in flight when
/// `unregister` was called (every rule is asserted either way).
pub(super) async fn unregister_round(p: &Pair, remote_side: bool, n: usize) -> bool {
    const K: usize = 4;
    let part_len = n / K;
    let side = if remote_side { "remote" } else { "local" };
    let src_local = Mem::new(&p.a, n, 61).await;
    let src_remote = Mem::new(&p.b, n, 62).await;
    let expected = if remote_side {
        pattern(61, n)
    } else {
        pattern(62, n)
    };
    // The region that will be unregistered: the peer's target of writes, or
    // the local destination of reads.
    let mut victim = if remote_side {
        Mem::new(&p.b, n, 0).await
    } else {
        Mem::new(&p.a, n, 0).await
    };
    let mut tasks = Vec::new();
    for k in 0..K {
        let a = Arc::clone(&p.a);
        let seg = p.seg;
        let off = (k * part_len) as u64;
        let len = part_len as u64;
        let req = if remote_side {
            TransferRequest::write(src_local.addr() + off, victim.addr() + off, len)
        } else {
            TransferRequest::read(victim.addr() + off, src_remote.addr() + off, len)
        };
        tasks.push(tokio::spawn(async move { a.transfer(seg, req).await }));
    }
    let landed = |at: usize| {
        let mut s = [0u8; 16];
        victim.buf().read(at, &mut s).expect("reading test memory");
        s[..] == expected[at..at + 16]
    };
    // Wait until the first bytes land (the transfers have started), or until
    // they are all done.
    let start = Instant::now();
    loop {
        if (0..K).any(|k| landed(k * part_len)) || tasks.iter().all(|t| t.is_finished()) {
            break;
        }
        assert!(
            start.elapsed() < LIVENESS,
            "transfers made no progress in {LIVENESS:?}"
        );
        tokio::task::yield_now().await;
    }
    // The proof of overlap: the last bytes of some transfer are not there yet.
    let in_flight = (0..K).any(|k| !landed((k + 1) * part_len - 16));
    let owner = if remote_side { &p.b } else { &p.a };
    owner
        .unregister(victim.addr())
        .await
        .unwrap_or_else(|e| panic!("unregister during transfers failed: {e}"));
    victim.forget_registration(0);
    // Sample the region at once (a full copy would take long enough for a
    // misbehaving engine to finish in the meantime), then in full.
    const STEP: usize = 8 * 1024;
    let samples: Vec<[u8; 16]> = (0..n / STEP)
        .map(|i| {
            let mut s = [0u8; 16];
            victim
                .buf()
                .read(i * STEP + STEP - 16, &mut s)
                .expect("reading test memory");
            s
        })
        .collect();
    let snapshot = victim.bytes();
    let mut results = Vec::new();
    for t in tasks {
        results.push(t.await.expect("transfer task panicked"));
    }
    let now = victim.bytes();
    for (i, sample) in samples.iter().enumerate() {
        let at = i * STEP + STEP - 16;
        assert_eq!(
            &now[at..at + 16],
            sample,
            "{side} region changed at offset {at} after unregister returned"
        );
    }
    assert_bytes(
        &now,
        &snapshot,
        &format!("{side} region changed after unregister returned"),
    );
    for (k, r) in results.iter().enumerate() {
        if r.is_ok() {
            let part = k * part_len..(k + 1) * part_len;
            assert_bytes(
                &snapshot[part.clone()],
                &expected[part],
                &format!("transfer {k} reported success but its bytes were not all there when unregister returned ({side} side)"),
            );
        }
    }
    // New transfers are refused.
    let req = if remote_side {
        TransferRequest::write(src_local.addr(), victim.addr(), 64)
    } else {
        TransferRequest::read(victim.addr(), src_remote.addr(), 64)
    };
    let want = if remote_side {
        Side::Remote
    } else {
        Side::Local
    };
    expect_addr_err(
        p.a.transfer(p.seg, req).await,
        Some(want),
        &format!("transfer after unregister ({side} side)"),
    );
    victim.release().await; // frees the memory
    src_local.release().await;
    src_remote.release().await;
    in_flight
}

/// Polls `fut` once with a waker that never wakes (as a blocked caller's
/// first look does, [`crate::assist::block_on`]), then, if it is not done,
/// drives the same future to its end: a future must take the waker of its
/// latest poll, so the first look never loses a wake-up, and what it did
/// counts once. Whether it finished at the first look, and its outcome.
async fn first_look<T>(fut: impl std::future::Future<Output = T>) -> (bool, T) {
    let mut fut = std::pin::pin!(fut);
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    match fut.as_mut().poll(&mut cx) {
        std::task::Poll::Ready(out) => (true, out),
        std::task::Poll::Pending => (false, fut.await),
    }
}

/// A transfer looked at once and then driven (see [`first_look`]) does what
/// `transfer` does: the bytes of a write or a read land, an unregistered
/// local range and a remote range outside the peer's regions fail typed
/// with no byte changed, an unknown segment is `UnknownSegment`, an empty
/// request succeeds. Each request is made after the same request went
/// through `transfer` once (tables and connections are warm: where the
/// engine can finish a call on its first poll, it does here; the count is
/// printed).
pub async fn check_first_poll(factory: Arc<dyn EngineFactory>, adapted: bool) -> Outcome {
    let p = match pair(&factory, adapted).await {
        Ok(p) => p,
        Err(o) => return o,
    };
    const N: usize = 4096;
    let src = Mem::new(&p.a, 2 * N, 41).await;
    let back = Mem::new(&p.a, N, 0).await;
    let dst = Mem::new(&p.b, 2 * N, 0).await;
    let stray = Mem::unregistered(&p.a, N, 42);
    // Warm: the first half through `transfer`.
    p.a.transfer(
        p.seg,
        TransferRequest::write(src.addr(), dst.addr(), N as u64),
    )
    .await
    .unwrap_or_else(|e| panic!("write of {N} bytes failed: {e}"));
    let mut at_once = 0;
    let w = TransferRequest::write(src.at(N), dst.at(N), N as u64);
    let (now, r) = first_look(p.a.transfer(p.seg, w)).await;
    r.unwrap_or_else(|e| panic!("write looked at once failed: {e}"));
    at_once += usize::from(now);
    assert_bytes(&dst.bytes(), &src.bytes(), "peer memory after the writes");
    let r = TransferRequest::read(back.addr(), dst.at(N), N as u64);
    let (now, res) = first_look(p.a.transfer(p.seg, r)).await;
    res.unwrap_or_else(|e| panic!("read looked at once failed: {e}"));
    at_once += usize::from(now);
    assert_bytes(
        &back.bytes(),
        &src.bytes()[N..],
        "local memory after the read",
    );
    // Refusals: typed; no byte changes.
    let (src_before, dst_before, stray_before) = (src.bytes(), dst.bytes(), stray.bytes());
    let bad: [(TransferRequest, Option<Side>, &str); 3] = [
        (
            TransferRequest::write(stray.addr(), dst.addr(), 64),
            Some(Side::Local),
            "a write from unregistered memory",
        ),
        (
            TransferRequest::read(stray.addr(), dst.addr(), 64),
            Some(Side::Local),
            "a read into unregistered memory",
        ),
        (
            TransferRequest::write(src.addr(), dst.at(2 * N - 8), 16),
            Some(Side::Remote),
            "a write past the peer's region",
        ),
    ];
    for (req, side, what) in bad {
        let (_, r) = first_look(p.a.transfer(p.seg, req)).await;
        expect_addr_err(r, side, &format!("{what}, looked at once"));
        assert_bytes(&src.bytes(), &src_before, "local memory");
        assert_bytes(&dst.bytes(), &dst_before, "peer memory");
        assert_bytes(&stray.bytes(), &stray_before, "unregistered local memory");
    }
    let unknown = SegmentId(p.seg.0.wrapping_add(1 << 40));
    let req = TransferRequest::write(src.addr(), dst.addr(), 8);
    match first_look(p.a.transfer(unknown, req)).await.1 {
        Err(Error::UnknownSegment(_)) => {}
        other => panic!("a transfer on an unknown segment, looked at once: {other:?}"),
    }
    let (_, r) = first_look(p.a.transfer(p.seg, TransferRequest::write(0, 0, 0))).await;
    r.unwrap_or_else(|e| panic!("an empty request looked at once failed: {e}"));
    assert_bytes(&dst.bytes(), &dst_before, "peer memory");
    println!(
        "first_poll: {at_once} of 2 valid calls finished on their first poll ({})",
        p.a.backend_name()
    );
    src.release().await;
    back.release().await;
    dst.release().await;
    Outcome::Passed
}

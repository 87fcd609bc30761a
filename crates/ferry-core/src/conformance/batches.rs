//! Batches: one, many, thousands of requests, and the asynchronous batch API.

use super::harness::*;
use super::*;

/// Builds `n` write requests of `size` bytes from `local` slots to `remote`
/// slots: the first half in order (contiguous, so the adapter coalesces
/// them), the rest scattered.
pub(super) fn slot_requests(
    local: &Mem,
    remote: &Mem,
    n: usize,
    size: usize,
) -> (Vec<TransferRequest>, Vec<usize>) {
    let mut targets: Vec<usize> = (0..n).collect();
    let half = n / 2;
    // Scatter the second half with a fixed permutation (multiplicative, odd
    // step, so distinct slots).
    let tail = n - half;
    for i in 0..tail {
        targets[half + i] = half + (i * 7919 + 13) % tail;
    }
    let reqs = (0..n)
        .map(|i| {
            TransferRequest::write(
                local.at(i * size),
                remote.at(targets[i] * size),
                size as u64,
            )
        })
        .collect();
    (reqs, targets)
}

pub(super) async fn batch_of(
    factory: Arc<dyn EngineFactory>,
    adapted: bool,
    n: usize,
    size: usize,
) -> Outcome {
    let p = match pair(&factory, adapted).await {
        Ok(p) => p,
        Err(o) => return o,
    };
    let caps = p.a.capabilities();
    if batch_path(&caps).is_none() {
        return Outcome::Skipped(NEEDS_BATCH.to_owned());
    }
    let local = Mem::new(&p.a, n * size, 71).await;
    let remote = Mem::new(&p.b, n * size, 0).await;
    let (reqs, targets) = slot_requests(&local, &remote, n, size);
    if let Some(max) = caps.max_batch_len {
        if n > max {
            match p.a.batch_transfer(p.seg, &reqs, None).await {
                Err(Error::BatchTooLarge { len, max: m }) => {
                    assert_eq!((len, m), (n, max), "BatchTooLarge reports wrong sizes");
                }
                Err(Error::Unsupported { .. }) if !caps.batch_transfer => {}
                other => panic!(
                    "a batch of {n} over the declared max_batch_len {max}: expected BatchTooLarge, got {other:?}"
                ),
            }
            assert_bytes(
                &remote.bytes(),
                &vec![0; n * size],
                "a refused batch moved bytes",
            );
        }
    }
    let report = batch(&p.a, p.seg, &reqs, None)
        .await
        .unwrap_or_else(|e| panic!("a batch of {n} x {size} B was refused: {e}"));
    assert_eq!(report.len(), n);
    assert_all_ok(&report, &format!("batch of {n} x {size} B"));
    let src = pattern(71, n * size);
    let mut model = vec![0u8; n * size];
    for (i, t) in targets.iter().enumerate() {
        model[t * size..(t + 1) * size].copy_from_slice(&src[i * size..(i + 1) * size]);
    }
    assert_bytes(
        &remote.bytes(),
        &model,
        &format!("peer memory after a batch of {n}"),
    );
    local.release().await;
    remote.release().await;
    Outcome::Passed
}

/// A batch of one request.
pub async fn check_batch_one(factory: Arc<dyn EngineFactory>, adapted: bool) -> Outcome {
    batch_of(factory, adapted, 1, 4096).await
}

/// A batch of 100 requests of 1000 bytes, half contiguous, half scattered.
pub async fn check_batch_many(factory: Arc<dyn EngineFactory>, adapted: bool) -> Outcome {
    batch_of(factory, adapted, 100, 1000).await
}

/// A batch of 4096 requests of 64 bytes, half contiguous, half scattered.
pub async fn check_batch_thousands(factory: Arc<dyn EngineFactory>, adapted: bool) -> Outcome {
    batch_of(factory, adapted, 4096, 64).await
}

/// `submit` returns a batch id; `status` reports one state per request (a
/// failing request as `Failed` at its index); `release_batch` of a pending
/// batch is `BatchBusy`; after `wait` or `release_batch` the id is
/// `UnknownBatch` everywhere.
pub async fn check_async_batch(factory: Arc<dyn EngineFactory>, adapted: bool) -> Outcome {
    let p = match pair(&factory, adapted).await {
        Ok(p) => p,
        Err(o) => return o,
    };
    let caps = p.a.capabilities();
    if !caps.async_batch {
        return Outcome::Skipped("needs async_batch".to_owned());
    }
    const N: usize = 16;
    const PART: usize = 256 << 10;
    let local = Mem::new(&p.a, N * PART, 81).await;
    let remote = Mem::new(&p.b, N * PART, 0).await;
    let max = caps.max_batch_len.unwrap_or(usize::MAX);
    let n = N.min(max);
    // Request 1 is out of bounds; the rest move 1 MiB each, scattered so
    // nothing coalesces.
    let reqs: Vec<TransferRequest> = (0..n)
        .map(|i| {
            if i == 1 {
                TransferRequest::write(local.addr(), remote.end() - 8, 16)
            } else {
                let t = (i * 5 + 3) % N;
                TransferRequest::write(local.at(i * PART), remote.at(t * PART), PART as u64)
            }
        })
        .collect();
    let id =
        p.a.submit(p.seg, &reqs, None)
            .await
            .unwrap_or_else(|e| panic!("submit failed: {e}"));
    let st =
        p.a.status(id)
            .unwrap_or_else(|e| panic!("status right after submit failed: {e}"));
    assert_eq!(st.states.len(), n, "status must hold one state per request");
    match p.a.release_batch(id).await {
        Err(Error::BatchBusy(b)) => {
            assert_eq!(b, id);
            assert!(
                p.a.status(id).is_ok(),
                "a BatchBusy release_batch must leave the batch in place"
            );
        }
        Ok(()) => {
            // The batch was already finished: the id is gone.
            match p.a.status(id) {
                Err(Error::UnknownBatch(b)) => assert_eq!(b, id),
                other => panic!("status after release_batch: expected UnknownBatch, got {other:?}"),
            }
        }
        Err(e) => panic!("release_batch right after submit: expected BatchBusy or Ok, got {e}"),
    }
    let released_early = matches!(p.a.status(id), Err(Error::UnknownBatch(_)));
    if !released_early {
        let final_status = poll_until("the batch to finish", || async {
            let st =
                p.a.status(id)
                    .unwrap_or_else(|e| panic!("status while running failed: {e}"));
            assert_eq!(st.states.len(), n);
            st.is_finished().then_some(st)
        })
        .await;
        for (i, s) in final_status.states.iter().enumerate() {
            match (i, s) {
                (1, TransferState::Failed(Error::AddressNotRegistered { side, .. })) => {
                    assert_eq!(*side, Side::Remote)
                }
                (1, other) => panic!("request 1 is out of bounds but its state is {other:?}"),
                (_, TransferState::Completed) => {}
                (i, other) => panic!("request {i} should have completed, state {other:?}"),
            }
        }
        p.a.release_batch(id)
            .await
            .unwrap_or_else(|e| panic!("release_batch of a finished batch failed: {e}"));
    }
    let src = pattern(81, N * PART);
    let got = remote.bytes();
    for i in (0..n).filter(|i| *i != 1) {
        let t = (i * 5 + 3) % N;
        assert_bytes(
            &got[t * PART..(t + 1) * PART],
            &src[i * PART..(i + 1) * PART],
            &format!("bytes of async request {i}"),
        );
    }
    match p.a.status(id) {
        Err(Error::UnknownBatch(b)) => assert_eq!(b, id),
        other => panic!("status after release: expected UnknownBatch, got {other:?}"),
    }
    match p.a.release_batch(id).await {
        Err(Error::UnknownBatch(_)) => {}
        other => panic!("second release_batch: expected UnknownBatch, got {other:?}"),
    }
    if caps.batch_wait {
        match p.a.wait(id).await {
            Err(Error::UnknownBatch(_)) => {}
            other => panic!("wait after release: expected UnknownBatch, got {other:?}"),
        }
        // wait returns the report and invalidates the id.
        let good = &reqs[2..3.min(n)];
        let id2 =
            p.a.submit(p.seg, good, None)
                .await
                .unwrap_or_else(|e| panic!("submit failed: {e}"));
        let report =
            p.a.wait(id2)
                .await
                .unwrap_or_else(|e| panic!("wait failed: {e}"));
        assert_eq!(report.len(), good.len());
        assert_all_ok(&report, "waited batch");
        match p.a.status(id2) {
            Err(Error::UnknownBatch(_)) => {}
            other => panic!("status after wait: expected UnknownBatch, got {other:?}"),
        }
    }
    match p.a.status(BatchId(u64::MAX)) {
        Err(Error::UnknownBatch(_)) => {}
        other => panic!("status of a never-issued id: expected UnknownBatch, got {other:?}"),
    }
    // An empty async batch finishes with an empty report.
    let id3 =
        p.a.submit(p.seg, &[], None)
            .await
            .unwrap_or_else(|e| panic!("submit of an empty batch failed: {e}"));
    let report = finish(&p.a, id3).await;
    assert!(report.is_empty());
    local.release().await;
    remote.release().await;
    Outcome::Passed
}

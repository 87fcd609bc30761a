//! The batch rules of `ferry_core::batch`, seen from outside: a batch is
//! finished only after its notification reached the peer, and a
//! notification that fails after the data moved is a failed last request,
//! not a refused batch.

use super::harness::*;
use super::*;

const BLOCK: usize = 256 * 1024;
const BLOCKS: usize = 8;

/// Writes of `BLOCKS` blocks, each to the mirrored block of `remote`, and
/// the bytes `remote` holds once they landed.
fn mirrored_writes(local: &Mem, remote: &Mem) -> (Vec<TransferRequest>, Vec<u8>) {
    let src = local.bytes();
    let mut model = remote.bytes();
    let reqs = (0..BLOCKS)
        .map(|i| {
            let t = BLOCKS - 1 - i;
            model[t * BLOCK..(t + 1) * BLOCK].copy_from_slice(&src[i * BLOCK..(i + 1) * BLOCK]);
            TransferRequest::write(local.at(i * BLOCK), remote.at(t * BLOCK), BLOCK as u64)
        })
        .collect();
    (reqs, model)
}

/// An asynchronous batch with a notification is not finished, for `status`
/// or for `release_batch`, before the peer has the notification: the moment
/// either says "finished", `take_notifications` on the peer returns it.
pub async fn check_finished_after_notification(
    factory: Arc<dyn EngineFactory>,
    adapted: bool,
) -> Outcome {
    let p = match pair(&factory, adapted).await {
        Ok(p) => p,
        Err(o) => return o,
    };
    let caps = p.a.capabilities();
    if !caps.async_batch || !caps.notify {
        return Outcome::Skipped("needs async_batch and notify".to_owned());
    }
    if caps.max_batch_len.is_some_and(|m| m < BLOCKS) {
        return Outcome::Skipped(format!("needs batches of {BLOCKS} requests"));
    }
    let local = Mem::new(&p.a, BLOCK * BLOCKS, 111).await;
    let remote = Mem::new(&p.b, BLOCK * BLOCKS, 0).await;
    let (reqs, _) = mirrored_writes(&local, &remote);
    let _ = p.b.take_notifications().await;
    // Both ways of learning that a batch is over: status, then release.
    for round in 0..8 {
        let by_release = round % 2 == 1;
        let note = Notification::new("conformance", format!("finished-{round}"));
        // Some batches are empty: only the notification.
        let part: &[TransferRequest] = if round % 4 == 2 { &[] } else { &reqs };
        let id =
            p.a.submit(p.seg, part, Some(&note))
                .await
                .unwrap_or_else(|e| panic!("submit with a notification failed: {e}"));
        let start = Instant::now();
        loop {
            // The states as `status` shows them (before a release removes
            // the batch): a failure names its request's error.
            let st =
                p.a.status(id)
                    .unwrap_or_else(|e| panic!("status({id}) failed: {e}"));
            let over = if by_release {
                match p.a.release_batch(id).await {
                    Ok(()) => true,
                    Err(Error::BatchBusy(_)) => false,
                    Err(e) => panic!("release_batch({id}) failed: {e}"),
                }
            } else {
                st.is_finished()
            };
            if over {
                let got = p.b.take_notifications().await.expect("take_notifications");
                assert!(
                    got.contains(&note),
                    "batch {id} ({} requests) was {} before its notification reached the peer \
                     (the peer has {got:?}; the batch's states: {:?})",
                    part.len(),
                    if by_release {
                        "released"
                    } else {
                        "finished for status"
                    },
                    st.states,
                );
                break;
            }
            assert!(
                start.elapsed() < LIVENESS,
                "batch {id} did not finish within {LIVENESS:?}"
            );
            tokio::task::yield_now().await;
        }
        if !by_release {
            let report = finish(&p.a, id).await;
            assert_all_ok(&report, "a batch with a notification");
        }
    }
    local.release().await;
    remote.release().await;
    Outcome::Passed
}

/// A notification that fails after the data moved does not turn the batch
/// into an error (`Err` means nothing moved): the data is in the peer's
/// memory, the earlier requests succeed and the last request fails. A batch
/// of no requests whose notification fails is refused (`Err`): nothing moved.
pub async fn check_notify_failure_after_data(
    factory: Arc<dyn EngineFactory>,
    adapted: bool,
) -> Outcome {
    let p = match pair(&factory, adapted).await {
        Ok(p) => p,
        Err(o) => return o,
    };
    let caps = p.a.capabilities();
    if !caps.notify || batch_path(&caps).is_none() {
        return Outcome::Skipped(format!("needs notify with a batch path ({NEEDS_BATCH})"));
    }
    let local = Mem::new(&p.a, BLOCK * BLOCKS, 113).await;
    let remote = Mem::new(&p.b, BLOCK * BLOCKS, 0).await;
    match factory.refuse_notifications(&p.b).await {
        Ok(true) => {}
        Ok(false) => {
            local.release().await;
            remote.release().await;
            return Outcome::Skipped(
                "the factory cannot make an engine refuse notifications".to_owned(),
            );
        }
        Err(e) => panic!("refuse_notifications failed: {e}"),
    }
    let (reqs, model) = mirrored_writes(&local, &remote);
    let paths = [BatchPath::Sync, BatchPath::Async]
        .into_iter()
        .filter(|path| match path {
            BatchPath::Sync => caps.batch_transfer,
            BatchPath::Async => caps.async_batch,
        });
    for path in paths {
        remote.write(0, &vec![0u8; BLOCK * BLOCKS]);
        let note = Notification::new("conformance", "refused by the peer");
        // Only the last chunk carries the notification (see `batch`).
        let report = batch_via(&p.a, path, p.seg, &reqs, Some(&note)).await;
        let report = report.unwrap_or_else(|e| {
            panic!(
                "{path:?}: a batch whose data moved was refused as a whole because its \
                 notification failed: {e}"
            )
        });
        assert_eq!(report.len(), BLOCKS, "{path:?}: one result per request");
        for (i, r) in report.results.iter().enumerate() {
            if i + 1 < BLOCKS {
                assert!(r.is_ok(), "{path:?}: request {i} failed: {r:?}");
            } else {
                assert!(
                    r.is_err(),
                    "{path:?}: the notification was refused but the last request succeeded"
                );
            }
        }
        assert_bytes(
            &remote.bytes(),
            &model,
            &format!("{path:?}: peer memory after a batch whose notification failed"),
        );
        if path == BatchPath::Async {
            // Nothing but the notification: nothing moved, so `Err` (at
            // submit, or from the batch).
            let r = match p.a.submit(p.seg, &[], Some(&note)).await {
                Err(e) => Err(e),
                Ok(id) => {
                    if caps.batch_wait {
                        p.a.wait(id).await
                    } else {
                        Ok(finish(&p.a, id).await)
                    }
                }
            };
            assert!(
                r.is_err(),
                "an empty batch whose notification failed reported success: {r:?}"
            );
        }
    }
    let got = p.b.take_notifications().await.unwrap_or_default();
    assert!(
        got.is_empty(),
        "the peer refused notifications but has {got:?}"
    );
    local.release().await;
    remote.release().await;
    Outcome::Passed
}

//! Notifications: delivered after the data, only for batches that fully succeeded, refused where the engine has none.

use super::harness::*;
use super::*;
use crate::DynTransferEngine;

/// An engine without notifications refuses a batch that carries one up
/// front, with the operation named and nothing moved, and refuses
/// `take_notifications` too.
pub(super) async fn check_notification_refused(p: &Pair) -> Outcome {
    const N: usize = 4096;
    let local = Mem::new(&p.a, N, 93).await;
    let remote = Mem::new(&p.b, N, 0).await;
    let reqs = [TransferRequest::write(local.at(0), remote.at(0), N as u64)];
    let note = Notification::new("refused", "never sent");
    match batch(&p.a, p.seg, &reqs, Some(&note)).await {
        Err(Error::Unsupported { operation, .. }) => {
            assert_eq!(
                operation,
                Operation::Notify,
                "refusal names the wrong operation"
            )
        }
        other => panic!("a batch with a notification on an engine without notify: {other:?}"),
    }
    assert_bytes(
        &remote.bytes(),
        &vec![0u8; N],
        "peer memory after a refused batch with a notification",
    );
    match p.b.take_notifications().await {
        Err(Error::Unsupported { operation, .. }) => assert_eq!(operation, Operation::Notify),
        other => panic!("take_notifications on an engine without notify: {other:?}"),
    }
    local.release().await;
    remote.release().await;
    Outcome::Passed
}

/// A batch's notification reaches the peer only after every byte of the
/// batch has landed, and only if every request succeeded (engines without
/// notifications: see `check_notification_refused`).
pub async fn check_notification(factory: Arc<dyn EngineFactory>, adapted: bool) -> Outcome {
    let p = match pair(&factory, adapted).await {
        Ok(p) => p,
        Err(o) => return o,
    };
    let caps = p.a.capabilities();
    if !caps.notify && batch_path(&caps).is_some() {
        return check_notification_refused(&p).await;
    }
    if !caps.notify {
        return Outcome::Skipped("needs notify".to_owned());
    }
    if batch_path(&caps).is_none() {
        return Outcome::Skipped(format!("needs notify with a batch path ({NEEDS_BATCH})"));
    }
    const BLOCK: usize = 256 * 1024;
    const BLOCKS: usize = 8;
    let local = Mem::new(&p.a, BLOCK * BLOCKS, 91).await;
    let remote = Mem::new(&p.b, BLOCK * BLOCKS, 0).await;
    let src = pattern(91, BLOCK * BLOCKS);
    let reqs: Vec<TransferRequest> = (0..BLOCKS)
        .map(|i| {
            let t = BLOCKS - 1 - i;
            TransferRequest::write(local.at(i * BLOCK), remote.at(t * BLOCK), BLOCK as u64)
        })
        .collect();
    let mut model = vec![0u8; BLOCK * BLOCKS];
    for i in 0..BLOCKS {
        let t = BLOCKS - 1 - i;
        model[t * BLOCK..(t + 1) * BLOCK].copy_from_slice(&src[i * BLOCK..(i + 1) * BLOCK]);
    }
    let mut seen: Vec<Notification> =
        p.b.take_notifications()
            .await
            .unwrap_or_else(|e| panic!("take_notifications failed: {e}"));
    assert!(
        seen.is_empty(),
        "a fresh engine has notifications: {seen:?}"
    );

    // Wait for `want` while checking, the moment it shows up, that the bytes
    // are already there.
    async fn await_note(
        b: &Arc<dyn DynTransferEngine>,
        want: &Notification,
        seen: &mut Vec<Notification>,
        remote: &Mem,
        model: &[u8],
    ) {
        let start = Instant::now();
        loop {
            let got = b
                .take_notifications()
                .await
                .unwrap_or_else(|e| panic!("take_notifications failed: {e}"));
            let hit = got.contains(want);
            seen.extend(got);
            if hit {
                break;
            }
            assert!(
                start.elapsed() < LIVENESS,
                "gave up waiting for notification {:?} after {LIVENESS:?}",
                want.message
            );
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        assert_bytes(
            &remote.bytes(),
            model,
            &format!("peer memory when notification {:?} arrived", want.message),
        );
    }

    // 1. Through the batch path, then (if any) through submit without waiting.
    let n1 = Notification::new("conformance", "kv-ready-1");
    let report = batch(&p.a, p.seg, &reqs, Some(&n1))
        .await
        .unwrap_or_else(|e| panic!("batch with a notification refused: {e}"));
    assert_all_ok(&report, "batch with a notification");
    await_note(&p.b, &n1, &mut seen, &remote, &model).await;
    if caps.async_batch && caps.max_batch_len.is_none_or(|m| m >= BLOCKS) {
        // Clear, then let the notification race the bytes.
        remote.write(0, &vec![0u8; BLOCK * BLOCKS]);
        let n2 = Notification::new("conformance", "kv-ready-2");
        let id =
            p.a.submit(p.seg, &reqs, Some(&n2))
                .await
                .unwrap_or_else(|e| panic!("submit with a notification failed: {e}"));
        await_note(&p.b, &n2, &mut seen, &remote, &model).await;
        let report = finish(&p.a, id).await;
        assert_all_ok(&report, "submitted batch with a notification");
    }
    // 2. A failing batch sends nothing; a later good one does.
    let n3 = Notification::new("conformance", "must-not-arrive");
    let mut bad = reqs.clone();
    bad[BLOCKS / 2] = TransferRequest::write(local.addr(), remote.end() - 4, 8);
    let report = batch(&p.a, p.seg, &bad, Some(&n3))
        .await
        .unwrap_or_else(|e| panic!("a failing batch with a notification was refused whole: {e}"));
    assert!(!report.is_success(), "an out-of-bounds request succeeded");
    let n4 = Notification::new("conformance", "kv-ready-4");
    batch(&p.a, p.seg, &reqs[..1], Some(&n4))
        .await
        .unwrap_or_else(|e| panic!("batch with a notification refused: {e}"));
    await_note(&p.b, &n4, &mut seen, &remote, &model).await;
    assert!(
        !seen.contains(&n3),
        "the notification of a batch with a failed request was delivered"
    );
    // Delivered exactly once each, and take_notifications drains.
    for n in [&n1, &n4] {
        assert_eq!(
            seen.iter().filter(|s| *s == n).count(),
            1,
            "notification {:?} delivered more than once",
            n.message
        );
    }
    let rest = p.b.take_notifications().await.expect("take_notifications");
    assert!(!rest.contains(&n1), "take_notifications does not drain");
    // 3. An oversized notification is refused as a whole.
    let huge = Notification::new("conformance", "x".repeat(MAX_NOTIFICATION_MESSAGE + 1));
    match batch(&p.a, p.seg, &reqs[..1], Some(&huge)).await {
        Err(Error::InvalidArgument(_)) => {}
        other => panic!("oversized notification: expected InvalidArgument, got {other:?}"),
    }
    local.release().await;
    remote.release().await;
    Outcome::Passed
}

/// `next_notification` waits for a notification sent after the call and
/// takes only the one it names, leaving the others queued in order; with
/// no name it takes the oldest. A `take_notifications` or
/// `next_notification` future dropped after any number of polls loses no
/// notification and delivers none twice (an engine whose library keeps
/// its own queue must move what it took into a queue of its own before the
/// caller can drop the future). An engine without notifications refuses
/// `next_notification` with the operation named.
pub async fn check_awaited_notification(factory: Arc<dyn EngineFactory>, adapted: bool) -> Outcome {
    let p = match pair(&factory, adapted).await {
        Ok(p) => p,
        Err(o) => return o,
    };
    let caps = p.a.capabilities();
    if !caps.notify {
        match within(
            "next_notification without notify",
            p.b.next_notification(None),
        )
        .await
        {
            Err(Error::Unsupported { operation, .. }) => assert_eq!(operation, Operation::Notify),
            other => panic!("next_notification on an engine without notify: {other:?}"),
        }
        return Outcome::Passed;
    }
    if batch_path(&caps).is_none() {
        return Outcome::Skipped(format!("needs notify with a batch path ({NEEDS_BATCH})"));
    }
    const N: usize = 4096;
    const MAX_POLLS: u32 = 8;
    let local = Mem::new(&p.a, N, 95).await;
    let remote = Mem::new(&p.b, N, 0).await;
    let reqs = [TransferRequest::write(local.at(0), remote.at(0), N as u64)];
    let send = |note: Notification| {
        let (a, seg) = (Arc::clone(&p.a), p.seg);
        async move {
            let report = within(
                "a batch with a notification",
                batch(&a, seg, &reqs, Some(&note)),
            )
            .await
            .unwrap_or_else(|e| panic!("batch with notification {note:?} refused: {e}"));
            assert_all_ok(&report, "batch with a notification");
        }
    };
    // Takes until `want` notifications named `name` came (all of them
    // kept, in order).
    let collect = |name: &'static str, want: usize, mut got: Vec<Notification>| {
        let b = Arc::clone(&p.b);
        async move {
            let start = Instant::now();
            while got.iter().filter(|n| n.name == name).count() < want {
                assert!(
                    start.elapsed() < LIVENESS,
                    "gave up after {LIVENESS:?} waiting for {want} notifications named {name:?}; \
                     got {got:?}"
                );
                got.extend(
                    b.take_notifications()
                        .await
                        .unwrap_or_else(|e| panic!("take_notifications failed: {e}")),
                );
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            got
        }
    };
    let leftovers = p.b.take_notifications().await.expect("take_notifications");
    assert!(
        leftovers.is_empty(),
        "a fresh engine has notifications: {leftovers:?}"
    );

    // 1. A waiter that starts before anything is sent gets the one it
    //    names; the other stays queued.
    let other = Notification::new("awaited-other", "first");
    let wanted = Notification::new("awaited-kv", "second");
    let (got, ()) = tokio::join!(
        within(
            "next_notification(awaited-kv)",
            p.b.next_notification(Some("awaited-kv"))
        ),
        async {
            tokio::time::sleep(Duration::from_millis(20)).await;
            send(other.clone()).await;
            send(wanted.clone()).await;
        }
    );
    assert_eq!(
        got.unwrap_or_else(|e| panic!("next_notification failed: {e}")),
        wanted
    );
    let rest = collect("awaited-other", 1, Vec::new()).await;
    assert_eq!(
        rest,
        vec![other],
        "what next_notification(name) left queued"
    );

    // 2. Without a name: the oldest first, at once when queued.
    let (n1, n2) = (
        Notification::new("awaited-any", "1"),
        Notification::new("awaited-any", "2"),
    );
    send(n1.clone()).await;
    send(n2.clone()).await;
    for want in [n1, n2] {
        let got = within("next_notification(None)", p.b.next_notification(None))
            .await
            .unwrap_or_else(|e| panic!("next_notification failed: {e}"));
        assert_eq!(got, want, "next_notification(None) is not oldest first");
    }

    // 3. Futures dropped after any number of polls lose nothing.
    let mut expected = Vec::new();
    let mut got = Vec::new();
    for polls in 0..MAX_POLLS {
        for next in [false, true] {
            let n = Notification::new(
                "awaited-drop",
                format!("{polls}-{}", if next { "next" } else { "take" }),
            );
            send(n.clone()).await;
            expected.push(n);
            if next {
                if let Some(r) =
                    poll_then_drop(p.b.next_notification(Some("awaited-drop")), polls).await
                {
                    got.push(r.unwrap_or_else(|e| panic!("next_notification failed: {e}")));
                }
            } else if let Some(r) = poll_then_drop(p.b.take_notifications(), polls).await {
                got.extend(r.unwrap_or_else(|e| panic!("take_notifications failed: {e}")));
            }
        }
    }
    let mut got = collect("awaited-drop", expected.len(), got).await;
    got.sort_by(|x, y| x.message.cmp(&y.message));
    expected.sort_by(|x, y| x.message.cmp(&y.message));
    assert_eq!(
        got, expected,
        "the notifications taken around dropped take_notifications / next_notification futures"
    );
    local.release().await;
    remote.release().await;
    Outcome::Passed
}

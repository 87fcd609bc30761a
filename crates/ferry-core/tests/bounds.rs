//! Bounded queues: a full one is a typed, retryable error, and nothing
//! grows past its bound.

use ferry_core::DynTransferEngine;
use std::sync::Arc;

use ferry_core::inproc::InprocEngine;
use ferry_core::{
    BatchId, Capabilities, CapabilityAdapter, Error, Notification, Queue, RegisteredBuffer,
    SegmentId, TransferEngine, TransferRequest, MAX_LIVE_BATCHES,
};

async fn pair(caps: Capabilities) -> (Arc<dyn DynTransferEngine>, Arc<dyn DynTransferEngine>) {
    let a: Arc<dyn DynTransferEngine> = Arc::new(InprocEngine::auto(caps));
    let b: Arc<dyn DynTransferEngine> = Arc::new(InprocEngine::auto(caps));
    (a, b)
}

#[tokio::test]
async fn a_full_notification_queue_fails_the_last_request_retryably() {
    let (a, b) = pair(Capabilities::all()).await;
    let src = RegisteredBuffer::new(Arc::clone(&a), 64).await.unwrap();
    let dst = RegisteredBuffer::new(Arc::clone(&b), 64).await.unwrap();
    let seg = a.open_segment(b.segment_name()).await.unwrap();
    let req = [TransferRequest::write(src.addr(), dst.addr(), 64)];
    let cap = ferry_core::inproc::MAX_QUEUED_NOTIFICATIONS;
    for i in 0..cap {
        let n = Notification::new("n", i.to_string());
        a.batch_transfer(seg, &req, Some(&n))
            .await
            .unwrap()
            .into_result()
            .unwrap();
    }
    src.memory().fill(7);
    let n = Notification::new("n", "one too many");
    let report = a.batch_transfer(seg, &req, Some(&n)).await.unwrap();
    match &report.results[0] {
        Err(
            e @ Error::QueueFull {
                queue: Queue::Notifications,
                limit: Some(limit),
                ..
            },
        ) => {
            assert!(e.is_retryable(), "{e}");
            assert_eq!(*limit, cap as u64);
            assert!(
                e.to_string().contains(&format!("{cap} notifications")),
                "{e}"
            );
        }
        other => panic!("expected QueueFull, got {other:?}"),
    }
    // The data moved all the same; the notification did not.
    assert_eq!(dst.memory().to_vec(), vec![7u8; 64]);
    let got = b.take_notifications().await.unwrap();
    assert_eq!(got.len(), cap);
    assert!(got.iter().all(|n| n.message != "one too many"));
    // Drained: room again.
    a.batch_transfer(seg, &req, Some(&n))
        .await
        .unwrap()
        .into_result()
        .unwrap();
    assert_eq!(b.take_notifications().await.unwrap(), vec![n]);
}

/// Submits until the bound; returns the first batch.
async fn fill_live_batches(e: &Arc<dyn DynTransferEngine>, seg: SegmentId) -> BatchId {
    let first = e.submit(seg, &[], None).await.unwrap();
    for _ in 1..MAX_LIVE_BATCHES {
        e.submit(seg, &[], None).await.unwrap();
    }
    match e.submit(seg, &[], None).await {
        Err(
            err @ Error::QueueFull {
                queue: Queue::Batches,
                limit: Some(limit),
                ..
            },
        ) => {
            assert!(err.is_retryable(), "{err}");
            assert_eq!(limit, MAX_LIVE_BATCHES as u64);
        }
        other => panic!("expected QueueFull past {MAX_LIVE_BATCHES} batches, got {other:?}"),
    }
    first
}

#[tokio::test]
async fn live_batches_are_bounded_natively_and_through_the_adapter() {
    let (a, b) = pair(Capabilities::all()).await;
    let seg = a.open_segment(b.segment_name()).await.unwrap();
    let first = fill_live_batches(&a, seg).await;
    // Releasing one makes room for one.
    a.release_batch(first).await.unwrap();
    a.submit(seg, &[], None).await.unwrap();

    let inner = Arc::new(InprocEngine::auto(Capabilities::default()));
    let (_, b) = pair(Capabilities::default()).await;
    let adapted: Arc<dyn DynTransferEngine> =
        Arc::new(CapabilityAdapter::from_arc(inner, Default::default()));
    let seg = adapted.open_segment(b.segment_name()).await.unwrap();
    let first = fill_live_batches(&adapted, seg).await;
    adapted.wait(first).await.unwrap();
    adapted.submit(seg, &[], None).await.unwrap();
}

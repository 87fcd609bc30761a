//! Per-call deadlines (`TransferEngineExt`) on real TCP engines: a call
//! that cannot finish in time is `Timeout` naming the deadline, leaves no
//! batch behind, and the engine goes on working; a wait for a notification
//! that does not come is `None` and takes nothing.
#![cfg(feature = "tcp")]

mod common;
use common::{tcp_pair, Pair};

use std::time::{Duration, Instant};

use ferry::{Error, ErrorKind, Notification, Retry, TransferEngine, TransferEngineExt};

const LEN: usize = 64 << 20;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_past_its_deadline_times_out_and_leaves_nothing_behind() {
    let Pair {
        a,
        b,
        src,
        dst,
        seg,
        whole,
    } = tcp_pair(LEN, 0x3c).await;

    // 64 MiB over loopback cannot land within 1 ms.
    let within = Duration::from_millis(1);
    match a.transfer_within(seg, whole, within).await {
        Err(e @ Error::Timeout { .. }) => {
            assert_eq!(e.kind(), ErrorKind::Timeout);
            assert_eq!(e.retry(), Retry::MaybeApplied);
            assert!(e.to_string().contains("1ms"), "{e}");
        }
        other => panic!("a 64 MiB write within 1 ms: {other:?}"),
    }
    let requests = [whole];
    match a.batch_transfer_within(seg, &requests, None, within).await {
        Err(Error::Timeout { after, .. }) => assert_eq!(after, within),
        other => panic!("a 64 MiB batch within 1 ms: {other:?}"),
    }
    // Nothing left behind, and the engine still moves every byte.
    let start = Instant::now();
    while a.live_batches() != Some(0) {
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "a batch was left behind"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    a.transfer_within(seg, whole, Duration::from_secs(60))
        .await
        .unwrap();
    assert!(dst.memory().to_vec().iter().all(|&x| x == 0x3c));

    // A notification wait that times out takes nothing.
    let t = Instant::now();
    assert_eq!(
        b.next_notification_within(Some("prefill-0"), Duration::from_millis(30))
            .await
            .unwrap(),
        None
    );
    assert!(t.elapsed() >= Duration::from_millis(30));
    let note = Notification::new("prefill-0", "req-1 done");
    a.batch_transfer(seg, &[], Some(&note))
        .await
        .unwrap()
        .into_result()
        .unwrap();
    assert_eq!(
        b.next_notification_within(Some("prefill-0"), Duration::from_secs(30))
            .await
            .unwrap(),
        Some(note)
    );
    a.close_segment(seg).await.unwrap();
    src.release().await.unwrap();
    dst.release().await.unwrap();
}

//! `shutdown` drains (issue 25 item 6): on real TCP engines behind the
//! facade's adapter, a write in flight when `shutdown` starts lands whole
//! and `shutdown` returns only after it; calls that start afterwards are
//! refused with `Canceled`; a submitted batch nobody waited for runs to
//! its end first; a notification waiter ends with `Canceled`; the memory
//! can still be unregistered, and a second `shutdown` returns at once.
#![cfg(feature = "tcp")]

mod common;
use common::{tcp_pair, Pair};

use std::time::Duration;

use ferry::{Error, TransferEngine};

const LEN: usize = 64 << 20;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_waits_for_calls_in_flight_and_refuses_new_ones() {
    let Pair {
        a,
        b,
        src,
        dst,
        seg,
        whole,
    } = tcp_pair(LEN, 0x5a).await;

    // A waiter on b's notifications ends with Canceled when b shuts down.
    let waiter = tokio::spawn({
        let b = b.clone();
        async move { b.next_notification(None).await }
    });

    // A write in flight: shutdown starts once its first bytes landed.
    let write = tokio::spawn({
        let a = a.clone();
        async move { a.transfer(seg, whole).await }
    });
    let started = std::time::Instant::now();
    loop {
        let mut first = [0u8; 1];
        dst.memory().read(0, &mut first).unwrap();
        if first[0] == 0x5a || write.is_finished() {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "the write never started"
        );
        tokio::time::sleep(Duration::from_micros(100)).await;
    }
    tokio::time::timeout(Duration::from_secs(60), a.shutdown())
        .await
        .expect("shutdown drains within 60 s")
        .unwrap();
    // Not cut off half-way: the write in flight ran to its end.
    write.await.unwrap().unwrap();
    assert!(dst.memory().to_vec().iter().all(|&x| x == 0x5a));

    // New work is refused, typed.
    for e in [
        a.transfer(seg, whole).await.unwrap_err(),
        a.open_segment(b.segment_name())
            .await
            .map(|_| ())
            .unwrap_err(),
        a.batch_transfer(seg, &[whole], None)
            .await
            .map(|_| ())
            .unwrap_err(),
    ] {
        assert!(
            matches!(e, Error::Canceled(ref m) if m.contains("shutting down")),
            "{e}"
        );
    }
    // Cleanup still works, and a second shutdown returns at once.
    a.shutdown().await.unwrap();
    src.release().await.unwrap();

    b.shutdown().await.unwrap();
    let note = tokio::time::timeout(Duration::from_secs(10), waiter)
        .await
        .expect("the notification waiter ends")
        .unwrap();
    assert!(matches!(note, Err(Error::Canceled(_))), "{note:?}");
    dst.release().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_runs_a_submitted_batch_to_its_end() {
    let Pair {
        a,
        b: _b,
        src,
        dst,
        seg,
        whole,
    } = tcp_pair(LEN, 0xa5).await;
    // Submitted and never waited for.
    let batch = a.submit(seg, &[whole], None).await.unwrap();
    tokio::time::timeout(Duration::from_secs(60), a.shutdown())
        .await
        .expect("shutdown drains within 60 s")
        .unwrap();
    assert!(
        dst.memory().to_vec().iter().all(|&x| x == 0xa5),
        "the submitted batch ran to its end before shutdown returned"
    );
    assert_eq!(a.live_batches(), Some(0), "no batch is left behind");
    // Its id went with the engine's batches.
    assert!(matches!(a.wait(batch).await, Err(Error::UnknownBatch(_))));
    src.release().await.unwrap();
    dst.release().await.unwrap();
}

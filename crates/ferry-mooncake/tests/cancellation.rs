//! Registration under cancellation: a `register`, `batch_register` or
//! `batch_unregister` future dropped at any poll leaves every region either
//! registered in both the library and the engine's region table, or in
//! neither — for a batch, all of its regions the same way. (On the faithful
//! C-ABI test libraries, NOT Mooncake.)

mod common;

use std::future::{poll_fn, Future};
use std::task::Poll;
use std::time::Duration;

use common::{metadata_for, start, SUPPORTED};
use ferry_core::{Error, HostBuffer, Location, MemoryRegion, TransferEngine};

/// Polls `f` at most `polls` times, yielding to the runtime in between,
/// then drops it. Its output, if it finished before that.
async fn poll_then_drop<F: Future>(f: F, polls: usize) -> Option<F::Output> {
    let mut f = std::pin::pin!(f);
    for _ in 0..polls {
        if let Poll::Ready(v) = poll_fn(|cx| Poll::Ready(f.as_mut().poll(cx))).await {
            return Some(v);
        }
        tokio::task::yield_now().await;
    }
    None
}

/// Poll counts: every count up to 8, then pseudo-random ones (fixed seed).
fn poll_counts() -> Vec<usize> {
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
    let mut v: Vec<usize> = (0..=8).collect();
    for _ in 0..24 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        v.push((x % 12) as usize);
    }
    v
}

/// Waits until no registration of `e` is running (they run to completion
/// after their future is dropped).
async fn settle(e: &ferry_mooncake::MooncakeEngine) {
    let mut spins = 0u32;
    while e.registrations_in_flight() != 0 {
        spins += 1;
        assert!(spins < 20_000, "a registration never finished");
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

/// Whether each region is registered, asserting that the library and the
/// region table agree and that all of `regions` are in the same state; the
/// regions are left unregistered.
async fn registered_all_or_none(
    e: &ferry_mooncake::MooncakeEngine,
    bufs: &[HostBuffer],
    what: &str,
) -> bool {
    let mut states = Vec::new();
    let addrs: Vec<u64> = bufs.iter().map(HostBuffer::addr).collect();
    for r in regions_of(bufs) {
        // Registering again: `RegionOverlap` from the table if it is there;
        // Ok only if the library takes it too (it refuses a region it
        // still has).
        match e.register(r).await {
            Ok(()) => states.push(false),
            Err(Error::RegionOverlap { .. }) => states.push(true),
            Err(other) => panic!("{what}: table and library disagree: {other:?}"),
        }
    }
    assert!(
        states.iter().all(|&s| s == states[0]),
        "{what}: part of the regions registered: {states:?}"
    );
    // Every region is registered now, in both (the library refuses to
    // unregister what it does not have).
    e.batch_unregister(&addrs)
        .await
        .unwrap_or_else(|err| panic!("{what}: table and library disagree: {err:?}"));
    states[0]
}

fn buffers() -> Vec<HostBuffer> {
    (0..3).map(|_| HostBuffer::new(4096).unwrap()).collect()
}

fn regions_of(bufs: &[HostBuffer]) -> Vec<MemoryRegion> {
    bufs.iter()
        .enumerate()
        // Two locations: batch_register makes one library call per location.
        // SAFETY: the buffers outlive every registration of the test.
        .map(|(i, b)| unsafe { b.region(Location::cpu(i as u32 % 2)) })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_register_futures_leave_regions_whole() {
    for gen in SUPPORTED {
        let e = start(gen, &metadata_for(gen)).await;
        let bufs = buffers();
        for polls in poll_counts() {
            let what = format!("{gen}: register dropped after {polls} polls");
            let got = poll_then_drop(e.register(regions_of(&bufs).remove(0)), polls).await;
            settle(&e).await;
            let registered = registered_all_or_none(&e, &bufs[..1], &what).await;
            match got {
                Some(Ok(())) => assert!(registered, "{what}: Ok but not registered"),
                Some(Err(err)) => panic!("{what}: {err:?}"),
                None => {}
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_batch_register_futures_register_all_or_nothing() {
    for gen in SUPPORTED {
        let e = start(gen, &metadata_for(gen)).await;
        let bufs = buffers();
        let mut seen = [false; 2];
        for polls in poll_counts() {
            let what = format!("{gen}: batch_register dropped after {polls} polls");
            let got = poll_then_drop(e.batch_register(regions_of(&bufs)), polls).await;
            settle(&e).await;
            let registered = registered_all_or_none(&e, &bufs, &what).await;
            seen[usize::from(registered)] = true;
            match got {
                Some(Ok(())) => assert!(registered, "{what}: Ok but not registered"),
                Some(Err(err)) => panic!("{what}: {err:?}"),
                None => {}
            }
        }
        // Dropped before its first poll, nothing is registered.
        assert!(seen[0], "{gen}: no drop left the batch unregistered");
        assert!(seen[1], "{gen}: no drop left the batch registered");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_batch_unregister_futures_leave_tables_agreeing() {
    for gen in SUPPORTED {
        let e = start(gen, &metadata_for(gen)).await;
        let bufs = buffers();
        let regions = regions_of(&bufs);
        let addrs: Vec<u64> = regions.iter().map(|r| r.addr()).collect();
        for polls in poll_counts() {
            let what = format!("{gen}: batch_unregister dropped after {polls} polls");
            e.batch_register(regions_of(&bufs)).await.unwrap();
            let got = poll_then_drop(e.batch_unregister(&addrs), polls).await;
            settle(&e).await;
            let registered = registered_all_or_none(&e, &bufs, &what).await;
            match got {
                Some(Ok(())) => assert!(!registered, "{what}: Ok but still registered"),
                Some(Err(err)) => panic!("{what}: {err:?}"),
                None => {}
            }
        }
    }
}

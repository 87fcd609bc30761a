//! The adapter's asynchronous batches: a native one is forwarded (its
//! per-request progress shows through `status`), an emulated one works
//! without a Tokio runtime.

use ferry_core::DynTransferEngine;
use std::sync::Arc;
use std::time::Duration;

use ferry_core::inproc::InprocEngine;
use ferry_core::{
    AdapterConfig, Capabilities, CapabilityAdapter, HostBuffer, Location, MemoryRegion,
    TransferEngine, TransferRequest, TransferState,
};

const BLOCK: usize = InprocEngine::CHUNK * 4;

/// Registers `buf` with `e` (the buffer outlives every use in these tests).
async fn register(e: &dyn DynTransferEngine, buf: &HostBuffer) {
    // SAFETY: `buf` outlives the engines' use of it (unregistered at the end
    // of each test, before it is dropped).
    let r = unsafe { MemoryRegion::from_raw_parts(buf.as_ptr(), buf.len(), Location::cpu(0)) };
    e.register(r).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_native_async_batch_is_forwarded_with_its_per_request_progress() {
    let inner = Arc::new(InprocEngine::auto(Capabilities::all()));
    inner.set_pace(Some(Duration::from_millis(20)));
    let peer = InprocEngine::auto(Capabilities::all());
    let a = CapabilityAdapter::from_arc(Arc::clone(&inner), AdapterConfig::default());
    let src = HostBuffer::new(4 * BLOCK).unwrap();
    let dst = HostBuffer::new(8 * BLOCK).unwrap();
    register(&a, &src).await;
    register(&peer, &dst).await;
    let seg = a.open_segment(peer.segment_name()).await.unwrap();
    // Scattered destinations: nothing to merge, so the batch is forwarded.
    let reqs = ferry_core::conformance::scattered_writes(src.addr(), dst.addr(), BLOCK, 4);
    let id = a.submit(seg, &reqs, None).await.unwrap();
    // A task-driven batch publishes every state at once at the end; the
    // backend's own batch shows requests completing one by one.
    let mut mixed = false;
    for _ in 0..2000 {
        let st = a.status(id).unwrap();
        let done = st
            .states
            .iter()
            .filter(|s| **s == TransferState::Completed)
            .count();
        if done > 0 && done < reqs.len() {
            mixed = true;
        }
        if st.is_finished() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    assert!(
        mixed,
        "no partial progress seen: the batch was not forwarded"
    );
    let report = a.wait(id).await.unwrap();
    assert!(report.is_success());
    a.unregister(src.addr()).await.unwrap();
    peer.unregister(dst.addr()).await.unwrap();
}

#[test]
fn an_emulated_async_batch_works_outside_a_runtime() {
    futures::executor::block_on(async {
        let inner = Arc::new(InprocEngine::auto(Capabilities::default()));
        let peer = InprocEngine::auto(Capabilities::default());
        let a = CapabilityAdapter::from_arc(Arc::clone(&inner), AdapterConfig::default());
        let src = HostBuffer::new(BLOCK).unwrap();
        let dst = HostBuffer::new(BLOCK).unwrap();
        src.fill(9);
        register(&a, &src).await;
        register(&peer, &dst).await;
        let seg = a.open_segment(peer.segment_name()).await.unwrap();
        let req = [TransferRequest::write(src.addr(), dst.addr(), BLOCK as u64)];
        let id = a.submit(seg, &req, None).await.unwrap();
        assert!(a.status(id).unwrap().is_finished());
        assert!(a.wait(id).await.unwrap().is_success());
        assert_eq!(dst.to_vec(), vec![9u8; BLOCK]);
        a.unregister(src.addr()).await.unwrap();
        peer.unregister(dst.addr()).await.unwrap();
    });
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_emulated_batch_transfer_leaves_no_backend_batch() {
    // Native async batches only: the adapter's batch_transfer submits one
    // for itself and waits; dropping that future must not leak it.
    let caps = {
        let mut caps = Capabilities::default();
        caps.async_batch = true;
        caps
    };
    let inner = Arc::new(InprocEngine::auto(caps));
    inner.set_pace(Some(Duration::from_millis(20)));
    let peer = InprocEngine::auto(caps);
    let a = CapabilityAdapter::from_arc(Arc::clone(&inner), AdapterConfig::default());
    let src = HostBuffer::new(BLOCK).unwrap();
    let dst = HostBuffer::new(BLOCK).unwrap();
    register(&a, &src).await;
    register(&peer, &dst).await;
    let seg = a.open_segment(peer.segment_name()).await.unwrap();
    let req = [TransferRequest::write(src.addr(), dst.addr(), BLOCK as u64)];
    for _ in 0..3 {
        let r = tokio::time::timeout(Duration::from_millis(10), a.batch_transfer(seg, &req, None))
            .await;
        assert!(r.is_err(), "the paced batch finished within 10 ms");
    }
    let mut spins = 0;
    while inner.live_batches() != Some(0) {
        spins += 1;
        assert!(spins < 2000, "abandoned batches stay in the backend");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    a.unregister(src.addr()).await.unwrap();
    peer.unregister(dst.addr()).await.unwrap();
}

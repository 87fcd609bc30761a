//! `RegisteredBuffer`: owned memory registered with one or more engines and
//! unregistered from all of them before it is freed.

use ferry_core::DynTransferEngine;
use std::sync::Arc;

use ferry_core::inproc::InprocEngine;
use ferry_core::{
    Capabilities, CapabilityAdapter, Error, HostBuffer, Location, RegisteredBuffer,
    RegisteredBuffers, TransferEngine,
};

#[tokio::test]
async fn one_buffer_registered_with_two_engines_is_unregistered_from_both() {
    let a = Arc::new(InprocEngine::auto(Capabilities::all()));
    let b = Arc::new(InprocEngine::auto(Capabilities::all()));
    let memory = HostBuffer::new(8192).unwrap();
    let addr = memory.addr();
    let mut buf = RegisteredBuffer::from_owned(Arc::clone(&a), memory, Location::cpu(0))
        .await
        .unwrap();
    buf.register_with(Arc::clone(&b)).await.unwrap();
    assert_eq!(buf.engines().len(), 2);
    for e in [&a, &b] {
        assert!(e
            .regions()
            .iter()
            .any(|r| r.addr() == addr && r.len() == 8192));
    }
    buf.release().await.unwrap();
    assert!(a.regions().is_empty() && b.regions().is_empty());
}

#[tokio::test]
async fn a_refused_registration_leaves_nothing_registered() {
    let a = Arc::new(InprocEngine::auto(Capabilities::all()));
    let first = RegisteredBuffer::new(Arc::clone(&a), 4096).await.unwrap();
    // Registering the same memory twice with one engine overlaps: refused,
    // and the buffer stays registered once.
    let mut buf = first;
    let e = buf.register_with(Arc::clone(&a)).await.unwrap_err();
    assert!(matches!(e, Error::RegionOverlap { .. }), "{e}");
    assert_eq!(buf.engines().len(), 1);
    assert_eq!(a.regions().len(), 1);
    buf.release().await.unwrap();
    assert!(a.regions().is_empty());
}

#[tokio::test]
async fn dropping_unregisters_from_every_engine() {
    let a = Arc::new(InprocEngine::auto(Capabilities::all()));
    let b = Arc::new(InprocEngine::auto(Capabilities::all()));
    let mut buf = RegisteredBuffer::new(Arc::clone(&a), 4096).await.unwrap();
    buf.register_with(Arc::clone(&b)).await.unwrap();
    drop(buf);
    // The unregisters run on a spawned task; give it a bounded while.
    for _ in 0..1000 {
        if a.regions().is_empty() && b.regions().is_empty() {
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    panic!(
        "still registered after drop: {:?} {:?}",
        a.regions(),
        b.regions()
    );
}

#[tokio::test]
async fn buffers_register_together_and_release_together() {
    // Native batch register, and the adapter's emulation of it.
    for caps in [Capabilities::all(), Capabilities::default()] {
        let e: Arc<dyn DynTransferEngine> =
            Arc::new(CapabilityAdapter::new(InprocEngine::auto(caps)));
        let bufs = RegisteredBuffers::new(Arc::clone(&e), &[4096, 8192, 4096])
            .await
            .unwrap();
        let addrs = bufs.addrs();
        assert_eq!(addrs.len(), 3);
        // Each is registered: registering it again overlaps.
        for b in bufs.buffers() {
            // SAFETY: refused (overlap), so never registered by this call.
            let again = unsafe { b.region(Location::cpu(0)) };
            assert!(matches!(
                e.register(again).await,
                Err(Error::RegionOverlap { .. })
            ));
        }
        bufs.release().await.unwrap();
        assert_eq!(e.live_batches(), Some(0));
    }
}

#[tokio::test]
async fn a_refused_batch_registers_none_of_the_buffers() {
    let a = Arc::new(InprocEngine::auto(Capabilities::all()));
    let kept = RegisteredBuffer::new(Arc::clone(&a), 4096).await.unwrap();
    // Host-only engine: device memory is refused, and so is the whole batch.
    let bufs = vec![
        HostBuffer::new(4096).unwrap(),
        HostBuffer::new(4096).unwrap(),
    ];
    match RegisteredBuffers::from_owned(Arc::clone(&a), bufs, Location::cuda(0)).await {
        Err(Error::BatchRegisterFailed { index: 0, .. }) => {}
        other => panic!("expected BatchRegisterFailed at index 0, got {other:?}"),
    }
    assert_eq!(
        a.regions().len(),
        1,
        "only the earlier buffer is registered"
    );
    kept.release().await.unwrap();
    assert!(a.regions().is_empty());
}

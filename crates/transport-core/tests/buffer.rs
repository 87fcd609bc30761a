//! `RegisteredBuffer`: owned memory registered with one or more engines and
//! unregistered from all of them before it is freed.

use std::sync::Arc;

use transport_core::inproc::InprocEngine;
use transport_core::{Capabilities, Error, HostBuffer, Location, RegisteredBuffer};

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

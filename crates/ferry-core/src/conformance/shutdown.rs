//! `shutdown`: through the adapter a drain (a call in flight runs to its
//! end, new work is refused with `Canceled`); on every engine it returns,
//! ends notification waiters, is idempotent and leaves regions that can
//! still be unregistered.

use super::harness::*;
use super::*;

/// Shuts engine `a` down while a 4 MiB write to `b` is in flight, then
/// `b` while a task awaits its next notification.
///
/// Every engine: `shutdown` returns (within the liveness bound), so does
/// the write, a second `shutdown` returns `Ok`, a `next_notification`
/// waiter ends with `Canceled` (or `Unsupported` where there are none),
/// and both engines' regions unregister afterwards.
///
/// Through the adapter: the write is not cut off half-way: it either ran
/// to its end (every byte landed) or was refused before it began
/// (`Canceled`, "shutting down", no byte changed); and a transfer,
/// `open_segment` and `register` after `shutdown` are refused with
/// `Canceled`.
pub async fn check_shutdown(factory: Arc<dyn EngineFactory>, adapted: bool) -> Outcome {
    const LEN: usize = 4 << 20;
    let p = match pair(&factory, adapted).await {
        Ok(p) => p,
        Err(o) => return o,
    };
    let local = Mem::new(&p.a, LEN, 61).await;
    let remote = Mem::new(&p.b, LEN, 0).await;
    let model = local.bytes();
    let waiter = p.b.capabilities().notify.then(|| {
        let b = Arc::clone(&p.b);
        tokio::spawn(async move { b.next_notification(Some("conformance-never")).await })
    });

    let write = tokio::spawn({
        let a = Arc::clone(&p.a);
        let req = TransferRequest::write(local.addr(), remote.addr(), LEN as u64);
        let seg = p.seg;
        async move { a.transfer(seg, req).await }
    });
    tokio::task::yield_now().await;
    within("shutdown with a write in flight", p.a.shutdown())
        .await
        .unwrap_or_else(|e| panic!("shutdown failed: {e}"));
    let wrote = within("a write in flight at shutdown", write)
        .await
        .expect("the write task panicked");
    if adapted {
        match &wrote {
            Ok(()) => assert_bytes(
                &remote.bytes(),
                &model,
                "peer memory after a write that was in flight at shutdown",
            ),
            Err(Error::Canceled(m)) if m.contains("shutting down") => assert_bytes(
                &remote.bytes(),
                &vec![0u8; LEN],
                "peer memory after a write refused by shutdown",
            ),
            Err(e) => panic!(
                "a write in flight when the adapter's shutdown began was cut off: {e} \
                 (the drain must let it finish)"
            ),
        }
        let t =
            p.a.transfer(
                p.seg,
                TransferRequest::write(local.addr(), remote.addr(), 8),
            )
            .await;
        assert!(
            matches!(t, Err(Error::Canceled(_))),
            "a transfer after shutdown: {t:?}"
        );
        let o = p.a.open_segment(p.b.segment_name()).await;
        assert!(
            matches!(o, Err(Error::Canceled(_))),
            "open_segment after shutdown: {o:?}"
        );
        let extra = Mem::unregistered(&p.a, 4096, 0);
        let r = p.a.register(extra.region(0, 4096)).await;
        assert!(
            matches!(r, Err(Error::Canceled(_))),
            "register after shutdown: {r:?}"
        );
        extra.release().await;
    }
    within("a second shutdown", p.a.shutdown())
        .await
        .unwrap_or_else(|e| panic!("a second shutdown failed: {e}"));

    within("shutdown of the peer", p.b.shutdown())
        .await
        .unwrap_or_else(|e| panic!("shutdown of the peer failed: {e}"));
    if let Some(w) = waiter {
        let got = within("a notification waiter at shutdown", w)
            .await
            .expect("the waiter panicked");
        assert!(
            matches!(
                got,
                Err(Error::Canceled(_)) | Err(Error::Unsupported { .. })
            ),
            "next_notification across shutdown: {got:?}"
        );
    }
    // Regions outlive shutdown: they unregister as usual.
    local.release().await;
    remote.release().await;
    Outcome::Passed
}

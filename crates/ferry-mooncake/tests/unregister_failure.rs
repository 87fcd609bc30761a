//! `batch_unregister` when the library refuses part of the batch: a region
//! the library kept stays registered in Ferry's table too (usable, and
//! unregistered again later), and only the regions the library released
//! leave it — against the faithful C-ABI test libraries (NOT Mooncake),
//! whose `unreg_refuse_len=<n>` convention makes an engine keep every
//! region of `n` bytes.

mod common;

use common::{config, metadata_for, start, start_engine, SUPPORTED};
use ferry_core::{Error, HostBuffer, Location, TransferEngine, TransferRequest};
use mooncake_testlibs::Generation as Lib;

const KEPT: usize = 12288;
const FREED: usize = 4096;

fn is_library_error(e: &Error, operation: &str) -> bool {
    matches!(
        e,
        Error::Backend { backend, operation: op, name, .. }
            if backend == "mooncake" && op == operation && name == "ERR_CONTEXT"
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn regions_the_library_kept_stay_registered_after_a_failed_batch_unregister() {
    for gen in SUPPORTED {
        let meta = metadata_for(gen);
        // Buffers first: they outlive the engines (dropped after them).
        let kept = HostBuffer::new(KEPT).unwrap();
        let freed = HostBuffer::new(FREED).unwrap();
        let dst = HostBuffer::new(KEPT).unwrap();
        let mut cfg = config(gen, &meta, "");
        cfg.device = Some(format!("unreg_refuse_len={KEPT}"));
        let a = start_engine(cfg).await.unwrap();
        let b = start(gen, &meta).await;
        // SAFETY: the buffers outlive both engines (declared before them);
        // `kept` is leaked below, as it stays registered.
        a.batch_register(vec![unsafe { kept.region(Location::cpu(0)) }, unsafe {
            freed.region(Location::cpu(0))
        }])
        .await
        .unwrap();
        // SAFETY: as above.
        b.register(unsafe { dst.region(Location::cpu(0)) })
            .await
            .unwrap();

        let err = a
            .batch_unregister(&[kept.addr(), freed.addr()])
            .await
            .unwrap_err();
        assert!(
            is_library_error(&err, "unregisterLocalMemoryBatch"),
            "{gen}: the library's refusal, typed: {err:?}"
        );

        // The kept region is still in Ferry's table: transfers from it
        // work, and unregistering it asks the library again (which still
        // refuses) instead of answering RegionNotRegistered, which callers
        // take as "safe to free".
        let seg = a.open_segment(b.segment_name()).await.unwrap();
        a.transfer(seg, TransferRequest::write(kept.addr(), dst.addr(), 64))
            .await
            .unwrap_or_else(|e| panic!("{gen}: the kept region left Ferry's table: {e:?}"));
        let again = a.unregister(kept.addr()).await.unwrap_err();
        assert!(
            is_library_error(&again, "unregisterLocalMemory"),
            "{gen}: unregister of the region the library kept: {again:?}"
        );
        if gen >= Lib::Current {
            // The library still serves it to peers (v0.3.12 checks
            // registration on the serving side).
            let bseg = b.open_segment(a.segment_name()).await.unwrap();
            b.transfer(bseg, TransferRequest::write(dst.addr(), kept.addr(), 64))
                .await
                .unwrap_or_else(|e| panic!("{gen}: a peer's write into the kept region: {e:?}"));
            // The released one is out of the library: a peer's write fails.
            let into_freed = b
                .transfer(bseg, TransferRequest::write(dst.addr(), freed.addr(), 64))
                .await;
            assert!(into_freed.is_err(), "{gen}: {into_freed:?}");
        }

        // The released region is out of both tables: unregister says so,
        // and the memory registers again.
        assert_eq!(
            a.unregister(freed.addr()).await,
            Err(Error::RegionNotRegistered { addr: freed.addr() }),
            "{gen}"
        );
        // SAFETY: as above.
        a.register(unsafe { freed.region(Location::cpu(0)) })
            .await
            .unwrap_or_else(|e| panic!("{gen}: re-registering released memory: {e:?}"));
        a.unregister(freed.addr()).await.unwrap();
        a.close_segment(seg).await.unwrap();
        drop((a, b));
        // Still registered with the library when its engine went: leaked.
        std::mem::forget(kept);
    }
}

/// A batch register whose later group the library refuses, and whose undo
/// of an earlier group the library refuses too: the region the library
/// kept stays in Ferry's table (a later `unregister` asks the library
/// again) and the error is `RegionHeld`, which `RegisteredBuffer` takes as
/// "leak, never free". Before, the undo's answer was ignored, Ferry forgot
/// the region and the caller freed memory the library still had.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_register_whose_undo_the_library_refuses_keeps_the_region() {
    const REFUSED: usize = 8192;
    for gen in SUPPORTED {
        let meta = metadata_for(gen);
        let kept = HostBuffer::new(KEPT).unwrap();
        let refused = HostBuffer::new(REFUSED).unwrap();
        let mut cfg = config(gen, &meta, "");
        cfg.device = Some(format!("unreg_refuse_len={KEPT},reg_fail_len={REFUSED}"));
        let a = start_engine(cfg).await.unwrap();
        // Two locations, two library calls: `kept` is registered by the
        // first, `refused` fails the second.
        // SAFETY: the buffers outlive the engine; `kept` is leaked below.
        let err = a
            .batch_register(vec![unsafe { kept.region(Location::cpu(0)) }, unsafe {
                refused.region(Location::cpu(1))
            }])
            .await
            .unwrap_err();
        assert!(
            matches!(err, Error::RegionHeld { addr, .. } if addr == kept.addr()),
            "{gen}: a region the library may still have, typed: {err:?}"
        );
        // Still in Ferry's table: unregistering it asks the library again
        // (which still refuses) instead of answering RegionNotRegistered.
        let again = a.unregister(kept.addr()).await.unwrap_err();
        assert!(
            is_library_error(&again, "unregisterLocalMemory"),
            "{gen}: unregister of the region the library kept: {again:?}"
        );
        // The refused region is in neither table.
        assert_eq!(
            a.unregister(refused.addr()).await,
            Err(Error::RegionNotRegistered {
                addr: refused.addr()
            }),
            "{gen}"
        );
        drop(a);
        // Still registered with the library when its engine went: leaked.
        std::mem::forget(kept);
    }
}

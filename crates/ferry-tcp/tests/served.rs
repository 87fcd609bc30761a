//! The target counts what peers moved through requests it served
//! (`TransferEngine::inbound`): exactly the bytes of the requests that
//! succeeded, per peer (by the engine name it gave in the handshake) and
//! direction, on the socket path and on the same-host paths (kernel copy,
//! staging area and granted copies); refused requests count nothing; a notification the
//! target refuses is counted as dropped.

mod common;

use std::sync::Arc;

use common::{engine, mem, pattern};
use ferry_core::{Notification, ServedCounts, TransferEngine, TransferRequest};
use ferry_tcp::{SameHost, TcpConfig, TcpEngine};

const BLOCK: u64 = 10_000;

/// What `b` served to `a`, by `a`'s name.
fn served_to(b: &TcpEngine, a: &TcpEngine) -> ServedCounts {
    let snap = b.inbound().expect("tcp counts inbound").snapshot();
    let served = snap.served.expect("tcp sees inbound traffic");
    assert!(
        served.keys().all(|k| k == a.segment_name()),
        "only {} talked to it: {served:?}",
        a.segment_name()
    );
    served.get(a.segment_name()).copied().unwrap_or_default()
}

async fn counts_exactly(cfg: impl Fn() -> TcpConfig, want_path: &str) {
    let a: Arc<TcpEngine> = engine(cfg()).await;
    let b: Arc<TcpEngine> = engine(cfg()).await;
    let len = 8 * BLOCK as usize;
    let src = mem(&a, len, 0).await;
    src.write(0, &pattern(3, len)).unwrap();
    let back = mem(&a, len, 0).await;
    let dst = mem(&b, len, 0).await;
    let seg = a.open_segment(b.segment_name()).await.unwrap();
    let report = a.peer_report(b.segment_name()).expect("a report");
    assert!(
        report.path.starts_with(want_path),
        "path {} (want {want_path})",
        report.path
    );
    assert_eq!(served_to(&b, &a), ServedCounts::default(), "nothing yet");

    // One write, then a batch of four blocks in reverse remote order (not
    // mergeable), one of them outside the target's region.
    a.transfer(seg, TransferRequest::write(src.addr(), dst.addr(), BLOCK))
        .await
        .unwrap();
    let batch: Vec<TransferRequest> = (0..3u64)
        .map(|i| {
            TransferRequest::write(src.addr() + i * BLOCK, dst.addr() + (6 - i) * BLOCK, BLOCK)
        })
        .chain([TransferRequest::write(
            src.addr(),
            dst.addr() + len as u64,
            BLOCK,
        )])
        .collect();
    let r = a.batch_transfer(seg, &batch, None).await.unwrap();
    assert_eq!(r.failures().count(), 1, "{r:?}");
    // Reads: one of 123 bytes, a batch of two blocks.
    a.transfer(seg, TransferRequest::read(back.addr(), dst.addr(), 123))
        .await
        .unwrap();
    let reads: Vec<TransferRequest> = (0..2u64)
        .map(|i| {
            TransferRequest::read(back.addr() + i * BLOCK, dst.addr() + (5 - i) * BLOCK, BLOCK)
        })
        .collect();
    a.batch_transfer(seg, &reads, None)
        .await
        .unwrap()
        .into_result()
        .unwrap();
    // The bytes moved as asked: remote block 5 holds source block 1.
    assert!(
        back.to_vec()[..BLOCK as usize] == pattern(3, len)[BLOCK as usize..2 * BLOCK as usize],
        "read back differs"
    );

    let c = served_to(&b, &a);
    assert_eq!(c.bytes_written, 4 * BLOCK, "{c:?}");
    assert_eq!(c.bytes_read, 123 + 2 * BLOCK, "{c:?}");
    // Each request is one range at least (a path may split one in frames).
    assert!(c.segments_written >= 4 && c.segments_read >= 3, "{c:?}");

    // A refused notification is dropped and counted; an accepted one not.
    b.set_refuse_notifications(true);
    let note = Notification::new("n", "m");
    assert!(a.batch_transfer(seg, &[], Some(&note)).await.is_err());
    b.set_refuse_notifications(false);
    a.batch_transfer(seg, &[], Some(&note))
        .await
        .unwrap()
        .into_result()
        .unwrap();
    let dropped = b.inbound().unwrap().snapshot().notifications_dropped;
    assert_eq!(dropped.map(|d| (d.full, d.closed)), Some((1, 0)));
    // The initiator served nothing.
    let a_served = a.inbound().unwrap().snapshot().served.unwrap();
    assert!(a_served.is_empty(), "{a_served:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn socket_path_counts_exactly() {
    counts_exactly(
        || {
            TcpConfig::builder()
                .chunk_size(4096)
                .same_host(SameHost::Off)
                .build()
                .unwrap()
        },
        "socket",
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn same_host_copy_counts_exactly() {
    counts_exactly(
        || {
            TcpConfig::builder()
                .chunk_size(4096)
                .same_host_chunk(4096)
                .same_host(SameHost::Cma)
                .same_host_stage(None)
                .build()
                .unwrap()
        },
        "same-host cma",
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn same_host_staged_counts_exactly() {
    counts_exactly(
        || {
            TcpConfig::builder()
                .chunk_size(200_000)
                .same_host_chunk(200_000)
                .same_host(SameHost::Cma)
                .same_host_stage(Some(1))
                .same_host_grant(false)
                .build()
                .unwrap()
        },
        "same-host staged",
    )
    .await;
}

/// Granted copies are counted by the initiator in the area; the target
/// adds them to the peer's counts when they are read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn same_host_granted_counts_exactly() {
    counts_exactly(
        || {
            TcpConfig::builder()
                .chunk_size(200_000)
                .same_host_chunk(200_000)
                .same_host(SameHost::Cma)
                .same_host_stage(Some(1))
                .build()
                .unwrap()
        },
        "same-host granted",
    )
    .await;
}

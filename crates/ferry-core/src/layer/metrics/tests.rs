//! The metrics layer counts what moved, and its exposition parses with
//! an ecosystem parser (`prometheus-parse`) to the same numbers as the
//! snapshot.

use std::sync::Arc;

use prometheus_parse::{Scrape, Value};

use super::*;
use crate::inproc::InprocEngine;
use crate::{CapabilityAdapter, DynTransferEngine, RegisteredBuffer};

fn scrape(metrics: &Metrics) -> Scrape {
    let text = metrics.encode();
    Scrape::parse(text.lines().map(|l| Ok(l.to_owned()))).expect("exposition parses")
}

/// The value of the sample `name` whose labels include every pair of
/// `labels`; `None` if there is none.
fn sample(scrape: &Scrape, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    scrape
        .samples
        .iter()
        .find(|s| s.metric == name && labels.iter().all(|(k, v)| s.labels.get(k) == Some(*v)))
        .map(|s| match &s.value {
            Value::Counter(v) | Value::Gauge(v) | Value::Untyped(v) => *v,
            Value::Histogram(b) => b.last().map_or(0.0, |b| b.count),
            Value::Summary(_) => f64::NAN,
        })
}

#[tokio::test]
async fn counts_bytes_requests_failures_and_registrations() {
    let metrics = Metrics::new();
    // Nothing optional native: the adapter emulates `batch_transfer`.
    let caps = Capabilities::default();
    let a = Arc::new(
        MetricsLayer::new(metrics.clone())
            .native(caps)
            .layer(CapabilityAdapter::new(InprocEngine::auto(caps))),
    );
    let b: Arc<dyn DynTransferEngine> = Arc::new(InprocEngine::auto(caps));
    let src = RegisteredBuffer::new(Arc::clone(&a), 4096).await.unwrap();
    let dst = RegisteredBuffer::new(Arc::clone(&b), 4096).await.unwrap();
    let peer = a.open_segment(b.segment_name()).await.unwrap();
    let requests = [
        TransferRequest::write(src.addr(), dst.addr(), 100),
        TransferRequest::write(src.addr() + 100, dst.addr() + 1000, 200),
        // Outside the peer's region: fails with `not_registered`.
        TransferRequest::write(src.addr(), dst.addr() + 8192, 50),
        TransferRequest::read(src.addr(), dst.addr(), 30),
    ];
    let report = a.batch_transfer(peer, &requests, None).await.unwrap();
    assert_eq!(report.failures().count(), 1);
    a.transfer(peer, TransferRequest::read(src.addr(), dst.addr(), 7))
        .await
        .unwrap();

    let snap = a.snapshot();
    let engine = a.segment_name().to_owned();
    let peer_name = b.segment_name().to_owned();
    assert_eq!(snap.engine, engine);
    let p = &snap.peers[&peer_name];
    assert_eq!(p.bytes_written, 300);
    assert_eq!(p.bytes_read, 37);
    assert_eq!(p.requests_ok, 4);
    assert_eq!(p.requests_failed.get("not_registered"), Some(&1));
    assert_eq!(snap.bytes_total(), 337);
    assert_eq!(snap.registered_bytes, 4096);
    assert_eq!(snap.batches_in_flight, 0);
    assert_eq!(snap.emulated.get("batch_transfer"), Some(&1));

    // The exposition says the same, through a parser of the format.
    let s = scrape(&metrics);
    let e = engine.as_str();
    let pe = peer_name.as_str();
    let labels = |op| [("engine", e), ("peer", pe), ("op", op)];
    assert_eq!(
        sample(&s, "ferry_transfer_bytes_total", &labels("write")),
        Some(300.0)
    );
    assert_eq!(
        sample(&s, "ferry_transfer_bytes_total", &labels("read")),
        Some(37.0)
    );
    assert_eq!(
        sample(
            &s,
            "ferry_transfer_requests_total",
            &[("engine", e), ("op", "write"), ("result", "not_registered")]
        ),
        Some(1.0)
    );
    assert_eq!(
        sample(
            &s,
            "ferry_transfer_failed_bytes_total",
            &[("engine", e), ("op", "write"), ("result", "not_registered")]
        ),
        Some(50.0)
    );
    assert_eq!(
        sample(&s, "ferry_registered_bytes", &[("engine", e)]),
        Some(4096.0)
    );
    assert_eq!(
        sample(&s, "ferry_batches_in_flight", &[("engine", e)]),
        Some(0.0)
    );
    assert_eq!(
        sample(
            &s,
            "ferry_batch_duration_seconds",
            &[("engine", e), ("call", "batch_transfer")]
        ),
        Some(1.0),
        "one batch observed (the +Inf bucket counts it)"
    );

    src.release().await.unwrap();
    assert_eq!(a.snapshot().registered_bytes, 0);
    dst.release().await.unwrap();

    // The engine gone, its series leave the exposition.
    a.close_segment(peer).await.unwrap();
    drop(a);
    let s = scrape(&metrics);
    assert!(
        s.samples.iter().all(|x| x.labels.get("engine") != Some(e)),
        "{:?}",
        s.samples
    );
    assert!(metrics.snapshots().is_empty());
}

#[tokio::test]
async fn async_batches_count_when_their_results_come_back() {
    let metrics = Metrics::new();
    let a = Arc::new(
        MetricsLayer::new(metrics.clone()).layer(CapabilityAdapter::new(InprocEngine::auto(
            Capabilities::all(),
        ))),
    );
    let b: Arc<dyn DynTransferEngine> = Arc::new(InprocEngine::auto(Capabilities::all()));
    let src = RegisteredBuffer::new(Arc::clone(&a), 1024).await.unwrap();
    let dst = RegisteredBuffer::new(Arc::clone(&b), 1024).await.unwrap();
    let peer = a.open_segment(b.segment_name()).await.unwrap();
    let note = Notification::new("a", "done");
    let id = a
        .submit(
            peer,
            &[TransferRequest::write(src.addr(), dst.addr(), 64)],
            Some(&note),
        )
        .await
        .unwrap();
    a.wait(id).await.unwrap();
    let second = a
        .submit(
            peer,
            &[TransferRequest::write(src.addr(), dst.addr(), 16)],
            None,
        )
        .await
        .unwrap();
    loop {
        if a.status(second).unwrap().is_finished() {
            break;
        }
        tokio::task::yield_now().await;
    }
    a.release_batch(second).await.unwrap();
    let snap = a.snapshot();
    let p = &snap.peers[b.segment_name()];
    assert_eq!(p.bytes_written, 80);
    assert_eq!(p.notifications_sent, 1);
    assert_eq!(snap.batches_in_flight, 0);
    // No native capabilities given: nothing counted as emulated.
    assert!(snap.emulated.is_empty());
    assert_eq!(metrics.snapshots().len(), 1);
    src.release().await.unwrap();
    dst.release().await.unwrap();
}

#[tokio::test]
async fn peers_beyond_the_limit_fold_into_other() {
    let metrics = Metrics::new();
    let a = Arc::new(
        MetricsLayer::new(metrics.clone())
            .peer_limit(1)
            .layer(InprocEngine::auto(Capabilities::all())),
    );
    let src = RegisteredBuffer::new(Arc::clone(&a), 64).await.unwrap();
    let mut peers = Vec::new();
    for _ in 0..3 {
        let b: Arc<dyn DynTransferEngine> = Arc::new(InprocEngine::auto(Capabilities::all()));
        let dst = RegisteredBuffer::new(Arc::clone(&b), 64).await.unwrap();
        let seg = a.open_segment(b.segment_name()).await.unwrap();
        a.transfer(seg, TransferRequest::write(src.addr(), dst.addr(), 8))
            .await
            .unwrap();
        peers.push((b, dst));
    }
    let snap = a.snapshot();
    assert_eq!(snap.peers.len(), 2, "{snap:?}");
    assert_eq!(snap.peers[peers[0].0.segment_name()].bytes_written, 8);
    assert_eq!(snap.peers[OTHER].bytes_written, 16);
    a.set_peer_path(peers[0].0.segment_name(), "socket");
    a.set_peer_path(peers[0].0.segment_name(), "same-host cma");
    a.set_peer_path(peers[1].0.segment_name(), "socket"); // folded: not recorded
    let snap = a.snapshot();
    assert_eq!(
        snap.peers[peers[0].0.segment_name()].path.as_deref(),
        Some("same-host cma")
    );
    assert_eq!(snap.peers[OTHER].path, None);
    assert_eq!(snap.bytes_total(), 24);
    let s = scrape(&metrics);
    assert_eq!(
        sample(&s, "ferry_transfer_bytes_total", &[("peer", OTHER)]),
        Some(16.0)
    );
    let path = |p| sample(&s, "ferry_peer_path", &[("path", p)]);
    assert_eq!(path("same-host cma"), Some(1.0));
    assert_eq!(path("socket"), None, "the replaced path's series is gone");
}

#[test]
fn every_error_kind_has_a_failure_label() {
    for label in FAILURE_LABELS {
        assert!(label.chars().all(|c| c.is_ascii_lowercase() || c == '_'));
    }
    assert_eq!(kind_label(ErrorKind::QueueFull), "queue_full");
    let distinct: std::collections::HashSet<_> = FAILURE_LABELS.iter().collect();
    assert_eq!(distinct.len(), FAILURE_LABELS.len());
}

/// The target side: what peers wrote into and read from an engine's
/// memory, read from the backend's counters at scrape time, per peer
/// (folded beyond the limit), with the inbox's dropped notifications.
#[tokio::test]
async fn exports_what_peers_moved_and_the_dropped_notifications() {
    let metrics = Metrics::new();
    let caps = Capabilities::all();
    let target = InprocEngine::auto(caps);
    let target_name = target.segment_name().to_owned();
    // One peer of its own, the rest `other`.
    let b = Arc::new(
        MetricsLayer::new(metrics.clone())
            .peer_limit(1)
            .layer(target),
    );
    let dst = RegisteredBuffer::new(Arc::clone(&b), 4096).await.unwrap();
    // Before any traffic: no served series (the family is left out).
    let s = scrape(&metrics);
    assert_eq!(sample(&s, "ferry_served_bytes_total", &[]), None);
    assert_eq!(
        sample(
            &s,
            "ferry_notifications_dropped_total",
            &[("engine", &target_name), ("reason", "full")]
        ),
        Some(0.0)
    );

    let mut initiators = Vec::new();
    for _ in 0..3 {
        let a = Arc::new(MetricsLayer::new(metrics.clone()).layer(InprocEngine::auto(caps)));
        let src = RegisteredBuffer::new(Arc::clone(&a), 4096).await.unwrap();
        let seg = a.open_segment(&target_name).await.unwrap();
        initiators.push((a, src, seg));
    }
    let (a0, src0, seg0) = &initiators[0];
    let requests = [
        TransferRequest::write(src0.addr(), dst.addr(), 100),
        TransferRequest::write(src0.addr() + 100, dst.addr() + 1000, 200),
        // Outside the target's region: refused, not served.
        TransferRequest::write(src0.addr(), dst.addr() + 8192, 50),
        TransferRequest::read(src0.addr(), dst.addr(), 30),
        // Empty: moves nothing, counts nothing.
        TransferRequest::read(src0.addr(), dst.addr(), 0),
    ];
    let report = a0.batch_transfer(*seg0, &requests, None).await.unwrap();
    assert_eq!(report.failures().count(), 1);
    for (a, src, seg) in &initiators[1..] {
        a.transfer(*seg, TransferRequest::write(src.addr(), dst.addr(), 10))
            .await
            .unwrap();
        a.transfer(*seg, TransferRequest::read(src.addr(), dst.addr(), 5))
            .await
            .unwrap();
    }
    // A notification the target refuses is dropped and counted.
    b.get_ref().set_refuse_notifications(true);
    let note = Notification::new("n", "m");
    assert!(a0.batch_transfer(*seg0, &[], Some(&note)).await.is_err());
    b.get_ref().set_refuse_notifications(false);
    a0.batch_transfer(*seg0, &[], Some(&note)).await.unwrap();

    let first = a0.segment_name();
    let s = scrape(&metrics);
    let served = |peer: &str, op: &str| {
        sample(
            &s,
            "ferry_served_bytes_total",
            &[("engine", &target_name), ("peer", peer), ("op", op)],
        )
    };
    assert_eq!(served(first, "write"), Some(300.0));
    assert_eq!(served(first, "read"), Some(30.0));
    assert_eq!(served(OTHER, "write"), Some(20.0));
    assert_eq!(served(OTHER, "read"), Some(10.0));
    let segments = |peer: &str, op: &str| {
        sample(
            &s,
            "ferry_served_segments_total",
            &[("engine", &target_name), ("peer", peer), ("op", op)],
        )
    };
    assert_eq!(segments(first, "write"), Some(2.0));
    assert_eq!(segments(first, "read"), Some(1.0));
    assert_eq!(segments(OTHER, "write"), Some(2.0));
    // The initiators serve nothing: no served series of theirs.
    let theirs = s
        .samples
        .iter()
        .filter(|x| x.metric == "ferry_served_bytes_total")
        .filter(|x| x.labels.get("engine") != Some(target_name.as_str()))
        .count();
    assert_eq!(theirs, 0);
    let dropped = |reason: &str| {
        sample(
            &s,
            "ferry_notifications_dropped_total",
            &[("engine", &target_name), ("reason", reason)],
        )
    };
    assert_eq!((dropped("full"), dropped("closed")), (Some(1.0), Some(0.0)));
    // What the initiator counted equals what the target served.
    assert_eq!(
        sample(
            &s,
            "ferry_transfer_bytes_total",
            &[("engine", first), ("op", "write")]
        ),
        served(first, "write")
    );

    // The snapshot says the same.
    let inbound = b.snapshot().inbound.expect("inproc counts inbound");
    let by_peer = inbound.served.as_ref().expect("served");
    assert_eq!(by_peer.len(), 2, "{by_peer:?}");
    assert_eq!(by_peer[first].bytes_written, 300);
    assert_eq!(by_peer[OTHER].bytes_read, 10);
    assert_eq!(inbound.served_bytes(), 360);
    assert_eq!(inbound.notifications_dropped.map(|d| d.total()), Some(1));
}

/// The request path counts through per-peer handles cached by segment:
/// handles to one peer share its series, a closed handle leaves the
/// others counting, a handle opened below the layer counts as `unknown`,
/// and a series appears only with its first sample.
#[tokio::test]
async fn cached_peer_series_are_shared_and_created_on_first_use() {
    let metrics = Metrics::new();
    let caps = Capabilities::all();
    let a = Arc::new(MetricsLayer::new(metrics.clone()).layer(InprocEngine::auto(caps)));
    let b: Arc<dyn DynTransferEngine> = Arc::new(InprocEngine::auto(caps));
    let src = RegisteredBuffer::new(Arc::clone(&a), 4096).await.unwrap();
    let dst = RegisteredBuffer::new(Arc::clone(&b), 4096).await.unwrap();
    let one = a.open_segment(b.segment_name()).await.unwrap();
    let two = a.open_segment(b.segment_name()).await.unwrap();
    let below = a.get_ref().open_segment(b.segment_name()).await.unwrap();
    let w = |n| TransferRequest::write(src.addr(), dst.addr(), n);
    a.transfer(one, w(10)).await.unwrap();
    a.transfer(two, w(20)).await.unwrap();
    a.close_segment(one).await.unwrap();
    a.transfer(two, w(40)).await.unwrap();
    a.transfer(below, w(7)).await.unwrap();
    let engine = a.segment_name().to_owned();
    let peer = b.segment_name().to_owned();
    let s = scrape(&metrics);
    let bytes = |peer: &str, op: &str| {
        sample(
            &s,
            "ferry_transfer_bytes_total",
            &[("engine", &engine), ("peer", peer), ("op", op)],
        )
    };
    assert_eq!(bytes(&peer, "write"), Some(70.0));
    assert_eq!(bytes(UNKNOWN, "write"), Some(7.0));
    assert_eq!(bytes(&peer, "read"), None, "no read yet: no series");
    let ok = sample(
        &s,
        "ferry_transfer_requests_total",
        &[("engine", &engine), ("peer", &peer), ("result", "ok")],
    );
    assert_eq!(ok, Some(3.0));
    let calls = |call: &str| {
        sample(
            &s,
            "ferry_batch_duration_seconds",
            &[("engine", &engine), ("peer", &peer), ("call", call)],
        )
    };
    assert_eq!(calls("transfer"), Some(3.0));
    assert_eq!(calls("batch_transfer"), None);
    assert_eq!(
        sample(&s, "ferry_batches_in_flight", &[("engine", &engine)]),
        Some(0.0)
    );
    let snap = a.snapshot();
    assert_eq!(snap.peers[&peer].bytes_written, 70);
    assert_eq!(snap.peers[UNKNOWN].bytes_written, 7);
}

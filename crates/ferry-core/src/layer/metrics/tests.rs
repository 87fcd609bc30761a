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

//! The conformance suite through a stack of every layer (timeout, metrics,
//! tracing, coalescing, capability adapter, and the adapter's three layers
//! stacked by hand) on the in-process engine and on TCP, and
//! the facade's metrics counting what moved.
#![cfg(feature = "tcp")]

use std::sync::Arc;
use std::time::Duration;

use ferry::ConcurrencyLimitLayer;
use ferry::{
    Engine, EngineConfig, Layer, LayerExt, Metrics, MetricsLayer, RegisteredBuffer, Result,
    TimeoutLayer, TracingLayer, TransferEngine, TransferRequest,
};
use ferry_core::conformance::{EngineFactory, InprocFactory};
use ferry_core::inproc::InprocEngine;
use ferry_core::layer::CoalesceLayer;
use ferry_core::EmulationLayer;
use ferry_core::{Capabilities, CapabilityAdapter, DynTransferEngine};

/// Far longer than any check takes: the deadline is there, never reached.
const DEADLINE: Duration = Duration::from_secs(120);

/// In-process engines with `caps` natively, under every layer.
struct InprocStack(Capabilities);

#[async_trait::async_trait]
impl EngineFactory for InprocStack {
    async fn create(&self) -> Result<Arc<dyn DynTransferEngine>> {
        let adapted = CapabilityAdapter::new(InprocEngine::auto(self.0));
        let native = adapted.report().native;
        let coalesced = CoalesceLayer::default().layer(adapted);
        let timed = TimeoutLayer::new(DEADLINE).layer(coalesced);
        let counted = MetricsLayer::new(Metrics::new())
            .native(native)
            .layer(timed);
        Ok(Arc::new(TracingLayer::new().layer(counted)))
    }

    async fn refuse_notifications(&self, engine: &Arc<dyn DynTransferEngine>) -> Result<bool> {
        InprocFactory::new(self.0)
            .refuse_notifications(engine)
            .await
    }
}

/// Nothing optional native: every emulation runs under the layers.
mod inproc_none {
    use super::*;
    ferry_core::conformance_tests!(InprocStack(Capabilities::default()));
}

/// Everything native: the layers forward native batches.
mod inproc_all {
    use super::*;
    ferry_core::conformance_tests!(InprocStack(Capabilities::all()));
}

/// The adapter split in its three layers: coalescing over emulation over
/// the concurrency limit (each with one job), on engines with `caps`
/// natively.
struct SplitStack(Capabilities);

#[async_trait::async_trait]
impl EngineFactory for SplitStack {
    async fn create(&self) -> Result<Arc<dyn DynTransferEngine>> {
        let engine = InprocEngine::auto(self.0)
            .layer(ConcurrencyLimitLayer::default())
            .layer(EmulationLayer::default())
            .layer(CoalesceLayer::default());
        Ok(Arc::new(engine))
    }

    async fn refuse_notifications(&self, engine: &Arc<dyn DynTransferEngine>) -> Result<bool> {
        InprocFactory::new(self.0)
            .refuse_notifications(engine)
            .await
    }
}

fn async_notify() -> Capabilities {
    let mut caps = Capabilities::default();
    caps.async_batch = true;
    caps.notify = true;
    caps
}

/// Nothing optional native.
mod split_none {
    use super::*;
    ferry_core::conformance_tests!(SplitStack(Capabilities::default()));
}

/// Native async batches and notifications only: merged batches run on
/// the emulated `batch_transfer` over the native async path.
mod split_async_notify {
    use super::*;
    ferry_core::conformance_tests!(SplitStack(async_notify()));
}

#[test]
fn the_split_layers_report_what_the_default_adapter_reports() {
    for caps in [Capabilities::default(), Capabilities::all(), async_notify()] {
        let whole = CapabilityAdapter::new(InprocEngine::auto(caps));
        let split = InprocEngine::auto(caps)
            .layer(ConcurrencyLimitLayer::default())
            .layer(EmulationLayer::default())
            .layer(CoalesceLayer::default());
        assert_eq!(split.capabilities(), whole.capabilities(), "{caps:?}");
        let (a, b) = (split.get_ref().report(), whole.report());
        assert_eq!(
            (a.native, a.effective, a.operations, a.guarantees, a.strict),
            (b.native, b.effective, b.operations, b.guarantees, b.strict),
            "{caps:?}"
        );
    }
}

/// TCP engines opened through the facade (its default stack), with every
/// layer stacked once more on top through `Engine::layer`.
struct TcpStack;

#[async_trait::async_trait]
impl EngineFactory for TcpStack {
    async fn create(&self) -> Result<Arc<dyn DynTransferEngine>> {
        let engine = Engine::open("tcp://127.0.0.1:0?secret=layers")
            .await?
            .layer(CoalesceLayer::default())
            .layer(TimeoutLayer::new(DEADLINE))
            .layer(MetricsLayer::new(Metrics::new()))
            .layer(TracingLayer::new());
        Ok(Arc::new(engine))
    }

    fn unknown_segment_name(&self) -> String {
        // A port nothing listens on (bound, then released).
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = l.local_addr().expect("addr");
        drop(l);
        addr.to_string()
    }
}

mod tcp {
    use super::*;
    ferry_core::conformance_tests!(TcpStack);
}

async fn open(metrics: Option<Metrics>) -> Engine {
    let config = EngineConfig::from_url("tcp://127.0.0.1:0")
        .expect("url")
        .metrics(metrics);
    Engine::start(config).await.expect("engine starts")
}

#[tokio::test]
async fn engine_metrics_count_the_bytes_moved_per_peer() {
    let metrics = Metrics::new();
    let prefill = Arc::new(open(Some(metrics.clone())).await);
    let decode = Arc::new(open(Some(metrics.clone())).await);
    let src = RegisteredBuffer::new(Arc::clone(&prefill), 64 << 10)
        .await
        .unwrap();
    let dst = RegisteredBuffer::new(Arc::clone(&decode), 64 << 10)
        .await
        .unwrap();
    let peer = prefill.open_segment(decode.segment_name()).await.unwrap();
    let blocks: Vec<TransferRequest> = (0..16u64)
        .map(|i| TransferRequest::write(src.addr() + i * 4096, dst.addr() + i * 4096, 4096))
        .collect();
    prefill
        .batch_transfer(peer, &blocks, None)
        .await
        .unwrap()
        .into_result()
        .unwrap();
    prefill
        .transfer(peer, TransferRequest::read(src.addr(), dst.addr(), 100))
        .await
        .unwrap();

    let snap = prefill.metrics();
    assert_eq!(snap.engine, prefill.segment_name());
    let p = &snap.peers[decode.segment_name()];
    assert_eq!(p.bytes_written, 16 * 4096);
    assert_eq!(p.bytes_read, 100);
    assert_eq!(p.requests_ok, 17);
    // Two engines of one process: the same-host path, or the socket where
    // the machine refuses cross-memory attach; never unset.
    let path = p.path.as_deref().expect("the path to the peer");
    assert!(path == "socket" || path.starts_with("same-host"), "{path}");
    assert_eq!(snap.requests_failed(), 0);
    assert_eq!(snap.registered_bytes, 64 << 10);
    assert_eq!(snap.batches_in_flight, 0);
    // TCP has every batch operation natively: nothing emulated.
    assert!(snap.emulated.is_empty(), "{snap:?}");
    // Both engines count into the same registry, each under its own label.
    assert_eq!(metrics.snapshots().len(), 2);
    assert_eq!(decode.metrics().bytes_total(), 0);
    assert!(prefill.metrics_registry().is_some());

    // Metrics off: nothing counted, the engine works the same.
    let quiet = Arc::new(open(None).await);
    let buf = RegisteredBuffer::new(Arc::clone(&quiet), 4096)
        .await
        .unwrap();
    let seg = quiet.open_segment(decode.segment_name()).await.unwrap();
    quiet
        .transfer(seg, TransferRequest::write(buf.addr(), dst.addr(), 4096))
        .await
        .unwrap();
    assert_eq!(quiet.metrics().bytes_total(), 0);
    assert!(quiet.metrics_registry().is_none());
    // The default stack's capability report is the adapter's.
    assert_eq!(prefill.report().effective, prefill.capabilities());
}

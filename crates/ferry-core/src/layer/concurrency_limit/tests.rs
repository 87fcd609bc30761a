//! The layer on its own and in the adapter's stack, over an engine whose
//! transfers and batches wait at a gate the test opens: what it holds back
//! and what it lets through.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use super::*;
use crate::caps::Capabilities;
use crate::inproc::InprocEngine;
use crate::layer::LayerExt;
use crate::types::{BatchReport, Notification};
use crate::{AdapterConfig, CapabilityAdapter, EmulationEngine};

/// Every `transfer` and `batch_transfer` waits for a permit of `gate`
/// (and consumes it), counted while it waits; the rest is an in-process
/// engine's.
struct Gate {
    inner: InprocEngine,
    gate: Semaphore,
    transfers: AtomicUsize,
    batches: AtomicUsize,
}

impl Gate {
    /// Native `batch_transfer` or not; nothing else optional.
    fn new(native_batches: bool) -> Gate {
        let caps = Capabilities {
            batch_transfer: native_batches,
            ..Capabilities::default()
        };
        Gate {
            inner: InprocEngine::auto(caps),
            gate: Semaphore::new(0),
            transfers: AtomicUsize::new(0),
            batches: AtomicUsize::new(0),
        }
    }

    async fn pass(&self, count: &AtomicUsize) {
        count.fetch_add(1, Ordering::SeqCst);
        let _left = Left(count);
        self.gate.acquire().await.expect("gate open").forget();
    }
}

/// Counts a call out when it returns or is dropped.
struct Left<'a>(&'a AtomicUsize);

impl Drop for Left<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// The optional operations it does not declare keep the trait's
/// refusing defaults.
impl TransferEngine for Gate {
    forward!(
        backend_name,
        segment_name,
        capabilities,
        backend_info,
        register,
        unregister,
        open_segment,
        close_segment
    );

    async fn transfer(&self, _segment: SegmentId, _request: TransferRequest) -> Result<()> {
        self.pass(&self.transfers).await;
        Ok(())
    }

    async fn batch_transfer(
        &self,
        _segment: SegmentId,
        requests: &[TransferRequest],
        _notify: Option<&Notification>,
    ) -> Result<BatchReport> {
        self.pass(&self.batches).await;
        Ok(BatchReport {
            results: vec![Ok(()); requests.len()],
        })
    }
}

/// Waits (up to 10 s) until `count` reads `n`, then a little longer, and
/// returns what it reads then: `n` unless more calls got through.
async fn settles_at(count: &AtomicUsize, n: usize) -> usize {
    for _ in 0..10_000 {
        if count.load(Ordering::SeqCst) >= n {
            break;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    tokio::time::sleep(Duration::from_millis(50)).await;
    count.load(Ordering::SeqCst)
}

/// The gate moves no bytes; any request does.
const REQUEST: TransferRequest = TransferRequest {
    op: crate::types::TransferOp::Write,
    local_addr: 0,
    remote_addr: 0,
    len: 0,
};

/// Pending once (waking itself), then ready: a yield with no runtime.
async fn yield_once() {
    let mut yielded = false;
    std::future::poll_fn(|cx| {
        if yielded {
            std::task::Poll::Ready(())
        } else {
            yielded = true;
            cx.waker().wake_by_ref();
            std::task::Poll::Pending
        }
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn holds_back_limited_transfers_only() {
    let engine = Arc::new(Gate::new(true).layer(ConcurrencyLimitLayer::new(2)));
    let gate = engine.get_ref();
    let seg = SegmentId(1);

    // A caller's own transfers: all five reach the engine at once.
    let mut calls = Vec::new();
    for _ in 0..5 {
        let e = Arc::clone(&engine);
        calls.push(tokio::spawn(async move { e.transfer(seg, REQUEST).await }));
    }
    assert_eq!(settles_at(&gate.transfers, 5).await, 5);
    assert_eq!(engine.in_flight(), 0);
    gate.gate.add_permits(5);
    for c in calls.drain(..) {
        c.await.unwrap().unwrap();
    }

    // Inside `limited`: two at a time.
    for _ in 0..5 {
        let e = Arc::clone(&engine);
        calls.push(tokio::spawn(async move {
            limited(e.transfer(seg, REQUEST)).await
        }));
    }
    assert_eq!(settles_at(&gate.transfers, 2).await, 2);
    assert_eq!(engine.in_flight(), 2);
    gate.gate.add_permits(5);
    for c in calls.drain(..) {
        c.await.unwrap().unwrap();
    }
    assert_eq!(engine.in_flight(), 0);

    // Native batches, even inside `limited`: all five at once.
    let mut batches = Vec::new();
    for _ in 0..5 {
        let e = Arc::clone(&engine);
        batches.push(tokio::spawn(async move {
            limited(e.batch_transfer(seg, &[REQUEST; 3], None)).await
        }));
    }
    assert_eq!(settles_at(&gate.batches, 5).await, 5);
    assert_eq!(engine.in_flight(), 0);
    gate.gate.add_permits(5);
    for b in batches {
        assert!(b.await.unwrap().unwrap().is_success());
    }
}

#[tokio::test]
async fn a_dropped_transfer_gives_its_permit_back() {
    let engine = Arc::new(Gate::new(true).layer(ConcurrencyLimitLayer::new(1)));
    let e = Arc::clone(&engine);
    let stuck = tokio::spawn(async move { limited(e.transfer(SegmentId(1), REQUEST)).await });
    assert_eq!(settles_at(&engine.get_ref().transfers, 1).await, 1);
    assert_eq!(engine.in_flight(), 1);
    stuck.abort();
    assert!(stuck.await.unwrap_err().is_cancelled());
    assert_eq!(engine.in_flight(), 0);
    // The next one gets the permit.
    engine.get_ref().gate.add_permits(1);
    limited(engine.transfer(SegmentId(1), REQUEST))
        .await
        .unwrap();
}

#[test]
fn limits_without_a_runtime_too() {
    let engine = Gate::new(true).layer(ConcurrencyLimitLayer::new(1));
    let gate = engine.get_ref();
    futures::executor::block_on(async {
        let (a, b, ()) = futures::join!(
            limited(engine.transfer(SegmentId(1), REQUEST)),
            limited(engine.transfer(SegmentId(1), REQUEST)),
            async {
                for _ in 0..100 {
                    yield_once().await;
                }
                // One at the gate, the other held back by the layer.
                assert_eq!(gate.transfers.load(Ordering::SeqCst), 1);
                assert_eq!(engine.in_flight(), 1);
                gate.gate.add_permits(2);
            }
        );
        a.unwrap();
        b.unwrap();
    });
    assert_eq!(engine.in_flight(), 0);
}

#[test]
fn keeps_the_inner_capabilities_and_report() {
    for caps in [Capabilities::default(), Capabilities::all()] {
        let raw = InprocEngine::new("limit-report", caps).unwrap();
        let (c, info) = (raw.capabilities(), raw.backend_info());
        let limited = raw.layer(ConcurrencyLimitLayer::default());
        assert_eq!(limited.capabilities(), c);
        assert_eq!(limited.backend_info(), info);
        assert_eq!(limited.max(), 16);
    }
    assert_eq!(
        ConcurrencyLimitLayer::new(0).layer(Gate::new(true)).max(),
        1
    );
}

/// `max_concurrency` 3, coalescing off, over a gate with no native batch
/// path: every batch is emulated with single transfers.
fn config() -> AdapterConfig {
    AdapterConfig::builder()
        .max_concurrency(3)
        .coalesce(false)
        .build()
        .unwrap()
}

/// Two sync batches and one async batch of 8 requests each, on tasks.
fn three_batches<E: TransferEngine>(engine: &Arc<E>) -> Vec<tokio::task::JoinHandle<BatchReport>> {
    let seg = SegmentId(1);
    let sync = (0..2).map(|_| {
        let e = Arc::clone(engine);
        tokio::spawn(async move { e.batch_transfer(seg, &[REQUEST; 8], None).await.unwrap() })
    });
    let e = Arc::clone(engine);
    let async_ = tokio::spawn(async move {
        let id = e.submit(seg, &[REQUEST; 8], None).await.unwrap();
        e.wait(id).await.unwrap()
    });
    sync.chain([async_]).collect()
}

async fn all_succeed(batches: Vec<tokio::task::JoinHandle<BatchReport>>) {
    for b in batches {
        let report = b.await.unwrap();
        assert!(report.is_success() && report.results.len() == 8);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_adapter_caps_emulated_transfers_across_batches() {
    let adapter = Arc::new(CapabilityAdapter::with_config(Gate::new(false), config()));
    let gate = adapter.get_ref();
    let batches = three_batches(&adapter);
    // 24 single transfers wanted, each batch could issue 3: 3 in all.
    assert_eq!(settles_at(&gate.transfers, 3).await, 3);
    assert_eq!(adapter.concurrency_limit().in_flight(), 3);
    gate.gate.add_permits(24);
    all_succeed(batches).await;
    assert_eq!(adapter.concurrency_limit().in_flight(), 0);
}

/// What the test above would see without the layer: the emulation alone
/// bounds each batch (3 at a time), not their sum.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_emulation_alone_bounds_each_batch_only() {
    let emulation = Arc::new(EmulationEngine::from_arc(
        Arc::new(Gate::new(false)),
        config(),
    ));
    let gate = emulation.get_ref();
    let batches = three_batches(&emulation);
    assert_eq!(settles_at(&gate.transfers, 9).await, 9);
    gate.gate.add_permits(24);
    all_succeed(batches).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_adapter_leaves_a_callers_transfers_and_native_batches_alone() {
    let seg = SegmentId(1);
    let adapter = Arc::new(CapabilityAdapter::with_config(Gate::new(true), config()));
    let gate = adapter.get_ref();
    let mut calls = Vec::new();
    for _ in 0..8 {
        let a = Arc::clone(&adapter);
        calls.push(tokio::spawn(async move { a.transfer(seg, REQUEST).await }));
    }
    assert_eq!(settles_at(&gate.transfers, 8).await, 8);
    let mut batches = Vec::new();
    for _ in 0..5 {
        let a = Arc::clone(&adapter);
        batches.push(tokio::spawn(async move {
            a.batch_transfer(seg, &[REQUEST; 4], None).await
        }));
    }
    assert_eq!(settles_at(&gate.batches, 5).await, 5);
    assert_eq!(adapter.concurrency_limit().in_flight(), 0);
    gate.gate.add_permits(13);
    for c in calls {
        c.await.unwrap().unwrap();
    }
    for b in batches {
        assert!(b.await.unwrap().unwrap().is_success());
    }
}

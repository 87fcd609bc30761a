//! The adapter's own promises, observed at the backend: bounded concurrency,
//! coalescing before the backend, chunking by `max_batch_len`, per-request
//! reporting of late refusals, strict mode and the capability report.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ferry_core::inproc::InprocEngine;
use ferry_core::{
    AdapterConfig, BackendInfo, BatchId, BatchReport, BatchStatus, Capabilities, CapabilityAdapter,
    Error, HostBuffer, Location, MemoryRegion, Notification, Operation, Result, SegmentId, Support,
    TransferEngine, TransferRequest,
};

/// Forwards to an inproc engine, recording what reaches the backend.
struct Probe {
    inner: InprocEngine,
    in_flight: AtomicUsize,
    max_in_flight: AtomicUsize,
    transfers: AtomicUsize,
    /// Lengths of the batches `batch_transfer` received.
    batches: Mutex<Vec<usize>>,
    /// `batch_transfer` call numbers (0-based) to refuse with `PeerLost`.
    refuse_batch_calls: Vec<usize>,
}

impl Probe {
    fn new(caps: Capabilities) -> Probe {
        Probe {
            inner: InprocEngine::auto(caps),
            in_flight: AtomicUsize::new(0),
            max_in_flight: AtomicUsize::new(0),
            transfers: AtomicUsize::new(0),
            batches: Mutex::new(Vec::new()),
            refuse_batch_calls: Vec::new(),
        }
    }
}

#[deny(clippy::missing_trait_methods)]
impl TransferEngine for Probe {
    fn backend_name(&self) -> &str {
        self.inner.backend_name()
    }
    fn segment_name(&self) -> &str {
        self.inner.segment_name()
    }
    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }
    fn backend_info(&self) -> BackendInfo {
        self.inner.backend_info()
    }
    async fn register(&self, region: MemoryRegion) -> Result<()> {
        self.inner.register(region).await
    }
    async fn unregister(&self, addr: u64) -> Result<()> {
        self.inner.unregister(addr).await
    }
    async fn batch_register(&self, regions: Vec<MemoryRegion>) -> Result<()> {
        self.inner.batch_register(regions).await
    }
    async fn batch_unregister(&self, addrs: &[u64]) -> Result<()> {
        self.inner.batch_unregister(addrs).await
    }
    async fn open_segment(&self, name: &str) -> Result<SegmentId> {
        self.inner.open_segment(name).await
    }
    async fn close_segment(&self, segment: SegmentId) -> Result<()> {
        self.inner.close_segment(segment).await
    }
    async fn transfer(&self, segment: SegmentId, request: TransferRequest) -> Result<()> {
        self.transfers.fetch_add(1, Ordering::SeqCst);
        let now = self.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
        self.max_in_flight.fetch_max(now, Ordering::SeqCst);
        let r = self.inner.transfer(segment, request).await;
        self.in_flight.fetch_sub(1, Ordering::SeqCst);
        r
    }
    async fn batch_transfer(
        &self,
        segment: SegmentId,
        requests: &[TransferRequest],
        notify: Option<&Notification>,
    ) -> Result<BatchReport> {
        let call = {
            let mut b = self.batches.lock().unwrap();
            b.push(requests.len());
            b.len() - 1
        };
        if self.refuse_batch_calls.contains(&call) {
            return Err(Error::PeerLost {
                peer: "probe".into(),
                reason: format!("refusing batch call {call}"),
            });
        }
        self.inner.batch_transfer(segment, requests, notify).await
    }
    async fn submit(
        &self,
        segment: SegmentId,
        requests: &[TransferRequest],
        notify: Option<&Notification>,
    ) -> Result<BatchId> {
        self.inner.submit(segment, requests, notify).await
    }
    fn status(&self, batch: BatchId) -> Result<BatchStatus> {
        self.inner.status(batch)
    }
    async fn wait(&self, batch: BatchId) -> Result<BatchReport> {
        self.inner.wait(batch).await
    }
    async fn release_batch(&self, batch: BatchId) -> Result<()> {
        self.inner.release_batch(batch).await
    }
    async fn take_notifications(&self) -> Result<Vec<Notification>> {
        self.inner.take_notifications().await
    }
    async fn next_notification(&self, name: Option<&str>) -> Result<Notification> {
        self.inner.next_notification(name).await
    }
    fn live_batches(&self) -> Option<usize> {
        self.inner.live_batches()
    }
    fn inbound(&self) -> Option<ferry_core::Inbound> {
        self.inner.inbound()
    }

    async fn shutdown(&self) -> Result<()> {
        self.inner.shutdown().await
    }
}

/// An issuing probe behind an adapter, a peer, registered memories of
/// `len` bytes on both sides and an open segment.
struct Rig {
    probe: Arc<Probe>,
    adapter: CapabilityAdapter<Probe>,
    peer: InprocEngine,
    local: &'static HostBuffer,
    remote: &'static HostBuffer,
    seg: SegmentId,
}

async fn rig(probe: Probe, peer_caps: Capabilities, config: AdapterConfig, len: usize) -> Rig {
    let probe = Arc::new(probe);
    let adapter = CapabilityAdapter::from_arc(Arc::clone(&probe), config);
    let peer = InprocEngine::auto(peer_caps);
    // Leaked: engines may outlive a failing test's stack.
    let local: &'static HostBuffer = Box::leak(Box::new(HostBuffer::new(len).unwrap()));
    let remote: &'static HostBuffer = Box::leak(Box::new(HostBuffer::new(len).unwrap()));
    local
        .write(0, &ferry_core::conformance::pattern(7, len))
        .unwrap();
    adapter
        // SAFETY: the buffer outlives its registration (the test's transfers finish first).
        .register(unsafe { local.region(Location::cpu(0)) })
        .await
        .unwrap();
    // SAFETY: the buffer outlives its registration (the test's transfers finish first).
    peer.register(unsafe { remote.region(Location::cpu(0)) })
        .await
        .unwrap();
    let seg = adapter.open_segment(peer.segment_name()).await.unwrap();
    Rig {
        probe,
        adapter,
        peer,
        local,
        remote,
        seg,
    }
}

/// `n` writes of `size` bytes, local slot i to remote slot `n-1-i`
/// (reversed: nothing is contiguous, nothing coalesces).
fn scattered(r: &Rig, n: usize, size: usize) -> Vec<TransferRequest> {
    (0..n)
        .map(|i| {
            TransferRequest::write(
                r.local.addr() + (i * size) as u64,
                r.remote.addr() + ((n - 1 - i) * size) as u64,
                size as u64,
            )
        })
        .collect()
}

fn contiguous(r: &Rig, n: usize, size: usize) -> Vec<TransferRequest> {
    (0..n)
        .map(|i| {
            let off = (i * size) as u64;
            TransferRequest::write(r.local.addr() + off, r.remote.addr() + off, size as u64)
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn emulated_concurrency_is_bounded_across_batches() {
    let probe = Probe::new(Capabilities::default());
    probe.inner.set_pace(Some(Duration::from_micros(100)));
    let config = AdapterConfig::builder()
        .max_concurrency(3)
        .coalesce(false)
        .build()
        .unwrap();
    let r = rig(probe, Capabilities::default(), config, 64 * 128 * 1024).await;
    let reqs = scattered(&r, 64, 128 * 1024);
    let (x, y) = tokio::join!(
        r.adapter.batch_transfer(r.seg, &reqs[..32], None),
        r.adapter.batch_transfer(r.seg, &reqs[32..], None)
    );
    assert!(x.unwrap().is_success() && y.unwrap().is_success());
    assert_eq!(r.probe.transfers.load(Ordering::SeqCst), 64);
    let max = r.probe.max_in_flight.load(Ordering::SeqCst);
    assert!(
        max <= 3,
        "{max} single transfers were in flight at once; the bound is 3"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn coalescing_happens_before_the_backend() {
    for coalesce in [true, false] {
        let config = AdapterConfig::builder().coalesce(coalesce).build().unwrap();
        // Emulated path: single transfers reach the backend.
        let r = rig(
            Probe::new(Capabilities::default()),
            Capabilities::default(),
            config.clone(),
            64 * 1000,
        )
        .await;
        let report = r
            .adapter
            .batch_transfer(r.seg, &contiguous(&r, 64, 1000), None)
            .await
            .unwrap();
        assert_eq!(report.len(), 64);
        assert!(report.is_success());
        assert_eq!(
            r.probe.transfers.load(Ordering::SeqCst),
            if coalesce { 1 } else { 64 }
        );
        assert_eq!(r.remote.to_vec(), r.local.to_vec());
        // Native path: one batch of one merged request.
        let r = rig(
            Probe::new(Capabilities::all()),
            Capabilities::all(),
            config,
            64 * 1000,
        )
        .await;
        let report = r
            .adapter
            .batch_transfer(r.seg, &contiguous(&r, 64, 1000), None)
            .await
            .unwrap();
        assert!(report.is_success());
        assert_eq!(
            *r.probe.batches.lock().unwrap(),
            vec![if coalesce { 1 } else { 64 }]
        );
        assert_eq!(r.remote.to_vec(), r.local.to_vec());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn coalescing_respects_max_coalesced_len() {
    let config = AdapterConfig::builder()
        .max_coalesced_len(3000)
        .build()
        .unwrap();
    let r = rig(
        Probe::new(Capabilities::default()),
        Capabilities::default(),
        config,
        8 * 1000,
    )
    .await;
    let report = r
        .adapter
        .batch_transfer(r.seg, &contiguous(&r, 8, 1000), None)
        .await
        .unwrap();
    assert!(report.is_success());
    assert_eq!(r.probe.transfers.load(Ordering::SeqCst), 3); // 3 + 3 + 2
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn native_batches_are_split_by_max_batch_len_and_notify_once_at_the_end() {
    let caps = {
        let mut caps = Capabilities::all();
        caps.max_batch_len = Some(10);
        caps
    };
    let r = rig(Probe::new(caps), caps, AdapterConfig::default(), 25 * 512).await;
    assert_eq!(r.adapter.capabilities().max_batch_len, None);
    let note = Notification::new("probe", "done");
    let report = r
        .adapter
        .batch_transfer(r.seg, &scattered(&r, 25, 512), Some(&note))
        .await
        .unwrap();
    assert!(report.is_success());
    assert_eq!(*r.probe.batches.lock().unwrap(), vec![10, 10, 5]);
    assert_eq!(r.peer.take_notifications().await.unwrap(), vec![note]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_chunk_refusal_fails_its_requests_not_the_batch() {
    let caps = {
        let mut caps = Capabilities::all();
        caps.max_batch_len = Some(10);
        caps
    };
    let mut probe = Probe::new(caps);
    probe.refuse_batch_calls = vec![1];
    let r = rig(probe, caps, AdapterConfig::default(), 25 * 512).await;
    let note = Notification::new("probe", "must-not-arrive");
    let report = r
        .adapter
        .batch_transfer(r.seg, &scattered(&r, 25, 512), Some(&note))
        .await
        .expect("bytes moved before the refusal: the batch is not refused whole");
    for (i, res) in report.results.iter().enumerate() {
        if (10..20).contains(&i) {
            assert!(matches!(res, Err(Error::PeerLost { .. })), "{i}: {res:?}");
        } else {
            assert!(res.is_ok(), "{i}: {res:?}");
        }
    }
    assert!(r.peer.take_notifications().await.unwrap().is_empty());
    // A refusal of the first chunk refuses the batch (nothing moved).
    let mut probe = Probe::new(caps);
    probe.refuse_batch_calls = vec![0];
    let r = rig(probe, caps, AdapterConfig::default(), 25 * 512).await;
    assert!(matches!(
        r.adapter
            .batch_transfer(r.seg, &scattered(&r, 25, 512), None)
            .await,
        Err(Error::PeerLost { .. })
    ));
    assert!(r.remote.to_vec().iter().all(|b| *b == 0));
}

#[tokio::test]
async fn strict_mode_refuses_and_names_every_missing_capability() {
    let strict = CapabilityAdapter::with_config(
        InprocEngine::auto({
            let mut caps = Capabilities::default();
            caps.batch_transfer = true;
            caps
        }),
        AdapterConfig::strict(),
    );
    let caps = strict.capabilities();
    assert!(caps.batch_transfer && !caps.batch_register && !caps.async_batch);
    match strict.batch_register(vec![]).await {
        Err(Error::Unsupported { operation, .. }) => {
            assert_eq!(operation, Operation::BatchRegister)
        }
        other => panic!("strict batch_register: {other:?}"),
    }
    strict.require(&[Operation::BatchTransfer]).unwrap();
    match strict.require(&[
        Operation::BatchRegister,
        Operation::BatchTransfer,
        Operation::AsyncBatch,
        Operation::Notify,
    ]) {
        Err(Error::MissingCapabilities { missing, .. }) => {
            let ops: Vec<Operation> = missing.iter().map(|m| m.operation).collect();
            assert_eq!(
                ops,
                vec![
                    Operation::BatchRegister,
                    Operation::AsyncBatch,
                    Operation::Notify
                ]
            );
            let msg = strict
                .require(&[Operation::BatchRegister])
                .unwrap_err()
                .to_string();
            assert!(msg.contains("batch_register"), "{msg}");
        }
        other => panic!("require: {other:?}"),
    }
    // Not strict: everything but notifications is available.
    let lenient = CapabilityAdapter::new(InprocEngine::auto(Capabilities::default()));
    lenient
        .require(&[
            Operation::BatchRegister,
            Operation::BatchUnregister,
            Operation::BatchTransfer,
            Operation::AsyncBatch,
            Operation::BatchWait,
        ])
        .unwrap();
    assert!(lenient.require(&[Operation::Notify]).is_err());
}

#[tokio::test]
async fn the_report_says_native_emulated_or_unsupported_and_why() {
    let a = CapabilityAdapter::new(InprocEngine::auto({
        let mut caps = Capabilities::default();
        caps.batch_transfer = true;
        caps
    }));
    let report = a.report();
    assert_eq!(report.support(Operation::BatchTransfer), Support::Native);
    assert!(matches!(
        report.support(Operation::BatchRegister),
        Support::Emulated { .. }
    ));
    match report.support(Operation::Notify) {
        Support::Unsupported(m) => assert!(!m.reason.is_empty()),
        other => panic!("notify: {other:?}"),
    }
    assert!(!report.native.batch_register);
    assert!(report.effective.batch_register);
    let text = report.to_string();
    assert!(
        text.contains("batch_register") && text.contains("emulated"),
        "{text}"
    );
    assert!(text.contains("unsupported"), "{text}");
}

/// Counts `tracing` events whose message mentions emulation.
struct EmulationEvents(Arc<AtomicUsize>);

struct MessageVisitor(String);

impl tracing::field::Visit for MessageVisitor {
    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
        if field.name() == "message" {
            self.0 = format!("{value:?}");
        }
    }
}

impl tracing::Subscriber for EmulationEvents {
    fn enabled(&self, _: &tracing::Metadata<'_>) -> bool {
        true
    }
    fn new_span(&self, _: &tracing::span::Attributes<'_>) -> tracing::span::Id {
        tracing::span::Id::from_u64(1)
    }
    fn record(&self, _: &tracing::span::Id, _: &tracing::span::Record<'_>) {}
    fn record_follows_from(&self, _: &tracing::span::Id, _: &tracing::span::Id) {}
    fn event(&self, event: &tracing::Event<'_>) {
        let mut v = MessageVisitor(String::new());
        event.record(&mut v);
        if v.0.contains("emulating") {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }
    fn enter(&self, _: &tracing::span::Id) {}
    fn exit(&self, _: &tracing::span::Id) {}
}

#[test]
fn emulation_announces_itself_once_per_engine_and_operation() {
    let count = Arc::new(AtomicUsize::new(0));
    let subscriber = EmulationEvents(Arc::clone(&count));
    tracing::subscriber::with_default(subscriber, || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let r = rig(
                Probe::new(Capabilities::default()),
                Capabilities::default(),
                AdapterConfig::default(),
                4 * 512,
            )
            .await;
            for _ in 0..3 {
                let reqs = scattered(&r, 4, 512);
                r.adapter.batch_transfer(r.seg, &reqs, None).await.unwrap();
            }
            assert_eq!(count.load(Ordering::SeqCst), 1, "batch_transfer x3");
            let id = r
                .adapter
                .submit(r.seg, &scattered(&r, 4, 512), None)
                .await
                .unwrap();
            r.adapter.wait(id).await.unwrap();
            // async_batch and batch_wait announced once each.
            assert_eq!(count.load(Ordering::SeqCst), 3, "after submit + wait");
            let id = r
                .adapter
                .submit(r.seg, &scattered(&r, 4, 512), None)
                .await
                .unwrap();
            r.adapter.wait(id).await.unwrap();
            assert_eq!(count.load(Ordering::SeqCst), 3, "repeated submit + wait");
            // A second adapter announces again.
            let r2 = rig(
                Probe::new(Capabilities::default()),
                Capabilities::default(),
                AdapterConfig::default(),
                4 * 512,
            )
            .await;
            let reqs = scattered(&r2, 4, 512);
            r2.adapter
                .batch_transfer(r2.seg, &reqs, None)
                .await
                .unwrap();
            assert_eq!(count.load(Ordering::SeqCst), 4, "second engine");
        });
    });
}

/// The capability report of the default stack, as text, for every
/// combination of a few native capability sets and adapter configurations:
/// the report (`Display` and `Debug`), the effective capabilities and what
/// `require` says of every optional operation and guarantee.
fn default_stack_reports() -> String {
    let none = Capabilities::default();
    let mut batch = none;
    batch.batch_transfer = true;
    let mut chunked = batch;
    chunked.max_batch_len = Some(8);
    chunked.batch_register = true;
    let mut async_notify = none;
    async_notify.async_batch = true;
    async_notify.notify = true;
    let mut batch_notify = batch;
    batch_notify.notify = true;
    batch_notify.batch_wait = true;
    let caps_sets = [
        ("none", none),
        ("all", Capabilities::all()),
        ("batch", batch),
        ("chunked", chunked),
        ("async_notify", async_notify),
        ("batch_notify", batch_notify),
    ];
    let configs = [
        ("default", AdapterConfig::default()),
        ("strict", AdapterConfig::strict()),
        (
            "max_concurrency=3,coalesce=0",
            AdapterConfig::builder()
                .max_concurrency(3)
                .coalesce(false)
                .build()
                .unwrap(),
        ),
        (
            "no batch emulation",
            AdapterConfig::builder()
                .emulate_batch_transfer(false)
                .emulate_async_batch(false)
                .build()
                .unwrap(),
        ),
    ];
    let mut out = String::new();
    for (caps_name, caps) in caps_sets {
        for (config_name, config) in &configs {
            let name = format!(
                "golden-{caps_name}-{}",
                config_name.replace([' ', ','], "-")
            );
            let engine = InprocEngine::new(&name, caps).unwrap();
            let adapter = CapabilityAdapter::with_config(engine, config.clone());
            let report = adapter.report();
            let required: Vec<Operation> = Operation::OPTIONAL
                .into_iter()
                .chain(Operation::GUARANTEES)
                .collect();
            let require = match adapter.require(&required) {
                Ok(()) => "ok".to_owned(),
                Err(e) => e.to_string(),
            };
            out.push_str(&format!(
                "== {caps_name} / {config_name}\n{report}{report:?}\ncapabilities: {:?}\nrequire: {require}\n\n",
                adapter.capabilities()
            ));
        }
    }
    out
}

/// The report is pinned as it was before the concurrency limit left the
/// emulation layer (recorded at d2ea76d): moving a job between layers
/// changes no byte of it. `FERRY_BLESS=1` rewrites the file (for a change
/// that means to change the report).
#[test]
fn the_default_stack_report_is_unchanged() {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/golden/default_stack_report.txt"
    );
    let now = default_stack_reports();
    if std::env::var_os("FERRY_BLESS").is_some() {
        std::fs::write(path, &now).unwrap();
    }
    let pinned = std::fs::read_to_string(path).unwrap();
    assert!(now == pinned, "the report differs from {path}:\n{now}");
}

//! [`MetricsLayer`]: counts what an engine does, for Prometheus (through
//! the `prometheus-client` crate's registry and text encoder) and as a
//! plain [`MetricsSnapshot`].
//!
//! Every series carries the label `engine` (the wrapped engine's segment
//! name); the per-peer ones also `peer` (the segment name the handle was
//! opened with; beyond [`MetricsLayer::peer_limit`] distinct peers, the
//! rest count as `other`; a handle the layer did not see opened counts as
//! `unknown`). The families, in the text exposition:
//!
//! | name | type | labels | what |
//! |---|---|---|---|
//! | `ferry_transfer_bytes_total` | counter | engine, peer, op | bytes of requests that succeeded |
//! | `ferry_transfer_failed_bytes_total` | counter | engine, peer, op, result | bytes of requests that failed, by [`ErrorKind`] |
//! | `ferry_transfer_requests_total` | counter | engine, peer, op, result | requests, `ok` or failed by [`ErrorKind`] |
//! | `ferry_batch_duration_seconds` | histogram | engine, peer, call | from the call (or `submit`) to its results |
//! | `ferry_batches_in_flight` | gauge | engine | batches and transfers started, not yet finished |
//! | `ferry_registered_bytes` | gauge | engine | bytes registered through this layer |
//! | `ferry_notifications_sent_total` | counter | engine, peer | notifications of batches that succeeded |
//! | `ferry_notifications_received_total` | counter | engine | notifications taken |
//! | `ferry_queue_full_total` | counter | engine | calls or requests refused with [`ErrorKind::QueueFull`] |
//! | `ferry_emulated_operations_total` | counter | engine, operation | calls of operations the backend lacks natively (see [`MetricsLayer::native`]) |
//! | `ferry_peer_path` | gauge | engine, peer, path | 1 for the payload path to the peer (`socket`, `same-host cma`, `mooncake`…), set by [`MetricsEngine::set_peer_path`] |
//! | `ferry_served_bytes_total` | counter | engine, peer, op | bytes peers wrote into (`write`) or read from (`read`) this engine's memory through requests it served |
//! | `ferry_served_segments_total` | counter | engine, peer, op | the non-empty ranges of those requests |
//! | `ferry_notifications_dropped_total` | counter | engine, reason | notifications the inbox refused: `full` (the consumer is behind) or `closed` (shut down) |
//! | `ferry_failovers_total` | counter | engine, peer, from, to | transfers to the peer that moved from one transport to another (an engine over several transports: `ferry::multi`) |
//! | `ferry_transport_chosen` | gauge | engine, peer, transport | the open segments to the peer that each transport carries now (the same engines) |
//!
//! The `ferry_transfer_*` families count what this engine *initiated*; the
//! `ferry_served_*` ones what peers initiated against it (the target side,
//! where `peer` is the name the peer's engine gave, folded into `other`
//! beyond the peer limit as on the initiator side). They are separate
//! families, not a `role` label, so that summing `ferry_transfer_bytes_total`
//! over a cluster does not count every byte twice. The served and dropped
//! families are read from the backend's counters at scrape time
//! ([`TransferEngine::inbound`]: nothing is added on the request path by
//! the layer); a backend that cannot see inbound traffic (verbs, Mooncake,
//! NIXL: one-sided) has no served series, and one that does not count
//! dropped notifications (verbs) no dropped series.
//!
//! `op` is `read` or `write`; `call` is `transfer`, `batch_transfer` or
//! `async_batch`; `result` is `ok` or the error kind in snake case
//! (`not_registered`, `peer_lost`, `timeout`…).
//!
//! A request counts once its outcome is known: at the end of `transfer` /
//! `batch_transfer`, and for an async batch when `wait` or
//! `release_batch` returns it (a batch polled with `status` and never
//! released is not counted). A call refused as a whole counts each of its
//! requests as failed with the refusal's kind.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::sync::{Arc, Mutex, OnceLock, RwLock, Weak};
use std::time::Instant;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;

use super::peers::{op_label, Peers, OTHER, UNKNOWN};
use crate::__private::sync::{lock, read, write};
use crate::caps::{Capabilities, Operation};
use crate::engine::TransferEngine;
use crate::error::{Error, ErrorKind, Result};
use crate::inbound::{Inbound, InboundSnapshot, ServedCounts};
use crate::layer::Layer;
use crate::types::{
    BatchId, BatchReport, MemoryRegion, Notification, SegmentId, TransferOp, TransferRequest,
};

/// Distinct peers per engine that get a label of their own by default.
pub const DEFAULT_PEER_LIMIT: usize = 64;

/// The content type of [`Metrics::encode`]'s output, for an HTTP
/// response.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct EngineLabels {
    engine: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PeerLabels {
    engine: String,
    peer: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CallLabels {
    engine: String,
    peer: String,
    call: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OpLabels {
    engine: String,
    peer: String,
    op: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ResultLabels {
    engine: String,
    peer: String,
    op: &'static str,
    result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PathLabels {
    engine: String,
    peer: String,
    path: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DropLabels {
    engine: String,
    reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct FailoverLabels {
    engine: String,
    peer: String,
    from: String,
    to: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ChosenLabels {
    engine: String,
    peer: String,
    transport: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OperationLabels {
    engine: String,
    operation: &'static str,
}

type HistogramFamily = Family<CallLabels, Histogram, fn() -> Histogram>;

fn latency_histogram() -> Histogram {
    // 10 µs … ~42 s.
    Histogram::new(exponential_buckets(1e-5, 4.0, 12))
}

#[derive(Debug)]
struct Families {
    bytes: Family<OpLabels, Counter>,
    failed_bytes: Family<ResultLabels, Counter>,
    requests: Family<ResultLabels, Counter>,
    latency: HistogramFamily,
    in_flight: Family<EngineLabels, Gauge>,
    registered: Family<EngineLabels, Gauge>,
    notes_sent: Family<PeerLabels, Counter>,
    notes_received: Family<EngineLabels, Counter>,
    queue_full: Family<EngineLabels, Counter>,
    emulated: Family<OperationLabels, Counter>,
    paths: Family<PathLabels, Gauge>,
}

/// The engines wrapped with one [`Metrics`] handle.
type EngineList = Arc<Mutex<Vec<Weak<EngineState>>>>;

fn live_engines(list: &EngineList) -> Vec<Arc<EngineState>> {
    let mut list = lock(list);
    list.retain(|w| w.strong_count() > 0);
    list.iter().filter_map(Weak::upgrade).collect()
}

struct Shared {
    registry: Registry,
    families: Families,
    /// The engines wrapped with this handle, for [`Metrics::snapshots`]
    /// and the inbound families.
    engines: EngineList,
}

/// Encodes the families read from the engines' inbound counters at
/// scrape time (`ferry_served_*`, `ferry_notifications_dropped_total`).
struct InboundCollector {
    engines: EngineList,
}

impl fmt::Debug for InboundCollector {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("InboundCollector").finish_non_exhaustive()
    }
}

impl Collector for InboundCollector {
    fn encode(&self, mut encoder: DescriptorEncoder<'_>) -> std::result::Result<(), fmt::Error> {
        let mut bytes: Vec<(OpLabels, u64)> = Vec::new();
        let mut segments: Vec<(OpLabels, u64)> = Vec::new();
        let mut dropped: Vec<(DropLabels, u64)> = Vec::new();
        let mut failovers: Vec<(FailoverLabels, u64)> = Vec::new();
        let mut chosen: Vec<(ChosenLabels, u64)> = Vec::new();
        for e in live_engines(&self.engines) {
            let Some(snap) = e.inbound() else { continue };
            for ((peer, from, to), n) in snap.failovers.iter().flatten() {
                let labels = FailoverLabels {
                    engine: e.engine.clone(),
                    peer: peer.clone(),
                    from: from.clone(),
                    to: to.clone(),
                };
                failovers.push((labels, *n));
            }
            for ((peer, transport), n) in snap.transports_chosen.iter().flatten() {
                let labels = ChosenLabels {
                    engine: e.engine.clone(),
                    peer: peer.clone(),
                    transport: transport.clone(),
                };
                chosen.push((labels, *n));
            }
            for (peer, c) in snap.served.iter().flatten() {
                for (op, b, n) in [
                    ("write", c.bytes_written, c.segments_written),
                    ("read", c.bytes_read, c.segments_read),
                ] {
                    let labels = OpLabels {
                        engine: e.engine.clone(),
                        peer: peer.clone(),
                        op,
                    };
                    bytes.push((labels.clone(), b));
                    segments.push((labels, n));
                }
            }
            if let Some(d) = snap.notifications_dropped {
                for (reason, n) in [("full", d.full), ("closed", d.closed)] {
                    dropped.push((
                        DropLabels {
                            engine: e.engine.clone(),
                            reason,
                        },
                        n,
                    ));
                }
            }
        }
        encode_counters(
            &mut encoder,
            "ferry_served_bytes",
            "Bytes peers wrote into (op=write) or read from (op=read) this engine's memory through requests it served",
            &bytes,
        )?;
        encode_counters(
            &mut encoder,
            "ferry_served_segments",
            "Non-empty memory ranges of the requests this engine served for peers",
            &segments,
        )?;
        encode_counters(
            &mut encoder,
            "ferry_notifications_dropped",
            "Notifications the engine's inbox refused and dropped (full: the consumer is behind; closed: shut down)",
            &dropped,
        )?;
        encode_counters(
            &mut encoder,
            "ferry_failovers",
            "Transfers to a peer that moved from one transport to another (an engine over several transports)",
            &failovers,
        )?;
        encode_gauges(
            &mut encoder,
            "ferry_transport_chosen",
            "Open segments to a peer that each transport carries now (an engine over several transports)",
            &chosen,
        )
    }
}

/// One counter family of `rows` (nothing when there are none).
fn encode_counters<L: EncodeLabelSet>(
    encoder: &mut DescriptorEncoder<'_>,
    name: &str,
    help: &str,
    rows: &[(L, u64)],
) -> std::result::Result<(), fmt::Error> {
    if rows.is_empty() {
        return Ok(());
    }
    let counter = ConstCounter::new(0u64);
    let mut family = encoder.encode_descriptor(name, help, None, counter.metric_type())?;
    for (labels, v) in rows {
        ConstCounter::new(*v).encode(family.encode_family(labels)?)?;
    }
    Ok(())
}

/// One gauge family of `rows` (nothing when there are none).
fn encode_gauges<L: EncodeLabelSet>(
    encoder: &mut DescriptorEncoder<'_>,
    name: &str,
    help: &str,
    rows: &[(L, u64)],
) -> std::result::Result<(), fmt::Error> {
    if rows.is_empty() {
        return Ok(());
    }
    let gauge = ConstGauge::new(0i64);
    let mut family = encoder.encode_descriptor(name, help, None, gauge.metric_type())?;
    for (labels, v) in rows {
        let v = i64::try_from(*v).unwrap_or(i64::MAX);
        ConstGauge::new(v).encode(family.encode_family(labels)?)?;
    }
    Ok(())
}

/// A set of Ferry metrics: a `prometheus-client` registry shared by every
/// engine wrapped with it (cheap to clone; clones share the counters).
#[derive(Clone)]
pub struct Metrics {
    shared: Arc<Shared>,
}

impl fmt::Debug for Metrics {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Metrics").finish_non_exhaustive()
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new()
    }
}

impl Metrics {
    /// A fresh set of metrics with its own registry.
    pub fn new() -> Metrics {
        let families = Families {
            bytes: Family::default(),
            failed_bytes: Family::default(),
            requests: Family::default(),
            latency: Family::new_with_constructor(latency_histogram),
            in_flight: Family::default(),
            registered: Family::default(),
            notes_sent: Family::default(),
            notes_received: Family::default(),
            queue_full: Family::default(),
            emulated: Family::default(),
            paths: Family::default(),
        };
        let mut registry = Registry::default();
        let f = &families;
        // Counters get their `_total` suffix from the encoder.
        registry.register(
            "ferry_transfer_bytes",
            "Bytes moved by requests that succeeded",
            f.bytes.clone(),
        );
        registry.register(
            "ferry_transfer_failed_bytes",
            "Bytes of requests that failed, by error kind",
            f.failed_bytes.clone(),
        );
        registry.register(
            "ferry_transfer_requests",
            "Transfer requests by outcome (ok, or the error kind)",
            f.requests.clone(),
        );
        registry.register(
            "ferry_batch_duration_seconds",
            "Time from a transfer, batch or submit call to its results",
            f.latency.clone(),
        );
        registry.register(
            "ferry_batches_in_flight",
            "Transfers and batches started and not finished",
            f.in_flight.clone(),
        );
        registry.register(
            "ferry_registered_bytes",
            "Bytes of memory registered",
            f.registered.clone(),
        );
        registry.register(
            "ferry_notifications_sent",
            "Notifications sent with batches that succeeded",
            f.notes_sent.clone(),
        );
        registry.register(
            "ferry_notifications_received",
            "Notifications taken",
            f.notes_received.clone(),
        );
        registry.register(
            "ferry_queue_full",
            "Calls or requests refused because a bounded queue or table was full",
            f.queue_full.clone(),
        );
        registry.register(
            "ferry_emulated_operations",
            "Calls of operations the backend lacks natively (emulated by the adapter)",
            f.emulated.clone(),
        );
        registry.register(
            "ferry_peer_path",
            "1 for the payload path to each peer (socket, same-host cma, mooncake, verbs, nixl)",
            f.paths.clone(),
        );
        let engines = EngineList::default();
        registry.register_collector(Box::new(InboundCollector {
            engines: Arc::clone(&engines),
        }));
        Metrics {
            shared: Arc::new(Shared {
                registry,
                families,
                engines,
            }),
        }
    }

    /// The process-wide metrics: what `ferry::Engine::open` counts into
    /// and what `ferry serve --metrics-listen` serves.
    pub fn global() -> &'static Metrics {
        static GLOBAL: OnceLock<Metrics> = OnceLock::new();
        GLOBAL.get_or_init(Metrics::new)
    }

    /// The text exposition (OpenMetrics, which Prometheus scrapes) of every
    /// series, encoded by `prometheus-client`. Serve it with
    /// [`CONTENT_TYPE`].
    pub fn encode(&self) -> String {
        let mut out = String::new();
        // Writing into a `String` cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.shared.registry);
        out
    }

    /// The `prometheus-client` registry, to encode it another way or to
    /// serve it with an application's own metrics.
    pub fn registry(&self) -> &Registry {
        &self.shared.registry
    }

    /// A snapshot of every live engine wrapped with these metrics.
    pub fn snapshots(&self) -> Vec<MetricsSnapshot> {
        live_engines(&self.shared.engines)
            .iter()
            .map(|e| e.snapshot())
            .collect()
    }

    fn families(&self) -> &Families {
        &self.shared.families
    }
}

/// What one engine did, as plain numbers ([`MetricsEngine::snapshot`]).
#[derive(Clone, Debug, Default, PartialEq)]
#[non_exhaustive]
pub struct MetricsSnapshot {
    /// The engine label (its segment name).
    pub engine: String,
    /// Per peer label (`other` and `unknown` included when used).
    pub peers: BTreeMap<String, PeerSnapshot>,
    /// Transfers and batches in flight.
    pub batches_in_flight: i64,
    /// Bytes registered.
    pub registered_bytes: i64,
    /// Notifications taken.
    pub notifications_received: u64,
    /// Calls or requests refused with [`ErrorKind::QueueFull`].
    pub queue_full: u64,
    /// Calls of emulated operations, by operation name.
    pub emulated: BTreeMap<String, u64>,
    /// What peers did to the engine ([`TransferEngine::inbound`]), with
    /// the peers beyond the layer's limit folded into `other`; `None`
    /// where the engine counts nothing inbound.
    pub inbound: Option<InboundSnapshot>,
}

impl MetricsSnapshot {
    /// Bytes of successful requests, every peer and direction.
    pub fn bytes_total(&self) -> u64 {
        self.peers
            .values()
            .map(|p| p.bytes_written.saturating_add(p.bytes_read))
            .fold(0, u64::saturating_add)
    }

    /// Requests that succeeded, every peer.
    pub fn requests_ok(&self) -> u64 {
        self.peers
            .values()
            .map(|p| p.requests_ok)
            .fold(0, u64::saturating_add)
    }

    /// Requests that failed, every peer and kind.
    pub fn requests_failed(&self) -> u64 {
        self.peers
            .values()
            .flat_map(|p| p.requests_failed.values())
            .fold(0, |a, b| a.saturating_add(*b))
    }
}

/// One peer's numbers in a [`MetricsSnapshot`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct PeerSnapshot {
    /// Bytes written to the peer by requests that succeeded.
    pub bytes_written: u64,
    /// Bytes read from the peer by requests that succeeded.
    pub bytes_read: u64,
    /// Requests that succeeded.
    pub requests_ok: u64,
    /// Requests that failed, by error kind (`peer_lost`, `timeout`…).
    pub requests_failed: BTreeMap<String, u64>,
    /// Notifications sent with batches that succeeded.
    pub notifications_sent: u64,
    /// The payload path to the peer, where the engine said
    /// ([`MetricsEngine::set_peer_path`]).
    pub path: Option<String>,
}

/// The `result` label of an error kind.
pub fn kind_label(kind: ErrorKind) -> &'static str {
    match kind {
        ErrorKind::Unsupported => "unsupported",
        ErrorKind::NotRegistered => "not_registered",
        ErrorKind::AlreadyRegistered => "already_registered",
        ErrorKind::RegionHeld => "region_held",
        ErrorKind::InvalidArgument => "invalid_argument",
        ErrorKind::PeerUnreachable => "peer_unreachable",
        ErrorKind::UnknownHandle => "unknown_handle",
        ErrorKind::Busy => "busy",
        ErrorKind::PeerLost => "peer_lost",
        ErrorKind::Timeout => "timeout",
        ErrorKind::Protocol => "protocol",
        ErrorKind::Authentication => "authentication",
        ErrorKind::Io => "io",
        ErrorKind::Unavailable => "unavailable",
        ErrorKind::Backend => "backend",
        ErrorKind::Canceled => "canceled",
        ErrorKind::QueueFull => "queue_full",
    }
}

/// Every `result` label of a failure, for snapshots.
const FAILURE_LABELS: [&str; 17] = [
    "unsupported",
    "not_registered",
    "already_registered",
    "region_held",
    "invalid_argument",
    "peer_unreachable",
    "unknown_handle",
    "busy",
    "peer_lost",
    "timeout",
    "protocol",
    "authentication",
    "io",
    "unavailable",
    "backend",
    "canceled",
    "queue_full",
];

/// [`Layer`] that wraps engines in a [`MetricsEngine`].
#[derive(Clone, Debug)]
pub struct MetricsLayer {
    metrics: Option<Metrics>,
    peer_limit: usize,
    native: Option<Capabilities>,
}

impl MetricsLayer {
    /// Counts into `metrics`.
    pub fn new(metrics: Metrics) -> Self {
        MetricsLayer {
            metrics: Some(metrics),
            peer_limit: DEFAULT_PEER_LIMIT,
            native: None,
        }
    }

    /// A layer whose engines count nothing and forward every call: metrics
    /// switched off without changing the engine's type (what
    /// `ferry::EngineConfig::metrics(None)` uses).
    pub fn disabled() -> Self {
        MetricsLayer {
            metrics: None,
            peer_limit: DEFAULT_PEER_LIMIT,
            native: None,
        }
    }

    /// At most `limit` distinct peers get a label of their own per engine
    /// (default [`DEFAULT_PEER_LIMIT`]); the rest count as `other`.
    pub fn peer_limit(mut self, limit: usize) -> Self {
        self.peer_limit = limit;
        self
    }

    /// The backend's native capabilities (a
    /// [`CapabilityReport`](crate::CapabilityReport)'s `native`): the
    /// calls of optional operations it lacks are counted in
    /// `ferry_emulated_operations_total`. Without it (a layer cannot see
    /// through the adapter below it) nothing is counted there.
    pub fn native(mut self, native: Capabilities) -> Self {
        self.native = Some(native);
        self
    }
}

impl<E: TransferEngine> Layer<E> for MetricsLayer {
    type Engine = MetricsEngine<E>;
    fn layer(&self, inner: E) -> MetricsEngine<E> {
        let Some(metrics) = &self.metrics else {
            return MetricsEngine { inner, state: None };
        };
        let state = Arc::new(EngineState {
            metrics: metrics.clone(),
            engine: inner.segment_name().to_owned(),
            peers: Peers::new(Some(self.peer_limit)),
            regions: Mutex::new(HashMap::new()),
            paths: Mutex::new(HashMap::new()),
            pending: Mutex::new(HashMap::new()),
            native: self.native,
            inbound: inner.inbound(),
            served_peers: Peers::new(Some(self.peer_limit)),
            segments: RwLock::new(HashMap::new()),
            series: Mutex::new(HashMap::new()),
            in_flight: OnceLock::new(),
        });
        {
            let mut list = lock(&metrics.shared.engines);
            list.retain(|w| w.strong_count() > 0);
            list.push(Arc::downgrade(&state));
        }
        MetricsEngine {
            inner,
            state: Some(state),
        }
    }
}

/// The `call` label values, in [`PeerSeries::latency`]'s order.
const CALLS: [&str; 3] = ["transfer", "batch_transfer", "async_batch"];
const TRANSFER: usize = 0;
const BATCH_TRANSFER: usize = 1;
const ASYNC_BATCH: usize = 2;

/// One peer's series of the request path, as `prometheus-client` handles
/// (clones share the value), each created on its first use (so a series
/// appears with its first sample, as with `get_or_create`): after that,
/// counting a request builds no label set and allocates nothing.
struct PeerSeries {
    label: Arc<str>,
    /// `ferry_transfer_bytes_total`, write then read.
    bytes: [OnceLock<Counter>; 2],
    /// `ferry_transfer_requests_total{result="ok"}`, write then read.
    ok: [OnceLock<Counter>; 2],
    /// `ferry_batch_duration_seconds`, by [`CALLS`].
    latency: [OnceLock<Histogram>; 3],
    notes_sent: OnceLock<Counter>,
}

impl PeerSeries {
    fn new(label: Arc<str>) -> Self {
        PeerSeries {
            label,
            bytes: Default::default(),
            ok: Default::default(),
            latency: Default::default(),
            notes_sent: OnceLock::new(),
        }
    }
}

/// An async batch submitted through the layer, counted when its results
/// come back.
struct Pending {
    peer: Arc<PeerSeries>,
    requests: Vec<(TransferOp, u64)>,
    started: Instant,
    notify: bool,
}

struct EngineState {
    metrics: Metrics,
    engine: String,
    peers: Peers,
    /// Registered region start → length.
    regions: Mutex<HashMap<u64, u64>>,
    /// Peer label → its payload path.
    paths: Mutex<HashMap<Arc<str>, String>>,
    pending: Mutex<HashMap<BatchId, Pending>>,
    native: Option<Capabilities>,
    /// The backend's inbound counters, read at scrape time.
    inbound: Option<Inbound>,
    /// Segment handle → its peer's series (the request path's lookup:
    /// one read lock, no label built).
    segments: RwLock<HashMap<SegmentId, Arc<PeerSeries>>>,
    /// Peer label → its series (shared by every handle to that peer).
    series: Mutex<HashMap<Arc<str>, Arc<PeerSeries>>>,
    /// `ferry_batches_in_flight` of this engine, once created.
    in_flight: OnceLock<Gauge>,
    /// The labels of the peers that served traffic came from (bounded
    /// like `peers`, first come first labelled).
    served_peers: Peers,
}

impl EngineState {
    fn f(&self) -> &Families {
        self.metrics.families()
    }

    /// The backend's inbound counters now, the peers beyond the limit
    /// folded into `other`.
    fn inbound(&self) -> Option<InboundSnapshot> {
        let mut snap = self.inbound.as_ref()?.snapshot();
        if let Some(served) = snap.served.take() {
            let mut folded: BTreeMap<String, ServedCounts> = BTreeMap::new();
            for (peer, c) in served {
                let label = self.served_peers.label(&peer);
                let into = folded.entry(label.to_string()).or_default();
                into.bytes_written = into.bytes_written.saturating_add(c.bytes_written);
                into.bytes_read = into.bytes_read.saturating_add(c.bytes_read);
                into.segments_written = into.segments_written.saturating_add(c.segments_written);
                into.segments_read = into.segments_read.saturating_add(c.segments_read);
            }
            snap.served = Some(folded);
        }
        if let Some(failovers) = snap.failovers.take() {
            let mut folded: BTreeMap<(String, String, String), u64> = BTreeMap::new();
            for ((peer, from, to), n) in failovers {
                let label = self.peers.label(&peer).to_string();
                let into = folded.entry((label, from, to)).or_default();
                *into = into.saturating_add(n);
            }
            snap.failovers = Some(folded);
        }
        if let Some(chosen) = snap.transports_chosen.take() {
            let mut folded: BTreeMap<(String, String), u64> = BTreeMap::new();
            for ((peer, transport), n) in chosen {
                let label = self.peers.label(&peer).to_string();
                let into = folded.entry((label, transport)).or_default();
                *into = into.saturating_add(n);
            }
            snap.transports_chosen = Some(folded);
        }
        Some(snap)
    }

    fn engine_labels(&self) -> EngineLabels {
        EngineLabels {
            engine: self.engine.clone(),
        }
    }

    fn flight(&self) -> &Gauge {
        self.in_flight.get_or_init(|| {
            self.f()
                .in_flight
                .get_or_create(&self.engine_labels())
                .clone()
        })
    }

    /// The series of the peer labelled `label`.
    fn series_of(&self, label: Arc<str>) -> Arc<PeerSeries> {
        let mut series = lock(&self.series);
        Arc::clone(
            series
                .entry(Arc::clone(&label))
                .or_insert_with(|| Arc::new(PeerSeries::new(label))),
        )
    }

    /// Records that `segment` reaches the peer called `name`.
    fn opened(&self, segment: SegmentId, name: &str) {
        self.peers.opened(segment, name);
        let series = self.series_of(self.peers.of(segment));
        write(&self.segments).insert(segment, series);
    }

    fn closed(&self, segment: SegmentId) {
        self.peers.closed(segment);
        write(&self.segments).remove(&segment);
    }

    /// The series of the peer behind `segment` (`unknown` for a handle
    /// this layer did not see opened).
    fn peer_series(&self, segment: SegmentId) -> Arc<PeerSeries> {
        if let Some(s) = read(&self.segments).get(&segment) {
            return Arc::clone(s);
        }
        self.series_of(Arc::from(UNKNOWN))
    }

    /// Records one `transfer` that ended with `r`, and
    /// hands `r` back.
    fn transfer_done(
        &self,
        segment: SegmentId,
        request: TransferRequest,
        r: Result<()>,
        started: Instant,
    ) -> Result<()> {
        self.transfer_done_in(&self.peer_series(segment), request, r, started)
    }

    /// [`Self::transfer_done`] into `series`, the segment's.
    fn transfer_done_in(
        &self,
        series: &PeerSeries,
        request: TransferRequest,
        r: Result<()>,
        started: Instant,
    ) -> Result<()> {
        let results = [r];
        self.record(
            series,
            TRANSFER,
            std::iter::once((request.op, request.len)),
            Ok(&results),
            started,
            false,
        );
        let [r] = results;
        r
    }

    fn in_flight(&self) -> InFlight<'_> {
        self.flight().inc();
        InFlight(self)
    }

    fn emulated(&self, op: Operation) {
        if self.native.is_some_and(|n| !n.supports(op)) {
            self.f()
                .emulated
                .get_or_create(&OperationLabels {
                    engine: self.engine.clone(),
                    operation: op.name(),
                })
                .inc();
        }
    }

    fn refused<T>(&self, r: Result<T>) -> Result<T> {
        if let Err(e) = &r {
            self.queue_full(e);
        }
        r
    }

    fn queue_full(&self, e: &Error) {
        if e.kind() == ErrorKind::QueueFull {
            self.f()
                .queue_full
                .get_or_create(&self.engine_labels())
                .inc();
        }
    }

    /// Counts the outcome of `requests` (`results` in the same order, or
    /// the refusal of them all) and the time since `started`.
    fn record<'a>(
        &self,
        peer: &PeerSeries,
        call: usize,
        requests: impl Iterator<Item = (TransferOp, u64)>,
        results: std::result::Result<&'a [Result<()>], &'a Error>,
        started: Instant,
        notify: bool,
    ) {
        let f = self.f();
        let mut ok = [(0u64, 0u64); 2];
        let mut failed: Vec<(usize, &'static str, u64, u64)> = Vec::new();
        let mut all_ok = true;
        for (i, (op, len)) in requests.enumerate() {
            let o = usize::from(op == TransferOp::Read);
            let err = match results {
                Ok(results) => results.get(i).and_then(|r| r.as_ref().err()),
                Err(e) => Some(e),
            };
            match err {
                None => {
                    ok[o].0 = ok[o].0.saturating_add(len);
                    ok[o].1 += 1;
                }
                Some(e) => {
                    all_ok = false;
                    if results.is_ok() {
                        self.queue_full(e);
                    }
                    let label = kind_label(e.kind());
                    match failed.iter_mut().find(|x| x.0 == o && x.1 == label) {
                        Some(x) => {
                            x.2 = x.2.saturating_add(len);
                            x.3 += 1;
                        }
                        None => failed.push((o, label, len, 1)),
                    }
                }
            }
        }
        let ops = [TransferOp::Write, TransferOp::Read];
        for (o, (bytes, count)) in ok.into_iter().enumerate() {
            if count == 0 {
                continue;
            }
            let op = op_label(ops[o]);
            peer.bytes[o]
                .get_or_init(|| {
                    f.bytes
                        .get_or_create(&OpLabels {
                            engine: self.engine.clone(),
                            peer: peer.label.to_string(),
                            op,
                        })
                        .clone()
                })
                .inc_by(bytes);
            peer.ok[o]
                .get_or_init(|| {
                    f.requests
                        .get_or_create(&ResultLabels {
                            engine: self.engine.clone(),
                            peer: peer.label.to_string(),
                            op,
                            result: "ok",
                        })
                        .clone()
                })
                .inc_by(count);
        }
        for (o, result, bytes, count) in failed {
            let labels = ResultLabels {
                engine: self.engine.clone(),
                peer: peer.label.to_string(),
                op: op_label(ops[o]),
                result,
            };
            f.failed_bytes.get_or_create(&labels).inc_by(bytes);
            f.requests.get_or_create(&labels).inc_by(count);
        }
        if let Err(e) = results {
            self.queue_full(e);
        }
        if notify && all_ok && results.is_ok() {
            peer.notes_sent
                .get_or_init(|| {
                    f.notes_sent
                        .get_or_create(&PeerLabels {
                            engine: self.engine.clone(),
                            peer: peer.label.to_string(),
                        })
                        .clone()
                })
                .inc();
        }
        peer.latency[call]
            .get_or_init(|| {
                f.latency
                    .get_or_create(&CallLabels {
                        engine: self.engine.clone(),
                        peer: peer.label.to_string(),
                        call: CALLS[call],
                    })
                    .clone()
            })
            .observe(started.elapsed().as_secs_f64());
    }

    /// Counts the results of an async batch submitted through the layer.
    fn finish_batch(&self, batch: BatchId, results: std::result::Result<&[Result<()>], &Error>) {
        let Some(p) = lock(&self.pending).remove(&batch) else {
            return;
        };
        self.record(
            &p.peer,
            ASYNC_BATCH,
            p.requests.into_iter(),
            results,
            p.started,
            p.notify,
        );
        self.flight().dec();
    }

    fn registered(&self, addr: u64, len: u64) {
        lock(&self.regions).insert(addr, len);
        self.f()
            .registered
            .get_or_create(&self.engine_labels())
            .inc_by(i64::try_from(len).unwrap_or(i64::MAX));
    }

    fn unregistered(&self, addr: u64) {
        if let Some(len) = lock(&self.regions).remove(&addr) {
            self.f()
                .registered
                .get_or_create(&self.engine_labels())
                .dec_by(i64::try_from(len).unwrap_or(i64::MAX));
        }
    }

    fn snapshot(&self) -> MetricsSnapshot {
        let f = self.f();
        let engine = || EngineLabels {
            engine: self.engine.clone(),
        };
        let gauge = |fam: &Family<EngineLabels, Gauge>| fam.get(&engine()).map_or(0, |g| g.get());
        let counter =
            |fam: &Family<EngineLabels, Counter>| fam.get(&engine()).map_or(0, |c| c.get());
        let mut peers = BTreeMap::new();
        let mut names: Vec<String> = self.peers.known().iter().map(|s| s.to_string()).collect();
        names.push(OTHER.to_owned());
        names.push(UNKNOWN.to_owned());
        for peer in names {
            let mut p = PeerSnapshot::default();
            for (op, slot) in [("write", &mut p.bytes_written), ("read", &mut p.bytes_read)] {
                let labels = OpLabels {
                    engine: self.engine.clone(),
                    peer: peer.clone(),
                    op,
                };
                *slot = f.bytes.get(&labels).map_or(0, |c| c.get());
            }
            for op in ["write", "read"] {
                let mut labels = ResultLabels {
                    engine: self.engine.clone(),
                    peer: peer.clone(),
                    op,
                    result: "ok",
                };
                p.requests_ok += f.requests.get(&labels).map_or(0, |c| c.get());
                for result in FAILURE_LABELS {
                    labels.result = result;
                    if let Some(n) = f.requests.get(&labels).map(|c| c.get()) {
                        *p.requests_failed.entry(result.to_owned()).or_default() += n;
                    }
                }
            }
            p.notifications_sent = f
                .notes_sent
                .get(&PeerLabels {
                    engine: self.engine.clone(),
                    peer: peer.clone(),
                })
                .map_or(0, |c| c.get());
            p.path = lock(&self.paths).get(peer.as_str()).cloned();
            if p != PeerSnapshot::default() {
                peers.insert(peer, p);
            }
        }
        let mut emulated = BTreeMap::new();
        for op in Operation::OPTIONAL {
            let labels = OperationLabels {
                engine: self.engine.clone(),
                operation: op.name(),
            };
            if let Some(c) = f.emulated.get(&labels) {
                emulated.insert(op.name().to_owned(), c.get());
            }
        }
        MetricsSnapshot {
            engine: self.engine.clone(),
            peers,
            batches_in_flight: gauge(&f.in_flight),
            registered_bytes: gauge(&f.registered),
            notifications_received: counter(&f.notes_received),
            queue_full: counter(&f.queue_full),
            emulated,
            inbound: self.inbound(),
        }
    }
}

impl Drop for EngineState {
    /// The engine is gone: its series leave the exposition (a scrape no
    /// longer shows them; Prometheus ends them), so that a process that
    /// opens engines over time does not keep every one it ever had.
    fn drop(&mut self) {
        let f = self.f();
        let engine = self.engine.clone();
        let mut names: Vec<String> = self.peers.known().iter().map(|s| s.to_string()).collect();
        names.push(OTHER.to_owned());
        names.push(UNKNOWN.to_owned());
        for peer in names {
            for op in ["write", "read"] {
                f.bytes.remove(&OpLabels {
                    engine: engine.clone(),
                    peer: peer.clone(),
                    op,
                });
                for result in FAILURE_LABELS.into_iter().chain(["ok"]) {
                    let labels = ResultLabels {
                        engine: engine.clone(),
                        peer: peer.clone(),
                        op,
                        result,
                    };
                    f.requests.remove(&labels);
                    f.failed_bytes.remove(&labels);
                }
            }
            for call in CALLS {
                f.latency.remove(&CallLabels {
                    engine: engine.clone(),
                    peer: peer.clone(),
                    call,
                });
            }
            f.notes_sent.remove(&PeerLabels {
                engine: engine.clone(),
                peer: peer.clone(),
            });
        }
        for (peer, path) in crate::__private::sync::get_mut(&mut self.paths).drain() {
            self.metrics.families().paths.remove(&PathLabels {
                engine: engine.clone(),
                peer: peer.to_string(),
                path,
            });
        }
        let f = self.f();
        for op in Operation::OPTIONAL {
            f.emulated.remove(&OperationLabels {
                engine: engine.clone(),
                operation: op.name(),
            });
        }
        let labels = EngineLabels { engine };
        f.in_flight.remove(&labels);
        f.registered.remove(&labels);
        f.notes_received.remove(&labels);
        f.queue_full.remove(&labels);
    }
}

/// Counts one transfer or batch in flight until dropped.
struct InFlight<'a>(&'a EngineState);

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.flight().dec();
    }
}

/// Counts what its inner engine does into a [`Metrics`] (see the module
/// docs for the series). Capabilities are the inner engine's. Made by
/// [`MetricsLayer::disabled`], it forwards every call and counts nothing.
pub struct MetricsEngine<E> {
    inner: E,
    state: Option<Arc<EngineState>>,
}

impl<E: TransferEngine> fmt::Debug for MetricsEngine<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MetricsEngine")
            .field("backend", &self.inner.backend_name())
            .field("counting", &self.state.is_some())
            .finish_non_exhaustive()
    }
}

accessors!(MetricsEngine);

impl<E> MetricsEngine<E> {
    /// `path` (a [`FastPath`](crate::FastPath) of `segment` under this
    /// layer) counting into this layer's metrics as `transfer` does: a
    /// call the path carried out is counted once, one it declined is not
    /// (the `transfer` that follows is).
    pub fn wrap_fast(&self, segment: SegmentId, path: crate::FastPath) -> crate::FastPath {
        let Some(s) = self.state.clone() else {
            return path;
        };
        // A segment's series is fixed from its `open_segment` to its
        // `close_segment` (after which the path declines everything):
        // looked up once here rather than at every call.
        let series = s.peer_series(segment);
        crate::FastPath::new(move |request, call| {
            let _flight = s.in_flight();
            let started = Instant::now();
            let r = path.try_call(request, call)?;
            Some(match call {
                crate::FastCall::Transfer => s.transfer_done_in(&series, *request, r, started),
                // As `batch_transfer` counts a batch of one.
                _ => {
                    s.emulated(Operation::BatchTransfer);
                    let results = [r];
                    s.record(
                        &series,
                        BATCH_TRANSFER,
                        std::iter::once((request.op, request.len)),
                        Ok(&results),
                        started,
                        false,
                    );
                    let [r] = results;
                    r
                }
            })
        })
    }

    /// The metrics this engine counts into (`None` when disabled).
    pub fn metrics(&self) -> Option<&Metrics> {
        self.state.as_ref().map(|s| &s.metrics)
    }
}

impl<E: TransferEngine> MetricsEngine<E> {
    /// This engine's numbers now (all zero when disabled).
    pub fn snapshot(&self) -> MetricsSnapshot {
        match &self.state {
            Some(s) => s.snapshot(),
            None => MetricsSnapshot {
                engine: self.inner.segment_name().to_owned(),
                ..MetricsSnapshot::default()
            },
        }
    }

    /// Records that the payload to the peer called `name` takes `path`
    /// (the `ferry_peer_path` series; a path set before for that peer is
    /// replaced). Peers folded into `other` are not recorded.
    pub fn set_peer_path(&self, name: &str, path: &str) {
        let Some(s) = &self.state else {
            return;
        };
        let peer = s.peers.label(name);
        if &*peer == OTHER {
            return;
        }
        let labels = |path: String| PathLabels {
            engine: s.engine.clone(),
            peer: peer.to_string(),
            path,
        };
        let mut paths = lock(&s.paths);
        if let Some(old) = paths.insert(Arc::clone(&peer), path.to_owned()) {
            if old == path {
                return;
            }
            s.f().paths.remove(&labels(old));
        }
        s.f().paths.get_or_create(&labels(path.to_owned())).set(1);
    }

    /// Forgets the async batches whose ids the engine no longer knows
    /// (dropped by the caller and reclaimed by the engine): without it
    /// the table would grow with every batch never waited for. Runs only
    /// when the table holds as many as the engine can have live.
    fn prune_pending(&self, s: &EngineState) {
        let ids: Vec<BatchId> = {
            let pending = lock(&s.pending);
            if pending.len() < crate::MAX_LIVE_BATCHES {
                return;
            }
            pending.keys().copied().collect()
        };
        let gone: Vec<BatchId> = ids
            .into_iter()
            .filter(|id| self.inner.status(*id).is_err())
            .collect();
        let mut pending = lock(&s.pending);
        for id in gone {
            if pending.remove(&id).is_some() {
                s.flight().dec();
            }
        }
    }
}

#[deny(clippy::missing_trait_methods)]
impl<E: TransferEngine> TransferEngine for MetricsEngine<E> {
    forward!(
        backend_name,
        segment_name,
        capabilities,
        backend_info,
        status,
        live_batches,
        inbound,
        shutdown
    );

    async fn register(&self, region: MemoryRegion) -> Result<()> {
        let Some(s) = &self.state else {
            return self.inner.register(region).await;
        };
        let (addr, len) = (region.addr(), region.len());
        s.refused(self.inner.register(region).await)?;
        s.registered(addr, len);
        Ok(())
    }

    async fn unregister(&self, addr: u64) -> Result<()> {
        self.inner.unregister(addr).await?;
        if let Some(s) = &self.state {
            s.unregistered(addr);
        }
        Ok(())
    }

    async fn batch_register(&self, regions: Vec<MemoryRegion>) -> Result<()> {
        let Some(s) = &self.state else {
            return self.inner.batch_register(regions).await;
        };
        s.emulated(Operation::BatchRegister);
        let spans: Vec<(u64, u64)> = regions.iter().map(|r| (r.addr(), r.len())).collect();
        s.refused(self.inner.batch_register(regions).await)?;
        for (addr, len) in spans {
            s.registered(addr, len);
        }
        Ok(())
    }

    async fn batch_unregister(&self, addrs: &[u64]) -> Result<()> {
        let Some(s) = &self.state else {
            return self.inner.batch_unregister(addrs).await;
        };
        s.emulated(Operation::BatchUnregister);
        let r = self.inner.batch_unregister(addrs).await;
        // Every address is attempted; on an error the layer cannot tell
        // which ones went, and keeps counting them as registered.
        if r.is_ok() {
            for &addr in addrs {
                s.unregistered(addr);
            }
        }
        r
    }

    async fn open_segment(&self, name: &str) -> Result<SegmentId> {
        let segment = self.inner.open_segment(name).await?;
        if let Some(s) = &self.state {
            s.opened(segment, name);
        }
        Ok(segment)
    }

    async fn close_segment(&self, segment: SegmentId) -> Result<()> {
        self.inner.close_segment(segment).await?;
        if let Some(s) = &self.state {
            s.closed(segment);
        }
        Ok(())
    }

    async fn transfer(&self, segment: SegmentId, request: TransferRequest) -> Result<()> {
        let Some(s) = &self.state else {
            return self.inner.transfer(segment, request).await;
        };
        let _flight = s.in_flight();
        let started = Instant::now();
        s.transfer_done(
            segment,
            request,
            self.inner.transfer(segment, request).await,
            started,
        )
    }

    async fn batch_transfer(
        &self,
        segment: SegmentId,
        requests: &[TransferRequest],
        notify: Option<&Notification>,
    ) -> Result<BatchReport> {
        let Some(s) = &self.state else {
            return self.inner.batch_transfer(segment, requests, notify).await;
        };
        s.emulated(Operation::BatchTransfer);
        let _flight = s.in_flight();
        let started = Instant::now();
        let r = self.inner.batch_transfer(segment, requests, notify).await;
        let results = match &r {
            Ok(report) => Ok(&report.results[..]),
            Err(e) => Err(e),
        };
        s.record(
            &s.peer_series(segment),
            BATCH_TRANSFER,
            requests.iter().map(|r| (r.op, r.len)),
            results,
            started,
            notify.is_some(),
        );
        r
    }

    async fn submit(
        &self,
        segment: SegmentId,
        requests: &[TransferRequest],
        notify: Option<&Notification>,
    ) -> Result<BatchId> {
        let Some(s) = &self.state else {
            return self.inner.submit(segment, requests, notify).await;
        };
        s.emulated(Operation::AsyncBatch);
        let started = Instant::now();
        let peer = s.peer_series(segment);
        match self.inner.submit(segment, requests, notify).await {
            Ok(id) => {
                self.prune_pending(s);
                s.flight().inc();
                lock(&s.pending).insert(
                    id,
                    Pending {
                        peer,
                        requests: requests.iter().map(|r| (r.op, r.len)).collect(),
                        started,
                        notify: notify.is_some(),
                    },
                );
                Ok(id)
            }
            Err(e) => {
                s.record(
                    &peer,
                    ASYNC_BATCH,
                    requests.iter().map(|r| (r.op, r.len)),
                    Err(&e),
                    started,
                    false,
                );
                Err(e)
            }
        }
    }

    async fn wait(&self, batch: BatchId) -> Result<BatchReport> {
        let Some(s) = &self.state else {
            return self.inner.wait(batch).await;
        };
        s.emulated(Operation::BatchWait);
        let r = self.inner.wait(batch).await;
        match &r {
            Ok(report) => s.finish_batch(batch, Ok(&report.results)),
            // Not a batch of this engine's (any more): nothing to count.
            Err(e) if e.kind() == ErrorKind::UnknownHandle => {}
            Err(e) => s.finish_batch(batch, Err(e)),
        }
        r
    }

    async fn release_batch(&self, batch: BatchId) -> Result<()> {
        let Some(s) = &self.state else {
            return self.inner.release_batch(batch).await;
        };
        // The results, if the batch is finished (release refuses it
        // otherwise).
        let report = self.inner.status(batch).ok().and_then(|st| st.to_report());
        self.inner.release_batch(batch).await?;
        match report {
            Some(report) => s.finish_batch(batch, Ok(&report.results)),
            None => {
                // Released without results to count: stop tracking it.
                if lock(&s.pending).remove(&batch).is_some() {
                    s.flight().dec();
                }
            }
        }
        Ok(())
    }

    async fn take_notifications(&self) -> Result<Vec<Notification>> {
        let notes = self.inner.take_notifications().await?;
        if let Some(s) = self.state.as_ref().filter(|_| !notes.is_empty()) {
            s.f()
                .notes_received
                .get_or_create(&s.engine_labels())
                .inc_by(notes.len() as u64);
        }
        Ok(notes)
    }

    async fn next_notification(&self, name: Option<&str>) -> Result<Notification> {
        let note = self.inner.next_notification(name).await?;
        if let Some(s) = &self.state {
            s.f().notes_received.get_or_create(&s.engine_labels()).inc();
        }
        Ok(note)
    }
}

#[cfg(test)]
mod tests;

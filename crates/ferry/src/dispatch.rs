//! [`Engine`]: one type over every backend compiled in, each wrapped in the
//! default stack of layers (tracing, metrics, capability adapter).

use ferry_core::DynTransferEngine;
use std::sync::Arc;

use ferry_core::layer::{MetricsEngine, MetricsSnapshot, TracingEngine};
use ferry_core::{
    AdapterConfig, BackendInfo, BatchId, BatchReport, BatchStatus, Capabilities, CapabilityAdapter,
    CapabilityReport, Layer, MemoryRegion, Metrics, MetricsLayer, Notification, Operation, Result,
    SegmentId, TracingLayer, TransferEngine, TransferRequest,
};

use crate::config::{BackendConfig, BackendKind, EngineConfig};
use crate::discovery::{Discovery, Etcd, Target};

/// The default stack over a backend `B`, outermost first: a
/// [`TracingEngine`] (a span per batch), a [`MetricsEngine`] (counters
/// into [`EngineConfig::metrics`]) and the [`CapabilityAdapter`] (itself
/// coalescing over emulation over the concurrency limit of emulated
/// batches, see [`ferry_core::adapter`]). Either
/// observing layer may be switched off in the [`EngineConfig`]; the type
/// stays the same.
pub type Stack<B> = TracingEngine<MetricsEngine<CapabilityAdapter<B>>>;

/// A started engine of whichever backend the configuration named, wrapped
/// in the default [`Stack`]: a [`CapabilityAdapter`] so that every
/// [`TransferEngine`] operation is available (natively, emulated, or
/// refused with a reason in strict mode), metrics ([`Engine::metrics`])
/// and a `tracing` span per batch. [`Engine::layer`] stacks more.
///
/// Dispatch is static: one variant of a private enum per backend compiled
/// in (cargo features `tcp`, `mooncake`, `verbs`, `nixl`). Users who pick a
/// backend at run time and prefer a trait object can use
/// `Arc<dyn DynTransferEngine>` (see [`Engine::into_dyn`]).
///
/// With segment discovery ([`EngineConfig::discovery`], `metadata=etcd://…`,
/// cargo feature `etcd`) the engine also holds its etcd publication:
/// `open_segment` resolves a logical name (one without `:`) through etcd
/// and follows it with a watch (a peer that re-registers at a new address
/// is reconnected to at the next transfer; one whose lease ended fails
/// transfers with `SegmentUnavailable` naming the segment and the lease),
/// and `shutdown` revokes the lease.
pub struct Engine {
    backend: Backend,
    /// The etcd publication, with `metadata=etcd://…`. Only
    /// `open_segment` of a logical name and `shutdown` use it.
    discovery: Option<Discovery>,
}

/// The backend in its [`Stack`].
enum Backend {
    /// The TCP backend.
    #[cfg(feature = "tcp")]
    Tcp(Stack<ferry_tcp::TcpEngine>),
    /// The Mooncake backend.
    #[cfg(feature = "mooncake")]
    Mooncake(Stack<ferry_mooncake::MooncakeEngine>),
    /// The verbs backend.
    #[cfg(feature = "verbs")]
    Verbs(Stack<ferry_verbs::VerbsEngine>),
    /// The NIXL backend.
    #[cfg(feature = "nixl")]
    Nixl(Stack<ferry_nixl::NixlEngine>),
}

// Why a macro and not `enum_dispatch`: `enum_dispatch` generates the impl
// only when it sees the trait definition, i.e. when the trait and the enum
// live in one crate (`TransferEngine` lives in ferry-core), and our
// trait methods are `async-trait` methods whose signatures it would have to
// see after expansion. This macro is the whole dispatcher: one `match` arm
// per compiled-in variant. With no backend compiled in, the enum is empty
// and `match $self.backend {}` is exhaustive.
macro_rules! dispatch {
    ($self:expr, $e:ident => $body:expr) => {
        match $self.backend {
            #[cfg(feature = "tcp")]
            Backend::Tcp(ref $e) => $body,
            #[cfg(feature = "mooncake")]
            Backend::Mooncake(ref $e) => $body,
            #[cfg(feature = "verbs")]
            Backend::Verbs(ref $e) => $body,
            #[cfg(feature = "nixl")]
            Backend::Nixl(ref $e) => $body,
        }
    };
}

/// The capability adapter at the bottom of the stack.
macro_rules! adapter {
    ($self:expr, $a:ident => $body:expr) => {
        dispatch!($self, e => {
            let $a = e.get_ref().get_ref();
            $body
        })
    };
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        dispatch!(self, e => f.debug_tuple("Engine").field(e).finish())
    }
}

impl Engine {
    /// Parses `url` (see [`EngineConfig`] for the schemes and parameters) and
    /// starts the engine.
    ///
    /// ```no_run
    /// # async fn demo() -> ferry::Result<()> {
    /// let engine = ferry::Engine::open("tcp://127.0.0.1:0?strict=1").await?;
    /// println!("peers reach me at {}", ferry::TransferEngine::segment_name(&engine));
    /// # Ok(()) }
    /// ```
    ///
    /// Errors: everything [`EngineConfig::from_url`] and [`Engine::start`]
    /// return.
    ///
    /// # Trust
    ///
    /// The URL is configuration, to be taken from the operator only: a
    /// `mooncake://` URL's `lib=` (or, without it, the `FERRY_MOONCAKE_LIB`
    /// environment variable) chooses a shared library that is loaded and run
    /// inside this process (so do a `nixl://` URL's `lib=` and
    /// `FERRY_NIXL_LIB`). Never build one from a peer's or a request's
    /// input.
    pub async fn open(url: &str) -> Result<Engine> {
        Engine::start(EngineConfig::from_url(url)?).await
    }

    /// Starts the backend `config` names, wraps it in the capability adapter
    /// and checks `config.require`. With [`EngineConfig::discovery`] it
    /// connects to etcd first, and publishes the segment's descriptor (the
    /// logical name, the segment name as the address, the protocol range
    /// where the backend reports one; nothing secret) once the backend runs.
    ///
    /// Errors: the backend's start-up error (e.g. [`ferry_core::Error::Unavailable`]
    /// on a machine without the library or device); [`ferry_core::Error::MissingCapabilities`]
    /// when a required operation is not available; with discovery,
    /// [`ferry_core::Error::Unavailable`] when etcd does not answer (or this
    /// build lacks the `etcd` feature) and [`ferry_core::Error::InvalidArgument`]
    /// naming the segment when another engine holds the logical name (the
    /// backend is shut down again: nothing is left running).
    pub async fn start(config: EngineConfig) -> Result<Engine> {
        let EngineConfig {
            backend,
            adapter,
            require,
            metrics,
            tracing,
            discovery,
        } = config;
        let etcd = match &discovery {
            Some(_) if !matches!(backend.kind(), BackendKind::Tcp | BackendKind::Verbs) => {
                return Err(ferry_core::Error::InvalidArgument(format!(
                    "etcd discovery is for Ferry's own transports (tcp://, verbs://), not {}://",
                    backend.kind()
                )));
            }
            Some(d) => Some(Etcd::connect(d).await?),
            None => None,
        };
        let observe = Observe { metrics, tracing };
        let backend: Backend = match backend {
            #[cfg(feature = "tcp")]
            BackendConfig::Tcp(c) => Backend::Tcp(observe.stack(CapabilityAdapter::with_config(
                ferry_tcp::TcpEngine::start(c).await?,
                adapter,
            ))),
            #[cfg(feature = "mooncake")]
            BackendConfig::Mooncake(mut c) => {
                // Strict mode emulates nothing, including the backend's own
                // confirmation of landed writes, unless asked for by name.
                c.confirm_writes = c.confirm_writes.or(Some(!adapter.strict));
                // The URL's `lib=` (or FERRY_MOONCAKE_LIB) names the library;
                // `Engine::open` documents that the configuration chooses
                // native code run in this process.
                let engine = ferry_mooncake::MooncakeEngine::start_trusted(
                    c,
                    ferry_mooncake::LibraryTrust::OperatorConfigured,
                )
                .await?;
                Backend::Mooncake(observe.stack(CapabilityAdapter::with_config(engine, adapter)))
            }
            #[cfg(feature = "verbs")]
            BackendConfig::Verbs(c) => Backend::Verbs(observe.stack(
                CapabilityAdapter::with_config(ferry_verbs::VerbsEngine::start(c).await?, adapter),
            )),
            // As for Mooncake: the URL's `lib=` (or FERRY_NIXL_LIB, the
            // loader path, the active Python's wheel) is the operator's.
            #[cfg(feature = "nixl")]
            BackendConfig::Nixl(c) => Backend::Nixl(
                observe.stack(CapabilityAdapter::with_config(
                    ferry_nixl::NixlEngine::start_trusted(
                        c,
                        ferry_nixl::LibraryTrust::OperatorConfigured,
                    )
                    .await?,
                    adapter,
                )),
            ),
        };
        let mut engine = Engine {
            backend,
            discovery: None,
        };
        engine.require(&require)?;
        if let Some(etcd) = etcd {
            engine.publish(etcd).await?;
        }
        tracing::debug!(
            backend = engine.kind().scheme(),
            segment = engine.segment_name(),
            published = engine.published_name(),
            "ferry engine started"
        );
        Ok(engine)
    }

    /// Publishes this engine in etcd; on failure shuts the backend down.
    #[cfg(feature = "etcd")]
    async fn publish(&mut self, etcd: Etcd) -> Result<()> {
        let address = self.segment_name().to_owned();
        let protocol = match self.backend {
            #[cfg(feature = "tcp")]
            Backend::Tcp(_) => {
                let ours = crate::VersionRange::OURS;
                ferry_discovery::ProtocolRange {
                    min: ours.min.into(),
                    max: ours.max.into(),
                }
            }
            // A backend that does not report its range publishes 0..=0.
            #[allow(unreachable_patterns)]
            _ => ferry_discovery::ProtocolRange { min: 0, max: 0 },
        };
        let unspecified = address
            .parse::<std::net::SocketAddr>()
            .is_ok_and(|a| a.ip().is_unspecified());
        let published = if unspecified {
            Err(ferry_core::Error::InvalidArgument(format!(
                "etcd discovery: the engine listens on {address}, which peers cannot \
                 connect to; listen on the address peers use"
            )))
        } else {
            let descriptor =
                ferry_discovery::Descriptor::new(address.clone(), vec![address], protocol);
            etcd.publish(descriptor).await
        };
        match published {
            Ok(d) => {
                self.discovery = Some(d);
                Ok(())
            }
            Err(e) => {
                if let Err(s) = dispatch!(self, e => TransferEngine::shutdown(e).await) {
                    tracing::warn!(error = %s, "ferry: shutdown after a failed etcd publication");
                }
                Err(e)
            }
        }
    }

    #[cfg(not(feature = "etcd"))]
    async fn publish(&mut self, etcd: Etcd) -> Result<()> {
        match etcd {}
    }

    /// The logical name this engine publishes in etcd
    /// ([`EngineConfig::discovery`]; still given after
    /// [`TransferEngine::shutdown`] revoked it); `None` without discovery.
    pub fn published_name(&self) -> Option<&str> {
        self.discovery.as_ref().map(Discovery::name)
    }

    /// Which backend this is.
    pub fn kind(&self) -> BackendKind {
        match self.backend {
            #[cfg(feature = "tcp")]
            Backend::Tcp(_) => BackendKind::Tcp,
            #[cfg(feature = "mooncake")]
            Backend::Mooncake(_) => BackendKind::Mooncake,
            #[cfg(feature = "verbs")]
            Backend::Verbs(_) => BackendKind::Verbs,
            #[cfg(feature = "nixl")]
            Backend::Nixl(_) => BackendKind::Nixl,
        }
    }

    /// The capability report: native and effective capabilities and, per
    /// optional operation, native / emulated / unsupported with the reason
    /// and the version that would make it native.
    pub fn report(&self) -> CapabilityReport {
        adapter!(self, a => a.report())
    }

    /// Start-up check: `Ok` if every operation in `ops` is available
    /// (natively, or emulated unless strict), else
    /// [`ferry_core::Error::MissingCapabilities`] naming each missing one.
    pub fn require(&self, ops: &[Operation]) -> Result<()> {
        adapter!(self, a => a.require(ops))
    }

    /// The adapter configuration in force (strict mode, coalescing…).
    pub fn adapter_config(&self) -> &AdapterConfig {
        adapter!(self, a => a.config())
    }

    /// What this engine negotiated with the peer segment `name` (opened
    /// with `open_segment`) on its latest connection: both version ranges,
    /// the version in use, each optional feature on or off and why, and
    /// the payload path — for a serving stack to log at connection time.
    /// `None` if the segment is not open, or for a backend that does not
    /// negotiate (Mooncake speaks the installed library's protocol).
    #[cfg(feature = "tcp")]
    pub fn peer_report(&self, name: &str) -> Option<crate::PeerReport> {
        match self.backend {
            #[cfg(feature = "tcp")]
            Backend::Tcp(ref e) => e.get_ref().get_ref().get_ref().peer_report(name),
            #[allow(unreachable_patterns)]
            _ => {
                let _ = name;
                None
            }
        }
    }

    /// This engine's metrics now: bytes and requests per peer and outcome,
    /// batches in flight, registered bytes, notifications, emulated
    /// operations (all zero when [`EngineConfig::metrics`] was `None`).
    pub fn metrics(&self) -> MetricsSnapshot {
        dispatch!(self, e => e.get_ref().snapshot())
    }

    /// The registry this engine counts into ([`Metrics::encode`] gives
    /// the Prometheus text exposition); `None` when metrics are off.
    pub fn metrics_registry(&self) -> Option<&Metrics> {
        dispatch!(self, e => e.get_ref().metrics())
    }

    /// Wraps this engine in `layer` (tower's shape): a layer of the user's
    /// own, or one of [`ferry_core::layer`]'s, e.g. a
    /// [`TimeoutLayer`](ferry_core::TimeoutLayer):
    ///
    /// ```no_run
    /// # async fn demo() -> ferry::Result<()> {
    /// use std::time::Duration;
    /// use ferry::{Engine, TimeoutLayer, TransferEngine};
    ///
    /// let engine = Engine::open("tcp://127.0.0.1:0")
    ///     .await?
    ///     .layer(TimeoutLayer::new(Duration::from_secs(5)));
    /// let peer = engine.open_segment("10.0.0.2:7000").await?; // at most 5 s
    /// # let _ = peer; Ok(()) }
    /// ```
    pub fn layer<L: Layer<Engine>>(self, layer: L) -> L::Engine {
        layer.layer(self)
    }

    /// The payload path to the open peer `name`, for the metrics:
    /// what TCP negotiated (`socket`, `same-host cma`…), else the backend.
    fn peer_path(&self, name: &str) -> Option<String> {
        match self.backend {
            #[cfg(feature = "tcp")]
            Backend::Tcp(_) => self.peer_report(name).map(|r| r.path),
            #[allow(unreachable_patterns)]
            _ => {
                let _ = name;
                Some(self.kind().scheme().to_owned())
            }
        }
    }

    /// Opens the segment at `name` (`host:port`) on the backend.
    async fn open_address(&self, name: &str) -> Result<SegmentId> {
        let segment = dispatch!(self, e => e.open_segment(name).await)?;
        if let Some(path) = self.peer_path(name) {
            // Next to the tracing layer's `ferry_connect` span (closed by
            // now): the path the connection negotiated.
            tracing::debug!(peer = name, path = %path, "ferry: segment open");
            dispatch!(self, e => e.get_ref().set_peer_path(name, &path));
        }
        Ok(segment)
    }

    /// The backend segment behind `segment`: itself, or where the logical
    /// name it was opened by leads now (reconnecting after a move, closing
    /// the segment it replaces); the route's error when the name is gone.
    async fn backend_segment(&self, segment: SegmentId) -> Result<SegmentId> {
        let Some(d) = &self.discovery else {
            return Ok(segment);
        };
        match d.target(segment) {
            Target::Direct => Ok(segment),
            Target::Open(backend) => Ok(backend),
            Target::Gone(e) => Err(e),
            Target::Moved => {
                let open = |address: String| async move { self.open_address(&address).await };
                let (backend, old) = d.reconnect(segment, open).await?;
                if let Some(old) = old {
                    if let Err(e) = dispatch!(self, e => e.close_segment(old).await) {
                        tracing::debug!(error = %e, "ferry: closing the segment a move replaced");
                    }
                }
                Ok(backend)
            }
        }
    }

    /// The engine as a shared trait object, for code that chooses the
    /// backend at run time.
    pub fn into_dyn(self) -> Arc<dyn DynTransferEngine> {
        Arc::new(self)
    }
}

/// The observing layers [`Engine::start`] puts over the adapter.
struct Observe {
    metrics: Option<Metrics>,
    tracing: bool,
}

impl Observe {
    fn stack<B: TransferEngine>(&self, adapter: CapabilityAdapter<B>) -> Stack<B> {
        let metrics = match &self.metrics {
            Some(m) => MetricsLayer::new(m.clone()).native(adapter.report().native),
            None => MetricsLayer::disabled(),
        };
        let tracing = if self.tracing {
            TracingLayer::new()
        } else {
            TracingLayer::disabled()
        };
        tracing.layer(metrics.layer(adapter))
    }
}

#[deny(clippy::missing_trait_methods)]
impl TransferEngine for Engine {
    fn backend_name(&self) -> &str {
        dispatch!(self, e => e.backend_name())
    }

    fn segment_name(&self) -> &str {
        dispatch!(self, e => e.segment_name())
    }

    fn capabilities(&self) -> Capabilities {
        dispatch!(self, e => e.capabilities())
    }

    fn backend_info(&self) -> BackendInfo {
        dispatch!(self, e => e.backend_info())
    }

    async fn register(&self, region: MemoryRegion) -> Result<()> {
        dispatch!(self, e => e.register(region).await)
    }

    async fn unregister(&self, addr: u64) -> Result<()> {
        dispatch!(self, e => e.unregister(addr).await)
    }

    async fn batch_register(&self, regions: Vec<MemoryRegion>) -> Result<()> {
        dispatch!(self, e => e.batch_register(regions).await)
    }

    async fn batch_unregister(&self, addrs: &[u64]) -> Result<()> {
        dispatch!(self, e => e.batch_unregister(addrs).await)
    }

    async fn open_segment(&self, name: &str) -> Result<SegmentId> {
        match &self.discovery {
            Some(d) if crate::discovery::is_logical(name) => {
                // Resolved here, followed by a watch: a transfer on the
                // segment never asks etcd.
                let open = |address: String| async move { self.open_address(&address).await };
                d.open(name, open).await
            }
            _ => self.open_address(name).await,
        }
    }

    async fn close_segment(&self, segment: SegmentId) -> Result<()> {
        let backend = self
            .discovery
            .as_ref()
            .and_then(|d| d.remove(segment))
            .unwrap_or(segment);
        dispatch!(self, e => e.close_segment(backend).await)
    }

    async fn transfer(&self, segment: SegmentId, request: TransferRequest) -> Result<()> {
        let segment = self.backend_segment(segment).await?;
        dispatch!(self, e => e.transfer(segment, request).await)
    }

    fn transfer_now(&self, segment: SegmentId, request: TransferRequest) -> Option<Result<()>> {
        let segment = match self.discovery.as_ref().map(|d| d.target(segment)) {
            None | Some(Target::Direct) => segment,
            Some(Target::Open(backend)) => backend,
            Some(Target::Gone(e)) => return Some(Err(e)),
            // Reconnecting waits: `transfer` does it.
            Some(Target::Moved) => return None,
        };
        dispatch!(self, e => e.transfer_now(segment, request))
    }

    async fn batch_transfer(
        &self,
        segment: SegmentId,
        requests: &[TransferRequest],
        notify: Option<&Notification>,
    ) -> Result<BatchReport> {
        let segment = self.backend_segment(segment).await?;
        dispatch!(self, e => e.batch_transfer(segment, requests, notify).await)
    }

    async fn submit(
        &self,
        segment: SegmentId,
        requests: &[TransferRequest],
        notify: Option<&Notification>,
    ) -> Result<BatchId> {
        let segment = self.backend_segment(segment).await?;
        dispatch!(self, e => e.submit(segment, requests, notify).await)
    }

    fn status(&self, batch: BatchId) -> Result<BatchStatus> {
        dispatch!(self, e => e.status(batch))
    }

    async fn wait(&self, batch: BatchId) -> Result<BatchReport> {
        dispatch!(self, e => e.wait(batch).await)
    }

    async fn release_batch(&self, batch: BatchId) -> Result<()> {
        dispatch!(self, e => e.release_batch(batch).await)
    }

    async fn take_notifications(&self) -> Result<Vec<Notification>> {
        dispatch!(self, e => e.take_notifications().await)
    }

    async fn next_notification(&self, name: Option<&str>) -> Result<Notification> {
        dispatch!(self, e => e.next_notification(name).await)
    }

    fn live_batches(&self) -> Option<usize> {
        dispatch!(self, e => TransferEngine::live_batches(e))
    }
    fn inbound(&self) -> Option<ferry_core::Inbound> {
        dispatch!(self, e => TransferEngine::inbound(e))
    }

    async fn shutdown(&self) -> Result<()> {
        // The name goes first: no peer finds an engine that is stopping.
        let revoked = match &self.discovery {
            Some(d) => d.shutdown().await,
            None => Ok(()),
        };
        dispatch!(self, e => TransferEngine::shutdown(e).await)?;
        revoked
    }
}

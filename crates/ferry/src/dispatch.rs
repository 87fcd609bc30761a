//! [`Engine`]: one type over every backend compiled in, each wrapped in the
//! default stack of layers (tracing, metrics, capability adapter).

use ferry_core::DynTransferEngine;
use std::sync::Arc;

use ferry_core::layer::{MetricsEngine, MetricsSnapshot, TracingEngine};
use ferry_core::{
    AdapterConfig, BackendInfo, BatchId, BatchReport, BatchStatus, Capabilities, CapabilityAdapter,
    CapabilityReport, FastPath, Layer, MemoryRegion, Metrics, Notification, Operation, Result,
    SegmentId, TransferEngine, TransferRequest,
};

use crate::config::{BackendKind, DiscoveryConfig, EngineConfig};
use crate::discovery::{Discovery, Etcd, Target};
use crate::registry::{Observe, Registry, Scheme, SchemeContext, Stacked, Starting};

/// The default stack over a backend `B`, outermost first: a
/// [`TracingEngine`] (a span per batch), a [`MetricsEngine`] (counters
/// into [`EngineConfig::metrics`]) and the [`CapabilityAdapter`] (itself
/// coalescing over emulation over the concurrency limit of emulated
/// batches, see [`ferry_core::adapter`]). Either
/// observing layer may be switched off in the [`EngineConfig`]; the type
/// stays the same. Every scheme's backend goes into it (see
/// [`crate::registry`]).
pub type Stack<B> = TracingEngine<MetricsEngine<CapabilityAdapter<B>>>;

/// A started engine of whichever backend the URL's scheme (or the
/// configuration) named, wrapped in the default [`Stack`]: a
/// [`CapabilityAdapter`] so that every [`TransferEngine`] operation is
/// available (natively, emulated, or refused with a reason in strict
/// mode), metrics ([`Engine::metrics`]) and a `tracing` span per batch.
/// [`Engine::layer`] stacks more.
///
/// One type for every scheme: the stack is held as one trait object, and
/// [`Engine::open`] finds the backend in the scheme [`Registry`], where a
/// backend outside Ferry registers too ([`crate::registry::register`]).
/// [`Engine::backend`] reaches the backend under the stack.
///
/// With segment discovery ([`EngineConfig::discovery`], `metadata=etcd://…`,
/// cargo feature `etcd`) the engine also holds its etcd publication:
/// `open_segment` resolves a logical name (one without `:`) through etcd
/// and follows it with a watch (a peer that re-registers at a new address
/// is reconnected to at the next transfer; one whose lease ended fails
/// transfers with `SegmentUnavailable` naming the segment and the lease),
/// and `shutdown` revokes the lease.
pub struct Engine {
    /// The backend in its stack: every call goes through it.
    inner: Arc<dyn Stacked>,
    /// The scheme it was opened by (`tcp`, …).
    scheme: String,
    /// The etcd publication, with `metadata=etcd://…`. Only
    /// `open_segment` of a logical name and `shutdown` use it.
    discovery: Option<Discovery>,
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("scheme", &self.scheme)
            .field("segment", &self.inner.segment_name_dyn())
            .field("published", &self.published_name())
            .finish_non_exhaustive()
    }
}

impl Engine {
    /// Parses `url` and starts the engine its scheme names, through the
    /// scheme registry ([`Registry::global`]; see [`EngineConfig`] for the
    /// schemes of this build and their parameters).
    ///
    /// ```no_run
    /// # async fn demo() -> ferry::Result<()> {
    /// let engine = ferry::Engine::open("tcp://127.0.0.1:0?strict=1").await?;
    /// println!("peers reach me at {}", ferry::TransferEngine::segment_name(&engine));
    /// # Ok(()) }
    /// ```
    ///
    /// Errors: everything [`Registry::open_parsed`] returns.
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
        Registry::global().open(url).await
    }

    /// [`Engine::open`] on a URL already parsed (a program that adds
    /// parameters of its own, such as the secret from the environment),
    /// with `options` (metrics, tracing).
    pub async fn open_parsed(
        url: ferry_core::raw::ParsedUrl,
        options: crate::registry::OpenOptions,
    ) -> Result<Engine> {
        Registry::global().open_parsed(url, options).await
    }

    /// A [`crate::multi::MultiEngine`] over one engine per URL, best first
    /// (`&["verbs://rxe0", "tcp://0.0.0.0:7000"]`), in the default stack:
    /// the Rust form of `multi://?transports=…` (see [`crate::multi`]).
    /// Each URL is opened through [`Registry::global`]; Ferry's own
    /// parameters in them (`strict`, `require`…) apply to that inner
    /// engine only.
    ///
    /// Errors: [`ferry_core::Error::InvalidArgument`] for an empty list or
    /// a `multi://` URL in it; every error of [`Engine::open`] for each URL
    /// (the engines opened before are shut down again).
    pub async fn open_multi(urls: &[&str]) -> Result<Engine> {
        let urls: Vec<String> = urls.iter().map(|u| (*u).to_owned()).collect();
        let context = SchemeContext::new(
            AdapterConfig::default(),
            crate::registry::OpenOptions::default().into(),
        );
        let starting = crate::registry::stacking(
            async move {
                let urls: Vec<&str> = urls.iter().map(String::as_str).collect();
                crate::multi::MultiEngine::start(&urls).await
            },
            &context,
        );
        Engine::launch_as(crate::multi::SCHEME, None, starting, &[], None).await
    }

    /// For a multi engine ([`crate::multi`]): the transport chosen for the
    /// peer opened as `name`, and why. `None` for another engine, or a
    /// peer not open.
    pub fn transport_choice(&self, name: &str) -> Option<crate::multi::Choice> {
        self.backend::<crate::multi::MultiEngine>()?
            .choice_for(name)
    }

    /// Starts the backend `config` names, wraps it in the default stack
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
        let kind = backend.kind();
        let context = SchemeContext::new(adapter, Observe { metrics, tracing });
        let starting = crate::builtin::start(backend, &context);
        Engine::launch_as(
            kind.scheme(),
            crate::builtin::discovery(kind),
            starting,
            &require,
            discovery,
        )
        .await
    }

    /// Awaits `starting` (the backend going into its stack), checks
    /// `require` and publishes with `discovery`.
    pub(crate) async fn launch(
        scheme: &Scheme,
        starting: Starting,
        require: &[Operation],
        discovery: Option<DiscoveryConfig>,
    ) -> Result<Engine> {
        Engine::launch_as(
            scheme.name(),
            scheme.discovery(),
            starting,
            require,
            discovery,
        )
        .await
    }

    async fn launch_as(
        scheme: &str,
        protocol: Option<(u16, u16)>,
        starting: Starting,
        require: &[Operation],
        discovery: Option<DiscoveryConfig>,
    ) -> Result<Engine> {
        let etcd = match (&discovery, protocol) {
            (Some(_), None) => {
                return Err(ferry_core::Error::InvalidArgument(format!(
                    "etcd discovery is for Ferry's own transports (tcp://, verbs://), not {scheme}://"
                )));
            }
            (Some(d), Some(_)) => Some(Etcd::connect(d).await?),
            (None, _) => None,
        };
        let mut engine = Engine {
            inner: starting.await?,
            scheme: scheme.to_owned(),
            discovery: None,
        };
        engine.require(require)?;
        if let Some(etcd) = etcd {
            engine.publish(etcd, protocol.unwrap_or((0, 0))).await?;
        }
        tracing::debug!(
            backend = engine.scheme(),
            segment = engine.segment_name(),
            published = engine.published_name(),
            "ferry engine started"
        );
        Ok(engine)
    }

    /// Publishes this engine in etcd; on failure shuts the backend down.
    #[cfg(feature = "etcd")]
    async fn publish(&mut self, etcd: Etcd, (min, max): (u16, u16)) -> Result<()> {
        let address = self.segment_name().to_owned();
        let protocol = ferry_discovery::ProtocolRange {
            min: min.into(),
            max: max.into(),
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
            // A multi engine also lists each transport's own address after
            // its multi name: a multi peer opens the first, a peer of one
            // transport (a plain `tcp://` engine) the first it can.
            let mut addresses = vec![address.clone()];
            if let Some(multi) = self.backend::<crate::multi::MultiEngine>() {
                addresses.extend(multi.transports().filter_map(|(_, inner)| {
                    let own = inner.segment_name();
                    let unspecified = own
                        .parse::<std::net::SocketAddr>()
                        .is_ok_and(|a| a.ip().is_unspecified());
                    (!unspecified).then(|| own.to_owned())
                }));
            }
            let descriptor = ferry_discovery::Descriptor::new(address.clone(), addresses, protocol);
            etcd.publish(descriptor).await
        };
        match published {
            Ok(d) => {
                self.discovery = Some(d);
                Ok(())
            }
            Err(e) => {
                if let Err(s) = self.inner.shutdown_dyn().await {
                    tracing::warn!(error = %s, "ferry: shutdown after a failed etcd publication");
                }
                Err(e)
            }
        }
    }

    #[cfg(not(feature = "etcd"))]
    async fn publish(&mut self, etcd: Etcd, _: (u16, u16)) -> Result<()> {
        match etcd {}
    }

    /// The logical name this engine publishes in etcd
    /// ([`EngineConfig::discovery`]; still given after
    /// [`TransferEngine::shutdown`] revoked it); `None` without discovery.
    pub fn published_name(&self) -> Option<&str> {
        self.discovery.as_ref().map(Discovery::name)
    }

    /// The scheme this engine was opened by (`tcp`, `inproc`, a scheme
    /// registered outside Ferry…), in lower case.
    pub fn scheme(&self) -> &str {
        &self.scheme
    }

    /// Which of Ferry's backends this is; `None` for a scheme outside
    /// [`BackendKind`] (`inproc`, one registered by a program).
    pub fn kind(&self) -> Option<BackendKind> {
        self.scheme.parse().ok()
    }

    /// The backend under the stack, if it is a `B`
    /// (`engine.backend::<ferry::tcp::TcpEngine>()`): for what only
    /// that backend offers.
    pub fn backend<B: TransferEngine>(&self) -> Option<&B> {
        self.inner.backend().downcast_ref::<B>()
    }

    /// The synchronous fast path of `segment`, where its backend has one
    /// (TCP: a small same-host request the peer granted, copied by the
    /// calling thread), wrapped by the stack's layers (the adapter's
    /// drain, the metrics, the tracing switch). For a caller that waits
    /// anyway (the blocking API, Python): keep it with the segment and
    /// try it before [`TransferEngine::transfer`]:
    ///
    /// ```no_run
    /// # async fn f(engine: ferry::Engine, seg: ferry::SegmentId, req: ferry::TransferRequest) -> ferry::Result<()> {
    /// use ferry::TransferEngine;
    /// let fast = engine.fast_path(seg);
    /// match fast.as_ref().and_then(|f| f.try_transfer(&req)) {
    ///     Some(done) => done,                        // done here, counted once
    ///     None => engine.transfer(seg, req).await, // not a byte moved: the usual way
    /// }
    /// # }
    /// ```
    ///
    /// `None` when the backend has none (every scheme but `tcp`), the
    /// segment is unknown, or its etcd name does not resolve to an open
    /// segment now. A path kept past [`TransferEngine::close_segment`] or
    /// `shutdown` declines everything, and `transfer` reports why.
    pub fn fast_path(&self, segment: SegmentId) -> Option<FastPath> {
        let backend = match &self.discovery {
            None => segment,
            Some(d) => match d.target(segment) {
                Target::Direct => segment,
                Target::Open(backend) => backend,
                Target::Gone(_) | Target::Moved => return None,
            },
        };
        let path = crate::builtin::fast_path(self.inner.backend(), backend)?;
        Some(self.inner.wrap_fast(backend, path))
    }

    /// The capability report: native and effective capabilities and, per
    /// optional operation, native / emulated / unsupported with the reason
    /// and the version that would make it native.
    pub fn report(&self) -> CapabilityReport {
        self.inner.report()
    }

    /// Start-up check: `Ok` if every operation in `ops` is available
    /// (natively, or emulated unless strict), else
    /// [`ferry_core::Error::MissingCapabilities`] naming each missing one.
    pub fn require(&self, ops: &[Operation]) -> Result<()> {
        self.inner.require(ops)
    }

    /// The adapter configuration in force (strict mode, coalescing…).
    pub fn adapter_config(&self) -> &AdapterConfig {
        self.inner.adapter_config()
    }

    /// What this engine negotiated with the peer segment `name` (opened
    /// with `open_segment`) on its latest connection: both version ranges,
    /// the version in use, each optional feature on or off and why, and
    /// the payload path — for a serving stack to log at connection time.
    /// `None` if the segment is not open, or for a backend that does not
    /// negotiate (Mooncake speaks the installed library's protocol).
    ///
    /// On a multi engine, the report of the transport chosen for `name`
    /// when that transport is TCP.
    #[cfg(feature = "tcp")]
    pub fn peer_report(&self, name: &str) -> Option<crate::PeerReport> {
        if let Some(multi) = self.backend::<crate::multi::MultiEngine>() {
            let choice = multi.choice_for(name)?;
            let (_, inner) = multi.transports().nth(choice.index)?;
            return inner.peer_report(&choice.address);
        }
        self.backend::<ferry_tcp::TcpEngine>()?.peer_report(name)
    }

    /// This engine's metrics now: bytes and requests per peer and outcome,
    /// batches in flight, registered bytes, notifications, emulated
    /// operations (all zero when [`EngineConfig::metrics`] was `None`).
    pub fn metrics(&self) -> MetricsSnapshot {
        self.inner.snapshot()
    }

    /// The registry this engine counts into ([`Metrics::encode`] gives
    /// the Prometheus text exposition); `None` when metrics are off.
    pub fn metrics_registry(&self) -> Option<&Metrics> {
        self.inner.metrics()
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
    /// what TCP negotiated (`socket`, `same-host cma`…), else the scheme.
    fn peer_path(&self, name: &str) -> Option<String> {
        if let Some(multi) = self.backend::<crate::multi::MultiEngine>() {
            let choice = multi.choice_for(name)?;
            let (_, inner) = multi.transports().nth(choice.index)?;
            let path = inner.peer_path(&choice.address)?;
            return Some(if path == choice.transport {
                path
            } else {
                format!("{} {path}", choice.transport)
            });
        }
        #[cfg(feature = "tcp")]
        if let Some(tcp) = self.backend::<ferry_tcp::TcpEngine>() {
            return tcp.peer_report(name).map(|r| r.path);
        }
        let _ = name;
        Some(self.scheme.clone())
    }

    /// Opens the segment at `name` (`host:port`) on the backend.
    async fn open_address(&self, name: &str) -> Result<SegmentId> {
        let segment = self.inner.open_segment_dyn(name).await?;
        if let Some(path) = self.peer_path(name) {
            // Next to the tracing layer's `ferry_connect` span (closed by
            // now): the path the connection negotiated.
            tracing::debug!(peer = name, path = %path, "ferry: segment open");
            self.inner.set_peer_path(name, &path);
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
                    if let Err(e) = self.inner.close_segment_dyn(old).await {
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

#[deny(clippy::missing_trait_methods)]
impl TransferEngine for Engine {
    fn backend_name(&self) -> &str {
        self.inner.backend_name_dyn()
    }

    fn segment_name(&self) -> &str {
        self.inner.segment_name_dyn()
    }

    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities_dyn()
    }

    fn backend_info(&self) -> BackendInfo {
        self.inner.backend_info_dyn()
    }

    async fn register(&self, region: MemoryRegion) -> Result<()> {
        self.inner.register_dyn(region).await
    }

    async fn unregister(&self, addr: u64) -> Result<()> {
        self.inner.unregister_dyn(addr).await
    }

    async fn batch_register(&self, regions: Vec<MemoryRegion>) -> Result<()> {
        self.inner.batch_register_dyn(regions).await
    }

    async fn batch_unregister(&self, addrs: &[u64]) -> Result<()> {
        self.inner.batch_unregister_dyn(addrs).await
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
        self.inner.close_segment_dyn(backend).await
    }

    async fn transfer(&self, segment: SegmentId, request: TransferRequest) -> Result<()> {
        let segment = self.backend_segment(segment).await?;
        self.inner.transfer_dyn(segment, request).await
    }

    async fn batch_transfer(
        &self,
        segment: SegmentId,
        requests: &[TransferRequest],
        notify: Option<&Notification>,
    ) -> Result<BatchReport> {
        let segment = self.backend_segment(segment).await?;
        self.inner
            .batch_transfer_dyn(segment, requests, notify)
            .await
    }

    async fn submit(
        &self,
        segment: SegmentId,
        requests: &[TransferRequest],
        notify: Option<&Notification>,
    ) -> Result<BatchId> {
        let segment = self.backend_segment(segment).await?;
        self.inner.submit_dyn(segment, requests, notify).await
    }

    fn status(&self, batch: BatchId) -> Result<BatchStatus> {
        self.inner.status_dyn(batch)
    }

    async fn wait(&self, batch: BatchId) -> Result<BatchReport> {
        self.inner.wait_dyn(batch).await
    }

    async fn release_batch(&self, batch: BatchId) -> Result<()> {
        self.inner.release_batch_dyn(batch).await
    }

    async fn take_notifications(&self) -> Result<Vec<Notification>> {
        self.inner.take_notifications_dyn().await
    }

    async fn next_notification(&self, name: Option<&str>) -> Result<Notification> {
        self.inner.next_notification_dyn(name).await
    }

    fn live_batches(&self) -> Option<usize> {
        self.inner.live_batches_dyn()
    }
    fn inbound(&self) -> Option<ferry_core::Inbound> {
        self.inner.inbound_dyn()
    }

    async fn shutdown(&self) -> Result<()> {
        // The name goes first: no peer finds an engine that is stopping.
        let revoked = match &self.discovery {
            Some(d) => d.shutdown().await,
            None => Ok(()),
        };
        self.inner.shutdown_dyn().await?;
        revoked
    }
}

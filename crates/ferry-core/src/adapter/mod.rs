//! The capability adapter: gives any engine the whole [`TransferEngine`]
//! trait. It is three layers with one job each, stacked:
//!
//! - [`CoalesceEngine`] ([`CoalesceLayer`]): contiguous requests of a
//!   batch, sync or async, are merged before the layers below see them,
//!   and results are mapped back to the caller's indices (a merged
//!   request that fails on an address check is retried request by
//!   request: it may straddle two adjacent regions);
//! - [`EmulationEngine`] ([`EmulationLayer`]): the effective capability
//!   set is a pure function of the native one and the [`AdapterConfig`]:
//!   each optional operation is forwarded when native, emulated when
//!   allowed (with the same observable semantics), or refused with
//!   [`Error::Unsupported`]; `shutdown` drains the calls in flight; the
//!   capability report and `require` live here;
//! - [`ConcurrencyLimitEngine`]
//!   ([`ConcurrencyLimitLayer`](crate::layer::ConcurrencyLimitLayer)): at
//!   most [`AdapterConfig::max_concurrency`] of the single transfers the
//!   emulation issues for the batches it emulates are in flight at once,
//!   across all its batches; a caller's own transfers and native batches
//!   pass straight through.
//!
//! The coalescing and limiting layers keep the capabilities of the layer
//! below, so the adapter's are the emulation's.
//!
//! | operation | emulated with |
//! |---|---|
//! | `batch_register` | single registers, all-or-nothing (rollback on failure) |
//! | `batch_unregister` | single unregisters, every address attempted |
//! | `batch_transfer` | native async batch, else single transfers with bounded concurrency (`max_concurrency` per batch, and in all by the limit layer) |
//! | `submit`/`status`/`release_batch` | a task per batch driving the above (run inline outside a runtime); `status` reads its state |
//! | `wait` | awaiting that task (never polling a core hot) |
//! | notifications | not emulable: needs a channel to the peer |
//!
//! A native async batch is forwarded as it is (its own `status`, `wait`,
//! `release_batch`) when nothing in it needs the emulation: within the
//! backend's batch length, notification native (and, above, nothing to
//! merge).

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::stream::{self, StreamExt};

use crate::batch::report_into;
pub use crate::layer::coalesce::{coalesce, CoalesceEngine, CoalesceLayer, CoalescedBatch};
pub use crate::layer::Layer;

use crate::batch::BatchTable;
use crate::caps::{
    BackendInfo, Capabilities, CapabilityReport, MissingCapability, Operation, Support,
};
use crate::engine::TransferEngine;
use crate::error::{Error, Result};
use crate::layer::concurrency_limit::{limited, ConcurrencyLimitEngine};
use crate::types::{
    BatchId, BatchReport, BatchStatus, MemoryRegion, Notification, SegmentId, TransferRequest,
};

/// How the adapter fills gaps.
///
/// `#[non_exhaustive]`: outside ferry-core, build it with
/// [`AdapterConfig::builder`] (or start from `default()` and assign
/// fields).
///
/// ```
/// use ferry_core::AdapterConfig;
///
/// let config = AdapterConfig::builder()
///     .coalesce(false)
///     .max_concurrency(4)
///     .build()?;
/// assert!(!config.coalesce && !config.strict);
/// assert!(AdapterConfig::builder().max_concurrency(0).build().is_err());
/// # Ok::<(), ferry_core::Error>(())
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct AdapterConfig {
    /// Strict mode: emulate nothing; missing operations are `Unsupported`
    /// and [`CapabilityAdapter::require`] fails for them.
    pub strict: bool,
    /// Emulate `batch_register` with single registers.
    pub emulate_batch_register: bool,
    /// Emulate `batch_unregister` with single unregisters.
    pub emulate_batch_unregister: bool,
    /// Emulate `batch_transfer`.
    pub emulate_batch_transfer: bool,
    /// Emulate `submit` / `status` / `release_batch`.
    pub emulate_async_batch: bool,
    /// Emulate `wait`.
    pub emulate_batch_wait: bool,
    /// Merge contiguous requests before they reach the backend.
    pub coalesce: bool,
    /// Largest request coalescing may produce, in bytes.
    pub max_coalesced_len: u64,
    /// Most emulated single transfers in flight at once, across all batches
    /// of this adapter (at least 1): the
    /// [`ConcurrencyLimitLayer`](crate::layer::ConcurrencyLimitLayer) at
    /// the bottom of the adapter holds the others back. The emulation layer
    /// alone ([`EmulationLayer`]) issues each batch's single transfers
    /// this many at a time and sets no bound across batches.
    pub max_concurrency: usize,
}

impl Default for AdapterConfig {
    fn default() -> Self {
        AdapterConfig {
            strict: false,
            emulate_batch_register: true,
            emulate_batch_unregister: true,
            emulate_batch_transfer: true,
            emulate_async_batch: true,
            emulate_batch_wait: true,
            coalesce: true,
            max_coalesced_len: crate::layer::coalesce::DEFAULT_MAX_COALESCED_LEN,
            max_concurrency: crate::layer::concurrency_limit::DEFAULT_MAX_CONCURRENCY,
        }
    }
}

crate::__config_builder! {
    /// Builds an [`AdapterConfig`] ([`AdapterConfig::builder`]).
    pub struct AdapterConfigBuilder for AdapterConfig {
        set strict: bool,
        set emulate_batch_register: bool,
        set emulate_batch_unregister: bool,
        set emulate_batch_transfer: bool,
        set emulate_async_batch: bool,
        set emulate_batch_wait: bool,
        set coalesce: bool,
        set max_coalesced_len: u64,
        set max_concurrency: usize,
    }
}

impl AdapterConfig {
    /// The URL parameters that belong to the adapter (Ferry's own, taken
    /// by [`AdapterConfig::take_url_params`] before the backend sees the
    /// URL).
    pub const URL_PARAMETERS: [&'static str; 4] =
        ["strict", "coalesce", "max_concurrency", "require"];

    /// The strict configuration: forward what is native, refuse the rest.
    pub fn strict() -> Self {
        AdapterConfig {
            strict: true,
            ..Default::default()
        }
    }

    /// Checks the fields: `max_concurrency` and `max_coalesced_len` must
    /// be at least 1 ([`Error::InvalidArgument`] naming the field).
    pub fn validate(&self) -> Result<()> {
        if self.max_concurrency == 0 {
            return Err(Error::InvalidArgument(
                "adapter config: max_concurrency must be at least 1".to_owned(),
            ));
        }
        if self.max_coalesced_len == 0 {
            return Err(Error::InvalidArgument(
                "adapter config: max_coalesced_len must be at least 1".to_owned(),
            ));
        }
        Ok(())
    }

    /// Takes Ferry's own parameters ([`AdapterConfig::URL_PARAMETERS`]) out
    /// of `url`, leaving the rest for the backend: `strict`, `coalesce`
    /// (booleans: `1`/`0`, `true`/`false`, `yes`/`no`, `on`/`off`, a bare
    /// key is `true`), `max_concurrency` (a positive integer) and `require`
    /// (comma-separated operations or guarantees, see [`Operation`]).
    /// Returns the configuration (defaults for what is absent) and the
    /// required operations.
    pub fn take_url_params(
        url: &mut crate::raw::ParsedUrl,
    ) -> Result<(AdapterConfig, Vec<Operation>)> {
        let mut c = AdapterConfig::default();
        if let Some(v) = url.take_bool("strict")? {
            c.strict = v;
        }
        if let Some(v) = url.take_bool("coalesce")? {
            c.coalesce = v;
        }
        if let Some(n) = url.take_with("max_concurrency", "a positive integer", |v| {
            v.parse::<usize>().ok().filter(|n| *n > 0)
        })? {
            c.max_concurrency = n;
        }
        let mut require = Vec::new();
        for op in url.take_list("require")?.unwrap_or_default() {
            require.push(op.parse::<Operation>()?);
        }
        Ok((c, require))
    }

    fn may_emulate(&self, op: Operation) -> bool {
        !self.strict
            && match op {
                Operation::BatchRegister => self.emulate_batch_register,
                Operation::BatchUnregister => self.emulate_batch_unregister,
                Operation::BatchTransfer => self.emulate_batch_transfer,
                Operation::AsyncBatch => self.emulate_async_batch,
                Operation::BatchWait => self.emulate_batch_wait,
                _ => false,
            }
    }

    /// The effective capability set for a backend with `native` ones.
    pub fn effective(&self, native: &Capabilities) -> Capabilities {
        let mut eff = *native;
        for op in Operation::OPTIONAL {
            if !native.supports(op) && self.may_emulate(op) {
                eff.set(op, true);
            }
        }
        // Notifications ride on a native batch path; the adapter cannot add
        // them, but it can keep them when the batch itself is emulated only
        // if one native batch path exists to carry them.
        eff.notify = native.notify && (native.batch_transfer || native.async_batch);
        // `wait` works on the batches `submit` makes: without those it is
        // not available either.
        eff.batch_wait &= eff.async_batch;
        if eff.batch_transfer || eff.async_batch {
            eff.max_batch_len = None;
        }
        eff
    }
}

/// [`Layer`] that wraps engines in a [`CapabilityAdapter`].
#[derive(Clone, Debug, Default)]
pub struct AdapterLayer {
    config: AdapterConfig,
}

impl AdapterLayer {
    /// A layer with `config`.
    pub fn new(config: AdapterConfig) -> Self {
        AdapterLayer { config }
    }

    /// The adapter with coalescing off: its [`EmulationEngine`] (with
    /// the drain and report) over its [`ConcurrencyLimitEngine`], behind a
    /// coalescing layer that forwards everything. [`EmulationLayer`] gives
    /// the emulation layer itself.
    pub fn emulation() -> Self {
        AdapterLayer {
            config: AdapterConfig {
                coalesce: false,
                ..AdapterConfig::default()
            },
        }
    }
}

/// [`Layer`] that wraps engines in an [`EmulationEngine`]: the adapter's
/// emulation layer on its own. Stacked over a
/// [`ConcurrencyLimitLayer`](crate::layer::ConcurrencyLimitLayer) and under
/// a [`CoalesceLayer`] it is what [`CapabilityAdapter`] is.
#[derive(Clone, Debug, Default)]
pub struct EmulationLayer {
    config: AdapterConfig,
}

impl EmulationLayer {
    /// A layer with `config` (its coalescing fields are the coalescing
    /// layer's business and are ignored here; of `max_concurrency` it
    /// takes only the width it issues one batch's single transfers with,
    /// the bound across batches being the
    /// [`ConcurrencyLimitLayer`](crate::layer::ConcurrencyLimitLayer)'s).
    pub fn new(config: AdapterConfig) -> Self {
        EmulationLayer { config }
    }
}

impl<E: TransferEngine> Layer<E> for EmulationLayer {
    type Engine = EmulationEngine<E>;
    fn layer(&self, inner: E) -> EmulationEngine<E> {
        EmulationEngine::from_arc(Arc::new(inner), self.config.clone())
    }
}

impl<E: TransferEngine> Layer<E> for AdapterLayer {
    type Engine = CapabilityAdapter<E>;
    fn layer(&self, inner: E) -> CapabilityAdapter<E> {
        CapabilityAdapter::with_config(inner, self.config.clone())
    }
}

/// Gives any engine the whole [`TransferEngine`] trait (see the module
/// docs): the default stack of three layers, a [`CoalesceEngine`]
/// (merging contiguous requests, when [`AdapterConfig::coalesce`]) over
/// an [`EmulationEngine`] (emulation, the drain at shutdown and the
/// report) over a [`ConcurrencyLimitEngine`] (at most
/// [`AdapterConfig::max_concurrency`] emulated single transfers in
/// flight). Its capabilities are the emulation's; the other two layers
/// keep them as they are.
pub struct CapabilityAdapter<E: TransferEngine + ?Sized> {
    inner: CoalesceEngine<EmulationEngine<ConcurrencyLimitEngine<E>>>,
}

impl<E: TransferEngine + ?Sized> std::fmt::Debug for CapabilityAdapter<E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let e = self.inner.get_ref();
        f.debug_struct("CapabilityAdapter")
            .field("backend", &e.inner.backend_name())
            .field("segment", &e.inner.segment_name())
            .field("config", &e.shared.config)
            .field("native", &e.shared.native)
            .finish()
    }
}

impl<E: TransferEngine> CapabilityAdapter<E> {
    /// Wraps `inner` with the default (emulating) configuration.
    pub fn new(inner: E) -> Self {
        Self::with_config(inner, AdapterConfig::default())
    }
    /// Wraps `inner` with `config`.
    pub fn with_config(inner: E, config: AdapterConfig) -> Self {
        Self::from_arc(Arc::new(inner), config)
    }
}

impl<E: TransferEngine + ?Sized> CapabilityAdapter<E> {
    /// Wraps an engine that is already shared (e.g. `Arc<dyn DynTransferEngine>`).
    pub fn from_arc(inner: Arc<E>, config: AdapterConfig) -> Self {
        let (enabled, max_len) = (config.coalesce, config.max_coalesced_len);
        let limit = ConcurrencyLimitEngine::from_arc(inner, config.max_concurrency);
        let emulation = EmulationEngine::from_arc(Arc::new(limit), config);
        CapabilityAdapter {
            inner: CoalesceEngine::with(emulation, enabled, max_len),
        }
    }

    /// The wrapped engine.
    pub fn get_ref(&self) -> &E {
        self.concurrency_limit().get_ref()
    }
    /// `path` (a [`FastPath`](crate::FastPath) of a segment of the wrapped
    /// engine) as the adapter passes it on: admitted by the drain as
    /// `transfer` is (declined once `shutdown` began, so that `transfer`
    /// says so), the guard held across the call. Coalescing, emulation
    /// and the concurrency limit concern batches: a single transfer
    /// passes them untouched.
    pub fn wrap_fast(&self, path: crate::FastPath) -> crate::FastPath {
        let shared = Arc::clone(&self.emulation().shared);
        crate::FastPath::new(move |request, call| {
            // A batch the adapter would refuse (strict, not native) is
            // declined: `batch_transfer` refuses it, saying why.
            if call == crate::FastCall::BatchOfOne && !shared.effective.batch_transfer {
                return None;
            }
            let _admitted = shared.drain.admit()?;
            path.try_call(request, call)
        })
    }
    /// The wrapped engine, shared.
    pub fn inner(&self) -> &Arc<E> {
        self.concurrency_limit().inner()
    }
    /// Unwraps, returning the shared inner engine.
    pub fn into_inner(self) -> Arc<E> {
        Arc::clone(self.inner())
    }
    /// The emulation layer of the stack.
    pub fn emulation(&self) -> &EmulationEngine<ConcurrencyLimitEngine<E>> {
        self.inner.get_ref()
    }
    /// The concurrency limit at the bottom of the stack.
    pub fn concurrency_limit(&self) -> &ConcurrencyLimitEngine<E> {
        self.inner.get_ref().get_ref()
    }
    /// The configuration in force.
    pub fn config(&self) -> &AdapterConfig {
        self.inner.get_ref().config()
    }
    /// The capability report: native, effective, and how each optional
    /// operation is provided with the reason and the version that would make
    /// it native.
    pub fn report(&self) -> CapabilityReport {
        self.inner.get_ref().report()
    }
    /// Start-up check: `Ok` if every operation in `ops` is available
    /// (natively, or emulated when not strict); otherwise
    /// [`Error::MissingCapabilities`] naming every missing one.
    pub fn require(&self, ops: &[Operation]) -> Result<()> {
        self.inner.get_ref().require(ops)
    }
}

#[deny(clippy::missing_trait_methods)]
impl<E: TransferEngine + ?Sized> TransferEngine for CapabilityAdapter<E> {
    forward!(
        backend_name,
        segment_name,
        capabilities,
        backend_info,
        register,
        unregister,
        batch_register,
        batch_unregister,
        open_segment,
        close_segment,
        transfer,
        batch_transfer,
        submit,
        status,
        wait,
        release_batch,
        take_notifications,
        next_notification,
        live_batches,
        inbound,
        shutdown
    );
}

/// The adapter's emulation layer (see the module docs): every optional
/// operation the engine lacks, emulated (or refused in strict mode);
/// calls drained at shutdown; the capability report. It merges no
/// requests and bounds nothing across batches: [`CapabilityAdapter`]
/// stacks a [`CoalesceEngine`] over it and a [`ConcurrencyLimitEngine`]
/// under it for that. The single transfers of a batch it emulates are
/// issued inside [`limited`],
/// [`AdapterConfig::max_concurrency`] at a time per batch.
pub struct EmulationEngine<E: TransferEngine + ?Sized> {
    inner: Arc<E>,
    shared: Arc<Shared>,
}

struct Shared {
    config: AdapterConfig,
    native: Capabilities,
    effective: Capabilities,
    info: BackendInfo,
    /// The batches handed out: driven by an adapter task, or aliases of
    /// the backend's own batches (forwarded as they are).
    batches: BatchTable,
    announced: Mutex<HashSet<Operation>>,
    /// Calls in flight, for `shutdown`'s drain.
    drain: Arc<Drain>,
}

impl<E: TransferEngine + ?Sized> std::fmt::Debug for EmulationEngine<E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EmulationEngine")
            .field("backend", &self.inner.backend_name())
            .field("segment", &self.inner.segment_name())
            .field("config", &self.shared.config)
            .field("native", &self.shared.native)
            .finish()
    }
}

use crate::__private::sync::lock;
use crate::raw::Drain;

impl<E: TransferEngine + ?Sized> EmulationEngine<E> {
    /// Wraps a shared engine with `config` (its coalescing fields are for
    /// the [`CoalesceEngine`] above; this layer merges nothing).
    pub fn from_arc(inner: Arc<E>, mut config: AdapterConfig) -> Self {
        config.max_concurrency = config.max_concurrency.max(1);
        let native = inner.capabilities();
        let effective = config.effective(&native);
        let info = inner.backend_info();
        EmulationEngine {
            inner,
            shared: Arc::new(Shared {
                config,
                native,
                effective,
                info,
                batches: BatchTable::new("adapter"),
                announced: Mutex::new(HashSet::new()),
                drain: Drain::new(),
            }),
        }
    }

    /// The wrapped engine.
    pub fn get_ref(&self) -> &E {
        &self.inner
    }
    /// The wrapped engine, shared.
    pub fn inner(&self) -> &Arc<E> {
        &self.inner
    }
    /// Unwraps, returning the shared inner engine.
    pub fn into_inner(self) -> Arc<E> {
        self.inner
    }
    /// The configuration in force.
    pub fn config(&self) -> &AdapterConfig {
        &self.shared.config
    }

    /// The capability report: native, effective, and how each optional
    /// operation is provided with the reason and the version that would make
    /// it native.
    pub fn report(&self) -> CapabilityReport {
        let s = &self.shared;
        let support = |op: Operation| {
            if s.native.supports(op) {
                match s.info.emulation(op) {
                    Some(via) => Support::Emulated {
                        via: via.to_owned(),
                        missing: s.missing(op),
                    },
                    None => Support::Native,
                }
            } else if s.effective.supports(op) {
                Support::Emulated {
                    via: emulation_of(op).to_owned(),
                    missing: s.missing(op),
                }
            } else {
                Support::Unsupported(s.missing(op))
            }
        };
        CapabilityReport {
            info: s.info.clone(),
            native: s.native,
            effective: s.effective,
            operations: Operation::OPTIONAL.map(|op| (op, support(op))).to_vec(),
            guarantees: Operation::GUARANTEES.map(|op| (op, support(op))).to_vec(),
            strict: s.config.strict,
        }
    }

    /// Start-up check: `Ok` if every operation in `ops` is available
    /// (natively, or emulated when not strict); otherwise
    /// [`Error::MissingCapabilities`] naming every missing one.
    pub fn require(&self, ops: &[Operation]) -> Result<()> {
        let missing: Vec<MissingCapability> = ops
            .iter()
            .filter(|op| !self.shared.effective.supports(**op))
            .map(|op| self.shared.missing(*op))
            .collect();
        if missing.is_empty() {
            Ok(())
        } else {
            Err(Error::MissingCapabilities {
                backend: self.inner.backend_name().to_owned(),
                missing,
            })
        }
    }
}

fn emulation_of(op: Operation) -> &'static str {
    match op {
        Operation::BatchRegister => "single registers, all-or-nothing",
        Operation::BatchUnregister => "single unregisters",
        Operation::BatchTransfer => "single transfers, bounded concurrency",
        Operation::AsyncBatch => "a task per batch",
        Operation::BatchWait => "awaiting the batch task",
        _ => "adapter",
    }
}

impl Shared {
    fn missing(&self, op: Operation) -> MissingCapability {
        let mut m = self
            .info
            .note(op)
            .cloned()
            .unwrap_or_else(|| MissingCapability {
                operation: op,
                reason: format!(
                    "the {} backend does not offer it natively",
                    self.info.backend
                ),
                min_version: None,
            });
        let emulable = !matches!(
            op,
            Operation::Notify | Operation::LandedWrites | Operation::PeerValidation
        );
        if self.config.strict && !self.native.supports(op) && emulable {
            m.reason = format!("{} (strict mode: not emulated)", m.reason);
        }
        if op == Operation::Notify && !self.effective.notify {
            if self.native.notify {
                m.reason = "the backend's notifications need a native batch path".to_owned();
            } else if self.info.note(op).is_none() {
                m.reason = format!(
                    "the {} backend has no channel to deliver notifications; it cannot be emulated",
                    self.info.backend
                );
            }
        }
        m
    }

    fn refuse(&self, op: Operation) -> Error {
        let m = self.missing(op);
        Error::Unsupported {
            backend: self.info.backend.clone(),
            operation: op,
            reason: m.reason,
            min_version: m.min_version,
        }
    }

    /// Emits the once-per-engine-and-operation tracing event for emulation.
    fn announce(&self, op: Operation) {
        if lock(&self.announced).insert(op) {
            tracing::info!(
                backend = %self.info.backend,
                operation = %op,
                via = emulation_of(op),
                "ferry: emulating an operation the backend lacks natively"
            );
        }
    }
}

/// Executes already-coalesced `requests` on `inner`, natively where possible,
/// returning one result per request. `Err` = refused as a whole.
async fn execute<E: TransferEngine + ?Sized>(
    inner: &Arc<E>,
    shared: &Shared,
    segment: SegmentId,
    requests: &[TransferRequest],
    notify: Option<&Notification>,
) -> Result<Vec<Result<()>>> {
    let native = &shared.native;
    if native.batch_transfer || native.async_batch {
        let chunk = native.max_batch_len.unwrap_or(usize::MAX).max(1);
        let mut results = Vec::with_capacity(requests.len());
        let mut chunks: Vec<&[TransferRequest]> = requests.chunks(chunk).collect();
        if chunks.is_empty() {
            chunks.push(&[]);
        }
        let last = chunks.len() - 1;
        for (i, part) in chunks.into_iter().enumerate() {
            let all_ok = results.iter().all(Result::is_ok);
            let note = if i == last && all_ok { notify } else { None };
            let report = if native.batch_transfer {
                inner.batch_transfer(segment, part, note).await
            } else {
                match inner.submit(segment, part, note).await {
                    Ok(id) => {
                        // The caller never sees this id: if this future is
                        // dropped, finish and release the batch anyway.
                        let orphan = Orphan::new(inner, shared.native.batch_wait, id);
                        let r = wait_inner(inner, shared, id).await;
                        orphan.disarm();
                        r
                    }
                    Err(e) => Err(e),
                }
            };
            match report {
                Ok(report) => results.extend(report.results),
                // The first chunk refused: nothing moved, refuse the batch.
                Err(e) if i == 0 => return Err(e),
                // A later chunk refused after earlier ones moved bytes: the
                // batch is not "refused as a whole" any more; its requests
                // fail one by one.
                Err(e) => results.extend(std::iter::repeat_n(Err(e), part.len())),
            }
        }
        return Ok(results);
    }
    if notify.is_some() {
        return Err(shared.refuse(Operation::Notify));
    }
    shared.announce(Operation::BatchTransfer);
    // `limited`: a concurrency limit below counts these, not a caller's
    // own transfers. The window keeps one batch from making more futures
    // than that limit lets run.
    let results = stream::iter(requests.iter().copied().enumerate())
        .map(|(i, r)| async move { (i, limited(inner.transfer(segment, r)).await) })
        .buffer_unordered(shared.config.max_concurrency)
        .collect::<Vec<_>>()
        .await;
    let mut ordered: Vec<Result<()>> = vec![Ok(()); requests.len()];
    for (i, r) in results {
        ordered[i] = r;
    }
    // A native batch refuses an unknown segment as a whole; so does the
    // emulation (every single transfer was refused, nothing moved).
    if let Some(Err(Error::UnknownSegment(seg))) = ordered.first() {
        let seg = *seg;
        if ordered
            .iter()
            .all(|r| matches!(r, Err(Error::UnknownSegment(s)) if *s == seg))
        {
            return Err(Error::UnknownSegment(seg));
        }
    }
    Ok(ordered)
}

/// Waits for a native async batch: native `wait` if there is one, else
/// `status` polling with backoff (yields first, then sleeps up to 5 ms).
async fn wait_inner<E: TransferEngine + ?Sized>(
    inner: &Arc<E>,
    shared: &Shared,
    id: BatchId,
) -> Result<BatchReport> {
    if shared.native.batch_wait {
        return inner.wait(id).await;
    }
    let mut polls = 0u32;
    loop {
        let status = match inner.status(id) {
            Ok(st) => st,
            Err(e) => {
                // Best effort, so that the backend does not keep the batch.
                let _ = inner.release_batch(id).await;
                return Err(e);
            }
        };
        if let Some(report) = status.to_report() {
            inner.release_batch(id).await?;
            return Ok(report);
        }
        polls += 1;
        if polls < 16 {
            tokio::task::yield_now().await;
        } else {
            let ms = u64::from((polls - 15).min(5));
            tokio::time::sleep(Duration::from_millis(ms)).await;
        }
    }
}

/// A backend batch the adapter submitted for itself; dropped while armed
/// (the waiting future was dropped), it finishes and releases the batch on
/// a spawned task, so that the backend's batch table does not keep it.
struct Orphan<E: TransferEngine + ?Sized> {
    inner: Option<Arc<E>>,
    native_wait: bool,
    id: BatchId,
}

impl<E: TransferEngine + ?Sized> Orphan<E> {
    fn new(inner: &Arc<E>, native_wait: bool, id: BatchId) -> Self {
        Orphan {
            inner: Some(Arc::clone(inner)),
            native_wait,
            id,
        }
    }

    fn disarm(mut self) {
        self.inner = None;
    }
}

impl<E: TransferEngine + ?Sized> Drop for Orphan<E> {
    fn drop(&mut self) {
        let Some(inner) = self.inner.take() else {
            return;
        };
        let (id, native_wait) = (self.id, self.native_wait);
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            tracing::warn!(batch = %id, "an abandoned batch stays in the backend (no runtime)");
            return;
        };
        rt.spawn(async move {
            if native_wait {
                let _ = inner.wait(id).await;
                return;
            }
            loop {
                match inner.status(id) {
                    Ok(st) if st.is_finished() => {
                        let _ = inner.release_batch(id).await;
                        return;
                    }
                    Ok(_) => tokio::time::sleep(Duration::from_millis(5)).await,
                    Err(_) => return,
                }
            }
        });
    }
}

/// The emulation's batch path: [`execute`] (the coalescing layer above
/// has merged what it merges).
async fn run_batch<E: TransferEngine + ?Sized>(
    inner: &Arc<E>,
    shared: &Shared,
    segment: SegmentId,
    requests: &[TransferRequest],
    notify: Option<&Notification>,
) -> Result<Vec<Result<()>>> {
    execute(inner, shared, segment, requests, notify).await
}

#[deny(clippy::missing_trait_methods)]
impl<E: TransferEngine + ?Sized> TransferEngine for EmulationEngine<E> {
    fn backend_name(&self) -> &str {
        self.inner.backend_name()
    }

    fn segment_name(&self) -> &str {
        self.inner.segment_name()
    }

    fn capabilities(&self) -> Capabilities {
        self.shared.effective
    }

    fn backend_info(&self) -> BackendInfo {
        self.inner.backend_info()
    }

    async fn register(&self, region: MemoryRegion) -> Result<()> {
        let _active = self.shared.drain.enter("register")?;
        self.inner.register(region).await
    }

    async fn unregister(&self, addr: u64) -> Result<()> {
        self.inner.unregister(addr).await
    }

    async fn batch_register(&self, regions: Vec<MemoryRegion>) -> Result<()> {
        let _active = self.shared.drain.enter("batch_register")?;
        let s = &self.shared;
        if s.native.batch_register {
            return self.inner.batch_register(regions).await;
        }
        if !s.effective.batch_register {
            return Err(s.refuse(Operation::BatchRegister));
        }
        s.announce(Operation::BatchRegister);
        // All or nothing, also when this future is dropped half-way: the
        // rollback then runs on a task of its own.
        let mut done = Rollback {
            inner: Arc::clone(&self.inner),
            addrs: Vec::with_capacity(regions.len()),
        };
        for (index, region) in regions.into_iter().enumerate() {
            let addr = region.addr();
            if let Err(source) = self.inner.register(region).await {
                done.run().await;
                return Err(Error::BatchRegisterFailed {
                    index,
                    addr,
                    source: Box::new(source),
                });
            }
            done.addrs.push(addr);
        }
        done.addrs.clear();
        Ok(())
    }

    async fn batch_unregister(&self, addrs: &[u64]) -> Result<()> {
        let s = &self.shared;
        if s.native.batch_unregister {
            return self.inner.batch_unregister(addrs).await;
        }
        if !s.effective.batch_unregister {
            return Err(s.refuse(Operation::BatchUnregister));
        }
        s.announce(Operation::BatchUnregister);
        let mut first = None;
        for &addr in addrs {
            if let Err(e) = self.inner.unregister(addr).await {
                first.get_or_insert(e);
            }
        }
        first.map_or(Ok(()), Err)
    }

    async fn open_segment(&self, name: &str) -> Result<SegmentId> {
        let _active = self.shared.drain.enter("open_segment")?;
        self.inner.open_segment(name).await
    }

    async fn close_segment(&self, segment: SegmentId) -> Result<()> {
        self.inner.close_segment(segment).await
    }

    async fn transfer(&self, segment: SegmentId, request: TransferRequest) -> Result<()> {
        let _active = self.shared.drain.enter("transfer")?;
        self.inner.transfer(segment, request).await
    }

    async fn batch_transfer(
        &self,
        segment: SegmentId,
        requests: &[TransferRequest],
        notify: Option<&Notification>,
    ) -> Result<BatchReport> {
        let _active = self.shared.drain.enter("batch_transfer")?;
        let s = &self.shared;
        if !s.effective.batch_transfer {
            return Err(s.refuse(Operation::BatchTransfer));
        }
        if let Some(n) = notify {
            if !s.effective.notify {
                return Err(s.refuse(Operation::Notify));
            }
            n.validate()?;
        }
        let results = run_batch(&self.inner, s, segment, requests, notify).await?;
        Ok(BatchReport { results })
    }

    async fn submit(
        &self,
        segment: SegmentId,
        requests: &[TransferRequest],
        notify: Option<&Notification>,
    ) -> Result<BatchId> {
        let _active = self.shared.drain.enter("submit")?;
        let s = &self.shared;
        if !s.effective.async_batch {
            return Err(s.refuse(Operation::AsyncBatch));
        }
        if let Some(n) = notify {
            if !s.effective.notify {
                return Err(s.refuse(Operation::Notify));
            }
            n.validate()?;
        }
        if !s.native.async_batch {
            s.announce(Operation::AsyncBatch);
        }
        // The backend's own async batch, when it can take this one as is:
        // within its length limit, and the notification native too.
        let forward = s.native.async_batch
            && (notify.is_none() || s.native.notify)
            && s.native
                .max_batch_len
                .is_none_or(|max| requests.len() <= max);
        if forward {
            // Refused before the backend takes a batch nobody could name.
            if s.batches.is_full() {
                return Err(crate::live_batches_full("adapter"));
            }
            let inner_id = self.inner.submit(segment, requests, notify).await?;
            return match s.batches.forward(inner_id) {
                Ok(id) => Ok(id),
                Err(e) => {
                    // Filled up meanwhile: the backend's batch is nobody's.
                    drop(Orphan::new(&self.inner, s.native.batch_wait, inner_id));
                    Err(e)
                }
            };
        }
        let admission = s.batches.admit(requests.len())?;
        let inline = requests.is_empty() || tokio::runtime::Handle::try_current().is_err();
        let inner = Arc::clone(&self.inner);
        let shared = Arc::clone(&self.shared);
        let requests = requests.to_vec();
        let notify = notify.cloned();
        let driver = admission.driver().clone();
        // The batch counts as a call in flight until it ends.
        let active = s.drain.enter("submit")?;
        let drive = async move {
            let _active = active;
            let n = requests.len();
            let results = run_batch(&inner, &shared, segment, &requests, notify.as_ref()).await;
            report_into(&driver, n, results)
        };
        if inline {
            // Nothing to run but the notification (do it now, so that the
            // batch is finished for `status` exactly when it has been sent,
            // and a refused one refuses the batch), or no runtime to run a
            // task on (the batch runs to the end here: the backend must work
            // without one).
            drive.await?;
        } else {
            tokio::spawn(drive);
        }
        Ok(admission.claim())
    }

    fn status(&self, batch: BatchId) -> Result<BatchStatus> {
        let s = &self.shared;
        if !s.effective.async_batch {
            return Err(s.refuse(Operation::AsyncBatch));
        }
        match s.batches.forwarded(batch)? {
            Some(inner) => self.inner.status(inner),
            None => s.batches.status(batch),
        }
    }

    async fn wait(&self, batch: BatchId) -> Result<BatchReport> {
        let s = &self.shared;
        if !s.effective.batch_wait || !s.effective.async_batch {
            return Err(s.refuse(Operation::BatchWait));
        }
        if !s.native.batch_wait {
            s.announce(Operation::BatchWait);
        }
        match s.batches.forwarded(batch)? {
            Some(inner) => {
                // `wait_inner` releases the backend's batch when done.
                let report = wait_inner(&self.inner, s, inner).await?;
                s.batches.remove(batch);
                Ok(report)
            }
            None => s.batches.wait(batch).await,
        }
    }

    async fn release_batch(&self, batch: BatchId) -> Result<()> {
        let s = &self.shared;
        if !s.effective.async_batch {
            return Err(s.refuse(Operation::AsyncBatch));
        }
        match s.batches.forwarded(batch)? {
            Some(inner) => {
                self.inner.release_batch(inner).await.map_err(|e| match e {
                    Error::BatchBusy(_) => Error::BatchBusy(batch),
                    other => other,
                })?;
                s.batches.remove(batch);
                Ok(())
            }
            None => s.batches.release(batch),
        }
    }

    async fn take_notifications(&self) -> Result<Vec<Notification>> {
        // The effective set, not the native one: notifications the adapter
        // cannot send (no native batch path) are not offered at all.
        if !self.shared.effective.notify {
            return Err(self.shared.refuse(Operation::Notify));
        }
        self.inner.take_notifications().await
    }

    async fn next_notification(&self, name: Option<&str>) -> Result<Notification> {
        // Not counted (it waits without a bound, a drain must not wait for
        // it): refused once shut down; a waiter already in the backend ends
        // with `Canceled` when the backend stops.
        if self.shared.drain.is_closed() {
            return Err(Error::Canceled(
                "next_notification: the engine is shutting down".to_owned(),
            ));
        }
        if !self.shared.effective.notify {
            return Err(self.shared.refuse(Operation::Notify));
        }
        self.inner.next_notification(name).await
    }

    fn live_batches(&self) -> Option<usize> {
        // The backend's count includes the batches forwarded as aliases and
        // those the adapter submitted for itself.
        self.inner
            .live_batches()
            .map(|n| n + self.shared.batches.tracked_len())
    }

    fn inbound(&self) -> Option<crate::inbound::Inbound> {
        self.inner.inbound()
    }

    async fn shutdown(&self) -> Result<()> {
        let s = &self.shared;
        s.drain.close();
        // The calls in flight, and the batches the adapter runs itself
        // (each task holds a guard), end as usual.
        s.drain.idle().await;
        // The batches forwarded to the backend run to their end too; their
        // ids are gone afterwards, as every call is refused from now on.
        for (id, inner) in s.batches.forwarded_all() {
            let _ = wait_inner(&self.inner, s, inner).await;
            s.batches.remove(id);
        }
        self.inner.shutdown().await
    }
}

/// Registrations made by an emulated `batch_register` that are undone if
/// it fails, or if its future is dropped before it finished.
struct Rollback<E: TransferEngine + ?Sized> {
    inner: Arc<E>,
    /// Registered so far, in order.
    addrs: Vec<u64>,
}

impl<E: TransferEngine + ?Sized> Rollback<E> {
    async fn run(&mut self) {
        for addr in std::mem::take(&mut self.addrs).into_iter().rev() {
            if let Err(e) = self.inner.unregister(addr).await {
                tracing::warn!(addr, error = %e, "rollback unregister failed");
            }
        }
    }
}

impl<E: TransferEngine + ?Sized> Drop for Rollback<E> {
    fn drop(&mut self) {
        if self.addrs.is_empty() {
            return;
        }
        let mut rest = Rollback {
            inner: Arc::clone(&self.inner),
            addrs: std::mem::take(&mut self.addrs),
        };
        match tokio::runtime::Handle::try_current() {
            Ok(rt) => {
                rt.spawn(async move { rest.run().await });
            }
            Err(_) => {
                tracing::warn!(
                    regions = rest.addrs.len(),
                    "a canceled batch_register left regions registered (no runtime to undo them)"
                );
                rest.addrs.clear();
            }
        }
    }
}

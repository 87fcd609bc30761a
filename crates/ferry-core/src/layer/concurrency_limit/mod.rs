//! [`ConcurrencyLimitLayer`]: at most `max` of the single transfers that
//! emulated batches are made of in flight at once.
//!
//! # What it limits
//!
//! Only `transfer` calls made inside [`limited`]: that is how the
//! [`EmulationEngine`](crate::EmulationEngine) issues the single
//! transfers of a batch it emulates (a `batch_transfer`, or the task of a
//! `submit`, on a backend with neither native batch path; also the
//! request-by-request retry of a merged request). Such a call waits for
//! one of the layer's `max` permits before it reaches the inner engine and
//! holds it until it returns or is dropped, so however many batches run
//! at once, at most `max` of their transfers are in flight below this
//! layer.
//!
//! Everything else passes straight through, unlimited: a caller's own
//! `transfer` (one call is one transfer; the caller chose how many to run
//! at once), native batches (`batch_transfer`, `submit`, `wait`: the
//! backend bounds its own work), registration, segments, notifications,
//! `shutdown`. Capabilities and the backend's report are the inner
//! engine's: the layer changes which calls wait, never what they do.
//!
//! # Where it sits
//!
//! Under the emulation layer: the
//! [`CapabilityAdapter`](crate::CapabilityAdapter) is
//! [`CoalesceEngine`](crate::layer::CoalesceEngine) over
//! [`EmulationEngine`](crate::EmulationEngine) over
//! `ConcurrencyLimitEngine` over the backend, with `max` =
//! [`AdapterConfig::max_concurrency`](crate::AdapterConfig::max_concurrency)
//! (the `max_concurrency=N` URL parameter). One limit per engine: each
//! engine the layer wraps gets permits of its own, shared by all the
//! batches of every emulation above it. Stacked over an engine with no
//! emulation above, it limits only the caller's calls made inside
//! [`limited`].
//!
//! # Why a mark on the call
//!
//! Below the emulation a caller's `transfer` and an emulated batch's
//! single transfer are the same call, and the trait carries no per-call
//! context to tell them apart. [`limited`] marks a future (a
//! `tokio::task_local!` value, set while that future is polled, with or
//! without a runtime), and this layer looks for the mark when its
//! `transfer` starts. Layers between the two see nothing; one that moved
//! the inner call to another task would lose the mark (none of Ferry's
//! does).
//!
//! ```
//! use std::sync::Arc;
//!
//! use ferry_core::inproc::InprocEngine;
//! use ferry_core::layer::concurrency_limit::limited;
//! use ferry_core::layer::{CoalesceLayer, ConcurrencyLimitLayer, LayerExt};
//! use ferry_core::{
//!     AdapterConfig, Capabilities, CapabilityAdapter, EmulationLayer, RegisteredBuffer,
//!     TransferEngine, TransferRequest,
//! };
//!
//! # tokio::runtime::Runtime::new().unwrap().block_on(async {
//! // The adapter's stack, built by hand: at most 4 of the single transfers
//! // that emulate batches in flight at once.
//! let config = AdapterConfig::builder().max_concurrency(4).build()?;
//! let engine = Arc::new(
//!     InprocEngine::auto(Capabilities::default())
//!         .layer(ConcurrencyLimitLayer::new(4))
//!         .layer(EmulationLayer::new(config.clone()))
//!         .layer(CoalesceLayer::default()),
//! );
//! let adapter = CapabilityAdapter::with_config(InprocEngine::auto(Capabilities::default()), config);
//! assert_eq!(engine.capabilities(), adapter.capabilities());
//! let limit = engine.get_ref().get_ref();
//! assert_eq!((limit.max(), limit.in_flight()), (4, 0));
//!
//! // An emulated batch of 64 single transfers, 4 at a time at most ...
//! let src = RegisteredBuffer::new(Arc::clone(&engine), 64 * 4096).await?;
//! let dst = RegisteredBuffer::new(Arc::clone(&engine), 64 * 4096).await?;
//! let seg = engine.open_segment(engine.segment_name()).await?;
//! let blocks: Vec<TransferRequest> = (0..64u64)
//!     .map(|i| TransferRequest::write(src.addr() + i * 4096, dst.addr() + (63 - i) * 4096, 4096))
//!     .collect();
//! engine.batch_transfer(seg, &blocks, None).await?.into_result()?;
//! // ... while the caller's own transfers are not limited, unless the
//! // caller asks.
//! engine.transfer(seg, blocks[0]).await?;
//! limited(engine.transfer(seg, blocks[1])).await?;
//! assert_eq!(limit.in_flight(), 0);
//! # src.release().await?;
//! # dst.release().await?;
//! # Ok::<(), ferry_core::Error>(())
//! # }).unwrap();
//! ```

use std::fmt;
use std::future::Future;
use std::sync::Arc;

use tokio::sync::Semaphore;

use crate::engine::TransferEngine;
use crate::error::Result;
use crate::layer::Layer;
use crate::types::{SegmentId, TransferRequest};

tokio::task_local! {
    /// Set while a future passed to [`limited`] is polled.
    static LIMITED: ();
}

/// Runs `fut` with its `transfer` calls subject to every
/// [`ConcurrencyLimitEngine`] they reach (see the module docs). The
/// emulation wraps the single transfers of each batch it emulates in it;
/// a caller may wrap its own.
pub fn limited<F: Future>(fut: F) -> impl Future<Output = F::Output> {
    LIMITED.scope((), fut)
}

/// Whether the calling future runs inside [`limited`].
fn is_limited() -> bool {
    LIMITED.try_with(|()| ()).is_ok()
}

/// [`Layer`] that wraps engines in a [`ConcurrencyLimitEngine`] with
/// `max` permits of its own each.
#[derive(Clone, Copy, Debug)]
pub struct ConcurrencyLimitLayer {
    max: usize,
}

impl ConcurrencyLimitLayer {
    /// At most `max` limited transfers in flight per wrapped engine (`0`
    /// counts as 1, as [`AdapterConfig::validate`](crate::AdapterConfig::validate)
    /// refuses it).
    pub fn new(max: usize) -> Self {
        ConcurrencyLimitLayer { max: max.max(1) }
    }
}

/// The default limit (also the adapter's `max_concurrency`).
pub(crate) const DEFAULT_MAX_CONCURRENCY: usize = 16;

impl Default for ConcurrencyLimitLayer {
    /// The adapter's default, 16.
    fn default() -> Self {
        ConcurrencyLimitLayer::new(DEFAULT_MAX_CONCURRENCY)
    }
}

impl<E: TransferEngine> Layer<E> for ConcurrencyLimitLayer {
    type Engine = ConcurrencyLimitEngine<E>;
    fn layer(&self, inner: E) -> ConcurrencyLimitEngine<E> {
        ConcurrencyLimitEngine::from_arc(Arc::new(inner), self.max)
    }
}

/// Holds back the `transfer` calls made inside [`limited`] so that at
/// most `max` are in flight in its inner engine at once; forwards
/// everything else as it is (see the module docs). Capabilities are the
/// inner engine's.
pub struct ConcurrencyLimitEngine<E: ?Sized> {
    inner: Arc<E>,
    max: usize,
    /// `max` permits; never closed.
    permits: Semaphore,
}

impl<E: TransferEngine + ?Sized> fmt::Debug for ConcurrencyLimitEngine<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ConcurrencyLimitEngine")
            .field("backend", &self.inner.backend_name())
            .field("max", &self.max)
            .field("in_flight", &self.in_flight())
            .finish_non_exhaustive()
    }
}

impl<E: ?Sized> ConcurrencyLimitEngine<E> {
    /// Wraps an engine that is already shared (e.g. `Arc<dyn
    /// DynTransferEngine>`), with `max` permits (`0` counts as 1).
    pub fn from_arc(inner: Arc<E>, max: usize) -> Self {
        let max = max.max(1);
        ConcurrencyLimitEngine {
            inner,
            max,
            permits: Semaphore::new(max),
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
    /// Most limited transfers in flight at once.
    pub fn max(&self) -> usize {
        self.max
    }
    /// Limited transfers in flight now (each holds a permit).
    pub fn in_flight(&self) -> usize {
        self.max - self.permits.available_permits()
    }
}

#[deny(clippy::missing_trait_methods)]
impl<E: TransferEngine + ?Sized> TransferEngine for ConcurrencyLimitEngine<E> {
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

    async fn transfer(&self, segment: SegmentId, request: TransferRequest) -> Result<()> {
        // Looked for at the first poll (inside the caller's `limited`),
        // not when the future was made. The permit is held until the inner
        // call returns or this future is dropped; `acquire` fails only on
        // a closed semaphore, and this one is never closed.
        let _permit = if is_limited() {
            self.permits.acquire().await.ok()
        } else {
            None
        };
        self.inner.transfer(segment, request).await
    }
}

#[cfg(test)]
mod tests;

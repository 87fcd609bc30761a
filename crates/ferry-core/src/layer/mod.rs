//! Layers with one job each (tower's `Layer` shape, OpenDAL's layers):
//! [`MetricsLayer`] counts, [`TracingLayer`] opens a span per batch,
//! [`TimeoutLayer`] puts a deadline on every call that waits on a peer,
//! [`CoalesceLayer`] merges contiguous requests of a batch,
//! [`EmulationLayer`](crate::EmulationLayer) emulates what the engine lacks
//! (with a drain at shutdown and the capability report),
//! [`ConcurrencyLimitLayer`] bounds the single transfers an emulation
//! above it issues for its batches. The
//! [`CapabilityAdapter`](crate::CapabilityAdapter) is the last three
//! stacked, coalescing over emulation over the limit
//! (`ferry/tests/layers.rs` runs the conformance suite through the three
//! stacked by hand, and checks that they report what the adapter
//! reports).
//!
//! Each wrapper forwards every [`TransferEngine`](crate::TransferEngine)
//! method (`#[deny(clippy::missing_trait_methods)]`) and leaves the
//! capabilities of its inner engine as they are: stack them in any order,
//! over the [`CapabilityAdapter`](crate::CapabilityAdapter) or under it.
//!
//! ```
//! use ferry_core::inproc::InprocEngine;
//! use ferry_core::layer::{LayerExt, Metrics, MetricsLayer, TimeoutLayer, TracingLayer};
//! use ferry_core::{Capabilities, CapabilityAdapter, TransferEngine};
//! use std::time::Duration;
//!
//! let metrics = Metrics::new();
//! let engine = CapabilityAdapter::new(InprocEngine::auto(Capabilities::default()))
//!     .layer(TimeoutLayer::new(Duration::from_secs(30)))
//!     .layer(MetricsLayer::new(metrics.clone()))
//!     .layer(TracingLayer::new());
//! assert_eq!(engine.backend_name(), "inproc");
//! // Nothing moved yet; the exposition is OpenMetrics text.
//! assert_eq!(engine.get_ref().snapshot().bytes_total(), 0);
//! assert!(metrics.encode().ends_with("# EOF\n"));
//! ```

pub(crate) mod coalesce;
pub mod concurrency_limit;
pub mod metrics;
mod peers;
pub mod timeout;
pub mod tracing;

pub use concurrency_limit::{ConcurrencyLimitEngine, ConcurrencyLimitLayer};
pub use metrics::{Metrics, MetricsEngine, MetricsLayer, MetricsSnapshot, PeerSnapshot};
pub use timeout::{TimeoutEngine, TimeoutLayer};
pub use tracing::{TracingEngine, TracingLayer};

pub use coalesce::{CoalesceEngine, CoalesceLayer};

/// Builds a wrapper around an engine (tower's `Layer` shape).
pub trait Layer<E> {
    /// The wrapped engine type.
    type Engine;
    /// Wraps `inner`.
    fn layer(&self, inner: E) -> Self::Engine;
}

/// `engine.layer(L)` on every engine: wraps it in `L` (so that layers
/// chain: `engine.layer(a).layer(b)`; `b` ends up outermost).
pub trait LayerExt: crate::TransferEngine + Sized {
    /// Wraps `self` in `layer`.
    fn layer<L: Layer<Self>>(self, layer: L) -> L::Engine {
        layer.layer(self)
    }
}

impl<E: crate::TransferEngine> LayerExt for E {}

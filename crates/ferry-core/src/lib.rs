//! # ferry-core
//!
//! The contract every Ferry transport implements, and the machinery around
//! it:
//!
//! - [`TransferEngine`]: Mooncake's model (engines, registered regions,
//!   segments, raw remote addresses) as one async trait with optional batch
//!   operations;
//! - [`Capabilities`]: what a backend does natively;
//! - [`CapabilityAdapter`]: gives any engine the whole trait, emulating what
//!   it lacks with the same observable semantics, or refusing up front in
//!   strict mode;
//! - [`layer`]: [`MetricsLayer`] (Prometheus metrics), [`TracingLayer`]
//!   (a span per batch), [`TimeoutLayer`] (a deadline per call), and the
//!   adapter's own three (coalescing, [`EmulationLayer`],
//!   [`ConcurrencyLimitLayer`]), stacked with [`Layer`];
//! - [`RegionTable`]: the bounds-checked, in-flight-aware table of registered
//!   regions that backends share;
//! - [`HostBuffer`] / [`RegisteredBuffer`] / [`RegisteredBuffers`]: safe owned
//!   memory, registered for as long as it lives;
//! - `conformance` (feature): the behaviour suite every backend passes;
//! - `inproc` (feature): an in-process engine with configurable capabilities.
//!
//! # A prefill → decode hand-off
//!
//! The call sequence of disaggregated serving: the decode node registers its
//! KV cache and tells the prefill node (out of band) its segment name, the
//! cache's address and which blocks to fill; the prefill node opens the
//! segment, writes the finished blocks in one batch with a notification,
//! and the decode node starts decoding once it takes the notification. Here
//! both nodes are in-process engines; with a network backend only the engine
//! construction changes.
//!
//! ```
//! # #[cfg(feature = "inproc")]
//! # fn main() -> ferry_core::Result<()> {
//! use std::sync::Arc;
//!
//! use ferry_core::inproc::InprocEngine;
//! use ferry_core::{
//!     CapabilityAdapter, Capabilities, DynTransferEngine, Notification, RegisteredBuffer, TransferEngine,
//!     TransferRequest,
//! };
//!
//! const BLOCK: usize = 4096; // bytes of one KV block
//! # tokio::runtime::Runtime::new().unwrap().block_on(async {
//! // What these in-process engines do natively.
//! let mut caps = Capabilities::default();
//! caps.batch_transfer = true;
//! caps.notify = true;
//! // Decode node: a KV cache of 16 blocks, registered with its engine.
//! let decode: Arc<dyn DynTransferEngine> = Arc::new(CapabilityAdapter::new(InprocEngine::new(
//!     "decode-0",
//!     caps,
//! )?));
//! let kv_cache = RegisteredBuffer::new(Arc::clone(&decode), 16 * BLOCK).await?;
//! // Sent to the prefill node with the request: where to put the 3 blocks.
//! let (segment, kv_base, dst_blocks) = ("decode-0", kv_cache.addr(), [9u64, 2, 5]);
//!
//! // Prefill node: computes the blocks into its own registered memory ...
//! let prefill: Arc<dyn DynTransferEngine> = Arc::new(CapabilityAdapter::new(InprocEngine::new(
//!     "prefill-0",
//!     caps,
//! )?));
//! let staging = RegisteredBuffer::new(Arc::clone(&prefill), 3 * BLOCK).await?;
//! let computed: Vec<u8> = (0..3 * BLOCK).map(|i| (i % 251) as u8).collect();
//! staging.memory().write(0, &computed)?;
//!
//! // ... opens the decode node's segment and writes every block in one
//! // batch; the notification is delivered after all of them have landed.
//! let peer = prefill.open_segment(segment).await?;
//! let requests: Vec<TransferRequest> = dst_blocks
//!     .iter()
//!     .enumerate()
//!     .map(|(i, &b)| {
//!         let src = staging.addr() + (i * BLOCK) as u64;
//!         TransferRequest::write(src, kv_base + b * BLOCK as u64, BLOCK as u64)
//!     })
//!     .collect();
//! let done = Notification::new("prefill-0", "req-42:kv-ready");
//! let report = prefill.batch_transfer(peer, &requests, Some(&done)).await?;
//! report.into_result()?; // Err(BatchFailed) names the failed request
//! prefill.close_segment(peer).await?;
//!
//! // Decode node: the notification says the blocks are in place.
//! // (`next_notification` waits for it; wrap it in a timeout in real code.)
//! let note = decode.next_notification(Some("prefill-0")).await?;
//! assert_eq!(note, done);
//! for (i, &b) in dst_blocks.iter().enumerate() {
//!     let mut block = vec![0u8; BLOCK];
//!     kv_cache.memory().read(b as usize * BLOCK, &mut block)?;
//!     assert_eq!(block, computed[i * BLOCK..(i + 1) * BLOCK]);
//! }
//!
//! // Unregister before freeing (waits for transfers still in flight).
//! staging.release().await?;
//! kv_cache.release().await?;
//! # Ok(())
//! # })
//! # }
//! # #[cfg(not(feature = "inproc"))]
//! # fn main() {}
//! ```
#![deny(unsafe_op_in_unsafe_fn)]

#[macro_use]
mod forward;

pub mod adapter;
pub mod assist;
mod auth;
pub mod batch;
pub mod buffer;
mod builder;
pub mod caps;
#[cfg(feature = "dlopen")]
mod dl;
mod drain;
pub mod engine;
pub mod error;
mod fast;
mod ids;
pub mod inbound;
mod inbox;
pub mod layer;
pub(crate) mod operation;
mod redact;
pub mod region_table;
mod secret;
mod span;
pub mod types;
mod url;
mod within;

#[cfg(feature = "conformance")]
pub mod conformance;
#[cfg(feature = "inproc")]
pub mod inproc;

pub use adapter::{
    AdapterConfig, AdapterLayer, CapabilityAdapter, EmulationEngine, EmulationLayer, Layer,
};
pub use buffer::{HostBuffer, RegisteredBuffer, RegisteredBuffers};
pub use caps::{
    BackendInfo, Capabilities, CapabilityReport, MemoryKinds, MissingCapability, Operation, Support,
};
pub use engine::{BoxFuture, DynTransferEngine, TransferEngine};
pub use error::{live_batches_full, Error, ErrorKind, IoSource, Queue, Result, Retry, Side};
pub use fast::{FastCall, FastPath};
pub use inbound::{Inbound, InboundSnapshot, NotificationsDropped, ServedCounts};
pub use layer::{
    ConcurrencyLimitLayer, Metrics, MetricsLayer, MetricsSnapshot, TimeoutLayer, TracingLayer,
};
pub use region_table::{RegionGuard, RegionTable};
pub use secret::Secret;
pub use span::{LocalSpan, RemoteSpan};
pub use types::{
    BatchId, BatchReport, BatchStatus, Location, MemoryRegion, Notification, RegionInfo, SegmentId,
    TransferOp, TransferRequest, TransferState, MAX_LIVE_BATCHES, MAX_NOTIFICATION_MESSAGE,
    MAX_NOTIFICATION_NAME,
};
pub use within::TransferEngineExt;

/// What backend authors need and users do not (OpenDAL's `raw`): the
/// region table that guards memory while transfers use it, the adapter as a
/// tower-style layer, request coalescing, the error for a full batch
/// table, and the one parser of configuration URLs ([`raw::ParsedUrl`])
/// with its redaction helper.
pub mod raw {
    pub use crate::adapter::{coalesce, AdapterLayer, CoalescedBatch, Layer};
    pub use crate::batch::{BatchDriver, BatchTable};
    pub use crate::drain::{Active, Admitted, Drain};
    pub use crate::engine::{batch_register_in_each, register_in_each};
    pub use crate::error::live_batches_full;
    pub use crate::inbox::{notification_cost, Closed, Inbox, PushRefused};
    pub use crate::layer::{CoalesceEngine, CoalesceLayer};
    pub use crate::redact::{is_secret_key, redact_url};
    pub use crate::region_table::{RegionGuard, RegionTable, Removal};
    pub use crate::url::ParsedUrl;

    /// Loading a backend's C library at run time (feature `dlopen`): the
    /// path's source, the open with the flags every C-API backend needs,
    /// the symbol checks.
    #[cfg(feature = "dlopen")]
    pub mod dl {
        pub use crate::dl::{c_string, choose, loaded_from, CLibrary, LibrarySource};
    }

    /// HMAC-SHA256 challenge–response primitives for the backends'
    /// shared-secret handshakes.
    pub mod auth {
        pub use crate::auth::{nonce, proof, verify, MAC_LEN, NONCE_LEN};
    }
}

/// For Ferry's own crates only: not part of the API, not covered by semver,
/// hidden from the documentation and from the public-API listing.
#[doc(hidden)]
pub mod __private {
    pub use tokio;

    /// Poison-ignoring lock helpers shared by the workspace's crates.
    pub mod sync {
        use std::sync::{Mutex, MutexGuard, RwLock, RwLockReadGuard, RwLockWriteGuard};

        /// Locks `m`, using the data even if a thread panicked while holding it.
        /// For critical sections that leave the data consistent at every step
        /// (single map or vector operations), where poisoning says nothing.
        pub fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
            m.lock().unwrap_or_else(|p| p.into_inner())
        }

        /// [`lock`] for readers of an `RwLock`.
        pub fn read<T>(m: &RwLock<T>) -> RwLockReadGuard<'_, T> {
            m.read().unwrap_or_else(|p| p.into_inner())
        }

        /// [`lock`] for writers of an `RwLock`.
        pub fn write<T>(m: &RwLock<T>) -> RwLockWriteGuard<'_, T> {
            m.write().unwrap_or_else(|p| p.into_inner())
        }

        /// [`lock`] through `&mut` (no locking needed, poisoning ignored).
        pub fn get_mut<T>(m: &mut Mutex<T>) -> &mut T {
            m.get_mut().unwrap_or_else(|p| p.into_inner())
        }
    }
}

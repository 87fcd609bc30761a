//! # transport-core
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
//! - [`RegionTable`]: the bounds-checked, in-flight-aware table of registered
//!   regions that backends share;
//! - [`HostBuffer`] / [`RegisteredBuffer`]: safe owned memory;
//! - `conformance` (feature): the behaviour suite every backend passes;
//! - `inproc` (feature): an in-process engine with configurable capabilities.
#![deny(unsafe_op_in_unsafe_fn)]

pub mod adapter;
pub mod buffer;
pub mod caps;
pub mod engine;
pub mod error;
pub mod region_table;
pub mod types;

#[cfg(feature = "conformance")]
pub mod conformance;
#[cfg(feature = "inproc")]
pub mod inproc;

pub use adapter::{AdapterConfig, AdapterLayer, CapabilityAdapter, Layer};
pub use buffer::{HostBuffer, RegisteredBuffer};
pub use caps::{
    BackendInfo, Capabilities, CapabilityReport, MemoryKinds, MissingCapability, Operation, Support,
};
pub use engine::TransferEngine;
pub use error::{Error, Result, Side};
pub use region_table::{RegionGuard, RegionTable};
pub use types::{
    BatchId, BatchReport, BatchStatus, Location, MemoryRegion, Notification, SegmentId, TransferOp,
    TransferRequest, TransferState, MAX_NOTIFICATION_MESSAGE, MAX_NOTIFICATION_NAME,
};

#[doc(hidden)]
pub mod __private {
    pub use tokio;
}

//! Handles of segments and batches, and the bound on live batches. A leaf
//! module: [`crate::error`] names these types, so they depend on nothing
//! of the crate.

use std::fmt;

/// Handle of an opened peer segment, valid on the engine that opened it until
/// `close_segment`.
///
/// Every engine of a process takes its handles from one process-wide
/// counter ([`SegmentId::fresh`]), so a handle is never valid on two
/// engines: used on an engine that did not open it, it is
/// [`crate::Error::UnknownSegment`] there — never a transfer to whatever
/// peer that engine opened under the same number.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SegmentId(pub u64);

impl SegmentId {
    /// A handle no engine of this process has issued before (backends call
    /// it for every `open_segment`).
    pub fn fresh() -> SegmentId {
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
        SegmentId(NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed))
    }
}

impl fmt::Display for SegmentId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "#{}", self.0)
    }
}

/// Handle of a submitted asynchronous batch, valid on the engine that issued
/// it until the batch is waited on or released. Ids are never reused while
/// the process lives, and come from one process-wide counter
/// ([`BatchId::fresh`]): used on another engine, a handle is
/// [`crate::Error::UnknownBatch`] there.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BatchId(pub u64);

impl BatchId {
    /// A batch id no engine of this process has issued before.
    pub fn fresh() -> BatchId {
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
        BatchId(NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed))
    }
}

impl fmt::Display for BatchId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "#{}", self.0)
    }
}

/// Most asynchronous batches an engine keeps that were submitted and not yet
/// waited for or released; `submit` beyond that fails with
/// [`crate::Error::QueueFull`] (nothing is submitted).
pub const MAX_LIVE_BATCHES: usize = 65_536;

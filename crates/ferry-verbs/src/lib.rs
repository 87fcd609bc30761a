//! # ferry-verbs
//!
//! Ferry's native RDMA transport: one-sided RDMA WRITE and READ over
//! reliable-connected (RC) queue pairs, straight between registered memories.
//!
//! - **Device**: opened by name or the first with an active port; port and
//!   GID index configurable (RoCE needs a GID; the default picks RoCE v2 from
//!   the GID table). See [`VerbsConfig`].
//! - **Memory**: every registered region is a verbs memory region (MR) with
//!   local write, remote write and remote read access, tracked in a
//!   [`ferry_core::RegionTable`] for bounds checks and in-flight guards.
//! - **Connections**: opening a segment connects a small TCP control channel
//!   (tokio) to the peer, exchanges QP number, LID, GID, PSN, MTU and the
//!   peer's region table (address, length, rkey), and moves a fresh RC QP
//!   INIT → RTR → RTS (timeouts and retry counts in [`VerbsConfig`]). The
//!   same channel carries region-table updates and the answers to
//!   notifications; the notifications themselves are SENT on the queue
//!   pair after the batch's data, so the peer sees them only after it.
//! - **Batches** follow `ferry_core::batch`: finished only after the
//!   notification was answered; a notification failing after the data
//!   fails the last request (a full peer queue: the retryable
//!   [`ferry_core::Error::QueueFull`]). Every queue is bounded.
//! - **Authentication** (optional, [`VerbsConfig::secret`]): every control
//!   connection starts with a mutual HMAC-SHA256 challenge–response over
//!   fresh random nonces, before any queue-pair data, region table or rkey
//!   is exchanged and before any notification is accepted; a peer that does
//!   not prove the shared secret gets [`ferry_core::Error::Authentication`]
//!   (opener) or is disconnected (owner).
//! - **Versions**: the control channel is negotiated: each side announces
//!   a range of protocol versions (this build: 3–4) and optional features
//!   ([`Feature`]); the pair uses the highest common version and the
//!   features both have, and a build of protocol 3 (7c3e5e6) is served
//!   protocol 3's frames unchanged. [`VerbsEngine::peer_protocol`] reports
//!   what was agreed ([`PeerProtocol`]); only disjoint ranges are refused.
//!   See the crate's `PROTOCOL.md`.
//! - **Transfers**: a batch becomes a chain of work requests (native batch):
//!   requests above the maximum message size are split, requests whose
//!   remote ranges are contiguous share one work request with a
//!   scatter/gather list, the send queue never holds more than its depth,
//!   and only every `signal_every`-th request (and the last of each chain)
//!   asks for a completion.
//! - **Completions** are reaped by one thread per engine that sleeps in
//!   `poll(2)` on the verbs completion channel: no Tokio worker blocks and no
//!   core spins while idle.
//! - **Failures**: remote addresses are checked against the peer's table
//!   before anything is posted; a work completion error moves the connection
//!   to "broken", fails every outstanding request with a typed error — once
//!   its flush completion shows the device is done with its memory — and
//!   the next use of the segment builds a new queue pair.
//!
//! The RDMA code sits behind the cargo feature **`rdma`** (it needs `cmake`
//! and `libclang-dev` to build, and `libibverbs.so.1` plus a provider at run
//! time, loaded with `dlopen`). Without the feature the crate has no system
//! dependency and [`VerbsEngine::start`] returns
//! [`ferry_core::Error::Unavailable`] saying how to enable it.
#![deny(unsafe_op_in_unsafe_fn)]
#![cfg_attr(not(feature = "rdma"), forbid(unsafe_code))]

mod auth;
mod config;
mod handshake;
mod negotiate;
mod plan;
mod wire;

#[cfg(feature = "rdma")]
mod rdma;

pub use config::{VerbsConfig, VerbsConfigBuilder};
pub use negotiate::{Feature, FeatureState, PeerProtocol, VersionRange};

use ferry_core::DynTransferEngine;
use std::sync::Arc;

use ferry_core::{
    BackendInfo, BatchId, BatchReport, BatchStatus, Capabilities, Error, MemoryRegion,
    Notification, Result, SegmentId, TransferEngine, TransferRequest,
};

/// Backend name used in errors and reports.
pub const BACKEND: &str = "verbs";

/// Faults [`VerbsEngine::inject_fault`] can provoke, to test recovery on a
/// real verbs stack.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Fault {
    /// Move the segment's queue pair to the Error state behind the engine's
    /// back (as a link failure would): outstanding and next work requests
    /// are flushed, their requests fail with a typed error, and the segment
    /// reconnects on the use after that.
    QpError,
    /// Post the next work request on the segment with a corrupted rkey: the
    /// peer's device rejects it (remote access error), which also moves the
    /// queue pair to the Error state.
    InvalidRkey,
    /// Drop the segment's work completions unread from now on, as a
    /// stalled device would never deliver them: after `stall_timeout_ms`
    /// the engine breaks the connection, its requests fail `PeerLost` and
    /// their memory is released; the next use reconnects.
    LoseCompletions,
}

/// The verbs transfer engine.
///
/// Create it with [`VerbsEngine::start`]; it implements
/// [`TransferEngine`] with native `batch_transfer`, asynchronous batches,
/// `wait` and notifications (batch register is not native: `ibv_reg_mr`
/// registers one region per call, so the capability adapter loops).
pub struct VerbsEngine {
    #[cfg(feature = "rdma")]
    inner: Arc<rdma::Inner>,
    #[cfg(not(feature = "rdma"))]
    never: std::convert::Infallible,
}

impl std::fmt::Debug for VerbsEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VerbsEngine")
            .field("segment", &self.segment_name())
            .finish()
    }
}

#[cfg(not(feature = "rdma"))]
const NOT_BUILT: &str = "ferry-verbs was built without its `rdma` cargo feature \
     (enable `ferry-verbs/rdma`, which needs cmake and libclang-dev to build and \
     rdma-core's libibverbs1 + ibverbs-providers to run)";

impl VerbsEngine {
    /// Opens the device, starts the completion thread and the control-channel
    /// listener, and returns the engine.
    ///
    /// Fails with [`Error::Unavailable`] naming the reason when RDMA cannot
    /// work here: the crate was built without the `rdma` feature,
    /// `libibverbs.so.1` cannot be loaded, no device exists, the named device
    /// does not exist (the message lists those that do), or its port is not
    /// active. Fails with [`Error::Io`] if the listen address cannot be bound.
    pub async fn start(config: VerbsConfig) -> Result<VerbsEngine> {
        #[cfg(feature = "rdma")]
        {
            Ok(VerbsEngine {
                inner: rdma::Inner::start(config).await?,
            })
        }
        #[cfg(not(feature = "rdma"))]
        {
            let _ = config;
            Err(Error::Unavailable {
                backend: BACKEND.to_owned(),
                reason: NOT_BUILT.to_owned(),
            })
        }
    }

    /// Provokes `fault` on the connection of `segment` (connecting it first
    /// if needed). For tests of failure handling; harmless to other
    /// segments. Fails with [`Error::UnknownSegment`] for a handle that is
    /// not open.
    pub async fn inject_fault(&self, segment: SegmentId, fault: Fault) -> Result<()> {
        #[cfg(feature = "rdma")]
        {
            self.inner.inject_fault(segment, fault).await
        }
        #[cfg(not(feature = "rdma"))]
        {
            let _ = (segment, fault);
            match self.never {}
        }
    }

    /// Makes this engine refuse (`true`) or accept the notifications its
    /// peers send: a refused notification is answered as such, and the
    /// sender's batch — whose data landed — fails its last request with
    /// [`Error::SegmentUnavailable`]. For tests of that path.
    pub fn set_refuse_notifications(&self, refuse: bool) {
        #[cfg(feature = "rdma")]
        {
            self.inner.set_refuse_notifications(refuse);
        }
        #[cfg(not(feature = "rdma"))]
        {
            let _ = refuse;
            match self.never {}
        }
    }

    /// What this engine and the peer of `segment` agreed on their control
    /// channel (versions, the version in use, each optional feature on or
    /// off and why), if the segment is connected and healthy. The same
    /// report, for every connected peer and opener, is in
    /// [`TransferEngine::backend_info`] (`protocol peer NAME` and
    /// `protocol opener ADDR` entries; `peer NAME` gives the path).
    pub async fn peer_protocol(&self, segment: SegmentId) -> Option<PeerProtocol> {
        #[cfg(feature = "rdma")]
        {
            self.inner.peer_protocol(segment).await
        }
        #[cfg(not(feature = "rdma"))]
        {
            let _ = segment;
            match self.never {}
        }
    }

    /// The local queue pair number currently serving `segment`, if it is
    /// connected and healthy (a new number after a reconnect).
    pub async fn queue_pair_number(&self, segment: SegmentId) -> Option<u32> {
        #[cfg(feature = "rdma")]
        {
            self.inner.queue_pair_number(segment).await
        }
        #[cfg(not(feature = "rdma"))]
        {
            let _ = segment;
            match self.never {}
        }
    }
}

/// Dropping the engine stops its completion thread and control runtime:
/// its control connections close (peers see it go away) and its queue pairs
/// and memory regions are destroyed.
impl Drop for VerbsEngine {
    fn drop(&mut self) {
        #[cfg(feature = "rdma")]
        drop(self.inner.shutdown());
        #[cfg(not(feature = "rdma"))]
        match self.never {}
    }
}

#[cfg(feature = "rdma")]
macro_rules! forward {
    ($self:ident, $inner:ident => $e:expr) => {{
        let $inner = &$self.inner;
        $e
    }};
}

#[cfg(not(feature = "rdma"))]
macro_rules! forward {
    ($self:ident, $inner:ident => $e:expr) => {{
        match $self.never {}
    }};
}

#[deny(clippy::missing_trait_methods)]
#[cfg_attr(not(feature = "rdma"), allow(unused_variables))]
impl TransferEngine for VerbsEngine {
    fn backend_name(&self) -> &str {
        BACKEND
    }

    fn segment_name(&self) -> &str {
        forward!(self, i => i.segment_name())
    }

    fn capabilities(&self) -> Capabilities {
        forward!(self, i => i.capabilities())
    }

    fn backend_info(&self) -> BackendInfo {
        forward!(self, i => i.backend_info())
    }

    async fn register(&self, region: MemoryRegion) -> Result<()> {
        forward!(self, i => i.register(region).await)
    }

    async fn unregister(&self, addr: u64) -> Result<()> {
        forward!(self, i => i.unregister(addr).await)
    }

    async fn batch_register(&self, regions: Vec<MemoryRegion>) -> Result<()> {
        let _ = regions;
        Err(Error::unsupported(
            BACKEND,
            ferry_core::Operation::BatchRegister,
            "ibv_reg_mr registers one region per call; use the capability adapter",
        ))
    }

    async fn batch_unregister(&self, addrs: &[u64]) -> Result<()> {
        let _ = addrs;
        Err(Error::unsupported(
            BACKEND,
            ferry_core::Operation::BatchUnregister,
            "ibv_dereg_mr deregisters one region per call; use the capability adapter",
        ))
    }

    async fn open_segment(&self, name: &str) -> Result<SegmentId> {
        forward!(self, i => i.until_stopped(i.open_segment(name)).await)
    }

    async fn close_segment(&self, segment: SegmentId) -> Result<()> {
        forward!(self, i => i.close_segment(segment).await)
    }

    async fn transfer(&self, segment: SegmentId, request: TransferRequest) -> Result<()> {
        forward!(self, i => i.until_stopped(i.transfer(segment, request)).await)
    }

    async fn batch_transfer(
        &self,
        segment: SegmentId,
        requests: &[TransferRequest],
        notify: Option<&Notification>,
    ) -> Result<BatchReport> {
        forward!(self, i => i.until_stopped(i.batch_transfer(segment, requests, notify)).await)
    }

    async fn submit(
        &self,
        segment: SegmentId,
        requests: &[TransferRequest],
        notify: Option<&Notification>,
    ) -> Result<BatchId> {
        forward!(self, i => i.until_stopped(i.submit(segment, requests, notify)).await)
    }

    fn status(&self, batch: BatchId) -> Result<BatchStatus> {
        forward!(self, i => i.status(batch))
    }

    async fn wait(&self, batch: BatchId) -> Result<BatchReport> {
        forward!(self, i => i.until_stopped(i.wait(batch)).await)
    }

    async fn release_batch(&self, batch: BatchId) -> Result<()> {
        forward!(self, i => i.release_batch(batch))
    }

    async fn take_notifications(&self) -> Result<Vec<Notification>> {
        forward!(self, i => Ok(i.take_notifications()))
    }

    async fn next_notification(&self, name: Option<&str>) -> Result<Notification> {
        forward!(self, i => i.next_notification(name).await)
    }

    fn live_batches(&self) -> Option<usize> {
        forward!(self, i => Some(i.live_batches()))
    }

    /// Peers write and read this engine's memory by one-sided RDMA, which
    /// the target's CPU never sees: nothing inbound is counted.
    fn inbound(&self) -> Option<ferry_core::Inbound> {
        None
    }

    /// Closes the control connections and passive queue pairs and stops
    /// the completion thread (pending requests fail with `Canceled`),
    /// returning once both have stopped (at most about 5 s).
    async fn shutdown(&self) -> Result<()> {
        #[cfg(feature = "rdma")]
        if let Some(stopper) = self.inner.shutdown() {
            let _ = tokio::task::spawn_blocking(move || stopper.join()).await;
        }
        #[cfg(not(feature = "rdma"))]
        match self.never {}
        #[cfg(feature = "rdma")]
        Ok(())
    }
}

/// Starts an engine from a `verbs://` URL (see [`VerbsConfig::from_url`]),
/// shared as a trait object.
pub async fn open(url: &str) -> Result<Arc<dyn DynTransferEngine>> {
    let config = VerbsConfig::from_url(url)?;
    Ok(Arc::new(VerbsEngine::start(config).await?))
}

#[cfg(all(test, not(feature = "rdma")))]
mod tests {
    use super::*;

    #[tokio::test]
    async fn without_the_feature_start_is_unavailable() {
        match VerbsEngine::start(VerbsConfig::default()).await {
            Err(Error::Unavailable { backend, reason }) => {
                assert_eq!(backend, "verbs");
                assert!(reason.contains("`rdma`"), "{reason}");
            }
            other => panic!("expected Unavailable, got {other:?}"),
        }
    }
}

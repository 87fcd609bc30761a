//! The `TransferEngine` trait: Mooncake's model as one async contract.

use async_trait::async_trait;

use crate::caps::{BackendInfo, Capabilities, Operation};
use crate::error::{Error, Result};
use crate::types::{
    BatchId, BatchReport, BatchStatus, MemoryRegion, Notification, SegmentId, TransferRequest,
};

/// A local transfer endpoint: it owns registered memory regions, opens peer
/// segments by name and moves bytes between its regions and theirs.
///
/// Required methods work on every backend. The optional ones
/// (`batch_register`, `batch_unregister`, `batch_transfer`, `submit` /
/// `status` / `wait` / `release_batch`, notifications) return
/// [`Error::Unsupported`] unless [`TransferEngine::capabilities`] declares
/// them; their default bodies do exactly that and nothing else. Wrap an
/// engine in a [`crate::CapabilityAdapter`] to get all of them.
///
/// Common rules:
/// - Local addresses must lie inside one region registered with this engine,
///   remote addresses inside one region registered with the peer; anything
///   else fails that request with [`Error::AddressNotRegistered`] and changes
///   no byte of either memory.
/// - A zero-length request succeeds and moves nothing.
/// - Requests of one batch may run concurrently and in any order; a batch
///   whose destination ranges overlap leaves the overlap unspecified.
/// - A batch of zero requests is valid (useful to send only a notification).
/// - Ordering: a call that starts after another returned sees its effects
///   (bytes, registrations, closed handles); calls that run at the same time
///   are not ordered with each other.
/// - Cancel-safety: every method says what a future dropped before it
///   completes (a `tokio::time::timeout`, a `select!`) leaves behind; the
///   conformance suite's `cancellation` and `awaited_notification` checks
///   drop each one after every number of polls and check exactly that.
#[async_trait]
pub trait TransferEngine: Send + Sync + 'static {
    /// Backend name: `tcp`, `mooncake`, `verbs`, `inproc`.
    fn backend_name(&self) -> &str;

    /// The name peers pass to [`TransferEngine::open_segment`] to reach this
    /// engine (`host:port` for network backends).
    fn segment_name(&self) -> &str;

    /// What this engine does natively (through an adapter: effectively).
    fn capabilities(&self) -> Capabilities;

    /// Details for the capability report and the reasons for every optional
    /// operation that is not native.
    fn backend_info(&self) -> BackendInfo;

    /// Registers `region` so that it can be a local source/destination and a
    /// remote target of peers. Takes the region: each `unsafe`
    /// [`MemoryRegion::from_raw_parts`] vouches for one registration (make
    /// a new one to register the memory again after `unregister`).
    ///
    /// Fails with [`Error::InvalidArgument`] for an empty region or a
    /// location the backend cannot register, and with
    /// [`Error::RegionOverlap`] if it overlaps a registered region.
    ///
    /// Cancel-safety: a dropped future leaves the region registered or not,
    /// never half (a registration in a library runs to its end); a
    /// [`crate::RegisteredBuffer`] whose registration was dropped leaks its
    /// memory rather than free it possibly registered.
    async fn register(&self, region: MemoryRegion) -> Result<()>;

    /// Unregisters the region that starts at `addr`.
    ///
    /// Returns only when no transfer (local or from a peer) uses the region
    /// any more: transfers in flight finish or fail first, new ones are
    /// refused. After it returns the caller may free the memory.
    ///
    /// Cancel-safety: a dropped future leaves the region registered (and
    /// usable) or unregistered; only a call that returned `Ok` promises
    /// that no byte of it changes any more.
    async fn unregister(&self, addr: u64) -> Result<()>;

    /// Registers every region, all or nothing: if one fails, those already
    /// registered by this call are unregistered and the error is
    /// [`Error::BatchRegisterFailed`] naming the failed index.
    ///
    /// Cancel-safety: all or nothing also when dropped (a rollback runs on
    /// a task of its own).
    async fn batch_register(&self, regions: Vec<MemoryRegion>) -> Result<()> {
        let _ = regions;
        Err(unsupported(self.backend_name(), Operation::BatchRegister))
    }

    /// Unregisters the regions starting at each address (same waiting rule as
    /// [`TransferEngine::unregister`]). Every address is attempted; the first
    /// error is returned.
    ///
    /// Cancel-safety: as [`TransferEngine::unregister`], region by region.
    async fn batch_unregister(&self, addrs: &[u64]) -> Result<()> {
        let _ = addrs;
        Err(unsupported(self.backend_name(), Operation::BatchUnregister))
    }

    /// Opens the peer segment called `name` and returns a handle for
    /// transfers. Opening the same name twice may return the same handle.
    async fn open_segment(&self, name: &str) -> Result<SegmentId>;

    /// Closes a handle. Transfers in flight on it finish or fail first.
    ///
    /// Cancel-safety: a dropped future leaves the handle closed
    /// ([`Error::UnknownSegment`] from then on) or open, working and
    /// closable; never a handle that neither works nor releases its peer.
    async fn close_segment(&self, segment: SegmentId) -> Result<()>;

    /// Performs one request and waits for it.
    ///
    /// Cancel-safety: a dropped future may have moved some, all or none of
    /// the bytes (retry class [`crate::Retry::MaybeApplied`]); it leaves no
    /// batch behind, and once `unregister` of either memory returns no byte
    /// of it changes.
    async fn transfer(&self, segment: SegmentId, request: TransferRequest) -> Result<()>;

    /// Performs every request and waits for all of them. `Err` means the
    /// batch as a whole was refused (unknown segment, too many requests,
    /// notification unsupported) and nothing was moved; otherwise the report
    /// holds each request's outcome in the caller's order.
    ///
    /// With `notify`, the notification is delivered to the peer after every
    /// request has landed, and only if every request succeeded.
    ///
    /// Cancel-safety: as [`TransferEngine::transfer`], for every request;
    /// the notification may or may not have been sent.
    async fn batch_transfer(
        &self,
        segment: SegmentId,
        requests: &[TransferRequest],
        notify: Option<&Notification>,
    ) -> Result<BatchReport> {
        let _ = (segment, requests, notify);
        Err(unsupported(self.backend_name(), Operation::BatchTransfer))
    }

    /// Starts every request and returns at once with a batch id for
    /// [`TransferEngine::status`], [`TransferEngine::wait`] and
    /// [`TransferEngine::release_batch`]. `notify` as in `batch_transfer`.
    ///
    /// Cancel-safety: a dropped future either submitted nothing or
    /// submitted a batch the engine finishes and reclaims by itself
    /// ([`TransferEngine::live_batches`] returns to where it was).
    async fn submit(
        &self,
        segment: SegmentId,
        requests: &[TransferRequest],
        notify: Option<&Notification>,
    ) -> Result<BatchId> {
        let _ = (segment, requests, notify);
        Err(unsupported(self.backend_name(), Operation::AsyncBatch))
    }

    /// The state of each request of `batch`. Never blocks, never waits.
    fn status(&self, batch: BatchId) -> Result<BatchStatus> {
        let _ = batch;
        Err(unsupported(self.backend_name(), Operation::AsyncBatch))
    }

    /// Waits until every request of `batch` is terminal, releases the batch
    /// and returns the report. The id is invalid afterwards.
    ///
    /// Cancel-safety: a dropped future leaves the batch as it was; a later
    /// `wait` (or `status` and `release_batch`) takes it.
    async fn wait(&self, batch: BatchId) -> Result<BatchReport> {
        let _ = batch;
        Err(unsupported(self.backend_name(), Operation::BatchWait))
    }

    /// Releases a finished batch without waiting; [`Error::BatchBusy`] if a
    /// request is still pending. The id is invalid afterwards.
    async fn release_batch(&self, batch: BatchId) -> Result<()> {
        let _ = batch;
        Err(unsupported(self.backend_name(), Operation::AsyncBatch))
    }

    /// Takes the notifications received so far, oldest first. Never waits.
    ///
    /// Cancel-safe: the notifications live in a queue the engine owns until
    /// this call returns them, so a dropped future loses none (they are
    /// returned by the next call).
    async fn take_notifications(&self) -> Result<Vec<Notification>> {
        Err(unsupported(self.backend_name(), Operation::Notify))
    }

    /// Waits for the next notification — the oldest one queued, or the
    /// next to arrive — whose `name` is `name` (any name with `None`), and
    /// takes it; every other notification stays queued, in order, for
    /// `take_notifications` and later calls.
    ///
    /// Cancel-safe: a dropped future (`tokio::time::timeout`, `select!`)
    /// has taken nothing. Waits without a bound: wrap it in a timeout.
    /// Ends with [`Error::Canceled`] once the engine shuts down;
    /// [`Error::Unsupported`] (operation [`Operation::Notify`]) where the
    /// engine has no notifications.
    async fn next_notification(&self, name: Option<&str>) -> Result<Notification> {
        let _ = name;
        Err(unsupported(self.backend_name(), Operation::Notify))
    }

    /// How many asynchronous batches the engine holds: submitted (by the
    /// caller, or by the engine or a layer for itself) and not yet waited
    /// for or released. A caller that drops every id it got should see it
    /// return to zero once those batches finish; `None` if the backend does
    /// not count them.
    fn live_batches(&self) -> Option<usize> {
        None
    }
}

fn unsupported(backend: &str, op: Operation) -> Error {
    Error::unsupported(backend, op, "the backend does not implement it")
}

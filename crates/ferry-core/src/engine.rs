//! The `TransferEngine` trait: Mooncake's model as one async contract.

use std::future::Future;
use std::pin::Pin;

use crate::caps::{BackendInfo, Capabilities, Operation};
use crate::error::{Error, Result};
use crate::inbound::Inbound;
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
    /// A failed register registered nothing, except [`Error::RegionHeld`]:
    /// the region may be registered (a library failed to undo it) and stays
    /// in the engine's table; unregister it before freeing the memory.
    ///
    /// Cancel-safety: a dropped future leaves the region registered or not,
    /// never half (a registration in a library runs to its end); a
    /// [`crate::RegisteredBuffer`] whose registration was dropped leaks its
    /// memory rather than free it possibly registered.
    fn register(&self, region: MemoryRegion) -> impl Future<Output = Result<()>> + Send;

    /// Unregisters the region that starts at `addr`.
    ///
    /// Returns only when no transfer (local or from a peer) uses the region
    /// any more: transfers in flight finish or fail first, new ones are
    /// refused. After it returns the caller may free the memory.
    ///
    /// Cancel-safety: a dropped future leaves the region registered (and
    /// usable) or unregistered; only a call that returned `Ok` promises
    /// that no byte of it changes any more.
    fn unregister(&self, addr: u64) -> impl Future<Output = Result<()>> + Send;

    /// Registers every region, all or nothing: if one fails, those already
    /// registered by this call are unregistered and the error is
    /// [`Error::BatchRegisterFailed`] naming the failed index.
    ///
    /// A failed batch registered nothing, except [`Error::RegionHeld`]
    /// (also as the source of `BatchRegisterFailed`): the region at its
    /// address, and possibly others of the batch, may be registered (a
    /// library failed to undo them) and stay in the engine's table;
    /// unregister them before freeing the memory.
    ///
    /// Cancel-safety: all or nothing also when dropped (a rollback runs on
    /// a task of its own).
    fn batch_register(
        &self,
        regions: Vec<MemoryRegion>,
    ) -> impl Future<Output = Result<()>> + Send {
        let _ = regions;
        std::future::ready(Err(unsupported(
            self.backend_name(),
            Operation::BatchRegister,
        )))
    }

    /// Unregisters the regions starting at each address (same waiting rule as
    /// [`TransferEngine::unregister`]). Every address is attempted; the first
    /// error is returned.
    ///
    /// Cancel-safety: as [`TransferEngine::unregister`], region by region.
    fn batch_unregister(&self, addrs: &[u64]) -> impl Future<Output = Result<()>> + Send {
        let _ = addrs;
        std::future::ready(Err(unsupported(
            self.backend_name(),
            Operation::BatchUnregister,
        )))
    }

    /// Opens the peer segment called `name` and returns a handle for
    /// transfers. Opening the same name twice may return the same handle.
    fn open_segment(&self, name: &str) -> impl Future<Output = Result<SegmentId>> + Send;

    /// Closes a handle. Transfers in flight on it finish or fail first.
    ///
    /// Cancel-safety: a dropped future leaves the handle closed
    /// ([`Error::UnknownSegment`] from then on) or open, working and
    /// closable; never a handle that neither works nor releases its peer.
    fn close_segment(&self, segment: SegmentId) -> impl Future<Output = Result<()>> + Send;

    /// Performs one request and waits for it.
    ///
    /// Cancel-safety: a dropped future may have moved some, all or none of
    /// the bytes (retry class [`crate::Retry::MaybeApplied`]); it leaves no
    /// batch behind, and once `unregister` of either memory returns no byte
    /// of it changes.
    fn transfer(
        &self,
        segment: SegmentId,
        request: TransferRequest,
    ) -> impl Future<Output = Result<()>> + Send;

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
    fn batch_transfer(
        &self,
        segment: SegmentId,
        requests: &[TransferRequest],
        notify: Option<&Notification>,
    ) -> impl Future<Output = Result<BatchReport>> + Send {
        let _ = (segment, requests, notify);
        std::future::ready(Err(unsupported(
            self.backend_name(),
            Operation::BatchTransfer,
        )))
    }

    /// Starts every request and returns at once with a batch id for
    /// [`TransferEngine::status`], [`TransferEngine::wait`] and
    /// [`TransferEngine::release_batch`]. `notify` as in `batch_transfer`.
    ///
    /// Cancel-safety: a dropped future either submitted nothing or
    /// submitted a batch the engine finishes and reclaims by itself
    /// ([`TransferEngine::live_batches`] returns to where it was).
    fn submit(
        &self,
        segment: SegmentId,
        requests: &[TransferRequest],
        notify: Option<&Notification>,
    ) -> impl Future<Output = Result<BatchId>> + Send {
        let _ = (segment, requests, notify);
        std::future::ready(Err(unsupported(self.backend_name(), Operation::AsyncBatch)))
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
    fn wait(&self, batch: BatchId) -> impl Future<Output = Result<BatchReport>> + Send {
        let _ = batch;
        std::future::ready(Err(unsupported(self.backend_name(), Operation::BatchWait)))
    }

    /// Releases a finished batch without waiting; [`Error::BatchBusy`] if a
    /// request is still pending. The id is invalid afterwards.
    fn release_batch(&self, batch: BatchId) -> impl Future<Output = Result<()>> + Send {
        let _ = batch;
        std::future::ready(Err(unsupported(self.backend_name(), Operation::AsyncBatch)))
    }

    /// Takes the notifications received so far, oldest first. Never waits.
    ///
    /// Cancel-safe: the notifications live in a queue the engine owns until
    /// this call returns them, so a dropped future loses none (they are
    /// returned by the next call).
    fn take_notifications(&self) -> impl Future<Output = Result<Vec<Notification>>> + Send {
        std::future::ready(Err(unsupported(self.backend_name(), Operation::Notify)))
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
    fn next_notification(
        &self,
        name: Option<&str>,
    ) -> impl Future<Output = Result<Notification>> + Send {
        let _ = name;
        std::future::ready(Err(unsupported(self.backend_name(), Operation::Notify)))
    }

    /// How many asynchronous batches the engine holds: submitted (by the
    /// caller, or by the engine or a layer for itself) and not yet waited
    /// for or released. A caller that drops every id it got should see it
    /// return to zero once those batches finish; `None` if the backend does
    /// not count them.
    fn live_batches(&self) -> Option<usize> {
        None
    }

    /// A handle on what peers did to this engine (see
    /// [`crate::inbound`]): the bytes and segments they wrote into and read
    /// from its registered memory through requests it served, per peer,
    /// and the notifications its inbox dropped. Read it with
    /// [`Inbound::snapshot`] whenever needed (the metrics layer does at
    /// every scrape); the counters only grow.
    ///
    /// `None` (the default) where the backend counts nothing inbound; a
    /// snapshot's `served` is `None` where the backend cannot see inbound
    /// traffic: one-sided RDMA (verbs), Mooncake and NIXL move the bytes
    /// without the target's involvement. Every layer forwards it.
    fn inbound(&self) -> Option<Inbound> {
        None
    }

    /// Stops the engine and waits until it has stopped.
    ///
    /// Through a [`crate::CapabilityAdapter`] (and so `ferry::Engine`) this
    /// is a drain: calls that start after it began fail with
    /// [`Error::Canceled`], calls already in flight are awaited to their
    /// end (their bytes land or they fail as usual), and only then the
    /// backend stops. A backend's own `shutdown` stops at once: its
    /// listener and connections close, pending requests and the batches
    /// it holds fail with [`Error::Canceled`], `next_notification` waiters
    /// end with `Canceled`, and it returns once none of its tasks touches
    /// registered memory any more. Regions stay registered: `unregister`
    /// them (or drop the engine) to release them. Idempotent; dropping an
    /// engine does the backend's part without waiting.
    ///
    /// Cancel-safety: a dropped future leaves the engine shut down or
    /// shutting down (new calls are refused either way); awaiting
    /// `shutdown` again waits for the rest.
    ///
    /// The default, for engines with no background work, returns at once.
    fn shutdown(&self) -> impl Future<Output = Result<()>> + Send {
        std::future::ready(Ok(()))
    }
}

fn unsupported(backend: &str, op: Operation) -> Error {
    Error::unsupported(backend, op, "the backend does not implement it")
}

/// A boxed, sendable future: what [`DynTransferEngine`]'s methods return.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// The object-safe form of [`TransferEngine`], for code that picks the
/// backend at run time and holds `Arc<dyn DynTransferEngine>`.
///
/// [`TransferEngine`] uses native `async fn` (no allocation per call for
/// statically known engines, such as `ferry::Engine` over its adapter and
/// backend); it cannot be a trait object. Every `TransferEngine`
/// implements this trait, and `dyn DynTransferEngine` implements
/// `TransferEngine` again, so a trait object costs exactly one boxed
/// future and one dynamic call per operation (the pattern of OpenDAL's
/// `Access` / `AccessDyn`). Call the `TransferEngine` methods on it; the
/// `*_dyn` methods are its plumbing.
///
/// ```
/// use std::sync::Arc;
/// use ferry_core::{inproc::InprocEngine, Capabilities, DynTransferEngine, TransferEngine};
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// let engine: Arc<dyn DynTransferEngine> = Arc::new(InprocEngine::auto(Capabilities::default()));
/// assert_eq!(engine.backend_name(), "inproc");
/// let seg = engine.open_segment(engine.segment_name()).await.unwrap();
/// engine.close_segment(seg).await.unwrap();
/// # }
/// ```
#[allow(missing_docs)]
pub trait DynTransferEngine: Send + Sync + 'static {
    fn backend_name_dyn(&self) -> &str;
    fn segment_name_dyn(&self) -> &str;
    fn capabilities_dyn(&self) -> Capabilities;
    fn backend_info_dyn(&self) -> BackendInfo;
    fn register_dyn(&self, region: MemoryRegion) -> BoxFuture<'_, Result<()>>;
    fn unregister_dyn(&self, addr: u64) -> BoxFuture<'_, Result<()>>;
    fn batch_register_dyn(&self, regions: Vec<MemoryRegion>) -> BoxFuture<'_, Result<()>>;
    fn batch_unregister_dyn<'a>(&'a self, addrs: &'a [u64]) -> BoxFuture<'a, Result<()>>;
    fn open_segment_dyn<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<SegmentId>>;
    fn close_segment_dyn(&self, segment: SegmentId) -> BoxFuture<'_, Result<()>>;
    fn transfer_dyn(
        &self,
        segment: SegmentId,
        request: TransferRequest,
    ) -> BoxFuture<'_, Result<()>>;
    fn batch_transfer_dyn<'a>(
        &'a self,
        segment: SegmentId,
        requests: &'a [TransferRequest],
        notify: Option<&'a Notification>,
    ) -> BoxFuture<'a, Result<BatchReport>>;
    fn submit_dyn<'a>(
        &'a self,
        segment: SegmentId,
        requests: &'a [TransferRequest],
        notify: Option<&'a Notification>,
    ) -> BoxFuture<'a, Result<BatchId>>;
    fn status_dyn(&self, batch: BatchId) -> Result<BatchStatus>;
    fn wait_dyn(&self, batch: BatchId) -> BoxFuture<'_, Result<BatchReport>>;
    fn release_batch_dyn(&self, batch: BatchId) -> BoxFuture<'_, Result<()>>;
    fn take_notifications_dyn(&self) -> BoxFuture<'_, Result<Vec<Notification>>>;
    fn next_notification_dyn<'a>(
        &'a self,
        name: Option<&'a str>,
    ) -> BoxFuture<'a, Result<Notification>>;
    fn live_batches_dyn(&self) -> Option<usize>;
    fn inbound_dyn(&self) -> Option<Inbound>;
    fn shutdown_dyn(&self) -> BoxFuture<'_, Result<()>>;
}

impl<T: TransferEngine> DynTransferEngine for T {
    fn backend_name_dyn(&self) -> &str {
        self.backend_name()
    }
    fn segment_name_dyn(&self) -> &str {
        self.segment_name()
    }
    fn capabilities_dyn(&self) -> Capabilities {
        self.capabilities()
    }
    fn backend_info_dyn(&self) -> BackendInfo {
        self.backend_info()
    }
    fn register_dyn(&self, region: MemoryRegion) -> BoxFuture<'_, Result<()>> {
        Box::pin(self.register(region))
    }
    fn unregister_dyn(&self, addr: u64) -> BoxFuture<'_, Result<()>> {
        Box::pin(self.unregister(addr))
    }
    fn batch_register_dyn(&self, regions: Vec<MemoryRegion>) -> BoxFuture<'_, Result<()>> {
        Box::pin(self.batch_register(regions))
    }
    fn batch_unregister_dyn<'a>(&'a self, addrs: &'a [u64]) -> BoxFuture<'a, Result<()>> {
        Box::pin(self.batch_unregister(addrs))
    }
    fn open_segment_dyn<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<SegmentId>> {
        Box::pin(self.open_segment(name))
    }
    fn close_segment_dyn(&self, segment: SegmentId) -> BoxFuture<'_, Result<()>> {
        Box::pin(self.close_segment(segment))
    }
    fn transfer_dyn(
        &self,
        segment: SegmentId,
        request: TransferRequest,
    ) -> BoxFuture<'_, Result<()>> {
        Box::pin(self.transfer(segment, request))
    }
    fn batch_transfer_dyn<'a>(
        &'a self,
        segment: SegmentId,
        requests: &'a [TransferRequest],
        notify: Option<&'a Notification>,
    ) -> BoxFuture<'a, Result<BatchReport>> {
        Box::pin(self.batch_transfer(segment, requests, notify))
    }
    fn submit_dyn<'a>(
        &'a self,
        segment: SegmentId,
        requests: &'a [TransferRequest],
        notify: Option<&'a Notification>,
    ) -> BoxFuture<'a, Result<BatchId>> {
        Box::pin(self.submit(segment, requests, notify))
    }
    fn status_dyn(&self, batch: BatchId) -> Result<BatchStatus> {
        self.status(batch)
    }
    fn wait_dyn(&self, batch: BatchId) -> BoxFuture<'_, Result<BatchReport>> {
        Box::pin(self.wait(batch))
    }
    fn release_batch_dyn(&self, batch: BatchId) -> BoxFuture<'_, Result<()>> {
        Box::pin(self.release_batch(batch))
    }
    fn take_notifications_dyn(&self) -> BoxFuture<'_, Result<Vec<Notification>>> {
        Box::pin(self.take_notifications())
    }
    fn next_notification_dyn<'a>(
        &'a self,
        name: Option<&'a str>,
    ) -> BoxFuture<'a, Result<Notification>> {
        Box::pin(self.next_notification(name))
    }
    fn live_batches_dyn(&self) -> Option<usize> {
        self.live_batches()
    }
    fn inbound_dyn(&self) -> Option<Inbound> {
        self.inbound()
    }
    fn shutdown_dyn(&self) -> BoxFuture<'_, Result<()>> {
        Box::pin(self.shutdown())
    }
}

/// A trait object is an engine again: one boxed future per call.
#[deny(clippy::missing_trait_methods)]
impl TransferEngine for dyn DynTransferEngine {
    fn backend_name(&self) -> &str {
        self.backend_name_dyn()
    }
    fn segment_name(&self) -> &str {
        self.segment_name_dyn()
    }
    fn capabilities(&self) -> Capabilities {
        self.capabilities_dyn()
    }
    fn backend_info(&self) -> BackendInfo {
        self.backend_info_dyn()
    }
    fn register(&self, region: MemoryRegion) -> impl Future<Output = Result<()>> + Send {
        self.register_dyn(region)
    }
    fn unregister(&self, addr: u64) -> impl Future<Output = Result<()>> + Send {
        self.unregister_dyn(addr)
    }
    fn batch_register(
        &self,
        regions: Vec<MemoryRegion>,
    ) -> impl Future<Output = Result<()>> + Send {
        self.batch_register_dyn(regions)
    }
    async fn batch_unregister(&self, addrs: &[u64]) -> Result<()> {
        self.batch_unregister_dyn(addrs).await
    }
    async fn open_segment(&self, name: &str) -> Result<SegmentId> {
        self.open_segment_dyn(name).await
    }
    fn close_segment(&self, segment: SegmentId) -> impl Future<Output = Result<()>> + Send {
        self.close_segment_dyn(segment)
    }
    fn transfer(
        &self,
        segment: SegmentId,
        request: TransferRequest,
    ) -> impl Future<Output = Result<()>> + Send {
        self.transfer_dyn(segment, request)
    }
    async fn batch_transfer(
        &self,
        segment: SegmentId,
        requests: &[TransferRequest],
        notify: Option<&Notification>,
    ) -> Result<BatchReport> {
        self.batch_transfer_dyn(segment, requests, notify).await
    }
    async fn submit(
        &self,
        segment: SegmentId,
        requests: &[TransferRequest],
        notify: Option<&Notification>,
    ) -> Result<BatchId> {
        self.submit_dyn(segment, requests, notify).await
    }
    fn status(&self, batch: BatchId) -> Result<BatchStatus> {
        self.status_dyn(batch)
    }
    fn wait(&self, batch: BatchId) -> impl Future<Output = Result<BatchReport>> + Send {
        self.wait_dyn(batch)
    }
    fn release_batch(&self, batch: BatchId) -> impl Future<Output = Result<()>> + Send {
        self.release_batch_dyn(batch)
    }
    fn take_notifications(&self) -> impl Future<Output = Result<Vec<Notification>>> + Send {
        self.take_notifications_dyn()
    }
    async fn next_notification(&self, name: Option<&str>) -> Result<Notification> {
        self.next_notification_dyn(name).await
    }
    fn live_batches(&self) -> Option<usize> {
        self.live_batches_dyn()
    }
    fn inbound(&self) -> Option<Inbound> {
        self.inbound_dyn()
    }
    fn shutdown(&self) -> impl Future<Output = Result<()>> + Send {
        self.shutdown_dyn()
    }
}

/// For an engine made of several engines (`ferry::multi`, one inner engine
/// per transport): registers `region` in each of `engines`, in order, the
/// same bounds in every one, and stops at the first that fails. Returns
/// how many engines registered it (a prefix of `engines`) and the result.
/// The caller unregisters it from that prefix to undo a failure.
///
/// The region is copied for each engine inside this call and nowhere else:
/// no copy outlives it except as a registration. So the promise of
/// [`MemoryRegion::from_raw_parts`] (the memory stays valid until the
/// `unregister` of every engine it was registered with returns) covers
/// each of them, and the composed engine keeps it by returning from its
/// own `unregister` only once every inner one has.
pub async fn register_in_each(
    engines: &[std::sync::Arc<dyn DynTransferEngine>],
    region: MemoryRegion,
) -> (usize, Result<()>) {
    for (i, engine) in engines.iter().enumerate() {
        let copy = copy_region(&region);
        if let Err(e) = engine.register_dyn(copy).await {
            return (i, Err(e));
        }
    }
    (engines.len(), Ok(()))
}

/// [`register_in_each`] for a batch: `batch_register` of `regions` in each
/// engine, in order, stopping at the first that fails (each engine's own
/// call is all or nothing). Returns how many engines registered them all.
pub async fn batch_register_in_each(
    engines: &[std::sync::Arc<dyn DynTransferEngine>],
    regions: Vec<MemoryRegion>,
) -> (usize, Result<()>) {
    for (i, engine) in engines.iter().enumerate() {
        let copies = regions.iter().map(copy_region).collect();
        if let Err(e) = engine.batch_register_dyn(copies).await {
            return (i, Err(e));
        }
    }
    (engines.len(), Ok(()))
}

/// A second registration of the memory `region` describes, handed to one
/// engine at once by the two functions above.
fn copy_region(region: &MemoryRegion) -> MemoryRegion {
    // SAFETY: the caller of `from_raw_parts` for `region` promised that the
    // memory stays valid until the unregister of every engine it is
    // registered with returns; this copy goes straight into one engine's
    // registration (see `register_in_each`), so that promise covers it.
    unsafe {
        MemoryRegion::from_raw_parts(
            region.addr() as usize as *mut u8,
            region.len() as usize,
            region.location().clone(),
        )
    }
}

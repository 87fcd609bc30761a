//! `MooncakeEngine`: the `TransferEngine` trait over Mooncake's C API.
//!
//! The engine is split along its seams:
//!
//! - `start`: identity (segment name, host, ports), creating the C engine;
//! - `segments`: segment handles and the region tables of in-process peers;
//! - `regions`: registering memory, all or nothing even when canceled;
//! - `batches`: checking and submitting a batch, reporting its outcomes
//!   through `ferry_core::batch` (which owns ids, states, deadlines);
//! - `poller`: library batches and the poller thread that completes them;
//! - `landed`: confirming that writes landed on builds that do not say;
//! - `notify`: notifications (probe, send, receive);
//! - `peer_wire`: refusing a peer whose Mooncake generation cannot talk to
//!   this one, from its segment descriptor;
//! - `report`: capabilities and the capability report.

use std::ffi::{c_void, CString};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use ferry_core::raw::{BatchDriver, BatchTable};
use ferry_core::{
    BackendInfo, BatchId, BatchReport, BatchStatus, Capabilities, Error, MemoryRegion,
    MissingCapability, Notification, RegionTable, Result, SegmentId, TransferEngine,
    TransferRequest,
};

use crate::config::MooncakeConfig;
use crate::library::{Generation, MooncakeLibrary};

mod batches;
mod landed;
mod notify;
mod peer_wire;
mod poller;
mod regions;
mod report;
mod segments;
mod start;

use landed::Scratch;
use poller::Poller;
use segments::{Segments, PEERS};

const BACKEND: &str = "mooncake";

use ferry_core::__private::sync::lock;

/// The C engine handle. Mooncake's engine is used from many threads at once
/// by its own Python and C++ callers; every call Ferry makes is one of its
/// thread-safe C entry points.
struct RawEngine(*mut c_void);
// SAFETY: see above — the handle is an opaque pointer to a thread-safe
// object, only ever passed to the library's C functions.
unsafe impl Send for RawEngine {}
// SAFETY: as above.
unsafe impl Sync for RawEngine {}

/// The state of one engine, shared by its handles (and by the tasks that
/// finish its batches and registrations).
struct Inner {
    /// The C engine, owned by the poller thread's `Core`, which outlives
    /// this struct (it stops only after `Inner::drop`).
    raw: RawEngine,
    lib: Arc<MooncakeLibrary>,
    poller: Arc<Poller>,
    uid: u64,
    config: MooncakeConfig,
    server_name: String,
    segment_name: String,
    regions: RegionTable,
    segments: Mutex<Segments>,
    /// The batches callers hold ids for (`submit`).
    batches: BatchTable,
    /// Registrations running (see `regions`).
    registering: AtomicUsize,
    /// Held (shared) by each registration from its region-table insert to
    /// the end of its library call; taken (exclusive) by unregistering,
    /// which so never sees a region the library does not have yet.
    registry: tokio::sync::RwLock<()>,
    /// Probe memory, when writes are confirmed (see `landed`).
    scratch: Option<Arc<Scratch>>,
    /// Why notifications do not work with this build, if they do not.
    notify_gap: Option<MissingCapability>,
    /// Name of the notification the start-up probe sent to this engine
    /// itself (filtered out of `take_notifications`).
    probe_name: String,
    /// What the library's queue gave us and no caller has taken yet (see
    /// `notify::pull`). Unbounded like the library's own queue, whose
    /// contents it only moves: a notification taken from the library
    /// cannot be refused any more.
    inbox: ferry_core::raw::Inbox,
}

impl Inner {
    fn raw(&self) -> *mut c_void {
        self.raw.0
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        {
            let mut peers = lock(&PEERS);
            if peers
                .get(&self.segment_name)
                .is_some_and(|(uid, _)| *uid == self.uid)
            {
                peers.remove(&self.segment_name);
            }
        }
        // The poller finishes the batches still in the library, then exits
        // and drops the Core, which destroys the C engine.
        self.poller.stop();
    }
}

/// Who chose the native library a [`MooncakeConfig`] resolves to; see
/// [`MooncakeEngine::start_trusted`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LibraryTrust {
    /// The configuration (`lib=`, `FERRY_MOONCAKE_LIB`, the loader's search
    /// path) comes from the operator, who vouches for the library as they
    /// would for one linked at build time; never from a peer or a request.
    OperatorConfigured,
}

/// A Mooncake Transfer Engine, loaded at run time (see the crate docs).
///
/// Cloning gives another handle to the same engine; the C engine is
/// destroyed when the last handle (and the last background batch reaper)
/// is gone.
#[derive(Clone)]
pub struct MooncakeEngine {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for MooncakeEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MooncakeEngine")
            .field("segment", &self.inner.segment_name)
            .field("library", &self.inner.lib)
            .finish()
    }
}

/// Runs a blocking library call on tokio's blocking pool.
async fn blocking<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> Result<T> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| Error::Canceled(format!("a blocking Mooncake call did not finish: {e}")))
}

fn cstring(what: &str, s: &str) -> Result<CString> {
    CString::new(s).map_err(|_| Error::InvalidArgument(format!("{what} contains a NUL byte")))
}

impl MooncakeEngine {
    /// The loaded library.
    pub fn library(&self) -> &Arc<MooncakeLibrary> {
        &self.inner.lib
    }

    /// The detected generation.
    pub fn generation(&self) -> Generation {
        self.inner.lib.generation()
    }

    /// The configuration in force.
    pub fn config(&self) -> &MooncakeConfig {
        &self.inner.config
    }

    /// The `local_server_name` given to the library.
    pub fn server_name(&self) -> &str {
        &self.inner.server_name
    }

    /// Library batches allocated and not yet freed (including batches whose
    /// deadline passed: the engine's poller thread frees them once the
    /// library reports every task terminal). The batches callers hold ids
    /// for are counted by [`TransferEngine::live_batches`].
    pub fn library_batches_in_use(&self) -> usize {
        self.inner.poller.in_use.load(Ordering::Acquire)
    }

    /// `register`, `batch_register` and `batch_unregister` calls still
    /// running, including those whose caller dropped the future (they run
    /// to completion, see the trait methods).
    pub fn registrations_in_flight(&self) -> usize {
        self.inner.registering.load(Ordering::Acquire)
    }
}

impl ferry_core::inbound::InboundSource for Inner {
    fn snapshot(&self) -> ferry_core::InboundSnapshot {
        ferry_core::InboundSnapshot::new().with_notifications_dropped(self.inbox.dropped())
    }
}

#[deny(clippy::missing_trait_methods)]
impl TransferEngine for MooncakeEngine {
    fn backend_name(&self) -> &str {
        BACKEND
    }

    fn segment_name(&self) -> &str {
        &self.inner.segment_name
    }

    fn capabilities(&self) -> Capabilities {
        self.native_caps()
    }

    fn backend_info(&self) -> BackendInfo {
        self.capability_report()
    }

    /// Registers `region` with the library and the engine's region table,
    /// or with neither: the registration runs to its end even if this
    /// future is dropped.
    async fn register(&self, region: MemoryRegion) -> Result<()> {
        self.register_one(region).await
    }

    async fn unregister(&self, addr: u64) -> Result<()> {
        self.unregister_one(addr).await
    }

    /// All or nothing, and runs to its end even if this future is dropped.
    async fn batch_register(&self, regions: Vec<MemoryRegion>) -> Result<()> {
        self.register_all(regions).await
    }

    async fn batch_unregister(&self, addrs: &[u64]) -> Result<()> {
        self.unregister_all(addrs).await
    }

    async fn open_segment(&self, name: &str) -> Result<SegmentId> {
        self.open_handle(name).await
    }

    async fn close_segment(&self, segment: SegmentId) -> Result<()> {
        self.close_handle(segment).await
    }

    async fn transfer(&self, segment: SegmentId, request: TransferRequest) -> Result<()> {
        let report = self.batch_transfer(segment, &[request], None).await?;
        report.results.into_iter().next().unwrap_or(Ok(()))
    }

    async fn batch_transfer(
        &self,
        segment: SegmentId,
        requests: &[TransferRequest],
        notify: Option<&Notification>,
    ) -> Result<BatchReport> {
        let target = self.open_batch(segment, notify).await?;
        // No id: dropped before the batch ends, this future leaves nothing
        // behind (the library batch stays with the poller, which frees it
        // and its memory when the library is done).
        let driver = BatchDriver::detached(requests.len());
        self.start_batch(target, requests, notify, &driver).await?;
        driver.wait().await
    }

    async fn submit(
        &self,
        segment: SegmentId,
        requests: &[TransferRequest],
        notify: Option<&Notification>,
    ) -> Result<BatchId> {
        let target = self.open_batch(segment, notify).await?;
        let admission = self.inner.batches.admit(requests.len())?;
        self.start_batch(target, requests, notify, admission.driver())
            .await?;
        Ok(admission.claim())
    }

    fn status(&self, batch: BatchId) -> Result<BatchStatus> {
        self.inner.batches.status(batch)
    }

    async fn wait(&self, batch: BatchId) -> Result<BatchReport> {
        // Past its deadline, the library batch stays with the poller.
        self.inner.batches.wait(batch).await
    }

    async fn release_batch(&self, batch: BatchId) -> Result<()> {
        self.inner.batches.release(batch)
    }

    fn live_batches(&self) -> Option<usize> {
        Some(self.inner.batches.len())
    }

    /// Mooncake's library serves peers (RDMA, its TCP transport) without
    /// telling Ferry: `served` is `None`; the inbox's dropped notifications
    /// are counted (it is unbounded: only those arriving after shutdown).
    fn inbound(&self) -> Option<ferry_core::Inbound> {
        Some(ferry_core::Inbound::weak(&self.inner))
    }

    /// Ends every `next_notification` waiter with `Canceled`. The library
    /// cannot cancel what it runs: transfers in flight end in it as usual;
    /// the C engine is destroyed when the last handle is dropped.
    async fn shutdown(&self) -> Result<()> {
        self.inner.inbox.close();
        Ok(())
    }

    async fn take_notifications(&self) -> Result<Vec<Notification>> {
        self.take_received().await
    }

    async fn next_notification(&self, name: Option<&str>) -> Result<Notification> {
        self.next_received(name).await
    }
}

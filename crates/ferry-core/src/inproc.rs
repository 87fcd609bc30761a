//! An in-process engine with configurable native capabilities.
//!
//! Engines live in one process and find each other by name through a
//! process-wide registry: [`InprocEngine::open_segment`] with another
//! engine's [`TransferEngine::segment_name`] gives a handle to it. Transfers
//! move real bytes between regions registered with the two engines, under the
//! same [`RegionTable`] guards every backend uses, so the bounds, overlap and
//! unregister-while-in-flight rules hold exactly as on a network backend.
//!
//! Each optional operation is implemented natively only when its
//! [`Capabilities`] field is on; otherwise it answers [`Error::Unsupported`].
//! That makes the engine the test bed for every capability combination of
//! the [`crate::CapabilityAdapter`] and the reference engine of the
//! conformance suite.
//!
//! Copies proceed in chunks of [`InprocEngine::CHUNK`] bytes with a yield to
//! the scheduler between chunks, so a large transfer really is in flight
//! while other tasks run (as it is on a NIC).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::Duration;

use crate::batch::{BatchDriver, BatchTable};
use crate::caps::{BackendInfo, Capabilities, MemoryKinds, MissingCapability, Operation};
use crate::engine::TransferEngine;
use crate::error::{Error, Result, Side};
use crate::region_table::RegionTable;
use crate::types::{
    BatchId, BatchReport, BatchStatus, MemoryRegion, Notification, RegionInfo, SegmentId,
    TransferOp, TransferRequest,
};

const BACKEND: &str = "inproc";

/// Most notifications an engine holds before `take_notifications` (with the
/// size limits of [`Notification::validate`], at most about 66 MiB); a batch
/// whose notification finds the queue full fails its last request with
/// [`Error::QueueFull`].
pub const MAX_QUEUED_NOTIFICATIONS: usize = 1024;

use crate::__private::sync::lock;

/// The process-wide name → engine registry.
fn registry() -> &'static Mutex<HashMap<String, Weak<Core>>> {
    static REGISTRY: OnceLock<Mutex<HashMap<String, Weak<Core>>>> = OnceLock::new();
    REGISTRY.get_or_init(Default::default)
}

static AUTO_NAME: AtomicU64 = AtomicU64::new(1);

/// State shared by an engine, its peers' segment handles and its batch tasks.
#[derive(Debug)]
struct Core {
    name: String,
    caps: Capabilities,
    regions: RegionTable,
    notifications: crate::inbox::Inbox,
    segments: Mutex<HashMap<u64, Arc<Segment>>>,
    batches: BatchTable,
    /// Notifications sent to this engine are refused (for fault tests).
    refuse_notifications: std::sync::atomic::AtomicBool,
    /// What peers copied into and out of this engine's regions.
    served: crate::inbound::ServedTraffic,
    /// Pause after each copied chunk, in microseconds (0: just yield).
    pace_us: AtomicU64,
}

impl Core {
    /// Sleeps for the engine's pace, if it has one (see
    /// [`InprocEngine::set_pace`]).
    async fn pause(&self) {
        match self.pace_us.load(Ordering::Relaxed) {
            0 => {}
            us => tokio::time::sleep(Duration::from_micros(us)).await,
        }
    }
}

/// An open handle to a peer engine.
#[derive(Debug)]
struct Segment {
    name: String,
    peer: Weak<Core>,
    /// Transfers hold a read lock; `close_segment` takes the write lock to
    /// wait for them.
    gate: tokio::sync::RwLock<bool>,
}

/// An engine that moves bytes between engines of the same process (see the
/// module docs).
#[derive(Debug)]
pub struct InprocEngine {
    core: Arc<Core>,
}

impl InprocEngine {
    /// Bytes copied between two yields to the scheduler.
    pub const CHUNK: usize = 64 * 1024;

    /// Creates an engine called `name` (empty: a generated unique name) with
    /// native capabilities `caps`.
    ///
    /// Only host memory can be registered: `caps.memory` is forced to
    /// host-only. Fails with [`Error::InvalidArgument`] if a live engine of
    /// this process already has the name.
    pub fn new(name: &str, caps: Capabilities) -> Result<Self> {
        let name = if name.is_empty() {
            format!(
                "inproc-{}-{}",
                std::process::id(),
                AUTO_NAME.fetch_add(1, Ordering::Relaxed)
            )
        } else {
            name.to_owned()
        };
        let mut caps = caps;
        caps.memory = MemoryKinds {
            host: true,
            cuda: false,
        };
        let core = Arc::new(Core {
            name: name.clone(),
            caps,
            regions: RegionTable::new(),
            notifications: crate::inbox::Inbox::new(MAX_QUEUED_NOTIFICATIONS, usize::MAX),
            segments: Mutex::new(HashMap::new()),
            batches: BatchTable::new(BACKEND),
            refuse_notifications: std::sync::atomic::AtomicBool::new(false),
            served: crate::inbound::ServedTraffic::default(),
            pace_us: AtomicU64::new(0),
        });
        let mut reg = lock(registry());
        if reg.get(&name).is_some_and(|w| w.strong_count() > 0) {
            return Err(Error::InvalidArgument(format!(
                "an inproc engine called {name:?} already exists in this process"
            )));
        }
        reg.insert(name, Arc::downgrade(&core));
        Ok(InprocEngine { core })
    }

    /// An engine with a generated unique name.
    pub fn auto(caps: Capabilities) -> Self {
        match Self::new("", caps) {
            Ok(e) => e,
            // Generated names embed a process-wide counter and cannot clash
            // unless a user picked the same name; fall back to another one.
            Err(_) => Self::auto(caps),
        }
    }

    /// Makes every transfer this engine issues pause for `pace` after each
    /// chunk of [`InprocEngine::CHUNK`] bytes (`None`: only yield), and
    /// `register` and `submit` pause once, so that tests can observe
    /// transfers in flight on a busy machine and drop futures half way.
    pub fn set_pace(&self, pace: Option<Duration>) {
        let us = pace.map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX));
        self.core.pace_us.store(us, Ordering::Relaxed);
    }

    /// Makes this engine refuse (`true`) or accept the notifications peers
    /// send it; a refused notification fails the sender's last request
    /// after its data landed (for fault tests).
    pub fn set_refuse_notifications(&self, refuse: bool) {
        self.core
            .refuse_notifications
            .store(refuse, Ordering::Relaxed);
    }

    /// [`InprocEngine::set_refuse_notifications`] for the live engine of
    /// this process called `name`; whether there is one.
    pub fn refuse_notifications_of(name: &str, refuse: bool) -> bool {
        match lock(registry()).get(name).and_then(Weak::upgrade) {
            Some(core) => {
                core.refuse_notifications.store(refuse, Ordering::Relaxed);
                true
            }
            None => false,
        }
    }

    /// The registered regions, in address order (for tests and tools).
    pub fn regions(&self) -> Vec<RegionInfo> {
        self.core.regions.regions()
    }

    fn unsupported(&self, op: Operation) -> Error {
        Error::unsupported(
            BACKEND,
            op,
            format!(
                "inproc engine {:?} was created without native {op}",
                self.core.name
            ),
        )
    }

    fn segment(&self, id: SegmentId) -> Result<Arc<Segment>> {
        lock(&self.core.segments)
            .get(&id.0)
            .cloned()
            .ok_or(Error::UnknownSegment(id))
    }

    fn check_batch(
        &self,
        requests: &[TransferRequest],
        notify: Option<&Notification>,
    ) -> Result<()> {
        if let Some(max) = self.core.caps.max_batch_len {
            if requests.len() > max {
                return Err(Error::BatchTooLarge {
                    len: requests.len(),
                    max,
                });
            }
        }
        if let Some(n) = notify {
            if !self.core.caps.notify {
                return Err(self.unsupported(Operation::Notify));
            }
            n.validate()?;
        }
        Ok(())
    }
}

impl Drop for InprocEngine {
    fn drop(&mut self) {
        let mut reg = lock(registry());
        if reg
            .get(&self.core.name)
            .is_some_and(|w| w.as_ptr() == Arc::as_ptr(&self.core))
        {
            reg.remove(&self.core.name);
        }
    }
}

/// Copies `request` between `local` and the peer behind `segment`.
async fn copy(local: &Core, segment: &Segment, request: TransferRequest) -> Result<()> {
    let open = segment.gate.read().await;
    let Some(c) = Checked::new(local, segment, request, *open)? else {
        return Ok(());
    };
    let mut done = 0;
    while done < c.len {
        let n = InprocEngine::CHUNK.min(c.len - done);
        c.copy(done, n);
        done += n;
        if done < c.len {
            match local.pace_us.load(Ordering::Relaxed) {
                0 => tokio::task::yield_now().await,
                _ => local.pause().await,
            }
        }
    }
    c.served();
    drop(open);
    Ok(())
}

/// A request checked against both engines' regions, their guards held.
struct Checked {
    lg: crate::RegionGuard,
    rg: crate::RegionGuard,
    op: TransferOp,
    len: usize,
    served: crate::inbound::ServedPeer,
}

impl Checked {
    /// `None`: nothing to copy (an empty request on an open segment).
    fn new(
        local: &Core,
        segment: &Segment,
        request: TransferRequest,
        open: bool,
    ) -> Result<Option<Checked>> {
        if !open {
            return Err(Error::Canceled(format!(
                "segment {:?} was closed",
                segment.name
            )));
        }
        if request.len == 0 {
            return Ok(None);
        }
        let peer = segment.peer.upgrade().ok_or_else(|| Error::PeerLost {
            peer: segment.name.clone(),
            reason: "the inproc engine was dropped".to_owned(),
        })?;
        let lg = local
            .regions
            .acquire(request.local_addr, request.len, Side::Local, None)?;
        let rg = peer.regions.acquire(
            request.remote_addr,
            request.len,
            Side::Remote,
            Some(&segment.name),
        )?;
        let served = peer.served.peer(&local.name);
        let len = usize::try_from(request.len)
            .map_err(|_| Error::InvalidArgument(format!("length {} exceeds usize", request.len)))?;
        Ok(Some(Checked {
            lg,
            rg,
            op: request.op,
            len,
            served,
        }))
    }

    /// Copies bytes `[at, at + n)` of the request.
    fn copy(&self, at: usize, n: usize) {
        let (src, dst) = match self.op {
            TransferOp::Write => (&self.lg, &self.rg),
            TransferOp::Read => (&self.rg, &self.lg),
        };
        debug_assert!(at + n <= self.len);
        // SAFETY: both guards keep their regions registered, and the
        // registrants promised (MemoryRegion::from_raw_parts) that registered
        // memory stays valid for reads and writes; both ranges were
        // bounds-checked by `acquire` for the request's length. `copy`
        // (memmove) allows the two ranges to overlap, which happens when an
        // engine targets its own memory.
        unsafe { std::ptr::copy(src.as_ptr().add(at), dst.as_ptr().add(at), n) };
    }

    /// Counts the request as served by the peer, once its guards are gone.
    fn served(self) {
        let (served, len) = (self.served, self.len as u64);
        drop((self.lg, self.rg));
        match self.op {
            TransferOp::Write => served.wrote(len, 1),
            TransferOp::Read => served.read(len, 1),
        }
    }
}

impl crate::inbound::InboundSource for Core {
    fn snapshot(&self) -> crate::inbound::InboundSnapshot {
        crate::inbound::InboundSnapshot::new()
            .with_served(self.served.snapshot())
            .with_notifications_dropped(self.notifications.dropped())
    }
}

/// Runs every request in order, reporting each to `driver`, then hands
/// `notify` to the peer if all succeeded, and finishes the batch.
async fn run_batch(
    local: Arc<Core>,
    segment: Arc<Segment>,
    requests: Vec<TransferRequest>,
    notify: Option<Notification>,
    driver: BatchDriver,
) -> Result<BatchReport> {
    for (i, r) in requests.into_iter().enumerate() {
        let res = copy(&local, &segment, r).await;
        driver.complete(i, res);
    }
    let notified = match notify {
        Some(note) if driver.all_ok() => Some(deliver(&segment, note)),
        _ => None,
    };
    driver.finish(notified)
}

/// Puts `note` in the queue of the engine behind `segment`.
fn deliver(segment: &Segment, note: Notification) -> Result<()> {
    let Some(peer) = segment.peer.upgrade() else {
        return Err(Error::SegmentUnavailable {
            name: segment.name.clone(),
            reason: "the peer engine is gone; the notification was not delivered".to_owned(),
        });
    };
    if peer.refuse_notifications.load(Ordering::Relaxed) {
        peer.notifications
            .count_refused(crate::inbox::PushRefused::Full);
        return Err(Error::SegmentUnavailable {
            name: segment.name.clone(),
            reason: "the peer refuses notifications".to_owned(),
        });
    }
    match peer.notifications.push(note) {
        Ok(()) => Ok(()),
        Err(crate::inbox::PushRefused::Full) => Err(Error::QueueFull {
            backend: BACKEND.into(),
            queue: crate::error::Queue::Notifications,
            what: format!("{}'s notification queue", segment.name),
            limit: Some(MAX_QUEUED_NOTIFICATIONS as u64),
        }),
        Err(crate::inbox::PushRefused::Closed) => Err(Error::SegmentUnavailable {
            name: segment.name.clone(),
            reason: "the peer engine is shutting down; the notification was not delivered"
                .to_owned(),
        }),
    }
}

impl TransferEngine for InprocEngine {
    fn backend_name(&self) -> &str {
        BACKEND
    }

    fn segment_name(&self) -> &str {
        &self.core.name
    }

    fn capabilities(&self) -> Capabilities {
        self.core.caps
    }

    fn backend_info(&self) -> BackendInfo {
        let not_native = Operation::OPTIONAL
            .into_iter()
            .filter(|op| !self.core.caps.supports(*op))
            .map(|op| MissingCapability {
                operation: op,
                reason: format!("the inproc engine was configured without native {op}"),
                min_version: None,
            })
            .collect();
        BackendInfo {
            backend: BACKEND.to_owned(),
            details: vec![("segment".to_owned(), self.core.name.clone())],
            not_native,
            emulated: Vec::new(),
        }
    }

    async fn register(&self, region: MemoryRegion) -> Result<()> {
        region.require_host("inproc")?;
        // A paced engine takes its time, as pinning memory does.
        self.core.pause().await;
        self.core.regions.insert(region)
    }

    async fn unregister(&self, addr: u64) -> Result<()> {
        self.core.regions.remove(addr).await.map(drop)
    }

    async fn batch_register(&self, regions: Vec<MemoryRegion>) -> Result<()> {
        if !self.core.caps.batch_register {
            return Err(self.unsupported(Operation::BatchRegister));
        }
        for (index, region) in regions.iter().enumerate() {
            region
                .require_host("inproc")
                .map_err(|source| Error::BatchRegisterFailed {
                    index,
                    addr: region.addr(),
                    source: Box::new(source),
                })?;
        }
        self.core.regions.insert_all(regions)
    }

    async fn batch_unregister(&self, addrs: &[u64]) -> Result<()> {
        if !self.core.caps.batch_unregister {
            return Err(self.unsupported(Operation::BatchUnregister));
        }
        let mut first = None;
        for &addr in addrs {
            if let Err(e) = self.unregister(addr).await {
                first.get_or_insert(e);
            }
        }
        first.map_or(Ok(()), Err)
    }

    async fn open_segment(&self, name: &str) -> Result<SegmentId> {
        let peer = lock(registry()).get(name).and_then(Weak::upgrade);
        let Some(peer) = peer else {
            return Err(Error::SegmentUnavailable {
                name: name.to_owned(),
                reason: "no inproc engine of this process has that name".to_owned(),
            });
        };
        let id = SegmentId::fresh().0;
        lock(&self.core.segments).insert(
            id,
            Arc::new(Segment {
                name: name.to_owned(),
                peer: Arc::downgrade(&peer),
                gate: tokio::sync::RwLock::new(true),
            }),
        );
        Ok(SegmentId(id))
    }

    async fn close_segment(&self, segment: SegmentId) -> Result<()> {
        let seg = lock(&self.core.segments)
            .remove(&segment.0)
            .ok_or(Error::UnknownSegment(segment))?;
        *seg.gate.write().await = false;
        Ok(())
    }

    async fn transfer(&self, segment: SegmentId, request: TransferRequest) -> Result<()> {
        let seg = self.segment(segment)?;
        copy(&self.core, &seg, request).await
    }

    async fn batch_transfer(
        &self,
        segment: SegmentId,
        requests: &[TransferRequest],
        notify: Option<&Notification>,
    ) -> Result<BatchReport> {
        if !self.core.caps.batch_transfer {
            return Err(self.unsupported(Operation::BatchTransfer));
        }
        let seg = self.segment(segment)?;
        self.check_batch(requests, notify)?;
        run_batch(
            Arc::clone(&self.core),
            seg,
            requests.to_vec(),
            notify.cloned(),
            BatchDriver::detached(requests.len()),
        )
        .await
    }

    async fn submit(
        &self,
        segment: SegmentId,
        requests: &[TransferRequest],
        notify: Option<&Notification>,
    ) -> Result<BatchId> {
        if !self.core.caps.async_batch {
            return Err(self.unsupported(Operation::AsyncBatch));
        }
        let seg = self.segment(segment)?;
        self.check_batch(requests, notify)?;
        let admission = self.core.batches.admit(requests.len())?;
        // A paced engine takes its time to post the batch, as a NIC does.
        self.core.pause().await;
        let run = run_batch(
            Arc::clone(&self.core),
            seg,
            requests.to_vec(),
            notify.cloned(),
            admission.driver().clone(),
        );
        if requests.is_empty() {
            // Nothing to wait for: deliver the notification now, so that a
            // batch that `status` shows finished has delivered it; a refused
            // notification refuses the batch (nothing moved) and the
            // unclaimed admission takes the id back.
            run.await?;
        } else {
            tokio::spawn(run);
        }
        Ok(admission.claim())
    }

    fn status(&self, batch: BatchId) -> Result<BatchStatus> {
        if !self.core.caps.async_batch {
            return Err(self.unsupported(Operation::AsyncBatch));
        }
        self.core.batches.status(batch)
    }

    async fn wait(&self, batch: BatchId) -> Result<BatchReport> {
        if !self.core.caps.batch_wait {
            return Err(self.unsupported(Operation::BatchWait));
        }
        self.core.batches.wait(batch).await
    }

    async fn release_batch(&self, batch: BatchId) -> Result<()> {
        if !self.core.caps.async_batch {
            return Err(self.unsupported(Operation::AsyncBatch));
        }
        self.core.batches.release(batch)
    }

    async fn take_notifications(&self) -> Result<Vec<Notification>> {
        if !self.core.caps.notify {
            return Err(self.unsupported(Operation::Notify));
        }
        Ok(self.core.notifications.take_all())
    }

    async fn next_notification(&self, name: Option<&str>) -> Result<Notification> {
        if !self.core.caps.notify {
            return Err(self.unsupported(Operation::Notify));
        }
        Ok(self.core.notifications.next(name).await?)
    }

    fn live_batches(&self) -> Option<usize> {
        Some(self.core.batches.len())
    }

    /// The bytes peers' requests copied into and out of this engine's
    /// regions (per peer engine name), and the dropped notifications.
    fn inbound(&self) -> Option<crate::inbound::Inbound> {
        Some(crate::inbound::Inbound::weak(&self.core))
    }

    /// Ends the notification waiters with `Canceled`; the engine has no
    /// task of its own to stop.
    async fn shutdown(&self) -> Result<()> {
        self.core.notifications.close();
        Ok(())
    }
}

//! The RDMA implementation (feature `rdma`).

mod conn;
mod device;
mod poller;
mod progress;
mod server;

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use ferry_core::raw::{BatchDriver, BatchTable, RegionTable};
use ferry_core::{
    BackendInfo, BatchId, BatchReport, BatchStatus, Capabilities, Error, MemoryKinds, MemoryRegion,
    MissingCapability, Notification, Operation, Result, SegmentId, Side, TransferRequest,
};
use sideway::ibverbs::memory_region::MemoryRegion as Mr;
use sideway::ibverbs::AccessFlags;
use tokio::sync::{mpsc, Notify};

use self::conn::Conn;
use self::device::Device;
use self::poller::Poller;
use self::progress::Progress;
use crate::config::VerbsConfig;
use crate::negotiate::{Feature, Offer, PeerProtocol};
use crate::plan::{self, Piece};
use crate::wire::{Msg, RemoteRegion};
use crate::{Fault, BACKEND};

/// Most work requests posted as one chain.
const MAX_CHAIN: usize = 64;

/// Most notifications an engine holds before `take_notifications`; one
/// arriving beyond that (or beyond [`MAX_QUEUED_NOTIFICATION_BYTES`]) is
/// refused, and the sender's batch fails its last request with
/// [`Error::QueueFull`].
pub const MAX_QUEUED_NOTIFICATIONS: usize = 1024;
/// Most bytes of the notifications an engine holds, counted as allocated
/// (`ferry_core::raw::notification_cost`).
pub const MAX_QUEUED_NOTIFICATION_BYTES: usize = 16 << 20;

/// The control queue of one connected opener and the switch that
/// disconnects it when the queue overflows.
type Subscriber = (mpsc::Sender<Msg>, Arc<Notify>);

struct Segment {
    name: String,
    conn: tokio::sync::Mutex<Option<Arc<Conn>>>,
}

pub(crate) struct Inner {
    dev: Arc<Device>,
    name: String,
    poller: Arc<Poller>,
    runtime: Mutex<Option<tokio::runtime::Runtime>>,
    handle: tokio::runtime::Handle,
    local: RegionTable,
    mrs: Mutex<BTreeMap<u64, Arc<Mr>>>,
    segments: Mutex<HashMap<u64, Arc<Segment>>>,
    batches: BatchTable,
    notifications: ferry_core::raw::Inbox,
    refuse_notifications: AtomicBool,
    /// Closed by `shutdown`: a semaphore with no permits, whose `acquire`
    /// ends (with an error) exactly when it is closed.
    stopped: tokio::sync::Semaphore,
    subs: Mutex<HashMap<u64, Subscriber>>,
    /// What was negotiated with each connected opener (same ids as `subs`).
    inbound: Mutex<HashMap<u64, PeerProtocol>>,
    next_sub: AtomicU64,
}

use ferry_core::__private::sync::lock;

impl Inner {
    pub(crate) async fn start(cfg: VerbsConfig) -> Result<Arc<Inner>> {
        let dev = Arc::new(Device::open(&cfg)?);
        let poller = Poller::start(Arc::clone(&dev.ctx), Arc::clone(&dev.channel))?;
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("ferry-verbs-ctl")
            .enable_all()
            .build()
            .map_err(|e| Error::io("starting the verbs control runtime", &e))?;
        let handle = runtime.handle().clone();
        let listen = cfg.listen;
        let listener = handle
            .spawn(async move { tokio::net::TcpListener::bind(listen).await })
            .await
            .map_err(|e| Error::Canceled(format!("binding the control listener: {e}")))?
            .map_err(|e| {
                Error::io(
                    format!("binding the verbs control listener on {listen}"),
                    &e,
                )
            })?;
        let bound = listener
            .local_addr()
            .map_err(|e| Error::io("reading the control listener address", &e))?;
        let inner = Arc::new(Inner {
            dev,
            name: bound.to_string(),
            poller,
            runtime: Mutex::new(Some(runtime)),
            handle: handle.clone(),
            local: RegionTable::new(),
            mrs: Mutex::new(BTreeMap::new()),
            segments: Mutex::new(HashMap::new()),
            batches: BatchTable::new(BACKEND),
            notifications: ferry_core::raw::Inbox::new(
                MAX_QUEUED_NOTIFICATIONS,
                MAX_QUEUED_NOTIFICATION_BYTES,
            ),
            refuse_notifications: AtomicBool::new(false),
            stopped: tokio::sync::Semaphore::new(0),
            subs: Mutex::new(HashMap::new()),
            inbound: Mutex::new(HashMap::new()),
            next_sub: AtomicU64::new(1),
        });
        handle.spawn(server::accept_loop(listener, Arc::downgrade(&inner)));
        tracing::info!(
            device = %inner.dev.name,
            segment = %inner.name,
            "verbs engine started"
        );
        Ok(inner)
    }

    /// Stops the control runtime (closing every control connection and
    /// passive queue pair) and then the completion thread, on a detached
    /// helper thread: the caller (often a Tokio worker dropping the engine)
    /// never blocks on either.
    pub(crate) fn shutdown(&self) -> Option<std::thread::JoinHandle<()>> {
        self.notifications.close();
        self.stopped.close();
        let rt = lock(&self.runtime).take();
        let poller = Arc::clone(&self.poller);
        let stopper = std::thread::Builder::new()
            .name("ferry-verbs-stop".into())
            .spawn(move || {
                if let Some(rt) = rt {
                    // Drops every control task (its socket and queue pair),
                    // so peers see this engine go away.
                    rt.shutdown_timeout(std::time::Duration::from_secs(5));
                }
                poller.stop();
            });
        match stopper {
            Ok(t) => Some(t),
            Err(e) => {
                tracing::warn!(error = %e, "verbs: no thread to stop the engine on; stopping in place");
                None
            }
        }
    }

    /// Runs `fut` until it ends or the engine shuts down; then `Canceled`.
    /// The memory of work requests still posted stays guarded (by their
    /// batch's progress) until the device flushed them: the shutdown breaks
    /// every queue pair.
    pub(crate) async fn until_stopped<T>(
        &self,
        fut: impl std::future::Future<Output = Result<T>>,
    ) -> Result<T> {
        tokio::select! {
            biased;
            r = fut => r,
            _ = self.stopped.acquire() => Err(Error::Canceled(
                "the verbs engine shut down".to_owned(),
            )),
        }
    }

    pub(crate) fn segment_name(&self) -> &str {
        &self.name
    }

    pub(crate) fn capabilities(&self) -> Capabilities {
        let mut caps = Capabilities::default();
        caps.batch_transfer = true;
        caps.async_batch = true;
        caps.batch_wait = true;
        caps.notify = true;
        caps.memory = MemoryKinds {
            host: true,
            cuda: false,
        };
        caps
    }

    pub(crate) fn backend_info(&self) -> BackendInfo {
        let mut details = self.dev.details();
        details.push(("segment".into(), self.name.clone()));
        details.push((
            "authentication".into(),
            if self.dev.cfg.secret.is_some() {
                "HMAC-SHA256 shared secret (mutual challenge–response)"
            } else {
                "none"
            }
            .into(),
        ));
        let offer = self.offer();
        let features: Vec<&str> = offer.features.iter().map(|f| f.name()).collect();
        details.push((
            "protocol".into(),
            format!(
                "control channel versions {}; features {}",
                offer.versions,
                if features.is_empty() {
                    "none".to_owned()
                } else {
                    features.join(", ")
                }
            ),
        ));
        // `peer NAME` → `path: …` is the convention `ferry bench` reads;
        // the negotiated protocol is next to it.
        for p in self.peer_protocols() {
            if p.opened_here {
                details.push((
                    format!("peer {}", p.peer),
                    format!("path: RDMA RC queue pair, protocol {}", p.version),
                ));
                details.push((format!("protocol peer {}", p.peer), p.to_string()));
            } else {
                details.push((format!("protocol opener {}", p.peer), p.to_string()));
            }
        }
        BackendInfo {
            backend: BACKEND.into(),
            details,
            not_native: vec![
                MissingCapability {
                    operation: Operation::BatchRegister,
                    reason: "ibv_reg_mr registers one memory region per call".into(),
                    min_version: None,
                },
                MissingCapability {
                    operation: Operation::BatchUnregister,
                    reason: "ibv_dereg_mr deregisters one memory region per call".into(),
                    min_version: None,
                },
            ],
            emulated: Vec::new(),
        }
    }

    fn subscribers(&self) -> MutexGuard<'_, HashMap<u64, Subscriber>> {
        lock(&self.subs)
    }

    fn inbound(&self) -> MutexGuard<'_, HashMap<u64, PeerProtocol>> {
        lock(&self.inbound)
    }

    /// What this engine announces on every control connection.
    fn offer(&self) -> Offer {
        Offer::local(
            self.dev.cfg.test_protocol_max,
            &self.dev.cfg.test_features_off,
        )
    }

    /// The protocol agreed with every peer connected now: the segments this
    /// engine opened (whose connection is not being replaced), then the
    /// openers connected to it.
    pub(crate) fn peer_protocols(&self) -> Vec<PeerProtocol> {
        let segs: Vec<Arc<Segment>> = lock(&self.segments).values().cloned().collect();
        let mut out: Vec<PeerProtocol> = Vec::new();
        for seg in segs {
            if let Ok(slot) = seg.conn.try_lock() {
                if let Some(c) = slot.as_ref().filter(|c| !c.is_broken()) {
                    if !out.iter().any(|p| p.opened_here && p.peer == c.peer) {
                        out.push(c.protocol.clone());
                    }
                }
            }
        }
        let mut inbound: Vec<(u64, PeerProtocol)> = self
            .inbound()
            .iter()
            .map(|(id, p)| (*id, p.clone()))
            .collect();
        inbound.sort_by_key(|(id, _)| *id);
        out.extend(inbound.into_iter().map(|(_, p)| p));
        out
    }

    pub(crate) async fn peer_protocol(&self, segment: SegmentId) -> Option<PeerProtocol> {
        let seg = lock(&self.segments).get(&segment.0).cloned()?;
        let slot = seg.conn.lock().await;
        slot.as_ref()
            .filter(|c| !c.is_broken())
            .map(|c| c.protocol.clone())
    }

    /// Queues `msg` to every connected opener; one whose queue is full
    /// (it does not read) is disconnected and rebuilds its table when it
    /// reconnects.
    fn broadcast(&self, msg: &Msg) {
        for (tx, kill) in self.subscribers().values() {
            if let Err(mpsc::error::TrySendError::Full(_)) = tx.try_send(msg.clone()) {
                kill.notify_one();
            }
        }
    }

    fn region_snapshot(&self) -> Vec<RemoteRegion> {
        lock(&self.mrs)
            .iter()
            .map(|(addr, mr)| RemoteRegion {
                addr: *addr,
                len: mr.region_len() as u64,
                rkey: mr.rkey(),
            })
            .collect()
    }

    /// Queues a notification a peer SENT, or says why not: `(true, bound)`
    /// when the queue is full, `(false, reason)` when refused.
    fn accept_notification(&self, n: Notification) -> std::result::Result<(), (bool, String)> {
        if self.refuse_notifications.load(Ordering::Relaxed) {
            return Err((false, "this engine refuses notifications".to_owned()));
        }
        match self.notifications.push(n) {
            Ok(()) => Ok(()),
            Err(ferry_core::raw::PushRefused::Full) => Err((
                true,
                format!(
                    "{MAX_QUEUED_NOTIFICATIONS} notifications or {MAX_QUEUED_NOTIFICATION_BYTES} bytes \
                     (holding {} notifications)",
                    self.notifications.len()
                ),
            )),
            Err(ferry_core::raw::PushRefused::Closed) => {
                Err((false, "this engine is shutting down".to_owned()))
            }
        }
    }

    pub(crate) fn take_notifications(&self) -> Vec<Notification> {
        self.notifications.take_all()
    }

    pub(crate) async fn next_notification(&self, name: Option<&str>) -> Result<Notification> {
        Ok(self.notifications.next(name).await?)
    }

    pub(crate) fn set_refuse_notifications(&self, refuse: bool) {
        self.refuse_notifications.store(refuse, Ordering::Relaxed);
    }

    pub(crate) async fn register(&self, region: MemoryRegion) -> Result<()> {
        if !region.location().is_host() {
            return Err(Error::InvalidArgument(format!(
                "the verbs backend registers host memory only; {} needs GPUDirect RDMA, which this build does not support",
                region.location()
            )));
        }
        if region.is_empty() {
            return Err(Error::InvalidArgument(format!(
                "cannot register an empty region at {:#x}",
                region.addr()
            )));
        }
        if region.len() > usize::MAX as u64 {
            return Err(Error::InvalidArgument(format!(
                "region of {} bytes is too large",
                region.len()
            )));
        }
        // ibv_reg_mr pins the pages (seconds for gigabytes): off the async
        // workers. If this future is dropped meanwhile, the MR is dropped
        // (deregistered) when the blocking call returns and nothing stays
        // registered.
        let pd = Arc::clone(&self.dev.pd);
        let (addr, len) = (region.addr() as usize, region.len() as usize);
        let mr = tokio::task::spawn_blocking(move || {
            // SAFETY: the caller promised (MemoryRegion::from_raw_parts)
            // that the range stays valid until `unregister` returns; the MR
            // is dropped (deregistered) in `unregister` before that, or
            // below if the registration does not complete.
            unsafe {
                pd.reg_mr(
                    addr,
                    len,
                    AccessFlags::LocalWrite | AccessFlags::RemoteWrite | AccessFlags::RemoteRead,
                )
            }
            .map_err(|e| device::verbs_error("ibv_reg_mr", &device::io_of(&e)))
        })
        .await
        .map_err(|e| Error::Canceled(format!("ibv_reg_mr did not finish: {e}")))??;
        // From here on nothing awaits: the registration completes or fails
        // as a whole.
        let remote = RemoteRegion {
            addr: region.addr(),
            len: region.len(),
            rkey: mr.rkey(),
        };
        if let Err(e) = self.local.insert(region) {
            drop_off_workers(mr);
            return Err(e);
        }
        lock(&self.mrs).insert(remote.addr, mr);
        self.broadcast(&Msg::RegionAdded(remote));
        Ok(())
    }

    /// Revoke, then remove: local transfers are waited for and new ones
    /// refused (the range stays taken), the MR is deregistered (the device
    /// refuses every later access by peers), and only then the range
    /// leaves the table, so a region registered anew over it can never
    /// meet the old MR. The deregistration blocks (unpinning) and runs off
    /// the async workers; the range is freed by the same blocking task,
    /// after the MR is gone, even if this future is dropped meanwhile (a
    /// dropped call may so leave the region unregistered, as the trait
    /// allows; it never frees the range while peers can still reach it).
    pub(crate) async fn unregister(&self, addr: u64) -> Result<()> {
        // Waits for local transfers using the region (cancel-safe).
        tracing::debug!(addr, "unregister: waiting for local transfers");
        let removal = self.local.remove_in_steps(addr).await?;
        tracing::debug!(addr, "unregister: no local transfer left");
        let mr = lock(&self.mrs).remove(&addr);
        self.broadcast(&Msg::RegionRemoved { addr });
        let done = tokio::task::spawn_blocking(move || {
            drop(mr);
            removal.finish();
        });
        done.await
            .map_err(|e| Error::Canceled(format!("ibv_dereg_mr did not finish: {e}")))
    }

    pub(crate) async fn open_segment(&self, name: &str) -> Result<SegmentId> {
        // Handles of the same name share one connection (one queue pair);
        // closing one handle leaves the others open.
        let existing = lock(&self.segments)
            .values()
            .find(|s| s.name == name)
            .cloned();
        let seg = match existing {
            Some(seg) => {
                self.healthy(&seg).await?;
                seg
            }
            None => {
                let seg = Arc::new(Segment {
                    name: name.to_owned(),
                    conn: tokio::sync::Mutex::new(None),
                });
                self.healthy(&seg).await?;
                seg
            }
        };
        let id = SegmentId::fresh().0;
        lock(&self.segments).insert(id, seg);
        Ok(SegmentId(id))
    }

    pub(crate) async fn close_segment(&self, segment: SegmentId) -> Result<()> {
        let seg = lock(&self.segments)
            .remove(&segment.0)
            .ok_or(Error::UnknownSegment(segment))?;
        // In-flight batches hold their own reference to the connection;
        // other handles of the same name keep using it.
        let shared = lock(&self.segments).values().any(|s| Arc::ptr_eq(s, &seg));
        if !shared {
            seg.conn.lock().await.take();
        }
        Ok(())
    }

    async fn connect(&self, name: &str) -> Result<Arc<Conn>> {
        let dev = Arc::clone(&self.dev);
        let poller = Arc::clone(&self.poller);
        let (peer, me) = (name.to_owned(), self.name.clone());
        self.handle
            .spawn(async move { Conn::connect(dev, poller, &peer, &me).await })
            .await
            .map_err(|e| Error::Canceled(format!("connecting to {name}: {e}")))?
    }

    /// The healthy connection of `segment`, reconnecting if it broke.
    async fn conn(&self, segment: SegmentId) -> Result<Arc<Conn>> {
        let seg = lock(&self.segments)
            .get(&segment.0)
            .cloned()
            .ok_or(Error::UnknownSegment(segment))?;
        self.healthy(&seg).await
    }

    /// The healthy connection of `seg`, (re)connecting when needed.
    async fn healthy(&self, seg: &Segment) -> Result<Arc<Conn>> {
        let mut slot = seg.conn.lock().await;
        if let Some(c) = slot.as_ref() {
            if !c.is_broken() {
                return Ok(Arc::clone(c));
            }
            tracing::info!(peer = %seg.name, "re-establishing the verbs queue pair");
        }
        *slot = None;
        let c = self.connect(&seg.name).await?;
        *slot = Some(Arc::clone(&c));
        Ok(c)
    }

    pub(crate) async fn inject_fault(&self, segment: SegmentId, fault: Fault) -> Result<()> {
        let c = self.conn(segment).await?;
        match fault {
            Fault::QpError => c.force_qp_error(),
            Fault::InvalidRkey => {
                c.corrupt_next_rkey();
                Ok(())
            }
            Fault::LoseCompletions => {
                c.lose_completions();
                Ok(())
            }
        }
    }

    pub(crate) async fn queue_pair_number(&self, segment: SegmentId) -> Option<u32> {
        let seg = lock(&self.segments).get(&segment.0).cloned()?;
        let slot = seg.conn.lock().await;
        slot.as_ref()
            .filter(|c| !c.is_broken())
            .map(|c| c.qp_number())
    }

    pub(crate) async fn transfer(
        &self,
        segment: SegmentId,
        request: TransferRequest,
    ) -> Result<()> {
        let mut report = self.batch_transfer(segment, &[request], None).await?;
        report.results.pop().unwrap_or(Ok(()))
    }

    pub(crate) async fn batch_transfer(
        &self,
        segment: SegmentId,
        requests: &[TransferRequest],
        notify: Option<&Notification>,
    ) -> Result<BatchReport> {
        let driver = BatchDriver::detached(requests.len());
        self.start_batch(segment, requests, notify, driver.clone())
            .await?;
        driver.wait().await
    }

    pub(crate) async fn submit(
        &self,
        segment: SegmentId,
        requests: &[TransferRequest],
        notify: Option<&Notification>,
    ) -> Result<BatchId> {
        if let Some(n) = notify {
            n.validate()?;
        }
        // Admitted first (bounded table); the id is taken back if the batch
        // is refused or this future is dropped before it is handed out.
        let admission = self.batches.admit(requests.len())?;
        let task = self
            .start_batch(segment, requests, notify, admission.driver().clone())
            .await?;
        if requests.is_empty() {
            // Nothing but the notification: wait for it, so that a refused
            // one refuses the batch (nothing moved).
            task.await
                .map_err(|e| Error::Canceled(format!("the batch task ended: {e}")))??;
        }
        Ok(admission.claim())
    }

    pub(crate) fn live_batches(&self) -> usize {
        self.batches.len()
    }

    pub(crate) fn status(&self, id: BatchId) -> Result<BatchStatus> {
        self.batches.status(id)
    }

    pub(crate) async fn wait(&self, id: BatchId) -> Result<BatchReport> {
        self.batches.wait(id).await
    }

    pub(crate) fn release_batch(&self, id: BatchId) -> Result<()> {
        self.batches.release(id)
    }

    /// Validates every request, plans the work requests and starts posting
    /// them on the control runtime; the task reports through `driver` and
    /// finishes the batch after the notification (if any) was answered.
    /// `Err` only when the batch as a whole is refused (unknown or
    /// unreachable segment, bad notification): then nothing was posted.
    async fn start_batch(
        &self,
        segment: SegmentId,
        requests: &[TransferRequest],
        notify: Option<&Notification>,
        driver: BatchDriver,
    ) -> Result<tokio::task::JoinHandle<Result<BatchReport>>> {
        if let Some(n) = notify {
            n.validate()?;
        }
        let conn = self.conn(segment).await?;
        if notify.is_some() && !conn.features.contains(Feature::Notify) {
            return Err(Error::unsupported(
                BACKEND,
                Operation::Notify,
                format!(
                    "notifications are not in use with {}: {}",
                    conn.peer, conn.protocol
                ),
            ));
        }
        let batch = Arc::new(Progress::new(driver));
        let mut pieces = Vec::new();
        let mut guards = Vec::new();
        let mut refreshed = false;
        for (i, r) in requests.iter().enumerate() {
            if r.len == 0 {
                batch.settle(i, Ok(()));
                continue;
            }
            let guard = match self.local.acquire(r.local_addr, r.len, Side::Local, None) {
                Ok(g) => g,
                Err(e) => {
                    batch.settle(i, Err(e));
                    continue;
                }
            };
            let lkey = lock(&self.mrs)
                .get(&guard.region_addr())
                .map(|mr| mr.lkey());
            let Some(lkey) = lkey else {
                batch.settle(
                    i,
                    Err(Error::AddressNotRegistered {
                        side: Side::Local,
                        addr: r.local_addr,
                        len: r.len,
                        peer: None,
                    }),
                );
                continue;
            };
            let mut rkey = conn.lookup(r.remote_addr, r.len);
            if rkey.is_none() && !refreshed && conn.features.contains(Feature::TableFetch) {
                // The peer may have registered it after our last update.
                refreshed = true;
                if let Err(e) = conn.refresh_regions().await {
                    tracing::debug!(peer = %conn.peer, error = %e, "region table refresh failed");
                }
                rkey = conn.lookup(r.remote_addr, r.len);
            }
            let Some(rkey) = rkey else {
                batch.settle(
                    i,
                    Err(Error::AddressNotRegistered {
                        side: Side::Remote,
                        addr: r.remote_addr,
                        len: r.len,
                        peer: Some(conn.peer.clone()),
                    }),
                );
                continue;
            };
            pieces.push(Piece {
                req: i as u32,
                op: r.op,
                local: r.local_addr,
                lkey,
                remote: r.remote_addr,
                rkey,
                len: r.len,
            });
            guards.push((i, guard));
        }
        let wrs = plan::plan(&pieces, self.dev.max_message, self.dev.max_sge as usize);
        let mut counts = vec![0u32; requests.len()];
        for w in &wrs {
            for &r in &w.reqs {
                counts[r as usize] += 1;
            }
        }
        for (i, g) in guards {
            batch.arm(i, counts[i], g);
        }
        let notify = notify.cloned();
        Ok(self.handle.spawn(async move {
            // Dropped unfinished (the control runtime shut down): the batch
            // finishes, its unreported requests `Canceled`, so no caller
            // waits forever. Their memory stays guarded by `batch` until
            // the device is done with their work requests (the shutdown
            // breaks every queue pair, which flushes them).
            let mut unfinished = FinishOnDrop(Some(batch.driver().clone()));
            for chain in wrs.chunks(MAX_CHAIN.min(conn_chain_limit(&conn))) {
                conn.post_chain(&batch, chain).await;
            }
            let ok = batch.all_reported().await;
            // The notification is SENT on the same queue pair, after the
            // data; the batch finishes once the peer answered it.
            let notified = match notify {
                Some(n) if ok => Some(conn.notify(&n).await),
                _ => None,
            };
            unfinished.0 = None;
            batch.driver().finish(notified)
        }))
    }
}

/// Finishes a batch whose task was dropped before it did.
struct FinishOnDrop(Option<BatchDriver>);

impl Drop for FinishOnDrop {
    fn drop(&mut self) {
        if let Some(d) = self.0.take() {
            let _ = d.finish(None);
        }
    }
}

fn conn_chain_limit(c: &Conn) -> usize {
    c.chain_limit()
}

/// Drops `v` (an MR: deregistration blocks) on the blocking pool when there
/// is a runtime, else here.
fn drop_off_workers<T: Send + 'static>(v: T) {
    match tokio::runtime::Handle::try_current() {
        Ok(h) => {
            h.spawn_blocking(move || drop(v));
        }
        Err(_) => drop(v),
    }
}

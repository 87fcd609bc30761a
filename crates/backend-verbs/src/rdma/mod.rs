//! The RDMA implementation (feature `rdma`).

mod batch;
mod conn;
mod device;
mod poller;
mod server;

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use sideway::ibverbs::memory_region::MemoryRegion as Mr;
use sideway::ibverbs::AccessFlags;
use tokio::sync::mpsc;
use transport_core::{
    BackendInfo, BatchId, BatchReport, BatchStatus, Capabilities, Error, MemoryKinds, MemoryRegion,
    MissingCapability, Notification, Operation, RegionTable, Result, SegmentId, Side,
    TransferRequest,
};

use self::batch::Batch;
use self::conn::Conn;
use self::device::Device;
use self::poller::Poller;
use crate::config::VerbsConfig;
use crate::plan::{self, Piece};
use crate::wire::{Msg, RemoteRegion};
use crate::{Fault, BACKEND};

/// Most work requests posted as one chain.
const MAX_CHAIN: usize = 64;

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
    next_segment: AtomicU64,
    batches: Mutex<HashMap<u64, Arc<Batch>>>,
    next_batch: AtomicU64,
    notifications: Mutex<Vec<Notification>>,
    subs: Mutex<HashMap<u64, mpsc::UnboundedSender<Msg>>>,
    next_sub: AtomicU64,
}

use transport_core::raw::lock;

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
            next_segment: AtomicU64::new(1),
            batches: Mutex::new(HashMap::new()),
            next_batch: AtomicU64::new(1),
            notifications: Mutex::new(Vec::new()),
            subs: Mutex::new(HashMap::new()),
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

    /// Stops the completion thread and the control runtime (closing every
    /// control connection and passive queue pair).
    pub(crate) fn shutdown(&self) {
        if let Some(rt) = lock(&self.runtime).take() {
            // Drop every control task now (closing its socket and passive
            // queue pair) so that peers see this engine go away at once. A
            // helper thread does the blocking wait, which is not allowed on
            // a Tokio worker; the bound covers a drop from a control task.
            let stopper = std::thread::spawn(move || {
                rt.shutdown_timeout(std::time::Duration::from_secs(5));
            });
            let _ = stopper.join();
        }
        self.poller.stop();
    }

    pub(crate) fn segment_name(&self) -> &str {
        &self.name
    }

    pub(crate) fn capabilities(&self) -> Capabilities {
        Capabilities {
            batch_transfer: true,
            async_batch: true,
            batch_wait: true,
            notify: true,
            memory: MemoryKinds {
                host: true,
                cuda: false,
            },
            ..Default::default()
        }
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

    fn subscribers(&self) -> MutexGuard<'_, HashMap<u64, mpsc::UnboundedSender<Msg>>> {
        lock(&self.subs)
    }

    fn broadcast(&self, msg: &Msg) {
        for tx in self.subscribers().values() {
            let _ = tx.send(msg.clone());
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

    fn push_notification(&self, n: Notification) {
        lock(&self.notifications).push(n);
    }

    pub(crate) fn take_notifications(&self) -> Vec<Notification> {
        std::mem::take(&mut *lock(&self.notifications))
    }

    pub(crate) async fn register(&self, region: &MemoryRegion) -> Result<()> {
        if !region.location().is_host() {
            return Err(Error::InvalidArgument(format!(
                "the verbs backend registers host memory only; {} needs GPUDirect RDMA, which this build does not support",
                region.location()
            )));
        }
        if region.len() > usize::MAX as u64 {
            return Err(Error::InvalidArgument(format!(
                "region of {} bytes is too large",
                region.len()
            )));
        }
        self.local.insert(region.clone())?;
        // SAFETY: the caller promised (MemoryRegion::from_raw_parts) that the
        // range stays valid until `unregister` returns; the MR is dropped
        // (deregistered) in `unregister` before that.
        let mr = unsafe {
            self.dev.pd.reg_mr(
                region.addr() as usize,
                region.len() as usize,
                AccessFlags::LocalWrite | AccessFlags::RemoteWrite | AccessFlags::RemoteRead,
            )
        };
        let mr = match mr {
            Ok(mr) => mr,
            Err(e) => {
                let _ = self.local.remove(region.addr()).await;
                return Err(device::verbs_error("ibv_reg_mr", &device::io_of(&e)));
            }
        };
        let remote = RemoteRegion {
            addr: region.addr(),
            len: region.len(),
            rkey: mr.rkey(),
        };
        lock(&self.mrs).insert(region.addr(), mr);
        self.broadcast(&Msg::RegionAdded(remote));
        Ok(())
    }

    pub(crate) async fn unregister(&self, addr: u64) -> Result<()> {
        // Waits for local transfers using the region.
        self.local.remove(addr).await?;
        let mr = lock(&self.mrs).remove(&addr);
        self.broadcast(&Msg::RegionRemoved { addr });
        // Deregistering makes the device refuse every later access by peers.
        drop(mr);
        Ok(())
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
        let id = self.next_segment.fetch_add(1, Ordering::Relaxed);
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
        let batch = self.start_batch(segment, requests, notify).await?;
        batch.finished().await
    }

    pub(crate) async fn submit(
        &self,
        segment: SegmentId,
        requests: &[TransferRequest],
        notify: Option<&Notification>,
    ) -> Result<BatchId> {
        let batch = self.start_batch(segment, requests, notify).await?;
        let id = self.next_batch.fetch_add(1, Ordering::Relaxed);
        lock(&self.batches).insert(id, batch);
        Ok(BatchId(id))
    }

    pub(crate) fn live_batches(&self) -> usize {
        lock(&self.batches).len()
    }

    pub(crate) fn status(&self, id: BatchId) -> Result<BatchStatus> {
        let b = lock(&self.batches)
            .get(&id.0)
            .cloned()
            .ok_or(Error::UnknownBatch(id))?;
        Ok(b.status())
    }

    pub(crate) async fn wait(&self, id: BatchId) -> Result<BatchReport> {
        let b = lock(&self.batches)
            .get(&id.0)
            .cloned()
            .ok_or(Error::UnknownBatch(id))?;
        let r = b.finished().await;
        lock(&self.batches).remove(&id.0);
        r
    }

    pub(crate) fn release_batch(&self, id: BatchId) -> Result<()> {
        let mut map = lock(&self.batches);
        match map.get(&id.0) {
            None => Err(Error::UnknownBatch(id)),
            Some(b) if !b.status().is_finished() => Err(Error::BatchBusy(id)),
            Some(_) => {
                map.remove(&id.0);
                Ok(())
            }
        }
    }

    /// Validates every request, plans the work requests and starts posting
    /// them on the control runtime. `Err` only when the batch as a whole is
    /// refused (unknown or unreachable segment, bad notification).
    async fn start_batch(
        &self,
        segment: SegmentId,
        requests: &[TransferRequest],
        notify: Option<&Notification>,
    ) -> Result<Arc<Batch>> {
        if let Some(n) = notify {
            n.validate()?;
        }
        let conn = self.conn(segment).await?;
        let batch = Arc::new(Batch::new(requests.len()));
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
            if rkey.is_none() && !refreshed {
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
        let b = Arc::clone(&batch);
        self.handle.spawn(async move {
            for chain in wrs.chunks(MAX_CHAIN.min(conn_chain_limit(&conn))) {
                conn.post_chain(&b, chain).await;
            }
            let ok = b.all_terminal().await;
            let notify_error = match notify {
                Some(n) if ok => conn.notify(n).await.err(),
                _ => None,
            };
            b.finish(notify_error);
        });
        Ok(batch)
    }
}

fn conn_chain_limit(c: &Conn) -> usize {
    c.chain_limit()
}

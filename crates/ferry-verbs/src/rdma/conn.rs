//! The opener's side of one connection: an RC queue pair with its own
//! completion queue, the peer's region table, the send-queue accounting with
//! selective signalling, notifications SENT on the queue pair after the
//! data, and the control-channel client.
//!
//! Memory the device may still touch stays guarded: a request's region
//! guards are released only when a completion covers its work requests —
//! after the queue pair breaks, that is its flush completion — or when the
//! queue pair has been destroyed (`Drop`).

use std::collections::{BTreeMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ferry_core::{Error, Notification, Result, Side, TransferOp};
use rdma_mummy_sys as sys;
use sideway::ibverbs::completion::{BasicCompletionQueue, CompletionQueue};
use sideway::ibverbs::queue_pair::{BasicQueuePair, QueuePair};
use tokio::net::TcpStream;
use tokio::sync::{mpsc, oneshot, Semaphore};
use tokio::task::AbortHandle;

use super::device::{self, Device, Slots};
use super::poller::{Poller, Watched};
use super::progress::Progress;
use crate::handshake;
use crate::negotiate::{FeatureSet, Offer, PeerProtocol};
use crate::plan::WrPlan;
use crate::wire::{self, Msg, RemoteRegion};

/// Notifications one connection has in flight (SENT, not yet answered):
/// the owner posts this many receives for the connection.
pub(crate) const NOTIFY_RING: usize = 8;
/// Bytes of one notification slot (the largest SEND payload).
pub(crate) const NOTIFY_SLOT: usize = wire::NOTIFICATION_MAX_PAYLOAD;
/// Region-table requests queued for the control channel's writer.
const CTL_QUEUE: usize = 64;

/// What an outstanding work request carries.
enum Work {
    /// Bytes of the requests `reqs` of a batch.
    Data {
        progress: Arc<Progress>,
        reqs: Vec<u32>,
        op: TransferOp,
    },
    /// The notification in send slot `slot`.
    Notify { slot: usize, id: u64 },
}

/// How often a connection checks for a stalled device.
const STALL_CHECK: Duration = Duration::from_secs(1);

/// A work request on the send queue whose completion is not yet known.
struct Outstanding {
    seq: u64,
    work: Work,
    remote: u64,
    len: u64,
}

struct Sq {
    /// `None` once destroyed (only in `Drop`).
    qp: Option<BasicQueuePair>,
    next_seq: u64,
    since_signal: u32,
    outstanding: VecDeque<Outstanding>,
    broken: Option<Error>,
    /// When the queue last moved: a completion covered work requests, or
    /// work was posted onto an empty queue.
    last_progress: Instant,
}

impl Sq {
    fn qp_ptr(&self) -> *mut sys::ibv_qp {
        match &self.qp {
            // SAFETY: only the pointer is taken; the QP lives in `self`.
            Some(qp) => unsafe { qp.qp() }.as_ptr(),
            None => std::ptr::null_mut(),
        }
    }
}

type TableReply = oneshot::Sender<Result<Vec<RemoteRegion>>>;

/// A notification SENT and waiting for the owner's answer.
struct NoteWait {
    id: u64,
    tx: oneshot::Sender<Result<()>>,
}

/// One connection to a peer segment.
pub(crate) struct Conn {
    pub peer: String,
    /// The features agreed with the peer.
    pub features: FeatureSet,
    /// What was negotiated, for reports.
    pub protocol: PeerProtocol,
    dev: Arc<Device>,
    cq: Arc<BasicCompletionQueue>,
    sq: Mutex<Sq>,
    credits: Arc<Semaphore>,
    regions: Mutex<BTreeMap<u64, RemoteRegion>>,
    ctl: mpsc::Sender<TableReply>,
    tasks: Mutex<Vec<AbortHandle>>,
    corrupt_next_rkey: AtomicBool,
    /// Fault injection: completions are not applied (a stalled device).
    lose_completions: AtomicBool,
    poller: Arc<Poller>,
    qpn: u32,
    qp_key: usize,
    /// Registered buffer the notification SENDs read from.
    send_slots: Arc<Slots>,
    free_slots: Mutex<Vec<usize>>,
    slot_permits: Arc<Semaphore>,
    /// Notifications SENT, in order, waiting for the owner's answer.
    notes: Mutex<VecDeque<NoteWait>>,
    next_note: AtomicU64,
    /// This connection, for the thread that destroys a broken QP.
    me: std::sync::OnceLock<std::sync::Weak<Conn>>,
}

use ferry_core::__private::sync::lock;

fn unavailable(name: &str, reason: impl Into<String>) -> Error {
    Error::SegmentUnavailable {
        name: name.to_owned(),
        reason: reason.into(),
    }
}

impl Conn {
    /// Connects to the engine listening at `name`: control channel, queue
    /// pair exchange, INIT → RTR → RTS. Runs on the control runtime.
    pub(crate) async fn connect(
        dev: Arc<Device>,
        poller: Arc<Poller>,
        name: &str,
        local_name: &str,
    ) -> Result<Arc<Conn>> {
        let deadline = Duration::from_millis(dev.cfg.connect_timeout_ms);
        let mut stream = match tokio::time::timeout(deadline, TcpStream::connect(name)).await {
            Ok(Ok(s)) => s,
            Ok(Err(e)) => {
                return Err(unavailable(
                    name,
                    format!("connecting the control channel: {e}"),
                ))
            }
            Err(_) => {
                return Err(unavailable(
                    name,
                    format!("control channel connect timed out after {deadline:?}"),
                ))
            }
        };
        let _ = stream.set_nodelay(true);
        // Registering the notification buffer is a blocking verbs call.
        let send_slots = {
            let dev = Arc::clone(&dev);
            tokio::task::spawn_blocking(move || Slots::new(&dev, NOTIFY_RING, NOTIFY_SLOT))
                .await
                .map_err(|e| {
                    Error::Canceled(format!("registering the notification buffer: {e}"))
                })??
        };
        let cq = dev.create_cq(dev.sq_depth + 16, true)?;
        let mut qp = dev.create_qp(&cq, dev.sq_depth, 1, dev.max_sge)?;
        let psn = device::random_psn();
        let local = dev.endpoint(&qp, psn);
        let secret = dev.cfg.secret.as_ref().map(ferry_core::Secret::expose);
        let offer = Offer::local(dev.cfg.test_protocol_max, &dev.cfg.test_features_off);
        let exchange = handshake::open(&mut stream, name, secret, &offer, local, local_name);
        let opened = match tokio::time::timeout(deadline, exchange).await {
            Ok(r) => r?,
            Err(_) => {
                return Err(unavailable(
                    name,
                    format!("handshake timed out after {deadline:?}"),
                ))
            }
        };
        let (remote, regions) = (opened.endpoint, opened.regions);
        let protocol = PeerProtocol::new(name, true, &opened.agreement);
        tracing::debug!(peer = name, %protocol, "verbs control channel agreed");
        dev.connect_qp(
            &mut qp,
            psn,
            &remote,
            device::agree_mtu(local.mtu, remote.mtu),
        )?;
        let qpn = qp.qp_number();
        // SAFETY: only the address is used, as a map key.
        let qp_key = unsafe { qp.qp() }.as_ptr() as usize;
        let (ctl_tx, ctl_rx) = mpsc::channel(CTL_QUEUE);
        let conn = Arc::new(Conn {
            peer: name.to_owned(),
            features: opened.agreement.features,
            protocol,
            credits: Arc::new(Semaphore::new(dev.sq_depth as usize)),
            dev,
            cq,
            sq: Mutex::new(Sq {
                qp: Some(qp),
                next_seq: 1,
                since_signal: 0,
                outstanding: VecDeque::new(),
                broken: None,
                last_progress: Instant::now(),
            }),
            regions: Mutex::new(regions.into_iter().map(|r| (r.addr, r)).collect()),
            ctl: ctl_tx,
            tasks: Mutex::new(Vec::new()),
            corrupt_next_rkey: AtomicBool::new(false),
            lose_completions: AtomicBool::new(false),
            poller,
            qpn,
            qp_key,
            send_slots: Arc::new(send_slots),
            free_slots: Mutex::new((0..NOTIFY_RING).collect()),
            slot_permits: Arc::new(Semaphore::new(NOTIFY_RING)),
            notes: Mutex::new(VecDeque::new()),
            next_note: AtomicU64::new(1),
            me: std::sync::OnceLock::new(),
        });
        let _ = conn.me.set(Arc::downgrade(&conn));
        let weak: std::sync::Weak<dyn Watched> = Arc::downgrade(&conn) as _;
        conn.poller
            .watch(&conn.cq, [conn.cq_key(), conn.qp_key], weak)?;
        let (rd, wr) = stream.into_split();
        let pending = Arc::new(Mutex::new(VecDeque::new()));
        let w = tokio::spawn(ctl_writer(
            wr,
            ctl_rx,
            Arc::clone(&pending),
            Arc::downgrade(&conn),
        ));
        let r = tokio::spawn(ctl_reader(rd, pending, Arc::downgrade(&conn)));
        let s = tokio::spawn(stall_watch(Arc::downgrade(&conn)));
        lock(&conn.tasks).extend([w.abort_handle(), r.abort_handle(), s.abort_handle()]);
        Ok(conn)
    }

    /// Most work requests one chain may hold (half the send queue).
    pub(crate) fn chain_limit(&self) -> usize {
        (self.dev.sq_depth as usize / 2).max(1)
    }

    pub(crate) fn qp_number(&self) -> u32 {
        self.qpn
    }

    pub(crate) fn is_broken(&self) -> bool {
        lock(&self.sq).broken.is_some()
    }

    /// The peer region containing `[addr, addr+len)`, with its rkey.
    pub(crate) fn lookup(&self, addr: u64, len: u64) -> Option<u32> {
        let map = lock(&self.regions);
        map.range(..=addr).next_back().and_then(|(_, r)| {
            let end = addr.checked_add(len)?;
            (addr >= r.addr && end <= r.addr.saturating_add(r.len)).then_some(r.rkey)
        })
    }

    /// Fetches the peer's current region table over the control channel
    /// (waiting for room in its bounded request queue).
    pub(crate) async fn refresh_regions(&self) -> Result<()> {
        let (tx, rx) = oneshot::channel();
        self.ctl
            .send(tx)
            .await
            .map_err(|_| self.lost("the control channel is closed"))?;
        let regions = rx
            .await
            .map_err(|_| self.lost("the control channel closed"))??;
        *lock(&self.regions) = regions.into_iter().map(|r| (r.addr, r)).collect();
        Ok(())
    }

    /// SENDs a notification on the queue pair — after every work request
    /// posted before it, so the owner receives it only after their data —
    /// and waits for the owner's answer: queued, or refused (its queue is
    /// full: [`Error::QueueFull`]; it refuses notifications:
    /// [`Error::SegmentUnavailable`]).
    pub(crate) async fn notify(&self, n: &Notification) -> Result<()> {
        let payload = wire::encode_notification(n);
        let permit = Arc::clone(&self.slot_permits)
            .acquire_owned()
            .await
            .map_err(|_| self.lost("the connection is closed"))?;
        permit.forget();
        let Some(slot) = lock(&self.free_slots).pop() else {
            // Cannot happen: a permit is a free slot.
            self.slot_permits.add_permits(1);
            return Err(self.lost("no free notification slot"));
        };
        let credit = match Arc::clone(&self.credits).acquire_owned().await {
            Ok(c) => c,
            Err(_) => {
                self.release_slot(slot);
                return Err(self.broken_error());
            }
        };
        credit.forget();
        let (tx, rx) = oneshot::channel();
        {
            let mut sq = lock(&self.sq);
            if sq.broken.is_some() {
                self.credits.add_permits(1);
                self.release_slot(slot);
                return Err(self.broken_error_locked(&sq));
            }
            // SAFETY: the slot was free: no work request uses it.
            unsafe { self.send_slots.write(slot, &payload) };
            let id = self.next_note.fetch_add(1, Ordering::Relaxed);
            let seq = sq.next_seq;
            sq.next_seq += 1;
            sq.since_signal = 0;
            let mut sge = sys::ibv_sge {
                addr: self.send_slots.addr(slot),
                length: payload.len() as u32,
                lkey: self.send_slots.lkey(),
            };
            // SAFETY: plain C data; all-zero is a valid empty value.
            let mut wr: sys::ibv_send_wr = unsafe { std::mem::zeroed() };
            wr.wr_id = seq;
            wr.sg_list = &mut sge;
            wr.num_sge = 1;
            wr.opcode = sys::ibv_wr_opcode::IBV_WR_SEND;
            // Fenced: it waits for the RDMA READs before it too.
            wr.send_flags =
                sys::ibv_send_flags::IBV_SEND_SIGNALED.0 | sys::ibv_send_flags::IBV_SEND_FENCE.0;
            lock(&self.notes).push_back(NoteWait { id, tx });
            if sq.outstanding.is_empty() {
                sq.last_progress = Instant::now();
            }
            sq.outstanding.push_back(Outstanding {
                seq,
                work: Work::Notify { slot, id },
                remote: 0,
                len: payload.len() as u64,
            });
            let mut bad: *mut sys::ibv_send_wr = std::ptr::null_mut();
            // SAFETY: the QP is alive (locked in `sq`); the WR and its SGE
            // live until the call returns; the SGE lies in the registered
            // notification buffer, whose slot stays reserved until the
            // completion.
            let rc = unsafe { sys::ibv_post_send(sq.qp_ptr(), &mut wr, &mut bad) };
            if rc != 0 {
                let err =
                    device::verbs_error("ibv_post_send", &std::io::Error::from_raw_os_error(rc));
                if let Some(o) = sq.outstanding.pop_back() {
                    self.retire(o, &Err(err.clone()));
                }
                self.credits.add_permits(1);
                self.break_locked(&mut sq, err);
            }
        }
        rx.await.map_err(|_| {
            self.lost("the connection closed before the peer answered the notification")
        })?
    }

    /// The owner's answer to the oldest notification waiting for one.
    fn answer(&self, result: Result<()>) -> bool {
        match lock(&self.notes).pop_front() {
            Some(w) => {
                let _ = w.tx.send(result);
                true
            }
            None => false,
        }
    }

    fn fail_notes(&self, err: &Error) {
        for w in lock(&self.notes).drain(..) {
            let _ = w.tx.send(Err(err.clone()));
        }
    }

    fn release_slot(&self, slot: usize) {
        lock(&self.free_slots).push(slot);
        self.slot_permits.add_permits(1);
    }

    /// Applies the outcome of one work request the device is done with.
    fn retire(&self, o: Outstanding, result: &Result<()>) {
        match o.work {
            Work::Data { progress, reqs, .. } => progress.wr_done(&reqs, result),
            Work::Notify { slot, id } => {
                if let Err(e) = result {
                    // The owner did not get it: it will not answer.
                    let mut notes = lock(&self.notes);
                    if let Some(k) = notes.iter().position(|w| w.id == id) {
                        if let Some(w) = notes.remove(k) {
                            let _ = w.tx.send(Err(e.clone()));
                        }
                    }
                }
                self.release_slot(slot);
            }
        }
    }

    fn broken_error(&self) -> Error {
        let sq = lock(&self.sq);
        self.broken_error_locked(&sq)
    }

    fn broken_error_locked(&self, sq: &Sq) -> Error {
        sq.broken
            .clone()
            .unwrap_or_else(|| self.lost("the connection is closed"))
    }

    fn lost(&self, reason: &str) -> Error {
        Error::PeerLost {
            peer: self.peer.clone(),
            reason: reason.to_owned(),
        }
    }

    /// Fault injection: from now on the device's completions are dropped
    /// unread, as if it had stalled.
    pub(crate) fn lose_completions(&self) {
        self.lose_completions.store(true, Ordering::SeqCst);
    }

    pub(crate) fn corrupt_next_rkey(&self) {
        self.corrupt_next_rkey.store(true, Ordering::SeqCst);
    }

    /// Moves the queue pair to the Error state without telling the engine
    /// (the completion path discovers it).
    pub(crate) fn force_qp_error(&self) -> Result<()> {
        let mut sq = lock(&self.sq);
        match sq.qp.as_mut() {
            Some(qp) => device::qp_to_error(qp),
            None => Ok(()),
        }
    }

    /// Marks the connection broken: the queue pair goes to Error and later
    /// posts fail at once. Outstanding work requests stay outstanding —
    /// with their region guards — until their flush completions arrive (or
    /// the queue pair is destroyed): until then the device may still write
    /// their memory (an RDMA READ in flight).
    pub(crate) fn break_with(&self, err: Error) {
        let mut sq = lock(&self.sq);
        self.break_locked(&mut sq, err);
    }

    fn break_locked(&self, sq: &mut Sq, err: Error) {
        if sq.broken.is_none() {
            tracing::debug!(peer = %self.peer, qpn = self.qpn, error = %err, "verbs connection broken");
            sq.broken = Some(err);
            // After this the device executes none of the QP's work requests
            // and flushes them all, each with a completion.
            if let Some(qp) = sq.qp.as_mut() {
                if let Err(e) = device::qp_to_error(qp) {
                    tracing::warn!(peer = %self.peer, error = %e, "moving the QP to the error state failed");
                }
            }
            self.credits.close();
            self.slot_permits.close();
            // Then destroy it, on a helper thread (ibv_destroy_qp waits for
            // the acknowledgement of the QP's asynchronous events, which the
            // completion thread — possibly this one — gives). Once it is
            // destroyed the device touches none of the outstanding work
            // requests' memory: they fail as flushed, whether or not the
            // device produced their flush completions.
            if let Some(me) = self.me.get().and_then(std::sync::Weak::upgrade) {
                if let Some(qp) = sq.qp.take() {
                    let spawned = std::thread::Builder::new()
                        .name("ferry-verbs-qp-down".into())
                        .spawn(move || {
                            drop(qp);
                            me.retire_all_flushed();
                        });
                    if let Err(e) = spawned {
                        // The QP was destroyed with the thread's closure:
                        // retire here.
                        tracing::warn!(error = %e, "no thread to destroy a broken queue pair on");
                        let flushed = self.flushed(&self.broken_error_locked(sq));
                        let n = sq.outstanding.len();
                        for o in sq.outstanding.drain(..) {
                            self.retire(o, &Err(flushed.clone()));
                        }
                        self.credits.add_permits(n);
                    }
                }
            }
        }
    }

    /// Fails every outstanding work request as flushed (its QP is
    /// destroyed).
    fn retire_all_flushed(&self) {
        let mut sq = lock(&self.sq);
        let err = self.flushed(&self.broken_error_locked(&sq));
        let n = sq.outstanding.len();
        let drained: Vec<Outstanding> = sq.outstanding.drain(..).collect();
        for o in drained {
            self.retire(o, &Err(err.clone()));
        }
        self.credits.add_permits(n);
    }

    fn flushed(&self, err: &Error) -> Error {
        Error::PeerLost {
            peer: self.peer.clone(),
            reason: format!("request flushed: the queue pair entered the error state ({err})"),
        }
    }

    /// Posts `wrs` as one chain of work requests for `batch`, waiting for
    /// send-queue room first. Failures are recorded in the batch.
    pub(crate) async fn post_chain(&self, batch: &Arc<Progress>, wrs: &[WrPlan]) {
        let n = wrs.len();
        if n == 0 {
            return;
        }
        if self.credits.available_permits() < n {
            tracing::debug!(peer = %self.peer, wrs = n, free = self.credits.available_permits(), "waiting for send-queue credits");
        }
        let permit = match Arc::clone(&self.credits).acquire_many_owned(n as u32).await {
            Ok(p) => p,
            Err(_) => {
                let err = lock(&self.sq)
                    .broken
                    .clone()
                    .unwrap_or_else(|| self.lost("the connection is closed"));
                for w in wrs {
                    batch.wr_done(&w.reqs, &Err(err.clone()));
                }
                return;
            }
        };
        // Credits come back one by one as completions cover the WRs.
        permit.forget();
        let mut sq = lock(&self.sq);
        if let Some(err) = sq.broken.clone() {
            self.credits.add_permits(n);
            for w in wrs {
                batch.wr_done(&w.reqs, &Err(err.clone()));
            }
            return;
        }
        if sq.outstanding.is_empty() {
            sq.last_progress = Instant::now();
        }
        let corrupt = self.corrupt_next_rkey.swap(false, Ordering::SeqCst);
        let mut sges: Vec<Vec<sys::ibv_sge>> = Vec::with_capacity(n);
        let mut raw: Vec<sys::ibv_send_wr> = Vec::with_capacity(n);
        for (k, w) in wrs.iter().enumerate() {
            let seq = sq.next_seq;
            sq.next_seq += 1;
            let signaled = k + 1 == n || sq.since_signal + 1 >= self.dev.signal_every;
            sq.since_signal = if signaled { 0 } else { sq.since_signal + 1 };
            sq.outstanding.push_back(Outstanding {
                seq,
                work: Work::Data {
                    progress: Arc::clone(batch),
                    reqs: w.reqs.clone(),
                    op: w.op,
                },
                remote: w.remote,
                len: w.len,
            });
            sges.push(
                w.sges
                    .iter()
                    .map(|s| sys::ibv_sge {
                        addr: s.addr,
                        length: s.len,
                        lkey: s.lkey,
                    })
                    .collect(),
            );
            // SAFETY: ibv_send_wr is plain C data for which all-zero is a
            // valid (empty) value; the fields used are set below.
            let mut wr: sys::ibv_send_wr = unsafe { std::mem::zeroed() };
            wr.wr_id = seq;
            wr.num_sge = w.sges.len() as i32;
            wr.opcode = match w.op {
                TransferOp::Write => sys::ibv_wr_opcode::IBV_WR_RDMA_WRITE,
                TransferOp::Read => sys::ibv_wr_opcode::IBV_WR_RDMA_READ,
            };
            wr.send_flags = if signaled {
                sys::ibv_send_flags::IBV_SEND_SIGNALED.0
            } else {
                0
            };
            let rkey = if corrupt && k == 0 {
                w.rkey ^ 0x5a5a_5a5a
            } else {
                w.rkey
            };
            wr.wr.rdma = sys::rdma_t {
                remote_addr: w.remote,
                rkey,
            };
            raw.push(wr);
        }
        for k in 0..n {
            raw[k].sg_list = sges[k].as_mut_ptr();
            raw[k].next = if k + 1 < n {
                &mut raw[k + 1] as *mut _
            } else {
                std::ptr::null_mut()
            };
        }
        let mut bad: *mut sys::ibv_send_wr = std::ptr::null_mut();
        // SAFETY: the QP is alive (owned by `sq`, locked); the WR chain and
        // its SGE arrays live until the call returns (the device copies
        // them); every SGE lies in memory registered with this PD and held
        // registered by the requests' region guards until their completions.
        let rc = unsafe { sys::ibv_post_send(sq.qp_ptr(), raw.as_mut_ptr(), &mut bad) };
        if rc != 0 {
            let posted = if bad.is_null() {
                0
            } else {
                // SAFETY: on failure `bad` points into `raw`.
                (unsafe { bad.offset_from(raw.as_ptr()) }).clamp(0, n as isize) as usize
            };
            let err = device::verbs_error("ibv_post_send", &std::io::Error::from_raw_os_error(rc));
            // The unposted tail never reaches the device.
            for _ in posted..n {
                if let Some(o) = sq.outstanding.pop_back() {
                    self.retire(o, &Err(err.clone()));
                }
            }
            self.credits.add_permits(n - posted);
            self.break_locked(&mut sq, err);
        }
    }

    /// Applies one work completion (from the completion thread).
    fn on_completion(&self, wr_id: u64, status: u32, vendor_err: u32) {
        if self.lose_completions.load(Ordering::Relaxed) {
            return;
        }
        let mut sq = lock(&self.sq);
        let mut covered = 0;
        if status == sys::ibv_wc_status::IBV_WC_SUCCESS {
            // In-order completion on an RC send queue: one completion
            // retires every work request up to it.
            while sq.outstanding.front().is_some_and(|o| o.seq <= wr_id) {
                if let Some(o) = sq.outstanding.pop_front() {
                    self.retire(o, &Ok(()));
                    covered += 1;
                }
            }
            if covered > 0 {
                sq.last_progress = Instant::now();
            }
            self.credits.add_permits(covered);
            return;
        }
        // Before the connection broke, everything before the first failed
        // WR completed; after, every WR completes on its own (errors always
        // produce a completion), and unsignalled ones before a flushed one
        // are not known to have completed.
        let earlier = sq.broken.as_ref().map(|e| self.flushed(e));
        while sq.outstanding.front().is_some_and(|o| o.seq < wr_id) {
            if let Some(o) = sq.outstanding.pop_front() {
                let r = earlier.clone().map_or(Ok(()), Err);
                self.retire(o, &r);
                covered += 1;
            }
        }
        let mut err = None;
        if sq.outstanding.front().is_some_and(|o| o.seq == wr_id) {
            if let Some(o) = sq.outstanding.pop_front() {
                let e = self.wc_error(status, vendor_err, &o);
                self.retire(o, &Err(e.clone()));
                covered += 1;
                err = Some(e);
            }
        }
        self.credits.add_permits(covered);
        let err = err.unwrap_or_else(|| Error::PeerLost {
            peer: self.peer.clone(),
            reason: format!(
                "{} (vendor error {vendor_err:#x})",
                device::wc_status_name(status)
            ),
        });
        self.break_locked(&mut sq, err);
    }

    fn wc_error(&self, status: u32, vendor_err: u32, o: &Outstanding) -> Error {
        use sys::ibv_wc_status as st;
        let name = device::wc_status_name(status);
        let what = match &o.work {
            Work::Data { op, .. } => format!("RDMA {op}"),
            Work::Notify { .. } => "notification SEND".to_owned(),
        };
        match status {
            st::IBV_WC_REM_ACCESS_ERR | st::IBV_WC_REM_INV_REQ_ERR
                if matches!(o.work, Work::Data { .. }) =>
            {
                Error::AddressNotRegistered {
                    side: Side::Remote,
                    addr: o.remote,
                    len: o.len,
                    peer: Some(self.peer.clone()),
                }
            }
            st::IBV_WC_RETRY_EXC_ERR
            | st::IBV_WC_RNR_RETRY_EXC_ERR
            | st::IBV_WC_RESP_TIMEOUT_ERR
            | st::IBV_WC_WR_FLUSH_ERR => Error::PeerLost {
                peer: self.peer.clone(),
                reason: format!(
                    "{name}: the peer did not answer the {what} (vendor error {vendor_err:#x})"
                ),
            },
            _ => Error::Backend {
                backend: crate::BACKEND.to_owned(),
                operation: format!("{what} of {} bytes to {:#x}", o.len, o.remote),
                code: i64::from(status),
                name: name.to_owned(),
            },
        }
    }

    /// Re-arms the CQ and drains it (from the completion thread).
    pub(crate) fn drain_cq(&self) {
        // SAFETY: the CQ lives as long as `self`.
        let cq = unsafe { self.cq.cq() }.as_ptr();
        // SAFETY: valid CQ; re-arm before draining so no completion is missed.
        unsafe { sys::ibv_req_notify_cq(cq, 0) };
        let mut wcs: [std::mem::MaybeUninit<sys::ibv_wc>; 32] =
            [const { std::mem::MaybeUninit::uninit() }; 32];
        loop {
            // SAFETY: valid CQ; `wcs` has room for 32 entries.
            let n = unsafe { sys::ibv_poll_cq(cq, 32, wcs.as_mut_ptr().cast()) };
            if n <= 0 {
                if n < 0 {
                    self.break_with(self.lost("ibv_poll_cq failed: completion queue error"));
                }
                return;
            }
            for wc in &wcs[..n as usize] {
                // SAFETY: the first `n` entries were written by ibv_poll_cq.
                let wc = unsafe { wc.assume_init_ref() };
                self.on_completion(wc.wr_id, wc.status, wc.vendor_err);
            }
        }
    }

    /// Arms the CQ for its first event.
    pub(crate) fn arm_cq(cq: &BasicCompletionQueue) -> Result<()> {
        // SAFETY: valid CQ created with a completion channel.
        let rc = unsafe { sys::ibv_req_notify_cq(cq.cq().as_ptr(), 0) };
        if rc != 0 {
            return Err(device::verbs_error(
                "ibv_req_notify_cq",
                &std::io::Error::from_raw_os_error(rc),
            ));
        }
        Ok(())
    }

    pub(crate) fn cq_key(&self) -> usize {
        // SAFETY: only the address is used, as a map key.
        unsafe { self.cq.cq() }.as_ptr() as usize
    }

    fn apply_push(&self, msg: Msg) {
        let mut map = lock(&self.regions);
        match msg {
            Msg::RegionAdded(r) => {
                map.insert(r.addr, r);
            }
            Msg::RegionRemoved { addr } => {
                map.remove(&addr);
            }
            _ => {}
        }
    }
}

impl Watched for Conn {
    fn drain_cq(&self) {
        Conn::drain_cq(self);
    }

    fn fail(&self, event: &str) {
        self.break_with(Error::PeerLost {
            peer: self.peer.clone(),
            reason: format!(
                "{event}: the device reported the queue pair or its completion queue in error"
            ),
        });
    }

    fn peer(&self) -> &str {
        &self.peer
    }

    fn cancel(&self, err: &Error) {
        self.break_with(err.clone());
    }
}

impl Drop for Conn {
    fn drop(&mut self) {
        self.poller.unwatch(&[self.cq_key(), self.qp_key]);
        for t in lock(&self.tasks).drain(..) {
            t.abort();
        }
        let err = self.lost("the connection was closed");
        let (qp, outstanding) = {
            let sq = ferry_core::__private::sync::get_mut(&mut self.sq);
            (sq.qp.take(), sq.outstanding.drain(..).collect::<Vec<_>>())
        };
        self.fail_notes(&err);
        let cq = Arc::clone(&self.cq);
        let slots = Arc::clone(&self.send_slots);
        let teardown = move || {
            // The queue pair first: once ibv_destroy_qp returns the device
            // touches none of the memory of its work requests, and only then
            // may their guards go, their requests fail, and the notification
            // buffer and the completion queue go.
            drop(qp);
            for o in outstanding {
                if let Work::Data { progress, reqs, .. } = o.work {
                    progress.wr_done(&reqs, &Err(err.clone()));
                }
            }
            drop(slots);
            drop(cq);
        };
        // Destroying a queue pair or completion queue waits until the
        // completion thread has acknowledged their events: on that thread
        // (which drops a connection whose last other holder went while it
        // drained it) it would wait for itself, and every connection's
        // completions would stop. Tear down on a thread of its own there.
        if self.poller.is_current() {
            if let Err(e) = std::thread::Builder::new()
                .name("ferry-verbs-conn-down".into())
                .spawn(teardown)
            {
                tracing::warn!(error = %e, "verbs: no thread to tear a connection down on");
            }
        } else {
            teardown();
        }
    }
}

impl Conn {
    /// How long the queue may go without a completion while work requests
    /// are outstanding: `stall_timeout_ms`, and at least twice the
    /// transport retry window (ACK timeout × (retries + 1)). Past it the
    /// device has neither completed nor failed the work (a soft-RoCE queue
    /// pair was seen to stall so), and the connection is broken: its queue
    /// pair is destroyed and its work requests fail as flushed, so that
    /// their memory is released instead of held forever.
    fn stall_after(&self) -> Duration {
        let c = &self.dev.cfg;
        let ack = Duration::from_nanos(4096u64 << u32::from(c.timeout.min(31)));
        (ack * 2 * (u32::from(c.retry_cnt) + 1)).max(Duration::from_millis(c.stall_timeout_ms))
    }

    /// `Some((outstanding, idle))` if the queue has stalled.
    fn stalled(&self) -> Option<(usize, Duration)> {
        let sq = lock(&self.sq);
        let idle = sq.last_progress.elapsed();
        (sq.broken.is_none() && !sq.outstanding.is_empty() && idle > self.stall_after())
            .then(|| (sq.outstanding.len(), idle))
    }
}

/// Breaks `conn` if its device stalls (see [`Conn::stall_after`]); ends
/// with the connection.
async fn stall_watch(conn: std::sync::Weak<Conn>) {
    loop {
        tokio::time::sleep(STALL_CHECK).await;
        let Some(c) = conn.upgrade() else { return };
        if let Some((n, idle)) = c.stalled() {
            tracing::warn!(peer = %c.peer, outstanding = n, ?idle, "no work completion: the device stalled; breaking the connection");
            c.break_with(c.lost(&format!(
                "no work completion for {idle:?} with {n} work requests outstanding (the device stalled)"
            )));
        }
    }
}

async fn ctl_writer(
    mut wr: tokio::net::tcp::OwnedWriteHalf,
    mut rx: mpsc::Receiver<TableReply>,
    pending: Arc<Mutex<VecDeque<TableReply>>>,
    conn: std::sync::Weak<Conn>,
) {
    while let Some(tx) = rx.recv().await {
        lock(&pending).push_back(tx);
        if let Err(e) = wire::write_msg(&mut wr, &Msg::TableRequest).await {
            let err = Error::PeerLost {
                peer: conn.upgrade().map(|c| c.peer.clone()).unwrap_or_default(),
                reason: format!("control channel write failed: {e}"),
            };
            for p in lock(&pending).drain(..) {
                let _ = p.send(Err(err.clone()));
            }
            if let Some(c) = conn.upgrade() {
                c.fail_notes(&err);
                c.break_with(err);
            }
            return;
        }
    }
}

async fn ctl_reader(
    mut rd: tokio::net::tcp::OwnedReadHalf,
    pending: Arc<Mutex<VecDeque<TableReply>>>,
    conn: std::sync::Weak<Conn>,
) {
    let peer = conn.upgrade().map(|c| c.peer.clone()).unwrap_or_default();
    let reason = loop {
        match wire::read_msg(&mut rd, &peer).await {
            Ok(Some(Msg::Table { regions })) => match lock(&pending).pop_front() {
                Some(tx) => {
                    let _ = tx.send(Ok(regions));
                }
                None => break "unexpected Table frame".to_owned(),
            },
            Ok(Some(Msg::NotifyAck)) => match conn.upgrade() {
                Some(c) if c.answer(Ok(())) => {}
                Some(_) => break "unexpected NotifyAck frame".to_owned(),
                None => return,
            },
            Ok(Some(Msg::Notify { full, reason })) => {
                let err = if full {
                    Error::QueueFull {
                        backend: crate::BACKEND.to_owned(),
                        queue: ferry_core::Queue::Notifications,
                        what: format!("{peer}'s notification queue ({reason})"),
                        limit: None,
                    }
                } else {
                    Error::SegmentUnavailable {
                        name: peer.clone(),
                        reason: format!("the notification was refused: {reason}"),
                    }
                };
                match conn.upgrade() {
                    Some(c) if c.answer(Err(err)) => {}
                    Some(_) => break "unexpected Notify frame".to_owned(),
                    None => return,
                }
            }
            Ok(Some(m @ (Msg::RegionAdded(_) | Msg::RegionRemoved { .. }))) => {
                match conn.upgrade() {
                    Some(c) => c.apply_push(m),
                    None => return,
                }
            }
            Ok(Some(other)) => break format!("unexpected frame {other:?}"),
            Ok(None) => break "the peer closed the control channel".to_owned(),
            Err(e) => break e.to_string(),
        }
    };
    let err = Error::PeerLost { peer, reason };
    for p in lock(&pending).drain(..) {
        let _ = p.send(Err(err.clone()));
    }
    if let Some(c) = conn.upgrade() {
        c.fail_notes(&err);
        c.break_with(err);
    }
}

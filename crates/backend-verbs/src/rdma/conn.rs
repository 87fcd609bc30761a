//! The opener's side of one connection: an RC queue pair with its own
//! completion queue, the peer's region table, the send-queue accounting with
//! selective signalling, and the control-channel client.

use std::collections::{BTreeMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rdma_mummy_sys as sys;
use sideway::ibverbs::completion::{BasicCompletionQueue, CompletionQueue};
use sideway::ibverbs::queue_pair::{BasicQueuePair, QueuePair};
use tokio::net::TcpStream;
use tokio::sync::{mpsc, oneshot, Semaphore};
use tokio::task::AbortHandle;
use transport_core::{Error, Notification, Result, Side, TransferOp};

use super::batch::Batch;
use super::device::{self, Device};
use super::poller::Poller;
use crate::auth;
use crate::plan::WrPlan;
use crate::wire::{self, Msg, QpEndpoint, RemoteRegion};

/// A work request on the send queue whose completion is not yet known.
struct Outstanding {
    seq: u64,
    batch: Arc<Batch>,
    reqs: Vec<u32>,
    op: TransferOp,
    remote: u64,
    len: u64,
}

struct Sq {
    qp: BasicQueuePair,
    next_seq: u64,
    since_signal: u32,
    outstanding: VecDeque<Outstanding>,
    broken: Option<Error>,
}

enum CtlRequest {
    Table(oneshot::Sender<Result<Vec<RemoteRegion>>>),
    Notify(Notification, oneshot::Sender<Result<()>>),
}

enum Pending {
    Table(oneshot::Sender<Result<Vec<RemoteRegion>>>),
    Notify(oneshot::Sender<Result<()>>),
}

impl Pending {
    fn fail(self, e: Error) {
        match self {
            Pending::Table(tx) => {
                let _ = tx.send(Err(e));
            }
            Pending::Notify(tx) => {
                let _ = tx.send(Err(e));
            }
        }
    }
}

/// One connection to a peer segment.
pub(crate) struct Conn {
    pub peer: String,
    dev: Arc<Device>,
    cq: Arc<BasicCompletionQueue>,
    sq: Mutex<Sq>,
    credits: Arc<Semaphore>,
    regions: Mutex<BTreeMap<u64, RemoteRegion>>,
    ctl: mpsc::UnboundedSender<CtlRequest>,
    tasks: Mutex<Vec<AbortHandle>>,
    corrupt_next_rkey: AtomicBool,
    poller: Arc<Poller>,
    qpn: u32,
    qp_key: usize,
}

use transport_core::raw::lock;

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
        let cq = dev.create_cq(dev.sq_depth + 16, true)?;
        let mut qp = dev.create_qp(&cq, dev.sq_depth, dev.max_sge)?;
        let psn = device::random_psn();
        let local = dev.endpoint(&qp, psn);
        let hello = Msg::Hello {
            version: wire::VERSION,
            endpoint: local,
            name: local_name.to_owned(),
        };
        let secret = dev.cfg.secret.as_deref();
        let exchange = async {
            // Nothing (not even this side's queue pair) is sent before the
            // peer is authenticated.
            auth::initiator(&mut stream, name, secret).await?;
            wire::write_msg(&mut stream, &hello)
                .await
                .map_err(|e| unavailable(name, format!("sending hello: {e}")))?;
            match wire::read_msg(&mut stream, name).await? {
                Some(Msg::Welcome { endpoint, regions }) => Ok((endpoint, regions)),
                Some(Msg::Refused { reason }) => {
                    Err(unavailable(name, format!("refused: {reason}")))
                }
                Some(other) => Err(Error::Protocol {
                    peer: name.to_owned(),
                    reason: format!("expected Welcome, got {other:?}"),
                }),
                None => Err(unavailable(
                    name,
                    "the peer closed the control channel during the handshake",
                )),
            }
        };
        let (remote, regions): (QpEndpoint, Vec<RemoteRegion>) =
            match tokio::time::timeout(deadline, exchange).await {
                Ok(r) => r?,
                Err(_) => {
                    return Err(unavailable(
                        name,
                        format!("handshake timed out after {deadline:?}"),
                    ))
                }
            };
        dev.connect_qp(
            &mut qp,
            psn,
            &remote,
            device::agree_mtu(local.mtu, remote.mtu),
        )?;
        let qpn = qp.qp_number();
        // SAFETY: only the address is used, as a map key.
        let qp_key = unsafe { qp.qp() }.as_ptr() as usize;
        let (ctl_tx, ctl_rx) = mpsc::unbounded_channel();
        let conn = Arc::new(Conn {
            peer: name.to_owned(),
            credits: Arc::new(Semaphore::new(dev.sq_depth as usize)),
            dev,
            cq,
            sq: Mutex::new(Sq {
                qp,
                next_seq: 1,
                since_signal: 0,
                outstanding: VecDeque::new(),
                broken: None,
            }),
            regions: Mutex::new(regions.into_iter().map(|r| (r.addr, r)).collect()),
            ctl: ctl_tx,
            tasks: Mutex::new(Vec::new()),
            corrupt_next_rkey: AtomicBool::new(false),
            poller,
            qpn,
            qp_key,
        });
        conn.poller.watch(&conn.cq, &conn)?;
        let (rd, wr) = stream.into_split();
        let pending = Arc::new(Mutex::new(VecDeque::new()));
        let w = tokio::spawn(ctl_writer(
            wr,
            ctl_rx,
            Arc::clone(&pending),
            Arc::downgrade(&conn),
        ));
        let r = tokio::spawn(ctl_reader(rd, pending, Arc::downgrade(&conn)));
        lock(&conn.tasks).extend([w.abort_handle(), r.abort_handle()]);
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

    /// Fetches the peer's current region table over the control channel.
    pub(crate) async fn refresh_regions(&self) -> Result<()> {
        let (tx, rx) = oneshot::channel();
        self.ctl
            .send(CtlRequest::Table(tx))
            .map_err(|_| self.lost("the control channel is closed"))?;
        let regions = rx
            .await
            .map_err(|_| self.lost("the control channel closed"))??;
        *lock(&self.regions) = regions.into_iter().map(|r| (r.addr, r)).collect();
        Ok(())
    }

    /// Delivers a notification and waits for the peer's acknowledgement.
    pub(crate) async fn notify(&self, n: Notification) -> Result<()> {
        let (tx, rx) = oneshot::channel();
        self.ctl
            .send(CtlRequest::Notify(n, tx))
            .map_err(|_| self.lost("the control channel is closed"))?;
        rx.await
            .map_err(|_| self.lost("the control channel closed"))?
    }

    fn lost(&self, reason: &str) -> Error {
        Error::PeerLost {
            peer: self.peer.clone(),
            reason: reason.to_owned(),
        }
    }

    pub(crate) fn corrupt_next_rkey(&self) {
        self.corrupt_next_rkey.store(true, Ordering::SeqCst);
    }

    /// Moves the queue pair to the Error state without telling the engine
    /// (the completion path discovers it).
    pub(crate) fn force_qp_error(&self) -> Result<()> {
        let mut sq = lock(&self.sq);
        device::qp_to_error(&mut sq.qp)
    }

    /// Marks the connection broken: the queue pair goes to Error, every
    /// outstanding work request fails with `err`, later posts fail at once.
    pub(crate) fn break_with(&self, err: Error) {
        let mut sq = lock(&self.sq);
        self.break_locked(&mut sq, err);
    }

    fn break_locked(&self, sq: &mut Sq, err: Error) {
        if sq.broken.is_none() {
            tracing::debug!(peer = %self.peer, qpn = self.qpn, error = %err, "verbs connection broken");
            sq.broken = Some(err.clone());
            // After this the device executes none of the QP's work requests.
            if let Err(e) = device::qp_to_error(&mut sq.qp) {
                tracing::warn!(peer = %self.peer, error = %e, "moving the QP to the error state failed");
            }
            self.credits.close();
        }
        let flushed = Error::PeerLost {
            peer: self.peer.clone(),
            reason: format!("request flushed: the queue pair entered the error state ({err})"),
        };
        let n = sq.outstanding.len();
        for o in sq.outstanding.drain(..) {
            o.batch.wr_done(&o.reqs, &Err(flushed.clone()));
        }
        self.credits.add_permits(n);
    }

    /// Posts `wrs` as one chain of work requests for `batch`, waiting for
    /// send-queue room first. Failures are recorded in the batch.
    pub(crate) async fn post_chain(&self, batch: &Arc<Batch>, wrs: &[WrPlan]) {
        let n = wrs.len();
        if n == 0 {
            return;
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
                batch: Arc::clone(batch),
                reqs: w.reqs.clone(),
                op: w.op,
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
        let rc = unsafe { sys::ibv_post_send(sq.qp.qp().as_ptr(), raw.as_mut_ptr(), &mut bad) };
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
                    o.batch.wr_done(&o.reqs, &Err(err.clone()));
                }
            }
            self.credits.add_permits(n - posted);
            self.break_locked(&mut sq, err);
        }
    }

    /// Applies one work completion (from the completion thread).
    fn on_completion(&self, wr_id: u64, status: u32, vendor_err: u32) {
        let mut sq = lock(&self.sq);
        let mut covered = 0;
        if status == sys::ibv_wc_status::IBV_WC_SUCCESS {
            while sq.outstanding.front().is_some_and(|o| o.seq <= wr_id) {
                if let Some(o) = sq.outstanding.pop_front() {
                    o.batch.wr_done(&o.reqs, &Ok(()));
                    covered += 1;
                }
            }
            self.credits.add_permits(covered);
            return;
        }
        // In-order completion on an RC send queue: everything before the
        // failed WR completed.
        while sq.outstanding.front().is_some_and(|o| o.seq < wr_id) {
            if let Some(o) = sq.outstanding.pop_front() {
                o.batch.wr_done(&o.reqs, &Ok(()));
                covered += 1;
            }
        }
        let mut err = None;
        if sq.outstanding.front().is_some_and(|o| o.seq == wr_id) {
            if let Some(o) = sq.outstanding.pop_front() {
                let e = self.wc_error(status, vendor_err, &o);
                o.batch.wr_done(&o.reqs, &Err(e.clone()));
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
        match status {
            st::IBV_WC_REM_ACCESS_ERR | st::IBV_WC_REM_INV_REQ_ERR => Error::AddressNotRegistered {
                side: Side::Remote,
                addr: o.remote,
                len: o.len,
                peer: Some(self.peer.clone()),
            },
            st::IBV_WC_RETRY_EXC_ERR
            | st::IBV_WC_RNR_RETRY_EXC_ERR
            | st::IBV_WC_RESP_TIMEOUT_ERR
            | st::IBV_WC_WR_FLUSH_ERR => Error::PeerLost {
                peer: self.peer.clone(),
                reason: format!(
                    "{name}: the peer did not answer the RDMA {} (vendor error {vendor_err:#x})",
                    o.op
                ),
            },
            _ => Error::Backend {
                backend: crate::BACKEND.to_owned(),
                operation: format!("RDMA {} of {} bytes to {:#x}", o.op, o.len, o.remote),
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

    pub(crate) fn qp_key(&self) -> usize {
        self.qp_key
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

impl Drop for Conn {
    fn drop(&mut self) {
        self.poller.unwatch(&[self.cq_key(), self.qp_key]);
        for t in lock(&self.tasks).drain(..) {
            t.abort();
        }
        let err = self.lost("the connection was closed");
        let sq = self.sq.get_mut().unwrap_or_else(|p| p.into_inner());
        for o in sq.outstanding.drain(..) {
            o.batch.wr_done(&o.reqs, &Err(err.clone()));
        }
    }
}

async fn ctl_writer(
    mut wr: tokio::net::tcp::OwnedWriteHalf,
    mut rx: mpsc::UnboundedReceiver<CtlRequest>,
    pending: Arc<Mutex<VecDeque<Pending>>>,
    conn: std::sync::Weak<Conn>,
) {
    while let Some(req) = rx.recv().await {
        let (msg, p) = match req {
            CtlRequest::Table(tx) => (Msg::TableRequest, Pending::Table(tx)),
            CtlRequest::Notify(n, tx) => (
                Msg::Notify {
                    name: n.name,
                    message: n.message,
                },
                Pending::Notify(tx),
            ),
        };
        lock(&pending).push_back(p);
        if let Err(e) = wire::write_msg(&mut wr, &msg).await {
            let err = Error::PeerLost {
                peer: conn.upgrade().map(|c| c.peer.clone()).unwrap_or_default(),
                reason: format!("control channel write failed: {e}"),
            };
            for p in lock(&pending).drain(..) {
                p.fail(err.clone());
            }
            if let Some(c) = conn.upgrade() {
                c.break_with(err);
            }
            return;
        }
    }
}

async fn ctl_reader(
    mut rd: tokio::net::tcp::OwnedReadHalf,
    pending: Arc<Mutex<VecDeque<Pending>>>,
    conn: std::sync::Weak<Conn>,
) {
    let peer = conn.upgrade().map(|c| c.peer.clone()).unwrap_or_default();
    let reason = loop {
        match wire::read_msg(&mut rd, &peer).await {
            Ok(Some(Msg::Table { regions })) => match lock(&pending).pop_front() {
                Some(Pending::Table(tx)) => {
                    let _ = tx.send(Ok(regions));
                }
                _ => break "unexpected Table frame".to_owned(),
            },
            Ok(Some(Msg::NotifyAck)) => match lock(&pending).pop_front() {
                Some(Pending::Notify(tx)) => {
                    let _ = tx.send(Ok(()));
                }
                _ => break "unexpected NotifyAck frame".to_owned(),
            },
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
        p.fail(err.clone());
    }
    if let Some(c) = conn.upgrade() {
        c.break_with(err);
    }
}

//! One connection to a peer: its operations in flight, how responses and
//! failures complete them, and expiry of a batch's operations.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use crate::stream::Stream;
use ferry_core::__private::sync::lock;
use ferry_core::{Error, RegionGuard, Result, Side};
use socket2::SockRef;
use tokio::task::AbortHandle;

use super::wire_ops::WireOps;
use crate::frame::Response;
use crate::frame::{Status, TableEntry};
use crate::io::Pace;
use ferry_tcp_proto::initiator::{self, Answered, Expect, Pending, Recv};

/// The cached region table of a peer.
pub(crate) type TableCache = RwLock<Arc<Vec<TableEntry>>>;

/// What an operation in flight holds until its response: the region
/// guards that keep its local memory registered, and where a READ
/// payload goes.
pub(crate) enum PendingKind {
    /// Holds the source region registered until the target acknowledges,
    /// so `unregister` returns only after the transfer has finished.
    Write(#[allow(dead_code)] Arc<RegionGuard>),
    Read {
        dst: usize,
        len: u64,
        _guard: Arc<RegionGuard>,
    },
    Notify,
    Table(Arc<TableCache>),
    /// Several small writes in one frame: `(request index, remote addr,
    /// len)` per segment; the guards keep the sources registered.
    WriteV {
        parts: Vec<(usize, u64, u64)>,
        _guards: Vec<Arc<RegionGuard>>,
    },
    /// Several small reads in one frame: `(request index, local
    /// destination, remote addr, len)` per segment; the guards keep the
    /// destinations registered.
    ReadV {
        parts: Vec<(usize, usize, u64, u64)>,
        _guards: Vec<Arc<RegionGuard>>,
    },
    /// A CWRITE / CREAD (the target copies) or SWRITE / SREAD: `(request
    /// index, remote addr, len)` per segment; the guards keep the local
    /// sources or destinations registered until the target has answered.
    Cma {
        parts: Vec<(usize, u64, u64)>,
        guards: Vec<Arc<RegionGuard>>,
        /// The target writes this process's memory itself (a CREAD): if
        /// the operation ends without its answer, the guards are held
        /// until the target is shown to have stopped (see [`crate::same_host::fence`]).
        target_writes: bool,
    },
}

/// An operation sent and not yet answered.
pub(crate) struct PendingOp {
    /// The pass of the batch it belongs to.
    pub(crate) batch: Arc<WireOps>,
    /// Its request (the first one for a gathered frame).
    pub(crate) index: usize,
    /// What it holds.
    pub(crate) kind: PendingKind,
}

impl PendingOp {
    /// The guards that must outlive this operation if it ends without the
    /// target's answer (those of a CREAD, which the target copies into
    /// this process's memory; see [`crate::same_host::fence`]).
    fn take_unproven(&mut self) -> Vec<Arc<RegionGuard>> {
        match &mut self.kind {
            PendingKind::Cma {
                guards,
                target_writes: true,
                ..
            } => std::mem::take(guards),
            _ => Vec::new(),
        }
    }

    /// Completes the operation (every segment of a WRITEV) with `r`.
    pub(crate) fn complete(self, r: Result<()>) {
        match &self.kind {
            PendingKind::WriteV { parts, .. } | PendingKind::Cma { parts, .. } => {
                for (index, _, _) in parts {
                    self.batch.complete(*index, r.clone());
                }
            }
            PendingKind::ReadV { parts, .. } => {
                for (index, _, _, _) in parts {
                    self.batch.complete(*index, r.clone());
                }
            }
            _ => self.batch.complete(self.index, r),
        }
    }
}

impl Answered for PendingOp {
    #[inline]
    fn expect(&self) -> Expect {
        match &self.kind {
            PendingKind::Write(_) | PendingKind::Notify => Expect::Ack,
            PendingKind::Read { len, .. } => Expect::Data(*len),
            PendingKind::Table(_) => Expect::Table,
            PendingKind::WriteV { .. } | PendingKind::Cma { .. } => Expect::AckV,
            PendingKind::ReadV { .. } => Expect::DataV,
        }
    }
}

impl PendingOp {
    /// Where a READ's payload goes.
    #[inline]
    pub(crate) fn destination(&self) -> Option<usize> {
        match &self.kind {
            PendingKind::Read { dst, .. } => Some(*dst),
            _ => None,
        }
    }
}

/// The operations in flight on a connection (by request id), the ids of
/// those whose batch expired (their responses are skipped), and why the
/// connection is closed, once it is (later sends fail with it): the core's
/// bookkeeping.
pub(crate) type PendingMap = Pending<PendingOp, Error>;

/// One connection to a peer, shared by callers and its reader task.
pub(crate) struct ConnShared {
    /// The socket.
    pub(crate) stream: Stream,
    /// The peer's segment name (for errors).
    pub(crate) peer: String,
    /// Operations in flight.
    pub(crate) pending: Mutex<PendingMap>,
    /// Held while a caller writes its frames.
    pub(crate) write_lock: tokio::sync::Mutex<()>,
    /// Small frames of callers that found the write lock taken, in the
    /// order they came: whoever holds the lock writes them before letting
    /// go (see `send::send_combined`).
    pub(crate) outbox: Mutex<Vec<Vec<u8>>>,
    /// The next request id.
    pub(crate) next_id: AtomicU64,
    /// No longer usable (failed, closed or retired).
    pub(crate) dead: AtomicBool,
    /// Closed by this side for idleness (before the target's idle
    /// deadline): a send that finds it so goes to a new connection.
    pub(crate) retired: AtomicBool,
    /// Deadlines for moving bytes inside frames.
    pub(crate) pace: Pace,
    /// When the connection was made; `last_rx` counts from it.
    pub(crate) born: Instant,
    /// Milliseconds after `born` when the last response header arrived.
    pub(crate) last_rx: AtomicU64,
    /// Payloads move by cross-memory attach (the target copies).
    pub(crate) cma: bool,
    /// The staging area the target mapped, if any: medium payloads move
    /// through it (see [`crate::same_host::stage`]).
    pub(crate) stage: Option<ClientStage>,
    /// Microseconds after `born` of the last request sent or response
    /// header received: the reader keeps polling (instead of sleeping)
    /// for `spin_pending` after it while requests are outstanding.
    pub(crate) activity_us: AtomicU64,
    /// The reader task, for a blocked caller to drive while it waits for
    /// its answer ([`ferry_core::assist`]).
    pub(crate) assist: ferry_core::assist::Handle,
    /// The runtime the connection was made on: where a send dropped
    /// outside any runtime hands the queued small calls to a task.
    pub(crate) rt: tokio::runtime::Handle,
    /// Told when operations are answered (taken out of `pending`) or the
    /// connection fails, while `window_waiters` > 0: a long send waits
    /// here for its earlier slices' answers (`send::FAIR_WINDOW`).
    pub(crate) answered: tokio::sync::Notify,
    /// Long sends waiting on `answered`.
    pub(crate) window_waiters: std::sync::atomic::AtomicUsize,
}

/// The initiator's side of a connection's staging area.
pub(crate) struct ClientStage {
    /// The shared area.
    pub(crate) area: Arc<crate::same_host::stage::Area>,
    /// The target's grants, if agreed and this process may reach the
    /// target (see [`crate::same_host::grant`]).
    pub(crate) grants: Option<Arc<crate::same_host::grant::ClientGrants>>,
    /// Frames of at least this many bytes go through it.
    pub(crate) min: usize,
    /// How long a copy waits for the target to make room (or to fill a
    /// slot) before the connection fails with a timeout: the stall timeout,
    /// or the request timeout if shorter (a batch waiting that long is
    /// past its deadline).
    pub(crate) patience: Duration,
    /// This side's positions: the next slot to fill in the ring to the
    /// target, the next to empty in the ring from it. Taken by a sender
    /// before it releases the write lock, so that streams go through the
    /// rings in the order of their frames.
    pub(crate) cursor: tokio::sync::Mutex<(u64, u64)>,
    /// Callers copying through the area right now (the reader waits for
    /// readiness instead of spinning meanwhile, see [`ConnShared::poll_on`]).
    pub(crate) movers: std::sync::atomic::AtomicU32,
    /// Those of them moving more than the rings hold (they wait for the
    /// target as they go: milliseconds).
    pub(crate) long_movers: std::sync::atomic::AtomicU32,
    /// Ends the reader's pause once a long move is over (see
    /// [`crate::io::Pause`]).
    pub(crate) nudge: Arc<tokio::sync::Notify>,
    /// The next position to take in the area's acknowledgement lane (only
    /// the reader task takes).
    pub(crate) lane_tail: AtomicU64,
    /// Held around each copy out of the area into local memory:
    /// [`ConnShared::fail_all`] takes it after marking the connection dead,
    /// so no such copy lands once the operations have failed.
    pub(crate) gate: Mutex<()>,
    /// Whether long frames go through the area or to the kernel copy
    /// right now (they avoid the area while the target loses its CPU).
    pub(crate) choice: crate::same_host::choice::PathChoice,
}

impl ClientStage {
    /// Whether a caller is moving a stream longer than the rings (the
    /// reader then pauses instead of polling: see [`ConnShared::poll_on`]).
    pub(crate) fn moving_long(&self) -> bool {
        self.long_movers.load(Ordering::Relaxed) > 0
    }

    pub(crate) fn new(
        area: Arc<crate::same_host::stage::Area>,
        grants: Option<Arc<crate::same_host::grant::ClientGrants>>,
        min: usize,
        patience: Duration,
    ) -> ClientStage {
        ClientStage {
            area,
            grants,
            min,
            patience,
            cursor: tokio::sync::Mutex::new((0, 0)),
            movers: std::sync::atomic::AtomicU32::new(0),
            long_movers: std::sync::atomic::AtomicU32::new(0),
            nudge: Arc::new(tokio::sync::Notify::new()),
            lane_tail: AtomicU64::new(0),
            gate: Mutex::new(()),
            choice: Default::default(),
        }
    }
}

impl ConnShared {
    /// Marks the connection dead, fails every pending operation with `err`
    /// and shuts the socket down. Idempotent.
    pub(crate) fn fail_all(&self, err: Error) {
        self.fail_with(err, Vec::new());
    }

    /// [`ConnShared::fail_all`], failing `taken` (operations already taken
    /// out of the pending map) with the rest. On a same-host connection
    /// only the writing half is shut (the target reads the end of the
    /// stream and stops) and the guards of operations the target may still
    /// copy into go to a fence until its side has ended too.
    fn fail_with(&self, err: Error, mut taken: Vec<PendingOp>) {
        self.dead.store(true, Ordering::Release);
        if let Some(st) = &self.stage {
            // Wait out a copy from the staging area in progress.
            drop(lock(&st.gate));
        }
        {
            let mut map = lock(&self.pending);
            taken.extend(map.close(err.clone()));
        }
        // Their operations are failed with the rest: never sent.
        lock(&self.outbox).clear();
        // A long send waiting for answers sees the connection failed.
        self.answered.notify_waiters();
        let mut unproven = Vec::new();
        for mut op in taken {
            unproven.extend(op.take_unproven());
            op.complete(Err(err.clone()));
        }
        let sock = SockRef::from(&self.stream);
        if self.cma {
            // Never the reading half: a fence of this connection (now or
            // from an earlier failure) reads on until the target's end.
            let _ = sock.shutdown(std::net::Shutdown::Write);
            if !unproven.is_empty() {
                crate::same_host::fence::hold_until_closed(
                    &self.stream,
                    unproven,
                    self.pace.stall,
                    &self.peer,
                );
            }
        } else {
            let _ = sock.shutdown(std::net::Shutdown::Both);
        }
    }

    /// The reader's spin hook: marks it polling the staging area's
    /// acknowledgement lane (or about to sleep) and completes the
    /// operations acknowledged there. No-op without a staging area.
    /// Returns whether it took any.
    pub(crate) fn take_lane(&self, polling: bool) -> bool {
        let Some(st) = &self.stage else { return false };
        let mut tail = st.lane_tail.load(Ordering::Relaxed);
        let start = tail;
        let mut failed = None;
        st.area.acks().take(polling, &mut tail, |id| {
            if failed.is_none() {
                self.mark_rx();
                failed = self.ack(id, Ok(())).err();
            }
        });
        st.lane_tail.store(tail, Ordering::Relaxed);
        if let Some(e) = failed {
            self.fail_all(e);
        }
        tail != start
    }

    /// What the core makes of an answer header (the operation it answers
    /// taken out of flight, when it names one).
    #[inline]
    pub(crate) fn on_header(&self, resp: &Response) -> Recv<PendingOp> {
        let staged = self.stage.is_some();
        if let Some(r) = initiator::header_alone(resp, staged) {
            // Names no operation: no lock taken.
            return r;
        }
        let r = initiator::on_header(&mut lock(&self.pending), resp, staged);
        // SeqCst with the waiter's increment: it counts itself before it
        // looks at `pending`, so either it sees this removal or this sees it.
        if self.window_waiters.load(Ordering::SeqCst) > 0 {
            self.answered.notify_waiters();
        }
        r
    }

    /// Executes what the core decided for an answer header, as far as no
    /// payload bytes are involved; hands back what needs reading (`Into`,
    /// `Indices`, `Refusals`, `Acks`, `Table`, a `Discard` of some bytes)
    /// or the staging area's lane.
    pub(crate) fn settle(&self, recv: Recv<PendingOp>) -> Result<Option<Recv<PendingOp>>> {
        match recv {
            Recv::Ack(op) => {
                op.complete(Ok(()));
                Ok(None)
            }
            Recv::Refused(op, status, addr, len) => {
                if initiator::retried(status) {
                    op.batch.mark_stale(op.index);
                }
                op.complete(Err(self.status_error(status, addr, len)));
                Ok(None)
            }
            Recv::Fail(op, reason) => {
                let err = self.protocol(reason);
                if let Some(op) = op {
                    op.complete(Err(err.clone()));
                }
                Err(err)
            }
            Recv::Discard(0) => Ok(None),
            other => Ok(Some(other)),
        }
    }

    /// Completes part `index` of `batch` as the core judged it
    /// ([`initiator::Verdicts::of`]): landed, or refused with `status`
    /// (marked for the retry where [`initiator::retried`] says so; `addr`
    /// and `len` name the range in the error).
    #[inline]
    pub(crate) fn complete_part(
        &self,
        batch: &WireOps,
        index: usize,
        verdict: std::result::Result<(), Status>,
        addr: u64,
        len: u64,
    ) {
        let r = verdict.map_err(|status| {
            if initiator::retried(status) {
                batch.mark_stale(index);
            }
            self.status_error(status, addr, len)
        });
        batch.complete(index, r);
    }

    pub(crate) fn mark_rx(&self) {
        let ms = self.born.elapsed().as_millis() as u64;
        self.last_rx.store(ms, Ordering::Relaxed);
        self.touch();
    }

    /// Records activity (a request sent, a response received) now.
    pub(crate) fn touch(&self) {
        let us = self.born.elapsed().as_micros() as u64;
        self.activity_us.store(us, Ordering::Relaxed);
    }

    /// Whether the reader should keep polling: requests are outstanding
    /// and the last activity is less than `window` ago.
    pub(crate) fn poll_on(&self, window: Duration) -> bool {
        if let Some(st) = &self.stage {
            if st.moving_long() {
                // A caller moves a long stream through the staging area,
                // and the target with it: the two copying threads need the
                // CPUs for a millisecond or more. Stop polling and pause
                // (`crate::io::Pause`): still "polling" for the target, so
                // its acknowledgements wait in the lane without a WAKE
                // frame, until the mover nudges the reader when done.
                // Never sleep in this task: that would stall every task of
                // the caller's runtime.
                return false;
            }
            if st.movers.load(Ordering::Relaxed) > 0 {
                // A short copy (the rings hold it all, a few µs): keep
                // polling, so that the target posts the acknowledgement in
                // the lane, but offer the CPU to the copying threads
                // between looks. A yield, not a sleep.
                std::thread::yield_now();
                return true;
            }
        }
        let last = self.activity_us.load(Ordering::Relaxed);
        let now = self.born.elapsed().as_micros() as u64;
        now.saturating_sub(last) < window.as_micros() as u64 && !lock(&self.pending).is_empty()
    }

    /// How long ago the last response header arrived.
    pub(crate) fn since_rx(&self) -> Duration {
        let last = Duration::from_millis(self.last_rx.load(Ordering::Relaxed));
        self.born.elapsed().saturating_sub(last)
    }

    /// Fails the operations of `batch` pending on this connection with
    /// `err` (their late responses will be skipped). The connection itself
    /// is dropped only if the peer has sent nothing for `quiet` (it is
    /// stuck for every batch) or too many ids are abandoned.
    pub(crate) fn abandon(&self, batch: &Arc<WireOps>, err: &Error, quiet: Duration) {
        let (ops, too_many) = lock(&self.pending).abandon(|op| Arc::ptr_eq(&op.batch, batch));
        if self.cma && !ops.is_empty() {
            // The target copies into (out of) memory these operations
            // name: close the connection, so that the target (which checks
            // before each copy) starts no more copies, and hold what it may
            // still be copying into until it is shown to have stopped.
            self.fail_with(err.clone(), ops);
            return;
        }
        for op in ops {
            op.complete(Err(err.clone()));
        }
        if too_many || self.since_rx() >= quiet {
            self.fail_all(err.clone());
        }
    }

    pub(crate) fn protocol(&self, reason: impl Into<String>) -> Error {
        Error::Protocol {
            peer: self.peer.clone(),
            reason: reason.into(),
        }
    }

    pub(crate) fn lost(&self, e: &std::io::Error) -> Error {
        if e.kind() == std::io::ErrorKind::TimedOut {
            Error::Timeout {
                operation: "receiving a response".to_owned(),
                peer: Some(self.peer.clone()),
                after: self.pace.stall,
            }
        } else {
            Error::PeerLost {
                peer: self.peer.clone(),
                reason: e.to_string(),
            }
        }
    }

    pub(crate) fn status_error(&self, status: Status, addr: u64, len: u64) -> Error {
        match status {
            Status::AddressNotRegistered => Error::AddressNotRegistered {
                side: Side::Remote,
                addr,
                len,
                peer: Some(self.peer.clone()),
            },
            Status::NotifyInvalid => Error::InvalidArgument(format!(
                "peer {} refused the notification as malformed",
                self.peer
            )),
            // Retryable (WouldBlock): the target drains its queue.
            Status::NotifyQueueFull => Error::QueueFull {
                backend: "tcp".to_owned(),
                queue: ferry_core::Queue::Notifications,
                what: format!(
                    "{}'s notification queue (or it refuses notifications)",
                    self.peer
                ),
                limit: None,
            },
            Status::StaleRegion => Error::AddressNotRegistered {
                side: Side::Remote,
                addr,
                len,
                peer: Some(self.peer.clone()),
            },
            Status::CopyFailed => Error::Io {
                context: format!("cross-memory copy by {} at [{addr:#x}, +{len})", self.peer),
                kind: std::io::ErrorKind::Other,
                message: "the target could not reach this process's memory".to_owned(),
                source: None,
            },
            Status::ShuttingDown => Error::PeerLost {
                peer: self.peer.clone(),
                reason: "the peer is shutting down".to_owned(),
            },
            other => self.protocol(format!("peer reported {other:?}")),
        }
    }

    /// Completes `id` with a plain acknowledgement or an error status
    /// (responses for ids of expired batches are skipped).
    pub(crate) fn ack(
        &self,
        id: u64,
        r: std::result::Result<(), (Status, u64, u64)>,
    ) -> Result<()> {
        let resp = match r {
            Ok(()) => Response::Ok { id },
            Err((status, addr, len)) => Response::Err {
                id,
                status,
                addr,
                len,
            },
        };
        self.settle(self.on_header(&resp)).map(drop)
    }
}

/// A connection: its shared state and its reader task (aborted on drop).
pub(crate) struct Conn {
    /// What callers and the reader share.
    pub(crate) shared: Arc<ConnShared>,
    /// The reader task.
    pub(crate) reader: AbortHandle,
}

impl Drop for Conn {
    fn drop(&mut self) {
        self.reader.abort();
        self.shared.fail_all(Error::Canceled(format!(
            "connection to {} closed",
            self.shared.peer
        )));
    }
}

/// A caller moving streams through the staging area, counted in
/// [`ClientStage::movers`] (and `long_movers`) for as long as it lives —
/// also when its future is dropped mid-move; the reader is nudged when a
/// long move ends.
pub(crate) struct Moving<'a> {
    st: &'a ClientStage,
    long: bool,
}

impl<'a> Moving<'a> {
    pub(crate) fn new(st: &'a ClientStage, long: bool) -> Moving<'a> {
        st.movers.fetch_add(1, Ordering::Relaxed);
        if long {
            st.long_movers.fetch_add(1, Ordering::Relaxed);
        }
        Moving { st, long }
    }
}

impl Drop for Moving<'_> {
    fn drop(&mut self) {
        self.st.movers.fetch_sub(1, Ordering::Relaxed);
        if self.long {
            self.st.long_movers.fetch_sub(1, Ordering::Relaxed);
            // Only a long move pauses the reader.
            self.st.nudge.notify_one();
        }
    }
}

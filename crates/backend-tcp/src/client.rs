//! The initiator side: peers, their connections, request pipelining and
//! batch bookkeeping.
//!
//! Callers write their frames themselves (header and payload from registered
//! memory in one `writev`), under a per-connection write lock. One reader
//! task per connection reads responses and completes requests; READ payloads
//! go from the socket straight into the destination region, which a
//! [`RegionGuard`] keeps registered until the request completes.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use socket2::SockRef;
use tokio::net::TcpStream;
use tokio::sync::Notify;
use tokio::task::AbortHandle;
use transport_core::{Error, Notification, RegionGuard, Result, Side, TransferOp, TransferRequest};

use crate::cma::SameHost;
use crate::frame::{
    decode_ids, decode_table, encode_cma_segments, encode_segments, table_lookup, CmaSegment,
    Request, Response, Segment, Status, TableEntry, MAX_ACKS, MAX_SEGMENTS, TABLE_ENTRY_LEN,
};
use crate::handshake;
use crate::io::{write_all, Bytes, FrameReader, Next, Pace};
use crate::server::Core;
use transport_core::raw::{lock, BatchDriver};

/// Requests up to this size are gathered into WRITEV / READV frames.
const GATHER_MAX_SEGMENT: u64 = 64 * 1024;
/// Most payload bytes per WRITEV / READV frame.
const GATHER_MAX_BYTES: u64 = 4 << 20;
/// Most request ids of expired batches a connection remembers (their late
/// responses are skipped); beyond it the connection is dropped.
const MAX_ABANDONED: usize = 65_536;

/// Wire-operation bookkeeping of one pass over a batch (or of one control
/// request): how many frames each request still waits for, and its first
/// error. When the last operation of a request completes, its outcome goes
/// to the batch's [`BatchDriver`] (if any); the batch rules (finishing,
/// the notification, cancellation) are the driver's.
#[derive(Debug)]
pub struct WireOps {
    slots: Mutex<Vec<Slot>>,
    remaining: AtomicUsize,
    done: Notify,
    /// Where finished requests are reported.
    sink: Option<Sink>,
}

/// The driver a [`WireOps`] reports to.
#[derive(Debug)]
struct Sink {
    driver: BatchDriver,
    /// The driver's index of each request here (a retry pass covers some
    /// requests of the batch); `None`: the same.
    indices: Option<Vec<usize>>,
    /// Requests refused as stale are held back (not reported) for a retry.
    hold_stale: bool,
}

#[derive(Debug, Default, Clone)]
struct Slot {
    left: u32,
    err: Option<Error>,
    /// The target refused part of the request because the region was
    /// registered again since the table this engine used (`StaleRegion`):
    /// the request is retried once with a fresh table.
    stale: bool,
}

impl WireOps {
    fn with_sink(n: usize, sink: Option<Sink>) -> Arc<Self> {
        Arc::new(WireOps {
            // Every request counts as pending until `arm`.
            slots: Mutex::new(vec![
                Slot {
                    left: 1,
                    err: None,
                    stale: false
                };
                n
            ]),
            // Held at 1 until `arm` sets the real count.
            remaining: AtomicUsize::new(1),
            done: Notify::new(),
            sink,
        })
    }

    /// Bookkeeping for `n` requests reported nowhere (control requests:
    /// read [`WireOps::results`]).
    pub fn new(n: usize) -> Arc<Self> {
        Self::with_sink(n, None)
    }

    /// Bookkeeping for the requests of `driver`'s batch; requests the
    /// target refused as stale are held back for a retry.
    pub fn reporting(driver: &BatchDriver) -> Arc<Self> {
        Self::with_sink(
            driver.len(),
            Some(Sink {
                driver: driver.clone(),
                indices: None,
                hold_stale: true,
            }),
        )
    }

    /// Bookkeeping for a retry of the requests `indices` of `driver`'s
    /// batch; every outcome, stale again or not, is final.
    pub fn retrying(driver: &BatchDriver, indices: Vec<usize>) -> Arc<Self> {
        Self::with_sink(
            indices.len(),
            Some(Sink {
                driver: driver.clone(),
                indices: Some(indices),
                hold_stale: false,
            }),
        )
    }

    /// Reports request `index` to the driver if it is over.
    fn report(&self, index: usize, slot: &Slot) {
        let Some(sink) = &self.sink else { return };
        if slot.left > 0 || (slot.stale && sink.hold_stale) {
            return;
        }
        let to = match &sink.indices {
            Some(map) => match map.get(index) {
                Some(&i) => i,
                None => return,
            },
            None => index,
        };
        let r = match &slot.err {
            Some(e) => Err(e.clone()),
            None => Ok(()),
        };
        sink.driver.complete(to, r);
    }

    /// Sets each request's number of wire operations; must be called once
    /// before any operation is sent. Requests with none (zero length, or
    /// failed before the wire) are over now.
    fn arm(&self, ops_per_request: &[u32]) {
        let mut slots = lock(&self.slots);
        let mut total = 0usize;
        for (i, (s, &n)) in slots.iter_mut().zip(ops_per_request).enumerate() {
            s.left = n;
            total += n as usize;
            if n == 0 {
                self.report(i, s);
            }
        }
        drop(slots);
        // Replace the placeholder 1 with the real count.
        self.remaining.fetch_add(total, Ordering::AcqRel);
        self.finish_one();
    }

    fn finish_one(&self) {
        if self.remaining.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.done.notify_waiters();
        }
    }

    /// Records an error for a request that never reached the wire.
    fn fail_unsent(&self, index: usize, err: Error) {
        let mut slots = lock(&self.slots);
        if let Some(s) = slots.get_mut(index) {
            s.err.get_or_insert(err);
        }
    }

    /// Completes one wire operation of request `index`.
    fn complete(&self, index: usize, r: Result<()>) {
        {
            let mut slots = lock(&self.slots);
            if let Some(s) = slots.get_mut(index) {
                let before = s.left;
                s.left = s.left.saturating_sub(1);
                if let Err(e) = r {
                    s.err.get_or_insert(e);
                }
                if before > 0 {
                    self.report(index, s);
                }
            }
        }
        self.finish_one();
    }

    /// Whether every operation has completed.
    pub fn is_done(&self) -> bool {
        self.remaining.load(Ordering::Acquire) == 0
    }

    /// Waits until every operation has completed.
    pub async fn wait(&self) {
        loop {
            let notified = self.done.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if self.is_done() {
                return;
            }
            notified.await;
        }
    }

    /// Each request's result (meaningful once done).
    pub fn results(&self) -> Vec<Result<()>> {
        lock(&self.slots)
            .iter()
            .map(|s| match &s.err {
                Some(e) => Err(e.clone()),
                None => Ok(()),
            })
            .collect()
    }

    /// Marks request `index` for a retry with a fresh table.
    fn mark_stale(&self, index: usize) {
        if let Some(s) = lock(&self.slots).get_mut(index) {
            s.stale = true;
        }
    }

    /// The requests marked for a retry.
    fn stale(&self) -> Vec<usize> {
        lock(&self.slots)
            .iter()
            .enumerate()
            .filter(|(_, s)| s.stale)
            .map(|(i, _)| i)
            .collect()
    }
}

/// The cached region table of a peer.
type TableCache = RwLock<Arc<Vec<TableEntry>>>;

enum PendingKind {
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
    /// A CWRITE / CREAD (the target copies): `(request index, remote addr,
    /// len)` per segment; the guards keep the local sources or
    /// destinations registered until the target has answered.
    Cma {
        parts: Vec<(usize, u64, u64)>,
        _guards: Vec<Arc<RegionGuard>>,
    },
}

struct PendingOp {
    batch: Arc<WireOps>,
    index: usize,
    kind: PendingKind,
}

impl PendingOp {
    /// Completes the operation (every segment of a WRITEV) with `r`.
    fn complete(self, r: Result<()>) {
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

#[derive(Default)]
struct PendingMap {
    ops: HashMap<u64, PendingOp>,
    /// Ids of operations whose batch expired: their responses are skipped.
    abandoned: HashSet<u64>,
    closed: Option<Error>,
}

/// One connection to a peer, shared by callers and its reader task.
pub struct ConnShared {
    stream: TcpStream,
    peer: String,
    pending: Mutex<PendingMap>,
    write_lock: tokio::sync::Mutex<()>,
    next_id: AtomicU64,
    dead: AtomicBool,
    /// Closed by this side for idleness (before the target's idle
    /// deadline): a send that finds it so goes to a new connection.
    retired: AtomicBool,
    /// Deadlines for moving bytes inside frames.
    pace: Pace,
    /// When the connection was made; `last_rx` counts from it.
    born: Instant,
    /// Milliseconds after `born` when the last response header arrived.
    last_rx: AtomicU64,
    /// Payloads move by cross-memory attach (the target copies).
    cma: bool,
}

impl ConnShared {
    /// Marks the connection dead, fails every pending operation with `err`
    /// and shuts the socket down. Idempotent.
    fn fail_all(&self, err: Error) {
        self.dead.store(true, Ordering::Release);
        let drained: Vec<PendingOp> = {
            let mut map = lock(&self.pending);
            map.closed.get_or_insert_with(|| err.clone());
            map.ops.drain().map(|(_, op)| op).collect()
        };
        for op in drained {
            op.complete(Err(err.clone()));
        }
        let _ = SockRef::from(&self.stream).shutdown(std::net::Shutdown::Both);
    }

    fn take(&self, id: u64) -> Option<PendingOp> {
        lock(&self.pending).ops.remove(&id)
    }

    /// Whether `id` belonged to an expired batch (and forgets it).
    fn forget(&self, id: u64) -> bool {
        lock(&self.pending).abandoned.remove(&id)
    }

    fn mark_rx(&self) {
        let ms = self.born.elapsed().as_millis() as u64;
        self.last_rx.store(ms, Ordering::Relaxed);
    }

    /// How long ago the last response header arrived.
    fn since_rx(&self) -> Duration {
        let last = Duration::from_millis(self.last_rx.load(Ordering::Relaxed));
        self.born.elapsed().saturating_sub(last)
    }

    /// Fails the operations of `batch` pending on this connection with
    /// `err` (their late responses will be skipped). The connection itself
    /// is dropped only if the peer has sent nothing for `quiet` (it is
    /// stuck for every batch) or too many ids are abandoned.
    fn abandon(&self, batch: &Arc<WireOps>, err: &Error, quiet: Duration) {
        let (ops, too_many) = {
            let mut map = lock(&self.pending);
            let ids: Vec<u64> = map
                .ops
                .iter()
                .filter(|(_, op)| Arc::ptr_eq(&op.batch, batch))
                .map(|(id, _)| *id)
                .collect();
            let mut ops = Vec::with_capacity(ids.len());
            for id in ids {
                if let Some(op) = map.ops.remove(&id) {
                    map.abandoned.insert(id);
                    ops.push(op);
                }
            }
            (ops, map.abandoned.len() > MAX_ABANDONED)
        };
        if self.cma && !ops.is_empty() {
            // The target copies into (out of) memory these operations
            // name: close the connection before releasing it, so the
            // target (which checks before each copy) touches it no more.
            self.fail_all(err.clone());
        }
        for op in ops {
            op.complete(Err(err.clone()));
        }
        if too_many || self.since_rx() >= quiet {
            self.fail_all(err.clone());
        }
    }

    fn protocol(&self, reason: impl Into<String>) -> Error {
        Error::Protocol {
            peer: self.peer.clone(),
            reason: reason.into(),
        }
    }

    fn lost(&self, e: &std::io::Error) -> Error {
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

    fn status_error(&self, status: Status, addr: u64, len: u64) -> Error {
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
            Status::NotifyQueueFull => Error::Io {
                context: format!(
                    "notifying {}: its notification queue is full, try again later",
                    self.peer
                ),
                kind: std::io::ErrorKind::WouldBlock,
                message: "notification queue full".to_owned(),
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
    fn ack(&self, id: u64, r: std::result::Result<(), (Status, u64, u64)>) -> Result<()> {
        let Some(op) = self.take(id) else {
            if self.forget(id) {
                return Ok(());
            }
            return Err(self.protocol(format!("response for unknown request id {id}")));
        };
        if r.is_ok()
            && matches!(
                op.kind,
                PendingKind::Read { .. } | PendingKind::ReadV { .. } | PendingKind::Table(_)
            )
        {
            let err = self.protocol(format!("plain OK for request {id}, which needs data"));
            op.complete(Err(err.clone()));
            return Err(err);
        }
        match r {
            Ok(()) => op.complete(Ok(())),
            Err((status, addr, len)) => {
                if status == Status::StaleRegion {
                    op.batch.mark_stale(op.index);
                }
                let e = self.status_error(status, addr, len);
                op.complete(Err(e));
            }
        }
        Ok(())
    }
}

async fn reader_task(
    conn: Arc<ConnShared>,
    spin: Duration,
    spin_pending: Duration,
    idle: Option<Duration>,
) {
    let err = match reader_loop(&conn, spin, spin_pending, idle).await {
        Ok(()) => Error::PeerLost {
            peer: conn.peer.clone(),
            reason: "the peer closed the connection".to_owned(),
        },
        Err(e) => e,
    };
    tracing::debug!(peer = %conn.peer, error = %err, "connection closed");
    conn.fail_all(err);
}

/// Reads responses until EOF or an error. `idle`: how long the connection
/// may stay without requests before this side retires it (half the
/// target's idle deadline, so the target never closes it under a request).
async fn reader_loop(
    conn: &ConnShared,
    spin: Duration,
    spin_pending: Duration,
    idle: Option<Duration>,
) -> Result<()> {
    let mut rd = FrameReader::new(spin, conn.pace);
    let mut ids = vec![0u8; MAX_ACKS as usize * 8];
    let stream = &conn.stream;
    let spin_pending = spin_pending.max(spin);
    loop {
        // Poll longer while responses are expected.
        let busy = !lock(&conn.pending).ops.is_empty();
        rd.set_spin(if busy { spin_pending } else { spin });
        let hdr = match rd
            .next_header(stream, if busy { None } else { idle })
            .await
            .map_err(|e| conn.lost(&e))?
        {
            Next::Header(h) => h,
            Next::Eof => return Ok(()),
            Next::Idle => {
                let mut map = lock(&conn.pending);
                if map.ops.is_empty() {
                    // Retire it: sends that race with this go elsewhere.
                    conn.retired.store(true, Ordering::Release);
                    conn.dead.store(true, Ordering::Release);
                    map.closed.get_or_insert_with(|| {
                        Error::Canceled(format!("idle connection to {} retired", conn.peer))
                    });
                    return Ok(());
                }
                continue;
            }
        };
        conn.mark_rx();
        let resp = Response::decode(&hdr).map_err(|e| conn.protocol(e.0))?;
        // The whole frame must arrive at the minimum rate.
        rd.begin_frame(match resp {
            Response::Ok { .. } | Response::Err { .. } => 0,
            Response::OkMany { count } => count as u64 * 8,
            Response::Data { len, .. } => len,
            Response::DataV { failed, len, .. } => failed as u64 * 4 + len,
            Response::ErrV { count, .. } => count as u64 * 4,
            Response::Table { count, .. } => count as u64 * TABLE_ENTRY_LEN as u64,
        });
        match resp {
            Response::Ok { id } => conn.ack(id, Ok(()))?,
            Response::OkMany { count } => {
                let buf = &mut ids[..count as usize * 8];
                rd.read_payload(stream, Bytes::from_mut(buf))
                    .await
                    .map_err(|e| conn.lost(&e))?;
                for id in decode_ids(buf) {
                    conn.ack(id, Ok(()))?;
                }
            }
            Response::Err {
                id,
                status,
                addr,
                len,
            } => conn.ack(id, Err((status, addr, len)))?,
            Response::Data { id, len } => {
                let Some(op) = conn.take(id) else {
                    if conn.forget(id) {
                        rd.discard(stream, len, true)
                            .await
                            .map_err(|e| conn.lost(&e))?;
                        continue;
                    }
                    return Err(conn.protocol(format!("DATA for unknown request id {id}")));
                };
                let (dst, want) = match &op.kind {
                    PendingKind::Read { dst, len, .. } => (*dst, *len),
                    _ => (0, u64::MAX),
                };
                if want != len {
                    let err = conn.protocol(format!(
                        "DATA of {len} bytes for request {id}, which expects {want}"
                    ));
                    op.complete(Err(err.clone()));
                    return Err(err);
                }
                // SAFETY: `dst..dst+len` was bounds-checked against a local
                // registered region when the request was issued, and the
                // RegionGuard held in `op` keeps that region registered (so
                // the memory valid) until `op` is dropped below. Only
                // recvmsg(2) writes it.
                let slice = unsafe { Bytes::from_raw(dst as *mut u8, len as usize) };
                match rd.read_payload(stream, slice).await {
                    Ok(()) => op.complete(Ok(())),
                    Err(e) => {
                        let err = conn.lost(&e);
                        op.complete(Err(err.clone()));
                        return Err(err);
                    }
                }
            }
            Response::DataV {
                id,
                status,
                failed,
                len,
            } => {
                let buf = &mut ids[..failed as usize * 4];
                // The indices end the frame only if no data follows.
                let Some(op) = conn.take(id) else {
                    if conn.forget(id) {
                        let r = if len == 0 {
                            rd.read_payload(stream, Bytes::from_mut(buf)).await
                        } else {
                            rd.read_part(stream, Bytes::from_mut(buf)).await
                        };
                        r.map_err(|e| conn.lost(&e))?;
                        if len > 0 {
                            rd.discard(stream, len, true)
                                .await
                                .map_err(|e| conn.lost(&e))?;
                        }
                        continue;
                    }
                    return Err(conn.protocol(format!("DATAV for unknown request id {id}")));
                };
                let PendingKind::ReadV { parts, .. } = &op.kind else {
                    let err = conn.protocol(format!("DATAV for request {id}, not a READV"));
                    op.complete(Err(err.clone()));
                    return Err(err);
                };
                let r = if len == 0 {
                    rd.read_payload(stream, Bytes::from_mut(buf)).await
                } else {
                    rd.read_part(stream, Bytes::from_mut(buf)).await
                };
                if let Err(e) = r {
                    let err = conn.lost(&e);
                    op.complete(Err(err.clone()));
                    return Err(err);
                }
                let mut bad = vec![false; parts.len()];
                let mut wrong = None;
                for c in buf.chunks_exact(4) {
                    let i = u32::from_le_bytes([c[0], c[1], c[2], c[3]]) as usize;
                    match bad.get_mut(i) {
                        Some(b) => *b = true,
                        None => wrong = Some(format!("DATAV names segment {i} of {}", parts.len())),
                    }
                }
                let valid: u64 = parts
                    .iter()
                    .zip(&bad)
                    .filter(|(_, b)| !**b)
                    .map(|(p, _)| p.3)
                    .sum();
                if wrong.is_none() && valid != len {
                    wrong = Some(format!(
                        "DATAV carries {len} bytes, the segments need {valid}"
                    ));
                }
                if let Some(w) = wrong {
                    let err = conn.protocol(w);
                    op.complete(Err(err.clone()));
                    return Err(err);
                }
                let dsts: Vec<Bytes<'static>> = parts
                    .iter()
                    .zip(&bad)
                    .filter(|(_, b)| !**b)
                    // SAFETY: each destination was bounds-checked against a
                    // local registered region when the request was issued;
                    // the guards held in `op` keep those regions registered
                    // until `op` is dropped. Only recvmsg(2) writes them.
                    .map(|(p, _)| unsafe { Bytes::from_raw(p.1 as *mut u8, p.3 as usize) })
                    .collect();
                if len > 0 {
                    if let Err(e) = rd.read_v(stream, &dsts, true).await {
                        let err = conn.lost(&e);
                        op.complete(Err(err.clone()));
                        return Err(err);
                    }
                }
                let status = status.unwrap_or(Status::AddressNotRegistered);
                for ((index, _, remote, n), b) in parts.iter().zip(bad) {
                    let r = if b {
                        if status == Status::StaleRegion {
                            op.batch.mark_stale(*index);
                        }
                        Err(conn.status_error(status, *remote, *n))
                    } else {
                        Ok(())
                    };
                    op.batch.complete(*index, r);
                }
            }
            Response::ErrV { id, status, count } => {
                let buf = &mut ids[..count as usize * 4];
                rd.read_payload(stream, Bytes::from_mut(buf))
                    .await
                    .map_err(|e| conn.lost(&e))?;
                let Some(op) = conn.take(id) else {
                    if conn.forget(id) {
                        continue;
                    }
                    return Err(conn.protocol(format!("ERRV for unknown request id {id}")));
                };
                let (PendingKind::WriteV { parts, .. } | PendingKind::Cma { parts, .. }) = &op.kind
                else {
                    let err = conn.protocol(format!("ERRV for request {id}, not a WRITEV"));
                    op.complete(Err(err.clone()));
                    return Err(err);
                };
                let mut failed = vec![false; parts.len()];
                for c in buf.chunks_exact(4) {
                    let i = u32::from_le_bytes([c[0], c[1], c[2], c[3]]) as usize;
                    match failed.get_mut(i) {
                        Some(f) => *f = true,
                        None => {
                            let err =
                                conn.protocol(format!("ERRV names segment {i} of {}", parts.len()));
                            op.complete(Err(err.clone()));
                            return Err(err);
                        }
                    }
                }
                for ((index, addr, len), bad) in parts.iter().zip(failed) {
                    let r = if bad {
                        if status == Status::StaleRegion {
                            op.batch.mark_stale(*index);
                        }
                        Err(conn.status_error(status, *addr, *len))
                    } else {
                        Ok(())
                    };
                    op.batch.complete(*index, r);
                }
            }
            Response::Table { id, count } => {
                // Bounded by the decoder (≤ 65,536 entries, 1.5 MiB).
                let mut raw = vec![0u8; count as usize * TABLE_ENTRY_LEN];
                rd.read_payload(stream, Bytes::from_mut(&mut raw))
                    .await
                    .map_err(|e| conn.lost(&e))?;
                let Some(op) = conn.take(id) else {
                    if conn.forget(id) {
                        continue;
                    }
                    return Err(conn.protocol(format!("TABLE for unknown request id {id}")));
                };
                let table = match decode_table(&raw) {
                    Ok(t) => t,
                    Err(e) => {
                        let err = conn.protocol(e.0);
                        op.complete(Err(err.clone()));
                        return Err(err);
                    }
                };
                match &op.kind {
                    PendingKind::Table(cache) => {
                        *cache.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(table);
                        op.complete(Ok(()));
                    }
                    _ => {
                        let err = conn.protocol(format!("TABLE reply to request {id}"));
                        op.complete(Err(err.clone()));
                        return Err(err);
                    }
                }
            }
        }
    }
}

/// A connection: its shared state and its reader task (aborted on drop).
pub struct Conn {
    shared: Arc<ConnShared>,
    reader: AbortHandle,
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

/// If a send is abandoned before it started writing (its caller was
/// dropped while waiting for the write lock), withdraws its operations so
/// that they release their region guards at once.
struct Unsent<'a> {
    conn: &'a ConnShared,
    ids: Option<Vec<u64>>,
}

impl Drop for Unsent<'_> {
    fn drop(&mut self) {
        let Some(ids) = self.ids.take() else { return };
        let ops: Vec<PendingOp> = {
            let mut map = lock(&self.conn.pending);
            ids.iter().filter_map(|id| map.ops.remove(id)).collect()
        };
        for op in ops {
            op.complete(Err(Error::Canceled(
                "the transfer was abandoned".to_owned(),
            )));
        }
    }
}

/// Marks a connection dead if a send is interrupted half-way (the stream
/// would hold a partial frame).
struct PoisonOnDrop<'a>(Option<&'a ConnShared>);

impl Drop for PoisonOnDrop<'_> {
    fn drop(&mut self) {
        if let Some(c) = self.0.take() {
            c.fail_all(Error::Canceled(
                "a send to the peer was interrupted".to_owned(),
            ));
        }
    }
}

/// A frame to send.
enum OutKind {
    Write {
        guard: Arc<RegionGuard>,
        off: u64,
        len: u64,
        remote: u64,
        gen: u32,
    },
    Read {
        guard: Arc<RegionGuard>,
        off: u64,
        len: u64,
        remote: u64,
        gen: u32,
    },
    Notify {
        bytes: Vec<u8>,
        name_len: u64,
    },
    Table(Arc<TableCache>),
    /// Small writes sent as one WRITEV frame (see [`Part`]).
    WriteV(Vec<Part>),
    /// Small reads sent as one READV frame, same layout.
    ReadV(Vec<Part>),
}

/// One segment of a WRITEV/READV: `(request index, local guard, offset in
/// it, len, remote addr, remote region generation)`.
type Part = (usize, Arc<RegionGuard>, u64, u64, u64, u32);

/// The segment table of a WRITEV/READV frame and the segments' total
/// length.
fn segment_table(parts: &[Part]) -> (Vec<u8>, u64) {
    let segs: Vec<Segment> = parts
        .iter()
        .map(|p| Segment {
            addr: p.4,
            len: p.3,
            gen: p.5,
        })
        .collect();
    (encode_segments(&segs), parts.iter().map(|p| p.3).sum())
}

struct OutOp {
    index: usize,
    kind: OutKind,
}

impl OutOp {
    /// Whether it moves payload (WRITE, READ, WRITEV, READV).
    fn is_transfer(&self) -> bool {
        matches!(
            self.kind,
            OutKind::Write { .. } | OutKind::Read { .. } | OutKind::WriteV(_) | OutKind::ReadV(_)
        )
    }

    /// The segments of a transfer operation as a CWRITE / CREAD sends
    /// them (`true`: a read); `None` for control operations.
    fn cma_parts(&self) -> Option<(bool, Vec<Part>)> {
        match &self.kind {
            OutKind::Write {
                guard,
                off,
                len,
                remote,
                gen,
            } => Some((
                false,
                vec![(self.index, Arc::clone(guard), *off, *len, *remote, *gen)],
            )),
            OutKind::Read {
                guard,
                off,
                len,
                remote,
                gen,
            } => Some((
                true,
                vec![(self.index, Arc::clone(guard), *off, *len, *remote, *gen)],
            )),
            OutKind::WriteV(parts) => Some((false, parts.clone())),
            OutKind::ReadV(parts) => Some((true, parts.clone())),
            _ => None,
        }
    }

    /// Fails the operation (every segment of a WRITEV) before it was sent.
    fn fail(&self, batch: &WireOps, e: &Error) {
        match &self.kind {
            OutKind::WriteV(parts) | OutKind::ReadV(parts) => {
                for p in parts {
                    batch.complete(p.0, Err(e.clone()));
                }
            }
            _ => batch.complete(self.index, Err(e.clone())),
        }
    }
}

/// `len` bytes at `off` in the range `guard` holds, for sendmsg(2).
fn source(guard: &RegionGuard, off: u64, len: u64) -> Bytes<'static> {
    // SAFETY: the guard (held by the operation until it completes, and in
    // `ops` until `send_ops` returns) keeps the local region registered and
    // valid; `off + len` lies inside the guarded range (the request was
    // checked against it when planned). Only sendmsg(2) reads it.
    unsafe { Bytes::from_raw(guard.as_ptr().wrapping_add(off as usize), len as usize) }
}

/// Registers `ops` as pending on `conn` and writes them in as few system
/// calls as possible. Failures complete the operations with an error; a
/// connection this side retired for idleness hands them back untouched.
async fn send_ops(
    conn: &ConnShared,
    batch: &Arc<WireOps>,
    ops: Vec<OutOp>,
) -> std::result::Result<(), Vec<OutOp>> {
    let mut hdrs = Vec::with_capacity(ops.len());
    let mut ids = Vec::with_capacity(ops.len());
    // Segment tables of WRITEV frames, in frame order.
    let mut tables: Vec<Vec<u8>> = Vec::new();
    {
        let mut map = lock(&conn.pending);
        if let Some(e) = map.closed.clone() {
            drop(map);
            if conn.retired.load(Ordering::Acquire) {
                return Err(ops);
            }
            for op in &ops {
                op.fail(batch, &e);
            }
            return Ok(());
        }
        for op in &ops {
            let id = conn.next_id.fetch_add(1, Ordering::Relaxed);
            ids.push(id);
            if conn.cma {
                if let Some((read, parts)) = op.cma_parts() {
                    let segs: Vec<CmaSegment> = parts
                        .iter()
                        .map(|p| CmaSegment {
                            seg: Segment {
                                addr: p.4,
                                len: p.3,
                                gen: p.5,
                            },
                            local: p.1.as_ptr() as u64 + p.2,
                        })
                        .collect();
                    tables.push(encode_cma_segments(&segs));
                    let req = Request::Cma {
                        id,
                        read,
                        count: parts.len() as u32,
                        total: parts.iter().map(|p| p.3).sum(),
                    };
                    hdrs.push(req.encode());
                    map.ops.insert(
                        id,
                        PendingOp {
                            batch: Arc::clone(batch),
                            index: op.index,
                            kind: PendingKind::Cma {
                                parts: parts.iter().map(|p| (p.0, p.4, p.3)).collect(),
                                _guards: parts.iter().map(|p| Arc::clone(&p.1)).collect(),
                            },
                        },
                    );
                    continue;
                }
            }
            let (req, kind) = match &op.kind {
                OutKind::Write {
                    guard,
                    len,
                    remote: addr,
                    gen,
                    ..
                } => (
                    Request::Write {
                        id,
                        addr: *addr,
                        len: *len,
                        gen: *gen,
                    },
                    PendingKind::Write(Arc::clone(guard)),
                ),
                OutKind::Read {
                    guard,
                    off,
                    len,
                    remote,
                    gen,
                } => (
                    Request::Read {
                        id,
                        addr: *remote,
                        len: *len,
                        gen: *gen,
                    },
                    PendingKind::Read {
                        dst: guard.as_ptr() as usize + *off as usize,
                        len: *len,
                        _guard: Arc::clone(guard),
                    },
                ),
                OutKind::Notify { bytes, name_len } => (
                    Request::Notify {
                        id,
                        name_len: *name_len,
                        msg_len: bytes.len() as u64 - name_len,
                    },
                    PendingKind::Notify,
                ),
                OutKind::Table(cache) => {
                    (Request::Table { id }, PendingKind::Table(Arc::clone(cache)))
                }
                OutKind::ReadV(parts) => {
                    let (table, total) = segment_table(parts);
                    tables.push(table);
                    (
                        Request::ReadV {
                            id,
                            count: parts.len() as u32,
                            total,
                        },
                        PendingKind::ReadV {
                            parts: parts
                                .iter()
                                .map(|p| (p.0, p.1.as_ptr() as usize + p.2 as usize, p.4, p.3))
                                .collect(),
                            _guards: parts.iter().map(|p| Arc::clone(&p.1)).collect(),
                        },
                    )
                }
                OutKind::WriteV(parts) => {
                    let (table, total) = segment_table(parts);
                    tables.push(table);
                    (
                        Request::WriteV {
                            id,
                            count: parts.len() as u32,
                            total,
                        },
                        PendingKind::WriteV {
                            parts: parts.iter().map(|p| (p.0, p.4, p.3)).collect(),
                            _guards: parts.iter().map(|p| Arc::clone(&p.1)).collect(),
                        },
                    )
                }
            };
            hdrs.push(req.encode());
            map.ops.insert(
                id,
                PendingOp {
                    batch: Arc::clone(batch),
                    index: op.index,
                    kind,
                },
            );
        }
    }
    let mut bufs: Vec<Bytes<'_>> = Vec::with_capacity(ops.len() * 2);
    let mut tables = tables.iter();
    for (hdr, op) in hdrs.iter().zip(&ops) {
        bufs.push(Bytes::from_ref(hdr));
        if conn.cma && op.is_transfer() {
            // Segment table only: the target copies the payload.
            if let Some(t) = tables.next() {
                bufs.push(Bytes::from_ref(t));
            }
            continue;
        }
        match &op.kind {
            OutKind::WriteV(parts) => {
                if let Some(t) = tables.next() {
                    bufs.push(Bytes::from_ref(t));
                }
                for (_, guard, off, len, _, _) in parts {
                    bufs.push(source(guard, *off, *len));
                }
            }
            OutKind::ReadV(_) => {
                if let Some(t) = tables.next() {
                    bufs.push(Bytes::from_ref(t));
                }
            }
            OutKind::Write {
                guard, off, len, ..
            } => bufs.push(source(guard, *off, *len)),
            OutKind::Notify { bytes, .. } => bufs.push(Bytes::from_ref(bytes)),
            _ => {}
        }
    }
    let mut unsent = Unsent {
        conn,
        ids: Some(ids),
    };
    let _w = conn.write_lock.lock().await;
    unsent.ids = None;
    let mut poison = PoisonOnDrop(Some(conn));
    let res = write_all(&conn.stream, &bufs, conn.pace).await;
    poison.0 = None;
    if let Err(e) = res {
        conn.fail_all(conn.lost(&e));
    }
    Ok(())
}

/// One connection slot of a peer.
#[derive(Default)]
struct SlotState {
    cur: RwLock<Option<Arc<Conn>>>,
    connect: tokio::sync::Mutex<()>,
}

/// An opened peer segment.
pub struct Peer {
    /// Segment name (`host:port`).
    pub name: String,
    core: Arc<Core>,
    slots: Vec<SlotState>,
    table: Arc<TableCache>,
    rr: AtomicUsize,
    /// The payload path of the latest connection, as reported.
    path: Mutex<Option<String>>,
}

impl std::fmt::Debug for Peer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Peer").field("name", &self.name).finish()
    }
}

fn connect_error(name: &str, e: &std::io::Error) -> Error {
    Error::SegmentUnavailable {
        name: name.to_owned(),
        reason: format!("cannot connect: {e}"),
    }
}

impl Peer {
    /// A peer with no connection yet.
    pub fn new(name: &str, core: Arc<Core>) -> Arc<Peer> {
        let n = core.config.connections;
        Arc::new(Peer {
            name: name.to_owned(),
            core,
            slots: (0..n).map(|_| SlotState::default()).collect(),
            table: Arc::new(RwLock::new(Arc::new(Vec::new()))),
            rr: AtomicUsize::new(0),
            path: Mutex::new(None),
        })
    }

    /// The payload path in use: `cma`, or `tcp (reason)`; `None` before
    /// the first connection.
    pub fn path(&self) -> Option<String> {
        lock(&self.path).clone()
    }

    /// Closes every connection (pending requests fail with `Canceled`).
    pub fn close(&self) {
        for s in &self.slots {
            s.cur.write().unwrap_or_else(|p| p.into_inner()).take();
        }
    }

    fn table(&self) -> Arc<Vec<TableEntry>> {
        Arc::clone(&self.table.read().unwrap_or_else(|p| p.into_inner()))
    }

    /// The live connection of slot `i`, connecting (and handshaking) if it
    /// is absent or dead.
    pub async fn conn(&self, i: usize) -> Result<Arc<ConnShared>> {
        let slot = &self.slots[i];
        let live = |slot: &SlotState| {
            slot.cur
                .read()
                .unwrap_or_else(|p| p.into_inner())
                .as_ref()
                .filter(|c| !c.shared.dead.load(Ordering::Acquire))
                .map(|c| Arc::clone(&c.shared))
        };
        if let Some(c) = live(slot) {
            return Ok(c);
        }
        let _g = slot.connect.lock().await;
        if let Some(c) = live(slot) {
            return Ok(c);
        }
        let cfg = &self.core.config;
        let conn = tokio::time::timeout(cfg.connect_timeout, self.connect())
            .await
            .map_err(|_| Error::Timeout {
                operation: "connect and handshake".to_owned(),
                peer: Some(self.name.clone()),
                after: cfg.connect_timeout,
            })??;
        let shared = Arc::clone(&conn.shared);
        let old = slot
            .cur
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .replace(Arc::new(conn));
        drop(old);
        Ok(shared)
    }

    async fn connect(&self) -> Result<Conn> {
        let cfg = &self.core.config;
        let addr = tokio::net::lookup_host(&self.name)
            .await
            .map_err(|e| connect_error(&self.name, &e))?
            .next()
            .ok_or_else(|| Error::SegmentUnavailable {
                name: self.name.clone(),
                reason: "the name resolves to no address".to_owned(),
            })?;
        let sock = if addr.is_ipv4() {
            tokio::net::TcpSocket::new_v4()
        } else {
            tokio::net::TcpSocket::new_v6()
        }
        .map_err(|e| Error::io("creating a socket", &e))?;
        if let Some(n) = cfg.socket_buffer {
            let _ = sock.set_send_buffer_size(n as u32);
            let _ = sock.set_recv_buffer_size(n as u32);
        }
        let stream = sock
            .connect(addr)
            .await
            .map_err(|e| connect_error(&self.name, &e))?;
        let _ = stream.set_nodelay(true);
        let welcome = handshake::client(
            &stream,
            &self.name,
            &self.core.name,
            cfg.secret.as_deref(),
            cfg.connect_timeout,
        )
        .await?;
        *self.table.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(welcome.table);
        let cma = match cfg.same_host {
            SameHost::Off => {
                *lock(&self.path) = Some("tcp (same_host=off)".to_owned());
                false
            }
            mode => {
                match handshake::offer_same_host(&stream, &self.name, cfg.connect_timeout).await? {
                    handshake::SameHostVerdict::Cma => {
                        *lock(&self.path) = Some("cma".to_owned());
                        true
                    }
                    handshake::SameHostVerdict::Refused(reason) => {
                        tracing::debug!(peer = %self.name, %reason, "same-host path not used");
                        *lock(&self.path) = Some(format!("tcp ({reason})"));
                        if mode == SameHost::Cma {
                            return Err(Error::SegmentUnavailable {
                                name: self.name.clone(),
                                reason: format!("same_host=cma, but the path is refused: {reason}"),
                            });
                        }
                        false
                    }
                }
            }
        };
        let shared = Arc::new(ConnShared {
            stream,
            peer: self.name.clone(),
            pending: Mutex::new(PendingMap::default()),
            write_lock: tokio::sync::Mutex::new(()),
            next_id: AtomicU64::new(1),
            dead: AtomicBool::new(false),
            retired: AtomicBool::new(false),
            pace: Pace {
                stall: cfg.stall_timeout,
                min_rate: cfg.min_rate,
            },
            born: Instant::now(),
            last_rx: AtomicU64::new(0),
            cma,
        });
        // Retire idle connections well before the target's idle deadline.
        let idle = welcome.idle.map(|d| d / 2);
        let reader = tokio::spawn(reader_task(
            Arc::clone(&shared),
            cfg.spin,
            cfg.spin_pending,
            idle,
        ))
        .abort_handle();
        Ok(Conn { shared, reader })
    }

    /// Sends `ops` on connection slot `c` (connecting if needed; a
    /// connection retired for idleness is replaced). Returns the
    /// connection they went out on, or `None` if they failed up front.
    async fn send_on(
        &self,
        c: usize,
        state: &Arc<WireOps>,
        mut ops: Vec<OutOp>,
    ) -> Option<Arc<ConnShared>> {
        for _ in 0..3 {
            match self.conn(c).await {
                Ok(conn) => match send_ops(&conn, state, ops).await {
                    Ok(()) => return Some(conn),
                    Err(back) => ops = back,
                },
                Err(e) => {
                    fail_ops(state, &ops, &e);
                    return None;
                }
            }
        }
        let e = Error::PeerLost {
            peer: self.name.clone(),
            reason: "every new connection was retired before use".to_owned(),
        };
        fail_ops(state, &ops, &e);
        None
    }

    /// Asks the target for its current region table and caches it.
    async fn refresh_table(&self) -> Result<()> {
        let state = WireOps::new(1);
        state.arm(&[1]);
        let ops = vec![OutOp {
            index: 0,
            kind: OutKind::Table(Arc::clone(&self.table)),
        }];
        let conns: Vec<_> = self.send_on(0, &state, ops).await.into_iter().collect();
        self.await_state(&state, &conns, 0).await;
        state
            .results()
            .pop()
            .unwrap_or_else(|| Err(Error::Canceled("no result".into())))
    }

    /// Waits for `state`, which moves `bytes`, within `request_timeout +
    /// bytes / min_rate`; on expiry only its requests fail, with
    /// [`Error::Timeout`] (a connection is dropped only if the peer has
    /// been silent for `request_timeout`).
    async fn await_state(&self, state: &Arc<WireOps>, conns: &[Arc<ConnShared>], bytes: u64) {
        let cfg = &self.core.config;
        let t = cfg.deadline_for(cfg.request_timeout, bytes);
        if tokio::time::timeout(t, state.wait()).await.is_err() {
            let err = Error::Timeout {
                operation: format!("a batch of {bytes} bytes"),
                peer: Some(self.name.clone()),
                after: t,
            };
            for c in conns {
                c.abandon(state, &err, cfg.request_timeout);
            }
            // What is left is a payload being received right now, which
            // the minimum rate bounds.
            state.wait().await;
        }
    }

    /// Delivers a notification (after the batch it follows has landed).
    async fn notify(&self, n: &Notification) -> Result<()> {
        let state = WireOps::new(1);
        state.arm(&[1]);
        let mut bytes = Vec::with_capacity(n.name.len() + n.message.len());
        bytes.extend_from_slice(n.name.as_bytes());
        bytes.extend_from_slice(n.message.as_bytes());
        let size = bytes.len() as u64;
        let ops = vec![OutOp {
            index: 0,
            kind: OutKind::Notify {
                bytes,
                name_len: n.name.len() as u64,
            },
        }];
        let conns: Vec<_> = self.send_on(0, &state, ops).await.into_iter().collect();
        self.await_state(&state, &conns, size).await;
        state
            .results()
            .pop()
            .unwrap_or_else(|| Err(Error::Canceled("no result".into())))
    }

    /// Runs a batch: validates every request locally and against the
    /// peer's table, sends the valid ones (chunked, spread over the
    /// connections), reports each request's outcome to `driver` as its
    /// last wire operation completes, then hands `notify` to the peer if
    /// every request succeeded and finishes the batch with the
    /// notification's outcome (a failed notification fails the last
    /// request; see [`BatchDriver::finish`]). Requests the target refused
    /// because their region was registered again since the table used (a
    /// different generation) are retried once with a fresh table.
    ///
    /// Dropped before it returns, the batch is canceled by the driver's
    /// rules (unreported requests fail [`Error::Canceled`]).
    pub async fn run_batch(
        self: &Arc<Self>,
        requests: &[TransferRequest],
        notify: Option<&Notification>,
        driver: &BatchDriver,
    ) -> Result<transport_core::BatchReport> {
        let ops = WireOps::reporting(driver);
        self.transfer_all(requests, &ops).await;
        let stale = ops.stale();
        if !stale.is_empty() {
            match self.refresh_table().await {
                Ok(()) => {
                    let retry: Vec<TransferRequest> = stale.iter().map(|&i| requests[i]).collect();
                    let sub = WireOps::retrying(driver, stale);
                    self.transfer_all(&retry, &sub).await;
                }
                Err(e) => {
                    for i in stale {
                        driver.complete(i, Err(e.clone()));
                    }
                }
            }
        }
        let notified = match notify {
            Some(n) if driver.all_ok() => Some(self.notify(n).await),
            _ => None,
        };
        driver.finish(notified)
    }

    /// One pass of [`Peer::run_batch`] without the notification.
    async fn transfer_all(self: &Arc<Self>, requests: &[TransferRequest], state: &Arc<WireOps>) {
        let chunk = self.core.config.chunk_size as u64;
        let mut guards: Vec<Option<Arc<RegionGuard>>> = Vec::with_capacity(requests.len());
        let mut remote_miss = Vec::new();
        let table = self.table();
        for (i, r) in requests.iter().enumerate() {
            if r.len == 0 {
                guards.push(None);
                continue;
            }
            match self
                .core
                .regions
                .acquire(r.local_addr, r.len, Side::Local, None)
            {
                Ok(g) => {
                    if table_lookup(&table, r.remote_addr, r.len).is_none() {
                        remote_miss.push(i);
                    }
                    guards.push(Some(Arc::new(g)));
                }
                Err(e) => {
                    state.fail_unsent(i, e);
                    guards.push(None);
                }
            }
        }
        if !remote_miss.is_empty() {
            // The cached table may be stale (regions registered since the
            // handshake): refresh once, then refuse what is still outside.
            let refreshed = self.refresh_table().await;
            let table = self.table();
            for i in remote_miss {
                let r = &requests[i];
                let err = match &refreshed {
                    Err(e) => Some(e.clone()),
                    Ok(()) if table_lookup(&table, r.remote_addr, r.len).is_none() => {
                        Some(Error::AddressNotRegistered {
                            side: Side::Remote,
                            addr: r.remote_addr,
                            len: r.len,
                            peer: Some(self.name.clone()),
                        })
                    }
                    Ok(()) => None,
                };
                if let Some(e) = err {
                    state.fail_unsent(i, e);
                    guards[i] = None;
                }
            }
        }
        // The generation each request's remote range is in, from the
        // table as it is now (frames carry it; the target refuses a frame
        // whose region was registered again since).
        let table = self.table();
        // Plan the wire operations.
        let n_conns = self.slots.len();
        let mut per_conn: Vec<Vec<OutOp>> = (0..n_conns).map(|_| Vec::new()).collect();
        let mut counts = vec![0u32; requests.len()];
        let mut bytes = 0u64;
        // Requests that fit in one chunk all go to connection 0: in order,
        // pipelined, and the other connections stay idle (and do not poll)
        // unless large requests are split over them.
        let home = 0;
        // Small writes (reads) are gathered into WRITEV (READV) frames: one
        // system call on the target for all of them.
        let mut groups: [(Vec<Part>, u64); 2] = [(Vec::new(), 0), (Vec::new(), 0)];
        let flush = |g: &mut (Vec<Part>, u64), read: bool, out: &mut Vec<OutOp>| {
            g.1 = 0;
            match g.0.len() {
                0 => {}
                1 => {
                    if let Some((index, guard, off, len, remote, gen)) = g.0.pop() {
                        let kind = if read {
                            OutKind::Read {
                                guard,
                                off,
                                len,
                                remote,
                                gen,
                            }
                        } else {
                            OutKind::Write {
                                guard,
                                off,
                                len,
                                remote,
                                gen,
                            }
                        };
                        out.push(OutOp { index, kind });
                    }
                }
                _ => {
                    let parts = std::mem::take(&mut g.0);
                    let index = parts[0].0;
                    let kind = if read {
                        OutKind::ReadV(parts)
                    } else {
                        OutKind::WriteV(parts)
                    };
                    out.push(OutOp { index, kind });
                }
            }
        };
        for (i, (r, g)) in requests.iter().zip(&guards).enumerate() {
            let Some(g) = g else { continue };
            let Some(gen) = table_lookup(&table, r.remote_addr, r.len) else {
                // The table changed under a concurrent refresh.
                state.fail_unsent(
                    i,
                    Error::AddressNotRegistered {
                        side: Side::Remote,
                        addr: r.remote_addr,
                        len: r.len,
                        peer: Some(self.name.clone()),
                    },
                );
                continue;
            };
            bytes += r.len;
            if r.len <= GATHER_MAX_SEGMENT.min(chunk) {
                let read = r.op == TransferOp::Read;
                let grp = &mut groups[read as usize];
                if grp.0.len() == MAX_SEGMENTS as usize || grp.1 + r.len > GATHER_MAX_BYTES {
                    flush(grp, read, &mut per_conn[home]);
                }
                grp.0.push((i, Arc::clone(g), 0, r.len, r.remote_addr, gen));
                grp.1 += r.len;
                counts[i] += 1;
                continue;
            }
            let mut off = 0;
            while off < r.len {
                let len = chunk.min(r.len - off);
                let kind = match r.op {
                    TransferOp::Write => OutKind::Write {
                        guard: Arc::clone(g),
                        off,
                        len,
                        remote: r.remote_addr + off,
                        gen,
                    },
                    TransferOp::Read => OutKind::Read {
                        guard: Arc::clone(g),
                        off,
                        len,
                        remote: r.remote_addr + off,
                        gen,
                    },
                };
                // Chunks of requests larger than one chunk are spread.
                let c = if n_conns == 1 || r.len <= chunk {
                    home
                } else {
                    self.rr.fetch_add(1, Ordering::Relaxed) % n_conns
                };
                if c == home {
                    // Keep the order of requests on the home connection.
                    let [w, rd] = &mut groups;
                    flush(w, false, &mut per_conn[home]);
                    flush(rd, true, &mut per_conn[home]);
                }
                per_conn[c].push(OutOp { index: i, kind });
                counts[i] += 1;
                off += len;
            }
        }
        {
            let [w, rd] = &mut groups;
            flush(w, false, &mut per_conn[home]);
            flush(rd, true, &mut per_conn[home]);
        }
        drop(guards);
        state.arm(&counts);
        let used: Vec<usize> = (0..n_conns).filter(|c| !per_conn[*c].is_empty()).collect();
        let mut conns = Vec::with_capacity(used.len());
        if used.len() == 1 {
            let c = used[0];
            let ops = std::mem::take(&mut per_conn[c]);
            conns.extend(self.send_on(c, state, ops).await);
        } else if !used.is_empty() {
            let sends = used.iter().map(|&c| {
                let ops = std::mem::take(&mut per_conn[c]);
                self.send_on(c, state, ops)
            });
            conns.extend(futures::future::join_all(sends).await.into_iter().flatten());
        }
        self.await_state(state, &conns, bytes).await;
    }
}

fn fail_ops(state: &WireOps, ops: &[OutOp], e: &Error) {
    for op in ops {
        op.fail(state, e);
    }
}

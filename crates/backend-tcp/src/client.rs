//! The initiator side: peers, their connections, request pipelining and
//! batch bookkeeping.
//!
//! Callers write their frames themselves (header and payload from registered
//! memory in one `writev`), under a per-connection write lock. One reader
//! task per connection reads responses and completes requests; READ payloads
//! go from the socket straight into the destination region, which a
//! [`RegionGuard`] keeps registered until the request completes.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use socket2::SockRef;
use tokio::net::TcpStream;
use tokio::sync::Notify;
use tokio::task::AbortHandle;
use transport_core::{
    Error, Notification, RegionGuard, Result, Side, TransferOp, TransferRequest, TransferState,
};

use crate::frame::{
    decode_ids, decode_table, table_contains, Request, Response, Status, MAX_ACKS, MAX_SEGMENTS,
};
use crate::handshake;
use crate::io::{write_all, Bytes, FrameReader, Next};
use crate::server::{lock, Core};

/// Requests up to this size are gathered into WRITEV / READV frames.
const GATHER_MAX_SEGMENT: u64 = 64 * 1024;
/// Most payload bytes per WRITEV / READV frame.
const GATHER_MAX_BYTES: u64 = 4 << 20;

/// Outcome bookkeeping of one batch (or one control request).
#[derive(Debug)]
pub struct BatchState {
    slots: Mutex<Vec<Slot>>,
    remaining: AtomicUsize,
    done: Notify,
}

#[derive(Debug, Default, Clone)]
struct Slot {
    left: u32,
    err: Option<Error>,
}

impl BatchState {
    /// State for `n` requests, none of them started.
    pub fn new(n: usize) -> Arc<Self> {
        Arc::new(BatchState {
            // Every request counts as pending until `arm`.
            slots: Mutex::new(vec![Slot { left: 1, err: None }; n]),
            // Held at 1 until `arm` sets the real count.
            remaining: AtomicUsize::new(1),
            done: Notify::new(),
        })
    }

    /// Sets each request's number of wire operations; must be called once
    /// before any operation is sent.
    fn arm(&self, ops_per_request: &[u32]) {
        let mut slots = lock(&self.slots);
        let mut total = 0usize;
        for (s, &n) in slots.iter_mut().zip(ops_per_request) {
            s.left = n;
            total += n as usize;
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
                s.left = s.left.saturating_sub(1);
                if let Err(e) = r {
                    s.err.get_or_insert(e);
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

    /// Each request's state right now.
    pub fn states(&self) -> Vec<TransferState> {
        lock(&self.slots)
            .iter()
            .map(|s| match (&s.err, s.left) {
                (_, l) if l > 0 => TransferState::Pending { transferred: 0 },
                (Some(e), _) => TransferState::Failed(e.clone()),
                (None, _) => TransferState::Completed,
            })
            .collect()
    }

    /// Overrides the result of request `index` (notification failures).
    pub fn set_error(&self, index: usize, err: Error) {
        if let Some(s) = lock(&self.slots).get_mut(index) {
            s.err = Some(err);
        }
    }
}

/// The cached region table of a peer.
type TableCache = RwLock<Arc<Vec<(u64, u64)>>>;

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
}

struct PendingOp {
    batch: Arc<BatchState>,
    index: usize,
    kind: PendingKind,
}

impl PendingOp {
    /// Completes the operation (every segment of a WRITEV) with `r`.
    fn complete(self, r: Result<()>) {
        match &self.kind {
            PendingKind::WriteV { parts, .. } => {
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
    timeout: Duration,
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
                after: self.timeout,
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
            Status::NotifyQueueFull => Error::Backend {
                backend: "tcp".to_owned(),
                operation: "notify".to_owned(),
                code: status as i64,
                name: format!("notification queue of {} is full", self.peer),
            },
            Status::ShuttingDown => Error::PeerLost {
                peer: self.peer.clone(),
                reason: "the peer is shutting down".to_owned(),
            },
            other => self.protocol(format!("peer reported {other:?}")),
        }
    }

    /// Completes `id` with a plain acknowledgement.
    fn ack(&self, id: u64, r: Result<()>) -> Result<()> {
        let op = self
            .take(id)
            .ok_or_else(|| self.protocol(format!("response for unknown request id {id}")))?;
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
        op.complete(r);
        Ok(())
    }
}

async fn reader_task(conn: Arc<ConnShared>, spin: Duration, spin_pending: Duration) {
    let err = match reader_loop(&conn, spin, spin_pending).await {
        Ok(()) => Error::PeerLost {
            peer: conn.peer.clone(),
            reason: "the peer closed the connection".to_owned(),
        },
        Err(e) => e,
    };
    tracing::debug!(peer = %conn.peer, error = %err, "connection closed");
    conn.fail_all(err);
}

async fn reader_loop(conn: &ConnShared, spin: Duration, spin_pending: Duration) -> Result<()> {
    let mut rd = FrameReader::new(spin, conn.timeout);
    let mut ids = vec![0u8; MAX_ACKS as usize * 8];
    let stream = &conn.stream;
    let spin_pending = spin_pending.max(spin);
    loop {
        // Poll longer while responses are expected.
        let busy = !lock(&conn.pending).ops.is_empty();
        rd.set_spin(if busy { spin_pending } else { spin });
        let hdr = match rd.next_header(stream).await.map_err(|e| conn.lost(&e))? {
            Next::Header(h) => h,
            Next::Eof => return Ok(()),
        };
        let resp = Response::decode(&hdr).map_err(|e| conn.protocol(e.0))?;
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
            } => conn.ack(id, Err(conn.status_error(status, addr, len)))?,
            Response::Data { id, len } => {
                let op = conn
                    .take(id)
                    .ok_or_else(|| conn.protocol(format!("DATA for unknown request id {id}")))?;
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
                let op = conn
                    .take(id)
                    .ok_or_else(|| conn.protocol(format!("DATAV for unknown request id {id}")))?;
                let PendingKind::ReadV { parts, .. } = &op.kind else {
                    let err = conn.protocol(format!("DATAV for request {id}, not a READV"));
                    op.complete(Err(err.clone()));
                    return Err(err);
                };
                let buf = &mut ids[..failed as usize * 4];
                // The indices end the frame only if no data follows.
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
                let op = conn
                    .take(id)
                    .ok_or_else(|| conn.protocol(format!("ERRV for unknown request id {id}")))?;
                let PendingKind::WriteV { parts, .. } = &op.kind else {
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
                        Err(conn.status_error(status, *addr, *len))
                    } else {
                        Ok(())
                    };
                    op.batch.complete(*index, r);
                }
            }
            Response::Table { id, count } => {
                // Bounded by the decoder (≤ 65,536 entries, 1 MiB).
                let mut raw = vec![0u8; count as usize * 16];
                rd.read_payload(stream, Bytes::from_mut(&mut raw))
                    .await
                    .map_err(|e| conn.lost(&e))?;
                let table = decode_table(&raw).map_err(|e| conn.protocol(e.0))?;
                let op = conn
                    .take(id)
                    .ok_or_else(|| conn.protocol(format!("TABLE for unknown request id {id}")))?;
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
    },
    Read {
        guard: Arc<RegionGuard>,
        off: u64,
        len: u64,
        remote: u64,
    },
    Notify {
        bytes: Vec<u8>,
        name_len: u64,
    },
    Table(Arc<TableCache>),
    /// Small writes sent as one WRITEV frame: `(request index, source
    /// guard, offset in it, len, remote addr)` per segment.
    WriteV(Vec<(usize, Arc<RegionGuard>, u64, u64, u64)>),
    /// Small reads sent as one READV frame, same layout.
    ReadV(Vec<(usize, Arc<RegionGuard>, u64, u64, u64)>),
}

/// The segment table of a WRITEV/READV frame (`remote addr, len` per
/// segment, little-endian) and the segments' total length.
fn segment_table(parts: &[(usize, Arc<RegionGuard>, u64, u64, u64)]) -> (Vec<u8>, u64) {
    let mut table = Vec::with_capacity(parts.len() * 16);
    let mut total = 0;
    for (_, _, _, len, remote) in parts {
        table.extend_from_slice(&remote.to_le_bytes());
        table.extend_from_slice(&len.to_le_bytes());
        total += len;
    }
    (table, total)
}

struct OutOp {
    index: usize,
    kind: OutKind,
}

impl OutOp {
    /// Fails the operation (every segment of a WRITEV) before it was sent.
    fn fail(&self, batch: &BatchState, e: &Error) {
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
/// calls as possible. Failures complete the operations with an error.
async fn send_ops(conn: &ConnShared, batch: &Arc<BatchState>, ops: Vec<OutOp>) {
    let mut hdrs = Vec::with_capacity(ops.len());
    let mut ids = Vec::with_capacity(ops.len());
    // Segment tables of WRITEV frames, in frame order.
    let mut tables: Vec<Vec<u8>> = Vec::new();
    {
        let mut map = lock(&conn.pending);
        if let Some(e) = map.closed.clone() {
            drop(map);
            for op in &ops {
                op.fail(batch, &e);
            }
            return;
        }
        for op in &ops {
            let id = conn.next_id.fetch_add(1, Ordering::Relaxed);
            ids.push(id);
            let (req, kind) = match &op.kind {
                OutKind::Write {
                    guard,
                    len,
                    remote: addr,
                    ..
                } => (
                    Request::Write {
                        id,
                        addr: *addr,
                        len: *len,
                    },
                    PendingKind::Write(Arc::clone(guard)),
                ),
                OutKind::Read {
                    guard,
                    off,
                    len,
                    remote,
                } => (
                    Request::Read {
                        id,
                        addr: *remote,
                        len: *len,
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
        match &op.kind {
            OutKind::WriteV(parts) => {
                if let Some(t) = tables.next() {
                    bufs.push(Bytes::from_ref(t));
                }
                for (_, guard, off, len, _) in parts {
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
    let res = write_all(&conn.stream, &bufs, conn.timeout).await;
    poison.0 = None;
    if let Err(e) = res {
        conn.fail_all(conn.lost(&e));
    }
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
        })
    }

    /// Closes every connection (pending requests fail with `Canceled`).
    pub fn close(&self) {
        for s in &self.slots {
            s.cur.write().unwrap_or_else(|p| p.into_inner()).take();
        }
    }

    fn table(&self) -> Arc<Vec<(u64, u64)>> {
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
        let shared = Arc::new(ConnShared {
            stream,
            peer: self.name.clone(),
            pending: Mutex::new(PendingMap::default()),
            write_lock: tokio::sync::Mutex::new(()),
            next_id: AtomicU64::new(1),
            dead: AtomicBool::new(false),
            timeout: cfg.request_timeout,
        });
        let reader = tokio::spawn(reader_task(Arc::clone(&shared), cfg.spin, cfg.spin_pending))
            .abort_handle();
        Ok(Conn { shared, reader })
    }

    /// Asks the target for its current region table and caches it.
    async fn refresh_table(&self) -> Result<()> {
        let state = BatchState::new(1);
        state.arm(&[1]);
        let conn = match self.conn(0).await {
            Ok(c) => c,
            Err(e) => return Err(e),
        };
        send_ops(
            &conn,
            &state,
            vec![OutOp {
                index: 0,
                kind: OutKind::Table(Arc::clone(&self.table)),
            }],
        )
        .await;
        self.await_state(&state, &[conn]).await;
        state
            .results()
            .pop()
            .unwrap_or_else(|| Err(Error::Canceled("no result".into())))
    }

    /// Waits for `state` within the request timeout; on expiry the
    /// connections involved are dropped and their requests fail with
    /// [`Error::Timeout`].
    async fn await_state(&self, state: &BatchState, conns: &[Arc<ConnShared>]) {
        let t = self.core.config.request_timeout;
        if tokio::time::timeout(t, state.wait()).await.is_err() {
            for c in conns {
                c.fail_all(Error::Timeout {
                    operation: "transfer".to_owned(),
                    peer: Some(self.name.clone()),
                    after: t,
                });
            }
            state.wait().await;
        }
    }

    /// Delivers a notification (after the batch it follows has landed).
    async fn notify(&self, n: &Notification) -> Result<()> {
        let state = BatchState::new(1);
        state.arm(&[1]);
        let conn = self.conn(0).await?;
        let mut bytes = Vec::with_capacity(n.name.len() + n.message.len());
        bytes.extend_from_slice(n.name.as_bytes());
        bytes.extend_from_slice(n.message.as_bytes());
        send_ops(
            &conn,
            &state,
            vec![OutOp {
                index: 0,
                kind: OutKind::Notify {
                    bytes,
                    name_len: n.name.len() as u64,
                },
            }],
        )
        .await;
        self.await_state(&state, &[conn]).await;
        state
            .results()
            .pop()
            .unwrap_or_else(|| Err(Error::Canceled("no result".into())))
    }

    /// Runs a batch: validates every request locally and against the
    /// peer's table, sends the valid ones (chunked, spread over the
    /// connections), waits for them, then sends `notify` if all succeeded.
    /// Results land in `state` (which has `requests.len()` slots); a failed
    /// notification becomes the last request's error, or the `Err` returned
    /// for an empty batch.
    pub async fn run_batch(
        self: &Arc<Self>,
        requests: &[TransferRequest],
        notify: Option<&Notification>,
        state: &Arc<BatchState>,
    ) -> Result<()> {
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
                    if !table_contains(&table, r.remote_addr, r.len) {
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
                    Ok(()) if !table_contains(&table, r.remote_addr, r.len) => {
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
        // Plan the wire operations.
        let n_conns = self.slots.len();
        let mut per_conn: Vec<Vec<OutOp>> = (0..n_conns).map(|_| Vec::new()).collect();
        let mut counts = vec![0u32; requests.len()];
        // Requests that fit in one chunk all go to connection 0: in order,
        // pipelined, and the other connections stay idle (and do not poll)
        // unless large requests are split over them.
        let home = 0;
        // Small writes (reads) are gathered into WRITEV (READV) frames: one
        // system call on the target for all of them.
        type Group = Vec<(usize, Arc<RegionGuard>, u64, u64, u64)>;
        let mut groups: [(Group, u64); 2] = [(Vec::new(), 0), (Vec::new(), 0)];
        let flush = |g: &mut (Group, u64), read: bool, out: &mut Vec<OutOp>| {
            g.1 = 0;
            match g.0.len() {
                0 => {}
                1 => {
                    if let Some((index, guard, off, len, remote)) = g.0.pop() {
                        let kind = if read {
                            OutKind::Read {
                                guard,
                                off,
                                len,
                                remote,
                            }
                        } else {
                            OutKind::Write {
                                guard,
                                off,
                                len,
                                remote,
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
            if r.len <= GATHER_MAX_SEGMENT.min(chunk) {
                let read = r.op == TransferOp::Read;
                let grp = &mut groups[read as usize];
                if grp.0.len() == MAX_SEGMENTS as usize || grp.1 + r.len > GATHER_MAX_BYTES {
                    flush(grp, read, &mut per_conn[home]);
                }
                grp.0.push((i, Arc::clone(g), 0, r.len, r.remote_addr));
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
                    },
                    TransferOp::Read => OutKind::Read {
                        guard: Arc::clone(g),
                        off,
                        len,
                        remote: r.remote_addr + off,
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
            match self.conn(c).await {
                Ok(conn) => {
                    send_ops(&conn, state, ops).await;
                    conns.push(conn);
                }
                Err(e) => fail_ops(state, &ops, &e),
            }
        } else if !used.is_empty() {
            let sends = used.iter().map(|&c| {
                let ops = std::mem::take(&mut per_conn[c]);
                async move {
                    match self.conn(c).await {
                        Ok(conn) => {
                            send_ops(&conn, state, ops).await;
                            Some(conn)
                        }
                        Err(e) => {
                            fail_ops(state, &ops, &e);
                            None
                        }
                    }
                }
            });
            conns.extend(futures::future::join_all(sends).await.into_iter().flatten());
        }
        self.await_state(state, &conns).await;
        if let Some(n) = notify {
            let results = state.results();
            if results.iter().all(Result::is_ok) {
                if let Err(e) = self.notify(n).await {
                    match results.len() {
                        0 => return Err(e),
                        len => state.set_error(len - 1, e),
                    }
                }
            }
        }
        Ok(())
    }
}

fn fail_ops(state: &BatchState, ops: &[OutOp], e: &Error) {
    for op in ops {
        op.fail(state, e);
    }
}

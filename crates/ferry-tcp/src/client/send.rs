//! Frames out: the operations a batch is planned into, their encoding
//! (WRITE / READ / WRITEV / READV, or CWRITE / CREAD on the same-host
//! path), and sending them on a connection in as few system calls as
//! possible.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use ferry_core::__private::sync::lock;
use ferry_core::{Error, RegionGuard};

use super::conn::{ClientStage, ConnShared, PendingKind, PendingOp, TableCache};
use super::wire_ops::WireOps;
use crate::frame::{encode_cma_segments, encode_segments, CmaSegment, Request, Segment};
use crate::io::{write_all, Bytes};
use crate::same_host::stage;
use ferry_tcp_proto::initiator::{window_until, Slicing};

// The long sends' slices and window (`FAIR_SLICE`, `FAIR_WINDOW`) are the
// core's (`ferry_tcp_proto::initiator`): a small call issued beside a
// 16 MiB batch waits for one 1 MiB slice (and what the socket buffers
// hold), not for the whole batch; four slices may be unanswered (two
// served the small calls a little better but made the batch, waiting for a
// wake-up per slice on a busy host, take twice as long: figures in
// crates/ferry-tcp/BENCHMARKS.md). The same-host path keeps its frames
// together (the staging area's streams follow the frame order).

/// If a send is abandoned before it started writing (its caller was
/// dropped while waiting for the write lock), withdraws its operations so
/// that they release their region guards at once.
///
/// And writes the small calls queued meanwhile (`send_combined`): the
/// lock may have been handed to this caller by a holder that then found
/// it taken and left the queue to it.
pub(crate) struct Unsent<'a> {
    conn: &'a Arc<ConnShared>,
    ids: Option<&'a [u64]>,
}

impl Drop for Unsent<'_> {
    fn drop(&mut self) {
        let Some(ids) = self.ids.take() else { return };
        let ops: Vec<PendingOp> = {
            let mut map = lock(&self.conn.pending);
            map.withdraw(ids)
        };
        for op in ops {
            op.complete(Err(Error::Canceled(
                "the transfer was abandoned".to_owned(),
            )));
        }
        if !lock(&self.conn.outbox).is_empty() {
            // Dropped on a thread outside any runtime too (a future moved
            // there): the connection's own runtime runs the task.
            let rt = tokio::runtime::Handle::try_current().unwrap_or_else(|_| self.conn.rt.clone());
            let conn = Arc::clone(self.conn);
            rt.spawn(async move { drain_outbox(&conn).await });
        }
    }
}

/// Marks a connection dead if a send is interrupted half-way (the stream
/// would hold a partial frame).
pub(crate) struct PoisonOnDrop<'a>(Option<&'a ConnShared>);

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
pub(crate) enum OutKind {
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

/// One segment of a WRITEV/READV (or of a CWRITE/CREAD), as the core
/// plans it: its request, the guard that keeps its local range registered
/// while in flight (`hold`), where it starts there, its length, the peer's
/// address and the generation of the peer's region.
pub(crate) type Part = ferry_tcp_proto::batch::Part<Arc<RegionGuard>>;

/// The segment table of a WRITEV/READV frame and the segments' total
/// length.
pub(crate) fn segment_table(parts: &[Part]) -> (Vec<u8>, u64) {
    let segs: Vec<Segment> = parts
        .iter()
        .map(|p| Segment {
            addr: p.remote,
            len: p.len,
            gen: p.gen,
        })
        .collect();
    (encode_segments(&segs), parts.iter().map(|p| p.len).sum())
}

/// One planned wire operation.
pub(crate) struct OutOp {
    /// Its request (the first one for a gathered frame).
    pub(crate) index: usize,
    /// The frame.
    pub(crate) kind: OutKind,
}

impl OutOp {
    /// A frame as the core planned it.
    pub(crate) fn from_frame(f: ferry_tcp_proto::batch::Frame<Arc<RegionGuard>>) -> OutOp {
        use ferry_tcp_proto::batch::Frame;
        match f {
            Frame::Write(p) => OutOp {
                index: p.index,
                kind: OutKind::Write {
                    guard: p.hold,
                    off: p.off,
                    len: p.len,
                    remote: p.remote,
                    gen: p.gen,
                },
            },
            Frame::Read(p) => OutOp {
                index: p.index,
                kind: OutKind::Read {
                    guard: p.hold,
                    off: p.off,
                    len: p.len,
                    remote: p.remote,
                    gen: p.gen,
                },
            },
            Frame::WriteV(parts) => OutOp {
                index: parts.first().map_or(0, |p| p.index),
                kind: OutKind::WriteV(parts),
            },
            Frame::ReadV(parts) => OutOp {
                index: parts.first().map_or(0, |p| p.index),
                kind: OutKind::ReadV(parts),
            },
        }
    }

    /// Whether it moves payload (WRITE, READ, WRITEV, READV).
    pub(crate) fn is_transfer(&self) -> bool {
        matches!(
            self.kind,
            OutKind::Write { .. } | OutKind::Read { .. } | OutKind::WriteV(_) | OutKind::ReadV(_)
        )
    }

    /// The payload bytes of a transfer operation (0 for control ones).
    pub(crate) fn payload_len(&self) -> u64 {
        match &self.kind {
            OutKind::Write { len, .. } | OutKind::Read { len, .. } => *len,
            OutKind::WriteV(parts) | OutKind::ReadV(parts) => parts.iter().map(|p| p.len).sum(),
            _ => 0,
        }
    }

    /// The segments of a transfer operation as a CWRITE / CREAD sends
    /// them (`true`: a read); `None` for control operations.
    pub(crate) fn cma_parts(&self) -> Option<(bool, Vec<Part>)> {
        match &self.kind {
            OutKind::Write {
                guard,
                off,
                len,
                remote,
                gen,
            } => Some((
                false,
                vec![Part {
                    index: self.index,
                    hold: Arc::clone(guard),
                    off: *off,
                    len: *len,
                    remote: *remote,
                    gen: *gen,
                }],
            )),
            OutKind::Read {
                guard,
                off,
                len,
                remote,
                gen,
            } => Some((
                true,
                vec![Part {
                    index: self.index,
                    hold: Arc::clone(guard),
                    off: *off,
                    len: *len,
                    remote: *remote,
                    gen: *gen,
                }],
            )),
            OutKind::WriteV(parts) => Some((false, parts.clone())),
            OutKind::ReadV(parts) => Some((true, parts.clone())),
            _ => None,
        }
    }

    /// Fails the operation (every segment of a WRITEV) before it was sent.
    pub(crate) fn fail(&self, batch: &WireOps, e: &Error) {
        match &self.kind {
            OutKind::WriteV(parts) | OutKind::ReadV(parts) => {
                for p in parts {
                    batch.complete(p.index, Err(e.clone()));
                }
            }
            _ => batch.complete(self.index, Err(e.clone())),
        }
    }
}

/// `len` bytes at `off` in the range `guard` holds, for sendmsg(2).
pub(crate) fn source(guard: &RegionGuard, off: u64, len: u64) -> Bytes<'static> {
    // SAFETY: the guard (held by the operation until it completes, and in
    // `ops` until `send_ops` returns) keeps the local region registered and
    // valid; `off + len` lies inside the guarded range (the request was
    // checked against it when planned). Only sendmsg(2) reads it.
    unsafe { Bytes::from_raw(guard.as_ptr().wrapping_add(off as usize), len as usize) }
}

/// Registers `ops` as pending on `conn` and writes them in as few system
/// calls as possible. Failures complete the operations with an error; a
/// connection this side retired for idleness hands them back untouched.
pub(crate) async fn send_ops(
    conn: &Arc<ConnShared>,
    batch: &Arc<WireOps>,
    ops: Vec<OutOp>,
) -> std::result::Result<(), Vec<OutOp>> {
    // Whether this call's frames below the kernel-copy size may go through
    // the area now (`crate::same_host::choice`): all or none of them.
    let stage_now = stage_now(conn, &ops);
    // Small calls, and long ones while the area is avoided, as granted
    // copies where the target granted them.
    let ops = copy_granted(conn, batch, ops, stage_now).await;
    if ops.is_empty() {
        return Ok(());
    }
    let mut framed = {
        let mut map = lock(&conn.pending);
        if let Some(e) = map.closed().cloned() {
            drop(map);
            if conn.retired.load(Ordering::Acquire) {
                return Err(ops);
            }
            fail_ops(batch, &ops, &e);
            return Ok(());
        }
        frame_ops(conn, batch, &ops, stage_now, &mut map)
    };
    for op in std::mem::take(&mut framed.refused) {
        op.complete(Err(Error::Canceled(format!(
            "connection to {} closed",
            conn.peer
        ))));
    }
    let (bufs, cuts, slicing) = frame_bufs(conn, &framed, &ops);
    let frame_bytes: usize = bufs.iter().map(Bytes::len).sum();
    if cuts.len() == 1 && framed.staging.is_empty() && frame_bytes <= COMBINE_MAX && !conn.cma {
        send_combined(conn, &bufs, frame_bytes).await;
        return Ok(());
    }
    let Some((w, mut poison)) = write_slices(conn, batch, &framed.ids, &bufs, &cuts, slicing).await
    else {
        return Ok(());
    };
    if let (false, Some(st)) = (framed.staging.is_empty(), &conn.stage) {
        // In frame order: the next sender waits for this cursor after us.
        let mut cursor = st.cursor.lock().await;
        drop(w);
        move_after_frames(conn, batch, st, &mut cursor, &framed.staging).await;
    } else {
        poison.0 = None;
        // Frames queued while we wrote go now (none are queued on a
        // same-host connection, the only kind with staged bytes).
        write_queued(conn, w, &[]).await;
        return Ok(());
    }
    poison.0 = None;
    Ok(())
}

/// Whether this call's frames below the kernel-copy size may go through
/// the staging area now (`crate::same_host::choice`).
fn stage_now(conn: &ConnShared, ops: &[OutOp]) -> bool {
    conn.stage.as_ref().is_some_and(|st| {
        let parallel = crate::same_host::cma::PARALLEL_MIN as u64;
        let bytes = ops
            .iter()
            .map(OutOp::payload_len)
            .filter(|&n| n < parallel)
            .sum();
        let peer_slept = st.area.target_slept().load(Ordering::Relaxed);
        st.choice.stage(bytes, peer_slept)
    })
}

/// The frames of one call, registered as pending.
struct Framed {
    hdrs: Vec<[u8; crate::frame::HEADER_LEN]>,
    ids: Vec<u64>,
    /// Segment tables of the frames that have one, in frame order.
    tables: Vec<Vec<u8>>,
    /// Streams of the staged frames, in frame order: (read, pieces).
    staging: Vec<(bool, Vec<stage::Piece>)>,
    /// Operations the pending map refused (none: it is open, see
    /// [`frame_ops`]).
    refused: Vec<PendingOp>,
}

/// Registers `ops` as pending in `map` (the connection is open: checked
/// under this lock) and encodes their headers and tables.
fn frame_ops(
    conn: &ConnShared,
    batch: &Arc<WireOps>,
    ops: &[OutOp],
    stage_now: bool,
    map: &mut super::conn::PendingMap,
) -> Framed {
    let mut f = Framed {
        hdrs: Vec::with_capacity(ops.len()),
        ids: Vec::with_capacity(ops.len()),
        tables: Vec::new(),
        staging: Vec::new(),
        refused: Vec::new(),
    };
    for op in ops {
        let id = conn.next_id.fetch_add(1, Ordering::Relaxed);
        f.ids.push(id);
        // Transfers go as CWRITE / CREAD (or staged) on the same-host path.
        let cma = if conn.cma { op.cma_parts() } else { None };
        let (req, kind) = match cma {
            Some((read, parts)) => cma_frame(conn, id, read, &parts, stage_now, &mut f),
            None => socket_frame(op, id, &mut f.tables),
        };
        f.hdrs.push(req.encode());
        let pending = PendingOp {
            batch: Arc::clone(batch),
            index: op.index,
            kind,
        };
        if let Err(op) = map.insert(id, pending) {
            // Never: the connection was open, under this lock. Failed, not
            // dropped, if it were not.
            f.refused.push(op);
        }
    }
    f
}

/// A transfer on the same-host path: CWRITE / CREAD, or SWRITE / SREAD
/// (its stream added to `f.staging`) if the area takes its size now.
fn cma_frame(
    conn: &ConnShared,
    id: u64,
    read: bool,
    parts: &[Part],
    stage_now: bool,
    f: &mut Framed,
) -> (Request, PendingKind) {
    let total: u64 = parts.iter().map(|p| p.len).sum();
    let staged = conn.stage.as_ref().is_some_and(|st| {
        total >= st.min as u64
            && (total < crate::same_host::cma::PARALLEL_MIN as u64
                || crate::same_host::cma::helpers() == 0)
            && stage_now
    });
    if staged {
        f.staging.push((
            read,
            parts
                .iter()
                .map(|p| stage::Piece {
                    ptr: p.hold.as_ptr().wrapping_add(p.off as usize),
                    len: p.len as usize,
                })
                .collect(),
        ));
    }
    let segs: Vec<CmaSegment> = parts
        .iter()
        .map(|p| CmaSegment {
            seg: Segment {
                addr: p.remote,
                len: p.len,
                gen: p.gen,
            },
            // The target copies through the area: no address of ours.
            local: if staged {
                0
            } else {
                p.hold.as_ptr() as u64 + p.off
            },
        })
        .collect();
    f.tables.push(encode_cma_segments(&segs));
    let req = Request::Cma {
        id,
        read,
        staged,
        count: parts.len() as u32,
        total,
    };
    let kind = PendingKind::Cma {
        parts: parts.iter().map(|p| (p.index, p.remote, p.len)).collect(),
        guards: parts.iter().map(|p| Arc::clone(&p.hold)).collect(),
        // Staged reads are copied by this side.
        target_writes: ferry_tcp_proto::initiator::target_writes(read, staged),
    };
    (req, kind)
}

/// A frame on the socket path (or a control frame): its request and what
/// it holds while pending; WRITEV / READV add their table to `tables`.
fn socket_frame(op: &OutOp, id: u64, tables: &mut Vec<Vec<u8>>) -> (Request, PendingKind) {
    match &op.kind {
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
        OutKind::Table(cache) => (Request::Table { id }, PendingKind::Table(Arc::clone(cache))),
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
                        .map(|p| {
                            (
                                p.index,
                                p.hold.as_ptr() as usize + p.off as usize,
                                p.remote,
                                p.len,
                            )
                        })
                        .collect(),
                    _guards: parts.iter().map(|p| Arc::clone(&p.hold)).collect(),
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
                    parts: parts.iter().map(|p| (p.index, p.remote, p.len)).collect(),
                    _guards: parts.iter().map(|p| Arc::clone(&p.hold)).collect(),
                },
            )
        }
    }
}

/// The buffers of the frames in order (headers, tables, payloads from
/// registered memory), and where the write lock is let go between frames
/// (buffers and ops up to there; the last cut is the end), so that other
/// callers' frames go in between (see FAIR_SLICE).
fn frame_bufs<'a>(
    conn: &ConnShared,
    f: &'a Framed,
    ops: &'a [OutOp],
) -> (Vec<Bytes<'a>>, Vec<(usize, usize)>, Slicing) {
    let mut bufs: Vec<Bytes<'a>> = Vec::with_capacity(ops.len() * 2);
    let mut tables = f.tables.iter();
    // Where the write lock is let go between frames (buffers and ops up
    // to there), so that other callers' frames go in between (see
    // FAIR_SLICE). The last cut is the end.
    let mut cuts: Vec<(usize, usize)> = Vec::new();
    let mut since_cut = 0u64;
    // The same-host path keeps its frames together.
    let slicing = if conn.cma {
        Slicing {
            slice: u64::MAX,
            ..Slicing::default()
        }
    } else {
        Slicing::default()
    };
    for (i, (hdr, op)) in f.hdrs.iter().zip(ops).enumerate() {
        if slicing.cut_before(&mut since_cut, op.payload_len()) {
            cuts.push((bufs.len(), i));
        }
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
                for p in parts {
                    bufs.push(source(&p.hold, p.off, p.len));
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
    cuts.push((bufs.len(), ops.len()));
    (bufs, cuts, slicing)
}

/// Writes the frames under the write lock, letting go of it at each cut
/// and keeping the send window (the earlier slices answered, never past
/// the batch's deadline). `None`: the connection failed meanwhile (the
/// operations completed with its error); else the lock, and the poison
/// armed until the caller is done with the stream.
async fn write_slices<'a>(
    conn: &'a Arc<ConnShared>,
    batch: &WireOps,
    ids: &'a [u64],
    bufs: &[Bytes<'_>],
    cuts: &[(usize, usize)],
    slicing: Slicing,
) -> Option<(tokio::sync::MutexGuard<'a, ()>, PoisonOnDrop<'a>)> {
    let mut unsent = Unsent {
        conn,
        ids: Some(ids),
    };
    let mut w = conn.write_lock.lock().await;
    unsent.ids = None;
    let mut poison = PoisonOnDrop(Some(conn));
    let (mut from_buf, mut from_op) = (0, 0);
    for (k, &(to_buf, to_op)) in cuts.iter().enumerate() {
        if k > 0 {
            // At a frame boundary: let the senders waiting for the lock
            // in. Abandoned while waiting, the frames not yet sent are
            // withdrawn (the stream is whole).
            // Small calls queued meanwhile go in between too.
            if !write_outbox(conn).await {
                poison.0 = None;
                return None;
            }
            poison.0 = None;
            unsent.ids = Some(&ids[from_op..]);
            drop(w);
            // And let the caller's thread do its other work: a blocked
            // caller (ferry_core::assist) that drives the connection's
            // reader reads the answers that came meanwhile (other callers'
            // small calls, answered between these slices, completed at
            // once instead of after the last slice); a runtime worker
            // runs the tasks those answers woke.
            tokio::task::yield_now().await;
            if let Some(gate) = slicing.gate(k) {
                // Never past the batch's deadline: a target that reads and
                // does not answer is then timed out by the batch's wait, as
                // without the window (the rest is sent meanwhile).
                let until = crate::io::instant(window_until(
                    batch.deadline_time(),
                    crate::io::now(),
                    conn.pace.stall,
                ));
                let answered = wait_answered(conn, &ids[..cuts[gate].1]);
                let _ = tokio::time::timeout_at(until.into(), answered).await;
            }
            w = conn.write_lock.lock().await;
            unsent.ids = None;
            if conn.dead.load(Ordering::Acquire) {
                // Failed meanwhile: every pending operation, these too,
                // was completed with the connection's error.
                return None;
            }
            poison.0 = Some(conn);
        }
        let res = write_all(&conn.stream, &bufs[from_buf..to_buf], conn.pace).await;
        conn.touch();
        // A blocked caller (a Python thread) reads its answer itself.
        conn.assist.offer();
        if let Err(e) = res {
            poison.0 = None;
            conn.fail_all(conn.lost(&e));
            return None;
        }
        (from_buf, from_op) = (to_buf, to_op);
    }
    Some((w, poison))
}

/// With the rings' cursor taken (in frame order): moves the staged
/// frames' streams; the connection fails if they do not go through.
async fn move_after_frames(
    conn: &ConnShared,
    batch: &WireOps,
    st: &ClientStage,
    cursor: &mut (u64, u64),
    staging: &[(bool, Vec<stage::Piece>)],
) {
    let bytes: usize = staging
        .iter()
        .flat_map(|(_, pieces)| pieces.iter().map(|p| p.len))
        .sum();
    let moving = super::conn::Moving::new(st, bytes > stage::RING_BYTES);
    let start = std::time::Instant::now();
    let moved = move_staged(conn, batch, st, cursor, staging).await;
    if moved.is_ok() {
        st.choice.moved(false, bytes as u64, start.elapsed());
    }
    drop(moving);
    if let Err(stop) = moved {
        conn.fail_all(stop.error(
            &conn.peer,
            st.patience,
            "the connection closed while a payload moved through the staging area",
        ));
    }
    conn.touch();
}

/// Waits until none of `ids` is pending on `conn` any more (answered,
/// failed, or given up with an expired batch), or the connection failed.
async fn wait_answered(conn: &ConnShared, ids: &[u64]) {
    struct Counted<'a>(&'a std::sync::atomic::AtomicUsize);
    impl Drop for Counted<'_> {
        fn drop(&mut self) {
            self.0.fetch_sub(1, Ordering::SeqCst);
        }
    }
    conn.window_waiters.fetch_add(1, Ordering::SeqCst);
    let _counted = Counted(&conn.window_waiters);
    loop {
        let notified = conn.answered.notified();
        let mut notified = std::pin::pin!(notified);
        // Registered before looking: an answer taken after the look wakes it.
        notified.as_mut().enable();
        let waiting = {
            let map = lock(&conn.pending);
            map.closed().is_none() && ids.iter().rev().any(|id| map.contains(*id))
        };
        if !waiting || conn.dead.load(Ordering::Acquire) {
            return;
        }
        notified.await;
    }
}

/// Most bytes of a call's frames (headers, tables and payloads together)
/// that go through [`send_combined`].
const COMBINE_MAX: usize = 64 << 10;

/// Sends a small call's frames (already registered as pending, `bytes`
/// long in all): written at once if the write lock is free, else copied
/// and queued for the caller that holds the lock, which writes every
/// queued call in one system call before letting go. The caller goes on
/// to wait for its answer either way.
///
/// Why: with many threads calling at once on one connection (ten Python
/// threads, as vLLM's connector calls), each waited for the write lock in
/// turn, and every hand-over of the lock was a thread wake-up (tens of µs
/// on a VM) in series with the next `sendmsg`: the calls went one at a
/// time however many threads there were. Copying a small payload is
/// cheaper than one of those wake-ups (figures:
/// crates/ferry-tcp/BENCHMARKS.md).
///
/// Frames queued here are never withdrawn: once queued, the call is as
/// good as sent (its caller may stop waiting, as after a send).
async fn send_combined(conn: &ConnShared, bufs: &[Bytes<'_>], bytes: usize) {
    if let Ok(w) = conn.write_lock.try_lock() {
        write_queued(conn, w, bufs).await;
        return;
    }
    let mut frames = Vec::with_capacity(bytes);
    for b in bufs {
        b.append_to(&mut frames);
    }
    lock(&conn.outbox).push(frames);
    conn.touch();
    conn.assist.offer();
    drain_outbox(conn).await;
}

/// Writes the queued frames if nobody holds the write lock (whoever holds
/// it writes them before letting go).
async fn drain_outbox(conn: &ConnShared) {
    if let Ok(w) = conn.write_lock.try_lock() {
        write_queued(conn, w, &[]).await;
    }
    // Else the holder looks at the queue after its write, and again after
    // letting go.
}

/// With the write lock `w` held: writes `first` (frames of the caller's
/// own, from its memory), then the queued frames until the queue stays
/// empty after the lock is let go.
async fn write_queued(
    conn: &ConnShared,
    mut w: tokio::sync::MutexGuard<'_, ()>,
    first: &[Bytes<'_>],
) {
    if !first.is_empty() {
        let mut poison = PoisonOnDrop(Some(conn));
        let res = write_all(&conn.stream, first, conn.pace).await;
        conn.touch();
        // A blocked caller (a Python thread) reads its answer itself.
        conn.assist.offer();
        poison.0 = None;
        if let Err(e) = res {
            conn.fail_all(conn.lost(&e));
            return;
        }
    }
    loop {
        if !write_outbox(conn).await {
            return;
        }
        match let_go(&conn.write_lock, &conn.outbox, w) {
            Some(again) => w = again,
            None => return,
        }
    }
}

/// Lets go of the write lock `w`, taken by a writer whose last look found
/// `outbox` empty. A call queued after that look but before the letting
/// go was left to this writer (its caller found the lock taken), and
/// whoever takes the lock next may have looked already: so the writer
/// looks again, and takes the lock back (`Some`: write the queue again)
/// if the queue is not empty and nobody has taken it since. `None`: the
/// queue is empty, or the lock was taken by a caller that has not looked
/// yet.
fn let_go<'a>(
    write_lock: &'a tokio::sync::Mutex<()>,
    outbox: &std::sync::Mutex<Vec<Vec<u8>>>,
    w: tokio::sync::MutexGuard<'a, ()>,
) -> Option<tokio::sync::MutexGuard<'a, ()>> {
    drop(w);
    if lock(outbox).is_empty() {
        return None;
    }
    write_lock.try_lock().ok()
}

/// With the write lock held: writes the queued frames until the queue is
/// empty. `false` if the connection has failed (the queued calls failed
/// with it).
async fn write_outbox(conn: &ConnShared) -> bool {
    let mut poison = PoisonOnDrop(Some(conn));
    loop {
        let frames = std::mem::take(&mut *lock(&conn.outbox));
        if frames.is_empty() {
            poison.0 = None;
            return true;
        }
        if conn.dead.load(Ordering::Acquire) {
            poison.0 = None;
            return false;
        }
        let bufs: Vec<Bytes<'_>> = frames.iter().map(|f| Bytes::from_ref(f)).collect();
        let res = write_all(&conn.stream, &bufs, conn.pace).await;
        conn.touch();
        if let Err(e) = res {
            poison.0 = None;
            conn.fail_all(conn.lost(&e));
            return false;
        }
    }
}

/// Moves the streams of staged frames (sent, in this order) through the
/// connection's staging area: an SWRITE's bytes into the ring to the
/// target; an SREAD's verdict, then the bytes of its accepted segments,
/// out of the ring from it into local memory (under the gate: none lands
/// once the connection has failed its operations).
async fn move_staged(
    conn: &ConnShared,
    batch: &WireOps,
    st: &ClientStage,
    cursor: &mut (u64, u64),
    staging: &[(bool, Vec<stage::Piece>)],
) -> std::result::Result<(), stage::Stop> {
    let alive = || !conn.dead.load(Ordering::Acquire);
    let slept = AtomicU64::new(0);
    let watch = stage::Watch {
        alive: &alive,
        stall: st.patience,
        // The batch's own deadline covers moving its staged bytes too.
        deadline: batch.deadline(),
        // The caller's task: sleeps go to the blocking pool.
        blocking: false,
        slept: Some(&slept),
    };
    let gate = stage::Gate {
        lock: &st.gate,
        closed: &conn.dead,
    };
    let (to_target, from_target) = (
        st.area.ring(stage::Dir::ToTarget),
        st.area.ring(stage::Dir::ToInitiator),
    );
    for (read, pieces) in staging {
        if !read {
            // SAFETY: each piece lies in a range a guard of the pending
            // operation holds registered (and valid) until its
            // acknowledgement, which comes after the target has emptied
            // the ring; `ops` (in the caller) also holds them.
            unsafe { stage::put(&to_target, &mut cursor.0, pieces, &watch) }.await?;
            continue;
        }
        let mut verdict = [0u8; stage::VERDICT_LEN];
        let v = [stage::Piece {
            ptr: verdict.as_mut_ptr(),
            len: verdict.len(),
        }];
        // SAFETY: `verdict` is ours, valid for writes until this returns.
        unsafe { stage::get(&from_target, &mut cursor.1, &v, &watch, None) }.await?;
        let accepted: Vec<stage::Piece> = pieces
            .iter()
            .enumerate()
            .filter(|(i, _)| !stage::refused(&verdict, *i))
            .map(|(_, p)| *p)
            .collect();
        // SAFETY: each piece lies in a range the pending operation's guard
        // holds registered; the gate stops the copies once the operation
        // has failed and its memory went back to the caller.
        unsafe { stage::get(&from_target, &mut cursor.1, &accepted, &watch, Some(&gate)) }.await?;
    }
    st.choice.staged(slept.load(Ordering::Relaxed));
    Ok(())
}

/// Fails `ops`, which were never sent, with `e`.
pub(crate) fn fail_ops(state: &WireOps, ops: &[OutOp], e: &Error) {
    for op in ops {
        op.fail(state, e);
    }
}

/// Calls of at most this many bytes (in frames below 8 MiB) go as granted
/// copies whatever the state of the staging area: below it one
/// `process_vm_writev` by the initiator beats a round trip with the
/// target; above it, on a quiet machine, the area's two pipelined copies
/// are faster (crates/ferry-tcp/BENCHMARKS.md), so larger calls take the
/// way [`crate::same_host::choice::PathChoice::grant`] finds faster.
pub(crate) const GRANTED_ALWAYS: u64 = 128 << 10;

/// Granted copies run on the caller's thread (a kernel copy is as long as
/// a memcpy of its bytes; a hop to the blocking pool was slower:
/// crates/ferry-tcp/BENCHMARKS.md), in pieces of at most this many bytes, each under its own mark
/// (so that a target's `unregister` waits for one piece at most).
const GRANTED_PIECE: u64 = 256 << 10;

/// A granted copy yields to the caller's runtime once this long has passed
/// since its start or its last yield, so that no caller's runtime is held
/// for long. (A yield after every piece woke a parked worker of a
/// multi-threaded runtime through its I/O driver, which then stole the
/// task: crates/ferry-tcp/BENCHMARKS.md.)
const GRANTED_YIELD: std::time::Duration = std::time::Duration::from_micros(500);

/// Copies the transfer operations of `ops` that the target has granted
/// (see [`crate::same_host::grant`]) and completes them, unless the call
/// is long and the staging area is in favour (`stage_now`); returns the
/// others, in their order, to go as frames (a notification after the
/// writes before it, as always).
async fn copy_granted(
    conn: &ConnShared,
    batch: &Arc<WireOps>,
    ops: Vec<OutOp>,
    stage_now: bool,
) -> Vec<OutOp> {
    let Some(grants) = conn.stage.as_ref().and_then(|s| s.grants.as_ref()) else {
        return ops;
    };
    if !conn.cma || conn.dead.load(Ordering::Acquire) {
        return ops;
    }
    let parallel = crate::same_host::cma::PARALLEL_MIN as u64;
    // Below the kernel-copy size: larger frames are faster as the
    // target's split kernel copy.
    let eligible = |op: &OutOp| op.is_transfer() && op.payload_len() < parallel;
    let total: u64 = ops
        .iter()
        .filter(|op| eligible(op))
        .map(OutOp::payload_len)
        .sum();
    let choice = conn.stage.as_ref().map(|s| &s.choice);
    if total == 0 || (total > GRANTED_ALWAYS && !choice.is_some_and(|c| c.grant(total, stage_now)))
    {
        return ops;
    }
    let start = std::time::Instant::now();
    let mut left = Vec::new();
    let mut since_yield = start;
    let mut copied = 0;
    for op in ops {
        if eligible(&op) && copy_one(grants, batch, &op, &mut since_yield).await {
            copied += op.payload_len();
        } else {
            left.push(op);
        }
    }
    if let Some(c) = choice {
        c.moved(true, copied, start.elapsed());
    }
    left
}

/// One granted copy of a transfer operation, in pieces (see
/// [`GRANTED_PIECE`]), completed on success. `false`: not (all) copied;
/// the operation goes as a frame (which moves every byte again).
async fn copy_one(
    grants: &crate::same_host::grant::ClientGrants,
    batch: &WireOps,
    op: &OutOp,
    since_yield: &mut std::time::Instant,
) -> bool {
    use crate::same_host::grant::Part;
    let Some((read, parts)) = op.cma_parts() else {
        return false;
    };
    // Every piece first (no raw pointer lives across an await but in
    // `Part`s, which are Send).
    let all: Vec<Part> = parts
        .iter()
        .flat_map(|p| {
            let (local, remote) = (p.hold.as_ptr() as usize + p.off as usize, p.remote);
            (0..p.len.div_ceil(GRANTED_PIECE).max(1)).map(move |i| {
                let off = i * GRANTED_PIECE;
                Part {
                    local: (local + off as usize) as *mut u8,
                    len: (p.len - off).min(GRANTED_PIECE),
                    remote: remote + off,
                    gen: p.gen,
                }
            })
        })
        .collect();
    let mut from = 0;
    while from < all.len() {
        // Pieces up to GRANTED_PIECE bytes in one copy.
        let mut to = from;
        let mut bytes = 0;
        while to < all.len() && (to == from || bytes + all[to].len <= GRANTED_PIECE) {
            bytes += all[to].len;
            to += 1;
        }
        // SAFETY: each local range lies in the range its guard (held by
        // `op` for this call) keeps registered; the operation was checked
        // against it when planned.
        if !unsafe { grants.copy(read, &all[from..to]) } {
            return false;
        }
        from = to;
        if since_yield.elapsed() >= GRANTED_YIELD {
            tokio::task::yield_now().await;
            *since_yield = std::time::Instant::now();
        }
    }
    for p in &parts {
        batch.complete(p.index, Ok(()));
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The second look of [`let_go`]: a call queued between the writer's
    /// last look at the queue and its letting go is not stranded.
    #[test]
    fn a_call_queued_as_the_writer_lets_go_is_left_to_it() {
        let write_lock = tokio::sync::Mutex::new(());
        let outbox = std::sync::Mutex::new(Vec::new());
        // Nothing queued: the lock goes for good.
        let w = write_lock.try_lock().unwrap();
        assert!(let_go(&write_lock, &outbox, w).is_none());
        // Queued while the writer held the lock, after its last look: it
        // takes the lock back to write the call.
        let w = write_lock.try_lock().unwrap();
        lock(&outbox).push(vec![1]);
        let again = let_go(&write_lock, &outbox, w);
        assert!(again.is_some(), "the queued call was left to nobody");
        // The next holder (here, the same writer) has the lock.
        assert!(write_lock.try_lock().is_err());
    }
}

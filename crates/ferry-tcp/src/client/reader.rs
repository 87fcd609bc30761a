//! The reader task of a connection: reads responses, moves READ payloads
//! from the socket straight into their destination regions, and completes
//! the operations they answer. What each answer header means, what to read
//! next and into which destination, and how each part of an operation
//! ends are the core's decisions ([`ferry_tcp_proto::initiator::on_header`],
//! [`Verdicts`]); this task makes the reads and completes the
//! operations.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use ferry_core::__private::sync::lock;
use ferry_core::{Error, Result};

use super::conn::{ConnShared, PendingKind, PendingOp};
use crate::frame::{decode_ids, decode_table, Response, Status};
use crate::io::{Bytes, FrameReader, Next};
use ferry_tcp_proto::initiator::{frame_bytes, Recv, Verdicts, SCRATCH};

/// The reader task of `conn`: reads responses until the connection ends,
/// then fails what is still pending on it.
pub(crate) async fn reader_task(
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
///
/// Polling: `spin` after each response; while requests are outstanding,
/// for as long as the connection's last activity (a request sent, a
/// response received) is less than `spin_pending` ago — decided while
/// polling, so a request sent after the reader began waiting keeps it
/// awake for its answer (waking a sleeping reader costs tens of µs:
/// BENCHMARKS.md). With nothing outstanding it sleeps after `spin`.
pub(crate) async fn reader_loop(
    conn: &Arc<ConnShared>,
    spin: Duration,
    spin_pending: Duration,
    idle: Option<Duration>,
) -> Result<()> {
    let mut rd = frame_reader(conn, spin, spin_pending);
    let mut scratch = Scratch::new();
    while let Some(resp) = next_answer(conn, &mut rd, idle).await? {
        // The whole frame must arrive at the minimum rate.
        rd.begin_frame(frame_bytes(&resp));
        let recv = conn.on_header(&resp);
        execute(conn, &mut rd, &mut scratch, recv).await?;
    }
    Ok(())
}

/// What the reader keeps from one answer to the next, so that no answer
/// allocates (but a table).
struct Scratch {
    /// The ids of an OKS, the failed indices of an ERRV or a DATAV
    /// ([`SCRATCH`] bytes: the core asks for no more).
    buf: Box<[u8; SCRATCH]>,
    /// How each segment of the last ERRV or DATAV ends.
    verdicts: Verdicts,
    /// The destinations of a DATAV's segments that land (empty between
    /// answers).
    dsts: Vec<Bytes<'static>>,
}

impl Scratch {
    fn new() -> Scratch {
        Scratch {
            buf: Box::new([0; SCRATCH]),
            verdicts: Verdicts::new(),
            dsts: Vec::new(),
        }
    }
}

/// The connection's frame reader, polling as [`reader_loop`] says.
fn frame_reader(conn: &Arc<ConnShared>, spin: Duration, spin_pending: Duration) -> FrameReader {
    let mut rd = FrameReader::new(spin, conn.pace);
    if !spin_pending.is_zero() {
        let c = Arc::clone(conn);
        rd.set_spin_while(Arc::new(move || c.poll_on(spin_pending)));
    }
    if let Some(st) = &conn.stage {
        let c = Arc::clone(conn);
        rd.set_spin_hook(Arc::new(move |polling| c.take_lane(polling)));
        let c = Arc::clone(conn);
        rd.set_pause(crate::io::Pause {
            active: Arc::new(move || c.stage.as_ref().is_some_and(|st| st.moving_long())),
            nudge: Arc::clone(&st.nudge),
        });
    }
    rd
}

/// The next answer header, decoded; `None` once the connection ends
/// between frames (the peer closed it, or it was idle for `idle` and this
/// side retired it).
async fn next_answer(
    conn: &ConnShared,
    rd: &mut FrameReader,
    idle: Option<Duration>,
) -> Result<Option<Response>> {
    loop {
        // Between frames: a blocked caller driving this task whose own
        // call completed returns now (else it kept reading the answers of
        // another caller's long batch for as long as they kept coming),
        // and a caller waiting to drive it takes it over.
        if ferry_core::assist::should_yield() {
            tokio::task::yield_now().await;
        }
        let busy = !lock(&conn.pending).is_empty();
        let next = rd
            .next_header(&conn.stream, if busy { None } else { idle })
            .await
            .map_err(|e| conn.lost(&e))?;
        match next {
            Next::Header(h) => {
                conn.mark_rx();
                return Response::decode(&h)
                    .map(Some)
                    .map_err(|e| conn.protocol(e.0));
            }
            Next::Eof => return Ok(None),
            Next::Idle if retire(conn) => return Ok(None),
            Next::Idle => {}
        }
    }
}

/// Retires the idle connection if nothing is in flight (sends that race
/// with this go elsewhere); returns whether it did.
fn retire(conn: &ConnShared) -> bool {
    let mut map = lock(&conn.pending);
    let retired =
        map.retire(|| Error::Canceled(format!("idle connection to {} retired", conn.peer)));
    if retired {
        conn.retired.store(true, Ordering::Release);
        conn.dead.store(true, Ordering::Release);
    }
    retired
}

/// Executes the core's decision on an answer header: reads what it says
/// to read, where it says, and completes the operation answered.
async fn execute(
    conn: &ConnShared,
    rd: &mut FrameReader,
    scratch: &mut Scratch,
    recv: Recv<PendingOp>,
) -> Result<()> {
    match recv {
        Recv::Into(op, len) => read_into(conn, rd, op, len).await,
        Recv::Indices {
            op,
            failed,
            len,
            status,
        } => read_datav(conn, rd, scratch, op, (failed, len, status)).await,
        Recv::Refusals { op, status, count } => {
            read_errv(conn, rd, scratch, op, status, count).await
        }
        Recv::Acks(count) => {
            let ids = &mut scratch.buf[..count as usize * 8];
            read_rest(conn, rd, &mut *ids).await?;
            for id in decode_ids(ids) {
                conn.ack(id, Ok(()))?;
            }
            Ok(())
        }
        Recv::Table(op, bytes) => read_table(conn, rd, op, bytes).await,
        // Acknowledgements wait in the staging area's lane.
        Recv::Lane => {
            conn.take_lane(true);
            Ok(())
        }
        // The late answer of an expired batch's operation.
        Recv::Discard(n) if n > 0 => rd
            .discard(&conn.stream, n, true)
            .await
            .map_err(|e| conn.lost(&e)),
        // Nothing to read: an acknowledgement, a refusal, a protocol error.
        Recv::Ack(_) | Recv::Refused(..) | Recv::Fail(..) | Recv::Discard(_) => {
            conn.settle(recv).map(drop)
        }
    }
}

/// Reads the rest of the frame into `buf`.
async fn read_rest(conn: &ConnShared, rd: &mut FrameReader, buf: &mut [u8]) -> Result<()> {
    rd.read_payload(&conn.stream, Bytes::from_mut(buf))
        .await
        .map_err(|e| conn.lost(&e))
}

/// Fails `op` with `err`, which ends the connection too.
fn fail(op: PendingOp, err: Error) -> Error {
    op.complete(Err(err.clone()));
    err
}

/// Reads a DATA's payload into its READ's destination and completes it.
async fn read_into(conn: &ConnShared, rd: &mut FrameReader, op: PendingOp, len: u64) -> Result<()> {
    let Some(dst) = op.destination() else {
        return Err(fail(
            op,
            conn.protocol("DATA for an operation without a destination"),
        ));
    };
    // SAFETY: `dst..dst+len` was bounds-checked against a local registered
    // region when the request was issued (the core checked that `len` is
    // the READ's length), and the RegionGuard held in `op` keeps that
    // region registered (so the memory valid) until `op` is dropped below.
    // Only recvmsg(2) writes it.
    let slice = unsafe { Bytes::from_raw(dst as *mut u8, len as usize) };
    match rd.read_payload(&conn.stream, slice).await {
        Ok(()) => {
            op.complete(Ok(()));
            Ok(())
        }
        Err(e) => Err(fail(op, conn.lost(&e))),
    }
}

/// Reads a DATAV (`failed` indices, then `len` payload bytes; `status`:
/// why those failed): the indices, judged by the core, then the payload
/// into the READV's segments that land; completes each segment.
async fn read_datav(
    conn: &ConnShared,
    rd: &mut FrameReader,
    sc: &mut Scratch,
    op: PendingOp,
    (failed, len, status): (u32, u64, Option<Status>),
) -> Result<()> {
    let PendingKind::ReadV { parts, .. } = &op.kind else {
        return Err(fail(
            op,
            conn.protocol("DATAV for an operation not a READV"),
        ));
    };
    let idx = &mut sc.buf[..failed as usize * 4];
    // The indices end the frame only if no data follows.
    let r = rd
        .read_v(&conn.stream, &[Bytes::from_mut(&mut *idx)], len == 0)
        .await;
    if let Err(e) = r {
        return Err(fail(op, conn.lost(&e)));
    }
    if let Err(why) = sc
        .verdicts
        .datav(idx, parts.iter().map(|p| p.3), status, len)
    {
        return Err(fail(op, conn.protocol(why)));
    }
    let v = &sc.verdicts;
    sc.dsts.clear();
    sc.dsts.extend(
        parts
            .iter()
            .enumerate()
            .filter(|(i, _)| v.lands(*i))
            // SAFETY: each destination was bounds-checked against a local
            // registered region when the request was issued; the guards
            // held in `op` keep those regions registered until `op` is
            // dropped. Only recvmsg(2) writes them.
            .map(|(_, p)| unsafe { Bytes::from_raw(p.1 as *mut u8, p.3 as usize) }),
    );
    let r = if len > 0 {
        rd.read_v(&conn.stream, &sc.dsts, true).await
    } else {
        Ok(())
    };
    sc.dsts.clear();
    if let Err(e) = r {
        return Err(fail(op, conn.lost(&e)));
    }
    for (i, &(index, _, remote, n)) in parts.iter().enumerate() {
        conn.complete_part(&op.batch, index, sc.verdicts.of(i), remote, n);
    }
    Ok(())
}

/// Reads an ERRV's `count` failed indices, judged by the core, and
/// completes each segment of the WRITEV (or same-host frame) `op`.
async fn read_errv(
    conn: &ConnShared,
    rd: &mut FrameReader,
    sc: &mut Scratch,
    op: PendingOp,
    status: Status,
    count: u32,
) -> Result<()> {
    let (PendingKind::WriteV { parts, .. } | PendingKind::Cma { parts, .. }) = &op.kind else {
        return Err(fail(
            op,
            conn.protocol("ERRV for an operation not a WRITEV"),
        ));
    };
    let idx = &mut sc.buf[..count as usize * 4];
    if let Err(e) = read_rest(conn, rd, &mut *idx).await {
        return Err(fail(op, e));
    }
    if let Err(why) = sc.verdicts.errv(idx, parts.len(), status) {
        return Err(fail(op, conn.protocol(why)));
    }
    for (i, &(index, addr, len)) in parts.iter().enumerate() {
        conn.complete_part(&op.batch, index, sc.verdicts.of(i), addr, len);
    }
    Ok(())
}

/// Reads a TABLE reply (`bytes`: bounded by the core, at most 65,536
/// entries, 1.5 MiB) into the cache of the TABLE `op`.
async fn read_table(
    conn: &ConnShared,
    rd: &mut FrameReader,
    op: PendingOp,
    bytes: u64,
) -> Result<()> {
    let PendingKind::Table(cache) = &op.kind else {
        return Err(fail(
            op,
            conn.protocol("TABLE reply to an operation not a TABLE"),
        ));
    };
    let mut raw = vec![0u8; bytes as usize];
    if let Err(e) = read_rest(conn, rd, &mut raw).await {
        return Err(fail(op, e));
    }
    match decode_table(&raw) {
        Ok(table) => {
            *ferry_core::__private::sync::write(cache) = Arc::new(table);
            op.complete(Ok(()));
            Ok(())
        }
        Err(e) => Err(fail(op, conn.protocol(e.0))),
    }
}

//! The reader task of a connection: reads responses, moves READ payloads
//! from the socket straight into their destination regions, and completes
//! the operations they answer.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use ferry_core::__private::sync::lock;
use ferry_core::{Error, Result};

use super::conn::{ConnShared, PendingKind};
use crate::frame::{decode_ids, decode_table, Response, Status, MAX_ACKS, TABLE_ENTRY_LEN};
use crate::io::{Bytes, FrameReader, Next};
use ferry_tcp_proto::initiator::{check_datav, failed_segments, frame_bytes, Recv, Reply};

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
    let mut ids = vec![0u8; MAX_ACKS as usize * 8];
    let stream = &conn.stream;
    loop {
        // Between frames: a blocked caller driving this task whose own
        // call completed returns now (else it kept reading the answers of
        // another caller's long batch for as long as they kept coming),
        // and a caller waiting to drive it takes it over.
        if ferry_core::assist::should_yield() {
            tokio::task::yield_now().await;
        }
        let busy = !lock(&conn.pending).is_empty();
        let hdr = match rd
            .next_header(stream, if busy { None } else { idle })
            .await
            .map_err(|e| conn.lost(&e))?
        {
            Next::Header(h) => h,
            Next::Eof => return Ok(()),
            Next::Idle => {
                let mut map = lock(&conn.pending);
                // Retire it if nothing is in flight: sends that race with
                // this go elsewhere.
                if map
                    .retire(|| Error::Canceled(format!("idle connection to {} retired", conn.peer)))
                {
                    conn.retired.store(true, Ordering::Release);
                    conn.dead.store(true, Ordering::Release);
                    return Ok(());
                }
                continue;
            }
        };
        conn.mark_rx();
        let resp = Response::decode(&hdr).map_err(|e| conn.protocol(e.0))?;
        // The whole frame must arrive at the minimum rate.
        rd.begin_frame(frame_bytes(&resp));
        // OK, ERR, DATA, DATAV: the core decides what the header means.
        let header = match conn.on_header(&resp) {
            Some(recv) => conn.settle(recv)?,
            None => None,
        };
        match (header, resp) {
            (Some(Recv::Discard(n)), _) => {
                // The late answer of an expired batch's operation.
                rd.discard(stream, n, true)
                    .await
                    .map_err(|e| conn.lost(&e))?;
            }
            (Some(Recv::Into(op, len)), _) => {
                let Some(dst) = op.destination() else {
                    let err = conn.protocol("DATA for an operation without a destination");
                    op.complete(Err(err.clone()));
                    return Err(err);
                };
                // SAFETY: `dst..dst+len` was bounds-checked against a local
                // registered region when the request was issued (the core
                // checked that `len` is the READ's length), and the
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
            (
                Some(Recv::Indices(op, failed)),
                Response::DataV {
                    id, status, len, ..
                },
            ) => {
                let buf = &mut ids[..failed as usize * 4];
                let PendingKind::ReadV { parts, .. } = &op.kind else {
                    let err = conn.protocol(format!("DATAV for request {id}, not a READV"));
                    op.complete(Err(err.clone()));
                    return Err(err);
                };
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
                let bad = match failed_segments(buf, parts.len(), "DATAV")
                    .and_then(|bad| check_datav(&bad, parts.iter().map(|p| p.3), len).map(|()| bad))
                {
                    Ok(bad) => bad,
                    Err(w) => {
                        let err = conn.protocol(w);
                        op.complete(Err(err.clone()));
                        return Err(err);
                    }
                };
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
            // Acknowledgements wait in the staging area's lane.
            (_, Response::Wake) if conn.stage.is_some() => {
                conn.take_lane(true);
            }
            (_, Response::Wake) => return Err(conn.protocol("WAKE without a staging area")),
            (_, Response::OkMany { count }) => {
                let buf = &mut ids[..count as usize * 8];
                rd.read_payload(stream, Bytes::from_mut(buf))
                    .await
                    .map_err(|e| conn.lost(&e))?;
                for id in decode_ids(buf) {
                    conn.ack(id, Ok(()))?;
                }
            }
            (_, Response::ErrV { id, status, count }) => {
                let buf = &mut ids[..count as usize * 4];
                rd.read_payload(stream, Bytes::from_mut(buf))
                    .await
                    .map_err(|e| conn.lost(&e))?;
                let op = match conn.reply(id) {
                    Reply::Op(op) => op,
                    Reply::Skip => continue,
                    Reply::Unknown => {
                        return Err(conn.protocol(format!("ERRV for unknown request id {id}")))
                    }
                };
                let (PendingKind::WriteV { parts, .. } | PendingKind::Cma { parts, .. }) = &op.kind
                else {
                    let err = conn.protocol(format!("ERRV for request {id}, not a WRITEV"));
                    op.complete(Err(err.clone()));
                    return Err(err);
                };
                let failed = match failed_segments(buf, parts.len(), "ERRV") {
                    Ok(f) => f,
                    Err(w) => {
                        let err = conn.protocol(w);
                        op.complete(Err(err.clone()));
                        return Err(err);
                    }
                };
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
            (_, Response::SameHostOk { id, .. }) => {
                return Err(conn.protocol(format!("SAME_HOST_OK for request {id}, not offered")));
            }
            (_, Response::Table { id, count }) => {
                // Bounded by the decoder (≤ 65,536 entries, 1.5 MiB).
                let mut raw = vec![0u8; count as usize * TABLE_ENTRY_LEN];
                rd.read_payload(stream, Bytes::from_mut(&mut raw))
                    .await
                    .map_err(|e| conn.lost(&e))?;
                let op = match conn.reply(id) {
                    Reply::Op(op) => op,
                    Reply::Skip => continue,
                    Reply::Unknown => {
                        return Err(conn.protocol(format!("TABLE for unknown request id {id}")))
                    }
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
                        *ferry_core::__private::sync::write(cache) = Arc::new(table);
                        op.complete(Ok(()));
                    }
                    _ => {
                        let err = conn.protocol(format!("TABLE reply to request {id}"));
                        op.complete(Err(err.clone()));
                        return Err(err);
                    }
                }
            }
            // Settled by the core above (an acknowledgement, a refusal).
            (_, Response::Ok { .. } | Response::Err { .. })
            | (_, Response::Data { .. } | Response::DataV { .. }) => {}
        }
    }
}

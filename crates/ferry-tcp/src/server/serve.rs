//! Serving an established connection: its state, the loop that reads
//! requests and answers them (acknowledgements coalesced), and the
//! same-host connection's own thread.

use super::copy::{acquire_segments, cma_copy, staged_copy};
use super::*;
use ferry_tcp_proto::target::{
    failed_status, frame_bytes, landed, overlapping, Delivered, Part, Step, TargetConn,
};

/// A connection's serving state, handed to a dedicated thread when the
/// same-host path is agreed.
pub(super) struct ConnState {
    pub(super) rd: FrameReader,
    /// The protocol's side of the connection: the answers it owes.
    pub(super) conn: TargetConn,
    /// The initiator's process once the same-host path is agreed.
    pub(super) cma_pid: Option<Arc<cma::Initiator>>,
    /// The staging area it offered, once mapped.
    pub(super) stage: Option<TargetStage>,
    /// The version and features the handshake settled.
    pub(super) agreed: crate::negotiate::Agreement,
    /// The connection's credential socket until its SAME_HOST offer
    /// (see [`cma::check_offer_on`]).
    pub(super) cred: Option<cma::CredListener>,
    /// The peer's served-traffic counters.
    pub(super) served: ferry_core::inbound::ServedPeer,
}

/// The target's side of a connection's staging area.
pub(super) struct TargetStage {
    pub(super) area: Arc<crate::same_host::stage::Area>,
    /// Its grants (if agreed): revoked when the connection ends.
    pub(super) _grants: Option<crate::same_host::grant::Link>,
    /// The next slot to empty in the ring from the initiator.
    pub(super) from_initiator: u64,
    /// The next slot to fill in the ring to it.
    pub(super) to_initiator: u64,
    /// The next position of the acknowledgement lane.
    pub(super) ack_head: u64,
}

/// How [`serve`] ended.
pub(super) enum Served {
    /// The connection is over (EOF, idle, evicted).
    Closed,
    /// The same-host path was agreed: serve the rest on a dedicated thread.
    ToThread(Stream, Box<ConnState>),
}

/// Serves a same-host (cma) connection on a thread of its own, with its own
/// single-threaded runtime, until it ends or this future is dropped (then
/// the thread stops at its next await point; a copy in progress finishes
/// first, under its guards).
///
/// Why: the connection polls its socket between requests and copies; on
/// the engine's multi-threaded runtime every request arriving on a polled
/// socket still wakes the worker parked in the reactor, which then steals
/// and bounces the polling task between threads — on a 2-vCPU machine
/// those wake-ups took the CPU the initiator's process needed
/// (BENCHMARKS.md). On its own thread nothing else wakes.
/// One thread per same-host connection (bounded by `max_inbound`); such
/// peers are local processes the target may already `ptrace`.
pub(super) async fn serve_on_thread(
    stream: Stream,
    peer: String,
    core: Arc<Core>,
    live: Arc<Live>,
    st: ConnState,
) -> Result<(), Error> {
    let stall = core.config.stall_timeout;
    let owned = stream.into_owned().map_err(|e| io_error(&peer, e, stall))?;
    let (done_tx, done_rx) = oneshot::channel();
    let (stop_tx, stop_rx) = oneshot::channel::<()>();
    let p = peer.clone();
    let body = move || {
        let r = (|| {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .map_err(|e| io_error(&p, e, stall))?;
            rt.block_on(async {
                let stream = Stream::from_owned(owned).map_err(|e| io_error(&p, e, stall))?;
                tokio::select! {
                    r = serve(stream, &p, &core, &live, st) => r.map(|_| ()),
                    _ = stop_rx => Ok(()),
                }
            })
        })();
        let _ = done_tx.send(r);
    };
    std::thread::Builder::new()
        .name("ferry-cma-conn".to_owned())
        .spawn(body)
        .map_err(|e| io_error(&peer, e, stall))?;
    // Dropped with this future (the connection task aborted at shutdown):
    // the thread then stops.
    let _stop = stop_tx;
    done_rx.await.unwrap_or(Ok(()))
}

/// `stall`: the connection's stall timeout, the bound a timed-out read or
/// write of a frame ran into (a payload's own bound grows with its size).
fn io_error(peer: &str, e: std::io::Error, stall: Duration) -> Error {
    if e.kind() == std::io::ErrorKind::TimedOut {
        Error::Timeout {
            operation: format!("receiving or sending a frame ({e})"),
            peer: Some(peer.to_owned()),
            after: stall,
        }
    } else {
        Error::PeerLost {
            peer: peer.to_owned(),
            reason: e.to_string(),
        }
    }
}

async fn flush(
    stream: &Stream,
    conn: &mut TargetConn,
    core: &Core,
    peer: &str,
) -> Result<(), Error> {
    if !conn.has_answers() {
        return Ok(());
    }
    let buf = conn.take_answers();
    write_all_slices(stream, &[&buf], core.pace())
        .await
        .map_err(|e| io_error(peer, e, core.config.stall_timeout))
}

/// Framing is lost: answer what was processed, then `Malformed` for `id`,
/// and close (PROTOCOL.md §3).
async fn malformed(
    stream: &Stream,
    conn: &mut TargetConn,
    core: &Core,
    peer: &str,
    id: u64,
    reason: String,
) -> Error {
    let _ = conn.malformed::<()>(id, "");
    closed(stream, conn, core, peer, reason).await
}

/// The core found the framing lost (it queued `Malformed`): answer what
/// was processed, and close.
async fn closed(
    stream: &Stream,
    conn: &mut TargetConn,
    core: &Core,
    peer: &str,
    reason: String,
) -> Error {
    let _ = flush(stream, conn, core, peer).await;
    Error::Protocol {
        peer: peer.to_owned(),
        reason,
    }
}

/// The region table as the connection's core asks it.
struct Table<'a>(&'a Core);

impl ferry_tcp_proto::target::Regions for Table<'_> {
    type Hold = RegionGuard;
    fn acquire(&mut self, addr: u64, len: u64, gen: u32) -> Result<RegionGuard, Status> {
        self.0.acquire(addr, len, gen)
    }
}

/// Registered memory a guard holds, as a socket I/O range.
fn held(g: &RegionGuard) -> Bytes<'static> {
    // SAFETY: the guard keeps [addr, addr+len) registered and therefore
    // valid (MemoryRegion::from_raw_parts contract) for as long as it is
    // held, and every caller drops the range before the guard; recvmsg(2)
    // writes straight into it (or sendmsg(2) reads it), the way a NIC's
    // DMA does.
    unsafe { Bytes::from_raw(g.as_ptr(), g.len() as usize) }
}

/// Executes one step of the core for a socket request, until the request
/// is served. `Ok(false)`: the core closed the connection (answered).
async fn run_step(
    stream: &Stream,
    rd: &mut FrameReader,
    conn: &mut TargetConn,
    core: &Core,
    peer: &str,
    served: &ferry_core::inbound::ServedPeer,
    mut step: Step<RegionGuard>,
) -> Result<(), Error> {
    let stall = core.config.stall_timeout;
    let io = |e| io_error(peer, e, stall);
    loop {
        step = match step {
            Step::Done => return Ok(()),
            Step::ReadBuf { len, ends_frame } => {
                let buf = Bytes::from_mut(&mut conn.buf()[..len]);
                if ends_frame {
                    rd.read_payload(stream, buf).await.map_err(io)?;
                } else {
                    rd.read_part(stream, buf).await.map_err(io)?;
                }
                conn.on_buf(&mut Table(core), |name, message| {
                    deliver(core, name, message)
                })
            }
            Step::Receive {
                parts,
                one_call,
                landed,
            } => {
                if one_call {
                    let dsts: Vec<Bytes<'static>> = parts
                        .iter()
                        .filter_map(|p| match p {
                            Part::Into(g, _) => Some(held(g)),
                            Part::Skip(_) => None,
                        })
                        .collect();
                    rd.read_v(stream, &dsts, true).await.map_err(io)?;
                } else {
                    // In order; only the last part ends the frame (header
                    // top-up).
                    let last = parts.len().saturating_sub(1);
                    for (i, part) in parts.iter().enumerate() {
                        match part {
                            Part::Into(g, _) if i == last => rd.read_payload(stream, held(g)).await,
                            Part::Into(g, _) => rd.read_part(stream, held(g)).await,
                            Part::Skip(len) => rd.discard(stream, *len, i == last).await,
                        }
                        .map_err(io)?;
                    }
                }
                drop(parts);
                conn.received();
                served.wrote(landed.0, landed.1);
                return Ok(());
            }
            Step::Send {
                meta,
                holds,
                landed,
            } => {
                let mut bufs = Vec::with_capacity(holds.len() + 1);
                bufs.push(Bytes::from_ref(&meta));
                bufs.extend(holds.iter().map(|(g, _)| held(g)));
                write_all(stream, &bufs, core.pace()).await.map_err(io)?;
                drop(bufs);
                drop(holds);
                served.read(landed.0, landed.1);
                return Ok(());
            }
            Step::Table { meta, id } => {
                let (count, table) = core.table_bytes();
                let hdr = Response::Table { id, count }.encode();
                write_all_slices(stream, &[&meta, &hdr, &table], core.pace())
                    .await
                    .map_err(io)?;
                return Ok(());
            }
            Step::Close(reason) => return Err(closed(stream, conn, core, peer, reason).await),
            // Taken by `serve` before any step runs (never reached).
            Step::Driver(_) => return Ok(()),
        };
    }
}

/// Hands a notification to the engine's queue.
fn deliver(core: &Core, name: &str, message: &str) -> Delivered {
    let n = Notification {
        name: name.to_owned(),
        message: message.to_owned(),
    };
    if n.validate().is_err() {
        return Delivered::Invalid;
    }
    let refused = core.refuse_notifications.load(Ordering::Relaxed);
    if refused {
        // Counted as the inbox's own refusals are.
        core.notifications
            .count_refused(ferry_core::raw::PushRefused::Full);
    }
    // Full (or the engine shutting down): the sender sees a retryable
    // refusal.
    if refused || core.notifications.push(n).is_err() {
        Delivered::Full
    } else {
        Delivered::Queued
    }
}

/// Serves one established connection until EOF, idleness, an error or
/// abort — or until the same-host path is agreed (then
/// [`Served::ToThread`]: once per connection, a second SAME_HOST is
/// malformed).
pub(super) async fn serve(
    stream: Stream,
    peer: &str,
    core: &Core,
    live: &Live,
    st: ConnState,
) -> Result<Served, Error> {
    let cfg = &core.config;
    let pace = core.pace();
    let stall = cfg.stall_timeout;
    let ConnState {
        mut rd,
        mut conn,
        mut cma_pid,
        mut stage,
        agreed,
        mut cred,
        served,
    } = st;
    // One SAME_HOST offer per connection: a second one closes it.
    let mut offered = false;
    // The segment table of the current CWRITE / CREAD.
    let mut cma_table: Vec<u8> = Vec::new();
    loop {
        // Answer everything processed so far before waiting for more input.
        if conn.has_answers()
            && !rd
                .poll_header_now(&stream)
                .map_err(|e| io_error(peer, e, stall))?
        {
            flush(&stream, &mut conn, core, peer).await?;
        }
        // Idle: evictable (after `evict_idle`) while waiting here.
        live.idle_since.store(core.now_ms(), Ordering::Release);
        let next = tokio::select! {
            r = rd.next_header(&stream, Some(cfg.idle_timeout)) => Some(r),
            _ = live.evict.notified() => None,
        };
        live.idle_since.store(0, Ordering::Release);
        let Some(next) = next else {
            tracing::debug!(%peer, "evicted an idle connection for a new one");
            return Ok(Served::Closed);
        };
        let hdr = match next.map_err(|e| io_error(peer, e, stall))? {
            Next::Header(h) => h,
            Next::Eof => {
                flush(&stream, &mut conn, core, peer).await?;
                return Ok(Served::Closed);
            }
            Next::Idle => {
                tracing::debug!(%peer, "closing an idle connection");
                return Ok(Served::Closed);
            }
        };
        if core.is_closed() {
            tracing::debug!(%peer, "engine shut down: closing the connection");
            return Ok(Served::Closed);
        }
        let req = match Request::decode(&hdr) {
            Ok(r) => r,
            Err(e) => return Err(malformed(&stream, &mut conn, core, peer, 0, e.0).await),
        };
        if let Some(bytes) = frame_bytes(&req) {
            rd.begin_frame(bytes);
        }
        let req = match conn.on_request(req, &mut Table(core)) {
            Step::Driver(req) => req,
            step => {
                run_step(&stream, &mut rd, &mut conn, core, peer, &served, step).await?;
                if conn.wants_flush() {
                    flush(&stream, &mut conn, core, peer).await?;
                }
                continue;
            }
        };
        match req {
            Request::SameHost {
                id,
                channel,
                stage: offered_stage,
            } => {
                let mut raw = [0u8; cma::OFFER_LEN];
                rd.read_payload(&stream, Bytes::from_mut(&mut raw))
                    .await
                    .map_err(|e| io_error(peer, e, stall))?;
                let offer = cma::Offer::decode(&raw);
                if std::mem::replace(&mut offered, true) {
                    let reason = "a second SAME_HOST offer on one connection".to_owned();
                    return Err(malformed(&stream, &mut conn, core, peer, id, reason).await);
                }
                // The offered PID is trusted only once proven (see
                // `cma::check_offer_on`); until then the target makes no
                // system call on it, and whatever fails, the peer is told
                // only "refused" (the detail goes to this log).
                let verdict = match &stream {
                    _ if cfg.same_host == SameHost::Off => Err((cma::Refusal::Disabled, None)),
                    _ if !agreed.theirs.enabled(crate::negotiate::SAME_HOST) => {
                        let reason = "SAME_HOST from a peer that did not announce it".to_owned();
                        return Err(malformed(&stream, &mut conn, core, peer, id, reason).await);
                    }
                    s if cma_pid.is_none() && !s.is_unix() => {
                        let checked = match (cred.take(), s.tcp_addrs()) {
                            (None, _) => Err(
                                "the peer did not prove its credentials (same-host-cred: a Ferry \
                                 build without it, or not on this host)"
                                    .to_owned(),
                            ),
                            (Some(_), None) => Err("no TCP addresses".to_owned()),
                            (Some(l), Some(addrs)) => l.prove().and_then(|proof| {
                                cma::check_offer_on(addrs, &offer, proof, &cfg.same_host_uids)
                            }),
                        };
                        checked.map_err(|why| (cma::Refusal::Refused, Some(why)))
                    }
                    _ => {
                        let reason = "SAME_HOST on a connection that has agreed it".to_owned();
                        return Err(malformed(&stream, &mut conn, core, peer, id, reason).await);
                    }
                };
                match verdict {
                    Ok(initiator) => {
                        let pid = initiator.pid;
                        // Only what the handshake agreed (a peer of an
                        // older version never offers more).
                        let taken = match channel {
                            None => Err(0),
                            Some(_) if !agreed.both(crate::negotiate::CONTROL_CHANNEL) => {
                                Err(libc::EOPNOTSUPP)
                            }
                            Some(fd) => initiator.take_channel(fd),
                        };
                        let staging_agreed = agreed.both(crate::negotiate::STAGING)
                            && agreed.both(crate::negotiate::ACK_LANE);
                        // With grants agreed the area carries their page.
                        let grants = staging_agreed && agreed.both(crate::negotiate::GRANTS);
                        let mapped = match offered_stage {
                            None => Err(0),
                            Some(_) if !staging_agreed => Err(libc::EOPNOTSUPP),
                            Some(fd) => initiator.take_stage(fd, grants),
                        };
                        let initiator = Arc::new(initiator);
                        let staging = mapped.as_ref().map(|_| ()).map_err(|e| *e as u32);
                        tracing::debug!(%peer, pid, ?taken, ?staging, "same-host path agreed");
                        stage = mapped.ok().map(|area| {
                            let area = Arc::new(area);
                            // Published before the answer: the initiator
                            // reads the page once it has it.
                            let link = grants
                                .then(|| {
                                    core.grants.attach(
                                        Arc::clone(&area),
                                        Arc::clone(&initiator),
                                        served.clone(),
                                    )
                                })
                                .flatten();
                            TargetStage {
                                area,
                                _grants: link,
                                from_initiator: 0,
                                to_initiator: 0,
                                ack_head: 0,
                            }
                        });
                        cma_pid = Some(initiator);
                        // Its requests are headers with short segment
                        // tables: one `recvmsg` each.
                        rd.set_lookahead();
                        let answer = Response::SameHostOk {
                            id,
                            channel: taken.as_ref().map(|_| ()).map_err(|e| *e as u32),
                            stage: staging,
                        };
                        conn.frame(&answer.encode());
                        let stream = match taken {
                            Ok(unix) => {
                                // Answer on the TCP connection (the initiator
                                // sent nothing after its offer), which then
                                // closes: the connection goes on over the
                                // channel.
                                flush(&stream, &mut conn, core, peer).await?;
                                rd = FrameReader::new(cfg.spin, pace);
                                rd.set_lookahead();
                                Stream::Quiet(
                                    crate::quiet::Quiet::new(unix.into(), true)
                                        .map_err(|e| io_error(peer, e, stall))?,
                                )
                            }
                            Err(_) => stream,
                        };
                        let st = Box::new(ConnState {
                            rd,
                            conn,
                            cma_pid,
                            stage,
                            agreed,
                            cred: None,
                            served,
                        });
                        return Ok(Served::ToThread(stream, st));
                    }
                    Err((why, detail)) => {
                        tracing::info!(
                            %peer,
                            pid = offer.pid,
                            detail = detail.as_deref().unwrap_or("same_host=off"),
                            "same-host path refused"
                        );
                        // No errno, no detail: one answer for every reason.
                        conn.err(id, Status::SameHostRefused, why as u64, 0);
                    }
                }
            }
            Request::Cma {
                id,
                read,
                staged,
                count,
                total,
            } => {
                // Reused: no 12 KiB zeroed per request.
                let n = count as usize * CMA_SEGMENT_LEN;
                if cma_table.len() < n {
                    cma_table.resize(n, 0);
                }
                let raw = &mut cma_table[..n];
                rd.read_payload(&stream, Bytes::from_mut(raw))
                    .await
                    .map_err(|e| io_error(peer, e, stall))?;
                let Some(initiator) = &cma_pid else {
                    let reason = "CWRITE/CREAD without an agreed same-host path".to_owned();
                    return Err(malformed(&stream, &mut conn, core, peer, id, reason).await);
                };
                let segs = match decode_cma_segments(raw, total) {
                    Ok(s) => s,
                    Err(e) => return Err(malformed(&stream, &mut conn, core, peer, id, e.0).await),
                };
                let plain: Vec<Segment> = segs.iter().map(|s| s.seg).collect();
                let guards = acquire_segments(core, &plain);
                if staged {
                    let Some(st) = &mut stage else {
                        let reason = "SWRITE/SREAD without a staging area".to_owned();
                        return Err(malformed(&stream, &mut conn, core, peer, id, reason).await);
                    };
                    let alive = || initiator.alive_for(&stream);
                    let slept = std::sync::atomic::AtomicU64::new(0);
                    let watch = crate::same_host::stage::Watch {
                        alive: &alive,
                        stall: cfg.stall_timeout,
                        // From the frame's first byte, as on the socket.
                        deadline: Some(crate::io::deadline(&pace, total)),
                        // Staged frames are served on the connection's own
                        // thread (`serve_on_thread`).
                        blocking: true,
                        // Told to the initiator below: it chooses the path.
                        slept: Some(&slept),
                    };
                    let failed: Vec<u32> = (0..guards.len() as u32)
                        .filter(|&i| guards[i as usize].is_err())
                        .collect();
                    let moved = staged_copy(st, read, &guards, &plain, &failed, &watch).await;
                    let slept = slept.into_inner();
                    if slept > 0 {
                        st.area
                            .target_slept()
                            .fetch_add(slept, std::sync::atomic::Ordering::Relaxed);
                    }
                    let status = failed_status(&guards);
                    drop(guards);
                    moved.map_err(|stop| {
                        let gone = "closed by the initiator, or its process exited";
                        stop.error(peer, cfg.stall_timeout, gone)
                    })?;
                    let (bytes, n) = landed(&plain, |i| !failed.contains(&(i as u32)));
                    if read {
                        served.read(bytes, n);
                    } else {
                        served.wrote(bytes, n);
                    }
                    if !failed.is_empty() {
                        conn.errv(id, status, &failed);
                    } else {
                        // Through the acknowledgement lane while the
                        // initiator's reader polls it (else with a WAKE);
                        // on the socket when the lane is full.
                        match st.area.acks().post(&mut st.ack_head, id) {
                            Some(true) => {}
                            Some(false) => conn.frame(&Response::Wake.encode()),
                            None => conn.ack(id, 0),
                        }
                    }
                    conn.count_bytes(total);
                    flush(&stream, &mut conn, core, peer).await?;
                    continue;
                }
                // An initiator that gave up on this connection (its batch
                // expired) may reuse the memory it named: copy nothing.
                if !initiator.alive_for(&stream) {
                    return Err(Error::PeerLost {
                        peer: peer.to_owned(),
                        reason: "closed by the initiator, or its process exited".to_owned(),
                    });
                }
                #[cfg(feature = "test-hooks")]
                crate::test_hooks::between_check_and_copy(read);
                let failed = cma_copy(
                    initiator.remote(),
                    read,
                    &segs,
                    &guards,
                    !overlapping(&plain),
                );
                drop(guards);
                let (bytes, n) = match &failed {
                    None => landed(&plain, |_| true),
                    Some((_, idx)) => landed(&plain, |i| !idx.contains(&(i as u32))),
                };
                if read {
                    served.read(bytes, n);
                } else {
                    served.wrote(bytes, n);
                }
                match failed {
                    None => conn.ack(id, total),
                    Some((status, idx)) => {
                        conn.errv(id, status, &idx);
                        conn.count_bytes(total);
                    }
                }
                // The copy is done: answer now (the initiator is waiting
                // for this; a pipelined next request is read right after).
                flush(&stream, &mut conn, core, peer).await?;
            }
            // Served by the core.
            _ => {}
        }
        if conn.wants_flush() {
            flush(&stream, &mut conn, core, peer).await?;
        }
    }
}

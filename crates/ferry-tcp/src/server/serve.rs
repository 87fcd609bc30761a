//! Serving an established connection: its state, the loop that reads
//! requests and answers them (acknowledgements coalesced), and the
//! same-host connection's own thread.

use super::copy::{acquire_segments, cma_copy, failed_status, staged_copy};
use super::*;

/// A connection's serving state, handed to a dedicated thread when the
/// same-host path is agreed.
pub(super) struct ConnState {
    pub(super) rd: FrameReader,
    pub(super) out: Out,
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

/// The bytes and the number of the non-empty segments `ok` accepts (by
/// index): what a served request moved.
fn landed(segs: &[Segment], ok: impl Fn(usize) -> bool) -> (u64, u64) {
    segs.iter()
        .enumerate()
        .filter(|&(i, s)| s.len > 0 && ok(i))
        .fold((0, 0), |(b, n), (_, s)| (b.saturating_add(s.len), n + 1))
}

/// Whether any two segments share a byte.
fn overlapping(segs: &[Segment]) -> bool {
    let mut sorted: Vec<(u64, u64)> = segs.iter().map(|s| (s.addr, s.len)).collect();
    sorted.sort_unstable();
    sorted
        .windows(2)
        .any(|w| w[0].0.saturating_add(w[0].1) > w[1].0)
}

pub(super) struct Out {
    pub(super) acks: Vec<u64>,
    pub(super) frames: Vec<u8>,
    /// Payload bytes covered by the pending acknowledgements.
    pub(super) bytes: u64,
}

impl Out {
    fn is_empty(&self) -> bool {
        self.acks.is_empty() && self.frames.is_empty()
    }

    fn errv(&mut self, id: u64, status: Status, failed: &[u32]) {
        self.frames.extend_from_slice(
            &Response::ErrV {
                id,
                status,
                count: failed.len() as u32,
            }
            .encode(),
        );
        for i in failed {
            self.frames.extend_from_slice(&i.to_le_bytes());
        }
    }

    fn err(&mut self, id: u64, status: Status, addr: u64, len: u64) {
        self.frames.extend_from_slice(
            &Response::Err {
                id,
                status,
                addr,
                len,
            }
            .encode(),
        );
    }

    /// Encodes the pending acknowledgements and frames into one buffer
    /// (metadata only) and clears them.
    fn take(&mut self) -> Vec<u8> {
        let mut buf = Vec::with_capacity(HEADER_LEN + self.acks.len() * 8 + self.frames.len());
        match self.acks.len() {
            0 => {}
            1 => buf.extend_from_slice(&Response::Ok { id: self.acks[0] }.encode()),
            n => {
                buf.extend_from_slice(&Response::OkMany { count: n as u32 }.encode());
                for id in &self.acks {
                    buf.extend_from_slice(&id.to_le_bytes());
                }
            }
        }
        buf.extend_from_slice(&self.frames);
        self.acks.clear();
        self.frames.clear();
        self.bytes = 0;
        buf
    }
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

async fn flush(stream: &Stream, out: &mut Out, core: &Core, peer: &str) -> Result<(), Error> {
    if out.is_empty() {
        return Ok(());
    }
    let buf = out.take();
    write_all_slices(stream, &[&buf], core.pace())
        .await
        .map_err(|e| io_error(peer, e, core.config.stall_timeout))
}

/// Framing is lost: answer what was processed, then `Malformed` for `id`,
/// and close (PROTOCOL.md §3).
async fn malformed(
    stream: &Stream,
    out: &mut Out,
    core: &Core,
    peer: &str,
    id: u64,
    reason: String,
) -> Error {
    out.err(id, Status::Malformed, 0, 0);
    let _ = flush(stream, out, core, peer).await;
    Error::Protocol {
        peer: peer.to_owned(),
        reason,
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
        mut out,
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
        if !out.is_empty()
            && !rd
                .poll_header_now(&stream)
                .map_err(|e| io_error(peer, e, stall))?
        {
            flush(&stream, &mut out, core, peer).await?;
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
                flush(&stream, &mut out, core, peer).await?;
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
            Err(e) => return Err(malformed(&stream, &mut out, core, peer, 0, e.0).await),
        };
        match req {
            Request::Write { id, addr, len, gen } => {
                rd.begin_frame(len);
                match core.acquire(addr, len, gen) {
                    Ok(guard) => {
                        // SAFETY: the guard keeps [addr, addr+len) registered
                        // and therefore valid (MemoryRegion::from_raw_parts
                        // contract) until it drops below; recvmsg(2) writes
                        // the payload straight into it, the way a NIC's DMA
                        // writes registered memory.
                        let dst = unsafe { Bytes::from_raw(guard.as_ptr(), guard.len() as usize) };
                        rd.read_payload(&stream, dst)
                            .await
                            .map_err(|e| io_error(peer, e, stall))?;
                        drop(guard);
                        served.wrote(len, 1);
                        out.acks.push(id);
                        out.bytes += len;
                    }
                    Err(status) => {
                        rd.discard(&stream, len, true)
                            .await
                            .map_err(|e| io_error(peer, e, stall))?;
                        out.err(id, status, addr, len);
                    }
                }
            }
            Request::Read { id, addr, len, gen } => match core.acquire(addr, len, gen) {
                Ok(guard) => {
                    let meta = out.take();
                    let hdr = Response::Data { id, len }.encode();
                    // SAFETY: as for writes; sendmsg(2) only reads it.
                    let src = unsafe { Bytes::from_raw(guard.as_ptr(), guard.len() as usize) };
                    write_all(
                        &stream,
                        &[Bytes::from_ref(&meta), Bytes::from_ref(&hdr), src],
                        pace,
                    )
                    .await
                    .map_err(|e| io_error(peer, e, stall))?;
                    drop(guard);
                    served.read(len, 1);
                }
                Err(status) => out.err(id, status, addr, len),
            },
            Request::Notify {
                id,
                name_len,
                msg_len,
            } => {
                rd.begin_frame(name_len + msg_len);
                // Bounded by the decoder: at most 256 + 64 KiB.
                let mut buf = vec![0u8; (name_len + msg_len) as usize];
                rd.read_payload(&stream, Bytes::from_mut(&mut buf))
                    .await
                    .map_err(|e| io_error(peer, e, stall))?;
                // Exact-size copies: the queue holds what it counts.
                let (name, msg) = buf.split_at(name_len as usize);
                let n = match (std::str::from_utf8(name), std::str::from_utf8(msg)) {
                    (Ok(name), Ok(message)) => Some(Notification {
                        name: name.to_owned(),
                        message: message.to_owned(),
                    }),
                    _ => None,
                };
                drop(buf);
                match n.filter(|n| n.validate().is_ok()) {
                    None => out.err(id, Status::NotifyInvalid, name_len, msg_len),
                    Some(n) => {
                        let refused = core.refuse_notifications.load(Ordering::Relaxed);
                        if refused {
                            // Counted as the inbox's own refusals are.
                            core.notifications
                                .count_refused(ferry_core::raw::PushRefused::Full);
                        }
                        if refused || core.notifications.push(n).is_err() {
                            // Full (or the engine shutting down): the
                            // sender sees a retryable refusal.
                            out.err(id, Status::NotifyQueueFull, name_len, msg_len);
                        } else {
                            out.acks.push(id);
                        }
                    }
                }
            }
            Request::WriteV { id, count, total } => {
                rd.begin_frame(count as u64 * SEGMENT_LEN as u64 + total);
                let mut raw = [0u8; MAX_SEGMENTS as usize * SEGMENT_LEN];
                let raw = &mut raw[..count as usize * SEGMENT_LEN];
                rd.read_part(&stream, Bytes::from_mut(raw))
                    .await
                    .map_err(|e| io_error(peer, e, stall))?;
                let segs = match decode_segments(raw, total) {
                    Ok(s) => s,
                    Err(e) => return Err(malformed(&stream, &mut out, core, peer, id, e.0).await),
                };
                let guards = acquire_segments(core, &segs);
                if guards.iter().all(Result::is_ok) && !overlapping(&segs) {
                    // One readv straight into every destination.
                    let dsts: Vec<Bytes<'static>> = guards
                        .iter()
                        .flatten()
                        // SAFETY: as for WRITE: each guard keeps its range
                        // registered until `guards` drops below.
                        .map(|g| unsafe { Bytes::from_raw(g.as_ptr(), g.len() as usize) })
                        .collect();
                    rd.read_v(&stream, &dsts, true)
                        .await
                        .map_err(|e| io_error(peer, e, stall))?;
                    out.acks.push(id);
                } else {
                    // Segment by segment, in order; refused ones discarded.
                    // Only the last segment ends the frame (header top-up).
                    let mut failed = Vec::new();
                    let last = segs.len() - 1;
                    for (i, (g, s)) in guards.iter().zip(&segs).enumerate() {
                        let r = match g {
                            Ok(g) => {
                                // SAFETY: as for WRITE.
                                let dst = unsafe { Bytes::from_raw(g.as_ptr(), g.len() as usize) };
                                if i == last {
                                    rd.read_payload(&stream, dst).await
                                } else {
                                    rd.read_part(&stream, dst).await
                                }
                            }
                            Err(_) => {
                                failed.push(i as u32);
                                rd.discard(&stream, s.len, i == last).await
                            }
                        };
                        r.map_err(|e| io_error(peer, e, stall))?;
                    }
                    if failed.is_empty() {
                        out.acks.push(id);
                    } else {
                        out.errv(id, failed_status(&guards), &failed);
                    }
                }
                let (bytes, n) = landed(&segs, |i| guards[i].is_ok());
                served.wrote(bytes, n);
                drop(guards);
                out.bytes += total;
            }
            Request::ReadV { id, count, total } => {
                rd.begin_frame(count as u64 * SEGMENT_LEN as u64);
                let mut raw = [0u8; MAX_SEGMENTS as usize * SEGMENT_LEN];
                let raw = &mut raw[..count as usize * SEGMENT_LEN];
                // The segment table ends the frame.
                rd.read_payload(&stream, Bytes::from_mut(raw))
                    .await
                    .map_err(|e| io_error(peer, e, stall))?;
                let segs = match decode_segments(raw, total) {
                    Ok(s) => s,
                    Err(e) => return Err(malformed(&stream, &mut out, core, peer, id, e.0).await),
                };
                let guards = acquire_segments(core, &segs);
                let mut failed = Vec::new();
                let mut valid = 0u64;
                for (i, (g, s)) in guards.iter().zip(&segs).enumerate() {
                    match g {
                        Ok(_) => valid += s.len,
                        Err(_) => failed.extend_from_slice(&(i as u32).to_le_bytes()),
                    }
                }
                let meta = out.take();
                let hdr = Response::DataV {
                    id,
                    status: (!failed.is_empty()).then(|| failed_status(&guards)),
                    failed: (failed.len() / 4) as u32,
                    len: valid,
                }
                .encode();
                let mut bufs = vec![
                    Bytes::from_ref(&meta),
                    Bytes::from_ref(&hdr),
                    Bytes::from_ref(&failed),
                ];
                for g in guards.iter().flatten() {
                    // SAFETY: as for READ: the guard keeps the range
                    // registered until `guards` drops below; sendmsg(2) only
                    // reads it.
                    bufs.push(unsafe { Bytes::from_raw(g.as_ptr(), g.len() as usize) });
                }
                write_all(&stream, &bufs, pace)
                    .await
                    .map_err(|e| io_error(peer, e, stall))?;
                drop(bufs);
                let (bytes, n) = landed(&segs, |i| guards[i].is_ok());
                served.read(bytes, n);
                drop(guards);
            }
            Request::SameHost {
                id,
                channel,
                stage: offered_stage,
            } => {
                rd.begin_frame(cma::OFFER_LEN as u64);
                let mut raw = [0u8; cma::OFFER_LEN];
                rd.read_payload(&stream, Bytes::from_mut(&mut raw))
                    .await
                    .map_err(|e| io_error(peer, e, stall))?;
                let offer = cma::Offer::decode(&raw);
                if std::mem::replace(&mut offered, true) {
                    let reason = "a second SAME_HOST offer on one connection".to_owned();
                    return Err(malformed(&stream, &mut out, core, peer, id, reason).await);
                }
                // The offered PID is trusted only once proven (see
                // `cma::check_offer_on`); until then the target makes no
                // system call on it, and whatever fails, the peer is told
                // only "refused" (the detail goes to this log).
                let verdict = match &stream {
                    _ if cfg.same_host == SameHost::Off => Err((cma::Refusal::Disabled, None)),
                    _ if !agreed.theirs.enabled(crate::negotiate::SAME_HOST) => {
                        let reason = "SAME_HOST from a peer that did not announce it".to_owned();
                        return Err(malformed(&stream, &mut out, core, peer, id, reason).await);
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
                        return Err(malformed(&stream, &mut out, core, peer, id, reason).await);
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
                        out.frames.extend_from_slice(&answer.encode());
                        let stream = match taken {
                            Ok(unix) => {
                                // Answer on the TCP connection (the initiator
                                // sent nothing after its offer), which then
                                // closes: the connection goes on over the
                                // channel.
                                flush(&stream, &mut out, core, peer).await?;
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
                            out,
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
                        out.err(id, Status::SameHostRefused, why as u64, 0);
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
                rd.begin_frame(count as u64 * CMA_SEGMENT_LEN as u64);
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
                    return Err(malformed(&stream, &mut out, core, peer, id, reason).await);
                };
                let segs = match decode_cma_segments(raw, total) {
                    Ok(s) => s,
                    Err(e) => return Err(malformed(&stream, &mut out, core, peer, id, e.0).await),
                };
                let plain: Vec<Segment> = segs.iter().map(|s| s.seg).collect();
                let guards = acquire_segments(core, &plain);
                if staged {
                    let Some(st) = &mut stage else {
                        let reason = "SWRITE/SREAD without a staging area".to_owned();
                        return Err(malformed(&stream, &mut out, core, peer, id, reason).await);
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
                        out.errv(id, status, &failed);
                    } else {
                        // Through the acknowledgement lane while the
                        // initiator's reader polls it (else with a WAKE);
                        // on the socket when the lane is full.
                        match st.area.acks().post(&mut st.ack_head, id) {
                            Some(true) => {}
                            Some(false) => out.frames.extend_from_slice(&Response::Wake.encode()),
                            None => out.acks.push(id),
                        }
                    }
                    out.bytes += total;
                    flush(&stream, &mut out, core, peer).await?;
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
                    None => out.acks.push(id),
                    Some((status, idx)) => out.errv(id, status, &idx),
                }
                out.bytes += total;
                // The copy is done: answer now (the initiator is waiting
                // for this; a pipelined next request is read right after).
                flush(&stream, &mut out, core, peer).await?;
            }
            Request::Table { id } => {
                let meta = out.take();
                let (count, table) = core.table_bytes();
                let hdr = Response::Table { id, count }.encode();
                write_all_slices(&stream, &[&meta, &hdr, &table], pace)
                    .await
                    .map_err(|e| io_error(peer, e, stall))?;
            }
        }
        if out.acks.len() >= MAX_ACKS as usize
            || out.bytes >= ACK_FLUSH_BYTES
            || out.frames.len() >= 16 * 1024
        {
            flush(&stream, &mut out, core, peer).await?;
        }
    }
}

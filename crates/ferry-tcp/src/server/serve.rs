//! Serving an established connection: its state, the loop that reads
//! requests and answers them (acknowledgements coalesced), and the
//! same-host connection's own thread.

use super::copy::{cma_copy, staged_copy};
use super::*;
use ferry_tcp_proto::target::{
    frame_bytes, Copy, Delivered, Moved, Part, SameHost as SameHostPath, Step, Take, TargetConn,
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

/// What the same-host steps of a connection use.
struct Side<'a> {
    served: &'a ferry_core::inbound::ServedPeer,
    /// The initiator's process, once the path is agreed.
    initiator: Option<&'a Arc<cma::Initiator>>,
    /// The staging area, once mapped.
    stage: Option<&'a mut TargetStage>,
}

/// A SAME_HOST offer for the driver to prove ([`Step::Prove`]).
struct ToProve {
    id: u64,
    channel: Take,
    stage: Take,
    grants: bool,
}

/// Executes the core's steps for one request until it is served;
/// `Some`: an offer to prove (the bytes are in the core's buffer).
async fn run_step(
    stream: &Stream,
    rd: &mut FrameReader,
    conn: &mut TargetConn,
    core: &Core,
    peer: &str,
    side: Side<'_>,
    mut step: Step<RegionGuard>,
) -> Result<Option<ToProve>, Error> {
    let stall = core.config.stall_timeout;
    let io = |e| io_error(peer, e, stall);
    loop {
        step = match step {
            Step::Done => return Ok(None),
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
                receive(stream, rd, &parts, one_call).await.map_err(io)?;
                drop(parts);
                conn.received();
                side.served.wrote(landed.0, landed.1);
                return Ok(None);
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
                side.served.read(landed.0, landed.1);
                return Ok(None);
            }
            Step::Table { meta, id } => {
                let (count, table) = core.table_bytes();
                let hdr = Response::Table { id, count }.encode();
                write_all_slices(stream, &[&meta, &hdr, &table], core.pace())
                    .await
                    .map_err(io)?;
                return Ok(None);
            }
            Step::Close(reason) => return Err(closed(stream, conn, core, peer, reason).await),
            Step::Prove {
                id,
                channel,
                stage,
                grants,
            } => {
                return Ok(Some(ToProve {
                    id,
                    channel,
                    stage,
                    grants,
                }))
            }
            Step::Copy(c) => {
                let moved = copy(stream, conn, peer, side.initiator, c)?;
                count(side.served, moved);
                flush(stream, conn, core, peer).await?;
                return Ok(None);
            }
            Step::Staged(c) => {
                let moved = staged(stream, conn, core, peer, side.initiator, side.stage, c).await?;
                count(side.served, moved);
                flush(stream, conn, core, peer).await?;
                return Ok(None);
            }
        };
    }
}

/// Reads a payload into the parts of a [`Step::Receive`].
async fn receive(
    stream: &Stream,
    rd: &mut FrameReader,
    parts: &[Part<RegionGuard>],
    one_call: bool,
) -> std::io::Result<()> {
    if one_call {
        let dsts: Vec<Bytes<'static>> = parts
            .iter()
            .filter_map(|p| match p {
                Part::Into(g, _) => Some(held(g)),
                Part::Skip(_) => None,
            })
            .collect();
        return rd.read_v(stream, &dsts, true).await;
    }
    // In order; only the last part ends the frame (header top-up).
    let last = parts.len().saturating_sub(1);
    for (i, part) in parts.iter().enumerate() {
        match part {
            Part::Into(g, _) if i == last => rd.read_payload(stream, held(g)).await,
            Part::Into(g, _) => rd.read_part(stream, held(g)).await,
            Part::Skip(len) => rd.discard(stream, *len, i == last).await,
        }?;
    }
    Ok(())
}

/// Adds what a same-host request moved to the peer's counters.
fn count(served: &ferry_core::inbound::ServedPeer, m: Moved) {
    if m.read {
        served.read(m.bytes, m.ranges);
    } else {
        served.wrote(m.bytes, m.ranges);
    }
}

/// The initiator gave up on this connection, or its process exited.
fn gone(peer: &str) -> Error {
    Error::PeerLost {
        peer: peer.to_owned(),
        reason: "closed by the initiator, or its process exited".to_owned(),
    }
}

/// Executes a [`Step::Copy`]: the initiator's check, then the kernel
/// copies.
fn copy(
    stream: &Stream,
    conn: &mut TargetConn,
    peer: &str,
    initiator: Option<&Arc<cma::Initiator>>,
    c: Copy<RegionGuard>,
) -> Result<Moved, Error> {
    // The core asks for copies only once the path is agreed.
    let Some(initiator) = initiator else {
        return Err(gone(peer));
    };
    // An initiator that gave up on this connection (its batch expired) may
    // reuse the memory it named: copy nothing.
    if !initiator.alive_for(stream) {
        return Err(gone(peer));
    }
    let failed = cma_copy(initiator.remote(), &c);
    let Copy { segs, holds, .. } = c;
    drop(holds);
    Ok(conn.copied(&segs, &failed))
}

/// Executes a [`Step::Staged`] through the connection's staging area.
async fn staged(
    stream: &Stream,
    conn: &mut TargetConn,
    core: &Core,
    peer: &str,
    initiator: Option<&Arc<cma::Initiator>>,
    stage: Option<&mut TargetStage>,
    c: Copy<RegionGuard>,
) -> Result<Moved, Error> {
    let (Some(initiator), Some(st)) = (initiator, stage) else {
        return Err(gone(peer));
    };
    let cfg = &core.config;
    let alive = || initiator.alive_for(stream);
    let slept = std::sync::atomic::AtomicU64::new(0);
    let total = c.segs.iter().map(|s| s.seg.len).sum();
    let watch = crate::same_host::stage::Watch {
        alive: &alive,
        stall: cfg.stall_timeout,
        // From the frame's first byte, as on the socket.
        deadline: Some(crate::io::deadline(&core.pace(), total)),
        // Staged frames are served on the connection's own thread
        // (`serve_on_thread`).
        blocking: true,
        // Told to the initiator below: it chooses the path.
        slept: Some(&slept),
    };
    let moved = staged_copy(st, c.read, &c.holds, &c.segs, &watch).await;
    let slept = slept.into_inner();
    if slept > 0 {
        st.area.target_slept().fetch_add(slept, Ordering::Relaxed);
    }
    let Copy { segs, holds, .. } = c;
    drop(holds);
    moved.map_err(|stop| {
        let gone = "closed by the initiator, or its process exited";
        stop.error(peer, cfg.stall_timeout, gone)
    })?;
    // Through the acknowledgement lane while the initiator's reader polls
    // it (else with a WAKE); on the socket when the lane is full.
    Ok(conn.staged(&segs, |id| st.area.acks().post(&mut st.ack_head, id)))
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
    let stall = cfg.stall_timeout;
    let ConnState {
        mut rd,
        mut conn,
        cma_pid,
        mut stage,
        agreed,
        mut cred,
        served,
    } = st;
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
        let offered = conn.same_host() != SameHostPath::Unoffered;
        let step = conn.on_request(req, &mut Table(core));
        let side = Side {
            served: &served,
            initiator: cma_pid.as_ref(),
            stage: stage.as_mut(),
        };
        if let Some(offer) = run_step(&stream, &mut rd, &mut conn, core, peer, side, step).await? {
            let mut raw = [0u8; cma::OFFER_LEN];
            raw.copy_from_slice(&conn.buf()[..cma::OFFER_LEN]);
            let offer_bytes = cma::Offer::decode(&raw);
            match prove(&stream, cred.take(), &offer_bytes, cfg) {
                Ok(initiator) => {
                    let st = ConnState {
                        rd,
                        conn,
                        cma_pid: None,
                        stage: None,
                        agreed,
                        cred: None,
                        served,
                    };
                    return agree(stream, peer, core, st, initiator, offer).await;
                }
                Err(detail) => {
                    tracing::info!(%peer, pid = offer_bytes.pid, %detail, "same-host path refused");
                    // No errno, no detail: one answer for every reason.
                    conn.refused(offer.id, cma::Refusal::Refused);
                }
            }
        } else if !offered && conn.same_host() == SameHostPath::Refused {
            // Refused by the core, no system call made: `same_host=off`.
            tracing::info!(%peer, detail = "same_host=off", "same-host path refused");
        }
        if conn.wants_flush() {
            flush(&stream, &mut conn, core, peer).await?;
        }
    }
}

/// Proves a SAME_HOST offer: the offered PID is trusted only once proven
/// (see `cma::check_offer_on`); until then the target makes no system call
/// on it. The error is for this log only.
fn prove(
    stream: &Stream,
    cred: Option<cma::CredListener>,
    offer: &cma::Offer,
    cfg: &TcpConfig,
) -> Result<cma::Initiator, String> {
    match (cred, stream.tcp_addrs()) {
        (None, _) => Err(
            "the peer did not prove its credentials (same-host-cred: a Ferry build without it, \
             or not on this host)"
                .to_owned(),
        ),
        (Some(_), None) => Err("no TCP addresses".to_owned()),
        (Some(l), Some(addrs)) => l
            .prove()
            .and_then(|proof| cma::check_offer_on(addrs, offer, proof, &cfg.same_host_uids)),
    }
}

/// Takes what a proven offer names as the core decided ([`Take`]), queues
/// SAME_HOST_OK and hands the connection to its own thread (over the
/// control channel if taken).
async fn agree(
    stream: Stream,
    peer: &str,
    core: &Core,
    mut st: ConnState,
    initiator: cma::Initiator,
    offer: ToProve,
) -> Result<Served, Error> {
    let cfg = &core.config;
    let channel = take(offer.channel, |fd| initiator.take_channel(fd));
    let area = take(offer.stage, |fd| initiator.take_stage(fd, offer.grants));
    let staging = area.as_ref().map(|_| ()).map_err(|e| *e);
    let initiator = Arc::new(initiator);
    tracing::debug!(%peer, pid = initiator.pid, ?channel, ?staging, "same-host path agreed");
    st.stage = area.ok().map(|area| {
        let area = Arc::new(area);
        // Published before the answer: the initiator reads the page once
        // it has it.
        let link = offer
            .grants
            .then(|| {
                core.grants
                    .attach(Arc::clone(&area), Arc::clone(&initiator), st.served.clone())
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
    st.cma_pid = Some(initiator);
    // Its requests are headers with short segment tables: one `recvmsg`
    // each.
    st.rd.set_lookahead();
    st.conn.agreed(
        offer.id,
        channel.as_ref().map(|_| ()).map_err(|e| *e),
        staging,
    );
    let stream = match channel {
        Ok(unix) => {
            // Answer on the TCP connection (the initiator sent nothing
            // after its offer), which then closes: the connection goes on
            // over the channel.
            flush(&stream, &mut st.conn, core, peer).await?;
            st.rd = FrameReader::new(cfg.spin, core.pace());
            st.rd.set_lookahead();
            Stream::Quiet(
                crate::quiet::Quiet::new(unix.into(), true)
                    .map_err(|e| io_error(peer, e, cfg.stall_timeout))?,
            )
        }
        Err(_) => stream,
    };
    Ok(Served::ToThread(stream, Box::new(st)))
}

/// Takes a descriptor of the initiator's as the core decided: the errno
/// the peer is told if not (0: none offered).
fn take<T>(t: Take, f: impl FnOnce(u32) -> Result<T, i32>) -> Result<T, u32> {
    match t {
        Take::NotOffered => Err(0),
        Take::NotAgreed => Err(libc::EOPNOTSUPP as u32),
        Take::Fd(fd) => f(fd).map_err(|e| e as u32),
    }
}

//! The target side: accepts connections, runs the handshake, and serves
//! WRITE / READ / NOTIFY / TABLE requests against the engine's region table.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard};

use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinSet;
use transport_core::{Error, Notification, RegionGuard, RegionTable, Side};

use crate::config::TcpConfig;
use crate::frame::{
    decode_segments, Request, Response, Status, HEADER_LEN, MAX_ACKS, MAX_SEGMENTS,
};
use crate::handshake;
use crate::io::{write_all, write_all_slices, Bytes, FrameReader, Next};

/// Payload bytes received after which pending acknowledgements are sent
/// even if more requests are already waiting (so large transfers complete
/// progressively).
const ACK_FLUSH_BYTES: u64 = 512 * 1024;

/// Most notification bytes (names and messages) queued before NOTIFY
/// requests are refused.
pub const MAX_QUEUED_NOTIFICATION_BYTES: usize = 64 << 20;

/// Notifications received and not yet taken, with their total size.
#[derive(Debug, Default)]
pub struct NotificationQueue {
    /// Oldest first.
    pub queue: VecDeque<Notification>,
    /// Sum of name and message lengths in `queue`.
    pub bytes: usize,
}

/// Most notifications queued before NOTIFY requests are refused.
pub const MAX_QUEUED_NOTIFICATIONS: usize = 65_536;

/// State the target side shares with the rest of the engine.
#[derive(Debug)]
pub struct Core {
    /// The engine's segment name.
    pub name: String,
    /// Its configuration.
    pub config: TcpConfig,
    /// Its registered regions.
    pub regions: RegionTable,
    /// Notifications received, oldest first.
    pub notifications: Mutex<NotificationQueue>,
}

pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Critical sections are single collection operations; a poisoned lock
    // still holds consistent data.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Accepts connections until aborted; dropping this future aborts every
/// connection it serves.
pub async fn accept_loop(listener: TcpListener, core: Arc<Core>) {
    let mut conns = JoinSet::new();
    loop {
        let (stream, addr) = match listener.accept().await {
            Ok(x) => x,
            Err(e) => {
                tracing::warn!(error = %e, "accept failed");
                tokio::time::sleep(std::time::Duration::from_millis(10)).await;
                continue;
            }
        };
        while conns.try_join_next().is_some() {}
        if conns.len() >= core.config.max_inbound {
            tracing::warn!(%addr, limit = core.config.max_inbound, "refusing connection: too many inbound connections");
            drop(stream);
            continue;
        }
        let core = Arc::clone(&core);
        conns.spawn(async move {
            let peer = addr.to_string();
            if let Err(e) = serve(stream, &peer, &core).await {
                tracing::debug!(%peer, error = %e, "inbound connection ended");
            }
        });
    }
}

/// Whether any two segments share a byte.
fn overlapping(segs: &[(u64, u64)]) -> bool {
    let mut sorted = segs.to_vec();
    sorted.sort_unstable();
    sorted
        .windows(2)
        .any(|w| w[0].0.saturating_add(w[0].1) > w[1].0)
}

struct Out {
    acks: Vec<u64>,
    frames: Vec<u8>,
    /// Payload bytes covered by the pending acknowledgements.
    bytes: u64,
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

fn io_error(peer: &str, e: std::io::Error) -> Error {
    Error::PeerLost {
        peer: peer.to_owned(),
        reason: e.to_string(),
    }
}

/// Decodes a WRITEV/READV segment table and holds every segment that lies in
/// a registered region (`None` for the others, which fail individually).
#[allow(clippy::type_complexity)]
fn acquire_segments(
    core: &Core,
    raw: &[u8],
    total: u64,
    peer: &str,
) -> Result<(Vec<(u64, u64)>, Vec<Option<RegionGuard>>), Error> {
    let segs = decode_segments(raw, total).map_err(|e| Error::Protocol {
        peer: peer.to_owned(),
        reason: e.0,
    })?;
    let guards = segs
        .iter()
        .map(|&(a, l)| core.regions.acquire(a, l, Side::Remote, None).ok())
        .collect();
    Ok((segs, guards))
}

async fn flush(stream: &TcpStream, out: &mut Out, core: &Core, peer: &str) -> Result<(), Error> {
    if out.is_empty() {
        return Ok(());
    }
    let buf = out.take();
    write_all_slices(stream, &[&buf], core.config.request_timeout)
        .await
        .map_err(|e| io_error(peer, e))
}

/// Serves one inbound connection until EOF, an error or abort.
async fn serve(stream: TcpStream, peer: &str, core: &Core) -> Result<(), Error> {
    let _ = stream.set_nodelay(true);
    let cfg = &core.config;
    let peer_name = tokio::time::timeout(
        cfg.connect_timeout,
        handshake::server(
            &stream,
            peer,
            &core.name,
            cfg.secret.as_deref(),
            &core.regions,
            cfg.connect_timeout,
        ),
    )
    .await
    .map_err(|_| Error::Timeout {
        operation: "handshake".to_owned(),
        peer: Some(peer.to_owned()),
        after: cfg.connect_timeout,
    })??;
    let peer = format!("{peer_name} ({peer})");
    let peer = peer.as_str();
    tracing::debug!(%peer, "peer connected");

    let mut rd = FrameReader::new(cfg.spin, cfg.request_timeout);
    let mut out = Out {
        acks: Vec::with_capacity(MAX_ACKS as usize),
        frames: Vec::new(),
        bytes: 0,
    };
    loop {
        // Answer everything processed so far before waiting for more input.
        if !rd.poll_header_now(&stream).map_err(|e| io_error(peer, e))? {
            flush(&stream, &mut out, core, peer).await?;
        }
        let hdr = match rd
            .next_header(&stream)
            .await
            .map_err(|e| io_error(peer, e))?
        {
            Next::Header(h) => h,
            Next::Eof => {
                flush(&stream, &mut out, core, peer).await?;
                return Ok(());
            }
        };
        let req = match Request::decode(&hdr) {
            Ok(r) => r,
            Err(e) => {
                // Framing is lost: answer what we can and close.
                out.err(0, Status::Malformed, 0, 0);
                let _ = flush(&stream, &mut out, core, peer).await;
                return Err(Error::Protocol {
                    peer: peer.to_owned(),
                    reason: e.0,
                });
            }
        };
        match req {
            Request::Write { id, addr, len } => {
                match core.regions.acquire(addr, len, Side::Remote, None) {
                    Ok(guard) => {
                        // SAFETY: the guard keeps [addr, addr+len) registered
                        // and therefore valid (MemoryRegion::from_raw_parts
                        // contract) until it drops below; recvmsg(2) writes
                        // the payload straight into it, the way a NIC's DMA
                        // writes registered memory.
                        let dst = unsafe { Bytes::from_raw(guard.as_ptr(), guard.len() as usize) };
                        rd.read_payload(&stream, dst)
                            .await
                            .map_err(|e| io_error(peer, e))?;
                        drop(guard);
                        out.acks.push(id);
                        out.bytes += len;
                    }
                    Err(_) => {
                        rd.discard(&stream, len, true)
                            .await
                            .map_err(|e| io_error(peer, e))?;
                        out.err(id, Status::AddressNotRegistered, addr, len);
                    }
                }
            }
            Request::Read { id, addr, len } => {
                match core.regions.acquire(addr, len, Side::Remote, None) {
                    Ok(guard) => {
                        let meta = out.take();
                        let hdr = Response::Data { id, len }.encode();
                        // SAFETY: as for writes; sendmsg(2) only reads it.
                        let src = unsafe { Bytes::from_raw(guard.as_ptr(), guard.len() as usize) };
                        write_all(
                            &stream,
                            &[Bytes::from_ref(&meta), Bytes::from_ref(&hdr), src],
                            cfg.request_timeout,
                        )
                        .await
                        .map_err(|e| io_error(peer, e))?;
                        drop(guard);
                    }
                    Err(_) => out.err(id, Status::AddressNotRegistered, addr, len),
                }
            }
            Request::Notify {
                id,
                name_len,
                msg_len,
            } => {
                // Bounded by the decoder: at most 256 + 64 KiB.
                let mut buf = vec![0u8; (name_len + msg_len) as usize];
                rd.read_payload(&stream, Bytes::from_mut(&mut buf))
                    .await
                    .map_err(|e| io_error(peer, e))?;
                let msg = buf.split_off(name_len as usize);
                let n = match (String::from_utf8(buf), String::from_utf8(msg)) {
                    (Ok(name), Ok(message)) => Some(Notification { name, message }),
                    _ => None,
                };
                match n.filter(|n| n.validate().is_ok()) {
                    None => out.err(id, Status::NotifyInvalid, name_len, msg_len),
                    Some(n) => {
                        let size = n.name.len() + n.message.len();
                        let mut q = lock(&core.notifications);
                        if q.queue.len() >= MAX_QUEUED_NOTIFICATIONS
                            || q.bytes + size > MAX_QUEUED_NOTIFICATION_BYTES
                        {
                            drop(q);
                            out.err(id, Status::NotifyQueueFull, name_len, msg_len);
                        } else {
                            q.queue.push_back(n);
                            q.bytes += size;
                            drop(q);
                            out.acks.push(id);
                        }
                    }
                }
            }
            Request::WriteV { id, count, total } => {
                let mut raw = [0u8; MAX_SEGMENTS as usize * 16];
                let raw = &mut raw[..count as usize * 16];
                rd.read_part(&stream, Bytes::from_mut(raw))
                    .await
                    .map_err(|e| io_error(peer, e))?;
                let (segs, guards) = acquire_segments(core, raw, total, peer)?;
                if guards.iter().all(Option::is_some) && !overlapping(&segs) {
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
                        .map_err(|e| io_error(peer, e))?;
                    out.acks.push(id);
                } else {
                    // Segment by segment, in order; refused ones discarded.
                    // Only the last segment ends the frame (header top-up).
                    let mut failed = Vec::new();
                    let last = segs.len() - 1;
                    for (i, (g, &(_, len))) in guards.iter().zip(&segs).enumerate() {
                        let r = match g {
                            Some(g) => {
                                // SAFETY: as for WRITE.
                                let dst = unsafe { Bytes::from_raw(g.as_ptr(), g.len() as usize) };
                                if i == last {
                                    rd.read_payload(&stream, dst).await
                                } else {
                                    rd.read_part(&stream, dst).await
                                }
                            }
                            None => {
                                failed.push(i as u32);
                                rd.discard(&stream, len, i == last).await
                            }
                        };
                        r.map_err(|e| io_error(peer, e))?;
                    }
                    if failed.is_empty() {
                        out.acks.push(id);
                    } else {
                        out.errv(id, Status::AddressNotRegistered, &failed);
                    }
                }
                drop(guards);
                out.bytes += total;
            }
            Request::ReadV { id, count, total } => {
                let mut raw = [0u8; MAX_SEGMENTS as usize * 16];
                let raw = &mut raw[..count as usize * 16];
                // The segment table ends the frame.
                rd.read_payload(&stream, Bytes::from_mut(raw))
                    .await
                    .map_err(|e| io_error(peer, e))?;
                let (segs, guards) = acquire_segments(core, raw, total, peer)?;
                let mut failed = Vec::new();
                let mut valid = 0u64;
                for (i, (g, &(_, len))) in guards.iter().zip(&segs).enumerate() {
                    match g {
                        Some(_) => valid += len,
                        None => failed.extend_from_slice(&(i as u32).to_le_bytes()),
                    }
                }
                let meta = out.take();
                let hdr = Response::DataV {
                    id,
                    status: (!failed.is_empty()).then_some(Status::AddressNotRegistered),
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
                write_all(&stream, &bufs, cfg.request_timeout)
                    .await
                    .map_err(|e| io_error(peer, e))?;
                drop(bufs);
                drop(guards);
            }
            Request::Table { id } => {
                let meta = out.take();
                let (count, table) = handshake::table_bytes(&core.regions);
                let hdr = Response::Table { id, count }.encode();
                write_all_slices(&stream, &[&meta, &hdr, &table], cfg.request_timeout)
                    .await
                    .map_err(|e| io_error(peer, e))?;
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

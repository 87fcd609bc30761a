//! The target side: accepts connections, runs the handshake, and serves
//! WRITE / READ / NOTIFY / TABLE requests against the engine's region table.
//!
//! Inbound connections are bounded twice: at most `max_handshakes` in the
//! handshake (a small budget with a short deadline; when it is full, a new
//! connection evicts the oldest handshake of the source address holding the
//! most slots) and at most `max_inbound` established ones. When those are
//! full, a newly authenticated connection evicts the established connection
//! of the source holding the most that has been idle longest (at least
//! `evict_idle`); if none has, new connections receive `Busy`. Established connections are closed after
//! `idle_timeout` without a request, and every payload must move at
//! `min_rate` (after a `stall_timeout` grace), so a region is never held by
//! a slow peer for longer than that.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::net::{TcpListener, TcpStream};

use crate::stream::Stream;
use tokio::sync::{oneshot, Notify};
use tokio::task::JoinSet;
use transport_core::raw::lock;
use transport_core::{Error, MemoryRegion, Notification, RegionGuard, RegionTable, Side};

use crate::config::TcpConfig;
use crate::frame::{
    decode_cma_segments, decode_segments, encode_table, Request, Response, Segment, Status,
    TableEntry, CMA_SEGMENT_LEN, HEADER_LEN, MAX_ACKS, MAX_SEGMENTS, MAX_TABLE_ENTRIES,
    SEGMENT_LEN,
};
use crate::handshake;
use crate::io::{write_all, write_all_slices, Bytes, FrameReader, Next, Pace};
use crate::same_host::cma::{self, SameHost};

/// Payload bytes received after which pending acknowledgements are sent
/// even if more requests are already waiting (so large transfers complete
/// progressively).
const ACK_FLUSH_BYTES: u64 = 512 * 1024;

/// Most bytes of memory the queued notifications may occupy, counted as
/// allocated (string capacities plus a fixed per-notification overhead).
/// Beyond it NOTIFY requests are refused with `NotifyQueueFull`, which the
/// sender sees as a retryable error. A consumer that processes what one
/// `take_notifications` returned before taking again therefore holds at
/// most twice this much.
pub const MAX_QUEUED_NOTIFICATION_BYTES: usize = 32 << 20;

/// Bytes counted for each queued notification besides its strings (the
/// `Notification` itself, its queue slot and allocator headers).
pub const NOTIFICATION_OVERHEAD: usize = std::mem::size_of::<Notification>() + 64;

/// How long a refused connection's rejection may take to send.
const REJECT_TIMEOUT: Duration = Duration::from_millis(200);

/// An established inbound connection, as the admission logic sees it.
#[derive(Debug)]
struct Live {
    source: IpAddr,
    /// Milliseconds after the core's epoch when it started waiting idle
    /// for a request (0: busy).
    idle_since: AtomicU64,
    /// Chosen for eviction (not to be chosen again).
    evicted: AtomicBool,
    /// Tells the connection to close when it is (or next is) idle.
    evict: Notify,
}

/// Notifications received and not yet taken, with the memory they occupy.
#[derive(Debug, Default)]
pub struct NotificationQueue {
    /// Oldest first.
    pub queue: VecDeque<Notification>,
    /// Bytes allocated for `queue`'s notifications (see
    /// [`MAX_QUEUED_NOTIFICATION_BYTES`]).
    pub bytes: usize,
}

/// Most notifications queued before NOTIFY requests are refused.
pub const MAX_QUEUED_NOTIFICATIONS: usize = 65_536;

/// Bytes a notification is counted for in the queue.
pub fn notification_cost(n: &Notification) -> usize {
    n.name.capacity() + n.message.capacity() + NOTIFICATION_OVERHEAD
}

/// Generations of the live regions: a number given to each registration
/// (never 0; wraps after 2³² registrations), sent in the region table and
/// checked against the one WRITE/READ frames carry.
#[derive(Debug, Default)]
struct Generations {
    last: u32,
    by_base: HashMap<u64, u32>,
}

impl Generations {
    fn bump(&mut self) -> u32 {
        self.last = self.last.wrapping_add(1).max(1);
        self.last
    }
}

/// State the target side shares with the rest of the engine.
#[derive(Debug)]
pub struct Core {
    /// The engine's segment name.
    pub name: String,
    /// Its configuration.
    pub config: TcpConfig,
    /// Its registered regions.
    pub regions: RegionTable,
    gens: Mutex<Generations>,
    /// Notifications received, oldest first.
    pub notifications: Mutex<NotificationQueue>,
    /// Refuse every notification (answer `NotifyQueueFull`); for fault
    /// tests (see `TcpEngine::set_refuse_notifications`).
    pub refuse_notifications: AtomicBool,
    /// Established inbound connections (admitted, not yet ended).
    established: AtomicUsize,
    /// The established connections, for eviction.
    live: Mutex<HashMap<u64, Arc<Live>>>,
    next_live: AtomicU64,
    epoch: Instant,
}

impl Core {
    /// A core with no regions.
    pub fn new(name: String, config: TcpConfig) -> Core {
        Core {
            name,
            config,
            regions: RegionTable::new(),
            gens: Mutex::new(Generations::default()),
            notifications: Mutex::new(NotificationQueue::default()),
            refuse_notifications: AtomicBool::new(false),
            established: AtomicUsize::new(0),
            live: Mutex::new(HashMap::new()),
            next_live: AtomicU64::new(1),
            epoch: Instant::now(),
        }
    }

    fn now_ms(&self) -> u64 {
        (self.epoch.elapsed().as_millis() as u64).max(1)
    }

    /// The established connection to evict for a new one: among those idle
    /// for at least `evict_idle` and not already chosen, one of the
    /// source holding the most connections, idle longest.
    fn pick_evictable(&self) -> Option<Arc<Live>> {
        let live = lock(&self.live);
        let mut per_source: HashMap<IpAddr, usize> = HashMap::new();
        for l in live.values() {
            *per_source.entry(l.source).or_default() += 1;
        }
        let now = self.now_ms();
        let min = self.config.evict_idle.as_millis() as u64;
        live.values()
            .filter(|l| !l.evicted.load(Ordering::Acquire))
            .filter_map(|l| {
                let since = l.idle_since.load(Ordering::Acquire);
                let idle = now.saturating_sub(since);
                let n = per_source.get(&l.source).copied().unwrap_or(0);
                (since != 0 && idle >= min).then_some((n, idle, l))
            })
            .max_by_key(|(n, idle, _)| (*n, *idle))
            .map(|(_, _, l)| Arc::clone(l))
    }

    /// An idle connection of `source` not already chosen for eviction (the
    /// longest idle).
    fn idle_of(&self, source: IpAddr) -> Option<Arc<Live>> {
        let live = lock(&self.live);
        let now = self.now_ms();
        live.values()
            .filter(|l| l.source == source && !l.evicted.load(Ordering::Acquire))
            .filter_map(|l| {
                let since = l.idle_since.load(Ordering::Acquire);
                (since != 0).then_some((now.saturating_sub(since), l))
            })
            .max_by_key(|(idle, _)| *idle)
            .map(|(_, l)| Arc::clone(l))
    }

    /// Connections of `source` established now (not being evicted).
    fn count_of(&self, source: IpAddr) -> usize {
        lock(&self.live)
            .values()
            .filter(|l| l.source == source && !l.evicted.load(Ordering::Acquire))
            .count()
    }

    /// Admits a connection that completed its handshake, evicting an idle
    /// one if `max_inbound` are established, or one of its source's own if
    /// that source holds its share ([`TcpConfig::per_source_limit`]);
    /// `Err(reason)`: refuse it (`Busy`).
    fn admit(&self, source: IpAddr) -> Result<Admitted<'_>, &'static str> {
        if self.count_of(source) >= self.config.per_source_limit() {
            match self.idle_of(source) {
                Some(victim) if !victim.evicted.swap(true, Ordering::AcqRel) => {
                    victim.evict.notify_one();
                }
                _ => return Err("too many connections from this source"),
            }
        }
        if self.established.fetch_add(1, Ordering::AcqRel) >= self.config.max_inbound {
            match self.pick_evictable() {
                Some(victim) if !victim.evicted.swap(true, Ordering::AcqRel) => {
                    victim.evict.notify_one();
                }
                _ => {
                    self.established.fetch_sub(1, Ordering::AcqRel);
                    return Err("too many connections");
                }
            }
        }
        let id = self.next_live.fetch_add(1, Ordering::Relaxed);
        let live = Arc::new(Live {
            source,
            idle_since: AtomicU64::new(0),
            evicted: AtomicBool::new(false),
            evict: Notify::new(),
        });
        lock(&self.live).insert(id, Arc::clone(&live));
        Ok(Admitted {
            core: self,
            id,
            live,
        })
    }

    /// Registers `region` under a new generation.
    pub fn register(&self, region: &MemoryRegion) -> transport_core::Result<()> {
        // The generation lock is held across the insert so that a guard
        // acquired on the new region reads its generation, not a missing or
        // older one.
        let mut g = lock(&self.gens);
        self.regions.insert(region.clone())?;
        let gen = g.bump();
        g.by_base.insert(region.addr(), gen);
        Ok(())
    }

    /// Registers every region or none, each under a new generation.
    pub fn register_all(&self, regions: &[MemoryRegion]) -> transport_core::Result<()> {
        let mut g = lock(&self.gens);
        self.regions.insert_all(regions)?;
        for r in regions {
            let gen = g.bump();
            g.by_base.insert(r.addr(), gen);
        }
        Ok(())
    }

    /// Unregisters the region at `addr` (waiting for the payloads in flight
    /// into or out of it, which the minimum rate bounds).
    pub async fn unregister(&self, addr: u64) -> transport_core::Result<()> {
        let old = lock(&self.gens).by_base.get(&addr).copied();
        self.regions.remove(addr).await?;
        let mut g = lock(&self.gens);
        // A new registration at the same address may have come in between.
        if g.by_base.get(&addr).copied() == old {
            g.by_base.remove(&addr);
        }
        Ok(())
    }

    /// Holds `[addr, addr+len)` if it lies in a live region of generation
    /// `gen`; else the status to answer.
    fn acquire(&self, addr: u64, len: u64, gen: u32) -> Result<RegionGuard, Status> {
        let guard = self
            .regions
            .acquire(addr, len, Side::Remote, None)
            .map_err(|_| Status::AddressNotRegistered)?;
        // The guard keeps the region (and so its generation) in place.
        let live = lock(&self.gens).by_base.get(&guard.region_addr()).copied();
        if live == Some(gen) {
            Ok(guard)
        } else {
            Err(Status::StaleRegion)
        }
    }

    /// The live regions with their generations, in address order (at most
    /// [`MAX_TABLE_ENTRIES`]; a target with more regions advertises the
    /// first ones and initiators fall back to the target's own checks for
    /// the rest).
    pub fn table(&self) -> Vec<TableEntry> {
        let g = lock(&self.gens);
        self.regions
            .regions()
            .iter()
            .take(MAX_TABLE_ENTRIES as usize)
            .filter_map(|r| {
                Some(TableEntry {
                    addr: r.addr(),
                    len: r.len(),
                    gen: *g.by_base.get(&r.addr())?,
                })
            })
            .collect()
    }

    /// The table as it goes on the wire: entry count and bytes.
    pub fn table_bytes(&self) -> (u32, Vec<u8>) {
        let t = self.table();
        (t.len() as u32, encode_table(&t))
    }

    /// Established inbound connections right now.
    pub fn established(&self) -> usize {
        self.established.load(Ordering::Acquire)
    }

    fn pace(&self) -> Pace {
        Pace {
            stall: self.config.stall_timeout,
            min_rate: self.config.min_rate,
        }
    }
}

/// Inbound connections in the handshake, by source address; each can be
/// evicted through its sender.
#[derive(Default)]
struct Handshakes {
    next: u64,
    total: usize,
    by_source: HashMap<IpAddr, BTreeMap<u64, oneshot::Sender<()>>>,
}

impl Handshakes {
    fn add(&mut self, ip: IpAddr) -> (u64, oneshot::Receiver<()>) {
        let (tx, rx) = oneshot::channel();
        self.next += 1;
        self.by_source.entry(ip).or_default().insert(self.next, tx);
        self.total += 1;
        (self.next, rx)
    }

    fn remove(&mut self, ip: IpAddr, id: u64) {
        if let Some(m) = self.by_source.get_mut(&ip) {
            if m.remove(&id).is_some() {
                self.total -= 1;
            }
            if m.is_empty() {
                self.by_source.remove(&ip);
            }
        }
    }

    /// Evicts the oldest handshake of the source holding the most; false
    /// if there was none.
    fn evict_one(&mut self) -> bool {
        let Some(ip) = self
            .by_source
            .iter()
            .max_by_key(|(_, m)| m.len())
            .map(|(ip, _)| *ip)
        else {
            self.total = 0;
            return false;
        };
        if let Some(m) = self.by_source.get_mut(&ip) {
            if let Some((_, tx)) = m.pop_first() {
                self.total -= 1;
                let _ = tx.send(());
            }
            if m.is_empty() {
                self.by_source.remove(&ip);
            }
        }
        true
    }
}

/// The "source" a connection counts against for handshake fairness: its
/// IPv4 address, or the /64 prefix of its IPv6 address (one host commonly
/// holds a whole /64).
fn source_of(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => {
                let bits = u128::from(v6) & !((1u128 << 64) - 1);
                IpAddr::V6(std::net::Ipv6Addr::from(bits))
            }
        },
        v4 => v4,
    }
}

/// Refuses a connection with `Busy` without waiting (a fresh socket's send
/// buffer is empty, so the rejection fits) and closes it.
fn refuse_now(stream: TcpStream, reason: &str) {
    let _ = stream.try_write(&handshake::reject_bytes(Status::Busy, reason));
    let _ = socket2::SockRef::from(&stream).shutdown(std::net::Shutdown::Write);
}

/// Accepts connections until aborted; dropping this future aborts every
/// connection it serves.
pub async fn accept_loop(listener: TcpListener, core: Arc<Core>) {
    let mut conns = JoinSet::new();
    let handshakes = Arc::new(Mutex::new(Handshakes::default()));
    loop {
        let (stream, addr) = match listener.accept().await {
            Ok(x) => x,
            Err(e) => {
                tracing::warn!(error = %e, "accept failed");
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        while conns.try_join_next().is_some() {}
        if core.established() >= core.config.max_inbound && core.pick_evictable().is_none() {
            tracing::debug!(%addr, limit = core.config.max_inbound, "refusing connection: too many established connections");
            refuse_now(stream, "too many connections");
            continue;
        }
        let (id, evicted) = {
            let mut h = lock(&handshakes);
            while h.total >= core.config.max_handshakes && h.evict_one() {}
            h.add(source_of(addr.ip()))
        };
        let core = Arc::clone(&core);
        let handshakes = Arc::clone(&handshakes);
        conns.spawn(async move {
            let r = serve_conn(stream, addr, &core, &handshakes, id, evicted).await;
            if let Err(e) = r {
                tracing::debug!(peer = %addr, error = %e, "inbound connection ended");
            }
        });
    }
}

/// An admitted connection; leaves the established set when dropped.
struct Admitted<'a> {
    core: &'a Core,
    id: u64,
    live: Arc<Live>,
}

impl Drop for Admitted<'_> {
    fn drop(&mut self) {
        lock(&self.core.live).remove(&self.id);
        self.core.established.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Runs the handshake of one inbound connection (within its budget), then
/// serves it.
async fn serve_conn(
    stream: TcpStream,
    addr: SocketAddr,
    core: &Arc<Core>,
    handshakes: &Mutex<Handshakes>,
    id: u64,
    mut evicted: oneshot::Receiver<()>,
) -> Result<(), Error> {
    let _ = stream.set_nodelay(true);
    let stream = Stream::Tcp(stream);
    let cfg = &core.config;
    let peer = addr.to_string();
    let hs = tokio::select! {
        r = tokio::time::timeout(
            cfg.handshake_timeout,
            handshake::server(
                &stream,
                &peer,
                &core.name,
                cfg.secret.as_deref(),
                cfg.handshake_timeout,
                crate::negotiate::our_features(cfg, false),
            ),
        ) => Some(r),
        _ = &mut evicted => None,
    };
    lock(handshakes).remove(source_of(addr.ip()), id);
    let verified = match hs {
        None => {
            handshake::send_reject(
                &stream,
                Status::Busy,
                "too many connections in the handshake",
                REJECT_TIMEOUT,
            )
            .await;
            return Err(Error::SegmentUnavailable {
                name: peer,
                reason: "evicted from the handshake budget".to_owned(),
            });
        }
        Some(Err(_)) => {
            return Err(Error::Timeout {
                operation: "handshake".to_owned(),
                peer: Some(peer),
                after: cfg.handshake_timeout,
            })
        }
        Some(Ok(r)) => r?,
    };
    let admitted = match core.admit(source_of(addr.ip())) {
        Ok(a) => a,
        Err(why) => {
            handshake::send_reject(&stream, Status::Busy, why, REJECT_TIMEOUT).await;
            return Err(Error::SegmentUnavailable {
                name: peer,
                reason: format!("refused: {why}"),
            });
        }
    };
    handshake::send_welcome(
        &stream,
        &peer,
        &verified,
        cfg.idle_timeout,
        core.table_bytes(),
        cfg.handshake_timeout,
    )
    .await?;
    let peer = format!("{} ({peer})", verified.name.escape_default());
    let agreed = verified.agreement.clone();
    tracing::debug!(
        %peer,
        version = agreed.version,
        peer_versions = %agreed.peer_versions,
        negotiated = agreed.peer_negotiates,
        "peer connected"
    );
    let first = ConnState {
        rd: FrameReader::new(cfg.spin, core.pace()),
        out: Out {
            acks: Vec::with_capacity(MAX_ACKS as usize),
            frames: Vec::new(),
            bytes: 0,
        },
        cma_pid: None,
        stage: None,
        agreed,
    };
    match serve(stream, &peer, core, &admitted.live, first).await? {
        Served::Closed => Ok(()),
        Served::ToThread(stream, st) => {
            let (core, live) = (Arc::clone(core), Arc::clone(&admitted.live));
            serve_on_thread(stream, peer, core, live, *st).await
        }
    }
}

/// A connection's serving state, handed to a dedicated thread when the
/// same-host path is agreed.
struct ConnState {
    rd: FrameReader,
    out: Out,
    /// The initiator's process once the same-host path is agreed.
    cma_pid: Option<cma::Initiator>,
    /// The staging area it offered, once mapped.
    stage: Option<TargetStage>,
    /// The version and features the handshake settled.
    agreed: crate::negotiate::Agreement,
}

/// The target's side of a connection's staging area.
struct TargetStage {
    area: crate::same_host::stage::Area,
    /// The next slot to empty in the ring from the initiator.
    from_initiator: u64,
    /// The next slot to fill in the ring to it.
    to_initiator: u64,
    /// The next position of the acknowledgement lane.
    ack_head: u64,
}

/// How [`serve`] ended.
enum Served {
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
async fn serve_on_thread(
    stream: Stream,
    peer: String,
    core: Arc<Core>,
    live: Arc<Live>,
    st: ConnState,
) -> Result<(), Error> {
    let (unix, fd) = stream.into_owned_fd().map_err(|e| io_error(&peer, e))?;
    let (done_tx, done_rx) = oneshot::channel();
    let (stop_tx, stop_rx) = oneshot::channel::<()>();
    let p = peer.clone();
    let body = move || {
        let r = (|| {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .map_err(|e| io_error(&p, e))?;
            rt.block_on(async {
                let stream = Stream::from_owned_fd(unix, fd).map_err(|e| io_error(&p, e))?;
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
        .map_err(|e| io_error(&peer, e))?;
    // Dropped with this future (the connection task aborted at shutdown):
    // the thread then stops.
    let _stop = stop_tx;
    done_rx.await.unwrap_or(Ok(()))
}

/// Whether any two segments share a byte.
fn overlapping(segs: &[Segment]) -> bool {
    let mut sorted: Vec<(u64, u64)> = segs.iter().map(|s| (s.addr, s.len)).collect();
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
    if e.kind() == std::io::ErrorKind::TimedOut {
        Error::Timeout {
            operation: format!("receiving or sending a frame ({e})"),
            peer: Some(peer.to_owned()),
            after: Duration::ZERO,
        }
    } else {
        Error::PeerLost {
            peer: peer.to_owned(),
            reason: e.to_string(),
        }
    }
}

/// Holds every segment of a WRITEV/READV that lies in a live region of its
/// generation (`Err(status)` for the others, which fail individually).
fn acquire_segments(core: &Core, segs: &[Segment]) -> Vec<Result<RegionGuard, Status>> {
    segs.iter()
        .map(|s| core.acquire(s.addr, s.len, s.gen))
        .collect()
}

/// Performs the copies of a CWRITE (`read` false: from the initiator into
/// the guarded target ranges) or CREAD (from them into the initiator) for
/// the segments whose guard was acquired; `None` if every segment moved,
/// else the status and indices of those that did not. `one_call`: the
/// segments do not overlap, so all of them may go in one system call.
fn cma_copy(
    pid: i32,
    read: bool,
    segs: &[crate::frame::CmaSegment],
    guards: &[Result<RegionGuard, Status>],
    one_call: bool,
) -> Option<(Status, Vec<u32>)> {
    let total: u64 = segs.iter().map(|s| s.seg.len).sum();
    if one_call && guards.iter().all(Result::is_ok) {
        let ok = if total as usize >= cma::PARALLEL_MIN && cma::helpers() > 0 {
            let pairs: Vec<(usize, u64, usize)> = guards
                .iter()
                .flatten()
                .zip(segs)
                .map(|(g, s)| (g.as_ptr() as usize, s.local, g.len() as usize))
                .collect();
            // SAFETY: every local range is held registered (and so valid)
            // by its guard until after copy_split has returned (it waits
            // for its helper threads); the kernel checks the initiator's
            // ranges (EFAULT, never a fault here).
            unsafe { cma::copy_split(pid, read, &pairs) }.is_ok()
        } else {
            let local: Vec<libc::iovec> = guards
                .iter()
                .flatten()
                .map(|g| cma::iov(g.as_ptr(), g.len() as usize))
                .collect();
            let remote: Vec<libc::iovec> = segs
                .iter()
                .map(|s| cma::iov(s.local as usize as *mut u8, s.seg.len as usize))
                .collect();
            // SAFETY: as above, for one system call.
            (unsafe { cma::copy(pid, read, &local, &remote) }) == Ok(total as usize)
        };
        if ok {
            return None;
        }
        // A short or refused call: redo segment by segment to find which.
    }
    let mut failed = Vec::new();
    let mut status = None;
    for (i, (g, s)) in guards.iter().zip(segs).enumerate() {
        let st = match g {
            Ok(g) => {
                // SAFETY: as above, for this guard's range.
                let r = unsafe { cma::copy_all(pid, read, g.as_ptr(), s.local, g.len() as usize) };
                match r {
                    Ok(()) => continue,
                    Err(_) => Status::CopyFailed,
                }
            }
            Err(st) => *st,
        };
        failed.push(i as u32);
        // StaleRegion first (the initiator retries), then unregistered.
        status = Some(match (status, st) {
            (Some(Status::StaleRegion), _) | (_, Status::StaleRegion) => Status::StaleRegion,
            (Some(Status::AddressNotRegistered), _) | (_, Status::AddressNotRegistered) => {
                Status::AddressNotRegistered
            }
            _ => st,
        });
    }
    status.map(|st| (st, failed))
}

/// Moves an SWRITE's stream out of the staging area into the guarded
/// ranges (the bytes of refused segments are dropped), or an SREAD's
/// verdict (naming the `refused` segments) and accepted ranges into it —
/// then waits until the initiator has emptied the ring, so that the
/// acknowledgement follows the data.
async fn staged_copy(
    st: &mut TargetStage,
    read: bool,
    guards: &[Result<RegionGuard, Status>],
    segs: &[Segment],
    refused: &[u32],
    watch: &crate::same_host::stage::Watch<'_>,
) -> Result<(), crate::same_host::stage::Stop> {
    use crate::same_host::stage::{self, Dir, Piece};
    let pieces = guards.iter().zip(segs).map(|(g, s)| Piece {
        // Refused (null): its bytes are dropped (SWRITE) or never sent
        // (SREAD).
        ptr: g.as_ref().map_or(std::ptr::null_mut(), |g| g.as_ptr()),
        len: s.len as usize,
    });
    if !read {
        let ring = st.area.ring(Dir::ToTarget);
        // The initiator sends every segment's bytes, refused ones too.
        let pieces: Vec<Piece> = pieces.collect();
        // SAFETY: every non-null piece is a range its guard holds
        // registered (and so valid) until the caller drops `guards`, after
        // this returns.
        return unsafe { stage::get(&ring, &mut st.from_initiator, &pieces, watch, None) }.await;
    }
    let ring = st.area.ring(Dir::ToInitiator);
    let mut verdict = stage::verdict(refused.iter().map(|&i| i as usize));
    let v = [Piece {
        ptr: verdict.as_mut_ptr(),
        len: verdict.len(),
    }];
    // SAFETY: `verdict` is valid for reads until this returns.
    unsafe { stage::put(&ring, &mut st.to_initiator, &v, watch) }.await?;
    let accepted: Vec<Piece> = pieces.filter(|p| !p.ptr.is_null()).collect();
    // SAFETY: as for SWRITE, read instead of written.
    unsafe { stage::put(&ring, &mut st.to_initiator, &accepted, watch) }.await?;
    let end = st.to_initiator;
    stage::wait(|| ring.drained(end), watch).await
}

/// The status a v-frame reports for its failed segments: `StaleRegion` if
/// any failed for that reason (the initiator refreshes its table and
/// retries them), else `AddressNotRegistered`.
fn failed_status(guards: &[Result<RegionGuard, Status>]) -> Status {
    if guards.iter().any(|g| matches!(g, Err(Status::StaleRegion))) {
        Status::StaleRegion
    } else {
        Status::AddressNotRegistered
    }
}

async fn flush(stream: &Stream, out: &mut Out, core: &Core, peer: &str) -> Result<(), Error> {
    if out.is_empty() {
        return Ok(());
    }
    let buf = out.take();
    write_all_slices(stream, &[&buf], core.pace())
        .await
        .map_err(|e| io_error(peer, e))
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
async fn serve(
    stream: Stream,
    peer: &str,
    core: &Core,
    live: &Live,
    st: ConnState,
) -> Result<Served, Error> {
    let cfg = &core.config;
    let pace = core.pace();
    let ConnState {
        mut rd,
        mut out,
        mut cma_pid,
        mut stage,
        agreed,
    } = st;
    // The segment table of the current CWRITE / CREAD.
    let mut cma_table: Vec<u8> = Vec::new();
    loop {
        // Answer everything processed so far before waiting for more input.
        if !out.is_empty() && !rd.poll_header_now(&stream).map_err(|e| io_error(peer, e))? {
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
        let hdr = match next.map_err(|e| io_error(peer, e))? {
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
                            .map_err(|e| io_error(peer, e))?;
                        drop(guard);
                        out.acks.push(id);
                        out.bytes += len;
                    }
                    Err(status) => {
                        rd.discard(&stream, len, true)
                            .await
                            .map_err(|e| io_error(peer, e))?;
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
                    .map_err(|e| io_error(peer, e))?;
                    drop(guard);
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
                    .map_err(|e| io_error(peer, e))?;
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
                        let cost = notification_cost(&n);
                        let mut q = lock(&core.notifications);
                        if core.refuse_notifications.load(Ordering::Relaxed)
                            || q.queue.len() >= MAX_QUEUED_NOTIFICATIONS
                            || q.bytes + cost > MAX_QUEUED_NOTIFICATION_BYTES
                        {
                            drop(q);
                            out.err(id, Status::NotifyQueueFull, name_len, msg_len);
                        } else {
                            q.queue.push_back(n);
                            q.bytes += cost;
                            drop(q);
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
                    .map_err(|e| io_error(peer, e))?;
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
                        .map_err(|e| io_error(peer, e))?;
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
                        r.map_err(|e| io_error(peer, e))?;
                    }
                    if failed.is_empty() {
                        out.acks.push(id);
                    } else {
                        out.errv(id, failed_status(&guards), &failed);
                    }
                }
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
                    .map_err(|e| io_error(peer, e))?;
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
                    .map_err(|e| io_error(peer, e))?;
                drop(bufs);
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
                    .map_err(|e| io_error(peer, e))?;
                let offer = cma::Offer::decode(&raw);
                let verdict = match &stream {
                    _ if cfg.same_host == SameHost::Off => Err((cma::Refusal::Disabled, 0)),
                    _ if !agreed.theirs.enabled(crate::negotiate::SAME_HOST) => {
                        let reason = "SAME_HOST from a peer that did not announce it".to_owned();
                        return Err(malformed(&stream, &mut out, core, peer, id, reason).await);
                    }
                    Stream::Tcp(tcp) if cma_pid.is_none() => cma::check_offer(tcp, &offer),
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
                        let mapped = match offered_stage {
                            None => Err(0),
                            Some(_) if !staging_agreed => Err(libc::EOPNOTSUPP),
                            Some(fd) => initiator.take_stage(fd),
                        };
                        let staging = mapped.as_ref().map(|_| ()).map_err(|e| *e as u32);
                        tracing::debug!(%peer, pid, ?taken, ?staging, "same-host path agreed");
                        stage = mapped.ok().map(|area| TargetStage {
                            area,
                            from_initiator: 0,
                            to_initiator: 0,
                            ack_head: 0,
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
                                Stream::Unix(
                                    tokio::net::UnixStream::from_std(unix)
                                        .map_err(|e| io_error(peer, e))?,
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
                        });
                        return Ok(Served::ToThread(stream, st));
                    }
                    Err((why, errno)) => {
                        tracing::debug!(%peer, ?why, errno, "same-host path refused");
                        out.err(id, Status::SameHostRefused, why as u64, errno as u64);
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
                    .map_err(|e| io_error(peer, e))?;
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
                    let watch = crate::same_host::stage::Watch {
                        alive: &alive,
                        stall: cfg.stall_timeout,
                        // From the frame's first byte, as on the socket.
                        deadline: Some(pace.deadline(total)),
                    };
                    let failed: Vec<u32> = (0..guards.len() as u32)
                        .filter(|&i| guards[i as usize].is_err())
                        .collect();
                    let moved = staged_copy(st, read, &guards, &plain, &failed, &watch).await;
                    let status = failed_status(&guards);
                    drop(guards);
                    moved.map_err(|stop| {
                        let gone = "closed by the initiator, or its process exited";
                        stop.error(peer, cfg.stall_timeout, gone)
                    })?;
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
                let failed = cma_copy(initiator.pid, read, &segs, &guards, !overlapping(&plain));
                drop(guards);
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handshake_sources_and_eviction() {
        let a: IpAddr = "2001:db8::1".parse().unwrap();
        let b: IpAddr = "2001:db8::ffff:1".parse().unwrap();
        assert_eq!(source_of(a), source_of(b), "one /64, one source");
        let m: IpAddr = "::ffff:10.0.0.1".parse().unwrap();
        assert_eq!(source_of(m), "10.0.0.1".parse::<IpAddr>().unwrap());

        // The source holding the most slots loses its oldest one.
        let mut h = Handshakes::default();
        let x: IpAddr = "10.0.0.1".parse().unwrap();
        let y: IpAddr = "10.0.0.2".parse().unwrap();
        let (_, mut legit) = h.add(y);
        let (_, mut first) = h.add(x);
        let (_, mut second) = h.add(x);
        assert!(h.evict_one());
        assert!(first.try_recv().is_ok(), "the oldest of the biggest source");
        assert!(second.try_recv().is_err() && legit.try_recv().is_err());
        assert_eq!(h.total, 2);
        assert!(h.evict_one() && h.evict_one() && !h.evict_one());
        assert_eq!(h.total, 0);
    }
}

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

use std::collections::{BTreeMap, HashMap};
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::net::{TcpListener, TcpStream};

use crate::same_host::grant::Grants;
use crate::stream::Stream;
use ferry_core::__private::sync::lock;
use ferry_core::{Error, MemoryRegion, Notification, RegionGuard, RegionTable, Side};
use tokio::sync::{oneshot, Notify};
use tokio::task::JoinSet;

use crate::config::{SameHost, TcpConfig};
use crate::frame::{encode_table, Request, Response, Status, TableEntry, MAX_TABLE_ENTRIES};
use crate::handshake;
use crate::io::{write_all, write_all_slices, Bytes, FrameReader, Next, Pace};
use crate::same_host::cma;

/// Most bytes of memory the queued notifications may occupy, counted as
/// allocated (string capacities plus a fixed per-notification overhead).
/// Beyond it NOTIFY requests are refused with `NotifyQueueFull`, which the
/// sender sees as a retryable error. A consumer that processes what one
/// `take_notifications` returned before taking again therefore holds at
/// most twice this much.
pub const MAX_QUEUED_NOTIFICATION_BYTES: usize = 32 << 20;

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

/// Most notifications queued before NOTIFY requests are refused.
pub const MAX_QUEUED_NOTIFICATIONS: usize = 65_536;

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
    /// Its TLS configurations (`None`: `tls=off`).
    pub tls: Option<std::sync::Arc<crate::tls::TlsContext>>,
    /// Its boot id and PID namespace, the key of its same-host tokens
    /// (read once, here; `None`: `same_host=off`, or no `/proc`).
    pub host_key: Option<crate::negotiate::HostKey>,
    /// Its registered regions.
    pub regions: RegionTable,
    gens: Arc<Mutex<Generations>>,
    /// Notifications received, oldest first.
    pub notifications: ferry_core::raw::Inbox,
    /// What peers wrote into and read from the regions, per peer.
    pub served: ferry_core::inbound::ServedTraffic,
    /// The grants published to same-host initiators (see
    /// [`crate::same_host::grant`]).
    pub(crate) grants: Arc<Grants>,
    /// Refuse every notification (answer `NotifyQueueFull`); for fault
    /// tests (see `TcpEngine::set_refuse_notifications`).
    pub refuse_notifications: AtomicBool,
    /// Set by [`Core::close`]: no request is answered and no connection
    /// admitted any more.
    closed: AtomicBool,
    /// Established inbound connections (admitted, not yet ended).
    established: AtomicUsize,
    /// The established connections, for eviction.
    live: Mutex<HashMap<u64, Arc<Live>>>,
    next_live: AtomicU64,
    epoch: Instant,
}

impl Core {
    /// Stops serving: from the moment this returns, every connection ends
    /// at its next request (before acting on it) and no new one is
    /// welcomed. Aborting the connection tasks alone is not enough: an
    /// abort takes effect only at a task's next await and a same-host
    /// connection runs on a thread of its own, so a shut-down engine could
    /// still answer (a table refresh, a write) for a while — the initiator
    /// then saw an engine without regions, not a lost connection.
    pub fn close(&self) {
        self.closed.store(true, Ordering::Release);
        // Same-host initiators copy into no region any more.
        self.grants.close();
        // Whoever awaits a notification learns that none will come.
        self.notifications.close();
    }

    /// Whether [`Core::close`] was called.
    pub fn is_closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }

    /// A core with no regions.
    pub fn new(name: String, config: TcpConfig) -> Core {
        let regions = RegionTable::new();
        let gens: Arc<Mutex<Generations>> = Arc::default();
        let grants: Arc<Grants> = Arc::default();
        {
            let (gens, grants) = (Arc::clone(&gens), Arc::clone(&grants));
            regions.on_detached_release(move |table, addr| {
                Core::forget_detached(&gens, &grants, table, addr)
            });
        }
        let host_key = (config.same_host != SameHost::Off)
            .then(crate::same_host::cma::host_key)
            .flatten();
        Core {
            name,
            tls: None,
            host_key,
            config,
            regions,
            gens,
            notifications: ferry_core::raw::Inbox::new(
                MAX_QUEUED_NOTIFICATIONS,
                MAX_QUEUED_NOTIFICATION_BYTES,
            ),
            served: ferry_core::inbound::ServedTraffic::default(),
            grants,
            refuse_notifications: AtomicBool::new(false),
            closed: AtomicBool::new(false),
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
    /// Registers `region` under a new generation.
    pub fn register(&self, region: MemoryRegion) -> ferry_core::Result<()> {
        // The generation lock is held across the insert so that a guard
        // acquired on the new region reads its generation, not a missing or
        // older one.
        let mut g = lock(&self.gens);
        let (addr, len) = (region.addr(), region.len());
        self.regions.insert(region)?;
        let gen = g.bump();
        g.by_base.insert(addr, gen);
        self.grants.grant(addr, len, gen);
        Ok(())
    }

    /// Registers every region or none, each under a new generation.
    pub fn register_all(&self, regions: Vec<MemoryRegion>) -> ferry_core::Result<()> {
        let mut g = lock(&self.gens);
        let spans: Vec<(u64, u64)> = regions.iter().map(|r| (r.addr(), r.len())).collect();
        self.regions.insert_all(regions)?;
        for (addr, len) in spans {
            let gen = g.bump();
            g.by_base.insert(addr, gen);
            self.grants.grant(addr, len, gen);
        }
        Ok(())
    }

    /// Unregisters the region at `addr`, in the order every path that lets
    /// a region go follows (revoke and settle first, remove from the table
    /// last, leak on doubt):
    ///
    /// 1. its grant is revoked (no same-host initiator starts a granted
    ///    copy into it from here on, whatever happens below) and the
    ///    engine waits until no initiator copies under an earlier mark (at
    ///    most the stall timeout: past it the region stays registered,
    ///    ungranted, and the error is [`ferry_core::Error::RegionHeld`]; a
    ///    later call waits again);
    /// 2. new frames are refused and the payloads in flight into or out of
    ///    it are waited for (which the minimum rate bounds); a payload held
    ///    for a peer that could not be shown to have stopped makes this
    ///    [`ferry_core::Error::RegionHeld`], and the region leaves the
    ///    table by itself when that peer is done (see
    ///    [`Core::forget_detached`]);
    /// 3. only then the region leaves the table and its generation is
    ///    forgotten.
    ///
    /// Cancelling the future at any point leaves the region registered
    /// (ungranted once step 1 has begun: served as frames).
    pub async fn unregister(&self, addr: u64) -> ferry_core::Result<()> {
        use ferry_tcp_proto::grants::{Unfinished, UnregisterStep as Step, Unregistration};
        let gen = lock(&self.gens).by_base.get(&addr).copied();
        let mut u = Unregistration::new(gen, self.config.stall_timeout);
        let mut revoked = None;
        let mut refused = None;
        let mut step = u.start();
        loop {
            step = match step {
                Step::Revoke { gen } => {
                    revoked = self.grants.revoke(addr, gen);
                    u.revoked(crate::io::now(), revoked.is_some())
                }
                Step::Settle { deadline } => {
                    let r = match (&revoked, gen) {
                        (Some(r), Some(gen)) => {
                            let patience = crate::io::now().until(deadline);
                            self.grants.settle(addr, gen, r, patience).await
                        }
                        _ => Ok(()),
                    };
                    u.settled(r)
                }
                Step::Remove => match self.regions.remove_in_steps(addr).await {
                    Ok(steps) => {
                        steps.finish();
                        u.removed(true)
                    }
                    Err(e) => {
                        refused = Some(e);
                        u.removed(false)
                    }
                },
                Step::Forget { gen } => {
                    let mut g = lock(&self.gens);
                    // A new registration at the same address may have come
                    // in between.
                    if g.by_base.get(&addr).copied() == Some(gen) {
                        g.by_base.remove(&addr);
                    }
                    u.forgotten()
                }
                Step::Done(Ok(())) => return Ok(()),
                Step::Done(Err(Unfinished::Marked { pid, patience })) => {
                    return Err(ferry_core::Error::RegionHeld {
                        addr,
                        reason: format!(
                            "the same-host peer process {pid} may still copy into it under a \
                             grant it marked before the region's unregistration, and has not \
                             finished within {patience:?} (is its process stopped?); the grant \
                             is revoked, unregister again later"
                        ),
                    });
                }
                Step::Done(Err(Unfinished::Table)) => {
                    return Err(refused.unwrap_or(ferry_core::Error::RegionNotRegistered { addr }));
                }
            };
        }
    }

    /// A region that `unregister` gave up on (`RegionHeld` from the table:
    /// a payload was held for a peer that had not proven it stopped) has
    /// left the table by itself: its generation is forgotten, unless a new
    /// registration took the address since. Its grant was revoked and
    /// settled before the table was asked to remove it; should one still
    /// be published (a bug), it is revoked here. Called by the table's
    /// hook (see [`RegionTable::on_detached_release`]).
    fn forget_detached(gens: &Mutex<Generations>, grants: &Grants, table: &RegionTable, addr: u64) {
        let mut g = lock(gens);
        // Under the generation lock no registration can come in (it holds
        // this lock across its insert): a region in the table at `addr`
        // now is a new one, whose generation stays.
        if table.holds(addr) {
            return;
        }
        if let Some(gen) = g.by_base.remove(&addr) {
            if grants.revoke(addr, gen).is_some() {
                tracing::error!(
                    addr,
                    gen,
                    "a detached region was still granted; revoked now"
                );
            }
        }
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

impl ferry_core::inbound::InboundSource for Core {
    fn snapshot(&self) -> ferry_core::InboundSnapshot {
        // Granted copies are counted by the initiators, in their areas.
        self.grants.sync();
        ferry_core::InboundSnapshot::new()
            .with_served(self.served.snapshot())
            .with_notifications_dropped(self.notifications.dropped())
    }
}

mod admission;
mod copy;
mod serve;

pub use admission::accept_loop;

//! `NixlEngine`: the `TransferEngine` trait over a NIXL agent.
//!
//! - an engine is one NIXL agent plus Ferry's metadata listener
//!   (`control`), whose `host:port` is the segment name;
//! - registering is `nixl_capi_register_mem` of DRAM (VRAM for `cuda:N`);
//! - a segment is a peer agent whose metadata was loaded, with a mirror of
//!   the regions the peer advertises;
//! - a batch is one NIXL transfer request per direction (all its writes in
//!   one descriptor list, all its reads in another), carrying the batch's
//!   notification when it has one direction;
//! - the poller thread (`poller`) watches every posted request with
//!   `nixl_capi_get_xfer_status` and reports through
//!   `ferry_core::batch`, which owns ids, states and deadlines.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ferry_core::__private::sync::lock;
use ferry_core::raw::{BatchDriver, BatchTable, Removal};
use ferry_core::{
    BackendInfo, BatchId, BatchReport, BatchStatus, Capabilities, Error, Location, MemoryKinds,
    MemoryRegion, Notification, RegionGuard, RegionInfo, RegionTable, Result, SegmentId, Side,
    TransferEngine, TransferOp, TransferRequest,
};
use tokio::net::tcp::OwnedWriteHalf;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{oneshot, Notify};
use tokio::task::AbortHandle;

use crate::agent::{Agent, XferReq};
use crate::config::NixlConfig;
use crate::control::{read_frame, write_frame, Frame, PeerWriter, State, VERSION_MAX, VERSION_MIN};
use crate::library::{self, NixlLibrary};
use crate::poller::{Job, Pending, Poller};

pub(crate) const BACKEND: &str = "nixl";

/// How long opening a segment may take (connect, handshake, metadata).
const OPEN_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a target waits for a notification it was asked to confirm.
const CONFIRM_TIMEOUT: Duration = Duration::from_secs(10);
/// Most notifications kept for `take_notifications` (older ones are
/// dropped, with a warning, beyond it).
const MAX_QUEUED_NOTIFICATIONS: usize = 1 << 20;
/// How long dropping an engine waits for its poller thread to end.
const POLLER_STOP: Duration = Duration::from_secs(5);
/// Most confirmation tokens remembered while no `CONFIRM` asked for them.
const MAX_SEEN_TOKENS: usize = 1 << 16;

type Writer = Arc<tokio::sync::Mutex<PeerWriter>>;
type Waiters<T> = Arc<Mutex<HashMap<u64, oneshot::Sender<T>>>>;
type Revocations = Arc<Mutex<PeerRevocations>>;

/// A peer's revocations waiting for its `REVOKED`, and how its connection
/// ended (set once, by the task serving it, under this lock).
#[derive(Default)]
struct PeerRevocations {
    /// seq → (region, answer).
    waiting: HashMap<u64, (u64, oneshot::Sender<()>)>,
    /// `Some(None)`: the peer closed the connection (nothing of it in
    /// flight); `Some(Some(why))`: it ended otherwise.
    ended: Option<Option<String>>,
}
type RegDescs = Vec<(u64, u64, u64)>;

/// The tokens of the notifications taken from NIXL whose delivery a sender
/// may ask to confirm (the notifications themselves wait in `Inner::inbox`).
#[derive(Default)]
struct Notes {
    seen: HashSet<(String, u64)>,
    seen_order: VecDeque<(String, u64)>,
}

static AGENTS: AtomicU64 = AtomicU64::new(0);

/// Who chose the native library a [`NixlConfig`] resolves to; see
/// [`NixlEngine::start_trusted`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LibraryTrust {
    /// The configuration (`lib=`, `FERRY_NIXL_LIB`, the loader's search
    /// path, the active Python environment) comes from the operator, who
    /// vouches for the library as they would for one linked at build time;
    /// never from a peer or a request.
    OperatorConfigured,
}

/// A Ferry engine over one NIXL agent. See the crate docs.
pub struct NixlEngine {
    inner: Arc<Inner>,
}

struct Inner {
    lib: Arc<NixlLibrary>,
    agent: Arc<Agent>,
    config: NixlConfig,
    segment_name: String,
    plugins: Vec<String>,
    /// Regions registered here, guarded while local transfers use them.
    regions: RegionTable,
    /// The regions registered with NIXL that peers may use.
    advertised: Mutex<BTreeMap<u64, u64>>,
    /// Held while a `STATE` or the `REVOKE`s of a region are written, so
    /// that on every connection they appear in the order they happened.
    order: tokio::sync::Mutex<u64>,
    /// Connections of peers that opened this engine's segment.
    peers: Mutex<HashMap<u64, Peer>>,
    /// Regions a peer may still be using although it can no longer be
    /// asked: its control connection ended without the peer closing it
    /// (a reset, a read or write error, a frame this engine refused) while
    /// the region was advertised to it or being revoked from it. Such a
    /// peer may still have NIXL requests into the region in flight, and
    /// nothing can show when they end: the region stays registered
    /// (`unregister` answers `RegionHeld`) for the life of the engine.
    doubt: Mutex<BTreeMap<u64, String>>,
    next_peer: AtomicU64,
    segments: Mutex<HashMap<u64, Arc<Segment>>>,
    /// Open segments per peer agent (its metadata is invalidated when the
    /// last one closes).
    remote_agents: Mutex<HashMap<String, usize>>,
    batches: BatchTable,
    poller: Arc<Poller>,
    /// The listener's accept loop (aborted by `shutdown`).
    accept: Mutex<Option<AbortHandle>>,
    /// The tasks serving peers that opened this engine's segment. They
    /// outlive `shutdown`: a peer's answer to a `REVOKE` (or its
    /// connection closing) is what lets a region of this engine leave
    /// NIXL safely, and regions outlive `shutdown`. Aborted on drop.
    tasks: Mutex<Vec<AbortHandle>>,
    notes: Mutex<Notes>,
    /// Notifications taken from NIXL and not yet from Ferry.
    inbox: ferry_core::raw::Inbox,
    refuse_notifications: std::sync::atomic::AtomicBool,
}

/// A peer connected to this engine's listener.
struct Peer {
    who: String,
    writer: Writer,
    pending: Revocations,
}

/// A peer segment opened by this engine.
pub(crate) struct Segment {
    pub(crate) name: String,
    pub(crate) agent: String,
    /// The peer's advertised regions; guards are held by transfers in flight.
    remote: RegionTable,
    writer: tokio::sync::Mutex<OwnedWriteHalf>,
    fetch_lock: tokio::sync::Mutex<()>,
    confirms: Waiters<bool>,
    next_token: AtomicU64,
    waiter: Mutex<Option<oneshot::Sender<Result<()>>>>,
    lost: Mutex<Option<String>>,
    reader: Mutex<Option<AbortHandle>>,
    /// Batches posted on this segment and not finished by NIXL.
    pub(crate) inflight: AtomicUsize,
    pub(crate) idle: Notify,
    /// The control connection ended without this engine closing it: the
    /// poller aborts the requests still in flight on this segment (the
    /// peer can no longer revoke its regions from us).
    pub(crate) aborted: std::sync::atomic::AtomicBool,
}

impl Segment {
    /// Why the control connection was lost, once it was.
    pub(crate) fn lost_reason(&self) -> Option<String> {
        lock(&self.lost).clone()
    }

    fn lost_error(&self) -> Option<Error> {
        lock(&self.lost).as_ref().map(|r| Error::PeerLost {
            peer: self.name.clone(),
            reason: r.clone(),
        })
    }

    /// A fresh token for a notification on this segment.
    pub(crate) fn token(&self) -> u64 {
        self.next_token.fetch_add(1, Ordering::Relaxed)
    }

    /// Waits until the peer confirms it took the notification `token` sent
    /// by agent `sender`.
    pub(crate) async fn confirm(&self, token: u64, sender: &str) -> Result<()> {
        if let Some(e) = self.lost_error() {
            return Err(e);
        }
        let (tx, rx) = oneshot::channel();
        lock(&self.confirms).insert(token, tx);
        {
            let mut w = self.writer.lock().await;
            let f = Frame::Confirm {
                token,
                sender: sender.to_owned(),
            };
            if let Err(e) = write_frame(&mut *w, &f, &self.name).await {
                lock(&self.confirms).remove(&token);
                return Err(e);
            }
        }
        match tokio::time::timeout(CONFIRM_TIMEOUT + OPEN_TIMEOUT, rx).await {
            Ok(Ok(true)) => Ok(()),
            Ok(Ok(false)) => Err(Error::PeerLost {
                peer: self.name.clone(),
                reason: format!(
                    "the peer did not take the NIXL notification (refused, or not received \
                     within {CONFIRM_TIMEOUT:?})"
                ),
            }),
            Ok(Err(_)) => Err(self.lost_error().unwrap_or_else(|| Error::PeerLost {
                peer: self.name.clone(),
                reason: "the connection closed".to_owned(),
            })),
            Err(_) => {
                lock(&self.confirms).remove(&token);
                Err(Error::Timeout {
                    operation: "confirming a notification".to_owned(),
                    peer: Some(self.name.clone()),
                    after: CONFIRM_TIMEOUT + OPEN_TIMEOUT,
                })
            }
        }
    }

    /// Asks the peer for a fresh `STATE` and waits until it is applied.
    async fn fetch(&self) -> Result<()> {
        let _one = self.fetch_lock.lock().await;
        if let Some(e) = self.lost_error() {
            return Err(e);
        }
        let (tx, rx) = oneshot::channel();
        *lock(&self.waiter) = Some(tx);
        {
            let mut w = self.writer.lock().await;
            write_frame(&mut *w, &Frame::Fetch, &self.name).await?;
        }
        match tokio::time::timeout(OPEN_TIMEOUT, rx).await {
            Ok(Ok(r)) => r,
            Ok(Err(_)) => Err(self.lost_error().unwrap_or_else(|| Error::PeerLost {
                peer: self.name.clone(),
                reason: "the connection closed".to_owned(),
            })),
            Err(_) => Err(Error::Timeout {
                operation: "fetching the peer's NIXL metadata".to_owned(),
                peer: Some(self.name.clone()),
                after: OPEN_TIMEOUT,
            }),
        }
    }
}

/// Applies a peer's `STATE`: loads its metadata, mirrors its regions.
fn apply_state(
    agent: &Agent,
    seg_agent: &str,
    remote: &RegionTable,
    s: &State,
    peer: &str,
) -> Result<()> {
    if s.agent != seg_agent {
        return Err(Error::Protocol {
            peer: peer.to_owned(),
            reason: format!("agent {:?} answered for agent {seg_agent:?}", s.agent),
        });
    }
    if s.agent != agent.name() {
        let loaded = agent.load_remote_md(&s.metadata)?;
        if loaded != s.agent {
            return Err(Error::Protocol {
                peer: peer.to_owned(),
                reason: format!("metadata of agent {loaded:?} sent as agent {:?}", s.agent),
            });
        }
    }
    for &(addr, len) in &s.regions {
        if !remote.contains(addr, len) {
            // SAFETY: the region is never dereferenced by this process: it
            // is the peer's memory, recorded to check remote addresses.
            let r = unsafe {
                MemoryRegion::from_raw_parts(addr as *mut u8, len as usize, Default::default())
            };
            // Overlap with a region still being revoked: the next fetch
            // after the revocation adds it.
            let _ = remote.insert(r);
        }
    }
    Ok(())
}

pub(crate) fn encode_notification(n: &Notification, token: u64) -> Vec<u8> {
    let mut b = Vec::with_capacity(16 + n.name.len() + n.message.len());
    b.extend_from_slice(NOTE_MAGIC);
    b.extend_from_slice(&token.to_le_bytes());
    b.extend_from_slice(&(n.name.len() as u16).to_le_bytes());
    b.extend_from_slice(n.name.as_bytes());
    b.extend_from_slice(n.message.as_bytes());
    b
}

const NOTE_MAGIC: &[u8; 6] = b"FERRY\x01";

/// A NIXL notification as Ferry's, with its confirmation token: Ferry's
/// own encoding, or (from an agent that is not Ferry) the sender's agent
/// name and the bytes as text, without a token.
pub(crate) fn decode_notification(sender: &str, bytes: &[u8]) -> (Notification, Option<u64>) {
    if let Some(rest) = bytes.strip_prefix(NOTE_MAGIC) {
        if rest.len() >= 10 {
            let mut t = [0u8; 8];
            t.copy_from_slice(&rest[..8]);
            let n = u16::from_le_bytes([rest[8], rest[9]]) as usize;
            if let (Some(name), Some(msg)) = (rest.get(10..10 + n), rest.get(10 + n..)) {
                let note = Notification::new(
                    String::from_utf8_lossy(name).into_owned(),
                    String::from_utf8_lossy(msg).into_owned(),
                );
                return (note, Some(u64::from_le_bytes(t)));
            }
        }
    }
    let note = Notification::new(sender, String::from_utf8_lossy(bytes).into_owned());
    (note, None)
}

impl std::fmt::Debug for NixlEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NixlEngine")
            .field("segment", &self.inner.segment_name)
            .field("agent", &self.inner.agent.name())
            .field("library", &self.inner.lib.path())
            .finish()
    }
}

impl NixlEngine {
    /// Loads the library the configuration selects (see
    /// [`NixlLibrary::resolve`]) and starts an engine on it.
    ///
    /// # Safety
    ///
    /// As [`NixlLibrary::resolve`]: the library chosen by `lib=`,
    /// `FERRY_NIXL_LIB`, the loader or the Python wheel runs native code in
    /// this process and must be NIXL's `libnixl_capi.so`.
    pub async unsafe fn start(config: NixlConfig) -> Result<NixlEngine> {
        config.validate()?;
        // SAFETY: forwarded to the caller.
        let lib = unsafe { NixlLibrary::resolve(&config) }?;
        Self::start_with(lib, config).await
    }

    /// [`NixlEngine::start`] for code that states, with `trust`, that the
    /// library the configuration resolves to was chosen by the operator (the
    /// `ferry` facade does so for URLs, which it documents as trusted
    /// configuration).
    pub async fn start_trusted(config: NixlConfig, trust: LibraryTrust) -> Result<NixlEngine> {
        let LibraryTrust::OperatorConfigured = trust;
        // SAFETY: `trust` is the caller's statement of `start`'s contract.
        unsafe { Self::start(config) }.await
    }

    /// Starts an engine on a library already loaded.
    ///
    /// Errors: [`Error::InvalidArgument`] when `config.host` is not a
    /// loopback address and `config.insecure` is not set (the listener
    /// gives every caller the agent's NIXL metadata, with the remote keys
    /// of every registered region, and authenticates nobody),
    /// [`Error::Unavailable`] when a backend plugin of `config.backends`
    /// cannot be loaded, [`Error::Io`] when the listener cannot bind,
    /// [`Error::Backend`] when NIXL refuses the agent.
    pub async fn start_with(lib: Arc<NixlLibrary>, config: NixlConfig) -> Result<NixlEngine> {
        config.validate()?;
        check_exposure(&config).await?;
        let listener = TcpListener::bind((config.host.as_str(), config.port))
            .await
            .map_err(|e| {
                Error::io(
                    format!(
                        "binding the NIXL metadata listener on {}:{}",
                        config.host, config.port
                    ),
                    &e,
                )
            })?;
        let port = listener
            .local_addr()
            .map_err(|e| Error::io("reading the listener's address", &e))?
            .port();
        let segment_name = format!("{}:{port}", config.host);
        let name = config.name.clone().unwrap_or_else(|| {
            format!(
                "ferry-{}-{}-{port}",
                std::process::id(),
                AGENTS.fetch_add(1, Ordering::Relaxed)
            )
        });
        let (l2, cfg2) = (Arc::clone(&lib), config.clone());
        let (agent, plugins) =
            tokio::task::spawn_blocking(move || -> Result<(Agent, Vec<String>)> {
                let agent = Agent::create(l2, &name, cfg2.progress_thread)?;
                let plugins = agent.available_plugins()?;
                for b in &cfg2.backends {
                    if !plugins.iter().any(|p| p == b) {
                        return Err(library::unavailable(format!(
                            "NIXL has no {b} backend plugin here (available: {}); the plugins are \
                         found next to libnixl_capi.so or in NIXL_PLUGIN_DIR",
                            if plugins.is_empty() {
                                "none".to_owned()
                            } else {
                                plugins.join(", ")
                            }
                        )));
                    }
                    agent.create_backend(b)?;
                }
                Ok((agent, plugins))
            })
            .await
            .map_err(|e| Error::Canceled(format!("starting the NIXL agent: {e}")))??;
        let agent = Arc::new(agent);
        let poller = Poller::start(Arc::clone(&agent), tokio::runtime::Handle::current())?;
        let inner = Arc::new(Inner {
            lib,
            agent,
            config,
            segment_name,
            plugins,
            regions: RegionTable::new(),
            advertised: Mutex::new(BTreeMap::new()),
            order: tokio::sync::Mutex::new(0),
            peers: Mutex::new(HashMap::new()),
            doubt: Mutex::new(BTreeMap::new()),
            next_peer: AtomicU64::new(1),
            segments: Mutex::new(HashMap::new()),
            remote_agents: Mutex::new(HashMap::new()),
            batches: BatchTable::new(BACKEND),
            poller,
            accept: Mutex::new(None),
            tasks: Mutex::new(Vec::new()),
            notes: Mutex::new(Notes::default()),
            inbox: ferry_core::raw::Inbox::new(MAX_QUEUED_NOTIFICATIONS, usize::MAX),
            refuse_notifications: std::sync::atomic::AtomicBool::new(false),
        });
        let weak = Arc::downgrade(&inner);
        let accept = tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    continue;
                };
                let Some(inner) = weak.upgrade() else { return };
                let w = Arc::downgrade(&inner);
                drop(inner);
                let task = tokio::spawn(serve_peer(w, stream));
                if let Some(inner) = weak.upgrade() {
                    let mut t = lock(&inner.tasks);
                    t.retain(|h| !h.is_finished());
                    t.push(task.abort_handle());
                }
            }
        });
        *lock(&inner.accept) = Some(accept.abort_handle());
        tracing::info!(
            segment = %inner.segment_name,
            agent = %inner.agent.name(),
            library = %inner.lib.path().display(),
            "ferry: NIXL engine started"
        );
        Ok(NixlEngine { inner })
    }

    /// The NIXL agent's name (what NIXL peers and notifications call it).
    pub fn agent_name(&self) -> &str {
        self.inner.agent.name()
    }

    /// From now on, drop every notification peers send and answer their
    /// confirmations "not received" (their batches then report the
    /// notification failed after the data moved). For tests of that path
    /// and for draining a server.
    pub fn set_refuse_notifications(&self, on: bool) {
        self.inner.refuse_notifications.store(on, Ordering::Release);
    }

    /// The library this engine runs on.
    pub fn library(&self) -> &Arc<NixlLibrary> {
        &self.inner.lib
    }

    /// The configuration the engine was started with.
    pub fn config(&self) -> &NixlConfig {
        &self.inner.config
    }

    /// NIXL requests that outlived their batch's deadline or cancellation
    /// and that NIXL has not released yet: their memory stays registered
    /// (unregistering it waits) until NIXL reports them finished.
    pub fn held_requests(&self) -> usize {
        self.inner.poller.held()
    }

    /// NIXL requests aborted in progress because the control connection of
    /// their segment was lost (their batches failed with `PeerLost`). Not
    /// proven to have stopped touching memory, their regions stay
    /// registered for the life of the engine (`unregister` answers
    /// `RegionHeld`).
    pub fn aborted_requests(&self) -> usize {
        self.inner.poller.aborted()
    }

    fn segment(&self, id: SegmentId) -> Result<Arc<Segment>> {
        lock(&self.inner.segments)
            .get(&id.0)
            .cloned()
            .ok_or(Error::UnknownSegment(id))
    }

    /// Checks, guards and posts `requests`, reporting through `driver`.
    /// `Err`: nothing was posted.
    async fn start_batch(
        &self,
        seg: &Arc<Segment>,
        requests: &[TransferRequest],
        notify: Option<&Notification>,
        driver: &BatchDriver,
    ) -> Result<()> {
        if let Some(n) = notify {
            n.validate()?;
        }
        if let Some(e) = seg.lost_error() {
            return Err(e);
        }
        let inner = &self.inner;
        let mut valid: Vec<(usize, TransferRequest, RegionGuard, RegionGuard)> = Vec::new();
        let mut failed = Vec::new();
        let mut fetched = false;
        for (i, r) in requests.iter().enumerate() {
            if r.len == 0 {
                continue;
            }
            let local = match inner
                .regions
                .acquire(r.local_addr, r.len, Side::Local, None)
            {
                Ok(g) => g,
                Err(e) => {
                    failed.push((i, e));
                    continue;
                }
            };
            let acquire = || {
                seg.remote
                    .acquire(r.remote_addr, r.len, Side::Remote, Some(&seg.name))
            };
            let remote = match acquire() {
                Ok(g) => Ok(g),
                Err(_) if !fetched && r.remote_addr.checked_add(r.len).is_some() => {
                    fetched = true;
                    seg.fetch().await?;
                    acquire()
                }
                Err(e) => Err(e),
            };
            match remote {
                Ok(g) => valid.push((i, *r, local, g)),
                Err(e) => failed.push((i, e)),
            }
        }
        // From here on nothing awaits until every request is posted: the
        // batch is posted whole or not at all, whatever happens to the
        // caller's future.
        let all_valid = failed.is_empty();
        for (i, e) in failed {
            driver.complete(i, Err(e));
        }
        for (i, r) in requests.iter().enumerate() {
            if r.len == 0 {
                driver.complete(i, Ok(()));
            }
        }
        let bytes: u64 = valid.iter().map(|v| v.1.len).sum();
        driver.set_deadline(
            Instant::now() + inner.config.deadline_for(bytes),
            Error::Timeout {
                operation: format!(
                    "a NIXL transfer of {} requests ({bytes} bytes)",
                    requests.len()
                ),
                peer: Some(seg.name.clone()),
                after: inner.config.deadline_for(bytes),
            },
        );
        let (writes, reads): (Vec<_>, Vec<_>) =
            valid.into_iter().partition(|v| v.1.op == TransferOp::Write);
        let groups: Vec<_> = [writes, reads]
            .into_iter()
            .filter(|g| !g.is_empty())
            .collect();
        let token = seg.token();
        let note = notify
            .filter(|_| all_valid)
            .map(|n| encode_notification(n, token));
        let attach = note.is_some() && groups.len() == 1;
        let mut pendings = Vec::new();
        for g in groups {
            let write = g[0].1.op == TransferOp::Write;
            let local: Vec<(u64, u64)> = g.iter().map(|v| (v.1.local_addr, v.1.len)).collect();
            let remote: Vec<(u64, u64)> = g.iter().map(|v| (v.1.remote_addr, v.1.len)).collect();
            let indices: Vec<usize> = g.iter().map(|v| v.0).collect();
            let guards: Vec<RegionGuard> = g.into_iter().flat_map(|v| [v.2, v.3]).collect();
            let msg = if attach { note.as_deref() } else { None };
            match inner.agent.post(write, &local, &remote, &seg.agent, msg) {
                Ok((req, _)) => pendings.push(Pending::new(req, indices, guards)),
                Err(e) => {
                    for i in indices {
                        driver.complete(i, Err(e.clone()));
                    }
                }
            }
        }
        if pendings.is_empty() && !attach {
            // Nothing for NIXL to move (every request empty or refused):
            // the notification, if any, is sent and confirmed here, so that
            // a batch of no requests (whose status has no request to keep
            // pending) is not seen finished before the peer has it.
            let notified = match note {
                Some(bytes) if driver.all_ok() => {
                    Some(match inner.agent.gen_notif(&seg.agent, &bytes) {
                        Ok(()) => seg.confirm(token, inner.agent.name()).await,
                        Err(e) => Err(e),
                    })
                }
                _ => None,
            };
            let _ = driver.finish(notified);
            return Ok(());
        }
        seg.inflight.fetch_add(1, Ordering::AcqRel);
        inner.poller.push(Job {
            driver: driver.clone(),
            pendings,
            notify_after: if attach {
                None
            } else {
                note.map(|n| (seg.agent.clone(), n))
            },
            attached: attach,
            token,
            sender: inner.agent.name().to_owned(),
            segment: Arc::clone(seg),
        });
        Ok(())
    }

    async fn run_detached(
        &self,
        segment: SegmentId,
        requests: &[TransferRequest],
        notify: Option<&Notification>,
    ) -> Result<BatchReport> {
        let seg = self.segment(segment)?;
        let driver = BatchDriver::detached(requests.len());
        self.start_batch(&seg, requests, notify, &driver).await?;
        driver.wait().await
    }
}

/// Serves one peer connected to the listener: the handshake, `FETCH`es and
/// `REVOKED` answers.
async fn serve_peer(inner: std::sync::Weak<Inner>, stream: TcpStream) {
    let who = stream
        .peer_addr()
        .map(|a| a.to_string())
        .unwrap_or_else(|_| "a peer".to_owned());
    let _ = stream.set_nodelay(true);
    let (mut rd, wr) = stream.into_split();
    let writer: Writer = Arc::new(tokio::sync::Mutex::new(PeerWriter::new(wr)));
    let pending: Revocations = Arc::default();
    let first = tokio::time::timeout(OPEN_TIMEOUT, read_frame(&mut rd, &who)).await;
    let Ok(Ok(Some(Frame::Hello { min, max }))) = first else {
        return;
    };
    let Some(engine) = inner.upgrade() else {
        return;
    };
    if max < VERSION_MIN || min > VERSION_MAX {
        let mut w = writer.lock().await;
        let refuse = Frame::Refuse(format!(
            "no common protocol version: the peer speaks {min}..={max}, this engine \
             {VERSION_MIN}..={VERSION_MAX}"
        ));
        let _ = w.send(&refuse, &who).await;
        let _ = w.shutdown().await;
        return;
    }
    let id = engine.next_peer.fetch_add(1, Ordering::Relaxed);
    {
        let _order = engine.order.lock().await;
        if send_state(&engine, &writer, &who).await.is_err() {
            return;
        }
        lock(&engine.peers).insert(
            id,
            Peer {
                who: who.clone(),
                writer: Arc::clone(&writer),
                pending: Arc::clone(&pending),
            },
        );
    }
    drop(engine);
    // Runs when this task ends, returned or aborted (the engine dropped):
    // the peer leaves the table and every revocation still waiting on it
    // is answered (dropped senders). Only a connection the peer closed
    // (end of stream) shows it has nothing in flight: Ferry's initiator
    // closes it only once NIXL released its last request on it, or its
    // process ended. Any other end (reset, read or write error, a frame
    // refused here, this engine dropping it) leaves the peer's requests
    // unknown: every region advertised to it, or being revoked from it,
    // goes into `doubt` first, so that the revocations answered here fail
    // with `RegionHeld` instead of taking the close as "nothing in flight".
    struct Gone {
        inner: std::sync::Weak<Inner>,
        id: u64,
        who: String,
        pending: Revocations,
        /// Why the connection ended, unless the peer closed it.
        abnormal: Option<String>,
    }
    impl Drop for Gone {
        fn drop(&mut self) {
            // Under the peer's revocation lock: a revocation starting now
            // sees `ended` (see `revoke_and_deregister`).
            let mut rev = lock(&self.pending);
            if let Some(engine) = self.inner.upgrade() {
                // The peer leaves the table, and the regions advertised to
                // it go into `doubt`, under one hold of `peers`, as a
                // revocation unadvertises a region and lists the peers
                // (`revoke_and_deregister`): either that list has this
                // peer (and the revocation meets `ended` below), or the
                // region is in `doubt` before the revocation looks there
                // last. Taken apart, a revocation could fall between them
                // and miss both: an `unregister` after a reset answered
                // Ok (tests/control_loss.rs, 2 runs in 40).
                let mut peers = lock(&engine.peers);
                peers.remove(&self.id);
                if let Some(why) = &self.abnormal {
                    let mut addrs: Vec<u64> = lock(&engine.advertised).keys().copied().collect();
                    addrs.extend(rev.waiting.values().map(|(a, _)| *a));
                    let mut doubt = lock(&engine.doubt);
                    for a in addrs {
                        doubt
                            .entry(a)
                            .or_insert_with(|| lost_peer_reason(&self.who, why));
                    }
                }
                drop(peers);
            }
            rev.ended = Some(self.abnormal.clone());
            rev.waiting.clear();
        }
    }
    let mut gone = Gone {
        inner: inner.clone(),
        id,
        who: who.clone(),
        pending: Arc::clone(&pending),
        abnormal: Some("the task serving it was stopped".to_owned()),
    };
    gone.abnormal = Some(loop {
        match read_frame(&mut rd, &who).await {
            Ok(Some(Frame::Fetch)) => {
                let Some(engine) = inner.upgrade() else {
                    break "the engine is gone".to_owned();
                };
                let _order = engine.order.lock().await;
                if let Err(e) = send_state(&engine, &writer, &who).await {
                    break format!("sending a STATE failed: {e}");
                }
            }
            Ok(Some(Frame::Revoked { seq })) => {
                if let Some((_, tx)) = lock(&pending).waiting.remove(&seq) {
                    let _ = tx.send(());
                }
            }
            Ok(Some(Frame::Confirm { token, sender })) => {
                let (w, who, inner) = (Arc::clone(&writer), who.clone(), inner.clone());
                tokio::spawn(async move {
                    let ok = match inner.upgrade() {
                        Some(engine) => engine.await_token(&sender, token).await,
                        None => false,
                    };
                    let mut w = w.lock().await;
                    let _ = w.send(&Frame::Confirmed { token, ok }, &who).await;
                });
            }
            Ok(Some(other)) => {
                tracing::warn!(peer = %who, frame = ?other, "ferry: NIXL peer sent an unexpected frame; closing");
                break format!("it sent an unexpected frame {other:?}");
            }
            Ok(None) => {
                // A write that took a reset leaves the read at end of
                // stream (see `PeerWriter`): asked under the writer's lock.
                if writer.lock().await.was_reset() {
                    break "the connection was reset".to_owned();
                }
                // The peer closed it: nothing of it is in flight.
                gone.abnormal = None;
                return;
            }
            Err(e) => {
                tracing::warn!(peer = %who, error = %e, "ferry: NIXL peer connection failed");
                break e.to_string();
            }
        }
    });
}

/// Writes a `STATE` (the caller holds `order`).
async fn send_state(
    engine: &Inner,
    writer: &tokio::sync::Mutex<PeerWriter>,
    who: &str,
) -> Result<()> {
    let regions: Vec<(u64, u64)> = lock(&engine.advertised)
        .iter()
        .map(|(a, l)| (*a, *l))
        .collect();
    let metadata = engine.agent.local_md()?;
    let frame = Frame::State(State {
        version: VERSION_MAX,
        agent: engine.agent.name().to_owned(),
        metadata,
        regions,
    });
    writer.lock().await.send(&frame, who).await
}

/// The initiator's side of a segment connection: applies `STATE`s, answers
/// `REVOKE`s once no transfer into the region is in flight.
async fn read_segment(
    seg: Arc<Segment>,
    agent: Arc<Agent>,
    mut rd: tokio::net::tcp::OwnedReadHalf,
) {
    let reason = loop {
        match read_frame(&mut rd, &seg.name).await {
            Ok(Some(Frame::State(s))) => {
                let r = apply_state(&agent, &seg.agent, &seg.remote, &s, &seg.name);
                if let Some(tx) = lock(&seg.waiter).take() {
                    let _ = tx.send(r);
                }
            }
            Ok(Some(Frame::Confirmed { token, ok })) => {
                if let Some(tx) = lock(&seg.confirms).remove(&token) {
                    let _ = tx.send(ok);
                }
            }
            Ok(Some(Frame::Revoke { seq, addr })) => {
                let s = Arc::clone(&seg);
                tokio::spawn(async move {
                    // Waits until every transfer into the region has been
                    // reported finished by NIXL (their guards dropped). A
                    // region still used by a request aborted in progress
                    // (`RegionHeld`) is never answered: the target then
                    // keeps it registered.
                    match s.remote.remove(addr).await {
                        Ok(_) | Err(Error::RegionNotRegistered { .. }) => {}
                        Err(e) => {
                            tracing::warn!(peer = %s.name, addr, error = %e, "ferry: not answering a NIXL REVOKE: a request of ours may still use the region");
                            return;
                        }
                    }
                    let mut w = s.writer.lock().await;
                    let _ = write_frame(&mut *w, &Frame::Revoked { seq }, &s.name).await;
                });
            }
            Ok(Some(other)) => break format!("unexpected frame {other:?}"),
            Ok(None) => break "the connection closed".to_owned(),
            Err(e) => break e.to_string(),
        }
    };
    *lock(&seg.lost) = Some(reason.clone());
    // The peer can no longer ask us to stop using its regions (a `REVOKE`
    // would not arrive): the requests still in flight are aborted now.
    seg.aborted.store(true, Ordering::Release);
    // Where the connection itself still works (a frame this side could
    // not take), the peer must not see our later close (end of stream) as
    // "nothing in flight": it is told the connection is given up, which a
    // target takes as an abnormal end (best effort; a dead connection
    // needs nothing).
    {
        let giving_up = Frame::Refuse(format!("the initiator gave up this connection: {reason}"));
        let mut w = seg.writer.lock().await;
        let _ = tokio::time::timeout(
            Duration::from_secs(1),
            write_frame(&mut *w, &giving_up, &seg.name),
        )
        .await;
    }
    tracing::warn!(
        peer = %seg.name,
        reason = %reason,
        in_flight = seg.inflight.load(Ordering::Acquire),
        "ferry: lost the NIXL control connection; aborting the requests in flight on it"
    );
    lock(&seg.confirms).clear();
    if let Some(tx) = lock(&seg.waiter).take() {
        let _ = tx.send(Err(Error::PeerLost {
            peer: seg.name.clone(),
            reason,
        }));
    }
}

impl NixlEngine {
    /// Stops accepting peers, closes the segments (their readers stop,
    /// whatever waits on them ends with `PeerLost`) and ends the
    /// notification waiters. `peers_too` (on drop): also ends the tasks
    /// serving peers, which `shutdown` leaves running (see
    /// [`Inner::tasks`]).
    fn stop_tasks(&self, peers_too: bool) {
        self.inner.inbox.close();
        if let Some(t) = lock(&self.inner.accept).take() {
            t.abort();
        }
        if peers_too {
            for t in lock(&self.inner.tasks).drain(..) {
                t.abort();
            }
        }
        for (_, s) in lock(&self.inner.segments).drain() {
            if let Some(r) = lock(&s.reader).take() {
                r.abort();
            }
            // The reader's own ending (`read_segment`) does not run when it
            // is aborted: confirmations and a waiting open end here, so
            // that no task keeps the segment (and its connection) alive.
            // The connection closes once the last batch posted on it is
            // finished (the poller holds the segment until then), which
            // is what tells the peer that nothing of ours still uses its
            // regions.
            lock(&s.lost).get_or_insert_with(|| "this engine was shut down".to_owned());
            lock(&s.confirms).clear();
            if let Some(tx) = lock(&s.waiter).take() {
                let _ = tx.send(Err(Error::Canceled("the engine was shut down".to_owned())));
            }
        }
    }
}

impl Drop for NixlEngine {
    fn drop(&mut self) {
        self.stop_tasks(true);
        // Waits for the poller thread (bounded), so that no thread of
        // ours tears an agent down after the engine is gone, possibly while
        // the process exits (see `Poller::stop_and_wait`).
        self.inner.poller.stop_and_wait(POLLER_STOP);
    }
}

/// Why a region stays registered after the control connection of peer
/// `who` ended other than by the peer closing it (`why`).
fn lost_peer_reason(who: &str, why: &str) -> String {
    format!(
        "the control connection of NIXL peer {who} ended without the peer closing it ({why}) \
         while it could use this region: its NIXL requests into it may still be in flight and \
         cannot be shown finished; the region stays registered and its memory must not be freed"
    )
}

/// Refuses a listener other hosts can reach unless `insecure` says so
/// (then logs it): the listener authenticates nobody, and its `STATE` is
/// all another NIXL agent needs to read and write every registered region.
async fn check_exposure(config: &NixlConfig) -> Result<()> {
    let addrs: Vec<std::net::SocketAddr> =
        tokio::net::lookup_host((config.host.as_str(), config.port))
            .await
            .map_err(|e| Error::io(format!("resolving {}", config.host), &e))?
            .collect();
    let exposed: Vec<String> = addrs
        .iter()
        .filter(|a| !a.ip().is_loopback())
        .map(|a| a.ip().to_string())
        .collect();
    if exposed.is_empty() && !addrs.is_empty() {
        return Ok(());
    }
    if !config.insecure {
        return Err(Error::InvalidArgument(format!(
            "refusing to start the NIXL metadata listener on {:?} ({}): it is not a loopback \
             address, and the listener authenticates nobody: any host that can reach it \
             receives this agent's NIXL metadata (the remote keys of every registered region) \
             and can read and write all of that memory with its own NIXL agent. Listen on a \
             loopback address, or accept the exposure explicitly with insecure=1 \
             (NixlConfig::insecure) on a network you trust",
            config.host,
            if exposed.is_empty() {
                "resolves to no address".to_owned()
            } else {
                exposed.join(", ")
            }
        )));
    }
    tracing::warn!(
        host = %config.host,
        addresses = %exposed.join(", "),
        "ferry: NIXL metadata listener beyond loopback without authentication (insecure=1): \
         every host that can reach it can read and write this agent's registered memory"
    );
    Ok(())
}

fn mem_kind(loc: &Location) -> Result<(i32, u64)> {
    if loc.is_host() {
        let node = loc
            .as_str()
            .split_once(':')
            .and_then(|(_, n)| n.parse::<u64>().ok())
            .unwrap_or(0);
        Ok((library::MEM_DRAM, node))
    } else if loc.is_cuda() {
        let dev = loc
            .as_str()
            .split_once(':')
            .and_then(|(_, n)| n.parse::<u64>().ok())
            .ok_or_else(|| {
                Error::InvalidArgument(format!("location {loc} names no CUDA device"))
            })?;
        Ok((library::MEM_VRAM, dev))
    } else {
        Err(Error::InvalidArgument(format!(
            "the nixl backend registers host (cpu:N) or CUDA (cuda:N) memory, not {loc}"
        )))
    }
}

/// A failed [`Inner::register_nixl`]: the error, and the addresses NIXL
/// may still hold (their rollback deregistration failed).
struct NixlRegisterFailed {
    error: Error,
    kept: Vec<u64>,
}

impl NixlRegisterFailed {
    fn nothing(error: Error) -> NixlRegisterFailed {
        NixlRegisterFailed {
            error,
            kept: Vec::new(),
        }
    }
}

impl Inner {
    /// Moves what NIXL received into Ferry's queue.
    fn drain_notes(&self) -> Result<()> {
        let got = self.agent.take_notifs()?;
        if got.is_empty() {
            return Ok(());
        }
        if self.refuse_notifications.load(Ordering::Acquire) {
            // Taken from NIXL and discarded: dropped.
            for _ in &got {
                self.inbox.count_refused(ferry_core::raw::PushRefused::Full);
            }
            return Ok(());
        }
        let mut notes = lock(&self.notes);
        for (sender, bytes) in got {
            let (note, token) = decode_notification(&sender, &bytes);
            // Taken from NIXL, it cannot be refused any more: beyond the
            // bound the oldest goes (under `notes`, so drains keep NIXL's
            // order).
            if let Err(ferry_core::raw::PushRefused::Full) = self.inbox.push(note.clone()) {
                let _ = self.inbox.take_next(None);
                tracing::warn!("ferry: nixl notification queue full; dropped the oldest");
                let _ = self.inbox.push(note);
            }
            if let Some(t) = token {
                let key = (sender, t);
                if notes.seen.insert(key.clone()) {
                    notes.seen_order.push_back(key);
                }
                while notes.seen_order.len() > MAX_SEEN_TOKENS {
                    if let Some(old) = notes.seen_order.pop_front() {
                        notes.seen.remove(&old);
                    }
                }
            }
        }
        Ok(())
    }

    /// Waits (up to [`CONFIRM_TIMEOUT`]) until the notification `token` of
    /// agent `sender` has been taken from NIXL; whether it was.
    async fn await_token(&self, sender: &str, token: u64) -> bool {
        let start = Instant::now();
        let key = (sender.to_owned(), token);
        let mut nap = Duration::from_micros(20);
        loop {
            let _ = self.drain_notes();
            if lock(&self.notes).seen.remove(&key) {
                return true;
            }
            if start.elapsed() > CONFIRM_TIMEOUT
                || self.refuse_notifications.load(Ordering::Acquire)
            {
                return false;
            }
            tokio::time::sleep(nap).await;
            nap = (nap * 2).min(Duration::from_millis(1));
        }
    }

    /// Registers with NIXL and advertises; the region is already in the
    /// table. Nothing awaits: cancel-safe. On failure, the groups already
    /// registered are deregistered; the error names the addresses NIXL
    /// may still hold (a deregistration that failed), which must stay in
    /// the table.
    fn register_nixl(&self, regions: &[RegionInfo]) -> std::result::Result<(), NixlRegisterFailed> {
        let mut by_kind: BTreeMap<i32, RegDescs> = BTreeMap::new();
        for r in regions {
            let (kind, dev) = mem_kind(r.location()).map_err(NixlRegisterFailed::nothing)?;
            by_kind
                .entry(kind)
                .or_default()
                .push((r.addr(), r.len(), dev));
        }
        let mut done: Vec<(i32, &RegDescs)> = Vec::new();
        for (kind, descs) in &by_kind {
            if let Err(error) = self.agent.register(*kind, descs, true) {
                let mut kept = Vec::new();
                for (k, d) in done {
                    if let Err(undo) = self.agent.register(k, d, false) {
                        tracing::warn!(
                            error = %undo,
                            "ferry: NIXL refused to deregister regions of a failed register; \
                             they stay registered"
                        );
                        kept.extend(d.iter().map(|&(addr, _, _)| addr));
                    }
                }
                return Err(NixlRegisterFailed { error, kept });
            }
            done.push((*kind, descs));
        }
        let mut adv = lock(&self.advertised);
        for r in regions {
            adv.insert(r.addr(), r.len());
        }
        Ok(())
    }

    /// Takes the region of `removal` (idle, closed to new transfers) back
    /// from every peer, then from NIXL, then out of the table.
    ///
    /// A peer answers a `REVOKE` once every transfer of its own into the
    /// region is finished in NIXL, or closes its connection (which it does
    /// only once its last request on it is released, or when its process
    /// ends). A peer that does neither within [`Inner::revoke_limit`] (its
    /// NIXL request never finishing, or the peer process stopped) cannot be
    /// shown done: the region stays registered with NIXL and in the table
    /// (unadvertised), and `unregister` fails with `RegionHeld`, so that
    /// its memory is not freed (`RegisteredBuffer` leaks it) while the peer
    /// may still write it. A later `unregister` asks again.
    ///
    /// A peer whose connection ended any other way (reset, error, a frame
    /// refused) is never shown done: the region is in [`Inner::doubt`] and
    /// stays registered for good (`RegionHeld`). A `REVOKE` that cannot be
    /// written is answered by how the connection ended.
    async fn revoke_and_deregister(self: Arc<Self>, addr: u64, removal: Removal) -> Result<()> {
        let Some(region) = removal.region() else {
            return Err(Error::RegionNotRegistered { addr });
        };
        let held = |reason: String| Error::RegionHeld {
            addr: region.addr(),
            reason,
        };
        if let Some(reason) = lock(&self.doubt).get(&region.addr()).cloned() {
            // `removal` dropped unfinished: still registered, usable.
            return Err(held(reason));
        }
        let waits = {
            let mut order = self.order.lock().await;
            *order += 1;
            let seq = *order;
            // Unadvertised and the peers listed under one hold of `peers`
            // (see `Gone` in `serve_peer`): a peer whose connection ends
            // meanwhile is in this list, or put this region in `doubt`.
            let peers: Vec<(String, Writer, Revocations)> = {
                let peers = lock(&self.peers);
                lock(&self.advertised).remove(&region.addr());
                peers
                    .values()
                    .map(|p| (p.who.clone(), Arc::clone(&p.writer), Arc::clone(&p.pending)))
                    .collect()
            };
            let mut waits = Vec::new();
            for (who, w, pending) in peers {
                let (tx, rx) = oneshot::channel();
                {
                    let mut rev = lock(&pending);
                    match &rev.ended {
                        None => {
                            rev.waiting.insert(seq, (region.addr(), tx));
                        }
                        // Closed by the peer meanwhile: nothing in flight.
                        Some(None) => continue,
                        Some(Some(why)) => {
                            lock(&self.doubt)
                                .entry(region.addr())
                                .or_insert_with(|| lost_peer_reason(&who, why));
                            continue;
                        }
                    }
                }
                let mut w = w.lock().await;
                let revoke = Frame::Revoke {
                    seq,
                    addr: region.addr(),
                };
                if let Err(e) = w.send(&revoke, &who).await {
                    // The connection is broken: how it ended (seen by the
                    // task serving it, which then answers) decides.
                    tracing::debug!(peer = %who, error = %e, "ferry: a NIXL REVOKE could not be sent");
                }
                waits.push(rx);
            }
            waits
        };
        let limit = self.revoke_limit(region.len());
        let answered = tokio::time::timeout(limit, async {
            for w in waits {
                // Err: the connection ended. The peer closed it (nothing
                // in flight), or it ended otherwise and the region is in
                // `doubt` (checked below).
                let _ = w.await;
            }
        })
        .await;
        if answered.is_err() {
            // `removal` dropped unfinished: the region is open again (and
            // unadvertised: peers drop it when they see the `REVOKE`).
            return Err(held(format!(
                "a peer did not confirm within {limit:?} that none of its NIXL transfers \
                 into this region is still in flight (its request never finished, or the \
                 peer is stopped); the region stays registered and its memory must not be \
                 freed"
            )));
        }
        if let Some(reason) = lock(&self.doubt).get(&region.addr()).cloned() {
            return Err(held(reason));
        }
        let (kind, dev) = mem_kind(region.location())?;
        self.agent
            .register(kind, &[(region.addr(), region.len(), dev)], false)?;
        removal.finish();
        Ok(())
    }

    /// How long `unregister` waits for peers to give a region back: as long
    /// as a batch moving the whole region may take.
    fn revoke_limit(&self, len: u64) -> Duration {
        self.config.deadline_for(len)
    }
}

impl ferry_core::inbound::InboundSource for Inner {
    fn snapshot(&self) -> ferry_core::InboundSnapshot {
        ferry_core::InboundSnapshot::new().with_notifications_dropped(self.inbox.dropped())
    }
}

#[deny(clippy::missing_trait_methods)]
impl TransferEngine for NixlEngine {
    fn backend_name(&self) -> &str {
        BACKEND
    }

    fn segment_name(&self) -> &str {
        &self.inner.segment_name
    }

    fn capabilities(&self) -> Capabilities {
        let mut caps = Capabilities::all();
        caps.memory = MemoryKinds {
            host: true,
            cuda: false,
        };
        caps
    }

    fn backend_info(&self) -> BackendInfo {
        let i = &self.inner;
        BackendInfo {
            backend: BACKEND.to_owned(),
            details: vec![
                ("library".to_owned(), i.lib.path().display().to_string()),
                ("library source".to_owned(), i.lib.source().to_string()),
                (
                    "nixl generation".to_owned(),
                    format!("{} or later (from its symbols)", i.lib.generation()),
                ),
                ("agent".to_owned(), i.agent.name().to_owned()),
                ("nixl backends".to_owned(), i.config.backends.join(",")),
                ("nixl plugins available".to_owned(), i.plugins.join(",")),
                (
                    "metadata exchange".to_owned(),
                    format!(
                        "ferry listener {} (protocol v{VERSION_MAX})",
                        i.segment_name
                    ),
                ),
                (
                    "ucx modules".to_owned(),
                    crate::ucx_env::decision()
                        .unwrap_or("not examined")
                        .to_owned(),
                ),
                (
                    "cuda memory".to_owned(),
                    "passed to NIXL as VRAM; untested on this build's hosts".to_owned(),
                ),
            ],
            not_native: Vec::new(),
            emulated: Vec::new(),
        }
    }

    async fn register(&self, region: MemoryRegion) -> Result<()> {
        self.batch_register(vec![region])
            .await
            .map_err(|e| match e {
                Error::BatchRegisterFailed { source, .. } => *source,
                other => other,
            })
    }

    async fn unregister(&self, addr: u64) -> Result<()> {
        let removal = self.inner.regions.remove_in_steps(addr).await?;
        // The rest runs to the end even if the caller goes away: the region
        // is closed to new transfers and is taken back from the peers and
        // from NIXL (or, where a peer cannot be shown done, stays
        // registered).
        let inner = Arc::clone(&self.inner);
        tokio::spawn(inner.revoke_and_deregister(addr, removal))
            .await
            .map_err(|e| Error::Canceled(format!("unregistering: {e}")))?
    }

    async fn batch_register(&self, regions: Vec<MemoryRegion>) -> Result<()> {
        for (index, r) in regions.iter().enumerate() {
            let checked = if r.is_empty() {
                Err(Error::InvalidArgument(
                    "cannot register an empty region".to_owned(),
                ))
            } else {
                mem_kind(r.location()).map(|_| ())
            };
            if let Err(e) = checked {
                return Err(Error::BatchRegisterFailed {
                    index,
                    addr: r.addr(),
                    source: Box::new(e),
                });
            }
        }
        let infos: Vec<RegionInfo> = regions.iter().map(MemoryRegion::info).collect();
        self.inner.regions.insert_all(regions)?;
        if let Err(failed) = self.inner.register_nixl(&infos) {
            // Out of the table only what NIXL surely does not hold: a
            // region whose rollback failed stays (unadvertised), so that a
            // later `unregister` deregisters it from NIXL again.
            for r in infos.iter().filter(|r| !failed.kept.contains(&r.addr())) {
                let _ = self.inner.regions.remove(r.addr()).await;
            }
            if let Some(&addr) = failed.kept.first() {
                return Err(Error::RegionHeld {
                    addr,
                    reason: format!(
                        "the registration failed ({}) and NIXL refused to undo {} region(s) \
                         registered before, which may stay registered; they stay in Ferry's \
                         table: unregister them (to retry NIXL's deregistration) before \
                         freeing the memory",
                        failed.error,
                        failed.kept.len()
                    ),
                });
            }
            return Err(Error::BatchRegisterFailed {
                index: 0,
                addr: infos.first().map(RegionInfo::addr).unwrap_or(0),
                source: Box::new(failed.error),
            });
        }
        Ok(())
    }

    async fn batch_unregister(&self, addrs: &[u64]) -> Result<()> {
        let mut first = None;
        for &a in addrs {
            if let Err(e) = self.unregister(a).await {
                first.get_or_insert(e);
            }
        }
        first.map_or(Ok(()), Err)
    }

    async fn open_segment(&self, name: &str) -> Result<SegmentId> {
        let unavailable = |reason: String| Error::SegmentUnavailable {
            name: name.to_owned(),
            reason,
        };
        let opened = tokio::time::timeout(OPEN_TIMEOUT, async {
            let stream = TcpStream::connect(name).await.map_err(|e| {
                unavailable(format!("cannot connect to its metadata listener: {e}"))
            })?;
            let _ = stream.set_nodelay(true);
            let (mut rd, mut wr) = stream.into_split();
            write_frame(
                &mut wr,
                &Frame::Hello {
                    min: VERSION_MIN,
                    max: VERSION_MAX,
                },
                name,
            )
            .await?;
            match read_frame(&mut rd, name).await {
                Ok(Some(Frame::State(s))) => Ok((rd, wr, s)),
                Ok(Some(Frame::Refuse(r))) => Err(unavailable(format!("the peer refused: {r}"))),
                Ok(Some(other)) => Err(Error::Protocol {
                    peer: name.to_owned(),
                    reason: format!("expected STATE, got {other:?}"),
                }),
                Ok(None) => Err(unavailable(
                    "the peer closed the connection (not a Ferry NIXL engine?)".to_owned(),
                )),
                Err(e) => Err(unavailable(format!("not a Ferry NIXL engine: {e}"))),
            }
        })
        .await
        .map_err(|_| unavailable(format!("no answer within {OPEN_TIMEOUT:?}")))?;
        let (rd, wr, state) = opened?;
        if !(VERSION_MIN..=VERSION_MAX).contains(&state.version) {
            return Err(unavailable(format!(
                "the peer answered with protocol version {}, this engine speaks \
                 {VERSION_MIN}..={VERSION_MAX}",
                state.version
            )));
        }
        let seg = Arc::new(Segment {
            name: name.to_owned(),
            agent: state.agent.clone(),
            remote: RegionTable::new(),
            writer: tokio::sync::Mutex::new(wr),
            fetch_lock: tokio::sync::Mutex::new(()),
            confirms: Arc::default(),
            next_token: AtomicU64::new(1),
            waiter: Mutex::new(None),
            lost: Mutex::new(None),
            reader: Mutex::new(None),
            inflight: AtomicUsize::new(0),
            idle: Notify::new(),
            aborted: std::sync::atomic::AtomicBool::new(false),
        });
        let agent = Arc::clone(&self.inner.agent);
        let (a2, s2) = (Arc::clone(&agent), Arc::clone(&seg));
        tokio::task::spawn_blocking(move || {
            apply_state(&a2, &s2.agent, &s2.remote, &state, &s2.name)
        })
        .await
        .map_err(|e| Error::Canceled(format!("loading NIXL metadata: {e}")))??;
        *lock(&self.inner.remote_agents)
            .entry(seg.agent.clone())
            .or_insert(0) += 1;
        let reader = tokio::spawn(read_segment(Arc::clone(&seg), agent, rd));
        *lock(&seg.reader) = Some(reader.abort_handle());
        let id = SegmentId::fresh().0;
        lock(&self.inner.segments).insert(id, seg);
        Ok(SegmentId(id))
    }

    async fn close_segment(&self, segment: SegmentId) -> Result<()> {
        let seg = lock(&self.inner.segments)
            .remove(&segment.0)
            .ok_or(Error::UnknownSegment(segment))?;
        loop {
            let idle = seg.idle.notified();
            if seg.inflight.load(Ordering::Acquire) == 0 {
                break;
            }
            idle.await;
        }
        if let Some(r) = lock(&seg.reader).take() {
            r.abort();
        }
        let last = {
            let mut m = lock(&self.inner.remote_agents);
            match m.get_mut(&seg.agent) {
                Some(n) if *n > 1 => {
                    *n -= 1;
                    false
                }
                _ => {
                    m.remove(&seg.agent);
                    true
                }
            }
        };
        if last && seg.agent != self.inner.agent.name() {
            if let Err(e) = self.inner.agent.invalidate_remote_md(&seg.agent) {
                tracing::debug!(agent = %seg.agent, error = %e, "ferry: NIXL kept a peer's metadata");
            }
        }
        Ok(())
    }

    async fn transfer(&self, segment: SegmentId, request: TransferRequest) -> Result<()> {
        let report = self.run_detached(segment, &[request], None).await?;
        report.results.into_iter().next().unwrap_or(Ok(()))
    }

    async fn batch_transfer(
        &self,
        segment: SegmentId,
        requests: &[TransferRequest],
        notify: Option<&Notification>,
    ) -> Result<BatchReport> {
        self.run_detached(segment, requests, notify).await
    }

    async fn submit(
        &self,
        segment: SegmentId,
        requests: &[TransferRequest],
        notify: Option<&Notification>,
    ) -> Result<BatchId> {
        let seg = self.segment(segment)?;
        let admission = self.inner.batches.admit(requests.len())?;
        let driver = admission.driver().clone();
        self.start_batch(&seg, requests, notify, &driver).await?;
        Ok(admission.claim())
    }

    fn status(&self, batch: BatchId) -> Result<BatchStatus> {
        self.inner.batches.status(batch)
    }

    async fn wait(&self, batch: BatchId) -> Result<BatchReport> {
        self.inner.batches.wait(batch).await
    }

    async fn release_batch(&self, batch: BatchId) -> Result<()> {
        self.inner.batches.release(batch)
    }

    async fn take_notifications(&self) -> Result<Vec<Notification>> {
        self.inner.drain_notes()?;
        Ok(self.inner.inbox.take_all())
    }

    async fn next_notification(&self, name: Option<&str>) -> Result<Notification> {
        // `drain_notes` is synchronous: nothing it took can be lost to a
        // dropped future.
        self.inner
            .inbox
            .pull_then(name, || std::future::ready(self.inner.drain_notes()))
            .await
    }

    fn live_batches(&self) -> Option<usize> {
        Some(self.inner.batches.len())
    }

    /// NIXL moves peers' bytes (UCX, one-sided) without telling Ferry:
    /// `served` is `None`; the dropped notifications are counted (the
    /// oldest dropped when the queue is full, and those discarded while
    /// refusing).
    fn inbound(&self) -> Option<ferry_core::Inbound> {
        Some(ferry_core::Inbound::weak(&self.inner))
    }

    /// Stops accepting peers, closes every segment (its reader stops) and
    /// ends the notification waiters with `Canceled`. Batches already
    /// posted run to their end in NIXL; peers already connected are still
    /// served, so that this engine's regions can be unregistered safely
    /// afterwards. NIXL's progress thread stops when the engine is
    /// dropped.
    async fn shutdown(&self) -> Result<()> {
        self.stop_tasks(false);
        Ok(())
    }
}

/// Keeps the type in the API docs of `poller` honest.
#[allow(dead_code)]
fn _req_is_send(r: XferReq) -> impl Send {
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn notifications_round_trip_and_foreign_ones_are_text() {
        let n = Notification::new("prefill-0", "req-42:kv-ready");
        assert_eq!(
            decode_notification("agent-x", &encode_notification(&n, 7)),
            (n.clone(), Some(7))
        );
        assert_eq!(
            decode_notification("agent-x", b"hello"),
            (Notification::new("agent-x", "hello"), None)
        );
        // Truncated Ferry encodings never panic.
        let enc = encode_notification(&n, 9);
        for cut in 0..enc.len() {
            let _ = decode_notification("a", &enc[..cut]);
        }
    }
}

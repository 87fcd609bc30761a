//! `MooncakeEngine`: the `TransferEngine` trait over Mooncake's C API.

use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, LazyLock, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use tokio::sync::{watch, OwnedRwLockReadGuard, RwLock};
use transport_core::{
    BackendInfo, BatchId, BatchReport, BatchStatus, Capabilities, Error, MemoryRegion,
    MissingCapability, Notification, Operation, RegionGuard, RegionTable, Result, SegmentId, Side,
    TransferEngine, TransferOp, TransferRequest, TransferState,
};

use crate::codes::call_error;
use crate::config::{MooncakeConfig, P2P_HANDSHAKE};
use crate::library::{
    status, CBufferEntry, CNotifyMsg, CTransferRequest, CTransferStatus, Generation,
    MooncakeLibrary, INVALID_BATCH, OPCODE_READ, OPCODE_WRITE,
};

mod landed;

use landed::{Probe, Scratch};

const BACKEND: &str = "mooncake";

use transport_core::raw::lock;

extern "C" {
    /// libc's `free`, for notification buffers of v0.3.5 (see
    /// `take_notifications`).
    fn free(ptr: *mut c_void);
}

// ------------------------------------------------------------------ peers

/// Region tables of the Mooncake engines of this process, by segment name.
///
/// Mooncake's C API cannot list a remote segment's buffers, and builds
/// before v0.3.12 write at the peer wherever the address points, registered
/// or not. For peers in this process Ferry knows the regions and checks
/// every remote range before submitting (and holds the peer's region while
/// the transfer runs, so the peer's `unregister` waits for it). Peers in
/// other processes are checked by the library alone (from v0.3.12; older
/// builds do not check, which the capability report says).
static PEERS: LazyLock<Mutex<HashMap<String, (u64, RegionTable)>>> =
    LazyLock::new(|| Mutex::new(HashMap::new()));
static ENGINE_IDS: AtomicU64 = AtomicU64::new(1);

// ------------------------------------------------------------------ engine

/// The C engine handle. Mooncake's engine is used from many threads at once
/// by its own Python and C++ callers; every call Ferry makes is one of its
/// thread-safe C entry points.
struct RawEngine(*mut c_void);
// SAFETY: see above — the handle is an opaque pointer to a thread-safe
// object, only ever passed to the library's C functions.
unsafe impl Send for RawEngine {}
// SAFETY: as above.
unsafe impl Sync for RawEngine {}

/// One handle returned by `open_segment`. Handles to the same name share
/// the library's segment (Mooncake caches it by name), which is closed when
/// the last handle is.
struct Segment {
    c_id: i32,
    name: String,
    gate: Arc<RwLock<()>>,
    peer: Option<RegionTable>,
}

#[derive(Default)]
struct Segments {
    by_id: HashMap<u64, Segment>,
    /// Library segment id and number of open handles, by name.
    by_name: HashMap<String, (i32, usize)>,
    next: u64,
}

impl Segments {
    fn add(&mut self, name: &str, c_id: i32, peer: Option<RegionTable>) -> SegmentId {
        self.next += 1;
        let id = self.next;
        self.by_id.insert(
            id,
            Segment {
                c_id,
                name: name.to_owned(),
                gate: Arc::new(RwLock::new(())),
                peer,
            },
        );
        SegmentId(id)
    }
}

enum Slot {
    Done(Result<()>),
    Task(usize),
}

/// Region guards and the segment gate a library batch needs until the
/// library reports every task terminal.
struct Hold {
    _guards: Vec<RegionGuard>,
    _gate: OwnedRwLockReadGuard<()>,
}

/// A batch submitted to the library, owned by the engine's poller thread
/// until it is freed.
struct Live {
    c_id: u64,
    tasks: usize,
    peer: String,
    budget: Duration,
    /// Terminal result of each task, filled in by the poller.
    results: Mutex<Vec<Option<Result<()>>>>,
    hold: Mutex<Option<Hold>>,
    /// Becomes true once every task is terminal and the batch is freed.
    done: watch::Sender<bool>,
}

/// One batch as the caller sees it: decisions made before submitting, and
/// the library batch, if any request was submitted.
struct Pending {
    slots: Vec<Slot>,
    live: Option<Arc<Live>>,
    /// For a batch whose writes are confirmed (see `landed`): the results
    /// once confirmed; they replace the library's.
    landing: Option<Arc<Landing>>,
    deadline: Instant,
    budget: Duration,
    peer: String,
}

/// The final results of a batch whose writes are confirmed after the
/// library reports them sent.
struct Landing {
    results: Mutex<Option<Vec<Result<()>>>>,
    done: watch::Sender<bool>,
}

/// The C engine and its library; destroyed when the last holder (the
/// engine or its poller thread) lets go.
struct Core {
    lib: Arc<MooncakeLibrary>,
    raw: RawEngine,
    /// Released after the C engine (and its metadata entry) is gone.
    _name: Option<NameReservation>,
    /// Freed after the C engine is gone.
    _scratch: Option<Arc<Scratch>>,
}

impl Drop for Core {
    fn drop(&mut self) {
        // SAFETY: created by this library, destroyed once; every batch was
        // freed first (the poller holds the Core until its queue is empty).
        unsafe { (self.lib.api.destroy)(self.raw.0) };
    }
}

#[derive(Default)]
struct PollQueue {
    live: Vec<Arc<Live>>,
    stop: bool,
    /// A batch was added since the poller last looked: poll it at the
    /// fastest pace (a new batch must not wait out an idle backoff).
    fresh: bool,
}

/// Shared between an engine and its poller thread.
#[derive(Default)]
struct Poller {
    queue: Mutex<PollQueue>,
    wake: Condvar,
    in_use: AtomicUsize,
}

struct Inner {
    /// The C engine, owned by the poller thread's `Core`, which outlives
    /// this struct (it stops only after `Inner::drop`).
    raw: RawEngine,
    lib: Arc<MooncakeLibrary>,
    poller: Arc<Poller>,
    uid: u64,
    config: MooncakeConfig,
    server_name: String,
    segment_name: String,
    regions: RegionTable,
    segments: Mutex<Segments>,
    batches: Mutex<HashMap<u64, Pending>>,
    next_batch: AtomicU64,
    /// Probe memory, when writes are confirmed (see `landed`).
    scratch: Option<Arc<Scratch>>,
    /// Why notifications do not work with this build, if they do not.
    notify_gap: Option<MissingCapability>,
    /// Name of the notification the start-up probe sent to this engine
    /// itself (filtered out of `take_notifications`).
    probe_name: String,
}

impl Inner {
    fn raw(&self) -> *mut c_void {
        self.raw.0
    }
}

/// Who chose the native library a [`MooncakeConfig`] resolves to; see
/// [`MooncakeEngine::start_trusted`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LibraryTrust {
    /// The configuration (`lib=`, `FERRY_MOONCAKE_LIB`, the loader's search
    /// path) comes from the operator, who vouches for the library as they
    /// would for one linked at build time; never from a peer or a request.
    OperatorConfigured,
}

/// A Mooncake Transfer Engine, loaded at run time (see the crate docs).
///
/// Cloning gives another handle to the same engine; the C engine is
/// destroyed when the last handle (and the last background batch reaper)
/// is gone.
#[derive(Clone)]
pub struct MooncakeEngine {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for MooncakeEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MooncakeEngine")
            .field("segment", &self.inner.segment_name)
            .field("library", &self.inner.lib)
            .finish()
    }
}

async fn blocking<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> Result<T> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| Error::Canceled(format!("a blocking Mooncake call did not finish: {e}")))
}

fn cstring(what: &str, s: &str) -> Result<CString> {
    CString::new(s).map_err(|_| Error::InvalidArgument(format!("{what} contains a NUL byte")))
}

/// The NIC priority matrix for `installTransport`'s first argument.
fn device_matrix(device: &str) -> String {
    if device.trim_start().starts_with('{') {
        return device.to_owned();
    }
    let nics: Vec<String> = device
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| format!("{s:?}"))
        .collect();
    format!("{{\"cpu:0\": [[{}], []]}}", nics.join(", "))
}

/// Names in use by the live engines of this process: `local_server_name`s
/// given to the library in metadata-server mode. Mooncake keeps one metadata
/// entry per name, and a second engine with the same name overwrites the
/// first one's entry (and, on builds that bind the port the entry names,
/// throws from inside the C API, which aborts the process).
static LIVE_NAMES: LazyLock<Mutex<std::collections::HashSet<String>>> =
    LazyLock::new(|| Mutex::new(std::collections::HashSet::new()));

/// The `local_server_name` and RPC port to give `createTransferEngine`.
///
/// - `P2PHANDSHAKE` (≥ v0.3.0): Mooncake names the segment
///   `<host part of local_server_name>:<port it picks>` and ignores
///   `ip_or_host_name` and `rpc_port`, so the name given is the host, and
///   `name=` / `port=` are refused as meaningless.
/// - metadata server, v0.2.0 era (no `getLocalIpAndPort`): the library
///   publishes `host:port` as given and its TCP transport binds that port;
///   port 0 would be published as 0 (unreachable), so Ferry picks a free
///   port, and checks a given one is free (a clash throws a C++ exception
///   through the C API, which aborts the process).
/// - metadata server, ≥ v0.3.0: the library picks a random port and
///   announces `MC_TCP_BIND_ADDRESS` or the first LAN address; `host=` and
///   `port=` are ignored by the library (logged).
fn local_identity(
    lib: &MooncakeLibrary,
    config: &MooncakeConfig,
    p2p: bool,
) -> Result<(String, u16, Option<NameReservation>)> {
    if p2p {
        if config.name.is_some() {
            return Err(Error::InvalidArgument(format!(
                "mooncake: name= names the segment only with a metadata server; with \
                 {P2P_HANDSHAKE} Mooncake names it <host>:<port it picks> (set host= to the \
                 address peers should use)"
            )));
        }
        if config.port != 0 {
            return Err(Error::InvalidArgument(format!(
                "mooncake: port= has no effect with {P2P_HANDSHAKE}: Mooncake picks its own \
                 port (the segment name says which)"
            )));
        }
        if lib.generation() == Generation::V0_3_0 {
            // v0.3.0–v0.3.4 listen for TCP data on the RPC port + 1 without
            // checking it is free (a clash throws through the C API and
            // aborts the process), and honour a port in the name: give them
            // a pair of free ports.
            let port = free_port_pair(&config.host)?;
            return Ok((format!("{}:{port}", config.host), 0, None));
        }
        return Ok((config.host.clone(), 0, None));
    }
    static NAMES: AtomicU64 = AtomicU64::new(0);
    let name = config.name.clone().unwrap_or_else(|| {
        format!(
            "ferry-{}-{}",
            std::process::id(),
            NAMES.fetch_add(1, Ordering::Relaxed)
        )
    });
    if !lock(&LIVE_NAMES).insert(name.clone()) {
        return Err(Error::InvalidArgument(format!(
            "mooncake: name {name:?} is in use by a live engine of this process; each \
             engine needs its own name (it is the key of its metadata entry)"
        )));
    }
    let reservation = NameReservation(name.clone());
    if lib.generation() >= Generation::V0_3_0 {
        if std::env::var("MC_TCP_BIND_ADDRESS").map_or(true, |a| a != config.host) {
            tracing::info!(
                host = %config.host,
                "ferry: Mooncake {} in metadata-server mode ignores host= and port=: it \
                 announces MC_TCP_BIND_ADDRESS or the first LAN address, on a port it picks",
                lib.generation()
            );
        }
        return Ok((name, config.port, Some(reservation)));
    }
    let port = if config.port == 0 {
        free_port(&config.host)?
    } else {
        ensure_port_free(&config.host, config.port)?;
        config.port
    };
    Ok((name, port, Some(reservation)))
}

/// A name held in [`LIVE_NAMES`] until the C engine that uses it is
/// destroyed (the reservation lives in its `Core`).
struct NameReservation(String);

impl Drop for NameReservation {
    fn drop(&mut self) {
        lock(&LIVE_NAMES).remove(&self.0);
    }
}

/// A port nothing listens on at `host` (see [`free_ports`]).
fn free_port(host: &str) -> Result<u16> {
    free_ports(host, 1)
}

/// A port `p` such that `p` and `p + 1` are both free at `host`.
fn free_port_pair(host: &str) -> Result<u16> {
    free_ports(host, 2)
}

/// A port `p` such that `p .. p + n` are all free at `host` (bound, then
/// released: another process could take one in between, a window of
/// microseconds). Chosen below the kernel's ephemeral range (32768 and up
/// by default), where the outgoing connections of the library itself (old
/// builds open one per request) do not compete, starting at a point that
/// differs per process and per call.
fn free_ports(host: &str, n: u16) -> Result<u16> {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let seed = u64::from(std::process::id()).wrapping_mul(7919)
        + NEXT.fetch_add(u64::from(n), Ordering::Relaxed);
    for i in 0..256u64 {
        let p = 20000 + ((seed + u64::from(n) * i) % 10000) as u16;
        let all: std::io::Result<Vec<std::net::TcpListener>> = (0..n)
            .map(|k| std::net::TcpListener::bind(("0.0.0.0", p + k)))
            .collect();
        if all.is_ok() {
            return Ok(p);
        }
    }
    Err(Error::Unavailable {
        backend: BACKEND.into(),
        reason: format!("found no {n} consecutive free TCP ports on host {host:?} in 256 tries"),
    })
}

/// Fails with `InvalidArgument` when `port` cannot be bound: the library
/// would throw from inside the C API (process abort) instead of failing.
fn ensure_port_free(host: &str, port: u16) -> Result<()> {
    // The library binds the IPv4 wildcard address.
    match std::net::TcpListener::bind(("0.0.0.0", port)) {
        Ok(_) => Ok(()),
        Err(e) => Err(Error::InvalidArgument(format!(
            "mooncake: port {port} (host {host}) cannot be bound ({e}); this Mooncake build \
             would abort the process on it, so Ferry refuses it: give a free port, or 0"
        ))),
    }
}

impl MooncakeEngine {
    /// Loads the library (see [`MooncakeLibrary::resolve`]), creates a C
    /// engine, installs the configured transport and returns the engine.
    ///
    /// Errors: [`Error::InvalidArgument`] for a bad config;
    /// [`Error::Unavailable`] when the library cannot be found or loaded, is
    /// not Mooncake, is older than v0.2.0, or cannot create the engine or the
    /// transport (the message says which and why); [`Error::MissingSymbol`]
    /// when a required symbol is missing.
    ///
    /// # Safety
    ///
    /// This loads native code into the process and runs it: the library
    /// `config.library` names (the `lib=` URL parameter), else the one
    /// `FERRY_MOONCAKE_LIB` names, else `libtransfer_engine.so` from the
    /// loader's search path. Whoever sets those chooses code that runs with
    /// the process's rights, so they must come from the operator, never from
    /// a peer or a request. The library must be a Mooncake Transfer Engine
    /// build (or implement the same C API), as [`MooncakeLibrary::load`]
    /// requires.
    pub async unsafe fn start(config: MooncakeConfig) -> Result<MooncakeEngine> {
        config.validate()?;
        let cfg = config.clone();
        // SAFETY: forwarded to the caller (see above).
        let lib = blocking(move || unsafe { MooncakeLibrary::resolve(&cfg) }).await??;
        Self::start_with_library(lib, config).await
    }

    /// [`MooncakeEngine::start`] for code that states, with `trust`, that
    /// the library the configuration resolves to was chosen by the operator
    /// (the `ferry` facade does so for URLs, which it documents as trusted
    /// configuration).
    pub async fn start_trusted(
        config: MooncakeConfig,
        trust: LibraryTrust,
    ) -> Result<MooncakeEngine> {
        let LibraryTrust::OperatorConfigured = trust;
        // SAFETY: `trust` is the caller's statement of `start`'s contract.
        unsafe { Self::start(config) }.await
    }

    /// As [`MooncakeEngine::start`], with a library already loaded (its
    /// `config.library` is ignored).
    pub async fn start_with_library(
        lib: Arc<MooncakeLibrary>,
        config: MooncakeConfig,
    ) -> Result<MooncakeEngine> {
        config.validate()?;
        let p2p = config.metadata == P2P_HANDSHAKE;
        if p2p && lib.api.get_local_ip_and_port.is_none() {
            return Err(Error::Unavailable {
                backend: BACKEND.into(),
                reason: format!(
                    "{} is Mooncake {} (no getLocalIpAndPort): metadata {P2P_HANDSHAKE} needs \
                     Mooncake ≥ v0.3.0; give a metadata server with `metadata=` instead",
                    lib.path().display(),
                    lib.generation()
                ),
            });
        }
        let (server_name, port, reservation) = local_identity(&lib, &config, p2p)?;
        let meta = cstring("metadata", &config.metadata)?;
        let name_c = cstring("name", &server_name)?;
        let host = cstring("host", &config.host)?;
        let proto = cstring("protocol", &config.protocol)?;
        let matrix = match &config.device {
            Some(d) => Some(cstring("device", &device_matrix(d))?),
            None => None,
        };
        let port = u64::from(port);
        let api = lib.api;
        let created = blocking(move || {
            // SAFETY: `create` has the C API's signature (5 arguments, see
            // `library::CreateFn` for why that is sound on 4-argument
            // builds); the strings live until the call returns and Mooncake
            // copies them.
            let h = unsafe { (api.create)(meta.as_ptr(), name_c.as_ptr(), host.as_ptr(), port, 0) };
            if h.is_null() {
                return Err("createTransferEngine returned NULL".to_owned());
            }
            let mut args: [*mut c_void; 2] = [
                matrix
                    .as_ref()
                    .map_or(std::ptr::null_mut(), |m| m.as_ptr() as *mut c_void),
                std::ptr::null_mut(),
            ];
            let args_ptr = if matrix.is_some() {
                args.as_mut_ptr()
            } else {
                std::ptr::null_mut()
            };
            // SAFETY: `h` is a live engine; `proto` and `args` outlive the call.
            let t = unsafe { (api.install_transport)(h, proto.as_ptr(), args_ptr) };
            if t.is_null() {
                // SAFETY: `h` came from `create` and is destroyed once.
                unsafe { (api.destroy)(h) };
                return Err(format!(
                    "installTransport({:?}) returned NULL",
                    proto.to_string_lossy()
                ));
            }
            Ok(RawEngine(h))
        })
        .await?;
        let raw = created.map_err(|what| Error::Unavailable {
            backend: BACKEND.into(),
            reason: format!(
                "{what} ({} {}, metadata {:?}, local_server_name {:?}, host {}, port {}, \
                 protocol {}); the library's log says why",
                lib.path().display(),
                lib.generation(),
                config.metadata,
                server_name,
                config.host,
                port,
                config.protocol
            ),
        })?;
        // From here on the Core destroys the engine when dropped.
        let scratch = (sends_unacknowledged(&lib, &config) && config.confirm_writes != Some(false))
            .then(|| Arc::new(Scratch::new()));
        let core = Arc::new(Core {
            lib: Arc::clone(&lib),
            raw,
            _name: reservation,
            _scratch: scratch.clone(),
        });
        if let Some(s) = &scratch {
            let engine = RawEngine(core.raw.0);
            let addr = s.addr() as usize;
            let loc = cstring("location", "cpu:0")?;
            let rc = blocking(move || {
                let e = engine;
                // SAFETY: live engine (the Core keeps it); the scratch buffer
                // stays allocated until after the engine is destroyed.
                unsafe { (api.register)(e.0, addr as *mut c_void, Scratch::LEN, loc.as_ptr(), 1) }
            })
            .await?;
            if rc != 0 {
                return Err(Error::Unavailable {
                    backend: BACKEND.into(),
                    reason: format!(
                        "registering the write-confirmation probe memory failed: {}",
                        call_error("registerLocalMemory", i64::from(rc))
                    ),
                });
            }
        }
        let segment_name = match (p2p, api.get_local_ip_and_port) {
            (true, Some(get)) => {
                let mut buf = vec![0u8; 256];
                // SAFETY: live engine; the buffer is writable for its length.
                let rc = unsafe { get(core.raw.0, buf.as_mut_ptr().cast::<c_char>(), buf.len()) };
                let got = CStr::from_bytes_until_nul(&buf)
                    .map(|s| s.to_string_lossy().into_owned())
                    .unwrap_or_default();
                if rc != 0 || got.is_empty() {
                    return Err(Error::Unavailable {
                        backend: BACKEND.into(),
                        reason: format!(
                            "getLocalIpAndPort failed ({rc}) on {}",
                            lib.path().display()
                        ),
                    });
                }
                got
            }
            _ => server_name.clone(),
        };
        let uid = ENGINE_IDS.fetch_add(1, Ordering::Relaxed);
        let probe_name = format!("ferry-notify-probe-{uid}");
        let notify_gap = notify_gap(&lib, &config, &core, &segment_name, &probe_name).await;
        let poller = Arc::new(Poller::default());
        // The poller thread is the only owner of the Core from here on, so
        // destroyTransferEngine (which may block: it joins threads and may
        // talk to the metadata server) runs there, never on an async worker.
        let raw = RawEngine(core.raw.0);
        {
            let poller = Arc::clone(&poller);
            std::thread::Builder::new()
                .name("ferry-mooncake-poll".into())
                .spawn(move || poll_loop(&core, &poller))
                .map_err(|e| Error::io("starting the Mooncake status poller", &e))?;
        }
        let regions = RegionTable::new();
        lock(&PEERS).insert(segment_name.clone(), (uid, regions.clone()));
        tracing::info!(
            library = %lib.path().display(),
            generation = %lib.generation(),
            segment = %segment_name,
            protocol = %config.protocol,
            "ferry: Mooncake engine started"
        );
        Ok(MooncakeEngine {
            inner: Arc::new(Inner {
                raw,
                lib,
                poller,
                uid,
                config,
                server_name,
                segment_name,
                regions,
                segments: Mutex::new(Segments::default()),
                batches: Mutex::new(HashMap::new()),
                next_batch: AtomicU64::new(1),
                scratch,
                notify_gap,
                probe_name,
            }),
        })
    }

    /// The loaded library.
    pub fn library(&self) -> &Arc<MooncakeLibrary> {
        &self.inner.lib
    }

    /// The detected generation.
    pub fn generation(&self) -> Generation {
        self.inner.lib.generation()
    }

    /// The configuration in force.
    pub fn config(&self) -> &MooncakeConfig {
        &self.inner.config
    }

    /// The `local_server_name` given to the library.
    pub fn server_name(&self) -> &str {
        &self.inner.server_name
    }

    /// Batches submitted and not yet waited for or released (at most
    /// [`transport_core::MAX_LIVE_BATCHES`]).
    pub fn live_batches(&self) -> usize {
        lock(&self.inner.batches).len()
    }

    /// Library batches allocated and not yet freed (including batches whose
    /// deadline passed: the engine's poller thread frees them once the
    /// library reports every task terminal).
    pub fn library_batches_in_use(&self) -> usize {
        self.inner.poller.in_use.load(Ordering::Acquire)
    }

    fn native_caps(&self) -> Capabilities {
        Capabilities {
            batch_register: true,
            batch_unregister: true,
            batch_transfer: true,
            async_batch: true,
            batch_wait: true,
            notify: self.has_notify(),
            landed_writes: !sends_unacknowledged(&self.inner.lib, &self.inner.config)
                || self.confirms_writes(),
            peer_validation: !sends_unacknowledged(&self.inner.lib, &self.inner.config),
            ..Default::default()
        }
    }

    /// Whether writes are confirmed by reading them back (see `landed`).
    fn confirms_writes(&self) -> bool {
        self.inner.scratch.is_some()
    }

    /// What "completed" means and whether the peer checks addresses, in
    /// words for the capability report.
    fn guarantees(&self) -> (String, &'static str) {
        if !sends_unacknowledged(&self.inner.lib, &self.inner.config) {
            return (
                "landed (acknowledged by the peer)".into(),
                "yes (the peer refuses addresses outside its registered regions)",
            );
        }
        let completion = if self.confirms_writes() {
            "landed: this build's TCP transport reports a write completed when it is sent, so \
             Ferry reads each write's last byte back until it shows before reporting it \
             completed (acknowledged by the library from Mooncake v0.3.12)"
        } else {
            "sent, not landed: this build's TCP transport reports a write completed when it \
             is handed to the socket, before the peer has written it, and confirm_writes is \
             off (acknowledged from Mooncake v0.3.12)"
        };
        (
            completion.into(),
            "no: this build's TCP transport writes at the peer wherever the address points, \
             registered or not, and reports success; Ferry checks peers in this process \
             itself (checked at the peer from Mooncake v0.3.12)",
        )
    }

    /// The guarantees this engine cannot give natively, with reasons.
    fn guarantees_missing(&self) -> Vec<MissingCapability> {
        if !sends_unacknowledged(&self.inner.lib, &self.inner.config) {
            return Vec::new();
        }
        let lib = &self.inner.lib;
        let min_version = Some(Generation::V0_3_12.mooncake_version());
        vec![
            MissingCapability {
                operation: Operation::LandedWrites,
                reason: format!(
                    "{} ({}) reports a TCP write completed when it is sent, with no \
                     acknowledgement from the peer{}",
                    lib.path().display(),
                    lib.generation(),
                    if self.confirms_writes() {
                        ""
                    } else {
                        " (Ferry confirms landings itself unless confirm_writes=0 or strict=1)"
                    }
                ),
                min_version: min_version.clone(),
            },
            MissingCapability {
                operation: Operation::PeerValidation,
                reason: format!(
                    "{} ({}) writes and reads at the peer wherever the address points \
                     (mapped but unregistered memory is overwritten)",
                    lib.path().display(),
                    lib.generation()
                ),
                min_version,
            },
        ]
    }

    fn notify_missing(&self) -> MissingCapability {
        self.inner
            .notify_gap
            .clone()
            .unwrap_or_else(|| MissingCapability {
                operation: Operation::Notify,
                reason: "notifications work with this build".into(),
                min_version: None,
            })
    }

    /// Whether notifications work with this build and transport.
    fn has_notify(&self) -> bool {
        self.inner.notify_gap.is_none()
    }

    fn refuse_notify(&self) -> Error {
        let m = self.notify_missing();
        Error::Unsupported {
            backend: BACKEND.into(),
            operation: Operation::Notify,
            reason: m.reason,
            min_version: m.min_version,
        }
    }

    // -------------------------------------------------------------- batches

    /// Checks, submits and records a batch; returns its id.
    async fn submit_batch(
        &self,
        segment: SegmentId,
        requests: &[TransferRequest],
        notify: Option<&Notification>,
    ) -> Result<u64> {
        let inner = &self.inner;
        if let Some(n) = notify {
            if !self.has_notify() {
                return Err(self.refuse_notify());
            }
            n.validate()?;
        }
        let (c_id, peer_name, gate, peer_table) = {
            let segs = lock(&inner.segments);
            let s = segs
                .by_id
                .get(&segment.0)
                .ok_or(Error::UnknownSegment(segment))?;
            (s.c_id, s.name.clone(), Arc::clone(&s.gate), s.peer.clone())
        };
        let gate = gate.read_owned().await;
        if !lock(&inner.segments).by_id.contains_key(&segment.0) {
            return Err(Error::UnknownSegment(segment));
        }
        if lock(&inner.batches).len() >= transport_core::MAX_LIVE_BATCHES {
            return Err(transport_core::live_batches_full(BACKEND));
        }

        let mut slots = Vec::with_capacity(requests.len());
        let mut guards = Vec::new();
        let mut entries: Vec<CTransferRequest> = Vec::new();
        // The slot of each entry, for mapping results back.
        let mut entry_slot: Vec<usize> = Vec::new();
        let mut bytes = 0u64;
        for r in requests {
            if r.len == 0 {
                slots.push(Slot::Done(Ok(())));
                continue;
            }
            let local = match inner
                .regions
                .acquire(r.local_addr, r.len, Side::Local, None)
            {
                Ok(g) => g,
                Err(e) => {
                    slots.push(Slot::Done(Err(e)));
                    continue;
                }
            };
            let remote = match &peer_table {
                Some(t) => match t.acquire(r.remote_addr, r.len, Side::Remote, Some(&peer_name)) {
                    Ok(g) => Some(g),
                    Err(e) => {
                        slots.push(Slot::Done(Err(e)));
                        continue;
                    }
                },
                None => None,
            };
            guards.push(local);
            guards.extend(remote);
            entry_slot.push(slots.len());
            slots.push(Slot::Task(entries.len()));
            bytes = bytes.saturating_add(r.len);
            entries.push(CTransferRequest {
                opcode: match r.op {
                    TransferOp::Read => OPCODE_READ,
                    TransferOp::Write => OPCODE_WRITE,
                },
                source: r.local_addr as usize as *mut c_void,
                target_id: c_id,
                file_id_or_padding: 0,
                target_offset: r.remote_addr,
                length: r.len,
            });
        }
        let budget = inner.config.deadline_for(bytes);
        let deadline = Instant::now() + budget;

        // Writes whose landing is confirmed (see `landed`): make each
        // target's last byte differ from what the write puts there, and drop
        // the writes whose target could not be probed.
        let mut probes: Vec<(usize, Probe)> = Vec::new();
        if self.confirms_writes() {
            let writes: Vec<usize> = (0..entries.len())
                .filter(|&i| entries[i].opcode == OPCODE_WRITE)
                .collect();
            let ranges: Vec<(u64, u64)> = writes
                .iter()
                .map(|&i| {
                    let e = &entries[i];
                    (e.target_offset, e.target_offset.saturating_add(e.length))
                })
                .collect();
            let wanted: Vec<(usize, Probe)> = writes
                .iter()
                .zip(landed::probe_addresses(&ranges))
                .filter_map(|(&i, at)| {
                    let at = at?;
                    let e = &entries[i];
                    let src = e.source as usize as u64 + (at - e.target_offset);
                    // SAFETY: inside local memory registered with this
                    // engine (the request's range), held by `guards` until
                    // the batch is done.
                    let value = unsafe { (src as usize as *const u8).read_volatile() };
                    Some((
                        i,
                        Probe {
                            c_id,
                            last: at,
                            value,
                        },
                    ))
                })
                .collect();
            if !wanted.is_empty() {
                let just: Vec<Probe> = wanted.iter().map(|(_, p)| *p).collect();
                let ready = self.prepare_writes(&just, &peer_name, deadline).await;
                let mut refused: HashMap<usize, Error> = HashMap::new();
                for ((i, p), r) in wanted.into_iter().zip(ready) {
                    match r {
                        Ok(()) => probes.push((i, p)),
                        // The probe used up the batch's deadline: the batch
                        // timed out, as it would have waiting for the write.
                        Err(Error::Timeout { .. }) => {
                            refused.insert(
                                i,
                                Error::Timeout {
                                    operation: "mooncake batch".into(),
                                    peer: Some(peer_name.clone()),
                                    after: budget,
                                },
                            );
                        }
                        Err(e) => {
                            refused.insert(i, e);
                        }
                    }
                }
                if !refused.is_empty() {
                    let mut kept = Vec::with_capacity(entries.len());
                    let mut kept_slot = Vec::with_capacity(entries.len());
                    let mut new_index = vec![usize::MAX; entries.len()];
                    for (i, (e, slot)) in entries.into_iter().zip(entry_slot).enumerate() {
                        match refused.remove(&i) {
                            Some(err) => slots[slot] = Slot::Done(Err(err)),
                            None => {
                                new_index[i] = kept.len();
                                slots[slot] = Slot::Task(kept.len());
                                kept.push(e);
                                kept_slot.push(slot);
                            }
                        }
                    }
                    entries = kept;
                    for (i, _) in &mut probes {
                        *i = new_index[*i];
                    }
                }
            }
        }

        let all_ok = slots.iter().all(|s| !matches!(s, Slot::Done(Err(_))));
        // The notification goes only with a batch where every request can
        // succeed; one refused up front means it is not sent.
        let notify = notify.filter(|_| all_ok);

        let mut landing = None;
        let live = if entries.is_empty() {
            if let Some(n) = notify {
                self.gen_notify(c_id, n).await?;
            }
            None
        } else {
            let this = Arc::clone(&self.inner);
            // The notification is sent by the finishing task below once every
            // request is done (and its writes confirmed), never with the
            // submission: submitTransferWithNotify of v0.3.5 sends it before
            // the data, that of v0.3.6 on the first completed task.
            let finish = !probes.is_empty() || notify.is_some();
            let hold = Hold {
                _guards: guards,
                _gate: gate,
            };
            let (poller_hold, confirm_hold) = if finish {
                (None, Some(hold))
            } else {
                (Some(hold), None)
            };
            let peer = peer_name.clone();
            let live = blocking(move || this.launch(entries, peer, budget, poller_hold)).await??;
            if let Some(hold) = confirm_hold {
                let (done, _) = watch::channel(false);
                let l = Arc::new(Landing {
                    results: Mutex::new(None),
                    done,
                });
                landing = Some(Arc::clone(&l));
                let engine = self.clone();
                let live = Arc::clone(&live);
                let notify = notify.cloned();
                let peer = peer_name.clone();
                tokio::spawn(async move {
                    let results = engine
                        .confirm_batch(&live, c_id, &probes, notify.as_ref(), &peer, deadline)
                        .await;
                    // The bytes are in place (or the batch failed): release
                    // the memory, then publish.
                    drop(hold);
                    *lock(&l.results) = Some(results);
                    l.done.send_replace(true);
                });
            }
            Some(live)
        };
        let id = inner.next_batch.fetch_add(1, Ordering::Relaxed);
        lock(&inner.batches).insert(
            id,
            Pending {
                slots,
                live,
                landing,
                deadline,
                budget,
                peer: peer_name,
            },
        );
        Ok(id)
    }

    /// Runs after a batch with writes to confirm is submitted: waits for the
    /// library, confirms every write it reported completed, then sends the
    /// notification if every request succeeded. Returns one result per
    /// library task.
    async fn confirm_batch(
        &self,
        live: &Arc<Live>,
        c_id: i32,
        probes: &[(usize, Probe)],
        notify: Option<&Notification>,
        peer: &str,
        deadline: Instant,
    ) -> Vec<Result<()>> {
        // The library must be done with the memory before the guards go,
        // whatever the deadline says.
        let mut done = live.done.subscribe();
        let _ = done.wait_for(|d| *d).await;
        let mut results: Vec<Result<()>> = lock(&live.results)
            .iter()
            .map(|r| {
                r.clone()
                    .unwrap_or_else(|| Err(Error::Canceled("task not reported".into())))
            })
            .collect();
        let sent: Vec<(usize, Probe)> = probes
            .iter()
            .filter(|(t, _)| results[*t].is_ok())
            .copied()
            .collect();
        let just: Vec<Probe> = sent.iter().map(|(_, p)| *p).collect();
        let landed = self.confirm_writes(&just, peer, deadline).await;
        for ((t, _), r) in sent.iter().zip(landed) {
            results[*t] = r;
        }
        if let Some(n) = notify {
            if results.iter().all(Result::is_ok) {
                if let Err(e) = self.gen_notify(c_id, n).await {
                    // The data moved; the notification did not: the last
                    // request carries the failure.
                    if let Some(last) = results.last_mut() {
                        *last = Err(e);
                    }
                }
            }
        }
        results
    }

    async fn gen_notify(&self, c_id: i32, n: &Notification) -> Result<()> {
        let gen = self
            .inner
            .lib
            .api
            .gen_notify
            .ok_or_else(|| self.refuse_notify())?;
        let name = cstring("name", &n.name)?;
        let msg = cstring("message", &n.message)?;
        let this = Arc::clone(&self.inner);
        let rc = blocking(move || {
            let m = CNotifyMsg {
                name: name.as_ptr() as *mut c_char,
                msg: msg.as_ptr() as *mut c_char,
            };
            // SAFETY: live engine; the strings outlive the call and Mooncake
            // copies them.
            unsafe { gen(this.raw(), c_id as u64, m) }
        })
        .await?;
        if rc != 0 {
            return Err(call_error("genNotifyInEngine", i64::from(rc)));
        }
        Ok(())
    }

    /// Whether every request of `p` is terminal (or its deadline passed):
    /// exactly when `status` says the batch is finished.
    fn finished(p: &Pending) -> bool {
        Self::states(p).iter().all(TransferState::is_terminal)
    }

    fn states(p: &Pending) -> Vec<TransferState> {
        let results = match &p.landing {
            Some(l) => lock(&l.results)
                .clone()
                .map(|v| v.into_iter().map(Some).collect::<Vec<_>>()),
            None => p.live.as_ref().map(|l| lock(&l.results).clone()),
        };
        let timed_out = Instant::now() >= p.deadline;
        p.slots
            .iter()
            .map(|s| match s {
                Slot::Done(Ok(())) => TransferState::Completed,
                Slot::Done(Err(e)) => TransferState::Failed(e.clone()),
                Slot::Task(t) => match results.as_ref().and_then(|r| r[*t].clone()) {
                    Some(Ok(())) => TransferState::Completed,
                    Some(Err(e)) => TransferState::Failed(e),
                    None if timed_out => TransferState::Failed(Error::Timeout {
                        operation: "mooncake batch".into(),
                        peer: Some(p.peer.clone()),
                        after: p.budget,
                    }),
                    None => TransferState::Pending { transferred: 0 },
                },
            })
            .collect()
    }

    fn report(p: &Pending) -> BatchReport {
        BatchReport {
            results: Self::states(p)
                .into_iter()
                .map(|s| match s {
                    TransferState::Failed(e) => Err(e),
                    _ => Ok(()),
                })
                .collect(),
        }
    }

    async fn wait_batch(&self, id: u64) -> Result<BatchReport> {
        let (done, deadline) = {
            let batches = lock(&self.inner.batches);
            let p = batches.get(&id).ok_or(Error::UnknownBatch(BatchId(id)))?;
            let done = match &p.landing {
                Some(l) => Some(l.done.subscribe()),
                None => p.live.as_ref().map(|l| l.done.subscribe()),
            };
            (done, p.deadline)
        };
        if let Some(mut done) = done {
            let deadline = tokio::time::Instant::from_std(deadline);
            // Err = deadline passed (reported per request below) or the
            // poller is gone (cannot happen while the engine lives).
            let _ = tokio::time::timeout_at(deadline, done.wait_for(|d| *d)).await;
        }
        let p = lock(&self.inner.batches)
            .remove(&id)
            .ok_or(Error::UnknownBatch(BatchId(id)))?;
        // A batch past its deadline stays with the poller, which frees it
        // (and releases its memory) once the library is done with it.
        Ok(Self::report(&p))
    }
}

/// The engine's poller thread: polls every live library batch with backoff,
/// records terminal results, frees each batch once every task is terminal,
/// then releases its memory guards and wakes its waiters. It holds the Core,
/// so the C engine outlives every batch; it exits when the engine is gone
/// and no batch is left.
fn poll_loop(core: &Core, poller: &Poller) {
    let api = core.lib.api;
    let mut idle = Duration::from_micros(10);
    loop {
        let live: Vec<Arc<Live>> = {
            let mut q = lock(&poller.queue);
            while q.live.is_empty() {
                if q.stop {
                    return;
                }
                q = poller.wake.wait(q).unwrap_or_else(|p| p.into_inner());
            }
            if std::mem::take(&mut q.fresh) {
                idle = Duration::from_micros(10);
            }
            q.live.clone()
        };
        let mut progressed = false;
        for l in &live {
            let mut results = lock(&l.results);
            let mut all = true;
            for (task, slot) in results.iter_mut().enumerate() {
                if slot.is_some() {
                    continue;
                }
                let mut st = CTransferStatus::default();
                // SAFETY: `l.c_id` is a live batch of this engine (freed only
                // below, once), `task` is below the submitted count.
                let rc = unsafe { (api.get_status)(core.raw.0, l.c_id, task, &mut st) };
                match task_result(rc, st.status, l) {
                    Some(r) => {
                        *slot = Some(r);
                        progressed = true;
                    }
                    None => all = false,
                }
            }
            drop(results);
            if !all {
                continue;
            }
            // SAFETY: every task is terminal; the batch is freed once.
            let rc = unsafe { (api.free_batch)(core.raw.0, l.c_id) };
            if rc != 0 {
                tracing::warn!(
                    code = rc,
                    name = crate::codes::code_name(i64::from(rc)),
                    "ferry: freeBatchID refused a finished batch; retrying"
                );
                continue;
            }
            debug_assert!(l.tasks > 0);
            poller.in_use.fetch_sub(1, Ordering::AcqRel);
            lock(&poller.queue).live.retain(|x| !Arc::ptr_eq(x, l));
            // The library is done with the memory: release it, then wake.
            drop(lock(&l.hold).take());
            l.done.send_replace(true);
            progressed = true;
        }
        if progressed {
            idle = Duration::from_micros(10);
            continue;
        }
        let q = lock(&poller.queue);
        if q.fresh {
            // Added while this pass ran (its wake-up was missed): go again.
            continue;
        }
        let _ = poller.wake.wait_timeout(q, idle);
        idle = (idle * 2).min(Duration::from_millis(1));
    }
}

/// A task's terminal result, or `None` while it is still running.
fn task_result(rc: c_int, st: c_int, l: &Live) -> Option<Result<()>> {
    if rc != 0 {
        return Some(Err(call_error("getTransferStatus", i64::from(rc))));
    }
    Some(match st {
        status::WAITING | status::PENDING => return None,
        status::COMPLETED => Ok(()),
        status::TIMEOUT => Err(Error::Timeout {
            operation: "mooncake transfer (the library's own deadline)".into(),
            peer: Some(l.peer.clone()),
            after: l.budget,
        }),
        status::CANCELED => Err(Error::Canceled("Mooncake canceled the transfer".into())),
        other => {
            let status = match other {
                status::FAILED => "FAILED",
                status::INVALID => "INVALID",
                _ => "unknown",
            };
            Err(Error::TransferFailed {
                backend: BACKEND.into(),
                peer: l.peer.clone(),
                status: format!("{status} ({other})"),
                detail: "the library gives no reason; usual causes: the peer address is \
                         not inside a region the peer registered (checked by Mooncake's TCP \
                         transport from v0.3.12), or the peer is unreachable or died"
                    .into(),
            })
        }
    })
}

impl Inner {
    /// Submits `entries` as one library batch and hands it to the poller
    /// (blocking: call on the blocking pool). `hold` is released by the
    /// poller once the library is done (`None`: the caller keeps it).
    fn launch(
        &self,
        entries: Vec<CTransferRequest>,
        peer: String,
        budget: Duration,
        hold: Option<Hold>,
    ) -> Result<Arc<Live>> {
        let tasks = entries.len();
        let c_id = self.submit_c(entries)?;
        let (done, _) = watch::channel(false);
        let live = Arc::new(Live {
            c_id,
            tasks,
            peer,
            budget,
            results: Mutex::new(vec![None; tasks]),
            hold: Mutex::new(hold),
            done,
        });
        let mut q = lock(&self.poller.queue);
        q.live.push(Arc::clone(&live));
        q.fresh = true;
        self.poller.wake.notify_one();
        Ok(live)
    }

    fn submit_c(&self, mut entries: Vec<CTransferRequest>) -> Result<u64> {
        let api = self.lib.api;
        // SAFETY: live engine.
        let id = unsafe { (api.allocate_batch)(self.raw(), entries.len()) };
        if id == INVALID_BATCH {
            return Err(Error::Backend {
                backend: BACKEND.into(),
                operation: "allocateBatchID".into(),
                code: -1,
                name: "invalid batch id".into(),
            });
        }
        // SAFETY: live engine and batch; `entries` outlives the call
        // (Mooncake copies the requests).
        let rc = unsafe { (api.submit)(self.raw(), id, entries.as_mut_ptr(), entries.len()) };
        if rc != 0 {
            // Nothing was submitted, so the batch is not busy.
            // SAFETY: live batch, freed once.
            let free_rc = unsafe { (api.free_batch)(self.raw(), id) };
            if free_rc != 0 {
                tracing::warn!(code = free_rc, "ferry: freeBatchID after a failed submit");
            }
            return Err(call_error("submitTransfer", i64::from(rc)));
        }
        self.poller.in_use.fetch_add(1, Ordering::AcqRel);
        Ok(id)
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        {
            let mut peers = lock(&PEERS);
            if peers
                .get(&self.segment_name)
                .is_some_and(|(uid, _)| *uid == self.uid)
            {
                peers.remove(&self.segment_name);
            }
        }
        // The poller finishes the batches still in the library, then exits
        // and drops the Core, which destroys the C engine.
        lock(&self.poller.queue).stop = true;
        self.poller.wake.notify_all();
    }
}

/// Removes batch `id` from the engine's table when dropped (see
/// `batch_transfer`).
struct ForgetOnDrop<'a> {
    inner: &'a Inner,
    id: u64,
}

impl Drop for ForgetOnDrop<'_> {
    fn drop(&mut self) {
        lock(&self.inner.batches).remove(&self.id);
    }
}

/// Whether the build's transport reports a write completed when it is sent
/// (Mooncake's TCP transport before v0.3.12 has no acknowledgement, and no
/// address check at the target either).
fn sends_unacknowledged(lib: &MooncakeLibrary, config: &MooncakeConfig) -> bool {
    config.protocol == "tcp" && lib.generation() < Generation::V0_3_12
}

fn check_host(region: &MemoryRegion) -> Result<()> {
    if region.location().is_host() {
        Ok(())
    } else {
        Err(Error::InvalidArgument(format!(
            "the mooncake backend registers host memory only; {} is not (the C API does not \
             say whether the library was built with CUDA)",
            region.location()
        )))
    }
}

#[deny(clippy::missing_trait_methods)]
#[async_trait]
impl TransferEngine for MooncakeEngine {
    fn backend_name(&self) -> &str {
        BACKEND
    }

    fn segment_name(&self) -> &str {
        &self.inner.segment_name
    }

    fn capabilities(&self) -> Capabilities {
        self.native_caps()
    }

    fn backend_info(&self) -> BackendInfo {
        let lib = &self.inner.lib;
        let mut details = vec![("library".to_owned(), lib.path().display().to_string())];
        if lib.requested_path() != lib.path() {
            details.push((
                "library requested".to_owned(),
                lib.requested_path().display().to_string(),
            ));
        }
        details.extend([
            ("library source".to_owned(), lib.source().to_string()),
            ("generation".to_owned(), generation_detail(lib)),
            ("metadata".to_owned(), self.inner.config.metadata.clone()),
            ("protocol".to_owned(), self.inner.config.protocol.clone()),
            ("segment".to_owned(), self.inner.segment_name.clone()),
        ]);
        let (completion, validation) = self.guarantees();
        details.push(("completion".to_owned(), completion));
        details.push(("peer address validation".to_owned(), validation.to_owned()));
        if self.inner.config.protocol == "tcp" && lib.generation() == Generation::V0_3_6 {
            details.push((
                "bad peer addresses".to_owned(),
                "a TCP transfer to an unmapped address crashes the peer on Mooncake \
                 v0.3.6–v0.3.8 (its error log prints the address as a C string; fixed in \
                 v0.3.9; this build's symbols cannot tell which it is)"
                    .to_owned(),
            ));
        }
        let mut not_native = Vec::new();
        not_native.extend(self.inner.notify_gap.clone());
        not_native.extend(self.guarantees_missing());
        let mut emulated = Vec::new();
        if self.confirms_writes() {
            emulated.push((
                Operation::LandedWrites,
                "Ferry reads each write's last byte back until it shows".to_owned(),
            ));
        }
        BackendInfo {
            backend: BACKEND.into(),
            details,
            not_native,
            emulated,
        }
    }

    async fn register(&self, region: &MemoryRegion) -> Result<()> {
        check_host(region)?;
        self.inner.regions.insert(region.clone())?;
        let this = Arc::clone(&self.inner);
        let (addr, len) = (region.addr(), region.len());
        let loc = cstring("location", region.location().as_str())?;
        let rc = blocking(move || {
            // SAFETY: live engine; the caller promised (MemoryRegion) that the
            // range is valid while registered; `loc` outlives the call.
            unsafe {
                (this.lib.api.register)(
                    this.raw(),
                    addr as usize as *mut c_void,
                    len as usize,
                    loc.as_ptr(),
                    1,
                )
            }
        })
        .await;
        match rc {
            Ok(0) => Ok(()),
            other => {
                self.inner.regions.remove(addr).await?;
                Err(match other {
                    Ok(rc) => call_error("registerLocalMemory", i64::from(rc)),
                    Err(e) => e,
                })
            }
        }
    }

    async fn unregister(&self, addr: u64) -> Result<()> {
        self.inner.regions.remove(addr).await?;
        let this = Arc::clone(&self.inner);
        let rc = blocking(move || {
            // SAFETY: live engine; no transfer uses the region any more.
            unsafe { (this.lib.api.unregister)(this.raw(), addr as usize as *mut c_void) }
        })
        .await?;
        if rc != 0 {
            return Err(call_error("unregisterLocalMemory", i64::from(rc)));
        }
        Ok(())
    }

    async fn batch_register(&self, regions: &[MemoryRegion]) -> Result<()> {
        let fail = |index: usize, source: Error| Error::BatchRegisterFailed {
            index,
            addr: regions[index].addr(),
            source: Box::new(source),
        };
        for (i, r) in regions.iter().enumerate() {
            if let Err(e) = check_host(r) {
                return Err(fail(i, e));
            }
        }
        for (i, r) in regions.iter().enumerate() {
            if let Err(e) = self.inner.regions.insert(r.clone()) {
                for done in &regions[..i] {
                    let _ = self.inner.regions.remove(done.addr()).await;
                }
                return Err(fail(i, e));
            }
        }
        // One C call per location, in first-appearance order.
        let mut groups: Vec<(String, Vec<usize>)> = Vec::new();
        for (i, r) in regions.iter().enumerate() {
            let loc = r.location().as_str();
            match groups.iter_mut().find(|(l, _)| l == loc) {
                Some((_, v)) => v.push(i),
                None => groups.push((loc.to_owned(), vec![i])),
            }
        }
        let mut registered: Vec<usize> = Vec::new();
        for (loc, idx) in &groups {
            let this = Arc::clone(&self.inner);
            let mut entries: Vec<CBufferEntry> = idx
                .iter()
                .map(|&i| CBufferEntry {
                    addr: regions[i].addr() as usize as *mut c_void,
                    length: regions[i].len() as usize,
                })
                .collect();
            let loc_c = cstring("location", loc)?;
            let rc = blocking(move || {
                // SAFETY: live engine; every range is a region the caller
                // promised valid; `entries` and `loc_c` outlive the call.
                unsafe {
                    (this.lib.api.register_batch)(
                        this.raw(),
                        entries.as_mut_ptr(),
                        entries.len(),
                        loc_c.as_ptr(),
                    )
                }
            })
            .await;
            let err = match rc {
                Ok(0) => None,
                Ok(rc) => Some(call_error("registerLocalMemoryBatch", i64::from(rc))),
                Err(e) => Some(e),
            };
            if let Some(e) = err {
                // All or nothing: undo the groups already registered (and
                // this one, in case the library registered part of it).
                let undo: Vec<u64> = registered
                    .iter()
                    .chain(idx)
                    .map(|&i| regions[i].addr())
                    .collect();
                let this = Arc::clone(&self.inner);
                let _ = blocking(move || {
                    let mut ptrs: Vec<*mut c_void> =
                        undo.iter().map(|&a| a as usize as *mut c_void).collect();
                    // SAFETY: live engine; addresses of regions this call
                    // registered (unknown ones are reported, not touched).
                    unsafe {
                        (this.lib.api.unregister_batch)(this.raw(), ptrs.as_mut_ptr(), ptrs.len())
                    }
                })
                .await;
                for r in regions {
                    let _ = self.inner.regions.remove(r.addr()).await;
                }
                return Err(fail(idx[0], e));
            }
            registered.extend(idx);
        }
        Ok(())
    }

    async fn batch_unregister(&self, addrs: &[u64]) -> Result<()> {
        let mut first = None;
        let mut removed = Vec::new();
        for &a in addrs {
            match self.inner.regions.remove(a).await {
                Ok(_) => removed.push(a),
                Err(e) => {
                    first.get_or_insert(e);
                }
            }
        }
        if !removed.is_empty() {
            let this = Arc::clone(&self.inner);
            let rc = blocking(move || {
                let mut ptrs: Vec<*mut c_void> =
                    removed.iter().map(|&a| a as usize as *mut c_void).collect();
                // SAFETY: live engine; regions no transfer uses any more.
                unsafe {
                    (this.lib.api.unregister_batch)(this.raw(), ptrs.as_mut_ptr(), ptrs.len())
                }
            })
            .await?;
            if rc != 0 {
                first.get_or_insert(call_error("unregisterLocalMemoryBatch", i64::from(rc)));
            }
        }
        first.map_or(Ok(()), Err)
    }

    async fn open_segment(&self, name: &str) -> Result<SegmentId> {
        let peer = || lock(&PEERS).get(name).map(|(_, t)| t.clone());
        {
            let mut segs = lock(&self.inner.segments);
            if let Some((c_id, refs)) = segs.by_name.get_mut(name) {
                *refs += 1;
                let c_id = *c_id;
                return Ok(segs.add(name, c_id, peer()));
            }
        }
        let name_c = cstring("segment name", name)?;
        let this = Arc::clone(&self.inner);
        let c_id = blocking(move || {
            // SAFETY: live engine; the name outlives the call.
            unsafe { (this.lib.api.open_segment)(this.raw(), name_c.as_ptr()) }
        })
        .await?;
        if c_id < 0 {
            return Err(Error::SegmentUnavailable {
                name: name.to_owned(),
                reason: crate::codes::open_segment_failure(c_id, self.inner.lib.generation()),
            });
        }
        let mut segs = lock(&self.inner.segments);
        // Another open of the same name may have won the race; the library
        // returned the same cached segment to both.
        let entry = segs.by_name.entry(name.to_owned()).or_insert((c_id, 0));
        entry.1 += 1;
        let c_id = entry.0;
        Ok(segs.add(name, c_id, peer()))
    }

    async fn close_segment(&self, segment: SegmentId) -> Result<()> {
        let closing = lock(&self.inner.segments)
            .by_id
            .remove(&segment.0)
            .ok_or(Error::UnknownSegment(segment))?;
        // Transfers in flight on the handle hold its gate; wait for them.
        let _closed = closing.gate.write().await;
        let last = {
            let mut segs = lock(&self.inner.segments);
            match segs.by_name.get_mut(&closing.name) {
                Some((_, refs)) if *refs > 1 => {
                    *refs -= 1;
                    false
                }
                _ => {
                    segs.by_name.remove(&closing.name);
                    true
                }
            }
        };
        if !last {
            return Ok(());
        }
        let this = Arc::clone(&self.inner);
        let c_id = closing.c_id;
        // SAFETY: live engine; the id came from openSegment; no handle uses it.
        let rc =
            blocking(move || unsafe { (this.lib.api.close_segment)(this.raw(), c_id) }).await?;
        if rc != 0 {
            return Err(call_error("closeSegment", i64::from(rc)));
        }
        Ok(())
    }

    async fn transfer(&self, segment: SegmentId, request: TransferRequest) -> Result<()> {
        let report = self.batch_transfer(segment, &[request], None).await?;
        report.results.into_iter().next().unwrap_or(Ok(()))
    }

    async fn batch_transfer(
        &self,
        segment: SegmentId,
        requests: &[TransferRequest],
        notify: Option<&Notification>,
    ) -> Result<BatchReport> {
        let id = self.submit_batch(segment, requests, notify).await?;
        // Dropped before the wait ends, the caller can no longer name the
        // batch: forget it (the library batch stays with the poller, which
        // frees it and its memory when the library is done).
        let forget = ForgetOnDrop {
            inner: &self.inner,
            id,
        };
        let report = self.wait_batch(id).await;
        std::mem::forget(forget);
        report
    }

    async fn submit(
        &self,
        segment: SegmentId,
        requests: &[TransferRequest],
        notify: Option<&Notification>,
    ) -> Result<BatchId> {
        self.submit_batch(segment, requests, notify)
            .await
            .map(BatchId)
    }

    fn status(&self, batch: BatchId) -> Result<BatchStatus> {
        let batches = lock(&self.inner.batches);
        let p = batches.get(&batch.0).ok_or(Error::UnknownBatch(batch))?;
        Ok(BatchStatus {
            states: Self::states(p),
        })
    }

    async fn wait(&self, batch: BatchId) -> Result<BatchReport> {
        self.wait_batch(batch.0).await
    }

    async fn release_batch(&self, batch: BatchId) -> Result<()> {
        let mut batches = lock(&self.inner.batches);
        let p = batches.get(&batch.0).ok_or(Error::UnknownBatch(batch))?;
        if !Self::finished(p) {
            return Err(Error::BatchBusy(batch));
        }
        // Past its deadline, the library batch stays with the poller.
        batches.remove(&batch.0);
        Ok(())
    }

    fn live_batches(&self) -> Option<usize> {
        Some(MooncakeEngine::live_batches(self))
    }

    async fn take_notifications(&self) -> Result<Vec<Notification>> {
        let lib = &self.inner.lib;
        let get = match (self.has_notify(), lib.api.get_notifs) {
            (true, Some(g)) => g,
            _ => return Err(self.refuse_notify()),
        };
        let free_notifs = lib.api.free_notifs;
        let this = Arc::clone(&self.inner);
        blocking(move || {
            let mut size: c_int = 0;
            // SAFETY: live engine; `size` is writable.
            let arr = unsafe { get(this.raw(), &mut size) };
            let n = usize::try_from(size).unwrap_or(0);
            if arr.is_null() || n == 0 {
                return Vec::new();
            }
            let mut out = Vec::with_capacity(n);
            for i in 0..n {
                // SAFETY: the library returned an array of `size` entries.
                let m = unsafe { *arr.add(i) };
                let text = |p: *mut c_char| {
                    if p.is_null() {
                        String::new()
                    } else {
                        // SAFETY: NUL-terminated strings owned by the array.
                        unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
                    }
                };
                let n = Notification::new(text(m.name), text(m.msg));
                if n.name != this.probe_name {
                    out.push(n);
                }
            }
            match free_notifs {
                // SAFETY: the array and size the library returned, freed once.
                Some(f) => unsafe {
                    f(arr, size);
                },
                // Only v0.3.5 lacks freeNotifsMsgBuf, and notifications are
                // refused there (see `notify_gap`): its strings are not ours.
                // SAFETY: the array was allocated with malloc, freed once.
                None => unsafe { free(arr.cast()) },
            }
            out
        })
        .await
    }
}

/// Why notifications do not work with this build and transport (`None`:
/// they do). Mooncake v0.3.5's `getNotifsFromEngine` returns names and
/// messages in strings it has already freed; TCP engines of v0.3.5–v0.3.7
/// never install the handler that receives notifications (only the RDMA
/// transport did, until v0.3.8), so the peer rejects them. v0.3.6 and v0.3.8
/// export the same symbols, so on that generation with TCP the engine sends
/// one notification to itself at start-up to find out.
async fn notify_gap(
    lib: &MooncakeLibrary,
    config: &MooncakeConfig,
    core: &Arc<Core>,
    segment_name: &str,
    probe_name: &str,
) -> Option<MissingCapability> {
    let tcp = config.protocol == "tcp";
    let gap = |reason: String, version: &str| {
        Some(MissingCapability {
            operation: Operation::Notify,
            reason,
            min_version: Some(format!("Mooncake {version}")),
        })
    };
    if !lib.has_notify() {
        return gap(
            format!(
                "{} ({}) has no submitTransferWithNotify/getNotifsFromEngine/genNotifyInEngine",
                lib.path().display(),
                lib.generation()
            ),
            if tcp { "v0.3.8" } else { "v0.3.6" },
        );
    }
    match lib.generation() {
        Generation::V0_3_5 => gap(
            format!(
                "{} (v0.3.5) returns notification names and messages in strings it has \
                 already freed{}",
                lib.path().display(),
                if tcp {
                    ", and its TCP engines reject incoming notifications"
                } else {
                    ""
                }
            ),
            if tcp { "v0.3.8" } else { "v0.3.6" },
        ),
        Generation::V0_3_6 if tcp => {
            let gen = lib.api.gen_notify?;
            let (open, close) = (lib.api.open_segment, lib.api.close_segment);
            let engine = RawEngine(core.raw.0);
            let seg = CString::new(segment_name).ok()?;
            let name = CString::new(probe_name).ok()?;
            let probed = blocking(move || {
                let e = engine;
                // SAFETY: live engine (the caller holds the Core); the
                // strings outlive the calls.
                let id = unsafe { open(e.0, seg.as_ptr()) };
                if id < 0 {
                    return Err(format!("openSegment of its own segment returned {id}"));
                }
                let msg = CNotifyMsg {
                    name: name.as_ptr() as *mut c_char,
                    msg: c"".as_ptr() as *mut c_char,
                };
                // SAFETY: live engine and segment; Mooncake copies the strings.
                let rc = unsafe { gen(e.0, id as u64, msg) };
                // SAFETY: the segment opened above, closed once.
                unsafe { close(e.0, id) };
                if rc == 0 {
                    Ok(())
                } else {
                    Err(format!(
                        "a notification this engine sent to itself was rejected ({})",
                        crate::codes::code_name(i64::from(rc))
                    ))
                }
            })
            .await;
            match probed {
                Ok(Ok(())) => None,
                Ok(Err(why)) | Err(Error::Canceled(why)) => gap(
                    format!(
                        "{} ({}, v0.3.6–v0.3.10 by its symbols) is a build whose TCP engines \
                         reject incoming notifications (v0.3.6 and v0.3.7): {why}",
                        lib.path().display(),
                        lib.generation()
                    ),
                    "v0.3.8",
                ),
                Err(e) => gap(format!("probing notifications failed: {e}"), "v0.3.8"),
            }
        }
        _ => None,
    }
}

fn generation_detail(lib: &MooncakeLibrary) -> String {
    let g = lib.generation();
    let note = match g {
        Generation::V0_2_0 => {
            "no getLocalIpAndPort; createTransferEngine may take 4 or 5 arguments"
        }
        Generation::V0_3_0 => "getLocalIpAndPort present; no notification symbols",
        Generation::V0_3_5 => "submitTransferWithNotify present; no freeNotifsMsgBuf",
        Generation::V0_3_6 => "freeNotifsMsgBuf present; no discoverTopology",
        Generation::V0_3_11 => "discoverTopology present; no getNicLoadStats",
        Generation::V0_3_12 => "getNicLoadStats present",
    };
    format!("Mooncake {} or later ({note})", g.version())
}

#[cfg(test)]
mod tests {
    use super::device_matrix;

    #[test]
    fn device_filter_becomes_a_nic_priority_matrix() {
        assert_eq!(
            device_matrix("mlx5_0, mlx5_1"),
            r#"{"cpu:0": [["mlx5_0", "mlx5_1"], []]}"#
        );
        let json = r#"{"cuda:0": [["mlx5_2"], ["mlx5_0"]]}"#;
        assert_eq!(device_matrix(json), json);
    }
}

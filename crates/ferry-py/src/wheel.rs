//! `mooncake-py://`: a backend whose bytes move through the installed
//! Mooncake wheel (`mooncake.engine.TransferEngine`, pybind11).
//!
//! The wheel's own engine does the transport and speaks Mooncake's wire
//! protocol, so a node on this backend interoperates with plain Mooncake
//! nodes of the same version. This module only calls the wheel's Python
//! methods (through pyo3, from the runtime's blocking pool, taking the GIL
//! for each call) and declares which of them the installed wheel has as
//! [`Capabilities`]; the [`ferry::CapabilityAdapter`] that wraps it adds
//! the rest (batch register with rollback from single registers, batches
//! from concurrent single transfers, async batches from tasks) exactly as
//! for every other backend, so strict mode, `require=` and the capability
//! report work unchanged.
//!
//! What Ferry checks itself, before the wheel sees a request: the local
//! range of every transfer lies in a region registered through this engine
//! (and that region stays registered until the transfer returns). What it
//! cannot check: the peer's ranges, which the wheel's Python API does not
//! expose; the `peer_validation` guarantee says whether the wheel's
//! transport refuses them itself.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use ferry::{
    BackendInfo, BatchReport, Capabilities, Error, MemoryKinds, MemoryRegion, MissingCapability,
    Notification, Operation, Result, SegmentId, TransferEngine, TransferOp, TransferRequest,
};
use ferry_core::raw::{ParsedUrl, RegionTable};
use ferry_core::Side;
use pyo3::prelude::*;

/// The backend's name in reports and errors.
pub(crate) const BACKEND: &str = "mooncake-py";

/// Transport names Mooncake's `initialize` accepts (its `protocol`).
pub(crate) const KNOWN_PROTOCOLS: [&str; 11] = [
    "tcp",
    "rdma",
    "nvmeof",
    "nvlink",
    "nvlink_intra",
    "hip",
    "cxl",
    "efa",
    "ascend",
    "barex",
    "ubshmem",
];

/// How often `initialize` is tried when the wheel's port collides.
const BIND_ATTEMPTS: u32 = 4;
/// The wheel's message for that collision.
const BIND_COLLISION: &str = "Address already in use";

/// Where Linux lists RDMA devices.
const RDMA_DEVICES: &str = "/sys/class/infiniband";

/// The installed distributions that provide `mooncake.engine`, in the order
/// they are looked up for the version.
const DISTRIBUTIONS: [&str; 3] = [
    "mooncake-transfer-engine",
    "mooncake-transfer-engine-non-cuda",
    "mooncake-transfer-engine-cuda13",
];

/// `mooncake-py://?host=…&metadata=…&protocol=…&device=…&metadata_type=…`
/// (Ferry's own parameters, `strict=` and the others, are taken by
/// Ferry's scheme registry before these).
#[derive(Debug, Clone, Default)]
pub(crate) struct WheelConfig {
    /// `local_hostname` as given to `initialize` (`host` or `host:port`).
    pub host: String,
    /// `metadata_server` (`P2PHANDSHAKE`, `etcd://…`, `http://…`, …).
    pub metadata: String,
    /// The transport the wheel is asked for (after `MC_FORCE_TCP`).
    pub protocol: String,
    /// The protocol the caller asked for, when `MC_FORCE_TCP` replaced it.
    pub forced_from: Option<String>,
    /// RDMA device names (comma-separated, Mooncake's `device_name`).
    pub device: String,
    /// Mooncake's explicit metadata type (`initialize_ext`), or empty.
    pub metadata_type: String,
}

fn bad(m: String) -> Error {
    Error::InvalidArgument(m)
}

impl WheelConfig {
    /// Parses a `mooncake-py://` URL. `force_tcp` is whether `MC_FORCE_TCP`
    /// is set (Mooncake: set to any value, the TCP transport only).
    ///
    /// Errors ([`Error::InvalidArgument`]): another scheme, an unknown
    /// parameter (named, with the known ones), a repeated one, a malformed
    /// percent-escape, a path, an unknown protocol, a device that does not
    /// exist.
    #[cfg(test)]
    pub(crate) fn from_url(url: &str, force_tcp: bool) -> Result<WheelConfig> {
        // The one parser of Ferry's URLs (strict percent-decoding, `+` a
        // space, a key given twice refused; messages quote the URL
        // redacted).
        let mut u = ParsedUrl::parse(url)?;
        if u.scheme() != "mooncake-py" {
            return Err(bad(format!("{:?} is not a mooncake-py:// URL", u.shown())));
        }
        // Ferry's own parameters are the registry's (ferry::registry).
        ferry::AdapterConfig::take_url_params(&mut u)?;
        WheelConfig::from_parts(u, force_tcp)
    }

    /// [`WheelConfig::from_url`] on a URL already parsed, with Ferry's own
    /// parameters taken out (what the scheme registry hands the
    /// `mooncake-py` constructor): takes the wheel's parameters and refuses
    /// what is left.
    pub(crate) fn from_parts(mut u: ParsedUrl, force_tcp: bool) -> Result<WheelConfig> {
        let mut c = WheelConfig {
            host: u.authority().to_owned(),
            metadata: "P2PHANDSHAKE".to_owned(),
            protocol: "tcp".to_owned(),
            ..WheelConfig::default()
        };
        for (key, field) in [
            ("host", &mut c.host),
            ("metadata", &mut c.metadata),
            ("protocol", &mut c.protocol),
            ("device", &mut c.device),
            ("metadata_type", &mut c.metadata_type),
        ] {
            if let Some(v) = u.take_str(key)? {
                *field = v;
            }
        }
        u.finish()?;
        if c.host.is_empty() {
            c.host = "127.0.0.1".to_owned();
        }
        if c.metadata.is_empty() {
            c.metadata = "P2PHANDSHAKE".to_owned();
        }
        if c.protocol.is_empty() {
            c.protocol = "tcp".to_owned();
        }
        if !KNOWN_PROTOCOLS.contains(&c.protocol.as_str()) {
            return Err(bad(format!(
                "unknown Mooncake protocol {:?} (known: {})",
                c.protocol,
                KNOWN_PROTOCOLS.join(", ")
            )));
        }
        if force_tcp && c.protocol != "tcp" {
            c.forced_from = Some(std::mem::replace(&mut c.protocol, "tcp".to_owned()));
        }
        if c.protocol == "rdma" {
            check_rdma_devices(&c.device, std::path::Path::new(RDMA_DEVICES))?;
        }
        Ok(c)
    }
}

/// For `protocol="rdma"`: every named device (comma-separated) must exist
/// under `dir`, and with no name at least one device must.
pub(crate) fn check_rdma_devices(device: &str, dir: &std::path::Path) -> Result<()> {
    let present: Vec<String> = std::fs::read_dir(dir)
        .map(|d| {
            d.filter_map(|e| e.ok().map(|e| e.file_name().to_string_lossy().into_owned()))
                .collect()
        })
        .unwrap_or_default();
    let wanted: Vec<&str> = device
        .split(',')
        .map(str::trim)
        .filter(|d| !d.is_empty())
        .collect();
    if wanted.is_empty() && present.is_empty() {
        return Err(Error::Unavailable {
            backend: BACKEND.to_owned(),
            reason: format!(
                "protocol \"rdma\" needs an RDMA device and {} lists none",
                dir.display()
            ),
        });
    }
    for d in wanted {
        if !present.iter().any(|p| p == d) {
            return Err(bad(format!(
                "RDMA device {d:?} does not exist (present in {}: {})",
                dir.display(),
                if present.is_empty() {
                    "none".to_owned()
                } else {
                    present.join(", ")
                }
            )));
        }
    }
    Ok(())
}

/// Which optional methods the installed wheel's class has.
#[derive(Clone, Copy, Debug, Default)]
struct Methods {
    batch_register: bool,
    batch_unregister: bool,
    batch_write: bool,
    batch_read: bool,
    /// `register_memory` takes a `location` (0.3.13 does, 0.3.3 does not).
    register_location: bool,
}

/// A started engine of the wheel, wrapped for [`TransferEngine`].
pub(crate) struct WheelEngine {
    inner: Arc<Inner>,
}

struct Inner {
    /// The wheel's `TransferEngine` object.
    wheel: Py<PyAny>,
    segment_name: String,
    methods: Methods,
    version: Option<String>,
    distribution: Option<String>,
    module_file: Option<String>,
    config: WheelConfig,
    cuda: bool,
    peer_validation: bool,
    landed_writes: bool,
    /// Regions registered through this engine: local ranges are checked
    /// against it, and `unregister` waits for the transfers that use them.
    regions: RegionTable,
    segments: Mutex<HashMap<u64, String>>,
    next_segment: AtomicU64,
}

/// `(major, minor, patch)` of a version such as `0.3.13.post1`.
fn version_tuple(v: &str) -> Option<(u32, u32, u32)> {
    let mut it = v.split(['.', '+', '-']).map(|p| {
        let digits: String = p.chars().take_while(|c| c.is_ascii_digit()).collect();
        digits.parse::<u32>().ok()
    });
    Some((it.next()??, it.next()??, it.next().flatten().unwrap_or(0)))
}

/// Whether the wheel's transport refuses a peer's request outside the
/// memory the target registered: verified for `mooncake-transfer-engine
/// -non-cuda` 0.3.13.post1 over tcp (the target answers "not within any
/// registered buffer" and the initiator's call fails); 0.3.3 over tcp
/// writes outside. Not claimed for anything not verified.
fn wheel_validates_peers(version: Option<&str>, protocol: &str) -> bool {
    protocol == "tcp"
        && version
            .and_then(version_tuple)
            .is_some_and(|v| v >= (0, 3, 13))
}

/// Whether a write the wheel reports done has landed in the peer's memory:
/// 0.3.13's tcp target answers every write with a status (it refuses
/// out-of-range ones that way); 0.3.3's `transfer_sync_write` has returned
/// `0` with the bytes not yet in the target's memory (seen in this crate's
/// tests, about one run in ten).
fn wheel_lands_writes(version: Option<&str>, protocol: &str) -> bool {
    wheel_validates_peers(version, protocol)
}

fn py_failure(operation: &str, e: &PyErr) -> Error {
    Error::Backend {
        backend: BACKEND.to_owned(),
        operation: operation.to_owned(),
        code: -1,
        name: format!("Python exception: {e}"),
    }
}

/// From interpreter exit on ([`crate::runtime::exiting`]) the wheel is not
/// called: a thread that asks for the GIL then never gets it back, and the
/// caller (the main thread dropping an engine) would wait for it for ever.
/// Nothing of Ferry's is released instead: a region stays registered in the
/// wheel and in Ferry's table, its memory kept, until the process ends (as
/// the plain wheel leaves it).
fn refuse_at_exit(operation: &str) -> Result<()> {
    if crate::runtime::exiting() {
        return Err(Error::Unavailable {
            backend: BACKEND.to_owned(),
            reason: format!(
                "the Python interpreter is exiting: {operation} is not called on the Mooncake \
                 wheel any more (what is registered stays so until the process ends)"
            ),
        });
    }
    Ok(())
}

fn returned(operation: &str, code: i64) -> Error {
    Error::Backend {
        backend: BACKEND.to_owned(),
        operation: operation.to_owned(),
        code,
        name: "non-zero return of the Mooncake wheel (its log says why)".to_owned(),
    }
}

/// The wheel's class: `mooncake.engine.TransferEngine`, or the one the
/// shim saved when `ferry.mooncake.install()` replaced it with Ferry's.
fn wheel_class<'py>(py: Python<'py>) -> Result<Bound<'py, PyAny>> {
    let unavailable = |reason: String| Error::Unavailable {
        backend: BACKEND.to_owned(),
        reason,
    };
    let module = py
        .import("mooncake.engine")
        .map_err(|e| unavailable(format!("cannot import mooncake.engine: {e}")))?;
    let class = module
        .getattr("TransferEngine")
        .map_err(|e| unavailable(format!("mooncake.engine has no TransferEngine: {e}")))?;
    match class.getattr("_ferry_wheel_class") {
        Ok(original) if !original.is_none() => Ok(original),
        _ => Ok(class),
    }
}

/// The version of the installed distribution that provides the wheel.
fn wheel_version(py: Python<'_>) -> (Option<String>, Option<String>) {
    let Ok(metadata) = py.import("importlib.metadata") else {
        return (None, None);
    };
    for dist in DISTRIBUTIONS {
        if let Ok(v) = metadata
            .call_method1("version", (dist,))
            .and_then(|v| v.extract::<String>())
        {
            return (Some(dist.to_owned()), Some(v));
        }
    }
    (None, None)
}

impl WheelEngine {
    /// Creates the wheel's engine and initializes it as `config` says
    /// (called with the GIL held; the wheel's `initialize` needs it).
    ///
    /// Errors: [`Error::Unavailable`] when `mooncake.engine` cannot be
    /// imported; [`Error::Backend`] when the wheel's `initialize` fails.
    pub(crate) fn start(py: Python<'_>, config: WheelConfig) -> Result<WheelEngine> {
        let class = wheel_class(py)?;
        let has = |name: &str| class.hasattr(name).unwrap_or(false);
        let register_doc: String = class
            .getattr("register_memory")
            .and_then(|m| m.getattr("__doc__"))
            .and_then(|d| d.extract())
            .unwrap_or_default();
        let methods = Methods {
            batch_register: has("batch_register_memory"),
            batch_unregister: has("batch_unregister_memory"),
            batch_write: has("batch_transfer_sync_write"),
            batch_read: has("batch_transfer_sync_read"),
            register_location: register_doc.contains("location"),
        };
        let module = py.import("mooncake.engine").ok();
        let cuda = module
            .as_ref()
            .and_then(|m| m.getattr("SUPPORT_CUDA").ok())
            .and_then(|v| v.is_truthy().ok())
            .unwrap_or(false);
        let module_file = module
            .as_ref()
            .and_then(|m| m.getattr("__file__").ok())
            .and_then(|f| f.extract::<String>().ok());
        let (distribution, version) = wheel_version(py);
        // 0.3.3's TCP transport binds a randomly chosen port and raises
        // "bind: Address already in use" when it collides: a fresh engine
        // picks another, so that one error is tried again (bounded).
        let mut attempt = 0;
        let (wheel, rc) = loop {
            attempt += 1;
            let wheel = class
                .call0()
                .map_err(|e| py_failure("TransferEngine()", &e))?;
            let out: PyResult<i64> = if config.metadata_type.is_empty() {
                wheel.call_method1(
                    "initialize",
                    (
                        &config.host,
                        &config.metadata,
                        &config.protocol,
                        &config.device,
                    ),
                )
            } else {
                wheel.call_method1(
                    "initialize_ext",
                    (
                        &config.host,
                        &config.metadata,
                        &config.protocol,
                        &config.device,
                        &config.metadata_type,
                    ),
                )
            }
            .and_then(|r| r.extract());
            match out {
                Ok(rc) => break (wheel, rc),
                Err(e) if attempt < BIND_ATTEMPTS && e.to_string().contains(BIND_COLLISION) => {
                    continue
                }
                Err(e) => return Err(py_failure("initialize", &e)),
            }
        };
        if rc != 0 {
            return Err(returned("initialize", rc));
        }
        let (host, _) = split_port(&config.host);
        let segment_name = if config.metadata == "P2PHANDSHAKE" {
            let port: i64 = wheel
                .call_method0("get_rpc_port")
                .and_then(|r| r.extract())
                .map_err(|e| py_failure("get_rpc_port", &e))?;
            format!("{host}:{port}")
        } else {
            config.host.clone()
        };
        let peer_validation = wheel_validates_peers(version.as_deref(), &config.protocol);
        let landed_writes = wheel_lands_writes(version.as_deref(), &config.protocol);
        Ok(WheelEngine {
            inner: Arc::new(Inner {
                wheel: wheel.unbind(),
                segment_name,
                methods,
                version,
                distribution,
                module_file,
                config,
                cuda,
                peer_validation,
                landed_writes,
                regions: RegionTable::new(),
                segments: Mutex::new(HashMap::new()),
                next_segment: AtomicU64::new(1),
            }),
        })
    }

    /// The wheel's own engine object (for `get_engine()`).
    pub(crate) fn wheel(&self, py: Python<'_>) -> Py<PyAny> {
        self.inner.wheel.clone_ref(py)
    }
}

/// `host:port` → `host`; `[v6]:port` → `[v6]`; anything else unchanged.
fn split_port(s: &str) -> (&str, Option<&str>) {
    if s.starts_with('[') {
        return match s.rsplit_once("]:") {
            Some((h, p)) => (&s[..h.len() + 1], Some(p)),
            None => (s, None),
        };
    }
    match s.split_once(':') {
        Some((h, p)) if !p.contains(':') => (h, Some(p)),
        _ => (s, None),
    }
}

/// The wheel's `ERR_ADDRESS_NOT_REGISTERED`.
const ADDRESS_NOT_REGISTERED: i64 = -3;

impl Inner {
    /// Runs `f` with the GIL on the runtime's blocking pool and returns what
    /// the wheel's method returned (`0` is success).
    async fn call<F>(self: &Arc<Self>, operation: &'static str, f: F) -> Result<i64>
    where
        F: for<'py> FnOnce(Python<'py>, &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>>
            + Send
            + 'static,
    {
        refuse_at_exit(operation)?;
        let this = Arc::clone(self);
        tokio::task::spawn_blocking(move || {
            Python::attach(|py| {
                let wheel = this.wheel.bind(py);
                f(py, wheel)
                    .and_then(|r| r.extract::<i64>())
                    .map_err(|e| py_failure(operation, &e))
            })
        })
        .await
        .map_err(|e| Error::Canceled(format!("{operation} on the Mooncake wheel: {e}")))?
    }

    async fn call_ok<F>(self: &Arc<Self>, operation: &'static str, f: F) -> Result<()>
    where
        F: for<'py> FnOnce(Python<'py>, &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>>
            + Send
            + 'static,
    {
        match self.call(operation, f).await? {
            0 => Ok(()),
            rc => Err(returned(operation, rc)),
        }
    }

    fn peer(&self, segment: SegmentId) -> Result<String> {
        ferry::__private::sync::lock(&self.segments)
            .get(&segment.0)
            .cloned()
            .ok_or(Error::UnknownSegment(segment))
    }

    fn check_kind(&self, region: &MemoryRegion) -> Result<()> {
        if region.location().is_cuda() && !self.cuda {
            return Err(bad(format!(
                "the installed Mooncake wheel ({}) was built without CUDA and cannot register \
                 {} memory; GPU memory needs a CUDA build of the wheel (mooncake-transfer-engine, \
                 whose mooncake.engine.SUPPORT_CUDA is true) or Ferry's mooncake:// backend over \
                 a CUDA libtransfer_engine.so",
                self.describe(),
                region.location()
            )));
        }
        Ok(())
    }

    fn describe(&self) -> String {
        match (&self.distribution, &self.version) {
            (Some(d), Some(v)) => format!("{d} {v}"),
            _ => "version unknown".to_owned(),
        }
    }

    async fn register(self: Arc<Self>, region: MemoryRegion) -> Result<()> {
        self.check_kind(&region)?;
        let (addr, len) = (region.addr(), region.len());
        let location = region.location().as_str().to_owned();
        self.regions.insert(region)?;
        let with_location = self.methods.register_location;
        let out = self
            .call_ok("register_memory", move |_, w| {
                if with_location {
                    w.call_method1("register_memory", (addr, len, location))
                } else {
                    w.call_method1("register_memory", (addr, len))
                }
            })
            .await;
        if out.is_err() {
            let _ = self.regions.remove(addr).await;
        }
        out
    }

    /// Waits for the local transfers using the region, then takes it out
    /// of the wheel and only then out of Ferry's table: if the wheel
    /// refuses, the region stays registered in both (the caller keeps its
    /// memory; a later `unregister` tries again) and the error is the
    /// wheel's ([`Error::Backend`]), never `RegionNotRegistered`. At
    /// interpreter exit nothing is waited for (see [`refuse_at_exit`]).
    async fn unregister(self: Arc<Self>, addr: u64) -> Result<()> {
        refuse_at_exit("unregister_memory")?;
        let removal = self.regions.remove_in_steps(addr).await?;
        self.call_ok("unregister_memory", move |_, w| {
            w.call_method1("unregister_memory", (addr,))
        })
        .await?;
        // Dropped unfinished above (`?`): reopened, still registered.
        removal.finish();
        Ok(())
    }

    async fn batch_register(self: Arc<Self>, regions: Vec<MemoryRegion>) -> Result<()> {
        for (index, r) in regions.iter().enumerate() {
            self.check_kind(r).map_err(|e| Error::BatchRegisterFailed {
                index,
                addr: r.addr(),
                source: Box::new(e),
            })?;
        }
        let addrs: Vec<u64> = regions.iter().map(|r| r.addr()).collect();
        let lens: Vec<u64> = regions.iter().map(|r| r.len()).collect();
        let first = regions
            .first()
            .map(|r| r.location().as_str().to_owned())
            .unwrap_or_else(|| "*".to_owned());
        let location = if regions.iter().all(|r| r.location().as_str() == first) {
            first
        } else {
            "*".to_owned()
        };
        self.regions.insert_all(regions)?;
        let call_addrs = addrs.clone();
        let out = self
            .call_ok("batch_register_memory", move |_, w| {
                w.call_method1("batch_register_memory", (call_addrs, lens, location))
            })
            .await;
        if let Err(e) = out {
            // All or nothing: the wheel does not say which region failed,
            // nor whether it kept the others; take every one back, out of
            // the wheel first, then out of the table. An address the wheel
            // answers 0 (released) or ERR_ADDRESS_NOT_REGISTERED (never
            // kept) leaves the table; any other answer may mean the wheel
            // still has it: it stays in the table (a later `unregister`
            // retries) and the error says so (`RegionHeld`, leak on doubt).
            let mut kept = None;
            for &addr in &addrs {
                let removal = self.regions.remove_in_steps(addr).await;
                let undo = self
                    .call("unregister_memory", move |_, w| {
                        w.call_method1("unregister_memory", (addr,))
                    })
                    .await;
                match (removal, undo) {
                    (Ok(r), Ok(0 | ADDRESS_NOT_REGISTERED)) => r.finish(),
                    (_, undo) => {
                        kept.get_or_insert((addr, undo));
                    }
                }
            }
            if let Some((addr, undo)) = kept {
                let answer = match undo {
                    Ok(rc) => format!("answered {rc}"),
                    Err(e) => format!("failed: {e}"),
                };
                return Err(Error::BatchRegisterFailed {
                    index: 0,
                    addr,
                    source: Box::new(Error::RegionHeld {
                        addr,
                        reason: format!(
                            "batch_register_memory failed ({e}), and the wheel's unregister_memory \
                             of the region it may have kept {answer}: it stays registered; \
                             unregister it before freeing the memory"
                        ),
                    }),
                });
            }
            return Err(Error::BatchRegisterFailed {
                index: 0,
                addr: addrs.first().copied().unwrap_or(0),
                source: Box::new(Error::Backend {
                    backend: BACKEND.to_owned(),
                    operation: "batch_register_memory".to_owned(),
                    code: match &e {
                        Error::Backend { code, .. } => *code,
                        _ => -1,
                    },
                    name: format!(
                        "{e}; the wheel does not say which region failed (index 0 stands for \
                         the batch); none stays registered"
                    ),
                }),
            });
        }
        Ok(())
    }

    /// Every region it can (waiting for the local transfers using each),
    /// out of the wheel in one call and only then out of Ferry's table;
    /// the first error. If the wheel's call fails, every region of it stays
    /// registered in Ferry's table (the wheel does not say which it let go
    /// of: kept on doubt).
    async fn batch_unregister(self: Arc<Self>, addrs: Vec<u64>) -> Result<()> {
        refuse_at_exit("batch_unregister_memory")?;
        let mut first_err = None;
        let mut removals = Vec::with_capacity(addrs.len());
        for &addr in &addrs {
            match self.regions.remove_in_steps(addr).await {
                Ok(r) => removals.push((addr, r)),
                Err(e) => {
                    first_err.get_or_insert(e);
                }
            }
        }
        if !removals.is_empty() {
            let removed: Vec<u64> = removals.iter().map(|(a, _)| *a).collect();
            match self
                .call_ok("batch_unregister_memory", move |_, w| {
                    w.call_method1("batch_unregister_memory", (removed,))
                })
                .await
            {
                Ok(()) => removals.into_iter().for_each(|(_, r)| r.finish()),
                // `removals` dropped unfinished: reopened.
                Err(e) => {
                    first_err.get_or_insert(e);
                }
            }
        }
        first_err.map_or(Ok(()), Err)
    }

    async fn transfer(self: Arc<Self>, segment: SegmentId, req: TransferRequest) -> Result<()> {
        let peer = self.peer(segment)?;
        if req.len == 0 {
            return Ok(());
        }
        let guard = self
            .regions
            .acquire(req.local_addr, req.len, Side::Local, Some(&peer))?;
        let method = match req.op {
            TransferOp::Write => "transfer_sync_write",
            TransferOp::Read => "transfer_sync_read",
        };
        let name = peer.clone();
        let rc = self
            .call(method, move |_, w| {
                w.call_method1(method, (name, req.local_addr, req.remote_addr, req.len))
            })
            .await?;
        drop(guard);
        if rc == 0 {
            Ok(())
        } else {
            Err(self.transfer_failed(&peer, method, rc, false))
        }
    }

    fn transfer_failed(&self, peer: &str, method: &str, rc: i64, batch: bool) -> Error {
        let mut detail = format!(
            "the wheel's {method} returned {rc} (its log says why: peer unreachable, an address \
             outside the peer's registered memory, …)"
        );
        if batch {
            detail.push_str("; it reports the batch as a whole, not which request failed");
        }
        Error::TransferFailed {
            backend: BACKEND.to_owned(),
            peer: peer.to_owned(),
            status: format!("returned {rc}"),
            detail,
        }
    }

    async fn batch_transfer(
        self: Arc<Self>,
        segment: SegmentId,
        requests: Vec<TransferRequest>,
    ) -> Result<BatchReport> {
        let peer = self.peer(segment)?;
        let mut results: Vec<Result<()>> = vec![Ok(()); requests.len()];
        let mut guards = Vec::with_capacity(requests.len());
        let mut groups: [(TransferOp, Vec<usize>); 2] = [
            (TransferOp::Write, Vec::new()),
            (TransferOp::Read, Vec::new()),
        ];
        for (i, r) in requests.iter().enumerate() {
            if r.len == 0 {
                continue;
            }
            match self
                .regions
                .acquire(r.local_addr, r.len, Side::Local, Some(&peer))
            {
                Ok(g) => {
                    guards.push(g);
                    let g = if r.op == TransferOp::Write { 0 } else { 1 };
                    groups[g].1.push(i);
                }
                Err(e) => results[i] = Err(e),
            }
        }
        for (op, idx) in groups {
            if idx.is_empty() {
                continue;
            }
            let method = match op {
                TransferOp::Write => "batch_transfer_sync_write",
                TransferOp::Read => "batch_transfer_sync_read",
            };
            let local: Vec<u64> = idx.iter().map(|&i| requests[i].local_addr).collect();
            let remote: Vec<u64> = idx.iter().map(|&i| requests[i].remote_addr).collect();
            let lens: Vec<u64> = idx.iter().map(|&i| requests[i].len).collect();
            let name = peer.clone();
            let out = self
                .call(method, move |_, w| {
                    w.call_method1(method, (name, local, remote, lens))
                })
                .await;
            let failure = match out {
                Ok(0) => None,
                Ok(rc) => Some(self.transfer_failed(&peer, method, rc, true)),
                Err(e) => Some(e),
            };
            if let Some(e) = failure {
                for &i in &idx {
                    results[i] = Err(e.clone());
                }
            }
        }
        drop(guards);
        Ok(BatchReport { results })
    }
}

#[deny(clippy::missing_trait_methods)]
impl TransferEngine for WheelEngine {
    fn backend_name(&self) -> &str {
        BACKEND
    }

    fn segment_name(&self) -> &str {
        &self.inner.segment_name
    }

    fn capabilities(&self) -> Capabilities {
        let m = self.inner.methods;
        {
            let mut caps = Capabilities::default();
            caps.batch_register = m.batch_register;
            caps.batch_unregister = m.batch_unregister;
            caps.batch_transfer = m.batch_write && m.batch_read;
            caps.memory = MemoryKinds {
                host: true,
                cuda: self.inner.cuda,
            };
            caps.peer_validation = self.inner.peer_validation;
            caps.landed_writes = self.inner.landed_writes;
            caps
        }
    }

    fn backend_info(&self) -> BackendInfo {
        let i = &self.inner;
        let wheel = i.describe();
        let mut details = vec![
            ("wheel".to_owned(), wheel.clone()),
            ("protocol".to_owned(), i.config.protocol.clone()),
            ("metadata".to_owned(), i.config.metadata.clone()),
        ];
        if let Some(f) = &i.module_file {
            details.push(("module".to_owned(), f.clone()));
        }
        if let Some(from) = &i.config.forced_from {
            details.push((
                "MC_FORCE_TCP".to_owned(),
                format!("set: protocol {from:?} replaced by \"tcp\""),
            ));
        }
        let newer = Some("mooncake-transfer-engine 0.3.13.post1 (verified)".to_owned());
        let lacks = |op: Operation, method: &str| MissingCapability {
            operation: op,
            reason: format!("the installed Mooncake wheel ({wheel}) has no {method}"),
            min_version: newer.clone(),
        };
        let mut not_native = Vec::new();
        if !i.methods.batch_register {
            not_native.push(lacks(Operation::BatchRegister, "batch_register_memory"));
        }
        if !i.methods.batch_unregister {
            not_native.push(lacks(Operation::BatchUnregister, "batch_unregister_memory"));
        }
        if !(i.methods.batch_write && i.methods.batch_read) {
            not_native.push(lacks(
                Operation::BatchTransfer,
                "batch_transfer_sync_write/batch_transfer_sync_read",
            ));
        }
        for op in [Operation::AsyncBatch, Operation::BatchWait] {
            not_native.push(MissingCapability {
                operation: op,
                reason: "the wheel's Python API reports no per-request state of an async batch"
                    .to_owned(),
                min_version: None,
            });
        }
        not_native.push(MissingCapability {
            operation: Operation::Notify,
            reason: "Ferry's mooncake-py backend does not bridge the wheel's notifications"
                .to_owned(),
            min_version: None,
        });
        if !i.peer_validation {
            not_native.push(MissingCapability {
                operation: Operation::PeerValidation,
                reason: format!(
                    "Ferry cannot see the peer's registered ranges through the wheel's Python \
                     API, and the wheel ({wheel}, protocol {}) is not known to refuse a write \
                     outside them (0.3.3 over tcp writes it); local ranges are checked",
                    i.config.protocol
                ),
                min_version: Some(
                    "mooncake-transfer-engine 0.3.13.post1 over tcp (verified)".to_owned(),
                ),
            });
        }
        if !i.landed_writes {
            not_native.push(MissingCapability {
                operation: Operation::LandedWrites,
                reason: format!(
                    "the wheel ({wheel}, protocol {}) can report a write done before its bytes \
                     are in the peer's memory (0.3.3's transfer_sync_write has returned 0 with \
                     them not there yet)",
                    i.config.protocol
                ),
                min_version: Some(
                    "mooncake-transfer-engine 0.3.13.post1 over tcp (the target acknowledges \
                     each write)"
                        .to_owned(),
                ),
            });
        }
        BackendInfo {
            backend: BACKEND.to_owned(),
            details,
            not_native,
            emulated: Vec::new(),
        }
    }

    /// Registers with Ferry's table and the wheel, or with neither; runs to
    /// its end even if this future is dropped.
    async fn register(&self, region: MemoryRegion) -> Result<()> {
        detached(self.inner.clone().register(region)).await
    }

    async fn unregister(&self, addr: u64) -> Result<()> {
        detached(self.inner.clone().unregister(addr)).await
    }

    async fn batch_register(&self, regions: Vec<MemoryRegion>) -> Result<()> {
        if !self.inner.methods.batch_register {
            return Err(Error::unsupported(
                BACKEND,
                Operation::BatchRegister,
                "the installed Mooncake wheel has no batch_register_memory",
            ));
        }
        detached(self.inner.clone().batch_register(regions)).await
    }

    async fn batch_unregister(&self, addrs: &[u64]) -> Result<()> {
        if !self.inner.methods.batch_unregister {
            return Err(Error::unsupported(
                BACKEND,
                Operation::BatchUnregister,
                "the installed Mooncake wheel has no batch_unregister_memory",
            ));
        }
        detached(self.inner.clone().batch_unregister(addrs.to_vec())).await
    }

    /// Records the name: the wheel opens the peer's segment itself on the
    /// first transfer (as its `transfer_sync_*` do), so an unreachable peer
    /// shows there.
    async fn open_segment(&self, name: &str) -> Result<SegmentId> {
        if name.is_empty() {
            return Err(bad("an empty segment name".to_owned()));
        }
        let mut segs = ferry::__private::sync::lock(&self.inner.segments);
        if let Some((id, _)) = segs.iter().find(|(_, n)| n.as_str() == name) {
            return Ok(SegmentId(*id));
        }
        let id = self.inner.next_segment.fetch_add(1, Ordering::Relaxed);
        segs.insert(id, name.to_owned());
        Ok(SegmentId(id))
    }

    async fn close_segment(&self, segment: SegmentId) -> Result<()> {
        ferry::__private::sync::lock(&self.inner.segments)
            .remove(&segment.0)
            .map(|_| ())
            .ok_or(Error::UnknownSegment(segment))
    }

    async fn transfer(&self, segment: SegmentId, request: TransferRequest) -> Result<()> {
        detached(self.inner.clone().transfer(segment, request)).await
    }

    async fn batch_transfer(
        &self,
        segment: SegmentId,
        requests: &[TransferRequest],
        notify: Option<&Notification>,
    ) -> Result<BatchReport> {
        let m = self.inner.methods;
        if !(m.batch_write && m.batch_read) {
            return Err(Error::unsupported(
                BACKEND,
                Operation::BatchTransfer,
                "the installed Mooncake wheel has no batch_transfer_sync_write/read",
            ));
        }
        if notify.is_some() {
            return Err(Error::unsupported(
                BACKEND,
                Operation::Notify,
                "Ferry's mooncake-py backend does not bridge the wheel's notifications",
            ));
        }
        detached(
            self.inner
                .clone()
                .batch_transfer(segment, requests.to_vec()),
        )
        .await
    }

    async fn submit(
        &self,
        segment: SegmentId,
        requests: &[TransferRequest],
        notify: Option<&Notification>,
    ) -> Result<ferry::BatchId> {
        let _ = (segment, requests, notify);
        Err(Error::unsupported(
            BACKEND,
            Operation::AsyncBatch,
            "the adapter provides async batches",
        ))
    }

    fn status(&self, batch: ferry::BatchId) -> Result<ferry::BatchStatus> {
        let _ = batch;
        Err(Error::unsupported(
            BACKEND,
            Operation::AsyncBatch,
            "the adapter provides async batches",
        ))
    }

    async fn wait(&self, batch: ferry::BatchId) -> Result<BatchReport> {
        let _ = batch;
        Err(Error::unsupported(
            BACKEND,
            Operation::BatchWait,
            "the adapter provides async batches",
        ))
    }

    async fn release_batch(&self, batch: ferry::BatchId) -> Result<()> {
        let _ = batch;
        Err(Error::unsupported(
            BACKEND,
            Operation::AsyncBatch,
            "the adapter provides async batches",
        ))
    }

    async fn take_notifications(&self) -> Result<Vec<Notification>> {
        Err(Error::unsupported(
            BACKEND,
            Operation::Notify,
            "Ferry's mooncake-py backend does not bridge the wheel's notifications",
        ))
    }

    async fn next_notification(&self, _name: Option<&str>) -> Result<Notification> {
        Err(Error::unsupported(
            BACKEND,
            Operation::Notify,
            "Ferry's mooncake-py backend does not bridge the wheel's notifications",
        ))
    }

    fn live_batches(&self) -> Option<usize> {
        None
    }

    /// The wheel's engine serves its peers inside Mooncake: nothing
    /// inbound is visible to Ferry.
    fn inbound(&self) -> Option<ferry_core::Inbound> {
        None
    }

    /// The wheel's engine has no task of Ferry's to stop; it is destroyed
    /// with the last handle.
    async fn shutdown(&self) -> Result<()> {
        Ok(())
    }
}

/// Runs `fut` as its own task: dropping the caller's future does not stop
/// it half-way (a registration is then either done or rolled back).
async fn detached<T: Send + 'static>(
    fut: impl std::future::Future<Output = Result<T>> + Send + 'static,
) -> Result<T> {
    tokio::spawn(fut)
        .await
        .map_err(|e| Error::Canceled(format!("a {BACKEND} call: {e}")))?
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err(url: &str) -> String {
        match WheelConfig::from_url(url, false) {
            Err(Error::InvalidArgument(m)) => m,
            other => panic!("{url}: expected InvalidArgument, got {other:?}"),
        }
    }

    #[test]
    fn parses_with_the_shared_parser() {
        let c = WheelConfig::from_url(
            "mooncake-py://10.0.0.1:7000?metadata=etcd%3A%2F%2Fm%3A2379&strict&require=notify",
            false,
        )
        .unwrap();
        assert_eq!(c.host, "10.0.0.1:7000");
        assert_eq!(c.metadata, "etcd://m:2379");
        assert_eq!(c.protocol, "tcp");
        let c = WheelConfig::from_url("mooncake-py://?host=h&protocol=nvlink", true).unwrap();
        assert_eq!((c.host.as_str(), c.protocol.as_str()), ("h", "tcp"));
        assert_eq!(c.forced_from.as_deref(), Some("nvlink"));
        assert_eq!(
            WheelConfig::from_url("mooncake-py://", false).unwrap().host,
            "127.0.0.1"
        );
    }

    #[test]
    fn refuses_what_the_shared_parser_refuses() {
        assert!(err("tcp://h:1").contains("not a mooncake-py:// URL"));
        let m = err("mooncake-py://?colour=blue");
        assert!(
            // Ferry's own keys first, as for every scheme.
            m.contains("`colour`")
                && m.contains("known: strict, coalesce")
                && m.contains("require, host, metadata"),
            "{m}"
        );
        assert!(err("mooncake-py://?host=a&h%6Fst=b").contains("`host` given twice"));
        assert!(err("mooncake-py://?host=%+5").contains("percent-escape"));
        assert!(err("mooncake-py://?strict=maybe").contains("`strict`"));
        assert!(err("mooncake-py://?protocol=rmda").contains("unknown Mooncake protocol"));
        let m = err("mooncake-py://u:hunter2@h?secret=hunter2");
        assert!(!m.contains("hunter2"), "{m}");
    }
}

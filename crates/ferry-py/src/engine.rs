//! `ferry._native.Engine`: [`ferry::Engine`] for Python.

use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::str::FromStr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, RwLock};

use ferry::registry::OpenOptions;
use ferry::{
    BatchId, BatchReport, Engine, Location, MemoryRegion, Notification, SegmentId, TransferEngine,
    TransferOp, TransferRequest, TransferState,
};
use pyo3::exceptions::{PyRuntimeError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyTuple};

use crate::convert::{error_object, metrics_dict, report_dict, result_object, to_pyerr};
use crate::memory::{address_of, resolve, Keep, Resolved};
use crate::runtime::{block_on, run, runtime};
use crate::wheel::{WheelConfig, WheelEngine};

/// A Ferry engine: a local endpoint with registered memory that opens peer
/// segments and moves bytes. Every method that waits releases the GIL.
///
/// Errors are raised as the classes of `ferry.errors`, one per
/// `ferry::Error` variant, with the variant's fields as attributes.
#[pyclass(module = "ferry._native", name = "Engine", frozen, subclass)]
pub(crate) struct PyEngine {
    /// `None` only while being dropped.
    inner: Option<Handle>,
    /// What keeps each registered region's memory valid, by start address.
    regions: Mutex<HashMap<u64, Held>>,
    /// The token of the next registration (see [`Held::token`]).
    next_token: AtomicU64,
    /// Tests only (`_set_test_hook("after_unregister", f)`): called with the
    /// GIL after the engine's `unregister` returned `Ok` and before the
    /// holder is released, to interleave a re-`register` deterministically.
    after_unregister: Mutex<Option<Py<PyAny>>>,
    /// The fast path of each segment this object opened that has one
    /// ([`Engine::fast_path`]), tried by `transfer` before the engine's
    /// `transfer`. A path left for a closed segment declines everything.
    fast: RwLock<BTreeMap<u64, ferry::FastPath>>,
}

/// One registration made from Python: what keeps its memory valid.
struct Held {
    len: u64,
    keep: Keep,
    /// Which registration this is: an `unregister` releases the holder it
    /// saw before it released the GIL, never one that a re-`register` of
    /// the same address put there meanwhile.
    token: u64,
}

impl Drop for PyEngine {
    fn drop(&mut self) {
        let Some(Handle { engine, wheel }) = self.inner.take() else {
            return;
        };
        let mut regions = std::mem::take(ferry::__private::sync::get_mut(&mut self.regions));
        // The fast paths hold the backend's segments: they go with it.
        let fast = std::mem::take(
            self.fast
                .get_mut()
                .unwrap_or_else(std::sync::PoisonError::into_inner),
        );
        let Ok(rt) = runtime() else {
            // No runtime, so no engine was ever started; kept all the same.
            leak(regions.drain().map(|(_, h)| h));
            return;
        };
        // Unregister what Python registered before its objects are released:
        // `unregister` waits for transfers in flight, local or from peers,
        // and refuses new ones, so no byte is written into memory that
        // Python frees next. A region whose `unregister` failed with
        // anything but `RegionNotRegistered` may still be written (a peer
        // that could not be shown to have stopped, a library that refused):
        // its holder is leaked, never released, as `RegisteredBuffer` does.
        // Then drop the backend — inside the runtime's context and without
        // the GIL, so that a task about to call back into Python can finish.
        let addrs: Vec<u64> = regions.keys().copied().collect();
        Python::attach(|py| {
            // A drop may run while an exception is on its way out (the
            // engine was a temporary of a call that raised): set aside
            // while Python is called below, and put back after, or the
            // caller would get "error return without exception set".
            let pending = PyErr::take(py);
            // At interpreter exit the wheel backend cannot be called (see
            // `runtime::exiting`): its unregisters fail at once and the
            // regions stay registered until the process ends.
            let exiting = crate::runtime::note_finalizing(py);
            let failed = py.detach(|| {
                let failed = run(rt, async {
                    let mut failed = Vec::new();
                    for addr in addrs {
                        match engine.unregister(addr).await {
                            Ok(()) | Err(ferry::Error::RegionNotRegistered { .. }) => {}
                            Err(e) => failed.push((addr, e)),
                        }
                    }
                    failed
                });
                let _guard = rt.enter();
                drop(fast);
                drop(engine);
                failed
            });
            if !failed.is_empty() {
                leak(failed.iter().filter_map(|(addr, _)| regions.remove(addr)));
                let detail: Vec<String> = failed
                    .iter()
                    .map(|(addr, e)| format!("{addr:#x}: {e}"))
                    .collect();
                // Once per engine. At exit this is what is expected (the
                // process ends next): not a warning there.
                let level = if exiting { 10 } else { 30 };
                log(
                    py,
                    level,
                    &format!(
                        "ferry.Engine dropped with {} region(s) that may still be registered: \
                         their memory is kept (leaked), never released: {}",
                        failed.len(),
                        detail.join("; ")
                    ),
                );
            }
            drop(regions);
            drop(wheel);
            if let Some(e) = pending {
                e.restore(py);
            }
        });
    }
}

/// Never releases the holders: the memory they keep valid stays valid until
/// the process ends.
fn leak(held: impl Iterator<Item = Held>) {
    for h in held {
        std::mem::forget(h.keep);
    }
}

/// Logs `message` on the `ferry` logger at `level` (Python's numbers),
/// ignoring any failure (during finalization logging may be gone).
fn log(py: Python<'_>, level: i32, message: &str) {
    let _ = py
        .import("logging")
        .and_then(|l| l.call_method1("getLogger", ("ferry",)))
        .and_then(|l| l.call_method1("log", (level, message)));
}

/// A started engine: every call goes through it.
struct Handle {
    engine: Arc<Engine>,
    /// On `mooncake-py://`: the wheel's own engine object.
    wheel: Option<Py<PyAny>>,
}

/// The scheme `mooncake-py://` (see [`crate::wheel`]): the installed
/// Mooncake wheel's engine, initialized with the GIL held, in the default
/// stack like every scheme. `MC_FORCE_TCP` (set to any value) asks the
/// wheel for its TCP transport only, as Mooncake defines it.
fn wheel_scheme() -> ferry::registry::Scheme {
    ferry::registry::Scheme::new(crate::wheel::BACKEND, |url, _| {
        let force_tcp = std::env::var_os("MC_FORCE_TCP").is_some();
        let config = WheelConfig::from_parts(url, force_tcp)?;
        Ok(async move { Python::attach(|py| WheelEngine::start(py, config)) })
    })
}

/// Registers this crate's scheme (`mooncake-py`) in Ferry's scheme
/// registry, once per process; `Engine(url)` opens every scheme through
/// that registry.
pub(crate) fn register_schemes() -> PyResult<()> {
    static DONE: std::sync::OnceLock<Result<(), ferry::registry::RegisterError>> =
        std::sync::OnceLock::new();
    DONE.get_or_init(|| ferry::registry::register(wheel_scheme()))
        .clone()
        .map_err(|e| PyRuntimeError::new_err(e.to_string()))
}

fn parse_op(op: &str) -> PyResult<TransferOp> {
    // In any case, without allocating (this runs on every call).
    let is = |name: &str| op.eq_ignore_ascii_case(name);
    if is("write") || is("w") {
        Ok(TransferOp::Write)
    } else if is("read") || is("r") {
        Ok(TransferOp::Read)
    } else {
        Err(PyValueError::new_err(format!(
            "op must be 'read' or 'write', got {op:?}"
        )))
    }
}

fn parse_location(s: &str) -> PyResult<Location> {
    Location::from_str(s).map_err(|e| PyValueError::new_err(e.to_string()))
}

fn notification(notify: Option<(String, String)>) -> Option<Notification> {
    notify.map(|(name, message)| Notification::new(name, message))
}

/// The requests of a batch from parallel lists (Mooncake's calling
/// convention), checked for equal lengths.
fn requests(
    op: TransferOp,
    local: &[u64],
    remote: &[u64],
    lengths: &[u64],
) -> PyResult<Vec<TransferRequest>> {
    if local.len() != remote.len() || local.len() != lengths.len() {
        return Err(PyValueError::new_err(format!(
            "local_addrs, remote_addrs and lengths must have the same length \
             (got {}, {}, {})",
            local.len(),
            remote.len(),
            lengths.len()
        )));
    }
    Ok(local
        .iter()
        .zip(remote)
        .zip(lengths)
        .map(|((l, r), n)| TransferRequest {
            op,
            local_addr: *l,
            remote_addr: *r,
            len: *n,
        })
        .collect())
}

fn report_list<'py>(py: Python<'py>, report: &BatchReport) -> PyResult<Bound<'py, PyList>> {
    let list = PyList::empty(py);
    for r in &report.results {
        list.append(result_object(py, r)?)?;
    }
    Ok(list)
}

/// Runs `fut` on the runtime and calls `callback(error, value)` when it
/// is done (from a runtime thread, with the GIL): `error` is `None` or the
/// exception instance, `value` what `convert` made of the output.
fn spawn_with_callback<T, F, C>(callback: Py<PyAny>, fut: F, convert: C) -> PyResult<()>
where
    T: Send + 'static,
    F: Future<Output = ferry::Result<T>> + Send + 'static,
    C: for<'py> FnOnce(Python<'py>, T) -> PyResult<Bound<'py, PyAny>> + Send + 'static,
{
    let rt = runtime()?;
    rt.spawn(async move {
        let out = fut.await;
        // Waiting for the GIL must not hold up a worker that serves peers.
        let _ = tokio::task::spawn_blocking(move || {
            Python::attach(|py| {
                let args = match out {
                    Ok(v) => match convert(py, v) {
                        Ok(obj) => (py.None().into_bound(py), obj),
                        Err(e) => (
                            e.into_value(py).into_bound(py).into_any(),
                            py.None().into_bound(py),
                        ),
                    },
                    Err(e) => match error_object(py, &e) {
                        Ok(obj) => (obj, py.None().into_bound(py)),
                        Err(e) => (
                            e.into_value(py).into_bound(py).into_any(),
                            py.None().into_bound(py),
                        ),
                    },
                };
                if let Err(e) = callback.call1(py, args) {
                    e.write_unraisable(py, None);
                }
            })
        })
        .await;
    });
    Ok(())
}

impl PyEngine {
    fn handle(&self) -> PyResult<&Handle> {
        self.inner
            .as_ref()
            .ok_or_else(|| PyRuntimeError::new_err("the engine is closed"))
    }

    fn engine(&self) -> PyResult<&Arc<Engine>> {
        Ok(&self.handle()?.engine)
    }

    fn regions(&self) -> MutexGuard<'_, HashMap<u64, Held>> {
        // A poisoned lock only means another thread panicked while holding
        // it; the map itself is still consistent (inserts and removes are
        // single operations).
        ferry::__private::sync::lock(&self.regions)
    }

    /// Keeps `keep` for the registration just made at `addr`. A holder
    /// still there for that address belongs to a registration the engine
    /// no longer has (it just accepted this one over the same range), whose
    /// `unregister` has not yet come back for it: replaced (that
    /// `unregister` then finds another token and leaves this one).
    fn hold(&self, addr: u64, len: u64, keep: Keep) {
        let token = self.next_token.fetch_add(1, Ordering::Relaxed);
        let old = self.regions().insert(addr, Held { len, keep, token });
        drop(old);
    }

    /// Calls the `after_unregister` test hook, if one is set.
    fn run_test_hook(&self, py: Python<'_>) -> PyResult<()> {
        let hook = ferry::__private::sync::lock(&self.after_unregister)
            .as_ref()
            .map(|f| f.clone_ref(py));
        match hook {
            Some(hook) => hook.call0(py).map(drop),
            None => Ok(()),
        }
    }

    /// The token of the registration held at `addr` now.
    fn token_of(&self, addr: u64) -> Option<u64> {
        self.regions().get(&addr).map(|h| h.token)
    }

    /// Takes the holder at `addr` out if it is still the registration
    /// `token` names (to be dropped by the caller, outside the lock).
    fn release(&self, addr: u64, token: Option<u64>) -> Option<Held> {
        let mut table = self.regions();
        match (token, table.get(&addr)) {
            (Some(t), Some(h)) if h.token == t => table.remove(&addr),
            _ => None,
        }
    }

    fn region_of(resolved: &Resolved, location: Option<&str>) -> PyResult<MemoryRegion> {
        let loc = match (location, resolved.location.as_deref()) {
            (Some(l), _) => parse_location(l)?,
            (None, Some(l)) => parse_location(l)?,
            (None, None) => Location::cpu(0),
        };
        let len = usize::try_from(resolved.len).map_err(|_| {
            PyValueError::new_err("length does not fit in this machine's address space")
        })?;
        // SAFETY: the region is only handed to the engine, which checks every
        // transfer against registered regions. The memory stays valid until
        // `unregister` returns because `resolved.keep` is stored in
        // `self.regions` from registration until then: a buffer export keeps
        // its exporter from freeing or resizing it, an object reference
        // keeps an object that owns its memory alive, and a raw address is the
        // caller's documented promise (the contract of Mooncake's
        // `register_memory`, which this API mirrors).
        Ok(unsafe { MemoryRegion::from_raw_parts(resolved.addr as *mut u8, len, loc) })
    }

    /// The region with its memory kind checked (see [`crate::cuda`]): a
    /// pointer the CUDA driver calls device memory, given as host memory
    /// (`*`, `cpu:N`), becomes `cuda:N` with `*` on a backend that takes GPU
    /// memory, and is refused otherwise, before the backend sees it.
    fn checked_kind(&self, region: MemoryRegion) -> ferry::Result<MemoryRegion> {
        if !region.location().is_host() {
            return Ok(region);
        }
        let crate::cuda::Kind::Device { ordinal } = crate::cuda::classify(region.addr()) else {
            return Ok(region);
        };
        let engine = self
            .engine()
            .map_err(|_| ferry::Error::InvalidArgument("the engine is closed".to_owned()))?;
        if engine.capabilities().memory.cuda && region.location().as_str() == "*" {
            let len = usize::try_from(region.len())
                .map_err(|_| ferry::Error::InvalidArgument("length too large".to_owned()))?;
            // SAFETY: the same memory as `region`, which was built under the
            // contract stated in `region_of`; only the location changes.
            return Ok(unsafe {
                MemoryRegion::from_raw_parts(region.addr() as *mut u8, len, Location::cuda(ordinal))
            });
        }
        Err(ferry::Error::InvalidArgument(format!(
            "{:#x}+{} is CUDA device memory of GPU {ordinal} (cuPointerGetAttribute), given as {}; \
             the {} backend {} takes host memory only. Backends that take GPU memory: mooncake:// \
             over a CUDA build of libtransfer_engine.so, mooncake-py:// over a CUDA build of the \
             Mooncake wheel (mooncake.engine.SUPPORT_CUDA)",
            region.addr(),
            region.len(),
            region.location(),
            engine.backend_name(),
            if engine.capabilities().memory.cuda {
                "is given a host location and"
            } else {
                "here"
            },
        )))
    }
}

/// Opens the engine `url`'s scheme names, through Ferry's scheme
/// registry (`tcp`, `mooncake`, `verbs`, `nixl`, `inproc`, and this
/// crate's `mooncake-py`), with the shared secret taken the one way every
/// program takes it (`ferry::secret`: `FERRY_SECRET`, `FERRY_SECRET_FILE`,
/// `secret_file=`).
fn open(py: Python<'_>, url: &str) -> PyResult<ferry::Result<Handle>> {
    register_schemes()?;
    let parsed = ferry::raw::ParsedUrl::parse(url).and_then(|mut u| {
        ferry::secret::from_environment(&mut u)?;
        Ok(u)
    });
    let parsed = match parsed {
        Ok(u) => u,
        Err(e) => return Ok(Err(e)),
    };
    let engine = match block_on(py, Engine::open_parsed(parsed, OpenOptions::default()))? {
        Ok(e) => e,
        Err(e) => return Ok(Err(e)),
    };
    let wheel = engine.backend::<WheelEngine>().map(|w| w.wheel(py));
    Ok(Ok(Handle {
        engine: Arc::new(engine),
        wheel,
    }))
}

#[pymethods]
impl PyEngine {
    /// Opens an engine from a URL (`tcp://127.0.0.1:0`,
    /// `mooncake://?lib=…&metadata=P2PHANDSHAKE&protocol=tcp`, plus Ferry's
    /// `strict=1`, `require=op,op`, …). Blocks (GIL released) until started.
    #[new]
    fn py_new(py: Python<'_>, url: &str) -> PyResult<PyEngine> {
        let handle = open(py, url)?.map_err(|e| to_pyerr(py, &e))?;
        Ok(PyEngine {
            inner: Some(handle),
            regions: Mutex::new(HashMap::new()),
            next_token: AtomicU64::new(1),
            after_unregister: Mutex::new(None),
            fast: RwLock::new(BTreeMap::new()),
        })
    }

    /// The name peers pass to `open_segment` to reach this engine.
    #[getter]
    fn segment_name(&self) -> PyResult<String> {
        Ok(self.engine()?.segment_name().to_owned())
    }

    /// On `mooncake-py://`: the installed wheel's own
    /// `mooncake.engine.TransferEngine` that moves the bytes (what
    /// `mooncake.store` and `mooncake.pg` take); `None` on other backends.
    fn wheel_engine(&self, py: Python<'_>) -> PyResult<Option<Py<PyAny>>> {
        Ok(self.handle()?.wheel.as_ref().map(|w| w.clone_ref(py)))
    }

    /// The backend: `tcp`, `mooncake`, `mooncake-py`, `verbs` or `inproc`.
    #[getter]
    fn backend(&self) -> PyResult<String> {
        Ok(self.engine()?.backend_name().to_owned())
    }

    /// The capability report as a dict: per optional operation and
    /// guarantee `native` / `emulated` / `unsupported` with the reason and
    /// the version that makes it native; `text` is the printed report.
    fn report<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        report_dict(py, &self.handle()?.engine.report())
    }

    /// This engine's metrics as a dict: `engine`, `bytes_total`,
    /// `requests_ok`, `requests_failed`, `batches_in_flight`,
    /// `registered_bytes`, `notifications_received`, `queue_full`,
    /// `emulated` (calls per emulated operation) and `peers` (per peer
    /// segment name, beyond 64 peers `other`: `bytes_written`,
    /// `bytes_read`, `requests_ok`, `requests_failed` by error kind,
    /// `notifications_sent`), `served` (the target side: per peer engine
    /// name, `bytes_written` into this engine's memory, `bytes_read` from
    /// it, `segments_written`, `segments_read`; `None` where the backend
    /// cannot see it) and `notifications_dropped` (`None` where not
    /// counted) — for a serving stack to export.
    fn metrics<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        metrics_dict(py, &self.handle()?.engine.metrics())
    }

    /// Registers memory: `register(addr, length)` or `register(obj)` for an
    /// object exposing writable memory (buffer protocol,
    /// `__array_interface__`, `data_ptr()`/`nbytes`), which is kept alive
    /// until unregistered. Returns `(addr, length)`.
    #[pyo3(signature = (target, length=None, location=None))]
    fn register(
        &self,
        py: Python<'_>,
        target: &Bound<'_, PyAny>,
        length: Option<u64>,
        location: Option<&str>,
    ) -> PyResult<(u64, u64)> {
        let engine = self.engine()?;
        let resolved = resolve(target, length)?;
        let region = Self::region_of(&resolved, location)?;
        let region = self.checked_kind(region).map_err(|e| to_pyerr(py, &e))?;
        let (addr, len) = (resolved.addr, resolved.len);
        if let Err(e) = block_on(py, engine.register(region))? {
            if may_stay_registered(&e) {
                // The backend may still have it: its object stays alive
                // until an `unregister` of it succeeds (or the engine
                // drops), never released on doubt.
                self.hold(addr, len, resolved.keep);
            }
            return Err(to_pyerr(py, &e));
        }
        self.hold(addr, len, resolved.keep);
        Ok((addr, len))
    }

    /// Unregisters the region starting at `target` (an address or the object
    /// that was registered). Returns when no transfer uses it any more; the
    /// object is released then.
    fn unregister(&self, py: Python<'_>, target: &Bound<'_, PyAny>) -> PyResult<()> {
        let engine = self.engine()?;
        let addr = address_of(target)?;
        let token = self.token_of(addr);
        if let Err(e) = block_on(py, engine.unregister(addr))? {
            if matches!(e, ferry::Error::RegionNotRegistered { .. }) {
                // Not registered (the engine says so): an object kept on
                // doubt (a failed register that may have stayed) goes.
                drop(self.release(addr, token));
            }
            return Err(to_pyerr(py, &e));
        }
        self.run_test_hook(py)?;
        let released = self.release(addr, token);
        drop(released);
        Ok(())
    }

    /// Registers every target, all or nothing (`BatchRegisterFailed` names
    /// the index that failed). `lengths`, if given, has one entry per target
    /// (`None` for objects). Returns `[(addr, length), …]`.
    #[pyo3(signature = (targets, lengths=None, location=None))]
    fn batch_register(
        &self,
        py: Python<'_>,
        targets: &Bound<'_, PyAny>,
        lengths: Option<Vec<Option<u64>>>,
        location: Option<&str>,
    ) -> PyResult<Vec<(u64, u64)>> {
        let engine = self.engine()?;
        let targets: Vec<Bound<'_, PyAny>> = targets
            .try_iter()
            .map_err(|_| PyTypeError::new_err("targets must be a sequence"))?
            .collect::<PyResult<_>>()?;
        if let Some(l) = &lengths {
            if l.len() != targets.len() {
                return Err(PyValueError::new_err(format!(
                    "{} targets but {} lengths",
                    targets.len(),
                    l.len()
                )));
            }
        }
        let mut resolved = Vec::with_capacity(targets.len());
        let mut regions = Vec::with_capacity(targets.len());
        for (i, t) in targets.iter().enumerate() {
            let len = lengths.as_ref().and_then(|l| l.get(i).copied().flatten());
            let r = resolve(t, len)?;
            let region = Self::region_of(&r, location)?;
            let region = self.checked_kind(region).map_err(|e| {
                let e = ferry::Error::BatchRegisterFailed {
                    index: i,
                    addr: r.addr,
                    source: Box::new(e),
                };
                to_pyerr(py, &e)
            })?;
            regions.push(region);
            resolved.push(r);
        }
        if let Err(e) = block_on(py, engine.batch_register(regions))? {
            if may_stay_registered(&e) {
                // Which regions the backend kept is not certain: every
                // object of the batch stays alive until an `unregister`
                // of it succeeds or says it is not registered (or the
                // engine drops, which unregisters each).
                for r in resolved {
                    self.hold(r.addr, r.len, r.keep);
                }
            }
            return Err(to_pyerr(py, &e));
        }
        let out = resolved.iter().map(|r| (r.addr, r.len)).collect();
        for r in resolved {
            self.hold(r.addr, r.len, r.keep);
        }
        Ok(out)
    }

    /// Unregisters the regions starting at each target; every one is
    /// attempted and the first error is raised.
    fn batch_unregister(&self, py: Python<'_>, targets: &Bound<'_, PyAny>) -> PyResult<()> {
        let engine = self.engine()?;
        let addrs: Vec<u64> = targets
            .try_iter()
            .map_err(|_| PyTypeError::new_err("targets must be a sequence"))?
            .map(|t| address_of(&t?))
            .collect::<PyResult<_>>()?;
        let tokens: Vec<Option<u64>> = addrs.iter().map(|&a| self.token_of(a)).collect();
        let result = block_on(py, engine.batch_unregister(&addrs))?;
        // On success release every object. On failure the engine does not
        // say which addresses it did unregister: keep them all (holding an
        // object too long is a leak until `unregister`; releasing one still
        // registered would let peers write into freed memory).
        if result.is_ok() {
            self.run_test_hook(py)?;
            let released: Vec<_> = addrs
                .iter()
                .zip(tokens)
                .filter_map(|(&a, t)| self.release(a, t))
                .collect();
            drop(released);
        }
        result.map_err(|e| to_pyerr(py, &e))
    }

    /// The regions this engine registered from Python: `[(addr, length), …]`
    /// sorted by address.
    fn registered(&self) -> Vec<(u64, u64)> {
        let mut v: Vec<(u64, u64)> = self.regions().iter().map(|(a, h)| (*a, h.len)).collect();
        v.sort_unstable();
        v
    }

    /// Opens the peer segment called `name` (`host:port`); returns its
    /// handle (an int).
    fn open_segment(&self, py: Python<'_>, name: &str) -> PyResult<u64> {
        let engine = self.engine()?;
        let seg = block_on(py, engine.open_segment(name))?.map_err(|e| to_pyerr(py, &e))?;
        if let Some(fast) = engine.fast_path(seg) {
            ferry::__private::sync::write(&self.fast).insert(seg.0, fast);
        }
        Ok(seg.0)
    }

    /// Closes a segment handle.
    fn close_segment(&self, py: Python<'_>, segment: u64) -> PyResult<()> {
        let engine = self.engine()?;
        ferry::__private::sync::write(&self.fast).remove(&segment);
        block_on(py, engine.close_segment(SegmentId(segment)))?.map_err(|e| to_pyerr(py, &e))
    }

    /// One transfer, waited on: `op` is `"write"` (local → peer) or
    /// `"read"` (peer → local). Raises on failure.
    fn transfer(
        &self,
        py: Python<'_>,
        segment: u64,
        op: &str,
        local_addr: u64,
        remote_addr: u64,
        length: u64,
    ) -> PyResult<()> {
        let engine = self.engine()?;
        let req = TransferRequest {
            op: parse_op(op)?,
            local_addr,
            remote_addr,
            len: length,
        };
        // With the GIL released as for any call (holding it through a copy
        // starved threads waiting for the GIL: docs/benchmarks/ferry-py.md).
        // The segment's fast path first (a granted same-host copy, done by
        // this thread with no future); when it declines, not a byte moved
        // and the engine's `transfer` runs (the lock is not held by then).
        let seg = SegmentId(segment);
        let rt = runtime()?;
        py.detach(|| {
            let done = ferry::__private::sync::read(&self.fast)
                .get(&segment)
                .and_then(|fast| fast.try_transfer(&req));
            match done {
                Some(result) => result,
                None => run(rt, engine.transfer(seg, req)),
            }
        })
        .map_err(|e| to_pyerr(py, &e))
    }

    /// A batch, waited on. Returns one entry per request: `None` or the
    /// exception of that request (not raised). Raises only when the batch
    /// as a whole is refused (nothing moved). `notify=(name, message)` is
    /// delivered to the peer after every request landed.
    #[pyo3(signature = (segment, op, local_addrs, remote_addrs, lengths, notify=None))]
    #[allow(clippy::too_many_arguments)]
    fn batch_transfer<'py>(
        &self,
        py: Python<'py>,
        segment: u64,
        op: &str,
        local_addrs: Vec<u64>,
        remote_addrs: Vec<u64>,
        lengths: Vec<u64>,
        notify: Option<(String, String)>,
    ) -> PyResult<Bound<'py, PyList>> {
        let engine = self.engine()?;
        let reqs = requests(parse_op(op)?, &local_addrs, &remote_addrs, &lengths)?;
        let note = notification(notify);
        // One request and no notification: the segment's fast path first,
        // counted as the batch of one it stands in for.
        let seg = SegmentId(segment);
        let rt = runtime()?;
        let report = py
            .detach(|| {
                let fast = match (&reqs[..], &note) {
                    ([one], None) => ferry::__private::sync::read(&self.fast)
                        .get(&segment)
                        .and_then(|fast| fast.try_batch_of_one(one)),
                    _ => None,
                };
                match fast {
                    Some(result) => Ok(ferry::BatchReport {
                        results: vec![result],
                    }),
                    None => run(rt, engine.batch_transfer(seg, &reqs, note.as_ref())),
                }
            })
            .map_err(|e| to_pyerr(py, &e))?;
        report_list(py, &report)
    }

    /// Starts a batch and returns its id at once (for `status`, `wait`,
    /// `release_batch`).
    #[pyo3(signature = (segment, op, local_addrs, remote_addrs, lengths, notify=None))]
    #[allow(clippy::too_many_arguments)]
    fn submit(
        &self,
        py: Python<'_>,
        segment: u64,
        op: &str,
        local_addrs: Vec<u64>,
        remote_addrs: Vec<u64>,
        lengths: Vec<u64>,
        notify: Option<(String, String)>,
    ) -> PyResult<u64> {
        let engine = self.engine()?;
        let reqs = requests(parse_op(op)?, &local_addrs, &remote_addrs, &lengths)?;
        let note = notification(notify);
        let id = block_on(py, engine.submit(SegmentId(segment), &reqs, note.as_ref()))?
            .map_err(|e| to_pyerr(py, &e))?;
        Ok(id.0)
    }

    /// The state of each request of a batch, never waiting: a list of
    /// `("pending", bytes_so_far)`, `("completed", None)` or
    /// `("failed", exception)`.
    fn status<'py>(&self, py: Python<'py>, batch: u64) -> PyResult<Bound<'py, PyList>> {
        let engine = self.engine()?;
        let status = engine
            .status(BatchId(batch))
            .map_err(|e| to_pyerr(py, &e))?;
        let list = PyList::empty(py);
        for s in &status.states {
            let item = match s {
                TransferState::Pending { transferred } => PyTuple::new(
                    py,
                    [
                        ("pending").into_pyobject(py)?.into_any(),
                        transferred.into_pyobject(py)?.into_any(),
                    ],
                )?,
                TransferState::Completed => PyTuple::new(
                    py,
                    [
                        ("completed").into_pyobject(py)?.into_any(),
                        py.None().into_bound(py),
                    ],
                )?,
                TransferState::Failed(e) => PyTuple::new(
                    py,
                    [
                        ("failed").into_pyobject(py)?.into_any(),
                        error_object(py, e)?,
                    ],
                )?,
            };
            list.append(item)?;
        }
        Ok(list)
    }

    /// Waits for every request of a batch, releases it and returns the
    /// per-request results (as `batch_transfer`).
    fn wait<'py>(&self, py: Python<'py>, batch: u64) -> PyResult<Bound<'py, PyList>> {
        let engine = self.engine()?;
        let report = block_on(py, engine.wait(BatchId(batch)))?.map_err(|e| to_pyerr(py, &e))?;
        report_list(py, &report)
    }

    /// Releases a finished batch without waiting (`BatchBusy` if a request
    /// is still pending).
    fn release_batch(&self, py: Python<'_>, batch: u64) -> PyResult<()> {
        let engine = self.engine()?;
        block_on(py, engine.release_batch(BatchId(batch)))?.map_err(|e| to_pyerr(py, &e))
    }

    /// The notifications received so far, oldest first, as
    /// `[(name, message), …]`. Never waits.
    fn take_notifications(&self, py: Python<'_>) -> PyResult<Vec<(String, String)>> {
        let engine = self.engine()?;
        let notes = block_on(py, engine.take_notifications())?.map_err(|e| to_pyerr(py, &e))?;
        Ok(notes.into_iter().map(|n| (n.name, n.message)).collect())
    }

    /// Waits for the next notification (the oldest queued, or the next to
    /// arrive) whose name is `name` (any with `None`) and takes it, leaving
    /// every other one queued: `(name, message)`, or `None` once `timeout`
    /// seconds have passed without one. Releases the GIL while it waits
    /// and sees Ctrl-C within 100 ms; a wait that times out or is
    /// interrupted takes nothing.
    #[pyo3(signature = (name=None, timeout=None))]
    fn next_notification(
        &self,
        py: Python<'_>,
        name: Option<String>,
        timeout: Option<f64>,
    ) -> PyResult<Option<(String, String)>> {
        let engine = self.engine()?;
        let limit = match timeout {
            None => None,
            Some(t) if t.is_finite() && t >= 0.0 => Some(std::time::Duration::from_secs_f64(t)),
            Some(t) => {
                return Err(PyValueError::new_err(format!(
                    "timeout must be a non-negative number of seconds, not {t}"
                )))
            }
        };
        let start = std::time::Instant::now();
        const SLICE: std::time::Duration = std::time::Duration::from_millis(100);
        loop {
            let slice = match limit {
                None => SLICE,
                Some(l) => l.saturating_sub(start.elapsed()).min(SLICE),
            };
            // Cancel-safe: a slice that ends without one has taken nothing.
            // (The timer is made inside the runtime, where `block_on` polls.)
            let got = block_on(py, async {
                tokio::time::timeout(slice, engine.next_notification(name.as_deref())).await
            })?;
            match got {
                Ok(n) => {
                    let n = n.map_err(|e| to_pyerr(py, &e))?;
                    return Ok(Some((n.name, n.message)));
                }
                Err(_) => {
                    py.check_signals()?;
                    if limit.is_some_and(|l| start.elapsed() >= l) {
                        return Ok(None);
                    }
                }
            }
        }
    }

    /// `transfer` without blocking: `callback(error, None)` is called from a
    /// runtime thread when it is done. (`ferry.Engine.transfer_async` wraps
    /// this in an asyncio future.)
    #[allow(clippy::too_many_arguments)]
    fn _transfer_cb(
        &self,
        segment: u64,
        op: &str,
        local_addr: u64,
        remote_addr: u64,
        length: u64,
        callback: Py<PyAny>,
    ) -> PyResult<()> {
        let engine = self.engine()?.clone();
        let req = TransferRequest {
            op: parse_op(op)?,
            local_addr,
            remote_addr,
            len: length,
        };
        spawn_with_callback(
            callback,
            async move { engine.transfer(SegmentId(segment), req).await },
            |py, ()| Ok(py.None().into_bound(py)),
        )
    }

    /// `batch_transfer` without blocking; `callback(error, results)`.
    #[pyo3(signature = (segment, op, local_addrs, remote_addrs, lengths, notify, callback))]
    #[allow(clippy::too_many_arguments)]
    fn _batch_transfer_cb(
        &self,
        segment: u64,
        op: &str,
        local_addrs: Vec<u64>,
        remote_addrs: Vec<u64>,
        lengths: Vec<u64>,
        notify: Option<(String, String)>,
        callback: Py<PyAny>,
    ) -> PyResult<()> {
        let engine = self.engine()?.clone();
        let reqs = requests(parse_op(op)?, &local_addrs, &remote_addrs, &lengths)?;
        let note = notification(notify);
        spawn_with_callback(
            callback,
            async move {
                engine
                    .batch_transfer(SegmentId(segment), &reqs, note.as_ref())
                    .await
            },
            |py, report| Ok(report_list(py, &report)?.into_any()),
        )
    }

    /// `wait` without blocking; `callback(error, results)`.
    fn _wait_cb(&self, batch: u64, callback: Py<PyAny>) -> PyResult<()> {
        let engine = self.engine()?.clone();
        spawn_with_callback(
            callback,
            async move { engine.wait(BatchId(batch)).await },
            |py, report| Ok(report_list(py, &report)?.into_any()),
        )
    }

    /// Benchmark helper (`python -m ferry.bench`): the Rust engine's own
    /// figure for the same work, with no Python per call. Runs `iterations`
    /// transfers (one request) or batches (several) in a Rust loop,
    /// shifting every address by `stride` (default: the batch's size) each
    /// iteration, modulo `span` bytes; returns the seconds it took.
    #[pyo3(signature = (segment, op, local_addrs, remote_addrs, lengths, iterations, span, stride=None))]
    #[allow(clippy::too_many_arguments)]
    fn _bench_loop(
        &self,
        py: Python<'_>,
        segment: u64,
        op: &str,
        local_addrs: Vec<u64>,
        remote_addrs: Vec<u64>,
        lengths: Vec<u64>,
        iterations: u64,
        span: u64,
        stride: Option<u64>,
    ) -> PyResult<f64> {
        let engine = self.engine()?;
        let base = requests(parse_op(op)?, &local_addrs, &remote_addrs, &lengths)?;
        let size: u64 = stride.unwrap_or_else(|| lengths.iter().sum());
        let slots = span.checked_div(size).unwrap_or(1).max(1);
        let seg = SegmentId(segment);
        let elapsed = block_on(py, async {
            let mut reqs = base.clone();
            let start = std::time::Instant::now();
            for i in 0..iterations {
                let shift = (i % slots) * size;
                for (r, b) in reqs.iter_mut().zip(&base) {
                    r.local_addr = b.local_addr + shift;
                    r.remote_addr = b.remote_addr + shift;
                }
                if reqs.len() == 1 {
                    engine.transfer(seg, reqs[0]).await?;
                } else {
                    engine
                        .batch_transfer(seg, &reqs, None)
                        .await?
                        .into_result()?;
                }
            }
            Ok::<_, ferry::Error>(start.elapsed())
        })?
        .map_err(|e| to_pyerr(py, &e))?;
        Ok(elapsed.as_secs_f64())
    }

    /// For tests: `_set_test_hook("after_unregister", f)` makes every
    /// successful `unregister` / `batch_unregister` call `f()` (with the GIL) after the engine
    /// unregistered the region and before its holder is released;
    /// `None` removes it.
    fn _set_test_hook(&self, name: &str, hook: Option<Py<PyAny>>) -> PyResult<()> {
        match name {
            "after_unregister" => {
                *ferry::__private::sync::lock(&self.after_unregister) = hook;
                Ok(())
            }
            _ => Err(PyValueError::new_err(format!("unknown test hook {name:?}"))),
        }
    }

    fn __repr__(&self) -> String {
        match &self.inner {
            Some(h) => format!(
                "<ferry.Engine {} {}>",
                h.engine.backend_name(),
                h.engine.segment_name()
            ),
            None => "<ferry.Engine closed>".to_owned(),
        }
    }
}

/// Whether a failed register may have left the region registered
/// (`RegionHeld`, also as the source of `BatchRegisterFailed`): see
/// `TransferEngine::register`.
fn may_stay_registered(e: &ferry::Error) -> bool {
    match e {
        ferry::Error::RegionHeld { .. } => true,
        ferry::Error::BatchRegisterFailed { source, .. } => may_stay_registered(source),
        _ => false,
    }
}

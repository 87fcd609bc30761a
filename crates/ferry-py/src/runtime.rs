//! The one tokio runtime every engine of the process runs on, and the
//! helper that runs a future from Python with the GIL released.

use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;

use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use tokio::runtime::Runtime;

static RUNTIME: OnceLock<Result<Runtime, String>> = OnceLock::new();

/// Set when the interpreter starts to exit (see [`exiting`]).
static EXITING: AtomicBool = AtomicBool::new(false);

/// Whether the interpreter is exiting: set by an `atexit` callback that
/// `ferry._native` registers when it is imported (`atexit` callbacks run
/// before finalization starts; the one registered first runs last, so the
/// application's own handlers, registered after the import, still see
/// `false`), or by [`note_finalizing`]. From then on a thread that is not
/// Python's main thread and asks for the GIL never gets it (CPython ends
/// or parks it), so nothing may wait for such a thread: the
/// `mooncake-py://` backend refuses its calls into the wheel instead.
pub(crate) fn exiting() -> bool {
    EXITING.load(Ordering::Acquire)
}

/// Marks the interpreter as exiting (the `atexit` callback).
#[pyfunction]
pub(crate) fn _at_exit() {
    EXITING.store(true, Ordering::Release);
}

/// Sets [`exiting`] if `sys.is_finalizing()` says so (for a drop that runs
/// during finalization without the `atexit` callback having run, e.g. when
/// registering it failed); returns [`exiting`].
pub(crate) fn note_finalizing(py: Python<'_>) -> bool {
    let finalizing = py
        .import("sys")
        .and_then(|sys| sys.call_method0("is_finalizing"))
        .and_then(|r| r.is_truthy())
        // Python that cannot even answer this is being torn down.
        .unwrap_or(true);
    if finalizing {
        _at_exit();
    }
    exiting()
}

/// The shared multi-threaded runtime (started on first use). Its worker
/// threads serve peers and drive the sockets while Python threads wait with
/// the GIL released.
pub(crate) fn runtime() -> PyResult<&'static Runtime> {
    RUNTIME
        .get_or_init(|| {
            let mut b = tokio::runtime::Builder::new_multi_thread();
            b.enable_all().thread_name("ferry-worker");
            if let Some(n) = worker_threads()? {
                b.worker_threads(n);
            }
            b.build()
                .map_err(|e| format!("cannot start ferry's async runtime: {e}"))
        })
        .as_ref()
        .map_err(|e| PyRuntimeError::new_err(e.clone()))
}

/// Runs `fut` to completion on the calling thread with the GIL released:
/// other Python threads run meanwhile, the runtime's workers do the I/O.
///
/// Not tokio's `Runtime::block_on` (whose thread only sleeps until a worker
/// wakes it): see [`run`].
pub(crate) fn block_on<F>(py: Python<'_>, fut: F) -> PyResult<F::Output>
where
    F: Future + Send,
    F::Output: Send,
{
    let rt = runtime()?;
    Ok(py.detach(|| run(rt, fut)))
}

/// The body of [`block_on`], for a caller that has already released the GIL:
/// the calling thread drives the connections its call uses while it waits
/// (it reads its own answer: no wake-up from a worker thread in between,
/// see `ferry_core::assist`), and otherwise spins briefly, then sleeps.
pub(crate) fn run<F: Future>(rt: &Runtime, fut: F) -> F::Output {
    ferry::assist::block_on(rt.handle(), fut)
}

/// `FERRY_WORKER_THREADS`: the runtime's worker threads (default: tokio's,
/// one per CPU).
fn worker_threads() -> Result<Option<usize>, String> {
    match std::env::var("FERRY_WORKER_THREADS") {
        Err(_) => Ok(None),
        Ok(v) => match v.trim().parse::<usize>() {
            Ok(n) if n > 0 => Ok(Some(n)),
            _ => Err(format!(
                "FERRY_WORKER_THREADS={v:?}: expected a number of threads (1 or more)"
            )),
        },
    }
}

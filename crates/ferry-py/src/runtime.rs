//! The one tokio runtime every engine of the process runs on, and the
//! helper that runs a future from Python with the GIL released.

use std::future::Future;
use std::pin::pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::task::{Context, Poll, Wake, Waker};
use std::thread::Thread;
use std::time::{Duration, Instant};

use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use tokio::runtime::Runtime;

static RUNTIME: OnceLock<Result<Runtime, String>> = OnceLock::new();

/// The shared multi-threaded runtime (started on first use). Its worker
/// threads serve peers and drive the sockets while Python threads wait with
/// the GIL released.
pub(crate) fn runtime() -> PyResult<&'static Runtime> {
    RUNTIME
        .get_or_init(|| {
            tokio::runtime::Builder::new_multi_thread()
                .enable_all()
                .thread_name("ferry-worker")
                .build()
                .map_err(|e| format!("cannot start ferry's async runtime: {e}"))
        })
        .as_ref()
        .map_err(|e| PyRuntimeError::new_err(e.clone()))
}

/// How long a waiting Python thread spins for its wake-up before it sleeps.
/// Waking a sleeping thread costs tens of microseconds on a VM, as much as a
/// whole small transfer; a completion usually arrives within this window.
const SPIN: Duration = Duration::from_micros(50);

/// Wakes the thread that runs [`block_on`].
struct Signal {
    woken: AtomicBool,
    thread: Thread,
}

impl Wake for Signal {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }
    fn wake_by_ref(self: &Arc<Self>) {
        self.woken.store(true, Ordering::Release);
        // Cheap when the thread is not parked (no system call).
        self.thread.unpark();
    }
}

/// Runs `fut` to completion on the calling thread with the GIL released:
/// other Python threads run meanwhile, the runtime's workers do the I/O.
///
/// Not tokio's `Runtime::block_on`: that one always sleeps until woken; this
/// one first spins for [`SPIN`] (yielding the CPU), which halves the latency
/// of a single small transfer.
pub(crate) fn block_on<F>(py: Python<'_>, fut: F) -> PyResult<F::Output>
where
    F: Future + Send,
    F::Output: Send,
{
    let rt = runtime()?;
    Ok(py.detach(|| run(rt, fut)))
}

/// The body of [`block_on`], for a caller that has already released the GIL.
pub(crate) fn run<F: Future>(rt: &Runtime, fut: F) -> F::Output {
    // Futures may use the runtime (timers, spawned tasks).
    let _guard = rt.enter();
    let signal = Arc::new(Signal {
        woken: AtomicBool::new(false),
        thread: std::thread::current(),
    });
    let waker = Waker::from(signal.clone());
    let mut cx = Context::from_waker(&waker);
    let mut fut = pin!(fut);
    loop {
        if let Poll::Ready(out) = fut.as_mut().poll(&mut cx) {
            return out;
        }
        let start = Instant::now();
        while !signal.woken.swap(false, Ordering::AcqRel) {
            if start.elapsed() < SPIN {
                std::thread::yield_now();
            } else {
                // `unpark` before `park` makes `park` return at once, so no
                // wake-up is lost between the check and the sleep.
                std::thread::park();
            }
        }
    }
}

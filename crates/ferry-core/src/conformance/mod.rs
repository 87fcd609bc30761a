//! The conformance suite every backend passes.
//!
//! One `pub async fn check_<behaviour>(factory, adapted) -> Outcome` per
//! behaviour. Each check builds its engines from an [`EngineFactory`]
//! (usually two: `a` opens `b`'s segment and issues the transfers), wraps
//! them in every layer Ferry ships ([`full_stack`]: tracing, metrics, a
//! per-call deadline, and a [`CapabilityAdapter`] with the default
//! configuration) when `adapted` is true, and panics with a message naming the broken rule when
//! the engine misbehaves. A check that needs an operation the engine (or the
//! adapter) does not offer returns [`Outcome::Skipped`] naming it — never a
//! silent pass.
//!
//! A backend instantiates every check as a `#[test]`, raw and adapted, with
//! [`conformance_tests!`](crate::conformance_tests):
//!
//! ```ignore
//! struct MyFactory;
//! #[async_trait::async_trait]
//! impl ferry_core::conformance::EngineFactory for MyFactory {
//!     async fn create(&self) -> ferry_core::Result<std::sync::Arc<dyn ferry_core::DynTransferEngine>> {
//!         Ok(std::sync::Arc::new(my_backend::Engine::start().await?))
//!     }
//! }
//! ferry_core::conformance_tests!(MyFactory);
//! ```
//!
//! which expands to `mod raw { #[test] fn register_unregister() … }` and the
//! same in `mod adapted`, one test per name in [`CHECKS`]. A skipped test
//! prints `skipped: <check>: <reason>`.

use crate::DynTransferEngine;
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;

use crate::adapter::{AdapterConfig, CapabilityAdapter};
use crate::buffer::HostBuffer;
use crate::caps::{Capabilities, Operation};
use crate::engine::TransferEngine;
use crate::error::{Error, Result, Side};
use crate::inproc::InprocEngine;
use crate::types::{
    BatchId, BatchReport, Location, MemoryRegion, Notification, SegmentId, TransferRequest,
    TransferState, MAX_NOTIFICATION_MESSAGE,
};

/// Makes fresh engines for the checks.
#[async_trait]
pub trait EngineFactory: Send + Sync + 'static {
    /// A fresh engine, reachable from other engines of the same factory via
    /// its `segment_name()`.
    ///
    /// `Err(Error::Unavailable{..})` means the backend cannot run on this
    /// machine (no library, no device): the checks skip, printing the reason,
    /// unless [`REQUIRE_BACKENDS_ENV`] lists that backend. Any other error is
    /// a broken factory or backend and fails the check.
    async fn create(&self) -> Result<Arc<dyn DynTransferEngine>>;

    /// A segment name that no engine answers to, for
    /// [`check_open_unknown_segment`]. Override it when the backend's names
    /// have a fixed shape (a network backend might return `127.0.0.1:1`).
    fn unknown_segment_name(&self) -> String {
        "ferry-conformance-no-such-segment".to_owned()
    }

    /// Makes `engine` (made by this factory, possibly wrapped in an
    /// adapter) refuse every notification its peers send it from now on,
    /// for [`check_notify_failure_after_data`]: the sender's data lands,
    /// the notification fails. `Ok(false)` when the backend has no way to do
    /// that (the check then skips, saying so).
    async fn refuse_notifications(&self, engine: &Arc<dyn DynTransferEngine>) -> Result<bool> {
        let _ = engine;
        Ok(false)
    }

    /// A check (by its name in [`CHECKS`]) that is known to hang on this
    /// backend, with the bug that makes it hang: the check is skipped,
    /// printing both, instead of holding the suite until its watchdog
    /// aborts the process. A stopgap for a bug being fixed, never a way to
    /// pass a check: a hang that is not listed still aborts.
    fn known_hang(&self, check: &str) -> Option<String> {
        let _ = check;
        None
    }
}

/// Result of a check that did not fail (failures panic).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Every assertion held.
    Passed,
    /// The check could not run; the reason names what was missing.
    Skipped(String),
}

/// Factory of [`InprocEngine`]s with the given native capabilities.
#[derive(Clone, Copy, Debug, Default)]
pub struct InprocFactory {
    /// Native capabilities of every engine made.
    pub caps: Capabilities,
    /// Pause of every engine after each copied chunk (see
    /// [`InprocEngine::set_pace`]).
    pub pace: Option<Duration>,
}

impl InprocFactory {
    /// A factory of engines with native capabilities `caps`.
    pub fn new(caps: Capabilities) -> Self {
        InprocFactory { caps, pace: None }
    }

    /// The same factory, with engines that pause `pace` after each chunk.
    pub fn paced(self, pace: Duration) -> Self {
        InprocFactory {
            pace: Some(pace),
            ..self
        }
    }
}

#[async_trait]
impl EngineFactory for InprocFactory {
    async fn create(&self) -> Result<Arc<dyn DynTransferEngine>> {
        let e = InprocEngine::auto(self.caps);
        e.set_pace(self.pace);
        Ok(Arc::new(e))
    }

    async fn refuse_notifications(&self, engine: &Arc<dyn DynTransferEngine>) -> Result<bool> {
        Ok(InprocEngine::refuse_notifications_of(
            engine.segment_name(),
            true,
        ))
    }
}

/// The name of every check, in the order the macro instantiates them. The
/// check function for `name` is `check_<name>`.
pub const CHECKS: &[&str] = &[
    "identity",
    "register_unregister",
    "overlap_refused",
    "write_read_round_trip",
    "capability_honesty",
    "remote_out_of_bounds",
    "local_unregistered",
    "zero_length",
    "unaligned",
    "unregister_in_flight",
    "first_poll",
    "batch_one",
    "batch_many",
    "batch_thousands",
    "async_batch",
    "notification",
    "batch_register_rollback",
    "unknown_segment",
    "open_unknown_segment",
    "finished_after_notification",
    "notify_failure_after_data",
    "cancellation",
    "awaited_notification",
    "shutdown",
];

/// Runs the check called `name` (one of [`CHECKS`]).
///
/// # Panics
///
/// If the check fails, or if `name` is not a check.
pub async fn run_check(name: &str, factory: Arc<dyn EngineFactory>, adapted: bool) -> Outcome {
    if let Some(bug) = factory.known_hang(name) {
        return Outcome::Skipped(format!("known to hang on this backend: {bug}"));
    }
    let f = factory;
    let a = adapted;
    match name {
        "identity" => check_identity(f, a).await,
        "register_unregister" => check_register_unregister(f, a).await,
        "overlap_refused" => check_overlap_refused(f, a).await,
        "write_read_round_trip" => check_write_read_round_trip(f, a).await,
        "capability_honesty" => check_capability_honesty(f, a).await,
        "remote_out_of_bounds" => check_remote_out_of_bounds(f, a).await,
        "local_unregistered" => check_local_unregistered(f, a).await,
        "zero_length" => check_zero_length(f, a).await,
        "unaligned" => check_unaligned(f, a).await,
        "unregister_in_flight" => check_unregister_in_flight(f, a).await,
        "first_poll" => check_first_poll(f, a).await,
        "batch_one" => check_batch_one(f, a).await,
        "batch_many" => check_batch_many(f, a).await,
        "batch_thousands" => check_batch_thousands(f, a).await,
        "async_batch" => check_async_batch(f, a).await,
        "notification" => check_notification(f, a).await,
        "batch_register_rollback" => check_batch_register_rollback(f, a).await,
        "unknown_segment" => check_unknown_segment(f, a).await,
        "open_unknown_segment" => check_open_unknown_segment(f, a).await,
        "finished_after_notification" => check_finished_after_notification(f, a).await,
        "notify_failure_after_data" => check_notify_failure_after_data(f, a).await,
        "cancellation" => check_cancellation(f, a).await,
        "awaited_notification" => check_awaited_notification(f, a).await,
        "shutdown" => check_shutdown(f, a).await,
        other => panic!("unknown conformance check {other:?}; known: {CHECKS:?}"),
    }
}

/// Longest one conformance check may run under [`__run_test`] before the
/// process is aborted with its name (a blocked runtime cannot panic).
pub const CHECK_DEADLINE: Duration = Duration::from_secs(15 * 60);

/// Runs `name` on a fresh multi-thread runtime and prints the skip line.
#[doc(hidden)]
pub fn __run_test(name: &str, factory: Arc<dyn EngineFactory>, adapted: bool) {
    __run_test_on(name, factory, adapted, false)
}

/// Runs `name` on a fresh runtime — multi-threaded (two workers), or with
/// `current_thread` a single-threaded one on which the engines, their
/// tasks and the check all share one thread (an engine that blocks or
/// spins inside its caller's runtime starves itself there) — and prints
/// the skip line; the body of every test
/// [`conformance_tests!`](crate::conformance_tests) generates.
#[doc(hidden)]
pub fn __run_test_on(
    name: &str,
    factory: Arc<dyn EngineFactory>,
    adapted: bool,
    current_thread: bool,
) {
    let rt = if current_thread {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
    } else {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
    }
    .expect("building a tokio runtime for a conformance test");
    let mode = match (adapted, current_thread) {
        (false, false) => "raw",
        (true, false) => "adapted",
        (false, true) => "raw, current_thread",
        (true, true) => "adapted, current_thread",
    };
    // A check that blocks its runtime cannot time itself out: after
    // CHECK_DEADLINE the process ends, saying which check hung, instead of
    // hanging its test run. The guard stops the watchdog however the check
    // ends (a failing check panics).
    struct Stop(Arc<std::sync::atomic::AtomicBool>, std::thread::Thread);
    impl Drop for Stop {
        fn drop(&mut self) {
            self.0.store(true, std::sync::atomic::Ordering::Release);
            self.1.unpark();
        }
    }
    let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let what = format!("{name} ({mode})");
    let flag = Arc::clone(&done);
    let watchdog = std::thread::spawn(move || {
        let start = std::time::Instant::now();
        while !flag.load(std::sync::atomic::Ordering::Acquire) {
            if start.elapsed() > CHECK_DEADLINE {
                eprintln!(
                    "conformance check {what} still running after {CHECK_DEADLINE:?}: aborting"
                );
                std::process::abort();
            }
            std::thread::park_timeout(Duration::from_millis(200));
        }
    });
    let stop = Stop(done, watchdog.thread().clone());
    let outcome = rt.block_on(run_check(name, factory, adapted));
    drop(stop);
    let _ = watchdog.join();
    match outcome {
        Outcome::Passed => {}
        Outcome::Skipped(reason) => report_skip(&format!("{name}: {reason} ({mode})")),
    }
}

/// The environment variable listing the backends that must run: a
/// comma-separated list of backend names (`inproc,tcp,mooncake,verbs`).
///
/// A test that finds a listed backend [`Error::Unavailable`] fails, with the
/// reason, instead of skipping. CI sets it for every backend its machine can
/// reach, so that a backend that silently stops starting cannot turn its
/// tests into skips.
pub const REQUIRE_BACKENDS_ENV: &str = "FERRY_REQUIRE_BACKENDS";

/// Whether [`REQUIRE_BACKENDS_ENV`] lists `backend` (case-insensitive).
pub fn backend_required(backend: &str) -> bool {
    std::env::var(REQUIRE_BACKENDS_ENV).is_ok_and(|list| {
        list.split(',')
            .any(|b| b.trim().eq_ignore_ascii_case(backend.trim()))
    })
}

/// The one skip policy of every test in the workspace that needs a backend:
/// `what` (a test name) could not get an engine because of `err`.
///
/// Returns the skip reason when `err` is [`Error::Unavailable`] for a
/// backend that [`REQUIRE_BACKENDS_ENV`] does not list, after printing
/// `skipped: <what>: <reason>` with [`report_skip`].
///
/// # Panics
///
/// When `err` is any other error (a broken factory or start-up is a
/// failure, never a skip), or when the unavailable backend is required.
#[track_caller]
pub fn skip_unavailable(what: &str, err: &Error) -> String {
    let reason = unavailable_reason(what, err);
    report_skip(&format!("{what}: {reason}"));
    reason
}

/// A factory error as a check's outcome: [`Outcome::Skipped`] for a backend
/// that is unavailable and not required, a panic otherwise (see
/// [`skip_unavailable`]). The skip line itself is printed by the test body.
#[track_caller]
fn factory_failed(err: &Error) -> Outcome {
    Outcome::Skipped(unavailable_reason("the engine factory", err))
}

/// The skip reason for `err` if it may skip, else a panic naming `what`.
#[track_caller]
fn unavailable_reason(what: &str, err: &Error) -> String {
    match err {
        Error::Unavailable { backend, .. } if backend_required(backend) => panic!(
            "{what}: the {backend} backend is listed in {REQUIRE_BACKENDS_ENV} but is \
             unavailable: {err}"
        ),
        Error::Unavailable { .. } => err.to_string(),
        other => panic!("{what} failed (only Unavailable may skip): {other}"),
    }
}

/// Prints `skipped: <what>` where a person running the tests sees it.
///
/// It writes to the process's standard error directly rather than through
/// `println!`, which the test harness captures (and hides) for tests that
/// pass: a skipped check must never look like a silent pass.
pub fn report_skip(what: &str) {
    use std::io::Write as _;
    let _ = writeln!(std::io::stderr().lock(), "skipped: {what}");
}

/// `n` writes of `block` bytes: block `i` of `src` to block `2 i` of
/// `dst`, a block-sized gap after each destination, so that no layer can
/// merge the requests into fewer, larger ones (a batch of them is
/// forwarded as it is). `dst` needs `2 n block` bytes.
pub fn scattered_writes(src: u64, dst: u64, block: usize, n: usize) -> Vec<TransferRequest> {
    (0..n)
        .map(|i| {
            TransferRequest::write(
                src + (i * block) as u64,
                dst + (2 * i * block) as u64,
                block as u64,
            )
        })
        .collect()
}

/// Instantiates every conformance check as a `#[test]`, in `mod raw` (the
/// engines as the factory makes them) and `mod adapted` (each wrapped in
/// every layer: [`full_stack`](crate::conformance::full_stack)).
///
/// The argument is an expression whose type implements
/// [`EngineFactory`](crate::conformance::EngineFactory); it is evaluated once
/// per test inside the generated modules, which `use super::*`.
#[macro_export]
macro_rules! conformance_tests {
    ($factory:expr) => {
        $crate::__conformance_mode!(raw, false, false, $factory);
        $crate::__conformance_mode!(adapted, true, false, $factory);
    };
    (current_thread, $factory:expr) => {
        $crate::__conformance_mode!(raw, false, true, $factory);
        $crate::__conformance_mode!(adapted, true, true, $factory);
    };
}

#[doc(hidden)]
#[macro_export]
macro_rules! __conformance_mode {
    ($mode:ident, $adapted:expr, $current:expr, $factory:expr) => {
        mod $mode {
            #[allow(unused_imports)]
            use super::*;
            $crate::__conformance_cases!($adapted, $current, $factory;
                identity,
                register_unregister,
                overlap_refused,
                write_read_round_trip,
                capability_honesty,
                remote_out_of_bounds,
                local_unregistered,
                zero_length,
                unaligned,
                unregister_in_flight,
                first_poll,
                batch_one,
                batch_many,
                batch_thousands,
                async_batch,
                notification,
                batch_register_rollback,
                unknown_segment,
                open_unknown_segment,
                finished_after_notification,
                notify_failure_after_data,
                cancellation,
                awaited_notification,
                shutdown
            );
        }
    };
}

#[doc(hidden)]
#[macro_export]
macro_rules! __conformance_cases {
    ($adapted:expr, $current:expr, $factory:expr; $($name:ident),* $(,)?) => {
        $(
            #[test]
            fn $name() {
                let factory: ::std::sync::Arc<dyn $crate::conformance::EngineFactory> =
                    ::std::sync::Arc::new($factory);
                $crate::conformance::__run_test_on(
                    ::std::stringify!($name),
                    factory,
                    $adapted,
                    $current,
                );
            }
        )*
    };
}

mod basics;
mod batches;
mod cancellation;
mod harness;
mod notifications;
mod rules;
mod segments;
mod shutdown;
mod transfers;

pub use basics::{
    check_capability_honesty, check_identity, check_overlap_refused, check_register_unregister,
    check_write_read_round_trip,
};
pub use batches::{check_async_batch, check_batch_many, check_batch_one, check_batch_thousands};
pub use cancellation::check_cancellation;
pub use harness::{full_stack, pattern};
pub use notifications::{check_awaited_notification, check_notification};
pub use rules::{check_finished_after_notification, check_notify_failure_after_data};
pub use segments::{
    check_batch_register_rollback, check_open_unknown_segment, check_unknown_segment,
};
pub use shutdown::check_shutdown;
pub use transfers::{
    check_first_poll, check_local_unregistered, check_remote_out_of_bounds, check_unaligned,
    check_unregister_in_flight, check_zero_length,
};

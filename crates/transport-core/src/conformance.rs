//! The conformance suite every backend passes.
//!
//! One `pub async fn check_<behaviour>(factory, adapted) -> Outcome` per
//! behaviour. Each check builds its engines from an [`EngineFactory`]
//! (usually two: `a` opens `b`'s segment and issues the transfers), wraps
//! them in a [`CapabilityAdapter`] with the default configuration when
//! `adapted` is true, and panics with a message naming the broken rule when
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
//! impl transport_core::conformance::EngineFactory for MyFactory {
//!     async fn create(&self) -> transport_core::Result<std::sync::Arc<dyn transport_core::TransferEngine>> {
//!         Ok(std::sync::Arc::new(my_backend::Engine::start().await?))
//!     }
//! }
//! transport_core::conformance_tests!(MyFactory);
//! ```
//!
//! which expands to `mod raw { #[test] fn register_unregister() … }` and the
//! same in `mod adapted`, one test per name in [`CHECKS`]. A skipped test
//! prints `skipped: <check>: <reason>`.

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
    async fn create(&self) -> Result<Arc<dyn TransferEngine>>;

    /// A segment name that no engine answers to, for
    /// [`check_open_unknown_segment`]. Override it when the backend's names
    /// have a fixed shape (a network backend might return `127.0.0.1:1`).
    fn unknown_segment_name(&self) -> String {
        "ferry-conformance-no-such-segment".to_owned()
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
    async fn create(&self) -> Result<Arc<dyn TransferEngine>> {
        let e = InprocEngine::auto(self.caps);
        e.set_pace(self.pace);
        Ok(Arc::new(e))
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
    "batch_one",
    "batch_many",
    "batch_thousands",
    "async_batch",
    "notification",
    "batch_register_rollback",
    "unknown_segment",
    "open_unknown_segment",
];

/// Runs the check called `name` (one of [`CHECKS`]).
///
/// # Panics
///
/// If the check fails, or if `name` is not a check.
pub async fn run_check(name: &str, factory: Arc<dyn EngineFactory>, adapted: bool) -> Outcome {
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
        "batch_one" => check_batch_one(f, a).await,
        "batch_many" => check_batch_many(f, a).await,
        "batch_thousands" => check_batch_thousands(f, a).await,
        "async_batch" => check_async_batch(f, a).await,
        "notification" => check_notification(f, a).await,
        "batch_register_rollback" => check_batch_register_rollback(f, a).await,
        "unknown_segment" => check_unknown_segment(f, a).await,
        "open_unknown_segment" => check_open_unknown_segment(f, a).await,
        other => panic!("unknown conformance check {other:?}; known: {CHECKS:?}"),
    }
}

/// Runs `name` on a fresh multi-thread runtime and prints the skip line; the
/// body of every test [`conformance_tests!`](crate::conformance_tests)
/// generates.
#[doc(hidden)]
pub fn __run_test(name: &str, factory: Arc<dyn EngineFactory>, adapted: bool) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("building a tokio runtime for a conformance test");
    let mode = if adapted { "adapted" } else { "raw" };
    match rt.block_on(run_check(name, factory, adapted)) {
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

/// Instantiates every conformance check as a `#[test]`, in `mod raw` (the
/// engines as the factory makes them) and `mod adapted` (each wrapped in a
/// default [`CapabilityAdapter`](crate::CapabilityAdapter)).
///
/// The argument is an expression whose type implements
/// [`EngineFactory`](crate::conformance::EngineFactory); it is evaluated once
/// per test inside the generated modules, which `use super::*`.
#[macro_export]
macro_rules! conformance_tests {
    ($factory:expr) => {
        $crate::__conformance_mode!(raw, false, $factory);
        $crate::__conformance_mode!(adapted, true, $factory);
    };
}

#[doc(hidden)]
#[macro_export]
macro_rules! __conformance_mode {
    ($mode:ident, $adapted:expr, $factory:expr) => {
        mod $mode {
            #[allow(unused_imports)]
            use super::*;
            $crate::__conformance_cases!($adapted, $factory;
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
                batch_one,
                batch_many,
                batch_thousands,
                async_batch,
                notification,
                batch_register_rollback,
                unknown_segment,
                open_unknown_segment
            );
        }
    };
}

#[doc(hidden)]
#[macro_export]
macro_rules! __conformance_cases {
    ($adapted:expr, $factory:expr; $($name:ident),* $(,)?) => {
        $(
            #[test]
            fn $name() {
                let factory: ::std::sync::Arc<dyn $crate::conformance::EngineFactory> =
                    ::std::sync::Arc::new($factory);
                $crate::conformance::__run_test(::std::stringify!($name), factory, $adapted);
            }
        )*
    };
}

// ---------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------

/// Upper bound on waiting for something that must eventually happen (a batch
/// finishing, a notification arriving). A liveness guard, not a timing
/// assertion: hitting it means the engine lost the event.
const LIVENESS: Duration = Duration::from_secs(120);

type Setup<T> = std::result::Result<T, Outcome>;

async fn engine(factory: &Arc<dyn EngineFactory>, adapted: bool) -> Setup<Arc<dyn TransferEngine>> {
    let raw = factory.create().await.map_err(|e| factory_failed(&e))?;
    Ok(if adapted {
        Arc::new(CapabilityAdapter::from_arc(raw, AdapterConfig::default()))
    } else {
        raw
    })
}

/// Two engines; `a` has opened `b`'s segment as `seg`.
struct Pair {
    a: Arc<dyn TransferEngine>,
    b: Arc<dyn TransferEngine>,
    seg: SegmentId,
}

async fn pair(factory: &Arc<dyn EngineFactory>, adapted: bool) -> Setup<Pair> {
    let a = engine(factory, adapted).await?;
    let b = engine(factory, adapted).await?;
    assert_ne!(
        a.segment_name(),
        b.segment_name(),
        "two engines of one factory have the same segment name"
    );
    let seg = a.open_segment(b.segment_name()).await.unwrap_or_else(|e| {
        panic!(
            "engine {} could not open the segment of engine {}: {e}",
            a.segment_name(),
            b.segment_name()
        )
    });
    Ok(pair_from(a, b, seg))
}

fn pair_from(a: Arc<dyn TransferEngine>, b: Arc<dyn TransferEngine>, seg: SegmentId) -> Pair {
    Pair { a, b, seg }
}

/// Deterministic, non-periodic test bytes.
pub fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        out.extend_from_slice(&x.to_le_bytes());
    }
    out.truncate(len);
    out
}

/// Host memory for a check. It is registered with `engine` (whole, or in
/// pieces) and must be [`Mem::release`]d; if a failing check drops it while
/// registered, the memory is leaked instead of freed, so a misbehaving
/// engine cannot write into freed memory.
struct Mem {
    engine: Arc<dyn TransferEngine>,
    buf: Option<HostBuffer>,
    registered: Vec<u64>,
}

impl Mem {
    /// `len` bytes filled with `pattern(seed)` (seed 0: zeros), registered
    /// whole.
    async fn new(engine: &Arc<dyn TransferEngine>, len: usize, seed: u64) -> Mem {
        let mut m = Mem::unregistered(engine, len, seed);
        m.register(0, len).await;
        m
    }

    /// `len` bytes filled with `pattern(seed)` (seed 0: zeros), not registered.
    fn unregistered(engine: &Arc<dyn TransferEngine>, len: usize, seed: u64) -> Mem {
        let buf = HostBuffer::new(len).expect("allocating test memory");
        if seed != 0 {
            buf.write(0, &pattern(seed, len))
                .expect("filling test memory");
        }
        Mem {
            engine: Arc::clone(engine),
            buf: Some(buf),
            registered: Vec::new(),
        }
    }

    fn buf(&self) -> &HostBuffer {
        self.buf.as_ref().expect("test memory already released")
    }

    fn region(&self, offset: usize, len: usize) -> MemoryRegion {
        assert!(offset + len <= self.buf().len());
        // SAFETY: the range lies inside `buf`, which stays allocated until
        // every registration made through `Mem` is undone (or is leaked).
        unsafe {
            MemoryRegion::from_raw_parts(self.buf().as_ptr().add(offset), len, Location::cpu(0))
        }
    }

    async fn register(&mut self, offset: usize, len: usize) {
        let region = self.region(offset, len);
        self.engine
            .register(&region)
            .await
            .unwrap_or_else(|e| panic!("register of {:#x}+{len} failed: {e}", region.addr()));
        self.registered.push(region.addr());
    }

    async fn unregister(&mut self, offset: usize) {
        let addr = self.at(offset);
        self.engine
            .unregister(addr)
            .await
            .unwrap_or_else(|e| panic!("unregister of {addr:#x} failed: {e}"));
        self.registered.retain(|a| *a != addr);
    }

    /// Marks the registration at `offset` as undone by other means.
    fn forget_registration(&mut self, offset: usize) {
        let addr = self.at(offset);
        self.registered.retain(|a| *a != addr);
    }

    fn at(&self, offset: usize) -> u64 {
        self.buf().addr() + offset as u64
    }
    fn addr(&self) -> u64 {
        self.at(0)
    }
    fn len(&self) -> usize {
        self.buf().len()
    }
    fn end(&self) -> u64 {
        self.addr() + self.len() as u64
    }
    fn bytes(&self) -> Vec<u8> {
        self.buf().to_vec()
    }
    fn write(&self, offset: usize, data: &[u8]) {
        self.buf().write(offset, data).expect("writing test memory");
    }

    /// Unregisters what is still registered, then frees the memory.
    async fn release(mut self) {
        for addr in std::mem::take(&mut self.registered) {
            self.engine
                .unregister(addr)
                .await
                .unwrap_or_else(|e| panic!("unregister of {addr:#x} failed: {e}"));
        }
        drop(self.buf.take());
    }
}

impl Drop for Mem {
    fn drop(&mut self) {
        if !self.registered.is_empty() {
            // Still registered (a check panicked): never free memory an
            // engine may still write.
            std::mem::forget(self.buf.take());
        }
    }
}

fn is_unsupported(r: &Result<impl Sized>) -> bool {
    matches!(r, Err(Error::Unsupported { .. }))
}

#[track_caller]
fn expect_addr_err<T: std::fmt::Debug>(r: Result<T>, side: Option<Side>, what: &str) {
    match r {
        Err(Error::AddressNotRegistered { side: s, .. }) if side.is_none_or(|x| x == s) => {}
        other => panic!(
            "{what}: expected AddressNotRegistered{} , got {other:?}",
            side.map(|s| format!(" ({s} side)")).unwrap_or_default()
        ),
    }
}

/// How a check runs a batch on an engine.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum BatchPath {
    Sync,
    Async,
}

fn batch_path(caps: &Capabilities) -> Option<BatchPath> {
    if caps.batch_transfer {
        Some(BatchPath::Sync)
    } else if caps.async_batch {
        Some(BatchPath::Async)
    } else {
        None
    }
}

const NEEDS_BATCH: &str = "needs batch_transfer or async_batch";

/// Waits for a submitted batch: `wait` when declared, else `status` polling
/// and `release_batch`.
async fn finish(e: &Arc<dyn TransferEngine>, id: BatchId) -> BatchReport {
    if e.capabilities().batch_wait {
        return e
            .wait(id)
            .await
            .unwrap_or_else(|err| panic!("wait({id}) failed: {err}"));
    }
    let report = poll_until(&format!("batch {id} to finish"), || async {
        let st = e
            .status(id)
            .unwrap_or_else(|err| panic!("status({id}) failed: {err}"));
        st.to_report()
    })
    .await;
    e.release_batch(id)
        .await
        .unwrap_or_else(|err| panic!("release_batch({id}) of a finished batch failed: {err}"));
    report
}

/// Polls `f` until it returns `Some`, sleeping briefly between tries; panics
/// after [`LIVENESS`].
async fn poll_until<T, F, Fut>(what: &str, mut f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let start = Instant::now();
    let mut tries = 0u32;
    loop {
        if let Some(v) = f().await {
            return v;
        }
        assert!(
            start.elapsed() < LIVENESS,
            "gave up waiting for {what} after {LIVENESS:?}"
        );
        tries += 1;
        if tries < 8 {
            tokio::task::yield_now().await;
        } else {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }
}

/// Runs `requests` as one batch (splitting by the declared `max_batch_len`),
/// through `batch_transfer` or `submit`; `Err` = refused as a whole.
async fn batch(
    e: &Arc<dyn TransferEngine>,
    seg: SegmentId,
    requests: &[TransferRequest],
    notify: Option<&Notification>,
) -> Result<BatchReport> {
    let caps = e.capabilities();
    let path = batch_path(&caps).expect("batch() called without a batch path");
    let max = caps.max_batch_len.unwrap_or(usize::MAX).max(1);
    let mut parts: Vec<&[TransferRequest]> = requests.chunks(max).collect();
    if parts.is_empty() {
        parts.push(&[]);
    }
    let last = parts.len() - 1;
    let mut results = Vec::with_capacity(requests.len());
    for (i, part) in parts.into_iter().enumerate() {
        let note = if i == last { notify } else { None };
        let report = match path {
            BatchPath::Sync => e.batch_transfer(seg, part, note).await?,
            BatchPath::Async => {
                let id = e.submit(seg, part, note).await?;
                finish(e, id).await
            }
        };
        assert_eq!(
            report.len(),
            part.len(),
            "a batch report must hold one result per request"
        );
        results.extend(report.results);
    }
    Ok(BatchReport { results })
}

#[track_caller]
fn assert_all_ok(report: &BatchReport, what: &str) {
    if let Some((i, e)) = report.failures().next() {
        panic!(
            "{what}: request {i} failed ({} of {} failed): {e}",
            report.failures().count(),
            report.len()
        );
    }
}

#[track_caller]
fn assert_bytes(actual: &[u8], expected: &[u8], what: &str) {
    assert_eq!(actual.len(), expected.len(), "{what}: length differs");
    if actual == expected {
        return;
    }
    if let Some(i) = actual.iter().zip(expected).position(|(a, b)| a != b) {
        let n = actual.iter().zip(expected).filter(|(a, b)| a != b).count();
        panic!(
            "{what}: {n} bytes differ, first at offset {i} (got {:#04x}, expected {:#04x})",
            actual[i], expected[i]
        );
    }
}

// ---------------------------------------------------------------------------
// Checks
// ---------------------------------------------------------------------------

/// Engines have a backend name and distinct, non-empty segment names;
/// capabilities are stable across calls.
pub async fn check_identity(factory: Arc<dyn EngineFactory>, adapted: bool) -> Outcome {
    let p = match pair(&factory, adapted).await {
        Ok(p) => p,
        Err(o) => return o,
    };
    assert!(!p.a.backend_name().is_empty(), "backend_name is empty");
    assert!(!p.a.segment_name().is_empty(), "segment_name is empty");
    assert_eq!(p.a.capabilities(), p.a.capabilities());
    assert_eq!(p.a.backend_info().backend, p.a.backend_name());
    p.a.close_segment(p.seg)
        .await
        .unwrap_or_else(|e| panic!("close_segment failed: {e}"));
    Outcome::Passed
}

/// Register / unregister one region; double unregister and empty regions
/// are refused; a peer cannot reach a region after it is unregistered.
pub async fn check_register_unregister(factory: Arc<dyn EngineFactory>, adapted: bool) -> Outcome {
    let p = match pair(&factory, adapted).await {
        Ok(p) => p,
        Err(o) => return o,
    };
    let src = Mem::new(&p.a, 4096, 1).await;
    let mut dst = Mem::new(&p.b, 8192, 0).await;
    let addr = dst.addr();
    p.a.transfer(p.seg, TransferRequest::write(src.addr(), addr, 4096))
        .await
        .unwrap_or_else(|e| panic!("write into a registered region failed: {e}"));
    dst.unregister(0).await;
    match p.b.unregister(addr).await {
        Err(Error::RegionNotRegistered { addr: a }) if a == addr => {}
        other => panic!("second unregister: expected RegionNotRegistered, got {other:?}"),
    }
    match p.b.unregister(addr + 16).await {
        Err(Error::RegionNotRegistered { .. }) => {}
        other => panic!("unregister of an address where no region starts: expected RegionNotRegistered, got {other:?}"),
    }
    let before = dst.bytes();
    expect_addr_err(
        p.a.transfer(p.seg, TransferRequest::write(src.addr(), addr, 4096))
            .await,
        Some(Side::Remote),
        "write into an unregistered region",
    );
    assert_bytes(&dst.bytes(), &before, "an unregistered region was written");
    // SAFETY: a zero-length region; nothing is ever accessed through it.
    let empty = unsafe { MemoryRegion::from_raw_parts(dst.buf().as_ptr(), 0, Location::cpu(0)) };
    match p.b.register(&empty).await {
        Err(Error::InvalidArgument(_)) => {}
        other => panic!("register of an empty region: expected InvalidArgument, got {other:?}"),
    }
    // Registering again after unregister works.
    dst.register(0, 8192).await;
    p.a.transfer(p.seg, TransferRequest::write(src.addr(), addr + 4096, 4096))
        .await
        .unwrap_or_else(|e| panic!("write after re-register failed: {e}"));
    assert_bytes(
        &dst.bytes()[4096..],
        &src.bytes(),
        "write after re-register",
    );
    src.release().await;
    dst.release().await;
    Outcome::Passed
}

/// A region that shares a byte with a registered one is refused with
/// `RegionOverlap`; adjacent regions are fine.
pub async fn check_overlap_refused(factory: Arc<dyn EngineFactory>, adapted: bool) -> Outcome {
    let e = match engine(&factory, adapted).await {
        Ok(e) => e,
        Err(o) => return o,
    };
    let mut m = Mem::unregistered(&e, 4 * 4096, 0);
    m.register(4096, 8192).await;
    for (off, len, what) in [
        (4096, 8192, "the same region"),
        (0, 4097, "a region overlapping its first byte"),
        (12287, 4097, "a region overlapping its last byte"),
        (6000, 100, "a region inside it"),
        (0, 16384, "a region containing it"),
    ] {
        match e.register(&m.region(off, len)).await {
            Err(Error::RegionOverlap {
                existing_addr,
                existing_len,
                ..
            }) => {
                assert_eq!(
                    existing_addr,
                    m.at(4096),
                    "RegionOverlap names the wrong region"
                );
                assert_eq!(existing_len, 8192, "RegionOverlap names the wrong length");
            }
            other => panic!("register of {what}: expected RegionOverlap, got {other:?}"),
        }
    }
    m.register(0, 4096).await;
    m.register(12288, 4096).await;
    m.release().await;
    Outcome::Passed
}

/// Writes land byte for byte in the peer's memory; reads bring them back.
pub async fn check_write_read_round_trip(
    factory: Arc<dyn EngineFactory>,
    adapted: bool,
) -> Outcome {
    let p = match pair(&factory, adapted).await {
        Ok(p) => p,
        Err(o) => return o,
    };
    const N: usize = 256 * 1024;
    let src = Mem::new(&p.a, N, 11).await;
    let back = Mem::new(&p.a, N, 0).await;
    let dst = Mem::new(&p.b, N, 0).await;
    p.a.transfer(
        p.seg,
        TransferRequest::write(src.addr(), dst.addr(), N as u64),
    )
    .await
    .unwrap_or_else(|e| panic!("write of {N} bytes failed: {e}"));
    assert_bytes(&dst.bytes(), &src.bytes(), "peer memory after a write");
    // Overwrite a middle part with a different part of the source.
    p.a.transfer(
        p.seg,
        TransferRequest::write(src.at(1000), dst.at(50_000), 70_000),
    )
    .await
    .unwrap_or_else(|e| panic!("write at an offset failed: {e}"));
    let mut model = src.bytes();
    model.copy_within(1000..71_000, 50_000);
    assert_bytes(
        &dst.bytes(),
        &model,
        "peer memory after a write at an offset",
    );
    p.a.transfer(
        p.seg,
        TransferRequest::read(back.addr(), dst.addr(), N as u64),
    )
    .await
    .unwrap_or_else(|e| panic!("read of {N} bytes failed: {e}"));
    assert_bytes(&back.bytes(), &model, "local memory after a read");
    // The source was never changed by any of this.
    assert_bytes(&src.bytes(), &pattern(11, N), "source memory");
    src.release().await;
    back.release().await;
    dst.release().await;
    Outcome::Passed
}

/// What a default adapter must report over each native capability set a
/// backend of this workspace declares, written out by hand rather than
/// computed by the adapter's own rules, so that the check can disagree with
/// the adapter.
///
/// Columns, in [`Operation::OPTIONAL`] order: batch_register,
/// batch_unregister, batch_transfer, async_batch, batch_wait, notify (`y` =
/// available, `-` = not). The adapter emulates every batch operation; it
/// cannot add notifications, and keeps them only when a native batch path
/// (batch_transfer or async_batch) exists to carry them.
const EXPECTED_EFFECTIVE: &[(&str, &str)] = &[
    // inproc `none`; nothing native.
    ("------", "yyyyy-"),
    // inproc `all`, tcp, Mooncake ≥ v0.3.5.
    ("yyyyyy", "yyyyyy"),
    // Mooncake v0.2.0 and v0.3.0: every batch call, no notify.
    ("yyyyy-", "yyyyy-"),
    // verbs: batches and notify, registration one region at a time.
    ("--yyyy", "yyyyyy"),
    // inproc `async_notify`.
    ("---y-y", "yyyyyy"),
    // inproc `only_*`.
    ("y-----", "yyyyy-"),
    ("-y----", "yyyyy-"),
    ("--y---", "yyyyy-"),
    ("---y--", "yyyyy-"),
    ("----y-", "yyyyy-"),
    // notify without any native batch path to carry it is dropped.
    ("-----y", "yyyyy-"),
];

/// The six optional-operation flags of `caps` as in [`EXPECTED_EFFECTIVE`].
fn caps_flags(caps: &Capabilities) -> String {
    Operation::OPTIONAL
        .iter()
        .map(|op| if caps.supports(*op) { 'y' } else { '-' })
        .collect()
}

/// The effective set [`EXPECTED_EFFECTIVE`] gives for `native`: its flags,
/// no batch-length limit (the adapter splits batches), the same memory kinds.
///
/// # Panics
///
/// When the table has no row for `native`: add one, worked out by hand.
fn expected_effective(native: &Capabilities) -> Capabilities {
    let key = caps_flags(native);
    let Some((_, flags)) = EXPECTED_EFFECTIVE.iter().find(|(n, _)| *n == key) else {
        panic!(
            "conformance::EXPECTED_EFFECTIVE has no row for native capabilities {key}: \
             add one, worked out by hand"
        )
    };
    // Guarantees pass through the adapter unchanged: it cannot add them.
    let mut eff = Capabilities {
        max_batch_len: None,
        memory: native.memory,
        landed_writes: native.landed_writes,
        peer_validation: native.peer_validation,
        ..Capabilities::default()
    };
    for (op, flag) in Operation::OPTIONAL.iter().zip(flags.chars()) {
        eff.set(*op, flag == 'y');
    }
    eff
}

/// Every declared optional operation works (never `Unsupported`); every
/// undeclared one answers `Unsupported`. Through the adapter the declared set
/// is the effective one, which must equal the hand-written
/// [`EXPECTED_EFFECTIVE`] row of the native set.
pub async fn check_capability_honesty(factory: Arc<dyn EngineFactory>, adapted: bool) -> Outcome {
    let (a_raw, b_raw) = match (factory.create().await, factory.create().await) {
        (Ok(a), Ok(b)) => (a, b),
        (Err(e), _) | (_, Err(e)) => return factory_failed(&e),
    };
    let native = a_raw.capabilities();
    let (a, b): (Arc<dyn TransferEngine>, Arc<dyn TransferEngine>) = if adapted {
        (
            Arc::new(CapabilityAdapter::from_arc(a_raw, AdapterConfig::default())),
            Arc::new(CapabilityAdapter::from_arc(b_raw, AdapterConfig::default())),
        )
    } else {
        (a_raw, b_raw)
    };
    let caps = a.capabilities();
    if adapted {
        let expected = expected_effective(&native);
        assert_eq!(
            caps,
            expected,
            "a default adapter over native {} reports {} instead of {}",
            caps_flags(&native),
            caps_flags(&caps),
            caps_flags(&expected)
        );
    }
    let seg = a
        .open_segment(b.segment_name())
        .await
        .unwrap_or_else(|e| panic!("open_segment failed: {e}"));
    let src = Mem::new(&a, 4096, 5).await;
    let dst = Mem::new(&b, 4096, 0).await;
    let one = [TransferRequest::write(src.addr(), dst.addr(), 64)];

    #[track_caller]
    fn honest<T: std::fmt::Debug>(declared: bool, r: &Result<T>, op: Operation, call: &str) {
        if declared {
            assert!(
                !is_unsupported(r),
                "{op} is declared but {call} answered Unsupported: {r:?}"
            );
        } else {
            match r {
                Err(Error::Unsupported { operation, .. }) => assert_eq!(
                    *operation, op,
                    "{call}: Unsupported names the wrong operation"
                ),
                other => {
                    panic!("{op} is not declared but {call} did not answer Unsupported: {other:?}")
                }
            }
        }
    }

    // batch_register / batch_unregister
    let extra = Mem::unregistered(&a, 8192, 0);
    let regions = [extra.region(0, 4096), extra.region(4096, 4096)];
    let r = a.batch_register(&regions).await;
    honest(
        caps.batch_register,
        &r,
        Operation::BatchRegister,
        "batch_register",
    );
    if let Err(e) = &r {
        if caps.batch_register {
            panic!("batch_register of two fresh regions failed: {e}");
        }
    }
    let addrs = [regions[0].addr(), regions[1].addr()];
    if caps.batch_register {
        let r = a.batch_unregister(&addrs).await;
        honest(
            caps.batch_unregister,
            &r,
            Operation::BatchUnregister,
            "batch_unregister",
        );
        if r.is_err() {
            for addr in addrs {
                a.unregister(addr)
                    .await
                    .unwrap_or_else(|e| panic!("unregister failed: {e}"));
            }
        }
    } else {
        let r = a.batch_unregister(&addrs).await;
        // Nothing is registered: a declared batch_unregister answers
        // RegionNotRegistered, an undeclared one Unsupported.
        honest(
            caps.batch_unregister,
            &r,
            Operation::BatchUnregister,
            "batch_unregister",
        );
    }
    drop(extra);

    // batch_transfer
    let r = a.batch_transfer(seg, &one, None).await;
    honest(
        caps.batch_transfer,
        &r,
        Operation::BatchTransfer,
        "batch_transfer",
    );
    if caps.batch_transfer {
        assert_all_ok(&r.expect("checked above"), "batch_transfer of one request");
    }

    // submit / status / release_batch / wait
    let r = a.submit(seg, &one, None).await;
    honest(caps.async_batch, &r, Operation::AsyncBatch, "submit");
    let never = BatchId(u64::MAX);
    honest(
        caps.async_batch,
        &a.status(never),
        Operation::AsyncBatch,
        "status",
    );
    if let Ok(id) = r {
        let st = a.status(id);
        assert!(st.is_ok(), "status of a fresh batch failed: {st:?}");
        let w = a.wait(id).await;
        honest(caps.batch_wait, &w, Operation::BatchWait, "wait");
        match w {
            Ok(report) => assert_all_ok(&report, "waited batch of one request"),
            Err(_) => {
                let report = finish(&a, id).await;
                assert_all_ok(&report, "polled batch of one request");
            }
        }
    } else {
        honest(
            caps.async_batch,
            &a.release_batch(never).await,
            Operation::AsyncBatch,
            "release_batch",
        );
        // wait without async batches must not pretend to work.
        assert!(
            a.wait(never).await.is_err(),
            "wait on a never-issued batch succeeded"
        );
    }

    // notifications
    let r = b.take_notifications().await;
    honest(caps.notify, &r, Operation::Notify, "take_notifications");
    let note = Notification::new("honesty", "n");
    if caps.batch_transfer {
        let r = a.batch_transfer(seg, &one, Some(&note)).await;
        honest(
            caps.notify,
            &r,
            Operation::Notify,
            "batch_transfer with a notification",
        );
    }
    if caps.async_batch {
        let r = a.submit(seg, &one, Some(&note)).await;
        honest(
            caps.notify,
            &r,
            Operation::Notify,
            "submit with a notification",
        );
        if let Ok(id) = r {
            finish(&a, id).await;
        }
    }
    a.close_segment(seg)
        .await
        .unwrap_or_else(|e| panic!("close_segment failed: {e}"));
    src.release().await;
    dst.release().await;
    Outcome::Passed
}

/// A remote range outside the peer's registered regions (straddling an end,
/// before, after, wrapping, straddling two adjacent regions) fails with
/// `AddressNotRegistered` and changes no byte on either side.
pub async fn check_remote_out_of_bounds(factory: Arc<dyn EngineFactory>, adapted: bool) -> Outcome {
    let p = match pair(&factory, adapted).await {
        Ok(p) => p,
        Err(o) => return o,
    };
    let local = Mem::new(&p.a, 8192, 21).await;
    // Remote: 3 pages; pages 0 and 1 registered as two adjacent regions,
    // page 2 unregistered.
    let mut remote = Mem::unregistered(&p.b, 3 * 4096, 22);
    remote.register(0, 4096).await;
    remote.register(4096, 4096).await;
    let r0 = remote.addr();
    let cases: [(u64, u64, &str); 7] = [
        (r0 + 8192 - 8, 16, "straddling the end of the last region"),
        (r0 + 8192, 8, "just past the last region"),
        (r0.wrapping_sub(8), 16, "straddling the start"),
        (r0 + 4096 - 8, 16, "straddling two adjacent regions"),
        (u64::MAX - 4, 16, "wrapping around the address space"),
        (0, 16, "at address 0"),
        (r0 + 100, 8192, "starting inside but longer than the region"),
    ];
    let local_before = local.bytes();
    let remote_before = remote.bytes();
    for (addr, len, what) in cases {
        let w =
            p.a.transfer(p.seg, TransferRequest::write(local.addr(), addr, len))
                .await;
        expect_addr_err(w, Some(Side::Remote), &format!("write {what}"));
        let r =
            p.a.transfer(p.seg, TransferRequest::read(local.addr(), addr, len))
                .await;
        expect_addr_err(r, Some(Side::Remote), &format!("read {what}"));
        assert_bytes(
            &remote.bytes(),
            &remote_before,
            &format!("peer memory after a write {what}"),
        );
        assert_bytes(
            &local.bytes(),
            &local_before,
            &format!("local memory after a read {what}"),
        );
    }
    // A length that overflows: refused (on either side), nothing changes.
    let w =
        p.a.transfer(p.seg, TransferRequest::write(local.addr(), r0, u64::MAX))
            .await;
    expect_addr_err(w, None, "write of u64::MAX bytes");
    assert_bytes(
        &remote.bytes(),
        &remote_before,
        "peer memory after an overflowing write",
    );
    // Batches report the failure per request and still move the good ones.
    let caps = p.a.capabilities();
    if batch_path(&caps).is_some() {
        let reqs = [
            TransferRequest::write(local.addr(), r0, 64),
            TransferRequest::write(local.addr(), r0 + 8192 - 8, 16),
            TransferRequest::write(local.at(64), r0 + 4096, 64),
        ];
        let report = batch(&p.a, p.seg, &reqs, None)
            .await
            .unwrap_or_else(|e| panic!("a batch with one bad request was refused whole: {e}"));
        assert!(
            report.results[0].is_ok(),
            "request 0: {:?}",
            report.results[0]
        );
        expect_addr_err(
            report.results[1].clone(),
            Some(Side::Remote),
            "batched bad request",
        );
        assert!(
            report.results[2].is_ok(),
            "request 2: {:?}",
            report.results[2]
        );
        let mut model = remote_before.clone();
        model[..64].copy_from_slice(&local_before[..64]);
        model[4096..4160].copy_from_slice(&local_before[64..128]);
        assert_bytes(
            &remote.bytes(),
            &model,
            "peer memory after a partly failing batch",
        );
    }
    local.release().await;
    remote.release().await;
    Outcome::Passed
}

/// A local range that is not registered fails with `AddressNotRegistered`
/// (local side); neither memory changes.
pub async fn check_local_unregistered(factory: Arc<dyn EngineFactory>, adapted: bool) -> Outcome {
    let p = match pair(&factory, adapted).await {
        Ok(p) => p,
        Err(o) => return o,
    };
    let stray = Mem::unregistered(&p.a, 4096, 31);
    let mut local = Mem::unregistered(&p.a, 8192, 32);
    local.register(0, 4096).await;
    let remote = Mem::new(&p.b, 4096, 33).await;
    let stray_before = stray.bytes();
    let local_before = local.bytes();
    let remote_before = remote.bytes();
    let cases: [(u64, u64, &str); 3] = [
        (stray.addr(), 64, "in unregistered memory"),
        (
            local.at(4096 - 8),
            16,
            "straddling the end of a local region",
        ),
        (local.at(4096), 64, "just past a local region"),
    ];
    for (addr, len, what) in cases {
        let w =
            p.a.transfer(p.seg, TransferRequest::write(addr, remote.addr(), len))
                .await;
        expect_addr_err(w, Some(Side::Local), &format!("write from {what}"));
        let r =
            p.a.transfer(p.seg, TransferRequest::read(addr, remote.addr(), len))
                .await;
        expect_addr_err(r, Some(Side::Local), &format!("read into {what}"));
        assert_bytes(&remote.bytes(), &remote_before, "peer memory");
        assert_bytes(&stray.bytes(), &stray_before, "unregistered local memory");
        assert_bytes(&local.bytes(), &local_before, "local memory");
    }
    stray.release().await;
    local.release().await;
    remote.release().await;
    Outcome::Passed
}

/// A zero-length request succeeds, moves nothing and checks no address.
pub async fn check_zero_length(factory: Arc<dyn EngineFactory>, adapted: bool) -> Outcome {
    let p = match pair(&factory, adapted).await {
        Ok(p) => p,
        Err(o) => return o,
    };
    let local = Mem::new(&p.a, 4096, 41).await;
    let remote = Mem::new(&p.b, 4096, 0).await;
    let before = remote.bytes();
    for (l, r) in [
        (local.addr(), remote.addr()),
        (local.end(), remote.end()),
        (0, 0),
        (u64::MAX, u64::MAX),
    ] {
        for req in [
            TransferRequest::write(l, r, 0),
            TransferRequest::read(l, r, 0),
        ] {
            p.a.transfer(p.seg, req)
                .await
                .unwrap_or_else(|e| panic!("zero-length {req:?} failed: {e}"));
        }
    }
    assert_bytes(
        &remote.bytes(),
        &before,
        "peer memory after zero-length writes",
    );
    assert_bytes(
        &local.bytes(),
        &pattern(41, 4096),
        "local memory after zero-length reads",
    );
    if batch_path(&p.a.capabilities()).is_some() {
        let reqs = [
            TransferRequest::write(0, 0, 0),
            TransferRequest::write(local.addr(), remote.addr(), 100),
            TransferRequest::write(local.at(100), remote.at(100), 0),
            TransferRequest::write(local.at(100), remote.at(100), 28),
        ];
        let report = batch(&p.a, p.seg, &reqs, None)
            .await
            .unwrap_or_else(|e| panic!("batch with zero-length requests refused: {e}"));
        assert_all_ok(&report, "batch with zero-length requests");
        let mut model = before.clone();
        model[..128].copy_from_slice(&pattern(41, 128));
        assert_bytes(
            &remote.bytes(),
            &model,
            "peer memory after a batch with zero-length requests",
        );
        let empty = batch(&p.a, p.seg, &[], None)
            .await
            .unwrap_or_else(|e| panic!("an empty batch was refused: {e}"));
        assert!(empty.is_empty(), "an empty batch reported results");
    }
    local.release().await;
    remote.release().await;
    Outcome::Passed
}

/// Odd offsets and lengths (1, 3, 7, page ± 1 …) move exactly those bytes.
pub async fn check_unaligned(factory: Arc<dyn EngineFactory>, adapted: bool) -> Outcome {
    let p = match pair(&factory, adapted).await {
        Ok(p) => p,
        Err(o) => return o,
    };
    const N: usize = 5 * 4096;
    let local = Mem::new(&p.a, N, 51).await;
    let back = Mem::new(&p.a, N, 0).await;
    let remote = Mem::new(&p.b, N, 52).await;
    let src = pattern(51, N);
    let mut model = pattern(52, N);
    let cases: [(usize, usize, usize); 8] = [
        (1, 3, 1),
        (7, 13, 3),
        (5, 4097, 4095),
        (333, 8191, 7),
        (4095, 1, 4097),
        (8193, 12287, 4097),
        (3, 16383, 4001),
        (N - 1, N - 1, 1),
    ];
    for (lo, ro, len) in cases {
        p.a.transfer(
            p.seg,
            TransferRequest::write(local.at(lo), remote.at(ro), len as u64),
        )
        .await
        .unwrap_or_else(|e| panic!("unaligned write {lo}->{ro} len {len} failed: {e}"));
        model[ro..ro + len].copy_from_slice(&src[lo..lo + len]);
        assert_bytes(
            &remote.bytes(),
            &model,
            &format!("peer memory after unaligned write {lo}->{ro} len {len}"),
        );
    }
    let mut back_model = vec![0u8; N];
    for (lo, ro, len) in cases {
        p.a.transfer(
            p.seg,
            TransferRequest::read(back.at(ro), remote.at(lo), len as u64),
        )
        .await
        .unwrap_or_else(|e| panic!("unaligned read {lo}->{ro} len {len} failed: {e}"));
        back_model[ro..ro + len].copy_from_slice(&model[lo..lo + len]);
        assert_bytes(
            &back.bytes(),
            &back_model,
            &format!("local memory after unaligned read {lo}->{ro} len {len}"),
        );
    }
    if batch_path(&p.a.capabilities()).is_some() {
        // Unaligned, scattered requests in one batch; destinations never
        // overlap (the trait leaves overlapping destinations unspecified).
        let reqs: Vec<TransferRequest> = (0..40)
            .map(|i| {
                let len = 1 + (i * 37) % 301;
                let lo = 1 + i * 311;
                let ro = if i % 3 == 0 { 3 + i * 400 } else { 7 + i * 400 };
                TransferRequest::write(local.at(lo), remote.at(ro), len as u64)
            })
            .collect();
        for r in &reqs {
            let lo = (r.local_addr - local.addr()) as usize;
            let ro = (r.remote_addr - remote.addr()) as usize;
            let len = r.len as usize;
            model[ro..ro + len].copy_from_slice(&src[lo..lo + len]);
        }
        let report = batch(&p.a, p.seg, &reqs, None)
            .await
            .unwrap_or_else(|e| panic!("unaligned batch refused: {e}"));
        assert_all_ok(&report, "unaligned batch");
        assert_bytes(
            &remote.bytes(),
            &model,
            "peer memory after an unaligned batch",
        );
    }
    local.release().await;
    back.release().await;
    remote.release().await;
    Outcome::Passed
}

/// Unregistering a region while transfers use it (as remote target, as local
/// destination) returns only when they have finished or failed: no byte of
/// it changes after `unregister` returns, a transfer that reports success has
/// moved all its bytes, and new transfers are refused.
///
/// The check proves that the transfers really were in flight: right before
/// `unregister` is called, part of the bytes have landed and the end of at
/// least one transfer has not. A round that cannot show that (the transfers
/// were too fast) is repeated with more bytes ([`IN_FLIGHT_SIZES`]); failing
/// to catch a transfer in flight at all fails the check, so it can never
/// quietly test the idle case.
pub async fn check_unregister_in_flight(factory: Arc<dyn EngineFactory>, adapted: bool) -> Outcome {
    let p = match pair(&factory, adapted).await {
        Ok(p) => p,
        Err(o) => return o,
    };
    for remote_side in [true, false] {
        let side = if remote_side { "remote" } else { "local" };
        let mut caught = false;
        for n in IN_FLIGHT_SIZES {
            if unregister_round(&p, remote_side, n).await {
                caught = true;
                break;
            }
        }
        assert!(
            caught,
            "unregister_in_flight ({side} side): in {} rounds of up to {} MiB, every transfer \
             had finished before unregister could be called; the check could not catch a \
             transfer in flight",
            IN_FLIGHT_SIZES.len(),
            IN_FLIGHT_SIZES[IN_FLIGHT_SIZES.len() - 1] >> 20
        );
    }
    p.a.close_segment(p.seg)
        .await
        .unwrap_or_else(|e| panic!("close_segment failed: {e}"));
    Outcome::Passed
}

/// The region sizes of the rounds of [`check_unregister_in_flight`], until
/// one catches a transfer in flight. Later rounds repeat the largest size: on
/// a busy machine the checking thread can lose the processor for the whole of
/// a fast transfer.
const IN_FLIGHT_SIZES: [usize; 8] = [
    4 << 20,
    16 << 20,
    64 << 20,
    64 << 20,
    64 << 20,
    64 << 20,
    64 << 20,
    64 << 20,
];

/// One round of [`check_unregister_in_flight`] with a victim region of `n`
/// bytes; returns whether a transfer was shown to be in flight when
/// `unregister` was called (every rule is asserted either way).
async fn unregister_round(p: &Pair, remote_side: bool, n: usize) -> bool {
    const K: usize = 4;
    let part_len = n / K;
    let side = if remote_side { "remote" } else { "local" };
    let src_local = Mem::new(&p.a, n, 61).await;
    let src_remote = Mem::new(&p.b, n, 62).await;
    let expected = if remote_side {
        pattern(61, n)
    } else {
        pattern(62, n)
    };
    // The region that will be unregistered: the peer's target of writes, or
    // the local destination of reads.
    let mut victim = if remote_side {
        Mem::new(&p.b, n, 0).await
    } else {
        Mem::new(&p.a, n, 0).await
    };
    let mut tasks = Vec::new();
    for k in 0..K {
        let a = Arc::clone(&p.a);
        let seg = p.seg;
        let off = (k * part_len) as u64;
        let len = part_len as u64;
        let req = if remote_side {
            TransferRequest::write(src_local.addr() + off, victim.addr() + off, len)
        } else {
            TransferRequest::read(victim.addr() + off, src_remote.addr() + off, len)
        };
        tasks.push(tokio::spawn(async move { a.transfer(seg, req).await }));
    }
    let landed = |at: usize| {
        let mut s = [0u8; 16];
        victim.buf().read(at, &mut s).expect("reading test memory");
        s[..] == expected[at..at + 16]
    };
    // Wait until the first bytes land (the transfers have started), or until
    // they are all done.
    let start = Instant::now();
    loop {
        if (0..K).any(|k| landed(k * part_len)) || tasks.iter().all(|t| t.is_finished()) {
            break;
        }
        assert!(
            start.elapsed() < LIVENESS,
            "transfers made no progress in {LIVENESS:?}"
        );
        tokio::task::yield_now().await;
    }
    // The proof of overlap: the last bytes of some transfer are not there yet.
    let in_flight = (0..K).any(|k| !landed((k + 1) * part_len - 16));
    let owner = if remote_side { &p.b } else { &p.a };
    owner
        .unregister(victim.addr())
        .await
        .unwrap_or_else(|e| panic!("unregister during transfers failed: {e}"));
    victim.forget_registration(0);
    // Sample the region at once (a full copy would take long enough for a
    // misbehaving engine to finish in the meantime), then in full.
    const STEP: usize = 8 * 1024;
    let samples: Vec<[u8; 16]> = (0..n / STEP)
        .map(|i| {
            let mut s = [0u8; 16];
            victim
                .buf()
                .read(i * STEP + STEP - 16, &mut s)
                .expect("reading test memory");
            s
        })
        .collect();
    let snapshot = victim.bytes();
    let mut results = Vec::new();
    for t in tasks {
        results.push(t.await.expect("transfer task panicked"));
    }
    let now = victim.bytes();
    for (i, sample) in samples.iter().enumerate() {
        let at = i * STEP + STEP - 16;
        assert_eq!(
            &now[at..at + 16],
            sample,
            "{side} region changed at offset {at} after unregister returned"
        );
    }
    assert_bytes(
        &now,
        &snapshot,
        &format!("{side} region changed after unregister returned"),
    );
    for (k, r) in results.iter().enumerate() {
        if r.is_ok() {
            let part = k * part_len..(k + 1) * part_len;
            assert_bytes(
                &snapshot[part.clone()],
                &expected[part],
                &format!("transfer {k} reported success but its bytes were not all there when unregister returned ({side} side)"),
            );
        }
    }
    // New transfers are refused.
    let req = if remote_side {
        TransferRequest::write(src_local.addr(), victim.addr(), 64)
    } else {
        TransferRequest::read(victim.addr(), src_remote.addr(), 64)
    };
    let want = if remote_side {
        Side::Remote
    } else {
        Side::Local
    };
    expect_addr_err(
        p.a.transfer(p.seg, req).await,
        Some(want),
        &format!("transfer after unregister ({side} side)"),
    );
    victim.release().await; // frees the memory
    src_local.release().await;
    src_remote.release().await;
    in_flight
}

/// Builds `n` write requests of `size` bytes from `local` slots to `remote`
/// slots: the first half in order (contiguous, so the adapter coalesces
/// them), the rest scattered.
fn slot_requests(
    local: &Mem,
    remote: &Mem,
    n: usize,
    size: usize,
) -> (Vec<TransferRequest>, Vec<usize>) {
    let mut targets: Vec<usize> = (0..n).collect();
    let half = n / 2;
    // Scatter the second half with a fixed permutation (multiplicative, odd
    // step, so distinct slots).
    let tail = n - half;
    for i in 0..tail {
        targets[half + i] = half + (i * 7919 + 13) % tail;
    }
    let reqs = (0..n)
        .map(|i| {
            TransferRequest::write(
                local.at(i * size),
                remote.at(targets[i] * size),
                size as u64,
            )
        })
        .collect();
    (reqs, targets)
}

async fn batch_of(
    factory: Arc<dyn EngineFactory>,
    adapted: bool,
    n: usize,
    size: usize,
) -> Outcome {
    let p = match pair(&factory, adapted).await {
        Ok(p) => p,
        Err(o) => return o,
    };
    let caps = p.a.capabilities();
    if batch_path(&caps).is_none() {
        return Outcome::Skipped(NEEDS_BATCH.to_owned());
    }
    let local = Mem::new(&p.a, n * size, 71).await;
    let remote = Mem::new(&p.b, n * size, 0).await;
    let (reqs, targets) = slot_requests(&local, &remote, n, size);
    if let Some(max) = caps.max_batch_len {
        if n > max {
            match p.a.batch_transfer(p.seg, &reqs, None).await {
                Err(Error::BatchTooLarge { len, max: m }) => {
                    assert_eq!((len, m), (n, max), "BatchTooLarge reports wrong sizes");
                }
                Err(Error::Unsupported { .. }) if !caps.batch_transfer => {}
                other => panic!(
                    "a batch of {n} over the declared max_batch_len {max}: expected BatchTooLarge, got {other:?}"
                ),
            }
            assert_bytes(
                &remote.bytes(),
                &vec![0; n * size],
                "a refused batch moved bytes",
            );
        }
    }
    let report = batch(&p.a, p.seg, &reqs, None)
        .await
        .unwrap_or_else(|e| panic!("a batch of {n} x {size} B was refused: {e}"));
    assert_eq!(report.len(), n);
    assert_all_ok(&report, &format!("batch of {n} x {size} B"));
    let src = pattern(71, n * size);
    let mut model = vec![0u8; n * size];
    for (i, t) in targets.iter().enumerate() {
        model[t * size..(t + 1) * size].copy_from_slice(&src[i * size..(i + 1) * size]);
    }
    assert_bytes(
        &remote.bytes(),
        &model,
        &format!("peer memory after a batch of {n}"),
    );
    local.release().await;
    remote.release().await;
    Outcome::Passed
}

/// A batch of one request.
pub async fn check_batch_one(factory: Arc<dyn EngineFactory>, adapted: bool) -> Outcome {
    batch_of(factory, adapted, 1, 4096).await
}

/// A batch of 100 requests of 1000 bytes, half contiguous, half scattered.
pub async fn check_batch_many(factory: Arc<dyn EngineFactory>, adapted: bool) -> Outcome {
    batch_of(factory, adapted, 100, 1000).await
}

/// A batch of 4096 requests of 64 bytes, half contiguous, half scattered.
pub async fn check_batch_thousands(factory: Arc<dyn EngineFactory>, adapted: bool) -> Outcome {
    batch_of(factory, adapted, 4096, 64).await
}

/// `submit` returns a batch id; `status` reports one state per request (a
/// failing request as `Failed` at its index); `release_batch` of a pending
/// batch is `BatchBusy`; after `wait` or `release_batch` the id is
/// `UnknownBatch` everywhere.
pub async fn check_async_batch(factory: Arc<dyn EngineFactory>, adapted: bool) -> Outcome {
    let p = match pair(&factory, adapted).await {
        Ok(p) => p,
        Err(o) => return o,
    };
    let caps = p.a.capabilities();
    if !caps.async_batch {
        return Outcome::Skipped("needs async_batch".to_owned());
    }
    const N: usize = 16;
    const PART: usize = 256 << 10;
    let local = Mem::new(&p.a, N * PART, 81).await;
    let remote = Mem::new(&p.b, N * PART, 0).await;
    let max = caps.max_batch_len.unwrap_or(usize::MAX);
    let n = N.min(max);
    // Request 1 is out of bounds; the rest move 1 MiB each, scattered so
    // nothing coalesces.
    let reqs: Vec<TransferRequest> = (0..n)
        .map(|i| {
            if i == 1 {
                TransferRequest::write(local.addr(), remote.end() - 8, 16)
            } else {
                let t = (i * 5 + 3) % N;
                TransferRequest::write(local.at(i * PART), remote.at(t * PART), PART as u64)
            }
        })
        .collect();
    let id =
        p.a.submit(p.seg, &reqs, None)
            .await
            .unwrap_or_else(|e| panic!("submit failed: {e}"));
    let st =
        p.a.status(id)
            .unwrap_or_else(|e| panic!("status right after submit failed: {e}"));
    assert_eq!(st.states.len(), n, "status must hold one state per request");
    match p.a.release_batch(id).await {
        Err(Error::BatchBusy(b)) => {
            assert_eq!(b, id);
            assert!(
                p.a.status(id).is_ok(),
                "a BatchBusy release_batch must leave the batch in place"
            );
        }
        Ok(()) => {
            // The batch was already finished: the id is gone.
            match p.a.status(id) {
                Err(Error::UnknownBatch(b)) => assert_eq!(b, id),
                other => panic!("status after release_batch: expected UnknownBatch, got {other:?}"),
            }
        }
        Err(e) => panic!("release_batch right after submit: expected BatchBusy or Ok, got {e}"),
    }
    let released_early = matches!(p.a.status(id), Err(Error::UnknownBatch(_)));
    if !released_early {
        let final_status = poll_until("the batch to finish", || async {
            let st =
                p.a.status(id)
                    .unwrap_or_else(|e| panic!("status while running failed: {e}"));
            assert_eq!(st.states.len(), n);
            st.is_finished().then_some(st)
        })
        .await;
        for (i, s) in final_status.states.iter().enumerate() {
            match (i, s) {
                (1, TransferState::Failed(Error::AddressNotRegistered { side, .. })) => {
                    assert_eq!(*side, Side::Remote)
                }
                (1, other) => panic!("request 1 is out of bounds but its state is {other:?}"),
                (_, TransferState::Completed) => {}
                (i, other) => panic!("request {i} should have completed, state {other:?}"),
            }
        }
        p.a.release_batch(id)
            .await
            .unwrap_or_else(|e| panic!("release_batch of a finished batch failed: {e}"));
    }
    let src = pattern(81, N * PART);
    let got = remote.bytes();
    for i in (0..n).filter(|i| *i != 1) {
        let t = (i * 5 + 3) % N;
        assert_bytes(
            &got[t * PART..(t + 1) * PART],
            &src[i * PART..(i + 1) * PART],
            &format!("bytes of async request {i}"),
        );
    }
    match p.a.status(id) {
        Err(Error::UnknownBatch(b)) => assert_eq!(b, id),
        other => panic!("status after release: expected UnknownBatch, got {other:?}"),
    }
    match p.a.release_batch(id).await {
        Err(Error::UnknownBatch(_)) => {}
        other => panic!("second release_batch: expected UnknownBatch, got {other:?}"),
    }
    if caps.batch_wait {
        match p.a.wait(id).await {
            Err(Error::UnknownBatch(_)) => {}
            other => panic!("wait after release: expected UnknownBatch, got {other:?}"),
        }
        // wait returns the report and invalidates the id.
        let good = &reqs[2..3.min(n)];
        let id2 =
            p.a.submit(p.seg, good, None)
                .await
                .unwrap_or_else(|e| panic!("submit failed: {e}"));
        let report =
            p.a.wait(id2)
                .await
                .unwrap_or_else(|e| panic!("wait failed: {e}"));
        assert_eq!(report.len(), good.len());
        assert_all_ok(&report, "waited batch");
        match p.a.status(id2) {
            Err(Error::UnknownBatch(_)) => {}
            other => panic!("status after wait: expected UnknownBatch, got {other:?}"),
        }
    }
    match p.a.status(BatchId(u64::MAX)) {
        Err(Error::UnknownBatch(_)) => {}
        other => panic!("status of a never-issued id: expected UnknownBatch, got {other:?}"),
    }
    // An empty async batch finishes with an empty report.
    let id3 =
        p.a.submit(p.seg, &[], None)
            .await
            .unwrap_or_else(|e| panic!("submit of an empty batch failed: {e}"));
    let report = finish(&p.a, id3).await;
    assert!(report.is_empty());
    local.release().await;
    remote.release().await;
    Outcome::Passed
}

/// An engine without notifications refuses a batch that carries one up
/// front, with the operation named and nothing moved, and refuses
/// `take_notifications` too.
async fn check_notification_refused(p: &Pair) -> Outcome {
    const N: usize = 4096;
    let local = Mem::new(&p.a, N, 93).await;
    let remote = Mem::new(&p.b, N, 0).await;
    let reqs = [TransferRequest::write(local.at(0), remote.at(0), N as u64)];
    let note = Notification::new("refused", "never sent");
    match batch(&p.a, p.seg, &reqs, Some(&note)).await {
        Err(Error::Unsupported { operation, .. }) => {
            assert_eq!(
                operation,
                Operation::Notify,
                "refusal names the wrong operation"
            )
        }
        other => panic!("a batch with a notification on an engine without notify: {other:?}"),
    }
    assert_bytes(
        &remote.bytes(),
        &vec![0u8; N],
        "peer memory after a refused batch with a notification",
    );
    match p.b.take_notifications().await {
        Err(Error::Unsupported { operation, .. }) => assert_eq!(operation, Operation::Notify),
        other => panic!("take_notifications on an engine without notify: {other:?}"),
    }
    local.release().await;
    remote.release().await;
    Outcome::Passed
}

/// A batch's notification reaches the peer only after every byte of the
/// batch has landed, and only if every request succeeded (engines without
/// notifications: see `check_notification_refused`).
pub async fn check_notification(factory: Arc<dyn EngineFactory>, adapted: bool) -> Outcome {
    let p = match pair(&factory, adapted).await {
        Ok(p) => p,
        Err(o) => return o,
    };
    let caps = p.a.capabilities();
    if !caps.notify && batch_path(&caps).is_some() {
        return check_notification_refused(&p).await;
    }
    if !caps.notify {
        return Outcome::Skipped("needs notify".to_owned());
    }
    if batch_path(&caps).is_none() {
        return Outcome::Skipped(format!("needs notify with a batch path ({NEEDS_BATCH})"));
    }
    const BLOCK: usize = 256 * 1024;
    const BLOCKS: usize = 8;
    let local = Mem::new(&p.a, BLOCK * BLOCKS, 91).await;
    let remote = Mem::new(&p.b, BLOCK * BLOCKS, 0).await;
    let src = pattern(91, BLOCK * BLOCKS);
    let reqs: Vec<TransferRequest> = (0..BLOCKS)
        .map(|i| {
            let t = BLOCKS - 1 - i;
            TransferRequest::write(local.at(i * BLOCK), remote.at(t * BLOCK), BLOCK as u64)
        })
        .collect();
    let mut model = vec![0u8; BLOCK * BLOCKS];
    for i in 0..BLOCKS {
        let t = BLOCKS - 1 - i;
        model[t * BLOCK..(t + 1) * BLOCK].copy_from_slice(&src[i * BLOCK..(i + 1) * BLOCK]);
    }
    let mut seen: Vec<Notification> =
        p.b.take_notifications()
            .await
            .unwrap_or_else(|e| panic!("take_notifications failed: {e}"));
    assert!(
        seen.is_empty(),
        "a fresh engine has notifications: {seen:?}"
    );

    // Wait for `want` while checking, the moment it shows up, that the bytes
    // are already there.
    async fn await_note(
        b: &Arc<dyn TransferEngine>,
        want: &Notification,
        seen: &mut Vec<Notification>,
        remote: &Mem,
        model: &[u8],
    ) {
        let start = Instant::now();
        loop {
            let got = b
                .take_notifications()
                .await
                .unwrap_or_else(|e| panic!("take_notifications failed: {e}"));
            let hit = got.contains(want);
            seen.extend(got);
            if hit {
                break;
            }
            assert!(
                start.elapsed() < LIVENESS,
                "gave up waiting for notification {:?} after {LIVENESS:?}",
                want.message
            );
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        assert_bytes(
            &remote.bytes(),
            model,
            &format!("peer memory when notification {:?} arrived", want.message),
        );
    }

    // 1. Through the batch path, then (if any) through submit without waiting.
    let n1 = Notification::new("conformance", "kv-ready-1");
    let report = batch(&p.a, p.seg, &reqs, Some(&n1))
        .await
        .unwrap_or_else(|e| panic!("batch with a notification refused: {e}"));
    assert_all_ok(&report, "batch with a notification");
    await_note(&p.b, &n1, &mut seen, &remote, &model).await;
    if caps.async_batch && caps.max_batch_len.is_none_or(|m| m >= BLOCKS) {
        // Clear, then let the notification race the bytes.
        remote.write(0, &vec![0u8; BLOCK * BLOCKS]);
        let n2 = Notification::new("conformance", "kv-ready-2");
        let id =
            p.a.submit(p.seg, &reqs, Some(&n2))
                .await
                .unwrap_or_else(|e| panic!("submit with a notification failed: {e}"));
        await_note(&p.b, &n2, &mut seen, &remote, &model).await;
        let report = finish(&p.a, id).await;
        assert_all_ok(&report, "submitted batch with a notification");
    }
    // 2. A failing batch sends nothing; a later good one does.
    let n3 = Notification::new("conformance", "must-not-arrive");
    let mut bad = reqs.clone();
    bad[BLOCKS / 2] = TransferRequest::write(local.addr(), remote.end() - 4, 8);
    let report = batch(&p.a, p.seg, &bad, Some(&n3))
        .await
        .unwrap_or_else(|e| panic!("a failing batch with a notification was refused whole: {e}"));
    assert!(!report.is_success(), "an out-of-bounds request succeeded");
    let n4 = Notification::new("conformance", "kv-ready-4");
    batch(&p.a, p.seg, &reqs[..1], Some(&n4))
        .await
        .unwrap_or_else(|e| panic!("batch with a notification refused: {e}"));
    await_note(&p.b, &n4, &mut seen, &remote, &model).await;
    assert!(
        !seen.contains(&n3),
        "the notification of a batch with a failed request was delivered"
    );
    // Delivered exactly once each, and take_notifications drains.
    for n in [&n1, &n4] {
        assert_eq!(
            seen.iter().filter(|s| *s == n).count(),
            1,
            "notification {:?} delivered more than once",
            n.message
        );
    }
    let rest = p.b.take_notifications().await.expect("take_notifications");
    assert!(!rest.contains(&n1), "take_notifications does not drain");
    // 3. An oversized notification is refused as a whole.
    let huge = Notification::new("conformance", "x".repeat(MAX_NOTIFICATION_MESSAGE + 1));
    match batch(&p.a, p.seg, &reqs[..1], Some(&huge)).await {
        Err(Error::InvalidArgument(_)) => {}
        other => panic!("oversized notification: expected InvalidArgument, got {other:?}"),
    }
    local.release().await;
    remote.release().await;
    Outcome::Passed
}

/// `batch_register` is all-or-nothing: when one region fails, the error
/// names its index and nothing of the call stays registered.
pub async fn check_batch_register_rollback(
    factory: Arc<dyn EngineFactory>,
    adapted: bool,
) -> Outcome {
    let p = match pair(&factory, adapted).await {
        Ok(p) => p,
        Err(o) => return o,
    };
    if !p.b.capabilities().batch_register {
        return Outcome::Skipped("needs batch_register".to_owned());
    }
    const PAGE: usize = 4096;
    let src = Mem::new(&p.a, PAGE, 101).await;
    let mut m = Mem::unregistered(&p.b, 6 * PAGE, 0);
    m.register(3 * PAGE, PAGE).await; // the obstacle
    let attempts: [(Vec<(usize, usize)>, usize); 3] = [
        // The third overlaps the obstacle.
        (
            vec![
                (0, PAGE),
                (PAGE, PAGE),
                (2 * PAGE, 2 * PAGE),
                (4 * PAGE, PAGE),
            ],
            2,
        ),
        // The same region twice.
        (vec![(0, PAGE), (0, PAGE)], 1),
        // An empty region last.
        (vec![(0, PAGE), (PAGE, PAGE), (5 * PAGE, 0)], 2),
    ];
    for (ranges, bad) in attempts {
        let regions: Vec<MemoryRegion> = ranges.iter().map(|&(o, l)| m.region(o, l)).collect();
        match p.b.batch_register(&regions).await {
            Err(Error::BatchRegisterFailed { index, addr, .. }) => {
                assert_eq!(index, bad, "BatchRegisterFailed names the wrong index");
                assert_eq!(addr, regions[bad].addr(), "BatchRegisterFailed names the wrong address");
            }
            other => panic!("batch_register with a bad region {bad}: expected BatchRegisterFailed, got {other:?}"),
        }
        for (i, &(o, l)) in ranges.iter().enumerate() {
            if l == 0 || o == 3 * PAGE {
                continue;
            }
            let r =
                p.a.transfer(p.seg, TransferRequest::write(src.addr(), m.at(o), 64))
                    .await;
            expect_addr_err(
                r,
                Some(Side::Remote),
                &format!("region {i} after a failed batch_register"),
            );
        }
        assert_bytes(
            &m.bytes(),
            &vec![0; 6 * PAGE],
            "memory of a rolled-back batch_register",
        );
    }
    // The obstacle is still registered and a good batch works.
    p.a.transfer(
        p.seg,
        TransferRequest::write(src.addr(), m.at(3 * PAGE), 64),
    )
    .await
    .unwrap_or_else(|e| panic!("the region registered before the failed batch is gone: {e}"));
    let good: Vec<MemoryRegion> = [0, PAGE, 2 * PAGE]
        .iter()
        .map(|&o| m.region(o, PAGE))
        .collect();
    p.b.batch_register(&good)
        .await
        .unwrap_or_else(|e| panic!("batch_register of three free regions failed: {e}"));
    for o in [0, PAGE, 2 * PAGE] {
        m.registered.push(m.at(o));
        p.a.transfer(p.seg, TransferRequest::write(src.addr(), m.at(o), 64))
            .await
            .unwrap_or_else(|e| panic!("write into a batch-registered region failed: {e}"));
    }
    if p.b.capabilities().batch_unregister {
        let addrs: Vec<u64> = good.iter().map(MemoryRegion::addr).collect();
        p.b.batch_unregister(&addrs)
            .await
            .unwrap_or_else(|e| panic!("batch_unregister failed: {e}"));
        for o in [0, PAGE, 2 * PAGE] {
            m.forget_registration(o);
        }
        let r =
            p.a.transfer(p.seg, TransferRequest::write(src.addr(), m.at(0), 64))
                .await;
        expect_addr_err(r, Some(Side::Remote), "write after batch_unregister");
    }
    src.release().await;
    m.release().await;
    Outcome::Passed
}

/// Transfers on a handle that was never opened, or was closed, fail with
/// `UnknownSegment` and move nothing.
pub async fn check_unknown_segment(factory: Arc<dyn EngineFactory>, adapted: bool) -> Outcome {
    let p = match pair(&factory, adapted).await {
        Ok(p) => p,
        Err(o) => return o,
    };
    let local = Mem::new(&p.a, 4096, 111).await;
    let remote = Mem::new(&p.b, 4096, 0).await;
    let bogus = SegmentId(u64::MAX - 1);
    let req = TransferRequest::write(local.addr(), remote.addr(), 64);
    let caps = p.a.capabilities();
    let check = |r: Result<()>, what: &str| match r {
        Err(Error::UnknownSegment(s)) => s,
        other => panic!("{what}: expected UnknownSegment, got {other:?}"),
    };
    // Open another handle to close it.
    let closed =
        p.a.open_segment(p.b.segment_name())
            .await
            .unwrap_or_else(|e| panic!("open_segment failed: {e}"));
    p.a.close_segment(closed)
        .await
        .unwrap_or_else(|e| panic!("close_segment failed: {e}"));
    for (seg, what) in [(bogus, "never opened"), (closed, "closed")] {
        assert_eq!(
            check(
                p.a.transfer(seg, req).await,
                &format!("transfer on a {what} handle")
            ),
            seg
        );
        assert_eq!(
            check(
                p.a.close_segment(seg).await,
                &format!("close_segment of a {what} handle")
            ),
            seg
        );
        if caps.batch_transfer {
            let r = p.a.batch_transfer(seg, &[req], None).await.map(drop);
            check(r, &format!("batch_transfer on a {what} handle"));
        }
        if caps.async_batch {
            match p.a.submit(seg, &[req], None).await {
                Err(Error::UnknownSegment(_)) => {}
                Ok(id) => {
                    // Accepted, but every request must fail with UnknownSegment.
                    let report = finish(&p.a, id).await;
                    for r in report.results {
                        check(r, &format!("request submitted on a {what} handle"));
                    }
                }
                Err(e) => panic!("submit on a {what} handle: expected UnknownSegment, got {e}"),
            }
        }
    }
    assert_bytes(
        &remote.bytes(),
        &[0; 4096],
        "peer memory after transfers on bad handles",
    );
    // The good handle still works.
    p.a.transfer(p.seg, req)
        .await
        .unwrap_or_else(|e| panic!("transfer on the open handle failed: {e}"));
    local.release().await;
    remote.release().await;
    Outcome::Passed
}

/// Opening a segment name no engine answers to fails with a typed error
/// (`SegmentUnavailable`, or for malformed names `InvalidArgument`).
pub async fn check_open_unknown_segment(factory: Arc<dyn EngineFactory>, adapted: bool) -> Outcome {
    let e = match engine(&factory, adapted).await {
        Ok(e) => e,
        Err(o) => return o,
    };
    let name = factory.unknown_segment_name();
    match e.open_segment(&name).await {
        Err(
            Error::SegmentUnavailable { .. }
            | Error::InvalidArgument(_)
            | Error::PeerLost { .. }
            | Error::Io { .. }
            | Error::Timeout { .. },
        ) => {}
        other => panic!("open_segment({name:?}): expected SegmentUnavailable, got {other:?}"),
    }
    Outcome::Passed
}

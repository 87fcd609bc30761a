//! Property tests of the capability adapter against a model of memory, over
//! in-process engines and over real loopback TCP (two and three engines):
//!
//! (a) an emulated batch is indistinguishable from a native one: same final
//!     memory, same per-request outcomes, for random batches that include
//!     failing requests;
//! (b) coalescing never changes results: random request lists, with and
//!     without coalescing, against a model of memory, including adjacent
//!     registered regions so that merged requests straddle region boundaries;
//! (c) a batch register that fails leaves nothing of it registered.
//!
//! Memory layout: every engine registers the first two pages of its
//! three-page buffer as two *adjacent* regions; the third page is allocated
//! but never registered. Random requests start anywhere in the first two
//! pages, so they straddle the region boundary or run into the unregistered
//! page (and fail) at random.

use ferry_core::DynTransferEngine;
use std::sync::Arc;

use ferry_core::inproc::InprocEngine;
use ferry_core::{
    AdapterConfig, BatchReport, Capabilities, CapabilityAdapter, Error, HostBuffer, Location,
    MemoryRegion, Result, SegmentId, Side, TransferEngine, TransferRequest,
};
use ferry_tcp::{TcpConfig, TcpEngine};
use ferry_tests::{normalize, Masked};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};

const PAGE: usize = 4096;
const SPAN: usize = 3 * PAGE;

// ---------------------------------------------------------------------------
// Engines
// ---------------------------------------------------------------------------

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Backend {
    Inproc,
    Tcp,
    /// TCP splitting requests into 100-byte chunks over three connections,
    /// so that one request (or a merged one) becomes many wire operations.
    TcpChunked,
}

/// A raw engine of `backend` with all its native capabilities.
async fn raw(backend: Backend) -> Arc<dyn DynTransferEngine> {
    match backend {
        Backend::Inproc => Arc::new(InprocEngine::auto(Capabilities::all())),
        Backend::Tcp => Arc::new(
            TcpEngine::start(TcpConfig::default())
                .await
                .expect("starting a loopback TCP engine"),
        ),
        Backend::TcpChunked => Arc::new(
            TcpEngine::start(
                TcpConfig::builder()
                    .chunk_size(100)
                    .connections(3)
                    .build()
                    .unwrap(),
            )
            .await
            .expect("starting a loopback TCP engine"),
        ),
    }
}

/// How an engine is presented to the test.
#[derive(Clone, Copy, Debug)]
enum Flavor {
    /// The backend as it is, native batches.
    Native,
    /// Nothing optional native (masked), the adapter emulating everything.
    Emulated { coalesce: bool },
    /// Native batches behind the adapter.
    AdaptedNative { coalesce: bool },
}

fn adapter(coalesce: bool) -> AdapterConfig {
    AdapterConfig::builder()
        .coalesce(coalesce)
        .build()
        .expect("a valid adapter configuration")
}

async fn make(backend: Backend, flavor: Flavor) -> Arc<dyn DynTransferEngine> {
    let e = raw(backend).await;
    match flavor {
        Flavor::Native => e,
        Flavor::Emulated { coalesce } => {
            let masked: Arc<dyn DynTransferEngine> =
                Arc::new(Masked::new(e, Capabilities::default()));
            Arc::new(CapabilityAdapter::from_arc(masked, adapter(coalesce)))
        }
        Flavor::AdaptedNative { coalesce } => {
            Arc::new(CapabilityAdapter::from_arc(e, adapter(coalesce)))
        }
    }
}

/// Test memory shared by every engine set of a test: leaked on purpose, so
/// that no failing case can leave an engine pointing at freed memory.
fn buffer() -> &'static HostBuffer {
    Box::leak(Box::new(
        HostBuffer::new(SPAN).expect("allocating test memory"),
    ))
}

fn page(buf: &HostBuffer, i: usize) -> MemoryRegion {
    // SAFETY: the page lies inside `buf`, which is leaked (never freed).
    unsafe { MemoryRegion::from_raw_parts(buf.as_ptr().add(i * PAGE), PAGE, Location::cpu(0)) }
}

/// One issuing engine and its peers, each peer's segment opened, every
/// engine's pages 0 and 1 registered as two adjacent regions.
struct Setup {
    a: Arc<dyn DynTransferEngine>,
    local: &'static HostBuffer,
    peers: Vec<(Arc<dyn DynTransferEngine>, SegmentId, &'static HostBuffer)>,
}

impl Setup {
    async fn new(
        backend: Backend,
        flavor: Flavor,
        local: &'static HostBuffer,
        remotes: &[&'static HostBuffer],
    ) -> Setup {
        let a = make(backend, flavor).await;
        for i in 0..2 {
            a.register(page(local, i))
                .await
                .expect("register local page");
        }
        let mut peers = Vec::new();
        for &buf in remotes {
            let b = make(backend, flavor).await;
            for i in 0..2 {
                b.register(page(buf, i))
                    .await
                    .expect("register remote page");
            }
            let seg = a
                .open_segment(b.segment_name())
                .await
                .expect("open_segment");
            peers.push((b, seg, buf));
        }
        Setup { a, local, peers }
    }

    async fn teardown(self) {
        for (b, seg, buf) in self.peers {
            self.a.close_segment(seg).await.expect("close_segment");
            for i in 0..2 {
                b.unregister(page(buf, i).addr()).await.expect("unregister");
            }
        }
        for i in 0..2 {
            self.a
                .unregister(page(self.local, i).addr())
                .await
                .expect("unregister");
        }
    }
}

// ---------------------------------------------------------------------------
// Random batches and the model
// ---------------------------------------------------------------------------

/// One group of requests in a batch.
#[derive(Clone, Debug)]
enum Item {
    /// Contiguous pieces (both sides continue each other), after gaps.
    Run {
        read: bool,
        gap_l: usize,
        gap_r: usize,
        lens: Vec<usize>,
    },
    /// A zero-length request at the cursors.
    Zero { read: bool },
    /// A request at an address far from any registered region.
    Wild { read: bool, kind: u8 },
}

#[derive(Clone, Debug)]
struct BatchSpec {
    start_l: usize,
    start_r: usize,
    items: Vec<Item>,
    /// Order in which the groups are issued (a permutation).
    order: Vec<usize>,
}

fn item() -> impl Strategy<Value = Item> {
    prop_oneof![
        6 => (
            any::<bool>(),
            prop_oneof![2 => Just(0usize), 1 => 1usize..200],
            prop_oneof![2 => Just(0usize), 1 => 1usize..200],
            prop::collection::vec(1usize..700, 1..5),
        )
            .prop_map(|(read, gap_l, gap_r, lens)| Item::Run {
                read,
                gap_l,
                gap_r,
                lens
            }),
        1 => any::<bool>().prop_map(|read| Item::Zero { read }),
        1 => (any::<bool>(), 0u8..3).prop_map(|(read, kind)| Item::Wild { read, kind }),
    ]
}

fn batch_spec(max_items: usize) -> impl Strategy<Value = BatchSpec> {
    (
        0usize..2 * PAGE,
        0usize..2 * PAGE,
        prop::collection::vec(item(), 0..max_items),
    )
        .prop_flat_map(|(start_l, start_r, items)| {
            let n = items.len();
            (
                Just(start_l),
                Just(start_r),
                Just(items),
                Just((0..n).collect::<Vec<_>>()).prop_shuffle(),
            )
        })
        .prop_map(|(start_l, start_r, items, order)| BatchSpec {
            start_l,
            start_r,
            items,
            order,
        })
}

/// The requests of `spec` between `local` and `remote`. Ranges never leave
/// the three-page buffers, and no two requests share a local or a remote
/// byte, so the final memory does not depend on execution order.
fn layout(spec: &BatchSpec, local: u64, remote: u64) -> Vec<TransferRequest> {
    let (mut l, mut r) = (spec.start_l, spec.start_r);
    let mk = |read: bool, la: u64, ra: u64, len: u64| {
        if read {
            TransferRequest::read(la, ra, len)
        } else {
            TransferRequest::write(la, ra, len)
        }
    };
    let mut groups: Vec<Vec<TransferRequest>> = Vec::new();
    for it in &spec.items {
        let mut g = Vec::new();
        match it {
            Item::Run {
                read,
                gap_l,
                gap_r,
                lens,
            } => {
                l += gap_l;
                r += gap_r;
                for &len in lens {
                    if l + len > SPAN || r + len > SPAN {
                        break;
                    }
                    g.push(mk(*read, local + l as u64, remote + r as u64, len as u64));
                    l += len;
                    r += len;
                }
            }
            Item::Zero { read } => {
                g.push(mk(*read, local + l as u64, remote + r as u64, 0));
            }
            Item::Wild { read, kind } => {
                let (la, ra) = match kind {
                    0 => (local, 64),
                    1 => (local, u64::MAX - 8),
                    _ => (64, remote),
                };
                g.push(mk(*read, la, ra, 16));
            }
        }
        groups.push(g);
    }
    spec.order.iter().flat_map(|&i| groups[i].clone()).collect()
}

/// Whether `[addr, addr+len)` lies inside page 0 or page 1 of `base`.
fn valid(addr: u64, len: u64, base: u64) -> bool {
    let Some(off) = addr.checked_sub(base) else {
        return false;
    };
    let Some(end) = off.checked_add(len) else {
        return false;
    };
    let p = PAGE as u64;
    (off < p && end <= p) || (off >= p && off < 2 * p && end <= 2 * p)
}

/// What the model expects of one request.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Expect {
    Ok,
    /// Fails on this side.
    Fail(Side),
    /// Fails on both sides (which one is reported is unspecified).
    FailBoth,
}

/// Applies `reqs` to the model memories and returns the expected outcomes.
fn model(
    reqs: &[TransferRequest],
    local_base: u64,
    remote_base: u64,
    local: &mut [u8],
    remote: &mut [u8],
) -> Vec<Expect> {
    reqs.iter()
        .map(|r| {
            if r.len == 0 {
                return Expect::Ok;
            }
            let lv = valid(r.local_addr, r.len, local_base);
            let rv = valid(r.remote_addr, r.len, remote_base);
            match (lv, rv) {
                (false, false) => Expect::FailBoth,
                (false, true) => Expect::Fail(Side::Local),
                (true, false) => Expect::Fail(Side::Remote),
                (true, true) => {
                    let lo = (r.local_addr - local_base) as usize;
                    let ro = (r.remote_addr - remote_base) as usize;
                    let n = r.len as usize;
                    match r.op {
                        ferry_core::TransferOp::Write => {
                            remote[ro..ro + n].copy_from_slice(&local[lo..lo + n])
                        }
                        ferry_core::TransferOp::Read => {
                            local[lo..lo + n].copy_from_slice(&remote[ro..ro + n])
                        }
                    }
                    Expect::Ok
                }
            }
        })
        .collect()
}

fn check_outcome(
    i: usize,
    got: &Result<()>,
    want: &Expect,
) -> std::result::Result<(), TestCaseError> {
    let ok = match (want, got) {
        (Expect::Ok, Ok(())) => true,
        (Expect::Fail(s), Err(Error::AddressNotRegistered { side, .. })) => s == side,
        (Expect::FailBoth, Err(Error::AddressNotRegistered { .. })) => true,
        _ => false,
    };
    prop_assert!(ok, "request {}: expected {:?}, got {:?}", i, want, got);
    Ok(())
}

fn fill(buf: &HostBuffer, seed: u64) {
    buf.write(0, &ferry_core::conformance::pattern(seed, SPAN))
        .expect("filling test memory");
}

/// Whether to run batches through `batch_transfer` or `submit` + `wait`.
#[derive(Clone, Copy, Debug)]
enum Path {
    Sync,
    Async,
}

async fn run(
    e: &Arc<dyn DynTransferEngine>,
    seg: SegmentId,
    reqs: &[TransferRequest],
    path: Path,
) -> Result<BatchReport> {
    match path {
        Path::Sync => e.batch_transfer(seg, reqs, None).await,
        Path::Async => {
            let id = e.submit(seg, reqs, None).await?;
            e.wait(id).await
        }
    }
}

/// Final memories (local first) and per-peer outcomes of one execution.
type Run = (Vec<Vec<u8>>, Vec<Vec<Result<()>>>);

/// Fills the memories, runs one batch per peer (concurrently), and returns
/// the final memories (local first) and the outcomes per peer.
async fn execute(s: &Setup, reqs: &[Vec<TransferRequest>], path: Path) -> Run {
    fill(s.local, 1);
    for (k, (_, _, buf)) in s.peers.iter().enumerate() {
        fill(buf, 2 + k as u64);
    }
    let runs = s
        .peers
        .iter()
        .zip(reqs)
        .map(|((_, seg, _), r)| run(&s.a, *seg, r, path));
    let reports = futures::future::join_all(runs).await;
    let mut mems = vec![s.local.to_vec()];
    mems.extend(s.peers.iter().map(|(_, _, b)| b.to_vec()));
    let outcomes = reports
        .into_iter()
        .map(|r| {
            let r = r.unwrap_or_else(|e| panic!("a batch was refused as a whole: {e}"));
            r.results.iter().map(normalize).collect()
        })
        .collect();
    (mems, outcomes)
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime")
}

fn runner(cases: u32) -> TestRunner {
    TestRunner::new(Config {
        cases,
        failure_persistence: None,
        ..Config::default()
    })
}

// ---------------------------------------------------------------------------
// (a) emulated == native
// ---------------------------------------------------------------------------

/// Runs `spec` (one per peer) on a native and an emulated setup of
/// `backend` over the same memory and compares everything, and both with
/// the model.
fn emulated_equals_native(backend: Backend, peers: usize, path: Path, cases: u32) {
    let rt = runtime();
    let local = buffer();
    let remotes: Vec<&'static HostBuffer> = (0..peers).map(|_| buffer()).collect();
    let (native, emulated) = rt.block_on(async {
        (
            Setup::new(backend, Flavor::Native, local, &remotes).await,
            Setup::new(
                backend,
                Flavor::Emulated { coalesce: true },
                local,
                &remotes,
            )
            .await,
        )
    });
    let strategy = prop::collection::vec(batch_spec(12), peers);
    runner(cases)
        .run(&strategy, |specs| {
            let reqs: Vec<Vec<TransferRequest>> = specs
                .iter()
                .zip(&remotes)
                .map(|(s, r)| layout(s, local.addr(), r.addr()))
                .collect();
            let (mem_n, out_n) = rt.block_on(execute(&native, &reqs, path));
            let (mem_e, out_e) = rt.block_on(execute(&emulated, &reqs, path));
            for (k, (n, e)) in out_n.iter().zip(&out_e).enumerate() {
                for (i, (x, y)) in n.iter().zip(e).enumerate() {
                    prop_assert_eq!(x, y, "peer {} request {}: native vs emulated", k, i);
                }
            }
            for (k, (n, e)) in mem_n.iter().zip(&mem_e).enumerate() {
                prop_assert!(n == e, "memory {} differs between native and emulated", k);
            }
            check_model(local.addr(), &remotes, &reqs, &mem_n, &out_n)
        })
        .unwrap_or_else(|e| panic!("{backend:?}, {peers} peer(s), {path:?}: {e}"));
    rt.block_on(async {
        native.teardown().await;
        emulated.teardown().await;
    });
}

/// Compares final memories and outcomes with the model. With several
/// peers the batches run concurrently; callers keep the local ranges of
/// different peers disjoint, so applying them one after the other to one
/// model of the local memory gives the same result.
fn check_model(
    local_base: u64,
    remotes: &[&'static HostBuffer],
    reqs: &[Vec<TransferRequest>],
    mems: &[Vec<u8>],
    outcomes: &[Vec<Result<()>>],
) -> std::result::Result<(), TestCaseError> {
    let mut local_m = ferry_core::conformance::pattern(1, SPAN);
    for (k, r) in reqs.iter().enumerate() {
        let mut remote_m = ferry_core::conformance::pattern(2 + k as u64, SPAN);
        let want = model(
            r,
            local_base,
            remotes[k].addr(),
            &mut local_m,
            &mut remote_m,
        );
        prop_assert_eq!(outcomes[k].len(), want.len(), "peer {}: result count", k);
        for (i, (g, w)) in outcomes[k].iter().zip(&want).enumerate() {
            check_outcome(i, g, w)?;
        }
        prop_assert!(
            mems[1 + k] == remote_m,
            "remote memory {} differs from the model",
            k
        );
    }
    prop_assert!(mems[0] == local_m, "local memory differs from the model");
    Ok(())
}

#[test]
fn a_emulated_batch_equals_native_inproc_sync() {
    emulated_equals_native(Backend::Inproc, 1, Path::Sync, 256);
}

#[test]
fn a_emulated_batch_equals_native_inproc_async() {
    emulated_equals_native(Backend::Inproc, 1, Path::Async, 128);
}

#[test]
fn a_emulated_batch_equals_native_tcp_two_engines() {
    emulated_equals_native(Backend::Tcp, 1, Path::Sync, 128);
}

#[test]
fn a_emulated_batch_equals_native_tcp_async() {
    emulated_equals_native(Backend::Tcp, 1, Path::Async, 64);
}

// ---------------------------------------------------------------------------
// (b) coalescing never changes results
// ---------------------------------------------------------------------------

/// Runs random request lists through the adapter with and without
/// coalescing, over native and emulated batch paths, against the model.
fn coalescing_is_invisible(backend: Backend, cases: u32) {
    let rt = runtime();
    let local = buffer();
    let remotes = vec![buffer()];
    let setups: Vec<Setup> = rt.block_on(async {
        let mut v = Vec::new();
        for flavor in [
            Flavor::Emulated { coalesce: true },
            Flavor::Emulated { coalesce: false },
            Flavor::AdaptedNative { coalesce: true },
            Flavor::AdaptedNative { coalesce: false },
        ] {
            v.push(Setup::new(backend, flavor, local, &remotes).await);
        }
        v
    });
    runner(cases)
        .run(&batch_spec(16), |spec| {
            let reqs = vec![layout(&spec, local.addr(), remotes[0].addr())];
            let mut first: Option<Run> = None;
            for s in &setups {
                let (mems, outs) = rt.block_on(execute(s, &reqs, Path::Sync));
                check_model(local.addr(), &remotes, &reqs, &mems, &outs)?;
                match &first {
                    None => first = Some((mems, outs)),
                    Some((m0, o0)) => {
                        prop_assert!(m0 == &mems, "memory differs between adapter setups");
                        prop_assert_eq!(o0, &outs, "outcomes differ between adapter setups");
                    }
                }
            }
            Ok(())
        })
        .unwrap_or_else(|e| panic!("{backend:?}: {e}"));
    rt.block_on(async {
        for s in setups {
            s.teardown().await;
        }
    });
}

#[test]
fn b_coalescing_never_changes_results_inproc() {
    coalescing_is_invisible(Backend::Inproc, 256);
}

#[test]
fn b_coalescing_never_changes_results_tcp() {
    coalescing_is_invisible(Backend::Tcp, 96);
}

/// With requests split into many chunks, a merged request that fails (it
/// straddles two regions, or runs into unregistered memory) must not have
/// written any of its chunks: the retried constituents that fail on their
/// own must leave their bytes untouched.
#[test]
fn b_coalescing_never_changes_results_tcp_chunked() {
    coalescing_is_invisible(Backend::TcpChunked, 64);
}

#[test]
fn a_emulated_batch_equals_native_tcp_chunked() {
    emulated_equals_native(Backend::TcpChunked, 1, Path::Sync, 64);
}

/// Three TCP engines: one issuer, two peers, batches to both at once, with
/// and without coalescing, against the model. The issuer's local ranges for
/// the two peers are disjoint halves of its buffer.
#[test]
fn b_coalescing_never_changes_results_tcp_three_engines() {
    let rt = runtime();
    let local = buffer();
    let remotes = vec![buffer(), buffer()];
    let setups: Vec<Setup> = rt.block_on(async {
        let mut v = Vec::new();
        for flavor in [
            Flavor::AdaptedNative { coalesce: true },
            Flavor::Emulated { coalesce: false },
        ] {
            v.push(Setup::new(Backend::Tcp, flavor, local, &remotes).await);
        }
        v
    });
    // Peer 0 uses local page 0 only, peer 1 local page 1 only (writes and
    // reads of one peer never touch the other's local bytes).
    let strategy = (batch_spec(10), batch_spec(10));
    runner(64)
        .run(&strategy, |(s0, s1)| {
            let r0: Vec<TransferRequest> = layout(&s0, local.addr(), remotes[0].addr())
                .into_iter()
                .filter(|r| r.local_addr + r.len <= local.addr() + PAGE as u64)
                .collect();
            let r1: Vec<TransferRequest> = layout(&s1, local.addr(), remotes[1].addr())
                .into_iter()
                .filter(|r| r.local_addr >= local.addr() + PAGE as u64)
                .collect();
            let reqs = vec![r0, r1];
            let mut first: Option<Vec<Vec<u8>>> = None;
            for s in &setups {
                let (mems, outs) = rt.block_on(execute(s, &reqs, Path::Sync));
                check_model(local.addr(), &remotes, &reqs, &mems, &outs)?;
                match &first {
                    None => first = Some(mems),
                    Some(m0) => prop_assert!(m0 == &mems, "memory differs between setups"),
                }
            }
            Ok(())
        })
        .unwrap_or_else(|e| panic!("three TCP engines: {e}"));
    rt.block_on(async {
        for s in setups {
            s.teardown().await;
        }
    });
}

// ---------------------------------------------------------------------------
// (c) batch register rollback
// ---------------------------------------------------------------------------

#[derive(Clone, Debug)]
struct RegisterSpec {
    /// A region registered before the batch: (offset, len).
    obstacle: Option<(usize, usize)>,
    /// The batch: (offset, len) inside the three-page buffer.
    regions: Vec<(usize, usize)>,
}

fn register_spec() -> impl Strategy<Value = RegisterSpec> {
    let range = (0usize..SPAN).prop_flat_map(|o| {
        (
            Just(o),
            prop_oneof![1 => Just(0usize), 8 => 1usize..=(SPAN - o).min(2000)],
        )
    });
    (
        prop::option::of(
            (0usize..SPAN - 1).prop_flat_map(|o| (Just(o), 1usize..=(SPAN - o).min(3000))),
        ),
        prop::collection::vec(range, 1..8),
    )
        .prop_map(|(obstacle, regions)| RegisterSpec { obstacle, regions })
}

fn overlaps(a: (usize, usize), b: (usize, usize)) -> bool {
    a.0 < b.0 + b.1 && b.0 < a.0 + a.1
}

/// The index the batch must fail at, if any.
fn first_failure(spec: &RegisterSpec) -> Option<usize> {
    (0..spec.regions.len()).find(|&i| {
        let r = spec.regions[i];
        r.1 == 0
            || spec.obstacle.is_some_and(|o| overlaps(r, o))
            || spec.regions[..i].iter().any(|&p| overlaps(r, p))
    })
}

fn region(buf: &HostBuffer, (off, len): (usize, usize)) -> MemoryRegion {
    assert!(off + len <= buf.len());
    // SAFETY: inside the leaked buffer.
    unsafe { MemoryRegion::from_raw_parts(buf.as_ptr().add(off), len, Location::cpu(0)) }
}

/// Registers the free ranges around the obstacle and unregisters them
/// again; succeeds only if nothing else is registered in the buffer.
async fn nothing_but_obstacle(
    e: &Arc<dyn DynTransferEngine>,
    buf: &HostBuffer,
    obstacle: Option<(usize, usize)>,
) -> std::result::Result<(), String> {
    let free: Vec<(usize, usize)> = match obstacle {
        None => vec![(0, SPAN)],
        Some((o, l)) => [(0, o), (o + l, SPAN - o - l)]
            .into_iter()
            .filter(|r| r.1 > 0)
            .collect(),
    };
    for r in &free {
        e.register(region(buf, *r))
            .await
            .map_err(|err| format!("a range of the buffer is still registered: {err}"))?;
    }
    for r in &free {
        e.unregister(region(buf, *r).addr())
            .await
            .map_err(|err| format!("unregister failed: {err}"))?;
    }
    Ok(())
}

fn batch_register_rolls_back(backend: Backend, flavor: Flavor, cases: u32) {
    let rt = runtime();
    let buf = buffer();
    let e = rt.block_on(make(backend, flavor));
    assert!(
        e.capabilities().batch_register,
        "{flavor:?} lacks batch_register"
    );
    runner(cases)
        .run(&register_spec(), |spec| {
            rt.block_on(async {
                if let Some(o) = spec.obstacle {
                    e.register(region(buf, o)).await.expect("register obstacle");
                }
                let regions: Vec<MemoryRegion> =
                    spec.regions.iter().map(|&r| region(buf, r)).collect();
                let addrs: Vec<u64> = regions.iter().map(|r| r.addr()).collect();
                let res = e.batch_register(regions).await;
                let verdict = match (first_failure(&spec), res) {
                    (Some(i), Err(Error::BatchRegisterFailed { index, addr, .. })) => {
                        if index != i || addr != addrs[i] {
                            Err(format!("failed at {index} ({addr:#x}), expected {i}"))
                        } else {
                            nothing_but_obstacle(&e, buf, spec.obstacle).await
                        }
                    }
                    (None, Ok(())) => {
                        let mut r = Ok(());
                        for &addr in &addrs {
                            if let Err(err) = e.unregister(addr).await {
                                r = Err(format!("a batch-registered region is missing: {err}"));
                            }
                        }
                        match r {
                            Ok(()) => nothing_but_obstacle(&e, buf, spec.obstacle).await,
                            err => err,
                        }
                    }
                    (want, got) => Err(format!("expected failure at {want:?}, got {got:?}")),
                };
                if let Some(o) = spec.obstacle {
                    e.unregister(region(buf, o).addr())
                        .await
                        .expect("unregister obstacle");
                }
                verdict
            })
            .map_err(TestCaseError::fail)
        })
        .unwrap_or_else(|err| panic!("{backend:?} {flavor:?}: {err}"));
}

#[test]
fn c_batch_register_rollback_inproc_emulated() {
    batch_register_rolls_back(Backend::Inproc, Flavor::Emulated { coalesce: true }, 128);
}

#[test]
fn c_batch_register_rollback_inproc_native() {
    batch_register_rolls_back(Backend::Inproc, Flavor::Native, 128);
}

#[test]
fn c_batch_register_rollback_tcp_emulated() {
    batch_register_rolls_back(Backend::Tcp, Flavor::Emulated { coalesce: true }, 64);
}

#[test]
fn c_batch_register_rollback_tcp_native() {
    batch_register_rolls_back(Backend::Tcp, Flavor::Native, 64);
}

// ---------------------------------------------------------------------------
// Pinned cases: the shapes the properties exist for, checked every run.
// ---------------------------------------------------------------------------

/// Runs fixed requests (offsets into local and remote buffers) on every
/// adapter flavour of `backend` and checks them against the model.
fn pinned(backend: Backend, reqs: &[(bool, usize, usize, usize)]) {
    let rt = runtime();
    let local = buffer();
    let remotes = vec![buffer()];
    for flavor in [
        Flavor::Native,
        Flavor::Emulated { coalesce: true },
        Flavor::AdaptedNative { coalesce: true },
    ] {
        let s = rt.block_on(Setup::new(backend, flavor, local, &remotes));
        let batch: Vec<TransferRequest> = reqs
            .iter()
            .map(|&(read, l, r, len)| {
                let (l, r) = (local.addr() + l as u64, remotes[0].addr() + r as u64);
                if read {
                    TransferRequest::read(l, r, len as u64)
                } else {
                    TransferRequest::write(l, r, len as u64)
                }
            })
            .collect();
        let reqs = vec![batch];
        for path in [Path::Sync, Path::Async] {
            let (mems, outs) = rt.block_on(execute(&s, &reqs, path));
            check_model(local.addr(), &remotes, &reqs, &mems, &outs)
                .unwrap_or_else(|e| panic!("{backend:?} {flavor:?} {path:?}: {e}"));
        }
        rt.block_on(s.teardown());
    }
}

/// Two contiguous writes, each inside one of two adjacent remote regions:
/// merged they straddle the boundary; both must succeed.
#[test]
fn regression_merged_write_straddles_adjacent_regions() {
    let reqs = [(false, 0, PAGE - 100, 100), (false, 100, PAGE, 100)];
    pinned(Backend::Inproc, &reqs);
    pinned(Backend::TcpChunked, &reqs);
}

/// Contiguous reads where the last one runs into the unregistered third
/// page: the others succeed, the last fails and its bytes stay untouched.
#[test]
fn regression_merged_read_runs_into_unregistered_memory() {
    let reqs = [
        (true, 10, 2 * PAGE - 300, 100),
        (true, 110, 2 * PAGE - 200, 100),
        (true, 210, 2 * PAGE - 100, 150),
    ];
    pinned(Backend::Inproc, &reqs);
    pinned(Backend::TcpChunked, &reqs);
}

/// A contiguous run whose merged local range straddles the issuer's two
/// adjacent regions, next to a zero-length request at the boundary.
#[test]
fn regression_merged_local_straddle_and_zero_length() {
    let reqs = [
        (false, PAGE - 64, 0, 64),
        (false, PAGE, 64, 64),
        (false, PAGE + 64, 128, 0),
        (false, PAGE + 64, 128, 64),
    ];
    pinned(Backend::Inproc, &reqs);
    pinned(Backend::TcpChunked, &reqs);
}

//! What every check uses: engines and pairs of them, registered memory with a byte model, batch helpers, assertions.

use super::*;
use crate::DynTransferEngine;

/// Upper bound on waiting for something that must eventually happen (a batch
/// finishing, a notification arriving). A liveness guard, not a timing
/// assertion: hitting it means the engine lost the event.
pub(super) const LIVENESS: Duration = Duration::from_secs(120);

pub(super) type Setup<T> = std::result::Result<T, Outcome>;

pub(super) async fn engine(
    factory: &Arc<dyn EngineFactory>,
    adapted: bool,
) -> Setup<Arc<dyn DynTransferEngine>> {
    let raw = factory.create().await.map_err(|e| factory_failed(&e))?;
    Ok(if adapted { full_stack(raw) } else { raw })
}

/// What the adapted mode checks: `raw` under every layer Ferry ships, as a
/// user stacks them — tracing over metrics over a per-call deadline (far
/// longer than any check: never reached) over the default capability
/// adapter (coalescing over emulation). Every layer forwards what the
/// checks observe, so each check holds through the stack exactly as
/// through the adapter alone.
pub fn full_stack(raw: Arc<dyn DynTransferEngine>) -> Arc<dyn DynTransferEngine> {
    use crate::adapter::Layer;
    let native = raw.capabilities();
    let adapted = CapabilityAdapter::from_arc(raw, AdapterConfig::default());
    let timed = crate::TimeoutLayer::new(LIVENESS).layer(adapted);
    let counted = crate::MetricsLayer::new(crate::Metrics::new())
        .native(native)
        .layer(timed);
    Arc::new(crate::TracingLayer::new().layer(counted))
}

/// Two engines; `a` has opened `b`'s segment as `seg`.
pub(super) struct Pair {
    pub(super) a: Arc<dyn DynTransferEngine>,
    pub(super) b: Arc<dyn DynTransferEngine>,
    pub(super) seg: SegmentId,
}

pub(super) async fn pair(factory: &Arc<dyn EngineFactory>, adapted: bool) -> Setup<Pair> {
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

pub(super) fn pair_from(
    a: Arc<dyn DynTransferEngine>,
    b: Arc<dyn DynTransferEngine>,
    seg: SegmentId,
) -> Pair {
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
pub(super) struct Mem {
    pub(super) engine: Arc<dyn DynTransferEngine>,
    pub(super) buf: Option<HostBuffer>,
    pub(super) registered: Vec<u64>,
}

impl Mem {
    /// `len` bytes filled with `pattern(seed)` (seed 0: zeros), registered
    /// whole.
    pub(super) async fn new(engine: &Arc<dyn DynTransferEngine>, len: usize, seed: u64) -> Mem {
        let mut m = Mem::unregistered(engine, len, seed);
        m.register(0, len).await;
        m
    }

    /// `len` bytes filled with `pattern(seed)` (seed 0: zeros), not registered.
    pub(super) fn unregistered(engine: &Arc<dyn DynTransferEngine>, len: usize, seed: u64) -> Mem {
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

    pub(super) fn buf(&self) -> &HostBuffer {
        self.buf.as_ref().expect("test memory already released")
    }

    pub(super) fn region(&self, offset: usize, len: usize) -> MemoryRegion {
        assert!(offset + len <= self.buf().len());
        // SAFETY: the range lies inside `buf`, which stays allocated until
        // every registration made through `Mem` is undone (or is leaked).
        unsafe {
            MemoryRegion::from_raw_parts(self.buf().as_ptr().add(offset), len, Location::cpu(0))
        }
    }

    pub(super) async fn register(&mut self, offset: usize, len: usize) {
        let region = self.region(offset, len);
        let addr = region.addr();
        self.engine
            .register(region)
            .await
            .unwrap_or_else(|e| panic!("register of {addr:#x}+{len} failed: {e}"));
        self.registered.push(addr);
    }

    pub(super) async fn unregister(&mut self, offset: usize) {
        let addr = self.at(offset);
        self.engine
            .unregister(addr)
            .await
            .unwrap_or_else(|e| panic!("unregister of {addr:#x} failed: {e}"));
        self.registered.retain(|a| *a != addr);
    }

    /// Marks the registration at `offset` as undone by other means.
    pub(super) fn forget_registration(&mut self, offset: usize) {
        let addr = self.at(offset);
        self.registered.retain(|a| *a != addr);
    }

    pub(super) fn at(&self, offset: usize) -> u64 {
        self.buf().addr() + offset as u64
    }
    pub(super) fn addr(&self) -> u64 {
        self.at(0)
    }
    pub(super) fn len(&self) -> usize {
        self.buf().len()
    }
    pub(super) fn end(&self) -> u64 {
        self.addr() + self.len() as u64
    }
    pub(super) fn bytes(&self) -> Vec<u8> {
        self.buf().to_vec()
    }
    pub(super) fn write(&self, offset: usize, data: &[u8]) {
        self.buf().write(offset, data).expect("writing test memory");
    }

    /// Unregisters what is still registered, then frees the memory.
    pub(super) async fn release(mut self) {
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

pub(super) fn is_unsupported(r: &Result<impl Sized>) -> bool {
    matches!(r, Err(Error::Unsupported { .. }))
}

#[track_caller]
pub(super) fn expect_addr_err<T: std::fmt::Debug>(r: Result<T>, side: Option<Side>, what: &str) {
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
pub(super) enum BatchPath {
    Sync,
    Async,
}

pub(super) fn batch_path(caps: &Capabilities) -> Option<BatchPath> {
    if caps.batch_transfer {
        Some(BatchPath::Sync)
    } else if caps.async_batch {
        Some(BatchPath::Async)
    } else {
        None
    }
}

pub(super) const NEEDS_BATCH: &str = "needs batch_transfer or async_batch";

/// Waits for a submitted batch: `wait` when declared, else `status` polling
/// and `release_batch`.
pub(super) async fn finish(e: &Arc<dyn DynTransferEngine>, id: BatchId) -> BatchReport {
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

/// Awaits `fut`; panics naming `what` if it has not finished within
/// [`LIVENESS`] (a hang is a failure that says where, not a stuck test).
pub(super) async fn within<T>(what: &str, fut: impl Future<Output = T>) -> T {
    tokio::time::timeout(LIVENESS, fut)
        .await
        .unwrap_or_else(|_| panic!("{what} did not return within {LIVENESS:?}"))
}

/// Polls `f` until it returns `Some`, sleeping briefly between tries; panics
/// after [`LIVENESS`].
pub(super) async fn poll_until<T, F, Fut>(what: &str, mut f: F) -> T
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
pub(super) async fn batch(
    e: &Arc<dyn DynTransferEngine>,
    seg: SegmentId,
    requests: &[TransferRequest],
    notify: Option<&Notification>,
) -> Result<BatchReport> {
    let path = batch_path(&e.capabilities()).expect("batch() called without a batch path");
    batch_via(e, path, seg, requests, notify).await
}

/// [`batch`] through the given path (which the engine must offer).
pub(super) async fn batch_via(
    e: &Arc<dyn DynTransferEngine>,
    path: BatchPath,
    seg: SegmentId,
    requests: &[TransferRequest],
    notify: Option<&Notification>,
) -> Result<BatchReport> {
    let caps = e.capabilities();
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
pub(super) fn assert_all_ok(report: &BatchReport, what: &str) {
    if let Some((i, e)) = report.failures().next() {
        panic!(
            "{what}: request {i} failed ({} of {} failed): {e}",
            report.failures().count(),
            report.len()
        );
    }
}

#[track_caller]
pub(super) fn assert_bytes(actual: &[u8], expected: &[u8], what: &str) {
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

/// Polls `fut` up to `polls` times, letting the runtime run between polls;
/// `Some` if it completed, else it is dropped still pending.
pub(super) async fn poll_then_drop<T>(fut: impl Future<Output = T>, polls: u32) -> Option<T> {
    let mut fut = std::pin::pin!(fut);
    for i in 0..polls {
        let ready = std::future::poll_fn(|cx: &mut std::task::Context<'_>| {
            std::task::Poll::Ready(match fut.as_mut().poll(cx) {
                std::task::Poll::Ready(v) => Some(v),
                std::task::Poll::Pending => None,
            })
        })
        .await;
        if ready.is_some() {
            return ready;
        }
        if i % 2 == 0 {
            tokio::task::yield_now().await;
        } else {
            tokio::time::sleep(Duration::from_micros(200)).await;
        }
    }
    None
}

//! Merging of contiguous requests (SGLang's `group_concurrent_contiguous`,
//! done once here for every backend): [`coalesce`], the batch path built
//! on it, and [`CoalesceLayer`], that path as a layer of its own.

use std::fmt;
use std::future::Future;
use std::ops::Range;
use std::sync::Arc;

use super::Layer;
use crate::batch::BatchTable;
use crate::drain::Drain;
use crate::engine::TransferEngine;
use crate::error::{Error, Result};
use crate::types::{BatchId, BatchReport, BatchStatus, Notification, SegmentId, TransferRequest};

/// A batch after coalescing: the requests to issue and, for each, the range
/// of caller indices it stands for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CoalescedBatch {
    /// Requests to issue.
    pub requests: Vec<TransferRequest>,
    /// `groups[i]` = caller indices merged into `requests[i]` (consecutive).
    pub groups: Vec<Range<usize>>,
}

impl CoalescedBatch {
    /// Number of caller requests.
    pub fn caller_len(&self) -> usize {
        self.groups.last().map_or(0, |g| g.end)
    }

    /// Spreads one result per issued request back to caller indices.
    pub fn expand<T: Clone>(&self, results: &[T]) -> Vec<T> {
        let mut out = Vec::with_capacity(self.caller_len());
        for (g, r) in self.groups.iter().zip(results) {
            out.extend(std::iter::repeat_n(r, g.len()).cloned());
        }
        out
    }
}

/// Merges runs of consecutive requests with the same op whose local and
/// remote ranges both continue the previous one, up to `max_len` bytes per
/// merged request. Zero-length requests are never merged. Order is kept.
pub fn coalesce(requests: &[TransferRequest], enabled: bool, max_len: u64) -> CoalescedBatch {
    let mut out = CoalescedBatch {
        requests: Vec::with_capacity(requests.len()),
        groups: Vec::with_capacity(requests.len()),
    };
    for (i, r) in requests.iter().enumerate() {
        if enabled {
            if let (Some(last), Some(group)) = (out.requests.last_mut(), out.groups.last_mut()) {
                let adjacent = last.op == r.op
                    && last.len > 0
                    && r.len > 0
                    && last.local_addr.checked_add(last.len) == Some(r.local_addr)
                    && last.remote_addr.checked_add(last.len) == Some(r.remote_addr)
                    && last.len.checked_add(r.len).is_some_and(|n| n <= max_len);
                if adjacent {
                    last.len += r.len;
                    group.end = i + 1;
                    continue;
                }
            }
        }
        out.requests.push(*r);
        out.groups.push(i..i + 1);
    }
    out
}

/// Issues a batch of already-coalesced requests: one result per request,
/// `Err` when refused as a whole.
pub(crate) trait Issue {
    fn issue(
        &self,
        requests: &[TransferRequest],
        notify: Option<&Notification>,
    ) -> impl Future<Output = Result<Vec<Result<()>>>> + Send;
}

/// The coalescing batch path: coalesce, issue, retry the constituents of
/// merged requests that failed on an address check (a merged range may
/// straddle two adjacent regions that each request alone stays inside),
/// send the notification if the retry made the batch whole, map back.
pub(crate) async fn run_coalesced(
    exec: &impl Issue,
    requests: &[TransferRequest],
    notify: Option<&Notification>,
    enabled: bool,
    max_len: u64,
) -> Result<Vec<Result<()>>> {
    let plan = coalesce(requests, enabled, max_len);
    let merged = exec.issue(&plan.requests, notify).await?;
    let mut results = plan.expand(&merged);
    let retry: Vec<usize> = plan
        .groups
        .iter()
        .zip(&merged)
        .filter(|(g, r)| g.len() > 1 && matches!(r, Err(Error::AddressNotRegistered { .. })))
        .flat_map(|(g, _)| g.clone())
        .collect();
    if !retry.is_empty() {
        let singles: Vec<TransferRequest> = retry.iter().map(|&i| requests[i]).collect();
        // Bytes of the batch have moved by now: a refusal of the retry is
        // reported per request, not for the batch as a whole.
        let again = exec
            .issue(&singles, None)
            .await
            .unwrap_or_else(|e| vec![Err(e); singles.len()]);
        for (i, r) in retry.into_iter().zip(again) {
            results[i] = r;
        }
        let first_try_ok = merged.iter().all(Result::is_ok);
        if notify.is_some() && !first_try_ok && results.iter().all(Result::is_ok) {
            exec.issue(&[], notify).await?;
        }
    }
    Ok(results)
}

/// [`Layer`] that wraps engines in a [`CoalesceEngine`].
#[derive(Clone, Copy, Debug)]
pub struct CoalesceLayer {
    max_len: u64,
}

impl CoalesceLayer {
    /// Merges up to `max_len` bytes per request (see [`coalesce`]).
    pub fn new(max_len: u64) -> Self {
        CoalesceLayer {
            max_len: max_len.max(1),
        }
    }
}

/// The default limit of a merged request (also the adapter's
/// `max_coalesced_len`).
pub(crate) const DEFAULT_MAX_COALESCED_LEN: u64 = 64 << 20;

impl Default for CoalesceLayer {
    /// The adapter's default limit, 64 MiB.
    fn default() -> Self {
        CoalesceLayer::new(DEFAULT_MAX_COALESCED_LEN)
    }
}

impl<E: TransferEngine> Layer<E> for CoalesceLayer {
    type Engine = CoalesceEngine<E>;
    fn layer(&self, inner: E) -> CoalesceEngine<E> {
        CoalesceEngine::with(inner, true, self.max_len)
    }
}

/// Merges contiguous requests of each batch before its inner engine sees
/// them, and maps the results back to the caller's requests (the
/// [`CapabilityAdapter`](crate::CapabilityAdapter)'s batch path without
/// its emulation). Capabilities are the inner engine's.
///
/// `batch_transfer` merges, calls the inner `batch_transfer` and maps
/// back. `submit` forwards batches with nothing to merge (and every batch
/// when the inner engine has no `batch_transfer`, or the notification is
/// one it does not offer, so that it refuses as it would); one with
/// requests to merge becomes a batch of the layer's own, run on a task
/// through the same path as `batch_transfer` (its id is this layer's:
/// `status`, `wait`, `release_batch` answer it here, and
/// `live_batches` counts it; `shutdown` waits for those tasks first).
pub struct CoalesceEngine<E> {
    inner: Arc<E>,
    /// Off: every call forwarded as it is (the adapter with
    /// `coalesce=0`).
    enabled: bool,
    max_len: u64,
    /// The batches of merged requests this layer runs itself.
    batches: BatchTable,
    /// Those batches' tasks, for `shutdown`.
    drain: Arc<Drain>,
}

impl<E: TransferEngine> fmt::Debug for CoalesceEngine<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CoalesceEngine")
            .field("backend", &self.inner.backend_name())
            .field("max_len", &self.max_len)
            .finish_non_exhaustive()
    }
}

impl<E> CoalesceEngine<E> {
    pub(crate) fn with(inner: E, enabled: bool, max_len: u64) -> Self {
        CoalesceEngine {
            inner: Arc::new(inner),
            enabled,
            max_len: max_len.max(1),
            batches: BatchTable::new("coalesce"),
            drain: Drain::new(),
        }
    }

    /// The wrapped engine.
    pub fn get_ref(&self) -> &E {
        &self.inner
    }
    /// Unwraps, returning the shared inner engine.
    pub fn into_inner(self) -> Arc<E> {
        self.inner
    }
}

/// The inner engine's own `batch_transfer` on one segment.
struct Forward<'a, E> {
    inner: &'a E,
    segment: SegmentId,
}

impl<E: TransferEngine> Issue for Forward<'_, E> {
    async fn issue(
        &self,
        requests: &[TransferRequest],
        notify: Option<&Notification>,
    ) -> Result<Vec<Result<()>>> {
        let report = self
            .inner
            .batch_transfer(self.segment, requests, notify)
            .await?;
        Ok(report.results)
    }
}

#[deny(clippy::missing_trait_methods)]
impl<E: TransferEngine> TransferEngine for CoalesceEngine<E> {
    forward!(
        backend_name,
        segment_name,
        capabilities,
        backend_info,
        register,
        unregister,
        batch_register,
        batch_unregister,
        open_segment,
        close_segment,
        transfer,
        take_notifications,
        next_notification
    );

    async fn submit(
        &self,
        segment: SegmentId,
        requests: &[TransferRequest],
        notify: Option<&Notification>,
    ) -> Result<BatchId> {
        let caps = self.inner.capabilities();
        let merges =
            self.enabled && coalesce(requests, true, self.max_len).requests.len() < requests.len();
        if !merges || !caps.batch_transfer || (notify.is_some() && !caps.notify) {
            return self.inner.submit(segment, requests, notify).await;
        }
        if let Some(n) = notify {
            n.validate()?;
        }
        let admission = self.batches.admit(requests.len())?;
        // The batch counts as a call in flight until it ends.
        let active = self.drain.enter("submit")?;
        let inner = Arc::clone(&self.inner);
        let (requests, notify) = (requests.to_vec(), notify.cloned());
        let (driver, max_len) = (admission.driver().clone(), self.max_len);
        let drive = async move {
            let _active = active;
            let forward = Forward {
                inner: &*inner,
                segment,
            };
            let results = run_coalesced(&forward, &requests, notify.as_ref(), true, max_len).await;
            crate::batch::report_into(&driver, requests.len(), results)
        };
        if tokio::runtime::Handle::try_current().is_ok() {
            tokio::spawn(drive);
        } else {
            // No runtime to run a task on: the batch runs to its end here.
            drive.await?;
        }
        Ok(admission.claim())
    }

    fn status(&self, batch: BatchId) -> Result<BatchStatus> {
        match self.batches.forwarded(batch) {
            Ok(_) => self.batches.status(batch),
            Err(_) => self.inner.status(batch),
        }
    }

    async fn wait(&self, batch: BatchId) -> Result<BatchReport> {
        match self.batches.forwarded(batch) {
            Ok(_) => self.batches.wait(batch).await,
            Err(_) => self.inner.wait(batch).await,
        }
    }

    async fn release_batch(&self, batch: BatchId) -> Result<()> {
        match self.batches.forwarded(batch) {
            Ok(_) => self.batches.release(batch),
            Err(_) => self.inner.release_batch(batch).await,
        }
    }

    fn live_batches(&self) -> Option<usize> {
        self.inner
            .live_batches()
            .map(|n| n + self.batches.tracked_len())
    }

    fn inbound(&self) -> Option<crate::inbound::Inbound> {
        self.inner.inbound()
    }

    async fn shutdown(&self) -> Result<()> {
        // New merged batches are refused; those running end as usual.
        self.drain.close();
        self.drain.idle().await;
        self.inner.shutdown().await
    }

    async fn batch_transfer(
        &self,
        segment: SegmentId,
        requests: &[TransferRequest],
        notify: Option<&Notification>,
    ) -> Result<BatchReport> {
        let forward = Forward {
            inner: &*self.inner,
            segment,
        };
        let results = run_coalesced(&forward, requests, notify, self.enabled, self.max_len).await?;
        Ok(BatchReport { results })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn merges_only_runs_that_continue_on_both_sides() {
        let reqs = [
            TransferRequest::write(0, 100, 10),
            TransferRequest::write(10, 110, 10),
            TransferRequest::write(20, 121, 10), // remote gap
            TransferRequest::read(30, 131, 10),  // op differs
            TransferRequest::read(40, 141, 0),   // zero length
            TransferRequest::read(40, 141, 5),
        ];
        let c = coalesce(&reqs, true, u64::MAX);
        assert_eq!(c.requests.len(), 5);
        assert_eq!(c.requests[0], TransferRequest::write(0, 100, 20));
        assert_eq!(c.groups, vec![0..2, 2..3, 3..4, 4..5, 5..6]);
        assert_eq!(c.expand(&[1, 2, 3, 4, 5]), vec![1, 1, 2, 3, 4, 5]);
        let off = coalesce(&reqs, false, u64::MAX);
        assert_eq!(off.requests, reqs.to_vec());
        let capped = coalesce(&reqs[..2], true, 15);
        assert_eq!(capped.requests.len(), 2);
    }
}

#[cfg(all(test, feature = "inproc"))]
mod layer_tests {
    use std::sync::Arc;

    use super::*;
    use crate::inproc::InprocEngine;
    use crate::layer::{LayerExt, Metrics, MetricsLayer};
    use crate::{Capabilities, DynTransferEngine, RegisteredBuffer};

    type Counted = CoalesceEngine<crate::layer::MetricsEngine<InprocEngine>>;

    /// A coalescing engine over a metrics layer (which counts what the
    /// engine below is asked to do), a peer, `len` registered bytes on
    /// each side, and the peer's segment open.
    struct Rig {
        a: Arc<Counted>,
        b: Arc<dyn DynTransferEngine>,
        src: RegisteredBuffer<Counted>,
        dst: RegisteredBuffer,
        peer: SegmentId,
    }

    async fn rig(len: usize) -> Rig {
        let a = Arc::new(
            InprocEngine::auto(Capabilities::all())
                .layer(MetricsLayer::new(Metrics::new()))
                .layer(CoalesceLayer::default()),
        );
        let b: Arc<dyn DynTransferEngine> = Arc::new(InprocEngine::auto(Capabilities::all()));
        let src = RegisteredBuffer::new(Arc::clone(&a), len).await.unwrap();
        let dst = RegisteredBuffer::new(Arc::clone(&b), len).await.unwrap();
        let peer = a.open_segment(b.segment_name()).await.unwrap();
        Rig {
            a,
            b,
            src,
            dst,
            peer,
        }
    }

    /// `n` contiguous 4 KiB writes from the start of `src` to `dst`.
    fn blocks(r: &Rig, n: u64) -> Vec<TransferRequest> {
        (0..n)
            .map(|i| TransferRequest::write(r.src.addr() + i * 4096, r.dst.addr() + i * 4096, 4096))
            .collect()
    }

    #[tokio::test]
    async fn contiguous_requests_reach_the_engine_merged_and_results_map_back() {
        let r = rig(64 * 1024).await;
        let (a, b, peer) = (&r.a, &r.b, r.peer);
        r.src.memory().write(0, &[7u8; 64 * 1024]).unwrap();
        let mut requests = blocks(&r, 16);
        // Past the end of the peer's region: merged with nothing (not
        // contiguous), fails on its own.
        requests.push(TransferRequest::write(
            r.src.addr(),
            r.dst.addr() + (64 << 10),
            1,
        ));
        let report = a.batch_transfer(peer, &requests, None).await.unwrap();
        assert_eq!(report.len(), 17);
        assert!(report.results[..16].iter().all(Result::is_ok));
        assert!(matches!(
            report.results[16],
            Err(Error::AddressNotRegistered { .. })
        ));
        let mut back = vec![0u8; 64 * 1024];
        r.dst.memory().read(0, &mut back).unwrap();
        assert!(back.iter().all(|&b| b == 7));
        let snap = a.get_ref().snapshot();
        let p = &snap.peers[b.segment_name()];
        assert_eq!(p.bytes_written, 64 * 1024);
        assert_eq!(p.requests_ok, 1, "16 contiguous requests merged into one");
        assert_eq!(snap.requests_failed(), 1);
    }

    #[tokio::test]
    async fn an_async_batch_with_requests_to_merge_is_the_layers_own() {
        let r = rig(8 * 4096).await;
        let (a, peer) = (&r.a, r.peer);
        let requests = blocks(&r, 8);
        let merged = a.submit(peer, &requests, None).await.unwrap();
        let report = a.wait(merged).await.unwrap();
        assert_eq!(report.results.len(), 8);
        assert!(report.is_success());
        assert_eq!(a.get_ref().snapshot().requests_ok(), 1, "merged into one");
        // Nothing to merge: the inner engine's own batch, answered by it.
        let single = a.submit(peer, &requests[..1], None).await.unwrap();
        loop {
            if a.status(single).unwrap().is_finished() {
                break;
            }
            tokio::task::yield_now().await;
        }
        a.release_batch(single).await.unwrap();
        assert_eq!(a.live_batches(), Some(0));
        a.shutdown().await.unwrap();
    }
}

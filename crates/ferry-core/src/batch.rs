//! One state machine for batches, shared by every backend and the adapter:
//! ids, per-request states, completion, the notification rule,
//! `status` / `wait` / `release`, deadlines, cancellation and the bound on
//! live batches.
//!
//! A backend moves bytes and reports what happened through a
//! [`BatchDriver`]; the trait's rules are enforced here, once:
//!
//! - A batch is finished only when its driver calls [`BatchDriver::finish`],
//!   which a backend does after the batch's notification (if any) has been
//!   handed to the transport. Until then [`BatchTable::status`] shows at
//!   least one request pending, even if every request has completed.
//! - `Err` for a batch means nothing moved. A notification that fails after
//!   data moved is reported as a failure of the last request.
//! - A driver dropped before `finish` (its task aborted, the future that
//!   owned it canceled) finishes the batch with every unreported request
//!   failed [`Error::Canceled`]: no waiter hangs, no batch stays pending.
//! - A batch whose deadline ([`BatchDriver::set_deadline`]) passes is
//!   finished: requests not reported by then fail with the deadline's error,
//!   and what the driver reports later is ignored.
//! - A table holds at most its limit ([`MAX_LIVE_BATCHES`] by default) of
//!   batches not yet waited for or released; [`BatchTable::admit`] beyond
//!   it fails with [`Error::QueueFull`].
//!
//! Batches that never get an id (`batch_transfer`, `transfer`) use a
//! [`BatchDriver::detached`] driver: the same rules, without a table.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use tokio::sync::Notify;

use crate::__private::sync::lock;
use crate::error::{batches_full, Error, Result};
use crate::types::{BatchId, BatchReport, BatchStatus, TransferState, MAX_LIVE_BATCHES};

/// The batches of one engine (or adapter) that callers hold ids for.
#[derive(Debug)]
pub struct BatchTable {
    backend: String,
    limit: usize,
    entries: Mutex<Entries>,
}

#[derive(Debug)]
struct Entries {
    map: HashMap<u64, Entry>,
}

#[derive(Debug)]
enum Entry {
    /// A batch whose state lives here.
    Tracked(Arc<Tracker>),
    /// An alias of a batch of the wrapped engine (the adapter forwarding a
    /// native batch); its state lives there.
    Forwarded(BatchId),
}

impl BatchTable {
    /// An empty table for `backend` (named in its errors), holding at most
    /// [`MAX_LIVE_BATCHES`] batches.
    pub fn new(backend: impl Into<String>) -> Self {
        Self::with_limit(backend, MAX_LIVE_BATCHES)
    }

    /// An empty table holding at most `limit` batches.
    pub fn with_limit(backend: impl Into<String>, limit: usize) -> Self {
        BatchTable {
            backend: backend.into(),
            limit,
            entries: Mutex::new(Entries {
                map: HashMap::new(),
            }),
        }
    }

    /// Admits a batch of `requests` requests: a fresh id (never reused while
    /// the table lives) and the driver the backend reports through. Fails
    /// with [`Error::QueueFull`] when the table is full; nothing is admitted
    /// then.
    ///
    /// The id counts as the caller's only once [`Admission::claim`] hands
    /// it out: an admission dropped unclaimed (the batch refused, or the
    /// submitting future canceled) takes the id back, so that no batch
    /// nobody can name stays in the table.
    pub fn admit(&self, requests: usize) -> Result<Admission<'_>> {
        let driver = BatchDriver::detached(requests);
        let id = self.insert(Entry::Tracked(Arc::clone(&driver.tracker)))?;
        Ok(Admission {
            table: self,
            id,
            driver,
            claimed: false,
        })
    }

    /// Admits an alias for batch `inner` of a wrapped engine, counted
    /// against the limit like any batch.
    pub fn forward(&self, inner: BatchId) -> Result<BatchId> {
        self.insert(Entry::Forwarded(inner))
    }

    fn insert(&self, entry: Entry) -> Result<BatchId> {
        let mut e = lock(&self.entries);
        if e.map.len() >= self.limit {
            return Err(batches_full(&self.backend, self.limit));
        }
        let id = BatchId::fresh();
        e.map.insert(id.0, entry);
        Ok(id)
    }

    /// The wrapped engine's batch that `id` aliases, or `None` for a batch
    /// tracked here; [`Error::UnknownBatch`] if `id` is not in the table.
    pub fn forwarded(&self, id: BatchId) -> Result<Option<BatchId>> {
        match lock(&self.entries).map.get(&id.0) {
            Some(Entry::Forwarded(inner)) => Ok(Some(*inner)),
            Some(Entry::Tracked(_)) => Ok(None),
            None => Err(Error::UnknownBatch(id)),
        }
    }

    /// Every alias in the table: (the table's id, the wrapped engine's).
    pub fn forwarded_all(&self) -> Vec<(BatchId, BatchId)> {
        lock(&self.entries)
            .map
            .iter()
            .filter_map(|(id, e)| match e {
                Entry::Forwarded(inner) => Some((BatchId(*id), *inner)),
                Entry::Tracked(_) => None,
            })
            .collect()
    }

    /// Forgets `id` whatever its state (an alias whose wrapped batch was
    /// waited for or released). Whether it was there.
    pub fn remove(&self, id: BatchId) -> bool {
        lock(&self.entries).map.remove(&id.0).is_some()
    }

    fn tracked(&self, id: BatchId) -> Result<Arc<Tracker>> {
        match lock(&self.entries).map.get(&id.0) {
            Some(Entry::Tracked(t)) => Ok(Arc::clone(t)),
            // The caller should have resolved the alias first.
            Some(Entry::Forwarded(inner)) => Err(Error::InvalidArgument(format!(
                "batch {id} is the wrapped engine's batch {inner}"
            ))),
            None => Err(Error::UnknownBatch(id)),
        }
    }

    /// The state of each request of `id`. Never waits.
    pub fn status(&self, id: BatchId) -> Result<BatchStatus> {
        Ok(self.tracked(id)?.status())
    }

    /// Waits until `id` is finished, removes it and returns its report.
    /// Dropping the future leaves the batch in the table; a second waiter
    /// of the same batch gets [`Error::UnknownBatch`] once the first has
    /// taken it.
    pub async fn wait(&self, id: BatchId) -> Result<BatchReport> {
        let t = self.tracked(id)?;
        t.finished().await;
        {
            let mut e = lock(&self.entries);
            match e.map.get(&id.0) {
                Some(Entry::Tracked(x)) if Arc::ptr_eq(x, &t) => {
                    e.map.remove(&id.0);
                }
                _ => return Err(Error::UnknownBatch(id)),
            }
        }
        t.report()
    }

    /// Removes a finished batch; [`Error::BatchBusy`] if it is not finished
    /// (exactly when `status` shows a request pending).
    pub fn release(&self, id: BatchId) -> Result<()> {
        let mut e = lock(&self.entries);
        match e.map.get(&id.0) {
            Some(Entry::Tracked(t)) => {
                if !t.is_finished() {
                    return Err(Error::BatchBusy(id));
                }
                e.map.remove(&id.0);
                Ok(())
            }
            Some(Entry::Forwarded(inner)) => Err(Error::InvalidArgument(format!(
                "batch {id} is the wrapped engine's batch {inner}"
            ))),
            None => Err(Error::UnknownBatch(id)),
        }
    }

    /// Batches held: admitted or forwarded, not yet waited for, released or
    /// withdrawn.
    pub fn len(&self) -> usize {
        lock(&self.entries).map.len()
    }

    /// Whether no batch is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether the table holds its limit of batches (the next admission
    /// would fail with [`Error::QueueFull`]).
    pub fn is_full(&self) -> bool {
        self.len() >= self.limit
    }

    /// Batches held that are tracked here (not aliases).
    pub fn tracked_len(&self) -> usize {
        lock(&self.entries)
            .map
            .values()
            .filter(|e| matches!(e, Entry::Tracked(_)))
            .count()
    }
}

/// A batch admitted to a [`BatchTable`] whose id has not been handed out
/// yet (see [`BatchTable::admit`]).
#[derive(Debug)]
pub struct Admission<'a> {
    table: &'a BatchTable,
    id: BatchId,
    driver: BatchDriver,
    claimed: bool,
}

impl Admission<'_> {
    /// The batch's id.
    pub fn id(&self) -> BatchId {
        self.id
    }

    /// The batch's driver (clone it for the task that runs the batch).
    pub fn driver(&self) -> &BatchDriver {
        &self.driver
    }

    /// Hands the id out: from now on the batch is the caller's, until it is
    /// waited for or released.
    pub fn claim(mut self) -> BatchId {
        self.claimed = true;
        self.id
    }
}

impl Drop for Admission<'_> {
    fn drop(&mut self) {
        if !self.claimed {
            // What the batch's driver still does (a task already running)
            // goes on; only the id is taken back.
            lock(&self.table.entries).map.remove(&self.id.0);
        }
    }
}

/// The backend's side of one batch: report each request's outcome, then
/// [`finish`](BatchDriver::finish). Clones report into the same batch; when
/// the last clone is dropped before `finish`, the batch finishes with its
/// unreported requests failed [`Error::Canceled`].
#[derive(Clone, Debug)]
pub struct BatchDriver {
    tracker: Arc<Tracker>,
    _cancel: Arc<CancelOnDrop>,
}

#[derive(Debug)]
struct CancelOnDrop(Arc<Tracker>);

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        self.0.close(Some(Error::Canceled(
            "the batch was abandoned before it finished (its task or future was dropped)"
                .to_owned(),
        )));
    }
}

impl BatchDriver {
    /// A driver for a batch of `requests` requests that no table holds (a
    /// `batch_transfer` waited for in place).
    pub fn detached(requests: usize) -> Self {
        let tracker = Arc::new(Tracker {
            state: Mutex::new(State {
                results: vec![None; requests],
                transferred: vec![0; requests],
                finished: false,
                batch_error: None,
                deadline: None,
            }),
            changed: Notify::new(),
        });
        BatchDriver {
            _cancel: Arc::new(CancelOnDrop(Arc::clone(&tracker))),
            tracker,
        }
    }

    /// Number of requests.
    pub fn len(&self) -> usize {
        lock(&self.tracker.state).results.len()
    }

    /// Whether the batch has no requests.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Records that request `index` has moved `bytes` bytes so far.
    pub fn progress(&self, index: usize, bytes: u64) {
        let mut s = lock(&self.tracker.state);
        if let Some(t) = s.transferred.get_mut(index) {
            *t = (*t).max(bytes);
        }
    }

    /// Records the outcome of request `index`: its bytes have landed
    /// (`Ok`) or it failed. The first outcome of a request stands; reports
    /// after the batch finished (deadline, cancellation) are ignored, as is
    /// an index out of range.
    pub fn complete(&self, index: usize, result: Result<()>) {
        let mut s = lock(&self.tracker.state);
        if s.finished {
            return;
        }
        if let Some(slot) = s.results.get_mut(index) {
            if slot.is_none() {
                *slot = Some(result);
            }
        }
    }

    /// Fails every request not reported yet with `err`.
    pub fn fail_unreported(&self, err: &Error) {
        let mut s = lock(&self.tracker.state);
        if s.finished {
            return;
        }
        for slot in s.results.iter_mut().filter(|r| r.is_none()) {
            *slot = Some(Err(err.clone()));
        }
    }

    /// Whether every request has been reported.
    pub fn all_reported(&self) -> bool {
        lock(&self.tracker.state)
            .results
            .iter()
            .all(Option::is_some)
    }

    /// Whether every request has been reported successful: the condition
    /// for sending the batch's notification.
    pub fn all_ok(&self) -> bool {
        lock(&self.tracker.state)
            .results
            .iter()
            .all(|r| matches!(r, Some(Ok(()))))
    }

    /// From `at` on, the batch counts as finished, with every request not
    /// reported by then failed with `error` (usually [`Error::Timeout`]).
    pub fn set_deadline(&self, at: Instant, error: Error) {
        lock(&self.tracker.state).deadline = Some((at, error));
        // A waiter may be sleeping without a deadline.
        self.tracker.changed.notify_waiters();
    }

    /// Whether the batch is finished (by `finish`, its deadline or
    /// cancellation).
    pub fn is_finished(&self) -> bool {
        self.tracker.is_finished()
    }

    /// Finishes the batch. `notified` is the outcome of handing the
    /// batch's notification to the transport (`None`: no notification). A
    /// notification that failed after requests moved data fails the last
    /// request; for a batch of no requests it is the batch's error. Requests
    /// still unreported fail [`Error::Canceled`]. Returns the report (`Err`
    /// only for a batch of no requests whose notification failed). Calling
    /// it again returns the same report.
    pub fn finish(&self, notified: Option<Result<()>>) -> Result<BatchReport> {
        {
            let mut s = lock(&self.tracker.state);
            if !s.finished {
                if let Some(Err(e)) = notified {
                    match s.results.last_mut() {
                        Some(Some(last @ Ok(()))) => *last = Err(e),
                        Some(_) => {}
                        None => s.batch_error = Some(e),
                    }
                }
            }
        }
        self.tracker.close(Some(Error::Canceled(
            "the backend finished the batch without reporting this request".to_owned(),
        )));
        self.tracker.report()
    }

    /// The batch's state as [`BatchTable::status`] shows it.
    pub fn status(&self) -> BatchStatus {
        self.tracker.status()
    }

    /// Waits until the batch is finished, then returns its report (for a
    /// detached batch awaited by the backend itself).
    pub async fn wait(&self) -> Result<BatchReport> {
        self.tracker.finished().await;
        self.tracker.report()
    }
}

#[derive(Debug)]
struct Tracker {
    state: Mutex<State>,
    /// Woken when the batch finishes or its deadline changes.
    changed: Notify,
}

#[derive(Debug)]
struct State {
    /// `None` while request `i` is unreported.
    results: Vec<Option<Result<()>>>,
    transferred: Vec<u64>,
    finished: bool,
    /// The error of a batch of no requests whose notification failed.
    batch_error: Option<Error>,
    deadline: Option<(Instant, Error)>,
}

impl State {
    fn expire_if_due(&mut self) -> bool {
        if self.finished {
            return false;
        }
        let Some((at, err)) = &self.deadline else {
            return false;
        };
        if Instant::now() < *at {
            return false;
        }
        let err = err.clone();
        for slot in self.results.iter_mut().filter(|r| r.is_none()) {
            *slot = Some(Err(err.clone()));
        }
        self.finished = true;
        true
    }
}

impl Tracker {
    /// Marks the batch finished, failing unreported requests with `err`
    /// (`None`: a withdrawn batch, nothing to record). Idempotent.
    fn close(&self, err: Option<Error>) {
        {
            let mut s = lock(&self.state);
            if s.finished {
                return;
            }
            if let Some(err) = err {
                for slot in s.results.iter_mut().filter(|r| r.is_none()) {
                    *slot = Some(Err(err.clone()));
                }
            }
            s.finished = true;
        }
        self.changed.notify_waiters();
    }

    fn is_finished(&self) -> bool {
        let (expired, finished) = {
            let mut s = lock(&self.state);
            (s.expire_if_due(), s.finished)
        };
        if expired {
            self.changed.notify_waiters();
        }
        finished
    }

    async fn finished(&self) {
        loop {
            let changed = self.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            if self.is_finished() {
                return;
            }
            let deadline = lock(&self.state).deadline.as_ref().map(|(at, _)| *at);
            match deadline {
                Some(at) => {
                    let at = tokio::time::Instant::from_std(at);
                    let _ = tokio::time::timeout_at(at, changed).await;
                }
                None => changed.await,
            }
        }
    }

    fn status(&self) -> BatchStatus {
        let mut s = lock(&self.state);
        let expired = s.expire_if_due();
        let mut states: Vec<TransferState> = s
            .results
            .iter()
            .zip(&s.transferred)
            .map(|(r, &transferred)| match r {
                None => TransferState::Pending { transferred },
                Some(Ok(())) => TransferState::Completed,
                Some(Err(e)) => TransferState::Failed(e.clone()),
            })
            .collect();
        if !s.finished {
            // Every request done but the batch not finished: its
            // notification is still on its way. The batch must not look
            // finished before it is.
            if let (Some(last), Some(&transferred)) = (states.last_mut(), s.transferred.last()) {
                if last.is_terminal() {
                    *last = TransferState::Pending { transferred };
                }
            }
        }
        drop(s);
        if expired {
            self.changed.notify_waiters();
        }
        BatchStatus { states }
    }

    fn report(&self) -> Result<BatchReport> {
        let s = lock(&self.state);
        if let Some(e) = &s.batch_error {
            return Err(e.clone());
        }
        Ok(BatchReport {
            results: s
                .results
                .iter()
                .map(|r| {
                    r.clone().unwrap_or_else(|| {
                        Err(Error::Canceled("the batch ended unfinished".to_owned()))
                    })
                })
                .collect(),
        })
    }
}

/// Reports the results of a batch run by the adapter (or the coalescing
/// layer) to `driver` and
/// finishes it (its notification, if any, was sent by `run_batch`). `Err`
/// when the batch was refused as a whole.
pub(crate) fn report_into(
    driver: &BatchDriver,
    n: usize,
    results: Result<Vec<Result<()>>>,
) -> Result<BatchReport> {
    match results {
        Ok(results) => {
            for (i, r) in results.into_iter().enumerate() {
                driver.complete(i, r);
            }
            driver.finish(None)
        }
        // Refused as a whole: nothing moved. An empty batch's refusal is
        // the batch's error; otherwise every request carries it.
        Err(e) if n == 0 => driver.finish(Some(Err(e))),
        Err(e) => {
            driver.fail_unreported(&e);
            driver.finish(None)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn canceled(r: &Result<()>) -> bool {
        matches!(r, Err(Error::Canceled(_)))
    }

    #[test]
    fn a_batch_is_finished_only_by_finish_even_with_every_request_done() {
        let t = BatchTable::new("test");
        let a = t.admit(2).unwrap();
        let d = a.driver().clone();
        let id = a.claim();
        d.complete(0, Ok(()));
        d.complete(1, Ok(()));
        assert!(!t.status(id).unwrap().is_finished());
        assert!(matches!(t.release(id), Err(Error::BatchBusy(_))));
        d.finish(None).unwrap();
        assert!(t.status(id).unwrap().is_finished());
        t.release(id).unwrap();
        assert!(t.is_empty());
    }

    #[test]
    fn a_notification_failing_after_data_fails_the_last_request() {
        let d = BatchDriver::detached(2);
        d.complete(0, Ok(()));
        d.complete(1, Ok(()));
        let r = d
            .finish(Some(Err(Error::Canceled("peer gone".into()))))
            .unwrap();
        assert!(r.results[0].is_ok());
        assert!(canceled(&r.results[1]));
        // The empty batch has no request to carry it: the batch fails.
        let d = BatchDriver::detached(0);
        assert!(d.finish(Some(Err(Error::Canceled("x".into())))).is_err());
    }

    #[test]
    fn a_dropped_driver_cancels_what_it_did_not_report() {
        let t = BatchTable::new("test");
        let a = t.admit(3).unwrap();
        let d = a.driver().clone();
        let id = a.claim();
        let d2 = d.clone();
        d.complete(0, Ok(()));
        drop(d);
        assert!(
            !t.status(id).unwrap().is_finished(),
            "a clone still drives it"
        );
        drop(d2);
        let st = t.status(id).unwrap();
        assert!(st.is_finished());
        let report = st.to_report().unwrap();
        assert!(report.results[0].is_ok());
        assert!(canceled(&report.results[1]) && canceled(&report.results[2]));
    }

    #[test]
    fn the_table_is_bounded_and_ids_are_not_reused() {
        let t = BatchTable::with_limit("test", 2);
        let first = t.admit(0).unwrap();
        let da = first.driver().clone();
        let a = first.claim();
        let _b = t.admit(0).unwrap().claim();
        assert!(matches!(t.admit(0), Err(Error::QueueFull { .. })));
        assert!(matches!(
            t.forward(BatchId(7)),
            Err(Error::QueueFull { .. })
        ));
        da.finish(None).unwrap();
        t.release(a).unwrap();
        let c = t.admit(0).unwrap();
        assert!(c.id().0 > a.0);
        // Dropped unclaimed: the id is taken back.
        drop(c);
        assert_eq!(t.len(), 1);
    }

    #[test]
    fn reports_after_finishing_are_ignored_and_the_first_outcome_stands() {
        let d = BatchDriver::detached(1);
        d.complete(0, Err(Error::Canceled("first".into())));
        d.complete(0, Ok(()));
        let r = d.finish(None).unwrap();
        assert!(r.results[0].is_err());
        d.complete(0, Ok(()));
        assert!(d.finish(None).unwrap().results[0].is_err());
    }

    #[tokio::test]
    async fn wait_returns_at_the_deadline_with_unreported_requests_failed() {
        let t = BatchTable::new("test");
        let a = t.admit(2).unwrap();
        let d = a.driver().clone();
        let id = a.claim();
        d.complete(0, Ok(()));
        let at = Instant::now() + Duration::from_millis(50);
        d.set_deadline(
            at,
            Error::Timeout {
                operation: "test".into(),
                peer: None,
                after: Duration::from_millis(50),
            },
        );
        let report = t.wait(id).await.unwrap();
        assert!(Instant::now() >= at);
        assert!(report.results[0].is_ok());
        assert!(matches!(report.results[1], Err(Error::Timeout { .. })));
        // The late report changes nothing.
        d.complete(1, Ok(()));
        assert!(matches!(t.status(id), Err(Error::UnknownBatch(_))));
    }

    #[tokio::test]
    async fn a_dropped_wait_leaves_the_batch_and_a_second_wait_takes_it() {
        let t = Arc::new(BatchTable::new("test"));
        let a = t.admit(1).unwrap();
        let d = a.driver().clone();
        let id = a.claim();
        let waiting = tokio::time::timeout(Duration::from_millis(20), t.wait(id)).await;
        assert!(waiting.is_err());
        assert_eq!(t.len(), 1);
        let t2 = Arc::clone(&t);
        let w = tokio::spawn(async move { t2.wait(id).await });
        tokio::task::yield_now().await;
        d.complete(0, Ok(()));
        d.finish(None).unwrap();
        assert!(w.await.unwrap().unwrap().is_success());
        assert!(t.is_empty());
    }

    #[test]
    fn forwarded_batches_are_aliases_counted_against_the_limit() {
        let t = BatchTable::new("adapter");
        let id = t.forward(BatchId(42)).unwrap();
        assert_eq!(t.forwarded(id).unwrap(), Some(BatchId(42)));
        assert_eq!(t.tracked_len(), 0);
        assert!(t.status(id).is_err());
        assert!(t.remove(id));
        assert!(matches!(t.forwarded(id), Err(Error::UnknownBatch(_))));
    }
}

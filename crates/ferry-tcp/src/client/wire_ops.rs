//! Wire-operation counting of one pass over a batch, as the core counts it
//! ([`Requests`]: each request's frames in flight, its first error, the
//! deadline); finished requests go to the batch's [`BatchDriver`], which
//! keeps the batch rules.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use ferry_core::__private::sync::lock;
use ferry_core::raw::BatchDriver;
use ferry_core::{Error, Result};
use ferry_tcp_proto::batch::Requests;
use tokio::sync::Notify;

/// Wire-operation bookkeeping of one pass over a batch (or of one control
/// request): how many frames each request still waits for, and its first
/// error. When the last operation of a request completes, its outcome goes
/// to the batch's [`BatchDriver`] (if any); the batch rules (finishing,
/// the notification, cancellation) are the driver's.
#[derive(Debug)]
pub(crate) struct WireOps {
    /// The counting, the stale marks and the deadline (the core's).
    state: Mutex<Requests<Error>>,
    /// Every operation has completed (a mirror of the core's count, read
    /// without the lock).
    over: AtomicBool,
    done: Notify,
    /// Where finished requests are reported.
    sink: Option<Sink>,
}

/// The driver a [`WireOps`] reports to.
#[derive(Debug)]
struct Sink {
    driver: BatchDriver,
    /// The driver's index of each request here (a retry pass covers some
    /// requests of the batch); `None`: the same.
    indices: Option<Vec<usize>>,
}

impl WireOps {
    fn with_sink(n: usize, sink: Option<Sink>, hold_stale: bool) -> Arc<Self> {
        Arc::new(WireOps {
            state: Mutex::new(Requests::new(n, hold_stale)),
            over: AtomicBool::new(false),
            done: Notify::new(),
            sink,
        })
    }

    /// Starts the pass's clock: it expires `after` from now (the first
    /// call wins). Called before its first frame is sent, so that sending
    /// (moving staged bytes included) counts against the deadline.
    pub(crate) fn start_clock(&self, after: std::time::Duration) -> std::time::Instant {
        crate::io::instant(lock(&self.state).start_clock(crate::io::now(), after))
    }

    /// When the pass expires, once its clock has started.
    pub(crate) fn deadline(&self) -> Option<std::time::Instant> {
        self.deadline_time().map(crate::io::instant)
    }

    /// [`WireOps::deadline`] on the core's clock.
    pub(crate) fn deadline_time(&self) -> Option<ferry_tcp_proto::time::Time> {
        lock(&self.state).deadline()
    }

    /// Bookkeeping for `n` requests reported nowhere (control requests:
    /// read [`WireOps::results`]).
    pub(crate) fn new(n: usize) -> Arc<Self> {
        Self::with_sink(n, None, false)
    }

    /// Bookkeeping for the requests of `driver`'s batch; requests the
    /// target refused as stale are held back for a retry.
    pub(crate) fn reporting(driver: &BatchDriver) -> Arc<Self> {
        Self::with_sink(
            driver.len(),
            Some(Sink {
                driver: driver.clone(),
                indices: None,
            }),
            true,
        )
    }

    /// Bookkeeping for a retry of the requests `indices` of `driver`'s
    /// batch; every outcome, stale again or not, is final.
    pub(crate) fn retrying(driver: &BatchDriver, indices: Vec<usize>) -> Arc<Self> {
        Self::with_sink(
            indices.len(),
            Some(Sink {
                driver: driver.clone(),
                indices: Some(indices),
            }),
            false,
        )
    }

    /// Reports request `index`, which is over, to the driver.
    fn report(&self, index: usize, r: Result<()>) {
        let Some(sink) = &self.sink else { return };
        let to = match &sink.indices {
            Some(map) => match map.get(index) {
                Some(&i) => i,
                None => return,
            },
            None => index,
        };
        sink.driver.complete(to, r);
    }

    /// Sets each request's number of wire operations; must be called once
    /// before any operation is sent. Requests with none (zero length, or
    /// failed before the wire) are over now.
    pub(crate) fn arm(&self, ops_per_request: &[u32]) {
        let over = lock(&self.state).arm(ops_per_request, |i, r| self.report(i, r));
        if over {
            self.finish();
        }
    }

    fn finish(&self) {
        self.over.store(true, Ordering::Release);
        self.done.notify_waiters();
    }

    /// Records an error for a request that never reached the wire.
    pub(crate) fn fail_unsent(&self, index: usize, err: Error) {
        lock(&self.state).fail_unsent(index, err);
    }

    /// Completes one wire operation of request `index`.
    pub(crate) fn complete(&self, index: usize, r: Result<()>) {
        let over = lock(&self.state).complete(index, r, |i, r| self.report(i, r));
        if over {
            self.finish();
        }
    }

    /// Whether every operation has completed.
    pub(crate) fn is_done(&self) -> bool {
        self.over.load(Ordering::Acquire)
    }

    /// Waits until every operation has completed.
    pub(crate) async fn wait(&self) {
        loop {
            let notified = self.done.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if self.is_done() {
                return;
            }
            notified.await;
        }
    }

    /// Each request's result (meaningful once done).
    pub(crate) fn results(&self) -> Vec<Result<()>> {
        lock(&self.state).results()
    }

    /// Marks request `index` for a retry with a fresh table.
    pub(crate) fn mark_stale(&self, index: usize) {
        lock(&self.state).mark_stale(index);
    }

    /// The requests marked for a retry.
    pub(crate) fn stale(&self) -> Vec<usize> {
        lock(&self.state).stale()
    }
}

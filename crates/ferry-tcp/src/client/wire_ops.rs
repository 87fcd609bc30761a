//! Wire-operation counting of one pass over a batch: each request's frames
//! in flight and its first error; finished requests go to the batch's
//! [`BatchDriver`], which keeps the batch rules.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use ferry_core::__private::sync::lock;
use ferry_core::raw::BatchDriver;
use ferry_core::{Error, Result};
use tokio::sync::Notify;

/// Wire-operation bookkeeping of one pass over a batch (or of one control
/// request): how many frames each request still waits for, and its first
/// error. When the last operation of a request completes, its outcome goes
/// to the batch's [`BatchDriver`] (if any); the batch rules (finishing,
/// the notification, cancellation) are the driver's.
#[derive(Debug)]
pub(crate) struct WireOps {
    slots: Mutex<Vec<Slot>>,
    remaining: AtomicUsize,
    done: Notify,
    /// Where finished requests are reported.
    sink: Option<Sink>,
    /// When the pass expires (set once, before its first frame is sent).
    deadline: std::sync::OnceLock<std::time::Instant>,
}

/// The driver a [`WireOps`] reports to.
#[derive(Debug)]
struct Sink {
    driver: BatchDriver,
    /// The driver's index of each request here (a retry pass covers some
    /// requests of the batch); `None`: the same.
    indices: Option<Vec<usize>>,
    /// Requests refused as stale are held back (not reported) for a retry.
    hold_stale: bool,
}

#[derive(Debug, Default, Clone)]
struct Slot {
    left: u32,
    err: Option<Error>,
    /// The target refused part of the request because the region was
    /// registered again since the table this engine used (`StaleRegion`):
    /// the request is retried once with a fresh table.
    stale: bool,
}

impl WireOps {
    fn with_sink(n: usize, sink: Option<Sink>) -> Arc<Self> {
        Arc::new(WireOps {
            // Every request counts as pending until `arm`.
            slots: Mutex::new(vec![
                Slot {
                    left: 1,
                    err: None,
                    stale: false
                };
                n
            ]),
            // Held at 1 until `arm` sets the real count.
            remaining: AtomicUsize::new(1),
            done: Notify::new(),
            sink,
            deadline: std::sync::OnceLock::new(),
        })
    }

    /// Starts the pass's clock: it expires `after` from now (the first
    /// call wins). Called before its first frame is sent, so that sending
    /// (moving staged bytes included) counts against the deadline.
    pub(crate) fn start_clock(&self, after: std::time::Duration) -> std::time::Instant {
        *self.deadline.get_or_init(|| {
            let now = std::time::Instant::now();
            now.checked_add(after)
                .unwrap_or_else(|| now + std::time::Duration::from_secs(365 * 86_400))
        })
    }

    /// When the pass expires, once its clock has started.
    pub(crate) fn deadline(&self) -> Option<std::time::Instant> {
        self.deadline.get().copied()
    }

    /// Bookkeeping for `n` requests reported nowhere (control requests:
    /// read [`WireOps::results`]).
    pub(crate) fn new(n: usize) -> Arc<Self> {
        Self::with_sink(n, None)
    }

    /// Bookkeeping for the requests of `driver`'s batch; requests the
    /// target refused as stale are held back for a retry.
    pub(crate) fn reporting(driver: &BatchDriver) -> Arc<Self> {
        Self::with_sink(
            driver.len(),
            Some(Sink {
                driver: driver.clone(),
                indices: None,
                hold_stale: true,
            }),
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
                hold_stale: false,
            }),
        )
    }

    /// Reports request `index` to the driver if it is over.
    fn report(&self, index: usize, slot: &Slot) {
        let Some(sink) = &self.sink else { return };
        if slot.left > 0 || (slot.stale && sink.hold_stale) {
            return;
        }
        let to = match &sink.indices {
            Some(map) => match map.get(index) {
                Some(&i) => i,
                None => return,
            },
            None => index,
        };
        let r = match &slot.err {
            Some(e) => Err(e.clone()),
            None => Ok(()),
        };
        sink.driver.complete(to, r);
    }

    /// Sets each request's number of wire operations; must be called once
    /// before any operation is sent. Requests with none (zero length, or
    /// failed before the wire) are over now.
    pub(crate) fn arm(&self, ops_per_request: &[u32]) {
        let mut slots = lock(&self.slots);
        let mut total = 0usize;
        for (i, (s, &n)) in slots.iter_mut().zip(ops_per_request).enumerate() {
            s.left = n;
            total += n as usize;
            if n == 0 {
                self.report(i, s);
            }
        }
        drop(slots);
        // Replace the placeholder 1 with the real count.
        self.remaining.fetch_add(total, Ordering::AcqRel);
        self.finish_one();
    }

    fn finish_one(&self) {
        if self.remaining.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.done.notify_waiters();
        }
    }

    /// Records an error for a request that never reached the wire.
    pub(crate) fn fail_unsent(&self, index: usize, err: Error) {
        let mut slots = lock(&self.slots);
        if let Some(s) = slots.get_mut(index) {
            s.err.get_or_insert(err);
        }
    }

    /// Completes one wire operation of request `index`.
    pub(crate) fn complete(&self, index: usize, r: Result<()>) {
        {
            let mut slots = lock(&self.slots);
            if let Some(s) = slots.get_mut(index) {
                let before = s.left;
                s.left = s.left.saturating_sub(1);
                if let Err(e) = r {
                    s.err.get_or_insert(e);
                }
                if before > 0 {
                    self.report(index, s);
                }
            }
        }
        self.finish_one();
    }

    /// Whether every operation has completed.
    pub(crate) fn is_done(&self) -> bool {
        self.remaining.load(Ordering::Acquire) == 0
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
        lock(&self.slots)
            .iter()
            .map(|s| match &s.err {
                Some(e) => Err(e.clone()),
                None => Ok(()),
            })
            .collect()
    }

    /// Marks request `index` for a retry with a fresh table.
    pub(crate) fn mark_stale(&self, index: usize) {
        if let Some(s) = lock(&self.slots).get_mut(index) {
            s.stale = true;
        }
    }

    /// The requests marked for a retry.
    pub(crate) fn stale(&self) -> Vec<usize> {
        lock(&self.slots)
            .iter()
            .enumerate()
            .filter(|(_, s)| s.stale)
            .map(|(i, _)| i)
            .collect()
    }
}

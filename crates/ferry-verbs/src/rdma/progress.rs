//! How the work requests of one batch map to its requests: per-request
//! work-request counts, the first error of each, and the region guards that
//! keep local memory registered while the device may still touch it.
//!
//! This is transport bookkeeping only. The batch's rules (ids, states,
//! finished only after the notification, cancellation) live in
//! `ferry_core::batch`: a request is reported to the batch's
//! [`BatchDriver`] when its last work request is terminal.

use std::sync::Mutex;

use ferry_core::__private::sync::lock;
use ferry_core::raw::{BatchDriver, RegionGuard};
use ferry_core::Error;
use tokio::sync::Notify;

pub(crate) struct Progress {
    driver: BatchDriver,
    state: Mutex<State>,
    changed: Notify,
}

struct State {
    /// Work requests of request `i` not yet terminal.
    remaining: Vec<u32>,
    /// First error of request `i` while some of its work requests run.
    errors: Vec<Option<Error>>,
    guards: Vec<Option<RegionGuard>>,
    reported: Vec<bool>,
    /// Requests not yet reported to the driver.
    unreported: usize,
}

impl Progress {
    pub(crate) fn new(driver: BatchDriver) -> Progress {
        let n = driver.len();
        Progress {
            driver,
            state: Mutex::new(State {
                remaining: vec![0; n],
                errors: vec![None; n],
                guards: (0..n).map(|_| None).collect(),
                reported: vec![false; n],
                unreported: n,
            }),
            changed: Notify::new(),
        }
    }

    pub(crate) fn driver(&self) -> &BatchDriver {
        &self.driver
    }

    /// Request `i` is over before anything was posted for it.
    pub(crate) fn settle(&self, i: usize, result: Result<(), Error>) {
        let mut s = lock(&self.state);
        if i >= s.remaining.len() || s.remaining[i] != 0 || s.reported[i] {
            return;
        }
        s.reported[i] = true;
        drop(s);
        // Reported to the driver before it counts as reported here: the
        // batch task finishes the batch as soon as nothing is unreported.
        self.driver.complete(i, result);
        lock(&self.state).unreported -= 1;
        self.changed.notify_waiters();
    }

    /// Request `i` will be carried by `wrs` (> 0) work requests; `guard`
    /// is held until the last of them is terminal.
    pub(crate) fn arm(&self, i: usize, wrs: u32, guard: RegionGuard) {
        let mut s = lock(&self.state);
        s.remaining[i] = wrs;
        s.guards[i] = Some(guard);
    }

    /// One work request carrying bytes of each of `reqs` is terminal: the
    /// device will not touch its memory any more (a completion, or its
    /// queue pair destroyed).
    pub(crate) fn wr_done(&self, reqs: &[u32], result: &Result<(), Error>) {
        let mut done = Vec::new();
        {
            let mut s = lock(&self.state);
            for &r in reqs {
                let i = r as usize;
                if i >= s.remaining.len() || s.remaining[i] == 0 {
                    continue;
                }
                if let Err(e) = result {
                    if s.errors[i].is_none() {
                        s.errors[i] = Some(e.clone());
                    }
                }
                s.remaining[i] -= 1;
                if s.remaining[i] == 0 {
                    // The device is done with this request's memory.
                    let guard = s.guards[i].take();
                    s.reported[i] = true;
                    done.push((i, s.errors[i].take(), guard));
                }
            }
        }
        if done.is_empty() {
            return;
        }
        // Guards go before the request is reported: whoever learns that it
        // is over may unregister the region at once.
        let n = done.len();
        for (i, err, guard) in done {
            drop(guard);
            self.driver.complete(i, err.map_or(Ok(()), Err));
        }
        // Only now: the batch task finishes the batch once nothing is
        // unreported, and every outcome must be in the driver by then.
        lock(&self.state).unreported -= n;
        self.changed.notify_waiters();
    }

    /// Waits until every request is reported; returns whether all
    /// succeeded (the condition for sending the notification).
    pub(crate) async fn all_reported(&self) -> bool {
        loop {
            let notified = self.changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if lock(&self.state).unreported == 0 {
                return self.driver.all_ok();
            }
            notified.await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferry_core::raw::RegionTable;
    use ferry_core::{Location, MemoryRegion, Side, TransferState};

    fn table_with_region() -> RegionTable {
        let t = RegionTable::new();
        // SAFETY: the table never dereferences the address.
        let r =
            unsafe { MemoryRegion::from_raw_parts(0x10000 as *mut u8, 0x1000, Location::any()) };
        t.insert(r).unwrap();
        t
    }

    #[tokio::test]
    async fn request_is_reported_after_its_last_work_request_and_guard() {
        let t = table_with_region();
        let d = BatchDriver::detached(3);
        let b = Progress::new(d.clone());
        b.settle(0, Ok(()));
        b.arm(1, 2, t.acquire(0x10000, 16, Side::Local, None).unwrap());
        b.arm(2, 1, t.acquire(0x10010, 16, Side::Local, None).unwrap());
        // One WR carrying bytes of requests 1 and 2.
        b.wr_done(&[1, 2], &Ok(()));
        let st = d.status();
        assert_eq!(st.states[0], TransferState::Completed);
        assert!(matches!(st.states[1], TransferState::Pending { .. }));
        // Every request but the last done: the last shows pending until the
        // batch finishes (ferry_core::batch's rule).
        assert!(matches!(st.states[2], TransferState::Pending { .. }));
        // Request 1's guard still holds the region.
        let removal = {
            let t = t.clone();
            tokio::spawn(async move { t.remove(0x10000).await })
        };
        tokio::task::yield_now().await;
        assert!(!removal.is_finished());
        let err = Error::Canceled("test".into());
        b.wr_done(&[1], &Err(err.clone()));
        removal.await.unwrap().unwrap();
        assert!(!b.all_reported().await, "a failed request is not success");
        let report = d.finish(None).unwrap();
        assert_eq!(report.results[1], Err(err));
        assert_eq!(report.failures().count(), 1);
    }

    #[tokio::test]
    async fn duplicate_or_unknown_completions_are_ignored() {
        let d = BatchDriver::detached(1);
        let b = Progress::new(d.clone());
        let t = table_with_region();
        b.arm(0, 1, t.acquire(0x10000, 16, Side::Local, None).unwrap());
        b.wr_done(&[0, 7], &Ok(()));
        b.wr_done(&[0], &Err(Error::Canceled("late".into())));
        b.settle(0, Err(Error::Canceled("late".into())));
        assert!(b.all_reported().await);
        // A notification failing after the data fails the last request; the
        // batch is not an error.
        let report = d
            .finish(Some(Err(Error::Canceled("notify".into()))))
            .unwrap();
        assert!(matches!(report.results[0], Err(Error::Canceled(_))));
    }
}

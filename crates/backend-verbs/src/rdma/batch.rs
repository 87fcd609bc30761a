//! Progress of one batch: per-request chunk counts, results, and the
//! region guards that keep local memory registered while the device may
//! still touch it.

use std::sync::{Mutex, MutexGuard};

use tokio::sync::Notify;
use transport_core::{BatchReport, BatchStatus, Error, RegionGuard, TransferState};

pub(crate) struct Batch {
    state: Mutex<State>,
    changed: Notify,
}

struct State {
    states: Vec<TransferState>,
    /// Work requests of request `i` not yet terminal.
    remaining: Vec<u32>,
    /// First error of request `i` while some of its work requests run.
    errors: Vec<Option<Error>>,
    guards: Vec<Option<RegionGuard>>,
    /// Requests not yet terminal.
    pending: usize,
    /// All requests terminal and the notification (if any) handled.
    finished: bool,
    /// The notification could not be delivered.
    notify_error: Option<Error>,
}

impl Batch {
    pub(crate) fn new(n: usize) -> Batch {
        Batch {
            state: Mutex::new(State {
                states: vec![TransferState::Pending { transferred: 0 }; n],
                remaining: vec![0; n],
                errors: vec![None; n],
                guards: (0..n).map(|_| None).collect(),
                pending: n,
                finished: false,
                notify_error: None,
            }),
            changed: Notify::new(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // Every critical section leaves the state consistent.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Request `i` finished before anything was posted for it.
    pub(crate) fn settle(&self, i: usize, result: Result<(), Error>) {
        let mut s = self.lock();
        if s.states[i].is_terminal() {
            return;
        }
        s.states[i] = match result {
            Ok(()) => TransferState::Completed,
            Err(e) => TransferState::Failed(e),
        };
        s.guards[i] = None;
        s.pending -= 1;
        drop(s);
        self.changed.notify_waiters();
    }

    /// Request `i` will be carried by `wrs` work requests, holding `guard`.
    pub(crate) fn arm(&self, i: usize, wrs: u32, guard: RegionGuard) {
        let mut s = self.lock();
        s.remaining[i] = wrs;
        s.guards[i] = Some(guard);
    }

    /// One work request carrying bytes of each of `reqs` is terminal.
    pub(crate) fn wr_done(&self, reqs: &[u32], result: &Result<(), Error>) {
        let mut s = self.lock();
        let mut changed = false;
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
                s.states[i] = match s.errors[i].take() {
                    None => TransferState::Completed,
                    Some(e) => TransferState::Failed(e),
                };
                // The device is done with this request's memory.
                s.guards[i] = None;
                s.pending -= 1;
                changed = true;
            }
        }
        drop(s);
        if changed {
            self.changed.notify_waiters();
        }
    }

    /// Waits until every request is terminal; returns whether all succeeded.
    pub(crate) async fn all_terminal(&self) -> bool {
        loop {
            let notified = self.changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            {
                let s = self.lock();
                if s.pending == 0 {
                    return s.states.iter().all(|st| *st == TransferState::Completed);
                }
            }
            notified.await;
        }
    }

    /// Marks the batch finished (after the notification step).
    pub(crate) fn finish(&self, notify_error: Option<Error>) {
        let mut s = self.lock();
        s.finished = true;
        s.notify_error = notify_error;
        drop(s);
        self.changed.notify_waiters();
    }

    /// Waits until [`Batch::finish`] and returns the report (or the
    /// notification's delivery error).
    pub(crate) async fn finished(&self) -> Result<BatchReport, Error> {
        loop {
            let notified = self.changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            {
                let s = self.lock();
                if s.finished {
                    if let Some(e) = &s.notify_error {
                        return Err(e.clone());
                    }
                    return Ok(report(&s.states));
                }
            }
            notified.await;
        }
    }

    pub(crate) fn status(&self) -> BatchStatus {
        BatchStatus {
            states: self.lock().states.clone(),
        }
    }
}

fn report(states: &[TransferState]) -> BatchReport {
    BatchReport {
        results: states
            .iter()
            .map(|s| match s {
                TransferState::Failed(e) => Err(e.clone()),
                _ => Ok(()),
            })
            .collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use transport_core::{Location, MemoryRegion, RegionTable, Side};

    fn table_with_region() -> RegionTable {
        let t = RegionTable::new();
        // SAFETY: the table never dereferences the address.
        let r =
            unsafe { MemoryRegion::from_raw_parts(0x10000 as *mut u8, 0x1000, Location::any()) };
        t.insert(r).unwrap();
        t
    }

    #[tokio::test]
    async fn request_is_terminal_after_its_last_work_request() {
        let t = table_with_region();
        let b = Batch::new(3);
        b.settle(0, Ok(()));
        b.arm(1, 2, t.acquire(0x10000, 16, Side::Local, None).unwrap());
        b.arm(2, 1, t.acquire(0x10010, 16, Side::Local, None).unwrap());
        // One WR carrying bytes of requests 1 and 2.
        b.wr_done(&[1, 2], &Ok(()));
        let st = b.status();
        assert_eq!(st.states[0], TransferState::Completed);
        assert_eq!(st.states[1], TransferState::Pending { transferred: 0 });
        assert_eq!(st.states[2], TransferState::Completed);
        // Request 1's guard still holds the region.
        let removal = {
            let t = t.clone();
            tokio::spawn(async move { t.remove(0x10000).await })
        };
        tokio::task::yield_now().await;
        assert!(!removal.is_finished());
        let err = Error::Canceled("test".into());
        b.wr_done(&[1], &Err(err.clone()));
        assert_eq!(b.status().states[1], TransferState::Failed(err));
        removal.await.unwrap().unwrap();
        assert!(!b.all_terminal().await, "a failed request is not success");
        b.finish(None);
        let report = b.finished().await.unwrap();
        assert_eq!(report.failures().count(), 1);
    }

    #[tokio::test]
    async fn duplicate_or_unknown_completions_are_ignored() {
        let b = Batch::new(1);
        let t = table_with_region();
        b.arm(0, 1, t.acquire(0x10000, 16, Side::Local, None).unwrap());
        b.wr_done(&[0, 7], &Ok(()));
        b.wr_done(&[0], &Err(Error::Canceled("late".into())));
        assert_eq!(b.status().states[0], TransferState::Completed);
        assert!(b.all_terminal().await);
        b.finish(Some(Error::Canceled("notify".into())));
        assert!(matches!(b.finished().await, Err(Error::Canceled(_))));
    }
}

//! The library side of batches: submitting a library batch, and the
//! engine's poller thread, which polls every live library batch, reports
//! each task's result, frees the batch once every task is terminal and
//! releases the memory it used.

use std::ffi::c_int;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use ferry_core::__private::sync::lock;
use ferry_core::raw::BatchDriver;
use ferry_core::{Error, RegionGuard, Result};
use tokio::sync::{watch, OwnedRwLockReadGuard};

use super::landed::{Scratch, WriteClaim};
use super::start::NameReservation;
use super::{Inner, RawEngine, BACKEND};
use crate::codes::call_error;
use crate::library::{status, CTransferRequest, CTransferStatus, MooncakeLibrary, INVALID_BATCH};

/// Region guards and the segment gate a library batch needs until the
/// library reports every task terminal (and, for a batch whose writes are
/// confirmed, until the confirmation is over: that task holds a clone).
pub(super) struct Hold {
    pub(super) _guards: Vec<RegionGuard>,
    pub(super) _gate: OwnedRwLockReadGuard<()>,
    /// The batch's write ranges, while its writes are unconfirmed (see
    /// `Scratch::claim_writes`).
    pub(super) claim: Option<WriteClaim>,
}

/// Where the poller reports a library batch's task results: the user
/// batch's driver, and the request index of each task.
pub(super) struct Report {
    pub(super) driver: BatchDriver,
    pub(super) request_of_task: Vec<usize>,
}

/// A batch submitted to the library, owned by the engine's poller thread
/// until it is freed.
pub(super) struct Live {
    c_id: u64,
    tasks: usize,
    peer: String,
    budget: Duration,
    /// Terminal result of each task, filled in by the poller.
    pub(super) results: Mutex<Vec<Option<Result<()>>>>,
    /// Released by the poller once the library is done with the batch.
    hold: Mutex<Option<Arc<Hold>>>,
    /// Reported to as tasks end, finished once the batch is freed (`None`:
    /// whoever submitted the batch reads `results` after `done`).
    report: Option<Report>,
    /// Becomes true once every task is terminal and the batch is freed.
    pub(super) done: watch::Sender<bool>,
}

/// The C engine and its library; destroyed when the last holder (the
/// engine or its poller thread) lets go.
pub(super) struct Core {
    pub(super) lib: Arc<MooncakeLibrary>,
    pub(super) raw: RawEngine,
    /// Released after the C engine (and its metadata entry) is gone.
    pub(super) _name: Option<NameReservation>,
    /// Freed after the C engine is gone.
    pub(super) _scratch: Option<Arc<Scratch>>,
}

impl Drop for Core {
    fn drop(&mut self) {
        // SAFETY: created by this library, destroyed once; every batch was
        // freed first (the poller holds the Core until its queue is empty).
        unsafe { (self.lib.api.destroy)(self.raw.0) };
    }
}

#[derive(Default)]
pub(super) struct PollQueue {
    live: Vec<Arc<Live>>,
    stop: bool,
    /// A batch was added since the poller last looked: poll it at the
    /// fastest pace (a new batch must not wait out an idle backoff).
    fresh: bool,
}

/// Shared between an engine and its poller thread.
#[derive(Default)]
pub(super) struct Poller {
    queue: Mutex<PollQueue>,
    wake: Condvar,
    pub(super) in_use: AtomicUsize,
}

impl Poller {
    /// Tells the poller thread to exit once its last batch is freed (the
    /// engine is gone).
    pub(super) fn stop(&self) {
        lock(&self.queue).stop = true;
        self.wake.notify_all();
    }
}

/// The engine's poller thread: polls every live library batch with backoff,
/// records terminal results (and reports them to the batch's driver, if it
/// has one), frees each batch once every task is terminal, then releases
/// its memory guards, finishes its driver and wakes its waiters. It holds
/// the Core, so the C engine outlives every batch; it exits when the engine
/// is gone and no batch is left.
pub(super) fn poll_loop(core: &Core, poller: &Poller) {
    let api = core.lib.api;
    let mut idle = Duration::from_micros(10);
    loop {
        let live: Vec<Arc<Live>> = {
            let mut q = lock(&poller.queue);
            while q.live.is_empty() {
                if q.stop {
                    return;
                }
                q = poller.wake.wait(q).unwrap_or_else(|p| p.into_inner());
            }
            if std::mem::take(&mut q.fresh) {
                idle = Duration::from_micros(10);
            }
            q.live.clone()
        };
        let mut progressed = false;
        for l in &live {
            let mut results = lock(&l.results);
            let mut all = true;
            for (task, slot) in results.iter_mut().enumerate() {
                if slot.is_some() {
                    continue;
                }
                let mut st = CTransferStatus::default();
                // SAFETY: `l.c_id` is a live batch of this engine (freed only
                // below, once), `task` is below the submitted count.
                let rc = unsafe { (api.get_status)(core.raw.0, l.c_id, task, &mut st) };
                match task_result(rc, st.status, l) {
                    Some(r) => {
                        if let Some(rep) = &l.report {
                            rep.driver.complete(rep.request_of_task[task], r.clone());
                        }
                        *slot = Some(r);
                        progressed = true;
                    }
                    None => all = false,
                }
            }
            drop(results);
            if !all {
                continue;
            }
            // SAFETY: every task is terminal; the batch is freed once.
            let rc = unsafe { (api.free_batch)(core.raw.0, l.c_id) };
            if rc != 0 {
                tracing::warn!(
                    code = rc,
                    name = crate::codes::code_name(i64::from(rc)),
                    "ferry: freeBatchID refused a finished batch; retrying"
                );
                continue;
            }
            debug_assert!(l.tasks > 0);
            poller.in_use.fetch_sub(1, Ordering::AcqRel);
            lock(&poller.queue).live.retain(|x| !Arc::ptr_eq(x, l));
            // The library is done with the memory: finish the batch, then
            // release the memory (once a peer's `unregister` returns, the
            // batch shows finished) and wake the waiters.
            if let Some(rep) = &l.report {
                // Such a batch has no notification (one that has is finished
                // by its confirmation task); its report is the table's.
                let _ = rep.driver.finish(None);
            }
            drop(lock(&l.hold).take());
            l.done.send_replace(true);
            progressed = true;
        }
        if progressed {
            idle = Duration::from_micros(10);
            continue;
        }
        let q = lock(&poller.queue);
        if q.fresh {
            // Added while this pass ran (its wake-up was missed): go again.
            continue;
        }
        let _ = poller.wake.wait_timeout(q, idle);
        idle = (idle * 2).min(Duration::from_millis(1));
    }
}

/// A task's terminal result, or `None` while it is still running.
fn task_result(rc: c_int, st: c_int, l: &Live) -> Option<Result<()>> {
    if rc != 0 {
        return Some(Err(call_error("getTransferStatus", i64::from(rc))));
    }
    Some(match st {
        status::WAITING | status::PENDING => return None,
        status::COMPLETED => Ok(()),
        status::TIMEOUT => Err(Error::Timeout {
            operation: "mooncake transfer (the library's own deadline)".into(),
            peer: Some(l.peer.clone()),
            after: l.budget,
        }),
        status::CANCELED => Err(Error::Canceled("Mooncake canceled the transfer".into())),
        other => {
            let status = match other {
                status::FAILED => "FAILED",
                status::INVALID => "INVALID",
                _ => "unknown",
            };
            Err(Error::TransferFailed {
                backend: BACKEND.into(),
                peer: l.peer.clone(),
                status: format!("{status} ({other})"),
                detail: "the library gives no reason; usual causes: the peer address is \
                         not inside a region the peer registered (checked by Mooncake's TCP \
                         transport from v0.3.12), or the peer is unreachable or died"
                    .into(),
            })
        }
    })
}

impl Inner {
    /// Submits `entries` as one library batch and hands it to the poller
    /// (blocking: call on the blocking pool). `hold` is released by the
    /// poller once the library is done; `report`, if any, gets each task's
    /// result and is finished then.
    pub(super) fn launch(
        &self,
        entries: Vec<CTransferRequest>,
        peer: String,
        budget: Duration,
        hold: Option<Arc<Hold>>,
        report: Option<Report>,
    ) -> Result<Arc<Live>> {
        let tasks = entries.len();
        let c_id = self.submit_c(entries)?;
        let (done, _) = watch::channel(false);
        let live = Arc::new(Live {
            c_id,
            tasks,
            peer,
            budget,
            results: Mutex::new(vec![None; tasks]),
            hold: Mutex::new(hold),
            report,
            done,
        });
        let mut q = lock(&self.poller.queue);
        q.live.push(Arc::clone(&live));
        q.fresh = true;
        self.poller.wake.notify_one();
        Ok(live)
    }

    fn submit_c(&self, mut entries: Vec<CTransferRequest>) -> Result<u64> {
        let api = self.lib.api;
        // SAFETY: live engine.
        let id = unsafe { (api.allocate_batch)(self.raw(), entries.len()) };
        if id == INVALID_BATCH {
            return Err(Error::Backend {
                backend: BACKEND.into(),
                operation: "allocateBatchID".into(),
                code: -1,
                name: "invalid batch id".into(),
            });
        }
        // SAFETY: live engine and batch; `entries` outlives the call
        // (Mooncake copies the requests).
        let rc = unsafe { (api.submit)(self.raw(), id, entries.as_mut_ptr(), entries.len()) };
        if rc != 0 {
            // Nothing was submitted, so the batch is not busy.
            // SAFETY: live batch, freed once.
            let free_rc = unsafe { (api.free_batch)(self.raw(), id) };
            if free_rc != 0 {
                tracing::warn!(code = free_rc, "ferry: freeBatchID after a failed submit");
            }
            return Err(call_error("submitTransfer", i64::from(rc)));
        }
        self.poller.in_use.fetch_add(1, Ordering::AcqRel);
        Ok(id)
    }
}

//! The poller thread: watches every posted NIXL request with
//! `nixl_capi_get_xfer_status`, reports outcomes through the batch's
//! [`BatchDriver`], sends notifications that could not ride on a request,
//! and releases each request only once NIXL says it is finished.
//!
//! The guarantee Ferry adds to NIXL's: a request whose batch's deadline
//! passed (the batch is then failed by `ferry_core::batch`), or whose
//! caller went away, stays here with the guards of its local and remote
//! regions until NIXL reports it done or failed. A request NIXL never
//! finishes is held for the life of the process ([`Poller::held`] counts
//! them).
//!
//! One exception: when the control connection of a segment is lost
//! (`Segment::aborted`), the peer can no longer revoke its regions from
//! this engine, so its requests still in progress are aborted
//! (`nixl_capi_release_xfer_req`, which cancels them in UCX) and their
//! batches fail with `PeerLost`. An aborted request is not proven to have
//! stopped touching memory (UCX may not cancel an operation already on
//! the wire), so the guards of its regions are kept for the life of the
//! engine, marked unproven: unregistering its local region answers
//! `RegionHeld` ([`Poller::aborted`] counts them).

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use ferry_core::__private::sync::lock;
use ferry_core::raw::BatchDriver;
use ferry_core::{Error, RegionGuard, Result};

use crate::agent::{Agent, XferReq, XferState};
use crate::engine::Segment;
use crate::library::status;

/// One posted NIXL request of a batch.
pub(crate) struct Pending {
    req: Option<XferReq>,
    indices: Vec<usize>,
    /// Local and remote region guards, dropped once NIXL released the
    /// request.
    guards: Vec<RegionGuard>,
}

impl Pending {
    pub(crate) fn new(req: XferReq, indices: Vec<usize>, guards: Vec<RegionGuard>) -> Self {
        Pending {
            req: Some(req),
            indices,
            guards,
        }
    }
}

/// A batch whose requests were posted.
pub(crate) struct Job {
    pub driver: BatchDriver,
    pub pendings: Vec<Pending>,
    /// A notification to send once every request succeeded (it did not
    /// ride on a request): `(peer agent, bytes)`.
    pub notify_after: Option<(String, Vec<u8>)>,
    /// The notification rode on the (single) request.
    pub attached: bool,
    /// The notification's confirmation token and this agent's name.
    pub token: u64,
    pub sender: String,
    pub segment: Arc<Segment>,
}

/// The engine's poller thread and its queue.
pub(crate) struct Poller {
    queue: Mutex<Vec<Job>>,
    wake: Condvar,
    stop: AtomicBool,
    held: AtomicUsize,
    /// Guards of requests aborted in progress (kept, see the module docs).
    parked: Mutex<Vec<RegionGuard>>,
    aborted: AtomicUsize,
    runtime: tokio::runtime::Handle,
    /// The thread, joined by [`Poller::stop_and_wait`].
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
}

impl Poller {
    /// Starts the thread; it runs until [`Poller::stop`] and every request
    /// it holds is finished.
    pub(crate) fn start(agent: Arc<Agent>, runtime: tokio::runtime::Handle) -> Result<Arc<Poller>> {
        let p = Arc::new(Poller {
            queue: Mutex::new(Vec::new()),
            wake: Condvar::new(),
            stop: AtomicBool::new(false),
            held: AtomicUsize::new(0),
            parked: Mutex::new(Vec::new()),
            aborted: AtomicUsize::new(0),
            runtime,
            thread: Mutex::new(None),
        });
        let p2 = Arc::clone(&p);
        let thread = std::thread::Builder::new()
            .name("ferry-nixl-poller".to_owned())
            .spawn(move || run(&p2, &agent))
            .map_err(|e| Error::io("starting the NIXL poller thread", &e))?;
        *lock(&p.thread) = Some(thread);
        Ok(p)
    }

    /// Hands a posted batch to the thread.
    pub(crate) fn push(&self, job: Job) {
        lock(&self.queue).push(job);
        self.wake.notify_one();
    }

    /// Asks the thread to end once it holds nothing.
    pub(crate) fn stop(&self) {
        self.stop.store(true, Ordering::Release);
        self.wake.notify_one();
    }

    /// [`Poller::stop`], then waits up to `limit` for the thread to end.
    /// The thread holds the agent: where it holds the last reference it
    /// destroys the agent (UCX's workers) on its way out, and a process
    /// that returned from `main` meanwhile runs UCX's static destructors
    /// under it (SIGSEGV in `ucs_profile_record` at exit, seen 1 in 60
    /// runs of `tests/exit.rs`'s child). A thread still holding requests
    /// in NIXL after `limit` is left running, with a warning.
    pub(crate) fn stop_and_wait(&self, limit: Duration) {
        self.stop();
        let Some(thread) = lock(&self.thread).take() else {
            return;
        };
        if thread.thread().id() == std::thread::current().id() {
            return;
        }
        let start = std::time::Instant::now();
        while !thread.is_finished() {
            if start.elapsed() > limit {
                tracing::warn!(
                    held = self.held(),
                    "ferry: the NIXL poller still holds requests {limit:?} after the engine was \
                     dropped; leaving it to finish on its own"
                );
                return;
            }
            std::thread::sleep(Duration::from_micros(200));
        }
        let _ = thread.join();
    }

    /// Requests held past their batch's end (deadline or cancellation).
    pub(crate) fn held(&self) -> usize {
        self.held.load(Ordering::Acquire)
    }

    /// Requests aborted in progress because their segment's control
    /// connection was lost (their regions' guards are kept).
    pub(crate) fn aborted(&self) -> usize {
        self.aborted.load(Ordering::Acquire)
    }
}

/// Aborts `p` (its segment's control connection is lost): a request NIXL
/// already finished takes the usual way ([`poll`]); one in progress is
/// released (NIXL cancels it in UCX), its batch requests fail with
/// `PeerLost`, and its guards are parked, unproven. Whether it is finished
/// (released); a request NIXL refuses to release stays (held).
fn abort(p_: &Poller, agent: &Agent, driver: &BatchDriver, seg: &Segment, p: &mut Pending) -> bool {
    let Some(req) = p.req.as_ref() else {
        return true;
    };
    if !matches!(agent.state(req), XferState::InProgress) {
        return poll(agent, driver, seg, p);
    }
    let Some(req) = p.req.take() else {
        return true;
    };
    match agent.release(req) {
        Ok(()) => {
            let reason = format!(
                "the control connection to {} was lost ({}): its NIXL request was aborted in \
                 progress",
                seg.name,
                seg.lost_reason().unwrap_or_default()
            );
            for &i in &p.indices {
                driver.complete(
                    i,
                    Err(Error::PeerLost {
                        peer: seg.name.clone(),
                        reason: reason.clone(),
                    }),
                );
            }
            let held = format!(
                "{reason}; UCX may still move bytes of it, so this region stays registered for \
                 the life of the engine"
            );
            let mut parked = lock(&p_.parked);
            for g in p.guards.drain(..) {
                g.hold_unproven(held.clone());
                parked.push(g);
            }
            p_.aborted.fetch_add(1, Ordering::AcqRel);
            true
        }
        Err(req) => {
            p.req = Some(req);
            false
        }
    }
}

fn failed(seg: &Segment, code: i32) -> Error {
    Error::TransferFailed {
        backend: "nixl".to_owned(),
        peer: seg.name.clone(),
        status: status::name(code).to_owned(),
        detail: format!(
            "nixl_capi_get_xfer_status returned {code}: the NIXL backend reported the transfer \
             failed (peer gone, connection error, or a descriptor the peer does not have)"
        ),
    }
}

/// Polls `pending` once; whether it is finished (released or held).
fn poll(agent: &Agent, driver: &BatchDriver, seg: &Segment, p: &mut Pending) -> bool {
    let Some(req) = p.req.as_ref() else {
        return true;
    };
    let outcome = match agent.state(req) {
        XferState::InProgress => return false,
        XferState::Done => Ok(()),
        XferState::Failed(code) => Err(failed(seg, code)),
    };
    for &i in &p.indices {
        driver.complete(i, outcome.clone());
    }
    if let Some(req) = p.req.take() {
        match agent.release(req) {
            Ok(()) => p.guards.clear(),
            // Finished but not released: keep it (and its guards), retry.
            Err(req) => {
                p.req = Some(req);
                return false;
            }
        }
    }
    true
}

fn run(p: &Poller, agent: &Agent) {
    let mut jobs: Vec<Job> = Vec::new();
    let mut idle_rounds: u32 = 0;
    loop {
        {
            let mut q = lock(&p.queue);
            if jobs.is_empty() && q.is_empty() {
                if p.stop.load(Ordering::Acquire) {
                    return;
                }
                let (g, _) = p
                    .wake
                    .wait_timeout(q, Duration::from_millis(100))
                    .unwrap_or_else(|e| e.into_inner());
                q = g;
            }
            jobs.append(&mut q);
        }
        let mut progressed = false;
        jobs.retain_mut(|job| {
            let mut all = true;
            let aborting = job.segment.aborted.load(Ordering::Acquire);
            for pending in &mut job.pendings {
                if pending.req.is_some() {
                    let finished = if aborting {
                        abort(p, agent, &job.driver, &job.segment, pending)
                    } else {
                        poll(agent, &job.driver, &job.segment, pending)
                    };
                    if finished {
                        progressed = true;
                    } else {
                        all = false;
                    }
                }
            }
            if !all {
                return true;
            }
            finish(agent, job, &p.runtime);
            false
        });
        // Requests still in NIXL whose batch already ended (deadline or
        // cancellation) are counted as held.
        let held: usize = jobs
            .iter()
            .filter(|j| j.driver.is_finished())
            .map(|j| j.pendings.iter().filter(|x| x.req.is_some()).count())
            .sum();
        p.held.store(held, Ordering::Release);
        if progressed {
            idle_rounds = 0;
        } else {
            idle_rounds = idle_rounds.saturating_add(1);
            if idle_rounds < 200 {
                std::thread::yield_now();
            } else {
                let us = 20u64 << (idle_rounds - 200).min(6);
                std::thread::sleep(Duration::from_micros(us.min(1000)));
            }
        }
    }
}

fn done(seg: &Segment) {
    if seg.inflight.fetch_sub(1, Ordering::AcqRel) == 1 {
        seg.idle.notify_waiters();
    }
}

/// Every request of `job` is finished: the notification (sent, then
/// confirmed by the peer), then the batch.
fn finish(agent: &Agent, job: &Job, runtime: &tokio::runtime::Handle) {
    let notifies = job.driver.all_ok() && (job.attached || job.notify_after.is_some());
    if !notifies {
        let _ = job.driver.finish(None);
        done(&job.segment);
        return;
    }
    if let Some((peer, bytes)) = &job.notify_after {
        if let Err(e) = agent.gen_notif(peer, bytes) {
            let _ = job.driver.finish(Some(Err(e)));
            done(&job.segment);
            return;
        }
    }
    let (driver, seg, token, sender) = (
        job.driver.clone(),
        Arc::clone(&job.segment),
        job.token,
        job.sender.clone(),
    );
    runtime.spawn(async move {
        let r = seg.confirm(token, &sender).await;
        let _ = driver.finish(Some(r));
        done(&seg);
    });
}

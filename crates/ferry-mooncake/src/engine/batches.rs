//! Batches as the caller sees them: checking the requests, submitting the
//! library batch, confirming writes and sending the notification. Every
//! outcome is reported through a [`BatchDriver`]; the rules of the trait
//! (ids, states, when a batch is finished, deadlines, cancellation) are
//! `ferry_core::batch`'s, not this module's.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ferry_core::__private::sync::lock;
use ferry_core::raw::BatchDriver;
use ferry_core::{
    Error, Notification, RegionTable, Result, SegmentId, Side, TransferOp, TransferRequest,
};
use tokio::sync::{oneshot, OwnedRwLockReadGuard};

use super::landed::{self, Probe};
use super::poller::{Hold, Live, Report};
use super::{blocking, MooncakeEngine};
use crate::library::{CTransferRequest, OPCODE_READ, OPCODE_WRITE};

/// A segment handle checked and held for one batch (see
/// [`MooncakeEngine::open_batch`]).
pub(super) struct Target {
    c_id: i32,
    peer: String,
    gate: OwnedRwLockReadGuard<()>,
    peer_table: Option<RegionTable>,
    /// Whether writes to this peer are confirmed by reading them back (see
    /// `landed`): this build does not know when they land, or the peer's
    /// generation does not acknowledge them.
    confirm: bool,
}

/// A batch checked and held by [`MooncakeEngine::start_batch`], handed to
/// the task that runs it.
struct Prepared {
    c_id: i32,
    peer: String,
    hold: Hold,
    entries: Vec<CTransferRequest>,
    /// The request of each library task.
    request_of_task: Vec<usize>,
    /// Whether a request was refused before submitting.
    refused_any: bool,
    budget: Duration,
    deadline: Instant,
    notify: Option<Notification>,
    driver: BatchDriver,
    /// See [`Target::confirm`].
    confirm_writes: bool,
}

/// Writes left out of a batch because other writes of it cover them (see
/// `landed::plan_probes`), and the errors of requests refused after the
/// probes.
struct Shadows {
    /// (request, the requests whose results decide its own).
    shadows: Vec<(usize, Vec<usize>)>,
    early: HashMap<usize, Error>,
}

/// Reports each shadowed write: it succeeds when every write covering it
/// did (its bytes are theirs), else it fails with the first of their errors.
fn complete_shadows(
    driver: &BatchDriver,
    shadows: &[(usize, Vec<usize>)],
    result_of: impl Fn(usize) -> Result<()>,
) {
    for (request, cover) in shadows {
        let r = cover
            .iter()
            .map(|&c| result_of(c))
            .find(Result::is_err)
            .unwrap_or(Ok(()));
        driver.complete(*request, r);
    }
}

/// The error of requests not done by the batch's deadline.
fn batch_timeout(peer: &str, budget: Duration) -> Error {
    Error::Timeout {
        operation: "mooncake batch".into(),
        peer: Some(peer.to_owned()),
        after: budget,
    }
}

impl MooncakeEngine {
    /// The checks made before a batch is admitted: the notification can be
    /// sent with this build and is valid, and `segment` is an open handle,
    /// whose gate is held (a `close_segment` waits for the batch).
    pub(super) async fn open_batch(
        &self,
        segment: SegmentId,
        notify: Option<&Notification>,
    ) -> Result<Target> {
        let inner = &self.inner;
        if let Some(n) = notify {
            if !self.has_notify() {
                return Err(self.refuse_notify());
            }
            n.validate()?;
        }
        let (c_id, peer, gate, peer_table, unacknowledged_peer) = {
            let segs = lock(&inner.segments);
            let s = segs
                .by_id
                .get(&segment.0)
                .ok_or(Error::UnknownSegment(segment))?;
            (
                s.c_id,
                s.name.clone(),
                Arc::clone(&s.gate),
                s.peer.clone(),
                s.unacknowledged_peer,
            )
        };
        let gate = gate.read_owned().await;
        if !lock(&inner.segments).by_id.contains_key(&segment.0) {
            return Err(Error::UnknownSegment(segment));
        }
        let confirm =
            self.confirms_writes() || (unacknowledged_peer && self.inner.scratch.is_some());
        Ok(Target {
            c_id,
            peer,
            gate,
            peer_table,
            confirm,
        })
    }

    /// Checks `requests`, submits the ones that can run as one library batch
    /// and arranges for every outcome to reach `driver`: requests refused
    /// up front at once, library tasks from the poller thread (or, when
    /// writes are confirmed or a notification goes with the batch, from a
    /// task that confirms, notifies and then finishes the batch). Sets the
    /// batch's deadline.
    ///
    /// `Err` means nothing was submitted (the driver is then to be dropped).
    /// Dropped, this future leaves the rest to the task that runs the batch:
    /// it submits nothing more if it has not submitted yet, and it keeps the
    /// batch's memory until every probe and library batch it started is
    /// done with it (and, for confirmed writes, until they have landed).
    pub(super) async fn start_batch(
        &self,
        target: Target,
        requests: &[TransferRequest],
        notify: Option<&Notification>,
        driver: &BatchDriver,
    ) -> Result<()> {
        let inner = &self.inner;
        let Target {
            c_id,
            peer,
            gate,
            peer_table,
            confirm,
        } = target;
        let mut guards = Vec::new();
        let mut entries: Vec<CTransferRequest> = Vec::new();
        // The request of each library task.
        let mut request_of_task: Vec<usize> = Vec::new();
        let mut refused_any = false;
        let mut bytes = 0u64;
        for (i, r) in requests.iter().enumerate() {
            if r.len == 0 {
                driver.complete(i, Ok(()));
                continue;
            }
            let local = match inner
                .regions
                .acquire(r.local_addr, r.len, Side::Local, None)
            {
                Ok(g) => g,
                Err(e) => {
                    driver.complete(i, Err(e));
                    refused_any = true;
                    continue;
                }
            };
            let remote = match &peer_table {
                Some(t) => match t.acquire(r.remote_addr, r.len, Side::Remote, Some(&peer)) {
                    Ok(g) => Some(g),
                    Err(e) => {
                        driver.complete(i, Err(e));
                        refused_any = true;
                        continue;
                    }
                },
                None => None,
            };
            guards.push(local);
            guards.extend(remote);
            request_of_task.push(i);
            bytes = bytes.saturating_add(r.len);
            entries.push(CTransferRequest {
                opcode: match r.op {
                    TransferOp::Read => OPCODE_READ,
                    TransferOp::Write => OPCODE_WRITE,
                },
                source: r.local_addr as usize as *mut c_void,
                target_id: c_id,
                file_id_or_padding: 0,
                target_offset: r.remote_addr,
                length: r.len,
            });
        }
        let budget = inner.config.deadline_for(bytes);
        let deadline = Instant::now() + budget;
        driver.set_deadline(deadline, batch_timeout(&peer, budget));

        // The rest runs in a task of its own: probing the write targets,
        // submitting, confirming, notifying. A caller that drops this future
        // does not release the memory while a probe or a write may still
        // land (a peer's `unregister` must not return before they have).
        let (launched_tx, launched) = tokio::sync::oneshot::channel();
        let engine = self.clone();
        let batch = Prepared {
            c_id,
            peer,
            hold: Hold {
                _guards: guards,
                _gate: gate,
                claim: None,
            },
            entries,
            request_of_task,
            refused_any,
            budget,
            deadline,
            notify: notify.cloned(),
            driver: driver.clone(),
            confirm_writes: confirm,
        };
        tokio::spawn(async move { engine.run_batch(batch, launched_tx).await });
        launched.await.map_err(|_| {
            Error::Canceled("the task submitting a Mooncake batch did not finish".into())
        })?
    }

    /// The part of [`MooncakeEngine::start_batch`] that runs in its own
    /// task; tells `launched` whether the batch was submitted (or, for a
    /// batch with nothing to submit, finished).
    async fn run_batch(&self, batch: Prepared, launched: oneshot::Sender<Result<()>>) {
        let Prepared {
            c_id,
            peer,
            mut hold,
            mut entries,
            mut request_of_task,
            mut refused_any,
            budget,
            deadline,
            notify,
            driver,
            confirm_writes,
        } = batch;
        if launched.is_closed() {
            // The caller is gone before anything was sent: nobody can see
            // the batch, so nothing is.
            return;
        }

        // Writes whose landing is confirmed (see `landed`): make each
        // target's last byte differ from what the write puts there, and drop
        // the writes whose target could not be probed.
        let mut probes: Vec<(usize, Probe)> = Vec::new();
        // Writes other writes of the batch cover entirely, left out (see
        // `landed::plan_probes`): (request, the requests whose results
        // decide its own).
        let mut shadows: Vec<(usize, Vec<usize>)> = Vec::new();
        // Requests refused after the probes, with their errors (a shadowed
        // write takes the error of a refused write that covers it).
        let mut early: HashMap<usize, Error> = HashMap::new();
        if confirm_writes {
            let writes: Vec<usize> = (0..entries.len())
                .filter(|&i| entries[i].opcode == OPCODE_WRITE)
                .collect();
            let ranges: Vec<(u64, u64)> = writes
                .iter()
                .map(|&i| {
                    let e = &entries[i];
                    (e.target_offset, e.target_offset.saturating_add(e.length))
                })
                .collect();
            // Task index -> why it is not submitted.
            let mut removed: HashMap<usize, Option<Error>> = HashMap::new();
            let mut wanted: Vec<(usize, Probe)> = Vec::new();
            // No other batch of this engine may have a write to these
            // bytes in flight while they are probed and confirmed.
            let mut plans = landed::plan_probes(&ranges);
            if let (Some(scratch), false) = (self.inner.scratch.as_ref(), writes.is_empty()) {
                match scratch.claim_writes(&peer, &ranges, deadline).await {
                    Some(claim) => hold.claim = Some(claim),
                    None => {
                        // Waited out the batch's deadline: no write is sent.
                        plans.clear();
                        for &i in &writes {
                            removed.insert(i, Some(batch_timeout(&peer, budget)));
                        }
                    }
                }
            }
            for (&i, plan) in writes.iter().zip(plans) {
                match plan {
                    Ok(at) => {
                        let e = &entries[i];
                        let src = e.source as usize as u64 + (at - e.target_offset);
                        // SAFETY: inside local memory registered with this
                        // engine (the request's range), held by `hold` until
                        // the batch is done.
                        let value = unsafe { (src as usize as *const u8).read_volatile() };
                        wanted.push((
                            i,
                            Probe {
                                c_id,
                                last: at,
                                value,
                            },
                        ));
                    }
                    Err(cover) => {
                        shadows.push((
                            request_of_task[i],
                            cover.iter().map(|&w| request_of_task[writes[w]]).collect(),
                        ));
                        removed.insert(i, None);
                    }
                }
            }
            if !wanted.is_empty() {
                let just: Vec<Probe> = wanted.iter().map(|(_, p)| *p).collect();
                let ready = self.prepare_writes(&just, &peer, deadline).await;
                for ((i, p), r) in wanted.into_iter().zip(ready) {
                    match r {
                        Ok(()) => probes.push((i, p)),
                        // The probe used up the batch's deadline: the batch
                        // timed out, as it would have waiting for the write.
                        Err(Error::Timeout { .. }) => {
                            removed.insert(i, Some(batch_timeout(&peer, budget)));
                        }
                        Err(e) => {
                            removed.insert(i, Some(e));
                        }
                    }
                }
            }
            if !removed.is_empty() {
                let mut kept = Vec::with_capacity(entries.len());
                let mut kept_request = Vec::with_capacity(entries.len());
                let mut new_index = vec![usize::MAX; entries.len()];
                for (t, (e, request)) in entries.into_iter().zip(request_of_task).enumerate() {
                    match removed.remove(&t) {
                        Some(Some(err)) => {
                            refused_any = true;
                            early.insert(request, err.clone());
                            driver.complete(request, Err(err));
                        }
                        Some(None) => {}
                        None => {
                            new_index[t] = kept.len();
                            kept.push(e);
                            kept_request.push(request);
                        }
                    }
                }
                entries = kept;
                request_of_task = kept_request;
                for (t, _) in &mut probes {
                    *t = new_index[*t];
                }
            }
        }

        // The notification goes only with a batch where every request can
        // succeed; one refused up front means it is not sent.
        let notify = notify.filter(|_| !refused_any);
        if launched.is_closed() {
            // The caller is gone and nothing was submitted (the probes only
            // touched bytes the batch's writes were to overwrite): nobody
            // can see the batch, so it is not submitted.
            return;
        }

        if entries.is_empty() {
            // Every write that covers a shadowed one was refused.
            complete_shadows(&driver, &shadows, |r| {
                early.get(&r).cloned().map_or(Ok(()), Err)
            });
            // Nothing moves: a notification that cannot be sent fails the
            // batch (`Err` = nothing moved).
            let notified = match &notify {
                Some(n) => match self.gen_notify(c_id, n).await {
                    Ok(()) => Some(Ok(())),
                    Err(e) => {
                        let _ = launched.send(Err(e));
                        return;
                    }
                },
                None => None,
            };
            drop(hold);
            let _ = launched.send(driver.finish(notified).map(drop));
            return;
        }
        // The memory stays held until the library is done with the batch
        // (the poller's clone) and, for a batch finished below, until the
        // confirmation is over (this clone).
        let hold = Arc::new(hold);
        // The notification is sent by the task below once every request is
        // done (and its writes confirmed), never with the submission:
        // submitTransferWithNotify of v0.3.5 sends it before the data, that
        // of v0.3.6 on the first completed task.
        let confirm = !probes.is_empty() || notify.is_some() || !shadows.is_empty();
        let report = (!confirm).then(|| Report {
            driver: driver.clone(),
            request_of_task: request_of_task.clone(),
        });
        let this = Arc::clone(&self.inner);
        let poller_hold = Arc::clone(&hold);
        let peer_owned = peer.clone();
        let submitted =
            blocking(move || this.launch(entries, peer_owned, budget, Some(poller_hold), report))
                .await
                .and_then(|r| r);
        let live = match submitted {
            Ok(live) => {
                let _ = launched.send(Ok(()));
                live
            }
            Err(e) => {
                let _ = launched.send(Err(e));
                return;
            }
        };
        if confirm {
            self.finish_confirmed(
                live,
                hold,
                c_id,
                probes,
                request_of_task,
                Shadows { shadows, early },
                notify,
                peer,
                deadline,
                driver,
            )
            .await;
        }
    }

    /// Finishes a batch whose writes are confirmed or that has a
    /// notification: waits for the library, confirms every write it
    /// reported completed, reports each request, sends the notification if
    /// every request succeeded (and the batch's deadline has not passed),
    /// releases the memory and finishes the batch.
    #[allow(clippy::too_many_arguments)]
    async fn finish_confirmed(
        &self,
        live: Arc<Live>,
        hold: Arc<Hold>,
        c_id: i32,
        probes: Vec<(usize, Probe)>,
        request_of_task: Vec<usize>,
        shadows: Shadows,
        notify: Option<Notification>,
        peer: String,
        deadline: Instant,
        driver: BatchDriver,
    ) {
        // The library must be done with the memory before the guards go,
        // whatever the deadline says.
        let mut done = live.done.subscribe();
        let _ = done.wait_for(|d| *d).await;
        let mut results: Vec<Result<()>> = lock(&live.results)
            .iter()
            .map(|r| {
                r.clone()
                    .unwrap_or_else(|| Err(Error::Canceled("task not reported".into())))
            })
            .collect();
        let sent: Vec<(usize, Probe)> = probes
            .iter()
            .filter(|(t, _)| results[*t].is_ok())
            .copied()
            .collect();
        let just: Vec<Probe> = sent.iter().map(|(_, p)| *p).collect();
        let landed = self.confirm_writes(&just, &peer, deadline).await;
        for ((t, _), r) in sent.iter().zip(landed) {
            results[*t] = r;
        }
        let mut by_request: HashMap<usize, Result<()>> = shadows
            .early
            .into_iter()
            .map(|(r, e)| (r, Err(e)))
            .collect();
        for (t, r) in results.into_iter().enumerate() {
            by_request.insert(request_of_task[t], r.clone());
            driver.complete(request_of_task[t], r);
        }
        complete_shadows(&driver, &shadows.shadows, |r| {
            by_request.get(&r).cloned().unwrap_or(Ok(()))
        });
        let notified = match &notify {
            // A batch past its deadline has been reported failed: no
            // notification says otherwise.
            Some(n) if !driver.is_finished() && driver.all_ok() => {
                Some(self.gen_notify(c_id, n).await)
            }
            _ => None,
        };
        // The bytes are in place (or the batch failed): finish, then release
        // the memory (so that once a peer's `unregister` returns, the batch
        // shows finished).
        let _ = driver.finish(notified);
        drop(hold);
    }
}

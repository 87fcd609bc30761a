//! Driving a batch on a peer: validation against local regions and the
//! peer's table, planning into wire operations (gathered small requests,
//! chunks of large ones spread over the connections), sending, waiting
//! within the batch's deadline, the stale-table retry, and finishing with
//! the notification through the batch's [`BatchDriver`].

use std::sync::atomic::Ordering;
use std::sync::Arc;

use ferry_core::raw::BatchDriver;
use ferry_core::{Error, Notification, RegionGuard, Result, Side, TransferOp, TransferRequest};

use super::peer::Peer;
use super::send::OutOp;
use super::wire_ops::WireOps;
use crate::frame::table_lookup;
use ferry_tcp_proto::batch::{plan, Flow, Plan, Req, Then};

impl Peer {
    /// Runs a batch: validates every request locally and against the
    /// peer's table, sends the valid ones (chunked, spread over the
    /// connections), reports each request's outcome to `driver` as its
    /// last wire operation completes, then hands `notify` to the peer if
    /// every request succeeded and finishes the batch with the
    /// notification's outcome (a failed notification fails the last
    /// request; see [`BatchDriver::finish`]). Requests the target refused
    /// because their region was registered again since the table used (a
    /// different generation) are retried once with a fresh table.
    ///
    /// Dropped before it returns, the batch is canceled by the driver's
    /// rules (unreported requests fail [`Error::Canceled`]).
    pub(crate) async fn run_batch(
        self: &Arc<Self>,
        requests: &[TransferRequest],
        notify: Option<&Notification>,
        driver: &BatchDriver,
    ) -> Result<ferry_core::BatchReport> {
        let mut flow = Flow::new(notify.is_some());
        let mut notified = None;
        if let (true, Some(n)) = (flow.notify_at_submit(), notify) {
            notified = Some(self.notify(n).await);
        }
        let ops = WireOps::reporting(driver);
        self.transfer_all(requests, &ops).await;
        let mut then = flow.after_pass(ops.stale(), notify.is_some() && driver.all_ok());
        if let Then::Retry(stale) = then {
            match self.refresh_table().await {
                Ok(()) => {
                    let retry: Vec<TransferRequest> = stale.iter().map(|&i| requests[i]).collect();
                    let sub = WireOps::retrying(driver, stale);
                    self.transfer_all(&retry, &sub).await;
                }
                Err(e) => {
                    for i in stale {
                        driver.complete(i, Err(e.clone()));
                    }
                }
            }
            then = flow.after_pass(Vec::new(), notify.is_some() && driver.all_ok());
        }
        if let (Then::Notify, Some(n)) = (then, notify) {
            notified = Some(self.notify(n).await);
        }
        driver.finish(notified)
    }

    /// One pass of [`Peer::run_batch`] without the notification.
    pub(crate) async fn transfer_all(
        self: &Arc<Self>,
        requests: &[TransferRequest],
        state: &Arc<WireOps>,
    ) {
        let cfg = &self.core.config;
        // Same-host frames are one kernel copy each: larger pieces.
        let chunk = if self.same_host.load(Ordering::Relaxed) {
            cfg.same_host_chunk
        } else {
            cfg.chunk_size
        } as u64;
        let mut guards: Vec<Option<Arc<RegionGuard>>> = Vec::with_capacity(requests.len());
        let mut remote_miss = Vec::new();
        let table = self.table();
        for (i, r) in requests.iter().enumerate() {
            if r.len == 0 {
                guards.push(None);
                continue;
            }
            match self
                .core
                .regions
                .acquire(r.local_addr, r.len, Side::Local, None)
            {
                Ok(g) => {
                    if table_lookup(&table, r.remote_addr, r.len).is_none() {
                        remote_miss.push(i);
                    }
                    guards.push(Some(Arc::new(g)));
                }
                Err(e) => {
                    state.fail_unsent(i, e);
                    guards.push(None);
                }
            }
        }
        if !remote_miss.is_empty() {
            // The cached table may be stale (regions registered since the
            // handshake): refresh once, then refuse what is still outside.
            let refreshed = self.refresh_table().await;
            let table = self.table();
            for i in remote_miss {
                let r = &requests[i];
                let err = match &refreshed {
                    Err(e) => Some(e.clone()),
                    Ok(()) if table_lookup(&table, r.remote_addr, r.len).is_none() => {
                        Some(Error::AddressNotRegistered {
                            side: Side::Remote,
                            addr: r.remote_addr,
                            len: r.len,
                            peer: Some(self.name.clone()),
                        })
                    }
                    Ok(()) => None,
                };
                if let Some(e) = err {
                    state.fail_unsent(i, e);
                    guards[i] = None;
                }
            }
        }
        // The generation each request's remote range is in, from the
        // table as it is now (frames carry it; the target refuses a frame
        // whose region was registered again since).
        let table = self.table();
        // Plan the wire operations (the core's planner), each request with
        // the generation of its remote range.
        let n_conns = self.slots.len();
        let mut per_conn: Vec<Vec<OutOp>> = (0..n_conns).map(|_| Vec::new()).collect();
        let reqs = requests.iter().zip(&guards).enumerate().map(|(i, (r, g))| {
            let g = g.as_ref()?;
            let Some(gen) = table_lookup(&table, r.remote_addr, r.len) else {
                // The table changed under a concurrent refresh.
                state.fail_unsent(
                    i,
                    Error::AddressNotRegistered {
                        side: Side::Remote,
                        addr: r.remote_addr,
                        len: r.len,
                        peer: Some(self.name.clone()),
                    },
                );
                return None;
            };
            let req = Req {
                read: r.op == TransferOp::Read,
                len: r.len,
                remote: r.remote_addr,
                gen,
            };
            Some((req, Arc::clone(g)))
        });
        let Plan { counts, bytes } = plan(
            reqs,
            chunk,
            n_conns,
            || self.rr.fetch_add(1, Ordering::Relaxed),
            |c, f| per_conn[c].push(OutOp::from_frame(f)),
        );
        drop(guards);
        state.arm(&counts);
        self.start_clock(state, bytes);
        let used: Vec<usize> = (0..n_conns).filter(|c| !per_conn[*c].is_empty()).collect();
        let mut conns = Vec::with_capacity(used.len());
        if used.len() == 1 {
            let c = used[0];
            let ops = std::mem::take(&mut per_conn[c]);
            conns.extend(self.send_on(c, state, ops).await);
        } else if !used.is_empty() {
            let sends = used.iter().map(|&c| {
                let ops = std::mem::take(&mut per_conn[c]);
                self.send_on(c, state, ops)
            });
            conns.extend(futures::future::join_all(sends).await.into_iter().flatten());
        }
        self.await_state(state, &conns, bytes).await;
    }
}

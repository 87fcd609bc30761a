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
use super::send::{OutKind, OutOp, Part};
use super::wire_ops::WireOps;
use crate::frame::{table_lookup, MAX_SEGMENTS};

/// Requests up to this size are gathered into WRITEV / READV frames.
pub(crate) const GATHER_MAX_SEGMENT: u64 = 64 * 1024;
/// Most payload bytes per WRITEV / READV frame.
pub(crate) const GATHER_MAX_BYTES: u64 = 4 << 20;

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
        let ops = WireOps::reporting(driver);
        self.transfer_all(requests, &ops).await;
        let stale = ops.stale();
        if !stale.is_empty() {
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
        }
        let notified = match notify {
            Some(n) if driver.all_ok() => Some(self.notify(n).await),
            _ => None,
        };
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
        // Plan the wire operations.
        let n_conns = self.slots.len();
        let mut per_conn: Vec<Vec<OutOp>> = (0..n_conns).map(|_| Vec::new()).collect();
        let mut counts = vec![0u32; requests.len()];
        let mut bytes = 0u64;
        // Requests that fit in one chunk all go to connection 0: in order,
        // pipelined, and the other connections stay idle (and do not poll)
        // unless large requests are split over them.
        let home = 0;
        // Small writes (reads) are gathered into WRITEV (READV) frames: one
        // system call on the target for all of them.
        let mut groups: [(Vec<Part>, u64); 2] = [(Vec::new(), 0), (Vec::new(), 0)];
        let flush = |g: &mut (Vec<Part>, u64), read: bool, out: &mut Vec<OutOp>| {
            g.1 = 0;
            match g.0.len() {
                0 => {}
                1 => {
                    if let Some(Part {
                        index,
                        guard,
                        off,
                        len,
                        remote,
                        gen,
                    }) = g.0.pop()
                    {
                        let kind = if read {
                            OutKind::Read {
                                guard,
                                off,
                                len,
                                remote,
                                gen,
                            }
                        } else {
                            OutKind::Write {
                                guard,
                                off,
                                len,
                                remote,
                                gen,
                            }
                        };
                        out.push(OutOp { index, kind });
                    }
                }
                _ => {
                    let parts = std::mem::take(&mut g.0);
                    let index = parts[0].index;
                    let kind = if read {
                        OutKind::ReadV(parts)
                    } else {
                        OutKind::WriteV(parts)
                    };
                    out.push(OutOp { index, kind });
                }
            }
        };
        for (i, (r, g)) in requests.iter().zip(&guards).enumerate() {
            let Some(g) = g else { continue };
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
                continue;
            };
            bytes += r.len;
            if r.len <= GATHER_MAX_SEGMENT.min(chunk) {
                let read = r.op == TransferOp::Read;
                let grp = &mut groups[read as usize];
                if grp.0.len() == MAX_SEGMENTS as usize || grp.1 + r.len > GATHER_MAX_BYTES {
                    flush(grp, read, &mut per_conn[home]);
                }
                grp.0.push(Part {
                    index: i,
                    guard: Arc::clone(g),
                    off: 0,
                    len: r.len,
                    remote: r.remote_addr,
                    gen,
                });
                grp.1 += r.len;
                counts[i] += 1;
                continue;
            }
            let mut off = 0;
            while off < r.len {
                let len = chunk.min(r.len - off);
                let kind = match r.op {
                    TransferOp::Write => OutKind::Write {
                        guard: Arc::clone(g),
                        off,
                        len,
                        remote: r.remote_addr + off,
                        gen,
                    },
                    TransferOp::Read => OutKind::Read {
                        guard: Arc::clone(g),
                        off,
                        len,
                        remote: r.remote_addr + off,
                        gen,
                    },
                };
                // Chunks of requests larger than one chunk are spread.
                let c = if n_conns == 1 || r.len <= chunk {
                    home
                } else {
                    self.rr.fetch_add(1, Ordering::Relaxed) % n_conns
                };
                if c == home {
                    // Keep the order of requests on the home connection.
                    let [w, rd] = &mut groups;
                    flush(w, false, &mut per_conn[home]);
                    flush(rd, true, &mut per_conn[home]);
                }
                per_conn[c].push(OutOp { index: i, kind });
                counts[i] += 1;
                off += len;
            }
        }
        {
            let [w, rd] = &mut groups;
            flush(w, false, &mut per_conn[home]);
            flush(rd, true, &mut per_conn[home]);
        }
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

//! Confirming that writes landed, on builds whose TCP transport reports a
//! write completed when it is sent.
//!
//! Mooncake's TCP transport before v0.3.12 sends each request over a fresh
//! connection with no acknowledgement: the client marks the write completed
//! once its last byte is in the socket, and the target `recv`s the payload
//! straight into memory, front to back. So the last byte of a request lands
//! last, and once it holds the written value the whole request has landed.
//!
//! Ferry confirms each write with that property:
//!
//! 1. before submitting, it reads the target's last byte; if it already
//!    holds the value being written, it first writes the complement there
//!    and reads it back until it shows (so a later match can only come from
//!    the write itself);
//! 2. after the library reports the write completed, it reads the last byte
//!    back until it holds the written value, within the batch's deadline.
//!
//! A complement or write sent but not seen by the deadline fails the batch,
//! but may still land: it is read back for a while longer (`LATE_LANDING`)
//! before the batch's memory is released.
//!
//! A later match must come from the write itself, not from a write of
//! another batch putting the same value there: a batch's writes wait until
//! no other batch of the engine has a write overlapping them in flight
//! (`Scratch::claim_writes`). Writes of other engines to the same bytes are
//! not ordered with them and can still fool a confirmation.
//!
//! The batch keeps its memory guards (and the peer's, for peers in this
//! process) until then, so `status` says finished, `unregister` returns and
//! a notification is sent only after the bytes are in the peer's memory.

use std::ffi::c_void;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ferry_core::{Error, Result};
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};

use super::poller::Live;
use super::{blocking, lock, MooncakeEngine, BACKEND};
use crate::library::{CTransferRequest, OPCODE_READ, OPCODE_WRITE};

/// How long, past a batch's deadline, a write or complement that was sent
/// but not seen to land is still read back before the batch's memory is
/// released: the library reported it sent, so it may land any time, and
/// it must not land after the peer's `unregister` returned.
const LATE_LANDING: Duration = Duration::from_secs(3);

/// Probe slots in one engine's scratch memory (two bytes each: the byte read
/// back and the complement written before a write).
pub(super) const SLOTS: usize = 16 * 1024;

/// Memory registered with the library (never in the engine's region table,
/// so peers in this process cannot reach it) that probes read into and
/// write from. Freed only after the C engine is destroyed (the `Core` holds
/// it too).
pub(super) struct Scratch {
    ptr: *mut u8,
    free: Mutex<Vec<usize>>,
    permits: Arc<Semaphore>,
    /// Target ranges of the batches whose writes are in flight (claimed
    /// before their probes, released once they are confirmed; see
    /// [`Scratch::claim_writes`]).
    writing: Mutex<Vec<InFlight>>,
    /// Woken whenever a claim is released.
    settled: Notify,
    next_claim: AtomicU64,
}

/// One write range a batch has in flight.
struct InFlight {
    claim: u64,
    peer: String,
    start: u64,
    end: u64,
}

/// The write ranges of one batch, claimed against the other batches of the
/// engine (see [`Scratch::claim_writes`]); released when dropped (it goes
/// with the batch's memory guards, after its writes are confirmed).
pub(super) struct WriteClaim {
    scratch: Arc<Scratch>,
    claim: u64,
}

impl Drop for WriteClaim {
    fn drop(&mut self) {
        lock(&self.scratch.writing).retain(|w| w.claim != self.claim);
        self.scratch.settled.notify_waiters();
    }
}

// SAFETY: the buffer is only touched through raw pointers at slots that one
// probe owns at a time (see `Slots`), and by the library.
unsafe impl Send for Scratch {}
// SAFETY: as above.
unsafe impl Sync for Scratch {}

impl Scratch {
    /// Allocates the (zeroed) scratch buffer.
    pub(super) fn new() -> Scratch {
        let buf = vec![0u8; Self::LEN].into_boxed_slice();
        Scratch {
            ptr: Box::into_raw(buf).cast::<u8>(),
            free: Mutex::new((0..SLOTS).rev().collect()),
            permits: Arc::new(Semaphore::new(SLOTS)),
            writing: Mutex::new(Vec::new()),
            settled: Notify::new(),
            next_claim: AtomicU64::new(0),
        }
    }

    /// Claims the target ranges `[start, end)` of one batch's writes to
    /// `peer`, first waiting (until `deadline`: `None` then) while another
    /// batch of this engine has a write overlapping one of them in flight.
    ///
    /// A write is confirmed by its last byte showing the written value, so
    /// no other write may put that value there between the probe and the
    /// confirmation: a concurrent batch writing the same bytes (the same
    /// requests again, say) would otherwise confirm it before it lands, and
    /// its memory would be released with the write still to land (after
    /// the peer's `unregister` returned). So overlapping writes of
    /// different batches run one batch after the other.
    pub(super) async fn claim_writes(
        self: &Arc<Self>,
        peer: &str,
        ranges: &[(u64, u64)],
        deadline: Instant,
    ) -> Option<WriteClaim> {
        let claim = self.next_claim.fetch_add(1, Ordering::Relaxed);
        loop {
            let settled = self.settled.notified();
            tokio::pin!(settled);
            // Registered before looking, so a release in between wakes it.
            settled.as_mut().enable();
            {
                let mut writing = lock(&self.writing);
                let busy = writing.iter().any(|w| {
                    w.peer == peer && ranges.iter().any(|&(s, e)| w.start < e && s < w.end)
                });
                if !busy {
                    writing.extend(ranges.iter().filter(|(s, e)| s < e).map(|&(start, end)| {
                        InFlight {
                            claim,
                            peer: peer.to_owned(),
                            start,
                            end,
                        }
                    }));
                    return Some(WriteClaim {
                        scratch: Arc::clone(self),
                        claim,
                    });
                }
            }
            tokio::time::timeout_at(tokio::time::Instant::from_std(deadline), settled)
                .await
                .ok()?;
        }
    }

    /// Length in bytes.
    pub(super) const LEN: usize = 2 * SLOTS;

    /// Start of the buffer (for `registerLocalMemory`).
    pub(super) fn addr(&self) -> *mut c_void {
        self.ptr.cast()
    }

    /// Takes `n` (≤ [`SLOTS`]) slots, waiting for other probes to return
    /// theirs.
    async fn take(self: &Arc<Self>, n: usize) -> Result<Slots> {
        let permit = Arc::clone(&self.permits)
            .acquire_many_owned(n as u32)
            .await
            .map_err(|_| Error::Canceled("the engine is shutting down".into()))?;
        let mut free = lock(&self.free);
        let at = free.len() - n;
        let slots = free.split_off(at);
        Ok(Slots {
            scratch: Arc::clone(self),
            slots,
            _permit: Some(permit),
        })
    }

    fn probe_ptr(&self, slot: usize) -> *mut u8 {
        debug_assert!(slot < SLOTS);
        // SAFETY: inside the allocation (2 * SLOTS bytes).
        unsafe { self.ptr.add(2 * slot) }
    }

    fn flip_ptr(&self, slot: usize) -> *mut u8 {
        // SAFETY: inside the allocation (2 * SLOTS bytes).
        unsafe { self.ptr.add(2 * slot + 1) }
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` as a boxed slice of LEN bytes and freed
        // once; the library is done with it (see the type's docs).
        drop(unsafe { Box::from_raw(std::ptr::slice_from_raw_parts_mut(self.ptr, Self::LEN)) });
    }
}

/// Slots one probe owns; returned to the scratch when dropped.
struct Slots {
    scratch: Arc<Scratch>,
    slots: Vec<usize>,
    _permit: Option<OwnedSemaphorePermit>,
}

impl Drop for Slots {
    fn drop(&mut self) {
        lock(&self.scratch.free).append(&mut self.slots);
    }
}

/// Holds a probe's slots while an internal batch may write into them (see
/// `internal_batch`).
struct KeepUntilDone<'a> {
    live: Arc<Live>,
    slots: &'a mut Option<Slots>,
}

impl KeepUntilDone<'_> {
    /// Called when the wait is over: the slots stay with the caller if the
    /// library is done, else they are parked until it is.
    fn release(&mut self) {
        if !*self.live.done.borrow() {
            park(Arc::clone(&self.live), self.slots.take());
        }
    }
}

impl Drop for KeepUntilDone<'_> {
    fn drop(&mut self) {
        if !*self.live.done.borrow() {
            park(Arc::clone(&self.live), self.slots.take());
        }
    }
}

/// Returns `slots` to the scratch once `live` is done (never, if no runtime
/// is left to wait: two bytes per slot are then lost, not reused).
fn park(live: Arc<Live>, slots: Option<Slots>) {
    let Some(slots) = slots else { return };
    match tokio::runtime::Handle::try_current() {
        Ok(rt) => {
            let mut done = live.done.subscribe();
            rt.spawn(async move {
                let _ = done.wait_for(|d| *d).await;
                drop(slots);
            });
        }
        Err(_) => std::mem::forget(slots),
    }
}

/// One write to confirm: where its last byte goes and what it must become.
#[derive(Clone, Copy, Debug)]
pub(super) struct Probe {
    /// Segment id in the library.
    pub c_id: i32,
    /// Remote address of the write's last byte.
    pub last: u64,
    /// The value the write puts there.
    pub value: u8,
}

impl MooncakeEngine {
    /// Runs `entries` as an internal library batch and waits for it, within
    /// `deadline`. One result per entry. The batch holds no memory guards:
    /// its local memory is scratch slots the caller owns until this returns
    /// (or, past the deadline, until the library is done: the slots go back
    /// only then).
    async fn internal_batch(
        &self,
        entries: Vec<CTransferRequest>,
        peer: &str,
        deadline: Instant,
        slots: &mut Option<Slots>,
    ) -> Vec<Result<()>> {
        let n = entries.len();
        let this = Arc::clone(&self.inner);
        let budget = deadline.saturating_duration_since(Instant::now());
        let peer_owned = peer.to_owned();
        let submitted = blocking(move || this.launch(entries, peer_owned, budget, None, None))
            .await
            .and_then(|r| r);
        let live = match submitted {
            Ok(l) => l,
            Err(e) => return vec![Err(e); n],
        };
        // If this future is dropped, or the deadline passes, while the
        // library may still write into the slots, they go back only when it
        // is done with the batch.
        let mut keep = KeepUntilDone {
            live: Arc::clone(&live),
            slots,
        };
        let mut done = live.done.subscribe();
        let _ = tokio::time::timeout_at(
            tokio::time::Instant::from_std(deadline),
            done.wait_for(|d| *d),
        )
        .await;
        keep.release();
        let results = lock(&live.results).clone();
        results
            .into_iter()
            .map(|r| {
                r.unwrap_or_else(|| {
                    Err(Error::Timeout {
                        operation: "confirming that a write landed".into(),
                        peer: Some(peer.to_owned()),
                        after: budget,
                    })
                })
            })
            .collect()
    }

    /// Reads the byte at each probe's `last` into its slot, until `accept`
    /// holds for it or the deadline passes. `results[i]` becomes the outcome
    /// of probe `i`; probes already failed are skipped.
    async fn read_until(
        &self,
        probes: &[Probe],
        slots: &mut Option<Slots>,
        accept: impl Fn(usize, u8) -> bool,
        peer: &str,
        deadline: Instant,
        results: &mut [Option<Result<()>>],
    ) {
        // Each round is a network round trip, which paces the first ones;
        // after those, sleep (tokio's timer has millisecond resolution).
        let mut rounds = 0u32;
        let started = Instant::now();
        loop {
            let open: Vec<usize> = (0..probes.len())
                .filter(|&i| results[i].is_none())
                .collect();
            if open.is_empty() {
                return;
            }
            let Some(s) = slots.as_ref() else {
                for i in open {
                    results[i] = Some(Err(Error::Canceled(
                        "probe memory abandoned after a timeout".into(),
                    )));
                }
                return;
            };
            let entries: Vec<CTransferRequest> = open
                .iter()
                .map(|&i| CTransferRequest {
                    opcode: OPCODE_READ,
                    source: s.scratch.probe_ptr(s.slots[i]).cast(),
                    target_id: probes[i].c_id,
                    file_id_or_padding: 0,
                    target_offset: probes[i].last,
                    length: 1,
                })
                .collect();
            let got = self.internal_batch(entries, peer, deadline, slots).await;
            for (&i, r) in open.iter().zip(got) {
                match r {
                    Err(e) => results[i] = Some(Err(e)),
                    Ok(()) => {
                        // The slots are gone when the deadline passed just
                        // before the library finished (they were parked):
                        // the next round reports that.
                        let Some(s) = slots.as_ref() else { continue };
                        // SAFETY: the slot is ours and the library finished
                        // the READ into it.
                        let b = unsafe { s.scratch.probe_ptr(s.slots[i]).read_volatile() };
                        if accept(i, b) {
                            results[i] = Some(Ok(()));
                        }
                    }
                }
            }
            if results.iter().all(Option::is_some) {
                return;
            }
            if Instant::now() >= deadline {
                for r in results.iter_mut().filter(|r| r.is_none()) {
                    *r = Some(Err(Error::Timeout {
                        operation: "confirming that a write landed".into(),
                        peer: Some(peer.to_owned()),
                        after: started.elapsed(),
                    }));
                }
                return;
            }
            rounds += 1;
            if rounds > 8 {
                let ms = u64::from((rounds - 8).min(5));
                tokio::time::sleep(Duration::from_millis(ms)).await;
            }
        }
    }

    /// Reads the probes `late` of `probes` (sent, not seen to land by the
    /// batch's deadline) for up to [`LATE_LANDING`] more, until `accept`
    /// holds for each, so that the batch's memory is released only after
    /// they landed; warns about those that still did not show.
    async fn await_late(
        &self,
        probes: &[Probe],
        late: &[usize],
        slots: &mut Option<Slots>,
        accept: impl Fn(usize, u8) -> bool,
        peer: &str,
    ) {
        if late.is_empty() {
            return;
        }
        if slots.is_none() {
            // Abandoned to a library batch past the deadline: read into
            // fresh ones.
            if let Some(scratch) = self.inner.scratch.as_ref() {
                *slots = scratch.take(probes.len()).await.ok();
            }
        }
        let mut results: Vec<Option<Result<()>>> = vec![Some(Ok(())); probes.len()];
        for &i in late {
            results[i] = None;
        }
        self.read_until(
            probes,
            slots,
            accept,
            peer,
            Instant::now() + LATE_LANDING,
            &mut results,
        )
        .await;
        let missing = late
            .iter()
            .filter(|&&i| !matches!(results[i], Some(Ok(()))))
            .count();
        if missing > 0 {
            tracing::warn!(
                peer,
                missing,
                after = ?LATE_LANDING,
                "ferry: writes sent to a peer were not seen to land even after the batch's \
                 deadline; releasing their memory (they may still land there)"
            );
        }
    }

    /// Step 1 (before a batch is submitted): makes the target's last byte of
    /// every write differ from the value the write puts there. One result
    /// per probe; a failed probe's write must not be submitted.
    pub(super) async fn prepare_writes(
        &self,
        probes: &[Probe],
        peer: &str,
        deadline: Instant,
    ) -> Vec<Result<()>> {
        let mut out = Vec::with_capacity(probes.len());
        let Some(scratch) = self.inner.scratch.as_ref() else {
            // Nothing to confirm on this engine (it never makes probes).
            return probes.iter().map(|_| Ok(())).collect();
        };
        for part in probes.chunks(SLOTS) {
            let mut slots = match scratch.take(part.len()).await {
                Ok(s) => Some(s),
                Err(e) => {
                    out.extend(std::iter::repeat_n(Err(e), part.len()));
                    continue;
                }
            };
            // Read what the targets hold now.
            let mut read: Vec<Option<Result<()>>> = vec![None; part.len()];
            let mut current = vec![0u8; part.len()];
            self.read_until(part, &mut slots, |_, _| true, peer, deadline, &mut read)
                .await;
            if let Some(s) = &slots {
                for (i, c) in current.iter_mut().enumerate() {
                    // SAFETY: our slot; its READ finished (or failed, then
                    // the value is unused).
                    *c = unsafe { s.scratch.probe_ptr(s.slots[i]).read_volatile() };
                }
            }
            let mut results: Vec<Option<Result<()>>> = read
                .into_iter()
                .map(|r| match r {
                    Some(Err(e)) => Some(Err(e)),
                    _ => None,
                })
                .collect();
            // Where the target already holds the value, write its complement.
            let same: Vec<usize> = (0..part.len())
                .filter(|&i| results[i].is_none() && current[i] == part[i].value)
                .collect();
            for (i, r) in results.iter_mut().enumerate() {
                if r.is_none() && !same.contains(&i) {
                    *r = Some(Ok(()));
                }
            }
            if !same.is_empty() && (Instant::now() >= deadline || slots.is_none()) {
                // No time left to see a complement land (or no probe memory
                // left to write it from): send none.
                for &i in &same {
                    results[i] = Some(Err(Error::TransferFailed {
                        backend: BACKEND.into(),
                        peer: peer.to_owned(),
                        status: "sent, not landed".into(),
                        detail: "the batch's deadline passed (or the probe memory ran out) \
                                 before the write's landing could be confirmed"
                            .into(),
                    }));
                }
            } else if !same.is_empty() {
                let s = slots.as_ref().expect("slots are kept while reads succeed");
                let entries: Vec<CTransferRequest> = same
                    .iter()
                    .map(|&i| {
                        let flip = s.scratch.flip_ptr(s.slots[i]);
                        // SAFETY: our slot, not in use by the library.
                        unsafe { flip.write_volatile(!part[i].value) };
                        CTransferRequest {
                            opcode: OPCODE_WRITE,
                            source: flip.cast(),
                            target_id: part[i].c_id,
                            file_id_or_padding: 0,
                            target_offset: part[i].last,
                            length: 1,
                        }
                    })
                    .collect();
                let wrote = self
                    .internal_batch(entries, peer, deadline, &mut slots)
                    .await;
                for (&i, r) in same.iter().zip(wrote) {
                    if let Err(e) = r {
                        results[i] = Some(Err(e));
                    }
                }
                // The complement is sent, not landed: read until it shows.
                self.read_until(
                    part,
                    &mut slots,
                    |i, b| b == !part[i].value,
                    peer,
                    deadline,
                    &mut results,
                )
                .await;
                // A complement sent but not seen by the deadline may still
                // land: wait for it (the batch fails all the same).
                let late: Vec<usize> = same
                    .iter()
                    .copied()
                    .filter(|&i| !matches!(results[i], Some(Ok(()))))
                    .collect();
                self.await_late(part, &late, &mut slots, |i, b| b == !part[i].value, peer)
                    .await;
            }
            out.extend(results.into_iter().map(|r| r.unwrap_or(Ok(()))));
        }
        out
    }

    /// Step 2 (after the library reported the writes completed): reads each
    /// write's last byte back until it holds the written value. One result
    /// per probe.
    pub(super) async fn confirm_writes(
        &self,
        probes: &[Probe],
        peer: &str,
        deadline: Instant,
    ) -> Vec<Result<()>> {
        let mut out = Vec::with_capacity(probes.len());
        let Some(scratch) = self.inner.scratch.as_ref() else {
            // Nothing to confirm on this engine (it never makes probes).
            return probes.iter().map(|_| Ok(())).collect();
        };
        for part in probes.chunks(SLOTS) {
            let mut slots = match scratch.take(part.len()).await {
                Ok(s) => Some(s),
                Err(e) => {
                    out.extend(std::iter::repeat_n(Err(e), part.len()));
                    continue;
                }
            };
            let mut results = vec![None; part.len()];
            self.read_until(
                part,
                &mut slots,
                |i, b| b == part[i].value,
                peer,
                deadline,
                &mut results,
            )
            .await;
            // A write sent but not seen by the deadline may still land:
            // wait for it (it is reported failed all the same).
            let late: Vec<usize> = (0..part.len())
                .filter(|&i| !matches!(results[i], Some(Ok(()))))
                .collect();
            self.await_late(part, &late, &mut slots, |i, b| b == part[i].value, peer)
                .await;
            out.extend(results.into_iter().map(|r| {
                r.unwrap_or_else(|| Err(Error::Canceled("confirmation not run".into())))
                    .map_err(|e| not_landed(peer, e))
            }));
        }
        out
    }
}

/// The error of a write whose landing could not be confirmed.
fn not_landed(peer: &str, e: Error) -> Error {
    match e {
        Error::Timeout { .. } => Error::TransferFailed {
            backend: BACKEND.into(),
            peer: peer.to_owned(),
            status: "sent, not landed".into(),
            detail: "the library reported the write sent, but its last byte did not reach \
                     the peer's memory before the deadline (old Mooncake builds write to \
                     unmapped addresses at the peer nowhere and report success)"
                .into(),
        },
        other => other,
    }
}

/// Which writes of one batch are sent and probed, and which are left out.
///
/// A write whose range other writes of the batch cover entirely cannot be
/// probed (no byte of it is its own), so its landing could never be
/// confirmed: it could land after the batch is reported, even after the
/// peer's `unregister` returned. Such writes are left out: sending them
/// first and the covering writes after them is one of the outcomes the
/// trait allows for overlapping destinations, and leaves exactly the bytes
/// of the covering writes. They are left out one at a time (the first
/// fully covered one, then the others again), so that of writes covering
/// each other (two identical writes) one is kept.
///
/// For each write: `Ok(address its probe reads)` if it is sent, or
/// `Err(indices of the sent writes that overlap it)` if it is left out.
pub(super) fn plan_probes(ranges: &[(u64, u64)]) -> Vec<std::result::Result<u64, Vec<usize>>> {
    let n = ranges.len();
    // Identical ranges first: keep the first of each (cheap, and the
    // common case of overlap).
    let mut first_of: std::collections::HashMap<(u64, u64), usize> =
        std::collections::HashMap::new();
    let mut kept: Vec<usize> = Vec::with_capacity(n);
    let mut dropped: Vec<usize> = Vec::new();
    for (i, r) in ranges.iter().enumerate() {
        if first_of.insert(*r, i).is_some() {
            dropped.push(i);
        } else {
            kept.push(i);
        }
    }
    let at = loop {
        let sub: Vec<(u64, u64)> = kept.iter().map(|&i| ranges[i]).collect();
        let at = probe_addresses(&sub);
        match at.iter().position(Option::is_none) {
            Some(k) => dropped.push(kept.remove(k)),
            None => break at,
        }
    };
    let mut plan: Vec<std::result::Result<u64, Vec<usize>>> = vec![Err(Vec::new()); n];
    for (&i, a) in kept.iter().zip(at) {
        plan[i] = Ok(a.unwrap_or(ranges[i].1.saturating_sub(1)));
    }
    for d in dropped {
        let (s, e) = ranges[d];
        plan[d] = Err(kept
            .iter()
            .copied()
            .filter(|&k| ranges[k].0 < e && s < ranges[k].1)
            .collect());
    }
    plan
}

/// For each write `[start, end)` of one batch, the address its probe reads:
/// its last byte that no other write of the batch covers (the payload lands
/// front to back, so that byte holding the written value means every byte
/// before it landed). `None` when other writes cover the whole range: what
/// lands there is unspecified (the trait leaves overlapping destinations
/// undefined) and the write is not probed on its own.
pub(super) fn probe_addresses(ranges: &[(u64, u64)]) -> Vec<Option<u64>> {
    let n = ranges.len();
    let mut order: Vec<usize> = (0..n).collect();
    order.sort_by_key(|&i| ranges[i].0);
    // Sorted by start, a range overlaps another exactly when an earlier one
    // ends after its start or the next one starts before its end.
    let mut overlapping = vec![false; n];
    let mut max_end = 0u64;
    for (k, &i) in order.iter().enumerate() {
        let (start, end) = ranges[i];
        let earlier = k > 0 && max_end > start;
        let later = order.get(k + 1).is_some_and(|&j| ranges[j].0 < end);
        overlapping[i] = earlier || later;
        max_end = max_end.max(end);
    }
    let crowded: Vec<usize> = (0..n).filter(|&i| overlapping[i]).collect();
    (0..n)
        .map(|a| {
            let (start, end) = ranges[a];
            if end <= start {
                return None;
            }
            let mut x = end - 1;
            if !overlapping[a] {
                return Some(x);
            }
            loop {
                let cover = crowded
                    .iter()
                    .filter(|&&b| b != a)
                    .map(|&b| ranges[b])
                    .filter(|&(s, e)| s <= x && x < e)
                    .map(|(s, _)| s)
                    .min();
                match cover {
                    None => return Some(x),
                    Some(s) if s <= start => return None,
                    Some(s) => x = s - 1,
                }
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::probe_addresses;

    #[test]
    fn probe_is_the_last_byte_no_other_write_covers() {
        // Disjoint: each write's own last byte.
        assert_eq!(
            probe_addresses(&[(0, 10), (10, 20), (30, 31)]),
            vec![Some(9), Some(19), Some(30)]
        );
        // B covers A's tail: A is probed before B starts; B's tail is its own.
        assert_eq!(
            probe_addresses(&[(0, 100), (99, 200)]),
            vec![Some(98), Some(199)]
        );
        // Covered from the end by a chain of writes.
        assert_eq!(
            probe_addresses(&[(0, 100), (90, 95), (94, 100), (100, 101)]),
            vec![Some(89), None, None, Some(100)]
        );
        // Entirely covered: not probed on its own.
        assert_eq!(probe_addresses(&[(10, 20), (0, 30)]), vec![None, Some(29)]);
        // Two identical writes cover each other.
        assert_eq!(probe_addresses(&[(5, 9), (5, 9)]), vec![None, None]);
    }

    #[test]
    fn writes_covered_by_others_are_left_out_and_one_of_each_group_is_kept() {
        use super::plan_probes;
        // Disjoint: every write sent, probed at its own last byte.
        assert_eq!(plan_probes(&[(0, 10), (10, 20)]), vec![Ok(9), Ok(19)]);
        // Identical writes: the first is sent, the second takes its result.
        assert_eq!(plan_probes(&[(5, 9), (5, 9)]), vec![Ok(8), Err(vec![0])]);
        // A write inside another is left out.
        assert_eq!(
            plan_probes(&[(100, 150), (0, 8192)]),
            vec![Err(vec![1]), Ok(8191)]
        );
        // A covered by B and C together, B and C covered by A: A is left
        // out, B and C (disjoint) are sent.
        assert_eq!(
            plan_probes(&[(0, 10), (0, 5), (5, 10)]),
            vec![Err(vec![1, 2]), Ok(4), Ok(9)]
        );
        // Every byte some write puts is put by a sent write, and every sent
        // write has a byte no other sent write covers.
        let ranges = [(0, 10), (2, 8), (0, 6), (5, 10), (5, 10), (9, 12)];
        let plan = plan_probes(&ranges);
        let sent: Vec<usize> = (0..ranges.len()).filter(|&i| plan[i].is_ok()).collect();
        for x in 0..12u64 {
            let put = ranges.iter().any(|&(s, e)| s <= x && x < e);
            let by_sent = sent.iter().any(|&i| ranges[i].0 <= x && x < ranges[i].1);
            assert_eq!(put, by_sent, "byte {x}");
        }
        for &i in &sent {
            let at = *plan[i].as_ref().unwrap();
            assert!(ranges[i].0 <= at && at < ranges[i].1);
            assert!(!sent
                .iter()
                .any(|&j| j != i && ranges[j].0 <= at && at < ranges[j].1));
        }
    }
}

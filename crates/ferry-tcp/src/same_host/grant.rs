//! Granted copies: on the same-host path, the initiator copies straight
//! into (out of) the target's registered memory with one
//! `process_vm_writev` (`process_vm_readv`), as NIXL's UCX does on one
//! host — no frame, no copy by the target, no round trip: a write needs
//! only the initiator on a CPU.
//!
//! The target still decides what may be touched. It publishes **grants**
//! in a page appended to the staging area (negotiated: feature
//! [`crate::negotiate::GRANTS`]): per registered region one entry
//! `(generation, address, length)`, in the same entry of every area; a
//! generation of 0 is no grant. It grants a region when it is registered
//! (and every live region to a new area) and **revokes** it when the
//! region is unregistered, before the range is freed:
//!
//! - The initiator, before each copy, writes a **mark** naming the entry
//!   and its generation into one of [`MARKS`] words of the page, then
//!   (after a full fence) checks that the entry still carries that
//!   generation, copies, and clears the mark. A failed check is no copy:
//!   the request goes as a frame, and the target's own checks answer it.
//! - The target's `unregister` sets the entry's generation to 0, then
//!   (after a full fence) waits until no mark of any area names it. The
//!   two form a Dekker pair (model-checked with loom below): either the
//!   initiator sees the revocation and does not copy, or the target sees
//!   the mark and waits for the copy to end. Once the wait is over no
//!   copy into the region can start or be in progress: the range may be
//!   freed.
//! - A mark that stays (the initiator's process stopped between mark and
//!   copy, or in the copy) makes the wait end after the stall timeout
//!   with [`ferry_core::Error::RegionHeld`]: the region stays registered
//!   (and so its memory allocated), ungranted, and a later `unregister`
//!   waits for the same mark again. A mark of a process that has exited
//!   (its pidfd says so) is void. An area whose connection ended has all
//!   its entries revoked and is watched until its marks are clear.
//!
//! The initiator uses grants only after proving it may reach the target
//! process the same way the target proved it may reach the initiator's: it
//! pins the PID the page names with a pidfd, then reads a nonce out of the
//! target's memory (`process_vm_readv`) and compares it with the page's
//! copy. An initiator that may do that may write anywhere in the target
//! anyway (the kernel's ptrace rule): grants give a same-host peer no
//! power it lacks; they keep a cooperating one out of memory that is
//! being unregistered. Whatever a peer writes into the page (entries,
//! marks, counters) can cost the target only a `RegionHeld` or wrong
//! served-traffic counts, never a fault or a byte outside its regions:
//! the target reads only marks and counters, and only compares them.
//!
//! Served traffic (issue 27): the target never sees granted bytes, so the
//! initiator adds what it copied to four counters in the page, which the
//! target folds into its per-peer counters when they are read.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

#[cfg(ferry_loom)]
use loom::sync::atomic::{fence, AtomicU64};
#[cfg(not(ferry_loom))]
use std::sync::atomic::{fence, AtomicU64};
use std::sync::atomic::{AtomicU32, Ordering};

use ferry_core::__private::sync::lock;

use super::cma::Initiator;
use super::stage::Area;

pub use ferry_tcp_proto::layout::grants::{mark_value, ENTRIES, GRANTS_LEN, MARKS};
use ferry_tcp_proto::layout::grants::{
    COUNTERS_AT, ENTRIES_AT, ENTRY, MARKS_AT, NONCE, PID, PROBE, USED, VERSION,
};

/// Initiator: marks a copy under the grant `granted` (entry generation
/// word) at `gen`, then checks the grant. `true`: the copy may go ahead
/// and must [`leave`] after; `false`: revoked (the mark is cleared).
pub fn enter(mark: &AtomicU64, granted: &AtomicU64, value: u64, gen: u32) -> bool {
    mark.store(value, Ordering::Relaxed);
    // Dekker with `revoke`: the mark is ordered before the look at the
    // grant, as the revocation is before the target's look at the marks.
    fence(Ordering::SeqCst);
    if granted.load(Ordering::Relaxed) == u64::from(gen) {
        return true;
    }
    mark.store(0, Ordering::Release);
    false
}

/// Initiator: the copy is over (its bytes are in place before the cleared
/// mark is seen).
pub fn leave(mark: &AtomicU64) {
    mark.store(0, Ordering::Release);
}

/// Target: revokes a grant; the caller then waits while [`names`] holds
/// for any mark.
pub fn revoke(granted: &AtomicU64) {
    granted.store(0, Ordering::Relaxed);
    fence(Ordering::SeqCst);
}

/// Target: whether `mark` names the revoked grant `value` (a copy under it
/// may be in progress).
pub fn names(mark: &AtomicU64, value: u64) -> bool {
    mark.load(Ordering::Acquire) == value
}

/// A view of an area's grants page.
#[derive(Clone, Copy)]
pub struct Page<'a> {
    base: *mut u8,
    _area: std::marker::PhantomData<&'a Area>,
}

impl<'a> Page<'a> {
    /// # Safety
    ///
    /// `base` is the start of a page-aligned shared mapping of at least
    /// [`GRANTS_LEN`] bytes that outlives `'a` and is accessed only
    /// through atomics.
    pub unsafe fn new(base: *mut u8) -> Page<'a> {
        Page {
            base,
            _area: std::marker::PhantomData,
        }
    }

    fn word(&self, off: usize) -> &'a AtomicU64 {
        debug_assert!(off % 8 == 0 && off + 8 <= GRANTS_LEN);
        // SAFETY: `off` is one of this module's 8-aligned offsets inside
        // the page (see `new`); AtomicU64 has the layout of u64 and every
        // access to the page is atomic.
        unsafe { &*self.base.add(off).cast::<AtomicU64>() }
    }

    fn mark(&self, m: usize) -> &'a AtomicU64 {
        self.word(MARKS_AT + 8 * (m % MARKS))
    }

    /// Entry `idx`'s words: generation, address, length.
    fn entry(&self, idx: usize) -> [&'a AtomicU64; 3] {
        let at = ENTRIES_AT + ENTRY * (idx % ENTRIES);
        [self.word(at), self.word(at + 8), self.word(at + 16)]
    }

    fn counter(&self, i: usize) -> &'a AtomicU64 {
        self.word(COUNTERS_AT + 8 * (i % 4))
    }

    fn bump(&self) {
        self.word(VERSION).fetch_add(1, Ordering::Release);
    }

    /// Target: publishes entry `idx` (not granted meanwhile).
    fn publish(&self, idx: usize, slot: &Slot) {
        let [gen, addr, len] = self.entry(idx);
        gen.store(0, Ordering::Relaxed);
        addr.store(slot.addr, Ordering::Relaxed);
        len.store(slot.len, Ordering::Relaxed);
        gen.store(u64::from(slot.gen), Ordering::Release);
    }

    fn any_mark(&self, value: Option<u64>) -> bool {
        (0..MARKS).any(|m| match value {
            Some(v) => names(self.mark(m), v),
            None => self.mark(m).load(Ordering::Acquire) != 0,
        })
    }

    fn counters(&self) -> [u64; 4] {
        std::array::from_fn(|i| self.counter(i).load(Ordering::Relaxed))
    }
}

use ferry_tcp_proto::grants::{GrantTable, Slot};

/// One area the target publishes grants in.
struct Linked {
    area: Arc<Area>,
    peer: Arc<Initiator>,
    served: ferry_core::inbound::ServedPeer,
    /// The connection ended: every entry is revoked; kept until its marks
    /// are clear (or its process exited).
    closed: bool,
    /// The area's counters already added to `served`.
    counted: [u64; 4],
}

impl Linked {
    fn page(&self) -> Page<'_> {
        self.area
            .grants()
            .expect("only areas with a grants page are linked")
    }

    /// Adds what the initiator counted since the last look to the peer's
    /// served traffic (a counter that goes back is a lying peer: ignored).
    fn sync(&mut self) {
        let now = self.page().counters();
        let d: [u64; 4] = std::array::from_fn(|i| now[i].saturating_sub(self.counted[i]));
        self.served.wrote(d[0], d[1]);
        self.served.read(d[2], d[3]);
        for (c, n) in self.counted.iter_mut().zip(now) {
            *c = (*c).max(n);
        }
    }
}

/// A revocation some mark may still name (see [`Grants::revoke`]).
#[derive(Clone)]
pub struct Revoked {
    value: u64,
    watch: Vec<(Arc<Area>, Arc<Initiator>)>,
}

impl Revoked {
    /// Whether a live initiator still marks a copy under the grant.
    fn held(&self) -> Option<i32> {
        self.watch.iter().find_map(|(area, peer)| {
            let page = area.grants()?;
            (page.any_mark(Some(self.value)) && peer.alive()).then_some(peer.pid)
        })
    }
}

#[derive(Default)]
struct Inner {
    /// Which region each entry grants, and the revocations still waited
    /// for (by address and generation: see `ferry_tcp_proto::grants`).
    table: GrantTable<Revoked>,
    areas: Vec<Linked>,
}

impl Inner {
    /// Drops the closed areas no copy can still be in progress in.
    fn prune(&mut self) {
        self.areas.retain_mut(|l| {
            if !l.closed {
                return true;
            }
            l.sync();
            l.page().any_mark(None) && l.peer.alive()
        });
    }
}

/// The target's grants: what it publishes in every area (see the
/// module's comment).
pub struct Grants {
    inner: Mutex<Inner>,
    /// A word of this process holding the nonce (never written after it
    /// is made): read by initiators with `process_vm_readv`.
    probe: Box<u64>,
}

impl std::fmt::Debug for Grants {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let g = lock(&self.inner);
        f.debug_struct("Grants")
            .field("granted", &g.table.granted().count())
            .field("areas", &g.areas.len())
            .finish()
    }
}

impl Default for Grants {
    fn default() -> Self {
        Grants {
            inner: Mutex::default(),
            probe: Box::new(rand::random::<u64>() | 1),
        }
    }
}

/// Unlinks its area when the connection ends (see [`Grants::detach`]).
pub struct Link {
    grants: Arc<Grants>,
    area: Arc<Area>,
}

impl Drop for Link {
    fn drop(&mut self) {
        self.grants.detach(&self.area);
    }
}

impl Grants {
    /// Starts publishing in `area` (a connection's, with a grants page)
    /// for the initiator process `peer`: the probe, then every granted
    /// region. The grants go when the returned link drops.
    pub fn attach(
        self: &Arc<Self>,
        area: Arc<Area>,
        peer: Arc<Initiator>,
        served: ferry_core::inbound::ServedPeer,
    ) -> Option<Link> {
        let page = area.grants()?;
        let mut g = lock(&self.inner);
        if g.table.is_closed() {
            return None;
        }
        g.prune();
        page.word(PID)
            .store(u64::from(std::process::id()), Ordering::Relaxed);
        page.word(PROBE)
            .store(&*self.probe as *const u64 as u64, Ordering::Relaxed);
        page.word(NONCE).store(*self.probe, Ordering::Relaxed);
        for (idx, slot) in g.table.granted() {
            page.publish(idx, &slot);
        }
        page.word(USED)
            .store(g.table.used() as u64, Ordering::Relaxed);
        page.bump();
        g.areas.push(Linked {
            area: Arc::clone(&area),
            peer,
            served,
            closed: false,
            counted: [0; 4],
        });
        Some(Link {
            grants: Arc::clone(self),
            area,
        })
    }

    /// Grants the region `[addr, addr+len)` of generation `gen` in every
    /// live area (none if every entry is taken: it is served as frames).
    pub fn grant(&self, addr: u64, len: u64, gen: u32) {
        let mut g = lock(&self.inner);
        if g.table.is_closed() {
            return;
        }
        g.prune();
        let slot = Slot { addr, len, gen };
        let Some(granted) = g.table.grant(slot) else {
            return;
        };
        if let Some(old) = granted.stale {
            // A region leaves only after its grant was revoked (see
            // `Core::unregister`): an entry still here is a bug. Revoke it
            // rather than leave it published beside the new one.
            tracing::error!(addr, "a grant outlived its region; revoked now");
            for l in &g.areas {
                revoke(l.page().entry(old)[0]);
                l.page().bump();
            }
        }
        let used = g.table.used() as u64;
        for l in g.areas.iter().filter(|l| !l.closed) {
            let page = l.page();
            page.publish(granted.idx, &slot);
            page.word(USED).store(used, Ordering::Relaxed);
            page.bump();
        }
    }

    /// Revokes the grant of the registration of generation `gen` at
    /// `addr` in every area; `None` if it has none (and no earlier
    /// revocation of it is still waited for). The caller waits with
    /// [`Grants::settle`] before the region may leave its table. A grant
    /// of another generation at the same address is not touched.
    pub fn revoke(&self, addr: u64, gen: u32) -> Option<Revoked> {
        let g = &mut *lock(&self.inner);
        let areas = &g.areas;
        g.table.revoke(addr, gen, |idx, value| {
            for l in areas {
                let page = l.page();
                revoke(page.entry(idx)[0]);
                page.bump();
            }
            Revoked {
                value,
                watch: areas
                    .iter()
                    .map(|l| (Arc::clone(&l.area), Arc::clone(&l.peer)))
                    .collect(),
            }
        })
    }

    /// Waits until no live initiator marks a copy under the revoked grant
    /// of the registration `(addr, gen)`, at most `patience`: `Ok` once
    /// none does (the range may be freed), else `Err(pid)` of a process
    /// that still marks one (the revocation stays, a later call waits for
    /// it again).
    pub async fn settle(
        &self,
        addr: u64,
        gen: u32,
        r: &Revoked,
        patience: Duration,
    ) -> Result<(), i32> {
        wait_while(patience, || r.held()).await?;
        lock(&self.inner).table.settled(addr, gen);
        Ok(())
    }

    /// Waits until no live initiator marks a copy under any grant, at most
    /// `patience` (the engine was closed first: no new mark can pass its
    /// check). `Err((addr, pid))`: the region a mark names (0 if it names
    /// none the engine knows) and the process that still holds it.
    pub async fn settle_all(&self, patience: Duration) -> Result<(), (u64, i32)> {
        wait_while(patience, || {
            let g = lock(&self.inner);
            g.areas.iter().find_map(|l| {
                let page = l.page();
                let v = (0..MARKS)
                    .map(|m| page.mark(m).load(Ordering::Acquire))
                    .find(|&v| v != 0)?;
                l.peer.alive().then(|| (g.table.region_of(v), l.peer.pid))
            })
        })
        .await
    }

    /// The engine stops serving: every grant of every area is revoked (a
    /// copy marked before this may still complete; none starts after), and
    /// none is made any more.
    pub fn close(&self) {
        let mut g = lock(&self.inner);
        let used = g.table.close();
        for l in &g.areas {
            let page = l.page();
            for idx in 0..used {
                revoke(page.entry(idx)[0]);
            }
            page.bump();
        }
    }

    /// The connection of `area` ended: every entry of it is revoked; it is
    /// watched until its marks are clear.
    fn detach(&self, area: &Arc<Area>) {
        let mut g = lock(&self.inner);
        let used = g.table.used();
        if let Some(l) = g.areas.iter_mut().find(|l| Arc::ptr_eq(&l.area, area)) {
            l.closed = true;
            let page = l.page();
            for idx in 0..used {
                revoke(page.entry(idx)[0]);
            }
            page.bump();
        }
        g.prune();
    }

    /// Adds what initiators copied since the last look to their peers'
    /// served traffic.
    pub fn sync(&self) {
        let mut g = lock(&self.inner);
        for l in &mut g.areas {
            l.sync();
        }
    }
}

/// Looks with `held` until it finds nothing (`Ok`), at most `patience`
/// (then `Err` with what it found last): 64 yields first, then once a
/// millisecond.
async fn wait_while<T>(patience: Duration, mut held: impl FnMut() -> Option<T>) -> Result<(), T> {
    let start = Instant::now();
    let mut n = 0u32;
    loop {
        let Some(h) = held() else {
            return Ok(());
        };
        if start.elapsed() >= patience {
            return Err(h);
        }
        n += 1;
        if n < 64 {
            tokio::task::yield_now().await;
        } else {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }
}

/// A grant as the initiator caches it.
#[derive(Clone, Copy, Debug)]
struct Known {
    addr: u64,
    len: u64,
    gen: u32,
    idx: usize,
}

/// The initiator's side of an area's grants.
pub struct ClientGrants {
    area: Arc<Area>,
    /// The target's process, pinned.
    target: Initiator,
    /// Marks not in use (bit `m`: mark `m` is free).
    free: AtomicU32,
    /// The page's version and the grants it held then, by address.
    cache: Mutex<(u64, Vec<Known>)>,
}

impl std::fmt::Debug for ClientGrants {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClientGrants")
            .field("target_pid", &self.target.pid)
            .finish()
    }
}

/// One segment of a granted copy: local address, length, the target's
/// address and the region generation the initiator believes in.
#[derive(Clone, Copy, Debug)]
pub struct Part {
    /// Local start.
    pub local: *mut u8,
    /// Bytes.
    pub len: u64,
    /// The target's address.
    pub remote: u64,
    /// The generation of the target's region.
    pub gen: u32,
}

// SAFETY: an address range; `ClientGrants::copy` states why it is valid.
unsafe impl Send for Part {}

impl ClientGrants {
    /// Checks that this process may reach the target the page names (see
    /// the module's comment): `Err(reason)` otherwise (no grants are used).
    ///
    /// `attested`: the target's process as the kernel attests it on the
    /// credential connection ([`super::cma::attested_target`]). The page
    /// is the target's word only: granted copies go to the PID it names
    /// only if that is the attested (and pinned) process, so a target
    /// cannot make this process write with its privileges into another.
    pub fn open(
        area: Arc<Area>,
        attested: Option<Result<Initiator, String>>,
    ) -> Result<ClientGrants, String> {
        let page = area.grants().ok_or("no grants page")?;
        let pid = page.word(PID).load(Ordering::Relaxed);
        let probe = page.word(PROBE).load(Ordering::Relaxed);
        let nonce = page.word(NONCE).load(Ordering::Relaxed);
        let pid = i32::try_from(pid)
            .ok()
            .filter(|&p| p > 0 && probe != 0 && nonce != 0)
            .ok_or("the target published no grants")?;
        // Pinned when attested, then checked: the checks concern the
        // pinned process.
        let target = match attested {
            None => return Err("the target did not prove which process it is".to_owned()),
            Some(Err(why)) => return Err(format!("the target's credentials: {why}")),
            Some(Ok(t)) if t.pid != pid => {
                return Err(format!(
                    "the grants page names PID {pid}, not the target's process {}",
                    t.pid
                ))
            }
            Some(Ok(t)) => t,
        };
        if !target.pinned() {
            return Err("no pidfd for the target's process".to_owned());
        }
        let mut seen = 0u64;
        // SAFETY: `seen` is ours, valid for writes of 8 bytes; the remote
        // range is checked by the kernel.
        let r = unsafe {
            super::cma::copy_all(
                target.remote(),
                false,
                (&mut seen as *mut u64).cast(),
                probe,
                std::mem::size_of::<u64>(),
            )
        };
        match r {
            Err(e) => Err(format!(
                "process_vm_readv of the target: {}",
                super::cma::errno_name(e)
            )),
            Ok(()) if seen != nonce => {
                Err("the target's probe holds other bytes than its page says".to_owned())
            }
            Ok(()) if !target.alive() => Err("the target's process exited".to_owned()),
            Ok(()) => Ok(ClientGrants {
                area,
                target,
                free: AtomicU32::new(if MARKS >= 32 {
                    u32::MAX
                } else {
                    (1 << MARKS) - 1
                }),
                cache: Mutex::new((u64::MAX, Vec::new())),
            }),
        }
    }

    fn page(&self) -> Page<'_> {
        self.area
            .grants()
            .expect("opened on an area with a grants page")
    }

    /// The grant covering every part, all in one region: `(entry,
    /// generation)`.
    fn find(&self, parts: &[Part]) -> Option<(usize, u32)> {
        let page = self.page();
        let version = page.word(VERSION).load(Ordering::Acquire);
        let mut cache = lock(&self.cache);
        if cache.0 != version {
            let used = (page.word(USED).load(Ordering::Relaxed) as usize).min(ENTRIES);
            let mut known: Vec<Known> = (0..used)
                .filter_map(|idx| {
                    let [gen, addr, len] = page.entry(idx);
                    let g = gen.load(Ordering::Acquire);
                    let k = Known {
                        addr: addr.load(Ordering::Relaxed),
                        len: len.load(Ordering::Relaxed),
                        gen: u32::try_from(g).ok()?,
                        idx,
                    };
                    // Torn by a change meanwhile: the next version retries.
                    (g != 0 && gen.load(Ordering::Acquire) == g).then_some(k)
                })
                .collect();
            known.sort_unstable_by_key(|k| k.addr);
            *cache = (version, known);
        }
        let mut found: Option<(usize, u32)> = None;
        for p in parts {
            let i = cache.1.partition_point(|k| k.addr <= p.remote);
            let k = cache.1[..i].last()?;
            let inside = p.remote >= k.addr
                && p.remote
                    .checked_add(p.len)
                    .is_some_and(|end| end <= k.addr.saturating_add(k.len));
            if !inside || k.gen != p.gen || found.is_some_and(|f| f != (k.idx, k.gen)) {
                return None;
            }
            found = Some((k.idx, k.gen));
        }
        found
    }

    fn claim(&self) -> Option<usize> {
        let mut cur = self.free.load(Ordering::Relaxed);
        loop {
            if cur == 0 {
                return None;
            }
            let m = cur.trailing_zeros() as usize;
            match self.free.compare_exchange_weak(
                cur,
                cur & !(1 << m),
                Ordering::Acquire,
                Ordering::Relaxed,
            ) {
                Ok(_) => return Some(m),
                Err(now) => cur = now,
            }
        }
    }

    fn release(&self, m: usize) {
        self.free.fetch_or(1 << m, Ordering::Release);
    }

    /// Copies `parts` into the target's memory (`read`: out of it) under
    /// its grant. `false`: not granted (any more), the target is gone, or
    /// the kernel refused: nothing is known to have landed, and the
    /// request goes as a frame instead.
    ///
    /// # Safety
    ///
    /// Every part's local range is valid for reads (writes for `read`)
    /// until this returns (its region guard is held).
    pub unsafe fn copy(&self, read: bool, parts: &[Part]) -> bool {
        let Some((idx, gen)) = self.find(parts) else {
            return false;
        };
        let Some(m) = self.claim() else {
            return false;
        };
        let page = self.page();
        let mark = page.mark(m);
        let ok = enter(mark, page.entry(idx)[0], mark_value(idx, gen), gen) && {
            // A PID whose process exited may have been reused: never
            // reached (each copy polls the pidfd right before it, see
            // `cma::Remote`).
            // SAFETY: the caller guarantees the local ranges; the remote
            // ones lie in a region the target granted and cannot free
            // while the mark stands.
            let ok = unsafe { self.copy_parts(read, parts) };
            leave(mark);
            ok
        };
        self.release(m);
        if ok {
            let (bytes, segs) = parts
                .iter()
                .filter(|p| p.len > 0)
                .fold((0, 0), |(b, n), p| (b + p.len, n + 1));
            let at = if read { 2 } else { 0 };
            page.counter(at).fetch_add(bytes, Ordering::Relaxed);
            page.counter(at + 1).fetch_add(segs, Ordering::Relaxed);
        }
        ok
    }

    /// # Safety
    ///
    /// As for [`ClientGrants::copy`].
    unsafe fn copy_parts(&self, read: bool, parts: &[Part]) -> bool {
        const IOV_MAX: usize = 1024;
        // Small calls (most granted ones) build their iovecs on the stack:
        // the copy's own poll of the pidfd is its one extra cost.
        const ON_STACK: usize = 8;
        let empty = super::cma::iov(std::ptr::null_mut(), 0);
        let (mut l_stack, mut r_stack) = ([empty; ON_STACK], [empty; ON_STACK]);
        let (mut l_heap, mut r_heap) = (Vec::new(), Vec::new());
        for chunk in parts.chunks(IOV_MAX) {
            let (local, remote) = if chunk.len() <= ON_STACK {
                (&mut l_stack[..chunk.len()], &mut r_stack[..chunk.len()])
            } else {
                l_heap.resize(chunk.len(), empty);
                r_heap.resize(chunk.len(), empty);
                (&mut l_heap[..chunk.len()], &mut r_heap[..chunk.len()])
            };
            for ((l, r), p) in local.iter_mut().zip(remote.iter_mut()).zip(chunk) {
                *l = super::cma::iov(p.local, p.len as usize);
                *r = super::cma::iov(p.remote as usize as *mut u8, p.len as usize);
            }
            let want: u64 = chunk.iter().map(|p| p.len).sum();
            // SAFETY: as for `copy`.
            match unsafe { super::cma::copy(self.target.remote(), !read, local, remote) } {
                Ok(n) if n as u64 == want => {}
                _ => return false,
            }
        }
        true
    }
}

#[cfg(all(test, not(ferry_loom)))]
mod tests {
    use super::*;

    /// Issue 41 (item 2, the other way): the grants page is the target's
    /// word; an initiator copies only into the process the kernel attests
    /// on the credential connection. A page naming another PID (here a
    /// child of this process, whose probe would pass: it is a copy of
    /// this process's memory) is refused, as is a page from a target that
    /// attested nothing; the page naming the attested process is taken.
    #[test]
    fn grants_go_only_to_the_attested_target() {
        let area = Arc::new(Area::create(true).expect("an area with grants"));
        let word = Box::new(0x1234_5678_9abc_def0u64);
        let page = area.grants().expect("grants page");
        page.word(PROBE)
            .store(&*word as *const u64 as u64, Ordering::Relaxed);
        page.word(NONCE).store(*word, Ordering::Relaxed);
        let me = std::process::id() as i32;
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .expect("sleep");
        page.word(PID).store(child.id() as u64, Ordering::Relaxed);
        let why = match ClientGrants::open(Arc::clone(&area), Some(Ok(Initiator::new(me)))) {
            Err(why) => why,
            Ok(_) => panic!("another PID is refused"),
        };
        assert!(why.contains("not the target's process"), "{why}");
        let _ = child.kill();
        let _ = child.wait();
        page.word(PID).store(me as u64, Ordering::Relaxed);
        assert!(ClientGrants::open(Arc::clone(&area), None).is_err());
        assert!(ClientGrants::open(Arc::clone(&area), Some(Ok(Initiator::new(me)))).is_ok());
    }

    #[test]
    fn marks_name_entry_and_generation() {
        assert_ne!(mark_value(0, 1), mark_value(1, 1));
        assert_ne!(mark_value(0, 1), mark_value(0, 2));
        assert_ne!(mark_value(0, 1), 0);
        let (mark, granted) = (AtomicU64::new(0), AtomicU64::new(7));
        assert!(enter(&mark, &granted, mark_value(3, 7), 7));
        assert!(names(&mark, mark_value(3, 7)));
        leave(&mark);
        revoke(&granted);
        assert!(!enter(&mark, &granted, mark_value(3, 7), 7));
        assert!(
            !names(&mark, mark_value(3, 7)),
            "a refused entry leaves no mark"
        );
    }
}

#[cfg(all(test, ferry_loom))]
mod loom_model {
    use super::*;
    use loom::cell::UnsafeCell;
    use loom::sync::Arc;

    /// The Dekker pair of a granted copy: an initiator that marks, checks
    /// and copies, against a target that revokes, waits for the marks and
    /// then reuses the memory. loom reports a data race on `memory` if a
    /// copy can overlap the reuse.
    #[test]
    fn loom_model_no_copy_after_revocation_settles() {
        loom::model(|| {
            struct Shared {
                mark: AtomicU64,
                granted: AtomicU64,
                memory: UnsafeCell<u64>,
            }
            let s = Arc::new(Shared {
                mark: AtomicU64::new(0),
                granted: AtomicU64::new(5),
                memory: UnsafeCell::new(0),
            });
            let value = mark_value(0, 5);
            let init = {
                let s = Arc::clone(&s);
                loom::thread::spawn(move || {
                    if enter(&s.mark, &s.granted, value, 5) {
                        // The copy into the target's memory.
                        s.memory.with_mut(|m| unsafe { *m = 1 });
                        leave(&s.mark);
                    }
                })
            };
            revoke(&s.granted);
            while names(&s.mark, value) {
                loom::thread::yield_now();
            }
            // Freed and reused by the target.
            s.memory.with_mut(|m| unsafe { *m = 2 });
            init.join().unwrap();
        });
    }
}

//! The registered-region table every backend keeps: overlap checks on
//! register, bounds checks on every transfer, and in-flight guards that make
//! `unregister` wait until no transfer uses a region any more.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard};

use tokio::sync::Notify;

use crate::error::{Error, Result, Side};
use crate::types::{MemoryRegion, RegionInfo};

#[derive(Debug)]
struct Entry {
    region: MemoryRegion,
    in_flight: usize,
    closing: bool,
    /// Why a guard of it is held for a peer that may still write it and
    /// could not be shown to have stopped ([`RegionGuard::hold_unproven`]).
    unproven: Option<String>,
    /// `remove` gave up on it (it was [`Entry::unproven`]): the entry goes
    /// when its last guard drops.
    detached: bool,
}

/// Called with the table and a region's address when a detached region
/// leaves the table (see [`RegionTable::on_detached_release`]).
type ReleaseHook = Arc<dyn Fn(&RegionTable, u64) + Send + Sync>;

#[derive(Default)]
struct Shared {
    entries: Mutex<BTreeMap<u64, Entry>>,
    released: Notify,
    on_detached_release: Mutex<Option<ReleaseHook>>,
}

impl std::fmt::Debug for Shared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shared")
            .field("entries", &self.entries)
            .finish_non_exhaustive()
    }
}

/// A region on its way out of a [`RegionTable`] (see
/// [`RegionTable::remove_in_steps`]).
#[derive(Debug)]
pub struct Removal {
    table: RegionTable,
    addr: u64,
    finished: bool,
}

impl Removal {
    /// The region being removed (its address, length and location).
    pub fn region(&self) -> Option<RegionInfo> {
        self.table.lock().get(&self.addr).map(|e| e.region.info())
    }

    /// Takes the region out of the table: its range is free from now on.
    pub fn finish(mut self) {
        self.finished = true;
        self.table.lock().remove(&self.addr);
    }
}

impl Drop for Removal {
    fn drop(&mut self) {
        if !self.finished {
            // Unfinished: the region stays registered and usable again.
            if let Some(e) = self.table.lock().get_mut(&self.addr) {
                e.closing = false;
            }
            self.table.shared.released.notify_waiters();
        }
    }
}

/// A set of non-overlapping registered regions, keyed by start address.
///
/// Cloning gives another handle to the same table.
#[derive(Clone, Debug, Default)]
pub struct RegionTable {
    shared: Arc<Shared>,
}

impl RegionTable {
    /// An empty table.
    pub fn new() -> Self {
        Self::default()
    }

    fn lock(&self) -> MutexGuard<'_, BTreeMap<u64, Entry>> {
        // A panic while holding this lock cannot leave the map inconsistent
        // (every critical section is a single map operation), so poisoning is
        // ignored rather than propagated.
        crate::__private::sync::lock(&self.shared.entries)
    }

    /// Adds `region`. Fails with [`Error::InvalidArgument`] if it is empty or
    /// wraps around the address space, [`Error::RegionOverlap`] if it shares a
    /// byte with a registered (or closing) region.
    pub fn insert(&self, region: MemoryRegion) -> Result<()> {
        let mut map = self.lock();
        check_insertable(&map, &region)?;
        insert_entry(&mut map, region);
        Ok(())
    }

    /// Adds every region or none: all are checked (against the table and
    /// against each other) under one lock before any is inserted, so a peer
    /// never sees a region that a failed batch would take back. The error is
    /// [`Error::BatchRegisterFailed`] naming the first region that cannot be
    /// added.
    pub fn insert_all(&self, regions: Vec<MemoryRegion>) -> Result<()> {
        let mut map = self.lock();
        for (index, region) in regions.iter().enumerate() {
            let earlier = regions[..index].iter().find(|r| r.overlaps(region));
            let checked = match earlier {
                Some(e) => Err(overlap(region, e)),
                None => check_insertable(&map, region),
            };
            if let Err(source) = checked {
                return Err(Error::BatchRegisterFailed {
                    index,
                    addr: region.addr(),
                    source: Box::new(source),
                });
            }
        }
        for region in regions {
            insert_entry(&mut map, region);
        }
        Ok(())
    }

    /// Finds the region containing all of `[addr, addr+len)` and holds it
    /// registered until the returned guard drops. `side` and `peer` only
    /// shape the error.
    pub fn acquire(
        &self,
        addr: u64,
        len: u64,
        side: Side,
        peer: Option<&str>,
    ) -> Result<RegionGuard> {
        let mut map = self.lock();
        let found = map
            .range_mut(..=addr)
            .next_back()
            .map(|(_, e)| e)
            .filter(|e| !e.closing && e.region.contains(addr, len));
        match found {
            Some(e) => {
                e.in_flight += 1;
                Ok(RegionGuard {
                    table: self.clone(),
                    base: e.region.addr(),
                    addr,
                    len,
                })
            }
            None => Err(Error::AddressNotRegistered {
                side,
                addr,
                len,
                peer: peer.map(str::to_owned),
            }),
        }
    }

    /// Whether a region starting at `addr` is in the table, live, closing
    /// or detached (its range is taken).
    pub fn holds(&self, addr: u64) -> bool {
        self.lock().contains_key(&addr)
    }

    /// Sets what is called, with this table and the region's address,
    /// when a region that [`RegionTable::remove`] gave up on (its guard was
    /// [held unproven](RegionGuard::hold_unproven)) leaves the table by
    /// itself as that guard drops: a backend that keeps state per region
    /// beside the table (grants, generations) forgets it there. The hook
    /// runs after the table's lock is let go (it may call the table), on
    /// the thread that dropped the guard; it must not block.
    pub fn on_detached_release(&self, hook: impl Fn(&RegionTable, u64) + Send + Sync + 'static) {
        *crate::__private::sync::lock(&self.shared.on_detached_release) = Some(Arc::new(hook));
    }

    /// Whether `[addr, addr+len)` lies inside one live region.
    pub fn contains(&self, addr: u64, len: u64) -> bool {
        let map = self.lock();
        map.range(..=addr)
            .next_back()
            .is_some_and(|(_, e)| !e.closing && e.region.contains(addr, len))
    }

    /// Removes the region starting at `addr`, first refusing new guards on it
    /// and waiting until every outstanding guard has dropped.
    ///
    /// If a guard is (or becomes) held for a peer that may still write the
    /// region ([`RegionGuard::hold_unproven`]), `remove` stops waiting and
    /// fails with [`Error::RegionHeld`]: the region leaves the table only
    /// when that guard drops (until then its addresses cannot be registered
    /// again), and its memory must not be freed (`RegisteredBuffer` leaks
    /// it).
    ///
    /// Cancel-safe: if the returned future is dropped before it completes,
    /// the region stays registered and usable, as if `remove` had not been
    /// called.
    pub async fn remove(&self, addr: u64) -> Result<MemoryRegion> {
        self.close_when_idle(addr, true)
            .await?
            .ok_or(Error::RegionNotRegistered { addr })
    }

    /// Marks the region closing, waits until no guard holds it, then takes
    /// it out (`take`: the region is returned) or leaves it there closed.
    async fn close_when_idle(&self, addr: u64, take: bool) -> Result<Option<MemoryRegion>> {
        {
            let mut map = self.lock();
            match map.get_mut(&addr) {
                Some(e) if e.detached => {
                    return Err(Error::RegionHeld {
                        addr,
                        reason: e.unproven.clone().unwrap_or_default(),
                    })
                }
                Some(e) if !e.closing => e.closing = true,
                _ => return Err(Error::RegionNotRegistered { addr }),
            }
        }
        // Reopens the region if this future is dropped while waiting.
        struct Reopen<'a> {
            table: &'a RegionTable,
            addr: u64,
            armed: bool,
        }
        impl Drop for Reopen<'_> {
            fn drop(&mut self) {
                if self.armed {
                    if let Some(e) = self.table.lock().get_mut(&self.addr) {
                        e.closing = false;
                    }
                }
            }
        }
        let mut reopen = Reopen {
            table: self,
            addr,
            armed: true,
        };
        loop {
            let notified = self.shared.released.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            {
                let mut map = self.lock();
                if map.get(&addr).is_some_and(|e| e.in_flight == 0) {
                    reopen.armed = false;
                    if !take {
                        return Ok(None);
                    }
                    return match map.remove(&addr) {
                        Some(e) => Ok(Some(e.region)),
                        None => Err(Error::RegionNotRegistered { addr }),
                    };
                }
                if let Some(e) = map.get_mut(&addr) {
                    if let Some(reason) = &e.unproven {
                        reopen.armed = false;
                        e.detached = true;
                        return Err(Error::RegionHeld {
                            addr,
                            reason: reason.clone(),
                        });
                    }
                }
            }
            notified.await;
        }
    }

    /// [`RegionTable::remove`] in two steps, for a backend that must let
    /// its library go of the region before the range is free again: waits
    /// like `remove` (cancel-safe the same way), then returns a
    /// [`Removal`] while the region, idle and closed to new guards, still
    /// occupies its range (a new [`RegionTable::insert`] over it is
    /// [`Error::RegionOverlap`]). [`Removal::finish`] frees the range;
    /// dropping the `Removal` unfinished reopens the region (it stays
    /// registered, as if nothing had happened).
    pub async fn remove_in_steps(&self, addr: u64) -> Result<Removal> {
        self.close_when_idle(addr, false).await?;
        Ok(Removal {
            table: self.clone(),
            addr,
            finished: false,
        })
    }

    /// The live regions, in address order.
    pub fn regions(&self) -> Vec<RegionInfo> {
        self.lock()
            .values()
            .filter(|e| !e.closing)
            .map(|e| e.region.info())
            .collect()
    }

    /// Number of live regions.
    pub fn len(&self) -> usize {
        self.lock().values().filter(|e| !e.closing).count()
    }

    /// Whether no region is live.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn release(&self, base: u64) {
        let mut map = self.lock();
        let mut gone = false;
        if let Some(e) = map.get_mut(&base) {
            e.in_flight = e.in_flight.saturating_sub(1);
            if e.in_flight == 0 {
                e.unproven = None;
                if e.detached {
                    map.remove(&base);
                    gone = true;
                } else if e.closing {
                    self.shared.released.notify_waiters();
                }
            }
        }
        drop(map);
        if gone {
            let hook = crate::__private::sync::lock(&self.shared.on_detached_release).clone();
            if let Some(hook) = hook {
                hook(self, base);
            }
        }
    }

    fn mark_unproven(&self, base: u64, reason: String) {
        let mut map = self.lock();
        if let Some(e) = map.get_mut(&base) {
            e.unproven.get_or_insert(reason);
            if e.closing {
                self.shared.released.notify_waiters();
            }
        }
    }
}

fn overlap(region: &MemoryRegion, existing: &MemoryRegion) -> Error {
    Error::RegionOverlap {
        addr: region.addr(),
        len: region.len(),
        existing_addr: existing.addr(),
        existing_len: existing.len(),
    }
}

/// Whether `region` may join `map`: non-empty, not wrapping, no overlap with
/// a registered or closing region.
fn check_insertable(map: &BTreeMap<u64, Entry>, region: &MemoryRegion) -> Result<()> {
    if region.is_empty() {
        return Err(Error::InvalidArgument(format!(
            "cannot register an empty region at {:#x}",
            region.addr()
        )));
    }
    if region.addr().checked_add(region.len()).is_none() {
        return Err(Error::InvalidArgument(format!(
            "region {:#x}+{} wraps around the address space",
            region.addr(),
            region.len()
        )));
    }
    let before = map.range(..=region.addr()).next_back();
    let after = map.range(region.addr()..).next();
    match before
        .into_iter()
        .chain(after)
        .find(|(_, e)| e.region.overlaps(region))
    {
        Some((_, e)) => Err(overlap(region, &e.region)),
        None => Ok(()),
    }
}

fn insert_entry(map: &mut BTreeMap<u64, Entry>, region: MemoryRegion) {
    map.insert(
        region.addr(),
        Entry {
            region,
            in_flight: 0,
            closing: false,
            unproven: None,
            detached: false,
        },
    );
}

/// Keeps one region registered while a transfer uses `[addr, addr+len)` of
/// it. Dropping the guard lets a pending `remove` of the region finish.
#[derive(Debug)]
pub struct RegionGuard {
    table: RegionTable,
    base: u64,
    addr: u64,
    len: u64,
}

impl RegionGuard {
    /// Start of the guarded range.
    pub fn addr(&self) -> u64 {
        self.addr
    }
    /// Length of the guarded range.
    pub fn len(&self) -> u64 {
        self.len
    }
    /// Whether the range is empty (never, for a guard from `acquire`).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// Start of the region the range lies in.
    pub fn region_addr(&self) -> u64 {
        self.base
    }
    /// The guarded range as a raw pointer.
    pub fn as_ptr(&self) -> *mut u8 {
        self.addr as usize as *mut u8
    }

    /// Declares that this guard is held for a peer that may still write the
    /// guarded range although its transfer was given up, and that could not
    /// be shown to have stopped (`reason` says which peer and why). A
    /// pending or later `remove` of the region stops waiting for it and
    /// fails with [`Error::RegionHeld`]; the region leaves the table when
    /// the guard drops. Backends call it once a peer has had its chance to
    /// prove it is done and did not take it; they drop the guard only once
    /// it has.
    pub fn hold_unproven(&self, reason: impl Into<String>) {
        self.table.mark_unproven(self.base, reason.into());
    }
}

impl Drop for RegionGuard {
    fn drop(&mut self) {
        self.table.release(self.base);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::types::Location;

    fn region(addr: u64, len: u64) -> MemoryRegion {
        // SAFETY: the table never dereferences these addresses.
        unsafe {
            MemoryRegion::from_raw_parts(addr as usize as *mut u8, len as usize, Location::any())
        }
    }

    #[test]
    fn overlap_and_bounds() {
        let t = RegionTable::new();
        t.insert(region(0x1000, 0x1000)).unwrap();
        assert!(matches!(
            t.insert(region(0x1800, 0x1000)),
            Err(Error::RegionOverlap {
                existing_addr: 0x1000,
                ..
            })
        ));
        assert!(matches!(
            t.insert(region(0x800, 0x1000)),
            Err(Error::RegionOverlap { .. })
        ));
        t.insert(region(0x2000, 0x10)).unwrap();
        assert!(t.contains(0x1000, 0x1000));
        assert!(!t.contains(0x1fff, 2));
        assert!(t.acquire(0x1ff0, 0x20, Side::Remote, None).is_err());
        assert!(t.acquire(u64::MAX, 2, Side::Local, None).is_err());
        assert!(matches!(
            t.insert(region(0x3000, 0)),
            Err(Error::InvalidArgument(_))
        ));
    }

    #[test]
    fn insert_all_is_all_or_nothing() {
        let t = RegionTable::new();
        t.insert(region(0x1000, 0x100)).unwrap();
        // The third region overlaps the registered one: nothing is added.
        let batch = [
            region(0x2000, 0x100),
            region(0x3000, 0x100),
            region(0x10f0, 0x20),
        ];
        match t.insert_all(Vec::from(batch)) {
            Err(Error::BatchRegisterFailed {
                index: 2,
                addr: 0x10f0,
                source,
            }) => {
                assert!(matches!(
                    *source,
                    Error::RegionOverlap {
                        existing_addr: 0x1000,
                        ..
                    }
                ))
            }
            other => panic!("expected BatchRegisterFailed at index 2, got {other:?}"),
        }
        assert_eq!(t.len(), 1);
        // Regions of one batch may not overlap each other either.
        let twins = [region(0x4000, 0x100), region(0x4080, 0x100)];
        assert!(matches!(
            t.insert_all(Vec::from(twins)),
            Err(Error::BatchRegisterFailed { index: 1, .. })
        ));
        assert_eq!(t.len(), 1);
        t.insert_all(vec![region(0x2000, 0x100), region(0x3000, 0x100)])
            .unwrap();
        assert_eq!(t.len(), 3);
    }

    #[tokio::test]
    async fn remove_gives_up_on_a_guard_held_unproven() {
        let t = RegionTable::new();
        t.insert(region(0x1000, 0x100)).unwrap();
        let g = t.acquire(0x1010, 0x10, Side::Local, None).unwrap();
        let t2 = t.clone();
        let removal = tokio::spawn(async move { t2.remove(0x1000).await });
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        assert!(
            !removal.is_finished(),
            "remove returned while a guard was live"
        );
        // Marked while remove waits: remove fails at once, naming why.
        g.hold_unproven("peer p may still write it");
        match removal.await.unwrap() {
            Err(Error::RegionHeld {
                addr: 0x1000,
                reason,
            }) => {
                assert!(reason.contains("peer p"), "{reason}")
            }
            other => panic!("expected RegionHeld, got {other:?}"),
        }
        // Until the guard drops the range stays taken: no new guard, no
        // overlapping registration, and a second remove fails the same way
        // (the entry is detached, not live).
        assert!(t.acquire(0x1010, 0x10, Side::Local, None).is_err());
        assert!(matches!(
            t.insert(region(0x1080, 0x100)),
            Err(Error::RegionOverlap { .. })
        ));
        assert!(t.is_empty(), "a detached region is not live");
        assert!(matches!(
            t.remove(0x1000).await,
            Err(Error::RegionHeld { addr: 0x1000, .. })
        ));
        drop(g);
        // Proven done: the entry goes by itself, the range is free again.
        t.insert(region(0x1000, 0x100)).unwrap();
        assert_eq!(t.len(), 1);
        // Marked before remove is called: remove fails without waiting.
        let g = t.acquire(0x1000, 0x10, Side::Local, None).unwrap();
        g.hold_unproven("peer q");
        assert!(matches!(
            t.remove(0x1000).await,
            Err(Error::RegionHeld { addr: 0x1000, .. })
        ));
        drop(g);
        assert!(t.insert(region(0x1000, 0x100)).is_ok());
    }

    #[tokio::test]
    async fn a_detached_region_that_leaves_tells_the_hook_once() {
        let t = RegionTable::new();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let s = Arc::clone(&seen);
        // The hook may look at the table: the region is gone by then.
        t.on_detached_release(move |t, addr| s.lock().unwrap().push((addr, t.holds(addr))));
        t.insert(region(0x1000, 0x100)).unwrap();
        t.insert(region(0x2000, 0x100)).unwrap();
        let g = t.acquire(0x1000, 0x10, Side::Local, None).unwrap();
        let g2 = t.acquire(0x2000, 0x10, Side::Local, None).unwrap();
        g.hold_unproven("peer p");
        assert!(t.remove(0x1000).await.is_err());
        assert!(t.holds(0x1000));
        drop(g);
        assert!(!t.holds(0x1000));
        // A region removed the ordinary way does not call it.
        drop(g2);
        t.remove(0x2000).await.unwrap();
        assert_eq!(*seen.lock().unwrap(), vec![(0x1000, false)]);
    }

    #[tokio::test]
    async fn removal_in_steps_keeps_the_range_until_finished() {
        let t = RegionTable::new();
        t.insert(region(0x1000, 0x100)).unwrap();
        let removal = t.remove_in_steps(0x1000).await.unwrap();
        // Closed to transfers, listed no more, but its range is taken.
        assert!(t.acquire(0x1000, 8, Side::Local, None).is_err());
        assert!(t.regions().is_empty());
        assert!(matches!(
            t.insert(region(0x1080, 0x10)),
            Err(Error::RegionOverlap { .. })
        ));
        assert!(matches!(
            t.remove(0x1000).await,
            Err(Error::RegionNotRegistered { .. })
        ));
        // Dropped unfinished: registered and usable again.
        drop(removal);
        assert!(t.acquire(0x1000, 8, Side::Local, None).is_ok());
        // Finished: the range is free.
        t.remove_in_steps(0x1000).await.unwrap().finish();
        assert_eq!(t.len(), 0);
        t.insert(region(0x1080, 0x10)).unwrap();
    }

    #[tokio::test]
    async fn remove_waits_for_guards() {
        let t = RegionTable::new();
        t.insert(region(0x1000, 0x100)).unwrap();
        let g = t.acquire(0x1010, 0x10, Side::Local, None).unwrap();
        let t2 = t.clone();
        let removal = tokio::spawn(async move { t2.remove(0x1000).await });
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        assert!(
            !removal.is_finished(),
            "remove returned while a guard was live"
        );
        assert!(
            t.acquire(0x1010, 0x10, Side::Local, None).is_err(),
            "closing region handed out a guard"
        );
        drop(g);
        let r = removal.await.unwrap().unwrap();
        assert_eq!(r.addr(), 0x1000);
        assert!(t.is_empty());
        assert!(matches!(
            t.remove(0x1000).await,
            Err(Error::RegionNotRegistered { addr: 0x1000 })
        ));
    }

    #[tokio::test]
    async fn cancelled_remove_leaves_region_registered() {
        let t = RegionTable::new();
        t.insert(region(0x1000, 0x100)).unwrap();
        let g = t.acquire(0x1000, 0x10, Side::Local, None).unwrap();
        {
            let removal = t.remove(0x1000);
            tokio::pin!(removal);
            // Polled once (marks the region closing), then dropped.
            assert!(futures::poll!(removal.as_mut()).is_pending());
            assert!(!t.contains(0x1000, 0x10));
        }
        assert!(
            t.contains(0x1000, 0x10),
            "a cancelled remove left the region closed"
        );
        drop(g);
        t.acquire(0x1000, 0x10, Side::Local, None).unwrap();
        t.remove(0x1000).await.unwrap();
        assert!(t.is_empty());
    }
}

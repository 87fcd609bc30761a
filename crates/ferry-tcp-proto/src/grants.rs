//! The target's grants as bookkeeping, and the order in which a region
//! leaves: what the same-host grants page must say, decided here; the
//! driver writes the pages (atomics on shared memory, the Dekker pair of
//! `enter` / `revoke`), asks the marks and the region table, and reports.
//!
//! Invariants:
//! - an address has at most one granted slot, of the generation of its
//!   live registration ([`GrantTable::grant`] revokes a stale one first);
//! - a revocation is remembered by address **and generation** until its
//!   wait ends ([`GrantTable::settled`]): an unfinished revocation of an
//!   earlier registration never answers for a later one at the same
//!   address;
//! - an unregistration revokes the grant and waits for the marks that
//!   name it **before** the region may leave its table, on every path:
//!   a refusal of the table (a payload still held) comes after the grant
//!   is gone ([`Unregistration`]).

use std::collections::HashMap;
use std::time::Duration;

use crate::layout::grants::{mark_value, ENTRIES};
use crate::time::Time;

/// A region granted: where, and under which generation (the region's).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Slot {
    /// Start of the region.
    pub addr: u64,
    /// Its length.
    pub len: u64,
    /// Its registration's generation.
    pub gen: u32,
}

/// Where [`GrantTable::grant`] put a grant.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Granted {
    /// The entry to publish in every area.
    pub idx: usize,
    /// An entry of an earlier registration at the same address that was
    /// still granted (a bug elsewhere): revoke it in every area.
    pub stale: Option<usize>,
}

/// See the module. `W` is what the driver keeps of a revocation to wait
/// on it (the areas and processes whose marks may name it).
#[derive(Debug)]
pub struct GrantTable<W> {
    slots: Vec<Option<Slot>>,
    by_addr: HashMap<u64, usize>,
    /// Revocations whose wait has not ended, by address and generation:
    /// the mark value they wait on, and the driver's watch.
    held: HashMap<(u64, u32), (u64, W)>,
    closed: bool,
}

impl<W> Default for GrantTable<W> {
    fn default() -> Self {
        GrantTable {
            slots: Vec::new(),
            by_addr: HashMap::new(),
            held: HashMap::new(),
            closed: false,
        }
    }
}

impl<W: Clone> GrantTable<W> {
    /// Entries in use (granted or free between granted ones): what a page
    /// must publish.
    #[inline]
    pub fn used(&self) -> usize {
        self.slots.len()
    }

    /// The granted entries, by index.
    pub fn granted(&self) -> impl Iterator<Item = (usize, Slot)> + '_ {
        self.slots
            .iter()
            .enumerate()
            .filter_map(|(i, s)| s.map(|s| (i, s)))
    }

    /// Whether the engine stopped serving (nothing is granted any more).
    #[inline]
    pub fn is_closed(&self) -> bool {
        self.closed
    }

    /// Grants `slot` (a region just registered); `None` when closed or
    /// when every entry is taken (the region is then served as frames).
    pub fn grant(&mut self, slot: Slot) -> Option<Granted> {
        if self.closed {
            return None;
        }
        let idx = match self.slots.iter().position(Option::is_none) {
            Some(i) => i,
            None if self.slots.len() < ENTRIES => {
                self.slots.push(None);
                self.slots.len() - 1
            }
            None => return None,
        };
        self.slots[idx] = Some(slot);
        let stale = self
            .by_addr
            .insert(slot.addr, idx)
            .and_then(|old| self.slots[old].take().map(|_| old));
        Some(Granted { idx, stale })
    }

    /// Revokes the grant of the registration `(addr, gen)`: `revoke(idx,
    /// value)` is called to revoke entry `idx` in every area (and returns
    /// what to wait on: marks of `value`). Returns that watch, or the one
    /// of an earlier revocation of this very registration whose wait has
    /// not ended; `None` if it has no grant. A grant of another generation
    /// at the address is not touched.
    pub fn revoke(
        &mut self,
        addr: u64,
        gen: u32,
        revoke: impl FnOnce(usize, u64) -> W,
    ) -> Option<W> {
        if let Some((_, w)) = self.held.get(&(addr, gen)) {
            return Some(w.clone());
        }
        let idx = *self.by_addr.get(&addr)?;
        if self.slots[idx].is_none_or(|s| s.gen != gen) {
            return None;
        }
        self.by_addr.remove(&addr);
        let slot = self.slots[idx].take()?;
        let value = mark_value(idx, slot.gen);
        let w = revoke(idx, value);
        self.held.insert((addr, gen), (value, w.clone()));
        Some(w)
    }

    /// The wait for the revocation of `(addr, gen)` ended: no mark names
    /// it any more.
    pub fn settled(&mut self, addr: u64, gen: u32) {
        self.held.remove(&(addr, gen));
    }

    /// The region a mark of value `v` names (0: none known).
    pub fn region_of(&self, v: u64) -> u64 {
        let by_slot = usize::try_from(v >> 32)
            .ok()
            .and_then(|i| i.checked_sub(1))
            .and_then(|i| self.slots.get(i).copied().flatten())
            .filter(|s| s.gen == v as u32)
            .map(|s| s.addr);
        by_slot
            .or_else(|| {
                self.held
                    .iter()
                    .find(|(_, (value, _))| *value == v)
                    .map(|((addr, _), _)| *addr)
            })
            .unwrap_or(0)
    }

    /// The engine stops serving: nothing is granted any more; returns the
    /// entries in use, every one of which the driver revokes in every
    /// area.
    pub fn close(&mut self) -> usize {
        self.closed = true;
        self.used()
    }
}

/// What the driver does next for an [`Unregistration`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum UnregisterStep {
    /// Revoke the grant of the registration ([`GrantTable::revoke`]);
    /// report with [`Unregistration::revoked`].
    Revoke {
        /// Its generation.
        gen: u32,
    },
    /// Wait until no live mark names the revocation, until `deadline`;
    /// report with [`Unregistration::settled`].
    Settle {
        /// The end of the patience.
        deadline: Time,
    },
    /// Take the region out of the table (waiting for its payloads in
    /// flight); report with [`Unregistration::removed`].
    Remove,
    /// Forget the generation of the address, if it is still `gen` (a new
    /// registration may have taken the address since); then it is done.
    Forget {
        /// The generation to forget.
        gen: u32,
    },
    /// Finished.
    Done(Result<(), Unfinished>),
}

/// Why an unregistration did not finish (the region stays registered).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Unfinished {
    /// A live same-host peer still marks a copy under the revoked grant
    /// after the patience (its process is stopped?): the grant stays
    /// revoked; a later unregistration waits for the same marks again.
    Marked {
        /// Its process.
        pid: i32,
        /// The patience that ran out.
        patience: Duration,
    },
    /// The region table refused (its error is the driver's to report).
    Table,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    Start,
    Revoking,
    Settling,
    Removing,
    Forgetting,
    Done,
}

/// The order in which a registration at `addr` leaves: revoke its grant,
/// wait for the marks, then the table, then its generation. Driven by the
/// driver's reports; each report answers the step asked.
#[derive(Debug)]
pub struct Unregistration {
    gen: Option<u32>,
    patience: Duration,
    state: State,
}

impl Unregistration {
    /// The unregistration of the registration at an address, whose
    /// generation is `gen` (`None`: none known, nothing was granted);
    /// `patience`: how long the marks are waited for.
    pub fn new(gen: Option<u32>, patience: Duration) -> Unregistration {
        Unregistration {
            gen,
            patience,
            state: State::Start,
        }
    }

    /// The first step.
    pub fn start(&mut self) -> UnregisterStep {
        if cfg!(ferry_mutant = "grant_outlives_region") {
            // The bug of 888a448: the table first; a refusal returns
            // before the grant is revoked.
            self.state = State::Removing;
            return UnregisterStep::Remove;
        }
        match self.gen {
            Some(gen) => {
                self.state = State::Revoking;
                UnregisterStep::Revoke { gen }
            }
            None => {
                self.state = State::Removing;
                UnregisterStep::Remove
            }
        }
    }

    /// The grant was revoked (`any`: there was one, or an earlier
    /// revocation of it is still waited for) at `now`.
    pub fn revoked(&mut self, now: Time, any: bool) -> UnregisterStep {
        debug_assert_eq!(self.state, State::Revoking);
        if any {
            self.state = State::Settling;
            UnregisterStep::Settle {
                deadline: now.after(self.patience),
            }
        } else if cfg!(ferry_mutant = "grant_outlives_region") {
            self.forget()
        } else {
            self.state = State::Removing;
            UnregisterStep::Remove
        }
    }

    /// The wait ended: `Ok` no mark names the revocation, `Err(pid)` a live
    /// process still marks a copy under it.
    pub fn settled(&mut self, r: Result<(), i32>) -> UnregisterStep {
        debug_assert_eq!(self.state, State::Settling);
        match r {
            Err(pid) => self.done(Err(Unfinished::Marked {
                pid,
                patience: self.patience,
            })),
            Ok(()) if cfg!(ferry_mutant = "grant_outlives_region") => self.forget(),
            Ok(()) => {
                self.state = State::Removing;
                UnregisterStep::Remove
            }
        }
    }

    /// The table took the region out (`true`) or refused.
    pub fn removed(&mut self, ok: bool) -> UnregisterStep {
        debug_assert_eq!(self.state, State::Removing);
        if !ok {
            return self.done(Err(Unfinished::Table));
        }
        match self.gen {
            Some(gen) if cfg!(ferry_mutant = "grant_outlives_region") => {
                self.state = State::Revoking;
                UnregisterStep::Revoke { gen }
            }
            _ => self.forget(),
        }
    }

    fn forget(&mut self) -> UnregisterStep {
        match self.gen {
            Some(gen) => {
                self.state = State::Forgetting;
                UnregisterStep::Forget { gen }
            }
            None => self.done(Ok(())),
        }
    }

    /// The generation was forgotten (or kept for a newer registration).
    pub fn forgotten(&mut self) -> UnregisterStep {
        debug_assert_eq!(self.state, State::Forgetting);
        self.done(Ok(()))
    }

    fn done(&mut self, r: Result<(), Unfinished>) -> UnregisterStep {
        self.state = State::Done;
        UnregisterStep::Done(r)
    }
}

#[cfg(all(test, not(ferry_mutant = "grant_outlives_region")))]
mod tests {
    use super::*;

    fn run(
        gen: Option<u32>,
        granted: bool,
        marks: Result<(), i32>,
        table: bool,
    ) -> Vec<UnregisterStep> {
        let mut u = Unregistration::new(gen, Duration::from_secs(1));
        let mut steps = vec![u.start()];
        loop {
            let next = match *steps.last().unwrap() {
                UnregisterStep::Revoke { .. } => u.revoked(Time::ZERO, granted),
                UnregisterStep::Settle { .. } => u.settled(marks),
                UnregisterStep::Remove => u.removed(table),
                UnregisterStep::Forget { .. } => u.forgotten(),
                UnregisterStep::Done(_) => return steps,
            };
            steps.push(next);
        }
    }

    /// The grant goes before the table on every path: a table that
    /// refuses (a payload held) finds the grant already revoked and
    /// settled; marks that stay end it before the table is asked.
    #[test]
    fn the_grant_goes_first_on_every_path() {
        use UnregisterStep::*;
        let settle = Settle {
            deadline: Time::ZERO.after(Duration::from_secs(1)),
        };
        assert_eq!(
            run(Some(3), true, Ok(()), true),
            [
                Revoke { gen: 3 },
                settle,
                Remove,
                Forget { gen: 3 },
                Done(Ok(()))
            ]
        );
        assert_eq!(
            run(Some(3), true, Ok(()), false),
            [
                Revoke { gen: 3 },
                settle,
                Remove,
                Done(Err(Unfinished::Table))
            ]
        );
        assert_eq!(
            run(Some(3), true, Err(42), true),
            [
                Revoke { gen: 3 },
                settle,
                Done(Err(Unfinished::Marked {
                    pid: 42,
                    patience: Duration::from_secs(1)
                }))
            ]
        );
        assert_eq!(
            run(Some(3), false, Ok(()), false),
            [Revoke { gen: 3 }, Remove, Done(Err(Unfinished::Table))]
        );
        assert_eq!(run(None, false, Ok(()), true), [Remove, Done(Ok(()))]);
    }

    /// A revocation is remembered by address and generation: a later
    /// registration at the address is revoked for itself, and the first
    /// one's unfinished wait never answers for it.
    #[test]
    fn revocations_are_keyed_by_address_and_generation() {
        let mut t = GrantTable::<u64>::default();
        let g1 = t
            .grant(Slot {
                addr: 0x1000,
                len: 64,
                gen: 1,
            })
            .unwrap();
        assert_eq!(g1.stale, None);
        let mut revoked = Vec::new();
        let w1 = t.revoke(0x1000, 1, |idx, v| {
            revoked.push(idx);
            v
        });
        assert_eq!(w1, Some(mark_value(g1.idx, 1)));
        // Its wait has not ended; the address is registered again.
        let g2 = t
            .grant(Slot {
                addr: 0x1000,
                len: 64,
                gen: 2,
            })
            .unwrap();
        assert_eq!(g2.stale, None, "the first grant was already gone");
        // Asking again for generation 1 answers its own wait, touching
        // nothing; generation 2 is revoked for itself.
        assert_eq!(t.revoke(0x1000, 1, |_, _| unreachable!()), w1);
        let w2 = t.revoke(0x1000, 2, |idx, v| {
            revoked.push(idx);
            v
        });
        assert_eq!(w2, Some(mark_value(g2.idx, 2)));
        assert_eq!(revoked, [g1.idx, g2.idx]);
        assert_eq!(t.region_of(mark_value(g2.idx, 2)), 0x1000);
        t.settled(0x1000, 1);
        t.settled(0x1000, 2);
        assert_eq!(t.revoke(0x1000, 2, |_, _| unreachable!()), None);
        // A grant left behind by a bug is revoked by the next one.
        let g3 = t
            .grant(Slot {
                addr: 0x2000,
                len: 8,
                gen: 5,
            })
            .unwrap();
        let g4 = t
            .grant(Slot {
                addr: 0x2000,
                len: 8,
                gen: 6,
            })
            .unwrap();
        assert_eq!(g4.stale, Some(g3.idx));
        assert_eq!(t.granted().count(), 1);
        assert_eq!(t.close(), t.used());
        assert!(t
            .grant(Slot {
                addr: 0x3000,
                len: 8,
                gen: 7
            })
            .is_none());
    }
}

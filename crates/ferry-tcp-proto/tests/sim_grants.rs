//! Deterministic simulation of the same-host grants (issue 42, simulator
//! v1): the real cores ([`GrantTable`], [`Unregistration`]) driven the
//! way ferry-tcp's `Grants` and `Core::unregister` drive them, in a world
//! of same-host initiators that mark, copy and leave (the Dekker protocol
//! of the grants page, one step at a time), processes stopped between
//! their mark and their copy or killed, a region table whose removal is
//! refused while a payload is held unproven (the CREAD fence) and which
//! then lets the region go by itself later, and an application that
//! registers, unregisters, retries, frees and registers again at the same
//! addresses, on virtual time. One seed is one schedule.
//!
//! Checked at every copy: **(a)** no byte of a registration lands after
//! the application was told it may free it (`unregister` returned `Ok`,
//! or `RegionNotRegistered` after an earlier `RegionHeld`, as
//! `RegisteredBuffer` takes it).
//!
//! `cargo test -p ferry-tcp-proto --test sim_grants` runs
//! [`DEFAULT_SEEDS`] seeds and prints what it ran; `FERRY_SIM_SEEDS=N`
//! runs N; a failure prints its seed and `FERRY_SIM_SEED=<s>` replays it.
//! With `RUSTFLAGS='--cfg ferry_mutant="grant_outlives_region"'` the
//! unregistration takes the order of 888a448 (the table first), and the
//! test expects the simulator to find it.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::{Duration, Instant};

mod common;

use common::Rng;
use ferry_tcp_proto::grants::{GrantTable, Slot, Unfinished, UnregisterStep, Unregistration};
use ferry_tcp_proto::time::Time;

const DEFAULT_SEEDS: u64 = 10_000;
const STEPS: u64 = 300;
const SLOTS: u64 = 4;
const INITIATORS: usize = 2;
const PATIENCE: Duration = Duration::from_millis(20);

/// The region table as the engine has it (`RegionTable`): a region with a
/// payload held unproven (the CREAD fence) is refused removal and leaves
/// by itself once the last such hold goes.
#[derive(Debug)]
struct Region {
    unproven: u32,
    detached: bool,
}

/// An initiator process: its grants page (entry generations as published,
/// its one mark) and what it is doing.
#[derive(Debug, Default)]
struct Initiator {
    /// Entry index → (generation, address) as published (0: revoked).
    entries: HashMap<usize, (u32, u64)>,
    mark: u64,
    /// Marked for a copy into the registration (addr, gen).
    copying: Option<(u64, u32)>,
    stopped_until: Time,
    dead: bool,
}

/// What the application knows of one address.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum App {
    Free,
    Registered { gen: u32, held_before: bool },
}

/// An unregistration in progress and the step it waits on.
struct Pending {
    addr: u64,
    gen: Option<u32>,
    u: Unregistration,
    step: UnregisterStep,
    /// The revocation's mark value, once revoked.
    value: Option<u64>,
    /// The table's refusal: true for `RegionHeld`, false for
    /// `RegionNotRegistered`.
    refused_held: Option<bool>,
}

struct World {
    now: Time,
    rng: Rng,
    table: GrantTable<u64>,
    gens: HashMap<u64, u32>,
    regions: BTreeMap<u64, Region>,
    inits: Vec<Initiator>,
    app: HashMap<u64, App>,
    freed: HashSet<(u64, u32)>,
    pending: Vec<Pending>,
    next_gen: u32,
    copies: u64,
}

impl World {
    fn publish_all(&mut self, idx: usize, entry: (u32, u64)) {
        for i in &mut self.inits {
            i.entries.insert(idx, entry);
        }
    }

    fn revoke_entry(inits: &mut [Initiator], idx: usize) {
        for i in inits {
            if let Some(e) = i.entries.get_mut(&idx) {
                e.0 = 0;
            }
        }
    }

    /// `Grants::revoke`: the entry is revoked in every page; the watch is
    /// the mark value.
    fn revoke(&mut self, addr: u64, gen: u32) -> Option<u64> {
        let inits = &mut self.inits;
        self.table.revoke(addr, gen, |idx, value| {
            World::revoke_entry(inits, idx);
            value
        })
    }

    /// A live (not dead) process marks a copy under `value`.
    fn marked_by(&self, value: u64) -> Option<usize> {
        self.inits.iter().position(|i| !i.dead && i.mark == value)
    }

    fn register(&mut self, addr: u64) {
        if self.regions.contains_key(&addr) {
            return;
        }
        self.next_gen += 1;
        let gen = self.next_gen;
        self.regions.insert(
            addr,
            Region {
                unproven: 0,
                detached: false,
            },
        );
        self.gens.insert(addr, gen);
        self.app.insert(
            addr,
            App::Registered {
                gen,
                held_before: false,
            },
        );
        if let Some(g) = self.table.grant(Slot {
            addr,
            len: 4096,
            gen,
        }) {
            if let Some(old) = g.stale {
                World::revoke_entry(&mut self.inits, old);
            }
            self.publish_all(g.idx, (gen, addr));
        }
    }

    /// The region table lets a detached region go (its last unproven hold
    /// went): `Core::forget_detached`.
    fn forget_detached(&mut self, addr: u64) {
        self.regions.remove(&addr);
        if let Some(gen) = self.gens.remove(&addr) {
            let _ = self.revoke(addr, gen);
        }
    }

    /// Runs an unregistration's steps until it waits (a settle before its
    /// deadline) or ends; returns whether it ended.
    fn drive(&mut self, p: &mut Pending) -> bool {
        loop {
            p.step = match p.step {
                UnregisterStep::Revoke { gen } => {
                    p.value = self.revoke(p.addr, gen);
                    p.u.revoked(self.now, p.value.is_some())
                }
                UnregisterStep::Settle { deadline } => {
                    let held = p.value.and_then(|v| self.marked_by(v));
                    match held {
                        None => {
                            if let Some(gen) = p.gen {
                                self.table.settled(p.addr, gen);
                            }
                            p.u.settled(Ok(()))
                        }
                        Some(_) if self.now < deadline => return false,
                        Some(i) => p.u.settled(Err(i as i32)),
                    }
                }
                UnregisterStep::Remove => match self.regions.get_mut(&p.addr) {
                    None => {
                        p.refused_held = Some(false);
                        p.u.removed(false)
                    }
                    Some(r) if r.unproven > 0 => {
                        r.detached = true;
                        p.refused_held = Some(true);
                        p.u.removed(false)
                    }
                    Some(_) => {
                        self.regions.remove(&p.addr);
                        p.u.removed(true)
                    }
                },
                UnregisterStep::Forget { gen } => {
                    if self.gens.get(&p.addr) == Some(&gen) {
                        self.gens.remove(&p.addr);
                    }
                    p.u.forgotten()
                }
                UnregisterStep::Done(r) => {
                    let App::Registered { gen, held_before } = self.app[&p.addr] else {
                        unreachable!("only registered addresses are unregistered")
                    };
                    let may_free = match r {
                        Ok(()) => true,
                        Err(Unfinished::Table) if p.refused_held == Some(false) => held_before,
                        Err(_) => false,
                    };
                    if may_free {
                        self.freed.insert((p.addr, gen));
                        self.app.insert(p.addr, App::Free);
                    } else {
                        self.app.insert(
                            p.addr,
                            App::Registered {
                                gen,
                                held_before: true,
                            },
                        );
                    }
                    return true;
                }
            };
        }
    }

    fn step(&mut self) -> Result<(), String> {
        self.now = self.now.after(Duration::from_millis(1 + self.rng.below(3)));
        // Unregistrations waiting on marks go on.
        let mut pending = std::mem::take(&mut self.pending);
        pending.retain_mut(|p| !self.drive(p));
        self.pending.extend(pending);
        match self.rng.below(100) {
            // The application.
            0..=24 => {
                let addr = 0x1000 * (1 + self.rng.below(SLOTS));
                let busy = self.pending.iter().any(|p| p.addr == addr);
                match self.app.get(&addr).copied().unwrap_or(App::Free) {
                    App::Free if !self.regions.contains_key(&addr) => self.register(addr),
                    App::Registered { .. } if !busy => {
                        let gen = self.gens.get(&addr).copied();
                        let mut u = Unregistration::new(gen, PATIENCE);
                        let step = u.start();
                        let mut p = Pending {
                            addr,
                            gen,
                            u,
                            step,
                            value: None,
                            refused_held: None,
                        };
                        if !self.drive(&mut p) {
                            self.pending.push(p);
                        }
                    }
                    _ => {}
                }
            }
            // An initiator marks, then copies and leaves.
            25..=69 => {
                let i = self.rng.below(INITIATORS as u64) as usize;
                let now = self.now;
                let pick = self.rng.next();
                let init = &mut self.inits[i];
                if init.dead || init.stopped_until > now {
                    return Ok(());
                }
                match init.copying.take() {
                    None => {
                        let granted: Vec<(usize, (u32, u64))> = {
                            let mut v: Vec<_> = init
                                .entries
                                .iter()
                                .filter(|(_, e)| e.0 != 0)
                                .map(|(&k, &e)| (k, e))
                                .collect();
                            v.sort();
                            v
                        };
                        if granted.is_empty() {
                            return Ok(());
                        }
                        let (idx, (gen, addr)) = granted[(pick % granted.len() as u64) as usize];
                        // `enter`: the mark, then the look at the entry.
                        init.mark = ferry_tcp_proto::layout::grants::mark_value(idx, gen);
                        if init.entries.get(&idx).map(|e| e.0) == Some(gen) {
                            init.copying = Some((addr, gen));
                        } else {
                            init.mark = 0;
                        }
                    }
                    Some((addr, gen)) => {
                        // The copy lands, then `leave`.
                        self.copies += 1;
                        if self.freed.contains(&(addr, gen)) {
                            return Err(format!(
                                "a copy landed in the registration {addr:#x}/{gen} after the \
                                 application was told it may free it"
                            ));
                        }
                        init.mark = 0;
                    }
                }
            }
            // An initiator is stopped for a while (often between its mark
            // and its copy).
            70..=79 => {
                let i = self.rng.below(INITIATORS as u64) as usize;
                let d = Duration::from_millis(self.rng.below(120));
                self.inits[i].stopped_until = self.now.after(d);
            }
            // A process dies; a new one connects (its page gets every
            // grant, as `Grants::attach` publishes them).
            80..=82 => {
                let i = self.rng.below(INITIATORS as u64) as usize;
                if self.inits[i].dead {
                    let mut fresh = Initiator::default();
                    for (idx, s) in self.table.granted() {
                        fresh.entries.insert(idx, (s.gen, s.addr));
                    }
                    self.inits[i] = fresh;
                } else {
                    self.inits[i].dead = true;
                    self.inits[i].copying = None;
                }
            }
            // A CREAD from a stopped peer is given up: its payload stays
            // held, unproven, until the peer's connection closes.
            83..=90 => {
                let addr = 0x1000 * (1 + self.rng.below(SLOTS));
                if let Some(r) = self.regions.get_mut(&addr) {
                    if !r.detached {
                        r.unproven += 1;
                    }
                }
            }
            _ => {
                let addr = 0x1000 * (1 + self.rng.below(SLOTS));
                let gone = match self.regions.get_mut(&addr) {
                    Some(r) if r.unproven > 0 => {
                        r.unproven -= 1;
                        r.unproven == 0 && r.detached
                    }
                    _ => false,
                };
                if gone {
                    self.forget_detached(addr);
                }
            }
        }
        Ok(())
    }
}

fn run_seed(seed: u64) -> Result<(u64, u64), String> {
    let mut w = World {
        now: Time::ZERO,
        rng: Rng(seed),
        table: GrantTable::default(),
        gens: HashMap::new(),
        regions: BTreeMap::new(),
        inits: (0..INITIATORS).map(|_| Initiator::default()).collect(),
        app: HashMap::new(),
        freed: HashSet::new(),
        pending: Vec::new(),
        next_gen: 0,
        copies: 0,
    };
    for n in 0..STEPS {
        w.step().map_err(|e| format!("step {n}: {e}"))?;
    }
    Ok((STEPS, w.copies))
}

#[test]
fn no_granted_copy_lands_after_unregister_returned() {
    let mutant = cfg!(ferry_mutant = "grant_outlives_region");
    if let Some(seed) = std::env::var("FERRY_SIM_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
    {
        match run_seed(seed) {
            Ok((steps, copies)) => {
                eprintln!("sim grants: seed {seed} passed, {steps} steps, {copies} copies")
            }
            Err(e) => panic!("sim grants: seed {seed}: {e}"),
        }
        return;
    }
    let seeds: u64 = std::env::var("FERRY_SIM_SEEDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(DEFAULT_SEEDS);
    let start = Instant::now();
    let (mut steps, mut copies) = (0, 0);
    for seed in 0..seeds {
        match run_seed(seed) {
            Ok((s, c)) => {
                steps += s;
                copies += c;
            }
            Err(e) if mutant => {
                eprintln!(
                    "sim grants: the mutant grant_outlives_region found at seed {seed} \
                     after {steps} steps of the seeds before ({e})"
                );
                return;
            }
            Err(e) => panic!(
                "sim grants: seed {seed}: {e}; replay with FERRY_SIM_SEED={seed} cargo test \
                 -p ferry-tcp-proto --test sim_grants"
            ),
        }
    }
    assert!(!mutant, "the mutant grant_outlives_region was not found");
    eprintln!(
        "sim grants: {seeds} seeds, {steps} steps, {copies} granted copies in {:.1} s",
        start.elapsed().as_secs_f64()
    );
}

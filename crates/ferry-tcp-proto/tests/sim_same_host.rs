//! Deterministic simulation of the same-host copies (issue 42, simulator
//! v1): the target's core ([`TargetConn`]: the offer, the region checks
//! with generations, the [`Step::Copy`] instructions naming the
//! initiator's addresses) and the initiator's ([`Pending`], [`on_header`],
//! [`target_writes`] and the [`Fence`]) driven the way ferry-tcp drives
//! them, over one initiator memory (byte arrays its application
//! registers, unregisters, frees, reuses and registers again at the same
//! addresses) and one target memory, on virtual time. The target executes
//! the copies of a CREAD into the initiator's memory and of a CWRITE out
//! of it; it checks that the initiator has not closed the connection,
//! and is sometimes stopped between that check and its copy (SIGSTOP, a
//! cgroup freeze) or killed; the initiator times its operations out,
//! closes the connection and lets go of their memory as its core says.
//! One seed is one schedule.
//!
//! Checked after every step:
//! - **(a, b) memory:** the initiator's memory equals a reference that
//!   takes the application's own writes, and a target's copy only where
//!   the registration the operation named is still registered: so no byte
//!   of a region changes after its `unregister` returned, and no byte
//!   outside registered memory changes;
//! - **answers:** every answer names an operation in flight or abandoned
//!   (a protocol error fails the seed); an abandoned operation's memory
//!   is held until the target's side has ended;
//! - **(e) bounded state:** the target core's memory stays under its bound;
//! - at the end (every connection given up, the targets resumed), no
//!   registration is held any more.
//!
//! `cargo test -p ferry-tcp-proto --test sim_same_host` runs
//! [`DEFAULT_SEEDS`] seeds and prints what it ran; `FERRY_SIM_SEEDS=N`
//! runs N; a failure prints its seed and `FERRY_SIM_SEED=<s>` replays it.
//!
//! With `RUSTFLAGS='--cfg ferry_mutant="cread_unfenced"'` the initiator's
//! core has no CREAD fence (the bug of 7c3e5e6: a CREAD given up on
//! timeout let its destination go while the target could still copy into
//! it), and the test expects the simulator to find it. It does at seed 1,
//! step 56 (after the 101 steps of seed 0; 5,053 of the 10,000 default
//! seeds find it): a target stopped between its check and its copy writes
//! into a region the application has
//! unregistered and reused.

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

mod common;

use common::{Rng, HELD_BOUND};
use ferry_tcp_proto::frame::{
    decode_ids, encode_cma_segments, CmaSegment, Request, Response, Segment, Status, HEADER_LEN,
};
use ferry_tcp_proto::initiator::{
    on_header, target_writes, Answered, Expect, Fence, Pending, Recv, Reply,
};
use ferry_tcp_proto::offer::OFFER_LEN;
use ferry_tcp_proto::target::{Copy, Regions, SameHost, SameHostTerms, Step, TargetConn};
use ferry_tcp_proto::time::Time;

const DEFAULT_SEEDS: u64 = 10_000;
const STEPS: u64 = 100;
/// Steps after which the end (every connection given up) must be reached.
const DRAIN: u64 = 200;
const IBASE: u64 = 0x5500_0000_0000;
const ISLOTS: u64 = 4;
const ISLOT: u64 = 256;
const TBASE: u64 = 0x7f00_0000_0000;
const TSLOTS: u64 = 4;
const TSLOT: u64 = 512;
const TICK: Duration = Duration::from_millis(1);
const TIMEOUT: Duration = Duration::from_millis(8);
const PATIENCE: Duration = Duration::from_millis(20);

/// A registration of the initiator's application.
#[derive(Debug)]
struct IReg {
    id: u64,
    len: u64,
    /// Operations (or fences) holding it.
    guards: u32,
    /// Marked by a fence past its patience (`unregister`: `RegionHeld`).
    unproven: bool,
}

/// A region of the target's table.
#[derive(Debug)]
struct TReg {
    len: u64,
    gen: u32,
    holds: u32,
}

#[derive(Debug)]
struct THold {
    addr: u64,
    len: u64,
}

struct TTable<'a>(&'a mut BTreeMap<u64, TReg>);

impl Regions for TTable<'_> {
    type Hold = THold;
    fn acquire(&mut self, addr: u64, len: u64, gen: u32) -> Result<THold, Status> {
        let end = addr.checked_add(len).ok_or(Status::AddressNotRegistered)?;
        match self.0.range_mut(..=addr).next_back() {
            Some((&b, r)) if end <= b + r.len => {
                if r.gen != gen {
                    return Err(Status::StaleRegion);
                }
                r.holds += 1;
                Ok(THold { addr, len })
            }
            _ => Err(Status::AddressNotRegistered),
        }
    }
}

fn release_holds(t: &mut BTreeMap<u64, TReg>, holds: Vec<Result<THold, Status>>) {
    for h in holds.into_iter().flatten() {
        let r = t
            .range_mut(..=h.addr)
            .next_back()
            .expect("a held region stays");
        r.1.holds -= 1;
    }
}

/// An operation in flight on the initiator's side: a CREAD or CWRITE
/// whose local segments lie in one registration.
#[derive(Debug)]
struct Op {
    read: bool,
    base: u64,
    segs: usize,
    deadline: Time,
}

impl Answered for Op {
    fn expect(&self) -> Expect {
        Expect::AckV
    }
}

/// What the target's side of a connection is doing.
enum TState {
    Idle,
    /// Checked that the initiator still wants the copy; copies at
    /// `resume` (later when stopped).
    Checked {
        copy: Copy<THold>,
        resume: Time,
    },
}

struct Conn {
    core: TargetConn,
    /// Initiator → target.
    wire: Vec<u8>,
    /// Target → initiator, not yet read.
    answers: Vec<u8>,
    pending: Pending<Op, ()>,
    next_id: u64,
    /// The initiator has the same-host path agreed.
    agreed: bool,
    /// The initiator gave up the connection (shut its writing half).
    i_closed: bool,
    t: TState,
    /// The target's side has ended (closed, or its process died).
    t_ended: bool,
}

struct World {
    now: Time,
    rng: Rng,
    imem: Vec<u8>,
    imodel: Vec<u8>,
    iregs: BTreeMap<u64, IReg>,
    next_reg: u64,
    tmem: Vec<u8>,
    tregs: BTreeMap<u64, TReg>,
    next_gen: u32,
    conns: Vec<Conn>,
    /// Fences: the connection, the fence, the registrations it holds.
    fences: Vec<(usize, Fence, Vec<u64>)>,
    /// (connection, request id) → the registration its local segments lie in.
    sent: HashMap<(usize, u64), u64>,
    steps: u64,
    stats: Stats,
}

#[derive(Default)]
struct Stats {
    copies: u64,
    stopped: u64,
    given_up: u64,
    fenced: u64,
    held_refusals: u64,
}

fn ioff(addr: u64) -> usize {
    (addr - IBASE) as usize
}

fn toff(addr: u64) -> usize {
    (addr - TBASE) as usize
}

impl World {
    fn release(&mut self, base: u64) {
        let r = self
            .iregs
            .get_mut(&base)
            .expect("a held registration stays");
        r.guards -= 1;
    }

    fn app_step(&mut self) {
        let base = IBASE + self.rng.below(ISLOTS) * ISLOT;
        match self.iregs.get(&base) {
            None => {
                self.next_reg += 1;
                let len = 16 + self.rng.below(ISLOT - 16);
                self.iregs.insert(
                    base,
                    IReg {
                        id: self.next_reg,
                        len,
                        guards: 0,
                        unproven: false,
                    },
                );
            }
            Some(r) if r.guards > 0 => {
                // Refused: `RegionHeld` when unproven, else it waits for
                // the payloads in flight (tried again later here).
                if r.unproven {
                    self.stats.held_refusals += 1;
                }
            }
            Some(_) => {
                // Unregistered: the memory is freed and reused.
                self.iregs.remove(&base);
                let o = ioff(base);
                for i in o..o + ISLOT as usize {
                    let b = self.rng.next() as u8;
                    self.imem[i] = b;
                    self.imodel[i] = b;
                }
            }
        }
    }

    fn target_churn(&mut self) {
        let base = TBASE + self.rng.below(TSLOTS) * TSLOT;
        match self.tregs.get(&base) {
            Some(r) if r.holds == 0 => {
                self.tregs.remove(&base);
            }
            Some(_) => {}
            None => {
                self.next_gen += 1;
                let len = 1 + self.rng.below(TSLOT);
                self.tregs.insert(
                    base,
                    TReg {
                        len,
                        gen: self.next_gen,
                        holds: 0,
                    },
                );
            }
        }
    }

    fn open(&mut self) {
        let mut wire = Vec::new();
        wire.extend(
            Request::SameHost {
                id: 0,
                channel: None,
                stage: None,
            }
            .encode(),
        );
        wire.extend((0..OFFER_LEN).map(|i| i as u8));
        let terms = SameHostTerms {
            on: true,
            announced: true,
            provable: true,
            channel: false,
            staging: false,
            grants: false,
        };
        self.conns.push(Conn {
            core: TargetConn::with_same_host(terms),
            wire,
            answers: Vec::new(),
            pending: Pending::new(),
            next_id: 1,
            agreed: false,
            i_closed: false,
            t: TState::Idle,
            t_ended: false,
        });
    }

    /// A target range: mostly inside a region, sometimes stale or outside.
    fn target_range(&mut self, max: u64) -> Segment {
        let regs: Vec<(u64, u64, u32)> =
            self.tregs.iter().map(|(&b, r)| (b, r.len, r.gen)).collect();
        let len = 1 + self.rng.below(max);
        if regs.is_empty() || self.rng.chance(8) {
            let addr = TBASE + self.rng.below(TSLOTS * TSLOT - len);
            return Segment {
                addr,
                len,
                gen: self.rng.below(3) as u32,
            };
        }
        let (b, l, g) = regs[self.rng.below(regs.len() as u64) as usize];
        let len = len.min(l);
        let addr = b + self.rng.below(l - len + 1);
        let gen = if self.rng.chance(8) { g + 1 } else { g };
        Segment { addr, len, gen }
    }

    /// The initiator sends a CREAD or CWRITE on connection `c`.
    fn send(&mut self, c: usize) {
        let regs: Vec<(u64, u64, u64)> =
            self.iregs.iter().map(|(&b, r)| (b, r.len, r.id)).collect();
        if regs.is_empty() {
            return;
        }
        let (base, len, reg) = regs[self.rng.below(regs.len() as u64) as usize];
        let read = self.rng.chance(60);
        let n = 1 + self.rng.below(3) as usize;
        let segs: Vec<CmaSegment> = (0..n)
            .map(|_| {
                let seg = self.target_range(len.min(64));
                let local = base + self.rng.below(len - seg.len + 1);
                CmaSegment { seg, local }
            })
            .collect();
        let total = segs.iter().map(|s| s.seg.len).sum();
        let conn = &mut self.conns[c];
        let id = conn.next_id;
        conn.next_id += 1;
        let op = Op {
            read,
            base,
            segs: n,
            deadline: self.now.after(TIMEOUT),
        };
        if conn.pending.insert(id, op).is_err() {
            return;
        }
        conn.wire.extend(
            Request::Cma {
                id,
                read,
                staged: false,
                count: n as u32,
                total,
            }
            .encode(),
        );
        conn.wire.extend(encode_cma_segments(&segs));
        self.iregs.get_mut(&base).unwrap().guards += 1;
        self.sent.insert((c, id), reg);
    }

    /// The initiator gives up connection `c` (an operation expired, or
    /// the target's side ended): it closes, and each operation's memory
    /// goes back now or to a fence, as its core says.
    fn give_up(&mut self, c: usize, mut ops: Vec<Op>) {
        let conn = &mut self.conns[c];
        ops.extend(conn.pending.close(()));
        conn.i_closed = true;
        let mut held = Vec::new();
        for op in ops {
            if target_writes(op.read, false) {
                held.push(op.base);
            } else {
                self.release(op.base);
            }
        }
        if !held.is_empty() {
            self.stats.fenced += 1;
            self.fences.push((c, Fence::new(self.now, PATIENCE), held));
        }
    }

    fn fences_step(&mut self) {
        let now = self.now;
        let mut i = 0;
        while i < self.fences.len() {
            let (c, f, _) = &mut self.fences[i];
            if self.conns[*c].t_ended {
                f.on_peer_end();
                let (_, _, held) = self.fences.swap_remove(i);
                for base in held {
                    self.release(base);
                }
                continue;
            }
            if f.on_timeout(now) {
                let held = self.fences[i].2.clone();
                for base in held {
                    self.iregs.get_mut(&base).unwrap().unproven = true;
                }
            }
            i += 1;
        }
    }

    /// The initiator reads connection `c`'s answers.
    fn read_answers(&mut self, c: usize) {
        let bytes = std::mem::take(&mut self.conns[c].answers);
        if self.conns[c].i_closed {
            // Given up: its fence reads and throws away what comes.
            return;
        }
        let mut b = &bytes[..];
        let mut done: Vec<Op> = Vec::new();
        while !b.is_empty() {
            let hdr: [u8; HEADER_LEN] = b[..HEADER_LEN].try_into().unwrap();
            b = &b[HEADER_LEN..];
            let resp = Response::decode(&hdr).expect("the target's answers decode");
            let pending = &mut self.conns[c].pending;
            match resp {
                Response::SameHostOk { id: 0, .. } => self.conns[c].agreed = true,
                Response::OkMany { count } => {
                    let n = count as usize * 8;
                    for id in decode_ids(&b[..n]) {
                        match pending.answer(id) {
                            Reply::Op(op) => done.push(op),
                            Reply::Skip => {}
                            Reply::Unknown => panic!("OKS names unknown request {id}"),
                        }
                    }
                    b = &b[n..];
                }
                Response::ErrV { id, count, .. } => {
                    let n = count as usize * 4;
                    match pending.answer(id) {
                        Reply::Op(op) => {
                            let bad = initiator_indices(&b[..n], op.segs);
                            assert!(bad.iter().any(|&x| x), "an ERRV names a segment");
                            done.push(op);
                        }
                        Reply::Skip => {}
                        Reply::Unknown => panic!("ERRV for unknown request {id}"),
                    }
                    b = &b[n..];
                }
                r => match on_header(pending, &r, false) {
                    Recv::Ack(op) | Recv::Refused(op, ..) => done.push(op),
                    Recv::Discard(0) => {}
                    other => panic!("an answer the initiator cannot take: {r:?} -> {other:?}"),
                },
            }
        }
        for op in done {
            self.release(op.base);
        }
        if self.conns[c].t_ended && !self.conns[c].i_closed {
            // The stream ended: every operation fails with the connection.
            self.give_up(c, Vec::new());
        }
    }

    /// One step of connection `c`'s target.
    fn target_step(&mut self, c: usize) {
        let now = self.now;
        let conn = &mut self.conns[c];
        if conn.t_ended {
            return;
        }
        match std::mem::replace(&mut conn.t, TState::Idle) {
            TState::Checked { copy, resume } if resume > now => {
                conn.t = TState::Checked { copy, resume };
            }
            TState::Checked { copy, .. } => self.copy(c, copy),
            TState::Idle => {
                if conn.i_closed {
                    // It reads the end of the stream (or its next check
                    // fails): its side ends, its copies all returned.
                    conn.t_ended = true;
                    return;
                }
                self.serve_one(c);
            }
        }
        let conn = &mut self.conns[c];
        assert!(
            conn.core.held_bytes() <= HELD_BOUND,
            "the core holds {} bytes",
            conn.core.held_bytes()
        );
    }

    /// The target serves the next request of `c` if all of it is there.
    fn serve_one(&mut self, c: usize) {
        let conn = &mut self.conns[c];
        if conn.wire.len() < HEADER_LEN {
            return;
        }
        let hdr: [u8; HEADER_LEN] = conn.wire[..HEADER_LEN].try_into().unwrap();
        let req = Request::decode(&hdr).expect("the initiator's requests decode");
        let need = ferry_tcp_proto::target::frame_bytes(&req).unwrap_or(0) as usize;
        if conn.wire.len() < HEADER_LEN + need {
            return;
        }
        let frame: Vec<u8> = conn.wire.drain(..HEADER_LEN + need).collect();
        let mut at = HEADER_LEN;
        let mut step = conn.core.on_request(req, &mut TTable(&mut self.tregs));
        loop {
            step = match step {
                Step::Done => break,
                Step::ReadBuf { len, .. } => {
                    conn.core.buf()[..len].copy_from_slice(&frame[at..at + len]);
                    at += len;
                    conn.core.on_buf(&mut TTable(&mut self.tregs), |_, _| {
                        unreachable!("no notifications here")
                    })
                }
                Step::Prove { id, .. } => {
                    assert_eq!(conn.core.same_host(), SameHost::Proving);
                    conn.core.agreed(id, Err(0), Err(0));
                    break;
                }
                Step::Copy(copy) => {
                    // The check: the initiator has not closed.
                    if conn.i_closed {
                        release_holds(&mut self.tregs, copy.holds);
                        conn.t_ended = true;
                        return;
                    }
                    let resume = if self.rng.chance(20) {
                        self.stats.stopped += 1;
                        self.now.after(TICK * (1 + self.rng.below(30) as u32))
                    } else {
                        self.now
                    };
                    conn.t = TState::Checked { copy, resume };
                    return;
                }
                Step::Close(reason) => panic!("closed: {reason}"),
                other => panic!("a step CWRITE / CREAD never asks for: {other:?}"),
            };
        }
        let a = conn.core.take_answers();
        conn.answers.extend(a);
    }

    /// The target's copies of a checked request, then its answer.
    fn copy(&mut self, c: usize, copy: Copy<THold>) {
        let reg = self.sent[&(c, copy.id)];
        let mut failed = Vec::new();
        for (i, (s, h)) in copy.segs.iter().zip(&copy.holds).enumerate() {
            let Ok(h) = h else { continue };
            assert_eq!((h.addr, h.len), (s.seg.addr, s.seg.len));
            if self.rng.chance(2) {
                // EFAULT: the kernel refused the initiator's range.
                failed.push(i as u32);
                continue;
            }
            self.stats.copies += 1;
            let (lo, to) = (ioff(s.local), toff(h.addr));
            let len = h.len as usize;
            if !copy.read {
                let bytes = self.imem[lo..lo + len].to_vec();
                self.tmem[to..to + len].copy_from_slice(&bytes);
                continue;
            }
            let bytes = self.tmem[to..to + len].to_vec();
            self.imem[lo..lo + len].copy_from_slice(&bytes);
            // The reference: only into the registration the operation
            // named, while it is registered.
            let live = self
                .iregs
                .range(..=s.local)
                .next_back()
                .is_some_and(|(&b, r)| r.id == reg && s.local + h.len <= b + r.len);
            if live {
                self.imodel[lo..lo + len].copy_from_slice(&bytes);
            }
        }
        let conn = &mut self.conns[c];
        let moved = conn.core.copied(&copy.segs, &failed);
        assert_eq!(moved.read, copy.read);
        release_holds(&mut self.tregs, copy.holds);
        let a = conn.core.take_answers();
        conn.answers.extend(a);
    }

    fn check(&self, seed: u64) {
        if self.imem == self.imodel {
            return;
        }
        let i = self
            .imem
            .iter()
            .zip(&self.imodel)
            .position(|(a, b)| a != b)
            .unwrap();
        let addr = IBASE + i as u64;
        let registered = self
            .iregs
            .range(..=addr)
            .next_back()
            .is_some_and(|(&b, r)| addr < b + r.len);
        panic!(
            "seed {seed}, step {}: byte {addr:#x} of the initiator changed by a target's copy \
             {}",
            self.steps,
            if registered {
                "into a registration the operation did not name (its own was unregistered)"
            } else {
                "after its region's unregister returned"
            }
        );
    }
}

fn initiator_indices(b: &[u8], segs: usize) -> Vec<bool> {
    ferry_tcp_proto::initiator::failed_segments(b, segs, "ERRV").expect("indices in range")
}

fn run_seed(seed: u64) -> u64 {
    let mut rng = Rng(seed);
    let imem: Vec<u8> = (0..ISLOTS * ISLOT).map(|_| rng.next() as u8).collect();
    let tmem: Vec<u8> = (0..TSLOTS * TSLOT).map(|_| rng.next() as u8).collect();
    let mut w = World {
        now: Time::ZERO,
        rng,
        imodel: imem.clone(),
        imem,
        iregs: BTreeMap::new(),
        next_reg: 0,
        tmem,
        tregs: BTreeMap::new(),
        next_gen: 0,
        conns: Vec::new(),
        fences: Vec::new(),
        sent: HashMap::new(),
        steps: 0,
        stats: Stats::default(),
    };
    for _ in 0..3 {
        w.app_step();
        w.target_churn();
    }
    w.open();
    for step in 0..STEPS + DRAIN {
        let draining = step >= STEPS;
        w.steps += 1;
        w.now = w.now.after(TICK);
        if !draining {
            match w.rng.below(10) {
                0 | 1 => w.app_step(),
                2 => w.target_churn(),
                3 if w.rng.chance(5) => {
                    // A target process killed.
                    let c = w.rng.below(w.conns.len() as u64) as usize;
                    let conn = &mut w.conns[c];
                    if let TState::Checked { copy, .. } =
                        std::mem::replace(&mut conn.t, TState::Idle)
                    {
                        release_holds(&mut w.tregs, copy.holds);
                    }
                    conn.t_ended = true;
                }
                _ => {
                    let live = w.conns.iter().rposition(|c| !c.i_closed);
                    match live {
                        Some(c) if w.conns[c].agreed => w.send(c),
                        Some(_) => {}
                        None => w.open(),
                    }
                }
            }
        } else {
            for c in 0..w.conns.len() {
                if !w.conns[c].i_closed {
                    w.give_up(c, Vec::new());
                }
            }
        }
        // The targets, in a random order of connections.
        let n = w.conns.len();
        let first = w.rng.below(n as u64) as usize;
        for k in 0..n {
            w.target_step((first + k) % n);
        }
        for c in 0..n {
            w.read_answers(c);
            if w.conns[c].i_closed {
                continue;
            }
            // A batch expired: its operations are abandoned, and on the
            // same-host path the connection is given up with them.
            let now = w.now;
            let (expired, _) = w.conns[c].pending.abandon(|op| op.deadline <= now);
            if !expired.is_empty() {
                w.stats.given_up += 1;
                w.give_up(c, expired);
            }
        }
        w.fences_step();
        w.check(seed);
        if draining && w.fences.is_empty() && w.conns.iter().all(|c| c.t_ended) {
            break;
        }
    }
    assert!(
        w.fences.is_empty() && w.conns.iter().all(|c| c.t_ended),
        "seed {seed}: the connections did not end"
    );
    for (b, r) in &w.iregs {
        assert_eq!(
            r.guards, 0,
            "seed {seed}: registration at {b:#x} still held"
        );
    }
    STATS.with(|s| {
        let mut s = s.borrow_mut();
        s.copies += w.stats.copies;
        s.stopped += w.stats.stopped;
        s.given_up += w.stats.given_up;
        s.fenced += w.stats.fenced;
        s.held_refusals += w.stats.held_refusals;
    });
    w.steps
}

thread_local! {
    static STATS: std::cell::RefCell<Stats> = std::cell::RefCell::new(Stats::default());
}

#[test]
fn no_target_copy_lands_in_memory_given_back() {
    let mutant = cfg!(ferry_mutant = "cread_unfenced").then_some("cread_unfenced");
    common::run_seeds(
        "same_host",
        "sim_same_host",
        DEFAULT_SEEDS,
        mutant,
        run_seed,
    );
    if mutant.is_none() {
        STATS.with(|s| {
            let s = s.borrow();
            eprintln!(
                "sim same_host: target copies {}, targets stopped between check and copy {}, \
                 connections given up {}, fences {}, unregisters refused while unproven {}",
                s.copies, s.stopped, s.given_up, s.fenced, s.held_refusals
            );
        });
    }
}

//! Deterministic simulation of both sides of Ferry's TCP connections
//! (issue 42): the initiator's real cores ([`batch::plan`],
//! [`batch::Requests`], [`batch::Flow`], [`initiator::Pending`],
//! [`initiator::on_header`] for every answer header, the segments'
//! [`initiator::Verdicts`] and [`initiator::retried`], [`initiator::Slicing`]
//! and [`initiator::window_until`])
//! against the target's real core ([`TargetConn`]), in a simulated world:
//! byte queues per connection (bounded like socket buffers) moved in
//! pieces of random size, a target that stops reading for a while, one
//! that reads and never answers, one late to answer (past the deadline:
//! late answers of abandoned operations), connections reset, the clock
//! advancing in small steps or jumping, hostile bytes in the answers, and
//! the target's regions unregistered and registered again (new
//! generations) while batches run. One seed is one schedule.
//!
//! What the test plays is the driver (ferry-tcp's `client/` and
//! `server/serve.rs`, reduced): it executes the cores' decisions; every
//! decision is the cores'. Simplifications, stated: a side acts on a frame
//! once all of it has arrived (`sim_target` cuts frames anywhere against
//! the target's receive cursor); at most a few batches, of one initiator
//! process, run at a time (now and then two at once); the initiator's
//! regions stay registered (its guards hold them during a transfer); a
//! remote range missing from the cached table fails before the wire
//! (ferry-tcp fetches the table first).
//!
//! Checked after every step:
//! - **(b)** every byte written (payload into the target's memory, answer
//!   into the initiator's) lands in a range registered at that moment on
//!   that side: `World::write_target` and `World::write_local` assert it,
//!   and memory is only written there;
//! - **(c)** every pass of a batch (data, table refresh, notification)
//!   completes, or fails typed, by its deadline plus [`slack`] — the
//!   deadline as the test computes it from the first frame's time, not the
//!   core's (after a clock jump, the slack counts from the jump: a process
//!   stopped past a deadline answers when it runs again);
//! - **(d)** a notification reaches the target only after every byte of
//!   every request of its batch landed, at most once, and is never lost
//!   (a batch that finished with every request and its notification
//!   successful was delivered exactly once); order and loss are checked
//!   for honest answer streams only (a forged OK, injected as hostile
//!   bytes, completes a write the target never served);
//! - **(e)** what each side keeps per connection is bounded: the target
//!   core's [`TargetConn::held_bytes`], the initiator's operations in
//!   flight and abandoned ids, the bytes of a frame being received.
//!
//! `cargo test -p ferry-tcp-proto --test sim_pair` runs [`DEFAULT_SEEDS`]
//! seeds and prints what it ran; `FERRY_SIM_SEEDS=N` runs N; a failure
//! prints its seed, its step and `FERRY_SIM_SEED=<s>`, which replays it.
//! Under a planted mutant (`RUSTFLAGS='--cfg ferry_mutant="…"'`:
//! `notify_before_data`, `deadline_per_slot`, `window_waits_forever`) the
//! test expects the simulator to find it within the default seeds, and
//! prints the first seed and step that did (`FERRY_SIM_MUTANT_ALL=1`: and
//! how many of the seeds find it).

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

mod common;

use common::Rng;
use ferry_tcp_proto::batch::{self, Flow, Frame, Req, Requests, Then};
use ferry_tcp_proto::frame::{
    decode_ids, decode_table, encode_segments, encode_table, table_lookup, Request, Response,
    Segment, Status, TableEntry, HEADER_LEN, SEGMENT_LEN,
};
use ferry_tcp_proto::initiator::{
    self, Answered, Expect, Pending, Recv, Slicing, Verdicts, MAX_ABANDONED,
};
use ferry_tcp_proto::target::{frame_bytes, Delivered, Part, Regions, Step, TargetConn};
use ferry_tcp_proto::time::Time;

const DEFAULT_SEEDS: u64 = 10_000;
/// The initiator's memory: `ISPACE` bytes at `IBASE`; the target's:
/// `TSPACE` bytes at `TBASE`.
const IBASE: u64 = 0x1000_0000;
const ISPACE: usize = 32 * 1024;
const TBASE: u64 = 0x7f00_0000_0000;
const TSPACE: usize = 32 * 1024;
/// The largest part of a large request (ferry-tcp's `chunk_size`).
const CHUNK: u64 = 2048;
/// Slices small enough that a batch has several, and a window of two
/// (ferry-tcp: 1 MiB, four): the window acts in most batches.
const SLICING: Slicing = Slicing {
    slice: 1024,
    window: 2,
};
const REQUEST_TIMEOUT: Duration = Duration::from_millis(50);
/// The pace of a frame: some progress every `STALL`, bytes at `MIN_RATE`.
const STALL: Duration = Duration::from_millis(1);
const MIN_RATE: u64 = 16 << 20;
/// A socket buffer, each way.
const CAP: usize = 8 * 1024;
/// Most bytes of one answer frame the initiator buffers.
const FRAME_BOUND: u64 = 64 * 1024;
/// What a pass may take beyond its deadline (see [`Pass::slack`]): each
/// frame still to write when the window lets go is written at the pace or
/// fails the connection, then the expiry runs in the step that passes the
/// deadline.
fn slack(frames: usize) -> Duration {
    (STALL + pace_of(CHUNK + 64 * SEGMENT_LEN as u64)) * (frames as u32 + 2)
        + Duration::from_millis(1)
}

/// The time allowed for moving `n` bytes beyond the stall.
fn pace_of(n: u64) -> Duration {
    Duration::from_secs_f64(n as f64 / MIN_RATE as f64)
}
/// Steps before a seed gives up (a stuck schedule fails invariant (c)
/// long before).
const MAX_STEPS: u64 = 40_000;
use common::HELD_BOUND;

/// What the seeds went through (printed with the figures): that the
/// schedules reach the paths the invariants are about.
static STATS: [AtomicU64; 9] = [const { AtomicU64::new(0) }; 9];
const STAT_NAMES: [&str; 9] = [
    "passes expired",
    "window waits",
    "stale retries",
    "notifications delivered",
    "late answers skipped",
    "connections failed",
    "protocol errors",
    "requests ok",
    "batches beside another",
];

fn count(i: usize) {
    STATS[i].fetch_add(1, Ordering::Relaxed);
}

/// How an operation or a request ends badly (ferry-tcp's `Error`, reduced).
#[derive(Clone, Debug, PartialEq, Eq)]
enum Failure {
    Timeout,
    PeerLost,
    Protocol(String),
    Status(Status),
    NotRegistered,
}

/// An operation in flight, as ferry-tcp's `PendingOp`: the pass it belongs
/// to and what its answer completes.
#[derive(Debug)]
struct Op {
    pass: u64,
    kind: OpKind,
}

#[derive(Debug)]
enum OpKind {
    /// Parts of a WRITE / WRITEV: (request index, length); whether a
    /// WRITEV.
    Write(Vec<(usize, u64)>, bool),
    /// Parts of a READ: (request index, local destination, length).
    Read(usize, u64, u64),
    ReadV(Vec<(usize, u64, u64)>),
    Notify,
    Table,
}

impl Answered for Op {
    fn expect(&self) -> Expect {
        match self.kind {
            OpKind::Write(_, false) | OpKind::Notify => Expect::Ack,
            OpKind::Write(_, true) => Expect::AckV,
            OpKind::Read(_, _, len) => Expect::Data(len),
            OpKind::ReadV(_) => Expect::DataV,
            OpKind::Table => Expect::Table,
        }
    }
}

impl Op {
    fn indices(&self) -> Vec<usize> {
        match &self.kind {
            OpKind::Write(p, _) => p.iter().map(|x| x.0).collect(),
            OpKind::Read(i, ..) => vec![*i],
            OpKind::ReadV(p) => p.iter().map(|x| x.0).collect(),
            OpKind::Notify | OpKind::Table => vec![0],
        }
    }
}

/// A frame queued for sending, with the slice it starts (if any).
struct Out {
    bytes: Vec<u8>,
    id: u64,
    starts_slice: bool,
}

/// One pass's frames on one connection (a send under the write lock).
struct SendTask {
    pass: u64,
    frames: VecDeque<Out>,
    /// Bytes of the front frame written.
    written: usize,
    /// Slices begun, and the ids sent by the end of each.
    slices: Vec<u64>,
    /// Ids of this task in order (for the window).
    ids: Vec<u64>,
    /// Since when the front frame may be written (its write's pace counts
    /// from there).
    ready_since: Option<Time>,
    /// The window wait in progress: until when.
    window_until: Option<Time>,
}

/// The initiator's side of a connection.
struct IConn {
    pending: Pending<Op, Failure>,
    tasks: VecDeque<SendTask>,
    next_id: u64,
    input: Vec<u8>,
    /// Bytes of an abandoned operation's answer still to throw away.
    discard: u64,
    /// When the frame at the front of `input` began to arrive.
    frame_since: Option<Time>,
    last_rx: Time,
}

/// The target's side of a connection.
struct TConn {
    core: TargetConn,
    input: Vec<u8>,
    stopped_until: Time,
    /// Reads and serves, never answers.
    mute: bool,
    /// Answers are held back until then (a target late to answer).
    late_until: Time,
    held: Vec<u8>,
}

impl Conn {
    /// The target sends answer bytes (or holds them back, or, mute, drops
    /// them).
    fn emit(&mut self, now: Time, bytes: &[u8]) {
        if self.t.mute {
            return;
        }
        if now < self.t.late_until {
            self.t.held.extend_from_slice(bytes);
            return;
        }
        self.t2c.extend(self.t.held.drain(..));
        self.t2c.extend(bytes);
    }
}

struct Conn {
    uid: u64,
    alive: bool,
    i: IConn,
    t: TConn,
    c2t: VecDeque<u8>,
    t2c: VecDeque<u8>,
}

/// One request of a batch.
#[derive(Clone, Copy, Debug)]
struct BReq {
    read: bool,
    local: u64,
    remote: u64,
    len: u64,
}

#[derive(Debug, Clone, PartialEq)]
enum Phase {
    Data,
    Refresh(Vec<usize>),
    Retry,
    Notify,
    Done,
}

/// A pass: one `Requests` of the core and where its outcomes go.
struct Pass {
    id: u64,
    batch: usize,
    reqs: Requests<Failure>,
    /// The batch's index of each request here (`None`: a control pass).
    map: Option<Vec<usize>>,
    kind: PassKind,
    bytes: u64,
    /// Send tasks not finished.
    sending: usize,
    /// When the test says the pass must end: first frame + allowance.
    due: Option<Time>,
    waiting: bool,
    over: bool,
    /// Frames of this pass and queued before it: what bounds the time
    /// past its deadline ([`slack`]).
    frames: usize,
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum PassKind {
    Data,
    Table,
    Notify,
}

struct Batch {
    reqs: Vec<BReq>,
    results: Vec<Option<Result<(), Failure>>>,
    flow: Flow,
    notify: bool,
    phase: Phase,
    /// The outcome of the notification pass(es).
    notified: Option<Result<(), Failure>>,
    /// Bytes of each request landed (target memory for writes, local
    /// memory for reads).
    landed: Vec<u64>,
    /// Notification passes still running.
    notify_passes: usize,
}

/// The batch a WRITE / WRITEV frame belongs to and its parts: (request
/// index in the batch, length).
type Owner = (usize, Vec<(usize, u64)>);

struct World {
    seed: u64,
    now: Time,
    /// When the clock last jumped (the process ran again).
    resumed: Time,
    rng: Rng,
    step: u64,
    imem: Vec<u8>,
    /// Local regions: base → len (registered for the whole run).
    iregions: Vec<(u64, u64)>,
    tmem: Vec<u8>,
    /// Target regions: base → (len, generation).
    tregions: BTreeMap<u64, (u64, u32)>,
    next_gen: u32,
    /// The initiator's cached copy of the target's table.
    table: Vec<TableEntry>,
    conns: Vec<Conn>,
    next_uid: u64,
    batches: Vec<Batch>,
    passes: Vec<Pass>,
    next_pass: u64,
    /// Which batch and request parts a frame carries: (conn uid, id) →
    /// (batch, [(request index, len)]).
    owners: HashMap<(u64, u64), Owner>,
    /// Notifications delivered, per batch.
    delivered: HashMap<usize, u32>,
    rr: usize,
    hostile: bool,
    /// Hostile bytes went into an answer stream: a forged OK may complete
    /// an operation the target never served.
    forged: bool,
    mute_chance: u64,
    /// How the segments of the last ERRV or DATAV end (kept, as the
    /// reader keeps it).
    verdicts: Verdicts,
}

/// The target's region table as the core sees it.
struct TRegions<'a>(&'a BTreeMap<u64, (u64, u32)>);

#[derive(Debug)]
struct Hold {
    addr: u64,
    len: u64,
}

fn lookup(regions: &BTreeMap<u64, (u64, u32)>, addr: u64, len: u64) -> Option<u32> {
    let end = addr.checked_add(len)?;
    match regions.range(..=addr).next_back() {
        Some((&b, &(l, g))) if len > 0 && end <= b + l => Some(g),
        _ => None,
    }
}

impl Regions for TRegions<'_> {
    type Hold = Hold;
    fn acquire(&mut self, addr: u64, len: u64, gen: u32) -> Result<Hold, Status> {
        match lookup(self.0, addr, len) {
            Some(g) if g == gen => Ok(Hold { addr, len }),
            Some(_) => Err(Status::StaleRegion),
            None => Err(Status::AddressNotRegistered),
        }
    }
}

fn allowance(bytes: u64) -> Duration {
    REQUEST_TIMEOUT + Duration::from_secs_f64(bytes as f64 / MIN_RATE as f64)
}

impl World {
    fn fail(&self, what: impl std::fmt::Display) -> ! {
        panic!(
            "sim pair: seed {} step {} (t = {} µs): {what}",
            self.seed,
            self.step,
            self.now.as_nanos() / 1000
        )
    }

    fn new_conn(&mut self) -> Conn {
        self.next_uid += 1;
        let mute = self.rng.chance(self.mute_chance);
        Conn {
            uid: self.next_uid,
            alive: true,
            i: IConn {
                pending: Pending::new(),
                tasks: VecDeque::new(),
                next_id: 1,
                input: Vec::new(),
                discard: 0,
                frame_since: None,
                last_rx: self.now,
            },
            t: TConn {
                core: TargetConn::new(),
                input: Vec::new(),
                stopped_until: Time::ZERO,
                mute,
                late_until: Time::ZERO,
                held: Vec::new(),
            },
            c2t: VecDeque::new(),
            t2c: VecDeque::new(),
        }
    }

    /// Invariant (b): a write lands only in registered memory.
    fn write_target(&mut self, addr: u64, bytes: &[u8]) {
        if lookup(&self.tregions, addr, bytes.len() as u64).is_none() && !bytes.is_empty() {
            self.fail(format!(
                "the target wrote [{addr:#x}, +{}) outside its registered memory",
                bytes.len()
            ));
        }
        let o = (addr - TBASE) as usize;
        self.tmem[o..o + bytes.len()].copy_from_slice(bytes);
    }

    fn write_local(&mut self, addr: u64, bytes: &[u8]) {
        let ok = self
            .iregions
            .iter()
            .any(|&(b, l)| addr >= b && addr + bytes.len() as u64 <= b + l);
        if !ok && !bytes.is_empty() {
            self.fail(format!(
                "the initiator wrote [{addr:#x}, +{}) outside its registered memory",
                bytes.len()
            ));
        }
        let o = (addr - IBASE) as usize;
        self.imem[o..o + bytes.len()].copy_from_slice(bytes);
    }

    // ---- the initiator's driver -------------------------------------

    /// The live connection of slot `c` (a new one if it died).
    fn conn(&mut self, c: usize) -> usize {
        if !self.conns[c].alive {
            let fresh = self.new_conn();
            self.conns[c] = fresh;
        }
        c
    }

    /// Completes one part of request `index` of pass `pass`.
    fn complete(&mut self, pass: u64, index: usize, r: Result<(), Failure>) {
        let Some(p) = self.passes.iter_mut().find(|p| p.id == pass) else {
            return;
        };
        let mut out = None;
        if let Err(Failure::Status(status)) = &r {
            if initiator::retried(*status) {
                p.reqs.mark_stale(index);
            }
        }
        p.reqs.complete(index, r, |i, r| out = Some((i, r)));
        if let Some((i, r)) = out {
            let (b, map) = (p.batch, p.map.clone());
            match map {
                Some(m) => self.batches[b].results[m[i]] = Some(r),
                None => {
                    if p.kind == PassKind::Notify {
                        self.batches[b].notified.get_or_insert(r);
                    }
                }
            }
        }
    }

    fn complete_op(&mut self, op: Op, r: Result<(), Failure>) {
        for i in op.indices() {
            self.complete(op.pass, i, r.clone());
        }
    }

    /// ferry-tcp's `fail_all`: the connection is dead, every operation in
    /// flight fails, the queued frames with it.
    fn fail_conn(&mut self, c: usize, err: Failure) {
        let conn = &mut self.conns[c];
        if !conn.alive {
            return;
        }
        conn.alive = false;
        count(5);
        if matches!(err, Failure::Protocol(_)) {
            count(6);
        }
        let ops = conn.i.pending.close(err.clone());
        let tasks: Vec<SendTask> = conn.i.tasks.drain(..).collect();
        conn.c2t.clear();
        conn.t2c.clear();
        for op in ops {
            self.complete_op(op, Err(err.clone()));
        }
        for t in tasks {
            if let Some(p) = self.passes.iter_mut().find(|p| p.id == t.pass) {
                p.sending -= 1;
            }
            // Frames not yet in flight were registered as pending when the
            // task was made (as ferry-tcp does): `close` failed them.
        }
    }

    /// Queues the frames of `pass` on slot `c`: ids, pending operations,
    /// encoding (ferry-tcp's `send_ops`).
    fn send_on(&mut self, c: usize, pass: u64, frames: Vec<(Request, Vec<u8>, OpKind, u64)>) {
        let c = self.conn(c);
        let uid = self.conns[c].uid;
        let batch = self.passes.iter().find(|p| p.id == pass).map(|p| p.batch);
        let mut task = SendTask {
            pass,
            frames: VecDeque::new(),
            written: 0,
            slices: Vec::new(),
            ids: Vec::new(),
            ready_since: None,
            window_until: None,
        };
        let mut since = 0u64;
        for (req, body, kind, payload) in frames {
            let id = self.conns[c].i.next_id;
            self.conns[c].i.next_id += 1;
            let req = with_id(req, id);
            let mut bytes = req.encode().to_vec();
            bytes.extend(body);
            if let (Some(b), OpKind::Write(parts, _)) = (batch, &kind) {
                // By the batch's index of each request.
                let map = self
                    .passes
                    .iter()
                    .find(|p| p.id == pass)
                    .and_then(|p| p.map.as_ref());
                let parts = parts
                    .iter()
                    .map(|&(i, l)| (map.map_or(i, |m| m[i]), l))
                    .collect();
                self.owners.insert((uid, id), (b, parts));
            }
            let starts_slice = SLICING.cut_before(&mut since, payload);
            if self.conns[c]
                .i
                .pending
                .insert(id, Op { pass, kind })
                .is_err()
            {
                self.fail("a send on a closed connection");
            }
            task.ids.push(id);
            task.frames.push_back(Out {
                bytes,
                id,
                starts_slice,
            });
        }
        let ahead: usize = self.conns[c].i.tasks.iter().map(|t| t.frames.len()).sum();
        let n = task.frames.len();
        if let Some(p) = self.passes.iter_mut().find(|p| p.id == pass) {
            p.sending += 1;
            p.frames += n + ahead;
        }
        self.conns[c].i.tasks.push_back(task);
    }

    /// Whether the front frame of connection `c` may be written now: at
    /// a slice boundary, the window (ferry-tcp's send loop) waits for the
    /// answers of slice `k - FAIR_WINDOW`, until [`initiator::window_until`].
    fn may_write(&mut self, c: usize) -> bool {
        let now = self.now;
        let conn = &mut self.conns[c];
        let Some(task) = conn.i.tasks.front_mut() else {
            return false;
        };
        let Some(front) = task.frames.front() else {
            return false;
        };
        if task.written > 0 || !front.starts_slice {
            return true;
        }
        let k = task.slices.len() + 1;
        if let Some(gate) = SLICING.gate(k) {
            let last = task.slices[gate];
            let waiting = task
                .ids
                .iter()
                .any(|&id| id <= last && conn.i.pending.contains(id));
            if waiting {
                let pass = self.passes.iter().find(|p| p.id == task.pass);
                let deadline = pass.and_then(|p| p.reqs.deadline());
                if task.window_until.is_none() {
                    count(1);
                }
                let until = *task
                    .window_until
                    .get_or_insert_with(|| initiator::window_until(deadline, now, STALL));
                if now < until {
                    return false;
                }
            }
        }
        true
    }

    /// Writes some bytes of the front send task of connection `c`, within
    /// the socket buffer.
    fn send_step(&mut self, c: usize) {
        let mut k = self.pick_len();
        // One writev of several frames, while the window lets them go.
        while k > 0 && self.conns[c].alive && self.may_write(c) {
            let conn = &mut self.conns[c];
            let task = conn.i.tasks.front_mut().unwrap();
            let front = task.frames.front().unwrap();
            if task.written == 0 && front.starts_slice {
                // This slice begins: the ids sent before it.
                task.window_until = None;
                let before = task
                    .ids
                    .iter()
                    .take_while(|&&id| id < front.id)
                    .last()
                    .copied()
                    .unwrap_or(0);
                task.slices.push(before);
            }
            let room = CAP.saturating_sub(conn.c2t.len());
            let n = k.min(room).min(front.bytes.len() - task.written);
            if n == 0 {
                return;
            }
            conn.c2t
                .extend(&front.bytes[task.written..task.written + n]);
            task.written += n;
            k -= n;
            if task.written < front.bytes.len() {
                return;
            }
            task.frames.pop_front();
            task.written = 0;
            task.ready_since = None;
            if task.frames.is_empty() {
                let pass = task.pass;
                conn.i.tasks.pop_front();
                if let Some(p) = self.passes.iter_mut().find(|p| p.id == pass) {
                    p.sending -= 1;
                }
            }
        }
    }

    /// What fires by time (ferry-tcp's pace deadlines): a frame not
    /// written within the pace since it could be, a frame not received
    /// within its pace, fail the connection.
    fn timers(&mut self) {
        let now = self.now;
        for c in 0..self.conns.len() {
            if !self.conns[c].alive {
                continue;
            }
            if self.may_write(c) {
                let task = self.conns[c].i.tasks.front_mut().unwrap();
                let len = task.frames.front().map_or(0, |f| f.bytes.len()) as u64;
                let since = *task.ready_since.get_or_insert(now);
                if now > since.after(STALL + pace_of(len)) {
                    self.fail_conn(c, Failure::Timeout);
                    continue;
                }
            }
            let conn = &self.conns[c];
            if let (Some(since), false) = (conn.i.frame_since, conn.i.input.is_empty()) {
                if now > since.after(STALL + pace_of(FRAME_BOUND)) {
                    self.fail_conn(c, Failure::Timeout);
                }
            }
        }
    }

    fn pick_len(&mut self) -> usize {
        match self.rng.below(4) {
            0 => 1 + self.rng.below(16) as usize,
            1 => 1 + self.rng.below(600) as usize,
            _ => 1 + self.rng.below(6000) as usize,
        }
    }

    /// Reads some answer bytes and handles every complete answer
    /// (ferry-tcp's reader task).
    fn receive_step(&mut self, c: usize) {
        let k = self.pick_len();
        let now = self.now;
        let conn = &mut self.conns[c];
        if !conn.alive {
            return;
        }
        let n = k.min(conn.t2c.len());
        if conn.i.discard > 0 {
            let d = (n as u64).min(conn.i.discard);
            conn.t2c.drain(..d as usize);
            conn.i.discard -= d;
            return;
        }
        let n = n.min((FRAME_BOUND as usize + HEADER_LEN).saturating_sub(conn.i.input.len()));
        conn.i.input.extend(conn.t2c.drain(..n));
        if conn.i.input.is_empty() {
            return;
        }
        conn.i.frame_since.get_or_insert(now);
        loop {
            match self.take_answer(c) {
                Ok(true) => continue,
                Ok(false) => break,
                Err(e) => {
                    self.fail_conn(c, e);
                    break;
                }
            }
        }
    }

    /// Handles the answer at the front of the input if all of it is there
    /// (true), with the core's decisions.
    fn take_answer(&mut self, c: usize) -> Result<bool, Failure> {
        let conn = &mut self.conns[c];
        if !conn.alive || conn.i.discard > 0 || conn.i.input.len() < HEADER_LEN {
            return Ok(false);
        }
        let hdr: [u8; HEADER_LEN] = conn.i.input[..HEADER_LEN].try_into().unwrap();
        let resp = Response::decode(&hdr).map_err(|e| Failure::Protocol(e.0))?;
        let need = initiator::frame_bytes(&resp);
        if need > FRAME_BOUND {
            // Only the late answer of an abandoned read may be this long
            // (thrown away as it comes); else the checks below fail it.
            match resp {
                Response::Data { id, .. } | Response::DataV { id, .. }
                    if conn.i.pending.forget(id) =>
                {
                    conn.i.input.drain(..HEADER_LEN);
                    let have = conn.i.input.len() as u64;
                    conn.i.input.clear();
                    conn.i.discard = need - have;
                    conn.i.frame_since = None;
                    return Ok(true);
                }
                _ => return Err(Failure::Protocol(format!("a frame of {need} bytes"))),
            }
        }
        if (conn.i.input.len() as u64) < HEADER_LEN as u64 + need {
            return Ok(false);
        }
        let body: Vec<u8> = conn.i.input[HEADER_LEN..HEADER_LEN + need as usize].to_vec();
        conn.i.input.drain(..HEADER_LEN + need as usize);
        conn.i.frame_since = (!conn.i.input.is_empty()).then_some(self.now);
        conn.i.last_rx = self.now;
        self.answer(c, resp, &body)?;
        Ok(true)
    }

    /// One answer, as ferry-tcp's reader handles it: the core decides
    /// every header ([`initiator::on_header`]; no staging area here), the
    /// test executes the decision with the frame's body.
    fn answer(&mut self, c: usize, resp: Response, body: &[u8]) -> Result<(), Failure> {
        let recv = initiator::on_header(&mut self.conns[c].i.pending, &resp, false);
        self.execute(c, recv, body)
    }

    /// An OK or ERR (ferry-tcp's `ConnShared::ack`).
    fn ack(&mut self, c: usize, id: u64, r: Result<(), Status>) -> Result<(), Failure> {
        let resp = match r {
            Ok(()) => Response::Ok { id },
            Err(status) => Response::Err {
                id,
                status,
                addr: 0,
                len: 0,
            },
        };
        let recv = initiator::on_header(&mut self.conns[c].i.pending, &resp, false);
        self.execute(c, recv, &[])
    }

    /// Executes what the core decided for an answer whose frame (after
    /// its header) is `body` (ferry-tcp's `reader::execute`).
    fn execute(&mut self, c: usize, recv: Recv<Op>, body: &[u8]) -> Result<(), Failure> {
        match recv {
            Recv::Ack(op) => self.complete_op(op, Ok(())),
            Recv::Refused(op, status, ..) => self.complete_op(op, Err(Failure::Status(status))),
            Recv::Into(op, len) => {
                let OpKind::Read(index, dst, _) = op.kind else {
                    self.fail("DATA into an operation that is not a READ");
                };
                self.write_local(dst, body);
                self.land(op.pass, index, len);
                self.complete_op(op, Ok(()));
            }
            Recv::Indices {
                op,
                failed,
                len,
                status,
            } => {
                let OpKind::ReadV(parts) = &op.kind else {
                    self.fail("DATAV for an operation that is not a READV");
                };
                let (idx, data) = body.split_at(failed as usize * 4);
                let lens = parts.iter().map(|p| p.2);
                if let Err(r) = self.verdicts.datav(idx, lens, status, len) {
                    self.complete_op(op, Err(Failure::Protocol(r.clone())));
                    return Err(Failure::Protocol(r));
                }
                let mut at = 0usize;
                let parts = parts.clone();
                for (i, (index, dst, n)) in parts.into_iter().enumerate() {
                    if self.verdicts.lands(i) {
                        self.write_local(dst, &data[at..at + n as usize]);
                        at += n as usize;
                        self.land(op.pass, index, n);
                    }
                    let r = self.verdicts.of(i).map_err(Failure::Status);
                    self.complete(op.pass, index, r);
                }
            }
            Recv::Refusals { op, status, count } => {
                let OpKind::Write(parts, true) = &op.kind else {
                    self.fail("ERRV for an operation that is not a WRITEV");
                };
                let idx = &body[..count as usize * 4];
                if let Err(r) = self.verdicts.errv(idx, parts.len(), status) {
                    self.complete_op(op, Err(Failure::Protocol(r.clone())));
                    return Err(Failure::Protocol(r));
                }
                let parts = parts.clone();
                for (i, (index, _)) in parts.into_iter().enumerate() {
                    let r = self.verdicts.of(i).map_err(Failure::Status);
                    self.complete(op.pass, index, r);
                }
            }
            Recv::Acks(_) => {
                for id in decode_ids(body) {
                    self.ack(c, id, Ok(()))?;
                }
            }
            Recv::Table(op, _) => {
                if !matches!(op.kind, OpKind::Table) {
                    self.fail("TABLE for an operation that is not a TABLE");
                }
                match decode_table(body) {
                    Ok(table) => {
                        self.table = table;
                        self.complete_op(op, Ok(()));
                    }
                    Err(e) => {
                        let e = Failure::Protocol(e.0);
                        self.complete_op(op, Err(e.clone()));
                        return Err(e);
                    }
                }
            }
            Recv::Lane => self.fail("a staging area's lane on a connection without one"),
            // The frame is thrown away with the body.
            Recv::Discard(_) => count(4),
            Recv::Fail(op, reason) => {
                if let Some(op) = op {
                    self.complete_op(op, Err(Failure::Protocol(reason.clone())));
                }
                return Err(Failure::Protocol(reason));
            }
        }
        Ok(())
    }

    /// Bytes of request `index` of the batch of pass `pass` landed.
    fn land(&mut self, pass: u64, index: usize, n: u64) {
        if let Some(p) = self.passes.iter().find(|p| p.id == pass) {
            if let Some(m) = &p.map {
                let (b, i) = (p.batch, m[index]);
                self.batches[b].landed[i] += n;
            }
        }
    }

    // ---- the target's driver ----------------------------------------

    /// Reads some request bytes and serves the complete requests.
    fn serve_step(&mut self, c: usize) {
        let k = self.pick_len();
        let now = self.now;
        let conn = &mut self.conns[c];
        if !conn.alive || now < conn.t.stopped_until {
            return;
        }
        let n = k.min(conn.c2t.len());
        conn.t.input.extend(conn.c2t.drain(..n));
        loop {
            match self.serve_one(c) {
                Some(true) => continue,
                Some(false) => break,
                None => {
                    // Closed (Malformed): the connection ends (the answers
                    // before it are lost with it here).
                    self.fail_conn(c, Failure::PeerLost);
                    return;
                }
            }
        }
        // Nothing complete buffered: the answers go out before the wait.
        let conn = &mut self.conns[c];
        let a = conn.t.core.take_answers();
        conn.emit(now, &a);
    }

    /// Serves the request at the front of the input if all of it is there:
    /// Some(true) served, Some(false) incomplete, None closed.
    fn serve_one(&mut self, c: usize) -> Option<bool> {
        let uid = self.conns[c].uid;
        let input = &self.conns[c].t.input;
        if input.len() < HEADER_LEN {
            return Some(false);
        }
        let hdr: [u8; HEADER_LEN] = input[..HEADER_LEN].try_into().unwrap();
        let req = match Request::decode(&hdr) {
            Ok(r) => r,
            Err(_) => {
                let _ = self.conns[c].t.core.malformed::<Hold>(0, "bad header");
                return None;
            }
        };
        let need = frame_bytes(&req).unwrap_or(0);
        if (input.len() as u64) < HEADER_LEN as u64 + need {
            return Some(false);
        }
        let frame: Vec<u8> = self.conns[c]
            .t
            .input
            .drain(..HEADER_LEN + need as usize)
            .collect();
        let mut at = HEADER_LEN;
        let regions = std::mem::take(&mut self.tregions);
        let mut step = self.conns[c]
            .t
            .core
            .on_request(req, &mut TRegions(&regions));
        let mut delivered_now = None;
        let result = loop {
            step = match step {
                Step::Done => break Some(true),
                Step::ReadBuf { len, .. } => {
                    let core = &mut self.conns[c].t.core;
                    core.buf()[..len].copy_from_slice(&frame[at..at + len]);
                    at += len;
                    core.on_buf(&mut TRegions(&regions), |name, _| {
                        delivered_now = Some(name.to_owned());
                        Delivered::Queued
                    })
                }
                Step::Receive { parts, .. } => {
                    let owner = self.owners.get(&(uid, req_id(&req))).cloned();
                    self.tregions = regions;
                    for (pos, part) in parts.iter().enumerate() {
                        match part {
                            Part::Into(h, l) => {
                                let bytes = frame[at..at + *l as usize].to_vec();
                                self.write_target(h.addr, &bytes);
                                at += *l as usize;
                                if let Some((b, ps)) = &owner {
                                    if let Some(&(i, _)) = ps.get(pos) {
                                        let _ = h.len;
                                        self.batches[*b].landed[i] += *l;
                                    }
                                }
                            }
                            Part::Skip(l) => at += *l as usize,
                        }
                    }
                    self.conns[c].t.core.received();
                    return Some(true);
                }
                Step::Send {
                    mut meta, holds, ..
                } => {
                    for (h, len) in &holds {
                        let o = (h.addr - TBASE) as usize;
                        meta.extend_from_slice(&self.tmem[o..o + *len as usize]);
                    }
                    let now = self.now;
                    self.conns[c].emit(now, &meta);
                    break Some(true);
                }
                Step::Table { meta, id } => {
                    let t: Vec<TableEntry> = regions
                        .iter()
                        .map(|(&addr, &(len, gen))| TableEntry { addr, len, gen })
                        .collect();
                    let mut bytes = meta;
                    bytes.extend(
                        Response::Table {
                            id,
                            count: t.len() as u32,
                        }
                        .encode(),
                    );
                    bytes.extend(encode_table(&t));
                    let now = self.now;
                    self.conns[c].emit(now, &bytes);
                    break Some(true);
                }
                Step::Close(_) => break None,
                // The path is off on these connections (the core refuses
                // an offer itself, a CWRITE / CREAD is malformed).
                Step::Prove { .. } | Step::Copy(_) | Step::Staged(_) => {
                    unreachable!("same-host steps with the path off")
                }
            };
        };
        self.tregions = regions;
        if let Some(name) = delivered_now {
            self.deliver(&name);
        }
        result
    }

    /// Invariant (d) at the target's delivery of a notification.
    fn deliver(&mut self, name: &str) {
        let Some(b) = name.strip_prefix('b').and_then(|s| s.parse::<usize>().ok()) else {
            return;
        };
        count(3);
        let n = self.delivered.entry(b).or_insert(0);
        *n += 1;
        if *n > 1 {
            self.fail(format!("the notification of batch {b} was delivered twice"));
        }
        let batch = &self.batches[b];
        for (i, r) in batch.reqs.iter().enumerate() {
            // A forged OK completes a write the target never served.
            if batch.landed[i] < r.len && !self.forged {
                self.fail(format!(
                    "the notification of batch {b} arrived before its data: request {i} \
                     has {} of {} bytes",
                    batch.landed[i], r.len
                ));
            }
        }
    }

    // ---- batches ------------------------------------------------------

    fn new_pass(&mut self, batch: usize, n: usize, hold_stale: bool, kind: PassKind) -> u64 {
        self.next_pass += 1;
        let id = self.next_pass;
        self.passes.push(Pass {
            id,
            batch,
            reqs: Requests::new(n, hold_stale),
            map: None,
            kind,
            bytes: 0,
            sending: 0,
            due: None,
            waiting: false,
            over: false,
            frames: 0,
        });
        id
    }

    fn pass_mut(&mut self, id: u64) -> &mut Pass {
        self.passes.iter_mut().find(|p| p.id == id).unwrap()
    }

    /// Starts a pass's clock before its first frame (ferry-tcp's
    /// `start_clock`), and the test's own deadline for (c).
    fn start_clock(&mut self, id: u64, bytes: u64) {
        let now = self.now;
        let p = self.pass_mut(id);
        p.bytes = bytes;
        p.reqs.start_clock(now, allowance(bytes));
        p.due.get_or_insert(now.after(allowance(bytes)));
    }

    /// A data pass over `indices` of batch `b` (ferry-tcp's
    /// `transfer_all`, after validation).
    fn data_pass(&mut self, b: usize, indices: Vec<usize>, hold_stale: bool) {
        let id = self.new_pass(b, indices.len(), hold_stale, PassKind::Data);
        let mut reqs = Vec::new();
        for (k, &i) in indices.iter().enumerate() {
            let r = self.batches[b].reqs[i];
            let gen = if r.len == 0 {
                None
            } else {
                table_lookup(&self.table, r.remote, r.len)
            };
            if r.len > 0 && gen.is_none() {
                self.pass_mut(id)
                    .reqs
                    .fail_unsent(k, Failure::NotRegistered);
            }
            reqs.push(gen.map(|gen| {
                let req = Req {
                    read: r.read,
                    len: r.len,
                    remote: r.remote,
                    gen,
                };
                (req, r.local)
            }));
        }
        let conns = self.conns.len();
        let mut rr = self.rr;
        let mut per_conn: Vec<Vec<Frame<u64>>> = (0..conns).map(|_| Vec::new()).collect();
        let plan = batch::plan(
            reqs,
            CHUNK,
            conns,
            || {
                rr += 1;
                rr
            },
            |c, f| per_conn[c].push(f),
        );
        self.rr = rr;
        self.pass_mut(id).map = Some(indices);
        let mut out = Vec::new();
        {
            let p = self.pass_mut(id);
            p.reqs.arm(&plan.counts, |i, r| out.push((i, r)));
        }
        for (i, r) in out {
            let m = self.pass_mut(id).map.clone().unwrap();
            self.batches[b].results[m[i]] = Some(r);
        }
        self.start_clock(id, plan.bytes);
        for (c, frames) in per_conn.into_iter().enumerate() {
            if frames.is_empty() {
                continue;
            }
            let encoded = frames
                .into_iter()
                .map(|f| self.encode(f))
                .collect::<Vec<_>>();
            self.send_on(c, id, encoded);
        }
        self.pass_mut(id).waiting = false;
    }

    fn encode(&self, f: Frame<u64>) -> (Request, Vec<u8>, OpKind, u64) {
        let payload = f.payload_len();
        let segs = |ps: &[batch::Part<u64>]| {
            encode_segments(
                &ps.iter()
                    .map(|p| Segment {
                        addr: p.remote,
                        len: p.len,
                        gen: p.gen,
                    })
                    .collect::<Vec<_>>(),
            )
        };
        let local = |p: &batch::Part<u64>| {
            let o = (p.hold + p.off - IBASE) as usize;
            &self.imem[o..o + p.len as usize]
        };
        match f {
            Frame::Write(p) => (
                Request::Write {
                    id: 0,
                    addr: p.remote,
                    len: p.len,
                    gen: p.gen,
                },
                local(&p).to_vec(),
                OpKind::Write(vec![(p.index, p.len)], false),
                payload,
            ),
            Frame::Read(p) => (
                Request::Read {
                    id: 0,
                    addr: p.remote,
                    len: p.len,
                    gen: p.gen,
                },
                Vec::new(),
                OpKind::Read(p.index, p.hold + p.off, p.len),
                payload,
            ),
            Frame::WriteV(ps) => {
                let mut body = segs(&ps);
                for p in &ps {
                    body.extend_from_slice(local(p));
                }
                (
                    Request::WriteV {
                        id: 0,
                        count: ps.len() as u32,
                        total: payload,
                    },
                    body,
                    OpKind::Write(ps.iter().map(|p| (p.index, p.len)).collect(), true),
                    payload,
                )
            }
            Frame::ReadV(ps) => (
                Request::ReadV {
                    id: 0,
                    count: ps.len() as u32,
                    total: payload,
                },
                segs(&ps),
                OpKind::ReadV(
                    ps.iter()
                        .map(|p| (p.index, p.hold + p.off, p.len))
                        .collect(),
                ),
                payload,
            ),
        }
    }

    fn control_pass(&mut self, b: usize, kind: PassKind) {
        let id = self.new_pass(b, 1, false, kind);
        self.pass_mut(id).reqs.arm(&[1], |_, _| {});
        let (req, body) = match kind {
            PassKind::Table => (Request::Table { id: 0 }, Vec::new()),
            _ => {
                let name = format!("b{b}");
                let msg = b"done".to_vec();
                let mut body = name.clone().into_bytes();
                body.extend(&msg);
                (
                    Request::Notify {
                        id: 0,
                        name_len: name.len() as u64,
                        msg_len: msg.len() as u64,
                    },
                    body,
                )
            }
        };
        let size = body.len() as u64;
        self.start_clock(id, size);
        let op = if kind == PassKind::Table {
            OpKind::Table
        } else {
            OpKind::Notify
        };
        self.send_on(0, id, vec![(req, body, op, 0)]);
    }

    /// Passes: the wait (ferry-tcp's `await_state`) and the expiry.
    fn passes_step(&mut self) {
        let now = self.now;
        let ids: Vec<u64> = self
            .passes
            .iter()
            .filter(|p| !p.over)
            .map(|p| p.id)
            .collect();
        for id in ids {
            let p = self.pass_mut(id);
            if p.sending > 0 {
                continue;
            }
            if !p.waiting {
                // await_state starts the clock again (the first call won).
                p.waiting = true;
                let bytes = p.bytes;
                p.reqs.start_clock(now, allowance(bytes));
            }
            if !p.reqs.is_done() && p.reqs.deadline().is_some_and(|d| now >= d) {
                count(0);
                // Expired: abandon its operations on every connection.
                for c in 0..self.conns.len() {
                    if !self.conns[c].alive {
                        continue;
                    }
                    let (ops, too_many) = self.conns[c].i.pending.abandon(|op| op.pass == id);
                    for op in ops {
                        self.complete_op(op, Err(Failure::Timeout));
                    }
                    let quiet = self.conns[c].i.last_rx.after(REQUEST_TIMEOUT) <= now;
                    if too_many || quiet {
                        self.fail_conn(c, Failure::Timeout);
                    }
                }
            }
            let p = self.pass_mut(id);
            if p.reqs.is_done() {
                p.over = true;
                let (b, kind) = (p.batch, p.kind);
                let stale = p.reqs.stale();
                let table_ok = p.reqs.results().pop();
                self.after_pass(b, kind, stale, table_ok);
            }
        }
    }

    /// The batch's next phase (ferry-tcp's `run_batch`).
    fn after_pass(
        &mut self,
        b: usize,
        kind: PassKind,
        stale: Vec<usize>,
        last: Option<Result<(), Failure>>,
    ) {
        let batch = &mut self.batches[b];
        let all_ok = |batch: &Batch| batch.results.iter().all(|r| matches!(r, Some(Ok(()))));
        match (kind, batch.phase.clone()) {
            (PassKind::Notify, _) => {
                batch.notify_passes -= 1;
                if batch.notify_passes == 0 && batch.phase == Phase::Notify {
                    batch.phase = Phase::Done;
                }
            }
            (PassKind::Data, Phase::Data) => {
                // The stale ones of the first pass: by the batch's index.
                let pass_stale = stale;
                let ok = all_ok(batch);
                match batch.flow.after_pass(pass_stale, batch.notify && ok) {
                    Then::Retry(s) => {
                        count(2);
                        batch.phase = Phase::Refresh(s);
                        self.control_pass(b, PassKind::Table);
                    }
                    then => self.finish_or_notify(b, then),
                }
            }
            (PassKind::Table, Phase::Refresh(s)) => match last {
                Some(Ok(())) => {
                    batch.phase = Phase::Retry;
                    self.data_pass(b, s, false);
                }
                other => {
                    let e = match other {
                        Some(Err(e)) => e,
                        _ => Failure::PeerLost,
                    };
                    for i in s {
                        batch.results[i] = Some(Err(e.clone()));
                    }
                    let ok = all_ok(batch);
                    let then = batch.flow.after_pass(Vec::new(), batch.notify && ok);
                    self.finish_or_notify(b, then);
                }
            },
            (PassKind::Data, Phase::Retry) => {
                let ok = all_ok(batch);
                let then = batch.flow.after_pass(Vec::new(), batch.notify && ok);
                self.finish_or_notify(b, then);
            }
            (k, ph) => self.fail(format!("pass {k:?} in phase {ph:?}")),
        }
    }

    fn finish_or_notify(&mut self, b: usize, then: Then) {
        match then {
            Then::Notify => {
                self.batches[b].phase = Phase::Notify;
                self.batches[b].notify_passes += 1;
                self.control_pass(b, PassKind::Notify);
            }
            _ => {
                let batch = &mut self.batches[b];
                batch.phase = if batch.notify_passes > 0 {
                    Phase::Notify
                } else {
                    Phase::Done
                };
            }
        }
    }

    /// Submits batch `b` (ferry-tcp's `run_batch` start).
    fn submit(&mut self, b: usize) {
        let batch = &mut self.batches[b];
        if batch.flow.notify_at_submit() {
            batch.notify_passes += 1;
            self.control_pass(b, PassKind::Notify);
        }
        let n = self.batches[b].reqs.len();
        self.data_pass(b, (0..n).collect(), true);
    }

    // ---- the world ----------------------------------------------------

    /// The application on the target's side registers and unregisters.
    fn churn(&mut self) {
        let bases: Vec<u64> = self.tregions.keys().copied().collect();
        if !bases.is_empty() && self.rng.chance(60) {
            let b = bases[self.rng.below(bases.len() as u64) as usize];
            self.tregions.remove(&b);
            if self.rng.chance(60) {
                // Registered again at once: a new generation.
                let len = 1024 + self.rng.below(TSPACE as u64 / 8 - 1024);
                self.next_gen = self.next_gen.wrapping_add(1);
                self.tregions.insert(b, (len, self.next_gen));
            }
        } else {
            register(&mut self.rng, &mut self.tregions, &mut self.next_gen);
        }
    }

    /// Whether nothing but time can move the world.
    fn idle(&mut self) -> bool {
        let now = self.now;
        for c in 0..self.conns.len() {
            let conn = &self.conns[c];
            if !conn.alive {
                continue;
            }
            let t2c = !conn.t2c.is_empty() && conn.i.discard == 0;
            let running = now >= conn.t.stopped_until;
            let c2t = running
                && (!conn.c2t.is_empty() || (!conn.t.held.is_empty() && now >= conn.t.late_until));
            if t2c || c2t || (self.may_write(c) && self.conns[c].c2t.len() < CAP) {
                return false;
            }
        }
        true
    }

    /// The next time something is due (a deadline, a window, a stopped
    /// target resuming), for a jump when nothing else moves.
    fn next_timer(&self) -> Option<Time> {
        let mut t: Option<Time> = None;
        let mut see = |x: Time| {
            if x > self.now {
                t = Some(t.map_or(x, |t| t.min(x)));
            }
        };
        for p in self.passes.iter().filter(|p| !p.over) {
            if let Some(d) = p.reqs.deadline() {
                see(d);
            }
        }
        for c in self.conns.iter().filter(|c| c.alive) {
            see(c.t.stopped_until);
            if !c.t.held.is_empty() {
                see(c.t.late_until);
            }
            for task in &c.i.tasks {
                if let Some(w) = task.window_until.filter(|&w| w != Time::NEVER) {
                    see(w);
                }
                if let Some(s) = task.ready_since {
                    let len = task.frames.front().map_or(0, |f| f.bytes.len()) as u64;
                    see(s.after(STALL + pace_of(len)).after(Duration::from_nanos(1)));
                }
            }
            if let Some(s) = c.i.frame_since {
                see(s
                    .after(STALL + pace_of(FRAME_BOUND))
                    .after(Duration::from_nanos(1)));
            }
        }
        t
    }

    fn step(&mut self) {
        self.step += 1;
        let c = self.rng.below(self.conns.len() as u64) as usize;
        match self.rng.below(100) {
            0..=24 => self.send_step(c),
            25..=49 => self.serve_step(c),
            50..=74 => self.receive_step(c),
            75..=88 => {
                let dt = self.rng.below(100_000);
                self.now = self.now.after(Duration::from_nanos(dt));
            }
            89..=92 if self.idle() => {
                // Nothing moves: on to the next timer.
                let to = self
                    .next_timer()
                    .unwrap_or_else(|| self.now.after(Duration::from_millis(1)));
                self.now = to.max(self.now);
            }
            93 if self.rng.chance(20) => {
                // The clock jumps (the process was descheduled).
                let dt = self.rng.below(2 * REQUEST_TIMEOUT.as_micros() as u64);
                self.now = self.now.after(Duration::from_micros(dt));
                self.resumed = self.now;
            }
            94 | 98 => self.churn(),
            95 if self.rng.chance(10) => self.fail_conn(c, Failure::PeerLost),
            96 if self.rng.chance(50) => {
                let d = Duration::from_micros(self.rng.below(1_500));
                self.conns[c].t.stopped_until = self.now.after(d);
            }
            97 if self.hostile => {
                let n = 1 + self.rng.below(40) as usize;
                let at = self.rng.below(self.conns[c].t2c.len() as u64 + 1) as usize;
                let junk: Vec<u8> = if self.rng.chance(50) {
                    let id = self.rng.below(8);
                    let r = match self.rng.below(3) {
                        0 => Response::Ok { id },
                        1 => Response::Data {
                            id,
                            len: self.rng.below(1 << 20),
                        },
                        _ => Response::ErrV {
                            id,
                            status: Status::StaleRegion,
                            count: 1,
                        },
                    };
                    r.encode().to_vec()
                } else {
                    (0..n).map(|_| self.rng.next() as u8).collect()
                };
                self.forged = true;
                let t2c = &mut self.conns[c].t2c;
                for (k, byte) in junk.into_iter().enumerate() {
                    t2c.insert(at + k, byte);
                }
            }
            99 => {
                // The target answers late: past the deadline at times.
                let d = Duration::from_micros(self.rng.below(80_000));
                self.conns[c].t.late_until = self.now.after(d);
            }
            _ => {}
        }
        // Checked as time reached (a timer fired late is a miss even if
        // the pass ends in this step), then after what fired.
        self.check();
        self.timers();
        self.passes_step();
        self.check();
    }

    /// Invariants (c) and (e) after every step.
    fn check(&self) {
        for p in self.passes.iter().filter(|p| !p.over) {
            if let Some(due) = p.due {
                // A stopped process answers late by the time it was
                // stopped: the slack counts from when it runs again.
                if self.now > due.max(self.resumed).after(slack(p.frames)) {
                    self.fail(format!(
                        "pass {} ({:?}, batch {}) is not over {} µs after its deadline",
                        p.id,
                        p.kind,
                        p.batch,
                        due.until(self.now).as_micros()
                    ));
                }
            }
        }
        for c in self.conns.iter().filter(|c| c.alive) {
            if c.t.core.held_bytes() > HELD_BOUND {
                self.fail(format!(
                    "the target core holds {} bytes",
                    c.t.core.held_bytes()
                ));
            }
            if c.i.pending.abandoned() > MAX_ABANDONED + 1 || c.i.pending.len() > 4096 {
                self.fail("the initiator keeps too many operations");
            }
            if c.i.input.len() > FRAME_BOUND as usize + HEADER_LEN {
                self.fail("the initiator buffers more than one frame");
            }
        }
    }
}

fn req_id(r: &Request) -> u64 {
    match *r {
        Request::Write { id, .. }
        | Request::Read { id, .. }
        | Request::WriteV { id, .. }
        | Request::ReadV { id, .. }
        | Request::Notify { id, .. }
        | Request::Table { id }
        | Request::SameHost { id, .. }
        | Request::Cma { id, .. } => id,
    }
}

fn with_id(r: Request, id: u64) -> Request {
    match r {
        Request::Write { addr, len, gen, .. } => Request::Write { id, addr, len, gen },
        Request::Read { addr, len, gen, .. } => Request::Read { id, addr, len, gen },
        Request::WriteV { count, total, .. } => Request::WriteV { id, count, total },
        Request::ReadV { count, total, .. } => Request::ReadV { id, count, total },
        Request::Notify {
            name_len, msg_len, ..
        } => Request::Notify {
            id,
            name_len,
            msg_len,
        },
        Request::Table { .. } => Request::Table { id },
        other => other,
    }
}

/// Registers a target region at one of 8 places, with a new generation.
fn register(rng: &mut Rng, regions: &mut BTreeMap<u64, (u64, u32)>, next_gen: &mut u32) {
    let slot = rng.below(8);
    let base = TBASE + slot * (TSPACE as u64 / 8);
    if regions.contains_key(&base) {
        return;
    }
    let len = 1024 + rng.below(TSPACE as u64 / 8 - 1024);
    *next_gen = next_gen.wrapping_add(1);
    regions.insert(base, (len, *next_gen));
}

/// A request: local range inside a local region; remote mostly inside a
/// region of the initiator's table, sometimes outside.
fn pick_request(rng: &mut Rng, w: &World) -> BReq {
    let (lb, ll) = w.iregions[rng.below(w.iregions.len() as u64) as usize];
    let max = if rng.chance(30) { 7000 } else { 900 };
    let len = if rng.chance(3) {
        0
    } else {
        (1 + rng.below(max)).min(ll)
    };
    let local = lb + rng.below(ll - len + 1);
    let remote = if w.table.is_empty() || rng.chance(5) {
        TBASE + rng.below(TSPACE as u64 - len)
    } else {
        let e = w.table[rng.below(w.table.len() as u64) as usize];
        let len = len.min(e.len);
        e.addr + rng.below(e.len - len + 1)
    };
    let len = if w
        .table
        .iter()
        .any(|e| remote >= e.addr && remote + len <= e.addr + e.len)
    {
        len
    } else {
        len.min(TBASE + TSPACE as u64 - remote)
    };
    BReq {
        read: rng.chance(40),
        local,
        remote,
        len,
    }
}

/// One seed: a few batches, mostly one after the other, sometimes two at
/// once, through 1-3 connections. Returns the steps taken.
fn run_seed(seed: u64) -> u64 {
    let mut rng = Rng(seed);
    let n_conns = 1 + rng.below(3) as usize;
    let hostile = rng.chance(10);
    let mute_chance = if rng.chance(30) { 25 } else { 0 };
    let mut tregions = BTreeMap::new();
    let mut next_gen = 0;
    for _ in 0..2 + rng.below(5) {
        register(&mut rng, &mut tregions, &mut next_gen);
    }
    let table = tregions
        .iter()
        .map(|(&addr, &(len, gen))| TableEntry { addr, len, gen })
        .collect();
    let mut imem = vec![0u8; ISPACE];
    let mut tmem = vec![0u8; TSPACE];
    for c in imem.chunks_mut(8).chain(tmem.chunks_mut(8)) {
        c.copy_from_slice(&rng.next().to_le_bytes());
    }
    let mut w = World {
        seed,
        now: Time::from_nanos(1_000_000),
        resumed: Time::ZERO,
        rng: Rng(seed ^ 0x5bd1_e995),
        step: 0,
        imem,
        iregions: vec![(IBASE, 12 * 1024), (IBASE + 16 * 1024, 12 * 1024)],
        tmem,
        tregions,
        next_gen,
        table,
        conns: Vec::new(),
        next_uid: 0,
        batches: Vec::new(),
        passes: Vec::new(),
        next_pass: 0,
        owners: HashMap::new(),
        delivered: HashMap::new(),
        rr: 0,
        hostile,
        forged: false,
        mute_chance,
        verdicts: Verdicts::new(),
    };
    for _ in 0..n_conns {
        let c = w.new_conn();
        w.conns.push(c);
    }
    let batches = 1 + rng.below(3) as usize;
    // Batches one after the other, and now and then one beside the one
    // running (two callers on one peer: their passes share connections).
    let mut checked = vec![false; batches];
    loop {
        let next = w.batches.len();
        let previous_done = next == 0 || w.batches[next - 1].phase == Phase::Done;
        if next < batches && (previous_done || w.rng.chance(2)) {
            let n = 1 + rng.below(8) as usize;
            let reqs: Vec<BReq> = (0..n).map(|_| pick_request(&mut rng, &w)).collect();
            let notify = rng.chance(70);
            if !previous_done {
                count(8);
            }
            w.batches.push(Batch {
                results: vec![None; reqs.len()],
                landed: vec![0; reqs.len()],
                reqs,
                flow: Flow::new(notify),
                notify,
                phase: Phase::Data,
                notified: None,
                notify_passes: 0,
            });
            w.submit(next);
        }
        for (b, seen) in checked.iter_mut().enumerate() {
            if *seen || w.batches.get(b).is_none_or(|x| x.phase != Phase::Done) {
                continue;
            }
            *seen = true;
            // (d) never lost: a batch whose requests and notification all
            // succeeded was delivered exactly once (unless forged answers
            // were injected: a target that lies can claim anything).
            let batch = &w.batches[b];
            let all_ok = batch.results.iter().all(|r| matches!(r, Some(Ok(()))));
            for _ in batch.results.iter().filter(|r| matches!(r, Some(Ok(())))) {
                count(7);
            }
            if batch.results.iter().any(Option::is_none) {
                w.fail(format!("batch {b} finished with a request unreported"));
            }
            if batch.notify && all_ok && batch.notified == Some(Ok(())) && !w.forged {
                let n = w.delivered.get(&b).copied().unwrap_or(0);
                if n != 1 {
                    w.fail(format!("batch {b}'s notification delivered {n} times"));
                }
            }
        }
        if checked.iter().all(|&c| c) {
            break;
        }
        if w.step >= MAX_STEPS {
            w.fail(format!("batches still running after {MAX_STEPS} steps"));
        }
        w.step();
    }
    w.step
}

fn mutant() -> Option<&'static str> {
    if cfg!(ferry_mutant = "notify_before_data") {
        Some("notify_before_data")
    } else if cfg!(ferry_mutant = "deadline_per_slot") {
        Some("deadline_per_slot")
    } else if cfg!(ferry_mutant = "window_waits_forever") {
        Some("window_waits_forever")
    } else {
        None
    }
}

#[test]
fn initiator_and_target_cores_keep_memory_deadlines_and_notifications() {
    let steps = common::run_seeds("pair", "sim_pair", DEFAULT_SEEDS, mutant(), run_seed);
    if steps > 0 {
        let stats: Vec<String> = STAT_NAMES
            .iter()
            .zip(&STATS)
            .map(|(n, v)| format!("{n} {}", v.load(Ordering::Relaxed)))
            .collect();
        eprintln!("sim pair: {}", stats.join(", "));
    }
}

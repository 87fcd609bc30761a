//! The initiator's side of a connection: the operations in flight by id,
//! the checks every answer passes before it completes one, and the send
//! window of a long send.
//!
//! The driver sends frames and reads answers. For every answer header,
//! [`on_header`] says what to do ([`Recv`]: complete the operation, read
//! the payload into its destination, read the failed indices of a DATAV or
//! ERRV, the ids of an OKS or a table into a buffer, take the staging
//! area's lane, throw the rest of the frame away, or fail); the headers
//! that name no operation are decided by [`header_alone`] without the
//! operations in flight. An id is looked up by [`Pending::answer`]
//! ([`Reply`]): an operation in flight (taken out: the driver completes
//! it), the late answer of an operation whose batch expired
//! ([`Reply::Skip`]: the driver reads and throws away the rest of the
//! frame), or nothing it sent ([`Reply::Unknown`]: the connection fails
//! with a protocol error). The payload checks ([`check_data`],
//! [`Verdicts`] over [`failed_segments`] and [`check_datav`],
//! [`check_ack`], the frame's lengths against the operation and
//! [`SCRATCH`]) decide before a byte is written to local memory: a
//! payload lands only in the destination of the operation it answers, and
//! only if its length is the one that operation expects. The driver reads
//! and completes; each segment of a gathered answer ends as
//! [`Verdicts::of`] says, and a refusal marks its request for the retry
//! when [`retried`] says so.
//!
//! States of an operation ([`OpState`]): `InFlight` (sent, in
//! [`Pending`]) → out of the core, completed by its answer
//! ([`Reply::Op`]) or failed with the connection ([`Pending::close`]
//! drains them all; every later send fails with the close reason) | →
//! `Abandoned` (its batch expired: the id is remembered, at most
//! [`MAX_ABANDONED`], so its late answer is skipped, [`Reply::Skip`];
//! beyond that the connection is dropped).
//!
//! The send window ([`Slicing`]): a long send on the socket path is cut
//! into slices of [`FAIR_SLICE`] payload bytes; before slice `k` goes out,
//! the operations of slice `k - FAIR_WINDOW` must be answered — but never
//! past the batch's deadline ([`window_until`]): a target that reads and
//! never answers is then timed out by the batch, not waited for.
//!
//! The CREAD fence ([`target_writes`], [`Fence`]): on the same-host path
//! the target copies into this side's memory itself (a CREAD), after a
//! check that this side still wants the copy, and nothing makes the check
//! and the copy one step. So an operation of that kind that ends without
//! its answer keeps its destination registered until the target's side
//! of the connection has ended (its copies return before it closes), or,
//! past the patience, marks it unproven (`unregister` then fails with
//! `RegionHeld`) and keeps waiting.
//!
//! Invariants:
//! - an id is in flight at most once and answered at most once;
//! - no memory the target may still write goes back to the application:
//!   the destination of a CREAD ended without its answer is released only
//!   by [`Fence::on_peer_end`];
//! - the memory kept per connection is bounded: the operations in flight
//!   (each holds what the caller gave) and [`MAX_ABANDONED`] ids;
//! - a window wait ends by the batch's deadline (or `stall` from now when
//!   the batch has none).

use core::time::Duration;
use std::collections::{HashMap, HashSet};

use crate::frame::{Response, Status, MAX_ACKS, MAX_SEGMENTS, MAX_TABLE_ENTRIES, TABLE_ENTRY_LEN};
use crate::time::Time;

/// Most request ids of expired batches a connection remembers (their late
/// answers are skipped); beyond it the connection is dropped.
pub const MAX_ABANDONED: usize = 65_536;

/// Payload bytes a sender on the socket path writes before it lets go of
/// the connection at the next frame boundary (other callers' frames go in
/// between).
pub const FAIR_SLICE: u64 = 1 << 20;

/// Slices of a long send that may be written and not yet answered.
pub const FAIR_WINDOW: usize = 4;

/// The states of an id the core keeps (see the module; named in
/// PROTOCOL.md §3.2).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OpState {
    /// Sent and waiting for its answer.
    InFlight,
    /// Its batch expired: its late answer will be skipped.
    Abandoned,
}

/// What an answer's id names.
#[derive(Debug, PartialEq, Eq)]
pub enum Reply<T> {
    /// An operation in flight, taken out: the answer completes it.
    Op(T),
    /// An operation of an expired batch: skip the rest of the frame.
    Skip,
    /// Nothing this side sent: a protocol error.
    Unknown,
}

/// The operations in flight on a connection, the ids of abandoned ones,
/// and the reason it closed, once it did.
#[derive(Debug)]
pub struct Pending<T, E> {
    ops: HashMap<u64, T>,
    abandoned: HashSet<u64>,
    closed: Option<E>,
}

impl<T, E> Default for Pending<T, E> {
    fn default() -> Self {
        Pending {
            ops: HashMap::new(),
            abandoned: HashSet::new(),
            closed: None,
        }
    }
}

impl<T, E: Clone> Pending<T, E> {
    /// Nothing in flight.
    pub fn new() -> Self {
        Self::default()
    }

    /// Why the connection closed, once it did: a send fails with it.
    #[inline]
    pub fn closed(&self) -> Option<&E> {
        self.closed.as_ref()
    }

    /// Puts `op` in flight under `id` (`Err(op)` if the connection is
    /// closed: fail it with [`Pending::closed`]).
    #[inline]
    pub fn insert(&mut self, id: u64, op: T) -> Result<(), T> {
        if self.closed.is_some() {
            return Err(op);
        }
        self.ops.insert(id, op);
        Ok(())
    }

    /// Takes `id` out of flight, if it is in.
    #[inline]
    pub fn take(&mut self, id: u64) -> Option<T> {
        self.ops.remove(&id)
    }

    /// Whether `id` belonged to an expired batch (and forgets it).
    #[inline]
    pub fn forget(&mut self, id: u64) -> bool {
        self.abandoned.remove(&id)
    }

    /// What the answer to `id` completes (see [`Reply`]).
    #[inline]
    pub fn answer(&mut self, id: u64) -> Reply<T> {
        match self.ops.remove(&id) {
            Some(op) => Reply::Op(op),
            None if self.abandoned.remove(&id) => Reply::Skip,
            None => Reply::Unknown,
        }
    }

    /// Whether `id` is in flight.
    #[inline]
    pub fn contains(&self, id: u64) -> bool {
        self.ops.contains_key(&id)
    }

    /// Whether nothing is in flight.
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.ops.is_empty()
    }

    /// Operations in flight.
    #[inline]
    pub fn len(&self) -> usize {
        self.ops.len()
    }

    /// Abandoned ids remembered.
    #[inline]
    pub fn abandoned(&self) -> usize {
        self.abandoned.len()
    }

    /// The state of `id`: in flight, abandoned, or neither (`None`).
    pub fn state(&self, id: u64) -> Option<OpState> {
        if self.ops.contains_key(&id) {
            Some(OpState::InFlight)
        } else if self.abandoned.contains(&id) {
            Some(OpState::Abandoned)
        } else {
            None
        }
    }

    /// Abandons the operations `of` picks (their batch expired): they are
    /// taken out, their ids remembered. The second value: more ids are
    /// remembered than [`MAX_ABANDONED`] (drop the connection).
    pub fn abandon(&mut self, of: impl Fn(&T) -> bool) -> (Vec<T>, bool) {
        let ids: Vec<u64> = self
            .ops
            .iter()
            .filter(|(_, op)| of(op))
            .map(|(id, _)| *id)
            .collect();
        let mut out = Vec::with_capacity(ids.len());
        for id in ids {
            if let Some(op) = self.ops.remove(&id) {
                self.abandoned.insert(id);
                out.push(op);
            }
        }
        (out, self.abandoned.len() > MAX_ABANDONED)
    }

    /// Takes the operations `ids` out without remembering them (sends
    /// withdrawn before a byte of them was written).
    pub fn withdraw(&mut self, ids: &[u64]) -> Vec<T> {
        ids.iter().filter_map(|id| self.ops.remove(id)).collect()
    }

    /// The connection closed with `err` (the first reason stays): every
    /// operation in flight is returned, to fail.
    pub fn close(&mut self, err: E) -> Vec<T> {
        self.closed.get_or_insert(err);
        self.ops.drain().map(|(_, op)| op).collect()
    }

    /// Marks the connection closed with `err` if nothing is in flight
    /// (retired for idleness); returns whether it did.
    pub fn retire(&mut self, err: impl FnOnce() -> E) -> bool {
        if !self.ops.is_empty() {
            return false;
        }
        self.closed.get_or_insert_with(err);
        true
    }
}

/// What an operation in flight takes as its answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Expect {
    /// OK or ERR (WRITE, NOTIFY).
    Ack,
    /// OK, ERR, or ERRV over its segments (WRITEV; CWRITE, CREAD, SWRITE,
    /// SREAD).
    AckV,
    /// DATA of this many bytes, or ERR (READ).
    Data(u64),
    /// DATAV over its segments, or ERR (READV).
    DataV,
    /// TABLE_REPLY, or ERR (TABLE).
    Table,
}

/// An operation in flight names the answer it takes.
pub trait Answered {
    /// See [`Expect`].
    fn expect(&self) -> Expect;
}

/// Bytes of the reader's scratch buffer: the longest id list (an OKS of
/// [`MAX_ACKS`] ids) or index list (an ERRV or DATAV naming
/// [`MAX_SEGMENTS`] segments) an instruction asks it to read there.
pub const SCRATCH: usize = MAX_ACKS as usize * 8;

/// What the reader does with an answer header (the reader's states, named
/// in PROTOCOL.md §3.2). The payload never passes through the core: `Into`
/// and `Indices` name the operation whose destinations the driver reads
/// into. Every length an instruction asks the driver to read into its
/// scratch buffer is at most [`SCRATCH`].
#[derive(Debug, PartialEq, Eq)]
pub enum Recv<T> {
    /// Complete the operation (every part) with an acknowledgement.
    Ack(T),
    /// Complete the operation (every part) with the ERR's status, address
    /// and length ([`retried`]: whether the status marks it for the
    /// batch's retry).
    Refused(T, Status, u64, u64),
    /// Read the DATA's payload (this many bytes, the READ's own length)
    /// into the operation's destination, then complete it.
    Into(T, u64),
    /// A DATAV for the operation: read its failed indices (`failed` of
    /// them, 4 bytes each, into the scratch; they end the frame only if
    /// `len` is 0), judge them with [`Verdicts::datav`], read the `len`
    /// payload bytes into the segments that [`Verdicts::lands`], then
    /// complete each segment with [`Verdicts::of`].
    Indices {
        /// The READV answered.
        op: T,
        /// Failed indices that follow the header.
        failed: u32,
        /// Payload bytes after them.
        len: u64,
        /// Why the listed segments failed.
        status: Option<Status>,
    },
    /// An ERRV for the operation: read `count` failed indices (4 bytes
    /// each, into the scratch; they end the frame), judge them with
    /// [`Verdicts::errv`], then complete each segment with
    /// [`Verdicts::of`].
    Refusals {
        /// The WRITEV (or same-host frame) answered.
        op: T,
        /// Why the listed segments failed.
        status: Status,
        /// Failed indices that follow the header.
        count: u32,
    },
    /// An OKS: read this many ids (8 bytes each, into the scratch; they
    /// end the frame); each acknowledges an operation as an OK header
    /// would ([`on_header`] of `Response::Ok`).
    Acks(u32),
    /// A TABLE reply for the operation: read this many bytes (they end
    /// the frame), decode them ([`crate::frame::decode_table`]: an error
    /// fails the operation and the connection), and complete the
    /// operation with the table.
    Table(T, u64),
    /// A WAKE on a connection with a staging area: acknowledgements wait
    /// in its lane; take them.
    Lane,
    /// The answer of an operation whose batch expired: read and throw away
    /// this many bytes (the rest of the frame).
    Discard(u64),
    /// Not an answer to anything in flight, or not the answer the
    /// operation takes: fail the operation (if any) and the connection
    /// with this protocol error.
    Fail(Option<T>, String),
}

/// Decides the headers that name no operation in flight (OKS, WAKE,
/// SAME_HOST_OK: `staged`, the connection has a staging area), so that a
/// driver takes no lock for them; `None` for those that do (see
/// [`on_header`]).
#[inline]
pub fn header_alone<T>(resp: &Response, staged: bool) -> Option<Recv<T>> {
    match *resp {
        Response::OkMany { count } if count > MAX_ACKS => Some(Recv::Fail(
            None,
            format!("OKS with {count} ids (at most {MAX_ACKS})"),
        )),
        Response::OkMany { count } => Some(Recv::Acks(count)),
        Response::Wake if staged => Some(Recv::Lane),
        Response::Wake => Some(Recv::Fail(None, "WAKE without a staging area".to_owned())),
        Response::SameHostOk { id, .. } => Some(Recv::Fail(
            None,
            format!("SAME_HOST_OK for request {id}, not offered"),
        )),
        _ => None,
    }
}

/// Decides any answer header (`staged`: the connection has a staging
/// area): what the reader does next ([`Recv`]). A header that names an
/// operation takes it out of flight; every check of its kind and lengths
/// against what the operation expects ([`Expect`]) is made here, before a
/// byte of payload is read.
#[inline]
pub fn on_header<T: Answered, E: Clone>(
    pending: &mut Pending<T, E>,
    resp: &Response,
    staged: bool,
) -> Recv<T> {
    if let Some(r) = header_alone(resp, staged) {
        return r;
    }
    let (id, what) = match *resp {
        Response::Ok { id } | Response::Err { id, .. } => (id, "response"),
        Response::Data { id, .. } => (id, "DATA"),
        Response::DataV { id, .. } => (id, "DATAV"),
        Response::ErrV { id, .. } => (id, "ERRV"),
        Response::Table { id, .. } => (id, "TABLE"),
        // Decided above.
        Response::OkMany { .. } | Response::Wake | Response::SameHostOk { .. } => {
            return Recv::Fail(None, "an answer header out of place".to_owned())
        }
    };
    let op = match pending.answer(id) {
        Reply::Op(op) => op,
        Reply::Skip => return Recv::Discard(frame_bytes(resp)),
        Reply::Unknown => return Recv::Fail(None, format!("{what} for unknown request id {id}")),
    };
    let expect = op.expect();
    match *resp {
        Response::Ok { id } => {
            let needs_data = matches!(expect, Expect::Data(_) | Expect::DataV | Expect::Table);
            match check_ack(id, needs_data) {
                Ok(()) => Recv::Ack(op),
                Err(reason) => Recv::Fail(Some(op), reason),
            }
        }
        Response::Err {
            status, addr, len, ..
        } => Recv::Refused(op, status, addr, len),
        Response::Data { id, len } => {
            let want = match expect {
                Expect::Data(w) => Some(w),
                _ => None,
            };
            match check_data(id, want, len) {
                Ok(()) => Recv::Into(op, len),
                Err(reason) => Recv::Fail(Some(op), reason),
            }
        }
        Response::DataV {
            id,
            failed,
            len,
            status,
        } => match expect {
            _ if failed > MAX_SEGMENTS => Recv::Fail(
                Some(op),
                format!("DATAV names {failed} failed segments (at most {MAX_SEGMENTS})"),
            ),
            Expect::DataV => Recv::Indices {
                op,
                failed,
                len,
                status,
            },
            _ => Recv::Fail(Some(op), format!("DATAV for request {id}, not a READV")),
        },
        Response::ErrV { id, status, count } => match expect {
            _ if count > MAX_SEGMENTS => Recv::Fail(
                Some(op),
                format!("ERRV names {count} failed segments (at most {MAX_SEGMENTS})"),
            ),
            Expect::AckV => Recv::Refusals { op, status, count },
            _ => Recv::Fail(Some(op), format!("ERRV for request {id}, not a WRITEV")),
        },
        Response::Table { id, count } => match expect {
            _ if count > MAX_TABLE_ENTRIES => Recv::Fail(
                Some(op),
                format!("TABLE of {count} entries (at most {MAX_TABLE_ENTRIES})"),
            ),
            Expect::Table => Recv::Table(op, frame_bytes(resp)),
            _ => Recv::Fail(Some(op), format!("TABLE reply to request {id}")),
        },
        Response::OkMany { .. } | Response::Wake | Response::SameHostOk { .. } => {
            Recv::Fail(Some(op), "an answer header out of place".to_owned())
        }
    }
}

/// Whether a refusal with `status` marks its request for the batch's
/// retry (after a fresh table: [`crate::batch::Then::Retry`]).
#[inline]
pub fn retried(status: Status) -> bool {
    status == Status::StaleRegion
}

/// How each segment of a gathered answer (ERRV, DATAV) ends: judged once
/// from the failed indices the frame lists, then asked per segment. Kept
/// by the reader and refilled for every such answer (no allocation once
/// it has held [`MAX_SEGMENTS`] segments).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Verdicts {
    failed: Vec<bool>,
    status: Option<Status>,
}

impl Verdicts {
    /// No segments judged yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// An ERRV listing `indices` (4 bytes each) among `segments`, which
    /// failed with `status`; the others landed. An index out of range is a
    /// protocol error (the operation and the connection fail).
    pub fn errv(&mut self, indices: &[u8], segments: usize, status: Status) -> Result<(), String> {
        self.status = Some(status);
        fill_failed(&mut self.failed, indices, segments, "ERRV")
    }

    /// A DATAV listing `indices` among the segments of lengths `lens`,
    /// which failed with `status` (`None` in the frame: reported as
    /// `AddressNotRegistered`), and carrying `len` payload bytes: exactly
    /// the segments not failed, else a protocol error.
    pub fn datav(
        &mut self,
        indices: &[u8],
        lens: impl ExactSizeIterator<Item = u64>,
        status: Option<Status>,
        len: u64,
    ) -> Result<(), String> {
        self.status = Some(status.unwrap_or(Status::AddressNotRegistered));
        fill_failed(&mut self.failed, indices, lens.len(), "DATAV")?;
        check_datav(&self.failed, lens, len)
    }

    /// Segments judged.
    #[inline]
    pub fn len(&self) -> usize {
        self.failed.len()
    }

    /// Whether no segment is judged.
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.failed.is_empty()
    }

    /// Whether segment `i`'s payload follows in the frame (a DATAV's
    /// segment not failed).
    #[inline]
    pub fn lands(&self, i: usize) -> bool {
        self.failed.get(i) == Some(&false)
    }

    /// How segment `i` ends: landed, or refused with the frame's status
    /// (a segment never judged: refused too).
    #[inline]
    pub fn of(&self, i: usize) -> Result<(), Status> {
        if self.lands(i) {
            Ok(())
        } else {
            Err(self.status.unwrap_or(Status::AddressNotRegistered))
        }
    }
}

/// Flags the segments `indices` names among `segments` into `bad`
/// (cleared first; its capacity is reused).
fn fill_failed(
    bad: &mut Vec<bool>,
    indices: &[u8],
    segments: usize,
    what: &str,
) -> Result<(), String> {
    bad.clear();
    bad.resize(segments, false);
    for c in indices.chunks_exact(4) {
        let i = u32::from_le_bytes([c[0], c[1], c[2], c[3]]) as usize;
        match bad.get_mut(i) {
            Some(b) => *b = true,
            None => return Err(format!("{what} names segment {i} of {segments}")),
        }
    }
    Ok(())
}

/// The payload bytes of a response frame after its header: due by one
/// deadline.
#[inline]
pub fn frame_bytes(resp: &Response) -> u64 {
    match *resp {
        Response::Ok { .. } | Response::Err { .. } => 0,
        Response::OkMany { count } => u64::from(count) * 8,
        Response::Data { len, .. } => len,
        Response::DataV { failed, len, .. } => (u64::from(failed) * 4).saturating_add(len),
        Response::ErrV { count, .. } => u64::from(count) * 4,
        Response::Table { count, .. } => u64::from(count) * TABLE_ENTRY_LEN as u64,
        Response::SameHostOk { .. } | Response::Wake => 0,
    }
}

/// A plain OK for an operation that needs data back (`needs_data`: a
/// READ, READV or TABLE) is a protocol error.
#[inline]
pub fn check_ack(id: u64, needs_data: bool) -> Result<(), String> {
    if needs_data {
        Err(format!("plain OK for request {id}, which needs data"))
    } else {
        Ok(())
    }
}

/// A DATA of `len` bytes for request `id`, which expects `want` (`None`:
/// not a READ).
#[inline]
pub fn check_data(id: u64, want: Option<u64>, len: u64) -> Result<(), String> {
    match want {
        Some(w) if w == len => Ok(()),
        Some(w) => Err(format!(
            "DATA of {len} bytes for request {id}, which expects {w}"
        )),
        None => Err(format!(
            "DATA of {len} bytes for request {id}, which expects {}",
            u64::MAX
        )),
    }
}

/// The failed segments a DATAV or ERRV names (`indices`: 4 bytes each)
/// among `segments`: a flag per segment, or the error for an index out of
/// range (`what`: the frame's name).
pub fn failed_segments(indices: &[u8], segments: usize, what: &str) -> Result<Vec<bool>, String> {
    let mut bad = Vec::new();
    fill_failed(&mut bad, indices, segments, what)?;
    Ok(bad)
}

/// A DATAV carries `len` bytes: exactly the segments not failed.
pub fn check_datav(
    failed: &[bool],
    lens: impl Iterator<Item = u64>,
    len: u64,
) -> Result<(), String> {
    let valid: u64 = lens
        .zip(failed)
        .filter(|(_, b)| !**b)
        .fold(0u64, |a, (l, _)| a.saturating_add(l));
    if valid == len {
        Ok(())
    } else {
        Err(format!(
            "DATAV carries {len} bytes, the segments need {valid}"
        ))
    }
}

/// How a long send is cut and how far it runs ahead of its answers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Slicing {
    /// Payload bytes per slice.
    pub slice: u64,
    /// Slices written and not yet answered.
    pub window: usize,
}

impl Default for Slicing {
    fn default() -> Self {
        Slicing {
            slice: FAIR_SLICE,
            window: FAIR_WINDOW,
        }
    }
}

impl Slicing {
    /// Frame by frame: whether a new slice starts before a frame of
    /// `payload` bytes; `since` counts the payload of the slice so far.
    #[inline]
    pub fn cut_before(&self, since: &mut u64, payload: u64) -> bool {
        let cut = *since >= self.slice;
        if cut {
            *since = 0;
        }
        *since = since.saturating_add(payload);
        cut
    }

    /// Before slice `k` (0-based) goes out: the slice whose operations
    /// must be answered first, if any (its operations end at
    /// `cuts[slice]`).
    #[inline]
    pub fn gate(&self, k: usize) -> Option<usize> {
        k.checked_sub(self.window.max(1))
    }
}

/// How long a window wait may last: until the batch's deadline, or
/// `stall` from `now` if its clock has not started.
#[inline]
pub fn window_until(deadline: Option<Time>, now: Time, stall: Duration) -> Time {
    if cfg!(ferry_mutant = "window_waits_forever") {
        // The planted bug of 888a448: the window ignores the deadline.
        return Time::NEVER;
    }
    deadline.unwrap_or_else(|| now.after(stall))
}

/// Whether the target writes this side's memory itself for a same-host
/// operation (a CREAD: `process_vm_writev` into the destination; an SREAD
/// is copied out of the staging area by this side): such an operation
/// that ends without its answer leaves its memory to a [`Fence`].
#[inline]
pub fn target_writes(read: bool, staged: bool) -> bool {
    if cfg!(ferry_mutant = "cread_unfenced") {
        // The planted bug of 7c3e5e6: no CREAD fence, the destination goes
        // back to the application when the operation is given up.
        return false;
    }
    read && !staged
}

/// The states of a [`Fence`] (named in PROTOCOL.md §3.2).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FenceState {
    /// Holding the memory, within the patience.
    Holding,
    /// Past the patience without proof: the memory is marked unproven
    /// (`unregister` fails with `RegionHeld`) and still held.
    Unproven,
    /// The target's side has ended: the memory may go.
    Released,
}

/// Memory the target may still write, held until the target's side of
/// the connection has ended (see the module). The driver shuts its
/// writing half (the target reads the end and stops), watches for the end
/// of the stream, and calls [`Fence::on_timeout`] at
/// [`Fence::poll_timeout`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fence {
    until: Time,
    state: FenceState,
}

impl Fence {
    /// A fence raised at `now`, patient for `patience`.
    #[inline]
    pub fn new(now: Time, patience: Duration) -> Fence {
        Fence {
            until: now.after(patience),
            state: FenceState::Holding,
        }
    }

    /// Its state.
    #[inline]
    pub fn state(&self) -> FenceState {
        self.state
    }

    /// When [`Fence::on_timeout`] is due (`None`: no more timeouts).
    #[inline]
    pub fn poll_timeout(&self) -> Option<Time> {
        (self.state == FenceState::Holding).then_some(self.until)
    }

    /// Time has come to `now`: `true` once, when the patience is over
    /// without proof (mark the memory unproven now).
    #[inline]
    pub fn on_timeout(&mut self, now: Time) -> bool {
        if self.state == FenceState::Holding && now >= self.until {
            self.state = FenceState::Unproven;
            return true;
        }
        false
    }

    /// The target's side of the connection has ended (the stream's end,
    /// a reset, the process gone): the memory may go back.
    #[inline]
    pub fn on_peer_end(&mut self) {
        self.state = FenceState::Released;
    }
}

#[cfg(all(
    test,
    not(ferry_mutant = "window_waits_forever"),
    not(ferry_mutant = "cread_unfenced")
))]
mod tests {
    use super::*;

    #[test]
    fn answers_name_an_operation_an_abandoned_id_or_nothing() {
        let mut p: Pending<u32, &str> = Pending::new();
        p.insert(1, 10).unwrap();
        p.insert(2, 20).unwrap();
        p.insert(3, 30).unwrap();
        let (gone, too_many) = p.abandon(|op| *op == 20);
        assert_eq!((gone, too_many), (vec![20], false));
        assert_eq!(p.state(2), Some(OpState::Abandoned));
        assert_eq!(p.answer(1), Reply::Op(10));
        assert_eq!(p.answer(2), Reply::Skip);
        assert_eq!(p.answer(2), Reply::Unknown);
        assert_eq!(p.answer(1), Reply::Unknown);
        assert_eq!(p.close("closed"), vec![30]);
        assert_eq!(p.insert(4, 40), Err(40));
        assert_eq!(p.closed(), Some(&"closed"));
    }

    impl Answered for Expect {
        fn expect(&self) -> Expect {
            *self
        }
    }

    #[test]
    fn answer_headers_become_what_the_reader_does() {
        let mut p: Pending<Expect, ()> = Pending::new();
        for (id, e) in [
            (1, Expect::Ack),
            (2, Expect::Data(8)),
            (3, Expect::Data(8)),
            (4, Expect::DataV),
            (5, Expect::Ack),
            (6, Expect::Table),
        ] {
            p.insert(id, e).unwrap();
        }
        assert_eq!(
            on_header(&mut p, &Response::Ok { id: 1 }, false),
            Recv::Ack(Expect::Ack)
        );
        assert_eq!(
            on_header(&mut p, &Response::Data { id: 2, len: 8 }, false),
            Recv::Into(Expect::Data(8), 8)
        );
        // A DATA longer than the READ's destination.
        assert!(matches!(
            on_header(&mut p, &Response::Data { id: 3, len: 9 }, false),
            Recv::Fail(Some(_), _)
        ));
        let dv = Response::DataV {
            id: 4,
            status: None,
            failed: 2,
            len: 5,
        };
        assert_eq!(
            on_header(&mut p, &dv, false),
            Recv::Indices {
                op: Expect::DataV,
                failed: 2,
                len: 5,
                status: None
            }
        );
        assert!(matches!(
            on_header(&mut p, &Response::Ok { id: 6 }, false),
            Recv::Fail(Some(Expect::Table), _)
        ));
        let (gone, _) = p.abandon(|_| true);
        assert_eq!(gone, vec![Expect::Ack]);
        assert_eq!(
            on_header(&mut p, &Response::Data { id: 5, len: 77 }, false),
            Recv::Discard(77)
        );
        assert!(matches!(
            on_header(&mut p, &Response::Ok { id: 5 }, false),
            Recv::Fail(None, _)
        ));
        assert_eq!(
            on_header(&mut p, &Response::OkMany { count: 2 }, false),
            Recv::Acks(2)
        );
    }

    /// A connection with one operation of each kind in flight, by id.
    fn one_of_each() -> Pending<Expect, ()> {
        let mut p = Pending::new();
        for (id, e) in [
            (1, Expect::Ack),
            (2, Expect::AckV),
            (3, Expect::Data(8)),
            (4, Expect::DataV),
            (5, Expect::Table),
        ] {
            p.insert(id, e).unwrap();
        }
        p
    }

    #[test]
    fn headers_without_an_operation_are_decided_without_the_lookup() {
        let oks = Response::OkMany { count: MAX_ACKS };
        assert_eq!(header_alone::<()>(&oks, false), Some(Recv::Acks(MAX_ACKS)));
        assert_eq!(header_alone::<()>(&Response::Wake, true), Some(Recv::Lane));
        assert!(matches!(
            header_alone::<()>(&Response::Wake, false),
            Some(Recv::Fail(None, r)) if r == "WAKE without a staging area"
        ));
        let sh = Response::SameHostOk {
            id: 3,
            channel: Ok(()),
            stage: Ok(()),
        };
        // Never offered on an established connection: even for an id in
        // flight, nothing is taken out.
        let mut p = one_of_each();
        assert!(matches!(on_header(&mut p, &sh, true), Recv::Fail(None, _)));
        assert_eq!(p.len(), 5);
        for r in [Response::Ok { id: 1 }, Response::Data { id: 3, len: 8 }] {
            assert_eq!(header_alone::<()>(&r, true), None);
        }
        // More ids than the scratch holds (the decoder refuses them too).
        let big = Response::OkMany {
            count: MAX_ACKS + 1,
        };
        assert!(matches!(
            header_alone::<()>(&big, false),
            Some(Recv::Fail(None, _))
        ));
    }

    #[test]
    fn errv_and_table_are_checked_against_their_operation_before_the_read() {
        let errv = |id, count| Response::ErrV {
            id,
            status: Status::StaleRegion,
            count,
        };
        let table = |id, count| Response::Table { id, count };
        let mut p = one_of_each();
        assert_eq!(
            on_header(&mut p, &errv(2, 3), false),
            Recv::Refusals {
                op: Expect::AckV,
                status: Status::StaleRegion,
                count: 3
            }
        );
        assert_eq!(
            on_header(&mut p, &table(5, 2), false),
            Recv::Table(Expect::Table, 2 * TABLE_ENTRY_LEN as u64)
        );
        // The wrong kind of operation: it fails with the connection.
        for (resp, want) in [
            (errv(1, 1), "ERRV for request 1, not a WRITEV"),
            (table(3, 1), "TABLE reply to request 3"),
            (
                Response::DataV {
                    id: 4,
                    status: None,
                    failed: MAX_SEGMENTS + 1,
                    len: 0,
                },
                "DATAV names 513 failed segments (at most 512)",
            ),
        ] {
            assert!(
                matches!(on_header(&mut p, &resp, false), Recv::Fail(Some(_), ref r) if r == want),
                "{resp:?}"
            );
        }
        // Unknown ids: no operation to fail, the connection fails.
        for resp in [errv(9, 1), table(9, 1)] {
            assert!(matches!(
                on_header(&mut p, &resp, false),
                Recv::Fail(None, _)
            ));
        }
        // Lengths beyond the destinations (the decoder refuses them too).
        let mut p = one_of_each();
        assert!(matches!(
            on_header(&mut p, &errv(2, MAX_SEGMENTS + 1), false),
            Recv::Fail(Some(Expect::AckV), _)
        ));
        assert!(matches!(
            on_header(&mut p, &table(5, MAX_TABLE_ENTRIES + 1), false),
            Recv::Fail(Some(Expect::Table), _)
        ));
        // The late answers of an expired batch: the rest of the frame.
        let mut p = one_of_each();
        p.abandon(|_| true);
        assert_eq!(on_header(&mut p, &errv(2, 3), false), Recv::Discard(12));
        assert_eq!(on_header(&mut p, &table(5, 2), false), Recv::Discard(48));
        let dv = Response::DataV {
            id: 4,
            status: None,
            failed: 1,
            len: 10,
        };
        assert_eq!(on_header(&mut p, &dv, false), Recv::Discard(14));
    }

    /// What an instruction asks the driver to read into its scratch.
    fn scratch_bytes<T>(r: &Recv<T>) -> usize {
        match r {
            Recv::Acks(n) => *n as usize * 8,
            Recv::Indices { failed, .. } => *failed as usize * 4,
            Recv::Refusals { count, .. } => *count as usize * 4,
            _ => 0,
        }
    }

    proptest::proptest! {
        /// Any header bytes, decoded or not, with any operation in flight
        /// under its id: a decision and no panic; what it asks to read
        /// into the scratch fits it; a payload read into an operation is
        /// the length it expects.
        #[test]
        fn any_header_is_decided_within_the_scratch(
            hdr in proptest::array::uniform32(proptest::prelude::any::<u8>()),
            expect in 0u8..5,
            want in 0u64..1 << 20,
            staged: bool,
        ) {
            let Ok(resp) = Response::decode(&hdr) else { return Ok(()) };
            let id = match resp {
                Response::Ok { id }
                | Response::Err { id, .. }
                | Response::Data { id, .. }
                | Response::DataV { id, .. }
                | Response::ErrV { id, .. }
                | Response::Table { id, .. }
                | Response::SameHostOk { id, .. } => id,
                Response::OkMany { .. } | Response::Wake => 0,
            };
            let e = [Expect::Ack, Expect::AckV, Expect::Data(want), Expect::DataV, Expect::Table]
                [expect as usize];
            let mut p: Pending<Expect, ()> = Pending::new();
            p.insert(id, e).unwrap();
            let r = on_header(&mut p, &resp, staged);
            proptest::prop_assert!(scratch_bytes(&r) <= SCRATCH);
            if let Recv::Into(op, len) = r {
                proptest::prop_assert_eq!(op, Expect::Data(len));
            }
        }

        /// Headers built past the decoder's limits are refused, not read.
        #[test]
        fn oversized_headers_are_refused(
            count in proptest::prelude::any::<u32>(),
            id in 0u64..3,
        ) {
            let mut p: Pending<Expect, ()> = Pending::new();
            p.insert(1, Expect::AckV).unwrap();
            p.insert(2, Expect::DataV).unwrap();
            for resp in [
                Response::OkMany { count },
                Response::ErrV { id, status: Status::CopyFailed, count },
                Response::DataV { id, status: None, failed: count, len: 0 },
            ] {
                let r = on_header(&mut p, &resp, false);
                proptest::prop_assert!(scratch_bytes(&r) <= SCRATCH, "{:?}", r);
            }
        }
    }

    #[test]
    fn verdicts_of_gathered_answers() {
        let idx = |is: &[u32]| -> Vec<u8> { is.iter().flat_map(|i| i.to_le_bytes()).collect() };
        let mut v = Verdicts::new();
        v.errv(&idx(&[2, 0]), 3, Status::StaleRegion).unwrap();
        assert_eq!(
            (0..3).map(|i| v.of(i)).collect::<Vec<_>>(),
            vec![Err(Status::StaleRegion), Ok(()), Err(Status::StaleRegion)]
        );
        assert!(retried(Status::StaleRegion) && !retried(Status::CopyFailed));
        // An index out of range: a protocol error, no panic.
        assert_eq!(
            v.errv(&idx(&[3]), 3, Status::CopyFailed),
            Err("ERRV names segment 3 of 3".to_owned())
        );
        assert_eq!(
            v.errv(&idx(&[u32::MAX]), 0, Status::CopyFailed),
            Err(format!("ERRV names segment {} of 0", u32::MAX))
        );
        // A DATAV: the payload is the segments not failed, no more, no less.
        let lens = [4u64, 5, 6];
        v.datav(&idx(&[1]), lens.into_iter(), None, 10).unwrap();
        assert_eq!(
            (0..3).map(|i| v.lands(i)).collect::<Vec<_>>(),
            vec![true, false, true]
        );
        assert_eq!(v.of(1), Err(Status::AddressNotRegistered));
        assert!(!v.lands(3) && v.of(3).is_err(), "never judged: never lands");
        assert!(v.datav(&idx(&[1]), lens.into_iter(), None, 11).is_err());
        assert!(v.datav(&idx(&[1]), lens.into_iter(), None, 9).is_err());
        assert!(v.datav(&idx(&[7]), lens.into_iter(), None, 0).is_err());
        v.datav(&[], lens.into_iter(), Some(Status::CopyFailed), 15)
            .unwrap();
        assert!((0..3).all(|i| v.of(i).is_ok()));
        // A trailing partial index is not an index (the driver reads
        // whole ones).
        v.datav(&[1, 0, 0, 0, 9], lens.into_iter(), None, 10)
            .unwrap();
        assert!(!v.lands(1));
        // Refilled in place: no allocation per answer once it has held
        // the most segments a frame has.
        let many: Vec<u64> = vec![1; MAX_SEGMENTS as usize];
        v.datav(&[], many.iter().copied(), None, u64::from(MAX_SEGMENTS))
            .unwrap();
        let cap = v.failed.capacity();
        for _ in 0..3 {
            v.errv(&idx(&[0]), MAX_SEGMENTS as usize, Status::CopyFailed)
                .unwrap();
            v.datav(&idx(&[0]), lens.into_iter(), None, 11).unwrap();
        }
        assert_eq!(v.failed.capacity(), cap);
    }

    #[test]
    fn too_many_abandoned_ids_drop_the_connection() {
        let mut p: Pending<u64, ()> = Pending::new();
        for id in 0..=MAX_ABANDONED as u64 {
            p.insert(id, id).unwrap();
        }
        let (gone, too_many) = p.abandon(|_| true);
        assert_eq!(gone.len(), MAX_ABANDONED + 1);
        assert!(too_many);
    }

    #[test]
    fn payload_checks() {
        assert!(check_data(1, Some(5), 5).is_ok());
        assert!(check_data(1, Some(5), 6).is_err());
        assert!(check_data(1, None, 0).is_err());
        assert!(check_ack(1, true).is_err());
        let idx: Vec<u8> = [1u32, 2].iter().flat_map(|i| i.to_le_bytes()).collect();
        let bad = failed_segments(&idx, 3, "DATAV").unwrap();
        assert_eq!(bad, vec![false, true, true]);
        assert!(failed_segments(&idx, 2, "DATAV").is_err());
        assert!(check_datav(&bad, [4, 5, 6].into_iter(), 4).is_ok());
        assert!(check_datav(&bad, [4, 5, 6].into_iter(), 5).is_err());
    }

    #[test]
    fn the_fence_holds_until_the_peer_ends() {
        assert!(target_writes(true, false));
        assert!(!target_writes(true, true) && !target_writes(false, false));
        let mut f = Fence::new(Time::from_nanos(10), Duration::from_nanos(5));
        assert_eq!(f.poll_timeout(), Some(Time::from_nanos(15)));
        assert!(!f.on_timeout(Time::from_nanos(14)));
        assert!(f.on_timeout(Time::from_nanos(15)));
        assert!(!f.on_timeout(Time::from_nanos(99)));
        assert_eq!((f.state(), f.poll_timeout()), (FenceState::Unproven, None));
        f.on_peer_end();
        assert_eq!(f.state(), FenceState::Released);
    }

    #[test]
    fn slices_and_the_window() {
        let s = Slicing {
            slice: 10,
            window: 2,
        };
        let mut since = 0;
        let cuts: Vec<usize> = [6, 6, 6, 12, 1]
            .iter()
            .enumerate()
            .filter(|&(_, &p)| s.cut_before(&mut since, p))
            .map(|(i, _)| i)
            .collect();
        assert_eq!(cuts, vec![2, 4]);
        assert_eq!((s.gate(1), s.gate(2), s.gate(3)), (None, Some(0), Some(1)));
        let now = Time::from_nanos(5);
        assert_eq!(
            window_until(Some(Time::from_nanos(9)), now, Duration::from_nanos(100)),
            Time::from_nanos(9)
        );
        assert_eq!(
            window_until(None, now, Duration::from_nanos(100)),
            Time::from_nanos(105)
        );
    }
}

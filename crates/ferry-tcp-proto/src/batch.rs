//! The initiator's side of a batch: how its requests become frames, how
//! the answers to those frames add up to each request's outcome, when the
//! batch expires, and when its notification may go.
//!
//! - [`plan`]: a pure function from the requests (already checked against
//!   local memory and the peer's table) to frames per connection: requests
//!   of at most [`GATHER_MAX_SEGMENT`] bytes gathered into WRITEV / READV
//!   frames (at most [`MAX_SEGMENTS`] segments, [`GATHER_MAX_BYTES`]
//!   bytes), larger ones cut into chunks, chunks of a request larger than
//!   one chunk spread round-robin over the connections; everything else
//!   stays on the home connection, in request order.
//! - [`Requests`]: one pass over a batch: each request's frames still
//!   unanswered, its first error, whether the target called it stale; the
//!   pass's deadline, set once, before its first frame.
//! - [`Flow`]: the batch's order: a pass, one retry of the stale requests
//!   with a fresh table, and the notification only once every request
//!   succeeded, after every answer of every pass.
//!
//! Invariants:
//! - every byte of a request is in exactly one frame part, and a request
//!   is over when the answers to all its parts are in (`counts`);
//! - the deadline of a pass is fixed by the first call that starts its
//!   clock; later calls return it unchanged;
//! - the notification goes out at most once, never before the last answer
//!   of the last pass, and only if every request succeeded.

use core::time::Duration;

use crate::frame::MAX_SEGMENTS;
use crate::time::Time;

/// Requests up to this size are gathered into WRITEV / READV frames.
pub const GATHER_MAX_SEGMENT: u64 = 64 * 1024;
/// Most payload bytes per WRITEV / READV frame.
pub const GATHER_MAX_BYTES: u64 = 4 << 20;

/// One request of a batch as the planner sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Req {
    /// A read (the peer's bytes into local memory), else a write.
    pub read: bool,
    /// Its length.
    pub len: u64,
    /// The peer's address.
    pub remote: u64,
    /// The generation of the peer's region there (from its table).
    pub gen: u32,
}

/// One part of a frame: a range of one request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Part<H> {
    /// The request of the batch it belongs to.
    pub index: usize,
    /// The local memory of the request (the driver's guard), held while
    /// the part is in flight.
    pub hold: H,
    /// Where the part starts in the request (and in the hold's range).
    pub off: u64,
    /// Its length.
    pub len: u64,
    /// The peer's address.
    pub remote: u64,
    /// The generation of the peer's region there.
    pub gen: u32,
}

/// A planned frame.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Frame<H> {
    /// A WRITE of one part.
    Write(Part<H>),
    /// A READ of one part.
    Read(Part<H>),
    /// A WRITEV of gathered small requests.
    WriteV(Vec<Part<H>>),
    /// A READV of gathered small requests.
    ReadV(Vec<Part<H>>),
}

impl<H> Frame<H> {
    /// Its parts, in order.
    #[inline]
    pub fn parts(&self) -> &[Part<H>] {
        match self {
            Frame::Write(p) | Frame::Read(p) => core::slice::from_ref(p),
            Frame::WriteV(ps) | Frame::ReadV(ps) => ps,
        }
    }

    /// Whether it reads.
    #[inline]
    pub fn read(&self) -> bool {
        matches!(self, Frame::Read(_) | Frame::ReadV(_))
    }

    /// Its payload bytes.
    #[inline]
    pub fn payload_len(&self) -> u64 {
        self.parts().iter().map(|p| p.len).sum()
    }
}

/// What [`plan`] counted: each request's parts and the bytes planned.
#[derive(Debug)]
pub struct Plan {
    /// Parts per request (0: nothing to send: empty, or left out).
    pub counts: Vec<u32>,
    /// Payload bytes planned.
    pub bytes: u64,
}

/// Plans `reqs` (by index; `None`: left out — refused before the wire)
/// into frames over `conns` connections (at least one), handing each to
/// `emit(connection, frame)` in sending order (connection 0: the home
/// one). `chunk`: the largest part of a large request; `next_rr` names
/// the connection of its next chunk (the driver's round-robin counter,
/// shared by its batches). A request's hold is the driver's guard of its
/// local memory, cloned into each of its parts.
pub fn plan<H: Clone>(
    reqs: impl IntoIterator<Item = Option<(Req, H)>>,
    chunk: u64,
    conns: usize,
    mut next_rr: impl FnMut() -> usize,
    mut emit: impl FnMut(usize, Frame<H>),
) -> Plan {
    let conns = conns.max(1);
    let chunk = chunk.max(1);
    let reqs = reqs.into_iter();
    let mut counts = Vec::with_capacity(reqs.size_hint().0);
    let mut bytes = 0u64;
    // Requests that fit in one chunk all go to connection 0: in order,
    // pipelined, and the other connections stay idle unless large requests
    // are split over them.
    let home = 0;
    // Gathered small writes (reads): parts and bytes.
    let mut groups: [(Vec<Part<H>>, u64); 2] = [(Vec::new(), 0), (Vec::new(), 0)];
    fn flush<H>(g: &mut (Vec<Part<H>>, u64), read: bool, emit: &mut impl FnMut(usize, Frame<H>)) {
        g.1 = 0;
        match g.0.len() {
            0 => {}
            1 => {
                if let Some(p) = g.0.pop() {
                    emit(
                        0,
                        if read {
                            Frame::Read(p)
                        } else {
                            Frame::Write(p)
                        },
                    );
                }
            }
            _ => {
                let parts = core::mem::take(&mut g.0);
                emit(
                    0,
                    if read {
                        Frame::ReadV(parts)
                    } else {
                        Frame::WriteV(parts)
                    },
                );
            }
        }
    }
    for (i, r) in reqs.enumerate() {
        counts.push(0u32);
        let Some((r, h)) = r else { continue };
        if r.len == 0 {
            continue;
        }
        bytes += r.len;
        if r.len <= GATHER_MAX_SEGMENT.min(chunk) {
            let grp = &mut groups[r.read as usize];
            if grp.0.len() == MAX_SEGMENTS as usize || grp.1 + r.len > GATHER_MAX_BYTES {
                flush(grp, r.read, &mut emit);
            }
            grp.0.push(Part {
                index: i,
                hold: h,
                off: 0,
                len: r.len,
                remote: r.remote,
                gen: r.gen,
            });
            grp.1 += r.len;
            counts[i] += 1;
            continue;
        }
        let mut off = 0;
        while off < r.len {
            let len = chunk.min(r.len - off);
            let part = Part {
                index: i,
                hold: h.clone(),
                off,
                len,
                remote: r.remote + off,
                gen: r.gen,
            };
            // Chunks of requests larger than one chunk are spread.
            let c = if conns == 1 || r.len <= chunk {
                home
            } else {
                next_rr() % conns
            };
            if c == home {
                // Keep the order of requests on the home connection.
                let [w, rd] = &mut groups;
                flush(w, false, &mut emit);
                flush(rd, true, &mut emit);
            }
            emit(
                c,
                if r.read {
                    Frame::Read(part)
                } else {
                    Frame::Write(part)
                },
            );
            counts[i] += 1;
            off += len;
        }
    }
    let [w, rd] = &mut groups;
    flush(w, false, &mut emit);
    flush(rd, true, &mut emit);
    Plan { counts, bytes }
}

/// One request's state in a pass.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Slot<E> {
    /// Parts still unanswered.
    left: u32,
    /// Its first error.
    err: Option<E>,
    /// The target refused part of it because the region was registered
    /// again since the table used (`StaleRegion`): retried once.
    stale: bool,
}

/// One pass over a batch (or one control request): see the module.
#[derive(Clone, Debug)]
pub struct Requests<E> {
    slots: Vec<Slot<E>>,
    /// Parts unanswered, plus one until [`Requests::arm`].
    remaining: usize,
    /// Requests refused as stale are held back (not reported) for a retry.
    hold_stale: bool,
    deadline: Option<Time>,
}

impl<E: Clone> Requests<E> {
    /// `n` requests, each pending until [`Requests::arm`]; `hold_stale`:
    /// stale ones are not reported (a first pass, retried).
    pub fn new(n: usize, hold_stale: bool) -> Requests<E> {
        Requests {
            slots: vec![
                Slot {
                    left: 1,
                    err: None,
                    stale: false,
                };
                n
            ],
            remaining: 1,
            hold_stale,
            deadline: None,
        }
    }

    fn outcome(&self, slot: &Slot<E>) -> Option<Result<(), E>> {
        if slot.left > 0 || (slot.stale && self.hold_stale) {
            return None;
        }
        Some(match &slot.err {
            Some(e) => Err(e.clone()),
            None => Ok(()),
        })
    }

    /// Sets each request's number of parts (once, before any is sent);
    /// requests with none are over now and go to `report`. Returns
    /// whether the pass is over.
    pub fn arm(&mut self, counts: &[u32], mut report: impl FnMut(usize, Result<(), E>)) -> bool {
        let mut total = 0usize;
        for i in 0..self.slots.len() {
            let n = counts.get(i).copied().unwrap_or(0);
            self.slots[i].left = n;
            total += n as usize;
            if n == 0 {
                if let Some(r) = self.outcome(&self.slots[i]) {
                    report(i, r);
                }
            }
        }
        self.remaining = self.remaining.saturating_add(total).saturating_sub(1);
        self.remaining == 0
    }

    /// Records an error for a request that never reached the wire.
    pub fn fail_unsent(&mut self, index: usize, err: E) {
        if let Some(s) = self.slots.get_mut(index) {
            s.err.get_or_insert(err);
        }
    }

    /// One part of request `index` is answered with `r`; if that ends the
    /// request, its outcome goes to `report`. Returns whether the pass is
    /// over.
    pub fn complete(
        &mut self,
        index: usize,
        r: Result<(), E>,
        report: impl FnOnce(usize, Result<(), E>),
    ) -> bool {
        if let Some(s) = self.slots.get_mut(index) {
            let before = s.left;
            s.left = s.left.saturating_sub(1);
            if let Err(e) = r {
                s.err.get_or_insert(e);
            }
            if before > 0 {
                if let Some(out) = self.outcome(&self.slots[index]) {
                    report(index, out);
                }
            }
        }
        self.remaining = self.remaining.saturating_sub(1);
        self.remaining == 0
    }

    /// Whether every part is answered.
    #[inline]
    pub fn is_done(&self) -> bool {
        self.remaining == 0
    }

    /// Each request's result (meaningful once done).
    pub fn results(&self) -> Vec<Result<(), E>> {
        self.slots
            .iter()
            .map(|s| match &s.err {
                Some(e) => Err(e.clone()),
                None => Ok(()),
            })
            .collect()
    }

    /// Marks request `index` for a retry with a fresh table.
    pub fn mark_stale(&mut self, index: usize) {
        if let Some(s) = self.slots.get_mut(index) {
            s.stale = true;
        }
    }

    /// The requests marked for a retry.
    pub fn stale(&self) -> Vec<usize> {
        self.slots
            .iter()
            .enumerate()
            .filter(|(_, s)| s.stale)
            .map(|(i, _)| i)
            .collect()
    }

    /// Starts the pass's clock: it expires `after` from `now`. Every
    /// sender calls it before its first frame (sending counts against the
    /// deadline); the first call fixes the deadline, the others get it.
    pub fn start_clock(&mut self, now: Time, after: Duration) -> Time {
        if cfg!(ferry_mutant = "deadline_per_slot") {
            // The planted bug: the deadline restarts with every frame.
            let d = now.after(after);
            self.deadline = Some(d);
            return d;
        }
        *self.deadline.get_or_insert_with(|| now.after(after))
    }

    /// When the pass expires, once its clock has started.
    #[inline]
    pub fn deadline(&self) -> Option<Time> {
        self.deadline
    }
}

/// What a batch does after a pass.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Then {
    /// Fetch the peer's table again, then send these requests once more
    /// (a failed fetch fails them).
    Retry(Vec<usize>),
    /// Send the notification, then finish.
    Notify,
    /// Finish with the outcomes as they are.
    Finish,
}

/// The order of a batch: see the module.
#[derive(Clone, Debug)]
pub struct Flow {
    notify: bool,
    retried: bool,
    notified: bool,
}

impl Flow {
    /// A batch, with a notification or not.
    pub fn new(notify: bool) -> Flow {
        Flow {
            notify,
            retried: false,
            notified: false,
        }
    }

    /// Whether the notification goes out at submission, before any data
    /// (never: the notification follows the data; true only for the
    /// planted bug `notify_before_data`).
    pub fn notify_at_submit(&mut self) -> bool {
        if cfg!(ferry_mutant = "notify_before_data") && self.notify && !self.notified {
            self.notified = true;
            return true;
        }
        false
    }

    /// Every answer of a pass is in: `stale` are the requests refused as
    /// stale (held back), `all_ok` whether every request reported
    /// succeeded.
    pub fn after_pass(&mut self, stale: Vec<usize>, all_ok: bool) -> Then {
        if !self.retried && !stale.is_empty() {
            self.retried = true;
            return Then::Retry(stale);
        }
        if self.notify && !self.notified && all_ok {
            self.notified = true;
            return Then::Notify;
        }
        Then::Finish
    }
}

#[cfg(all(
    test,
    not(any(
        ferry_mutant = "deadline_per_slot",
        ferry_mutant = "notify_before_data"
    ))
))]
mod tests {
    use super::*;

    fn req(read: bool, len: u64) -> Req {
        Req {
            read,
            len,
            remote: 0x1000,
            gen: 1,
        }
    }

    /// Plans into frames per connection.
    fn planned(reqs: &[Req], chunk: u64, conns: usize) -> (Plan, Vec<Vec<Frame<()>>>) {
        let mut per_conn = vec![Vec::new(); conns];
        let mut rr = 0;
        let p = plan(
            reqs.iter().map(|r| Some((*r, ()))),
            chunk,
            conns,
            || {
                rr += 1;
                rr
            },
            |c, f| per_conn[c].push(f),
        );
        (p, per_conn)
    }

    #[test]
    fn small_requests_are_gathered_and_large_ones_spread() {
        let reqs = [
            req(false, 10),
            req(false, 20),
            req(true, 5),
            req(false, 300),
        ];
        let (p, per_conn) = planned(&reqs, 100, 2);
        assert_eq!(p.counts, vec![1, 1, 1, 3]);
        assert_eq!(p.bytes, 335);
        let home: Vec<bool> = per_conn[0].iter().map(Frame::read).collect();
        // The gathered writes and the read are flushed before a chunk on
        // the home connection; the chunks alternate 1, 0, 1.
        assert!(matches!(per_conn[0][0], Frame::WriteV(ref ps) if ps.len() == 2));
        assert_eq!(home, vec![false, true, false]);
        assert_eq!(per_conn[1].len(), 2);
        let total: u64 = per_conn.iter().flatten().map(Frame::payload_len).sum();
        assert_eq!(total, 335);
    }

    #[test]
    fn a_gathered_frame_holds_at_most_512_segments() {
        let reqs = vec![req(false, 1); 1000];
        let (_, per_conn) = planned(&reqs, 1 << 20, 1);
        let sizes: Vec<usize> = per_conn[0].iter().map(|f| f.parts().len()).collect();
        assert_eq!(sizes, vec![512, 488]);
    }

    #[test]
    fn a_request_is_over_after_its_last_part_and_stale_ones_wait() {
        let mut r: Requests<&str> = Requests::new(3, true);
        let mut out = Vec::new();
        assert!(!r.arm(&[2, 0, 1], |i, x| out.push((i, x))));
        assert_eq!(out, vec![(1, Ok(()))]);
        assert!(!r.complete(0, Ok(()), |i, x| out.push((i, x))));
        r.mark_stale(2);
        assert!(!r.complete(2, Err("stale"), |i, x| out.push((i, x))));
        assert!(r.complete(0, Err("e"), |i, x| out.push((i, x))));
        assert_eq!(out, vec![(1, Ok(())), (0, Err("e"))]);
        assert_eq!(r.stale(), vec![2]);
    }

    #[test]
    fn the_deadline_is_set_once() {
        let mut r: Requests<()> = Requests::new(1, false);
        let d = r.start_clock(Time::from_nanos(10), Duration::from_nanos(5));
        let again = r.start_clock(Time::from_nanos(100), Duration::from_nanos(5));
        assert_eq!((d, again), (Time::from_nanos(15), Time::from_nanos(15)));
    }

    #[test]
    fn the_notification_follows_a_successful_batch_once() {
        let mut f = Flow::new(true);
        assert!(!f.notify_at_submit());
        assert_eq!(f.after_pass(vec![3], false), Then::Retry(vec![3]));
        assert_eq!(f.after_pass(vec![3], true), Then::Notify);
        assert_eq!(f.after_pass(vec![], true), Then::Finish);
        let mut f = Flow::new(true);
        assert_eq!(f.after_pass(vec![], false), Then::Finish);
    }
}

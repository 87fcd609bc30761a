//! The receiving side of one connection, without the reads: where the
//! next frame header stands, the bytes read past it, and the deadline of
//! the frame being read.
//!
//! The driver makes the system calls ([`RecvCursor::header_bufs`] lends
//! it the buffers of a header read, [`RecvCursor::header_tail`] the one a
//! payload read tops up) and tells the cursor what they returned; payload
//! bytes go straight from the socket into their destination and never pass
//! through here. The invariants, kept by every method:
//!
//! - `filled ≤ HEADER_LEN` bytes of the next header are in `hdr`;
//! - `ahead[pos..len]` are the bytes that come next on the stream, read
//!   past a header in the same call ([`RecvCursor::set_lookahead`]); they
//!   are non-empty only while no header bytes are buffered (`filled` is 0)
//!   or the header is being completed from them, so the stream's order is
//!   hdr, then ahead, then the socket;
//! - a frame's deadline is set once when its header has been read
//!   ([`RecvCursor::begin_frame`]) and holds for every read of it, in
//!   however many pieces.

use crate::frame::{CMA_SEGMENT_LEN, HEADER_LEN};
use crate::time::{Pace, Time};

/// Most bytes past a header read in the same call once the lookahead is
/// on: a CWRITE / CREAD header with a segment table of up to 16 segments.
pub const LOOKAHEAD: usize = 16 * CMA_SEGMENT_LEN;

/// See the module.
#[derive(Debug)]
pub struct RecvCursor {
    hdr: [u8; HEADER_LEN],
    filled: usize,
    ahead: Option<Box<[u8; LOOKAHEAD]>>,
    ahead_pos: usize,
    ahead_len: usize,
    pace: Pace,
    frame_deadline: Option<Time>,
}

impl RecvCursor {
    /// A cursor before the first header; `pace` bounds the reads of a
    /// frame.
    pub fn new(pace: Pace) -> RecvCursor {
        RecvCursor {
            hdr: [0; HEADER_LEN],
            filled: 0,
            ahead: None,
            ahead_pos: 0,
            ahead_len: 0,
            pace,
            frame_deadline: None,
        }
    }

    /// The pace reads of a frame must keep.
    #[inline]
    pub fn pace(&self) -> Pace {
        self.pace
    }

    /// Reads of a header also take up to [`LOOKAHEAD`] bytes past it
    /// (kept for the reads that follow).
    pub fn set_lookahead(&mut self) {
        if self.ahead.is_none() {
            self.ahead = Some(Box::new([0; LOOKAHEAD]));
        }
    }

    /// The bytes read past the last header that come next on the stream.
    #[inline]
    pub fn ahead(&self) -> &[u8] {
        match &self.ahead {
            Some(a) => &a[self.ahead_pos..self.ahead_len],
            None => &[],
        }
    }

    /// `n` bytes of [`RecvCursor::ahead`] were taken (`n` at most its
    /// length).
    #[inline]
    pub fn consume_ahead(&mut self, n: usize) {
        self.ahead_pos = (self.ahead_pos + n).min(self.ahead_len);
    }

    /// Moves lookahead bytes into the header; true once it is complete.
    #[inline]
    pub fn header_from_ahead(&mut self) -> bool {
        if let Some(ahead) = &self.ahead {
            let n = (self.ahead_len - self.ahead_pos).min(HEADER_LEN - self.filled);
            self.hdr[self.filled..self.filled + n]
                .copy_from_slice(&ahead[self.ahead_pos..self.ahead_pos + n]);
            self.ahead_pos += n;
            self.filled += n;
        }
        self.filled == HEADER_LEN
    }

    /// Whether some bytes of the next header are in (a header started).
    #[inline]
    pub fn header_started(&self) -> bool {
        self.filled > 0
    }

    /// Whether the next header is complete.
    #[inline]
    pub fn header_complete(&self) -> bool {
        self.filled == HEADER_LEN
    }

    /// The buffers of one read of the header: its missing bytes, then,
    /// when the lookahead is on and drained, the lookahead. Give the count
    /// the read returned to [`RecvCursor::account_header`] with the
    /// length of the first buffer.
    #[inline]
    pub fn header_bufs(&mut self) -> (&mut [u8], Option<&mut [u8]>) {
        let drained = self.ahead_pos == self.ahead_len;
        let ahead = match &mut self.ahead {
            Some(a) if drained => Some(&mut a[..]),
            _ => None,
        };
        (&mut self.hdr[self.filled..], ahead)
    }

    /// A read into [`RecvCursor::header_bufs`] (the first of length
    /// `want`) returned `n`.
    #[inline]
    pub fn account_header(&mut self, n: usize, want: usize) {
        if n > want {
            self.filled += want;
            self.ahead_pos = 0;
            self.ahead_len = (n - want).min(LOOKAHEAD);
        } else {
            self.filled += n;
        }
    }

    /// The header's missing bytes: what a read that ends a frame's payload
    /// may top up (see [`RecvCursor::account_topup`]).
    #[inline]
    pub fn header_tail(&mut self) -> &mut [u8] {
        &mut self.hdr[self.filled..]
    }

    /// A payload read brought `n` bytes past the payload into
    /// [`RecvCursor::header_tail`].
    #[inline]
    pub fn account_topup(&mut self, n: usize) {
        self.filled = (self.filled + n).min(HEADER_LEN);
    }

    /// Takes the complete header (see [`RecvCursor::header_complete`]):
    /// the next read starts the header after it.
    #[inline]
    pub fn take_header(&mut self) -> [u8; HEADER_LEN] {
        self.filled = 0;
        self.hdr
    }

    /// No frame is being read (a header is awaited): no frame deadline.
    #[inline]
    pub fn end_frame(&mut self) {
        self.frame_deadline = None;
    }

    /// The frame whose header was just taken has `bytes` more (after the
    /// header), all due by one deadline from `now`, however they are read.
    #[inline]
    pub fn begin_frame(&mut self, now: Time, bytes: u64) {
        self.frame_deadline = Some(self.pace.deadline(now, bytes));
    }

    /// The deadline of a read of `bytes` at `now()`: the frame's, or (for
    /// a read outside a begun frame) one of its own (the only case that
    /// asks the clock).
    #[inline]
    pub fn read_deadline(&self, now: impl FnOnce() -> Time, bytes: u64) -> Time {
        self.frame_deadline
            .unwrap_or_else(|| self.pace.deadline(now(), bytes))
    }
}

/// Where a read of several ranges stands: range `idx`, `off` bytes in.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Progress {
    /// The range being filled (the count of ranges once all are).
    pub idx: usize,
    /// Bytes of it already filled.
    pub off: usize,
}

impl Progress {
    /// Skips ranges that are full; true once every one of `count` ranges
    /// (of lengths `len(i)`) is.
    #[inline]
    pub fn settle(&mut self, count: usize, len: impl Fn(usize) -> usize) -> bool {
        while self.idx < count && self.off >= len(self.idx) {
            self.idx += 1;
            self.off = 0;
        }
        self.idx == count
    }

    /// `n` bytes were read from here on, across the ranges; returns how
    /// many went past the last one (the header top-up).
    #[inline]
    pub fn advance(&mut self, count: usize, len: impl Fn(usize) -> usize, n: usize) -> usize {
        let mut left = n;
        while left > 0 && self.idx < count {
            let avail = len(self.idx) - self.off;
            if left >= avail {
                left -= avail;
                self.idx += 1;
                self.off = 0;
            } else {
                self.off += left;
                left = 0;
            }
        }
        left
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// A stream of frames (a header of its index, then a body) read
    /// through the cursor by a model of the driver that gets at most the
    /// chunk sizes `cuts` allows per read, as a socket may: headers and
    /// bodies come out whole and in order, with and without lookahead, the
    /// bodies read in one or two pieces, the last one topping up the next
    /// header.
    fn replay(bodies: &[usize], cuts: &[usize], lookahead: bool, split: bool) {
        let mut wire = Vec::new();
        for (i, &n) in bodies.iter().enumerate() {
            wire.extend(std::iter::repeat_n(i as u8, HEADER_LEN));
            wire.extend((0..n).map(|j| (j as u8).wrapping_mul(31).wrapping_add(i as u8)));
        }
        let mut at = 0usize;
        let mut cut = 0usize;
        // One "recvmsg" of the wire into `bufs` in order, at most the next
        // cut's bytes.
        let mut read = |bufs: &mut [&mut [u8]]| -> usize {
            let mut allowed = cuts[cut % cuts.len()].max(1);
            cut += 1;
            let mut n = 0;
            for b in bufs.iter_mut() {
                let k = b.len().min(allowed).min(wire.len() - at);
                b[..k].copy_from_slice(&wire[at..at + k]);
                at += k;
                n += k;
                allowed -= k;
                if k < b.len() {
                    break;
                }
            }
            n
        };
        let mut cur = RecvCursor::new(Pace::stall_only(core::time::Duration::from_secs(1)));
        if lookahead {
            cur.set_lookahead();
        }
        for (i, &n) in bodies.iter().enumerate() {
            cur.end_frame();
            while !cur.header_from_ahead() {
                let (tail, ahead) = cur.header_bufs();
                let want = tail.len();
                let got = match ahead {
                    Some(a) => read(&mut [tail, a]),
                    None => read(&mut [tail]),
                };
                assert!(got > 0, "header {i}: the wire ran dry");
                cur.account_header(got, want);
            }
            assert_eq!(cur.take_header(), [i as u8; HEADER_LEN], "header {i}");
            cur.begin_frame(Time::ZERO, n as u64);
            let mut body = vec![0u8; n];
            let pieces: Vec<(usize, usize)> = if split && n > 1 {
                vec![(0, n / 2), (n / 2, n)]
            } else {
                vec![(0, n)]
            };
            let last = pieces.len() - 1;
            for (k, (from, to)) in pieces.into_iter().enumerate() {
                let seg = &mut body[from..to];
                let topup = k == last;
                let mut p = Progress::default();
                let len = seg.len();
                while !p.settle(1, |_| len) {
                    let ahead = cur.ahead();
                    let take = ahead.len().min(len - p.off);
                    if take > 0 {
                        seg[p.off..p.off + take].copy_from_slice(&ahead[..take]);
                        cur.consume_ahead(take);
                        p.off += take;
                        continue;
                    }
                    let got = if topup {
                        read(&mut [&mut seg[p.off..], cur.header_tail()])
                    } else {
                        read(&mut [&mut seg[p.off..]])
                    };
                    assert!(got > 0, "body {i}: the wire ran dry");
                    let past = p.advance(1, |_| len, got);
                    assert!(topup || past == 0);
                    cur.account_topup(past);
                }
            }
            let want: Vec<u8> = (0..n)
                .map(|j| (j as u8).wrapping_mul(31).wrapping_add(i as u8))
                .collect();
            assert_eq!(body, want, "body {i}");
        }
        assert!(!cur.header_started() && cur.ahead().is_empty() && at == wire.len());
    }

    #[test]
    fn frames_come_out_whole_and_in_order() {
        let bodies = [
            24,
            0,
            LOOKAHEAD - HEADER_LEN,
            LOOKAHEAD,
            3 * LOOKAHEAD + 5,
            7,
        ];
        for lookahead in [false, true] {
            for split in [false, true] {
                replay(&bodies, &[usize::MAX], lookahead, split);
                replay(&bodies, &[1], lookahead, split);
                replay(&bodies, &[5, 31, 33, 1000], lookahead, split);
            }
        }
    }

    proptest! {
        #[test]
        fn any_cutting_of_the_stream_reads_the_same(
            bodies in prop::collection::vec(0usize..3 * LOOKAHEAD, 1..12),
            cuts in prop::collection::vec(1usize..2 * LOOKAHEAD, 1..16),
            lookahead: bool,
            split: bool,
        ) {
            replay(&bodies, &cuts, lookahead, split);
        }
    }

    #[test]
    fn a_frame_has_one_deadline_however_it_is_read() {
        let pace = Pace {
            stall: core::time::Duration::from_secs(1),
            min_rate: 1000,
        };
        let mut cur = RecvCursor::new(pace);
        let t0 = Time::from_nanos(5);
        // Outside a frame each read has its own.
        let later = t0.after(core::time::Duration::from_secs(3));
        assert_eq!(cur.read_deadline(|| later, 0), pace.deadline(later, 0));
        cur.begin_frame(t0, 2000);
        let d = pace.deadline(t0, 2000);
        assert_eq!(
            cur.read_deadline(|| panic!("no clock read in a frame"), 10),
            d,
            "not restarted by a later read"
        );
        cur.end_frame();
        assert_eq!(cur.read_deadline(|| later, 0), pace.deadline(later, 0));
    }
}

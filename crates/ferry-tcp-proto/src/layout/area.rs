//! The staging area of a same-host connection (ferry-tcp's
//! `same_host::stage` maps it and runs the rings): a control page, then
//! two rings of [`SLOTS`] slots of [`SLOT`] bytes, one per direction
//! (initiator → target first), then optionally a grants page
//! ([`super::grants`]). The control page holds the four ring counters at
//! offsets 0, 64, 128 and 192 (each with its sleeper flag 8 bytes after
//! it), the acknowledgement lane and [`TARGET_SLEPT`].
//!
//! Under `--cfg ferry_loom` (the model checker of the ring and lane code)
//! the rings and the lane are shorter: a smaller state space.

use crate::frame::MAX_SEGMENTS;

/// Bytes per slot.
pub const SLOT: usize = 64 << 10;
/// Slots per ring (one ring per direction).
#[cfg(not(ferry_loom))]
pub const SLOTS: u64 = 4;
/// Slots per ring, fewer for the model checker (a smaller state space).
#[cfg(ferry_loom)]
pub const SLOTS: u64 = 2;
/// Bytes one ring holds: a stream no longer than this is copied in
/// without waiting for the other side.
pub const RING_BYTES: usize = SLOTS as usize * SLOT;
/// The control page: the four counters, each on its own cache line.
pub const CONTROL: usize = 4096;
/// Size of the shared area.
pub const AREA_LEN: usize = CONTROL + 2 * SLOTS as usize * SLOT;
/// Entries of the acknowledgement lane (in the control page).
#[cfg(not(ferry_loom))]
pub const ACKS: u64 = 256;
/// Entries of the lane, fewer for the model checker.
#[cfg(ferry_loom)]
pub const ACKS: u64 = 2;
/// Offset in the control page of the lane's `head` (acknowledgements the
/// target has posted).
pub const ACK_HEAD: usize = 256;
/// Offset in the control page of the lane's `tail` (acknowledgements the
/// initiator has taken).
pub const ACK_TAIL: usize = 320;
/// Offset in the control page of the initiator's `polling` flag.
pub const ACK_POLLING: usize = 384;
/// Offset in the control page of the lane's ring of request ids
/// ([`ACKS`] u64 entries).
pub const ACK_RING: usize = 2048;
/// Offset in the control page of the target's count of its waits that
/// slept (ferry-tcp's `Area::target_slept`).
pub const TARGET_SLEPT: usize = 448;

// The lane's ring fits in the control page.
const _: () = assert!(ACK_RING + 8 * ACKS as usize <= CONTROL);

/// Bytes of an SREAD's verdict (one bit per segment).
pub const VERDICT_LEN: usize = MAX_SEGMENTS as usize / 8;

/// Encodes the verdict slot of an SREAD: bit `i` set when segment `i` was
/// refused.
pub fn verdict(refused: impl Iterator<Item = usize>) -> [u8; VERDICT_LEN] {
    let mut v = [0u8; VERDICT_LEN];
    for i in refused {
        if i < MAX_SEGMENTS as usize {
            v[i / 8] |= 1 << (i % 8);
        }
    }
    v
}

/// Whether segment `i` is refused in a verdict.
#[inline]
pub fn refused(v: &[u8; VERDICT_LEN], i: usize) -> bool {
    i < MAX_SEGMENTS as usize && v[i / 8] & (1 << (i % 8)) != 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn verdicts_name_the_refused_segments() {
        let v = verdict([0, 9, 511, 512].into_iter());
        assert!(refused(&v, 0) && refused(&v, 9) && refused(&v, 511));
        assert!(!refused(&v, 1) && !refused(&v, 8) && !refused(&v, 512));
    }

    #[test]
    fn the_control_page_fields_do_not_overlap() {
        // The four ring counters and their flags take 0..256.
        let words = [ACK_HEAD, ACK_TAIL, ACK_POLLING, TARGET_SLEPT];
        for (i, a) in words.iter().enumerate() {
            assert!(*a >= 256 && a % 64 == 0 && a + 8 <= ACK_RING);
            assert!(words[i + 1..].iter().all(|b| b.abs_diff(*a) >= 64));
        }
        assert_eq!(AREA_LEN, CONTROL + 2 * RING_BYTES);
    }
}

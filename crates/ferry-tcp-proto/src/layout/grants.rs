//! The grants page a staging area may carry after its rings (feature
//! [`crate::negotiate::GRANTS`]; ferry-tcp's `same_host::grant` writes,
//! reads and model-checks it): the target's PID, probe word and nonce, the
//! page's version, the initiator's [`MARKS`] marks and copy counters, and
//! [`ENTRIES`] grants `(generation, address, length)`, one per region; a
//! generation of 0 is no grant.

/// Bytes of the grants page appended to a staging area.
pub const GRANTS_LEN: usize = 64 << 10;
/// Offset in the page of the target's PID.
pub const PID: usize = 0;
/// Offset in the page of the address of the target's probe word.
pub const PROBE: usize = 8;
/// Offset in the page of the nonce the probe word holds.
pub const NONCE: usize = 16;
/// Offset in the page of its version (bumped after every change of the
/// entries).
pub const VERSION: usize = 24;
/// Offset in the page of the count of entries in use (an upper bound).
pub const USED: usize = 32;
/// Offset in the page of the initiator's marks, one word each.
pub const MARKS_AT: usize = 64;
/// Marks per area: copies one initiator process may have in progress on
/// one connection at once (more wait their turn as frames).
pub const MARKS: usize = 16;
/// Offset in the page of what the initiator copied: bytes written,
/// segments written, bytes read, segments read (four words).
pub const COUNTERS_AT: usize = 256;
/// Offset in the page of the entries.
pub const ENTRIES_AT: usize = 1024;
/// Bytes of one entry: generation, address, length (and a spare word).
pub const ENTRY: usize = 32;
/// Entries of a page: regions a target can grant (the rest are served as
/// frames).
pub const ENTRIES: usize = (GRANTS_LEN - ENTRIES_AT) / ENTRY;

// The marks, the counters and the entries do not overlap.
const _: () = assert!(MARKS_AT + 8 * MARKS <= COUNTERS_AT && COUNTERS_AT + 4 * 8 <= ENTRIES_AT);

/// The value of a mark naming entry `idx` at generation `gen`.
#[inline]
pub fn mark_value(idx: usize, gen: u32) -> u64 {
    ((idx as u64 + 1) << 32) | u64::from(gen)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn marks_name_an_entry_and_a_generation() {
        assert_ne!(mark_value(0, 1), mark_value(1, 1));
        assert_ne!(mark_value(0, 1), mark_value(0, 2));
        assert_ne!(
            mark_value(0, 1),
            0,
            "a mark of entry 0 is never a cleared mark"
        );
        assert_eq!(mark_value(ENTRIES - 1, u32::MAX) >> 32, ENTRIES as u64);
    }

    #[test]
    fn the_page_fields_do_not_overlap() {
        for w in [PID, PROBE, NONCE, VERSION, USED] {
            assert!(w % 8 == 0 && w + 8 <= MARKS_AT);
        }
        assert_eq!(ENTRIES_AT + ENTRIES * ENTRY, GRANTS_LEN);
    }
}

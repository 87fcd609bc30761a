//! Fuzzing by property of every decoder that takes a peer's bytes: on
//! arbitrary input each one returns a value or a typed error, never
//! panics, and what it accepts keeps the protocol's limits (the frame
//! decoders' own unit property covers the fixed headers; this adds the
//! segment tables of every kind, the same-host offer and the header
//! decoder on inputs shaped like real frames, with lengths and counts at
//! and around their bounds).

use ferry_tcp::test_support::cma::{Offer, OFFER_LEN};
use ferry_tcp::test_support::frame::{
    decode_cma_segments, decode_ids, decode_segments, decode_table, Header, Request, Response,
    CMA_SEGMENT_LEN, HEADER_LEN, MAX_OP_LEN, MAX_SEGMENTS, SEGMENT_LEN,
};
use proptest::prelude::*;

/// Bytes of a segment table: `n` entries of `entry` bytes (often a valid
/// count, sometimes one off), each field drawn near interesting values.
fn table(entry: usize) -> impl Strategy<Value = Vec<u8>> {
    let field = prop_oneof![
        Just(0u64),
        Just(1u64),
        Just(u64::MAX),
        Just(MAX_OP_LEN),
        Just(MAX_OP_LEN + 1),
        any::<u64>()
    ];
    (
        0..=MAX_SEGMENTS as usize + 1,
        proptest::collection::vec(field, 1..64),
    )
        .prop_map(move |(n, fields)| {
            let mut out = Vec::with_capacity(n * entry);
            let mut f = fields.into_iter().cycle();
            while out.len() < n * entry {
                out.extend_from_slice(&f.next().unwrap_or(7).to_le_bytes());
            }
            out.truncate(n * entry);
            out
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    /// WRITEV/READV and CWRITE/CREAD tables: accepted ones have 1..=MAX
    /// segments of non-zero length whose lengths add up to `total`, with
    /// no range wrapping the address space.
    #[test]
    fn segment_tables(raw in table(SEGMENT_LEN), craw in table(CMA_SEGMENT_LEN), total in prop_oneof![any::<u64>(), 0..=MAX_OP_LEN]) {
        if let Ok(segs) = decode_segments(&raw, total) {
            prop_assert!((1..=MAX_SEGMENTS as usize).contains(&segs.len()));
            prop_assert_eq!(segs.iter().map(|s| s.len).sum::<u64>(), total);
            prop_assert!(segs.iter().all(|s| s.len > 0 && s.addr.checked_add(s.len).is_some()));
        }
        if let Ok(segs) = decode_cma_segments(&craw, total) {
            prop_assert!((1..=MAX_SEGMENTS as usize).contains(&segs.len()));
            prop_assert_eq!(segs.iter().map(|s| s.seg.len).sum::<u64>(), total);
            prop_assert!(segs.iter().all(|s| s.seg.len > 0 && s.seg.addr.checked_add(s.seg.len).is_some()));
        }
        // Tables of the wrong entry size, and region tables, from the same bytes.
        let _ = decode_segments(&craw, total);
        let _ = decode_cma_segments(&raw, total);
        let _ = decode_table(&raw);
        let _ = decode_ids(&craw).count();
    }

    /// Any offer decodes (the target checks each field against the
    /// system) and encodes back to its bytes.
    #[test]
    fn offers(bytes in proptest::collection::vec(any::<u8>(), OFFER_LEN)) {
        let mut raw = [0u8; OFFER_LEN];
        raw.copy_from_slice(&bytes);
        let offer = Offer::decode(&raw);
        prop_assert_eq!(offer.encode(), raw);
    }

    /// Headers with a real frame kind in front and arbitrary fields: the
    /// three header decoders agree on what they accept and never panic.
    #[test]
    fn headers(kind in any::<u8>(), rest in proptest::collection::vec(any::<u8>(), HEADER_LEN - 1)) {
        let mut hdr = [0u8; HEADER_LEN];
        hdr[0] = kind;
        hdr[1..].copy_from_slice(&rest);
        let raw = Header::decode(&hdr);
        if Request::decode(&hdr).is_ok() || Response::decode(&hdr).is_ok() {
            prop_assert!(raw.is_ok(), "a frame accepted whose header is not");
        }
    }
}

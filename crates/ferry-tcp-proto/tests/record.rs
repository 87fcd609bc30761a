//! The TLS record layer's core without sockets or crypto: a stream sealed
//! by [`Writer`] comes out whole through [`Reader`] whatever the cutting
//! (of the plaintext into writes, of the ciphertext into reads, of the
//! destination into ranges), across key updates; hostile bytes give typed
//! errors and never a panic.
//!
//! The AEAD here is a **double** (`ToyAead`: a keystream and a keyed
//! checksum tag, no security): ring's real one is exercised by the
//! driver's tests in ferry-tcp (`src/tls/tests.rs`); the double lets these
//! tests check that each byte is opened with the right nonce, key and
//! header, and that a changed byte is refused.

use ferry_tcp_proto::record::{
    header, record_len, runs, seal_planned, Aead, Message, Planned, Reader, RecordError, Step,
    Writer, BIG, HEADER_LEN, MAX_PLAINTEXT, MAX_RECORD, NONCE_LEN, OVERHEAD, SHORT_TAIL, TAG_LEN,
};
use proptest::prelude::*;

/// Keystream and tag from (key, nonce): a toy, see the module comment.
#[derive(Clone)]
struct ToyAead {
    key: u64,
}

fn mix(mut x: u64) -> u64 {
    x ^= x >> 33;
    x = x.wrapping_mul(0xff51_afd7_ed55_8ccd);
    x ^= x >> 33;
    x = x.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    x ^ (x >> 33)
}

impl ToyAead {
    fn seed(&self, nonce: &[u8; NONCE_LEN]) -> u64 {
        nonce
            .iter()
            .fold(self.key, |h, &b| mix(h ^ u64::from(b)).wrapping_add(1))
    }

    fn ks(seed: u64, i: usize) -> u8 {
        (mix(seed ^ (i as u64 / 8)) >> ((i % 8) * 8)) as u8
    }

    fn tag(&self, seed: u64, aad: &[u8; HEADER_LEN], ct: &[u8]) -> [u8; TAG_LEN] {
        let mut h = mix(seed ^ 0xabcdef);
        for &b in aad.iter().chain(ct) {
            h = mix(h ^ u64::from(b));
        }
        let mut t = [0u8; TAG_LEN];
        t[..8].copy_from_slice(&h.to_le_bytes());
        t[8..].copy_from_slice(&mix(h).to_le_bytes());
        t
    }
}

impl Aead for ToyAead {
    fn open_within(
        &mut self,
        nonce: [u8; NONCE_LEN],
        aad: [u8; HEADER_LEN],
        in_out: &mut [u8],
        src: usize,
    ) -> Option<usize> {
        let clen = in_out.len().checked_sub(src + TAG_LEN)?;
        let seed = self.seed(&nonce);
        let (ct, tag) = in_out[src..].split_at(clen);
        if self.tag(seed, &aad, ct) != tag {
            return None;
        }
        // Front to back: each write lands at or before what is read next.
        for i in 0..clen {
            in_out[i] = in_out[src + i] ^ Self::ks(seed, i);
        }
        Some(clen)
    }

    fn seal(
        &mut self,
        nonce: [u8; NONCE_LEN],
        aad: [u8; HEADER_LEN],
        in_out: &mut [u8],
    ) -> Option<[u8; TAG_LEN]> {
        let seed = self.seed(&nonce);
        for (i, b) in in_out.iter_mut().enumerate() {
            *b ^= Self::ks(seed, i);
        }
        Some(self.tag(seed, &aad, in_out))
    }
}

fn iv(k: u64) -> [u8; NONCE_LEN] {
    let mut v = [0u8; NONCE_LEN];
    v[4..].copy_from_slice(&mix(k).to_le_bytes());
    v
}

/// The wire of `writes` (each a list of ranges), with a key update after
/// every `update_every` records (and a session ticket first, as an older
/// Ferry target sends).
fn seal_stream(writes: &[Vec<Vec<u8>>], update_every: u64, ticket: bool) -> Vec<u8> {
    let mut w = Writer::new(iv(0), 0);
    w.limit = update_every;
    let mut aead = ToyAead { key: 0 };
    let mut gen = 0;
    let mut wire = Vec::new();
    let mut rec = vec![0u8; MAX_PLAINTEXT + OVERHEAD];
    if ticket {
        let body = [4u8, 0, 0, 3, 9, 9, 9];
        rec[HEADER_LEN..HEADER_LEN + body.len()].copy_from_slice(&body);
        let n = w.seal(&mut rec, body.len(), 22, &mut aead).unwrap();
        wire.extend_from_slice(&rec[..n]);
    }
    for bufs in writes {
        let (mut i, mut off) = (0, 0);
        loop {
            let l = record_len(bufs[i.min(bufs.len())..].iter().enumerate().map(|(k, b)| {
                if k == 0 {
                    b.len() - off
                } else {
                    b.len()
                }
            }));
            if l == 0 {
                break;
            }
            let mut at = HEADER_LEN;
            let mut left = l;
            while left > 0 {
                if off == bufs[i].len() {
                    (i, off) = (i + 1, 0);
                    continue;
                }
                let k = left.min(bufs[i].len() - off);
                rec[at..at + k].copy_from_slice(&bufs[i][off..off + k]);
                (at, off, left) = (at + k, off + k, left - k);
            }
            let n = w.seal(&mut rec, l, 23, &mut aead).unwrap();
            wire.extend_from_slice(&rec[..n]);
            if w.key_update_due() {
                let n = w
                    .seal_key_update(&mut rec, gen % 2 == 0, &mut aead)
                    .unwrap();
                wire.extend_from_slice(&rec[..n]);
                gen += 1;
                aead = ToyAead { key: gen };
                w.set_key(iv(gen));
            }
        }
    }
    let n = w.seal_close_notify(&mut rec, &mut aead).unwrap();
    wire.extend_from_slice(&rec[..n]);
    wire
}

/// Reads `total` plaintext bytes from `wire` into destinations cut by
/// `dsts` (cycled), the socket giving at most `chunks` (cycled) bytes per
/// read. Returns the plaintext and the key updates that were requested.
fn read_stream(
    wire: &[u8],
    total: usize,
    dsts: &[usize],
    chunks: &[usize],
) -> Result<(Vec<u8>, usize), RecordError> {
    let mut out = vec![0u8; total];
    let mut r = Reader::new(iv(0), 0, Vec::new());
    let mut aead = ToyAead { key: 0 };
    let (mut gen, mut requested) = (0, 0);
    let (mut pos, mut at, mut di, mut ci) = (0usize, 0usize, 0usize, 0usize);
    let mut closed = false;
    while at < total && !closed {
        let len = dsts[di % dsts.len()].max(1).min(total - at);
        di += 1;
        let mut off = 0;
        while off < len {
            let dst = &mut out[at + off..at + len];
            match r.step(dst, &mut aead)? {
                Step::Delivered(n) => {
                    assert!(n > 0, "no progress");
                    off += n;
                }
                Step::Message => match r.take_message() {
                    Some(Message::KeyUpdate { requested: q }) => {
                        gen += 1;
                        aead = ToyAead { key: gen };
                        r.set_key(iv(gen));
                        requested += usize::from(q);
                    }
                    Some(Message::NewSessionTicket(b)) => assert_eq!(b, [9, 9, 9]),
                    None => panic!("no message"),
                },
                Step::Closed => {
                    closed = true;
                    break;
                }
                Step::Read { dst: d, bounce: b } => {
                    let c = chunks[ci % chunks.len()].max(1);
                    ci += 1;
                    let n = c.min(d.len() + b.len()).min(wire.len() - pos);
                    let nd = n.min(d.len());
                    dst[d.start..d.start + nd].copy_from_slice(&wire[pos..pos + nd]);
                    let bounce = &mut r.bounce_mut()[b.clone()];
                    bounce[..n - nd].copy_from_slice(&wire[pos + nd..pos + n]);
                    pos += n;
                    r.received(n);
                }
            }
        }
        at += off;
    }
    out.truncate(at);
    Ok((out, requested))
}

fn data(len: usize, seed: u64) -> Vec<u8> {
    (0..len).map(|i| mix(seed ^ i as u64) as u8).collect()
}

const SIZES: &[usize] = &[
    1,
    5,
    17,
    24,
    32,
    33,
    1000,
    BIG - 1,
    BIG,
    16 << 10,
    16_416,
    70_000,
];

fn writes_of(lens: &[usize], seed: u64) -> (Vec<Vec<Vec<u8>>>, Vec<u8>) {
    let mut writes = Vec::new();
    let mut all = Vec::new();
    for (k, group) in lens.chunks(3).enumerate() {
        let bufs: Vec<Vec<u8>> = group
            .iter()
            .enumerate()
            .map(|(j, &l)| data(l, seed ^ (k * 31 + j) as u64))
            .collect();
        for b in &bufs {
            all.extend_from_slice(b);
        }
        writes.push(bufs);
    }
    (writes, all)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(96))]

    /// Any cutting of writes, reads and destinations; key updates every
    /// few records; a ticket first; close_notify at the end.
    #[test]
    fn the_stream_comes_out_whole(
        lens in prop::collection::vec(prop::sample::select(SIZES), 1..12),
        dsts in prop::collection::vec(
            prop_oneof![1usize..64, 8000usize..20_000, 60_000usize..400_000], 1..6),
        chunks in prop::collection::vec(prop_oneof![1usize..40, 1000usize..300_000], 1..6),
        every in 1u64..12,
        seed in any::<u64>(),
    ) {
        let (writes, all) = writes_of(&lens, seed);
        let wire = seal_stream(&writes, every, true);
        let (got, _) = read_stream(&wire, all.len(), &dsts, &chunks).unwrap();
        prop_assert!(got == all);
        // And the end of the stream reads as closed.
    }

    /// Hostile bytes in place of records: a typed error or a wait for
    /// more, never a panic and never plaintext.
    #[test]
    fn hostile_bytes_give_typed_errors(
        wire in prop::collection::vec(any::<u8>(), 0..3000),
        dst in prop_oneof![1usize..64, 9000usize..40_000],
        chunk in 1usize..4000,
    ) {
        let r = read_stream(&wire, 50_000, &[dst], &[chunk]);
        if let Ok((got, _)) = r { prop_assert!(got.is_empty()); }
    }

    /// A valid stream with one byte changed: an error, and no plaintext
    /// of the changed record or after it.
    #[test]
    fn a_changed_byte_is_refused(
        lens in prop::collection::vec(prop::sample::select(SIZES), 1..6),
        dst in prop_oneof![1usize..64, 9000usize..40_000, 100_000usize..300_000],
        chunk in prop_oneof![1usize..64, 1000usize..300_000],
        at in any::<prop::sample::Index>(),
        bit in 0u8..8,
        seed in any::<u64>(),
    ) {
        let (writes, all) = writes_of(&lens, seed);
        let mut wire = seal_stream(&writes, 1000, false);
        let k = at.index(wire.len());
        wire[k] ^= 1 << bit;
        match read_stream(&wire, all.len(), &[dst], &[chunk]) {
            Err(_) => {}
            Ok((got, _)) => {
                // A flipped bit in the last record (close_notify) can only
                // cut the stream short; nothing wrong is delivered.
                prop_assert!(all.starts_with(&got));
                prop_assert!(got.len() < all.len() || k >= wire.len() - 24);
            }
        }
    }

    /// Records never exceed 2^14 bytes, a large range gets records of its
    /// own ending with a short one, small ranges share.
    #[test]
    fn record_cutting_follows_the_ranges(
        lens in prop::collection::vec(prop::sample::select(SIZES), 1..10),
    ) {
        let mut rest = lens.clone();
        let mut bounds = Vec::new();
        let mut pos = 0;
        loop {
            let l = record_len(rest.iter().copied());
            if l == 0 { break; }
            prop_assert!(l <= MAX_PLAINTEXT);
            pos += l;
            bounds.push(pos);
            let mut left = l;
            for r in rest.iter_mut() {
                let k = left.min(*r);
                *r -= k;
                left -= k;
            }
            rest.retain(|&r| r > 0);
        }
        prop_assert_eq!(pos, lens.iter().sum::<usize>());
        let mut start = 0;
        for &l in &lens {
            if l >= BIG {
                // A record ends where the large range starts and where it
                // ends, and the one before its end is SHORT_TAIL long.
                prop_assert!(start == 0 || bounds.contains(&start));
                prop_assert!(bounds.contains(&(start + l - SHORT_TAIL)));
            }
            start += l;
        }
    }
}

#[test]
fn key_updates_are_requested_and_answered() {
    let (writes, all) = writes_of(&[70_000, 70_000, 5], 3);
    let wire = seal_stream(&writes, 2, false);
    let (got, requested) = read_stream(&wire, all.len(), &[100_000], &[1 << 20]).unwrap();
    assert!(got == all);
    assert!(requested >= 2, "{requested}");
}

/// One record of `content` with inner type `typ`, under key 0 / seq 0.
fn one_record(content: &[u8], typ: u8) -> Vec<u8> {
    let mut w = Writer::new(iv(0), 0);
    let mut rec = vec![0u8; MAX_PLAINTEXT + OVERHEAD];
    rec[HEADER_LEN..HEADER_LEN + content.len()].copy_from_slice(content);
    let n = w
        .seal(&mut rec, content.len(), typ, &mut ToyAead { key: 0 })
        .unwrap();
    rec.truncate(n);
    rec
}

fn first_error(wire: &[u8]) -> RecordError {
    read_stream(wire, 1000, &[100], &[1 << 20]).unwrap_err()
}

#[test]
fn hostile_records_give_the_error_that_names_them() {
    let mut w = one_record(b"x", 23);
    w[0] = 22;
    assert!(matches!(
        first_error(&w),
        RecordError::BadHeader { typ: 22, .. }
    ));
    let mut w = one_record(b"x", 23);
    w[2] = 1;
    assert!(matches!(
        first_error(&w),
        RecordError::BadHeader {
            version: 0x0301,
            ..
        }
    ));
    for len in [0usize, 16, (1 << 14) + 257, 65535] {
        let mut w = header(len).to_vec();
        w.resize(len + 5, 0);
        assert_eq!(first_error(&w), RecordError::BadLength(len));
    }
    // Zeros only inside: no content type.
    let mut w = one_record(&[0, 0, 0], 0);
    assert_eq!(first_error(&w), RecordError::NoContentType);
    w = one_record(b"??", 20);
    assert_eq!(first_error(&w), RecordError::UnexpectedContentType(20));
    w = one_record(&[2, 42], 21);
    assert_eq!(first_error(&w), RecordError::Alert(42));
    w = one_record(&[2], 21);
    assert_eq!(first_error(&w), RecordError::BadAlert);
    w = one_record(&[24, 0, 0, 1, 0, 24, 0, 0, 1, 0], 22);
    assert!(matches!(first_error(&w), RecordError::BadHandshake(_)));
    w = one_record(&[24, 0, 0, 1, 7], 22);
    assert!(matches!(first_error(&w), RecordError::BadHandshake(_)));
    w = one_record(&[13, 0, 0, 0], 22);
    assert!(matches!(first_error(&w), RecordError::BadHandshake(_)));
    // Padding after the type byte is stripped.
    let w = one_record(&[b'h', b'i', 23, 0, 0, 0], 0);
    let (got, _) = read_stream(&w, 2, &[10], &[100]).unwrap();
    assert_eq!(got, b"hi");
}

#[test]
fn a_half_received_record_must_be_finished_in_the_same_destination() {
    let payload = data(12_000, 1);
    let wire = seal_stream(&[vec![payload]], 1000, false);
    let mut r = Reader::new(iv(0), 0, Vec::new());
    let mut aead = ToyAead { key: 0 };
    let mut mem = vec![0u8; 40_000];
    let (a, b) = mem.split_at_mut(20_000);
    // Header first (a small destination reads through the bounce buffer).
    let Step::Read { dst, bounce } = r.step(&mut a[..24], &mut aead).unwrap() else {
        panic!()
    };
    assert!(dst.is_empty());
    r.bounce_mut()[bounce.start..bounce.start + 5].copy_from_slice(&wire[..5]);
    r.received(5);
    // Now a large destination: the record goes there, half of it arrives.
    let Step::Read { dst, .. } = r.step(&mut a[..], &mut aead).unwrap() else {
        panic!()
    };
    assert_eq!(dst.start, 0);
    a[..6000].copy_from_slice(&wire[5..6005]);
    r.received(6000);
    assert_eq!(
        r.step(&mut b[..], &mut aead),
        Err(RecordError::WrongDestination)
    );
    assert_eq!(
        r.step(&mut a[..100], &mut aead),
        Err(RecordError::WrongDestination)
    );
}

/// [`seal_stream`] without the ticket, the way the driver sends: each
/// write planned ([`Writer::plan`]) into a send buffer of `room` bytes
/// (a record starts before `room`), the records of each plan sealed in the
/// order `order` permutes them (as several threads would), the buffer
/// emptied between plans.
fn seal_stream_planned(
    writes: &[Vec<Vec<u8>>],
    update_every: u64,
    room: usize,
    order: &[usize],
) -> Vec<u8> {
    let mut w = Writer::new(iv(0), 0);
    w.limit = update_every;
    let mut aead = ToyAead { key: 0 };
    let mut gen = 0;
    let mut wire = Vec::new();
    let mut buf = vec![0u8; room + MAX_RECORD];
    for bufs in writes {
        let all: Vec<u8> = bufs.concat();
        let mut taken = 0;
        loop {
            // What is left of the write's ranges.
            let mut lens = Vec::new();
            let mut skip = taken;
            for b in bufs {
                let k = skip.min(b.len());
                skip -= k;
                if b.len() > k {
                    lens.push(b.len() - k);
                }
            }
            let mut recs: Vec<Planned> = Vec::new();
            let start = order.first().map_or(0, |&o| o % 7).min(room - 1);
            let got = w.plan(&lens, start, room, &mut recs).unwrap();
            // Laid one after another from `start`, each starting before
            // `room`, taking the plaintext in order.
            let (mut at, mut src) = (start, 0);
            for r in &recs {
                assert_eq!((r.at, r.src), (at, src), "{recs:?}");
                assert!(r.at < room && r.len > 0 && r.len <= MAX_PLAINTEXT);
                (at, src) = (r.end(), src + r.len);
            }
            assert_eq!(src, got);
            // Sealed in any order, each from its own plaintext.
            let mut idx: Vec<usize> = (0..recs.len()).collect();
            for (k, &o) in order.iter().enumerate() {
                if idx.len() > 1 {
                    let a = k % idx.len();
                    let b = o % idx.len();
                    idx.swap(a, b);
                }
            }
            for &k in &idx {
                let r = recs[k];
                let p = taken + r.src;
                buf[r.at + HEADER_LEN..r.at + HEADER_LEN + r.len]
                    .copy_from_slice(&all[p..p + r.len]);
                let n = seal_planned(&mut buf[r.at..], &r, &mut aead).unwrap();
                assert_eq!(n, r.end() - r.at);
            }
            wire.extend_from_slice(&buf[start..at]);
            taken += got;
            if w.key_update_due() {
                let n = w
                    .seal_key_update(&mut buf, gen % 2 == 0, &mut aead)
                    .unwrap();
                wire.extend_from_slice(&buf[..n]);
                gen += 1;
                aead = ToyAead { key: gen };
                w.set_key(iv(gen));
            } else if got == 0 || taken == all.len() {
                assert_eq!(taken, all.len(), "a plan stopped early");
                break;
            }
        }
    }
    let n = w.seal_close_notify(&mut buf, &mut aead).unwrap();
    wire.extend_from_slice(&buf[..n]);
    wire
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// Planned records sealed in any order make the same bytes as the
    /// records sealed one by one: the same cutting, numbers and keys.
    #[test]
    fn planned_records_seal_to_the_same_stream(
        lens in prop::collection::vec(prop::sample::select(SIZES), 1..12),
        every in 1u64..12,
        room in prop_oneof![1usize..40, 16_000usize..70_000, Just(1usize << 20)],
        order in prop::collection::vec(any::<usize>(), 1..8),
        seed in any::<u64>(),
    ) {
        let (writes, all) = writes_of(&lens, seed);
        let planned = seal_stream_planned(&writes, every, room, &order);
        prop_assert!(planned == seal_stream(&writes, every, false));
        let (got, _) = read_stream(&planned, all.len(), &[70_000], &[1 << 20]).unwrap();
        prop_assert!(got == all);
    }

    /// Runs cover the records in order, each but the last at least the
    /// asked plaintext.
    #[test]
    fn runs_cover_the_plan(
        lens in prop::collection::vec(prop::sample::select(SIZES), 0..12),
        bytes in prop_oneof![0usize..100, 10_000usize..200_000],
    ) {
        let mut recs = Vec::new();
        Writer::new(iv(0), 0).plan(&lens, 0, 1 << 30, &mut recs).unwrap();
        let rs = runs(&recs, bytes);
        let mut next = 0;
        for (k, r) in rs.iter().enumerate() {
            prop_assert_eq!(r.start, next);
            prop_assert!(r.end > r.start);
            let sum: usize = recs[r.clone()].iter().map(|p| p.len).sum();
            if k + 1 < rs.len() {
                prop_assert!(sum >= bytes);
                // Minimal: without its last record the run is short.
                let less: usize = recs[r.start..r.end - 1].iter().map(|p| p.len).sum();
                prop_assert!(less < bytes.max(1));
            }
            next = r.end;
        }
        prop_assert_eq!(next, recs.len());
    }
}

#[test]
fn a_plan_stops_where_the_key_must_change() {
    let mut w = Writer::new(iv(0), 0);
    w.limit = 3;
    let mut recs = Vec::new();
    let got = w.plan(&[100_000], 0, 1 << 20, &mut recs).unwrap();
    assert_eq!(recs.len(), 3);
    assert_eq!(got, 3 * MAX_PLAINTEXT);
    assert!(w.key_update_due());
    // Nothing more until the key changed.
    let mut more = Vec::new();
    assert_eq!(w.plan(&[100_000 - got], 0, 1 << 20, &mut more).unwrap(), 0);
    assert!(more.is_empty());
}

//! The tables that follow a header: WRITEV/READV segments, CWRITE/CREAD
//! segments, id lists (OKS) and the region table (Welcome, TABLE_REPLY),
//! with the lookups an initiator validates requests against.

use super::*;

/// One WRITEV/READV segment: target address, length and the generation of
/// the target region the sender saw.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Segment {
    /// Target address.
    pub addr: u64,
    /// Length (> 0).
    pub len: u64,
    /// Region generation.
    pub gen: u32,
}

/// Decodes WRITEV/READV segments ([`SEGMENT_LEN`] bytes each: `addr u64,
/// len u32, generation u32`). Every length must be non-zero and the lengths
/// must add up to `total`.
pub fn decode_segments(buf: &[u8], total: u64) -> Result<Vec<Segment>, DecodeError> {
    if buf.len() % SEGMENT_LEN != 0 || buf.len() / SEGMENT_LEN > MAX_SEGMENTS as usize {
        return Err(bad("segment table has a bad length"));
    }
    let mut sum = 0u64;
    let mut out = Vec::with_capacity(buf.len() / SEGMENT_LEN);
    for e in buf.chunks_exact(SEGMENT_LEN) {
        let addr = le64(&e[..8]);
        let len = u32::from_le_bytes([e[8], e[9], e[10], e[11]]) as u64;
        let gen = u32::from_le_bytes([e[12], e[13], e[14], e[15]]);
        if len == 0 {
            return Err(bad("WRITEV/READV segment of zero bytes"));
        }
        sum = sum.saturating_add(len);
        out.push(Segment { addr, len, gen });
    }
    if sum != total {
        return Err(bad(format!(
            "WRITEV/READV segments add up to {sum} bytes, the header says {total}"
        )));
    }
    Ok(out)
}

/// Encodes WRITEV/READV segments; lengths must fit in a u32 (they are at
/// most [`MAX_OP_LEN`]).
pub fn encode_segments(segs: &[Segment]) -> Vec<u8> {
    let mut out = Vec::with_capacity(segs.len() * SEGMENT_LEN);
    for s in segs {
        out.extend_from_slice(&s.addr.to_le_bytes());
        out.extend_from_slice(&(s.len.min(u32::MAX as u64) as u32).to_le_bytes());
        out.extend_from_slice(&s.gen.to_le_bytes());
    }
    out
}

/// Size of one CWRITE/CREAD segment: `addr u64, len u32, generation
/// u32, initiator addr u64`.
pub const CMA_SEGMENT_LEN: usize = 24;

/// One CWRITE/CREAD segment: a WRITEV/READV segment plus the initiator's
/// own (registered) source or destination address.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CmaSegment {
    /// The target range and its generation.
    pub seg: Segment,
    /// The initiator's address.
    pub local: u64,
}

/// Decodes CWRITE/CREAD segments (same rules as [`decode_segments`]).
pub fn decode_cma_segments(buf: &[u8], total: u64) -> Result<Vec<CmaSegment>, DecodeError> {
    if buf.len() % CMA_SEGMENT_LEN != 0 || buf.len() / CMA_SEGMENT_LEN > MAX_SEGMENTS as usize {
        return Err(bad("CWRITE/CREAD segment table has a bad length"));
    }
    let mut plain = Vec::with_capacity(buf.len() / CMA_SEGMENT_LEN * SEGMENT_LEN);
    let mut locals = Vec::with_capacity(buf.len() / CMA_SEGMENT_LEN);
    for e in buf.chunks_exact(CMA_SEGMENT_LEN) {
        plain.extend_from_slice(&e[..SEGMENT_LEN]);
        locals.push(le64(&e[SEGMENT_LEN..]));
    }
    let segs = decode_segments(&plain, total)?;
    Ok(segs
        .into_iter()
        .zip(locals)
        .map(|(seg, local)| CmaSegment { seg, local })
        .collect())
}

/// Encodes CWRITE/CREAD segments.
pub fn encode_cma_segments(segs: &[CmaSegment]) -> Vec<u8> {
    let mut out = Vec::with_capacity(segs.len() * CMA_SEGMENT_LEN);
    for s in segs {
        out.extend_from_slice(&encode_segments(std::slice::from_ref(&s.seg)));
        out.extend_from_slice(&s.local.to_le_bytes());
    }
    out
}

/// Decodes `n` little-endian u64 ids from `buf` (exactly `8*n` bytes).
pub fn decode_ids(buf: &[u8]) -> impl Iterator<Item = u64> + '_ {
    buf.chunks_exact(8).map(le64)
}

/// One entry of a region table: a registered region and its generation
/// (a number the target gives each registration; frames name it so that a
/// frame never lands in memory registered after it was sent).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TableEntry {
    /// Start of the region.
    pub addr: u64,
    /// Length (> 0).
    pub len: u64,
    /// Generation (never 0).
    pub gen: u32,
}

/// Decodes a region table: [`TABLE_ENTRY_LEN`]-byte entries `(addr u64,
/// len u64, generation u32, reserved u32)`. Entries must be non-empty, must
/// not wrap and must be sorted without overlap; the result is what an
/// initiator validates requests against.
pub fn decode_table(buf: &[u8]) -> Result<Vec<TableEntry>, DecodeError> {
    if buf.len() % TABLE_ENTRY_LEN != 0 || buf.len() / TABLE_ENTRY_LEN > MAX_TABLE_ENTRIES as usize
    {
        return Err(bad("region table has a bad length"));
    }
    let mut out = Vec::with_capacity(buf.len() / TABLE_ENTRY_LEN);
    let mut prev_end = 0u64;
    for (i, e) in buf.chunks_exact(TABLE_ENTRY_LEN).enumerate() {
        let addr = le64(&e[..8]);
        let len = le64(&e[8..16]);
        let gen = u32::from_le_bytes([e[16], e[17], e[18], e[19]]);
        let end = addr
            .checked_add(len)
            .ok_or_else(|| bad(format!("region {i} wraps around")))?;
        if len == 0 || (i > 0 && addr < prev_end) {
            return Err(bad(format!("region {i} is empty, unsorted or overlapping")));
        }
        prev_end = end;
        out.push(TableEntry { addr, len, gen });
    }
    Ok(out)
}

/// Encodes a region table (entries sorted by address).
pub fn encode_table(regions: &[TableEntry]) -> Vec<u8> {
    let mut out = Vec::with_capacity(regions.len() * TABLE_ENTRY_LEN);
    for r in regions {
        out.extend_from_slice(&r.addr.to_le_bytes());
        out.extend_from_slice(&r.len.to_le_bytes());
        out.extend_from_slice(&r.gen.to_le_bytes());
        out.extend_from_slice(&[0u8; 4]);
    }
    out
}

/// The generation of the entry of a sorted table that contains all of
/// `[addr, addr+len)`, if one does.
#[inline]
pub fn table_lookup(table: &[TableEntry], addr: u64, len: u64) -> Option<u32> {
    let end = addr.checked_add(len)?;
    if len == 0 {
        return None;
    }
    let i = table.partition_point(|e| e.addr <= addr);
    let e = table.get(i.checked_sub(1)?)?;
    (addr >= e.addr && end <= e.addr + e.len).then_some(e.gen)
}

/// Whether `[addr, addr+len)` lies inside one entry of a sorted table.
#[inline]
pub fn table_contains(table: &[TableEntry], addr: u64, len: u64) -> bool {
    table_lookup(table, addr, len).is_some()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn limits_are_enforced() {
        let e = |addr, len| TableEntry { addr, len, gen: 1 };
        assert!(decode_table(&encode_table(&[e(10, 5), e(12, 5)])).is_err());
        assert!(decode_table(&encode_table(&[e(u64::MAX, 5)])).is_err());
        assert_eq!(
            decode_table(&encode_table(&[e(10, 5), e(15, 5)])).unwrap(),
            vec![e(10, 5), e(15, 5)]
        );
    }

    #[test]
    fn table_lookups() {
        let t = [
            TableEntry {
                addr: 0x1000,
                len: 0x100,
                gen: 1,
            },
            TableEntry {
                addr: 0x2000,
                len: 0x10,
                gen: 2,
            },
        ];
        assert_eq!(table_lookup(&t, 0x2008, 8), Some(2));
        assert!(table_contains(&t, 0x1000, 0x100));
        assert!(table_contains(&t, 0x2008, 8));
        assert!(!table_contains(&t, 0x10ff, 2));
        assert!(!table_contains(&t, 0x0fff, 1));
        assert!(!table_contains(&t, 0x2000, 0));
        assert!(!table_contains(&t, u64::MAX, 2));
        assert!(!table_contains(&[], 0, 1));
    }
}

//! Typed byte ranges for building requests without raw address arithmetic.
//!
//! A serving stack's decode node registers its KV cache and tells the
//! prefill node, out of band, where to write: a [`RemoteSpan`] (segment
//! name, address, length), which serialises with serde (feature `serde`)
//! for that exchange. The prefill node cuts it into blocks with
//! [`RemoteSpan::slice`], cuts its own registered memory with
//! [`crate::RegisteredBuffer::slice`] into [`LocalSpan`]s, and pairs them
//! with [`TransferRequest::write_span`] / [`TransferRequest::read_span`],
//! which refuse ranges of different lengths. Every cut is checked: a range
//! outside its span is [`Error::InvalidArgument`] naming both, never a
//! request into a neighbour's bytes.

use std::ops::{Bound, RangeBounds};

use crate::error::{Error, Result};
use crate::types::TransferRequest;

/// `range` within `0..len` as `(start, end)`, or why not.
fn resolve(range: &impl RangeBounds<u64>, len: u64, what: &str) -> Result<(u64, u64)> {
    let start = match range.start_bound() {
        Bound::Included(&s) => Some(s),
        Bound::Excluded(&s) => s.checked_add(1),
        Bound::Unbounded => Some(0),
    };
    let end = match range.end_bound() {
        Bound::Included(&e) => e.checked_add(1),
        Bound::Excluded(&e) => Some(e),
        Bound::Unbounded => Some(len),
    };
    match (start, end) {
        (Some(s), Some(e)) if s <= e && e <= len => Ok((s, e)),
        _ => Err(Error::InvalidArgument(format!(
            "range {:?}..{:?} is outside the {len} bytes of {what}",
            range.start_bound(),
            range.end_bound()
        ))),
    }
}

/// A range of this engine's registered memory (made by
/// [`crate::RegisteredBuffer::slice`], so it lies inside a registration
/// while that buffer lives).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct LocalSpan {
    addr: u64,
    len: u64,
}

impl LocalSpan {
    /// `len` bytes from `addr`; for buffers that build their spans.
    pub(crate) fn new(addr: u64, len: u64) -> LocalSpan {
        LocalSpan { addr, len }
    }

    /// Start address.
    pub fn addr(&self) -> u64 {
        self.addr
    }

    /// Length in bytes.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether it has no byte.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The bytes `range` of this span (offsets from its start);
    /// [`Error::InvalidArgument`] if the range leaves it.
    pub fn slice(&self, range: impl RangeBounds<u64>) -> Result<LocalSpan> {
        let (s, e) = resolve(&range, self.len, "the local span")?;
        Ok(LocalSpan::new(self.addr + s, e - s))
    }

    /// Cuts the span into consecutive pieces of `block` bytes (the last
    /// one shorter if `block` does not divide it); [`Error::InvalidArgument`]
    /// for a zero block.
    pub fn blocks(&self, block: u64) -> Result<Vec<LocalSpan>> {
        blocks(self.len, block).map(|v| {
            v.into_iter()
                .map(|(s, l)| LocalSpan::new(self.addr + s, l))
                .collect()
        })
    }
}

fn blocks(len: u64, block: u64) -> Result<Vec<(u64, u64)>> {
    if block == 0 {
        return Err(Error::InvalidArgument("a block of 0 bytes".to_owned()));
    }
    Ok((0..len.div_ceil(block))
        .map(|i| {
            let s = i * block;
            (s, block.min(len - s))
        })
        .collect())
}

/// Where bytes go in (or come from) a peer's registered memory: the
/// peer's segment name (what [`crate::TransferEngine::open_segment`]
/// takes), an address inside its registration and a length. What a decode
/// node sends a prefill node out of band; `Serialize`/`Deserialize` with
/// the feature `serde`.
///
/// Its fields are the peer's word: a span that lies outside the peer's
/// registrations is refused by the peer when a request uses it
/// ([`Error::AddressNotRegistered`]), never a write elsewhere.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct RemoteSpan {
    /// The peer's segment name.
    pub segment: String,
    /// Start address in the peer's registered memory.
    pub addr: u64,
    /// Length in bytes.
    pub len: u64,
}

impl RemoteSpan {
    /// `len` bytes at `addr` of the peer `segment`.
    pub fn new(segment: impl Into<String>, addr: u64, len: u64) -> RemoteSpan {
        RemoteSpan {
            segment: segment.into(),
            addr,
            len,
        }
    }

    /// The bytes `range` of this span (offsets from its start), on the
    /// same segment; [`Error::InvalidArgument`] if the range leaves it or
    /// the span's own end overflows.
    pub fn slice(&self, range: impl RangeBounds<u64>) -> Result<RemoteSpan> {
        self.end()?;
        let (s, e) = resolve(&range, self.len, &format!("the span of {}", self.segment))?;
        Ok(RemoteSpan::new(self.segment.clone(), self.addr + s, e - s))
    }

    /// Cuts the span into consecutive pieces of `block` bytes (the last
    /// one shorter if `block` does not divide it).
    pub fn blocks(&self, block: u64) -> Result<Vec<RemoteSpan>> {
        self.end()?;
        blocks(self.len, block).map(|v| {
            v.into_iter()
                .map(|(s, l)| RemoteSpan::new(self.segment.clone(), self.addr + s, l))
                .collect()
        })
    }

    fn end(&self) -> Result<u64> {
        self.addr.checked_add(self.len).ok_or_else(|| {
            Error::InvalidArgument(format!(
                "the span of {} at {:#x} with {} bytes ends beyond the address space",
                self.segment, self.addr, self.len
            ))
        })
    }
}

impl TransferRequest {
    /// A write of `local` into `remote` (whose segment the caller has
    /// opened); [`Error::InvalidArgument`] if their lengths differ.
    pub fn write_span(local: LocalSpan, remote: &RemoteSpan) -> Result<TransferRequest> {
        same_len(local, remote)?;
        Ok(TransferRequest::write(local.addr, remote.addr, local.len))
    }

    /// A read of `remote` into `local`; [`Error::InvalidArgument`] if
    /// their lengths differ.
    pub fn read_span(local: LocalSpan, remote: &RemoteSpan) -> Result<TransferRequest> {
        same_len(local, remote)?;
        Ok(TransferRequest::read(local.addr, remote.addr, local.len))
    }
}

fn same_len(local: LocalSpan, remote: &RemoteSpan) -> Result<()> {
    if local.len != remote.len {
        return Err(Error::InvalidArgument(format!(
            "a local span of {} bytes paired with a span of {} bytes of {}",
            local.len, remote.len, remote.segment
        )));
    }
    remote.end().map(|_| ())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slices_stay_inside_and_name_what_is_wrong() {
        let r = RemoteSpan::new("decode-0:7000", 0x1000, 4096);
        assert_eq!(
            r.slice(1024..2048).unwrap(),
            RemoteSpan::new("decode-0:7000", 0x1400, 1024)
        );
        assert_eq!(r.slice(..).unwrap(), r);
        assert_eq!(r.slice(4096..).unwrap().len, 0);
        assert_eq!(r.slice(..=0).unwrap().len, 1);
        for bad in [r.slice(0..4097), r.slice(4097..), r.slice(..=u64::MAX)] {
            match bad {
                Err(Error::InvalidArgument(m)) => assert!(m.contains("4096 bytes"), "{m}"),
                other => panic!("expected InvalidArgument, got {other:?}"),
            }
        }
        #[allow(clippy::reversed_empty_ranges)]
        let reversed = r.slice(10..5);
        assert!(matches!(reversed, Err(Error::InvalidArgument(_))));
        let overflowing = RemoteSpan::new("p", u64::MAX - 10, 100);
        assert!(matches!(
            overflowing.slice(..),
            Err(Error::InvalidArgument(_))
        ));
        let l = LocalSpan::new(0x9000, 100);
        assert_eq!(l.slice(10..20).unwrap(), LocalSpan::new(0x900a, 10));
        assert!(matches!(l.slice(90..101), Err(Error::InvalidArgument(_))));
    }

    #[test]
    fn blocks_cover_the_span_exactly() {
        let r = RemoteSpan::new("p", 1000, 10);
        let b = r.blocks(4).unwrap();
        assert_eq!(
            b.iter().map(|s| (s.addr, s.len)).collect::<Vec<_>>(),
            vec![(1000, 4), (1004, 4), (1008, 2)]
        );
        assert!(r.blocks(0).is_err());
        assert!(RemoteSpan::new("p", 0, 0).blocks(4).unwrap().is_empty());
        let l = LocalSpan::new(0, 8).blocks(8).unwrap();
        assert_eq!(l, vec![LocalSpan::new(0, 8)]);
    }

    #[test]
    fn requests_pair_equal_lengths_only() {
        let l = LocalSpan::new(0x9000, 64);
        let r = RemoteSpan::new("p", 0x1000, 64);
        assert_eq!(
            TransferRequest::write_span(l, &r).unwrap(),
            TransferRequest::write(0x9000, 0x1000, 64)
        );
        assert_eq!(
            TransferRequest::read_span(l, &r).unwrap(),
            TransferRequest::read(0x9000, 0x1000, 64)
        );
        let short = r.slice(..32).unwrap();
        match TransferRequest::write_span(l, &short) {
            Err(Error::InvalidArgument(m)) => assert!(m.contains("64") && m.contains("32"), "{m}"),
            other => panic!("expected InvalidArgument, got {other:?}"),
        }
    }

    #[cfg(feature = "serde")]
    #[test]
    fn a_remote_span_round_trips_through_json() {
        let r = RemoteSpan::new("decode-0:7000", 0x7f00_0000_1000, 1 << 20);
        let text = serde_json::to_string(&r).unwrap();
        assert_eq!(
            text,
            r#"{"segment":"decode-0:7000","addr":139637976731648,"len":1048576}"#
        );
        assert_eq!(serde_json::from_str::<RemoteSpan>(&text).unwrap(), r);
        assert!(serde_json::from_str::<RemoteSpan>(r#"{"segment":"x","addr":1}"#).is_err());
    }
}

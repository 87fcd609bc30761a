//! The copies of the same-host requests: CWRITE / CREAD by cross-memory
//! attach, SWRITE / SREAD through the staging area, and the segment
//! verdicts they report.

use super::serve::TargetStage;
use super::*;
use crate::frame::CmaSegment;
use ferry_tcp_proto::target::Copy;

/// Performs the copies of a CWRITE (`read` false: from the initiator into
/// the held target ranges) or CREAD (from them into the initiator) for
/// the segments the core held; returns the indices of those whose copy
/// failed (nothing allocated when every one moved). `one_call`: every
/// segment is held and none overlaps, so all may go in one system call.
pub(super) fn cma_copy(to: cma::Remote<'_>, c: &Copy<RegionGuard>) -> Vec<u32> {
    let (read, segs, guards) = (c.read, &c.segs, &c.holds);
    let total: u64 = segs.iter().map(|s| s.seg.len).sum();
    if c.one_call {
        let ok = if total as usize >= cma::PARALLEL_MIN && cma::helpers() > 0 {
            let pairs: Vec<(usize, u64, usize)> = guards
                .iter()
                .flatten()
                .zip(segs)
                .map(|(g, s)| (g.as_ptr() as usize, s.local, g.len() as usize))
                .collect();
            // SAFETY: every local range is held registered (and so valid)
            // by its guard until after copy_split has returned (it waits
            // for its helper threads); the kernel checks the initiator's
            // ranges (EFAULT, never a fault here).
            unsafe { cma::copy_split(to, read, &pairs) }.is_ok()
        } else {
            let local: Vec<libc::iovec> = guards
                .iter()
                .flatten()
                .map(|g| cma::iov(g.as_ptr(), g.len() as usize))
                .collect();
            let remote: Vec<libc::iovec> = segs
                .iter()
                .map(|s| cma::iov(s.local as usize as *mut u8, s.seg.len as usize))
                .collect();
            // SAFETY: as above, for one system call.
            (unsafe { cma::copy(to, read, &local, &remote) }) == Ok(total as usize)
        };
        if ok {
            return Vec::new();
        }
        // A short or refused call: redo segment by segment to find which.
    }
    let mut failed = Vec::new();
    for (i, (g, s)) in guards.iter().zip(segs).enumerate() {
        if let Ok(g) = g {
            // SAFETY: as above, for this guard's range.
            let r = unsafe { cma::copy_all(to, read, g.as_ptr(), s.local, g.len() as usize) };
            if r.is_err() {
                failed.push(i as u32);
            }
        }
    }
    failed
}

/// Moves an SWRITE's stream out of the staging area into the guarded
/// ranges (the bytes of refused segments are dropped), or an SREAD's
/// verdict (naming the refused segments) and accepted ranges into it —
/// then waits until the initiator has emptied the ring, so that the
/// acknowledgement follows the data.
pub(super) async fn staged_copy(
    st: &mut TargetStage,
    read: bool,
    guards: &[Result<RegionGuard, Status>],
    segs: &[CmaSegment],
    watch: &crate::same_host::stage::Watch<'_>,
) -> Result<(), crate::same_host::stage::Stop> {
    use crate::same_host::stage::{self, Dir, Piece};
    let pieces = guards.iter().zip(segs).map(|(g, s)| Piece {
        // Refused (null): its bytes are dropped (SWRITE) or never sent
        // (SREAD).
        ptr: g.as_ref().map_or(std::ptr::null_mut(), |g| g.as_ptr()),
        len: s.seg.len as usize,
    });
    if !read {
        let ring = st.area.ring(Dir::ToTarget);
        // The initiator sends every segment's bytes, refused ones too.
        let pieces: Vec<Piece> = pieces.collect();
        // SAFETY: every non-null piece is a range its guard holds
        // registered (and so valid) until the caller drops `guards`, after
        // this returns.
        return unsafe { stage::get(&ring, &mut st.from_initiator, &pieces, watch, None) }.await;
    }
    let ring = st.area.ring(Dir::ToInitiator);
    let refused = guards.iter().enumerate().filter(|(_, g)| g.is_err());
    let mut verdict = stage::verdict(refused.map(|(i, _)| i));
    let v = [Piece {
        ptr: verdict.as_mut_ptr(),
        len: verdict.len(),
    }];
    // SAFETY: `verdict` is valid for reads until this returns.
    unsafe { stage::put(&ring, &mut st.to_initiator, &v, watch) }.await?;
    let accepted: Vec<Piece> = pieces.filter(|p| !p.ptr.is_null()).collect();
    // SAFETY: as for SWRITE, read instead of written.
    unsafe { stage::put(&ring, &mut st.to_initiator, &accepted, watch) }.await?;
    let end = st.to_initiator;
    stage::wait(|| ring.drained(end), &ring.tail_waiter(), watch).await
}

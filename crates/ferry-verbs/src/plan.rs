//! Turning validated requests into work requests: split above the maximum
//! message size, merge remote-contiguous pieces into one scatter/gather
//! list. Pure logic, tested without a device.
#![cfg_attr(not(feature = "rdma"), allow(dead_code))]

use ferry_core::TransferOp;

/// One validated request: local range with its lkey, remote range with its
/// rkey.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Piece {
    /// Index of the request in the caller's batch.
    pub req: u32,
    pub op: TransferOp,
    pub local: u64,
    pub lkey: u32,
    pub remote: u64,
    pub rkey: u32,
    pub len: u64,
}

/// One scatter/gather entry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Sge {
    pub addr: u64,
    pub len: u32,
    pub lkey: u32,
}

/// One work request to post.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct WrPlan {
    pub op: TransferOp,
    pub remote: u64,
    pub rkey: u32,
    pub len: u64,
    pub sges: Vec<Sge>,
    /// Requests this work request carries bytes of (each once, in order).
    pub reqs: Vec<u32>,
}

/// Plans the work requests for `pieces` (in order): each is at most
/// `max_msg` bytes (clamped to 1 GiB, as an SGE length is 32-bit) with at
/// most `max_sge` entries.
pub(crate) fn plan(pieces: &[Piece], max_msg: u64, max_sge: usize) -> Vec<WrPlan> {
    let max_msg = max_msg.clamp(1, 1 << 30);
    let max_sge = max_sge.max(1);
    let mut out: Vec<WrPlan> = Vec::new();
    for p in pieces {
        let mut off = 0;
        while off < p.len {
            let n = (p.len - off).min(max_msg);
            let (local, remote) = (p.local + off, p.remote + off);
            off += n;
            if let Some(w) = out.last_mut() {
                let mergeable = w.op == p.op
                    && w.rkey == p.rkey
                    && w.remote.checked_add(w.len) == Some(remote)
                    && w.len + n <= max_msg;
                if mergeable {
                    let last = w.sges.last_mut().expect("a planned WR has an SGE");
                    if last.lkey == p.lkey && last.addr + u64::from(last.len) == local {
                        last.len += n as u32;
                    } else if w.sges.len() < max_sge {
                        w.sges.push(Sge {
                            addr: local,
                            len: n as u32,
                            lkey: p.lkey,
                        });
                    } else {
                        out.push(new_wr(p, local, remote, n));
                        continue;
                    }
                    w.len += n;
                    if w.reqs.last() != Some(&p.req) {
                        w.reqs.push(p.req);
                    }
                    continue;
                }
            }
            out.push(new_wr(p, local, remote, n));
        }
    }
    out
}

fn new_wr(p: &Piece, local: u64, remote: u64, n: u64) -> WrPlan {
    WrPlan {
        op: p.op,
        remote,
        rkey: p.rkey,
        len: n,
        sges: vec![Sge {
            addr: local,
            len: n as u32,
            lkey: p.lkey,
        }],
        reqs: vec![p.req],
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn piece(req: u32, op: TransferOp, local: u64, remote: u64, len: u64) -> Piece {
        Piece {
            req,
            op,
            local,
            lkey: 1,
            remote,
            rkey: 9,
            len,
        }
    }

    /// Every byte of every piece appears exactly once, at the right remote
    /// offset, and the limits hold.
    fn check(pieces: &[Piece], wrs: &[WrPlan], max_msg: u64, max_sge: usize) {
        let mut covered = Vec::new();
        for w in wrs {
            assert!(w.len <= max_msg && w.len > 0);
            assert!(w.sges.len() <= max_sge);
            assert_eq!(w.sges.iter().map(|s| u64::from(s.len)).sum::<u64>(), w.len);
            let mut r = w.remote;
            for s in &w.sges {
                for i in 0..u64::from(s.len) {
                    covered.push((s.addr + i, r + i, w.op));
                }
                r += u64::from(s.len);
            }
        }
        let mut want = Vec::new();
        for p in pieces {
            for i in 0..p.len {
                want.push((p.local + i, p.remote + i, p.op));
            }
        }
        assert_eq!(covered, want);
    }

    #[test]
    fn splits_above_max_message() {
        let ps = [piece(0, TransferOp::Write, 0x1000, 0x9000, 10)];
        let wrs = plan(&ps, 4, 8);
        assert_eq!(wrs.len(), 3);
        assert!(wrs.iter().all(|w| w.reqs == vec![0]));
        check(&ps, &wrs, 4, 8);
    }

    #[test]
    fn merges_remote_contiguous_into_sg_lists() {
        // Local scattered, remote contiguous: one WR with 3 SGEs.
        let ps = [
            piece(0, TransferOp::Write, 0x1000, 0x9000, 4),
            piece(1, TransferOp::Write, 0x3000, 0x9004, 4),
            piece(2, TransferOp::Write, 0x5000, 0x9008, 4),
        ];
        let wrs = plan(&ps, 1 << 20, 8);
        assert_eq!(wrs.len(), 1);
        assert_eq!(wrs[0].sges.len(), 3);
        assert_eq!(wrs[0].reqs, vec![0, 1, 2]);
        check(&ps, &wrs, 1 << 20, 8);
        // SGE limit forces a new WR.
        let wrs = plan(&ps, 1 << 20, 2);
        assert_eq!(wrs.len(), 2);
        check(&ps, &wrs, 1 << 20, 2);
        // Different ops or a gap never merge.
        let ps2 = [
            piece(0, TransferOp::Write, 0x1000, 0x9000, 4),
            piece(1, TransferOp::Read, 0x3000, 0x9004, 4),
            piece(2, TransferOp::Read, 0x5000, 0x9010, 4),
        ];
        let wrs = plan(&ps2, 1 << 20, 8);
        assert_eq!(wrs.len(), 3);
        check(&ps2, &wrs, 1 << 20, 8);
    }

    #[test]
    fn many_shapes_cover_every_byte() {
        let mut seed = 0x2545f4914f6cdd1du64;
        let mut next = || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        for _ in 0..200 {
            let n = (next() % 6 + 1) as usize;
            let mut remote = 0x10_0000;
            let mut ps = Vec::new();
            for i in 0..n {
                let len = next() % 40 + 1;
                if next() % 3 == 0 {
                    remote += next() % 8;
                }
                let op = if next() % 4 == 0 {
                    TransferOp::Read
                } else {
                    TransferOp::Write
                };
                ps.push(piece(i as u32, op, 0x1000 * (i as u64 + 1), remote, len));
                remote += len;
            }
            let max_msg = next() % 50 + 1;
            let max_sge = (next() % 4 + 1) as usize;
            check(&ps, &plan(&ps, max_msg, max_sge), max_msg, max_sge);
        }
    }
}

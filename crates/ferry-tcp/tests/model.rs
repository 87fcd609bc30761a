//! Property tests: random sequences of writes, reads and batches (including
//! out-of-bounds and zero-length requests) between two and three engines on
//! loopback, checked after every step against a model of every memory.

mod common;

use std::sync::Arc;

use common::{engine, mem, pattern};
use ferry_core::{Error, HostBuffer, SegmentId, Side, TransferEngine, TransferOp, TransferRequest};
use ferry_tcp::{TcpConfig, TcpEngine};
use proptest::prelude::*;

const LEN: usize = 8192;
const SLOTS: usize = 8;
const SLOT: usize = LEN / SLOTS;

#[derive(Clone, Debug)]
struct Req {
    op: TransferOp,
    local: usize,
    remote: usize,
    len: usize,
    /// Push the remote range past the end of the peer's region.
    remote_oob: bool,
    /// Push the local range before the start of the local region.
    local_oob: bool,
}

#[derive(Clone, Debug)]
enum Step {
    Single {
        from: usize,
        to: usize,
        req: Req,
    },
    /// Requests of one direction with disjoint destination slots.
    Batch {
        from: usize,
        to: usize,
        reqs: Vec<Req>,
    },
}

fn req(op: TransferOp) -> impl Strategy<Value = Req> {
    (0..LEN, 0..LEN, 0..=LEN, any::<bool>(), 0..10u8).prop_map(move |(l, r, n, oob_r, k)| {
        let len = n.min(LEN - l).min(LEN - r);
        Req {
            op,
            local: l,
            remote: r,
            len: if k == 0 { 0 } else { len },
            remote_oob: oob_r && k == 1,
            local_oob: !oob_r && k == 1,
        }
    })
}

fn slot_req(op: TransferOp, slot: usize) -> impl Strategy<Value = Req> {
    (0..SLOT, 0..LEN, 0..=SLOT, 0..12u8).prop_map(move |(off, other, n, k)| {
        let dst = slot * SLOT + off;
        let len = n.min(SLOT - off).min(LEN - other);
        let (local, remote) = match op {
            TransferOp::Write => (other, dst),
            TransferOp::Read => (dst, other),
        };
        Req {
            op,
            local,
            remote,
            len: if k == 0 { 0 } else { len },
            remote_oob: k == 1,
            local_oob: k == 2,
        }
    })
}

fn step(engines: usize) -> impl Strategy<Value = Step> {
    let pair = (0..engines, 1..engines).prop_map(move |(f, d)| (f, (f + d) % engines));
    let op = prop_oneof![Just(TransferOp::Write), Just(TransferOp::Read)];
    prop_oneof![
        (pair.clone(), op.clone()).prop_flat_map(
            |((from, to), op)| req(op).prop_map(move |req| Step::Single { from, to, req })
        ),
        (
            pair,
            op,
            proptest::sample::subsequence((0..SLOTS).collect::<Vec<_>>(), 0..=SLOTS)
        )
            .prop_flat_map(|((from, to), op, slots)| {
                let reqs: Vec<_> = slots.into_iter().map(|s| slot_req(op, s)).collect();
                reqs.prop_map(move |reqs| Step::Batch { from, to, reqs })
            }),
    ]
}

struct World {
    engines: Vec<Arc<TcpEngine>>,
    mems: Vec<HostBuffer>,
    /// segs[i][j]: engine i's handle to engine j.
    segs: Vec<Vec<Option<SegmentId>>>,
    model: Vec<Vec<u8>>,
}

async fn world(n: usize, cfg: TcpConfig) -> World {
    let mut engines = Vec::new();
    let mut mems = Vec::new();
    let mut model = Vec::new();
    for i in 0..n {
        let e = engine(cfg.clone()).await;
        let m = mem(&e, LEN, 0).await;
        let p = pattern(i as u8 + 1, LEN);
        m.write(0, &p).unwrap();
        model.push(p);
        mems.push(m);
        engines.push(e);
    }
    let mut segs = vec![vec![None; n]; n];
    for i in 0..n {
        for j in 0..n {
            if i != j {
                segs[i][j] = Some(
                    engines[i]
                        .open_segment(engines[j].segment_name())
                        .await
                        .unwrap(),
                );
            }
        }
    }
    World {
        engines,
        mems,
        segs,
        model,
    }
}

impl World {
    fn wire(&self, from: usize, to: usize, r: &Req) -> TransferRequest {
        let local = if r.local_oob {
            self.mems[from].addr() - 16
        } else {
            self.mems[from].addr() + r.local as u64
        };
        let remote = if r.remote_oob {
            self.mems[to].addr() + (LEN - r.len.min(LEN) / 2) as u64
        } else {
            self.mems[to].addr() + r.remote as u64
        };
        TransferRequest {
            op: r.op,
            local_addr: local,
            remote_addr: remote,
            len: r.len as u64,
        }
    }

    /// Expected outcome, applied to the model if it succeeds.
    fn apply(&mut self, from: usize, to: usize, r: &Req) -> Result<(), (Side, u64)> {
        if r.len == 0 {
            return Ok(());
        }
        if r.local_oob {
            return Err((Side::Local, 0));
        }
        if r.remote_oob {
            return Err((Side::Remote, 0));
        }
        match r.op {
            TransferOp::Write => {
                let src = self.model[from][r.local..r.local + r.len].to_vec();
                self.model[to][r.remote..r.remote + r.len].copy_from_slice(&src);
            }
            TransferOp::Read => {
                let src = self.model[to][r.remote..r.remote + r.len].to_vec();
                self.model[from][r.local..r.local + r.len].copy_from_slice(&src);
            }
        }
        Ok(())
    }

    fn check_memory(&self, what: &str) -> Result<(), TestCaseError> {
        for (i, m) in self.mems.iter().enumerate() {
            let got = m.to_vec();
            if got != self.model[i] {
                let first = got.iter().zip(&self.model[i]).position(|(a, b)| a != b);
                return Err(TestCaseError::fail(format!(
                    "{what}: engine {i} memory differs from the model (first at {first:?})"
                )));
            }
        }
        Ok(())
    }
}

fn check_result(
    got: &Result<(), Error>,
    want: &Result<(), (Side, u64)>,
) -> Result<(), TestCaseError> {
    match (got, want) {
        (Ok(()), Ok(())) => Ok(()),
        (Err(Error::AddressNotRegistered { side, .. }), Err((want_side, _)))
            if side == want_side =>
        {
            Ok(())
        }
        (g, w) => Err(TestCaseError::fail(format!("got {g:?}, model says {w:?}"))),
    }
}

async fn run(world: &mut World, steps: &[Step]) -> Result<(), TestCaseError> {
    for (k, s) in steps.iter().enumerate() {
        match s {
            Step::Single { from, to, req } => {
                let w = world.wire(*from, *to, req);
                let seg = world.segs[*from][*to].unwrap();
                let got = world.engines[*from].transfer(seg, w).await;
                let want = world.apply(*from, *to, req);
                check_result(&got, &want)?;
            }
            Step::Batch { from, to, reqs, .. } => {
                let wires: Vec<_> = reqs.iter().map(|r| world.wire(*from, *to, r)).collect();
                let seg = world.segs[*from][*to].unwrap();
                let report = world.engines[*from]
                    .batch_transfer(seg, &wires, None)
                    .await
                    .map_err(|e| TestCaseError::fail(format!("batch refused: {e}")))?;
                prop_assert_eq!(report.len(), reqs.len());
                for (r, got) in reqs.iter().zip(&report.results) {
                    let want = world.apply(*from, *to, r);
                    check_result(got, &want)?;
                }
            }
        }
        world.check_memory(&format!("after step {k}: {s:?}"))?;
    }
    Ok(())
}

fn prop(engines: usize, cfg: TcpConfig, cases: u32) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let mut runner = proptest::test_runner::TestRunner::new(ProptestConfig {
        cases,
        ..ProptestConfig::default()
    });
    runner
        .run(&proptest::collection::vec(step(engines), 1..24), |steps| {
            rt.block_on(async {
                let mut w = world(engines, cfg.clone()).await;
                run(&mut w, &steps).await
            })
        })
        .unwrap();
}

#[test]
fn two_engines_match_the_model() {
    prop(2, TcpConfig::default(), 48);
}

#[test]
fn three_engines_match_the_model() {
    prop(3, TcpConfig::default(), 32);
}

#[test]
fn three_engines_chunked_many_connections_match_the_model() {
    prop(
        3,
        TcpConfig::builder()
            .connections(4)
            .chunk_size(100)
            .same_host_chunk(4096)
            .spin(std::time::Duration::ZERO)
            .build()
            .unwrap(),
        32,
    );
}

//! Cancellation: futures dropped at any await point leave nothing behind.
//!
//! A property test: random plans of operations (`transfer`,
//! `batch_transfer`, `submit` then `wait`, `batch_register`, `unregister`,
//! `close_segment`), each future polled a random number of times and then
//! dropped. After every plan: no batch is left in either engine once the
//! ids the plan obtained are waited for, no region of a dropped
//! `batch_register` is half registered, a dropped `unregister` left its
//! region either registered or not (and registrable again once
//! unregistered), a dropped `close_segment` left its handle either closed
//! or working (and closable), and after `unregister` returns no byte of
//! the unregistered memory changes. (`take_notifications` and
//! `next_notification` dropped mid-way: `check_awaited_notification`.)

use proptest::strategy::{Strategy, ValueTree};
use proptest::test_runner::{Config, TestRunner};

use super::harness::*;
use super::*;

const CHUNK: usize = 64 * 1024;
const CHUNKS: usize = 8;
const LEN: usize = CHUNK * CHUNKS;
/// Random plans per check, after the sweep (each plan re-registers memory,
/// so keep it modest).
const PLANS: usize = 12;
/// Poll counts the sweep drops every operation at (the random plans use the
/// same range).
const MAX_POLLS: u32 = 12;

#[derive(Clone, Copy, Debug)]
enum Op {
    /// One write of the whole buffer.
    Write,
    /// One read of the whole buffer.
    Read,
    /// A batch of `CHUNKS` writes.
    Batch,
    /// `submit` of `CHUNKS` writes, then `wait` (each may be dropped).
    SubmitWait,
    /// `batch_register` of three regions.
    BatchRegister,
    /// `unregister` of a region registered for it.
    Unregister,
    /// `close_segment` of a second handle of the peer's segment.
    CloseSegment,
}

const OPS: [Op; 7] = [
    Op::Write,
    Op::Read,
    Op::Batch,
    Op::SubmitWait,
    Op::BatchRegister,
    Op::Unregister,
    Op::CloseSegment,
];

/// Drops futures of every operation at random poll counts and checks that
/// nothing is left behind (see the module docs).
pub async fn check_cancellation(factory: Arc<dyn EngineFactory>, adapted: bool) -> Outcome {
    let p = match pair(&factory, adapted).await {
        Ok(p) => p,
        Err(o) => return o,
    };
    if p.a.live_batches().is_none() {
        return Outcome::Skipped("the engine does not count its live batches".to_owned());
    }
    let caps = p.a.capabilities();
    let ops: Vec<Op> = OPS
        .into_iter()
        .filter(|op| match op {
            Op::Batch => caps.batch_transfer && caps.max_batch_len.is_none_or(|m| m >= CHUNKS),
            Op::SubmitWait => caps.async_batch && caps.max_batch_len.is_none_or(|m| m >= CHUNKS),
            Op::BatchRegister => caps.batch_register,
            _ => true,
        })
        .collect();
    let mut local = Mem::new(&p.a, LEN, 121).await;
    let mut remote = Mem::new(&p.b, LEN, 0).await;
    let spare = Mem::unregistered(&p.a, 3 * CHUNK, 0);
    // What the close_segment probes move (nothing else touches it).
    let probe_src = Mem::new(&p.a, 4096, 77).await;
    let probe_dst = Mem::new(&p.b, 4096, 0).await;
    let strategy = proptest::collection::vec((0..ops.len(), 0..MAX_POLLS, 0u32..6), 1..5);
    let mut runner = TestRunner::new(Config {
        cases: PLANS as u32,
        ..Config::default()
    });
    // First a sweep: every operation alone, dropped after each poll count;
    // then random plans of several operations.
    let mut plans: Vec<Vec<(Op, u32, u32)>> = ops
        .iter()
        .flat_map(|&op| (0..MAX_POLLS).map(move |polls| vec![(op, polls, polls / 2)]))
        .collect();
    for _ in 0..PLANS {
        plans.push(
            strategy
                .new_tree(&mut runner)
                .expect("generating a cancellation plan")
                .current()
                .into_iter()
                .map(|(i, polls, wait_polls)| (ops[i], polls, wait_polls))
                .collect(),
        );
    }
    for (case, plan) in plans.into_iter().enumerate() {
        let what = format!("plan {case} {plan:?}");
        let mut ids = Vec::new();
        for &(op, polls, wait_polls) in &plan {
            let writes: Vec<TransferRequest> = (0..CHUNKS)
                .map(|i| {
                    TransferRequest::write(
                        local.at(i * CHUNK),
                        remote.at((CHUNKS - 1 - i) * CHUNK),
                        CHUNK as u64,
                    )
                })
                .collect();
            match op {
                Op::Write => {
                    let r = TransferRequest::write(local.addr(), remote.addr(), LEN as u64);
                    poll_then_drop(p.a.transfer(p.seg, r), polls).await;
                }
                Op::Read => {
                    let r = TransferRequest::read(local.addr(), remote.addr(), LEN as u64);
                    poll_then_drop(p.a.transfer(p.seg, r), polls).await;
                }
                Op::Batch => {
                    poll_then_drop(p.a.batch_transfer(p.seg, &writes, None), polls).await;
                }
                Op::SubmitWait => {
                    if let Some(Ok(id)) =
                        poll_then_drop(p.a.submit(p.seg, &writes, None), polls).await
                    {
                        // The id is ours now: a dropped wait must leave the
                        // batch for a later one.
                        if caps.batch_wait
                            && poll_then_drop(p.a.wait(id), wait_polls).await.is_some()
                        {
                            continue;
                        }
                        ids.push(id);
                    }
                }
                Op::BatchRegister => {
                    let regions: Vec<MemoryRegion> =
                        (0..3).map(|i| spare.region(i * CHUNK, CHUNK)).collect();
                    let addrs: Vec<u64> = regions.iter().map(|r| r.addr()).collect();
                    poll_then_drop(p.a.batch_register(regions), polls).await;
                    // All or nothing, once any rollback of the dropped call
                    // has run: either every region is registered or none.
                    let state = poll_until(&format!("{what}: batch_register settles"), || {
                        let a = Arc::clone(&p.a);
                        let spare = &spare;
                        async move {
                            let mut reg = Vec::new();
                            for i in 0..3 {
                                // Registering again tells: Overlap means the
                                // region is registered.
                                let r = spare.region(i * CHUNK, CHUNK);
                                let addr = r.addr();
                                reg.push(match within("a register probe", a.register(r)).await {
                                    Ok(()) => {
                                        within("unregister of a probe", a.unregister(addr))
                                            .await
                                            .unwrap_or_else(|e| {
                                                panic!("unregister of a probe failed: {e}")
                                            });
                                        false
                                    }
                                    Err(Error::RegionOverlap { .. }) => true,
                                    Err(e) => panic!("register probe failed: {e}"),
                                });
                            }
                            let all = reg.iter().all(|x| *x);
                            let none = reg.iter().all(|x| !*x);
                            (all || none).then_some(all)
                        }
                    })
                    .await;
                    if state {
                        for &addr in &addrs {
                            within(&format!("{what}: unregister"), p.a.unregister(addr))
                                .await
                                .unwrap_or_else(|e| {
                                    panic!("{what}: unregister after a dropped batch_register: {e}")
                                });
                        }
                    }
                }
                Op::Unregister => {
                    let addr = spare.region(0, CHUNK).addr();
                    within(
                        &format!("{what}: register for unregister"),
                        p.a.register(spare.region(0, CHUNK)),
                    )
                    .await
                    .unwrap_or_else(|e| panic!("{what}: register failed: {e}"));
                    poll_then_drop(p.a.unregister(addr), polls).await;
                    // Either still registered (a register probe overlaps:
                    // unregister it for real) or gone (the probe registers
                    // it: unregister the probe).
                    poll_until(&format!("{what}: a dropped unregister settles"), || {
                        let a = Arc::clone(&p.a);
                        let r = spare.region(0, CHUNK);
                        async move {
                            match within("a register probe", a.register(r)).await {
                                Ok(()) | Err(Error::RegionOverlap { .. }) => {}
                                // Its unregister still finishing.
                                Err(Error::RegionHeld { .. }) => return None,
                                Err(e) => panic!("register probe after a dropped unregister: {e}"),
                            }
                            match within(
                                "unregister after a dropped unregister",
                                a.unregister(addr),
                            )
                            .await
                            {
                                Ok(()) => Some(()),
                                // The dropped unregister was past waiting
                                // for transfers and is completing on its
                                // own (the probe overlapped it): look again.
                                Err(Error::RegionNotRegistered { .. }) => None,
                                Err(e) => {
                                    panic!("unregister after a dropped unregister failed: {e}")
                                }
                            }
                        }
                    })
                    .await;
                }
                Op::CloseSegment => {
                    let seg2 = within(
                        &format!("{what}: open_segment"),
                        p.a.open_segment(p.b.segment_name()),
                    )
                    .await
                    .unwrap_or_else(|e| panic!("{what}: open_segment failed: {e}"));
                    let closed = poll_then_drop(p.a.close_segment(seg2), polls).await;
                    if let Some(Err(e)) = &closed {
                        panic!("{what}: close_segment failed: {e}");
                    }
                    // Either closed (UnknownSegment from then on) or still
                    // working, and then closable. The probes move memory of
                    // their own: a dropped transfer of the plan may still
                    // be running over `local` and `remote`, a race whose
                    // bytes are unspecified (and that a backend confirming
                    // writes by reading them back sees never land).
                    let probe = TransferRequest::write(probe_src.addr(), probe_dst.addr(), 64);
                    match within(
                        &format!("{what}: transfer on it"),
                        p.a.transfer(seg2, probe),
                    )
                    .await
                    {
                        Err(Error::UnknownSegment(s)) => assert_eq!(s, seg2, "{what}"),
                        Ok(()) => {
                            assert!(
                                closed.is_none(),
                                "{what}: a closed segment handle still moves bytes"
                            );
                            within(&format!("{what}: close_segment"), p.a.close_segment(seg2))
                                .await
                                .unwrap_or_else(|e| {
                                    panic!("{what}: close after a dropped close failed: {e}")
                                });
                        }
                        Err(e) => panic!(
                            "{what}: after a dropped close_segment the handle is neither \
                             closed nor working: {e}"
                        ),
                    }
                    // The first handle is unaffected.
                    within(
                        &format!("{what}: transfer on the first handle"),
                        p.a.transfer(p.seg, probe),
                    )
                    .await
                    .unwrap_or_else(|e| {
                        panic!("{what}: the pair's own handle broke after closing another: {e}")
                    });
                }
            }
        }
        for id in ids {
            let _ = within(&format!("{what}: waiting for batch {id}"), finish(&p.a, id)).await;
        }
        for (name, e) in [("initiator", &p.a), ("target", &p.b)] {
            poll_until(&format!("{what}: no batch left in the {name}"), || async {
                (e.live_batches() == Some(0)).then_some(())
            })
            .await;
        }
        // Once unregister returns, nothing writes the memory any more: not
        // the dropped writes into the target, not the dropped reads into the
        // initiator.
        within(
            &format!("{what}: unregister in the target"),
            remote.unregister(0),
        )
        .await;
        within(
            &format!("{what}: unregister in the initiator"),
            local.unregister(0),
        )
        .await;
        let (r0, l0) = (remote.bytes(), local.bytes());
        tokio::time::sleep(Duration::from_millis(10)).await;
        assert_bytes(
            &remote.bytes(),
            &r0,
            &format!("{what}: target memory after unregister returned"),
        );
        assert_bytes(
            &local.bytes(),
            &l0,
            &format!("{what}: initiator memory after unregister returned"),
        );
        remote.write(0, &vec![0u8; LEN]);
        local.write(0, &pattern(121 + case as u64, LEN));
        within(
            &format!("{what}: register in the target"),
            remote.register(0, LEN),
        )
        .await;
        within(
            &format!("{what}: register in the initiator"),
            local.register(0, LEN),
        )
        .await;
    }
    // Still working: a batch after all that moves every byte.
    let r = TransferRequest::write(local.addr(), remote.addr(), LEN as u64);
    within(
        "a transfer after the cancellation plans",
        p.a.transfer(p.seg, r),
    )
    .await
    .unwrap_or_else(|e| panic!("a transfer after the cancellation plans failed: {e}"));
    assert_bytes(
        &remote.bytes(),
        &local.bytes(),
        "a transfer after the cancellation plans",
    );
    drop(spare);
    probe_src.release().await;
    probe_dst.release().await;
    local.release().await;
    remote.release().await;
    Outcome::Passed
}

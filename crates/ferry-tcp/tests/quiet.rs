//! Quiet sockets (`crate::quiet`): a blocked caller that reads its own
//! answers (`ferry_core::assist::block_on`, what the Python package does)
//! wakes no runtime thread for them. Its own binary: tests running beside
//! it in one process take the CPU from the caller, and a caller preempted
//! between sending and reading lets its answer meet the readiness armed
//! for the reader's sleep (one wake-up, rightly).
#![cfg(target_os = "linux")]

mod common;

use std::time::Duration;

use common::{mem, runtime};
use ferry_core::assist::block_on;
use ferry_core::{TransferEngine, TransferRequest};
use ferry_tcp::{SameHost, TcpConfig, TcpEngine};

const BLOCK: usize = 4096;

/// A blocked caller reads its own answers on the socket path, and the
/// initiator's runtime threads are not woken for them: the connection's
/// socket reports readiness to the runtime only while a task waits on it
/// (`quiet` sockets). A socket registered with the runtime for good wakes
/// the worker parked in `epoll_wait` for every answer, while the caller
/// that reads it spins on another CPU (measured: ~1 worker wake-up per
/// call), which on a small host takes that CPU from the target.
#[test]
fn a_blocked_callers_answers_wake_no_runtime_thread() {
    const N: usize = 1000;
    let (rt_a, rt_b) = (runtime(), runtime());
    // The reader polls for as long as an answer is outstanding, also in a
    // slow debug build on a busy machine: a reader that gives up polling
    // sleeps on readiness, which rightly wakes a runtime thread.
    let cfg = TcpConfig::builder()
        .same_host(SameHost::Off)
        .spin_pending(Duration::from_millis(50))
        .build()
        .unwrap();
    // Clear sockets whatever FERRY_TEST_TLS says: a TLS connection keeps
    // the runtime's registration.
    let a = rt_a.block_on(TcpEngine::start(cfg.clone())).unwrap();
    let b = rt_b.block_on(TcpEngine::start(cfg)).unwrap();
    let src = rt_a.block_on(mem(&a, BLOCK, 3));
    let dst = rt_b.block_on(mem(&b, BLOCK, 0));
    let seg = block_on(rt_a.handle(), a.open_segment(b.segment_name())).unwrap();
    let write = || {
        let req = TransferRequest::write(src.addr(), dst.addr(), BLOCK as u64);
        // Plain `block_on`: no timer of the test's own in each call.
        block_on(rt_a.handle(), a.transfer(seg, req)).unwrap();
    };
    for _ in 0..50 {
        write();
    }
    let m = rt_a.metrics();
    let parks = || {
        (0..m.num_workers())
            .map(|w| m.worker_park_unpark_count(w))
            .sum::<u64>()
    };
    let before = parks();
    for _ in 0..N {
        write();
    }
    // Two counts per wake-up: the unpark and the park after it.
    let woken = (parks() - before) / 2;
    assert!(dst.to_vec() == vec![3u8; BLOCK]);
    assert!(
        (woken as usize) < N / 2,
        "the initiator's runtime threads woke {woken} times for {N} calls"
    );
}

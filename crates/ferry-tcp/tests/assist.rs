//! Blocked callers that drive their connection's reader themselves
//! (`ferry_core::assist::block_on`, what the Python package does): real
//! engines on loopback, on the same-host path and on the socket, with many
//! blocked threads and runtime tasks sharing one connection.
#![cfg(target_os = "linux")]

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::{engine, mem, pattern, runtime};
use ferry_core::assist::block_on;
use ferry_core::{Error, SegmentId, TransferEngine, TransferRequest};
use ferry_tcp::{SameHost, TcpConfig, TcpEngine};

const BLOCK: usize = 4096;
const THREADS: usize = 4;
const CALLS: usize = 200;

/// A call from a blocked thread, bounded so that a hang fails the test.
fn call<T>(
    rt: &tokio::runtime::Runtime,
    f: impl std::future::Future<Output = ferry_core::Result<T>>,
) -> ferry_core::Result<T> {
    block_on(rt.handle(), async {
        tokio::time::timeout(Duration::from_secs(20), f)
            .await
            .expect("a blocked call finishes")
    })
}

/// A runtime task moving the batch `reqs` again and again until the flag
/// returned is set; its handle gives how many batches it moved.
fn bulk_until_stopped(
    rt: &tokio::runtime::Runtime,
    a: &Arc<TcpEngine>,
    seg: SegmentId,
    reqs: Vec<TransferRequest>,
) -> (Arc<AtomicBool>, tokio::task::JoinHandle<u32>) {
    let stop = Arc::new(AtomicBool::new(false));
    let (a, flag) = (Arc::clone(a), Arc::clone(&stop));
    let bulk = rt.spawn(async move {
        let mut n = 0u32;
        while !flag.load(Ordering::Relaxed) {
            a.batch_transfer(seg, &reqs, None)
                .await
                .unwrap()
                .into_result()
                .unwrap();
            n += 1;
        }
        n
    });
    (stop, bulk)
}

/// Threads outside the runtime write and read back their own blocks, one
/// transfer per call, while a runtime task moves 64 KiB batches on the same
/// connection; every byte lands where it should, in both directions.
fn blocked_threads_and_tasks_share_a_connection(same_host: SameHost) {
    let rt = runtime();
    let (a, b) = rt.block_on(async {
        let cfg = TcpConfig::builder().same_host(same_host).build().unwrap();
        (engine(cfg.clone()).await, engine(cfg).await)
    });
    let span = THREADS * CALLS * BLOCK;
    let (src, back, dst, bulk_src, bulk_dst) = rt.block_on(async {
        (
            mem(&a, span, 0).await,
            mem(&a, span, 0).await,
            mem(&b, span, 0).await,
            mem(&a, 16 << 16, 0).await,
            mem(&b, 16 << 16, 0).await,
        )
    });
    let data = pattern(7, span);
    src.write(0, &data).unwrap();
    bulk_src.write(0, &pattern(9, 16 << 16)).unwrap();
    let seg = rt.block_on(a.open_segment(b.segment_name())).unwrap();
    // Runtime tasks: batches of 16 x 64 KiB, until the threads are done.
    let (s, d) = (bulk_src.addr(), bulk_dst.addr());
    let reqs: Vec<TransferRequest> = (0..16u64)
        .map(|i| TransferRequest::write(s + (i << 16), d + (i << 16), 1 << 16))
        .collect();
    let (stop, bulk) = bulk_until_stopped(&rt, &a, seg, reqs);
    std::thread::scope(|s| {
        for t in 0..THREADS {
            let (a, rt) = (&a, &rt);
            let (src, back, dst) = (src.addr(), back.addr(), dst.addr());
            s.spawn(move || {
                for i in 0..CALLS {
                    let off = ((t * CALLS + i) * BLOCK) as u64;
                    call(
                        rt,
                        a.transfer(
                            seg,
                            TransferRequest::write(src + off, dst + off, BLOCK as u64),
                        ),
                    )
                    .unwrap();
                    // Every other block also comes back by a read.
                    if i % 2 == 0 {
                        call(
                            rt,
                            a.transfer(
                                seg,
                                TransferRequest::read(back + off, dst + off, BLOCK as u64),
                            ),
                        )
                        .unwrap();
                    }
                }
            });
        }
    });
    stop.store(true, Ordering::Relaxed);
    let batches = rt.block_on(bulk).unwrap();
    assert!(batches > 0);
    assert!(dst.to_vec() == data, "every written block landed");
    let back = back.to_vec();
    for t in 0..THREADS {
        for i in (0..CALLS).step_by(2) {
            let r = (t * CALLS + i) * BLOCK..(t * CALLS + i + 1) * BLOCK;
            assert!(back[r.clone()] == data[r], "block {t}/{i} read back");
        }
    }
    assert!(bulk_dst.to_vec() == pattern(9, 16 << 16));
    // The connection is still fine for tasks once the threads are gone.
    rt.block_on(a.transfer(
        seg,
        TransferRequest::write(src.addr(), dst.addr(), BLOCK as u64),
    ))
    .unwrap();
}

#[test]
fn blocked_threads_and_tasks_share_a_same_host_connection() {
    blocked_threads_and_tasks_share_a_connection(SameHost::Auto);
}

#[test]
fn blocked_threads_and_tasks_share_a_socket_connection() {
    blocked_threads_and_tasks_share_a_connection(SameHost::Off);
}

/// The target goes away while a blocked caller drives the reader for a
/// long transfer: the call fails with the connection's error (no hang), and
/// the engine opens the segment again afterwards.
#[test]
fn a_blocked_caller_sees_the_connection_end() {
    let rt = runtime();
    let cfg = TcpConfig::builder()
        .same_host(SameHost::Off)
        .build()
        .unwrap();
    let (a, b) = rt.block_on(async { (engine(cfg.clone()).await, engine(cfg.clone()).await) });
    let len = 256 << 20;
    let (src, dst) = rt.block_on(async { (mem(&a, len, 1).await, mem(&b, len, 0).await) });
    let seg: SegmentId = rt.block_on(a.open_segment(b.segment_name())).unwrap();
    let b2 = Arc::clone(&b);
    let killer = rt.spawn(async move {
        tokio::time::sleep(Duration::from_millis(30)).await;
        b2.shutdown_now();
    });
    let mut failed = None;
    // Repeat until the shutdown lands inside a call.
    for _ in 0..100 {
        match call(
            &rt,
            a.transfer(
                seg,
                TransferRequest::write(src.addr(), dst.addr(), len as u64),
            ),
        ) {
            Ok(()) => continue,
            Err(e) => {
                failed = Some(e);
                break;
            }
        }
    }
    rt.block_on(killer).unwrap();
    let e = failed.expect("a call fails once the target is gone");
    assert!(
        matches!(
            e,
            Error::PeerLost { .. } | Error::SegmentUnavailable { .. } | Error::BatchFailed { .. }
        ),
        "{e:?}"
    );
    // A new target on the same engine works with blocked callers again.
    let c: Arc<TcpEngine> = rt.block_on(engine(cfg));
    let dst2 = rt.block_on(mem(&c, BLOCK, 0));
    let seg2 = call(&rt, a.open_segment(c.segment_name())).unwrap();
    call(
        &rt,
        a.transfer(
            seg2,
            TransferRequest::write(src.addr(), dst2.addr(), BLOCK as u64),
        ),
    )
    .unwrap();
    assert!(dst2.to_vec() == vec![1u8; BLOCK]);
}

/// Small calls of many blocked threads on one socket connection are
/// written together by whichever caller holds the connection's write lock
/// (`send_combined`), beside a runtime task whose 3 MiB writes are cut into
/// slices (small calls queued meanwhile go between the slices): calls of
/// every size around the limit of that path, writes and reads, all
/// complete and every byte lands where it should.
#[test]
fn small_calls_of_many_threads_are_written_together_and_all_land() {
    const THREADS: usize = 12;
    const CALLS: usize = 120;
    // Sizes below, at and above the combined path's limit (64 KiB of
    // frames: a header, then the payload).
    const SIZES: [usize; 5] = [1, 4096, (64 << 10) - 64, 64 << 10, (64 << 10) + 1];
    const SLOT: usize = (64 << 10) + 4096;
    let rt = runtime();
    let cfg = TcpConfig::builder()
        .same_host(SameHost::Off)
        .build()
        .unwrap();
    let (a, b) = rt.block_on(async { (engine(cfg.clone()).await, engine(cfg).await) });
    let span = THREADS * CALLS * SLOT;
    let big = 3 << 20;
    let (src, back, dst, big_src, big_dst) = rt.block_on(async {
        (
            mem(&a, span, 0).await,
            mem(&a, span, 0).await,
            mem(&b, span, 0).await,
            mem(&a, big, 0).await,
            mem(&b, big, 0).await,
        )
    });
    let data = pattern(11, span);
    src.write(0, &data).unwrap();
    big_src.write(0, &pattern(13, big)).unwrap();
    let seg = rt.block_on(a.open_segment(b.segment_name())).unwrap();
    let long = TransferRequest::write(big_src.addr(), big_dst.addr(), big as u64);
    let (stop, bulk) = bulk_until_stopped(&rt, &a, seg, vec![long]);
    std::thread::scope(|s| {
        for t in 0..THREADS {
            let (a, rt) = (&a, &rt);
            let (src, back, dst) = (src.addr(), back.addr(), dst.addr());
            s.spawn(move || {
                for i in 0..CALLS {
                    let off = ((t * CALLS + i) * SLOT) as u64;
                    let len = SIZES[(t + i) % SIZES.len()] as u64;
                    call(
                        rt,
                        a.transfer(seg, TransferRequest::write(src + off, dst + off, len)),
                    )
                    .unwrap();
                    if i % 3 == 0 {
                        call(
                            rt,
                            a.transfer(seg, TransferRequest::read(back + off, dst + off, len)),
                        )
                        .unwrap();
                    }
                }
            });
        }
    });
    stop.store(true, Ordering::Relaxed);
    assert!(rt.block_on(bulk).unwrap() > 0);
    let (dst, back) = (dst.to_vec(), back.to_vec());
    for t in 0..THREADS {
        for i in 0..CALLS {
            let off = (t * CALLS + i) * SLOT;
            let len = SIZES[(t + i) % SIZES.len()];
            let r = off..off + len;
            assert!(
                dst[r.clone()] == data[r.clone()],
                "call {t}/{i} ({len} bytes) landed"
            );
            assert!(
                dst[off + len..off + SLOT].iter().all(|&x| x == 0),
                "call {t}/{i} wrote nothing past its end"
            );
            if i % 3 == 0 {
                assert!(back[r.clone()] == data[r], "call {t}/{i} read back");
            }
        }
    }
    assert!(big_dst.to_vec() == pattern(13, big));
}

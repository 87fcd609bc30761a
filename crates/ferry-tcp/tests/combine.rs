//! Small calls queued for the writer that holds a connection's write lock
//! (`client::send::send_combined`): a call queued just before the holder
//! lets go is still written. Six threads call at once, again and again, so
//! that calls land while another holds the lock. The threads call in
//! rounds (a barrier between calls), so no later call writes a stranded
//! one along: a call left unwritten would never be answered, and the test
//! fails at its deadline. The window itself (between the holder's last
//! look at the queue and its letting go) is a few instructions wide and
//! met by chance only here (with the holder's second look removed, this
//! test passed 8 runs of 8); the unit test
//! `client::send::tests::a_call_queued_as_the_writer_lets_go_is_left_to_it`
//! puts a call in it every time, and fails without the second look.
#![cfg(target_os = "linux")]

mod common;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use common::{engine, mem, pattern, runtime};
use ferry_core::assist::block_on;
use ferry_core::{TransferEngine, TransferRequest};
use ferry_tcp::{SameHost, TcpConfig};

#[test]
fn a_call_queued_as_the_writer_lets_go_is_still_written() {
    const THREADS: usize = 6;
    const CALLS: usize = 100;
    const BLOCK: usize = 512;
    let rt = runtime();
    let cfg = TcpConfig::builder()
        .same_host(SameHost::Off)
        .request_timeout(Duration::from_secs(30))
        .build()
        .unwrap();
    let (a, b) = rt.block_on(async { (engine(cfg.clone()).await, engine(cfg).await) });
    let span = THREADS * CALLS * BLOCK;
    let (src, dst) = rt.block_on(async { (mem(&a, span, 0).await, mem(&b, span, 0).await) });
    let data = pattern(21, span);
    src.write(0, &data).unwrap();
    let seg = rt.block_on(a.open_segment(b.segment_name())).unwrap();
    // Calls answered so far; a thread starts call i once every thread's
    // call i - 1 is answered (or one thread has failed: all stop).
    let answered = AtomicUsize::new(0);
    let failed = AtomicBool::new(false);
    std::thread::scope(|s| {
        for t in 0..THREADS {
            let (a, rt, answered, failed) = (&a, &rt, &answered, &failed);
            let (src, dst) = (src.addr(), dst.addr());
            s.spawn(move || {
                for i in 0..CALLS {
                    while answered.load(Ordering::Acquire) < i * THREADS {
                        if failed.load(Ordering::Acquire) {
                            return;
                        }
                        std::thread::yield_now();
                    }
                    let off = ((t * CALLS + i) * BLOCK) as u64;
                    let done = block_on(rt.handle(), async {
                        tokio::time::timeout(
                            Duration::from_secs(10),
                            a.transfer(
                                seg,
                                TransferRequest::write(src + off, dst + off, BLOCK as u64),
                            ),
                        )
                        .await
                    });
                    if !matches!(done, Ok(Ok(()))) {
                        failed.store(true, Ordering::Release);
                    }
                    done.expect("every queued call is written and answered")
                        .unwrap();
                    answered.fetch_add(1, Ordering::AcqRel);
                }
            });
        }
    });
    assert!(dst.to_vec() == data, "every call landed");
}

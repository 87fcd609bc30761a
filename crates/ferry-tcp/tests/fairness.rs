//! A small call beside a long batch on one connection (socket path): the
//! batch's sender lets go of the connection between its frames every
//! `FAIR_SLICE` (1 MiB) of payload, so the small call's frame goes in
//! between and is answered while most of the batch is still to come,
//! instead of waiting behind all of it.
#![cfg(target_os = "linux")]

mod common;

use std::time::{Duration, Instant};

use common::{engine, mem};
use ferry_core::{TransferEngine, TransferRequest};
use ferry_tcp::{SameHost, TcpConfig};

const BLOCK: u64 = 1 << 20;
/// The batch: long enough that the test thread, which issues the small
/// write once the first block has landed, is not outrun by the whole batch
/// while it waits for a CPU (the batch's threads poll; on two CPUs the
/// test thread can wait tens of ms: with 64 blocks it lost 1 to 3 runs in
/// 40 before and after the small-call path changed).
const BLOCKS: u64 = 256;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_small_write_overtakes_the_rest_of_a_long_batch() {
    let cfg = TcpConfig::builder()
        .same_host(SameHost::Off)
        .build()
        .unwrap();
    let a = engine(cfg.clone()).await;
    let b = engine(cfg).await;
    let span = (BLOCK * BLOCKS) as usize;
    let src = mem(&a, span, 7).await;
    let dst = mem(&b, span, 0).await;
    let small_src = mem(&a, 4096, 9).await;
    let small_dst = mem(&b, 4096, 0).await;
    let seg = a.open_segment(b.segment_name()).await.unwrap();
    let reqs: Vec<TransferRequest> = (0..BLOCKS)
        .map(|i| TransferRequest::write(src.addr() + i * BLOCK, dst.addr() + i * BLOCK, BLOCK))
        .collect();
    let big = {
        let a = std::sync::Arc::clone(&a);
        tokio::spawn(async move {
            a.batch_transfer(seg, &reqs, None)
                .await
                .unwrap()
                .into_result()
                .unwrap();
        })
    };
    // Until the batch's first block has landed at the target.
    let started = Instant::now();
    let view = |at: usize| {
        let mut byte = [0u8];
        dst.read(at, &mut byte).unwrap();
        byte[0]
    };
    while view(BLOCK as usize - 1) != 7 {
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "the batch never started"
        );
        tokio::time::sleep(Duration::from_micros(200)).await;
    }
    a.transfer(
        seg,
        TransferRequest::write(small_src.addr(), small_dst.addr(), 4096),
    )
    .await
    .unwrap();
    let last = view(((BLOCKS - 1) * BLOCK) as usize);
    big.await.unwrap();
    assert_eq!(small_dst.to_vec(), vec![9u8; 4096]);
    assert_eq!(dst.to_vec(), vec![7u8; span], "the batch landed whole");
    assert_eq!(
        last, 0,
        "the small write was answered only after the batch's last block had landed"
    );
}

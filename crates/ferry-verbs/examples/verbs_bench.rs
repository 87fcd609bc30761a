//! A small throughput benchmark of the verbs backend: two engines in one
//! process on the same device (loopback through the NIC, or through the
//! kernel for soft-RoCE), RDMA WRITE and READ in batches of equal requests,
//! reported as MiB/s and as a ratio to a `memcpy` of the same bytes measured
//! in the same run.
//!
//! ```text
//! cargo run --release -p ferry-verbs --features rdma --example verbs_bench -- [URL] [TOTAL_MIB]
//! ```
//!
//! `URL` defaults to `$FERRY_VERBS_URL` or `verbs://`; other arguments
//! starting with `-` are ignored (so test-harness flags do no harm).

use std::sync::Arc;
use std::time::{Duration, Instant};

use ferry_core::{Error, HostBuffer, Location, TransferEngine, TransferRequest};
use ferry_verbs::{VerbsConfig, VerbsEngine};

fn mib_s(bytes: usize, d: Duration) -> f64 {
    bytes as f64 / (1 << 20) as f64 / d.as_secs_f64().max(1e-9)
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with('-'))
        .collect();
    let url = args
        .first()
        .cloned()
        .or_else(|| std::env::var("FERRY_VERBS_URL").ok())
        .unwrap_or_else(|| "verbs://".into());
    let total_mib: usize = args.get(1).and_then(|s| s.parse().ok()).unwrap_or(64);
    let total = total_mib << 20;
    let cfg = VerbsConfig::from_url(&url).expect("URL");
    let start = |c: VerbsConfig| async move { VerbsEngine::start(c).await };
    let (a, b) = match (start(cfg.clone()).await, start(cfg).await) {
        (Ok(a), Ok(b)) => (Arc::new(a), Arc::new(b)),
        (Err(Error::Unavailable { reason, .. }), _)
        | (_, Err(Error::Unavailable { reason, .. })) => {
            println!("skipped: verbs_bench: the verbs backend is unavailable: {reason}");
            return;
        }
        (Err(e), _) | (_, Err(e)) => panic!("starting the engines: {e}"),
    };
    for (k, v) in a.backend_info().details {
        println!("{k}: {v}");
    }
    let src = HostBuffer::new(total).expect("alloc");
    let dst = HostBuffer::new(total).expect("alloc");
    src.fill(0xa5);
    // SAFETY: the buffers live until the end of the benchmark, after the engines.
    a.register(unsafe { src.region(Location::cpu(0)) })
        .await
        .expect("register");
    // SAFETY: the buffers live until the end of the benchmark, after the engines.
    b.register(unsafe { dst.region(Location::cpu(0)) })
        .await
        .expect("register");
    let seg = a.open_segment(b.segment_name()).await.expect("open");

    // Baseline: memcpy of the same bytes, same run (destination touched
    // once first, so page faults are not measured).
    let mut scratch = vec![0u8; total];
    src.read(0, &mut scratch).expect("copy");
    let t = Instant::now();
    src.read(0, &mut scratch).expect("copy");
    let memcpy = mib_s(total, t.elapsed());
    std::hint::black_box(&scratch);
    println!("baseline memcpy: {memcpy:.0} MiB/s ({total_mib} MiB)");
    println!(
        "{:>6} {:>9} {:>9} {:>12} {:>12}",
        "op", "req size", "requests", "MiB/s", "vs memcpy"
    );
    for size in [4usize << 10, 64 << 10, 1 << 20, 8 << 20] {
        let n = total / size;
        for write in [true, false] {
            let reqs: Vec<_> = (0..n as u64)
                .map(|i| {
                    let off = i * size as u64;
                    if write {
                        TransferRequest::write(src.addr() + off, dst.addr() + off, size as u64)
                    } else {
                        TransferRequest::read(src.addr() + off, dst.addr() + off, size as u64)
                    }
                })
                .collect();
            let t = Instant::now();
            let report = a.batch_transfer(seg, &reqs, None).await.expect("batch");
            let d = t.elapsed();
            assert!(report.is_success(), "{:?}", report.failures().next());
            let rate = mib_s(total, d);
            println!(
                "{:>6} {:>8}K {:>9} {:>12.1} {:>11.4}x",
                if write { "WRITE" } else { "READ" },
                size >> 10,
                n,
                rate,
                rate / memcpy
            );
        }
    }
    assert_eq!(
        dst.to_vec().iter().filter(|b| **b != 0xa5).count(),
        0,
        "payload check"
    );
    println!("verbs_bench: done");
}

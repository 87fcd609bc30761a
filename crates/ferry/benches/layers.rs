//! What the default observability layers (tracing over metrics, as
//! `ferry::Engine` stacks them over the capability adapter) cost per batch,
//! measured deterministically: both stacks over the in-process engine (a
//! `memcpy` between two engines of this process, faster than any network
//! path, so the ratio here bounds the relative cost on a real backend from
//! above), one after the other in the same run.
//!
//! Run: `cargo bench -p ferry --bench layers`. Criterion prints the time per
//! batch of each stack; nothing here asserts anything.
// criterion_group! makes an undocumented public function.
#![allow(missing_docs)]

use std::sync::Arc;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use ferry_core::inproc::InprocEngine;
use ferry_core::layer::LayerExt;
use ferry_core::{
    Capabilities, CapabilityAdapter, DynTransferEngine, HostBuffer, Location, MemoryRegion,
    Metrics, MetricsLayer, RegisteredBuffer, TracingLayer, TransferEngine, TransferRequest,
};

const POINTS: [(usize, usize); 4] = [(4096, 1), (64, 256), (4096, 256), (1 << 20, 16)];

fn bench(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .expect("runtime");
    let mut group = c.benchmark_group("layers");
    for (block, batch) in POINTS {
        let span = block * batch * 2;
        let stacks: Vec<(&str, Arc<dyn DynTransferEngine>)> = rt.block_on(async {
            let raw = || InprocEngine::new("", Capabilities::all()).expect("engine");
            let adapter = CapabilityAdapter::new(raw());
            let native = adapter.report().native;
            let full = CapabilityAdapter::new(raw())
                .layer(MetricsLayer::new(Metrics::new()).native(native))
                .layer(TracingLayer::new());
            vec![
                (
                    "adapter only",
                    Arc::new(adapter) as Arc<dyn DynTransferEngine>,
                ),
                ("tracing+metrics+adapter", Arc::new(full)),
            ]
        });
        let peer: Arc<dyn DynTransferEngine> =
            Arc::new(InprocEngine::new("", Capabilities::all()).expect("peer"));
        // One source and one destination for both stacks, so that neither
        // gets better-placed memory than the other (at 1 MiB x 16 fresh
        // buffers alone moved one stack's time by ±30 % between runs).
        let mem = HostBuffer::new(span).expect("memory");
        let remote = rt.block_on(async {
            RegisteredBuffer::new(Arc::clone(&peer), span)
                .await
                .expect("remote")
        });
        group.throughput(Throughput::Bytes((block * batch) as u64));
        // A, B, A, B: a drift of the machine during the run shows as a
        // difference between the two runs of one stack.
        for round in 1..=2 {
            for (name, engine) in &stacks {
                let seg = rt.block_on(async {
                    // SAFETY: `mem` outlives this registration (it is
                    // unregistered below, before the next one and before
                    // `mem` drops) and no Rust reference into it is held.
                    let region = unsafe {
                        MemoryRegion::from_raw_parts(mem.as_ptr(), mem.len(), Location::cpu(0))
                    };
                    engine.register(region).await.expect("register");
                    engine
                        .open_segment(peer.segment_name())
                        .await
                        .expect("segment")
                });
                // Blocks with gaps between them: no layer can merge them.
                let requests: Vec<TransferRequest> = (0..batch)
                    .map(|i| {
                        let off = (i * 2 * block) as u64;
                        TransferRequest::write(mem.addr() + off, remote.addr() + off, block as u64)
                    })
                    .collect();
                let id = BenchmarkId::new(format!("{name} ({round})"), format!("{block}x{batch}"));
                group.bench_function(id, |b| {
                    b.to_async(&rt).iter(|| async {
                        if batch == 1 {
                            engine.transfer(seg, requests[0]).await.expect("transfer");
                        } else {
                            engine
                                .batch_transfer(seg, &requests, None)
                                .await
                                .expect("batch");
                        }
                    })
                });
                rt.block_on(async {
                    engine.close_segment(seg).await.expect("close");
                    engine.unregister(mem.addr()).await.expect("unregister");
                });
            }
        }
        rt.block_on(async { remote.release().await.expect("release") });
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);

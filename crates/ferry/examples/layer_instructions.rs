//! Runs `N` batches of `COUNT` writes of `BLOCK` bytes through one stack
//! over the in-process engine, for counting the instructions the default
//! observability layers add per batch (timing cannot resolve them on a
//! shared machine; an instruction count can):
//!
//! ```sh
//! cargo build --release --example layer_instructions
//! for s in adapter layered; do for n in 100 200; do
//!   valgrind --tool=callgrind --callgrind-out-file=/dev/null \
//!     target/release/examples/layer_instructions $s $n 4096 256 2>&1 | grep refs
//! done; done
//! ```
//!
//! (Instructions per batch of a stack: the difference between its 200- and
//! 100-batch runs over 100; the start-up cancels.) Arguments: `adapter` |
//! `layered`, `N`, `BLOCK`, `COUNT`. Prints the bytes moved.

use std::sync::Arc;

use ferry_core::inproc::InprocEngine;
use ferry_core::layer::LayerExt;
use ferry_core::{
    Capabilities, CapabilityAdapter, DynTransferEngine, Metrics, MetricsLayer, RegisteredBuffer,
    TracingLayer, TransferEngine, TransferRequest,
};

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let usage = "usage: layer_instructions adapter|layered N BLOCK COUNT";
    let [_, stack, n, block, count] = &args[..] else {
        eprintln!("{usage}");
        std::process::exit(2);
    };
    let parse = |s: &str| -> usize {
        s.parse().unwrap_or_else(|_| {
            eprintln!("{usage}");
            std::process::exit(2)
        })
    };
    let (n, block, count) = (parse(n), parse(block), parse(count));
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        let raw = || InprocEngine::new("", Capabilities::all()).expect("engine");
        let engine: Arc<dyn DynTransferEngine> = match stack.as_str() {
            "adapter" => Arc::new(CapabilityAdapter::new(raw())),
            "layered" => {
                let native = CapabilityAdapter::new(raw()).report().native;
                Arc::new(
                    CapabilityAdapter::new(raw())
                        .layer(MetricsLayer::new(Metrics::new()).native(native))
                        .layer(TracingLayer::new()),
                )
            }
            _ => {
                eprintln!("{usage}");
                std::process::exit(2);
            }
        };
        let peer: Arc<dyn DynTransferEngine> = Arc::new(raw());
        let span = block * count * 2;
        let local = RegisteredBuffer::new(Arc::clone(&engine), span)
            .await
            .expect("local");
        let remote = RegisteredBuffer::new(Arc::clone(&peer), span)
            .await
            .expect("remote");
        let seg = engine
            .open_segment(peer.segment_name())
            .await
            .expect("segment");
        let requests: Vec<TransferRequest> = (0..count)
            .map(|i| {
                let off = (i * 2 * block) as u64;
                TransferRequest::write(local.addr() + off, remote.addr() + off, block as u64)
            })
            .collect();
        let mut bytes = 0u64;
        for _ in 0..n {
            let report = engine
                .batch_transfer(seg, &requests, None)
                .await
                .expect("batch");
            assert!(report.results.iter().all(|r| r.is_ok()), "a request failed");
            bytes += (block * count) as u64;
        }
        println!("{bytes} bytes in {n} batches through the {stack} stack");
        engine.close_segment(seg).await.expect("close");
        local.release().await.expect("release");
        remote.release().await.expect("release");
    });
}

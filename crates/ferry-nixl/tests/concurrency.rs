//! Many tasks at once on one engine (NIXL's own Rust users call an agent
//! from one thread): concurrent batches, async batches and notifications
//! from 8 tasks, every byte checked.

mod common;

use ferry_core::DynTransferEngine;
use std::sync::Arc;

use ferry_core::conformance::{pattern, skip_unavailable};
use ferry_core::{Notification, RegisteredBuffer, TransferEngine, TransferRequest};

const TASKS: usize = 8;
const ROUNDS: usize = 25;
const BLOCK: usize = 64 * 1024;

#[test]
fn many_tasks_share_one_engine() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(4)
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        let (a, b) = match (common::engine().await, common::engine().await) {
            (Ok(a), Ok(b)) => (
                a as Arc<dyn DynTransferEngine>,
                b as Arc<dyn DynTransferEngine>,
            ),
            (Err(e), _) | (_, Err(e)) => {
                skip_unavailable("many_tasks_share_one_engine", &e);
                return;
            }
        };
        let seg = a.open_segment(b.segment_name()).await.expect("open");
        let src = Arc::new(
            RegisteredBuffer::new(Arc::clone(&a), TASKS * 4 * BLOCK)
                .await
                .expect("src"),
        );
        let dst = Arc::new(
            RegisteredBuffer::new(Arc::clone(&b), TASKS * 4 * BLOCK)
                .await
                .expect("dst"),
        );
        let back = Arc::new(
            RegisteredBuffer::new(Arc::clone(&a), TASKS * 4 * BLOCK)
                .await
                .expect("back"),
        );
        let data = pattern(77, TASKS * 4 * BLOCK);
        src.memory().write(0, &data).expect("fill");
        let mut tasks = Vec::new();
        for t in 0..TASKS {
            let (a, src, dst, back) = (
                Arc::clone(&a),
                Arc::clone(&src),
                Arc::clone(&dst),
                Arc::clone(&back),
            );
            tasks.push(tokio::spawn(async move {
                let base = (t * 4 * BLOCK) as u64;
                for round in 0..ROUNDS {
                    let writes: Vec<TransferRequest> = (0..4)
                        .map(|k| {
                            let off = base + (k * BLOCK) as u64;
                            TransferRequest::write(src.addr() + off, dst.addr() + off, BLOCK as u64)
                        })
                        .collect();
                    let note = Notification::new(format!("task-{t}"), format!("round-{round}"));
                    if round % 2 == 0 {
                        a.batch_transfer(seg, &writes, Some(&note))
                            .await
                            .expect("batch_transfer")
                            .into_result()
                            .expect("writes");
                    } else {
                        let id = a.submit(seg, &writes, Some(&note)).await.expect("submit");
                        a.wait(id)
                            .await
                            .expect("wait")
                            .into_result()
                            .expect("writes");
                    }
                    let reads: Vec<TransferRequest> = (0..4)
                        .map(|k| {
                            let off = base + (k * BLOCK) as u64;
                            TransferRequest::read(back.addr() + off, dst.addr() + off, BLOCK as u64)
                        })
                        .collect();
                    a.batch_transfer(seg, &reads, None)
                        .await
                        .expect("batch_transfer")
                        .into_result()
                        .expect("reads");
                }
            }));
        }
        for t in tasks {
            t.await.expect("task panicked");
        }
        assert_eq!(dst.memory().to_vec(), data, "peer memory");
        assert_eq!(back.memory().to_vec(), data, "read back");
        let notes = b.take_notifications().await.expect("notifications");
        assert_eq!(notes.len(), TASKS * ROUNDS, "one notification per batch");
        for t in 0..TASKS {
            let mine: Vec<_> = notes
                .iter()
                .filter(|n| n.name == format!("task-{t}"))
                .collect();
            assert_eq!(mine.len(), ROUNDS, "task {t}");
        }
        assert_eq!(a.live_batches(), Some(0));
        a.close_segment(seg).await.expect("close");
        for buf in [src, dst, back] {
            match Arc::try_unwrap(buf) {
                Ok(b) => b.release().await.expect("release"),
                Err(_) => panic!("a task still holds a buffer"),
            }
        }
    });
}

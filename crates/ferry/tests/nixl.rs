//! The facade over the nixl backend (feature `nixl`), on the real NIXL
//! library (the pinned wheel): `Engine::open("nixl://?lib=…")`, a batch with
//! a notification, the capability report.
#![cfg(feature = "nixl")]

use std::path::PathBuf;
use std::sync::Arc;

use ferry::{
    BackendKind, Engine, Error, Notification, Operation, RegisteredBuffer, Support, TransferEngine,
    TransferRequest,
};
use ferry_core::conformance::skip_unavailable;
use ferry_nixl::test_support::install_pinned_wheel;

fn library() -> Option<PathBuf> {
    let venv = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join("nixl")
        .join("venv");
    match install_pinned_wheel(&venv) {
        Ok(lib) => Some(lib),
        Err(reason) => {
            let e = Error::Unavailable {
                backend: "nixl".to_owned(),
                reason,
            };
            skip_unavailable("ferry nixl facade", &e);
            None
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nixl_urls_open_engines_that_move_bytes_with_notifications() {
    let Some(lib) = library() else { return };
    let url = format!("nixl://?backends=UCX&lib={}&strict=1", lib.display());
    let decode = Arc::new(Engine::open(&url).await.expect("open decode"));
    let prefill = Arc::new(Engine::open(&url).await.expect("open prefill"));
    assert_eq!(decode.kind(), Some(BackendKind::Nixl));
    let report = decode.report();
    for op in Operation::OPTIONAL {
        assert_eq!(report.support(op), Support::Native, "{op}");
    }
    let kv = RegisteredBuffer::new(Arc::clone(&decode), 1 << 20)
        .await
        .expect("kv");
    let src = RegisteredBuffer::new(Arc::clone(&prefill), 3 * 4096)
        .await
        .expect("src");
    let data: Vec<u8> = (0..3 * 4096).map(|i| (i % 251) as u8).collect();
    src.memory().write(0, &data).expect("fill");
    let peer = prefill
        .open_segment(decode.segment_name())
        .await
        .expect("open segment");
    let reqs: Vec<TransferRequest> = [9u64, 2, 5]
        .iter()
        .enumerate()
        .map(|(i, b)| {
            TransferRequest::write(src.addr() + (i * 4096) as u64, kv.addr() + b * 4096, 4096)
        })
        .collect();
    let note = Notification::new("prefill-0", "req-42:kv-ready");
    prefill
        .batch_transfer(peer, &reqs, Some(&note))
        .await
        .expect("batch")
        .into_result()
        .expect("every request");
    assert_eq!(
        decode.take_notifications().await.expect("notes"),
        vec![note]
    );
    for (i, b) in [9usize, 2, 5].iter().enumerate() {
        let mut block = vec![0u8; 4096];
        kv.memory().read(b * 4096, &mut block).expect("read");
        assert_eq!(block, data[i * 4096..(i + 1) * 4096], "block {b}");
    }
    prefill.close_segment(peer).await.expect("close");
    src.release().await.expect("release");
    kv.release().await.expect("release");
}

#[test]
fn unknown_nixl_parameters_are_refused_by_name() {
    let e = Engine::open("nixl://?colour=blue");
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    match rt.block_on(e) {
        Err(Error::InvalidArgument(m)) => assert!(m.contains("`colour`"), "{m}"),
        other => panic!("expected InvalidArgument, got {other:?}"),
    }
}

//! Requests built from typed spans: the decode side's descriptor crosses
//! "out of band" as JSON, the prefill side cuts both sides into blocks and
//! writes them; a span outside the peer's registration is refused by the
//! peer, never written elsewhere.

use ferry_core::DynTransferEngine;
use std::sync::Arc;

use ferry_core::inproc::InprocEngine;
use ferry_core::{
    Capabilities, Error, RegisteredBuffer, RemoteSpan, TransferEngine, TransferRequest,
};

fn engine(name: &str) -> Arc<dyn DynTransferEngine> {
    Arc::new(
        InprocEngine::new(name, {
            let mut caps = Capabilities::default();
            caps.batch_transfer = true;
            caps
        })
        .expect("engine"),
    )
}

#[tokio::test]
async fn a_descriptor_sent_as_json_is_written_block_by_block() {
    const BLOCK: u64 = 4096;
    let decode = engine("spans-decode");
    let prefill = engine("spans-prefill");
    let kv = RegisteredBuffer::new(Arc::clone(&decode), 16 * BLOCK as usize)
        .await
        .unwrap();
    // Decode → prefill, out of band: blocks 4..8 of the cache.
    let wire =
        serde_json::to_string(&kv.descriptor().slice(4 * BLOCK..8 * BLOCK).unwrap()).unwrap();

    let staging = RegisteredBuffer::new(Arc::clone(&prefill), 4 * BLOCK as usize)
        .await
        .unwrap();
    let bytes: Vec<u8> = (0..4 * BLOCK as usize)
        .map(|i| (i * 7 % 253) as u8)
        .collect();
    staging.memory().write(0, &bytes).unwrap();
    let target: RemoteSpan = serde_json::from_str(&wire).unwrap();
    assert_eq!(target.segment, "spans-decode");
    let peer = prefill.open_segment(&target.segment).await.unwrap();
    // Block i of the staging area to block 3 - i of the target.
    let src = staging.span().blocks(BLOCK).unwrap();
    let dst = target.blocks(BLOCK).unwrap();
    let requests: Vec<TransferRequest> = src
        .iter()
        .zip(dst.iter().rev())
        .map(|(l, r)| TransferRequest::write_span(*l, r).unwrap())
        .collect();
    prefill
        .batch_transfer(peer, &requests, None)
        .await
        .unwrap()
        .into_result()
        .unwrap();
    let got = kv.memory().to_vec();
    assert!(got[..4 * BLOCK as usize].iter().all(|&b| b == 0));
    assert!(got[8 * BLOCK as usize..].iter().all(|&b| b == 0));
    for i in 0..4usize {
        let b = BLOCK as usize;
        let at = (4 + 3 - i) * b;
        assert_eq!(&got[at..at + b], &bytes[i * b..(i + 1) * b], "block {i}");
    }

    // A forged descriptor past the registration: refused by the peer.
    let forged = RemoteSpan::new(&target.segment, kv.addr() + 15 * BLOCK, 2 * BLOCK);
    let r = TransferRequest::write_span(staging.slice(..2 * BLOCK).unwrap(), &forged).unwrap();
    match prefill.transfer(peer, r).await {
        Err(Error::AddressNotRegistered { .. }) => {}
        other => panic!("a write past the peer's registration: {other:?}"),
    }
    assert_eq!(
        kv.memory().to_vec(),
        got,
        "memory changed by a refused write"
    );
    // Lengths that differ are refused before anything is sent.
    assert!(matches!(
        TransferRequest::write_span(staging.slice(..BLOCK).unwrap(), &dst[0].slice(..1).unwrap()),
        Err(Error::InvalidArgument(_))
    ));
    prefill.close_segment(peer).await.unwrap();
    staging.release().await.unwrap();
    kv.release().await.unwrap();
}

//! `Engine::fast_path` over real TCP engines of one process (the same-host
//! path): a granted 4 KiB write is done by the calling thread, lands, and is
//! counted once by the metrics; what the path cannot do it declines with
//! nothing moved and nothing counted; a closed segment or an engine
//! shutting down declines everything, and `transfer` says why.
#![cfg(feature = "tcp")]

use std::sync::Arc;
use std::time::{Duration, Instant};

use ferry::{Engine, Error, RegisteredBuffer, TransferEngine, TransferRequest};

const SIZE: usize = 1 << 20;
/// Above the largest request the TCP backend copies as a granted one
/// (128 KiB).
const BIG: usize = 256 << 10;

/// Two engines of one process, a registered buffer on each, the
/// initiator's segment of the target and its fast path once granted
/// (`None`: no same-host path here, the test skips).
struct Setup {
    init: Arc<Engine>,
    src: RegisteredBuffer<Engine>,
    dst: RegisteredBuffer<Engine>,
    seg: ferry::SegmentId,
    fast: ferry::FastPath,
}

async fn setup() -> Option<Setup> {
    let init = Arc::new(Engine::open("tcp://127.0.0.1:0").await.unwrap());
    let target = Arc::new(Engine::open("tcp://127.0.0.1:0").await.unwrap());
    let src = RegisteredBuffer::new(Arc::clone(&init), SIZE)
        .await
        .unwrap();
    let dst = RegisteredBuffer::new(Arc::clone(&target), SIZE)
        .await
        .unwrap();
    let seg = init.open_segment(target.segment_name()).await.unwrap();
    let warm = TransferRequest::write(src.addr(), dst.addr(), 4096);
    let fast = granted(&init, seg, warm).await?;
    Some(Setup {
        init,
        src,
        dst,
        seg,
        fast,
    })
}

/// The fast path of `seg`, once the target granted a 4 KiB write of `src`
/// to `dst` (grants follow the same-host agreement); `None` when this
/// machine gives no same-host path (cross-memory attach refused): the
/// caller skips, saying so.
async fn granted(
    init: &Engine,
    seg: ferry::SegmentId,
    req: TransferRequest,
) -> Option<ferry::FastPath> {
    let fast = init.fast_path(seg).expect("a tcp segment has a fast path");
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        // The usual way until the grant is there (it establishes the
        // connection and the same-host agreement).
        if let Some(done) = fast.try_transfer(&req) {
            done.unwrap();
            return Some(fast);
        }
        init.transfer(seg, req).await.unwrap();
        let path = init.metrics().peers.values().find_map(|p| p.path.clone());
        if path.as_deref() == Some("socket") || Instant::now() > deadline {
            eprintln!("skipped: no granted same-host path here (path {path:?})");
            return None;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[tokio::test]
async fn a_granted_write_is_done_here_lands_and_is_counted_once() {
    let Some(Setup {
        init,
        src,
        dst,
        seg,
        fast,
    }) = setup().await
    else {
        return;
    };

    let data: Vec<u8> = (0..4096u32).map(|i| (i * 7 + 3) as u8).collect();
    src.memory().write(0, &data).unwrap();
    let before = init.metrics();
    let req = TransferRequest::write(src.addr(), dst.addr() + 8192, 4096);
    assert!(matches!(fast.try_transfer(&req), Some(Ok(()))));
    let mut got = vec![0; 4096];
    dst.memory().read(8192, &mut got).unwrap();
    assert_eq!(got, data, "the fast path's bytes landed");
    let after = init.metrics();
    assert_eq!(
        after.requests_ok(),
        before.requests_ok() + 1,
        "counted once"
    );
    assert_eq!(after.bytes_total(), before.bytes_total() + 4096);
    assert_eq!(after.batches_in_flight, 0);

    // Too big to be granted: declined, nothing moved, nothing counted;
    // `transfer` then does it.
    let big = TransferRequest::write(src.addr(), dst.addr(), BIG as u64);
    dst.memory().fill(0);
    src.memory().fill(0xab);
    assert!(
        fast.try_transfer(&big).is_none(),
        "a 256 KiB write declined"
    );
    dst.memory().read(0, &mut got).unwrap();
    assert!(
        got.iter().all(|&b| b == 0),
        "a declined request moved bytes"
    );
    assert_eq!(init.metrics().requests_ok(), after.requests_ok());
    init.transfer(seg, big).await.unwrap();
    dst.memory().read(BIG - 4096, &mut got).unwrap();
    assert!(got.iter().all(|&b| b == 0xab));

    // Outside the peer's region: declined (the usual way fails, typed).
    let outside = TransferRequest::write(src.addr(), dst.addr() + SIZE as u64, 16);
    assert!(fast.try_transfer(&outside).is_none());
    assert!(init.transfer(seg, outside).await.is_err());

    // A closed segment: every request declined, and `transfer` says the
    // segment is unknown.
    init.close_segment(seg).await.unwrap();
    assert!(
        fast.try_transfer(&req).is_none(),
        "a closed segment's path ran"
    );
    let e = init.transfer(seg, req).await.unwrap_err();
    assert!(matches!(e, Error::UnknownSegment(_)), "{e}");
    assert!(init.fast_path(seg).is_none(), "an unknown segment has none");
}

/// The `_count` of the duration histogram of `call` in the engine's
/// Prometheus text (0 when absent): this engine's series only (the
/// registry is the process's, shared with the other tests' engines).
fn calls_counted(engine: &Engine, call: &str) -> u64 {
    let text = engine.metrics_registry().expect("metrics on").encode();
    let this = format!("engine=\"{}\"", engine.segment_name());
    text.lines()
        .filter(|l| l.starts_with("ferry_batch_duration_seconds_count"))
        .filter(|l| l.contains(&this))
        .filter(|l| l.contains(&format!("call=\"{call}\"")))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
        .sum()
}

#[tokio::test]
async fn a_batch_of_one_is_counted_as_a_batch_and_a_transfer_as_a_transfer() {
    let Some(Setup {
        init,
        src,
        dst,
        seg: _,
        fast,
    }) = setup().await
    else {
        return;
    };
    let req = TransferRequest::write(src.addr(), dst.addr(), 4096);
    let (t0, b0) = (
        calls_counted(&init, "transfer"),
        calls_counted(&init, "batch_transfer"),
    );
    src.memory().fill(0x3c);
    assert!(matches!(fast.try_batch_of_one(&req), Some(Ok(()))));
    let mut got = vec![0; 4096];
    dst.memory().read(0, &mut got).unwrap();
    assert!(got.iter().all(|&b| b == 0x3c), "the batch's bytes landed");
    assert_eq!(calls_counted(&init, "batch_transfer"), b0 + 1);
    assert_eq!(calls_counted(&init, "transfer"), t0);
    assert!(matches!(fast.try_transfer(&req), Some(Ok(()))));
    assert_eq!(calls_counted(&init, "transfer"), t0 + 1);
    assert_eq!(calls_counted(&init, "batch_transfer"), b0 + 1);
}

#[tokio::test]
async fn an_engine_shutting_down_declines_and_transfer_says_so() {
    let Some(Setup {
        init,
        src,
        dst,
        seg,
        fast,
    }) = setup().await
    else {
        return;
    };
    let req = TransferRequest::write(src.addr(), dst.addr(), 4096);
    dst.memory().fill(0);
    src.memory().fill(0x5a);
    init.shutdown().await.unwrap();
    assert!(fast.try_transfer(&req).is_none(), "ran after shutdown");
    let mut got = vec![0; 4096];
    dst.memory().read(0, &mut got).unwrap();
    assert!(got.iter().all(|&b| b == 0), "bytes moved after shutdown");
    let e = init.transfer(seg, req).await.unwrap_err();
    assert!(matches!(e, Error::Canceled(_)), "{e}");
}

#[cfg(feature = "inproc")]
#[tokio::test]
async fn the_inproc_scheme_has_no_fast_path() {
    let a = Engine::open("inproc://").await.unwrap();
    let b = Engine::open("inproc://").await.unwrap();
    let seg = a.open_segment(b.segment_name()).await.unwrap();
    assert!(a.fast_path(seg).is_none());
}

//! `Engine` with segment discovery through etcd (`metadata=etcd://…`,
//! cargo feature `etcd`) against a real etcd (Debian's `etcd-server`,
//! binary `etcd` on `PATH` or `/usr/bin/etcd`), each test's own, started
//! through `ferry_discovery::test_support` (loopback, free ports, a data
//! directory under the target's tmp directory, killed at the end).
//!
//! Without the `etcd` feature or the binary each test prints
//! `skipped: <test>: <reason>` and passes, unless `FERRY_REQUIRE_BACKENDS`
//! lists `etcd` (then it fails).
#![cfg(feature = "tcp")]

use std::net::TcpListener;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ferry::{Engine, Error, RegisteredBuffer, TransferEngine, TransferRequest};
use ferry_discovery::test_support::{etcd_binary, free_port, Etcd};
use ferry_discovery::EtcdDiscovery;

/// The lease TTL of the tests (etcd's minimum with default settings).
const TTL: Duration = Duration::from_secs(2);
/// Longest wait for etcd to start or a port to be free again.
const WAIT: Duration = Duration::from_secs(30);
const PREFIX: &str = "/ferry-engine-test";

async fn start_etcd(test: &str) -> Option<Etcd> {
    Etcd::start(test, Path::new(env!("CARGO_TARGET_TMPDIR"))).await
}

/// An engine URL on `listen` publishing `name` in `etcd`.
fn url(etcd: &Etcd, listen: &str, name: &str) -> String {
    format!(
        "tcp://{listen}?metadata=etcd://{}&prefix={PREFIX}&lease_ttl_ms={}&segment_name={name}",
        etcd.endpoint(),
        TTL.as_millis()
    )
}

fn is_unavailable(r: &ferry::Result<ferry::SegmentId>, name: &str) -> bool {
    matches!(r, Err(Error::SegmentUnavailable { name: n, .. }) if n == name)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transfer_by_logical_name_and_the_name_goes_at_shutdown() {
    let test = "transfer_by_logical_name_and_the_name_goes_at_shutdown";
    let Some(etcd) = start_etcd(test).await else {
        return;
    };
    let prefill = Arc::new(
        Engine::open(&url(&etcd, "127.0.0.1:0", "prefill-0"))
            .await
            .unwrap(),
    );
    let decode = Arc::new(
        Engine::open(&url(&etcd, "127.0.0.1:0", "decode-0"))
            .await
            .unwrap(),
    );
    assert_eq!(prefill.published_name(), Some("prefill-0"));
    assert_eq!(decode.published_name(), Some("decode-0"));
    // What etcd holds: the name and the address, nothing else of note.
    let etcd_client = EtcdDiscovery::connect(&[etcd.endpoint()], PREFIX, TTL)
        .await
        .unwrap();
    let d = etcd_client.lookup("decode-0").await.unwrap();
    assert_eq!(d.addresses, vec![decode.segment_name().to_owned()]);
    assert!(
        d.protocol.min >= 1 && d.protocol.min <= d.protocol.max,
        "{d:?}"
    );

    let src = RegisteredBuffer::new(Arc::clone(&prefill), 8192)
        .await
        .unwrap();
    let dst = RegisteredBuffer::new(Arc::clone(&decode), 8192)
        .await
        .unwrap();
    let data: Vec<u8> = (0..8192u32).map(|i| (i * 7 % 251) as u8).collect();
    src.memory().write(0, &data).unwrap();
    // Opened by its logical name only.
    let seg = prefill.open_segment("decode-0").await.unwrap();
    prefill
        .batch_transfer(
            seg,
            &[
                TransferRequest::write(src.addr(), dst.addr() + 4096, 4096),
                TransferRequest::write(src.addr() + 4096, dst.addr(), 4096),
            ],
            None,
        )
        .await
        .unwrap()
        .into_result()
        .unwrap();
    let got = dst.memory().to_vec();
    assert_eq!(&got[4096..], &data[..4096]);
    assert_eq!(&got[..4096], &data[4096..]);
    // And back the other way, by name too.
    let back = decode.open_segment("prefill-0").await.unwrap();
    decode
        .transfer(
            back,
            TransferRequest::read(dst.addr(), src.addr() + 100, 1000),
        )
        .await
        .unwrap();
    assert_eq!(&dst.memory().to_vec()[..1000], &data[100..1100]);

    // A name nobody published: typed, naming it.
    let r = prefill.open_segment("nobody-7").await;
    assert!(is_unavailable(&r, "nobody-7"), "{r:?}");

    prefill.close_segment(seg).await.unwrap();
    src.release().await.unwrap();
    dst.release().await.unwrap();
    decode.shutdown().await.unwrap();
    // Revoked at once: no wait for the lease.
    let r = prefill.open_segment("decode-0").await;
    assert!(is_unavailable(&r, "decode-0"), "{r:?}");
    prefill.shutdown().await.unwrap();
    let r = etcd_client.lookup("prefill-0").await;
    assert!(matches!(r, Err(Error::SegmentUnavailable { .. })), "{r:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_taken_name_fails_the_second_start_and_leaves_nothing_running() {
    let test = "a_taken_name_fails_the_second_start_and_leaves_nothing_running";
    let Some(etcd) = start_etcd(test).await else {
        return;
    };
    let first = Engine::open(&url(&etcd, "127.0.0.1:0", "prefill-1"))
        .await
        .unwrap();
    let port = free_port();
    let listen = format!("127.0.0.1:{port}");
    let e = Engine::open(&url(&etcd, &listen, "prefill-1"))
        .await
        .unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
    assert!(e.to_string().contains("prefill-1"), "{e}");
    // The loser's listener is closed: its port can be bound again.
    let deadline = Instant::now() + WAIT;
    while let Err(err) = TcpListener::bind(&listen) {
        assert!(
            Instant::now() < deadline,
            "the port of the engine that lost the name is still in use: {err}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // The winner still holds the name, at its own address.
    let etcd_client = EtcdDiscovery::connect(&[etcd.endpoint()], PREFIX, TTL)
        .await
        .unwrap();
    let d = etcd_client.lookup("prefill-1").await.unwrap();
    assert_eq!(d.addresses, vec![first.segment_name().to_owned()]);
    // The same port, another name: starts.
    let again = Engine::open(&url(&etcd, &listen, "prefill-2"))
        .await
        .unwrap();
    assert_eq!(again.segment_name(), listen);
    again.shutdown().await.unwrap();
    first.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_the_engine_revokes_its_name_in_the_background() {
    let test = "dropping_the_engine_revokes_its_name_in_the_background";
    let Some(etcd) = start_etcd(test).await else {
        return;
    };
    // A TTL far longer than the wait below: the name goes because the
    // lease is revoked, not because it expired.
    let url = format!(
        "tcp://127.0.0.1:0?metadata=etcd://{}&prefix={PREFIX}&lease_ttl_ms=30000&segment_name=dropped",
        etcd.endpoint()
    );
    let engine = Engine::open(&url).await.unwrap();
    let etcd_client = EtcdDiscovery::connect(&[etcd.endpoint()], PREFIX, TTL)
        .await
        .unwrap();
    etcd_client.lookup("dropped").await.unwrap();
    drop(engine);
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        match etcd_client.lookup("dropped").await {
            Err(Error::SegmentUnavailable { .. }) => break,
            r => assert!(Instant::now() < deadline, "still published: {r:?}"),
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unspecified_listen_address_is_not_published() {
    let test = "an_unspecified_listen_address_is_not_published";
    let Some(etcd) = start_etcd(test).await else {
        return;
    };
    let e = Engine::open(&url(&etcd, "0.0.0.0:0", "anywhere"))
        .await
        .unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
    assert!(e.to_string().contains("0.0.0.0"), "{e}");
    let etcd_client = EtcdDiscovery::connect(&[etcd.endpoint()], PREFIX, TTL)
        .await
        .unwrap();
    let r = etcd_client.lookup("anywhere").await;
    assert!(matches!(r, Err(Error::SegmentUnavailable { .. })), "{r:?}");
}

#[tokio::test]
async fn an_etcd_that_does_not_answer_fails_the_start_typed() {
    let test = "an_etcd_that_does_not_answer_fails_the_start_typed";
    if etcd_binary(test).is_none() {
        return;
    }
    let url = format!(
        "tcp://127.0.0.1:0?metadata=etcd://127.0.0.1:{}&segment_name=x",
        free_port()
    );
    let e = Engine::open(&url).await.unwrap_err();
    assert!(
        matches!(&e, Error::Unavailable { backend, .. } if backend == "etcd"),
        "{e}"
    );
}

#[cfg(not(feature = "etcd"))]
#[test]
fn without_the_feature_etcd_is_refused_naming_it() {
    let e = ferry::EngineConfig::from_url("tcp://127.0.0.1:0?metadata=etcd://127.0.0.1:2379")
        .unwrap_err();
    assert!(matches!(e, Error::Unavailable { .. }), "{e}");
    assert!(e.to_string().contains("cargo feature `etcd`"), "{e}");
}

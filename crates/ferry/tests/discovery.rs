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

/// A multi engine of two TCP transports publishing `name` in `etcd`.
fn multi_url(etcd: &Etcd, name: &str) -> String {
    let inner = "tcp%3A%2F%2F127.0.0.1%3A0";
    format!(
        "multi://?transports=tcp,tcp2&tcp.url={inner}&tcp2.url={inner}&metadata=etcd://{}\
         &prefix={PREFIX}&lease_ttl_ms={}&segment_name={name}",
        etcd.endpoint(),
        TTL.as_millis()
    )
}

/// A multi engine's descriptor in etcd is its multi segment name (every
/// transport it listens on); a peer, multi or plain TCP, opens it by the
/// logical name and moves bytes over a transport both have; the name goes
/// at shutdown.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_multi_engine_is_published_and_reached_by_its_logical_name() {
    let test = "a_multi_engine_is_published_and_reached_by_its_logical_name";
    let Some(etcd) = start_etcd(test).await else {
        return;
    };
    let decode = Arc::new(Engine::open(&multi_url(&etcd, "decode-m")).await.unwrap());
    let prefill = Arc::new(Engine::open(&multi_url(&etcd, "prefill-m")).await.unwrap());
    let plain = Arc::new(
        Engine::open(&url(&etcd, "127.0.0.1:0", "plain-0"))
            .await
            .unwrap(),
    );
    assert_eq!(decode.published_name(), Some("decode-m"));
    let multi_name = decode.segment_name().to_owned();
    assert!(
        multi_name.starts_with(ferry::multi::SEGMENT_PREFIX),
        "{multi_name}"
    );
    assert_eq!(multi_name.matches("tcp=").count(), 2, "{multi_name}");
    let etcd_client = EtcdDiscovery::connect(&[etcd.endpoint()], PREFIX, TTL)
        .await
        .unwrap();
    // The multi name first, then each transport's own address (what a
    // plain TCP engine can open).
    let d = etcd_client.lookup("decode-m").await.unwrap();
    let own: Vec<String> = multi_name
        .trim_start_matches(ferry::multi::SEGMENT_PREFIX)
        .split(';')
        .map(|part| part.trim_start_matches("tcp=").to_owned())
        .collect();
    assert_eq!(d.addresses[0], multi_name);
    assert_eq!(&d.addresses[1..], &own[..]);

    let dst = RegisteredBuffer::new(Arc::clone(&decode), 8192)
        .await
        .unwrap();
    for (k, from) in [&prefill, &plain].into_iter().enumerate() {
        let src = RegisteredBuffer::new(Arc::clone(from), 4096).await.unwrap();
        let data: Vec<u8> = (0..4096u32).map(|i| (i * 13 + k as u32) as u8).collect();
        src.memory().write(0, &data).unwrap();
        let seg = from.open_segment("decode-m").await.unwrap();
        from.transfer(seg, TransferRequest::write(src.addr(), dst.addr(), 4096))
            .await
            .unwrap();
        assert_eq!(&dst.memory().to_vec()[..4096], &data[..], "from peer {k}");
        if k == 0 {
            let choice = prefill
                .transport_choice(&multi_name)
                .expect("the multi peer's transport choice");
            assert_eq!(choice.transport, "tcp", "{choice}");
        }
        from.close_segment(seg).await.unwrap();
        src.release().await.unwrap();
    }

    dst.release().await.unwrap();
    decode.shutdown().await.unwrap();
    let r = prefill.open_segment("decode-m").await;
    assert!(is_unavailable(&r, "decode-m"), "{r:?}");
    prefill.shutdown().await.unwrap();
    plain.shutdown().await.unwrap();
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

/// How much later than the lease TTL a dead peer's segment may still be
/// usable: etcd looks for expired leases every 500 ms and deletes through
/// raft, the watch delivers the deletion, the test polls every 50 ms; the
/// rest is margin for a loaded host (crates/ferry-discovery measured
/// 2.2-2.55 s from `kill -9` to deletion with a 2 s TTL).
const EXPIRY_SLACK: Duration = Duration::from_millis(1500);
const CHILD_ENV: &str = "FERRY_ENGINE_CHILD";

/// An engine URL on `listen` publishing `name` in etcd at `endpoint`.
fn url_at(endpoint: &str, listen: &str, name: &str) -> String {
    format!(
        "tcp://{listen}?metadata=etcd://{endpoint}&prefix={PREFIX}&lease_ttl_ms={}&segment_name={name}",
        TTL.as_millis()
    )
}

/// `SegmentUnavailable` naming `name` and (in hex) `lease`.
fn gone_naming_lease<T: std::fmt::Debug>(r: &ferry::Result<T>, name: &str, lease: i64) -> bool {
    matches!(r, Err(Error::SegmentUnavailable { name: n, reason })
        if n == name && reason.contains(&format!("lease {lease:x}")))
}

async fn lease_of(etcd: &Etcd, name: &str) -> i64 {
    EtcdDiscovery::connect(&[etcd.endpoint()], PREFIX, TTL)
        .await
        .unwrap()
        .resolve(name)
        .await
        .unwrap()
        .lease
}

/// Transfers `req` on `seg` every 50 ms until `done` holds or `limit`
/// passed; the last outcome and when.
async fn poll_transfer(
    engine: &Engine,
    seg: ferry::SegmentId,
    req: TransferRequest,
    limit: Duration,
    done: impl Fn(&ferry::Result<()>) -> bool,
) -> (ferry::Result<()>, Duration) {
    let t0 = Instant::now();
    loop {
        let r = engine.transfer(seg, req).await;
        if done(&r) || t0.elapsed() > limit {
            return (r, t0.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Run by `a_killed_peer_fails_open_and_transfers_typed_naming_the_lease`
/// in a child process: an engine publishing the name given, with a
/// registered buffer; prints `ready <addr>` and waits to be killed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "helper process of a_killed_peer_fails_open_and_transfers_typed_naming_the_lease"]
async fn child_engine() {
    let Ok(spec) = std::env::var(CHILD_ENV) else {
        return;
    };
    let (endpoint, name) = spec.split_once('|').unwrap();
    let engine = Arc::new(
        Engine::open(&url_at(endpoint, "127.0.0.1:0", name))
            .await
            .unwrap(),
    );
    let buf = RegisteredBuffer::new(Arc::clone(&engine), 4096)
        .await
        .unwrap();
    println!("ready {}", buf.addr());
    std::future::pending::<()>().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_peer_fails_open_and_transfers_typed_naming_the_lease() {
    use std::io::{BufRead, BufReader};
    use std::process::{Command, Stdio};
    let test = "a_killed_peer_fails_open_and_transfers_typed_naming_the_lease";
    let Some(etcd) = start_etcd(test).await else {
        return;
    };
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "child_engine", "--ignored", "--nocapture"])
        .env(CHILD_ENV, format!("{}|node-9", etcd.endpoint()))
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let out = child.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(out).lines().map_while(Result::ok) {
            if let Some(addr) = line.strip_prefix("ready ") {
                let _ = tx.send(addr.trim().parse::<u64>().unwrap());
            }
        }
    });
    let Ok(remote) = rx.recv_timeout(WAIT) else {
        let _ = child.kill();
        panic!("the child engine did not start within {WAIT:?}");
    };
    let engine = Arc::new(
        Engine::open(&url(&etcd, "127.0.0.1:0", "observer-9"))
            .await
            .unwrap(),
    );
    let buf = RegisteredBuffer::new(Arc::clone(&engine), 8192)
        .await
        .unwrap();
    let data: Vec<u8> = (0..4096u32).map(|i| (i % 253) as u8).collect();
    buf.memory().write(0, &data).unwrap();
    let seg = engine.open_segment("node-9").await.unwrap();
    let write = TransferRequest::write(buf.addr(), remote, 4096);
    engine.transfer(seg, write).await.unwrap();
    engine
        .transfer(seg, TransferRequest::read(buf.addr() + 4096, remote, 4096))
        .await
        .unwrap();
    assert_eq!(&buf.memory().to_vec()[4096..], &data[..]);
    let lease = lease_of(&etcd, "node-9").await;

    child.kill().unwrap(); // SIGKILL: nothing revokes the lease
    child.wait().unwrap();
    let bound = TTL + EXPIRY_SLACK;
    let (r, after) = poll_transfer(&engine, seg, write, bound + WAIT, |r| {
        gone_naming_lease(r, "node-9", lease)
    })
    .await;
    assert!(gone_naming_lease(&r, "node-9", lease), "{r:?}");
    eprintln!("{test}: transfers to the killed peer failed typed after {after:?} (TTL {TTL:?})");
    assert!(after <= bound, "only after {after:?}, bound {bound:?}");
    // Every entry point says the same, at once.
    let r = engine.batch_transfer(seg, &[write], None).await;
    assert!(gone_naming_lease(&r, "node-9", lease), "{r:?}");
    // Refused on the spot: on the future's first poll.
    let mut fut = std::pin::pin!(engine.transfer(seg, write));
    let first = std::future::Future::poll(
        fut.as_mut(),
        &mut std::task::Context::from_waker(std::task::Waker::noop()),
    );
    let std::task::Poll::Ready(r) = first else {
        panic!("a transfer to a gone peer waited")
    };
    assert!(gone_naming_lease(&r, "node-9", lease), "{r:?}");
    let r = engine.open_segment("node-9").await;
    assert!(gone_naming_lease(&r, "node-9", lease), "{r:?}");
    engine.close_segment(seg).await.unwrap();
    buf.release().await.unwrap();
    engine.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_clean_shutdown_fails_transfers_typed_at_once() {
    let test = "a_clean_shutdown_fails_transfers_typed_at_once";
    let Some(etcd) = start_etcd(test).await else {
        return;
    };
    // A TTL far longer than the bound below: the name goes because the
    // lease is revoked, not because it expired.
    let long = |name: &str| {
        format!(
            "tcp://127.0.0.1:0?metadata=etcd://{}&prefix={PREFIX}&lease_ttl_ms=30000&segment_name={name}",
            etcd.endpoint()
        )
    };
    let peer = Arc::new(Engine::open(&long("decode-8")).await.unwrap());
    let engine = Arc::new(Engine::open(&long("prefill-8")).await.unwrap());
    let dst = RegisteredBuffer::new(Arc::clone(&peer), 4096)
        .await
        .unwrap();
    let src = RegisteredBuffer::new(Arc::clone(&engine), 4096)
        .await
        .unwrap();
    let seg = engine.open_segment("decode-8").await.unwrap();
    let write = TransferRequest::write(src.addr(), dst.addr(), 4096);
    engine.transfer(seg, write).await.unwrap();
    let lease = lease_of(&etcd, "decode-8").await;
    dst.release().await.unwrap();
    peer.shutdown().await.unwrap();
    let bound = Duration::from_secs(1);
    let (r, after) = poll_transfer(&engine, seg, write, bound + WAIT, |r| {
        gone_naming_lease(r, "decode-8", lease)
    })
    .await;
    assert!(gone_naming_lease(&r, "decode-8", lease), "{r:?}");
    assert!(after <= bound, "only after {after:?} (lease TTL 30 s)");
    let r = engine.open_segment("decode-8").await;
    assert!(gone_naming_lease(&r, "decode-8", lease), "{r:?}");
    engine.close_segment(seg).await.unwrap();
    src.release().await.unwrap();
    engine.shutdown().await.unwrap();
}

/// An engine publishing `name` with a registered buffer of `len` bytes.
async fn peer(etcd: &Etcd, name: &str, len: usize) -> (Arc<Engine>, RegisteredBuffer<Engine>) {
    let e = Arc::new(Engine::open(&url(etcd, "127.0.0.1:0", name)).await.unwrap());
    let b = RegisteredBuffer::new(Arc::clone(&e), len).await.unwrap();
    (e, b)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_restarted_at_a_new_port_is_reached_by_the_next_transfers() {
    let test = "a_peer_restarted_at_a_new_port_is_reached_by_the_next_transfers";
    let Some(etcd) = start_etcd(test).await else {
        return;
    };
    let (engine, src) = peer(&etcd, "prefill-5", 4096).await;
    let data: Vec<u8> = (0..4096u32).map(|i| (i * 13 % 241) as u8).collect();
    src.memory().write(0, &data).unwrap();
    let (first, first_buf) = peer(&etcd, "decode-5", 4096).await;
    let seg = engine.open_segment("decode-5").await.unwrap();
    engine
        .transfer(
            seg,
            TransferRequest::write(src.addr(), first_buf.addr(), 4096),
        )
        .await
        .unwrap();
    assert_eq!(first_buf.memory().to_vec(), data);
    let first_lease = lease_of(&etcd, "decode-5").await;
    let first_addr = first.segment_name().to_owned();

    // 1. Stopped, seen gone, then started again elsewhere.
    first_buf.release().await.unwrap();
    first.shutdown().await.unwrap();
    drop(first);
    let probe = TransferRequest::write(src.addr(), 0x1000, 1);
    let (r, _) = poll_transfer(&engine, seg, probe, WAIT, |r| {
        gone_naming_lease(r, "decode-5", first_lease)
    })
    .await;
    assert!(gone_naming_lease(&r, "decode-5", first_lease), "{r:?}");
    let (second, second_buf) = peer(&etcd, "decode-5", 4096).await;
    assert_ne!(second.segment_name(), first_addr);
    let to_second = TransferRequest::write(src.addr(), second_buf.addr(), 4096);
    // Until the watch delivers the registration (milliseconds) the name
    // is still gone; then the transfer reconnects at the new address.
    let (r, after) = poll_transfer(&engine, seg, to_second, Duration::from_secs(5), |r| {
        r.is_ok() || !matches!(r, Err(Error::SegmentUnavailable { .. }))
    })
    .await;
    r.unwrap();
    eprintln!("{test}: reached the new address {after:?} after it was published");
    assert_eq!(second_buf.memory().to_vec(), data);
    assert!(engine.peer_report(second.segment_name()).is_some());
    assert!(
        engine.peer_report(&first_addr).is_none(),
        "the segment at the old address is closed"
    );

    // 2. Moved with no pause between stop and start: transfers in the
    // gap may fail (typed: gone, or the old connection lost), then reach
    // the new address.
    second_buf.release().await.unwrap();
    second.shutdown().await.unwrap();
    let (third, third_buf) = peer(&etcd, "decode-5", 4096).await;
    let to_third = TransferRequest::write(src.addr(), third_buf.addr(), 4096);
    let (r, _) = poll_transfer(
        &engine,
        seg,
        to_third,
        Duration::from_secs(5),
        |r| match r {
            Ok(()) => true,
            Err(Error::SegmentUnavailable { .. } | Error::PeerLost { .. }) => false,
            Err(_) => true,
        },
    )
    .await;
    r.unwrap();
    assert_eq!(third_buf.memory().to_vec(), data);

    engine.close_segment(seg).await.unwrap();
    third_buf.release().await.unwrap();
    third.shutdown().await.unwrap();
    src.release().await.unwrap();
    engine.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_lost_under_load_transfers_go_on_and_names_come_back() {
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    let test = "etcd_lost_under_load_transfers_go_on_and_names_come_back";
    let Some(mut etcd) = start_etcd(test).await else {
        return;
    };
    let (engine, src) = peer(&etcd, "prefill-7", 65536).await;
    let (decode, dst) = peer(&etcd, "decode-7", 65536).await;
    let seg = engine.open_segment("decode-7").await.unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let done = Arc::new(AtomicU64::new(0));
    let load = {
        let (engine, stop, done) = (Arc::clone(&engine), Arc::clone(&stop), Arc::clone(&done));
        let (s, d) = (src.addr(), dst.addr());
        tokio::spawn(async move {
            let mut failures = Vec::new();
            while !stop.load(Ordering::Relaxed) {
                let reqs: Vec<_> = (0..4)
                    .map(|i| TransferRequest::write(s + i * 16384, d + i * 16384, 16384))
                    .collect();
                match engine.batch_transfer(seg, &reqs, None).await {
                    Ok(r) => match r.into_result() {
                        Ok(_) => {
                            done.fetch_add(1, Ordering::Relaxed);
                        }
                        Err(e) => failures.push(e.to_string()),
                    },
                    Err(e) => failures.push(e.to_string()),
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            failures
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;

    etcd.kill();
    let before = done.load(Ordering::Relaxed);
    // New lookups fail typed (the name is not one this engine opened).
    let r = engine.open_segment("prefill-7").await;
    assert!(
        matches!(&r, Err(Error::Unavailable { backend, .. }) if backend == "etcd"),
        "{r:?}"
    );
    // Down for longer than the lease TTL.
    tokio::time::sleep(TTL + Duration::from_secs(1)).await;
    let during = done.load(Ordering::Relaxed) - before;
    assert!(during > 10, "only {during} batches while etcd was down");

    etcd.run().await; // same data directory and ports
    let client = EtcdDiscovery::connect(&[etcd.endpoint()], PREFIX, TTL)
        .await
        .unwrap();
    for name in ["prefill-7", "decode-7"] {
        let addr = if name == "prefill-7" {
            engine.segment_name()
        } else {
            decode.segment_name()
        };
        let d = client.lookup(name).await.unwrap();
        assert_eq!(d.addresses, vec![addr.to_owned()]);
    }
    // Kept alive after the restart (the keepers found etcd again).
    tokio::time::sleep(TTL * 2 + Duration::from_millis(500)).await;
    client.lookup("prefill-7").await.unwrap();
    client.lookup("decode-7").await.unwrap();
    // Lookups work again.
    let again = decode.open_segment("prefill-7").await.unwrap();
    decode.close_segment(again).await.unwrap();

    stop.store(true, Ordering::Relaxed);
    let failures = load.await.unwrap();
    assert!(
        failures.is_empty(),
        "{} transfers failed: {:?}",
        failures.len(),
        &failures[..failures.len().min(3)]
    );
    engine.close_segment(seg).await.unwrap();
    src.release().await.unwrap();
    dst.release().await.unwrap();
    decode.shutdown().await.unwrap();
    engine.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_engines_racing_for_one_name_one_wins() {
    let test = "two_engines_racing_for_one_name_one_wins";
    let Some(etcd) = start_etcd(test).await else {
        return;
    };
    let client = EtcdDiscovery::connect(&[etcd.endpoint()], PREFIX, TTL)
        .await
        .unwrap();
    for round in 0..4 {
        let name = format!("race-{round}");
        let u = url(&etcd, "127.0.0.1:0", &name);
        let (a, b) = tokio::join!(Engine::open(&u), Engine::open(&u));
        let (winner, loser) = match (a, b) {
            (Ok(w), Err(l)) | (Err(l), Ok(w)) => (w, l),
            (a, b) => panic!("exactly one must win: {a:?} / {b:?}"),
        };
        let lease = client.resolve(&name).await.unwrap().lease;
        match &loser {
            Error::InvalidArgument(m) => {
                assert!(m.contains(&format!("{name:?}")), "{m}");
                assert!(m.contains(&format!("lease {lease:x}")), "{m}");
            }
            e => panic!("the loser's error: {e}"),
        }
        assert_eq!(
            client.lookup(&name).await.unwrap().addresses,
            vec![winner.segment_name().to_owned()]
        );
        winner.shutdown().await.unwrap();
    }
}

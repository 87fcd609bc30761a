//! `ferry-discovery` against a real etcd (Debian's `etcd-server`, binary
//! `etcd` on `PATH` or `/usr/bin/etcd`): each test starts its own etcd
//! through `ferry_discovery::test_support` (loopback, free ports, a data
//! directory under the target's tmp directory, killed at the end).
//!
//! Without the `etcd` feature or without the binary each test prints
//! `skipped: <test>: <reason>` and passes, unless `FERRY_REQUIRE_BACKENDS`
//! lists `etcd` (then it fails). `child_publisher` is a helper that
//! `lease_expires_after_the_publisher_is_killed` runs in a child process.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use ferry_discovery::test_support::{free_port, Etcd};
use ferry_discovery::{Descriptor, Error, EtcdDiscovery, ProtocolRange, SegmentEvent};

/// The lease TTL of the tests (etcd's minimum with default settings).
const TTL: Duration = Duration::from_secs(2);
/// How much later than the TTL a dead publisher's key may still be seen:
/// etcd looks for expired leases every 500 ms, then deletes through raft;
/// the lookups poll every 50 ms; the rest is margin for a loaded host.
/// Measured: 2.2-2.55 s after `kill -9` with a 2 s TTL.
const EXPIRY_SLACK: Duration = Duration::from_millis(1500);
/// Longest wait for anything else (etcd starting, a watch event).
const WAIT: Duration = Duration::from_secs(30);
const CHILD_ENV: &str = "FERRY_DISCOVERY_CHILD";

async fn start_etcd(test: &str) -> Option<Etcd> {
    Etcd::start(test, Path::new(env!("CARGO_TARGET_TMPDIR"))).await
}

fn descriptor(name: &str, addr: &str) -> Descriptor {
    Descriptor {
        name: name.into(),
        addresses: vec![addr.into()],
        protocol: ProtocolRange { min: 3, max: 4 },
        features: vec!["tls".into()],
    }
}

async fn connect(etcd: &Etcd) -> EtcdDiscovery {
    EtcdDiscovery::connect(&[etcd.endpoint()], "/ferry-test", TTL)
        .await
        .expect("connect to the test etcd")
}

/// Polls `lookup(name)` every 50 ms until `done` holds, up to `limit`.
async fn poll_lookup(
    d: &EtcdDiscovery,
    name: &str,
    limit: Duration,
    done: impl Fn(&Result<Descriptor, Error>) -> bool,
) -> (Result<Descriptor, Error>, Duration) {
    let t0 = Instant::now();
    loop {
        let r = d.lookup(name).await;
        if done(&r) || t0.elapsed() > limit {
            return (r, t0.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn is_gone(r: &Result<Descriptor, Error>, name: &str) -> bool {
    matches!(r, Err(Error::SegmentUnavailable { name: n, .. }) if n == name)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publish_then_lookup() {
    let Some(etcd) = start_etcd("publish_then_lookup").await else {
        return;
    };
    let d = connect(&etcd).await;
    let desc = descriptor("prefill-0", "127.0.0.1:4100");
    let p = d.publish(&desc).await.unwrap();
    assert_eq!(p.key(), "/ferry-test/segments/prefill-0");
    assert!(p.lease_ttl() >= TTL);
    // Another connection sees it.
    let other = connect(&etcd).await;
    assert_eq!(other.lookup("prefill-0").await.unwrap(), desc);
    // A name never published: typed, naming the segment.
    let e = other.lookup("decode-9").await.unwrap_err();
    assert!(is_gone(&Err(e.clone()), "decode-9"), "{e}");
    // Still there after more than two TTLs: the lease is kept alive.
    tokio::time::sleep(TTL * 2 + Duration::from_millis(500)).await;
    assert_eq!(other.lookup("prefill-0").await.unwrap(), desc);
    p.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreachable_etcd_fails_typed_within_the_timeout() {
    let port = free_port(); // nothing listens there
    let t0 = Instant::now();
    let timeout = Duration::from_secs(1);
    let e = EtcdDiscovery::connect_with_timeout(&[format!("127.0.0.1:{port}")], "/p", TTL, timeout)
        .await
        .unwrap_err();
    assert!(
        matches!(&e, Error::Unavailable { backend, .. } if backend == "etcd"),
        "{e}"
    );
    assert!(
        t0.elapsed() < timeout + Duration::from_millis(500),
        "{:?}",
        t0.elapsed()
    );
    if cfg!(feature = "etcd") {
        assert!(e.to_string().contains(&format!("127.0.0.1:{port}")), "{e}");
    } else {
        assert!(e.to_string().contains("`etcd` cargo feature"), "{e}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_removes_the_key_at_once() {
    let Some(etcd) = start_etcd("shutdown_removes_the_key_at_once").await else {
        return;
    };
    let d = connect(&etcd).await;
    let p = d
        .publish(&descriptor("decode-1", "127.0.0.1:4200"))
        .await
        .unwrap();
    assert!(d.lookup("decode-1").await.is_ok());
    p.shutdown().await.unwrap();
    let r = d.lookup("decode-1").await;
    assert!(is_gone(&r, "decode-1"), "{r:?}");
    // The name is free again.
    let p = d
        .publish(&descriptor("decode-1", "127.0.0.1:4201"))
        .await
        .unwrap();
    // Dropping revokes too (in the background): gone well before the TTL.
    drop(p);
    let (r, after) = poll_lookup(&d, "decode-1", TTL, |r| r.is_err()).await;
    assert!(is_gone(&r, "decode-1"), "{r:?}");
    assert!(
        after < TTL / 2,
        "dropped publication still visible after {after:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_publishers_race_for_one_name() {
    let Some(etcd) = start_etcd("two_publishers_race_for_one_name").await else {
        return;
    };
    let a = connect(&etcd).await;
    let b = connect(&etcd).await;
    for round in 0..5 {
        let name = format!("race-{round}");
        let (da, db) = (
            descriptor(&name, "10.0.0.1:1"),
            descriptor(&name, "10.0.0.2:2"),
        );
        let (ra, rb) = tokio::join!(a.publish(&da), b.publish(&db));
        let (winner, loser, addr) = match (ra, rb) {
            (Ok(p), Err(e)) => (p, e, "10.0.0.1:1"),
            (Err(e), Ok(p)) => (p, e, "10.0.0.2:2"),
            (ra, rb) => panic!("exactly one must win: {ra:?} / {rb:?}"),
        };
        match &loser {
            Error::InvalidArgument(m) => {
                assert!(m.contains(&format!("{name:?}")), "{m}");
                assert!(m.contains(&format!("lease {:x}", winner.lease_id())), "{m}");
            }
            e => panic!("the loser's error: {e}"),
        }
        assert_eq!(a.lookup(&name).await.unwrap().addresses, vec![addr]);
        winner.shutdown().await.unwrap();
    }
}

/// Run by `lease_expires_after_the_publisher_is_killed` in a child process:
/// publishes, prints `published <ttl secs>`, and waits to be killed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "helper process of lease_expires_after_the_publisher_is_killed"]
async fn child_publisher() {
    let Ok(spec) = std::env::var(CHILD_ENV) else {
        return;
    };
    let mut it = spec.split('|');
    let (ep, name, addr) = (it.next().unwrap(), it.next().unwrap(), it.next().unwrap());
    let d = EtcdDiscovery::connect(&[ep], "/ferry-test", TTL)
        .await
        .unwrap();
    let p = d.publish(&descriptor(name, addr)).await.unwrap();
    println!("published {}", p.lease_ttl().as_secs());
    std::future::pending::<()>().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_expires_after_the_publisher_is_killed() {
    let test = "lease_expires_after_the_publisher_is_killed";
    let Some(etcd) = start_etcd(test).await else {
        return;
    };
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "child_publisher", "--ignored", "--nocapture"])
        .env(
            CHILD_ENV,
            format!("{}|node-7|127.0.0.1:4700", etcd.endpoint()),
        )
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let out = child.stdout.take().unwrap();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(out).lines().map_while(Result::ok) {
            if let Some(ttl) = line.strip_prefix("published ") {
                let _ = tx.send(ttl.trim().parse::<u64>().unwrap());
            }
        }
    });
    let granted = match rx.recv_timeout(WAIT) {
        Ok(s) => Duration::from_secs(s),
        Err(_) => {
            let _ = child.kill();
            panic!("the child did not publish within {WAIT:?}");
        }
    };
    let d = connect(&etcd).await;
    assert_eq!(
        d.lookup("node-7").await.unwrap().addresses,
        vec!["127.0.0.1:4700"]
    );
    child.kill().unwrap(); // SIGKILL: no revocation
    child.wait().unwrap();
    let bound = granted + EXPIRY_SLACK;
    let (r, after) = poll_lookup(&d, "node-7", bound + WAIT, |r| r.is_err()).await;
    assert!(is_gone(&r, "node-7"), "{r:?}");
    eprintln!(
        "{test}: the killed publisher's segment was gone after {after:?} (lease TTL {granted:?})"
    );
    assert!(after <= bound, "gone only after {after:?}, bound {bound:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publication_survives_an_etcd_restart() {
    let Some(mut etcd) = start_etcd("publication_survives_an_etcd_restart").await else {
        return;
    };
    let d = connect(&etcd).await;
    let desc = descriptor("decode-2", "127.0.0.1:4300");
    let p = d.publish(&desc).await.unwrap();
    let first_lease = p.lease_id();
    // A watch opened before the outages follows the name through them.
    let mut w = d.watch("decode-2").await.unwrap();

    // etcd down: lookups fail typed (and quickly).
    etcd.kill();
    let t0 = Instant::now();
    let e = d.lookup("decode-2").await.unwrap_err();
    assert!(
        matches!(&e, Error::Unavailable { backend, .. } if backend == "etcd"),
        "{e}"
    );
    assert!(e.to_string().contains("decode-2"), "{e}");
    assert!(t0.elapsed() <= ferry_discovery::DEFAULT_TIMEOUT + Duration::from_millis(500));
    // Longer than the TTL: the keeper has seen the outage.
    tokio::time::sleep(TTL + Duration::from_millis(500)).await;

    // Back with its data: the publication is there again.
    etcd.run().await;
    let (r, _) = poll_lookup(&d, "decode-2", WAIT, |r| r.is_ok()).await;
    assert_eq!(r.unwrap(), desc);
    tokio::time::sleep(TTL * 2 + Duration::from_millis(500)).await;
    assert_eq!(
        d.lookup("decode-2").await.unwrap(),
        desc,
        "kept alive after the restart"
    );
    // etcd kept the lease (it renews leases when it starts): no new one.
    assert_eq!(p.lease_id(), first_lease);

    // Back without its data (a new, empty etcd on the same address): the
    // keeper re-publishes under a new lease.
    let old_lease = p.lease_id();
    etcd.kill();
    std::fs::remove_dir_all(etcd.data_dir()).unwrap();
    etcd.run().await;
    let (r, after) = poll_lookup(&d, "decode-2", WAIT, |r| r.is_ok()).await;
    assert_eq!(r.unwrap(), desc, "not re-published within {after:?}");
    assert_ne!(p.lease_id(), old_lease);
    tokio::time::sleep(TTL * 2 + Duration::from_millis(500)).await;
    assert_eq!(
        d.lookup("decode-2").await.unwrap(),
        desc,
        "kept alive after re-publishing"
    );
    p.shutdown().await.unwrap();
    assert!(is_gone(&d.lookup("decode-2").await, "decode-2"));
    // The watch saw nothing but the same descriptor until the deletion.
    loop {
        match next(&mut w).await {
            SegmentEvent::Registered(got) => assert_eq!(got.descriptor, desc),
            SegmentEvent::Deleted { name } => break assert_eq!(name, "decode-2"),
        }
    }
}

async fn next(w: &mut ferry_discovery::SegmentWatch) -> SegmentEvent {
    tokio::time::timeout(WAIT, w.next())
        .await
        .expect("a watch event")
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watch_sees_re_registration_at_a_new_address() {
    let Some(etcd) = start_etcd("watch_sees_re_registration_at_a_new_address").await else {
        return;
    };
    let d = connect(&etcd).await;
    let first = d
        .publish(&descriptor("decode-4", "127.0.0.1:4400"))
        .await
        .unwrap();
    let mut w = d.watch("decode-4").await.unwrap();
    first.shutdown().await.unwrap();
    assert_eq!(
        next(&mut w).await,
        SegmentEvent::Deleted {
            name: "decode-4".into()
        }
    );
    // Another engine (another connection) takes the name at a new address.
    let other = connect(&etcd).await;
    let moved = descriptor("decode-4", "127.0.0.1:4401");
    let second = other.publish(&moved).await.unwrap();
    match next(&mut w).await {
        SegmentEvent::Registered(r) => {
            assert_eq!(r.descriptor, moved);
            assert_eq!(r.lease, second.lease_id());
        }
        e => panic!("expected the re-registration, got {e:?}"),
    }
    let r = d.resolve("decode-4").await.unwrap();
    assert_eq!((r.descriptor, r.lease), (moved.clone(), second.lease_id()));
    assert_eq!(d.lookup("decode-4").await.unwrap(), moved);
    second.shutdown().await.unwrap();
    assert_eq!(
        next(&mut w).await,
        SegmentEvent::Deleted {
            name: "decode-4".into()
        }
    );
}

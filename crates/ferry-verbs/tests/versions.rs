//! Mixed protocol versions on a real verbs stack: an engine capped at
//! protocol 3 (the test-only `test_protocol_max=3`, which makes it speak
//! exactly as a build of 7c3e5e6) and a new one, both directions; two new
//! engines (protocol 4) with features switched off on one; and, when
//! `FERRY_VERBS_OLD_FERRY` names a `ferry` binary built from 7c3e5e6 with
//! the `verbs` feature, that real build's `ferry serve` and `ferry bench
//! --peer` against an engine of this build.
//!
//! Each test prints `skipped: <test>: <reason>` and returns when no RDMA
//! device is usable (or the crate lacks its `rdma` feature).

use std::time::Duration;

use ferry_core::{
    Error, HostBuffer, Location, Notification, Operation, TransferEngine, TransferRequest,
};
use ferry_verbs::{Feature, FeatureState, VerbsConfig, VerbsEngine};

const LEN: usize = 64 << 10;

/// An engine from `FERRY_VERBS_URL` plus the URL parameters `extra`.
async fn engine_with(test: &str, extra: &str) -> Option<VerbsEngine> {
    let base = std::env::var("FERRY_VERBS_URL").unwrap_or_else(|_| "verbs://".to_owned());
    let url = match (extra.is_empty(), base.contains('?')) {
        (true, _) => base,
        (false, true) => format!("{base}&{extra}"),
        (false, false) => format!("{base}?{extra}"),
    };
    let cfg = VerbsConfig::from_url(&url).expect("FERRY_VERBS_URL parses");
    match VerbsEngine::start(cfg).await {
        Ok(e) => Some(e),
        Err(e) => {
            ferry_core::conformance::skip_unavailable(test, &e);
            None
        }
    }
}

fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

async fn registered(e: &VerbsEngine, len: usize, seed: u8) -> HostBuffer {
    let b = HostBuffer::new(len).expect("alloc");
    if seed != 0 {
        b.write(0, &pattern(seed, len)).expect("fill");
    }
    // SAFETY: callers keep the buffer alive until it is unregistered or its engine is dropped.
    e.register(unsafe { b.region(Location::cpu(0)) })
        .await
        .expect("register");
    b
}

/// `from` opens `to`, writes a pattern, reads it back into a second buffer
/// and sends a notification after a write; checks the bytes and the
/// notification; returns the segment.
async fn exchange(from: &VerbsEngine, to: &VerbsEngine, seed: u8) -> ferry_core::SegmentId {
    let src = registered(from, LEN, seed).await;
    let back = registered(from, LEN, 0).await;
    let dst = registered(to, LEN, 0).await;
    let seg = from
        .open_segment(to.segment_name())
        .await
        .expect("open_segment");
    from.transfer(
        seg,
        TransferRequest::write(src.addr(), dst.addr(), LEN as u64),
    )
    .await
    .expect("write");
    assert_eq!(dst.to_vec(), pattern(seed, LEN), "the write landed");
    from.transfer(
        seg,
        TransferRequest::read(back.addr(), dst.addr(), LEN as u64),
    )
    .await
    .expect("read");
    assert_eq!(back.to_vec(), pattern(seed, LEN), "the read");
    let _ = to.take_notifications().await.expect("take");
    let note = Notification::new("versions", format!("seed {seed}"));
    let report = from
        .batch_transfer(
            seg,
            &[TransferRequest::write(back.addr(), dst.addr(), 4096)],
            Some(&note),
        )
        .await
        .expect("batch with a notification");
    assert!(report.is_success(), "{report:?}");
    assert_eq!(to.take_notifications().await.expect("take"), vec![note]);
    from.unregister(src.addr()).await.expect("unregister");
    from.unregister(back.addr()).await.expect("unregister");
    to.unregister(dst.addr()).await.expect("unregister");
    seg
}

fn detail<'a>(info: &'a ferry_core::BackendInfo, prefix: &str) -> Vec<&'a str> {
    info.details
        .iter()
        .filter(|(k, _)| k.starts_with(prefix))
        .map(|(_, v)| v.as_str())
        .collect()
}

#[tokio::test]
async fn a_v3_peer_and_a_new_peer_interoperate_both_ways() {
    const T: &str = "a_v3_peer_and_a_new_peer_interoperate_both_ways";
    for secret in ["", "secret=v3mix"] {
        let Some(new) = engine_with(T, secret).await else {
            return;
        };
        let cap = if secret.is_empty() {
            "test_protocol_max=3".to_owned()
        } else {
            format!("test_protocol_max=3&{secret}")
        };
        let Some(old) = engine_with(T, &cap).await else {
            return;
        };
        // New opener, v3 owner.
        let seg = exchange(&new, &old, 5).await;
        let p = new.peer_protocol(seg).await.expect("connected");
        assert_eq!(p.version, 3, "{p}");
        assert!(!p.negotiated, "{p}");
        assert_eq!(p.local.max, 4, "{p}");
        assert!(
            p.features
                .iter()
                .all(|(_, s)| *s == FeatureState::OnImplied),
            "{p}"
        );
        let info = new.backend_info();
        assert!(
            detail(&info, "protocol peer ")
                .iter()
                .any(|v| v.starts_with("protocol 3 ")),
            "{:?}",
            info.details
        );
        // v3 opener, new owner.
        let seg = exchange(&old, &new, 9).await;
        let p = old.peer_protocol(seg).await.expect("connected");
        assert_eq!((p.version, p.local.max, p.negotiated), (3, 3, false), "{p}");
        let info = new.backend_info();
        let openers = detail(&info, "protocol opener ");
        assert!(
            openers
                .iter()
                .any(|v| v.starts_with("protocol 3 (this engine 3–4, the peer 3")),
            "{openers:?}"
        );
        eprintln!("{T}: {secret:?}: v3 <-> new: ok ({p})");
    }
}

#[tokio::test]
async fn new_peers_negotiate_4_and_honour_features_switched_off() {
    const T: &str = "new_peers_negotiate_4_and_honour_features_switched_off";
    let Some(a) = engine_with(T, "").await else {
        return;
    };
    let Some(b) = engine_with(T, "").await else {
        return;
    };
    let seg = exchange(&a, &b, 3).await;
    let p = a.peer_protocol(seg).await.expect("connected");
    assert_eq!((p.version, p.negotiated), (4, true), "{p}");
    assert!(
        p.features.iter().all(|(_, s)| *s == FeatureState::On),
        "{p}"
    );

    // The owner does not announce notifications or region pushes.
    let Some(c) = engine_with(T, "test_features_off=notify,region_push").await else {
        return;
    };
    let src = registered(&a, LEN, 4).await;
    let dst = registered(&c, LEN, 0).await;
    let seg = a.open_segment(c.segment_name()).await.expect("open");
    let p = a.peer_protocol(seg).await.expect("connected");
    assert_eq!(p.version, 4, "{p}");
    assert!(
        p.features
            .contains(&(Feature::Notify, FeatureState::OffPeer)),
        "{p}"
    );
    assert!(
        p.features
            .contains(&(Feature::RegionPush, FeatureState::OffPeer)),
        "{p}"
    );
    assert!(p.has(Feature::TableFetch), "{p}");
    // A batch with a notification is refused before anything moves.
    let w = TransferRequest::write(src.addr(), dst.addr(), LEN as u64);
    match a
        .batch_transfer(seg, &[w], Some(&Notification::new("n", "m")))
        .await
    {
        Err(Error::Unsupported {
            operation, reason, ..
        }) => {
            assert_eq!(operation, Operation::Notify);
            assert!(
                reason.contains("notify off (the peer lacks it)"),
                "{reason}"
            );
        }
        other => panic!("expected Unsupported, got {other:?}"),
    }
    assert_eq!(dst.to_vec(), vec![0u8; LEN], "nothing moved");
    a.transfer(seg, w)
        .await
        .expect("a write without notification");
    assert_eq!(dst.to_vec(), pattern(4, LEN));
    // No pushes: a region the owner registers now is found by fetching
    // the table on the miss.
    let late = registered(&c, LEN, 0).await;
    a.transfer(
        seg,
        TransferRequest::write(src.addr(), late.addr(), LEN as u64),
    )
    .await
    .expect("write to a region registered after the connection");
    assert_eq!(late.to_vec(), pattern(4, LEN));
    // The owner's side of the report.
    let info = c.backend_info();
    let openers = detail(&info, "protocol opener ");
    assert!(
        openers
            .iter()
            .any(|v| v.contains("notify off (disabled on this engine)")),
        "{openers:?}"
    );
    a.unregister(src.addr()).await.expect("unregister");
    c.unregister(dst.addr()).await.expect("unregister");
    c.unregister(late.addr()).await.expect("unregister");
}

/// Lines of a child's stdout, read on a task, for matching.
struct Lines(tokio::sync::mpsc::UnboundedReceiver<String>);

impl Lines {
    fn spawn(out: tokio::process::ChildStdout) -> Lines {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        tokio::spawn(async move {
            let mut l = tokio::io::AsyncBufReadExt::lines(tokio::io::BufReader::new(out));
            while let Ok(Some(line)) = l.next_line().await {
                eprintln!("  | {line}");
                if tx.send(line).is_err() {
                    return;
                }
            }
        });
        Lines(rx)
    }

    /// The first line containing `needle` (within `bound`).
    async fn find(&mut self, needle: &str, bound: Duration) -> String {
        tokio::time::timeout(bound, async {
            loop {
                match self.0.recv().await {
                    Some(l) if l.contains(needle) => return l,
                    Some(_) => {}
                    None => panic!("the child exited before printing {needle:?}"),
                }
            }
        })
        .await
        .unwrap_or_else(|_| panic!("no {needle:?} within {bound:?}"))
    }
}

fn after<'a>(line: &'a str, flag: &str) -> &'a str {
    line.split_whitespace()
        .skip_while(|w| *w != flag)
        .nth(1)
        .unwrap_or_else(|| panic!("no {flag} in {line:?}"))
}

/// The real protocol-3 build: `ferry` of 7c3e5e6 (built with
/// `--features verbs`: `scripts/build-old-ferry.sh 7c3e5e6 --features verbs`), named by
/// `FERRY_VERBS_OLD_FERRY`. Its `ferry serve` is opened by an engine of
/// this build (write, read back, notification), and its `ferry bench
/// --peer` drives an engine of this build (every point read back and
/// compared by bench; its notifications arrive here).
#[tokio::test]
async fn the_7c3e5e6_ferry_cli_and_this_build_interoperate_both_ways() {
    const T: &str = "the_7c3e5e6_ferry_cli_and_this_build_interoperate_both_ways";
    let Ok(old) = std::env::var("FERRY_VERBS_OLD_FERRY") else {
        println!("skipped: {T}: FERRY_VERBS_OLD_FERRY does not name a ferry binary of 7c3e5e6");
        return;
    };
    let Some(new) = engine_with(T, "").await else {
        return;
    };
    let bound = Duration::from_secs(300);
    let url = std::env::var("FERRY_VERBS_URL").unwrap_or_else(|_| "verbs://".to_owned());
    let listen = |u: &str| {
        if u.contains('?') {
            format!("{u}&listen=127.0.0.1:0")
        } else {
            format!("{u}?listen=127.0.0.1:0")
        }
    };

    // 1. The old owner (`ferry serve`), this build's opener.
    let mut serve = tokio::process::Command::new(&old)
        .args(["serve", "--backend", &listen(&url), "--size", "1MiB"])
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("spawning the old ferry serve");
    let mut out = Lines::spawn(serve.stdout.take().expect("stdout"));
    let line = out.find("drive it with:", bound).await;
    let peer = after(&line, "--peer").to_owned();
    let addr = u64::from_str_radix(after(&line, "--remote-addr").trim_start_matches("0x"), 16)
        .expect("remote addr");
    let len = after(&line, "--remote-len")
        .parse::<u64>()
        .expect("remote len");
    assert!(len >= LEN as u64);
    let src = registered(&new, LEN, 11).await;
    let back = registered(&new, LEN, 0).await;
    let seg = tokio::time::timeout(bound, new.open_segment(&peer))
        .await
        .expect("open_segment hung")
        .expect("open the old serve's segment");
    let p = new.peer_protocol(seg).await.expect("connected");
    assert_eq!((p.version, p.negotiated), (3, false), "{p}");
    new.transfer(seg, TransferRequest::write(src.addr(), addr, LEN as u64))
        .await
        .expect("write to the old build");
    new.transfer(seg, TransferRequest::read(back.addr(), addr, LEN as u64))
        .await
        .expect("read from the old build");
    assert_eq!(
        back.to_vec(),
        pattern(11, LEN),
        "bytes round-trip through the old build"
    );
    let report = new
        .batch_transfer(
            seg,
            &[TransferRequest::write(src.addr(), addr, 4096)],
            Some(&Notification::new("new-build", "hello v3")),
        )
        .await
        .expect("batch with a notification to the old build");
    assert!(report.is_success(), "{report:?}");
    out.find("notification from new-build: hello v3", bound)
        .await;
    new.close_segment(seg).await.expect("close");
    let _ = serve.start_kill();
    let _ = serve.wait().await;
    eprintln!("{T}: old serve <- new opener: ok ({p})");

    // 2. This build's owner, the old opener (`ferry bench --peer`).
    let target = registered(&new, 4 << 20, 0).await;
    let mut bench = tokio::process::Command::new(&old)
        .args([
            "bench",
            "--backend",
            &url,
            "--peer",
            new.segment_name(),
            "--remote-addr",
            &format!("{:#x}", target.addr()),
            "--remote-len",
            &(4u64 << 20).to_string(),
            "--region-size",
            "4MiB",
            "--span",
            "1MiB",
            "--blocks",
            "4KiB,64KiB",
            "--batches",
            "1,4",
            "--ops",
            "write,read",
            "--duration",
            "100ms",
            "--warmup",
            "10ms",
            "--no-baselines",
        ])
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("spawning the old ferry bench");
    let _out = Lines::spawn(bench.stdout.take().expect("stdout"));
    // While it runs, this engine reports the old opener at protocol 3.
    let seen = tokio::time::timeout(bound, async {
        loop {
            let info = new.backend_info();
            if let Some(v) = detail(&info, "protocol opener ").first() {
                return v.to_string();
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("the old bench never connected");
    assert!(
        seen.starts_with("protocol 3 (this engine 3–4, the peer 3"),
        "{seen}"
    );
    let status = tokio::time::timeout(bound, bench.wait())
        .await
        .expect("the old bench did not finish")
        .expect("bench exit");
    assert!(
        status.success(),
        "the old ferry bench failed against this build: {status}"
    );
    let notes = new.take_notifications().await.expect("take");
    assert!(!notes.is_empty(), "the old bench's notifications arrive");
    eprintln!(
        "{T}: old bench -> new owner: ok ({} notifications; {seen})",
        notes.len()
    );
    new.unregister(src.addr()).await.expect("unregister");
    new.unregister(back.addr()).await.expect("unregister");
    new.unregister(target.addr()).await.expect("unregister");
}

//! Version and feature negotiation (PROTOCOL.md §1.1), with real engines
//! and, for the peers this build must handle but cannot be (a version-4
//! target, a future target, a remote host, a Mooncake Transfer Engine),
//! small fake peers speaking those peers' first bytes over real sockets.
#![cfg(target_os = "linux")]

mod common;

use std::time::Duration;

use common::{engine, mem, pattern};
use ferry_core::{Error, TransferEngine, TransferRequest};
use ferry_tcp::test_support::frame::{
    encode_table, Hello, Status, TableEntry, FLAG_EXT, HELLO_FIXED, REJECT, WELCOME,
};
use ferry_tcp::test_support::negotiate::{
    self, Extensions, FeatureSet, VersionRange, LEGACY_VERSION, MAX_VERSION, MIN_VERSION,
};
use ferry_tcp::{FeatureOff, SameHost, TcpConfig, TcpEngine};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

fn feature<'a>(r: &'a ferry_tcp::PeerReport, name: &str) -> &'a Option<FeatureOff> {
    &r.features
        .iter()
        .find(|f| f.name == name)
        .unwrap_or_else(|| panic!("{name} in {r}"))
        .off
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_builds_of_this_version_negotiate_everything_on() {
    let a = engine(TcpConfig::default()).await;
    let b = engine(TcpConfig::default()).await;
    let dst = mem(&b, 1 << 20, 0).await;
    let src = mem(&a, 1 << 20, 0).await;
    src.write(0, &pattern(3, 1 << 20)).unwrap();
    let seg = a.open_segment(b.segment_name()).await.unwrap();
    let r = a.peer_report(b.segment_name()).expect("a report");
    assert_eq!(r.version, MAX_VERSION, "{r}");
    assert!(r.peer_negotiates);
    assert_eq!(r.ours, VersionRange::OURS);
    assert_eq!(r.theirs, VersionRange::OURS);
    if a.config().same_host == SameHost::Auto && a.config().same_host_stage.is_some() {
        for f in negotiate::FEATURES {
            assert_eq!(feature(&r, f.name), &None, "{r}");
        }
        assert_eq!(r.path, "same-host granted", "{r}");
    }
    a.transfer(seg, TransferRequest::write(src.addr(), dst.addr(), 1 << 20))
        .await
        .unwrap();
    assert!(dst.to_vec() == pattern(3, 1 << 20));
    // The report names the settings that turn features off.
    let c = TcpEngine::start(
        TcpConfig::builder()
            .same_host_unix(false)
            .same_host_stage(None)
            .build()
            .unwrap(),
    )
    .await
    .unwrap();
    c.open_segment(b.segment_name()).await.unwrap();
    let r = c.peer_report(b.segment_name()).unwrap();
    assert_eq!(feature(&r, "same-host"), &None, "{r}");
    assert_eq!(
        feature(&r, "control-channel"),
        &Some(FeatureOff::DisabledHere("same_host_control=tcp")),
        "{r}"
    );
    assert_eq!(
        feature(&r, "staging-area"),
        &Some(FeatureOff::DisabledHere("same_host_stage=off")),
        "{r}"
    );
    assert_eq!(
        feature(&r, "granted-copy"),
        &Some(FeatureOff::Needs("staging-area")),
        "{r}"
    );
    assert_eq!(r.path, "same-host cma", "{r}");
    // Grants off: staged.
    let d = engine(TcpConfig::builder().same_host_grant(false).build().unwrap()).await;
    d.open_segment(b.segment_name()).await.unwrap();
    let r = d.peer_report(b.segment_name()).unwrap();
    assert_eq!(
        feature(&r, "granted-copy"),
        &Some(FeatureOff::DisabledHere("same_host_grant=off")),
        "{r}"
    );
    assert_eq!(feature(&r, "staging-area"), &None, "{r}");
    if d.config().same_host == SameHost::Auto {
        assert_eq!(r.path, "same-host staged", "{r}");
    }
    // A target that grants nothing: the initiator is told so.
    let e = engine(TcpConfig::builder().same_host_grant(false).build().unwrap()).await;
    a.open_segment(e.segment_name()).await.unwrap();
    let r = a.peer_report(e.segment_name()).unwrap();
    assert_eq!(
        feature(&r, "granted-copy"),
        &Some(FeatureOff::DisabledByPeer),
        "{r}"
    );
    if a.config().same_host == SameHost::Auto && a.config().same_host_stage.is_some() {
        assert_eq!(r.path, "same-host staged", "{r}");
    }
    // A target with the path off says so in its announcement: no offer.
    let off = TcpEngine::start(
        TcpConfig::builder()
            .same_host(SameHost::Off)
            .build()
            .unwrap(),
    )
    .await
    .unwrap();
    c.open_segment(off.segment_name()).await.unwrap();
    let r = c.peer_report(off.segment_name()).unwrap();
    assert_eq!(
        feature(&r, "same-host"),
        &Some(FeatureOff::DisabledByPeer),
        "{r}"
    );
    assert_eq!(r.path, "socket");
    assert!(r.to_string().contains("disabled by the peer"), "{r}");
}

/// Reads an initiator's hello (fixed part and name).
async fn read_hello(s: &mut TcpStream) -> Hello {
    let mut fixed = [0u8; HELLO_FIXED];
    s.read_exact(&mut fixed).await.expect("hello");
    let (mut h, n) = Hello::decode_fixed(&fixed).expect("a ferry hello");
    let mut name = vec![0u8; n];
    s.read_exact(&mut name).await.expect("name");
    h.name = String::from_utf8(name).unwrap();
    h
}

/// The rest of a target's handshake after its hello: read the proof, send
/// a welcome with one region.
async fn welcome(s: &mut TcpStream) {
    let mut proof = [0u8; 32];
    s.read_exact(&mut proof).await.expect("proof");
    let mut w = vec![WELCOME];
    w.extend_from_slice(&[0u8; 32]);
    w.extend_from_slice(&60_000u32.to_le_bytes());
    w.extend_from_slice(&1u32.to_le_bytes());
    w.extend_from_slice(&encode_table(&[TableEntry {
        addr: 0x1000,
        len: 1 << 20,
        gen: 1,
    }]));
    s.write_all(&w).await.unwrap();
}

/// A double of a version-4 target (4b6cd43): it answers every hello with
/// its own version-4 hello and refuses, with `BadVersion`, any other
/// version (as that build does), else completes the handshake and refuses
/// the same-host offer. Returns its address and the versions of the
/// hellos it received.
async fn v4_target() -> (String, tokio::sync::mpsc::UnboundedReceiver<(u16, u16)>) {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = l.accept().await {
            let tx = tx.clone();
            tokio::spawn(async move {
                let h = read_hello(&mut s).await;
                let _ = tx.send((h.version, h.flags));
                let mine = Hello {
                    version: 4,
                    flags: 0,
                    nonce: [4; 32],
                    name: "v4".into(),
                };
                s.write_all(&mine.encode()).await.unwrap();
                if h.version != 4 {
                    let _ = s
                        .write_all(&ferry_tcp::test_support::frame::REJECT.to_le_bytes())
                        .await;
                    let msg = b"unsupported protocol version";
                    let mut rej = vec![Status::BadVersion as u8];
                    rej.extend_from_slice(&(msg.len() as u16).to_le_bytes());
                    rej.extend_from_slice(msg);
                    let _ = s.write_all(&rej).await;
                    return;
                }
                welcome(&mut s).await;
                common::refuse_same_host(&mut s).await;
                let mut sink = [0u8; 64];
                while s.read(&mut sink).await.unwrap_or(0) > 0 {}
            });
        }
    });
    (addr, rx)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_version_4_target_is_reached_with_a_version_4_hello() {
    let (addr, mut hellos) = v4_target().await;
    let a = engine(TcpConfig::builder().connections(2).build().unwrap()).await;
    a.open_segment(&addr).await.expect("version 4 is spoken");
    // First a legacy hello with the negotiation flag, refused; then a
    // version-4 hello, accepted.
    let first = hellos.recv().await.unwrap();
    assert_eq!(first.0, LEGACY_VERSION);
    assert_ne!(first.1 & FLAG_EXT, 0);
    assert_eq!(hellos.recv().await.unwrap().0, 4);
    let r = a.peer_report(&addr).unwrap();
    assert_eq!((r.version, r.peer_negotiates), (4, false), "{r}");
    assert_eq!(r.theirs, VersionRange { min: 4, max: 4 });
    assert_eq!(
        feature(&r, "staging-area"),
        &Some(FeatureOff::PeerLacks),
        "{r}"
    );
    assert_eq!(feature(&r, "ack-lane"), &Some(FeatureOff::PeerLacks), "{r}");
    assert!(
        matches!(feature(&r, "same-host"), Some(FeatureOff::Refused(_))),
        "{r}"
    );
}

/// A double of a future target that negotiates: announces `range` and
/// `host` (its same-host token) with every feature on. Sends what the
/// initiator sent after the welcome (up to 1 s of it) on `seen`.
async fn negotiating_target(
    range: VersionRange,
    host: Option<[u8; 32]>,
) -> (String, tokio::sync::oneshot::Receiver<Vec<u8>>) {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let (tx, rx) = tokio::sync::oneshot::channel();
    tokio::spawn(async move {
        let (mut s, _) = l.accept().await.unwrap();
        let h = read_hello(&mut s).await;
        assert_ne!(h.flags & FLAG_EXT, 0, "the initiator negotiates");
        let mine = Hello {
            version: LEGACY_VERSION,
            flags: FLAG_EXT,
            nonce: [9; 32],
            name: "future".into(),
        };
        let ext = Extensions {
            versions: range,
            features: FeatureSet::implied_by(5),
            host,
            tls: None,
            cred: None,
        };
        s.write_all(&[mine.encode(), ext.encode()].concat())
            .await
            .unwrap();
        let mut len = [0u8; 2];
        if s.read_exact(&mut len).await.is_err() {
            return;
        }
        let mut body = vec![0u8; u16::from_le_bytes(len) as usize];
        s.read_exact(&mut body).await.unwrap();
        Extensions::decode(&body).expect("the initiator's block decodes");
        if VersionRange::OURS.highest_common(range).is_none() {
            return;
        }
        welcome(&mut s).await;
        let mut after = Vec::new();
        let _ = tokio::time::timeout(Duration::from_secs(1), s.read_to_end(&mut after)).await;
        let _ = tx.send(after);
    });
    (addr, rx)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_common_version_names_both_ranges_and_what_to_upgrade() {
    let future = VersionRange { min: 9, max: 12 };
    let (addr, _) = negotiating_target(future, None).await;
    let a = engine(TcpConfig::default()).await;
    let e = a.open_segment(&addr).await.unwrap_err();
    let text = e.to_string();
    assert!(matches!(e, Error::Protocol { .. }), "{e:?}");
    assert!(
        text.contains(&format!("{MIN_VERSION}..={MAX_VERSION}"))
            && text.contains("9..=12")
            && text.contains("upgrade this engine"),
        "{text}"
    );
    // The target side: an initiator announcing only old versions gets a
    // BadVersion rejection naming both ranges.
    let b = engine(TcpConfig::default()).await;
    let mut s = TcpStream::connect(b.segment_name()).await.unwrap();
    let hello = Hello {
        version: LEGACY_VERSION,
        flags: FLAG_EXT,
        nonce: [1; 32],
        name: "old".into(),
    };
    s.write_all(&hello.encode()).await.unwrap();
    let _ = read_hello(&mut s).await;
    let mut len = [0u8; 2];
    s.read_exact(&mut len).await.unwrap();
    let mut body = vec![0u8; u16::from_le_bytes(len) as usize];
    s.read_exact(&mut body).await.unwrap();
    let theirs = Extensions::decode(&body).unwrap();
    assert_eq!(theirs.versions, VersionRange::OURS);
    let mine = Extensions {
        versions: VersionRange { min: 1, max: 3 },
        features: FeatureSet::default(),
        host: None,
        tls: None,
        cred: None,
    };
    s.write_all(&mine.encode()).await.unwrap();
    let mut rej = Vec::new();
    s.read_to_end(&mut rej).await.unwrap();
    assert_eq!(rej[0], REJECT);
    assert_eq!(rej[1], Status::BadVersion as u8);
    let reason = String::from_utf8_lossy(&rej[4..]);
    assert!(
        reason.contains("1..=3") && reason.contains("upgrade the initiator"),
        "{reason}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_on_another_host_gets_no_same_host_offer() {
    // A target that negotiates but whose host token differs (another
    // boot, or another PID namespace): the initiator offers nothing — no
    // PID, boot id, namespace or address leaves this process — and
    // creates no staging area or socket pair.
    let (addr, seen) = negotiating_target(VersionRange::OURS, Some([0xee; 32])).await;
    let a = engine(TcpConfig::default()).await;
    a.open_segment(&addr).await.unwrap();
    let r = a.peer_report(&addr).unwrap();
    if a.config().same_host != SameHost::Off {
        assert_eq!(
            feature(&r, "same-host"),
            &Some(FeatureOff::NotSameHost),
            "{r}"
        );
    }
    assert_eq!(r.path, "socket", "{r}");
    drop(a);
    let after = seen.await.unwrap();
    assert!(
        after.is_empty(),
        "nothing after the welcome, got {} bytes starting {:02x?}",
        after.len(),
        &after[..after.len().min(8)]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_version_5_initiator_is_answered_in_version_5() {
    let b = engine(TcpConfig::default()).await;
    let mut s = TcpStream::connect(b.segment_name()).await.unwrap();
    let hello = Hello {
        version: 5,
        flags: 0,
        nonce: [1; 32],
        name: "v5".into(),
    };
    s.write_all(&hello.encode()).await.unwrap();
    let h = read_hello(&mut s).await;
    assert_eq!(h.version, 5);
    assert_eq!(h.flags & FLAG_EXT, 0, "no extension block for a v5 peer");
    assert!(negotiate::is_marked_legacy(&h.nonce), "downgrade sentinel");
    s.write_all(&[0u8; 32]).await.unwrap();
    let mut status = [0u8; 1];
    s.read_exact(&mut status).await.unwrap();
    assert_eq!(status[0], WELCOME);
    // A version-3 initiator is refused, naming this build's range.
    let mut s = TcpStream::connect(b.segment_name()).await.unwrap();
    let hello = Hello {
        version: 3,
        ..hello
    };
    s.write_all(&hello.encode()).await.unwrap();
    let _ = read_hello(&mut s).await;
    let mut rej = Vec::new();
    s.read_to_end(&mut rej).await.unwrap();
    assert_eq!(&rej[..2], &[REJECT, Status::BadVersion as u8]);
    assert!(String::from_utf8_lossy(&rej[4..]).contains("4..=6"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stripped_negotiation_flag_is_a_detected_downgrade() {
    // A MITM that clears FLAG_EXT on the way to a target that negotiates:
    // the target answers as to a version-5 peer, with the sentinel.
    let b = engine(TcpConfig::default()).await;
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let target = b.segment_name().to_owned();
    tokio::spawn(async move {
        let (mut c, _) = l.accept().await.unwrap();
        let mut t = TcpStream::connect(target).await.unwrap();
        let mut fixed = [0u8; HELLO_FIXED];
        c.read_exact(&mut fixed).await.unwrap();
        fixed[6] &= !(FLAG_EXT as u8);
        t.write_all(&fixed).await.unwrap();
        let (mut cr, mut cw) = c.into_split();
        let (mut tr, mut tw) = t.into_split();
        tokio::spawn(async move { tokio::io::copy(&mut cr, &mut tw).await });
        let _ = tokio::io::copy(&mut tr, &mut cw).await;
    });
    let a = engine(TcpConfig::default()).await;
    let e = a.open_segment(&addr).await.unwrap_err();
    assert!(e.to_string().contains("downgrade"), "{e}");
}

/// A double of a Mooncake Transfer Engine P2P handshake listener, as its
/// `SocketHandShakePlugin` reads: `length u64` (at most 1 MiB), then the
/// message; an over-long length makes it close the connection, unread
/// bytes and all (the reset Ferry used to report bare).
async fn mooncake_listener() -> String {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap().to_string();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = l.accept().await {
            let mut len = [0u8; 8];
            if s.read_exact(&mut len).await.is_err() {
                continue;
            }
            if u64::from_le_bytes(len) > 1 << 20 {
                drop(s);
            }
        }
    });
    addr
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mooncake_peer_is_named_both_ways() {
    let addr = mooncake_listener().await;
    let a = engine(TcpConfig::default()).await;
    let e = a.open_segment(&addr).await.unwrap_err();
    let text = e.to_string();
    assert!(
        text.contains("not a ferry-tcp target") && text.contains("Mooncake"),
        "{text}"
    );
    // A Mooncake dialer reaching a Ferry target (its handshake request:
    // length, type 0 = connection, JSON) gets a Mooncake frame back whose
    // `reply_msg` says what the port is.
    let b = engine(TcpConfig::default()).await;
    let mut s = TcpStream::connect(b.segment_name()).await.unwrap();
    let json = br#"{"local_nic_path":"10.0.0.1:12345@mlx5_0","peer_nic_path":"x","qp_num":[1]}"#;
    let mut msg = ((json.len() + 1) as u64).to_le_bytes().to_vec();
    msg.push(0);
    msg.extend_from_slice(json);
    s.write_all(&msg).await.unwrap();
    let mut reply = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut reply)).await;
    assert!(reply.len() > 9, "a reply: {reply:02x?}");
    let len = u64::from_le_bytes(reply[..8].try_into().unwrap()) as usize;
    assert_eq!(len, reply.len() - 8);
    assert_eq!(reply[8], 0, "the request's type");
    let body = String::from_utf8_lossy(&reply[9..]);
    assert!(
        body.contains("reply_msg") && body.contains("not a Mooncake Transfer Engine"),
        "{body}"
    );
}

#[test]
fn check_offer_pins_the_process_it_proved() {
    use ferry_tcp::test_support::cma::{check_offer, cred_connect, make_offer, CredListener};
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let _c = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
    let (srv, _) = l.accept().unwrap();
    srv.set_nonblocking(true).unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let _g = rt.enter();
    let srv = TcpStream::from_std(srv).unwrap();
    let (probe, offer) = make_offer().expect("an offer");
    let prove = || {
        let cred = CredListener::bind().expect("a credential socket");
        let conn = cred_connect(cred.invite()).expect("connect");
        let proof = cred.prove().expect("this process proved itself");
        (cred, conn, proof)
    };
    let (_l, _conn, proof) = prove();
    assert_eq!(proof.pid as u32, std::process::id());
    match check_offer(&srv, &offer, proof, &[]) {
        Ok(init) => {
            assert_eq!(init.pid as u32, std::process::id());
            assert!(init.pinned() && init.alive());
        }
        // Where this process may not read itself (ptrace scope), the
        // detail names the probe.
        Err(why) => assert!(why.contains("process_vm_readv"), "{why}"),
    }
    // Another process's PID (an exited child here), whatever its state:
    // not the process that proved itself, refused before anything is
    // done to it.
    let mut child = std::process::Command::new("true").spawn().unwrap();
    let dead = ferry_tcp::test_support::cma::Offer {
        pid: child.id() as u64,
        ..offer.clone()
    };
    let (_l, _conn, proof) = prove();
    let why = check_offer(&srv, &dead, proof, &[]).unwrap_err();
    assert!(why.contains("credential socket was connected by"), "{why}");
    let _ = child.wait();
    // A token that does not match proves nothing.
    let cred = CredListener::bind().unwrap();
    let mut other = cred.invite().clone();
    other.token[0] ^= 1;
    let _conn = cred_connect(&other).unwrap();
    assert!(cred.prove().is_err());
    drop(probe);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_a_secret_an_altered_announcement_fails_the_proofs() {
    // A MITM that turns the target's announced features off (so the
    // initiator would not use them): with a secret, the proofs cover both
    // extension blocks, so the target refuses the initiator's proof.
    let secret = Some("s3cret".to_owned());
    let b = engine({
        let mut config = TcpConfig::default();
        config.secret = secret.clone().map(Into::into);
        config
    })
    .await;
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let target = b.segment_name().to_owned();
    tokio::spawn(async move {
        let (c, _) = l.accept().await.unwrap();
        let t = TcpStream::connect(target).await.unwrap();
        let (mut cr, mut cw) = c.into_split();
        let (mut tr, mut tw) = t.into_split();
        tokio::spawn(async move { tokio::io::copy(&mut cr, &mut tw).await });
        // The target's hello, then its block: rewrite FEATURES.on to 0.
        let mut fixed = [0u8; HELLO_FIXED];
        tr.read_exact(&mut fixed).await.unwrap();
        let (_, n) = Hello::decode_fixed(&fixed).unwrap();
        let mut name = vec![0u8; n];
        tr.read_exact(&mut name).await.unwrap();
        let mut len = [0u8; 2];
        tr.read_exact(&mut len).await.unwrap();
        let mut body = vec![0u8; u16::from_le_bytes(len) as usize];
        tr.read_exact(&mut body).await.unwrap();
        let ext = Extensions::decode(&body).unwrap();
        let altered = Extensions {
            features: FeatureSet {
                on: 0,
                ..ext.features
            },
            ..ext
        }
        .encode();
        cw.write_all(&[fixed.to_vec(), name, altered].concat())
            .await
            .unwrap();
        let _ = tokio::io::copy(&mut tr, &mut cw).await;
    });
    let a = engine({
        let mut config = TcpConfig::default();
        config.secret = secret.map(Into::into);
        config
    })
    .await;
    let e = a.open_segment(&addr).await.unwrap_err();
    // Under FERRY_TEST_TLS the altered block also hides the target's TLS:
    // the initiator goes on in clear and meets the target's TLS records
    // (a Protocol error) before any proof is checked. Refused either way.
    let tls = std::env::var_os("FERRY_TEST_TLS").is_some();
    assert!(
        matches!(e, Error::Authentication { .. }) || (tls && matches!(e, Error::Protocol { .. })),
        "{e:?}"
    );
    // Unaltered, the same pair connects.
    a.open_segment(b.segment_name()).await.unwrap();
    assert_eq!(
        a.peer_report(b.segment_name()).unwrap().version,
        MAX_VERSION
    );
}

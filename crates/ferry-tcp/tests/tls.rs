//! TLS 1.3 on the socket path (PROTOCOL.md §1.3), with real engines over
//! real loopback sockets: both identities, the negotiation with peers that
//! have TLS off or lack it, a man-in-the-middle proxy that records every
//! byte (and must see no plaintext), and fake targets that terminate TLS
//! with the wrong identity (and must not complete the handshake).
#![cfg(target_os = "linux")]

mod common;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{make_tls_files, mem, pattern, tls_files, TlsFiles};
use ferry_core::{Error, TransferEngine, TransferRequest};
use ferry_tcp::test_support::frame::{Hello, FLAG_AUTH, FLAG_EXT, HELLO_FIXED, REJECT};
use ferry_tcp::test_support::negotiate::{Extensions, FeatureSet, VersionRange, LEGACY_VERSION};
use ferry_tcp::{FeatureOff, SameHost, TcpConfig, TcpEngine, TlsMode};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

const SECRET: &str = "tls-test-secret";

/// A socket-path engine with TLS in `mode`, its identity from `SECRET`.
fn secret_cfg(mode: TlsMode) -> TcpConfig {
    TcpConfig::builder()
        .secret(SECRET)
        .tls(mode)
        .same_host(SameHost::Off)
        .build()
        .unwrap()
}

/// A socket-path engine with TLS in `mode` and the certificates `f`.
fn cert_cfg(mode: TlsMode, f: &TlsFiles) -> TcpConfig {
    TcpConfig::builder()
        .tls(mode)
        .tls_cert(f.cert.clone())
        .tls_key(f.key.clone())
        .tls_ca(f.ca.clone())
        .same_host(SameHost::Off)
        .build()
        .unwrap()
}

async fn start(cfg: TcpConfig) -> Arc<TcpEngine> {
    Arc::new(TcpEngine::start(cfg).await.expect("engine starts"))
}

/// Writes then reads back `len` bytes from `a` to `b` at `target` (a
/// segment name: `b`'s own, or a proxy's), checking both.
async fn round_trip(a: &TcpEngine, b: &TcpEngine, target: &str, len: usize) {
    let src = mem(a, len, 0).await;
    let back = mem(a, len, 0).await;
    let dst = mem(b, len, 0).await;
    let data = pattern(11, len);
    src.write(0, &data).unwrap();
    let seg = a.open_segment(target).await.expect("open");
    a.transfer(
        seg,
        TransferRequest::write(src.addr(), dst.addr(), len as u64),
    )
    .await
    .expect("write");
    assert!(dst.to_vec() == data, "written bytes differ");
    a.transfer(
        seg,
        TransferRequest::read(back.addr(), dst.addr(), len as u64),
    )
    .await
    .expect("read");
    assert!(back.to_vec() == data, "read bytes differ");
    // The buffers are freed next: unregister them first.
    a.unregister(src.addr()).await.unwrap();
    a.unregister(back.addr()).await.unwrap();
    b.unregister(dst.addr()).await.unwrap();
}

fn tls_of(e: &TcpEngine, peer: &str) -> Result<String, FeatureOff> {
    e.peer_report(peer).expect("a report").tls
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn secret_identity_encrypts_and_reports_the_suite() {
    let a = start(secret_cfg(TlsMode::Require)).await;
    let b = start(secret_cfg(TlsMode::On)).await;
    round_trip(&a, &b, b.segment_name(), 1 << 20).await;
    let r = a.peer_report(b.segment_name()).unwrap();
    let suite = r.tls.clone().expect("TLS on");
    assert!(suite.starts_with("TLS13_"), "{r}");
    assert!(suite.contains("shared secret"), "{r}");
    assert!(r.to_string().contains("tls"), "{r}");
    assert_eq!(r.path, "socket", "{r}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn certificates_encrypt_and_authenticate_both_ways() {
    let f = tls_files();
    let a = start(cert_cfg(TlsMode::Require, f)).await;
    let b = start(cert_cfg(TlsMode::Require, f)).await;
    round_trip(&a, &b, b.segment_name(), 300_000).await;
    let suite = tls_of(&a, b.segment_name()).expect("TLS on");
    assert!(suite.contains("certificates"), "{suite}");
    // An initiator whose chain the target's CA did not sign is refused
    // (and so is the target's chain, by the initiator's CA).
    let other = make_tls_files("other");
    let c = start(cert_cfg(TlsMode::Require, &other)).await;
    let t0 = Instant::now();
    let e = c.open_segment(b.segment_name()).await.unwrap_err();
    eprintln!("refused as expected: {e}");
    assert!(matches!(e, Error::Authentication { .. }), "{e}");
    assert!(t0.elapsed() < Duration::from_secs(4), "no hang");
    // A target with another CA is refused by the initiator.
    let e = a.open_segment(c.segment_name()).await.unwrap_err();
    eprintln!("refused as expected: {e}");
    assert!(matches!(e, Error::Authentication { .. }), "{e}");
    // An initiator that trusts the target but presents a chain of another
    // CA is refused by the target (TLS 1.3 checks the client's chain after
    // the client's Finished: the target's alert reaches the initiator with
    // its first read, and is reported as what it is).
    let mixed = TlsFiles {
        ca: f.ca.clone(),
        ..other.clone()
    };
    let d = start(cert_cfg(TlsMode::Require, &mixed)).await;
    let e = d.open_segment(b.segment_name()).await.unwrap_err();
    eprintln!("refused as expected: {e}");
    assert!(matches!(e, Error::Authentication { .. }), "{e}");
    assert!(t0.elapsed() < Duration::from_secs(8), "no hang");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn peers_without_tls_stay_in_clear_unless_it_is_required() {
    let on = start(secret_cfg(TlsMode::On)).await;
    let off = start(secret_cfg(TlsMode::Off)).await;
    // on → off and off → on: in clear, and the report says why.
    round_trip(&on, &off, off.segment_name(), 70_000).await;
    assert_eq!(
        tls_of(&on, off.segment_name()),
        Err(FeatureOff::DisabledByPeer)
    );
    round_trip(&off, &on, on.segment_name(), 70_000).await;
    assert_eq!(
        tls_of(&off, on.segment_name()),
        Err(FeatureOff::DisabledHere("tls=off"))
    );
    // A requiring initiator refuses a target without TLS, naming why.
    let req = start(secret_cfg(TlsMode::Require)).await;
    let e = req.open_segment(off.segment_name()).await.unwrap_err();
    eprintln!("refused as expected: {e}");
    match &e {
        Error::Authentication { reason, .. } => {
            assert!(reason.contains("tls=require"), "{e}");
            assert!(reason.contains("tls=off"), "{e}");
        }
        other => panic!("{other}"),
    }
    // A requiring target refuses an initiator without TLS, naming why.
    let e = off.open_segment(req.segment_name()).await.unwrap_err();
    eprintln!("refused as expected: {e}");
    match &e {
        Error::Authentication { reason, .. } => {
            assert!(reason.contains("tls=require"), "{e}")
        }
        other => panic!("{other}"),
    }
    // Different identities are refused, never silently in clear.
    let cert = start({
        let mut config = cert_cfg(TlsMode::On, tls_files());
        config.secret = Some(SECRET.to_owned().into());
        config
    })
    .await;
    let e = on.open_segment(cert.segment_name()).await.unwrap_err();
    eprintln!("refused as expected: {e}");
    assert!(e.to_string().contains("TLS identities differ"), "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_target_requiring_tls_refuses_a_peer_that_does_not_negotiate() {
    // A hello without FLAG_EXT: a Ferry build before version 6.
    let t = start(secret_cfg(TlsMode::Require)).await;
    let mut s = TcpStream::connect(t.segment_name()).await.unwrap();
    let hello = Hello {
        version: LEGACY_VERSION,
        flags: FLAG_AUTH,
        nonce: [5; 32],
        name: "old".to_owned(),
    };
    s.write_all(&hello.encode()).await.unwrap();
    let mut fixed = [0u8; HELLO_FIXED];
    s.read_exact(&mut fixed).await.unwrap();
    let (_, n) = Hello::decode_fixed(&fixed).unwrap();
    let mut name = vec![0u8; n];
    s.read_exact(&mut name).await.unwrap();
    let mut head = [0u8; 4];
    tokio::time::timeout(Duration::from_secs(3), s.read_exact(&mut head))
        .await
        .expect("no hang")
        .unwrap();
    assert_eq!(head[0], REJECT);
    let mut msg = vec![0u8; u16::from_le_bytes([head[2], head[3]]) as usize];
    s.read_exact(&mut msg).await.unwrap();
    let msg = String::from_utf8_lossy(&msg);
    assert!(
        msg.contains("tls=require") && msg.contains("does not negotiate"),
        "{msg}"
    );
}

/// A TCP proxy to `target` that records every byte in both directions.
async fn recording_proxy(target: String) -> (String, Arc<Mutex<Vec<u8>>>) {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let log = Arc::clone(&seen);
    tokio::spawn(async move {
        while let Ok((inbound, _)) = l.accept().await {
            let Ok(outbound) = TcpStream::connect(&target).await else {
                continue;
            };
            let (ri, wi) = inbound.into_split();
            let (ro, wo) = outbound.into_split();
            tokio::spawn(pump(ri, wo, Arc::clone(&log)));
            tokio::spawn(pump(ro, wi, Arc::clone(&log)));
        }
    });
    (addr, seen)
}

/// Copies `r` to `w`, appending every byte to `log`.
async fn pump(
    mut r: impl tokio::io::AsyncRead + Unpin,
    mut w: impl tokio::io::AsyncWrite + Unpin,
    log: Arc<Mutex<Vec<u8>>>,
) {
    let mut buf = vec![0u8; 64 << 10];
    loop {
        let n = match r.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        log.lock().unwrap().extend_from_slice(&buf[..n]);
        if w.write_all(&buf[..n]).await.is_err() {
            break;
        }
    }
    let _ = w.shutdown().await;
}

fn contains(hay: &[u8], needle: &[u8]) -> bool {
    hay.windows(needle.len()).any(|w| w == needle)
}

/// Moves a 64 KiB pattern through a recording proxy and reports whether
/// the capture holds the whole pattern, and any 16-byte piece of it.
async fn capture_through_proxy(a: &TcpEngine, b: &TcpEngine) -> (bool, bool, usize, String) {
    let (addr, seen) = recording_proxy(b.segment_name().to_owned()).await;
    let len = 64 << 10;
    let data: Vec<u8> = (0..len as u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8 ^ 0x5a)
        .collect();
    let src = mem(a, len, 0).await;
    let back = mem(a, len, 0).await;
    let dst = mem(b, len, 0).await;
    src.write(0, &data).unwrap();
    let seg = a.open_segment(&addr).await.expect("open through the proxy");
    a.transfer(
        seg,
        TransferRequest::write(src.addr(), dst.addr(), len as u64),
    )
    .await
    .expect("write through the proxy");
    a.transfer(
        seg,
        TransferRequest::read(back.addr(), dst.addr(), len as u64),
    )
    .await
    .expect("read through the proxy");
    assert!(dst.to_vec() == data && back.to_vec() == data);
    a.unregister(src.addr()).await.unwrap();
    a.unregister(back.addr()).await.unwrap();
    b.unregister(dst.addr()).await.unwrap();
    let cap = seen.lock().unwrap().clone();
    let whole = contains(&cap, &data);
    let piece = (0..len - 16)
        .step_by(997)
        .any(|at| contains(&cap, &data[at..at + 16]));
    (whole, piece, cap.len(), addr)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_recording_proxy_sees_no_plaintext() {
    // Control: without TLS the proxy sees the pattern (the test can fail).
    let a = start(secret_cfg(TlsMode::Off)).await;
    let b = start(secret_cfg(TlsMode::Off)).await;
    let (whole, piece, n, _) = capture_through_proxy(&a, &b).await;
    assert!(
        whole && piece,
        "the clear-text control must show the pattern ({n} bytes)"
    );
    for (a, b) in [
        (secret_cfg(TlsMode::Require), secret_cfg(TlsMode::On)),
        (
            cert_cfg(TlsMode::Require, tls_files()),
            cert_cfg(TlsMode::On, tls_files()),
        ),
    ] {
        let (a, b) = (start(a).await, start(b).await);
        let (whole, piece, n, proxy) = capture_through_proxy(&a, &b).await;
        assert!(
            n > 2 * (64 << 10),
            "the proxy carried the transfer ({n} bytes)"
        );
        assert!(!whole && !piece, "plaintext in the capture");
        assert!(tls_of(&a, &proxy).is_ok());
    }
}

/// A fake target that answers the clear-text handshake announcing TLS
/// with `identity`, then terminates TLS with `server` (a certificate the
/// initiator must not accept).
async fn fake_tls_target(identity: u8, server: Arc<rustls::ServerConfig>) -> String {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap().to_string();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = l.accept().await {
            let server = Arc::clone(&server);
            tokio::spawn(async move {
                let mut fixed = [0u8; HELLO_FIXED];
                s.read_exact(&mut fixed).await?;
                let (_, n) =
                    Hello::decode_fixed(&fixed).map_err(|_| std::io::ErrorKind::InvalidData)?;
                let mut name = vec![0u8; n];
                s.read_exact(&mut name).await?;
                let hello = Hello {
                    version: LEGACY_VERSION,
                    flags: FLAG_AUTH | FLAG_EXT,
                    nonce: [9; 32],
                    name: "mitm".to_owned(),
                };
                let ext = Extensions {
                    versions: VersionRange::OURS,
                    features: FeatureSet { has: 16, on: 16 },
                    host: None,
                    tls: Some(identity),
                    cred: None,
                };
                s.write_all(&[hello.encode(), ext.encode()].concat())
                    .await?;
                let mut len = [0u8; 2];
                s.read_exact(&mut len).await?;
                let mut body = vec![0u8; u16::from_le_bytes(len) as usize];
                s.read_exact(&mut body).await?;
                let acceptor = tokio_rustls::TlsAcceptor::from(server);
                let _ = acceptor.accept(s).await;
                Ok::<_, std::io::Error>(())
            });
        }
    });
    addr
}

fn server_config(
    cert: rustls::pki_types::CertificateDer<'static>,
    key: rustls::pki_types::PrivateKeyDer<'static>,
) -> Arc<rustls::ServerConfig> {
    Arc::new(
        rustls::ServerConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_protocol_versions(&[&rustls::version::TLS13])
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(vec![cert], key)
        .unwrap(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_proxy_with_the_wrong_certificate_cannot_complete_the_handshake() {
    use rustls::pki_types::pem::PemObject;
    // Secret identity: the proxy presents a self-signed Ed25519 certificate
    // of its own key (it does not know the secret).
    let key = rcgen::KeyPair::generate_for(&rcgen::PKCS_ED25519).unwrap();
    let cert = rcgen::CertificateParams::new(vec!["ferry-tcp".to_owned()])
        .unwrap()
        .self_signed(&key)
        .unwrap();
    let der = rustls::pki_types::PrivateKeyDer::Pkcs8(key.serialize_der().into());
    let addr = fake_tls_target(1, server_config(cert.der().clone(), der)).await;
    let a = start({
        let mut config = secret_cfg(TlsMode::Require);
        config.connect_timeout = Duration::from_secs(3);
        config
    })
    .await;
    let t0 = Instant::now();
    let e = a.open_segment(&addr).await.unwrap_err();
    eprintln!("refused as expected: {e}");
    assert!(matches!(e, Error::Authentication { .. }), "{e}");
    assert!(e.to_string().contains("TLS"), "{e}");
    assert!(
        t0.elapsed() < Duration::from_secs(3),
        "typed error, no hang"
    );
    // Certificates: the proxy's chain comes from another CA.
    let other = make_tls_files("mitm");
    let cert = rustls::pki_types::CertificateDer::from_pem_file(&other.cert).unwrap();
    let key = rustls::pki_types::PrivateKeyDer::from_pem_file(&other.key).unwrap();
    let addr = fake_tls_target(2, server_config(cert, key)).await;
    let a = start({
        let mut config = cert_cfg(TlsMode::Require, tls_files());
        config.connect_timeout = Duration::from_secs(3);
        config
    })
    .await;
    let e = a.open_segment(&addr).await.unwrap_err();
    eprintln!("refused as expected: {e}");
    assert!(matches!(e, Error::Authentication { .. }), "{e}");
    assert!(
        e.to_string().contains("UnknownIssuer") || e.to_string().contains("issuer"),
        "{e}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_same_host_path_runs_after_a_tls_handshake() {
    // TLS covers the socket; the same-host path stays a kernel copy.
    let cfg = || {
        let mut config = secret_cfg(TlsMode::Require);
        config.same_host = SameHost::Auto;
        config
    };
    let (a, b) = (start(cfg()).await, start(cfg()).await);
    round_trip(&a, &b, b.segment_name(), 1 << 20).await;
    let r = a.peer_report(b.segment_name()).unwrap();
    assert!(r.tls.is_ok(), "{r}");
    assert!(r.path.starts_with("same-host"), "{r}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tls_connection_moved_to_its_own_thread_keeps_its_session() {
    // With the frames kept on the TCP connection (`same_host_unix` off),
    // the target serves the agreed same-host connection on a thread of its
    // own: the TLS session moves there with the socket, and frames, acks
    // and notifications keep flowing encrypted.
    let cfg = || {
        let mut config = secret_cfg(TlsMode::Require);
        config.same_host = SameHost::Auto;
        config.same_host_unix = false;
        config
    };
    let (a, b) = (start(cfg()).await, start(cfg()).await);
    for len in [4096, 300_000, 1 << 20] {
        round_trip(&a, &b, b.segment_name(), len).await;
    }
    let r = a.peer_report(b.segment_name()).unwrap();
    assert!(r.tls.is_ok(), "{r}");
    assert!(r.path.starts_with("same-host"), "{r}");
}

#[test]
fn tls_settings_are_checked() {
    for (url, want) in [
        ("tcp://127.0.0.1:0?tls=on", "needs a shared secret"),
        ("tcp://127.0.0.1:0?tls=maybe", "must be off, on or require"),
        ("tcp://127.0.0.1:0?tls=on&tls_cert=/x", "go together"),
    ] {
        let e = TcpConfig::from_url(url).unwrap_err();
        eprintln!("refused as expected: {e}");
        assert!(e.to_string().contains(want), "{url}: {e}");
    }
    let c = TcpConfig::from_url("tcp://127.0.0.1:0?tls=require&secret=s").unwrap();
    assert_eq!(c.tls, TlsMode::Require);
}

//! Where the cost of TLS goes on this machine: AES-GCM alone (ring, one
//! core), a loopback TCP stream in clear and under rustls (no Ferry), and
//! the same TLS stream behind one Unix-socket relay hop on each side (the
//! design `tls=on` had until 2026-12-03; now the connection's own I/O
//! drives rustls, see src/tls/conn.rs). Each line is GB/s of payload for
//! 1 MiB writes. `cargo run --release -p ferry-tcp --example
//! tls_cost [GiB]`.

use std::sync::Arc;
use std::time::Instant;

use ring::aead::{Aad, LessSafeKey, Nonce, UnboundKey, AES_128_GCM, AES_256_GCM};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream, UnixStream};

const BLOCK: usize = 1 << 20;

fn aead(alg: &'static ring::aead::Algorithm, total: usize) -> f64 {
    let key = LessSafeKey::new(UnboundKey::new(alg, &vec![7u8; alg.key_len()]).unwrap());
    let mut rec = vec![1u8; 16 << 10];
    let t = Instant::now();
    let mut n = 0;
    let mut i = 0u64;
    while n < total {
        let mut nonce = [0u8; 12];
        nonce[4..].copy_from_slice(&i.to_be_bytes());
        let _tag = key
            .seal_in_place_separate_tag(Nonce::assume_unique_for_key(nonce), Aad::empty(), &mut rec)
            .unwrap();
        n += rec.len();
        i += 1;
    }
    n as f64 / t.elapsed().as_secs_f64() / 1e9
}

#[derive(Debug)]
struct AcceptAll;

impl rustls::client::danger::ServerCertVerifier for AcceptAll {
    fn verify_server_cert(
        &self,
        _: &CertificateDer<'_>,
        _: &[CertificateDer<'_>],
        _: &ServerName<'_>,
        _: &[u8],
        _: UnixTime,
    ) -> Result<rustls::client::danger::ServerCertVerified, rustls::Error> {
        Ok(rustls::client::danger::ServerCertVerified::assertion())
    }
    fn verify_tls12_signature(
        &self,
        _: &[u8],
        _: &CertificateDer<'_>,
        _: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        Ok(rustls::client::danger::HandshakeSignatureValid::assertion())
    }
    fn verify_tls13_signature(
        &self,
        _: &[u8],
        _: &CertificateDer<'_>,
        _: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        Ok(rustls::client::danger::HandshakeSignatureValid::assertion())
    }
    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        rustls::crypto::ring::default_provider()
            .signature_verification_algorithms
            .supported_schemes()
    }
}

/// Sends `total` bytes from `w` in 1 MiB writes while `r` reads them.
async fn pump<W, R>(mut w: W, mut r: R, total: usize) -> f64
where
    W: AsyncWrite + Unpin + Send + 'static,
    R: AsyncRead + Unpin + Send + 'static,
{
    let t = Instant::now();
    let tx = tokio::spawn(async move {
        let buf = vec![3u8; BLOCK];
        let mut n = 0;
        while n < total {
            w.write_all(&buf).await.unwrap();
            n += BLOCK;
        }
        w.flush().await.unwrap();
        w
    });
    let mut buf = vec![0u8; BLOCK];
    let mut n = 0;
    while n < total {
        let k = r.read(&mut buf).await.unwrap();
        assert!(k > 0);
        n += k;
    }
    let _w = tx.await.unwrap();
    total as f64 / t.elapsed().as_secs_f64() / 1e9
}

async fn tcp_pair() -> (TcpStream, TcpStream) {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let c = TcpStream::connect(l.local_addr().unwrap()).await.unwrap();
    let (s, _) = l.accept().await.unwrap();
    c.set_nodelay(true).unwrap();
    s.set_nodelay(true).unwrap();
    (c, s)
}

type Buffered = tokio::io::BufReader<TcpStream>;

/// A TLS pair over loopback TCP, each end reading the socket through a
/// `read_buf`-byte buffer (0: rustls reads the socket itself).
async fn tls_pair(
    suite: rustls::CipherSuite,
    read_buf: usize,
) -> (
    tokio_rustls::client::TlsStream<Buffered>,
    tokio_rustls::server::TlsStream<Buffered>,
) {
    let mut p = rustls::crypto::ring::default_provider();
    p.cipher_suites.retain(|s| s.suite() == suite);
    let p = Arc::new(p);
    let key = rcgen::KeyPair::generate_for(&rcgen::PKCS_ED25519).unwrap();
    let cert = rcgen::CertificateParams::new(vec!["x".to_owned()])
        .unwrap()
        .self_signed(&key)
        .unwrap();
    let server = rustls::ServerConfig::builder_with_provider(Arc::clone(&p))
        .with_protocol_versions(&[&rustls::version::TLS13])
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(
            vec![cert.der().clone()],
            PrivateKeyDer::Pkcs8(key.serialize_der().into()),
        )
        .unwrap();
    let client = rustls::ClientConfig::builder_with_provider(p)
        .with_protocol_versions(&[&rustls::version::TLS13])
        .unwrap()
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(AcceptAll))
        .with_no_client_auth();
    let (c, s) = tcp_pair().await;
    let (c, s) = (
        tokio::io::BufReader::with_capacity(read_buf.max(1), c),
        tokio::io::BufReader::with_capacity(read_buf.max(1), s),
    );
    let acc = tokio_rustls::TlsAcceptor::from(Arc::new(server));
    let con = tokio_rustls::TlsConnector::from(Arc::new(client));
    let sv = tokio::spawn(async move { acc.accept(s).await.unwrap() });
    let cl = con
        .connect(ServerName::try_from("x").unwrap(), c)
        .await
        .unwrap();
    (cl, sv.await.unwrap())
}

/// A Unix pair whose far end is copied to and from `io` (the former TLS
/// relay's design, 256 KiB buffers).
fn relay<T: AsyncRead + AsyncWrite + Unpin + Send + 'static>(mut io: T) -> UnixStream {
    let (a, mut b) = UnixStream::pair().unwrap();
    tokio::spawn(async move {
        let _ =
            tokio::io::copy_bidirectional_with_sizes(&mut io, &mut b, 256 << 10, 256 << 10).await;
    });
    a
}

fn main() {
    let gib: usize = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(2);
    let total = gib << 30;
    println!(
        "AES-128-GCM seal, one core, 16 KiB records: {:.2} GB/s",
        aead(&AES_128_GCM, total)
    );
    println!(
        "AES-256-GCM seal, one core, 16 KiB records: {:.2} GB/s",
        aead(&AES_256_GCM, total)
    );
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let (c, s) = tcp_pair().await;
        println!(
            "loopback TCP, clear:             {:.2} GB/s",
            pump(c, s, total).await
        );
        let (c, s) = UnixStream::pair().unwrap();
        println!(
            "Unix socket pair, clear:         {:.2} GB/s",
            pump(c, s, total).await
        );
        for suite in [
            rustls::CipherSuite::TLS13_AES_128_GCM_SHA256,
            rustls::CipherSuite::TLS13_AES_256_GCM_SHA384,
        ] {
            let (c, s) = tls_pair(suite, 0).await;
            println!(
                "loopback TCP, {suite:?}: {:.2} GB/s",
                pump(c, s, total).await
            );
            let (c, s) = tls_pair(suite, 1 << 20).await;
            println!(
                "  … reading the socket through a 1 MiB buffer: {:.2} GB/s",
                pump(c, s, total).await
            );
            let (c, s) = tls_pair(suite, 0).await;
            let (c, s) = (relay(c), relay(s));
            println!(
                "  … behind a Unix relay on each side: {:.2} GB/s",
                pump(c, s, total).await
            );
            let (c, s) = tls_pair(suite, 1 << 20).await;
            let (c, s) = (relay(c), relay(s));
            println!(
                "  … relay and 1 MiB read buffer: {:.2} GB/s",
                pump(c, s, total).await
            );
        }
    });
}

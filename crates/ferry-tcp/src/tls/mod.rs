//! TLS 1.3 on a connection (PROTOCOL.md §1.3), with rustls and its `ring`
//! provider (no OpenSSL).
//!
//! Two ways to name the peers:
//!
//! - **Certificates** (`tls_cert`, `tls_key`, `tls_ca`): the target
//!   presents its chain, the initiator checks it against `tls_ca` and the
//!   host of the segment name; the initiator presents its own chain, which
//!   the target checks against the same CA (mutual authentication).
//! - **An identity derived from the shared secret** (no files): rustls has
//!   no external-PSK API, so each role's Ed25519 key is derived from the
//!   secret (HKDF-SHA256), the target presents a self-signed certificate
//!   of its key, and the initiator accepts exactly that public key (the
//!   TLS 1.3 CertificateVerify signature must verify with it; nothing else
//!   in the certificate counts). This is not a TLS PSK: it is an
//!   authenticated (EC)DHE handshake whose server key only holders of the
//!   secret can compute. The initiator is then authenticated by the HMAC
//!   proof, which runs inside TLS and is bound to the TLS exporter.
//!
//! rustls runs the handshake (read one record at a time, so that it never
//! holds a byte of what follows); then its traffic secrets move with the
//! TCP socket into a [`conn::TlsConn`], Ferry's own TLS 1.3 record layer
//! ([`ferry_tcp_proto::record`] decides, ring seals and opens), which the
//! connection's non-blocking reads and writes drive ([`crate::io`]):
//! frames, pacing, deadlines and fences run unchanged on it, and a byte
//! costs its encryption, nothing more (records that fit the destination
//! are decrypted in place). The wire is standard TLS 1.3: a peer running
//! plain rustls (an older Ferry) talks to it unchanged.

pub(crate) mod conn;
mod seal;
#[cfg(test)]
mod tests;

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use ferry_core::{Error, Result};
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer, ServerName, UnixTime};
use rustls::{DigitallySignedStruct, SignatureScheme};

use crate::stream::Stream;

/// The `tls` setting.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum TlsMode {
    /// Never (default): connections stay in clear; TLS is announced off.
    #[default]
    Off,
    /// TLS with every peer that has it on; clear with the others.
    On,
    /// TLS or nothing: a peer without it is refused.
    Require,
}

impl TlsMode {
    /// Parses a URL value: `off`/`0`, `on`/`1`, `require`.
    pub fn parse(s: &str) -> Option<TlsMode> {
        match s {
            "off" | "0" | "false" => Some(TlsMode::Off),
            "on" | "1" | "true" => Some(TlsMode::On),
            "require" => Some(TlsMode::Require),
            _ => None,
        }
    }
}

/// How a side names itself in TLS (the value of the TLS extension): the
/// core's, where the handshake decides with it.
pub use ferry_tcp_proto::handshake::TlsIdentity as Identity;

/// An engine's TLS configurations, built once at start.
pub struct TlsContext {
    /// `tls=on` or `require`.
    pub mode: TlsMode,
    /// How this engine names itself.
    pub identity: Identity,
    client: Arc<rustls::ClientConfig>,
    server: Arc<rustls::ServerConfig>,
}

impl std::fmt::Debug for TlsContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TlsContext")
            .field("mode", &self.mode)
            .field("identity", &self.identity)
            .finish_non_exhaustive()
    }
}

/// What a TLS handshake settled.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Session {
    /// The cipher suite (`TLS13_AES_256_GCM_SHA384`, …).
    pub suite: String,
    /// 32 bytes of the TLS exporter (label `EXPORTER-ferry-tcp`), which
    /// the HMAC proofs cover.
    pub exporter: [u8; 32],
}

/// The exporter's label (RFC 8446 §7.5).
const EXPORTER_LABEL: &[u8] = b"EXPORTER-ferry-tcp";

fn invalid(msg: String) -> Error {
    Error::InvalidArgument(msg)
}

/// ring's provider with TLS13_AES_128_GCM_SHA256 first (both sides use
/// this order, so it is the suite two Ferry engines agree on): 10 AES
/// rounds instead of AES-256's 14, the cheapest suite on CPUs with AES-NI.
fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    let mut p = rustls::crypto::ring::default_provider();
    p.cipher_suites
        .sort_by_key(|s| s.suite() != rustls::CipherSuite::TLS13_AES_128_GCM_SHA256);
    Arc::new(p)
}

/// The PKCS#8 (v1) encoding of an Ed25519 private key seed (RFC 8410).
fn ed25519_pkcs8(seed: &[u8; 32]) -> Vec<u8> {
    const PREFIX: [u8; 16] = [
        0x30, 0x2e, 0x02, 0x01, 0x00, 0x30, 0x05, 0x06, 0x03, 0x2b, 0x65, 0x70, 0x04, 0x22, 0x04,
        0x20,
    ];
    [PREFIX.as_slice(), seed].concat()
}

/// The Ed25519 seed of `role` (`target` or `initiator`) for `secret`:
/// HKDF-SHA256(salt `ferry-tcp tls v1`, ikm secret, info `role`).
fn derive_seed(secret: &str, role: &str) -> [u8; 32] {
    let hk = hkdf::Hkdf::<sha2::Sha256>::new(Some(b"ferry-tcp tls v1"), secret.as_bytes());
    let mut seed = [0u8; 32];
    // 32 bytes is far below HKDF's limit (255 × 32): cannot fail.
    let _ = hk.expand(role.as_bytes(), &mut seed);
    seed
}

/// The target's derived certificate, its key and its public key.
fn derived_target(
    secret: &str,
) -> Result<(CertificateDer<'static>, PrivateKeyDer<'static>, Vec<u8>)> {
    use ring::signature::KeyPair as _;
    let seed = derive_seed(secret, "target");
    let pair = ring::signature::Ed25519KeyPair::from_seed_unchecked(&seed)
        .map_err(|_| invalid("deriving the TLS key from the secret failed".to_owned()))?;
    let public = pair.public_key().as_ref().to_vec();
    let pkcs8 = PrivatePkcs8KeyDer::from(ed25519_pkcs8(&seed));
    let key = rcgen::KeyPair::from_pkcs8_der_and_sign_algo(&pkcs8, &rcgen::PKCS_ED25519)
        .map_err(|e| invalid(format!("the derived TLS key: {e}")))?;
    let params = rcgen::CertificateParams::new(vec!["ferry-tcp".to_owned()])
        .map_err(|e| invalid(format!("the derived TLS certificate: {e}")))?;
    let cert = params
        .self_signed(&key)
        .map_err(|e| invalid(format!("the derived TLS certificate: {e}")))?;
    Ok((cert.der().clone(), PrivateKeyDer::Pkcs8(pkcs8), public))
}

/// Accepts exactly one Ed25519 public key: the certificate is not read,
/// the handshake signature must verify with the pinned key.
#[derive(Debug)]
struct PinnedKey {
    public: Vec<u8>,
}

impl ServerCertVerifier for PinnedKey {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp: &[u8],
        _now: UnixTime,
    ) -> std::result::Result<ServerCertVerified, rustls::Error> {
        // Identity is proven by the CertificateVerify signature below.
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        _message: &[u8],
        _cert: &CertificateDer<'_>,
        _dss: &DigitallySignedStruct,
    ) -> std::result::Result<HandshakeSignatureValid, rustls::Error> {
        Err(rustls::Error::PeerIncompatible(
            rustls::PeerIncompatible::Tls12NotOffered,
        ))
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        _cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> std::result::Result<HandshakeSignatureValid, rustls::Error> {
        if dss.scheme != SignatureScheme::ED25519 {
            return Err(rustls::Error::InvalidCertificate(
                rustls::CertificateError::BadSignature,
            ));
        }
        ring::signature::UnparsedPublicKey::new(&ring::signature::ED25519, &self.public)
            .verify(message, dss.signature())
            .map(|()| HandshakeSignatureValid::assertion())
            .map_err(|_| {
                rustls::Error::InvalidCertificate(
                    rustls::CertificateError::ApplicationVerificationFailure,
                )
            })
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        vec![SignatureScheme::ED25519]
    }
}

fn load_certs(path: &Path, what: &str) -> Result<Vec<CertificateDer<'static>>> {
    let certs: Vec<_> = CertificateDer::pem_file_iter(path)
        .map_err(|e| invalid(format!("{what} {}: {e}", path.display())))?
        .collect::<std::result::Result<_, _>>()
        .map_err(|e| invalid(format!("{what} {}: {e}", path.display())))?;
    if certs.is_empty() {
        return Err(invalid(format!(
            "{what} {} holds no PEM certificate",
            path.display()
        )));
    }
    Ok(certs)
}

impl TlsContext {
    /// The context of `cfg`, or `None` with `tls=off`. Reads the files
    /// named (errors name the file and the problem, never key bytes).
    pub fn new(cfg: &crate::TcpConfig) -> Result<Option<Arc<TlsContext>>> {
        if cfg.tls == TlsMode::Off {
            return Ok(None);
        }
        let tls13: &[&rustls::SupportedProtocolVersion] = &[&rustls::version::TLS13];
        let rustls_err = |e: rustls::Error| invalid(format!("TLS configuration: {e}"));
        let (identity, client, server) = match (&cfg.tls_cert, &cfg.tls_key, &cfg.tls_ca) {
            (Some(cert), Some(key), Some(ca)) => {
                let chain = load_certs(cert, "tls_cert")?;
                let key = PrivateKeyDer::from_pem_file(key)
                    .map_err(|e| invalid(format!("tls_key {}: {e}", key.display())))?;
                let mut roots = rustls::RootCertStore::empty();
                for c in load_certs(ca, "tls_ca")? {
                    roots
                        .add(c)
                        .map_err(|e| invalid(format!("tls_ca {}: {e}", ca.display())))?;
                }
                let roots = Arc::new(roots);
                let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
                    Arc::clone(&roots),
                    provider(),
                )
                .build()
                .map_err(|e| invalid(format!("tls_ca {}: {e}", ca.display())))?;
                let server = rustls::ServerConfig::builder_with_provider(provider())
                    .with_protocol_versions(tls13)
                    .map_err(rustls_err)?
                    .with_client_cert_verifier(verifier)
                    .with_single_cert(chain.clone(), key.clone_key())
                    .map_err(rustls_err)?;
                let client = rustls::ClientConfig::builder_with_provider(provider())
                    .with_protocol_versions(tls13)
                    .map_err(rustls_err)?
                    .with_root_certificates(roots)
                    .with_client_auth_cert(chain, key)
                    .map_err(rustls_err)?;
                (Identity::Certificates, client, server)
            }
            (None, None, None) => {
                let Some(secret) = cfg.secret.as_ref().map(ferry_core::Secret::expose) else {
                    return Err(invalid(
                        "tls=on/require needs either a shared secret (the TLS identity is \
                         derived from it) or tls_cert, tls_key and tls_ca"
                            .to_owned(),
                    ));
                };
                let (cert, key, public) = derived_target(secret)?;
                let server = rustls::ServerConfig::builder_with_provider(provider())
                    .with_protocol_versions(tls13)
                    .map_err(rustls_err)?
                    .with_no_client_auth()
                    .with_single_cert(vec![cert], key)
                    .map_err(rustls_err)?;
                let client = rustls::ClientConfig::builder_with_provider(provider())
                    .with_protocol_versions(tls13)
                    .map_err(rustls_err)?
                    .dangerous()
                    .with_custom_certificate_verifier(Arc::new(PinnedKey { public }))
                    .with_no_client_auth();
                (Identity::Secret, client, server)
            }
            _ => {
                return Err(invalid(
                    "tls_cert, tls_key and tls_ca go together (each side presents its chain \
                     and checks the peer's against the CA); without any of them the TLS \
                     identity is derived from the shared secret"
                        .to_owned(),
                ))
            }
        };
        let (mut client, mut server) = (client, server);
        client.enable_sni = identity == Identity::Certificates;
        // The record layer after the handshake is ours (conn.rs): rustls
        // hands over the traffic keys.
        client.enable_secret_extraction = true;
        server.enable_secret_extraction = true;
        // No session tickets: they would be records after the handshake,
        // and Ferry resumes no sessions (every handshake is a full one).
        server.send_tls13_tickets = 0;
        Ok(Some(Arc::new(TlsContext {
            mode: cfg.tls,
            identity,
            client: Arc::new(client),
            server: Arc::new(server),
        })))
    }

    /// Initiator side: runs the TLS handshake on `stream` (a TCP stream)
    /// with the target `peer` (`host:port`; with certificates the host is
    /// the name checked) and replaces `stream` with the plaintext end.
    pub async fn connect(
        &self,
        stream: &mut Stream,
        peer: &str,
        timeout: Duration,
    ) -> Result<Session> {
        let (mut tcp, addrs) = take_tcp(stream, peer)?;
        let name = match self.identity {
            Identity::Secret => ServerName::try_from("ferry-tcp").map(|n| n.to_owned()),
            Identity::Certificates => {
                let host = peer.rsplit_once(':').map_or(peer, |(h, _)| h);
                let host = host.trim_start_matches('[').trim_end_matches(']');
                ServerName::try_from(host.to_owned())
            }
        }
        .map_err(|e| Error::InvalidArgument(format!("TLS server name of {peer}: {e}")))?;
        let capture = Arc::new(Capture::default());
        let mut config = (*self.client).clone();
        config.key_log = capture.clone();
        let conn = rustls::ClientConnection::new(Arc::new(config), name)
            .map_err(|e| rustls_error(peer, "the target", &e))?;
        let mut conn = rustls::Connection::from(conn);
        handshake(drive(&mut conn, &mut tcp), timeout, peer, "the target").await?;
        let session = session_of(&conn, peer)?;
        let start = hand_over(conn, &capture, true, peer)?;
        *stream = Stream::Tls(Box::new(conn::TlsConn::new(tcp, addrs, start)));
        Ok(session)
    }

    /// Target side: as [`TlsContext::connect`].
    pub async fn accept(
        &self,
        stream: &mut Stream,
        peer: &str,
        timeout: Duration,
    ) -> Result<Session> {
        let (mut tcp, addrs) = take_tcp(stream, peer)?;
        let capture = Arc::new(Capture::default());
        let mut config = (*self.server).clone();
        config.key_log = capture.clone();
        let conn = rustls::ServerConnection::new(Arc::new(config))
            .map_err(|e| rustls_error(peer, "the initiator", &e))?;
        let mut conn = rustls::Connection::from(conn);
        let r = handshake(drive(&mut conn, &mut tcp), timeout, peer, "the initiator").await;
        if let Err(e) = r {
            linger(tcp);
            return Err(e);
        }
        let session = session_of(&conn, peer)?;
        let start = hand_over(conn, &capture, false, peer)?;
        *stream = Stream::Tls(Box::new(conn::TlsConn::new(tcp, addrs, start)));
        Ok(session)
    }
}

/// The traffic secrets of one handshake, as rustls logs them.
#[derive(Debug, Default)]
struct Capture(std::sync::Mutex<[Option<Vec<u8>>; 2]>);

const TRAFFIC_LABELS: [&str; 2] = ["CLIENT_TRAFFIC_SECRET_0", "SERVER_TRAFFIC_SECRET_0"];

impl rustls::KeyLog for Capture {
    fn log(&self, label: &str, _client_random: &[u8], secret: &[u8]) {
        if let Some(i) = TRAFFIC_LABELS.iter().position(|l| *l == label) {
            self.0.lock().unwrap_or_else(|p| p.into_inner())[i] = Some(secret.to_vec());
        }
    }

    fn will_log(&self, label: &str) -> bool {
        TRAFFIC_LABELS.contains(&label)
    }
}

/// Drives rustls through the handshake on `tcp`, giving it one record at
/// a time: when the handshake is done, rustls holds no byte of the
/// records that follow (they are the record layer's).
async fn drive(
    conn: &mut rustls::Connection,
    tcp: &mut tokio::net::TcpStream,
) -> std::io::Result<()> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut out = Vec::new();
    loop {
        while conn.wants_write() {
            out.clear();
            conn.write_tls(&mut out)?;
            tcp.write_all(&out).await?;
        }
        if !conn.is_handshaking() {
            return Ok(());
        }
        let mut h = [0u8; 5];
        tcp.read_exact(&mut h).await?;
        // rustls judges the header first (type, version, length): bytes
        // that are no TLS record get its alert at once, not a wait for a
        // body that never comes.
        feed(conn, tcp, &h, &mut out).await?;
        let len = usize::from(u16::from_be_bytes([h[3], h[4]]));
        // (rustls refuses longer records above; this bounds the buffer
        // whatever it accepts.)
        if len > (1 << 14) + 2048 {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                rustls::Error::InvalidMessage(rustls::InvalidMessage::MessageTooLarge),
            ));
        }
        let mut body = vec![0u8; len];
        tcp.read_exact(&mut body).await?;
        feed(conn, tcp, &body, &mut out).await?;
    }
}

/// Gives `bytes` to rustls; on a TLS error its alert goes out (best
/// effort) and the error is returned.
async fn feed(
    conn: &mut rustls::Connection,
    tcp: &mut tokio::net::TcpStream,
    bytes: &[u8],
    out: &mut Vec<u8>,
) -> std::io::Result<()> {
    use tokio::io::AsyncWriteExt;
    let mut s = bytes;
    while !s.is_empty() {
        conn.read_tls(&mut s)?;
    }
    if let Err(e) = conn.process_new_packets() {
        out.clear();
        if conn.write_tls(out).is_ok() {
            let _ = tcp.write_all(out).await;
        }
        return Err(std::io::Error::new(std::io::ErrorKind::InvalidData, e));
    }
    Ok(())
}

/// After a failed handshake on the target: the alert is written; the
/// socket stays open (reading and dropping what the initiator still
/// sends) for a short while, so that closing it does not reset the
/// connection before the initiator has read the alert (a reset discards
/// it, and the initiator would see a lost peer instead of a refusal).
fn linger(mut tcp: tokio::net::TcpStream) {
    let Ok(rt) = tokio::runtime::Handle::try_current() else {
        return;
    };
    rt.spawn(async move {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let _ = tcp.shutdown().await;
        let mut scratch = [0u8; 4096];
        let _ = tokio::time::timeout(Duration::from_secs(2), async {
            while matches!(tcp.read(&mut scratch).await, Ok(n) if n > 0) {}
        })
        .await;
    });
}

/// Takes the keys out of a connection whose handshake `drive` completed.
fn hand_over(
    mut conn: rustls::Connection,
    capture: &Capture,
    client: bool,
    peer: &str,
) -> Result<conn::Start> {
    let protocol = |reason: String| Error::Protocol {
        peer: peer.to_owned(),
        reason,
    };
    // Plaintext rustls decrypted already (none is expected: it was given
    // the handshake's records only) is delivered first.
    let mut pending = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        match std::io::Read::read(&mut conn.reader(), &mut chunk) {
            Ok(0) => break,
            Ok(n) => pending.extend_from_slice(&chunk[..n]),
            Err(_) => break,
        }
    }
    let suite = conn
        .negotiated_cipher_suite()
        .and_then(|s| conn::Suite::of(s.suite()))
        .ok_or_else(|| protocol("TLS suite without a record layer here".to_owned()))?;
    let secrets = conn
        .dangerous_extract_secrets()
        .map_err(|e| protocol(format!("TLS keys: {e}")))?;
    let [c, s] = std::mem::take(&mut *capture.0.lock().unwrap_or_else(|p| p.into_inner()));
    let (Some(c), Some(s)) = (c, s) else {
        return Err(protocol("TLS traffic secrets were not logged".to_owned()));
    };
    let (tx, rx) = if client { (c, s) } else { (s, c) };
    let (tx, rx) = (conn::Keys::new(suite, tx), conn::Keys::new(suite, rx));
    if !tx.matches(&secrets.tx.1) || !rx.matches(&secrets.rx.1) {
        return Err(protocol("TLS key schedule mismatch".to_owned()));
    }
    Ok(conn::Start {
        client,
        tx: (tx, secrets.tx.0),
        rx: (rx, secrets.rx.0),
        pending,
    })
}

/// Runs a TLS handshake within `timeout`, its failure named as [`tls_error`]
/// says (`who`: the other side).
async fn handshake<T>(
    hs: impl std::future::Future<Output = std::io::Result<T>>,
    timeout: Duration,
    peer: &str,
    who: &str,
) -> Result<T> {
    tokio::time::timeout(timeout, hs)
        .await
        .map_err(|_| tls_timeout(peer, timeout))?
        .map_err(|e| tls_error(peer, who, e))
}

fn tls_timeout(peer: &str, after: Duration) -> Error {
    Error::Timeout {
        operation: "TLS handshake".to_owned(),
        peer: Some(peer.to_owned()),
        after,
    }
}

/// A failed TLS handshake: a certificate or signature the peer could not
/// prove is [`Error::Authentication`]; a closed connection
/// [`Error::PeerLost`]; anything else [`Error::Protocol`].
fn tls_error(peer: &str, who: &str, e: std::io::Error) -> Error {
    if let Some(r) = e.get_ref().and_then(|i| i.downcast_ref::<rustls::Error>()) {
        return rustls_error(peer, who, r);
    }
    match e.kind() {
        std::io::ErrorKind::UnexpectedEof
        | std::io::ErrorKind::ConnectionReset
        | std::io::ErrorKind::BrokenPipe
        | std::io::ErrorKind::ConnectionAborted => Error::PeerLost {
            peer: peer.to_owned(),
            reason: format!("during the TLS handshake: {e}"),
        },
        _ => Error::Protocol {
            peer: peer.to_owned(),
            reason: format!("TLS handshake: {e}"),
        },
    }
}

/// A TLS error: a certificate or signature one side could not prove (also
/// as an alert the peer sent, such as a target refusing our certificate
/// once our side of the handshake was done) is [`Error::Authentication`],
/// anything else [`Error::Protocol`].
pub(crate) fn rustls_error(peer: &str, who: &str, r: &rustls::Error) -> Error {
    match r {
        rustls::Error::InvalidCertificate(_)
        | rustls::Error::NoCertificatesPresented
        | rustls::Error::AlertReceived(
            rustls::AlertDescription::BadCertificate
            | rustls::AlertDescription::CertificateRequired
            | rustls::AlertDescription::UnknownCA
            | rustls::AlertDescription::DecryptError
            | rustls::AlertDescription::CertificateUnknown,
        ) => Error::Authentication {
            peer: peer.to_owned(),
            reason: format!("TLS: {r} ({who} could not be authenticated, or refused us)"),
        },
        r => Error::Protocol {
            peer: peer.to_owned(),
            reason: format!("TLS: {r}"),
        },
    }
}

/// The TLS error an I/O error of a TLS connection carries, if any (see
/// [`conn`]): a record-layer error, or a peer's alert (a refused
/// certificate is [`Error::Authentication`]).
pub(crate) fn io_error_tls(peer: &str, who: &str, e: &std::io::Error) -> Option<Error> {
    let inner = e.get_ref()?;
    if let Some(r) = inner.downcast_ref::<rustls::Error>() {
        return Some(rustls_error(peer, who, r));
    }
    let r = inner.downcast_ref::<ferry_tcp_proto::record::RecordError>()?;
    use ferry_tcp_proto::record::RecordError;
    Some(match r {
        // The alerts of a certificate one side could not prove (RFC 8446
        // §6.2: bad_certificate, unknown_ca, certificate_unknown,
        // decrypt_error, certificate_required).
        RecordError::Alert(42 | 46 | 48 | 51 | 116) => Error::Authentication {
            peer: peer.to_owned(),
            reason: format!("TLS: {r} ({who} could not be authenticated, or refused us)"),
        },
        r => Error::Protocol {
            peer: peer.to_owned(),
            reason: format!("TLS: {r}"),
        },
    })
}

fn session_of(conn: &rustls::Connection, peer: &str) -> Result<Session> {
    if conn.protocol_version() != Some(rustls::ProtocolVersion::TLSv1_3) {
        return Err(Error::Protocol {
            peer: peer.to_owned(),
            reason: format!("TLS negotiated {:?}, not TLS 1.3", conn.protocol_version()),
        });
    }
    let suite = conn
        .negotiated_cipher_suite()
        .map(|s| format!("{:?}", s.suite()))
        .unwrap_or_else(|| "unknown".to_owned());
    let exporter = conn
        .export_keying_material([0u8; 32], EXPORTER_LABEL, None)
        .map_err(|e| Error::Protocol {
            peer: peer.to_owned(),
            reason: format!("TLS exporter: {e}"),
        })?;
    Ok(Session { suite, exporter })
}

/// Takes the TCP stream out of `stream` (leaving a placeholder that is
/// replaced right after).
fn take_tcp(
    stream: &mut Stream,
    peer: &str,
) -> Result<(tokio::net::TcpStream, (SocketAddr, SocketAddr))> {
    let Some(addrs) = stream.tcp_addrs() else {
        return Err(Error::Protocol {
            peer: peer.to_owned(),
            reason: "TLS can only start on a TCP connection".to_owned(),
        });
    };
    let (a, _b) = tokio::net::UnixStream::pair().map_err(|e| Error::io("socketpair", &e))?;
    match std::mem::replace(stream, Stream::Unix(a)) {
        Stream::Tcp(t) => Ok((t, addrs)),
        other => {
            *stream = other;
            Err(Error::Protocol {
                peer: peer.to_owned(),
                reason: "TLS already runs on this connection".to_owned(),
            })
        }
    }
}

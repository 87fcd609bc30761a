//! Helpers shared by the integration tests.
#![allow(dead_code)]

use std::sync::Arc;

use ferry_core::{HostBuffer, Location, TransferEngine};
use ferry_tcp::test_support::frame::{
    decode_table, Hello, TableEntry, HELLO_FIXED, MAX_TABLE_ENTRIES, NONCE_LEN, REJECT,
    TABLE_ENTRY_LEN, VERSION, WELCOME,
};
use ferry_tcp::{TcpConfig, TcpEngine};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// An engine. `FERRY_TEST_SAME_HOST=off|cma` overrides the default
/// `same_host=auto` (under which engines of one host use the cross-memory
/// path), so the fault tests run on either path; `FERRY_TEST_STAGE=off`
/// turns the staging area off (every same-host frame is then one kernel
/// copy by the target). `FERRY_TEST_TLS=cert` turns TLS on (`tls=on`) in
/// every engine with the test certificates ([`tls_files`]);
/// `FERRY_TEST_TLS=secret` in every engine that has a secret (the identity
/// derived from it). Hand-made raw peers do not announce TLS and stay in
/// clear.
/// A runtime of two worker threads, for tests whose callers block threads
/// outside it (`ferry_core::assist::block_on`).
pub fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

pub async fn engine(mut cfg: TcpConfig) -> Arc<TcpEngine> {
    with_test_tls(&mut cfg);
    if cfg.same_host == ferry_tcp::SameHost::Auto {
        if let Ok(v) = std::env::var("FERRY_TEST_SAME_HOST") {
            cfg.same_host = ferry_tcp::SameHost::parse(&v).expect("auto, cma or off");
        }
    }
    if std::env::var("FERRY_TEST_STAGE").as_deref() == Ok("off") {
        cfg.same_host_stage = None;
    }
    Arc::new(TcpEngine::start(cfg).await.expect("engine starts"))
}

/// Applies `FERRY_TEST_TLS` (see [`engine`]) to `cfg`.
pub fn with_test_tls(cfg: &mut TcpConfig) {
    if cfg.tls != ferry_tcp::TlsMode::Off {
        return;
    }
    match std::env::var("FERRY_TEST_TLS").as_deref() {
        Ok("cert") => {
            let f = tls_files();
            cfg.tls = ferry_tcp::TlsMode::On;
            cfg.tls_cert = Some(f.cert.clone());
            cfg.tls_key = Some(f.key.clone());
            cfg.tls_ca = Some(f.ca.clone());
        }
        Ok("secret") if cfg.secret.is_some() => cfg.tls = ferry_tcp::TlsMode::On,
        _ => {}
    }
}

/// A CA and a certificate it signed (for `localhost` and `127.0.0.1`,
/// server and client use), as PEM files.
#[derive(Clone, Debug)]
pub struct TlsFiles {
    /// Their directory.
    pub dir: std::path::PathBuf,
    /// The leaf certificate.
    pub cert: std::path::PathBuf,
    /// Its private key.
    pub key: std::path::PathBuf,
    /// The CA's certificate.
    pub ca: std::path::PathBuf,
}

/// Makes a fresh CA and leaf under a new directory named after `tag`
/// (in cargo's `CARGO_TARGET_TMPDIR`).
pub fn make_tls_files(tag: &str) -> TlsFiles {
    use rcgen::{
        BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair,
    };
    // Under the target directory (cargo's scratch space for integration
    // tests), not /tmp: the files are not removed after the run.
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("ferry-tls-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let ca_key = KeyPair::generate().expect("CA key");
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).expect("CA params");
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca_params
        .distinguished_name
        .push(DnType::CommonName, format!("ferry test CA {tag}"));
    let ca = ca_params.self_signed(&ca_key).expect("CA cert");
    let key = KeyPair::generate().expect("leaf key");
    let mut params = CertificateParams::new(vec!["localhost".to_owned(), "127.0.0.1".to_owned()])
        .expect("leaf params");
    params.extended_key_usages = vec![
        ExtendedKeyUsagePurpose::ServerAuth,
        ExtendedKeyUsagePurpose::ClientAuth,
    ];
    let leaf = params.signed_by(&key, &ca, &ca_key).expect("leaf cert");
    let files = TlsFiles {
        dir: dir.clone(),
        cert: dir.join("cert.pem"),
        key: dir.join("key.pem"),
        ca: dir.join("ca.pem"),
    };
    std::fs::write(&files.cert, leaf.pem()).expect("write cert");
    std::fs::write(&files.key, key.serialize_pem()).expect("write key");
    std::fs::write(&files.ca, ca.pem()).expect("write CA");
    files
}

/// The test certificates shared by a test binary's engines (a child
/// process of a test uses its parent's: the directory in
/// `FERRY_TEST_TLS_DIR`, see [`child_env`]).
pub fn tls_files() -> &'static TlsFiles {
    static FILES: std::sync::OnceLock<TlsFiles> = std::sync::OnceLock::new();
    FILES.get_or_init(|| match std::env::var_os("FERRY_TEST_TLS_DIR") {
        Some(dir) => {
            let dir = std::path::PathBuf::from(dir);
            TlsFiles {
                cert: dir.join("cert.pem"),
                key: dir.join("key.pem"),
                ca: dir.join("ca.pem"),
                dir,
            }
        }
        None => make_tls_files("shared"),
    })
}

/// What a child engine process of a test needs in its environment to
/// speak to its parent's engines (under `FERRY_TEST_TLS=cert`: the same
/// certificates).
pub fn child_env() -> Vec<(&'static str, std::ffi::OsString)> {
    if std::env::var("FERRY_TEST_TLS").as_deref() == Ok("cert") {
        vec![(
            "FERRY_TEST_TLS_DIR",
            tls_files().dir.clone().into_os_string(),
        )]
    } else {
        Vec::new()
    }
}

/// A host buffer filled with `byte`, registered with `e`.
pub async fn mem(e: &TcpEngine, len: usize, byte: u8) -> HostBuffer {
    let b = HostBuffer::new(len).expect("alloc");
    b.fill(byte);
    // SAFETY: callers keep the buffer alive until it is unregistered or its engine is dropped.
    e.register(unsafe { b.region(Location::cpu(0)) })
        .await
        .expect("register");
    b
}

/// `len` bytes of a deterministic pattern.
pub fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u32).wrapping_mul(2_654_435_761).to_le_bytes()[1] ^ seed)
        .collect()
}

/// A raw client that performs the handshake by hand (no secret) and
/// returns the stream and the advertised table as `(addr, len)`.
pub async fn raw_handshake(target: &str) -> (TcpStream, Vec<(u64, u64)>) {
    let (s, t) = raw_handshake_gens(target).await;
    (s, t.iter().map(|e| (e.addr, e.len)).collect())
}

/// The generation the raw table gives the region at `addr`.
pub fn gen_of(table: &[TableEntry], addr: u64) -> u32 {
    table
        .iter()
        .find(|e| e.addr <= addr && addr < e.addr + e.len)
        .map(|e| e.gen)
        .expect("address in the advertised table")
}

/// [`raw_handshake`] with the table's generations.
pub async fn raw_handshake_gens(target: &str) -> (TcpStream, Vec<TableEntry>) {
    let s = TcpStream::connect(target).await.expect("connect");
    raw_handshake_on(s).await
}

/// [`raw_handshake_gens`] on a connected stream.
pub async fn raw_handshake_on(mut s: TcpStream) -> (TcpStream, Vec<TableEntry>) {
    let hello = Hello {
        version: VERSION,
        flags: 0,
        nonce: [1; NONCE_LEN],
        name: "raw-test-client".to_owned(),
    };
    s.write_all(&hello.encode()).await.expect("hello");
    let mut fixed = [0u8; HELLO_FIXED];
    s.read_exact(&mut fixed).await.expect("server hello");
    let (_, name_len) = Hello::decode_fixed(&fixed).expect("valid hello");
    let mut name = vec![0u8; name_len];
    s.read_exact(&mut name).await.expect("name");
    s.write_all(&[0u8; 32]).await.expect("proof");
    let mut status = [0u8; 1];
    s.read_exact(&mut status).await.expect("status");
    assert_eq!(
        status[0], WELCOME,
        "expected a welcome (REJECT is {REJECT})"
    );
    let mut proof = [0u8; 32];
    s.read_exact(&mut proof).await.expect("proof");
    let mut idle = [0u8; 4];
    s.read_exact(&mut idle).await.expect("idle deadline");
    let mut count = [0u8; 4];
    s.read_exact(&mut count).await.expect("count");
    let count = u32::from_le_bytes(count);
    assert!(count <= MAX_TABLE_ENTRIES);
    let mut raw = vec![0u8; count as usize * TABLE_ENTRY_LEN];
    s.read_exact(&mut raw).await.expect("table");
    (s, decode_table(&raw).expect("valid table"))
}

/// A fake target's answer to the initiator's same-host offer (the first
/// frame after the welcome, if any): refused as disabled, so the connection
/// carries payloads on the socket, which these fakes speak.
pub async fn refuse_same_host(s: &mut TcpStream) {
    use ferry_tcp::test_support::frame::{kind, Response, Status, HEADER_LEN};
    // An initiator with same_host=off sends no offer.
    let mut first = [0u8; 1];
    if s.peek(&mut first).await.unwrap_or(0) == 0 || first[0] != kind::SAME_HOST {
        return;
    }
    let mut offer = [0u8; HEADER_LEN + ferry_tcp::test_support::cma::OFFER_LEN];
    s.read_exact(&mut offer).await.expect("same-host offer");
    let no = Response::Err {
        id: 0,
        status: Status::SameHostRefused,
        addr: ferry_tcp::test_support::cma::Refusal::Disabled as u64,
        len: 0,
    };
    s.write_all(&no.encode()).await.expect("refusal");
}

/// Asserts that `e` reaches `peer` on the path this run is about: the
/// cross-memory path unless `FERRY_TEST_SAME_HOST=off` (then the socket).
pub fn assert_path(e: &TcpEngine, peer: &str) {
    let key = format!("peer {peer}");
    let path = e
        .backend_info()
        .details
        .into_iter()
        .find(|(k, _)| *k == key)
        .map(|(_, v)| v)
        .unwrap_or_default();
    let want = match std::env::var("FERRY_TEST_SAME_HOST").as_deref() {
        Ok("off") => "path: tcp (same_host=off)",
        _ => "path: cma",
    };
    assert_eq!(path, want, "the path to {peer}");
    assert_tls(e, peer);
}

/// Under `FERRY_TEST_TLS`, asserts that the connection of `e` to `peer`
/// runs TLS (where the run puts TLS on both: with `secret`, only engines
/// with a secret have it).
pub fn assert_tls(e: &TcpEngine, peer: &str) {
    let want = match std::env::var("FERRY_TEST_TLS").as_deref() {
        Ok("cert") => true,
        Ok("secret") => e.config().secret.is_some(),
        _ => false,
    };
    if want {
        let r = e.peer_report(peer).expect("a peer report");
        assert!(r.tls.is_ok(), "FERRY_TEST_TLS: TLS is off to {peer}: {r}");
    }
}

/// Whether process `pid` is stopped (state `T` in /proc).
pub fn is_stopped(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|st| {
            st.rsplit(')')
                .next()
                .map(|r| r.trim_start().starts_with('T'))
        })
        .unwrap_or(false)
}

/// A child process of a test, killed and reaped when dropped.
pub struct Child(pub std::process::Child);

impl Drop for Child {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A child process running one ignored test of this test binary, spoken
/// to by lines: its standard input, and its standard output's lines.
/// Killed and reaped when dropped.
pub struct Helper {
    pub pid: i32,
    stdin: tokio::process::ChildStdin,
    lines: tokio::io::Lines<tokio::io::BufReader<tokio::process::ChildStdout>>,
    _child: Child,
}

impl Helper {
    /// Runs the ignored test `name` of this binary with `envs` (beside
    /// [`child_env`]). Call inside a Tokio runtime.
    pub fn spawn(name: &str, envs: &[(&str, String)]) -> Helper {
        use std::process::{Command, Stdio};
        let mut cmd = Command::new(std::env::current_exe().unwrap());
        cmd.args([
            "--exact",
            name,
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .envs(child_env())
        .envs(envs.iter().map(|(k, v)| (k, v)))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
        let mut child = cmd.spawn().unwrap();
        let pid = child.id() as i32;
        let stdin = tokio::process::ChildStdin::from_std(child.stdin.take().unwrap()).unwrap();
        let stdout = tokio::process::ChildStdout::from_std(child.stdout.take().unwrap()).unwrap();
        use tokio::io::AsyncBufReadExt;
        Helper {
            pid,
            stdin,
            lines: tokio::io::BufReader::new(stdout).lines(),
            _child: Child(child),
        }
    }

    /// Sends one line.
    pub async fn say(&mut self, line: &str) {
        self.stdin
            .write_all(format!("{line}\n").as_bytes())
            .await
            .unwrap();
    }

    /// The next line that holds one of `words`, from that word on (the
    /// test harness may print before it on the same line).
    pub async fn next(&mut self, words: &[&str]) -> String {
        loop {
            let line =
                tokio::time::timeout(std::time::Duration::from_secs(60), self.lines.next_line())
                    .await
                    .expect("the child answers")
                    .unwrap()
                    .expect("the child exited early");
            if let Some(pos) = words.iter().find_map(|w| line.find(w)) {
                return line[pos..].to_owned();
            }
        }
    }

    /// Waits (at most 10 s) until the process is stopped.
    pub async fn stopped(&self) {
        let t = std::time::Instant::now();
        while !is_stopped(self.pid) {
            assert!(
                t.elapsed() < std::time::Duration::from_secs(10),
                "the child did not stop"
            );
            tokio::time::sleep(std::time::Duration::from_millis(1)).await;
        }
    }

    /// Sends `sig` to the process.
    pub fn signal(&self, sig: i32) {
        // SAFETY: kill(2) on our own child, which is not reaped before
        // this helper drops.
        assert_eq!(unsafe { libc::kill(self.pid, sig) }, 0);
    }
}

/// A raw client that negotiates (extension block, no secret) with the
/// same-host path and its credential proof on (granted copies and TLS
/// off), returning the stream, the table and the target's credential
/// invitation (`None`: it sent none).
pub async fn raw_handshake_cred(
    target: &str,
) -> (
    TcpStream,
    Vec<TableEntry>,
    Option<ferry_tcp::test_support::negotiate::CredInvite>,
) {
    use ferry_tcp::test_support::frame::FLAG_EXT;
    use ferry_tcp::test_support::negotiate::{
        host_token, Extensions, FeatureSet, VersionRange, FEATURES, GRANTS, LEGACY_VERSION,
    };
    let mut s = TcpStream::connect(target).await.expect("connect");
    let nc: [u8; NONCE_LEN] = [3; NONCE_LEN];
    let hello = Hello {
        version: LEGACY_VERSION,
        flags: FLAG_EXT,
        nonce: nc,
        name: "raw-cred-client".to_owned(),
    };
    s.write_all(&hello.encode()).await.expect("hello");
    let mut fixed = [0u8; HELLO_FIXED];
    s.read_exact(&mut fixed).await.expect("server hello");
    let (theirs, name_len) = Hello::decode_fixed(&fixed).expect("valid hello");
    let mut name = vec![0u8; name_len];
    s.read_exact(&mut name).await.expect("name");
    let mut len = [0u8; 2];
    s.read_exact(&mut len).await.expect("extension block");
    let mut body = vec![0u8; u16::from_le_bytes(len) as usize];
    s.read_exact(&mut body).await.expect("extension block");
    let ext = Extensions::decode(&body).expect("the target's block");
    let has = FEATURES
        .iter()
        .filter(|f| **f != GRANTS)
        .fold(0, |m, f| m | f.bit);
    let mine = Extensions {
        versions: VersionRange::OURS,
        features: FeatureSet { has, on: has },
        host: ferry_tcp::test_support::cma::host_key().map(|k| host_token(&k, &nc, &theirs.nonce)),
        tls: None,
        cred: None,
    };
    s.write_all(&mine.encode()).await.expect("our block");
    s.write_all(&[0u8; 32]).await.expect("proof");
    let table = read_welcome(&mut s).await;
    (s, table, ext.cred)
}

/// [`raw_handshake_cred`], then proves this process's credentials to the
/// target (the returned Unix connection must stay open until the offer is
/// answered).
pub async fn raw_same_host(
    target: &str,
) -> (TcpStream, Vec<TableEntry>, std::os::unix::net::UnixStream) {
    let (s, table, invite) = raw_handshake_cred(target).await;
    let invite = invite.expect("the target invites a same-host peer to prove its credentials");
    let proof = ferry_tcp::test_support::cma::cred_connect(&invite).expect("credential socket");
    (s, table, proof)
}

/// Reads WELCOME, the target's proof, idle deadline and table.
async fn read_welcome(s: &mut TcpStream) -> Vec<TableEntry> {
    let mut status = [0u8; 1];
    s.read_exact(&mut status).await.expect("status");
    assert_eq!(
        status[0], WELCOME,
        "expected a welcome (REJECT is {REJECT})"
    );
    let mut proof = [0u8; 32];
    s.read_exact(&mut proof).await.expect("proof");
    let mut idle = [0u8; 4];
    s.read_exact(&mut idle).await.expect("idle deadline");
    let mut count = [0u8; 4];
    s.read_exact(&mut count).await.expect("count");
    let count = u32::from_le_bytes(count);
    assert!(count <= MAX_TABLE_ENTRIES);
    let mut raw = vec![0u8; count as usize * TABLE_ENTRY_LEN];
    s.read_exact(&mut raw).await.expect("table");
    decode_table(&raw).expect("valid table")
}

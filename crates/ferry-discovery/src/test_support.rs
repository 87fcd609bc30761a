//! A real etcd for tests (feature `test-support`; not part of the API
//! promise): one member started on loopback with free ports and its own
//! data directory, killed (and the directory removed) when dropped.
//!
//! [`Etcd::start`] returns `None` after printing `skipped: <test>: <reason>`
//! when the binary (Debian's `etcd-server`: `etcd` on `PATH` or
//! `/usr/bin/etcd`) or the `etcd` feature is missing, and panics instead
//! when `FERRY_REQUIRE_BACKENDS` lists `etcd`: CI cannot skip.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use ferry_core::conformance::{backend_required, report_skip};

/// Longest wait for etcd to answer after it was started.
pub const START_WAIT: Duration = Duration::from_secs(30);

/// The etcd binary, or `None` after reporting the skip (a panic when
/// `FERRY_REQUIRE_BACKENDS` lists `etcd`).
pub fn etcd_binary(test: &str) -> Option<PathBuf> {
    let reason = if !cfg!(feature = "etcd") {
        "built without the `etcd` cargo feature of ferry-discovery \
         (test with `--features etcd`)"
    } else {
        let found = std::env::var_os("PATH")
            .and_then(|paths| {
                std::env::split_paths(&paths)
                    .map(|d| d.join("etcd"))
                    .find(|p| p.is_file())
            })
            .or_else(|| Some(PathBuf::from("/usr/bin/etcd")).filter(|p| p.is_file()));
        if found.is_some() {
            return found;
        }
        "etcd is not installed (apt-get install etcd-server)"
    };
    if backend_required("etcd") {
        panic!("{test}: FERRY_REQUIRE_BACKENDS lists etcd, but {reason}");
    }
    report_skip(&format!("{test}: {reason}"));
    None
}

/// A loopback port nothing listens on right now.
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("bind a loopback port")
}

/// One etcd member on loopback.
#[derive(Debug)]
pub struct Etcd {
    bin: PathBuf,
    dir: PathBuf,
    client_port: u16,
    peer_port: u16,
    child: Option<Child>,
}

impl Etcd {
    /// Starts etcd for `test` with its directory under `tmp` (a test's
    /// `env!("CARGO_TARGET_TMPDIR")`) and waits until it answers; `None`
    /// when skipped (see the module).
    pub async fn start(test: &str, tmp: &Path) -> Option<Etcd> {
        let bin = etcd_binary(test)?;
        let dir = tmp.join(format!("etcd-{test}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("create the etcd directory");
        let mut etcd = Etcd {
            bin,
            dir,
            client_port: free_port(),
            peer_port: free_port(),
            child: None,
        };
        etcd.run().await;
        Some(etcd)
    }

    /// `host:port` of the client endpoint.
    pub fn endpoint(&self) -> String {
        format!("127.0.0.1:{}", self.client_port)
    }

    /// The member's data directory (remove it while stopped to restart
    /// empty).
    pub fn data_dir(&self) -> PathBuf {
        self.dir.join("data")
    }

    /// Whether the process runs (between [`Etcd::run`] and [`Etcd::kill`]).
    pub fn running(&self) -> bool {
        self.child.is_some()
    }

    /// Starts the process (again: same ports and data directory) and waits
    /// until it answers, at most [`START_WAIT`] (then panics with its log).
    pub async fn run(&mut self) {
        assert!(self.child.is_none(), "etcd is already running");
        let client = format!("http://127.0.0.1:{}", self.client_port);
        let peer = format!("http://127.0.0.1:{}", self.peer_port);
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.join("etcd.log"))
            .expect("open the etcd log");
        let child = Command::new(&self.bin)
            .args(["--name", "t", "--data-dir"])
            .arg(self.data_dir())
            .args(["--listen-client-urls", &client])
            .args(["--advertise-client-urls", &client])
            .args(["--listen-peer-urls", &peer])
            .args(["--initial-advertise-peer-urls", &peer])
            .args(["--initial-cluster", &format!("t={peer}")])
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("start etcd");
        self.child = Some(child);
        self.wait_ready().await;
    }

    #[cfg(feature = "etcd")]
    async fn wait_ready(&self) {
        let deadline = std::time::Instant::now() + START_WAIT;
        loop {
            let ep = [self.endpoint()];
            let probe = crate::EtcdDiscovery::connect_with_timeout(
                &ep,
                "/probe",
                Duration::from_secs(2),
                Duration::from_millis(500),
            );
            match probe.await {
                Ok(_) => return,
                Err(e) if std::time::Instant::now() > deadline => panic!(
                    "etcd did not come up within {START_WAIT:?}: {e}; log: {}",
                    std::fs::read_to_string(self.dir.join("etcd.log")).unwrap_or_default()
                ),
                Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
            }
        }
    }

    #[cfg(not(feature = "etcd"))]
    async fn wait_ready(&self) {
        unreachable!("etcd_binary skips every test without the `etcd` feature")
    }

    /// `kill -9`, waited for (no-op when not running).
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

//! A real Prometheus (Debian's `prometheus` package, `/usr/bin/prometheus`,
//! or whichever `prometheus` is first on `PATH`)
//! scrapes `ferry serve --metrics-listen` and `ferry bench --peer
//! --metrics-listen` on loopback while the bench drives traffic into the
//! serve, and the test queries Prometheus's HTTP API until
//! - the serve's `ferry_served_bytes_total` (what peers wrote into and read
//!   from its region, counted by its backend where each request is
//!   served), and
//! - the bench's own `ferry_transfer_bytes_total` (what its engine
//!   initiated)
//!
//! both equal, exactly and per direction, the bytes the bench reports in
//! its `--json` rows plus its known extras (see below).
//!
//! Where the server is not installed the test prints `skipped: …` and
//! returns; `FERRY_REQUIRE_BACKENDS` listing `prometheus` makes that a
//! failure (`.ci/run` installs and requires it).
//!
//! The serve initiates nothing: its `ferry_transfer_bytes_total` stays
//! absent, and the bench serves nothing: it has no `ferry_served_*`
//! series with bytes (both checked).
//!
//! Nothing listens beyond 127.0.0.1: the serve's engine, both metrics
//! endpoints and Prometheus's web port are all on loopback.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use ferry_core::conformance::{backend_required, report_skip};

/// Longest wait for anything: a child's banner, Prometheus's answer.
const WAIT: Duration = Duration::from_secs(60);

/// The Prometheus binary on `PATH` (Debian's is `/usr/bin/prometheus`;
/// `.ci/run` looks for it with `command -v`), or the skip (a failure when
/// `FERRY_REQUIRE_BACKENDS` lists prometheus).
fn prometheus(test: &str) -> Option<PathBuf> {
    let found = std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|d| d.join("prometheus"))
            .find(|p| p.is_file())
    });
    if found.is_some() {
        return found;
    }
    let reason = "prometheus is not installed (apt-get install prometheus)";
    if backend_required("prometheus") {
        panic!("{test}: FERRY_REQUIRE_BACKENDS lists prometheus, but {reason}");
    }
    report_skip(&format!("{test}: {reason}"));
    None
}

/// The child processes and the temporary directory of one test: killed
/// and removed on every exit path, a panic included.
struct Guard {
    children: Vec<Child>,
    dir: Option<PathBuf>,
}

impl Drop for Guard {
    fn drop(&mut self) {
        for c in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
        if let Some(d) = &self.dir {
            let _ = std::fs::remove_dir_all(d);
        }
    }
}

/// Spawns `cmd` with its stdout and stderr piped into one channel of
/// lines, those of stderr prefixed with [`STDERR`] (drained on threads, so
/// the child never blocks on a full pipe).
fn spawn(guard: &mut Guard, mut cmd: Command, what: &str) -> mpsc::Receiver<String> {
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("spawning {what}: {e}"));
    let (tx, rx) = mpsc::channel();
    let out = child.stdout.take().expect("stdout");
    let err = child.stderr.take().expect("stderr");
    guard.children.push(child);
    let tx2 = tx.clone();
    std::thread::spawn(move || drain(out, "", &tx));
    std::thread::spawn(move || drain(err, STDERR, &tx2));
    rx
}

/// The prefix of a child's stderr lines in [`spawn`]'s channel.
const STDERR: &str = "stderr: ";

fn drain(r: impl Read, prefix: &str, tx: &mpsc::Sender<String>) {
    for line in BufReader::new(r).lines() {
        let Ok(line) = line else { break };
        if tx.send(format!("{prefix}{line}")).is_err() {
            break;
        }
    }
}

/// Reads lines until `pick` accepts one; bounded by [`WAIT`].
fn wait_line<T>(
    rx: &mpsc::Receiver<String>,
    what: &str,
    seen: &mut Vec<String>,
    mut pick: impl FnMut(&str) -> Option<T>,
) -> T {
    let deadline = Instant::now() + WAIT;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let line = rx.recv_timeout(left).unwrap_or_else(|e| {
            panic!("{what}: no expected line within {WAIT:?} ({e}); got {seen:#?}")
        });
        seen.push(line.clone());
        if let Some(v) = pick(&line) {
            return v;
        }
    }
}

/// A port on 127.0.0.1 that was free a moment ago (for Prometheus, which
/// does not report the port it picks for `:0`).
fn free_port() -> u16 {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1:0");
    l.local_addr().expect("local_addr").port()
}

/// `GET path` on 127.0.0.1:`port` over HTTP/1.0 (so the answer is not
/// chunked and ends with the connection): the status and the body.
fn http_get(port: u16, path: &str) -> std::io::Result<(u16, String)> {
    let mut s = TcpStream::connect(("127.0.0.1", port))?;
    s.set_read_timeout(Some(Duration::from_secs(10)))?;
    write!(s, "GET {path} HTTP/1.0\r\nHost: 127.0.0.1:{port}\r\n\r\n")?;
    let mut answer = String::new();
    s.read_to_string(&mut answer)?;
    let (head, body) = answer.split_once("\r\n\r\n").unwrap_or((&answer, ""));
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    Ok((status, body.to_owned()))
}

/// Percent-encodes everything but unreserved characters (RFC 3986).
fn encode(q: &str) -> String {
    q.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// An instant query's single value (`None` while the result is empty),
/// or a description of what came back instead.
fn query(port: u16, q: &str) -> Result<Option<f64>, String> {
    let (status, body) =
        http_get(port, &format!("/api/v1/query?query={}", encode(q))).map_err(|e| e.to_string())?;
    if status != 200 {
        return Err(format!("HTTP {status}: {body}"));
    }
    let v: serde_json::Value = serde_json::from_str(&body).map_err(|e| format!("{e}: {body}"))?;
    if v["status"] != "success" {
        return Err(body);
    }
    match v["data"]["result"].as_array().map(Vec::as_slice) {
        Some([]) => Ok(None),
        Some([one]) => one["value"][1]
            .as_str()
            .and_then(|s| s.parse().ok())
            .map(Some)
            .ok_or(body),
        _ => Err(body),
    }
}

/// Polls `q` until it equals `want`; bounded by [`WAIT`]. The message of
/// the failure shows the last answer and the expected value.
fn wait_for_value(port: u16, q: &str, want: f64) {
    let deadline = Instant::now() + WAIT;
    let mut last = Err("no answer yet".to_owned());
    while Instant::now() < deadline {
        last = query(port, q);
        if matches!(last, Ok(Some(v)) if v == want) {
            return;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    panic!("{q}: last value {last:?}, expected {want} (waited {WAIT:?})");
}

#[test]
fn prometheus_scrapes_the_bytes_the_bench_moved() {
    let test = "prometheus_scrapes_the_bytes_the_bench_moved";
    let Some(prom) = prometheus(test) else {
        return;
    };
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("prometheus-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(dir.join("data")).expect("create the temp dir");
    let mut guard = Guard {
        children: Vec::new(),
        dir: Some(dir.clone()),
    };

    // The target: `ferry serve` on loopback with its metrics endpoint.
    let mut serve = Command::new(env!("CARGO_BIN_EXE_ferry"));
    serve.env_remove("RUST_LOG").args([
        "serve",
        "--backend",
        "tcp://127.0.0.1:0",
        "--size",
        "4MiB",
        "--metrics-listen",
        "127.0.0.1:0",
    ]);
    let serve_rx = spawn(&mut guard, serve, "ferry serve");
    let mut serve_seen = Vec::new();
    let serve_metrics = wait_line(&serve_rx, "ferry serve", &mut serve_seen, |l| {
        l.strip_prefix("metrics: http://")
            .and_then(|a| a.strip_suffix("/metrics"))
            .map(str::to_owned)
    });
    let command = wait_line(&serve_rx, "ferry serve", &mut serve_seen, |l| {
        l.strip_prefix("drive it with: ").map(str::to_owned)
    });
    let words: Vec<&str> = command.split_whitespace().collect();
    assert_eq!(&words[..2], &["ferry", "bench"], "{command}");

    // The initiator: `ferry bench --peer` with the printed coordinates.
    // `--warmup 0s` makes the warm-up exactly one batch per point; the
    // metrics endpoint stays up after the results (`--metrics-linger`)
    // until the guard kills the bench.
    let mut bench = Command::new(env!("CARGO_BIN_EXE_ferry"));
    bench
        .env_remove("RUST_LOG")
        .args(&words[1..])
        .args(["--json", "--no-baselines", "--ops", "write,read"])
        .args(["--blocks", "4KiB,64KiB", "--batches", "1,4"])
        .args(["--duration", "20ms", "--warmup", "0s", "--total", "4MiB"])
        .args(["--region-size", "4MiB", "--span", "1MiB"])
        .args(["--metrics-listen", "127.0.0.1:0", "--metrics-linger", "10m"]);
    let bench_rx = spawn(&mut guard, bench, "ferry bench");
    let mut bench_seen = Vec::new();
    let bench_metrics = wait_line(&bench_rx, "ferry bench", &mut bench_seen, |l| {
        l.strip_prefix(STDERR)?
            .strip_prefix("metrics: http://")
            .and_then(|a| a.strip_suffix("/metrics"))
            .map(str::to_owned)
    });

    // Prometheus, scraping both every 200 ms, on a port of its own.
    let web_port = free_port();
    let config = format!(
        "global:\n  scrape_interval: 200ms\n  scrape_timeout: 200ms\n\
         scrape_configs:\n\
         \x20 - job_name: ferry-serve\n    static_configs:\n      - targets: ['{serve_metrics}']\n\
         \x20 - job_name: ferry-bench\n    static_configs:\n      - targets: ['{bench_metrics}']\n"
    );
    let config_path = dir.join("prometheus.yml");
    std::fs::write(&config_path, config).expect("write prometheus.yml");
    let mut p = Command::new(prom);
    p.arg(format!("--config.file={}", config_path.display()))
        .arg(format!(
            "--storage.tsdb.path={}",
            dir.join("data").display()
        ))
        .arg(format!("--web.listen-address=127.0.0.1:{web_port}"))
        .arg("--log.level=warn");
    let prom_rx = spawn(&mut guard, p, "prometheus");

    // The bench's rows: a pretty-printed JSON array on stdout, which ends
    // with a line `]` (stderr lines, the progress and the linger notice,
    // are not part of it).
    let mut json = String::new();
    wait_line(&bench_rx, "ferry bench", &mut bench_seen, |l| {
        if l.starts_with(STDERR) {
            return None;
        }
        json.push_str(l);
        json.push('\n');
        (l == "]" || l == "[]").then_some(())
    });
    let rows: serde_json::Value = serde_json::from_str(&json)
        .unwrap_or_else(|e| panic!("bench --json: {e}\n{json}\n{bench_seen:#?}"));
    let rows = rows.as_array().expect("an array of points");
    assert_eq!(rows.len(), 8, "{json}");
    // Per point the bench's engine moves its measured `bytes`, one warm-up
    // batch (block × batch, `--warmup 0s`: the warm-up loop runs once) of
    // the same op, and one block read back for verification; the
    // end-of-point notification moves no bytes. Every one of those
    // requests succeeds (the bench stops at the first failure), so the
    // serve lands or sends each byte once: its served counters must show
    // the same sums. The bench's requests are never merged away or split
    // in a way that changes bytes (coalescing joins ranges, it does not
    // drop any), and nothing else reaches the serve (`--no-baselines`: no
    // raw-TCP stream).
    let (mut write, mut read) = (0u64, 0u64);
    for r in rows {
        assert_eq!(r["verified"], true, "{r}");
        let field = |k: &str| r[k].as_u64().unwrap_or_else(|| panic!("{k} in {r}"));
        let (bytes, block, batch) = (field("bytes"), field("block"), field("batch"));
        assert!(bytes > 0, "{r}");
        let moved = bytes + block * batch;
        match r["op"].as_str() {
            Some("write") => write += moved,
            Some("read") => read += moved,
            other => panic!("op {other:?} in {r}"),
        }
        read += block;
    }

    let port = web_port;
    // Prometheus answers at all (bounded), or its output says why not.
    let deadline = Instant::now() + WAIT;
    while !matches!(http_get(port, "/-/ready"), Ok((200, _))) {
        if Instant::now() >= deadline {
            let out: Vec<String> = prom_rx.try_iter().collect();
            panic!("prometheus not ready on 127.0.0.1:{port} within {WAIT:?}: {out:#?}");
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    wait_for_value(port, r#"sum(up{job="ferry-serve"})"#, 1.0);
    wait_for_value(
        port,
        r#"sum(ferry_transfer_bytes_total{job="ferry-bench",op="write"})"#,
        write as f64,
    );
    wait_for_value(
        port,
        r#"sum(ferry_transfer_bytes_total{job="ferry-bench",op="read"})"#,
        read as f64,
    );
    wait_for_value(
        port,
        r#"sum(ferry_transfer_bytes_total{job="ferry-bench"})"#,
        (write + read) as f64,
    );
    // The target: what the bench wrote into the serve's region and read
    // from it, counted by the serve's backend.
    wait_for_value(
        port,
        r#"sum(ferry_served_bytes_total{job="ferry-serve",op="write"})"#,
        write as f64,
    );
    wait_for_value(
        port,
        r#"sum(ferry_served_bytes_total{job="ferry-serve",op="read"})"#,
        read as f64,
    );
    // One peer, the bench's engine, by the name it gave in the handshake.
    wait_for_value(
        port,
        r#"count(count by (peer) (ferry_served_bytes_total{job="ferry-serve"}))"#,
        1.0,
    );
    // Nothing was dropped, and each side counts only its own role.
    wait_for_value(
        port,
        r#"sum(ferry_notifications_dropped_total{job="ferry-serve"})"#,
        0.0,
    );
    assert_eq!(
        query(
            port,
            r#"sum(ferry_transfer_bytes_total{job="ferry-serve"})"#
        ),
        Ok(None),
        "the serve initiated nothing"
    );
    let bench_served = query(port, r#"sum(ferry_served_bytes_total{job="ferry-bench"})"#);
    assert!(
        matches!(bench_served, Ok(None) | Ok(Some(0.0))),
        "the bench served nothing: {bench_served:?}"
    );
    eprintln!(
        "{test}: prometheus saw ferry_transfer_bytes_total (bench) = ferry_served_bytes_total (serve) = {} (write {write}, read {read})",
        write + read
    );
    drop(guard);
}

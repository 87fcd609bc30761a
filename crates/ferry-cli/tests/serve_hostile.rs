//! `ferry serve` under hostile and slow peers (issue 12): the raw sink is
//! off by default and bounded when on, peer text is escaped, peer-reported
//! counters saturate, the secret never shows (however it is encoded) and
//! can come from a file or the environment, a notification flood is
//! bounded, and a stop signal ends serve in bounded time even while a peer
//! trickles a payload into the region (a second one at once).
#![cfg(all(unix, feature = "tcp"))]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

// The wire format from the protocol's own crate (the sans-IO core), as a
// hostile peer speaks it by hand.
use ferry::tcp::{TcpConfig, TcpEngine};
use ferry::{Notification, TransferEngine};
use ferry_tcp_proto::frame::{Hello, Request, HELLO_FIXED, NONCE_LEN, VERSION, WELCOME};

/// Kills the child on drop so a failed test leaves no process behind.
struct Serve {
    child: Child,
    lines: mpsc::Receiver<String>,
    banner: Vec<String>,
}

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Serve {
    /// Starts `ferry serve ARGS` and reads its banner up to "serving".
    fn start(args: &[&str], env: &[(&str, &str)]) -> Serve {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_ferry"));
        cmd.env_remove("RUST_LOG")
            .env_remove("FERRY_SECRET")
            .arg("serve")
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::null());
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().expect("spawn ferry serve");
        let stdout = child.stdout.take().expect("stdout");
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let mut s = Serve {
            child,
            lines,
            banner: Vec::new(),
        };
        loop {
            // Liveness guard only.
            let line = s
                .lines
                .recv_timeout(Duration::from_secs(60))
                .unwrap_or_else(|e| panic!("serve did not start ({e}): {:?}", s.banner));
            s.banner.push(line.clone());
            if line.starts_with("serving until") {
                return s;
            }
        }
    }

    fn banner_value(&self, prefix: &str) -> Option<String> {
        self.banner
            .iter()
            .find_map(|l| l.strip_prefix(prefix).map(str::to_owned))
    }

    fn segment(&self) -> String {
        let l = self
            .banner_value("ferry serve: backend tcp, segment ")
            .expect("segment");
        l.trim().to_owned()
    }

    fn region(&self) -> (u64, u64) {
        let l = self.banner_value("region: addr 0x").expect("region line");
        let mut w = l.split_whitespace();
        let addr = u64::from_str_radix(w.next().unwrap(), 16).unwrap();
        assert_eq!(w.next(), Some("len"));
        (addr, w.next().unwrap().parse().unwrap())
    }

    fn signal(&self, sig: nix::sys::signal::Signal) {
        let pid = nix::unistd::Pid::from_raw(i32::try_from(self.child.id()).expect("pid"));
        nix::sys::signal::kill(pid, sig).expect("kill");
    }

    /// Waits up to `limit` for the process to exit; returns its status.
    fn exit_within(&mut self, limit: Duration) -> Option<std::process::ExitStatus> {
        let start = Instant::now();
        while start.elapsed() < limit {
            if let Some(st) = self.child.try_wait().expect("try_wait") {
                return Some(st);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        None
    }

    /// The lines printed after the banner, until the output closes.
    fn rest(&self) -> Vec<String> {
        let mut out = Vec::new();
        while let Ok(l) = self.lines.recv_timeout(Duration::from_secs(30)) {
            out.push(l);
        }
        out
    }

    fn rss_kib(&self) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id()))
            .expect("proc status");
        status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.split_whitespace().next()?.parse().ok())
            .expect("VmRSS")
    }
}

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime")
}

/// Sends each notification (empty batches) from a fresh TCP engine.
fn notify_all(
    segment: &str,
    secret: Option<&str>,
    notes: &[Notification],
) -> Vec<ferry::Result<()>> {
    rt().block_on(async {
        let a = TcpEngine::start({
            let mut config = TcpConfig::default();
            config.secret = secret.map(str::to_owned).map(Into::into);
            config
        })
        .await
        .expect("engine");
        let seg = match a.open_segment(segment).await {
            Ok(s) => s,
            Err(e) => return vec![Err(e)],
        };
        let mut out = Vec::new();
        for n in notes {
            out.push(a.batch_transfer(seg, &[], Some(n)).await.map(drop));
        }
        out
    })
}

/// Row 8: no raw sink unless asked for; when on, idle streams cannot hold
/// its slots or its memory and a real stream is served.
#[test]
fn raw_sink_is_off_by_default_and_bounded_when_on() {
    let s = Serve::start(&["--size", "1MiB"], &[]);
    assert!(
        !s.banner.iter().any(|l| l.starts_with("raw-TCP sink")),
        "{:?}",
        s.banner
    );
    let cmd = s.banner_value("drive it with: ").unwrap();
    assert!(!cmd.contains("--raw-peer"), "{cmd}");
    drop(s);

    let s = Serve::start(&["--size", "1MiB", "--raw-listen", "127.0.0.1:0"], &[]);
    let sink = s.banner_value("raw-TCP sink: ").expect("sink address");
    let before = s.rss_kib();
    let idle: Vec<TcpStream> = (0..9)
        .map(|_| TcpStream::connect(&sink).expect("connect"))
        .collect();
    std::thread::sleep(Duration::from_secs(2));
    let during = s.rss_kib();
    eprintln!("serve RSS {before} KiB, with 9 idle sink streams {during} KiB");
    assert!(
        during < before + 64 * 1024,
        "idle sink streams made serve allocate: {before} -> {during} KiB"
    );
    drop(idle);
    // One byte each, then silence (what took 64 MiB a stream): all of them
    // together stay within the sink's 64 MiB budget, and so do streams that
    // send a lot at once.
    let mut poked: Vec<TcpStream> = (0..9)
        .map(|_| TcpStream::connect(&sink).expect("connect"))
        .collect();
    for p in &mut poked {
        p.write_all(&[1]).unwrap();
    }
    std::thread::sleep(Duration::from_secs(2));
    let poked_rss = s.rss_kib();
    let senders: Vec<_> = (0..4)
        .map(|_| {
            let sink = sink.clone();
            std::thread::spawn(move || {
                let mut t = TcpStream::connect(&sink).expect("connect");
                let block = vec![9u8; 1 << 20];
                for _ in 0..96 {
                    if t.write_all(&block).is_err() {
                        break;
                    }
                }
            })
        })
        .collect();
    let mut peak = poked_rss;
    let t0 = std::time::Instant::now();
    while senders.iter().any(|h| !h.is_finished()) && t0.elapsed() < Duration::from_secs(30) {
        peak = peak.max(s.rss_kib());
        std::thread::sleep(Duration::from_millis(20));
    }
    for h in senders {
        let _ = h.join();
    }
    eprintln!("with 9 poked streams {poked_rss} KiB, peak with senders {peak} KiB");
    assert!(
        poked_rss < before + 64 * 1024 && peak < before + 72 * 1024,
        "sink streams grew serve past its budget: {before} -> {poked_rss} / {peak} KiB"
    );
    drop(poked);
    // A real stream is served (once the idle ones time out at the latest).
    let mut real = TcpStream::connect(&sink).expect("connect");
    real.write_all(&vec![7u8; 1 << 20]).unwrap();
    real.shutdown(std::net::Shutdown::Write).unwrap();
    real.set_read_timeout(Some(Duration::from_secs(60)))
        .unwrap();
    let mut ack = [0u8; 8];
    real.read_exact(&mut ack)
        .expect("the real stream was never served");
    assert_eq!(u64::from_le_bytes(ack), 1 << 20);
}

/// Rows 9 and 10: counters a peer reports cannot overflow (debug builds
/// used to panic), and peer text cannot forge lines or reach the terminal.
#[test]
fn peer_reports_saturate_and_peer_text_is_escaped() {
    let s = Serve::start(&["--size", "1MiB"], &[]);
    let huge = format!("write bytes={}", u64::MAX);
    let notes = [
        Notification::new("peer", huge.as_str()),
        Notification::new("peer", huge.as_str()),
        Notification::new(
            "evil",
            "x\nreceived: 999 notifications; forged\u{1b}[2J\u{1b}]0;title\u{7}",
        ),
    ];
    for r in notify_all(&s.segment(), None, &notes) {
        r.expect("notification");
    }
    std::thread::sleep(Duration::from_millis(300));
    s.signal(nix::sys::signal::Signal::SIGINT);
    let rest = s.rest();
    let mut s = s;
    let st = s
        .exit_within(Duration::from_secs(60))
        .expect("serve exited");
    assert!(st.success(), "serve failed (panic?): {st}; {rest:?}");
    let received: Vec<&String> = rest
        .iter()
        .filter(|l| l.starts_with("received: "))
        .collect();
    assert_eq!(received.len(), 1, "a forged summary line: {rest:?}");
    assert!(
        received[0].starts_with("received: 3 notifications"),
        "{rest:?}"
    );
    assert!(received[0].contains("saturated"), "{rest:?}");
    assert!(
        rest.iter()
            .all(|l| !l.contains('\u{1b}') && !l.contains('\u{7}')),
        "an escape sequence reached the terminal: {rest:?}"
    );
}

/// Row 11: the secret is redacted however its key is encoded, and can come
/// from a file or FERRY_SECRET (so it is not in /proc/PID/cmdline).
#[test]
fn secret_is_redacted_and_read_from_a_file_or_the_environment() {
    let s = Serve::start(
        &[
            "--size",
            "1MiB",
            "--backend",
            "tcp://127.0.0.1:0?%73ecret=hunter2",
        ],
        &[],
    );
    assert!(
        s.banner.iter().all(|l| !l.contains("hunter2")),
        "{:?}",
        s.banner
    );
    drop(s);

    let file = std::env::temp_dir().join(format!("ferry-secret-test-{}", std::process::id()));
    std::fs::write(&file, "from-file\n").unwrap();
    let path = file.to_str().unwrap().to_owned();
    for (args, env, secret) in [
        (
            vec!["--size", "1MiB", "--secret-file", path.as_str()],
            vec![],
            "from-file",
        ),
        (
            vec!["--size", "1MiB"],
            vec![("FERRY_SECRET", "from-env")],
            "from-env",
        ),
    ] {
        let s = Serve::start(&args, &env);
        let cmdline = std::fs::read(format!("/proc/{}/cmdline", s.child.id())).unwrap();
        assert!(!String::from_utf8_lossy(&cmdline).contains(secret));
        assert!(
            s.banner.iter().all(|l| !l.contains(secret)),
            "{:?}",
            s.banner
        );
        let n = [Notification::new("a", "hello")];
        let right = notify_all(&s.segment(), Some(secret), &n);
        assert!(right.iter().all(Result::is_ok), "{right:?}");
        let wrong = notify_all(&s.segment(), None, &n);
        assert!(
            matches!(&wrong[..], [Err(ferry::Error::Authentication { .. })]),
            "{wrong:?}"
        );
    }
    let _ = std::fs::remove_file(&file);
}

/// Issue 43 (item 6): every subcommand takes the secret the way `serve`
/// does. `ferry caps --peer` against a `serve` with a secret: proven with
/// `FERRY_SECRET`, `FERRY_SECRET_FILE` or `--secret-file` (none of them on
/// the command line), refused as `Authentication` without one, and a
/// secret given two ways is an error before anything is dialled.
#[test]
fn caps_takes_the_secret_the_way_serve_does() {
    let s = Serve::start(&["--size", "1MiB"], &[("FERRY_SECRET", "one-way")]);
    let seg = s.segment();
    let file = std::env::temp_dir().join(format!("ferry-caps-secret-{}", std::process::id()));
    std::fs::write(&file, "one-way\n").unwrap();
    let path = file.to_str().unwrap().to_owned();
    let caps = |args: &[&str], env: &[(&str, &str)]| {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_ferry"));
        cmd.env_remove("RUST_LOG")
            .env_remove("FERRY_SECRET")
            .env_remove("FERRY_SECRET_FILE")
            .args(["caps", "--peer", seg.as_str()])
            .args(args);
        for (k, v) in env {
            cmd.env(k, v);
        }
        let out = cmd.output().expect("run ferry caps");
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        (out.status.success(), text)
    };
    for (args, env) in [
        (vec![], vec![("FERRY_SECRET", "one-way")]),
        (vec![], vec![("FERRY_SECRET_FILE", path.as_str())]),
        (vec!["--secret-file", path.as_str()], vec![]),
    ] {
        let (ok, text) = caps(&args, &env);
        assert!(ok, "{args:?} {env:?}: {text}");
        assert!(!text.contains("one-way"), "the secret never shows: {text}");
    }
    let (ok, text) = caps(&[], &[]);
    assert!(!ok, "no secret: refused");
    assert!(text.to_lowercase().contains("authentic"), "{text}");
    let (ok, text) = caps(
        &["--secret-file", path.as_str()],
        &[("FERRY_SECRET", "one-way")],
    );
    assert!(!ok && text.contains("two ways"), "{text}");
    assert!(!text.contains("one-way"), "{text}");
    let _ = std::fs::remove_file(&file);
}

/// Row 4 at serve: a notification flood keeps serve's memory and output
/// bounded.
#[test]
fn notification_flood_keeps_serve_bounded() {
    let s = Serve::start(&["--size", "1MiB"], &[]);
    let before = s.rss_kib();
    let msg = "y".repeat(ferry::MAX_NOTIFICATION_MESSAGE);
    let notes: Vec<Notification> = (0..2000)
        .map(|_| Notification::new("flood", msg.as_str()))
        .collect();
    let results = notify_all(&s.segment(), None, &notes);
    let full = results.iter().filter(|r| r.is_err()).count();
    for r in results.iter().filter_map(|r| r.as_ref().err()) {
        assert!(r.is_retryable(), "{r:?}");
    }
    let after = s.rss_kib();
    eprintln!(
        "{} notifications of 64 KiB ({full} refused as queue full): serve RSS {before} -> {after} KiB",
        notes.len()
    );
    // Queue (32 MiB) + one taken batch (32 MiB) + slack.
    assert!(after < before + 128 * 1024, "{before} -> {after} KiB");
    s.signal(nix::sys::signal::Signal::SIGTERM);
    let rest = s.rest();
    let printed: usize = rest.iter().map(String::len).sum();
    assert!(
        printed < 1 << 20,
        "serve printed {printed} bytes for the flood"
    );
}

/// A raw v2 handshake (no secret); returns the stream and the generation
/// of the region containing `addr`.
fn raw_handshake(segment: &str, addr: u64) -> (TcpStream, u32) {
    let mut s = TcpStream::connect(segment).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let hello = Hello {
        version: VERSION,
        flags: 0,
        nonce: [3; NONCE_LEN],
        name: "trickler".into(),
    };
    s.write_all(&hello.encode()).unwrap();
    let mut fixed = [0u8; HELLO_FIXED];
    s.read_exact(&mut fixed).unwrap();
    let (_, n) = Hello::decode_fixed(&fixed).unwrap();
    let mut name = vec![0u8; n];
    s.read_exact(&mut name).unwrap();
    s.write_all(&[0u8; 32]).unwrap();
    let mut head = [0u8; 1 + 32 + 4 + 4];
    s.read_exact(&mut head).unwrap();
    assert_eq!(head[0], WELCOME);
    let count = u32::from_le_bytes(head[37..41].try_into().unwrap());
    let mut raw = vec![0u8; count as usize * ferry_tcp_proto::frame::TABLE_ENTRY_LEN];
    s.read_exact(&mut raw).unwrap();
    let table = ferry_tcp_proto::frame::decode_table(&raw).unwrap();
    let gen = table
        .iter()
        .find(|e| e.addr <= addr && addr < e.addr + e.len)
        .expect("region in table")
        .gen;
    (s, gen)
}

/// Starts trickling a 1 MiB WRITE into serve's region (one byte every
/// 200 ms) on a thread.
fn trickle(s: &Serve) -> std::thread::JoinHandle<()> {
    let (addr, _) = s.region();
    let (mut stream, gen) = raw_handshake(&s.segment(), addr);
    let w = Request::Write {
        id: 1,
        addr,
        len: 1 << 20,
        gen,
    };
    stream.write_all(&w.encode()).unwrap();
    std::thread::spawn(move || {
        for _ in 0..1000 {
            if stream.write_all(&[0x42]).is_err() {
                return;
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    })
}

/// Row 5 at serve: SIGTERM while a peer trickles a payload into the region
/// ends serve within the payload deadline; a second SIGTERM ends it at once.
#[test]
fn stop_signals_end_serve_in_bounded_time_whatever_a_peer_does() {
    // Deadline of the trickled 1 MiB: 2 s + 1 MiB / 256 KiB/s = 6 s.
    let mut s = Serve::start(
        &[
            "--size",
            "2MiB",
            "--backend",
            "tcp://127.0.0.1:0?stall_timeout_ms=2000&min_rate=262144",
        ],
        &[],
    );
    let t = trickle(&s);
    std::thread::sleep(Duration::from_millis(500));
    let start = Instant::now();
    s.signal(nix::sys::signal::Signal::SIGTERM);
    let st = s
        .exit_within(Duration::from_secs(60))
        .expect("serve still running 60 s after SIGTERM");
    eprintln!("serve exited {st} {:?} after SIGTERM", start.elapsed());
    assert!(st.success(), "{st}");
    t.join().unwrap();

    // A very long payload deadline: the first SIGTERM would wait for it;
    // the second exits at once.
    let mut s = Serve::start(
        &[
            "--size",
            "2MiB",
            "--backend",
            "tcp://127.0.0.1:0?stall_timeout_ms=600000&min_rate=1",
        ],
        &[],
    );
    let _t = trickle(&s);
    std::thread::sleep(Duration::from_millis(500));
    s.signal(nix::sys::signal::Signal::SIGTERM);
    std::thread::sleep(Duration::from_millis(500));
    assert!(
        s.child.try_wait().unwrap().is_none(),
        "exited on the first signal without waiting for the payload"
    );
    s.signal(nix::sys::signal::Signal::SIGTERM);
    let st = s
        .exit_within(Duration::from_secs(30))
        .expect("serve still running after a second SIGTERM");
    assert_eq!(st.code(), Some(130), "{st}");
}

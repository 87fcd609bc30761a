//! Runs the `ferry` binary: argument errors, `caps`, `bench --json`, and
//! `serve` driven by `bench --peer`, all on loopback.

use std::io::{BufRead, BufReader};
use std::process::{Output, Stdio};
use std::sync::mpsc;
use std::time::Duration;

mod common;
use common::{ferry, Proc};

/// Prints a skip notice past the test harness's output capture (which hides
/// `println!` of passing tests), so a skip never looks like a silent pass.
macro_rules! skip_line {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stderr().lock(), $($arg)*);
    }};
}

fn run(args: &[&str]) -> Output {
    ferry().args(args).output().expect("run ferry")
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// Asserts the exit code, returning (stdout, stderr).
fn expect_code(args: &[&str], code: i32) -> (String, String) {
    let out = run(args);
    let (so, se) = (text(&out.stdout), text(&out.stderr));
    assert_eq!(
        out.status.code(),
        Some(code),
        "ferry {args:?}\nstdout:\n{so}\nstderr:\n{se}"
    );
    (so, se)
}

#[test]
fn no_subcommand_is_a_usage_error() {
    let (_, err) = expect_code(&[], 2);
    assert!(err.contains("Usage"), "{err}");
}

#[test]
fn malformed_sizes_counts_and_ops_are_usage_errors() {
    let (_, err) = expect_code(&["bench", "--blocks", "4XB"], 2);
    assert!(err.contains("unknown unit"), "{err}");
    let (_, err) = expect_code(&["bench", "--blocks", "0"], 2);
    assert!(err.contains("at least 1 byte"), "{err}");
    let (_, err) = expect_code(&["bench", "--batches", "0"], 2);
    assert!(err.contains("at least 1"), "{err}");
    let (_, err) = expect_code(&["bench", "--ops", "copy"], 2);
    assert!(err.contains("copy"), "{err}");
    let (_, err) = expect_code(&["bench", "--duration", "soon"], 2);
    assert!(err.contains("not a duration"), "{err}");
    let (_, err) = expect_code(&["caps", "--require", "teleport"], 2);
    assert!(err.contains("unknown operation"), "{err}");
}

#[test]
fn peer_needs_the_remote_region() {
    let (_, err) = expect_code(&["bench", "--peer", "127.0.0.1:9"], 2);
    assert!(err.contains("--remote-addr"), "{err}");
    let (_, err) = expect_code(&["bench", "--remote-addr", "0x1000"], 2);
    assert!(err.contains("--peer"), "{err}");
}

#[test]
fn a_remote_region_past_the_address_space_is_refused() {
    let (_, err) = expect_code(
        &[
            "bench",
            "--peer",
            "127.0.0.1:9",
            "--remote-addr",
            "0xffffffffffffff00",
            "--remote-len",
            "1MiB",
        ],
        1,
    );
    assert!(err.contains("overflows the address space"), "{err}");
}

#[test]
fn every_subcommand_help_has_examples() {
    for sub in [
        &["--help"][..],
        &["bench", "--help"],
        &["caps", "--help"],
        &["serve", "--help"],
        &["metadata-server", "--help"],
    ] {
        let (out, _) = expect_code(sub, 0);
        assert!(out.contains("Examples:"), "ferry {sub:?}:\n{out}");
        assert!(out.contains("ferry "), "ferry {sub:?}:\n{out}");
    }
}

#[test]
fn bad_backend_is_one_line_and_verbose_shows_the_chain() {
    let (out, err) = expect_code(&["caps", "--backend", "udp://127.0.0.1:0"], 1);
    assert!(out.is_empty(), "{out}");
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.starts_with("error: opening udp://"), "{err}");
    assert!(err.contains("unknown backend"), "{err}");

    let (_, err) = expect_code(&["-v", "caps", "--backend", "udp://127.0.0.1:0"], 1);
    let lines: Vec<&str> = err.lines().collect();
    assert_eq!(lines[0], "error: opening udp://127.0.0.1:0", "{err}");
    assert!(
        lines
            .iter()
            .any(|l| l.starts_with("  caused by:") && l.contains("unknown backend")),
        "{err}"
    );
}

#[test]
fn backends_not_compiled_in_name_their_feature() {
    let cases = [
        ("tcp", "tcp://127.0.0.1:0", cfg!(feature = "tcp")),
        (
            "mooncake",
            "mooncake://?lib=/nonexistent.so",
            cfg!(feature = "mooncake"),
        ),
        ("verbs", "verbs://mlx5_0", cfg!(feature = "verbs")),
    ];
    let mut checked = 0;
    for (feature, url, enabled) in cases {
        if enabled {
            continue;
        }
        let (_, err) = expect_code(&["caps", "--backend", url], 1);
        assert!(
            err.contains(&format!("enable the cargo feature `{feature}`")),
            "{err}"
        );
        checked += 1;
    }
    if checked == 0 {
        skip_line!("skipped: every backend feature is enabled in this build");
    }
}

#[cfg(all(feature = "tcp", unix))]
mod tcp {
    use super::*;

    const OPTIONAL: [&str; 6] = [
        "batch_register",
        "batch_unregister",
        "batch_transfer",
        "async_batch",
        "batch_wait",
        "notify",
    ];

    #[test]
    fn caps_reports_tcp_and_require_passes() {
        let (out, _) = expect_code(&["caps"], 0);
        assert!(out.starts_with("backend: tcp\n"), "{out}");
        for op in OPTIONAL {
            assert!(
                out.lines()
                    .any(|l| l.trim_start().starts_with(op) && l.trim_end().ends_with("native")),
                "{op} not reported native:\n{out}"
            );
        }
        assert!(out.contains("segment: 127.0.0.1:"), "{out}");

        let (out, _) = expect_code(
            &[
                "caps",
                "--strict",
                "--require",
                "batch_transfer,notify,async_batch",
            ],
            0,
        );
        assert!(out.contains("mode: strict"), "{out}");
        assert!(out.contains("all available"), "{out}");
    }

    #[test]
    fn caps_json_parses() {
        let (out, _) = expect_code(&["caps", "--json"], 0);
        let v: serde_json::Value = serde_json::from_str(&out).expect("caps --json is JSON");
        assert_eq!(v["backend"], "tcp");
        let ops = v["operations"].as_array().expect("operations");
        assert_eq!(ops.len(), OPTIONAL.len());
        for (o, name) in ops.iter().zip(OPTIONAL) {
            assert_eq!(o["operation"], name);
            assert_eq!(o["support"], "native");
        }
    }

    const TINY: [&str; 12] = [
        "--blocks",
        "4KiB,64KiB",
        "--batches",
        "1,4",
        "--duration",
        "30ms",
        "--warmup",
        "5ms",
        "--region-size",
        "1MiB",
        "--total",
        "64MiB",
    ];

    fn check_points(json: &str, want_raw_tcp: bool) -> Vec<serde_json::Value> {
        let v: serde_json::Value = serde_json::from_str(json).expect("bench --json is JSON");
        let points = v.as_array().expect("a JSON array").clone();
        // 2 blocks x 2 batches x (write, read)
        assert_eq!(points.len(), 8, "{json}");
        for p in &points {
            assert_eq!(p["backend"], "tcp", "{p}");
            assert!(p["op"] == "write" || p["op"] == "read", "{p}");
            assert!([4096, 65536].contains(&p["block"].as_u64().unwrap()), "{p}");
            assert!([1, 4].contains(&p["batch"].as_u64().unwrap()), "{p}");
            for k in [
                "gbps",
                "transfers_per_s",
                "p50_us",
                "p99_us",
                "ratio_memcpy",
            ] {
                assert!(p[k].as_f64().is_some_and(|x| x > 0.0), "{k} in {p}");
            }
            assert!(p["p99_us"].as_f64() >= p["p50_us"].as_f64(), "{p}");
            if want_raw_tcp {
                assert!(p["ratio_raw_tcp"].as_f64().is_some_and(|x| x > 0.0), "{p}");
            } else {
                assert!(p["ratio_raw_tcp"].is_null(), "{p}");
            }
            assert_eq!(p["verified"], true, "{p}");
            let bytes = p["bytes"].as_u64().unwrap();
            let per_batch = p["block"].as_u64().unwrap() * p["batch"].as_u64().unwrap();
            assert_eq!(bytes % per_batch, 0, "{p}");
        }
        points
    }

    #[test]
    fn bench_json_parses() {
        let mut args = vec!["bench", "--json"];
        args.extend(TINY);
        let (out, _) = expect_code(&args, 0);
        let points = check_points(&out, true);
        assert!(points.iter().all(|p| p["target"] == "loopback"));
    }

    /// `text` without its ANSI colour sequences (`ESC [ … m`).
    fn strip_ansi(text: &str) -> String {
        let mut out = String::with_capacity(text.len());
        let mut chars = text.chars();
        while let Some(c) = chars.next() {
            if c == '\x1b' {
                for c in chars.by_ref() {
                    if c.is_ascii_alphabetic() {
                        break;
                    }
                }
            } else {
                out.push(c);
            }
        }
        out
    }

    /// `-vv` closes a `ferry_connect` span per connection that carries what
    /// the handshake settled (the TCP backend records it on the span).
    #[test]
    fn bench_vv_shows_the_handshake_in_the_connect_span() {
        let args = [
            "-vv",
            "bench",
            "--json",
            "--no-baselines",
            "--ops",
            "write",
            "--blocks",
            "4KiB",
            "--batches",
            "1",
            "--duration",
            "5ms",
            "--warmup",
            "0s",
            "--region-size",
            "1MiB",
        ];
        let (_, err) = expect_code(&args, 0);
        let err = strip_ansi(&err);
        let connect: Vec<&str> = err
            .lines()
            .filter(|l| l.contains("ferry_connect") && l.contains("close"))
            .collect();
        assert!(!connect.is_empty(), "no ferry_connect span closed:\n{err}");
        let line = connect[0];
        // The version in use is a number of the range this build speaks.
        let version: u16 = line
            .split("version=")
            .nth(1)
            .and_then(|v| v.split(|c: char| !c.is_ascii_digit()).next())
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("no version= in {line}"));
        assert!(version >= 1, "{line}");
        for field in [
            "peer_versions=",
            "path=",
            "tls=",
            "features=",
            "outcome=\"ok\"",
        ] {
            assert!(line.contains(field), "{field} missing in {line}");
        }
    }

    /// `--span`: points cycle through that many bytes (whole batches,
    /// capped at the region), or stay on one batch's bytes when it is that
    /// small; every point is verified at the last window it used.
    #[test]
    fn bench_span_sets_the_bytes_cycled_through() {
        for (span, want) in [("64KiB", [64u64 << 10, 64 << 10]), ("1B", [0, 0])] {
            let mut args = vec!["bench", "--json", "--span", span];
            args.extend(TINY);
            let (out, _) = expect_code(&args, 0);
            for p in check_points(&out, true) {
                let per_batch = p["block"].as_u64().unwrap() * p["batch"].as_u64().unwrap();
                let want = if want[0] == 0 || per_batch > want[0] {
                    per_batch
                } else {
                    want[1] / per_batch * per_batch
                };
                assert_eq!(p["span"].as_u64(), Some(want), "{p}");
            }
        }
        let mut args = vec!["bench", "--json"];
        args.extend(TINY);
        let (out, _) = expect_code(&args, 0);
        for p in check_points(&out, true) {
            // Default 64 MiB, capped at the 1 MiB region.
            let per_batch = p["block"].as_u64().unwrap() * p["batch"].as_u64().unwrap();
            assert_eq!(
                p["span"].as_u64(),
                Some((1 << 20) / per_batch * per_batch),
                "{p}"
            );
        }
    }

    #[test]
    fn bench_async_api_in_strict_mode() {
        let mut args = vec![
            "bench",
            "--json",
            "--api",
            "async",
            "--backend",
            "tcp://127.0.0.1:0?strict=1",
        ];
        args.extend(TINY);
        let (out, _) = expect_code(&args, 0);
        let points = check_points(&out, true);
        assert!(points.iter().all(|p| p["api"] == "async"), "{out}");
    }

    #[test]
    fn bench_table_has_every_column_and_the_baselines() {
        let mut args = vec!["bench"];
        args.extend(TINY);
        let (out, _) = expect_code(&args, 0);
        for col in [
            "GB/s",
            "transfers/s",
            "p50 µs",
            "p99 µs",
            "×rawTCP",
            "×memcpy",
            "raw TCP GB/s",
            "memcpy GB/s",
        ] {
            assert!(out.contains(col), "{col}:\n{out}");
        }
        assert_eq!(
            out.lines().filter(|l| l.starts_with("tcp ")).count(),
            8,
            "{out}"
        );
    }

    #[test]
    fn bench_with_no_fitting_point_explains() {
        let (_, err) = expect_code(
            &[
                "bench",
                "--blocks",
                "1MiB",
                "--batches",
                "4",
                "--region-size",
                "1MiB",
                "--no-baselines",
            ],
            1,
        );
        assert!(err.contains("no point fits"), "{err}");
    }

    /// `ferry serve ARGS…`, killed on drop, its stdout as lines.
    fn spawn_serve(args: &[&str]) -> Proc {
        let mut c = ferry();
        c.arg("serve").args(args);
        Proc::spawn(c)
    }

    #[test]
    fn serve_and_bench_peer_on_loopback() {
        let mut server = spawn_serve(&["--size", "2MiB", "--raw-listen", "127.0.0.1:0"]);
        let command = server.line_after("drive it with: ");
        let banner = server.seen().to_vec();
        assert!(
            banner[0].starts_with("ferry serve: backend tcp, segment 127.0.0.1:"),
            "{banner:?}"
        );
        assert!(
            banner
                .iter()
                .any(|l| l.starts_with("region: addr 0x") && l.contains("len 2097152")),
            "{banner:?}"
        );

        // The printed command, with tiny sizes and JSON added.
        let words: Vec<&str> = command.split_whitespace().collect();
        assert_eq!(&words[..2], &["ferry", "bench"], "{command}");
        let mut args: Vec<&str> = words[1..].to_vec();
        args.push("--json");
        args.extend(TINY);
        let (out, _) = expect_code(&args, 0);
        let points = check_points(&out, true);
        let peer = words[words.iter().position(|w| *w == "--peer").unwrap() + 1];
        assert!(points.iter().all(|p| p["target"] == peer), "{out}");

        // Interrupt it like Ctrl-C and read its report.
        let pid = nix::unistd::Pid::from_raw(i32::try_from(server.child.id()).expect("pid"));
        nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGINT).expect("SIGINT");
        let mut rest = Vec::new();
        while let Ok(line) = server.next_line() {
            rest.push(line);
        }
        let exit = server.child.wait().expect("wait");
        assert!(exit.success(), "serve exited with {exit}; output {rest:?}");
        let notes: Vec<&String> = rest
            .iter()
            .filter(|l| l.starts_with("notification from ferry-bench: "))
            .collect();
        assert_eq!(notes.len(), 8, "{rest:?}");
        let summary = rest
            .iter()
            .find(|l| l.starts_with("received: "))
            .expect("summary line");
        assert!(
            summary.starts_with("received: 8 notifications;"),
            "{summary}"
        );
        assert!(summary.contains("raw-TCP sink: 6 streams"), "{summary}");
        // The bench wrote its patterns into the region: it changed.
        assert!(!summary.contains("region: 0 of"), "{summary}");
    }

    /// `ferry caps --backend multi://… --peer` says which transport was
    /// chosen to the peer and why: the peer lists a dead transport first,
    /// then a running `ferry serve`.
    #[test]
    fn caps_on_a_multi_engine_names_the_transport_chosen_and_why() {
        let mut server = spawn_serve(&["--size", "1MiB", "--backend", "tcp://127.0.0.1:0"]);
        let banner = server.line_after("ferry serve: ");
        let seg = banner
            .split("segment ")
            .nth(1)
            .and_then(|r| r.split([',', ' ']).next())
            .unwrap_or_else(|| panic!("no segment in {banner:?}"))
            .to_owned();
        let dead = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
            l.local_addr().expect("addr").to_string()
        };
        let peer = format!("ferry-multi:tcp={dead};tcp={seg}");
        let url = "multi://?transports=tcp,t2&tcp.url=tcp%3A%2F%2F127.0.0.1%3A0\
                   &t2.url=tcp%3A%2F%2F127.0.0.1%3A0";
        let (out, _) = expect_code(&["caps", "--backend", url, "--peer", &peer], 0);
        assert!(out.starts_with("backend: multi\n"), "{out}");
        let line = out
            .lines()
            .find(|l| l.starts_with("transport to "))
            .unwrap_or_else(|| panic!("no transport line in {out}"));
        assert!(
            line.starts_with(&format!(
                "transport to {peer}: tcp to {seg} (ours: tcp, tcp; the peer's: tcp, tcp): "
            )),
            "{line}"
        );
        assert!(
            line.contains(&format!("tcp to {dead} failed first")),
            "{line}"
        );
        let (out, _) = expect_code(&["caps", "--backend", url, "--peer", &peer, "--json"], 0);
        let v: serde_json::Value = serde_json::from_str(&out).expect("caps --json is JSON");
        let t = &v["transports"][0];
        assert_eq!(t["peer"], peer.as_str(), "{out}");
        assert_eq!(t["transport"], "tcp", "{out}");
        assert_eq!(t["address"], seg.as_str(), "{out}");
        assert!(
            t["reason"]
                .as_str()
                .is_some_and(|r| r.contains("failed first")),
            "{out}"
        );
        // A plain engine has no transport line.
        let (out, _) = expect_code(&["caps", "--peer", &seg], 0);
        assert!(!out.contains("transport to "), "{out}");
    }

    /// `GET /metrics` of a `--metrics-listen` endpoint, parsed by an
    /// ecosystem parser of the exposition format.
    fn scrape(addr: &str) -> prometheus_parse::Scrape {
        use std::io::{Read, Write};
        let mut s = std::net::TcpStream::connect(addr).expect("connect to /metrics");
        s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            .expect("send");
        let mut response = String::new();
        s.read_to_string(&mut response).expect("read");
        let (head, body) = response.split_once("\r\n\r\n").expect("head and body");
        assert!(head.starts_with("HTTP/1.1 200"), "{head}");
        prometheus_parse::Scrape::parse(body.lines().map(|l| Ok(l.to_owned()))).expect("parses")
    }

    fn value(scrape: &prometheus_parse::Scrape, name: &str, engine: &str) -> Option<f64> {
        scrape
            .samples
            .iter()
            .find(|s| s.metric == name && s.labels.get("engine") == Some(engine))
            .map(|s| match s.value {
                prometheus_parse::Value::Counter(v)
                | prometheus_parse::Value::Gauge(v)
                | prometheus_parse::Value::Untyped(v) => v,
                ref other => panic!("{name}: {other:?}"),
            })
    }

    #[test]
    fn serve_metrics_listen_counts_what_the_target_sees() {
        let mut server = spawn_serve(&["--size", "2MiB", "--metrics-listen", "127.0.0.1:0"]);
        let command = server.line_after("drive it with: ");
        let banner = |prefix: &str| {
            server
                .seen()
                .iter()
                .find_map(|l| l.strip_prefix(prefix).map(str::to_owned))
        };
        let segment = banner("ferry serve: backend tcp, segment ").expect("segment line");
        let metrics = banner("metrics: http://")
            .and_then(|url| url.strip_suffix("/metrics").map(str::to_owned))
            .expect("metrics line");
        let before = scrape(&metrics);
        assert_eq!(
            value(&before, "ferry_registered_bytes", &segment),
            Some(2097152.0)
        );

        let words: Vec<&str> = command.split_whitespace().collect();
        let mut args: Vec<&str> = words[1..].to_vec();
        args.push("--json");
        args.extend(TINY);
        expect_code(&args, 0);
        // The bench sends one notification per point; serve prints each
        // after taking it (and counting it).
        let mut seen = 0;
        while seen < 8 {
            let line = server.next_line().expect("serve prints the notifications");
            if line.starts_with("notification from ferry-bench: ") {
                seen += 1;
            }
        }
        let after = scrape(&metrics);
        assert_eq!(
            value(&after, "ferry_notifications_received_total", &segment),
            Some(8.0)
        );
    }
}

#[cfg(feature = "mooncake")]
mod mooncake {
    use super::*;
    use mooncake_testlibs::{broken_library_path, library_path, Broken, Generation};

    fn url(gen: Generation) -> String {
        format!(
            "mooncake://?lib={}&metadata=P2PHANDSHAKE&protocol=tcp&host=127.0.0.1",
            library_path(gen).display()
        )
    }

    #[test]
    fn caps_of_the_current_generation_is_all_native() {
        let u = url(Generation::Current);
        let (out, _) = expect_code(
            &[
                "caps",
                "--backend",
                &u,
                "--require",
                "batch_transfer,notify",
            ],
            0,
        );
        assert!(out.starts_with("backend: mooncake\n"), "{out}");
        let lib = library_path(Generation::Current).display().to_string();
        assert!(out.contains(&format!("library: {lib}")), "{out}");
        assert!(out.contains("generation: Mooncake v0.3.12"), "{out}");
        assert!(
            out.lines().any(|l| l.trim() == "notify            native"),
            "{out}"
        );
        assert!(out.contains("all available"), "{out}");
        assert_eq!(
            out.lines().filter(|l| l.starts_with("segment: ")).count(),
            1,
            "{out}"
        );
    }

    #[test]
    fn caps_of_v0_3_0_names_the_version_that_adds_notify_and_require_fails() {
        let u = url(Generation::V0_3_0);
        let (out, _) = expect_code(&["caps", "--backend", &u], 0);
        let line = out
            .lines()
            .find(|l| l.trim_start().starts_with("notify"))
            .unwrap_or_else(|| panic!("no notify line:\n{out}"));
        assert!(line.contains("unsupported"), "{line}");
        assert!(line.contains("submitTransferWithNotify"), "{line}");
        assert!(line.contains("needs Mooncake v0.3.8"), "{line}");

        let (_, err) = expect_code(
            &[
                "caps",
                "--backend",
                &u,
                "--require",
                "batch_transfer,notify",
            ],
            3,
        );
        assert_eq!(err.lines().count(), 1, "{err}");
        assert!(
            err.starts_with("error: the mooncake backend lacks required capabilities: notify"),
            "{err}"
        );
        assert!(err.contains("v0.3.8"), "{err}");

        let (out, _) = expect_code(&["caps", "--backend", &u, "--json"], 0);
        let v: serde_json::Value = serde_json::from_str(&out).expect("JSON");
        let notify = v["operations"]
            .as_array()
            .unwrap()
            .iter()
            .find(|o| o["operation"] == "notify")
            .unwrap()
            .clone();
        assert_eq!(notify["support"], "unsupported");
        assert_eq!(notify["min_version"], "Mooncake v0.3.8");
    }

    #[test]
    fn a_library_missing_a_required_symbol_is_one_clear_line() {
        let lib = broken_library_path(Broken::MissingSubmitTransfer);
        let u = format!("mooncake://?lib={}", lib.display());
        let (_, err) = expect_code(&["caps", "--backend", &u], 1);
        assert_eq!(err.lines().count(), 1, "{err}");
        assert!(
            err.contains("does not export the required symbol submitTransfer"),
            "{err}"
        );
    }

    #[test]
    fn bench_runs_over_a_mooncake_test_library() {
        let u = url(Generation::Current);
        let (out, _) = expect_code(
            &[
                "bench",
                "--backend",
                &u,
                "--json",
                "--no-baselines",
                "--blocks",
                "4KiB,64KiB",
                "--batches",
                "1,4",
                "--duration",
                "20ms",
                "--warmup",
                "5ms",
                "--region-size",
                "1MiB",
            ],
            0,
        );
        let v: serde_json::Value = serde_json::from_str(&out).expect("JSON");
        let points = v.as_array().unwrap();
        assert_eq!(points.len(), 8, "{out}");
        for p in points {
            assert_eq!(p["backend"], "mooncake", "{p}");
            assert!(p["gbps"].as_f64().is_some_and(|g| g > 0.0), "{p}");
            assert_eq!(p["verified"], true, "{p}");
            assert!(
                p["ratio_raw_tcp"].is_null() && p["ratio_memcpy"].is_null(),
                "{p}"
            );
        }
    }
}

/// `ferry serve` on an address other hosts can reach refuses to start
/// without a secret, saying what is exposed and how to set one; with
/// `--insecure` it starts (and stops on SIGINT).
#[test]
fn serve_beyond_loopback_needs_a_secret_or_insecure() {
    let (_, err) = expect_code(
        &["serve", "--size", "1MiB", "--backend", "tcp://0.0.0.0:0"],
        1,
    );
    for needle in [
        "without a secret",
        "read and write",
        "FERRY_SECRET",
        "--secret-file",
        "--insecure",
    ] {
        assert!(err.contains(needle), "{needle:?} missing: {err}");
    }
    let mut child = ferry()
        .args([
            "serve",
            "--size",
            "1MiB",
            "--backend",
            "tcp://0.0.0.0:0",
            "--insecure",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn");
    let stdout = child.stdout.take().expect("stdout");
    let first = BufReader::new(stdout).lines().next();
    let pid = nix::unistd::Pid::from_raw(i32::try_from(child.id()).expect("pid"));
    let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGINT);
    let _ = child.wait();
    let first = first.expect("a banner").expect("a line");
    assert!(
        first.starts_with("ferry serve: backend tcp, segment 0.0.0.0:"),
        "{first}"
    );
    // The secret in the URL works, with a warning about the process list.
    let mut child = ferry()
        .args([
            "serve",
            "--size",
            "1MiB",
            "--backend",
            "tcp://0.0.0.0:0?secret=x",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn");
    let stdout = child.stdout.take().expect("stdout");
    let first = BufReader::new(stdout).lines().next();
    let pid = nix::unistd::Pid::from_raw(i32::try_from(child.id()).expect("pid"));
    let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGINT);
    let out = child.wait_with_output().expect("wait");
    assert!(first.is_some_and(|l| l.is_ok_and(|l| l.starts_with("ferry serve: backend tcp"))));
    let err = text(&out.stderr);
    assert!(err.contains("visible to every user"), "{err}");
}

/// `ferry serve --tls require` (identity derived from FERRY_SECRET), and
/// `ferry caps --tls require --peer` naming the cipher suite; a peer
/// without TLS is refused with the reason.
#[test]
fn serve_with_tls_and_caps_names_the_cipher_suite() {
    let mut child = ferry()
        .args([
            "serve",
            "--size",
            "1MiB",
            "--backend",
            "tcp://127.0.0.1:0?same_host=off",
            "--tls",
            "require",
        ])
        .env("FERRY_SECRET", "tls-cli-secret")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn");
    let stdout = child.stdout.take().expect("stdout");
    // Keep reading: a closed pipe would end `serve` at its next line.
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let first = rx
        .recv_timeout(Duration::from_secs(60))
        .expect("a banner line");
    let seg = first
        .split("segment ")
        .nth(1)
        .and_then(|r| r.split([',', ' ']).next())
        .unwrap_or_else(|| panic!("no segment in {first:?}"))
        .to_owned();
    let url = "tcp://127.0.0.1:0?secret=tls-cli-secret&same_host=off";
    let caps = run(&["caps", "--backend", url, "--tls", "require", "--peer", &seg]);
    let clear = run(&["caps", "--backend", url, "--peer", &seg]);
    let json = run(&[
        "caps",
        "--backend",
        url,
        "--tls",
        "on",
        "--peer",
        &seg,
        "--json",
    ]);
    let pid = nix::unistd::Pid::from_raw(i32::try_from(child.id()).expect("pid"));
    let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGINT);
    let _ = child.wait();
    let out = text(&caps.stdout);
    assert!(caps.status.success(), "{out}{}", text(&caps.stderr));
    let line = out
        .lines()
        .find(|l| l.trim_start().starts_with("tls "))
        .unwrap_or_else(|| panic!("no tls line in {out}"));
    assert!(line.contains("on: TLS13_"), "{line}");
    assert!(line.contains("shared secret"), "{line}");
    let err = text(&clear.stderr);
    assert_eq!(clear.status.code(), Some(1), "{err}");
    assert!(err.contains("tls=require"), "{err}");
    let j: serde_json::Value = serde_json::from_slice(&json.stdout).expect("json");
    let suite = j["peers"][0]["tls"].as_str().unwrap_or_default();
    assert!(suite.starts_with("TLS13_"), "{j}");
}

/// The decision of issue 44 item 5, where users read it: `ferry
/// metadata-server` is the single-machine option, clusters use etcd.
#[test]
fn metadata_server_help_says_it_is_the_single_machine_option() {
    let (out, _) = expect_code(&["metadata-server", "--help"], 0);
    assert!(out.contains("single-machine option"), "{out}");
    assert!(out.contains("etcd"), "{out}");
    let (out, _) = expect_code(&["--help"], 0);
    assert!(out.contains("single-machine option"), "{out}");
}

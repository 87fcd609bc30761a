//! Two processes over `nixl://` on the real NIXL library (the pinned wheel,
//! UCX): `ferry caps --backend nixl://` reports every operation native, and
//! `ferry serve --backend nixl://` driven by the `ferry bench --peer`
//! command it prints moves verified bytes, with a notification per point.
#![cfg(feature = "nixl")]

use std::path::PathBuf;
use std::process::Command;
use std::sync::OnceLock;

mod common;
use common::Proc;
use ferry_core::conformance::skip_unavailable;
use ferry_core::Error;
use ferry_nixl::test_support::install_pinned_wheel;

/// The wheel's library, or the skip (a failure when `FERRY_REQUIRE_BACKENDS`
/// lists nixl).
fn library(test: &str) -> Option<PathBuf> {
    // Once per test binary: the tests run in parallel and share the venv.
    static LIB: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    let venv = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join("nixl")
        .join("venv");
    match LIB.get_or_init(|| install_pinned_wheel(&venv)).clone() {
        Ok(lib) => Some(lib),
        Err(reason) => {
            let e = Error::Unavailable {
                backend: "nixl".to_owned(),
                reason,
            };
            skip_unavailable(test, &e);
            None
        }
    }
}

fn ferry(lib: &PathBuf) -> Command {
    let mut c = common::ferry();
    c.env("FERRY_NIXL_LIB", lib);
    c
}

#[test]
fn caps_of_nixl_is_all_native() {
    let Some(lib) = library("caps_of_nixl_is_all_native") else {
        return;
    };
    let out = ferry(&lib)
        .args(["caps", "--backend", "nixl://?backends=UCX", "--strict"])
        .args(["--require", "batch_transfer,async_batch,notify"])
        .output()
        .expect("run ferry caps");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(text.contains("backend: nixl"), "{text}");
    assert!(text.contains("libnixl_capi.so"), "{text}");
    for op in [
        "batch_register",
        "batch_unregister",
        "batch_transfer",
        "async_batch",
        "batch_wait",
        "notify",
    ] {
        assert!(
            text.lines()
                .any(|l| l.trim_start().starts_with(op) && l.trim_end().ends_with("native")),
            "{op} not native:\n{text}"
        );
    }
}

#[test]
fn serve_and_bench_peer_over_nixl() {
    let Some(lib) = library("serve_and_bench_peer_over_nixl") else {
        return;
    };
    let mut serve = ferry(&lib);
    serve.args([
        "serve",
        "--backend",
        "nixl://?backends=UCX",
        "--size",
        "4MiB",
    ]);
    let mut server = Proc::spawn(serve);
    let command = server.line_after("drive it with: ");
    let banner = server.seen().to_vec();
    assert!(
        banner[0].starts_with("ferry serve: backend nixl, segment 127.0.0.1:"),
        "{banner:?}"
    );
    // The printed command (its URL is in single quotes), tiny sizes, JSON.
    let words: Vec<String> = command
        .split_whitespace()
        .map(|w| w.trim_matches('\'').to_owned())
        .collect();
    assert_eq!(&words[..2], &["ferry", "bench"], "{command}");
    assert!(words.iter().any(|w| w.starts_with("nixl://")), "{command}");
    let out = ferry(&lib)
        .args(&words[1..])
        .args(["--json", "--blocks", "4KiB,64KiB", "--batches", "1,4"])
        .args([
            "--duration",
            "30ms",
            "--warmup",
            "5ms",
            "--region-size",
            "1MiB",
        ])
        .args(["--total", "16MiB"])
        .output()
        .expect("run ferry bench");
    let json = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "bench failed:\n{json}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_str(&json).expect("bench --json is JSON");
    let points = v.as_array().expect("an array");
    assert_eq!(points.len(), 8, "{json}");
    for p in points {
        assert_eq!(p["backend"], "nixl", "{p}");
        assert_eq!(p["verified"], true, "{p}");
        assert!(p["bytes"].as_u64().is_some_and(|b| b > 0), "{p}");
    }

    let pid = nix::unistd::Pid::from_raw(i32::try_from(server.child.id()).expect("pid"));
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGINT).expect("SIGINT");
    let mut rest = Vec::new();
    while let Ok(line) = server.next_line() {
        rest.push(line);
    }
    let exit = server.child.wait().expect("wait");
    assert!(exit.success(), "serve exited with {exit}; output {rest:?}");
    let summary = rest
        .iter()
        .find(|l| l.starts_with("received: "))
        .unwrap_or_else(|| panic!("no summary line in {rest:?}"));
    assert!(
        summary.starts_with("received: 8 notifications;"),
        "{summary}"
    );
    assert!(!summary.contains("region: 0 of"), "{summary}");
}

//! A real Mooncake Transfer Engine and Ferry pointed at each other by
//! mistake (issue 22): each side names the other instead of a bare
//! "connection reset". Needs a Python with Mooncake's wheel:
//! `FERRY_MOONCAKE_PYTHON=/path/to/python` where `import mooncake.engine`
//! works (tried with `mooncake-transfer-engine-non-cuda==0.3.13.post1` in a
//! venv, 185 MB, hence not installed by the test). Skips, saying so,
//! without it; `FERRY_REQUIRE_BACKENDS` listing `mooncake-wheel` makes
//! that a failure.
#![cfg(all(feature = "tcp", target_os = "linux"))]

use std::io::{BufRead, BufReader, Read};
use std::process::{Command, Stdio};

use ferry_core::conformance::{backend_required, report_skip};

const SCRIPT: &str = r#"
import sys, time, ctypes
from mooncake.engine import TransferEngine
te = TransferEngine()
assert te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
print("rpc_port", te.get_rpc_port(), flush=True)
if sys.argv[1] == "listen":
    sys.stdin.read()
else:
    buf = ctypes.create_string_buffer(4096)
    addr = ctypes.addressof(buf)
    assert te.register_memory(addr, 4096) == 0
    rc = te.transfer_sync_write(sys.argv[2], addr, int(sys.argv[3], 0), 4096)
    print("rc", rc, flush=True)
"#;

fn python_or_skip(test: &str) -> Option<String> {
    let reason = match std::env::var("FERRY_MOONCAKE_PYTHON") {
        Err(_) => "FERRY_MOONCAKE_PYTHON is not set (a python with mooncake.engine)".to_owned(),
        Ok(p) => match Command::new(&p)
            .args(["-c", "import mooncake.engine"])
            .output()
        {
            Ok(o) if o.status.success() => return Some(p),
            Ok(o) => format!(
                "{p} cannot import mooncake.engine: {}",
                String::from_utf8_lossy(&o.stderr).trim()
            ),
            Err(e) => format!("{p}: {e}"),
        },
    };
    if backend_required("mooncake-wheel") {
        panic!("{test}: FERRY_REQUIRE_BACKENDS lists mooncake-wheel, but {reason}");
    }
    report_skip(&format!("{test}: {reason}"));
    None
}

mod common;
use common::ferry;

#[test]
fn ferry_names_a_mooncake_handshake_port() {
    let Some(py) = python_or_skip("ferry_names_a_mooncake_handshake_port") else {
        return;
    };
    let mut mc = Command::new(&py)
        .args(["-c", SCRIPT, "listen"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("mooncake listener");
    let mut lines = BufReader::new(mc.stdout.take().expect("stdout")).lines();
    let port = loop {
        let l = lines.next().expect("rpc port line").expect("line");
        if let Some(p) = l.strip_prefix("rpc_port ") {
            break p.trim().to_owned();
        }
    };
    let out = ferry()
        .args(["caps", "--peer", &format!("127.0.0.1:{port}")])
        .output()
        .expect("ferry caps");
    drop(mc.stdin.take());
    let _ = mc.wait();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("not a ferry-tcp target") && err.contains("Mooncake"),
        "{err}"
    );
}

#[test]
fn mooncake_is_told_it_reached_a_ferry_target() {
    let Some(py) = python_or_skip("mooncake_is_told_it_reached_a_ferry_target") else {
        return;
    };
    let mut serve = ferry()
        .env("RUST_LOG", "warn")
        .args(["serve", "--size", "1MiB"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("ferry serve");
    let mut lines = BufReader::new(serve.stdout.take().expect("stdout")).lines();
    let (mut segment, mut addr) = (None, None);
    while segment.is_none() || addr.is_none() {
        let l = lines.next().expect("serve's banner").expect("line");
        if let Some(rest) = l.split("segment ").nth(1) {
            segment = Some(rest.trim().to_owned());
        }
        if let Some(rest) = l.split("--remote-addr ").nth(1) {
            addr = rest.split_whitespace().next().map(str::to_owned);
        }
    }
    let (segment, addr) = (segment.unwrap(), addr.unwrap());
    let out = Command::new(&py)
        .args(["-c", SCRIPT, "dial", &segment, &addr])
        .output()
        .expect("mooncake dialer");
    let so = String::from_utf8_lossy(&out.stdout);
    let se = String::from_utf8_lossy(&out.stderr);
    assert!(so.contains("rc -1"), "the transfer fails: {so}\n{se}");
    assert!(
        se.contains("this port is a Ferry target, not a Mooncake Transfer Engine"),
        "Mooncake names Ferry: {se}"
    );
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(serve.id() as i32),
        nix::sys::signal::Signal::SIGINT,
    )
    .expect("SIGINT");
    let _ = serve.wait();
    let mut log = String::new();
    serve
        .stderr
        .take()
        .expect("stderr")
        .read_to_string(&mut log)
        .expect("serve's log");
    assert!(
        log.contains("a Mooncake Transfer Engine handshake"),
        "serve logs it: {log}"
    );
}

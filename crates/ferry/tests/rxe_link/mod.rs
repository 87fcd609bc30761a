//! The link under a verbs device, taken down and brought up again by a
//! test: `ip link set <netdev> down|up` on the network interface the RDMA
//! device sits on (soft-RoCE's `rxe0` on the guest's `dummy0` in
//! `scripts/rxe-vm.sh`).
//!
//! Taking a link down is destructive on a real machine, so it is done only
//! where the environment opts in: `FERRY_TEST_BREAK_LINK=1` (set by
//! `scripts/verbs-tests.sh` for its disposable guest), as root. Elsewhere
//! [`Link::find`] says why not, and the caller skips (or fails, where
//! `FERRY_REQUIRE_BACKENDS` lists `verbs`).
//!
//! Shared by `tests/multi_verbs.rs` and `examples/multi_verbs_bench.rs`
//! (included with `#[path]`).
#![allow(dead_code)] // each includer uses its own part of it

use std::time::{Duration, Instant};

/// The environment variable that allows a test to take the link down.
pub const BREAK_LINK_ENV: &str = "FERRY_TEST_BREAK_LINK";

/// The RDMA device (`rxe0`) of a `verbs://` URL and the network interface
/// under its port 1. Dropping it brings the interface up again (a test
/// that failed while the link was down leaves it up for the next).
pub struct Link {
    pub device: String,
    pub netdev: String,
}

/// Runs `ip` or `rdma` with `args`; `Err` with its output when it fails.
fn run(program: &str, args: &[&str]) -> Result<String, String> {
    let out = std::process::Command::new(program)
        .args(args)
        .output()
        .map_err(|e| format!("{program} {}: {e}", args.join(" ")))?;
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    if out.status.success() {
        Ok(text)
    } else {
        Err(format!(
            "{program} {}: {}: {}",
            args.join(" "),
            out.status,
            text.trim()
        ))
    }
}

fn is_root() -> bool {
    std::fs::read_to_string("/proc/self/status").is_ok_and(|s| {
        s.lines()
            .find(|l| l.starts_with("Uid:"))
            .and_then(|l| l.split_whitespace().nth(1))
            == Some("0")
    })
}

/// The device a `verbs://DEVICE?…` URL names, else the first in sysfs.
fn device_of(url: &str) -> Option<String> {
    let rest = url.strip_prefix("verbs://")?;
    let dev = rest.split(['?', '/']).next().unwrap_or("");
    if !dev.is_empty() {
        return Some(dev.to_owned());
    }
    let mut all: Vec<String> = std::fs::read_dir("/sys/class/infiniband")
        .ok()?
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .collect();
    all.sort();
    all.into_iter().next()
}

impl Link {
    /// The link under the device of `verbs_url`, if this process may take
    /// it down; else why not.
    pub fn find(verbs_url: &str) -> Result<Link, String> {
        if std::env::var(BREAK_LINK_ENV).as_deref() != Ok("1") {
            return Err(format!(
                "taking the verbs device's link down needs {BREAK_LINK_ENV}=1 (a disposable \
                 machine: scripts/verbs-tests.sh sets it in its guest)"
            ));
        }
        if !is_root() {
            return Err("taking a link down needs root".to_owned());
        }
        let device = device_of(verbs_url)
            .ok_or_else(|| format!("no RDMA device for {verbs_url:?} in /sys/class/infiniband"))?;
        let shown = run("rdma", &["link", "show", &format!("{device}/1")])?;
        let netdev = shown
            .split_whitespace()
            .skip_while(|w| *w != "netdev")
            .nth(1)
            .ok_or_else(|| format!("`rdma link show {device}/1` names no netdev: {shown}"))?
            .to_owned();
        Ok(Link { device, netdev })
    }

    /// `ip link set <netdev> down`, returning once `ip` has.
    pub async fn down(&self) {
        let netdev = self.netdev.clone();
        tokio::task::spawn_blocking(move || run("ip", &["link", "set", &netdev, "down"]))
            .await
            .expect("the ip task")
            .expect("taking the link down");
    }

    /// `ip link set <netdev> up`, then waits (at most 30 s) until the RDMA
    /// port is ACTIVE again.
    pub async fn up(&self) {
        let netdev = self.netdev.clone();
        tokio::task::spawn_blocking(move || run("ip", &["link", "set", &netdev, "up"]))
            .await
            .expect("the ip task")
            .expect("bringing the link up");
        let state = format!("/sys/class/infiniband/{}/ports/1/state", self.device);
        let start = Instant::now();
        loop {
            let now = std::fs::read_to_string(&state).unwrap_or_default();
            if now.contains("ACTIVE") {
                return;
            }
            assert!(
                start.elapsed() < Duration::from_secs(30),
                "{} port 1 not ACTIVE 30 s after its link came up: {now:?}",
                self.device
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

impl Drop for Link {
    fn drop(&mut self) {
        if let Err(e) = run("ip", &["link", "set", &self.netdev, "up"]) {
            eprintln!("rxe_link: could not bring {} up again: {e}", self.netdev);
            return;
        }
        // A test that failed with the link down: the next starts on an
        // active port (a blocking wait, on the way out of a test).
        let state = format!("/sys/class/infiniband/{}/ports/1/state", self.device);
        let start = Instant::now();
        while !std::fs::read_to_string(&state).is_ok_and(|s| s.contains("ACTIVE"))
            && start.elapsed() < Duration::from_secs(10)
        {
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

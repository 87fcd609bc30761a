//! `ferry bench --same-host` and `ferry caps --peer` (issue 14): two
//! processes on this host, the path in every row and in the report.
#![cfg(all(feature = "tcp", target_os = "linux"))]

use std::io::{BufRead, BufReader};
use std::process::Stdio;

mod common;
use common::ferry;

#[test]
fn bench_same_host_rows_carry_both_paths() {
    let out = ferry()
        .args([
            "bench",
            "--same-host",
            "--json",
            "--blocks",
            "4KiB,1MiB",
            "--batches",
            "1",
            "--duration",
            "30ms",
            "--warmup",
            "5ms",
            "--region-size",
            "4MiB",
        ])
        .output()
        .expect("run ferry");
    let so = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{so}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_str(&so).expect("JSON");
    let rows = v.as_array().expect("array");
    // 2 blocks × (write, read) × (cma, socket)
    assert_eq!(rows.len(), 8, "{so}");
    let paths: Vec<&str> = rows.iter().filter_map(|r| r["path"].as_str()).collect();
    assert_eq!(paths.iter().filter(|p| **p == "cma").count(), 4, "{so}");
    assert_eq!(
        paths
            .iter()
            .filter(|p| **p == "tcp (same_host=off)")
            .count(),
        4,
        "{so}"
    );
    for r in rows {
        assert_eq!(r["verified"], true, "{r}");
        // The default span (64 MiB) is capped at the region: every point
        // cycled through all of it (and was verified at its last window).
        assert_eq!(r["span"], 4u64 << 20, "{r}");
        for k in ["ratio_memcpy", "ratio_raw_tcp", "gbps"] {
            assert!(r[k].as_f64().is_some_and(|x| x > 0.0), "{k} in {r}");
        }
    }
}

#[test]
fn caps_names_the_path_to_a_same_host_peer() {
    let mut serve = ferry()
        .args(["serve", "--size", "1MiB"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("ferry serve");
    let mut lines = BufReader::new(serve.stdout.take().expect("stdout")).lines();
    let segment = loop {
        let line = lines
            .next()
            .expect("serve printed its segment")
            .expect("line");
        if let Some(rest) = line.split("segment ").nth(1) {
            break rest.trim().to_owned();
        }
    };
    let run = |backend: &str| {
        let out = ferry()
            .args(["caps", "--backend", backend, "--peer", &segment])
            .output()
            .expect("ferry caps");
        assert!(out.status.success());
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let auto = run("tcp://127.0.0.1:0");
    let off = run("tcp://127.0.0.1:0?same_host=off");
    let _ = serve.kill();
    let _ = serve.wait();
    assert!(
        auto.contains(&format!("peer {segment}: path: cma")),
        "{auto}"
    );
    assert!(
        off.contains(&format!("peer {segment}: path: tcp (same_host=off)")),
        "{off}"
    );
}

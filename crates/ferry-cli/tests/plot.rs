//! `ferry bench --plot FILE.svg`: the chart of a short loopback run, read
//! back as XML; and the paths `--plot` refuses.

use std::collections::BTreeMap;
use std::process::{Command, Output};

mod svg_chart;

fn ferry(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_ferry"))
        .env_remove("RUST_LOG")
        .args(args)
        .output()
        .expect("run ferry")
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// A directory of its own under the target directory, emptied first.
fn scratch(name: &str) -> std::path::PathBuf {
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join(name);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("scratch directory");
    dir
}

#[test]
fn other_extensions_and_missing_directories_are_refused_before_the_run() {
    let out = ferry(&["bench", "--plot", "out.png"]);
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("SVG only") && err.contains("*.svg"), "{err}");
    let out = ferry(&["bench", "--plot", "/no/such/dir/out.svg"]);
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("/no/such/dir does not exist"), "{err}");
}

#[cfg(all(feature = "tcp", unix))]
#[test]
fn bench_plot_draws_one_line_per_series_and_the_baselines() {
    let dir = scratch("bench_plot");
    let svg_path = dir.join("bench.svg");
    let svg_arg = svg_path.to_str().expect("a UTF-8 path");
    let out = ferry(&[
        "bench",
        "--json",
        "--plot",
        svg_arg,
        "--blocks",
        "4KiB,16KiB,64KiB",
        "--batches",
        "1,4",
        "--duration",
        "20ms",
        "--warmup",
        "5ms",
        "--region-size",
        "1MiB",
        "--total",
        "32MiB",
    ]);
    let (so, se) = (text(&out.stdout), text(&out.stderr));
    assert!(out.status.success(), "stdout:\n{so}\nstderr:\n{se}");
    assert!(se.contains("chart written to"), "{se}");

    // What was measured, from the JSON rows of the same run.
    let rows: Vec<serde_json::Value> = serde_json::from_str(&so).expect("--json still prints");
    let mut blocks_per_series: BTreeMap<String, usize> = BTreeMap::new();
    for r in &rows {
        let label = format!("{}, batch {}", r["op"].as_str().expect("op"), r["batch"]);
        *blocks_per_series.entry(label).or_default() += 1;
    }
    assert_eq!(blocks_per_series.len(), 4, "{blocks_per_series:?}");
    for baseline in ["raw TCP", "memcpy"] {
        blocks_per_series.insert(baseline.to_owned(), 3);
    }

    let svg = std::fs::read_to_string(&svg_path).expect("the chart was written");
    let doc = roxmltree::Document::parse(&svg).expect("the chart is XML");
    assert!(doc.root_element().has_tag_name("svg"));
    let texts: Vec<&str> = doc
        .descendants()
        .filter(|n| n.has_tag_name("text"))
        .filter_map(|n| n.text().map(str::trim))
        .collect();
    for axis in [
        "block size (bytes per request, log scale)",
        "throughput (GB/s, log scale)",
    ] {
        assert!(texts.contains(&axis), "no axis label {axis:?} in {texts:?}");
    }
    for tick in ["4 KiB", "16 KiB", "64 KiB"] {
        assert!(texts.contains(&tick), "no tick {tick:?} in {texts:?}");
    }

    // Each legend entry is a sample line followed by its label; the series
    // is the one polyline of more than two points in the sample's color,
    // with a point per block size measured.
    let legend: BTreeMap<String, String> = blocks_per_series
        .keys()
        .filter_map(|label| Some((label.clone(), svg_chart::legend_color(&doc, label)?)))
        .collect();
    assert_eq!(
        legend.keys().collect::<Vec<_>>(),
        blocks_per_series.keys().collect::<Vec<_>>(),
        "a legend entry per series and baseline"
    );
    let mut colors: Vec<&String> = legend.values().collect();
    colors.sort();
    colors.dedup();
    assert_eq!(colors.len(), legend.len(), "distinct colors: {legend:?}");
    for (label, color) in &legend {
        let lines = svg_chart::lines_in(&doc, color);
        assert_eq!(lines.len(), 1, "{label}: {lines:?}");
        assert_eq!(
            lines[0].len(),
            blocks_per_series[label],
            "{label}: {lines:?}"
        );
        // Block sizes from left to right.
        assert!(
            lines[0].windows(2).all(|w| w[0].0 < w[1].0),
            "{label}: {lines:?}"
        );
    }
}

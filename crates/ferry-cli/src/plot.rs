//! `ferry bench --plot FILE.svg`: throughput against block size, one line per
//! (batch size, operation) series, with the baselines of the same run drawn
//! as reference lines.
//!
//! The chart is drawn from the bench's rows as `--json` prints them (the
//! rows carry each block size's baselines), so what the chart shows is what
//! the JSON says. It is SVG only: plotters' SVG backend writes labels as
//! `<text>` elements that the viewer renders, so drawing needs no font and
//! no system library (a PNG would need a font file to rasterise its text).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use plotters::coord::combinators::WithKeyPoints;
use plotters::coord::Shift;
use plotters::prelude::*;
use serde::{Deserialize, Serialize};

use crate::util::human_bytes;

/// Width and height of the chart, in SVG pixels.
const SIZE: (u32, u32) = (1000, 620);
/// Width of the legend column right of the plotting area.
const LEGEND_WIDTH: u32 = 240;

/// The fields of one bench row (an object of `ferry bench --json`) that the
/// chart reads.
#[derive(Debug, Clone, Deserialize)]
pub struct Row {
    /// Backend scheme (`tcp`, `mooncake`, ...).
    pub backend: String,
    /// `loopback` or the peer's segment name.
    pub target: String,
    /// The payload path to the target (`cma`, `tcp (reason)`), when known.
    pub path: Option<String>,
    /// `write` or `read`.
    pub op: String,
    /// `sync` or `async`.
    pub api: String,
    /// Bytes per request.
    pub block: u64,
    /// Requests per batch.
    pub batch: usize,
    /// Measured throughput.
    pub gbps: f64,
    /// Raw-TCP baseline at this block size, GB/s.
    pub raw_tcp_gbps: Option<f64>,
    /// memcpy baseline at this block size, GB/s.
    pub memcpy_gbps: Option<f64>,
    /// Kernel cross-memory-copy baseline (`--same-host`), GB/s.
    pub raw_cma_gbps: Option<f64>,
}

/// Parses `--plot`'s value: a path ending in `.svg` (any case) whose
/// directory exists, so that a wrong path fails before the bench runs.
pub fn parse_plot_path(s: &str) -> Result<PathBuf, String> {
    let path = PathBuf::from(s);
    match path.extension().and_then(|e| e.to_str()) {
        Some(e) if e.eq_ignore_ascii_case("svg") => {}
        Some(e) => {
            return Err(format!(
                "the chart is written as SVG only: name the file *.svg, not *.{e} \
                 (a PNG would need a font; a browser or `rsvg-convert` turns the SVG into one)"
            ))
        }
        None => return Err("the chart is written as SVG only: name the file *.svg".to_owned()),
    }
    if path.file_stem().is_none_or(|s| s.is_empty()) {
        return Err("needs a file name before .svg".to_owned());
    }
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        if !dir.is_dir() {
            return Err(format!("directory {} does not exist", dir.display()));
        }
    }
    Ok(path)
}

/// Draws the chart of `rows` (the bench's rows, as `--json` prints them)
/// and writes it to `path` as SVG.
pub fn write_svg<T: Serialize>(path: &Path, rows: &[T]) -> anyhow::Result<()> {
    let value = serde_json::to_value(rows).context("collecting the rows to plot")?;
    let rows: Vec<Row> = serde_json::from_value(value).context("reading the rows to plot")?;
    let svg = render(&rows)?;
    std::fs::write(path, svg).with_context(|| format!("writing the chart to {}", path.display()))
}

/// The baselines' marker: a 7-pixel square around the point.
fn square(fill: ShapeStyle) -> Rectangle<(i32, i32)> {
    Rectangle::new([(-3, -3), (3, 3)], fill)
}

/// Which line a value belongs to.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
enum Key {
    /// A measured series: (path label, batch, op rank, op).
    Ferry(Option<String>, usize, usize, String),
    /// A baseline: raw TCP, memcpy, kernel CMA.
    RawTcp,
    Memcpy,
    RawCma,
}

/// One line of the chart.
struct Series {
    label: String,
    color: RGBColor,
    width: u32,
    marker: Marker,
    /// (block, GB/s), sorted by block.
    points: Vec<(f64, f64)>,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Marker {
    Circle,
    Triangle,
    Square,
}

/// Pairs of (dark, light) colors: one pair per batch size (and path),
/// dark for the first operation, light for the second. No greys or black:
/// those are the baselines'.
const PAIRS: [(RGBColor, RGBColor); 7] = [
    (RGBColor(0x1f, 0x77, 0xb4), RGBColor(0x6b, 0xae, 0xd6)),
    (RGBColor(0xd9, 0x5f, 0x02), RGBColor(0xfd, 0xae, 0x6b)),
    (RGBColor(0x2c, 0xa0, 0x2c), RGBColor(0x74, 0xc4, 0x76)),
    (RGBColor(0xd6, 0x27, 0x28), RGBColor(0xfc, 0x92, 0x72)),
    (RGBColor(0x94, 0x67, 0xbd), RGBColor(0xbc, 0xa0, 0xdc)),
    (RGBColor(0x17, 0xbe, 0xcf), RGBColor(0x9e, 0xda, 0xe5)),
    (RGBColor(0xe3, 0x77, 0xc2), RGBColor(0xf7, 0xb6, 0xd2)),
];

/// Groups the rows into lines: the measured series first (by path, batch,
/// operation), then the baselines (one value per block: the last row's,
/// as the table prints).
fn series(rows: &[Row]) -> Vec<Series> {
    let usable = |g: f64| g.is_finite() && g > 0.0;
    let path_label = |r: &Row| {
        r.path
            .as_deref()
            .and_then(|p| p.split_whitespace().next())
            .map(str::to_owned)
    };
    let mut paths: Vec<Option<String>> = rows.iter().map(path_label).collect();
    paths.sort();
    paths.dedup();
    let show_path = paths.len() > 1;
    let mut ops: Vec<&str> = Vec::new();
    for r in rows {
        if !ops.contains(&r.op.as_str()) {
            ops.push(&r.op);
        }
    }

    let mut lines: BTreeMap<Key, BTreeMap<u64, f64>> = BTreeMap::new();
    for r in rows {
        let rank = ops.iter().position(|o| *o == r.op).unwrap_or(0);
        let path = if show_path { path_label(r) } else { None };
        let mut put = |key: Key, g: Option<f64>| {
            if let Some(g) = g.filter(|g| usable(*g)) {
                lines.entry(key).or_default().insert(r.block, g);
            }
        };
        put(Key::Ferry(path, r.batch, rank, r.op.clone()), Some(r.gbps));
        put(Key::RawTcp, r.raw_tcp_gbps);
        put(Key::Memcpy, r.memcpy_gbps);
        put(Key::RawCma, r.raw_cma_gbps);
    }

    let mut pair_of: Vec<(Option<String>, usize)> = Vec::new();
    lines
        .into_iter()
        .map(|(key, values)| {
            let points = values.into_iter().map(|(b, g)| (b as f64, g)).collect();
            let (label, color, width, marker) = match key {
                Key::Ferry(path, batch, rank, op) => {
                    let pair = (path.clone(), batch);
                    let i = pair_of.iter().position(|p| *p == pair).unwrap_or_else(|| {
                        pair_of.push(pair);
                        pair_of.len() - 1
                    });
                    let (dark, light) = PAIRS[i % PAIRS.len()];
                    let (color, marker) = if rank == 1 {
                        (light, Marker::Triangle)
                    } else {
                        (dark, Marker::Circle)
                    };
                    let label = match path {
                        Some(p) => format!("{p} {op}, batch {batch}"),
                        None => format!("{op}, batch {batch}"),
                    };
                    (label, color, 2, marker)
                }
                Key::RawTcp => ("raw TCP".to_owned(), BLACK, 3, Marker::Square),
                Key::Memcpy => (
                    "memcpy".to_owned(),
                    RGBColor(0x80, 0x80, 0x80),
                    3,
                    Marker::Square,
                ),
                Key::RawCma => (
                    "kernel CMA".to_owned(),
                    RGBColor(0x8c, 0x56, 0x4b),
                    3,
                    Marker::Square,
                ),
            };
            Series {
                label,
                color,
                width,
                marker,
                points,
            }
        })
        .collect()
}

/// Tick values 1, 2, 5 × 10^k inside `lo..=hi` (1…9 × 10^k when that gives
/// fewer than three).
fn log_ticks(lo: f64, hi: f64) -> Vec<f64> {
    let (e0, e1) = (lo.log10().floor() as i32, hi.log10().ceil() as i32);
    let pick = |mantissas: &[f64]| -> Vec<f64> {
        (e0..=e1)
            .flat_map(|e| mantissas.iter().map(move |m| m * 10f64.powi(e)))
            .filter(|v| *v >= lo && *v <= hi)
            .collect()
    };
    let ticks = pick(&[1.0, 2.0, 5.0]);
    if ticks.len() >= 3 {
        ticks
    } else {
        pick(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0])
    }
}

/// A GB/s tick label: as many decimals as the value needs (0.05, 0.2, 1, 20).
fn gbps_label(v: f64) -> String {
    let decimals = (-v.log10().floor()).max(0.0) as usize;
    format!("{v:.decimals$}")
}

/// The chart of `rows` as an SVG document.
fn render(rows: &[Row]) -> anyhow::Result<String> {
    let lines = series(rows);
    let all = || lines.iter().flat_map(|s| s.points.iter());
    let (Some(x_lo), Some(x_hi)) = (
        all().map(|p| p.0).reduce(f64::min),
        all().map(|p| p.0).reduce(f64::max),
    ) else {
        bail!("nothing to plot: no row with a positive throughput");
    };
    let y_lo = all().map(|p| p.1).fold(f64::INFINITY, f64::min);
    let y_hi = all().map(|p| p.1).fold(0.0, f64::max);
    let (x_lo, x_hi) = (x_lo / 1.5, x_hi * 1.5);
    let (y_lo, y_hi) = (y_lo / 1.6, y_hi * 1.6);
    let mut blocks: Vec<f64> = all().map(|p| p.0).collect();
    blocks.sort_by(f64::total_cmp);
    blocks.dedup();

    let first = rows.first().context("nothing to plot")?;
    let title = format!(
        "ferry bench: {} → {}, {} API",
        first.backend, first.target, first.api
    );
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, SIZE).into_drawing_area();
        root.fill(&WHITE).map_err(draw_error)?;
        let root = root
            .titled(&title, ("sans-serif", 24))
            .map_err(draw_error)?;
        let (plot_area, legend_area) = root.split_horizontally(SIZE.0 - LEGEND_WIDTH);
        let mut chart = ChartBuilder::on(&plot_area)
            .margin(16)
            .x_label_area_size(56)
            .y_label_area_size(70)
            .build_cartesian_2d(
                (x_lo..x_hi).log_scale().with_key_points(blocks),
                (y_lo..y_hi)
                    .log_scale()
                    .with_key_points(log_ticks(y_lo, y_hi)),
            )
            .map_err(draw_error)?;
        chart
            .configure_mesh()
            .bold_line_style(RGBColor(0xdd, 0xdd, 0xdd))
            .x_desc("block size (bytes per request, log scale)")
            .y_desc("throughput (GB/s, log scale)")
            .x_label_formatter(&|b| human_bytes(b.round() as u64))
            .y_label_formatter(&|g| gbps_label(*g))
            .label_style(("sans-serif", 17))
            .axis_desc_style(("sans-serif", 19))
            .draw()
            .map_err(draw_error)?;

        // Baselines under the measured lines.
        for s in lines.iter().rev() {
            draw_line(&mut chart, s)?;
        }
        draw_legend(&legend_area, &lines)?;
        root.present().map_err(draw_error)?;
    }
    Ok(svg)
}

/// The chart's coordinates: log block size, log GB/s, ticks where we put them.
type Coords = Cartesian2d<WithKeyPoints<LogCoord<f64>>, WithKeyPoints<LogCoord<f64>>>;

/// Draws one series: the polyline, then a marker at each point.
fn draw_line(
    chart: &mut ChartContext<'_, SVGBackend<'_>, Coords>,
    s: &Series,
) -> anyhow::Result<()> {
    let style = s.color.stroke_width(s.width);
    chart
        .draw_series(LineSeries::new(s.points.iter().copied(), style))
        .map_err(draw_error)?;
    let fill = s.color.filled();
    let points = s.points.iter().copied();
    match s.marker {
        Marker::Circle => chart.draw_series(points.map(|p| Circle::new(p, 4, fill))),
        Marker::Triangle => chart.draw_series(points.map(|p| TriangleMarker::new(p, 6, fill))),
        Marker::Square => chart.draw_series(points.map(|p| EmptyElement::at(p) + square(fill))),
    }
    .map_err(draw_error)?;
    Ok(())
}

/// The legend, in its own column: a sample of each line and its label,
/// measured series first, then the baselines under a heading.
fn draw_legend(area: &DrawingArea<SVGBackend<'_>, Shift>, lines: &[Series]) -> anyhow::Result<()> {
    let text = ("sans-serif", 18).into_font().color(&BLACK);
    let heading = ("sans-serif", 18)
        .into_font()
        .style(FontStyle::Bold)
        .color(&BLACK);
    let mut y = 30;
    let mut in_baselines = false;
    area.draw(&Text::new("measured", (8, y), heading.clone()))
        .map_err(draw_error)?;
    y += 26;
    for s in lines {
        if s.marker == Marker::Square && !in_baselines {
            in_baselines = true;
            y += 10;
            area.draw(&Text::new("baselines, same run", (8, y), heading.clone()))
                .map_err(draw_error)?;
            y += 26;
        }
        let style = s.color.stroke_width(s.width);
        area.draw(&PathElement::new(vec![(10, y + 8), (46, y + 8)], style))
            .map_err(draw_error)?;
        let (at, fill) = ((28, y + 8), s.color.filled());
        match s.marker {
            Marker::Circle => area.draw(&Circle::new(at, 4, fill)),
            Marker::Triangle => area.draw(&TriangleMarker::new(at, 6, fill)),
            Marker::Square => area.draw(&(EmptyElement::at(at) + square(fill))),
        }
        .map_err(draw_error)?;
        area.draw(&Text::new(s.label.as_str(), (56, y), text.clone()))
            .map_err(draw_error)?;
        y += 24;
    }
    Ok(())
}

fn draw_error<E: std::error::Error + Send + Sync>(e: DrawingAreaErrorKind<E>) -> anyhow::Error {
    anyhow::anyhow!("drawing the chart: {e}")
}

/// Reads the SVG back (shared with tests/plot.rs).
#[cfg(test)]
#[path = "../tests/svg_chart/mod.rs"]
mod svg_chart;

#[cfg(test)]
mod tests {
    use super::*;

    fn row(op: &str, batch: usize, block: u64, gbps: f64) -> Row {
        Row {
            backend: "tcp".to_owned(),
            target: "loopback".to_owned(),
            path: None,
            op: op.to_owned(),
            api: "sync".to_owned(),
            block,
            batch,
            gbps,
            raw_tcp_gbps: Some(2.0),
            memcpy_gbps: Some(8.0),
            raw_cma_gbps: None,
        }
    }

    /// The points of the one line drawn in the color of the legend entry
    /// `label`.
    fn line_of(svg: &str, label: &str) -> Vec<(f64, f64)> {
        let doc = roxmltree::Document::parse(svg).expect("the chart is XML");
        let color = svg_chart::legend_color(&doc, label)
            .unwrap_or_else(|| panic!("no legend entry {label:?}"));
        let lines = svg_chart::lines_in(&doc, &color);
        assert_eq!(lines.len(), 1, "one line in {color} for {label:?}");
        lines.into_iter().next().unwrap_or_default()
    }

    #[test]
    fn a_series_of_higher_throughput_is_drawn_higher() {
        let blocks = [4096, 65536, 1 << 20];
        let mut rows = Vec::new();
        for (i, &block) in blocks.iter().enumerate() {
            rows.push(row("write", 1, block, 0.1 * (i + 1) as f64));
            rows.push(row("write", 16, block, 1.0 * (i + 1) as f64));
        }
        let svg = render(&rows).expect("renders");
        let slow = line_of(&svg, "write, batch 1");
        let fast = line_of(&svg, "write, batch 16");
        assert_eq!(slow.len(), blocks.len());
        assert_eq!(fast.len(), blocks.len());
        for (s, f) in slow.iter().zip(&fast) {
            assert_eq!(s.0, f.0, "same block, same x");
            // SVG's y grows downwards.
            assert!(f.1 < s.1, "batch 16 ({f:?}) is drawn above batch 1 ({s:?})");
        }
        // Larger blocks are further right, and the baselines are lines too.
        assert!(slow.windows(2).all(|w| w[0].0 < w[1].0), "{slow:?}");
        let memcpy = line_of(&svg, "memcpy");
        let raw_tcp = line_of(&svg, "raw TCP");
        assert!(memcpy.iter().zip(&raw_tcp).all(|(m, t)| m.1 < t.1));
    }

    #[test]
    fn paths_are_named_only_when_rows_differ_in_path() {
        let mut rows = vec![row("read", 4, 4096, 1.0), row("read", 4, 8192, 2.0)];
        let labels =
            |rows: &[Row]| -> Vec<String> { series(rows).into_iter().map(|s| s.label).collect() };
        assert_eq!(labels(&rows), ["read, batch 4", "raw TCP", "memcpy"]);
        for r in &mut rows {
            r.path = Some("cma".to_owned());
        }
        assert_eq!(labels(&rows)[0], "read, batch 4");
        let mut off = rows.clone();
        for r in &mut off {
            r.path = Some("tcp (same_host=off)".to_owned());
            r.raw_cma_gbps = Some(5.0);
        }
        rows.extend(off);
        assert_eq!(
            labels(&rows),
            [
                "cma read, batch 4",
                "tcp read, batch 4",
                "raw TCP",
                "memcpy",
                "kernel CMA"
            ]
        );
    }

    #[test]
    fn one_block_size_and_no_baselines_still_draw() {
        let mut r = row("write", 1, 4096, 0.5);
        r.raw_tcp_gbps = None;
        r.memcpy_gbps = None;
        let svg = render(&[r]).expect("renders");
        let doc = roxmltree::Document::parse(&svg).expect("XML");
        let texts: Vec<&str> = doc
            .descendants()
            .filter(|n| n.has_tag_name("text"))
            .map(|n| n.text().unwrap_or("").trim())
            .collect();
        assert!(texts.contains(&"write, batch 1"), "{texts:?}");
        assert!(!texts.contains(&"baselines, same run"), "{texts:?}");
        assert!(texts.contains(&"4 KiB"), "{texts:?}");
    }

    #[test]
    fn nothing_to_plot_is_an_error() {
        let mut r = row("write", 1, 4096, f64::NAN);
        r.raw_tcp_gbps = None;
        r.memcpy_gbps = None;
        let err = render(&[r]).expect_err("no usable value").to_string();
        assert!(err.contains("nothing to plot"), "{err}");
        assert!(render(&[]).is_err());
    }

    #[test]
    fn the_plot_path_must_be_svg_in_a_directory_that_exists() {
        assert!(parse_plot_path("out.svg").is_ok());
        assert!(parse_plot_path("OUT.SVG").is_ok());
        for bad in ["out.png", "out", "out.svg.png"] {
            let err = parse_plot_path(bad).expect_err(bad);
            assert!(err.contains("SVG") && err.contains("*.svg"), "{bad}: {err}");
        }
        let err = parse_plot_path("/no/such/dir/out.svg").expect_err("missing dir");
        assert!(
            err.contains("/no/such/dir") && err.contains("does not exist"),
            "{err}"
        );
        assert!(parse_plot_path(".svg").is_err());
    }

    #[test]
    fn tick_labels() {
        assert_eq!(log_ticks(0.3, 30.0), [0.5, 1.0, 2.0, 5.0, 10.0, 20.0]);
        assert_eq!(log_ticks(1.1, 4.5), [2.0, 3.0, 4.0]);
        assert_eq!(gbps_label(0.05), "0.05");
        assert_eq!(gbps_label(0.2), "0.2");
        assert_eq!(gbps_label(20.0), "20");
    }
}

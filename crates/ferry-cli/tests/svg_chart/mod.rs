//! Reads back the chart `ferry bench --plot` draws: shared by the plot
//! module's unit tests (`src/plot.rs`) and `tests/plot.rs`.
//!
//! In the chart, each legend entry is a two-point sample line followed by
//! its label's `<text>`, and each series is one `<polyline>` in the
//! sample's color (told apart from samples and ticks by having more than
//! two points: give the series three block sizes or more).

use roxmltree::{Document, Node};

/// The points of a `<polyline>`.
pub fn points(n: Node<'_, '_>) -> Vec<(f64, f64)> {
    n.attribute("points")
        .unwrap_or_default()
        .split_whitespace()
        .map(|p| {
            let (x, y) = p.split_once(',').expect("x,y");
            (x.parse().expect("x"), y.parse().expect("y"))
        })
        .collect()
}

/// The color of the legend sample drawn right before the text `label`.
pub fn legend_color(doc: &Document<'_>, label: &str) -> Option<String> {
    let mut sample = None;
    let mut color = None;
    for n in doc.descendants() {
        if n.has_tag_name("polyline") && points(n).len() == 2 {
            sample = n.attribute("stroke");
        } else if n.has_tag_name("text") && n.text().map(str::trim) == Some(label) {
            color = sample;
        }
    }
    color.map(str::to_owned)
}

/// The polylines of more than two points drawn in `color`.
pub fn lines_in(doc: &Document<'_>, color: &str) -> Vec<Vec<(f64, f64)>> {
    doc.descendants()
        .filter(|n| n.has_tag_name("polyline") && n.attribute("stroke") == Some(color))
        .map(points)
        .filter(|p| p.len() > 2)
        .collect()
}

//! `--plot FILE.svg`: the rate/quality trade-off as an SVG chart (plotters, SVG backend only).
//!
//! One generic chart: curves (a method's levels, joined in order) and separate points (the
//! baselines), a legend, and a log y axis for errors that span decades. The text is SVG `<text>`
//! whose size plotters estimates itself, so no font file is read: the chart draws the same on a
//! machine without fonts.

use std::error::Error;
use std::ops::Range;
use std::path::Path;

use plotters::coord::ranged1d::{AsRangedCoord, ValueFormatter};
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

use kvc_io::Output;

use crate::say::note;
use crate::Result;

/// Width and height of the chart in pixels.
const SIZE: (u32, u32) = (900, 600);

/// Series colours, in order: dark enough on white, told apart by colour-blind readers too (the
/// Okabe-Ito set, its yellow left out).
const COLORS: [RGBColor; 7] = [
    RGBColor(213, 94, 0),
    RGBColor(0, 114, 178),
    RGBColor(0, 158, 115),
    RGBColor(230, 159, 0),
    RGBColor(204, 121, 167),
    RGBColor(86, 180, 233),
    RGBColor(0, 0, 0),
];

/// One named set of points, drawn as one legend entry.
#[derive(Clone, Debug, Default)]
pub struct Series {
    /// The legend text.
    pub name: String,
    /// The points, (x, y), in drawing order.
    pub points: Vec<(f64, f64)>,
    /// Text next to each point (e.g. the level number), by index; shorter than `points` (or
    /// empty) leaves the rest unlabelled.
    pub labels: Vec<String>,
}

/// What [`render_svg`] draws.
#[derive(Clone, Debug, Default)]
pub struct Chart {
    /// The caption above the chart.
    pub title: String,
    /// The x axis' description.
    pub x_label: String,
    /// The y axis' description.
    pub y_label: String,
    /// A logarithmic y axis (errors spanning decades); y values <= 0 are then left out.
    pub log_y: bool,
    /// Series drawn as lines through their points.
    pub curves: Vec<Series>,
    /// Series drawn as markers only.
    pub points: Vec<Series>,
}

/// The points of `s` that can be drawn, with their labels: finite, and y > 0 on a log axis.
fn visible(s: &Series, log_y: bool) -> Vec<((f64, f64), String)> {
    let label = |i: usize| s.labels.get(i).cloned().unwrap_or_default();
    s.points
        .iter()
        .enumerate()
        .filter(|(_, &(x, y))| x.is_finite() && y.is_finite() && (!log_y || y > 0.0))
        .map(|(i, &p)| (p, label(i)))
        .collect()
}

/// The least and greatest of `v` (`None` when empty).
fn bounds(v: impl Iterator<Item = f64>) -> Option<(f64, f64)> {
    v.fold(None, |b, x| match b {
        None => Some((x, x)),
        Some((l, h)) => Some((x.min(l), x.max(h))),
    })
}

/// The range of `v` widened by 8% of its span on each side (half the value, at least 0.5, around
/// a single value), so the extreme points do not sit on the frame. Empty input gives `0..1`.
fn padded(v: impl Iterator<Item = f64>) -> Range<f64> {
    let Some((lo, hi)) = bounds(v) else {
        return 0.0..1.0;
    };
    let pad = if hi > lo {
        (hi - lo) * 0.08
    } else {
        lo.abs().max(1.0) * 0.5
    };
    lo - pad..hi + pad
}

/// Like [`padded`] for positive values on a log axis: 8% of the span in decades, at least a
/// factor of 2 each side. Empty input gives `0.01..1`.
fn padded_log(v: impl Iterator<Item = f64>) -> Range<f64> {
    let Some((lo, hi)) = bounds(v.map(f64::log10)) else {
        return 0.01..1.0;
    };
    let pad = ((hi - lo) * 0.08).max(0.3);
    10f64.powf(lo - pad)..10f64.powf(hi + pad)
}

/// An axis tick: plain decimals near 1, scientific notation for small or large values.
fn tick(v: &f64) -> String {
    let a = v.abs();
    if *v == 0.0 || (1e-2..1e4).contains(&a) {
        let s = format!("{v:.3}");
        s.trim_end_matches('0').trim_end_matches('.').to_string()
    } else {
        format!("{v:.0e}")
    }
}

/// What an empty chart says in its middle, so that it is not read as a result.
pub const NOTHING_TO_DRAW: &str = "no finite values to draw (e.g. a dump without queries)";

/// Renders `chart` as an SVG document. Any input draws: non-finite points (and non-positive y on
/// a log axis) are left out, and the axes fit whatever remains, even one point; with none, the
/// chart says [`NOTHING_TO_DRAW`].
pub fn render_svg(chart: &Chart) -> Result<String> {
    let log = chart.log_y;
    let all: Vec<(f64, f64)> = (chart.curves.iter().chain(&chart.points))
        .flat_map(|s| visible(s, log))
        .map(|(p, _)| p)
        .collect();
    let x = padded(all.iter().map(|p| p.0));
    let ys = all.iter().map(|p| p.1);
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, SIZE).into_drawing_area();
        let r = if log {
            draw(&root, chart, x, padded_log(ys).log_scale())
        } else {
            draw(&root, chart, x, padded(ys))
        };
        r.and_then(|()| {
            if all.is_empty() {
                let (w, h) = (SIZE.0 as i32, SIZE.1 as i32);
                let style = ("sans-serif", 18).into_font().color(&BLACK);
                let style = style.pos(Pos::new(HPos::Center, VPos::Center));
                root.draw(&Text::new(NOTHING_TO_DRAW, (w / 2, h / 2), style))?;
            }
            Ok(root.present()?)
        })
        .map_err(|e| format!("cannot draw the plot: {e}"))?;
    }
    Ok(svg)
}

/// Draws the frame, the series and the legend on `root`, with the axes `x` and `y`.
fn draw<Y>(
    root: &DrawingArea<SVGBackend<'_>, plotters::coord::Shift>,
    chart: &Chart,
    x: Range<f64>,
    y: Y,
) -> std::result::Result<(), Box<dyn Error>>
where
    Y: AsRangedCoord<Value = f64>,
    Y::CoordDescType: ValueFormatter<f64>,
{
    root.fill(&WHITE)?;
    let mut c = ChartBuilder::on(root)
        .caption(&chart.title, ("sans-serif", 22))
        .margin(16)
        .x_label_area_size(48)
        .y_label_area_size(72)
        .build_cartesian_2d(x, y)?;
    c.configure_mesh()
        .x_desc(&chart.x_label)
        .y_desc(&chart.y_label)
        .x_label_formatter(&tick)
        .y_label_formatter(&tick)
        .max_light_lines(4)
        .label_style(("sans-serif", 14))
        .axis_desc_style(("sans-serif", 16))
        .draw()?;
    let series = chart.curves.iter().map(|s| (s, true));
    for (i, (s, line)) in series
        .chain(chart.points.iter().map(|s| (s, false)))
        .enumerate()
    {
        let color = COLORS[i % COLORS.len()].to_rgba();
        let pts = visible(s, chart.log_y);
        // The line first, so the markers sit on top of it.
        if line {
            c.draw_series(LineSeries::new(
                pts.iter().map(|(p, _)| *p),
                color.stroke_width(2),
            ))?;
        }
        let anno = c.draw_series(pts.iter().map(|(p, l)| {
            EmptyElement::at(*p)
                + marker(line, (0, 0), color)
                + Text::new(l.clone(), (6, -16), ("sans-serif", 13))
        }))?;
        anno.label(&s.name).legend(move |at| {
            let path = if line { color } else { TRANSPARENT };
            EmptyElement::at(at)
                + PathElement::new(vec![(0, 0), (20, 0)], path.stroke_width(2))
                + marker(line, (10, 0), color)
        });
    }
    c.configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .label_font(("sans-serif", 14))
        .draw()?;
    Ok(())
}

/// The marker of a point at `at` (pixels from it): a dot on a curve, a triangle for a baseline.
fn marker<DB: DrawingBackend>(
    line: bool,
    at: (i32, i32),
    color: RGBAColor,
) -> DynElement<'static, DB, (i32, i32)> {
    if line {
        Circle::new(at, 4, color.filled()).into_dyn()
    } else {
        TriangleMarker::new(at, 7, color.filled()).into_dyn()
    }
}

/// The last component of `p`, for a chart's title.
pub fn file_name(p: &Path) -> String {
    p.file_name().map_or_else(
        || p.display().to_string(),
        |n| n.to_string_lossy().into_owned(),
    )
}

/// Renders `chart` and writes it to `path` (atomically), saying so on stderr. Every `--plot`
/// goes through here, so a check on the output path belongs here too.
pub fn write(out: &Output, chart: &Chart) -> Result<()> {
    let svg = render_svg(chart)?;
    out.write(svg.as_bytes()).map_err(|e| e.to_string())?;
    note!("wrote {}", out.path().display());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn series(name: &str, points: &[(f64, f64)]) -> Series {
        Series {
            name: name.into(),
            points: points.to_vec(),
            labels: vec!["0".into()],
        }
    }

    fn chart(log_y: bool, curve: &[(f64, f64)], point: &[(f64, f64)]) -> Chart {
        Chart {
            title: "t".into(),
            x_label: "bits".into(),
            y_label: "error".into(),
            log_y,
            curves: vec![series("curve-name", curve)],
            points: vec![series("points-name", point)],
        }
    }

    #[test]
    fn degenerate_inputs_draw() {
        const NAN: f64 = f64::NAN;
        type Points = &'static [(f64, f64)];
        let cases: [(Points, Points); 7] = [
            (&[(1.0, 0.1)], &[]),
            (&[(1.0, 0.0)], &[(2.0, 0.5)]),
            (&[(NAN, 0.1), (1.0, NAN)], &[(f64::INFINITY, 1.0)]),
            (&[], &[]),
            (&[(NAN, NAN)], &[(1.0, NAN)]),
            (&[(3.0, 0.0), (3.0, -1.0)], &[(3.0, 0.0)]),
            (&[(1.0, 1e-9), (2.0, 1e3)], &[(1.5, 1e-9)]),
        ];
        for log_y in [true, false] {
            for (curve, point) in cases {
                let svg = render_svg(&chart(log_y, curve, point)).unwrap();
                assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
                assert!(svg.contains("curve-name") && svg.contains("points-name"));
                let drawn = curve
                    .iter()
                    .chain(point)
                    .any(|&(x, y)| x.is_finite() && y.is_finite() && (!log_y || y > 0.0));
                assert_eq!(svg.contains(NOTHING_TO_DRAW), !drawn, "{curve:?} {point:?}");
            }
        }
    }

    #[test]
    fn ranges_are_padded_and_ticks_readable() {
        assert_eq!(padded([2.0].into_iter()), 1.0..3.0);
        assert_eq!(padded(std::iter::empty()), 0.0..1.0);
        let r = padded_log([0.01, 0.01].into_iter());
        assert!(r.start < 0.01 && r.end > 0.01 && r.start > 0.0);
        assert_eq!(tick(&0.25), "0.25");
        assert_eq!(tick(&3.0), "3");
        assert_eq!(tick(&0.0001), "1e-4");
    }
}

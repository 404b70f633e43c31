//! Line charts of the soak's series over time (PNG, plotters as the other
//! benchmarks draw theirs).

use std::path::Path;

use crate::bench::plot::{legend, line_key};
use anyhow::{anyhow, Context, Result};
use plotters::prelude::*;

/// One line: its legend and (seconds, value) points.
pub struct Series {
    pub name: String,
    pub points: Vec<(f64, f64)>,
}

const COLORS: [RGBColor; 8] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(0, 0, 0),
];

/// Draws `series` against time into a 900x480 PNG at `path`; `y_desc`
/// names the unit. A chart with no points still gets its axes and title.
pub fn time_chart(path: &Path, title: &str, y_desc: &str, series: &[Series]) -> Result<()> {
    draw(BitMapBackend::new(path, (900, 480)).into_drawing_area(), title, y_desc, series)
        .with_context(|| format!("drawing {}", path.display()))
}

fn draw<DB: DrawingBackend>(
    area: DrawingArea<DB, plotters::coord::Shift>,
    title: &str,
    y_desc: &str,
    series: &[Series],
) -> Result<()>
where
    DB::ErrorType: 'static,
{
    let e = |e: DrawingAreaErrorKind<DB::ErrorType>| anyhow!("{e}");
    area.fill(&WHITE).map_err(e)?;
    let all = series.iter().flat_map(|s| s.points.iter()).filter(|p| p.0.is_finite() && p.1.is_finite());
    let (mut x_hi, mut y_hi) = (1.0f64, 0.0f64);
    for &(x, y) in all {
        x_hi = x_hi.max(x);
        y_hi = y_hi.max(y);
    }
    let y_hi = if y_hi > 0.0 { y_hi * 1.15 } else { 1.0 };
    let mut chart = ChartBuilder::on(&area)
        .caption(title, ("sans-serif", 20))
        .margin(16)
        .x_label_area_size(40)
        .y_label_area_size(72)
        .build_cartesian_2d(0.0..x_hi * 1.02, 0.0..y_hi)
        .map_err(e)?;
    chart
        .configure_mesh()
        .x_desc("seconds into the run")
        .y_desc(y_desc)
        .light_line_style(RGBColor(240, 240, 240))
        .draw()
        .map_err(e)?;
    for (i, s) in series.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        let style = ShapeStyle { color: color.to_rgba(), filled: true, stroke_width: 2 };
        let pts: Vec<(f64, f64)> = s.points.iter().copied().filter(|p| p.0.is_finite() && p.1.is_finite()).collect();
        chart
            .draw_series(LineSeries::new(pts, style).point_size(3))
            .map_err(e)?
            .label(s.name.clone())
            .legend(line_key(color));
    }
    if !series.is_empty() {
        legend(&mut chart, SeriesLabelPosition::LowerRight)?;
    }
    area.present().map_err(e)?;
    Ok(())
}

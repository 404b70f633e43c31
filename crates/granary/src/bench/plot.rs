//! What the benchmarks' charts share: the legend box and the legend keys.

use anyhow::Result;
use plotters::coord::CoordTranslate;
use plotters::prelude::*;

/// Draws a chart's legend (the series given a `.label`) at `at`, on a
/// white, slightly see-through box with a black border.
pub fn legend<'a, DB: DrawingBackend + 'a, CT: CoordTranslate>(
    chart: &mut ChartContext<'a, DB, CT>,
    at: SeriesLabelPosition,
) -> Result<()> {
    chart
        .configure_series_labels()
        .position(at)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(|e| anyhow::anyhow!("{e}"))
}

/// A line series' legend key: a short stroke of its colour.
pub fn line_key(color: impl Color + Copy) -> impl Fn((i32, i32)) -> PathElement<(i32, i32)> {
    move |(x, y)| PathElement::new([(x, y), (x + 20, y)], color.stroke_width(2))
}

/// A bar series' legend key: a filled square of its colour.
pub fn bar_key(color: impl Color + Copy) -> impl Fn((i32, i32)) -> Rectangle<(i32, i32)> {
    move |(x, y)| Rectangle::new([(x, y - 5), (x + 14, y + 5)], color.filled())
}

//! What the benchmarks' charts share: the fonts check, the legend box and
//! the legend keys.

use anyhow::Result;
use plotters::coord::CoordTranslate;
use plotters::prelude::*;

/// The chart's text goes through fontconfig, loaded when first needed
/// (a missing library would then abort the process): checks it is there.
pub fn check_fonts() -> Result<()> {
    // SAFETY: dlopen with a constant name; the handle is closed at once.
    let handle = unsafe { libc::dlopen(c"libfontconfig.so.1".as_ptr(), libc::RTLD_LAZY | libc::RTLD_LOCAL) };
    if handle.is_null() {
        anyhow::bail!(
            "the benchmarks' charts need fontconfig and a font, not found here \
             (Debian: apt-get install fontconfig fonts-dejavu-core)"
        );
    }
    // SAFETY: a handle dlopen returned.
    unsafe { libc::dlclose(handle) };
    Ok(())
}

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

//! What `bench ttft` prints and draws: its goals, tables and chart.

use super::*;
use crate::bench::plot::legend;

/// The size the goals are judged at: 4096 tokens if run, else the largest.
fn goal_size(sizes: &[SizeResult]) -> Option<&SizeResult> {
    sizes.iter().find(|s| s.tokens == GOAL_SIZE).or_else(|| sizes.iter().max_by_key(|s| s.tokens))
}

pub(super) fn goals(sizes: &[SizeResult]) -> Vec<Goal> {
    let Some(s) = goal_size(sizes) else { return Vec::new() };
    let md = &s.median;
    let mut out = Vec::new();
    for t in Tier::ALL {
        let ratio = md.warm(t) / md.raw(t);
        let anchor = if t == Tier::Memory { "memcpy of the KV" } else { "raw read of its files" };
        out.push(Goal::new(
            "ttft",
            format!("{} tokens, warm {}: TTFT <= {RAW_GOAL}x {anchor}", s.tokens, t.name()),
            ratio <= RAW_GOAL,
            format!("{:.1} ms vs {:.1} ms ({ratio:.2}x)", md.warm(t), md.raw(t)),
        ));
    }
    let ratio = md.cold_ms / md.disk_ms;
    out.push(Goal::new(
        "ttft",
        format!("{} tokens: cold TTFT >= {COLD_GOAL}x warm disk (after restart)", s.tokens),
        ratio >= COLD_GOAL,
        format!("{:.1} ms vs {:.1} ms ({ratio:.1}x)", md.cold_ms, md.disk_ms),
    ));
    // Long prompts: a warm start from engine memory, and how cold prefill
    // holds up against the shortest prompt's rate.
    let (short, long) = match (sizes.first(), sizes.last()) {
        (Some(a), Some(b)) if b.tokens >= LONG_TOKENS && a.tokens < b.tokens => (a, b),
        _ => return out,
    };
    out.push(Goal::new(
        "ttft",
        format!("{} tokens, warm memory: TTFT < {LONG_WARM_GOAL_MS} ms", long.tokens),
        long.median.warm(Tier::Memory) < LONG_WARM_GOAL_MS,
        format!("{:.1} ms", long.median.warm(Tier::Memory)),
    ));
    let rate = |x: &SizeResult| x.tokens as f64 / x.median.cold_ms * 1e3;
    let ratio = rate(long) / rate(short);
    out.push(Goal::new(
        "ttft",
        format!("cold prefill at {} tokens >= {LONG_PREFILL_GOAL}x its rate at {}", long.tokens, short.tokens),
        ratio >= LONG_PREFILL_GOAL,
        format!("{:.0} vs {:.0} tok/s ({ratio:.2}x)", rate(long), rate(short)),
    ));
    out
}

/// A prompt this long gets the long-prompt goals.
const LONG_TOKENS: usize = 8000;
const LONG_WARM_GOAL_MS: f64 = 300.0;
const LONG_PREFILL_GOAL: f64 = 0.6;

fn f1(x: f64) -> String {
    format!("{x:.1}")
}

pub(super) fn tables(r: &Report) -> Vec<Table> {
    let mut t = Table::new(
        format!(
            "ttft: time to first token, ms (median of {} run(s)); {}-token blocks, KV {} B/token",
            r.repeats, r.block_tokens, r.kv_bytes_per_token
        ),
        &[
            "prompt",
            "cached tok (memory/lower tiers)",
            "KV MiB",
            "cold",
            "warm memory",
            "warm disk",
            "warm remote",
            "cold/memory",
            "cold/disk",
            "cold/remote",
        ],
    );
    for s in &r.sizes {
        let md = &s.median;
        let cached = |i: usize| s.runs.first().map_or(0, |x| x.tiers.get(i).map_or(0, |t| t.cached_tokens));
        t.row(vec![
            s.tokens.to_string(),
            format!("{}/{}", cached(0), cached(1)),
            f1(s.kv_bytes as f64 / (1u64 << 20) as f64),
            f1(md.cold_ms),
            f1(md.memory_ms),
            f1(md.disk_ms),
            f1(md.remote_ms),
            format!("{:.1}x", md.cold_ms / md.memory_ms),
            format!("{:.1}x", md.cold_ms / md.disk_ms),
            format!("{:.1}x", md.cold_ms / md.remote_ms),
        ]);
    }
    let mut reads = Table::new(
        "ttft: warm TTFT against reading the same KV from the tier, ms (median); raw = sequential reads \
         of the tier's files (memory: one memcpy); Store::get = every block from a freshly opened store; \
         connector = the engine's lookup + get_many on a freshly opened store; page cache = share of the \
         files cached when the warm run / the raw read started",
        &[
            "prompt",
            "tier",
            "warm TTFT",
            "connector",
            "Store::get",
            "raw read",
            "MiB read",
            "page cache",
            "TTFT/raw",
            "goal",
        ],
    );
    for s in &r.sizes {
        let md = &s.median;
        for t in Tier::ALL {
            let first = s.runs.first().and_then(|x| x.tiers.iter().find(|y| y.tier == t));
            let ratio = md.warm(t) / md.raw(t);
            let resident = first.and_then(|f| f.cached_at_raw.zip(f.cached_at_ttft));
            reads.row(vec![
                s.tokens.to_string(),
                t.name().to_string(),
                f1(md.warm(t)),
                md.connector_get(t).map_or_else(|| "-".into(), f1),
                md.store_get(t).map_or_else(|| "-".into(), f1),
                f1(md.raw(t)),
                f1(first.map_or(0, |f| f.raw_bytes) as f64 / (1u64 << 20) as f64),
                resident.map_or_else(|| "-".into(), |(a, b)| format!("{:.0}%/{:.0}%", b * 100.0, a * 100.0)),
                format!("{ratio:.2}x"),
                if ratio <= RAW_GOAL { "PASS" } else { "MISS" }.to_string(),
            ]);
        }
    }
    vec![t, reads]
}

pub(super) fn draw<DB: DrawingBackend>(r: &Report, area: DrawingArea<DB, plotters::coord::Shift>) -> Result<()>
where
    DB::ErrorType: 'static,
{
    let e = |e: DrawingAreaErrorKind<DB::ErrorType>| anyhow::anyhow!("{e}");
    area.fill(&WHITE).map_err(e)?;
    let n = r.sizes.len();
    let labels: Vec<String> = r.sizes.iter().map(|s| s.tokens.to_string()).collect();
    let label = move |x: &f64| {
        let i = x.round();
        if (x - i).abs() < 1e-6 && i >= 0.0 && (i as usize) < labels.len() {
            labels[i as usize].clone()
        } else {
            String::new()
        }
    };
    type Pick = fn(&Medians) -> f64;
    let series: [(&str, Pick, RGBColor, bool); 7] = [
        ("cold (full prefill)", |m| m.cold_ms, RGBColor(0, 0, 0), false),
        ("warm: engine memory", |m| m.memory_ms, RGBColor(31, 119, 180), false),
        ("warm: disk after restart", |m| m.disk_ms, RGBColor(255, 127, 14), false),
        ("warm: remote after restart", |m| m.remote_ms, RGBColor(44, 160, 44), false),
        ("memcpy of the KV", |m| m.raw_memory_ms, RGBColor(31, 119, 180), true),
        ("raw read: disk files", |m| m.raw_disk_ms, RGBColor(255, 127, 14), true),
        ("raw read: remote files", |m| m.raw_remote_ms, RGBColor(44, 160, 44), true),
    ];
    let values: Vec<f64> = r
        .sizes
        .iter()
        .flat_map(|s| series.iter().map(|(_, f, _, _)| f(&s.median)))
        .filter(|v| v.is_finite() && *v > 0.0)
        .collect();
    let lo = values.iter().copied().fold(f64::INFINITY, f64::min).min(1.0) / 2.0;
    let hi = values.iter().copied().fold(1.0, f64::max) * 2.0;
    let mut chart = ChartBuilder::on(&area)
        .caption(
            format!("Time to first token by where the prompt's KV comes from ({}-token blocks)", r.block_tokens),
            ("sans-serif", 20),
        )
        .margin(16)
        .x_label_area_size(44)
        .y_label_area_size(64)
        .build_cartesian_2d(-0.25..(n as f64 - 0.75), (lo..hi).log_scale())
        .map_err(e)?;
    chart
        .configure_mesh()
        .x_labels(n)
        .x_desc("prompt tokens")
        .y_desc("ms (log scale)")
        .x_label_formatter(&label)
        .y_label_formatter(&|y| format!("{y}"))
        .light_line_style(RGBColor(240, 240, 240))
        .draw()
        .map_err(e)?;
    for (name, pick, color, dashed) in series {
        let points: Vec<(f64, f64)> = r
            .sizes
            .iter()
            .enumerate()
            .map(|(i, s)| (i as f64, pick(&s.median)))
            .filter(|p| p.1.is_finite() && p.1 > 0.0)
            .collect();
        let style = ShapeStyle { color: color.to_rgba(), filled: true, stroke_width: 2 };
        let anno = if dashed {
            chart.draw_series(DashedLineSeries::new(points.iter().copied(), 8, 5, style)).map_err(e)?
        } else {
            chart.draw_series(LineSeries::new(points.iter().copied(), style).point_size(4)).map_err(e)?
        };
        anno.label(name).legend(move |(x, y)| {
            if dashed {
                PathElement::new([(x, y), (x + 8, y)], color.stroke_width(2))
            } else {
                PathElement::new([(x, y), (x + 20, y)], color.stroke_width(2))
            }
        });
    }
    legend(&mut chart, SeriesLabelPosition::UpperLeft)?;
    area.present().map_err(e)?;
    Ok(())
}

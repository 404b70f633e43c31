//! `hitratio`: what each eviction policy keeps of the reuse in a real trace.
//!
//! Replays the Mooncake conversation trace (requests as lists of block ids,
//! each block 512 tokens) through every memory-tier policy at budgets from
//! 1% to 50% of the trace's distinct blocks, with the warehouse's trace
//! simulator. The anchor is the trace's ceiling: the hit ratio of a cache
//! that never evicts (every repeat reference hits). Writes a line chart,
//! hit ratio against budget with one line per policy and the ceiling
//! dashed, as SVG and PNG into the output directory.

use std::path::PathBuf;

use crate::bench::plot::{legend, line_key};
use anyhow::{Context, Result};
use granary_warehouse::PolicyKind;
use plotters::prelude::*;
use serde::Serialize;

use super::report::{bar, Goal, Table};
use super::{Ctx, Unavailable};
use crate::bench::sim::{self, TraceRequest};

const TRACE: &str = "shared/data/mooncake/conversation_trace.jsonl";
const QUICK_BUDGETS: [f64; 3] = [0.02, 0.10, 0.50];

#[derive(Debug, Serialize)]
pub struct Cell {
    pub policy: PolicyKind,
    pub budget_share: f64,
    pub capacity_blocks: u64,
    pub hits: u64,
    pub refs: u64,
    pub hit_ratio: f64,
    /// hit_ratio / ceiling.
    pub of_ceiling: f64,
    /// Hits before each request's first miss, over all references: what an
    /// engine loading the longest cached prefix can use.
    pub prefix_hit_ratio: f64,
    pub evictions: u64,
}

#[derive(Debug, Serialize)]
pub struct HitReport {
    pub trace: PathBuf,
    pub requests: usize,
    pub distinct_blocks: u64,
    pub block_refs: u64,
    pub ceiling: f64,
    pub budgets: Vec<f64>,
    pub cells: Vec<Cell>,
    pub chart_svg: PathBuf,
    pub chart_png: PathBuf,
}

pub fn run(ctx: &Ctx) -> Result<HitReport> {
    let path = locate(ctx)?;
    let trace: Vec<TraceRequest> =
        sim::load_trace(&path).with_context(|| format!("loading the trace {}", path.display()))?;
    let distinct = sim::distinct_blocks(&trace);
    let refs: u64 = trace.iter().map(|r| r.hash_ids.len() as u64).sum();
    let ceiling = sim::unbounded_ceiling(&trace);
    let budgets: Vec<f64> = if ctx.quick { QUICK_BUDGETS.to_vec() } else { sim::SWEEP_FRACTIONS.to_vec() };
    let pb = bar((PolicyKind::ALL.len() * budgets.len()) as u64, "hitratio");
    let mut cells = Vec::new();
    for policy in PolicyKind::ALL {
        for &share in &budgets {
            pb.set_message(format!("{policy} at {:.0}%", share * 100.0));
            let capacity_blocks = sim::capacity_for(distinct, share);
            let r = sim::replay(&trace, policy, capacity_blocks);
            cells.push(Cell {
                policy,
                budget_share: share,
                capacity_blocks,
                hits: r.hits,
                refs: r.refs,
                hit_ratio: r.hit_ratio,
                of_ceiling: if ceiling > 0.0 { r.hit_ratio / ceiling } else { 0.0 },
                prefix_hit_ratio: r.prefix_hit_ratio,
                evictions: r.evictions,
            });
            pb.inc(1);
        }
    }
    pb.finish_and_clear();
    std::fs::create_dir_all(&ctx.out).with_context(|| format!("creating {}", ctx.out.display()))?;
    let chart_svg = ctx.out.join("hitratio.svg");
    let chart_png = ctx.out.join("hitratio.png");
    let mut report = HitReport {
        trace: path,
        requests: trace.len(),
        distinct_blocks: distinct,
        block_refs: refs,
        ceiling,
        budgets,
        cells,
        chart_svg: chart_svg.clone(),
        chart_png: chart_png.clone(),
    };
    draw(&report, SVGBackend::new(&chart_svg, (900, 560)).into_drawing_area())
        .with_context(|| format!("drawing {}", chart_svg.display()))?;
    draw(&report, BitMapBackend::new(&chart_png, (900, 560)).into_drawing_area())
        .with_context(|| format!("drawing {}", chart_png.display()))?;
    report.trace = report.trace.canonicalize().unwrap_or(report.trace);
    Ok(report)
}

/// `--trace`, else where the simulator looks (`$GRANARY_MOONCAKE_TRACE`,
/// beside the repository), else `shared/data/mooncake/...` under any
/// ancestor of the current directory or of this executable (a worktree may
/// sit a few levels below `shared/`'s parent).
fn locate(ctx: &Ctx) -> Result<PathBuf> {
    if let Some(p) = &ctx.trace {
        return Ok(p.clone());
    }
    if let Ok(p) = sim::locate_mooncake_trace() {
        return Ok(p);
    }
    let starts = [std::env::current_dir().ok(), std::env::current_exe().ok()];
    starts
        .into_iter()
        .flatten()
        .flat_map(|s| s.ancestors().map(|a| a.join(TRACE)).collect::<Vec<_>>())
        .find(|p| p.is_file())
        .ok_or_else(|| Unavailable(format!("no {TRACE} found (set {} or pass --trace)", sim::TRACE_ENV)).into())
}

fn draw<DB: DrawingBackend>(r: &HitReport, area: DrawingArea<DB, plotters::coord::Shift>) -> Result<()>
where
    DB::ErrorType: 'static,
{
    area.fill(&WHITE).map_err(|e| anyhow::anyhow!("{e}"))?;
    let pct = |x: f64| x * 100.0;
    // The budgets follow a 1-2-5 series, so evenly spaced positions are a
    // log scale that keeps one labelled tick per measured budget.
    let n = r.budgets.len();
    let budgets = r.budgets.clone();
    let label = move |x: &f64| {
        let i = x.round();
        if (x - i).abs() < 1e-6 && i >= 0.0 && (i as usize) < budgets.len() {
            format!("{:.0}%", budgets[i as usize] * 100.0)
        } else {
            String::new()
        }
    };
    let ymax = (r.cells.iter().map(|c| c.hit_ratio).fold(r.ceiling, f64::max) * 100.0 * 1.15).max(1.0);
    let x_span = -0.25..(n as f64 - 0.75);
    let mut chart = ChartBuilder::on(&area)
        .caption(
            format!("Mooncake conversation trace: block hit ratio vs memory budget ({} requests)", r.requests),
            ("sans-serif", 20),
        )
        .margin(16)
        .x_label_area_size(44)
        .y_label_area_size(56)
        .build_cartesian_2d(x_span.clone(), 0.0..ymax)
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    chart
        .configure_mesh()
        .x_labels(n)
        .x_desc(format!("memory budget, % of {} distinct blocks (log-spaced)", r.distinct_blocks))
        .y_desc("block hit ratio, %")
        .x_label_formatter(&label)
        .y_label_formatter(&|y| format!("{y:.0}%"))
        .light_line_style(RGBColor(240, 240, 240))
        .draw()
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    let ceiling = pct(r.ceiling);
    chart
        .draw_series(DashedLineSeries::new(
            [(x_span.start, ceiling), (x_span.end, ceiling)],
            10,
            6,
            ShapeStyle { color: BLACK.to_rgba(), filled: false, stroke_width: 2 },
        ))
        .map_err(|e| anyhow::anyhow!("{e}"))?
        .label(format!("unbounded ceiling {ceiling:.2}%"))
        .legend(|(x, y)| PathElement::new([(x, y), (x + 20, y)], BLACK.stroke_width(2)));
    let colors = [
        RGBColor(214, 39, 40),
        RGBColor(44, 160, 44),
        RGBColor(255, 127, 14),
        RGBColor(31, 119, 180),
        RGBColor(148, 103, 189),
    ];
    for (i, policy) in PolicyKind::ALL.into_iter().enumerate() {
        let color = colors[i % colors.len()].to_rgba();
        let points: Vec<(f64, f64)> = r
            .cells
            .iter()
            .filter(|c| c.policy == policy)
            .enumerate()
            .map(|(j, c)| (j as f64, pct(c.hit_ratio)))
            .collect();
        chart
            .draw_series(LineSeries::new(points.iter().copied(), color.stroke_width(2)).point_size(3))
            .map_err(|e| anyhow::anyhow!("{e}"))?
            .label(policy.as_str())
            .legend(line_key(color));
    }
    legend(&mut chart, SeriesLabelPosition::LowerRight)?;
    area.present().map_err(|e| anyhow::anyhow!("{e}"))?;
    Ok(())
}

pub fn tables(r: &HitReport) -> Vec<Table> {
    let head: Vec<String> = std::iter::once("policy".to_string())
        .chain(r.budgets.iter().map(|b| format!("{:.0}%", b * 100.0)))
        .chain(std::iter::once("ceiling".to_string()))
        .collect();
    let head: Vec<&str> = head.iter().map(String::as_str).collect();
    let caps: Vec<String> = std::iter::once("(blocks)".to_string())
        .chain(r.budgets.iter().map(|&b| sim::capacity_for(r.distinct_blocks, b).to_string()))
        .chain(std::iter::once("unbounded".to_string()))
        .collect();
    let name = r.trace.file_name().map_or_else(String::new, |f| f.to_string_lossy().into_owned());
    let mut t = Table::new(
        format!(
            "hitratio: block hit ratio (share of the ceiling) replaying {name}: {} requests, {} block refs, \
             {} distinct blocks; budgets in % of distinct blocks",
            r.requests, r.block_refs, r.distinct_blocks
        ),
        &head,
    );
    let mut prefix = Table::new("hitratio: prefix hit ratio (hits before each request's first miss)", &head);
    t.row(caps.clone());
    prefix.row(caps);
    for policy in PolicyKind::ALL {
        let cells: Vec<&Cell> = r.cells.iter().filter(|c| c.policy == policy).collect();
        let mut row = vec![policy.to_string()];
        row.extend(cells.iter().map(|c| format!("{:.2}% ({:.0}%)", c.hit_ratio * 100.0, c.of_ceiling * 100.0)));
        row.push(format!("{:.2}%", r.ceiling * 100.0));
        t.row(row);
        let mut row = vec![policy.to_string()];
        row.extend(cells.iter().map(|c| format!("{:.2}%", c.prefix_hit_ratio * 100.0)));
        row.push(format!("{:.2}%", r.ceiling * 100.0));
        prefix.row(row);
    }
    vec![t, prefix]
}

/// No numeric goal: the anchor is the ceiling itself, shown beside every cell.
pub fn goals(_r: &HitReport) -> Vec<Goal> {
    Vec::new()
}

pub fn notes(r: &HitReport) -> Vec<String> {
    vec![format!("Chart: {} and {}", r.chart_svg.display(), r.chart_png.display())]
}

//! `hitratio`: what each eviction policy keeps of the reuse in a real trace.
//!
//! Replays the Mooncake conversation trace (requests as lists of block ids,
//! each block 512 tokens) through every memory-tier policy at budgets from
//! 1% to 50% of the trace's distinct blocks, with the warehouse's trace
//! simulator. The anchor is the trace's ceiling: the hit ratio of a cache
//! that never evicts (every repeat reference hits). Writes a line chart,
//! hit ratio against budget with one line per policy and the ceiling
//! dashed, as SVG and PNG into the output directory.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use granary_warehouse::PolicyKind;
use plotters::prelude::*;
use serde::Serialize;

use super::report::{bar, Goal, Table};
use super::{Ctx, Unavailable};

const TRACE: &str = "shared/data/mooncake/conversation_trace.jsonl";
const BUDGETS: [f64; 6] = [0.01, 0.02, 0.05, 0.10, 0.20, 0.50];
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
    let path = match &ctx.trace {
        Some(p) => p.clone(),
        None => find_trace().ok_or_else(|| {
            Unavailable(format!("no {TRACE} found above the current directory or the executable; pass --trace"))
        })?,
    };
    let trace = sim_api::load(&path).with_context(|| format!("loading {}", path.display()))?;
    let ceiling = sim_api::ceiling(&trace);
    let budgets: Vec<f64> = if ctx.quick { QUICK_BUDGETS.to_vec() } else { BUDGETS.to_vec() };
    let pb = bar((PolicyKind::ALL.len() * budgets.len()) as u64, "hitratio");
    let mut cells = Vec::new();
    for policy in PolicyKind::ALL {
        for &share in &budgets {
            pb.set_message(format!("{policy} at {:.0}%", share * 100.0));
            let capacity_blocks = ((trace.distinct as f64 * share).round() as u64).max(1);
            let (hits, refs, hit_ratio) = sim_api::replay(&trace, policy, capacity_blocks);
            cells.push(Cell {
                policy,
                budget_share: share,
                capacity_blocks,
                hits,
                refs,
                hit_ratio,
                of_ceiling: if ceiling > 0.0 { hit_ratio / ceiling } else { 0.0 },
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
        requests: trace.requests,
        distinct_blocks: trace.distinct,
        block_refs: trace.refs,
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

/// `shared/data/mooncake/...` under any ancestor of the current directory
/// or of this executable (the repository's checkout sits below `shared/`'s
/// parent, possibly a few levels down as a worktree).
fn find_trace() -> Option<PathBuf> {
    let starts = [std::env::current_dir().ok(), std::env::current_exe().ok()];
    starts
        .into_iter()
        .flatten()
        .flat_map(|s| s.ancestors().map(|a| a.join(TRACE)).collect::<Vec<_>>())
        .find(|p| p.is_file())
}

fn draw<DB: DrawingBackend>(r: &HitReport, area: DrawingArea<DB, plotters::coord::Shift>) -> Result<()>
where
    DB::ErrorType: 'static,
{
    area.fill(&WHITE).map_err(|e| anyhow::anyhow!("{e}"))?;
    let pct = |x: f64| x * 100.0;
    let lo = r.budgets.iter().copied().fold(f64::INFINITY, f64::min);
    let hi = r.budgets.iter().copied().fold(0.0, f64::max);
    let ymax = (r.cells.iter().map(|c| c.hit_ratio).fold(r.ceiling, f64::max) * 100.0 * 1.15).max(1.0);
    let mut chart = ChartBuilder::on(&area)
        .caption(
            format!("Mooncake conversation trace: hit ratio vs memory budget ({} requests)", r.requests),
            ("sans-serif", 20),
        )
        .margin(16)
        .x_label_area_size(44)
        .y_label_area_size(56)
        .build_cartesian_2d((pct(lo) * 0.9..pct(hi) * 1.1).log_scale(), 0.0..ymax)
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    chart
        .configure_mesh()
        .x_desc(format!("memory budget, % of {} distinct blocks (log scale)", r.distinct_blocks))
        .y_desc("block hit ratio, %")
        .x_label_formatter(&|x| format!("{x:.0}%"))
        .y_label_formatter(&|y| format!("{y:.0}%"))
        .draw()
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    let x_span = [pct(lo) * 0.9, pct(hi) * 1.1];
    let ceiling = pct(r.ceiling);
    chart
        .draw_series(DashedLineSeries::new(
            x_span.iter().map(|&x| (x, ceiling)),
            10,
            6,
            ShapeStyle { color: BLACK.to_rgba(), filled: false, stroke_width: 2 },
        ))
        .map_err(|e| anyhow::anyhow!("{e}"))?
        .label(format!("unbounded ceiling {ceiling:.2}%"))
        .legend(|(x, y)| PathElement::new([(x, y), (x + 20, y)], BLACK.stroke_width(2)));
    for (i, policy) in PolicyKind::ALL.into_iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        let points: Vec<(f64, f64)> =
            r.cells.iter().filter(|c| c.policy == policy).map(|c| (pct(c.budget_share), pct(c.hit_ratio))).collect();
        chart
            .draw_series(LineSeries::new(points.iter().copied(), color.stroke_width(2)).point_size(3))
            .map_err(|e| anyhow::anyhow!("{e}"))?
            .label(policy.as_str())
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 20, y)], color.stroke_width(2)));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(|e| anyhow::anyhow!("{e}"))?;
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
        .chain(r.budgets.iter().map(|&b| ((r.distinct_blocks as f64 * b).round() as u64).max(1).to_string()))
        .chain(std::iter::once("unbounded".to_string()))
        .collect();
    let mut t = Table::new(
        format!(
            "hitratio: block hit ratio replaying {} ({} requests, {} block refs, {} distinct blocks) at memory budgets in % of distinct blocks",
            r.trace.file_name().map_or_else(String::new, |f| f.to_string_lossy().into_owned()),
            r.requests,
            r.block_refs,
            r.distinct_blocks
        ),
        &head,
    );
    let mut share = Table::new("hitratio: share of the ceiling reached", &head);
    t.row(caps.clone());
    share.row(caps);
    for policy in PolicyKind::ALL {
        let cells: Vec<&Cell> = r.cells.iter().filter(|c| c.policy == policy).collect();
        let mut row = vec![policy.to_string()];
        row.extend(cells.iter().map(|c| format!("{:.2}%", c.hit_ratio * 100.0)));
        row.push(format!("{:.2}%", r.ceiling * 100.0));
        t.row(row);
        let mut row = vec![policy.to_string()];
        row.extend(cells.iter().map(|c| format!("{:.0}%", c.of_ceiling * 100.0)));
        row.push("100%".into());
        share.row(row);
    }
    vec![t, share]
}

/// No numeric goal: the anchor is the ceiling itself, shown beside every cell.
pub fn goals(_r: &HitReport) -> Vec<Goal> {
    Vec::new()
}

pub fn notes(r: &HitReport) -> Vec<String> {
    vec![format!("Chart: {} and {}", r.chart_svg.display(), r.chart_png.display())]
}

/// The warehouse's trace simulator, behind the three calls this part needs.
mod sim_api {
    use super::*;

    pub struct Trace {
        pub requests: usize,
        pub distinct: u64,
        pub refs: u64,
    }

    pub fn load(_path: &Path) -> Result<Trace> {
        Err(Unavailable("the warehouse's trace simulator is not in this build".into()).into())
    }

    pub fn ceiling(_t: &Trace) -> f64 {
        0.0
    }

    pub fn replay(_t: &Trace, _policy: PolicyKind, _capacity_blocks: u64) -> (u64, u64, f64) {
        (0, 0, 0.0)
    }
}

//! A cold-start run's figures: the breakdown of each start, the tables and
//! the stacked chart.

use std::path::PathBuf;

use crate::bench::plot::{bar_key, legend};
use anyhow::Result;
use plotters::prelude::*;
use serde::Serialize;

use super::super::llm::median;
use super::super::warehouse::report::{Host, Table};
use super::TierName;

/// The breakdown of one cold start, in ms.
#[derive(Debug, Clone, Default, Serialize)]
pub(super) struct Run {
    pub(super) tier: String,
    /// Client: request sent → first content chunk.
    pub(super) ttft_ms: f64,
    /// Client: the same request again on the loaded model.
    pub(super) warm_ttft_ms: f64,
    /// Agent: the whole load, its download, and engine process start → healthy.
    pub(super) load_ms: f64,
    pub(super) fetch_ms: f64,
    pub(super) engine_ms: f64,
    /// Engine: its load (weights read incl. header, conversion, tokenizer),
    /// and process start → serving.
    pub(super) read_ms: f64,
    pub(super) convert_ms: f64,
    pub(super) tokenizer_ms: f64,
    pub(super) before_load_ms: f64,
    pub(super) ready_ms: f64,
    pub(super) weights_bytes: u64,
    pub(super) loader: String,
    /// What became of the engine's converted-weight checkpoint (`loaded`, `missing`, ...).
    pub(super) checkpoint: String,
}

impl Run {
    /// The stacked parts, each at least 0, summing to `ttft_ms` (the last
    /// takes what the others do not explain).
    pub(super) fn parts(&self) -> [f64; PARTS.len()] {
        let agent_other = (self.load_ms - self.fetch_ms - self.engine_ms).max(0.0);
        let engine_other = (self.ready_ms - self.read_ms - self.convert_ms).max(0.0);
        let health = (self.engine_ms - self.ready_ms).max(0.0);
        let request = (self.ttft_ms - self.load_ms).max(0.0);
        [self.fetch_ms, agent_other, self.read_ms, self.convert_ms, engine_other, health, request]
    }
}

pub(super) const PARTS: [(&str, RGBColor); 7] = [
    ("download from the registry", RGBColor(148, 103, 189)),
    ("agent: lookup, promotion, links", RGBColor(140, 86, 75)),
    ("engine: weights read", RGBColor(31, 119, 180)),
    ("engine: conversion (dequantize, int8)", RGBColor(255, 127, 14)),
    ("engine: process start, tokenizer, listen", RGBColor(127, 127, 127)),
    ("agent: health check seen", RGBColor(188, 189, 34)),
    ("routing, prefill, first token", RGBColor(44, 160, 44)),
];

#[derive(Debug, Clone, Serialize)]
pub(super) struct TierResult {
    pub(super) tier: TierName,
    pub(super) runs: Vec<Run>,
    /// Medians of each field, and of each stacked part.
    pub(super) median: Run,
    pub(super) median_parts: Vec<f64>,
}

#[derive(Serialize)]
pub(super) struct Report {
    pub(super) run_with: String,
    pub(super) date: String,
    pub(super) host: Host,
    pub(super) release_build: bool,
    pub(super) quick: bool,
    pub(super) gateway: bool,
    pub(super) model_path: PathBuf,
    pub(super) model_bytes: u64,
    pub(super) ram_dir: PathBuf,
    pub(super) ram_dir_is_tmpfs: bool,
    pub(super) health_interval: String,
    pub(super) parts: Vec<&'static str>,
    pub(super) tiers: Vec<TierResult>,
}

pub(super) fn median_of(v: &[f64]) -> f64 {
    median(v)
}

pub(super) fn median_run(tier: TierName, runs: &[Run]) -> Run {
    let m = |f: fn(&Run) -> f64| median(&runs.iter().map(f).collect::<Vec<_>>());
    Run {
        tier: tier.name().into(),
        ttft_ms: m(|r| r.ttft_ms),
        warm_ttft_ms: m(|r| r.warm_ttft_ms),
        load_ms: m(|r| r.load_ms),
        fetch_ms: m(|r| r.fetch_ms),
        engine_ms: m(|r| r.engine_ms),
        read_ms: m(|r| r.read_ms),
        convert_ms: m(|r| r.convert_ms),
        tokenizer_ms: m(|r| r.tokenizer_ms),
        before_load_ms: m(|r| r.before_load_ms),
        ready_ms: m(|r| r.ready_ms),
        weights_bytes: runs.first().map_or(0, |r| r.weights_bytes),
        loader: runs.first().map_or_else(String::new, |r| r.loader.clone()),
        checkpoint: runs.first().map_or_else(String::new, |r| r.checkpoint.clone()),
    }
}

pub(super) fn tables(r: &Report) -> Vec<Table> {
    let n = r.tiers.first().map_or(0, |t| t.runs.len());
    let mut t = Table::new(
        format!(
            "coldstart: request → first token for an unloaded model, ms (median of {n}); {} MB GGUF; {}",
            (r.model_bytes as f64 / 1e6).round(),
            if r.gateway { "through the gateway (load on demand)" } else { "agent load, then the engine" }
        ),
        &[
            "tier",
            "first token",
            "load (agent)",
            "download",
            "engine start→healthy",
            "weights from",
            "weights read",
            "read GB/s",
            "conversion",
            "engine ready",
            "warm first token",
        ],
    );
    for tr in &r.tiers {
        let m = &tr.median;
        t.row(vec![
            tr.tier.name().into(),
            format!("{:.0}", m.ttft_ms),
            format!("{:.0}", m.load_ms),
            format!("{:.0}", m.fetch_ms),
            format!("{:.0}", m.engine_ms),
            m.loader.clone(),
            format!("{:.1}", m.read_ms),
            format!("{:.2}", m.weights_bytes as f64 / (m.read_ms / 1e3).max(1e-9) / 1e9),
            format!("{:.0}", m.convert_ms),
            format!("{:.0}", m.ready_ms),
            format!("{:.0}", m.warm_ttft_ms),
        ]);
    }
    let mut parts = Table::new(
        "coldstart: where the time went, ms (medians of each part; they add up to about the median first token)",
        &["tier"].into_iter().chain(PARTS.iter().map(|p| p.0)).collect::<Vec<_>>(),
    );
    for tr in &r.tiers {
        let mut row = vec![tr.tier.name().to_string()];
        row.extend(tr.median_parts.iter().map(|v| format!("{v:.0}")));
        parts.row(row);
    }
    vec![t, parts]
}

pub(super) fn draw<DB: DrawingBackend>(r: &Report, area: DrawingArea<DB, plotters::coord::Shift>) -> Result<()>
where
    DB::ErrorType: 'static,
{
    let e = |e: DrawingAreaErrorKind<DB::ErrorType>| anyhow::anyhow!("{e}");
    area.fill(&WHITE).map_err(e)?;
    let n = r.tiers.len();
    let top = r.tiers.iter().map(|t| t.median_parts.iter().sum::<f64>()).fold(1.0, f64::max) * 1.45;
    let labels: Vec<String> = r.tiers.iter().map(|t| t.tier.name().to_string()).collect();
    let mut chart = ChartBuilder::on(&area)
        .caption(
            format!(
                "Cold start: request → first token, by where the weights are ({})",
                if r.gateway { "through the gateway" } else { "no gateway" }
            ),
            ("sans-serif", 20),
        )
        .margin(16)
        .x_label_area_size(40)
        .y_label_area_size(64)
        .build_cartesian_2d(0.0..n as f64, 0.0..top)
        .map_err(e)?;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(n * 2 + 1)
        .x_label_formatter(&|x| {
            let i = x.floor() as usize;
            if i < labels.len() && (x - (i as f64 + 0.5)).abs() < 0.05 {
                labels[i].clone()
            } else {
                String::new()
            }
        })
        .y_desc("ms (median of each part)")
        .y_label_formatter(&|y| format!("{y:.0}"))
        .light_line_style(RGBColor(240, 240, 240))
        .draw()
        .map_err(e)?;
    for (k, (name, color)) in PARTS.iter().enumerate() {
        let color = *color;
        let bars: Vec<Rectangle<(f64, f64)>> = r
            .tiers
            .iter()
            .enumerate()
            .map(|(i, t)| {
                let below: f64 = t.median_parts[..k].iter().sum();
                let v = t.median_parts[k];
                Rectangle::new([(i as f64 + 0.2, below), (i as f64 + 0.8, below + v)], color.filled())
            })
            .collect();
        chart.draw_series(bars).map_err(e)?.label(*name).legend(bar_key(color));
    }
    legend(&mut chart, SeriesLabelPosition::UpperRight)?;
    area.present().map_err(e)?;
    Ok(())
}

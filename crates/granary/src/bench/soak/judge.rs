//! The soak's arithmetic: percentiles of a window, the least-squares slope
//! of a series, and the goals judged from the samples.

use super::super::warehouse::report::Goal;
use super::{ProcSample, Sample};

/// RSS may grow by less than this share of its mean per 10 minutes.
pub const RSS_SLOPE_GOAL: f64 = 0.01;
/// The last window's p99 TTFT within this share of the first post-warm-up window's.
pub const P99_DRIFT_GOAL: f64 = 0.20;

/// The `q` quantile (0..=1) of `xs` by nearest rank; `None` when empty.
pub fn percentile(xs: &[f64], q: f64) -> Option<f64> {
    if xs.is_empty() {
        return None;
    }
    let mut v = xs.to_vec();
    v.sort_by(f64::total_cmp);
    let rank = (q.clamp(0.0, 1.0) * v.len() as f64).ceil() as usize;
    Some(v[rank.clamp(1, v.len()) - 1])
}

/// The least-squares slope of `y` over `x`; `None` with fewer than two
/// distinct x.
pub fn slope(points: &[(f64, f64)]) -> Option<f64> {
    let n = points.len() as f64;
    if points.len() < 2 {
        return None;
    }
    let mx = points.iter().map(|p| p.0).sum::<f64>() / n;
    let my = points.iter().map(|p| p.1).sum::<f64>() / n;
    let sxx: f64 = points.iter().map(|p| (p.0 - mx).powi(2)).sum();
    if sxx == 0.0 {
        return None;
    }
    let sxy: f64 = points.iter().map(|p| (p.0 - mx) * (p.1 - my)).sum();
    Some(sxy / sxx)
}

/// Growth of a series as a share of its mean per 10 minutes, from the
/// least-squares slope over (seconds, value) points.
pub fn growth_per_10min(points: &[(f64, f64)]) -> Option<f64> {
    let mean = points.iter().map(|p| p.1).sum::<f64>() / points.len().max(1) as f64;
    if mean <= 0.0 {
        return None;
    }
    slope(points).map(|s| s * 600.0 / mean)
}

/// Warm-up windows skipped by the judging: a fifth of them, at least one
/// (none when there are fewer than three windows).
pub fn warmup_windows(n: usize) -> usize {
    if n < 3 {
        0
    } else {
        n.div_ceil(5).max(1)
    }
}

/// The goals of issue 17's soak, judged on `samples` after `warmup` windows.
pub fn goals(samples: &[Sample], errors: u64, requests: u64, warmup: usize) -> Vec<Goal> {
    let mut out = vec![Goal::new("soak", "0 errors", errors == 0, format!("{errors} errors in {requests} requests"))];
    let after = samples.get(warmup..).unwrap_or(&[]);
    let goal = format!("RSS slope after warm-up ({warmup} window(s)) under 1% per 10 min, every process");
    let mut pids: Vec<(u32, String)> =
        after.iter().flat_map(|s| s.procs.iter().map(|p| (p.pid, p.name.clone()))).collect();
    pids.sort();
    pids.dedup();
    if pids.is_empty() || after.len() < 2 {
        out.push(Goal::unmeasured("soak", goal, "fewer than two post-warm-up samples with a process"));
    } else {
        let mut figures = Vec::new();
        let mut pass = true;
        for (pid, name) in &pids {
            let pts: Vec<(f64, f64)> = after
                .iter()
                .filter_map(|s| {
                    s.procs.iter().find(|p| p.pid == *pid).map(|p: &ProcSample| (s.t_s, p.rss_bytes as f64))
                })
                .collect();
            match growth_per_10min(&pts) {
                Some(g) => {
                    pass &= g < RSS_SLOPE_GOAL;
                    figures.push(format!("{name}[{pid}] {:+.2}%", g * 100.0));
                }
                None => {
                    pass = false;
                    figures.push(format!("{name}[{pid}] not measured ({} sample(s))", pts.len()));
                }
            }
        }
        out.push(Goal::new("soak", goal, pass, figures.join(", ")));
    }
    let goal = "p99 TTFT of the last window within 20% of the first post-warm-up window";
    let first = after.iter().find_map(|s| s.ttft_p99_ms);
    let last = after.last().and_then(|s| s.ttft_p99_ms);
    match (first, last) {
        (Some(f), Some(l)) if f > 0.0 => {
            let drift = l / f - 1.0;
            out.push(Goal::new(
                "soak",
                goal,
                drift.abs() <= P99_DRIFT_GOAL,
                format!("{f:.1} ms -> {l:.1} ms ({:+.1}%)", drift * 100.0),
            ));
        }
        _ => out.push(Goal::unmeasured("soak", goal, "a window without answered requests")),
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(t: f64, rss: u64, p99: f64) -> Sample {
        Sample {
            t_s: t,
            ttft_p99_ms: Some(p99),
            procs: vec![ProcSample { pid: 7, name: "granary".into(), rss_bytes: rss, fds: 20 }],
            ..Default::default()
        }
    }

    #[test]
    fn percentiles_by_nearest_rank() {
        let xs: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&xs, 0.5), Some(50.0));
        assert_eq!(percentile(&xs, 0.99), Some(99.0));
        assert_eq!(percentile(&[3.0], 0.99), Some(3.0));
        assert_eq!(percentile(&[], 0.5), None);
    }

    #[test]
    fn slopes_by_least_squares() {
        assert_eq!(slope(&[(0.0, 1.0), (1.0, 3.0), (2.0, 5.0)]), Some(2.0));
        assert_eq!(slope(&[(0.0, 1.0)]), None);
        assert_eq!(slope(&[(1.0, 1.0), (1.0, 2.0)]), None);
        // 1 MB/min on 100 MB: 10% per 10 minutes.
        let pts: Vec<(f64, f64)> = (0..6).map(|i| (60.0 * f64::from(i), 100e6 + 1e6 * f64::from(i))).collect();
        let g = growth_per_10min(&pts).unwrap();
        assert!((g - 10.0 / 102.5).abs() < 1e-9, "{g}");
    }

    #[test]
    fn growing_rss_misses_and_flat_rss_passes() {
        let growing: Vec<Sample> =
            (0..8).map(|i| sample(f64::from(i) * 60.0, 100_000_000 + i as u64 * 2_000_000, 50.0)).collect();
        let g = goals(&growing, 0, 40, 2);
        assert!(g[0].pass, "{:?}", g[0]);
        assert!(!g[1].pass, "growing RSS judged {:?}", g[1]);
        assert!(g[2].pass);

        // Flat with noise either way: passes.
        let flat: Vec<Sample> = (0..8)
            .map(|i| sample(f64::from(i) * 60.0, 100_000_000 + if i % 2 == 0 { 50_000 } else { 0 }, 50.0))
            .collect();
        let g = goals(&flat, 0, 40, 2);
        assert!(g[1].pass, "flat RSS judged {:?}", g[1]);
        // Errors and a p99 that doubled: both missed.
        let mut drifting = flat.clone();
        drifting.last_mut().unwrap().ttft_p99_ms = Some(100.0);
        let g = goals(&drifting, 3, 40, 2);
        assert!(!g[0].pass && g[0].figures.starts_with("3 errors"));
        assert!(!g[2].pass, "{:?}", g[2]);
        assert!(g[2].figures.contains("+100.0%"), "{}", g[2].figures);
    }

    #[test]
    fn warm_up_skips_a_fifth() {
        assert_eq!(warmup_windows(2), 0);
        assert_eq!(warmup_windows(6), 2);
        assert_eq!(warmup_windows(10), 2);
        assert_eq!(warmup_windows(60), 12);
    }

    #[test]
    fn too_few_samples_are_unmeasured() {
        let g = goals(&[sample(60.0, 1, 5.0)], 0, 1, 0);
        assert!(!g[1].pass && g[1].figures.starts_with("not measured"));
    }
}

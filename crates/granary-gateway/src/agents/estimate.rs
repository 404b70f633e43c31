//! How long a load of a model on an agent would take to give its first
//! token, estimated ServerlessLLM-style from what the agent reports:
//!
//! ```text
//! fetch    bytes to download / the node's download rate   (weights in no tier)
//! read     bytes to read / the rate of the tier they are in
//!          (the checkpoint's bytes and tier when it has one, else the weights')
//! convert  the model's conversion as last measured there  (0 with a checkpoint)
//! start    the node's fixed start cost (process, tokenizer, health poll)
//! queue    what the loads already under way there have left
//! ```
//!
//! A rate or cost an agent has not measured yet (no load there yet) is
//! taken from the other agents (the median of theirs: the nodes of a fleet
//! are mostly alike, and a guess far from theirs would make a new node
//! look better or worse than it is), else from the defaults below; a
//! conversion not measured there takes one measured for the model on
//! another agent, else the default rate. The load goes to the agent with
//! the lowest total, and the placement header shows each term.

use std::time::Instant;

use serde::{Deserialize, Serialize};

/// Bytes per second read from a RAM tier (tmpfs), until measured.
pub const DEFAULT_RAM_BPS: f64 = 2e9;
/// Bytes per second read from local disk, until measured.
pub const DEFAULT_DISK_BPS: f64 = 5e8;
/// Bytes per second downloaded from the registry, until measured.
pub const DEFAULT_DOWNLOAD_BPS: f64 = 1e8;
/// Bytes of weights converted per second, until a conversion is measured
/// (the embedded engine converts SmolLM2-135M's 100 MB in about 1.5 s on a
/// 2-core host).
pub const DEFAULT_CONVERT_BPS: f64 = 7e7;
/// An engine start's fixed cost, ms, until measured.
pub const DEFAULT_START_MS: f64 = 200.0;

/// What an agent says of its load speed (`load_profile` in heartbeats).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LoadProfileReport {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ram_read_bps: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub disk_read_bps: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub download_bps: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub start_ms: Option<u64>,
}

impl LoadProfileReport {
    /// Each figure this one lacks, from `other`.
    pub fn or(&self, other: &LoadProfileReport) -> LoadProfileReport {
        LoadProfileReport {
            ram_read_bps: self.ram_read_bps.or(other.ram_read_bps),
            disk_read_bps: self.disk_read_bps.or(other.disk_read_bps),
            download_bps: self.download_bps.or(other.download_bps),
            start_ms: self.start_ms.or(other.start_ms),
        }
    }

    /// Per figure, the median of those `profiles` report.
    pub fn median<'a>(profiles: impl Iterator<Item = &'a LoadProfileReport> + Clone) -> LoadProfileReport {
        fn med(mut v: Vec<u64>) -> Option<u64> {
            v.sort_unstable();
            v.get(v.len() / 2).copied()
        }
        let field = |f: fn(&LoadProfileReport) -> Option<u64>| med(profiles.clone().filter_map(f).collect());
        LoadProfileReport {
            ram_read_bps: field(|p| p.ram_read_bps),
            disk_read_bps: field(|p| p.disk_read_bps),
            download_bps: field(|p| p.download_bps),
            start_ms: field(|p| p.start_ms),
        }
    }

    /// Bytes per second read from tier `t` (0 RAM, else disk).
    fn read_bps(&self, t: u8) -> f64 {
        let (measured, default) =
            if t == 0 { (self.ram_read_bps, DEFAULT_RAM_BPS) } else { (self.disk_read_bps, DEFAULT_DISK_BPS) };
        measured.filter(|&b| b > 0).map_or(default, |b| b as f64)
    }
}

/// What an agent holds of one model, for the estimate.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(super) struct Held {
    /// 0 RAM, 1 disk, 2 none.
    pub tier: u8,
    pub bytes: u64,
    /// The checkpoint's tier (0 RAM, 1 disk), if there is one.
    pub checkpoint: Option<u8>,
    pub checkpoint_bytes: u64,
    /// The conversion (or start work) measured there, ms.
    pub convert_ms: Option<u64>,
}

impl Held {
    /// Closer first: the tier, then a checkpoint.
    pub(super) fn better_than(&self, other: &Held) -> bool {
        (self.tier, self.checkpoint.is_none()) < (other.tier, other.checkpoint.is_none())
    }
}

/// The estimated time to first token of one load, ms per term.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Estimate {
    pub fetch: f64,
    pub read: f64,
    pub convert: f64,
    pub start: f64,
    pub queue: f64,
}

impl Estimate {
    pub fn total(&self) -> f64 {
        self.fetch + self.read + self.convert + self.start + self.queue
    }

    /// Without the queue: what one load there takes.
    pub fn alone(&self) -> f64 {
        self.total() - self.queue
    }

    /// `est. 410 ms: fetch 0 + read 200 + convert 0 + start 210 + queue 0`.
    pub fn describe(&self) -> String {
        format!(
            "est. {:.0} ms: fetch {:.0} + read {:.0} + convert {:.0} + start {:.0} + queue {:.0}",
            self.total(),
            self.fetch,
            self.read,
            self.convert,
            self.start,
            self.queue
        )
    }
}

/// The estimate for a load on an agent holding `held` of the model (None:
/// nothing laid out), reporting `profile`. `model_bytes` is the model's size
/// when this agent does not know it; `fleet_convert_ms` a conversion of it
/// measured elsewhere; `queue_ms` what loads under way there have left.
pub(super) fn estimate(
    held: Option<&Held>,
    profile: &LoadProfileReport,
    model_bytes: u64,
    fleet_convert_ms: Option<u64>,
    queue_ms: f64,
) -> Estimate {
    let h = held.copied().unwrap_or(Held { tier: 2, ..Default::default() });
    let bytes = if h.bytes > 0 { h.bytes } else { model_bytes } as f64;
    let ms = |bytes: f64, bps: f64| bytes / bps * 1e3;
    let fetch = if h.tier >= 2 {
        ms(bytes, profile.download_bps.filter(|&b| b > 0).map_or(DEFAULT_DOWNLOAD_BPS, |b| b as f64))
    } else {
        0.0
    };
    let (read, convert) = match h.checkpoint {
        Some(t) if h.tier < 2 && h.checkpoint_bytes > 0 => (ms(h.checkpoint_bytes as f64, profile.read_bps(t)), 0.0),
        _ => {
            // Just downloaded weights are read from disk.
            let read = ms(bytes, profile.read_bps(h.tier.min(1)));
            let convert = h.convert_ms.or(fleet_convert_ms).map_or(ms(bytes, DEFAULT_CONVERT_BPS), |c| c as f64);
            (read, convert)
        }
    };
    let start = profile.start_ms.map_or(DEFAULT_START_MS, |s| s as f64);
    Estimate { fetch, read, convert, start, queue: queue_ms }
}

/// Loads this gateway has under way on one agent: when each began and its
/// estimate, ms.
#[derive(Debug, Default)]
pub(super) struct Underway(Vec<(u64, Instant, f64)>);

impl Underway {
    pub(super) fn add(&mut self, id: u64, est_ms: f64) {
        self.0.push((id, Instant::now(), est_ms));
    }

    pub(super) fn remove(&mut self, id: u64) {
        self.0.retain(|(i, _, _)| *i != id);
    }

    pub(super) fn len(&self) -> usize {
        self.0.len()
    }

    pub(super) fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// What they have left by their estimates (one past its estimate
    /// still counts a little: it is not done).
    pub(super) fn left_ms(&self, now: Instant) -> f64 {
        self.0.iter().map(|(_, at, est)| (est - now.duration_since(*at).as_secs_f64() * 1e3).max(est * 0.1)).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MB: u64 = 1_000_000;

    fn profile() -> LoadProfileReport {
        LoadProfileReport {
            ram_read_bps: Some(1_000 * MB),
            disk_read_bps: Some(500 * MB),
            download_bps: Some(100 * MB),
            start_ms: Some(100),
        }
    }

    #[test]
    fn each_term_comes_from_the_tier_the_bytes_are_in() {
        let p = profile();
        let ram = Held { tier: 0, bytes: 100 * MB, convert_ms: Some(1500), ..Default::default() };
        let e = estimate(Some(&ram), &p, 0, None, 0.0);
        assert_eq!((e.fetch, e.read, e.convert, e.start, e.queue), (0.0, 100.0, 1500.0, 100.0, 0.0));
        assert_eq!(e.describe(), "est. 1700 ms: fetch 0 + read 100 + convert 1500 + start 100 + queue 0");
        // Weights on disk with a checkpoint on disk: its bytes, no conversion.
        let disk_ck =
            Held { tier: 1, bytes: 100 * MB, checkpoint: Some(1), checkpoint_bytes: 140 * MB, convert_ms: Some(1500) };
        let e = estimate(Some(&disk_ck), &p, 0, None, 0.0);
        assert_eq!((e.read, e.convert, e.total()), (280.0, 0.0, 380.0));
        // Nowhere: download, then read from disk, converting at the rate
        // measured elsewhere (or the default).
        let e = estimate(None, &p, 100 * MB, Some(1400), 0.0);
        assert_eq!((e.fetch, e.read, e.convert), (1000.0, 200.0, 1400.0));
        let e = estimate(None, &LoadProfileReport::default(), 70 * MB, None, 250.0);
        assert_eq!((e.fetch, e.read, e.convert, e.start, e.queue), (700.0, 140.0, 1000.0, 200.0, 250.0));
        assert_eq!(e.alone(), 2040.0);
    }

    /// An agent that has measured nothing is judged by the fleet's median,
    /// figure by figure.
    #[test]
    fn unmeasured_figures_come_from_the_fleet() {
        let a = profile();
        let b = LoadProfileReport { ram_read_bps: Some(3_000 * MB), start_ms: Some(300), ..Default::default() };
        let c = LoadProfileReport { start_ms: Some(200), ..Default::default() };
        let fleet = LoadProfileReport::median([&a, &b, &c].into_iter());
        assert_eq!(fleet.ram_read_bps, Some(3_000 * MB), "the upper median of two");
        assert_eq!((fleet.disk_read_bps, fleet.start_ms), (Some(500 * MB), Some(200)));
        let new = LoadProfileReport { download_bps: Some(7), ..Default::default() }.or(&fleet);
        assert_eq!((new.download_bps, new.start_ms), (Some(7), Some(200)), "its own first");
        assert_eq!(LoadProfileReport::median(std::iter::empty()), LoadProfileReport::default());
    }

    #[test]
    fn loads_under_way_count_what_they_have_left() {
        let mut u = Underway::default();
        assert_eq!(u.left_ms(Instant::now()), 0.0);
        u.add(1, 1000.0);
        u.add(2, 500.0);
        let left = u.left_ms(Instant::now());
        assert!((1400.0..=1500.0).contains(&left), "{left}");
        u.remove(1);
        assert_eq!(u.len(), 1);
        let later = Instant::now() + std::time::Duration::from_secs(10);
        assert_eq!(u.left_ms(later), 50.0, "past its estimate: a tenth of it");
    }
}

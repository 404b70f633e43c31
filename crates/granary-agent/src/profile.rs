//! How fast this node brings a model up, learned from its own loads and
//! reported in heartbeats, so that a gateway can estimate each agent's time
//! to first token for a load (ServerlessLLM-style placement): bytes to
//! download at the measured download rate, bytes to read at the measured
//! rate of the tier they are in, the model's conversion unless a
//! checkpoint is loaded, and the engine's fixed start cost.
//!
//! Every figure comes from a load that happened here:
//! - **read rate per tier**: `granary engine` prints its load stats (bytes
//!   read, milliseconds reading, conversion) as one JSON line in its log
//!   ([`granary_core::ENGINE_LOAD_STATS_PREFIX`]); the agent reads the
//!   line of the start it made and files the rate under the tier the bytes
//!   came from (the checkpoint's tier when one was loaded);
//! - **conversion** per model revision, from the same line, when the start
//!   converted (a checkpoint load converts nothing). For an engine that
//!   prints no stats (a third-party server), the whole start beyond the
//!   read and the fixed cost counts as its model's start work;
//! - **start cost**: process start, tokenizer, health poll: the start's
//!   wall time less its read and conversion;
//! - **download rate**: the bytes of a load's downloads over their wall time.
//!
//! Rates are smoothed (each new one counts half), so a node whose disk got
//! slower is believed within a few loads. Nothing is reported before it is
//! measured: the gateway then uses its defaults. What was measured is kept
//! in `<cache_dir>/load-profile.json`, so a restarted agent still knows its
//! node (a file that cannot be read is ignored: the profile is relearned).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use parking_lot::Mutex;
use serde::{Deserialize, Serialize};

use crate::tiers::Tier;

/// The smallest transfer a rate is learned from: a few kilobytes are all
/// latency and would say nothing of bandwidth.
const MIN_SAMPLE_BYTES: u64 = 1 << 20;
const MIN_SAMPLE_MS: f64 = 1.0;

/// What a heartbeat says of this node's load speed (absent: not measured yet).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProfileReport {
    /// Bytes per second an engine read weights at from the RAM tier.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ram_read_bps: Option<u64>,
    /// Bytes per second an engine read weights at from local disk.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub disk_read_bps: Option<u64>,
    /// Bytes per second downloads from the registry ran at.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub download_bps: Option<u64>,
    /// An engine start's fixed cost here (process, tokenizer, health poll), ms.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub start_ms: Option<u64>,
}

/// The load stats of one engine start, as `granary engine` prints them.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct EngineLoadStats {
    /// Bytes of weight (or checkpoint) files read.
    pub weights_bytes: u64,
    #[serde(default)]
    pub header_ms: f64,
    pub read_ms: f64,
    pub convert_ms: f64,
    /// `loaded` when a converted-weight checkpoint was read.
    #[serde(default)]
    pub checkpoint: String,
}

impl EngineLoadStats {
    /// The last stats line in `text` (an engine log written since its start).
    pub fn find(text: &str) -> Option<EngineLoadStats> {
        text.lines()
            .rev()
            .find_map(|l| l.split_once(granary_core::ENGINE_LOAD_STATS_PREFIX))
            .and_then(|(_, json)| serde_json::from_str(json.trim()).ok())
    }

    /// Reads the stats line an engine wrote to `log` past byte `from`.
    pub fn read_log(log: &Path, from: u64) -> Option<EngineLoadStats> {
        use std::io::{Read, Seek, SeekFrom};
        let mut f = std::fs::File::open(log).ok()?;
        let len = f.metadata().ok()?.len();
        // A log rotated since `from` was taken starts again at 0.
        let from = if from > len { 0 } else { from };
        f.seek(SeekFrom::Start(from.max(len.saturating_sub(4 << 20)))).ok()?;
        let mut buf = Vec::new();
        f.read_to_end(&mut buf).ok()?;
        Self::find(&String::from_utf8_lossy(&buf))
    }

    fn loaded_checkpoint(&self) -> bool {
        self.checkpoint == "loaded"
    }
}

/// One engine start, as the agent saw it.
#[derive(Debug, Clone)]
pub struct StartSample {
    pub model: String,
    pub revision: String,
    /// The tier the weights were read from.
    pub weights_tier: Tier,
    /// The tier of the checkpoint, if the revision had one at the start.
    pub checkpoint_tier: Option<Tier>,
    /// The revision's weight bytes.
    pub weights_bytes: u64,
    /// From spawning the engine to its first healthy answer.
    pub ready: Duration,
    /// What the engine said of its load, if it says.
    pub stats: Option<EngineLoadStats>,
}

#[derive(Default, Serialize, Deserialize)]
struct Inner {
    ram_read_bps: Option<f64>,
    disk_read_bps: Option<f64>,
    download_bps: Option<f64>,
    start_ms: Option<f64>,
    /// Per `model@revision`, its conversion (or third-party start work), ms.
    convert_ms: HashMap<String, f64>,
}

fn key(model: &str, revision: &str) -> String {
    format!("{model}@{revision}")
}

/// This node's measured load speed.
#[derive(Default)]
pub struct LoadProfile {
    inner: Mutex<Inner>,
    /// Where it is kept (none: in memory only).
    path: Option<PathBuf>,
}

/// Half the old value, half the new.
fn smooth(old: &mut Option<f64>, new: f64) {
    *old = Some(old.map_or(new, |o| (o + new) / 2.0));
}

fn rate(bytes: u64, ms: f64) -> Option<f64> {
    (bytes >= MIN_SAMPLE_BYTES && ms >= MIN_SAMPLE_MS).then(|| bytes as f64 / (ms / 1e3))
}

impl LoadProfile {
    /// The profile kept at `path`, empty if there is none (or it cannot be read).
    pub fn open(path: PathBuf) -> LoadProfile {
        let inner = match std::fs::read(&path) {
            Ok(bytes) => serde_json::from_slice(&bytes).unwrap_or_else(|e| {
                tracing::warn!(path = %path.display(), error = %e, "unreadable load profile; learning it again");
                Inner::default()
            }),
            Err(_) => Inner::default(),
        };
        LoadProfile { inner: Mutex::new(inner), path: Some(path) }
    }

    /// Writes the profile through a temporary file (a failure is logged:
    /// only the next restart's knowledge is lost).
    fn save(&self, inner: &Inner) {
        let Some(path) = &self.path else { return };
        let write = || -> std::io::Result<()> {
            let tmp = path.with_extension("json.tmp");
            std::fs::write(&tmp, serde_json::to_vec_pretty(inner)?)?;
            std::fs::rename(&tmp, path)
        };
        if let Err(e) = write() {
            tracing::warn!(path = %path.display(), error = %e, "could not keep the load profile");
        }
    }

    /// A load downloaded `bytes` in `took` (all its files together).
    pub fn record_download(&self, bytes: u64, took: Duration) {
        if let Some(r) = rate(bytes, took.as_secs_f64() * 1e3) {
            let mut g = self.inner.lock();
            smooth(&mut g.download_bps, r);
            self.save(&g);
        }
    }

    /// An engine became healthy.
    pub fn record_start(&self, s: &StartSample) {
        let ready_ms = s.ready.as_secs_f64() * 1e3;
        let mut g = self.inner.lock();
        let key = key(&s.model, &s.revision);
        match &s.stats {
            Some(st) => {
                let from = match (st.loaded_checkpoint(), s.checkpoint_tier) {
                    (true, Some(t)) => t,
                    _ => s.weights_tier,
                };
                if let Some(r) = rate(st.weights_bytes, st.read_ms) {
                    match from {
                        Tier::Ram => smooth(&mut g.ram_read_bps, r),
                        // Just downloaded: on disk (and likely in the page cache).
                        Tier::Disk | Tier::Registry => smooth(&mut g.disk_read_bps, r),
                    }
                }
                if !st.loaded_checkpoint() {
                    g.convert_ms.insert(key, st.convert_ms);
                }
                smooth(&mut g.start_ms, (ready_ms - st.header_ms - st.read_ms - st.convert_ms).max(0.0));
            }
            None => {
                // An engine that says nothing of its load: what is left
                // after reading the weights (at the rate known, if any) and
                // the usual fixed cost is this model's own start work.
                let bps = match s.weights_tier {
                    Tier::Ram => g.ram_read_bps,
                    Tier::Disk | Tier::Registry => g.disk_read_bps,
                };
                let read_ms = bps.map_or(0.0, |b| s.weights_bytes as f64 / b * 1e3);
                let work = (ready_ms - read_ms - g.start_ms.unwrap_or(0.0)).max(0.0);
                g.convert_ms.insert(key, work);
            }
        }
        self.save(&g);
    }

    /// The conversion (or start work) a start of this revision took here, ms.
    pub fn convert_ms(&self, model: &str, revision: &str) -> Option<u64> {
        self.inner.lock().convert_ms.get(&key(model, revision)).map(|&v| v.round() as u64)
    }

    pub fn report(&self) -> ProfileReport {
        let g = self.inner.lock();
        let r = |v: Option<f64>| v.map(|x| x.round() as u64);
        ProfileReport {
            ram_read_bps: r(g.ram_read_bps),
            disk_read_bps: r(g.disk_read_bps),
            download_bps: r(g.download_bps),
            start_ms: r(g.start_ms),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stats(bytes: u64, read_ms: f64, convert_ms: f64, checkpoint: &str) -> EngineLoadStats {
        EngineLoadStats { weights_bytes: bytes, header_ms: 2.0, read_ms, convert_ms, checkpoint: checkpoint.into() }
    }

    fn sample(tier: Tier, ckpt: Option<Tier>, ready_ms: u64, stats: Option<EngineLoadStats>) -> StartSample {
        StartSample {
            model: "m".into(),
            revision: "r1".into(),
            weights_tier: tier,
            checkpoint_tier: ckpt,
            weights_bytes: 100 << 20,
            ready: Duration::from_millis(ready_ms),
            stats,
        }
    }

    /// The stats line is found among other log lines, the last one wins,
    /// and a log with none (a third-party engine) gives none.
    #[test]
    fn the_engines_stats_line_is_read_from_its_log() {
        let d = tempfile::tempdir().unwrap();
        let log = d.path().join("m.log");
        let line = |ms: u32| {
            format!(
                "{}{{\"loader\":\"parallel\",\"weights_bytes\":1000,\"threads\":2,\"header_ms\":1,\"read_ms\":{ms},\"convert_ms\":5,\"tokenizer_ms\":3,\"load_ms\":9,\"before_load_ms\":1,\"checkpoint\":\"loaded\"}}\n",
                granary_core::ENGINE_LOAD_STATS_PREFIX
            )
        };
        std::fs::write(&log, format!("old start\n{}", line(7))).unwrap();
        let from = std::fs::metadata(&log).unwrap().len();
        assert_eq!(EngineLoadStats::read_log(&log, from), None, "nothing written since the start");
        std::fs::write(&log, format!("old start\n{}granary: loaded m\n{}listening\n", line(7), line(8))).unwrap();
        let s = EngineLoadStats::read_log(&log, from).unwrap();
        assert_eq!((s.read_ms, s.convert_ms, s.weights_bytes), (8.0, 5.0, 1000));
        assert!(s.loaded_checkpoint());
        assert_eq!(EngineLoadStats::find("INFO llama_cpp.server listening\n"), None);
    }

    /// Reads are filed under the tier the bytes came from (a checkpoint's,
    /// when one was loaded), conversions per revision only when a start
    /// converted, and the fixed cost is what the start took beyond both.
    #[test]
    fn starts_teach_read_rates_conversion_and_fixed_cost() {
        let p = LoadProfile::default();
        assert_eq!(p.report(), ProfileReport::default(), "nothing before a load");
        // A disk start that converted: 100 MiB in 200 ms, 1500 ms converting.
        p.record_start(&sample(Tier::Disk, None, 1800, Some(stats(100 << 20, 200.0, 1500.0, "missing"))));
        let r = p.report();
        assert_eq!(r.disk_read_bps, Some((100u64 << 20) * 5));
        assert_eq!(r.ram_read_bps, None);
        assert_eq!(r.start_ms, Some(98), "1800 - 2 - 200 - 1500");
        assert_eq!(p.convert_ms("m", "r1"), Some(1500));
        // Weights on disk but the checkpoint in RAM: the read is RAM's, and
        // a checkpoint load leaves the conversion learned before.
        p.record_start(&sample(Tier::Disk, Some(Tier::Ram), 300, Some(stats(140 << 20, 100.0, 4.0, "loaded"))));
        let r = p.report();
        assert_eq!(r.ram_read_bps, Some((140u64 << 20) * 10));
        assert_eq!(r.disk_read_bps, Some((100u64 << 20) * 5), "unchanged");
        assert_eq!(r.start_ms, Some(146), "(98 + 194) / 2");
        assert_eq!(p.convert_ms("m", "r1"), Some(1500));
        // Tiny reads teach no rate.
        p.record_start(&sample(Tier::Ram, None, 50, Some(stats(4096, 0.5, 1.0, "off"))));
        assert_eq!(p.report().ram_read_bps, Some((140u64 << 20) * 10));
    }

    /// A third-party engine prints nothing: its start beyond the read (at
    /// the known rate) and the fixed cost is its model's start work.
    #[test]
    fn a_silent_engines_start_counts_as_its_models_start_work() {
        let p = LoadProfile::default();
        p.record_start(&sample(Tier::Disk, None, 1000, Some(stats(100 << 20, 200.0, 0.0, "missing"))));
        let mut s = sample(Tier::Disk, None, 5000, None);
        s.model = "llama".into();
        p.record_start(&s);
        // 5000 - 100 MiB at the disk rate (200 ms) - fixed 798 ms.
        assert_eq!(p.convert_ms("llama", "r1"), Some(4002));
        p.record_download(50 << 20, Duration::from_millis(500));
        assert_eq!(p.report().download_bps, Some((50u64 << 20) * 2));
        p.record_download(10, Duration::from_millis(500));
        assert_eq!(p.report().download_bps, Some((50u64 << 20) * 2), "a tiny download teaches nothing");
    }

    /// A restarted agent still knows its node; a damaged file is relearned.
    #[test]
    fn the_profile_survives_a_restart() {
        let d = tempfile::tempdir().unwrap();
        let path = d.path().join("load-profile.json");
        let p = LoadProfile::open(path.clone());
        p.record_start(&sample(Tier::Disk, None, 1800, Some(stats(100 << 20, 200.0, 1500.0, "missing"))));
        let before = p.report();
        let again = LoadProfile::open(path.clone());
        assert_eq!(again.report(), before);
        assert_eq!(again.convert_ms("m", "r1"), Some(1500));
        std::fs::write(&path, b"{not json").unwrap();
        assert_eq!(LoadProfile::open(path).report(), ProfileReport::default());
    }
}

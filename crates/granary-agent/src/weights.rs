//! What this node holds of each model revision it has laid out, reported in
//! heartbeats and `GET /status` so that a gateway can place a load where
//! the weights already are (RAM before disk before nowhere).
//!
//! A revision is known once a load laid it out (`<cache>/models/<name>/<rev>/`,
//! links named by the files' paths into the tiers' blobs, which are named
//! by their sha256); an agent that starts again finds the revisions from
//! those directories. Its tier is the slowest tier holding one of its
//! files, asked of the tiers at report time (a copy evicted or deleted
//! since counts as gone).

use std::collections::BTreeMap;
use std::path::Path;

use parking_lot::Mutex;
use serde::{Deserialize, Serialize};

use crate::tiers::{Tier, Tiers};

/// Where a revision's weights are on this node.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum WeightsTier {
    /// Every file in the RAM tier.
    Ram,
    /// Every file at least on local disk.
    Disk,
    /// Some file in no tier: a load downloads it.
    None,
}

/// One revision in a heartbeat.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HeldRevision {
    pub model: String,
    pub revision: String,
    pub tier: WeightsTier,
    /// The revision's size, as far as the tiers know its files.
    #[serde(default)]
    pub bytes: u64,
    /// Where the engine's converted-weight checkpoint of it is (`ram` or
    /// `disk`); absent: none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checkpoint: Option<WeightsTier>,
    /// The checkpoint's size (0: none).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub checkpoint_bytes: u64,
    /// What the last start of it here spent converting (or, for an engine
    /// that reports no load stats, on its own start work), ms; absent: no
    /// start measured since the agent started.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub convert_ms: Option<u64>,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// The revisions this node has laid out, with their files' sha256.
#[derive(Default)]
pub struct Known {
    revisions: Mutex<BTreeMap<(String, String), Vec<String>>>,
    /// Where they are laid out (`<name>/<rev>/`), for their checkpoints.
    models_dir: Option<std::path::PathBuf>,
}

fn is_sha256(s: &str) -> bool {
    granary_registry::api::is_sha256(s)
}

/// The sha256 of every link under `dir` (their targets' file names).
fn linked_blobs(dir: &Path, out: &mut Vec<String>, depth: usize) {
    let Ok(rd) = std::fs::read_dir(dir) else { return };
    for e in rd.flatten() {
        let p = e.path();
        match std::fs::read_link(&p) {
            // Checkpoints are a cache beside the weights, not part of them.
            Ok(_) if crate::tiers::is_checkpoint_name(&e.file_name().to_string_lossy()) => {}
            Ok(target) => {
                if let Some(name) = target.file_name().and_then(|n| n.to_str()).filter(|n| is_sha256(n)) {
                    out.push(name.to_string());
                }
            }
            Err(_) if p.is_dir() && depth < 32 => linked_blobs(&p, out, depth + 1),
            Err(_) => {}
        }
    }
}

impl Known {
    /// The revisions laid out under `models_dir` (`<name>/<rev>/…`).
    pub fn scan(models_dir: &Path) -> Known {
        let mut map = BTreeMap::new();
        for model in std::fs::read_dir(models_dir).into_iter().flatten().flatten() {
            for rev in std::fs::read_dir(model.path()).into_iter().flatten().flatten() {
                let mut shas = Vec::new();
                linked_blobs(&rev.path(), &mut shas, 0);
                let (m, r) =
                    (model.file_name().to_string_lossy().into_owned(), rev.file_name().to_string_lossy().into_owned());
                if !shas.is_empty() {
                    shas.sort();
                    shas.dedup();
                    map.insert((m, r), shas);
                }
            }
        }
        Known { revisions: Mutex::new(map), models_dir: Some(models_dir.to_path_buf()) }
    }

    /// Records a revision a load laid out.
    pub fn record(&self, model: &str, revision: &str, shas: &[String]) {
        let mut shas = shas.to_vec();
        shas.sort();
        shas.dedup();
        self.revisions.lock().insert((model.to_string(), revision.to_string()), shas);
    }

    /// Each known revision and where its weights are now.
    pub fn report(&self, tiers: &Tiers) -> Vec<HeldRevision> {
        let known = self.revisions.lock().clone();
        known
            .into_iter()
            .map(|((model, revision), shas)| {
                let mut tier = WeightsTier::Ram;
                let bytes = shas.iter().filter_map(|s| tiers.size(s)).sum();
                for sha in &shas {
                    match tiers.locate(sha) {
                        Some(Tier::Ram) => {}
                        Some(_) => tier = WeightsTier::Disk,
                        None => {
                            tier = WeightsTier::None;
                            break;
                        }
                    }
                }
                let held: Vec<(Tier, u64)> = self
                    .models_dir
                    .as_ref()
                    .map(|d| tiers.checkpoint_shas(&d.join(&model).join(&revision)))
                    .unwrap_or_default()
                    .iter()
                    .filter_map(|s| Some((tiers.locate(s)?, tiers.size(s).unwrap_or(0))))
                    .collect();
                let best = held.iter().min_by_key(|(t, _)| *t);
                let checkpoint = best.map(|(t, _)| if *t == Tier::Ram { WeightsTier::Ram } else { WeightsTier::Disk });
                let checkpoint_bytes = best.map_or(0, |(_, n)| *n);
                HeldRevision { model, revision, tier, bytes, checkpoint, checkpoint_bytes, convert_ms: None }
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use granary_core::ByteSize;

    use super::*;
    use crate::tiers::TierConfig;

    #[tokio::test]
    async fn revisions_report_the_slowest_tier_of_their_files_and_survive_a_restart() {
        let d = tempfile::tempdir().unwrap();
        let cfg = TierConfig {
            ram_dir: Some(d.path().join("ram")),
            ram_budget: ByteSize::mib(1),
            promote_after: 1,
            ..Default::default()
        };
        let (a, b) = ("a".repeat(64), "b".repeat(64));
        let disk = d.path().join("blobs/sha256");
        std::fs::create_dir_all(&disk).unwrap();
        std::fs::write(disk.join(&a), b"weights").unwrap();
        std::fs::write(disk.join(&b), b"config").unwrap();
        let tiers = Tiers::open(cfg.clone(), d.path()).unwrap();
        let root = d.path().join("models/m/r1");
        let files = [("w.gguf".to_string(), a.clone()), ("sub/config.json".to_string(), b.clone())];
        tiers.materialise(&root, &files).unwrap();
        let known = Known::default();
        known.record("m", "r1", &[a.clone(), b.clone()]);
        let tier = |k: &Known, t: &Tiers| k.report(t)[0].tier;
        assert_eq!(tier(&known, &tiers), WeightsTier::Disk);
        tiers.promote(std::slice::from_ref(&a)).await.unwrap();
        assert_eq!(tier(&known, &tiers), WeightsTier::Disk, "one file still on disk only");
        tiers.promote(std::slice::from_ref(&b)).await.unwrap();
        assert_eq!(tier(&known, &tiers), WeightsTier::Ram);

        // A new agent finds the revision from its directory of links.
        let again = Known::scan(&d.path().join("models"));
        assert_eq!(
            again.report(&tiers),
            [HeldRevision {
                model: "m".into(),
                revision: "r1".into(),
                tier: WeightsTier::Ram,
                bytes: 13,
                checkpoint: None,
                checkpoint_bytes: 0,
                convert_ms: None
            }]
        );
        // A checkpoint an engine left beside the weights is reported with
        // its tier, apart from the weights' own.
        std::fs::write(root.join("w.gguf.granary-portable.ckpt"), b"converted").unwrap();
        assert_eq!(tiers.adopt_checkpoints(&root).len(), 1);
        let r = again.report(&tiers);
        assert_eq!((r[0].checkpoint, r[0].tier, r[0].bytes), (Some(WeightsTier::Disk), WeightsTier::Ram, 13), "{r:?}");
        assert_eq!(r[0].checkpoint_bytes, 9, "its size, for the gateway's estimate of a start");
        // A file gone from every tier: a load would download it.
        std::fs::remove_file(d.path().join("ram/blobs/sha256").join(&b)).unwrap();
        std::fs::remove_file(disk.join(&b)).unwrap();
        assert_eq!(tier(&again, &tiers), WeightsTier::None);
    }
}

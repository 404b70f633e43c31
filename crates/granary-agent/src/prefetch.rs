//! Prefetch: a gateway's heartbeat answer names models this node's tenants
//! are likely to ask for (`prefetch: [{model, revision?}]`); the agent
//! stages their weights into the RAM tier in the background, so that a
//! later load reads them from RAM.
//!
//! Staging a model resolves its revision in the registry, downloads the
//! files no tier holds into the disk tier, then promotes them all to RAM
//! (with the engine's converted-weight checkpoint of the revision, when the
//! tiers keep one) through [`Tiers::promote`]: bounded by the RAM budget, demoting only
//! least recently used copies no loaded model holds (a model that cannot
//! fit stays on disk). The revision is laid out like a load's, so
//! heartbeats report it in RAM and an agent started again finds it. A model
//! with an engine, or being loaded, is left alone (its load holds the same
//! lock). One staging per model at a time; a failed one is not tried again
//! for [`RETRY_AFTER`].
//!
//! Counted in `GET /status` → `prefetch`: asked (staging started), done (in
//! RAM), failed, and hits (a load whose weights were in RAM because of a
//! prefetch, counted once per prefetch).

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use serde::{Deserialize, Serialize};

use crate::agent::{check_name, Agent};
use crate::error::AgentError;

/// How long a failed staging is not tried again.
pub const RETRY_AFTER: Duration = Duration::from_secs(600);

/// Models a gateway asks for in one answer, at most (more are ignored).
const MAX_ASKED: usize = 64;

/// One model in a heartbeat answer's `prefetch`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PrefetchItem {
    pub model: String,
    /// None: the registry's latest.
    #[serde(default)]
    pub revision: Option<String>,
}

/// The counters in `GET /status`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PrefetchStats {
    pub asked: u64,
    pub done: u64,
    pub failed: u64,
    pub hits: u64,
}

/// What the agent's prefetches are doing.
#[derive(Default)]
pub struct Prefetches {
    stats: Mutex<PrefetchStats>,
    /// Models being staged now.
    running: Mutex<HashSet<String>>,
    /// When staging each model last failed.
    failed: Mutex<HashMap<String, Instant>>,
    /// (model, revision) staged into RAM and not yet loaded.
    staged: Mutex<HashSet<(String, String)>>,
}

impl Prefetches {
    pub fn stats(&self) -> PrefetchStats {
        *self.stats.lock()
    }

    /// A load of `model` at `revision` read its weights from RAM: a hit if
    /// a prefetch put them there.
    pub(crate) fn loaded_from_ram(&self, model: &str, revision: &str) {
        if self.staged.lock().remove(&(model.to_string(), revision.to_string())) {
            self.stats.lock().hits += 1;
        }
    }
}

impl Agent {
    /// Starts staging each model `items` names that is not staged, running
    /// or being staged already (returns at once; the work is in the
    /// background). Returns the models it started.
    pub fn prefetch(self: &Arc<Self>, items: &[PrefetchItem]) -> Vec<String> {
        if !self.config().prefetch {
            return Vec::new();
        }
        let mut started = Vec::new();
        for item in items.iter().take(MAX_ASKED) {
            let valid = check_name("name", &item.model).is_ok()
                && item.revision.as_deref().is_none_or(|r| check_name("revision", r).is_ok());
            if !valid || self.supervisor().status(&item.model).is_some() {
                continue;
            }
            if self.prefetches().failed.lock().get(&item.model).is_some_and(|at| at.elapsed() < RETRY_AFTER) {
                continue;
            }
            let in_ram = self.weights().iter().any(|w| {
                w.model == item.model
                    && w.tier == crate::weights::WeightsTier::Ram
                    && item.revision.as_ref().is_none_or(|r| *r == w.revision)
            });
            if in_ram || !self.prefetches().running.lock().insert(item.model.clone()) {
                continue;
            }
            self.prefetches().stats.lock().asked += 1;
            started.push(item.model.clone());
            let (agent, item) = (self.clone(), item.clone());
            tokio::spawn(async move {
                let p = agent.prefetches();
                match agent.stage(&item.model, item.revision.as_deref()).await {
                    Ok(Some(rev)) => {
                        tracing::info!(model = %item.model, revision = %rev, "prefetched into the RAM tier");
                        p.staged.lock().insert((item.model.clone(), rev));
                        p.stats.lock().done += 1;
                    }
                    Ok(None) => {}
                    Err(e) => {
                        tracing::warn!(model = %item.model, error = %e, "prefetch failed");
                        p.failed.lock().insert(item.model.clone(), Instant::now());
                        p.stats.lock().failed += 1;
                    }
                }
                p.running.lock().remove(&item.model);
            });
        }
        started
    }

    /// Downloads and promotes `name` into RAM; its revision, or None when
    /// an engine for it started meanwhile (nothing to stage).
    pub async fn stage(&self, name: &str, revision: Option<&str>) -> Result<Option<String>, AgentError> {
        let rev = revision.unwrap_or("latest");
        let lock = self.load_lock(name);
        let _one_at_a_time = lock.lock().await;
        if self.supervisor().status(name).is_some() {
            return Ok(None);
        }
        let revision = self.registry().revision(name, rev).await?;
        if let Some(room) = self.tiers().ram_room() {
            if revision.size > room {
                return Err(AgentError::Conflict(format!(
                    "{name}@{} ({} bytes) does not fit the RAM tier's room ({room} bytes)",
                    revision.revision, revision.size
                )));
            }
        } else {
            return Err(AgentError::Conflict("this agent has no RAM tier".into()));
        }
        for f in &revision.files {
            granary_registry::api::check_file_path(&f.path)
                .map_err(|why| AgentError::Registry(format!("{name}@{}: {why}", revision.revision)))?;
        }
        let shas: Vec<String> = revision.files.iter().map(|f| f.sha256.to_ascii_lowercase()).collect();
        self.fetch_files(name, &revision).await?;
        // An engine's converted-weight checkpoint of the revision goes to
        // RAM with the weights: the load then neither reads the disk nor converts.
        let root = self.config().cache_dir.join("models").join(name).join(&revision.revision);
        let staged: Vec<String> = shas.iter().cloned().chain(self.tiers().checkpoint_shas(&root)).collect();
        if !self.tiers().promote(&staged).await? {
            return Err(AgentError::Conflict(format!(
                "{name}@{} stays on disk: the RAM tier cannot make room",
                revision.revision
            )));
        }
        self.lay_out(name, &revision, &shas)?;
        if self.tiers().checkpoint_shas(&root).is_empty() {
            self.convert_staged(name, &revision, &root).await;
        }
        Ok(Some(revision.revision))
    }

    /// For the embedded engine: writes the converted-weight checkpoint of
    /// a staged revision (`granary convert`), takes it into the tiers and
    /// promotes it with the weights, so that the load that follows neither
    /// converts nor reads the disk. Not for a command template (another
    /// engine), nor when `--engine-arg` sets the engine's `--checkpoint`.
    /// A failure is logged; the weights stay staged.
    async fn convert_staged(&self, name: &str, revision: &crate::registry::Revision, root: &std::path::Path) {
        let engines = &self.config().engines;
        // Unit tests run as their own test binary, not as `granary`.
        if cfg!(test) || engines.command.is_some() || engines.engine_args.iter().any(|a| a.starts_with("--checkpoint"))
        {
            return;
        }
        let exe = match engines.granary_exe.clone().map(Ok).unwrap_or_else(std::env::current_exe) {
            Ok(e) => e,
            Err(e) => return tracing::warn!(error = %e, "no checkpoint converted: the granary executable is unknown"),
        };
        let path = match crate::agent::model_path(name, revision, root) {
            Ok(p) => p,
            Err(e) => return tracing::warn!(model = name, error = %e, "no checkpoint converted"),
        };
        let started = std::time::Instant::now();
        let run = tokio::process::Command::new(&exe)
            .arg("convert")
            .arg("--model")
            .arg(&path)
            .stdin(std::process::Stdio::null())
            .kill_on_drop(true)
            .output();
        let out = match tokio::time::timeout(engines.start_timeout, run).await {
            Ok(Ok(out)) => out,
            Ok(Err(e)) => return tracing::warn!(model = name, error = %e, "no checkpoint converted"),
            Err(_) => return tracing::warn!(model = name, "no checkpoint converted: the conversion took too long"),
        };
        if !out.status.success() {
            let err = String::from_utf8_lossy(&out.stderr);
            let last = err.lines().last().unwrap_or("").to_string();
            return tracing::warn!(model = name, status = %out.status, error = %last, "no checkpoint converted");
        }
        // Hashing the file takes a moment: off the runtime's other tasks.
        let adopted = tokio::task::block_in_place(|| self.tiers().adopt_checkpoints(root));
        let shas: Vec<String> = adopted.into_iter().map(|(_, sha)| sha).collect();
        let in_ram = !shas.is_empty() && self.tiers().promote(&shas).await.unwrap_or(false);
        if in_ram {
            // Linked to the RAM copy, as the weights are.
            let files: Vec<(String, String)> =
                revision.files.iter().map(|f| (f.path.clone(), f.sha256.to_ascii_lowercase())).collect();
            let _ = self.tiers().materialise(root, &files);
        }
        tracing::info!(
            model = name,
            ms = started.elapsed().as_millis() as u64,
            in_ram,
            "converted the staged weights into a checkpoint"
        );
    }
}

#[cfg(test)]
mod tests {
    use granary_core::ByteSize;
    use granary_registry::api::ImportRequest;
    use granary_registry::{Registry, RegistryConfig};

    use super::*;
    use crate::weights::WeightsTier;

    /// A registry in this process holding `m` (one 64 KiB GGUF) and `big`
    /// (more than the agent's RAM budget); its base URL.
    async fn registry(dir: &std::path::Path) -> String {
        let mut cfg = RegistryConfig::new(
            format!("sqlite://{}/reg.db?mode=rwc", dir.display()),
            format!("file://{}/store", dir.display()),
        );
        cfg.anonymous_read = true;
        std::fs::create_dir_all(dir.join("store")).unwrap();
        let reg = Arc::new(Registry::open(&cfg).await.unwrap());
        for (name, size) in [("m", 64 << 10), ("big", 2 << 20)] {
            let src = dir.join(format!("src-{name}"));
            std::fs::create_dir_all(&src).unwrap();
            std::fs::write(src.join("w.gguf"), vec![7u8; size]).unwrap();
            let source = format!("dir:{}", src.display());
            reg.import(ImportRequest { name: name.into(), revision: None, source, license: None }).await.unwrap();
        }
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", l.local_addr().unwrap());
        tokio::spawn(async move {
            granary_registry::server::serve_registry(reg, &cfg, l, std::future::pending()).await.unwrap();
        });
        url
    }

    async fn wait_for(what: &str, mut f: impl FnMut() -> bool) {
        let deadline = Instant::now() + Duration::from_secs(20);
        while !f() {
            assert!(Instant::now() < deadline, "waited 20 s for {what}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// A gateway's prefetch stages the model into the RAM tier in the
    /// background; the heartbeat then reports it in RAM. A model larger
    /// than the RAM tier's room is refused (counted failed, not retried at
    /// once); with prefetch off, nothing happens.
    #[tokio::test]
    async fn a_prefetched_model_is_staged_into_ram_and_reported() {
        let d = tempfile::tempdir().unwrap();
        let reg = registry(d.path()).await;
        let mut cfg = crate::AgentConfig {
            cache_dir: d.path().join("cache"),
            registry: reg,
            agent_id: Some("node-p".into()),
            ..Default::default()
        };
        cfg.tiers.ram_dir = Some(d.path().join("ram"));
        cfg.tiers.ram_budget = ByteSize::mib(1);
        cfg.tiers.promote_after = 0;
        let agent = Agent::start(cfg).await.unwrap();
        let ask = |m: &str| PrefetchItem { model: m.into(), revision: None };
        assert_eq!(agent.prefetch(&[ask("m"), ask("big"), ask("bad name")]), ["m", "big"]);
        assert!(agent.prefetch(&[ask("m")]).is_empty(), "one staging per model at a time");
        let a = agent.clone();
        wait_for("both prefetches to end", move || {
            let s = a.prefetches().stats();
            s.done + s.failed == 2
        })
        .await;
        assert_eq!(agent.prefetches().stats(), PrefetchStats { asked: 2, done: 1, failed: 1, hits: 0 });
        let hb = crate::heartbeat::body(&agent);
        let w: Vec<(&str, WeightsTier, u64)> = hb.weights.iter().map(|w| (w.model.as_str(), w.tier, w.bytes)).collect();
        assert_eq!(w, [("m", WeightsTier::Ram, 64 << 10)], "reported in RAM, `big` not laid out");
        assert_eq!(hb.prefetch_room, Some(1 << 20), "nothing loaded holds RAM copies");
        assert!(agent.prefetch(&[ask("m"), ask("big")]).is_empty(), "already in RAM; failed recently");
        let ram_files = std::fs::read_dir(d.path().join("ram/blobs/sha256")).unwrap().count();
        assert_eq!(ram_files, 1);
        agent.shutdown();

        // Another agent with prefetch off ignores the gateway's answer.
        let mut off = agent.config().clone();
        off.cache_dir = d.path().join("cache-off");
        off.tiers.ram_dir = Some(d.path().join("ram-off"));
        off.prefetch = false;
        let agent = Agent::start(off).await.unwrap();
        assert!(agent.prefetch(&[ask("m")]).is_empty());
        assert_eq!(agent.prefetches().stats(), PrefetchStats::default());
        agent.shutdown();
    }
}

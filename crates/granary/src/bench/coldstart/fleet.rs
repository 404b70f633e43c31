//! `granary bench coldstart --fleet`: three agents on this host, the model's
//! weights in a different tier on each (RAM, disk, none: only in the
//! registry), and two gateways over the same agents: one placing loads by
//! locality (the lowest estimated time to first token), one on the agent
//! with the fewest engines (blind to the tier). Rounds alternate between
//! the gateways; each sends one request for the unloaded model and times
//! request → first token, then unloads it.
//!
//! The disk node keeps the engine's converted-weight checkpoint; the RAM
//! node's engine runs with `--checkpoint=off`, so each of its starts
//! converts. Ranking by tier alone would pick the RAM node; the estimate
//! (read + conversion + start, from what the agents measured) picks the
//! node that starts first: where converting is slow (int8 tiles, on CPUs
//! with AVX-512 VNNI) the disk node, whose start converts nothing; where
//! converting is quick and the checkpoint large (dense f32 weights on
//! other CPUs: a checkpoint 5.5 times the Q4_1 file, read from disk), it
//! can be the RAM node.
//!
//! Every round starts the agents again over their own tiers (what a tier
//! held survives, as on a node; the "none" agent's tiers are wiped), with
//! their names rotated among the tiers each pair of rounds: all agents
//! run no engine and report the same free memory, so `fewest_engines`
//! picks by name, and the rotation makes that pick land on each tier in
//! turn (what a locality-blind policy does on average). Locality ignores
//! names. The disk tier's files and the registry's are dropped from the
//! page cache before each round.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{ensure, Context, Result};
use serde::Serialize;
use serde_json::Value;

use super::super::llm::median;
use super::super::warehouse::disk::{drop_from_page_cache, files_under};
use super::super::warehouse::report::Table;
use super::procs::{chat, start_gateway, strings, Engines, Proc};
use super::{Args, AGENT_TOKEN, GW_ADMIN, MODEL, REG_READ};

/// The agents' names; round `k` gives name `i` to tier `(i + k) % 3`.
const NAMES: [&str; 3] = ["fleet-1", "fleet-2", "fleet-3"];
/// The tiers, as the placement header names them.
const TIERS: [&str; 3] = ["ram", "disk", "none"];
const POLICIES: [&str; 2] = ["locality", "fewest_engines"];

/// One round's outcome.
#[derive(Debug, Clone, Serialize)]
pub(super) struct FleetRun {
    pub(super) policy: &'static str,
    pub(super) agent: String,
    /// Where the chosen agent held the weights.
    pub(super) tier: String,
    pub(super) ttft_ms: f64,
    /// The gateway's estimate for the chosen agent, from its placement header.
    pub(super) estimated_ms: Option<f64>,
    /// Its estimates for the agents it ranked after the chosen one.
    pub(super) ranked_after_ms: Vec<f64>,
    /// The placement header as the answer carried it.
    pub(super) placement: String,
}

/// Every `est. N ms` in (part of) a placement header, in order.
fn estimates(text: &str) -> impl Iterator<Item = f64> + '_ {
    text.split("(est. ").skip(1).filter_map(|e| e.split_once(" ms")?.0.parse().ok())
}

/// `est. 380 ms` in a placement header's first entry.
fn estimated_ms(placement: &str) -> Option<f64> {
    estimates(placement.split("; ranked after: ").next()?).next()
}

/// Every `est. N ms` after `; ranked after: ` in a placement header.
fn ranked_after_ms(placement: &str) -> Vec<f64> {
    placement.split_once("; ranked after: ").map_or_else(Vec::new, |(_, rest)| estimates(rest).collect())
}

/// Both policies' rounds, with medians and spread.
#[derive(Debug, Clone, Serialize)]
pub(super) struct FleetReport {
    pub(super) runs: Vec<FleetRun>,
    /// Per policy: (median, min, max) first token, ms.
    pub(super) summary: BTreeMap<&'static str, (f64, f64, f64)>,
}

struct Node {
    tier: usize,
    cache: PathBuf,
    ram: PathBuf,
}

pub(super) struct Fleet<'a> {
    args: &'a Args,
    registry: &'a str,
    registry_dir: PathBuf,
    http: &'a reqwest::Client,
    gateways: Vec<(Proc, String)>,
    nodes: Vec<Node>,
    engines: &'a mut Engines,
}

impl<'a> Fleet<'a> {
    pub(super) async fn start(
        args: &'a Args,
        registry: &'a str,
        base: &Path,
        ram_parent: &Path,
        http: &'a reqwest::Client,
        engines: &'a mut Engines,
    ) -> Result<Fleet<'a>> {
        let mut gateways = Vec::new();
        for p in POLICIES {
            gateways.push(start_gateway(base, http, &format!("gateway-{p}"), &format!("placement = \"{p}\"\n")).await?);
        }
        let nodes = (0..3)
            .map(|t| Node {
                tier: t,
                cache: base.join(format!("fleet-{}", TIERS[t])),
                ram: ram_parent.join(format!("fleet-{}", TIERS[t])),
            })
            .collect();
        let mut f = Fleet { args, registry, registry_dir: base.join("registry"), http, gateways, nodes, engines };
        // Warm-up: the RAM node loads once with promotion on the first
        // load, the disk node once without promotion and keeps the
        // checkpoint its engine writes; both unload. Their agents keep
        // what the loads measured (`load-profile.json`) across restarts.
        for t in [0, 1] {
            let agent = f.agent(t, NAMES[t])?;
            let load = f.call(&agent, reqwest::Method::POST, &format!("/models/{MODEL}/load")).await?;
            ensure!(load["upstream"].is_string(), "warm-up load on the {} node: {load}", TIERS[t]);
            if t == 1 {
                super::wait_checkpoint(&f.nodes[t].cache.join("models"), Duration::from_secs(120)).await?;
                let until = Instant::now() + Duration::from_secs(30);
                loop {
                    let st = f.call(&agent, reqwest::Method::GET, "/status").await?;
                    if st["weights"].as_array().is_some_and(|w| w.iter().any(|w| w["checkpoint"] == "disk")) {
                        break;
                    }
                    ensure!(Instant::now() < until, "the disk node did not take in its checkpoint: {st}");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
            f.unload(&agent).await?;
        }
        Ok(f)
    }

    /// Starts the agent over tier `t`'s directories under `name`.
    fn agent(&self, t: usize, name: &str) -> Result<Proc> {
        let n = &self.nodes[t];
        let mut a = strings(&["agent", "--listen", "127.0.0.1:0", "--agent-id", name]);
        a.extend(strings(&[
            "--registry",
            self.registry,
            "--registry-token",
            REG_READ,
            "--admin-token",
            AGENT_TOKEN,
            "--heartbeat-interval",
            "250ms",
            "--health-interval",
            &self.args.health_interval,
            "--ram-budget",
            "4GiB",
            "--cache-dir",
            &n.cache.display().to_string(),
            "--ram-dir",
            &n.ram.display().to_string(),
            "--promote-after",
            if n.tier == 0 { "1" } else { "0" },
            "--gateway-token",
            GW_ADMIN,
        ]));
        for (gw, _) in &self.gateways {
            a.extend(strings(&["--gateway", &gw.base]));
        }
        // Checkpoints are taken in at each activity poll.
        a.extend(strings(&["--idle-poll", "250ms"]));
        for e in &self.args.engine_args {
            a.push(format!("--engine-arg={e}"));
        }
        if n.tier == 0 && !self.args.engine_args.iter().any(|e| e.starts_with("--checkpoint")) {
            a.push("--engine-arg=--checkpoint=off".into());
        }
        Proc::start(name, &a, &[], "granary agent: control API on ", "granary: ready")
    }

    async fn call(&self, agent: &Proc, method: reqwest::Method, path: &str) -> Result<Value> {
        let r = self
            .http
            .request(method, format!("{}{path}", agent.base))
            .bearer_auth(AGENT_TOKEN)
            .header("content-type", "application/json")
            .body("{}")
            .send()
            .await?;
        let status = r.status();
        let text = r.text().await?;
        ensure!(status.is_success(), "agent {path}: {status} {text}");
        serde_json::from_str(&text).with_context(|| format!("agent {path}: not JSON: {text}"))
    }

    /// Unloads the model from `agent` if it runs it (its engine's pid kept
    /// for the final clean-up).
    async fn unload(&mut self, agent: &Proc) -> Result<()> {
        let st = self.call(agent, reqwest::Method::GET, "/status").await?;
        let engine = st["engines"].as_array().and_then(|e| e.iter().find(|e| e["model"] == MODEL)).cloned();
        if let Some(e) = engine {
            if let Some(pid) = e["pid"].as_u64() {
                self.engines.pids.push(pid as u32);
            }
            self.call(agent, reqwest::Method::POST, &format!("/models/{MODEL}/unload")).await?;
        }
        Ok(())
    }

    /// Waits until every gateway lists `agents` (name, tier, process) with
    /// the model loadable and no engine.
    async fn wait_gateways(&self, agents: &[(&str, usize, &Proc)]) -> Result<()> {
        let deadline = Instant::now() + Duration::from_secs(60);
        for (gw, _) in &self.gateways {
            loop {
                let v: Value = self
                    .http
                    .get(format!("{}/admin/v1/agents", gw.base))
                    .bearer_auth(GW_ADMIN)
                    .send()
                    .await?
                    .json()
                    .await?;
                // Listed with the model loadable, no engine, and the disk
                // node's checkpoint known (what the estimate reads).
                let listed = |(name, tier, p): &(&str, usize, &Proc)| {
                    v["data"].as_array().and_then(|a| a.iter().find(|a| a["agent_id"] == *name)).is_some_and(|a| {
                        a["url"] == p.base.as_str()
                            && a["models"].as_array().is_some_and(|m| m.iter().any(|m| m == MODEL))
                            && a["engines"].as_array().is_some_and(|e| e.is_empty())
                            && (*tier != 1 || a["checkpoints"].as_array().is_some_and(|c| c.iter().any(|m| m == MODEL)))
                    })
                };
                if agents.iter().all(listed) {
                    break;
                }
                ensure!(Instant::now() < deadline, "a gateway did not see the fleet within 60 s: {v}");
                tokio::time::sleep(Duration::from_millis(25)).await;
            }
        }
        Ok(())
    }

    /// One round: fresh agents (names rotated by `rotation`), one cold
    /// request through `policy`'s gateway.
    async fn round(&mut self, policy: usize, rotation: usize) -> Result<FleetRun> {
        let none = &self.nodes[2];
        for d in [&none.cache, &none.ram] {
            std::fs::remove_dir_all(d).ok();
        }
        for f in files_under(&self.nodes[1].cache.join("blobs")).into_iter().chain(files_under(&self.registry_dir)) {
            drop_from_page_cache(&f)?;
        }
        // Name i goes to tier (i + rotation) % 3.
        let mut procs = Vec::new();
        for (i, name) in NAMES.iter().enumerate() {
            procs.push((*name, (i + rotation) % 3, self.agent((i + rotation) % 3, name)?));
        }
        let listed: Vec<(&str, usize, &Proc)> = procs.iter().map(|(n, t, p)| (*n, *t, p)).collect();
        self.wait_gateways(&listed).await?;
        // Heartbeats carry the weights with the engines: one more interval
        // so that every gateway has this round's tiers.
        tokio::time::sleep(Duration::from_millis(300)).await;
        let (gw, key) = &self.gateways[policy];
        let (ttft_ms, placement) = chat(self.http, &gw.base, Some(key), self.args.max_tokens).await?;
        let placement = placement.context("the cold request's answer has no x-granary-placement")?;
        let chosen = placement
            .strip_prefix("loaded on ")
            .and_then(|r| r.split_whitespace().next())
            .with_context(|| format!("placement {placement:?}"))?
            .to_string();
        let (_, tier, proc) =
            procs.iter().find(|(n, _, _)| *n == chosen).context("the placement names no fleet agent")?;
        let run = FleetRun {
            policy: POLICIES[policy],
            agent: chosen.clone(),
            tier: TIERS[*tier].into(),
            ttft_ms,
            estimated_ms: estimated_ms(&placement),
            ranked_after_ms: ranked_after_ms(&placement),
            placement,
        };
        self.unload(proc).await?;
        drop(procs);
        Ok(run)
    }
}

/// Runs `rounds` rounds per policy, alternating, and prints the table.
pub(super) async fn run(mut fleet: Fleet<'_>, rounds: usize, pb: &indicatif::ProgressBar) -> Result<FleetReport> {
    let mut runs = Vec::new();
    for k in 0..rounds {
        // Pair k: both policies under the same names; which goes first alternates.
        let order = if k % 2 == 0 { [0, 1] } else { [1, 0] };
        for p in order {
            pb.set_message(format!("fleet round {}/{rounds}: {}", k + 1, POLICIES[p]));
            let r = fleet.round(p, k % 3).await.with_context(|| format!("fleet round {} ({})", k + 1, POLICIES[p]))?;
            pb.suspend(|| {
                eprintln!(
                    "coldstart --fleet: round {}/{rounds} {}: loaded on {} (weights: {}), first token {:.0} ms (estimated {})",
                    k + 1,
                    r.policy,
                    r.agent,
                    r.tier,
                    r.ttft_ms,
                    r.estimated_ms.map_or("-".into(), |e| format!("{e:.0} ms"))
                )
            });
            runs.push(r);
            pb.inc(1);
        }
    }
    let mut summary = BTreeMap::new();
    for p in POLICIES {
        let v: Vec<f64> = runs.iter().filter(|r| r.policy == p).map(|r| r.ttft_ms).collect();
        let (lo, hi) = v.iter().fold((f64::MAX, f64::MIN), |(lo, hi), x| (lo.min(*x), hi.max(*x)));
        summary.insert(p, (median(&v), lo, hi));
    }
    Ok(FleetReport { runs, summary })
}

pub(super) fn table(r: &FleetReport) -> Table {
    let n = r.runs.len() / POLICIES.len();
    let mut t = Table::new(
        format!("coldstart --fleet: request → first token for an unloaded model on 3 agents (weights in RAM with no checkpoint, on disk with one, nowhere), ms; {n} rounds per placement, alternating"),
        &["placement", "median", "min", "max", "estimated (median)", "tiers loaded from"],
    );
    for p in POLICIES {
        let (m, lo, hi) = r.summary[p];
        let mut from: BTreeMap<&str, usize> = BTreeMap::new();
        for x in r.runs.iter().filter(|x| x.policy == p) {
            *from.entry(x.tier.as_str()).or_default() += 1;
        }
        let from: Vec<String> = from.iter().map(|(t, c)| format!("{t} ×{c}")).collect();
        let est = estimated_median(r.runs.iter().filter(|x| x.policy == p));
        t.row(vec![p.into(), format!("{m:.0}"), format!("{lo:.0}"), format!("{hi:.0}"), est, from.join(", ")]);
    }
    // The same runs by the tier the chosen agent read from, whichever placement chose it.
    for tier in TIERS {
        let v: Vec<f64> = r.runs.iter().filter(|x| x.tier == tier).map(|x| x.ttft_ms).collect();
        if v.is_empty() {
            continue;
        }
        let (lo, hi) = v.iter().fold((f64::MAX, f64::MIN), |(lo, hi), x| (lo.min(*x), hi.max(*x)));
        t.row(vec![
            format!("(any, from {tier})"),
            format!("{:.0}", median(&v)),
            format!("{lo:.0}"),
            format!("{hi:.0}"),
            estimated_median(r.runs.iter().filter(|x| x.tier == tier)),
            format!("{tier} ×{}", v.len()),
        ]);
    }
    t
}

/// The median of the gateway's estimates for `runs` (`-`: none gave one).
fn estimated_median<'a>(runs: impl Iterator<Item = &'a FleetRun>) -> String {
    let v: Vec<f64> = runs.filter_map(|r| r.estimated_ms).collect();
    if v.is_empty() {
        "-".into()
    } else {
        format!("{:.0}", median(&v))
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_estimate_is_read_from_the_placement_header() {
        let h = "loaded on fleet-2 (est. 380 ms: fetch 0 + read 280 + convert 0 + start 100 + queue 0; weights: disk)";
        assert_eq!(super::estimated_ms(h), Some(380.0));
        assert_eq!(super::estimated_ms("loaded on a (weights: ram)"), None);
        assert!(super::ranked_after_ms(h).is_empty());
        let h = "loaded on fleet-1 (est. 380 ms: fetch 0 + read 80 + convert 200 + start 100 + queue 0; weights: ram); \
                 ranked after: fleet-2 (est. 612 ms: fetch 0 + read 512 + convert 0 + start 100 + queue 0; weights: disk), \
                 fleet-3 (est. 1490 ms: fetch 1190 + read 0 + convert 200 + start 100 + queue 0; weights: none)";
        assert_eq!(super::estimated_ms(h), Some(380.0));
        assert_eq!(super::ranked_after_ms(h), vec![612.0, 1490.0]);
    }
}

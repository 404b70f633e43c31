//! GPUs and memory as resources: which engine holds which GPU, and whether
//! a new one fits.
//!
//! GPUs come from `nvidia-smi` when it runs, else from the configured list
//! (a node without `nvidia-smi`, or an agent given a subset of a node's
//! GPUs). Each engine gets `gpus_per_engine` of them, named to it in
//! `CUDA_VISIBLE_DEVICES`, and reserves its memory on them: the declared
//! `engine_memory`, else an estimate (its weights' bytes plus
//! `memory_overhead` for the KV cache, activations and the runtime). An
//! engine without GPUs reserves host RAM instead, out of `host_memory`
//! (default: the node's total). A load that does not fit is refused with
//! what each GPU or the host has free and who holds it; nothing is
//! oversubscribed, so two engines never share a GPU past its memory.
//!
//! Reservations are the agent's bookkeeping, not a measurement: they are
//! restored from the engines' launch specs when an agent adopts running
//! engines, and reported (with the host's own `MemAvailable`) in `GET
//! /status` and in heartbeats.

use std::collections::BTreeMap;
use std::process::Command;

use granary_core::ByteSize;
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};

use crate::error::AgentError;

/// How GPUs and memory are found and shared out.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ResourceConfig {
    /// The node's GPUs; none: ask `nvidia-smi` (no GPUs when it does not run).
    pub gpus: Option<Vec<GpuSpec>>,
    /// Host RAM engines without GPUs may reserve [default: the node's total].
    pub host_memory: Option<ByteSize>,
    /// GPUs each engine gets (0: engines run without GPUs, in host RAM).
    pub gpus_per_engine: u32,
    /// Memory each engine reserves; none: estimated as its weights' bytes
    /// plus `memory_overhead`.
    pub engine_memory: Option<ByteSize>,
    /// Added to the weights' bytes in the estimate.
    pub memory_overhead: ByteSize,
}

impl Default for ResourceConfig {
    fn default() -> Self {
        ResourceConfig {
            gpus: None,
            host_memory: None,
            gpus_per_engine: 0,
            engine_memory: None,
            memory_overhead: ByteSize::mib(512),
        }
    }
}

/// One GPU as configured (or found by `nvidia-smi`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GpuSpec {
    /// Its index in `CUDA_VISIBLE_DEVICES`.
    pub index: u32,
    /// Its memory.
    pub memory: ByteSize,
    #[serde(default)]
    pub name: Option<String>,
    #[serde(default)]
    pub uuid: Option<String>,
}

/// One GPU in `GET /status` and heartbeats.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuStatus {
    pub index: u32,
    pub name: Option<String>,
    pub uuid: Option<String>,
    pub memory_total: u64,
    /// Reserved by this agent's engines.
    pub memory_reserved: u64,
    pub memory_free: u64,
    /// The models of the engines on it.
    pub engines: Vec<String>,
}

/// Free capacity, for `GET /status` and heartbeats.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ResourcesStatus {
    /// `nvidia-smi`, `config` or `none`.
    pub gpu_source: String,
    pub gpus: Vec<GpuStatus>,
    /// What engines without GPUs may reserve.
    pub host_memory_total: u64,
    pub host_memory_reserved: u64,
    pub host_memory_free: u64,
    /// The kernel's `MemAvailable` now (what the node as a whole has left).
    pub host_memory_available: Option<u64>,
}

/// What one engine holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reservation {
    /// Its GPUs; none on a node without GPUs.
    pub gpus: Option<Vec<u32>>,
    /// Its memory: on its GPUs together, or in host RAM.
    pub memory: u64,
}

/// The node's GPUs and memory, and who holds what.
pub struct Resources {
    cfg: ResourceConfig,
    gpus: Vec<GpuSpec>,
    gpu_source: &'static str,
    host_total: u64,
    held: Mutex<BTreeMap<String, Reservation>>,
}

/// `/proc/meminfo`'s `key` in bytes.
fn meminfo(key: &str) -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.split(':').next() == Some(key))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// GPUs from `nvidia-smi --query-gpu=index,uuid,name,memory.total
/// --format=csv,noheader,nounits` (memory in MiB).
pub fn parse_nvidia_smi(text: &str) -> Result<Vec<GpuSpec>, String> {
    let mut out = Vec::new();
    for line in text.lines().map(str::trim).filter(|l| !l.is_empty()) {
        let f: Vec<&str> = line.split(',').map(str::trim).collect();
        let [index, uuid, name, mib] = f.as_slice() else {
            return Err(format!("unexpected nvidia-smi line {line:?} (expected index, uuid, name, memory.total)"));
        };
        let index = index.parse().map_err(|_| format!("nvidia-smi: bad index in {line:?}"))?;
        let mib: u64 = mib.parse().map_err(|_| format!("nvidia-smi: bad memory.total in {line:?}"))?;
        out.push(GpuSpec {
            index,
            memory: ByteSize::mib(mib),
            name: Some(name.to_string()),
            uuid: Some(uuid.to_string()),
        });
    }
    Ok(out)
}

fn discover() -> (Vec<GpuSpec>, &'static str) {
    let out = Command::new("nvidia-smi")
        .args(["--query-gpu=index,uuid,name,memory.total", "--format=csv,noheader,nounits"])
        .output();
    match out {
        Ok(o) if o.status.success() => match parse_nvidia_smi(&String::from_utf8_lossy(&o.stdout)) {
            Ok(g) => (g, "nvidia-smi"),
            Err(e) => {
                tracing::warn!(error = %e, "cannot read nvidia-smi's GPU list; no GPUs are used");
                (Vec::new(), "none")
            }
        },
        _ => (Vec::new(), "none"),
    }
}

fn mib(b: u64) -> String {
    format!("{} MiB", b.div_ceil(1 << 20))
}

impl Resources {
    /// The configured GPUs, or those `nvidia-smi` lists.
    pub fn new(cfg: ResourceConfig) -> Result<Resources, AgentError> {
        let (gpus, gpu_source) = match &cfg.gpus {
            Some(list) => (list.clone(), "config"),
            None => discover(),
        };
        for (i, g) in gpus.iter().enumerate() {
            if gpus[..i].iter().any(|o| o.index == g.index) {
                return Err(AgentError::invalid("resources.gpus", format!("GPU index {} is listed twice", g.index)));
            }
        }
        if cfg.gpus_per_engine as usize > gpus.len() {
            return Err(AgentError::invalid(
                "resources.gpus_per_engine",
                format!(
                    "each engine needs {} GPUs but this node has {} ({gpu_source})",
                    cfg.gpus_per_engine,
                    gpus.len()
                ),
            ));
        }
        let host_total = match cfg.host_memory {
            Some(b) => b.as_u64(),
            None => meminfo("MemTotal").unwrap_or(u64::MAX),
        };
        if !gpus.is_empty() {
            tracing::info!(count = gpus.len(), source = gpu_source, "GPUs");
        }
        Ok(Resources { cfg, gpus, gpu_source, host_total, held: Mutex::new(BTreeMap::new()) })
    }

    pub fn config(&self) -> &ResourceConfig {
        &self.cfg
    }

    /// Memory an engine whose weights are `weight_bytes` needs.
    pub fn estimate(&self, weight_bytes: u64) -> u64 {
        match self.cfg.engine_memory {
            Some(b) => b.as_u64(),
            None => weight_bytes.saturating_add(self.cfg.memory_overhead.as_u64()),
        }
    }

    fn gpu_reserved(held: &BTreeMap<String, Reservation>, index: u32) -> u64 {
        held.values()
            .filter_map(|r| {
                let gpus = r.gpus.as_ref()?;
                gpus.contains(&index).then(|| r.memory.div_ceil(gpus.len().max(1) as u64))
            })
            .sum()
    }

    fn host_reserved(held: &BTreeMap<String, Reservation>) -> u64 {
        held.values().filter(|r| r.gpus.as_ref().is_none_or(Vec::is_empty)).map(|r| r.memory).sum()
    }

    fn holders(held: &BTreeMap<String, Reservation>, index: Option<u32>) -> Vec<String> {
        held.iter()
            .filter(|(_, r)| match index {
                Some(i) => r.gpus.as_ref().is_some_and(|g| g.contains(&i)),
                None => r.gpus.as_ref().is_none_or(Vec::is_empty),
            })
            .map(|(m, _)| m.clone())
            .collect()
    }

    /// Reserves GPUs and memory for `model`'s engine, or says why it does not fit.
    pub fn reserve(&self, model: &str, weight_bytes: u64) -> Result<Reservation, AgentError> {
        let need = self.estimate(weight_bytes);
        let how = match self.cfg.engine_memory {
            Some(_) => "resources.engine_memory".to_string(),
            None => format!(
                "weights {} + resources.memory_overhead {}",
                mib(weight_bytes),
                mib(self.cfg.memory_overhead.as_u64())
            ),
        };
        let mut held = self.held.lock();
        let n = self.cfg.gpus_per_engine as usize;
        let r = if n == 0 {
            let free = self.host_total.saturating_sub(Self::host_reserved(&held));
            if need > free {
                let by = Self::holders(&held, None);
                return Err(AgentError::Resources(format!(
                    "`{model}` needs {} of host memory ({how}) but {} of {} is free (held by: {})",
                    mib(need),
                    mib(free),
                    mib(self.host_total),
                    if by.is_empty() { "none".into() } else { by.join(", ") }
                )));
            }
            let gpus = (!self.gpus.is_empty()).then(Vec::new);
            Reservation { gpus, memory: need }
        } else {
            let share = need.div_ceil(n as u64);
            // The GPUs with the most free memory, fewest engines first on a tie.
            let mut free: Vec<(u64, usize, u32)> = self
                .gpus
                .iter()
                .map(|g| {
                    let f = g.memory.as_u64().saturating_sub(Self::gpu_reserved(&held, g.index));
                    (f, Self::holders(&held, Some(g.index)).len(), g.index)
                })
                .collect();
            free.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)).then(a.2.cmp(&b.2)));
            let fits: Vec<u32> = free.iter().filter(|(f, _, _)| *f >= share).map(|(_, _, i)| *i).take(n).collect();
            if fits.len() < n {
                let each: Vec<String> = free
                    .iter()
                    .map(|(f, _, i)| {
                        let by = Self::holders(&held, Some(*i));
                        let by = if by.is_empty() { String::new() } else { format!(", held by {}", by.join(", ")) };
                        format!("GPU {i}: {} free{by}", mib(*f))
                    })
                    .collect();
                return Err(AgentError::Resources(format!(
                    "`{model}` needs {n} GPU(s) with {} free each ({} in all: {how}); {}",
                    mib(share),
                    mib(need),
                    each.join("; ")
                )));
            }
            let mut gpus = fits;
            gpus.sort_unstable();
            Reservation { gpus: Some(gpus), memory: need }
        };
        held.insert(model.to_string(), r.clone());
        Ok(r)
    }

    /// Records what an engine started by an earlier agent holds.
    pub fn restore(&self, model: &str, gpus: Option<Vec<u32>>, memory: u64) {
        self.held.lock().insert(model.to_string(), Reservation { gpus, memory });
    }

    /// Gives back what `model`'s engine held.
    pub fn release(&self, model: &str) {
        self.held.lock().remove(model);
    }

    pub fn status(&self) -> ResourcesStatus {
        let held = self.held.lock();
        let host_reserved = Self::host_reserved(&held);
        ResourcesStatus {
            gpu_source: self.gpu_source.to_string(),
            gpus: self
                .gpus
                .iter()
                .map(|g| {
                    let reserved = Self::gpu_reserved(&held, g.index);
                    GpuStatus {
                        index: g.index,
                        name: g.name.clone(),
                        uuid: g.uuid.clone(),
                        memory_total: g.memory.as_u64(),
                        memory_reserved: reserved,
                        memory_free: g.memory.as_u64().saturating_sub(reserved),
                        engines: Self::holders(&held, Some(g.index)),
                    }
                })
                .collect(),
            host_memory_total: self.host_total,
            host_memory_reserved: host_reserved,
            host_memory_free: self.host_total.saturating_sub(host_reserved),
            host_memory_available: meminfo("MemAvailable"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gpus(n: u32, mib: u64) -> Option<Vec<GpuSpec>> {
        Some((0..n).map(|index| GpuSpec { index, memory: ByteSize::mib(mib), name: None, uuid: None }).collect())
    }

    #[test]
    fn each_engine_gets_its_own_gpu_until_none_has_room() {
        let r = Resources::new(ResourceConfig {
            gpus: gpus(2, 1024),
            gpus_per_engine: 1,
            engine_memory: Some(ByteSize::mib(800)),
            ..Default::default()
        })
        .unwrap();
        assert_eq!(r.reserve("a", 1).unwrap().gpus, Some(vec![0]));
        assert_eq!(r.reserve("b", 1).unwrap().gpus, Some(vec![1]), "the emptier GPU");
        let e = r.reserve("c", 1).unwrap_err();
        assert_eq!((e.status().as_u16(), e.code()), (503, "insufficient_resources"));
        let msg = e.to_string();
        assert!(
            msg.contains("GPU 0: 224 MiB free, held by a") && msg.contains("GPU 1: 224 MiB free, held by b"),
            "{msg}"
        );
        r.release("a");
        assert_eq!(r.reserve("c", 1).unwrap().gpus, Some(vec![0]));
        let st = r.status();
        assert_eq!((st.gpu_source.as_str(), st.gpus[0].memory_free), ("config", 224 << 20));
        assert_eq!(st.gpus[0].engines, ["c"]);
    }

    #[test]
    fn small_engines_share_a_gpu_and_big_ones_span_two() {
        let r = Resources::new(ResourceConfig {
            gpus: gpus(2, 1000),
            gpus_per_engine: 2,
            engine_memory: Some(ByteSize::mib(1200)),
            ..Default::default()
        })
        .unwrap();
        let a = r.reserve("a", 0).unwrap();
        assert_eq!((a.gpus, a.memory), (Some(vec![0, 1]), 1200 << 20));
        assert_eq!(r.status().gpus[1].memory_reserved, 600 << 20);
        let e = r.reserve("b", 0).unwrap_err().to_string();
        assert!(
            e.contains("needs 2 GPU(s) with 600 MiB free each") && e.contains("GPU 1: 400 MiB free, held by a"),
            "{e}"
        );
        let e = Resources::new(ResourceConfig { gpus: gpus(1, 1), gpus_per_engine: 2, ..Default::default() });
        assert!(e.err().unwrap().to_string().contains("needs 2 GPUs but this node has 1"));
    }

    #[test]
    fn engines_without_gpus_reserve_host_memory() {
        let r = Resources::new(ResourceConfig {
            gpus: Some(vec![]),
            host_memory: Some(ByteSize::mib(1000)),
            memory_overhead: ByteSize::mib(100),
            ..Default::default()
        })
        .unwrap();
        let a = r.reserve("a", 400 << 20).unwrap();
        assert_eq!((a.gpus, a.memory), (None, 500 << 20), "no GPUs on the node: the variable is left alone");
        let e = r.reserve("b", 500 << 20).unwrap_err().to_string();
        assert!(
            e.contains("needs 600 MiB of host memory") && e.contains("500 MiB of 1000 MiB is free (held by: a)"),
            "{e}"
        );
        assert_eq!(r.status().host_memory_free, 500 << 20);
        // On a node with GPUs, an engine without any sees none of them.
        let g = Resources::new(ResourceConfig { gpus: gpus(1, 10), ..Default::default() }).unwrap();
        assert_eq!(g.reserve("a", 1).unwrap().gpus, Some(vec![]));
    }

    /// Lines in the shape of `nvidia-smi --query-gpu=index,uuid,name,memory.total
    /// --format=csv,noheader,nounits` (no GPU here: the values are illustrative).
    #[test]
    fn reads_nvidia_smi() {
        let text = "0, GPU-5d3b2a9e-1c4f-4b7e-9a0d-2f6c8e1b3a57, NVIDIA H100 80GB HBM3, 81559\n\
                    1, GPU-0a1b2c3d-4e5f-6789-abcd-ef0123456789, NVIDIA H100 80GB HBM3, 81559\n";
        let g = parse_nvidia_smi(text).unwrap();
        assert_eq!(g.len(), 2);
        assert_eq!(
            (g[1].index, g[1].memory, g[1].name.as_deref()),
            (1, ByteSize::mib(81559), Some("NVIDIA H100 80GB HBM3"))
        );
        assert!(parse_nvidia_smi("0, x, y\n").is_err());
        assert!(parse_nvidia_smi("").unwrap().is_empty());
    }
}

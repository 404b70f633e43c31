//! The engine's Prometheus metrics (names from
//! [`granary_core::metrics::engine`]); every label value comes from a fixed set.

use std::sync::atomic::{AtomicU64, Ordering};

use granary_core::metrics::engine as names;
use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

type Labels = Vec<(&'static str, &'static str)>;

pub use granary_core::metrics::engine::{PREEMPTED, PREEMPTIONS, RESUMED_TOKENS};
type F64Gauge = Gauge<f64, AtomicU64>;

/// Where a prompt token's KV came from: computed, the engine's own memory,
/// or one of the warehouse's tiers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    Computed,
    /// The engine's block cache.
    Engine,
    /// The warehouse's memory tier.
    Memory,
    Disk,
    Remote,
}

impl Source {
    pub fn as_str(self) -> &'static str {
        match self {
            Source::Computed => "computed",
            Source::Engine => "engine",
            Source::Memory => "memory",
            Source::Disk => "disk",
            Source::Remote => "remote",
        }
    }
}

pub struct EngineMetrics {
    registry: Registry,
    pub ttft: Histogram,
    pub tpot: Histogram,
    pub request_seconds: Histogram,
    pub prompt_tokens: Family<Labels, Counter>,
    pub generated: Counter,
    /// Logits the tensor path brought to the host to choose tokens.
    pub logits_to_host: Counter,
    pub requests: Family<Labels, Counter>,
    pub running: Gauge,
    pub waiting: Gauge,
    pub resident: Family<Labels, Gauge>,
    pub tokens_per_second: Family<Labels, F64Gauge>,
    pub saves: Family<Labels, Counter>,
    pub warehouse_errors: Counter,
    pub kv_budget_blocks: Gauge,
    pub kv_reserved_blocks: Gauge,
    /// Sequences set aside for memory (label `kv`: warehouse, recompute).
    pub preemptions: Family<Labels, Counter>,
    /// KV tokens of resumed sequences (label `how`: loaded, recomputed).
    pub resumed_tokens: Family<Labels, Counter>,
    /// Sequences set aside now.
    pub preempted: Gauge,
    prompt_by_source: [AtomicU64; 5],
}

impl Default for EngineMetrics {
    fn default() -> Self {
        Self::new()
    }
}

impl EngineMetrics {
    pub fn new() -> Self {
        let mut registry = Registry::default();
        let m = EngineMetrics {
            ttft: Histogram::new(exponential_buckets(0.005, 2.0, 16)),
            tpot: Histogram::new(exponential_buckets(0.001, 2.0, 14)),
            request_seconds: Histogram::new(exponential_buckets(0.01, 2.0, 16)),
            prompt_tokens: Family::default(),
            generated: Counter::default(),
            logits_to_host: Counter::default(),
            requests: Family::default(),
            running: Gauge::default(),
            waiting: Gauge::default(),
            resident: Family::default(),
            tokens_per_second: Family::default(),
            saves: Family::default(),
            warehouse_errors: Counter::default(),
            kv_budget_blocks: Gauge::default(),
            kv_reserved_blocks: Gauge::default(),
            preemptions: Family::default(),
            resumed_tokens: Family::default(),
            preempted: Gauge::default(),
            prompt_by_source: Default::default(),
            registry: Registry::default(),
        };
        let base = granary_core::metrics::warehouse::counter_base;
        registry.register(names::TTFT_SECONDS, "Time to first token", m.ttft.clone());
        registry.register(names::TPOT_SECONDS, "Time per output token", m.tpot.clone());
        registry.register(names::REQUEST_SECONDS, "Request duration", m.request_seconds.clone());
        registry.register(
            base(names::PROMPT_TOKENS),
            "Prompt tokens by KV source (computed, memory, disk, remote)",
            m.prompt_tokens.clone(),
        );
        registry.register(base(names::GENERATED_TOKENS), "Tokens generated", m.generated.clone());
        registry.register(
            base(names::LOGITS_TO_HOST),
            "Logits brought from the device to choose tokens",
            m.logits_to_host.clone(),
        );
        registry.register(base(names::REQUESTS), "Requests by outcome", m.requests.clone());
        registry.register(names::RUNNING, "Requests in the running batch", m.running.clone());
        registry.register(names::WAITING, "Requests waiting to run", m.waiting.clone());
        registry.register(names::RESIDENT_BLOCKS, "KV blocks resident in engine memory", m.resident.clone());
        registry.register(names::TOKENS_PER_SECOND, "Recent throughput by phase", m.tokens_per_second.clone());
        registry.register(base(names::BLOCK_SAVES), "KV block saves by outcome", m.saves.clone());
        registry.register(base(names::WAREHOUSE_ERRORS), "Warehouse calls failed", m.warehouse_errors.clone());
        registry.register(names::KV_BUDGET_BLOCKS, "KV blocks the KV memory budget holds", m.kv_budget_blocks.clone());
        registry.register(
            names::KV_RESERVED_BLOCKS,
            "KV blocks running sequences hold after the next step, and those reserved for sequences being resumed",
            m.kv_reserved_blocks.clone(),
        );
        registry.register(
            base(PREEMPTIONS),
            "Sequences set aside for KV memory (kv: warehouse or recompute)",
            m.preemptions.clone(),
        );
        registry.register(
            base(RESUMED_TOKENS),
            "KV tokens of resumed sequences (how: loaded or recomputed)",
            m.resumed_tokens.clone(),
        );
        registry.register(PREEMPTED, "Sequences set aside for KV memory now", m.preempted.clone());
        for kv in ["warehouse", "recompute"] {
            let _ = m.preemptions.get_or_create(&vec![("kv", kv)]);
        }
        for how in ["loaded", "recomputed"] {
            let _ = m.resumed_tokens.get_or_create(&vec![("how", how)]);
        }
        for s in names::SOURCES {
            let _ = m.prompt_tokens.get_or_create(&vec![("source", s)]);
        }
        EngineMetrics { registry, ..m }
    }

    pub fn add_prompt_tokens(&self, source: Source, n: usize) {
        if n == 0 {
            return;
        }
        self.prompt_tokens.get_or_create(&vec![("source", source.as_str())]).inc_by(n as u64);
        self.prompt_by_source[source as usize].fetch_add(n as u64, Ordering::Relaxed);
    }

    /// Prompt tokens so far by source, in [`names::SOURCES`] order.
    pub fn prompt_tokens_by_source(&self) -> [u64; 5] {
        std::array::from_fn(|i| self.prompt_by_source[i].load(Ordering::Relaxed))
    }

    pub fn outcome(&self, outcome: &'static str) {
        self.requests.get_or_create(&vec![("outcome", outcome)]).inc();
    }

    pub fn save(&self, outcome: &'static str, n: u64) {
        self.saves.get_or_create(&vec![("outcome", outcome)]).inc_by(n);
    }

    /// Prometheus text exposition.
    pub fn render(&self) -> String {
        let mut out = String::new();
        encode(&mut out, &self.registry).expect("writing to a String cannot fail");
        granary_warehouse::metrics::to_prometheus_text(&out)
    }
}

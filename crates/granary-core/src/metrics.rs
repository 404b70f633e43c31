//! The catalog of metric names every component exports.
//!
//! Rules, checked by the tests below:
//! - names are `granary_<component>_<what>` in snake case;
//! - counters end in `_total`, durations are `_seconds`, sizes are `_bytes`;
//! - a label never takes a user-controlled value unless it passes through a
//!   bounded set first (tiers, policies, outcomes; tenants only through a
//!   capped table), so a client cannot blow up cardinality.
//!
//! Components register their metrics with these constants so names are
//! written once.

/// Label values for the warehouse's tiers.
pub const TIERS: [&str; 3] = ["memory", "disk", "remote"];

pub mod warehouse {
    /// Bytes held per tier (gauge; label `tier`).
    pub const TIER_BYTES: &str = "granary_warehouse_tier_bytes";
    /// Entries held per tier (gauge; label `tier`).
    pub const TIER_ENTRIES: &str = "granary_warehouse_tier_entries";
    /// Byte budget per tier (gauge; label `tier`; 0 = unbounded).
    pub const TIER_CAPACITY_BYTES: &str = "granary_warehouse_tier_capacity_bytes";
    /// Read hits per tier (counter; label `tier`).
    pub const HITS: &str = "granary_warehouse_hits_total";
    /// Read misses per tier (counter; label `tier`).
    pub const MISSES: &str = "granary_warehouse_misses_total";
    /// Entries evicted per tier (counter; label `tier`).
    pub const EVICTIONS: &str = "granary_warehouse_evictions_total";
    /// Entries that expired (counter; label `tier`).
    pub const EXPIRATIONS: &str = "granary_warehouse_expirations_total";
    /// Offloads to a slower tier dropped because its queue was full (counter; label `tier`).
    pub const OFFLOADS_DROPPED: &str = "granary_warehouse_offloads_dropped_total";
    /// Offloads written to a slower tier (counter; label `tier`).
    pub const OFFLOADS: &str = "granary_warehouse_offloads_total";
    /// Hits promoted into a faster tier (counter; label `tier` = where it was found).
    pub const PROMOTIONS: &str = "granary_warehouse_promotions_total";
    /// Entries recovered from disk at start (counter).
    pub const RECOVERED: &str = "granary_warehouse_recovered_total";
    /// Corrupt or torn entries found and dropped (counter; label `tier`).
    pub const CORRUPT_DROPPED: &str = "granary_warehouse_corrupt_dropped_total";
    /// Tier I/O errors (counter; label `tier`).
    pub const TIER_ERRORS: &str = "granary_warehouse_tier_errors_total";
    /// Remote-tier reads that failed verification (checksum, key, another
    /// entry's record, an unknown format): skipped, the shared object left
    /// in place (counter).
    pub const REMOTE_VERIFY_FAILED: &str = "granary_warehouse_remote_verify_failed_total";
    /// Requests served per protocol and outcome (counter; labels `protocol`, `outcome`).
    pub const REQUESTS: &str = "granary_warehouse_requests_total";
    /// Request latency per protocol (histogram; label `protocol`).
    pub const REQUEST_SECONDS: &str = "granary_warehouse_request_seconds";
    /// Open client connections per protocol (gauge; label `protocol`).
    pub const CONNECTIONS: &str = "granary_warehouse_connections";
    /// Bytes the server read from clients (counter; label `protocol`).
    pub const READ_BYTES: &str = "granary_warehouse_read_bytes_total";
    /// Bytes the server wrote to clients (counter; label `protocol`).
    pub const WRITTEN_BYTES: &str = "granary_warehouse_written_bytes_total";
    /// Client connections accepted since start (counter; label `protocol`).
    pub const CONNECTIONS_ACCEPTED: &str = "granary_warehouse_connections_accepted_total";
    /// Requests or connections refused for a protocol violation: malformed
    /// frames, oversized values (counter; label `protocol`).
    pub const PROTOCOL_ERRORS: &str = "granary_warehouse_protocol_errors_total";
    /// Offloads accepted into a slower tier's queue (counter; label `tier`).
    pub const OFFLOADS_QUEUED: &str = "granary_warehouse_offloads_queued_total";
    /// Offloads that failed to write to a slower tier (counter; label `tier`).
    pub const OFFLOAD_ERRORS: &str = "granary_warehouse_offload_errors_total";
    /// HTTP request latency (histogram; labels `method`, `route` = the route
    /// template or `unmatched`, `status` = class such as `2xx`).
    pub const HTTP_REQUEST_SECONDS: &str = "granary_warehouse_http_request_seconds";
    /// Seconds since the server started (gauge).
    pub const UPTIME_SECONDS: &str = "granary_warehouse_uptime_seconds";

    pub const ALL: &[&str] = &[
        TIER_BYTES,
        TIER_ENTRIES,
        TIER_CAPACITY_BYTES,
        HITS,
        MISSES,
        EVICTIONS,
        EXPIRATIONS,
        OFFLOADS_DROPPED,
        OFFLOADS,
        PROMOTIONS,
        RECOVERED,
        CORRUPT_DROPPED,
        TIER_ERRORS,
        REMOTE_VERIFY_FAILED,
        REQUESTS,
        REQUEST_SECONDS,
        CONNECTIONS,
        READ_BYTES,
        WRITTEN_BYTES,
        CONNECTIONS_ACCEPTED,
        PROTOCOL_ERRORS,
        OFFLOADS_QUEUED,
        OFFLOAD_ERRORS,
        HTTP_REQUEST_SECONDS,
        UPTIME_SECONDS,
    ];

    /// Counters as declared (without `_total`), for registries that append it.
    pub fn counter_base(name: &str) -> &str {
        name.strip_suffix("_total").unwrap_or(name)
    }
}

pub mod engine {
    /// Label values for where a prompt token's KV came from: computed, the
    /// engine's own memory, or a warehouse tier.
    pub const SOURCES: [&str; 5] = ["computed", "engine", "memory", "disk", "remote"];

    /// Time from arrival to the first generated token (histogram).
    pub const TTFT_SECONDS: &str = "granary_engine_ttft_seconds";
    /// Time between consecutive generated tokens of a request (histogram).
    pub const TPOT_SECONDS: &str = "granary_engine_tpot_seconds";
    /// Time from arrival to the last token (histogram).
    pub const REQUEST_SECONDS: &str = "granary_engine_request_seconds";
    /// Prompt tokens by where their KV came from (counter; label `source`).
    pub const PROMPT_TOKENS: &str = "granary_engine_prompt_tokens_total";
    /// Tokens generated (counter).
    pub const GENERATED_TOKENS: &str = "granary_engine_generated_tokens_total";
    /// Requests by outcome: finished, cancelled, failed (counter; label `outcome`).
    pub const REQUESTS: &str = "granary_engine_requests_total";
    /// Requests in the running batch (gauge).
    pub const RUNNING: &str = "granary_engine_running_requests";
    /// Requests admitted but not yet running (gauge).
    pub const WAITING: &str = "granary_engine_waiting_requests";
    /// KV blocks resident in engine memory (gauge; label `holder` = sequences or cache).
    pub const RESIDENT_BLOCKS: &str = "granary_engine_kv_resident_blocks";
    /// Throughput over the last steps (gauge; label `phase` = prefill or decode).
    pub const TOKENS_PER_SECOND: &str = "granary_engine_tokens_per_second";
    /// KV block saves to the warehouse by outcome: saved, dropped, failed (counter; label `outcome`).
    pub const BLOCK_SAVES: &str = "granary_engine_kv_block_saves_total";
    /// Warehouse calls that failed or timed out, costing hits (counter).
    pub const WAREHOUSE_ERRORS: &str = "granary_engine_warehouse_errors_total";
    /// KV blocks the engine's KV memory budget holds (gauge).
    pub const KV_BUDGET_BLOCKS: &str = "granary_engine_kv_budget_blocks";
    /// KV blocks running sequences hold after the next step, and those
    /// reserved for sequences being resumed (gauge).
    pub const KV_RESERVED_BLOCKS: &str = "granary_engine_kv_reserved_blocks";
    /// Sequences set aside for KV memory (counter; label `kv` = warehouse or recompute).
    pub const PREEMPTIONS: &str = "granary_engine_preemptions_total";
    /// KV tokens of resumed sequences (counter; label `how` = loaded or recomputed).
    pub const RESUMED_TOKENS: &str = "granary_engine_resumed_kv_tokens_total";
    /// Sequences set aside for KV memory now (gauge).
    pub const PREEMPTED: &str = "granary_engine_preempted_requests";
    /// Logits brought from the device to the host for next-token choices
    /// (counter; tensor path only: greedy rows bring one id, rows cut by
    /// `min_p` or `top_k` their candidate blocks).
    pub const LOGITS_TO_HOST: &str = "granary_engine_logits_to_host_total";

    pub const ALL: &[&str] = &[
        TTFT_SECONDS,
        TPOT_SECONDS,
        REQUEST_SECONDS,
        PROMPT_TOKENS,
        GENERATED_TOKENS,
        REQUESTS,
        RUNNING,
        WAITING,
        RESIDENT_BLOCKS,
        TOKENS_PER_SECOND,
        BLOCK_SAVES,
        WAREHOUSE_ERRORS,
        KV_BUDGET_BLOCKS,
        KV_RESERVED_BLOCKS,
        PREEMPTIONS,
        RESUMED_TOKENS,
        PREEMPTED,
        LOGITS_TO_HOST,
    ];
}

/// The gateway's metrics. The four `inference_*` names are the ones
/// inference gateways commonly export (dashboards and autoscalers look for
/// them); the rest follow the `granary_gateway_` rule.
pub mod gateway {
    /// Requests answered (counter; labels `tenant` (capped table), `model`
    /// (configured or served models, else `unknown`), `status` (HTTP code)).
    pub const REQUESTS: &str = "inference_requests_total";
    /// Time from arrival to the last byte sent (histogram; label `model`).
    pub const LATENCY_SECONDS: &str = "inference_latency_seconds";
    /// Time from arrival to the upstream's first body byte (histogram; label `model`).
    pub const TTFT_SECONDS: &str = "inference_ttft_seconds";
    /// Requests in progress (gauge).
    pub const ACTIVE_REQUESTS: &str = "inference_active_requests";
    /// Tokens by kind: prompt, completion, cached (counter; labels `tenant`, `model`, `kind`).
    pub const TOKENS: &str = "granary_gateway_tokens_total";
    /// Whether each upstream passed its last health check (gauge 0/1; label `upstream`).
    pub const UPSTREAM_UP: &str = "granary_gateway_upstream_up";
    /// Breaker state per upstream: 0 closed, 1 half-open, 2 open (gauge; label `upstream`).
    pub const BREAKER_STATE: &str = "granary_gateway_upstream_breaker_state";
    /// Requests in flight per upstream (gauge; label `upstream`).
    pub const UPSTREAM_ACTIVE: &str = "granary_gateway_upstream_active_requests";
    /// Attempts per upstream by outcome: ok, connect_error, timeout, status_5xx, status_4xx (counter; labels `upstream`, `outcome`).
    pub const UPSTREAM_ATTEMPTS: &str = "granary_gateway_upstream_attempts_total";
    /// Attempts that were retries on another upstream (counter).
    pub const RETRIES: &str = "granary_gateway_retries_total";
    /// Requests refused by a limit (counter; labels `scope` = key or tenant, `limit`).
    pub const RATE_LIMITED: &str = "granary_gateway_rate_limited_total";
    /// Requests refused before routing: auth, bad request, no access (counter; label `reason`).
    pub const REJECTED: &str = "granary_gateway_rejected_total";
    /// Requests waiting for a free upstream slot (gauge; label `priority`).
    pub const QUEUE_WAITING: &str = "granary_gateway_queue_waiting_requests";
    /// Time requests waited for a slot (histogram; label `priority`).
    pub const QUEUE_SECONDS: &str = "granary_gateway_queue_seconds";
    /// (block, upstream) pairs known from KV events (gauge).
    pub const KV_INDEX_BLOCKS: &str = "granary_gateway_kv_index_blocks";
    /// Prompt blocks the chosen upstream held, per routed request (counter; label `policy`).
    pub const ROUTED_HIT_BLOCKS: &str = "granary_gateway_routed_hit_blocks_total";
    /// Prompt blocks of routed requests (counter; label `policy`).
    pub const ROUTED_BLOCKS: &str = "granary_gateway_routed_blocks_total";
    /// Audit records dropped because the writer fell behind (counter).
    pub const AUDIT_DROPPED: &str = "granary_gateway_audit_dropped_total";
    /// Loads the gateway asked agents for, one per model at a time (counter; label `model`).
    pub const MODEL_LOAD_REQUESTS: &str = "granary_gateway_model_load_requests_total";
    /// Loads finished, by outcome: succeeded, failed (counter; labels `model`, `outcome`).
    pub const MODEL_LOADS: &str = "granary_gateway_model_loads_total";
    /// Time from asking for a load to the engine joining (histogram; label `model`).
    pub const MODEL_LOAD_SECONDS: &str = "granary_gateway_model_load_seconds";
    /// Requests held while their model loads (gauge).
    pub const MODEL_LOAD_WAITING: &str = "granary_gateway_model_load_waiting_requests";
    /// Response cache lookups and writes (counter; label `event`).
    pub const RESPONSE_CACHE: &str = "granary_gateway_response_cache_total";
    /// Spend of answered requests at the configured per-model prices, in
    /// currency units (counter; labels `tenant`, `model`, `currency`).
    pub const COST: &str = "granary_gateway_cost_total";
    /// Semantic cache lookups and writes (counter; label `event`).
    pub const SEMANTIC_CACHE: &str = "granary_gateway_semantic_cache_total";
    /// Prefill calls of disaggregated prefill/decode pairs (counter; label `outcome` = ok, failed, busy).
    pub const PREFILL: &str = "granary_gateway_prefill_total";
    /// vLLM KV event blocks and batches read (counter; label `outcome`).
    pub const VLLM_KV_EVENTS: &str = "granary_gateway_vllm_kv_events_total";
    /// Audit records waiting in the spool for the database (gauge).
    pub const AUDIT_SPOOLED: &str = "granary_gateway_audit_spooled_records";
    /// Audit batch writes the database refused (counter).
    pub const AUDIT_WRITE_ERRORS: &str = "granary_gateway_audit_write_errors_total";
    /// Limiter calls to Redis that failed or timed out (counter).
    pub const LIMITER_ERRORS: &str = "granary_gateway_limiter_errors_total";

    pub const ALL: &[&str] = &[
        REQUESTS,
        LATENCY_SECONDS,
        TTFT_SECONDS,
        ACTIVE_REQUESTS,
        TOKENS,
        UPSTREAM_UP,
        BREAKER_STATE,
        UPSTREAM_ACTIVE,
        UPSTREAM_ATTEMPTS,
        RETRIES,
        RATE_LIMITED,
        REJECTED,
        QUEUE_WAITING,
        QUEUE_SECONDS,
        KV_INDEX_BLOCKS,
        ROUTED_HIT_BLOCKS,
        ROUTED_BLOCKS,
        AUDIT_DROPPED,
        MODEL_LOAD_REQUESTS,
        MODEL_LOADS,
        MODEL_LOAD_SECONDS,
        MODEL_LOAD_WAITING,
        COST,
        RESPONSE_CACHE,
        SEMANTIC_CACHE,
        PREFILL,
        VLLM_KV_EVENTS,
        AUDIT_SPOOLED,
        AUDIT_WRITE_ERRORS,
        LIMITER_ERRORS,
    ];
}

/// The model registry's metrics.
pub mod registry {
    /// HTTP requests answered (counter; labels `method`, `route` = the route
    /// template or `unmatched`, `status` = class such as `2xx`).
    pub const HTTP_REQUESTS: &str = "granary_registry_http_requests_total";
    /// Blob bytes sent to clients (counter).
    pub const BLOB_SENT_BYTES: &str = "granary_registry_blob_sent_bytes_total";
    /// Stored blobs found missing, of the wrong size, or not matching their
    /// sha256 when fetched; the transfer was refused or aborted (counter).
    pub const INTEGRITY_FAILURES: &str = "granary_registry_integrity_failures_total";
    /// Imports by outcome: ok, conflict, invalid, failed (counter; label `outcome`).
    pub const IMPORTS: &str = "granary_registry_imports_total";
    /// Bytes of imported files, by whether they were uploaded or already
    /// stored (counter; label `stored` = uploaded or deduplicated).
    pub const IMPORTED_BYTES: &str = "granary_registry_imported_bytes_total";
    /// Blobs deleted because no revision referenced them any more (counter).
    pub const BLOBS_DELETED: &str = "granary_registry_blobs_deleted_total";
    /// Presigned download URLs handed out (counter).
    pub const PRESIGNED_URLS: &str = "granary_registry_presigned_urls_total";
    /// Catalog rows (gauge; label `kind` = models, revisions or files).
    pub const CATALOG_ENTRIES: &str = "granary_registry_catalog_entries";
    /// Sum of the revisions' sizes (gauge).
    pub const CATALOG_BYTES: &str = "granary_registry_catalog_bytes";

    pub const ALL: &[&str] = &[
        HTTP_REQUESTS,
        BLOB_SENT_BYTES,
        INTEGRITY_FAILURES,
        IMPORTS,
        IMPORTED_BYTES,
        BLOBS_DELETED,
        PRESIGNED_URLS,
        CATALOG_ENTRIES,
        CATALOG_BYTES,
    ];
}

/// Every name in the catalog, for the rule checks.
pub fn all() -> impl Iterator<Item = &'static str> {
    warehouse::ALL.iter().chain(engine::ALL).chain(gateway::ALL).chain(registry::ALL).copied()
}

/// Rewrites OpenMetrics text (as `prometheus-client` encodes it) in the Prometheus text format
/// (0.0.4), for scrapers and tools that do not speak OpenMetrics (curl
/// users, `promtool check metrics`): a counter's HELP and TYPE name its
/// `_total` series, and the `# EOF` / `# UNIT` lines go.
pub fn to_prometheus_text(openmetrics: &str) -> String {
    let counters: std::collections::HashSet<&str> =
        openmetrics.lines().filter_map(|l| l.strip_prefix("# TYPE ")?.strip_suffix(" counter")).collect();
    let mut out = String::with_capacity(openmetrics.len() + 16 * counters.len());
    for line in openmetrics.lines() {
        if line == "# EOF" || line.starts_with("# UNIT ") {
            continue;
        }
        let meta = ["# HELP ", "# TYPE "].into_iter().find_map(|p| line.strip_prefix(p).map(|rest| (p, rest)));
        match meta {
            Some((prefix, rest)) => {
                let (name, tail) = rest.split_once(' ').unwrap_or((rest, ""));
                let sep = if tail.is_empty() { "" } else { " " };
                let suffix = if counters.contains(name) { "_total" } else { "" };
                out.push_str(&format!("{prefix}{name}{suffix}{sep}{tail}"));
            }
            None => out.push_str(line),
        }
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    #[test]
    fn names_follow_the_rules() {
        let mut seen = HashSet::new();
        for name in all() {
            assert!(seen.insert(name), "{name} declared twice");
            assert!(name.starts_with("granary_") || name.starts_with("inference_"), "{name}");
            assert!(name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_'), "{name}");
            let units_ok = name.ends_with("_total")
                || name.ends_with("_seconds")
                || name.ends_with("_bytes")
                || name.ends_with("_entries")
                || name.ends_with("_connections")
                || name.ends_with("_requests")
                || name.ends_with("_records")
                || name.ends_with("_blocks")
                || name.ends_with("_per_second")
                || name.ends_with("_up")
                || name.ends_with("_state");
            assert!(units_ok, "{name} has no unit or _total suffix");
        }
        assert_eq!(warehouse::counter_base(warehouse::HITS), "granary_warehouse_hits");
    }
}

//! Whether an engine is serving, read from its Prometheus `/metrics`: the
//! request counter moving, or requests running or waiting. Scale to zero
//! unloads an engine only when one of these is known and says idle, so an
//! engine whose metrics it cannot read is never unloaded for idleness.
//!
//! Known names, from each engine's documentation:
//! - the embedded engine: `granary_engine_requests_total`,
//!   `granary_engine_running_requests`, `granary_engine_waiting_requests`;
//! - vLLM (docs.vllm.ai, "Production Metrics"): `vllm:request_success_total`,
//!   `vllm:prompt_tokens_total`, `vllm:num_requests_running`,
//!   `vllm:num_requests_waiting`;
//! - SGLang with `--enable-metrics` (docs.sglang.io, "Production Metrics"):
//!   the counters `sglang:prompt_tokens_total`, `sglang:generation_tokens_total`
//!   (and `sglang:num_requests_total` where the version has it), the gauges
//!   `sglang:num_running_reqs`, `sglang:num_queue_reqs`. The gauges alone
//!   miss a request that starts and ends between two scrapes; the counters
//!   do not;
//! - llama.cpp's `llama-server` with `--metrics` (its README, "GET
//!   /metrics"): the counters `llamacpp:prompt_tokens_total`,
//!   `llamacpp:tokens_predicted_total`, the gauges
//!   `llamacpp:requests_processing`, `llamacpp:requests_deferred`.
//!
//! Token counters move with every request, so they serve as request
//! counters here (only whether they moved matters).

use granary_core::metrics::engine;

const COUNTERS: &[&str] = &[
    engine::REQUESTS,
    "vllm:request_success_total",
    "vllm:prompt_tokens_total",
    "sglang:num_requests_total",
    "sglang:prompt_tokens_total",
    "sglang:generation_tokens_total",
    "llamacpp:prompt_tokens_total",
    "llamacpp:tokens_predicted_total",
];
const GAUGES: &[&str] = &[
    engine::RUNNING,
    engine::WAITING,
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "sglang:num_running_reqs",
    "sglang:num_queue_reqs",
    "llamacpp:requests_processing",
    "llamacpp:requests_deferred",
];

/// What one scrape says about activity.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Activity {
    /// Requests seen so far (sum over labels of the known counters).
    pub requests: f64,
    /// Requests running or waiting now.
    pub in_flight: f64,
}

/// Reads the known series from Prometheus (or OpenMetrics) text; `None`
/// when none is there.
pub fn parse(text: &str) -> Option<Activity> {
    let mut found = false;
    let mut a = Activity { requests: 0.0, in_flight: 0.0 };
    for line in text.lines() {
        if line.starts_with('#') {
            continue;
        }
        let name_end = line.find(['{', ' ']).unwrap_or(line.len());
        let name = &line[..name_end];
        let is_counter = COUNTERS.contains(&name);
        if !is_counter && !GAUGES.contains(&name) {
            continue;
        }
        // The value follows the labels; a timestamp may follow the value.
        let rest = match line[name_end..].strip_prefix('{') {
            Some(r) => r.rsplit_once('}').map_or("", |(_, v)| v),
            None => &line[name_end..],
        };
        let Some(v) = rest.split_whitespace().next().and_then(|v| v.parse::<f64>().ok()) else { continue };
        found = true;
        if is_counter {
            a.requests += v;
        } else {
            a.in_flight += v;
        }
    }
    found.then_some(a)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sums_the_engines_series() {
        let text = "# HELP granary_engine_requests_total Requests by outcome\n\
                    # TYPE granary_engine_requests_total counter\n\
                    granary_engine_requests_total{outcome=\"finished\"} 3\n\
                    granary_engine_requests_total{outcome=\"failed\"} 1\n\
                    granary_engine_running_requests 2\n\
                    granary_engine_waiting_requests 0\n\
                    granary_engine_ttft_seconds_count 4\n";
        assert_eq!(parse(text), Some(Activity { requests: 4.0, in_flight: 2.0 }));
    }

    #[test]
    fn reads_vllm_and_knows_when_it_knows_nothing() {
        let text = "vllm:num_requests_running{model_name=\"m\"} 0.0\nvllm:request_success_total{finished_reason=\"stop\",model_name=\"m\"} 7.0 1700000000\n";
        assert_eq!(parse(text), Some(Activity { requests: 7.0, in_flight: 0.0 }));
        assert_eq!(parse("process_cpu_seconds_total 3\n"), None);
    }

    /// The shapes of SGLang's and llama-server's metrics as their docs show
    /// them: a short request between two scrapes still moves a counter.
    #[test]
    fn reads_sglang_and_llama_server() {
        let sglang = "# TYPE sglang:prompt_tokens_total counter\n\
                      sglang:prompt_tokens_total{model_name=\"m\"} 8.128902e+06\n\
                      sglang:generation_tokens_total{model_name=\"m\"} 7.557572e+06\n\
                      sglang:num_running_reqs{model_name=\"m\"} 0.0\n\
                      sglang:num_queue_reqs{model_name=\"m\"} 0.0\n";
        assert_eq!(parse(sglang), Some(Activity { requests: 8.128902e6 + 7.557572e6, in_flight: 0.0 }));
        let llama = "# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed.\n\
                     # TYPE llamacpp:prompt_tokens_total counter\n\
                     llamacpp:prompt_tokens_total 6886\n\
                     llamacpp:tokens_predicted_total 3469\n\
                     llamacpp:prompt_seconds_total 2903.63\n\
                     llamacpp:requests_processing 1\n\
                     llamacpp:requests_deferred 0\n";
        assert_eq!(parse(llama), Some(Activity { requests: 6886.0 + 3469.0, in_flight: 1.0 }));
    }
}

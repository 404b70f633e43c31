//! Conversation replay: requests of the Mooncake trace (see [`super::sim`])
//! turned into real chat prompts and streamed to an OpenAI-compatible server.
//!
//! Each trace block id (512 prompt tokens in the trace, prefix-chained)
//! becomes a deterministic chunk of ordinary words, picked from a fixed word
//! list by an RNG seeded with the id and scaled down to `block_words` words
//! so the prompts fit a CPU engine. Requests that share their first k block
//! ids then share the text of their first k chunks, so an engine's prefix
//! reuse and a gateway's KV-aware routing see the trace's real sharing.
//!
//! The driver keeps the trace's arrival order and gaps (divided by
//! `speedup`), runs at most `concurrency` requests at once (an arrival waits
//! for a free slot), and stops after `requests` requests or at a deadline,
//! looping over the trace slice when it runs out. Each request streams
//! (`stream: true`, `stream_options.include_usage`); its outcome carries the
//! time to the first token and the prompt and cached tokens from `usage`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use futures::StreamExt;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};
use tokio::sync::{mpsc, Semaphore};

use super::sim::TraceRequest;

/// Words the prompts are made of: plain English, no markup.
const WORDS: &[&str] = &[
    "river", "barley", "market", "ledger", "harvest", "stone", "winter", "miller", "bread", "valley", "cart", "roof",
    "keeper", "grain", "bridge", "autumn", "village", "sack", "flour", "window", "shelf", "morning", "evening",
    "field", "orchard", "wagon", "lantern", "storm", "summer", "kettle", "garden", "meadow", "chapel", "inn", "baker",
    "weigher", "sparrow", "mouse", "plaster", "slate", "oak", "candle", "road", "hill", "farm", "yard", "door",
    "stove", "honey", "rye", "oats", "wheat", "season", "record", "clerk", "scholar", "flood", "thaw", "quiet",
    "heavy", "warm", "dry", "old", "long", "bright", "small", "careful", "early", "late", "slow",
];

/// The text of one trace block: `words` words chosen by an RNG seeded with
/// `hash_id`, each preceded by a space (so chunks join without changing
/// how the one before ends).
pub fn block_text(hash_id: u64, words: usize) -> String {
    let mut rng = StdRng::seed_from_u64(hash_id.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ 0x736f_616b);
    let mut s = String::with_capacity(words * 8);
    for _ in 0..words {
        s.push(' ');
        s.push_str(WORDS[rng.random_range(0..WORDS.len())]);
    }
    s
}

/// A request's prompt: the texts of its first `max_blocks` block ids in
/// order (0 = all of them). Shared id prefixes give shared text prefixes.
pub fn prompt_text(hash_ids: &[u64], words: usize, max_blocks: usize) -> String {
    let n = if max_blocks == 0 { hash_ids.len() } else { hash_ids.len().min(max_blocks) };
    let mut s = String::from("Continue this list of words:");
    for &h in &hash_ids[..n] {
        s.push_str(&block_text(h, words));
    }
    s
}

/// A block id under `salt` (0: the id itself).
pub fn salted(hash_id: u64, salt: u64) -> u64 {
    if salt == 0 {
        hash_id
    } else {
        hash_id ^ salt.wrapping_mul(0xd6e8_feb8_6659_fd93).rotate_left(17)
    }
}

/// Where and how the replay sends its requests.
#[derive(Debug, Clone)]
pub struct Target {
    /// Base URL of the OpenAI-compatible API (without `/v1`).
    pub base: String,
    pub api_key: Option<String>,
    pub model: String,
}

/// What the replay does with the trace.
#[derive(Debug, Clone)]
pub struct ReplayConfig {
    pub block_words: usize,
    /// Blocks of a request kept (0 = all); the prefix is kept, so sharing is.
    pub max_blocks: usize,
    pub max_tokens: usize,
    /// Trace time is divided by this; 0 = no pacing (as fast as slots free).
    pub speedup: f64,
    pub concurrency: usize,
    /// Requests in all (0 = bounded by the deadline only).
    pub requests: u64,
    pub request_timeout: Duration,
    /// Mixed into every block id: replays with different salts share no
    /// text (so no KV), the same salt the same text.
    pub salt: u64,
}

/// How one request ended.
#[derive(Debug, Clone)]
pub struct Outcome {
    /// When it ended, from the start of the replay.
    pub done: Duration,
    pub result: Result<Answer, String>,
}

/// A successful request's figures.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Answer {
    pub ttft: Duration,
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
    pub completion_tokens: u64,
}

/// Reads `/v1/models` and returns the first model's id.
pub async fn first_model(http: &reqwest::Client, target_base: &str, key: Option<&str>) -> Result<String> {
    let mut req = http.get(format!("{target_base}/v1/models"));
    if let Some(k) = key {
        req = req.bearer_auth(k);
    }
    let r = req.send().await.with_context(|| format!("GET {target_base}/v1/models"))?;
    let status = r.status();
    let v: Value = r.json().await.with_context(|| format!("GET {target_base}/v1/models: not JSON"))?;
    if !status.is_success() {
        bail!("GET {target_base}/v1/models: {status} {v}");
    }
    v["data"][0]["id"]
        .as_str()
        .map(str::to_string)
        .with_context(|| format!("GET {target_base}/v1/models lists no model: {v}"))
}

/// Streams one chat completion; an error is any non-2xx answer, a stream
/// error, a stream without a token or without usage, or a timeout.
pub async fn chat(
    http: &reqwest::Client,
    t: &Target,
    prompt: &str,
    max_tokens: usize,
    timeout: Duration,
) -> Result<Answer> {
    let body = json!({
        "model": t.model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": true,
        "stream_options": {"include_usage": true},
    });
    let t0 = Instant::now();
    let go = async {
        let mut req = http.post(format!("{}/v1/chat/completions", t.base)).json(&body);
        if let Some(k) = &t.api_key {
            req = req.bearer_auth(k);
        }
        let r = req.send().await.context("sending")?;
        let status = r.status();
        if !status.is_success() {
            bail!("{status} {}", r.text().await.unwrap_or_default());
        }
        let mut stream = r.bytes_stream();
        let mut buf = Vec::new();
        let (mut first, mut usage, mut done) = (None, None, false);
        while let Some(chunk) = stream.next().await {
            buf.extend_from_slice(&chunk.context("reading the stream")?);
            while let Some(i) = buf.iter().position(|&b| b == b'\n') {
                let line: Vec<u8> = buf.drain(..=i).collect();
                let line = String::from_utf8_lossy(&line);
                let Some(data) = line.trim().strip_prefix("data:").map(str::trim) else { continue };
                if data == "[DONE]" {
                    done = true;
                    continue;
                }
                let v: Value = serde_json::from_str(data).with_context(|| format!("a stream chunk: {data}"))?;
                if let Some(e) = v.get("error") {
                    bail!("the stream failed: {e}");
                }
                if let Some(c) = v["choices"].get(0) {
                    let content = c["delta"]["content"].as_str().is_some_and(|s| !s.is_empty());
                    if first.is_none() && (content || !c["finish_reason"].is_null()) {
                        first = Some(t0.elapsed());
                    }
                }
                if v["usage"].is_object() {
                    usage = Some(v["usage"].clone());
                }
            }
        }
        if !done {
            bail!("the stream ended without [DONE]");
        }
        let ttft = first.context("the stream ended without a token")?;
        let u = usage.context("the stream carried no usage (stream_options.include_usage)")?;
        Ok(Answer {
            ttft,
            prompt_tokens: u["prompt_tokens"].as_u64().unwrap_or(0),
            cached_tokens: u["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap_or(0),
            completion_tokens: u["completion_tokens"].as_u64().unwrap_or(0),
        })
    };
    match tokio::time::timeout(timeout, go).await {
        Ok(r) => r,
        Err(_) => bail!("timed out after {timeout:?}"),
    }
}

/// Replays `trace` against `target` until `deadline` or `cfg.requests`
/// requests; every outcome goes to `out` as it happens. Returns the number
/// of requests sent. Requests still running at the deadline are awaited (a
/// request is never cut short by the deadline, only by its timeout).
pub async fn drive(
    http: reqwest::Client,
    target: Target,
    cfg: ReplayConfig,
    trace: Arc<Vec<TraceRequest>>,
    deadline: Instant,
    out: mpsc::UnboundedSender<Outcome>,
) -> Result<u64> {
    anyhow::ensure!(!trace.is_empty(), "the trace slice is empty");
    anyhow::ensure!(cfg.concurrency > 0, "--concurrency must be at least 1");
    let start = Instant::now();
    let slots = Arc::new(Semaphore::new(cfg.concurrency));
    let first_ts = trace[0].timestamp;
    // One pass of the trace, in trace ms, so the next pass follows on.
    let span = trace.last().map_or(0, |r| r.timestamp - first_ts) + 1;
    let mut sent = 0u64;
    let mut tasks = tokio::task::JoinSet::new();
    'outer: for pass in 0u64.. {
        for req in trace.iter() {
            if cfg.requests != 0 && sent >= cfg.requests {
                break 'outer;
            }
            if cfg.speedup > 0.0 {
                let trace_ms = pass * span + (req.timestamp - first_ts);
                let at = start + Duration::from_secs_f64(trace_ms as f64 / 1e3 / cfg.speedup);
                if at >= deadline {
                    break 'outer;
                }
                tokio::time::sleep_until(at.into()).await;
            }
            let permit = tokio::select! {
                p = slots.clone().acquire_owned() => p.expect("the semaphore is never closed"),
                _ = tokio::time::sleep_until(deadline.into()) => break 'outer,
            };
            if Instant::now() >= deadline {
                break 'outer;
            }
            let ids: Vec<u64> = req.hash_ids.iter().map(|&h| salted(h, cfg.salt)).collect();
            let prompt = prompt_text(&ids, cfg.block_words, cfg.max_blocks);
            let (http, target, out) = (http.clone(), target.clone(), out.clone());
            let (max_tokens, timeout) = (cfg.max_tokens, cfg.request_timeout);
            sent += 1;
            tasks.spawn(async move {
                let result = chat(&http, &target, &prompt, max_tokens, timeout).await.map_err(|e| format!("{e:#}"));
                let _ = out.send(Outcome { done: start.elapsed(), result });
                drop(permit);
            });
            // Reap finished tasks so the set stays small on long runs.
            while tasks.try_join_next().is_some() {}
        }
    }
    while tasks.join_next().await.is_some() {}
    Ok(sent)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shared_id_prefixes_share_text_prefixes() {
        let a = prompt_text(&[7, 8, 9], 24, 0);
        let b = prompt_text(&[7, 8, 10], 24, 0);
        let shared = prompt_text(&[7, 8], 24, 0);
        assert!(a.starts_with(&shared) && b.starts_with(&shared), "{a}\n{b}");
        assert_ne!(a, b);
        // The third chunks differ from their first word on.
        let (ta, tb) = (&a[shared.len()..], &b[shared.len()..]);
        assert_eq!(ta, block_text(9, 24));
        assert_ne!(ta.split(' ').nth(1), None);
        assert_ne!(ta, tb);
    }

    #[test]
    fn blocks_are_deterministic_and_sized() {
        assert_eq!(block_text(42, 24), block_text(42, 24));
        assert_eq!(block_text(42, 24).split_whitespace().count(), 24);
        assert_eq!(block_text(42, 5).split_whitespace().count(), 5);
        // Different ids give different text (over many ids, no collision).
        let texts: std::collections::HashSet<String> = (0..2000).map(|h| block_text(h, 24)).collect();
        assert_eq!(texts.len(), 2000);
        assert!(block_text(1, 24).split_whitespace().all(|w| WORDS.contains(&w)));
    }

    #[test]
    fn max_blocks_keeps_the_prefix() {
        let with = |salt| prompt_text(&[1, 2].map(|h| salted(h, salt)), 8, 0);
        assert_eq!(with(0), prompt_text(&[1, 2], 8, 0), "salt 0 is no salt");
        assert_eq!(with(5), with(5));
        assert_ne!(block_text(salted(1, 1), 8), block_text(salted(1, 2), 8), "other salts, other text");
        assert_ne!(block_text(salted(1, 1), 8), block_text(1, 8));
        let full = prompt_text(&[1, 2, 3, 4], 8, 0);
        let cut = prompt_text(&[1, 2, 3, 4], 8, 2);
        assert_eq!(cut, prompt_text(&[1, 2], 8, 0));
        assert!(full.starts_with(&cut) && full.len() > cut.len());
    }
}

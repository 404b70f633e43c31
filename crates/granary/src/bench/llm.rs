//! What the model benchmarks (`ttft`, `engine`) share: loading the model
//! as `granary engine` does, prompts of an exact token count made of real
//! text, and one request timed event by event.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use granary_core::ByteSize;
use granary_engine::engine::{BlockStore, Engine, EngineConfig, Role};
use granary_engine::model::Model;
use granary_engine::{Event, GenerateRequest, SamplingParams, Usage};
use granary_tokenizer::Tokenizer;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

use crate::engine::ModelArgs;

/// A loaded model with what the benchmarks print about it.
pub struct Loaded {
    pub model: Arc<Model>,
    pub tokenizer: Arc<Tokenizer>,
    pub id: String,
    pub path: std::path::PathBuf,
    /// Bytes of K and V per token, f16 (what a block holds per token).
    pub kv_bytes_per_token: usize,
}

/// Loads `source` (a `--model` value) on `device` (a `--device` value:
/// `cpu`, `cuda[:N]`) exactly as `granary engine` does.
pub fn load(source: &str, device: &str) -> Result<Loaded> {
    let args = ModelArgs {
        model: source.to_string(),
        model_id: None,
        listen: "127.0.0.1:0".into(),
        block_tokens: 256,
        max_batch_tokens: 512,
        max_running: 64,
        kv_cache: ByteSize::mib(512),
        kv_cache_per_namespace: ByteSize(0),
        kv_memory: None,
        max_context: None,
        device: device.to_string(),
        trust_namespace_header: false,
        tokenizer: None,
        sampling: None,
        checkpoint: "auto".into(),
    };
    let (model, tokenizer, id) = tokio::task::block_in_place(|| crate::engine::load(&args))?;
    let path = model.source().to_path_buf();
    let kv_bytes_per_token = model.config().kv_bytes_per_token(2);
    Ok(Loaded { model, tokenizer, id, path, kv_bytes_per_token })
}

/// The engine settings of `granary engine` with the given block size,
/// batch budget and local cache.
pub fn engine_config(id: &str, block_tokens: usize, max_batch_tokens: usize, local_cache: usize) -> EngineConfig {
    EngineConfig {
        model_id: id.to_string(),
        block_tokens,
        role: Role::Both,
        max_batch_tokens,
        max_running: 64,
        local_cache_bytes: local_cache,
        ..Default::default()
    }
}

pub fn start(m: &Loaded, cfg: EngineConfig, store: Option<Arc<dyn BlockStore>>) -> Result<Engine> {
    Engine::start(cfg, m.model.clone(), m.tokenizer.clone(), store)
}

/// Sentences the prompts are made of (plain prose, written for these
/// benchmarks), shuffled per prompt so no two prompts share a prefix.
const SENTENCES: &[&str] = &[
    "The granary stood at the edge of the river town, a long stone building with a slate roof and shutters painted the colour of dry moss.",
    "Every autumn the carts came down from the hill farms, heavy with barley, oats and rye, and the weighers at the door wrote each load into a ledger bound in calfskin.",
    "The keeper of the granary was a patient woman who knew the moisture of grain by the sound it made when poured from one hand into the other.",
    "In wet years she opened the upper vents at dawn and closed them at noon, so that the warm air rose through the bins and carried the damp away before the mould could take hold.",
    "Children from the lower streets were paid a penny a day to chase the sparrows from the loading yard, and most of them spent the penny on honey cakes before sundown.",
    "The ledgers were kept in a cabinet of oak beside the stove, and no page was ever torn out, for the town believed that a record once written belonged to everyone who came after.",
    "When the river froze the barges stopped, and the granary became the one place in the valley where a family could be certain of bread until the thaw.",
    "Travelling merchants argued over prices in the square, but they spoke quietly inside the granary, as if the stacked sacks were listening.",
    "The millers of the three villages took turns at the great stones, and each one swore that his flour was the finest, though the bakers could never tell them apart.",
    "A clerk once tried to count every grain in a single sack and gave up after a week, having reached a number so large that nobody would believe him.",
    "In the spring the keeper walked the empty bins with a lamp, looking for cracks in the plaster where the mice had found their way in during the long nights.",
    "The old men said that a town is only as wise as its storehouse, because a harvest saved is a year of worry spared.",
    "Rain drummed on the slate for days at a time in November, and the smell of wet stone mixed with the sweet dust of the threshing floor.",
    "On market days the doors stood open from first light, and the queue of carts reached back past the bridge and the chapel to the crossroads by the inn.",
    "Scholars who came to study the ledgers found in them the whole history of the valley: the good years and the lean, the floods, the fevers and the weddings paid for in wheat.",
    "At the end of each season the keeper closed the last ledger, blew the dust from its cover and set it on the shelf beside the others, one more year remembered.",
];

/// A prompt of exactly `tokens` tokens: real text, tokenized with the
/// model's tokenizer, different for every `salt` from its first token on.
pub fn prompt(tok: &Tokenizer, tokens: usize, salt: u64) -> Result<Vec<u32>> {
    if tokens == 0 {
        bail!("a prompt needs at least one token");
    }
    let mut rng = StdRng::seed_from_u64(0x6772_616e ^ salt.wrapping_mul(0x9e37_79b9_7f4a_7c15));
    let mut text = format!("Record {salt} of the valley archive, volume {}.\n\n", rng.random_range(1..1000));
    let mut ids = Vec::new();
    let mut chapter = 1;
    while ids.len() < tokens {
        // About 4 characters a token in English prose: grow, then check.
        let want_chars = text.len() + (tokens - ids.len()) * 5 + 64;
        while text.len() < want_chars {
            text.push_str(&format!("Chapter {chapter}. "));
            chapter += 1;
            let mut order: Vec<&str> = SENTENCES.to_vec();
            order.shuffle(&mut rng);
            for s in order.iter().take(rng.random_range(5..=SENTENCES.len())) {
                text.push_str(s);
                text.push(' ');
            }
            text.push_str("\n\n");
        }
        ids = tok.encode(&text, false).context("tokenizing the benchmark prompt")?;
    }
    ids.truncate(tokens);
    Ok(ids)
}

/// A greedy request for `prompt` that ignores end-of-text tokens, so it
/// generates exactly `max_tokens` (the timing covers a fixed amount of work).
pub fn request(namespace: &str, prompt: Vec<u32>, max_tokens: usize) -> GenerateRequest {
    GenerateRequest {
        namespace: namespace.to_string(),
        prompt,
        max_tokens,
        sampling: SamplingParams { seed: Some(0), ..SamplingParams::greedy() },
        stop_token_ids: Vec::new(),
        min_tokens: 0,
        constraint: None,
        priority: 0,
    }
}

/// One request's timeline, every time measured from the caller's `t0`.
#[derive(Debug, Clone)]
pub struct Timeline {
    /// The generated tokens and when each arrived.
    pub tokens: Vec<(u32, Duration)>,
    pub usage: Usage,
    /// Each token's top alternatives (id, log probability), when the
    /// request asked for them.
    pub top: Vec<Vec<(u32, f32)>>,
}

impl Timeline {
    /// Time to the first token.
    pub fn ttft(&self) -> Duration {
        self.tokens.first().map_or(Duration::ZERO, |t| t.1)
    }

    pub fn ids(&self) -> Vec<u32> {
        self.tokens.iter().map(|t| t.0).collect()
    }
}

/// Submits `req` and follows it to the end; times are from `t0` (taken by
/// the caller just before, so the submission itself is timed).
pub async fn run(engine: &Engine, req: GenerateRequest, t0: Instant) -> Result<Timeline> {
    let mut rx = engine.generate(req).map_err(|e| anyhow::anyhow!("request refused: {e}"))?;
    let mut tokens = Vec::new();
    let mut top = Vec::new();
    while let Some(ev) = rx.recv().await {
        match ev {
            Event::Started { .. } => {}
            Event::Logprobs(lp) => top.push(lp.top),
            Event::Token(t) => tokens.push((t, t0.elapsed())),
            Event::Finished { usage, .. } => {
                if tokens.is_empty() {
                    bail!("the request finished without a token");
                }
                return Ok(Timeline { tokens, usage, top });
            }
            Event::Failed(e) => bail!("the request failed: {e}"),
        }
    }
    bail!("the engine dropped the request without finishing it")
}

pub fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// The median of `xs` (the mean of the middle two for an even count).
pub fn median(xs: &[f64]) -> f64 {
    if xs.is_empty() {
        return f64::NAN;
    }
    let mut v = xs.to_vec();
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

#[cfg(test)]
mod tests {
    use super::median;

    #[test]
    fn medians() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), 2.5);
        assert!(median(&[]).is_nan());
    }
}

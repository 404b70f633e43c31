//! The contract between the OpenAI layer ([`crate::api`]) and whatever
//! generates tokens ([`Backend`]).

use std::sync::Arc;

use granary_tokenizer::Tokenizer;
use tokio::sync::mpsc;

/// Sampling settings of one request, already validated and resolved
/// against the model's defaults ([`SamplingDefaults`]).
///
/// Applied in vLLM's order: `logit_bias`, then the penalties (repetition
/// over prompt and output, presence and frequency over the output), then
/// temperature; at temperature 0 the highest logit wins; otherwise `min_p`,
/// `top_k` and `top_p` cut the candidates and one is drawn.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// 0 means greedy.
    pub temperature: f32,
    /// In (0, 1]; 1 disables nucleus filtering.
    pub top_p: f32,
    /// Keep the `top_k` most likely tokens; 0 disables it.
    pub top_k: usize,
    /// Drop tokens less likely than `min_p` times the most likely; 0 disables it.
    pub min_p: f32,
    /// OpenAI's: subtracted once from every token already generated.
    pub presence_penalty: f32,
    /// OpenAI's: subtracted once per earlier occurrence in the output.
    pub frequency_penalty: f32,
    /// vLLM's / transformers': logits of tokens in the prompt or the output
    /// are divided by it when positive, multiplied when negative; 1 disables it.
    pub repetition_penalty: f32,
    /// Added to the logits of these token ids (OpenAI's `logit_bias`).
    pub logit_bias: Vec<(u32, f32)>,
    pub seed: Option<u64>,
    /// Return the chosen token's log probability and this many alternatives.
    pub logprobs: Option<usize>,
}

impl SamplingParams {
    /// Always the highest logit.
    pub fn greedy() -> Self {
        SamplingParams { temperature: 0.0, ..Default::default() }
    }
}

impl Default for SamplingParams {
    /// Plain sampling from the model's distribution (temperature 1, no cuts).
    fn default() -> Self {
        SamplingParams {
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            min_p: 0.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            repetition_penalty: 1.0,
            logit_bias: Vec::new(),
            seed: None,
            logprobs: None,
        }
    }
}

/// What a request gets for the sampling fields it leaves out: the model's
/// `generation_config.json` where it has one, else llama.cpp server's
/// defaults, and in both cases what the operator set (`--sampling`).
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct SamplingDefaults {
    pub temperature: f32,
    pub top_p: f32,
    pub top_k: usize,
    pub min_p: f32,
    pub repetition_penalty: f32,
}

impl Default for SamplingDefaults {
    /// llama.cpp server's (`llama-server --help`): temperature 0.8, top_k
    /// 40, top_p 0.95, min_p 0.05, no repetition penalty.
    fn default() -> Self {
        SamplingDefaults { temperature: 0.8, top_p: 0.95, top_k: 40, min_p: 0.05, repetition_penalty: 1.0 }
    }
}

impl SamplingDefaults {
    /// Overrides from a Hugging Face `generation_config.json`. When it sets
    /// `do_sample: false` the default is greedy. Keys it lacks keep their
    /// current values.
    pub fn apply_generation_config(&mut self, text: &str) -> anyhow::Result<()> {
        let v: serde_json::Value = serde_json::from_str(text)?;
        let f = |k: &str| v.get(k).and_then(serde_json::Value::as_f64).map(|x| x as f32);
        if let Some(t) = f("temperature") {
            self.temperature = t;
        }
        if let Some(p) = f("top_p") {
            self.top_p = p;
        }
        if let Some(k) = v.get("top_k").and_then(serde_json::Value::as_u64) {
            self.top_k = k as usize;
        }
        if let Some(p) = f("min_p") {
            self.min_p = p;
        }
        if let Some(r) = f("repetition_penalty") {
            self.repetition_penalty = r;
        }
        if v.get("do_sample").and_then(serde_json::Value::as_bool) == Some(false) {
            self.temperature = 0.0;
        }
        self.check()
    }

    /// Overrides from `key=value,...` (`temperature`, `top_p`, `top_k`,
    /// `min_p`, `repetition_penalty`), as `--sampling` takes them.
    pub fn apply_overrides(&mut self, spec: &str) -> anyhow::Result<()> {
        for part in spec.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (k, v) = part.split_once('=').ok_or_else(|| anyhow::anyhow!("{part:?}: expected KEY=VALUE"))?;
            let num = || v.trim().parse::<f32>().map_err(|_| anyhow::anyhow!("{k}={v}: not a number"));
            match k.trim() {
                "temperature" => self.temperature = num()?,
                "top_p" => self.top_p = num()?,
                "top_k" => self.top_k = v.trim().parse().map_err(|_| anyhow::anyhow!("top_k={v}: not a count"))?,
                "min_p" => self.min_p = num()?,
                "repetition_penalty" => self.repetition_penalty = num()?,
                other => anyhow::bail!(
                    "unknown sampling setting {other:?} (known: temperature, top_p, top_k, min_p, repetition_penalty)"
                ),
            }
        }
        self.check()
    }

    fn check(&self) -> anyhow::Result<()> {
        anyhow::ensure!((0.0..=2.0).contains(&self.temperature), "temperature {} is not in [0, 2]", self.temperature);
        anyhow::ensure!(self.top_p > 0.0 && self.top_p <= 1.0, "top_p {} is not in (0, 1]", self.top_p);
        anyhow::ensure!((0.0..=1.0).contains(&self.min_p), "min_p {} is not in [0, 1]", self.min_p);
        anyhow::ensure!(
            self.repetition_penalty > 0.0,
            "repetition_penalty {} must be positive",
            self.repetition_penalty
        );
        Ok(())
    }
}

/// Log probabilities of one generated token (natural log, of the model's
/// distribution before any sampling setting).
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprobs {
    pub logprob: f32,
    /// The most likely tokens, most likely first, as many as asked for.
    pub top: Vec<(u32, f32)>,
}

/// One generation request in tokens.
#[derive(Debug, Clone)]
pub struct GenerateRequest {
    /// Tenant namespace: KV blocks are only shared within one namespace.
    pub namespace: String,
    pub prompt: Vec<u32>,
    /// Upper bound on generated tokens (already clamped to the context).
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    /// Token ids that end generation (EOS, end of turn); the stop token is
    /// not returned.
    pub stop_token_ids: Vec<u32>,
    /// Generated tokens before which `stop_token_ids` cannot end the answer
    /// (vLLM's `min_tokens`): until then they are never sampled.
    pub min_tokens: usize,
    /// A grammar the output must follow (structured outputs, tool calls).
    pub constraint: Option<crate::constraint::Constraint>,
    /// Scheduling priority, vLLM's convention: lower values are more
    /// important (0 is the default). When KV memory runs short the engine
    /// sets aside the highest value first.
    pub priority: i32,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// A stop token was generated (or, decided by the API layer, a stop string).
    Stop,
    /// `max_tokens` reached.
    Length,
    /// The answer is tool calls (decided by the API layer).
    ToolCalls,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::ToolCalls => "tool_calls",
        }
    }
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    /// Prompt tokens whose KV was loaded instead of computed.
    pub cached_tokens: usize,
}

/// What a running request reports, in order: `Started` once its prompt is
/// admitted (backends may omit it), zero or more `Token`s, then exactly one
/// `Finished` or `Failed`. Dropping the receiver cancels the request and
/// frees its KV.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// The prompt was admitted; `cached_tokens` of it were loaded, not computed.
    Started {
        cached_tokens: usize,
    },
    Token(u32),
    /// The log probabilities of the token that follows (only when the
    /// request asked for them).
    Logprobs(Box<TokenLogprobs>),
    Finished {
        reason: FinishReason,
        usage: Usage,
    },
    Failed(String),
}

/// Why a request was refused before it started.
#[derive(Debug, thiserror::Error)]
pub enum SubmitError {
    /// Prompt plus at least one generated token exceed the context.
    #[error("this model's maximum context length is {limit} tokens; the prompt has {prompt} tokens")]
    ContextExceeded { limit: usize, prompt: usize },
    #[error("the prompt is empty")]
    EmptyPrompt,
    #[error("the engine is shutting down")]
    ShuttingDown,
    /// The prompt and `max_tokens` need more KV memory than the engine has.
    #[error("the request needs KV memory for {needed} tokens; the engine holds {budget}")]
    KvMemory { budget: usize, needed: usize },
    /// The engine cannot serve (its step thread stopped).
    #[error("the engine is unavailable: {0}")]
    Unavailable(String),
}

/// A model the backend serves.
#[derive(Clone)]
pub struct ModelInfo {
    /// The id clients put in `model`.
    pub id: String,
    pub context_len: usize,
    pub tokenizer: Arc<Tokenizer>,
    /// Unix seconds when it was loaded.
    pub created: u64,
    /// Sampling settings for fields a request leaves out.
    pub sampling: SamplingDefaults,
}

/// Generates tokens for the API layer.
pub trait Backend: Send + Sync + 'static {
    fn models(&self) -> Vec<ModelInfo>;
    /// Starts a request for model `model` (an id from [`Backend::models`]).
    fn submit(&self, model: &str, req: GenerateRequest) -> Result<mpsc::UnboundedReceiver<Event>, SubmitError>;
    /// Prometheus text exposition of the backend's metrics.
    fn metrics_text(&self) -> String;
    /// `Err` with the reason when the backend cannot serve (a dead or
    /// stalled step thread, a wedged KV loader).
    fn health(&self) -> Result<(), String> {
        Ok(())
    }
    /// The embedding of `tokens` under model `model` (blocking CPU work:
    /// callers run it off the async threads); `None` when this backend
    /// serves no embeddings.
    fn embed(&self, _model: &str, _tokens: &[u32]) -> Option<anyhow::Result<Vec<f32>>> {
        None
    }
    /// The log probability of each of `tokens` after the first given those
    /// before it, with the `top` most likely at each position (blocking CPU
    /// work, like [`Backend::embed`]); `None` when this backend does not
    /// compute them.
    fn prompt_logprobs(
        &self,
        _model: &str,
        _tokens: &[u32],
        _top: usize,
    ) -> Option<anyhow::Result<Vec<TokenLogprobs>>> {
        None
    }
}

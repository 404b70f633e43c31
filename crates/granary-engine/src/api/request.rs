//! Request bodies of `/v1/chat/completions` and `/v1/completions`, and their
//! validation into a [`Validated`] request that only needs tokenizing.
//!
//! Type errors are caught while parsing (see [`super::body`]); range and
//! support checks happen in [`ChatRequest::validate`] and
//! [`CompletionRequest::validate`]. A field this server does not know is
//! refused with a 400 naming it (`unknown_parameter`), as OpenAI's API
//! does; OpenAI's fields that ask nothing of generation (`user`,
//! `metadata`...) are accepted (see [`check_no_action`]); fields it knows
//! and cannot honour (`functions`, audio, `store: true`...) are refused
//! with a 400 naming them, never ignored. Structured outputs
//! and tools are read in [`super::structured`].

use granary_tokenizer::{ChatMessage, TemplateKwargs};
use serde::Deserialize;

use super::error::ApiError;
use super::stop::TextRules;
use super::structured::{tools_spec, FormatFields, OutputGrammar, ToolChoice, ToolsSpec};
use crate::types::{SamplingDefaults, SamplingParams};

mod messages;
mod shared;
mod values;

pub(crate) use messages::{chat_message, ChatRender, Message};
pub(crate) use values::{Prompt, Seed, Stop};

/// Most stop sequences per request (OpenAI's limit).
pub const MAX_STOP_SEQUENCES: usize = 4;

/// The body of `POST /v1/chat/completions`. A field not named here is
/// refused (`unknown_parameter`), as OpenAI's API does.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct ChatRequest {
    pub model: String,
    pub messages: Vec<Message>,
    #[serde(default)]
    pub max_tokens: Option<u64>,
    #[serde(default)]
    pub max_completion_tokens: Option<u64>,
    #[serde(default)]
    pub temperature: Option<f64>,
    #[serde(default)]
    pub top_p: Option<f64>,
    #[serde(default)]
    pub n: Option<u64>,
    #[serde(default)]
    pub seed: Option<Seed>,
    #[serde(default)]
    pub stop: Option<Stop>,
    #[serde(default)]
    pub stream: Option<bool>,
    #[serde(default)]
    pub stream_options: Option<StreamOptions>,
    #[serde(default)]
    pub presence_penalty: Option<f64>,
    #[serde(default)]
    pub frequency_penalty: Option<f64>,
    #[serde(default)]
    pub logprobs: Option<bool>,
    #[serde(default)]
    pub top_logprobs: Option<u64>,
    #[serde(default)]
    pub top_k: Option<i64>,
    #[serde(default)]
    pub min_p: Option<f64>,
    #[serde(default)]
    pub repetition_penalty: Option<f64>,
    /// vLLM's scheduling priority: lower is more important.
    #[serde(default)]
    pub priority: Option<i64>,
    /// vLLM's `ignore_eos`: generate up to `max_tokens` past the model's
    /// end-of-sequence tokens (what serving benchmarks send).
    #[serde(default)]
    pub ignore_eos: Option<bool>,
    /// vLLM's `min_tokens`: tokens generated before a stop token or stop
    /// string may end the answer.
    #[serde(default)]
    pub min_tokens: Option<u64>,
    /// vLLM's `stop_token_ids`: token ids that end the answer, as the
    /// model's end-of-sequence tokens do.
    #[serde(default)]
    pub stop_token_ids: Option<Vec<u32>>,
    /// vLLM's `include_stop_str_in_output`: the stop string found stays in
    /// the answer.
    #[serde(default)]
    pub include_stop_str_in_output: Option<bool>,
    /// vLLM's `skip_special_tokens` (true by default): false writes special
    /// tokens out in the answer's text.
    #[serde(default)]
    pub skip_special_tokens: Option<bool>,
    /// Token id (as a string) to a bias in [-100, 100].
    #[serde(default)]
    pub logit_bias: Option<std::collections::BTreeMap<String, f64>>,
    /// vLLM's and llama.cpp's structured-output fields.
    #[serde(default)]
    pub guided_json: Option<serde_json::Value>,
    #[serde(default)]
    pub guided_regex: Option<serde_json::Value>,
    #[serde(default)]
    pub guided_choice: Option<serde_json::Value>,
    #[serde(default)]
    pub guided_grammar: Option<serde_json::Value>,
    #[serde(default)]
    pub grammar: Option<serde_json::Value>,
    #[serde(default)]
    pub json_schema: Option<serde_json::Value>,
    #[serde(default)]
    pub tools: Option<serde_json::Value>,
    #[serde(default)]
    pub tool_choice: Option<serde_json::Value>,
    #[serde(default)]
    pub functions: Option<serde_json::Value>,
    #[serde(default)]
    pub function_call: Option<serde_json::Value>,
    #[serde(default)]
    pub response_format: Option<serde_json::Value>,
    #[serde(default)]
    pub parallel_tool_calls: Option<bool>,
    #[serde(default)]
    pub modalities: Option<Vec<String>>,
    #[serde(default)]
    pub audio: Option<serde_json::Value>,
    #[serde(default)]
    pub prediction: Option<serde_json::Value>,
    #[serde(default)]
    pub web_search_options: Option<serde_json::Value>,
    /// vLLM's `chat_template_kwargs`: variables of the request's own for
    /// the model's chat template (Qwen 3's `enable_thinking`).
    #[serde(default)]
    pub chat_template_kwargs: Option<TemplateKwargs>,
    /// vLLM's: end the prompt with the assistant turn's opening (true
    /// unless `continue_final_message`).
    #[serde(default)]
    pub add_generation_prompt: Option<bool>,
    /// vLLM's: end the prompt inside the last (assistant's) message, so
    /// that the answer continues it.
    #[serde(default)]
    pub continue_final_message: Option<bool>,
    /// OpenAI fields that ask nothing of generation, checked in
    /// [`check_no_action`]; the identifiers are taken and not used.
    #[serde(default)]
    #[allow(dead_code)]
    pub user: Option<String>,
    #[serde(default)]
    pub metadata: Option<std::collections::BTreeMap<String, String>>,
    #[serde(default)]
    pub store: Option<bool>,
    #[serde(default)]
    pub service_tier: Option<String>,
    #[serde(default)]
    #[allow(dead_code)]
    pub prompt_cache_key: Option<String>,
    #[serde(default)]
    #[allow(dead_code)]
    pub safety_identifier: Option<String>,
}

/// Sampling fields beyond OpenAI's that vLLM and llama.cpp servers take,
/// OpenAI's `logit_bias`, and structured-output fields of other servers.
#[derive(Debug, Default)]
struct ExtraSampling {
    top_k: Option<i64>,
    min_p: Option<f64>,
    repetition_penalty: Option<f64>,
    logit_bias: Option<std::collections::BTreeMap<String, f64>>,
    priority: Option<i64>,
    ignore_eos: Option<bool>,
    min_tokens: Option<u64>,
    stop_token_ids: Option<Vec<u32>>,
    include_stop_str_in_output: Option<bool>,
    skip_special_tokens: Option<bool>,
    /// Structured-output fields.
    format: FormatFields,
}

macro_rules! extra_of {
    ($r:expr) => {
        ExtraSampling {
            top_k: $r.top_k,
            min_p: $r.min_p,
            repetition_penalty: $r.repetition_penalty,
            logit_bias: $r.logit_bias,
            priority: $r.priority,
            ignore_eos: $r.ignore_eos,
            min_tokens: $r.min_tokens,
            stop_token_ids: $r.stop_token_ids,
            include_stop_str_in_output: $r.include_stop_str_in_output,
            skip_special_tokens: $r.skip_special_tokens,
            format: FormatFields {
                response_format: $r.response_format,
                guided_json: $r.guided_json,
                guided_regex: $r.guided_regex,
                guided_choice: $r.guided_choice,
                guided_grammar: $r.guided_grammar,
                json_schema: $r.json_schema,
                grammar: $r.grammar,
            },
        }
    };
}

fn is_set(v: &Option<serde_json::Value>) -> bool {
    v.as_ref().is_some_and(|v| !v.is_null())
}

/// The body of `POST /v1/completions`. A field not named here is refused.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct CompletionRequest {
    pub model: String,
    pub prompt: Prompt,
    #[serde(default)]
    pub max_tokens: Option<u64>,
    #[serde(default)]
    pub temperature: Option<f64>,
    #[serde(default)]
    pub top_p: Option<f64>,
    #[serde(default)]
    pub n: Option<u64>,
    #[serde(default)]
    pub seed: Option<Seed>,
    #[serde(default)]
    pub stop: Option<Stop>,
    #[serde(default)]
    pub stream: Option<bool>,
    #[serde(default)]
    pub stream_options: Option<StreamOptions>,
    #[serde(default)]
    pub presence_penalty: Option<f64>,
    #[serde(default)]
    pub frequency_penalty: Option<f64>,
    #[serde(default)]
    pub logprobs: Option<u64>,
    #[serde(default)]
    pub echo: Option<bool>,
    #[serde(default)]
    pub best_of: Option<u64>,
    #[serde(default)]
    pub suffix: Option<String>,
    #[serde(default)]
    pub top_k: Option<i64>,
    #[serde(default)]
    pub min_p: Option<f64>,
    #[serde(default)]
    pub repetition_penalty: Option<f64>,
    /// vLLM's scheduling priority: lower is more important.
    #[serde(default)]
    pub priority: Option<i64>,
    /// vLLM's `ignore_eos`: generate up to `max_tokens` past the model's
    /// end-of-sequence tokens (what serving benchmarks send).
    #[serde(default)]
    pub ignore_eos: Option<bool>,
    /// vLLM's `min_tokens`: tokens generated before a stop token or stop
    /// string may end the answer.
    #[serde(default)]
    pub min_tokens: Option<u64>,
    /// vLLM's `stop_token_ids`: token ids that end the answer, as the
    /// model's end-of-sequence tokens do.
    #[serde(default)]
    pub stop_token_ids: Option<Vec<u32>>,
    /// vLLM's `include_stop_str_in_output`: the stop string found stays in
    /// the answer.
    #[serde(default)]
    pub include_stop_str_in_output: Option<bool>,
    /// vLLM's `skip_special_tokens` (true by default): false writes special
    /// tokens out in the answer's text.
    #[serde(default)]
    pub skip_special_tokens: Option<bool>,
    /// Token id (as a string) to a bias in [-100, 100].
    #[serde(default)]
    pub logit_bias: Option<std::collections::BTreeMap<String, f64>>,
    /// vLLM's and llama.cpp's structured-output fields.
    #[serde(default)]
    pub guided_json: Option<serde_json::Value>,
    #[serde(default)]
    pub guided_regex: Option<serde_json::Value>,
    #[serde(default)]
    pub guided_choice: Option<serde_json::Value>,
    #[serde(default)]
    pub guided_grammar: Option<serde_json::Value>,
    #[serde(default)]
    pub grammar: Option<serde_json::Value>,
    #[serde(default)]
    pub json_schema: Option<serde_json::Value>,
    /// OpenAI's chat field, taken here too as vLLM does.
    #[serde(default)]
    pub response_format: Option<serde_json::Value>,
    /// OpenAI fields that ask nothing of generation, checked in
    /// [`check_no_action`]; the identifiers are taken and not used.
    #[serde(default)]
    #[allow(dead_code)]
    pub user: Option<String>,
    #[serde(default)]
    pub metadata: Option<std::collections::BTreeMap<String, String>>,
    #[serde(default)]
    pub store: Option<bool>,
    #[serde(default)]
    pub service_tier: Option<String>,
    #[serde(default)]
    #[allow(dead_code)]
    pub prompt_cache_key: Option<String>,
    #[serde(default)]
    #[allow(dead_code)]
    pub safety_identifier: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
pub(crate) struct StreamOptions {
    #[serde(default)]
    pub include_usage: Option<bool>,
}

/// What the request asks to run on, before tokenizing.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Input {
    Chat(Vec<ChatMessage>),
    Text(String),
    Tokens(Vec<u32>),
}

/// A requested completion budget and the field that carried it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct MaxTokens {
    pub value: usize,
    pub param: &'static str,
}

/// The sampling fields a request set; [`SamplingRequest::resolve`] fills
/// in the rest from the model's defaults.
#[derive(Debug, Clone, PartialEq, Default)]
pub(crate) struct SamplingRequest {
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<usize>,
    pub min_p: Option<f32>,
    pub presence_penalty: f32,
    pub frequency_penalty: f32,
    pub repetition_penalty: Option<f32>,
    pub logit_bias: Vec<(u32, f32)>,
    pub seed: Option<u64>,
    pub logprobs: Option<usize>,
}

impl SamplingRequest {
    pub fn resolve(&self, d: &SamplingDefaults) -> SamplingParams {
        SamplingParams {
            temperature: self.temperature.unwrap_or(d.temperature),
            top_p: self.top_p.unwrap_or(d.top_p),
            top_k: self.top_k.unwrap_or(d.top_k),
            min_p: self.min_p.unwrap_or(d.min_p),
            presence_penalty: self.presence_penalty,
            frequency_penalty: self.frequency_penalty,
            repetition_penalty: self.repetition_penalty.unwrap_or(d.repetition_penalty),
            logit_bias: self.logit_bias.clone(),
            seed: self.seed,
            logprobs: self.logprobs,
        }
    }
}

/// A request that passed validation.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Validated {
    pub model: String,
    pub input: Input,
    pub max_tokens: Option<MaxTokens>,
    pub sampling: SamplingRequest,
    /// Stop strings, `min_tokens`, and how the text is written.
    pub text: TextRules,
    /// Token ids that end the answer beside the model's own (vLLM's
    /// `stop_token_ids`).
    pub stop_token_ids: Vec<u32>,
    pub stream: bool,
    pub include_usage: bool,
    /// Completions: the answer starts with the prompt (OpenAI's `echo`).
    pub echo: bool,
    /// Choices to return (`n`), 1 to [`MAX_N`].
    pub n: usize,
    /// Choices to generate, of which the `n` with the highest mean token
    /// log probability are returned (completions' `best_of`); at least `n`.
    pub best_of: usize,
    /// A grammar the output must match (structured outputs).
    pub grammar: Option<OutputGrammar>,
    /// Tools the model may call (chat only).
    pub tools: Option<ToolsSpec>,
    /// Scheduling priority (vLLM's `priority`): lower is more important.
    pub priority: i32,
    /// vLLM's `ignore_eos`: end-of-sequence tokens do not end generation.
    pub ignore_eos: bool,
    /// Completions: the prompts batched after `input`, each answered as
    /// `n` choices of its own after those of the prompts before it.
    pub batch: Vec<Input>,
    /// Chat: how the messages are rendered into the prompt.
    pub chat: ChatRender,
}

/// Most choices one request may ask for.
pub const MAX_N: u64 = 8;

impl Validated {
    /// The field the prompt came in: where a too-long prompt is blamed.
    pub fn prompt_param(&self) -> &'static str {
        match self.input {
            Input::Chat(_) => "messages",
            Input::Text(_) | Input::Tokens(_) => "prompt",
        }
    }
}

/// The fields both endpoints share.
struct Shared {
    max_tokens: Option<MaxTokens>,
    temperature: Option<f64>,
    top_p: Option<f64>,
    n: Option<u64>,
    seed: Option<Seed>,
    stop: Option<Stop>,
    stream: Option<bool>,
    stream_options: Option<StreamOptions>,
    presence_penalty: Option<f64>,
    frequency_penalty: Option<f64>,
    logprobs: Option<usize>,
    extra: ExtraSampling,
}

/// Most alternatives `top_logprobs` (chat) may ask for, as OpenAI allows.
pub const MAX_TOP_LOGPROBS: u64 = 20;
/// Most alternatives completions' `logprobs` may ask for, as OpenAI allows.
pub const MAX_COMPLETION_LOGPROBS: u64 = 5;

/// A 400 for a field that is known but not supported, when it is set.
fn refuse_if(set: bool, param: &str, why: &str) -> Result<(), ApiError> {
    if set {
        return Err(unsupported(param, format!("`{param}` is not supported by this server: {why}")));
    }
    Ok(())
}

/// OpenAI's fields that need no action here: `user`, `prompt_cache_key`
/// and `safety_identifier` (identifiers), `metadata` (tags for stored
/// completions). `store: true` and service tiers other than `auto` and
/// `default` ask for something this server does not do, so they are
/// refused.
fn check_no_action(
    store: Option<bool>,
    service_tier: Option<&str>,
    metadata: Option<&std::collections::BTreeMap<String, String>>,
) -> Result<(), ApiError> {
    refuse_if(store == Some(true), "store", "completions are not stored.")?;
    // OpenAI's limits on `metadata`, so that what passes here passes there.
    if let Some(m) = metadata {
        if m.len() > 16 || m.iter().any(|(k, v)| k.chars().count() > 64 || v.chars().count() > 512) {
            return Err(ApiError::invalid(
                "metadata",
                "invalid_value",
                "Invalid value for `metadata`: at most 16 pairs, keys up to 64 characters, values up to 512.",
            ));
        }
    }
    refuse_if(
        service_tier.is_some_and(|t| t != "auto" && t != "default"),
        "service_tier",
        "there is one service tier (`auto` or `default`); use `priority` to rank requests.",
    )
}

impl ChatRequest {
    pub fn validate(self) -> Result<Validated, ApiError> {
        check_no_action(self.store, self.service_tier.as_deref(), self.metadata.as_ref())?;
        refuse_if(
            is_set(&self.functions),
            "functions",
            "the deprecated `functions` are not supported; send them as `tools`.",
        )?;
        refuse_if(
            self.function_call.as_ref().is_some_and(|t| !t.is_null() && t != "none"),
            "function_call",
            "the deprecated `function_call` is not supported; use `tool_choice`.",
        )?;
        let tools = tools_spec(self.tools.as_ref(), self.tool_choice.as_ref(), self.parallel_tool_calls)?;
        refuse_if(
            self.modalities.as_ref().is_some_and(|m| m.iter().any(|m| m != "text")),
            "modalities",
            "only text output is produced.",
        )?;
        refuse_if(is_set(&self.audio), "audio", "only text output is produced.")?;
        refuse_if(is_set(&self.prediction), "prediction", "predicted outputs are not used.")?;
        refuse_if(is_set(&self.web_search_options), "web_search_options", "there is no web search.")?;
        let logprobs = match (self.logprobs, self.top_logprobs) {
            (Some(true), top) => {
                let top = top.unwrap_or(0);
                if top > MAX_TOP_LOGPROBS {
                    return Err(out_of_range("top_logprobs", top as f64, "between 0 and 20"));
                }
                Some(top as usize)
            }
            (_, Some(top)) if top > 0 => {
                return Err(ApiError::invalid(
                    "top_logprobs",
                    "invalid_value",
                    "Invalid value for `top_logprobs`: `logprobs` must be true when `top_logprobs` is set.",
                ))
            }
            _ => None,
        };
        if self.messages.is_empty() {
            return Err(ApiError::invalid(
                "messages",
                "invalid_value",
                "Invalid value for `messages`: it must hold at least one message.",
            ));
        }
        let mut messages = Vec::with_capacity(self.messages.len());
        for (i, m) in self.messages.into_iter().enumerate() {
            messages.push(chat_message(i, m)?);
        }
        let render = ChatRender::new(
            self.add_generation_prompt,
            self.continue_final_message,
            self.chat_template_kwargs,
            &messages,
        )?;
        // The newer name wins when a client sends both.
        let max_tokens = match (self.max_completion_tokens, self.max_tokens) {
            (Some(v), _) => Some(("max_completion_tokens", v)),
            (None, Some(v)) => Some(("max_tokens", v)),
            (None, None) => None,
        };
        let extra = extra_of!(self);
        let shared = Shared {
            max_tokens: max_tokens.map(|(p, v)| max_tokens_value(p, v)).transpose()?,
            temperature: self.temperature,
            top_p: self.top_p,
            n: self.n,
            seed: self.seed,
            stop: self.stop,
            stream: self.stream,
            stream_options: self.stream_options,
            presence_penalty: self.presence_penalty,
            frequency_penalty: self.frequency_penalty,
            logprobs,
            extra,
        };
        let mut v = shared.validate(self.model, Input::Chat(messages))?;
        if let (Some(g), Some(t)) = (&v.grammar, &tools) {
            if t.active() {
                return Err(ApiError::invalid(
                    g.param,
                    "invalid_value",
                    format!(
                        "Invalid value for `{}`: an output format cannot be combined with tools; \
                         set `tool_choice` to `none` or leave the format out.",
                        g.param
                    ),
                ));
            }
        }
        if tools.as_ref().is_some_and(|t| t.active()) && v.sampling.logprobs.is_some() {
            return Err(unsupported(
                "logprobs",
                "`logprobs` with `tools` is not supported: log probabilities are not split between content and calls.",
            ));
        }
        refuse_if(
            v.text.min_tokens > 0
                && tools.as_ref().is_some_and(|t| matches!(t.choice, ToolChoice::Required | ToolChoice::Named(_))),
            "min_tokens",
            "it cannot be combined with a forced tool call, whose grammar decides where the answer ends.",
        )?;
        v.tools = tools;
        v.chat = render;
        Ok(v)
    }
}

/// `max_tokens` of a completion request that sets none, as OpenAI's API has it.
pub const COMPLETION_DEFAULT_MAX_TOKENS: usize = 16;

impl CompletionRequest {
    pub fn validate(self) -> Result<Validated, ApiError> {
        check_no_action(self.store, self.service_tier.as_deref(), self.metadata.as_ref())?;
        let logprobs = match self.logprobs {
            Some(n) if n > MAX_COMPLETION_LOGPROBS => {
                return Err(out_of_range("logprobs", n as f64, "between 0 and 5"));
            }
            other => other.map(|n| n as usize),
        };
        let echo = self.echo == Some(true);
        if echo && logprobs.is_some() && self.stream == Some(true) {
            return Err(unsupported(
                "echo",
                "`echo` with `logprobs` is not supported with `stream`: the prompt's log probabilities come in one body.",
            ));
        }
        if self.suffix.as_deref().is_some_and(|s| !s.is_empty()) {
            return Err(unsupported("suffix", "`suffix` is not supported: there is no insertion mode."));
        }
        let one = |p: Prompt| match p {
            Prompt::Text(s) => Ok(Input::Text(s)),
            Prompt::Tokens(ids) if ids.is_empty() => {
                Err(ApiError::invalid("prompt", "invalid_value", "Invalid value for `prompt`: a token array is empty."))
            }
            Prompt::Tokens(ids) => Ok(Input::Tokens(ids)),
            Prompt::Batch(_) => Err(ApiError::invalid("prompt", "invalid_value", "Invalid value for `prompt`.")),
        };
        let (input, batch) = match self.prompt {
            Prompt::Batch(prompts) => {
                if self.stream == Some(true) {
                    return Err(unsupported(
                        "stream",
                        "`stream` with batched prompts is not supported: send one prompt per streamed request.",
                    ));
                }
                let mut inputs = prompts.into_iter().map(one).collect::<Result<Vec<_>, _>>()?;
                let first = inputs.remove(0);
                (first, inputs)
            }
            p => (one(p)?, Vec::new()),
        };
        let extra = extra_of!(self);
        let max_tokens = match self.max_tokens {
            // With `echo`, no completion at all: the prompt (and its log
            // probabilities) alone.
            Some(0) if echo && self.stream == Some(true) => {
                return Err(unsupported(
                    "max_tokens",
                    "`max_tokens` 0 (the echoed prompt alone) is not supported with `stream`.",
                ));
            }
            Some(0) if echo => MaxTokens { value: 0, param: "max_tokens" },
            Some(v) => max_tokens_value("max_tokens", v)?,
            None => MaxTokens { value: COMPLETION_DEFAULT_MAX_TOKENS, param: "max_tokens" },
        };
        let shared = Shared {
            max_tokens: Some(max_tokens),
            temperature: self.temperature,
            top_p: self.top_p,
            n: self.n,
            seed: self.seed,
            stop: self.stop,
            stream: self.stream,
            stream_options: self.stream_options,
            presence_penalty: self.presence_penalty,
            frequency_penalty: self.frequency_penalty,
            logprobs,
            extra,
        };
        let mut v = shared.validate(self.model, input)?;
        v.echo = echo;
        v.batch = batch;
        if let Some(b) = self.best_of {
            if !(1..=MAX_N).contains(&b) {
                return Err(out_of_range("best_of", b as f64, "between 1 and 8"));
            }
            if (b as usize) < v.n {
                return Err(ApiError::invalid(
                    "best_of",
                    "invalid_value",
                    format!("Invalid value for `best_of`: it must be at least `n` ({}), got {b}.", v.n),
                ));
            }
            if b > 1 && v.stream {
                return Err(unsupported("best_of", "`best_of` greater than 1 is not supported with `stream`."));
            }
            v.best_of = b as usize;
        }
        Ok(v)
    }
}

fn max_tokens_value(param: &'static str, v: u64) -> Result<MaxTokens, ApiError> {
    if v == 0 {
        return Err(ApiError::invalid(
            param,
            "invalid_value",
            format!("Invalid value for `{param}`: it must be at least 1."),
        ));
    }
    Ok(MaxTokens { value: usize::try_from(v).unwrap_or(usize::MAX), param })
}

fn unsupported(param: &str, message: impl Into<String>) -> ApiError {
    ApiError::invalid(param, "unsupported_parameter", message)
}

fn out_of_range(param: &str, value: f64, range: &str) -> ApiError {
    ApiError::invalid(param, "invalid_value", format!("Invalid value for `{param}`: it must be {range}, got {value}."))
}

#[cfg(test)]
mod tests;

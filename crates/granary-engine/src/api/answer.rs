//! One generation request from validated body to answer: tokenizing
//! (with the tools, when there are some), the context budget, the output
//! grammar, submitting, and answering in one body or as a stream, with
//! tool calls parsed out of the text.

use std::collections::HashMap;
use std::convert::Infallible;
use std::sync::Arc;

use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures::StreamExt;
use granary_tokenizer::{ChatMessage, ChatOptions, Tokenizer};

use super::error::ApiError;
use super::generate::{self, collect, sse_data, Outcome};
use super::request::{ChatRender, Input, MaxTokens, Validated};
use super::response::{self, Answer, Endpoint, Header, UsageBody};
use super::stop::TextRules;
use super::structured::{ToolChoice, ToolsSpec};
use super::tools::{parse_output, ToolFormat, ToolParser};
use super::AppState;
use crate::constraint::{Constraint, Grammars};
use crate::types::{FinishReason, GenerateRequest, ModelInfo, SubmitError, TokenLogprobs};

/// Grammar compilers by model (id and tokenizer instance).
#[derive(Default)]
pub(crate) struct GrammarCache {
    by_model: parking_lot::Mutex<HashMap<(String, usize), Arc<Grammars>>>,
}

impl GrammarCache {
    /// The compiler of `model`, built off the async threads on first use.
    async fn get(&self, model: &ModelInfo, param: &str) -> Result<Arc<Grammars>, ApiError> {
        let key = (model.id.clone(), Arc::as_ptr(&model.tokenizer) as usize);
        if let Some(g) = self.by_model.lock().get(&key) {
            return Ok(g.clone());
        }
        let tokenizer = model.tokenizer.clone();
        let built = tokio::task::spawn_blocking(move || Grammars::new(tokenizer))
            .await
            .map_err(|e| ApiError::internal(&e))?
            .map_err(|e| {
                ApiError::invalid(
                    param,
                    "unsupported_parameter",
                    format!(
                        "`{param}` is not available for model `{}`: its vocabulary cannot be constrained ({e}).",
                        model.id
                    ),
                )
            })?;
        let g = Arc::new(built);
        self.by_model.lock().insert(key, g.clone());
        Ok(g)
    }
}

/// The tools of a chat request, with the model's call syntax.
#[derive(Clone)]
struct ToolUse {
    spec: ToolsSpec,
    format: ToolFormat,
}

impl ToolUse {
    fn parser(&self) -> Option<ToolParser> {
        self.spec.active().then(|| ToolParser::new(self.format, &self.spec))
    }
}

/// The constraint of a request: its output grammar, or the grammar that
/// forces a tool call.
async fn constraint(
    st: &AppState,
    model: &ModelInfo,
    v: &Validated,
    tools: Option<&ToolUse>,
) -> Result<Option<Constraint>, ApiError> {
    let forced = tools.filter(|t| matches!(t.spec.choice, ToolChoice::Required | ToolChoice::Named(_)));
    let (param, grammar): (&str, llguidance::api::TopLevelGrammar) = if let Some(g) = &v.grammar {
        (g.param, g.top_level())
    } else if let Some(t) = forced {
        let grammars = st.grammars.get(model, "tool_choice").await?;
        let lark = t.format.forced_grammar(&t.spec, &|name| grammars.special_token(name));
        ("tools", llguidance::api::TopLevelGrammar::from_lark(lark))
    } else {
        return Ok(None);
    };
    let grammars = st.grammars.get(model, param).await?;
    let compiled =
        tokio::task::spawn_blocking(move || grammars.compile(grammar)).await.map_err(|e| ApiError::internal(&e))?;
    compiled.map(Some).map_err(|e| {
        ApiError::invalid(
            param,
            "invalid_value",
            format!("Invalid value for `{param}`: the grammar does not compile: {e}"),
        )
    })
}

/// Tokenizes, checks the context, submits, and answers.
pub(crate) async fn generate(
    st: &AppState,
    namespace: String,
    mut v: Validated,
    endpoint: Endpoint,
) -> Result<Response, ApiError> {
    let model = st.model(&v.model)?;
    let prompt_param = v.prompt_param();
    let tokenizer = model.tokenizer.clone();
    let echoed = match (&v.input, v.echo) {
        (Input::Text(t), true) => Some(t.clone()),
        (Input::Tokens(ids), true) => Some(tokenizer.decode(ids, false).map_err(|e| ApiError::internal(&e))?),
        _ => None,
    };
    let tools = v.tools.take().map(|spec| ToolUse { format: ToolFormat::of(&tokenizer), spec });
    let input = std::mem::replace(&mut v.input, Input::Tokens(Vec::new()));
    let render = std::mem::take(&mut v.chat);
    let (prompt, mut stop_token_ids) = tokenize(tokenizer.clone(), input, tools.clone(), render).await?;
    if v.ignore_eos {
        stop_token_ids.clear();
    }
    let vocab = tokenizer.vocab_size();
    if let Some(&id) = v.stop_token_ids.iter().find(|&&id| id as usize >= vocab) {
        return Err(ApiError::invalid(
            "stop_token_ids",
            "invalid_value",
            format!("Invalid value for `stop_token_ids`: token id {id} is outside the vocabulary of {vocab} tokens."),
        ));
    }
    for &id in &v.stop_token_ids {
        if !stop_token_ids.contains(&id) {
            stop_token_ids.push(id);
        }
    }
    let max_tokens = budget(prompt.len(), model.context_len, v.max_tokens, prompt_param)?;
    let prompt_tokens = prompt.len();
    tracing::Span::current().record("gen_ai.usage.input_tokens", prompt_tokens);
    if let Some(&(id, _)) = v.sampling.logit_bias.iter().find(|(id, _)| *id as usize >= vocab) {
        return Err(ApiError::invalid(
            format!("logit_bias.{id}"),
            "invalid_value",
            format!("Invalid value for `logit_bias`: token id {id} is outside the vocabulary of {vocab} tokens."),
        ));
    }
    // `echo` with `logprobs`: the prompt's own log probabilities.
    let echo_lps = match (v.echo, v.sampling.logprobs) {
        (true, Some(top)) => Some((prompt.clone(), prompt_logprobs(st, &model.id, &prompt, top).await?)),
        _ => None,
    };
    if max_tokens == 0 {
        // `echo` with `max_tokens: 0`: the prompt alone, nothing generated.
        let header = Header::new(endpoint, model.id.clone());
        let name = |id: u32| generate::DecoderSource::token_text(&tokenizer, id);
        let answers = (0..v.n)
            .map(|_| {
                let logprobs = echo_lps.as_ref().map(|(p, lps)| response::echoed_logprobs_json(p, lps, &[], &name, 0));
                response::Answer::text(echoed.clone().unwrap_or_default(), FinishReason::Length, logprobs)
            })
            .collect();
        return Ok(Json(header.complete_choices(answers, UsageBody::new(prompt_tokens, 0, 0))).into_response());
    }
    let constraint = constraint(st, &model, &v, tools.as_ref()).await?;
    let sampling = v.sampling.resolve(&model.sampling);
    let req = GenerateRequest {
        namespace,
        prompt,
        max_tokens,
        sampling,
        stop_token_ids,
        min_tokens: v.text.min_tokens,
        constraint,
        priority: v.priority,
    };
    if v.best_of > 1 && !v.stream {
        let how = Choices {
            n: v.n,
            best_of: v.best_of,
            text: v.text,
            logprobs: v.sampling.logprobs.is_some(),
            prompt_param,
            endpoint,
            echoed,
            echo_lps,
            prompt_tokens,
            tools,
        };
        return generate_n(st, &model.id, req, how).await;
    }
    let header = Header::new(endpoint, model.id.clone());
    if v.stream {
        let receivers = submit_choices(st, &model.id, req, v.n, prompt_param).await?;
        let chunker = header.chunker(v.include_usage);
        let echo: Vec<String> = match echoed.filter(|t| !t.is_empty()) {
            Some(t) => (0..v.n).map(|i| chunker.for_choice(i).text_with(&t, None)).collect(),
            None => Vec::new(),
        };
        let choices = receivers.into_iter().map(|rx| (rx, tools.as_ref().and_then(ToolUse::parser))).collect();
        let data = sse_data(choices, tokenizer, v.text, chunker, prompt_tokens);
        // The request span ends with the stream, not with these headers.
        let ends = granary_core::trace::EndOnDrop::new([tracing::Span::current()]);
        let events = futures::stream::iter(echo).chain(data).map(move |d| {
            let _ = &ends;
            Ok::<_, Infallible>(SseEvent::default().data(d))
        });
        return Ok(Sse::new(events).into_response());
    }
    let rx = st.backend.submit(&model.id, req).map_err(|e| submit_error(e, prompt_param))?;
    let parser = tools.as_ref().and_then(ToolUse::parser);
    // Tool-call markers may be special tokens: keep them in the text.
    let mut decoder = tokenizer.decode_stream(parser.is_none() && !v.text.keep_special);
    let out = collect(rx, &mut decoder, &v.text).await.map_err(|msg| {
        tracing::warn!(error = %msg, "generation failed");
        ApiError::generation_failed(&msg)
    })?;
    let usage = UsageBody::new(prompt_tokens, out.completion_tokens, out.cached_tokens);
    let span = tracing::Span::current();
    span.record("gen_ai.usage.output_tokens", out.completion_tokens);
    span.record("granary.cached_tokens", out.cached_tokens);
    let echo = Echo { text: echoed.as_deref(), logprobs: echo_lps.as_ref() };
    let answer = answer_of(out, &tokenizer, endpoint, v.sampling.logprobs.is_some(), echo, parser);
    Ok(Json(header.complete_choices(vec![answer], usage)).into_response())
}

/// The prompt tokens and their log probabilities (`echo` with `logprobs`).
type PromptLogprobs = (Vec<u32>, Vec<TokenLogprobs>);

/// What an answer echoes: the prompt's text, and with `logprobs` the
/// prompt's log probabilities.
#[derive(Clone, Copy, Default)]
struct Echo<'a> {
    text: Option<&'a str>,
    logprobs: Option<&'a PromptLogprobs>,
}

/// One finished generation as a choice: log probabilities, the echoed
/// prompt, tool calls split from the text.
fn answer_of(
    out: Outcome,
    tokenizer: &Arc<Tokenizer>,
    endpoint: Endpoint,
    want_logprobs: bool,
    echo: Echo<'_>,
    parser: Option<ToolParser>,
) -> Answer {
    let echoed = echo.text;
    let logprobs = want_logprobs.then(|| {
        let name = |id: u32| generate::DecoderSource::token_text(tokenizer, id);
        match echo.logprobs {
            Some((prompt, lps)) => {
                response::echoed_logprobs_json(prompt, lps, &out.logprobs, &name, echoed.map_or(0, str::len))
            }
            None => response::logprobs_json(endpoint, &out.logprobs, &name, 0),
        }
    });
    if let Some(mut p) = parser {
        let (content, calls) = parse_output(&mut p, &out.text);
        let reason =
            if !calls.is_empty() && out.reason != FinishReason::Length { FinishReason::ToolCalls } else { out.reason };
        return Answer { content, reason, logprobs, tool_calls: calls.iter().map(|c| c.to_json()).collect() };
    }
    let text = match echoed {
        Some(prompt) => format!("{prompt}{}", out.text),
        None => out.text,
    };
    Answer::text(text, out.reason, logprobs)
}

/// What [`generate_n`] needs of a validated request.
struct Choices {
    n: usize,
    best_of: usize,
    text: TextRules,
    logprobs: bool,
    prompt_param: &'static str,
    endpoint: Endpoint,
    echoed: Option<String>,
    echo_lps: Option<PromptLogprobs>,
    prompt_tokens: usize,
    tools: Option<ToolUse>,
}

/// `n` choices of one prompt, answered in one body. The first choice is
/// submitted alone; the others once it has produced its first token, so its
/// prompt's full blocks are in engine memory and theirs are loaded, not
/// computed (each choice computes only the prompt's unaligned tail). With
/// a `seed`, choice `i` samples with `seed + i`; each choice has its own
/// copy of the output grammar. With `best_of` above `n`, `best_of` choices
/// run and the `n` with the highest mean token log probability are
/// returned, best first (usage counts every generated token).
async fn generate_n(st: &AppState, model: &str, mut req: GenerateRequest, how: Choices) -> Result<Response, ApiError> {
    let Choices {
        n,
        best_of,
        text,
        logprobs: want_logprobs,
        prompt_param,
        endpoint,
        echoed,
        echo_lps,
        prompt_tokens,
        tools,
    } = how;
    let tokenizer = st.model(model)?.tokenizer;
    let ranked = best_of > n;
    if ranked && req.sampling.logprobs.is_none() {
        req.sampling.logprobs = Some(0);
    }
    let receivers = submit_choices(st, model, req, best_of, prompt_param).await?;
    let skip_special = tools.as_ref().and_then(ToolUse::parser).is_none() && !text.keep_special;
    let runs = receivers.into_iter().map(|rx| {
        let tokenizer = tokenizer.clone();
        let text = &text;
        async move {
            let mut decoder = tokenizer.decode_stream(skip_special);
            collect(rx, &mut decoder, text).await
        }
    });
    let outcomes = futures::future::join_all(runs).await;
    let header = Header::new(endpoint, model.to_string());
    let mut answers = Vec::with_capacity(outcomes.len());
    let (mut completion, mut cached) = (0, 0);
    let mut finished = Vec::with_capacity(outcomes.len());
    for (i, out) in outcomes.into_iter().enumerate() {
        let out = out.map_err(|msg| {
            tracing::warn!(error = %msg, "generation failed");
            ApiError::generation_failed(&msg)
        })?;
        completion += out.completion_tokens;
        if i == 0 {
            cached = out.cached_tokens;
        }
        finished.push(out);
    }
    if ranked {
        let mean = |o: &Outcome| {
            let lps: Vec<f32> = o.logprobs.iter().map(|(_, lp)| lp.logprob).collect();
            if lps.is_empty() {
                f32::NEG_INFINITY
            } else {
                lps.iter().sum::<f32>() / lps.len() as f32
            }
        };
        finished.sort_by(|a, b| mean(b).total_cmp(&mean(a)));
        finished.truncate(n);
    }
    for out in finished {
        let parser = tools.as_ref().and_then(ToolUse::parser);
        let echo = Echo { text: echoed.as_deref(), logprobs: echo_lps.as_ref() };
        answers.push(answer_of(out, &tokenizer, endpoint, want_logprobs, echo, parser));
    }
    // The prompt is counted once, as OpenAI counts it.
    let usage = UsageBody::new(prompt_tokens, completion, cached);
    Ok(Json(header.complete_choices(answers, usage)).into_response())
}

/// The prompt's log probabilities from the backend, off the async threads.
async fn prompt_logprobs(
    st: &AppState,
    model: &str,
    prompt: &[u32],
    top: usize,
) -> Result<Vec<TokenLogprobs>, ApiError> {
    let (backend, model, tokens) = (Arc::clone(&st.backend), model.to_string(), prompt.to_vec());
    let got = st.side_pass(move || backend.prompt_logprobs(&model, &tokens, top)).await?;
    match got {
        None => Err(ApiError::invalid(
            "echo",
            "unsupported_parameter",
            "`echo` with `logprobs` is not supported by this backend: it does not compute the prompt's log probabilities.",
        )),
        Some(Err(e)) => {
            tracing::warn!(error = %e, "prompt log probabilities failed");
            Err(ApiError::generation_failed(&e.to_string()))
        }
        Some(Ok(lps)) => Ok(lps),
    }
}

/// Submits `count` choices of one request: the first alone until its first
/// token (or its end), so its prompt's full blocks are in engine memory when
/// the others start and they load them instead of computing them. With a
/// `seed`, choice `i` samples with `seed + i`.
async fn submit_choices(
    st: &AppState,
    model: &str,
    req: GenerateRequest,
    count: usize,
    prompt_param: &'static str,
) -> Result<Vec<tokio::sync::mpsc::UnboundedReceiver<crate::Event>>, ApiError> {
    let submit = |i: usize| {
        let mut r = req.clone();
        r.sampling.seed = req.sampling.seed.map(|s| s.wrapping_add(i as u64));
        st.backend.submit(model, r).map_err(|e| submit_error(e, prompt_param))
    };
    let mut first = submit(0)?;
    if count == 1 {
        return Ok(vec![first]);
    }
    // Forward the first choice's events, noting when its first token (or its
    // end) has come: its prompt has been computed by then.
    let (tx, rx0) = tokio::sync::mpsc::unbounded_channel();
    loop {
        let Some(ev) = first.recv().await else { break };
        let started = !matches!(ev, crate::Event::Started { .. });
        let _ = tx.send(ev);
        if started {
            break;
        }
    }
    tokio::spawn(async move {
        while let Some(ev) = first.recv().await {
            if tx.send(ev).is_err() {
                break;
            }
        }
    });
    let mut receivers = vec![rx0];
    for i in 1..count {
        receivers.push(submit(i)?);
    }
    Ok(receivers)
}

/// The prompt's tokens and the tokens that end generation. Runs on the
/// blocking pool: templates and long prompts cost CPU time.
async fn tokenize(
    tokenizer: Arc<Tokenizer>,
    input: Input,
    tools: Option<ToolUse>,
    render: ChatRender,
) -> Result<(Vec<u32>, Vec<u32>), ApiError> {
    tokio::task::spawn_blocking(move || {
        let tok = &*tokenizer;
        let template_error = |e: granary_tokenizer::TokenizerError| match e {
            granary_tokenizer::TokenizerError::Template(_) => {
                ApiError::invalid("messages", "invalid_value", format!("Invalid value for `messages`: {e}."))
            }
            other => ApiError::internal(&other),
        };
        let prompt = match input {
            Input::Chat(messages) => match &tools {
                None => tok.encode_chat_with(&messages, None, &render.options()).map_err(template_error)?,
                Some(t) => encode_with_tools(tok, messages, t, &render.options()).map_err(template_error)?,
            },
            Input::Text(text) => tok.encode(&text, true).map_err(|e| ApiError::internal(&e))?,
            Input::Tokens(ids) => {
                let vocab = tok.vocab_size();
                if let Some((i, id)) = ids.iter().enumerate().find(|(_, &id)| id as usize >= vocab) {
                    return Err(ApiError::invalid(
                        "prompt",
                        "invalid_value",
                        format!(
                            "Invalid value for `prompt`: token id {id} at position {i} is outside the vocabulary of {vocab} tokens."
                        ),
                    ));
                }
                ids
            }
        };
        Ok((prompt, tok.eos_token_ids().to_vec()))
    })
    .await
    .map_err(|e| ApiError::internal(&e))?
}

/// A chat with tools. A template that refuses a system message (Gemma 2)
/// gets the tool description at the start of the first user message.
fn encode_with_tools(
    tok: &Tokenizer,
    messages: Vec<ChatMessage>,
    t: &ToolUse,
    opts: &ChatOptions<'_>,
) -> granary_tokenizer::Result<Vec<u32>> {
    let (msgs, tools) = super::tools::prompt_messages(tok, t.format, messages, &t.spec);
    match tok.encode_chat_with(&msgs, tools.as_ref(), opts) {
        Err(e) if tools.is_none() && msgs.first().is_some_and(|m| m.role == "system") && msgs.len() > 1 => {
            let mut msgs = msgs;
            let system = msgs.remove(0);
            match msgs.iter_mut().find(|m| m.role == "user") {
                Some(user) => user.content = format!("{}\n\n{}", system.content, user.content),
                None => return Err(e),
            }
            tok.encode_chat_with(&msgs, None, opts)
        }
        other => other,
    }
}

/// The completion budget: the request's, or all the context left.
pub(crate) fn budget(
    prompt: usize,
    context: usize,
    requested: Option<MaxTokens>,
    prompt_param: &'static str,
) -> Result<usize, ApiError> {
    if prompt >= context {
        return Err(prompt_too_long(context, prompt, prompt_param));
    }
    let room = context - prompt;
    match requested {
        None => Ok(room),
        Some(m) if m.value <= room => Ok(m.value),
        Some(m) => Err(ApiError::invalid(
            m.param,
            "context_length_exceeded",
            format!(
                "This model's maximum context length is {context} tokens. However, you requested {} tokens \
                 ({prompt} in the {prompt_param}, {} in the completion). Please reduce the length of the \
                 {prompt_param} or `{}`.",
                prompt.saturating_add(m.value),
                m.value,
                m.param
            ),
        )),
    }
}

fn prompt_too_long(context: usize, prompt: usize, prompt_param: &'static str) -> ApiError {
    ApiError::invalid(
        prompt_param,
        "context_length_exceeded",
        format!(
            "This model's maximum context length is {context} tokens. However, your {prompt_param} resulted in {prompt} \
             tokens, leaving no room for the completion. Please reduce the length of the {prompt_param}."
        ),
    )
}

pub(crate) fn submit_error(e: SubmitError, prompt_param: &'static str) -> ApiError {
    match e {
        SubmitError::ContextExceeded { limit, prompt } => prompt_too_long(limit, prompt, prompt_param),
        SubmitError::EmptyPrompt => ApiError::invalid(
            prompt_param,
            "empty_prompt",
            format!("Invalid value for `{prompt_param}`: it encodes to no tokens."),
        ),
        SubmitError::KvMemory { budget, needed } => ApiError::invalid(
            prompt_param,
            "context_length_exceeded",
            format!(
                "This engine's KV memory (--kv-memory) holds {budget} tokens; this request needs up to {needed} \
                 (its {prompt_param} and the completion's `max_tokens`, in whole blocks). Reduce `max_tokens` \
                 or the {prompt_param}."
            ),
        ),
        SubmitError::ShuttingDown => ApiError::unavailable("The server is shutting down; retry on another."),
        SubmitError::Unavailable(why) => {
            ApiError::unavailable(format!("The engine cannot serve: {why}; retry on another."))
        }
    }
}

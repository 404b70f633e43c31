//! From a backend's [`Event`]s to text: incremental detokenizing, stop
//! strings, and the two ways of answering (one body, or an SSE stream).
//!
//! Whoever holds the event receiver keeps the generation alive; dropping it
//! cancels the request in the backend. Here the receiver is owned by the
//! [`collect`] future or by the stream [`sse_data`] returns, never by a
//! spawned task, so a client that goes away (its request future or
//! response body dropped) cancels its generation. A stop string drops the
//! receiver as soon as it is found.

use std::sync::Arc;

use futures::Stream;
use granary_tokenizer::{DecodeStream, Tokenizer};
use tokio::sync::mpsc::UnboundedReceiver;

use super::error::ApiError;
use super::response::{Chunker, UsageBody};
use super::stop::{Matched, StopMatcher, TextRules};
use super::tools::{ToolEvent, ToolParser};
use crate::types::{Event, FinishReason, TokenLogprobs};

/// Turns token ids into text as characters complete.
pub(crate) trait Detokenize: Send {
    fn push(&mut self, id: u32) -> Result<Option<String>, String>;
    /// Text still held back when the generation ends.
    fn finish(&mut self) -> Result<Option<String>, String> {
        Ok(None)
    }
}

impl Detokenize for DecodeStream<'_> {
    fn push(&mut self, id: u32) -> Result<Option<String>, String> {
        DecodeStream::push(self, id).map_err(|e| e.to_string())
    }
    fn finish(&mut self) -> Result<Option<String>, String> {
        DecodeStream::finish(self).map_err(|e| e.to_string())
    }
}

/// Makes the detokenizer of one request (the streaming answer owns its
/// source, so the detokenizer may borrow it).
pub(crate) trait DecoderSource: Send + 'static {
    fn decoder(&self) -> Box<dyn Detokenize + '_>;
    /// A detokenizer that keeps special tokens (tool-call markers may be
    /// special tokens).
    fn raw_decoder(&self) -> Box<dyn Detokenize + '_> {
        self.decoder()
    }
    /// One token's text, as log probabilities name it.
    fn token_text(&self, id: u32) -> String;
}

impl DecoderSource for Arc<Tokenizer> {
    fn decoder(&self) -> Box<dyn Detokenize + '_> {
        Box::new(self.decode_stream(true))
    }
    fn raw_decoder(&self) -> Box<dyn Detokenize + '_> {
        Box::new(self.decode_stream(false))
    }
    fn token_text(&self, id: u32) -> String {
        self.decode(&[id], false).unwrap_or_default()
    }
}

/// What one event made of the output.
#[derive(Debug, PartialEq)]
pub(crate) enum Step {
    /// Text safe to send (may be empty).
    Text(String),
    /// The last text, then the end.
    Done {
        text: String,
        reason: FinishReason,
        cached_tokens: usize,
    },
    Failed(String),
}

/// The text side of one generation.
pub(crate) struct Generation {
    stop: StopMatcher,
    /// Tokens received before a stop string may end the answer.
    min_tokens: usize,
    /// Tokens received so far.
    pub completion_tokens: usize,
    /// Prompt tokens loaded instead of computed, once the backend said.
    cached_tokens: usize,
    /// Log probabilities announced for the next token.
    pending_logprobs: Option<Box<TokenLogprobs>>,
    /// Tokens with their log probabilities, not yet sent.
    logprobs: Vec<(u32, TokenLogprobs)>,
}

impl Generation {
    pub fn new(rules: &TextRules) -> Self {
        Generation {
            stop: StopMatcher::new(rules.stop.clone(), rules.include_stop),
            min_tokens: rules.min_tokens,
            completion_tokens: 0,
            cached_tokens: 0,
            pending_logprobs: None,
            logprobs: Vec::new(),
        }
    }

    /// The tokens (with log probabilities) received since the last call.
    pub fn take_logprobs(&mut self) -> Vec<(u32, TokenLogprobs)> {
        std::mem::take(&mut self.logprobs)
    }

    /// Takes the next event (`None`: the backend dropped its sender).
    /// After `Done` or `Failed` the caller drops the receiver.
    pub fn step(&mut self, event: Option<Event>, decoder: &mut dyn Detokenize) -> Step {
        match event {
            Some(Event::Started { cached_tokens }) => {
                self.cached_tokens = cached_tokens;
                Step::Text(String::new())
            }
            Some(Event::Logprobs(lp)) => {
                self.pending_logprobs = Some(lp);
                Step::Text(String::new())
            }
            Some(Event::Token(id)) => {
                self.completion_tokens += 1;
                if let Some(lp) = self.pending_logprobs.take() {
                    self.logprobs.push((id, *lp));
                }
                let piece = match decoder.push(id) {
                    Ok(Some(piece)) => piece,
                    Ok(None) => return Step::Text(String::new()),
                    Err(e) => return Step::Failed(format!("detokenizing failed: {e}")),
                };
                match self.stop.push(&piece, self.completion_tokens >= self.min_tokens) {
                    Matched::Pending(text) => Step::Text(text),
                    Matched::Stop(text) => {
                        Step::Done { text, reason: FinishReason::Stop, cached_tokens: self.cached_tokens }
                    }
                }
            }
            Some(Event::Finished { reason, usage }) => {
                let mut text = String::new();
                match decoder.finish() {
                    Ok(Some(tail)) => match self.stop.push(&tail, self.completion_tokens >= self.min_tokens) {
                        Matched::Pending(t) => text.push_str(&t),
                        Matched::Stop(t) => {
                            return Step::Done {
                                text: t,
                                reason: FinishReason::Stop,
                                cached_tokens: usage.cached_tokens,
                            }
                        }
                    },
                    Ok(None) => {}
                    Err(e) => return Step::Failed(format!("detokenizing failed: {e}")),
                }
                text.push_str(&self.stop.finish());
                Step::Done { text, reason, cached_tokens: usage.cached_tokens }
            }
            Some(Event::Failed(msg)) => Step::Failed(msg),
            None => Step::Failed("the generation ended without a result".into()),
        }
    }
}

/// A whole non-streamed answer.
#[derive(Debug, PartialEq)]
pub(crate) struct Outcome {
    pub text: String,
    pub reason: FinishReason,
    pub completion_tokens: usize,
    pub cached_tokens: usize,
    /// The tokens' log probabilities, when the request asked for them.
    pub logprobs: Vec<(u32, TokenLogprobs)>,
}

/// Runs a generation to its end. Returns the backend's failure message
/// on failure. The receiver is dropped on return, also when a stop
/// string ends the answer early.
pub(crate) async fn collect(
    mut rx: UnboundedReceiver<Event>,
    decoder: &mut dyn Detokenize,
    rules: &TextRules,
) -> Result<Outcome, String> {
    let mut gen = Generation::new(rules);
    let mut out = String::new();
    loop {
        match gen.step(rx.recv().await, decoder) {
            Step::Text(t) => out.push_str(&t),
            Step::Done { text, reason, cached_tokens } => {
                out.push_str(&text);
                let logprobs = gen.take_logprobs();
                return Ok(Outcome {
                    text: out,
                    reason,
                    completion_tokens: gen.completion_tokens,
                    cached_tokens,
                    logprobs,
                });
            }
            Step::Failed(msg) => return Err(msg),
        }
    }
}

/// What one choice's stream produces.
enum Piece {
    Data(String),
    End {
        index: usize,
        completion_tokens: usize,
        cached_tokens: usize,
    },
    /// An error body; the answer ends.
    Failed(String),
}

/// The SSE `data:` payloads of a streamed answer with one choice per
/// receiver (`n`), interleaved as they come, then the usage chunk (when
/// asked for: every choice's tokens, the prompt once) and `[DONE]`. The
/// stream owns the receivers: dropping it (the client left) cancels every
/// choice, and so does a failure of one.
pub(crate) fn sse_data<S: DecoderSource + Clone>(
    choices: Vec<(UnboundedReceiver<Event>, Option<ToolParser>)>,
    source: S,
    rules: TextRules,
    chunker: Chunker,
    prompt_tokens: usize,
) -> impl Stream<Item = String> + Send {
    let streams: Vec<_> = choices
        .into_iter()
        .enumerate()
        .map(|(i, (rx, tools))| {
            Box::pin(choice_stream(rx, source.clone(), rules.clone(), chunker.for_choice(i), tools))
        })
        .collect();
    let mut merged = futures::stream::select_all(streams);
    async_stream::stream! {
        let (mut completion, mut cached) = (0usize, 0usize);
        while let Some(piece) = futures::StreamExt::next(&mut merged).await {
            match piece {
                Piece::Data(d) => yield d,
                Piece::End { index, completion_tokens, cached_tokens } => {
                    completion += completion_tokens;
                    if index == 0 {
                        cached = cached_tokens;
                    }
                }
                Piece::Failed(body) => {
                    drop(merged);
                    yield body;
                    yield "[DONE]".to_string();
                    return;
                }
            }
        }
        if let Some(usage) = chunker.usage(UsageBody::new(prompt_tokens, completion, cached)) {
            yield usage;
        }
        yield "[DONE]".to_string();
    }
}

/// One choice's chunks, ending with its finish chunk.
fn choice_stream<S: DecoderSource>(
    mut rx: UnboundedReceiver<Event>,
    source: S,
    rules: TextRules,
    chunker: Chunker,
    mut tools: Option<ToolParser>,
) -> impl Stream<Item = Piece> + Send {
    async_stream::stream! {
        let mut decoder = if tools.is_some() || rules.keep_special { source.raw_decoder() } else { source.decoder() };
        let mut calls_sent = 0usize;
        let mut gen = Generation::new(&rules);
        let mut offset = 0usize;
        let mut lp_json = |gen: &mut Generation, decoder: &S| {
            let lps = gen.take_logprobs();
            if lps.is_empty() {
                return None;
            }
            let name = |id: u32| decoder.token_text(id);
            let v = super::response::logprobs_json(chunker.endpoint(), &lps, &name, offset);
            offset += lps.iter().map(|(id, _)| decoder.token_text(*id).len()).sum::<usize>();
            Some(v)
        };
        if let Some(start) = chunker.start() {
            yield Piece::Data(start);
        }
        loop {
            let event = rx.recv().await;
            let step = gen.step(event, &mut *decoder);
            if let Some(parser) = tools.as_mut() {
                // Tool calls are found in the text; content streams as it
                // is known not to start a call.
                let (text, done) = match step {
                    Step::Text(t) => (t, None),
                    Step::Done { text, reason, cached_tokens } => (text, Some((reason, cached_tokens))),
                    Step::Failed(msg) => {
                        drop(rx);
                        tracing::warn!(error = %msg, "generation failed while streaming");
                        yield Piece::Failed(serde_json::to_string(&ApiError::generation_failed(&msg).body()).expect("errors serialize"));
                        return;
                    }
                };
                let mut events = parser.push(&text);
                if done.is_some() {
                    events.extend(parser.finish());
                }
                for e in events {
                    match e {
                        ToolEvent::Content(c) => yield Piece::Data(chunker.text_with(&c, None)),
                        ToolEvent::Call(call) => {
                            yield Piece::Data(chunker.tool_call(calls_sent, &call.to_json()));
                            calls_sent += 1;
                        }
                    }
                }
                if let Some((reason, cached_tokens)) = done {
                    drop(rx);
                    let reason = if calls_sent > 0 && reason != FinishReason::Length { FinishReason::ToolCalls } else { reason };
                    yield Piece::Data(chunker.finish(reason));
                    yield Piece::End { index: chunker.index(), completion_tokens: gen.completion_tokens, cached_tokens };
                    return;
                }
                continue;
            }
            match step {
                Step::Text(t) => {
                    if !t.is_empty() {
                        let lp = lp_json(&mut gen, &source);
                        yield Piece::Data(chunker.text_with(&t, lp));
                    }
                }
                Step::Done { text, reason, cached_tokens } => {
                    drop(rx);
                    let lp = lp_json(&mut gen, &source);
                    if !text.is_empty() || lp.is_some() {
                        yield Piece::Data(chunker.text_with(&text, lp));
                    }
                    yield Piece::Data(chunker.finish(reason));
                    yield Piece::End { index: chunker.index(), completion_tokens: gen.completion_tokens, cached_tokens };
                    return;
                }
                Step::Failed(msg) => {
                    drop(rx);
                    tracing::warn!(error = %msg, "generation failed while streaming");
                    let e = ApiError::generation_failed(&msg);
                    yield Piece::Failed(serde_json::to_string(&e.body()).expect("errors serialize"));
                    return;
                }
            }
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::api::response::{Endpoint, Header};
    use crate::types::Usage;
    use futures::StreamExt;
    use serde_json::{json, Value};
    use tokio::sync::mpsc;

    /// A detokenizer over a fixed vocabulary of byte strings, holding back
    /// incomplete UTF-8 like the real one.
    pub(crate) struct BytesDecoder {
        vocab: Vec<Vec<u8>>,
        pending: Vec<u8>,
    }

    impl BytesDecoder {
        pub fn new(vocab: &[&[u8]]) -> Self {
            BytesDecoder { vocab: vocab.iter().map(|b| b.to_vec()).collect(), pending: Vec::new() }
        }
    }

    impl Detokenize for BytesDecoder {
        fn push(&mut self, id: u32) -> Result<Option<String>, String> {
            let bytes = self.vocab.get(id as usize).ok_or_else(|| format!("no token {id}"))?;
            self.pending.extend_from_slice(bytes);
            match String::from_utf8(std::mem::take(&mut self.pending)) {
                Ok(s) => Ok(Some(s)),
                Err(e) => {
                    self.pending = e.into_bytes();
                    Ok(None)
                }
            }
        }
    }

    #[derive(Clone)]
    struct BytesSource(&'static [&'static [u8]]);

    impl DecoderSource for BytesSource {
        fn decoder(&self) -> Box<dyn Detokenize + '_> {
            Box::new(BytesDecoder::new(self.0))
        }
        fn token_text(&self, id: u32) -> String {
            String::from_utf8_lossy(self.0[id as usize]).into_owned()
        }
    }

    /// "Hello", " wor", "ld", "\n", first and second half of "é", "</", "s>", "!"
    const VOCAB: &[&[u8]] = &[b"Hello", b" wor", b"ld", b"\n", &[0xC3], &[0xA9], b"</", b"s>", b"!"];

    fn finished(reason: FinishReason, completion_tokens: usize) -> Event {
        Event::Finished { reason, usage: Usage { prompt_tokens: 3, completion_tokens, cached_tokens: 2 } }
    }

    /// A receiver already holding `events` (the sender is returned so the
    /// channel stays open unless the events end it).
    fn scripted(events: Vec<Event>) -> (mpsc::UnboundedSender<Event>, UnboundedReceiver<Event>) {
        let (tx, rx) = mpsc::unbounded_channel();
        for e in events {
            tx.send(e).unwrap();
        }
        (tx, rx)
    }

    #[tokio::test]
    async fn collect_joins_text_and_reports_the_backend_finish() {
        let (_tx, rx) = scripted(vec![
            Event::Token(0),
            Event::Token(1),
            Event::Token(4),
            Event::Token(5),
            finished(FinishReason::Length, 4),
        ]);
        let out = collect(rx, &mut BytesDecoder::new(VOCAB), &TextRules::default()).await.unwrap();
        assert_eq!(
            out,
            Outcome {
                text: "Hello woré".into(),
                reason: FinishReason::Length,
                completion_tokens: 4,
                cached_tokens: 2,
                logprobs: vec![]
            }
        );
    }

    #[tokio::test]
    async fn collect_stops_at_a_stop_string_and_cancels() {
        let (tx, rx) = scripted(vec![
            Event::Started { cached_tokens: 256 },
            Event::Token(0),
            Event::Token(6),
            Event::Token(7),
            Event::Token(8),
        ]);
        let out = collect(rx, &mut BytesDecoder::new(VOCAB), &TextRules::stop(&["</s>"])).await.unwrap();
        // Cached tokens come from `Started`: the backend never finishes.
        assert_eq!(
            out,
            Outcome {
                text: "Hello".into(),
                reason: FinishReason::Stop,
                completion_tokens: 3,
                cached_tokens: 256,
                logprobs: vec![]
            }
        );
        assert!(tx.is_closed(), "the receiver must be dropped so the backend cancels");
    }

    #[tokio::test]
    async fn collect_reports_failures() {
        let (_tx, rx) = scripted(vec![Event::Token(0), Event::Failed("out of memory".into())]);
        assert_eq!(
            collect(rx, &mut BytesDecoder::new(VOCAB), &TextRules::default()).await,
            Err("out of memory".into())
        );
        let (tx, rx) = scripted(vec![Event::Token(0)]);
        drop(tx);
        let err = collect(rx, &mut BytesDecoder::new(VOCAB), &TextRules::default()).await.unwrap_err();
        assert!(err.contains("without a result"), "{err}");
    }

    async fn stream_all(events: Vec<Event>, stop: &[&str], endpoint: Endpoint, include_usage: bool) -> Vec<String> {
        let (_tx, rx) = scripted(events);
        let chunker = Header { endpoint, id: "x".into(), created: 1, model: "m".into() }.chunker(include_usage);
        sse_data(vec![(rx, None)], BytesSource(VOCAB), TextRules::stop(stop), chunker, 3).collect().await
    }

    fn json_chunks(data: &[String]) -> Vec<Value> {
        assert_eq!(data.last().map(String::as_str), Some("[DONE]"));
        data[..data.len() - 1].iter().map(|d| serde_json::from_str(d).unwrap()).collect()
    }

    fn chat_text(chunks: &[Value]) -> String {
        chunks.iter().filter_map(|c| c["choices"].get(0)?["delta"]["content"].as_str()).collect()
    }

    #[tokio::test]
    async fn a_chat_stream_has_the_openai_chunk_sequence() {
        let events = vec![Event::Token(0), Event::Token(1), Event::Token(2), finished(FinishReason::Stop, 3)];
        let chunks = json_chunks(&stream_all(events, &[], Endpoint::Chat, true).await);
        let deltas: Vec<&Value> = chunks.iter().map(|c| &c["choices"]).collect();
        assert_eq!(
            deltas[0],
            &json!([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null}])
        );
        assert_eq!(chat_text(&chunks), "Hello world");
        let finish = &chunks[chunks.len() - 2];
        assert_eq!(finish["choices"], json!([{"index": 0, "delta": {}, "logprobs": null, "finish_reason": "stop"}]));
        assert_eq!(finish["usage"], Value::Null);
        let last = chunks.last().unwrap();
        assert_eq!(last["choices"], json!([]));
        assert_eq!(
            last["usage"],
            json!({"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6, "prompt_tokens_details": {"cached_tokens": 2}})
        );
        assert!(chunks.iter().all(|c| c["id"] == "x" && c["object"] == "chat.completion.chunk"));
    }

    #[tokio::test]
    async fn a_stream_never_splits_a_character_nor_sends_empty_deltas() {
        let events = vec![Event::Token(0), Event::Token(4), Event::Token(5), finished(FinishReason::Length, 3)];
        let chunks = json_chunks(&stream_all(events, &[], Endpoint::Chat, false).await);
        let texts: Vec<&str> =
            chunks[1..].iter().filter_map(|c| c["choices"][0]["delta"]["content"].as_str()).collect();
        assert_eq!(texts, ["Hello", "é"]);
        assert!(chunks.iter().all(|c| c.get("usage").is_none()));
    }

    #[tokio::test]
    async fn a_stream_stops_at_a_stop_string_across_tokens() {
        let (tx, rx) = scripted(vec![Event::Token(0), Event::Token(6), Event::Token(7), Event::Token(8)]);
        let chunker =
            Header { endpoint: Endpoint::Completion, id: "x".into(), created: 1, model: "m".into() }.chunker(true);
        let data: Vec<String> =
            sse_data(vec![(rx, None)], BytesSource(VOCAB), TextRules::stop(&["</s>"]), chunker, 3).collect().await;
        assert!(tx.is_closed());
        let chunks = json_chunks(&data);
        let text: String = chunks.iter().filter_map(|c| c["choices"].get(0)?["text"].as_str()).collect();
        assert_eq!(text, "Hello");
        assert_eq!(chunks[chunks.len() - 2]["choices"][0]["finish_reason"], "stop");
        let usage = &chunks.last().unwrap()["usage"];
        assert_eq!((usage["completion_tokens"].as_u64(), usage["prompt_tokens"].as_u64()), (Some(3), Some(3)));
    }

    #[tokio::test]
    async fn held_back_text_is_sent_when_generation_ends() {
        let events = vec![Event::Token(0), Event::Token(6), finished(FinishReason::Length, 2)];
        let chunks = json_chunks(&stream_all(events, &["</s>"], Endpoint::Completion, false).await);
        let text: String = chunks.iter().filter_map(|c| c["choices"].get(0)?["text"].as_str()).collect();
        assert_eq!(text, "Hello</");
        assert_eq!(chunks.last().unwrap()["choices"][0]["finish_reason"], "length");
    }

    #[tokio::test]
    async fn a_failure_becomes_an_error_event() {
        let events = vec![Event::Token(0), Event::Failed("kv pool exhausted".into())];
        let data = stream_all(events, &[], Endpoint::Chat, true).await;
        let chunks = json_chunks(&data);
        let err = &chunks.last().unwrap()["error"];
        assert_eq!(err["type"], "server_error");
        assert!(err["message"].as_str().unwrap().contains("kv pool exhausted"));
        assert_eq!(chat_text(&chunks), "Hello");
    }

    #[tokio::test]
    async fn dropping_the_stream_cancels_the_generation() {
        let (tx, rx) = mpsc::unbounded_channel();
        let chunker = Header { endpoint: Endpoint::Chat, id: "x".into(), created: 1, model: "m".into() }.chunker(false);
        let mut stream = Box::pin(sse_data(vec![(rx, None)], BytesSource(VOCAB), TextRules::default(), chunker, 3));
        tx.send(Event::Token(0)).unwrap();
        assert!(stream.next().await.is_some()); // role
        assert!(stream.next().await.is_some()); // "Hello"
        assert!(!tx.is_closed());
        drop(stream); // the client went away
        assert!(tx.is_closed());
    }
}

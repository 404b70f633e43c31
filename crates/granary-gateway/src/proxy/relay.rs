//! Relaying an SSE answer event by event, metering tokens as they pass.

use super::*;

/// Passes an SSE answer through event by event (never the whole answer),
/// counting completion tokens as chunks pass (one per choice with new
/// content, or the relayed text's tokens where the upstream's tokenizer is
/// known and counts more: see [`Outcome::streamed_tokens`]), taking usage from the last
/// chunk as the truth and hiding that chunk when the client did not ask for
/// it. A failure mid-stream ends it with an error event: a stream that has
/// started is never retried. When the client goes away the stream is
/// dropped where it waits, and with it the upstream request; the record
/// says 499 with the tokens counted so far.
pub(super) fn relay_sse(
    first: Bytes,
    mut body: impl Stream<Item = Result<Bytes, crate::upstream::BodyError>> + Send + Unpin + 'static,
    mut out: Outcome,
    held: (Slot, granary_core::trace::EndOnDrop),
    include_usage: bool,
    idle: Duration,
) -> impl Stream<Item = Result<Bytes, std::io::Error>> + Send {
    async_stream::stream! {
        // The upstream's slot, and the spans that end with the stream.
        let _held = held;
        let mut filter = EventFilter::default();
        // The last chunk, whose id, model and object a usage chunk copies.
        let mut last: Option<Value> = None;
        let mut next = Some(first);
        loop {
            let chunk = match next.take() {
                Some(c) => c,
                None => match tokio::time::timeout(idle, body.next()).await {
                    Ok(Some(Ok(c))) => c,
                    Ok(None) => {
                        out.finished();
                        break;
                    }
                    // After `[DONE]` the answer is whole: how the upstream
                    // closes the connection then does not matter.
                    Ok(Some(Err(_))) | Err(_) if out.done => break,
                    Ok(Some(Err(e))) => {
                        tracing::warn!(request_id = %out.rec.request_id, error = %e, "upstream stream broke");
                        out.done = true;
                        out.broke(502, "upstream_error");
                        yield Ok(error_event("The upstream engine failed mid-stream."));
                        break;
                    }
                    Err(_) => {
                        out.done = true;
                        out.broke(504, "upstream_timeout");
                        yield Ok(error_event("The upstream engine went silent mid-stream."));
                        break;
                    }
                },
            };
            let mut pass = Vec::with_capacity(chunk.len());
            for ev in filter.push(&chunk) {
                if let Some(data) = ev.data.as_deref() {
                    if data.trim() == "[DONE]" {
                        out.done = true;
                        if include_usage && !out.usage_seen {
                            // The upstream ignores `stream_options` (llama.cpp's
                            // Python server does): the client asked for usage,
                            // so it gets the gateway's count.
                            if let Some(last) = &last {
                                pass.extend_from_slice(&usage_event(last, out.prompt_estimate, out.streamed_tokens()));
                            }
                        }
                    }
                    if let Ok(v) = serde_json::from_str::<Value>(data) {
                        out.streamed_chunk(&v);
                        if include_usage && !out.usage_seen {
                            last = Some(v.clone());
                        }
                        if v.get("usage").is_some_and(|u| u.is_object()) {
                            out.usage(&v);
                            let usage_only = v["choices"].as_array().is_some_and(|c| c.is_empty());
                            if usage_only && !include_usage {
                                continue;
                            }
                        }
                    }
                }
                pass.extend_from_slice(&ev.raw);
            }
            if !pass.is_empty() {
                yield Ok(Bytes::from(pass));
            }
        }
        let rest = filter.finish();
        if !rest.is_empty() {
            yield Ok(Bytes::from(rest));
        }
    }
}

/// Choices of a streamed chunk that carry new output (text, reasoning or a
/// tool call): a token each.
pub(super) fn content_choices(v: &Value) -> u64 {
    let some = |x: &Value| x.as_str().is_some_and(|s| !s.is_empty());
    let Some(choices) = v.get("choices").and_then(Value::as_array) else { return 0 };
    choices
        .iter()
        .filter(|c| {
            let d = &c["delta"];
            some(&d["content"]) || some(&d["reasoning_content"]) || d["tool_calls"].is_array() || some(&c["text"])
        })
        .count() as u64
}

/// A final usage chunk as OpenAI sends it (no choices), counted here.
pub(super) fn usage_event(last: &Value, prompt: u64, completion: u64) -> Vec<u8> {
    let v = serde_json::json!({
        "id": last["id"],
        "object": last["object"],
        "created": last["created"],
        "model": last["model"],
        "choices": [],
        "usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion},
    });
    format!("data: {v}\n\n").into_bytes()
}

pub(super) fn error_event(message: &str) -> Bytes {
    let e = ApiError::bad_gateway(message);
    Bytes::from(format!("data: {}\n\n", e.body()))
}

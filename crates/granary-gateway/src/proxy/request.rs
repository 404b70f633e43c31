//! Reading a generation request: the bearer token and the body, checked
//! field by field, read once into what routing and limits need.

use super::*;

/// What the gateway read from a request body. Only the fields routing,
/// limits and metering need are read; the body is forwarded as received
/// (unless the model's name or the usage option must change), and parsed
/// whole only for the features that need all of it (caches, prompt
/// hashing, logged prompts).
pub(super) struct Parsed {
    /// The body as the client sent it.
    pub(super) raw: Bytes,
    whole: std::sync::OnceLock<serde_json::Map<String, Value>>,
    pub(super) model: String,
    pub(super) stream: bool,
    pub(super) include_usage: bool,
    /// The body has a `stream_options` object.
    has_stream_options: bool,
    /// `temperature` 0 or a numeric `seed`: the answer may be cached.
    pub(super) deterministic: bool,
    pub(super) estimate: u64,
    /// The prompt alone, estimated (~4 bytes a token).
    pub(super) prompt_estimate: u64,
    /// `max_tokens` (or `max_completion_tokens`) when the request sets it.
    pub(super) max_tokens: Option<u64>,
    /// Completions the request may generate, each up to `max_tokens`: `n`
    /// (or completions' `best_of`, when larger) for each batched prompt.
    pub(super) completions: u64,
}

impl Parsed {
    /// The whole body, parsed on first use.
    pub(super) fn body(&self) -> &serde_json::Map<String, Value> {
        // The bytes parsed as a JSON object in `parse_body`.
        self.whole.get_or_init(|| serde_json::from_slice(&self.raw).unwrap_or_default())
    }

    /// The body to send upstream as `wire_model`: as received when nothing
    /// changes, else with the model's name and (streams) the usage chunk
    /// asked for.
    pub(super) fn payload(&self, wire_model: &str) -> Result<Bytes, ApiError> {
        let add_usage = self.stream && !self.include_usage;
        if wire_model == self.model && !add_usage {
            return Ok(self.raw.clone());
        }
        if wire_model == self.model && !self.has_stream_options {
            // A member put first: the object has no other by that name.
            let at = self.raw.iter().position(|&b| b == b'{').map_or(0, |i| i + 1);
            let mut out = Vec::with_capacity(self.raw.len() + 40);
            out.extend_from_slice(&self.raw[..at]);
            out.extend_from_slice(br#""stream_options":{"include_usage":true},"#);
            out.extend_from_slice(&self.raw[at..]);
            return Ok(out.into());
        }
        let mut body = self.body().clone();
        body.insert("model".into(), Value::String(wire_model.to_string()));
        if add_usage {
            let opts = body.entry("stream_options").or_insert_with(|| Value::Object(Default::default()));
            if let Value::Object(o) = opts {
                o.insert("include_usage".into(), Value::Bool(true));
            }
        }
        Ok(Bytes::from(serde_json::to_vec(&body).map_err(|e| ApiError::internal(&e))?))
    }
}

/// The fields the gateway reads; the rest of the body is checked to be
/// JSON and skipped.
#[derive(serde::Deserialize)]
struct Head<'a> {
    #[serde(default)]
    model: Option<Value>,
    #[serde(default)]
    stream: Option<Value>,
    #[serde(default)]
    stream_options: Option<Value>,
    #[serde(default)]
    max_tokens: Option<Value>,
    #[serde(default)]
    max_completion_tokens: Option<Value>,
    #[serde(default)]
    temperature: Option<Value>,
    #[serde(default)]
    seed: Option<Value>,
    #[serde(default)]
    n: Option<Value>,
    #[serde(default)]
    best_of: Option<Value>,
    #[serde(default, borrow)]
    messages: Option<&'a serde_json::value::RawValue>,
    #[serde(default, borrow)]
    prompt: Option<&'a serde_json::value::RawValue>,
}

pub(super) fn parse_body(endpoint: Endpoint, bytes: &Bytes) -> Result<Parsed, ApiError> {
    let invalid = |e: serde_json::Error| {
        ApiError::bad_request("invalid_json", format!("The request body is not valid JSON: {e}."))
    };
    if bytes.iter().find(|b| !b.is_ascii_whitespace()) != Some(&b'{') {
        // Tell a JSON value that is not an object from text that is not JSON.
        serde_json::from_slice::<serde::de::IgnoredAny>(bytes).map_err(invalid)?;
        return Err(ApiError::bad_request("invalid_json", "The request body must be a JSON object."));
    }
    let head: Head<'_> = serde_json::from_slice(bytes).map_err(invalid)?;
    let model = match head.model {
        Some(Value::String(s)) if !s.is_empty() => s,
        Some(Value::String(_)) | None | Some(Value::Null) => {
            return Err(ApiError::invalid(
                "model",
                "missing_required_parameter",
                "Missing required parameter: `model`.",
            ))
        }
        Some(_) => {
            return Err(ApiError::invalid("model", "invalid_type", "Invalid type for `model`: expected a string."))
        }
    };
    let stream = match head.stream {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => b,
        Some(_) => {
            return Err(ApiError::invalid("stream", "invalid_type", "Invalid type for `stream`: expected a boolean."))
        }
    };
    let has_stream_options = matches!(head.stream_options, Some(Value::Object(_)));
    let include_usage = match &head.stream_options {
        None | Some(Value::Null) => false,
        Some(Value::Object(o)) => match o.get("include_usage") {
            None | Some(Value::Null) => false,
            Some(Value::Bool(b)) => *b,
            Some(_) => {
                return Err(ApiError::invalid(
                    "stream_options.include_usage",
                    "invalid_type",
                    "Invalid type for `stream_options.include_usage`: expected a boolean.",
                ))
            }
        },
        Some(_) => {
            return Err(ApiError::invalid(
                "stream_options",
                "invalid_type",
                "Invalid type for `stream_options`: expected an object.",
            ))
        }
    };
    let mut max_tokens = None;
    for (field, v) in [("max_tokens", &head.max_tokens), ("max_completion_tokens", &head.max_completion_tokens)] {
        match v {
            None | Some(Value::Null) => {}
            Some(v) => match v.as_u64() {
                Some(n) => max_tokens = Some(n),
                None => {
                    return Err(ApiError::invalid(
                        field,
                        "invalid_type",
                        format!("Invalid type for `{field}`: expected a non-negative integer."),
                    ))
                }
            },
        }
    }
    // The first character of a field's JSON text tells its type.
    let starts = |v: Option<&serde_json::value::RawValue>| v.and_then(|r| r.get().bytes().next());
    let (field, ok) = match endpoint {
        Endpoint::Chat => {
            let non_empty_array =
                head.messages.is_some_and(|r| r.get().starts_with('[') && !r.get()[1..].trim_start().starts_with(']'));
            ("messages", non_empty_array)
        }
        Endpoint::Completions => ("prompt", matches!(starts(head.prompt), Some(b'"' | b'['))),
    };
    if !ok {
        let present = match endpoint {
            Endpoint::Chat => head.messages,
            Endpoint::Completions => head.prompt,
        };
        return Err(match present.filter(|r| r.get() != "null") {
            None => ApiError::invalid(
                field,
                "missing_required_parameter",
                format!("Missing required parameter: `{field}`."),
            ),
            Some(_) => ApiError::invalid(
                field,
                "invalid_type",
                if endpoint == Endpoint::Chat {
                    "Invalid type for `messages`: expected a non-empty array.".to_string()
                } else {
                    "Invalid type for `prompt`: expected a string or an array of token ids.".to_string()
                },
            ),
        });
    }
    let mut choices = 1;
    for (field, v) in [("n", &head.n), ("best_of", &head.best_of)] {
        match v {
            None | Some(Value::Null) => {}
            Some(v) => match v.as_u64().filter(|&n| n >= 1) {
                Some(n) => choices = choices.max(n),
                None => {
                    return Err(ApiError::invalid(
                        field,
                        "invalid_type",
                        format!("Invalid type for `{field}`: expected a positive integer."),
                    ))
                }
            },
        }
    }
    let completions = choices.saturating_mul(batched_prompts(head.prompt));
    let deterministic = crate::cache::deterministic_fields(head.temperature.as_ref(), head.seed.as_ref());
    // A rough token estimate for token limits: ~4 bytes a token.
    let prompt_estimate = bytes.len() as u64 / 4;
    let estimate = prompt_estimate + max_tokens.unwrap_or(0).saturating_mul(completions);
    Ok(Parsed {
        raw: bytes.clone(),
        whole: std::sync::OnceLock::new(),
        model,
        stream,
        include_usage,
        has_stream_options,
        deterministic,
        estimate,
        prompt_estimate,
        max_tokens,
        completions,
    })
}

/// Prompts in a completions `prompt`: an array of strings or of token
/// arrays is a batch, each prompt answered on its own; anything else is one.
fn batched_prompts(prompt: Option<&serde_json::value::RawValue>) -> u64 {
    let Some(raw) = prompt.filter(|r| r.get().starts_with('[')) else { return 1 };
    match serde_json::from_str::<Vec<&serde_json::value::RawValue>>(raw.get()) {
        Ok(items) if items.first().is_some_and(|i| i.get().starts_with(['"', '['])) => items.len().max(1) as u64,
        _ => 1,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bodies_are_checked_field_by_field() {
        let err = |e: Endpoint, s: &str| parse_body(e, &Bytes::copy_from_slice(s.as_bytes())).err().unwrap();
        let e = err(Endpoint::Chat, "{");
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
        assert!(e.message.contains("not valid JSON"), "{}", e.message);
        assert_eq!(err(Endpoint::Chat, "[1]").code, Some("invalid_json"));
        assert_eq!(
            err(Endpoint::Chat, r#"{"messages": [{"role":"user","content":"x"}]}"#).param.as_deref(),
            Some("model")
        );
        assert_eq!(err(Endpoint::Chat, r#"{"model": 5, "messages": []}"#).param.as_deref(), Some("model"));
        assert_eq!(err(Endpoint::Chat, r#"{"model": "m"}"#).param.as_deref(), Some("messages"));
        assert_eq!(err(Endpoint::Chat, r#"{"model": "m", "messages": "hi"}"#).param.as_deref(), Some("messages"));
        assert_eq!(err(Endpoint::Completions, r#"{"model": "m"}"#).param.as_deref(), Some("prompt"));
        let m = r#""model": "m", "prompt": "x""#;
        assert_eq!(err(Endpoint::Completions, &format!("{{{m}, \"stream\": 1}}")).param.as_deref(), Some("stream"));
        assert_eq!(
            err(Endpoint::Completions, &format!("{{{m}, \"max_tokens\": -1}}")).param.as_deref(),
            Some("max_tokens")
        );
        assert_eq!(
            err(Endpoint::Completions, &format!("{{{m}, \"stream_options\": {{\"include_usage\": \"y\"}}}}"))
                .param
                .as_deref(),
            Some("stream_options.include_usage")
        );
        let ok =
            parse_body(Endpoint::Completions, &Bytes::from(format!("{{{m}, \"stream\": true, \"max_tokens\": 100}}")))
                .ok()
                .unwrap();
        assert!(ok.stream && !ok.include_usage);
        assert_eq!(ok.model, "m");
        assert!(ok.estimate >= 100);
        assert_eq!(ok.completions, 1);
        // Every completion the request may generate counts: n (or best_of)
        // for each batched prompt.
        let parse = |s: String| parse_body(Endpoint::Completions, &Bytes::from(s));
        let three = parse(format!("{{{m}, \"n\": 3, \"max_tokens\": 100}}")).ok().unwrap();
        assert_eq!(three.completions, 3);
        assert_eq!(three.estimate, three.prompt_estimate + 300);
        let batch = parse(r#"{"model": "m", "prompt": ["a", "b"], "n": 2, "best_of": 3, "max_tokens": 10}"#.into())
            .ok()
            .unwrap();
        assert_eq!(batch.completions, 6);
        let ids = parse(r#"{"model": "m", "prompt": [[1, 2], [3], [4]], "max_tokens": 10}"#.into()).ok().unwrap();
        assert_eq!(ids.completions, 3);
        assert_eq!(parse(r#"{"model": "m", "prompt": [1, 2, 3]}"#.into()).ok().unwrap().completions, 1);
        assert_eq!(parse(r#"{"model": "m", "prompt": ["one"]}"#.into()).ok().unwrap().completions, 1);
        for bad in [r#""n": 0"#, r#""n": "2""#, r#""best_of": -1"#] {
            let e = parse(format!("{{{m}, {bad}}}")).err().unwrap();
            assert!(e.message.contains("positive integer"), "{bad}: {}", e.message);
        }
    }
}

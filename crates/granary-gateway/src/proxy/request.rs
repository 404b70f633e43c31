//! Reading a generation request: the bearer token and the body, checked
//! field by field, read once into what routing and limits need.

use super::*;

/// What the gateway read from a request body.
pub(super) struct Parsed {
    pub(super) body: serde_json::Map<String, Value>,
    pub(super) model: String,
    pub(super) stream: bool,
    pub(super) include_usage: bool,
    pub(super) estimate: u64,
    /// The prompt alone, estimated (~4 bytes a token).
    pub(super) prompt_estimate: u64,
    /// `max_tokens` (or `max_completion_tokens`) when the request sets it.
    pub(super) max_tokens: Option<u64>,
}

pub(super) fn parse_body(endpoint: Endpoint, bytes: &[u8]) -> Result<Parsed, ApiError> {
    let v: Value = serde_json::from_slice(bytes)
        .map_err(|e| ApiError::bad_request("invalid_json", format!("The request body is not valid JSON: {e}.")))?;
    let Value::Object(body) = v else {
        return Err(ApiError::bad_request("invalid_json", "The request body must be a JSON object."));
    };
    let model = match body.get("model") {
        Some(Value::String(s)) if !s.is_empty() => s.clone(),
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
    let stream = match body.get("stream") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => {
            return Err(ApiError::invalid("stream", "invalid_type", "Invalid type for `stream`: expected a boolean."))
        }
    };
    let include_usage = match body.get("stream_options") {
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
    for field in ["max_tokens", "max_completion_tokens"] {
        match body.get(field) {
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
    let (field, ok) = match endpoint {
        Endpoint::Chat => ("messages", matches!(body.get("messages"), Some(Value::Array(a)) if !a.is_empty())),
        Endpoint::Completions => ("prompt", matches!(body.get("prompt"), Some(Value::String(_) | Value::Array(_)))),
    };
    if !ok {
        return Err(match body.get(field) {
            None | Some(Value::Null) => ApiError::invalid(
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
    // A rough token estimate for token limits: ~4 bytes a token.
    let prompt_estimate = bytes.len() as u64 / 4;
    let estimate = prompt_estimate + max_tokens.unwrap_or(0);
    Ok(Parsed { body, model, stream, include_usage, estimate, prompt_estimate, max_tokens })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bodies_are_checked_field_by_field() {
        let err = |e: Endpoint, s: &str| parse_body(e, s.as_bytes()).err().unwrap();
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
            parse_body(Endpoint::Completions, format!("{{{m}, \"stream\": true, \"max_tokens\": 100}}").as_bytes())
                .ok()
                .unwrap();
        assert!(ok.stream && !ok.include_usage);
        assert_eq!(ok.model, "m");
        assert!(ok.estimate >= 100);
    }
}

//! JSON request bodies: content type, size limit and parse errors that
//! name the line and column (bad JSON) or the field (wrong type or value).

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{FromRequest, Request};
use axum::http::{header, HeaderMap, StatusCode};
use serde::de::DeserializeOwned;
use serde_json::error::Category;

use super::error::ApiError;
use super::AppState;

/// A request body parsed as `T`, or the [`ApiError`] saying why not.
pub(crate) struct JsonBody<T>(pub T);

impl<T: DeserializeOwned> FromRequest<AppState> for JsonBody<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &AppState) -> Result<Self, ApiError> {
        if !is_json(req.headers()) {
            return Err(ApiError::unsupported_media_type());
        }
        let bytes = Bytes::from_request(req, state).await.map_err(|e| read_error(e, state.opts.max_body_bytes))?;
        parse_json(&bytes).map(JsonBody)
    }
}

/// `application/json` (any parameters) or a `+json` type.
fn is_json(headers: &HeaderMap) -> bool {
    let Some(ct) = headers.get(header::CONTENT_TYPE).and_then(|v| v.to_str().ok()) else {
        return false;
    };
    let essence = ct.split(';').next().unwrap_or("").trim().to_ascii_lowercase();
    essence == "application/json" || (essence.starts_with("application/") && essence.ends_with("+json"))
}

fn read_error(e: BytesRejection, limit: usize) -> ApiError {
    if e.status() == StatusCode::PAYLOAD_TOO_LARGE {
        ApiError::too_large(limit)
    } else {
        ApiError::bad_request("invalid_body", format!("Could not read the request body: {e}"))
    }
}

/// Parses `bytes` as `T`. Syntax errors name the line and column; data
/// errors name the field in `param` and in the message.
pub(crate) fn parse_json<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, ApiError> {
    // Structs would also accept an array of their fields in order.
    if bytes.iter().find(|b| !b.is_ascii_whitespace()).is_some_and(|&b| b != b'{') {
        return Err(match serde_json::from_slice::<serde::de::IgnoredAny>(bytes) {
            Err(e) => field_error(".", e),
            Ok(_) => ApiError::bad_request("invalid_type", "The request body must be a JSON object."),
        });
    }
    let mut de = serde_json::Deserializer::from_slice(bytes);
    let value = serde_path_to_error::deserialize(&mut de).map_err(|e| {
        let path = e.path().to_string();
        field_error(&path, e.into_inner())
    })?;
    de.end().map_err(|e| field_error(".", e))?;
    Ok(value)
}

fn field_error(path: &str, e: serde_json::Error) -> ApiError {
    if e.classify() != Category::Data {
        return ApiError::bad_request(
            "invalid_json",
            format!("We could not parse the JSON body of your request: {e}. The body must be a JSON object."),
        );
    }
    // serde_json appends the position; the field path says more.
    let full = e.to_string();
    let suffix = format!(" at line {} column {}", e.line(), e.column());
    let reason = full.strip_suffix(&suffix).unwrap_or(&full);
    let path = (path != "." && path != "?").then_some(path);

    if let Some(field) = reason.strip_prefix("missing field `").and_then(|r| r.strip_suffix('`')) {
        let param = match path {
            Some(p) => format!("{p}.{field}"),
            None => field.to_string(),
        };
        return ApiError::invalid(
            &param,
            "missing_required_parameter",
            format!("Missing required parameter: `{param}`."),
        );
    }
    if let Some(field) = reason.strip_prefix("unknown field `").and_then(|r| r.split('`').next()) {
        // The path already ends with the unknown field.
        let param = path.unwrap_or(field).to_string();
        return ApiError::invalid(
            &param,
            "unknown_parameter",
            format!("Unknown parameter: `{param}`. This server does not take it; leave it out."),
        );
    }
    let code = if reason.starts_with("invalid type") { "invalid_type" } else { "invalid_value" };
    match path {
        Some(p) => ApiError::invalid(p, code, format!("Invalid value for `{p}`: {reason}.")),
        None => ApiError::bad_request(code, format!("Invalid request body: {reason}. The body must be a JSON object.")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;
    use serde::Deserialize;

    #[derive(Debug, Deserialize)]
    #[allow(dead_code)]
    struct Outer {
        name: String,
        items: Vec<Inner>,
    }

    #[derive(Debug, Deserialize)]
    #[allow(dead_code)]
    struct Inner {
        value: u32,
    }

    #[test]
    fn syntax_errors_name_line_and_column() {
        let e = parse_json::<Outer>(b"{\n  \"name\": \"x\",\n  \"items\": [,]\n}").unwrap_err();
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
        assert_eq!(e.code, Some("invalid_json"));
        assert_eq!(e.param, None);
        assert!(e.message.contains("line 3 column 13"), "{}", e.message);

        let e = parse_json::<Outer>(b"").unwrap_err();
        assert_eq!(e.code, Some("invalid_json"));
        assert!(e.message.contains("line 1 column 0"), "{}", e.message);

        let e = parse_json::<Outer>(br#"{"name":"x","items":[]} trailing"#).unwrap_err();
        assert_eq!(e.code, Some("invalid_json"));
        assert!(e.message.contains("trailing characters at line 1 column 25"), "{}", e.message);
    }

    #[test]
    fn data_errors_name_the_field() {
        let e = parse_json::<Outer>(br#"{"name":"x","items":[{"value":1},{"value":"two"}]}"#).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("items[1].value"));
        assert_eq!(e.code, Some("invalid_type"));
        assert!(e.message.contains("`items[1].value`"), "{}", e.message);
        assert!(!e.message.contains("column"), "{}", e.message);

        let e = parse_json::<Outer>(br#"{"name":"x","items":[{"value":-1}]}"#).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("items[0].value"));
        assert_eq!(e.code, Some("invalid_value"));
    }

    #[test]
    fn missing_fields_are_named_with_their_parent() {
        let e = parse_json::<Outer>(br#"{"items":[]}"#).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("name"));
        assert_eq!(e.code, Some("missing_required_parameter"));
        assert!(e.message.contains("`name`"), "{}", e.message);

        let e = parse_json::<Outer>(br#"{"name":"x","items":[{},{"value":1}]}"#).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("items[0].value"));
    }

    #[derive(Debug, Deserialize)]
    #[serde(deny_unknown_fields)]
    #[allow(dead_code)]
    struct Strict {
        name: String,
        #[serde(default)]
        inner: Option<StrictInner>,
    }

    #[derive(Debug, Deserialize)]
    #[serde(deny_unknown_fields)]
    #[allow(dead_code)]
    struct StrictInner {
        value: u32,
    }

    #[test]
    fn unknown_fields_are_named() {
        let e = parse_json::<Strict>(br#"{"name":"x","bogus_field":1}"#).unwrap_err();
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
        assert_eq!(e.code, Some("unknown_parameter"));
        assert_eq!(e.param.as_deref(), Some("bogus_field"));
        assert!(e.message.contains("`bogus_field`"), "{}", e.message);
        // The list of expected fields serde appends stays out of the message.
        assert!(!e.message.contains("expected"), "{}", e.message);

        let e = parse_json::<Strict>(br#"{"name":"x","inner":{"value":1,"extra":true}}"#).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("inner.extra"));
    }

    #[test]
    fn a_body_that_is_not_an_object_has_no_param() {
        for body in [&br#"["x", []]"#[..], b"5", b" \"text\""] {
            let e = parse_json::<Outer>(body).unwrap_err();
            assert_eq!(e.status, StatusCode::BAD_REQUEST);
            assert_eq!(e.param, None);
            assert!(e.message.contains("JSON object"), "{}", e.message);
        }
        let e = parse_json::<Outer>(b"[1,").unwrap_err();
        assert_eq!(e.code, Some("invalid_json"));
    }

    #[test]
    fn content_types() {
        let mut h = HeaderMap::new();
        assert!(!is_json(&h));
        for (ct, ok) in [
            ("application/json", true),
            ("Application/JSON; charset=utf-8", true),
            ("application/merge-patch+json", true),
            ("text/plain", false),
            ("application/x-www-form-urlencoded", false),
        ] {
            h.insert(header::CONTENT_TYPE, HeaderValue::from_static(ct));
            assert_eq!(is_json(&h), ok, "{ct}");
        }
    }
}

//! Errors in the OpenAI shape.
//!
//! Every refusal — a body that is not JSON, a field of the wrong type or out
//! of range, an unknown model, a prompt over the context, a route that does
//! not exist — is an [`ApiError`], rendered as
//!
//! ```json
//! {"error": {"message": "...", "type": "invalid_request_error", "param": "temperature", "code": "invalid_value"}}
//! ```
//!
//! `param` names the request field at fault in the path notation OpenAI
//! uses (`messages[1].content`), or is `null` when no single field is.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Serialize;

/// The OpenAI error `type` values used here.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorType {
    InvalidRequestError,
    ServerError,
}

/// An error answer: status plus the JSON body's fields.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    pub status: StatusCode,
    pub kind: ErrorType,
    pub message: String,
    /// The request field at fault (`model`, `messages[1].content`, ...).
    pub param: Option<String>,
    /// A stable, machine-readable code.
    pub code: Option<&'static str>,
}

#[derive(Serialize)]
pub(crate) struct ErrorBody<'a> {
    error: ErrorInner<'a>,
}

#[derive(Serialize)]
struct ErrorInner<'a> {
    message: &'a str,
    #[serde(rename = "type")]
    kind: ErrorType,
    param: Option<&'a str>,
    code: Option<&'a str>,
}

impl ApiError {
    pub fn new(status: StatusCode, kind: ErrorType, code: &'static str, message: impl Into<String>) -> Self {
        ApiError { status, kind, message: message.into(), param: None, code: Some(code) }
    }

    /// Names the request field at fault.
    pub fn param(mut self, param: impl Into<String>) -> Self {
        self.param = Some(param.into());
        self
    }

    /// 400 about one field.
    pub fn invalid(param: impl Into<String>, code: &'static str, message: impl Into<String>) -> Self {
        Self::bad_request(code, message).param(param)
    }

    /// 400 not tied to one field.
    pub fn bad_request(code: &'static str, message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, ErrorType::InvalidRequestError, code, message)
    }

    pub fn model_not_found(model: &str) -> Self {
        Self::new(
            StatusCode::NOT_FOUND,
            ErrorType::InvalidRequestError,
            "model_not_found",
            format!("The model `{model}` does not exist."),
        )
        .param("model")
    }

    pub fn too_large(limit: usize) -> Self {
        Self::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            ErrorType::InvalidRequestError,
            "payload_too_large",
            format!("The request body exceeds the limit of {limit} bytes."),
        )
    }

    pub fn unsupported_media_type() -> Self {
        Self::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            ErrorType::InvalidRequestError,
            "unsupported_media_type",
            "The request body must be JSON, sent with `Content-Type: application/json`.",
        )
    }

    pub fn unknown_url(method: &str, path: &str) -> Self {
        Self::new(
            StatusCode::NOT_FOUND,
            ErrorType::InvalidRequestError,
            "unknown_url",
            format!("Invalid URL ({method} {path})."),
        )
    }

    pub fn method_not_allowed(method: &str, path: &str) -> Self {
        Self::new(
            StatusCode::METHOD_NOT_ALLOWED,
            ErrorType::InvalidRequestError,
            "method_not_allowed",
            format!("Method {method} is not allowed on {path}."),
        )
    }

    pub fn unavailable(message: impl Into<String>) -> Self {
        Self::new(StatusCode::SERVICE_UNAVAILABLE, ErrorType::ServerError, "shutting_down", message)
    }

    /// A generation that failed after it started.
    pub fn generation_failed(reason: &str) -> Self {
        Self::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            ErrorType::ServerError,
            "generation_failed",
            format!("The generation failed: {reason}"),
        )
    }

    /// 500 with a generic message; `detail` goes to the log only.
    pub fn internal(detail: &dyn std::fmt::Display) -> Self {
        tracing::error!(error = %detail, "request failed");
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, ErrorType::ServerError, "internal_error", "Internal server error.")
    }

    /// The JSON body, also sent as the data of an SSE error event.
    pub(crate) fn body(&self) -> ErrorBody<'_> {
        ErrorBody {
            error: ErrorInner {
                message: &self.message,
                kind: self.kind,
                param: self.param.as_deref(),
                code: self.code,
            },
        }
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, Json(self.body())).into_response()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn body_has_the_openai_shape() {
        let e = ApiError::invalid("messages[1].content", "invalid_type", "bad");
        let v = serde_json::to_value(e.body()).unwrap();
        assert_eq!(
            v,
            serde_json::json!({"error": {
                "message": "bad", "type": "invalid_request_error",
                "param": "messages[1].content", "code": "invalid_type"
            }})
        );
        let v = serde_json::to_value(ApiError::internal(&"disk on fire at /secret").body()).unwrap();
        assert_eq!(v["error"]["param"], serde_json::Value::Null);
        assert_eq!(v["error"]["type"], "server_error");
        assert!(!v["error"]["message"].as_str().unwrap().contains("secret"));
    }
}

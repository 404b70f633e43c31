//! Errors in the OpenAI shape:
//!
//! ```json
//! {"error": {"message": "...", "type": "rate_limit_error", "param": null, "code": "rate_limit_exceeded"}}
//! ```
//!
//! Every refusal the gateway makes, on the public API and the admin API, is
//! an [`ApiError`]. Messages say what the caller can fix; they never carry
//! internal detail (upstream addresses, database errors), which goes to the
//! log instead.

use std::time::Duration;

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Serialize;

/// The OpenAI error `type` values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorType {
    InvalidRequestError,
    AuthenticationError,
    PermissionError,
    RateLimitError,
    /// A spent budget (OpenAI's type and code for a spent quota).
    InsufficientQuota,
    ServerError,
}

/// An error answer: status, the body's fields, and `Retry-After` for 429/503.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    pub status: StatusCode,
    pub kind: ErrorType,
    pub message: String,
    /// The request field at fault (`model`, `messages[1].content`, ...).
    pub param: Option<String>,
    /// A stable, machine-readable code.
    pub code: Option<&'static str>,
    /// Seconds the client should wait before trying again.
    pub retry_after: Option<Duration>,
}

#[derive(Serialize)]
struct ErrorBody<'a> {
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
        ApiError { status, kind, message: message.into(), param: None, code: Some(code), retry_after: None }
    }

    /// Names the request field at fault.
    pub fn param(mut self, param: impl Into<String>) -> Self {
        self.param = Some(param.into());
        self
    }

    pub fn retry_after(mut self, after: Duration) -> Self {
        self.retry_after = Some(after);
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

    /// 401: no key, or a key that is unknown, expired or revoked.
    pub fn unauthorized(code: &'static str, message: impl Into<String>) -> Self {
        Self::new(StatusCode::UNAUTHORIZED, ErrorType::AuthenticationError, code, message)
    }

    /// 403: a valid key that may not do this.
    pub fn forbidden(code: &'static str, message: impl Into<String>) -> Self {
        Self::new(StatusCode::FORBIDDEN, ErrorType::PermissionError, code, message)
    }

    /// 404 for a model the key may not use or nobody serves.
    pub fn model_not_found(model: &str) -> Self {
        Self::new(
            StatusCode::NOT_FOUND,
            ErrorType::InvalidRequestError,
            "model_not_found",
            format!("The model `{model}` does not exist or you do not have access to it."),
        )
        .param("model")
    }

    pub fn not_found(what: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_FOUND, ErrorType::InvalidRequestError, "not_found", what)
    }

    /// 429 with `Retry-After`.
    pub fn rate_limited(message: impl Into<String>, retry_after: Duration) -> Self {
        Self::new(StatusCode::TOO_MANY_REQUESTS, ErrorType::RateLimitError, "rate_limit_exceeded", message)
            .retry_after(retry_after)
    }

    /// 413 for a body over the limit.
    pub fn too_large(limit: usize) -> Self {
        Self::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            ErrorType::InvalidRequestError,
            "request_too_large",
            format!("The request body is over the limit of {limit} bytes."),
        )
    }

    /// 502: the upstream answered with something unusable.
    pub fn bad_gateway(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_GATEWAY, ErrorType::ServerError, "upstream_error", message)
    }

    /// 503: no upstream can take the request now.
    pub fn unavailable(message: impl Into<String>) -> Self {
        Self::new(StatusCode::SERVICE_UNAVAILABLE, ErrorType::ServerError, "no_upstream", message)
    }

    /// 503 with `Retry-After`: an agent is loading the model and the wait
    /// for it ran out (the load goes on).
    pub fn model_loading(model: &str, retry_after: Duration) -> Self {
        Self::new(
            StatusCode::SERVICE_UNAVAILABLE,
            ErrorType::ServerError,
            "model_loading",
            format!("The model `{model}` is being loaded; try again shortly."),
        )
        .retry_after(retry_after)
    }

    /// 503 with `Retry-After`: no agent could load the model.
    pub fn model_load_failed(model: &str, retry_after: Duration) -> Self {
        Self::new(
            StatusCode::SERVICE_UNAVAILABLE,
            ErrorType::ServerError,
            "model_load_failed",
            format!("The model `{model}` could not be loaded; try again later."),
        )
        .retry_after(retry_after)
    }

    /// 504: the upstream did not answer in time.
    pub fn timeout(message: impl Into<String>) -> Self {
        Self::new(StatusCode::GATEWAY_TIMEOUT, ErrorType::ServerError, "upstream_timeout", message)
    }

    /// 500 with a generic message; the cause is logged, not returned.
    pub fn internal(cause: &dyn std::fmt::Display) -> Self {
        tracing::error!(error = %cause, "internal error");
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, ErrorType::ServerError, "internal_error", "Internal error.")
    }

    /// The JSON body alone.
    pub fn body(&self) -> serde_json::Value {
        serde_json::to_value(ErrorBody {
            error: ErrorInner {
                message: &self.message,
                kind: self.kind,
                param: self.param.as_deref(),
                code: self.code,
            },
        })
        .expect("an error body always serializes")
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}", self.status.as_u16(), self.message)
    }
}

impl std::error::Error for ApiError {}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut resp = (self.status, Json(self.body())).into_response();
        if let Some(after) = self.retry_after {
            // Whole seconds, rounded up, at least 1.
            let secs = after.as_secs() + u64::from(after.subsec_nanos() > 0);
            if let Ok(v) = HeaderValue::from_str(&secs.max(1).to_string()) {
                resp.headers_mut().insert(header::RETRY_AFTER, v);
            }
        }
        resp
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn rate_limited_rounds_retry_after_up_and_keeps_the_openai_shape() {
        let e = ApiError::rate_limited("Too many requests per minute for key gk_ab12.", Duration::from_millis(1200));
        let resp = e.into_response();
        assert_eq!(resp.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(resp.headers()[header::RETRY_AFTER], "2");
        let body = axum::body::to_bytes(resp.into_body(), 1 << 16).await.unwrap();
        let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(v["error"]["type"], "rate_limit_error");
        assert_eq!(v["error"]["code"], "rate_limit_exceeded");
        assert!(v["error"]["param"].is_null());
    }
}

//! The one place where HTTP answers turn into errors.
//!
//! Every failure — a store error, a bad path or query parameter, a body
//! that is not JSON, a missing token, a route that does not exist — becomes
//! an [`ApiError`], rendered as an OpenAI-shaped body:
//!
//! ```json
//! {"error": {"message": "...", "type": "invalid_request_error", "param": "key", "code": "invalid_block_hash"}}
//! ```
//!
//! Server-side failures keep their details in the log and tell the client
//! only that something went wrong on our side.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Serialize;

use crate::error::WarehouseError;

/// The OpenAI error `type` values used here.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorType {
    InvalidRequestError,
    AuthenticationError,
    PermissionError,
    NotFoundError,
    ServerError,
}

/// An error answer: status plus the JSON body's fields.
#[derive(Debug, Clone)]
pub struct ApiError {
    pub status: StatusCode,
    pub kind: ErrorType,
    pub message: String,
    /// The request field at fault (`key`, `keys[3]`, `ttl`, ...).
    pub param: Option<String>,
    /// A stable, machine-readable code.
    pub code: &'static str,
}

#[derive(Serialize)]
struct Body<'a> {
    error: Inner<'a>,
}

#[derive(Serialize)]
struct Inner<'a> {
    message: &'a str,
    #[serde(rename = "type")]
    kind: ErrorType,
    param: Option<&'a str>,
    code: &'a str,
}

impl ApiError {
    fn new(status: StatusCode, kind: ErrorType, code: &'static str, message: impl Into<String>) -> Self {
        ApiError { status, kind, message: message.into(), param: None, code }
    }

    /// Names the request field at fault.
    pub fn param(mut self, param: impl Into<String>) -> Self {
        self.param = Some(param.into());
        self
    }

    /// 400 about one field.
    pub fn invalid(param: impl Into<String>, code: &'static str, message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, ErrorType::InvalidRequestError, code, message).param(param)
    }

    /// 400 not tied to one field (a body that is not JSON at all).
    pub fn bad_request(code: &'static str, message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, ErrorType::InvalidRequestError, code, message)
    }

    pub fn unauthenticated(code: &'static str, message: impl Into<String>) -> Self {
        Self::new(StatusCode::UNAUTHORIZED, ErrorType::AuthenticationError, code, message)
    }

    pub fn forbidden(code: &'static str, message: impl Into<String>) -> Self {
        Self::new(StatusCode::FORBIDDEN, ErrorType::PermissionError, code, message)
    }

    pub fn not_found(code: &'static str, message: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_FOUND, ErrorType::NotFoundError, code, message)
    }

    pub fn too_large(limit: u64) -> Self {
        Self::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            ErrorType::InvalidRequestError,
            "payload_too_large",
            format!("request body exceeds the limit of {limit} bytes"),
        )
    }

    pub fn method_not_allowed() -> Self {
        Self::new(
            StatusCode::METHOD_NOT_ALLOWED,
            ErrorType::InvalidRequestError,
            "method_not_allowed",
            "method not allowed on this path",
        )
    }

    /// 500 with a generic message; `detail` goes to the log only.
    pub fn internal(detail: &dyn std::fmt::Display) -> Self {
        tracing::error!(error = %detail, "request failed");
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, ErrorType::ServerError, "internal_error", "internal server error")
    }
}

impl From<WarehouseError> for ApiError {
    fn from(e: WarehouseError) -> Self {
        match e {
            WarehouseError::Invalid { field, reason } => {
                ApiError::invalid(field, "invalid_value", format!("invalid {field}: {reason}"))
            }
            WarehouseError::TooLarge { limit, .. } => ApiError::too_large(limit),
            WarehouseError::OutOfMemory { size } => ApiError::new(
                StatusCode::INSUFFICIENT_STORAGE,
                ErrorType::ServerError,
                "insufficient_storage",
                format!("no tier can hold a value of {size} bytes"),
            ),
            other => ApiError::internal(&other),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = Body {
            error: Inner { message: &self.message, kind: self.kind, param: self.param.as_deref(), code: self.code },
        };
        (self.status, Json(body)).into_response()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tier::TierKind;

    #[test]
    fn store_errors_map_to_statuses_without_leaking_internals() {
        let e = ApiError::from(WarehouseError::invalid("namespace", "too long"));
        assert_eq!((e.status, e.param.as_deref()), (StatusCode::BAD_REQUEST, Some("namespace")));
        let e = ApiError::from(WarehouseError::TooLarge { size: 10, limit: 5 });
        assert_eq!(e.status, StatusCode::PAYLOAD_TOO_LARGE);
        let io = std::io::Error::other("/var/lib/granary/secret-path broke");
        let e = ApiError::from(WarehouseError::io(TierKind::Disk, io));
        assert_eq!(e.status, StatusCode::INTERNAL_SERVER_ERROR);
        assert!(!e.message.contains("secret-path"));
        assert_eq!(e.kind, ErrorType::ServerError);
    }
}

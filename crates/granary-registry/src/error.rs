//! Errors: [`RegistryError`] for what the registry's operations refuse or
//! fail at, and [`ApiError`], the one place they become an HTTP status and
//! an OpenAI-shaped body:
//!
//! ```json
//! {"error": {"message": "...", "type": "invalid_request_error", "param": "source", "code": "invalid_source"}}
//! ```
//!
//! Messages say what the caller can fix; store and database detail goes to
//! the log, not to clients.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Serialize;

/// Why a registry operation did not happen.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RegistryError {
    /// A request field is wrong; `field` names it.
    #[error("{field}: {message}")]
    Invalid { field: String, code: &'static str, message: String },
    /// No such model, revision, file or blob.
    #[error("{message}")]
    NotFound { code: &'static str, message: String },
    /// The revision exists already.
    #[error("{0}")]
    Conflict(String),
    /// A tool the import runs (pip) failed; its output's tail is in the message.
    #[error("{0}")]
    Upstream(String),
    /// The object store refused or failed.
    #[error("object store: {0}")]
    Store(String),
    /// The object store (a local directory) is out of space.
    #[error("no space left in the object store: {0}")]
    NoSpace(String),
    /// A stored blob's bytes no longer match its size or sha256.
    #[error("{0}")]
    Corrupt(String),
    /// The catalog database failed.
    #[error("catalog database: {0}")]
    Database(#[from] sqlx::Error),
    /// Anything else (I/O on local files, a task that panicked).
    #[error("{0}")]
    Internal(String),
}

impl RegistryError {
    /// 400 about `field`.
    pub fn invalid(field: &str, code: &'static str, message: impl Into<String>) -> Self {
        RegistryError::Invalid { field: field.to_string(), code, message: message.into() }
    }

    pub fn not_found(code: &'static str, message: impl Into<String>) -> Self {
        RegistryError::NotFound { code, message: message.into() }
    }

    /// Maps an object-store error, telling "out of space" apart.
    pub fn store(context: &str, e: object_store::Error) -> Self {
        let text = format!("{context}: {e}");
        if is_no_space(&e) {
            RegistryError::NoSpace(text)
        } else {
            RegistryError::Store(text)
        }
    }
}

fn is_no_space(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(err) = cur {
        if let Some(io) = err.downcast_ref::<std::io::Error>() {
            if io.raw_os_error() == Some(28) || io.kind() == std::io::ErrorKind::StorageFull {
                return true;
            }
        }
        cur = err.source();
    }
    e.to_string().contains("No space left on device")
}

/// The OpenAI error `type` values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorType {
    InvalidRequestError,
    AuthenticationError,
    PermissionError,
    ServerError,
}

/// An error answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    pub status: StatusCode,
    pub kind: ErrorType,
    pub message: String,
    /// The request field at fault.
    pub param: Option<String>,
    /// A stable, machine-readable code.
    pub code: &'static str,
}

impl ApiError {
    pub fn new(status: StatusCode, kind: ErrorType, code: &'static str, message: impl Into<String>) -> Self {
        ApiError { status, kind, message: message.into(), param: None, code }
    }

    /// Names the request field at fault.
    pub fn param(mut self, param: impl Into<String>) -> Self {
        self.param = Some(param.into());
        self
    }

    pub fn bad_request(code: &'static str, message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, ErrorType::InvalidRequestError, code, message)
    }

    pub fn unauthorized(message: impl Into<String>) -> Self {
        Self::new(StatusCode::UNAUTHORIZED, ErrorType::AuthenticationError, "invalid_token", message)
    }

    pub fn forbidden(code: &'static str, message: impl Into<String>) -> Self {
        Self::new(StatusCode::FORBIDDEN, ErrorType::PermissionError, code, message)
    }

    pub fn not_found(code: &'static str, message: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_FOUND, ErrorType::InvalidRequestError, code, message)
    }

    pub fn too_large(limit: usize) -> Self {
        Self::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            ErrorType::InvalidRequestError,
            "request_too_large",
            format!("The request body is over the limit of {limit} bytes."),
        )
    }

    /// 500 with a generic message; the cause is logged, not returned.
    pub fn internal(cause: &dyn std::fmt::Display) -> Self {
        tracing::error!(error = %cause, "internal error");
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, ErrorType::ServerError, "internal_error", "Internal error.")
    }

    /// The JSON body alone.
    pub fn body(&self) -> serde_json::Value {
        serde_json::json!({"error": {
            "message": self.message,
            "type": self.kind,
            "param": self.param,
            "code": self.code,
        }})
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
        (self.status, Json(self.body())).into_response()
    }
}

impl From<RegistryError> for ApiError {
    fn from(e: RegistryError) -> Self {
        match e {
            RegistryError::Invalid { field, code, message } => ApiError::bad_request(code, message).param(field),
            RegistryError::NotFound { code, message } => ApiError::not_found(code, message),
            RegistryError::Conflict(m) => {
                ApiError::new(StatusCode::CONFLICT, ErrorType::InvalidRequestError, "revision_exists", m)
            }
            RegistryError::Upstream(m) => {
                tracing::warn!(error = %m, "import source failed");
                ApiError::new(StatusCode::BAD_GATEWAY, ErrorType::ServerError, "source_failed", m)
            }
            RegistryError::Store(m) => {
                tracing::error!(error = %m, "object store");
                ApiError::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    ErrorType::ServerError,
                    "store_unavailable",
                    "The object store failed; try again shortly.",
                )
            }
            RegistryError::NoSpace(m) => {
                tracing::error!(error = %m, "object store full");
                ApiError::new(
                    StatusCode::INSUFFICIENT_STORAGE,
                    ErrorType::ServerError,
                    "insufficient_storage",
                    "The registry's object store is out of space.",
                )
            }
            RegistryError::Corrupt(m) => {
                tracing::error!(error = %m, "corrupt blob");
                ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, ErrorType::ServerError, "blob_corrupt", m)
            }
            RegistryError::Database(e) => {
                tracing::error!(error = %e, "catalog database");
                ApiError::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    ErrorType::ServerError,
                    "database_unavailable",
                    "The catalog database failed; try again shortly.",
                )
            }
            RegistryError::Internal(m) => ApiError::internal(&m),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn registry_errors_map_to_statuses_and_name_the_field() {
        let e: ApiError = RegistryError::invalid("source", "invalid_source", "unknown scheme").into();
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
        assert_eq!(e.body()["error"]["param"], "source");
        assert_eq!(e.body()["error"]["type"], "invalid_request_error");
        let e: ApiError = RegistryError::Conflict("exists".into()).into();
        assert_eq!(e.status, StatusCode::CONFLICT);
        let e: ApiError = RegistryError::Store("s3 said no at 10.0.0.1".into()).into();
        assert_eq!(e.status, StatusCode::SERVICE_UNAVAILABLE);
        assert!(!e.message.contains("10.0.0.1"), "store detail leaked: {}", e.message);
        let io = std::io::Error::from_raw_os_error(28);
        let e = RegistryError::store(
            "put",
            object_store::Error::Generic { store: "LocalFileSystem", source: Box::new(io) },
        );
        assert!(matches!(e, RegistryError::NoSpace(_)), "{e:?}");
        assert_eq!(ApiError::from(e).status, StatusCode::INSUFFICIENT_STORAGE);
    }
}

//! The agent's one error type, and the one place it becomes an HTTP answer.
//!
//! Every refusal of the control API is OpenAI-shaped:
//!
//! ```json
//! {"error": {"message": "...", "type": "invalid_request_error", "param": "revision", "code": "invalid_request_body"}}
//! ```
//!
//! Messages say what the operator can fix (which file, which directory,
//! which budget); the control API is an admin surface, so naming local paths
//! is fine here.

use std::path::{Path, PathBuf};

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;

/// What went wrong, with what an operator needs to fix it.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum AgentError {
    /// A request field is wrong.
    #[error("{message}")]
    BadRequest { param: Option<String>, code: &'static str, message: String },
    /// No or a wrong admin token.
    #[error("{0}")]
    Unauthorized(&'static str),
    /// The registry has no such model or revision.
    #[error("the registry has no model `{name}` at revision `{revision}`")]
    ModelNotFound { name: String, revision: String },
    /// The model is not loaded on this agent.
    #[error("model `{0}` is not loaded on this agent")]
    NotLoaded(String),
    /// The request contradicts what is loaded.
    #[error("{0}")]
    Conflict(String),
    /// The registry answered with an error or could not be reached.
    #[error("registry: {0}")]
    Registry(String),
    /// A download failed (network, status); what was fetched stays for a resume.
    #[error("downloading {file}: {message}")]
    Download { file: String, message: String },
    /// Downloaded bytes do not hash to the sha256 the registry lists; nothing was kept.
    #[error("{file}: sha256 mismatch (expected {expected}, got {actual}); the download was discarded and the model is not loaded")]
    Integrity { file: String, expected: String, actual: String },
    /// The filesystem is full; the partial file was removed.
    #[error("no space left on device in {dir} while writing {file} ({needed} bytes needed); the partial file was removed", dir = .dir.display())]
    NoSpace { dir: PathBuf, file: String, needed: u64 },
    /// A tier's byte budget cannot hold the file even after evicting everything not in use.
    #[error("the {tier} tier's budget of {budget} bytes cannot hold {file} ({needed} bytes): {pinned} bytes are held by loaded models")]
    OverBudget { tier: &'static str, file: String, needed: u64, budget: u64, pinned: u64 },
    /// No GPU or not enough memory is free for another engine.
    #[error("not enough free resources: {0}")]
    Resources(String),
    /// The engine did not become healthy, or exited.
    #[error("engine for `{model}`: {message}")]
    Engine { model: String, message: String },
    /// Local I/O failed.
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
}

impl AgentError {
    /// A 400 about one request field.
    pub fn invalid(param: impl Into<String>, message: impl Into<String>) -> Self {
        AgentError::BadRequest { param: Some(param.into()), code: "invalid_value", message: message.into() }
    }

    /// Wraps an I/O error, mapping ENOSPC/EDQUOT to [`AgentError::NoSpace`].
    pub fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        AgentError::Io { context: context.into(), source }
    }

    /// Whether an I/O error means the filesystem (or quota) is full.
    pub fn is_no_space(e: &std::io::Error) -> bool {
        matches!(e.raw_os_error(), Some(libc::ENOSPC) | Some(libc::EDQUOT))
    }

    /// [`AgentError::NoSpace`] for a write into `dir`.
    pub fn no_space(dir: &Path, file: &str, needed: u64) -> Self {
        AgentError::NoSpace { dir: dir.to_path_buf(), file: file.to_string(), needed }
    }

    pub fn status(&self) -> StatusCode {
        match self {
            AgentError::BadRequest { .. } => StatusCode::BAD_REQUEST,
            AgentError::Unauthorized(_) => StatusCode::UNAUTHORIZED,
            AgentError::ModelNotFound { .. } | AgentError::NotLoaded(_) => StatusCode::NOT_FOUND,
            AgentError::Conflict(_) => StatusCode::CONFLICT,
            AgentError::Registry(_) | AgentError::Download { .. } | AgentError::Integrity { .. } => {
                StatusCode::BAD_GATEWAY
            }
            AgentError::NoSpace { .. } | AgentError::OverBudget { .. } => StatusCode::INSUFFICIENT_STORAGE,
            AgentError::Engine { .. } | AgentError::Resources(_) => StatusCode::SERVICE_UNAVAILABLE,
            AgentError::Io { .. } => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// The stable, machine-readable code.
    pub fn code(&self) -> &'static str {
        match self {
            AgentError::BadRequest { code, .. } => code,
            AgentError::Unauthorized(_) => "invalid_admin_token",
            AgentError::ModelNotFound { .. } => "model_not_found",
            AgentError::NotLoaded(_) => "model_not_loaded",
            AgentError::Conflict(_) => "conflict",
            AgentError::Registry(_) => "registry_error",
            AgentError::Download { .. } => "download_failed",
            AgentError::Integrity { .. } => "checksum_mismatch",
            AgentError::NoSpace { .. } => "insufficient_storage",
            AgentError::OverBudget { .. } => "over_budget",
            AgentError::Engine { .. } => "engine_failed",
            AgentError::Resources(_) => "insufficient_resources",
            AgentError::Io { .. } => "io_error",
        }
    }

    fn kind(&self) -> &'static str {
        match self.status().as_u16() {
            401 => "authentication_error",
            400..=499 => "invalid_request_error",
            _ => "server_error",
        }
    }

    fn param(&self) -> Option<&str> {
        match self {
            AgentError::BadRequest { param, .. } => param.as_deref(),
            AgentError::ModelNotFound { .. } | AgentError::NotLoaded(_) => Some("name"),
            _ => None,
        }
    }

    /// The JSON body alone.
    pub fn body(&self) -> serde_json::Value {
        serde_json::json!({"error": {
            "message": self.to_string(),
            "type": self.kind(),
            "param": self.param(),
            "code": self.code(),
        }})
    }
}

impl IntoResponse for AgentError {
    fn into_response(self) -> Response {
        if self.status().is_server_error() {
            tracing::warn!(error = %self, "control API request failed");
        }
        (self.status(), Json(self.body())).into_response()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_space_is_507_and_names_the_directory() {
        let e = AgentError::no_space(Path::new("/var/cache/granary/blobs"), "model.gguf", 42);
        assert_eq!(e.status(), StatusCode::INSUFFICIENT_STORAGE);
        let b = e.body();
        assert_eq!(b["error"]["code"], "insufficient_storage");
        assert!(b["error"]["message"].as_str().unwrap().contains("/var/cache/granary/blobs"));
        assert!(AgentError::is_no_space(&std::io::Error::from_raw_os_error(libc::ENOSPC)));
        assert!(!AgentError::is_no_space(&std::io::Error::from_raw_os_error(libc::EIO)));
    }

    #[test]
    fn unknown_model_names_the_field() {
        let e = AgentError::ModelNotFound { name: "nope".into(), revision: "latest".into() };
        assert_eq!(e.status(), StatusCode::NOT_FOUND);
        assert_eq!(e.body()["error"]["param"], "name");
        assert_eq!(e.body()["error"]["type"], "invalid_request_error");
    }
}

//! Typed errors of the store; servers map them to protocol errors in one place each.

use crate::tier::TierKind;

#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum WarehouseError {
    #[error("invalid {field}: {reason}")]
    Invalid { field: &'static str, reason: String },
    #[error("value of {size} bytes exceeds the limit of {limit} bytes")]
    TooLarge { size: u64, limit: u64 },
    #[error("{tier} tier I/O error: {source}")]
    Io {
        tier: TierKind,
        #[source]
        source: std::io::Error,
    },
    #[error("remote tier error: {0}")]
    Remote(String),
    #[error("corrupt entry in {tier} tier: {reason}")]
    Corrupt { tier: TierKind, reason: String },
    #[error("configuration: {0}")]
    Config(String),
    /// No tier could take the value: refused, never acknowledged.
    #[error("no tier can hold a value of {size} bytes")]
    OutOfMemory { size: u64 },
    #[error("timed out after {after:?} waiting for {what}")]
    Timeout { what: &'static str, after: std::time::Duration },
}

impl WarehouseError {
    pub fn invalid(field: &'static str, reason: impl Into<String>) -> Self {
        WarehouseError::Invalid { field, reason: reason.into() }
    }

    pub fn io(tier: TierKind, source: std::io::Error) -> Self {
        WarehouseError::Io { tier, source }
    }
}

pub type Result<T, E = WarehouseError> = std::result::Result<T, E>;

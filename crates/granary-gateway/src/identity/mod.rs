//! TEMP STUB
use crate::{ApiError, KeyId, Principal, TenantId};
use serde::{Deserialize, Serialize};
#[derive(Clone)]
pub struct Identity;
#[derive(Clone, Debug, Default)]
pub struct IdentityOptions {
    pub key_cache: std::time::Duration,
    pub audit_queue: usize,
}
#[derive(Debug)]
pub enum AuthError {
    Unknown,
}
impl AuthError {
    pub fn to_api_error(&self) -> ApiError {
        todo!()
    }
}
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct AuditRecord {
    pub time_ms: i64,
    pub request_id: String,
    pub tenant_id: Option<TenantId>,
    pub tenant: Option<String>,
    pub key_id: Option<KeyId>,
    pub endpoint: String,
    pub model: Option<String>,
    pub upstream: Option<String>,
    pub status: u16,
    pub error_code: Option<String>,
    pub stream: bool,
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
    pub cached_tokens: u64,
    pub latency_ms: f64,
    pub ttft_ms: Option<f64>,
    pub prompt: Option<String>,
}
impl Identity {
    pub async fn open(_url: &str, _o: IdentityOptions) -> anyhow::Result<Self> {
        todo!()
    }
    pub fn backend(&self) -> &'static str {
        todo!()
    }
    pub async fn authenticate(&self, _b: &str) -> Result<Principal, AuthError> {
        todo!()
    }
    pub fn record(&self, _r: AuditRecord) {
        todo!()
    }
    pub async fn flush(&self) {
        todo!()
    }
    pub fn audit_dropped(&self) -> u64 {
        todo!()
    }
}
#[derive(Clone)]
pub struct AdminToken;
impl AdminToken {
    pub fn new(_s: &str) -> Self {
        AdminToken
    }
    pub fn verify(&self, _p: &str) -> bool {
        todo!()
    }
}
pub fn admin_router(_i: Identity, _t: AdminToken) -> axum::Router {
    todo!()
}
#[derive(clap::Subcommand, Debug)]
pub enum AdminCmd {
    X,
}
pub async fn run_admin(_c: AdminCmd, _i: &Identity) -> anyhow::Result<()> {
    todo!()
}

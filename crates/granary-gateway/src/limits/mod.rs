//! TEMP STUB
use crate::{ApiError, Principal};
#[derive(Clone, Copy, Debug)]
pub enum Scope {
    Key,
    Tenant,
}
impl Scope {
    pub fn as_str(self) -> &'static str {
        "key"
    }
}
#[derive(Debug)]
pub struct Rejection {
    pub scope: Scope,
    pub limit: &'static str,
    pub max: u64,
    pub used: u64,
    pub retry_after: std::time::Duration,
}
impl Rejection {
    pub fn to_api_error(&self) -> ApiError {
        todo!()
    }
}
#[derive(Clone)]
pub struct Limiter;
#[derive(Clone, Debug, Default, serde::Deserialize)]
pub struct RedisOptions {
    pub prefix: String,
    pub timeout_ms: u64,
}
impl Limiter {
    pub fn in_process() -> Self {
        Limiter
    }
    pub async fn redis(_u: &str, _o: RedisOptions) -> anyhow::Result<Self> {
        todo!()
    }
    pub fn backend(&self) -> &'static str {
        "memory"
    }
    pub async fn admit(&self, _w: &Principal, _e: u64) -> Result<(), Rejection> {
        todo!()
    }
    pub async fn charge(&self, _w: &Principal, _t: u64) {
        todo!()
    }
    pub fn backend_errors(&self) -> u64 {
        0
    }
}

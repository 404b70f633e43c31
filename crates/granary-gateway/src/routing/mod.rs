//! TEMP STUB
use granary_core::hash::BlockHash;
use std::sync::Arc;
#[derive(Clone, Debug)]
pub struct Candidate {
    pub index: usize,
    pub active: usize,
    pub max_active: usize,
    pub publishes_events: bool,
}
pub struct RouteRequest<'a> {
    pub namespace: &'a str,
    pub session: Option<&'a str>,
    pub blocks: &'a [BlockHash],
}
pub trait Policy: Send + Sync {
    fn name(&self) -> &'static str;
    fn rank(&self, req: &RouteRequest<'_>, candidates: &[Candidate]) -> Vec<usize>;
    fn routed(&self, req: &RouteRequest<'_>, upstream: usize) {
        let _ = (req, upstream);
    }
}
#[derive(Clone, Debug, PartialEq, serde::Deserialize, serde::Serialize, Default)]
#[serde(tag = "policy", rename_all = "snake_case", deny_unknown_fields)]
pub enum PolicyConfig {
    #[default]
    RoundRobin,
    LeastLoad,
    Session {
        header: String,
    },
    KvAware {
        load_penalty: f64,
        approx_capacity_blocks: usize,
    },
}
impl PolicyConfig {
    pub fn session_header(&self) -> Option<&str> {
        match self {
            PolicyConfig::Session { header } => Some(header),
            _ => None,
        }
    }
}
pub fn build_policy(_cfg: &PolicyConfig, _index: Arc<KvIndex>) -> Arc<dyn Policy> {
    todo!()
}
#[derive(Default)]
pub struct KvIndex;
#[derive(Clone, Debug, serde::Deserialize)]
pub struct KvEventMsg {
    pub kind: String,
    #[serde(default)]
    pub namespace: String,
    #[serde(default)]
    pub tier: String,
    #[serde(default)]
    pub hashes: Vec<String>,
}
impl KvIndex {
    pub fn new() -> Self {
        KvIndex
    }
    pub fn apply(&self, _u: usize, _e: &KvEventMsg) {}
    pub fn forget(&self, _u: usize) {}
    pub fn prefix_match(&self, _u: usize, _b: &[BlockHash]) -> usize {
        0
    }
    pub fn blocks(&self, _u: usize) -> usize {
        0
    }
}
pub struct Admission;
impl Admission {
    pub fn new() -> Self {
        Admission
    }
    pub async fn acquire<T>(
        &self,
        _p: crate::Priority,
        _t: std::time::Duration,
        _f: impl FnMut() -> Option<T>,
    ) -> Option<T> {
        todo!()
    }
    pub fn released(&self) {}
    pub fn waiting(&self, _p: crate::Priority) -> usize {
        0
    }
}
pub struct PoolSelector;
impl PoolSelector {
    pub fn new(_w: &[u32]) -> Self {
        PoolSelector
    }
    pub fn order(&self) -> Vec<usize> {
        vec![]
    }
}

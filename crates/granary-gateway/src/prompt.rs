//! A prompt's KV blocks as each upstream names them, for KV-aware routing.
//!
//! Granary engines name blocks with the tenant's namespace and their own KV
//! layout (`GET /v1/kv/config`), and serve their tokenizer (`GET
//! /v1/kv/tokenizer`). Third-party engines (vLLM, SGLang, llama.cpp's
//! server...) name nothing the gateway can read, so their blocks get the
//! gateway's own names ([`third_party_chain`]) over the tokens the model's
//! tokenizer (an upstream's `tokenizer` file) cuts the prompt into; vLLM's
//! KV events are mapped onto the same names ([`crate::routing::vllm`]).
//!
//! Tokenizing (a chat template and a BPE pass over a long prompt) takes
//! milliseconds of CPU: it runs on the blocking pool, never on the async
//! workers that relay streams.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use granary_core::hash::{BlockHash, HashChain};
use granary_tokenizer::{ChatMessage, Tokenizer};
use parking_lot::RwLock;
use serde_json::Value;

use crate::config::UpstreamConfig;
use crate::proxy::Endpoint;
use crate::routing::vllm::third_party_chain;
use crate::upstream::Upstream;

#[derive(Clone)]
enum Slot {
    Loading,
    Ready(Arc<Tokenizer>),
    Missing(Instant),
}

/// The tokenizers routing uses: fetched from Granary engines per model,
/// and read from the files upstreams name.
#[derive(Default)]
pub(crate) struct Tokenizers {
    fetched: RwLock<HashMap<String, Slot>>,
    files: HashMap<PathBuf, Arc<Tokenizer>>,
}

/// Reads a tokenizer file: a GGUF, a `tokenizer.json`, or a directory
/// holding one.
pub fn load_tokenizer(path: &Path) -> anyhow::Result<Tokenizer> {
    let tok = if path.is_dir() {
        Tokenizer::from_pretrained_dir(path)?
    } else if path.extension().is_some_and(|e| e.eq_ignore_ascii_case("gguf")) {
        Tokenizer::from_gguf_path(path)?
    } else {
        Tokenizer::from_file(path)?
    };
    Ok(tok)
}

impl Tokenizers {
    /// Reads every tokenizer the upstreams name, once per file. A file that
    /// cannot be read is an error naming the upstream: routing would
    /// otherwise silently lose its KV awareness.
    pub(crate) fn load(upstreams: &[UpstreamConfig]) -> anyhow::Result<Tokenizers> {
        let mut files = HashMap::new();
        for u in upstreams {
            let Some(path) = &u.tokenizer else { continue };
            if files.contains_key(path) {
                continue;
            }
            let tok = load_tokenizer(path)
                .map_err(|e| anyhow::anyhow!("upstream {}: tokenizer {}: {e}", u.name, path.display()))?;
            tracing::info!(upstream = %u.name, path = %path.display(), "tokenizer loaded for KV-aware routing");
            files.insert(path.clone(), Arc::new(tok));
        }
        Ok(Tokenizers { fetched: RwLock::new(HashMap::new()), files })
    }

    /// A configured file's tokenizer.
    pub(crate) fn file(&self, path: &Path) -> Option<Arc<Tokenizer>> {
        self.files.get(path).cloned()
    }

    /// The model's tokenizer, fetched once from a Granary engine that serves
    /// it (`GET /v1/kv/tokenizer`); `None` until it has arrived.
    pub(crate) fn fetched(self: &Arc<Self>, model: &str, from: &Arc<Upstream>) -> Option<Arc<Tokenizer>> {
        match self.fetched.read().get(model) {
            Some(Slot::Ready(t)) => return Some(t.clone()),
            Some(Slot::Loading) => return None,
            Some(Slot::Missing(at)) if at.elapsed() < Duration::from_secs(30) => return None,
            _ => {}
        }
        self.fetched.write().insert(model.to_string(), Slot::Loading);
        let me = self.clone();
        let (model, up) = (model.to_string(), from.clone());
        tokio::spawn(async move {
            let slot = match fetch_tokenizer(&up).await {
                Ok(t) => {
                    tracing::info!(model = %model, upstream = %up.name(), "tokenizer loaded for KV-aware routing");
                    Slot::Ready(Arc::new(t))
                }
                Err(e) => {
                    tracing::warn!(model = %model, upstream = %up.name(), error = %e, "no tokenizer: KV-aware routing falls back to load");
                    Slot::Missing(Instant::now())
                }
            };
            me.fetched.write().insert(model, slot);
        });
        None
    }
}

async fn fetch_tokenizer(up: &Upstream) -> anyhow::Result<Tokenizer> {
    let files: HashMap<String, String> =
        up.get("/v1/kv/tokenizer").timeout(Duration::from_secs(30)).send().await?.error_for_status()?.json().await?;
    let dir = tempfile::tempdir()?;
    for (name, text) in &files {
        if !matches!(name.as_str(), "tokenizer.json" | "tokenizer_config.json" | "generation_config.json") {
            continue;
        }
        std::fs::write(dir.path().join(name), text)?;
    }
    let path = dir.path().to_path_buf();
    let tok = tokio::task::spawn_blocking(move || Tokenizer::from_pretrained_dir(&path)).await??;
    Ok(tok)
}

/// The prompt as the tokenizer takes it, copied out of the request body so
/// that tokenizing can run elsewhere.
#[derive(Clone, Debug)]
pub(crate) enum PromptText {
    Chat(Vec<ChatMessage>),
    Text(String),
    Tokens(Vec<u32>),
}

impl PromptText {
    /// The prompt of a generation request (`None`: a shape routing does not
    /// hash, such as several prompts in one request).
    pub(crate) fn of(endpoint: Endpoint, body: &serde_json::Map<String, Value>) -> Option<PromptText> {
        match endpoint {
            Endpoint::Chat => {
                let msgs = body.get("messages")?.as_array()?;
                let mut out = Vec::with_capacity(msgs.len());
                for m in msgs {
                    let role = match m.get("role")?.as_str()? {
                        "system" | "developer" => "system",
                        r => r,
                    };
                    let content = match m.get("content") {
                        Some(Value::String(s)) => s.clone(),
                        Some(Value::Array(parts)) => {
                            parts.iter().filter_map(|p| p.get("text")?.as_str()).collect::<Vec<_>>().join("\n")
                        }
                        _ => String::new(),
                    };
                    out.push(ChatMessage::new(role, content));
                }
                Some(PromptText::Chat(out))
            }
            Endpoint::Completions => match body.get("prompt")? {
                Value::String(s) => Some(PromptText::Text(s.clone())),
                Value::Array(a) if !a.is_empty() && a.iter().all(Value::is_u64) => a
                    .iter()
                    .map(|x| x.as_u64().and_then(|v| u32::try_from(v).ok()))
                    .collect::<Option<Vec<u32>>>()
                    .map(PromptText::Tokens),
                Value::Array(a) if a.len() == 1 => Some(PromptText::Text(a[0].as_str()?.to_string())),
                _ => None,
            },
        }
    }

    /// The prompt's tokens as the engine will see them (chat template applied).
    pub(crate) fn tokens(&self, tok: &Tokenizer) -> Option<Vec<u32>> {
        match self {
            PromptText::Chat(msgs) => tok.encode_chat(msgs, true).ok(),
            PromptText::Text(s) => tok.encode(s, true).ok(),
            PromptText::Tokens(t) => Some(t.clone()),
        }
    }
}

/// Which blocks a routing target wants: the Granary engines' (shared by all
/// of them in a pool) or one third-party upstream's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Target {
    Granary,
    Upstream(usize),
}

/// Tokenize with `tokenizer`, then name the blocks with each chain.
pub(crate) struct Job {
    pub tokenizer: Arc<Tokenizer>,
    pub chains: Vec<(Target, HashChain)>,
}

/// The prompt's blocks: the Granary engines', and per third-party upstream.
#[derive(Default, Debug)]
pub(crate) struct PromptBlocks {
    /// The prompt's length in tokens, when some tokenizer cut it.
    pub prompt_tokens: Option<usize>,
    pub granary: Vec<BlockHash>,
    pub by_upstream: Vec<(usize, Arc<[BlockHash]>)>,
}

impl PromptBlocks {
    /// Tokenizes and hashes on the blocking pool (nothing to do: no task).
    pub(crate) async fn compute(prompt: PromptText, jobs: Vec<Job>) -> PromptBlocks {
        if jobs.is_empty() {
            return PromptBlocks::default();
        }
        tokio::task::spawn_blocking(move || Self::compute_now(&prompt, &jobs)).await.unwrap_or_default()
    }

    fn compute_now(prompt: &PromptText, jobs: &[Job]) -> PromptBlocks {
        let mut out = PromptBlocks::default();
        for job in jobs {
            let Some(tokens) = prompt.tokens(&job.tokenizer) else { continue };
            out.prompt_tokens.get_or_insert(tokens.len());
            // Upstreams sharing a chain share its hashes.
            let mut done: Vec<(BlockHash, usize, Arc<[BlockHash]>)> = Vec::new();
            for (target, chain) in &job.chains {
                let hashes = match done.iter().find(|(r, b, _)| *r == chain.root() && *b == chain.block_tokens()) {
                    Some((_, _, h)) => h.clone(),
                    None => {
                        let h: Arc<[BlockHash]> = chain.hashes(&tokens).into();
                        done.push((chain.root(), chain.block_tokens(), h.clone()));
                        h
                    }
                };
                match target {
                    Target::Granary => out.granary = hashes.to_vec(),
                    Target::Upstream(id) => out.by_upstream.push((*id, hashes)),
                }
            }
        }
        out
    }
}

/// The jobs for a request to `candidates` (kv-aware pools' members):
/// Granary engines through their fetched tokenizer and layout, third-party
/// upstreams with a tokenizer file through the third-party chain.
pub(crate) fn jobs_for(
    tokenizers: &Arc<Tokenizers>,
    model: &str,
    namespace: &str,
    candidates: &[Arc<Upstream>],
) -> Vec<Job> {
    let mut jobs: Vec<Job> = Vec::new();
    let mut add = |tok: Arc<Tokenizer>, target: Target, chain: HashChain| match jobs
        .iter_mut()
        .find(|j| Arc::ptr_eq(&j.tokenizer, &tok))
    {
        Some(j) => j.chains.push((target, chain)),
        None => jobs.push(Job { tokenizer: tok, chains: vec![(target, chain)] }),
    };
    if let Some(source) = candidates.iter().find(|u| u.kv_info().is_some() && u.is_granary()) {
        if let (Some(info), Some(tok)) = (source.kv_info(), tokenizers.fetched(model, source)) {
            add(tok, Target::Granary, info.chain(namespace));
        }
    }
    for u in candidates {
        if u.is_granary() {
            continue;
        }
        let Some(tok) = u.cfg.tokenizer.as_deref().and_then(|p| tokenizers.file(p)) else { continue };
        add(tok, Target::Upstream(u.id), third_party_chain(u.cfg.kv_block_tokens));
    }
    jobs
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prompts_are_copied_out_of_bodies_by_endpoint() {
        let body = |v: Value| v.as_object().unwrap().clone();
        let chat = body(serde_json::json!({"messages": [
            {"role": "developer", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
        ]}));
        let Some(PromptText::Chat(m)) = PromptText::of(Endpoint::Chat, &chat) else { panic!() };
        assert_eq!(m, vec![ChatMessage::new("system", "be brief"), ChatMessage::new("user", "a\nb")]);
        let ids = body(serde_json::json!({"prompt": [1, 2, 3]}));
        assert!(matches!(PromptText::of(Endpoint::Completions, &ids), Some(PromptText::Tokens(t)) if t == [1, 2, 3]));
        let many = body(serde_json::json!({"prompt": ["a", "b"]}));
        assert!(PromptText::of(Endpoint::Completions, &many).is_none(), "several prompts: not hashed");
        let big = body(serde_json::json!({"prompt": [1, 5_000_000_000u64]}));
        assert!(PromptText::of(Endpoint::Completions, &big).is_none(), "an id past u32 is no token");
    }
}

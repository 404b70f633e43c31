//! The files Hugging Face keeps beside `tokenizer.json`:
//! `tokenizer_config.json` (chat template, special tokens, BOS/EOS
//! insertion), `chat_template.jinja` / `chat_template.json` (newer layout)
//! and `generation_config.json` (the ids that end generation).

use std::path::Path;

use serde_json::Value as Json;

use crate::{Result, TokenizerError};

#[derive(Debug, Default)]
pub(crate) struct HfConfig {
    pub chat_template: Option<String>,
    pub bos_token: Option<String>,
    pub eos_token: Option<String>,
    pub unk_token: Option<String>,
    pub pad_token: Option<String>,
    pub add_bos_token: Option<bool>,
    pub add_eos_token: Option<bool>,
    /// `eos_token_id` of generation_config.json.
    pub generation_eos_ids: Vec<u32>,
    pub warnings: Vec<String>,
}

fn read_json(path: &Path) -> Result<Option<Json>> {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(TokenizerError::Load(format!("{}: {e}", path.display()))),
    };
    serde_json::from_str(&text).map(Some).map_err(|e| TokenizerError::Load(format!("{}: {e}", path.display())))
}

/// A special token as tokenizer_config.json writes it: a string, or an
/// AddedToken object with a `content`.
fn token_string(v: Option<&Json>) -> Option<String> {
    match v? {
        Json::String(s) => Some(s.clone()),
        Json::Object(o) => o.get("content").and_then(Json::as_str).map(str::to_owned),
        _ => None,
    }
}

/// `chat_template` is either one template or a list of named ones; the one
/// named "default" is the chat template (the first when none is).
fn chat_template(v: &Json, warnings: &mut Vec<String>) -> Option<String> {
    match v {
        Json::String(s) => Some(s.clone()),
        Json::Array(list) => {
            let named = |want: &str| {
                list.iter().find_map(|t| {
                    (t.get("name").and_then(Json::as_str) == Some(want))
                        .then(|| t.get("template").and_then(Json::as_str).map(str::to_owned))
                        .flatten()
                })
            };
            named("default").or_else(|| {
                let first = list.first().and_then(|t| t.get("template")).and_then(Json::as_str).map(str::to_owned);
                if first.is_some() {
                    warnings.push("tokenizer_config.json: no chat template named \"default\"; using the first".into());
                }
                first
            })
        }
        _ => None,
    }
}

fn ids(v: Option<&Json>) -> Vec<u32> {
    match v {
        Some(Json::Number(n)) => n.as_u64().and_then(|x| u32::try_from(x).ok()).into_iter().collect(),
        Some(Json::Array(a)) => a.iter().filter_map(|x| x.as_u64().and_then(|x| u32::try_from(x).ok())).collect(),
        _ => Vec::new(),
    }
}

pub(crate) fn read_config(dir: &Path) -> Result<HfConfig> {
    let mut cfg = HfConfig::default();
    if let Some(tc) = read_json(&dir.join("tokenizer_config.json"))? {
        if let Some(t) = tc.get("chat_template") {
            cfg.chat_template = chat_template(t, &mut cfg.warnings);
        }
        cfg.bos_token = token_string(tc.get("bos_token"));
        cfg.eos_token = token_string(tc.get("eos_token"));
        cfg.unk_token = token_string(tc.get("unk_token"));
        cfg.pad_token = token_string(tc.get("pad_token"));
        cfg.add_bos_token = tc.get("add_bos_token").and_then(Json::as_bool);
        cfg.add_eos_token = tc.get("add_eos_token").and_then(Json::as_bool);
    }
    if cfg.chat_template.is_none() {
        let jinja = dir.join("chat_template.jinja");
        match std::fs::read_to_string(&jinja) {
            Ok(t) => cfg.chat_template = Some(t),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(TokenizerError::Load(format!("{}: {e}", jinja.display()))),
        }
    }
    if cfg.chat_template.is_none() {
        if let Some(ct) = read_json(&dir.join("chat_template.json"))? {
            if let Some(t) = ct.get("chat_template") {
                cfg.chat_template = chat_template(t, &mut cfg.warnings);
            }
        }
    }
    if let Some(gc) = read_json(&dir.join("generation_config.json"))? {
        cfg.generation_eos_ids = ids(gc.get("eos_token_id"));
    }
    Ok(cfg)
}

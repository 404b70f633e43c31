#![allow(dead_code)]

use std::path::PathBuf;

/// The default model GGUF, or `None` (after saying why) when it is absent
/// and `GRANARY_REQUIRE_EXTERNAL` is not set.
pub fn default_model() -> Option<PathBuf> {
    let p = std::env::var_os("GRANARY_TEST_MODEL")
        .map(PathBuf::from)
        .unwrap_or_else(granary_engine::source::default_model_path);
    if p.exists() {
        return Some(p);
    }
    if std::env::var_os("GRANARY_REQUIRE_EXTERNAL").is_some_and(|v| v == "1") {
        panic!("default model missing at {} (GRANARY_REQUIRE_EXTERNAL=1)", p.display());
    }
    eprintln!("skipping: default model missing at {}", p.display());
    None
}

#[derive(serde::Deserialize)]
pub struct Fixture {
    pub generate: Vec<GenCase>,
}

#[derive(serde::Deserialize)]
pub struct GenCase {
    pub prompt: String,
    pub prompt_ids: Vec<u32>,
    pub greedy_ids: Vec<u32>,
    pub top_logits: Vec<(u32, f32)>,
}

pub fn fixture() -> Fixture {
    let p = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/llama_cpp_smollm2.json");
    serde_json::from_str(&std::fs::read_to_string(p).expect("fixture")).expect("fixture JSON")
}

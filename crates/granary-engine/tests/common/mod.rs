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

/// The devices the accelerator (tensor) path is checked on: the CPU always
/// (the same candle operations a GPU runs), and the first CUDA device when
/// this crate is built with `--features cuda` and one is visible. Where it
/// is not, a line says the CUDA run was skipped and why, unless
/// `GRANARY_TEST_CUDA=require` (set by `scripts/gpu-check.sh`), which turns
/// a missing GPU into a failure.
pub fn tensor_devices() -> Vec<(&'static str, candle_core::Device)> {
    let mut out = vec![("cpu", candle_core::Device::Cpu)];
    match cuda_device() {
        Ok(d) => out.push(("cuda:0", d)),
        Err(why) => {
            if std::env::var("GRANARY_TEST_CUDA").is_ok_and(|v| v == "require") {
                panic!("GRANARY_TEST_CUDA=require but {why}");
            }
            eprintln!("SKIPPED on cuda: {why}; the tensor path ran on the CPU only");
        }
    }
    out
}

/// The first CUDA device, or why there is none.
pub fn cuda_device() -> Result<candle_core::Device, String> {
    if !candle_core::utils::cuda_is_available() {
        return Err("this build has no CUDA support (build with `--features cuda`)".into());
    }
    // The error's first line: candle appends a backtrace under RUST_BACKTRACE.
    candle_core::Device::new_cuda(0).map_err(|e| format!("no CUDA device is visible ({})", first_line(&e)))
}

fn first_line(e: &dyn std::fmt::Display) -> String {
    e.to_string().lines().next().unwrap_or_default().to_string()
}

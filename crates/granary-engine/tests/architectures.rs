//! Every supported architecture and weight type against llama.cpp, with no
//! download: `scripts/reference/tiny_models.py` writes small random models
//! with llama.cpp's own GGUF writer (`gguf`), quantizes one of them with
//! llama.cpp's `llama_model_quantize` to every common type, runs them
//! through llama.cpp (`llama-cpp-python`) and records its logits; the same
//! weights are also written as Hugging Face directories. This test runs the
//! script, loads every file with the engine and compares.
//!
//! The prompt (72 tokens) is fed as a 40-token prefill chunk, then one token
//! per step, and the logits of positions 39..72 are compared: both paths,
//! and positions past the models' sliding windows (24 keys) and Gemma 3's
//! first global layer.
//!
//! The Python that runs the script is `$GRANARY_REFERENCE_PYTHON`, else the
//! repository's `.venv/bin/python` (which `scripts/test.sh` sets up).

use std::path::{Path, PathBuf};
use std::process::Command;

use granary_engine::model::{Chunk, LoadOptions, Model};

const PREFILL: usize = 40;

#[derive(serde::Deserialize)]
struct Reference {
    generator: String,
    prompt: Vec<u32>,
    models: std::collections::BTreeMap<String, RefModel>,
    tokenize: RefTokenize,
}

/// llama.cpp's tokenization of a text set with a SentencePiece vocabulary.
#[derive(serde::Deserialize)]
struct RefTokenize {
    file: String,
    cases: Vec<(String, Vec<u32>)>,
    with_bos: Vec<u32>,
}

/// The script's output, made once for the tests of this file, in one
/// folder under cargo's directory for test files (a temporary directory
/// held by a static would never be removed: 130 MB left per run).
fn reference() -> Option<&'static (Folder, Reference)> {
    static REF: std::sync::OnceLock<Option<(Folder, Reference)>> = std::sync::OnceLock::new();
    REF.get_or_init(|| {
        let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("architectures");
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let r = generate(&dir)?;
        Some((Folder(dir), r))
    })
    .as_ref()
}

/// The reference folder (what `tempfile::TempDir` would give: `path()`).
struct Folder(PathBuf);

impl Folder {
    fn path(&self) -> &Path {
        &self.0
    }
}

#[derive(serde::Deserialize)]
struct RefModel {
    arch: String,
    #[serde(default)]
    quant: Option<String>,
    #[serde(default)]
    hf: Option<String>,
    /// The same weights in other Hugging Face layouts (a multimodal
    /// checkpoint's, for Gemma 3).
    #[serde(default)]
    hf_more: Vec<String>,
    logits: Vec<Vec<f32>>,
    greedy: Vec<u32>,
}

fn python() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("GRANARY_REFERENCE_PYTHON").filter(|p| !p.is_empty()) {
        return Some(PathBuf::from(p));
    }
    let venv = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../.venv/bin/python");
    venv.is_file().then_some(venv)
}

/// Runs the reference script into `dir`; `None` (after saying why) when
/// its Python is missing and external tools are not required.
fn generate(dir: &Path) -> Option<Reference> {
    let required = std::env::var_os("GRANARY_REQUIRE_EXTERNAL").is_some_and(|v| v == "1");
    let skip = |why: String| {
        if required {
            panic!("{why} (GRANARY_REQUIRE_EXTERNAL=1)");
        }
        eprintln!("skipping: {why}");
    };
    let Some(py) = python() else {
        skip("no Python with llama-cpp-python and gguf (set GRANARY_REFERENCE_PYTHON or run scripts/test.sh)".into());
        return None;
    };
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/reference/tiny_models.py");
    let out = Command::new(&py).arg(&script).arg("--out").arg(dir).output().expect("running the reference script");
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        if err.contains("ModuleNotFoundError") {
            skip(format!("{} lacks a module: {}", py.display(), err.lines().last().unwrap_or("")));
            return None;
        }
        panic!("{} failed: {err}", script.display());
    }
    let text = std::fs::read_to_string(dir.join("reference.json")).expect("reference.json");
    Some(serde_json::from_str(&text).expect("reference JSON"))
}

/// The engine's logits at positions PREFILL-1 .. prompt end, and its greedy
/// continuation.
fn run(model: &Model, prompt: &[u32], steps: usize) -> (Vec<Vec<f32>>, Vec<u32>) {
    let row = |t: candle_core::Tensor| t.to_vec2::<f32>().unwrap().remove(0);
    let mut kv = model.new_kv(16);
    let mut rows = Vec::new();
    let l = model.forward(&mut [Chunk { tokens: &prompt[..PREFILL], kv: &mut kv, logits: true }]).unwrap();
    rows.push(row(l.unwrap()));
    for t in &prompt[PREFILL..] {
        let l = model.forward(&mut [Chunk { tokens: std::slice::from_ref(t), kv: &mut kv, logits: true }]).unwrap();
        rows.push(row(l.unwrap()));
    }
    let mut greedy = Vec::new();
    let mut last = rows.last().unwrap().clone();
    for _ in 0..steps {
        let tok = argmax(&last);
        greedy.push(tok);
        let l = model.forward(&mut [Chunk { tokens: &[tok], kv: &mut kv, logits: true }]).unwrap();
        last = row(l.unwrap());
    }
    (rows, greedy)
}

fn argmax(row: &[f32]) -> u32 {
    row.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1)).unwrap().0 as u32
}

/// Largest |a - b| over all rows, and the root mean square of `b`.
fn compare(a: &[Vec<f32>], b: &[Vec<f32>]) -> (f32, f32) {
    assert_eq!(a.len(), b.len());
    let mut worst = 0f32;
    let (mut sq, mut n) = (0f64, 0usize);
    for (ra, rb) in a.iter().zip(b) {
        assert_eq!(ra.len(), rb.len(), "vocabulary sizes differ");
        for (x, y) in ra.iter().zip(rb) {
            worst = worst.max((x - y).abs());
            sq += (*y as f64).powi(2);
            n += 1;
        }
    }
    (worst, (sq / n as f64).sqrt() as f32)
}

/// Tolerance on the largest logit difference, relative to the logits' RMS:
/// the engine multiplies by its own int8 / 4-bit tiles (and llama.cpp by
/// Q8-quantized activations), so the two agree closely but not bit for
/// bit; a wrong rotary style, window, norm or scale moves logits by far more.
fn tolerance(quant: Option<&str>) -> f32 {
    match quant {
        // The lowest-bit types amplify rounding differences of the activations.
        Some("Q2_K") | Some("Q3_K_M") => 0.25,
        // Measured 0.06-0.13 (F32 to Q6_K); a wrong rotary style measured 1.4.
        _ => 0.15,
    }
}

#[test]
fn every_architecture_and_weight_type_matches_llama_cpp() {
    let Some((dir, reference)) = reference() else { return };
    eprintln!("reference: {}", reference.generator);
    let prompt = &reference.prompt;
    let mut failures = Vec::new();
    for (file, r) in &reference.models {
        let model = Model::load(&dir.path().join(file), &LoadOptions::default())
            .unwrap_or_else(|e| panic!("loading {file}: {e:#}"));
        assert_eq!(model.config().architecture, r.arch);
        let (rows, greedy) = run(&model, prompt, r.greedy.len());
        let want = &r.logits[PREFILL - 1..];
        let (worst, rms) = compare(&rows, want);
        let rel = worst / rms.max(1e-3);
        let agree = greedy.iter().zip(&r.greedy).take_while(|(a, b)| a == b).count();
        let tol = tolerance(r.quant.as_deref());
        eprintln!(
            "{file:>18}: largest logit difference {worst:.4} (logit RMS {rms:.3}, relative {rel:.4}, tolerance {tol}); \
             greedy agrees on {agree} of {}",
            r.greedy.len()
        );
        if rel > tol {
            failures.push(format!("{file}: relative difference {rel:.4} > {tol}"));
        }
        // The first greedy token is compared when llama.cpp's choice leads
        // its runner-up by more than the difference seen.
        let last = want.last().unwrap();
        let mut sorted = last.clone();
        sorted.sort_by(|a, b| b.total_cmp(a));
        if sorted[0] - sorted[1] > 2.0 * worst && greedy[0] != r.greedy[0] {
            failures.push(format!("{file}: first greedy token {} vs llama.cpp's {}", greedy[0], r.greedy[0]));
        }
        for hf in r.hf.iter().chain(&r.hf_more) {
            let st = Model::load(&dir.path().join(hf), &LoadOptions::default())
                .unwrap_or_else(|e| panic!("loading {hf}: {e:#}"));
            let (st_rows, _) = run(&st, prompt, 0);
            let (w, _) = compare(&st_rows, &rows);
            let (w_ref, _) = compare(&st_rows, want);
            eprintln!(
                "{:>18}: largest logit difference {w:.4} from the GGUF, {:.4} relative to llama.cpp",
                format!("{hf}/"),
                w_ref / rms.max(1e-3)
            );
            if w_ref / rms.max(1e-3) > tol {
                failures.push(format!("{hf}: relative difference {:.4} from llama.cpp > {tol}", w_ref / rms));
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// The tensor path (an accelerator's, here on the CPU: the device KV pool,
/// batched attention, masks built on the device) against llama.cpp on
/// every architecture's dense GGUF: rotary styles, Q/K norms, sliding
/// windows, soft-capping and scaled embeddings all go through it.
#[test]
fn the_tensor_path_matches_llama_cpp_on_every_architecture() {
    let Some((dir, reference)) = reference() else { return };
    let mut seen = std::collections::BTreeSet::new();
    let mut failures = Vec::new();
    for (file, r) in &reference.models {
        if r.quant.is_some() || !seen.insert(r.arch.clone()) {
            continue;
        }
        let opts = LoadOptions { tensor_ops: true, quantized_decode: false, ..Default::default() };
        let model = Model::load(&dir.path().join(file), &opts).unwrap_or_else(|e| panic!("loading {file}: {e:#}"));
        let (rows, _) = run(&model, &reference.prompt, 0);
        let (worst, rms) = compare(&rows, &r.logits[PREFILL - 1..]);
        let rel = worst / rms.max(1e-3);
        // Dense weights on both sides: measured at most 0.0023; with the
        // sliding windows ignored, Gemma 2 measured 2.2.
        let tol = 0.02;
        eprintln!("{file:>18} (tensor path): largest logit difference {worst:.4}, relative {rel:.4}, tolerance {tol}");
        if rel > tol {
            failures.push(format!("{file}: relative difference {rel:.4} > {tol}"));
        }
    }
    assert!(seen.len() >= 6, "only {} architectures have a dense GGUF: {seen:?}", seen.len());
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Q4_0 and the K-quants keep their own bits: the engine holds
/// their matmul weights in about the bytes the file stores (4-bit tiles
/// with f32 scales: 24 bytes per 32 weights against Q4_0's 18; the other
/// K-quants exactly as stored), not in a second int8 copy (36 bytes per
/// 32 weights, twice Q4_0's).
#[test]
fn four_bit_and_k_quant_weights_are_held_as_stored() {
    let Some((dir, reference)) = reference() else { return };
    let mut checked = 0;
    for (file, r) in &reference.models {
        let Some(quant) = r.quant.as_deref() else { continue };
        // Q4_1 too on CPUs with AVX-512 VNNI (4-bit tiles); elsewhere it
        // has no fast kernel as stored and is converted (see linear.rs).
        if !(quant == "Q4_0" || quant.ends_with("_K") || quant.contains("_K_")) {
            continue;
        }
        let path = dir.path().join(file);
        let held = Model::load(&path, &LoadOptions::default()).unwrap().matmul_weight_bytes();
        let stored = Model::load(&path, &LoadOptions { native_quant: true, ..Default::default() })
            .unwrap()
            .matmul_weight_bytes();
        let ratio = held as f64 / stored as f64;
        eprintln!("{file:>18}: matmul weights held in {held} bytes, {stored} as stored ({ratio:.2}x)");
        assert!(ratio <= 1.34, "{file}: weights held in {ratio:.2}x the bytes the file stores them in");
        checked += 1;
    }
    assert!(checked >= 6, "only {checked} quantized models checked");
}

#[test]
fn sentencepiece_gguf_tokenizes_as_llama_cpp() {
    let Some((dir, reference)) = reference() else { return };
    let t = &reference.tokenize;
    let tok = granary_tokenizer::Tokenizer::from_gguf_path(&dir.path().join(&t.file)).expect("SentencePiece GGUF");
    let mut wrong = Vec::new();
    for (text, want) in &t.cases {
        let got = tok.encode(text, false).unwrap();
        if &got != want {
            wrong.push(format!("{text:?}: {got:?} vs llama.cpp's {want:?}"));
        }
        // Decoding gives the text back (byte fallback included).
        if !text.contains("<s>") {
            assert_eq!(&tok.decode(&got, false).unwrap(), text, "round trip of {text:?}");
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
    assert_eq!(tok.encode("Hello world", true).unwrap(), t.with_bos, "BOS is added as llama.cpp adds it");
    eprintln!("{} texts tokenized as llama.cpp does", t.cases.len());
}

/// Every architecture, GGUF and Hugging Face alike, comes back from a
/// converted-weight checkpoint bit for bit: int8 and 4-bit tiles (the
/// default), the stored quantized tensors kept apart (`native_quant`), and
/// dense weights (`tensor_ops`).
#[test]
fn every_architecture_round_trips_through_a_checkpoint() {
    use granary_engine::model::CheckpointUse;
    let Some((dir, reference)) = reference() else { return };
    let prompt = &reference.prompt;
    let ckdir = tempfile::tempdir().unwrap();
    let mut sources: Vec<String> = Vec::new();
    for (file, r) in &reference.models {
        sources.push(file.clone());
        sources.extend(r.hf.iter().chain(&r.hf_more).cloned());
    }
    let variants: [(&str, LoadOptions); 3] = [
        ("default", LoadOptions::default()),
        ("native_quant", LoadOptions { native_quant: true, ..Default::default() }),
        ("tensor_ops", LoadOptions { tensor_ops: true, ..Default::default() }),
    ];
    let mut checked = 0;
    for (i, src) in sources.iter().enumerate() {
        for (v, base) in &variants {
            if *v != "default" && !src.ends_with(".gguf") {
                continue;
            }
            let path = dir.path().join(src);
            let ck = ckdir.path().join(format!("{i}-{v}.ckpt"));
            let opts = LoadOptions { checkpoint: Some(ck.clone()), ..base.clone() };
            let (converted, stats) = Model::load_timed(&path, &opts).unwrap();
            assert_eq!(stats.checkpoint, CheckpointUse::Missing, "{src} {v}");
            let bytes = converted.save_checkpoint(&ck).unwrap();
            assert_eq!(bytes, std::fs::metadata(&ck).unwrap().len());
            let (loaded, stats) = Model::load_timed(&path, &opts).unwrap();
            assert_eq!(stats.checkpoint, CheckpointUse::Loaded, "{src} {v}");
            assert_eq!(stats.read.loader, "checkpoint");
            assert_eq!(loaded.fingerprint(), converted.fingerprint(), "{src} {v}");
            assert_eq!(loaded.config(), converted.config(), "{src} {v}");
            let (a, ga) = run(&converted, prompt, 8);
            let (b, gb) = run(&loaded, prompt, 8);
            assert!(a == b, "{src} {v}: logits differ after the checkpoint");
            assert_eq!(ga, gb, "{src} {v}");
            checked += 1;
        }
    }
    eprintln!("{checked} models round-tripped through checkpoints bit for bit");
    assert!(checked >= 20, "only {checked} models checked");
}

//! `granary bench load`: how fast weights get from a file into the engine's
//! tensors, next to the raw sequential read bandwidth of the same disk and
//! to the naive path, measured in the same run.
//!
//! Files, all in one directory (`--dir`, so on one disk): the default
//! model's GGUF (copied there), and a Llama-shaped safetensors checkpoint
//! of random bf16/f16 bytes written for the run (`--synthetic`, 2 GiB by
//! default); `--path` adds files or Hugging Face directories measured where
//! they are. For each file and run, every pass starts with the file's
//! pages dropped from the page cache (`posix_fadvise(DONTNEED)` after an
//! fsync; the share still cached is printed):
//!
//! - **raw**: `fio --rw=read --bs=16M --ioengine=psync --invalidate=1` over
//!   the file (one sequential stream; buffered, as the loaders read), or a
//!   plain sequential read with a 16 MiB buffer where fio is missing;
//! - **naive**: the whole file into one buffer, then parsed by the library
//!   calls the engine used before (`load::naive_gguf`/`naive_safetensors`);
//! - **parallel**: the engine's loader (`load::read_gguf`/`read_safetensors`):
//!   parallel positioned reads straight into the tensors' buffers;
//! - **parallel + fingerprint**: the same, also hashing the file (blake3,
//!   overlapped with the reads), as `Model::load` runs it;
//! - for real models (the GGUF, `--path` entries with a config): a whole
//!   `Model::load_timed`, split into the read and the conversion that
//!   follows (dequantizing, fusing, int8 tiles), which is not weight loading;
//!   the same through the naive reader (the naive read-and-convert path);
//!   and from a converted-weight checkpoint written once before the runs
//!   (`model::checkpoint`: header, parallel read with its checksum, no
//!   conversion), next to the raw anchor over the checkpoint's own bytes.
//!
//! Figures are medians over `--runs`; GB/s is the file's bytes over the
//! time (10^9 bytes). Goals: parallel at least 0.8x raw and 3x naive; a
//! checkpoint load within 1.2x the raw read of its bytes and at least 5x
//! faster than the naive read-and-convert path.

use std::fs::File;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Instant, SystemTime};

use crate::bench::plot::{bar_key, legend};
use anyhow::{bail, ensure, Context, Result};
use clap::{Args as ClapArgs, ValueEnum};
use granary_core::ByteSize;
use granary_engine::model::load::{self, ReadOptions};
use granary_engine::model::{CheckpointUse, LoadOptions, Loader, Model};
use granary_engine::source::ModelSource;
use plotters::prelude::*;
use rand::rngs::StdRng;
use rand::{RngCore, SeedableRng};
use serde::Serialize;

use super::llm::median;
use super::warehouse::disk::{drop_from_page_cache, fio_version, parse_fio, resident_share};
use super::warehouse::report::{bar, byte_bar, command_line, utc_timestamp, Goal, Host, Table};

const RAW_GOAL: f64 = 0.8;
const NAIVE_GOAL: f64 = 3.0;
/// A checkpoint load at most this many times the raw read of its bytes.
const CHECKPOINT_RAW_GOAL: f64 = 1.2;
/// A checkpoint load at least this many times faster than naive read-and-convert.
const CHECKPOINT_NAIVE_GOAL: f64 = 5.0;
/// fio's block size and the fallback's buffer: the loader's largest read.
const RAW_BLOCK: usize = 16 << 20;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum SynthDtype {
    Bf16,
    F16,
}

#[derive(ClapArgs, Debug)]
pub struct Args {
    /// The real model measured (copied into --dir): `default`, a GGUF file or
    /// a Hugging Face directory.
    #[arg(long, default_value = "default")]
    model: String,
    /// Size of the synthetic Llama-shaped safetensors checkpoint (0: none).
    #[arg(long, default_value = "2GiB")]
    synthetic: ByteSize,
    /// Element type of the synthetic checkpoint.
    #[arg(long, value_enum, default_value = "bf16")]
    dtype: SynthDtype,
    /// More weights to measure where they are: a .gguf or .safetensors
    /// file, or a directory with config.json and *.safetensors (repeatable).
    #[arg(long = "path")]
    paths: Vec<PathBuf>,
    /// Where the model copy and the synthetic checkpoint are written
    /// [default: OUT/files]; removed afterwards unless --keep.
    #[arg(long)]
    dir: Option<PathBuf>,
    /// Directory for the chart.
    #[arg(long, default_value = "bench-out/load")]
    out: PathBuf,
    /// Also write every figure as JSON to this file.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Runs per file; tables show the median [default: 3, 1 with --quick].
    #[arg(long)]
    runs: Option<usize>,
    /// Reader threads of the parallel loader [default: the loader's, 8 or $GRANARY_LOAD_THREADS].
    #[arg(long)]
    threads: Option<usize>,
    /// Largest single read of the parallel loader.
    #[arg(long, default_value = "16MiB")]
    chunk: ByteSize,
    /// Keep the files written to --dir.
    #[arg(long)]
    keep: bool,
    /// A smoke run: a 48 MiB synthetic checkpoint, one run; figures not representative.
    #[arg(long)]
    quick: bool,
    /// Seed of the synthetic checkpoint's bytes.
    #[arg(long, default_value_t = 42)]
    seed: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
enum Format {
    Gguf,
    Safetensors,
}

/// One set of weights measured.
#[derive(Debug, Clone, Serialize)]
struct Case {
    label: String,
    format: Format,
    files: Vec<PathBuf>,
    bytes: u64,
    /// A model `Model::load` can build (GGUF or a directory with config.json).
    model_path: Option<PathBuf>,
    tensors: usize,
    /// The model's converted-weight checkpoint, written before the runs.
    checkpoint: Option<PathBuf>,
}

/// One pass: seconds and the share of the files cached when it started.
#[derive(Debug, Clone, Copy, Serialize)]
struct Pass {
    secs: f64,
    cached: f64,
}

#[derive(Debug, Clone, Serialize)]
struct EngineLoad {
    read_ms: f64,
    convert_ms: f64,
    cached: f64,
}

#[derive(Debug, Clone, Default, Serialize)]
struct Runs {
    raw: Vec<Pass>,
    naive: Vec<Pass>,
    parallel: Vec<Pass>,
    parallel_fingerprint: Vec<Pass>,
    engine: Vec<EngineLoad>,
    /// `Model::load_timed` through the naive reader: read, then convert.
    naive_engine: Vec<EngineLoad>,
    /// The raw anchor over the checkpoint file.
    checkpoint_raw: Vec<Pass>,
    /// `Model::load_timed` from the checkpoint (read_ms: header and read,
    /// convert_ms: putting the buffers together).
    checkpoint: Vec<EngineLoad>,
}

#[derive(Debug, Clone, Serialize)]
struct Medians {
    raw_gbps: f64,
    naive_gbps: f64,
    parallel_gbps: f64,
    parallel_fingerprint_gbps: f64,
    vs_raw: f64,
    vs_naive: f64,
    /// Largest share of the files found cached at the start of a pass.
    max_cached: f64,
    engine_read_ms: Option<f64>,
    engine_convert_ms: Option<f64>,
    naive_engine_ms: Option<f64>,
    checkpoint_bytes: Option<u64>,
    checkpoint_raw_ms: Option<f64>,
    checkpoint_ms: Option<f64>,
}

#[derive(Debug, Clone, Serialize)]
struct CaseResult {
    case: Case,
    runs: Runs,
    median: Medians,
}

#[derive(Serialize)]
struct Report {
    run_with: String,
    date: String,
    host: Host,
    release_build: bool,
    quick: bool,
    dir: PathBuf,
    /// `fio-3.x` or the fallback.
    raw_anchor: String,
    threads: usize,
    chunk_bytes: u64,
    runs: usize,
    cases: Vec<CaseResult>,
    goals: Vec<Goal>,
}

pub async fn run(args: Args) -> Result<()> {
    tokio::task::block_in_place(|| run_blocking(args))
}

fn run_blocking(args: Args) -> Result<()> {
    let runs = args.runs.unwrap_or(if args.quick { 1 } else { 3 }).max(1);
    let synthetic = if args.quick { args.synthetic.as_u64().min(48 << 20) } else { args.synthetic.as_u64() };
    let defaults = ReadOptions::default();
    let read = ReadOptions {
        threads: args.threads.unwrap_or(defaults.threads).max(1),
        chunk_bytes: (args.chunk.as_u64() as usize).max(1 << 20),
        fingerprint: false,
    };
    let host = Host::probe();
    let date = utc_timestamp(SystemTime::now());
    let run_with = command_line();
    let release = !cfg!(debug_assertions);
    println!("Run with: {run_with}");
    println!("Date:     {date}");
    println!("Host:     {}", host.describe());
    println!(
        "Build:    {}; {runs} run(s) per file; parallel loader: {} threads, reads up to {}{}",
        if release { "release" } else { "debug (figures not representative)" },
        read.threads,
        ByteSize(read.chunk_bytes as u64),
        if args.quick { "; --quick (smoke-test sizes, figures not representative)" } else { "" }
    );

    let dir = args.dir.clone().unwrap_or_else(|| args.out.join("files"));
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let dir = dir.canonicalize()?;
    let scratch = tempfile::Builder::new().prefix("granary-bench-load-").tempdir_in(&dir)?;
    let fio = fio_version();
    let raw_anchor = match &fio {
        Some(v) => format!("{v} --rw=read --bs=16M --ioengine=psync --invalidate=1"),
        None => {
            eprintln!("load: fio not found on PATH; the raw anchor is a plain sequential read with a 16 MiB buffer");
            "sequential read, 16 MiB buffer (fio missing)".to_string()
        }
    };
    println!("Files:    {} (raw anchor: {raw_anchor})", scratch.path().display());
    println!();

    let mut cases = Vec::new();
    cases.push(copy_model(&args.model, scratch.path())?);
    if synthetic > 0 {
        cases.push(write_synthetic(&scratch.path().join("synthetic"), synthetic, args.dtype, args.seed)?);
    }
    for p in &args.paths {
        cases.push(external(p)?);
    }

    for case in cases.iter_mut() {
        if let Some(path) = case.model_path.clone() {
            case.checkpoint = Some(write_checkpoint(&path, scratch.path(), &read)?);
        }
    }
    let passes = cases.iter().map(|c| if c.model_path.is_some() { 8 } else { 4 }).sum::<usize>() * runs;
    let pb = bar(passes as u64, "load");
    let mut results = Vec::new();
    for case in cases {
        let mut r = Runs::default();
        for i in 0..runs {
            pb.set_message(format!("{} run {}/{runs}", case.label, i + 1));
            r.raw.push(raw_pass(&case, fio.is_some())?);
            pb.inc(1);
            r.naive.push(timed(&case, || naive(&case))?);
            pb.inc(1);
            r.parallel.push(timed(&case, || parallel(&case, &read))?);
            pb.inc(1);
            let with_fp = ReadOptions { fingerprint: true, ..read.clone() };
            r.parallel_fingerprint.push(timed(&case, || parallel(&case, &with_fp))?);
            pb.inc(1);
            if let Some(path) = &case.model_path {
                r.engine.push(engine_load(&case, path, Loader::Parallel(read.clone()), None)?);
                pb.inc(1);
                r.naive_engine.push(engine_load(&case, path, Loader::Naive, None)?);
                pb.inc(1);
            }
            if let (Some(path), Some(ck)) = (&case.model_path, &case.checkpoint) {
                let ck_case = Case { files: vec![ck.clone()], ..case.clone() };
                r.checkpoint_raw.push(raw_pass(&ck_case, fio.is_some())?);
                pb.inc(1);
                drop_all(&ck_case)?;
                r.checkpoint.push(engine_load(&case, path, Loader::Parallel(read.clone()), Some(ck))?);
                pb.inc(1);
            }
            let last = |v: &[Pass]| v.last().map_or(0.0, |p| case.bytes as f64 / p.secs / 1e9);
            pb.suspend(|| {
                eprintln!(
                    "load: {} run {}/{runs}: raw {:.2} GB/s, naive {:.2}, parallel {:.2}, with fingerprint {:.2}",
                    case.label,
                    i + 1,
                    last(&r.raw),
                    last(&r.naive),
                    last(&r.parallel),
                    last(&r.parallel_fingerprint)
                )
            });
        }
        let median = medians(&case, &r);
        results.push(CaseResult { case, runs: r, median });
    }
    pb.finish_and_clear();

    let goals = goals(&results);
    let report = Report {
        run_with,
        date,
        host,
        release_build: release,
        quick: args.quick,
        dir: scratch.path().to_path_buf(),
        raw_anchor,
        threads: read.threads,
        chunk_bytes: read.chunk_bytes as u64,
        runs,
        cases: results,
        goals,
    };
    for t in tables(&report) {
        println!("{}", t.render());
    }
    std::fs::create_dir_all(&args.out).with_context(|| format!("creating {}", args.out.display()))?;
    let svg = args.out.join("load.svg");
    let png = args.out.join("load.png");
    draw(&report, SVGBackend::new(&svg, (900, 520)).into_drawing_area())
        .with_context(|| format!("drawing {}", svg.display()))?;
    draw(&report, BitMapBackend::new(&png, (900, 520)).into_drawing_area())
        .with_context(|| format!("drawing {}", png.display()))?;
    println!("Chart: {} and {}", svg.display(), png.display());
    if let Some(path) = &args.json {
        std::fs::write(path, serde_json::to_string_pretty(&report)? + "\n")
            .with_context(|| format!("writing {}", path.display()))?;
        println!("JSON: {}", path.display());
    }
    println!("\nGoals");
    for g in &report.goals {
        println!("{}", g.render());
    }
    if args.keep {
        let kept = scratch.keep();
        println!("\nKept the files in {}", kept.display());
    }
    Ok(())
}

/// The `--model` weights, copied into `dir` so every file is on one disk.
fn copy_model(model: &str, dir: &Path) -> Result<Case> {
    let resolved = model.parse::<ModelSource>()?.resolve()?;
    let src = &resolved.path;
    if src.is_dir() {
        let dst = dir.join("model");
        std::fs::create_dir_all(&dst)?;
        for e in std::fs::read_dir(src)? {
            let p = e?.path();
            let name = p.file_name().unwrap_or_default().to_string_lossy().into_owned();
            if name.ends_with(".safetensors") || name == "config.json" {
                copy_file(&p, &dst.join(&name))?;
            }
        }
        let mut c = external(&dst)?;
        c.label = format!("{} (copy)", resolved.id);
        return Ok(c);
    }
    let name = src.file_name().context("the model path has no file name")?;
    let dst = dir.join(name);
    copy_file(src, &dst)?;
    let mut c = external(&dst)?;
    c.label = format!("{} GGUF", resolved.id);
    Ok(c)
}

fn copy_file(src: &Path, dst: &Path) -> Result<()> {
    let len = std::fs::metadata(src)?.len();
    let pb = byte_bar(len, "copy");
    let mut from = File::open(src).with_context(|| format!("open {}", src.display()))?;
    let mut to = File::create(dst).with_context(|| format!("create {}", dst.display()))?;
    let mut buf = vec![0u8; 8 << 20];
    loop {
        let n = from.read(&mut buf)?;
        if n == 0 {
            break;
        }
        to.write_all(&buf[..n])?;
        pb.inc(n as u64);
    }
    to.sync_all()?;
    pb.finish_and_clear();
    Ok(())
}

/// A `--path` entry, measured where it is.
fn external(p: &Path) -> Result<Case> {
    ensure!(p.exists(), "--path {}: no such file or directory", p.display());
    let label = p.file_name().map_or_else(|| p.display().to_string(), |n| n.to_string_lossy().into_owned());
    let (format, files, model_path) = if p.is_dir() {
        let mut files: Vec<PathBuf> = std::fs::read_dir(p)?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|f| f.extension().is_some_and(|e| e == "safetensors"))
            .collect();
        files.sort();
        ensure!(!files.is_empty(), "{}: no .safetensors files", p.display());
        let model = p.join("config.json").is_file().then(|| p.to_path_buf());
        (Format::Safetensors, files, model)
    } else if p.extension().is_some_and(|e| e == "gguf") {
        (Format::Gguf, vec![p.to_path_buf()], Some(p.to_path_buf()))
    } else if p.extension().is_some_and(|e| e == "safetensors") {
        (Format::Safetensors, vec![p.to_path_buf()], None)
    } else {
        bail!("{}: expected a .gguf or .safetensors file, or a directory of safetensors", p.display());
    };
    let bytes = files.iter().map(|f| std::fs::metadata(f).map(|m| m.len())).sum::<std::io::Result<u64>>()?;
    Ok(Case { label, format, files, bytes, model_path, tensors: 0, checkpoint: None })
}

/// Shapes of a Llama-like model (grouped-query attention, 4 query heads
/// per KV head, SwiGLU MLP) whose weights come close to `bytes`.
fn synthetic_tensors(bytes: u64, elem: u64) -> Vec<(String, Vec<usize>)> {
    let vocab = 32_000usize;
    // The widest hidden size whose embedding and head take at most an
    // eighth (2 GiB: hidden 2048, 20 layers, about TinyLlama's shape).
    let hidden = [4096usize, 2048, 1024, 512, 256]
        .into_iter()
        .find(|h| (2 * vocab * h) as u64 * elem * 8 <= bytes)
        .unwrap_or(128);
    let inter = (hidden * 8 / 3).next_multiple_of(256);
    let kv = hidden / 4;
    let per_layer = (2 * hidden * hidden + 2 * kv * hidden + 3 * hidden * inter + 2 * hidden) as u64 * elem;
    let fixed = (2 * vocab * hidden + hidden) as u64 * elem;
    let layers = (bytes.saturating_sub(fixed) / per_layer).max(1) as usize;
    let mut t = vec![("model.embed_tokens.weight".to_string(), vec![vocab, hidden])];
    for i in 0..layers {
        let l = |n: &str| format!("model.layers.{i}.{n}");
        t.push((l("input_layernorm.weight"), vec![hidden]));
        t.push((l("self_attn.q_proj.weight"), vec![hidden, hidden]));
        t.push((l("self_attn.k_proj.weight"), vec![kv, hidden]));
        t.push((l("self_attn.v_proj.weight"), vec![kv, hidden]));
        t.push((l("self_attn.o_proj.weight"), vec![hidden, hidden]));
        t.push((l("post_attention_layernorm.weight"), vec![hidden]));
        t.push((l("mlp.gate_proj.weight"), vec![inter, hidden]));
        t.push((l("mlp.up_proj.weight"), vec![inter, hidden]));
        t.push((l("mlp.down_proj.weight"), vec![hidden, inter]));
    }
    t.push(("model.norm.weight".to_string(), vec![hidden]));
    t.push(("lm_head.weight".to_string(), vec![vocab, hidden]));
    t
}

/// Writes a safetensors file of Llama-shaped tensors filled with random
/// bytes (load speed does not depend on the values), then fsyncs it.
fn write_synthetic(dir: &Path, bytes: u64, dtype: SynthDtype, seed: u64) -> Result<Case> {
    std::fs::create_dir_all(dir)?;
    let (name, elem) = match dtype {
        SynthDtype::Bf16 => ("BF16", 2u64),
        SynthDtype::F16 => ("F16", 2u64),
    };
    let tensors = synthetic_tensors(bytes, elem);
    let mut header = serde_json::Map::new();
    let mut at = 0u64;
    for (n, shape) in &tensors {
        let len = shape.iter().product::<usize>() as u64 * elem;
        header.insert(n.clone(), serde_json::json!({"dtype": name, "shape": shape, "data_offsets": [at, at + len]}));
        at += len;
    }
    let mut h = serde_json::to_vec(&serde_json::Value::Object(header))?;
    // The format pads the header with spaces to a multiple of 8 bytes.
    while h.len() % 8 != 0 {
        h.push(b' ');
    }
    let path = dir.join("model.safetensors");
    let mut f = std::io::BufWriter::with_capacity(8 << 20, File::create(&path)?);
    f.write_all(&(h.len() as u64).to_le_bytes())?;
    f.write_all(&h)?;
    let pb = byte_bar(at, "write");
    let mut rng = StdRng::seed_from_u64(seed ^ 0x10ad);
    let mut buf = vec![0u8; 8 << 20];
    let mut left = at;
    while left > 0 {
        let n = left.min(buf.len() as u64) as usize;
        rng.fill_bytes(&mut buf[..n]);
        f.write_all(&buf[..n])?;
        left -= n as u64;
        pb.inc(n as u64);
    }
    let f = f.into_inner().map_err(|e| e.into_error())?;
    f.sync_all()?;
    pb.finish_and_clear();
    let bytes = std::fs::metadata(&path)?.len();
    let layers = tensors.iter().filter(|(n, _)| n.ends_with("q_proj.weight")).count();
    let hidden = tensors[0].1[1];
    Ok(Case {
        label: format!("synthetic {}-layer, hidden {hidden}, {}", layers, name.to_lowercase()),
        format: Format::Safetensors,
        files: vec![path],
        bytes,
        model_path: None,
        tensors: tensors.len(),
        checkpoint: None,
    })
}

fn drop_all(case: &Case) -> Result<f64> {
    for f in &case.files {
        drop_from_page_cache(f)?;
    }
    Ok(resident_share(&case.files))
}

/// Drops the page cache, then times `f`.
fn timed(case: &Case, f: impl FnOnce() -> Result<usize>) -> Result<Pass> {
    let cached = drop_all(case)?;
    let t = Instant::now();
    let tensors = f()?;
    let secs = t.elapsed().as_secs_f64();
    ensure!(tensors > 0, "{}: no tensors loaded", case.label);
    Ok(Pass { secs, cached })
}

fn naive(case: &Case) -> Result<usize> {
    let dev = candle_core::Device::Cpu;
    Ok(match case.format {
        Format::Gguf => load::naive_gguf(&case.files[0], &dev, false)?.tensors.len(),
        Format::Safetensors => load::naive_safetensors(&case.files, b"", &dev, false)?.tensors.len(),
    })
}

fn parallel(case: &Case, opts: &ReadOptions) -> Result<usize> {
    let dev = candle_core::Device::Cpu;
    Ok(match case.format {
        Format::Gguf => load::read_gguf(&case.files[0], &dev, opts)?.tensors.len(),
        Format::Safetensors => load::read_safetensors(&case.files, b"", &dev, opts)?.tensors.len(),
    })
}

/// A whole `Model::load_timed`, page cache dropped first (the checkpoint's
/// too, when one is given: then the load must come from it).
fn engine_load(case: &Case, path: &Path, loader: Loader, checkpoint: Option<&Path>) -> Result<EngineLoad> {
    let mut cached = drop_all(case)?;
    if let Some(ck) = checkpoint {
        drop_from_page_cache(ck)?;
        cached = cached.max(resident_share(&[ck.to_path_buf()]));
    }
    let opts = LoadOptions { loader, checkpoint: checkpoint.map(Path::to_path_buf), ..Default::default() };
    let (model, stats) = Model::load_timed(path, &opts).with_context(|| format!("loading {}", path.display()))?;
    drop(model);
    if checkpoint.is_some() {
        ensure!(stats.checkpoint == CheckpointUse::Loaded, "{}: checkpoint {}", case.label, stats.checkpoint);
    }
    Ok(EngineLoad {
        read_ms: stats.read.total().as_secs_f64() * 1e3,
        convert_ms: stats.convert.as_secs_f64() * 1e3,
        cached,
    })
}

/// Converts the model once and writes its checkpoint into `dir`.
fn write_checkpoint(path: &Path, dir: &Path, read: &ReadOptions) -> Result<PathBuf> {
    let ck = dir.join(format!(
        "{}.ckpt",
        path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| "model".into())
    ));
    let opts = LoadOptions { loader: Loader::Parallel(read.clone()), ..Default::default() };
    let (model, _) = Model::load_timed(path, &opts).with_context(|| format!("loading {}", path.display()))?;
    let bytes = model.save_checkpoint(&ck).with_context(|| format!("writing {}", ck.display()))?;
    eprintln!("load: wrote the checkpoint {} ({})", ck.display(), size(bytes));
    Ok(ck)
}

/// The raw anchor over every file of the case: one pass, bytes over time.
fn raw_pass(case: &Case, fio: bool) -> Result<Pass> {
    let cached = drop_all(case)?;
    let mut secs = 0.0;
    for f in &case.files {
        let len = std::fs::metadata(f)?.len();
        secs += if fio { len as f64 / fio_read(f, len)? } else { plain_read(f)? };
    }
    Ok(Pass { secs, cached })
}

/// `fio` sequential read of `file` (its own invalidation, too); bytes/s.
fn fio_read(file: &Path, len: u64) -> Result<f64> {
    let out = Command::new("fio")
        .arg("--name=raw")
        .arg(format!("--filename={}", file.display()))
        .args(["--readonly", "--rw=read", "--ioengine=psync", "--invalidate=1", "--output-format=json"])
        .arg(format!("--bs={RAW_BLOCK}"))
        .arg(format!("--size={len}"))
        .output()
        .context("running fio")?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        bail!(
            "fio --rw=read on {} failed: {}{}",
            file.display(),
            stdout.trim(),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    parse_fio(&stdout, "read")
}

/// The fallback anchor: the file read front to back with one buffer; seconds.
fn plain_read(file: &Path) -> Result<f64> {
    let mut f = File::open(file)?;
    let mut buf = vec![0u8; RAW_BLOCK];
    let t = Instant::now();
    while f.read(&mut buf)? > 0 {}
    Ok(t.elapsed().as_secs_f64())
}

fn medians(case: &Case, r: &Runs) -> Medians {
    let gbps = |v: &[Pass]| median(&v.iter().map(|p| case.bytes as f64 / p.secs / 1e9).collect::<Vec<_>>());
    let (raw, naive, par, fp) = (gbps(&r.raw), gbps(&r.naive), gbps(&r.parallel), gbps(&r.parallel_fingerprint));
    let max_cached = [&r.raw, &r.naive, &r.parallel, &r.parallel_fingerprint]
        .iter()
        .flat_map(|v| v.iter().map(|p| p.cached))
        .chain(r.engine.iter().map(|e| e.cached))
        .fold(0.0, f64::max);
    let engine =
        |f: fn(&EngineLoad) -> f64| (!r.engine.is_empty()).then(|| median(&r.engine.iter().map(f).collect::<Vec<_>>()));
    Medians {
        raw_gbps: raw,
        naive_gbps: naive,
        parallel_gbps: par,
        parallel_fingerprint_gbps: fp,
        vs_raw: par / raw,
        vs_naive: par / naive,
        max_cached,
        engine_read_ms: engine(|e| e.read_ms),
        engine_convert_ms: engine(|e| e.convert_ms),
        naive_engine_ms: (!r.naive_engine.is_empty())
            .then(|| median(&r.naive_engine.iter().map(|e| e.read_ms + e.convert_ms).collect::<Vec<_>>())),
        checkpoint_bytes: case.checkpoint.as_ref().and_then(|p| std::fs::metadata(p).ok()).map(|m| m.len()),
        checkpoint_raw_ms: (!r.checkpoint_raw.is_empty())
            .then(|| median(&r.checkpoint_raw.iter().map(|p| p.secs * 1e3).collect::<Vec<_>>())),
        checkpoint_ms: (!r.checkpoint.is_empty())
            .then(|| median(&r.checkpoint.iter().map(|e| e.read_ms + e.convert_ms).collect::<Vec<_>>())),
    }
}

fn goals(results: &[CaseResult]) -> Vec<Goal> {
    let mut g = Vec::new();
    for r in results {
        let m = &r.median;
        g.push(Goal::new(
            "load",
            format!("{}: parallel >= {RAW_GOAL}x raw disk", r.case.label),
            m.vs_raw >= RAW_GOAL,
            format!("{:.2} vs {:.2} GB/s ({:.2}x)", m.parallel_gbps, m.raw_gbps, m.vs_raw),
        ));
        g.push(Goal::new(
            "load",
            format!("{}: parallel >= {NAIVE_GOAL}x naive", r.case.label),
            m.vs_naive >= NAIVE_GOAL,
            format!("{:.2} vs {:.2} GB/s ({:.2}x)", m.parallel_gbps, m.naive_gbps, m.vs_naive),
        ));
        if let (Some(ck), Some(raw), Some(naive)) = (m.checkpoint_ms, m.checkpoint_raw_ms, m.naive_engine_ms) {
            g.push(Goal::new(
                "load",
                format!("{}: checkpoint load <= {CHECKPOINT_RAW_GOAL}x the raw read of its bytes", r.case.label),
                ck <= CHECKPOINT_RAW_GOAL * raw,
                format!("{ck:.1} vs {raw:.1} ms ({:.2}x)", ck / raw),
            ));
            g.push(Goal::new(
                "load",
                format!("{}: checkpoint load >= {CHECKPOINT_NAIVE_GOAL}x naive read-and-convert", r.case.label),
                naive >= CHECKPOINT_NAIVE_GOAL * ck,
                format!("{ck:.1} vs {naive:.1} ms ({:.2}x)", naive / ck),
            ));
        }
    }
    g
}

fn size(bytes: u64) -> String {
    if bytes >= 1 << 30 {
        format!("{:.2} GiB", bytes as f64 / (1u64 << 30) as f64)
    } else {
        format!("{:.1} MiB", bytes as f64 / (1u64 << 20) as f64)
    }
}

fn tables(r: &Report) -> Vec<Table> {
    let mut t = Table::new(
        format!(
            "load: weights into tensors, GB/s (median of {} run(s), page cache dropped before each pass); raw = {}; parallel: {} threads, reads up to {} MiB",
            r.runs,
            r.raw_anchor,
            r.threads,
            r.chunk_bytes >> 20
        ),
        &["weights", "size", "raw", "naive", "parallel", "+fingerprint", "vs raw", "vs naive", "cached at start"],
    );
    for c in &r.cases {
        let m = &c.median;
        t.row(vec![
            c.case.label.clone(),
            size(c.case.bytes),
            format!("{:.3}", m.raw_gbps),
            format!("{:.3}", m.naive_gbps),
            format!("{:.3}", m.parallel_gbps),
            format!("{:.3}", m.parallel_fingerprint_gbps),
            format!("{:.2}x", m.vs_raw),
            format!("{:.2}x", m.vs_naive),
            format!("{:.1}%", m.max_cached * 100.0),
        ]);
    }
    let mut out = vec![t];
    if r.cases.iter().any(|c| c.median.engine_read_ms.is_some()) {
        let mut e = Table::new(
            "load: a whole Model::load (page cache dropped), ms (median): the read (with fingerprint) then the conversion into the engine's layout (dequantize, fuse, int8 tiles), which is compute, not weight loading",
            &["weights", "read ms", "read GB/s", "conversion ms", "total ms", "conversion share"],
        );
        for c in &r.cases {
            let (Some(read), Some(conv)) = (c.median.engine_read_ms, c.median.engine_convert_ms) else { continue };
            e.row(vec![
                c.case.label.clone(),
                format!("{read:.1}"),
                format!("{:.3}", c.case.bytes as f64 / (read / 1e3) / 1e9),
                format!("{conv:.1}"),
                format!("{:.1}", read + conv),
                format!("{:.0}%", conv / (read + conv) * 100.0),
            ]);
        }
        out.push(e);
    }
    if r.cases.iter().any(|c| c.median.checkpoint_ms.is_some()) {
        let mut e = Table::new(
            "load: the converted-weight checkpoint against converting (page cache dropped), ms (median): naive read-and-convert, the parallel read then convert, and a load from the checkpoint next to the raw anchor over its bytes",
            &["weights", "naive + convert", "parallel + convert", "checkpoint size", "raw read of it", "checkpoint load", "vs raw", "vs naive"],
        );
        for c in &r.cases {
            let m = &c.median;
            let (Some(naive), Some(read), Some(conv), Some(bytes), Some(raw), Some(ck)) = (
                m.naive_engine_ms,
                m.engine_read_ms,
                m.engine_convert_ms,
                m.checkpoint_bytes,
                m.checkpoint_raw_ms,
                m.checkpoint_ms,
            ) else {
                continue;
            };
            e.row(vec![
                c.case.label.clone(),
                format!("{naive:.1}"),
                format!("{:.1}", read + conv),
                size(bytes),
                format!("{raw:.1}"),
                format!("{ck:.1}"),
                format!("{:.2}x", ck / raw),
                format!("{:.1}x faster", naive / ck),
            ]);
        }
        out.push(e);
    }
    out
}

const METHODS: [(&str, RGBColor); 4] = [
    ("raw disk (anchor)", RGBColor(120, 120, 120)),
    ("naive: whole file, then parse", RGBColor(214, 39, 40)),
    ("parallel loader", RGBColor(31, 119, 180)),
    ("parallel + fingerprint", RGBColor(44, 160, 44)),
];

fn draw<DB: DrawingBackend>(r: &Report, area: DrawingArea<DB, plotters::coord::Shift>) -> Result<()>
where
    DB::ErrorType: 'static,
{
    let e = |e: DrawingAreaErrorKind<DB::ErrorType>| anyhow::anyhow!("{e}");
    area.fill(&WHITE).map_err(e)?;
    let n = r.cases.len();
    let m = METHODS.len() as f64;
    let top = r
        .cases
        .iter()
        .flat_map(|c| {
            [c.median.raw_gbps, c.median.naive_gbps, c.median.parallel_gbps, c.median.parallel_fingerprint_gbps]
        })
        .filter(|v| v.is_finite())
        .fold(0.1, f64::max)
        * 1.35;
    let labels: Vec<String> = r.cases.iter().map(|c| format!("{} ({})", c.case.label, size(c.case.bytes))).collect();
    // File i's bars sit around x = i.
    let mut chart = ChartBuilder::on(&area)
        .caption("Weight load: file → tensors, page cache dropped (GB/s, median)", ("sans-serif", 20))
        .margin(16)
        .x_label_area_size(40)
        .y_label_area_size(56)
        .build_cartesian_2d(-0.5..(n as f64 - 0.5), 0.0..top)
        .map_err(e)?;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(n * 2 + 1)
        .x_label_formatter(&|x| {
            let i = x.round();
            if (x - i).abs() < 0.05 && i >= 0.0 && (i as usize) < labels.len() {
                labels[i as usize].clone()
            } else {
                String::new()
            }
        })
        .y_desc("GB/s")
        .light_line_style(RGBColor(240, 240, 240))
        .draw()
        .map_err(e)?;
    for (k, (name, color)) in METHODS.iter().enumerate() {
        let bars: Vec<Rectangle<(f64, f64)>> = r
            .cases
            .iter()
            .enumerate()
            .map(|(i, c)| {
                let v = [
                    c.median.raw_gbps,
                    c.median.naive_gbps,
                    c.median.parallel_gbps,
                    c.median.parallel_fingerprint_gbps,
                ][k];
                let x = i as f64 - 0.4 + k as f64 * 0.8 / m;
                Rectangle::new([(x, 0.0), (x + 0.8 / m * 0.9, if v.is_finite() { v } else { 0.0 })], color.filled())
            })
            .collect();
        let color = *color;
        chart.draw_series(bars).map_err(e)?.label(*name).legend(bar_key(color));
    }
    legend(&mut chart, SeriesLabelPosition::UpperRight)?;
    area.present().map_err(e)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn synthetic_shapes_come_close_to_the_size() {
        for (want, elem) in [(2u64 << 30, 2u64), (48 << 20, 2), (8 << 30, 2)] {
            let t = synthetic_tensors(want, elem);
            let got: u64 = t.iter().map(|(_, s)| s.iter().product::<usize>() as u64 * elem).sum();
            assert!(got <= want + want / 4 && got >= want / 2, "{want}: {got} bytes");
            assert_eq!(t[0].0, "model.embed_tokens.weight");
            assert!(t.iter().any(|(n, _)| n == "model.layers.0.mlp.down_proj.weight"));
        }
    }

    #[test]
    fn a_written_checkpoint_parses_as_safetensors() {
        let dir = tempfile::tempdir().unwrap();
        let case = write_synthetic(dir.path(), 4 << 20, SynthDtype::F16, 7).unwrap();
        let st = load::naive_safetensors(&case.files, b"", &candle_core::Device::Cpu, false).unwrap();
        assert_eq!(st.tensors.len(), case.tensors);
        assert_eq!(st.tensors["lm_head.weight"].dtype(), candle_core::DType::F16);
    }
}

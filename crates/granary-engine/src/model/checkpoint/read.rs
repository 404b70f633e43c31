//! Reading a checkpoint back into a model, each buffer straight into
//! place, after checking that it is this build's and its sources'.

use std::collections::HashMap;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::time::Instant;

use anyhow::{bail, ensure, Context, Result};
use candle_core::quantized::{GgmlDType, QMatMul};
use candle_core::Tensor;

use crate::model::linear::{Linear, Proj, Weights};
use crate::model::load::{self, Dst, Piece, Plan, QBuf, ReadOptions, ReadStats, Scratch, TBuf};
use crate::model::qmatmul::{Q4Matrix, Q8Matrix};
use crate::model::{config, Embedding, Layer, LoadOptions, LoadStats, Model, ModelConfig};

use super::*;

/// Why a checkpoint was not used.
pub(crate) enum Miss {
    Missing,
    Stale(String),
    Unusable(String),
}

impl From<Miss> for CheckpointUse {
    fn from(m: Miss) -> Self {
        match m {
            Miss::Missing => CheckpointUse::Missing,
            Miss::Stale(s) => CheckpointUse::Stale(s),
            Miss::Unusable(s) => CheckpointUse::Unusable(s),
        }
    }
}

fn unusable(e: impl std::fmt::Display) -> Miss {
    Miss::Unusable(e.to_string())
}

fn read_header(file: &File, len: u64) -> std::result::Result<(Header, u64), Miss> {
    let mut prefix = [0u8; PREFIX];
    if len < PREFIX as u64 {
        return Err(unusable(format!("{len} bytes is too short for a checkpoint")));
    }
    file.read_exact_at(&mut prefix, 0).map_err(unusable)?;
    if &prefix[..8] != MAGIC {
        return Err(unusable("not a granary checkpoint (bad magic)"));
    }
    let version = u32::from_le_bytes(prefix[8..12].try_into().expect("4 bytes"));
    if version != VERSION {
        return Err(Miss::Stale(format!("format version {version}, this build reads {VERSION}")));
    }
    let header_len = u64::from_le_bytes(prefix[16..24].try_into().expect("8 bytes"));
    if header_len > MAX_HEADER || PREFIX as u64 + header_len > len {
        return Err(unusable(format!("header of {header_len} bytes in a file of {len}")));
    }
    let mut text = vec![0u8; header_len as usize];
    file.read_exact_at(&mut text, PREFIX as u64).map_err(unusable)?;
    if blake3::hash(&text).as_bytes() != &prefix[24..56] {
        return Err(unusable("header checksum mismatch"));
    }
    let header: Header = serde_json::from_slice(&text).map_err(|e| unusable(format!("header: {e}")))?;
    let start = data_start(text.len());
    if start + header.data_bytes != len {
        return Err(unusable(format!(
            "the file has {len} bytes, the header describes {} (truncated?)",
            start + header.data_bytes
        )));
    }
    Ok((header, start))
}

/// A buffer read from a checkpoint.
enum Buf {
    Plain(TBuf, safetensors::Dtype, Vec<usize>),
    Quant(QBuf, GgmlDType, Vec<usize>),
    Alias(String),
}

fn ggml_dtype(name: &str) -> Option<GgmlDType> {
    use GgmlDType as G;
    [
        G::F32,
        G::F16,
        G::BF16,
        G::Q4_0,
        G::Q4_1,
        G::Q5_0,
        G::Q5_1,
        G::Q8_0,
        G::Q8_1,
        G::Q2K,
        G::Q3K,
        G::Q4K,
        G::Q5K,
        G::Q6K,
        G::Q8K,
    ]
    .into_iter()
    .find(|d| format!("{d:?}") == name)
}

fn plain_dtype(name: &str) -> Option<(safetensors::Dtype, usize)> {
    use safetensors::Dtype as D;
    Some(match name {
        "F32" => (D::F32, 4),
        "F16" => (D::F16, 2),
        "BF16" => (D::BF16, 2),
        "U8" => (D::U8, 1),
        _ => return None,
    })
}

/// The model from its checkpoint at `path`, or why not.
pub(crate) fn load(
    source: &Path,
    path: &Path,
    opts: &LoadOptions,
    stamps_now: &[Stamp],
) -> std::result::Result<(Model, LoadStats), Miss> {
    let t0 = Instant::now();
    let key = key(opts).ok_or_else(|| Miss::Stale("weights off the host are not checkpointed".into()))?;
    let file = match File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Err(Miss::Missing),
        Err(e) => return Err(unusable(format!("open {}: {e}", path.display()))),
    };
    let len = file.metadata().map_err(unusable)?.len();
    let (header, start) = read_header(&file, len)?;
    if header.key != key {
        return Err(Miss::Stale(format!("made for {}, this load needs {key}", header.key)));
    }
    if header.sources != stamps_now {
        let was = |s: &Stamp| {
            format!("{} ({} bytes, mtime {} ns, inode {}, ctime {} ns)", s.name, s.len, s.mtime_ns, s.ino, s.ctime_ns)
        };
        let what = match header.sources.iter().zip(stamps_now).find(|(a, b)| a != b) {
            Some((a, b)) => format!("{} is now {}", was(a), was(b)),
            None => format!("{} files then, {} now", header.sources.len(), stamps_now.len()),
        };
        return Err(Miss::Stale(format!("the model's files changed since it was written: {what}")));
    }
    let mut cfg = model_config(source).map_err(|e| unusable(format!("{e:#}")))?;
    let header_time = t0.elapsed();

    // Every buffer allocated at its final size, read straight into place.
    let t1 = Instant::now();
    let mut bufs: Vec<(String, Buf)> = Vec::with_capacity(header.entries.len());
    let mut pieces = Vec::with_capacity(header.entries.len() * 2);
    let mut scratch = Scratch(Vec::new());
    let mut names = Vec::with_capacity(header.entries.len());
    let mut at = 0u64;
    for e in &header.entries {
        if let Some(target) = &e.alias {
            bufs.push((e.name.clone(), Buf::Alias(target.clone())));
            continue;
        }
        if e.offset < at || e.offset + e.bytes > header.data_bytes {
            return Err(unusable(format!("entry {} lies outside the data", e.name)));
        }
        if e.offset > at {
            pieces.push(scratch.piece(0, start + at, (e.offset - at) as usize));
        }
        let mut buf = if let Some(g) = e.dtype.strip_prefix("ggml:").and_then(ggml_dtype) {
            if e.bytes != (e.len * g.type_size()) as u64 || e.dims.iter().product::<usize>() != e.len * g.block_size() {
                return Err(unusable(format!("entry {}: sizes do not agree", e.name)));
            }
            Buf::Quant(QBuf::new(g, e.len), g, e.dims.clone())
        } else if let Some((d, size)) = plain_dtype(&e.dtype) {
            if e.bytes != (e.len * size) as u64
                || e.dims.iter().product::<usize>() != e.len && d != safetensors::Dtype::U8
            {
                return Err(unusable(format!("entry {}: sizes do not agree", e.name)));
            }
            Buf::Plain(TBuf::new(d, e.len, e.bytes as usize), d, e.dims.clone())
        } else {
            return Err(unusable(format!("entry {}: unknown type {}", e.name, e.dtype)));
        };
        let (ptr, n) = match &mut buf {
            Buf::Plain(b, ..) => b.raw(),
            Buf::Quant(b, ..) => b.raw(),
            Buf::Alias(_) => unreachable!("handled above"),
        };
        if n as u64 != e.bytes {
            return Err(unusable(format!("entry {}: {n} bytes allocated for {}", e.name, e.bytes)));
        }
        pieces.push(Piece { file: 0, offset: start + e.offset, len: n, dst: Dst(ptr), tensor: Some(names.len()) });
        names.push(e.name.clone());
        bufs.push((e.name.clone(), buf));
        at = e.offset + e.bytes;
    }
    if at < header.data_bytes {
        pieces.push(scratch.piece(0, start + at, (header.data_bytes - at) as usize));
    }
    let read_opts = match &opts.loader {
        load::Loader::Parallel(r) => ReadOptions { fingerprint: true, ..r.clone() },
        load::Loader::Naive => ReadOptions { threads: 1, fingerprint: true, ..ReadOptions::default() },
    };
    let files = [file];
    let paths = [path.to_path_buf()];
    let plan = Plan { files: &files, paths: &paths, names: &names, pieces };
    let digest = load::run(plan, &read_opts, &[]).map_err(|e| unusable(format!("{e:#}")))?;
    drop(scratch);
    if digest.as_deref() != Some(header.data_blake3.as_str()) {
        return Err(unusable("data checksum mismatch"));
    }
    let mut parts = Parts { bufs: HashMap::with_capacity(bufs.len()), made: HashMap::new() };
    for (name, mut buf) in bufs {
        // SAFETY: `run` returned Ok, so every piece of every buffer was read in full.
        match &mut buf {
            Buf::Plain(b, ..) => unsafe { b.assume_filled() },
            Buf::Quant(b, ..) => unsafe { b.assume_filled() },
            Buf::Alias(_) => {}
        }
        parts.bufs.insert(name, buf);
    }
    let read_time = t1.elapsed();
    let t2 = Instant::now();
    // Factors a GGUF keeps as a tensor are in the checkpoint; those a
    // config.json gives are computed from it again (and must agree).
    if let config::RopeScaling::Factors(f) = &mut cfg.rope_scaling {
        let stored = parts.floats("rope_factors").map_err(unusable)?;
        if f.is_empty() {
            *f = stored;
        } else if *f != stored {
            return Err(unusable("rope frequency factors differ from the model's"));
        }
    }
    let model = assemble(cfg, &mut parts, opts, header.fingerprint.clone(), source, stamps_now.to_vec(), key)
        .map_err(|e| unusable(format!("{e:#}")))?;
    if let Some(name) = parts.bufs.keys().next() {
        return Err(unusable(format!("entry {name} belongs to no weight")));
    }
    let stats = LoadStats {
        read: ReadStats {
            loader: "checkpoint",
            files: 1,
            tensors: header.entries.len(),
            tensor_bytes: header.data_bytes,
            file_bytes: len,
            header: header_time,
            read: read_time,
            threads: read_opts.threads.max(1),
            fingerprint: Some(header.fingerprint),
        },
        convert: t2.elapsed(),
        checkpoint: CheckpointUse::Loaded,
    };
    Ok((model, stats))
}

/// The configuration from the model's own header (GGUF) or `config.json`.
fn model_config(source: &Path) -> Result<ModelConfig> {
    if source.is_dir() {
        let p = source.join("config.json");
        let text = std::fs::read_to_string(&p).with_context(|| format!("read {}", p.display()))?;
        return ModelConfig::from_hf_json(&text);
    }
    let file = load::open(source)?;
    let len = load::file_len(&file, source)?;
    ModelConfig::from_gguf(&load::gguf_header(&file, source, len)?)
}

/// The buffers read, handed out by name, each once.
struct Parts {
    bufs: HashMap<String, Buf>,
    /// Tensors already made, for aliases.
    made: HashMap<String, Tensor>,
}

impl Parts {
    fn has(&self, name: &str) -> bool {
        self.bufs.contains_key(name)
    }

    fn take(&mut self, name: &str) -> Result<Buf> {
        self.bufs.remove(name).with_context(|| format!("the checkpoint has no {name}"))
    }

    fn tensor(&mut self, name: &str) -> Result<Tensor> {
        let t = match self.take(name)? {
            Buf::Plain(b, d, dims) => b.into_tensor(d, &dims, &candle_core::Device::Cpu)?,
            Buf::Alias(target) => match self.made.get(&target) {
                Some(t) => t.clone(),
                None => self.tensor(&target)?,
            },
            Buf::Quant(..) => bail!("{name} is quantized, a tensor was expected"),
        };
        self.made.insert(name.to_string(), t.clone());
        Ok(t)
    }

    fn tensor_opt(&mut self, name: &str) -> Result<Option<Tensor>> {
        if self.has(name) {
            self.tensor(name).map(Some)
        } else {
            Ok(None)
        }
    }

    fn floats(&mut self, name: &str) -> Result<Vec<f32>> {
        match self.take(name)? {
            Buf::Plain(TBuf::F32(v, _), ..) => Ok(v),
            _ => bail!("{name} is not an f32 buffer"),
        }
    }

    fn floats_opt(&mut self, name: &str) -> Result<Option<Vec<f32>>> {
        if self.has(name) {
            self.floats(name).map(Some)
        } else {
            Ok(None)
        }
    }

    /// A byte buffer and the matrix shape `[n, k]` it holds.
    fn tiles(&mut self, name: &str) -> Result<(Vec<u8>, usize, usize)> {
        match self.take(name)? {
            Buf::Plain(TBuf::U8(v, _), _, dims) if dims.len() == 2 => Ok((v, dims[0], dims[1])),
            _ => bail!("{name} is not a tile buffer"),
        }
    }

    /// A quantized matmul stored under `name` (as [`linear_items`] names them), if any.
    fn quant(&mut self, name: &str) -> Result<Option<QMatMul>> {
        if self.has(name) {
            return match self.take(name)? {
                Buf::Quant(b, g, dims) => {
                    let q = b.into_qtensor(g, dims, &candle_core::Device::Cpu)?;
                    Ok(Some(QMatMul::QTensor(std::sync::Arc::new(q))))
                }
                _ => bail!("{name} is not quantized"),
            };
        }
        if let Some(t) = self.tensor_opt(&format!("{name}_tensor"))? {
            return Ok(Some(QMatMul::Tensor(t)));
        }
        Ok(self.tensor_opt(&format!("{name}_f16"))?.map(QMatMul::TensorF16))
    }

    fn linear(&mut self, p: &str) -> Result<Linear> {
        let w = if self.has(&format!("{p}.int8.qs")) {
            let (qs, n, k) = self.tiles(&format!("{p}.int8.qs"))?;
            let scales = self.floats(&format!("{p}.int8.scales"))?;
            ensure!(Q8Matrix::supported(), "{p}: int8 tiles need AVX-512 VNNI");
            Weights::Int8(Q8Matrix::from_parts(n, k, qs, scales)?)
        } else if self.has(&format!("{p}.int4.qs")) {
            let (qs, n, k) = self.tiles(&format!("{p}.int4.qs"))?;
            let d = self.floats(&format!("{p}.int4.d"))?;
            let m = self.floats(&format!("{p}.int4.m"))?;
            ensure!(Q8Matrix::supported(), "{p}: 4-bit tiles need AVX-512 VNNI");
            Weights::Int4(Q4Matrix::from_parts(n, k, qs, d, m)?)
        } else if let Some(dense) = self.tensor_opt(&format!("{p}.dense"))? {
            Weights::Dense { dense, quant: self.quant(&format!("{p}.quant"))? }
        } else if let Some(q) = self.quant(&format!("{p}.stored"))? {
            Weights::Stored(q)
        } else {
            bail!("the checkpoint has no weights for {p}");
        };
        Ok(Linear { w, bias: self.tensor_opt(&format!("{p}.bias"))? })
    }

    fn proj(&mut self, p: &str) -> Result<Proj> {
        let first = format!("{p}.split.0.");
        if !self.bufs.keys().any(|k| k.starts_with(&first)) {
            return Ok(Proj::Fused(self.linear(p)?));
        }
        let mut ls = Vec::new();
        while self.bufs.keys().any(|k| k.starts_with(&format!("{p}.split.{}.", ls.len()))) {
            ls.push(self.linear(&format!("{p}.split.{}", ls.len()))?);
        }
        Ok(Proj::Split(ls))
    }
}

fn assemble(
    cfg: ModelConfig,
    parts: &mut Parts,
    opts: &LoadOptions,
    fingerprint: String,
    source: &Path,
    stamps: Vec<Stamp>,
    key: String,
) -> Result<Model> {
    cfg.validate()?;
    let context_len = opts.max_context.map_or(cfg.context_len, |m| m.min(cfg.context_len));
    let (ropes, rope_of) = crate::model::weights::ropes(&cfg, context_len, &opts.device)?;
    let embed = if parts.has("embed.rows") {
        match parts.take("embed.rows")? {
            Buf::Quant(b, g, dims) => Embedding::Rows(Box::new(b.into_qtensor(g, dims, &candle_core::Device::Cpu)?)),
            _ => bail!("embed.rows is not quantized"),
        }
    } else {
        Embedding::Dense(parts.tensor("embed")?)
    };
    crate::model::weights::check_embedding(&cfg, embed.dims())?;
    let mut layers = Vec::with_capacity(cfg.layers);
    for (i, &rope) in rope_of.iter().enumerate() {
        let p = |n: &str| format!("layers.{i}.{n}");
        layers.push(Layer {
            attn_norm: parts.tensor(&p("attn_norm"))?,
            qkv: parts.proj(&p("qkv"))?,
            q_norm: parts.floats_opt(&p("q_norm"))?,
            k_norm: parts.floats_opt(&p("k_norm"))?,
            wo: parts.linear(&p("wo"))?,
            attn_post_norm: parts.tensor_opt(&p("attn_post_norm"))?,
            ffn_norm: parts.tensor(&p("ffn_norm"))?,
            gate_up: parts.proj(&p("gate_up"))?,
            down: parts.linear(&p("down"))?,
            ffn_post_norm: parts.tensor_opt(&p("ffn_post_norm"))?,
            rope,
            window: if cfg.is_sliding(i) { cfg.sliding_window } else { None },
        });
    }
    let norm = parts.tensor("norm")?;
    let lm_head = parts.linear("lm_head")?;
    let host = opts.device.is_cpu() && !opts.tensor_ops;
    Ok(Model {
        cfg,
        device: opts.device.clone(),
        host,
        embed,
        layers,
        norm,
        lm_head,
        ropes,
        context_len,
        fingerprint,
        source: source.to_path_buf(),
        stamps,
        checkpoint_key: Some(key),
        pools: Default::default(),
        head_norms: Default::default(),
    })
}

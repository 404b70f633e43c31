//! Converted-weight checkpoints.
//!
//! Building the engine's weights from a model's files (dequantizing, fusing
//! projections, re-quantizing into int8 or 4-bit tiles) costs far more than
//! reading them. A checkpoint is that converted form written out as it sits
//! in memory, so that the next start reads it straight into place with the
//! parallel reader ([`super::load`]) and converts nothing.
//!
//! Layout: an 8-byte magic, the format version (u32), a reserved u32, the
//! header's length (u64) and its blake3 (32 bytes); the header (JSON: the
//! key, the model fingerprint, the source files' stamps, the data's length
//! and blake3, and every buffer's name, type, shape and place); zeros up to
//! the next 4 KiB; then the data, each buffer 64-byte aligned. Numbers are
//! little-endian, as the buffers are in memory.
//!
//! A checkpoint is used only when all of these hold, and otherwise the
//! model is converted as usual (the caller may then write a fresh one):
//! - its key is this build's: the format version, the CPU kernels the
//!   weights were converted for and the load options that change them
//!   ([`key`]);
//! - the size and modification time of every source file are those it
//!   recorded (the model fingerprint stored in it is then the one those
//!   files hash to, so they need not be read); for a link into a
//!   content-addressed store, the size and the sha256 its target is named by;
//! - its header's blake3, and its data's blake3 (computed while the data
//!   is read, as the model loader computes the fingerprint), match.
//!
//! Rotary tables are not stored: they depend on the context length asked
//! for, and are recomputed (a few milliseconds).

use std::borrow::Cow;
use std::collections::HashMap;
use std::fs::File;
use std::io::Write;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, ensure, Context, Result};
use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
use candle_core::{DType, Tensor};
use serde::{Deserialize, Serialize};

use super::linear::{Linear, Proj, Weights};
use super::load::{self, Dst, Piece, Plan, QBuf, ReadOptions, ReadStats, Scratch, TBuf};
use super::qmatmul::{Q4Matrix, Q8Matrix};
use super::{config, Embedding, Layer, LoadOptions, LoadStats, Model, ModelConfig};

const MAGIC: &[u8; 8] = b"GRNRYCKP";
const VERSION: u32 = 1;
/// Magic, version, reserved, header length, header blake3.
const PREFIX: usize = 8 + 4 + 4 + 8 + 32;
/// Where the data starts (a multiple of).
const DATA_ALIGN: u64 = 4096;
/// Where each buffer starts within the data (a multiple of).
const ENTRY_ALIGN: u64 = 64;
/// The largest header accepted.
const MAX_HEADER: u64 = 64 << 20;

/// What became of the checkpoint at a load.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CheckpointUse {
    /// None was asked for.
    Off,
    /// The weights came from it.
    Loaded,
    /// There is none yet.
    Missing,
    /// It was made for other files, another CPU or other options.
    Stale(String),
    /// It is damaged or unreadable (checksum, truncation, format).
    Unusable(String),
}

impl CheckpointUse {
    /// Whether a fresh checkpoint is worth writing after this load.
    pub fn wants_write(&self) -> bool {
        matches!(self, CheckpointUse::Missing | CheckpointUse::Stale(_) | CheckpointUse::Unusable(_))
    }
}

impl std::fmt::Display for CheckpointUse {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CheckpointUse::Off => f.write_str("off"),
            CheckpointUse::Loaded => f.write_str("loaded"),
            CheckpointUse::Missing => f.write_str("missing"),
            CheckpointUse::Stale(why) => write!(f, "stale: {why}"),
            CheckpointUse::Unusable(why) => write!(f, "unusable: {why}"),
        }
    }
}

impl Serialize for CheckpointUse {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

/// Size, modification time, inode and status-change time of one source
/// file. Size and modification time alone miss a file replaced by another
/// of the same size whose time was set back (a copy that keeps times, a
/// download that sets the server's): the replacement has a new inode, or
/// in place a new status-change time, which no program can set back.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Stamp {
    name: String,
    len: u64,
    mtime_ns: i128,
    /// 0 in checkpoints written before these were stamped (never equal to
    /// a file's, so those checkpoints are rebuilt once).
    #[serde(default)]
    ino: u64,
    #[serde(default)]
    ctime_ns: i128,
}

/// A file's stamp. A link into a content-addressed store (a file named by
/// the sha256 of its bytes, as the node agent's tiers keep weights) is
/// stamped by that name instead of its time: such a store touches files
/// to track recency and moves them between tiers, neither of which
/// changes their bytes.
fn stamp(path: &Path) -> Result<Stamp> {
    let m = std::fs::metadata(path).with_context(|| format!("stat {}", path.display()))?;
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let target = std::fs::symlink_metadata(path)
        .ok()
        .filter(|l| l.file_type().is_symlink())
        .and_then(|_| std::fs::canonicalize(path).ok())
        .and_then(|t| t.file_name().map(|n| n.to_string_lossy().into_owned()))
        .filter(|n| n.len() == 64 && n.bytes().all(|b| b.is_ascii_hexdigit()));
    Ok(match target {
        Some(sha) => Stamp {
            name: format!("{name}@sha256:{}", sha.to_ascii_lowercase()),
            len: m.len(),
            mtime_ns: 0,
            ino: 0,
            ctime_ns: 0,
        },
        None => Stamp {
            name,
            len: m.len(),
            mtime_ns: m.mtime() as i128 * 1_000_000_000 + m.mtime_nsec() as i128,
            ino: m.ino(),
            ctime_ns: m.ctime() as i128 * 1_000_000_000 + m.ctime_nsec() as i128,
        },
    })
}

/// The stamps of a model's files: a GGUF file, or a directory's
/// `config.json` and `*.safetensors` (in the loader's order).
pub(crate) fn stamps(source: &Path) -> Result<Vec<Stamp>> {
    if !source.is_dir() {
        return Ok(vec![stamp(source)?]);
    }
    let mut files: Vec<PathBuf> = std::fs::read_dir(source)
        .with_context(|| format!("list {}", source.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "safetensors"))
        .collect();
    files.sort();
    let mut out = vec![stamp(&source.join("config.json"))?];
    for f in files {
        out.push(stamp(&f)?);
    }
    Ok(out)
}

/// The kernels converted weights are laid out for on this CPU.
fn kernels() -> &'static str {
    if Q8Matrix::supported() {
        "avx512vnni"
    } else {
        "portable"
    }
}

/// What converted weights depend on besides the model's files: the format,
/// this CPU's kernels, and the options that change the conversion. `None`
/// where no checkpoint applies (weights on an accelerator).
pub fn key(opts: &LoadOptions) -> Option<String> {
    if !opts.device.is_cpu() {
        return None;
    }
    let int4 = super::linear::int4_enabled();
    Some(format!(
        "v{VERSION};kernels={};holds={};int4={int4};quantized_decode={};native_quant={};tensor_ops={}",
        kernels(),
        super::linear::HOLD_RULES,
        opts.quantized_decode,
        opts.native_quant,
        opts.tensor_ops
    ))
}

/// Where a model's checkpoint goes by default: beside a GGUF file
/// (`model.gguf.granary-avx512vnni.ckpt`), or inside a model directory.
pub fn default_path(model: &Path) -> PathBuf {
    let tag = kernels();
    if model.is_dir() {
        model.join(format!("granary-{tag}.ckpt"))
    } else {
        let name = model.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        model.with_file_name(format!("{name}.granary-{tag}.ckpt"))
    }
}

#[derive(Serialize, Deserialize)]
struct Header {
    key: String,
    fingerprint: String,
    sources: Vec<Stamp>,
    data_bytes: u64,
    data_blake3: String,
    entries: Vec<Entry>,
}

#[derive(Clone, Serialize, Deserialize)]
struct Entry {
    name: String,
    /// `F32`, `F16`, `BF16`, `U8`, or `ggml:<type>` (quantized blocks).
    dtype: String,
    dims: Vec<usize>,
    /// Elements, or blocks for `ggml:` types.
    len: usize,
    /// Within the data.
    offset: u64,
    bytes: u64,
    /// The same buffer as the entry named here (a tied embedding).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    alias: Option<String>,
}

/// One buffer of a model, borrowed for writing.
enum Item<'a> {
    Tensor(&'a Tensor),
    Floats(&'a [f32], Vec<usize>),
    Bytes(&'a [u8], Vec<usize>),
    Quant(&'a QTensor),
}

fn as_bytes<T: bytemuck::Pod>(v: &[T]) -> &[u8] {
    bytemuck::cast_slice(v)
}

fn tensor_dtype(t: &Tensor) -> Result<&'static str> {
    Ok(match t.dtype() {
        DType::F32 => "F32",
        DType::F16 => "F16",
        DType::BF16 => "BF16",
        DType::U8 => "U8",
        other => bail!("a {other:?} tensor cannot be checkpointed"),
    })
}

impl Item<'_> {
    /// (dtype, dims, len, bytes).
    fn describe(&self) -> Result<(String, Vec<usize>, usize, u64)> {
        Ok(match self {
            Item::Tensor(t) => (
                tensor_dtype(t)?.into(),
                t.dims().to_vec(),
                t.elem_count(),
                (t.elem_count() * t.dtype().size_in_bytes()) as u64,
            ),
            Item::Floats(v, dims) => ("F32".into(), dims.clone(), v.len(), (v.len() * 4) as u64),
            Item::Bytes(v, dims) => ("U8".into(), dims.clone(), v.len(), v.len() as u64),
            Item::Quant(q) => {
                let blocks = q.shape().elem_count() / q.dtype().block_size();
                (
                    format!("ggml:{:?}", q.dtype()),
                    q.shape().dims().to_vec(),
                    blocks,
                    (blocks * q.dtype().type_size()) as u64,
                )
            }
        })
    }

    fn data(&self) -> Result<Cow<'_, [u8]>> {
        Ok(match self {
            Item::Tensor(t) => {
                let flat = t.flatten_all()?;
                Cow::Owned(match t.dtype() {
                    DType::F32 => as_bytes(&flat.to_vec1::<f32>()?).to_vec(),
                    DType::F16 => as_bytes(&flat.to_vec1::<half::f16>()?).to_vec(),
                    DType::BF16 => as_bytes(&flat.to_vec1::<half::bf16>()?).to_vec(),
                    DType::U8 => flat.to_vec1::<u8>()?,
                    other => bail!("a {other:?} tensor cannot be checkpointed"),
                })
            }
            Item::Floats(v, _) => Cow::Borrowed(as_bytes(v)),
            Item::Bytes(v, _) => Cow::Borrowed(v),
            Item::Quant(q) => q.data()?,
        })
    }
}

/// Every buffer of the model, named, in a fixed order.
fn items(m: &Model) -> Vec<(String, Item<'_>)> {
    let mut out = Vec::new();
    match &m.embed {
        Embedding::Dense(t) => out.push(("embed".to_string(), Item::Tensor(t))),
        Embedding::Rows(q) => out.push(("embed.rows".to_string(), Item::Quant(q))),
    }
    if let config::RopeScaling::Factors(f) = &m.cfg.rope_scaling {
        out.push(("rope_factors".to_string(), Item::Floats(f, vec![f.len()])));
    }
    for (i, l) in m.layers.iter().enumerate() {
        let p = |n: &str| format!("layers.{i}.{n}");
        out.push((p("attn_norm"), Item::Tensor(&l.attn_norm)));
        proj_items(&mut out, p("qkv"), &l.qkv);
        if let Some(v) = &l.q_norm {
            out.push((p("q_norm"), Item::Floats(v, vec![v.len()])));
        }
        if let Some(v) = &l.k_norm {
            out.push((p("k_norm"), Item::Floats(v, vec![v.len()])));
        }
        linear_items(&mut out, p("wo"), &l.wo);
        if let Some(t) = &l.attn_post_norm {
            out.push((p("attn_post_norm"), Item::Tensor(t)));
        }
        out.push((p("ffn_norm"), Item::Tensor(&l.ffn_norm)));
        proj_items(&mut out, p("gate_up"), &l.gate_up);
        linear_items(&mut out, p("down"), &l.down);
        if let Some(t) = &l.ffn_post_norm {
            out.push((p("ffn_post_norm"), Item::Tensor(t)));
        }
    }
    out.push(("norm".to_string(), Item::Tensor(&m.norm)));
    linear_items(&mut out, "lm_head".to_string(), &m.lm_head);
    out
}

fn proj_items<'a>(out: &mut Vec<(String, Item<'a>)>, p: String, proj: &'a Proj) {
    match proj {
        Proj::Fused(l) => linear_items(out, p, l),
        Proj::Split(ls) => {
            for (j, l) in ls.iter().enumerate() {
                linear_items(out, format!("{p}.split.{j}"), l);
            }
        }
    }
}

fn linear_items<'a>(out: &mut Vec<(String, Item<'a>)>, p: String, l: &'a Linear) {
    let quant = |out: &mut Vec<(String, Item<'a>)>, name: String, q: &'a QMatMul| match q {
        QMatMul::QTensor(q) => out.push((name, Item::Quant(q))),
        QMatMul::Tensor(t) => out.push((format!("{name}_tensor"), Item::Tensor(t))),
        QMatMul::TensorF16(t) => out.push((format!("{name}_f16"), Item::Tensor(t))),
    };
    match &l.w {
        Weights::Int8(w) => {
            let (n, k, qs, scales) = w.parts();
            out.push((format!("{p}.int8.qs"), Item::Bytes(qs, vec![n, k])));
            out.push((format!("{p}.int8.scales"), Item::Floats(scales, vec![scales.len()])));
        }
        Weights::Int4(w) => {
            let (n, k, qs, d, m) = w.parts();
            out.push((format!("{p}.int4.qs"), Item::Bytes(qs, vec![n, k])));
            out.push((format!("{p}.int4.d"), Item::Floats(d, vec![d.len()])));
            out.push((format!("{p}.int4.m"), Item::Floats(m, vec![m.len()])));
        }
        Weights::Dense { dense, quant: q } => {
            out.push((format!("{p}.dense"), Item::Tensor(dense)));
            if let Some(q) = q {
                quant(out, format!("{p}.quant"), q);
            }
        }
        Weights::Stored(q) => quant(out, format!("{p}.stored"), q),
    }
    if let Some(t) = &l.bias {
        out.push((format!("{p}.bias"), Item::Tensor(t)));
    }
}

fn header_bytes(h: &Header) -> Result<Vec<u8>> {
    Ok(serde_json::to_vec(h)?)
}

fn data_start(header_len: usize) -> u64 {
    ((PREFIX + header_len) as u64).next_multiple_of(DATA_ALIGN)
}

impl Model {
    /// Writes the converted weights to `path` (through a temporary file in
    /// the same directory, renamed into place); returns its size. Fails
    /// when the weights are not on the host or the model's files changed
    /// since they were loaded.
    pub fn save_checkpoint(&self, path: &Path) -> Result<u64> {
        let key = self.checkpoint_key.clone().context("weights off the host are not checkpointed")?;
        let now = stamps(&self.source)?;
        ensure!(now == self.stamps, "{} changed since it was loaded", self.source.display());
        let items = items(self);
        let mut entries = Vec::with_capacity(items.len());
        let mut seen: HashMap<candle_core::TensorId, String> = HashMap::new();
        let mut offset = 0u64;
        for (name, item) in &items {
            if let Item::Tensor(t) = item {
                if let Some(first) = seen.get(&t.id()) {
                    let (dtype, dims, len, _) = item.describe()?;
                    let alias = Some(first.clone());
                    entries.push(Entry { name: name.clone(), dtype, dims, len, offset, bytes: 0, alias });
                    continue;
                }
                seen.insert(t.id(), name.clone());
            }
            let (dtype, dims, len, bytes) = item.describe()?;
            offset = offset.next_multiple_of(ENTRY_ALIGN);
            entries.push(Entry { name: name.clone(), dtype, dims, len, offset, bytes, alias: None });
            offset += bytes;
        }
        let mut header = Header {
            key,
            fingerprint: self.fingerprint.clone(),
            sources: self.stamps.clone(),
            data_bytes: offset,
            data_blake3: "0".repeat(64),
            entries,
        };
        let start = data_start(header_bytes(&header)?.len());
        let dir = path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
        remove_stale_temporaries(dir);
        let mut tmp = tempfile::Builder::new()
            .prefix(".granary-ckpt-")
            .tempfile_in(dir)
            .with_context(|| format!("create a checkpoint in {}", dir.display()))?;
        // Readable as the model files are (a temporary file starts private).
        let mut perms = tmp.as_file().metadata()?.permissions();
        std::os::unix::fs::PermissionsExt::set_mode(&mut perms, 0o644);
        tmp.as_file().set_permissions(perms).context("set a checkpoint's permissions")?;
        let file = tmp.as_file_mut();
        let mut hasher = blake3::Hasher::new();
        let mut at = 0u64;
        let zeros = [0u8; ENTRY_ALIGN as usize];
        for ((_, item), e) in items.iter().zip(&header.entries) {
            if e.alias.is_some() {
                continue;
            }
            let pad = (e.offset - at) as usize;
            hasher.update(&zeros[..pad]);
            let data = item.data()?;
            ensure!(data.len() as u64 == e.bytes, "{}: {} bytes, expected {}", e.name, data.len(), e.bytes);
            hasher.update(&data);
            file.write_all_at(&data, start + e.offset).context("write a checkpoint")?;
            at = e.offset + e.bytes;
        }
        header.data_blake3 = hasher.finalize().to_hex().to_string();
        let text = header_bytes(&header)?;
        ensure!(data_start(text.len()) == start, "checkpoint header changed length");
        let mut head = Vec::with_capacity(PREFIX + text.len());
        head.extend_from_slice(MAGIC);
        head.extend_from_slice(&VERSION.to_le_bytes());
        head.extend_from_slice(&0u32.to_le_bytes());
        head.extend_from_slice(&(text.len() as u64).to_le_bytes());
        head.extend_from_slice(blake3::hash(&text).as_bytes());
        head.extend_from_slice(&text);
        head.resize(start as usize, 0);
        file.write_all_at(&head, 0).context("write a checkpoint")?;
        file.set_len(start + header.data_bytes)?;
        file.flush()?;
        file.sync_data().context("sync a checkpoint")?;
        tmp.persist(path).with_context(|| format!("rename a checkpoint to {}", path.display()))?;
        Ok(start + header.data_bytes)
    }
}

/// Removes the temporary files of writes cut short (an engine stopped
/// while writing) from `dir`; one younger than ten minutes may be another
/// engine's write in progress and is left alone.
fn remove_stale_temporaries(dir: &Path) {
    let cutoff = std::time::SystemTime::now() - std::time::Duration::from_secs(600);
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let stale = e.file_name().to_string_lossy().starts_with(".granary-ckpt-")
            && e.metadata().ok().and_then(|m| m.modified().ok()).is_some_and(|t| t < cutoff);
        if stale {
            let _ = std::fs::remove_file(e.path());
        }
    }
}

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
    let (ropes, rope_of) = super::weights::ropes(&cfg, context_len, &opts.device)?;
    let embed = if parts.has("embed.rows") {
        match parts.take("embed.rows")? {
            Buf::Quant(b, g, dims) => Embedding::Rows(Box::new(b.into_qtensor(g, dims, &candle_core::Device::Cpu)?)),
            _ => bail!("embed.rows is not quantized"),
        }
    } else {
        Embedding::Dense(parts.tensor("embed")?)
    };
    super::weights::check_embedding(&cfg, embed.dims())?;
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

#[cfg(test)]
mod tests;

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

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};

use super::qmatmul::Q8Matrix;
use super::LoadOptions;

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

fn header_bytes(h: &Header) -> Result<Vec<u8>> {
    Ok(serde_json::to_vec(h)?)
}

fn data_start(header_len: usize) -> u64 {
    ((PREFIX + header_len) as u64).next_multiple_of(DATA_ALIGN)
}

mod read;
mod write;

pub(crate) use read::load;

#[cfg(test)]
mod tests;

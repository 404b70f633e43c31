//! Writing a checkpoint: every buffer of a converted model, in place.

use std::borrow::Cow;
use std::collections::HashMap;
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::Path;

use anyhow::{bail, ensure, Context, Result};
use candle_core::quantized::{QMatMul, QTensor};
use candle_core::{DType, Tensor};

use crate::model::linear::{Linear, Proj, Weights};
use crate::model::{config, Embedding, Model};

use super::*;

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

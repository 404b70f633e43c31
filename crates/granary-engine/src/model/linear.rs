//! How the engine holds a weight matrix and multiplies by it: int8 or
//! 4-bit tiles (CPUs with AVX-512 VNNI), a dense f32 copy (with a Q8_0 one
//! for few-row matmuls where `GRANARY_QUANT_MAX_ROWS` asks for it), or the
//! file's quantized tensor as stored.
//!
//! [`hold`] chooses for a GGUF tensor: Q4_0, Q4_1 and Q4_K go into 4-bit
//! tiles exactly as stored; the other K-quants (and Q4_0/Q4_K where tiles
//! cannot run) stay as stored and are multiplied by GGML's kernels (as
//! candle implements them), so neither gets a second, lossier copy; the
//! rest (F32, F16, BF16, Q8_0, Q5_0, Q5_1) is converted to int8 tiles or
//! dense f32.

use anyhow::{bail, ensure, Result};
use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
use candle_core::{DType, Module, Tensor};

use super::blocks4;
use super::qmatmul;

/// The version of [`hold`]'s rules, part of a checkpoint's key: weights
/// converted under other rules are converted again.
pub(super) const HOLD_RULES: u32 = 2;

/// How a weight stored in a GGUF is held (see the module's text).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Hold {
    /// 4-bit tiles built from the stored blocks.
    Int4Exact,
    /// The stored tensor, multiplied by GGML's kernel for its type.
    Stored,
    /// Dequantized, then int8 tiles or dense f32 ([`Linear::new`]).
    Convert,
}

/// Where a weight's matmuls run and whether they may use quantized
/// weights.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Target {
    /// Dense f32 only (on the host, or the tensor path on any device).
    Dense,
    /// Quantized on the host, with the engine's tiles or GGML's kernels.
    HostQuantized,
    /// Quantized on an accelerator: every block-quantized GGUF type stays
    /// as stored and is multiplied by candle's device kernels for it
    /// (dequantizing on the device where a batch is large), so the
    /// device holds the file's bits and no f32 copy.
    DeviceQuantized,
}

/// How a `[n, k]` weight stored as `dtype` is held for matmuls on `target`.
pub(super) fn hold(dtype: GgmlDType, n: usize, k: usize, target: Target) -> Hold {
    match target {
        Target::Dense => return Hold::Convert,
        Target::DeviceQuantized => {
            let float = matches!(dtype, GgmlDType::F32 | GgmlDType::F16 | GgmlDType::BF16);
            return if float || !k.is_multiple_of(dtype.block_size()) { Hold::Convert } else { Hold::Stored };
        }
        Target::HostQuantized => {}
    }
    let tiles = qmatmul::Q8Matrix::supported() && qmatmul::Q8Matrix::fits(n, k) && int4_enabled();
    let k_quant = matches!(dtype, GgmlDType::Q2K | GgmlDType::Q3K | GgmlDType::Q4K | GgmlDType::Q5K | GgmlDType::Q6K);
    if tiles && blocks4::is_4bit(dtype) {
        Hold::Int4Exact
    } else if (k_quant || dtype == GgmlDType::Q4_0) && k.is_multiple_of(dtype.block_size()) {
        Hold::Stored
    } else {
        Hold::Convert
    }
}

/// Matmuls with at most this many rows use a Q8_0 copy of a dense weight
/// (`GRANARY_QUANT_MAX_ROWS`; 0, the default, keeps no copy). Off by
/// default: on a CPU without AVX-512 VNNI (AVX2 only, where a Q4_1 model's
/// weights are held dense), decoding through the copy turned the default
/// model's answers into nonsense, where the dense weights give the right
/// ones.
fn quant_max_rows() -> usize {
    static ROWS: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *ROWS.get_or_init(|| std::env::var("GRANARY_QUANT_MAX_ROWS").ok().and_then(|v| v.parse().ok()).unwrap_or(0))
}

/// How a weight matrix is held.
pub(super) enum Weights {
    /// Int8 tiles for every row count (CPUs with AVX-512 VNNI).
    Int8(qmatmul::Q8Matrix),
    /// 4-bit tiles instead of int8 ones, for weights stored as Q4_0, Q4_1
    /// or Q4_K (held exactly as stored, [`Hold::Int4Exact`]): a decode step
    /// reads half the bytes (about 20% faster), prefill is ~5% slower (the
    /// nibbles are unpacked). Used for every row count, so a row's result
    /// never depends on what it is batched with.
    Int4(qmatmul::Q4Matrix),
    /// Dense f32 for multi-row matmuls (gemm), with a Q8_0 copy for
    /// few-row ones when asked for (bound by memory bandwidth).
    Dense { dense: Tensor, quant: Option<QMatMul> },
    /// The file's quantized tensor as stored, in every matmul.
    Stored(QMatMul),
}

pub(super) struct Linear {
    pub(super) w: Weights,
    pub(super) bias: Option<Tensor>,
}

impl Linear {
    /// A weight from its values (f32, or f16/bf16 converted), held as int8
    /// tiles where they run, else dense (see [`Weights::Dense`]).
    pub(super) fn new(dense: Tensor, bias: Option<Tensor>, quantize: bool) -> Result<Self> {
        let (n, k) = dense.dims2()?;
        if quantize && dense.device().is_cpu() && qmatmul::Q8Matrix::supported() && qmatmul::Q8Matrix::fits(n, k) {
            let w = dense.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
            return Ok(Linear { w: Weights::Int8(qmatmul::Q8Matrix::quantize(&w, n, k)?), bias });
        }
        let quant = if quantize && quant_max_rows() > 0 && k % GgmlDType::Q8_0.block_size() == 0 {
            Some(QMatMul::from_qtensor(QTensor::quantize(&dense, GgmlDType::Q8_0)?)?)
        } else {
            None
        };
        Ok(Linear { w: Weights::Dense { dense, quant }, bias })
    }

    /// 4-bit tiles holding exactly the stored blocks of one or more
    /// tensors of `k` columns, stacked row-wise ([`Hold::Int4Exact`]).
    pub(super) fn int4_exact(parts: &[QTensor], bias: Option<Tensor>) -> Result<Self> {
        let mut blocks = Vec::new();
        let (mut n, mut k) = (0, None);
        for q in parts {
            let (rows, cols) = q.shape().dims2()?;
            ensure!(k.is_none_or(|k| k == cols), "stacked weights of {cols} columns, expected {k:?}");
            k = Some(cols);
            n += rows;
            blocks.extend(blocks4::blocks(q.dtype(), &q.data()?)?);
        }
        let w = qmatmul::Q4Matrix::from_blocks(&blocks, n, k.unwrap_or(0))?;
        Ok(Linear { w: Weights::Int4(w), bias })
    }

    pub(super) fn native(q: QTensor, bias: Option<Tensor>) -> Result<Self> {
        Ok(Linear { w: Weights::Stored(QMatMul::from_qtensor(q)?), bias })
    }

    /// Bytes of memory the weight (and its bias) is held in.
    pub(super) fn held_bytes(&self) -> usize {
        let tensor = |t: &Tensor| t.elem_count() * t.dtype().size_in_bytes();
        let w = match &self.w {
            Weights::Int8(w) => {
                let (_, _, qs, scales) = w.parts();
                qs.len() + 4 * scales.len()
            }
            Weights::Int4(w) => {
                let (_, _, qs, d, m) = w.parts();
                qs.len() + 4 * (d.len() + m.len())
            }
            Weights::Dense { dense, quant } => {
                tensor(dense)
                    + quant.as_ref().map_or(0, |q| match q {
                        QMatMul::QTensor(q) => q.storage_size_in_bytes(),
                        QMatMul::Tensor(t) | QMatMul::TensorF16(t) => tensor(t),
                    })
            }
            Weights::Stored(q) => match q {
                QMatMul::QTensor(q) => q.storage_size_in_bytes(),
                QMatMul::Tensor(t) | QMatMul::TensorF16(t) => tensor(t),
            },
        };
        w + self.bias.as_ref().map_or(0, tensor)
    }

    pub(super) fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let y = match &self.w {
            Weights::Int8(w8) => tiled(x, w8.in_features(), w8.out_features(), |xq, y| w8.matmul(xq, y))?,
            Weights::Int4(w4) => tiled(x, w4.in_features(), w4.out_features(), |xq, y| w4.matmul(xq, y))?,
            Weights::Dense { quant: Some(q), .. } if x.dim(0)? <= quant_max_rows() => q.forward(x)?,
            Weights::Dense { dense, .. } => x.matmul(&dense.t()?)?,
            Weights::Stored(q) => q.forward(x)?,
        };
        Ok(match &self.bias {
            Some(b) => y.broadcast_add(b)?,
            None => y,
        })
    }
}

/// `x wᵀ` through the engine's tiled kernel: `x` quantized per row and
/// block, then `matmul(xq, y)` fills the `[m, n_out]` result.
fn tiled(x: &Tensor, k_in: usize, n_out: usize, matmul: impl FnOnce(&qmatmul::Q8Rows, &mut [f32])) -> Result<Tensor> {
    let (m, k) = x.dims2()?;
    let (storage, lay) = x.storage_and_layout();
    let data: &[f32] = match (&*storage, lay.contiguous_offsets()) {
        (candle_core::Storage::Cpu(candle_core::CpuStorage::F32(v)), Some((a, b))) => &v[a..b],
        _ => bail!("matmul input is not a contiguous f32 host tensor"),
    };
    ensure!(k == k_in, "matmul input of width {k}, weights take {k_in}");
    let xq = qmatmul::Q8Rows::quantize(data, m, k);
    drop(storage);
    let mut y = vec![0f32; m * n_out];
    matmul(&xq, &mut y);
    Ok(Tensor::from_vec(y, (m, n_out), x.device())?)
}

/// Projections of the same input whose outputs are used side by side: one
/// matmul over concatenated weights, or (weights kept as stored) several.
pub(super) enum Proj {
    Fused(Linear),
    Split(Vec<Linear>),
}

impl Proj {
    pub(super) fn held_bytes(&self) -> usize {
        match self {
            Proj::Fused(l) => l.held_bytes(),
            Proj::Split(ls) => ls.iter().map(Linear::held_bytes).sum(),
        }
    }

    /// Outputs concatenated along the last dimension.
    pub(super) fn forward(&self, x: &Tensor) -> Result<Tensor> {
        match self {
            Proj::Fused(l) => l.forward(x),
            Proj::Split(ls) => {
                let outs = ls.iter().map(|l| l.forward(x)).collect::<Result<Vec<_>>>()?;
                Ok(Tensor::cat(&outs, 1)?)
            }
        }
    }
}

/// 4-bit decode tiles are on unless `GRANARY_INT4=0`.
pub(super) fn int4_enabled() -> bool {
    std::env::var_os("GRANARY_INT4").is_none_or(|v| v != "0")
}

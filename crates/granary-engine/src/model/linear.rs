//! How the engine holds a weight matrix and multiplies by it: int8 or
//! 4-bit tiles (CPUs with AVX-512 VNNI), a dense f32 copy with a Q8_0 one
//! for few-row matmuls, or the file's quantized tensor as stored.

use anyhow::{bail, ensure, Result};
use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
use candle_core::{DType, Module, Tensor};

use super::qmatmul;

/// Matmuls with at most this many rows use the quantized copy
/// (`GRANARY_QUANT_MAX_ROWS` overrides it).
fn quant_max_rows() -> usize {
    static ROWS: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *ROWS.get_or_init(|| std::env::var("GRANARY_QUANT_MAX_ROWS").ok().and_then(|v| v.parse().ok()).unwrap_or(4))
}

pub(super) struct Linear {
    pub(super) dense: Option<Tensor>,
    pub(super) quant: Option<QMatMul>,
    /// Int8 tiles for every row count (CPUs with AVX-512 VNNI).
    pub(super) int8: Option<qmatmul::Q8Matrix>,
    /// 4-bit tiles instead of int8 ones, for weights stored as Q4_1 (they
    /// come back exactly): a decode step reads half the bytes (about 20%
    /// faster), prefill is ~5% slower (the nibbles are unpacked). Used for
    /// every row count, so a row's result never depends on what it is
    /// batched with.
    pub(super) int4: Option<qmatmul::Q4Matrix>,
    pub(super) bias: Option<Tensor>,
}

impl Linear {
    /// `four_bit`: the weights were stored as Q4_1 (see [`Linear::int4`]).
    pub(super) fn new(dense: Tensor, bias: Option<Tensor>, quantize: bool, four_bit: bool) -> Result<Self> {
        let (n, k) = dense.dims2()?;
        if quantize && dense.device().is_cpu() && qmatmul::Q8Matrix::supported() && qmatmul::Q8Matrix::fits(n, k) {
            let w = dense.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
            if four_bit && int4_enabled() {
                let int4 = Some(qmatmul::Q4Matrix::quantize(&w, n, k)?);
                return Ok(Linear { dense: None, quant: None, int8: None, int4, bias });
            }
            let int8 = Some(qmatmul::Q8Matrix::quantize(&w, n, k)?);
            return Ok(Linear { dense: None, quant: None, int8, int4: None, bias });
        }
        let quant = if quantize && k % GgmlDType::Q8_0.block_size() == 0 {
            Some(QMatMul::from_qtensor(QTensor::quantize(&dense, GgmlDType::Q8_0)?)?)
        } else {
            None
        };
        Ok(Linear { dense: Some(dense), quant, int8: None, int4: None, bias })
    }

    pub(super) fn native(q: QTensor, bias: Option<Tensor>) -> Result<Self> {
        Ok(Linear { dense: None, quant: Some(QMatMul::from_qtensor(q)?), int8: None, int4: None, bias })
    }

    pub(super) fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let tiles = match (&self.int4, &self.int8) {
            (Some(w4), _) => Some((w4.in_features(), w4.out_features())),
            (None, Some(w8)) => Some((w8.in_features(), w8.out_features())),
            (None, None) => None,
        };
        if let Some((k_in, n_out)) = tiles {
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
            match (&self.int4, &self.int8) {
                (Some(w4), _) => w4.matmul(&xq, &mut y),
                (None, Some(w8)) => w8.matmul(&xq, &mut y),
                (None, None) => unreachable!("checked above"),
            }
            let y = Tensor::from_vec(y, (m, n_out), x.device())?;
            return Ok(match &self.bias {
                Some(b) => y.broadcast_add(b)?,
                None => y,
            });
        }
        let y = match (&self.quant, &self.dense) {
            (Some(q), Some(_)) if x.dim(0)? <= quant_max_rows() => q.forward(x)?,
            (_, Some(d)) => x.matmul(&d.t()?)?,
            (Some(q), None) => q.forward(x)?,
            (None, None) => unreachable!("a linear layer holds weights"),
        };
        Ok(match &self.bias {
            Some(b) => y.broadcast_add(b)?,
            None => y,
        })
    }
}

/// Projections of the same input whose outputs are used side by side: one
/// matmul over concatenated weights, or (weights kept as stored) several.
pub(super) enum Proj {
    Fused(Linear),
    Split(Vec<Linear>),
}

impl Proj {
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
fn int4_enabled() -> bool {
    std::env::var_os("GRANARY_INT4").is_none_or(|v| v != "0")
}

//! GGML's 4-bit formats read block by block, so the engine's 4-bit tiles
//! ([`super::qmatmul::Q4Matrix`]) hold exactly the weights a GGUF stored:
//! Q4_0 (`d · (q − 8)`), Q4_1 (`d · q + m`) and Q4_K (eight 32-weight
//! sub-blocks of a 256-weight super-block, each `d · sc · q − dmin · mn`
//! with 6-bit `sc` and `mn`). Every one of them is `d · q + m` per 32
//! weights with `q` in 0..=15, which is what a tile block holds; the scales
//! are computed in f32 as GGML's own dequantization computes them.

use anyhow::{bail, ensure, Result};
use candle_core::quantized::GgmlDType;
use half::f16;

/// Weights per block.
pub(crate) const BLOCK: usize = 32;

/// 32 weights `d · q[i] + m`.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Block4 {
    pub(crate) d: f32,
    pub(crate) m: f32,
    pub(crate) q: [u8; BLOCK],
}

/// Whether tensors of `dtype` are read exactly by [`blocks`].
pub(crate) fn is_4bit(dtype: GgmlDType) -> bool {
    matches!(dtype, GgmlDType::Q4_0 | GgmlDType::Q4_1 | GgmlDType::Q4K)
}

fn half(b: &[u8]) -> f32 {
    f16::from_le_bytes([b[0], b[1]]).to_f32()
}

/// Q4_0 and Q4_1 keep weight `j` in the low nibble of byte `j` and weight
/// `j + 16` in its high nibble.
fn nibbles_split(qs: &[u8]) -> [u8; BLOCK] {
    let mut q = [0u8; BLOCK];
    for (j, b) in qs.iter().enumerate().take(BLOCK / 2) {
        q[j] = b & 0x0f;
        q[j + BLOCK / 2] = b >> 4;
    }
    q
}

/// The 6-bit scale and min of Q4_K sub-block `j` (0..8) from the 12 bytes
/// that pack them.
fn scale_min_k4(j: usize, s: &[u8]) -> (u8, u8) {
    if j < 4 {
        (s[j] & 63, s[j + 4] & 63)
    } else {
        ((s[j + 4] & 0x0f) | ((s[j - 4] >> 6) << 4), (s[j + 4] >> 4) | ((s[j] >> 6) << 4))
    }
}

/// The blocks of a tensor's raw data in storage order (row after row, 32
/// weights at a time along the row).
pub(crate) fn blocks(dtype: GgmlDType, data: &[u8]) -> Result<Vec<Block4>> {
    let size = dtype.type_size();
    ensure!(data.len().is_multiple_of(size), "{dtype:?} data of {} bytes is not whole blocks", data.len());
    let mut out = Vec::with_capacity(data.len() / size * (dtype.block_size() / BLOCK));
    match dtype {
        GgmlDType::Q4_0 => {
            for b in data.chunks_exact(size) {
                let d = half(&b[0..2]);
                out.push(Block4 { d, m: -8.0 * d, q: nibbles_split(&b[2..18]) });
            }
        }
        GgmlDType::Q4_1 => {
            for b in data.chunks_exact(size) {
                out.push(Block4 { d: half(&b[0..2]), m: half(&b[2..4]), q: nibbles_split(&b[4..20]) });
            }
        }
        GgmlDType::Q4K => {
            for b in data.chunks_exact(size) {
                let (d, dmin) = (half(&b[0..2]), half(&b[2..4]));
                let (scales, qs) = (&b[4..16], &b[16..144]);
                // Four groups of 64 weights: 32 bytes, the first sub-block in
                // the low nibbles, the second in the high ones.
                for g in 0..4 {
                    let bytes = &qs[g * 32..][..32];
                    for (half_, shift) in [(0usize, 0u8), (1, 4)] {
                        let (sc, mn) = scale_min_k4(2 * g + half_, scales);
                        let mut q = [0u8; BLOCK];
                        for (i, byte) in bytes.iter().enumerate() {
                            q[i] = (byte >> shift) & 0x0f;
                        }
                        out.push(Block4 { d: d * sc as f32, m: -(dmin * mn as f32), q });
                    }
                }
            }
        }
        other => bail!("{other:?} is not a 4-bit block format"),
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::quantized::QTensor;
    use candle_core::{Device, Tensor};

    fn weights(n: usize) -> Vec<f32> {
        let mut s = 0x2545_f491_4f6c_dd1du64;
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                ((s >> 11) as f64 / (1u64 << 53) as f64 - 0.5) as f32 * 0.2
            })
            .collect()
    }

    /// The blocks give back exactly what GGML's dequantization (as
    /// candle implements it) gives for the same tensor.
    #[test]
    fn blocks_equal_ggml_dequantization_exactly() {
        let (rows, cols) = (8, 512);
        let w = Tensor::from_vec(weights(rows * cols), (rows, cols), &Device::Cpu).unwrap();
        for dtype in [GgmlDType::Q4_0, GgmlDType::Q4_1, GgmlDType::Q4K] {
            let q = QTensor::quantize(&w, dtype).unwrap();
            let want = q.dequantize(&Device::Cpu).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
            let got: Vec<f32> = blocks(dtype, &q.data().unwrap())
                .unwrap()
                .iter()
                .flat_map(|b| b.q.iter().map(move |&q| b.d * q as f32 + b.m))
                .collect();
            assert_eq!(got.len(), want.len(), "{dtype:?}");
            // Equal as numbers (a zero's sign may differ: `8d - 8d` is +0
            // where GGML's `(8 - 8) · d` is -0 for a negative `d`).
            let differ = got.iter().zip(&want).filter(|(a, b)| a != b).count();
            assert_eq!(differ, 0, "{dtype:?}: {differ} of {} weights differ", want.len());
        }
    }

    #[test]
    fn other_formats_are_refused_by_name() {
        let e = blocks(GgmlDType::Q8_0, &[0u8; 34]).unwrap_err().to_string();
        assert!(e.contains("Q8_0"), "{e}");
        assert!(!is_4bit(GgmlDType::Q5K) && !is_4bit(GgmlDType::Q6K) && is_4bit(GgmlDType::Q4K));
    }
}

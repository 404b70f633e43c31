// Attention over the engine's device KV pool (src/model/paged.rs has the
// same computation for the CPU and the description of every argument).
//
// One thread block per (query row, query head). Its warps split the keys
// the row may attend (warp w takes keys first + w, first + w + WARPS, ...);
// within a warp each lane holds head_dim / 32 of the dimensions. A key's
// score is the warp's sum of lane products, in f32 from the pool's f16 K;
// each warp keeps a running maximum, a running sum of exponentials and its
// weighted sum of V rows (online softmax), and the warps are merged at the
// end. Keys are read where they are in the pool, through the sequence's
// block table: nothing is gathered, padded or widened first.

#include <cuda_fp16.h>
#include <stdint.h>

#define WARPS 8
#define LANES 32
// head_dim at most LANES * PER_LANE.
#define PER_LANE 8

extern "C" __global__ void granary_paged_attention(
    float* __restrict__ out,                 // [rows, heads, head_dim]
    const float* __restrict__ q,             // [rows, heads, head_dim], scaled
    const __half* __restrict__ k_pool,       // [blocks, kv_heads, block_tokens, head_dim]
    const __half* __restrict__ v_pool,       // the same
    const uint32_t* __restrict__ tables,     // [seqs, max_blocks]
    const uint32_t* __restrict__ row_seq,    // [rows]
    const uint32_t* __restrict__ row_pos,    // [rows]
    const int heads,
    const int kv_heads,
    const int head_dim,
    const int block_tokens,
    const int max_blocks,
    const int window,        // 0: none
    const float softcap) {   // 0: none
  const int row = blockIdx.x;
  const int head = blockIdx.y;
  const int warp = threadIdx.x / LANES;
  const int lane = threadIdx.x % LANES;
  const int kvh = head / (heads / kv_heads);
  const size_t qo = ((size_t)row * heads + head) * head_dim;

  float qv[PER_LANE];
  float acc[PER_LANE];
#pragma unroll
  for (int i = 0; i < PER_LANE; ++i) {
    const int d = lane + LANES * i;
    qv[i] = d < head_dim ? q[qo + d] : 0.f;
    acc[i] = 0.f;
  }
  const uint32_t* table = tables + (size_t)row_seq[row] * max_blocks;
  const int pos = (int)row_pos[row];
  const int first = (window > 0 && pos + 1 > window) ? pos + 1 - window : 0;

  float m = -INFINITY;
  float l = 0.f;
  for (int t = first + warp; t <= pos; t += WARPS) {
    const size_t base =
        (((size_t)table[t / block_tokens] * kv_heads + kvh) * block_tokens + t % block_tokens) * head_dim;
    float s = 0.f;
#pragma unroll
    for (int i = 0; i < PER_LANE; ++i) {
      const int d = lane + LANES * i;
      if (d < head_dim) s += qv[i] * __half2float(k_pool[base + d]);
    }
#pragma unroll
    for (int o = LANES / 2; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    if (softcap > 0.f) s = softcap * tanhf(s / softcap);
    const float m2 = fmaxf(m, s);
    const float c = expf(m - m2);
    const float p = expf(s - m2);
    l = l * c + p;
#pragma unroll
    for (int i = 0; i < PER_LANE; ++i) {
      const int d = lane + LANES * i;
      const float v = d < head_dim ? __half2float(v_pool[base + d]) : 0.f;
      acc[i] = acc[i] * c + p * v;
    }
    m = m2;
  }

  __shared__ float warp_m[WARPS];
  __shared__ float warp_l[WARPS];
  __shared__ float warp_acc[WARPS][LANES * PER_LANE];
  if (lane == 0) {
    warp_m[warp] = m;
    warp_l[warp] = l;
  }
#pragma unroll
  for (int i = 0; i < PER_LANE; ++i) warp_acc[warp][lane + LANES * i] = acc[i];
  __syncthreads();
  if (warp != 0) return;

  float top = -INFINITY;
  for (int w = 0; w < WARPS; ++w) top = fmaxf(top, warp_m[w]);
  float sum = 0.f;
  float o[PER_LANE];
#pragma unroll
  for (int i = 0; i < PER_LANE; ++i) o[i] = 0.f;
  for (int w = 0; w < WARPS; ++w) {
    if (warp_l[w] == 0.f) continue;  // a warp that had no key
    const float c = expf(warp_m[w] - top);
    sum += warp_l[w] * c;
#pragma unroll
    for (int i = 0; i < PER_LANE; ++i) o[i] += warp_acc[w][lane + LANES * i] * c;
  }
#pragma unroll
  for (int i = 0; i < PER_LANE; ++i) {
    const int d = lane + LANES * i;
    if (d < head_dim) out[qo + d] = o[i] / sum;
  }
}

// Decode attention for float32 on CUDA cores: correct, not tuned (fp16/bf16 take the tensor-core kernel).
// Torch-free. Same grid and split-K output as the tensor-core kernel: one thread block per (sequence,
// KV head, row group, partition) serving up to kFp32Rows query heads of the group; K/V tiles of 32 tokens
// staged in shared memory; the output accumulator lives in shared memory.
#pragma once

#include <math.h>

#include "common/dtype_traits.cuh"
#include "attention/paged_attention.h"
#include "attention/paged_attention_rows.cuh"
#include "common/ptx.cuh"

namespace tpkit {

constexpr int kFp32Tile = 32;
constexpr int kFp32Rows = 32;
constexpr int kFp32Threads = 128;

// Shared memory of the float32 kernel, in floats.
__host__ __device__ constexpr int fp32_smem_floats(int rows, int head) {
  return 2 * rows * head                  // q, o
         + kFp32Tile * (head + 1)         // k (padded: conflict-free row-wise dot products)
         + kFp32Tile * head               // v
         + rows * kFp32Tile               // p
         + 4 * rows;                      // m, l, correction, slope
}

template <int HEAD>
__global__ void __launch_bounds__(kFp32Threads) paged_attention_fp32_kernel(const tpkit_paged_attention_args p) {
  static_assert(HEAD % 4 == 0, "head size must be a multiple of 4");
  constexpr int KS = HEAD + 1;
  extern __shared__ float4 smem_f4[];
  float* smem = reinterpret_cast<float*>(smem_f4);
  // KV heads vary fastest, so the blocks reading the same pages (one per KV head) run side by side.
  const bool multi = p.query_start_loc != nullptr;
  const BlockCoords coords = multi ? block_coords<true>(p) : block_coords<false>(p);
  const int kv_head = coords.kv_head;
  const int partition = blockIdx.y;
  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int rows = p.rows_per_cta;
  const int first_head = coords.m_group * rows;  // within the group
  const int group_heads = min(rows, p.group_size - first_head);
  const int head0 = kv_head * p.group_size + first_head;

  // Clamped to the table's capacity: a bad length must not read past the sequence's table row.
  QueryRows qr = multi ? tile_rows(p, coords.item, head0, group_heads) : decode_rows(p, coords.item, head0, group_heads);
  if (!multi) qr.set_seq_len(min(p.seq_lens[coords.item], p.max_blocks_per_seq << p.block_size_log2));
  if (qr.seq < 0) return;  // the whole block: past the batch's work tiles
  const int seq = qr.seq;
  const int rows_valid = qr.rows_valid;
  const int seq_len = qr.seq_len;
  const int start = partition * p.partition_size + keys_start(qr.first_pos, p.window_size, p.block_size_log2);
  const int end = min(start + p.partition_size, qr.key_end());
  const int first_key = qr.key_begin();  // keys before it are no row's: never read
  const bool split = p.num_partitions > 1;
  // The merge kernel reads a decode sequence's partitions that hold tokens, and every partition of a row with
  // several tokens a sequence.
  if (split && !multi && start >= seq_len) return;

  float* q_s = smem;                        // [rows][HEAD]
  float* o_s = q_s + rows * HEAD;           // [rows][HEAD]
  float* v_s = o_s + rows * HEAD;           // [kFp32Tile][HEAD] (16-byte aligned: float4 stores)
  float* k_s = v_s + kFp32Tile * HEAD;      // [kFp32Tile][KS]
  float* p_s = k_s + kFp32Tile * KS;        // [rows][kFp32Tile]
  float* m_s = p_s + rows * kFp32Tile;      // [rows]
  float* l_s = m_s + rows;
  float* c_s = l_s + rows;
  float* slope_s = c_s + rows;

  const float* query = static_cast<const float*>(p.query);
  for (int i = tid; i < rows * HEAD; i += blockDim.x) {
    const int r = i / HEAD;
    const int d = i - r * HEAD;
    q_s[i] = r < rows_valid ? query[qr.row(r) * p.q_stride_seq + static_cast<int64_t>(qr.head(r)) * p.q_stride_head + d]
                            : 0.f;
    o_s[i] = 0.f;
  }
  for (int r = tid; r < rows; r += blockDim.x) {
    m_s[r] = -INFINITY;
    l_s[r] = 0.f;
    slope_s[r] = (p.alibi_slopes != nullptr && r < rows_valid) ? p.alibi_slopes[qr.head(r)] * kLog2e : 0.f;
  }

  const float* k_base = static_cast<const float*>(p.key_cache) + static_cast<int64_t>(kv_head) * p.kc_stride_head;
  const float* v_base = static_cast<const float*>(p.value_cache) + static_cast<int64_t>(kv_head) * p.vc_stride_head;
  const int* bt_row = p.block_tables + static_cast<int64_t>(seq) * p.bt_stride;
  const int bs_mask = (1 << p.block_size_log2) - 1;

  for (int tile_start = start; tile_start < end; tile_start += kFp32Tile) {
    __syncthreads();  // previous tile's k/v/p fully consumed (and the initialisation above visible)
    for (int i = tid; i < kFp32Tile * (HEAD / 4); i += blockDim.x) {
      const int t = i / (HEAD / 4);
      const int c = i - t * (HEAD / 4);
      const int pos = tile_start + t;
      const int page = pos < end && pos >= first_key ? __ldg(bt_row + (pos >> p.block_size_log2)) : -1;
      float4 kv = make_float4(0.f, 0.f, 0.f, 0.f);
      float4 vv = kv;
      if (static_cast<unsigned>(page) < static_cast<unsigned>(p.num_blocks)) {
        const int64_t off = pos & bs_mask;
        kv = __ldg(reinterpret_cast<const float4*>(k_base + page * p.kc_stride_block + off * p.kc_stride_token) + c);
        vv = __ldg(reinterpret_cast<const float4*>(v_base + page * p.vc_stride_block + off * p.vc_stride_token) + c);
      }
      float* kr = k_s + t * KS + c * 4;
      kr[0] = kv.x;
      kr[1] = kv.y;
      kr[2] = kv.z;
      kr[3] = kv.w;
      reinterpret_cast<float4*>(v_s + t * HEAD)[c] = vv;
    }
    __syncthreads();
    // Scores: a warp takes one row and 32 tokens, one token a lane.
    for (int i = tid; i < rows * kFp32Tile; i += blockDim.x) {
      const int r = i / kFp32Tile;
      const int t = i - r * kFp32Tile;
      const float* q_row = q_s + r * HEAD;
      const float* k_row = k_s + t * KS;
      float dot = 0.f;
#pragma unroll 8
      for (int d = 0; d < HEAD; ++d) dot = fmaf(q_row[d], k_row[d], dot);
      const int pos = tile_start + t;
      const float logit = p.soft_cap_log2 > 0.f ? p.soft_cap_log2 * tanhf(dot * p.soft_cap_scale) : dot * p.scale_log2;
      const bool seen = pos < min(end, qr.end(r)) && pos >= qr.begin(r);
      p_s[i] = seen ? fmaf(slope_s[r], static_cast<float>(pos) - qr.position(r), logit) : -INFINITY;
    }
    __syncthreads();
    // Online softmax, a warp per row.
    for (int r = warp; r < rows; r += blockDim.x >> 5) {
      const float s = p_s[r * kFp32Tile + lane];
      float mx = s;
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
      const float m_old = m_s[r];
      const float m_new = fmaxf(m_old, mx);
      const float m_use = m_new == -INFINITY ? 0.f : m_new;
      const float e = fast_exp2(s - m_use);
      float sum = e;
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
      p_s[r * kFp32Tile + lane] = e;
      if (lane == 0) {
        const float corr = fast_exp2(m_old - m_use);
        c_s[r] = corr;
        l_s[r] = l_s[r] * corr + sum;
        m_s[r] = m_new;
      }
    }
    __syncthreads();
    for (int i = tid; i < rows * HEAD; i += blockDim.x) {
      const int r = i / HEAD;
      const int d = i - r * HEAD;
      const float* pr = p_s + r * kFp32Tile;
      float acc = o_s[i] * c_s[r];
#pragma unroll 8
      for (int t = 0; t < kFp32Tile; ++t) acc = fmaf(pr[t], v_s[t * HEAD + d], acc);
      o_s[i] = acc;
    }
  }
  __syncthreads();
  // Zeros only where the row sees no key of the partition: a NaN sum (a NaN key, value or query) stays NaN.
  for (int i = tid; i < rows_valid * HEAD; i += blockDim.x) {
    const int r = i / HEAD;
    const int d = i - r * HEAD;
    const bool attended = qr.attends(r, start, end);
    const int head = qr.head(r);
    // The sink joins the denominator once: here unsplit, else where the partitions merge.
    const float sum = split ? l_s[r] : with_sink(l_s[r], m_s[r], sink_log2(p, head));
    const float val = attended ? o_s[i] / sum : 0.f;
    if (!split) {
      float* out = static_cast<float*>(p.out) + qr.row(r) * p.o_stride_seq + static_cast<int64_t>(head) * p.o_stride_head;
      out[d] = val;
    } else {
      const int64_t row_index = (qr.row(r) * p.num_heads + head) * p.num_partitions + partition;
      p.tmp_out[row_index * HEAD + d] = val;
      if (d == 0) p.tmp_lse[row_index] = attended ? m_s[r] + log2f(sum) : -INFINITY;
    }
  }
}

}  // namespace tpkit

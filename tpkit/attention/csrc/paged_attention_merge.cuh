// Split-K merge: combines a sequence's partition results, each normalised with its own log-sum-exp, into
// the output. One thread block per (query head, sequence). Torch-free.
#pragma once

#include <math.h>

#include "dtype_traits.cuh"
#include "paged_attention.h"
#include "ptx.cuh"

namespace tpkit {

constexpr int kMergeThreads = 128;
constexpr int kMergeVecsPerLane = 2;  // float4 columns per lane: head sizes up to 256

template <bool kMax>
__device__ __forceinline__ float block_reduce(float v, float* scratch) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float other = __shfl_xor_sync(0xffffffffu, v, o);
    v = kMax ? fmaxf(v, other) : v + other;
  }
  const int warp = threadIdx.x >> 5;
  const int num_warps = blockDim.x >> 5;
  __syncthreads();  // scratch may still be read by a previous reduction
  if ((threadIdx.x & 31) == 0) scratch[warp] = v;
  __syncthreads();
  float r = scratch[0];
  for (int w = 1; w < num_warps; ++w) r = kMax ? fmaxf(r, scratch[w]) : r + scratch[w];
  return r;
}

template <typename T>
__global__ void __launch_bounds__(kMergeThreads) paged_attention_merge_kernel(const tpkit_paged_attention_args p) {
  using Traits = DTypeTraits<T>;
  extern __shared__ float weights[];  // [num_partitions]
  __shared__ float scratch[kMergeThreads / 32];
  const int head = blockIdx.x;
  const int seq = blockIdx.y;
  const int head_size = p.head_size;
  T* out = static_cast<T*>(p.out) + static_cast<int64_t>(seq) * p.o_stride_seq + static_cast<int64_t>(head) * p.o_stride_head;
  // Clamped to the table's capacity: a bad length must not read past the sequence's table row.
  const int seq_len = min(p.seq_lens[seq], p.max_blocks_per_seq << p.block_size_log2);
  // Partitions past the end were not written (their thread blocks exited at once).
  const int used = seq_len > 0 ? min(p.num_partitions, (seq_len + p.partition_size - 1) / p.partition_size) : 0;
  if (used == 0) {
    for (int d = threadIdx.x; d < head_size; d += blockDim.x) out[d] = Traits::from_float(0.f);
    return;
  }
  const int64_t row_index = (static_cast<int64_t>(seq) * p.num_heads + head) * p.num_partitions;
  const float* lse = p.tmp_lse + row_index;
  float mx = -INFINITY;
  for (int i = threadIdx.x; i < used; i += blockDim.x) mx = fmaxf(mx, lse[i]);
  mx = block_reduce<true>(mx, scratch);
  float sum = 0.f;
  for (int i = threadIdx.x; i < used; i += blockDim.x) {
    const float w = (mx == -INFINITY || lse[i] == -INFINITY) ? 0.f : fast_exp2(lse[i] - mx);
    weights[i] = w;
    sum += w;
  }
  sum = block_reduce<false>(sum, scratch);  // its barriers also publish `weights`
  const float inv = sum > 0.f ? 1.f / sum : 0.f;
  // Each warp sums every num_warps-th partition, a lane taking 4 columns (two float4 for head 256), so a
  // warp reads one partition row per instruction and several rows are in flight; then warps are summed.
  const float* parts = p.tmp_out + row_index * head_size;
  const int vecs = head_size / 4;
  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
  const int num_warps = blockDim.x >> 5;
  float4 acc[kMergeVecsPerLane];
#pragma unroll
  for (int k = 0; k < kMergeVecsPerLane; ++k) acc[k] = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 4
  for (int i = warp; i < used; i += num_warps) {
    const float w = weights[i];
    if (w == 0.f) continue;
    const float4* row = reinterpret_cast<const float4*>(parts + static_cast<int64_t>(i) * head_size);
#pragma unroll
    for (int k = 0; k < kMergeVecsPerLane; ++k) {
      const int v = lane + 32 * k;
      if (v < vecs) {
        const float4 x = row[v];
        acc[k].x = fmaf(w, x.x, acc[k].x);
        acc[k].y = fmaf(w, x.y, acc[k].y);
        acc[k].z = fmaf(w, x.z, acc[k].z);
        acc[k].w = fmaf(w, x.w, acc[k].w);
      }
    }
  }
  __shared__ float4 partial[kMergeThreads / 32][kMergeVecsPerLane * 32];
#pragma unroll
  for (int k = 0; k < kMergeVecsPerLane; ++k) partial[warp][lane + 32 * k] = acc[k];
  __syncthreads();
  for (int v = threadIdx.x; v < vecs; v += blockDim.x) {
    float4 total = partial[0][v];
    for (int w = 1; w < num_warps; ++w) {
      total.x += partial[w][v].x;
      total.y += partial[w][v].y;
      total.z += partial[w][v].z;
      total.w += partial[w][v].w;
    }
    out[4 * v + 0] = Traits::from_float(total.x * inv);
    out[4 * v + 1] = Traits::from_float(total.y * inv);
    out[4 * v + 2] = Traits::from_float(total.z * inv);
    out[4 * v + 3] = Traits::from_float(total.w * inv);
  }
}

}  // namespace tpkit

// Split-K merge: combines a query row's partition results, each normalised with its own log-sum-exp, into
// the output. The merge kernel: one warp per (query row, query head): the partitions' weights come from warp
// shuffles, with no block-wide barrier, and each lane sums four columns over every partition with float4
// loads, several partitions in flight. On Hopper the partitions of a thread-block cluster merge instead in
// the attention kernel's epilogue, through distributed shared memory (merge_in_cluster). Torch-free.
#pragma once

#include <math.h>

#include "common/dtype_traits.cuh"
#include "attention/paged_attention.h"
#include "attention/paged_attention_dispatch.h"
#include "attention/paged_attention_rows.cuh"
#include "common/ptx.cuh"

namespace tpkit {

constexpr int kMergeThreads = 128;
constexpr int kMergeRowsPerBlock = kMergeThreads / 32;

template <bool kMax>
__device__ __forceinline__ float warp_reduce(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float other = __shfl_xor_sync(0xffffffffu, v, o);
    v = kMax ? fmaxf(v, other) : v + other;
  }
  return v;
}

// PREFETCH: partitions whose results a lane loads before their weights are known (launch_merge picks it).
template <typename T, int PREFETCH>
__global__ void __launch_bounds__(kMergeThreads) paged_attention_merge_kernel(const tpkit_paged_attention_args p) {
  extern __shared__ float weights_s[];  // [kMergeRowsPerBlock][num_partitions]
  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
  const int head = blockIdx.x * kMergeRowsPerBlock + warp;
  const int query_row = blockIdx.y;  // decode: the sequence
  // Decode: partitions past the sequence's end were not written (their thread blocks exited at once).
  // seq_lens is the op's input, not the attention grid's output: read while that grid drains. Clamped to
  // the table's capacity: a bad length must not read past the sequence's table row. With several tokens a
  // sequence every partition writes each of its rows.
  // With a window a decode row's partitions start at the window's first block, as in the attention kernels.
  int used = p.num_partitions;
  if (p.query_start_loc == nullptr) {
    const int seq_len = min(p.seq_lens[query_row], p.max_blocks_per_seq << p.block_size_log2);
    const int keys = seq_len - keys_start(seq_len - 1, p.window_size, p.block_size_log2);
    used = seq_len > 0 ? min(p.num_partitions, (keys + p.partition_size - 1) / p.partition_size) : 0;
  }
  // Every block waits, even one with nothing to merge: the grid must not finish before the attention grid.
  grid_wait_primary();
  if (head >= p.num_heads) return;  // a whole warp: nothing below synchronises more than one warp
  const int vecs = p.head_size / 4;  // head sizes are multiples of 8
  T* out = static_cast<T*>(p.out) + static_cast<int64_t>(query_row) * p.o_stride_seq + static_cast<int64_t>(head) * p.o_stride_head;
  if (used == 0) {
    for (int v = lane; v < vecs; v += 32) store4(out + 4 * v, make_float4(0.f, 0.f, 0.f, 0.f));
    return;
  }
  const int64_t row_index = (static_cast<int64_t>(query_row) * p.num_heads + head) * p.num_partitions;
  const float* lse = p.tmp_lse + row_index;
  const float4* parts = reinterpret_cast<const float4*>(p.tmp_out + row_index * p.head_size);
  float lane_lse = lane < used ? lse[lane] : -INFINITY;
  // The first partitions' results for the lane's first four columns are asked for with the log-sum-exps,
  // not after the weights: one round trip to L2 rather than two.
  float4 first[PREFETCH];
#pragma unroll
  for (int i = 0; i < PREFETCH; ++i) {
    first[i] = i < used && lane < vecs ? parts[static_cast<int64_t>(i) * vecs + lane] : make_float4(0.f, 0.f, 0.f, 0.f);
  }
  float mx = lane_lse;
  for (int i = lane + 32; i < used; i += 32) mx = fmaxf(mx, lse[i]);
  mx = warp_reduce<true>(mx);
  float* weights = weights_s + warp * p.num_partitions;
  float sum = 0.f;
  for (int i = lane; i < used; i += 32) {
    const float l = i == lane ? lane_lse : lse[i];
    const float w = (mx == -INFINITY || l == -INFINITY) ? 0.f : fast_exp2(l - mx);
    weights[i] = w;
    sum += w;
  }
  sum = with_sink(warp_reduce<false>(sum), mx, sink_log2(p, head));
  __syncwarp();  // publishes `weights` to the warp
  // At least one partition holds keys (used > 0): a NaN sum stays NaN rather than becoming zeros.
  const float inv = 1.f / sum;
  for (int v = lane; v < vecs; v += 32) {
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    int i = 0;
    if (v == lane) {
#pragma unroll
      for (int j = 0; j < PREFETCH; ++j) {
        fma4(j < used ? weights[j] : 0.f, first[j], acc);
      }
      i = PREFETCH;
    }
#pragma unroll 4
    for (; i < used; ++i) {
      fma4(weights[i], parts[static_cast<int64_t>(i) * vecs + v], acc);
    }
    store4(out + 4 * v, make_float4(acc.x * inv, acc.y * inv, acc.z * inv, acc.w * inv));
  }
}

// merge_in_cluster's work: a thread takes ITEMS items at a time, eight (partition, item) pairs whatever
// the cluster's size (PARTS >= num_parts), and issues all their loads (every partition's log-sum-exp and
// 16 bytes of values) before using any, so a round costs one round trip to the other blocks' shared memory.
template <int HEAD, typename P, int PARTS, typename RowOut, typename OutRow, typename RowSink>
__device__ __forceinline__ void merge_items(int num_parts, bool attended, int rows_valid, const float* row_lse,
                                            RowOut row_out, OutRow out_row, RowSink row_sink) {
  constexpr int kPerLoad = 16 / static_cast<int>(sizeof(P));  // columns an item
  constexpr int kVecs = HEAD / kPerLoad;
  constexpr int ITEMS = kMaxClusterSize / PARTS;
  const int items = rows_valid * kVecs;
  const int stride = num_parts * blockDim.x;
  for (int first = cluster_rank() * blockDim.x + threadIdx.x; first < items; first += ITEMS * stride) {
    float lse[ITEMS][PARTS];
    uint4 x[ITEMS][PARTS];
#pragma unroll
    for (int k = 0; k < ITEMS; ++k) {
      const int i = first + k * stride;
      if (i >= items) continue;
      const int r = i / kVecs;
      const uint32_t lse_addr = smem_addr(row_lse + r);
      const uint32_t o_addr = smem_addr(row_out(r) + (i - r * kVecs) * kPerLoad);
#pragma unroll
      for (int c = 0; c < PARTS; ++c) {
        if (c < num_parts) {
          lse[k][c] = cluster_load(cluster_map(lse_addr, c));
          x[k][c] = cluster_load16(cluster_map(o_addr, c));
        }
      }
    }
#pragma unroll
    for (int k = 0; k < ITEMS; ++k) {
      const int i = first + k * stride;
      if (i >= items) continue;
      float mx = -INFINITY;
#pragma unroll
      for (int c = 0; c < PARTS; ++c) {
        if (c < num_parts) mx = fmaxf(mx, lse[k][c]);
      }
      float acc[kPerLoad] = {};
      float sum = 0.f;
#pragma unroll
      for (int c = 0; c < PARTS; ++c) {
        if (c < num_parts) {
          // Partitions past the end, and rows with nothing attended, weigh 0 (their results are zeros).
          const float w = lse[k][c] == -INFINITY ? 0.f : fast_exp2(lse[k][c] - mx);
          float v[kPerLoad];
          unpack16<P>(x[k][c], v);
#pragma unroll
          for (int j = 0; j < kPerLoad; ++j) acc[j] = fmaf(w, v[j], acc[j]);
          sum += w;
        }
      }
      const int r = i / kVecs;
      sum = with_sink(sum, mx, row_sink(r));
      // Zeros only where the sequence has no key: a NaN sum stays NaN.
      const float inv = attended ? 1.f / sum : 0.f;
      auto* out = out_row(r) + (i - r * kVecs) * kPerLoad;
#pragma unroll
      for (int j = 0; j < kPerLoad; j += 4) {
        store4(out + j, make_float4(acc[j] * inv, acc[j + 1] * inv, acc[j + 2] * inv, acc[j + 3] * inv));
      }
    }
  }
}

// Split-K merge inside a thread-block cluster (Hopper), after each block (partition) has written its
// normalised result, row_out(r) (HEAD values of type P: float, or the output's 16-bit type), and its
// log-sum-exp, row_lse[r], to its own shared memory: block `rank` finishes every num_partitions-th (row,
// 16 bytes of columns) item of the first rows_valid rows, reading every partition's values from that
// partition's shared memory, and stores it to out_row(r). No float32 partials in global memory, no second
// kernel. Every thread of every block of the cluster must call it. attended: the sequence has keys
// (seq_len > 0); without, the output is zeros. row_sink(r): row r's sink logit (log2 domain), -inf for none.
template <int HEAD, typename P, typename RowOut, typename OutRow, typename RowSink>
__device__ __forceinline__ void merge_in_cluster(int num_parts, bool attended, int rows_valid, const float* row_lse,
                                                 RowOut row_out, OutRow out_row, RowSink row_sink) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900  // clusters: Hopper and newer (the plan never asks before)
  cluster_sync_shared();  // every partition's row_out and row_lse are written
  if (num_parts <= 2) {
    merge_items<HEAD, P, 2>(num_parts, attended, rows_valid, row_lse, row_out, out_row, row_sink);
  } else if (num_parts <= 4) {
    merge_items<HEAD, P, 4>(num_parts, attended, rows_valid, row_lse, row_out, out_row, row_sink);
  } else {
    merge_items<HEAD, P, kMaxClusterSize>(num_parts, attended, rows_valid, row_lse, row_out, out_row, row_sink);
  }
  cluster_sync_exit();  // no block exits while another still reads its shared memory
#endif
}

}  // namespace tpkit

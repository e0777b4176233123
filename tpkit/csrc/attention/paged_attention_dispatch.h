// Host-side pieces of the paged-attention planner and its per-dtype launchers (paged_attention_api.cu and
// the paged_attention_<dtype>.cu instantiations). Torch-free.
#pragma once

#include <algorithm>
#include <cstdint>

#include <cuda_runtime.h>

#include "attention/paged_attention.h"
#include "common/launch_common.h"

// The head sizes the attention kernels are compiled for; keep in sync with kSupportedText.
#define TPKIT_FOR_EACH_HEAD_SIZE(F) F(32) F(64) F(80) F(96) F(112) F(120) F(128) F(192) F(256)

namespace tpkit {

// Partitions merged in one cluster: the portable maximum (a non-portable 16 is slower than the merge kernel).
constexpr int kMaxClusterSize = 8;

// Whether `num_partitions` partitions can merge in their cluster, given a mask whose bit n says n can (bits
// 2 .. kMaxClusterSize at most). Any other count cannot: a split of 32 or more partitions must not read bit
// num_partitions % 32, which is what shifting a 32-bit mask that far does on the host.
inline bool cluster_mergeable(uint32_t cluster_merges, int num_partitions) {
  return num_partitions > 1 && num_partitions <= kMaxClusterSize && ((cluster_merges >> num_partitions) & 1u) != 0;
}

// The attention grid of a plan (block_coords): (KV heads x row groups, partitions, sequences) in decode,
// (work tiles x KV heads x row groups, partitions, 1) with query_start_loc; clusters of
// attention_cluster_size blocks along y.
inline int64_t attention_grid_x(const tpkit_paged_attention_args* a) {
  const int64_t heads_groups = static_cast<int64_t>(a->num_kv_heads) * a->m_groups;
  return a->query_start_loc == nullptr ? heads_groups : heads_groups * a->num_work_tiles;
}
inline dim3 attention_grid(const tpkit_paged_attention_args* a) {
  const bool multi = a->query_start_loc != nullptr;
  return dim3(static_cast<unsigned>(attention_grid_x(a)), a->num_partitions, multi ? 1 : a->num_work_tiles);
}

// Work items the planner expects to do work: every sequence in decode; with query_start_loc, the tiles of the
// batch's query tokens at the mean query length (at least one a sequence that can hold a token).
inline int64_t work_items(const tpkit_paged_attention_args* a) {
  if (a->query_start_loc == nullptr) return a->num_seqs;
  const int64_t tiles = (static_cast<int64_t>(a->num_query_rows) + a->tile_tokens - 1) / a->tile_tokens;
  return tiles > a->num_seqs ? tiles : (a->num_query_rows < a->num_seqs ? a->num_query_rows : a->num_seqs);
}
// Keys one work item may read: the block table's capacity or, with a window, at most the window of its last
// token, its other tokens and the rounding down to a KV block (keys_start). Tokens that are not causal see
// every key from their window's start to the sequence's end: no bound but the table's.
inline int64_t key_span(const tpkit_paged_attention_args* a) {
  const int64_t capacity = static_cast<int64_t>(a->max_blocks_per_seq) * a->block_size;
  if (a->window_size <= 0 || (a->query_start_loc != nullptr && !a->causal)) return capacity;
  return std::min<int64_t>(capacity, static_cast<int64_t>(a->window_size) + a->tile_tokens + a->block_size - 2);
}

inline int attention_cluster_size(const tpkit_paged_attention_args* a) {
  return a->cluster_merge ? a->num_partitions : 1;
}

// Chooses num_partitions and partition_size from the shapes: split a sequence's context only when
// (num_seqs x num_kv_heads x m_groups) thread blocks leave resident-block slots idle, and then into at
// most one wave of blocks.
// `concurrent_blocks` is what the device runs at once; `write_cost` is the cost of writing and merging one
// partition's result, in units of one 64-token tile's K/V read; bit n of `cluster_merges` is set where n
// partitions can be merged in their cluster (no merge kernel).
void plan_partitions(tpkit_paged_attention_args* args, int concurrent_blocks, double write_cost,
                     uint32_t cluster_merges);

cudaError_t plan_float16(tpkit_paged_attention_args* args);
cudaError_t plan_bfloat16(tpkit_paged_attention_args* args);
cudaError_t plan_float32(tpkit_paged_attention_args* args);
cudaError_t launch_float16(const tpkit_paged_attention_args* args, cudaStream_t stream);
cudaError_t launch_bfloat16(const tpkit_paged_attention_args* args, cudaStream_t stream);
cudaError_t launch_float32(const tpkit_paged_attention_args* args, cudaStream_t stream);

}  // namespace tpkit

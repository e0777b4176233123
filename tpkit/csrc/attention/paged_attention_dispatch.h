// Host-side pieces of the paged-attention planner and its per-dtype launchers (paged_attention_api.cu and
// the paged_attention_<dtype>.cu instantiations). Torch-free.
#pragma once

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

// The attention grid of a plan: (KV heads x row groups, partitions, sequences); clusters of
// attention_cluster_size blocks along y.
inline dim3 attention_grid(const tpkit_paged_attention_args* a) {
  return dim3(a->num_kv_heads * a->m_groups, a->num_partitions, a->num_seqs);
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

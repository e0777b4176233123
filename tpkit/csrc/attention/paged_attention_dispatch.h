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

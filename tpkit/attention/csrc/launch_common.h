// Host-side helpers shared by the per-dtype launchers (defined in paged_attention_api.cu). Torch-free.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "paged_attention.h"

// The head sizes the attention kernels are compiled for; keep in sync with kSupportedText.
#define TPKIT_FOR_EACH_HEAD_SIZE(F) F(32) F(64) F(80) F(96) F(112) F(120) F(128) F(192) F(256)

namespace tpkit {

// The launch attribute of thread-block clusters of `cluster_size` blocks along y.
inline cudaLaunchAttribute cluster_dimension(int cluster_size) {
  cudaLaunchAttribute attr = {};
  attr.id = cudaLaunchAttributeClusterDimension;
  attr.val.clusterDim.x = 1;
  attr.val.clusterDim.y = cluster_size;
  attr.val.clusterDim.z = 1;
  return attr;
}

// Whether `ptr` allows 16-byte vector loads and stores.
inline bool aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

// An attribute of the current device (multiprocessor count, compute capability), queried once per device.
cudaError_t current_device_attribute(cudaDeviceAttr attr, int* value);

// The most dynamic shared memory `kernel` can launch with on the current device (the opt-in maximum less
// its static shared memory); raises the kernel's limit to it, once per device and kernel. Cached.
cudaError_t kernel_dynamic_smem_limit(const void* kernel, int* limit);

// Thread blocks of `kernel` that fit on one multiprocessor with this launch shape (after raising its
// dynamic shared-memory limit). Cached.
cudaError_t kernel_occupancy(const void* kernel, int threads, int smem_bytes, int* blocks_per_sm);

// Thread-block clusters of `cluster_size` blocks (along y) of `kernel` that the current device (sm_90+) can
// run at once with this launch shape. Cached.
cudaError_t kernel_max_active_clusters(const void* kernel, int threads, int smem_bytes, int cluster_size,
                                       int* clusters);

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

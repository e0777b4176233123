// Host-side launch helpers shared by every kernel family (defined in launch_common.cu). Torch-free.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

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

}  // namespace tpkit

// Device queries behind the launch planners, cached per device (and kernel, launch shape). Torch-free.
#include <map>
#include <mutex>
#include <tuple>

#include "common/launch_common.h"

namespace tpkit {
namespace {

std::mutex& cache_mutex() {
  static std::mutex m;
  return m;
}

// `key`'s value from `cache`; on a miss from query(&value), kept when the query succeeds. The query runs
// without the lock: it may itself call the other cached queries.
template <typename Key, typename Query>
cudaError_t cached(std::map<Key, int>& cache, const Key& key, int* value, Query&& query) {
  {
    std::lock_guard<std::mutex> lock(cache_mutex());
    const auto it = cache.find(key);
    if (it != cache.end()) {
      *value = it->second;
      return cudaSuccess;
    }
  }
  const cudaError_t err = query(value);
  if (err != cudaSuccess) return err;
  std::lock_guard<std::mutex> lock(cache_mutex());
  cache[key] = *value;
  return cudaSuccess;
}

}  // namespace

cudaError_t current_device_attribute(cudaDeviceAttr attr, int* value) {
  int device = 0;
  const cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  static std::map<std::pair<int, int>, int> cache;
  return cached(cache, std::make_pair(device, static_cast<int>(attr)), value,
                [&](int* v) { return cudaDeviceGetAttribute(v, attr, device); });
}

cudaError_t kernel_dynamic_smem_limit(const void* kernel, int* limit) {
  int device = 0;
  const cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  static std::map<std::pair<int, const void*>, int> cache;
  return cached(cache, std::make_pair(device, kernel), limit, [&](int* v) {
    int optin = 0;
    cudaFuncAttributes attrs{};
    cudaError_t e;
    if ((e = cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device)) != cudaSuccess ||
        (e = cudaFuncGetAttributes(&attrs, kernel)) != cudaSuccess) {
      return e;
    }
    // Static shared memory counts against the opt-in maximum too.
    *v = optin - static_cast<int>(attrs.sharedSizeBytes);
    return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, *v);
  });
}

cudaError_t kernel_occupancy(const void* kernel, int threads, int smem_bytes, int* blocks_per_sm) {
  int device = 0;
  const cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  static std::map<std::tuple<int, const void*, int, int>, int> cache;
  return cached(cache, std::make_tuple(device, kernel, threads, smem_bytes), blocks_per_sm, [&](int* v) {
    int limit = 0;
    const cudaError_t e = kernel_dynamic_smem_limit(kernel, &limit);
    if (e != cudaSuccess) return e;
    return cudaOccupancyMaxActiveBlocksPerMultiprocessor(v, kernel, threads, smem_bytes);
  });
}

cudaError_t kernel_max_active_clusters(const void* kernel, int threads, int smem_bytes, int cluster_size,
                                       int* clusters) {
  int device = 0;
  const cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  static std::map<std::tuple<int, const void*, int, int, int>, int> cache;
  return cached(cache, std::make_tuple(device, kernel, threads, smem_bytes, cluster_size), clusters, [&](int* v) {
    int limit = 0;
    const cudaError_t e = kernel_dynamic_smem_limit(kernel, &limit);
    if (e != cudaSuccess) return e;
    cudaLaunchConfig_t config = {};
    config.gridDim = dim3(1, cluster_size, 1);
    config.blockDim = dim3(threads);
    config.dynamicSmemBytes = smem_bytes;
    cudaLaunchAttribute attr = cluster_dimension(cluster_size);
    config.attrs = &attr;
    config.numAttrs = 1;
    return cudaOccupancyMaxActiveClusters(v, kernel, &config);
  });
}

}  // namespace tpkit

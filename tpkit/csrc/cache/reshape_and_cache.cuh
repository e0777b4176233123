// Cache write: copies each new token's K and V ([num_kv_heads, head_size]) into its slot of the paged
// caches. One thread block per token; the copy moves raw bytes in the widest vector (16, 8, 4 or 2 bytes)
// that the pointers and strides allow. Torch-free.
#pragma once

#include <stdint.h>

#include "cache/reshape_and_cache.h"

namespace tpkit {

constexpr int kCacheMaxThreads = 256;

template <typename Vec>
__global__ void __launch_bounds__(kCacheMaxThreads) reshape_and_cache_kernel(const tpkit_reshape_and_cache_args p) {
  const int64_t token = blockIdx.x;
  const int64_t slot = p.slot_mapping[token];
  if (slot < 0) return;  // padding
  const int64_t block = slot / p.block_size;
  const int64_t offset = slot - block * p.block_size;
  if (block >= p.num_blocks) return;  // out of the cache: never write outside it (TPKIT_DEBUG reports it)
  const int64_t es = p.elem_size;
  const int vecs_per_head = static_cast<int>(p.head_size * es / static_cast<int64_t>(sizeof(Vec)));
  const int n = p.num_kv_heads * vecs_per_head;
  const char* key = static_cast<const char*>(p.key) + token * p.key_stride_token * es;
  const char* value = static_cast<const char*>(p.value) + token * p.value_stride_token * es;
  char* kc = static_cast<char*>(p.key_cache) + (block * p.kc_stride_block + offset * p.kc_stride_token) * es;
  char* vc = static_cast<char*>(p.value_cache) + (block * p.vc_stride_block + offset * p.vc_stride_token) * es;
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    const int h = i / vecs_per_head;
    const int64_t c = static_cast<int64_t>(i - h * vecs_per_head) * sizeof(Vec);
    const Vec k = *reinterpret_cast<const Vec*>(key + h * p.key_stride_head * es + c);
    const Vec v = *reinterpret_cast<const Vec*>(value + h * p.value_stride_head * es + c);
    *reinterpret_cast<Vec*>(kc + h * p.kc_stride_head * es + c) = k;
    *reinterpret_cast<Vec*>(vc + h * p.vc_stride_head * es + c) = v;
  }
}

}  // namespace tpkit

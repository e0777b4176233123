// Cache write: copies each new token's K and V ([num_kv_heads, head_size]) into its slot of the paged
// caches. One thread block per token; the copy moves raw bytes in the widest vector (16, 8, 4 or 2 bytes)
// that the pointers and strides allow. Torch-free.
#pragma once

#include <cuda_fp8.h>
#include <stdint.h>

#include "cache/reshape_and_cache.h"
#include "common/dtype_traits.cuh"
#include "common/fp8.cuh"

namespace tpkit {

constexpr int kCacheMaxThreads = 256;

// The cache block and offset of a token's slot; false for a token not written: a negative slot (padding)
// or one past the cache (never written outside it; TPKIT_DEBUG reports it).
__device__ __forceinline__ bool token_slot(const tpkit_reshape_and_cache_args& p, int64_t token, int64_t& block,
                                           int64_t& offset) {
  const int64_t slot = p.slot_mapping[token];
  if (slot < 0) return false;
  block = slot / p.block_size;
  offset = slot - block * p.block_size;
  return block < p.num_blocks;
}

template <typename Vec>
__global__ void __launch_bounds__(kCacheMaxThreads) reshape_and_cache_kernel(const tpkit_reshape_and_cache_args p) {
  const int64_t token = blockIdx.x;
  int64_t block, offset;
  if (!token_slot(p, token, block, offset)) return;
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

// The quantizing write into a float8 cache: one thread block per token, one element a thread at a time, each
// stored as quantize_fp8 makes it.
template <typename Src, __nv_fp8_interpretation_t kFormat>
__global__ void __launch_bounds__(kCacheMaxThreads) reshape_and_cache_fp8_kernel(const tpkit_reshape_and_cache_args p) {
  const int64_t token = blockIdx.x;
  int64_t block, offset;
  if (!token_slot(p, token, block, offset)) return;
  const Src* key = static_cast<const Src*>(p.key) + token * p.key_stride_token;
  const Src* value = static_cast<const Src*>(p.value) + token * p.value_stride_token;
  __nv_fp8_storage_t* kc = static_cast<__nv_fp8_storage_t*>(p.key_cache) + block * p.kc_stride_block +
                           offset * p.kc_stride_token;
  __nv_fp8_storage_t* vc = static_cast<__nv_fp8_storage_t*>(p.value_cache) + block * p.vc_stride_block +
                           offset * p.vc_stride_token;
  const int n = p.num_kv_heads * p.head_size;
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    const int h = i / p.head_size;
    const int d = i - h * p.head_size;
    const int s = p.scale_per_head ? h : 0;
    kc[h * p.kc_stride_head + d] =
        quantize_fp8(DTypeTraits<Src>::to_float(key[h * p.key_stride_head + d]), p.k_scale[s], kFormat);
    vc[h * p.vc_stride_head + d] =
        quantize_fp8(DTypeTraits<Src>::to_float(value[h * p.value_stride_head + d]), p.v_scale[s], kFormat);
  }
}

}  // namespace tpkit

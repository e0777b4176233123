// The C entry point of the cache write (reshape_and_cache.h): the widest vector the pointers and strides
// allow. Torch-free.
#include <algorithm>

#include "cache/reshape_and_cache.cuh"

namespace {

template <typename Vec>
cudaError_t launch_cache_write(const tpkit_reshape_and_cache_args* a, cudaStream_t stream) {
  const int vecs = static_cast<int>(static_cast<int64_t>(a->num_kv_heads) * a->head_size * a->elem_size / sizeof(Vec));
  const int threads = std::min(tpkit::kCacheMaxThreads, std::max(32, (vecs + 31) / 32 * 32));
  tpkit::reshape_and_cache_kernel<Vec><<<a->num_tokens, threads, 0, stream>>>(*a);
  return cudaGetLastError();
}

template <typename Src>
cudaError_t launch_quantizing_write(const tpkit_reshape_and_cache_args* a, cudaStream_t stream) {
  const int elems = a->num_kv_heads * a->head_size;
  const int threads = std::min(tpkit::kCacheMaxThreads, std::max(32, (elems + 31) / 32 * 32));
  if (a->cache_fp8 == TPKIT_FP8_E4M3) {
    tpkit::reshape_and_cache_fp8_kernel<Src, __NV_E4M3><<<a->num_tokens, threads, 0, stream>>>(*a);
  } else {
    tpkit::reshape_and_cache_fp8_kernel<Src, __NV_E5M2><<<a->num_tokens, threads, 0, stream>>>(*a);
  }
  return cudaGetLastError();
}

bool allows_width(const tpkit_reshape_and_cache_args* a, int64_t width) {
  const int64_t es = a->elem_size;
  const int64_t strides[] = {a->key_stride_token,  a->key_stride_head,  a->value_stride_token, a->value_stride_head,
                             a->kc_stride_block,   a->kc_stride_token,  a->kc_stride_head,     a->vc_stride_block,
                             a->vc_stride_token,   a->vc_stride_head,   static_cast<int64_t>(a->head_size)};
  for (const int64_t s : strides) {
    if ((s * es) % width != 0) return false;
  }
  const void* ptrs[] = {a->key, a->value, a->key_cache, a->value_cache};
  for (const void* ptr : ptrs) {
    if (reinterpret_cast<uintptr_t>(ptr) % width != 0) return false;
  }
  return true;
}

}  // namespace

extern "C" {

cudaError_t tpkit_reshape_and_cache_launch(const tpkit_reshape_and_cache_args* a, cudaStream_t stream) {
  if (a->num_tokens == 0 || a->num_kv_heads == 0 || a->head_size == 0) return cudaSuccess;
  if (a->cache_fp8 != TPKIT_FP8_NONE) {
    if (a->cache_fp8 != TPKIT_FP8_E4M3 && a->cache_fp8 != TPKIT_FP8_E5M2) return cudaErrorInvalidValue;
    switch (a->src_dtype) {
      case TPKIT_FLOAT16: return launch_quantizing_write<__half>(a, stream);
      case TPKIT_BFLOAT16: return launch_quantizing_write<__nv_bfloat16>(a, stream);
      case TPKIT_FLOAT32: return launch_quantizing_write<float>(a, stream);
    }
    return cudaErrorInvalidValue;
  }
  if (allows_width(a, 16)) return launch_cache_write<uint4>(a, stream);
  if (allows_width(a, 8)) return launch_cache_write<uint2>(a, stream);
  if (allows_width(a, 4)) return launch_cache_write<uint32_t>(a, stream);
  if (allows_width(a, 2)) return launch_cache_write<uint16_t>(a, stream);
  return cudaErrorInvalidValue;
}

}  // extern "C"

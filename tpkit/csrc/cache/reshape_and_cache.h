// C interface of tpkit's cache write: raw pointers, sizes, strides (in elements) and a CUDA stream. No torch:
// the binding (binding.cpp) checks tensors and fills the struct.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

#include "common/dtype.h"

#ifdef __cplusplus
extern "C" {
#endif

// Copies new tokens' K and V into the caches: slot = block * block_size + offset; a negative slot (padding)
// and a slot past the cache are skipped. Strides in elements; every last dim contiguous. With a float8 cache
// (cache_fp8 not TPKIT_FP8_NONE) each element is quantized instead: stored = saturate(x / scale), rounded to
// nearest even, NaN kept; the scale is k_scale[h] or v_scale[h] per KV head h (scale_per_head) or entry 0.
typedef struct {
  const void* key;    // [num_tokens, num_kv_heads, head_size]
  const void* value;  // [num_tokens, num_kv_heads, head_size]
  void* key_cache;    // [num_blocks, block_size, num_kv_heads, head_size]
  void* value_cache;
  const int64_t* slot_mapping;  // [num_tokens]
  int num_tokens;
  int num_kv_heads;
  int head_size;
  int block_size;
  int64_t num_blocks;
  int elem_size;  // bytes per element of key and value
  tpkit_dtype src_dtype;           // key's and value's element type (read by the quantizing write)
  tpkit_fp8_format cache_fp8;      // the caches' float8 format, or TPKIT_FP8_NONE (a copy)
  const float* k_scale;            // [num_kv_heads] or [1]
  const float* v_scale;
  int scale_per_head;
  int64_t key_stride_token, key_stride_head;
  int64_t value_stride_token, value_stride_head;
  int64_t kc_stride_block, kc_stride_token, kc_stride_head;
  int64_t vc_stride_block, vc_stride_token, vc_stride_head;
} tpkit_reshape_and_cache_args;

cudaError_t tpkit_reshape_and_cache_launch(const tpkit_reshape_and_cache_args* args, cudaStream_t stream);

#ifdef __cplusplus
}
#endif

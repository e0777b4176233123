// C interface of the prefill's element-wise kernels: RoPE of the q and k heads, and SwiGLU's silu(gate) * up.
// Each rounds where eager PyTorch rounds (every product, sum and activation to the dtype), so that its
// output is that of the expressions it replaces (tpkit.attention.rotary, tpkit.attention.linear). float16 or
// bfloat16, 16-byte vectors. No torch: the binding checks tensors and fills the structs.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

#include "common/dtype.h"

#ifdef __cplusplus
extern "C" {
#endif

// out[t, h] = rotate(input[t, h]) by cos[t], sin[t] in the NeoX / HuggingFace layout: feature i of a head
// pairs with i + head_size / 2 (x1 cos - x2 sin, x2 cos + x1 sin).
typedef struct {
  void* out;           // [num_tokens, num_heads, head_size], contiguous
  const void* input;   // [num_tokens, num_heads, head_size], strides below, last dim contiguous
  const void* cos;     // [num_tokens, head_size / 2], contiguous
  const void* sin;     // [num_tokens, head_size / 2], contiguous
  tpkit_dtype dtype;   // of all four
  int64_t num_tokens;
  int num_heads;
  int head_size;
  int64_t input_stride_token;  // in elements
  int64_t input_stride_head;
} tpkit_rotary_args;

// out[r, j] = silu(input[r, j]) * input[r, features + j]: the gate's half of each row, then the up half.
typedef struct {
  void* out;           // [num_rows, features], row stride out_stride, last dim contiguous
  const void* input;   // [num_rows, 2 * features], row stride input_stride, last dim contiguous
  tpkit_dtype dtype;   // of both
  int64_t num_rows;
  int64_t features;
  int64_t input_stride;  // in elements
  int64_t out_stride;
} tpkit_silu_and_mul_args;

// 1 when the kernel takes these arguments: float16 or bfloat16; head_size a multiple of 16 (features one of
// 8); every pointer, and every stride in bytes, a multiple of 16.
int tpkit_rotary_supported(const tpkit_rotary_args* args);
int tpkit_silu_and_mul_supported(const tpkit_silu_and_mul_args* args);

// Launch on `stream` (cudaErrorInvalidValue where the *_supported function says 0).
cudaError_t tpkit_rotary_launch(const tpkit_rotary_args* args, cudaStream_t stream);
cudaError_t tpkit_silu_and_mul_launch(const tpkit_silu_and_mul_args* args, cudaStream_t stream);

#ifdef __cplusplus
}
#endif

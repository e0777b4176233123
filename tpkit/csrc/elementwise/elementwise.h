// C interface of the prefill's element-wise kernels: RoPE of the q and k heads, SwiGLU's silu(gate) * up, and
// the per-token float8 quantization of a float8 product's activations, alone or fused with SwiGLU or RMSNorm.
// Each rounds where eager PyTorch rounds (every product, sum and activation to the dtype; the quantization's
// quotient in float32), so that its output is that of the expressions it replaces (tpkit.ops.rotary,
// tpkit.ops.activation, tpkit.ops.fp8_quantize; the RMSNorm's sum of squares in another order). float16 or
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

// out[r, j] = saturate(input[r, j] / scale[r]) in float8 E4M3, and scale[r], each bit for bit what the
// PyTorch expression computes on a GPU (tpkit.ops.fp8_quantize._quantize_reference), NaN and
// infinities included. Dynamic (static_scale NULL): scale[r] = max(min(amax, amax_bound) * (1 / 448), 1e-12),
// amax the row's largest magnitude, NaN where the row holds a NaN (and then scale[r] is NaN; torch.clamp keeps
// NaN); the product by the float32 reciprocal is how torch divides a CUDA tensor by a Python number. Static:
// scale[r] = *static_scale for every row. The quotient is IEEE float32 division, saturated to +-448 (NaN stays
// NaN, with its sign, as torch's conversion keeps it).
typedef struct {
  void* out;                  // float8 E4M3 [num_rows, features], contiguous
  float* scale;               // [num_rows]
  const void* input;          // [num_rows, features], row stride input_stride, last dim contiguous
  const float* static_scale;  // one value, or NULL for a scale a row from its amax
  tpkit_dtype dtype;          // of input
  float amax_bound;           // the dynamic amax's upper bound; INFINITY for none
  int64_t num_rows;
  int64_t features;
  int64_t input_stride;       // in elements
} tpkit_quantize_fp8_args;

// The quantization fused with what comes before it: each quantizes, as tpkit_quantize_fp8_args says, the values
// below, which it makes in shared memory and does not write.
// - SwiGLU (tpkit_silu_and_mul_quantize_fp8_*, the tpkit_quantize_fp8_args above): input is [num_rows,
//   2 * features], the gate's half of each row then the up half, and the row's values silu(gate) * up as
//   tpkit_silu_and_mul computes them.
// - RMSNorm: the values of row r are s * rstd * norm_weight in float32 rounded once to the dtype, with
//   rstd = rsqrt(sum(s^2) / features + eps) (the sum in float32) and s = input[r], or with a residual
//   s = input[r] + residual[r] rounded to the dtype and written to residual_out[r] (the next residual stream).
typedef struct {
  tpkit_quantize_fp8_args quantize;  // its input: the rows normed (added to the residual first)
  const void* residual;              // [num_rows, features], row stride residual_stride, or NULL
  void* residual_out;                // [num_rows, features], contiguous: input + residual; NULL without one
  const void* norm_weight;           // [features], contiguous
  float eps;
  int64_t residual_stride;           // in elements
} tpkit_rms_norm_quantize_fp8_args;

// 1 when the kernel takes these arguments: float16 or bfloat16; head_size a multiple of 16 (features one of
// 8); every tensor's pointer, and every stride in bytes, a multiple of 16 (the quantization's scales: float
// aligned). The quantization takes at most 2^31 - 1 rows (a thread block each).
int tpkit_rotary_supported(const tpkit_rotary_args* args);
int tpkit_silu_and_mul_supported(const tpkit_silu_and_mul_args* args);
int tpkit_quantize_fp8_supported(const tpkit_quantize_fp8_args* args);
int tpkit_silu_and_mul_quantize_fp8_supported(const tpkit_quantize_fp8_args* args);
int tpkit_rms_norm_quantize_fp8_supported(const tpkit_rms_norm_quantize_fp8_args* args);

// Launch on `stream` (cudaErrorInvalidValue where the *_supported function says 0).
cudaError_t tpkit_rotary_launch(const tpkit_rotary_args* args, cudaStream_t stream);
cudaError_t tpkit_silu_and_mul_launch(const tpkit_silu_and_mul_args* args, cudaStream_t stream);
cudaError_t tpkit_quantize_fp8_launch(const tpkit_quantize_fp8_args* args, cudaStream_t stream);
cudaError_t tpkit_silu_and_mul_quantize_fp8_launch(const tpkit_quantize_fp8_args* args, cudaStream_t stream);
cudaError_t tpkit_rms_norm_quantize_fp8_launch(const tpkit_rms_norm_quantize_fp8_args* args,
                                               cudaStream_t stream);

#ifdef __cplusplus
}
#endif

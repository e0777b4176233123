// C interface of tpkit's decode linear kernel: out = input @ weight^T (+ bias) for the few rows of a decode
// step (up to 16), float16 or bfloat16. No torch: the binding (binding.cpp) checks tensors and fills the
// struct; .ci/run compiles the rest with a bare nvcc (python -m tpkit.attention.build_check).
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

#include "common/dtype.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
  void* out;             // [num_rows, out_features], row stride out_stride, last dim contiguous
  const void* input;     // [num_rows, in_features], row stride input_stride, last dim contiguous
  const void* weight;    // [out_features, in_features], contiguous
  const void* bias;      // [out_features] or NULL
  tpkit_dtype dtype;     // of all four
  int num_rows;
  int in_features;
  int out_features;
  int64_t input_stride;  // in elements
  int64_t out_stride;
  int splits;            // warps that share one weight row's in_features; 0: chosen from the shapes
  // 1: the weight stacks a gate's rows over an up projection's (out_features = 2 * features), and out
  // [num_rows, features] gets silu(gate) * up, each rounded to the dtype first as the plain product's
  // output would be, the product of the two rounded once (SwiGLU, as LlamaMLP computes it).
  int silu_and_mul;
  // The rotation and the cache write of a decode step's fused q, k, v projection, when rotary_features > 0
  // (not with silu_and_mul): out's features are q heads, then k heads, then v heads of head_size each; the
  // first rotary_features (q and k) are rotated by RoPE in the NeoX / HuggingFace layout (feature i of a
  // head pairs with i + head_size / 2: x1 cos - x2 sin, x2 cos + x1 sin, from the product rounded to the
  // dtype), and the features from q_features on (k, then v) are also written to row m's cache slot: the
  // value as the output holds it, or, in a float8 cache (cache_fp8 not TPKIT_FP8_NONE), quantized as the
  // quantizing cache write does (reshape_and_cache.h): stored = saturate(x / scale), with k_scale[h] or
  // v_scale[h] of KV head h (scale_per_head) or entry 0.
  int head_size;
  int q_features;
  int rotary_features;
  const void* cos;  // [num_rows, head_size / 2], contiguous, the dtype
  const void* sin;
  void* key_cache;  // [num_blocks, block_size, num_kv_heads, head_size], last dim contiguous
  void* value_cache;
  const int64_t* slot_mapping;  // [num_rows]: block * block_size + offset; negative or past the cache: skipped
  int block_size;
  int64_t num_blocks;
  int64_t kc_stride_block, kc_stride_token, kc_stride_head;
  int64_t vc_stride_block, vc_stride_token, vc_stride_head;
  tpkit_fp8_format cache_fp8;  // the caches' float8 format, or TPKIT_FP8_NONE (caches of the dtype)
  const float* k_scale;        // [num_kv_heads] or [1], float32, with a float8 cache
  const float* v_scale;
  int scale_per_head;
  // An RMSNorm split across two products of a decode step (rms_norm(x) W^T = rsqrt(mean(x^2) + eps) (x *
  // norm_weight) W^T), so that no kernel of its own runs between them:
  // - the producer (residual != NULL; plain product only): out = round(product) + residual, rounded (the
  //   residual stream's next value x); normed = round(x * norm_weight); sums[m] += the sum of x[m]^2 over
  //   the block's features (a float32 sum in a fixed order, added in float64, where the order of the
  //   blocks' adds does not change the result); block 0 also zeroes zero_sums[0, num_rows) (the buffer whose
  //   consumer ran before this product);
  // - the consumer (rms_sums != NULL; any epilogue): the product of row m is multiplied by
  //   rsqrt(rms_sums[m] / in_features + eps) before the bias and the epilogue.
  const void* residual;     // [num_rows, out_features], contiguous, the dtype
  const void* norm_weight;  // [out_features], the dtype
  void* normed;             // [num_rows, out_features], contiguous, the dtype
  double* sums;             // [num_rows], float64, zero before the product
  double* zero_sums;        // [num_rows], float64, or NULL
  const double* rms_sums;   // [num_rows], float64, or NULL
  float eps;
  // Float8 (E4M3) weights, when weight_scale is not NULL (with any epilogue): weight holds [out_features,
  // in_features] float8 values, converted exactly to the dtype in registers, and row n's product is
  // multiplied by weight_scale[n] (float32) after the RMSNorm's row scale, before the bias.
  const float* weight_scale;  // [out_features], or NULL
} tpkit_decode_linear_args;

// The most rows one launch takes.
#define TPKIT_DECODE_LINEAR_MAX_ROWS 16

// 1 when the kernel takes these arguments: float16 or bfloat16, 1-16 rows, in_features a multiple of 32,
// out_features of 8 (of 16 with silu_and_mul), input and weight rows 16-byte aligned, splits 0, 1, 2, 4 or 8;
// with the rotation, head_size a multiple of 16 and q_features, rotary_features and out_features multiples
// of head_size, and with a float8 cache k_scale and v_scale given; with a residual, neither SwiGLU nor the
// rotation, and norm_weight, normed and sums given.
int tpkit_decode_linear_supported(const tpkit_decode_linear_args* args);

// Launches the kernel on `stream` (cudaErrorInvalidValue where tpkit_decode_linear_supported says 0).
cudaError_t tpkit_decode_linear_launch(const tpkit_decode_linear_args* args, cudaStream_t stream);

#ifdef __cplusplus
}
#endif

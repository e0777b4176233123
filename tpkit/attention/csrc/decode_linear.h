// C interface of tpkit's decode linear kernel: out = input @ weight^T (+ bias) for the few rows of a decode
// step (up to 16), float16 or bfloat16. No torch: the binding (binding.cpp) checks tensors and fills the
// struct; .ci/run compiles the rest with a bare nvcc (python -m tpkit.attention.build_check).
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

#include "paged_attention.h"

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
} tpkit_decode_linear_args;

// The most rows one launch takes.
#define TPKIT_DECODE_LINEAR_MAX_ROWS 16

// 1 when the kernel takes these arguments: float16 or bfloat16, 1-16 rows, in_features a multiple of 32,
// out_features of 8 (of 16 with silu_and_mul), input and weight rows 16-byte aligned, splits 0, 1, 2, 4 or 8.
int tpkit_decode_linear_supported(const tpkit_decode_linear_args* args);

// Launches the kernel on `stream` (cudaErrorInvalidValue where tpkit_decode_linear_supported says 0).
cudaError_t tpkit_decode_linear_launch(const tpkit_decode_linear_args* args, cudaStream_t stream);

#ifdef __cplusplus
}
#endif

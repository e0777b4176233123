// The element types tpkit's kernels take, shared by every C interface (attention, cache, GEMM,
// element-wise). Torch-free: the binding maps torch dtypes onto these codes.
#pragma once

#ifdef __cplusplus
extern "C" {
#endif

typedef enum { TPKIT_FLOAT16 = 0, TPKIT_BFLOAT16 = 1, TPKIT_FLOAT32 = 2 } tpkit_dtype;

// The float8 formats of a quantized KV cache (and of quantized weights): OCP E4M3 (finite, no infinities)
// and E5M2.
typedef enum { TPKIT_FP8_NONE = 0, TPKIT_FP8_E4M3 = 1, TPKIT_FP8_E5M2 = 2 } tpkit_fp8_format;

#ifdef __cplusplus
}
#endif

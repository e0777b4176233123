// The element types tpkit's kernels take, shared by every C interface (attention, cache, GEMM,
// element-wise). Torch-free: the binding maps torch dtypes onto these codes.
#pragma once

#ifdef __cplusplus
extern "C" {
#endif

typedef enum { TPKIT_FLOAT16 = 0, TPKIT_BFLOAT16 = 1, TPKIT_FLOAT32 = 2 } tpkit_dtype;

#ifdef __cplusplus
}
#endif

// Float8 values (a quantized KV cache, quantized weights) converted to the 16-bit type the tensor cores
// take, and the quantizing conversion of a float8 KV cache's writes. Torch-free.
#pragma once

#include <stdint.h>

#include <cuda_fp8.h>

#include "common/dtype.h"
#include "common/dtype_traits.cuh"

namespace tpkit {

// The CUDA interpretation of a float8 format (TPKIT_FP8_E4M3 or TPKIT_FP8_E5M2).
template <int FORMAT>
constexpr __nv_fp8_interpretation_t kFp8Interpretation = FORMAT == TPKIT_FP8_E5M2 ? __NV_E5M2 : __NV_E4M3;

// Eight float8 values, 8 bytes, as eight values of T in 16 bytes: each pair converted exactly (every E4M3
// and E5M2 value is a float16 and a bfloat16 value; NaN stays NaN).
template <typename T, int FORMAT = TPKIT_FP8_E4M3>
__device__ __forceinline__ uint4 fp8x8_to(const uint2 raw) {
  const uint32_t words[2] = {raw.x, raw.y};
  uint32_t out[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const __nv_fp8x2_storage_t pair = static_cast<__nv_fp8x2_storage_t>(words[i / 2] >> (16 * (i % 2)));
    const __half2 h = __half2(__nv_cvt_fp8x2_to_halfraw2(pair, kFp8Interpretation<FORMAT>));
    if constexpr (DTypeTraits<T>::kIsBF16) {
      const float2 f = __half22float2(h);
      out[i] = DTypeTraits<T>::pack2(f.x, f.y);
    } else {
      out[i] = *reinterpret_cast<const uint32_t*>(&h);
    }
  }
  return make_uint4(out[0], out[1], out[2], out[3]);
}

// The two float8 values in the low 16 bits of `pair` as an fp16 pair, the lower byte in the lower half.
template <int FORMAT>
__device__ __forceinline__ uint32_t fp8x2_to_half2(uint32_t pair) {
  const __half2_raw h =
      __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(pair & 0xffffu), kFp8Interpretation<FORMAT>);
  return static_cast<uint32_t>(h.x) | (static_cast<uint32_t>(h.y) << 16);
}

// A float8 cache's stored value of x: saturate(x / scale), x / scale in float32 (IEEE division, as the
// PyTorch reference divides), then the saturating conversion: finite values beyond the format's range become
// its largest finite value, NaN stays NaN. Every cache write quantizes through this one rule, so that two
// writes of the same value store the same bits.
__device__ __forceinline__ __nv_fp8_storage_t quantize_fp8(float x, float scale, __nv_fp8_interpretation_t format) {
  return __nv_cvt_float_to_fp8(x / scale, __NV_SATFINITE, format);
}

}  // namespace tpkit

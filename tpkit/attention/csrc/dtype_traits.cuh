// Element types of the paged-attention kernels: conversions to and from float32, and the flag that picks
// the bf16 or fp16 form of the tensor-core instruction. Torch-free.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

namespace tpkit {

template <typename T>
struct DTypeTraits;

template <>
struct DTypeTraits<__half> {
  static constexpr bool kIsBF16 = false;
  __device__ __forceinline__ static float to_float(__half x) { return __half2float(x); }
  __device__ __forceinline__ static __half from_float(float x) { return __float2half_rn(x); }
  // Two floats rounded into one 32-bit register, the lower half first (an mma operand pair).
  __device__ __forceinline__ static uint32_t pack2(float lo, float hi) {
    const __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&h);
  }
  // Four consecutive outputs in one 8-byte store; dst 8-byte aligned.
  __device__ __forceinline__ static void store4(__half* dst, float4 v) {
    *reinterpret_cast<uint2*>(dst) = make_uint2(pack2(v.x, v.y), pack2(v.z, v.w));
  }
};

template <>
struct DTypeTraits<__nv_bfloat16> {
  static constexpr bool kIsBF16 = true;
  __device__ __forceinline__ static float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
  __device__ __forceinline__ static __nv_bfloat16 from_float(float x) { return __float2bfloat16_rn(x); }
  __device__ __forceinline__ static uint32_t pack2(float lo, float hi) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&h);
  }
  __device__ __forceinline__ static void store4(__nv_bfloat16* dst, float4 v) {
    *reinterpret_cast<uint2*>(dst) = make_uint2(pack2(v.x, v.y), pack2(v.z, v.w));
  }
};

template <>
struct DTypeTraits<float> {
  static constexpr bool kIsBF16 = false;
  __device__ __forceinline__ static float to_float(float x) { return x; }
  __device__ __forceinline__ static float from_float(float x) { return x; }
  __device__ __forceinline__ static void store4(float* dst, float4 v) { *reinterpret_cast<float4*>(dst) = v; }
};

}  // namespace tpkit

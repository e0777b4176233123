// Element types of the paged-attention kernels: conversions to and from float32, the flag that picks the
// bf16 or fp16 form of the tensor-core instruction, and four-element output stores. Torch-free.
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
};

template <>
struct DTypeTraits<float> {
  static constexpr bool kIsBF16 = false;
  __device__ __forceinline__ static float to_float(float x) { return x; }
  __device__ __forceinline__ static float from_float(float x) { return x; }
};

// Four consecutive outputs in one store: 8 bytes of two packed pairs for the 16-bit types (dst 8-byte
// aligned), 16 bytes for float (dst 16-byte aligned).
template <typename T>
__device__ __forceinline__ void store4(T* dst, float4 v) {
  using Traits = DTypeTraits<T>;
  *reinterpret_cast<uint2*>(dst) = make_uint2(Traits::pack2(v.x, v.y), Traits::pack2(v.z, v.w));
}

template <>
__device__ __forceinline__ void store4<float>(float* dst, float4 v) {
  *reinterpret_cast<float4*>(dst) = v;
}

// 16 bytes of partial results as floats: four float32s, or eight fp16/bf16s.
template <typename P>
__device__ __forceinline__ void unpack16(uint4 raw, float (&v)[16 / sizeof(P)]) {
  if constexpr (sizeof(P) == 4) {
    v[0] = __uint_as_float(raw.x);
    v[1] = __uint_as_float(raw.y);
    v[2] = __uint_as_float(raw.z);
    v[3] = __uint_as_float(raw.w);
  } else {
    const P* h = reinterpret_cast<const P*>(&raw);
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = DTypeTraits<P>::to_float(h[i]);
  }
}

// acc += w * x, four columns: a partition's weighted share of a merged row.
__device__ __forceinline__ void fma4(float w, float4 x, float4& acc) {
  acc.x = fmaf(w, x.x, acc.x);
  acc.y = fmaf(w, x.y, acc.y);
  acc.z = fmaf(w, x.z, acc.z);
  acc.w = fmaf(w, x.w, acc.w);
}

}  // namespace tpkit

// The prefill's element-wise kernels (elementwise.h): a thread takes 8 elements of a head's each half (RoPE)
// or of a row's gate and up halves (SwiGLU), as 16-byte vectors, in a grid-stride loop. The per-token float8
// quantization takes a thread block a row instead (its scale is a reduction over the row). Torch-free.
#pragma once

#include <cuda_fp8.h>
#include <stdint.h>

#include "common/dtype_traits.cuh"
#include "elementwise/elementwise.h"

namespace tpkit {

constexpr int kElementwiseThreads = 256;
constexpr int kVector = 8;  // 16-bit elements in 16 bytes

// Eight 16-bit elements, loaded and stored as one 16-byte vector.
template <typename T>
union Vector8 {
  uint4 raw;
  T values[kVector];
};

template <typename T>
__device__ __forceinline__ float round_to(float x) {
  return DTypeTraits<T>::to_float(DTypeTraits<T>::from_float(x));
}

template <typename T>
__global__ void __launch_bounds__(kElementwiseThreads) rotary_kernel(const tpkit_rotary_args a) {
  const int half = a.head_size / 2;
  const int vectors_per_head = half / kVector;
  const int64_t total = a.num_tokens * a.num_heads * vectors_per_head;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t token = i / (a.num_heads * vectors_per_head);
    const int rest = static_cast<int>(i - token * a.num_heads * vectors_per_head);
    const int head = rest / vectors_per_head, d = rest % vectors_per_head * kVector;
    const T* x = static_cast<const T*>(a.input) + token * a.input_stride_token + head * a.input_stride_head + d;
    const int64_t table = token * half + d;
    Vector8<T> x1, x2, cos, sin, out1, out2;
    x1.raw = *reinterpret_cast<const uint4*>(x);
    x2.raw = *reinterpret_cast<const uint4*>(x + half);
    cos.raw = *reinterpret_cast<const uint4*>(static_cast<const T*>(a.cos) + table);
    sin.raw = *reinterpret_cast<const uint4*>(static_cast<const T*>(a.sin) + table);
    using Traits = DTypeTraits<T>;
#pragma unroll
    for (int j = 0; j < kVector; ++j) {
      const float f1 = Traits::to_float(x1.values[j]), f2 = Traits::to_float(x2.values[j]);
      const float c = Traits::to_float(cos.values[j]), s = Traits::to_float(sin.values[j]);
      out1.values[j] = Traits::from_float(round_to<T>(f1 * c) - round_to<T>(f2 * s));
      out2.values[j] = Traits::from_float(round_to<T>(f2 * c) + round_to<T>(f1 * s));
    }
    T* out = static_cast<T*>(a.out) + (token * a.num_heads + head) * a.head_size + d;
    *reinterpret_cast<uint4*>(out) = out1.raw;
    *reinterpret_cast<uint4*>(out + half) = out2.raw;
  }
}

template <typename T>
__global__ void __launch_bounds__(kElementwiseThreads) silu_and_mul_kernel(const tpkit_silu_and_mul_args a) {
  const int64_t vectors_per_row = a.features / kVector;
  const int64_t total = a.num_rows * vectors_per_row;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t row = i / vectors_per_row, j0 = (i - row * vectors_per_row) * kVector;
    const T* gate_row = static_cast<const T*>(a.input) + row * a.input_stride + j0;
    Vector8<T> gate, up, out;
    gate.raw = *reinterpret_cast<const uint4*>(gate_row);
    up.raw = *reinterpret_cast<const uint4*>(gate_row + a.features);
    using Traits = DTypeTraits<T>;
#pragma unroll
    for (int j = 0; j < kVector; ++j) {
      const float g = Traits::to_float(gate.values[j]);
      // expf, not __expf: torch's silu kernel's, rounded to the dtype before the product, as F.silu's output.
      out.values[j] = Traits::from_float(round_to<T>(g / (1.f + expf(-g))) * Traits::to_float(up.values[j]));
    }
    *reinterpret_cast<uint4*>(static_cast<T*>(a.out) + row * a.out_stride + j0) = out.raw;
  }
}

// Per-token float8 quantization: a block a row, 32 to kQuantizeMaxThreads threads. Each thread loads up to
// kQuantizeVectors of the row's 16-byte vectors (thread t: vectors t, t + blockDim.x, ...), all before it
// uses one; the block reduces their magnitudes to the row's amax, and each thread quantizes the vectors it
// holds: the row is read from memory once. A row longer than the block holds (more than kQuantizeVectors *
// blockDim.x vectors) is reduced chunk by chunk and read a second time to quantize.
constexpr int kQuantizeMaxThreads = 512;
constexpr int kQuantizeVectors = 8;
// torch divides a CUDA tensor by a Python number as the product by its reciprocal in float32.
constexpr float kInvFp8E4M3Max = static_cast<float>(1.0 / 448.0);
// The smallest dynamic scale (an all-zero row's), float32 of the double 1e-12 as torch.clamp converts it.
constexpr float kMinQuantizeScale = static_cast<float>(1e-12);

// The bit pattern of a 16-bit type's +infinity. A magnitude's bits order as its value does, and every NaN's
// lie above infinity's.
template <typename T>
constexpr uint32_t kInfBits = DTypeTraits<T>::kIsBF16 ? 0x7f80u : 0x7c00u;

// The larger magnitude of each 16-bit half of `m` and of each pair in `v`, compared as bit patterns: the
// integer maximum of magnitudes is their maximum with NaN propagated (fmaxf would drop a NaN).
__device__ __forceinline__ uint32_t max_magnitudes(uint32_t m, const uint4 v) {
  constexpr uint32_t kAbs = 0x7fff7fffu;
  m = __vmaxu2(m, v.x & kAbs);
  m = __vmaxu2(m, v.y & kAbs);
  m = __vmaxu2(m, v.z & kAbs);
  return __vmaxu2(m, v.w & kAbs);
}

// The largest of every thread's `bits` in the block (blockDim.x a multiple of 32).
__device__ __forceinline__ uint32_t block_max(uint32_t bits) {
  __shared__ uint32_t warp_max[kQuantizeMaxThreads / 32];
  bits = __reduce_max_sync(0xffffffffu, bits);
  const int warps = blockDim.x / 32;
  if (warps == 1) return bits;
  if (threadIdx.x % 32 == 0) warp_max[threadIdx.x / 32] = bits;
  __syncthreads();
  for (int w = 0; w < warps; ++w) bits = max(bits, warp_max[w]);
  return bits;
}

// The float value of a 16-bit magnitude's bit pattern (NaN's are float32's quiet NaN, as torch's amax is).
template <typename T>
__device__ __forceinline__ float magnitude_value(uint32_t bits) {
  if (bits > kInfBits<T>) return __uint_as_float(0x7fc00000u);
  if constexpr (DTypeTraits<T>::kIsBF16) {
    return __uint_as_float(bits << 16);
  } else {
    return __half2float(__ushort_as_half(static_cast<unsigned short>(bits)));
  }
}

// A row's scale from its amax: max(min(amax, bound) / 448, 1e-12) as the PyTorch expression computes it, each
// clamp keeping NaN as torch.clamp does.
__device__ __forceinline__ float dynamic_scale(float amax, float bound) {
  if (!isnan(amax)) amax = fminf(amax, bound);
  const float scale = amax * kInvFp8E4M3Max;
  return isnan(scale) ? scale : fmaxf(scale, kMinQuantizeScale);
}

// The float8 E4M3 bits of a NaN quotient: torch's conversion keeps its sign.
__device__ __forceinline__ uint32_t fp8_nan(float q) { return 0x7fu | ((__float_as_uint(q) >> 24) & 0x80u); }

// Eight values over `scale`, in float32 (IEEE division, as torch.div of the promoted input), saturated to
// +-448 and rounded to nearest even into float8 E4M3: the saturating conversion is the clamp to +-448 and
// torch's conversion for every quotient but NaN, which it maps to NaN without its sign; kNanPossible rows
// (a NaN or infinity in the row, or a scale that is not finite and nonzero) put the sign back.
template <typename T, bool kNanPossible>
__device__ __forceinline__ uint2 quantize8(const uint4 raw, float scale) {
  Vector8<T> x;
  x.raw = raw;
  uint32_t words[2] = {0u, 0u};
#pragma unroll
  for (int p = 0; p < kVector / 2; ++p) {
    const float lo = DTypeTraits<T>::to_float(x.values[2 * p]) / scale;
    const float hi = DTypeTraits<T>::to_float(x.values[2 * p + 1]) / scale;
    uint32_t pair = __nv_cvt_float2_to_fp8x2(make_float2(lo, hi), __NV_SATFINITE, __NV_E4M3);
    if constexpr (kNanPossible) {
      if (isnan(lo)) pair = (pair & 0xff00u) | fp8_nan(lo);
      if (isnan(hi)) pair = (pair & 0x00ffu) | (fp8_nan(hi) << 8);
    }
    words[p / 2] |= pair << (16 * (p % 2));
  }
  return make_uint2(words[0], words[1]);
}

// Loads the vectors of the chunk at `base` that thread threadIdx.x holds (zeros past the row's end: they
// leave the amax as it is).
__device__ __forceinline__ void load_chunk(uint4 (&held)[kQuantizeVectors], const uint4* row, int64_t base,
                                           int64_t vectors) {
#pragma unroll
  for (int i = 0; i < kQuantizeVectors; ++i) {
    const int64_t j = base + i * static_cast<int64_t>(blockDim.x) + threadIdx.x;
    held[i] = j < vectors ? __ldg(row + j) : make_uint4(0u, 0u, 0u, 0u);
  }
}

template <typename T, bool kNanPossible>
__device__ __forceinline__ void store_chunk(const uint4 (&held)[kQuantizeVectors], uint2* out, int64_t base,
                                            int64_t vectors, float scale) {
#pragma unroll
  for (int i = 0; i < kQuantizeVectors; ++i) {
    const int64_t j = base + i * static_cast<int64_t>(blockDim.x) + threadIdx.x;
    if (j < vectors) out[j] = quantize8<T, kNanPossible>(held[i], scale);
  }
}

// The row's chunks after the first reduction: quantized from the registers where the row is one chunk, else
// each chunk loaded again.
template <typename T, bool kNanPossible>
__device__ __forceinline__ void quantize_row(uint4 (&held)[kQuantizeVectors], const uint4* row, uint2* out,
                                             int64_t vectors, float scale) {
  const int64_t chunk = static_cast<int64_t>(kQuantizeVectors) * blockDim.x;
  if (vectors <= chunk) {
    store_chunk<T, kNanPossible>(held, out, 0, vectors, scale);
    return;
  }
  for (int64_t base = 0; base < vectors; base += chunk) {
    load_chunk(held, row, base, vectors);
    store_chunk<T, kNanPossible>(held, out, base, vectors, scale);
  }
}

template <typename T>
__global__ void __launch_bounds__(kQuantizeMaxThreads) quantize_fp8_kernel(const tpkit_quantize_fp8_args a) {
  const int64_t r = blockIdx.x;
  const int64_t vectors = a.features / kVector;
  const uint4* row = reinterpret_cast<const uint4*>(static_cast<const T*>(a.input) + r * a.input_stride);
  uint2* out = reinterpret_cast<uint2*>(static_cast<uint8_t*>(a.out) + r * a.features);
  const int64_t chunk = static_cast<int64_t>(kQuantizeVectors) * blockDim.x;
  uint4 held[kQuantizeVectors];
  uint32_t magnitudes = 0u;  // two 16-bit magnitudes' bit patterns
  for (int64_t base = 0; base < vectors; base += chunk) {
    load_chunk(held, row, base, vectors);
#pragma unroll
    for (int i = 0; i < kQuantizeVectors; ++i) magnitudes = max_magnitudes(magnitudes, held[i]);
  }
  const uint32_t amax_bits = block_max(max(magnitudes & 0xffffu, magnitudes >> 16));
  const float scale =
      a.static_scale != nullptr ? *a.static_scale : dynamic_scale(magnitude_value<T>(amax_bits), a.amax_bound);
  if (threadIdx.x == 0) a.scale[r] = scale;
  // A finite row over a finite, nonzero scale has no NaN quotient.
  if (amax_bits < kInfBits<T> && isfinite(scale) && scale != 0.f) {
    quantize_row<T, false>(held, row, out, vectors, scale);
  } else {
    quantize_row<T, true>(held, row, out, vectors, scale);
  }
}

}  // namespace tpkit

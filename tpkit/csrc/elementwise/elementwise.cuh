// The prefill's element-wise kernels (elementwise.h): a thread takes 8 elements of a head's each half (RoPE)
// or of a row's gate and up halves (SwiGLU), as 16-byte vectors, in a grid-stride loop. The per-token float8
// quantizations are in quantize_fp8.cuh. Torch-free.
#pragma once

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

// f(x, y) of each pair of the eight values of x and of y, in float32, rounded to T.
template <typename T, typename F>
__device__ __forceinline__ uint4 map8(const uint4 x_raw, const uint4 y_raw, F f) {
  using Traits = DTypeTraits<T>;
  Vector8<T> x, y, out;
  x.raw = x_raw;
  y.raw = y_raw;
#pragma unroll
  for (int i = 0; i < kVector; ++i) {
    out.values[i] = Traits::from_float(f(Traits::to_float(x.values[i]), Traits::to_float(y.values[i])));
  }
  return out.raw;
}

// silu(gate) * up of eight gate and eight up values, each step rounded to T.
template <typename T>
__device__ __forceinline__ uint4 silu_and_mul8(const uint4 gate, const uint4 up) {
  // expf, not __expf: torch's silu kernel's, rounded to the dtype before the product, as F.silu's output.
  return map8<T>(gate, up, [](float g, float u) { return round_to<T>(g / (1.f + expf(-g))) * u; });
}

template <typename T>
__global__ void __launch_bounds__(kElementwiseThreads) silu_and_mul_kernel(const tpkit_silu_and_mul_args a) {
  const int64_t vectors_per_row = a.features / kVector;
  const int64_t total = a.num_rows * vectors_per_row;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t row = i / vectors_per_row, j0 = (i - row * vectors_per_row) * kVector;
    const T* gate_row = static_cast<const T*>(a.input) + row * a.input_stride + j0;
    *reinterpret_cast<uint4*>(static_cast<T*>(a.out) + row * a.out_stride + j0) = silu_and_mul8<T>(
        *reinterpret_cast<const uint4*>(gate_row), *reinterpret_cast<const uint4*>(gate_row + a.features));
  }
}

}  // namespace tpkit

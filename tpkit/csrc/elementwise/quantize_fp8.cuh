// Per-token float8 quantization (elementwise.h): a thread block a row, its scale a reduction over the row.
// The row's values are the input's row, SwiGLU of a gate/up product's row, or an RMSNorm of the residual
// stream (after the residual add), each computed as its own kernel computes it, so that a fused quantization
// gives the float8 bits of the unfused kernels' output quantized. Torch-free.
//
// The row's 16-bit inputs (one part, or two: SwiGLU's gate and up, the norm's input and residual) are copied
// into shared memory with cp.async, up to `chunk` vectors of each part at once. The copies hold no registers,
// so that a multiprocessor keeps several rows' loads in flight. Each thread copies its own vectors and makes
// each one's values as it lands, while its later copies are in flight; only the amax (and the norm's sum of
// squares) joins the block's threads. Where the row is one chunk its values stay in shared memory until they
// are quantized; a longer row is copied and made again, chunk by chunk, to quantize.
#pragma once

#include <cuda_fp8.h>
#include <stdint.h>

#include "common/dtype_traits.cuh"
#include "common/ptx.cuh"
#include "elementwise/elementwise.cuh"
#include "elementwise/elementwise.h"

namespace tpkit {

constexpr int kQuantizeMaxThreads = 512;
constexpr int kQuantizeVectorsPerThread = 4;  // a row's vectors a thread takes, where the row is long enough
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

// The sum of every thread's `x` in the block, every thread getting it; a barrier for the block's global writes
// before it.
__device__ __forceinline__ float block_sum(float x) {
  __shared__ float warp_sum[kQuantizeMaxThreads / 32];
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) x += __shfl_xor_sync(0xffffffffu, x, offset);
  if (threadIdx.x % 32 == 0) warp_sum[threadIdx.x / 32] = x;
  __syncthreads();
  x = 0.f;
  for (int w = 0; w < static_cast<int>(blockDim.x / 32); ++w) x += warp_sum[w];
  return x;
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

// x / scale as IEEE division computes it (torch.div of the promoted input), for every x and scale.
struct ExactQuotient {
  float scale;
  __device__ __forceinline__ float operator()(float x) const { return x / scale; }
};

// x / scale from `inverse`, the correctly rounded 1 / scale: q = x * inverse is within an ulp of the quotient,
// and one correction, q + (x - q * scale) * inverse with each step one fma, rounds it correctly (Markstein's
// theorem), where no step overflows and the scale and its inverse are positive normal numbers. A quotient
// that underflows may differ from the IEEE one but rounds to the same float8 (zero); the sign is x's, as a
// zero quotient's is. Three operations instead of a division's sequence.
struct ReciprocalQuotient {
  float scale, inverse;
  __device__ __forceinline__ float operator()(float x) const {
    const float q = x * inverse;
    return copysignf(fmaf(fmaf(-q, scale, x), inverse, q), x);
  }
};

// Whether ReciprocalQuotient gives the IEEE quotient over `scale` of every value of a row of magnitudes up
// to `amax`: a finite row (no NaN, no infinity) whose largest quotient does not overflow.
__device__ __forceinline__ bool reciprocal_applies(bool finite_row, float amax, float scale, float inverse) {
  constexpr float kLargest = 0x1p126f;  // below overflow for the correction's steps
  return finite_row && scale >= 0x1p-126f && scale < kLargest && inverse >= 0x1p-126f && amax * inverse < kLargest;
}

// Eight values `quotient(x)` (x / scale), saturated to +-448 and rounded to nearest even into float8 E4M3:
// the saturating conversion is the clamp to +-448 and torch's conversion for every quotient but NaN, which it
// maps to NaN without its sign; kNanPossible rows (a NaN or infinity in the row, or a scale that is not finite
// and nonzero) put the sign back.
template <typename T, bool kNanPossible, typename Quotient>
__device__ __forceinline__ uint2 quantize8(const uint4 raw, const Quotient& quotient) {
  Vector8<T> x;
  x.raw = raw;
  uint32_t words[2] = {0u, 0u};
#pragma unroll
  for (int p = 0; p < kVector / 2; ++p) {
    const float lo = quotient(DTypeTraits<T>::to_float(x.values[2 * p]));
    const float hi = quotient(DTypeTraits<T>::to_float(x.values[2 * p + 1]));
    uint32_t pair = __nv_cvt_float2_to_fp8x2(make_float2(lo, hi), __NV_SATFINITE, __NV_E4M3);
    if constexpr (kNanPossible) {
      if (isnan(lo)) pair = (pair & 0xff00u) | fp8_nan(lo);
      if (isnan(hi)) pair = (pair & 0x00ffu) | (fp8_nan(hi) << 8);
    }
    words[p / 2] |= pair << (16 * (p % 2));
  }
  return make_uint2(words[0], words[1]);
}

// x times rstd times the norm's weight w, in float32, rounded once to T (torch's fused RMSNorm).
template <typename T>
__device__ __forceinline__ uint4 normed8(const uint4 x, const uint4 w, float rstd) {
  return map8<T>(x, w, [rstd](float v, float weight) { return v * rstd * weight; });
}

// s = x + y of eight values each, rounded to T, with `squares` += the sum of s's squares in float32.
template <typename T>
__device__ __forceinline__ uint4 add8(const uint4 x, const uint4 y, float& squares) {
  Vector8<T> s;
  s.raw = map8<T>(x, y, [](float a, float b) { return a + b; });
#pragma unroll
  for (int i = 0; i < kVector; ++i) {
    const float v = DTypeTraits<T>::to_float(s.values[i]);
    squares = fmaf(v, v, squares);
  }
  return s.raw;
}

// How a staged chunk becomes the row's values: make(smem, chunk, j, column) is vector j of the chunk (the
// row's vector `column`) from the parts staged (part p's vector j at smem + p * chunk + j).
// The input's row, as it is.
struct RowValues {
  __device__ __forceinline__ uint4 make(const uint4* smem, int64_t, int64_t j, int64_t) const { return smem[j]; }
};

// silu(gate) * up, the gate in part 0 and the up in part 1.
template <typename T>
struct SiluAndMulValues {
  __device__ __forceinline__ uint4 make(const uint4* smem, int64_t chunk, int64_t j, int64_t) const {
    return silu_and_mul8<T>(smem[j], smem[chunk + j]);
  }
};

// The staged row (the residual sum) normed by rstd and the norm's weight.
template <typename T>
struct NormedValues {
  const uint4* weight;
  float rstd;
  __device__ __forceinline__ uint4 make(const uint4* smem, int64_t, int64_t j, int64_t column) const {
    return normed8<T>(smem[j], __ldg(weight + column), rstd);
  }
};

// Copies this thread's vectors j of chunk [base, base + count) (j = threadIdx.x, then a block's width apart)
// of each part's row (part p from rows[p]) into smem, part p's at smem + p * chunk + j, a cp.async group for
// each j; then calls visit(j) as each group lands, so that a thread's later copies are in flight while it
// works on the earlier ones. A thread reads only the shared memory its own copies wrote, so no barrier is
// needed between chunks or before the visits.
template <int kParts, typename Visit>
__device__ __forceinline__ void stage_each(uint4* smem, const uint4* const (&rows)[kParts], int parts, int64_t base,
                                           int64_t count, int64_t chunk, Visit&& visit) {
  int pending = 0;
  for (int64_t j = threadIdx.x; j < count; j += blockDim.x, ++pending) {
#pragma unroll
    for (int p = 0; p < kParts; ++p) {
      if (p < parts) cp_async_16(smem_addr(smem + p * chunk + j), rows[p] + base + j, true);
    }
    cp_async_commit();
  }
  for (int64_t j = threadIdx.x; j < count; j += blockDim.x) {
    cp_async_wait_dynamic(--pending);
    visit(j);
  }
}

// Quantizes the row's values into `out` by `quotient`: from shared memory where the row is one chunk (its
// values kept there), else each chunk staged and its values made again.
template <typename T, bool kNanPossible, int kParts, typename Values, typename Quotient>
__device__ __forceinline__ void store_row(const Values& values, uint4* smem, const uint4* const (&rows)[kParts],
                                          int parts, int64_t vectors, int64_t chunk, uint2* out,
                                          const Quotient& quotient) {
  if (vectors <= chunk) {
    for (int64_t j = threadIdx.x; j < vectors; j += blockDim.x) out[j] = quantize8<T, kNanPossible>(smem[j], quotient);
    return;
  }
  for (int64_t base = 0; base < vectors; base += chunk) {
    stage_each(smem, rows, parts, base, min(chunk, vectors - base), chunk, [&](int64_t j) {
      out[base + j] = quantize8<T, kNanPossible>(values.make(smem, chunk, j, base + j), quotient);
    });
  }
}

// Quantizes row blockIdx.x of `values` (`vectors` of them, made from `parts` rows of inputs) into a.out and
// a.scale. `staged`: the row is one chunk and smem holds its inputs already, each thread's own vectors.
template <typename T, int kParts, typename Values>
__device__ __forceinline__ void quantize_row(const tpkit_quantize_fp8_args& a, const Values& values, uint4* smem,
                                             const uint4* const (&rows)[kParts], int parts, int64_t vectors,
                                             int64_t chunk, bool staged) {
  const int64_t r = blockIdx.x;
  uint2* out = reinterpret_cast<uint2*>(static_cast<uint8_t*>(a.out) + r * vectors * kVector);
  uint32_t magnitudes = 0u;  // two 16-bit magnitudes' bit patterns
  // Where the row is one chunk its values stay in shared memory, each in place of its vector of part 0.
  const bool keep = vectors <= chunk;
  const auto made = [&](int64_t j, int64_t column) {
    const uint4 v = values.make(smem, chunk, j, column);
    if (keep) smem[j] = v;
    magnitudes = max_magnitudes(magnitudes, v);
  };
  if (staged) {
    for (int64_t j = threadIdx.x; j < vectors; j += blockDim.x) made(j, j);
  } else {
    for (int64_t base = 0; base < vectors; base += chunk) {
      stage_each(smem, rows, parts, base, min(chunk, vectors - base), chunk,
                 [&](int64_t j) { made(j, base + j); });
    }
  }
  const uint32_t amax_bits = block_max(max(magnitudes & 0xffffu, magnitudes >> 16));
  const float amax = magnitude_value<T>(amax_bits);
  const float scale = a.static_scale != nullptr ? *a.static_scale : dynamic_scale(amax, a.amax_bound);
  if (threadIdx.x == 0) a.scale[r] = scale;
  const float inverse = 1.f / scale;
  // A finite row over a finite, nonzero scale has no NaN quotient.
  if (reciprocal_applies(amax_bits < kInfBits<T>, amax, scale, inverse)) {
    store_row<T, false>(values, smem, rows, parts, vectors, chunk, out, ReciprocalQuotient{scale, inverse});
  } else {
    store_row<T, true>(values, smem, rows, parts, vectors, chunk, out, ExactQuotient{scale});
  }
}

template <typename T>
__device__ __forceinline__ const uint4* row_vectors(const void* base, int64_t row, int64_t stride) {
  return reinterpret_cast<const uint4*>(static_cast<const T*>(base) + row * stride);
}

// The kernels take the chunk (vectors of each part staged at once) besides their arguments; the launch gives
// them parts * chunk * 16 bytes of dynamic shared memory.
template <typename T>
__global__ void __launch_bounds__(kQuantizeMaxThreads) quantize_fp8_kernel(const tpkit_quantize_fp8_args a,
                                                                           int64_t chunk) {
  extern __shared__ uint4 smem[];
  const uint4* const rows[1] = {row_vectors<T>(a.input, blockIdx.x, a.input_stride)};
  quantize_row<T>(a, RowValues{}, smem, rows, 1, a.features / kVector, chunk, false);
}

template <typename T>
__global__ void __launch_bounds__(kQuantizeMaxThreads) silu_and_mul_quantize_fp8_kernel(
    const tpkit_quantize_fp8_args a, int64_t chunk) {
  extern __shared__ uint4 smem[];
  const int64_t vectors = a.features / kVector;
  const uint4* gate = row_vectors<T>(a.input, blockIdx.x, a.input_stride);
  const uint4* const rows[2] = {gate, gate + vectors};
  quantize_row<T>(a, SiluAndMulValues<T>{}, smem, rows, 2, vectors, chunk, false);
}

// The row (with the residual added first, and the sum written to residual_out), its rstd from the float32 sum
// of its squares, then the normed row quantized. The sum is kept in shared memory where the row is one chunk,
// else copied again from residual_out (or the input) chunk by chunk.
template <typename T>
__global__ void __launch_bounds__(kQuantizeMaxThreads) rms_norm_quantize_fp8_kernel(
    const tpkit_rms_norm_quantize_fp8_args a, int64_t chunk) {
  extern __shared__ uint4 smem[];
  const tpkit_quantize_fp8_args& q = a.quantize;
  const int64_t r = blockIdx.x, vectors = q.features / kVector;
  const bool has_residual = a.residual != nullptr;
  const uint4* input = row_vectors<T>(q.input, r, q.input_stride);
  uint4* sum = has_residual ? reinterpret_cast<uint4*>(static_cast<T*>(a.residual_out) + r * q.features) : nullptr;
  const uint4* const inputs[2] = {input, has_residual ? row_vectors<T>(a.residual, r, a.residual_stride) : input};
  // Without a residual the row plus -0, which is the row bit for bit (-0 included).
  const uint4 negative_zero = make_uint4(0x80008000u, 0x80008000u, 0x80008000u, 0x80008000u);
  float squares = 0.f;
  for (int64_t base = 0; base < vectors; base += chunk) {
    stage_each(smem, inputs, has_residual ? 2 : 1, base, min(chunk, vectors - base), chunk, [&](int64_t j) {
      const uint4 s = add8<T>(smem[j], has_residual ? smem[chunk + j] : negative_zero, squares);
      smem[j] = s;
      if (has_residual) sum[base + j] = s;
    });
  }
  // block_sum's barrier: the sums are in shared memory (and residual_out) for every thread.
  const float rstd = rsqrtf(block_sum(squares) / static_cast<float>(q.features) + a.eps);
  const uint4* const normed_rows[1] = {has_residual ? sum : input};
  quantize_row<T>(q, NormedValues<T>{static_cast<const uint4*>(a.norm_weight), rstd}, smem, normed_rows, 1,
                  vectors, chunk, vectors <= chunk);
}

}  // namespace tpkit

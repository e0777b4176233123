// Float8 KV caches in the tensor-core kernel: the shared-memory layout of a stage's rows as stored, and the
// query rows rewritten for products that read those rows straight from the stage. Torch-free.
#pragma once

#include <math.h>
#include <stdint.h>

#include <cuda_fp16.h>

#include "common/dtype_traits.cuh"

namespace tpkit {

// Shared-memory layout of a float8 stage's row (a token's K or V as stored, HEAD bytes) in 16-byte chunks,
// one mma k-step each. ldmatrix reads a chunk of 8 consecutive rows at once, which must sit in 8 distinct
// bank groups: rows of 1, 2, 4 or a multiple of 8 chunks are unpadded and swizzled (chunk c of row r at c ^
// swizzle(r)), other rows padded to an odd number of chunks.
template <int HEAD>
struct Fp8Layout {
  static_assert(HEAD % 16 == 0, "float8 rows load in 16-byte chunks");
  static constexpr int kChunks = HEAD / 16;
  static constexpr bool kSwizzled = kChunks == 1 || kChunks == 2 || kChunks == 4 || kChunks % 8 == 0;
  static constexpr int kRowStride = kSwizzled ? kChunks : kChunks | 1;
  static constexpr int kRowBytes = kRowStride * 16;
  // The XOR on row r's chunk index: one chunk of 8 consecutive rows (from a multiple of 8) lands in 8
  // distinct 16-byte slots of the 128-byte lines, however many rows a line holds.
  __device__ static int swizzle(int r) {
    return kChunks >= 8 ? r & 7 : kChunks == 4 ? (r >> 1) & 3 : kChunks == 2 ? (r >> 2) & 1 : 0;
  }
  // Where chunk c of row r is stored (in chunks from the stage's start).
  __device__ static int chunk(int r, int c) { return r * kRowStride + (kSwizzled ? c ^ swizzle(r) : c); }
  // ldmatrix of chunk (even k) + x of row r: address at(row address + k * 16, lane_bits(r, x)) + lane_base(x)
  // * 16, the swizzle one XOR of address bits 4-6 (rows start kRowBytes-aligned).
  __device__ static int lane_base(int x) { return kSwizzled ? 0 : x; }
  __device__ static uint32_t lane_bits(int r, int x) { return kSwizzled ? (x ^ swizzle(r)) << 4 : 0u; }
  __device__ static uint32_t at(uint32_t addr, uint32_t bits) { return kSwizzled ? addr ^ bits : addr; }
};

// A float8 cache's products run in fp16, which holds every float8 value exactly; the block's query rows
// (layout L, in shared memory) are rewritten for them once, by every thread (the caller synchronises before
// and after). bf16 queries are converted, times 2^-q_exp, the power of two that brings the block's largest
// magnitude into [2^14, 2^15) (bf16 exceeds fp16's range; returns q_exp, which the score scale takes back).
// Each k-step's 16 columns are reordered to columns 0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15: an
// ldmatrix of float8 K gives a lane 4 consecutive columns (4c .. 4c + 3) where the mma takes columns 2c, 2c +
// 1, 2c + 8, 2c + 9, and a dot product does not depend on the order of its terms. max_bits: a shared word,
// zeroed before the caller's barrier.
template <typename T, typename L>
__device__ __forceinline__ int prepare_fp8_query(uint4* q_s, int rows, unsigned* max_bits) {
  int q_exp = 0;
  if constexpr (DTypeTraits<T>::kIsBF16) {
    float mx = 0.f;  // fmaxf skips NaN: NaN queries stay NaN below, whatever the scale
    for (int i = threadIdx.x; i < rows * L::kPaddedChunks; i += blockDim.x) {
      const int r = i / L::kPaddedChunks;
      const uint4 x = q_s[r * L::kRowStride + L::chunk(r, i - r * L::kPaddedChunks)];
      const uint32_t w[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        mx = fmaxf(mx, fmaxf(fabsf(__uint_as_float(w[j] << 16)), fabsf(__uint_as_float(w[j] & 0xffff0000u))));
      }
    }
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, offset));
    if ((threadIdx.x & 31) == 0) atomicMax(max_bits, __float_as_uint(mx));  // non-negative: ordered as ints
    __syncthreads();
    const float block_max = __uint_as_float(*max_bits);
    q_exp = block_max > 0.f && block_max <= 3.4028235e38f ? ilogbf(block_max) - 14 : 0;
  }
  const float q_mul = ldexpf(1.f, -q_exp);
  auto to_half2 = [&](uint32_t w) -> uint32_t {
    if constexpr (!DTypeTraits<T>::kIsBF16) return w;
    return DTypeTraits<__half>::pack2(__uint_as_float(w << 16) * q_mul, __uint_as_float(w & 0xffff0000u) * q_mul);
  };
  for (int i = threadIdx.x; i < rows * L::kKSteps; i += blockDim.x) {
    const int r = i / L::kKSteps;
    const int ks = i - r * L::kKSteps;
    uint4* lo = q_s + r * L::kRowStride + L::chunk(r, 2 * ks);
    uint4* hi = q_s + r * L::kRowStride + L::chunk(r, 2 * ks + 1);
    const uint4 x = *lo, y = *hi;  // column pairs 0-3 and 4-7 of the k-step
    *lo = make_uint4(to_half2(x.x), to_half2(x.z), to_half2(y.x), to_half2(y.z));
    *hi = make_uint4(to_half2(x.y), to_half2(x.w), to_half2(y.y), to_half2(y.w));
  }
  return q_exp;
}

}  // namespace tpkit

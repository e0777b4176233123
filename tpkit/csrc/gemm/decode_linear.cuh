// The decode linear kernel: out[m, n] = sum_k input[m, k] weight[n, k] (+ bias[n]) for up to 16 rows m,
// with SwiGLU, RoPE and the KV-cache write, or a residual add and an RMSNorm's first half in its epilogue
// where asked, and an RMSNorm's second half (a row's scale) on any of them. Torch-free.
//
// A decode step's product reads a whole weight matrix for a handful of rows, so it runs at the speed the
// weight streams in; what a general GEMM adds on top (tiles staged in shared memory, a split-K reduction
// kernel) is fixed cost that shows at these sizes. Here each warp streams its slice of 8 weight rows straight from global
// memory into tensor-core operands, 16 bytes a lane a step, and the warps that share those rows meet once,
// in shared memory, at the end.
#pragma once

#include <stdint.h>

#include "gemm/decode_linear.h"
#include "common/dtype_traits.cuh"
#include "common/fp8.cuh"
#include "common/ptx.cuh"

namespace tpkit {

constexpr int kLinearRowGroups = 2;  // groups of 8 weight rows (output features) a thread block computes
constexpr int kLinearStep = 32;      // in_features one step of a warp covers: 4 lanes x 8 of each row
// Resident threads a multiprocessor must fit: the register cap (64) that lets the compiler keep several
// steps' loads in flight without giving up occupancy (the plain loop under this bound streams faster than
// one of fewer registers, or a ring of loads refilled after each step's products).
constexpr int kLinearThreadsPerSM = 1024;

// One step: a lane's 16 bytes of its weight row and of its input rows r (lower) and r + 8 (upper) fill its
// k-slots (2t, 2t+1, 2t+8, 2t+9) of two products. A sum does not care which column a slot holds, so long
// as the input's and the weight's agree.
template <bool kBF16, bool kUpperRows>
__device__ __forceinline__ void multiply_loaded(float (&c)[4], const uint4 w, const uint4* __restrict__ lower,
                                                const uint4* __restrict__ upper) {
  const uint4 x = *lower, y = kUpperRows ? *upper : make_uint4(0, 0, 0, 0);
  const uint32_t a0[4] = {x.x, y.x, x.y, y.y};
  const uint32_t a1[4] = {x.z, y.z, x.w, y.w};
  mma_m16n8k16<kBF16>(c, a0, w.x, w.y);
  mma_m16n8k16<kBF16>(c, a1, w.z, w.w);
}

// One step with the operands swapped, for at most 8 input rows: the lane's 16 bytes of weight rows r (lower,
// the first group's) and r + 8 (upper, the second group's) as A, its 16 bytes of input row r as B, so that
// one m16n8k16 product covers 16 features and none of its rows is padding: half the products of
// multiply_loaded for the same weight bytes.
template <bool kBF16>
__device__ __forceinline__ void multiply_swapped(float (&c)[4], const uint4 lower, const uint4 upper,
                                                 const uint4 x) {
  const uint32_t a0[4] = {lower.x, upper.x, lower.y, upper.y};
  const uint32_t a1[4] = {lower.z, upper.z, lower.w, upper.w};
  mma_m16n8k16<kBF16>(c, a0, x.x, x.y);
  mma_m16n8k16<kBF16>(c, a1, x.z, x.w);
}

template <bool kBF16, bool kUpperRows>
__device__ __forceinline__ void multiply_step(float (&c)[4], const uint4* __restrict__ weight,
                                              const uint4* __restrict__ lower, const uint4* __restrict__ upper) {
  multiply_loaded<kBF16, kUpperRows>(c, *weight, lower, upper);
}

// Warp `split` of a group's kSplits: weight rows n0 + r times input rows r and r + 8 (kUpperRows) over the
// split-th share of in_features, into c (multiply_loaded's layout).
template <typename T, int kSplits, bool kUpperRows, bool kFp8Weight>
__device__ __forceinline__ void multiply_rows(float (&c)[4], const tpkit_decode_linear_args& a, int split, int n0,
                                              int r, int t) {
  constexpr bool kBF16 = DTypeTraits<T>::kIsBF16;
  constexpr int kUnits = kLinearStep * sizeof(T) / 16;  // 16-byte units a step advances a row by
  const int steps = a.in_features / kLinearStep;
  const T* input = static_cast<const T*>(a.input);
  const int64_t row_start = static_cast<int64_t>(n0 + r) * a.in_features;
  // Rows past num_rows read the last row again: in bounds, and their sums are never stored.
  const uint4* __restrict__ lower = reinterpret_cast<const uint4*>(input + min(r, a.num_rows - 1) * a.input_stride) + t;
  const uint4* __restrict__ upper =
      reinterpret_cast<const uint4*>(input + min(r + 8, a.num_rows - 1) * a.input_stride) + t;
  if constexpr (kFp8Weight) {
    const uint8_t* weight_row = static_cast<const uint8_t*>(a.weight) + row_start;
    if (steps % 2 == 0) {
      // 16-byte loads, one per pair of steps (64 columns): a lane's 16 weights are the row's columns
      // 16t .. 16t + 15, whose inputs are the pair's 16-byte units 2t and 2t + 1 (lower + t is unit 2t).
      const uint4* __restrict__ weight = reinterpret_cast<const uint4*>(weight_row) + t;
      const int pairs = steps / 2;
#pragma unroll 2
      for (int pair = split * pairs / kSplits; pair < (split + 1) * pairs / kSplits; ++pair) {
        const uint4 w = weight[pair * 4];
        const int u = 2 * pair * kUnits + t;
        multiply_loaded<kBF16, kUpperRows>(c, fp8x8_to<T>(make_uint2(w.x, w.y)), lower + u, upper + u);
        multiply_loaded<kBF16, kUpperRows>(c, fp8x8_to<T>(make_uint2(w.z, w.w)), lower + u + 1, upper + u + 1);
      }
    } else {
      // 8-byte units: a step advances a float8 row by 32 bytes, a lane's 8 weights at unit t.
      const uint2* __restrict__ weight = reinterpret_cast<const uint2*>(weight_row) + t;
#pragma unroll 4
      for (int step = split * steps / kSplits; step < (split + 1) * steps / kSplits; ++step) {
        const int u = step * kUnits;
        multiply_loaded<kBF16, kUpperRows>(c, fp8x8_to<T>(weight[step * 4]), lower + u, upper + u);
      }
    }
  } else {
    const uint4* __restrict__ weight = reinterpret_cast<const uint4*>(static_cast<const T*>(a.weight) + row_start) + t;
#pragma unroll 4
    for (int step = split * steps / kSplits; step < (split + 1) * steps / kSplits; ++step) {
      const int u = step * kUnits;
      multiply_step<kBF16, kUpperRows>(c, weight + u, lower + u, upper + u);
    }
  }
}

// Float8 weights, at most 8 input rows: warp `share` of a block's kShares multiplies weight rows
// lower_n0 + r and upper_n0 + r (the two groups' 8 each) by input row r over the share-th share of
// in_features, into c (multiply_swapped's layout): half the products and input loads of multiply_rows for the
// same weight bytes. Float8 weights only: a 16-bit weight brings twice the bytes a product, and its stream
// bounds the kernel either way.
template <typename T, int kShares>
__device__ __forceinline__ void multiply_swapped_rows(float (&c)[4], const tpkit_decode_linear_args& a, int share,
                                                      int lower_n0, int upper_n0, int r, int t) {
  constexpr bool kBF16 = DTypeTraits<T>::kIsBF16;
  constexpr int kUnits = kLinearStep * sizeof(T) / 16;
  const int steps = a.in_features / kLinearStep;
  const uint8_t* weight = static_cast<const uint8_t*>(a.weight);
  const int64_t lower_start = static_cast<int64_t>(lower_n0 + r) * a.in_features;
  const int64_t upper_start = static_cast<int64_t>(upper_n0 + r) * a.in_features;
  const uint4* __restrict__ x =
      reinterpret_cast<const uint4*>(static_cast<const T*>(a.input) + min(r, a.num_rows - 1) * a.input_stride) + t;
  if (steps % 2 == 0) {
    // A lane's 16 weights of each row a pair of steps, as in multiply_rows.
    const uint4* __restrict__ lower = reinterpret_cast<const uint4*>(weight + lower_start) + t;
    const uint4* __restrict__ upper = reinterpret_cast<const uint4*>(weight + upper_start) + t;
    const int pairs = steps / 2;
#pragma unroll 2
    for (int pair = share * pairs / kShares; pair < (share + 1) * pairs / kShares; ++pair) {
      const uint4 lw = load_streaming(lower + pair * 4), uw = load_streaming(upper + pair * 4);
      const int u = 2 * pair * kUnits + t;
      multiply_swapped<kBF16>(c, fp8x8_to<T>(make_uint2(lw.x, lw.y)), fp8x8_to<T>(make_uint2(uw.x, uw.y)), x[u]);
      multiply_swapped<kBF16>(c, fp8x8_to<T>(make_uint2(lw.z, lw.w)), fp8x8_to<T>(make_uint2(uw.z, uw.w)), x[u + 1]);
    }
  } else {
    const uint2* __restrict__ lower = reinterpret_cast<const uint2*>(weight + lower_start) + t;
    const uint2* __restrict__ upper = reinterpret_cast<const uint2*>(weight + upper_start) + t;
#pragma unroll 4
    for (int step = share * steps / kShares; step < (share + 1) * steps / kShares; ++step) {
      multiply_swapped<kBF16>(c, fp8x8_to<T>(load_streaming(lower + step * 4)),
                              fp8x8_to<T>(load_streaming(upper + step * 4)), x[step * kUnits]);
    }
  }
}

// What a block does with its sums (decode_linear.h): store them, combine gate and up (SwiGLU), rotate q
// and k heads and write k and v to the cache as well (kRotaryFp8Cache: quantized into a float8 cache), or
// add the residual and start the next RMSNorm. The float8 cache's write is an epilogue of its own so that
// the 16-bit cache's kernels keep their registers.
enum class LinearEpilogue { kPlain, kSiLUAndMul, kRotaryCache, kRotaryFp8Cache, kResidualNorm };

// One block: kLinearRowGroups x kSplits warps; warp (group, split) multiplies 8 weight rows over the
// split-th share of in_features with m16n8k16 products: the input as A (rows 0-7 and, with kUpperRows,
// 8-15), the weight as B. The block's two groups take 16 weight rows: 16 consecutive features; with
// kSiLUAndMul, the gate's 8 rows and the up projection's same 8 features; with kRotaryCache, in a q or k
// head, 8 features and the 8 they rotate with (head_size / 2 on), so that the epilogue combines them.
// kFp8Weight: the weight is float8 (E4M3), 8 bytes a lane a step converted to T in registers, and each
// feature's sum is multiplied by its weight_scale (decode_linear.h), whichever the epilogue.
template <typename T, int kSplits, bool kUpperRows, LinearEpilogue kEpilogue, bool kFp8Weight = false>
__global__ void __launch_bounds__(kLinearRowGroups * kSplits * 32,
                                  kLinearThreadsPerSM / (kLinearRowGroups * kSplits * 32))
    decode_linear_kernel(const tpkit_decode_linear_args a) {
  static_assert(kLinearRowGroups == 2, "two groups: gate and up, or a rotation's two halves");
  constexpr bool kSiLUAndMul = kEpilogue == LinearEpilogue::kSiLUAndMul;
  constexpr bool kFp8Cache = kEpilogue == LinearEpilogue::kRotaryFp8Cache;
  constexpr bool kRotaryCache = kEpilogue == LinearEpilogue::kRotaryCache || kFp8Cache;
  constexpr bool kResidualNorm = kEpilogue == LinearEpilogue::kResidualNorm;
  using Traits = DTypeTraits<T>;
  // Float8 weights and at most 8 input rows: every warp of the block multiplies both groups' rows
  // (multiply_swapped_rows) over its share of in_features; else a group's kSplits warps share its rows.
  constexpr bool kSwapped = kFp8Weight && !kUpperRows;
  constexpr int kShares = kSwapped ? kLinearRowGroups * kSplits : kSplits;
  __shared__ float partial[kLinearRowGroups][kShares][16][8];  // [group][share][row m][feature n]
  __shared__ float squares[kResidualNorm ? 16 : 1][16];        // [row m][the block's feature]: x^2
  __shared__ float row_scale[16];                              // each row's RMSNorm scale (rms_sums)
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int r = lane / 4, t = lane % 4;  // a lane's row (of input and of weight) and its 16 bytes a step
  // The block's first feature of each group: with kSiLUAndMul, the gate's features (as many as the up
  // projection's) are a.out_features / 2; with kRotaryCache, a q or k head takes head_size / 16 blocks.
  const int half_head = kRotaryCache ? a.head_size / 2 : 0;
  const bool rotates = kRotaryCache && blockIdx.x * 16 < a.rotary_features;
  const int head_blocks = kRotaryCache ? a.head_size / 16 : 1;
  const int rotary_n0 = kRotaryCache ? blockIdx.x / head_blocks * a.head_size + blockIdx.x % head_blocks * 8 : 0;
  const int block = blockIdx.x;
  auto first_feature = [&](int g) {
    if (kSiLUAndMul) return block * 8 + (g == 0 ? 0 : a.out_features / 2);
    if (rotates) return rotary_n0 + (g == 0 ? 0 : half_head);
    return (block * kLinearRowGroups + g) * 8;
  };
  // In the split RMSNorm's kernels, what the epilogue reads besides the sums is asked for now, so that its
  // latency hides behind the weight's stream rather than adding to the epilogue's: a row's sum
  // of squares (threads 0-15), and the residual and norm weight of the thread's first epilogue element (its
  // only one at 4 or 8 warps a row group). The plain kernel, whose registers the hoisting would raise,
  // reads its rms_sums in the epilogue.
  constexpr bool kHoisted = kEpilogue != LinearEpilogue::kPlain;
  const bool reads_rms_sum = a.rms_sums != nullptr && threadIdx.x < a.num_rows;
  const double rms_sum = kHoisted && reads_rms_sum ? a.rms_sums[threadIdx.x] : 0.0;
  const int first_m = threadIdx.x / 8 % 16;
  const int first_n = (blockIdx.x * kLinearRowGroups + threadIdx.x / 128) * 8 + threadIdx.x % 8;
  const bool first_in_bounds =
      threadIdx.x < kLinearRowGroups * 16 * 8 && first_m < a.num_rows && first_n < a.out_features;
  float first_residual = 0.f, first_norm_weight = 0.f;
  if (kResidualNorm && first_in_bounds) {
    first_residual = Traits::to_float(static_cast<const T*>(a.residual)[first_m * a.out_features + first_n]);
    first_norm_weight = Traits::to_float(static_cast<const T*>(a.norm_weight)[first_n]);
  }
  float c[4] = {0.f, 0.f, 0.f, 0.f};
  if constexpr (kSwapped) {
    const int lower_n0 = first_feature(0), upper_n0 = first_feature(1);
    // A second group past the last feature reads the first group's rows again: in bounds, never stored.
    if (lower_n0 < a.out_features) {
      multiply_swapped_rows<T, kShares>(c, a, warp, lower_n0, upper_n0 < a.out_features ? upper_n0 : lower_n0, r,
                                        t);
    }
    // c: feature r of the first group (c[0], c[1]) and of the second (c[2], c[3]), input rows 2t and 2t + 1.
    partial[0][warp][2 * t][r] = c[0];
    partial[0][warp][2 * t + 1][r] = c[1];
    partial[1][warp][2 * t][r] = c[2];
    partial[1][warp][2 * t + 1][r] = c[3];
  } else {
    const int group = warp / kSplits, split = warp % kSplits;
    const int n0 = first_feature(group);
    if (n0 < a.out_features) multiply_rows<T, kSplits, kUpperRows, kFp8Weight>(c, a, split, n0, r, t);
    // c: input rows r and r + 8, features 2t and 2t + 1 of the group's 8.
    partial[group][split][r][2 * t] = c[0];
    partial[group][split][r][2 * t + 1] = c[1];
    partial[group][split][r + 8][2 * t] = c[2];
    partial[group][split][r + 8][2 * t + 1] = c[3];
  }
  // The next kernel may launch (the attention kernel, launched as a programmatic dependent, waits for this
  // grid's results and meanwhile asks L2 for what its prologue reads).
  grid_launch_dependents();
  if (reads_rms_sum) {
    const float sum = static_cast<float>(kHoisted ? rms_sum : a.rms_sums[threadIdx.x]);
    row_scale[threadIdx.x] = rsqrtf(sum / a.in_features + a.eps);
  }
  __syncthreads();
  T* out = static_cast<T*>(a.out);
  const T* bias = static_cast<const T*>(a.bias);
  // Group g's feature j of row m: the sum of its splits (times the row's RMSNorm scale) and its bias, in
  // float.
  auto product = [&](int g, int m, int j, int n) {
    float sum = 0.f;
#pragma unroll
    for (int s = 0; s < kShares; ++s) sum += partial[g][s][m][j];
    if (a.rms_sums != nullptr) sum *= row_scale[m];
    if constexpr (kFp8Weight) sum *= a.weight_scale[n];
    return bias != nullptr ? sum + Traits::to_float(bias[n]) : sum;
  };
  if constexpr (kSiLUAndMul) {
    const int features = a.out_features / 2;
    for (int i = threadIdx.x; i < 16 * 8; i += blockDim.x) {
      const int m = i / 8, j = i % 8, n = blockIdx.x * 8 + j;
      if (m >= a.num_rows || n >= features) continue;
      // gate and up rounded to the dtype first, as the plain product's output would be.
      const float gate = Traits::to_float(Traits::from_float(product(0, m, j, n)));
      const float up = Traits::to_float(Traits::from_float(product(1, m, j, features + n)));
      out[m * a.out_stride + n] = Traits::from_float(gate / (1.f + __expf(-gate)) * up);
    }
    return;
  }
  if constexpr (kRotaryCache) {
    for (int i = threadIdx.x; i < kLinearRowGroups * 16 * 8; i += blockDim.x) {
      const int g = i / 128, m = i / 8 % 16, j = i % 8;
      const int n = rotates ? rotary_n0 + j + (g == 0 ? 0 : half_head) : (blockIdx.x * kLinearRowGroups + g) * 8 + j;
      if (m >= a.num_rows || n >= a.out_features) continue;
      float value = product(g, m, j, n);
      if (rotates) {
        // x1 cos - x2 sin and x2 cos + x1 sin, from the product's halves rounded to the dtype.
        const int partner_n = g == 0 ? n + half_head : n - half_head;
        const float x = Traits::to_float(Traits::from_float(value));
        const float partner = Traits::to_float(Traits::from_float(product(1 - g, m, j, partner_n)));
        const int d = rotary_n0 % a.head_size + j;  // the pair's index in the head's first half
        const float cos = Traits::to_float(static_cast<const T*>(a.cos)[m * half_head + d]);
        const float sin = Traits::to_float(static_cast<const T*>(a.sin)[m * half_head + d]);
        value = g == 0 ? x * cos - partner * sin : x * cos + partner * sin;
      }
      const T rounded = Traits::from_float(value);
      out[m * a.out_stride + n] = rounded;
      const int64_t slot = a.slot_mapping[m];
      const int64_t block = slot / a.block_size;
      if (n < a.q_features || slot < 0 || block >= a.num_blocks) continue;
      const int64_t offset = slot - block * a.block_size;
      const bool is_key = n < a.rotary_features;
      const int kv_n = n - (is_key ? a.q_features : a.rotary_features);
      const int head = kv_n / a.head_size, d = kv_n % a.head_size;
      void* cache = is_key ? a.key_cache : a.value_cache;
      const int64_t index =
          is_key ? block * a.kc_stride_block + offset * a.kc_stride_token + head * a.kc_stride_head + d
                 : block * a.vc_stride_block + offset * a.vc_stride_token + head * a.vc_stride_head + d;
      if constexpr (!kFp8Cache) {
        static_cast<T*>(cache)[index] = rounded;
      } else {
        // The rounded value, as the layers' forward hands it to the quantizing cache write.
        const float scale = (is_key ? a.k_scale : a.v_scale)[a.scale_per_head ? head : 0];
        const __nv_fp8_interpretation_t format = a.cache_fp8 == TPKIT_FP8_E5M2 ? __NV_E5M2 : __NV_E4M3;
        static_cast<__nv_fp8_storage_t*>(cache)[index] = quantize_fp8(Traits::to_float(rounded), scale, format);
      }
    }
    return;
  }
  for (int i = threadIdx.x; i < kLinearRowGroups * 16 * 8; i += blockDim.x) {
    const int g = i / 128, m = i / 8 % 16, j = i % 8;
    const int n = (blockIdx.x * kLinearRowGroups + g) * 8 + j;
    if (m >= a.num_rows || n >= a.out_features) {
      if constexpr (kResidualNorm) squares[m][g * 8 + j] = 0.f;
      continue;
    }
    const T rounded = Traits::from_float(product(g, m, j, n));
    if constexpr (kResidualNorm) {
      const int64_t mn = static_cast<int64_t>(m) * a.out_features + n;
      const bool first = i == threadIdx.x;
      const float residual = first ? first_residual : Traits::to_float(static_cast<const T*>(a.residual)[mn]);
      const float norm_weight =
          first ? first_norm_weight : Traits::to_float(static_cast<const T*>(a.norm_weight)[n]);
      // x = round(round(product) + residual), as `residual + product` in the dtype rounds.
      const T x = Traits::from_float(Traits::to_float(rounded) + residual);
      const float xf = Traits::to_float(x);
      out[m * a.out_stride + n] = x;
      static_cast<T*>(a.normed)[mn] = Traits::from_float(xf * norm_weight);
      squares[m][g * 8 + j] = xf * xf;
    } else {
      out[m * a.out_stride + n] = rounded;
    }
  }
  if constexpr (kResidualNorm) {
    __syncthreads();
    if (threadIdx.x < a.num_rows) {
      // The block's 16 squares in a fixed order, then a float64 atomic add: a row's float32 partials add up
      // exactly in float64 while the sum needs at most 53 bits (24 a partial, the spread of their exponents
      // and log2 of their count: a largest partial up to 2^21 times the smallest over 256 blocks), and then
      // the order the blocks' adds land in does not change it: the steps are reproducible.
      float block_sum = 0.f;
#pragma unroll
      for (int f = 0; f < 16; ++f) block_sum += squares[threadIdx.x][f];
      atomicAdd(&a.sums[threadIdx.x], static_cast<double>(block_sum));
      if (blockIdx.x == 0 && a.zero_sums != nullptr) a.zero_sums[threadIdx.x] = 0.0;
    }
  }
}

}  // namespace tpkit

// The C entry points of the decode linear kernel (decode_linear.h): support check, the split of
// in_features over a block's warps, dtype and row-count dispatch. Torch-free.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "gemm/decode_linear.cuh"
#include "common/launch_common.h"

namespace {

// A block computes 16 weight rows: 16 features, or 8 gate and 8 up features of SwiGLU's 8.
int grid_blocks(const tpkit_decode_linear_args* a) {
  constexpr int kRows = tpkit::kLinearRowGroups * 8;
  return (a->out_features + kRows - 1) / kRows;
}

// Warps that share a weight row: 8, each with at least 8 steps of in_features (fewer warps for small
// in_features); 4 where a grid needs a second wave of 8-warp blocks but fits in one of 4-warp blocks
// (which are half the threads, so twice as many resident): a second wave costs more than the shorter
// shares of 8 warps save.
int planned_splits(const tpkit_decode_linear_args* a, int multiprocessors) {
  const int steps = a->in_features / tpkit::kLinearStep;
  int splits = 8;
  while (splits > 1 && steps / splits < 8) splits /= 2;
  const int resident_8 = multiprocessors * (tpkit::kLinearThreadsPerSM / (tpkit::kLinearRowGroups * 8 * 32));
  const int blocks = grid_blocks(a);
  if (splits == 8 && blocks > resident_8 && blocks <= 2 * resident_8) splits = 4;
  return splits;
}

template <typename T, int kSplits, tpkit::LinearEpilogue kEpilogue, bool kFp8Weight = false>
cudaError_t launch_rows(const tpkit_decode_linear_args* a, cudaStream_t stream) {
  const int blocks = grid_blocks(a);
  const int threads = tpkit::kLinearRowGroups * kSplits * 32;
  if (a->num_rows > 8) {
    tpkit::decode_linear_kernel<T, kSplits, true, kEpilogue, kFp8Weight><<<blocks, threads, 0, stream>>>(*a);
  } else {
    tpkit::decode_linear_kernel<T, kSplits, false, kEpilogue, kFp8Weight><<<blocks, threads, 0, stream>>>(*a);
  }
  return cudaGetLastError();
}

// Float8 weights (weight_scale given) or weights of the dtype, with any epilogue.
template <typename T, int kSplits, tpkit::LinearEpilogue kEpilogue>
cudaError_t launch_weight(const tpkit_decode_linear_args* a, cudaStream_t stream) {
  return a->weight_scale != nullptr ? launch_rows<T, kSplits, kEpilogue, true>(a, stream)
                                    : launch_rows<T, kSplits, kEpilogue, false>(a, stream);
}

template <typename T, int kSplits>
cudaError_t launch_splits(const tpkit_decode_linear_args* a, cudaStream_t stream) {
  using tpkit::LinearEpilogue;
  if (a->silu_and_mul) return launch_weight<T, kSplits, LinearEpilogue::kSiLUAndMul>(a, stream);
  if (a->rotary_features > 0 && a->cache_fp8 != TPKIT_FP8_NONE) {
    return launch_weight<T, kSplits, LinearEpilogue::kRotaryFp8Cache>(a, stream);
  }
  if (a->rotary_features > 0) return launch_weight<T, kSplits, LinearEpilogue::kRotaryCache>(a, stream);
  if (a->residual != nullptr) return launch_weight<T, kSplits, LinearEpilogue::kResidualNorm>(a, stream);
  return launch_weight<T, kSplits, LinearEpilogue::kPlain>(a, stream);
}

template <typename T>
cudaError_t launch_dtype(const tpkit_decode_linear_args* a, int splits, cudaStream_t stream) {
  switch (splits) {
    case 1: return launch_splits<T, 1>(a, stream);
    case 2: return launch_splits<T, 2>(a, stream);
    case 4: return launch_splits<T, 4>(a, stream);
    default: return launch_splits<T, 8>(a, stream);
  }
}


}  // namespace

extern "C" {

int tpkit_decode_linear_supported(const tpkit_decode_linear_args* a) {
  const bool dtype_ok = a->dtype == TPKIT_FLOAT16 || a->dtype == TPKIT_BFLOAT16;
  const int features_multiple = a->silu_and_mul ? 16 : 8;
  const bool shape_ok = a->num_rows >= 1 && a->num_rows <= TPKIT_DECODE_LINEAR_MAX_ROWS && a->in_features > 0 &&
                        a->in_features % tpkit::kLinearStep == 0 && a->out_features > 0 &&
                        a->out_features % features_multiple == 0;
  // 16-byte loads of every input and weight row (2-byte elements: strides in multiples of 8).
  const bool aligned = tpkit::aligned16(a->input) && tpkit::aligned16(a->weight) && a->input_stride % 8 == 0;
  const bool splits_ok = a->splits == 0 || a->splits == 1 || a->splits == 2 || a->splits == 4 || a->splits == 8;
  const int hs = a->head_size;
  const bool rotary_ok =
      a->rotary_features == 0 ||
      (!a->silu_and_mul && hs > 0 && hs % 16 == 0 && a->q_features % hs == 0 && a->rotary_features % hs == 0 &&
       a->q_features <= a->rotary_features && a->rotary_features <= a->out_features && a->out_features % hs == 0 &&
       a->cos != nullptr && a->sin != nullptr && a->key_cache != nullptr && a->value_cache != nullptr &&
       a->slot_mapping != nullptr && a->block_size > 0 &&
       (a->cache_fp8 == TPKIT_FP8_NONE || (a->k_scale != nullptr && a->v_scale != nullptr)));
  const bool residual_ok = a->residual == nullptr || (!a->silu_and_mul && a->rotary_features == 0 &&
                                                       a->norm_weight != nullptr && a->normed != nullptr &&
                                                       a->sums != nullptr);
  return dtype_ok && shape_ok && aligned && splits_ok && rotary_ok && residual_ok && a->out != nullptr
             ? 1
             : 0;
}

cudaError_t tpkit_decode_linear_launch(const tpkit_decode_linear_args* a, cudaStream_t stream) {
  if (!tpkit_decode_linear_supported(a)) return cudaErrorInvalidValue;
  int splits = a->splits;
  if (splits == 0) {
    int multiprocessors = 0;
    const cudaError_t err = tpkit::current_device_attribute(cudaDevAttrMultiProcessorCount, &multiprocessors);
    if (err != cudaSuccess) return err;
    splits = planned_splits(a, multiprocessors);
  }
  return a->dtype == TPKIT_BFLOAT16 ? launch_dtype<__nv_bfloat16>(a, splits, stream)
                                    : launch_dtype<__half>(a, splits, stream);
}

}  // extern "C"

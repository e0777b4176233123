// The C entry points of the prefill's element-wise kernels and quantizations (elementwise.h): support checks,
// grid sizes and dtype dispatch. Torch-free.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>

#include "elementwise/elementwise.cuh"
#include "elementwise/quantize_fp8.cuh"
#include "common/launch_common.h"

namespace {

bool is_16bit(tpkit_dtype dtype) { return dtype == TPKIT_FLOAT16 || dtype == TPKIT_BFLOAT16; }

// Enough blocks to fill the device a few times over; the grid-stride loops take the rest.
cudaError_t grid_for(int64_t vectors, int* blocks) {
  int multiprocessors = 0;
  const cudaError_t err = tpkit::current_device_attribute(cudaDevAttrMultiProcessorCount, &multiprocessors);
  if (err != cudaSuccess) return err;
  const int64_t needed = (vectors + tpkit::kElementwiseThreads - 1) / tpkit::kElementwiseThreads;
  *blocks = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(needed, 8LL * multiprocessors)));
  return cudaSuccess;
}

template <typename Args>
cudaError_t launch(void (*bf16)(Args), void (*fp16)(Args), const Args* a, int64_t vectors, cudaStream_t stream) {
  if (vectors == 0) return cudaSuccess;
  int blocks = 0;
  const cudaError_t err = grid_for(vectors, &blocks);
  if (err != cudaSuccess) return err;
  (a->dtype == TPKIT_BFLOAT16 ? bf16 : fp16)<<<blocks, tpkit::kElementwiseThreads, 0, stream>>>(*a);
  return cudaGetLastError();
}

// A quantization's launch: a block a row of q's (the arguments `args`, of which q is the quantization's), with
// `parts` rows of inputs staged `chunk` vectors at a time (a whole row where shared memory holds it). A thread
// for each kQuantizeVectorsPerThread vectors of a chunk, a warp at the least; where the rows are too few for
// that to fill the device, more threads a row (fewer vectors each), so that more of each row loads at once.
template <typename Args>
cudaError_t launch_rows(void (*bf16)(Args, int64_t), void (*fp16)(Args, int64_t), const Args& args,
                        const tpkit_quantize_fp8_args& q, int parts, cudaStream_t stream) {
  if (q.num_rows == 0) return cudaSuccess;
  const auto kernel = q.dtype == TPKIT_BFLOAT16 ? bf16 : fp16;
  int multiprocessors = 0, smem_limit = 0;
  cudaError_t err = tpkit::current_device_attribute(cudaDevAttrMultiProcessorCount, &multiprocessors);
  if (err == cudaSuccess) err = tpkit::kernel_dynamic_smem_limit(reinterpret_cast<const void*>(kernel), &smem_limit);
  if (err != cudaSuccess) return err;
  constexpr int64_t kVectorBytes = 16;
  const int64_t chunk = std::min<int64_t>(q.features / tpkit::kVector, smem_limit / (parts * kVectorBytes));
  constexpr int64_t kFullDevice = 1024;  // threads a multiprocessor that keep it busy
  int64_t per_thread = tpkit::kQuantizeVectorsPerThread;
  while (per_thread > 1 && q.num_rows * ((chunk + per_thread - 1) / per_thread) < kFullDevice * multiprocessors) {
    per_thread /= 2;
  }
  const int64_t needed = (chunk + per_thread - 1) / per_thread;
  const int threads = static_cast<int>(std::min<int64_t>(tpkit::kQuantizeMaxThreads, (needed + 31) / 32 * 32));
  const size_t smem = static_cast<size_t>(parts * chunk * kVectorBytes);
  kernel<<<static_cast<unsigned>(q.num_rows), threads, smem, stream>>>(args, chunk);
  return cudaGetLastError();
}

}  // namespace

extern "C" {

int tpkit_rotary_supported(const tpkit_rotary_args* a) {
  constexpr int kBytes = 2;
  using tpkit::aligned16;
  const bool shape_ok = a->num_tokens >= 0 && a->num_heads > 0 && a->head_size > 0 && a->head_size % 16 == 0;
  const bool aligned = a->out != nullptr && aligned16(a->out) && aligned16(a->input) && aligned16(a->cos) &&
                       aligned16(a->sin) && (a->input_stride_token * kBytes) % 16 == 0 &&
                       (a->input_stride_head * kBytes) % 16 == 0;
  return is_16bit(a->dtype) && shape_ok && aligned ? 1 : 0;
}

int tpkit_silu_and_mul_supported(const tpkit_silu_and_mul_args* a) {
  constexpr int kBytes = 2;
  using tpkit::aligned16;
  const bool shape_ok = a->num_rows >= 0 && a->features > 0 && a->features % tpkit::kVector == 0;
  const bool aligned = a->out != nullptr && aligned16(a->out) && aligned16(a->input) &&
                       (a->input_stride * kBytes) % 16 == 0 && (a->out_stride * kBytes) % 16 == 0;
  return is_16bit(a->dtype) && shape_ok && aligned ? 1 : 0;
}

int tpkit_quantize_fp8_supported(const tpkit_quantize_fp8_args* a) {
  constexpr int kBytes = 2;
  using tpkit::aligned16;
  const bool shape_ok = a->num_rows >= 0 && a->num_rows <= INT32_MAX && a->features > 0 &&
                        a->features % tpkit::kVector == 0;
  // No rows: nothing is read or written, and torch gives empty tensors null pointers.
  const bool pointers = a->num_rows == 0 || (a->out != nullptr && a->scale != nullptr && a->input != nullptr);
  const bool aligned = aligned16(a->out) && aligned16(a->input) && (a->input_stride * kBytes) % 16 == 0;
  return is_16bit(a->dtype) && shape_ok && pointers && aligned ? 1 : 0;
}

int tpkit_silu_and_mul_quantize_fp8_supported(const tpkit_quantize_fp8_args* a) {
  // The up half starts `features` (a multiple of 8) elements into the row: 16-byte aligned where the row is.
  return tpkit_quantize_fp8_supported(a);
}

int tpkit_rms_norm_quantize_fp8_supported(const tpkit_rms_norm_quantize_fp8_args* a) {
  constexpr int kBytes = 2;
  using tpkit::aligned16;
  const tpkit_quantize_fp8_args& q = a->quantize;
  const bool empty = q.num_rows == 0;
  const bool weight = empty || (a->norm_weight != nullptr && aligned16(a->norm_weight));
  const bool residual = a->residual == nullptr ||
                        ((empty || a->residual_out != nullptr) && aligned16(a->residual) &&
                         aligned16(a->residual_out) && (a->residual_stride * kBytes) % 16 == 0);
  return tpkit_quantize_fp8_supported(&q) && weight && residual ? 1 : 0;
}

cudaError_t tpkit_rotary_launch(const tpkit_rotary_args* a, cudaStream_t stream) {
  if (!tpkit_rotary_supported(a)) return cudaErrorInvalidValue;
  const int64_t vectors = a->num_tokens * a->num_heads * (a->head_size / 2 / tpkit::kVector);
  return launch(tpkit::rotary_kernel<__nv_bfloat16>, tpkit::rotary_kernel<__half>, a, vectors, stream);
}

cudaError_t tpkit_silu_and_mul_launch(const tpkit_silu_and_mul_args* a, cudaStream_t stream) {
  if (!tpkit_silu_and_mul_supported(a)) return cudaErrorInvalidValue;
  const int64_t vectors = a->num_rows * (a->features / tpkit::kVector);
  return launch(tpkit::silu_and_mul_kernel<__nv_bfloat16>, tpkit::silu_and_mul_kernel<__half>, a, vectors, stream);
}

cudaError_t tpkit_quantize_fp8_launch(const tpkit_quantize_fp8_args* a, cudaStream_t stream) {
  if (!tpkit_quantize_fp8_supported(a)) return cudaErrorInvalidValue;
  return launch_rows(tpkit::quantize_fp8_kernel<__nv_bfloat16>, tpkit::quantize_fp8_kernel<__half>, *a, *a, 1,
                     stream);
}

cudaError_t tpkit_silu_and_mul_quantize_fp8_launch(const tpkit_quantize_fp8_args* a, cudaStream_t stream) {
  if (!tpkit_silu_and_mul_quantize_fp8_supported(a)) return cudaErrorInvalidValue;
  return launch_rows(tpkit::silu_and_mul_quantize_fp8_kernel<__nv_bfloat16>,
                     tpkit::silu_and_mul_quantize_fp8_kernel<__half>, *a, *a, 2, stream);
}

cudaError_t tpkit_rms_norm_quantize_fp8_launch(const tpkit_rms_norm_quantize_fp8_args* a, cudaStream_t stream) {
  if (!tpkit_rms_norm_quantize_fp8_supported(a)) return cudaErrorInvalidValue;
  return launch_rows(tpkit::rms_norm_quantize_fp8_kernel<__nv_bfloat16>,
                     tpkit::rms_norm_quantize_fp8_kernel<__half>, *a, a->quantize, a->residual != nullptr ? 2 : 1,
                     stream);
}

}  // extern "C"

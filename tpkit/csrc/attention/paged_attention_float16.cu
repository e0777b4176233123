// The float16 paged-attention kernels, one per supported head size. Torch-free.
#include "attention/paged_attention_launch.cuh"

namespace tpkit {

cudaError_t plan_float16(tpkit_paged_attention_args* args) {
  return dispatch_head_size(args->head_size, [&](auto h) { return plan_mma<__half, decltype(h)::value>(args); });
}

cudaError_t launch_float16(const tpkit_paged_attention_args* args, cudaStream_t stream) {
  return dispatch_head_size(args->head_size, [&](auto h) { return launch_mma<__half, decltype(h)::value>(args, stream); });
}

}  // namespace tpkit

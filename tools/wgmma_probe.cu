// The kernel and binding of tools/wgmma_probe.py (built there with torch.utils.cpp_extension.load).
#include <c10/cuda/CUDAException.h>
#include <cuda_bf16.h>
#include <torch/extension.h>

#include "wgmma.cuh"

using namespace tpkit;

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

// Row r, 16-byte chunk c of a [64][128] bf16 matrix in the planar 128-byte-swizzled layout.
__device__ __forceinline__ int swizzled(int r, int c) { return (c / 8) * 8192 + r * 128 + (((c % 8) ^ (r & 7)) * 16); }

// Writes a warp's m64nN accumulators (N / 8 tiles of the m16n8 layout, 4 floats a tile a thread) into the
// row-major [64][N] matrix `out`: row `row` (this lane's first) and row + 8.
template <int N>
__device__ void store_accumulators(const float* acc, float* out, int row, int lane) {
  for (int j = 0; j < N / 8; ++j) {
    const int col = 8 * j + (lane % 4) * 2;
    out[row * N + col] = acc[4 * j];
    out[row * N + col + 1] = acc[4 * j + 1];
    out[(row + 8) * N + col] = acc[4 * j + 2];
    out[(row + 8) * N + col + 1] = acc[4 * j + 3];
  }
}

__global__ void probe_kernel(const __nv_bfloat16* q, const __nv_bfloat16* k, const __nv_bfloat16* v, float* s_out,
                             float* o_out) {
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  // The swizzle atoms must start on 1024-byte boundaries (descriptor base offset 0): align by hand, in case
  // the dynamic shared memory starts elsewhere.
  const uint32_t raw = static_cast<uint32_t>(__cvta_generic_to_shared(smem_raw));
  uint8_t* smem = smem_raw + (((raw + 1023) & ~1023u) - raw);
  uint8_t* q_s = smem;
  uint8_t* k_s = smem + 16384;
  uint8_t* v_s = smem + 32768;
  const int tid = threadIdx.x;
  for (int i = tid; i < 64 * 16; i += blockDim.x) {
    const int r = i / 16, c = i % 16;
    *reinterpret_cast<uint4*>(q_s + swizzled(r, c)) = *reinterpret_cast<const uint4*>(q + r * 128 + c * 8);
    *reinterpret_cast<uint4*>(k_s + swizzled(r, c)) = *reinterpret_cast<const uint4*>(k + r * 128 + c * 8);
    *reinterpret_cast<uint4*>(v_s + swizzled(r, c)) = *reinterpret_cast<const uint4*>(v + r * 128 + c * 8);
  }
  fence_proxy_async_shared();
  __syncthreads();

  const uint32_t q_addr = static_cast<uint32_t>(__cvta_generic_to_shared(q_s));
  const uint32_t k_addr = static_cast<uint32_t>(__cvta_generic_to_shared(k_s));
  const uint32_t v_addr = static_cast<uint32_t>(__cvta_generic_to_shared(v_s));
  float s[32];
  for (int i = 0; i < 32; ++i) s[i] = 0.f;
  wgmma_fence();
#pragma unroll
  for (int ks = 0; ks < 8; ++ks) {
    const uint32_t step = (ks / 4) * 8192 + (ks % 4) * 32;
    wgmma_m64n64k16_ss<true>(s, wgmma_desc(q_addr + step, 16, 1024), wgmma_desc(k_addr + step, 16, 1024), ks > 0);
  }
  wgmma_commit();
  wgmma_wait<0>();

  const int warp = tid / 32, lane = tid % 32;
  const int row = 16 * warp + lane / 4;
  store_accumulators<64>(s, s_out, row, lane);

  uint32_t pa[4][4];
  for (int kk = 0; kk < 4; ++kk) {
    for (int i = 0; i < 4; ++i) pa[kk][i] = pack_bf16(s[8 * kk + 2 * i], s[8 * kk + 2 * i + 1]);
  }
  float o[64];
  for (int i = 0; i < 64; ++i) o[i] = 0.f;
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) {
    wgmma_m64n128k16_rs<true>(o, pa[kk], wgmma_desc(v_addr + kk * 16 * 128, 8192, 1024), kk > 0);
  }
  wgmma_commit();
  wgmma_wait<0>();
  store_accumulators<128>(o, o_out, row, lane);
}

void probe(at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor s_out, at::Tensor o_out) {
  constexpr int kSmemBytes = 3 * 16384 + 1024;
  C10_CUDA_CHECK(cudaFuncSetAttribute(probe_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes));
  probe_kernel<<<1, 128, kSmemBytes>>>(reinterpret_cast<const __nv_bfloat16*>(q.data_ptr()),
                                  reinterpret_cast<const __nv_bfloat16*>(k.data_ptr()),
                                  reinterpret_cast<const __nv_bfloat16*>(v.data_ptr()), s_out.data_ptr<float>(),
                                  o_out.data_ptr<float>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("probe", &probe); }

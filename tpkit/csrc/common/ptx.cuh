// Thin wrappers over the PTX the kernels use (sm_80 and newer): asynchronous 16-byte copies into shared
// memory, ldmatrix, the m16n8k16 tensor-core product with float32 accumulators, programmatic dependent
// launch, thread-block cluster barriers and distributed shared memory, ex2. Torch-free.
#pragma once

#include <stdint.h>

namespace tpkit {

constexpr float kLog2e = 1.4426950408889634f;

__device__ __forceinline__ uint32_t smem_addr(const void* ptr) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(ptr));
}

// 16 bytes global -> shared, bypassing L1. With valid == false nothing is read and the 16 bytes are
// zero-filled, so masked tokens contribute exact zeros (never NaN from unused cache slots). L2 fetches the
// whole 128-byte line around the 16 bytes (the copies read every byte of it), in fewer, larger DRAM
// requests.
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, bool valid) {
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes)
               : "memory");
}

// An L2 policy for the K/V stream, which is read once: its lines are evicted first, before what is read
// again (the query, block tables, partial results, the next kernel's inputs). Used with cp.async's
// L2::128B prefetch, which long streams need too.
__device__ __forceinline__ uint64_t l2_evict_first_policy() {
  uint64_t policy;
  asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(policy));
  return policy;
}

// cp_async_16 under an L2 cache policy (l2_evict_first_policy).
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, bool valid, uint64_t policy) {
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global.L2::cache_hint.L2::128B [%0], [%1], 16, %2, %3;\n" ::"r"(dst), "l"(src),
               "r"(src_bytes), "l"(policy)
               : "memory");
}

// a * b + c with a 64-bit product and sum: one wide multiply-add (the compiler may widen first, then
// multiply in 64 bits).
__device__ __forceinline__ uint64_t mad_wide(uint32_t a, uint32_t b, uint64_t c) {
  uint64_t d;
  asm("mad.wide.u32 %0, %1, %2, %3;\n" : "=l"(d) : "r"(a), "r"(b), "l"(c));
  return d;
}

// threadIdx.x, read anew at each use: the compiler cannot hoist what is computed from it out of a loop.
__device__ __forceinline__ unsigned opaque_thread_index() {
  unsigned index;
  asm volatile("mov.u32 %0, %%tid.x;\n" : "=r"(index));
  return index;
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// Waits until at most `pending` groups are in flight; the pipeline depth is chosen at run time.
__device__ __forceinline__ void cp_async_wait_dynamic(int pending) {
  switch (pending) {
    case 0: cp_async_wait<0>(); break;
    case 1: cp_async_wait<1>(); break;
    case 2: cp_async_wait<2>(); break;
    case 3: cp_async_wait<3>(); break;
    case 4: cp_async_wait<4>(); break;
    case 5: cp_async_wait<5>(); break;
    case 6: cp_async_wait<6>(); break;
    default: cp_async_wait<7>(); break;
  }
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// Two 8x8 matrices (lanes 0-15 give the row addresses).
__device__ __forceinline__ void ldmatrix_x2(uint32_t (&r)[2], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];\n" : "=r"(r[0]), "=r"(r[1]) : "r"(addr));
}

__device__ __forceinline__ void ldmatrix_x2_trans(uint32_t (&r)[2], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];\n" : "=r"(r[0]), "=r"(r[1]) : "r"(addr));
}

// A 16- or 8-byte load of data read once (a decode product's weights): through the non-coherent path and
// without a place in L1, which then keeps what is read again (the input rows).
__device__ __forceinline__ uint4 load_streaming(const uint4* ptr) {
  uint4 v;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];\n"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(ptr));
  return v;
}

__device__ __forceinline__ uint2 load_streaming(const uint2* ptr) {
  uint2 v;
  asm("ld.global.nc.L1::no_allocate.v2.u32 {%0, %1}, [%2];\n" : "=r"(v.x), "=r"(v.y) : "l"(ptr));
  return v;
}

// d += a * b for a 16x16 (row-major) by 16x8 (column-major) tile, float32 accumulators.
template <bool kBF16>
__device__ __forceinline__ void mma_m16n8k16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  if constexpr (kBF16) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// Barrier ID (1-15; __syncthreads takes 0) among THREADS threads of the block, whole warps: lets groups of
// warps wait for their own work only. Immediate operands: a barrier id in a register reserves all 16.
template <int ID, int THREADS>
__device__ __forceinline__ void named_barrier_sync() {
  static_assert(ID > 0 && ID < 16 && THREADS % 32 == 0, "barrier 1-15, whole warps");
  asm volatile("bar.sync %0, %1;\n" ::"n"(ID), "n"(THREADS) : "memory");
}

// Asks L2 for the 128-byte line holding `ptr`; returns nothing (safe before griddepcontrol.wait: what the
// previous kernel writes there lands in L2, and the read after the wait sees it).
__device__ __forceinline__ void prefetch_l2(const void* ptr) {
  asm volatile("prefetch.global.L2 [%0];\n" ::"l"(ptr));
}

// Programmatic dependent launch (sm_90+; no-ops before, and when the launch was not programmatic): the
// primary grid lets its dependent grid start launching; the dependent waits for the primary's results.
__device__ __forceinline__ void grid_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void grid_wait_primary() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

// Thread-block clusters (sm_90+; never called on older devices, where these compile to a trap). Every
// thread of every block in the cluster must reach each barrier.
//
// cluster_sync_shared: the block's shared-memory writes before it are visible to every block's reads after
// it. The fence covers shared memory alone: barrier.cluster.arrive.release is MEMBAR.ALL.GPU in SASS, which
// also waits for the block's global stores to reach L2.
__device__ __forceinline__ void cluster_sync_shared() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile(
      "fence.release.sync_restrict::shared::cta.cluster;\n"
      "barrier.cluster.arrive.relaxed.aligned;\n"
      "barrier.cluster.wait.acquire.aligned;\n" ::: "memory");
#else
  __trap();
#endif
}

// cluster_sync_exit: no block leaves (freeing its shared memory) while another may still read it; orders
// nothing else, as a block's reads of its peers have returned their values before it arrives.
__device__ __forceinline__ void cluster_sync_exit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.arrive.relaxed.aligned;\nbarrier.cluster.wait.aligned;\n" ::: "memory");
#else
  __trap();
#endif
}

__device__ __forceinline__ int cluster_rank() {
  uint32_t rank = 0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(rank));
#else
  __trap();
#endif
  return static_cast<int>(rank);
}

// The address of this block's shared-memory location `addr` in the shared memory of cluster block `rank`.
__device__ __forceinline__ uint32_t cluster_map(uint32_t addr, int rank) {
  uint32_t mapped = 0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(mapped) : "r"(addr), "r"(rank));
#else
  __trap();
#endif
  return mapped;
}

__device__ __forceinline__ float cluster_load(uint32_t addr) {
  float v = 0.f;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("ld.shared::cluster.f32 %0, [%1];\n" : "=f"(v) : "r"(addr) : "memory");
#else
  __trap();
#endif
  return v;
}

__device__ __forceinline__ uint4 cluster_load16(uint32_t addr) {
  uint4 v = make_uint4(0u, 0u, 0u, 0u);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("ld.shared::cluster.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "r"(addr)
               : "memory");
#else
  __trap();
#endif
  return v;
}

// 2^x; exact 0 for -inf. Scores are kept in the log2 domain (scale folded with log2(e)).
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// tanh(x) as 1 - 2 / (e^(2x) + 1): an ex2 and a division, within about 1e-6 of tanhf (tanh.approx's error,
// some 5e-4, would move a capped logit of 50 by 0.02). Saturates to +-1; NaN stays NaN.
__device__ __forceinline__ float fast_tanh(float x) {
  return 1.f - __fdividef(2.f, fast_exp2(x * (2.f * kLog2e)) + 1.f);
}

}  // namespace tpkit

// Hopper warpgroup matrix products (wgmma, sm_90a) on operands in shared memory with the 128-byte swizzle.
// Torch-free. Compiled to traps everywhere but sm_90a: callers pick these paths only for such builds.
//
// Shared-memory operands are stored in "planes" of 64 bf16/fp16 columns: a plane is [rows][128 bytes] with
// the 16-byte chunk c of row r at chunk c ^ (r & 7), planes 1024-byte aligned. That is the 128-byte
// swizzle atom of wgmma (8 rows x 128 bytes) repeated down the rows.
// - K-major operand (Q as A, K as B of S = Q K^T; rows = M or N, columns = the head): one k-step (16
//   columns) is the descriptor at plane (ks / 4) + (ks % 4) * 32 bytes, stride between 8-row groups 1024.
// - MN-major operand (V as B of O = P V; rows = tokens = K, columns = the head = N): one k-step (16 tokens)
//   starts 16 rows down, 8-row groups 1024 bytes apart (SBO), the next 64 columns a plane further (LBO).
#pragma once

#include <stdint.h>

namespace tpkit {

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define TPKIT_WGMMA_AVAILABLE 1
#else
#define TPKIT_WGMMA_AVAILABLE 0
#endif

// Matrix descriptor of a 128-byte-swizzled operand at shared-memory address `addr` (the atom 1024-byte
// aligned, so the base offset is 0): leading and stride byte offsets as the PTX ISA defines them.
__device__ __forceinline__ uint64_t wgmma_desc(uint32_t addr, uint32_t leading_bytes, uint32_t stride_bytes) {
  return static_cast<uint64_t>((addr & 0x3FFFF) >> 4) | (static_cast<uint64_t>((leading_bytes & 0x3FFFF) >> 4) << 16) |
         (static_cast<uint64_t>((stride_bytes & 0x3FFFF) >> 4) << 32) | (uint64_t{1} << 62);
}

// The descriptor of the operand `bytes` further on (a multiple of 16): the address field is bits 0-13 of
// the descriptor in 16-byte units and shared memory ends below 2^18 bytes, so the sum never carries out of
// it. Descriptors of a loop's operands are then one add from a base made once, not the masks and shifts of
// wgmma_desc for every product.
__device__ __forceinline__ uint64_t wgmma_desc_advance(uint64_t desc, uint32_t bytes) { return desc + (bytes >> 4); }

// Orders this thread's register writes before the next wgmma that reads or accumulates into them.
__device__ __forceinline__ void wgmma_fence() {
#if TPKIT_WGMMA_AVAILABLE
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void wgmma_commit() {
#if TPKIT_WGMMA_AVAILABLE
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#endif
}

// Waits until at most N committed groups of this warpgroup's wgmmas are still in flight.
template <int N>
__device__ __forceinline__ void wgmma_wait() {
#if TPKIT_WGMMA_AVAILABLE
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
#endif
}

// Makes this thread's generic-proxy shared-memory writes (stores, cp.async) visible to wgmma's reads
// (the async proxy); then a barrier.
__device__ __forceinline__ void fence_proxy_async_shared() {
#if TPKIT_WGMMA_AVAILABLE
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}

#define TPKIT_D8(i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), \
                    "+f"(d[i + 6]), "+f"(d[i + 7])

// d[64 x 64] (+)= A[64 x 16] B[16 x 64]; A and B K-major in shared memory (descriptors). d: 32 floats a
// thread, the layout of 8 m16n8 accumulator tiles per warp (warp w: rows 16w .. 16w + 15).
template <bool kBF16>
__device__ __forceinline__ void wgmma_m64n64k16_ss(float (&d)[32], uint64_t desc_a, uint64_t desc_b,
                                                   bool accumulate) {
#if TPKIT_WGMMA_AVAILABLE
  const int scale_d = accumulate ? 1 : 0;
#define TPKIT_WGMMA_N64(TYPE)                                                                                   \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"                                                   \
               "wgmma.mma_async.sync.aligned.m64n64k16.f32." TYPE "." TYPE " "                                 \
               "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, "  \
               "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 0, 0;\n}\n"   \
               : TPKIT_D8(0), TPKIT_D8(8), TPKIT_D8(16), TPKIT_D8(24)                                         \
               : "l"(desc_a), "l"(desc_b), "r"(scale_d))
  if constexpr (kBF16) {
    TPKIT_WGMMA_N64("bf16");
  } else {
    TPKIT_WGMMA_N64("f16");
  }
#undef TPKIT_WGMMA_N64
#else
  __trap();
#endif
}

// d[64 x 128] (+)= A[64 x 16] B[16 x 128]; A in registers (the m16n8k16 A fragment of each warp's 16
// rows), B MN-major in shared memory (descriptor, transposed). d: 64 floats a thread, 16 m16n8 tiles.
template <bool kBF16>
__device__ __forceinline__ void wgmma_m64n128k16_rs(float (&d)[64], const uint32_t (&a)[4], uint64_t desc_b,
                                                    bool accumulate) {
#if TPKIT_WGMMA_AVAILABLE
  const int scale_d = accumulate ? 1 : 0;
#define TPKIT_WGMMA_N128(TYPE)                                                                                  \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"                                                   \
               "wgmma.mma_async.sync.aligned.m64n128k16.f32." TYPE "." TYPE " "                                \
               "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, "  \
               "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, "   \
               "%38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, "   \
               "%56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"          \
               : TPKIT_D8(0), TPKIT_D8(8), TPKIT_D8(16), TPKIT_D8(24), TPKIT_D8(32), TPKIT_D8(40),           \
                 TPKIT_D8(48), TPKIT_D8(56)                                                                   \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d))
  if constexpr (kBF16) {
    TPKIT_WGMMA_N128("bf16");
  } else {
    TPKIT_WGMMA_N128("f16");
  }
#undef TPKIT_WGMMA_N128
#else
  __trap();
#endif
}

#undef TPKIT_D8

}  // namespace tpkit

"""What the attention kernel's structure costs a bare stream of C6's bytes (GPU machine, compute 9.0).

    python3 benchmarks/diag_stream_probe.py [--rounds 3]

C6's K and V (64 sequences of 4096 tokens, one KV head, head 128, bf16: 134 MB) read by 128 thread blocks of
256 threads, each half a sequence, through `cp.async` (16 bytes, L2 evict-first, as the warpgroup kernel
copies) into shared memory, with no arithmetic. Each variant adds one piece of the warpgroup kernel's
structure to the one before:

- A: one 3-stage pipeline of 64-token tiles;
- B: two warpgroups, 2 stages each, on alternate tiles, waiting on their own named barriers;
- C: B in clusters of 2 (a sequence's halves), two cluster barriers and 24 KB read from the peer's shared
  memory at the end (the cluster merge's traffic);
- D: C as programmatic dependent launches (griddepcontrol.wait first, launch_dependents after the loop);
- E: B as programmatic dependent launches;
- F: D on a paged cache: 16-token pages in a random permutation, their numbers read from the block table
  one tile ahead into a ring in shared memory;
- G: F reading each sequence's length first (the tile count depends on it) and a 48-head query;
- H: G with the kernel's copy form: byte addresses from 32-bit strides (mad.wide), a predicate a copy and
  the 128-byte-swizzled planes;
- I: H with the kernel's proxy fence (fence.proxy.async.shared::cta) after each tile's wait;
- J: I ending as the kernel does: the warpgroups meet through shared memory, the first writes its rows'
  partial results (bf16, as the kernel's), and its own cluster merge (merge_in_cluster) writes a bf16 output;
- K: H with 1600 clocks of busy work a tile after the barrier (about a tile's arithmetic in the kernel);
- L: K with the proxy fence where the kernel has it (after the next tile's copies are issued);
- M: K with the fence first: wait for the tile, fence and barrier, then issue the next tile's copies.

Four input sets in turn (536 MB, against 60 MB of L2), 5 rounds of them captured in a CUDA graph; per
variant the median of 15 replays, in us a call, for each of --rounds passes over the variants.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch.utils.cpp_extension import load_inline

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_paged_attention import _graph_time_us  # noqa: E402

CSRC = Path(__file__).resolve().parent.parent / "tpkit" / "attention" / "csrc"
NUM_SEQS, SEQ_LEN, NUM_HEADS = 64, 4096, 48
VARIANTS = ("A one pipeline", "B two warpgroups", "C B + cluster merge", "D C + PDL", "E B + PDL",
            "F D + random pages", "G F + length, query", "H G + kernel's addresses", "I H + proxy fence",
            "J I + kernel's epilogue", "K H + work a tile", "L K + proxy fence", "M L, fence first")

SOURCE = r"""
#include <cstdint>
#include <cuda_runtime.h>
#include "paged_attention_mma.cuh"  // merge_in_cluster, and through it ptx.cuh and dtype_traits.cuh
#include "wgmma.cuh"                // fence_proxy_async_shared
using namespace tpkit;

// What a variant adds (bits of F).
constexpr int kTwoWarpgroups = 1, kCluster = 2, kPdl = 4, kPaged = 8, kPrologue = 16, kReal = 32, kFence = 64,
              kEpilogue = 128, kWork = 256, kFenceFirst = 512;

// Rows of 128 bf16 are 16 chunks of 16 bytes; a 64-token tile of K and V is 32 KB; a page 16 tokens.
template <int F>
__global__ void __launch_bounds__(256, 1) probe(const uint4* __restrict__ k, const uint4* __restrict__ v,
                                                float* out, __nv_bfloat16* attention_out, int tokens,
                                                const int* __restrict__ tables,
                                                const int* __restrict__ seq_lens,
                                                const uint4* __restrict__ query) {
  constexpr bool WG2 = F & kTwoWarpgroups, CLUSTER = F & kCluster, PDL = F & kPdl, PAGED = F & kPaged,
                 PROLOGUE = F & kPrologue, REAL = F & kReal, FENCE = F & kFence, EPILOGUE = F & kEpilogue,
                 WORK = F & kWork, FENCE_FIRST = F & kFenceFirst;
  extern __shared__ __align__(1024) uint8_t smem[];
  __shared__ int ring[2][4][4];  // [warpgroup][tile slot][page]
  __shared__ float row_lse[64];
  const uint32_t base = smem_addr(smem);
  if (PDL) grid_wait_primary();
  const uint64_t policy = l2_evict_first_policy();
  const int seq = blockIdx.x >> 1, half = blockIdx.x & 1, tid = threadIdx.x;
  const int* table = tables + seq * (tokens / 16) + half * (tokens / 32);
  int block_tiles = tokens / 2 / 64;
  if (PROLOGUE) block_tiles = min(block_tiles, (seq_lens[seq] - half * (tokens / 2) + 63) / 64);
  const uint4* ks = k + (size_t)seq * tokens * 16 + (size_t)half * (tokens / 2) * 16;
  const uint4* vs = v + (size_t)seq * tokens * 16 + (size_t)half * (tokens / 2) * 16;
  const int wg = tid >> 7, t = tid & 127;
  if (WG2) {
    const uint32_t stages = base + wg * 2 * 32768;
    const int num_tiles = block_tiles / 2;
    auto page_of = [&](int tile, int j) {
      return tile < num_tiles ? __ldg(table + (tile * 2 + wg) * 4 + j) : 0;
    };
    if (PAGED && t < 8) ring[wg][t >> 2][t & 3] = page_of(t >> 2, t & 3);
    if (PROLOGUE) {
      for (int i = tid; i < 48 * 16; i += 256) {
        cp_async_16(base + 4 * 32768 + i * 16, query + seq * 48 * 16 + i, true);
      }
    }
    __syncthreads();
    auto issue = [&](int tile, int stage) {
      const size_t row0 = (size_t)((tile * 2 + wg) * 64) * 16;
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const int c = t + i * 128;
        const int token = c >> 4, chunk = c & 15;
        const int page = PAGED ? ring[wg][tile & 3][token >> 4] : 0;
        if (REAL) {
          const int tile_tokens = block_tiles * 64 - (tile * 2 + wg) * 64;
          const bool valid = token < tile_tokens && static_cast<unsigned>(page) < 65536u;
          const uint32_t page_index = valid ? static_cast<uint32_t>(page) : 0u;
          const uint64_t k_row = reinterpret_cast<uint64_t>(k) + chunk * 16;
          const uint64_t v_row = reinterpret_cast<uint64_t>(v) + chunk * 16;
          const uint32_t offset = static_cast<uint32_t>(token & 15);
          const uint64_t k_src = mad_wide(page_index, 4096u, mad_wide(offset, 256u, k_row));
          const uint64_t v_src = mad_wide(page_index, 4096u, mad_wide(offset, 256u, v_row));
          const uint32_t dst =
              stages + stage * 32768 + (chunk >> 3) * 8192 + token * 128 + (((chunk & 7) ^ (token & 7)) << 4);
          cp_async_16(dst, reinterpret_cast<const void*>(k_src), valid, policy);
          cp_async_16(dst + 16384, reinterpret_cast<const void*>(v_src), valid, policy);
        } else {
          const size_t src = PAGED ? ((size_t)page * 16 + (token & 15)) * 16 + chunk : row0 + c;
          cp_async_16(stages + stage * 32768 + c * 16, (PAGED ? k : ks) + src, true, policy);
          cp_async_16(stages + stage * 32768 + 16384 + c * 16, (PAGED ? v : vs) + src, true, policy);
        }
      }
    };
    if (num_tiles > 0) issue(0, 0);
    cp_async_commit();
    for (int tile = 0; tile < num_tiles; ++tile) {
      const int ahead_page = PAGED && t < 4 ? page_of(tile + 2, t) : 0;
      if (!FENCE_FIRST) {
        if (tile + 1 < num_tiles) issue(tile + 1, (tile + 1) & 1);
        cp_async_commit();
      }
      cp_async_wait<FENCE_FIRST ? 0 : 1>();
      if (FENCE) fence_proxy_async_shared();
      if (wg == 0) named_barrier_sync<1, 128>(); else named_barrier_sync<2, 128>();
      if (FENCE_FIRST) {
        if (tile + 1 < num_tiles) issue(tile + 1, (tile + 1) & 1);
        cp_async_commit();
      }
      if (WORK) {  // about a tile's arithmetic in the kernel (0.8 us an SM, eighth session's nold)
        const long long begin = clock64();
        while (clock64() - begin < 1600) {
        }
      }
      if (PAGED && t < 4) ring[wg][(tile + 2) & 3][t] = ahead_page;
      if (wg == 0) named_barrier_sync<1, 128>(); else named_barrier_sync<2, 128>();
    }
  } else {
    auto issue = [&](int tile) {
      const uint32_t stage = base + (tile % 3) * 32768;
      const size_t row0 = (size_t)(tile * 64) * 16;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int c = tid + i * 256;
        cp_async_16(stage + c * 16, ks + row0 + c, true, policy);
        cp_async_16(stage + 16384 + c * 16, vs + row0 + c, true, policy);
      }
    };
    issue(0);
    cp_async_commit();
    issue(1);
    cp_async_commit();
    for (int tile = 0; tile < block_tiles; ++tile) {
      if (tile + 2 < block_tiles) issue(tile + 2);
      cp_async_commit();
      cp_async_wait<2>();
      __syncthreads();
    }
  }
  cp_async_wait<0>();
  __syncthreads();
  if (PDL) grid_launch_dependents();
  float acc = reinterpret_cast<const float*>(smem)[tid];
  if (EPILOGUE) {
    // The warpgroup kernel's end: the second warpgroup leaves 68 floats a thread in its stages for the
    // first; the first writes its 48 rows' partial results ([64][136] bf16) and log-sum-exps; then the
    // kernel's own cluster merge writes the output.
    float* state = reinterpret_cast<float*>(smem + 2 * 32768) + t * 68;
    if (wg == 1) {
#pragma unroll
      for (int i = 0; i < 17; ++i) {
        *reinterpret_cast<float4*>(state + 4 * i) = make_float4(acc, acc, acc, acc);
      }
    }
    __syncthreads();
    __nv_bfloat16* partial = reinterpret_cast<__nv_bfloat16*>(smem);
    if (wg == 0) {
#pragma unroll
      for (int i = 0; i < 17; ++i) {
        const float4 x = *reinterpret_cast<const float4*>(state + 4 * i);
        acc += x.x + x.w;
      }
      const int lane = t & 31, row0 = (t >> 5) * 16 + (lane >> 2);
#pragma unroll
      for (int r = row0; r < row0 + 16; r += 8) {
        if (r >= 48) continue;
#pragma unroll
        for (int n = 0; n < 16; ++n) {
          *reinterpret_cast<uint32_t*>(partial + r * 136 + n * 8 + ((lane & 3) << 1)) =
              DTypeTraits<__nv_bfloat16>::pack2(acc, acc);
        }
        if ((lane & 3) == 0) row_lse[r] = acc;
      }
    }
    merge_in_cluster<128, __nv_bfloat16>(2, 48, row_lse, [&](int r) { return partial + r * 136; },
                          [&](int r) { return attention_out + (static_cast<int64_t>(seq) * 48 + r) * 128; });
  } else if (CLUSTER) {
    cluster_sync_shared();
    const uint32_t peer = cluster_map(base, cluster_rank() ^ 1);
#pragma unroll
    for (int i = 0; i < 6; ++i) {
      const uint4 x = cluster_load16(peer + (tid + i * 256) * 16);
      acc += __uint_as_float(x.x) + __uint_as_float(x.y) + __uint_as_float(x.z) + __uint_as_float(x.w);
    }
    cluster_sync_exit();
  }
  out[blockIdx.x * 256 + tid] = acc;
}

template <int F>
static void launch(const uint4* k, const uint4* v, float* out, __nv_bfloat16* attention_out, int tokens,
                   int blocks, cudaStream_t stream, const int* tables, const int* seq_lens,
                   const uint4* query) {
  const auto kernel = probe<F>;
  const int bytes = F & kTwoWarpgroups ? 4 * 32768 + 48 * 256 : 3 * 32768;
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(blocks);
  config.blockDim = dim3(256);
  config.dynamicSmemBytes = bytes;
  config.stream = stream;
  cudaLaunchAttribute attrs[2] = {};
  int n = 0;
  if (F & kPdl) {
    attrs[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attrs[n++].val.programmaticStreamSerializationAllowed = 1;
  }
  if (F & kCluster) {
    attrs[n].id = cudaLaunchAttributeClusterDimension;
    attrs[n++].val.clusterDim = {2, 1, 1};
  }
  config.attrs = attrs;
  config.numAttrs = n;
  cudaLaunchKernelEx(&config, kernel, k, v, out, attention_out, tokens, tables, seq_lens, query);
}

void run_probe(int64_t variant, int64_t k, int64_t v, int64_t tables, int64_t seq_lens, int64_t query,
               int64_t out, int64_t attention_out, int64_t tokens, int64_t blocks, int64_t stream) {
  const auto kp = reinterpret_cast<const uint4*>(k);
  const auto vp = reinterpret_cast<const uint4*>(v);
  const auto tp = reinterpret_cast<const int*>(tables);
  const auto lp = reinterpret_cast<const int*>(seq_lens);
  const auto qp = reinterpret_cast<const uint4*>(query);
  const auto op = reinterpret_cast<float*>(out);
  const auto ap = reinterpret_cast<__nv_bfloat16*>(attention_out);
  const auto s = reinterpret_cast<cudaStream_t>(stream);
  const int t = static_cast<int>(tokens), b = static_cast<int>(blocks);
  constexpr int C = kTwoWarpgroups | kCluster, D = C | kPdl, F = D | kPaged, H = F | kPrologue | kReal;
  // VARIANTS, in order (A .. M).
  static constexpr decltype(&launch<0>) kLaunches[] = {
      launch<0>, launch<kTwoWarpgroups>, launch<C>, launch<D>, launch<kTwoWarpgroups | kPdl>, launch<F>,
      launch<F | kPrologue>, launch<H>, launch<H | kFence>, launch<H | kFence | kEpilogue>, launch<H | kWork>,
      launch<H | kWork | kFence>, launch<H | kWork | kFence | kFenceFirst>};
  kLaunches[variant](kp, vp, op, ap, t, b, s, tp, lp, qp);
}
"""
DECLARATION = ("void run_probe(int64_t variant, int64_t k, int64_t v, int64_t tables, int64_t seq_lens, "
               "int64_t query, int64_t out, int64_t attention_out, int64_t tokens, int64_t blocks, "
               "int64_t stream);")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    ext = load_inline("tpkit_diag_stream_probe", DECLARATION, cuda_sources=SOURCE, functions=["run_probe"],
                      extra_include_paths=[str(CSRC)],
                      extra_cuda_cflags=["-O3", "-gencode=arch=compute_90a,code=sm_90a", "-DTPKIT_SM90A"])
    pages = NUM_SEQS * SEQ_LEN // 16
    # [num_seqs, seq_len, head] K and V, which the paged variants read as [pages, 16, head] through a table.
    sets = [(torch.randn(NUM_SEQS, SEQ_LEN, 128, device="cuda").bfloat16(),
             torch.randn(NUM_SEQS, SEQ_LEN, 128, device="cuda").bfloat16(),
             torch.randperm(pages, device="cuda", dtype=torch.int32).view(NUM_SEQS, SEQ_LEN // 16))
            for _ in range(4)]
    seq_lens = torch.full((NUM_SEQS,), SEQ_LEN, dtype=torch.int32, device="cuda")
    query = torch.randn(NUM_SEQS, NUM_HEADS, 128, device="cuda").bfloat16()
    out = torch.zeros(2 * NUM_SEQS * 256, device="cuda")
    attention_out = torch.empty(NUM_SEQS, NUM_HEADS, 128, dtype=torch.bfloat16, device="cuda")
    def call(variant: int, k: torch.Tensor, v: torch.Tensor, tables: torch.Tensor) -> None:
        ext.run_probe(variant, k.data_ptr(), v.data_ptr(), tables.data_ptr(), seq_lens.data_ptr(),
                      query.data_ptr(), out.data_ptr(), attention_out.data_ptr(), SEQ_LEN, 2 * NUM_SEQS,
                      torch.cuda.current_stream().cuda_stream)

    results = {variant: [] for variant in range(len(VARIANTS))}
    for _ in range(args.rounds):
        for variant in results:
            # One graph of 5 rounds over the input sets, as the benchmark times its calls.
            calls = [lambda variant=variant, inputs=inputs: call(variant, *inputs) for inputs in sets] * 5
            results[variant].append(_graph_time_us(calls, 15))
    print(f"variant                    | us a call, {args.rounds} rounds")
    for variant, name in enumerate(VARIANTS):
        print(f"{name:26s} | " + " / ".join(f"{t:.1f}" for t in results[variant]))


if __name__ == "__main__":
    main()

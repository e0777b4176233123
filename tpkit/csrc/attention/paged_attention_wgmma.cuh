// Decode attention on Hopper's warpgroup products (wgmma, sm_90a), head size 128, fp16/bf16: for groups of
// more than 32 query heads a KV head, and for every group on block tables of 32 tiles or more (a smaller
// group's rows are padded to 64; the loop still streams faster than the mma kernel's). Torch-free.
//
// One warpgroup (4 warps) a thread block serves up to 64 query heads of one KV head as the 64 rows of
// S = Q K^T (m64n64k16: Q and K from shared memory) and O += P V (m64n128k16: P from registers, V from
// shared memory). The mma.sync kernel has every warp read K and V from shared memory for its own 16 rows;
// here each K/V byte is read from shared memory once per warpgroup. Warp w owns rows 16w .. 16w + 15 of
// S and O whole, so its online softmax needs no other warp, and the epilogue writes straight from
// registers. K/V pages stream through the mma kernel's cp.async pipeline of 64-token tiles, into the
// 128-byte-swizzled planes of wgmma.cuh; the query the same, once. Split sequences merge their partitions
// as the mma kernel does: in a thread-block cluster where the plan finds every cluster resident at once,
// else in the merge kernel. A block may hold two warpgroups (WARPGROUPS), each streaming alternate tiles
// of the block's partition through its own stages: an SM then runs the two streams of two one-warpgroup
// blocks with half the partitions to merge, which lets splits that the merge kernel would finish merge in
// their clusters.
#pragma once

#include <math.h>

#include "common/dtype_traits.cuh"
#include "attention/paged_attention.h"
#include "attention/paged_attention_mma.cuh"
#include "common/ptx.cuh"
#include "common/wgmma.cuh"

namespace tpkit {

constexpr int kWgmmaHead = 128;
constexpr int kWgmmaRows = 64;      // query rows a block's products take (the group, padded)
constexpr int kWgmmaThreads = 128;  // one warpgroup
constexpr int kPlaneBytes = 64 * 128;  // 64 rows x 128 bytes: 64 columns of a 64-row operand
// Elements (of the output's type) a row of the cluster merge's partial results: 68 words, so a warp's
// stores (8 rows x 4 column pairs) hit 32 different banks.
constexpr int kPartialStride = kWgmmaHead + 8;
constexpr int kStateStride = 64 + 4;  // floats a thread's O, m and l take when two warpgroups meet
// Q (q_sets sets of 64 rows), then `stage_sets` sets of stages of K and V (2 planes each); the base rounded up
// to 1024 bytes at run time.
template <typename T>
constexpr int wgmma_smem_bytes(int stages, int stage_sets, int q_sets = 1) {
  return 1024 + q_sets * kWgmmaRows * kWgmmaHead * static_cast<int>(sizeof(T)) +
         stage_sets * stages * 2 * kTileTokens * kWgmmaHead * static_cast<int>(sizeof(T));
}

// Byte offset of 16-byte chunk c of row r in 64-row planes (wgmma.cuh).
__device__ __forceinline__ uint32_t plane_offset(int r, int c) {
  return (c >> 3) * kPlaneBytes + r * 128 + (((c & 7) ^ (r & 7)) << 4);
}

// WARPGROUPS: 1 or 2 (the plan's `warpgroups`). In decode, warpgroup wg takes tiles wg, wg + 2, ... of the
// block's partition; the two meet in shared memory before the epilogue. Two ask for one block an SM (their
// shared memory allows no more), else ptxas caps them at 128 registers; one leaves the minimum unset (0).
// MULTI: rows of several query tokens a sequence (query_start_loc set), a kernel of its own as in the mma
// kernel; there two warpgroups split the rows instead (warpgroup wg takes rows 64 wg .. 64 wg + 63 of a
// 128-row tile) and share every K/V tile, which halves the K/V traffic of a query row.
template <typename T, int WARPGROUPS, bool MULTI>
__global__ void __launch_bounds__(kWgmmaThreads * WARPGROUPS, WARPGROUPS == 1 ? 0 : 1)
    paged_attention_wgmma_kernel(const tpkit_paged_attention_args p) {
#if TPKIT_WGMMA_AVAILABLE
  using Traits = DTypeTraits<T>;
  static_assert(sizeof(T) == 2, "fp16 or bf16");
  constexpr int C = kWgmmaHead / 8;                               // 16-byte chunks a row
  constexpr uint32_t kStageBytes = 2 * 2 * kPlaneBytes;           // K, then V
  constexpr bool kRowSplit = MULTI && WARPGROUPS == 2;             // the warpgroups split the rows
  constexpr int kStreams = kRowSplit ? 1 : WARPGROUPS;            // tile streams, each with its own stages
  constexpr int kRows = kRowSplit ? 2 * kWgmmaRows : kWgmmaRows;  // query rows a block serves
  constexpr int kLoaders = kRowSplit ? 2 * kWgmmaThreads : kWgmmaThreads;  // threads that copy a stream's tiles
  constexpr int kLoadIters = kTileTokens * C / kLoaders;          // copies a loader issues per tile and operand
  static_assert(kWgmmaRows * kPartialStride * 2 <= 2 * kStageBytes, "the cluster merge's partials fit 2 stages");
  static_assert(kWgmmaThreads * kStateStride * 4 <= 2 * kStageBytes, "a warpgroup's state fits its 2 stages");
  static_assert(WARPGROUPS == 1 || WARPGROUPS == 2, "one or two warpgroups");

  extern __shared__ __align__(1024) uint8_t smem_raw[];
  // Swizzle atoms start on 1024-byte boundaries (descriptor base offset 0).
  const uint32_t raw = smem_addr(smem_raw);
  const uint32_t q_s0 = (raw + 1023) & ~1023u;  // [kRows / 64][2 planes][64 rows][128 bytes]
  // [kStreams][num_stages][K 2 planes, V 2 planes][64 rows][128 bytes]
  const uint32_t kv_s0 = q_s0 + (kRows / kWgmmaRows) * 2 * kPlaneBytes;

  const BlockCoords coords = block_coords<MULTI>(p);
  const int kv_head = coords.kv_head;
  const int partition = blockIdx.y;
  const int wg = WARPGROUPS == 1 ? 0 : threadIdx.x / kWgmmaThreads;
  const int stream = kRowSplit ? 0 : wg;  // the tile stream this warpgroup takes
  const int tid = WARPGROUPS == 1 ? threadIdx.x : threadIdx.x % kWgmmaThreads;  // within the warpgroup
  const int loader = kRowSplit ? static_cast<int>(threadIdx.x) : tid;  // within the stream's loaders
  const int lane = tid & 31;
  const int warp = tid >> 5;  // within the warpgroup: rows 16 warp .. 16 warp + 15 of its 64
  const uint32_t q_s = q_s0 + (kRowSplit ? wg * 2 * kPlaneBytes : 0u);  // this warpgroup's rows
  const int first_head = coords.m_group * kRows;  // within the group
  const int group_heads = min(kRows, p.group_size - first_head);
  const int head0 = kv_head * p.group_size + first_head;

  const int capacity = p.max_blocks_per_seq << p.block_size_log2;
  // This partition's keys and table entries (with a window, shifted to the window's first block below).
  int start = partition * p.partition_size;
  int table_end = min(start + p.partition_size, capacity);
  const int num_stages = p.num_stages;
  const uint32_t kv_s = kv_s0 + stream * num_stages * kStageBytes;  // this stream's stages

  const T* k_base = static_cast<const T*>(p.key_cache) + static_cast<int64_t>(kv_head) * p.kc_stride_head;
  const T* v_base = static_cast<const T*>(p.value_cache) + static_cast<int64_t>(kv_head) * p.vc_stride_head;
  const int bs_log2 = p.block_size_log2;
  const int bs_mask = (1 << bs_log2) - 1;
  const int pages_per_tile = kTileTokens >> bs_log2;

  int seq_len_read = 0;
  QueryRows qr = start_rows<MULTI>(p, coords, head0, group_heads, [&](int seq) {
    prefetch_prologue<T, kWgmmaHead>(
        static_cast<const T*>(p.query) + seq * p.q_stride_seq + head0 * p.q_stride_head, p.q_stride_head,
        group_heads, p.seq_lens + seq, p.block_tables + seq * p.bt_stride + (start >> bs_log2),
        min(num_stages * WARPGROUPS * pages_per_tile, (table_end - start) >> bs_log2));
  }, seq_len_read);
  if (qr.seq < 0) return;  // the whole block: past the batch's work tiles
  if (p.window_size > 0) {
    // A window's keys start near the sequence's end: the length is needed before the first table read.
    if constexpr (!MULTI) qr.set_seq_len(min(seq_len_read, capacity));
    start += keys_start(qr.first_pos, p.window_size, bs_log2);
    table_end = min(start + p.partition_size, capacity);
  }
  const int first_key = qr.key_begin();  // keys before it are no row's: never copied (zero-filled)
  const int rows_valid = qr.rows_valid;
  const int* bt_row = p.block_tables + static_cast<int64_t>(qr.seq) * p.bt_stride;

  // A stream's tiles are counted in its own order: its tile t is the block's tile t * kStreams + stream.
  __shared__ int page_s[kStreams][kPageRing][kTileTokens / kMinBlockSize];
  int(*const page_ring)[kTileTokens / kMinBlockSize] = page_s[stream];
  auto page_of = [&](int tile, int j) -> int {
    const int pos = start + (tile * kStreams + stream) * kTileTokens + (j << bs_log2);
    return pos < table_end ? __ldg(bt_row + (pos >> bs_log2)) : -1;
  };

  const bool reads_page = loader < num_stages * pages_per_tile;
  const int first_page = reads_page ? page_of(loader / pages_per_tile, loader % pages_per_tile) : -1;
  {
    for (int i = threadIdx.x; i < kRows * C; i += kWgmmaThreads * WARPGROUPS) {
      const int r = i / C;
      const int c = i - r * C;
      const bool valid = r < rows_valid;  // padding rows: zeros
      const T* src = static_cast<const T*>(p.query);
      if (valid) src += qr.row(r) * p.q_stride_seq + static_cast<int64_t>(qr.head(r)) * p.q_stride_head + c * 8;
      cp_async_16(q_s0 + (r / kWgmmaRows) * 2 * kPlaneBytes + plane_offset(r % kWgmmaRows, c), src, valid);
    }
    cp_async_commit();
  }

  if constexpr (!MULTI) qr.set_seq_len(min(seq_len_read, capacity));
  const int seq_len = qr.seq_len;
  const int end = min(start + p.partition_size, qr.key_end());
  const bool split = p.num_partitions > 1;
  const bool cluster = p.cluster_merge != 0;
  // The merge kernel reads a decode sequence's partitions that hold tokens, and every partition of a row
  // with several tokens a sequence; a cluster's blocks must all reach its barriers.
  if (split && !cluster && !MULTI && start >= seq_len) {
    cp_async_wait<0>();
    return;
  }
  const int block_tiles = end > start ? (end - start + kTileTokens - 1) / kTileTokens : 0;
  const int num_tiles = (block_tiles - stream + kStreams - 1) / kStreams;  // this stream's

  const uint32_t k_block_bytes = static_cast<uint32_t>(p.kc_stride_block * sizeof(T));
  const uint32_t k_token_bytes = static_cast<uint32_t>(p.kc_stride_token * sizeof(T));
  const uint32_t v_block_bytes = static_cast<uint32_t>(p.vc_stride_block * sizeof(T));
  const uint32_t v_token_bytes = static_cast<uint32_t>(p.vc_stride_token * sizeof(T));
  const int chunk = loader % C;  // each loader copies one chunk of every (kLoaders / C)-th token
  const uint64_t k_row = reinterpret_cast<uint64_t>(k_base) + chunk * 16;
  const uint64_t v_row = reinterpret_cast<uint64_t>(v_base) + chunk * 16;

  // Copies tile `tile` (64 tokens of K and V) into pipeline stage `stage`; zero-fills masked tokens.
  auto issue_tile = [&](int tile, int stage) {
    const int tile_first = start + (tile * kStreams + stream) * kTileTokens;
    const int tile_tokens = end - tile_first;     // tokens of this tile before the end
    const int tile_skip = first_key - tile_first;  // and before the first key
    const int* pages = page_ring[tile % kPageRing];
    const uint64_t stream_policy = l2_evict_first_policy();
    const uint32_t k_dst = kv_s + stage * kStageBytes;
#pragma unroll
    for (int it = 0; it < kLoadIters; ++it) {
      const int t = loader / C + it * (kLoaders / C);
      const int page = pages[t >> bs_log2];
      const bool valid = t < tile_tokens && t >= tile_skip &&
                         static_cast<unsigned>(page) < static_cast<unsigned>(p.num_blocks);
      const uint32_t page_index = valid ? static_cast<uint32_t>(page) : 0u;
      const uint32_t off = static_cast<uint32_t>(t & bs_mask);
      const void* ksrc =
          reinterpret_cast<const void*>(mad_wide(page_index, k_block_bytes, mad_wide(off, k_token_bytes, k_row)));
      const void* vsrc =
          reinterpret_cast<const void*>(mad_wide(page_index, v_block_bytes, mad_wide(off, v_token_bytes, v_row)));
      const uint32_t dst = k_dst + plane_offset(t, chunk);
      cp_async_16(dst, ksrc, valid, stream_policy);
      cp_async_16(dst + 2 * kPlaneBytes, vsrc, valid, stream_policy);
    }
  };

  // Two warpgroups of their own streams wait for their own copies only (named barriers), never for each
  // other's; warpgroups that split the rows share every tile.
  auto warpgroup_sync = [&] {
    if constexpr (kStreams == 1) {
      __syncthreads();
    } else if (wg == 0) {
      named_barrier_sync<1, kWgmmaThreads>();
    } else {
      named_barrier_sync<2, kWgmmaThreads>();
    }
  };

  if (reads_page) page_ring[(loader / pages_per_tile) % kPageRing][loader % pages_per_tile] = first_page;
  __syncthreads();  // page_s
  for (int s = 0; s < num_stages - 1; ++s) {
    if (s < num_tiles) issue_tile(s, s);
    cp_async_commit();
  }
  if constexpr (WARPGROUPS > 1) {
    // Both warpgroups' threads copied the query: all of it lands before either reads it.
    cp_async_wait_dynamic(num_stages - 1);
    __syncthreads();
  }

  const int row0 = (kRowSplit ? wg * kWgmmaRows : 0) + warp * 16 + (lane >> 2);  // this thread's two rows
  const int row1 = row0 + 8;
  const RowPair rp = row_pair(p, qr, row0, row1, end);
  const ScoreMap map = score_map(p);

  float o[64];  // 16 column tiles of 8 x (row0: 2 values, row1: 2 values)
#pragma unroll
  for (int i = 0; i < 64; ++i) o[i] = 0.f;
  float m0 = -INFINITY, m1 = -INFINITY;
  float l0 = 0.f, l1 = 0.f;

  // Operand descriptors (wgmma.cuh): Q and stage 0's K K-major, stage 0's V MN-major.
  const uint64_t q_desc = wgmma_desc(q_s, 16, 1024);
  const uint64_t k_desc0 = wgmma_desc(kv_s, 16, 1024);
  const uint64_t v_desc0 = wgmma_desc(kv_s + 2 * kPlaneBytes, kPlaneBytes, 1024);
  // A warpgroup of split rows that are all padding (a short sequence's tile) only copies its share.
  const bool computes = !kRowSplit || wg * kWgmmaRows < rows_valid;
  // A counter, not tile % num_stages: a division by a run-time value is some 20 instructions a tile.
  for (int tile = 0, stage = 0; tile < num_tiles; ++tile, stage = stage + 1 == num_stages ? 0 : stage + 1) {
    const int ahead = tile + num_stages;
    const int ahead_page = loader < pages_per_tile ? page_of(ahead, loader) : -1;
    const int next = tile + num_stages - 1;
    // Tile `next` refills the stage the previous iteration read (next = tile - 1 modulo num_stages).
    if (next < num_tiles) issue_tile(next, stage == 0 ? num_stages - 1 : stage - 1);
    cp_async_commit();
    cp_async_wait_dynamic(num_stages - 1);  // this tile (and, the first time, the query) has landed
    fence_proxy_async_shared();             // ... and is visible to wgmma
    warpgroup_sync();

    const int tile_start = start + (tile * kStreams + stream) * kTileTokens;
    const uint64_t k_desc = wgmma_desc_advance(k_desc0, stage * kStageBytes);
    const uint64_t v_desc = wgmma_desc_advance(v_desc0, stage * kStageBytes);
    if (computes) {
      float s[32];  // 8 column tiles of 8 tokens
#pragma unroll
      for (int i = 0; i < 32; ++i) s[i] = 0.f;
      wgmma_fence();
#pragma unroll
      for (int ks = 0; ks < kWgmmaHead / 16; ++ks) {
        const uint32_t step = (ks >> 2) * kPlaneBytes + (ks & 3) * 32;
        wgmma_m64n64k16_ss<Traits::kIsBF16>(s, wgmma_desc_advance(q_desc, step), wgmma_desc_advance(k_desc, step),
                                            ks > 0);
      }
      wgmma_commit();
      wgmma_wait<0>();

      // S's accumulators are 8 column tiles of the mma layout, which the online softmax takes as [8][4].
      const float2 corr = online_softmax_step(reinterpret_cast<float(&)[8][4]>(s), tile_start + ((lane & 3) << 1), rp,
                                              map, m0, m1, l0, l1);
      const float corr0 = corr.x, corr1 = corr.y;
      if (__any_sync(0xffffffffu, corr0 != 1.f || corr1 != 1.f)) {
#pragma unroll
        for (int n = 0; n < 16; ++n) {
          o[4 * n] *= corr0;
          o[4 * n + 1] *= corr0;
          o[4 * n + 2] *= corr1;
          o[4 * n + 3] *= corr1;
        }
      }

      // P (the accumulator layout of S) is the A-register layout of P V: a k-step per 16 tokens.
      uint32_t pa[4][4];
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
#pragma unroll
        for (int i = 0; i < 4; ++i) pa[kk][i] = Traits::pack2(s[8 * kk + 2 * i], s[8 * kk + 2 * i + 1]);
      }
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
        wgmma_m64n128k16_rs<Traits::kIsBF16>(o, pa[kk], wgmma_desc_advance(v_desc, kk * 16 * 128), true);
      }
      wgmma_commit();
      wgmma_wait<0>();  // the stage is refilled after the barrier below
    }

    if (loader < pages_per_tile) page_ring[ahead % kPageRing][loader] = ahead_page;
    warpgroup_sync();
  }
  cp_async_wait<0>();  // trailing (empty) groups; the stage buffers become the cluster merge's
  grid_launch_dependents();
  if constexpr (kStreams == 2) {
    // Thread tid of either warpgroup holds the same rows and columns: the second leaves its O, m and l in
    // its own stages (no longer read), the first rescales both to the larger max and adds them.
    const uint32_t second_stages = kv_s0 + num_stages * kStageBytes;
    float* state = reinterpret_cast<float*>(smem_raw + (second_stages - raw)) + tid * kStateStride;
    if (wg == 1) {
#pragma unroll
      for (int i = 0; i < 16; ++i) {
        *reinterpret_cast<float4*>(state + 4 * i) = make_float4(o[4 * i], o[4 * i + 1], o[4 * i + 2], o[4 * i + 3]);
      }
      *reinterpret_cast<float4*>(state + 64) = make_float4(m0, m1, l0, l1);
    }
    __syncthreads();
    if (wg == 0) {
      const float4 other = *reinterpret_cast<const float4*>(state + 64);  // m0, m1, l0, l1
      const float mx0 = fmaxf(m0, other.x), mx1 = fmaxf(m1, other.y);
      // A warpgroup that attended nothing in a row (-inf) weighs 0 there.
      const float a0 = m0 == -INFINITY ? 0.f : fast_exp2(m0 - mx0);
      const float a1 = m1 == -INFINITY ? 0.f : fast_exp2(m1 - mx1);
      const float b0 = other.x == -INFINITY ? 0.f : fast_exp2(other.x - mx0);
      const float b1 = other.y == -INFINITY ? 0.f : fast_exp2(other.y - mx1);
      m0 = mx0;
      m1 = mx1;
      l0 = fmaf(l0, a0, other.z * b0);
      l1 = fmaf(l1, a1, other.w * b1);
#pragma unroll
      for (int i = 0; i < 16; ++i) {
        const float4 x = *reinterpret_cast<const float4*>(state + 4 * i);
        o[4 * i] = fmaf(o[4 * i], a0, x.x * b0);
        o[4 * i + 1] = fmaf(o[4 * i + 1], a0, x.y * b0);
        o[4 * i + 2] = fmaf(o[4 * i + 2], a1, x.z * b1);
        o[4 * i + 3] = fmaf(o[4 * i + 3], a1, x.w * b1);
      }
    }
  }

  // Epilogue, from registers: each row's output (or, split, its normalised partial and log-sum-exp: in
  // this block's shared memory for the cluster merge, else in global memory for the merge kernel).
  __shared__ float row_lse[kWgmmaRows];
  // In the output's type: the peers read half the bytes of float32 partials, for one more rounding.
  T* partial = reinterpret_cast<T*>(smem_raw + (kv_s0 - raw));  // [kWgmmaRows][kPartialStride]
  auto out_row = [&](int r) {
    return static_cast<T*>(p.out) + qr.row(r) * p.o_stride_seq + static_cast<int64_t>(qr.head(r)) * p.o_stride_head;
  };
  l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
  l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
  l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
  l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
  // The first warpgroup writes (with two streams, it holds the block's result); with the rows split, each
  // warpgroup writes its own.
#pragma unroll
  for (int half = 0; half < 2 && (kRowSplit || wg == 0); ++half) {
    const int r = half == 0 ? row0 : row1;
    if (r >= rows_valid) continue;
    const float m = half == 0 ? m0 : m1;
    // The sink joins the denominator once: here unsplit, else where the partitions merge.
    const float sum = split ? (half == 0 ? l0 : l1) : with_sink(half == 0 ? l0 : l1, m, sink_log2(p, qr.head(r)));
    // Zeros only where the row sees no key of the partition: a NaN sum stays NaN.
    const bool attended = qr.attends(r, start, end);
    const float inv = attended ? 1.f / sum : 0.f;
    const float lse = attended ? m + log2f(sum) : -INFINITY;
    if (!split) {
      T* out = out_row(r);
#pragma unroll
      for (int n = 0; n < 16; ++n) {
        const int col = n * 8 + ((lane & 3) << 1);
        *reinterpret_cast<uint32_t*>(out + col) =
            Traits::pack2(o[4 * n + 2 * half] * inv, o[4 * n + 2 * half + 1] * inv);
      }
    } else if (cluster) {
#pragma unroll
      for (int n = 0; n < 16; ++n) {
        const int col = n * 8 + ((lane & 3) << 1);
        *reinterpret_cast<uint32_t*>(partial + r * kPartialStride + col) =
            Traits::pack2(o[4 * n + 2 * half] * inv, o[4 * n + 2 * half + 1] * inv);
      }
      if ((lane & 3) == 0) row_lse[r] = lse;
    } else {
      const int64_t row_index = (qr.row(r) * p.num_heads + qr.head(r)) * p.num_partitions + partition;
      float* tmp = p.tmp_out + row_index * kWgmmaHead;
#pragma unroll
      for (int n = 0; n < 16; ++n) {
        const int col = n * 8 + ((lane & 3) << 1);
        *reinterpret_cast<float2*>(tmp + col) = make_float2(o[4 * n + 2 * half] * inv, o[4 * n + 2 * half + 1] * inv);
      }
      if ((lane & 3) == 0) p.tmp_lse[row_index] = lse;
    }
  }
  if (cluster) {
    merge_in_cluster<kWgmmaHead, T>(p.num_partitions, seq_len > 0, rows_valid, row_lse,
                                    [&](int r) { return partial + r * kPartialStride; }, out_row,
                                    [&](int r) { return sink_log2(p, qr.head(r)); });
  }
#else
  __trap();
#endif
}

}  // namespace tpkit

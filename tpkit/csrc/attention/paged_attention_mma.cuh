// Decode attention for fp16/bf16 on tensor cores. Torch-free.
//
// One thread block per (sequence, KV head, partition of the context) serves every query head of that KV
// head's group, so each K/V byte is read from device memory once. The group's queries are the rows of a
// matrix (padded to 16): S = Q K^T and O += P V are m16n8k16 mma.sync products fed by ldmatrix from shared
// memory. K/V pages stream through a multi-stage cp.async pipeline of 64-token tiles; masked tokens are
// zero-filled. Warps split the query rows in 16-row tiles (warps_m) and each tile's tokens (warps_n), each
// keeping its own online softmax; the epilogue merges the warps' partial results through shared memory and
// writes either the output or, with split-K, the partition's normalised output and log-sum-exp: to global
// memory for the merge kernel, or (Hopper) to shared memory, where the partitions of a thread-block cluster
// merge them through distributed shared memory.
#pragma once

#include <math.h>

#include <type_traits>

#include "common/dtype_traits.cuh"
#include "common/fp8.cuh"
#include "attention/paged_attention.h"
#include "attention/paged_attention_dispatch.h"
#include "attention/paged_attention_fp8.cuh"
#include "attention/paged_attention_merge.cuh"
#include "attention/paged_attention_rows.cuh"
#include "common/ptx.cuh"

namespace tpkit {

constexpr int kTileTokens = 64;      // tokens per pipeline stage
constexpr int kLoaderThreads = 128;  // threads that issue the cp.async copies (every config has >= 128)
constexpr int kMaxThreads = 256;
constexpr int kMinBlockSize = 8;  // smallest supported KV block: at most 8 pages per tile
constexpr int kPageRing = 8;      // page-id slots, one per tile; more than the deepest pipeline (4) + 1
constexpr int kFp8PageRing = 16;  // the same for float8 caches, whose pipelines are up to 8 deep

// Head size rounded up to the mma k-step.
constexpr int padded_head(int head) { return (head + 15) / 16 * 16; }

// Rows of a multiple of 8 chunks (16 bytes each) can be stored unpadded and swizzled (below).
template <int HEAD>
constexpr bool kSwizzleable = padded_head(HEAD) / 8 % 8 == 0;

// Shared-memory layout of one row (a token's K or V, or a query) in 16-byte chunks. Padded rows have an odd
// number of chunks, so ldmatrix's 8 rows hit 8 distinct bank groups. Swizzled rows are unpadded: chunk c of
// row r is stored at c ^ (r & 7), which keeps ldmatrix conflict-free and every 32-byte global sector in one
// 32-byte unit (a padded row splits its sectors: cp.async asks L2 for 1.5x the bytes). The plan picks it.
template <int HEAD, bool SWIZZLED>
struct MmaLayout {
  static_assert(HEAD % 8 == 0, "head size must be a multiple of 8");
  static_assert(!SWIZZLED || kSwizzleable<HEAD>, "swizzled rows need a multiple of 8 chunks");
  static constexpr int kChunks = HEAD / 8;                // chunks of real data
  static constexpr int kPadded = padded_head(HEAD);
  static constexpr int kPaddedChunks = kPadded / 8;       // even
  static constexpr bool kSwizzled = SWIZZLED;
  static constexpr int kRowStride = kSwizzled ? kPaddedChunks : kPaddedChunks + 1;
  static constexpr int kRowBytes = kRowStride * 16;
  // Where chunk c of row r is stored.
  __device__ static int chunk(int r, int c) { return kSwizzled ? c ^ (r & 7) : c; }
  // ldmatrix: a lane reads chunk 2 * step + x (x = 0 or 1) of its row r. Its shared-memory address is
  // at(row address + lane_base(x) * 16 + 2 * step * 16, lane_bits(r, x)): with rows 128-byte aligned, the
  // swizzle is one XOR of address bits 4-6, and the rest stays an immediate.
  __device__ static int lane_base(int x) { return kSwizzled ? 0 : x; }
  __device__ static uint32_t lane_bits(int r, int x) { return kSwizzled ? (x ^ (r & 7)) << 4 : 0u; }
  __device__ static uint32_t at(uint32_t addr, uint32_t bits) { return kSwizzled ? addr ^ bits : addr; }
  static constexpr int kKSteps = kPadded / 16;            // k-steps of S = Q K^T
  static constexpr int kNTiles = kPadded / 8;             // 8-column tiles of O
  static constexpr int kOutStride = kPadded + 4;          // float row stride of the epilogue buffer
  static constexpr bool kQueryInRegisters = kKSteps <= 4; // hold Q fragments (<= 16 registers)
};

// Register caps that keep each head size at its occupancy: <= 80 registers for head 32, <= 128 (16 warps per
// SM) for 64-96, <= 168 (12 warps) for 112-128.
constexpr int max_registers(int head) { return head <= 32 ? 80 : head <= 96 ? 128 : head <= 128 ? 168 : 255; }

// A thread's two rows of S (row0, row1): the keys each sees (positions begin .. end - 1), its query position
// (ALiBi's distances are measured from it) and its ALiBi slope (times log2 e; 0 without ALiBi).
struct RowPair {
  int begin0, begin1, end0, end1;
  float q0, q1, slope0, slope1;
};

// How a raw score q . k becomes a log2-domain logit: times scale_log2, or with a soft cap (cap_log2 > 0)
// cap_log2 * tanh(score * cap_scale), i.e. cap * tanh(scale * score / cap) times log2 e.
struct ScoreMap {
  float scale_log2, cap_scale, cap_log2;
};

// k_scale: a float8 cache's key scale (stored keys times it are the keys), 1 otherwise.
__device__ __forceinline__ ScoreMap score_map(const tpkit_paged_attention_args& p, float k_scale = 1.f) {
  return {p.scale_log2 * k_scale, p.soft_cap_scale * k_scale, p.soft_cap_log2};
}

// The RowPair of a thread's rows row0, row1 (ALiBi slope 0 for padding rows), their keys cut at the
// partition's end.
__device__ __forceinline__ RowPair row_pair(const tpkit_paged_attention_args& p, const QueryRows& qr, int row0,
                                            int row1, int end) {
  RowPair rp;
  rp.begin0 = qr.begin(row0);
  rp.begin1 = qr.begin(row1);
  rp.end0 = min(end, qr.end(row0));
  rp.end1 = min(end, qr.end(row1));
  rp.q0 = qr.position(row0);
  rp.q1 = qr.position(row1);
  rp.slope0 = p.alibi_slopes != nullptr && row0 < qr.rows_valid ? p.alibi_slopes[qr.head(row0)] * kLog2e : 0.f;
  rp.slope1 = p.alibi_slopes != nullptr && row1 < qr.rows_valid ? p.alibi_slopes[qr.head(row1)] * kLog2e : 0.f;
  return rp;
}


// One step of the online softmax for a thread's two rows of S, held as NJ 8-column tiles in the mma
// accumulator layout (elements 0 and 1 of a tile: row0 at columns 2c and 2c + 1 of the tile, c = lane & 3;
// elements 2 and 3: row1, the same columns), which wgmma's m64 accumulators share warp by warp. Scores
// go to the log2 domain (map) with ALiBi, positions outside a row's keys are masked, then each becomes
// exp2(score - the row's running max) in place, and the running max (m) and sum (l) are updated. pos_base:
// the position of this thread's first column. Returns the factors (row0, row1) that the rows' output
// accumulators must be multiplied by: exactly 1 once the max stops moving.
template <int NJ>
__device__ __forceinline__ float2 online_softmax_step(float (&s)[NJ][4], int pos_base, const RowPair& rp,
                                                      const ScoreMap& map, float& m0, float& m1, float& l0,
                                                      float& l1) {
  // Most steps have no ALiBi, no soft cap and no masked column: the max is then taken of the raw scores (the
  // same order for a positive scale) and the scale rides on the exp2's multiply-add, 4 instructions a score,
  // not 9.
  const bool raw = rp.slope0 == 0.f && rp.slope1 == 0.f && map.scale_log2 > 0.f && map.cap_log2 == 0.f &&
                   pos_base + (NJ - 1) * 8 + 1 < min(rp.end0, rp.end1) && pos_base >= max(rp.begin0, rp.begin1);
  if (!raw) {
    // One branch for the whole step: the capped logits' tanh is not computed where there is no cap.
    if (map.cap_log2 > 0.f) {
#pragma unroll
      for (int j = 0; j < NJ; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) s[j][e] = map.cap_log2 * fast_tanh(s[j][e] * map.cap_scale);
      }
    } else {
#pragma unroll
      for (int j = 0; j < NJ; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) s[j][e] *= map.scale_log2;
      }
    }
#pragma unroll
    for (int j = 0; j < NJ; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int pos = pos_base + j * 8 + (e & 1);
        const bool first = e < 2;
        const float v = fmaf(first ? rp.slope0 : rp.slope1, static_cast<float>(pos) - (first ? rp.q0 : rp.q1), s[j][e]);
        s[j][e] = pos < (first ? rp.end0 : rp.end1) && pos >= (first ? rp.begin0 : rp.begin1) ? v : -INFINITY;
      }
    }
  }
  const float scale = raw ? map.scale_log2 : 1.f;
  float mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
  for (int j = 0; j < NJ; ++j) {
    mx0 = fmaxf(mx0, fmaxf(s[j][0], s[j][1]));
    mx1 = fmaxf(mx1, fmaxf(s[j][2], s[j][3]));
  }
  mx0 *= scale;
  mx1 *= scale;
  mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
  mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
  mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
  mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
  const float new_m0 = fmaxf(m0, mx0);
  const float new_m1 = fmaxf(m1, mx1);
  // A row with no unmasked token yet keeps -inf; subtract 0 then, not -inf (inf - inf = NaN).
  const float use_m0 = new_m0 == -INFINITY ? 0.f : new_m0;
  const float use_m1 = new_m1 == -INFINITY ? 0.f : new_m1;
  const float corr0 = fast_exp2(m0 - use_m0);
  const float corr1 = fast_exp2(m1 - use_m1);
  m0 = new_m0;
  m1 = new_m1;
  float sum0 = 0.f, sum1 = 0.f;
#pragma unroll
  for (int j = 0; j < NJ; ++j) {
    s[j][0] = fast_exp2(fmaf(s[j][0], scale, -use_m0));
    s[j][1] = fast_exp2(fmaf(s[j][1], scale, -use_m0));
    s[j][2] = fast_exp2(fmaf(s[j][2], scale, -use_m1));
    s[j][3] = fast_exp2(fmaf(s[j][3], scale, -use_m1));
    sum0 += s[j][0] + s[j][1];
    sum1 += s[j][2] + s[j][3];
  }
  l0 = fmaf(l0, corr0, sum0);
  l1 = fmaf(l1, corr1, sum1);
  return make_float2(corr0, corr1);
}

// Before griddepcontrol.wait (both kernels): asks L2 for what a block's prologue reads first, the rows_valid
// query rows from q_rows (HEAD elements each, q_stride_head apart), the length and `entries` table entries,
// so that after the wait they come from L2, not DRAM. Safe where the kernel before writes them: a prefetch
// returns no data, that kernel's writes land in L2, and the reads come after the wait.
template <typename T, int HEAD>
__device__ __forceinline__ void prefetch_prologue(const T* q_rows, int64_t q_stride_head, int rows_valid,
                                                  const int* seq_len, const int* entries_first, int entries) {
  constexpr int kRowLines = (HEAD * static_cast<int>(sizeof(T)) + 127) / 128;
  const uintptr_t table_first = reinterpret_cast<uintptr_t>(entries_first);
  const int table_lines = entries > 0 ? static_cast<int>((table_first % 128 + entries * 4 + 127) / 128) : 0;
  for (int i = threadIdx.x; i < rows_valid * kRowLines + 1 + table_lines; i += blockDim.x) {
    if (i < rows_valid * kRowLines) {
      prefetch_l2(reinterpret_cast<const char*>(q_rows + (i / kRowLines) * q_stride_head) + (i % kRowLines) * 128);
    } else if (i == rows_valid * kRowLines) {
      prefetch_l2(seq_len);
    } else {
      prefetch_l2(reinterpret_cast<const void*>(table_first / 128 * 128 + (i - rows_valid * kRowLines - 1) * 128));
    }
  }
}

// FP8: the caches' float8 format (tpkit_fp8_format), or TPKIT_FP8_NONE for caches of T. A float8 tile streams
// into its stage as stored (half the bytes) and the products read it from there: each ldmatrix fragment is
// converted in registers into fp16 (exactly), the query rewritten to match (prepare_fp8_query), and V's
// fragments split by column parity, so that each 16-column chunk's even and odd columns are two 8-column
// output tiles. The scales go on the scores (k) and the output (v).
// SLICES: 16-token slices a warp takes at a time (1 or 2; the plan's `slices`). Two give twice the independent
// mma chains in flight and one softmax update per 32 tokens, for the large groups that are bound by issue
// latency; a kernel of its own, so the one-slice kernel keeps its registers. SWIZZLED: the layout (MmaLayout).
// MULTI: rows of several query tokens a sequence (query_start_loc set), a kernel of its own so that the
// decode kernels keep their registers.
template <typename T, int HEAD, int SLICES, bool SWIZZLED, bool MULTI, int FP8 = TPKIT_FP8_NONE>
__global__ void __launch_bounds__(kMaxThreads) __maxnreg__(max_registers(HEAD))
    paged_attention_mma_kernel(const tpkit_paged_attention_args p) {
  using L = MmaLayout<HEAD, SWIZZLED>;
  static_assert(SLICES == 1 || (SLICES == 2 && !L::kQueryInRegisters), "two slices only with Q in shared memory");
  constexpr bool kFp8 = FP8 != TPKIT_FP8_NONE;
  static_assert(!kFp8 || (HEAD % 16 == 0 && SLICES == 1), "float8 rows load in 16-byte chunks, one slice");
  using KV = std::conditional_t<kFp8, uint8_t, T>;  // a cache element as stored
  using F = Fp8Layout<kFp8 ? HEAD : 16>;             // float8 stages' rows
  using CT = std::conditional_t<kFp8, __half, T>;    // the products' operand type
  constexpr bool kMmaBF16 = DTypeTraits<CT>::kIsBF16;
  constexpr int C = L::kChunks;
  constexpr int CL = HEAD * static_cast<int>(sizeof(KV)) / 16;  // 16-byte chunks a cached row loads in
  constexpr int RS = L::kRowStride;
  constexpr int kLoadIters = (kTileTokens * CL + kLoaderThreads - 1) / kLoaderThreads;

  extern __shared__ __align__(128) uint4 smem[];  // swizzled rows start 128-byte aligned
  // KV heads vary fastest, so the blocks reading the same pages (one per KV head) run side by side.
  const BlockCoords coords = block_coords<MULTI>(p);
  const int kv_head = coords.kv_head;
  const int partition = blockIdx.y;
  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int warp_m = warp / p.warps_n;
  const int warp_n = warp - warp_m * p.warps_n;
  const int num_warps = blockDim.x >> 5;
  const int rows = p.rows_per_cta;
  const int first_head = coords.m_group * rows;  // within the group
  const int group_heads = min(rows, p.group_size - first_head);
  const int head0 = kv_head * p.group_size + first_head;

  const int capacity = p.max_blocks_per_seq << p.block_size_log2;
  // This partition's keys and table entries (with a window, shifted to the window's first block below).
  int start = partition * p.partition_size;
  int table_end = min(start + p.partition_size, capacity);
  const int num_stages = p.num_stages;
  const int bs_log2 = p.block_size_log2;
  const int pages_per_tile = kTileTokens >> bs_log2;

  // Launched as a programmatic dependent (Hopper): the blocks may start while the previous kernel drains;
  // every input may come from it, so nothing is read before it has finished, only prefetched into L2.
  int seq_len_read = 0;
  QueryRows qr = start_rows<MULTI>(p, coords, head0, group_heads, [&](int seq) {
    prefetch_prologue<T, HEAD>(static_cast<const T*>(p.query) + seq * p.q_stride_seq + head0 * p.q_stride_head,
                               p.q_stride_head, group_heads, p.seq_lens + seq,
                               p.block_tables + seq * p.bt_stride + (start >> bs_log2),
                               min(num_stages * pages_per_tile, (table_end - start) >> bs_log2));
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

  uint4* q_s = smem;                                 // [rows][RS]
  uint4* k_s = q_s + rows * RS;                      // [num_stages][kTileTokens][RS]
  uint4* v_s = k_s + num_stages * kTileTokens * RS;  // [num_stages][kTileTokens][RS]
  // Float8 stages in their place, as stored: [num_stages][kTileTokens][F::kRowStride] chunks of K, then V.
  uint4* k8_s = k_s;
  uint4* v8_s = k8_s + num_stages * kTileTokens * F::kRowStride;

  const KV* k_base = static_cast<const KV*>(p.key_cache) + static_cast<int64_t>(kv_head) * p.kc_stride_head;
  const KV* v_base = static_cast<const KV*>(p.value_cache) + static_cast<int64_t>(kv_head) * p.vc_stride_head;
  const int bs_mask = (1 << bs_log2) - 1;

  // Physical pages of the tiles ahead, one ring slot per tile: a tile's block-table reads are issued an
  // iteration before its copies, so no copy waits on a dependent global load. Entries past the sequence's
  // end (inside its table row) are read too, so the reads need not wait for its length; copies skip them.
  constexpr int kRing = kFp8 ? kFp8PageRing : kPageRing;
  __shared__ int page_s[kRing][kTileTokens / kMinBlockSize];
  auto page_of = [&](int tile, int j) -> int {  // j-th page of tile, or -1 past the partition's entries
    const int pos = start + tile * kTileTokens + (j << bs_log2);
    return pos < table_end ? __ldg(bt_row + (pos >> bs_log2)) : -1;
  };

  // Prologue: pages of the first num_stages tiles (at most 8 x 8 entries, one a thread) and the query (its
  // own cp.async group, the first) in flight together; then tiles 0 .. num_stages - 2.
  const bool reads_page = tid < num_stages * pages_per_tile;
  const int first_page = reads_page ? page_of(tid / pages_per_tile, tid % pages_per_tile) : -1;
  {
    for (int i = tid; i < rows * L::kPaddedChunks; i += blockDim.x) {
      const int r = i / L::kPaddedChunks;
      const int c = i - r * L::kPaddedChunks;
      const bool valid = r < rows_valid && c < C;  // padding rows and the head-120 pad chunk: zeros
      const T* src = static_cast<const T*>(p.query);
      if (valid) src += qr.row(r) * p.q_stride_seq + static_cast<int64_t>(qr.head(r)) * p.q_stride_head + c * 8;
      cp_async_16(smem_addr(q_s + r * RS + L::chunk(r, c)), src, valid);
    }
    cp_async_commit();
  }

  // Clamped to the table's capacity: a bad length must not read past the sequence's table row.
  if constexpr (!MULTI) qr.set_seq_len(min(seq_len_read, capacity));
  const int seq_len = qr.seq_len;
  const int end = min(start + p.partition_size, qr.key_end());
  const bool split = p.num_partitions > 1;
  const bool cluster = p.cluster_merge != 0;
  // The merge kernel reads a decode sequence's partitions that hold tokens, and every partition of a row
  // with several tokens a sequence; a cluster's blocks must all reach its barriers.
  if (split && !cluster && !MULTI && start >= seq_len) {
    cp_async_wait<0>();  // the query's copies land before the block's shared memory is given back
    return;
  }
  const int num_tiles = end > start ? (end - start + kTileTokens - 1) / kTileTokens : 0;

  // Block and token strides of the caches in bytes, 32-bit (the binding checks that they fit): a copy's
  // source address is two wide multiply-adds (64-bit strides in elements would make the address arithmetic
  // most of the kernel's instructions).
  const uint32_t k_block_bytes = static_cast<uint32_t>(p.kc_stride_block * sizeof(KV));
  const uint32_t k_token_bytes = static_cast<uint32_t>(p.kc_stride_token * sizeof(KV));
  const uint32_t v_block_bytes = static_cast<uint32_t>(p.vc_stride_block * sizeof(KV));
  const uint32_t v_token_bytes = static_cast<uint32_t>(p.vc_stride_token * sizeof(KV));
  // Loader threads and their chunk: with CL dividing kLoaderThreads, a thread keeps its chunk from copy to
  // copy and steps kLoaderThreads / CL tokens.
  constexpr bool kFixedChunk = kLoaderThreads % CL == 0;

  // Copies tile `tile` (64 tokens of K and V) into pipeline stage `stage`; zero-fills masked tokens.
  auto issue_tile = [&](int tile, int stage) {
    if (tid >= kLoaderThreads) return;
    // Otherwise each copy's token and chunk are recomputed, not kept in registers across the main loop.
    const unsigned loader = kFixedChunk ? static_cast<unsigned>(tid) : opaque_thread_index();
    const int tile_tokens = end - (start + tile * kTileTokens);  // tokens of this tile before the end
    const int tile_skip = first_key - (start + tile * kTileTokens);  // tokens of this tile before the first
    const int* pages = page_s[tile % kRing];
    const uint64_t stream_policy = l2_evict_first_policy();
    const uint32_t k_dst = smem_addr(kFp8 ? k8_s + stage * kTileTokens * F::kRowStride : k_s + stage * kTileTokens * RS);
    const uint32_t v_dst = smem_addr(kFp8 ? v8_s + stage * kTileTokens * F::kRowStride : v_s + stage * kTileTokens * RS);
#pragma unroll
    for (int it = 0; it < kLoadIters; ++it) {
      const int i = static_cast<int>(loader) + it * kLoaderThreads;
      if ((kTileTokens * CL) % kLoaderThreads == 0 || i < kTileTokens * CL) {
        const int t = kFixedChunk ? static_cast<int>(loader / CL) + it * (kLoaderThreads / CL) : i / CL;
        const int c = kFixedChunk ? static_cast<int>(loader % CL) : i - t * CL;
        const int page = pages[t >> bs_log2];
        const bool valid = t < tile_tokens && t >= tile_skip &&
                           static_cast<unsigned>(page) < static_cast<unsigned>(p.num_blocks);
        // A masked token copies nothing (zero fill), from an address inside the cache: page 0's.
        const uint32_t page_index = valid ? static_cast<uint32_t>(page) : 0u;
        const uint32_t off = static_cast<uint32_t>(t & bs_mask);
        const uint64_t k_row = reinterpret_cast<uint64_t>(k_base) + c * 16;
        const uint64_t v_row = reinterpret_cast<uint64_t>(v_base) + c * 16;
        const void* ksrc = reinterpret_cast<const void*>(
            mad_wide(page_index, k_block_bytes, mad_wide(off, k_token_bytes, k_row)));
        const void* vsrc = reinterpret_cast<const void*>(
            mad_wide(page_index, v_block_bytes, mad_wide(off, v_token_bytes, v_row)));
        const uint32_t dst = kFp8 ? F::chunk(t, c) * 16 : (t * RS + L::chunk(t, c)) * 16;
        cp_async_16(k_dst + dst, ksrc, valid, stream_policy);
        cp_async_16(v_dst + dst, vsrc, valid, stream_policy);
      }
    }
  };

  if (reads_page) page_s[(tid / pages_per_tile) % kRing][tid % pages_per_tile] = first_page;
  __shared__ unsigned q_max_bits;  // prepare_fp8_query's
  if (kFp8 && tid == 0) q_max_bits = 0u;
  if constexpr (L::kPaddedChunks > C) {
    // The k-step padding column (head size 120) is never copied into: zero it once in every stage.
    for (int i = tid; i < 2 * num_stages * kTileTokens; i += blockDim.x) {
      k_s[i * RS + L::chunk(i, C)] = make_uint4(0u, 0u, 0u, 0u);  // row i of a tile is row i % 64: same r & 7
    }
  }
  __syncthreads();  // page_s
  for (int s = 0; s < num_stages - 1; ++s) {
    if (s < num_tiles) issue_tile(s, s);
    cp_async_commit();
  }
  cp_async_wait_dynamic(num_stages - 1);  // the query's group
  __syncthreads();  // q_s and the zeroed padding are visible
  int q_exp = 0;
  if constexpr (kFp8) {
    q_exp = prepare_fp8_query<T, L>(q_s, rows, &q_max_bits);
    __syncthreads();
  }

  const bool warp_active = warp_m * 16 < rows_valid;
  const int row0 = warp_m * 16 + (lane >> 2);  // this thread's two rows of the warp's 16-row tile
  const int row1 = row0 + 8;
  const RowPair rp = row_pair(p, qr, row0, row1, end);
  // A float8 cache's scales: k's on the scores, v's on the output.
  const int scale_index = kFp8 && p.kv_scale_per_head ? kv_head : 0;
  const ScoreMap map = score_map(p, kFp8 ? ldexpf(p.k_scale[scale_index], q_exp) : 1.f);
  const float out_scale = kFp8 ? p.v_scale[scale_index] : 1.f;

  uint32_t q_frag[L::kQueryInRegisters ? L::kKSteps : 1][4];
  // ldmatrix lane addresses: the lane's row (of an 8x8 matrix), its part of a step's chunk. Q: warp's rows.
  const int q_row = warp_m * 16 + (lane & 15);
  const uint32_t q_addr = smem_addr(q_s + q_row * RS + L::lane_base(lane >> 4));
  const uint32_t q_xor = L::lane_bits(q_row, lane >> 4);
  if constexpr (L::kQueryInRegisters) {
#pragma unroll
    for (int ks = 0; ks < L::kKSteps; ++ks) ldmatrix_x4(q_frag[ks], L::at(q_addr + ks * 2 * 16, q_xor));
  }

  float o[L::kNTiles][4];
#pragma unroll
  for (int n = 0; n < L::kNTiles; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
  float m0 = -INFINITY, m1 = -INFINITY;  // running max (log2 domain) of rows row0, row1
  float l0 = 0.f, l1 = 0.f;              // this thread's share of the running sums

  const int tokens_per_warp = kTileTokens / p.warps_n;
  // K (non-transposed), V (transposed): rows in a 16-token slice (slices start at multiples of 16: r & 7 = lane & 7).
  const int k_lane_off = ((lane & 7) + ((lane >> 4) << 3)) * RS + L::lane_base((lane >> 3) & 1);
  const uint32_t k_xor = L::lane_bits(lane, (lane >> 3) & 1);
  const int v_lane_off = ((lane & 7) + (((lane >> 3) & 1) << 3)) * RS + L::lane_base(lane >> 4);
  const uint32_t v_xor = L::lane_bits(lane, lane >> 4);
  // Float8 K and V alike: matrices (tokens 0-7, chunk c), (tokens 8-15, c), (0-7, c + 1), (8-15, c + 1).
  const int f_row = (lane & 7) + (((lane >> 3) & 1) << 3);
  const int f_lane_off = f_row * F::kRowStride + F::lane_base(lane >> 4);
  const uint32_t f_xor = F::lane_bits(f_row, lane >> 4);

  // A counter, not tile % num_stages: a division by a run-time value is some 20 instructions a tile.
  for (int tile = 0, stage = 0; tile < num_tiles; ++tile, stage = stage + 1 == num_stages ? 0 : stage + 1) {
    // Block-table reads for tile + num_stages: in flight during this iteration, stored at its end.
    const int ahead = tile + num_stages;
    const int ahead_page = tid < pages_per_tile ? page_of(ahead, tid) : -1;
    const int next = tile + num_stages - 1;
    // Tile `next` refills the stage the previous iteration read (next = tile - 1 modulo num_stages).
    if (next < num_tiles) issue_tile(next, stage == 0 ? num_stages - 1 : stage - 1);
    cp_async_commit();
    cp_async_wait_dynamic(num_stages - 1);
    __syncthreads();

    const int tile_start = start + tile * kTileTokens;
    const uint32_t k_stage = smem_addr(kFp8 ? k8_s + stage * kTileTokens * F::kRowStride : k_s + stage * kTileTokens * RS);
    const uint32_t v_stage = smem_addr(kFp8 ? v8_s + stage * kTileTokens * F::kRowStride : v_s + stage * kTileTokens * RS);
    if (warp_active) {
      for (int tok0 = warp_n * tokens_per_warp; tok0 < (warp_n + 1) * tokens_per_warp; tok0 += 16 * SLICES) {
        if (tile_start + tok0 >= end) break;  // the rest of this warp's slice is past the end

        constexpr int NJ = 2 * SLICES;  // 8-token column tiles of S
        float s[NJ][4];
#pragma unroll
        for (int j = 0; j < NJ; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
        // The query's fragments of k-step ks.
        auto query_step = [&](uint32_t (&a)[4], int ks) {
          if constexpr (L::kQueryInRegisters) {
#pragma unroll
            for (int i = 0; i < 4; ++i) a[i] = q_frag[ks][i];
          } else {
            ldmatrix_x4(a, L::at(q_addr + ks * 2 * 16, q_xor));
          }
        };
        if constexpr (kFp8) {
          // A lane's 4 bytes of a chunk: columns 4c .. 4c + 3 of its token, the mma's b0 and b1 pairs.
          const uint32_t k_addr = k_stage + (tok0 * F::kRowStride + f_lane_off) * 16;
#pragma unroll
          for (int ks = 0; ks < L::kKSteps; ks += 2) {
            uint32_t a[4];
            query_step(a, ks);
            if (ks + 1 < L::kKSteps) {
              uint32_t b[4], a1[4];
              ldmatrix_x4(b, F::at(k_addr + ks * 16, f_xor));
              query_step(a1, ks + 1);
#pragma unroll
              for (int i = 0; i < 4; ++i) {
                mma_m16n8k16<kMmaBF16>(s[i & 1], i < 2 ? a : a1, fp8x2_to_half2<FP8>(b[i]),
                                       fp8x2_to_half2<FP8>(b[i] >> 16));
              }
            } else {
              uint32_t b[2];
              ldmatrix_x2(b, F::at(k_addr + ks * 16, f_xor));
#pragma unroll
              for (int i = 0; i < 2; ++i) {
                mma_m16n8k16<kMmaBF16>(s[i], a, fp8x2_to_half2<FP8>(b[i]), fp8x2_to_half2<FP8>(b[i] >> 16));
              }
            }
          }
        } else {
          const uint32_t k_addr = k_stage + (tok0 * RS + k_lane_off) * 16;
#pragma unroll
          for (int ks = 0; ks < L::kKSteps; ++ks) {
            uint32_t a[4];
            query_step(a, ks);
#pragma unroll
            for (int sl = 0; sl < SLICES; ++sl) {
              uint32_t b[4];
              ldmatrix_x4(b, L::at(k_addr + (sl * 16 * RS + ks * 2) * 16, k_xor));
              mma_m16n8k16<kMmaBF16>(s[2 * sl], a, b[0], b[1]);
              mma_m16n8k16<kMmaBF16>(s[2 * sl + 1], a, b[2], b[3]);
            }
          }
        }

        const float2 corr = online_softmax_step(s, tile_start + tok0 + ((lane & 3) << 1), rp, map, m0, m1, l0, l1);
        const float corr0 = corr.x, corr1 = corr.y;
        // Once the running max settles, corrections are exactly 1: skip the rescale for the whole warp.
        if (__any_sync(0xffffffffu, corr0 != 1.f || corr1 != 1.f)) {
#pragma unroll
          for (int n = 0; n < L::kNTiles; ++n) {
            o[n][0] *= corr0;
            o[n][1] *= corr0;
            o[n][2] *= corr1;
            o[n][3] *= corr1;
          }
        }

        // P (the accumulator layout of S) is already the A-operand layout of P V, a k-step per slice.
        uint32_t pa[SLICES][4];
#pragma unroll
        for (int sl = 0; sl < SLICES; ++sl) {
          pa[sl][0] = DTypeTraits<CT>::pack2(s[2 * sl][0], s[2 * sl][1]);
          pa[sl][1] = DTypeTraits<CT>::pack2(s[2 * sl][2], s[2 * sl][3]);
          pa[sl][2] = DTypeTraits<CT>::pack2(s[2 * sl + 1][0], s[2 * sl + 1][1]);
          pa[sl][3] = DTypeTraits<CT>::pack2(s[2 * sl + 1][2], s[2 * sl + 1][3]);
        }
        if constexpr (kFp8) {
          // Transposed, byte j of a lane's register of a matrix is V[token 2c + (j >> 1)][column 2g + (j & 1)]
          // (c = lane & 3, g = lane >> 2): bytes 0 and 2 are the b pair of column 2g, bytes 1 and 3 of 2g + 1.
          // Chunk h's even columns accumulate in o[2h], its odd ones in o[2h + 1].
          const uint32_t v_addr = v_stage + (tok0 * F::kRowStride + f_lane_off) * 16;
#pragma unroll
          for (int h = 0; h < F::kChunks; h += 2) {
            if (h + 1 < F::kChunks) {
              uint32_t b[4];
              ldmatrix_x4_trans(b, F::at(v_addr + h * 16, f_xor));
#pragma unroll
              for (int i = 0; i < 4; ++i) b[i] = __byte_perm(b[i], 0u, 0x3120);  // [column 2g | column 2g + 1]
#pragma unroll
              for (int i = 0; i < 4; ++i) {
                const int pair = i & 2;  // b[pair], b[pair + 1]: tokens 0-7 and 8-15 of chunk h + pair / 2
                const uint32_t word0 = (i & 1) ? b[pair] >> 16 : b[pair];
                const uint32_t word1 = (i & 1) ? b[pair + 1] >> 16 : b[pair + 1];
                mma_m16n8k16<kMmaBF16>(o[2 * h + i], pa[0], fp8x2_to_half2<FP8>(word0), fp8x2_to_half2<FP8>(word1));
              }
            } else {
              uint32_t b[2];
              ldmatrix_x2_trans(b, F::at(v_addr + h * 16, f_xor));
              b[0] = __byte_perm(b[0], 0u, 0x3120);
              b[1] = __byte_perm(b[1], 0u, 0x3120);
              mma_m16n8k16<kMmaBF16>(o[2 * h], pa[0], fp8x2_to_half2<FP8>(b[0]), fp8x2_to_half2<FP8>(b[1]));
              mma_m16n8k16<kMmaBF16>(o[2 * h + 1], pa[0], fp8x2_to_half2<FP8>(b[0] >> 16),
                                     fp8x2_to_half2<FP8>(b[1] >> 16));
            }
          }
        } else {
          const uint32_t v_addr = v_stage + (tok0 * RS + v_lane_off) * 16;
#pragma unroll
          for (int np = 0; np < L::kNTiles / 2; ++np) {
#pragma unroll
            for (int sl = 0; sl < SLICES; ++sl) {
              uint32_t b[4];
              ldmatrix_x4_trans(b, L::at(v_addr + (sl * 16 * RS + np * 2) * 16, v_xor));
              mma_m16n8k16<kMmaBF16>(o[2 * np], pa[sl], b[0], b[1]);
              mma_m16n8k16<kMmaBF16>(o[2 * np + 1], pa[sl], b[2], b[3]);
            }
          }
        }
      }
    }
    if (tid < pages_per_tile) page_s[ahead % kRing][tid] = ahead_page;
    __syncthreads();  // this stage is refilled, and page_s read, by the next iteration
  }
  cp_async_wait<0>();  // trailing (empty) groups; the stage buffers become the epilogue's
  grid_launch_dependents();  // the merge may launch: its blocks wait for this grid's results
  __syncthreads();

  // Epilogue: merge the warps_n partial softmaxes of each row tile.
  l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
  l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
  l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
  l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
  float* red_m = reinterpret_cast<float*>(k_s);  // [num_warps][16]
  float* red_l = red_m + num_warps * 16;          // [num_warps][16]
  float* row_m = red_l + num_warps * 16;          // [rows]
  float* row_l = row_m + rows;                    // [rows]
  float* row_lse = row_l + rows;                  // [rows] (cluster merge)
  float* red_o = row_lse + rows;                  // [num_warps][16][kOutStride]
  if ((lane & 3) == 0) {
    red_m[warp * 16 + (lane >> 2)] = m0;
    red_m[warp * 16 + (lane >> 2) + 8] = m1;
    red_l[warp * 16 + (lane >> 2)] = l0;
    red_l[warp * 16 + (lane >> 2) + 8] = l1;
  }
  __syncthreads();
  if (tid < rows) {
    const int wm = tid >> 4;
    const int r = tid & 15;
    float mx = -INFINITY;
    for (int wn = 0; wn < p.warps_n; ++wn) mx = fmaxf(mx, red_m[(wm * p.warps_n + wn) * 16 + r]);
    float sum = 0.f;
    for (int wn = 0; wn < p.warps_n; ++wn) {
      const float m = red_m[(wm * p.warps_n + wn) * 16 + r];
      if (m != -INFINITY) sum += red_l[(wm * p.warps_n + wn) * 16 + r] * fast_exp2(m - mx);
    }
    row_m[tid] = mx;
    // The sink joins the denominator once: here unsplit, else where the partitions merge.
    row_l[tid] = !split && tid < rows_valid ? with_sink(sum, mx, sink_log2(p, qr.head(tid))) : sum;
  }
  __syncthreads();
  {
    const float f0 = m0 == -INFINITY ? 0.f : fast_exp2(m0 - row_m[row0]);
    const float f1 = m1 == -INFINITY ? 0.f : fast_exp2(m1 - row_m[row1]);
    float* ro = red_o + warp * 16 * L::kOutStride;
    if constexpr (kFp8) {
      // o[2h] holds chunk h's columns 16h + 2n, o[2h + 1] its columns 16h + 2n + 1: a lane's four are
      // 16h + 4c .. 16h + 4c + 3.
#pragma unroll
      for (int h = 0; h < F::kChunks; ++h) {
        const int col = h * 16 + ((lane & 3) << 2);
        const float(&e)[4] = o[2 * h];
        const float(&d)[4] = o[2 * h + 1];
        *reinterpret_cast<float4*>(ro + (lane >> 2) * L::kOutStride + col) =
            make_float4(e[0] * f0, d[0] * f0, e[1] * f0, d[1] * f0);
        *reinterpret_cast<float4*>(ro + ((lane >> 2) + 8) * L::kOutStride + col) =
            make_float4(e[2] * f1, d[2] * f1, e[3] * f1, d[3] * f1);
      }
    } else {
#pragma unroll
      for (int n = 0; n < L::kNTiles; ++n) {
        const int col = n * 8 + ((lane & 3) << 1);
        *reinterpret_cast<float2*>(ro + (lane >> 2) * L::kOutStride + col) = make_float2(o[n][0] * f0, o[n][1] * f0);
        *reinterpret_cast<float2*>(ro + ((lane >> 2) + 8) * L::kOutStride + col) =
            make_float2(o[n][2] * f1, o[n][3] * f1);
      }
    }
  }
  __syncthreads();
  // Four columns a thread: one float4 per warp slice in, one 8- or 16-byte store out (a block's few rows
  // must not cost more instructions than its tiles).
  constexpr int kVecs = HEAD / 4;
  // Row r's finished columns, in the first warp slice of its row tile's partial results.
  auto row_out = [&](int r) { return red_o + ((r >> 4) * p.warps_n * 16 + (r & 15)) * L::kOutStride; };
  // Row r's output.
  auto out_row = [&](int r) {
    return static_cast<T*>(p.out) + qr.row(r) * p.o_stride_seq + static_cast<int64_t>(qr.head(r)) * p.o_stride_head;
  };
  for (int i = tid; i < rows_valid * kVecs; i += blockDim.x) {
    const int r = i / kVecs;
    const int d = (i - r * kVecs) * 4;
    float* src = row_out(r) + d;
    float4 acc = *reinterpret_cast<const float4*>(src);
    for (int wn = 1; wn < p.warps_n; ++wn) {
      const float4 x = *reinterpret_cast<const float4*>(src + wn * 16 * L::kOutStride);
      acc.x += x.x;
      acc.y += x.y;
      acc.z += x.z;
      acc.w += x.w;
    }
    const float sum = row_l[r];
    // Zeros only where the row sees no key of the partition: a NaN sum stays NaN.
    const bool attended = qr.attends(r, start, end);
    const float inv = attended ? out_scale / sum : 0.f;
    acc.x *= inv;
    acc.y *= inv;
    acc.z *= inv;
    acc.w *= inv;
    if (!split) {
      store4(out_row(r) + d, acc);
    } else if (cluster) {
      // Kept for the cluster's merge: each (r, d) is this thread's alone, so it overwrites what it read.
      *reinterpret_cast<float4*>(src) = acc;
      if (d == 0) row_lse[r] = attended ? row_m[r] + log2f(sum) : -INFINITY;
    } else {
      const int64_t row_index = (qr.row(r) * p.num_heads + qr.head(r)) * p.num_partitions + partition;
      *reinterpret_cast<float4*>(p.tmp_out + row_index * HEAD + d) = acc;
      if (d == 0) p.tmp_lse[row_index] = attended ? row_m[r] + log2f(sum) : -INFINITY;
    }
  }
  if (cluster) {
    merge_in_cluster<HEAD, float>(p.num_partitions, seq_len > 0, rows_valid, row_lse, row_out, out_row,
                                  [&](int r) { return sink_log2(p, qr.head(r)); });
  }
}

}  // namespace tpkit

// Planning and launching of the attention kernels for one element type, instantiated once per dtype by
// paged_attention_{f16,bf16,f32}.cu so the three compile in parallel. Torch-free.
#pragma once

#include <algorithm>
#include <type_traits>

#include "attention/paged_attention_dispatch.h"
#include "attention/paged_attention_fp32.cuh"
#include "attention/paged_attention_merge.cuh"
#include "attention/paged_attention_mma.cuh"
#include "attention/paged_attention_wgmma.cuh"

namespace tpkit {

constexpr int kMaxStages = 4;      // 16-bit caches' deepest pipeline
constexpr int kMaxFp8Stages = 8;   // float8 caches': a tile holds half the bytes (cp_async_wait_dynamic: <= 7 pending)

inline int ceil_div(int a, int b) { return (a + b - 1) / b; }

// Query tokens a sequence has on average, from the shapes (num_query_rows / num_seqs, rounded up).
inline int mean_query_len(const tpkit_paged_attention_args* a) {
  return ceil_div(std::max(a->num_query_rows, 1), std::max(a->num_seqs, 1));
}

// The query rows one work item needs (the kernel's row tile holds up to max_rows), after choosing its
// tokens. Decode: the group's query heads of one token. With query_start_loc: as many of a sequence's tokens
// as fill max_rows rows with every head of the group, at most the batch's mean query length (from the
// shapes, num_query_rows / num_seqs: no value is read), at least one; a group larger than max_rows is split
// into row groups as in decode.
inline int plan_work_tiles(tpkit_paged_attention_args* a, int max_rows) {
  if (a->query_start_loc == nullptr) {
    a->tile_tokens = 1;
    a->num_work_tiles = a->num_seqs;
    return a->group_size;
  }
  const int tokens = std::max(1, std::min(mean_query_len(a), max_rows / a->group_size));
  // Sequences that can hold a token each add at most one partly filled tile.
  const int64_t busy = std::min(a->num_seqs, a->num_query_rows);
  a->tile_tokens = tokens;
  a->num_work_tiles = static_cast<int>((a->num_query_rows + busy * (tokens - 1)) / tokens);
  return tokens * a->group_size;
}

// Calls f(std::integral_constant<int, H>) for the compiled head size H == head_size.
template <typename F>
cudaError_t dispatch_head_size(int head_size, F&& f) {
  switch (head_size) {
#define TPKIT_CASE(H) \
  case H:             \
    return f(std::integral_constant<int, H>{});
    TPKIT_FOR_EACH_HEAD_SIZE(TPKIT_CASE)
#undef TPKIT_CASE
    default:
      return cudaErrorInvalidValue;
  }
}

// Launches `kernel` on `stream`; on Hopper as a programmatic dependent launch: its blocks may be scheduled
// while the previous kernel in the stream drains (they wait for its results with griddepcontrol.wait), so
// the launch gap between the two overlaps that kernel's tail. cluster_size > 1: clusters of that many
// blocks along y.
template <typename Kernel>
cudaError_t launch_dependent(Kernel kernel, dim3 grid, int threads, int smem_bytes, int cluster_size,
                             const tpkit_paged_attention_args* a, cudaStream_t stream) {
  int major = 0;
  const cudaError_t err = current_device_attribute(cudaDevAttrComputeCapabilityMajor, &major);
  if (err != cudaSuccess) return err;
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = dim3(threads);
  config.dynamicSmemBytes = static_cast<size_t>(smem_bytes);
  config.stream = stream;
  cudaLaunchAttribute attrs[2] = {};
  attrs[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attrs[0].val.programmaticStreamSerializationAllowed = 1;
  attrs[1] = cluster_dimension(cluster_size);
  config.attrs = attrs;
  config.numAttrs = major < 9 ? 0 : (cluster_size > 1 ? 2 : 1);
  return cudaLaunchKernelEx(&config, kernel, *a);
}

template <typename T>
cudaError_t launch_merge(const tpkit_paged_attention_args* a, cudaStream_t stream) {
  if (a->num_partitions <= 1 || a->cluster_merge) return cudaSuccess;
  // The merge waits (griddepcontrol.wait) for the attention grid, which lets it launch after its main loop.
  const dim3 grid(ceil_div(a->num_heads, kMergeRowsPerBlock), a->num_query_rows);
  const int smem_bytes = kMergeRowsPerBlock * a->num_partitions * static_cast<int>(sizeof(float));
  // Every partition's results in the first round trip where there are up to 16. The 16-partition kernel
  // takes about twice the other's registers, so only splits of more than 8 partitions take it: with fewer,
  // its merge blocks would no longer all be resident at once.
  const auto kernel = a->num_partitions > 8 ? paged_attention_merge_kernel<T, 16> : paged_attention_merge_kernel<T, 8>;
  return launch_dependent(kernel, grid, kMergeThreads, smem_bytes, 1, a, stream);
}

using AttentionKernel = void (*)(tpkit_paged_attention_args);

// The mma kernel that takes `slices` 16-token slices a warp step (2 only where Q stays in shared memory),
// with swizzled shared-memory rows (one slice, where kSwizzleable allows) or padded ones. Several query tokens
// a sequence (multi) take one variant: one slice, swizzled rows where kSwizzleable allows.
template <typename T, int HEAD, int FP8>
AttentionKernel fp8_mma_kernel(bool multi) {
  return multi ? paged_attention_mma_kernel<T, HEAD, 1, kSwizzleable<HEAD>, true, FP8>
               : paged_attention_mma_kernel<T, HEAD, 1, kSwizzleable<HEAD>, false, FP8>;
}

// Float8 caches take one variant each for decode and for several query tokens: one slice, swizzled rows
// where kSwizzleable allows.
template <typename T, int HEAD>
AttentionKernel mma_kernel(int slices, bool swizzled, bool multi, tpkit_fp8_format fp8 = TPKIT_FP8_NONE) {
  if constexpr (HEAD % 16 == 0) {
    if (fp8 == TPKIT_FP8_E4M3) return fp8_mma_kernel<T, HEAD, TPKIT_FP8_E4M3>(multi);
    if (fp8 == TPKIT_FP8_E5M2) return fp8_mma_kernel<T, HEAD, TPKIT_FP8_E5M2>(multi);
  }
  if (multi) return paged_attention_mma_kernel<T, HEAD, 1, kSwizzleable<HEAD>, true>;
  if constexpr (!MmaLayout<HEAD, false>::kQueryInRegisters) {
    if (slices == 2) return paged_attention_mma_kernel<T, HEAD, 2, false, false>;
  }
  if constexpr (kSwizzleable<HEAD>) {
    if (swizzled) return paged_attention_mma_kernel<T, HEAD, 1, true, false>;
  }
  return paged_attention_mma_kernel<T, HEAD, 1, false, false>;
}

// The warpgroup kernel of one or two warpgroups, for decode or several query tokens a sequence.
template <typename T>
AttentionKernel wgmma_kernel(int warpgroups, bool multi) {
  if (multi) return warpgroups == 2 ? paged_attention_wgmma_kernel<T, 2, true> : paged_attention_wgmma_kernel<T, 1, true>;
  return warpgroups == 2 ? paged_attention_wgmma_kernel<T, 2, false> : paged_attention_wgmma_kernel<T, 1, false>;
}

// Pipeline depth against resident blocks (registers and shared memory decide how many fit): the stage count
// (2 .. max_stages) for `kernel` with `threads` threads and block_bytes(stages) bytes of shared memory. With
// prefer_depth, the most 64-token tiles in flight per multiprocessor, (stages - 1) x resident blocks;
// otherwise a depth that keeps more blocks resident wins while it keeps at least 2/3 as many tiles in
// flight: more warps hide the start and end of short blocks and the tensor-core work of large groups.
template <typename BlockBytes>
cudaError_t choose_pipeline(const void* kernel, int threads, BlockBytes block_bytes, bool prefer_depth,
                            int* stages, int* smem, int* blocks_per_sm, int max_stages = kMaxStages) {
  int smem_limit = 0;
  cudaError_t err = kernel_dynamic_smem_limit(kernel, &smem_limit);
  if (err != cudaSuccess) return err;
  *stages = *smem = *blocks_per_sm = 0;
  for (int s = 2; s <= max_stages; ++s) {
    const int bytes = block_bytes(s);
    if (bytes > smem_limit) break;
    int resident = 0;
    if ((err = kernel_occupancy(kernel, threads, bytes, &resident)) != cudaSuccess) return err;
    const int in_flight = resident * (s - 1), best = *blocks_per_sm * (*stages - 1);
    bool better;
    if (prefer_depth || resident == *blocks_per_sm) {
      better = in_flight > best;
    } else {
      better = resident > *blocks_per_sm ? 3 * in_flight >= 2 * best : 2 * in_flight > 3 * best;
    }
    if (*stages == 0 || better) {
      *stages = s;
      *smem = bytes;
      *blocks_per_sm = resident;
    }
  }
  return *stages == 0 || *blocks_per_sm == 0 ? cudaErrorInvalidConfiguration : cudaSuccess;
}

// Hopper: a (sequence, KV head, row group)'s partitions as one cluster, merged in shared memory, when every
// cluster of the grid can be resident at once (clusters must fit within one GPC). Bit n of *mask is set where
// n partitions of `kernel`, with the plan's threads and shared memory, can be merged that way.
inline cudaError_t cluster_merge_mask(const tpkit_paged_attention_args* a, const void* kernel, uint32_t* mask) {
  *mask = 0;
  // Rows of several tokens a sequence merge in the merge kernel: their work tiles are not known here.
  if (a->query_start_loc != nullptr) return cudaSuccess;
  int major = 0;
  cudaError_t err = current_device_attribute(cudaDevAttrComputeCapabilityMajor, &major);
  if (err != cudaSuccess || major < 9) return err;
  const int64_t clusters_needed = static_cast<int64_t>(a->num_seqs) * a->num_kv_heads * a->m_groups;
  for (int np = 2; np <= kMaxClusterSize; ++np) {
    int clusters = 0;
    if ((err = kernel_max_active_clusters(kernel, a->threads, a->smem_bytes, np, &clusters)) != cudaSuccess) {
      return err;
    }
    if (clusters >= clusters_needed) *mask |= 1u << np;
  }
  return cudaSuccess;
}

// Splits the context (plan_partitions) with the cluster merges `kernel` allows, which it leaves in *mask.
inline cudaError_t plan_split(tpkit_paged_attention_args* a, const void* kernel, int concurrent_blocks,
                              double write_cost, uint32_t* mask) {
  const cudaError_t err = cluster_merge_mask(a, kernel, mask);
  if (err != cudaSuccess) return err;
  plan_partitions(a, concurrent_blocks, write_cost, *mask);
  return cudaSuccess;
}

// Thread blocks of the planned attention grid that have work: one per (work item, KV head, row group,
// partition).
inline int64_t grid_blocks(const tpkit_paged_attention_args* a) {
  return work_items(a) * a->num_kv_heads * a->m_groups * a->num_partitions;
}

// Sets a->cluster_merge for the planned partitions from the cluster_merge_mask of the kernel that will run.
inline void set_cluster_merge(tpkit_paged_attention_args* a, uint32_t mask) {
  a->cluster_merge = cluster_mergeable(mask, a->num_partitions) ? 1 : 0;
}

// Whether this build has the warpgroup kernel (sm_90a) and the current device runs it (compute 9.0).
inline cudaError_t wgmma_available(bool* available) {
  *available = false;
#if defined(TPKIT_SM90A)
  int major = 0, minor = 0;
  cudaError_t err = current_device_attribute(cudaDevAttrComputeCapabilityMajor, &major);
  if (err == cudaSuccess) err = current_device_attribute(cudaDevAttrComputeCapabilityMinor, &minor);
  if (err != cudaSuccess) return err;
  *available = major == 9 && minor == 0;
#endif
  return cudaSuccess;
}

// The warpgroup kernel's cost of writing one partition's result for rows_written rows (plan_partitions).
template <typename T>
double wgmma_write_cost(int rows_written) {
  return rows_written * (kWgmmaHead + 1) * 4.0 / (2.0 * kTileTokens * kWgmmaHead * sizeof(T));
}

// A plan of the warpgroup kernel: `warpgroups` warpgroups a block (with several query tokens a sequence
// they split the block's rows, 64 each; in decode they share 64), work items of item_rows rows, the pipeline
// and occupancy for that, and the context's split; the cluster merges it allows are left in *mask.
template <typename T>
cudaError_t plan_wgmma_blocks(tpkit_paged_attention_args* a, int num_sms, int warpgroups, int item_rows,
                              int* blocks_per_sm, uint32_t* mask) {
  const bool multi = a->query_start_loc != nullptr;
  const int row_sets = multi ? warpgroups : 1;
  const void* kernel = reinterpret_cast<const void*>(wgmma_kernel<T>(warpgroups, multi));
  int stages = 0, smem = 0;
  cudaError_t err = choose_pipeline(
      kernel, warpgroups * kWgmmaThreads, [&](int s) { return wgmma_smem_bytes<T>(s, 1, row_sets); }, false,
      &stages, &smem, blocks_per_sm);
  if (err != cudaSuccess) return err;
  a->rows_per_cta = row_sets * kWgmmaRows;
  a->m_groups = ceil_div(item_rows, a->rows_per_cta);
  a->warps_m = warpgroups * kWgmmaThreads / 32;
  a->warps_n = 1;
  a->slices = 1;
  a->swizzled = 0;
  a->wgmma = 1;
  a->warpgroups = warpgroups;
  a->num_stages = stages;
  a->threads = warpgroups * kWgmmaThreads;
  a->smem_bytes = smem;
  return plan_split(a, kernel, num_sms * *blocks_per_sm, wgmma_write_cost<T>(std::min(item_rows, a->rows_per_cta)),
                    mask);
}

// The warpgroup kernel (paged_attention_wgmma.cuh). Several query tokens a sequence: work tiles of 64 rows, or
// of 128 split between two warpgroups that share the K/V tiles where a sequence's mean query fills at least
// two such tiles (in a batch of short queries beside long ones, the short ones' half-empty tiles would do a
// full tile's products). Decode: up to 64 query heads of a KV head a block, taken by one warpgroup or, in the
// two cases below, by two that share the block's tiles.
template <typename T>
cudaError_t plan_wgmma(tpkit_paged_attention_args* a) {
  int num_sms = 0;
  cudaError_t err = current_device_attribute(cudaDevAttrMultiProcessorCount, &num_sms);
  if (err != cudaSuccess) return err;
  int blocks_per_sm = 0;
  uint32_t mask = 0;
  if (a->query_start_loc != nullptr) {
    const int warpgroups = static_cast<int64_t>(mean_query_len(a)) * a->group_size >= 4 * kWgmmaRows ? 2 : 1;
    const int item_rows = plan_work_tiles(a, warpgroups * kWgmmaRows);
    return plan_wgmma_blocks<T>(a, num_sms, warpgroups, item_rows, &blocks_per_sm, &mask);
  }
  if ((err = plan_wgmma_blocks<T>(a, num_sms, 1, a->group_size, &blocks_per_sm, &mask)) != cudaSuccess) return err;
  const double write_cost = wgmma_write_cost<T>(std::min(a->group_size, kWgmmaRows));

  // Two warpgroups a block, 2 stages each (a third stage costs more in occupancy than it hides): their shared
  // memory leaves one block an SM.
  const void* two = reinterpret_cast<const void*>(wgmma_kernel<T>(2, false));
  int smem_limit = 0;
  if ((err = kernel_dynamic_smem_limit(two, &smem_limit)) != cudaSuccess) return err;
  const bool two_fit = wgmma_smem_bytes<T>(2, 2) <= smem_limit;
  const auto two_warpgroups = [](tpkit_paged_attention_args* b) {
    b->warpgroups = 2;
    b->threads = 2 * kWgmmaThreads;
    b->num_stages = 2;
    b->smem_bytes = wgmma_smem_bytes<T>(2, 2);
  };
  // A grid that leaves every SM at most one block has no use for the occupancy the pipeline's depth was
  // traded for: there two warpgroups a block share each block's tiles, so every SM has twice the tiles in
  // flight and each warpgroup half the chain of tiles to go through; the split is planned again for one block
  // an SM.
  if (two_fit && blocks_per_sm > 1 && grid_blocks(a) <= num_sms) {
    two_warpgroups(a);
    if ((err = plan_split(a, two, num_sms, write_cost, &mask)) != cudaSuccess) return err;
    set_cluster_merge(a, mask);
    return cudaSuccess;
  }
  set_cluster_merge(a, mask);
  // A split that the merge kernel would finish, in more blocks than SMs: half as many partitions, each twice
  // as long, in blocks of two warpgroups keep as many tiles streaming on every SM, and are taken where their
  // clusters all fit at once: they merge there, with no merge kernel.
  if (two_fit && a->num_partitions % 2 == 0 && !a->cluster_merge && grid_blocks(a) > num_sms) {
    tpkit_paged_attention_args b = *a;
    two_warpgroups(&b);
    b.num_partitions /= 2;
    b.partition_size *= 2;
    if ((err = cluster_merge_mask(&b, two, &mask)) != cudaSuccess) return err;
    set_cluster_merge(&b, mask);
    if (b.cluster_merge) *a = b;
  }
  return cudaSuccess;
}

template <typename T, int HEAD>
cudaError_t plan_mma(tpkit_paged_attention_args* a) {
  // Blocks of 32 tiles or more (a table that long, or a window that wide): long blocks, unless the context is
  // split.
  const bool long_tables = key_span(a) >= 32 * kTileTokens;
  // Groups of more than 32 query heads (the two-slice configurations of the mma kernel), and every group on
  // long tables, take the warpgroup kernel where it is built and runs: its rows beyond the group are padding,
  // but its loop streams faster on long tables; on short ones (a few tiles a block) the mma kernel stays
  // faster. Several query tokens a sequence are tensor-core bound: the warpgroup products serve them best.
  const bool multi = a->query_start_loc != nullptr;
  const bool fp8 = a->cache_fp8 != TPKIT_FP8_NONE;
  if constexpr (HEAD == kWgmmaHead) {
    bool available = false;
    const cudaError_t err = wgmma_available(&available);
    if (err != cudaSuccess) return err;
    if (available && !fp8 && (multi || a->group_size > 32 || long_tables)) return plan_wgmma<T>(a);
  }
  a->wgmma = 0;
  a->warpgroups = 1;
  using Padded = MmaLayout<HEAD, false>;
  using Swizzled = MmaLayout<HEAD, kSwizzleable<HEAD>>;
  int num_sms = 0;
  cudaError_t err = current_device_attribute(cudaDevAttrMultiProcessorCount, &num_sms);
  if (err != cudaSuccess) return err;
  // Query rows in 16-row mma tiles; a thread block takes up to 8 tiles (128 rows: heads of one KV head, or
  // the heads of several tokens).
  const int item_rows = plan_work_tiles(a, 128);
  const int row_tiles = ceil_div(item_rows, 16);
  const int m_groups = ceil_div(row_tiles, 8);
  const int warps_m = ceil_div(row_tiles, m_groups);
  const int warps_n = warps_m <= 2 ? 4 : (warps_m <= 4 ? 2 : 1);
  const int num_warps = warps_m * warps_n;
  const int rows = warps_m * 16;
  const int epilogue_bytes = (2 * num_warps * 16 + 3 * rows) * 4 + num_warps * 16 * Padded::kOutStride * 4;
  // Q, then the K/V stages (reused by the epilogue); a float8 cache's stages hold its bytes as stored.
  const int fp8_row_bytes = Fp8Layout<HEAD % 16 == 0 ? HEAD : 16>::kRowBytes;
  auto block_bytes = [&](int row_bytes, int stages) {
    const int tiles = stages * 2 * kTileTokens * (fp8 ? fp8_row_bytes : row_bytes);
    return rows * row_bytes + std::max(tiles, epilogue_bytes);
  };
  // Long blocks of small groups (one row tile) take the deepest pipeline.
  const bool prefer_depth = warps_m == 1 && long_tables;
  // Two slices a step where a warp's share of a tile holds them (large groups: warps_n <= 2) and Q is not
  // held in registers: twice the independent mma chains in flight.
  const int slices = !multi && !fp8 && !Padded::kQueryInRegisters && (kTileTokens / warps_n) % 32 == 0 ? 2 : 1;
  const void* kernel = reinterpret_cast<const void*>(mma_kernel<T, HEAD>(slices, false, multi, a->cache_fp8));
  int stages = 0, smem = 0, blocks_per_sm = 0;
  err = choose_pipeline(kernel, num_warps * 32, [&](int s) { return block_bytes(Padded::kRowBytes, s); },
                        prefer_depth, &stages, &smem, &blocks_per_sm, fp8 ? kMaxFp8Stages : kMaxStages);
  if (err != cudaSuccess) return err;
  a->m_groups = m_groups;
  a->rows_per_cta = rows;
  a->warps_m = warps_m;
  a->warps_n = warps_n;
  a->slices = slices;
  a->num_stages = stages;
  a->threads = num_warps * 32;
  a->smem_bytes = smem;
  const int rows_written = std::min(item_rows, rows);
  const double tile_bytes = 2.0 * kTileTokens * HEAD * (fp8 ? 1 : sizeof(T));  // a tile's K and V as stored
  const double write_cost = rows_written * (HEAD + 1) * 4.0 / tile_bytes;
  uint32_t mask = 0;
  err = plan_split(a, kernel, num_sms * std::max(blocks_per_sm, 1), write_cost, &mask);
  if (err != cudaSuccess) return err;
  // Swizzled rows where warps take one slice: whole-sector copies take two thirds of the L2 sectors and
  // half the requests of padded rows (with the K/V stream under the L2 evict-first policy, also in grids of
  // several waves). The two-slice kernel runs slower swizzled, so it keeps padded rows. Swizzled rows are
  // never longer than padded ones, so the pipeline depth, occupancy and partitions above still hold.
  a->swizzled = kSwizzleable<HEAD> && slices == 1;
  if (a->swizzled) {
    kernel = reinterpret_cast<const void*>(mma_kernel<T, HEAD>(1, true, multi, a->cache_fp8));
    smem = block_bytes(Swizzled::kRowBytes, stages);
    int smem_limit = 0;  // raises the swizzled kernel's limit
    if ((err = kernel_dynamic_smem_limit(kernel, &smem_limit)) != cudaSuccess) return err;
    a->smem_bytes = smem;
    // Another kernel and shared-memory size: its own clusters.
    if ((err = cluster_merge_mask(a, kernel, &mask)) != cudaSuccess) return err;
  }
  set_cluster_merge(a, mask);
  return cudaSuccess;
}

template <typename T, int HEAD>
cudaError_t launch_mma(const tpkit_paged_attention_args* a, cudaStream_t stream) {
  const dim3 grid = attention_grid(a);
  if constexpr (HEAD == kWgmmaHead) {
    if (a->wgmma) {
      const AttentionKernel kernel = wgmma_kernel<T>(a->warpgroups, a->query_start_loc != nullptr);
      const cudaError_t err =
          launch_dependent(kernel, grid, a->threads, a->smem_bytes, attention_cluster_size(a), a, stream);
      if (err != cudaSuccess) return err;
      return launch_merge<T>(a, stream);
    }
  }
  const AttentionKernel kernel =
      mma_kernel<T, HEAD>(a->slices, a->swizzled != 0, a->query_start_loc != nullptr, a->cache_fp8);
  const cudaError_t err =
      launch_dependent(kernel, grid, a->threads, a->smem_bytes, attention_cluster_size(a), a, stream);
  if (err != cudaSuccess) return err;
  return launch_merge<T>(a, stream);
}

template <int HEAD>
cudaError_t plan_fp32(tpkit_paged_attention_args* a) {
  int num_sms = 0;
  cudaError_t err = current_device_attribute(cudaDevAttrMultiProcessorCount, &num_sms);
  if (err != cudaSuccess) return err;
  const int item_rows = plan_work_tiles(a, kFp32Rows);
  const int m_groups = ceil_div(item_rows, kFp32Rows);
  const int rows = ceil_div(item_rows, m_groups);
  const int smem = fp32_smem_floats(rows, HEAD) * 4;
  const void* kernel = reinterpret_cast<const void*>(&paged_attention_fp32_kernel<HEAD>);
  int smem_limit = 0;
  if ((err = kernel_dynamic_smem_limit(kernel, &smem_limit)) != cudaSuccess) return err;
  if (smem > smem_limit) return cudaErrorInvalidConfiguration;
  int blocks_per_sm = 0;
  err = kernel_occupancy(kernel, kFp32Threads, smem, &blocks_per_sm);
  if (err != cudaSuccess) return err;
  a->m_groups = m_groups;
  a->rows_per_cta = rows;
  a->warps_m = 1;
  a->warps_n = kFp32Threads / 32;
  a->slices = 1;
  a->swizzled = 0;
  a->wgmma = 0;
  a->warpgroups = 1;
  a->num_stages = 1;
  a->threads = kFp32Threads;
  a->smem_bytes = smem;
  a->cluster_merge = 0;
  const double write_cost = rows * (HEAD + 1) * 4.0 / (2.0 * kTileTokens * HEAD * 4.0);
  plan_partitions(a, num_sms * std::max(blocks_per_sm, 1), write_cost, 0);
  return cudaSuccess;
}

template <int HEAD>
cudaError_t launch_fp32(const tpkit_paged_attention_args* a, cudaStream_t stream) {
  const dim3 grid = attention_grid(a);
  paged_attention_fp32_kernel<HEAD><<<grid, a->threads, a->smem_bytes, stream>>>(*a);
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  return launch_merge<float>(a, stream);
}

}  // namespace tpkit

// The C entry points of tpkit's paged-attention kernels (paged_attention.h): support checks, planning,
// dtype dispatch. Torch-free.
#include <algorithm>

#include "attention/paged_attention.h"
#include "attention/paged_attention_dispatch.h"
#include "common/ptx.cuh"

namespace tpkit {
namespace {

constexpr int kPlanTile = 64;           // tokens: partitions are whole tiles of every kernel
constexpr int kMaxPartitions = 256;
// The merge kernel (a second, dependent launch that starts once the attention grid is done), in tile reads;
// a cluster merge costs none.
constexpr double kMergeKernelCost = 2.5;
constexpr double kBlockStartCost = 1.0;   // a block's first loads (block table, then K/V): no overlap yet
// A block's fixed work (block table, query, epilogue, partial write) is about a tile's: partitions of one
// tile would spend half their time on it.
constexpr int kMinPartitionTiles = 2;

}  // namespace

void plan_partitions(tpkit_paged_attention_args* a, int concurrent_blocks, double write_cost,
                     uint32_t cluster_merges) {
  const int max_tiles = static_cast<int>(std::max<int64_t>(1, (key_span(a) + kPlanTile - 1) / kPlanTile));
  const double base = static_cast<double>(work_items(a)) * a->num_kv_heads * a->m_groups;
  const double slots = std::max(concurrent_blocks, 1);
  // No split when the unsplit grid already fills every slot: the blocks past the first wave still find the
  // memory system saturated, so splitting would only add partial writes and the merge.
  // Otherwise, among splits that fit one wave, a time model: a block
  // costs its start, its tiles and writing its partial result; the merge reads every partial result once
  // more, and the merge kernel, where the partitions cannot be merged in their cluster, costs its own.
  int best_partitions = 1;
  int best_tiles = max_tiles;
  double best_cost = max_tiles + kBlockStartCost;
  const int limit = base >= slots ? 1 : std::min(max_tiles / kMinPartitionTiles, kMaxPartitions);
  for (int np = 2; np <= limit; ++np) {
    const int tiles = (max_tiles + np - 1) / np;
    if ((max_tiles + tiles - 1) / tiles != np) continue;  // same split as a smaller np
    const double blocks = base * np;
    if (blocks > slots) break;
    const double merge_cost = cluster_mergeable(cluster_merges, np) ? 0.0 : kMergeKernelCost;
    const double cost = tiles + write_cost + kBlockStartCost + blocks * write_cost / slots + merge_cost;
    if (cost < best_cost) {
      best_cost = cost;
      best_partitions = np;
      best_tiles = tiles;
    }
  }
  a->num_partitions = best_partitions;
  a->partition_size = best_tiles * kPlanTile;
}

namespace {

// The last step of planning: the plan against the current device's launch limits. A cluster merge the device
// cannot launch (no cluster launch, more blocks than kMaxClusterSize, a grid whose y is not a multiple of the
// cluster's) becomes the merge kernel, which every device runs; a grid, block or shared-memory size past the
// device's limits, which the per-kernel planners never choose, is refused here, before any launch (a launch
// with a bad configuration can leave the context unusable).
cudaError_t fit_launch_limits(tpkit_paged_attention_args* a) {
  int grid_x = 0, grid_y = 0, grid_z = 0, threads = 0, smem = 0, cluster_launch = 0;
  cudaError_t err;
  if ((err = current_device_attribute(cudaDevAttrMaxGridDimX, &grid_x)) != cudaSuccess ||
      (err = current_device_attribute(cudaDevAttrMaxGridDimY, &grid_y)) != cudaSuccess ||
      (err = current_device_attribute(cudaDevAttrMaxGridDimZ, &grid_z)) != cudaSuccess ||
      (err = current_device_attribute(cudaDevAttrMaxThreadsPerBlock, &threads)) != cudaSuccess ||
      (err = current_device_attribute(cudaDevAttrMaxSharedMemoryPerBlockOptin, &smem)) != cudaSuccess ||
      (err = current_device_attribute(cudaDevAttrClusterLaunch, &cluster_launch)) != cudaSuccess) {
    return err;
  }
  const dim3 grid = attention_grid(a);
  const int cluster = attention_cluster_size(a);
  if (cluster > 1 && (!cluster_launch || cluster > kMaxClusterSize || grid.y % cluster != 0)) a->cluster_merge = 0;
  // A split whose merge grid (head groups, query rows) the device cannot launch runs unsplit.
  if (a->num_partitions > 1 && !a->cluster_merge && a->num_query_rows > grid_y) {
    a->num_partitions = 1;
    a->partition_size = static_cast<int>(std::max<int64_t>(1, (key_span(a) + kPlanTile - 1) / kPlanTile) * kPlanTile);
  }
  const bool fits = a->num_partitions >= 1 && a->num_partitions <= kMaxPartitions && a->m_groups >= 1 &&
                    attention_grid_x(a) <= grid_x &&
                    static_cast<int>(grid.y) <= grid_y && static_cast<int>(grid.z) <= grid_z &&
                    a->threads >= 32 && a->threads <= threads && a->smem_bytes >= 0 && a->smem_bytes <= smem;
  return fits ? cudaSuccess : cudaErrorInvalidConfiguration;
}

}  // namespace
}  // namespace tpkit

namespace {

constexpr const char* kSupportedText =
    "dtypes float16, bfloat16, float32; head sizes 32, 64, 80, 96, 112, 120, 128, 192, 256; block sizes 8, "
    "16, 32; float8 caches (E4M3, E5M2) under float16 and bfloat16 queries of head sizes that are multiples "
    "of 16";

bool head_size_supported(int head_size) {
  switch (head_size) {
#define TPKIT_CASE(H) case H:
    TPKIT_FOR_EACH_HEAD_SIZE(TPKIT_CASE)
#undef TPKIT_CASE
    return true;
    default:
      return false;
  }
}

}  // namespace

extern "C" {

int tpkit_paged_attention_supported(tpkit_dtype dtype, int head_size, int block_size, tpkit_fp8_format cache_fp8) {
  const bool dtype_ok = dtype == TPKIT_FLOAT16 || dtype == TPKIT_BFLOAT16 || dtype == TPKIT_FLOAT32;
  const bool block_ok = block_size == 8 || block_size == 16 || block_size == 32;
  // A float8 stage is loaded in 16-byte chunks of a row and converted for the 16-bit tensor-core kernel.
  const bool fp8_ok = cache_fp8 == TPKIT_FP8_NONE ||
                      ((cache_fp8 == TPKIT_FP8_E4M3 || cache_fp8 == TPKIT_FP8_E5M2) && dtype != TPKIT_FLOAT32 &&
                       head_size % 16 == 0);
  return dtype_ok && block_ok && fp8_ok && head_size_supported(head_size) ? 1 : 0;
}

const char* tpkit_paged_attention_supported_text(void) { return kSupportedText; }

cudaError_t tpkit_paged_attention_plan(tpkit_paged_attention_args* a) {
  if (!tpkit_paged_attention_supported(a->dtype, a->head_size, a->block_size, a->cache_fp8) || a->num_kv_heads <= 0 ||
      a->num_heads % a->num_kv_heads != 0 || a->window_size < 0 || !(a->logits_soft_cap >= 0.f)) {
    return cudaErrorInvalidValue;
  }
  a->group_size = a->num_heads / a->num_kv_heads;
  int log2 = 0;
  while ((1 << log2) < a->block_size) ++log2;
  a->block_size_log2 = log2;
  a->scale_log2 = a->scale * tpkit::kLog2e;
  const bool capped = a->logits_soft_cap > 0.f;
  a->soft_cap_scale = capped ? a->scale / a->logits_soft_cap : 0.f;
  a->soft_cap_log2 = capped ? a->logits_soft_cap * tpkit::kLog2e : 0.f;
  a->cluster_merge = 0;
  a->tile_tokens = 1;
  a->num_work_tiles = a->num_seqs;
  if (a->query_start_loc == nullptr) a->num_query_rows = a->num_seqs;
  a->tmp_out = nullptr;
  a->tmp_lse = nullptr;
  cudaError_t err;
  switch (a->dtype) {
    case TPKIT_FLOAT16: err = tpkit::plan_float16(a); break;
    case TPKIT_BFLOAT16: err = tpkit::plan_bfloat16(a); break;
    default: err = tpkit::plan_float32(a); break;
  }
  if (err == cudaSuccess) err = tpkit::fit_launch_limits(a);
  // A failed runtime query also sets the thread's last error: clear it so that it is not reported later by
  // an unrelated launch (ours or the framework's).
  if (err != cudaSuccess) cudaGetLastError();
  return err;
}

cudaError_t tpkit_paged_attention_launch(const tpkit_paged_attention_args* a, cudaStream_t stream) {
  if (a->num_seqs == 0 || a->num_work_tiles == 0) return cudaSuccess;
  if (a->num_partitions > 1 && !a->cluster_merge && (a->tmp_out == nullptr || a->tmp_lse == nullptr)) {
    return cudaErrorInvalidValue;
  }
  switch (a->dtype) {
    case TPKIT_FLOAT16: return tpkit::launch_float16(a, stream);
    case TPKIT_BFLOAT16: return tpkit::launch_bfloat16(a, stream);
    default: return tpkit::launch_float32(a, stream);
  }
}

}  // extern "C"

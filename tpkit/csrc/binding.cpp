// Torch binding of tpkit's CUDA kernels (paged attention, the cache write, the decode linear, the prefill's
// RoPE and SwiGLU, the float8 product's activation quantization): checks what the kernels rely on, plans,
// allocates the split-K scratch from the shapes (so it is CUDA-graph safe: the caching allocator serves it
// under capture too) and launches on the current stream. The kernels themselves are torch-free
// (paged_attention.h, decode_linear.h, elementwise.h).
//
// The rules of the public API, with their messages, are checked in Python (tpkit/ops) before a kernel is
// called. Here a tensor is checked only for what reading or writing it through its pointer needs: its device,
// dtype and sizes (check_tensor) and the strides and alignment the kernel assumes; a ValueError otherwise.
// Where a kernel does not take tensors it could read safely (a dtype, a row count, a stride), the entry point
// returns false and the caller runs the PyTorch implementation.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <map>
#include <optional>
#include <utility>
#include <string>

#include "attention/paged_attention.h"
#include "cache/reshape_and_cache.h"
#include "elementwise/elementwise.h"
#include "gemm/decode_linear.h"

namespace {

// Error messages are assembled with std::to_string and std::string only, and TORCH_CHECK only ever gets one
// finished string: formatting integers through std::ostream (c10::str, which TORCH_CHECK uses for several
// arguments) is not reliable inside this extension across torch builds.
std::string piece(const char* s) { return s; }
std::string piece(const std::string& s) { return s; }
std::string piece(int64_t v) { return std::to_string(v); }
std::string piece(at::ScalarType t) { return c10::toString(t); }
std::string piece(const at::Device& d) { return d.str(); }
std::string piece(at::IntArrayRef sizes) {
  std::string s = "[";
  for (size_t i = 0; i < sizes.size(); ++i) s += (i ? ", " : "") + std::to_string(sizes[i]);
  return s + "]";
}

template <typename... Args>
std::string message(const Args&... args) {
  return (std::string() + ... + piece(args));
}

#define TPKIT_CHECK_VALUE(cond, ...)                              \
  do {                                                           \
    if (!(cond)) TORCH_CHECK_VALUE(false, message(__VA_ARGS__)); \
  } while (0)

// Any size, in the sizes check_tensor expects.
constexpr int64_t kAny = -1;

std::string expected_sizes(std::initializer_list<int64_t> sizes) {
  std::string s = "[";
  for (auto it = sizes.begin(); it != sizes.end(); ++it) {
    s += (it == sizes.begin() ? "" : ", ") + (*it == kAny ? std::string("*") : std::to_string(*it));
  }
  return s + "]";
}

// A tensor a kernel reaches through its pointer: on `device`, of `dtype`, and of `sizes` (kAny: any size).
void check_tensor(const char* op, const char* name, const at::Tensor& t, const at::Device& device,
                  at::ScalarType dtype, std::initializer_list<int64_t> sizes) {
  TPKIT_CHECK_VALUE(t.device() == device, op, " (CUDA): ", name, ": expected device ", device, ", got ", t.device());
  bool fits = t.scalar_type() == dtype && t.dim() == static_cast<int64_t>(sizes.size());
  int64_t d = 0;
  for (const int64_t size : sizes) {
    fits = fits && (size == kAny || t.size(d) == size);
    ++d;
  }
  TPKIT_CHECK_VALUE(fits, op, " (CUDA): ", name, ": expected ", dtype, " ", expected_sizes(sizes), ", got ",
                    t.scalar_type(), " ", t.sizes());
}

// The device of the op's first tensor, which every other tensor must be on.
at::Device cuda_device(const char* op, const char* name, const at::Tensor& t) {
  TPKIT_CHECK_VALUE(t.is_cuda(), op, " (CUDA): ", name, ": expected a CUDA tensor, got ", t.device());
  return t.device();
}

bool rows_16b_aligned(const at::Tensor& t) {
  if (t.stride(-1) != 1 || reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 != 0) return false;
  for (int64_t d = 0; d + 1 < t.dim(); ++d) {
    if ((t.stride(d) * t.element_size()) % 16 != 0) return false;
  }
  return true;
}

tpkit_dtype to_tpkit_dtype(at::ScalarType t) {
  TPKIT_CHECK_VALUE(t == at::kHalf || t == at::kBFloat16 || t == at::kFloat, "paged_attention (CUDA): dtype ", t,
                    " is not supported; supported: ", tpkit_paged_attention_supported_text());
  return t == at::kHalf ? TPKIT_FLOAT16 : (t == at::kBFloat16 ? TPKIT_BFLOAT16 : TPKIT_FLOAT32);
}

void check_launch(cudaError_t err, const char* what) {
  if (err != cudaSuccess) TORCH_CHECK(false, message("tpkit ", what, " (CUDA): ", cudaGetErrorString(err)));
}

// A float8 cache's format, or TPKIT_FP8_NONE for a cache of key's dtype.
tpkit_fp8_format fp8_format(at::ScalarType t) {
  if (t == at::kFloat8_e4m3fn) return TPKIT_FP8_E4M3;
  if (t == at::kFloat8_e5m2) return TPKIT_FP8_E5M2;
  return TPKIT_FP8_NONE;
}

// A float8 cache's k and v scales as the kernels take them: float32 on the caches' device, one entry or one
// per KV head each, contiguous and of the same length (a single scale beside one a head is expanded to one a
// head: a copy of the shapes, safe in CUDA graphs).
std::pair<at::Tensor, at::Tensor> kv_scales(const char* op, const std::optional<at::Tensor>& k_scale,
                                            const std::optional<at::Tensor>& v_scale, const at::Device& device,
                                            int64_t num_kv_heads) {
  at::Tensor scales[2];
  const std::pair<const char*, const std::optional<at::Tensor>*> given[2] = {{"k_scale", &k_scale},
                                                                               {"v_scale", &v_scale}};
  for (int i = 0; i < 2; ++i) {
    const auto& [name, scale] = given[i];
    TPKIT_CHECK_VALUE(scale->has_value(), op, " (CUDA): ", name, ": expected a float32 scale for a float8 cache");
    const at::Tensor& t = **scale;
    TPKIT_CHECK_VALUE(t.device() == device && t.scalar_type() == at::kFloat &&
                          (t.numel() == 1 || t.numel() == num_kv_heads),
                      op, " (CUDA): ", name, ": expected float32 of 1 or num_kv_heads = ", num_kv_heads,
                      " entries on ", device, ", got ", t.scalar_type(), " ", t.sizes(), " on ", t.device());
    scales[i] = t.reshape({-1});
  }
  if (scales[0].numel() != scales[1].numel()) {
    at::Tensor& single = scales[0].numel() == 1 ? scales[0] : scales[1];
    single = single.expand({num_kv_heads});
  }
  return {scales[0].contiguous(), scales[1].contiguous()};
}

// The shape fields of the kernel arguments (all that planning reads; with query_start_loc, planning reads
// only that it is set, never its values).
void fill_shapes(tpkit_paged_attention_args* a, const at::Tensor& query, const at::Tensor& key_cache,
                 const at::Tensor& block_tables, const std::optional<at::Tensor>& query_start_loc,
                 std::optional<int64_t> window_size) {
  a->dtype = to_tpkit_dtype(query.scalar_type());
  a->num_seqs = static_cast<int>(block_tables.size(0));
  a->num_query_rows = static_cast<int>(query.size(0));
  a->query_start_loc = query_start_loc.has_value() ? query_start_loc->data_ptr<int32_t>() : nullptr;
  a->num_heads = static_cast<int>(query.size(1));
  a->head_size = static_cast<int>(query.size(2));
  a->num_blocks = static_cast<int>(std::min<int64_t>(key_cache.size(0), INT32_MAX));
  a->block_size = static_cast<int>(key_cache.size(1));
  a->num_kv_heads = static_cast<int>(key_cache.size(2));
  a->max_blocks_per_seq = static_cast<int>(block_tables.size(1));
  a->cache_fp8 = fp8_format(key_cache.scalar_type());
  // A window wider than the table is no window: every key is in it.
  a->window_size = static_cast<int>(std::min<int64_t>(window_size.value_or(0), INT32_MAX));
}

// The caches' strides [num_blocks, block_size, num_kv_heads, head_size], in elements, into any kernel's
// arguments (the attention's, the cache write's, the decode linear's: they name them alike).
template <typename Args>
void fill_cache_strides(Args& a, const at::Tensor& key_cache, const at::Tensor& value_cache) {
  a.kc_stride_block = key_cache.stride(0);
  a.kc_stride_token = key_cache.stride(1);
  a.kc_stride_head = key_cache.stride(2);
  a.vc_stride_block = value_cache.stride(0);
  a.vc_stride_token = value_cache.stride(1);
  a.vc_stride_head = value_cache.stride(2);
}

// The launch configuration paged_attention would use for these shapes (for benchmarks and notes).
std::map<std::string, int64_t> plan(const at::Tensor& query, const at::Tensor& key_cache,
                                    const at::Tensor& block_tables,
                                    const std::optional<at::Tensor>& query_start_loc, bool causal,
                                    std::optional<int64_t> window_size) {
  TPKIT_CHECK_VALUE(query.is_cuda() && query.dim() == 3 && key_cache.dim() == 4 && block_tables.dim() == 2,
                    "plan (CUDA): expected CUDA query [num_seqs, num_heads, head_size], key_cache [num_blocks, "
                    "block_size, num_kv_heads, head_size] and block_tables [num_seqs, max_blocks_per_seq]");
  const c10::cuda::CUDAGuard guard(query.device());
  TPKIT_CHECK_VALUE(!query_start_loc.has_value() || query_start_loc->scalar_type() == at::kInt,
                    "plan (CUDA): expected int32 query_start_loc");
  tpkit_paged_attention_args a{};
  fill_shapes(&a, query, key_cache, block_tables, query_start_loc, window_size);
  a.causal = causal ? 1 : 0;
  check_launch(tpkit_paged_attention_plan(&a), "paged_attention planning");
  // The attention grid as the launchers build it: (KV heads x row groups, partitions, sequences) in decode,
  // (work tiles x KV heads x row groups, partitions, 1) with query_start_loc; clusters of cluster_size blocks
  // along y.
  const bool multi = a.query_start_loc != nullptr;
  return {{"num_partitions", a.num_partitions}, {"partition_size", a.partition_size}, {"m_groups", a.m_groups},
          {"rows_per_cta", a.rows_per_cta}, {"warps_m", a.warps_m}, {"warps_n", a.warps_n}, {"slices", a.slices},
          {"swizzled", a.swizzled}, {"wgmma", a.wgmma}, {"warpgroups", a.warpgroups}, {"num_stages", a.num_stages},
          {"threads", a.threads}, {"smem_bytes", a.smem_bytes}, {"cluster_merge", a.cluster_merge},
          {"grid_x", static_cast<int64_t>(a.num_kv_heads) * a.m_groups * (multi ? a.num_work_tiles : 1)},
          {"grid_y", a.num_partitions}, {"grid_z", multi ? 1 : a.num_work_tiles},
          {"num_work_tiles", a.num_work_tiles}, {"tile_tokens", a.tile_tokens},
          {"cluster_size", a.cluster_merge ? a.num_partitions : 1}};
}

// The launch limits of a device, read from the CUDA runtime (not through the planners' cached queries), for
// tests that check plans against them.
std::map<std::string, int64_t> device_limits(int64_t device) {
  const std::pair<const char*, cudaDeviceAttr> attrs[] = {
      {"max_grid_x", cudaDevAttrMaxGridDimX},
      {"max_grid_y", cudaDevAttrMaxGridDimY},
      {"max_grid_z", cudaDevAttrMaxGridDimZ},
      {"max_threads_per_block", cudaDevAttrMaxThreadsPerBlock},
      {"max_smem_per_block_optin", cudaDevAttrMaxSharedMemoryPerBlockOptin},
      {"cluster_launch", cudaDevAttrClusterLaunch},
      {"multiprocessors", cudaDevAttrMultiProcessorCount},
      {"major", cudaDevAttrComputeCapabilityMajor},
      {"minor", cudaDevAttrComputeCapabilityMinor}};
  std::map<std::string, int64_t> limits;
  for (const auto& [name, attr] : attrs) {
    int value = 0;
    check_launch(cudaDeviceGetAttribute(&value, attr, static_cast<int>(device)), "device_limits");
    limits[name] = value;
  }
  return limits;
}

void paged_attention(at::Tensor out, const at::Tensor& query, const at::Tensor& key_cache,
                     const at::Tensor& value_cache, const at::Tensor& block_tables, const at::Tensor& seq_lens,
                     double scale, const std::optional<at::Tensor>& alibi_slopes,
                     const std::optional<at::Tensor>& query_start_loc, bool causal,
                     const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale,
                     std::optional<int64_t> window_size, std::optional<double> logits_soft_cap,
                     const std::optional<at::Tensor>& sinks) {
  const char* op = "paged_attention";
  const at::Device device = cuda_device(op, "query", query);
  const at::ScalarType scalar_type = query.scalar_type();
  check_tensor(op, "query", query, device, scalar_type, {kAny, kAny, kAny});
  // Rows of query: one token a sequence in decode, else num_tokens, owned by the sequences of block_tables.
  const int64_t num_rows = query.size(0), num_heads = query.size(1), head_size = query.size(2);
  const int64_t num_seqs = query_start_loc.has_value() ? block_tables.size(0) : num_rows;
  check_tensor(op, "out", out, device, scalar_type, {num_rows, num_heads, head_size});
  const tpkit_fp8_format cache_fp8 = fp8_format(key_cache.scalar_type());
  const at::ScalarType cache_type = cache_fp8 == TPKIT_FP8_NONE ? scalar_type : key_cache.scalar_type();
  check_tensor(op, "key_cache", key_cache, device, cache_type, {kAny, kAny, kAny, head_size});
  const int64_t num_blocks = key_cache.size(0), block_size = key_cache.size(1), num_kv_heads = key_cache.size(2);
  check_tensor(op, "value_cache", value_cache, device, cache_type, {num_blocks, block_size, num_kv_heads, head_size});
  check_tensor(op, "block_tables", block_tables, device, at::kInt, {num_seqs, kAny});
  check_tensor(op, "seq_lens", seq_lens, device, at::kInt, {num_seqs});
  if (alibi_slopes.has_value()) check_tensor(op, "alibi_slopes", *alibi_slopes, device, at::kFloat, {num_heads});
  if (query_start_loc.has_value()) {
    check_tensor(op, "query_start_loc", *query_start_loc, device, at::kInt, {num_seqs + 1});
  }
  if (sinks.has_value()) check_tensor(op, "sinks", *sinks, device, at::kFloat, {num_heads});
  TPKIT_CHECK_VALUE(window_size.value_or(1) >= 1, "paged_attention (CUDA): window_size: expected an int >= 1, got ",
                    window_size.value_or(0));
  TPKIT_CHECK_VALUE(std::isfinite(logits_soft_cap.value_or(1.0)) && logits_soft_cap.value_or(1.0) > 0,
                    "paged_attention (CUDA): logits_soft_cap: expected a finite float > 0, got ",
                    logits_soft_cap.value_or(0.0));
  const tpkit_dtype dtype = to_tpkit_dtype(scalar_type);
  TPKIT_CHECK_VALUE(tpkit_paged_attention_supported(dtype, static_cast<int>(head_size), static_cast<int>(block_size),
                                                    cache_fp8),
                    "paged_attention (CUDA): head_size ", head_size, " with block_size ", block_size, " and dtype ",
                    scalar_type, " over a ", key_cache.scalar_type(), " cache is not supported; supported: ",
                    tpkit_paged_attention_supported_text());
  std::pair<at::Tensor, at::Tensor> scales;
  if (cache_fp8 != TPKIT_FP8_NONE) scales = kv_scales(op, k_scale, v_scale, device, num_kv_heads);
  TPKIT_CHECK_VALUE(num_kv_heads > 0 && num_heads % num_kv_heads == 0, "paged_attention (CUDA): num_kv_heads ",
                    num_kv_heads, " must divide num_heads ", num_heads);
  TPKIT_CHECK_VALUE(num_seqs <= 65535 && num_heads <= 65535, "paged_attention (CUDA): at most 65535 sequences and "
                    "heads, got ", num_seqs, " and ", num_heads);
  TPKIT_CHECK_VALUE(num_rows < INT32_MAX, "paged_attention (CUDA): expected fewer than 2^31 - 1 query tokens, got ",
                    num_rows);
  TPKIT_CHECK_VALUE(rows_16b_aligned(key_cache) && rows_16b_aligned(value_cache),
                    "paged_attention (CUDA): key_cache/value_cache: expected a contiguous last dimension and "
                    "16-byte aligned rows, got strides ", key_cache.strides(), " and ", value_cache.strides());
  // The kernels address pages and tokens with 32-bit byte strides.
  const int64_t max_stride = std::max({key_cache.stride(0), key_cache.stride(1), value_cache.stride(0),
                                       value_cache.stride(1)});
  TPKIT_CHECK_VALUE(max_stride * key_cache.element_size() < (int64_t{1} << 31),
                    "paged_attention (CUDA): key_cache/value_cache: expected block and token strides under 2^31 "
                    "bytes, got strides ", key_cache.strides(), " and ", value_cache.strides(), " of ",
                    key_cache.element_size(), "-byte elements");
  if (num_seqs == 0 || num_rows == 0) return;

  const c10::cuda::CUDAGuard guard(device);
  // Misaligned or strided inputs are copied (shapes only, so still graph safe); the caches never are.
  const at::Tensor q = rows_16b_aligned(query) ? query : query.clone(at::MemoryFormat::Contiguous);
  const at::Tensor o = rows_16b_aligned(out) ? out : at::empty_like(query, at::MemoryFormat::Contiguous);
  const at::Tensor bt = block_tables.stride(1) == 1 ? block_tables : block_tables.contiguous();
  const at::Tensor sl = seq_lens.contiguous();
  std::optional<at::Tensor> slopes, starts, head_sinks;
  if (alibi_slopes.has_value()) slopes = alibi_slopes->contiguous();
  if (query_start_loc.has_value()) starts = query_start_loc->contiguous();
  if (sinks.has_value()) head_sinks = sinks->contiguous();

  tpkit_paged_attention_args a{};
  a.out = o.data_ptr();
  a.query = q.data_ptr();
  a.key_cache = key_cache.data_ptr();
  a.value_cache = value_cache.data_ptr();
  a.block_tables = bt.data_ptr<int32_t>();
  a.seq_lens = sl.data_ptr<int32_t>();
  a.alibi_slopes = slopes.has_value() ? slopes->data_ptr<float>() : nullptr;
  fill_shapes(&a, query, key_cache, bt, starts, window_size);
  a.causal = causal ? 1 : 0;
  a.logits_soft_cap = static_cast<float>(logits_soft_cap.value_or(0.0));
  a.sinks = head_sinks.has_value() ? head_sinks->data_ptr<float>() : nullptr;
  if (cache_fp8 != TPKIT_FP8_NONE) {
    a.k_scale = scales.first.data_ptr<float>();
    a.v_scale = scales.second.data_ptr<float>();
    a.kv_scale_per_head = scales.first.numel() == num_kv_heads && num_kv_heads > 1;
  }
  a.q_stride_seq = q.stride(0);
  a.q_stride_head = q.stride(1);
  a.o_stride_seq = o.stride(0);
  a.o_stride_head = o.stride(1);
  fill_cache_strides(a, key_cache, value_cache);
  a.bt_stride = bt.stride(0);
  a.scale = static_cast<float>(scale);
  check_launch(tpkit_paged_attention_plan(&a), "paged_attention planning");

  at::Tensor tmp_out, tmp_lse;
  if (a.num_partitions > 1 && !a.cluster_merge) {
    const auto opts = query.options().dtype(at::kFloat);
    tmp_out = at::empty({num_rows, num_heads, a.num_partitions, head_size}, opts);
    tmp_lse = at::empty({num_rows, num_heads, a.num_partitions}, opts);
    a.tmp_out = tmp_out.data_ptr<float>();
    a.tmp_lse = tmp_lse.data_ptr<float>();
  }
  check_launch(tpkit_paged_attention_launch(&a, c10::cuda::getCurrentCUDAStream()), "paged_attention");
  if (!o.is_same(out)) out.copy_(o);
}

// The caches' pointers, block geometry and strides, and the slots (contiguous int64), into either kernel's
// arguments (the cache write's or the decode linear kernel's, which name them alike).
template <typename Args>
void fill_cache_args(Args& a, at::Tensor& key_cache, at::Tensor& value_cache, const at::Tensor& slot_mapping) {
  a.key_cache = key_cache.data_ptr();
  a.value_cache = value_cache.data_ptr();
  a.slot_mapping = slot_mapping.data_ptr<int64_t>();
  a.block_size = static_cast<int>(key_cache.size(1));
  a.num_blocks = key_cache.size(0);
  fill_cache_strides(a, key_cache, value_cache);
}

void reshape_and_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor key_cache, at::Tensor value_cache,
                       const at::Tensor& slot_mapping, const std::optional<at::Tensor>& k_scale,
                       const std::optional<at::Tensor>& v_scale) {
  const char* op = "reshape_and_cache";
  const at::Device device = cuda_device(op, "key", key);
  const at::ScalarType dtype = key.scalar_type();
  const at::ScalarType cache_dtype = key_cache.scalar_type();
  const tpkit_fp8_format cache_fp8 = fp8_format(cache_dtype);
  check_tensor(op, "key", key, device, dtype, {kAny, kAny, kAny});
  const int64_t num_tokens = key.size(0), num_kv_heads = key.size(1), head_size = key.size(2);
  check_tensor(op, "value", value, device, dtype, {num_tokens, num_kv_heads, head_size});
  check_tensor(op, "key_cache", key_cache, device, cache_fp8 == TPKIT_FP8_NONE ? dtype : cache_dtype,
               {kAny, kAny, num_kv_heads, head_size});
  check_tensor(op, "value_cache", value_cache, device, key_cache.scalar_type(),
               {key_cache.size(0), key_cache.size(1), num_kv_heads, head_size});
  check_tensor(op, "slot_mapping", slot_mapping, device, at::kLong, {num_tokens});
  TPKIT_CHECK_VALUE(key_cache.stride(-1) == 1 && value_cache.stride(-1) == 1,
                    "reshape_and_cache (CUDA): caches: expected a contiguous last dimension, got strides ",
                    key_cache.strides(), " and ", value_cache.strides());
  TPKIT_CHECK_VALUE(key.size(0) <= INT32_MAX, "reshape_and_cache (CUDA): too many tokens: ", key.size(0));
  TPKIT_CHECK_VALUE(key.element_size() >= 2, "reshape_and_cache (CUDA): 1-byte dtypes are not supported, got ",
                    key.scalar_type());
  std::pair<at::Tensor, at::Tensor> scales;
  if (cache_fp8 != TPKIT_FP8_NONE) scales = kv_scales(op, k_scale, v_scale, device, num_kv_heads);
  tpkit_reshape_and_cache_args a{};
  a.cache_fp8 = cache_fp8;
  if (cache_fp8 != TPKIT_FP8_NONE) {
    a.src_dtype = to_tpkit_dtype(dtype);
    a.k_scale = scales.first.data_ptr<float>();
    a.v_scale = scales.second.data_ptr<float>();
    a.scale_per_head = scales.first.numel() == num_kv_heads && num_kv_heads > 1;
  }
  if (key.numel() == 0) return;

  const c10::cuda::CUDAGuard guard(device);
  const at::Tensor k = key.stride(-1) == 1 ? key : key.contiguous();
  const at::Tensor v = value.stride(-1) == 1 ? value : value.contiguous();
  const at::Tensor slots = slot_mapping.contiguous();
  a.key = k.data_ptr();
  a.value = v.data_ptr();
  fill_cache_args(a, key_cache, value_cache, slots);
  a.num_tokens = static_cast<int>(k.size(0));
  a.num_kv_heads = static_cast<int>(k.size(1));
  a.head_size = static_cast<int>(k.size(2));
  a.elem_size = static_cast<int>(k.element_size());
  a.key_stride_token = k.stride(0);
  a.key_stride_head = k.stride(1);
  a.value_stride_token = v.stride(0);
  a.value_stride_head = v.stride(1);
  check_launch(tpkit_reshape_and_cache_launch(&a, c10::cuda::getCurrentCUDAStream()), "reshape_and_cache");
}

// Checks the product's tensors and fills its arguments; false where the kernel does not take them (dtype, row
// count, sizes or alignment; decode_linear.h). input [num_rows, in_features], weight [out_features,
// in_features], out [num_rows, out_features] (with silu_and_mul, [num_rows, out_features / 2]).
bool fill_decode_linear_args(tpkit_decode_linear_args& a, at::Tensor& out, const at::Tensor& input,
                             const at::Tensor& weight, const std::optional<at::Tensor>& bias, int64_t splits,
                             bool silu_and_mul, bool fp8_weight = false) {
  const char* op = "decode_linear";
  const at::Device device = cuda_device(op, "input", input);
  const at::ScalarType dtype = input.scalar_type();
  check_tensor(op, "input", input, device, dtype, {kAny, kAny});
  check_tensor(op, "weight", weight, device, fp8_weight ? at::kFloat8_e4m3fn : dtype, {kAny, input.size(1)});
  TPKIT_CHECK_VALUE(!silu_and_mul || weight.size(0) % 2 == 0,
                    "decode_linear (CUDA): silu_and_mul: expected a weight of an even number of rows (gate, up), "
                    "got ", weight.sizes());
  check_tensor(op, "out", out, device, dtype, {input.size(0), silu_and_mul ? weight.size(0) / 2 : weight.size(0)});
  if (bias.has_value()) check_tensor(op, "bias", *bias, device, dtype, {weight.size(0)});
  if ((dtype != at::kHalf && dtype != at::kBFloat16) || input.size(0) > TPKIT_DECODE_LINEAR_MAX_ROWS ||
      weight.size(0) > INT32_MAX || weight.size(1) > INT32_MAX || input.stride(1) != 1 || out.stride(1) != 1 ||
      !weight.is_contiguous() || (bias.has_value() && !bias->is_contiguous())) {
    return false;
  }
  a.out = out.data_ptr();
  a.input = input.data_ptr();
  a.weight = weight.data_ptr();
  a.bias = bias.has_value() ? bias->data_ptr() : nullptr;
  a.dtype = dtype == at::kHalf ? TPKIT_FLOAT16 : TPKIT_BFLOAT16;
  a.num_rows = static_cast<int>(input.size(0));
  a.in_features = static_cast<int>(input.size(1));
  a.out_features = static_cast<int>(weight.size(0));
  a.input_stride = input.stride(0);
  a.out_stride = out.stride(0);
  a.splits = static_cast<int>(splits);
  a.silu_and_mul = silu_and_mul ? 1 : 0;
  return true;
}

// A consumer's half of an RMSNorm split across two products (decode_linear.h): each row's product times
// rsqrt(rms_sums[m] / in_features + eps). rms_sums: float64 [num_rows]; none leaves the product as it is.
// False where the kernel does not take the tensor.
bool fill_rms_scale(tpkit_decode_linear_args& a, const std::optional<at::Tensor>& rms_sums, double eps,
                    const at::Device& device, const char* op) {
  if (!rms_sums.has_value()) return true;
  check_tensor(op, "rms_sums", *rms_sums, device, at::kDouble, {a.num_rows});
  if (!rms_sums->is_contiguous()) return false;
  a.rms_sums = rms_sums->data_ptr<double>();
  a.eps = static_cast<float>(eps);
  return true;
}

// Float8 (E4M3) weights' per-row scales (decode_linear.h): weight_scale float32 [out_features]; none leaves a
// weight of the dtype. False where the kernel does not take the tensor.
bool fill_weight_scale(tpkit_decode_linear_args& a, const std::optional<at::Tensor>& weight_scale,
                       const at::Device& device, const char* op) {
  if (!weight_scale.has_value()) return true;
  check_tensor(op, "weight_scale", *weight_scale, device, at::kFloat, {a.out_features});
  if (!weight_scale->is_contiguous()) return false;
  a.weight_scale = weight_scale->data_ptr<float>();
  return true;
}

bool launch_decode_linear(const tpkit_decode_linear_args& a, const at::Tensor& input) {
  if (!tpkit_decode_linear_supported(&a)) return false;
  const c10::cuda::CUDAGuard guard(input.device());
  check_launch(tpkit_decode_linear_launch(&a, c10::cuda::getCurrentCUDAStream()), "decode_linear");
  return true;
}

// out = input @ weight^T (+ bias) with the decode linear kernel; false (nothing launched) where the kernel
// does not take these tensors, for the caller to fall back. With silu_and_mul, out [num_rows,
// out_features / 2] = silu(gate) * up of the product's two halves. With rms_sums, each row's product is
// scaled first (fill_rms_scale); with weight_scale, weight is float8 (fill_weight_scale).
bool decode_linear(at::Tensor out, const at::Tensor& input, const at::Tensor& weight,
                   const std::optional<at::Tensor>& bias, int64_t splits, bool silu_and_mul,
                   const std::optional<at::Tensor>& rms_sums, double eps,
                   const std::optional<at::Tensor>& weight_scale) {
  tpkit_decode_linear_args a{};
  return fill_decode_linear_args(a, out, input, weight, bias, splits, silu_and_mul, weight_scale.has_value()) &&
         fill_rms_scale(a, rms_sums, eps, input.device(), "decode_linear") &&
         fill_weight_scale(a, weight_scale, input.device(), "decode_linear") && launch_decode_linear(a, input);
}

// out = input @ (weight * weight_scale[:, None])^T (+ bias) with the decode linear kernel reading float8
// (E4M3) weights [out_features, in_features] and their float32 per-row scales [out_features]; false where the
// kernel does not take these tensors.
bool decode_linear_fp8(at::Tensor out, const at::Tensor& input, const at::Tensor& weight,
                       const at::Tensor& weight_scale, const std::optional<at::Tensor>& bias, int64_t splits) {
  tpkit_decode_linear_args a{};
  return fill_decode_linear_args(a, out, input, weight, bias, splits, false, true) &&
         fill_weight_scale(a, weight_scale, input.device(), "decode_linear_fp8") && launch_decode_linear(a, input);
}

// The producer's half of an RMSNorm split across two products (decode_linear.h): out = residual + input @
// weight^T (+ bias), normed = out * norm_weight, sums[m] += the sum of out[m]^2 (sums zero before), zero_sums
// set to zero; false where the kernel does not take these tensors. out, residual, normed [num_rows,
// out_features]; norm_weight [out_features]; sums, zero_sums float64 [num_rows], two buffers (distinct: the op
// checks that before the kernel runs); weight_scale as in decode_linear.
bool decode_linear_residual_norm(at::Tensor out, at::Tensor normed, const at::Tensor& input, const at::Tensor& weight,
                                 const std::optional<at::Tensor>& bias, const at::Tensor& residual,
                                 const at::Tensor& norm_weight, at::Tensor sums,
                                 const std::optional<at::Tensor>& zero_sums,
                                 const std::optional<at::Tensor>& weight_scale) {
  tpkit_decode_linear_args a{};
  const char* op = "decode_linear_residual_norm";
  if (!fill_decode_linear_args(a, out, input, weight, bias, 0, false, weight_scale.has_value()) ||
      !fill_weight_scale(a, weight_scale, input.device(), op)) {
    return false;
  }
  const at::Device device = input.device();
  const at::ScalarType dtype = input.scalar_type();
  const int64_t num_rows = input.size(0), features = weight.size(0);
  check_tensor(op, "residual", residual, device, dtype, {num_rows, features});
  check_tensor(op, "normed", normed, device, dtype, {num_rows, features});
  check_tensor(op, "norm_weight", norm_weight, device, dtype, {features});
  check_tensor(op, "sums", sums, device, at::kDouble, {num_rows});
  if (zero_sums.has_value()) check_tensor(op, "zero_sums", *zero_sums, device, at::kDouble, {num_rows});
  if (!residual.is_contiguous() || !normed.is_contiguous() || !norm_weight.is_contiguous() || !sums.is_contiguous() ||
      (zero_sums.has_value() && !zero_sums->is_contiguous())) {
    return false;
  }
  a.residual = residual.data_ptr();
  a.norm_weight = norm_weight.data_ptr();
  a.normed = normed.data_ptr();
  a.sums = sums.data_ptr<double>();
  a.zero_sums = zero_sums.has_value() ? zero_sums->data_ptr<double>() : nullptr;
  return launch_decode_linear(a, input);
}

// A decode step's fused q, k, v projection (out [num_rows, (num_heads + 2 * num_kv_heads) * head_size]) with
// RoPE on its q and k heads (cos, sin [num_rows, head_size / 2]) and its k and v heads also written to row
// m's slot (slot_mapping[m]) of the caches [num_blocks, block_size, num_kv_heads, head_size] (of the dtype, or
// float8 quantized with k_scale and v_scale); weight_scale as in decode_linear; false where the kernel does not
// take these tensors.
bool decode_qkv_rope_cache(at::Tensor out, const at::Tensor& input, const at::Tensor& weight,
                           const std::optional<at::Tensor>& bias, const at::Tensor& cos, const at::Tensor& sin,
                           at::Tensor key_cache, at::Tensor value_cache, const at::Tensor& slot_mapping,
                           int64_t num_heads, const std::optional<at::Tensor>& rms_sums, double eps,
                           const std::optional<at::Tensor>& weight_scale, const std::optional<at::Tensor>& k_scale,
                           const std::optional<at::Tensor>& v_scale) {
  tpkit_decode_linear_args a{};
  const char* op = "decode_qkv_rope_cache";
  if (!fill_decode_linear_args(a, out, input, weight, bias, 0, false, weight_scale.has_value()) ||
      !fill_rms_scale(a, rms_sums, eps, input.device(), op) ||
      !fill_weight_scale(a, weight_scale, input.device(), op)) {
    return false;
  }
  const at::Device device = input.device();
  const at::ScalarType dtype = input.scalar_type();
  const tpkit_fp8_format cache_fp8 = fp8_format(key_cache.scalar_type());
  check_tensor(op, "key_cache", key_cache, device, cache_fp8 == TPKIT_FP8_NONE ? dtype : key_cache.scalar_type(),
               {kAny, kAny, kAny, kAny});
  check_tensor(op, "value_cache", value_cache, device, key_cache.scalar_type(),
               {key_cache.size(0), key_cache.size(1), key_cache.size(2), key_cache.size(3)});
  const int64_t num_kv_heads = key_cache.size(2), head_size = key_cache.size(3);
  // Held until the launch: the scales as the kernel reads them (kv_scales may expand one).
  std::pair<at::Tensor, at::Tensor> scales;
  if (cache_fp8 != TPKIT_FP8_NONE) {
    scales = kv_scales(op, k_scale, v_scale, device, num_kv_heads);
    a.cache_fp8 = cache_fp8;
    a.k_scale = scales.first.data_ptr<float>();
    a.v_scale = scales.second.data_ptr<float>();
    a.scale_per_head = scales.first.numel() == num_kv_heads && num_kv_heads > 1;
  }
  const int64_t features = (num_heads + 2 * num_kv_heads) * head_size;
  TPKIT_CHECK_VALUE(num_heads > 0 && weight.size(0) == features,
                    "decode_qkv_rope_cache (CUDA): weight: expected [(num_heads + 2 * num_kv_heads) * head_size = ",
                    features, ", in_features] (num_heads ", num_heads, ", num_kv_heads and head_size of the cache), "
                    "got ", weight.sizes());
  const int64_t num_rows = input.size(0);
  check_tensor(op, "cos", cos, device, dtype, {num_rows, head_size / 2});
  check_tensor(op, "sin", sin, device, dtype, {num_rows, head_size / 2});
  check_tensor(op, "slot_mapping", slot_mapping, device, at::kLong, {num_rows});
  if (!cos.is_contiguous() || !sin.is_contiguous() || !slot_mapping.is_contiguous() || key_cache.stride(3) != 1 ||
      value_cache.stride(3) != 1 || head_size > INT32_MAX || key_cache.size(1) > INT32_MAX) {
    return false;
  }
  a.head_size = static_cast<int>(head_size);
  a.q_features = static_cast<int>(num_heads * head_size);
  a.rotary_features = static_cast<int>((num_heads + num_kv_heads) * head_size);
  a.cos = cos.data_ptr();
  a.sin = sin.data_ptr();
  fill_cache_args(a, key_cache, value_cache, slot_mapping);
  return launch_decode_linear(a, input);
}

// float16 and bfloat16 as tpkit_dtype codes; false for any other dtype (the element-wise kernels' two).
bool to_16bit_dtype(at::ScalarType t, tpkit_dtype* dtype) {
  if (t != at::kHalf && t != at::kBFloat16) return false;
  *dtype = t == at::kHalf ? TPKIT_FLOAT16 : TPKIT_BFLOAT16;
  return true;
}

// RoPE of input [num_tokens, num_heads, head_size] (any token and head strides, last dim contiguous) by cos,
// sin [num_tokens, head_size / 2] into out (contiguous, input's shape); false where the kernel does not take
// these tensors (elementwise.h).
bool rotary(at::Tensor out, const at::Tensor& input, const at::Tensor& cos, const at::Tensor& sin) {
  const char* op = "rotary";
  const at::Device device = cuda_device(op, "input", input);
  const at::ScalarType dtype = input.scalar_type();
  check_tensor(op, "input", input, device, dtype, {kAny, kAny, kAny});
  check_tensor(op, "out", out, device, dtype, {input.size(0), input.size(1), input.size(2)});
  check_tensor(op, "cos", cos, device, dtype, {input.size(0), input.size(2) / 2});
  check_tensor(op, "sin", sin, device, dtype, {input.size(0), input.size(2) / 2});
  if (!out.is_contiguous() || !cos.is_contiguous() || !sin.is_contiguous() || input.stride(2) != 1 ||
      input.size(1) > INT32_MAX || input.size(2) > INT32_MAX) {
    return false;
  }
  tpkit_rotary_args a{};
  if (!to_16bit_dtype(input.scalar_type(), &a.dtype)) return false;
  a.out = out.data_ptr();
  a.input = input.data_ptr();
  a.cos = cos.data_ptr();
  a.sin = sin.data_ptr();
  a.num_tokens = input.size(0);
  a.num_heads = static_cast<int>(input.size(1));
  a.head_size = static_cast<int>(input.size(2));
  a.input_stride_token = input.stride(0);
  a.input_stride_head = input.stride(1);
  if (!tpkit_rotary_supported(&a)) return false;
  const c10::cuda::CUDAGuard guard(device);
  check_launch(tpkit_rotary_launch(&a, c10::cuda::getCurrentCUDAStream()), "rotary");
  return true;
}

// out [num_rows, features] = silu(gate) * up of input [num_rows, 2 * features] (gate, then up; any row strides,
// last dims contiguous); false where the kernel does not take these tensors (elementwise.h).
bool silu_and_mul(at::Tensor out, const at::Tensor& input) {
  const char* op = "silu_and_mul";
  const at::Device device = cuda_device(op, "input", input);
  const at::ScalarType dtype = input.scalar_type();
  check_tensor(op, "input", input, device, dtype, {kAny, kAny});
  TPKIT_CHECK_VALUE(input.size(1) % 2 == 0, "silu_and_mul (CUDA): input: expected [num_rows, 2 * features] (gate, "
                    "then up), got ", input.sizes());
  check_tensor(op, "out", out, device, dtype, {input.size(0), input.size(1) / 2});
  if (input.stride(1) != 1 || out.stride(1) != 1) return false;
  tpkit_silu_and_mul_args a{};
  if (!to_16bit_dtype(input.scalar_type(), &a.dtype)) return false;
  a.out = out.data_ptr();
  a.input = input.data_ptr();
  a.num_rows = input.size(0);
  a.features = out.size(1);
  a.input_stride = input.stride(0);
  a.out_stride = out.stride(0);
  if (!tpkit_silu_and_mul_supported(&a)) return false;
  const c10::cuda::CUDAGuard guard(input.device());
  check_launch(tpkit_silu_and_mul_launch(&a, c10::cuda::getCurrentCUDAStream()), "silu_and_mul");
  return true;
}

// Fills a quantization's arguments: out float8 E4M3 [num_rows, features] and scale float32 [num_rows, 1] of the
// values of input [num_rows, parts * features] (any row stride, last dim contiguous; parts 2 for SwiGLU's gate
// and up), each row by its own amax, at most activation_scale_ub, or by input_scale (float32, one element)
// (elementwise.h); false where the kernel does not take these tensors.
bool fill_quantize_args(tpkit_quantize_fp8_args& a, const char* op, at::Tensor& out, at::Tensor& scale,
                        const at::Tensor& input, int64_t parts, const std::optional<at::Tensor>& input_scale,
                        std::optional<double> activation_scale_ub) {
  const at::Device device = cuda_device(op, "input", input);
  check_tensor(op, "input", input, device, input.scalar_type(), {kAny, kAny});
  TPKIT_CHECK_VALUE(input.size(1) % parts == 0, op, " (CUDA): input: expected [num_rows, ", parts,
                    " * features], got ", input.sizes());
  const int64_t num_rows = input.size(0), features = input.size(1) / parts;
  check_tensor(op, "out", out, device, at::kFloat8_e4m3fn, {num_rows, features});
  check_tensor(op, "scale", scale, device, at::kFloat, {num_rows, 1});
  if (!out.is_contiguous() || !scale.is_contiguous() || input.stride(1) != 1) return false;
  if (input_scale.has_value() && (input_scale->device() != device || input_scale->scalar_type() != at::kFloat ||
                                  input_scale->numel() != 1)) {
    return false;
  }
  // A finite bound beyond float32's range: torch refuses to convert it, and so does the PyTorch path.
  const double bound = activation_scale_ub.value_or(INFINITY);
  if (std::isfinite(bound) && std::abs(bound) > FLT_MAX) return false;
  if (!to_16bit_dtype(input.scalar_type(), &a.dtype)) return false;
  a.out = out.data_ptr();
  a.scale = scale.data_ptr<float>();
  a.input = input.data_ptr();
  a.static_scale = input_scale.has_value() ? input_scale->data_ptr<float>() : nullptr;
  a.amax_bound = static_cast<float>(bound);
  a.num_rows = num_rows;
  a.features = features;
  a.input_stride = input.stride(0);
  return true;
}

// A quantization of input [num_rows, parts * features] into out [num_rows, features] and scale
// (fill_quantize_args) by the kernel of `supported` and `launch`.
bool quantize_rows(const char* op, int64_t parts, int (*supported)(const tpkit_quantize_fp8_args*),
                   cudaError_t (*launch)(const tpkit_quantize_fp8_args*, cudaStream_t), at::Tensor out,
                   at::Tensor scale, const at::Tensor& input, const std::optional<at::Tensor>& input_scale,
                   std::optional<double> activation_scale_ub) {
  tpkit_quantize_fp8_args a{};
  if (!fill_quantize_args(a, op, out, scale, input, parts, input_scale, activation_scale_ub) || !supported(&a)) {
    return false;
  }
  const c10::cuda::CUDAGuard guard(input.device());
  check_launch(launch(&a, c10::cuda::getCurrentCUDAStream()), op);
  return true;
}

// input [num_rows, features] quantized per token.
bool quantize_per_token_fp8(at::Tensor out, at::Tensor scale, const at::Tensor& input,
                            const std::optional<at::Tensor>& input_scale,
                            std::optional<double> activation_scale_ub) {
  return quantize_rows("quantize_per_token_fp8", 1, tpkit_quantize_fp8_supported, tpkit_quantize_fp8_launch, out,
                       scale, input, input_scale, activation_scale_ub);
}

// silu(gate) * up of input [num_rows, 2 * features] (gate, then up) quantized per token.
bool silu_and_mul_quantize_fp8(at::Tensor out, at::Tensor scale, const at::Tensor& input,
                               const std::optional<at::Tensor>& input_scale,
                               std::optional<double> activation_scale_ub) {
  return quantize_rows("silu_and_mul_quantize_fp8", 2, tpkit_silu_and_mul_quantize_fp8_supported,
                       tpkit_silu_and_mul_quantize_fp8_launch, out, scale, input, input_scale, activation_scale_ub);
}

// RMSNorm of input [num_rows, features] (with residual: of input + residual, written to residual_out) by
// norm_weight [features], quantized per token into out and scale (fill_quantize_args).
bool rms_norm_quantize_fp8(at::Tensor out, at::Tensor scale, const std::optional<at::Tensor>& residual_out,
                           const at::Tensor& input, const std::optional<at::Tensor>& residual,
                           const at::Tensor& norm_weight, double eps, const std::optional<at::Tensor>& input_scale,
                           std::optional<double> activation_scale_ub) {
  const char* op = "rms_norm_quantize_fp8";
  tpkit_rms_norm_quantize_fp8_args a{};
  if (!fill_quantize_args(a.quantize, op, out, scale, input, 1, input_scale, activation_scale_ub)) {
    return false;
  }
  const at::Device device = input.device();
  const int64_t num_rows = input.size(0), features = input.size(1);
  check_tensor(op, "norm_weight", norm_weight, device, input.scalar_type(), {features});
  TPKIT_CHECK_VALUE(residual.has_value() == residual_out.has_value(), "rms_norm_quantize_fp8 (CUDA): expected "
                    "residual and residual_out both or neither");
  if (!norm_weight.is_contiguous()) return false;
  if (residual.has_value()) {
    check_tensor(op, "residual", *residual, device, input.scalar_type(), {num_rows, features});
    check_tensor(op, "residual_out", *residual_out, device, input.scalar_type(), {num_rows, features});
    if (residual->stride(1) != 1 || !residual_out->is_contiguous()) return false;
    a.residual = residual->data_ptr();
    a.residual_out = residual_out->data_ptr();
    a.residual_stride = residual->stride(0);
  }
  a.norm_weight = norm_weight.data_ptr();
  a.eps = static_cast<float>(eps);
  if (!tpkit_rms_norm_quantize_fp8_supported(&a)) return false;
  const c10::cuda::CUDAGuard guard(device);
  check_launch(tpkit_rms_norm_quantize_fp8_launch(&a, c10::cuda::getCurrentCUDAStream()), op);
  return true;
}

bool tpkit_paged_attention_supported_int(int dtype_code, int64_t head_size, int64_t block_size, int fp8_code) {
  return dtype_code >= TPKIT_FLOAT16 && dtype_code <= TPKIT_FLOAT32 && head_size <= INT32_MAX &&
         block_size <= INT32_MAX && fp8_code >= TPKIT_FP8_NONE && fp8_code <= TPKIT_FP8_E5M2 &&
         tpkit_paged_attention_supported(static_cast<tpkit_dtype>(dtype_code), static_cast<int>(head_size),
                                         static_cast<int>(block_size), static_cast<tpkit_fp8_format>(fp8_code));
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "tpkit paged-attention and decode linear CUDA kernels";
  m.def("paged_attention", &paged_attention, "Paged attention into `out` (see tpkit.ops.paged_attention).",
        py::arg("out"), py::arg("query"), py::arg("key_cache"), py::arg("value_cache"), py::arg("block_tables"),
        py::arg("seq_lens"), py::arg("scale"), py::arg("alibi_slopes"), py::arg("query_start_loc") = py::none(),
        py::arg("causal") = true, py::arg("k_scale") = py::none(), py::arg("v_scale") = py::none(),
        py::arg("window_size") = py::none(), py::arg("logits_soft_cap") = py::none(), py::arg("sinks") = py::none());
  m.def("plan", &plan, "The launch configuration for these shapes: partitions, warps, stages, shared memory.",
        py::arg("query"), py::arg("key_cache"), py::arg("block_tables"), py::arg("query_start_loc") = py::none(),
        py::arg("causal") = true, py::arg("window_size") = py::none());
  m.def("device_limits", &device_limits, "The launch limits of a CUDA device (grid, block, shared memory, clusters).",
        py::arg("device"));
  m.def("is_supported", &tpkit_paged_attention_supported_int,
        "Whether the kernels support (dtype code: 0 float16, 1 bfloat16, 2 float32; head_size; block_size; "
        "cache float8 code: 0 none, 1 E4M3, 2 E5M2).",
        py::arg("dtype_code"), py::arg("head_size"), py::arg("block_size"), py::arg("fp8_code") = 0);
  m.def("supported_text", &tpkit_paged_attention_supported_text, "What the kernels support, in words.");
  m.def("reshape_and_cache", &reshape_and_cache, "Writes key/value into their cache slots (in place).",
        py::arg("key"), py::arg("value"), py::arg("key_cache"), py::arg("value_cache"), py::arg("slot_mapping"),
        py::arg("k_scale") = py::none(), py::arg("v_scale") = py::none());
  m.def("decode_linear", &decode_linear,
        "out = input @ weight.T (+ bias) for up to 16 rows; False where the kernel does not take these tensors.",
        py::arg("out"), py::arg("input"), py::arg("weight"), py::arg("bias"), py::arg("splits"),
        py::arg("silu_and_mul") = false, py::arg("rms_sums") = py::none(), py::arg("eps") = 0.0,
        py::arg("weight_scale") = py::none());
  m.def("decode_linear_fp8", &decode_linear_fp8,
        "out = input @ (weight * weight_scale[:, None]).T (+ bias) for up to 16 rows of float8 weights; False "
        "where the kernel does not take these tensors.",
        py::arg("out"), py::arg("input"), py::arg("weight"), py::arg("weight_scale"), py::arg("bias"),
        py::arg("splits") = 0);
  m.def("decode_linear_residual_norm", &decode_linear_residual_norm,
        "out = residual + input @ weight.T (+ bias) for up to 16 rows, normed = out * norm_weight, sums += the "
        "rows' sums of squares, zero_sums zeroed; False where the kernel does not take these tensors.",
        py::arg("out"), py::arg("normed"), py::arg("input"), py::arg("weight"), py::arg("bias"), py::arg("residual"),
        py::arg("norm_weight"), py::arg("sums"), py::arg("zero_sums"), py::arg("weight_scale") = py::none());
  m.def("decode_qkv_rope_cache", &decode_qkv_rope_cache,
        "The fused q, k, v product of up to 16 rows with RoPE on q and k and k, v written to the caches; False "
        "where the kernel does not take these tensors.",
        py::arg("out"), py::arg("input"), py::arg("weight"), py::arg("bias"), py::arg("cos"), py::arg("sin"),
        py::arg("key_cache"), py::arg("value_cache"), py::arg("slot_mapping"), py::arg("num_heads"),
        py::arg("rms_sums") = py::none(), py::arg("eps") = 0.0, py::arg("weight_scale") = py::none(),
        py::arg("k_scale") = py::none(), py::arg("v_scale") = py::none());
  m.def("rotary", &rotary,
        "RoPE of input [num_tokens, num_heads, head_size] by cos, sin [num_tokens, head_size / 2] into out; False "
        "where the kernel does not take these tensors.",
        py::arg("out"), py::arg("input"), py::arg("cos"), py::arg("sin"));
  m.def("silu_and_mul", &silu_and_mul,
        "out = silu(gate) * up of input's halves [num_rows, 2 * features]; False where the kernel does not take "
        "these tensors.",
        py::arg("out"), py::arg("input"));
  m.def("quantize_per_token_fp8", &quantize_per_token_fp8,
        "out (float8 E4M3) and scale [num_rows, 1] of input [num_rows, features] quantized per token (or with "
        "input_scale); False where the kernel does not take these tensors.",
        py::arg("out"), py::arg("scale"), py::arg("input"), py::arg("input_scale") = py::none(),
        py::arg("activation_scale_ub") = py::none());
  m.def("silu_and_mul_quantize_fp8", &silu_and_mul_quantize_fp8,
        "out (float8 E4M3) and scale [num_rows, 1] of silu(gate) * up of input's halves [num_rows, 2 * features], "
        "quantized per token (or with input_scale); False where the kernel does not take these tensors.",
        py::arg("out"), py::arg("scale"), py::arg("input"), py::arg("input_scale") = py::none(),
        py::arg("activation_scale_ub") = py::none());
  m.def("rms_norm_quantize_fp8", &rms_norm_quantize_fp8,
        "out (float8 E4M3) and scale [num_rows, 1] of the RMSNorm of input (plus residual, their sum written to "
        "residual_out), quantized per token (or with input_scale); False where the kernel does not take these "
        "tensors.",
        py::arg("out"), py::arg("scale"), py::arg("residual_out"), py::arg("input"), py::arg("residual"),
        py::arg("norm_weight"), py::arg("eps"), py::arg("input_scale") = py::none(),
        py::arg("activation_scale_ub") = py::none());
}

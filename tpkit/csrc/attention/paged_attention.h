// C interface of tpkit's paged-attention kernels: raw pointers, sizes, strides (in elements) and a CUDA
// stream. No torch: the binding (binding.cpp) checks tensors and fills these structs; .ci/run compiles
// everything else with a bare nvcc (python -m tpkit.attention.build_check).
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

#include "common/dtype.h"

#ifdef __cplusplus
extern "C" {
#endif

// Paged attention: out[t, h] = softmax(scale * q[t, h] . K[s, b:e]^T (+ ALiBi)) V[s, b:e] over keys b .. e - 1
// of the sequence s that query row t belongs to, found through block_tables[s]. Query head h reads KV head
// h / (num_heads / num_kv_heads). b is 0, or with a window the row's position - window_size + 1 (at least 0).
// logits_soft_cap caps the scaled scores before ALiBi; sinks add exp(sinks[h]) to each row's denominator.
// - Decode (query_start_loc NULL): row t is sequence t's one query token, e = seq_lens[t].
// - Several tokens a sequence: sequence s owns rows query_start_loc[s] .. query_start_loc[s + 1] - 1, the last
//   q_len of its seq_lens[s] tokens; row j of them sees e = seq_lens[s] - q_len + j + 1 keys when causal
//   (bottom-right aligned), all seq_lens[s] otherwise.
typedef struct {
  // Inputs and output. Caches are [num_blocks, block_size, num_kv_heads, head_size], last dim contiguous;
  // query and out [num_query_rows, num_heads, head_size], last dim contiguous. Rows must be 16-byte aligned.
  void* out;
  const void* query;
  const void* key_cache;
  const void* value_cache;
  const int32_t* block_tables;  // [num_seqs, max_blocks_per_seq], last dim contiguous
  const int32_t* seq_lens;      // [num_seqs]
  const float* alibi_slopes;    // [num_heads] or NULL
  const int32_t* query_start_loc;  // [num_seqs + 1] or NULL (decode)
  int causal;                   // with query_start_loc: 1 causal (bottom-right), 0 every key
  int window_size;              // > 0: a row at position q sees keys from q - window_size + 1 on; 0: no window
  float logits_soft_cap;        // > 0: scaled scores become cap * tanh(scores / cap) before ALiBi; 0: none
  const float* sinks;           // [num_heads] or NULL: a logit a head that joins the softmax's denominator
  // A float8 cache (cache_fp8 not TPKIT_FP8_NONE; query and out stay dtype): stored = x / scale, with
  // k_scale[h], v_scale[h] for KV head h (kv_scale_per_head) or entry 0. The caches hold dtype otherwise.
  tpkit_fp8_format cache_fp8;
  const float* k_scale;         // [num_kv_heads] or [1]
  const float* v_scale;
  int kv_scale_per_head;
  tpkit_dtype dtype;
  int num_seqs;                 // sequences (rows of block_tables)
  int num_query_rows;           // rows of query and out: num_seqs in decode, num_tokens with query_start_loc
  int num_heads;
  int num_kv_heads;
  int head_size;
  int block_size;
  int max_blocks_per_seq;
  int num_blocks;
  int64_t q_stride_seq, q_stride_head;
  int64_t o_stride_seq, o_stride_head;
  int64_t kc_stride_block, kc_stride_token, kc_stride_head;
  int64_t vc_stride_block, vc_stride_token, vc_stride_head;
  int64_t bt_stride;
  float scale;

  // Filled by tpkit_paged_attention_plan from the shapes alone (never from seq_lens' values, so the plan
  // is the same in every replay of a CUDA graph).
  int num_partitions;  // split-K partitions per sequence; 1: no split, no scratch
  int cluster_merge;   // 1: a (sequence, KV head)'s partitions run as one thread-block cluster and merge
                       // through distributed shared memory (Hopper): no scratch, no merge kernel
  int partition_size;  // tokens per partition, a multiple of the kernel's tile
  int m_groups;        // thread blocks per KV head along the query-head axis (1 unless the group is huge)
  int rows_per_cta;    // query rows (heads) one thread block serves
  int warps_m, warps_n;
  int slices;          // 16-token slices a warp takes per step of the mma kernel (1 or 2)
  int swizzled;        // 1: the mma kernel's shared-memory rows are swizzled, 0: padded
  int wgmma;           // 1: the warpgroup kernel (sm_90a builds, large groups), 0: the mma or fp32 kernel
  int warpgroups;      // warpgroups a block of the warpgroup kernel (1 or 2, each on alternate tiles); else 1
  int num_stages;      // cp.async pipeline depth
  int threads;
  int smem_bytes;
  int group_size;           // num_heads / num_kv_heads
  int block_size_log2;
  float scale_log2;         // scale * log2(e)
  float soft_cap_scale;     // with logits_soft_cap: scale / cap (tanh's argument per raw score)
  float soft_cap_log2;      // with logits_soft_cap: cap * log2(e) (tanh's value to the log2 domain); else 0
  // With query_start_loc: a sequence's query tokens are served in work tiles of tile_tokens tokens (each of
  // them with every query head of the block's row group); num_work_tiles bounds the batch's tiles from the
  // shapes (the grid's z; tiles past the batch's exit at once). Decode: 1 and num_seqs.
  int tile_tokens;
  int num_work_tiles;

  // Split-K scratch, allocated by the caller after planning when num_partitions > 1 and not cluster_merge:
  // tmp_out float32 [num_query_rows, num_heads, num_partitions, head_size], tmp_lse float32
  // [num_query_rows, num_heads, num_partitions] (log2-domain log-sum-exp of each partition).
  float* tmp_out;
  float* tmp_lse;
} tpkit_paged_attention_args;

// 1 when the kernels support this dtype, head size and block size over caches of that dtype or, with
// cache_fp8 set, of that float8 format (see tpkit_paged_attention_supported_text).
int tpkit_paged_attention_supported(tpkit_dtype dtype, int head_size, int block_size, tpkit_fp8_format cache_fp8);

// What the kernels support, for error messages.
const char* tpkit_paged_attention_supported_text(void);

// Chooses the launch configuration and split-K partitioning for the current CUDA device from the shapes.
// Returns cudaSuccess, or the error of a device query (the args are then unusable).
cudaError_t tpkit_paged_attention_plan(tpkit_paged_attention_args* args);

// Launches the attention kernel (and, when num_partitions > 1, the log-sum-exp merge) on `stream`.
cudaError_t tpkit_paged_attention_launch(const tpkit_paged_attention_args* args, cudaStream_t stream);

#ifdef __cplusplus
}
#endif

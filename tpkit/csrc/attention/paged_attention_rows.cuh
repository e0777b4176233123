// The query rows a thread block of the attention kernels serves, the keys each row sees and the sink that
// joins its softmax's denominator. Torch-free.
//
// A block serves one row group of one KV head over one partition of the keys (blockIdx.y) for one work item
// (block_coords). Decode: item z is sequence z, its rows the row group's query heads of the sequence's one
// token, at its last position. With query_start_loc: item z is the z-th work tile of the batch, counting each sequence's query tokens in tiles of tile_tokens (a sequence of q_len tokens has
// ceil(q_len / tile_tokens) of them, in order); its rows are (token, head) pairs, token-major: row r is query
// head head0 + r % heads of the tile's token r / heads.
#pragma once

#include <math.h>
#include <stdint.h>

#include "attention/paged_attention.h"
#include "common/ptx.cuh"

namespace tpkit {

struct BlockCoords {
  int kv_head;
  int m_group;  // row group within the KV head's query heads
  int item;     // work item
};

// Decode grids are (KV heads x row groups, partitions, sequences); with query_start_loc every work tile's
// blocks are in x, (work tile, KV head, row group) with the row group fastest: a long prefill has more work
// tiles than a grid's z may hold.
template <bool MULTI>
__device__ __forceinline__ BlockCoords block_coords(const tpkit_paged_attention_args& p) {
  const int heads_groups = p.num_kv_heads * p.m_groups;
  const int item = MULTI ? static_cast<int>(blockIdx.x) / heads_groups : static_cast<int>(blockIdx.z);
  const int head_group = MULTI ? static_cast<int>(blockIdx.x) - item * heads_groups : static_cast<int>(blockIdx.x);
  const int kv_head = head_group / p.m_groups;
  return {kv_head, head_group - kv_head * p.m_groups, item};
}

struct QueryRows {
  int seq;            // the sequence; -1: the item is past the batch's tiles (nothing to do)
  int multi;          // 1: rows are (token, head) pairs of a work tile; 0: decode, one token
  int64_t first_row;  // the row of query and out holding the tile's first token
  int heads;          // query heads each token has in this block
  int head0;          // the first of them
  int tokens;         // the tile's tokens (decode: 1)
  int rows_valid;     // tokens * heads
  int first_pos;      // cache position of the first token (decode: seq_len - 1)
  int causal;         // 1: a token at position q sees keys 0 .. q; 0: every key of the sequence
  int window;         // > 0: a token at position q sees no key before q - window + 1
  int seq_len;        // clamped to the block table's capacity

  __device__ int token(int r) const { return multi ? r / heads : 0; }
  __device__ int head(int r) const { return head0 + r - token(r) * heads; }
  __device__ int64_t row(int r) const { return first_row + token(r); }
  // Keys row r attends to: positions begin(r) .. end(r) - 1.
  __device__ int begin(int r) const { return window > 0 ? max(0, first_pos + token(r) - window + 1) : 0; }
  __device__ int end(int r) const { return causal ? first_pos + token(r) + 1 : seq_len; }
  // Whether row r sees a key of positions start .. end - 1 (a partition's).
  __device__ bool attends(int r, int start, int stop) const { return max(start, begin(r)) < min(stop, end(r)); }
  // Row r's query position (ALiBi's distances are measured from it).
  __device__ float position(int r) const { return static_cast<float>(first_pos + token(r)); }
  // Keys the block reads: from the first its first token sees to the last its last token sees.
  __device__ int key_begin() const { return begin(0); }
  __device__ int key_end() const { return causal ? first_pos + tokens : seq_len; }
  // Decode: the sequence's length, once read (clamped to the table's capacity); its token stands last.
  __device__ void set_seq_len(int len) {
    seq_len = len;
    first_pos = len - 1;
  }
};

// Decode rows: `rows_valid` query heads from head0 of sequence `seq`'s token, which sees all its keys (the
// length comes with set_seq_len).
__device__ __forceinline__ QueryRows decode_rows(const tpkit_paged_attention_args& p, int seq, int head0,
                                                 int rows_valid) {
  QueryRows q;
  q.seq = seq;
  q.multi = 0;
  q.first_row = seq;
  q.heads = rows_valid;
  q.head0 = head0;
  q.tokens = 1;
  q.rows_valid = rows_valid;
  q.causal = 0;
  q.window = p.window_size;
  q.set_seq_len(0);
  return q;
}

// Where a block's partitions of the keys start: 0, or with a window the first key the block's first row sees
// (first_pos - window + 1), rounded down to a KV block so that every tile's pages start on block boundaries.
// The merge kernel finds a decode row's partitions the same way.
__device__ __forceinline__ int keys_start(int first_pos, int window, int block_size_log2) {
  return window > 0 ? (max(0, first_pos - window + 1) >> block_size_log2) << block_size_log2 : 0;
}

__device__ __forceinline__ int work_tiles_of(int q_len, int tile_tokens) {
  return q_len > 0 ? (q_len + tile_tokens - 1) / tile_tokens : 0;
}

// The rows of work tile `item` (query_start_loc set), for `heads` query heads from head0 of each token. Every
// thread of the block calls it after the inputs are ready (griddepcontrol.wait): a block-wide scan of the
// sequences' tile counts finds the tile's sequence. Clamped so that bad lengths never address rows past
// num_query_rows nor keys past the table's capacity.
__device__ __forceinline__ QueryRows tile_rows(const tpkit_paged_attention_args& p, int item, int head0,
                                               int heads) {
  __shared__ int found[2];  // sequence, tile within it
  __shared__ int warp_tiles[32];
  const int* qsl = p.query_start_loc;
  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int per_thread = (p.num_seqs + blockDim.x - 1) / blockDim.x;
  const int lo = min(tid * per_thread, p.num_seqs);
  const int hi = min(lo + per_thread, p.num_seqs);
  int count = 0;
  for (int s = lo; s < hi; ++s) count += work_tiles_of(qsl[s + 1] - qsl[s], p.tile_tokens);
  int inclusive = count;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int v = __shfl_up_sync(0xffffffffu, inclusive, o);
    if (lane >= o) inclusive += v;
  }
  if (lane == 31) warp_tiles[warp] = inclusive;
  if (tid == 0) found[0] = -1;
  __syncthreads();
  int before = inclusive - count;
  for (int w = 0; w < warp; ++w) before += warp_tiles[w];
  if (item >= before && item < before + count) {
    for (int s = lo, c = before; s < hi; ++s) {
      const int n = work_tiles_of(qsl[s + 1] - qsl[s], p.tile_tokens);
      if (item < c + n) {
        found[0] = s;
        found[1] = item - c;
        break;
      }
      c += n;
    }
  }
  __syncthreads();
  QueryRows q;
  q.multi = 1;
  q.seq = found[0];
  q.heads = heads;
  q.head0 = head0;
  q.causal = p.causal;
  q.window = p.window_size;
  if (q.seq < 0) {
    q.first_row = 0;
    q.tokens = q.rows_valid = q.first_pos = q.seq_len = 0;
    return q;
  }
  const int begin = qsl[q.seq];
  const int q_len = qsl[q.seq + 1] - begin;
  const int first = found[1] * p.tile_tokens;
  q.first_row = static_cast<int64_t>(begin) + first;
  q.tokens = max(0, min(min(p.tile_tokens, q_len - first), p.num_query_rows - static_cast<int>(q.first_row)));
  if (begin < 0 || q.tokens == 0) q.seq = -1;
  q.rows_valid = q.tokens * heads;
  q.seq_len = min(p.seq_lens[max(q.seq, 0)], p.max_blocks_per_seq << p.block_size_log2);
  q.first_pos = q.seq_len - q_len + first;
  return q;
}

// Query head `head`'s sink logit in the log2 domain, -inf without sinks (it then adds nothing).
__device__ __forceinline__ float sink_log2(const tpkit_paged_attention_args& p, int head) {
  return p.sinks != nullptr ? p.sinks[head] * kLog2e : -INFINITY;
}

// A row's softmax denominator with its sink: the sum of exp2(logit - m) over its keys, plus exp2(sink - m).
__device__ __forceinline__ float with_sink(float sum, float m, float sink) {
  return sink != -INFINITY ? sum + fast_exp2(sink - m) : sum;
}

// The block's query rows, once its inputs are ready (griddepcontrol.wait: every input may come from the kernel
// before, launched as a programmatic dependent). Decode: `prefetch` first asks L2 for what the prologue reads,
// and the sequence's length is the first read after the wait, into seq_len_read, for set_seq_len once the
// block's first copies are issued (a small grid's time is a chain of memory latencies). Several tokens a
// sequence: the rows of work tile coords.item, seq -1 past the batch's tiles.
template <bool MULTI, typename Prefetch>
__device__ __forceinline__ QueryRows start_rows(const tpkit_paged_attention_args& p, const BlockCoords& coords,
                                                int head0, int heads, Prefetch&& prefetch, int& seq_len_read) {
  if constexpr (MULTI) {
    grid_wait_primary();
    return tile_rows(p, coords.item, head0, heads);
  } else {
    prefetch(coords.item);
    grid_wait_primary();
    seq_len_read = p.seq_lens[coords.item];
    return decode_rows(p, coords.item, head0, heads);
  }
}

}  // namespace tpkit

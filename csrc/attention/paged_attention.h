// Host-side interface of the paged attention kernels. Plain C++ + CUDA runtime: no torch headers,
// so the .cu files compile standalone with `nvcc -c` (scripts/check_cuda_compile.sh).
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

namespace kvserve {

enum class DType : int { kFloat16 = 0, kBFloat16 = 1 };

// One packed varlen batch. Layouts (element strides; the last dim is contiguous everywhere):
//   q, out     [num_tokens, num_heads, head_dim]
//   k/v cache  [num_blocks, block_size, num_kv_heads, head_dim]
//   block_tables [num_seqs, max_blocks] int32; query_start_loc [num_seqs + 1]; seq_lens [num_seqs]
//   o_part     [num_tokens, num_heads, num_splits, head_dim] fp32 (only when num_splits > 1)
//   lse_part   [num_tokens, num_heads, num_splits] fp32, log2 units (only when num_splits > 1)
// Sequence i owns query rows [query_start_loc[i], query_start_loc[i+1]); its causal mask is aligned
// bottom-right: query row j of q_len sees KV positions [0, seq_len - q_len + j].
struct PagedAttentionParams {
  const void* q;
  const void* k_cache;
  const void* v_cache;
  void* out;
  float* o_part;
  float* lse_part;
  const int32_t* block_tables;
  const int32_t* query_start_loc;
  const int32_t* seq_lens;
  int64_t q_stride_token, q_stride_head;
  int64_t o_stride_token, o_stride_head;
  int64_t k_stride_block, k_stride_slot, k_stride_head;
  int64_t v_stride_block, v_stride_slot, v_stride_head;
  int64_t block_table_stride;
  int num_seqs, num_heads, num_kv_heads, head_dim, block_size;
  int max_query_len;     // launch grid: row tiles cover max_query_len * group packed rows
  int num_splits;        // split-KV: 1 writes `out` directly, > 1 writes o_part / lse_part
  int tokens_per_split;  // multiple of the kernel's KV tile (64)
  float scale_log2;      // softmax scale * log2(e)
};

// FlashAttention-2 forward over the paged pool; `decode_config` picks one-warp CTAs (16 packed rows)
// for steps whose sequences have few query rows. Returns the launch error, if any.
cudaError_t launch_paged_attention(const PagedAttentionParams& p, DType dtype, bool decode_config,
                                   cudaStream_t stream);

// Merges the num_splits partials of every (token, head) into `out`.
cudaError_t launch_merge_splits(const PagedAttentionParams& p, int num_tokens, DType dtype,
                                cudaStream_t stream);

constexpr int kKvTile = 64;  // KV tokens per tile; tokens_per_split must be a multiple of it

}  // namespace kvserve

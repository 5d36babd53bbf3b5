// Host-side interface of the paged attention kernels. Plain C++ + CUDA runtime: no torch headers,
// so the .cu files compile standalone with `nvcc -c` (scripts/check_cuda_compile.sh).
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

namespace kvserve {

enum class DType : int { kFloat16 = 0, kBFloat16 = 1 };

// How the pool stores K and V (kvserve/quant/); values reach shared memory as the query dtype.
//   kDense     k/v cache hold query-dtype values.
//   kFp8E4m3   k/v cache hold e4m3fn codes (uint8); x = e4m3(code) * scale, one fp32 scale per
//              (block, slot, kv head). K codes go to shared memory exactly and the K scale
//              multiplies the scores of its token; V is dequantized on the way into shared memory.
//   kInt8Kivi  KIVI int8: k/v cache hold uint8 codes, x = code * scale + zero (fp16 scale and
//              zero). K: per (block, kv head, channel) and only for closed blocks; a block with
//              k_open_slot[block] >= 0 has its K in k_open[slot] (query dtype). V: per (block,
//              slot, kv head, group of kKiviVGroup channels). Both dequantized into shared memory.
// The numbers are the kv_format argument of the binding (kvserve/kernels/cuda_ext.py KV_FORMATS).
enum class KvFormat : int { kDense = 0, kFp8E4m3 = 1, kInt8Kivi = 2 };

constexpr int kKiviVGroup = 64;  // V channels sharing one scale and zero (head_dim 64 and 128)

// One packed varlen batch. Layouts (element strides; the last dim is contiguous everywhere):
//   q, out     [num_tokens, num_heads, head_dim]
//   k/v cache  [num_blocks, block_size, num_kv_heads, head_dim]
//   block_tables [num_seqs, max_blocks] int32; query_start_loc [num_seqs + 1]; seq_lens [num_seqs]
//   o_part     [num_tokens, num_heads, num_splits, head_dim] fp32 (only when num_splits > 1)
//   lse_part   [num_tokens, num_heads, num_splits] fp32, log2 units (only when num_splits > 1)
//   8-bit pools (KvFormat above): k/v cache hold uint8 codes (strides in bytes), and k_scale /
//   k_zero are read at block * ks_stride_block + slot * ks_stride_slot + kv_head * ks_stride_head
//   (+ channel for int8 K), v_scale / v_zero likewise with vs_* (+ channel group for int8 V);
//   ks_stride_slot = 0 for KIVI's per-block K. fp8: k/v scale fp32 [num_blocks, block_size, H_kv],
//   no zero. int8: k scale/zero fp16 [num_blocks, H_kv, D] (contiguous channels), v scale/zero fp16
//   [num_blocks, block_size, H_kv, D / kKiviVGroup]; k_open [capacity, block_size, H_kv, D] in the
//   query dtype (strides ko_*), k_open_slot [num_blocks] int32.
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
  KvFormat kv_format;  // kDense unless the pool is 8-bit; the fields below are for 8-bit pools only
  const void* k_scale;
  const void* k_zero;  // int8 only
  const void* v_scale;
  const void* v_zero;  // int8 only
  int64_t ks_stride_block, ks_stride_slot, ks_stride_head;  // k_scale and k_zero
  int64_t vs_stride_block, vs_stride_slot, vs_stride_head;  // v_scale and v_zero
  const void* k_open;            // int8 only
  const int32_t* k_open_slot;    // int8 only
  int64_t ko_stride_block, ko_stride_slot, ko_stride_head;  // k_open
  int num_seqs, num_heads, num_kv_heads, head_dim, block_size;
  int max_query_len;     // launch grid: row tiles cover max_query_len * group packed rows
  int num_splits;        // split-KV: 1 writes `out` directly, > 1 writes o_part / lse_part
  int tokens_per_split;  // multiple of the kernel's KV tile (64)
  float scale_log2;      // softmax scale * log2(e)
};

// FlashAttention-2 forward over the paged pool in format p.kv_format; `decode_config` picks one-warp
// CTAs (16 packed rows) for steps whose sequences have few query rows. Returns the launch error, if
// any (cudaErrorInvalidValue for a format without its operands).
cudaError_t launch_paged_attention(const PagedAttentionParams& p, DType dtype, bool decode_config,
                                   cudaStream_t stream);

// Merges the num_splits partials of every (token, head) into `out`.
cudaError_t launch_merge_splits(const PagedAttentionParams& p, int num_tokens, DType dtype,
                                cudaStream_t stream);

constexpr int kKvTile = 64;  // KV tokens per tile; tokens_per_split must be a multiple of it

}  // namespace kvserve

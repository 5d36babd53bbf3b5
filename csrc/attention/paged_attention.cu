// FlashAttention-2 forward over a paged KV pool, with GQA row packing and optional split-KV.
//
// Grid (row tiles, num_seqs * num_kv_heads, num_splits); NUM_WARPS warps per CTA, 16 packed rows each.
// GQA packing: for one sequence and one kv head the CTA's rows are (query row, head in group) pairs,
//   packed row r -> query row r / group, head kv_head * group + r % group,
// so each K/V tile in shared memory serves every query head that reads it (decode: the whole group
// in one 16-row warp). Per KV tile of kKvTile tokens: S = Q K^T on tensor cores (mma.sync m16n8k16,
// fp32 accumulate, K fragments by ldmatrix), bottom-right causal + length mask on the tiles that
// cross a horizon, online softmax in registers (exp2, scale folded with log2 e), P re-packed from the
// S accumulators into A fragments, O += P V (V fragments by transposed ldmatrix). K and V have one
// shared-memory buffer each, loaded one phase ahead: V(tile) while S is computed, K(next) while
// O += P V runs (cp.async for dense pools). Row tiles run longest-first (causal rows near the end
// see the most KV).
// KV formats (KvFormat, a template parameter): K/V tiles reach shared memory in the query dtype
// from dense or 8-bit pools, read in place (kv_tile.cuh); for fp8 the K scale of each token
// multiplies its scores in fp32 (ks_smem), everything else is dequantized by the tile loads.
// Split z covers KV [z * tokens_per_split, (z + 1) * tokens_per_split); with one split the CTA writes
// the output, else fp32 partials + log2-sum-exp for merge_splits.cu.
#include <math.h>

#include "kv_tile.cuh"
#include "mma.cuh"
#include "paged_attention.h"

namespace kvserve {
namespace {

// Starts loading KV positions [tile_start, tile_start + kKvTile) into smem (load_kv_tile's layout and
// zero fill): dense pools by cp.async (complete after cp_async_wait_all), 8-bit pools by converting
// in registers and storing (complete at once). Every thread of the CTA takes part.
template <typename T, int HEAD_DIM, KvFormat FMT, bool IS_K>
__device__ __forceinline__ void issue_kv_tile(T* smem, float* scale_smem, const KvSource& src,
                                              const int32_t* table, int block_size, int tile_start,
                                              int tile_end) {
  if constexpr (FMT == KvFormat::kDense) {
    constexpr int kChunks = HEAD_DIM / 8;
    const T* values = static_cast<const T*>(src.data);
    for (int i = threadIdx.x; i < kKvTile * kChunks; i += blockDim.x) {
      const int row = i / kChunks, chunk = i % kChunks;
      const int pos = tile_start + row;
      const T* from = values;  // read nothing past tile_end, but name a valid address
      if (pos < tile_end) {
        from = values + (int64_t)table[pos / block_size] * src.stride_block + (pos % block_size) * src.stride_slot +
               chunk * 8;
      }
      cp_async_16(smem + row * (HEAD_DIM + kPad) + chunk * 8, from, pos < tile_end ? 16 : 0);
    }
    cp_async_commit();
  } else {
    load_kv_tile<T, HEAD_DIM, FMT, IS_K>(smem, scale_smem, src, table, block_size, tile_start, tile_end,
                                         threadIdx.x, blockDim.x);
  }
}

template <typename T, int HEAD_DIM, int NUM_WARPS, KvFormat FMT>
__global__ void __launch_bounds__(NUM_WARPS * 32) paged_attention_kernel(const PagedAttentionParams p) {
  using Traits = TypeTraits<T>;
  constexpr int kRows = NUM_WARPS * 16;
  constexpr int kStride = HEAD_DIM + kPad;
  constexpr int kDSteps = HEAD_DIM / 16;  // k-steps of Q K^T
  constexpr int kNTiles = kKvTile / 8;    // 8-token n-tiles of S
  constexpr int kDTiles = HEAD_DIM / 8;   // 8-wide n-tiles of O
  __shared__ __align__(16) T k_smem[kKvTile * kStride];
  __shared__ __align__(16) T v_smem[kKvTile * kStride];
  constexpr bool kFoldKScale = FMT == KvFormat::kFp8E4m3;  // per-token K scale applied to the scores
  __shared__ float ks_smem[kFoldKScale ? kKvTile : 1];     // [row of the tile]: K scale, 0 past kv_end

  const int seq = blockIdx.y / p.num_kv_heads;
  const int kv_head = blockIdx.y % p.num_kv_heads;
  const int split = blockIdx.z;
  const int group = p.num_heads / p.num_kv_heads;
  const int q_start = p.query_start_loc[seq];
  const int q_len = p.query_start_loc[seq + 1] - q_start;
  const int packed_rows = q_len * group;
  const int row0 = (gridDim.x - 1 - blockIdx.x) * kRows;  // the longest causal rows start first
  if (row0 >= packed_rows) return;  // uniform over the CTA
  const int seq_len = p.seq_lens[seq];
  const int ctx_len = seq_len - q_len;
  // KV range of this CTA: its split, cut at the horizon of its last query row
  const int last_q_row = min(q_len - 1, (row0 + kRows - 1) / group);
  const int kv_start = split * p.tokens_per_split;
  const int kv_end = min(min(seq_len, ctx_len + last_q_row + 1), kv_start + p.tokens_per_split);

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  int q_row[2], head[2];  // [0]: packed row g of the warp's 16, [1]: row g + 8
  bool row_ok[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int r = row0 + warp * 16 + g + i * 8;
    row_ok[i] = r < packed_rows;
    const int rr = row_ok[i] ? r : packed_rows - 1;  // padding rows mirror the last real row
    q_row[i] = rr / group;
    head[i] = kv_head * group + rr % group;
  }

  uint32_t q_frag[kDSteps][4];  // A fragments of Q, loaded once
  const T* q_ptr = static_cast<const T*>(p.q);
#pragma unroll
  for (int ks = 0; ks < kDSteps; ++ks) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int w = i & 1;  // a[0], a[2]: row g; a[1], a[3]: row g + 8
      const int col = ks * 16 + 2 * t + (i >= 2 ? 8 : 0);
      const T* src = q_ptr + (int64_t)(q_start + q_row[w]) * p.q_stride_token +
                     (int64_t)head[w] * p.q_stride_head + col;
      q_frag[ks][i] = row_ok[w] ? *reinterpret_cast<const uint32_t*>(src) : 0u;
    }
  }

  float o_acc[kDTiles][4];
#pragma unroll
  for (int dt = 0; dt < kDTiles; ++dt) o_acc[dt][0] = o_acc[dt][1] = o_acc[dt][2] = o_acc[dt][3] = 0.f;
  float row_max[2] = {-INFINITY, -INFINITY};
  float row_sum[2] = {0.f, 0.f};  // per-thread partial sums; quad-reduced at the end
  const int32_t* table = p.block_tables + (int64_t)seq * p.block_table_stride;
  const KvSource k_src = make_kv_source<T, FMT, true>(p, kv_head);
  const KvSource v_src = make_kv_source<T, FMT, false>(p, kv_head);

  // Two tiles in flight: V(tile) loads while S = Q K(tile)^T is computed, K(next) while O += P V(tile).
  // Dense pools copy with cp.async; 8-bit pools convert in registers and store (issue_kv_tile).
  const int first_q_row = row0 / group;  // every row of the CTA sees at least [0, ctx_len + first_q_row]
  if (kv_start < kv_end) {
    issue_kv_tile<T, HEAD_DIM, FMT, true>(k_smem, ks_smem, k_src, table, p.block_size, kv_start, kv_end);
  }
  for (int tile = kv_start; tile < kv_end; tile += kKvTile) {
    cp_async_wait_all();
    __syncthreads();  // K(tile) is in; every warp is done with V(previous tile)
    issue_kv_tile<T, HEAD_DIM, FMT, false>(v_smem, nullptr, v_src, table, p.block_size, tile, kv_end);

    float s[kNTiles][4];  // S = Q K^T for the warp's 16 rows x kKvTile positions
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt) {
      s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
#pragma unroll
      for (int ks = 0; ks < kDSteps; ks += 2) {  // one ldmatrix: B of k-steps ks and ks + 1
        uint32_t b[4];
        ldmatrix_x4(b, k_smem + (nt * 8 + lane % 8) * kStride + ks * 16 + (lane / 8) * 8);
        Traits::mma(s[nt], q_frag[ks], {b[0], b[1]});
        Traits::mma(s[nt], q_frag[ks + 1], {b[2], b[3]});
      }
    }

    // masks only where the tile crosses kv_end or some row's causal horizon (uniform over the CTA)
    const bool masked = tile + kKvTile > kv_end || tile + kKvTile - 1 > ctx_len + first_q_row;
    float tile_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int w = e / 2;  // c[0], c[1]: row g; c[2], c[3]: row g + 8
        const int col = nt * 8 + 2 * t + (e & 1);  // c[e] holds column 2t + (e & 1) of n-tile nt
        const int pos = tile + col;
        const bool visible = !masked || (pos < kv_end && pos <= ctx_len + q_row[w]);
        float col_scale = p.scale_log2;
        if constexpr (kFoldKScale) col_scale *= ks_smem[col];  // S = Q codes^T, times the K scale
        s[nt][e] = visible ? s[nt][e] * col_scale : -INFINITY;
        tile_max[w] = fmaxf(tile_max[w], s[nt][e]);
      }
    }
    float m_use[2];  // row max, or 0 while a row has seen nothing (keeps exp2 free of NaN)
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const float m_new = fmaxf(row_max[i], quad_max(tile_max[i]));
      m_use[i] = m_new == -INFINITY ? 0.f : m_new;
      const float alpha = exp2f(row_max[i] - m_use[i]);
      row_max[i] = m_new;
      row_sum[i] *= alpha;
#pragma unroll
      for (int dt = 0; dt < kDTiles; ++dt) {
        o_acc[dt][2 * i] *= alpha;
        o_acc[dt][2 * i + 1] *= alpha;
      }
    }

    cp_async_wait_all();
    __syncthreads();  // V(tile) is in; every warp is done with K(tile) and its scales
    if (tile + kKvTile < kv_end) {
      issue_kv_tile<T, HEAD_DIM, FMT, true>(k_smem, ks_smem, k_src, table, p.block_size, tile + kKvTile, kv_end);
    }

#pragma unroll
    for (int kk = 0; kk < kKvTile / 16; ++kk) {
      uint32_t a[4];  // P for positions [16 kk, 16 kk + 16): the C fragments of n-tiles 2kk, 2kk+1
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float* sv = s[2 * kk + h];
        const float p0 = exp2f(sv[0] - m_use[0]), p1 = exp2f(sv[1] - m_use[0]);
        const float p2 = exp2f(sv[2] - m_use[1]), p3 = exp2f(sv[3] - m_use[1]);
        row_sum[0] += p0 + p1;
        row_sum[1] += p2 + p3;
        a[2 * h] = Traits::pack(p0, p1);
        a[2 * h + 1] = Traits::pack(p2, p3);
      }
#pragma unroll
      for (int dt = 0; dt < kDTiles; dt += 2) {  // one transposed ldmatrix: B of n-tiles dt and dt + 1
        uint32_t b[4];
        const int row = kk * 16 + lane % 8 + ((lane / 8) % 2) * 8;
        ldmatrix_x4_trans(b, v_smem + row * kStride + dt * 8 + (lane / 16) * 8);
        Traits::mma(o_acc[dt], a, {b[0], b[1]});
        Traits::mma(o_acc[dt + 1], a, {b[2], b[3]});
      }
    }
  }

#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const float sum = quad_sum(row_sum[i]);
    if (!row_ok[i]) continue;
    const float inv = sum > 0.f ? 1.f / sum : 0.f;
    const int64_t token = q_start + q_row[i];
    if (p.num_splits == 1) {
      T* dst = static_cast<T*>(p.out) + token * p.o_stride_token + (int64_t)head[i] * p.o_stride_head + 2 * t;
#pragma unroll
      for (int dt = 0; dt < kDTiles; ++dt) {
        *reinterpret_cast<uint32_t*>(dst + dt * 8) = Traits::pack(o_acc[dt][2 * i] * inv, o_acc[dt][2 * i + 1] * inv);
      }
    } else {
      const int64_t part = (token * p.num_heads + head[i]) * p.num_splits + split;
      if (t == 0) p.lse_part[part] = sum > 0.f ? row_max[i] + log2f(sum) : -INFINITY;
      float* dst = p.o_part + part * HEAD_DIM + 2 * t;
#pragma unroll
      for (int dt = 0; dt < kDTiles; ++dt) {
        *reinterpret_cast<float2*>(dst + dt * 8) = make_float2(o_acc[dt][2 * i] * inv, o_acc[dt][2 * i + 1] * inv);
      }
    }
  }
}

template <typename T, int HEAD_DIM, int NUM_WARPS, KvFormat FMT>
cudaError_t launch(const PagedAttentionParams& p, cudaStream_t stream) {
  const int group = p.num_heads / p.num_kv_heads;
  const int rows = NUM_WARPS * 16;
  const dim3 grid((p.max_query_len * group + rows - 1) / rows, p.num_seqs * p.num_kv_heads, p.num_splits);
  paged_attention_kernel<T, HEAD_DIM, NUM_WARPS, FMT><<<grid, NUM_WARPS * 32, 0, stream>>>(p);
  return cudaGetLastError();
}

template <typename T, int HEAD_DIM, KvFormat FMT>
cudaError_t launch_warps(const PagedAttentionParams& p, bool decode_config, cudaStream_t stream) {
  return decode_config ? launch<T, HEAD_DIM, 1, FMT>(p, stream) : launch<T, HEAD_DIM, 4, FMT>(p, stream);
}

template <typename T, KvFormat FMT>
cudaError_t launch_head_dim(const PagedAttentionParams& p, bool decode_config, cudaStream_t stream) {
  switch (p.head_dim) {
    case 64: return launch_warps<T, 64, FMT>(p, decode_config, stream);
    case 128: return launch_warps<T, 128, FMT>(p, decode_config, stream);
    default: return cudaErrorInvalidValue;
  }
}

template <typename T>
cudaError_t launch_format(const PagedAttentionParams& p, bool decode_config, cudaStream_t stream) {
  switch (p.kv_format) {
    case KvFormat::kDense: return launch_head_dim<T, KvFormat::kDense>(p, decode_config, stream);
    case KvFormat::kFp8E4m3: return launch_head_dim<T, KvFormat::kFp8E4m3>(p, decode_config, stream);
    case KvFormat::kInt8Kivi: return launch_head_dim<T, KvFormat::kInt8Kivi>(p, decode_config, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace

cudaError_t launch_paged_attention(const PagedAttentionParams& p, DType dtype, bool decode_config,
                                   cudaStream_t stream) {
  if (p.num_seqs == 0 || p.max_query_len == 0) return cudaSuccess;
  if (p.num_kv_heads <= 0 || p.num_heads % p.num_kv_heads != 0) return cudaErrorInvalidValue;
  if (p.num_splits < 1 || (p.num_splits > 1 && (p.o_part == nullptr || p.lse_part == nullptr))) {
    return cudaErrorInvalidValue;
  }
  if (p.kv_format != KvFormat::kDense && (p.k_scale == nullptr || p.v_scale == nullptr)) {
    return cudaErrorInvalidValue;
  }
  if (p.kv_format == KvFormat::kInt8Kivi &&
      (p.k_zero == nullptr || p.v_zero == nullptr || p.k_open_slot == nullptr || p.head_dim % kKiviVGroup != 0)) {
    return cudaErrorInvalidValue;
  }
  return dtype == DType::kFloat16 ? launch_format<__half>(p, decode_config, stream)
                                  : launch_format<__nv_bfloat16>(p, decode_config, stream);
}

}  // namespace kvserve

// K/V tile loads of paged_attention.cu for every KvFormat: KV positions [tile_start, tile_start +
// kKvTile) of one kv head -> shared memory [kKvTile][HEAD_DIM + kPad] in the query dtype T, read
// through the block table straight from the pool (no dense copy). Each thread takes 8-channel chunks
// (one 16-byte smem store of 8 T): dense pools load them with one 16-byte load, 8-bit pools with one
// 8-byte load of codes, then convert in registers:
//   fp8 K      e4m3 codes -> T exactly (every e4m3 value is an fp16 and a bf16 value); the token's
//              fp32 scale goes to scale_smem[row] and the kernel multiplies it into that token's
//              scores (fp32), so K is never rounded after dequantization.
//   fp8 V      e4m3(code) * scale in fp32, rounded once to T. (Folding the V scale into the
//              probabilities instead, as the Triton decode kernel does, would push P * scale into
//              fp16 subnormals when V is small.)
//   int8 K     block with an open-K shadow (k_open_slot[block] >= 0): its 16-byte row of k_open,
//              else code * scale[channel] + zero[channel] of the block, in fp32, rounded to T.
//   int8 V     code * scale + zero of the token's channel group, in fp32, rounded to T.
// Everything here is __host__ __device__ and takes the thread index as an argument, so that
// tests/kernels/test_cuda_ext.py builds it for the CPU and checks it against kvserve's decoders.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include <type_traits>

#include "mma.cuh"
#include "paged_attention.h"

#define KVSERVE_HD __host__ __device__ __forceinline__

namespace kvserve {

constexpr int kPad = 8;  // smem row padding in elements: spreads rows over banks, keeps 16 B alignment

// e4m3fn code (bits 0..7 of c) -> its exact value with integer ops (sm_80 has no fp8 type): sign to
// bit 15, exponent|mantissa to bits 7..13 of an fp16, then x 2^8 for the exponent bias (7 vs 15).
// e4m3 subnormals land on fp16 subnormals and come out exact too. The NaN codes (0x7F, 0xFF; never
// written, kvserve/quant/fp8.py saturates) decode to 480 instead.
KVSERVE_HD float e4m3_to_float(uint32_t c) {
  const unsigned short bits = static_cast<unsigned short>(((c & 0x80u) << 8) | ((c & 0x7Fu) << 7));
  return __half2float(__ushort_as_half(bits)) * 256.f;
}

// Byte j (0..7) of 8 codes loaded as one uint2 (little-endian: channel j of the chunk).
KVSERVE_HD uint32_t code_byte(const uint2& codes, int j) {
  return ((j < 4 ? codes.x : codes.y) >> (8 * (j & 3))) & 0xFFu;
}

template <typename T>
KVSERVE_HD uint4 pack8(const float (&x)[8]) {
  using Traits = TypeTraits<T>;
  return make_uint4(Traits::pack(x[0], x[1]), Traits::pack(x[2], x[3]), Traits::pack(x[4], x[5]),
                    Traits::pack(x[6], x[7]));
}

// One side (K or V) of one kv head of the pool. Strides in elements of the pointed-to type.
struct KvSource {
  const void* data;  // values (kDense: T) or codes (uint8), offset to the kv head
  int64_t stride_block, stride_slot;
  const void* scale;  // fp8: fp32, int8: fp16; offset to the kv head (8-bit formats only)
  const void* zero;   // int8 only
  int64_t s_stride_block, s_stride_slot;  // scale and zero; s_stride_slot = 0 for int8 K (per block)
  const void* open;                       // int8 K only: T, offset to the kv head
  const int32_t* open_slot;               // int8 K only: [num_blocks]
  int64_t o_stride_block, o_stride_slot;
};

template <typename T, KvFormat FMT, bool IS_K>
KVSERVE_HD KvSource make_kv_source(const PagedAttentionParams& p, int kv_head) {
  using Code = typename std::conditional<FMT == KvFormat::kDense, T, uint8_t>::type;
  KvSource s{};
  s.data = static_cast<const Code*>(IS_K ? p.k_cache : p.v_cache) +
           (int64_t)kv_head * (IS_K ? p.k_stride_head : p.v_stride_head);
  s.stride_block = IS_K ? p.k_stride_block : p.v_stride_block;
  s.stride_slot = IS_K ? p.k_stride_slot : p.v_stride_slot;
  if constexpr (FMT != KvFormat::kDense) {
    using Scale = typename std::conditional<FMT == KvFormat::kFp8E4m3, float, __half>::type;
    const int64_t head_offset = (int64_t)kv_head * (IS_K ? p.ks_stride_head : p.vs_stride_head);
    s.scale = static_cast<const Scale*>(IS_K ? p.k_scale : p.v_scale) + head_offset;
    if constexpr (FMT == KvFormat::kInt8Kivi) {
      s.zero = static_cast<const Scale*>(IS_K ? p.k_zero : p.v_zero) + head_offset;
    }
    s.s_stride_block = IS_K ? p.ks_stride_block : p.vs_stride_block;
    s.s_stride_slot = IS_K ? p.ks_stride_slot : p.vs_stride_slot;
  }
  if constexpr (FMT == KvFormat::kInt8Kivi && IS_K) {
    s.open = static_cast<const T*>(p.k_open) + (int64_t)kv_head * p.ko_stride_head;
    s.open_slot = p.k_open_slot;
    s.o_stride_block = p.ko_stride_block;
    s.o_stride_slot = p.ko_stride_slot;
  }
  return s;
}

// Channels [8 chunk, 8 chunk + 8) of (block, slot) as 8 T (fp8 K: the unscaled codes).
template <typename T, KvFormat FMT, bool IS_K>
KVSERVE_HD uint4 load_chunk(const KvSource& src, int64_t block, int slot, int chunk) {
  if constexpr (FMT == KvFormat::kDense) {
    const T* values = static_cast<const T*>(src.data) + block * src.stride_block + slot * src.stride_slot;
    return *reinterpret_cast<const uint4*>(values + chunk * 8);
  } else {
    if constexpr (FMT == KvFormat::kInt8Kivi && IS_K) {
      const int32_t open = src.open_slot[block];
      if (open >= 0) {  // the block's K is still open: full precision, no codes yet
        const T* values = static_cast<const T*>(src.open) + open * src.o_stride_block + slot * src.o_stride_slot;
        return *reinterpret_cast<const uint4*>(values + chunk * 8);
      }
    }
    const uint8_t* row = static_cast<const uint8_t*>(src.data) + block * src.stride_block + slot * src.stride_slot;
    const uint2 codes = *reinterpret_cast<const uint2*>(row + chunk * 8);
    const int64_t at = block * src.s_stride_block + slot * src.s_stride_slot;  // the kv head's scale row
    float x[8];
    if constexpr (FMT == KvFormat::kFp8E4m3) {
      // K: exact codes, the scale is applied to the scores; V: dequantized here
      const float scale = IS_K ? 1.f : static_cast<const float*>(src.scale)[at];
#pragma unroll
      for (int j = 0; j < 8; ++j) x[j] = e4m3_to_float(code_byte(codes, j)) * scale;
    } else if constexpr (IS_K) {  // int8 K of a closed block: scale and zero per channel of the block
      const uint4 s4 = *reinterpret_cast<const uint4*>(static_cast<const __half*>(src.scale) + at + chunk * 8);
      const uint4 z4 = *reinterpret_cast<const uint4*>(static_cast<const __half*>(src.zero) + at + chunk * 8);
      const uint32_t sw[4] = {s4.x, s4.y, s4.z, s4.w}, zw[4] = {z4.x, z4.y, z4.z, z4.w};
#pragma unroll
      for (int w = 0; w < 4; ++w) {
        const float2 s2 = TypeTraits<__half>::unpack(sw[w]), z2 = TypeTraits<__half>::unpack(zw[w]);
        x[2 * w] = static_cast<float>(code_byte(codes, 2 * w)) * s2.x + z2.x;
        x[2 * w + 1] = static_cast<float>(code_byte(codes, 2 * w + 1)) * s2.y + z2.y;
      }
    } else {  // int8 V: scale and zero per token and group of kKiviVGroup channels
      static_assert(kKiviVGroup % 8 == 0, "a chunk of 8 channels must sit in one group");
      const int64_t group = chunk * 8 / kKiviVGroup;
      const float scale = __half2float(static_cast<const __half*>(src.scale)[at + group]);
      const float zero = __half2float(static_cast<const __half*>(src.zero)[at + group]);
#pragma unroll
      for (int j = 0; j < 8; ++j) x[j] = static_cast<float>(code_byte(codes, j)) * scale + zero;
    }
    return pack8<T>(x);
  }
}

// KV positions [tile_start, tile_start + kKvTile) -> smem [kKvTile][HEAD_DIM + kPad] in T; thread
// `tid` of `num_threads` takes chunks tid, tid + num_threads, ... Positions at or past `tile_end`
// are zero-filled: pool slots past seq_len hold arbitrary bits. fp8 K also writes each row's scale
// to scale_smem[row] (0 past tile_end); scale_smem is unused otherwise.
template <typename T, int HEAD_DIM, KvFormat FMT, bool IS_K>
KVSERVE_HD void load_kv_tile(T* smem, float* scale_smem, const KvSource& src, const int32_t* table,
                             int block_size, int tile_start, int tile_end, int tid, int num_threads) {
  constexpr int kChunks = HEAD_DIM / 8;  // 8-channel chunks per token row
  for (int i = tid; i < kKvTile * kChunks; i += num_threads) {
    const int row = i / kChunks, chunk = i % kChunks;
    const int pos = tile_start + row;
    uint4 value = make_uint4(0u, 0u, 0u, 0u);
    float row_scale = 0.f;
    if (pos < tile_end) {
      const int64_t block = table[pos / block_size];
      const int slot = pos % block_size;
      value = load_chunk<T, FMT, IS_K>(src, block, slot, chunk);
      if constexpr (FMT == KvFormat::kFp8E4m3 && IS_K) {
        if (chunk == 0) {
          row_scale = static_cast<const float*>(src.scale)[block * src.s_stride_block + slot * src.s_stride_slot];
        }
      }
    }
    *reinterpret_cast<uint4*>(smem + row * (HEAD_DIM + kPad) + chunk * 8) = value;
    if constexpr (FMT == KvFormat::kFp8E4m3 && IS_K) {
      if (chunk == 0) scale_smem[row] = row_scale;
    }
  }
}

}  // namespace kvserve

// KV formats as the CPU attention kernel reads them in place: a `Reader` per format hands the kernel
// fp32 rows of one (block, KV head). Dense fp32 rows are used where they lie; bf16 / fp16, fp8_e4m3
// and int8 KIVI are converted into a block-sized scratch (fp8's per-token scale is folded into the
// score and the probability instead). Layouts: kvserve/quant/ and kvserve/kernels/paged_kv.py.
//
// A Reader's result for a block depends on that block's bytes only: the same tokens convert to the
// same floats whichever call, row or thread reads them.
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "vec.h"

namespace kvserve_cpu {

template <typename T>
inline void to_float(const T* src, float* dst, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

// kLanes bytes -> int32 lanes (intrinsics: GCC's generic convertvector of a byte vector is a scalar mess)
inline vi widen_u8(const uint8_t* p) {
#if defined(__AVX512F__)
  return reinterpret_cast<vi>(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#elif defined(__AVX2__)
  return reinterpret_cast<vi>(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
#else
  vi out;
  for (int i = 0; i < kLanes; ++i) out[i] = p[i];
  return out;
#endif
}

// kLanes e4m3fn codes -> floats with integer operations: the code's exponent and mantissa bits are
// placed at fp32's bit 20, which reads as 2^(e - 127) (1 + m/8) (or m 2^-129 for e = 0), and a multiply
// by 2^120 rebiases that to e4m3's 2^(e - 7) (1 + m/8) (or m 2^-9: subnormals come out right too).
// 0x7f / 0xff are NaN as in float8_e4m3fn. Exact: every e4m3 value is an fp32 value.
inline vf e4m3_to_float(const uint8_t* codes) {
  const vi c = widen_u8(codes);
  const vi bits = ((c & 0x80) << 24) | ((c & 0x7f) << 20);
  vf f;
  std::memcpy(&f, &bits, sizeof(vf));
  f = f * 0x1p120f;
  return (c & 0x7f) == 0x7f ? splat(std::numeric_limits<float>::quiet_NaN()) : f;
}

// Asks for the cache lines [p, p + bytes) ahead of use (the kernel prefetches the next step's blocks).
inline void prefetch_bytes(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(c + i);
}

// Prefetches head h's rows of the first n tokens of `block` in K and V pools laid out
// [num_blocks, block_size, H_kv, D] (values or codes).
template <typename T>
inline void prefetch_head_rows(const T* k, const T* v, int64_t block, int64_t h, int64_t n,
                               int64_t block_size, int64_t h_kv, int64_t d) {
  const int64_t first = (block * block_size * h_kv + h) * d, stride = h_kv * d;
  for (int64_t t = 0; t < n; ++t) {
    prefetch_bytes(k + first + t * stride, d * sizeof(T));
    prefetch_bytes(v + first + t * stride, d * sizeof(T));
  }
}

// The fp32 rows of one (block, KV head): row t of K at k + t * stride (same for V), and optional
// per-token multipliers (null = 1): score_t = q.k_t * k_mult[t], and p_t * v_mult[t] weighs v_t.
struct BlockRows {
  const float* k;
  const float* v;
  int64_t stride;
  const float* k_mult;
  const float* v_mult;
};

// Scratch a Reader converts rows into: [block_size, D] each, plus multipliers.
struct Scratch {
  std::vector<float> k, v, k_mult, v_mult;
  Scratch(int64_t block_size, int64_t d) : k(block_size * d), v(block_size * d), k_mult(block_size), v_mult(block_size) {}
};

template <typename T>
struct DenseReader {
  const T* k;
  const T* v;  // [num_blocks, block_size, H_kv, D]
  int64_t block_size, h_kv, d;

  void prefetch(int64_t block, int64_t h, int64_t n) const {
    prefetch_head_rows(k, v, block, h, n, block_size, h_kv, d);
  }

  BlockRows rows(int64_t block, int64_t h, int64_t n, Scratch& sc) const {
    const int64_t first = (block * block_size * h_kv + h) * d, stride = h_kv * d;
    if constexpr (std::is_same_v<T, float>) {
      return {k + first, v + first, stride, nullptr, nullptr};
    } else {
      for (int64_t t = 0; t < n; ++t) {
        to_float(k + first + t * stride, sc.k.data() + t * d, d);
        to_float(v + first + t * stride, sc.v.data() + t * d, d);
      }
      return {sc.k.data(), sc.v.data(), d, nullptr, nullptr};
    }
  }
};

struct Fp8Reader {
  const uint8_t* k_codes;  // [num_blocks, block_size, H_kv, D]
  const uint8_t* v_codes;
  const float* k_scale;  // [num_blocks, block_size, H_kv]
  const float* v_scale;
  int64_t block_size, h_kv, d;

  void prefetch(int64_t block, int64_t h, int64_t n) const {
    prefetch_head_rows(k_codes, v_codes, block, h, n, block_size, h_kv, d);
  }

  BlockRows rows(int64_t block, int64_t h, int64_t n, Scratch& sc) const {
    for (int64_t t = 0; t < n; ++t) {
      const int64_t token_head = (block * block_size + t) * h_kv + h;
      const uint8_t* kc = k_codes + token_head * d;
      const uint8_t* vc = v_codes + token_head * d;
      float* kd = sc.k.data() + t * d;
      float* vd = sc.v.data() + t * d;
      for (int64_t i = 0; i < d; i += kLanes) {
        storeu(kd + i, e4m3_to_float(kc + i));
        storeu(vd + i, e4m3_to_float(vc + i));
      }
      sc.k_mult[t] = k_scale[token_head];
      sc.v_mult[t] = v_scale[token_head];
    }
    return {sc.k.data(), sc.v.data(), d, sc.k_mult.data(), sc.v_mult.data()};
  }
};

// int8 KIVI: x = code * scale + zero. K: scale / zero per (block, head, channel); a block still open
// has its K in full precision in shadow[slot_of_block[block]]. V: per (token, head, channel group).
template <typename S>  // the shadow pool's dtype (the compute dtype)
struct Int8KiviReader {
  const uint8_t* k_codes;  // [num_blocks, block_size, H_kv, D]
  const at::Half* k_scale;  // [num_blocks, H_kv, D]
  const at::Half* k_zero;
  const S* shadow;  // [capacity, block_size, H_kv, D]
  const int32_t* slot_of_block;  // [num_blocks], -1 = closed
  const uint8_t* v_codes;  // [num_blocks, block_size, H_kv, D]
  const at::Half* v_scale;  // [num_blocks, block_size, H_kv, D / group]
  const at::Half* v_zero;
  int64_t block_size, h_kv, d, group;

  void prefetch(int64_t block, int64_t h, int64_t n) const {
    prefetch_head_rows(k_codes, v_codes, block, h, n, block_size, h_kv, d);
  }

  BlockRows rows(int64_t block, int64_t h, int64_t n, Scratch& sc) const {
    const int64_t stride = h_kv * d;
    const int64_t slot = slot_of_block[block];
    if (slot >= 0) {
      const S* src = shadow + (slot * block_size * h_kv + h) * d;
      for (int64_t t = 0; t < n; ++t) to_float(src + t * stride, sc.k.data() + t * d, d);
    } else {
      float ks[256], kz[256];  // d <= 256
      to_float(k_scale + (block * h_kv + h) * d, ks, d);
      to_float(k_zero + (block * h_kv + h) * d, kz, d);
      for (int64_t t = 0; t < n; ++t) {
        const uint8_t* c = k_codes + (block * block_size * h_kv + h) * d + t * stride;
        float* dst = sc.k.data() + t * d;
#pragma omp simd
        for (int64_t i = 0; i < d; ++i) dst[i] = static_cast<float>(c[i]) * ks[i] + kz[i];
      }
    }
    const int64_t groups = d / group;
    for (int64_t t = 0; t < n; ++t) {
      const int64_t token_head = (block * block_size + t) * h_kv + h;
      const uint8_t* c = v_codes + token_head * d;
      float* dst = sc.v.data() + t * d;
      for (int64_t gi = 0; gi < groups; ++gi) {
        const float s = static_cast<float>(v_scale[token_head * groups + gi]);
        const float z = static_cast<float>(v_zero[token_head * groups + gi]);
#pragma omp simd
        for (int64_t i = gi * group; i < (gi + 1) * group; ++i) dst[i] = static_cast<float>(c[i]) * s + z;
      }
    }
    return {sc.k.data(), sc.v.data(), d, nullptr, nullptr};
  }
};

}  // namespace kvserve_cpu

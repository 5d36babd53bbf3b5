// The arithmetic of the CPU attention kernel (csrc/cpu/paged_attention_cpu.cpp), one online-softmax
// step at a time. A "lane" is one (query row, query head); a step covers `sp` consecutive KV tokens
// (a multiple of 4 * kLanes) whose K is transposed into kt [D][sp] (fp32) or kt2 [D / 2][sp] (bf16
// channel pairs), so that vector lanes are tokens. Fp32Math and Bf16Math below are the two arithmetics.
//
// Each function computes every lane with the same operations whatever the number of lanes it is
// given (the register tiles only decide which lanes share a load): that is what makes a row's result
// independent of the rows around it.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "vec.h"

namespace kvserve_cpu {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
// the bf16 arithmetic's running max is in log2 units (softmax_step_bf16; the AMX tiles' softmax_of); each
// split's end hands it on in natural ones
constexpr float kLog2e = 1.44269504088896341f, kLn2 = 0.693147180559945309f;

inline vi lane_index() {
  vi idx;
  for (int i = 0; i < kLanes; ++i) idx[i] = i;
  return idx;
}

// dst[c * dst_stride + t] = rows[t][d0 + c] for t, c < kLanes: one square tile of K transposed.
__attribute__((always_inline)) inline void transpose_tile(const float* const* rows, int64_t d0, float* dst, int64_t dst_stride) {
#if defined(__AVX512F__)
  __m512 r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(rows[i] + d0);
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    for (int j = 0; j < 2; ++j) {
      const __m512d a = _mm512_castps_pd(t[i + j]), b = _mm512_castps_pd(t[i + j + 2]);
      r[i + 2 * j] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, b));
      r[i + 2 * j + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, b));
    }
  }
  // r[4k + j] now holds, in each 128-bit lane L, rows 4k..4k+3 of column 4L + j
  for (int k = 0; k < 2; ++k) {
    for (int j = 0; j < 4; ++j) {
      t[8 * k + j] = _mm512_shuffle_f32x4(r[8 * k + j], r[8 * k + 4 + j], 0x88);
      t[8 * k + 4 + j] = _mm512_shuffle_f32x4(r[8 * k + j], r[8 * k + 4 + j], 0xdd);
    }
  }
  for (int j = 0; j < 8; ++j) {
    r[j] = _mm512_shuffle_f32x4(t[j], t[8 + j], 0x88);
    r[8 + j] = _mm512_shuffle_f32x4(t[j], t[8 + j], 0xdd);
  }
  for (int i = 0; i < 16; ++i) _mm512_storeu_ps(dst + i * dst_stride, r[i]);
#elif defined(__AVX2__)
  __m256 r[8], t[8];
  for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(rows[i] + d0);
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    r[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
    r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xee);
    r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xee);
  }
  for (int j = 0; j < 4; ++j) {
    t[j] = _mm256_permute2f128_ps(r[j], r[4 + j], 0x20);
    t[4 + j] = _mm256_permute2f128_ps(r[j], r[4 + j], 0x31);
  }
  for (int i = 0; i < 8; ++i) _mm256_storeu_ps(dst + i * dst_stride, t[i]);
#else
  for (int c = 0; c < kLanes; ++c)
    for (int t = 0; t < kLanes; ++t) dst[c * dst_stride + t] = rows[t][d0 + c];
#endif
}

// The two arithmetics of a step. Fp32Math: fp32 queries (pre-scaled), K and V, one FMA per product.
// Bf16Math (bf16 queries over a bf16 pool): operands in bf16 pairs, one dot_pairs per two products
// with fp32 sums: Q . K over channel pairs (2d, 2d + 1), the scale applied by the softmax, and P V over
// token pairs (2u, 2u + 1), with the probabilities rounded to bf16 (what a bf16 flash-attention kernel
// does); the softmax stays in fp32. `Unit` is what one multiply-add step covers: a channel / token for
// fp32, a pair for bf16.
struct Fp32Math {
  using Q = float;    // a query element
  using K = float;    // an element of transposed K: kt [D][sp]
  using P = float;    // a probability
  static constexpr int kPack = 1;
  struct V {          // token t's V row: rows[t]
    const float* const* rows;
  };
  static vf splat_q(const float* q, int64_t i) { return splat(q[i]); }
  static vf load_k(const float* kt) { return loadu(kt); }
  static vf splat_p(const float* p, int64_t t) { return splat(p[t]); }
  static vf load_v(const V& v, int64_t t, int c) { return loadu(v.rows[t] + c * kLanes); }
  static vf mac(vf acc, vf a, vf b) { return fmadd(a, b, acc); }
  static vf scaled(vf s, float) { return s; }  // q came pre-scaled
};

struct Bf16Math {
  using Q = uint32_t;  // a channel pair of the query
  using K = uint32_t;  // kt [D / 2][sp]: channel pair i of token t at kt[i * sp + t]
  using P = uint16_t;  // bf16 bits
  static constexpr int kPack = 2;
  struct V {           // [D / kLanes][stride][kLanes]: lane i of vector (c, u) = channel c * kLanes + i of tokens 2u, 2u + 1
    const uint32_t* pairs;
    int64_t stride;
  };
  static vf splat_q(const uint32_t* q, int64_t i) { return splat_pair(q[i]); }
  static vf load_k(const uint32_t* kt) { return load_pairs(kt); }
  static vf splat_p(const uint16_t* p, int64_t u) {
    uint32_t pair;
    std::memcpy(&pair, p + 2 * u, sizeof(pair));
    return splat_pair(pair);
  }
  static vf load_v(const V& v, int64_t u, int c) { return load_pairs(v.pairs + (c * v.stride + u) * kLanes); }
  static vf mac(vf acc, vf a, vf b) { return dot_pairs(acc, a, b); }
  static vf scaled(vf s, float) { return s; }  // the scale is the softmax's (softmax_step_bf16)
};

// out[j][v] = sum over the units of d in order of q_j . kt[.][v] (one chain of M::mac per score), for R
// lanes and the first nv token vectors (nv a multiple of 4).
template <int D, int R, typename M>
inline void score_tile(const typename M::Q* const* q, const typename M::K* kt, int64_t sp, int64_t nv, float scale,
                       float* const* out) {
  for (int64_t v0 = 0; v0 < nv * kLanes; v0 += 4 * kLanes) {
    vf s[R][4];
    for (int j = 0; j < R; ++j)
      for (int i = 0; i < 4; ++i) s[j][i] = vf{};
#pragma GCC unroll 4
    for (int d = 0; d < D / M::kPack; ++d) {
      vf k[4];
      for (int i = 0; i < 4; ++i) k[i] = M::load_k(kt + d * sp + v0 + i * kLanes);
      for (int j = 0; j < R; ++j) {
        const vf qd = M::splat_q(q[j], d);
        for (int i = 0; i < 4; ++i) s[j][i] = M::mac(s[j][i], qd, k[i]);
      }
    }
    for (int j = 0; j < R; ++j)
      for (int i = 0; i < 4; ++i) storeu(out[j] + v0 + i * kLanes, M::scaled(s[j][i], scale));
  }
}

// n lanes: tiles of R, then one tile of the remaining n % R (a GQA group of 3 in one pass).
template <int D, int R, typename M>
void score_lanes(const typename M::Q* const* q, const typename M::K* kt, int64_t sp, int64_t nv, float scale,
                 float* const* out, int64_t n) {
  int64_t j = 0;
  for (; j + R <= n; j += R) score_tile<D, R, M>(q + j, kt, sp, nv, scale, out + j);
  if constexpr (R > 1) {
    if (n - j == R - 1) {
      score_tile<D, R - 1, M>(q + j, kt, sp, nv, scale, out + j);
    } else if (j < n) {
      score_lanes<D, R - 1, M>(q + j, kt, sp, nv, scale, out + j, n - j);
    }
  }
}

// acc_j <- acc_j * corr_j (when corr is given), then += p_j v over the units [u0, u1) in order: one chain
// of M::mac per output element.
template <int D, int R, typename M>
inline void pv_tile(float* const* acc, const typename M::P* const* p, const float* corr, const typename M::V& v,
                    int64_t u0, int64_t u1) {
  constexpr int C = D / kLanes;
  vf a[R][C];
  for (int j = 0; j < R; ++j)
    for (int c = 0; c < C; ++c) a[j][c] = corr ? loadu(acc[j] + c * kLanes) * splat(corr[j]) : loadu(acc[j] + c * kLanes);
  for (int64_t u = u0; u < u1; ++u) {
    vf vr[C];
    for (int c = 0; c < C; ++c) vr[c] = M::load_v(v, u, c);
    for (int j = 0; j < R; ++j) {
      const vf pj = M::splat_p(p[j], u);
      for (int c = 0; c < C; ++c) a[j][c] = M::mac(a[j][c], pj, vr[c]);
    }
  }
  for (int j = 0; j < R; ++j)
    for (int c = 0; c < C; ++c) storeu(acc[j] + c * kLanes, a[j][c]);
}

template <int D, int R, typename M>
void pv_lanes(float* const* acc, const typename M::P* const* p, const float* corr, const typename M::V& v, int64_t u1,
              int64_t n) {
  int64_t j = 0;
  for (; j + R <= n; j += R) pv_tile<D, R, M>(acc + j, p + j, corr + j, v, 0, u1);
  if constexpr (R > 1) {
    if (n - j == R - 1) {
      pv_tile<D, R - 1, M>(acc + j, p + j, corr + j, v, 0, u1);
    } else if (j < n) {
      pv_lanes<D, R - 1, M>(acc + j, p + j, corr + j, v, u1, n - j);
    }
  }
}

constexpr int pv_rows(int d) { return std::max(1, std::min(8, 16 / (d / kLanes))); }

// One lane's online-softmax step over its valid tokens [first, n) of the step (scores in s, overwritten
// with the probabilities, 0 outside them, times v_mult when given): block max, rescale of (m, l), exp, sum. Returns the
// factor the lane's accumulator must be multiplied by.
inline float softmax_step(float* s, int64_t n, const float* k_mult, const float* v_mult, float& m, float& l,
                          int64_t first = 0) {
  const vi idx = lane_index();
  const int64_t nv = (n + kLanes - 1) / kLanes;
  vf mx = splat(kNegInf);
  for (int64_t v = 0; v < nv; ++v) {
    vf x = loadu(s + v * kLanes);
    if (k_mult) x = x * loadu(k_mult + v * kLanes);
    const vi at = idx + static_cast<int32_t>(v * kLanes);
    x = (at < static_cast<int32_t>(n)) & (at >= static_cast<int32_t>(first)) ? x : splat(kNegInf);
    storeu(s + v * kLanes, x);
    mx = mx > x ? mx : x;
  }
  const float new_max = std::max(m, hmax(mx));
  // the polynomial of the fp32 arithmetic's probabilities (the bf16 arithmetic has softmax_step_bf16's); on a
  // split's first step m = -inf, clamped to exp(-87) ~ 1e-38, which scales l = 0 and acc = 0
  const float correction = exp_nonpositive(splat(m - new_max))[0];
  vf sum = {};
  for (int64_t v = 0; v < nv; ++v) {
    vf e = exp_nonpositive(loadu(s + v * kLanes) - new_max);
    const vi at = idx + static_cast<int32_t>(v * kLanes);
    e = (at < static_cast<int32_t>(n)) & (at >= static_cast<int32_t>(first)) ? e : vf{};
    sum += e;
    if (v_mult) e = e * loadu(v_mult + v * kLanes);
    storeu(s + v * kLanes, e);
  }
  l = l * correction + hsum(sum);
  m = new_max;
  return correction;
}

// One lane's online-softmax step in the bf16 arithmetic, the AMX tiles' softmax (attention_amx.h
// softmax_of) one lane at a time: s holds the raw scores (q . k, unscaled) of the step's tokens, of which
// [first, n) are the lane's; m is in log2 units (the running max of score * scale2, scale2 = scale *
// log2(e)), a probability is 2^(s * scale2 - m) with one multiply-add (exp2_probability), the correction
// 2^(m_old - m_new). The step max is taken over the raw scores and scaled once (a positive scale keeps
// the order). Writes the probabilities rounded to bf16 (0 outside [first, n)) for the ceil(n / kLanes)
// vectors P V may read, updates m and l, returns the correction. Whole: first = 0 and n a multiple of
// kLanes (every token of a full step), so nothing is masked; a lane's arithmetic is the same either way.
template <bool Whole>
inline float softmax_step_bf16(const float* s, int64_t n, int64_t first, float scale2, float& m, float& l,
                               uint16_t* probs) {
  const vi idx = lane_index();
  const int64_t nv = (n + kLanes - 1) / kLanes;
  auto visible = [&](int64_t v) {
    const vi at = idx + static_cast<int32_t>(v * kLanes);
    return (at < static_cast<int32_t>(n)) & (at >= static_cast<int32_t>(first));
  };
  vf mx0 = splat(kNegInf), mx1 = mx0;  // two chains (max is exact: any order gives the same)
  int64_t v = 0;
  for (; v + 2 <= nv; v += 2) {
    vf x0 = loadu(s + v * kLanes), x1 = loadu(s + (v + 1) * kLanes);
    if constexpr (!Whole) x0 = visible(v) ? x0 : splat(kNegInf), x1 = visible(v + 1) ? x1 : splat(kNegInf);
    mx0 = mx0 > x0 ? mx0 : x0;
    mx1 = mx1 > x1 ? mx1 : x1;
  }
  if (v < nv) {
    vf x = loadu(s + v * kLanes);
    if constexpr (!Whole) x = visible(v) ? x : splat(kNegInf);
    mx0 = mx0 > x ? mx0 : x;
  }
  const float new_max = std::max(m, hmax(mx0 > mx1 ? mx0 : mx1) * scale2);
  // on a split's first step m = -inf: 2^-125 ~ 2e-38 (the clamp), which scales l = 0 and acc = 0
  const float correction = exp2_probability(splat(m - new_max))[0];
  const vf neg_m = splat(-new_max), sc = splat(scale2);
  vf sum0 = {}, sum1 = {};
  auto prob = [&](int64_t v) {
    const vf e = exp2_probability(fmadd(loadu(s + v * kLanes), sc, neg_m));
    if constexpr (Whole) return e;
    return visible(v) ? e : vf{};
  };
  auto store = [&](int64_t v, vf e) {  // the probabilities are never denormal (>= ~2e-38, or 0)
#if defined(__AVX512BF16__)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(probs + v * kLanes),
                        reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(reinterpret_cast<__m512>(e))));
#else
    store_bf16_bits(probs + v * kLanes, bf16_bits(e), kLanes);
#endif
  };
  v = 0;
  for (; v + 2 <= nv; v += 2) {  // two sums, folded below: each lane's order is fixed
    const vf e0 = prob(v), e1 = prob(v + 1);
    sum0 += e0;
    sum1 += e1;
    store(v, e0);
    store(v + 1, e1);
  }
  if (v < nv) {
    const vf e = prob(v);
    sum0 += e;
    store(v, e);
  }
  l = l * correction + hsum(sum0 + sum1);
  m = new_max;
  return correction;
}

// (ta, tm, tl) <- the union of itself and one more split (a, m, l): the one merge of partial results.
// tm = -inf: ta is empty and takes the split as it is.
template <int D>
inline void fold(float* ta, float& tm, float& tl, const float* a, float m, float l) {
  if (tm == kNegInf) {
    std::memcpy(ta, a, D * sizeof(float));
    tm = m, tl = l;
    return;
  }
  const float big = std::max(tm, m);
  const float wa = std::exp(tm - big), wb = std::exp(m - big);
  for (int c = 0; c < D; c += kLanes) storeu(ta + c, fmadd(loadu(a + c), splat(wb), loadu(ta + c) * splat(wa)));
  tl = tl * wa + l * wb;
  tm = big;
}

template <int D>
inline void finish(const float* ta, float tl, float* o) {
  for (int c = 0; c < D; c += kLanes) storeu(o + c, loadu(ta + c) / splat(tl));
}

}  // namespace kvserve_cpu

// The bf16 attention step (bf16 queries over a bf16 pool, Bf16Math) on AMX tiles: where the CPU has
// AMX-BF16 and head_dim is a multiple of 32, a step's Q . K and P V are TDPBF16PS tile products and its
// softmax runs 16 lanes at a time, one lane per vector element.
//
// Transposed: a tile's columns are lanes (16 (query row, query head) pairs of one KV head, a "group" of
// the item's lanes packed in order), so every vector of the softmax holds one token's value for 16
// lanes and no step needs a horizontal reduction:
//   - scores S^T = K Q^T: A = 16 tokens' K rows (32 channels = 16 channel pairs a tile, the step's rows
//     gathered, zero past its last token), B = the group's Q^T (16 channel pairs x 16 lanes, packed once
//     per item). C = 16 tokens x 16 lanes.
//   - P V as O^T = V^T P^T: A = V^T in token pairs (16 channels x 16 token pairs, built per step), B =
//     the group's probabilities P^T (16 token pairs x 16 lanes, written by the softmax). C = 16 channels
//     x 16 lanes, added to the group's transposed accumulator after it is scaled by the step's
//     correction.
//
// A lane's arithmetic follows the lanes path's (attention_math.h softmax_step, Bf16Math) in shape: each
// score is the sum over the channel pairs in order of exact bf16 products (here the tile's, which add
// the pairs in the same order for C^T as for C: a product of two bf16 values is exact and commutative);
// the step max; the correction; the probabilities, masked outside the lane's tokens; their sum in
// kLanes slots (token t in slot t % 16, tokens in order) folded by hsum's halving; the probabilities
// rounded to bf16; P V over token pairs in order. The softmax itself is cheaper (softmax_of: the max in
// log2 units, scale and max in one multiply-add, exp2_probability's degree-4 polynomial within 3e-6
// where exp_nonpositive's degree 6 is within an ulp). So a lane's result depends on its own inputs
// only, and which lanes share its tiles, where theirs end, or whether its group runs a step it does not
// see (its state is left as it was: a masked lane's correction is 1 and its probabilities 0) never
// changes it. The sums and the softmax differ from the vdpbf16ps path's within the bf16 roundings, so a
// machine runs this path for every call of a given head_dim (amx::on()).
#pragma once

#include "amx.h"

#ifdef KVSERVE_HAVE_AMX

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "attention_math.h"

namespace kvserve_cpu {
namespace amx {

constexpr int64_t kGroup = 16;  // lanes per group: a tile's columns, a vector's elements

// One worker's state for the tiles. Per KV head h and group g of the item's lanes (lane i of head h =
// local row i / group_size, query head h * group_size + i % group_size; padding lanes past the item's):
struct AttentionTiles {
  int64_t d, sp, h_kv, groups = 0, per_head = 0;
  std::vector<uint32_t> qt;     // [h_kv][groups][D / 32][16 pairs][16 lanes]: Q^T, B tiles of the scores
  std::vector<int32_t> pos, lo; // [h_kv][groups][16]: each lane's position and first visible position
  std::vector<float> acc;       // [h_kv][groups][D][16]: the split's transposed accumulators
  std::vector<float> m, l;      // [h_kv][groups][16]: the split's running max and sum
  std::vector<uint16_t> k;      // [h_kv][sp][D]: the step's K rows, zero past its tokens (copied: blocks < 16)
  std::vector<const char*> k_tile;  // [h_kv][sp / 16]: each 16-token tile's first K row (in the pool, or k)
  std::vector<int64_t> k_stride;    // [h_kv][sp / 16]: bytes between that tile's rows (0: a zero row)
  bool copy_k;                      // K rows copied into k (blocks of fewer than 16 tokens), else read in the pool
  std::vector<uint32_t> vt;     // [h_kv][D][sp / 2]: the step's V^T in token pairs, zero past its tokens
  std::vector<uint32_t> vrows;  // [sp / 2][D]: V's token pairs before the transpose
  std::vector<float> st;        // [2][sp][16]: a group's scores (two buffers: the next group's tiles run
                                // while this one's softmax does)
  std::vector<uint32_t> pt;     // [sp / 2][16]: a group's probabilities in token pairs
  alignas(64) float c[4 * kTileRows * kGroup];
  AttentionTiles(int64_t d_, int64_t sp_, int64_t h_kv_, int64_t max_lanes_per_head, bool copy_k_)
      : d(d_), sp(sp_), h_kv(h_kv_), copy_k(copy_k_) {
    const int64_t g = (max_lanes_per_head + kGroup - 1) / kGroup;
    qt.resize(h_kv * g * d * kGroup / 2);
    pos.resize(h_kv * g * kGroup), lo.resize(h_kv * g * kGroup);
    acc.resize(h_kv * g * d * kGroup), m.resize(h_kv * g * kGroup), l.resize(h_kv * g * kGroup);
    k.resize(copy_k ? h_kv * sp * d : 0), vt.resize(h_kv * d * sp / 2), vrows.resize(sp / 2 * d);
    k_tile.resize(h_kv * sp / 16), k_stride.resize(h_kv * sp / 16);
    st.resize(2 * sp * kGroup), pt.resize(sp / 2 * kGroup);
  }
  int64_t at(int64_t h, int64_t g) const { return h * groups + g; }  // a (KV head, group) index
};

inline bool attention_on(int64_t d) { return d % 32 == 0 && on(); }

// The item's lanes into groups: Q^T, positions. lane_q[lane] is lane's query (D / 2 pairs), lane_pos /
// lane_lo its position and first visible position; padding lanes get position -1 (they see nothing).
template <int D>
void pack_lanes(AttentionTiles& t, const uint32_t* const* lane_q, const int32_t* lane_pos, const int32_t* lane_lo,
                int64_t num_rows, int64_t num_heads) {
  const int64_t group = num_heads / t.h_kv;
  t.per_head = num_rows * group;
  t.groups = (t.per_head + kGroup - 1) / kGroup;
  for (int64_t h = 0; h < t.h_kv; ++h) {
    for (int64_t g = 0; g < t.groups; ++g) {
      uint32_t* qt = t.qt.data() + t.at(h, g) * (D / 2) * kGroup;  // [D / 2 pairs][16 lanes]
      int32_t* pos = t.pos.data() + t.at(h, g) * kGroup;
      int32_t* lo = t.lo.data() + t.at(h, g) * kGroup;
      for (int64_t j = 0; j < kGroup; ++j) {
        const int64_t i = g * kGroup + j;
        if (i >= t.per_head) {
          pos[j] = -1, lo[j] = 0;
          for (int64_t c = 0; c < D / 2; ++c) qt[c * kGroup + j] = 0;
          continue;
        }
        const int64_t lane = (i / group) * num_heads + h * group + i % group;
        pos[j] = lane_pos[lane], lo[j] = lane_lo[lane];
        for (int64_t c = 0; c < D / 2; ++c) qt[c * kGroup + j] = lane_q[lane][c];
      }
    }
  }
}

// The step's K tiles and V^T for every KV head from its token rows (k_rows / v_rows [h][sp]: D bf16 each,
// rows past n point at `zeros`), tokens up to `padded` (a multiple of 64).
//
// K: unless t.copy_k (blocks of at least 16 tokens, so a 16-token tile lies in one block, its rows
// pool_stride bytes apart) the score tiles read K in the pool: a tile's first row and that stride. A tile
// past the step's last token reads a zero row (stride 0); the rows of a tile's last block past n are
// whatever the pool holds there: their scores (rows of C of their own) are never read, the softmax
// stops at the step's last token. With t.copy_k the rows are copied into t.k (zero past n).
template <int D>
void read_kv(AttentionTiles& t, const uint16_t* const* k_rows, const uint16_t* const* v_rows, int64_t padded,
             int64_t n, int64_t pool_stride, const void* zeros) {
  const int64_t sp = t.sp;
  for (int64_t h = 0; h < t.h_kv; ++h) {
    const char** tiles = t.k_tile.data() + h * (sp / 16);
    int64_t* strides = t.k_stride.data() + h * (sp / 16);
    if (!t.copy_k) {
      for (int64_t i = 0; i < padded / 16; ++i) {
        const bool real = 16 * i < n;
        tiles[i] = real ? reinterpret_cast<const char*>(k_rows[h * sp + 16 * i]) : static_cast<const char*>(zeros);
        strides[i] = real ? pool_stride : 0;
      }
    } else {
      uint16_t* k = t.k.data() + h * sp * D;
      for (int64_t tok = 0; tok < padded; ++tok) std::memcpy(k + tok * D, k_rows[h * sp + tok], D * sizeof(uint16_t));
      for (int64_t i = 0; i < padded / 16; ++i) {
        tiles[i] = reinterpret_cast<const char*>(k + 16 * i * D);
        strides[i] = D * 2;
      }
    }
    const uint16_t* const* v = v_rows + h * sp;
    for (int64_t u = 0; u < padded / 2; ++u) {
      uint32_t* row = t.vrows.data() + u * D;
      for (int64_t c = 0; c < D; ++c) row[c] = uint32_t{v[2 * u][c]} | (uint32_t{v[2 * u + 1][c]} << 16);
    }
    uint32_t* vt = t.vt.data() + h * D * (sp / 2);
    const float* rows[16];
    for (int64_t u0 = 0; u0 < padded / 2; u0 += 16) {
      for (int64_t r = 0; r < 16; ++r) rows[r] = reinterpret_cast<const float*>(t.vrows.data() + (u0 + r) * D);
      for (int64_t c0 = 0; c0 < D; c0 += 16)
        transpose_tile(rows, c0, reinterpret_cast<float*>(vt + c0 * (sp / 2) + u0), sp / 2);
    }
  }
}

// Whether a lane of group g (of any KV head: they share positions) is at or past position `from`.
inline bool reaches(const AttentionTiles& t, int64_t g, int64_t from) {
  const int32_t* pos = t.pos.data() + g * kGroup;
  for (int64_t j = 0; j < kGroup; ++j)
    if (pos[j] >= from) return true;
  return false;
}

// A split's start at position `from`: the accumulators 0, max -inf, sum 0 of every group with a lane
// that sees it (the others are neither run nor folded in this split).
inline void begin_split(AttentionTiles& t, int64_t from) {
  for (int64_t g = 0; g < t.groups; ++g) {
    if (!reaches(t, g, from)) continue;
    for (int64_t h = 0; h < t.h_kv; ++h) {
      std::fill_n(t.acc.data() + t.at(h, g) * t.d * kGroup, t.d * kGroup, 0.f);
      std::fill_n(t.m.data() + t.at(h, g) * kGroup, kGroup, kNegInf);
      std::fill_n(t.l.data() + t.at(h, g) * kGroup, kGroup, 0.f);
    }
  }
}

// A split's end: the state of the groups begin_split started into the lanes path's per-lane arrays
// (acc [lane][D], m, l), where run_item folds it.
template <int D>
void end_split(const AttentionTiles& t, int64_t from, int64_t num_heads, float* acc, float* m, float* l) {
  const int64_t group = num_heads / t.h_kv;
  alignas(64) float block[16 * 16];
  for (int64_t h = 0; h < t.h_kv; ++h) {
    for (int64_t g = 0; g < t.groups; ++g) {
      if (!reaches(t, g, from)) continue;
      const float* a = t.acc.data() + t.at(h, g) * D * kGroup;
      const int64_t lanes = std::min(kGroup, t.per_head - g * kGroup);
      for (int64_t c0 = 0; c0 < D; c0 += 16) {
        const float* rows[16];
        for (int64_t r = 0; r < 16; ++r) rows[r] = a + (c0 + r) * kGroup;
        transpose_tile(rows, 0, block, 16);  // block[lane][channel]
        for (int64_t j = 0; j < lanes; ++j) {
          const int64_t i = g * kGroup + j, lane = (i / group) * num_heads + h * group + i % group;
          std::memcpy(acc + lane * D + c0, block + j * 16, 16 * sizeof(float));
        }
      }
      for (int64_t j = 0; j < lanes; ++j) {
        const int64_t i = g * kGroup + j, lane = (i / group) * num_heads + h * group + i % group;
        m[lane] = t.m[t.at(h, g) * kGroup + j] * kLn2, l[lane] = t.l[t.at(h, g) * kGroup + j];
      }
    }
  }
}

// S^T of group g of KV head h over the step's tokens < tokens (a multiple of 64) into st [tokens][16].
template <int D>
void scores(const AttentionTiles& t, int64_t h, int64_t g, int64_t tokens, float* st) {
  const char* q = reinterpret_cast<const char*>(t.qt.data() + t.at(h, g) * (D / 2) * kGroup);
  const char* const* tiles = t.k_tile.data() + h * (t.sp / 16);  // read_kv: each 16-token tile's rows
  const int64_t* strides = t.k_stride.data() + h * (t.sp / 16);
  for (int64_t t0 = 0; t0 < tokens; t0 += 64) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    const char* const* a = tiles + t0 / 16;
    const int64_t* sa = strides + t0 / 16;
    for (int64_t ks = 0; ks < D / 32; ++ks) {
      _tile_loadd(6, q + ks * 1024, 64);
      _tile_loadd(4, a[0] + ks * 64, sa[0]);
      _tile_dpbf16ps(0, 4, 6);
      _tile_loadd(5, a[1] + ks * 64, sa[1]);
      _tile_dpbf16ps(1, 5, 6);
      _tile_loadd(4, a[2] + ks * 64, sa[2]);
      _tile_dpbf16ps(2, 4, 6);
      _tile_loadd(5, a[3] + ks * 64, sa[3]);
      _tile_dpbf16ps(3, 5, 6);
    }
    float* s = st + t0 * kGroup;
    _tile_stored(0, s, 64);
    _tile_stored(1, s + 16 * kGroup, 64);
    _tile_stored(2, s + 32 * kGroup, 64);
    _tile_stored(3, s + 48 * kGroup, 64);
  }
}

// Two tokens' probabilities (16 lanes each) as bf16 pairs: p0 in the low half of each 32-bit lane.
// vcvtne2ps2bf16 rounds to nearest even as bf16_bits does (the probabilities are never denormal, which
// it would flush: exp2_probability is at least ~2e-38, or exactly 0 where masked).
inline vu bf16_pairs(vf p0, vf p1) {
#if defined(__AVX512BF16__)
  const __m512i both = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(reinterpret_cast<__m512>(p1), reinterpret_cast<__m512>(p0)));
  // [p0 0..15, p1 0..15] as bf16 -> (p0 j, p1 j) pairs
  const __m512i order = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6, 21, 5,
                                         20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  return reinterpret_cast<vu>(_mm512_permutexvar_epi16(order, both));
#else
  return bf16_bits(p0) | (bf16_bits(p1) << 16);
#endif
}

// The softmax of group g's step at `start`, scores st for tokens < n_max: updates m and l, writes the
// bf16 probabilities in token pairs to t.pt up to 2 * units tokens, returns the correction. A lane
// that does not see the step keeps its state (correction 1, probabilities 0). Whole: every lane sees
// every token of the step (all but the diagonal and window-edge groups), so nothing is masked; a lane's
// arithmetic is the same either way.
//
// In log2 units: m is the running max of score * scale2 (scale2 = scale * log2(e)), the probability of
// score s is 2^(s * scale2 - m) with one fused multiply-add, and the correction 2^(m_old - m_new).
// The step max is taken over the raw scores and scaled once (a positive factor and its rounding keep
// the order, so it is the max of the scaled scores).
template <bool Whole>
inline vf softmax_of(AttentionTiles& t, float* st, int64_t at, vi first, vi last, vi sees, int64_t n_max, int64_t units,
                     float scale2) {
  auto visible = [&](int64_t tok) {
    const vi x = vi{} + static_cast<int32_t>(tok);
    return (x <= last) & (x >= first);
  };
  auto raw = [&](int64_t tok) {
    const vf x = loadu(st + tok * kGroup);
    if constexpr (Whole) return x;
    return visible(tok) ? x : splat(kNegInf);
  };
  // the step max in four chains held in registers (max is exact: any order gives the same)
  vf mx0 = splat(kNegInf), mx1 = mx0, mx2 = mx0, mx3 = mx0;
  int64_t tok = 0;
  for (; tok + 4 <= n_max; tok += 4) {
    const vf x0 = raw(tok), x1 = raw(tok + 1), x2 = raw(tok + 2), x3 = raw(tok + 3);
    mx0 = mx0 > x0 ? mx0 : x0;
    mx1 = mx1 > x1 ? mx1 : x1;
    mx2 = mx2 > x2 ? mx2 : x2;
    mx3 = mx3 > x3 ? mx3 : x3;
  }
  for (; tok < n_max; ++tok) {
    const vf x = raw(tok);
    mx0 = mx0 > x ? mx0 : x;
  }
  const vf mx01 = mx0 > mx1 ? mx0 : mx1, mx23 = mx2 > mx3 ? mx2 : mx3;
  const vf mx = (mx01 > mx23 ? mx01 : mx23) * scale2;
  const vf m_old = loadu(t.m.data() + at);
  const vf m_new = m_old < mx ? mx : m_old;  // std::max(m, step max), lane by lane
  const vf corr = sees ? exp2_probability(m_old - m_new) : splat(1.0f);
  const vf neg_m = -m_new;
  vf slot[kLanes];
  for (auto& s : slot) s = vf{};
  auto prob = [&](int64_t tok) {
    const vf e = exp2_probability(fmadd(loadu(st + tok * kGroup), splat(scale2), neg_m));
    if constexpr (Whole) return e;
    return visible(tok) ? e : vf{};
  };
  auto round = [&](int64_t t0, auto&& p) {  // 16 tokens, one per slot: 16 exp chains
#pragma GCC unroll 8
    for (int j = 0; j < kLanes; j += 2) {
      const vf p0 = p(t0 + j), p1 = p(t0 + j + 1);
      slot[j] += p0;
      slot[j + 1] += p1;
      const vu pair = bf16_pairs(p0, p1);
      std::memcpy(t.pt.data() + (t0 + j) / 2 * kGroup, &pair, sizeof(vu));
    }
  };
  int64_t t0 = 0;
  for (; t0 + kLanes <= n_max; t0 += kLanes) round(t0, prob);
  for (; t0 < 2 * units; t0 += kLanes)  // the rounds past n_max's last whole one: 0 past it
    round(t0, [&](int64_t tok) { return tok < n_max ? prob(tok) : vf{}; });
  // hsum's halving (vec.h) of the slots, lane by lane
  for (int w = kLanes / 2; w >= 1; w /= 2)
    for (int j = 0; j < w; ++j) slot[j] = slot[j] + slot[j + w];
  const vf l_old = loadu(t.l.data() + at);
  storeu(t.l.data() + at, l_old * corr + slot[0]);
  storeu(t.m.data() + at, sees ? m_new : m_old);
  return corr;
}

inline vf softmax(AttentionTiles& t, float* st, int64_t h, int64_t g, int64_t start, int64_t n_max, int64_t units,
                  float scale2) {
  const int64_t at = t.at(h, g) * kGroup;
  vi pos, lo;
  std::memcpy(&pos, t.pos.data() + at, sizeof(vi));
  std::memcpy(&lo, t.lo.data() + at, sizeof(vi));
  // a lane sees token `start + tok` iff lo <= start + tok <= pos: tok in [first, last]
  const vi first = lo - static_cast<int32_t>(start), last = pos - static_cast<int32_t>(start);
  const vi sees = (last >= 0) & (first < static_cast<int32_t>(t.sp));
  bool whole = true;  // every lane sees tokens [0, n_max)
  for (int j = 0; j < kLanes; ++j) whole = whole && first[j] <= 0 && last[j] >= n_max - 1;
  return whole ? softmax_of<true>(t, st, at, first, last, sees, n_max, units, scale2)
               : softmax_of<false>(t, st, at, first, last, sees, n_max, units, scale2);
}

// acc^T <- acc^T * corr + V^T P^T over the token pairs < units (a multiple of 16) for group g.
template <int D>
void pv(AttentionTiles& t, int64_t h, int64_t g, int64_t units, vf corr) {
  constexpr int64_t kTiles = D / 16 < 4 ? D / 16 : 4;  // channel tiles per pass
  constexpr int64_t kC = kTileRows * kGroup;
  const int64_t half = t.sp / 2, a_stride = half * 4, a_tile = 16 * a_stride;
  const char* p = reinterpret_cast<const char*>(t.pt.data());
  float* acc = t.acc.data() + t.at(h, g) * D * kGroup;
  for (int64_t c0 = 0; c0 < D; c0 += 16 * kTiles) {
    const char* v = reinterpret_cast<const char*>(t.vt.data() + (h * D + c0) * half);
    _tile_zero(0);
    _tile_zero(1);
    if constexpr (kTiles > 2) {
      _tile_zero(2);
      _tile_zero(3);
    }
    for (int64_t u0 = 0; u0 < units; u0 += 16) {
      _tile_loadd(6, p + u0 * 64, 64);
      _tile_loadd(4, v + u0 * 4, a_stride);
      _tile_dpbf16ps(0, 4, 6);
      _tile_loadd(5, v + a_tile + u0 * 4, a_stride);
      _tile_dpbf16ps(1, 5, 6);
      if constexpr (kTiles > 2) {
        _tile_loadd(4, v + 2 * a_tile + u0 * 4, a_stride);
        _tile_dpbf16ps(2, 4, 6);
        _tile_loadd(5, v + 3 * a_tile + u0 * 4, a_stride);
        _tile_dpbf16ps(3, 5, 6);
      }
    }
    _tile_stored(0, t.c, 64);
    _tile_stored(1, t.c + kC, 64);
    if constexpr (kTiles > 2) {
      _tile_stored(2, t.c + 2 * kC, 64);
      _tile_stored(3, t.c + 3 * kC, 64);
    }
    for (int64_t r = 0; r < 16 * kTiles; ++r) {
      float* row = acc + (c0 + r) * kGroup;
      storeu(row, loadu(row) * corr + loadu(t.c + r * kGroup));
    }
  }
}

// One step at `start` (tokens < n_max, K and V read by read_kv) for every group of KV head h that has a
// lane seeing it. The next group's scores are computed before this group's softmax, so that the tile
// unit works while the vector units do (two score buffers).
template <int D>
void run_step(AttentionTiles& t, int64_t h, int64_t start, int64_t n_max, float scale) {
  const int64_t tokens = (n_max + 63) / 64 * 64;
  const int64_t units = (n_max + 31) / 32 * 16;  // P V over token pairs up to n_max, in tiles of 32 tokens
  auto seen = [&](int64_t g) {
    const int32_t* pos = t.pos.data() + t.at(h, g) * kGroup;
    const int32_t* lo = t.lo.data() + t.at(h, g) * kGroup;
    bool any = false;
    for (int64_t j = 0; j < kGroup; ++j) any |= pos[j] >= start && lo[j] < start + t.sp;
    return any;
  };
  auto next_seen = [&](int64_t g) {
    while (g < t.groups && !seen(g)) ++g;
    return g;
  };
  float* st[2] = {t.st.data(), t.st.data() + t.sp * kGroup};
  int64_t g = next_seen(0), buf = 0;
  if (g < t.groups) scores<D>(t, h, g, tokens, st[0]);
  while (g < t.groups) {
    const int64_t next = next_seen(g + 1);
    if (next < t.groups) scores<D>(t, h, next, tokens, st[buf ^ 1]);
    const vf corr = softmax(t, st[buf], h, g, start, n_max, units, scale * kLog2e);
    pv<D>(t, h, g, units, corr);
    g = next, buf ^= 1;
  }
}

}  // namespace amx
}  // namespace kvserve_cpu

#endif

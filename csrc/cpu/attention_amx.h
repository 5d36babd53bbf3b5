// The bf16 attention step (bf16 queries over a bf16 pool, Bf16Math) on AMX tiles: where the CPU has
// AMX-BF16 and head_dim is a multiple of 32, the step's Q . K and P V run as TDPBF16PS tile products
// instead of vdpbf16ps chains; the softmax between them is attention_math.h's as it is.
//
// The operands are already in tile layout, as read_step_bf16 prepares them for the lanes path:
//   - scores: A = 16 lanes' queries (32 channels = 16 channel pairs a tile; rows of the item's packed
//     queries), B = kt2 [D / 2][sp], K transposed into channel pairs: rows 16 channel pairs, columns 16
//     tokens, stride sp pairs. C = 16 lanes x 16 tokens, stored as rows of the step's scores.
//   - P V: A = 16 lanes' bf16 probabilities (32 tokens a tile; rows of the step's probabilities, which
//     the softmax wrote with zeros up to the tile's end), B = vt2, V interleaved by token pairs
//     [D / 16][sp / 2][16]: 16 token pairs x 16 channels, 1 KB contiguous. C = 16 lanes x 16 channels,
//     added to the lane's accumulator after it is scaled by the step's correction.
// Each lane's arithmetic is the lanes path's step (run_step_tiles, paged_attention.h): scores, the
// scale, the fp32 softmax, bf16 probabilities, P V; only its sums are the tiles'.
//
// Why a lane's result stays a function of its own inputs: a tile row is one lane, and a C element
// depends on its row of A and its column of B only. Every lane runs the same tiles over the whole step
// (its probabilities are 0 past its last valid token and the padded V rows are 0, and adding 0 leaves
// an fp32 sum as it is), so where a lane's valid tokens end, or which lanes share its tile, does not
// change its sums. The sums differ from the vdpbf16ps chains', so a machine runs this path for every
// call of a given head_dim (amx::on()).
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

// Scratch of one worker. q holds every lane of the current item packed per KV head (pack_queries):
// [h_kv][per_head + 16][D / 2] channel pairs, so that the lanes a step runs, a run of consecutive lanes
// wherever the rows come in position order, are read by the A tiles in place; gather holds them when
// they are not such a run. The 16 extra rows keep a last partial tile's loads inside the buffer (their
// rows are computed and dropped).
struct AttentionTiles {
  std::vector<uint32_t> q, gather;
  std::vector<int32_t> lane_of;  // a step's active lanes' indices i (run_step_tiles)
  int64_t per_head = 0, d;
  alignas(64) float c[4 * kTileRows * 16];
  AttentionTiles(int64_t d_, int64_t h_kv, int64_t lanes_per_head)
      : q(h_kv * (lanes_per_head + kTileRows) * d_ / 2), gather((lanes_per_head + kTileRows) * d_ / 2),
        lane_of(lanes_per_head), d(d_) {}
};

inline bool attention_on(int64_t d) { return d % 32 == 0 && on(); }

// out[j][t] = (q_j . k_t) for tokens t < tokens (a multiple of 64) and the lanes j < n, whose queries
// are rows of q (stride D / 2 pairs; 16 rows past n readable) and whose scores rows of s (stride sp; 16
// rows past n writable). Four C tiles (16 lanes x 64 tokens) run at once, so their TDPBF16PS overlap.
template <int D>
void scores(const uint32_t* q, int64_t n, const uint32_t* kt, int64_t sp, int64_t tokens, float* s) {
  constexpr int64_t kSteps = D / 32;
  const int64_t b_stride = sp * 4;
  for (int64_t j0 = 0; j0 < n; j0 += kTileRows) {
    const char* a = reinterpret_cast<const char*>(q + j0 * (D / 2));
    for (int64_t t0 = 0; t0 < tokens; t0 += 64) {
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int64_t k = 0; k < kSteps; ++k) {
        const char* b = reinterpret_cast<const char*>(kt + k * 16 * sp + t0);
        _tile_loadd(4, a + k * 64, D * 2);
        _tile_loadd(6, b, b_stride);
        _tile_dpbf16ps(0, 4, 6);
        _tile_loadd(7, b + 64, b_stride);
        _tile_dpbf16ps(1, 4, 7);
        _tile_loadd(6, b + 128, b_stride);
        _tile_dpbf16ps(2, 4, 6);
        _tile_loadd(7, b + 192, b_stride);
        _tile_dpbf16ps(3, 4, 7);
      }
      float* out = s + j0 * sp + t0;
      _tile_stored(0, out, b_stride);
      _tile_stored(1, out + 16, b_stride);
      _tile_stored(2, out + 32, b_stride);
      _tile_stored(3, out + 48, b_stride);
    }
  }
}

// acc_j <- acc_j * corr_j + sum over tokens t < 2 * units of p_j[t] v_t for the lanes j < n, whose bf16
// probabilities are rows of p (stride sp; zero from each lane's last valid token up to 2 * units; 16
// rows past n readable). units (token pairs) is a multiple of 16. Up to four channel tiles at once.
template <int D>
void pv(float* c, float* const* acc, const uint16_t* p, const float* corr, const uint32_t* vt2, int64_t pair_stride,
        int64_t units, int64_t sp, int64_t n) {
  constexpr int64_t kTiles = D / 16 < 4 ? D / 16 : 4;  // channel tiles per pass
  constexpr int64_t kC = kTileRows * 16;
  for (int64_t j0 = 0; j0 < n; j0 += kTileRows) {
    const int64_t lanes = std::min(kTileRows, n - j0);
    const char* a = reinterpret_cast<const char*>(p + j0 * sp);
    for (int64_t c0 = 0; c0 < D; c0 += 16 * kTiles) {
      const char* b = reinterpret_cast<const char*>(vt2 + (c0 / 16) * pair_stride * 16);
      const int64_t b_tile = pair_stride * 16 * 4;  // bytes from one channel tile of V to the next
      _tile_zero(0);
      _tile_zero(1);
      if constexpr (kTiles > 2) {
        _tile_zero(2);
        _tile_zero(3);
      }
      for (int64_t u0 = 0; u0 < units; u0 += 16) {
        const char* bu = b + u0 * 64;
        _tile_loadd(4, a + u0 * 4, sp * 2);
        _tile_loadd(6, bu, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_loadd(7, bu + b_tile, 64);
        _tile_dpbf16ps(1, 4, 7);
        if constexpr (kTiles > 2) {
          _tile_loadd(6, bu + 2 * b_tile, 64);
          _tile_dpbf16ps(2, 4, 6);
          _tile_loadd(7, bu + 3 * b_tile, 64);
          _tile_dpbf16ps(3, 4, 7);
        }
      }
      _tile_stored(0, c, 64);
      _tile_stored(1, c + kC, 64);
      if constexpr (kTiles > 2) {
        _tile_stored(2, c + 2 * kC, 64);
        _tile_stored(3, c + 3 * kC, 64);
      }
      for (int64_t j = 0; j < lanes; ++j) {
        float* dst = acc[j0 + j] + c0;
        const vf f = splat(corr[j0 + j]);
        for (int64_t t = 0; t < kTiles; ++t) storeu(dst + t * 16, loadu(dst + t * 16) * f + loadu(c + t * kC + j * 16));
      }
    }
  }
}

}  // namespace amx
}  // namespace kvserve_cpu

#endif

// The bf16 attention step (bf16 queries over a bf16 pool, Bf16Math) on AMX tiles: where the CPU has
// AMX-BF16 and head_dim is a multiple of 32, the step's Q . K and P V run as TDPBF16PS tile products
// instead of vdpbf16ps chains; the softmax between them is attention_math.h's as it is.
//
// The operands are already in tile layout, as read_step_bf16 prepares them for the lanes path:
//   - scores: A = 16 lanes' queries (32 channels = 16 channel pairs a tile, gathered into rows of one
//     buffer), B = kt2 [D / 2][sp], K transposed into channel pairs: rows 16 channel pairs, columns 16
//     tokens, stride sp pairs. C = 16 lanes x 16 tokens.
//   - P V: A = 16 lanes' bf16 probabilities (32 tokens a tile, gathered), B = vt2, V interleaved by
//     token pairs [D / 16][sp / 2][16]: 16 token pairs x 16 channels, 1 KB contiguous. C = 16 lanes x 16
//     channels, added to the lane's accumulator after it is scaled by the step's correction.
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

// Scratch of one worker: 16 lanes' queries [16][D / 2] pairs, probabilities [16][sp] bf16, one C tile.
struct AttentionTiles {
  std::vector<uint32_t> q;
  std::vector<uint16_t> p;
  alignas(64) float c[kTileRows * 16];
  AttentionTiles(int64_t d, int64_t sp) : q(kTileRows * d / 2), p(kTileRows * sp) {}
};

inline bool attention_on(int64_t d) { return d % 32 == 0 && on(); }

// out[j][t] = scale * (q_j . k_t) for the n lanes and tokens t < nv * kLanes (a multiple of 16).
template <int D>
void scores(AttentionTiles& w, const uint32_t* const* q, const uint32_t* kt, int64_t sp, int64_t nv, float scale,
            float* const* out, int64_t n) {
  constexpr int64_t kPairs = D / 2, kSteps = D / 32;
  const int64_t tokens = nv * kLanes;
  for (int64_t j0 = 0; j0 < n; j0 += kTileRows) {
    const int64_t lanes = std::min(kTileRows, n - j0);
    for (int64_t j = 0; j < kTileRows; ++j) {
      if (j < lanes) {
        std::memcpy(w.q.data() + j * kPairs, q[j0 + j], kPairs * sizeof(uint32_t));
      } else {
        std::memset(w.q.data() + j * kPairs, 0, kPairs * sizeof(uint32_t));
      }
    }
    const char* a = reinterpret_cast<const char*>(w.q.data());
    for (int64_t t0 = 0; t0 < tokens; t0 += 16) {
      _tile_zero(0);
      for (int64_t k = 0; k < kSteps; ++k) {
        _tile_loadd(4, a + k * 64, kPairs * 4);
        _tile_loadd(6, reinterpret_cast<const char*>(kt + k * 16 * sp + t0), sp * 4);
        _tile_dpbf16ps(0, 4, 6);
      }
      _tile_stored(0, w.c, 64);
      for (int64_t j = 0; j < lanes; ++j) {
        float* dst = out[j0 + j] + t0;
        const float* src = w.c + j * 16;
        for (int i = 0; i < 16; ++i) dst[i] = src[i] * scale;
      }
    }
  }
}

// acc_j <- acc_j * corr_j + sum over tokens t < 2 * units of p_j[t] v_t, for the n lanes; p_j holds
// valid[j] probabilities (rounded up to 16: softmax_step wrote zeros there), zero past them here.
// units (token pairs) is a multiple of 16.
template <int D>
void pv(AttentionTiles& w, float* const* acc, const uint16_t* const* p, const int32_t* valid, const float* corr,
        const uint32_t* vt2, int64_t pair_stride, int64_t units, int64_t sp, int64_t n) {
  for (int64_t j0 = 0; j0 < n; j0 += kTileRows) {
    const int64_t lanes = std::min(kTileRows, n - j0);
    for (int64_t j = 0; j < kTileRows; ++j) {
      uint16_t* row = w.p.data() + j * sp;
      const int64_t have = j < lanes ? std::min<int64_t>(2 * units, (valid[j0 + j] + kLanes - 1) / kLanes * kLanes) : 0;
      if (have > 0) std::memcpy(row, p[j0 + j], have * sizeof(uint16_t));
      std::memset(row + have, 0, (2 * units - have) * sizeof(uint16_t));
    }
    const char* a = reinterpret_cast<const char*>(w.p.data());
    for (int64_t c0 = 0; c0 < D; c0 += 16) {
      _tile_zero(0);
      const uint32_t* v = vt2 + (c0 / 16) * pair_stride * 16;
      for (int64_t u0 = 0; u0 < units; u0 += 16) {
        _tile_loadd(4, a + u0 * 4, sp * 2);
        _tile_loadd(6, reinterpret_cast<const char*>(v + u0 * 16), 64);
        _tile_dpbf16ps(0, 4, 6);
      }
      _tile_stored(0, w.c, 64);
      for (int64_t j = 0; j < lanes; ++j) {
        float* dst = acc[j0 + j] + c0;
        const float* src = w.c + j * 16;
        const float f = corr[j0 + j];
        for (int i = 0; i < 16; ++i) dst[i] = dst[i] * f + src[i];
      }
    }
  }
}

}  // namespace amx
}  // namespace kvserve_cpu

#endif

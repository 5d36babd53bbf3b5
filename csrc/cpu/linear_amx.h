// The bf16 row-invariant linear on AMX tiles (Intel Sapphire Rapids and later): row_linear_bf16's path
// where the CPU has AMX-BF16, the OS grants the tile state and in_features is a multiple of 32.
//
// A tile is 16 rows of 64 bytes: C 16 rows x 16 fp32 outputs, A 16 rows of x x 32 bf16 inputs, B 16
// input pairs x 16 outputs x 2 bf16, which is exactly a panel of pack_linear_weight_bf16's layout
// ([panels, in / 2, kLanes * 2]; panel p, pairs k0 .. k0 + 15 are 1 KB at one address, stride 64), so
// the packed weight is read as it is. One TDPBF16PS adds 32 inputs' products into each C element.
//
// Why it stays batch invariant: every y[m, o] is the C element of its own row, accumulated over the
// input tiles k = 0, 1, ... in order from zero, one TDPBF16PS each; an element's arithmetic in a
// TDPBF16PS depends on its row of A and its column of B only, never on the other rows of the tile or on
// how many rows the call has. Then the bias (fp32) and one rounding to bf16, as in the AVX-512 path. A
// partial tile of rows (the call's last rows < 16) is read from a zero-padded copy, so nothing past x is
// read; the zero rows are computed and dropped. Which of the row x panel tile shapes (2 x 2, 2 x 1,
// 1 x 2, 1 x 1) covers an output changes only how many tiles run together, not that output's chain.
// The sums differ from the AVX-512 path's (vdpbf16ps adds one pair at a time), so a machine computes
// every row count with the same path: AMX when it has it, for every call of a given in_features.
#pragma once

#include "amx.h"

#ifdef KVSERVE_HAVE_AMX

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

#include "parallel.h"
#include "vec.h"

namespace kvserve_cpu {
namespace amx {

constexpr int64_t kTileInputs = 32;  // input features per TDPBF16PS (16 pairs)
constexpr int64_t kTileOutputs = 16; // output features per tile: one weight panel (kLanes on AVX-512)
constexpr int64_t kBlockRows = 64;   // a work item: 64 rows x 8 panels (A and B of a block stay in L2)
constexpr int64_t kBlockPanels = 8;
constexpr int64_t kMinMacsPerThread = int64_t{1} << 21;
// A call of one row tile reads its weight once for few products: memory bound, so it splits over threads
// from a 32nd of that (a 576 x 576 projection at one row: 0.33 M products, 0.66 MB of weight). Which
// thread computes an output never changes its chain. SmolLM2 bf16 decode x1: 21.4 -> 14.5 ms a step.
constexpr int64_t kMinMacsPerThreadFewRows = kMinMacsPerThread / 32;

struct Shape {
  const at::BFloat16* x;     // [rows, in]: rows < full_rows read here
  const at::BFloat16* tail;  // [16, in]: rows full_rows .. rows, zero-padded
  const at::BFloat16* w;     // [panels, in / 2, 32]
  const float* b;            // [panels * 16] or null
  at::BFloat16* y;           // [rows, out]
  int64_t rows, full_rows, in, out;
  int64_t glu_panels = 0;    // > 0: the gated MLP's silu(gate) * up, gate panels [0, glu) and up [glu, 2 glu)
  struct Argmax* argmax = nullptr;  // set: each row's argmax over its first `limit` outputs, y not written
};

// The argmax of each row's bf16 outputs instead of the outputs (a greedy step's LM head): what
// argmax_rows returns for y[:, :limit], its first maximum (-0.0 ties +0.0) or its first NaN, without y
// written and read back. A cell holds the best (value, index) of one row over one work item's panels
// (ArgmaxLanes: a worker's panels reach it in increasing order, and only a later value that is larger, or
// the first NaN, replaces a held one); the cells of a row then fold in panel order the same way.
struct Argmax {
  std::vector<float> best;      // [rows, blocks]
  std::vector<int64_t> index;   // [rows, blocks]; -1: nothing yet
  int64_t blocks = 0, block_panels = 0, limit = 0;

  // whether (v, i), found after the cell's (best, index) in output order, replaces it
  static bool replaces(float held, int64_t held_index, float v) {
    return held_index < 0 || (held == held && (v != v || v > held));
  }
};

inline const char* a_rows(const Shape& s, int64_t m) {
  return reinterpret_cast<const char*>(m < s.full_rows ? s.x + m * s.in : s.tail + (m - s.full_rows) * s.in);
}

// The low halves of h's 16 lanes (bf16 bits) to dst[0 .. n): one vpmovdw and a 32-byte store for a
// whole panel.
inline void store_bits(at::BFloat16* dst, vu h, int64_t n) {
  const __m256i bits = _mm512_cvtepi32_epi16(reinterpret_cast<__m512i>(h));
  if (n == kTileOutputs) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), bits);
  } else {  // the last panel of an output count not a multiple of 16
    _mm256_mask_storeu_epi16(dst, static_cast<__mmask16>((1u << n) - 1), bits);
  }
}

// A worker's running argmax of the rows of its current work item, lane by lane (lane l: the outputs
// o0 + l of the item's panels so far): each lane's first maximum or first NaN and its index.
struct ArgmaxLanes {
  std::vector<float> held = std::vector<float>(kBlockRows * kTileOutputs);
  std::vector<int32_t> index = std::vector<int32_t>(kBlockRows * kTileOutputs);
};

// Rows [r0, r1) of C tile c (rows from m, panel p), rounded as store_rows rounds them, into their rows'
// lanes (the panel's outputs below the limit); at a work item's last panel each row's lanes fold into its
// cell: the first NaN by index, else the smallest index holding the maximum.
inline void argmax_lanes(const Shape& s, ArgmaxLanes& lanes, const float* c, int64_t m, int64_t p, int64_t r0,
                         int64_t r1) {
  Argmax& a = *s.argmax;
  const int64_t o0 = p * kTileOutputs, valid = std::min(kTileOutputs, a.limit - o0);
  if (valid <= 0) return;
  const __mmask16 live = static_cast<__mmask16>(valid == kTileOutputs ? 0xffffu : (1u << valid) - 1);
  const bool first = p % a.block_panels == 0;
  const bool last = p % a.block_panels == a.block_panels - 1 || o0 + kTileOutputs >= a.limit;
  const int64_t cell = p / a.block_panels;
  const __m512i ids = _mm512_add_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                       _mm512_set1_epi32(static_cast<int32_t>(o0)));
  const __m512i none = _mm512_set1_epi32(std::numeric_limits<int32_t>::max());
  for (int64_t r = r0; r < r1; ++r) {
    const vf sum = s.b ? loadu(c + r * kTileOutputs) + loadu(s.b + o0) : loadu(c + r * kTileOutputs);
    const __m512 v = reinterpret_cast<__m512>(widen_bits(bf16_bits(sum)));  // the stored bf16 value
    float* held = lanes.held.data() + (m + r) % kBlockRows * kTileOutputs;
    int32_t* index = lanes.index.data() + (m + r) % kBlockRows * kTileOutputs;
    __m512 h;
    __m512i i;
    if (first) {
      h = _mm512_mask_mov_ps(_mm512_set1_ps(-std::numeric_limits<float>::infinity()), live, v);
      i = _mm512_mask_mov_epi32(none, live, ids);
    } else {  // a lane takes a later value that is larger, or the first NaN
      h = _mm512_loadu_ps(held), i = _mm512_loadu_si512(index);
      const __mmask16 take = live & ~_mm512_cmp_ps_mask(h, h, _CMP_UNORD_Q) &
                             (_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(v, h, _CMP_GT_OQ));
      h = _mm512_mask_mov_ps(h, take, v), i = _mm512_mask_mov_epi32(i, take, ids);
    }
    if (!last) {
      _mm512_storeu_ps(held, h), _mm512_storeu_si512(index, i);
      continue;
    }
    const __mmask16 seen = _mm512_cmpneq_epi32_mask(i, none), nan = seen & _mm512_cmp_ps_mask(h, h, _CMP_UNORD_Q);
    float best;
    int32_t at;
    if (nan) {
      best = std::numeric_limits<float>::quiet_NaN(), at = _mm512_mask_reduce_min_epi32(nan, i);
    } else {
      best = _mm512_mask_reduce_max_ps(seen, h);
      at = _mm512_mask_reduce_min_epi32(seen & _mm512_cmp_ps_mask(h, _mm512_set1_ps(best), _CMP_EQ_OQ), i);
    }
    a.best[(m + r) * a.blocks + cell] = best, a.index[(m + r) * a.blocks + cell] = at;
  }
}

// Rows [r0, r1) of C tile c (rows from m, panel p) -> y with the bias, rounded to bf16 once (bf16_bits:
// nearest even, as c10's conversion of a finite float).
inline void store_rows(const Shape& s, const float* c, int64_t m, int64_t p, int64_t r0, int64_t r1) {
  const int64_t o0 = p * kTileOutputs, n = std::min(kTileOutputs, s.out - o0);
  at::BFloat16* y = s.y + m * s.out + o0;
  if (s.b) {
    const vf b = loadu(s.b + o0);  // bias zero-padded
    for (int64_t r = r0; r < r1; ++r) store_bits(y + r * s.out, bf16_bits(loadu(c + r * kTileOutputs) + b), n);
  } else {
    for (int64_t r = r0; r < r1; ++r) store_bits(y + r * s.out, bf16_bits(loadu(c + r * kTileOutputs)), n);
  }
}

// Rows [r0, r1) of the GLU's C tiles gate (panel p) and up (panel glu + p) -> y's outputs of panel p, as
// the unfused path computes them: each operand with its bias rounded to bf16 (what row_linear_bf16
// stores), the SiLU rounded to bf16, the product rounded once (glu_bf16; linear_cpu.cpp's other paths the
// same).
inline void store_glu_rows(const Shape& s, const float* gate, const float* up, int64_t m, int64_t p, int64_t r0,
                           int64_t r1) {
  const int64_t o0 = p * kTileOutputs, n = std::min(kTileOutputs, s.out - o0);
  const vf bg = s.b ? loadu(s.b + o0) : vf{}, bu = s.b ? loadu(s.b + s.glu_panels * kTileOutputs + o0) : vf{};
  at::BFloat16* y = s.y + m * s.out + o0;
  for (int64_t r = r0; r < r1; ++r) {
    const vu h = bf16_bits(glu_bf16(round_bf16(loadu(gate + r * kTileOutputs) + bg),
                                     round_bf16(loadu(up + r * kTileOutputs) + bu)));
    store_bits(y + r * s.out, h, n);
  }
}

constexpr int64_t kC = kTileRows * kTileOutputs;  // floats of a stored C tile

// The C tiles of the last tile group, stored and waiting for their epilogue (bias, rounding, the GLU's
// SiLU): it runs a few rows at a time inside the next group's input loop, so the vector units work while
// the tiles compute (the epilogue after the loop left the tiles idle: a third of Qwen's gate|up time at
// 1,800 rows). Only where an output's value is computed moves, never how.
struct Pending {
  const float* c = nullptr;  // the stored tiles: [row tile][panel] (GLU: [row tile][gate, up])
  int64_t m = 0, p = 0, pt = 0;
  int64_t done = 0, units = 0;  // epilogue rows done / in all (a row of one tile; GLU: of a gate|up pair)
  ArgmaxLanes* lanes = nullptr;  // the worker's, where the call takes the argmax
};

inline void drain(const Shape& s, Pending& e, int64_t upto) {
  const int64_t rows_left = s.rows - e.m;
  while (e.done < upto) {  // a run of rows of one tile at a time
    const int64_t t = e.done / kTileRows, r0 = e.done % kTileRows;  // from row r0 of tile (group) t
    const int64_t r1 = std::min(kTileRows, r0 + upto - e.done);
    e.done += r1 - r0;
    if (s.glu_panels) {  // t = row tile
      const int64_t last = std::min(r1, rows_left - t * kTileRows);  // rows past the call's are dropped
      const float* gate = e.c + 2 * t * kC;
      if (r0 < last) store_glu_rows(s, gate, gate + kC, e.m + t * kTileRows, e.p, r0, last);
    } else {  // t = row tile * pt + panel
      const int64_t rt = e.pt == 2 ? t >> 1 : t, q = e.pt == 2 ? t & 1 : 0;  // pt is 1 or 2: no division
      const int64_t last = std::min(r1, rows_left - rt * kTileRows);
      if (r0 < last && s.argmax) {
        argmax_lanes(s, *e.lanes, e.c + t * kC, e.m + rt * kTileRows, e.p + q, r0, last);
      } else if (r0 < last) {
        store_rows(s, e.c + t * kC, e.m + rt * kTileRows, e.p + q, r0, last);
      }
    }
  }
}

// RT row tiles (from row m) x PT panels (from panel p), C in tmm0..3, A in tmm4, 5, B in tmm6, 7, stored
// to c (4 tiles) and left pending; the previous group's epilogue (pend) runs in the input loop. With
// glu_panels the two panels are gate p and up glu + p (PT = 2), stored as one panel of y.
template <int RT, int PT>
inline void tiles(const Shape& s, int64_t m, int64_t p, float* c, Pending& pend) {
  const int64_t lda = s.in * 2, panel_bytes = s.in * 2 * kTileOutputs, steps = s.in / kTileInputs;
  const char* a0 = a_rows(s, m);
  const char* a1 = RT > 1 ? a_rows(s, m + kTileRows) : nullptr;
  const char* b0 = reinterpret_cast<const char*>(s.w) + p * panel_bytes;
  const char* b1 = b0 + (s.glu_panels ? s.glu_panels * panel_bytes : panel_bytes);
  _tile_zero(0);
  if constexpr (PT > 1) _tile_zero(1);
  if constexpr (RT > 1) _tile_zero(2);
  if constexpr (RT > 1 && PT > 1) _tile_zero(3);
  const int64_t per_step = (pend.units - pend.done + steps - 1) / steps;
  for (int64_t k = 0; k < steps; ++k) {
    _tile_loadd(4, a0 + k * 64, lda);
    _tile_loadd(6, b0 + k * 1024, 64);
    if constexpr (RT > 1) _tile_loadd(5, a1 + k * 64, lda);
    if constexpr (PT > 1) _tile_loadd(7, b1 + k * 1024, 64);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (PT > 1) _tile_dpbf16ps(1, 4, 7);
    if constexpr (RT > 1) _tile_dpbf16ps(2, 5, 6);
    if constexpr (RT > 1 && PT > 1) _tile_dpbf16ps(3, 5, 7);
    if (pend.done < pend.units) drain(s, pend, std::min(pend.units, pend.done + per_step));
  }
  drain(s, pend, pend.units);
  // stored [row tile][panel]: tmm0 (0, 0), tmm1 (0, 1), tmm2 (1, 0), tmm3 (1, 1)
  _tile_stored(0, c, 64);
  if constexpr (PT > 1) _tile_stored(1, c + kC, 64);
  if constexpr (RT > 1) _tile_stored(2, c + PT * kC, 64);
  if constexpr (RT > 1 && PT > 1) _tile_stored(3, c + 3 * kC, 64);
  pend = Pending{c, m, p, s.glu_panels ? 1 : PT, 0, (s.glu_panels ? RT : RT * PT) * kTileRows, pend.lanes};
}

template <int RT>
inline void panels_of(const Shape& s, int64_t m, int64_t p0, int64_t p1, float* c, Pending& pend) {
  int64_t p = p0;
  auto next_c = [&] { return pend.c == c ? c + 4 * kC : c; };  // two buffers: the pending one and the next
  if (s.glu_panels) {  // a gate and an up panel for each of y's
    for (; p < p1; ++p) tiles<RT, 2>(s, m, p, next_c(), pend);
    return;
  }
  for (; p + 2 <= p1; p += 2) tiles<RT, 2>(s, m, p, next_c(), pend);
  if (p < p1) tiles<RT, 1>(s, m, p, next_c(), pend);
}

// Rows [m0, m1) x panels [p0, p1): row tiles two at a time over each panel pair.
inline void block(const Shape& s, int64_t m0, int64_t m1, int64_t p0, int64_t p1, float* c, Pending& pend) {
  int64_t m = m0;
  for (; m + kTileRows < m1; m += 2 * kTileRows) panels_of<2>(s, m, p0, p1, c, pend);  // more than one tile of rows left
  if (m < m1) panels_of<1>(s, m, p0, p1, c, pend);
}

// y = x W^T (+ b) for bf16 x [rows, in] (in % 32 == 0) over pack_linear_weight_bf16's panels; with
// glu_panels, y = silu(x G^T + bg) * (x U^T + bu) over W = [G; U] (glu_panels each, out = G's outputs),
// and `panels` counts y's panels.
// With argmax (not with glu_panels): y is not written; argmax[m] is row m's argmax_rows over its first
// `limit` outputs.
inline void run(const at::BFloat16* x, const at::BFloat16* w, const float* b, at::BFloat16* y, int64_t rows,
                int64_t in, int64_t out, int64_t panels, int64_t glu_panels = 0, int64_t* argmax = nullptr,
                int64_t limit = 0) {
  const int64_t full_rows = rows / kTileRows * kTileRows;
  std::vector<at::BFloat16> tail;  // only where the rows end in a partial tile
  if (rows > full_rows) {
    tail.assign(kTileRows * in, at::BFloat16(0.0f));
    std::memcpy(tail.data(), x + full_rows * in, (rows - full_rows) * in * sizeof(at::BFloat16));
  }
  Shape s{x, tail.data(), w, b, y, rows, full_rows, in, out, glu_panels};
  const int64_t row_blocks = (rows + kBlockRows - 1) / kBlockRows;
  const int64_t block_panels = (rows <= kTileRows ? 2 : kBlockPanels) / (glu_panels ? 2 : 1);  // weight panels alike
  const int64_t panel_blocks = (panels + block_panels - 1) / block_panels;
  Argmax cells;
  if (argmax) {
    cells.best.assign(rows * panel_blocks, 0.0f);
    cells.index.assign(rows * panel_blocks, -1);
    cells.blocks = panel_blocks, cells.block_panels = block_panels, cells.limit = limit;
    s.argmax = &cells;
  }
  const int64_t num_blocks = row_blocks * panel_blocks;
  // a thread gets at least kMinMacsPerThread of work (one decode step's small projection stays on one)
  const int64_t block_macs =
      std::max<int64_t>(1, std::min(rows, kBlockRows) * in * block_panels * (glu_panels ? 2 : 1) * kTileOutputs);
  const int64_t min_macs = rows <= kTileRows ? kMinMacsPerThreadFewRows : kMinMacsPerThread;
  const int64_t min_blocks = std::max<int64_t>(1, min_macs / block_macs);
  const int64_t chunk = std::max<int64_t>(min_blocks, (num_blocks + 8 * at::get_num_threads() - 1) /
                                                          (8 * at::get_num_threads()));
  parallel_chunks_with(
      num_blocks, chunk, min_blocks,
      [] {
        configure();
        return std::vector<float>(8 * kC);
      },
      [&](std::vector<float>& c, int64_t first, int64_t last) {
        Pending pend;
        std::unique_ptr<ArgmaxLanes> lanes;
        if (s.argmax) lanes = std::make_unique<ArgmaxLanes>(), pend.lanes = lanes.get();
        for (int64_t i = first; i < last; ++i) {  // panel-major: consecutive blocks share their panels
          const int64_t pb = i / row_blocks, rb = i % row_blocks;
          block(s, rb * kBlockRows, std::min(rows, (rb + 1) * kBlockRows), pb * block_panels,
                std::min(panels, (pb + 1) * block_panels), c.data(), pend);
        }
        drain(s, pend, pend.units);
      });
  for (int64_t m = 0; argmax && m < rows; ++m) {  // each row's cells in panel order
    float best = 0.0f;
    int64_t index = -1;
    for (int64_t k = m * panel_blocks; k < (m + 1) * panel_blocks; ++k) {
      if (cells.index[k] >= 0 && Argmax::replaces(best, index, cells.best[k])) best = cells.best[k], index = cells.index[k];
    }
    argmax[m] = index;
  }
}

}  // namespace amx
}  // namespace kvserve_cpu

#endif

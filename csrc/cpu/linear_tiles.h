// The tiled schedule of the row-invariant CPU linears (linear_cpu.cpp: fp32, bf16; nested_linear.cpp:
// NestedFP), generic over T, the weight format: T::X an input step of x, T::W the packed weight's
// element, T::load_w a step of kLanes outputs' weights as fp32 lanes, T::step the multiply-add, T::store
// the result. T::load_w(panel, i, plane) takes the panel's start and the step, so that a format whose
// weights come with per-group factors (linear_codes.cpp) finds them. linear_cpu.cpp's header comment describes the schedule and why each output element is
// one fixed chain whatever the rows, tiles and threads.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

#include "parallel.h"
#include "vec.h"

namespace kvserve_cpu {

constexpr int64_t kBlockRows = 96;
constexpr int64_t kFewRows = 16;

// The register tile's shape: R rows x P panels of accumulators, held beside the P weight steps and a
// broadcast x, and sized to the vector registers: AVX-512 has 32 (8 x 3: 24 accumulators), AVX2 16
// (4 x 3: 12; an 8 x 3 tile there spills accumulators to the stack every step). A format that needs more
// registers per step (bf16 pairs widened to fp32 without vdpbf16ps) sets smaller ones. A block
// (run_blocks) is kTilePanels panels wide. The gated MLP's tile takes gate panels each with its up
// panel: kGluRows x kGluPairs pairs. AVX2, 1,800 rows of Qwen2.5-0.5B's four projections, fp32, one
// layer (AMD EPYC Zen 3, 2026-12-02, with splat's broadcast): 8 x 3 588 ms, 6 x 2 428-443 ms, 4 x 3 406 ms.
// kOwnTile: the format brings its own register tile (T::tile<R, P, Glu>, same arguments as `tile`), for
// a loop over W that is not one load_w per step (linear_qcodes.cpp: factors per group, codes per word).
struct TileShape32 {
  static constexpr int kTileRows = 8, kTilePanels = 3, kGluRows = 6, kGluPairs = 2;
  static constexpr bool kOwnTile = false;
};
struct TileShape16 {
  static constexpr int kTileRows = 4, kTilePanels = 3, kGluRows = 6, kGluPairs = 1;
  static constexpr bool kOwnTile = false;
};
#if defined(__AVX512F__)
using DefaultTileShape = TileShape32;
#else
using DefaultTileShape = TileShape16;
#endif
// Formats whose weight step takes a few registers more to widen (AVX2 bf16 pairs without vdpbf16ps:
// two halves of w and of x and a mask; int8 codes: the codes, their group's scale and offset): smaller
// tiles on AVX2 (4 x 2: 8 accumulators), the default ones on AVX-512's 32 registers.
#if defined(__AVX512F__)
using WideningTileShape = DefaultTileShape;
#else
struct WideningTileShape {
  static constexpr int kTileRows = 4, kTilePanels = 2, kGluRows = 4, kGluPairs = 1;
  static constexpr bool kOwnTile = false;
};
#endif

// fp32 x and y, one input feature a step; the weight formats that widen to fp32 lanes (NestedFP)
// derive from it and replace W and load_w.
struct Fp32 : DefaultTileShape {
  using X = float;
  using W = float;
  using Y = float;
  // a thread gets at least this many multiply-adds of a few-row call (run_blocks)
  static constexpr int64_t kMinMacsPerThread = int64_t{1} << 21;
  static vf broadcast(float x) { return splat(x); }
  static vf load_w(const float* panel, int64_t i, int64_t) { return loadu(panel + i * kLanes); }
  // acc + x * w, one fused multiply-add
  static vf step(vf acc, vf x, vf w) { return fmadd(x, w, acc); }
  static void store(float* dst, vf v, int64_t n) {
    if (n == kLanes) {
      storeu(dst, v);
    } else {
      for (int64_t l = 0; l < n; ++l) dst[l] = v[l];
    }
  }
  // silu(g) * u, the gated MLP's activation in fp32 (kLanes outputs)
  static void store_glu(float* dst, vf g, vf u) { storeu(dst, silu(g) * u); }
};

template <typename T>
struct Shape {
  const typename T::X* x;   // [rows, steps]
  const typename T::W* wp;  // [panels, steps, kLanes]
  const float* b;           // [panels * kLanes] zero-padded fp32, or null
  typename T::Y* y;         // [rows, out]
  int64_t steps, out;
  int64_t plane = 0;          // a second weight plane starts this many X after the first (NestedFP lo)
  const float* scale = nullptr;  // [panels * kLanes] per-output factor before the bias, or null
  // > 0: a gated MLP's gate|up (row_linear_glu): panel p < glu_half is the gate's and p + glu_half the
  // up's of the same outputs, and y [rows, out = glu_half * kLanes] takes T::store_glu of the two
  int64_t glu_half = 0;
  int64_t panel_stride = 0;  // W from one panel's start to the next's; 0: steps * kLanes
  int64_t y_stride = 0;      // Y from one row of y to the next; 0: out (a block of y's columns sets it)
  int64_t stride() const { return panel_stride ? panel_stride : steps * kLanes; }
  int64_t ldy() const { return y_stride ? y_stride : out; }
};

// The tile's accumulators acc[r][p] (rows m0 + r, panel p of the tile) stored to y: the per-output scale
// and the bias added, or (Glu) T::store_glu of each gate panel p < P / 2 with its up panel p + P / 2.
template <typename T, int R, int P, bool Glu>
inline void store_tile(const Shape<T>& s, int64_t m0, int64_t p0, const vf (&acc)[R][P]) {
  constexpr int Q = Glu ? P / 2 : P;  // the panels of y this tile stores
  for (int p = 0; p < Q; ++p) {
    const int64_t o0 = (p0 + p) * kLanes, n = std::min<int64_t>(kLanes, s.out - o0);
    const vf bias = s.b ? loadu(s.b + o0) : vf{};
    if constexpr (Glu) {  // whole panels (row_linear_glu checks), no per-output scale
      const vf up_bias = s.b ? loadu(s.b + o0 + s.glu_half * kLanes) : vf{};
      for (int r = 0; r < R; ++r) {
        T::store_glu(s.y + (m0 + r) * s.ldy() + o0, s.b ? acc[r][p] + bias : acc[r][p],
                     s.b ? acc[r][p + Q] + up_bias : acc[r][p + Q]);
      }
    } else {
      const vf scale = s.scale ? loadu(s.scale + o0) : vf{};
      for (int r = 0; r < R; ++r) {
        const vf v = s.scale ? acc[r][p] * scale : acc[r][p];
        T::store(s.y + (m0 + r) * s.ldy() + o0, s.b ? v + bias : v, n);
      }
    }
  }
}

// The weight panels of a tile at p0: P / 2 gate panels from p0 and the up panels of the same outputs
// (p0 + glu_half on) when Glu, else P panels from p0.
template <typename T, int P, bool Glu>
inline void tile_panels(const Shape<T>& s, int64_t p0, const typename T::W* (&w)[P]) {
  constexpr int Q = Glu ? P / 2 : P;
  for (int p = 0; p < P; ++p) w[p] = s.wp + (p0 + (p < Q ? p : s.glu_half + p - Q)) * s.stride();
}

// y[m0 .. m0 + R, panels p0 .. p0 + P]: the register tile. Glu: P / 2 gate panels from p0 and the up
// panels of the same outputs (p0 + glu_half on), stored as T::store_glu of each pair.
// Never inlined: inlined into a caller's loop (linear_codes.cpp's widening blocks) GCC allocated the
// registers of the whole function worse, and the gated MLP's tile ran at half the speed (AVX2, 2026-12-02).
template <typename T, int R, int P, bool Glu = false>
__attribute__((noinline)) void tile(const Shape<T>& s, int64_t m0, int64_t p0) {
  if constexpr (T::kOwnTile) {
    T::template tile<R, P, Glu>(s, m0, p0);
  } else {
    const typename T::X* x = s.x + m0 * s.steps;
    const typename T::W* w[P];
    tile_panels<T, P, Glu>(s, p0, w);
    vf acc[R][P];
    for (int r = 0; r < R; ++r)
      for (int p = 0; p < P; ++p) acc[r][p] = vf{};
    for (int64_t i = 0; i < s.steps; ++i) {
      vf wv[P];
      for (int p = 0; p < P; ++p) wv[p] = T::load_w(w[p], i, s.plane);
      for (int r = 0; r < R; ++r) {
        const vf xv = T::broadcast(x[r * s.steps + i]);
        for (int p = 0; p < P; ++p) acc[r][p] = T::step(acc[r][p], xv, wv[p]);
      }
    }
    store_tile<T, R, P, Glu>(s, m0, p0, acc);
  }
}

// Rows [m0, m1) x panels [p0, p0 + P): row tiles of T's rows (kGluRows for the gated MLP's), then 4, 2, 1.
template <typename T, int P, bool Glu = false>
inline void rows_tile(const Shape<T>& s, int64_t m0, int64_t m1, int64_t p0) {
  constexpr int kRows = Glu ? T::kGluRows : T::kTileRows;
  int64_t m = m0;
  for (; m + kRows <= m1; m += kRows) tile<T, kRows, P, Glu>(s, m, p0);
  if (m + 4 <= m1) tile<T, 4, P, Glu>(s, m, p0), m += 4;
  if (m + 2 <= m1) tile<T, 2, P, Glu>(s, m, p0), m += 2;
  if (m < m1) tile<T, 1, P, Glu>(s, m, p0);
}

// The block rows [m0, m1) x panels [p0, p1) of y (Glu: gate panels, each with its up panel: s.glu_half
// set, T has store_glu).
template <typename T, bool Glu = false>
void block(const Shape<T>& s, int64_t m0, int64_t m1, int64_t p0, int64_t p1) {
  int64_t p = p0;
  if constexpr (Glu) {
    constexpr int kPairs = T::kGluPairs;
    for (; p + kPairs <= p1; p += kPairs) rows_tile<T, 2 * kPairs, true>(s, m0, m1, p);
    for (; p < p1; ++p) rows_tile<T, 2, true>(s, m0, m1, p);
    return;
  }
  constexpr int kPanels = T::kTilePanels;
  for (; p + kPanels <= p1; p += kPanels) rows_tile<T, kPanels>(s, m0, m1, p);
  for (; p < p1; ++p) rows_tile<T, 1>(s, m0, m1, p);
}

// The same schedule for both dtypes: few rows stream W panel by panel; many rows go in cache blocks.
// Glu: panels counts y's (the gate's) panels; each brings its up panel along.
template <typename T, bool Glu = false>
void run_blocks(const Shape<T>& s, int64_t rows, int64_t panels, int64_t in_features) {
  auto block_fn = [&](int64_t m0, int64_t m1, int64_t p0, int64_t p1) { block<T, Glu>(s, m0, m1, p0, p1); };
  // y's panels a block takes (Glu: T::kGluPairs gate panels, each with its up panel)
  constexpr int64_t kPanels = Glu ? T::kGluPairs : T::kTilePanels;
  if (rows <= kFewRows) {  // bound by reading W: each panel once, a tile's panels at a time
    const int64_t groups = (panels + kPanels - 1) / kPanels;
    // a thread gets at least T::kMinMacsPerThread of work: waking a second thread for one decode-step
    // projection costs more than it saves (with the server's own threads on the same cores, far more)
    const int64_t group_macs = std::max<int64_t>(1, rows * in_features * kPanels * (Glu ? 2 : 1) * kLanes);
    const int64_t grain = std::max<int64_t>(2, T::kMinMacsPerThread / group_macs);
    parallel_chunks(groups, std::max<int64_t>(1, grain / 4), grain, [&](int64_t first, int64_t last) {
      for (int64_t g = first; g < last; ++g) block_fn(0, rows, g * kPanels, std::min(panels, (g + 1) * kPanels));
    });
    return;
  }
  const int64_t row_blocks = (rows + kBlockRows - 1) / kBlockRows;
  const int64_t panel_blocks = (panels + kPanels - 1) / kPanels;
  // panel-major: consecutive blocks of a chunk share their panels
  const int64_t num_blocks = row_blocks * panel_blocks;
  parallel_chunks(num_blocks, (num_blocks + 8 * at::get_num_threads() - 1) / (8 * at::get_num_threads()), 1,
                  [&](int64_t first, int64_t last) {
    for (int64_t i = first; i < last; ++i) {
      const int64_t pb = i / row_blocks, rb = i % row_blocks;
      block_fn(rb * kBlockRows, std::min(rows, (rb + 1) * kBlockRows), pb * kPanels,
               std::min(panels, (pb + 1) * kPanels));
    }
  });
}

// A linear's bias as fp32 zero-padded to whole panels of kLanes outputs (undefined without one): what
// every packed linear's store reads (linear_cpu.cpp, linear_codes.cpp, linear_qcodes.cpp).
inline at::Tensor padded_bias(const c10::optional<at::Tensor>& bias, int64_t panels, int64_t out_features) {
  if (!bias.has_value() || !bias->defined()) return {};
  TORCH_CHECK(bias->dim() == 1 && bias->size(0) == out_features, "bias must be [out_features]");
  auto b = at::zeros({panels * kLanes}, bias->options().dtype(at::kFloat));
  b.narrow(0, 0, out_features).copy_(*bias);
  return b;
}

}  // namespace kvserve_cpu

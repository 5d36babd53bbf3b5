// y = x W^T (+ b) in fp32 on CPU, for any number of rows, each row's result independent of the others.
//
// Every y[m, o] is one fused multiply-add chain over i = 0 .. in - 1 in order, started at 0, and then
// the bias is added. Nothing in that depends on how many rows the call has, how they are tiled or how
// many threads run, so a token's projections are bitwise the same in a decode step of 1 or 8 rows
// and in a prefill of 2,000. (torch's GEMM is not: on the dev machine its fp32 result for a row
// differed between 1 and 4+ rows.)
//
// W is packed once (`pack_linear_weight`) into panels of kLanes output features, [panels, in, kLanes]
// (the last panel zero-padded), so that vector lanes are outputs: y[m, panel] += x[m, i] * W[panel, i]
// needs one broadcast of x and one contiguous load of W per FMA of kLanes outputs, and no horizontal
// sum. Many rows: register tiles of 8 rows x 3 panels (24 accumulators, 11 loads per 24 FMAs) over
// cache blocks of 96 rows x 3 panels (the block's panels, 3 x in x kLanes floats, stay in L2 while the
// rows stream past). Up to 16 rows (decode steps): W streamed from memory once, panel by panel. Work
// runs on torch's threads. (Measured on the dev machine's AVX-512 core: about 1.4x the throughput of
// the same chains over W read in place with per-output horizontal sums.)
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>

#include "vec.h"

namespace {

using namespace kvserve_cpu;

constexpr int kTileRows = 8;
constexpr int kTilePanels = 3;
constexpr int64_t kBlockRows = 96;
constexpr int64_t kFewRows = 16;

struct Shape {
  const float* x;   // [rows, in]
  const float* wp;  // [panels, in, kLanes]
  const float* b;   // [panels * kLanes] zero-padded, or null
  float* y;         // [rows, out]
  int64_t in, out;
};

// y[m0 .. m0 + R, panels p0 .. p0 + P]: the register tile.
template <int R, int P>
inline void tile(const Shape& s, int64_t m0, int64_t p0) {
  const float* x = s.x + m0 * s.in;
  const float* w = s.wp + p0 * s.in * kLanes;
  vf acc[R][P];
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < P; ++p) acc[r][p] = vf{};
  for (int64_t i = 0; i < s.in; ++i) {
    vf wv[P];
    for (int p = 0; p < P; ++p) wv[p] = loadu(w + (p * s.in + i) * kLanes);
    for (int r = 0; r < R; ++r) {
      const vf xv = splat(x[r * s.in + i]);
      for (int p = 0; p < P; ++p) acc[r][p] = fmadd(xv, wv[p], acc[r][p]);
    }
  }
  for (int p = 0; p < P; ++p) {
    const int64_t o0 = (p0 + p) * kLanes, n = std::min<int64_t>(kLanes, s.out - o0);
    const vf bias = s.b ? loadu(s.b + o0) : vf{};
    for (int r = 0; r < R; ++r) {
      const vf v = s.b ? acc[r][p] + bias : acc[r][p];
      float* dst = s.y + (m0 + r) * s.out + o0;
      if (n == kLanes) {
        storeu(dst, v);
      } else {
        for (int64_t l = 0; l < n; ++l) dst[l] = v[l];
      }
    }
  }
}

// Rows [m0, m1) x panels [p0, p0 + P): row tiles of 8, then 4, 2, 1.
template <int P>
inline void rows_tile(const Shape& s, int64_t m0, int64_t m1, int64_t p0) {
  int64_t m = m0;
  for (; m + kTileRows <= m1; m += kTileRows) tile<kTileRows, P>(s, m, p0);
  if (m + 4 <= m1) tile<4, P>(s, m, p0), m += 4;
  if (m + 2 <= m1) tile<2, P>(s, m, p0), m += 2;
  if (m < m1) tile<1, P>(s, m, p0);
}

// The block rows [m0, m1) x panels [p0, p1).
void block(const Shape& s, int64_t m0, int64_t m1, int64_t p0, int64_t p1) {
  int64_t p = p0;
  for (; p + kTilePanels <= p1; p += kTilePanels) rows_tile<kTilePanels>(s, m0, m1, p);
  for (; p < p1; ++p) rows_tile<1>(s, m0, m1, p);
}

}  // namespace

at::Tensor pack_linear_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.device().is_cpu() && weight.scalar_type() == at::kFloat && weight.dim() == 2,
              "weight must be an fp32 CPU tensor [out_features, in_features]");
  const int64_t out = weight.size(0), in = weight.size(1), panels = (out + kLanes - 1) / kLanes;
  auto padded = at::zeros({panels * kLanes, in}, weight.options());
  padded.narrow(0, 0, out).copy_(weight);
  return padded.view({panels, kLanes, in}).transpose(1, 2).contiguous();  // [panels, in, kLanes]
}

at::Tensor row_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                      int64_t out_features) {
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu(), "row_linear runs on CPU tensors");
  TORCH_CHECK(x.scalar_type() == at::kFloat && packed.scalar_type() == at::kFloat, "row_linear is fp32");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be contiguous [rows, in_features]");
  TORCH_CHECK(packed.dim() == 3 && packed.is_contiguous() && packed.size(2) == kLanes &&
                  packed.size(0) * kLanes >= out_features && (packed.size(0) - 1) * kLanes < out_features,
              "packed must be pack_linear_weight(weight) of a weight with out_features rows");
  TORCH_CHECK(x.size(1) == packed.size(1), "in_features of x (", x.size(1), ") and weight (", packed.size(1),
              ") differ");
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->dim() == 1 && bias->size(0) == out_features,
                "bias must be fp32 [out_features]");
    b = at::zeros({packed.size(0) * kLanes}, bias->options());
    b.narrow(0, 0, out_features).copy_(*bias);
  }
  const int64_t rows = x.size(0), panels = packed.size(0);
  auto y = at::empty({rows, out_features}, x.options());
  if (rows == 0 || out_features == 0) return y;
  const Shape s{x.data_ptr<float>(), packed.data_ptr<float>(), b.defined() ? b.data_ptr<float>() : nullptr,
                y.data_ptr<float>(), x.size(1), out_features};
  if (rows <= kFewRows) {  // bound by reading W: each panel once, three at a time (three FMA chains)
    const int64_t groups = (panels + kTilePanels - 1) / kTilePanels;
    at::parallel_for(0, groups, 2, [&](int64_t first, int64_t last) {
      for (int64_t g = first; g < last; ++g) block(s, 0, rows, g * kTilePanels, std::min(panels, (g + 1) * kTilePanels));
    });
    return y;
  }
  const int64_t row_blocks = (rows + kBlockRows - 1) / kBlockRows;
  const int64_t panel_blocks = (panels + kTilePanels - 1) / kTilePanels;
  // panel-major: consecutive blocks of a thread share their panels
  at::parallel_for(0, row_blocks * panel_blocks, 1, [&](int64_t first, int64_t last) {
    for (int64_t i = first; i < last; ++i) {
      const int64_t pb = i / row_blocks, rb = i % row_blocks;
      block(s, rb * kBlockRows, std::min(rows, (rb + 1) * kBlockRows), pb * kTilePanels,
            std::min(panels, (pb + 1) * kTilePanels));
    }
  });
  return y;
}

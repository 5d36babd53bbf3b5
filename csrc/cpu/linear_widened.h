// Many rows over a weight kept in a compact format (linear_codes.cpp's int8 codes, linear_qcodes.cpp's
// packed bits): row_linear's blocks (linear_tiles.h run_blocks), each block's panels (Glu: gate panels
// and their up panels) widened to fp32 into the worker's scratch when the block's panels change, then
// row_linear's fp32 tiles over them. The widening is then about 1 % of a 96-row block's multiply-adds, and
// every output is row_linear's chain over the widened weights.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>

#include "linear_tiles.h"

namespace kvserve_cpu {

// s: the call's x, bias, y, steps (in_features), out and glu_half; widen(p, dst): weight panel p as fp32
// [steps, kLanes] at dst.
template <bool Glu, typename S, typename Widen>
void run_widened(const S& s, int64_t rows, int64_t panels, const Widen& widen) {
  constexpr int64_t kPanels = Glu ? Fp32::kGluPairs : Fp32::kTilePanels;
  constexpr int64_t kWidth = Glu ? 2 * kPanels : kPanels;  // weight panels a block reads
  const int64_t in = s.steps, row_blocks = (rows + kBlockRows - 1) / kBlockRows;
  const int64_t num_blocks = row_blocks * ((panels + kPanels - 1) / kPanels);
  struct Scratch {
    at::Tensor wt, bt;
    float* w;
    float* b;
    int64_t pb = -1;
  };
  auto make = [&] {
    Scratch sc{at::empty({kWidth * in * kLanes}, at::kFloat), at::empty({kWidth * kLanes}, at::kFloat), nullptr, nullptr, -1};
    sc.w = static_cast<float*>(sc.wt.data_ptr());
    sc.b = static_cast<float*>(sc.bt.data_ptr());
    return sc;
  };
  parallel_chunks_with(
      num_blocks, (num_blocks + 8 * at::get_num_threads() - 1) / (8 * at::get_num_threads()), 1, make,
      [&](Scratch& scratch, int64_t first, int64_t last) {
        for (int64_t i = first; i < last; ++i) {
          const int64_t pb = i / row_blocks, rb = i % row_blocks;  // panel-major, as run_blocks
          const int64_t p0 = pb * kPanels, np = std::min(panels, p0 + kPanels) - p0;
          if (scratch.pb != pb) {
            for (int64_t k = 0; k < np; ++k) {
              widen(p0 + k, scratch.w + k * in * kLanes);
              if (s.b) std::copy_n(s.b + (p0 + k) * kLanes, kLanes, scratch.b + k * kLanes);
              if constexpr (Glu) {
                widen(s.glu_half + p0 + k, scratch.w + (np + k) * in * kLanes);
                if (s.b) std::copy_n(s.b + (s.glu_half + p0 + k) * kLanes, kLanes, scratch.b + (np + k) * kLanes);
              }
            }
            scratch.pb = pb;
          }
          // the block's columns of y, over the scratch's panels
          Shape<Fp32> sub{s.x, scratch.w, s.b ? scratch.b : nullptr, s.y + p0 * kLanes, in, s.out - p0 * kLanes};
          sub.y_stride = s.out;
          if constexpr (Glu) sub.glu_half = np;
          block<Fp32, Glu>(sub, rb * kBlockRows, std::min(rows, (rb + 1) * kBlockRows), 0, np);
        }
      });
}

}  // namespace kvserve_cpu

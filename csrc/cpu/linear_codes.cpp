// y = x W^T (+ b) in fp32 over a weight kept as the int8 codes of its GGUF quantization
// (kvserve/models/gguf_codes.py): W[o, i] = fl(A[o, g] * C[o, i] + O[o, g]) for the group g = i / G of
// G (16 or 32) inputs, A and O fp32. For every GGUF format kvserve reads, A * C is exact in fp32, so
// that one fused multiply-add is bitwise the fp32 weight the converted model holds, and every y[m, o] is
// bitwise row_linear's chain over it (linear_cpu.cpp): the same result at 1 to 1.5 bytes a weight
// instead of 4.
//
// Packed once (`pack_linear_codes`) into row_linear's panels of kLanes outputs, one uint8 row per panel:
// the codes [in, kLanes] int8, then per group its A and O [in / G, 2, kLanes] fp32. G follows from the
// row's length and in_features.
// - Up to kFewRows rows (decode steps): the tile reads the panel in place and widens each step of codes
//   with its group's A and O (Codes::load_w): the bytes of W are what such a call waits on.
// - More rows (prefill): each block's panels are widened once into the worker's fp32 scratch, and
//   row_linear's tiles run over it: the widening is then about 1 % of a 96-row block's multiply-adds.
// Either way the same fp32 weights meet the same chain: batch invariant, and bitwise row_linear over
// the dequantized weight (tests/kernels/test_linear_codes.py).
// Models run linear_qcodes.cpp instead: the same weights and chains from the codes at their own width
// (0.6-1.07 bytes a weight); this layout stays as the reference the tests and bench_linear.py hold it to.
#include <torch/extension.h>

#include <algorithm>
#include <vector>

#include "linear_widened.h"

namespace {

using namespace kvserve_cpu;

// kLanes int8 codes -> fp32 lanes (exact)
inline vf widen_codes(const int8_t* p) {
#if defined(__AVX512F__)
  return reinterpret_cast<vf>(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))));
#elif defined(__AVX2__)
  return reinterpret_cast<vf>(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)))));
#else
  vf v;
  for (int l = 0; l < kLanes; ++l) v[l] = static_cast<float>(p[l]);
  return v;
#endif
}

template <int G>
struct Codes : WideningTileShape {
  using X = float;
  using W = int8_t;
  using Y = float;
  // a step costs a widening and a multiply-add more than fp32's: a second thread pays off sooner
  static constexpr int64_t kMinMacsPerThread = int64_t{1} << 19;
  static vf broadcast(float x) { return splat(x); }
  // plane: bytes from the panel's start to its groups' A and O
  static vf load_w(const int8_t* panel, int64_t i, int64_t plane) {
    const float* ao = reinterpret_cast<const float*>(panel + plane) + (i / G) * 2 * kLanes;
    return fmadd(loadu(ao), widen_codes(panel + i * kLanes), loadu(ao + kLanes));
  }
  static vf step(vf acc, vf x, vf w) { return Fp32::step(acc, x, w); }
  static void store(float* dst, vf v, int64_t n) { Fp32::store(dst, v, n); }
  static void store_glu(float* dst, vf g, vf u) { Fp32::store_glu(dst, g, u); }
};

// The group size of a packed row of `bytes` for in_features `in`, or 0 when it is not a packing of 16 or 32.
int64_t group_of(int64_t bytes, int64_t in) {
  const int64_t codes = in * kLanes, factors = bytes - codes;
  if (in <= 0 || factors <= 0 || factors % (8 * kLanes)) return 0;
  const int64_t groups = factors / (8 * kLanes);
  if (in % groups) return 0;
  const int64_t g = in / groups;
  return g == 16 || g == 32 ? g : 0;
}

int64_t checked_group(const at::Tensor& packed, int64_t in) {
  TORCH_CHECK(packed.device().is_cpu() && packed.scalar_type() == at::kByte && packed.dim() == 2 &&
                  packed.is_contiguous(),
              "packed must be pack_linear_codes' contiguous uint8 [panels, bytes]");
  const int64_t g = group_of(packed.size(1), in);
  TORCH_CHECK(g, "packed rows of ", packed.size(1), " bytes are not codes of ", in,
              " inputs in groups of 16 or 32 (in_features of x and weight differ?)");
  return g;
}

// panel `p` of s widened to fp32 [in, kLanes] at dst
template <int G>
void widen_panel(const Shape<Codes<G>>& s, int64_t p, float* dst) {
  const int8_t* panel = s.wp + p * s.stride();
  for (int64_t i = 0; i < s.steps; ++i) storeu(dst + i * kLanes, Codes<G>::load_w(panel, i, s.plane));
}

template <int G, bool Glu>
void run(const Shape<Codes<G>>& s, int64_t rows, int64_t panels) {
  if (rows <= kFewRows) {
    run_blocks<Codes<G>, Glu>(s, rows, panels, s.steps);
  } else {
    run_widened<Glu>(s, rows, panels, [&](int64_t p, float* dst) { widen_panel(s, p, dst); });
  }
}

template <bool Glu>
void dispatch(int64_t g, Shape<Codes<16>> s16, int64_t rows, int64_t panels) {
  if (g == 16) return run<16, Glu>(s16, rows, panels);
  const Shape<Codes<32>> s32{s16.x, s16.wp, s16.b, s16.y, s16.steps, s16.out, s16.plane, nullptr, s16.glu_half,
                             s16.panel_stride};
  run<32, Glu>(s32, rows, panels);
}

Shape<Codes<16>> shape_of(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& b, at::Tensor& y,
                          int64_t out) {
  const int64_t in = x.size(1);
  return Shape<Codes<16>>{x.data_ptr<float>(), reinterpret_cast<const int8_t*>(packed.data_ptr<uint8_t>()),
                          b.defined() ? b.data_ptr<float>() : nullptr, y.data_ptr<float>(), in, out, in * kLanes,
                          nullptr, 0, packed.size(1)};
}

void check_x(const at::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(),
              "x must be a contiguous fp32 CPU tensor [rows, in_features]");
}

}  // namespace

at::Tensor pack_linear_codes(const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& offset) {
  TORCH_CHECK(codes.device().is_cpu() && codes.scalar_type() == at::kChar && codes.dim() == 2,
              "codes must be an int8 CPU tensor [out_features, in_features]");
  const int64_t out = codes.size(0), in = codes.size(1), panels = (out + kLanes - 1) / kLanes;
  TORCH_CHECK(scale.scalar_type() == at::kFloat && offset.scalar_type() == at::kFloat && scale.dim() == 2 &&
                  scale.sizes() == offset.sizes() && scale.size(0) == out && scale.size(1) > 0 &&
                  in % scale.size(1) == 0,
              "scale and offset must be fp32 [out_features, groups], groups dividing in_features");
  const int64_t groups = scale.size(1), g = in / groups;
  TORCH_CHECK(g == 16 || g == 32, "codes come in groups of 16 or 32 inputs, not ", g);
  // codes [panels, kLanes, in] -> [panels, in * kLanes]; A and O [panels, kLanes, groups] -> [panels, groups, 2, kLanes]
  auto c = at::zeros({panels * kLanes, in}, codes.options());
  c.narrow(0, 0, out).copy_(codes);
  auto ao = at::zeros({2, panels * kLanes, groups}, scale.options());
  ao[0].narrow(0, 0, out).copy_(scale);
  ao[1].narrow(0, 0, out).copy_(offset);
  const at::Tensor c_panels = c.view({panels, kLanes, in}).transpose(1, 2).reshape({panels, in * kLanes});
  const at::Tensor ao_panels =
      ao.view({2, panels, kLanes, groups}).permute({1, 3, 0, 2}).reshape({panels, groups * 2 * kLanes});
  return at::cat({c_panels.view(at::kByte), ao_panels.contiguous().view(at::kByte)}, 1).contiguous();
}

// The packed codes widened to fp32 in row_linear's packed layout [panels, in, kLanes] (the reference the
// tests hold the kernel to, and what pack_linear_weight writes for the dequantized weight).
at::Tensor unpack_linear_codes(const at::Tensor& packed, int64_t in_features) {
  const int64_t g = checked_group(packed, in_features), panels = packed.size(0);
  auto w = at::empty({panels, in_features, kLanes}, packed.options().dtype(at::kFloat));
  const Shape<Codes<16>> s16{nullptr, reinterpret_cast<const int8_t*>(packed.data_ptr<uint8_t>()), nullptr, nullptr,
                             in_features, panels * kLanes, in_features * kLanes, nullptr, 0, packed.size(1)};
  for (int64_t p = 0; p < panels; ++p) {
    float* dst = w.data_ptr<float>() + p * in_features * kLanes;
    if (g == 16) {
      widen_panel(s16, p, dst);
    } else {
      const Shape<Codes<32>> s32{nullptr, s16.wp, nullptr, nullptr, s16.steps, s16.out, s16.plane, nullptr, 0,
                                 s16.panel_stride};
      widen_panel(s32, p, dst);
    }
  }
  return w;
}

at::Tensor row_linear_codes(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                            int64_t out_features) {
  check_x(x);
  const int64_t g = checked_group(packed, x.size(1)), rows = x.size(0), panels = packed.size(0);
  TORCH_CHECK(panels * kLanes >= out_features && (panels - 1) * kLanes < out_features,
              "packed must be the codes of a weight with out_features rows");
  const at::Tensor b = padded_bias(bias, panels, out_features);
  auto y = at::empty({rows, out_features}, x.options());
  if (rows == 0 || out_features == 0) return y;
  dispatch<false>(g, shape_of(x, packed, b, y, out_features), rows, panels);
  return y;
}

// row_linear_glu (linear_cpu.cpp) over codes: packed = the gate's and the up's packed codes concatenated
at::Tensor row_linear_glu_codes(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                                int64_t inter) {
  check_x(x);
  const int64_t g = checked_group(packed, x.size(1)), rows = x.size(0), panels = packed.size(0);
  TORCH_CHECK(inter > 0 && inter % kLanes == 0 && panels * kLanes == 2 * inter,
              "row_linear_glu: packed must be gate's and up's packed codes of inter (whole panels) outputs each");
  const at::Tensor b = padded_bias(bias, panels, 2 * inter);
  auto y = at::empty({rows, inter}, x.options());
  if (rows == 0) return y;
  Shape<Codes<16>> s = shape_of(x, packed, b, y, inter);
  s.glu_half = panels / 2;
  dispatch<true>(g, s, rows, panels / 2);
  return y;
}

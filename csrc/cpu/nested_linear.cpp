// y = (x W^T) * scale (+ b) in fp32 over NestedFP weights (kvserve/quant/nestedfp.py): the same tiled,
// row-invariant schedule as row_linear (linear_tiles.h), reading the weight's byte planes.
//
// W is packed once (`pack_nested_weight`) into [2, panels, in, kLanes] uint8, each plane in row_linear's
// panel order:
// - plane 0 holds the `hi` bytes (the E4M3 view of w * 2^8);
// - plane 1 holds the FP16 residual below it, r = m - ((hi & 0x7F) << 7) as an int8, m being the FP16
//   magnitude bits. That is a re-encoding of `lo` (the low mantissa byte), not a third copy: rounding
//   `hi` moved m by at most 64 ulps (127 where it saturated), so r always fits, and m and lo follow from
//   (hi, r) and back (tests/kernels/test_nested_linear.py). It makes FP16 mode one add away from FP8 mode.
// FP8 mode reads plane 0 only, 1 byte a weight; FP16 mode reads both, 2 bytes a weight.
//
// FP8 mode multiplies x rounded to bf16 (E4M3 weights are exact in bf16). Where the CPU has AVX-512 BF16
// it runs as bf16 pairs on vdpbf16ps (NestedFp8Pairs: two inputs a step, half the multiply instructions
// of the FMA chain, which is what bounds a batch of decode rows); elsewhere, and for an odd in_features,
// as the FMA chain below over the same products. Either way a row's result does not depend on the rows
// beside it. FP16 mode keeps fp32 x: its weights are not exact in bf16.
//
// The E4M3 byte of w * 2^8, its magnitude shifted up 7 under an FP16 sign, is the FP16 encoding of w
// itself (the exponent biases differ by 8: 15 - 7), subnormals included. So a step of weights is: widen
// the bytes to 16-bit lanes with their sign, shift by 7, clear the copy of the sign left at bit 14, (FP16
// mode: add the residual), and convert FP16 -> fp32 with F16C's vcvtph2ps, which is exact. The 16-bit
// work runs at half the vector width (one uop on CPUs that split 512-bit operations). Then every y[m, o]
// is one FMA chain over the inputs in order, times the row's power-of-two scale (exact), plus the bias:
// bitwise the chain row_linear computes over the dequantized weights (and, in FP8 mode, x rounded to
// bf16), whatever the rows.
//
// `unpack_nested_weight` writes that dequantized weight (scale applied) in row_linear's packed fp32
// layout, the same conversion once per weight instead of once per tile of rows: for prefill, where
// row_linear over it may beat converting inside every tile (scripts/bench_weights.py measures both).
#include <torch/extension.h>

#include <cstring>

#include "linear_tiles.h"

namespace {

using namespace kvserve_cpu;

// kLanes FP16 values (their bits) -> fp32 lanes, exactly
#if defined(__AVX512F__)
using vh = __m256i;
inline vf fp16_to_fp32(vh bits) { return reinterpret_cast<vf>(_mm512_cvtph_ps(bits)); }
// kLanes bytes sign-extended to 16-bit lanes
inline vh widen16(const uint8_t* p) { return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline vh fp8_to_fp16(vh b) { return _mm256_and_si256(_mm256_slli_epi16(b, 7), _mm256_set1_epi16(-0x4001)); }
inline vh add16(vh a, vh b) { return _mm256_add_epi16(a, b); }
#elif defined(__AVX2__)
using vh = __m128i;
inline vf fp16_to_fp32(vh bits) { return reinterpret_cast<vf>(_mm256_cvtph_ps(bits)); }
inline vh widen16(const uint8_t* p) { return _mm_cvtepi8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))); }
inline vh fp8_to_fp16(vh b) { return _mm_and_si128(_mm_slli_epi16(b, 7), _mm_set1_epi16(-0x4001)); }
inline vh add16(vh a, vh b) { return _mm_add_epi16(a, b); }
#else
struct vh {
  uint16_t v[kLanes];
};
inline vf fp16_to_fp32(vh bits) {
  vf out;
  for (int l = 0; l < kLanes; ++l) out[l] = static_cast<float>(c10::Half(bits.v[l], c10::Half::from_bits()));
  return out;
}
inline vh widen16(const uint8_t* p) {
  vh h;
  for (int l = 0; l < kLanes; ++l) h.v[l] = static_cast<uint16_t>(static_cast<int16_t>(static_cast<int8_t>(p[l])));
  return h;
}
inline vh fp8_to_fp16(vh b) {
  for (int l = 0; l < kLanes; ++l) b.v[l] = static_cast<uint16_t>((b.v[l] << 7) & 0xBFFF);
  return b;
}
inline vh add16(vh a, vh b) {
  for (int l = 0; l < kLanes; ++l) a.v[l] = static_cast<uint16_t>(a.v[l] + b.v[l]);
  return a;
}
#endif

struct NestedFp8 : Fp32 {
  using W = uint8_t;
  static constexpr int64_t kMinMacsPerThread = int64_t{1} << 18;
  // the sign-extended byte shifted by 7 has the sign at bits 15 and 14; clearing 14 leaves the FP16 of w
  static vf load_w(const uint8_t* panel, int64_t i, int64_t) {
    return fp16_to_fp32(fp8_to_fp16(widen16(panel + i * kLanes)));
  }
};

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
// FP8 mode as bf16 pairs for vdpbf16ps: an E4M3 value is exact in bf16 (3 mantissa bits of 7, and every
// E4M3 exponent, subnormals included, is a normal bf16 one), so a step takes two inputs: x's bf16 pair
// broadcast, and for each of the kLanes outputs the pair of its weights at those inputs, built from the
// plane's bytes with integer operations. One vdpbf16ps then does two multiply-adds per lane; the 16-bit
// work runs at the full vector width. W's unit is a byte pair so that the tile's step indexing (kLanes W
// per step) lands on the 2 kLanes bytes of inputs 2i and 2i + 1.
struct NestedFp8Pairs : DefaultTileShape {
  using X = uint32_t;
  using W = uint16_t;
  using Y = float;
  static constexpr int64_t kMinMacsPerThread = NestedFp8::kMinMacsPerThread;
  static vf broadcast(uint32_t x) { return splat_pair(x); }
  static vf step(vf acc, vf x, vf w) { return dot_pairs(acc, x, w); }
  static void store(float* dst, vf v, int64_t n) { Fp32::store(dst, v, n); }

  static vf load_w(const uint16_t* panel, int64_t i, int64_t) {
    const uint16_t* w = panel + i * kLanes;
    // [input 2i: lanes 0..15 | input 2i + 1: lanes 0..15], sign-extended to 16 bits, then paired by lane
    const __m512i s = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w)));
    const __m512i e = _mm512_permutexvar_epi16(interleave(), s);
    // a normal E4M3 byte: its 7 magnitude bits under bf16's exponent field, rebiased by 127 - 7 - 8 (the
    // 8 undoes the view's 2^8, so the value is w itself, as in FP16 mode)
    __m512i m = _mm512_add_epi16(_mm512_and_si512(_mm512_slli_epi16(e, 4), _mm512_set1_epi16(0x07F0)),
                                 _mm512_set1_epi16(112 << 7));
    // a subnormal (exponent field 0) one: m * 2^-9 * 2^-8, from a table indexed by its 3 mantissa bits
    const __mmask32 sub = _mm512_testn_epi16_mask(e, _mm512_set1_epi16(0x0078));
    m = _mm512_mask_permutexvar_epi16(m, sub, e, subnormals());
    // the sign from the byte (bit 15 of the sign-extended lane): bitwise select 0x8000 ? e : m
    return reinterpret_cast<vf>(_mm512_ternarylogic_epi32(_mm512_set1_epi16(static_cast<int16_t>(0x8000)), e, m, 0xCA));
  }

  static __m512i interleave() {  // 16-bit lane 2l <- l, 2l + 1 <- 16 + l
    alignas(64) static const int16_t idx[32] = {0, 16, 1, 17, 2,  18, 3,  19, 4,  20, 5,  21, 6,  22, 7,  23,
                                                8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
    return _mm512_load_si512(idx);
  }
  static __m512i subnormals() {  // entry m: the bf16 bits of m * 2^-17 (m = 0 .. 7; the rest unused)
    alignas(64) static const int16_t table[32] = {0, 0x3700, 0x3780, 0x37C0, 0x3800, 0x3820, 0x3840, 0x3860};
    return _mm512_load_si512(table);
  }
};
#endif

struct NestedFp16 : NestedFp8 {
  // the residual moves the magnitude below the sign: no carry reaches bit 15 (m stays below 0x3F80: |w| < 1.875)
  static vf load_w(const uint8_t* panel, int64_t i, int64_t plane) {
    const uint8_t* w = panel + i * kLanes;
    return fp16_to_fp32(add16(fp8_to_fp16(widen16(w)), widen16(w + plane)));
  }
};

// Each plane [panels, in, kLanes] contiguous; the planes any distance apart (a projection's planes are a
// slice of a concatenation's: kvserve/models/nested.py)
bool planes_laid_out(const at::Tensor& packed) {
  return packed.stride(3) == 1 && packed.stride(2) == kLanes && packed.stride(1) == packed.size(2) * kLanes;
}

at::Tensor padded(const at::Tensor& v, int64_t panels, int64_t out_features, const char* what) {
  TORCH_CHECK(v.dim() == 1 && v.size(0) == out_features, what, " must be [out_features]");
  if (out_features == panels * kLanes && v.scalar_type() == at::kFloat && v.is_contiguous()) {
    return v;  // whole panels: nothing to pad (a copy per call costs more than a decode row's small GEMV)
  }
  auto p = at::zeros({panels * kLanes}, v.options().dtype(at::kFloat));
  p.narrow(0, 0, out_features).copy_(v);
  return p;
}

}  // namespace

at::Tensor pack_nested_weight(const at::Tensor& hi, const at::Tensor& lo) {
  TORCH_CHECK(hi.device().is_cpu() && hi.scalar_type() == at::kByte && hi.dim() == 2 && lo.sizes() == hi.sizes() &&
                  lo.scalar_type() == at::kByte && lo.device().is_cpu(),
              "hi and lo must be uint8 CPU tensors [out_features, in_features] of one shape");
  const int64_t out = hi.size(0), in = hi.size(1), panels = (out + kLanes - 1) / kLanes;
  const at::Tensor h = hi.to(at::kInt).bitwise_and(0x7F), low = lo.to(at::kInt);
  // m = a << 8 | lo with a = (hi - (lo >> 7)) >> 1 (nestedfp.merge); the residual r = m - (hi << 7)
  const at::Tensor a = h.sub(low.bitwise_right_shift(7)).bitwise_right_shift(1);
  const at::Tensor residual = a.bitwise_left_shift(8).bitwise_or(low).sub(h.bitwise_left_shift(7));
  auto planes = at::zeros({2, panels * kLanes, in}, hi.options());
  planes[0].narrow(0, 0, out).copy_(hi);
  planes[1].narrow(0, 0, out).copy_(residual.to(at::kChar).view(at::kByte));
  return planes.view({2, panels, kLanes, in}).transpose(2, 3).contiguous();  // [2, panels, in, kLanes]
}

at::Tensor unpack_nested_weight(const at::Tensor& packed, const at::Tensor& scale, int64_t out_features, bool fp16) {
  TORCH_CHECK(packed.device().is_cpu() && packed.scalar_type() == at::kByte && packed.dim() == 4 &&
                  planes_laid_out(packed) && packed.size(0) == 2 && packed.size(3) == kLanes &&
                  packed.size(1) * kLanes >= out_features && (packed.size(1) - 1) * kLanes < out_features,
              "packed must be pack_nested_weight's planes of a weight with out_features rows");
  const int64_t panels = packed.size(1), in = packed.size(2), plane = packed.stride(0);
  const at::Tensor sc = padded(scale, panels, out_features, "scale");
  auto w = at::empty({panels, in, kLanes}, packed.options().dtype(at::kFloat));
  const uint8_t* src = packed.data_ptr<uint8_t>();
  float* dst = w.data_ptr<float>();
  const float* scales = sc.data_ptr<float>();
  parallel_chunks(panels, 1, std::max<int64_t>(1, (int64_t{1} << 20) / std::max<int64_t>(1, in * kLanes)),
                  [&](int64_t first, int64_t last) {
    for (int64_t p = first; p < last; ++p) {
      const vf s = loadu(scales + p * kLanes);
      for (int64_t i = 0; i < in; ++i) {
        const uint8_t* panel = src + p * in * kLanes;
        const vf v = fp16 ? NestedFp16::load_w(panel, i, plane) : NestedFp8::load_w(panel, i, plane);
        storeu(dst + (p * in + i) * kLanes, v * s);  // the row's power of two: exact
      }
    }
  });
  return w;
}

at::Tensor nested_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                         const c10::optional<at::Tensor>& bias, int64_t out_features, bool fp16) {
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu(), "nested_linear runs on CPU tensors");
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(),
              "x must be contiguous fp32 [rows, in_features]");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 4 && planes_laid_out(packed) &&
                  packed.size(0) == 2 && packed.size(3) == kLanes && packed.size(1) * kLanes >= out_features &&
                  (packed.size(1) - 1) * kLanes < out_features,
              "packed must be pack_nested_weight's planes of a weight with out_features rows");
  TORCH_CHECK(x.size(1) == packed.size(2), "in_features of x (", x.size(1), ") and weight (", packed.size(2),
              ") differ");
  const int64_t rows = x.size(0), panels = packed.size(1), in = x.size(1);
  const at::Tensor sc = padded(scale, panels, out_features, "scale");
  const at::Tensor b = bias.has_value() && bias->defined() ? padded(*bias, panels, out_features, "bias") : at::Tensor();
  auto y = at::empty({rows, out_features}, x.options());
  if (rows == 0 || out_features == 0) return y;
  const int64_t plane = packed.stride(0);
  if (fp16) {
    Shape<NestedFp16> s{x.data_ptr<float>(), packed.data_ptr<uint8_t>(), b.defined() ? b.data_ptr<float>() : nullptr,
                        y.data_ptr<float>(), in, out_features, plane, sc.data_ptr<float>()};
    run_blocks(s, rows, panels, in);
    return y;
  }
  // FP8 mode multiplies x rounded to bf16 (to nearest even): E4M3 weights are exact in bf16, so the
  // products are exact in fp32 and vdpbf16ps can take two inputs a step. Elsewhere (no AVX-512 BF16, or
  // an odd in_features) the same products go through the fp32 FMA chain.
  const at::Tensor xb = x.to(at::kBFloat16);
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  if (in % 2 == 0) {
    Shape<NestedFp8Pairs> s{reinterpret_cast<const uint32_t*>(xb.data_ptr<at::BFloat16>()),
                            reinterpret_cast<const uint16_t*>(packed.data_ptr<uint8_t>()),
                            b.defined() ? b.data_ptr<float>() : nullptr, y.data_ptr<float>(), in / 2, out_features,
                            plane / 2, sc.data_ptr<float>()};
    run_blocks(s, rows, panels, in);
    return y;
  }
#endif
  const at::Tensor xr = xb.to(at::kFloat);
  Shape<NestedFp8> s{xr.data_ptr<float>(), packed.data_ptr<uint8_t>(), b.defined() ? b.data_ptr<float>() : nullptr,
                     y.data_ptr<float>(), in, out_features, plane, sc.data_ptr<float>()};
  run_blocks(s, rows, panels, in);
  return y;
}

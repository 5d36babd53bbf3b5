// y = (x W^T) * scale (+ b) in fp32 over NestedFP weights (kvserve/quant/nestedfp.py): the same tiled,
// row-invariant schedule as row_linear (linear_tiles.h), reading the weight's byte planes.
//
// W is packed once (`pack_nested_weight`) into [2, panels, in, kLanes] uint8: plane 0 the `hi` bytes,
// plane 1 the `lo` bytes, each in row_linear's panel order. FP8 mode reads plane 0 only, 1 byte a
// weight; FP16 mode reads both, 2 bytes a weight, and rebuilds the FP16 magnitude
// (((hi & 0x7F) - (lo >> 7)) >> 1) << 8 | lo. Either magnitude, shifted under fp32's exponent field
// (E4M3 by 20, FP16 by 13) and read as a float, is the weight times 2^-112 (an fp32 denormal for the
// smallest ones); one multiply by 2^112 makes it the exact weight, zero and subnormals included. Then
// every y[m, o] is one FMA chain over the inputs in order, times the row's power-of-two scale (exact),
// plus the bias: bitwise the chain row_linear computes over the dequantized weights, whatever the rows.
//
// `unpack_nested_weight` writes that dequantized weight (scale applied) in row_linear's packed fp32
// layout, the same conversion once per weight instead of once per tile of rows: for prefill, where
// row_linear over it may beat converting inside every tile (scripts/bench_weights.py measures both).
#include <torch/extension.h>

#include <cstring>

#include "linear_tiles.h"

namespace {

using namespace kvserve_cpu;

// kLanes consecutive bytes, sign-extended to 32-bit lanes
inline vu widen_signed(const uint8_t* p) {
#if defined(__AVX512F__)
  return reinterpret_cast<vu>(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#elif defined(__AVX2__)
  return reinterpret_cast<vu>(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
#else
  vu v;
  for (int l = 0; l < kLanes; ++l) v[l] = static_cast<uint32_t>(static_cast<int32_t>(static_cast<int8_t>(p[l])));
  return v;
#endif
}

// kLanes consecutive bytes, zero-extended to 32-bit lanes
inline vu widen(const uint8_t* p) {
#if defined(__AVX512F__)
  return reinterpret_cast<vu>(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#elif defined(__AVX2__)
  return reinterpret_cast<vu>(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
#else
  vu v;
  for (int l = 0; l < kLanes; ++l) v[l] = p[l];
  return v;
#endif
}

inline vf weight_from_bits(vu bits) {
  vf v;
  std::memcpy(&v, &bits, sizeof(vf));
  return v * splat(0x1p112f);
}

struct NestedFp8 : Fp32 {
  using W = uint8_t;
  static vf load_w(const uint8_t* w, int64_t) {
    // sign-extended, the byte's sign lands on bits 27..31 after the shift and its magnitude on 20..26;
    // clearing bits 27..30 leaves sign | magnitude << 20 (three operations a vector)
    return weight_from_bits((widen_signed(w) << 20) & 0x87FFFFFFu);  // E4M3 / 2^8
  }
};

struct NestedFp16 : NestedFp8 {
  static vf load_w(const uint8_t* w, int64_t plane) {
    const vu h = widen(w), lo = widen(w + plane);
    const vu a = ((h & 0x7Fu) - (lo >> 7)) >> 1;  // never negative: hi's magnitude is 2a + (lo >> 7) + 0 or 1
    return weight_from_bits((((a << 8) | lo) << 13) | ((h & 0x80u) << 24));  // the FP16 value
  }
};

at::Tensor padded(const at::Tensor& v, int64_t panels, int64_t out_features, const char* what) {
  TORCH_CHECK(v.dim() == 1 && v.size(0) == out_features, what, " must be [out_features]");
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
  auto planes = at::zeros({2, panels * kLanes, in}, hi.options());
  planes[0].narrow(0, 0, out).copy_(hi);
  planes[1].narrow(0, 0, out).copy_(lo);
  return planes.view({2, panels, kLanes, in}).transpose(2, 3).contiguous();  // [2, panels, in, kLanes]
}

at::Tensor unpack_nested_weight(const at::Tensor& packed, const at::Tensor& scale, int64_t out_features, bool fp16) {
  TORCH_CHECK(packed.device().is_cpu() && packed.scalar_type() == at::kByte && packed.dim() == 4 &&
                  packed.is_contiguous() && packed.size(0) == 2 && packed.size(3) == kLanes &&
                  packed.size(1) * kLanes >= out_features && (packed.size(1) - 1) * kLanes < out_features,
              "packed must be pack_nested_weight's planes of a weight with out_features rows");
  const int64_t panels = packed.size(1), in = packed.size(2), plane = panels * in * kLanes;
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
        const int64_t at = (p * in + i) * kLanes;
        const vf v = fp16 ? NestedFp16::load_w(src + at, plane) : NestedFp8::load_w(src + at, plane);
        storeu(dst + at, v * s);  // the row's power of two: exact
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
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 4 && packed.is_contiguous() &&
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
  const int64_t plane = panels * in * kLanes;
  if (fp16) {
    Shape<NestedFp16> s{x.data_ptr<float>(), packed.data_ptr<uint8_t>(), b.defined() ? b.data_ptr<float>() : nullptr,
                        y.data_ptr<float>(), in, out_features, plane, sc.data_ptr<float>()};
    run_blocks(s, rows, panels, in);
  } else {
    Shape<NestedFp8> s{x.data_ptr<float>(), packed.data_ptr<uint8_t>(), b.defined() ? b.data_ptr<float>() : nullptr,
                       y.data_ptr<float>(), in, out_features, plane, sc.data_ptr<float>()};
    run_blocks(s, rows, panels, in);
  }
  return y;
}

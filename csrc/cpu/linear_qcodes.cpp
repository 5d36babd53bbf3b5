// y = x W^T (+ b) in fp32 over a GGUF linear's codes packed at their own width: the weights of
// linear_codes.cpp (W[o, i] = fl(A[o, g] * C[o, i] + O[o, g]), g = i / G, A * C exact; models/gguf_codes.py)
// from 4, 5, 6 or 8 bits of code a weight and compact factors, instead of 8 bits and fp32 A, O.
//
// Each packed row (one panel of kLanes outputs, as row_linear's) starts with a Format header, the same
// in every row, then planes of [.., kLanes] lanes:
//   codes, 8 bits: int8 C [in, kLanes];
//          4-6 bits: u = C - zero (0 <= u < 2^bits) as words: nib [in / 8, kLanes] uint32, bits 4s..4s+3
//          of word c the low 4 bits of u[8c + s]; 5 bits: hi [in / 32, kLanes] uint32, bit s of word c bit 4
//          of u[32c + s]; 6 bits: hi [in / 16, kLanes] uint32, bits 2s, 2s + 1 of word c bits 4, 5 of u[16c + s].
//          AVX-512 (16 lanes): hi instead [in, bits - 4] uint16 lane masks, bit l of mask k of step i bit
//          4 + k of u[i, lane l]: the kernel adds 16 (32) in those lanes with one masked add each.
//   factors of group g (O = -0.0 when the weight has no offsets, as formats without one store):
//     kF32    A, O fp32 [groups, kLanes]
//     kF16    A, O fp16 [groups, kLanes] (A and O exactly fp16: Q8_0, Q4_0, Q5_0, Q4_1, Q5_1)
//     kSuper  A = D[g / S] * s[g], O = E[g / S] * t[g]: D, E fp32 [groups / S, kLanes], s, t int8
//             [groups, kLanes] (the K-quants' super-block scale times 6-bit sub-scales; the product exact,
//             so it is bitwise A: the packer checks, models/code_layout.py)
// A weight step is then fmadd(A, C, O), C = float(u + zero) exactly: linear_codes.cpp's value, bitwise,
// and every output the same fp32 chain over it (so bitwise row_linear over the dequantized weight).
// Q5_0 at group 32 reads 0.69 bytes a weight (linear_codes.cpp: 1.25-1.5), Q4_K 0.59, Q6_K 0.83.
// - Up to kFewRows rows (decode): the tile (QCodes::tile) takes each group's factors once, then 8 steps
//   of codes from one word a panel (and one high-bits word), widened in registers.
// - More rows (prefill): each block's panels are widened to fp32 into the worker's scratch and
//   row_linear's tiles run over them (linear_widened.h), as linear_codes.cpp does.
#include <torch/extension.h>

#include <c10/util/Half.h>

#include <algorithm>
#include <cstring>
#include <utility>
#include <vector>

#include "linear_qcodes.h"
#include "linear_widened.h"

namespace {

using namespace kvserve_cpu;
using namespace kvserve_cpu::qcodes;

inline vu load_words(const uint8_t* p) {
  vu v;
  std::memcpy(&v, p, sizeof(vu));
  return v;
}
// kLanes int8 -> fp32 (exact). Not __builtin_convertvector of an int8 vector: GCC 12 widens that one
// lane at a time.
inline vf load_int8(const uint8_t* p) {
#if defined(__AVX512F__)
  return reinterpret_cast<vf>(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))));
#elif defined(__AVX2__)
  return reinterpret_cast<vf>(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)))));
#else
  vf v;
  for (int l = 0; l < kLanes; ++l) v[l] = static_cast<float>(static_cast<int8_t>(p[l]));
  return v;
#endif
}
// kLanes fp16 -> fp32 (exact)
inline vf load_half(const uint8_t* p) {
#if defined(__AVX512F__)
  return reinterpret_cast<vf>(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))));
#elif defined(__F16C__)
  return reinterpret_cast<vf>(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#else
  vf v;
  for (int l = 0; l < kLanes; ++l) {
    uint16_t h;
    std::memcpy(&h, p + 2 * l, 2);
    v[l] = c10::detail::fp16_ieee_to_fp32_value(h);
  }
  return v;
#endif
}

// Group g's A and O of one panel.
inline void factors(const Format& f, const uint8_t* panel, int64_t g, vf& a, vf& o) {
  const vf no_offset = splat(-0.0f);
  if (f.kind == kF32) {
    a = loadu(reinterpret_cast<const float*>(panel + f.a) + g * kLanes);
    o = f.offsets ? loadu(reinterpret_cast<const float*>(panel + f.o) + g * kLanes) : no_offset;
  } else if (f.kind == kF16) {
    a = load_half(panel + f.a + g * kLanes * 2);
    o = f.offsets ? load_half(panel + f.o + g * kLanes * 2) : no_offset;
  } else {
    const int64_t sb = g / f.super_groups;
    a = loadu(reinterpret_cast<const float*>(panel + f.a) + sb * kLanes) * load_int8(panel + f.a_sub + g * kLanes);
    o = f.offsets
            ? loadu(reinterpret_cast<const float*>(panel + f.o) + sb * kLanes) * load_int8(panel + f.o_sub + g * kLanes)
            : no_offset;
  }
}

// The words of the 8 steps from i0 (a multiple of 8) of one panel: nib, and hi shifted so that step
// i0 + s's high bits are at bit s (5 bits) or 2s (6 bits).
template <int Bits>
inline void load_chunk(const Format& f, const uint8_t* panel, int64_t i0, vu& nib, vu& hi) {
  if constexpr (Bits == 8) return;
  nib = load_words(panel + f.nib + (i0 / 8) * kLanes * 4);
#if defined(__AVX512F__)
  return;  // the high bits come as lane masks, one per step (code)
#endif
  if constexpr (Bits == 5) hi = load_words(panel + f.hi + (i0 / 32) * kLanes * 4) >> static_cast<uint32_t>(i0 % 32);
  if constexpr (Bits == 6) hi = load_words(panel + f.hi + (i0 / 16) * kLanes * 4) >> static_cast<uint32_t>(2 * (i0 % 16));
}

// What turns a code's bits u into C = u + zero in fp32, exactly. AVX-512: a table of C for u in [0, 16)
// (lo) that one permute reads by u's low 4 bits (it reads those only: the bits above need no mask).
// Otherwise: u's bits put into the mantissa of 2^23 (2^23 + u), minus 2^23 - zero (sub), both exact for
// |zero|, u < 2^8.
struct Lift {
  vf lo, sub;
};

inline Lift lift_of(const Format& f) {
  Lift t{vf{}, splat(8388608.0f - static_cast<float>(f.zero))};
  for (int l = 0; l < kLanes; ++l) t.lo[l] = static_cast<float>(f.zero + l);
  return t;
}

// C of step i0 + S as fp32, exactly (nib, hi: load_chunk's words).
template <int Bits, int S>
inline vf code(const Format& f, const uint8_t* panel, int64_t i0, vu nib, vu hi, const Lift& lift) {
  if constexpr (Bits == 8) {
    (void)nib, (void)hi, (void)lift;
    return load_int8(panel + f.nib + (i0 + S) * kLanes);
  } else {
    const vu low = S == 0 ? nib : nib >> static_cast<uint32_t>(4 * S);  // u's low 4 bits at bits 0-3
#if defined(__AVX512F__)
    // C of the low 4 bits from the table, then 16 (and 32) added in the lanes whose mask bit is set: exact
    vf c = reinterpret_cast<vf>(_mm512_permutexvar_ps(reinterpret_cast<__m512i>(low), reinterpret_cast<__m512>(lift.lo)));
    if constexpr (Bits >= 5) {
      const uint8_t* masks = panel + f.hi + (i0 + S) * (Bits - 4) * 2;
      __m512 v = reinterpret_cast<__m512>(c);
      uint16_t m[Bits - 4];
      std::memcpy(m, masks, sizeof m);
      v = _mm512_mask_add_ps(v, static_cast<__mmask16>(m[0]), v, _mm512_set1_ps(16.0f));
      if constexpr (Bits == 6) v = _mm512_mask_add_ps(v, static_cast<__mmask16>(m[1]), v, _mm512_set1_ps(32.0f));
      c = reinterpret_cast<vf>(v);
    }
    return c;
#endif
    vu u = S == 7 ? low : low & 15u;
    if constexpr (Bits == 5) u |= (S <= 4 ? hi << static_cast<uint32_t>(4 - S) : hi >> static_cast<uint32_t>(S - 4)) & 16u;
    if constexpr (Bits == 6)
      u |= (2 * S <= 4 ? hi << static_cast<uint32_t>(4 - 2 * S) : hi >> static_cast<uint32_t>(2 * S - 4)) & 48u;
    return reinterpret_cast<vf>(u | 0x4b000000u) - lift.sub;
  }
}

template <int Bits>
struct QCodes : WideningTileShape {
  using X = float;
  using W = uint8_t;
  using Y = float;
  static constexpr bool kOwnTile = true;
  // a step widens more than linear_codes.cpp's: a second thread pays off as soon
  static constexpr int64_t kMinMacsPerThread = int64_t{1} << 19;
  static void store(float* dst, vf v, int64_t n) { Fp32::store(dst, v, n); }
  static void store_glu(float* dst, vf g, vf u) { Fp32::store_glu(dst, g, u); }

  // linear_tiles.h's tile over this format: y[m0 .. m0 + R, panels p0 .. p0 + P], each output the chain
  // acc = fmadd(x[i], fmadd(A, C[i], O), acc) over i in order from 0, as `tile` computes it.
  template <int R, int P, bool Glu>
  static void tile(const Shape<QCodes>& s, int64_t m0, int64_t p0) {
    const float* x = s.x + m0 * s.steps;
    const uint8_t* w[P];
    tile_panels<QCodes, P, Glu>(s, p0, w);
    Format f;
    std::memcpy(&f, w[0], sizeof f);
    const Lift lift = lift_of(f);
    vf acc[R][P];
    for (int r = 0; r < R; ++r)
      for (int p = 0; p < P; ++p) acc[r][p] = vf{};
    for (int64_t g = 0; g * f.group < s.steps; ++g) {
      vf a[P], o[P];
      for (int p = 0; p < P; ++p) factors(f, w[p], g, a[p], o[p]);
      for (int64_t i0 = g * f.group; i0 < (g + 1) * f.group; i0 += 8) {
        if constexpr (R >= 4) {
          // the chunk's weights widened into L1 first, panel by panel: the multiply-adds of many rows
          // then take them as memory operands, and the accumulators keep the registers
          vf wv[8][P];
          for (int p = 0; p < P; ++p) {
            vu nib{}, hi{};
            load_chunk<Bits>(f, w[p], i0, nib, hi);
            widen_chunk<Bits>(f, w[p], i0, nib, hi, a[p], o[p], lift, wv, p, std::make_integer_sequence<int, 8>{});
          }
          for (int k = 0; k < 8; ++k) {
            for (int r = 0; r < R; ++r) {
              const vf xv = splat(x[r * s.steps + i0 + k]);
              for (int p = 0; p < P; ++p) acc[r][p] = fmadd(xv, wv[k][p], acc[r][p]);
            }
          }
        } else {
          vu nib[P], hi[P];
          for (int p = 0; p < P; ++p) load_chunk<Bits>(f, w[p], i0, nib[p], hi[p]);
          chunk<R, P>(f, x + i0, s.steps, w, i0, nib, hi, a, o, lift, acc, std::make_integer_sequence<int, 8>{});
        }
      }
    }
    store_tile<QCodes, R, P, Glu>(s, m0, p0, acc);
  }

  template <int B, int P, int... S>
  static inline void widen_chunk(const Format& f, const uint8_t* panel, int64_t i0, vu nib, vu hi, vf a, vf o,
                                 const Lift& lift, vf (&wv)[8][P], int p, std::integer_sequence<int, S...>) {
    ((wv[S][p] = fmadd(a, code<B, S>(f, panel, i0, nib, hi, lift), o)), ...);
  }

  template <int R, int P, int... S>
  static inline void chunk(const Format& f, const float* x, int64_t ldx, const uint8_t* const (&w)[P], int64_t i0,
                           const vu (&nib)[P], const vu (&hi)[P], const vf (&a)[P], const vf (&o)[P], const Lift& lift,
                           vf (&acc)[R][P], std::integer_sequence<int, S...>) {
    (step<R, P, S>(f, x, ldx, w, i0, nib, hi, a, o, lift, acc), ...);
  }

  template <int R, int P, int S>
  static inline void step(const Format& f, const float* x, int64_t ldx, const uint8_t* const (&w)[P], int64_t i0,
                          const vu (&nib)[P], const vu (&hi)[P], const vf (&a)[P], const vf (&o)[P], const Lift& lift,
                          vf (&acc)[R][P]) {
    vf wv[P];
    for (int p = 0; p < P; ++p) wv[p] = fmadd(a[p], code<Bits, S>(f, w[p], i0, nib[p], hi[p], lift), o[p]);
    for (int r = 0; r < R; ++r) {
      const vf xv = splat(x[r * ldx + S]);
      for (int p = 0; p < P; ++p) acc[r][p] = fmadd(xv, wv[p], acc[r][p]);
    }
  }
};

// panel's weights as fp32 [in, kLanes] at dst: fmadd(A, C, O) per step, the tile's values
template <int Bits>
void widen_panel(const Format& f, const uint8_t* panel, float* dst) {
  const Lift lift = lift_of(f);
  for (int64_t g = 0; g * f.group < f.in; ++g) {
    vf a, o;
    factors(f, panel, g, a, o);
    for (int64_t i0 = g * f.group; i0 < (g + 1) * f.group; i0 += 8) {
      vu nib{}, hi{};
      load_chunk<Bits>(f, panel, i0, nib, hi);
      float* d = dst + i0 * kLanes;
      storeu(d + 0 * kLanes, fmadd(a, code<Bits, 0>(f, panel, i0, nib, hi, lift), o));
      storeu(d + 1 * kLanes, fmadd(a, code<Bits, 1>(f, panel, i0, nib, hi, lift), o));
      storeu(d + 2 * kLanes, fmadd(a, code<Bits, 2>(f, panel, i0, nib, hi, lift), o));
      storeu(d + 3 * kLanes, fmadd(a, code<Bits, 3>(f, panel, i0, nib, hi, lift), o));
      storeu(d + 4 * kLanes, fmadd(a, code<Bits, 4>(f, panel, i0, nib, hi, lift), o));
      storeu(d + 5 * kLanes, fmadd(a, code<Bits, 5>(f, panel, i0, nib, hi, lift), o));
      storeu(d + 6 * kLanes, fmadd(a, code<Bits, 6>(f, panel, i0, nib, hi, lift), o));
      storeu(d + 7 * kLanes, fmadd(a, code<Bits, 7>(f, panel, i0, nib, hi, lift), o));
    }
  }
}

void widen_any(const Format& f, const uint8_t* panel, float* dst) {
  switch (f.bits) {
    case 4: return widen_panel<4>(f, panel, dst);
    case 5: return widen_panel<5>(f, panel, dst);
    case 6: return widen_panel<6>(f, panel, dst);
    default: return widen_panel<8>(f, panel, dst);
  }
}

// The format of packed's rows: every row's header the same, and describing rows of this length.
Format checked_format(const at::Tensor& packed, int64_t in_features) {
  TORCH_CHECK(packed.device().is_cpu() && packed.scalar_type() == at::kByte && packed.dim() == 2 &&
                  packed.is_contiguous() && packed.size(1) >= static_cast<int64_t>(sizeof(Format)) &&
                  packed.size(0) > 0,
              "packed must be pack_linear_qcodes' contiguous uint8 [panels, bytes]");
  const uint8_t* rows = packed.data_ptr<uint8_t>();
  Format f;
  std::memcpy(&f, rows, sizeof f);
  TORCH_CHECK(f.magic == kMagic && f.row_bytes == packed.size(1), "packed rows are not pack_linear_qcodes' rows");
  TORCH_CHECK(f.in == in_features, "packed codes are of ", f.in, " inputs, x has ", in_features);
  // the last row too (the first of another weight's concatenated after this one's); models/cpu_linear.py
  // concatenates only weights of one layout
  TORCH_CHECK(std::memcmp(rows + (packed.size(0) - 1) * f.row_bytes, rows, sizeof f) == 0,
              "packed rows of different formats (weights of different layouts concatenated?)");
  return f;
}

template <int Bits, bool Glu>
void run(const Shape<QCodes<Bits>>& s, int64_t rows, int64_t panels) {
  if (rows <= kFewRows) {
    run_blocks<QCodes<Bits>, Glu>(s, rows, panels, s.steps);
  } else {
    Format f;
    std::memcpy(&f, s.wp, sizeof f);
    run_widened<Glu>(s, rows, panels, [&](int64_t p, float* dst) { widen_panel<Bits>(f, s.wp + p * s.stride(), dst); });
  }
}

template <bool Glu>
void dispatch(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& b, at::Tensor& y, int64_t out,
              int64_t bits, int64_t glu_half, int64_t panels) {
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  auto go = [&](auto tag) {
    constexpr int kBits = decltype(tag)::value;
    Shape<QCodes<kBits>> s{x.data_ptr<float>(), packed.data_ptr<uint8_t>(), bp, y.data_ptr<float>(), x.size(1), out};
    s.glu_half = glu_half;
    s.panel_stride = packed.size(1);
    run<kBits, Glu>(s, x.size(0), panels);
  };
  switch (bits) {
    case 4: return go(std::integral_constant<int, 4>{});
    case 5: return go(std::integral_constant<int, 5>{});
    case 6: return go(std::integral_constant<int, 6>{});
    default: return go(std::integral_constant<int, 8>{});
  }
}

void check_x(const at::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(),
              "x must be a contiguous fp32 CPU tensor [rows, in_features]");
}

}  // namespace

// The packed codes widened to fp32 in row_linear's packed layout [panels, in, kLanes]: the reference the
// tests hold the kernel to (pack_linear_weight of the dequantized weight).
at::Tensor unpack_linear_qcodes(const at::Tensor& packed, int64_t in_features) {
  const Format f = checked_format(packed, in_features);
  const int64_t panels = packed.size(0);
  auto w = at::empty({panels, in_features, kLanes}, at::kFloat);
  for (int64_t p = 0; p < panels; ++p) {
    widen_any(f, packed.data_ptr<uint8_t>() + p * f.row_bytes, w.data_ptr<float>() + p * in_features * kLanes);
  }
  return w;
}

// Bytes a packed row holds per weight: what a decode step reads.
double qcodes_bytes_per_weight(const at::Tensor& packed, int64_t in_features) {
  const Format f = checked_format(packed, in_features);
  return static_cast<double>(f.row_bytes) / static_cast<double>(in_features * kLanes);
}

at::Tensor row_linear_qcodes(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                             int64_t out_features) {
  check_x(x);
  const Format f = checked_format(packed, x.size(1));
  const int64_t rows = x.size(0), panels = packed.size(0);
  TORCH_CHECK(panels * kLanes >= out_features && (panels - 1) * kLanes < out_features,
              "packed must be the codes of a weight with out_features rows");
  const at::Tensor b = padded_bias(bias, panels, out_features);
  auto y = at::empty({rows, out_features}, x.options());
  if (rows == 0 || out_features == 0) return y;
  dispatch<false>(x, packed, b, y, out_features, f.bits, 0, panels);
  return y;
}

// row_linear_glu (linear_cpu.cpp) over packed codes: packed = the gate's and the up's concatenated
at::Tensor row_linear_glu_qcodes(const at::Tensor& x, const at::Tensor& packed,
                                 const c10::optional<at::Tensor>& bias, int64_t inter) {
  check_x(x);
  const Format f = checked_format(packed, x.size(1));
  const int64_t rows = x.size(0), panels = packed.size(0);
  TORCH_CHECK(inter > 0 && inter % kLanes == 0 && panels * kLanes == 2 * inter,
              "row_linear_glu: packed must be gate's and up's packed codes of inter (whole panels) outputs each");
  const at::Tensor b = padded_bias(bias, panels, 2 * inter);
  auto y = at::empty({rows, inter}, x.options());
  if (rows == 0) return y;
  dispatch<true>(x, packed, b, y, inter, f.bits, panels / 2, panels / 2);
  return y;
}

// Output features per panel of every packed linear weight here (the vector's fp32 lanes).
int64_t linear_lanes() { return kLanes; }

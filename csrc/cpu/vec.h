// Vector helpers shared by the CPU kernels: GCC vector extensions sized to the ISA the extension is
// compiled for (kvserve/kernels/cpu_ext.py passes the flags of torch's CPU capability).
//
// Arithmetic is spelled out: the extension is compiled with -ffp-contract=off, so a multiply-add is
// fused exactly where `fmadd` says so and nowhere else. The kernels' batch invariance rests on each
// output element being computed by one fixed sequence of operations whatever the tiling around it.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace kvserve_cpu {

#if defined(__AVX512F__)
constexpr int kLanes = 16;
#elif defined(__AVX2__)
constexpr int kLanes = 8;
#else
constexpr int kLanes = 4;
#endif
typedef float vf __attribute__((vector_size(kLanes * sizeof(float))));
typedef int32_t vi __attribute__((vector_size(kLanes * sizeof(int32_t))));
typedef uint32_t vu __attribute__((vector_size(kLanes * sizeof(uint32_t))));

inline vf loadu(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof(vf));
  return v;
}
inline void storeu(float* p, vf v) { std::memcpy(p, &v, sizeof(vf)); }
// x in every lane: one broadcast (from memory where x is there). Not `vf{} + x`: under
// -ffp-contract=off that is an add the compiler must keep (0 + -0 is +0) before the broadcast, an
// extra instruction per x in the linears' inner loops.
inline vf splat(float x) {
#if defined(__AVX512F__)
  return reinterpret_cast<vf>(_mm512_set1_ps(x));
#elif defined(__AVX2__)
  return reinterpret_cast<vf>(_mm256_set1_ps(x));
#else
  return vf{x, x, x, x};
#endif
}

// a * b + c, rounded once where the ISA has FMA (every AVX2 / AVX-512 CPU), else twice.
inline vf fmadd(vf a, vf b, vf c) {
#if defined(__AVX512F__)
  return reinterpret_cast<vf>(_mm512_fmadd_ps(reinterpret_cast<__m512>(a), reinterpret_cast<__m512>(b),
                                              reinterpret_cast<__m512>(c)));
#elif defined(__FMA__)
  return reinterpret_cast<vf>(_mm256_fmadd_ps(reinterpret_cast<__m256>(a), reinterpret_cast<__m256>(b),
                                              reinterpret_cast<__m256>(c)));
#else
  return a * b + c;
#endif
}

// The sum of a vector's lanes by halving (lanes i and i + n/2, then again): one fixed order.
inline float hsum(vf v) {
#if defined(__AVX512F__)
  const __m512 x = reinterpret_cast<__m512>(v);
  const __m256 h8 = _mm256_add_ps(_mm512_castps512_ps256(x), _mm512_extractf32x8_ps(x, 1));
#elif defined(__AVX2__)
  const __m256 h8 = reinterpret_cast<__m256>(v);
#endif
#if defined(__AVX2__)
  const __m128 h4 = _mm_add_ps(_mm256_castps256_ps128(h8), _mm256_extractf128_ps(h8, 1));
  const __m128 h2 = _mm_add_ps(h4, _mm_movehl_ps(h4, h4));
  const __m128 h1 = _mm_add_ss(h2, _mm_movehdup_ps(h2));
  return _mm_cvtss_f32(h1);
#else
  return (v[0] + v[2]) + (v[1] + v[3]);
#endif
}

// bf16 pairs: two bf16 values in one 32-bit lane (the first in the low half), as vdpbf16ps reads them.
inline vf splat_pair(uint32_t pair) {
  const vi bits = vi{} + static_cast<int32_t>(pair);
  vf v;
  std::memcpy(&v, &bits, sizeof(vf));
  return v;
}
inline vf load_pairs(const uint32_t* p) {
  vf v;
  std::memcpy(&v, p, sizeof(vf));
  return v;
}

// acc + x0 * w0 + x1 * w1 in each 32-bit lane, for the bf16 pairs (x0, x1) of x and (w0, w1) of w: one
// vdpbf16ps where the CPU has AVX-512 BF16, else the pair widened to fp32 and two FMAs. (The products
// of two bf16 values are exact in fp32; either way a lane's result depends on its own inputs only.)
inline vf dot_pairs(vf acc, vf x, vf w) {
#if defined(__AVX512BF16__) && defined(__AVX512F__)
  return reinterpret_cast<vf>(_mm512_dpbf16_ps(reinterpret_cast<__m512>(acc), (__m512bh)reinterpret_cast<__m512i>(x),
                                               (__m512bh)reinterpret_cast<__m512i>(w)));
#else
  const vi mask = vi{} + static_cast<int32_t>(0xffff0000u);
  const vi wb = reinterpret_cast<vi>(w), xb = reinterpret_cast<vi>(x);
  const vf w0 = reinterpret_cast<vf>(wb << 16), w1 = reinterpret_cast<vf>(wb & mask);
  const vf x0 = reinterpret_cast<vf>(xb << 16), x1 = reinterpret_cast<vf>(xb & mask);
  return fmadd(x1, w1, fmadd(x0, w0, acc));
#endif
}

// The bf16 bit patterns of finite floats, rounded to nearest even with integer operations (the same on
// every ISA, denormals included), in the low 16 bits of each lane.
inline vu bf16_bits(vf x) {
  vu b;
  std::memcpy(&b, &x, sizeof(vf));
  return (b + 0x7fffu + ((b >> 16) & 1u)) >> 16;
}

// exp(x) for x <= 0 (scores minus their running max), lane-wise: Cephes expf polynomial, about 1 ulp.
// Below -87 it returns ~1e-38 rather than 0, which no softmax sum can notice.
inline vf exp_nonpositive(vf x) {
  const vf lo = splat(-87.0f);
  x = x < lo ? lo : x;
  const vf magic = splat(12582912.0f);  // 1.5 * 2^23: adding it rounds to the nearest integer
  const vf n = fmadd(x, splat(1.44269504088896341f), magic) - magic;
  const vf r = fmadd(n, splat(2.12194440e-4f), fmadd(n, splat(-0.693359375f), x));
  vf poly = splat(1.9875691500e-4f);
  poly = fmadd(poly, r, splat(1.3981999507e-3f));
  poly = fmadd(poly, r, splat(8.3334519073e-3f));
  poly = fmadd(poly, r, splat(4.1665795894e-2f));
  poly = fmadd(poly, r, splat(1.6666665459e-1f));
  poly = fmadd(poly, r, splat(5.0000001201e-1f));
  poly = fmadd(poly * r, r, r) + 1.0f;
#if defined(__AVX512F__)
  // poly * 2^n in one instruction: exact, as the multiply below (n >= -126 after the clamp, and the
  // result stays normal: at x = -87, r ~ 0.34 and poly ~ 1.4)
  return reinterpret_cast<vf>(_mm512_scalef_ps(reinterpret_cast<__m512>(poly), reinterpret_cast<__m512>(n)));
#else
  const vi bits = (__builtin_convertvector(n, vi) + 127) << 23;
  vf pow2;
  std::memcpy(&pow2, &bits, sizeof(vf));
  return poly * pow2;
#endif
}

// 2^y for y <= 0 (or -inf), for the softmax's probabilities: within 3e-6 of 2^y relative, exactly 1 at 0
// (a degree-4 polynomial of 2^f on [-1/2, 1/2] with constant term 1, fitted for relative error), far
// inside the probabilities' rounding to bf16 (2^-9) that P V uses. y is clamped at -125, so the result is
// at least ~2e-38 and never denormal: 2^n times the polynomial, n = y rounded to the nearest integer
// (ties to even), f the rest.
inline vf exp2_probability(vf y) {
  const vf lo = splat(-125.0f);
  y = y < lo ? lo : y;
#if defined(__AVX512F__)
  const vf n = reinterpret_cast<vf>(_mm512_roundscale_ps(reinterpret_cast<__m512>(y), _MM_FROUND_TO_NEAREST_INT));
#else
  const vf magic = splat(12582912.0f);  // 1.5 * 2^23: adding it rounds to the nearest integer, ties to even
  const vf n = (y + magic) - magic;
#endif
  const vf f = y - n;
  vf p = splat(9.582851082086563e-3f);
  p = fmadd(p, f, splat(5.5906426161527634e-2f));
  p = fmadd(p, f, splat(2.4024099111557007e-1f));
  p = fmadd(p, f, splat(6.931241750717163e-1f));
  p = fmadd(p, f, splat(1.0f));
#if defined(__AVX512F__)
  return reinterpret_cast<vf>(_mm512_scalef_ps(reinterpret_cast<__m512>(p), reinterpret_cast<__m512>(n)));
#else
  const vi bits = (__builtin_convertvector(n, vi) + 127) << 23;  // exact, as VSCALEFPS: n >= -125
  vf pow2;
  std::memcpy(&pow2, &bits, sizeof(vf));
  return p * pow2;
#endif
}

// silu(g) = g / (1 + exp(-g)) lane-wise, exp by exp_nonpositive's polynomial (which covers x < 88 as
// well): exp(-g) is +inf for g < -88 (silu -0, as torch's), ~1e-38 for g > 87 (silu g).
inline vf silu(vf g) {
  const vf x = -g, hi = splat(88.0f);
  const vf e = exp_nonpositive(x < hi ? x : hi);
  const vf inf = splat(__builtin_huge_valf());
  return g / (splat(1.0f) + (x < hi ? e : inf));
}

// bf16 bits (the low 16 of each lane) widened to fp32.
inline vf widen_bits(vu h) {
  const vu b = h << 16;
  vf r;
  std::memcpy(&r, &b, sizeof(vf));
  return r;
}

// x rounded to bf16 (bf16_bits) and widened back to fp32.
inline vf round_bf16(vf x) { return widen_bits(bf16_bits(x)); }

// x's bf16 bits as at::BFloat16(x) rounds: to nearest even (bf16_bits), a NaN to the quiet NaN 0x7fc0.
inline vu bf16_bits_of(vf x) { return x == x ? bf16_bits(x) : vu{} + 0x7fc0u; }

// The low 16 bits of the first n (<= kLanes) lanes of h, stored as n consecutive bf16.
inline void store_bf16_bits(void* dst, vu h, int64_t n) {
  typedef uint16_t vh __attribute__((vector_size(kLanes * sizeof(uint16_t))));
  const vh narrow = __builtin_convertvector(h, vh);
  std::memcpy(dst, &narrow, n * sizeof(uint16_t));
}

// The gated MLP's silu(g) * u over bf16 operands as torch's bf16 ops compute it: the SiLU rounded to
// bf16, then the product in fp32 (the caller rounds it once).
inline vf glu_bf16(vf g, vf u) { return round_bf16(silu(g)) * u; }

inline float hmax(vf v) {
#if defined(__AVX512F__)
  return _mm512_reduce_max_ps(reinterpret_cast<__m512>(v));  // max is exact: any order gives the same
#else
  float r = v[0];
  for (int i = 1; i < kLanes; ++i) r = v[i] > r ? v[i] : r;
  return r;
#endif
}

}  // namespace kvserve_cpu

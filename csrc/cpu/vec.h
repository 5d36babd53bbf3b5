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

inline vf loadu(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof(vf));
  return v;
}
inline void storeu(float* p, vf v) { std::memcpy(p, &v, sizeof(vf)); }
inline vf splat(float x) { return vf{} + x; }

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

inline float hmax(vf v) {
  float r = v[0];
  for (int i = 1; i < kLanes; ++i) r = v[i] > r ? v[i] : r;
  return r;
}

}  // namespace kvserve_cpu

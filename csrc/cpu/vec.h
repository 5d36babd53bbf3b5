// Vector helpers shared by the CPU kernels: GCC vector extensions sized to the ISA the extension is
// compiled for (kvserve/kernels/cpu_ext.py passes the flags of torch's CPU capability).
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

inline float hsum(vf v) {
#if defined(__AVX512F__)
  return _mm512_reduce_add_ps(reinterpret_cast<__m512>(v));
#else
  float r = 0.f;
  for (int i = 0; i < kLanes; ++i) r += v[i];
  return r;
#endif
}

}  // namespace kvserve_cpu

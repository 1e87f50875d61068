// The float32 vector every kernel computes with: 16 lanes (one AVX-512 register, two AVX2 ones;
// GCC vector extensions with -march=native pick the instructions).
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace mlxd {

constexpr int LANES = 16;

typedef float f32x16 __attribute__((vector_size(64)));
typedef int32_t i32x16 __attribute__((vector_size(64)));

inline f32x16 load_f32(const float* p) {
  f32x16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline float hsum(f32x16 v) {
#if defined(__AVX512F__)
  return _mm512_reduce_add_ps((__m512)v);
#else
  float s = 0.0f;
  for (int lane = 0; lane < LANES; ++lane) {
    s += v[lane];
  }
  return s;
#endif
}

}  // namespace mlxd

// The row-wise kernels, per ISA variant: RMSNorm (the op: rms_norm.cpp) and SwiGLU (swiglu.cpp).
// Plain loops the compiler vectorises at the variant's width.
#include <cmath>

#include "simd.h"
#include "variant.h"

namespace mlxd {
namespace MLXD_ISA {

namespace {

// Eigen's generic_fast_tanh_float: tanh(v) = v · P(v²) / Q(v²) on [-CLAMP, CLAMP].
constexpr float CLAMP = 7.90531110763549805f;
constexpr float P[] = {-2.76076847742355e-16f, 2.00018790482477e-13f, -8.60467152213735e-11f,
                       5.12229709037114e-08f,  1.48572235717979e-05f, 6.37261928875436e-04f,
                       4.89352455891786e-03f};
constexpr float Q[] = {1.19825839466702e-06f, 1.18534705686654e-04f, 2.26843463243900e-03f,
                       4.89352518554385e-03f};

inline float swiglu_one(float g, float x) {
  const float half = 0.5f * g;
  const float v = half < -CLAMP ? -CLAMP : half > CLAMP ? CLAMP : half;
  const float v2 = v * v;
  float p = P[0];
  for (int i = 1; i < 7; ++i) {
    p = p * v2 + P[i];
  }
  float q = Q[0];
  for (int i = 1; i < 4; ++i) {
    q = q * v2 + Q[i];
  }
  return 0.5f * g * (1.0f + v * p / q) * x;
}

}  // namespace

void rms_norm(const float* x, const float* weight, float* y, size_t rows, int D, float eps) {
  for (size_t r = 0; r < rows; ++r) {
    const float* in = x + r * D;
    float* out = y + r * D;
    float squares = 0.0f;
#pragma omp simd reduction(+ : squares)
    for (int d = 0; d < D; ++d) {
      squares += in[d] * in[d];
    }
    const float inv = 1.0f / std::sqrt(squares / D + eps);
#pragma omp simd
    for (int d = 0; d < D; ++d) {
      out[d] = in[d] * inv * weight[d];
    }
  }
}

void swiglu(const float* gate, const float* x, float* y, size_t n) {
#pragma omp simd
  for (size_t i = 0; i < n; ++i) {
    y[i] = swiglu_one(gate[i], x[i]);
  }
}

}  // namespace MLXD_ISA
}  // namespace mlxd

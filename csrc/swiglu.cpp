// SwiGLU, silu(gate) · x, in one pass.
//
// mlxd.models.activations.swiglu_rational computes the same function (Eigen's rational tanh,
// sigmoid(g) = (1 + tanh(g / 2)) / 2) as an mx.compile'd graph, which MLX's CPU backend runs as
// four compiled kernels, a multiply and their broadcasts: five graph nodes a layer, 150 of a
// SmolLM2 decode step, each a dispatch. Here it is one, with the same coefficients.
#include "swiglu.h"

#include <algorithm>
#include <stdexcept>

#include "mlx/ops.h"

namespace mx = mlx::core;

namespace mlxd {

namespace {

// Eigen's generic_fast_tanh_float: tanh(v) = v · P(v²) / Q(v²) on [-CLAMP, CLAMP].
constexpr float CLAMP = 7.90531110763549805f;
constexpr float P[] = {-2.76076847742355e-16f, 2.00018790482477e-13f, -8.60467152213735e-11f,
                       5.12229709037114e-08f,  1.48572235717979e-05f, 6.37261928875436e-04f,
                       4.89352455891786e-03f};
constexpr float Q[] = {1.19825839466702e-06f, 1.18534705686654e-04f, 2.26843463243900e-03f,
                       4.89352518554385e-03f};

inline float swiglu_one(float g, float x) {
  const float v = std::clamp(0.5f * g, -CLAMP, CLAMP);
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

mx::array swiglu(const mx::array& gate, const mx::array& x) {
  if (gate.dtype() != mx::float32 || x.dtype() != mx::float32 || gate.shape() != x.shape()) {
    throw std::invalid_argument("swiglu: float32 gate and x of one shape");
  }
  auto stream = mx::default_stream(mx::Device::cpu);
  return mx::array(gate.shape(), mx::float32, std::make_shared<SwiGLU>(stream), {gate, x});
}

void SwiGLU::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  auto& encoder = prepare(inputs, outputs);
  encoder.dispatch([gp = rows<float>(inputs[0], encoder),
                    xp = rows<float>(inputs[1], encoder),
                    yp = outputs[0].data<float>(),
                    n = outputs[0].size()]() {
#pragma omp simd
    for (size_t i = 0; i < n; ++i) {
      yp[i] = swiglu_one(gp[i], xp[i]);
    }
  });
}

}  // namespace mlxd

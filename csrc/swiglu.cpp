// SwiGLU, silu(gate) · x, in one pass.
//
// mlxd.models.activations.swiglu_rational computes the same function (Eigen's rational tanh,
// sigmoid(g) = (1 + tanh(g / 2)) / 2) as an mx.compile'd graph, which MLX's CPU backend runs as
// four compiled kernels, a multiply and their broadcasts: five graph nodes a layer, 150 of a
// SmolLM2 decode step, each a dispatch. Here it is one, with the same coefficients
// (pointwise.cpp, per ISA variant).
#include "swiglu.h"

#include <stdexcept>

#include "kernels.h"
#include "mlx/ops.h"

namespace mx = mlx::core;

namespace mlxd {


mx::array swiglu(const mx::array& gate, const mx::array& x) {
  if (gate.dtype() != mx::float32 || x.dtype() != mx::float32 || gate.shape() != x.shape()) {
    throw std::invalid_argument("swiglu: float32 gate and x of one shape");
  }
  auto stream = mx::default_stream(mx::Device::cpu);
  return mx::array(gate.shape(), mx::float32, std::make_shared<SwiGLU>(stream, false), {gate, x});
}

mx::array swiglu_halves(const mx::array& both) {
  if (both.dtype() != mx::float32 || both.ndim() == 0 || both.shape().back() % 2 != 0) {
    throw std::invalid_argument("swiglu_halves: float32 [..., 2F]");
  }
  auto shape = both.shape();
  shape.back() /= 2;
  auto stream = mx::default_stream(mx::Device::cpu);
  return mx::array(shape, mx::float32, std::make_shared<SwiGLU>(stream, true), {both});
}

void SwiGLU::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  auto& encoder = prepare(inputs, outputs);
  if (!halves_) {
    encoder.dispatch([gp = rows<float>(inputs[0], encoder),
                      xp = rows<float>(inputs[1], encoder),
                      yp = outputs[0].data<float>(),
                      n = outputs[0].size(),
                      run = kernels().swiglu]() { run(gp, xp, yp, n); });
    return;
  }
  const size_t width = outputs[0].shape().back();
  encoder.dispatch([bp = rows<float>(inputs[0], encoder),
                    yp = outputs[0].data<float>(),
                    count = outputs[0].size() / (width ? width : 1),
                    width,
                    run = kernels().swiglu]() {
    for (size_t r = 0; r < count; ++r) {
      run(bp + 2 * r * width, bp + (2 * r + 1) * width, yp + r * width, width);
    }
  });
}

}  // namespace mlxd

// The MLX op around the experts' gather matmul: shape checks, output allocation, dispatch on the
// CPU stream (as primitive.cpp's for the dense one).
#include <stdexcept>

#include "gather_qmatmul.h"
#include "kernels.h"
#include "mlx/ops.h"
#include "qmatmul.h"
#include "threads.h"

namespace mx = mlx::core;

namespace mlxd {

mx::array gather_qmatmul(
    const mx::array& x,
    const mx::array& indices,
    const mx::array& w,
    const mx::array& scale_bias,
    int bits,
    bool dot,
    bool precise) {
  if (bits != 4 && bits != 8) {
    throw std::invalid_argument("gather_qmatmul: bits must be 4 or 8");
  }
  if (x.ndim() != 2 || indices.ndim() != 2 || w.ndim() != 3 || w.dtype() != mx::uint8 ||
      (indices.dtype() != mx::int32 && indices.dtype() != mx::uint32)) {
    throw std::invalid_argument(
        "gather_qmatmul: x [T, K], int32 indices [T, J] and uint8 w [E, N, K * bits / 8]");
  }
  const int K = x.shape(1);
  const int E = w.shape(0);
  const int N = w.shape(1);
  const char* disagree = "gather_qmatmul: shapes of x, indices, w and scale_bias do not agree";
  if (indices.shape(0) != x.shape(0)) {
    throw std::invalid_argument(disagree);
  }
  PackedPrimitive::check_weights(disagree, bits, E, N, K, w.shape(2), scale_bias);
  auto stream = mx::default_stream(mx::Device::cpu);
  return mx::array(
      {x.shape(0), indices.shape(1), N},
      mx::float32,
      std::make_shared<GatherQMatmul>(stream, bits, dot, precise),
      {mx::astype(x, mx::float32, stream), mx::astype(indices, mx::int32, stream), w, scale_bias});
}

void GatherQMatmul::eval_cpu(
    const std::vector<mx::array>& inputs,
    std::vector<mx::array>& outputs) {
  const auto& x = inputs[0];
  const auto& indices = inputs[1];
  const auto& w = inputs[2];
  const auto& scale_bias = inputs[3];
  auto& encoder = prepare(inputs, outputs);
  const int T = x.shape(0), K = x.shape(1);
  const int J = indices.shape(1);
  const int E = w.shape(0), N = w.shape(1);
  const float* xp = rows<float>(x, encoder);
  const int32_t* ip = rows<int32_t>(indices, encoder);
  const uint8_t* wp = rows<uint8_t>(w, encoder);
  float* yp = outputs[0].data<float>();
  const int bits = bits_, group = PackedPrimitive::group(K, scale_bias);
  const bool dot = dot_, precise = precise_;
  const int buffer_rows = static_cast<int>(dot_buffer_rows().load());
  const int threads = threads_on(stream(), T);
  const Kernels& run = kernels();
  if (scale_bias.dtype() == mx::float16) {
    encoder.dispatch([=, sp = rows<uint16_t>(scale_bias, encoder)]() {
      if (dot) {
        run.gather_qdot_f16(
            xp, ip, wp, sp, yp, T, J, E, N, K, bits, group, precise, buffer_rows, threads);
      } else {
        run.gather_qmatmul_f16(xp, ip, wp, sp, yp, T, J, E, N, K, bits, group, threads);
      }
    });
  } else {
    encoder.dispatch([=, sp = rows<float>(scale_bias, encoder)]() {
      if (dot) {
        run.gather_qdot_f32(
            xp, ip, wp, sp, yp, T, J, E, N, K, bits, group, precise, buffer_rows, threads);
      } else {
        run.gather_qmatmul_f32(xp, ip, wp, sp, yp, T, J, E, N, K, bits, group, threads);
      }
    });
  }
}

}  // namespace mlxd

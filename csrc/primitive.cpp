// The MLX op around qmatmul_cpu: shape checks, output allocation, dispatch on the CPU stream.
#include <stdexcept>

#include "kernels.h"
#include "mlx/ops.h"
#include "qmatmul.h"
#include "threads.h"

namespace mx = mlx::core;

namespace mlxd {

mx::array qmatmul(
    const mx::array& x,
    const mx::array& w,
    const mx::array& scale_bias,
    int bits,
    bool dot,
    bool precise) {
  if (bits != 4 && bits != 8) {
    throw std::invalid_argument("qmatmul: bits must be 4 or 8");
  }
  if (x.ndim() < 1 || w.ndim() != 2 || w.dtype() != mx::uint8) {
    throw std::invalid_argument("qmatmul: x [..., K] and uint8 w [N, K * bits / 8]");
  }
  const int K = x.shape(-1);
  const int N = w.shape(0);
  PackedPrimitive::check_weights(
      "qmatmul: shapes of x, w and scale_bias do not agree", bits, 1, N, K, w.shape(1), scale_bias);
  auto stream = mx::default_stream(mx::Device::cpu);
  auto shape = x.shape();
  shape.back() = N;
  return mx::array(
      shape,
      mx::float32,
      std::make_shared<QMatmul>(stream, bits, dot, precise),
      {mx::astype(x, mx::float32, stream), w, scale_bias});
}

void PackedPrimitive::check_weights(
    const char* disagree,
    int bits,
    int experts,
    int N,
    int K,
    int row_bytes,
    const mx::array& scale_bias) {
  if (K <= 0 || N <= 0 || K % 32 != 0 || N % 32 != 0 || row_bytes * 8 != K * bits ||
      scale_bias.ndim() < 4 || scale_bias.shape(-3) <= 0 || K % scale_bias.shape(-3) != 0 ||
      (scale_bias.dtype() != mx::float16 && scale_bias.dtype() != mx::float32)) {
    throw std::invalid_argument(disagree);
  }
  const int blocks = group(K, scale_bias) / 32;  // blocks of 32 inputs a scale serves
  if (group(K, scale_bias) % 32 != 0 || (blocks & (blocks - 1)) != 0 ||
      scale_bias.size() != size_t(experts) * N * 2 * scale_bias.shape(-3)) {
    throw std::invalid_argument(disagree);
  }
}

void QMatmul::eval_cpu(
    const std::vector<mx::array>& inputs,
    std::vector<mx::array>& outputs) {
  const auto& x = inputs[0];
  const auto& w = inputs[1];
  const auto& scale_bias = inputs[2];
  auto& encoder = prepare(inputs, outputs);
  auto& y = outputs[0];
  const int K = x.shape(-1);
  const int M = static_cast<int>(x.size() / K);
  const int N = w.shape(0);
  const float* xp = rows<float>(x, encoder);
  const uint8_t* wp = rows<uint8_t>(w, encoder);
  float* yp = y.data<float>();
  const int bits = bits_, group = PackedPrimitive::group(K, scale_bias);
  const int threads = threads_on(stream(), M);
  const bool dot = dot_, precise = precise_;
  const int buffer_rows = static_cast<int>(dot_buffer_rows().load());
  const Kernels& run = kernels();
  if (scale_bias.dtype() == mx::float16) {
    encoder.dispatch([=, sp = rows<uint16_t>(scale_bias, encoder)]() {
      if (dot) {
        run.qdot_f16(xp, wp, sp, yp, M, N, K, bits, group, precise, buffer_rows, threads);
      } else {
        run.qmatmul_f16(xp, wp, sp, yp, M, N, K, bits, group, threads);
      }
    });
  } else {
    encoder.dispatch([=, sp = rows<float>(scale_bias, encoder)]() {
      if (dot) {
        run.qdot_f32(xp, wp, sp, yp, M, N, K, bits, group, precise, buffer_rows, threads);
      } else {
        run.qmatmul_f32(xp, wp, sp, yp, M, N, K, bits, group, threads);
      }
    });
  }
}

}  // namespace mlxd

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

PackedPrimitive::Operand PackedPrimitive::operand(
    const mx::array& w,
    const mx::array& scale_bias,
    int bits,
    mx::cpu::CommandEncoder& encoder) {
  const int K = w.shape(1) * 8 / bits;
  const bool half = scale_bias.dtype() == mx::float16;
  const void* sb = half ? static_cast<const void*>(rows<uint16_t>(scale_bias, encoder))
                        : static_cast<const void*>(rows<float>(scale_bias, encoder));
  return {rows<uint8_t>(w, encoder), sb, half, w.shape(0), K, bits, group(K, scale_bias)};
}

void PackedPrimitive::multiply(const float* x, const Operand& a, float* y, int M, bool dot,
                               bool precise, int threads) {
  const Kernels& run = kernels();
  if (a.half) {
    const auto* sb = static_cast<const uint16_t*>(a.scale_bias);
    if (dot) {
      run.qdot_f16(x, a.w, sb, y, M, a.N, a.K, a.bits, a.group, precise, threads);
    } else {
      run.qmatmul_f16(x, a.w, sb, y, M, a.N, a.K, a.bits, a.group, threads);
    }
  } else {
    const auto* sb = static_cast<const float*>(a.scale_bias);
    if (dot) {
      run.qdot_f32(x, a.w, sb, y, M, a.N, a.K, a.bits, a.group, precise, threads);
    } else {
      run.qmatmul_f32(x, a.w, sb, y, M, a.N, a.K, a.bits, a.group, threads);
    }
  }
}

void QMatmul::eval_cpu(
    const std::vector<mx::array>& inputs,
    std::vector<mx::array>& outputs) {
  const auto& x = inputs[0];
  auto& encoder = prepare(inputs, outputs);
  const int K = x.shape(-1);
  const int M = static_cast<int>(x.size() / K);
  encoder.dispatch([xp = rows<float>(x, encoder),
                    a = operand(inputs[1], inputs[2], bits_, encoder),
                    yp = outputs[0].data<float>(),
                    M,
                    dot = dot_,
                    precise = precise_,
                    threads = threads_on(stream(), M)]() {
    multiply(xp, a, yp, M, dot, precise, threads);
  });
}

}  // namespace mlxd

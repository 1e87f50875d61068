// The packed-weight CPU matmul (see qmatmul.cpp) and the MLX op that runs it.
#pragma once

#include <cstdint>

#include "mlx/array.h"
#include "cpu_primitive.h"

namespace mlxd {

// y[M, N] = x[M, K] @ dequantize(w)^T for weights packed by mlxd.kernels.pack, on `threads`
// threads; S is float or uint16_t (float16 bits) for the scales and biases.
template <typename S>
void qmatmul_cpu(const float* x, const uint8_t* w, const S* scale_bias, float* y, int M, int N,
                 int K, int bits, int threads);

// x [..., K]; w uint8 [N, K * bits / 8]; scale_bias float16 or float32 [N / 16, K / 32, 2, 16].
mlx::core::array qmatmul(
    const mlx::core::array& x,
    const mlx::core::array& w,
    const mlx::core::array& scale_bias,
    int bits);

class QMatmul : public CpuPrimitive {
 public:
  QMatmul(mlx::core::Stream stream, int bits) : CpuPrimitive(stream), bits_(bits) {}

  void eval_cpu(
      const std::vector<mlx::core::array>& inputs,
      std::vector<mlx::core::array>& outputs) override;

  const char* name() const override {
    return "QMatmulCPU";
  }
  bool is_equivalent(const mlx::core::Primitive& other) const override {
    return bits_ == static_cast<const QMatmul&>(other).bits_;
  }

 private:
  int bits_;
};

}  // namespace mlxd

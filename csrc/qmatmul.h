// The MLX op that runs the packed-weight CPU matmul (qmatmul.cpp, per ISA variant).
#pragma once

#include "mlx/array.h"
#include "cpu_primitive.h"

namespace mlxd {

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

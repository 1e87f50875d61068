// The MLX op that runs the experts' packed gather matmul (gather_qmatmul.cpp, per ISA variant).
#pragma once

#include "mlx/array.h"
#include "cpu_primitive.h"

namespace mlxd {

// x [T, K]; indices int32 or uint32 [T, J]; w uint8 [E, N, K * bits / 8] and scale_bias
// float16 or float32 [E, N / 16, K / 32, 2, 16]: E matrices as `mlxd.kernels.pack` lays each
// out. y [T, J, N] float32, y[t, j] = x[t] @ dequantize(w[indices[t, j]])^T.
mlx::core::array gather_qmatmul(
    const mlx::core::array& x,
    const mlx::core::array& indices,
    const mlx::core::array& w,
    const mlx::core::array& scale_bias,
    int bits);

class GatherQMatmul : public CpuPrimitive {
 public:
  GatherQMatmul(mlx::core::Stream stream, int bits) : CpuPrimitive(stream), bits_(bits) {}

  void eval_cpu(
      const std::vector<mlx::core::array>& inputs,
      std::vector<mlx::core::array>& outputs) override;

  const char* name() const override {
    return "GatherQMatmulCPU";
  }
  bool is_equivalent(const mlx::core::Primitive& other) const override {
    return bits_ == static_cast<const GatherQMatmul&>(other).bits_;
  }

 private:
  int bits_;
};

}  // namespace mlxd

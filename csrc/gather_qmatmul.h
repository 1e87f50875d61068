// The MLX op that runs the experts' packed gather matmul (gather_qmatmul.cpp, per ISA variant).
#pragma once

#include "mlx/array.h"
#include "qmatmul.h"

namespace mlxd {

// x [T, K]; indices int32 or uint32 [T, J]; w uint8 [E, N, K * bits / 8] and scale_bias
// float16 or float32 [E, N / 16, K / group, 2, 16]: E matrices as `mlxd.kernels.pack` lays each
// out. y [T, J, N] float32, y[t, j] = x[t] @ dequantize(w[indices[t, j]])^T. dot: each laid out
// by pack_dot instead, multiplied by integer dot products (precise: x as two int8 terms).
mlx::core::array gather_qmatmul(
    const mlx::core::array& x,
    const mlx::core::array& indices,
    const mlx::core::array& w,
    const mlx::core::array& scale_bias,
    int bits,
    bool dot,
    bool precise);

class GatherQMatmul : public PackedPrimitive {
 public:
  using PackedPrimitive::PackedPrimitive;

  void eval_cpu(
      const std::vector<mlx::core::array>& inputs,
      std::vector<mlx::core::array>& outputs) override;

  const char* name() const override {
    return "GatherQMatmulCPU";
  }
};

}  // namespace mlxd

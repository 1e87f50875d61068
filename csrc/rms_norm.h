// RMS normalisation on the CPU, as an MLX primitive (see rms_norm.cpp).
#pragma once

#include "mlx/array.h"
#include "cpu_primitive.h"

namespace mlxd {

// x [..., D] float32, weight float32 [D]: x / sqrt(mean(x²) + eps) * weight.
mlx::core::array rms_norm(const mlx::core::array& x, const mlx::core::array& weight, float eps);

class RMSNorm : public CpuPrimitive {
 public:
  RMSNorm(mlx::core::Stream stream, float eps) : CpuPrimitive(stream), eps_(eps) {}

  void eval_cpu(
      const std::vector<mlx::core::array>& inputs,
      std::vector<mlx::core::array>& outputs) override;

  const char* name() const override {
    return "RMSNormCPU";
  }
  bool is_equivalent(const mlx::core::Primitive& other) const override {
    return eps_ == static_cast<const RMSNorm&>(other).eps_;
  }

 private:
  float eps_;
};

}  // namespace mlxd

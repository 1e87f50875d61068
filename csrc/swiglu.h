// SwiGLU with the rational SiLU on the CPU, as an MLX primitive (see swiglu.cpp).
#pragma once

#include "mlx/array.h"
#include "cpu_primitive.h"

namespace mlxd {

// float32 gate and x of one shape: silu(gate) * x, SiLU from multiply-adds only.
mlx::core::array swiglu(const mlx::core::array& gate, const mlx::core::array& x);

class SwiGLU : public CpuPrimitive {
 public:
  using CpuPrimitive::CpuPrimitive;

  void eval_cpu(
      const std::vector<mlx::core::array>& inputs,
      std::vector<mlx::core::array>& outputs) override;

  const char* name() const override {
    return "SwiGLUCPU";
  }
  bool is_equivalent(const mlx::core::Primitive&) const override {
    return true;
  }
};

}  // namespace mlxd

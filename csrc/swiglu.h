// SwiGLU with the rational SiLU on the CPU, as an MLX primitive (see swiglu.cpp).
#pragma once

#include "mlx/array.h"
#include "cpu_primitive.h"

namespace mlxd {

// float32 gate and x of one shape: silu(gate) * x, SiLU from multiply-adds only.
mlx::core::array swiglu(const mlx::core::array& gate, const mlx::core::array& x);

// The same of a fused gate and up projection's output [..., 2F]: each row's first F values
// the gate, its last F the x; [..., F].
mlx::core::array swiglu_halves(const mlx::core::array& both);

class SwiGLU : public CpuPrimitive {
 public:
  SwiGLU(mlx::core::Stream stream, bool halves) : CpuPrimitive(stream), halves_(halves) {}

  void eval_cpu(
      const std::vector<mlx::core::array>& inputs,
      std::vector<mlx::core::array>& outputs) override;

  const char* name() const override {
    return "SwiGLUCPU";
  }
  bool is_equivalent(const mlx::core::Primitive& other) const override {
    return halves_ == static_cast<const SwiGLU&>(other).halves_;
  }

 private:
  bool halves_;  // one input, each row gate then x
};

}  // namespace mlxd

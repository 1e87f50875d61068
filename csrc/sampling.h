// Sampling a token per row of logits on the CPU, as an MLX primitive (see sampling.cpp).
#pragma once

#include "mlx/array.h"
#include "cpu_primitive.h"

namespace mlxd {

// logits [n, V] (float32, or any float type: cast), inv_temperature, top_p and u [n] (u in
// [0, 1)): uint32 tokens [n], row i's drawn from its top_p nucleus at its temperature by u[i]
// (the rule: Kernels::sample in kernels.h).
mlx::core::array sample(
    const mlx::core::array& logits,
    const mlx::core::array& inv_temperature,
    const mlx::core::array& top_p,
    const mlx::core::array& u);

class Sample : public CpuPrimitive {
 public:
  using CpuPrimitive::CpuPrimitive;

  void eval_cpu(
      const std::vector<mlx::core::array>& inputs,
      std::vector<mlx::core::array>& outputs) override;

  const char* name() const override {
    return "SampleCPU";
  }
  bool is_equivalent(const mlx::core::Primitive&) const override {
    return true;
  }
};

}  // namespace mlxd

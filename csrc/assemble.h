// A sequence's KV cache assembled from prefix-cache blocks, as an MLX primitive (see assemble.cpp).
#pragma once

#include <vector>

#include "cpu_primitive.h"
#include "mlx/array.h"

namespace mlxd {

// blocks: arrays [L, H, T, D] (one dtype, L, H and D; T may differ), positions in order.
// Returns L arrays [1, H, capacity, D]: layer l's positions of every block, then zeros.
std::vector<mlx::core::array> assemble_kv(
    const std::vector<mlx::core::array>& blocks, int capacity);

class AssembleKV : public CpuPrimitive {
 public:
  using CpuPrimitive::CpuPrimitive;

  void eval_cpu(
      const std::vector<mlx::core::array>& inputs,
      std::vector<mlx::core::array>& outputs) override;

  const char* name() const override {
    return "AssembleKVCPU";
  }
  bool is_equivalent(const mlx::core::Primitive&) const override {
    return true;
  }
};

}  // namespace mlxd

// A SwiGLU MLP on packed weights as one MLX op (see mlp.cpp).
#pragma once

#include <optional>

#include "mlx/array.h"
#include "qmatmul.h"

namespace mlxd {

// [x +] down(silu(g) * u) with [g | u] = gate_up(rms_norm(x, norm_weight, eps)) (without the
// norm where norm_weight is absent): float32 x [..., K]; gate_up packed [2 I, K] (the gate's
// rows, then the up projection's), down packed [K, I], each of its own bits; both in pack_dot's
// layout or both in pack's (dot), x as two int8 terms where precise.
mlx::core::array packed_mlp(
    const mlx::core::array& x,
    const mlx::core::array& gate_up,
    const mlx::core::array& gate_up_scale_bias,
    int gate_up_bits,
    const mlx::core::array& down,
    const mlx::core::array& down_scale_bias,
    int down_bits,
    bool dot,
    bool precise,
    const std::optional<mlx::core::array>& norm_weight,
    float eps,
    bool residual);

class PackedMLP : public PackedPrimitive {
 public:
  PackedMLP(mlx::core::Stream stream, int gate_up_bits, int down_bits, bool dot, bool precise,
            bool norm, float eps, bool residual)
      : PackedPrimitive(stream, gate_up_bits, dot, precise),
        down_bits_(down_bits),
        norm_(norm),
        eps_(eps),
        residual_(residual) {}

  void eval_cpu(
      const std::vector<mlx::core::array>& inputs,
      std::vector<mlx::core::array>& outputs) override;

  const char* name() const override {
    return "PackedMLPCPU";
  }
  bool is_equivalent(const mlx::core::Primitive& other) const override {
    const auto& same = static_cast<const PackedMLP&>(other);
    return PackedPrimitive::is_equivalent(other) && down_bits_ == same.down_bits_ &&
        norm_ == same.norm_ && eps_ == same.eps_ && residual_ == same.residual_;
  }

 private:
  int down_bits_;
  bool norm_;
  float eps_;
  bool residual_;
};

}  // namespace mlxd

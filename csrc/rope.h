// Rotary position embedding on the CPU, as an MLX primitive (see rope.cpp).
#pragma once

#include "mlx/array.h"
#include "cpu_primitive.h"

namespace mlxd {

// x [B, H, L, D] float32 (any strides); inv_freq float32 [dims / 2]; offsets int32 [B].
// Rotates the first `dims` features of each position p = offsets[b] + l by p * scale * inv_freq.
mlx::core::array rope(
    const mlx::core::array& x,
    const mlx::core::array& inv_freq,
    const mlx::core::array& offsets,
    int dims,
    bool traditional,
    float scale);

class RoPE : public CpuPrimitive {
 public:
  RoPE(mlx::core::Stream stream, int dims, bool traditional, float scale)
      : CpuPrimitive(stream), dims_(dims), traditional_(traditional), scale_(scale) {}

  void eval_cpu(
      const std::vector<mlx::core::array>& inputs,
      std::vector<mlx::core::array>& outputs) override;

  const char* name() const override {
    return "RoPECPU";
  }
  bool is_equivalent(const mlx::core::Primitive& other) const override {
    const auto& o = static_cast<const RoPE&>(other);
    return dims_ == o.dims_ && traditional_ == o.traditional_ && scale_ == o.scale_;
  }

 private:
  int dims_;
  bool traditional_;
  float scale_;
};

}  // namespace mlxd

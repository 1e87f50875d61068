// Scaled dot-product attention on the CPU, as an MLX primitive (see attention.cpp).
#pragma once

#include <optional>

#include "mlx/array.h"
#include "cpu_primitive.h"

namespace mlxd {

// q [B, Hq, Lq, D] float32, k [B, Hkv, Lk, D] and v [B, Hkv, Lk, Dv] both float32 or both
// float16 (a 16-bit KV cache); any strides; the result is float32.
// mask: none, causal (lower right: query i sees keys up to Lk - Lq + i), or an array that
// broadcasts to [B, Hq, Lq, Lk], bool (true: attend) or float32 (added to the scores).
// heads_last: the result as [B, Lq, Hq * Dv] (what the output projection takes: no transpose
// and copy after), else [B, Hq, Lq, Dv].
mlx::core::array attention(
    const mlx::core::array& q,
    const mlx::core::array& k,
    const mlx::core::array& v,
    float scale,
    const std::optional<mlx::core::array>& mask,
    bool causal,
    bool heads_last);

class Attention : public CpuPrimitive {
 public:
  Attention(mlx::core::Stream stream, float scale, bool causal, bool has_mask, bool heads_last)
      : CpuPrimitive(stream),
        scale_(scale),
        causal_(causal),
        has_mask_(has_mask),
        heads_last_(heads_last) {}

  void eval_cpu(
      const std::vector<mlx::core::array>& inputs,
      std::vector<mlx::core::array>& outputs) override;

  const char* name() const override {
    return "AttentionCPU";
  }
  bool is_equivalent(const mlx::core::Primitive& other) const override {
    const auto& o = static_cast<const Attention&>(other);
    return scale_ == o.scale_ && causal_ == o.causal_ && has_mask_ == o.has_mask_ &&
        heads_last_ == o.heads_last_;
  }

 private:
  float scale_;
  bool causal_;
  bool has_mask_;
  bool heads_last_;
};

}  // namespace mlxd

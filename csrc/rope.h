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

// A fused q/k/v projection's output qkv [B, L, (n_heads + 2 n_kv_heads) * D] float32 as
// attention takes it: q [B, n_heads, L, D] float32 and k [B, n_kv_heads, L, D] rotated as
// `rope` rotates them, v [B, n_kv_heads, L, D]; k and v in `kv_dtype` (float32 or float16).
// One graph node for what the slices, reshapes, transposes, two rotations and two casts of a
// layer took twelve.
std::vector<mlx::core::array> rope_qkv(
    const mlx::core::array& qkv,
    const mlx::core::array& inv_freq,
    const mlx::core::array& offsets,
    int n_heads,
    int n_kv_heads,
    int dims,
    bool traditional,
    float scale,
    mlx::core::Dtype kv_dtype);

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

class RoPEQKV : public CpuPrimitive {
 public:
  RoPEQKV(mlx::core::Stream stream, int n_heads, int n_kv_heads, int dims, bool traditional,
          float scale, mlx::core::Dtype kv_dtype)
      : CpuPrimitive(stream),
        n_heads_(n_heads),
        n_kv_heads_(n_kv_heads),
        dims_(dims),
        traditional_(traditional),
        scale_(scale),
        kv_dtype_(kv_dtype) {}

  void eval_cpu(
      const std::vector<mlx::core::array>& inputs,
      std::vector<mlx::core::array>& outputs) override;

  const char* name() const override {
    return "RoPEQKVCPU";
  }
  bool is_equivalent(const mlx::core::Primitive& other) const override {
    const auto& o = static_cast<const RoPEQKV&>(other);
    return n_heads_ == o.n_heads_ && n_kv_heads_ == o.n_kv_heads_ && dims_ == o.dims_ &&
        traditional_ == o.traditional_ && scale_ == o.scale_ && kv_dtype_ == o.kv_dtype_;
  }

 private:
  int n_heads_;
  int n_kv_heads_;
  int dims_;
  bool traditional_;
  float scale_;
  mlx::core::Dtype kv_dtype_;
};

}  // namespace mlxd

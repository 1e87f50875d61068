// The MLX op that runs the packed-weight CPU matmul (qmatmul.cpp, per ISA variant).
#pragma once

#include <atomic>
#include <cstdint>

#include "mlx/array.h"
#include "cpu_primitive.h"

namespace mlxd {

// x [..., K]; w uint8 [N, K * bits / 8]; scale_bias float16 or float32 [N / 16, K / group, 2,
// 16], a scale and bias per group inputs (32 times a power of two).
// dot: w in pack_dot's layout, multiplied by integer dot products (qdot.cpp; precise: x as
// two int8 terms), else in pack's.
mlx::core::array qmatmul(
    const mlx::core::array& x,
    const mlx::core::array& w,
    const mlx::core::array& scale_bias,
    int bits,
    bool dot,
    bool precise);

// qmatmul on pack_dot's layout over at least this many rows of x runs the float path's
// buffered passes, the weights dequantized from that layout (0: never; models/cpu_path.py
// sets it where the load timed those faster than the integer dot products).
inline std::atomic<int64_t>& dot_buffer_rows() {
  static std::atomic<int64_t> rows{0};
  return rows;
}

// What the primitives over packed weights share: the weights' width and layout.
class PackedPrimitive : public CpuPrimitive {
 public:
  PackedPrimitive(mlx::core::Stream stream, int bits, bool dot, bool precise)
      : CpuPrimitive(stream), bits_(bits), dot_(dot), precise_(precise) {}

  // Whether `experts` packed matrices [N, K] of `bits` agree with w's `row_bytes` and
  // `scale_bias`: K in blocks of 32 inputs, N in multiples of 32 rows (mlxd.kernels.packable's
  // rule), float16 or float32 scales, a pair per group of 32 times a power of two inputs.
  // Throws std::invalid_argument(`disagree`) otherwise.
  static void check_weights(
      const char* disagree,
      int bits,
      int experts,
      int N,
      int K,
      int row_bytes,
      const mlx::core::array& scale_bias);

  // The inputs sharing a scale and bias: scale_bias [..., K / group, 2, 16].
  static int group(int K, const mlx::core::array& scale_bias) {
    return K / scale_bias.shape(-3);
  }

  bool is_equivalent(const mlx::core::Primitive& other) const override {
    const auto& same = static_cast<const PackedPrimitive&>(other);
    return bits_ == same.bits_ && dot_ == same.dot_ && precise_ == same.precise_;
  }

 protected:
  int bits_;
  bool dot_;
  bool precise_;
};

class QMatmul : public PackedPrimitive {
 public:
  using PackedPrimitive::PackedPrimitive;

  void eval_cpu(
      const std::vector<mlx::core::array>& inputs,
      std::vector<mlx::core::array>& outputs) override;

  const char* name() const override {
    return "QMatmulCPU";
  }
};

}  // namespace mlxd

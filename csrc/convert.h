// Weight conversions that run once per load: MLX's quantized rows into the kernels' tiles
// (mlxd/kernels/layout.py), as MLX primitives that write their outputs once, on several threads;
// GGUF's blocks (every type MLX's affine groups hold exactly, and Q6_K) into MLX's affine groups
// (mlxd/models/gguf_quants.py), over buffers that Python's threads split between cores (the
// bindings release the GIL). numpy did both in a dozen passes over every byte and a copy into MLX:
// 42 s of an 8B Q4_K_M's first load for the first, 37 s for the second, on two AVX2 cores.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "cpu_primitive.h"
#include "mlx/array.h"

namespace mlxd {

// MLX's quantized weights uint32 [rows, words] (little-endian words: a byte holds one 8-bit value,
// or two 4-bit ones, the earlier in the low nibble) → the kernels' layout, uint8 [rows, words * 4]
// in tiles of 16 rows: qmatmul's (`dot` false: the tile's 16 bytes of each byte column in a row) or
// qdot's (`dot`: each row's 4 bytes of a column of 32-bit words side by side; 4-bit bytes
// regrouped so that byte i of a word holds inputs i and i + 4 of its 8). On `threads` threads.
mlx::core::array tile_weights(const mlx::core::array& weight, int bits, bool dot, int threads);

// MLX's packed `bits`-bit values (2, 3, 5 or 6: a little-endian bit stream along each row of
// uint32 [rows, words]) as the same values packed at `width` bits (4 for 2 and 3, 8 for 5 and 6),
// the width the kernels run: uint32 [rows, words * width / bits]. On `threads` threads.
mlx::core::array widen_weights(const mlx::core::array& weight, int bits, int width, int threads);

// float32 scales and biases [rows, groups] → [rows / 16, groups * repeats, 2, 16]: per tile and
// packed group its 16 scales then its 16 biases, each group's pair repeated `repeats` times (a
// group the kernels step as several). Three outputs: that layout in float16, in float32, and a
// bool scalar saying which was written: float16 where every value is one exactly (`rounded`:
// rounds to a finite one, to nearest even), else float32.
std::vector<mlx::core::array> tile_scales(
    const mlx::core::array& scales,
    const mlx::core::array& biases,
    int repeats,
    bool rounded,
    int threads);

class WidenWeights : public CpuPrimitive {
 public:
  WidenWeights(mlx::core::Stream stream, int bits, int width, int threads)
      : CpuPrimitive(stream), bits_(bits), width_(width), threads_(threads) {}

  void eval_cpu(
      const std::vector<mlx::core::array>& inputs,
      std::vector<mlx::core::array>& outputs) override;

  const char* name() const override {
    return "WidenWeightsCPU";
  }
  bool is_equivalent(const mlx::core::Primitive& other) const override {
    const auto& o = static_cast<const WidenWeights&>(other);
    return bits_ == o.bits_ && width_ == o.width_;
  }

 private:
  int bits_;
  int width_;
  int threads_;
};

class TileWeights : public CpuPrimitive {
 public:
  TileWeights(mlx::core::Stream stream, int bits, bool dot, int threads)
      : CpuPrimitive(stream), bits_(bits), dot_(dot), threads_(threads) {}

  void eval_cpu(
      const std::vector<mlx::core::array>& inputs,
      std::vector<mlx::core::array>& outputs) override;

  const char* name() const override {
    return "TileWeightsCPU";
  }
  bool is_equivalent(const mlx::core::Primitive& other) const override {
    const auto& o = static_cast<const TileWeights&>(other);
    return bits_ == o.bits_ && dot_ == o.dot_;
  }

 private:
  int bits_;
  bool dot_;
  int threads_;
};

class TileScales : public CpuPrimitive {
 public:
  TileScales(mlx::core::Stream stream, int repeats, bool rounded, int threads)
      : CpuPrimitive(stream), repeats_(repeats), rounded_(rounded), threads_(threads) {}

  void eval_cpu(
      const std::vector<mlx::core::array>& inputs,
      std::vector<mlx::core::array>& outputs) override;

  const char* name() const override {
    return "TileScalesCPU";
  }
  bool is_equivalent(const mlx::core::Primitive& other) const override {
    const auto& that = static_cast<const TileScales&>(other);
    return repeats_ == that.repeats_ && rounded_ == that.rounded_;
  }

 private:
  int repeats_;
  bool rounded_;
  int threads_;
};

// `blocks` GGUF Q6_K blocks (256 values: 6-bit codes in 16 sub-blocks of 16, each with an int8
// scale, and a float16 scale over all) → MLX 8-bit affine groups of 32: `codes` [blocks * 256],
// `scales` and `biases` [blocks * 8], each group's range cut in 255 steps from its minimum.
// Returns (sum of squared errors, sum of squared values) of the group values requantized.
std::pair<double, double> q6_k_to_affine8(
    const uint8_t* src, int64_t blocks, uint8_t* codes, float* scales, float* biases);

// GGUF blocks → MLX affine groups of 32, exactly: (src, blocks, words, scales, biases), writing
// `words` (the codes as MLX packs them), `scales` and `biases` (float32, one a group).
using Conversion = void (*)(const uint8_t*, int64_t, uint8_t*, float*, float*);

// Q4_K (256 values: 4-bit codes in 8 sub-blocks of 32, each with a 6-bit scale and min under two
// float16 ones): 128 bytes of words a block, scales d * scale and biases -(dmin * min). Q5_K: the
// same with a fifth bit a value, 160 bytes of 5-bit words a block.
void q4_k_to_affine4(
    const uint8_t* src, int64_t blocks, uint8_t* words, float* scales, float* biases);
void q5_k_to_affine5(
    const uint8_t* src, int64_t blocks, uint8_t* words, float* scales, float* biases);

// The legacy formats, 32 values a block under a float16 scale d: Q4_0 (w = d * (q - 8)), Q4_1
// (d * q + m, m a float16), Q5_0 (d * (q - 16)), Q5_1 (d * q + m), Q8_0 (d * q, q an int8). The
// bias is -8 d, m, -16 d, m or -128 d; a float16 itself but where it overflows one.
extern const Conversion q4_0_to_affine4, q4_1_to_affine4, q5_0_to_affine5, q5_1_to_affine5,
    q8_0_to_affine8;

}  // namespace mlxd

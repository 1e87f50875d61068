// Weight conversions that run once per load: MLX's quantized rows into the kernels' tiles
// (mlxd/kernels/layout.py), as MLX primitives that write their outputs once, on several threads;
// GGUF's blocks (every type MLX's affine groups hold exactly, and Q6_K) into MLX's affine groups
// (mlxd/models/gguf_quants.py), over numpy buffers that Python's threads split between cores (the
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

// float32 scales and biases [rows, groups] → float32 [rows / 16, groups * repeats, 2, 16]: per tile
// and packed group its 16 scales then its 16 biases, each group's pair repeated `repeats` times (a
// group the kernels step as several); and a bool scalar: whether every value is a float16 exactly.
std::vector<mlx::core::array> tile_scales(
    const mlx::core::array& scales, const mlx::core::array& biases, int repeats, int threads);

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
  TileScales(mlx::core::Stream stream, int repeats, int threads)
      : CpuPrimitive(stream), repeats_(repeats), threads_(threads) {}

  void eval_cpu(
      const std::vector<mlx::core::array>& inputs,
      std::vector<mlx::core::array>& outputs) override;

  const char* name() const override {
    return "TileScalesCPU";
  }
  bool is_equivalent(const mlx::core::Primitive& other) const override {
    return repeats_ == static_cast<const TileScales&>(other).repeats_;
  }

 private:
  int repeats_;
  int threads_;
};

// `blocks` GGUF Q6_K blocks (256 values: 6-bit codes in 16 sub-blocks of 16, each with an int8
// scale, and a float16 scale over all) → MLX 8-bit affine groups of 32: `codes` [blocks * 256],
// `scales` and `biases` [blocks * 8], each group's range cut in 255 steps from its minimum.
// Returns (sum of squared errors, sum of squared values) of the group values requantized.
std::pair<double, double> q6_k_to_affine8(
    const uint8_t* src, int64_t blocks, uint8_t* codes, float* scales, float* biases);

// `blocks` GGUF Q4_K blocks (256 values: 4-bit codes in 8 sub-blocks of 32, each with a 6-bit
// scale and min under two float16 ones) → MLX 4-bit affine groups of 32, exactly: `words` [blocks *
// 128 bytes], `scales` and `biases` [blocks * 8] (d * scale, -(dmin * min), as float32).
void q4_k_to_affine4(
    const uint8_t* src, int64_t blocks, uint8_t* words, float* scales, float* biases);

// `blocks` GGUF Q4_0 blocks (32 4-bit codes under one float16 scale d, w = d * (q - 8)) as MLX
// 4-bit affine groups of 32, exactly: `words` [blocks * 16 bytes], `scales` d and `biases` -8 d
// [blocks] (float32; both are float16s but where 8 d overflows one).
void q4_0_to_affine4(
    const uint8_t* src, int64_t blocks, uint8_t* words, float* scales, float* biases);

// `blocks` GGUF Q4_1 blocks (32 4-bit codes under a float16 scale d and min m, w = d * q + m) as
// MLX 4-bit affine groups of 32, exactly: `words` [blocks * 16 bytes], `scales` d and `biases` m.
void q4_1_to_affine4(
    const uint8_t* src, int64_t blocks, uint8_t* words, float* scales, float* biases);

// `blocks` GGUF Q5_K blocks (Q4_K's with a fifth bit a value) → MLX 5-bit affine groups of 32,
// exactly: `words` [blocks * 160 bytes], `scales` and `biases` [blocks * 8] as Q4_K's.
void q5_k_to_affine5(
    const uint8_t* src, int64_t blocks, uint8_t* words, float* scales, float* biases);

// `blocks` GGUF Q5_0 or Q5_1 blocks (32 5-bit codes; w = d * (q - 16), or d * q + m) as MLX 5-bit
// affine groups of 32, exactly: `words` [blocks * 20 bytes], `scales` d and `biases` -16 d or m.
void q5_0_to_affine5(
    const uint8_t* src, int64_t blocks, uint8_t* words, float* scales, float* biases);
void q5_1_to_affine5(
    const uint8_t* src, int64_t blocks, uint8_t* words, float* scales, float* biases);

// `blocks` GGUF Q8_0 blocks (32 int8 codes under a float16 scale d) as MLX 8-bit affine groups of
// 32, exactly: `codes` [blocks * 32] (q + 128), `scales` d and `biases` -128 d [blocks].
void q8_0_to_affine8(
    const uint8_t* src, int64_t blocks, uint8_t* codes, float* scales, float* biases);

}  // namespace mlxd

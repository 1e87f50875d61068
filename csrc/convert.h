// Weight conversions that run once per load, each over a slice of a tensor so that Python's
// threads split a tensor between cores (the bindings release the GIL): MLX's quantized rows into
// the kernels' tiles (mlxd/kernels/layout.py), and GGUF's Q6_K blocks into MLX's 8-bit groups
// and Q4_K blocks into MLX's groups (mlxd/models/gguf_quants.py). numpy did both in a dozen passes over every byte: 42 s of an 8B
// Q4_K_M's first load for the first, 21 s for the second, on two AVX2 cores.
#pragma once

#include <cstdint>
#include <utility>

namespace mlxd {

// `tiles` tiles of 16 rows × `width` bytes of MLX's quantized rows (little-endian words: a byte
// holds one 8-bit value, or two 4-bit ones, the earlier in the low nibble) → the kernels' layout,
// tile after tile: qmatmul's (`dot` false: the tile's 16 bytes of each byte column in a row) or
// qdot's (`dot`: each row's 4 bytes of a column of 32-bit words side by side; 4-bit bytes
// regrouped so that byte i of a word holds inputs i and i + 4 of its 8).
void repack_tiles(const uint8_t* src, uint8_t* dst, int64_t tiles, int64_t width, int bits, bool dot);

// Scales and biases [rows, groups] → [rows / 16, groups * repeats, 2, 16]: per tile and packed
// group its 16 scales then its 16 biases, each group's pair repeated `repeats` times (a group the
// kernels step as several). Returns whether every value is a float16 exactly.
bool tile_scales(
    const float* scales,
    const float* biases,
    float* dst,
    int64_t rows,
    int64_t groups,
    int64_t repeats);

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

}  // namespace mlxd

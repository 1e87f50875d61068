// The packed layout's tiling, shared by the float path's kernels (qmatmul_tiles.h) and the int8
// path's (qdot_tiles.h): blocks of inputs sharing a scale, tiles of output rows, the vector
// registers a variant has, and how many tiles a work item takes. Included once per ISA variant
// (simd.h), inside its namespace.
#pragma once

#include "simd.h"

namespace mlxd {
namespace MLXD_ISA {

namespace {

// Inputs per step of the kernels' loops (and, int8 path, per x scale). A weight scale and bias
// serve a group of 2^scale_shift blocks: a model quantized in groups of 64 keeps one pair per
// 64 inputs (4.5 bits a 4-bit weight, not 5: the bytes a decode step streams).
constexpr int BLOCK = 32;
constexpr int LANES = 16;  // output rows per tile (the packed layout)
constexpr int V = LANES / W;  // vectors per tile

// 32 zmm on AVX-512, 16 ymm on AVX2, 32 on NEON, 16 xmm for the generic variant on x86-64.
#if defined(MLXD_ISA_AVX512) || defined(MLXD_ISA_NEON)
constexpr int REGISTERS = 32;
#else
constexpr int REGISTERS = 16;
#endif

// One tile a work item on every ISA. On AVX-512 two (as 32 zmm allow) meant four streams a
// work item, each tile's weights and scales: one row times a 128,256 x 2,048 4-bit matrix read
// at 17 GB/s (int8 path) on one Zen 5 core and 32 on two; one tile, 31 and 44. A Llama-3.2-1B-
// shaped decode step: 38 -> 27 ms at batch 1, 86 -> 89 ms at batch 8 (a broadcast of x then
// feeds one vector of output rows, not two).
constexpr int TILES = 1;
constexpr int NV = TILES * V;  // vectors of output rows a work item
constexpr int GROUP = TILES * LANES;  // output rows per work item
// How far ahead (blocks of 32 inputs) weights are fetched. A Llama-3.2-1B's layers streamed from
// memory at 8 rows on two Zen 5 cores: 4 blocks 20-26 GB/s, 8 blocks 27-31, 16 and 32 30-32.
constexpr int PREFETCH_BLOCKS = 16;

// log2(group / BLOCK), for a group of inputs sharing a scale (the op checked: 32 times a power
// of two).
inline int scale_shift(int group) {
  return __builtin_ctz(unsigned(group / BLOCK));
}

}  // namespace
}  // namespace MLXD_ISA
}  // namespace mlxd

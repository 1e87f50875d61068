// A CPU matmul against affine-quantized weights (4 or 8 bits, blocks of 32), per ISA variant.
//
// MLX 0.32's CPU backend dequantizes quantized weights element by element, 2-4x slower than
// float32 BLAS; float32 weights in turn move 8x the bytes of a 4-bit file at batch 1, where a
// decode step is bound by memory bandwidth. This kernel reads the packed weights once per pass
// and multiplies them in registers with up to MAX_ROWS rows of x at a time; with many rows
// (prefill) each chunk of a tile's weights is dequantized once into an L1-sized buffer instead.
//
// `mlxd.kernels.pack` lays the weights out (once, at load) for vectors along the output axis, so
// no horizontal sums are needed: output rows go in tiles of 16, and for each tile and input k
//   8 bits: 16 bytes, q[n0 + j][k] for j < 16
//   4 bits: 16 bytes per pair (k, k + 1), byte j = q[n0 + j][k] | q[n0 + j][k + 1] << 4
// and per tile and group of inputs (32, or the model's 64 or 128) 16 scales then 16 biases,
// float16 (when that is exact, as for a GGUF's) or float32: w = scale * q + bias (MLX's affine
// quantization). At batch 1 a step streams every weight from memory, so the bytes per weight
// set its pace: with float16 scales 5 bits in groups of 32 (as a Q4_1 GGUF), 4.5 in groups of
// 64 (as Q4_0).
//
// In registers the bias is factored out of each block, as llama.cpp does:
//   sum_k x_k (s q_k + b) = s sum_k x_k q_k + b sum_k x_k
// so the inner loop only widens q to float and multiplies-adds; the block's sum of x is
// computed once per row, and scale and bias are applied once per block.

#include "parallel.h"
#include "qmatmul_tiles.h"
#include "variant.h"

namespace mlxd {
namespace MLXD_ISA {

namespace {

// Work items are split over the threads; each walks every row of x in passes. Buffered
// passes take BUFFER_TILES tiles a work item (N is a multiple of 32); on pack_dot's layout
// (DOT) every pass is buffered.
template <int BITS, typename S, bool DOT = false>
void run(const Problem<S>& p) {
  if (DOT || !in_registers(p.M)) {
    parallel_for(p.threads, p.N / (BUFFER_TILES * LANES), [&](int64_t first, int64_t last) {
      Scratch buf(BUFFER_FLOATS);
      for (int g = int(first); g < int(last); ++g) {
        buffered_item<BITS, BUFFER_TILES, S, DOT>(p, buf.data(), g);
      }
    });
    return;
  }
  Scratch xsum(size_t(p.M) * (p.K / BLOCK));
  block_sums(p.x, p.M, p.K, xsum.data());
  parallel_for(p.threads, p.N / GROUP, [&](int64_t first, int64_t last) {
    for (int g = int(first); g < int(last); ++g) {
      registers_item<BITS, S>(p, xsum.data(), g);
    }
  });
}

template <typename S, bool DOT = false>
void qmatmul(const float* x, const uint8_t* w, const S* scale_bias, float* y, int M, int N, int K,
             int bits, int group, int threads) {
  const Problem<S> p{x, w, scale_bias, y, M, N, K, scale_shift(group), threads};
  if (bits == 4) {
    run<4, S, DOT>(p);
  } else {
    run<8, S, DOT>(p);  // the op checked: 4 or 8
  }
}

// One work item (GROUP output rows) of the buffered passes on pack_dot's layout, on the
// calling thread: a mixture of experts' expert with many rows (gather_qdot.cpp).
template <typename S>
void dot_layout_item(const float* x, const uint8_t* w, const S* scale_bias, float* y, int M,
                     int N, int K, int bits, int group, int g, float* buf) {
  const Problem<S> p{x, w, scale_bias, y, M, N, K, scale_shift(group), 1};
  if (bits == 4) {
    buffered_item<4, TILES, S, true>(p, buf, g);
  } else {
    buffered_item<8, TILES, S, true>(p, buf, g);
  }
}

}  // namespace

void qmatmul_f32(const float* x, const uint8_t* w, const float* scale_bias, float* y, int M, int N,
                 int K, int bits, int group, int threads) {
  qmatmul(x, w, scale_bias, y, M, N, K, bits, group, threads);
}

void qmatmul_f16(const float* x, const uint8_t* w, const uint16_t* scale_bias, float* y, int M,
                 int N, int K, int bits, int group, int threads) {
  qmatmul(x, w, scale_bias, y, M, N, K, bits, group, threads);
}

void buffered_dot(const float* x, const uint8_t* w, const float* scale_bias, float* y, int M,
                  int N, int K, int bits, int group, int threads) {
  qmatmul<float, true>(x, w, scale_bias, y, M, N, K, bits, group, threads);
}

void buffered_dot(const float* x, const uint8_t* w, const uint16_t* scale_bias, float* y, int M,
                  int N, int K, int bits, int group, int threads) {
  qmatmul<uint16_t, true>(x, w, scale_bias, y, M, N, K, bits, group, threads);
}

int buffered_floats() {
  return BUFFER_FLOATS;
}

void buffered_dot_item(const float* x, const uint8_t* w, const float* scale_bias, float* y,
                       int M, int N, int K, int bits, int group, int g, float* buf) {
  dot_layout_item(x, w, scale_bias, y, M, N, K, bits, group, g, buf);
}

void buffered_dot_item(const float* x, const uint8_t* w, const uint16_t* scale_bias, float* y,
                       int M, int N, int K, int bits, int group, int g, float* buf) {
  dot_layout_item(x, w, scale_bias, y, M, N, K, bits, group, g, buf);
}

}  // namespace MLXD_ISA
}  // namespace mlxd

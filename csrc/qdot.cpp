// The quantized matmul by integer dot products, as llama.cpp's: x quantized per block of 32 to
// int8, multiplied with the 4/8-bit weights by vpdpbusd (AVX-512 VNNI, AVX-VNNI), vpmaddubsw +
// vpmaddwd (AVX2, AVX-512 without VNNI; precise's 8-bit weights there by vpmaddwd on x as
// int16, qdot_tiles.h's WIDE) or sdot (ARM dotprod), per ISA variant.
//
// The float path (qmatmul.cpp) widens every weight to float and spends one FMA per weight and
// row; here one instruction multiplies and sums 4 byte pairs per 32-bit lane, so a decode step
// is bound by the weights' bytes, not by the widening. With affine weights w = s q + b (q
// unsigned) and x ≈ d x8 per block (d = max |x| / 127, x8 in -127..127):
//   sum_k w_k x_k ≈ d (s sum_k q_k x8_k + b sum_k x8_k)
// both sums exact in integers. The bias term takes the rounded x too, as llama.cpp's Q8_1
// does: then the error is sum_k w_k (x_k - d x8_k), each x moving at most d / 2. With the exact
// sum of x there, it would be sum_k s q_k (x_k - d x8_k), and s q is far larger than w where
// the bias offsets it (a GGUF's Q4_0 / Q8_0: b = -8 s, -128 s): SmolLM2-135M Q4_1's logits
// moved from its float32 twin's by up to 3.8 (of 30) that way, 1.0-1.8 this way.
//
// `mlxd.kernels.pack_dot` lays the weights out for it: output rows in tiles of 16, and per tile
//   8 bits: per 4 inputs k..k+3, 64 bytes: bytes 4j..4j+3 = q[n0 + j][k..k+3]
//   4 bits: per 8 inputs k..k+7, 64 bytes: byte 4j+i = q[n0 + j][k+i] | q[n0 + j][k+4+i] << 4
// so each 32-bit lane holds one output row's 4 consecutive inputs, and a dot product of a weight
// vector with 4 bytes of x broadcast sums them per row with no horizontal sums. Scales and
// biases as the float path's: per tile and group of inputs 16 scales then 16 biases.

#include "parallel.h"
#include "qdot_tiles.h"
#include "variant.h"

namespace mlxd {
namespace MLXD_ISA {

namespace {

template <int BITS, int TERMS, typename S>
void qdot(const float* x, const uint8_t* w, const S* scale_bias, float* y, int M, int N, int K,
          int group, int threads) {
  QuantizedRows<BITS, TERMS> xq(M, K);
  xq.quantize(x, 0, M, threads);
  const Problem<S> p{xq.from(0), w, scale_bias, y, M, N, K, scale_shift(group)};
  parallel_for(threads, p.N / GROUP, [&](int64_t first, int64_t last) {
    for (int g = int(first); g < int(last); ++g) {
      dot_work_item<BITS, TERMS, S>(p, g);
    }
  });
}

// Where the float path's buffered passes beat the integer dot products (AVX2 from 32 rows:
// precise's two terms take two vpmaddubsw per 32 products, where a buffered pass loads a
// weight vector once for six rows), the weights are dequantized from this layout into them
// (`buffered_dot`): models/cpu_path.py decides from the load's timings.
template <typename S>
void qdot(const float* x, const uint8_t* w, const S* scale_bias, float* y, int M, int N, int K,
          int bits, int group, bool precise, int buffer_rows, int threads) {
  if (buffer_rows > 0 && M >= buffer_rows) {
    buffered_dot(x, w, scale_bias, y, M, N, K, bits, group, threads);
  } else if (precise) {  // the op checked: 4 or 8 bits
    bits == 4 ? qdot<4, 2, S>(x, w, scale_bias, y, M, N, K, group, threads)
              : qdot<8, 2, S>(x, w, scale_bias, y, M, N, K, group, threads);
  } else {
    bits == 4 ? qdot<4, 1, S>(x, w, scale_bias, y, M, N, K, group, threads)
              : qdot<8, 1, S>(x, w, scale_bias, y, M, N, K, group, threads);
  }
}

}  // namespace

#if defined(MLXD_SCALAR_DOT)
const bool integer_dot = false;
#else
const bool integer_dot = true;
#endif

void qdot_f32(const float* x, const uint8_t* w, const float* scale_bias, float* y, int M, int N,
              int K, int bits, int group, bool precise, int buffer_rows, int threads) {
  qdot(x, w, scale_bias, y, M, N, K, bits, group, precise, buffer_rows, threads);
}

void qdot_f16(const float* x, const uint8_t* w, const uint16_t* scale_bias, float* y, int M, int N,
              int K, int bits, int group, bool precise, int buffer_rows, int threads) {
  qdot(x, w, scale_bias, y, M, N, K, bits, group, precise, buffer_rows, threads);
}

}  // namespace MLXD_ISA
}  // namespace mlxd

// The packed matmul's row x block kernels (see qmatmul.cpp for the layout and the arithmetic),
// shared by the dense matmul (qmatmul.cpp) and the experts' gather matmul (gather_qmatmul.cpp):
// `work_item` computes one work item (GROUP output rows) of y = x @ dequantize(w)^T for every
// row of x. Included once per ISA variant (simd.h), inside its namespace.
#pragma once

#include "tiles.h"

namespace mlxd {
namespace MLXD_ISA {

namespace {

// A pass in registers takes up to MAX_ROWS rows of x, a buffered pass BUFFER_ROWS: as many as
// leave the accumulators, the weight vectors and a broadcast in the registers, so that no hot
// loop spills to the stack.
#if defined(MLXD_ISA_AVX512)
constexpr int MAX_ROWS = 8;
constexpr int BUFFER_ROWS = 12;
#elif defined(MLXD_ISA_AVX2)
constexpr int MAX_ROWS = 5;
constexpr int BUFFER_ROWS = 6;
#elif defined(MLXD_ISA_NEON)
constexpr int MAX_ROWS = 4;
constexpr int BUFFER_ROWS = 6;
#else
constexpr int MAX_ROWS = 2;
constexpr int BUFFER_ROWS = 2;
#endif
// Registers a pass in registers has for its accumulators: the rest hold a pair of inputs'
// weights (2 x NV) and the broadcast x values.
constexpr int ACCUMULATORS = REGISTERS - 2 * NV - 2;
#if !defined(MLXD_ISA_GENERIC)  // (x86-64's 16 xmm are not where the generic variant runs fast)
static_assert(MAX_ROWS * NV <= ACCUMULATORS, "a pass's accumulators fit the registers");
static_assert(BUFFER_ROWS * NV + NV + 1 <= REGISTERS, "a buffered pass fits the registers");
#endif
// From this many rows on, dequantizing a chunk of weights once into a buffer beats widening
// them in registers for every pass.
constexpr int BUFFER_MIN_ROWS = 32;
// Inputs per buffered chunk: 16 KB of float32 weights, which stay in L1 whatever K is.
constexpr int CHUNK = 4096 / GROUP;

static_assert(CHUNK % BLOCK == 0, "chunks hold whole blocks");

inline vf to_float(vi q) {
  return __builtin_convertvector(q, vf);
}

template <typename S>
struct Problem {
  const float* x;  // [M, K]
  const uint8_t* w;  // [N / 16 tiles, K * bits / 8 * 16 bytes]
  const S* scale_bias;  // [N / 16 tiles, K / 32 blocks, 2 (scale, bias), 16]
  float* y;  // [M, N]
  int M, N, K;
  int threads;

  // Vector v of work item g's weights (tile g * TILES + v / V, lanes from (v % V) * W).
  template <int BITS>
  const uint8_t* weights(int g, int v) const {
    return w + size_t(g * TILES + v / V) * K * BITS / 8 * LANES + (v % V) * W;
  }
  const S* scales(int g, int v, int block) const {  // its W scales; the biases follow at +16
    return scale_bias + (size_t(g * TILES + v / V) * (K / BLOCK) + block) * 2 * LANES + (v % V) * W;
  }
  float* out(int m, int g, int v) const {
    return y + size_t(m) * N + g * GROUP + v * W;
  }
};

// q of inputs k and k + 1 for the W rows at `at`, as float32.
template <int BITS>
inline void widen_pair(const uint8_t* at, int k, vf& q0, vf& q1) {
  if constexpr (BITS == 4) {
    const vi q = load_u8(at + (k / 2) * LANES);
    q0 = to_float(q & 15);
    q1 = to_float(q >> 4);
  } else {
    q0 = to_float(load_u8(at + k * LANES));
    q1 = to_float(load_u8(at + (k + 1) * LANES));
  }
}

// y[m0 .. m0 + MB, work item g] with the weights widened in registers, inputs accumulating into
// SPLIT partial sums summed per block.
template <int BITS, int MB, typename S>
void rows_in_registers(const Problem<S>& p, const float* xsum, int g, int m0) {
  constexpr int SPLIT = split_for(MB * NV, ACCUMULATORS);
  constexpr int PAIRS = SPLIT > 2 ? SPLIT / 2 : 1;  // pairs of inputs per step
  constexpr int BLOCK_BYTES = BLOCK * BITS / 8 * LANES;
  const int blocks = p.K / BLOCK;
  for (int b = 0; b < blocks; ++b) {
    prefetch_block<BITS, TILES, V, BLOCK_BYTES>(p, g, b + PREFETCH_BLOCKS);
    vf part[MB][NV][SPLIT] = {};
    for (int k = b * BLOCK; k < (b + 1) * BLOCK; k += 2 * PAIRS) {
      for (int u = 0; u < PAIRS; ++u) {
        const int kk = k + 2 * u;
        vf q0[NV], q1[NV];
        for (int v = 0; v < NV; ++v) {
          widen_pair<BITS>(p.template weights<BITS>(g, v), kk, q0[v], q1[v]);
        }
        for (int i = 0; i < MB; ++i) {
          const float* xr = p.x + size_t(m0 + i) * p.K + kk;
          const float x0 = xr[0], x1 = xr[1];
          for (int v = 0; v < NV; ++v) {
            part[i][v][(2 * u) % SPLIT] += q0[v] * x0;
            part[i][v][(2 * u + 1) % SPLIT] += q1[v] * x1;
          }
        }
      }
    }
    for (int v = 0; v < NV; ++v) {
      const vf scale = load_scales(p.scales(g, v, b));
      const vf bias = load_scales(p.scales(g, v, b) + LANES);
      for (int i = 0; i < MB; ++i) {
        vf sum = part[i][v][0];
        for (int s = 1; s < SPLIT; ++s) {
          sum += part[i][v][s];
        }
        float* out = p.out(m0 + i, g, v);
        const vf block_y = sum * scale + bias * xsum[size_t(m0 + i) * blocks + b];
        store(out, b == 0 ? block_y : load(out) + block_y);
      }
    }
  }
}

// Work item g's weights of inputs [k0, k0 + count) as float32 into buf [count][GROUP].
template <int BITS, typename S>
void dequantize_chunk(const Problem<S>& p, int g, int k0, int count, float* buf) {
  for (int b = k0 / BLOCK; b < (k0 + count) / BLOCK; ++b) {
    for (int v = 0; v < NV; ++v) {
      const vf scale = load_scales(p.scales(g, v, b));
      const vf bias = load_scales(p.scales(g, v, b) + LANES);
      for (int k = b * BLOCK; k < (b + 1) * BLOCK; k += 2) {
        vf q0, q1;
        widen_pair<BITS>(p.template weights<BITS>(g, v), k, q0, q1);
        store(buf + size_t(k - k0) * GROUP + v * W, q0 * scale + bias);
        store(buf + size_t(k + 1 - k0) * GROUP + v * W, q1 * scale + bias);
      }
    }
  }
}

// y[m0 .. m0 + MB, work item g] += x[.., k0 .. k0 + count] @ buf: per input NV loads and MB
// broadcasts feed MB x NV FMAs.
template <int MB, typename S>
void rows_from_buffer(const Problem<S>& p, const float* buf, int g, int k0, int count, int m0) {
  vf acc[MB][NV];
  for (int i = 0; i < MB; ++i) {
    for (int v = 0; v < NV; ++v) {
      acc[i][v] = k0 == 0 ? vf{} : load(p.out(m0 + i, g, v));
    }
  }
  for (int k = 0; k < count; ++k) {
    vf w[NV];
    for (int v = 0; v < NV; ++v) {
      w[v] = load(buf + size_t(k) * GROUP + v * W);
    }
    for (int i = 0; i < MB; ++i) {
      const float xk = p.x[size_t(m0 + i) * p.K + k0 + k];
      for (int v = 0; v < NV; ++v) {
        acc[i][v] += w[v] * xk;
      }
    }
  }
  for (int i = 0; i < MB; ++i) {
    for (int v = 0; v < NV; ++v) {
      store(p.out(m0 + i, g, v), acc[i][v]);
    }
  }
}

// x's sums per row and block of 32 inputs, xsum [M, K / 32]: what the bias multiplies.
inline void block_sums(const float* x, int M, int K, float* xsum) {
  const int blocks = K / BLOCK;
  for (int m = 0; m < M; ++m) {
    for (int b = 0; b < blocks; ++b) {
      vf sum = {};
      for (int k = b * BLOCK; k < (b + 1) * BLOCK; k += W) {
        sum += load(x + size_t(m) * K + k);
      }
      xsum[size_t(m) * blocks + b] = hsum(sum);
    }
  }
}

// Whether `work_item` takes p's rows in registers (then it needs block_sums of x) or
// dequantizes chunks into a buffer of CHUNK * GROUP floats.
inline bool in_registers(int M) {
  return M < BUFFER_MIN_ROWS;
}

// Work item g of y = x @ dequantize(w)^T: its GROUP outputs for every row of x, in passes.
template <int BITS, typename S>
void work_item(const Problem<S>& p, const float* xsum, float* buf, int g) {
  if (in_registers(p.M)) {
    for (int m = 0; m < p.M; m += MAX_ROWS) {
      with_rows<MAX_ROWS>(imin(MAX_ROWS, p.M - m), [&](auto mb) {
        rows_in_registers<BITS, decltype(mb)::value, S>(p, xsum, g, m);
      });
    }
    return;
  }
  for (int k0 = 0; k0 < p.K; k0 += CHUNK) {
    const int count = imin(CHUNK, p.K - k0);
    dequantize_chunk<BITS, S>(p, g, k0, count, buf);
    for (int m = 0; m < p.M; m += BUFFER_ROWS) {
      with_rows<BUFFER_ROWS>(imin(BUFFER_ROWS, p.M - m), [&](auto mb) {
        rows_from_buffer<decltype(mb)::value, S>(p, buf, g, k0, count, m);
      });
    }
  }
}

}  // namespace
}  // namespace MLXD_ISA
}  // namespace mlxd

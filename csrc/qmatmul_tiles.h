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
// The dense matmul's buffered passes take two tiles a work item on AVX-512, as its 32 zmm
// allow: each broadcast of x then feeds two vectors of output rows, not one. (Passes in
// registers stream the weights from memory and keep one tile: two streams a work item, not
// four; tiles.h.) A Llama-3.2-1B-shaped decode step on a Zen 5 core pair, one tile -> two:
// 32 rows 264 -> 231 ms, 64 rows 505 -> 437 ms.
#if defined(MLXD_ISA_AVX512)
constexpr int BUFFER_TILES = 2;
#else
constexpr int BUFFER_TILES = 1;
#endif
// Registers a pass in registers has for its accumulators: the rest hold a pair of inputs'
// weights (2 x NV) and the broadcast x values.
constexpr int ACCUMULATORS = REGISTERS - 2 * NV - 2;
#if !defined(MLXD_ISA_GENERIC)  // (x86-64's 16 xmm are not where the generic variant runs fast)
static_assert(MAX_ROWS * NV <= ACCUMULATORS, "a pass's accumulators fit the registers");
static_assert(BUFFER_ROWS * BUFFER_TILES * V + BUFFER_TILES * V + 1 <= REGISTERS,
              "a buffered pass fits the registers");
#endif
// From this many rows on, dequantizing a chunk of weights once into a buffer beats widening
// them in registers for every pass.
constexpr int BUFFER_MIN_ROWS = 32;
// A buffered chunk: 16 KB of float32 weights, which stay in L1 whatever K is.
constexpr int BUFFER_FLOATS = 4096;
// Inputs per buffered chunk of a work item of T tiles.
template <int T>
constexpr int CHUNK = BUFFER_FLOATS / (T * LANES);

static_assert(CHUNK<BUFFER_TILES> % BLOCK == 0 && CHUNK<TILES> % BLOCK == 0,
              "chunks hold whole blocks");

inline vf to_float(vi q) {
  return __builtin_convertvector(q, vf);
}

template <typename S>
struct Problem {
  const float* x;  // [M, K]
  const uint8_t* w;  // [N / 16 tiles, K * bits / 8 * 16 bytes]
  const S* scale_bias;  // [N / 16 tiles, K / group, 2 (scale, bias), 16]
  float* y;  // [M, N]
  int M, N, K;
  int scale_shift;  // log2(group / 32): blocks of 32 inputs share a scale and bias
  int threads;

  // Vector v of work item g's weights, work items of T tiles (tile g * T + v / V, lanes from
  // (v % V) * W).
  template <int BITS, int T = TILES>
  const uint8_t* weights(int g, int v) const {
    return w + size_t(g * T + v / V) * K * BITS / 8 * LANES + (v % V) * W;
  }
  template <int T = TILES>
  const S* scales(int g, int v) const {  // its W scales of the first group
    return scale_bias + size_t(g * T + v / V) * (K / BLOCK >> scale_shift) * 2 * LANES +
           (v % V) * W;
  }
  template <int T = TILES>
  const S* scales(int g, int v, int block) const {  // its W scales; the biases follow at +16
    return scales<T>(g, v) + size_t(block >> scale_shift) * 2 * LANES;
  }
  template <int T = TILES>
  float* out(int m, int g, int v) const {
    return y + size_t(m) * N + g * T * LANES + v * W;
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
// SPLIT partial sums summed per block into y's vectors, which stay in registers until the last
// block (as qdot_tiles.h's).
template <int BITS, int MB, typename S>
void rows_in_registers(const Problem<S>& p, const float* xsum, int g, int m0) {
  constexpr int SPLIT = split_for(MB * NV, ACCUMULATORS - MB * NV);
  constexpr int PAIRS = SPLIT > 2 ? SPLIT / 2 : 1;  // pairs of inputs per step
  constexpr int BLOCK_BYTES = BLOCK * BITS / 8 * LANES;
  const int blocks = p.K / BLOCK;
  const float* x = p.x + size_t(m0) * p.K;
  xsum += size_t(m0) * blocks;
  const S* scales[NV];  // work item g's first group, computed once (as qdot_tiles.h's)
  for (int v = 0; v < NV; ++v) {
    scales[v] = p.scales(g, v);
  }
  vf y[MB][NV] = {};
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
          const float* xr = x + size_t(i) * p.K + kk;
          const float x0 = xr[0], x1 = xr[1];
          for (int v = 0; v < NV; ++v) {
            part[i][v][(2 * u) % SPLIT] += q0[v] * x0;
            part[i][v][(2 * u + 1) % SPLIT] += q1[v] * x1;
          }
        }
      }
    }
    const size_t group_at = size_t(b >> p.scale_shift) * 2 * LANES;  // block b's pairs
    for (int v = 0; v < NV; ++v) {
      const vf scale = load_scales(scales[v] + group_at);
      const vf bias = load_scales(scales[v] + group_at + LANES);
      for (int i = 0; i < MB; ++i) {
        vf sum = part[i][v][0];
        for (int s = 1; s < SPLIT; ++s) {
          sum += part[i][v][s];
        }
        y[i][v] += sum * scale + bias * xsum[size_t(i) * blocks + b];
      }
    }
  }
  for (int i = 0; i < MB; ++i) {
    for (int v = 0; v < NV; ++v) {
      store(p.out(m0 + i, g, v), y[i][v]);
    }
  }
}

// Work item g's weights (T tiles: T * V vectors) of inputs [k0, k0 + count) as float32 into
// buf [count][T * LANES].
template <int BITS, int T, typename S>
void dequantize_chunk(const Problem<S>& p, int g, int k0, int count, float* buf) {
  constexpr int NVT = T * V, ROW = T * LANES;
  for (int b = k0 / BLOCK; b < (k0 + count) / BLOCK; ++b) {
    for (int v = 0; v < NVT; ++v) {
      const vf scale = load_scales(p.template scales<T>(g, v, b));
      const vf bias = load_scales(p.template scales<T>(g, v, b) + LANES);
      for (int k = b * BLOCK; k < (b + 1) * BLOCK; k += 2) {
        vf q0, q1;
        widen_pair<BITS>(p.template weights<BITS, T>(g, v), k, q0, q1);
        store(buf + size_t(k - k0) * ROW + v * W, q0 * scale + bias);
        store(buf + size_t(k + 1 - k0) * ROW + v * W, q1 * scale + bias);
      }
    }
  }
}

// The same from pack_dot's layout (qdot.cpp): each 32-bit lane holds one output row's inputs
// k..k+3 (8 bits), or k..k+3 and k+4..k+7 in its bytes' nibbles (4 bits), so input k + i of W
// rows is a shift and a mask of one vector, as cheap as pack's widening: a model held in the
// int8 path's layout runs the float path's buffered passes where those are the faster.
template <int BITS, int T, typename S>
void dequantize_dot_chunk(const Problem<S>& p, int g, int k0, int count, float* buf) {
  constexpr int NVT = T * V, ROW = T * LANES;
  constexpr int STEP = 32 / BITS;  // inputs per 64 bytes of a tile (4 a lane)
  constexpr int MASK = (1 << BITS) - 1;
  for (int b = k0 / BLOCK; b < (k0 + count) / BLOCK; ++b) {
    for (int v = 0; v < NVT; ++v) {
      const vf scale = load_scales(p.template scales<T>(g, v, b));
      const vf bias = load_scales(p.template scales<T>(g, v, b) + LANES);
      const uint8_t* tile = p.w + size_t(g * T + v / V) * p.K * BITS / 8 * LANES + (v % V) * W * 4;
      for (int k = b * BLOCK; k < (b + 1) * BLOCK; k += STEP) {
        const vi lanes = load_i32(tile + size_t(k / STEP) * 4 * LANES);
        for (int i = 0; i < 4; ++i) {
          float* row = buf + size_t(k + i - k0) * ROW + v * W;
          store(row, to_float((lanes >> (8 * i)) & MASK) * scale + bias);
          if constexpr (BITS == 4) {
            store(row + 4 * ROW, to_float((lanes >> (8 * i + 4)) & MASK) * scale + bias);
          }
        }
      }
    }
  }
}

// y[m0 .. m0 + MB, work item g of T tiles] += x[.., k0 .. k0 + count] @ buf: per input T * V
// loads and MB broadcasts feed MB x T * V FMAs.
template <int MB, int T, typename S>
void rows_from_buffer(const Problem<S>& p, const float* buf, int g, int k0, int count, int m0) {
  constexpr int NVT = T * V, ROW = T * LANES;
  vf acc[MB][NVT];
  for (int i = 0; i < MB; ++i) {
    for (int v = 0; v < NVT; ++v) {
      acc[i][v] = k0 == 0 ? vf{} : load(p.template out<T>(m0 + i, g, v));
    }
  }
  for (int k = 0; k < count; ++k) {
    vf w[NVT];
    for (int v = 0; v < NVT; ++v) {
      w[v] = load(buf + size_t(k) * ROW + v * W);
    }
    for (int i = 0; i < MB; ++i) {
      const float xk = p.x[size_t(m0 + i) * p.K + k0 + k];
      for (int v = 0; v < NVT; ++v) {
        acc[i][v] += w[v] * xk;
      }
    }
  }
  for (int i = 0; i < MB; ++i) {
    for (int v = 0; v < NVT; ++v) {
      store(p.template out<T>(m0 + i, g, v), acc[i][v]);
    }
  }
}

// Work item g (of T tiles) of y = x @ dequantize(w)^T in buffered passes: each chunk of its
// weights (pack_dot's layout where DOT) dequantized once into buf (BUFFER_FLOATS), then
// BUFFER_ROWS rows of x at a time.
template <int BITS, int T, typename S, bool DOT = false>
void buffered_item(const Problem<S>& p, float* buf, int g) {
  for (int k0 = 0; k0 < p.K; k0 += CHUNK<T>) {
    const int count = imin(CHUNK<T>, p.K - k0);
    if constexpr (DOT) {
      dequantize_dot_chunk<BITS, T, S>(p, g, k0, count, buf);
    } else {
      dequantize_chunk<BITS, T, S>(p, g, k0, count, buf);
    }
    // The rows split evenly over the passes: a short last pass (32 rows as 5 x 6 + 2 on AVX2)
    // has too few accumulators to hide the FMAs' latency.
    const int passes = (p.M + BUFFER_ROWS - 1) / BUFFER_ROWS;
    for (int pass = 0, m = 0; pass < passes; ++pass) {
      const int rows = (p.M - m) / (passes - pass);
      with_rows<BUFFER_ROWS>(rows, [&](auto mb) {
        rows_from_buffer<decltype(mb)::value, T, S>(p, buf, g, k0, count, m);
      });
      m += rows;
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
// dequantizes chunks into a buffer of BUFFER_FLOATS floats.
inline bool in_registers(int M) {
  return M < BUFFER_MIN_ROWS;
}

// Work item g (one tile) of y = x @ dequantize(w)^T in passes in registers, MAX_ROWS rows of
// x at a time; xsum: block_sums of x.
template <int BITS, typename S>
void registers_item(const Problem<S>& p, const float* xsum, int g) {
  for (int m = 0; m < p.M; m += MAX_ROWS) {
    with_rows<MAX_ROWS>(imin(MAX_ROWS, p.M - m), [&](auto mb) {
      rows_in_registers<BITS, decltype(mb)::value, S>(p, xsum, g, m);
    });
  }
}

// Work item g of y = x @ dequantize(w)^T: its GROUP outputs for every row of x, in passes.
template <int BITS, typename S>
void work_item(const Problem<S>& p, const float* xsum, float* buf, int g) {
  if (in_registers(p.M)) {
    registers_item<BITS, S>(p, xsum, g);
  } else {
    buffered_item<BITS, TILES, S>(p, buf, g);
  }
}

}  // namespace
}  // namespace MLXD_ISA
}  // namespace mlxd

// A CPU matmul against affine-quantized weights (4 or 8 bits, blocks of 32), as an MLX primitive.
//
// MLX 0.32's CPU backend dequantizes quantized weights element by element, 2-4x slower than
// float32 BLAS; float32 weights in turn move 8x the bytes of a 4-bit file at batch 1, where a
// decode step is bound by memory bandwidth. This kernel reads the packed weights once per step,
// turns them into float32 in registers and multiplies them with up to 8 rows of x at a time;
// with many rows (prefill) each tile pair is dequantized once into a buffer instead.
//
// `mlxd.kernels.pack` lays the weights out (once, at load) for vectors along the output axis, so
// no horizontal sums are needed: output rows go in tiles of 16, and for each tile and input k
//   8 bits: 16 bytes, q[n0 + j][k] for j < 16
//   4 bits: 16 bytes per pair (k, k + 1), byte j = q[n0 + j][k] | q[n0 + j][k + 1] << 4
// and per tile and block of 32 inputs 16 scales then 16 biases, float16 (when that is exact,
// as for a GGUF's) or float32: w = scale * q + bias (MLX's affine quantization). At batch 1 a
// step streams every weight from memory, so the bytes per weight set its pace: 4.5 bits here
// with float16 scales, as a Q4_1 GGUF.
// GCC vector extensions keep the code portable: -march=native turns them into AVX-512 or AVX2.

#include "qmatmul.h"
#include "simd.h"
#include "threads.h"

#include <omp.h>

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <vector>

namespace mlxd {

namespace {

constexpr int BLOCK = 32;  // inputs sharing one scale and bias (a tile: LANES output rows)
constexpr int TILES = 2;  // tiles per work item: each broadcast x value feeds two FMAs
constexpr int MAX_ROWS = 8;  // rows of x per pass over the weights
// From this many rows on, dequantizing a tile pair once into a buffer beats dequantizing it
// in registers for every pass of 8 (measured: slower below, up to 1.15x faster at 512 rows).
constexpr int BUFFER_MIN_ROWS = 64;
constexpr int PREFETCH_BLOCKS = 4;  // how far ahead (blocks of 32 inputs) weights are fetched

typedef uint8_t u8x16 __attribute__((vector_size(16)));

// 16 bytes widened to 16 int32 lanes. GCC's generic __builtin_convertvector does this byte by
// byte in scalar code, so the x86 widening instructions are named where they exist.
inline i32x16 load_u8(const uint8_t* p) {
#if defined(__AVX512F__)
  return (i32x16)_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#elif defined(__AVX2__)
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m256i halves[2] = {
      _mm256_cvtepu8_epi32(bytes), _mm256_cvtepu8_epi32(_mm_srli_si128(bytes, 8))};
  i32x16 v;
  std::memcpy(&v, halves, sizeof(v));
  return v;
#else
  u8x16 v;
  std::memcpy(&v, p, sizeof(v));
  return __builtin_convertvector(v, i32x16);
#endif
}

// 16 scales or biases as float32, from float32 or float16 (uint16_t bits).
template <typename S>
inline f32x16 load_scales(const S* p) {
  if constexpr (sizeof(S) == 4) {
    return load_f32(reinterpret_cast<const float*>(p));
  } else {
#if defined(__AVX512F__)
    return (f32x16)_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#elif defined(__F16C__)
    const __m256 halves[2] = {
        _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
        _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)))};
    f32x16 v;
    std::memcpy(&v, halves, sizeof(v));
    return v;
#else
    typedef _Float16 f16x16 __attribute__((vector_size(32)));
    f16x16 h;
    std::memcpy(&h, p, sizeof(h));
    return __builtin_convertvector(h, f32x16);
#endif
  }
}

template <typename S>
struct Problem {
  const float* x;  // [M, K]
  const uint8_t* w;  // [N / 16 tiles, K * bits / 8 * 16 bytes]
  const S* scale_bias;  // [N / 16 tiles, K / 32 blocks, 2 (scale, bias), 16]
  float* y;  // [M, N]
  int M, N, K;
  int threads;

  template <int BITS>
  const uint8_t* tile(int t) const {
    return w + size_t(t) * K * BITS / 8 * LANES;
  }
  const S* scales(int t, int block) const {  // the tile's 16 scales; its biases follow
    return scale_bias + (size_t(t) * (K / BLOCK) + block) * 2 * LANES;
  }
};

// Weights of inputs k and k + 1 for the 16 rows of a tile, as float32.
template <int BITS>
inline void dequantize_pair(
    const uint8_t* tile, int k, f32x16 scale, f32x16 bias, f32x16& w0, f32x16& w1) {
  if constexpr (BITS == 4) {
    const i32x16 q = load_u8(tile + (k / 2) * LANES);
    w0 = __builtin_convertvector(q & 15, f32x16) * scale + bias;
    w1 = __builtin_convertvector(q >> 4, f32x16) * scale + bias;
  } else {
    w0 = __builtin_convertvector(load_u8(tile + k * LANES), f32x16) * scale + bias;
    w1 = __builtin_convertvector(load_u8(tile + (k + 1) * LANES), f32x16) * scale + bias;
  }
}

// y[m0 .. m0 + MB, n0 .. n0 + 32] for tiles t0 and t0 + 1. With few rows the FMAs alone cannot
// hide their latency, so inputs k and k + 1 accumulate apart (SPLIT) and are summed at the end.
template <int BITS, int MB, typename S>
void tile_pair(const Problem<S>& p, int t0, int m0) {
  constexpr int SPLIT = MB <= 4 ? 2 : 1;
  constexpr int BLOCK_BYTES = BLOCK * BITS / 8 * LANES;
  const int blocks = p.K / BLOCK;
  f32x16 acc[MB][TILES][SPLIT] = {};
  for (int b = 0; b < blocks; ++b) {
    f32x16 scale[TILES], bias[TILES];
    for (int v = 0; v < TILES; ++v) {
      // The hardware prefetcher alone streamed a decode step's weights at ≈10 GB/s of the
      // ≈33 this machine reads: ask for the block a few ahead (past the end: harmless).
      const uint8_t* ahead = p.template tile<BITS>(t0 + v) + (b + PREFETCH_BLOCKS) * BLOCK_BYTES;
      for (int line = 0; line < BLOCK_BYTES; line += 64) {
        __builtin_prefetch(ahead + line);
      }
      __builtin_prefetch(p.scales(t0 + v, b + PREFETCH_BLOCKS));
      scale[v] = load_scales(p.scales(t0 + v, b));
      bias[v] = load_scales(p.scales(t0 + v, b) + LANES);
    }
    for (int k = b * BLOCK; k < (b + 1) * BLOCK; k += 2) {
      f32x16 w0[TILES], w1[TILES];
      for (int v = 0; v < TILES; ++v) {
        dequantize_pair<BITS>(p.template tile<BITS>(t0 + v), k, scale[v], bias[v], w0[v], w1[v]);
      }
      for (int i = 0; i < MB; ++i) {
        const float* xr = p.x + size_t(m0 + i) * p.K + k;
        const float x0 = xr[0], x1 = xr[1];
        for (int v = 0; v < TILES; ++v) {
          acc[i][v][0] += w0[v] * x0;
          acc[i][v][SPLIT - 1] += w1[v] * x1;
        }
      }
    }
  }
  for (int i = 0; i < MB; ++i) {
    for (int v = 0; v < TILES; ++v) {
      f32x16 sum = acc[i][v][0];
      if constexpr (SPLIT == 2) {
        sum += acc[i][v][1];
      }
      std::memcpy(p.y + size_t(m0 + i) * p.N + (t0 + v) * LANES, &sum, sizeof(sum));
    }
  }
}

template <int BITS, typename S>
void rows(const Problem<S>& p, int t0, int m0, int count) {
  switch (count) {
    case 1: return tile_pair<BITS, 1, S>(p, t0, m0);
    case 2: return tile_pair<BITS, 2, S>(p, t0, m0);
    case 3: return tile_pair<BITS, 3, S>(p, t0, m0);
    case 4: return tile_pair<BITS, 4, S>(p, t0, m0);
    case 5: return tile_pair<BITS, 5, S>(p, t0, m0);
    case 6: return tile_pair<BITS, 6, S>(p, t0, m0);
    case 7: return tile_pair<BITS, 7, S>(p, t0, m0);
    default: return tile_pair<BITS, 8, S>(p, t0, m0);
  }
}

// Many rows (prefill): a tile pair's weights dequantized once into `wbuf` [TILES][K][16]
// (L2-resident), then each pass of 8 rows loads them instead of dequantizing again: 2 loads
// and 8 broadcasts feed 16 FMAs, where dequantizing cost about as much as the FMAs.
template <int BITS, typename S>
void dequantize_tiles(const Problem<S>& p, int t0, float* wbuf) {
  for (int v = 0; v < TILES; ++v) {
    for (int b = 0; b < p.K / BLOCK; ++b) {
      const f32x16 scale = load_scales(p.scales(t0 + v, b));
      const f32x16 bias = load_scales(p.scales(t0 + v, b) + LANES);
      for (int k = b * BLOCK; k < (b + 1) * BLOCK; k += 2) {
        f32x16 w0, w1;
        dequantize_pair<BITS>(p.template tile<BITS>(t0 + v), k, scale, bias, w0, w1);
        std::memcpy(wbuf + (size_t(v) * p.K + k) * LANES, &w0, sizeof(w0));
        std::memcpy(wbuf + (size_t(v) * p.K + k + 1) * LANES, &w1, sizeof(w1));
      }
    }
  }
}

template <int MB, typename S>
void buffered_pair(const Problem<S>& p, const float* wbuf, int t0, int m0) {
  f32x16 acc[MB][TILES] = {};
  for (int k = 0; k < p.K; ++k) {
    f32x16 w[TILES];
    for (int v = 0; v < TILES; ++v) {
      w[v] = load_f32(wbuf + (size_t(v) * p.K + k) * LANES);
    }
    for (int i = 0; i < MB; ++i) {
      const float xk = p.x[size_t(m0 + i) * p.K + k];
      for (int v = 0; v < TILES; ++v) {
        acc[i][v] += w[v] * xk;
      }
    }
  }
  for (int i = 0; i < MB; ++i) {
    for (int v = 0; v < TILES; ++v) {
      std::memcpy(p.y + size_t(m0 + i) * p.N + (t0 + v) * LANES, &acc[i][v], sizeof(acc[i][v]));
    }
  }
}

// Work items are pairs of tiles, split over the threads; each walks every row of x in passes of
// up to 8: up to BUFFER_MIN_ROWS rows dequantize in registers per pass, more once into a buffer.
template <int BITS, typename S>
void run(const Problem<S>& p) {
  const int pairs = p.N / (LANES * TILES);
  const int threads = p.threads;
  if (p.M < BUFFER_MIN_ROWS) {
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int t = 0; t < pairs; ++t) {
      for (int m = 0; m < p.M; m += MAX_ROWS) {
        rows<BITS, S>(p, t * TILES, m, std::min(MAX_ROWS, p.M - m));
      }
    }
    return;
  }
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
    std::vector<float> wbuf(size_t(TILES) * p.K * LANES);
#pragma omp for schedule(static)
    for (int t = 0; t < pairs; ++t) {
      dequantize_tiles<BITS, S>(p, t * TILES, wbuf.data());
      int m = 0;
      for (; m + MAX_ROWS <= p.M; m += MAX_ROWS) {
        buffered_pair<MAX_ROWS, S>(p, wbuf.data(), t * TILES, m);
      }
      for (; m < p.M; ++m) {
        buffered_pair<1, S>(p, wbuf.data(), t * TILES, m);
      }
    }
  }
}

}  // namespace

template <typename S>
void qmatmul_cpu(const float* x, const uint8_t* w, const S* scale_bias, float* y, int M, int N,
                 int K, int bits, int threads) {
  const Problem<S> p{x, w, scale_bias, y, M, N, K, threads};
  if (bits == 4) {
    run<4, S>(p);
  } else if (bits == 8) {
    run<8, S>(p);
  } else {
    throw std::invalid_argument("qmatmul: bits must be 4 or 8");
  }
}

template void qmatmul_cpu<float>(const float*, const uint8_t*, const float*, float*, int, int,
                                 int, int, int);
template void qmatmul_cpu<uint16_t>(const float*, const uint8_t*, const uint16_t*, float*, int,
                                    int, int, int, int);

}  // namespace mlxd

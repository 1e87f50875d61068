// The int8 dot-product matmul's kernels (see qdot.cpp for the layout and the arithmetic), shared
// by the dense matmul (qdot.cpp) and the experts' gather matmul (gather_qdot.cpp):
// `quantize_rows` rounds x to int8 per block, `dot_work_item` computes one work item (GROUP
// output rows) for every row of x. Included once per ISA variant (simd.h), inside its namespace.
#pragma once

#include <utility>

#include "parallel.h"
#include "tiles.h"

namespace mlxd {
namespace MLXD_ISA {

namespace {

// Rows per pass: as many as leave the accumulators, a step's weight vectors (two per vector of
// output rows: low and high nibbles, or two groups of 4 inputs) and the broadcasts in registers.
#if defined(MLXD_ISA_AVX512)
constexpr int MAX_ROWS = 8;
#elif defined(MLXD_ISA_AVX2) || defined(MLXD_ISA_NEON)
constexpr int MAX_ROWS = 4;
#else
constexpr int MAX_ROWS = 2;
#endif
constexpr int ACCUMULATORS = REGISTERS - 2 * NV - 4;
// precise's second int8 term: what rounding x to int8 left, in steps of 1 / REST_STEPS of x8's.
constexpr int REST_STEPS = 254;

// Where the dot product takes q as signed (q - OFFSET: sdot is signed x signed; maddubs's pair
// sums of 255 x 127 would saturate int16), the sum misses OFFSET * sum_k x8_k: the bias term
// takes it (b + OFFSET s).
#if defined(__AVX512VNNI__) || defined(__AVXVNNI__)
constexpr int offset(int) {
  return 0;
}
#elif defined(MLXD_ISA_AVX512) || defined(MLXD_ISA_AVX2)
constexpr int offset(int bits) {
  return bits == 8 ? 128 : 0;
}
#elif defined(__ARM_FEATURE_DOTPROD)
constexpr int offset(int bits) {
  return bits == 8 ? 128 : 8;
}
#else
constexpr int offset(int) {
  return 0;
}
#define MLXD_SCALAR_DOT 1  // no integer dot instruction: a scalar loop, for correctness only
#endif

// Where the dot product is vpmaddubsw + vpmaddwd (no VNNI), 4-bit weights' pair sums (at most
// 2 * 15 * 127) are summed as int16 for a whole block (8 per lane: 30,480 < 2^15) and widened
// once, in `widen`: a third fewer instructions a step than widening every product.
//
// Precise's 8-bit weights there take x as int16 (WIDE): one int16 an input, 254 x8 + rest (see
// quantize_rows), times the weights' bytes as int16 pairs, 16 products a vpmaddwd. vpmaddubsw
// multiplies unsigned by signed bytes, so q (0-255) needs its sign moved onto x first: 4
// instructions per 32 products and int8 row, 8 for precise's two rows, where this takes 4. (With
// one term the same 4 either way, and twice the bytes of x: a Llama-3.2-1B-shaped layer's 8-bit
// matmuls at 8 rows took 4.4-5.4 ms this way against 3.5-4.0.) AVX2 on two Zen 5 cores, precise:
// SmolLM2's 8-bit head (49,152 x 576) at 32 rows 13.1 -> 7.6 ms (9.6 in the float layout), that
// Llama-3.2-1B-shaped layer at 8 rows 6.7-7.3 -> 4.7-5.5 ms (5.7-6.7 in the float layout).
#if (defined(MLXD_ISA_AVX512) && !defined(__AVX512VNNI__)) || \
    (defined(MLXD_ISA_AVX2) && !defined(__AVXVNNI__))
template <int BITS>
constexpr bool SUM16 = BITS == 4;
template <int BITS, int TERMS>
constexpr bool WIDE = BITS == 8 && TERMS == 2;
#else
template <int BITS>
constexpr bool SUM16 = false;
template <int BITS, int TERMS>
constexpr bool WIDE = false;
#endif

// int8 rows (of K bytes) a row of x takes quantized: TERMS, or one int16 row where WIDE.
template <int BITS, int TERMS>
constexpr int X_ROWS = WIDE<BITS, TERMS> ? 2 : TERMS;
// Dot products a row of x takes: one per int8 row, or one where WIDE (its int16 holds both terms).
template <int BITS, int TERMS>
constexpr int DOTS = WIDE<BITS, TERMS> ? 1 : TERMS;

#if defined(MLXD_ISA_AVX512)
// Adjacent int16 lanes summed into int32, times FACTOR (vpmaddwd by FACTOR: the multiplication
// costs nothing there).
template <int FACTOR = 1>
inline vi pairs_to_int32(vi pairs) {
  return (vi)_mm512_madd_epi16((__m512i)pairs, _mm512_set1_epi16(FACTOR));
}
#elif defined(MLXD_ISA_AVX2)
template <int FACTOR = 1>
inline vi pairs_to_int32(vi pairs) {
  return (vi)_mm256_madd_epi16((__m256i)pairs, _mm256_set1_epi16(FACTOR));
}
#endif

// A block's partial sum as int32 per lane, times FACTOR: the int16 pairs of SUM16's sums added.
template <int BITS, int FACTOR = 1>
inline vi widen(vi part) {
#if defined(MLXD_ISA_AVX512) || defined(MLXD_ISA_AVX2)
  if constexpr (SUM16<BITS>) {
    return pairs_to_int32<FACTOR>(part);
  }
#endif
  return FACTOR == 1 ? part : part * FACTOR;
}

// acc[j] += sum_i (w[4j + i] - OFFSET) x[4j + i], w unsigned bytes (q), x signed (x8, |x| <= 127)
// (as int16 pairs where SUM16); where PAIRS (WIDE), w and x as int16 pairs (see load_step).
template <int BITS, bool PAIRS = false>
inline vi dot(vi acc, vi w, vi x) {
#if defined(MLXD_ISA_AVX512) && defined(__AVX512VNNI__)
  return (vi)_mm512_dpbusd_epi32((__m512i)acc, (__m512i)w, (__m512i)x);
#elif defined(MLXD_ISA_AVX512)
  if constexpr (PAIRS) {
    return acc + (vi)_mm512_madd_epi16((__m512i)w, (__m512i)x);
  }
  __m512i u = (__m512i)w, s = (__m512i)x;
  if constexpr (BITS == 8) {  // |q - 128| <= 128 with q's sign moved onto x: pairs fit int16
    const __m512i q = _mm512_xor_si512(u, _mm512_set1_epi8(-128));
    s = _mm512_mask_sub_epi8(s, _mm512_movepi8_mask(q), _mm512_setzero_si512(), s);
    u = _mm512_abs_epi8(q);
  }
  if constexpr (SUM16<BITS>) {
    return (vi)_mm512_add_epi16((__m512i)acc, _mm512_maddubs_epi16(u, s));
  }
  return acc + pairs_to_int32((vi)_mm512_maddubs_epi16(u, s));
#elif defined(MLXD_ISA_AVX2) && defined(__AVXVNNI__)
  return (vi)_mm256_dpbusd_avx_epi32((__m256i)acc, (__m256i)w, (__m256i)x);
#elif defined(MLXD_ISA_AVX2)
  if constexpr (PAIRS) {
    return acc + (vi)_mm256_madd_epi16((__m256i)w, (__m256i)x);
  }
  __m256i u = (__m256i)w, s = (__m256i)x;
  if constexpr (BITS == 8) {
    const __m256i q = _mm256_xor_si256(u, _mm256_set1_epi8(-128));
    s = _mm256_sign_epi8(s, q);
    u = _mm256_sign_epi8(q, q);
  }
  if constexpr (SUM16<BITS>) {
    return (vi)_mm256_add_epi16((__m256i)acc, _mm256_maddubs_epi16(u, s));
  }
  return acc + pairs_to_int32((vi)_mm256_maddubs_epi16(u, s));
#elif defined(__ARM_FEATURE_DOTPROD)
  const int8x16_t q = BITS == 8 ? veorq_s8((int8x16_t)w, vdupq_n_s8(-128))
                                : vsubq_s8((int8x16_t)w, vdupq_n_s8(8));
  return (vi)vdotq_s32((int32x4_t)acc, q, (int8x16_t)x);
#else
  typedef uint8_t u8 __attribute__((vector_size(sizeof(vi))));
  typedef int8_t s8 __attribute__((vector_size(sizeof(vi))));
  const u8 u = (u8)w;
  const s8 s = (s8)x;
  for (int j = 0; j < W; ++j) {
    int32_t sum = 0;
    for (int i = 0; i < 4; ++i) {
      sum += int32_t(u[4 * j + i]) * int32_t(s[4 * j + i]);
    }
    acc[j] += sum;
  }
  return acc;
#endif
}

inline vi broadcast4(const int8_t* p) {  // 4 bytes of x8 in every 32-bit lane
  int32_t word;
  std::memcpy(&word, p, sizeof(word));
  return vi{} + word;
}

// x quantized per row and block: x8 [M * X_ROWS, K], and per block its scale d and the sum of
// x8 (see quantize_rows).
struct Quantized {
  const int8_t* x8;
  const float *d, *sum8;  // [M * X_ROWS, K / 32] each
};

template <typename S>
struct Problem {
  Quantized x;
  const uint8_t* w;  // [N / 16 tiles, K * bits / 8 * 16 bytes] (pack_dot's layout)
  const S* scale_bias;  // [N / 16 tiles, K / group, 2 (scale, bias), 16]
  float* y;  // [M, N]
  int M, N, K;  // M: rows of x (of y)
  int scale_shift;  // log2(group / 32): blocks of 32 inputs share a scale and bias

  // Vector v of work item g's weights (tile g * TILES + v / V, lanes from (v % V) * W), 4-byte
  // lanes.
  template <int BITS>
  const uint8_t* weights(int g, int v) const {
    return w + size_t(g * TILES + v / V) * K * BITS / 8 * LANES + (v % V) * W * 4;
  }
  const S* scales(int g, int v) const {  // its W scales of the first group
    return scale_bias + size_t(g * TILES + v / V) * (K / BLOCK >> scale_shift) * 2 * LANES +
           (v % V) * W;
  }
  const S* scales(int g, int v, int block) const {  // its W scales; the biases follow at +16
    return scales(g, v) + size_t(block >> scale_shift) * 2 * LANES;
  }
  float* out(int m, int g, int v) const {
    return y + size_t(m) * N + g * GROUP + v * W;
  }
};

// A step's weights for the W rows at `at`: the bytes of inputs k..k+3 (lo) and k+4..k+7 (hi),
// or where WIDE inputs k, k+2 (lo) and k+1, k+3 (hi) as int16 pairs, x's int16 in that order.
template <int BITS, bool PAIRS>
inline void load_step(const uint8_t* at, int k, vi& lo, vi& hi) {
  typedef uint32_t vu __attribute__((vector_size(sizeof(vi))));
  if constexpr (PAIRS) {
    const vu four = (vu)load_i32(at + (k / 4) * 64);
    lo = (vi)(four & 0x00FF00FFu);
    hi = (vi)((four >> 8) & 0x00FF00FFu);
  } else if constexpr (BITS == 4) {
    const vu both = (vu)load_i32(at + (k / 8) * 64);
    lo = (vi)(both & 0x0F0F0F0Fu);
    hi = (vi)((both >> 4) & 0x0F0F0F0Fu);
  } else {
    lo = load_i32(at + (k / 4) * 64);
    hi = load_i32(at + (k / 4 + 1) * 64);
  }
}

// y[m0 .. m0 + MB / DOTS, work item g] from MB dot rows (int8, or int16 where WIDE) from row
// m0's: per block the int32 sums of SPLIT partial accumulators and of a row's DOTS, scaled in
// float into y's vectors, which stay in registers until the last block (stored once, not loaded
// and stored again every 32 inputs: at 8 rows that epilogue was as many instructions as the dot
// products).
template <int BITS, int MB, int TERMS, typename S>
void rows_dot(const Problem<S>& p, int g, int m0) {
  constexpr bool PAIRS = WIDE<BITS, TERMS>;
  constexpr int ROWS = X_ROWS<BITS, TERMS>, ROW_DOTS = DOTS<BITS, TERMS>;
  static_assert(MB % ROW_DOTS == 0, "whole rows of x per pass");
  constexpr int SPLIT = split_for(MB * NV, ACCUMULATORS - MB / ROW_DOTS * NV);
  constexpr int STEP = PAIRS ? 4 : 8;  // inputs a step: two vectors of 4 a lane, or of int16 pairs
  constexpr int STEPS = SPLIT > 2 ? SPLIT / 2 : 1;  // steps per iteration
  constexpr int BLOCK_BYTES = BLOCK * BITS / 8 * LANES;
  constexpr int X_BYTES = PAIRS ? 2 : 1;  // a dot row's bytes per input
  constexpr float OFFSET = PAIRS ? 0 : offset(BITS);  // q - OFFSET in the dot product
  const int blocks = p.K / BLOCK;
  const size_t first = size_t(m0) * ROWS;  // the pass's first int8 row
  const int8_t* x8 = p.x.x8 + first * p.K;
  const float* d = p.x.d + first * blocks;
  const float* sum8 = p.x.sum8 + first * blocks;
  // Work item g's first group's scales, computed once: precise at one row is compute-bound.
  const S* scales[NV];
  for (int v = 0; v < NV; ++v) {
    scales[v] = p.scales(g, v);
  }
  vf y[MB / ROW_DOTS][NV] = {};
  for (int b = 0; b < blocks; ++b) {
    prefetch_block<BITS, TILES, V, BLOCK_BYTES>(p, g, b + PREFETCH_BLOCKS);
    vi part[MB][NV][SPLIT] = {};
    // Unrolled, so `part` is indexed by constants and stays in registers: with float32 scales
    // (a K-quant GGUF's) GCC 12 left the loops over rows and steps rolled for 2-7 rows (and
    // precise's one row, two int8 rows), `part` in memory: a 1B shape's 8192 x 2048 at one
    // row, precise, took 0.31 ms against 0.10 unrolled, int8 at 2-7 rows 2-3x the time
    // (AVX-512 VNNI). With float16 scales it had unrolled them: the same either way.
    for (int k = b * BLOCK; k < (b + 1) * BLOCK; k += STEP * STEPS) {
#pragma GCC unroll 8
      for (int u = 0; u < STEPS; ++u) {
        const int kk = k + STEP * u;
        vi lo[NV], hi[NV];
#pragma GCC unroll 8
        for (int v = 0; v < NV; ++v) {
          load_step<BITS, PAIRS>(p.template weights<BITS>(g, v), kk, lo[v], hi[v]);
        }
#pragma GCC unroll 16
        for (int i = 0; i < MB; ++i) {
          // lo's and hi's 4 bytes of x: inputs kk..kk+3, kk+4..kk+7, or where WIDE the int16
          // of kk, kk+2 and kk+1, kk+3.
          const int8_t* xr = x8 + (size_t(i) * p.K + kk) * X_BYTES;
          const vi x0 = broadcast4(xr), x1 = broadcast4(xr + 4);
#pragma GCC unroll 8
          for (int v = 0; v < NV; ++v) {
            part[i][v][(2 * u) % SPLIT] = dot<BITS, PAIRS>(part[i][v][(2 * u) % SPLIT], lo[v], x0);
            part[i][v][(2 * u + 1) % SPLIT] = dot<BITS, PAIRS>(part[i][v][(2 * u + 1) % SPLIT], hi[v], x1);
          }
        }
      }
    }
    const size_t group_at = size_t(b >> p.scale_shift) * 2 * LANES;  // block b's pairs
    for (int v = 0; v < NV; ++v) {
      const vf scale = load_scales(scales[v] + group_at);
      const vf bias = load_scales(scales[v] + group_at + LANES) + OFFSET * scale;
      for (int i = 0; i < MB / ROW_DOTS; ++i) {
        // A row's two int8 sums as one integer, 254 x8 + rest with precise (see quantize_rows),
        // then scaled once: half the float work a block of the two sums scaled apart took.
        vi sum = {};
        for (int s = 0; s < SPLIT; ++s) {
          sum += widen<BITS, ROW_DOTS == 2 ? REST_STEPS : 1>(part[i * ROW_DOTS][v][s]);
          if constexpr (ROW_DOTS == 2) {
            sum += widen<BITS>(part[i * ROW_DOTS + 1][v][s]);
          }
        }
        const size_t at = size_t(i * ROWS + ROWS - 1) * blocks + b;  // the row's d, sum8
        // Exact in float with one int8 term (|sum| <= 32 * 255 * 127 < 2^24); with two, to
        // float's 24 bits of a sum as exact as x's 16.
        const vf q_x8 = __builtin_convertvector(sum, vf);
        y[i][v] += (q_x8 * scale + bias * sum8[at]) * d[at];
      }
    }
  }
  for (int i = 0; i < MB / ROW_DOTS; ++i) {
    for (int v = 0; v < NV; ++v) {
      store(p.out(m0 + i, g, v), y[i][v]);
    }
  }
}

// Where WIDE, each 4 inputs' int16 in the order load_step pairs the weights: k, k+2, k+1, k+3.
template <size_t... J>
constexpr vi wide_order(std::index_sequence<J...>) {
  return vi{int((J & ~3u) | (J & 1) << 1 | (J & 2) >> 1)...};
}

// x's rows to int8 per block of 32, round to nearest, as llama.cpp's quantize_row_q8_1: int8
// row m * TERMS. With TERMS = 2, row m * 2 + 1 holds what the rounding left, e = x - d x8, in
// steps of d / 254 (|e| <= d / 2): x to 1 / 64,516 of its block's largest |x| instead of 1 / 254,
// for twice the dot products. That row's d and sum8 are the pair's, as one term's (the x8
// row's are not written: nothing reads them). Where WIDE, row m is one int16 row in those two
// rows' bytes instead: 254 x8 + rest (|x16| <= 32,385).
template <int BITS, int TERMS>
void quantize_rows(const float* x, int M, int K, int threads, int8_t* x8, float* d, float* sum8) {
  constexpr int ROWS = X_ROWS<BITS, TERMS>;
  const int blocks = K / BLOCK;
  parallel_for(M > 1 ? threads : 1, M, [&](int64_t first, int64_t last) {
    for (int m = int(first); m < int(last); ++m) {
      for (int b = 0; b < blocks; ++b) {
        const float* xb = x + size_t(m) * K + b * BLOCK;
        int8_t* row = x8 + size_t(m) * ROWS * K;
        int8_t* qb = row + b * BLOCK;  // the block in the int8 rows (not WIDE)
        vf largest = {};
        for (int k = 0; k < BLOCK; k += W) {
          const vf v = load(xb + k);
          largest = largest > v ? largest : v;
          largest = largest > -v ? largest : -v;
        }
        const float amax = hmax(largest), inverse = amax > 0 ? 127 / amax : 0;
        const float step = amax / 127;
        // W values at a time: one at a time, this was 14% of a 32-row SmolLM2 decode step.
        const vf by = vf{} + inverse, low = vf{} - 127, high = vf{} + 127;
        vf total = {};
        [[maybe_unused]] vf rest_total = {};
        for (int k = 0; k < BLOCK; k += W) {
          const vf v = load(xb + k);
          const vi q = round_to_int(v * by);
          const vf qf = __builtin_convertvector(q, vf);
          total += qf;
          vi rest = {};
          if constexpr (TERMS == 2) {
            vf e = __builtin_convertvector(round_to_int((v - qf * step) * by * REST_STEPS), vf);
            e = e < low ? low : e;
            e = e > high ? high : e;
            rest = __builtin_convertvector(e, vi);
            rest_total += e;
          }
          if constexpr (WIDE<BITS, TERMS>) {
            typedef int16_t vs __attribute__((vector_size(W * 2)));
            const vi wide = q * REST_STEPS + rest;
            const vs ordered = __builtin_convertvector(
                __builtin_shuffle(wide, wide_order(std::make_index_sequence<W>{})), vs);
            std::memcpy(row + 2 * (b * BLOCK + k), &ordered, sizeof(ordered));
          } else {
            store_i8(qb + k, q);
            if constexpr (TERMS == 2) {
              store_i8(qb + K + k, rest);
            }
          }
        }
        // Written where rows_dot reads them: the row's last int8 row.
        const size_t at = size_t(m * ROWS + ROWS - 1) * blocks + b;
        const float x8_sum = hsum(total);  // exact: |sum| <= 32 * 127
        if constexpr (TERMS == 2) {
          // The pair's scale and sum as one term's: x ~ step / 254 (254 x8 + rest), which
          // rows_dot sums in integers.
          d[at] = step / REST_STEPS;
          sum8[at] = REST_STEPS * x8_sum + hsum(rest_total);
        } else {
          d[at] = step;
          sum8[at] = x8_sum;
        }
      }
    }
  });
}

// `rows` rows of x quantized for BITS-bit weights in one allocation: X_ROWS int8 rows of K bytes
// a row of x, then d and sum8 per int8 row and block (the dense matmul quantizes all its rows at
// once, the experts' each expert's rows in their place).
template <int BITS, int TERMS>
class QuantizedRows {
 public:
  QuantizedRows(int rows, int K)
      : K_(K),
        blocks_(K / BLOCK),
        per_block_(size_t(rows) * ROWS * blocks_),
        scratch_(size_t(rows) * ROWS * K / 4 + 2 * per_block_) {}

  // Rows first .. first + count of x (`x` at row first) rounded into their place.
  void quantize(const float* x, int first, int count, int threads) {
    const size_t row = size_t(first) * ROWS;
    float* d = scale() + row * blocks_;
    quantize_rows<BITS, TERMS>(x, count, K_, threads, x8() + row * K_, d, d + per_block_);
  }

  // What the kernels read for the rows of x from `first` on.
  Quantized from(int first) const {
    const size_t row = size_t(first) * ROWS;
    const float* d = scale() + row * blocks_;
    return {x8() + row * K_, d, d + per_block_};
  }

 private:
  static constexpr int ROWS = X_ROWS<BITS, TERMS>;
  int8_t* x8() const {  // K / 4 floats' bytes per int8 row
    return reinterpret_cast<int8_t*>(scratch_.data());
  }
  float* scale() const {  // d, then sum8 per_block_ floats on
    return scratch_.data() + per_block_ * BLOCK / 4;
  }
  int K_, blocks_;
  size_t per_block_;  // d's floats (and sum8's)
  Scratch scratch_;
};

// Work item g of y for every row of x, in passes of MAX_ROWS dot rows.
template <int BITS, int TERMS, typename S>
void dot_work_item(const Problem<S>& p, int g) {
  constexpr int ROW_DOTS = DOTS<BITS, TERMS>;
  constexpr int PASS = MAX_ROWS / ROW_DOTS;  // rows of x per pass
  for (int m = 0; m < p.M; m += PASS) {
    with_rows<PASS>(imin(PASS, p.M - m), [&](auto mb) {
      rows_dot<BITS, decltype(mb)::value * ROW_DOTS, TERMS, S>(p, g, m);
    });
  }
}

}  // namespace
}  // namespace MLXD_ISA
}  // namespace mlxd

// Scaled dot-product attention on the CPU without materialising the score matrix, per ISA
// variant (the MLX op around it: attention.cpp).
//
// Decode attention is small (one query row against the cached keys), so each (batch, head) row
// computes its scores, a vectorised softmax and the weighted sum of values directly; prefill
// rows go in tiles of 8 over transposed keys (attend_tile). Rows or tiles are spread over the
// threads.
//
// Keys and values are float32 or float16 (a 16-bit KV cache: half the bytes to read, as
// llama.cpp's default f16 cache); each kernel below is a template on that type, widening halves
// to float32 as it loads them (F16C, NEON's vcvt, a scalar conversion in the generic variant).

#include <limits>

#include "exp.h"
#include "parallel.h"
#include "simd.h"
#include "tiles.h"
#include "variant.h"

namespace mlxd {
namespace MLXD_ISA {

namespace {

constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

// A key or value element as float32: KV is float, or uint16_t (the bits of an IEEE half).
inline float kv_scalar(float x) {
  return x;
}

inline float kv_scalar(uint16_t h) {
#if defined(MLXD_ISA_AVX512) || defined(MLXD_ISA_AVX2)
  return _cvtsh_ss(h);
#else
  return half_to_float(h);
#endif
}

// W consecutive keys or values as float32.
inline vf kv_load(const float* p) {
  return load(p);
}

inline vf kv_load(const uint16_t* p) {
  return load_f16(p);
}

constexpr int MAX_HEAD_DIM = 256;  // q of one row (or a tile's rows) kept in registers/stack
constexpr int MAX_CHUNKS = MAX_HEAD_DIM / W;

// scale * q · k_j for the first `visible` keys.
template <typename KV>
inline void dot_scores(
    const float* q, const KV* k, int64_t k_stride, int D, int visible, float scale, float* out) {
  if (D % W == 0 && D / W <= MAX_CHUNKS) {
    const int chunks = D / W;
    vf qv[MAX_CHUNKS];
    for (int c = 0; c < chunks; ++c) {
      qv[c] = load(q + c * W) * scale;
    }
    for (int j = 0; j < visible; ++j) {
      const KV* kj = k + j * k_stride;
      vf acc = qv[0] * kv_load(kj);
      for (int c = 1; c < chunks; ++c) {
        acc += qv[c] * kv_load(kj + c * W);
      }
      out[j] = hsum(acc);
    }
    return;
  }
  for (int j = 0; j < visible; ++j) {
    const KV* kj = k + j * k_stride;
    float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
    for (int d = 0; d < D; ++d) {
      dot += q[d] * kv_scalar(kj[d]);
    }
    out[j] = dot * scale;
  }
}

template <typename KV>
struct Args : AttentionArgs {
  int group() const {
    return Hq / Hkv;
  }
  int padded() const {  // keys rounded up to whole vectors
    return (Lk + W - 1) / W * W;
  }
  int visible(int i) const {  // keys query row i may see
    return causal ? imin(Lk, Lk - Lq + i + 1) : Lk;
  }
  const float* q_row(int b, int h, int i) const {
    return q + b * qs[0] + h * qs[1] + i * qs[2];
  }
  const KV* keys(int b, int hk) const {
    return static_cast<const KV*>(k) + b * ks[0] + hk * ks[1];
  }
  const KV* values(int b, int hk) const {
    return static_cast<const KV*>(v) + b * vs[0] + hk * vs[1];
  }
  float* out_row(int b, int h, int i) const {
    return y + (heads_last ? (size_t(b) * Lq + i) * Hq + h : (size_t(b) * Hq + h) * Lq + i) * Dv;
  }
};

inline void fill(float* begin, float* end, float value) {
  for (; begin < end; ++begin) {
    *begin = value;
  }
}

// Scores sc[0, visible) of row (b, h, i) in, padded to whole vectors: applies the mask, turns
// them into unnormalised probabilities in place and returns their sum (0: none visible).
template <typename KV>
float softmax_in_place(const Args<KV>& a, int b, int h, int i, float* sc) {
  const int visible = a.visible(i), padded = a.padded();
  fill(sc + visible, sc + padded, NEG_INF);
  if (a.mask != nullptr) {
    const int64_t row = b * a.ms[0] + h * a.ms[1] + i * a.ms[2];
    for (int j = 0; j < visible; ++j) {
      const int64_t at = row + j * a.ms[3];
      if (a.bool_mask) {
        sc[j] = static_cast<const bool*>(a.mask)[at] ? sc[j] : NEG_INF;
      } else {
        sc[j] += static_cast<const float*>(a.mask)[at];
      }
    }
  }
  vf tops = vf{} + NEG_INF;
  for (int j = 0; j < padded; j += W) {
    const vf s = load(sc + j);
    tops = s > tops ? s : tops;
  }
  const float top = hmax(tops);
  if (top == NEG_INF) {  // nothing visible: no weight on any value (a tile sums them all)
    fill(sc, sc + padded, 0.0f);
    return 0.0f;
  }
  vf total = {};
  for (int j = 0; j < padded; j += W) {
    const vf p = exp_nonpositive(load(sc + j) - top);
    store(sc + j, p);
    total += p;
  }
  return hsum(total);
}

// acc[0, n) += p * x[0, n): whole vectors, then the rest one by one.
template <typename KV>
inline void add_weighted(float* acc, float p, const KV* x, int n) {
  int d = 0;
  for (; d + W <= n; d += W) {
    store(acc + d, load(acc + d) + p * kv_load(x + d));
  }
  for (; d < n; ++d) {
    acc[d] += p * kv_scalar(x[d]);
  }
}

// One query row against its keys (decode: a row per head, no reuse of the keys to exploit).
template <typename KV>
void attend_row(const Args<KV>& a, int b, int h, int i, float* sc, float* acc) {
  const int hk = h / a.group();
  dot_scores(a.q_row(b, h, i), a.keys(b, hk), a.ks[2], a.D, a.visible(i), a.scale, sc);
  const float sum = softmax_in_place(a, b, h, i, sc);
  float* out = a.out_row(b, h, i);
  if (sum == 0.0f) {  // nothing visible: zeros, not NaN
    fill(out, out + a.Dv, 0.0f);
    return;
  }
  fill(acc, acc + a.Dv, 0.0f);
  const KV* vb = a.values(b, hk);
  for (int j = 0; j < a.Lk; ++j) {
    const float p = sc[j];
    if (p != 0.0f) {
      add_weighted(acc, p, vb + j * a.vs[2], a.Dv);
    }
  }
  const float inv = 1.0f / sum;
#pragma omp simd
  for (int d = 0; d < a.Dv; ++d) {
    out[d] = acc[d] * inv;
  }
}

constexpr int TILE_ROWS = 8;  // query rows sharing each pass over a kv head's keys and values

// Keys of every (b, kv head) W at a time, head dimension outermost: [B, Hkv, blocks, D, W].
template <typename KV>
void transpose_keys(const Args<KV>& a, float* kt, int b, int hk) {
  const KV* kb = a.keys(b, hk);
  const int padded = a.padded();
  float* dst = kt + (size_t(b) * a.Hkv + hk) * padded * a.D;
  for (int j = 0; j < padded; ++j) {
    float* block = dst + size_t(j / W) * a.D * W + j % W;
    for (int d = 0; d < a.D; ++d) {
      block[d * W] = j < a.Lk ? kv_scalar(kb[j * a.ks[2] + d]) : 0.0f;
    }
  }
}

// acc[r][c] += p[r][j] * v[j][c W, c W + width) over the first `visible` values. FULL loads
// whole vectors; a partial chunk (CHUNKS 1) is copied lane by lane. Apart so that neither path
// takes the accumulators' address: they stay in registers instead of a store per key.
template <int ROWS, int CHUNKS, bool FULL, typename KV>
inline void weigh_values(
    const Args<KV>& a, const KV* v, const float* sc, int visible, int width,
    vf (&acc)[ROWS][CHUNKS]) {
  static_assert(FULL || CHUNKS == 1, "a partial chunk goes alone");
  const int padded = a.padded();
  for (int j = 0; j < visible; ++j) {
    const KV* vj = v + j * a.vs[2];
    vf chunk[CHUNKS] = {};
    if constexpr (FULL) {
      for (int c = 0; c < CHUNKS; ++c) {
        chunk[c] = kv_load(vj + c * W);
      }
    } else {
      for (int lane = 0; lane < width; ++lane) {
        chunk[0][lane] = kv_scalar(vj[lane]);
      }
    }
    for (int r = 0; r < ROWS; ++r) {
      const float p = sc[size_t(r) * padded + j];
      for (int c = 0; c < CHUNKS; ++c) {
        acc[r][c] += p * chunk[c];
      }
    }
  }
}

// Value chunks a pass of `weigh_values` takes for ROWS rows: each accumulator is a chain of
// dependent FMAs, one per key, so a decode step's few rows with one chunk each ran at the FMA's
// latency (4 cycles), not its throughput (two a cycle). Up to four, as the registers allow
// beside the chunks and a broadcast.
template <int ROWS>
constexpr int value_chunks() {
  int chunks = 4;
  while (chunks > 1 && ROWS * chunks + chunks + 2 > REGISTERS) {
    chunks /= 2;
  }
  return chunks;
}

// Rows r of out_rows get acc[r] * inv[r] at columns [d0, d0 + width) (width up to CHUNKS W).
template <int ROWS, int CHUNKS>
inline void store_weighed(
    float* const (&out_rows)[ROWS], const vf (&acc)[ROWS][CHUNKS], const float (&inv)[ROWS],
    int d0, int width) {
  for (int r = 0; r < ROWS; ++r) {
    for (int c = 0; c < CHUNKS && c * W < width; ++c) {
      const vf out = acc[r][c] * inv[r];
      std::memcpy(out_rows[r] + d0 + c * W, &out, imin(W, width - c * W) * sizeof(float));
    }
  }
}

// The scores of ROWS query rows against kv head hk's first `most` keys transposed (kt, by
// transpose_keys): W keys a vector, so no horizontal sums.
template <int ROWS, typename KV>
void transposed_scores(
    const Args<KV>& a, const float (&qscaled)[ROWS][MAX_HEAD_DIM], const float* kt, int b,
    int hk, int most, float* sc) {
  const int padded = a.padded(), D = a.D;
  const float* kth = kt + (size_t(b) * a.Hkv + hk) * padded * D;
  for (int blk = 0; blk < (most + W - 1) / W; ++blk) {
    const float* kblock = kth + size_t(blk) * D * W;
    vf s[ROWS] = {};
    for (int d = 0; d < D; ++d) {
      const vf kd = load(kblock + d * W);
      for (int r = 0; r < ROWS; ++r) {
        s[r] += qscaled[r][d] * kd;
      }
    }
    for (int r = 0; r < ROWS; ++r) {
      store(sc + size_t(r) * padded + blk * W, s[r]);
    }
  }
}

// The same against the keys as stored (not transposed: a decode step's few rows per kv head
// would not repay a copy of every key): each key read once for all the rows, a horizontal sum
// per row and key, four keys' sums at a time where the registers hold their accumulators
// (hsum4: a third of the shuffles). D a multiple of W.
template <int ROWS, typename KV>
void group_scores(
    const Args<KV>& a, const float (&qscaled)[ROWS][MAX_HEAD_DIM], int b, int hk, int most,
    float* sc) {
  constexpr int KEYS = ROWS * 4 + 2 <= REGISTERS ? 4 : 1;
  const KV* kb = a.keys(b, hk);
  const int padded = a.padded(), chunks = a.D / W;
  int j = 0;
  if constexpr (KEYS == 4) {
    for (; j + KEYS <= most; j += KEYS) {
      vf s[ROWS][KEYS] = {};
      for (int c = 0; c < chunks; ++c) {
        for (int t = 0; t < KEYS; ++t) {
          const vf kc = kv_load(kb + (j + t) * a.ks[2] + c * W);
          for (int r = 0; r < ROWS; ++r) {
            s[r][t] += load(qscaled[r] + c * W) * kc;
          }
        }
      }
      for (int r = 0; r < ROWS; ++r) {
        hsum4(s[r][0], s[r][1], s[r][2], s[r][3], sc + size_t(r) * padded + j);
      }
    }
  }
  for (; j < most; ++j) {
    const KV* kj = kb + j * a.ks[2];
    vf s[ROWS] = {};
    for (int c = 0; c < chunks; ++c) {
      const vf kc = kv_load(kj + c * W);
      for (int r = 0; r < ROWS; ++r) {
        s[r] += load(qscaled[r] + c * W) * kc;
      }
    }
    for (int r = 0; r < ROWS; ++r) {
      sc[size_t(r) * padded + j] = hsum(s[r]);
    }
  }
}

// Up to 8 query rows of one kv head (rows r of its group: head hk * group + r / Lq, position
// r % Lq) in one pass over its keys and one over its values: each key block and value row read
// from cache feeds every row, where a row at a time re-read them all per row. The keys
// transposed (kt: prefill, verification) or as stored (kt null: a decode step's heads of one
// kv head, `group_scores`). ROWS is a compile-time count so that the tile's accumulators stay
// in registers.
template <int ROWS, typename KV>
void attend_tile(const Args<KV>& a, const float* kt, int b, int hk, int r0, float* sc) {
  const int padded = a.padded(), D = a.D;
  int hs[ROWS], is[ROWS], most = 0;
  float qscaled[ROWS][MAX_HEAD_DIM];
  for (int r = 0; r < ROWS; ++r) {
    hs[r] = hk * a.group() + (r0 + r) / a.Lq;
    is[r] = (r0 + r) % a.Lq;
    most = imax(most, a.visible(is[r]));
    const float* qi = a.q_row(b, hs[r], is[r]);
    for (int d = 0; d < D; ++d) {
      qscaled[r][d] = qi[d] * a.scale;
    }
  }
  if (kt != nullptr) {
    transposed_scores<ROWS>(a, qscaled, kt, b, hk, most, sc);
  } else {
    group_scores<ROWS>(a, qscaled, b, hk, most, sc);
  }
  float inv[ROWS];
  for (int r = 0; r < ROWS; ++r) {
    const float sum = softmax_in_place(a, b, hs[r], is[r], sc + size_t(r) * padded);
    inv[r] = sum == 0.0f ? 0.0f : 1.0f / sum;  // nothing visible: zeros, not NaN
  }
  const KV* vb = a.values(b, hk);
  float* out_rows[ROWS];
  for (int r = 0; r < ROWS; ++r) {
    out_rows[r] = a.out_row(b, hs[r], is[r]);
  }
  constexpr int CHUNKS = value_chunks<ROWS>();
  int d0 = 0;
  for (; d0 + CHUNKS * W <= a.Dv; d0 += CHUNKS * W) {
    vf acc[ROWS][CHUNKS] = {};
    weigh_values<ROWS, CHUNKS, true>(a, vb + d0, sc, most, CHUNKS * W, acc);
    store_weighed(out_rows, acc, inv, d0, CHUNKS * W);
  }
  for (; d0 < a.Dv; d0 += W) {
    const int width = imin(W, a.Dv - d0);
    vf acc[ROWS][1] = {};
    if (width == W) {
      weigh_values<ROWS, 1, true>(a, vb + d0, sc, most, width, acc);
    } else {
      weigh_values<ROWS, 1, false>(a, vb + d0, sc, most, width, acc);
    }
    store_weighed(out_rows, acc, inv, d0, width);
  }
}

template <typename KV>
void attend_rows(const Args<KV>& a, const float* kt, int b, int hk, int r0, int rows, float* sc) {
  switch (rows) {
    case 1: return attend_tile<1>(a, kt, b, hk, r0, sc);
    case 2: return attend_tile<2>(a, kt, b, hk, r0, sc);
    case 3: return attend_tile<3>(a, kt, b, hk, r0, sc);
    case 4: return attend_tile<4>(a, kt, b, hk, r0, sc);
    case 5: return attend_tile<5>(a, kt, b, hk, r0, sc);
    case 6: return attend_tile<6>(a, kt, b, hk, r0, sc);
    case 7: return attend_tile<7>(a, kt, b, hk, r0, sc);
    default: return attend_tile<TILE_ROWS>(a, kt, b, hk, r0, sc);
  }
}

template <typename KV>
void attend(const Args<KV>& a, int threads) {
  const int padded = a.padded(), group_rows = a.group() * a.Lq;
  // Tiles when each key serves several query rows (prefill, verification). Fewer (a decode
  // step's query heads of one kv head) share the keys as stored, where transposing them would
  // cost more than it saves; a single row, or a head dimension of no whole vectors, goes alone.
  if (group_rows > 1 && group_rows < TILE_ROWS && a.D % W == 0 && a.D <= MAX_HEAD_DIM) {
    parallel_for(threads, int64_t(a.B) * a.Hkv, [&](int64_t first, int64_t last) {
      Scratch scores(size_t(group_rows) * padded);
      for (int64_t head = first; head < last; ++head) {
        attend_rows(a, nullptr, head / a.Hkv, head % a.Hkv, 0, group_rows, scores.data());
      }
    });
    return;
  }
  if (group_rows >= TILE_ROWS && a.D <= MAX_HEAD_DIM) {
    Scratch kt(size_t(a.B) * a.Hkv * padded * a.D);
    const int tiles = (group_rows + TILE_ROWS - 1) / TILE_ROWS;
    parallel_for(threads, int64_t(a.B) * a.Hkv, [&](int64_t first, int64_t last) {
      for (int64_t head = first; head < last; ++head) {
        transpose_keys(a, kt.data(), head / a.Hkv, head % a.Hkv);
      }
    });
    parallel_for(threads, int64_t(a.B) * a.Hkv * tiles, [&](int64_t first, int64_t last) {
      Scratch scores(size_t(TILE_ROWS) * padded);
      for (int64_t item = first; item < last; ++item) {
        const int b = item / (a.Hkv * tiles), hk = item / tiles % a.Hkv, t = item % tiles;
        const int r0 = t * TILE_ROWS;
        attend_rows(a, kt.data(), b, hk, r0, imin(TILE_ROWS, group_rows - r0), scores.data());
      }
    });
    return;
  }
  parallel_for(threads, int64_t(a.B) * a.Hq * a.Lq, [&](int64_t first, int64_t last) {
    Scratch scores(padded), acc(a.Dv);
    for (int64_t row = first; row < last; ++row) {
      attend_row(
          a, row / (a.Hq * a.Lq), row / a.Lq % a.Hq, row % a.Lq, scores.data(), acc.data());
    }
  });
}

}  // namespace

void attention(const AttentionArgs& args, int threads) {
  if (args.kv_half) {
    attend(Args<uint16_t>{args}, threads);
  } else {
    attend(Args<float>{args}, threads);
  }
}

}  // namespace MLXD_ISA
}  // namespace mlxd

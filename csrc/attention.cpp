// Scaled dot-product attention on the CPU, without materialising the score matrix.
//
// MLX 0.32's CPU backend runs mx.fast.scaled_dot_product_attention as separate ops (two
// matmuls through BLAS, a softmax with element-wise exp, the mask): ≈70 µs a layer for one
// decode token and ≈0.7 ms at 32, most of it dispatch and exp. Decode attention is small
// (one query row against the cached keys), so each (batch, head) row computes its scores, a
// vectorised softmax and the weighted sum of values directly; prefill rows go in tiles of 8
// over transposed keys (attend_tile). Rows or tiles are spread over the threads.
#include "attention.h"
#include "simd.h"
#include "threads.h"

#include <omp.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <vector>

#include "mlx/ops.h"

namespace mx = mlx::core;

namespace mlxd {

namespace {

constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

// e^x for x <= 0 (scores minus their maximum), Cephes' expf polynomial: relative error < 2e-7.
inline f32x16 exp_nonpositive(f32x16 x) {
  const f32x16 lo = f32x16{} - 87.0f;
  x = x < lo ? lo : x;  // e^-87 is below float32's normal range: 0 to the sums
  const f32x16 magic = f32x16{} + 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  const f32x16 n = (x * 1.44269504088896341f + magic) - magic;
  const f32x16 r = x - n * 0.693359375f + n * 2.12194440e-4f;
  f32x16 p = f32x16{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const i32x16 bits = (__builtin_convertvector(n, i32x16) + 127) << 23;
  f32x16 scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

constexpr int MAX_HEAD_DIM = 256;  // q of one row (or a tile's rows) kept in registers/stack
constexpr int MAX_CHUNKS = MAX_HEAD_DIM / LANES;

// scale * q · k_j for the first `visible` keys.
inline void dot_scores(
    const float* q, const float* k, int64_t k_stride, int D, int visible, float scale, float* out) {
  if (D % LANES == 0 && D / LANES <= MAX_CHUNKS) {
    const int chunks = D / LANES;
    f32x16 qv[MAX_CHUNKS];
    for (int c = 0; c < chunks; ++c) {
      qv[c] = load_f32(q + c * LANES) * scale;
    }
    for (int j = 0; j < visible; ++j) {
      const float* kj = k + j * k_stride;
      f32x16 acc = qv[0] * load_f32(kj);
      for (int c = 1; c < chunks; ++c) {
        acc += qv[c] * load_f32(kj + c * LANES);
      }
      out[j] = hsum(acc);
    }
    return;
  }
  for (int j = 0; j < visible; ++j) {
    const float* kj = k + j * k_stride;
    float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
    for (int d = 0; d < D; ++d) {
      dot += q[d] * kj[d];
    }
    out[j] = dot * scale;
  }
}

struct Strides {
  int64_t b, h, l;  // the last dimension is contiguous
};

Strides strides_of(const mx::array& a) {
  return {a.strides()[0], a.strides()[1], a.strides()[2]};
}

struct Args {
  const float *q, *k, *v;
  float* y;
  Strides qs, ks, vs;
  const void* mask;  // nullptr, bool or float32, strides ms
  mx::Strides ms;
  bool bool_mask, causal;
  int B, Hq, Lq, D, Hkv, Lk, Dv;
  float scale;

  int group() const {
    return Hq / Hkv;
  }
  int padded() const {
    return (Lk + LANES - 1) / LANES * LANES;
  }
  int visible(int i) const {  // keys query row i may see
    return causal ? std::min(Lk, Lk - Lq + i + 1) : Lk;
  }
  const float* q_row(int b, int h, int i) const {
    return q + b * qs.b + h * qs.h + i * qs.l;
  }
  const float* keys(int b, int hk) const {
    return k + b * ks.b + hk * ks.h;
  }
  const float* values(int b, int hk) const {
    return v + b * vs.b + hk * vs.h;
  }
  float* out_row(int b, int h, int i) const {
    return y + ((size_t(b) * Hq + h) * Lq + i) * Dv;
  }
};

// Scores sc[0, visible) of row (b, h, i) in, padded to a multiple of 16: applies the mask,
// turns them into unnormalised probabilities in place and returns their sum (0: none visible).
float softmax_in_place(const Args& a, int b, int h, int i, float* sc) {
  const int visible = a.visible(i), padded = a.padded();
  std::fill(sc + visible, sc + padded, NEG_INF);
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
  f32x16 tops = f32x16{} + NEG_INF;
  for (int j = 0; j < padded; j += LANES) {
    const f32x16 s = load_f32(sc + j);
    tops = s > tops ? s : tops;
  }
  float top = NEG_INF;
  for (int lane = 0; lane < LANES; ++lane) {
    top = tops[lane] > top ? tops[lane] : top;
  }
  if (top == NEG_INF) {
    return 0.0f;
  }
  f32x16 total = {};
  for (int j = 0; j < padded; j += LANES) {
    const f32x16 p = exp_nonpositive(load_f32(sc + j) - top);
    std::memcpy(sc + j, &p, sizeof(p));
    total += p;
  }
  return hsum(total);
}

// One query row against its keys (decode: a row per head, no reuse of the keys to exploit).
void attend_row(const Args& a, int b, int h, int i, float* sc, float* acc) {
  const int hk = h / a.group();
  dot_scores(a.q_row(b, h, i), a.keys(b, hk), a.ks.l, a.D, a.visible(i), a.scale, sc);
  const float sum = softmax_in_place(a, b, h, i, sc);
  float* out = a.out_row(b, h, i);
  if (sum == 0.0f) {  // nothing visible: zeros, not NaN
    std::fill(out, out + a.Dv, 0.0f);
    return;
  }
  std::fill(acc, acc + a.Dv, 0.0f);
  const float* vb = a.values(b, hk);
  for (int j = 0; j < a.Lk; ++j) {
    const float p = sc[j];
    if (p == 0.0f) {
      continue;
    }
    const float* vj = vb + j * a.vs.l;
#pragma omp simd
    for (int d = 0; d < a.Dv; ++d) {
      acc[d] += p * vj[d];
    }
  }
  const float inv = 1.0f / sum;
#pragma omp simd
  for (int d = 0; d < a.Dv; ++d) {
    out[d] = acc[d] * inv;
  }
}

constexpr int TILE_ROWS = 8;  // query rows sharing each pass over a kv head's keys and values

// Keys of every (b, kv head) 16 at a time, head dimension outermost: [B, Hkv, blocks, D, 16].
void transpose_keys(const Args& a, float* kt, int b, int hk) {
  const float* kb = a.keys(b, hk);
  const int padded = a.padded();
  float* dst = kt + (size_t(b) * a.Hkv + hk) * padded * a.D;
  for (int j = 0; j < padded; ++j) {
    float* block = dst + size_t(j / LANES) * a.D * LANES + j % LANES;
    for (int d = 0; d < a.D; ++d) {
      block[d * LANES] = j < a.Lk ? kb[j * a.ks.l + d] : 0.0f;
    }
  }
}

// acc[r] += p[r][j] * v[j][0, width) over the first `visible` values. FULL (width 16) loads
// each chunk as one vector; a partial chunk is copied lane by lane. Apart so that neither path
// takes the accumulators' address: they stay in registers instead of a store per key.
template <int ROWS, bool FULL>
inline void weigh_values(
    const Args& a, const float* v, const float* sc, int visible, int width, f32x16 (&acc)[ROWS]) {
  const int padded = a.padded();
  for (int j = 0; j < visible; ++j) {
    const float* vj = v + j * a.vs.l;
    f32x16 chunk = {};
    if constexpr (FULL) {
      chunk = load_f32(vj);
    } else {
      for (int lane = 0; lane < width; ++lane) {
        chunk[lane] = vj[lane];
      }
    }
    for (int r = 0; r < ROWS; ++r) {
      acc[r] += sc[size_t(r) * padded + j] * chunk;
    }
  }
}

// Up to 8 query rows of one kv head (rows r of its group: head hk * group + r / Lq, position
// r % Lq) in one pass over its keys and one over its values: each key block and value row read
// from cache feeds every row, where a row at a time re-read them all per row.
// ROWS is a compile-time count so that the tile's accumulators stay in registers.
template <int ROWS>
void attend_tile(const Args& a, const float* kt, int b, int hk, int r0, float* sc) {
  const int padded = a.padded(), D = a.D;
  int hs[ROWS], is[ROWS], most = 0;
  float qscaled[ROWS][MAX_HEAD_DIM];
  for (int r = 0; r < ROWS; ++r) {
    hs[r] = hk * a.group() + (r0 + r) / a.Lq;
    is[r] = (r0 + r) % a.Lq;
    most = std::max(most, a.visible(is[r]));
    const float* qi = a.q_row(b, hs[r], is[r]);
    for (int d = 0; d < D; ++d) {
      qscaled[r][d] = qi[d] * a.scale;
    }
  }
  const float* kth = kt + (size_t(b) * a.Hkv + hk) * padded * D;
  for (int blk = 0; blk < (most + LANES - 1) / LANES; ++blk) {
    const float* kblock = kth + size_t(blk) * D * LANES;
    f32x16 s[ROWS] = {};
    for (int d = 0; d < D; ++d) {
      const f32x16 kd = load_f32(kblock + d * LANES);
      for (int r = 0; r < ROWS; ++r) {
        s[r] += qscaled[r][d] * kd;
      }
    }
    for (int r = 0; r < ROWS; ++r) {
      std::memcpy(sc + size_t(r) * padded + blk * LANES, &s[r], sizeof(s[r]));
    }
  }
  float inv[ROWS];
  for (int r = 0; r < ROWS; ++r) {
    const float sum = softmax_in_place(a, b, hs[r], is[r], sc + size_t(r) * padded);
    inv[r] = sum == 0.0f ? 0.0f : 1.0f / sum;  // nothing visible: zeros, not NaN
  }
  const float* vb = a.values(b, hk);
  for (int d0 = 0; d0 < a.Dv; d0 += LANES) {
    const int width = std::min(LANES, a.Dv - d0);
    f32x16 acc[ROWS] = {};
    if (width == LANES) {
      weigh_values<ROWS, true>(a, vb + d0, sc, most, width, acc);
    } else {
      weigh_values<ROWS, false>(a, vb + d0, sc, most, width, acc);
    }
    for (int r = 0; r < ROWS; ++r) {
      const f32x16 out = acc[r] * inv[r];
      std::memcpy(a.out_row(b, hs[r], is[r]) + d0, &out, width * sizeof(float));
    }
  }
}

void attend_rows(const Args& a, const float* kt, int b, int hk, int r0, int rows, float* sc) {
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

}  // namespace

mx::array attention(
    const mx::array& q,
    const mx::array& k,
    const mx::array& v,
    float scale,
    const std::optional<mx::array>& mask,
    bool causal) {
  for (const auto* a : {&q, &k, &v}) {
    if (a->ndim() != 4 || a->dtype() != mx::float32) {
      throw std::invalid_argument("attention: q, k, v must be float32 [B, H, L, D]");
    }
  }
  const int B = q.shape(0), Hq = q.shape(1), Lq = q.shape(2), Hkv = k.shape(1), Lk = k.shape(2);
  if (k.shape(0) != B || v.shape(0) != B || v.shape(1) != Hkv || v.shape(2) != Lk ||
      k.shape(3) != q.shape(3) || Hkv == 0 || Hq % Hkv != 0) {
    throw std::invalid_argument("attention: shapes of q, k and v do not agree");
  }
  auto stream = mx::default_stream(mx::Device::cpu);
  // Rows must be contiguous for the vector loops; a KV cache's views already are.
  auto rows = [&](const mx::array& a) {
    return a.strides()[3] == 1 ? a : mx::contiguous(a, false, stream);
  };
  std::vector<mx::array> inputs = {rows(q), rows(k), rows(v)};
  if (mask) {
    auto m = mask->dtype() == mx::bool_ ? *mask : mx::astype(*mask, mx::float32, stream);
    inputs.push_back(mx::broadcast_to(m, {B, Hq, Lq, Lk}, stream));
  }
  return mx::array(
      {B, Hq, Lq, v.shape(3)},
      mx::float32,
      std::make_shared<Attention>(stream, scale, causal, mask.has_value()),
      inputs);
}

void Attention::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  const auto &q = inputs[0], &k = inputs[1], &v = inputs[2];
  auto& encoder = prepare(inputs, outputs);
  auto& y = outputs[0];
  const bool has_mask = has_mask_;
  const Args args{
      q.data<float>(),
      k.data<float>(),
      v.data<float>(),
      y.data<float>(),
      strides_of(q),
      strides_of(k),
      strides_of(v),
      has_mask ? inputs[3].data<void>() : nullptr,
      has_mask ? inputs[3].strides() : mx::Strides{0, 0, 0, 0},
      has_mask && inputs[3].dtype() == mx::bool_,
      causal_,
      q.shape(0),
      q.shape(1),
      q.shape(2),
      q.shape(3),
      k.shape(1),
      k.shape(2),
      v.shape(3),
      scale_};
  encoder.dispatch([a = args, threads = threads_on(stream())]() {
    const int padded = a.padded(), group_rows = a.group() * a.Lq;
    // Tiles when each key serves several query rows (prefill, verification); decode rows go
    // one at a time, where transposing the keys would cost more than it saves.
    if (group_rows >= TILE_ROWS && a.D <= MAX_HEAD_DIM) {
      std::vector<float> kt(size_t(a.B) * a.Hkv * padded * a.D);
      const int tiles = (group_rows + TILE_ROWS - 1) / TILE_ROWS;
#pragma omp parallel num_threads(threads) if (threads > 1)
      {
        std::vector<float> scores(size_t(TILE_ROWS) * padded);
#pragma omp for collapse(2) schedule(static)
        for (int b = 0; b < a.B; ++b) {
          for (int hk = 0; hk < a.Hkv; ++hk) {
            transpose_keys(a, kt.data(), b, hk);
          }
        }
#pragma omp for schedule(static)
        for (int64_t item = 0; item < int64_t(a.B) * a.Hkv * tiles; ++item) {
          const int b = item / (a.Hkv * tiles), hk = item / tiles % a.Hkv, t = item % tiles;
          const int r0 = t * TILE_ROWS;
          attend_rows(
              a, kt.data(), b, hk, r0, std::min(TILE_ROWS, group_rows - r0), scores.data());
        }
      }
      return;
    }
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
      std::vector<float> scores(padded), acc(a.Dv);
#pragma omp for schedule(static)
      for (int64_t row = 0; row < int64_t(a.B) * a.Hq * a.Lq; ++row) {
        attend_row(
            a, row / (a.Hq * a.Lq), row / a.Lq % a.Hq, row % a.Lq, scores.data(), acc.data());
      }
    }
  });
}


}  // namespace mlxd

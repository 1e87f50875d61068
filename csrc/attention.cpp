// Scaled dot-product attention on the CPU in one pass per query row.
//
// MLX 0.32's CPU backend runs mx.fast.scaled_dot_product_attention as separate ops (two
// matmuls through BLAS, a softmax with element-wise exp, the mask): ≈70 µs a layer for one
// decode token and ≈0.7 ms at 32, most of it dispatch and exp. Decode attention is small
// (one query row against the cached keys), so here each (batch, head) row computes its scores,
// a vectorised softmax and the weighted sum of values directly, rows spread over the threads.
#include "attention.h"
#include "threads.h"

#include <immintrin.h>
#include <omp.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <vector>

#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"

namespace mx = mlx::core;

namespace mlxd {

namespace {

typedef float f32x16 __attribute__((vector_size(64)));
typedef int32_t i32x16 __attribute__((vector_size(64)));
constexpr int LANES = 16;
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

inline float hsum(f32x16 v) {
#if defined(__AVX512F__)
  return _mm512_reduce_add_ps((__m512)v);
#else
  float s = 0.0f;
  for (int lane = 0; lane < LANES; ++lane) {
    s += v[lane];
  }
  return s;
#endif
}

inline f32x16 load(const float* p) {
  f32x16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

constexpr int MAX_CHUNKS = 16;  // head dims up to 256 keep q in registers

// scale * q · k_j for the first `visible` keys.
inline void dot_scores(
    const float* q, const float* k, int64_t k_stride, int D, int visible, float scale, float* out) {
  if (D % LANES == 0 && D / LANES <= MAX_CHUNKS) {
    const int chunks = D / LANES;
    f32x16 qv[MAX_CHUNKS];
    for (int c = 0; c < chunks; ++c) {
      qv[c] = load(q + c * LANES) * scale;
    }
    for (int j = 0; j < visible; ++j) {
      const float* kj = k + j * k_stride;
      f32x16 acc = qv[0] * load(kj);
      for (int c = 1; c < chunks; ++c) {
        acc += qv[c] * load(kj + c * LANES);
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
  auto& y = outputs[0];
  y.set_data(mx::allocator::malloc(y.nbytes()));
  auto& encoder = mx::cpu::get_command_encoder(stream());
  for (const auto& a : inputs) {
    encoder.set_input_array(a);
  }
  encoder.set_output_array(y);

  const bool has_mask = has_mask_;
  const bool bool_mask = has_mask && inputs[3].dtype() == mx::bool_;
  const void* mp = has_mask ? inputs[3].data<void>() : nullptr;
  const auto ms = has_mask ? inputs[3].strides() : mx::Strides{0, 0, 0, 0};
  encoder.dispatch([qp = q.data<float>(),
                    kp = k.data<float>(),
                    vp = v.data<float>(),
                    yp = y.data<float>(),
                    qs = strides_of(q),
                    ks = strides_of(k),
                    vs = strides_of(v),
                    mp,
                    ms,
                    bool_mask,
                    B = q.shape(0),
                    Hq = q.shape(1),
                    Lq = q.shape(2),
                    D = q.shape(3),
                    Hkv = k.shape(1),
                    Lk = k.shape(2),
                    Dv = v.shape(3),
                    scale = scale_,
                    causal = causal_]() {
    const int group = Hq / Hkv;
    const int padded = (Lk + LANES - 1) / LANES * LANES;
    const int threads = kernel_threads().load();
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
      std::vector<float> scores(padded);
      std::vector<float> acc(Dv);
#pragma omp for collapse(2) schedule(static)
      for (int b = 0; b < B; ++b) {
        for (int h = 0; h < Hq; ++h) {
          const int hk = h / group;
          const float* kb = kp + b * ks.b + hk * ks.h;
          const float* vb = vp + b * vs.b + hk * vs.h;
          for (int i = 0; i < Lq; ++i) {
            const float* qi = qp + b * qs.b + h * qs.h + i * qs.l;
            const int visible = causal ? std::min(Lk, Lk - Lq + i + 1) : Lk;
            const int64_t mrow = b * ms[0] + h * ms[1] + i * ms[2];
            float* sc = scores.data();
            dot_scores(qi, kb, ks.l, D, visible, scale, sc);
            std::fill(sc + visible, sc + padded, NEG_INF);
            if (mp != nullptr) {
              for (int j = 0; j < visible; ++j) {
                const int64_t at = mrow + j * ms[3];
                if (bool_mask) {
                  sc[j] = static_cast<const bool*>(mp)[at] ? sc[j] : NEG_INF;
                } else {
                  sc[j] += static_cast<const float*>(mp)[at];
                }
              }
            }
            f32x16 tops = f32x16{} + NEG_INF;
            for (int j = 0; j < padded; j += LANES) {
              const f32x16 s = load(sc + j);
              tops = s > tops ? s : tops;
            }
            float top = NEG_INF;
            for (int lane = 0; lane < LANES; ++lane) {
              top = tops[lane] > top ? tops[lane] : top;
            }
            float* out = yp + ((size_t(b) * Hq + h) * Lq + i) * Dv;
            if (top == NEG_INF) {  // nothing visible: zeros, not NaN
              std::fill(out, out + Dv, 0.0f);
              continue;
            }
            f32x16 total = {};
            for (int j = 0; j < padded; j += LANES) {
              const f32x16 p = exp_nonpositive(load(sc + j) - top);
              std::memcpy(sc + j, &p, sizeof(p));
              total += p;
            }
            const float sum = hsum(total);
            std::fill(acc.begin(), acc.end(), 0.0f);
            for (int j = 0; j < Lk; ++j) {
              const float p = scores[j];
              if (p == 0.0f) {
                continue;
              }
              const float* vj = vb + j * vs.l;
#pragma omp simd
              for (int d = 0; d < Dv; ++d) {
                acc[d] += p * vj[d];
              }
            }
            const float inv = 1.0f / sum;
#pragma omp simd
            for (int d = 0; d < Dv; ++d) {
              out[d] = acc[d] * inv;
            }
          }
        }
      }
    }
  });
}

void Attention::eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  throw std::runtime_error("AttentionCPU runs on the CPU stream only");
}

}  // namespace mlxd

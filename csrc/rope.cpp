// Rotary position embedding on the CPU.
//
// MLX 0.32's CPU backend composes mx.fast.rope from element-wise ops (positions, exp, cos,
// sin, products) evaluated one by one: ≈175 µs for one decode token's 9 query heads, twice a
// layer, more than the layer's matmuls once those run packed. Here it is one pass: each
// position's cos/sin computed once and applied to every head. `rope_qkv` does the same for
// q and k straight from a fused projection's output, with the split and the cache's cast.
#include "rope.h"

#include <cmath>
#include <stdexcept>
#include <vector>

#include "mlx/ops.h"

namespace mx = mlx::core;

namespace mlxd {

mx::array rope(
    const mx::array& x,
    const mx::array& inv_freq,
    const mx::array& offsets,
    int dims,
    bool traditional,
    float scale) {
  if (x.ndim() != 4 || x.dtype() != mx::float32) {
    throw std::invalid_argument("rope: x must be float32 [B, H, L, D]");
  }
  if (dims % 2 != 0 || dims > x.shape(3) || inv_freq.size() != size_t(dims / 2) ||
      offsets.size() != size_t(x.shape(0))) {
    throw std::invalid_argument("rope: dims, inv_freq and offsets do not fit x");
  }
  auto stream = mx::default_stream(mx::Device::cpu);
  return mx::array(
      x.shape(),
      mx::float32,
      std::make_shared<RoPE>(stream, dims, traditional, scale),
      {x,
       mx::astype(inv_freq, mx::float32, stream),
       mx::astype(offsets, mx::int32, stream)});
}

namespace {

// Each pair's cos and sin at `position`, in double: the angle of a late position keeps its
// digits (float32 loses ~1e-4 radian at position 4000); once per position, shared by every head.
void angles(double position, const float* inv_freq, int half, float* cos, float* sin) {
  for (int i = 0; i < half; ++i) {
    const double theta = position * inv_freq[i];
    cos[i] = float(std::cos(theta));
    sin[i] = float(std::sin(theta));
  }
}

// One head's D features from `in` (`step` apart) to `out`, its first `dims` rotated.
template <typename T>
void rotate(
    const float* in,
    int64_t step,
    T* out,
    const float* cos,
    const float* sin,
    int dims,
    int D,
    bool traditional) {
  const int half = dims / 2;
  for (int i = 0; i < half; ++i) {
    // traditional: pairs (2i, 2i + 1); otherwise (i, i + dims / 2)
    const int a = traditional ? 2 * i : i;
    const int c = traditional ? 2 * i + 1 : i + half;
    const float x1 = in[a * step], x2 = in[c * step];
    out[a] = static_cast<T>(x1 * cos[i] - x2 * sin[i]);
    out[c] = static_cast<T>(x1 * sin[i] + x2 * cos[i]);
  }
  for (int d = dims; d < D; ++d) {
    out[d] = static_cast<T>(in[d * step]);
  }
}

// rope_qkv's arithmetic, k and v stored as T.
template <typename T>
void split_rotate(
    const float* x,
    const float* inv_freq,
    const int32_t* offsets,
    float* q,
    T* k,
    T* v,
    int B,
    int L,
    int H,
    int KV,
    int D,
    int dims,
    bool traditional,
    float scale) {
  const int half = dims / 2;
  const size_t width = size_t(H + 2 * KV) * D;
  std::vector<float> cos(half), sin(half);
  for (int b = 0; b < B; ++b) {
    for (int l = 0; l < L; ++l) {
      angles(double(offsets[b] + l) * scale, inv_freq, half, cos.data(), sin.data());
      const float* row = x + (size_t(b) * L + l) * width;
      for (int h = 0; h < H; ++h) {
        float* out = q + ((size_t(b) * H + h) * L + l) * D;
        rotate(row + size_t(h) * D, 1, out, cos.data(), sin.data(), dims, D, traditional);
      }
      for (int j = 0; j < KV; ++j) {
        const size_t at = ((size_t(b) * KV + j) * L + l) * D;
        rotate(row + size_t(H + j) * D, 1, k + at, cos.data(), sin.data(), dims, D, traditional);
        const float* in = row + size_t(H + KV + j) * D;
        for (int d = 0; d < D; ++d) {
          v[at + d] = static_cast<T>(in[d]);
        }
      }
    }
  }
}

}  // namespace

void RoPE::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  const auto& x = inputs[0];
  auto& encoder = prepare(inputs, outputs);
  auto& y = outputs[0];
  const auto& st = x.strides();
  encoder.dispatch([xp = x.data<float>(),
                    fp = rows<float>(inputs[1], encoder),
                    op = rows<int32_t>(inputs[2], encoder),
                    yp = y.data<float>(),
                    B = x.shape(0),
                    H = x.shape(1),
                    L = x.shape(2),
                    D = x.shape(3),
                    s0 = st[0],
                    s1 = st[1],
                    s2 = st[2],
                    s3 = st[3],
                    dims = dims_,
                    traditional = traditional_,
                    scale = scale_]() {
    const int half = dims / 2;
    std::vector<float> cos(half), sin(half);
    for (int b = 0; b < B; ++b) {
      for (int l = 0; l < L; ++l) {
        angles(double(op[b] + l) * scale, fp, half, cos.data(), sin.data());
        for (int h = 0; h < H; ++h) {
          const float* in = xp + b * s0 + h * s1 + l * s2;
          float* out = yp + ((size_t(b) * H + h) * L + l) * D;
          rotate(in, s3, out, cos.data(), sin.data(), dims, D, traditional);
        }
      }
    }
  });
}

std::vector<mx::array> rope_qkv(
    const mx::array& qkv,
    const mx::array& inv_freq,
    const mx::array& offsets,
    int n_heads,
    int n_kv_heads,
    int dims,
    bool traditional,
    float scale,
    mx::Dtype kv_dtype) {
  if (qkv.ndim() != 3 || qkv.dtype() != mx::float32) {
    throw std::invalid_argument("rope_qkv: qkv must be float32 [B, L, (H + 2 KV) * D]");
  }
  if (kv_dtype != mx::float32 && kv_dtype != mx::float16) {
    throw std::invalid_argument("rope_qkv: kv_dtype must be float32 or float16");
  }
  const int heads = n_heads + 2 * n_kv_heads;
  if (n_heads <= 0 || n_kv_heads <= 0 || qkv.shape(2) % heads != 0) {
    throw std::invalid_argument("rope_qkv: qkv's width is not (H + 2 KV) heads");
  }
  const int B = qkv.shape(0), L = qkv.shape(1), D = qkv.shape(2) / heads;
  if (dims % 2 != 0 || dims > D || inv_freq.size() != size_t(dims / 2) ||
      offsets.size() != size_t(B)) {
    throw std::invalid_argument("rope_qkv: dims, inv_freq and offsets do not fit qkv");
  }
  auto stream = mx::default_stream(mx::Device::cpu);
  return mx::array::make_arrays(
      {{B, n_heads, L, D}, {B, n_kv_heads, L, D}, {B, n_kv_heads, L, D}},
      {mx::float32, kv_dtype, kv_dtype},
      std::make_shared<RoPEQKV>(stream, n_heads, n_kv_heads, dims, traditional, scale, kv_dtype),
      {qkv, mx::astype(inv_freq, mx::float32, stream), mx::astype(offsets, mx::int32, stream)});
}

void RoPEQKV::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  auto& encoder = prepare(inputs, outputs);
  auto& q = outputs[0];
  encoder.dispatch([x = rows<float>(inputs[0], encoder),
                    fp = rows<float>(inputs[1], encoder),
                    op = rows<int32_t>(inputs[2], encoder),
                    qp = q.data<float>(),
                    kp = outputs[1].data<void>(),
                    vp = outputs[2].data<void>(),
                    kv_half = outputs[1].dtype() == mx::float16,
                    B = q.shape(0),
                    L = q.shape(2),
                    D = q.shape(3),
                    H = n_heads_,
                    KV = n_kv_heads_,
                    dims = dims_,
                    traditional = traditional_,
                    scale = scale_]() {
    if (kv_half) {
      split_rotate(x, fp, op, qp, static_cast<mx::float16_t*>(kp), static_cast<mx::float16_t*>(vp),
                   B, L, H, KV, D, dims, traditional, scale);
    } else {
      split_rotate(x, fp, op, qp, static_cast<float*>(kp), static_cast<float*>(vp), B, L, H, KV, D,
                   dims, traditional, scale);
    }
  });
}

}  // namespace mlxd

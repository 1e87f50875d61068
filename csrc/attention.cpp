// Scaled dot-product attention on the CPU, as an MLX primitive; the kernel itself is
// attention_kernel.cpp, one per ISA variant.
//
// MLX 0.32's CPU backend runs mx.fast.scaled_dot_product_attention as separate ops (two
// matmuls through BLAS, a softmax with element-wise exp, the mask): ≈70 µs a layer for one
// decode token and ≈0.7 ms at 32, most of it dispatch and exp.
#include "attention.h"

#include <stdexcept>

#include "kernels.h"
#include "mlx/ops.h"
#include "threads.h"

namespace mx = mlx::core;

namespace mlxd {

mx::array attention(
    const mx::array& q,
    const mx::array& k,
    const mx::array& v,
    float scale,
    const std::optional<mx::array>& mask,
    bool causal) {
  for (const auto* a : {&q, &k, &v}) {
    if (a->ndim() != 4) {
      throw std::invalid_argument("attention: q, k, v must be [B, H, L, D]");
    }
  }
  if (q.dtype() != mx::float32 || k.dtype() != v.dtype() ||
      (k.dtype() != mx::float32 && k.dtype() != mx::float16)) {
    throw std::invalid_argument(
        "attention: q must be float32, and k and v both float32 or both float16");
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
  const auto& ms = has_mask ? inputs[3].strides() : mx::Strides{0, 0, 0, 0};
  const AttentionArgs args{
      q.data<float>(),
      k.data<void>(),
      v.data<void>(),
      y.data<float>(),
      {q.strides()[0], q.strides()[1], q.strides()[2]},
      {k.strides()[0], k.strides()[1], k.strides()[2]},
      {v.strides()[0], v.strides()[1], v.strides()[2]},
      has_mask ? inputs[3].data<void>() : nullptr,
      {ms[0], ms[1], ms[2], ms[3]},
      has_mask && inputs[3].dtype() == mx::bool_,
      causal_,
      k.dtype() == mx::float16,
      q.shape(0),
      q.shape(1),
      q.shape(2),
      q.shape(3),
      k.shape(1),
      k.shape(2),
      v.shape(3),
      scale_};
  encoder.dispatch([args, threads = threads_on(stream()), run = kernels().attention]() {
    run(args, threads);
  });
}

}  // namespace mlxd

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
    bool causal,
    bool heads_last) {
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
  std::vector<mx::array> inputs = {q, k, v};
  if (mask) {
    auto m = mask->dtype() == mx::bool_ ? *mask : mx::astype(*mask, mx::float32, stream);
    inputs.push_back(mx::broadcast_to(m, {B, Hq, Lq, Lk}, stream));
  }
  const int Dv = v.shape(3);
  return mx::array(
      heads_last ? mx::Shape{B, Lq, Hq * Dv} : mx::Shape{B, Hq, Lq, Dv},
      mx::float32,
      std::make_shared<Attention>(stream, scale, causal, mask.has_value(), heads_last),
      inputs);
}

namespace {

// An input's data and its batch, head and row strides, its last axis contiguous.
struct Rows {
  const void* data;
  int64_t strides[3];
};

}  // namespace

void Attention::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  auto& encoder = prepare(inputs, outputs);
  auto& y = outputs[0];
  // The kernel walks the last axis element by element. Strides are known only now (a lazy
  // array reports row order), so an input whose last axis is strided is copied into row order.
  auto rows_of = [&](const mx::array& a, auto element) -> Rows {
    using T = decltype(element);
    const auto& st = a.strides();
    if (st[3] == 1) {
      return {a.data<T>(), {st[0], st[1], st[2]}};
    }
    const int64_t row = a.shape(3), head = row * a.shape(2), batch = head * a.shape(1);
    return {rows<T>(a, encoder), {batch, head, row}};
  };
  const bool kv_half = inputs[1].dtype() == mx::float16;
  const Rows q = rows_of(inputs[0], float{});
  const Rows k = kv_half ? rows_of(inputs[1], uint16_t{}) : rows_of(inputs[1], float{});
  const Rows v = kv_half ? rows_of(inputs[2], uint16_t{}) : rows_of(inputs[2], float{});
  const bool has_mask = has_mask_;
  const auto& ms = has_mask ? inputs[3].strides() : mx::Strides{0, 0, 0, 0};
  const auto& shape = inputs[0].shape();
  const AttentionArgs args{
      static_cast<const float*>(q.data),
      k.data,
      v.data,
      y.data<float>(),
      {q.strides[0], q.strides[1], q.strides[2]},
      {k.strides[0], k.strides[1], k.strides[2]},
      {v.strides[0], v.strides[1], v.strides[2]},
      has_mask ? inputs[3].data<void>() : nullptr,
      {ms[0], ms[1], ms[2], ms[3]},
      has_mask && inputs[3].dtype() == mx::bool_,
      causal_,
      kv_half,
      heads_last_,
      shape[0],
      shape[1],
      shape[2],
      shape[3],
      inputs[1].shape(1),
      inputs[1].shape(2),
      inputs[2].shape(3),
      scale_};
  const int64_t rows = int64_t(args.B) * args.Lq;
  encoder.dispatch([args, threads = threads_on(stream(), rows), run = kernels().attention]() {
    run(args, threads);
  });
}

}  // namespace mlxd

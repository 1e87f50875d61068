// A SwiGLU MLP on packed weights as one MLX op: the norm before it, the gate and up projections
// (one packed matrix, their rows one after the other), the SwiGLU, the down projection and the
// residual sum, in one dispatched task.
//
// At one decode row a small model's MLP is a few µs of arithmetic a layer, and each MLX op
// around it costs its dispatch, its output's allocation and (with two threads) a wake of the
// kernels' threads: as five ops SmolLM2's 30 MLPs were 150 graph nodes of a decode step, built in
// Python and dispatched one by one. The arithmetic is the separate ops', in their order, so the
// result is the same to the bit.
#include "mlp.h"

#include <stdexcept>

#include "kernels.h"
#include "mlx/ops.h"
#include "threads.h"

namespace mx = mlx::core;

namespace mlxd {

mx::array packed_mlp(
    const mx::array& x,
    const mx::array& gate_up,
    const mx::array& gate_up_scale_bias,
    int gate_up_bits,
    const mx::array& down,
    const mx::array& down_scale_bias,
    int down_bits,
    bool dot,
    bool precise,
    const std::optional<mx::array>& norm_weight,
    float eps,
    bool residual) {
  const char* disagree = "packed_mlp: shapes of x, gate_up, down and their scales do not agree";
  for (int bits : {gate_up_bits, down_bits}) {
    if (bits != 4 && bits != 8) {
      throw std::invalid_argument("packed_mlp: bits must be 4 or 8");
    }
  }
  if (x.ndim() < 1 || x.dtype() != mx::float32 || gate_up.ndim() != 2 || down.ndim() != 2 ||
      gate_up.dtype() != mx::uint8 || down.dtype() != mx::uint8) {
    throw std::invalid_argument("packed_mlp: float32 x [..., K] and uint8 packed weights");
  }
  const int K = x.shape(-1);
  const int inner = gate_up.shape(0) / 2;
  PackedPrimitive::check_weights(
      disagree, gate_up_bits, 1, gate_up.shape(0), K, gate_up.shape(1), gate_up_scale_bias);
  PackedPrimitive::check_weights(
      disagree, down_bits, 1, down.shape(0), inner, down.shape(1), down_scale_bias);
  if (down.shape(0) != K) {
    throw std::invalid_argument(disagree);
  }
  auto stream = mx::default_stream(mx::Device::cpu);
  std::vector<mx::array> inputs{x, gate_up, gate_up_scale_bias, down, down_scale_bias};
  if (norm_weight) {
    if (norm_weight->ndim() != 1 || norm_weight->shape(0) != K) {
      throw std::invalid_argument("packed_mlp: a norm weight [K]");
    }
    inputs.push_back(mx::astype(*norm_weight, mx::float32, stream));
  }
  return mx::array(
      x.shape(),
      mx::float32,
      std::make_shared<PackedMLP>(
          stream, gate_up_bits, down_bits, dot, precise, norm_weight.has_value(), eps, residual),
      std::move(inputs));
}

void PackedMLP::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  const auto& x = inputs[0];
  auto& encoder = prepare(inputs, outputs);
  const int K = x.shape(-1);
  const int M = static_cast<int>(x.size() / K);
  const Operand gate_up = operand(inputs[1], inputs[2], bits_, encoder);
  const Operand down = operand(inputs[3], inputs[4], down_bits_, encoder);
  // The normed x, then the gate and up projections' outputs, the SwiGLU written over them.
  auto scratch = [&](int width) {
    mx::array a({M, width}, mx::float32, nullptr, {});
    a.set_data(mx::allocator::malloc(a.nbytes()));
    encoder.add_temporary(a);
    return a.data<float>();
  };
  encoder.dispatch([xp = rows<float>(x, encoder),
                    weight = norm_ ? rows<float>(inputs[5], encoder) : nullptr,
                    normed = norm_ ? scratch(K) : nullptr,
                    hidden = scratch(gate_up.N),
                    yp = outputs[0].data<float>(),
                    gate_up,
                    down,
                    M,
                    K,
                    eps = eps_,
                    residual = residual_,
                    dot = dot_,
                    precise = precise_,
                    threads = threads_on(stream(), M)]() {
    const Kernels& run = kernels();
    const float* in = xp;
    if (weight != nullptr) {
      run.rms_norm(xp, weight, normed, M, K, eps);
      in = normed;
    }
    multiply(in, gate_up, hidden, M, dot, precise, threads);
    // Row r's gate and up halves sit at [2 I r, 2 I (r + 1)); its SwiGLU goes to [I r, I (r + 1)),
    // at or below them: row 0 in place element by element, later rows over rows already read.
    const int inner = gate_up.N / 2;
    for (int r = 0; r < M; ++r) {
      const float* row = hidden + size_t(r) * gate_up.N;
      run.swiglu(row, row + inner, hidden + size_t(r) * inner, inner);
    }
    multiply(hidden, down, yp, M, dot, precise, threads);
    if (residual) {
      for (size_t i = 0; i < size_t(M) * K; ++i) {
        yp[i] += xp[i];
      }
    }
  });
}

}  // namespace mlxd

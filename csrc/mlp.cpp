// A SwiGLU MLP on packed weights as one MLX op: the gate and up projections (one packed matrix,
// their rows one after the other), the SwiGLU and the down projection in one dispatched task.
//
// At one decode row a small model's MLP is a few µs of arithmetic a layer, and each MLX op costs
// its dispatch, its output's allocation and (with two threads) a wake of the kernels' threads:
// as four ops SmolLM2's 30 MLPs were 120 graph nodes of a decode step, built in Python and
// dispatched one by one. The arithmetic is the separate ops', in their order, so the result is
// the same to the bit.
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
    bool precise) {
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
  return mx::array(
      x.shape(),
      mx::float32,
      std::make_shared<PackedMLP>(stream, gate_up_bits, down_bits, dot, precise),
      {x, gate_up, gate_up_scale_bias, down, down_scale_bias});
}

void PackedMLP::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  const auto& x = inputs[0];
  auto& encoder = prepare(inputs, outputs);
  const int K = x.shape(-1);
  const int M = static_cast<int>(x.size() / K);
  const Operand gate_up = operand(inputs[1], inputs[2], bits_, encoder);
  const Operand down = operand(inputs[3], inputs[4], down_bits_, encoder);
  // The gate and up projections' outputs, the SwiGLU written over them.
  mx::array scratch({M, gate_up.N}, mx::float32, nullptr, {});
  scratch.set_data(mx::allocator::malloc(scratch.nbytes()));
  encoder.add_temporary(scratch);
  encoder.dispatch([xp = rows<float>(x, encoder),
                    hidden = scratch.data<float>(),
                    yp = outputs[0].data<float>(),
                    gate_up,
                    down,
                    M,
                    dot = dot_,
                    precise = precise_,
                    threads = threads_on(stream(), M)]() {
    multiply(xp, gate_up, hidden, M, dot, precise, threads);
    // Row r's gate and up halves sit at [2 I r, 2 I (r + 1)); its SwiGLU goes to [I r, I (r + 1)),
    // at or below them: row 0 in place element by element, later rows over rows already read.
    const int inner = gate_up.N / 2;
    const auto swiglu = kernels().swiglu;
    for (int r = 0; r < M; ++r) {
      const float* row = hidden + size_t(r) * gate_up.N;
      swiglu(row, row + inner, hidden + size_t(r) * inner, inner);
    }
    multiply(hidden, down, yp, M, dot, precise, threads);
  });
}

}  // namespace mlxd

// Sampling at a temperature and top_p in a few passes over each row of logits.
//
// As MLX graph code (mlxd/executor/nucleus.py) a draw at temperature 0.7 and top_p 0.9 was
// ≈15 element-wise passes, a partial selection and a sort of candidates, and when a row's
// nucleus reached past the candidates a full sort afterwards: 15-25% of a decode step on the
// CPU. The kernel (sampling_kernel.cpp, per ISA variant) finds the nucleus from a histogram of
// the row's mass and draws by one uniform per row, exactly, in one graph node.
#include "sampling.h"

#include <stdexcept>

#include "kernels.h"
#include "mlx/ops.h"
#include "threads.h"

namespace mx = mlx::core;

namespace mlxd {

mx::array sample(
    const mx::array& logits,
    const mx::array& inv_temperature,
    const mx::array& top_p,
    const mx::array& u) {
  if (logits.ndim() != 2 || logits.shape(1) == 0 || !mx::issubdtype(logits.dtype(), mx::floating)) {
    throw std::invalid_argument("sample: float logits [n, V] with V > 0");
  }
  const int n = logits.shape(0);
  for (const auto* a : {&inv_temperature, &top_p, &u}) {
    if (a->ndim() != 1 || a->shape(0) != n) {
      throw std::invalid_argument("sample: inv_temperature, top_p and u must be [n]");
    }
  }
  auto stream = mx::default_stream(mx::Device::cpu);
  std::vector<mx::array> inputs;
  for (const auto* a : {&logits, &inv_temperature, &top_p, &u}) {
    inputs.push_back(mx::astype(*a, mx::float32, stream));
  }
  return mx::array({n}, mx::uint32, std::make_shared<Sample>(stream), inputs);
}

void Sample::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  auto& encoder = prepare(inputs, outputs);
  encoder.dispatch([logits = rows<float>(inputs[0], encoder),
                    inv_temperature = rows<float>(inputs[1], encoder),
                    top_p = rows<float>(inputs[2], encoder),
                    u = rows<float>(inputs[3], encoder),
                    tokens = outputs[0].data<uint32_t>(),
                    n = inputs[0].shape(0),
                    V = inputs[0].shape(1),
                    threads = threads_on(stream()),
                    run = kernels().sample]() {
    run(logits, inv_temperature, top_p, u, tokens, n, V, threads);
  });
}

}  // namespace mlxd

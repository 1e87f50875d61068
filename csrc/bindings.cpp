// Python module mlxd.kernels._cpu (nanobind; arrays cross as mlx.core.array).
#include <nanobind/nanobind.h>

#include "qmatmul.h"

namespace nb = nanobind;
using namespace nb::literals;

NB_MODULE(_cpu, m) {
  m.doc() = "mlxd's CPU kernels for MLX";
  m.def(
      "qmatmul",
      &mlxd::qmatmul,
      "x"_a,
      "w"_a,
      "scales"_a,
      "biases"_a,
      "bits"_a,
      "x @ dequantize(w).T for weights packed by mlxd.kernels.pack (float32 result).");
}

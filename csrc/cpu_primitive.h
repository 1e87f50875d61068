// What every mlxd kernel primitive shares: it runs on the CPU stream only, and its outputs are
// allocated and every array registered with the stream's encoder before the kernel dispatches.
#pragma once

#include <stdexcept>
#include <string>

#include "mlx/backend/cpu/encoder.h"
#include "mlx/primitives.h"

namespace mlxd {

class CpuPrimitive : public mlx::core::Primitive {
 public:
  using Primitive::Primitive;

  void eval_gpu(
      const std::vector<mlx::core::array>& inputs,
      std::vector<mlx::core::array>& outputs) override {
    throw std::runtime_error(std::string(name()) + " runs on the CPU stream only");
  }

 protected:
  // Allocates the outputs, registers the arrays, and returns the encoder to dispatch on.
  mlx::core::cpu::CommandEncoder& prepare(
      const std::vector<mlx::core::array>& inputs,
      std::vector<mlx::core::array>& outputs) {
    auto& encoder = mlx::core::cpu::get_command_encoder(stream());
    for (const auto& a : inputs) {
      encoder.set_input_array(a);
    }
    for (auto& y : outputs) {
      y.set_data(mlx::core::allocator::malloc(y.nbytes()));
      encoder.set_output_array(y);
    }
    return encoder;
  }
};

}  // namespace mlxd

// What every mlxd kernel primitive shares: it runs on the CPU stream only, and its outputs are
// allocated and every array registered with the stream's encoder before the kernel dispatches.
//
// Inputs reach a primitive as they are, not through mx::contiguous: a Contiguous op per input
// was a graph node and a dispatch each, 875 of the 1,900 nodes of a SmolLM2 decode step, almost
// all on arrays already in row order. `rows` checks at evaluation instead (an input's layout is
// known by then) and copies only what is not.
#pragma once

#include <stdexcept>
#include <string>
#include <vector>

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

  // `a`'s elements in row-major order: its own data when it is row-contiguous, else a copy made
  // on the stream ahead of the kernel (dispatched after `prepare`, so before the kernel).
  template <typename T>
  static const T* rows(const mlx::core::array& a, mlx::core::cpu::CommandEncoder& encoder) {
    if (a.flags().row_contiguous) {
      return a.data<T>();
    }
    mlx::core::array copy(a.shape(), a.dtype(), nullptr, {});
    copy.set_data(mlx::core::allocator::malloc(copy.nbytes()));
    encoder.add_temporary(copy);
    encoder.dispatch([src = a.data<T>(),
                      dst = copy.data<T>(),
                      shape = std::vector<int>(a.shape().begin(), a.shape().end()),
                      strides = std::vector<int64_t>(a.strides().begin(), a.strides().end())]() {
      strided_copy(src, dst, shape, strides);
    });
    return copy.data<T>();
  }

 private:
  template <typename T>
  static void strided_copy(
      const T* src,
      T* dst,
      const std::vector<int>& shape,
      const std::vector<int64_t>& strides) {
    const int ndim = static_cast<int>(shape.size());
    if (ndim == 0) {
      *dst = *src;
      return;
    }
    std::vector<int> index(ndim, 0);
    const int inner = shape[ndim - 1];
    const int64_t step = strides[ndim - 1];
    while (true) {
      int64_t at = 0;
      for (int d = 0; d < ndim - 1; ++d) {
        at += index[d] * strides[d];
      }
      for (int i = 0; i < inner; ++i) {
        *dst++ = src[at + i * step];
      }
      int d = ndim - 2;
      for (; d >= 0; --d) {
        if (++index[d] < shape[d]) {
          break;
        }
        index[d] = 0;
      }
      if (d < 0) {
        return;
      }
    }
  }
};

}  // namespace mlxd

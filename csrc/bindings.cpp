// Python module mlxd.kernels._cpu (nanobind; arrays cross as mlx.core.array).
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <string>

#include "assemble.h"
#include "attention.h"
#include "convert.h"
#include "gather_qmatmul.h"
#include "kernels.h"
#include "mapped.h"
#include "qmatmul.h"
#include "rms_norm.h"
#include "rope.h"
#include "sampling.h"
#include "swiglu.h"
#include "threads.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace {

// Buffers, for the GGUF conversions (convert.h): they run on Python's threads, without the GIL,
// over a memory-mapped file's blocks into numpy views of MLX arrays (`empty`).
template <typename T>
using Buffer = nb::ndarray<T, nb::c_contig, nb::device::cpu>;

void require(bool condition, const char* message) {
  if (!condition) {
    throw std::invalid_argument(message);
  }
}

std::pair<double, double> q6_k_to_affine8(
    Buffer<const uint8_t> src, Buffer<uint8_t> codes, Buffer<float> scales, Buffer<float> biases) {
  require(src.size() % 210 == 0, "q6_k_to_affine8: src must be whole Q6_K blocks of 210 bytes");
  const int64_t blocks = static_cast<int64_t>(src.size() / 210);
  require(
      codes.size() == static_cast<size_t>(blocks) * 256 &&
          scales.size() == static_cast<size_t>(blocks) * 8 &&
          biases.size() == static_cast<size_t>(blocks) * 8,
      "q6_k_to_affine8: codes must hold 256 values a block, scales and biases 8");
  nb::gil_scoped_release release;
  return mlxd::q6_k_to_affine8(src.data(), blocks, codes.data(), scales.data(), biases.data());
}

// GGUF blocks of a type MLX's affine groups of 32 hold exactly → those groups.
void to_affine(
    const std::string& qtype,
    Buffer<const uint8_t> src,
    Buffer<uint8_t> words,
    Buffer<float> scales,
    Buffer<float> biases) {
  struct Format {
    const char* name;
    size_t block_bytes, values, bits;
    mlxd::Conversion convert;
  };
  static const Format kFormats[] = {
      {"Q4_0", 18, 32, 4, mlxd::q4_0_to_affine4},
      {"Q4_1", 20, 32, 4, mlxd::q4_1_to_affine4},
      {"Q5_0", 22, 32, 5, mlxd::q5_0_to_affine5},
      {"Q5_1", 24, 32, 5, mlxd::q5_1_to_affine5},
      {"Q8_0", 34, 32, 8, mlxd::q8_0_to_affine8},
      {"Q4_K", 144, 256, 4, mlxd::q4_k_to_affine4},
      {"Q5_K", 176, 256, 5, mlxd::q5_k_to_affine5},
  };
  const Format* format = nullptr;
  for (const Format& candidate : kFormats) {
    if (qtype == candidate.name) {
      format = &candidate;
    }
  }
  require(format != nullptr, "to_affine: qtype must be Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K or Q5_K");
  const size_t blocks = src.size() / format->block_bytes;
  require(
      src.size() % format->block_bytes == 0 &&
          words.size() == blocks * format->values * format->bits / 8 &&
          scales.size() == blocks * format->values / 32 && biases.size() == scales.size(),
      "to_affine: whole blocks, with room for their words, scales and biases");
  nb::gil_scoped_release release;
  format->convert(
      src.data(), static_cast<int64_t>(blocks), words.data(), scales.data(), biases.data());
}

}  // namespace

NB_MODULE(_cpu, m) {
  m.doc() = "mlxd's CPU kernels for MLX";
  m.def(
      "isa", []() { return std::string(mlxd::kernels().isa); }, "The ISA variant the kernels run.");
  m.def(
      "use_isa",
      &mlxd::use_isa,
      "isa"_a,
      "Runs every later kernel on this ISA variant (ValueError: not built, or the CPU lacks it).");
  m.def(
      "runnable_isas",
      &mlxd::runnable_isas,
      "The ISA variants built into this module that this CPU runs, best first.");
  m.def("built_isas", &mlxd::built_isas, "Every ISA variant built into this module, best first.");
  m.def(
      "set_threads",
      [](int threads) { mlxd::kernel_threads().store(threads < 1 ? 1 : threads); },
      "threads"_a,
      "How many threads the kernels use (1: no OpenMP threads are started).");
  m.def(
      "parallelize_default_stream",
      []() {
        mlxd::parallel_stream().store(
            mlx::core::default_stream(mlx::core::Device::cpu).index);
      },
      "Only kernels on the calling thread's default CPU stream use several threads from now on.");
  m.def(
      "set_spare_core_rows",
      [](int64_t rows) { mlxd::spare_core_rows().store(rows < 0 ? 0 : rows); },
      "rows"_a,
      "Kernels over at most this many rows of x leave one core to the rest (0: none).");
  m.def(
      "set_dot_buffer_rows",
      [](int64_t rows) { mlxd::dot_buffer_rows().store(rows < 0 ? 0 : rows); },
      "rows"_a,
      "qmatmul on the dot layout over at least this many rows of x dequantizes the "
      "weights into the float path's buffered passes (0: never).");
  m.def(
      "dot_buffer_rows",
      []() { return mlxd::dot_buffer_rows().load(); },
      "What set_dot_buffer_rows last set.");
  m.def(
      "threads_for_rows",
      [](int64_t rows) {
        return mlxd::threads_on(mlx::core::default_stream(mlx::core::Device::cpu), rows);
      },
      "rows"_a,
      "How many threads a kernel over `rows` rows on the calling thread's default CPU stream uses.");
  m.def(
      "threads_here",
      []() { return mlxd::threads_on(mlx::core::default_stream(mlx::core::Device::cpu)); },
      "How many threads kernels on the calling thread's default CPU stream use.");
  m.def(
      "qmatmul",
      &mlxd::qmatmul,
      "x"_a,
      "w"_a,
      "scale_bias"_a,
      "bits"_a,
      "dot"_a = false,
      "precise"_a = false,
      "x @ dequantize(w).T for weights packed by mlxd.kernels.pack, or by pack_dot with dot "
      "(integer dot products, x as one int8 term or, precise, two; float32 result).");
  m.def(
      "gather_qmatmul",
      &mlxd::gather_qmatmul,
      "x"_a,
      "indices"_a,
      "w"_a,
      "scale_bias"_a,
      "bits"_a,
      "dot"_a = false,
      "precise"_a = false,
      "y[t, j] = x[t] @ dequantize(w[indices[t, j]]).T for x [T, K], indices [T, J] and E "
      "matrices each packed by mlxd.kernels.pack (or pack_dot, with dot), stacked (float32 "
      "[T, J, N]).");
  m.def(
      "integer_dot",
      []() { return mlxd::kernels().integer_dot; },
      "Whether the ISA variant in use multiplies pack_dot's layout by integer dot products.");
  m.def(
      "rms_norm",
      &mlxd::rms_norm,
      "x"_a,
      "weight"_a,
      "eps"_a,
      "mx.fast.rms_norm for float32 x [..., D] and a weight [D].");
  m.def(
      "swiglu",
      &mlxd::swiglu,
      "gate"_a,
      "x"_a,
      "silu(gate) * x for float32 gate and x of one shape, with the rational SiLU.");
  m.def(
      "swiglu_halves",
      &mlxd::swiglu_halves,
      "both"_a,
      "swiglu of each row's halves of float32 both [..., 2F] (gate, then x): [..., F].");
  m.def(
      "rope",
      &mlxd::rope,
      "x"_a,
      "inv_freq"_a,
      "offsets"_a,
      "dims"_a,
      "traditional"_a,
      "scale"_a,
      "Rotary position embedding of float32 x [B, H, L, D] (mx.fast.rope's arithmetic).");
  m.def(
      "rope_qkv",
      &mlxd::rope_qkv,
      "qkv"_a,
      "inv_freq"_a,
      "offsets"_a,
      "n_heads"_a,
      "n_kv_heads"_a,
      "dims"_a,
      "traditional"_a,
      "scale"_a,
      "kv_dtype"_a,
      "A fused projection's float32 qkv [B, L, (H + 2 KV) * D] as q [B, H, L, D] and k rotated, "
      "v; k and v in kv_dtype (float32 or float16).");
  m.def(
      "attention",
      &mlxd::attention,
      "q"_a,
      "k"_a,
      "v"_a,
      "scale"_a,
      "mask"_a.none(),
      "causal"_a,
      "heads_last"_a = false,
      "Scaled dot-product attention of float32 q and float32 or float16 k, v [B, H, L, D] "
      "(grouped-query heads; float32 result [B, H, L, D], or [B, L, H * D] heads_last).");
  m.def(
      "sample",
      &mlxd::sample,
      "logits"_a,
      "inv_temperature"_a,
      "top_p"_a,
      "u"_a,
      "A token per row of logits [n, V] (uint32 [n]): among row i's top_p[i] nucleus of the "
      "untempered distribution (mlx-lm's rule; all at 1), weighted e^((x - max) * "
      "inv_temperature[i]), the first in index order whose cumulative weight passes u[i] of "
      "their total.");
  m.def(
      "widen_weights",
      &mlxd::widen_weights,
      "weight"_a,
      "bits"_a,
      "width"_a,
      "threads"_a,
      "MLX's packed 2/3-bit (5/6-bit) weights uint32 [rows, words] as the same values packed at "
      "4 (8) bits, the width the kernels run.");
  m.def(
      "tile_weights",
      &mlxd::tile_weights,
      "weight"_a,
      "bits"_a,
      "dot"_a,
      "threads"_a,
      "MLX's quantized weights uint32 [rows, words] in the kernels' layout, uint8 [rows, words * "
      "4]: qmatmul's, or qdot's with dot.");
  m.def(
      "tile_scale_pairs",
      &mlxd::tile_scales,
      "scales"_a,
      "biases"_a,
      "repeats"_a,
      "rounded"_a,
      "threads"_a,
      "float32 scales and biases [rows, groups] laid out as [rows / 16, groups * repeats, 2, "
      "16], in float16 where every value is one (rounded: rounds to a finite one), else "
      "float32: the float16 layout, the float32 one (only the one written is computed) and "
      "which (a bool scalar: float16).");
  m.def(
      "q6_k_to_affine8",
      &q6_k_to_affine8,
      "src"_a,
      "codes"_a.noconvert(),
      "scales"_a.noconvert(),
      "biases"_a.noconvert(),
      "GGUF Q6_K blocks requantized into MLX 8-bit affine groups of 32 (codes, float32 scales and "
      "biases written in place); (sum of squared errors, sum of squared values).");
  m.def(
      "to_affine",
      &to_affine,
      "qtype"_a,
      "src"_a,
      "words"_a.noconvert(),
      "scales"_a.noconvert(),
      "biases"_a.noconvert(),
      "GGUF Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K or Q5_K blocks as MLX affine groups of 32 (4, 5 or "
      "8 bits), exactly "
      "(words as bytes, float32 scales and biases written in place).");
  m.def(
      "empty",
      [](const std::vector<int>& shape, mlx::core::Dtype dtype) {
        size_t nbytes = dtype.size();
        for (int dim : shape) {
          require(dim >= 0, "empty: dimensions must not be negative");
          nbytes *= static_cast<size_t>(dim);
        }
        return mlx::core::array(
            mlx::core::allocator::malloc(nbytes),
            mlx::core::Shape(shape.begin(), shape.end()),
            dtype);
      },
      "shape"_a,
      "dtype"_a,
      "A new array whose memory is not written (MLX fills every array it makes): for a "
      "conversion to write, on the threads that convert.");
  m.def(
      "map_file_arrays",
      [](int fd,
         const std::string& name,
         const std::vector<std::tuple<int64_t, std::vector<int>, mlx::core::Dtype>>& specs) {
        std::vector<mlxd::FileArray> arrays;
        arrays.reserve(specs.size());
        for (const auto& [offset, shape, dtype] : specs) {
          arrays.push_back({offset, shape, dtype});
        }
        nb::gil_scoped_release release;
        return mlxd::map_arrays(fd, name, arrays);
      },
      "fd"_a,
      "name"_a,
      "arrays"_a,
      "The arrays (offset, shape, dtype) of the file open at `fd` (`name` in errors; closing "
      "it later is the caller's), each preceded by its byte count "
      "as a little-endian uint64; and whether they are the file's pages, mapped copy-on-write "
      "(else copies: an MLX whose allocator is not the CPU one).");
  m.def(
      "assemble_kv",
      &mlxd::assemble_kv,
      "blocks"_a,
      "capacity"_a,
      "Per-layer [1, H, capacity, D] buffers from blocks [L, H, T, D] in position order.");
}

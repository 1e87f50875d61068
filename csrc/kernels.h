// The kernels each ISA variant provides, as a table of plain functions (no MLX types: the
// variants' sources include no MLX header, see simd.h), and the dispatch that picks a variant.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace mlxd {

// Attention over float32 q [B, Hq, Lq, D] and k [B, Hkv, Lk, D], v [B, Hkv, Lk, Dv], both
// float32 or both float16 (kv_half: a 16-bit KV cache), given by their strides (batch, head,
// row; the last dimension is contiguous) into a contiguous float32 y.
struct AttentionArgs {
  const float* q;
  const void *k, *v;  // float, or uint16_t bits of IEEE halves when kv_half
  float* y;
  int64_t qs[3], ks[3], vs[3];
  const void* mask;  // nullptr, or bool / float32 [B, Hq, Lq, Lk] with strides ms
  int64_t ms[4];
  bool bool_mask, causal, kv_half;
  bool heads_last;  // y [B, Lq, Hq, Dv], else [B, Hq, Lq, Dv]
  int B, Hq, Lq, D, Hkv, Lk, Dv;
  float scale;
};

struct Kernels {
  const char* isa;
  // y[M, N] = x[M, K] @ dequantize(w)^T (see qmatmul.cpp), scales and biases float32 or
  // float16 bits, one pair per `group` inputs (32 times a power of two).
  void (*qmatmul_f32)(const float* x, const uint8_t* w, const float* scale_bias, float* y, int M,
                      int N, int K, int bits, int group, int threads);
  void (*qmatmul_f16)(const float* x, const uint8_t* w, const uint16_t* scale_bias, float* y,
                      int M, int N, int K, int bits, int group, int threads);
  // The same product by integer dot products on pack_dot's layout (see qdot.cpp), x as int8
  // or (precise) as int8 plus its rounding's rest in int8; from `buffer_rows` rows of x on
  // (0: never) by qmatmul's buffered passes instead, the weights dequantized from that layout.
  void (*qdot_f32)(const float* x, const uint8_t* w, const float* scale_bias, float* y, int M,
                   int N, int K, int bits, int group, bool precise, int buffer_rows, int threads);
  void (*qdot_f16)(const float* x, const uint8_t* w, const uint16_t* scale_bias, float* y, int M,
                   int N, int K, int bits, int group, bool precise, int buffer_rows, int threads);
  // Whether qdot runs on an integer dot-product instruction (VNNI, maddubs, sdot), not the
  // generic variant's scalar loop.
  bool integer_dot;
  void (*attention)(const AttentionArgs& args, int threads);
  void (*rms_norm)(const float* x, const float* weight, float* y, size_t rows, int D, float eps);
  void (*swiglu)(const float* gate, const float* x, float* y, size_t n);
  // y[t, j, N] = x[t, K] @ dequantize(w[idx[t, j]])^T for E matrices packed as qmatmul's, one
  // after another (gather_qmatmul.cpp): a mixture of experts' matmul.
  void (*gather_qmatmul_f32)(const float* x, const int32_t* idx, const uint8_t* w,
                             const float* scale_bias, float* y, int T, int J, int E, int N, int K,
                             int bits, int group, int threads);
  void (*gather_qmatmul_f16)(const float* x, const int32_t* idx, const uint8_t* w,
                             const uint16_t* scale_bias, float* y, int T, int J, int E, int N,
                             int K, int bits, int group, int threads);
  // The same on pack_dot's layout by integer dot products (gather_qdot.cpp); an expert with
  // `buffer_rows` rows or more (0: none) by qmatmul's buffered passes, as qdot's.
  void (*gather_qdot_f32)(const float* x, const int32_t* idx, const uint8_t* w,
                          const float* scale_bias, float* y, int T, int J, int E, int N, int K,
                          int bits, int group, bool precise, int buffer_rows, int threads);
  void (*gather_qdot_f16)(const float* x, const int32_t* idx, const uint8_t* w,
                          const uint16_t* scale_bias, float* y, int T, int J, int E, int N, int K,
                          int bits, int group, bool precise, int buffer_rows, int threads);
  // tokens[r] drawn from row r of logits [rows, V] (sampling_kernel.cpp): among the tokens of
  // the untempered distribution's top_p[r] nucleus (mlx-lm's rule; all at 1), with weights
  // e^((x - max) · inv_temperature[r]), the first in index order whose cumulative weight
  // passes u[r] (in [0, 1)) of their total.
  void (*sample)(const float* logits, const float* inv_temperature, const float* top_p,
                 const float* u, uint32_t* tokens, int rows, int V, int threads);
};

// The variant in use: MLXD_KERNELS_ISA's if set (see dispatch.cpp), else the best this CPU runs.
const Kernels& kernels();

// Switches every later kernel to `isa`; std::invalid_argument if it is not built or this CPU
// lacks it.
void use_isa(const std::string& isa);

// The variants this module holds and this CPU runs, best first.
std::vector<std::string> runnable_isas();

// Every variant built into this module, best first.
std::vector<std::string> built_isas();

}  // namespace mlxd

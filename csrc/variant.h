// The kernels of the ISA variant being compiled (namespace mlxd::MLXD_ISA; see simd.h),
// gathered into its Kernels table by variant.cpp.
#pragma once

#include "kernels.h"

#ifndef MLXD_ISA
#error "kernel sources are compiled once per ISA variant with -DMLXD_ISA=<name>"
#endif

namespace mlxd {
namespace MLXD_ISA {

void qmatmul_f32(const float* x, const uint8_t* w, const float* scale_bias, float* y, int M, int N,
                 int K, int bits, int group, int threads);
void qmatmul_f16(const float* x, const uint8_t* w, const uint16_t* scale_bias, float* y, int M,
                 int N, int K, int bits, int group, int threads);
void qdot_f32(const float* x, const uint8_t* w, const float* scale_bias, float* y, int M, int N,
              int K, int bits, int group, bool precise, int buffer_rows, int threads);
void qdot_f16(const float* x, const uint8_t* w, const uint16_t* scale_bias, float* y, int M, int N,
              int K, int bits, int group, bool precise, int buffer_rows, int threads);
// qmatmul's buffered passes on pack_dot's layout, x not rounded (qdot's from `buffer_rows`;
// overloads by the scales' type, as qdot's callers are templates over it: not in the table).
void buffered_dot(const float* x, const uint8_t* w, const float* scale_bias, float* y, int M,
                  int N, int K, int bits, int group, int threads);
void buffered_dot(const float* x, const uint8_t* w, const uint16_t* scale_bias, float* y, int M,
                  int N, int K, int bits, int group, int threads);
// The same for work item g (16 output rows) alone, on the calling thread, with its chunk
// buffer `buf` of buffered_floats() floats (gather_qdot's experts from `buffer_rows`).
int buffered_floats();
void buffered_dot_item(const float* x, const uint8_t* w, const float* scale_bias, float* y,
                       int M, int N, int K, int bits, int group, int g, float* buf);
void buffered_dot_item(const float* x, const uint8_t* w, const uint16_t* scale_bias, float* y,
                       int M, int N, int K, int bits, int group, int g, float* buf);
extern const bool integer_dot;
void attention(const AttentionArgs& args, int threads);
void rms_norm(const float* x, const float* weight, float* y, size_t rows, int D, float eps);
void swiglu(const float* gate, const float* x, float* y, size_t n);
void gather_qmatmul_f32(const float* x, const int32_t* idx, const uint8_t* w,
                        const float* scale_bias, float* y, int T, int J, int E, int N, int K,
                        int bits, int group, int threads);
void gather_qmatmul_f16(const float* x, const int32_t* idx, const uint8_t* w,
                        const uint16_t* scale_bias, float* y, int T, int J, int E, int N, int K,
                        int bits, int group, int threads);
void gather_qdot_f32(const float* x, const int32_t* idx, const uint8_t* w,
                     const float* scale_bias, float* y, int T, int J, int E, int N, int K,
                     int bits, int group, bool precise, int buffer_rows, int threads);
void gather_qdot_f16(const float* x, const int32_t* idx, const uint8_t* w,
                     const uint16_t* scale_bias, float* y, int T, int J, int E, int N, int K,
                     int bits, int group, bool precise, int buffer_rows, int threads);
void sample(const float* logits, const float* inv_temperature, const float* top_p,
            const float* u, uint32_t* tokens, int rows, int V, int threads);

}  // namespace MLXD_ISA
}  // namespace mlxd

// The mixture-of-experts matmul on the packed layout, per ISA variant: for x [T, K] and each
// token's J expert indices idx [T, J], y[t, j] = x[t] @ dequantize(w[idx[t, j]])^T, with w a
// stack of E matrices packed as the dense kernel's (qmatmul.cpp), one after another.
//
// MLX's gather_qmm on the CPU dequantizes element by element per (token, expert) pair; here the
// pairs are grouped by expert first (a counting sort), each expert's rows of x gathered into
// one block, and every selected expert multiplied once by the dense kernel's work items
// (qmatmul_tiles.h) over all its rows: at decode each selected expert's weights stream from
// memory once for the whole batch, at prefill each expert's rows run as a small GEMM (the
// buffered path from 32 rows on). The work items of all selected experts are shared among the
// threads together, so one expert's few outputs do not leave threads idle.

#include <omp.h>

#include "qmatmul_tiles.h"
#include "variant.h"

namespace mlxd {
namespace MLXD_ISA {

namespace {

template <typename S>
struct Gather {
  const float* x;  // [T, K]
  const int32_t* idx;  // [T, J]
  const uint8_t* w;  // [E, N / 16 tiles, K * bits / 8 * 16 bytes]
  const S* scale_bias;  // [E, N / 16 tiles, K / 32 blocks, 2, 16]
  float* y;  // [T, J, N]
  int T, J, E, N, K;
  int threads;
};

// Integers in a float Scratch (no std:: container here: see simd.h).
inline int32_t* ints(const Scratch& s) {
  return reinterpret_cast<int32_t*>(s.data());
}

template <int BITS, typename S>
void run(const Gather<S>& a) {
  const int pairs = a.T * a.J, blocks = a.K / BLOCK, items = a.N / GROUP;
  // Pairs by expert: start[e] .. start[e + 1] in order[], which holds pair indices t * J + j.
  // An index outside [0, E) selects no expert: its output is zero.
  Scratch start_s(size_t(a.E) + 1), order_s(pairs), active_s(a.E);
  int32_t *start = ints(start_s), *order = ints(order_s), *active = ints(active_s);
  for (int e = 0; e <= a.E; ++e) {
    start[e] = 0;
  }
  for (int i = 0; i < pairs; ++i) {
    const int32_t e = a.idx[i];
    if (e >= 0 && e < a.E) {
      ++start[e + 1];
    }
  }
  int selected = 0;
  for (int e = 0; e < a.E; ++e) {
    if (start[e + 1] > 0) {
      active[selected++] = e;
    }
    start[e + 1] += start[e];
  }
  const int routed = start[a.E];
  {
    Scratch next_s(a.E);
    int32_t* next = ints(next_s);
    for (int e = 0; e < a.E; ++e) {
      next[e] = start[e];
    }
    for (int i = 0; i < pairs; ++i) {
      const int32_t e = a.idx[i];
      if (e >= 0 && e < a.E) {
        order[next[e]++] = i;
      }
    }
  }
  // x's rows in that order and their block sums (for the passes in registers), on this thread:
  // every barrier of a parallel region is a chance to wait out a preempted thread's time slice
  // on a busy machine, and the copy is a few KB at decode, a few ms of a 512-token chunk's
  // hundreds at prefill.
  Scratch xs(size_t(routed) * a.K), ys(size_t(routed) * a.N), xsum(size_t(routed) * blocks);
  for (int r = 0; r < routed; ++r) {
    const float* from = a.x + size_t(order[r] / a.J) * a.K;
    std::memcpy(xs.data() + size_t(r) * a.K, from, size_t(a.K) * sizeof(float));
  }
  block_sums(xs.data(), routed, a.K, xsum.data());
  for (int i = 0; i < pairs; ++i) {
    if (a.idx[i] < 0 || a.idx[i] >= a.E) {
      std::memset(a.y + size_t(i) * a.N, 0, size_t(a.N) * sizeof(float));
    }
  }
  const int threads = a.threads;
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
    Scratch buf(size_t(CHUNK) * GROUP);
    // Experts differ in their row counts at prefill: work items go to whichever thread is free.
#pragma omp for schedule(dynamic)
    for (int item = 0; item < selected * items; ++item) {
      const int e = active[item / items], g = item % items, first = start[e];
      const int count = start[e + 1] - first;
      const Problem<S> p{
          xs.data() + size_t(first) * a.K,
          a.w + size_t(e) * a.N * a.K * BITS / 8,
          a.scale_bias + size_t(e) * a.N * a.K / 16,  // 2 per 16 rows and 32 inputs
          ys.data() + size_t(first) * a.N,
          count,
          a.N,
          a.K,
          1};
      work_item<BITS, S>(p, xsum.data() + size_t(first) * blocks, buf.data(), g);
      // The item's outputs are final: to their pairs' rows of y.
      for (int r = first; r < first + count; ++r) {
        std::memcpy(a.y + size_t(order[r]) * a.N + g * GROUP, ys.data() + size_t(r) * a.N + g * GROUP,
                    GROUP * sizeof(float));
      }
    }
  }
}

template <typename S>
void gather_qmatmul(const float* x, const int32_t* idx, const uint8_t* w, const S* scale_bias,
                    float* y, int T, int J, int E, int N, int K, int bits, int threads) {
  const Gather<S> a{x, idx, w, scale_bias, y, T, J, E, N, K, threads};
  if (bits == 4) {
    run<4, S>(a);
  } else {
    run<8, S>(a);  // the op checked: 4 or 8
  }
}

}  // namespace

void gather_qmatmul_f32(const float* x, const int32_t* idx, const uint8_t* w,
                        const float* scale_bias, float* y, int T, int J, int E, int N, int K,
                        int bits, int threads) {
  gather_qmatmul(x, idx, w, scale_bias, y, T, J, E, N, K, bits, threads);
}

void gather_qmatmul_f16(const float* x, const int32_t* idx, const uint8_t* w,
                        const uint16_t* scale_bias, float* y, int T, int J, int E, int N, int K,
                        int bits, int threads) {
  gather_qmatmul(x, idx, w, scale_bias, y, T, J, E, N, K, bits, threads);
}

}  // namespace MLXD_ISA
}  // namespace mlxd

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

#include "parallel.h"
#include "qmatmul_tiles.h"
#include "routing.h"
#include "variant.h"

namespace mlxd {
namespace MLXD_ISA {

namespace {

template <int BITS, typename S>
void run(const Gather<S>& a) {
  const int pairs = a.T * a.J, blocks = a.K / BLOCK, items = a.N / GROUP;
  const Routing routing(a.idx, pairs, a.E);
  const int32_t* start = routing.start();
  Scratch xs(size_t(routing.routed) * a.K), ys(size_t(routing.routed) * a.N);
  Scratch xsum(size_t(routing.routed) * blocks);  // for the passes in registers
  gather_rows(routing, a.x, a.idx, pairs, a.J, a.E, a.K, a.N, xs.data(), a.y);
  block_sums(xs.data(), routing.routed, a.K, xsum.data());
  const int threads = a.threads;
  // Experts differ in their row counts at prefill: ranges of work items go to whichever thread
  // is free (parallel.h).
  parallel_for(threads, int64_t(routing.selected) * items, [&](int64_t begin, int64_t end) {
    Scratch buf(BUFFER_FLOATS);
    for (int item = int(begin); item < int(end); ++item) {
      const int e = routing.active()[item / items], g = item % items, first = start[e];
      const int count = start[e + 1] - first;
      const Problem<S> p{
          xs.data() + size_t(first) * a.K,
          a.weights(e, BITS),
          a.scales(e),
          ys.data() + size_t(first) * a.N,
          count,
          a.N,
          a.K,
          a.scale_shift,
          1};
      work_item<BITS, S>(p, xsum.data() + size_t(first) * blocks, buf.data(), g);
      scatter_item(routing, ys.data(), first, count, g, GROUP, a.N, a.y);
    }
  });
}

template <typename S>
void gather_qmatmul(const float* x, const int32_t* idx, const uint8_t* w, const S* scale_bias,
                    float* y, int T, int J, int E, int N, int K, int bits, int group,
                    int threads) {
  const Gather<S> a{x, idx, w, scale_bias, y, T, J, E, N, K, scale_shift(group), threads};
  if (bits == 4) {
    run<4, S>(a);
  } else {
    run<8, S>(a);  // the op checked: 4 or 8
  }
}

}  // namespace

void gather_qmatmul_f32(const float* x, const int32_t* idx, const uint8_t* w,
                        const float* scale_bias, float* y, int T, int J, int E, int N, int K,
                        int bits, int group, int threads) {
  gather_qmatmul(x, idx, w, scale_bias, y, T, J, E, N, K, bits, group, threads);
}

void gather_qmatmul_f16(const float* x, const int32_t* idx, const uint8_t* w,
                        const uint16_t* scale_bias, float* y, int T, int J, int E, int N, int K,
                        int bits, int group, int threads) {
  gather_qmatmul(x, idx, w, scale_bias, y, T, J, E, N, K, bits, group, threads);
}

}  // namespace MLXD_ISA
}  // namespace mlxd

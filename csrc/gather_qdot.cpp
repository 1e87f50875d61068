// The mixture-of-experts matmul on pack_dot's layout, per ISA variant: gather_qmatmul.cpp's
// grouping by expert around the int8 dot-product kernel's work items (qdot_tiles.h). The
// gathered rows of x are rounded to int8 per block once, on the calling thread, as qdot.cpp
// rounds a dense matmul's. An expert with `buffer_rows` rows or more runs qmatmul's buffered
// passes on this layout instead, as qdot.cpp's dense matmul does from there: its rows are
// not rounded.

#include "parallel.h"
#include "qdot_tiles.h"
#include "routing.h"
#include "variant.h"

namespace mlxd {
namespace MLXD_ISA {

namespace {

template <int BITS, int TERMS, typename S>
void run(const Gather<S>& a, int buffer_rows) {
  const int pairs = a.T * a.J, items = a.N / GROUP;
  const Routing routing(a.idx, pairs, a.E);
  const int32_t* start = routing.start();
  const int routed = routing.routed;
  Scratch xs(size_t(routed) * a.K), ys(size_t(routed) * a.N);
  gather_rows(routing, a.x, a.idx, pairs, a.J, a.E, a.K, a.N, xs.data(), a.y);
  QuantizedRows<BITS, TERMS> xq(routed, a.K);
  for (int i = 0; i < routing.selected; ++i) {  // the rows the buffered passes do not take
    const int e = routing.active()[i], first = start[e], count = start[e + 1] - first;
    if (buffer_rows == 0 || count < buffer_rows) {
      xq.quantize(xs.data() + size_t(first) * a.K, first, count, 1);
    }
  }
  const int threads = a.threads;
  parallel_for(threads, int64_t(routing.selected) * items, [&](int64_t begin, int64_t end) {
    Scratch buf(buffer_rows > 0 ? buffered_floats() : 0);
    for (int item = int(begin); item < int(end); ++item) {
      const int e = routing.active()[item / items], g = item % items, first = start[e];
      const int count = start[e + 1] - first;
      if (buffer_rows > 0 && count >= buffer_rows) {
        buffered_dot_item(xs.data() + size_t(first) * a.K, a.weights(e, BITS), a.scales(e),
                          ys.data() + size_t(first) * a.N, count, a.N, a.K, BITS,
                          BLOCK << a.scale_shift, g, buf.data());
        scatter_item(routing, ys.data(), first, count, g, GROUP, a.N, a.y);
        continue;
      }
      const Problem<S> p{xq.from(first),
                         a.weights(e, BITS),
                         a.scales(e),
                         ys.data() + size_t(first) * a.N,
                         count,
                         a.N,
                         a.K,
                         a.scale_shift};
      dot_work_item<BITS, TERMS, S>(p, g);
      scatter_item(routing, ys.data(), first, count, g, GROUP, a.N, a.y);
    }
  });
}

template <typename S>
void gather_qdot(const float* x, const int32_t* idx, const uint8_t* w, const S* scale_bias,
                 float* y, int T, int J, int E, int N, int K, int bits, int group, bool precise,
                 int buffer_rows, int threads) {
  const Gather<S> a{x, idx, w, scale_bias, y, T, J, E, N, K, scale_shift(group), threads};
  if (precise) {
    bits == 4 ? run<4, 2, S>(a, buffer_rows) : run<8, 2, S>(a, buffer_rows);  // 4 or 8
  } else {
    bits == 4 ? run<4, 1, S>(a, buffer_rows) : run<8, 1, S>(a, buffer_rows);
  }
}

}  // namespace

void gather_qdot_f32(const float* x, const int32_t* idx, const uint8_t* w,
                     const float* scale_bias, float* y, int T, int J, int E, int N, int K,
                     int bits, int group, bool precise, int buffer_rows, int threads) {
  gather_qdot(x, idx, w, scale_bias, y, T, J, E, N, K, bits, group, precise, buffer_rows,
              threads);
}

void gather_qdot_f16(const float* x, const int32_t* idx, const uint8_t* w,
                     const uint16_t* scale_bias, float* y, int T, int J, int E, int N, int K,
                     int bits, int group, bool precise, int buffer_rows, int threads) {
  gather_qdot(x, idx, w, scale_bias, y, T, J, E, N, K, bits, group, precise, buffer_rows,
              threads);
}

}  // namespace MLXD_ISA
}  // namespace mlxd

// The experts' gather matmuls' common steps (gather_qmatmul.cpp, gather_qdot.cpp): the (token,
// expert) pairs grouped by expert, x's rows gathered in that order, and each work item's outputs
// scattered back to their pairs' rows. Included once per ISA variant (simd.h).
#pragma once

#include "simd.h"

namespace mlxd {
namespace MLXD_ISA {

namespace {

// A gather matmul's arguments: y[t, j] = x[t] @ dequantize(w[idx[t, j]])^T.
template <typename S>
struct Gather {
  const float* x;  // [T, K]
  const int32_t* idx;  // [T, J]
  const uint8_t* w;  // [E, N / 16 tiles, K * bits / 8 * 16 bytes] (either layout)
  const S* scale_bias;  // [E, N / 16 tiles, K / group, 2, 16]
  float* y;  // [T, J, N]
  int T, J, E, N, K;
  int scale_shift;  // log2(group / 32): a scale and bias per group inputs
  int threads;

  const uint8_t* weights(int e, int bits) const {  // expert e's
    return w + size_t(e) * N * K * bits / 8;
  }
  const S* scales(int e) const {  // 2 per 16 rows and group inputs
    return scale_bias + (size_t(e) * N * K / 16 >> scale_shift);
  }
};

// Integers in a float Scratch (no std:: container here: see simd.h).
inline int32_t* ints(const Scratch& s) {
  return reinterpret_cast<int32_t*>(s.data());
}

// The pairs t * J + j of idx [T, J] grouped by expert (a counting sort): expert e's are
// order()[start()[e] .. start()[e + 1]), and the `selected` experts with any are
// active()[0 .. selected). An index outside [0, E) selects no expert: its output is zero.
class Routing {
 public:
  Routing(const int32_t* idx, int pairs, int experts)
      : start_(size_t(experts) + 1), order_(pairs), active_(experts), next_(experts) {
    int32_t *start = ints(start_), *order = ints(order_), *next = ints(next_);
    for (int e = 0; e <= experts; ++e) {
      start[e] = 0;
    }
    for (int i = 0; i < pairs; ++i) {
      if (idx[i] >= 0 && idx[i] < experts) {
        ++start[idx[i] + 1];
      }
    }
    for (int e = 0; e < experts; ++e) {
      if (start[e + 1] > 0) {
        ints(active_)[selected++] = e;
      }
      start[e + 1] += start[e];
      next[e] = start[e];
    }
    routed = start[experts];
    for (int i = 0; i < pairs; ++i) {
      if (idx[i] >= 0 && idx[i] < experts) {
        order[next[idx[i]]++] = i;
      }
    }
  }
  const int32_t* start() const {
    return ints(start_);
  }
  const int32_t* order() const {
    return ints(order_);
  }
  const int32_t* active() const {
    return ints(active_);
  }

  int selected = 0;  // experts with any pair
  int routed = 0;  // pairs with an expert

 private:
  Scratch start_, order_, active_, next_;
};

// xs [routed, K]: x's row of each routed pair, in routing order; and y's rows of the pairs
// routed nowhere zeroed. On the calling thread: a few KB at decode, a few ms of a 512-token
// chunk's hundreds at prefill.
inline void gather_rows(const Routing& r, const float* x, const int32_t* idx, int pairs, int J,
                        int E, int K, int N, float* xs, float* y) {
  for (int i = 0; i < r.routed; ++i) {
    std::memcpy(xs + size_t(i) * K, x + size_t(r.order()[i] / J) * K, size_t(K) * sizeof(float));
  }
  for (int i = 0; i < pairs; ++i) {
    if (idx[i] < 0 || idx[i] >= E) {
      std::memset(y + size_t(i) * N, 0, size_t(N) * sizeof(float));
    }
  }
}

// Work item g's `columns` outputs of routed rows first .. first + count (ys, routing order) to
// their pairs' rows of y: final once the item is done, so no barrier waits for the others.
inline void scatter_item(const Routing& r, const float* ys, int first, int count, int g,
                         int columns, int N, float* y) {
  for (int i = first; i < first + count; ++i) {
    std::memcpy(y + size_t(r.order()[i]) * N + g * columns, ys + size_t(i) * N + g * columns,
                columns * sizeof(float));
  }
}

}  // namespace
}  // namespace MLXD_ISA
}  // namespace mlxd

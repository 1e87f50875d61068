// How many threads mlxd's kernels use (set from Python: mlxd.kernels.share_cores).
//
// Threads that just finished a kernel spin a while before sleeping, as OpenBLAS's do: in a
// process whose matmuls run on OpenBLAS (float32 models) both sets spin on the same cores and a
// decode step took 6x longer (measured). Such processes run the kernels on one thread. Only one
// stream, the engine's, runs kernels on several threads (parallel_stream); their parallel
// loops: parallel.h.
#pragma once

#include <atomic>

#include "mlx/stream.h"

namespace mlxd {

inline std::atomic<int>& kernel_threads() {
  static std::atomic<int> threads{1};
  return threads;
}

// The index of the one stream whose kernels use kernel_threads() (-1: any stream).
inline std::atomic<int>& parallel_stream() {
  static std::atomic<int> index{-1};
  return index;
}

// Threads for a kernel evaluated on `stream`.
inline int threads_on(const mlx::core::Stream& stream) {
  const int parallel = parallel_stream().load();
  return parallel < 0 || parallel == stream.index ? kernel_threads().load() : 1;
}

}  // namespace mlxd

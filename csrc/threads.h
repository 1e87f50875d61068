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

// Kernels over at most this many rows of x leave one core to the rest of the process (0: none
// do). A small model's one-row decode step is a few ms of kernels, and the engine's Python
// (building the next step, handing tokens out) needs a core beside them: SmolLM2-135M served
// one stream at 116-160 tok/s with its kernels on both of two cores, 172-180 on one
// (mlxd/models/cpu_path.py decides per model).
inline std::atomic<int64_t>& spare_core_rows() {
  static std::atomic<int64_t> rows{0};
  return rows;
}

// Threads for a kernel over `rows` rows of x evaluated on `stream`.
inline int threads_on(const mlx::core::Stream& stream, int64_t rows) {
  const int threads = threads_on(stream);
  return rows > 0 && rows <= spare_core_rows().load() && threads > 1 ? threads - 1 : threads;
}

}  // namespace mlxd

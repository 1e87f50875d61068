// How many threads mlxd's kernels use (set from Python: mlxd.kernels.share_cores).
//
// OpenMP threads that just finished a kernel spin a while before sleeping, as OpenBLAS's do:
// in a process whose matmuls run on OpenBLAS (float32 models) both sets spin on the same cores
// and a decode step took 6x longer (measured). Such processes run the kernels on one thread.
#pragma once

#include <atomic>

namespace mlxd {

inline std::atomic<int>& kernel_threads() {
  static std::atomic<int> threads{1};
  return threads;
}

}  // namespace mlxd

// The kernels' parallel loops, on mlxd's own thread pool (threads.cpp).
//
// Why not OpenMP: a `parallel for` ends at a barrier that waits for every thread of the team,
// including one the OS has not scheduled yet. When other work holds the cores (another model's
// worker, a compile, the daemon), each of a decode step's ~300 kernels waited up to a scheduler
// time slice for it: a SmolLM2 stream fell from ~110 to 2–3 tokens a second on a busy 2-core
// machine. Here the calling thread claims chunks of the loop alongside the pool's helpers and
// waits only for chunks a helper has claimed: a helper that is not running costs nothing.
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>

namespace mlxd {

using ChunkFn = void (*)(void* body, int64_t begin, int64_t end);

// Runs fn(body, begin, end) over [0, n) in chunks of `chunk` on this thread and up to
// `threads` - 1 helpers; returns when every chunk has run (threads.cpp).
void run_parallel(int threads, int64_t n, int64_t chunk, ChunkFn fn, void* body);

// body(begin, end) for consecutive ranges covering [0, n), on up to `threads` threads. Ranges
// are claimed as threads arrive (a few per thread, so a late one takes fewer); they must be
// independent. Same results whichever thread runs a range.
template <typename Body>
void parallel_for(int threads, int64_t n, Body&& body) {
  if (n <= 0) {
    return;
  }
  if (threads <= 1 || n == 1) {
    body(int64_t{0}, n);
    return;
  }
  const int64_t chunk = std::max<int64_t>(1, (n + 4 * threads - 1) / (4 * threads));
  run_parallel(
      threads, n, chunk,
      [](void* b, int64_t begin, int64_t end) { (*static_cast<std::remove_reference_t<Body>*>(b))(begin, end); },
      const_cast<void*>(static_cast<const void*>(&body)));
}

}  // namespace mlxd

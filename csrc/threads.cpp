// The kernels' thread pool (see parallel.h for why it is not OpenMP).
//
// One job at a time (a second caller runs its loop alone). The caller writes a job's fields
// only while no helper is inside (`inside_`), and says so first (`writing_`): a helper enters,
// then looks, and leaves again while a job is being written. Each side writes its flag before
// reading the other's (sequentially consistent), so either the caller sees the helper inside
// and waits, or the helper sees the write and stays out. (Without `writing_`, a helper that woke
// for a job the caller had already finished alone could enter as the next job was being written
// and run a torn one: a chunk function with another job's closure, or a chunk counted twice.)
// Helpers spin politely (yielding the core to anything else runnable) for a while after each
// job, as a decode step's kernels follow each other within microseconds, then sleep until the
// next.
#include "parallel.h"

#include <sched.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <thread>

namespace mlxd {
namespace {

inline void relax() {
#if defined(__x86_64__) || defined(_M_X64)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// Waits in a loop: pauses, a sched_yield every 64 turns (the core to any other runnable
// thread, e.g. the one this loop waits for), and reports when `budget` has passed.
class Spin {
 public:
  explicit Spin(std::chrono::microseconds budget)
      : deadline_(std::chrono::steady_clock::now() + budget) {}
  // False once the budget is spent (checked every 64 turns).
  bool wait() {
    relax();
    if (++turns_ % 64 != 0) {
      return true;
    }
    sched_yield();
    return std::chrono::steady_clock::now() < deadline_;
  }

 private:
  std::chrono::steady_clock::time_point deadline_;
  unsigned turns_ = 0;
};

// How long a helper spins for the next job before sleeping: longer than the gaps between a
// decode step's kernels, far shorter than an idle worker's life.
constexpr std::chrono::microseconds HELPER_SPIN{2000};

struct Job {
  ChunkFn fn = nullptr;
  void* body = nullptr;
  int64_t n = 0, chunk = 1;
  int helpers = 0;  // helpers with a lower index take part
};

class Pool {
 public:
  void run(int threads, int64_t n, int64_t chunk, ChunkFn fn, void* body) {
    std::unique_lock<std::mutex> owner(busy_, std::try_to_lock);
    if (!owner.owns_lock()) {  // another stream's kernel holds the pool
      fn(body, 0, n);
      return;
    }
    grow(threads - 1);
    writing_.store(true, std::memory_order_seq_cst);
    for (Spin spin(HELPER_SPIN); inside_.load(std::memory_order_seq_cst) != 0;) {
      spin.wait();  // a helper still leaving the previous job
    }
    job_ = Job{fn, body, n, chunk, threads - 1};
    next_.store(0, std::memory_order_relaxed);
    done_.store(0, std::memory_order_relaxed);
    generation_.fetch_add(1, std::memory_order_seq_cst);
    writing_.store(false, std::memory_order_seq_cst);
    if (sleepers_.load(std::memory_order_seq_cst) > 0) {
      std::lock_guard<std::mutex> lock(sleep_);
      wake_.notify_all();
    }
    work();
    for (Spin spin(HELPER_SPIN); done_.load(std::memory_order_acquire) < n;) {
      spin.wait();  // chunks helpers claimed: the budget does not apply
    }
  }

 private:
  void work() {
    const Job& job = job_;
    for (;;) {
      const int64_t begin = next_.fetch_add(job.chunk, std::memory_order_relaxed);
      if (begin >= job.n) {
        return;
      }
      const int64_t end = std::min(begin + job.chunk, job.n);
      job.fn(job.body, begin, end);
      done_.fetch_add(end - begin, std::memory_order_release);
    }
  }

  void grow(int helpers) {
    for (; started_ < helpers; ++started_) {
      std::thread([this, index = started_, seen = generation_.load()]() mutable {
        helper(index, seen);
      }).detach();
    }
  }

  [[noreturn]] void helper(int index, uint64_t seen) {
    for (;;) {
      await(seen);
      inside_.fetch_add(1, std::memory_order_seq_cst);
      const uint64_t generation = generation_.load(std::memory_order_seq_cst);
      if (writing_.load(std::memory_order_seq_cst)) {
        inside_.fetch_sub(1, std::memory_order_seq_cst);
        // A job is being written: look again once it is published (the budget does not
        // apply: the caller is between two stores).
        for (Spin spin(HELPER_SPIN); writing_.load(std::memory_order_seq_cst);) {
          spin.wait();
        }
        continue;
      }
      if (generation != seen) {
        seen = generation;
        if (index < job_.helpers) {
          work();
        }
      }
      inside_.fetch_sub(1, std::memory_order_seq_cst);
    }
  }

  // Until a generation after `seen` is published.
  void await(uint64_t seen) {
    Spin spin(HELPER_SPIN);
    while (generation_.load(std::memory_order_acquire) == seen) {
      if (!spin.wait()) {
        std::unique_lock<std::mutex> lock(sleep_);
        sleepers_.fetch_add(1, std::memory_order_seq_cst);
        wake_.wait(lock, [&] { return generation_.load(std::memory_order_seq_cst) != seen; });
        sleepers_.fetch_sub(1, std::memory_order_seq_cst);
        return;
      }
    }
  }

  std::mutex busy_;
  int started_ = 0;
  Job job_;
  std::atomic<uint64_t> generation_{0};
  std::atomic<int64_t> next_{0}, done_{0};
  std::atomic<int> inside_{0}, sleepers_{0};
  std::atomic<bool> writing_{false};
  std::mutex sleep_;
  std::condition_variable wake_;
};

// Never destroyed: its helpers are detached and may still be waiting at exit.
Pool& the_pool() {
  static Pool* pool = new Pool();
  return *pool;
}

}  // namespace

void run_parallel(int threads, int64_t n, int64_t chunk, ChunkFn fn, void* body) {
  the_pool().run(threads, n, chunk, fn, body);
}

}  // namespace mlxd

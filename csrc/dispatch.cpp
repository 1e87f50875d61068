// Which ISA variant of the kernels runs: the best one this CPU supports, asked of cpuid at the
// first kernel (not -march=native at build time: the module runs on any CPU of its
// architecture it is copied to), or the one use_isa names (MLXD_KERNELS_ISA, tests).
#include <atomic>
#include <stdexcept>

#if defined(__aarch64__)
#include <asm/hwcap.h>
#include <sys/auxv.h>
#endif

#include "kernels.h"

namespace mlxd {

#if defined(MLXD_HAVE_AVX512)
extern const Kernels kernels_avx512;
#endif
#if defined(MLXD_HAVE_AVX512VNNI)
extern const Kernels kernels_avx512vnni;
#endif
#if defined(MLXD_HAVE_AVX2)
extern const Kernels kernels_avx2;
#endif
#if defined(MLXD_HAVE_AVXVNNI)
extern const Kernels kernels_avxvnni;
#endif
#if defined(MLXD_HAVE_NEON)
extern const Kernels kernels_neon;
#endif
#if defined(MLXD_HAVE_NEONDOT)
extern const Kernels kernels_neondot;
#endif
extern const Kernels kernels_generic;

namespace {

#if defined(__x86_64__) || defined(__i386__)
// __builtin_cpu_supports also checks that the OS saves the wider registers (XCR0).
bool runs_avx2() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
      __builtin_cpu_supports("f16c");
}

bool runs_avx512() {
  return runs_avx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl");
}

bool runs_avx512vnni() {
  return runs_avx512() && __builtin_cpu_supports("avx512vnni");
}

bool runs_avxvnni() {
  return runs_avx2() && __builtin_cpu_supports("avxvnni");
}
#endif

#if defined(__aarch64__)
bool runs_neondot() {  // sdot: ARMv8.2's optional dot product (the kernel's HWCAP)
  return (getauxval(AT_HWCAP) & HWCAP_ASIMDDP) != 0;
}
#endif

bool runs_anywhere() {  // generic: no ISA flags; NEON: part of every aarch64 CPU
  return true;
}

struct Variant {
  const Kernels* kernels;
  bool (*runs_here)();
};

// Best first.
const Variant VARIANTS[] = {
#if defined(MLXD_HAVE_AVX512VNNI)
    {&kernels_avx512vnni, runs_avx512vnni},
#endif
#if defined(MLXD_HAVE_AVX512)
    {&kernels_avx512, runs_avx512},
#endif
#if defined(MLXD_HAVE_AVXVNNI)
    {&kernels_avxvnni, runs_avxvnni},
#endif
#if defined(MLXD_HAVE_AVX2)
    {&kernels_avx2, runs_avx2},
#endif
#if defined(MLXD_HAVE_NEONDOT)
    {&kernels_neondot, runs_neondot},
#endif
#if defined(MLXD_HAVE_NEON)
    {&kernels_neon, runs_anywhere},
#endif
    {&kernels_generic, runs_anywhere},
};

std::atomic<const Kernels*>& active() {
  static std::atomic<const Kernels*> kernels{nullptr};
  return kernels;
}

std::string joined(const std::vector<std::string>& names) {
  std::string out;
  for (const auto& name : names) {
    out += (out.empty() ? "" : ", ") + name;
  }
  return out;
}

}  // namespace

const Kernels& kernels() {
  const Kernels* chosen = active().load(std::memory_order_acquire);
  if (chosen == nullptr) {
    for (const auto& variant : VARIANTS) {
      if (variant.runs_here()) {
        chosen = variant.kernels;
        break;
      }
    }
    active().store(chosen, std::memory_order_release);
  }
  return *chosen;
}

void use_isa(const std::string& isa) {
  for (const auto& variant : VARIANTS) {
    if (isa == variant.kernels->isa) {
      if (!variant.runs_here()) {
        throw std::invalid_argument(
            "kernel ISA '" + isa + "': this CPU lacks it (it runs " + joined(runnable_isas()) + ")");
      }
      active().store(variant.kernels, std::memory_order_release);
      return;
    }
  }
  throw std::invalid_argument(
      "kernel ISA '" + isa + "' is not built into this module (built: " + joined(built_isas()) +
      ")");
}

std::vector<std::string> runnable_isas() {
  std::vector<std::string> names;
  for (const auto& variant : VARIANTS) {
    if (variant.runs_here()) {
      names.emplace_back(variant.kernels->isa);
    }
  }
  return names;
}

std::vector<std::string> built_isas() {
  std::vector<std::string> names;
  for (const auto& variant : VARIANTS) {
    names.emplace_back(variant.kernels->isa);
  }
  return names;
}

}  // namespace mlxd

// The float32 vector the kernels compute with, one per ISA variant (see dispatch.cpp).
//
// Every kernel source (KERNEL_SOURCES in CMakeLists.txt) is compiled once per variant with
// -DMLXD_ISA=<name> and that variant's target flags; this header gives it a vector as wide as
// the variant's registers: 16 lanes (AVX-512), 8 (AVX2) or 4 (NEON, and the generic variant,
// which any x86-64 or aarch64 CPU runs). A wider vector than the registers lowers to pairs of
// registers and spills every broadcast to the stack (measured: 10x slower than float32 BLAS).
//
// Each variant's code lives in namespace mlxd::MLXD_ISA and uses no std:: container or other
// out-of-line template: the linker keeps one copy of such a template's code for the whole
// module, which might then be another variant's (an AVX-512 instruction on an AVX2 CPU).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>

#if defined(MLXD_ISA_AVX512) || defined(MLXD_ISA_AVX2)
#include <immintrin.h>
#elif defined(MLXD_ISA_NEON)
#include <arm_neon.h>
#endif

#if defined(MLXD_ISA_AVX512) && !(defined(__AVX512F__) && defined(__AVX512BW__))
#error "the avx512 variant needs -mavx512f -mavx512bw -mavx512vl"
#endif
#if defined(MLXD_ISA_AVX2) && !(defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
#error "the avx2 variant needs -mavx2 -mfma -mf16c"
#endif

namespace mlxd {
namespace MLXD_ISA {

#if defined(MLXD_ISA_AVX512)
constexpr int W = 16;
#elif defined(MLXD_ISA_AVX2)
constexpr int W = 8;
#else
constexpr int W = 4;
#endif

typedef float vf __attribute__((vector_size(W * 4)));
typedef int32_t vi __attribute__((vector_size(W * 4)));

inline vf load(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline void store(float* p, vf v) {
  std::memcpy(p, &v, sizeof(v));
}

inline vi load_i32(const uint8_t* p) {  // W 32-bit lanes, unaligned
  vi v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// W bytes widened to W int32 lanes (GCC's generic __builtin_convertvector does this byte by
// byte in scalar code, so each ISA's widening instruction is named).
inline vi load_u8(const uint8_t* p) {
#if defined(MLXD_ISA_AVX512)
  return (vi)_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#elif defined(MLXD_ISA_AVX2)
  return (vi)_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
#elif defined(MLXD_ISA_NEON)
  uint32_t word;
  std::memcpy(&word, p, sizeof(word));
  const uint16x8_t wide = vmovl_u8(vreinterpret_u8_u32(vdup_n_u32(word)));
  return (vi)vmovl_u16(vget_low_u16(wide));
#else
  typedef uint8_t u8 __attribute__((vector_size(W)));
  u8 v;
  std::memcpy(&v, p, sizeof(v));
  return __builtin_convertvector(v, vi);
#endif
}

// IEEE half (bits) to float, exactly; the generic variant's conversion.
inline float half_to_float(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000) << 16;
  uint32_t exponent = (h >> 10) & 0x1F, mantissa = h & 0x3FF, bits;
  if (exponent == 0x1F) {
    bits = sign | 0x7F800000u | (mantissa << 13);  // inf, NaN
  } else if (exponent != 0) {
    bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
  } else if (mantissa == 0) {
    bits = sign;
  } else {  // subnormal: normalise
    exponent = 113;
    while ((mantissa & 0x400) == 0) {
      mantissa <<= 1;
      --exponent;
    }
    bits = sign | (exponent << 23) | ((mantissa & 0x3FF) << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// W float16 values (bits) as float32.
inline vf load_f16(const uint16_t* p) {
#if defined(MLXD_ISA_AVX512)
  return (vf)_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#elif defined(MLXD_ISA_AVX2)
  return (vf)_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#elif defined(MLXD_ISA_NEON)
  return (vf)vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(p)));
#else
  // half_to_float on every lane at once, without its branches (a loop of it was ≈15x slower
  // than the float32 loads it replaces in attention): the exponent rebiased, then infinities
  // and NaNs, and subnormals (normalised by a float subtraction), selected per lane.
  typedef uint16_t vh __attribute__((vector_size(W * 2)));
  typedef uint32_t vu __attribute__((vector_size(W * 4)));
  vh halves;
  std::memcpy(&halves, p, sizeof(halves));
  const vu h = __builtin_convertvector(halves, vu);
  const vu top = vu{} + (0x7C00u << 13);  // the exponent's bits, moved to float's place
  vu bits = (h & 0x7FFFu) << 13;
  const vu exponent = bits & top;
  bits += (127 - 15) << 23;
  bits = exponent == top ? bits + ((128 - 16) << 23) : bits;
  vf normal, subnormal;
  std::memcpy(&normal, &bits, sizeof(normal));
  const vu shifted = bits + (1u << 23);
  std::memcpy(&subnormal, &shifted, sizeof(subnormal));
  subnormal -= 6.10351562e-05f;  // 2^-14: the subnormal's value left in the mantissa
  vf v = exponent == 0 ? subnormal : normal;
  vu out;
  std::memcpy(&out, &v, sizeof(out));
  out |= (h & 0x8000u) << 16;
  std::memcpy(&v, &out, sizeof(v));
  return v;
#endif
}

// The sum of the lanes, as a tree (a serial loop over the lanes is W dependent adds).
inline float hsum(vf v) {
#if defined(MLXD_ISA_AVX512)
  return _mm512_reduce_add_ps((__m512)v);
#elif defined(MLXD_ISA_AVX2)
  __m128 s = _mm_add_ps(_mm256_castps256_ps128((__m256)v), _mm256_extractf128_ps((__m256)v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
#elif defined(MLXD_ISA_NEON)
  return vaddvq_f32((float32x4_t)v);
#else
  return (v[0] + v[2]) + (v[1] + v[3]);
#endif
}

// out[0..3] = hsum(a), hsum(b), hsum(c), hsum(d): the four reductions share their shuffles
// (three horizontal adds and one add on AVX2, where four hsum calls take twelve shuffles and
// twelve adds).
inline void hsum4(vf a, vf b, vf c, vf d, float* out) {
#if defined(MLXD_ISA_AVX512) || defined(MLXD_ISA_AVX2)
#if defined(MLXD_ISA_AVX512)
  const auto half = [](vf v) {  // the two 256-bit halves added
    const __m512 x = (__m512)v;
    return _mm256_add_ps(_mm512_castps512_ps256(x),
                         _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
  };
  const __m256 a8 = half(a), b8 = half(b), c8 = half(c), d8 = half(d);
#else
  const __m256 a8 = (__m256)a, b8 = (__m256)b, c8 = (__m256)c, d8 = (__m256)d;
#endif
  // Per 128-bit half: a's, b's, c's and d's sums of its four lanes.
  const __m256 all = _mm256_hadd_ps(_mm256_hadd_ps(a8, b8), _mm256_hadd_ps(c8, d8));
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(all), _mm256_extractf128_ps(all, 1)));
#elif defined(MLXD_ISA_NEON)
  const float32x4_t ab = vpaddq_f32((float32x4_t)a, (float32x4_t)b);
  const float32x4_t cd = vpaddq_f32((float32x4_t)c, (float32x4_t)d);
  vst1q_f32(out, vpaddq_f32(ab, cd));
#else
  out[0] = hsum(a);
  out[1] = hsum(b);
  out[2] = hsum(c);
  out[3] = hsum(d);
#endif
}

inline float hmax(vf v) {
#if defined(MLXD_ISA_AVX512)
  return _mm512_reduce_max_ps((__m512)v);
#elif defined(MLXD_ISA_AVX2)
  __m128 m = _mm_max_ps(_mm256_castps256_ps128((__m256)v), _mm256_extractf128_ps((__m256)v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
#elif defined(MLXD_ISA_NEON)
  return vmaxvq_f32((float32x4_t)v);
#else
  const float a = v[0] > v[2] ? v[0] : v[2], b = v[1] > v[3] ? v[1] : v[3];
  return a > b ? a : b;
#endif
}

// Each lane rounded to the nearest integer, ties to even (lrintf in the default rounding mode).
inline vi round_to_int(vf v) {
#if defined(MLXD_ISA_AVX512)
  return (vi)_mm512_cvtps_epi32((__m512)v);
#elif defined(MLXD_ISA_AVX2)
  return (vi)_mm256_cvtps_epi32((__m256)v);
#elif defined(MLXD_ISA_NEON)
  return (vi)vcvtnq_s32_f32((float32x4_t)v);
#else
  vi out;
  for (int i = 0; i < W; ++i) {
    out[i] = int32_t(__builtin_lrintf(v[i]));
  }
  return out;
#endif
}

// W lanes in [-128, 127] stored as W bytes (narrowed by each ISA's instruction, as load_u8).
inline void store_i8(int8_t* p, vi v) {
#if defined(MLXD_ISA_AVX512)
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtsepi32_epi8((__m512i)v));
#elif defined(MLXD_ISA_AVX2)
  const __m256i wide = (__m256i)v;
  const __m128i halves = _mm_packs_epi32(_mm256_castsi256_si128(wide), _mm256_extracti128_si256(wide, 1));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(p), _mm_packs_epi16(halves, halves));
#else
  for (int i = 0; i < W; ++i) {
    p[i] = int8_t(v[i]);
  }
#endif
}

// A float scratch buffer (not std::vector: see the top of this file), 64-byte aligned.
class Scratch {
 public:
  explicit Scratch(size_t floats)
      : data_(static_cast<float*>(std::aligned_alloc(64, ((floats | 1) * sizeof(float) + 63) / 64 * 64))) {
    if (data_ == nullptr) {
      std::abort();  // as operator new would throw: out of memory inside a kernel
    }
  }
  ~Scratch() {
    std::free(data_);
  }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  float* data() const {
    return data_;
  }

 private:
  float* data_;
};

// W scales or biases as float32, from float32 or float16 (uint16_t bits).
template <typename S>
inline vf load_scales(const S* p) {
  if constexpr (sizeof(S) == 4) {
    return load(reinterpret_cast<const float*>(p));
  } else {
    return load_f16(p);
  }
}

// Calls f(std::integral_constant<int, count>) for 1 <= count <= MOST: kernels whose row count
// is a compile-time constant keep their accumulators in registers.
template <int MOST, typename F>
inline void with_rows(int count, F&& f) {
  if constexpr (MOST > 1) {
    if (count < MOST) {
      return with_rows<MOST - 1>(count, f);
    }
  }
  f(std::integral_constant<int, MOST>{});
}

// The hardware prefetcher alone streamed a decode step's weights at ≈10 GB/s of the ≈33 the
// machine reads: a kernel asks for block `block` (of 32 inputs, BLOCK_BYTES a tile) of each of
// work item g's tiles, and its scales, a few blocks before it reaches them (past the end:
// harmless). `p` is the kernel's Problem: `weights<BITS>(g, v)` and `scales(g, v, block)`.
// Always inlined: as a function of its own GCC 12 found it free of side effects and deleted
// its calls, and the module held no prefetch at all (tests/unit/test_kernel_build.py checks).
template <int BITS, int TILES, int V, int BLOCK_BYTES, typename P>
__attribute__((always_inline)) inline void prefetch_block(const P& p, int g, int block) {
  for (int t = 0; t < TILES; ++t) {
    const uint8_t* ahead = p.template weights<BITS>(g, t * V) + block * BLOCK_BYTES;
    for (int line = 0; line < BLOCK_BYTES; line += 64) {
      __builtin_prefetch(ahead + line);
    }
    __builtin_prefetch(p.scales(g, t * V, block));
  }
}

// Partial sums per accumulator: with fewer than 8 independent chains the multiply-adds cannot
// hide their latency, so inputs alternate between 2 or 4 sums while the registers allow.
constexpr int split_for(int chains, int accumulators) {
  int split = 1;
  while (split < 4 && chains * split < 8 && chains * split * 2 <= accumulators) {
    split *= 2;
  }
  return split;
}

inline int imin(int a, int b) {
  return a < b ? a : b;
}

inline int imax(int a, int b) {
  return a > b ? a : b;
}

}  // namespace MLXD_ISA
}  // namespace mlxd

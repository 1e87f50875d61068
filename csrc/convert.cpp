#include "convert.h"

#include <algorithm>
#include <atomic>
#include <bit>
#include <cmath>
#include <cstring>
#include <stdexcept>

#include "mlx/ops.h"
#include "parallel.h"

namespace mx = mlx::core;

namespace mlxd {

// GGUF's and MLX's words are little-endian; the conversions copy them in and out of integers with
// memcpy (a Q4_K byte pair, a 5-bit eight's 40 bits, Q5_0's fifth bits).
static_assert(std::endian::native == std::endian::little, "the conversions assume a little-endian CPU");

namespace {

constexpr int kLanes = 16;  // output rows per tile (mlxd/kernels/layout.py: LANES)

// Bytes b0..b3 hold 4-bit inputs k..k+7 in pairs (b0 = q0 | q1 << 4, …); the integer dot product
// wants byte i = q[k+i] | q[k+4+i] << 4.
inline uint32_t dot_nibbles(uint32_t word) {
  const uint32_t b0 = word & 0xFF, b1 = (word >> 8) & 0xFF;
  const uint32_t b2 = (word >> 16) & 0xFF, b3 = word >> 24;
  const uint32_t o0 = (b0 & 0xF) | ((b2 << 4) & 0xF0), o1 = (b0 >> 4) | (b2 & 0xF0);
  const uint32_t o2 = (b1 & 0xF) | ((b3 << 4) & 0xF0), o3 = (b1 >> 4) | (b3 & 0xF0);
  return o0 | o1 << 8 | o2 << 16 | o3 << 24;
}

inline bool is_half(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  const int exponent = static_cast<int>((bits >> 23) & 0xFF) - 127;
  const uint32_t mantissa = bits & 0x7FFFFF;
  if ((bits & 0x7FFFFFFF) == 0) {
    return true;
  }
  if (exponent > 15 || exponent < -24) {  // beyond float16's range, or below its least value
    return false;
  }
  // float16 keeps 10 mantissa bits at normal exponents, fewer below 2^-14.
  const int dropped = 13 + std::max(0, -14 - exponent);
  return (mantissa & ((1u << dropped) - 1)) == 0;
}

// Whether `value` rounds to a finite float16 (|value| below 65520, where rounding reaches inf).
inline bool rounds_to_half(float value) {
  return std::fabs(value) < 65520.0f;
}

// The float16 at `at` as a float32.
inline float half_at(const uint8_t* at) {
  uint16_t half;
  std::memcpy(&half, at, 2);
  const uint32_t sign = (half & 0x8000u) << 16, exponent = (half >> 10) & 0x1F;
  const uint32_t mantissa = half & 0x3FF;
  if (exponent == 0) {  // zero or subnormal: mantissa * 2^-24
    const float value = std::ldexp(static_cast<float>(mantissa), -24);
    return sign ? -value : value;
  }
  const uint32_t bits = sign | (exponent == 31 ? 0xFFu << 23 : (exponent + 112) << 23) |
      mantissa << 13;
  float value;
  std::memcpy(&value, &bits, 4);
  return value;
}

// A Q4_K or Q5_K block's (d, dmin, then 12 bytes of 6-bit scales and mins) 8 sub-blocks' MLX
// scales d * scale and biases -(dmin * min), as float32.
void k_scales(const uint8_t* block, float* scales, float* biases) {
  const float d = half_at(block), dmin = half_at(block + 2);
  const uint8_t* packed = block + 4;
  for (int j = 0; j < 8; ++j) {
    int scale, min;
    if (j < 4) {
      scale = packed[j] & 63;
      min = packed[j + 4] & 63;
    } else {
      scale = (packed[j + 4] & 0xF) | ((packed[j - 4] >> 6) << 4);
      min = (packed[j + 4] >> 4) | ((packed[j] >> 6) << 4);
    }
    scales[j] = d * static_cast<float>(scale);
    biases[j] = -(dmin * static_cast<float>(min));
  }
}

// 32 codes below 32 as MLX stores 5-bit values: a little-endian bit stream, every 8 codes in 5
// bytes.
void pack_fives(const uint8_t* codes, uint8_t* out) {
  for (int eight = 0; eight < 4; ++eight) {
    uint64_t word = 0;
    for (int i = 0; i < 8; ++i) {
      word |= static_cast<uint64_t>(codes[8 * eight + i]) << (5 * i);
    }
    std::memcpy(out + 5 * eight, &word, 5);  // its low 5 bytes (little-endian, as the file)
  }
}

// A legacy 5-bit block's codes (qh [4], then qs [16]): qs' low nibbles are values 0-15 and its
// high ones 16-31, bit j of the little-endian qh each value's fifth.
void legacy_fives(const uint8_t* at, uint8_t* out) {
  uint32_t qh;
  std::memcpy(&qh, at, 4);
  const uint8_t* qs = at + 4;
  uint8_t codes[32];
  for (int j = 0; j < 16; ++j) {
    codes[j] = static_cast<uint8_t>((qs[j] & 0xF) | (((qh >> j) & 1) << 4));
    codes[j + 16] = static_cast<uint8_t>((qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4));
  }
  pack_fives(codes, out);
}

// A Q8_0 block's 32 int8 codes as MLX's unsigned ones, q + 128: each with its sign bit flipped.
void flip_signs(const uint8_t* at, uint8_t* out) {
  for (int t = 0; t < 32; ++t) {
    out[t] = at[t] ^ 0x80;
  }
}

// A legacy 4-bit block's 16 bytes (values j in the low nibbles, j + 16 in the high ones) as MLX's
// (byte t holds values 2t and 2t + 1, the earlier in the low nibble).
void split_nibbles(const uint8_t* qs, uint8_t* out) {
  for (int t = 0; t < 8; ++t) {
    out[t] = static_cast<uint8_t>((qs[2 * t] & 0xF) | (qs[2 * t + 1] << 4));
    out[t + 8] = static_cast<uint8_t>((qs[2 * t] >> 4) | (qs[2 * t + 1] & 0xF0));
  }
}

// ggml's legacy blocks: a float16 scale d, a float16 minimum m where the format has one, then
// the codes, written as MLX's `kOutBytes` by `kCodes`. MLX's bias is m, or `kOffset` d (the
// codes are unsigned offsets from it).
template <
    int kBlockBytes,
    bool kMin,
    int kOffset,
    int kOutBytes,
    void (*kCodes)(const uint8_t*, uint8_t*)>
void legacy_to_affine(
    const uint8_t* src, int64_t blocks, uint8_t* words, float* scales, float* biases) {
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* block = src + b * kBlockBytes;
    const float d = half_at(block);
    scales[b] = d;
    biases[b] = kMin ? half_at(block + 2) : static_cast<float>(kOffset) * d;
    kCodes(block + (kMin ? 4 : 2), words + b * kOutBytes);
  }
}

// `tiles` tiles of 16 rows × `width` bytes into the layout tile_weights describes.
void tile_range(
    const uint8_t* src, uint8_t* dst, int64_t tiles, int64_t width, int bits, bool dot) {
  const int64_t tile_bytes = kLanes * width;
  for (int64_t t = 0; t < tiles; ++t) {
    const uint8_t* in = src + t * tile_bytes;
    uint8_t* out = dst + t * tile_bytes;
    if (!dot) {
      for (int64_t b = 0; b < width; ++b) {
        for (int lane = 0; lane < kLanes; ++lane) {
          out[b * kLanes + lane] = in[lane * width + b];
        }
      }
      continue;
    }
    const int64_t words = width / 4;
    for (int64_t w = 0; w < words; ++w) {
      for (int lane = 0; lane < kLanes; ++lane) {
        uint32_t word;
        std::memcpy(&word, in + lane * width + 4 * w, 4);
        if (bits == 4) {
          word = dot_nibbles(word);
        }
        std::memcpy(out + (w * kLanes + lane) * 4, &word, 4);
      }
    }
  }
}

// Whether every one of `count` scales and biases is a float16 (with `rounded`: rounds to a
// finite one).
bool all_fit_half(const float* scales, const float* biases, int64_t count, bool rounded) {
  const auto fits = rounded ? rounds_to_half : is_half;
  bool half = true;
  for (int64_t i = 0; i < count; ++i) {
    half = half && fits(scales[i]) && fits(biases[i]);
  }
  return half;
}

// `rows` rows of scales and biases as tile_scales lays them out, as float32 or float16 (MLX's
// conversion: rounded to nearest even).
template <typename T>
void lay_out_scales(
    const float* scales,
    const float* biases,
    T* dst,
    int64_t rows,
    int64_t groups,
    int64_t repeats) {
  for (int64_t tile = 0; tile < rows / kLanes; ++tile) {
    for (int64_t g = 0; g < groups; ++g) {
      for (int64_t r = 0; r < repeats; ++r) {
        T* out = dst + ((tile * groups + g) * repeats + r) * 2 * kLanes;
        for (int lane = 0; lane < kLanes; ++lane) {
          const int64_t at = (tile * kLanes + lane) * groups + g;
          out[lane] = static_cast<T>(scales[at]);
          out[kLanes + lane] = static_cast<T>(biases[at]);
        }
      }
    }
  }
}

}  // namespace

mx::array tile_weights(const mx::array& weight, int bits, bool dot, int threads) {
  if (weight.dtype() != mx::uint32 || weight.ndim() != 2 || weight.shape(0) % kLanes) {
    throw std::invalid_argument("tile_weights: uint32 weights [rows (a multiple of 16), words]");
  }
  if (bits != 4 && bits != 8) {
    throw std::invalid_argument("tile_weights: bits must be 4 or 8");
  }
  auto stream = mx::default_stream(mx::Device::cpu);
  return mx::array(
      {weight.shape(0), weight.shape(1) * 4},
      mx::uint8,
      std::make_shared<TileWeights>(stream, bits, dot, threads),
      {weight});
}

mx::array widen_weights(const mx::array& weight, int bits, int width, int threads) {
  const bool valid = (width == 4 && (bits == 2 || bits == 3)) || (width == 8 && (bits == 5 || bits == 6));
  if (!valid) {
    throw std::invalid_argument("widen_weights: bits 2 or 3 to width 4, or 5 or 6 to width 8");
  }
  // Eight values fill `bits` bytes: a row of whole words holds whole eights when its values
  // are a multiple of 32 (a quantization group's).
  if (weight.dtype() != mx::uint32 || weight.ndim() != 2 || (weight.shape(1) * 4) % bits) {
    throw std::invalid_argument("widen_weights: uint32 weights [rows, words], whole eights of values");
  }
  auto stream = mx::default_stream(mx::Device::cpu);
  return mx::array(
      {weight.shape(0), weight.shape(1) * width / bits},
      mx::uint32,
      std::make_shared<WidenWeights>(stream, bits, width, threads),
      {weight});
}

void WidenWeights::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  auto& encoder = prepare(inputs, outputs);
  encoder.dispatch([src = reinterpret_cast<const uint8_t*>(rows<uint32_t>(inputs[0], encoder)),
                    dst = reinterpret_cast<uint8_t*>(outputs[0].data<uint32_t>()),
                    eights = int64_t{inputs[0].shape(0)} * inputs[0].shape(1) * 4 / bits_,
                    bits = bits_,
                    width = width_,
                    threads = threads_]() {
    // Rows hold whole eights, so the rows' streams are one stream of eights.
    const uint64_t mask = (uint64_t{1} << bits) - 1;
    parallel_for(threads, eights, [&](int64_t begin, int64_t end) {
      for (int64_t e = begin; e < end; ++e) {
        uint64_t stream = 0;
        std::memcpy(&stream, src + e * bits, bits);
        uint8_t* out = dst + e * width;  // 8 values at `width` bits: `width` bytes
        if (width == 8) {
          for (int k = 0; k < 8; ++k) {
            out[k] = static_cast<uint8_t>((stream >> (bits * k)) & mask);
          }
        } else {
          for (int k = 0; k < 4; ++k) {
            out[k] = static_cast<uint8_t>(
                ((stream >> (bits * 2 * k)) & mask) | (((stream >> (bits * (2 * k + 1))) & mask) << 4));
          }
        }
      }
    });
  });
}

void TileWeights::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  auto& encoder = prepare(inputs, outputs);
  const int64_t width = inputs[0].shape(1) * 4;
  // Whole words: a strided input is copied word by word, then read as its bytes.
  encoder.dispatch([src = reinterpret_cast<const uint8_t*>(rows<uint32_t>(inputs[0], encoder)),
                    dst = outputs[0].data<uint8_t>(),
                    tiles = int64_t{inputs[0].shape(0)} / kLanes,
                    width,
                    bits = bits_,
                    dot = dot_,
                    threads = threads_]() {
    parallel_for(threads, tiles, [&](int64_t begin, int64_t end) {
      const int64_t at = begin * kLanes * width;
      tile_range(src + at, dst + at, end - begin, width, bits, dot);
    });
  });
}

std::vector<mx::array> tile_scales(
    const mx::array& scales, const mx::array& biases, int repeats, bool rounded, int threads) {
  if (scales.dtype() != mx::float32 || biases.dtype() != mx::float32 || scales.ndim() != 2 ||
      scales.shape() != biases.shape() || scales.shape(0) % kLanes || repeats < 1) {
    throw std::invalid_argument(
        "tile_scales: float32 scales and biases [rows (a multiple of 16), groups], repeats >= 1");
  }
  auto stream = mx::default_stream(mx::Device::cpu);
  const int tiles = scales.shape(0) / kLanes, groups = scales.shape(1) * repeats;
  const mx::Shape tiled{tiles, groups, 2, kLanes};
  return mx::array::make_arrays(
      {tiled, tiled, {}},
      {mx::float16, mx::float32, mx::bool_},
      std::make_shared<TileScales>(stream, repeats, rounded, threads),
      {scales, biases});
}

void TileScales::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  auto& encoder = prepare(inputs, outputs);
  const int64_t groups = inputs[0].shape(1);
  // Only the layout written is touched: the other output's pages are never faulted in.
  encoder.dispatch([scales = rows<float>(inputs[0], encoder),
                    biases = rows<float>(inputs[1], encoder),
                    halves = outputs[0].data<mx::float16_t>(),
                    floats = outputs[1].data<float>(),
                    half = outputs[2].data<bool>(),
                    tiles = int64_t{inputs[0].shape(0)} / kLanes,
                    groups,
                    repeats = int64_t{repeats_},
                    rounded = rounded_,
                    threads = threads_]() {
    std::atomic<bool> all_half{true};
    parallel_for(threads, tiles, [&](int64_t begin, int64_t end) {
      const int64_t from = begin * kLanes * groups, count = (end - begin) * kLanes * groups;
      if (!all_fit_half(scales + from, biases + from, count, rounded)) {
        all_half.store(false, std::memory_order_relaxed);
      }
    });
    *half = all_half.load();
    parallel_for(threads, tiles, [&](int64_t begin, int64_t end) {
      const int64_t from = begin * kLanes * groups, at = begin * groups * repeats * 2 * kLanes;
      const int64_t rows = (end - begin) * kLanes;
      if (*half) {
        lay_out_scales(scales + from, biases + from, halves + at, rows, groups, repeats);
      } else {
        lay_out_scales(scales + from, biases + from, floats + at, rows, groups, repeats);
      }
    });
  });
}

std::pair<double, double> q6_k_to_affine8(
    const uint8_t* src, int64_t blocks, uint8_t* codes, float* scales, float* biases) {
  constexpr int kBlock = 256, kBlockBytes = 210, kGroup = 32;
  double error = 0, norm = 0;
  float values[kBlock];
  for (int64_t b = 0; b < blocks; ++b) {
    // ggml's layout: ql [128] low nibbles, qh [64] high bit pairs, int8 scales [16], float16 d.
    const uint8_t* block = src + b * kBlockBytes;
    const uint8_t* ql = block;
    const uint8_t* qh = block + 128;
    const int8_t* sc = reinterpret_cast<const int8_t*>(block + 192);
    const float d = half_at(block + 208);
    for (int half = 0; half < 2; ++half) {
      const uint8_t* h = qh + 32 * half;
      // Quarter q of the half: values 32q..32q+31, the low (q < 2) or high nibbles of ql's
      // bytes 32(q % 2).., and bits 2q, 2q+1 of qh's 32 bytes; a scale every 16 values. Loops
      // of one shift each, which the compiler vectorises (interleaved, they were not).
      for (int q = 0; q < 4; ++q) {
        const uint8_t* l = ql + 64 * half + 32 * (q % 2);
        const int low = 4 * (q / 2), high = 2 * q;
        for (int part = 0; part < 2; ++part) {
          const float scale = d * sc[8 * half + 2 * q + part];
          float* y = values + 128 * half + 32 * q + 16 * part;
          const int at = 16 * part;
          for (int i = 0; i < 16; ++i) {
            const int code = ((l[at + i] >> low) & 0xF) | (((h[at + i] >> high) & 3) << 4);
            y[i] = scale * static_cast<float>(code - 32);
          }
        }
      }
    }
    for (int g = 0; g < kBlock / kGroup; ++g) {
      const float* v = values + g * kGroup;
      float lo = v[0], hi = v[0];
      for (int i = 1; i < kGroup; ++i) {
        lo = std::min(lo, v[i]);
        hi = std::max(hi, v[i]);
      }
      const float scale = (hi - lo) / 255.0f;
      const float inverse = scale > 0 ? 1.0f / scale : 0.0f;
      uint8_t* q = codes + (b * kBlock + g * kGroup);
      float group_error = 0, group_norm = 0;
      for (int i = 0; i < kGroup; ++i) {
        // Round half up (x is at least 0.5): a conversion, not a libm call, on the baseline ISA
        // this file is compiled for; clamped before it (a corrupt block's NaN or infinity).
        const float x = (v[i] - lo) * inverse + 0.5f;
        const int code = x < 255.0f ? (x > 0.0f ? static_cast<int>(x) : 0) : 255;
        q[i] = static_cast<uint8_t>(code);
        const float back = static_cast<float>(code) * scale + lo - v[i];
        group_error += back * back;
        group_norm += v[i] * v[i];
      }
      error += group_error;
      norm += group_norm;
      scales[b * 8 + g] = scale;
      biases[b * 8 + g] = lo;
    }
  }
  return {error, norm};
}

void q4_k_to_affine4(
    const uint8_t* src, int64_t blocks, uint8_t* words, float* scales, float* biases) {
  constexpr int kBlockBytes = 144;
  for (int64_t b = 0; b < blocks; ++b) {
    // ggml's layout: d, dmin (float16), 12 bytes of 6-bit scales and mins, qs [128].
    const uint8_t* block = src + b * kBlockBytes;
    k_scales(block, scales + b * 8, biases + b * 8);
    const uint8_t* qs = block + 16;
    for (int c = 0; c < 4; ++c) {
      // Sub-blocks 2c and 2c + 1: the low and the high nibbles of 32 bytes; MLX's byte t holds
      // values 2t and 2t + 1, the earlier in the low nibble. Bytes 2t and 2t + 1 are read as one
      // little-endian word, both sub-blocks from it: loops the compiler vectorises (byte loads a
      // stride apart, one sub-block at a time, it did not).
      const uint8_t* in = qs + 32 * c;
      uint8_t* low = words + b * 128 + 32 * c;
      uint8_t* high = low + 16;
      for (int t = 0; t < 16; ++t) {
        uint16_t pair;
        std::memcpy(&pair, in + 2 * t, 2);
        low[t] = static_cast<uint8_t>((pair & 0xF) | ((pair >> 4) & 0xF0));
        high[t] = static_cast<uint8_t>(((pair >> 4) & 0xF) | ((pair >> 8) & 0xF0));
      }
    }
  }
}

void q5_k_to_affine5(
    const uint8_t* src, int64_t blocks, uint8_t* words, float* scales, float* biases) {
  constexpr int kBlockBytes = 176;
  for (int64_t b = 0; b < blocks; ++b) {
    // ggml's layout: d, dmin (float16), 12 bytes of 6-bit scales and mins, qh [32], qs [128].
    const uint8_t* block = src + b * kBlockBytes;
    k_scales(block, scales + b * 8, biases + b * 8);
    const uint8_t* qh = block + 16;
    const uint8_t* qs = block + 48;
    for (int j = 0; j < 8; ++j) {
      // Sub-block j: Q4_K's nibbles, and bit j of qh[l] the fifth bit of its value l.
      const uint8_t* in = qs + 32 * (j / 2);
      const int shift = 4 * (j % 2);
      uint8_t codes[32];
      for (int l = 0; l < 32; ++l) {
        codes[l] = static_cast<uint8_t>(((in[l] >> shift) & 0xF) | (((qh[l] >> j) & 1) << 4));
      }
      pack_fives(codes, words + b * 160 + 20 * j);
    }
  }
}

const Conversion q4_0_to_affine4 = legacy_to_affine<18, false, -8, 16, split_nibbles>;
const Conversion q4_1_to_affine4 = legacy_to_affine<20, true, 0, 16, split_nibbles>;
const Conversion q5_0_to_affine5 = legacy_to_affine<22, false, -16, 20, legacy_fives>;
const Conversion q5_1_to_affine5 = legacy_to_affine<24, true, 0, 20, legacy_fives>;
const Conversion q8_0_to_affine8 = legacy_to_affine<34, false, -128, 32, flip_signs>;

}  // namespace mlxd

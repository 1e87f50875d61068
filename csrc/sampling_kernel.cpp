// A token per row of logits, drawn in a few passes over the row, per ISA variant (the MLX op
// around it: sampling.cpp).
//
// The nucleus is mlx-lm's `apply_top_p` on the untempered distribution: a token is kept when
// the tokens more likely than it hold less than top_p of the mass (ties at the threshold are
// all kept). Sorting the row to find it cost more than the rest of a decode step's sampling;
// here its threshold is found from a histogram of the mass by distance below the row's maximum
// (STEPS buckets a nat): the buckets above the one where the mass reaches top_p are kept whole,
// and only that bucket's tokens are looked at more closely (split again while they are many).
// Then the kept tokens' tempered weights e^((x - max) / T) are summed in chunks, and the token
// is the first whose cumulative weight passes u · total, in index order.
//
// Passes over a row: its maximum; the histogram (top_p < 1 only); a few over the crossing
// bucket's tokens (mostly compares: only vectors holding one do more); the weights' chunk
// sums; one chunk again. Rows run in parallel; a row needs its stack and a float a chunk.

#include <cmath>
#include <limits>

#include "exp.h"
#include "parallel.h"
#include "simd.h"
#include "variant.h"

namespace mlxd {
namespace MLXD_ISA {

namespace {

constexpr float INF = std::numeric_limits<float>::infinity();
constexpr float UNDERFLOW = -87.0f;  // exp_nonpositive's range

// The histogram's buckets: STEPS a nat below the maximum, as far as the nucleus can reach (see
// reach()), at most NATS nats: V e^-40 is below float32's 2^-24, the least 1 - top_p can be.
// The tokens further below (-inf among them) only add to the total.
constexpr int STEPS = 8, NATS = 40, FAR = STEPS * NATS;
// Lanes add into this many copies of a histogram in turn, so that the adds of tokens in one
// bucket (all of a flat row's) do not wait on each other.
constexpr int COPIES = 4;
// A crossing bucket's tokens are split this many ways while more than CAPACITY, then sorted.
constexpr int SPLIT = 64, CAPACITY = 128;
// Tokens per partial sum (whole vectors): float sums stay short, and a chunk fits the stack.
constexpr int CHUNK = 1024;
static_assert(CHUNK % W == 0, "a chunk is whole vectors");

// e^z for z <= 0, exactly 0 below float32's normal range (a masked -inf is never drawn).
inline vf weight(vf z) {
  const vf e = exp_nonpositive(z);
  return z < UNDERFLOW ? vf{} : e;
}

// A comparison's mask as bits, lane i's at bit i.
inline unsigned bits(vi mask) {
#if defined(MLXD_ISA_AVX512)
  return _mm512_test_epi32_mask((__m512i)mask, (__m512i)mask);
#elif defined(MLXD_ISA_AVX2)
  return _mm256_movemask_ps((__m256)mask);
#elif defined(MLXD_ISA_NEON)
  const uint32x4_t weights = {1, 2, 4, 8};
  return vaddvq_u32(vandq_u32((uint32x4_t)mask, weights));
#else
  unsigned set = 0;
  for (int lane = 0; lane < W; ++lane) {
    set |= unsigned(mask[lane] & 1) << lane;
  }
  return set;
#endif
}

inline float hmin(vf v) {
  return -hmax(-v);
}

// f(i, v) for the vectors of x[begin, end), v holding x[i, i + W); the last one padded with
// -inf (no mass, no weight, below any threshold).
template <typename F>
inline void each_vector(const float* x, int begin, int end, F&& f) {
  int i = begin;
  for (; i + W <= end; i += W) {
    f(i, load(x + i));
  }
  if (i < end) {
    float tail[W];
    for (int lane = 0; lane < W; ++lane) {
      tail[lane] = i + lane < end ? x[i + lane] : -INF;
    }
    f(i, load(tail));
  }
}

float row_max(const float* x, int V) {
  vf tops = vf{} - INF;
  each_vector(x, 0, V, [&](int, vf v) { tops = v > tops ? v : tops; });
  return hmax(tops);
}

#if defined(MLXD_ISA_AVX2)
// For each mask of 8 lanes, the set lanes' indices first: AVX2's stand-in for a compress.
struct PackOrder {
  uint8_t lanes[256][8];
};

constexpr PackOrder pack_order() {
  PackOrder order{};
  for (int set = 0; set < 256; ++set) {
    int n = 0;
    for (int lane = 0; lane < 8; ++lane) {
      if ((set >> lane) & 1) {
        order.lanes[set][n++] = uint8_t(lane);
      }
    }
  }
  return order;
}

constexpr PackOrder PACK_ORDER = pack_order();
#endif

// The lanes set in `in` packed to the front of bin_out and e_out (room for W each): their count.
// No branch on the lanes: which are set is as random as the logits.
inline int pack(vi in, vi bin, vf e, int32_t* bin_out, float* e_out) {
#if defined(MLXD_ISA_AVX512)
  const __mmask16 set = _mm512_test_epi32_mask((__m512i)in, (__m512i)in);
  _mm512_storeu_si512(bin_out, _mm512_maskz_compress_epi32(set, (__m512i)bin));
  _mm512_storeu_ps(e_out, _mm512_maskz_compress_ps(set, (__m512)e));
  return __builtin_popcount(set);
#elif defined(MLXD_ISA_AVX2)
  const unsigned set = _mm256_movemask_ps((__m256)in);
  const __m256i order = _mm256_cvtepu8_epi32(
      _mm_loadl_epi64(reinterpret_cast<const __m128i*>(PACK_ORDER.lanes[set])));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(bin_out),
                      _mm256_permutevar8x32_epi32((__m256i)bin, order));
  _mm256_storeu_ps(e_out, _mm256_permutevar8x32_ps((__m256)e, order));
  return __builtin_popcount(set);
#else
  int32_t mask[W], at[W];
  float values[W];
  std::memcpy(mask, &in, sizeof(mask));
  std::memcpy(at, &bin, sizeof(at));
  std::memcpy(values, &e, sizeof(values));
  int n = 0;
  for (int lane = 0; lane < W; ++lane) {
    bin_out[n] = at[lane];
    e_out[n] = values[lane];
    n += mask[lane] & 1;
  }
  return n;
#endif
}

// Sums of e by bin in double (the sums decide which tokens are kept to a relative 1e-7, as
// float64 does). Lanes are queued (pack) and added QUEUE at a time, into COPIES copies in turn.
template <int BINS>
class Bins {
 public:
  // Adds the lanes of e set in `in`, each to its lane's bin.
  void add(vi in, vi bin, vf e) {
    queued_ += pack(in, bin, e, bin_ + queued_, e_ + queued_);
    if (queued_ >= QUEUE) {
      drain();
    }
  }
  void sum(double* out, int bins) {
    drain();
    for (int b = 0; b < bins; ++b) {
      out[b] = 0.0;
      for (int c = 0; c < COPIES; ++c) {
        out[b] += copies_[c][b];
      }
    }
  }

 private:
  static constexpr int QUEUE = 256;

  void drain() {
    for (int i = 0; i < queued_; ++i) {
      copies_[i % COPIES][bin_[i]] += e_[i];
    }
    queued_ = 0;
  }

  double copies_[COPIES][BINS] = {};
  int32_t bin_[QUEUE + W];
  float e_[QUEUE + W];
  int queued_ = 0;
};

// How many buckets the nucleus can reach: the tokens further than ln(V / (1 - top_p)) nats below
// the maximum (plus one, for the exponential's rounding) hold less than 1 - top_p of the mass,
// so the mass above them is more than top_p.
int reach(int V, float top_p) {
  const double nats = std::log(V / (1.0 - top_p)) + 1.0;
  return imax(1, imin(FAR, int(std::ceil(nats * STEPS))));
}

// The histogram bucket of each lane: n past the last (a NaN too).
inline vi bucket_of(vf v, float top, int n) {
  const vf at = (top - v) * float(STEPS);
  return __builtin_convertvector(at < float(n) ? at : vf{} + float(n), vi);
}

// mass[b] = Σ e^(x - top) over the row's tokens in bucket b < n; mass[n]: the rest's, in float
// sums a chunk (then in double).
void histogram(const float* x, int V, float top, int n, double* mass) {
  Bins<FAR> bins;
  double rest = 0.0;
  for (int begin = 0; begin < V; begin += CHUNK) {
    vf far = {};
    each_vector(x, begin, imin(V, begin + CHUNK), [&](int, vf v) {
      const vf e = weight(v - top);
      const vi b = bucket_of(v, top, n), in = b < n;
      far += in ? vf{} : e;
      bins.add(in, b, e);
    });
    rest += hsum(far);
  }
  bins.sum(mass, n);
  mass[n] = rest;
}

// Where the mass reaches `target`, walking buckets from the top (`above`: the mass before the
// first): the first bucket with mass that it reaches in, and the mass above that bucket. Summed
// in another order than their total, the buckets may fall short by a rounding: then the last
// bucket with mass.
struct Crossing {
  int bucket;
  double above;
};

Crossing crossing(const double* mass, int n, double above, double target) {
  Crossing last{0, above};
  for (int b = 0; b < n; ++b) {
    if (mass[b] > 0.0) {
      last = {b, above};
      if (above + mass[b] >= target) {
        break;
      }
    }
    above += mass[b];
  }
  return last;
}

// The tokens of values in [low, high], `count` of them. Those of one bucket, or of one part of
// a split, are one such range: bins follow values (higher values, lower bins).
struct Range {
  float low, high;
  int count;

  vi member(vf v) const {
    return (v >= low) & (v <= high);
  }
  // Each member's part of SPLIT (by division, not a product with SPLIT / (high - low): that
  // overflows for a range of a few denormals, where every value would fall in one part).
  vi part(vf v) const {
    vf at = (high - v) / (high - low) * float(SPLIT);
    at = at > 0.0f ? at : vf{};
    return __builtin_convertvector(at < float(SPLIT - 1) ? at : vf{} + float(SPLIT - 1), vi);
  }
};

// The range of the row's tokens where `member` holds (a mask per lane).
template <typename Member>
Range range_of(const float* x, int V, Member&& member) {
  vf low = vf{} + INF, high = vf{} - INF;
  vi count = {};
  each_vector(x, 0, V, [&](int, vf v) {
    const vi in = member(v);
    // Selected before compared: the sums' chains are then a min and a max, no more.
    const vf below = in ? v : vf{} + INF, above = in ? v : vf{} - INF;
    low = below < low ? below : low;
    high = above > high ? above : high;
    count -= in;
  });
  int total = 0;
  for (int lane = 0; lane < W; ++lane) {
    total += count[lane];
  }
  return {hmin(low), hmax(high), total};
}

// mass[j] = Σ e^(x - top) over `r`'s tokens in part j of SPLIT.
void split(const float* x, int V, float top, const Range& r, double* mass) {
  Bins<SPLIT> bins;
  each_vector(x, 0, V, [&](int, vf v) {
    const vi in = r.member(v);
    if (bits(in) != 0) {  // most vectors hold no member, or (a flat row's) all lanes do
      bins.add(in, r.part(v), weight(v - top));
    }
  });
  bins.sum(mass, SPLIT);
}

// r's tokens' values (r.count <= CAPACITY).
void collect(const float* x, int V, const Range& r, float* members) {
  int n = 0;
  each_vector(x, 0, V, [&](int, vf v) {
    for (unsigned lanes = bits(r.member(v)); lanes != 0 && n < CAPACITY; lanes &= lanes - 1) {
      members[n++] = v[__builtin_ctz(lanes)];
    }
  });
}

void sort_descending(float* values, int n) {
  for (int i = 1; i < n; ++i) {
    const float value = values[i];
    int j = i;
    for (; j > 0 && values[j - 1] < value; --j) {
      values[j] = values[j - 1];
    }
    values[j] = value;
  }
}

// The threshold among the last few candidates: each lower value is kept while the mass above
// it (`above` and the higher candidates') is short of `target`. The first is always kept (the
// mass above the crossing bucket is short of it).
float threshold_among(float* members, int n, float top, double above, double target) {
  sort_descending(members, n);
  float masses[CAPACITY + W];
  each_vector(members, 0, n, [&](int i, vf v) { store(masses + i, weight(v - top)); });
  float threshold = members[0];
  for (int i = 0; i < n; ++i) {
    if (members[i] < threshold) {
      if (above >= target) {
        break;
      }
      threshold = members[i];
    }
    above += masses[i];
  }
  return threshold;
}

// The lowest logit in the row's top_p nucleus: the histogram's crossing bucket, split while its
// tokens are many and not all one value.
float nucleus_threshold(const float* x, int V, float top, float top_p) {
  const int n = reach(V, top_p);
  double mass[FAR + 1];
  histogram(x, V, top, n, mass);
  double total = 0.0;
  for (int b = 0; b <= n; ++b) {
    total += mass[b];
  }
  const double target = double(top_p) * total;
  Crossing at = crossing(mass, n, 0.0, target);
  Range r = range_of(x, V, [&](vf v) { return bucket_of(v, top, n) == at.bucket; });
  while (r.count > CAPACITY && r.low < r.high) {
    double parts[SPLIT];
    split(x, V, top, r, parts);
    at = crossing(parts, SPLIT, at.above, target);
    const Range whole = r;
    r = range_of(x, V, [&](vf v) { return whole.member(v) & (whole.part(v) == at.bucket); });
  }
  if (r.low == r.high) {  // one value: kept, as the top of every crossing is
    return r.high;
  }
  float members[CAPACITY];
  collect(x, V, r, members);
  return threshold_among(members, r.count, top, at.above, target);
}

// The kept tokens' tempered weights e^((x - top) · inv_temperature) of x[begin, end), W lanes at
// a time: into w (when given), and their sum.
float weights(const float* x, int begin, int end, float top, float inv_temperature,
              float threshold, float* w) {
  vf sum = {};
  each_vector(x, begin, end, [&](int i, vf v) {
    const vi in = v >= threshold;
    // A nucleus is a few tokens: most vectors hold none, and skip the exponential.
    const vf kept = bits(in) != 0 ? (in ? weight((v - top) * inv_temperature) : vf{}) : vf{};
    sum += kept;
    if (w != nullptr) {
      store(w + (i - begin), kept);
    }
  });
  return hsum(sum);
}

// The first token of chunk [begin, end) whose cumulative weight, after `before`, passes
// `target`; when rounding leaves none, the chunk's last token with a weight.
int pick_in_chunk(const float* x, int begin, int end, float top, float inv_temperature,
                  float threshold, double before, double target) {
  float w[CHUNK];
  weights(x, begin, end, top, inv_temperature, threshold, w);
  int last = begin;
  for (int i = begin; i < end; ++i) {
    const float wi = w[i - begin];
    if (wi > 0.0f) {
      before += wi;
      if (before > target) {
        return i;
      }
      last = i;
    }
  }
  return last;
}

// The draw among the tokens at or above `threshold`: chunk sums (into `sums`), the chunk where
// u · total falls, the token within it.
int draw(const float* x, int V, float top, float inv_temperature, float threshold, float u,
         float* sums) {
  const int chunks = (V + CHUNK - 1) / CHUNK;
  double total = 0.0;
  for (int c = 0; c < chunks; ++c) {
    sums[c] = weights(x, c * CHUNK, imin(V, (c + 1) * CHUNK), top, inv_temperature, threshold,
                      nullptr);
    total += sums[c];
  }
  // The chunk where the cumulative weight passes u · total; when rounding leaves none, the
  // last chunk with a weight (the row's maximum has one).
  const double target = double(u) * total;
  double before = 0.0, before_chosen = 0.0;
  int chosen = 0;
  for (int c = 0; c < chunks; ++c) {
    if (sums[c] > 0.0f) {
      chosen = c;
      before_chosen = before;
      if (before + sums[c] > target) {
        break;
      }
    }
    before += sums[c];
  }
  return pick_in_chunk(x, chosen * CHUNK, imin(V, (chosen + 1) * CHUNK), top, inv_temperature,
                       threshold, before_chosen, target);
}

// The first token holding `top`, the row's maximum.
int first_at(const float* x, int V, float top) {
  int i = 0;
  for (; i + W <= V; i += W) {
    if (const unsigned at = bits(load(x + i) == top)) {
      return i + __builtin_ctz(at);
    }
  }
  for (; i < V && x[i] != top; ++i) {
  }
  return i;
}

int sample_row(const float* x, int V, float inv_temperature, float top_p, float u, float* sums) {
  const float top = row_max(x, V);
  if (!(top > -INF)) {  // every token masked (or NaN): nothing to draw from
    return 0;
  }
  if (inv_temperature == INF) {  // temperature 0: the argmax, as mx.argmax (the first maximum)
    return first_at(x, V, top);
  }
  const float threshold = top_p < 1.0f ? nucleus_threshold(x, V, top, top_p) : -INF;
  return draw(x, V, top, inv_temperature, threshold, u, sums);
}

}  // namespace

void sample(const float* logits, const float* inv_temperature, const float* top_p,
            const float* u, uint32_t* tokens, int rows, int V, int threads) {
  parallel_for(threads, rows, [&](int64_t first, int64_t last) {
    Scratch sums((V + CHUNK - 1) / CHUNK);
    for (int64_t r = first; r < last; ++r) {
      tokens[r] = uint32_t(
          sample_row(logits + r * int64_t(V), V, inv_temperature[r], top_p[r], u[r], sums.data()));
    }
  });
}

}  // namespace MLXD_ISA
}  // namespace mlxd

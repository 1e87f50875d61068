// The aarch64 variants of mlxd's kernels (generic, neon, neondot) against scalar float64 references,
// built with Debian's cross compiler and run under qemu-user by tests/unit/test_kernel_neon.py:
// no ARM machine is at hand, and the Python tests run the variants of the machine they run on.
// The packed layouts are mlxd.kernels.pack's and pack_dot's (see csrc/qmatmul.cpp, qdot.cpp).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>
#include "kernels.h"
namespace mlxd { extern const Kernels kernels_generic, kernels_neon, kernels_neondot; }
using namespace mlxd;
static uint16_t to_half(float f) {  // exact for the scales and biases used (k / 2^n)
  __fp16 h = static_cast<__fp16>(f); uint16_t b; std::memcpy(&b, &h, 2); return b; }
int check(const Kernels& k) {
  int bad = 0; srand(1);
  for (int bits : {4, 8}) for (int K : {64, 576}) for (int G : {32, 64}) for (int M : {1, 3, 7, 9, 33, 40}) {
    const int N = 64, levels = bits == 4 ? 16 : 256;
    std::vector<uint8_t> q(N * K); for (auto& v : q) v = rand() % levels;
    std::vector<float> x(M * K); for (auto& v : x) v = (rand() % 2001 - 1000) / 1000.0f;
    std::vector<float> sc(N * (K / G)), bi(N * (K / G));  // a scale and bias per G inputs
    for (auto& v : sc) v = (rand() % 64 + 1) / 1024.0f; for (auto& v : bi) v = -(rand() % 64) / 256.0f;
    // pack: tiles of 16 rows; per k (8 bits) or pair (4 bits) 16 bytes; per tile, group: 16 scales, 16 biases
    std::vector<uint8_t> w(N * K * bits / 8); size_t at = 0;
    for (int t = 0; t < N / 16; ++t) {
      if (bits == 8) for (int kk = 0; kk < K; ++kk) for (int j = 0; j < 16; ++j) w[at++] = q[(t*16+j)*K+kk];
      else for (int kk = 0; kk < K; kk += 2) for (int j = 0; j < 16; ++j) w[at++] = q[(t*16+j)*K+kk] | q[(t*16+j)*K+kk+1] << 4;
    }
    std::vector<uint16_t> sb(N * (K / G) * 2);
    for (int t = 0; t < N / 16; ++t) for (int b = 0; b < K / G; ++b) for (int j = 0; j < 16; ++j) {
      sb[((t*(K/G)+b)*2+0)*16+j] = to_half(sc[(t*16+j)*(K/G)+b]);
      sb[((t*(K/G)+b)*2+1)*16+j] = to_half(bi[(t*16+j)*(K/G)+b]);
    }
    std::vector<float> y(M * N);
    auto float_error = [&]() {  // y against x @ dequantize(q)^T in float64
      double worst = 0;
      for (int m = 0; m < M; ++m) for (int n = 0; n < N; ++n) {
        double ref = 0; for (int kk = 0; kk < K; ++kk) ref += x[m*K+kk] * (double(sc[n*(K/G)+kk/G]) * q[n*K+kk] + bi[n*(K/G)+kk/G]);
        worst = std::fmax(worst, std::fabs(ref - y[m*N+n]));
      }
      return worst;
    };
    k.qmatmul_f16(x.data(), w.data(), sb.data(), y.data(), M, N, K, bits, G, 2);
    double worst = float_error();
    if (worst > 1e-3) { printf("%s qmatmul bits %d K %d G %d M %d: error %g\n", k.isa, bits, K, G, M, worst); ++bad; }
    // qdot: pack_dot's layout (per tile 4 inputs of a row per 32-bit lane; 4 bits: k+4..k+7 in the high nibbles)
    // against float64 with x rounded to int8 per block of 32 as the kernel does (d = max |x| / 127).
    std::vector<uint8_t> wd(N * K * bits / 8); at = 0;
    for (int t = 0; t < N / 16; ++t) {
      if (bits == 8) for (int kk = 0; kk < K; kk += 4) for (int j = 0; j < 16; ++j) for (int i = 0; i < 4; ++i) wd[at++] = q[(t*16+j)*K+kk+i];
      else for (int kk = 0; kk < K; kk += 8) for (int j = 0; j < 16; ++j) for (int i = 0; i < 4; ++i) wd[at++] = q[(t*16+j)*K+kk+i] | q[(t*16+j)*K+kk+4+i] << 4;
    }
    for (bool precise : {false, true}) {  // x as one int8 term, or two (the rest in steps of d / 254)
      std::vector<double> xr(M * K);
      for (int m = 0; m < M; ++m) for (int b = 0; b < K / 32; ++b) {
        float amax = 0; for (int i = 0; i < 32; ++i) amax = std::fmax(amax, std::fabs(x[m*K+b*32+i]));
        const float inverse = amax > 0 ? 127 / amax : 0, step = amax / 127;
        for (int i = 0; i < 32; ++i) {
          const float v = x[m*K+b*32+i], x8 = std::lrint(v * inverse);
          const double rest = precise ? std::fmax(-127, std::fmin(127, std::lrint((v - x8 * step) * inverse * 254))) : 0;
          xr[m*K+b*32+i] = x8 * double(step) + rest * double(step / 254);
        }
      }
      k.qdot_f16(x.data(), wd.data(), sb.data(), y.data(), M, N, K, bits, G, precise, 0, 2);
      worst = 0;
      for (int m = 0; m < M; ++m) for (int n = 0; n < N; ++n) {
        double ref = 0; for (int kk = 0; kk < K; ++kk) ref += (double(sc[n*(K/G)+kk/G]) * q[n*K+kk] + bi[n*(K/G)+kk/G]) * xr[m*K+kk];
        worst = std::fmax(worst, std::fabs(ref - y[m*N+n]));
      }
      if (worst > 1e-3) { printf("%s qdot bits %d K %d G %d M %d precise %d: error %g\n", k.isa, bits, K, G, M, precise, worst); ++bad; }
    }
    // From `buffer_rows` rows on (here M): the float path's buffered passes on pack_dot's layout, x not rounded.
    k.qdot_f16(x.data(), wd.data(), sb.data(), y.data(), M, N, K, bits, G, false, M, 2);
    worst = float_error();
    if (worst > 1e-3) { printf("%s qdot buffered bits %d K %d G %d M %d: error %g\n", k.isa, bits, K, G, M, worst); ++bad; }
  }
  // attention: decode and tiled prefill, causal, D 64; float32 K/V, then float16 (a 16-bit cache)
  for (bool half : {false, true}) for (int Lq : {1, 12}) {
    const int B = 1, Hq = 4, Hkv = 2, Lk = 37, D = 64;
    std::vector<float> q(B*Hq*Lq*D), kk(B*Hkv*Lk*D), v(B*Hkv*Lk*D), y(B*Hq*Lq*D);
    for (auto* a : {&q, &kk, &v}) for (auto& e : *a) e = (rand() % 2001 - 1000) / 1000.0f;
    std::vector<uint16_t> kh(kk.size()), vh(v.size());
    if (half) {  // the reference sees the halves' values
      for (size_t e = 0; e < kk.size(); ++e) { kh[e] = to_half(kk[e]); kk[e] = float(static_cast<__fp16>(kk[e])); }
      for (size_t e = 0; e < v.size(); ++e) { vh[e] = to_half(v[e]); v[e] = float(static_cast<__fp16>(v[e])); }
    }
    const void* kp = half ? static_cast<const void*>(kh.data()) : kk.data();
    const void* vp = half ? static_cast<const void*>(vh.data()) : v.data();
    AttentionArgs a{q.data(), kp, vp, y.data(), {Hq*Lq*D, Lq*D, D}, {Hkv*Lk*D, Lk*D, D}, {Hkv*Lk*D, Lk*D, D},
                    nullptr, {0,0,0,0}, false, true, half, false, B, Hq, Lq, D, Hkv, Lk, D, 0.125f};
    k.attention(a, 2);
    double worst = 0;
    for (int h = 0; h < Hq; ++h) for (int i = 0; i < Lq; ++i) {
      const int hk = h / (Hq / Hkv), vis = Lk - Lq + i + 1; std::vector<double> s(vis); double top = -1e30, sum = 0;
      for (int j = 0; j < vis; ++j) { double d = 0; for (int e = 0; e < D; ++e) d += q[(h*Lq+i)*D+e] * kk[(hk*Lk+j)*D+e]; s[j] = d * 0.125; top = std::fmax(top, s[j]); }
      for (auto& e : s) { e = std::exp(e - top); sum += e; }
      for (int e = 0; e < D; ++e) { double o = 0; for (int j = 0; j < vis; ++j) o += s[j] * v[(hk*Lk+j)*D+e]; worst = std::fmax(worst, std::fabs(o / sum - y[(h*Lq+i)*D+e])); }
    }
    if (worst > 1e-5) { printf("%s attention half %d Lq %d: error %g\n", k.isa, half, Lq, worst); ++bad; }
    // heads last ([B, Lq, Hq, D], as the output projection takes it): the same numbers
    std::vector<float> last(y.size());
    a.y = last.data(); a.heads_last = true;
    k.attention(a, 2);
    for (int h = 0; h < Hq; ++h) for (int i = 0; i < Lq; ++i) for (int e = 0; e < D; ++e)
      if (last[(i*Hq+h)*D+e] != y[(h*Lq+i)*D+e]) { printf("%s attention heads_last half %d Lq %d differs\n", k.isa, half, Lq); ++bad; h = Hq; i = Lq; break; }
  }
  // sample: mlx-lm's top_p nucleus (ties kept) and the draw by u in float64; rows peaked, wide (split
  // again and again), all equal; V not whole vectors nor chunks. Draws within 1e-6 of a boundary skipped.
  {
    const int V = 3001, R = 6; std::vector<float> x(R * V);
    for (int r = 0; r < R; ++r) for (int i = 0; i < V; ++i) { const float n = (rand() % 20001 - 10000) / 1000.0f; x[r*V+i] = r % 3 == 0 ? n : r % 3 == 1 ? n / 100 : 0.0f; }
    const float inv[R] = {1.4f, 1.0f, 3.0f, 0.7f, 1.4f, 1.0f}, tp[R] = {0.9f, 0.5f, 0.95f, 1.0f, 0.9f, 0.9f};
    std::vector<uint32_t> tok(R);
    for (float u : {0.0f, 0.3f, 0.77f, 0.999f}) {
      const std::vector<float> us(R, u); k.sample(x.data(), inv, tp, us.data(), tok.data(), R, V, 2);
      for (int r = 0; r < R; ++r) {
        const float* row = &x[r*V]; double top = -1e300, total = 0; for (int i = 0; i < V; ++i) top = std::fmax(top, row[i]);
        for (int i = 0; i < V; ++i) total += std::exp(row[i] - top);
        std::vector<int> order(V); for (int i = 0; i < V; ++i) order[i] = i;
        std::sort(order.begin(), order.end(), [&](int a, int b) { return row[a] > row[b]; });
        double threshold = -INFINITY, above = 0, near = INFINITY, edge = INFINITY;  // kept while the mass above < top_p
        if (tp[r] < 1) for (int j = 0; j < V; ++j) {
          if (j == 0 || row[order[j]] < row[order[j-1]]) { near = std::fmin(near, std::fabs(above - tp[r] * total)); if (above >= tp[r] * total) break; threshold = row[order[j]]; }
          above += std::exp(row[order[j]] - top);
        }
        double sum = 0, c = 0; for (int i = 0; i < V; ++i) if (row[i] >= threshold) sum += std::exp((row[i] - top) * inv[r]);
        int want = -1; for (int i = 0; i < V && want < 0; ++i) if (row[i] >= threshold) {
          const double w = std::exp((row[i] - top) * inv[r]);
          if (c + w > u * sum) { want = i; edge = std::fmin(c + w - u * sum, u * sum - c); } c += w; }
        if (int(tok[r]) != want && near > 1e-6 * total && edge > 1e-6 * sum) { printf("%s sample row %d u %g: %u, expected %d\n", k.isa, r, u, tok[r], want); ++bad; }
      }
    }
  }
  // sample at inv_temperature inf: the argmax, the first of equal maxima; 0 with every token masked.
  {
    const int V = 3001, R = 4; std::vector<float> x(R * V);
    for (int i = 0; i < R * V; ++i) x[i] = float(rand() % 2001 - 1000);
    x[1*V + 2999] = x[1*V + 3000] = 5000.0f;  // tied in the last, partial vector
    for (int i = 0; i < V; ++i) x[3*V + i] = -INFINITY;
    const float inv[R] = {INFINITY, INFINITY, INFINITY, INFINITY}, tp[R] = {1, 0.9f, 1, 1}, us[R] = {0.5f, 0.5f, 0.5f, 0.5f};
    std::vector<uint32_t> tok(R); k.sample(x.data(), inv, tp, us, tok.data(), R, V, 2);
    for (int r = 0; r < R; ++r) {
      int want = 0; for (int i = 1; i < V; ++i) if (x[r*V+i] > x[r*V+want]) want = i;
      if (int(tok[r]) != want) { printf("%s argmax row %d: %u, expected %d\n", k.isa, r, tok[r], want); ++bad; }
    }
  }
  printf("%s: %s\n", k.isa, bad ? "FAILED" : "ok");
  return bad;
}
int main() { return check(kernels_generic) + check(kernels_neon) + check(kernels_neondot); }

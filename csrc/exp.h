// e^x on the variant's float vector (simd.h), for the kernels that exponentiate (attention's
// softmax, sampling's weights).
#pragma once

#include <cstring>

#include "simd.h"

namespace mlxd {
namespace MLXD_ISA {

// e^x for x <= 0 (values minus their maximum), Cephes' expf polynomial: relative error < 2e-7.
inline vf exp_nonpositive(vf x) {
  const vf lo = vf{} - 87.0f;
  x = x < lo ? lo : x;  // e^-87 is below float32's normal range: 0 to the sums
  const vf magic = vf{} + 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  const vf n = (x * 1.44269504088896341f + magic) - magic;
  const vf r = x - n * 0.693359375f + n * 2.12194440e-4f;
  vf p = vf{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const vi bits = (__builtin_convertvector(n, vi) + 127) << 23;
  vf scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

}  // namespace MLXD_ISA
}  // namespace mlxd

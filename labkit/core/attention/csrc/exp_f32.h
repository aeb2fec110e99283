// exp(x) in float32 without a library call, shared by labkit's C++ kernels (paged_decode_cpu.cpp, and
// ../../quant/csrc/gemv_cpu.cpp): a loop over it can vectorise, where std::exp is one call per element (PyTorch's own
// CPU ops use a vectorised exp for the same reason). 2^n * e^r with n = round(x / ln 2), |r| <= ln(2) / 2, and e^r by
// Cephes' degree-6 polynomial: within 2 ulp of std::exp. x is clamped to [-87.3, 88.3], where 2^n stays a normal
// float: e^x is then ~1e-38 or ~2e38 instead of 0 or inf, which no caller can tell apart (a softmax weight that
// small vanishes against the largest, exp(0) = 1; silu(g) = g / (1 + e^-g) is ~0 either way).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace labkit {

inline float exp_f32(float x) {
  x = std::min(std::max(x, -87.3f), 88.3f);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;  // x - n * ln 2, ln 2 split in two for accuracy
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;  // 2^n as a float's exponent field
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

}  // namespace labkit

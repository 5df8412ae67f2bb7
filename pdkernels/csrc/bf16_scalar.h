// Scalar bfloat16 <-> float32 conversions shared by the C++ kernels (cpu_attention.cpp, cpu_layer_ops.cpp).
// A header included by a kernel source is part of that kernel's build hash (pdkernels/native_build.py), so a change
// here rebuilds every kernel that includes it.
#pragma once

#include <cstdint>
#include <cstring>

namespace pdk {

inline float bf16_to_float(uint16_t h) {
  uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// float32 -> bfloat16, round to nearest even (torch's cast); NaN stays NaN. Branch-free (a select), so loops vectorize.
inline uint16_t float_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  const uint32_t nan = (u >> 16) | 0x40u;
  return uint16_t((u & 0x7fffffffu) > 0x7f800000u ? nan : rounded);
}

}  // namespace pdk

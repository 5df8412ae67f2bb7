// The small per-layer ops of a bfloat16 decode step fused for the CPU (pdkernels/cpu_layer_ops.py builds and loads this
// file; docs/kernels.md "Residual add + RMSNorm and SiLU-and-mul on the CPU").
//
// pd_add_rms_norm_bf16, per row r of `h` ([rows, dim], row stride h_s0, unit column stride):
//   h[r] = bf16(h[r] + add[r])                              (skipped where add is null)
//   out[r] = bf16(h[r] * rsqrt(mean(h[r]^2) + eps) * w)
// in float32, rounding to nearest even once at the end, as torch's bfloat16 rms_norm on the CPU does (torch 2.13's
// fused kernel), so the result differs from torch's only where the float32 sum of squares, summed in another order,
// moves a value across a bfloat16 rounding boundary (one bfloat16 ulp).
//
// pd_silu_and_mul_bf16, per row r of gate_up ([rows, 2 * inter]): out[r] = bf16(bf16(silu(gate)) * up), gate and
// up the row's two halves, silu(g) = g / (1 + exp(-g)) in float32: torch's F.silu(gate) * up with its two roundings;
// exp is a polynomial within ~2 ulp of expf (exp_any), not torch's vectorized one, so a value can land one bfloat16
// ulp away where the two exps differ in their last float32 bits across a rounding boundary.
//
// Plain C++ (no intrinsics, no torch headers), written so that g++ -O3 -march=native vectorizes the loops; OpenMP
// over rows. A C ABI called through ctypes; the caller checks every shape and passes element strides.
#include <omp.h>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "bf16_scalar.h"

using pdk::bf16_to_float;
using pdk::float_to_bf16;

namespace {

constexpr int64_t MAX_DIM = 16384;  // float32 row buffer on the stack (the caller falls back above it)

void one_row(uint16_t* h, const uint16_t* add, const uint16_t* w, uint16_t* out, int64_t dim, float eps) {
  alignas(64) float x[MAX_DIM];
  if (add != nullptr) {
#pragma omp simd
    for (int64_t i = 0; i < dim; ++i) {
      uint16_t s = float_to_bf16(bf16_to_float(h[i]) + bf16_to_float(add[i]));
      h[i] = s;
      x[i] = bf16_to_float(s);
    }
  } else {
#pragma omp simd
    for (int64_t i = 0; i < dim; ++i) x[i] = bf16_to_float(h[i]);
  }
  float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < dim; ++i) ss += x[i] * x[i];
  const float r = 1.0f / std::sqrt(ss / float(dim) + eps);
#pragma omp simd
  for (int64_t i = 0; i < dim; ++i) out[i] = float_to_bf16(x[i] * r * bf16_to_float(w[i]));
}

// exp(v) within ~2 ulp of expf, branch-free so that loops over it vectorize (std::exp does not): 2^k * p(r),
// r = v - k ln 2, |r| <= ln(2) / 2, p the degree-7 Taylor polynomial (pdkernels/csrc/cpu_attention.cpp's, for any
// sign); below -87 it is 0 and above 88.72 it is inf, as expf's underflow and overflow.
inline float exp_any(float v) {
  const float log2e = 1.44269504088896341f, ln2_hi = 0.693145751953125f, ln2_lo = 1.428606765330187e-06f;
  const float round = 12582912.0f;  // 1.5 * 2^23: adding and subtracting it rounds to an integer
  const float under = v < -87.0f ? 0.0f : 1.0f;
  const bool over = v > 88.72f;
  v = v < -87.0f ? -87.0f : (over ? 88.0f : v);
  const float k = (v * log2e + round) - round;
  const float r = (v - k * ln2_hi) - k * ln2_lo;
  float p = 1.0f / 5040.0f;
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t bits = (int32_t(k) + 127) << 23;
  float two_k;
  std::memcpy(&two_k, &bits, sizeof two_k);
  return over ? INFINITY : p * two_k * under;
}

void silu_mul_row(const uint16_t* g, const uint16_t* u, uint16_t* out, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const float x = bf16_to_float(g[i]);
    const float s = bf16_to_float(float_to_bf16(x / (1.0f + exp_any(-x))));
    out[i] = float_to_bf16(s * bf16_to_float(u[i]));
  }
}

}  // namespace

extern "C" {

// h [rows, dim] bfloat16 (row stride h_s0), mutated in place when add is not null; add [rows, dim] (row stride
// add_s0) or null; w [dim]; out [rows, dim] (row stride out_s0). Returns 0, or 1 where dim is out of bounds.
int pd_add_rms_norm_bf16(void* h, int64_t h_s0, const void* add, int64_t add_s0, const void* w, void* out,
                         int64_t out_s0, int64_t rows, int64_t dim, float eps, int threads) {
  if (dim <= 0 || dim > MAX_DIM) return 1;
  auto* hp = static_cast<uint16_t*>(h);
  const auto* ap = static_cast<const uint16_t*>(add);
  const auto* wp = static_cast<const uint16_t*>(w);
  auto* op = static_cast<uint16_t*>(out);
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && rows * dim >= 32768)
  for (int64_t r = 0; r < rows; ++r)
    one_row(hp + r * h_s0, ap == nullptr ? nullptr : ap + r * add_s0, wp, op + r * out_s0, dim, eps);
  return 0;
}

// gate_up [rows, 2 * inter] bfloat16 (row stride gu_s0, unit column stride); out [rows, inter] (row stride out_s0).
void pd_silu_and_mul_bf16(const void* gate_up, int64_t gu_s0, void* out, int64_t out_s0, int64_t rows, int64_t inter,
                          int threads) {
  const auto* gp = static_cast<const uint16_t*>(gate_up);
  auto* op = static_cast<uint16_t*>(out);
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && rows * inter >= 32768)
  for (int64_t r = 0; r < rows; ++r) silu_mul_row(gp + r * gu_s0, gp + r * gu_s0 + inter, op + r * out_s0, inter);
}

}  // extern "C"

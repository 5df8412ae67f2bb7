// Fused CPU kernels of the quantized weights (pdkernels/quant_fused.py builds and loads this file; docs/kernels.md).
// One translation unit, compiled with AVX-512 flags and loaded only where the CPU has them (the Python side checks).
//
// w8a8_linear: per-token int8 quantization of the activations (the levels of quant_ref.quantize_tokens_int8, stored
//   plus 128 as uint8), an int8 GEMM with AVX512-VNNI (vpdpbusd: uint8 activations x int8 weights, 4 products per
//   int32 lane; minus 128 * the weight's column sum), then float(acc) * w_scale[n] * x_scale[m] + bias[n], stored in
//   x's dtype. Weights pre-packed by quant_fused.pack_int8: [N/16][ceil(K/4)][16 columns][4 k].
// w4a16_linear: packed 4-bit levels dequantized in registers (a 16-entry table of bfloat16 values level - 8, vpermw),
//   multiplied with bfloat16 activations by vdpbf16ps (float32 activations split exactly into three bfloat16 parts),
//   summed per group in float32, then times the group's scale (and minus (zero - 8) * the group's activation sum
//   where asymmetric). Weights pre-packed by quant_fused.pack_int4: [N/16][K/4][32 bytes], byte 2c + j holding
//   column c's level at k = 4q + j in its low nibble and at k = 4q + 2 + j in its high one.
// Both: OpenMP over tiles of output columns (the caller passes torch.get_num_threads()), rows in register tiles of up
// to 4 (W8A8) or 8 (W4A16: each packed quad unpacked once for 8 rows; the weight prefetched ahead).
// A plain C ABI called through ctypes, no torch headers: the file compiles in seconds (torch/extension.h alone takes
// over a minute on a busy 2-core machine). The caller allocates every buffer and checks every shape.
#include <immintrin.h>
#include <omp.h>
#include <algorithm>
#include <cstdint>
#include <cstring>

namespace {

constexpr int MR = 4;  // rows per register tile

inline __m512 load_bf16(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}

inline __m512 load_bf16_mask(const uint16_t* p, __mmask16 m) {
  __m256i v = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

// float32 -> bfloat16, round to nearest even (as torch's cast of finite values)
inline __m256i to_bf16(__m512 v) {
  __m512i b = _mm512_castps_si512(v);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  b = _mm512_add_epi32(b, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(b, 16));
}

inline void store_row(const __m512& v, bool f32, void* out, int64_t idx, __mmask16 m) {
  if (f32) {
    _mm512_mask_storeu_ps((float*)out + idx, m, v);
  } else {
    _mm256_mask_storeu_epi16((uint16_t*)out + idx, m, to_bf16(v));
  }
}

inline __mmask16 tail_mask(int64_t valid) { return valid >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << valid) - 1); }

// Tiles of `nbt` 16-column blocks: the largest of 4, 2, 1 leaving at least two tiles per thread (or 1).
inline int64_t blocks_per_tile(int64_t nblocks, int64_t threads, int64_t most) {
  for (int64_t t = most; t > 1; t /= 2)
    if ((nblocks + t - 1) / t >= 2 * threads) return t;
  return 1;
}

// ---------------------------------------------------------------- W8A8 ---------------------------------------------

// Row m of x (float32 or bfloat16, K columns) as uint8 levels + 128 (K padded to Kp with 128) and its scale.
void quantize_row(const void* x, bool f32, int64_t K, int64_t Kp, uint8_t* q, float* scale) {
  __m512 amax = _mm512_setzero_ps();
  int64_t k = 0;
  const float* xf = (const float*)x;
  const uint16_t* xh = (const uint16_t*)x;
  auto load = [&](int64_t i, __mmask16 m) {
    return f32 ? _mm512_maskz_loadu_ps(m, xf + i) : load_bf16_mask(xh + i, m);
  };
  for (; k < K; k += 16) amax = _mm512_max_ps(amax, _mm512_abs_ps(load(k, tail_mask(K - k))));
  float s = _mm512_reduce_max_ps(amax) / 127.0f;
  *scale = s;
  __m512 div = _mm512_set1_ps(s > 1e-30f ? s : 1e-30f);
  __m512i off = _mm512_set1_epi32(128);
  for (k = 0; k < K; k += 16) {
    __mmask16 m = tail_mask(K - k);
    __m512i lv = _mm512_cvt_roundps_epi32(_mm512_div_ps(load(k, m), div), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm_mask_storeu_epi8(q + k, m, _mm512_cvtepi32_epi8(_mm512_add_epi32(lv, off)));
  }
  for (k = K; k < Kp; ++k) q[k] = 128;
}

template <int R, int NB>
void w8_tile(const uint8_t* xq, int64_t Kp, const int8_t* wp, int64_t K4, int32_t* acc_out) {
  __m512i acc[R][NB];
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < NB; ++b) acc[r][b] = _mm512_setzero_si512();
  for (int64_t q = 0; q < K4; ++q) {
    __m512i w[NB];
    for (int b = 0; b < NB; ++b) w[b] = _mm512_loadu_si512(wp + (b * K4 + q) * 64);
    for (int r = 0; r < R; ++r) {
      int32_t xv;
      std::memcpy(&xv, xq + r * Kp + 4 * q, 4);
      __m512i xb = _mm512_set1_epi32(xv);
      for (int b = 0; b < NB; ++b) acc[r][b] = _mm512_dpbusd_epi32(acc[r][b], xb, w[b]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < NB; ++b) _mm512_storeu_si512(acc_out + (r * NB + b) * 16, acc[r][b]);
}

template <int NB>
void w8_rows(int R, const uint8_t* xq, int64_t Kp, const int8_t* wp, int64_t K4, int32_t* acc) {
  switch (R) {
    case 1: w8_tile<1, NB>(xq, Kp, wp, K4, acc); break;
    case 2: w8_tile<2, NB>(xq, Kp, wp, K4, acc); break;
    case 3: w8_tile<3, NB>(xq, Kp, wp, K4, acc); break;
    default: w8_tile<4, NB>(xq, Kp, wp, K4, acc); break;
  }
}

}  // namespace

extern "C" {

// out [M, N] (x's dtype) = W8A8 of x [M, K] (float32 if x_f32 else bfloat16); packed [NBk][K4][16][4] int8;
// corr [16 NBk] int32; wscale [N]; bias [N] float32 or null; scratch: xq [M][4 K4] uint8, xs [M] float32.
void pdq_w8a8(const void* x, int x_f32, int64_t M, int64_t K, const int8_t* wp, int64_t K4, int64_t NBk,
              const int32_t* cp, const float* sp, const float* bp, int64_t N, uint8_t* xqp, float* xsp, void* op,
              int threads) {
  const bool f32 = x_f32 != 0;
  const int64_t Kp = 4 * K4, esz = f32 ? 4 : 2;
  const char* xp = (const char*)x;
#pragma omp parallel for num_threads(threads) schedule(static) if (M > 16 && threads > 1)
  for (int64_t m = 0; m < M; ++m) quantize_row(xp + m * K * esz, f32, K, Kp, xqp + m * Kp, xsp + m);
  const int64_t nbt = blocks_per_tile(NBk, threads, 4);
  const int64_t tiles = (NBk + nbt - 1) / nbt;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t t = 0; t < tiles; ++t) {
    alignas(64) int32_t acc[MR * 4 * 16];
    const int64_t b0 = t * nbt, nb = std::min(nbt, NBk - b0);
    for (int64_t m0 = 0; m0 < M; m0 += MR) {
      const int R = (int)std::min<int64_t>(MR, M - m0);
      const uint8_t* xr = xqp + m0 * Kp;
      const int8_t* wb = wp + b0 * K4 * 64;
      if (nb == 4) w8_rows<4>(R, xr, Kp, wb, K4, acc);
      else if (nb == 2) w8_rows<2>(R, xr, Kp, wb, K4, acc);
      else if (nb == 3) w8_rows<3>(R, xr, Kp, wb, K4, acc);
      else w8_rows<1>(R, xr, Kp, wb, K4, acc);
      for (int64_t b = 0; b < nb; ++b) {
        const int64_t n0 = (b0 + b) * 16;
        const __mmask16 msk = tail_mask(N - n0);
        const __m512i c = _mm512_loadu_si512(cp + n0);
        const __m512 ws = _mm512_maskz_loadu_ps(msk, sp + n0);
        const __m512 bv = bp ? _mm512_maskz_loadu_ps(msk, bp + n0) : _mm512_setzero_ps();
        for (int r = 0; r < R; ++r) {
          __m512i a = _mm512_sub_epi32(_mm512_loadu_si512(acc + (r * nb + b) * 16), c);
          __m512 v = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(a), ws), _mm512_set1_ps(xsp[m0 + r]));
          if (bp) v = _mm512_add_ps(v, bv);
          store_row(v, f32, op, (m0 + r) * N + n0, msk);
        }
      }
    }
  }
}

}  // extern "C"

// ---------------------------------------------------------------- W4A16 --------------------------------------------

namespace {

constexpr int MR4 = 8;  // rows per W4A16 register tile: each weight quad unpacked once for up to 8 rows
// W4A16 prefetches the packed weight this many bytes ahead of each block's read: the next tiles' weights arrive
// while this tile computes (the hardware prefetcher alone left the dot products waiting on memory; at 8 rows, 30
// layers of SmolLM2's shapes streamed, 12.0 -> 10.2 ms; W8A8's plain loads gain nothing from it)
constexpr int64_t W4_PREFETCH = 8192;

// The bfloat16 values level - 8 of the 16 levels, twice (vpermw reads 32 words).
inline __m512i w4_table() {
  alignas(64) uint16_t tab[32];
  for (int i = 0; i < 32; ++i) {
    float f = (float)((i & 15) - 8);
    uint32_t u;
    std::memcpy(&u, &f, 4);
    tab[i] = (uint16_t)(u >> 16);
  }
  return _mm512_load_si512(tab);
}

// R rows x NB 16-column blocks: per group, float32 sums in registers, then acc[r][b] (memory, zeroed by the caller)
// += scale * (sum - (zero - 8) * sum_group(x)).
template <int R, int NB, int S>
void w4_tile(const uint16_t* xb, int64_t M, int64_t K, const uint8_t* wq, int64_t Q, const float* sc, const float* zc,
             const float* xsum, int64_t G, int64_t qpg, float* acc) {
  const __m512i lut = w4_table();
  const __m512i nib = _mm512_set1_epi16(0x0F);
  for (int64_t g = 0; g < G; ++g) {
    __m512 gacc[R][NB];
    for (int r = 0; r < R; ++r)
      for (int b = 0; b < NB; ++b) gacc[r][b] = _mm512_setzero_ps();
    for (int64_t q = g * qpg; q < (g + 1) * qpg; ++q) {
      __m512i lo[NB], hi[NB];
      for (int b = 0; b < NB; ++b) {
        const uint8_t* p = wq + (b * Q + q) * 32;
        _mm_prefetch((const char*)p + W4_PREFETCH, _MM_HINT_T0);
        __m512i w16 = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)p));
        lo[b] = _mm512_permutexvar_epi16(_mm512_and_si512(w16, nib), lut);
        hi[b] = _mm512_permutexvar_epi16(_mm512_srli_epi16(w16, 4), lut);
      }
      for (int r = 0; r < R; ++r)
        for (int s = 0; s < S; ++s) {
          int32_t p0, p1;
          const uint16_t* xr = xb + (s * M + r) * K + 4 * q;
          std::memcpy(&p0, xr, 4);
          std::memcpy(&p1, xr + 2, 4);
          const __m512bh x0 = (__m512bh)_mm512_set1_epi32(p0), x1 = (__m512bh)_mm512_set1_epi32(p1);
          for (int b = 0; b < NB; ++b) {
            gacc[r][b] = _mm512_dpbf16_ps(gacc[r][b], (__m512bh)lo[b], x0);
            gacc[r][b] = _mm512_dpbf16_ps(gacc[r][b], (__m512bh)hi[b], x1);
          }
        }
    }
    for (int b = 0; b < NB; ++b) {
      const __m512 s = _mm512_loadu_ps(sc + (b * G + g) * 16);
      const __m512 z = zc ? _mm512_loadu_ps(zc + (b * G + g) * 16) : _mm512_setzero_ps();
      for (int r = 0; r < R; ++r) {
        float* a = acc + (r * NB + b) * 16;
        __m512 v = zc ? _mm512_fnmadd_ps(z, _mm512_set1_ps(xsum[r * G + g]), gacc[r][b]) : gacc[r][b];
        _mm512_storeu_ps(a, _mm512_fmadd_ps(s, v, _mm512_loadu_ps(a)));
      }
    }
  }
}

template <int NB, int S>
void w4_rows(int R, const uint16_t* xb, int64_t M, int64_t K, const uint8_t* wq, int64_t Q, const float* sc,
             const float* zc, const float* xsum, int64_t G, int64_t qpg, float* acc) {
  std::memset(acc, 0, sizeof(float) * R * NB * 16);
  switch (R) {
    case 1: w4_tile<1, NB, S>(xb, M, K, wq, Q, sc, zc, xsum, G, qpg, acc); break;
    case 2: w4_tile<2, NB, S>(xb, M, K, wq, Q, sc, zc, xsum, G, qpg, acc); break;
    case 3: w4_tile<3, NB, S>(xb, M, K, wq, Q, sc, zc, xsum, G, qpg, acc); break;
    case 4: w4_tile<4, NB, S>(xb, M, K, wq, Q, sc, zc, xsum, G, qpg, acc); break;
    case 5: w4_tile<5, NB, S>(xb, M, K, wq, Q, sc, zc, xsum, G, qpg, acc); break;
    case 6: w4_tile<6, NB, S>(xb, M, K, wq, Q, sc, zc, xsum, G, qpg, acc); break;
    case 7: w4_tile<7, NB, S>(xb, M, K, wq, Q, sc, zc, xsum, G, qpg, acc); break;
    default: w4_tile<8, NB, S>(xb, M, K, wq, Q, sc, zc, xsum, G, qpg, acc); break;
  }
}

// float32 row -> three bfloat16 rows whose sum is the row exactly (each part truncates the remainder's top bits)
void split_row(const float* x, int64_t K, uint16_t* h, uint16_t* m, uint16_t* l) {
  const __m512i top = _mm512_set1_epi32((int)0xFFFF0000u);
  for (int64_t k = 0; k < K; k += 16) {
    const __mmask16 msk = tail_mask(K - k);
    __m512 v = _mm512_maskz_loadu_ps(msk, x + k);
    uint16_t* dst[3] = {h, m, l};
    for (int p = 0; p < 3; ++p) {
      __m512i bits = _mm512_and_si512(_mm512_castps_si512(v), top);
      _mm256_mask_storeu_epi16(dst[p] + k, msk, _mm512_cvtepi32_epi16(_mm512_srli_epi32(bits, 16)));
      v = _mm512_sub_ps(v, _mm512_castsi512_ps(bits));
    }
  }
}

}  // namespace

extern "C" {

// out [M, N] (x's dtype) = W4A16 of x [M, K] (float32 if x_f32 else bfloat16), K % 4 == 0, group % 4 == 0;
// wq [NBk][K/4][32] uint8; sc [NBk][G][16]; zc likewise (zero - 8) or null; xsum [M][G] float32 (null if zc is);
// bias [N] or null; split [3][M][K] bfloat16 scratch (float32 x only).
void pdq_w4a16(const void* x, int x_f32, int64_t M, int64_t K, const uint8_t* wp, int64_t NBk, const float* sp,
               const float* zp, int64_t group, const float* xsp, const float* bp, int64_t N, uint16_t* split, void* op,
               int threads) {
  const bool f32 = x_f32 != 0;
  const int S = f32 ? 3 : 1;
  const int64_t Q = K / 4, G = K / group, qpg = group / 4;
  const uint16_t* xbp = (const uint16_t*)x;
  if (f32) {
    const float* xf = (const float*)x;
#pragma omp parallel for num_threads(threads) if (M > 16 && threads > 1)
    for (int64_t m = 0; m < M; ++m) split_row(xf + m * K, K, split + m * K, split + (M + m) * K, split + (2 * M + m) * K);
    xbp = split;
  }
  const int64_t nbt = blocks_per_tile(NBk, threads, 2);
  const int64_t tiles = (NBk + nbt - 1) / nbt;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t t = 0; t < tiles; ++t) {
    alignas(64) float acc[MR4 * 2 * 16];
    const int64_t b0 = t * nbt, nb = std::min(nbt, NBk - b0);
    const uint8_t* wb = wp + b0 * Q * 32;
    const float* sb = sp + b0 * G * 16;
    const float* zb = zp ? zp + b0 * G * 16 : nullptr;
    for (int64_t m0 = 0; m0 < M; m0 += MR4) {
      const int R = (int)std::min<int64_t>(MR4, M - m0);
      const uint16_t* xr = xbp + m0 * K;
      const float* xs = xsp ? xsp + m0 * G : nullptr;
      if (S == 3) {
        if (nb == 2) w4_rows<2, 3>(R, xr, M, K, wb, Q, sb, zb, xs, G, qpg, acc);
        else w4_rows<1, 3>(R, xr, M, K, wb, Q, sb, zb, xs, G, qpg, acc);
      } else {
        if (nb == 2) w4_rows<2, 1>(R, xr, M, K, wb, Q, sb, zb, xs, G, qpg, acc);
        else w4_rows<1, 1>(R, xr, M, K, wb, Q, sb, zb, xs, G, qpg, acc);
      }
      for (int64_t b = 0; b < nb; ++b) {
        const int64_t n0 = (b0 + b) * 16;
        const __mmask16 msk = tail_mask(N - n0);
        const __m512 bv = bp ? _mm512_maskz_loadu_ps(msk, bp + n0) : _mm512_setzero_ps();
        for (int r = 0; r < R; ++r) {
          __m512 v = _mm512_loadu_ps(acc + (r * nb + b) * 16);
          if (bp) v = _mm512_add_ps(v, bv);
          store_row(v, f32, op, (m0 + r) * N + n0, msk);
        }
      }
    }
  }
}

int pdq_abi() { return 1; }

}  // extern "C"

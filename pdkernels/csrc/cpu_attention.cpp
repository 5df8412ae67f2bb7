// Fused paged decode attention for the CPU (pdkernels/cpu_fused_decode.py builds and loads this file; docs/kernels.md
// "Decode attention on the CPU").
//
// One query token per sequence over its paged K/V, read in place through the block table (no gathered copy):
// one task per (sequence, kv head) computes that kv head's whole GQA group of query heads, so each K and V row is
// loaded (and, for bfloat16, widened to float32) once for the group. Scores, softmax and the output accumulate in
// float32; the softmax is online over chunks of CHUNK positions (scores of a chunk, the running max and sum rescaled
// once per chunk, then P @ V of the chunk). Positions: [max(0, len - window), len) with a sliding window, else [0, len);
// a row with len 0 writes zeros.
//
// Plain C++ (no intrinsics, no torch headers): the loops are written so that g++ -O3 -march=native vectorizes them
// (OpenMP simd reductions instead of -ffast-math; bfloat16 widened by a shift; exp by a polynomial that vectorizes).
// A C ABI called through ctypes; the caller checks every shape and passes element strides.
#include <omp.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "bf16_scalar.h"

using pdk::bf16_to_float;
using pdk::float_to_bf16;

namespace {

constexpr int CHUNK = 128;     // positions per online-softmax step
constexpr int MAX_DIM = 256;   // head_dim bound (the caller falls back above it)
constexpr int MAX_GROUP = 16;  // query heads per kv head bound (likewise)
constexpr int MAX_TASK_HEADS = 8;
constexpr int PREFETCH = 16;   // rows ahead that the loops ask the cache for (the rows of a chunk are scattered)  // kv heads of one sequence computed together in one task

// Ask for every cache line of a row of n values (a hint: no effect on results).
template <typename T>
inline void prefetch_row(const T* p, int n) {
  for (int b = 0; b < int(sizeof(T)) * n; b += 64) __builtin_prefetch(reinterpret_cast<const char*>(p) + b);
}

inline void widen(const float* src, float* dst, int n) { std::memcpy(dst, src, sizeof(float) * n); }

inline void widen(const uint16_t* src, float* dst, int n) {
#pragma omp simd
  for (int i = 0; i < n; ++i) dst[i] = bf16_to_float(src[i]);
}

inline void store(float* dst, const float* src, float mul, int n) {
#pragma omp simd
  for (int i = 0; i < n; ++i) dst[i] = src[i] * mul;
}

inline void store(uint16_t* dst, const float* src, float mul, int n) {
  for (int i = 0; i < n; ++i) dst[i] = float_to_bf16(src[i] * mul);
}

// x[i] = exp(x[i]) for x <= 0 (scores minus their running max), within ~2 ulp of expf: 2^n * p(r), r = x - n ln 2,
// |r| <= ln(2) / 2, p the degree-7 Taylor polynomial (truncation ~5e-9 relative). Below -87 the result is 0.
inline void exp_nonpositive(float* x, int n) {
  const float log2e = 1.44269504088896341f, ln2_hi = 0.693145751953125f, ln2_lo = 1.428606765330187e-06f;
  const float round = 12582912.0f;  // 1.5 * 2^23: adding and subtracting it rounds to an integer
#pragma omp simd
  for (int i = 0; i < n; ++i) {
    float v = x[i];
    float under = v < -87.0f ? 0.0f : 1.0f;
    v = v < -87.0f ? -87.0f : v;
    float k = (v * log2e + round) - round;
    float r = (v - k * ln2_hi) - k * ln2_lo;
    float p = 1.0f / 5040.0f;
    p = p * r + 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    int32_t bits = (int32_t(k) + 127) << 23;
    float two_k;
    std::memcpy(&two_k, &bits, sizeof two_k);
    x[i] = p * two_k * under;
  }
}

struct Layout {
  int64_t q_s0, q_s1;                // q [n, heads, dim] element strides (dim stride 1)
  int64_t k_sb, k_st, k_sh;          // k_cache [blocks, block_size, kv_heads, dim] element strides
  int64_t v_sb, v_st, v_sh;          // v_cache likewise
  const int32_t* tables;             // [n, t_s0] block ids
  int64_t t_s0;
  const int32_t* lens;               // [n]
  int64_t heads, kv_heads, dim, block_size, window;  // window <= 0: none
  float scale;
  int64_t num_blocks;
};

// One kv head's running state over a sequence: its group's queries (times the scale), output sums, max and sum.
struct HeadState {
  float q[MAX_GROUP * MAX_DIM];
  float acc[MAX_GROUP * MAX_DIM];
  float m[MAX_GROUP], l[MAX_GROUP];
};

// q . row over D values. With D a multiple of 16 known at compile time: 16 partial sums (one vector register) and a
// tree to add them (log2(16) steps); otherwise an OpenMP simd reduction.
template <int DIM>
inline float dot(const float* q, const float* row, int D) {
  if constexpr (DIM % 16 == 0 && DIM > 0) {
    float lanes[16] = {};
    for (int d0 = 0; d0 < DIM; d0 += 16)
#pragma omp simd
      for (int l = 0; l < 16; ++l) lanes[l] += q[d0 + l] * row[d0 + l];
#pragma omp simd
    for (int l = 0; l < 8; ++l) lanes[l] += lanes[l + 8];
#pragma omp simd
    for (int l = 0; l < 4; ++l) lanes[l] += lanes[l + 4];
    return (lanes[0] + lanes[2]) + (lanes[1] + lanes[3]);
  } else {
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int d = 0; d < D; ++d) sum += q[d] * row[d];
    return sum;
  }
}

// Positions [c0, c0 + cn) of kv head h into st (the online-softmax step): the chunk's row addresses from the block
// table, scores, softmax, then P @ V, each loop asking PREFETCH rows ahead for the rows it will read. DIM: head_dim as a compile-time constant
// (the common sizes: loops fully unrolled), or 0 for any head_dim read from L.
template <typename T, int DIM>
void chunk(HeadState& st, const T* kc, const T* vc, const int32_t* table, const Layout& L, int64_t h, int64_t c0,
           int cn) {
  const int G = int(L.heads / L.kv_heads), D = DIM ? DIM : int(L.dim);
  alignas(64) float s[MAX_GROUP * CHUNK];
  alignas(64) float row[MAX_DIM];
  const T* rows[CHUNK];  // the chunk's K rows, then its V rows
  int64_t blk = c0 / L.block_size, off = c0 % L.block_size;
  for (int i = 0; i < cn; ++i) {
    rows[i] = kc + table[blk] * L.k_sb + off * L.k_st + h * L.k_sh;
    if (++off == L.block_size) off = 0, ++blk;
  }
  for (int i = 0; i < cn; ++i) {  // scores of the chunk: s[g][i] = q_g . k_t
    if (i + PREFETCH < cn) prefetch_row(rows[i + PREFETCH], D);
    widen(rows[i], row, D);
    for (int g = 0; g < G; ++g) s[g * CHUNK + i] = dot<DIM>(st.q + g * D, row, D);
  }
  for (int g = 0; g < G; ++g) {  // online softmax: new max, rescale what was summed, exponentiate the chunk
    float* sg = s + g * CHUNK;
    float mx = st.m[g];
    for (int i = 0; i < cn; ++i) mx = std::max(mx, sg[i]);
    const float alpha = st.m[g] == -INFINITY ? 0.0f : std::exp(st.m[g] - mx);
    st.m[g] = mx;
    for (int i = 0; i < cn; ++i) sg[i] -= mx;
    exp_nonpositive(sg, cn);
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int i = 0; i < cn; ++i) sum += sg[i];
    st.l[g] = st.l[g] * alpha + sum;
    if (alpha != 1.0f) {
      float* ag = st.acc + g * D;
#pragma omp simd
      for (int d = 0; d < D; ++d) ag[d] *= alpha;
    }
  }
  blk = c0 / L.block_size, off = c0 % L.block_size;
  for (int i = 0; i < cn; ++i) {
    rows[i] = vc + table[blk] * L.v_sb + off * L.v_st + h * L.v_sh;
    if (++off == L.block_size) off = 0, ++blk;
  }
  for (int i = 0; i < cn; ++i) {  // acc[g] += p[g][i] * v_t
    if (i + PREFETCH < cn) prefetch_row(rows[i + PREFETCH], D);
    widen(rows[i], row, D);
    for (int g = 0; g < G; ++g) {
      const float p = s[g * CHUNK + i];
      float* ag = st.acc + g * D;
#pragma omp simd
      for (int d = 0; d < D; ++d) ag[d] += p * row[d];
    }
  }
}

// Sequence b's kv heads [h0, h1): chunk by chunk, every head of the range in turn (the heads of a position share its
// cache lines, so the later heads of a chunk read what the first one brought in). Returns false (writing nothing)
// where a block id the length reaches is outside the cache.
template <typename T, int DIM>
bool one_task(const T* q, const T* kc, const T* vc, T* out, const Layout& L, int64_t b, int64_t h0, int64_t h1) {
  const int G = int(L.heads / L.kv_heads), D = DIM ? DIM : int(L.dim);
  const int64_t len = L.lens[b];
  if (len <= 0) {
    std::memset(out + (b * L.heads + h0 * G) * D, 0, sizeof(T) * (h1 - h0) * G * D);
    return true;
  }
  const int64_t start = L.window > 0 ? std::max<int64_t>(0, len - L.window) : 0;
  const int32_t* table = L.tables + b * L.t_s0;
  for (int64_t i = start / L.block_size, e = (len - 1) / L.block_size; i <= e; ++i)
    if (table[i] < 0 || table[i] >= L.num_blocks) return false;
  thread_local std::vector<HeadState> pool;  // ~33 KB per head: on the heap, not an OpenMP worker's stack
  if (pool.size() < size_t(h1 - h0)) pool.resize(size_t(h1 - h0));
  HeadState* states = pool.data();
  for (int64_t h = h0; h < h1; ++h) {
    HeadState& st = states[h - h0];
    for (int g = 0; g < G; ++g) {
      widen(q + b * L.q_s0 + (h * G + g) * L.q_s1, st.q + g * D, D);
      for (int d = 0; d < D; ++d) st.q[g * D + d] *= L.scale;
      st.m[g] = -INFINITY;
      st.l[g] = 0.0f;
    }
    std::fill(st.acc, st.acc + G * D, 0.0f);
  }
  for (int64_t c0 = start; c0 < len; c0 += CHUNK) {
    const int cn = int(std::min<int64_t>(CHUNK, len - c0));
    for (int64_t h = h0; h < h1; ++h) chunk<T, DIM>(states[h - h0], kc, vc, table, L, h, c0, cn);
  }
  for (int64_t h = h0; h < h1; ++h) {
    const HeadState& st = states[h - h0];
    for (int g = 0; g < G; ++g) store(out + (b * L.heads + h * G + g) * D, st.acc + g * D, 1.0f / st.l[g], D);
  }
  return true;
}

// Tasks: whole sequences (up to MAX_TASK_HEADS kv heads each) where they keep every thread busy, else one task per
// (sequence, kv head).
template <typename T, int DIM>
int run(const void* q, const void* k, const void* v, void* out, const Layout& L, int64_t n, int threads) {
  const int64_t per = (n >= 2 * threads && L.kv_heads <= MAX_TASK_HEADS) ? L.kv_heads : 1;
  const int64_t splits = L.kv_heads / per, tasks = n * splits;
  int bad = 0;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1) if (threads > 1 && tasks > 1) reduction(| : bad)
  for (int64_t t = 0; t < tasks; ++t) {
    const int64_t b = t / splits, h0 = (t % splits) * per;
    bad |= !one_task<T, DIM>(static_cast<const T*>(q), static_cast<const T*>(k), static_cast<const T*>(v),
                             static_cast<T*>(out), L, b, h0, h0 + per);
  }
  return bad;
}

template <typename T>
int dispatch(const void* q, const void* k, const void* v, void* out, const Layout& L, int64_t n, int threads) {
  switch (L.dim) {
    case 64: return run<T, 64>(q, k, v, out, L, n, threads);
    case 128: return run<T, 128>(q, k, v, out, L, n, threads);
    default: return run<T, 0>(q, k, v, out, L, n, threads);
  }
}

}  // namespace

extern "C" {

// q [n, heads, dim] (strides q_s0, q_s1, unit dim stride), caches [blocks, block_size, kv_heads, dim] (strides given,
// unit dim stride), all of one dtype (bf16 != 0: bfloat16, else float32); tables int32 [n, >= needed blocks] (row
// stride t_s0), lens int32 [n]; out contiguous [n, heads, dim] of that dtype. window <= 0: no sliding window.
// Returns 0, or 1 where a block id that some length reaches is outside [0, num_blocks) (that row left unwritten).
int pd_decode_attn(const void* q, int64_t q_s0, int64_t q_s1, const void* k, int64_t k_sb, int64_t k_st,
                    int64_t k_sh, const void* v, int64_t v_sb, int64_t v_st, int64_t v_sh, int bf16,
                    const int32_t* tables, int64_t t_s0, const int32_t* lens, int64_t n, int64_t heads,
                   int64_t kv_heads, int64_t dim, int64_t block_size, float scale, int64_t window,
                   int64_t num_blocks, void* out, int threads) {
  const Layout L{q_s0, q_s1, k_sb, k_st, k_sh, v_sb, v_st, v_sh, tables, t_s0, lens,
                 heads, kv_heads, dim, block_size, window, scale, num_blocks};
  if (bf16) return dispatch<uint16_t>(q, k, v, out, L, n, threads);
  return dispatch<float>(q, k, v, out, L, n, threads);
}

}  // extern "C"

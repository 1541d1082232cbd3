// The AVX2 + FMA path of zen-mla's native kernel (EPYC Zen 2 / Zen 3, any x86-64 with AVX2 and
// FMA): these CPUs have no bf16 arithmetic (a bf16 GEMM runs a scalar loop there), so every
// product is fp32. Each key block of K and V is converted to fp32 once and packed (K
// transposed, [Dqk][keys], V as it is, [keys][Dv]) for oneDNN's fp32 brgemm micro-kernels
// (AVX2 FMA); the queries of a work item are converted into its tile once; the online softmax
// runs on 8-wide vectors and writes P in fp32 over the scores (no rounding between the two
// products); out is rounded to bf16 (to nearest even) once. Compiled for AVX2 and FMA through
// target attributes only: native.cpp calls this path only where the CPU has them.

#pragma once

#include <immintrin.h>

#include "native_plan.h"

namespace zen_mla_native {
namespace avx2 {

#define ZEN_MLA_AVX2 __attribute__((target("avx2,fma")))

// 2^x: x = i + f with i = floor(x) and f in [0, 1), 2^f by the AVX-512 path's degree-4
// polynomial (relative error 2.6e-6 at most), times 2^i made in the exponent bits. x is held to
// [-127, 128] first: 2^-127 comes out 0 (exponent bits 0), 2^128 inf (the softmax's lazy max
// then falls back to the exact one); NaN stays NaN (max and min keep their second operand).
ZEN_MLA_AVX2 inline __m256 exp2_ps(__m256 x) {
  x = _mm256_min_ps(_mm256_set1_ps(128.f), _mm256_max_ps(_mm256_set1_ps(-127.f), x));
  const __m256 i = _mm256_floor_ps(x);
  const __m256 f = _mm256_sub_ps(x, i);
  __m256 p = _mm256_set1_ps(1.3534167781472206e-2f);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.201146379113197e-2f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.414427548646927e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.930038332939148e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0000026226043701f));
  const __m256i e = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(i), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// n (< 8 allowed) bf16 values from src as fp32, zeros past n.
ZEN_MLA_AVX2 inline __m256 load_bf16(const bf16* src, int64_t n) {
  __m128i h;
  if (n >= 8) {
    h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
  } else {
    alignas(16) uint16_t tmp[8] = {};
    if (n > 0) std::memcpy(tmp, src, size_t(n) * sizeof(bf16));
    h = _mm_load_si128(reinterpret_cast<const __m128i*>(tmp));
  }
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// Eight fp32 values to bf16, rounded to nearest even (NaN stays NaN), n (< 8 allowed) of them
// stored.
ZEN_MLA_AVX2 inline void store_bf16(bf16* dst, __m256 x, int64_t n) {
  __m256i b = _mm256_castps_si256(x);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  b = _mm256_srli_epi32(_mm256_add_epi32(b, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
  // [b0..b3 b0..b3 | b4..b7 b4..b7] as 16-bit words; the two low quarters hold b0..b7
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(b, b), 0x08);
  const __m128i h = _mm256_castsi256_si128(packed);
  if (n >= 8) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), h);
  } else if (n > 0) {
    alignas(16) uint16_t tmp[8];
    _mm_store_si128(reinterpret_cast<__m128i*>(tmp), h);
    std::memcpy(dst, tmp, size_t(n) * sizeof(bf16));
  }
}

// 8 x 8 transpose: r[i] holds row i; afterwards r[j] holds column j.
ZEN_MLA_AVX2 inline void transpose8(__m256 r[8]) {
  __m256 t[8], u[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 2; ++i) {  // rows 4i..4i+3, columns e, e + 4 of each 128-bit lane
    u[4 * i] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
    u[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
    u[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
    u[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
  }
  for (int e = 0; e < 4; ++e) {
    r[e] = _mm256_permute2f128_ps(u[e], u[4 + e], 0x20);
    r[4 + e] = _mm256_permute2f128_ps(u[e], u[4 + e], 0x31);
  }
}

// K^T of one (head, key block) in fp32, its columns [lo, hi) (multiples of 32): dst[d * width
// + n] = K[n0 + n][d], zero for d >= Dqk (to kq) and n >= nn (to the width). 8 x 8 at a time.
ZEN_MLA_AVX2 inline void pack_k(
    const Problem& p, const Seq& s, const KeyBlock& b, int64_t head, int64_t lo, int64_t hi,
    float* dst) {
  const int64_t width = b.width, filled = round_up(p.dqk, 8);
  auto row = [&](int64_t n) { return p.k + (s.kv0 + b.n0 + n) * p.k_s0 + head * p.k_s1; };
  for (int64_t n0 = lo; n0 < hi; n0 += 8) {
    const int64_t live = std::clamp<int64_t>(b.nn - n0, 0, 8);
    for (int64_t d0 = 0; d0 < filled; d0 += 8) {
      __m256 r[8];
      for (int64_t j = 0; j < 8; ++j)
        r[j] = j < live ? load_bf16(row(n0 + j) + d0, p.dqk - d0) : _mm256_setzero_ps();
      transpose8(r);
      for (int64_t j = 0; j < 8; ++j) _mm256_storeu_ps(dst + (d0 + j) * width + n0, r[j]);
    }
  }
  for (int64_t d = filled; d < p.kq; ++d)
    std::memset(dst + d * width + lo, 0, (hi - lo) * sizeof(float));
}

// V of one (head, key block) in fp32, its rows [lo, hi), in chunks of up to 256 columns one
// after the other: chunk c holds dst[c * 256 * width + n * cols + d] = V[n0 + n][256 c + d]
// (`cols` its columns), zero for rows n >= nn (to the width) and columns past Dv.
ZEN_MLA_AVX2 inline void pack_v(
    const Problem& p, const Seq& s, const KeyBlock& b, int64_t head, int64_t lo, int64_t hi,
    float* dst) {
  for (int64_t c0 = 0; c0 < p.nv; c0 += kChunk) {
    const int64_t cols = std::min(kChunk, p.nv - c0);  // a multiple of 64
    float* chunk = dst + c0 * b.width;
    for (int64_t n = lo; n < hi; ++n) {
      float* out = chunk + n * cols;
      if (n >= b.nn) {
        std::memset(out, 0, cols * sizeof(float));
        continue;
      }
      const bf16* src = p.v + (s.kv0 + b.n0 + n) * p.v_s0 + head * p.v_s1 + c0;
      const int64_t live = std::clamp<int64_t>(p.dv - c0, 0, cols);
      for (int64_t d = 0; d < cols; d += 8)
        _mm256_storeu_ps(out + d, d < live ? load_bf16(src + d, live - d) : _mm256_setzero_ps());
    }
  }
}

// The item's rows of q in fp32, Dqk's chunks apart, into the thread's query tile (zeros past
// Dqk).
ZEN_MLA_AVX2 inline void load_queries(
    const Problem& p, const Seq& s, const Unit& u, int64_t head, float* qt) {
  const bf16* q = p.q + (s.q0 + u.r0) * p.q_s0 + head * p.q_s1;
  for (int64_t c0 = 0; c0 < p.kq; c0 += kChunk) {
    const int64_t cols = std::min(kChunk, p.kq - c0);
    const int64_t live = std::clamp<int64_t>(p.dqk - c0, 0, cols);
    float* tile = qt + c0 * p.bm;
    for (int64_t i = 0; i < u.rows; ++i) {
      const bf16* src = q + i * p.q_s0 + c0;
      for (int64_t d = 0; d < cols; d += 8)
        _mm256_storeu_ps(
            tile + i * cols + d, d < live ? load_bf16(src + d, live - d) : _mm256_setzero_ps());
    }
  }
}

ZEN_MLA_AVX2 inline float sum8(__m256 x) {
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}

ZEN_MLA_AVX2 inline float max8(__m256 x) {
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
}

// The first n (< 8) lanes set.
ZEN_MLA_AVX2 inline __m256 lanes8(int64_t n) {
  const __m256i index = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(int(n)), index));
}

// P = 2^(S * scale_log2 - m) of a row's `vis` visible columns into `prow` (fp32; `srow` itself
// may be it) and their sum.
ZEN_MLA_AVX2 inline float exp_row(
    const Problem& p, const float* srow, float* prow, int64_t vis, float m) {
  const int64_t whole = vis & ~int64_t(15);
  const __m256 sl = _mm256_set1_ps(p.scale_log2), vm = _mm256_set1_ps(m);
  __m256 sum0 = _mm256_setzero_ps(), sum1 = _mm256_setzero_ps();
  for (int64_t j = 0; j < whole; j += 16) {
    const __m256 e0 = exp2_ps(_mm256_fmsub_ps(_mm256_loadu_ps(srow + j), sl, vm));
    const __m256 e1 = exp2_ps(_mm256_fmsub_ps(_mm256_loadu_ps(srow + j + 8), sl, vm));
    sum0 = _mm256_add_ps(sum0, e0);
    sum1 = _mm256_add_ps(sum1, e1);
    _mm256_storeu_ps(prow + j, e0);
    _mm256_storeu_ps(prow + j + 8, e1);
  }
  for (int64_t j = whole; j < vis; j += 8) {
    const __m256 live = lanes8(vis - j);
    const __m256 x = _mm256_and_ps(live, _mm256_loadu_ps(srow + j));  // a row has width >= 32
    const __m256 e = _mm256_and_ps(live, exp2_ps(_mm256_fmsub_ps(x, sl, vm)));
    sum0 = _mm256_add_ps(sum0, e);
    _mm256_storeu_ps(prow + j, e);
  }
  return sum8(_mm256_add_ps(sum0, sum1));
}

// The max of a row's `vis` visible scores, times scale_log2.
ZEN_MLA_AVX2 inline float row_max(const Problem& p, const float* srow, int64_t vis) {
  const int64_t whole = vis & ~int64_t(7);
  const __m256 ninf = _mm256_set1_ps(kNegInf);
  __m256 vmax = ninf;
  for (int64_t j = 0; j < whole; j += 8) vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(srow + j));
  if (whole < vis)
    vmax = _mm256_max_ps(vmax, _mm256_blendv_ps(ninf, _mm256_loadu_ps(srow + whole),
                                                 lanes8(vis - whole)));
  return max8(vmax) * p.scale_log2;
}

// The online-softmax step of one query row over one key block: `vis` of the block's `width`
// columns are visible; updates m (base 2, scaled) and l, writes the row of P (fp32, zero from
// `vis` to `width`) over `srow` or elsewhere, and returns the factor the row of acc is to be
// scaled by. As on the AVX-512 path, P is taken against the row's max so far (acc not
// rescaled) while the block's sum of P stays under 2^64; P overwrites S here, so that is
// decided before P is made, from the block's max: where it rises no more than 64 - bits(vis)
// above the row's, no P exceeds 2^64 / vis.
ZEN_MLA_AVX2 inline float softmax_row(
    const Problem& p, const float* srow, float* prow, float& m, float& l, int64_t vis,
    int64_t width) {
  if (vis <= 0) {
    std::memset(prow, 0, width * sizeof(float));
    return 1.f;
  }
  const float block_max = row_max(p, srow, vis);
  const float rise = float(__builtin_clzll(uint64_t(vis)));  // 64 - bits(vis)
  float alpha = 1.f;
  if (m != kNegInf && block_max - m <= rise) {  // false for inf and NaN too
    l += exp_row(p, srow, prow, vis, m);
  } else {
    const float m_new = std::max(m, block_max);
    const float sum = exp_row(p, srow, prow, vis, m_new);
    alpha = m == kNegInf ? 0.f : std::exp2(m - m_new);
    l = l * alpha + sum;
    m = m_new;
  }
  for (int64_t j = round_up(vis, 8); j < width; j += 8)
    _mm256_storeu_ps(prow + j, _mm256_setzero_ps());
  return alpha;
}

ZEN_MLA_AVX2 inline void scale_row(float* row, int64_t n, float alpha) {
  const __m256 va = _mm256_set1_ps(alpha);
  const int64_t whole = n & ~int64_t(7);
  for (int64_t d = 0; d < whole; d += 8)
    _mm256_storeu_ps(row + d, _mm256_mul_ps(va, _mm256_loadu_ps(row + d)));
  for (int64_t d = whole; d < n; ++d) row[d] *= alpha;
}

// n values of out = row * inv in bf16, to `dst` with a stride of `stride` elements.
ZEN_MLA_AVX2 inline void store_row(
    const float* row, int64_t n, float inv, bf16* dst, int64_t stride) {
  const __m256 vinv = _mm256_set1_ps(inv);
  if (stride == 1) {
    const int64_t whole = n & ~int64_t(7);
    for (int64_t d = 0; d < whole; d += 8)
      store_bf16(dst + d, _mm256_mul_ps(_mm256_loadu_ps(row + d), vinv), 8);
    if (whole < n) {
      alignas(32) float tmp[8] = {};
      std::memcpy(tmp, row + whole, size_t(n - whole) * sizeof(float));
      store_bf16(dst + whole, _mm256_mul_ps(_mm256_load_ps(tmp), vinv), n - whole);
    }
    return;
  }
  alignas(16) bf16 tmp[8];
  for (int64_t d = 0; d < n; d += 8) {
    const int64_t live = std::min<int64_t>(8, n - d);
    alignas(32) float vals[8] = {};
    std::memcpy(vals, row + d, size_t(live) * sizeof(float));
    store_bf16(tmp, _mm256_mul_ps(_mm256_load_ps(vals), vinv), 8);
    for (int64_t j = 0; j < live; ++j) dst[(d + j) * stride] = tmp[j];
  }
}

inline void fence() {}  // out is written with ordinary stores

// `iterations` rounds of 12 independent 8-wide FMAs held in registers (12 hide the FMA's
// latency on two pipes: 4-5 cycles on Zen 2 to Zen 5), 192 FLOP a round; returns their sum so
// the loop is kept. The limit of this path's products on one core: `fma_peak` in native.cpp.
ZEN_MLA_AVX2 inline float fma_loop(int64_t iterations) {
  __m256 acc[12];
  for (int j = 0; j < 12; ++j) acc[j] = _mm256_set1_ps(float(j));
  const __m256 a = _mm256_set1_ps(0.999999f), b = _mm256_set1_ps(1e-7f);
  for (int64_t i = 0; i < iterations; ++i)
    for (int j = 0; j < 12; ++j) acc[j] = _mm256_fmadd_ps(acc[j], a, b);
  __m256 sum = acc[0];
  for (int j = 1; j < 12; ++j) sum = _mm256_add_ps(sum, acc[j]);
  return sum8(sum);
}

}  // namespace avx2

// The path as native.cpp's loop takes it (see `Avx512`).
struct Avx2 {
  using T = float;
  static constexpr bool kVnni = false;  // plain fp32 layouts: K^T [Dqk][keys], V [keys][Dv]
  static constexpr bool kProbInScores = true;  // P is fp32, written over S
  static constexpr auto pack_k = &avx2::pack_k;
  static constexpr auto pack_v = &avx2::pack_v;
  static constexpr auto load_queries = &avx2::load_queries;
  static constexpr auto softmax_row = &avx2::softmax_row;
  static constexpr auto scale_row = &avx2::scale_row;
  static constexpr auto store_row = &avx2::store_row;
  static constexpr auto fence = &avx2::fence;
};

}  // namespace zen_mla_native

// The AVX-512 BF16 path of zen-mla's native kernel (Zen 4, Zen 5, Xeons with AMX): K and V
// packed in bf16 in the VNNI layout oneDNN's bf16 brgemm micro-kernels read (AVX-512 BF16
// dot products, or AMX tiles), the online softmax on 16-wide vectors, P rounded to bf16 for
// the P V product. Compiled for AVX-512 BF16 through target attributes only: the module
// loads on any x86-64, and native.cpp calls this path only where the CPU has it.

#pragma once

#include <immintrin.h>

#include "native_plan.h"

namespace zen_mla_native {
namespace avx512 {

#define ZEN_MLA_AVX512 \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma")))

// 2^x: f = x - floor(x) in [0, 1) in one instruction (VREDUCEPS), 2^f by a degree-4
// polynomial fitted for relative error (2.6e-6 at most: a tenth of bf16's rounding of P, and
// the LSE's error from it 2.6e-6 at most), times 2^floor(x) by scalef (0 where it underflows,
// inf where it overflows). Four FMAs and two more instructions: the softmax is the part of a
// key block the AMX tiles wait for.
ZEN_MLA_AVX512 inline __m512 exp2_ps(__m512 x) {
  const __m512 f = _mm512_reduce_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 p = _mm512_set1_ps(1.3534167781472206e-2f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.201146379113197e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.414427548646927e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.930038332939148e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0000026226043701f));
  return _mm512_scalef_ps(p, x);
}

inline __mmask16 tail_mask(int64_t n) {
  return n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1u);
}

// 16 x 16 transpose of 32-bit words: r[i] holds row i; afterwards r[j] holds column j.
ZEN_MLA_AVX512 inline void transpose16(__m512i r[16]) {
  __m512i t[16], u[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  // u[4i + e], 128-bit lane L: rows 4i..4i+3 of column 4L + e
  for (int i = 0; i < 4; ++i) {
    u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int e = 0; e < 4; ++e) {
    __m512i v0 = _mm512_shuffle_i32x4(u[e], u[4 + e], 0x88);
    __m512i v1 = _mm512_shuffle_i32x4(u[8 + e], u[12 + e], 0x88);
    __m512i w0 = _mm512_shuffle_i32x4(u[e], u[4 + e], 0xDD);
    __m512i w1 = _mm512_shuffle_i32x4(u[8 + e], u[12 + e], 0xDD);
    r[e] = _mm512_shuffle_i32x4(v0, v1, 0x88);
    r[8 + e] = _mm512_shuffle_i32x4(v0, v1, 0xDD);
    r[4 + e] = _mm512_shuffle_i32x4(w0, w1, 0x88);
    r[12 + e] = _mm512_shuffle_i32x4(w0, w1, 0xDD);
  }
}

// n of 32 lanes
inline __mmask32 lanes32(int64_t n) {
  return n >= 32 ? ~__mmask32(0) : n <= 0 ? __mmask32(0) : __mmask32((1u << n) - 1u);
}

// K^T of one (head, key block) in VNNI, its columns [lo, hi) (multiples of 32): dst[(d / 2) *
// width * 2 + n * 2 + d % 2] = K[n0 + n][d], zero for d >= Dqk (to kq) and n >= nn (to the
// width). A transpose of 32-bit words (pairs of d), 16 x 16 at a time, the loads masked past
// Dqk; the words past the last 16 that hold any of K zeroed a row at a time.
ZEN_MLA_AVX512 inline void pack_k(
    const Problem& p, const Seq& s, const KeyBlock& b, int64_t head, int64_t lo, int64_t hi,
    bf16* dst) {
  const int64_t bn = b.width, filled = round_up((p.dqk + 1) / 2, 16);  // <= kq / 2
  auto* out = reinterpret_cast<uint32_t*>(dst);
  auto row = [&](int64_t n) { return p.k + (s.kv0 + b.n0 + n) * p.k_s0 + head * p.k_s1; };
  for (int64_t n0 = lo; n0 < hi; n0 += 16) {
    const int64_t live = std::clamp<int64_t>(b.nn - n0, 0, 16);
    for (int64_t i0 = 0; i0 < filled; i0 += 16) {
      const __mmask32 k = lanes32(p.dqk - 2 * i0);
      __m512i r[16];
      for (int64_t j = 0; j < 16; ++j)
        r[j] = j < live ? _mm512_maskz_loadu_epi16(k, row(n0 + j) + 2 * i0)
                        : _mm512_setzero_si512();
      transpose16(r);
      for (int64_t j = 0; j < 16; ++j) _mm512_storeu_si512(out + (i0 + j) * bn + n0, r[j]);
    }
  }
  for (int64_t i = filled; i < p.kq / 2; ++i)
    std::memset(out + i * bn + lo, 0, (hi - lo) * sizeof(uint32_t));
}

// V of one (head, key block) in VNNI, its rows [lo, hi) (multiples of 32), in chunks of up to
// 256 columns one after the other: chunk c holds dst[c * 256 * width + (n / 2) * cols * 2 +
// d * 2 + n % 2] = V[n0 + n][256 c + d] (`cols` its columns), zero for rows n >= nn (to the
// width) and columns past Dv. Pairs of rows interleaved 32 values at a time, the loads masked
// past Dv.
ZEN_MLA_AVX512 inline void pack_v(
    const Problem& p, const Seq& s, const KeyBlock& b, int64_t head, int64_t lo, int64_t hi,
    bf16* dst) {
  alignas(64) static constexpr uint16_t low[32] = {
      0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
      8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  alignas(64) static constexpr uint16_t high[32] = {
      16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
      24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
  const __m512i idx_lo = _mm512_load_si512(low), idx_hi = _mm512_load_si512(high);
  auto row = [&](int64_t n) {
    return n < b.nn ? p.v + (s.kv0 + b.n0 + n) * p.v_s0 + head * p.v_s1 : nullptr;
  };
  for (int64_t c0 = 0; c0 < p.nv; c0 += kChunk) {
    const int64_t cols = std::min(kChunk, p.nv - c0);  // a multiple of 64
    bf16* chunk = dst + c0 * b.width;
    for (int64_t n = lo; n < hi; n += 2) {
      bf16* pair = chunk + n * cols;
      const bf16* a = row(n);
      const bf16* c = row(n + 1);
      for (int64_t d = 0; d < cols; d += 32) {
        const __mmask32 k = lanes32(p.dv - c0 - d);
        __m512i x = a ? _mm512_maskz_loadu_epi16(k, a + c0 + d) : _mm512_setzero_si512();
        __m512i y = c ? _mm512_maskz_loadu_epi16(k, c + c0 + d) : _mm512_setzero_si512();
        _mm512_storeu_si512(pair + 2 * d, _mm512_permutex2var_epi16(x, idx_lo, y));
        _mm512_storeu_si512(pair + 2 * d + 32, _mm512_permutex2var_epi16(x, idx_hi, y));
      }
    }
  }
}

// P = 2^(S * scale_log2 - m) of a row's `vis` visible columns into `prow` (bf16, 32 at a time,
// zeros past `vis` to the next 32) and their sum.
ZEN_MLA_AVX512 inline float exp_row(
    const Problem& p, const float* srow, bf16* prow, int64_t vis, float m) {
  const int64_t whole = vis & ~int64_t(31);
  const __m512 sl = _mm512_set1_ps(p.scale_log2), vm = _mm512_set1_ps(m);
  __m512 sum0 = _mm512_setzero_ps(), sum1 = _mm512_setzero_ps();
  for (int64_t j = 0; j < whole; j += 32) {
    const __m512 e0 = exp2_ps(_mm512_fmsub_ps(_mm512_loadu_ps(srow + j), sl, vm));
    const __m512 e1 = exp2_ps(_mm512_fmsub_ps(_mm512_loadu_ps(srow + j + 16), sl, vm));
    sum0 = _mm512_add_ps(sum0, e0);
    sum1 = _mm512_add_ps(sum1, e1);
    _mm512_storeu_si512(prow + j, (__m512i)_mm512_cvtne2ps_pbh(e1, e0));
  }
  if (whole < vis) {
    const __mmask16 k0 = tail_mask(vis - whole);
    const __mmask16 k1 = tail_mask(std::max<int64_t>(vis - whole - 16, 0));
    const __m512 x0 = _mm512_maskz_loadu_ps(k0, srow + whole);
    const __m512 x1 = _mm512_maskz_loadu_ps(k1, srow + whole + 16);
    const __m512 e0 = _mm512_maskz_mov_ps(k0, exp2_ps(_mm512_fmsub_ps(x0, sl, vm)));
    const __m512 e1 = _mm512_maskz_mov_ps(k1, exp2_ps(_mm512_fmsub_ps(x1, sl, vm)));
    sum0 = _mm512_add_ps(sum0, e0);
    sum1 = _mm512_add_ps(sum1, e1);
    _mm512_storeu_si512(prow + whole, (__m512i)_mm512_cvtne2ps_pbh(e1, e0));
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(sum0, sum1));
}

// The max of a row's `vis` visible scores, times scale_log2.
ZEN_MLA_AVX512 inline float row_max(const Problem& p, const float* srow, int64_t vis) {
  const int64_t whole = vis & ~int64_t(15);
  const __m512 ninf = _mm512_set1_ps(kNegInf);
  __m512 vmax = ninf;
  for (int64_t j = 0; j < whole; j += 16) vmax = _mm512_max_ps(vmax, _mm512_loadu_ps(srow + j));
  if (whole < vis)
    vmax = _mm512_max_ps(vmax, _mm512_mask_loadu_ps(ninf, tail_mask(vis - whole), srow + whole));
  return _mm512_reduce_max_ps(vmax) * p.scale_log2;
}

// The online-softmax step of one query row over one key block: `vis` of the block's columns
// are visible. Updates m (base 2, scaled) and l, writes the row of P (bf16, zero past `vis` up
// to `width`, whole tiles) and returns the factor the row of acc is to be scaled by.
// After a row's first block, P is taken against the max it has (one pass over S, acc not
// rescaled) while the block's sum of P stays under kLazySum; else, and on the first block,
// against the exact max (a pass for the max, one for P).
ZEN_MLA_AVX512 inline float softmax_row(
    const Problem& p, const float* srow, bf16* prow, float& m, float& l, int64_t vis,
    int64_t width) {
  if (vis <= 0) {
    std::memset(prow, 0, width * sizeof(bf16));
    return 1.f;
  }
  for (int64_t j = round_up(vis, kTile); j < width; j += kTile)
    _mm512_storeu_si512(prow + j, _mm512_setzero_si512());
  if (m != kNegInf) {
    const float sum = exp_row(p, srow, prow, vis, m);
    if (sum < kLazySum) {  // false for inf and NaN too
      l += sum;
      return 1.f;
    }
  }
  const float m_new = std::max(m, row_max(p, srow, vis));
  const float sum = exp_row(p, srow, prow, vis, m_new);
  const float alpha = m == kNegInf ? 0.f : std::exp2(m - m_new);
  l = l * alpha + sum;
  m = m_new;
  return alpha;
}

ZEN_MLA_AVX512 inline void scale_row(float* row, int64_t n, float alpha) {
  const __m512 va = _mm512_set1_ps(alpha);
  for (int64_t d = 0; d < n; d += 16) {
    __mmask16 k = tail_mask(n - d);
    _mm512_mask_storeu_ps(row + d, k, _mm512_mul_ps(va, _mm512_maskz_loadu_ps(k, row + d)));
  }
}

// n values of out = row * inv in bf16, to `dst` with a stride of `stride` elements. Whole
// lines of a row (MLA's 128 values: four) go past the caches (streaming stores): a row of out
// is written once and not read here, and an ordinary store first reads the line it writes
// (measured on a Xeon with AMX, 2 threads: `short` 0.77x the time, `mixed` 0.93x, `long` 0.97x).
ZEN_MLA_AVX512 inline void store_row(const float* row, int64_t n, float inv, bf16* dst, int64_t stride) {
  const __m512 vinv = _mm512_set1_ps(inv);
  if (stride == 1 && n % 32 == 0 && reinterpret_cast<uintptr_t>(dst) % 64 == 0) {
    for (int64_t d = 0; d < n; d += 32) {
      const __m512 a = _mm512_mul_ps(_mm512_loadu_ps(row + d), vinv);
      const __m512 b = _mm512_mul_ps(_mm512_loadu_ps(row + d + 16), vinv);
      _mm512_stream_si512(
          reinterpret_cast<__m512i*>(dst + d), (__m512i)_mm512_cvtne2ps_pbh(b, a));
    }
    return;
  }
  if (stride == 1) {
    for (int64_t d = 0; d < n; d += 16) {
      __mmask16 k = tail_mask(n - d);
      __m256bh h = _mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_maskz_loadu_ps(k, row + d), vinv));
      _mm256_mask_storeu_epi16(dst + d, k, (__m256i)h);
    }
    return;
  }
  alignas(32) bf16 tmp[16];
  for (int64_t d = 0; d < n; d += 16) {
    __mmask16 k = tail_mask(n - d);
    __m256bh h = _mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_maskz_loadu_ps(k, row + d), vinv));
    _mm256_store_si256(reinterpret_cast<__m256i*>(tmp), (__m256i)h);
    for (int64_t j = 0; j < std::min<int64_t>(16, n - d); ++j) dst[(d + j) * stride] = tmp[j];
  }
}

// The item's rows of q, Dqk's chunks apart, into the thread's query tile (zeros past Dqk).
// Every line of the rows (a token stride apart in q) is asked for before the copy, so they are
// fetched at once rather than one after another (without, `short`'s 64-row items took 8 %
// longer on a Xeon with AMX).
ZEN_MLA_AVX512 inline void load_queries(
    const Problem& p, const Seq& s, const Unit& u, int64_t head, bf16* qt) {
  const bf16* q = p.q + (s.q0 + u.r0) * p.q_s0 + head * p.q_s1;
  for (int64_t i = 0; i < u.rows; ++i)
    for (int64_t d = 0; d < p.dqk; d += 32) _mm_prefetch(q + i * p.q_s0 + d, _MM_HINT_T0);
  for (int64_t c0 = 0; c0 < p.kq; c0 += kChunk) {
    const int64_t cols = std::min(kChunk, p.kq - c0);
    const int64_t live = std::clamp<int64_t>(p.dqk - c0, 0, cols);
    bf16* tile = qt + c0 * p.bm;
    for (int64_t i = 0; i < u.rows; ++i) {
      const bf16* src = q + i * p.q_s0 + c0;
      for (int64_t d = 0; d < cols; d += 32)
        _mm512_storeu_si512(
            tile + i * cols + d, _mm512_maskz_loadu_epi16(lanes32(live - d), src + d));
    }
  }
}

inline void fence() { _mm_sfence(); }  // rows of out stored past the caches are seen next

}  // namespace avx512

// The path as native.cpp's loop takes it: the element its brgemm calls multiply, their layout,
// and its vector code.
struct Avx512 {
  using T = bf16;
  static constexpr bool kVnni = true;  // K and V packed in pairs, as the bf16 micro-kernels read
  static constexpr bool kProbInScores = false;  // P is bf16, apart from the fp32 scores
  static constexpr auto pack_k = &avx512::pack_k;
  static constexpr auto pack_v = &avx512::pack_v;
  static constexpr auto load_queries = &avx512::load_queries;
  static constexpr auto softmax_row = &avx512::softmax_row;
  static constexpr auto scale_row = &avx512::scale_row;
  static constexpr auto store_row = &avx512::store_row;
  static constexpr auto fence = &avx512::fence;
};

}  // namespace zen_mla_native

// zen-mla's native ragged MLA prefill attention: a flash loop over oneDNN brgemm blocks with the
// query/key head dim (192) and the value head dim (128) apart, so V is never padded to 192.
//
// One call takes the whole varlen batch (flash-attn layout: q [Tq, H, Dqk], k [Tk, H, Dqk],
// v [Tk, H, Dv], bf16, cu_seq_lens) and writes out [Tq, H, Dv] bf16 and, when asked,
// lse [H, Tq] fp32 (natural log), bottom-right causal.
//
//   1. pack: every (head, key block of bn tokens) of K and V into the VNNI layout the bf16
//      brgemm micro-kernels read ([Dqk' / 2][width][2] for K^T, [width / 2][Dv'][2] for V, the
//      head dims rounded up as below, zeros in the padding), all threads; a group of heads at a
//      time where all of them would pass the call's packing budget;
//   2. attend: the work items (sequence, head, block of bm queries) go to the threads largest
//      first through one atomic counter (a causal block's cost is its visible keys); a thread
//      copies the item's queries into its own tile, then runs, per key block, S = Q K^T
//      (brgemm, fp32), the online softmax in fp32 (base-2 exponent, AVX-512), P in bf16,
//      acc += P V (brgemm, fp32), then out = acc / l and lse = m + log(l).
//
// Every brgemm call takes one of a fixed set of shapes, whatever the request: ATen keeps a
// oneDNN kernel per (M, N, K, lda, ldb, ldc, add_C) in a cache of each thread that is never
// freed (20-65 KiB each, measured on a Xeon with AMX), so shapes that followed the head count
// (q's row stride) or the head dims would let clients grow a worker's memory without bound
// (measured: +281 MiB over 1000 head counts and dims, 2 threads). Here:
//   M     the item's rows rounded up to a power of two, 16..bm;
//   K     Dqk rounded up to 64 (64, 128, 192, 256), past 256 to a multiple of 256 taken 256 at
//         a time; lda = K (the query tile's own stride, never q's);
//   N     a key block's width: bn, or a sequence's last block rounded up to a power of two
//         (32..bn); on a causal diagonal bn / 2 where no more keys are seen; ldb = the block's
//         width, ldc = bn;
//   Dv    (N of P V) rounded up to 64 and taken up to 256 columns at a time (64, 128, 192
//         or 256); ldb = ldc = those columns, lda = bn, K = the N of its Q K^T.
// With bm = 128, bn = 256: 4 x 5 x 5 = 100 shapes of Q K^T and 4 x 4 x 4 = 64 of P V, at most
// 164 kernels a thread (~7 MiB) for the life of the process.
//
// The brgemm calls reach oneDNN's AVX-512 BF16 micro-kernels on Zen 4 / Zen 5 and its AMX
// ones on Intel hosts that have AMX. The vector code is compiled for AVX-512 BF16 through
// target attributes only: the module loads on any x86-64, and `cpu_supported()` tells Python
// whether `attend` may be called.

#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>
#include <ATen/record_function.h>
#include <torch/extension.h>

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <vector>

namespace {

#define ZEN_MLA_AVX512 \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma")))

using bf16 = at::BFloat16;

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

struct AlignedFree {
  void operator()(void* p) const { std::free(p); }
};

template <typename T>
std::unique_ptr<T[], AlignedFree> aligned(int64_t n) {
  size_t bytes = ((size_t(std::max<int64_t>(n, 1)) * sizeof(T)) + 63) / 64 * 64;
  void* p = std::aligned_alloc(64, bytes);
  TORCH_CHECK(p != nullptr, "zen_mla native: out of memory for ", bytes, " bytes");
  return std::unique_ptr<T[], AlignedFree>(static_cast<T*>(p));
}

// The packed K and V of a call (tens of MB) are reused from call to call: a fresh mapping
// costs its page faults every time (measured 40 ms for the 84 MB of 8192 keys, half a `chunk`
// call on a Zen 4). One buffer is kept, up to kKeepBytes; a concurrent call allocates its own.
constexpr size_t kKeepBytes = size_t(256) << 20;

class PackBuffer {
 public:
  explicit PackBuffer(size_t bytes) : bytes_(bytes) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (kept_ && kept_bytes_ >= bytes) {
        ptr_ = std::move(kept_);
        bytes_ = kept_bytes_;
        return;
      }
    }
    void* p = std::aligned_alloc(64, (std::max<size_t>(bytes, 1) + 63) / 64 * 64);  // never 0
    TORCH_CHECK(p != nullptr, "zen_mla native: out of memory for ", bytes, " bytes");
    ptr_.reset(static_cast<char*>(p));
  }
  ~PackBuffer() {
    if (bytes_ > kKeepBytes) return;
    std::lock_guard<std::mutex> lock(mutex_);
    if (!kept_ || kept_bytes_ < bytes_) {
      kept_ = std::move(ptr_);
      kept_bytes_ = bytes_;
    }
  }
  char* get() const { return ptr_.get(); }

 private:
  std::unique_ptr<char[], AlignedFree> ptr_;
  size_t bytes_;
  static inline std::mutex mutex_;
  static inline std::unique_ptr<char[], AlignedFree> kept_;
  static inline size_t kept_bytes_ = 0;
};

// 2^x for x <= 0, x >= -126 after the clamp; relative error ~2e-7 (degree-6 Taylor on
// [-0.5, 0.5] about 0, the exponent by scalef).
ZEN_MLA_AVX512 inline __m512 exp2_ps(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-126.f));
  __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(1.5403530393381606e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076284772e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821580e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650695910071e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718055994531e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

inline __mmask16 tail_mask(int64_t n) {
  return n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1u);
}

// The widest a brgemm call takes of Dqk (its K in S = Q K^T) and of Dv (its N in acc += P V);
// wider head dims are taken in chunks of it.
constexpr int64_t kChunk = 256;

constexpr int64_t round_up(int64_t n, int64_t step) { return (n + step - 1) / step * step; }

// n rounded up to a power of two within [lo, hi]; hi itself where n reaches it.
inline int64_t pow2_bucket(int64_t n, int64_t lo, int64_t hi) {
  if (n >= hi) return hi;
  int64_t b = lo;
  while (b < n) b *= 2;
  return std::min(b, hi);
}

// Dqk as the brgemm calls take it: rounded up to 64 (64, 128, 192, 256), past 256 to a
// multiple of 256 (chunks of 256, summed into S).
constexpr int64_t qk_depth(int64_t dqk) {
  return dqk <= kChunk ? round_up(dqk, 64) : round_up(dqk, kChunk);
}

// Dv's packed columns: rounded up to 64, chunks of 256 (the last 64, 128, 192 or 256).
constexpr int64_t v_columns(int64_t dv) { return round_up(dv, 64); }

// One sequence of the batch.
struct Seq {
  int64_t q0, kv0, sq, sk;
  int64_t first_block;  // its first key block in the packed buffers
};

// One key block: which sequence, which tokens (`nn` of them from `n0`), its packed width
// (bn, or a last block's `nn` rounded up to a power of two from 32: AMX's bf16 tiles take keys
// 32 deep, and a block's width is the ldb of its brgemm calls) and where its columns start
// among all the blocks' (`col`).
struct KeyBlock {
  int64_t seq, n0, nn, width, col;
};

// One block of queries of one sequence, for every head: its cost in visible query-key pairs,
// and the run of the sequence's units of that cost it is in (`run0`, `run_len` of them).
struct Unit {
  int64_t seq, r0, rows, kend, cost, run0, run_len;
};

struct Problem {
  const bf16* q;
  const bf16* k;
  const bf16* v;
  bf16* out;
  float* lse;  // nullptr: not asked
  int64_t q_s0, q_s1, k_s0, k_s1, v_s0, v_s1, o_s0, o_s1, o_s2, l_s0, l_s1;
  int64_t dqk, dv, bm, bn;
  int64_t kq;  // qk_depth(dqk)
  int64_t nv;  // v_columns(dv)
  float scale_log2;  // the score scale times log2(e): the softmax runs in base 2
  bool causal;
};

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

// K^T of one (head, key block) in VNNI: dst[(d / 2) * width * 2 + n * 2 + d % 2] =
// K[n0 + n][d], zero for d >= Dqk (to kq) and n >= nn (to the width). A transpose of 32-bit
// words (pairs of d), 16 x 16 at a time, the loads masked past Dqk; the words past the last 16
// that hold any of K zeroed a row at a time.
ZEN_MLA_AVX512 void pack_k(
    const Problem& p, const Seq& s, const KeyBlock& b, int64_t head, bf16* dst) {
  const int64_t bn = b.width, filled = round_up((p.dqk + 1) / 2, 16);  // <= kq / 2
  auto* out = reinterpret_cast<uint32_t*>(dst);
  auto row = [&](int64_t n) { return p.k + (s.kv0 + b.n0 + n) * p.k_s0 + head * p.k_s1; };
  for (int64_t n0 = 0; n0 < bn; n0 += 16) {
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
  std::memset(out + filled * bn, 0, (p.kq / 2 - filled) * bn * sizeof(uint32_t));
}

// V of one (head, key block) in VNNI, in chunks of up to 256 columns one after the other:
// chunk c holds dst[c * 256 * width + (n / 2) * cols * 2 + d * 2 + n % 2] = V[n0 + n][256 c + d]
// (`cols` its columns), zero for rows n >= nn (to the width) and columns past Dv. Pairs of rows
// interleaved 32 values at a time, the loads masked past Dv.
ZEN_MLA_AVX512 void pack_v(
    const Problem& p, const Seq& s, const KeyBlock& b, int64_t head, bf16* dst) {
  alignas(64) static constexpr uint16_t lo[32] = {
      0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
      8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  alignas(64) static constexpr uint16_t hi[32] = {
      16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
      24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
  const __m512i idx_lo = _mm512_load_si512(lo), idx_hi = _mm512_load_si512(hi);
  auto row = [&](int64_t n) {
    return n < b.nn ? p.v + (s.kv0 + b.n0 + n) * p.v_s0 + head * p.v_s1 : nullptr;
  };
  for (int64_t c0 = 0; c0 < p.nv; c0 += kChunk) {
    const int64_t cols = std::min(kChunk, p.nv - c0);  // a multiple of 64
    bf16* chunk = dst + c0 * b.width;
    for (int64_t n = 0; n < b.width; n += 2) {
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

// Per-thread scratch: the query tile, scores, probabilities, accumulator, running max and sum.
// The query tile holds chunk c of Dqk at c * bm * 256 as [bm][its columns]; the accumulator
// chunk c of Dv the same way.
struct Scratch {
  std::unique_ptr<bf16[], AlignedFree> qt;
  std::unique_ptr<float[], AlignedFree> s, acc, m, l;
  std::unique_ptr<bf16[], AlignedFree> prob;
  Scratch(int64_t bm, int64_t bn, int64_t kq, int64_t nv)
      : qt(aligned<bf16>(bm * kq)),
        s(aligned<float>(bm * bn)),
        acc(aligned<float>(bm * nv)),
        m(aligned<float>(bm)),
        l(aligned<float>(bm)),
        prob(aligned<bf16>(bm * bn)) {
    // rows past an item's own (to M's bucket) are multiplied and never read: keep them finite
    std::memset(qt.get(), 0, bm * kq * sizeof(bf16));
    std::memset(prob.get(), 0, bm * bn * sizeof(bf16));
  }
};

// The online-softmax step of one query row over one key block: `vis` of the block's columns
// are visible. Updates m (base 2, scaled) and l, writes the row of P (bf16, zero past `vis` up
// to `width`) and returns the factor the row of acc is to be scaled by.
ZEN_MLA_AVX512 float softmax_row(
    const Problem& p, float* srow, bf16* prow, float& m, float& l, int64_t vis, int64_t width) {
  if (vis <= 0) {
    std::memset(prow, 0, width * sizeof(bf16));
    return 1.f;
  }
  const __m512 sl = _mm512_set1_ps(p.scale_log2);
  __m512 vmax = _mm512_set1_ps(kNegInf);
  for (int64_t j = 0; j < vis; j += 16) {
    __mmask16 k = tail_mask(vis - j);
    __m512 x = _mm512_mask_loadu_ps(_mm512_set1_ps(kNegInf), k, srow + j);
    vmax = _mm512_max_ps(vmax, x);
  }
  const float m_new = std::max(m, _mm512_reduce_max_ps(vmax) * p.scale_log2);
  const __m512 vm = _mm512_set1_ps(m_new);
  __m512 vsum = _mm512_setzero_ps();
  for (int64_t j = 0; j < width; j += 16) {
    const int64_t left = width - j;
    __mmask16 store = tail_mask(left);
    __mmask16 live = tail_mask(std::max<int64_t>(0, std::min<int64_t>(vis - j, 16)));
    __m512 x = _mm512_maskz_loadu_ps(live, srow + j);
    __m512 e = _mm512_maskz_mov_ps(live, exp2_ps(_mm512_fmsub_ps(x, sl, vm)));
    vsum = _mm512_add_ps(vsum, e);
    __m256bh h = _mm512_cvtneps_pbh(e);
    _mm256_mask_storeu_epi16(prow + j, store, (__m256i)h);
  }
  const float alpha = m == kNegInf ? 0.f : std::exp2(m - m_new);
  l = l * alpha + _mm512_reduce_add_ps(vsum);
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

// n values of out = row * inv in bf16, to `dst` with a stride of `stride` elements.
ZEN_MLA_AVX512 inline void store_row(const float* row, int64_t n, float inv, bf16* dst, int64_t stride) {
  const __m512 vinv = _mm512_set1_ps(inv);
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
ZEN_MLA_AVX512 void load_queries(
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

ZEN_MLA_AVX512 void attend_item(
    const Problem& p, const Seq& s, const Unit& u, int64_t head, const KeyBlock* blocks,
    const bf16* packed_k, const bf16* packed_v, Scratch& w) {
  const int64_t bm = p.bm, bn = p.bn, rows = u.rows;
  const int64_t mb = rows == bm ? bm : pow2_bucket(rows, 16, bm);  // M of every call
  load_queries(p, s, u, head, w.qt.get());
  std::fill(w.m.get(), w.m.get() + rows, kNegInf);
  std::fill(w.l.get(), w.l.get() + rows, 0.f);
  for (int64_t c0 = 0; c0 < p.nv; c0 += kChunk)
    std::memset(w.acc.get() + c0 * bm, 0, rows * std::min(kChunk, p.nv - c0) * sizeof(float));
  const int64_t shift = s.sk - s.sq;  // query i sees keys j <= i + shift (causal)
  const int64_t nb = (u.kend + bn - 1) / bn;
  for (int64_t b = 0; b < nb; ++b) {
    const KeyBlock& kb = blocks[s.first_block + b];
    const int64_t n0 = kb.n0, nn = std::min(kb.nn, u.kend - n0);
    // a causal diagonal's block is multiplied only as far as its first half where the item
    // sees no further (the padding's scores are computed, K is zero there or a key past the
    // diagonal, and masked)
    const int64_t half = bn / 2;
    const int64_t width = kb.width == bn && half % 32 == 0 && nn <= half ? half : kb.width;
    const bf16* kp = packed_k + kb.col * p.kq;
    const bf16* vp = packed_v + kb.col * p.nv;
    for (int64_t c0 = 0; c0 < p.kq; c0 += kChunk) {
      const int64_t depth = std::min(kChunk, p.kq - c0);
      at::native::cpublas::brgemm(
          mb, width, depth, depth, kb.width, bn, c0 > 0, w.qt.get() + c0 * bm,
          kp + c0 * kb.width, w.s.get(), true);
    }
    for (int64_t i = 0; i < rows; ++i) {
      const int64_t vis = p.causal ? std::min(nn, u.r0 + i + shift - n0 + 1) : nn;
      const float alpha =
          softmax_row(p, w.s.get() + i * bn, w.prob.get() + i * bn, w.m[i], w.l[i], vis, width);
      if (alpha != 1.f) {
        for (int64_t c0 = 0; c0 < p.nv; c0 += kChunk) {
          const int64_t cols = std::min(kChunk, p.nv - c0);
          scale_row(w.acc.get() + c0 * bm + i * cols, std::min(cols, p.dv - c0), alpha);
        }
      }
    }
    for (int64_t c0 = 0; c0 < p.nv; c0 += kChunk) {
      const int64_t cols = std::min(kChunk, p.nv - c0);
      at::native::cpublas::brgemm(
          mb, cols, width, bn, cols, cols, true, w.prob.get(), vp + c0 * kb.width,
          w.acc.get() + c0 * bm, true);
    }
  }
  // out = acc / l and lse = (m + log2 l) ln 2; rows that saw no key: out 0, lse -inf
  for (int64_t i = 0; i < rows; ++i) {
    const int64_t t = s.q0 + u.r0 + i;
    const bool blind = !(w.l[i] > 0.f);
    const float inv = blind ? 0.f : 1.f / w.l[i];
    bf16* orow = p.out + t * p.o_s0 + head * p.o_s1;
    for (int64_t c0 = 0; c0 < p.nv && c0 < p.dv; c0 += kChunk) {
      const int64_t cols = std::min(kChunk, p.nv - c0);
      store_row(
          w.acc.get() + c0 * bm + i * cols, std::min(cols, p.dv - c0), inv, orow + c0 * p.o_s2,
          p.o_s2);
    }
    if (p.lse)
      p.lse[head * p.l_s0 + t * p.l_s1] = blind ? kNegInf : (w.m[i] + std::log2(w.l[i])) * kLn2;
  }
}

void check(const at::Tensor& t, const char* name, int64_t dim, bool unit_stride = true) {
  TORCH_CHECK(t.device().is_cpu(), "zen_mla native: ", name, " must be on the CPU");
  TORCH_CHECK(t.dim() == 3, "zen_mla native: ", name, " must be [T, H, D], got ", t.sizes());
  TORCH_CHECK(
      t.scalar_type() == at::kBFloat16, "zen_mla native: ", name, " must be bfloat16, got ",
      t.scalar_type());
  TORCH_CHECK(t.size(2) == dim, "zen_mla native: ", name, " head dim ", t.size(2), " != ", dim);
  TORCH_CHECK(
      !unit_stride || t.stride(2) == 1, "zen_mla native: ", name, " needs a unit last stride");
}

}  // namespace

// Whether this CPU runs the vector code (AVX-512 F/BW/VL/DQ and BF16).
bool cpu_supported() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
         __builtin_cpu_supports("avx512bf16");
}

// Ragged attention into `out` [Tq, H, Dv] (any strides) and `lse` [H, Tq] fp32 when defined.
// cu_seq_lens: int64 CPU tensors of B + 1 offsets, validated by the caller. The packed K and V
// of all heads take at most `max_pack_bytes` (0: no limit), or one head's where that is more:
// heads are packed and attended a group at a time.
void attend(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& q_cu,
    const at::Tensor& kv_cu, double scale, bool causal, at::Tensor& out,
    const c10::optional<at::Tensor>& lse, int64_t bm, int64_t bn, int64_t max_pack_bytes) {
  TORCH_CHECK(cpu_supported(), "zen_mla native: this CPU lacks AVX-512 BF16");
  RECORD_FUNCTION("zen_mla::native_attend", std::vector<c10::IValue>());  // for torch.profiler
  const int64_t heads = q.size(1), dqk = q.size(2), dv = v.size(2);
  check(q, "q", dqk);
  check(k, "k", dqk);
  check(v, "v", dv);
  check(out, "out", dv, false);
  TORCH_CHECK(dqk > 0 && dv > 0, "zen_mla native: head dims must be positive");
  // key blocks are 32 wide at their tails (AMX tiles): a block of bn keys must be whole 32s
  TORCH_CHECK(bm > 0 && bn > 0 && bn % 32 == 0, "zen_mla native: bad blocks ", bm, "x", bn);
  TORCH_CHECK(max_pack_bytes >= 0, "zen_mla native: max_pack_bytes < 0");
  TORCH_CHECK(k.size(1) == heads && v.size(1) == heads && out.size(1) == heads);
  TORCH_CHECK(k.size(0) == v.size(0) && out.size(0) == q.size(0), "zen_mla native: token counts");
  TORCH_CHECK(q_cu.device().is_cpu() && kv_cu.device().is_cpu() && q_cu.dim() == 1);
  TORCH_CHECK(q_cu.scalar_type() == at::kLong && kv_cu.scalar_type() == at::kLong);
  TORCH_CHECK(q_cu.is_contiguous() && kv_cu.is_contiguous() && q_cu.numel() == kv_cu.numel());
  TORCH_CHECK(q_cu.numel() >= 1, "zen_mla native: cu_seq_lens need B + 1 >= 1 entries");
  float* lse_ptr = nullptr;
  int64_t l_s0 = 0, l_s1 = 0;
  if (lse.has_value() && lse->defined()) {
    TORCH_CHECK(lse->device().is_cpu() && lse->scalar_type() == at::kFloat && lse->dim() == 2);
    TORCH_CHECK(lse->size(0) == heads && lse->size(1) == q.size(0), "zen_mla native: lse shape");
    lse_ptr = lse->data_ptr<float>();
    l_s0 = lse->stride(0);
    l_s1 = lse->stride(1);
  }
  if (heads == 0) return;
  const int64_t kq = qk_depth(dqk), nv = v_columns(dv);
  Problem p{
      q.data_ptr<bf16>(), k.data_ptr<bf16>(), v.data_ptr<bf16>(), out.data_ptr<bf16>(), lse_ptr,
      q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
      out.stride(0), out.stride(1), out.stride(2), l_s0, l_s1, dqk, dv, bm, bn, kq, nv,
      float(scale * kLog2e), causal};

  const int64_t nseq = q_cu.numel() - 1;
  const int64_t* qc = q_cu.data_ptr<int64_t>();
  const int64_t* kc = kv_cu.data_ptr<int64_t>();
  // validated by the caller; checked again here, as every offset is memory this reads
  TORCH_CHECK(qc[0] >= 0 && kc[0] >= 0, "zen_mla native: negative cu_seq_lens");
  int64_t nblocks = 0, nunits = 0;
  for (int64_t i = 0; i < nseq; ++i) {
    TORCH_CHECK(
        qc[i] <= qc[i + 1] && kc[i] <= kc[i + 1] && qc[i + 1] <= q.size(0) &&
            kc[i + 1] <= k.size(0),
        "zen_mla native: cu_seq_lens must rise and stay within q and k, at sequence ", i);
    nblocks += (kc[i + 1] - kc[i] + bn - 1) / bn;
    nunits += (qc[i + 1] - qc[i] + bm - 1) / bm;
  }
  std::vector<Seq> seqs;
  std::vector<KeyBlock> blocks;
  std::vector<Unit> units;
  seqs.reserve(nseq);
  blocks.reserve(nblocks);
  units.reserve(nunits);
  int64_t columns = 0;  // packed key columns of one head: the blocks' widths summed
  for (int64_t i = 0; i < nseq; ++i) {
    Seq s{qc[i], kc[i], qc[i + 1] - qc[i], kc[i + 1] - kc[i], int64_t(blocks.size())};
    seqs.push_back(s);
    for (int64_t n0 = 0; n0 < s.sk; n0 += bn) {
      const int64_t nn = std::min(bn, s.sk - n0), width = pow2_bucket(nn, 32, bn);
      blocks.push_back({i, n0, nn, width, columns});
      columns += width;
    }
    for (int64_t r0 = 0; r0 < s.sq; r0 += bm) {
      const int64_t rows = std::min(bm, s.sq - r0);
      // keys the block's last row sees (causal), or all of them
      const int64_t kend = causal ? std::clamp<int64_t>(r0 + rows + s.sk - s.sq, 0, s.sk) : s.sk;
      units.push_back({i, r0, rows, kend, rows * kend, 0, 0});
    }
  }
  // largest first: the long causal blocks start early, the short ones fill the gaps
  std::stable_sort(units.begin(), units.end(), [](const Unit& a, const Unit& b) {
    return a.cost > b.cost;
  });
  for (size_t a = 0, b = 0; a < units.size(); a = b) {
    while (b < units.size() && units[b].cost == units[a].cost && units[b].seq == units[a].seq)
      ++b;
    for (size_t x = a; x < b; ++x) {
      units[x].run0 = int64_t(a);
      units[x].run_len = int64_t(b - a);
    }
  }

  // packed layout of a group of g heads: [g][columns][kq] for K, [g][columns][nv] for V, each
  // block in VNNI
  const int64_t head_bytes = columns * (kq + nv) * int64_t(sizeof(bf16));
  const int64_t group =
      max_pack_bytes == 0 || head_bytes == 0
          ? heads
          : std::clamp<int64_t>(max_pack_bytes / head_bytes, 1, heads);
  const size_t k_bytes = size_t(group * columns * kq) * sizeof(bf16);
  PackBuffer packed(size_t(group * head_bytes));
  bf16* const packed_k = reinterpret_cast<bf16*>(packed.get());
  bf16* const packed_v = reinterpret_cast<bf16*>(packed.get() + k_bytes);
  const int64_t nu = int64_t(units.size());
  for (int64_t h0 = 0; h0 < heads; h0 += group) {
    const int64_t hg = std::min(group, heads - h0);
    at::parallel_for(0, hg * nblocks, 1, [&](int64_t begin, int64_t end) {
      for (int64_t x = begin; x < end; ++x) {
        const int64_t h = x / nblocks, b = x % nblocks;
        const KeyBlock& kb = blocks[b];
        pack_k(p, seqs[kb.seq], kb, h0 + h, packed_k + (h * columns + kb.col) * kq);
        pack_v(p, seqs[kb.seq], kb, h0 + h, packed_v + (h * columns + kb.col) * nv);
      }
    });
    // item x: of the run of units unit x / hg is in, hg x run_len items, head by head: as
    // the work items of one cost go by (sequence, head, query block), one head's query blocks
    // of a sequence follow each other and find its packed K and V in cache
    std::atomic<int64_t> next{0};
    const int64_t nitems = nu * hg;
    const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), nitems));
    at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
      Scratch w(bm, bn, kq, nv);
      for (int64_t t = begin; t < end; ++t) {
        for (int64_t x = next.fetch_add(1); x < nitems; x = next.fetch_add(1)) {
          const Unit& first = units[x / hg];
          const int64_t y = x - first.run0 * hg, h = y / first.run_len;
          const Unit& u = units[first.run0 + y % first.run_len];
          attend_item(
              p, seqs[u.seq], u, h0 + h, blocks.data(), packed_k + h * columns * kq,
              packed_v + h * columns * nv, w);
        }
      }
      at::native::cpublas::brgemm_release(true);
    });
  }
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "zen-mla's native ragged MLA prefill attention (AVX-512 BF16 / AMX brgemm)";
  m.def("cpu_supported", &cpu_supported, "whether this CPU runs the kernel (AVX-512 BF16)");
  m.def(
      "attend", &attend, "ragged attention into out (and lse)", py::arg("q"), py::arg("k"),
      py::arg("v"), py::arg("q_cu_seq_lens"), py::arg("kv_cu_seq_lens"), py::arg("scale"),
      py::arg("causal"), py::arg("out"), py::arg("lse"), py::arg("bm") = 128,
      py::arg("bn") = 256, py::arg("max_pack_bytes") = 0,
      py::call_guard<py::gil_scoped_release>());
}

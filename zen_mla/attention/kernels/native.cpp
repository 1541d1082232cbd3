// zen-mla's native ragged MLA prefill attention: a flash loop over oneDNN brgemm blocks with the
// query/key head dim (192) and the value head dim (128) apart, so V is never padded to 192.
//
// One call takes the whole varlen batch (flash-attn layout: q [Tq, H, Dqk], k [Tk, H, Dqk],
// v [Tk, H, Dv], bf16, cu_seq_lens) and writes out [Tq, H, Dv] bf16 and, when asked,
// lse [H, Tq] fp32 (natural log), bottom-right causal.
//
//   1. pack: every (head, key block of bn tokens) of K and V into the VNNI layout the bf16
//      brgemm micro-kernels read ([Dqk' / 2][width][2] for K^T, [width / 2][Dv'][2] for V, the
//      head dims rounded up as below, zeros in the padding), all threads, slices of 64 keys
//      for all heads at a time; a group of heads at a time where all of them would pass the
//      call's packing budget. A sequence of one block of queries is not packed here: its items
//      pack each key block into their own tiles as they reach it (`Seq::packs_own`);
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
// With bm = 128, bn = 256 (Zen): 4 x 5 x 5 = 100 shapes of Q K^T and 4 x 4 x 4 = 64 of P V, at
// most 164 kernels a thread (~7 MiB) for the life of the process; with bm = 256, bn = 512
// (AMX): 5 x 6 x 5 + 5 x 4 x 5 = 250 (~11 MiB). The blocks are the caller's (`blocks()` in
// native.py), per CPU.
//
// The brgemm calls reach oneDNN's AVX-512 BF16 micro-kernels on Zen 4 / Zen 5 and its AMX
// ones on Intel hosts that have AMX. The vector code is compiled for AVX-512 BF16 through
// target attributes only: the module loads on any x86-64, and `cpu_supported()` tells Python
// whether `torch.ops.zen_mla.native_attend` may be called.
//
// The kernel is the torch operator `zen_mla::native_attend` (schema below, its CPU kernel
// `attend`): importing the module registers it. Its fake kernel, for tracing, is native.py's.

#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>
#include <torch/extension.h>

#include <immintrin.h>

#include <x86intrin.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
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

// The widest a brgemm call takes of Dqk (its K in S = Q K^T) and of Dv (its N in acc += P V);
// wider head dims are taken in chunks of it.
constexpr int64_t kChunk = 256;

// bf16 values an AMX tile takes in depth (64 bytes, as many as one AVX-512 register holds):
// keys come in whole tiles, so every key block's width is a multiple of it (the narrowest block
// is one tile), and a row of P is written and zeroed a tile at a time.
constexpr int64_t kTile = 32;

// Rows of an AMX tile: the fewest queries (M) a brgemm call is given.
constexpr int64_t kTileRows = 16;

// Keys of one packing item (whole tiles)
constexpr int64_t kPackSlice = 64;
static_assert(kPackSlice % kTile == 0, "a packing item takes whole tiles of keys");

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

// Where a call's time goes, in TSC ticks summed over its threads (`attend`'s `parts`): the
// packing of K and V, each item's queries into its tile, the Q K^T tiles, the online softmax,
// the P V tiles, and out and lse written. A few reads of the TSC per key block: ~0.1 % of it.
enum Part { kPack, kQueries, kScores, kSoftmax, kValues, kStore, kParts };
using Ticks = std::array<uint64_t, kParts>;

// Adds the ticks since the last mark to a part.
class Clock {
 public:
  explicit Clock(Ticks& ticks) : ticks_(ticks), last_(__rdtsc()) {}
  void mark(Part part) {
    const uint64_t now = __rdtsc();
    ticks_[part] += now - last_;
    last_ = now;
  }

 private:
  Ticks& ticks_;
  uint64_t last_;
};

// One sequence of the batch.
struct Seq {
  int64_t q0, kv0, sq, sk;
  int64_t first_block;  // its first key block in the call's list of them
  // one block of queries (sq <= bm): each of its key blocks is read by one work item a head,
  // which packs it into its own tiles right before (in L2 when multiplied) rather than into
  // the call's packed buffers ahead (written to memory and read back: a third of `chunk`'s
  // time, 256 queries over 2048 keys, on a Xeon with AMX)
  bool packs_own;
};

// One key block: which sequence, which tokens (`nn` of them from `n0`), its packed width
// (bn, or a last block's `nn` rounded up to a power of two from kTile: AMX's bf16 tiles take
// keys kTile deep, and a block's width is the ldb of its brgemm calls) and where its columns
// start among the packed blocks' (`col`; -1 where its sequence packs its own:
// `Seq::packs_own`).
struct KeyBlock {
  int64_t seq, n0, nn, width, col;
};

// One block of queries of one sequence, for every head: its cost in visible query-key pairs,
// and the run of the sequence's units of that cost it is in (`run0`, `run_len` of them).
struct Unit {
  int64_t seq, r0, rows, kend, cost, run0, run_len;
};

// A call's tensors (their data and strides, in elements), head dims, blocks and options; set
// field by field in `attend`.
struct Problem {
  const bf16* q = nullptr;
  const bf16* k = nullptr;
  const bf16* v = nullptr;
  bf16* out = nullptr;
  float* lse = nullptr;  // nullptr: not asked
  int64_t q_s0 = 0, q_s1 = 0;  // q's token and head strides
  int64_t k_s0 = 0, k_s1 = 0;
  int64_t v_s0 = 0, v_s1 = 0;
  int64_t o_s0 = 0, o_s1 = 0, o_s2 = 0;  // out's token, head and column strides
  int64_t l_s0 = 0, l_s1 = 0;  // lse's head and token strides
  int64_t dqk = 0, dv = 0, bm = 0, bn = 0;
  int64_t kq = 0;  // qk_depth(dqk)
  int64_t nv = 0;  // v_columns(dv)
  float scale_log2 = 0.f;  // the score scale times log2(e): the softmax runs in base 2
  bool causal = false;
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

// K^T of one (head, key block) in VNNI, its columns [lo, hi) (multiples of 32): dst[(d / 2) *
// width * 2 + n * 2 + d % 2] = K[n0 + n][d], zero for d >= Dqk (to kq) and n >= nn (to the
// width). A transpose of 32-bit words (pairs of d), 16 x 16 at a time, the loads masked past
// Dqk; the words past the last 16 that hold any of K zeroed a row at a time.
ZEN_MLA_AVX512 void pack_k(
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
ZEN_MLA_AVX512 void pack_v(
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

// Per-thread scratch: the query tile, scores, probabilities, accumulator, running max and sum,
// and one packed K and V block (`Seq::packs_own`).
// The query tile holds chunk c of Dqk at c * bm * 256 as [bm][its columns]; the accumulator
// chunk c of Dv the same way. Rows past an item's own (to M's bucket) are multiplied and never
// read. One buffer a thread is kept from call to call, up to kKeepScratch bytes (MLA's: ~0.45
// MiB at 128 x 256 blocks, ~1.3 MiB at 256 x 512), and grown where a call needs more: a fresh
// one per call cost its page faults, and with head dims changing from call to call its many
// sizes grew the allocator's arenas (measured on a Xeon with AMX: +119 MiB over 4000 calls of
// distinct head dims, against +41 MiB with 128 x 256 blocks).
constexpr size_t kKeepScratch = size_t(8) << 20;

struct Scratch {
  bf16* qt;
  float *s, *acc, *m, *l;
  bf16 *prob, *kblock, *vblock;
  std::unique_ptr<char[], AlignedFree> own;  // a call's own, past kKeepScratch

  Scratch(int64_t bm, int64_t bn, int64_t kq, int64_t nv) {
    thread_local std::unique_ptr<char[], AlignedFree> kept;
    thread_local size_t kept_bytes = 0;
    const size_t sizes[8] = {
        size_t(bm * kq) * sizeof(bf16), size_t(bm * bn) * sizeof(float),
        size_t(bm * nv) * sizeof(float), size_t(bm) * sizeof(float), size_t(bm) * sizeof(float),
        size_t(bm * bn) * sizeof(bf16), size_t(bn * kq) * sizeof(bf16),
        size_t(bn * nv) * sizeof(bf16)};
    size_t total = 0;
    for (size_t n : sizes) total += (n + 63) / 64 * 64;
    char* base = kept.get();
    if (total > kept_bytes) {
      auto fresh = aligned<char>(int64_t(total));
      std::memset(fresh.get(), 0, total);  // finite from the start, whatever rows a call leaves
      base = fresh.get();
      if (total <= kKeepScratch) {
        kept = std::move(fresh);
        kept_bytes = total;
      } else {
        own = std::move(fresh);
      }
    }
    char* at = base;
    auto take = [&](size_t n) {
      char* here = at;
      at += (n + 63) / 64 * 64;
      return here;
    };
    qt = reinterpret_cast<bf16*>(take(sizes[0]));
    s = reinterpret_cast<float*>(take(sizes[1]));
    acc = reinterpret_cast<float*>(take(sizes[2]));
    m = reinterpret_cast<float*>(take(sizes[3]));
    l = reinterpret_cast<float*>(take(sizes[4]));
    prob = reinterpret_cast<bf16*>(take(sizes[5]));
    kblock = reinterpret_cast<bf16*>(take(sizes[6]));
    vblock = reinterpret_cast<bf16*>(take(sizes[7]));
  }
};

// A block's P is taken against the max its row had before (`softmax_row`) while the block's sum
// of P stays under this: then no P exceeds it, and P, l and acc stay far within bf16's and
// fp32's range (2^64 against 2^127), at their relative precision.
constexpr float kLazySum = 18446744073709551616.f;  // 2^64

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
ZEN_MLA_AVX512 float softmax_row(
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
    const bf16* packed_k, const bf16* packed_v, Scratch& w, Ticks& ticks) {
  Clock clock(ticks);
  const int64_t bm = p.bm, bn = p.bn, rows = u.rows;
  const int64_t mb = rows == bm ? bm : pow2_bucket(rows, kTileRows, bm);  // M of every call
  load_queries(p, s, u, head, w.qt);
  std::fill(w.m, w.m + rows, kNegInf);
  std::fill(w.l, w.l + rows, 0.f);
  for (int64_t c0 = 0; c0 < p.nv; c0 += kChunk)
    std::memset(w.acc + c0 * bm, 0, rows * std::min(kChunk, p.nv - c0) * sizeof(float));
  clock.mark(kQueries);
  const int64_t shift = s.sk - s.sq;  // query i sees keys j <= i + shift (causal)
  const int64_t nb = (u.kend + bn - 1) / bn;
  for (int64_t b = 0; b < nb; ++b) {
    const KeyBlock& kb = blocks[s.first_block + b];
    const int64_t n0 = kb.n0, nn = std::min(kb.nn, u.kend - n0);
    // a causal diagonal's block is multiplied only as far as its first half where the item
    // sees no further (the padding's scores are computed, K is zero there or a key past the
    // diagonal, and masked)
    const int64_t half = bn / 2;
    const int64_t width = kb.width == bn && half % kTile == 0 && nn <= half ? half : kb.width;
    const bf16* kp = w.kblock;
    const bf16* vp = w.vblock;
    if (s.packs_own) {
      pack_k(p, s, kb, head, 0, kb.width, w.kblock);
      pack_v(p, s, kb, head, 0, kb.width, w.vblock);
      clock.mark(kPack);
    } else {
      kp = packed_k + kb.col * p.kq;
      vp = packed_v + kb.col * p.nv;
    }
    for (int64_t c0 = 0; c0 < p.kq; c0 += kChunk) {
      const int64_t depth = std::min(kChunk, p.kq - c0);
      at::native::cpublas::brgemm(
          mb, width, depth, depth, kb.width, bn, c0 > 0, w.qt + c0 * bm,
          kp + c0 * kb.width, w.s, true);
    }
    clock.mark(kScores);
    for (int64_t i = 0; i < rows; ++i) {
      const int64_t vis = p.causal ? std::min(nn, u.r0 + i + shift - n0 + 1) : nn;
      const float alpha =
          softmax_row(p, w.s + i * bn, w.prob + i * bn, w.m[i], w.l[i], vis, width);
      if (alpha != 1.f) {
        for (int64_t c0 = 0; c0 < p.nv; c0 += kChunk) {
          const int64_t cols = std::min(kChunk, p.nv - c0);
          scale_row(w.acc + c0 * bm + i * cols, std::min(cols, p.dv - c0), alpha);
        }
      }
    }
    clock.mark(kSoftmax);
    for (int64_t c0 = 0; c0 < p.nv; c0 += kChunk) {
      const int64_t cols = std::min(kChunk, p.nv - c0);
      at::native::cpublas::brgemm(
          mb, cols, width, bn, cols, cols, true, w.prob, vp + c0 * kb.width,
          w.acc + c0 * bm, true);
    }
    clock.mark(kValues);
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
          w.acc + c0 * bm + i * cols, std::min(cols, p.dv - c0), inv, orow + c0 * p.o_s2,
          p.o_s2);
    }
    if (p.lse)
      p.lse[head * p.l_s0 + t * p.l_s1] = blind ? kNegInf : (w.m[i] + std::log2(w.l[i])) * kLn2;
  }
  clock.mark(kStore);
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

// `zen_mla::native_attend`'s CPU kernel: ragged attention into `out` [Tq, H, Dv] bf16 (any
// strides) and `lse` [H, Tq] fp32 (any strides) when given. cu_seq_lens: contiguous int64 CPU
// tensors of B + 1 offsets, validated by the caller (their bounds checked here again). The
// packed K and V of all heads take at most `max_pack_bytes` (0: no limit), or one head's where
// that is more: heads are packed and attended a group at a time. `parts`, when given: a
// contiguous float64 tensor of kParts + 2, set to the seconds of each Part summed over the
// threads, the call's wall time and the threads it used.
void attend(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& q_cu,
    const at::Tensor& kv_cu, double scale, bool causal, at::Tensor& out,
    const std::optional<at::Tensor>& lse, int64_t bm, int64_t bn, int64_t max_pack_bytes,
    const std::optional<at::Tensor>& parts) {
  TORCH_CHECK(cpu_supported(), "zen_mla native: this CPU lacks AVX-512 BF16");
  const auto wall0 = std::chrono::steady_clock::now();
  const uint64_t tsc0 = __rdtsc();
  const int64_t heads = q.size(1), dqk = q.size(2), dv = v.size(2);
  check(q, "q", dqk);
  check(k, "k", dqk);
  check(v, "v", dv);
  check(out, "out", dv, false);
  TORCH_CHECK(dqk > 0 && dv > 0, "zen_mla native: head dims must be positive");
  // a block of bn keys must be whole tiles (a sequence's last block is one tile wide at least)
  TORCH_CHECK(
      bm > 0 && bn > 0 && bn % kTile == 0, "zen_mla native: bad blocks ", bm, "x", bn,
      ": bm must be positive and bn a positive multiple of ", kTile);
  TORCH_CHECK(max_pack_bytes >= 0, "zen_mla native: max_pack_bytes < 0");
  TORCH_CHECK(k.size(1) == heads && v.size(1) == heads && out.size(1) == heads);
  TORCH_CHECK(k.size(0) == v.size(0) && out.size(0) == q.size(0), "zen_mla native: token counts");
  TORCH_CHECK(q_cu.device().is_cpu() && kv_cu.device().is_cpu() && q_cu.dim() == 1);
  TORCH_CHECK(q_cu.scalar_type() == at::kLong && kv_cu.scalar_type() == at::kLong);
  TORCH_CHECK(q_cu.is_contiguous() && kv_cu.is_contiguous() && q_cu.numel() == kv_cu.numel());
  TORCH_CHECK(q_cu.numel() >= 1, "zen_mla native: cu_seq_lens need B + 1 >= 1 entries");
  Problem p;
  if (lse.has_value() && lse->defined()) {
    TORCH_CHECK(lse->device().is_cpu() && lse->scalar_type() == at::kFloat && lse->dim() == 2);
    TORCH_CHECK(lse->size(0) == heads && lse->size(1) == q.size(0), "zen_mla native: lse shape");
    p.lse = lse->data_ptr<float>();
    p.l_s0 = lse->stride(0);
    p.l_s1 = lse->stride(1);
  }
  double* parts_ptr = nullptr;
  if (parts.has_value() && parts->defined()) {
    TORCH_CHECK(
        parts->device().is_cpu() && parts->scalar_type() == at::kDouble &&
            parts->is_contiguous() && parts->numel() == kParts + 2,
        "zen_mla native: parts must be a contiguous float64 tensor of ", kParts + 2);
    parts_ptr = parts->data_ptr<double>();
  }
  if (heads == 0) return;
  const int64_t kq = qk_depth(dqk), nv = v_columns(dv);
  p.q = q.data_ptr<bf16>();
  p.q_s0 = q.stride(0);
  p.q_s1 = q.stride(1);
  p.k = k.data_ptr<bf16>();
  p.k_s0 = k.stride(0);
  p.k_s1 = k.stride(1);
  p.v = v.data_ptr<bf16>();
  p.v_s0 = v.stride(0);
  p.v_s1 = v.stride(1);
  p.out = out.data_ptr<bf16>();
  p.o_s0 = out.stride(0);
  p.o_s1 = out.stride(1);
  p.o_s2 = out.stride(2);
  p.dqk = dqk;
  p.dv = dv;
  p.bm = bm;
  p.bn = bn;
  p.kq = kq;
  p.nv = nv;
  p.scale_log2 = float(scale * kLog2e);
  p.causal = causal;

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
    const int64_t sq = qc[i + 1] - qc[i];
    Seq s{qc[i], kc[i], sq, kc[i + 1] - kc[i], int64_t(blocks.size()), sq <= bm};
    seqs.push_back(s);
    for (int64_t n0 = 0; n0 < s.sk; n0 += bn) {
      const int64_t nn = std::min(bn, s.sk - n0), width = pow2_bucket(nn, kTile, bn);
      blocks.push_back({i, n0, nn, width, s.packs_own ? -1 : columns});
      if (!s.packs_own) columns += width;
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
  // the packing's items: slices of kPackSlice keys of a block, each for every head of a group,
  // so that the slice's rows of k and v (all heads of its tokens: 640 KiB at MLA's 16 heads)
  // are read from memory once and from L2 by the other heads (a block at a time for one head,
  // then the next, read them from memory again: 36 % of `chunk`'s time on a Xeon with AMX)
  std::vector<std::pair<int64_t, int64_t>> slices;
  for (int64_t b = 0; b < nblocks; ++b)
    if (blocks[b].col >= 0)
      for (int64_t lo = 0; lo < blocks[b].width; lo += kPackSlice) slices.emplace_back(b, lo);
  const int64_t nu = int64_t(units.size());
  std::mutex ticks_mutex;
  Ticks ticks{};
  auto add = [&](const Ticks& mine) {
    std::lock_guard<std::mutex> lock(ticks_mutex);
    for (int i = 0; i < kParts; ++i) ticks[i] += mine[i];
  };
  int64_t used_threads = 1;
  for (int64_t h0 = 0; h0 < heads; h0 += group) {
    const int64_t hg = std::min(group, heads - h0);
    at::parallel_for(0, int64_t(slices.size()), 1, [&](int64_t begin, int64_t end) {
      Ticks mine{};
      Clock clock(mine);
      for (int64_t x = begin; x < end; ++x) {
        const KeyBlock& kb = blocks[slices[x].first];
        const int64_t lo = slices[x].second, hi = std::min(lo + kPackSlice, kb.width);
        for (int64_t h = 0; h < hg; ++h) {
          pack_k(p, seqs[kb.seq], kb, h0 + h, lo, hi, packed_k + (h * columns + kb.col) * kq);
          pack_v(p, seqs[kb.seq], kb, h0 + h, lo, hi, packed_v + (h * columns + kb.col) * nv);
        }
      }
      clock.mark(kPack);
      add(mine);
    });
    // item x: of the run of units unit x / hg is in, hg x run_len items, head by head: as
    // the work items of one cost go by (sequence, head, query block), one head's query blocks
    // of a sequence follow each other and find its packed K and V in cache
    std::atomic<int64_t> next{0};
    const int64_t nitems = nu * hg;
    const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), nitems));
    used_threads = std::max(used_threads, threads);
    at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
      Ticks mine{};
      Scratch w(bm, bn, kq, nv);
      for (int64_t t = begin; t < end; ++t) {
        for (int64_t x = next.fetch_add(1); x < nitems; x = next.fetch_add(1)) {
          const Unit& first = units[x / hg];
          const int64_t y = x - first.run0 * hg, h = y / first.run_len;
          const Unit& u = units[first.run0 + y % first.run_len];
          attend_item(
              p, seqs[u.seq], u, h0 + h, blocks.data(), packed_k + h * columns * kq,
              packed_v + h * columns * nv, w, mine);
        }
      }
      at::native::cpublas::brgemm_release(true);
      _mm_sfence();  // the rows of out stored past the caches are seen by whoever reads next
      add(mine);
    });
  }
  if (parts_ptr) {
    const double wall =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - wall0).count();
    const double per_tick = wall / double(std::max<uint64_t>(__rdtsc() - tsc0, 1));
    for (int i = 0; i < kParts; ++i) parts_ptr[i] = double(ticks[i]) * per_tick;
    parts_ptr[kParts] = wall;
    parts_ptr[kParts + 1] = double(used_threads);
  }
}

// The operator: out, lse and parts are written (declared mutated), nothing is returned. The
// block defaults are Zen's (native.py passes this CPU's own); `max_pack_bytes` 0 is no limit.
// torch.profiler sees a call as `zen_mla::native_attend`; torch.ops releases the GIL for it.
// Its fake kernel is registered by native.py, the Python module named here (torch names it
// where a fake kernel is missing).
TORCH_LIBRARY(zen_mla, m) {
  m.set_python_module("zen_mla.attention.kernels.native");
  m.def(
      "native_attend(Tensor q, Tensor k, Tensor v, Tensor q_cu_seq_lens, Tensor kv_cu_seq_lens, "
      "float scale, bool causal, Tensor(a!) out, Tensor(b!)? lse, int bm=128, int bn=256, "
      "int max_pack_bytes=0, Tensor(c!)? parts=None) -> ()");
}

TORCH_LIBRARY_IMPL(zen_mla, CPU, m) { m.impl("native_attend", &attend); }

// The Python module: importing it registers the operator; `cpu_supported` says whether the
// operator may be called on this CPU.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "zen-mla's native ragged MLA prefill attention (AVX-512 BF16 / AMX brgemm): "
            "torch.ops.zen_mla.native_attend";
  m.def("cpu_supported", &cpu_supported, "whether this CPU runs the kernel (AVX-512 BF16)");
}

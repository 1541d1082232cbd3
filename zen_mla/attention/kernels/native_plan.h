// What every path of zen-mla's native kernel shares: a call's problem (its tensors, head dims
// and blocks), its plan (sequences, key blocks, work items), the buffers it packs into and works
// in, and the clock of its parts. native.cpp plans and schedules a call; native_avx512.h and
// native_avx2.h hold each ISA's vector code.

#pragma once

#include <ATen/core/TensorBody.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>

#include <x86intrin.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>

namespace zen_mla_native {

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

// Per-thread scratch: the query tile, scores, probabilities, accumulator, running max and sum,
// and one packed K and V block (`Seq::packs_own`), in T: the element the path's brgemm calls
// multiply (bf16 on AVX-512, fp32 on AVX2). Where P is fp32 as S is (`in_place`), P overwrites
// S row by row and has no buffer of its own.
// The query tile holds chunk c of Dqk at c * bm * 256 as [bm][its columns]; the accumulator
// chunk c of Dv the same way. Rows past an item's own (to M's bucket) are multiplied and never
// read. One buffer a thread is kept from call to call, up to kKeepScratch bytes (MLA's: ~0.45
// MiB at 128 x 256 blocks, ~1.3 MiB at 256 x 512), and grown where a call needs more: a fresh
// one per call cost its page faults, and with head dims changing from call to call its many
// sizes grew the allocator's arenas (measured on a Xeon with AMX: +119 MiB over 4000 calls of
// distinct head dims, against +41 MiB with 128 x 256 blocks).
constexpr size_t kKeepScratch = size_t(8) << 20;

template <typename T, bool in_place>
struct Scratch {
  T* qt;
  float *s, *acc, *m, *l;
  T *prob, *kblock, *vblock;
  std::unique_ptr<char[], AlignedFree> own;  // a call's own, past kKeepScratch

  Scratch(int64_t bm, int64_t bn, int64_t kq, int64_t nv) {
    thread_local std::unique_ptr<char[], AlignedFree> kept;
    thread_local size_t kept_bytes = 0;
    const size_t sizes[8] = {
        size_t(bm * kq) * sizeof(T), size_t(bm * bn) * sizeof(float),
        size_t(bm * nv) * sizeof(float), size_t(bm) * sizeof(float), size_t(bm) * sizeof(float),
        in_place ? 0 : size_t(bm * bn) * sizeof(T), size_t(bn * kq) * sizeof(T),
        size_t(bn * nv) * sizeof(T)};
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
    qt = reinterpret_cast<T*>(take(sizes[0]));
    s = reinterpret_cast<float*>(take(sizes[1]));
    acc = reinterpret_cast<float*>(take(sizes[2]));
    m = reinterpret_cast<float*>(take(sizes[3]));
    l = reinterpret_cast<float*>(take(sizes[4]));
    prob = in_place ? reinterpret_cast<T*>(s) : reinterpret_cast<T*>(take(sizes[5]));
    kblock = reinterpret_cast<T*>(take(sizes[6]));
    vblock = reinterpret_cast<T*>(take(sizes[7]));
  }
};

// A block's P is taken against the max its row had before (`softmax_row`) while the block's sum
// of P stays under this: then no P exceeds it, and P, l and acc stay far within bf16's and
// fp32's range (2^64 against 2^127), at their relative precision.
constexpr float kLazySum = 18446744073709551616.f;  // 2^64

}  // namespace zen_mla_native

// zen-mla's native ragged MLA prefill attention: a flash loop over oneDNN brgemm blocks with the
// query/key head dim (192) and the value head dim (128) apart, so nothing multiplies V's padding.
//
// One call takes the whole varlen batch (flash-attn layout: q [Tq, H, Dqk], k [Tk, H, Dqk],
// v [Tk, H, Dv], bf16, cu_seq_lens) and writes out [Tq, H, Dv] bf16 and, when asked,
// lse [H, Tq] fp32 (natural log), bottom-right causal.
//
//   1. pack: every (head, key block of bn tokens) of K and V into the VNNI layout the bf16
//      brgemm micro-kernels read ([D / 2][bn][2] for K^T, [bn / 2][Dv][2] for V), once per
//      call, all threads;
//   2. attend: the work items (sequence, head, block of bm queries) go to the threads largest
//      first through one atomic counter (a causal block's cost is its visible keys); a thread
//      runs, per key block, S = Q K^T (brgemm, fp32), the online softmax in fp32 (base-2
//      exponent, AVX-512), P in bf16, acc += P V (brgemm, fp32), then out = acc / l and
//      lse = m + log(l).
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

// One sequence of the batch.
struct Seq {
  int64_t q0, kv0, sq, sk;
  int64_t first_block;  // its first key block in the packed buffers
};

// One key block: which sequence, which tokens (`nn` of them from `n0`), its packed width
// (`nn` rounded up to 32: AMX's bf16 tiles take keys 32 deep, and the brgemm shapes stay few,
// 8 widths a block size) and where its columns start among all the blocks' (`col`).
struct KeyBlock {
  int64_t seq, n0, nn, width, col;
};

// One work item: (sequence, head, query block), and its cost in visible query-key pairs.
struct Item {
  int64_t seq, head, r0, rows, kend, cost;
};

struct Problem {
  const bf16* q;
  const bf16* k;
  const bf16* v;
  bf16* out;
  float* lse;  // nullptr: not asked
  int64_t q_s0, q_s1, k_s0, k_s1, v_s0, v_s1, o_s0, o_s1, l_s0, l_s1;
  int64_t heads, dqk, dv, bm, bn;
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

// K^T of one (head, key block) in VNNI: dst[(d / 2) * width * 2 + n * 2 + d % 2] =
// K[n0 + n][d], columns past `nn` zero. A transpose of 32-bit words (pairs of d), 16 x 16 at a time.
ZEN_MLA_AVX512 void pack_k(
    const Problem& p, const Seq& s, const KeyBlock& b, int64_t head, bf16* dst) {
  const int64_t bn = b.width, pairs = p.dqk / 2, whole = pairs / 16 * 16;
  auto* out = reinterpret_cast<uint32_t*>(dst);
  auto row = [&](int64_t n) {
    return reinterpret_cast<const uint32_t*>(p.k + (s.kv0 + b.n0 + n) * p.k_s0 + head * p.k_s1);
  };
  for (int64_t n0 = 0; n0 < bn; n0 += 16) {
    const int64_t live = std::clamp<int64_t>(b.nn - n0, 0, 16);
    for (int64_t i0 = 0; i0 < whole; i0 += 16) {
      __m512i r[16];
      for (int64_t j = 0; j < 16; ++j)
        r[j] = j < live ? _mm512_loadu_si512(row(n0 + j) + i0) : _mm512_setzero_si512();
      transpose16(r);
      for (int64_t j = 0; j < 16; ++j) _mm512_storeu_si512(out + (i0 + j) * bn + n0, r[j]);
    }
    for (int64_t i = whole; i < pairs; ++i)
      for (int64_t j = 0; j < 16; ++j) out[i * bn + n0 + j] = j < live ? row(n0 + j)[i] : 0u;
  }
}

// V of one (head, key block) in VNNI: dst[(n / 2) * Dv * 2 + d * 2 + n % 2] = V[n0 + n][d],
// rows past `nn` (to the block's width) zero. Pairs of rows interleaved 32 values at a time.
ZEN_MLA_AVX512 void pack_v(
    const Problem& p, const Seq& s, const KeyBlock& b, int64_t head, bf16* dst) {
  const int64_t dv = p.dv, whole = dv / 32 * 32;
  alignas(64) static constexpr uint16_t lo[32] = {
      0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
      8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  alignas(64) static constexpr uint16_t hi[32] = {
      16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
      24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
  const __m512i idx_lo = _mm512_load_si512(lo), idx_hi = _mm512_load_si512(hi);
  for (int64_t n = 0; n < b.width; n += 2) {
    uint16_t* pair = reinterpret_cast<uint16_t*>(dst + n * dv);
    const auto* a = n < b.nn
        ? reinterpret_cast<const uint16_t*>(p.v + (s.kv0 + b.n0 + n) * p.v_s0 + head * p.v_s1)
        : nullptr;
    const auto* c = n + 1 < b.nn
        ? reinterpret_cast<const uint16_t*>(p.v + (s.kv0 + b.n0 + n + 1) * p.v_s0 + head * p.v_s1)
        : nullptr;
    for (int64_t d = 0; d < whole; d += 32) {
      __m512i x = a ? _mm512_loadu_si512(a + d) : _mm512_setzero_si512();
      __m512i y = c ? _mm512_loadu_si512(c + d) : _mm512_setzero_si512();
      _mm512_storeu_si512(pair + 2 * d, _mm512_permutex2var_epi16(x, idx_lo, y));
      _mm512_storeu_si512(pair + 2 * d + 32, _mm512_permutex2var_epi16(x, idx_hi, y));
    }
    for (int64_t d = whole; d < dv; ++d) {
      pair[2 * d] = a ? a[d] : 0;
      pair[2 * d + 1] = c ? c[d] : 0;
    }
  }
}

// Per-thread scratch: scores, probabilities, accumulator, running max and sum.
struct Scratch {
  std::unique_ptr<float[], AlignedFree> s, acc, m, l;
  std::unique_ptr<bf16[], AlignedFree> prob;
  Scratch(int64_t bm, int64_t bn, int64_t dv)
      : s(aligned<float>(bm * bn)),
        acc(aligned<float>(bm * dv)),
        m(aligned<float>(bm)),
        l(aligned<float>(bm)),
        prob(aligned<bf16>(bm * bn)) {}
};

// The online-softmax step of one query row over one key block: `vis` of the block's `nn`
// columns are visible. Updates m (base 2, scaled) and l, rescales the row of acc, and writes
// the row of P (bf16, zero past `vis` up to `width`).
ZEN_MLA_AVX512 void softmax_row(
    const Problem& p, float* srow, bf16* prow, float* arow, float& m, float& l, int64_t vis,
    int64_t width) {
  if (vis <= 0) {
    std::memset(prow, 0, width * sizeof(bf16));
    return;
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
  if (alpha != 1.f) {
    const __m512 va = _mm512_set1_ps(alpha);
    for (int64_t d = 0; d < p.dv; d += 16) {
      __mmask16 k = tail_mask(p.dv - d);
      _mm512_mask_storeu_ps(arow + d, k, _mm512_mul_ps(va, _mm512_maskz_loadu_ps(k, arow + d)));
    }
  }
}

// out = acc / l in bf16 and lse = (m + log2 l) ln 2; rows that saw no key: out 0, lse -inf.
ZEN_MLA_AVX512 void finish_row(
    const Problem& p, const float* arow, float m, float l, bf16* orow, float* lse) {
  const bool blind = !(l > 0.f);
  const __m512 inv = _mm512_set1_ps(blind ? 0.f : 1.f / l);
  for (int64_t d = 0; d < p.dv; d += 16) {
    __mmask16 k = tail_mask(p.dv - d);
    __m512 o = _mm512_mul_ps(_mm512_maskz_loadu_ps(k, arow + d), inv);
    __m256bh h = _mm512_cvtneps_pbh(o);
    _mm256_mask_storeu_epi16(orow + d, k, (__m256i)h);
  }
  if (lse) *lse = blind ? kNegInf : (m + std::log2(l)) * kLn2;
}

ZEN_MLA_AVX512 void attend_item(
    const Problem& p, const Seq& s, const Item& it, const KeyBlock* blocks,
    const bf16* packed_k, const bf16* packed_v, Scratch& w) {
  const int64_t bn = p.bn, rows = it.rows, dv = p.dv;
  std::fill(w.m.get(), w.m.get() + rows, kNegInf);
  std::fill(w.l.get(), w.l.get() + rows, 0.f);
  std::memset(w.acc.get(), 0, rows * dv * sizeof(float));
  const bf16* q = p.q + (s.q0 + it.r0) * p.q_s0 + it.head * p.q_s1;
  const int64_t shift = s.sk - s.sq;  // query i sees keys j <= i + shift (causal)
  const int64_t nb = (it.kend + bn - 1) / bn;
  for (int64_t b = 0; b < nb; ++b) {
    const KeyBlock& kb = blocks[s.first_block + b];
    // the keys this item sees of the block (fewer than the block's on a causal diagonal),
    // rounded up to 32: the padding's scores are computed (K is zero there, or a key past the
    // diagonal) and masked
    const int64_t n0 = kb.n0, nn = std::min(kb.nn, it.kend - n0);
    const int64_t width = std::min(kb.width, (nn + 31) / 32 * 32);
    const bf16* kp = packed_k + kb.col * p.dqk;
    const bf16* vp = packed_v + kb.col * dv;
    at::native::cpublas::brgemm(
        rows, width, p.dqk, p.q_s0, kb.width, bn, false, q, kp, w.s.get(), true);
    for (int64_t i = 0; i < rows; ++i) {
      const int64_t vis = p.causal ? std::min(nn, it.r0 + i + shift - n0 + 1) : nn;
      softmax_row(
          p, w.s.get() + i * bn, w.prob.get() + i * bn, w.acc.get() + i * dv, w.m[i], w.l[i],
          vis, width);
    }
    at::native::cpublas::brgemm(
        rows, dv, width, bn, dv, dv, true, w.prob.get(), vp, w.acc.get(), true);
  }
  for (int64_t i = 0; i < rows; ++i) {
    const int64_t t = s.q0 + it.r0 + i;
    finish_row(
        p, w.acc.get() + i * dv, w.m[i], w.l[i], p.out + t * p.o_s0 + it.head * p.o_s1,
        p.lse ? p.lse + it.head * p.l_s0 + t * p.l_s1 : nullptr);
  }
}

void check(const at::Tensor& t, const char* name, int64_t dim) {
  TORCH_CHECK(t.device().is_cpu(), "zen_mla native: ", name, " must be on the CPU");
  TORCH_CHECK(t.dim() == 3, "zen_mla native: ", name, " must be [T, H, D], got ", t.sizes());
  TORCH_CHECK(
      t.scalar_type() == at::kBFloat16, "zen_mla native: ", name, " must be bfloat16, got ",
      t.scalar_type());
  TORCH_CHECK(t.size(2) == dim, "zen_mla native: ", name, " head dim ", t.size(2), " != ", dim);
  TORCH_CHECK(t.stride(2) == 1, "zen_mla native: ", name, " needs a unit last stride");
}

}  // namespace

// Whether this CPU runs the vector code (AVX-512 F/BW/VL/DQ and BF16).
bool cpu_supported() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
         __builtin_cpu_supports("avx512bf16");
}

// Ragged attention into `out` [Tq, H, Dv] (and `lse` [H, Tq] fp32 when defined).
// cu_seq_lens: int64 CPU tensors of B + 1 offsets, validated by the caller.
void attend(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& q_cu,
    const at::Tensor& kv_cu, double scale, bool causal, at::Tensor& out,
    const c10::optional<at::Tensor>& lse, int64_t bm, int64_t bn) {
  TORCH_CHECK(cpu_supported(), "zen_mla native: this CPU lacks AVX-512 BF16");
  RECORD_FUNCTION("zen_mla::native_attend", std::vector<c10::IValue>());  // for torch.profiler
  const int64_t heads = q.size(1), dqk = q.size(2), dv = v.size(2);
  check(q, "q", dqk);
  check(k, "k", dqk);
  check(v, "v", dv);
  check(out, "out", dv);
  TORCH_CHECK(dqk % 2 == 0, "zen_mla native: Dqk must be even, got ", dqk);
  // key blocks are 32 wide at their tails (AMX tiles): a block of bn keys must be whole 32s
  TORCH_CHECK(bm > 0 && bn > 0 && bn % 32 == 0, "zen_mla native: bad blocks ", bm, "x", bn);
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
  Problem p{
      q.data_ptr<bf16>(), k.data_ptr<bf16>(), v.data_ptr<bf16>(), out.data_ptr<bf16>(), lse_ptr,
      q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
      out.stride(0), out.stride(1), l_s0, l_s1, heads, dqk, dv, bm, bn,
      float(scale * kLog2e), causal};

  const int64_t nseq = q_cu.numel() - 1;
  const int64_t* qc = q_cu.data_ptr<int64_t>();
  const int64_t* kc = kv_cu.data_ptr<int64_t>();
  std::vector<Seq> seqs;
  std::vector<KeyBlock> blocks;
  std::vector<Item> items;
  int64_t columns = 0;  // packed key columns of one head: the blocks' widths summed
  // validated by the caller; checked again here, as every offset is memory this reads
  TORCH_CHECK(qc[0] >= 0 && kc[0] >= 0, "zen_mla native: negative cu_seq_lens");
  for (int64_t i = 0; i < nseq; ++i) {
    TORCH_CHECK(
        qc[i] <= qc[i + 1] && kc[i] <= kc[i + 1] && qc[i + 1] <= q.size(0) &&
            kc[i + 1] <= k.size(0),
        "zen_mla native: cu_seq_lens must rise and stay within q and k, at sequence ", i);
    Seq s{qc[i], kc[i], qc[i + 1] - qc[i], kc[i + 1] - kc[i], int64_t(blocks.size())};
    seqs.push_back(s);
    for (int64_t n0 = 0; n0 < s.sk; n0 += bn) {
      const int64_t nn = std::min(bn, s.sk - n0), width = (nn + 31) / 32 * 32;
      blocks.push_back({i, n0, nn, width, columns});
      columns += width;
    }
    for (int64_t h = 0; h < heads; ++h) {
      for (int64_t r0 = 0; r0 < s.sq; r0 += bm) {
        const int64_t rows = std::min(bm, s.sq - r0);
        // keys the block's last row sees (causal), or all of them
        const int64_t kend =
            causal ? std::clamp<int64_t>(r0 + rows + s.sk - s.sq, 0, s.sk) : s.sk;
        items.push_back({i, h, r0, rows, kend, rows * kend});
      }
    }
  }
  // largest first: the long causal blocks start early, the short ones fill the gaps
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) {
    return a.cost > b.cost;
  });

  const int64_t nblocks = int64_t(blocks.size());
  // packed layout: [H][columns][Dqk] for K, [H][columns][Dv] for V, each block in VNNI
  const size_t k_bytes = size_t(heads * columns * dqk) * sizeof(bf16);
  PackBuffer packed(k_bytes + size_t(heads * columns * dv) * sizeof(bf16));
  bf16* const packed_k = reinterpret_cast<bf16*>(packed.get());
  bf16* const packed_v = reinterpret_cast<bf16*>(packed.get() + k_bytes);
  at::parallel_for(0, heads * nblocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t x = begin; x < end; ++x) {
      const int64_t h = x / nblocks, b = x % nblocks;
      const KeyBlock& kb = blocks[b];
      pack_k(p, seqs[kb.seq], kb, h, packed_k + (h * columns + kb.col) * dqk);
      pack_v(p, seqs[kb.seq], kb, h, packed_v + (h * columns + kb.col) * dv);
    }
  });

  std::atomic<int64_t> next{0};
  const int64_t nitems = int64_t(items.size());
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), nitems));
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    Scratch w(bm, bn, dv);
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t x = next.fetch_add(1); x < nitems; x = next.fetch_add(1)) {
        const Item& it = items[x];
        const bf16* kh = packed_k + it.head * columns * dqk;
        const bf16* vh = packed_v + it.head * columns * dv;
        attend_item(p, seqs[it.seq], it, blocks.data(), kh, vh, w);
      }
    }
    at::native::cpublas::brgemm_release(true);
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "zen-mla's native ragged MLA prefill attention (AVX-512 BF16 / AMX brgemm)";
  m.def("cpu_supported", &cpu_supported, "whether this CPU runs the kernel (AVX-512 BF16)");
  m.def(
      "attend", &attend, "ragged attention into out (and lse)", py::arg("q"), py::arg("k"),
      py::arg("v"), py::arg("q_cu_seq_lens"), py::arg("kv_cu_seq_lens"), py::arg("scale"),
      py::arg("causal"), py::arg("out"), py::arg("lse"), py::arg("bm") = 128,
      py::arg("bn") = 256, py::call_guard<py::gil_scoped_release>());
}

// zen-mla's native ragged MLA prefill attention: a flash loop over oneDNN brgemm blocks with the
// query/key head dim (192) and the value head dim (128) apart, so V is never padded to 192.
//
// One call takes the whole varlen batch (flash-attn layout: q [Tq, H, Dqk], k [Tk, H, Dqk],
// v [Tk, H, Dv], bf16, cu_seq_lens) and writes out [Tq, H, Dv] bf16 and, when asked,
// lse [H, Tq] fp32 (natural log), bottom-right causal.
//
//   1. pack: every (head, key block of bn tokens) of K and V into the layout the path's brgemm
//      micro-kernels read (the head dims rounded up as below, zeros in the padding), all
//      threads, slices of 64 keys for all heads at a time; a group of heads at a time where all
//      of them would pass the call's packing budget. A sequence of one block of queries is not
//      packed here: its items pack each key block into their own tiles as they reach it
//      (`Seq::packs_own`);
//   2. attend: the work items (sequence, head, block of bm queries) go to the threads largest
//      first through one atomic counter (a causal block's cost is its visible keys); a thread
//      copies the item's queries into its own tile, then runs, per key block, S = Q K^T
//      (brgemm, fp32), the online softmax in fp32 (base-2 exponent), acc += P V (brgemm,
//      fp32), then out = acc / l and lse = m + log(l).
//
// Two paths share that loop (`run`, `attend_item`), chosen per call by the CPU's features or
// the caller's `isa` (native_avx512.h, native_avx2.h):
//   avx512  (Zen 4, Zen 5, Xeons with AMX) K, V, the queries and P in bf16, packed in VNNI
//           pairs for oneDNN's AVX-512 BF16 or AMX micro-kernels; the softmax 16 wide;
//   avx2    (Zen 2, Zen 3: no bf16 arithmetic) K, V and the queries converted to fp32 once as
//           they are packed, oneDNN's fp32 micro-kernels (AVX2 FMA), P in fp32 over S; the
//           softmax 8 wide.
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
// (AMX): 5 x 6 x 5 + 5 x 4 x 5 = 250 (~11 MiB); each path its own set. The blocks are the
// caller's (`blocks()` in native.py), per CPU and path.
//
// The kernel is the torch operator `zen_mla::native_attend` (schema below, its CPU kernel
// `attend`): importing the module registers it. Its fake kernel, for tracing, is native.py's.
// The module loads on any x86-64: each path's vector code is compiled for its ISA through
// target attributes only, and `cpu_paths()` tells Python which paths this CPU runs.

#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>
#include <torch/extension.h>

#include <atomic>
#include <chrono>
#include <string>
#include <vector>

#include "native_avx2.h"
#include "native_avx512.h"
#include "native_plan.h"

namespace zen_mla_native {
namespace {

// One work item: a block of queries of one sequence and head, over the key blocks it sees.
template <typename Isa, typename T = typename Isa::T>
void attend_item(
    const Problem& p, const Seq& s, const Unit& u, int64_t head, const KeyBlock* blocks,
    const T* packed_k, const T* packed_v, Scratch<T, Isa::kProbInScores>& w, Ticks& ticks) {
  Clock clock(ticks);
  const int64_t bm = p.bm, bn = p.bn, rows = u.rows;
  const int64_t mb = rows == bm ? bm : pow2_bucket(rows, kTileRows, bm);  // M of every call
  Isa::load_queries(p, s, u, head, w.qt);
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
    const T* kp = w.kblock;
    const T* vp = w.vblock;
    if (s.packs_own) {
      Isa::pack_k(p, s, kb, head, 0, kb.width, w.kblock);
      Isa::pack_v(p, s, kb, head, 0, kb.width, w.vblock);
      clock.mark(kPack);
    } else {
      kp = packed_k + kb.col * p.kq;
      vp = packed_v + kb.col * p.nv;
    }
    for (int64_t c0 = 0; c0 < p.kq; c0 += kChunk) {
      const int64_t depth = std::min(kChunk, p.kq - c0);
      at::native::cpublas::brgemm(
          mb, width, depth, depth, kb.width, bn, c0 > 0, w.qt + c0 * bm,
          kp + c0 * kb.width, w.s, Isa::kVnni);
    }
    clock.mark(kScores);
    for (int64_t i = 0; i < rows; ++i) {
      const int64_t vis = p.causal ? std::min(nn, u.r0 + i + shift - n0 + 1) : nn;
      const float alpha =
          Isa::softmax_row(p, w.s + i * bn, w.prob + i * bn, w.m[i], w.l[i], vis, width);
      if (alpha != 1.f) {
        for (int64_t c0 = 0; c0 < p.nv; c0 += kChunk) {
          const int64_t cols = std::min(kChunk, p.nv - c0);
          Isa::scale_row(w.acc + c0 * bm + i * cols, std::min(cols, p.dv - c0), alpha);
        }
      }
    }
    clock.mark(kSoftmax);
    for (int64_t c0 = 0; c0 < p.nv; c0 += kChunk) {
      const int64_t cols = std::min(kChunk, p.nv - c0);
      at::native::cpublas::brgemm(
          mb, cols, width, bn, cols, cols, true, w.prob, vp + c0 * kb.width,
          w.acc + c0 * bm, Isa::kVnni);
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
      Isa::store_row(
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

// Packs and attends a planned call on one ISA's path; adds each part's ticks to `ticks` and
// returns the threads it used.
template <typename Isa, typename T = typename Isa::T>
int64_t run(
    const Problem& p, const std::vector<Seq>& seqs, const std::vector<KeyBlock>& blocks,
    const std::vector<Unit>& units, int64_t columns, int64_t heads, int64_t max_pack_bytes,
    Ticks& ticks) {
  const int64_t bm = p.bm, bn = p.bn, kq = p.kq, nv = p.nv;
  const int64_t nblocks = int64_t(blocks.size());
  // packed layout of a group of g heads: [g][columns][kq] for K, [g][columns][nv] for V, each
  // block in the path's layout (`Isa::kVnni`)
  const int64_t head_bytes = columns * (kq + nv) * int64_t(sizeof(T));
  const int64_t group =
      max_pack_bytes == 0 || head_bytes == 0
          ? heads
          : std::clamp<int64_t>(max_pack_bytes / head_bytes, 1, heads);
  const size_t k_bytes = size_t(group * columns * kq) * sizeof(T);
  PackBuffer packed(size_t(group * head_bytes));
  T* const packed_k = reinterpret_cast<T*>(packed.get());
  T* const packed_v = reinterpret_cast<T*>(packed.get() + k_bytes);
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
          Isa::pack_k(p, seqs[kb.seq], kb, h0 + h, lo, hi, packed_k + (h * columns + kb.col) * kq);
          Isa::pack_v(p, seqs[kb.seq], kb, h0 + h, lo, hi, packed_v + (h * columns + kb.col) * nv);
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
      Scratch<T, Isa::kProbInScores> w(bm, bn, kq, nv);
      for (int64_t t = begin; t < end; ++t) {
        for (int64_t x = next.fetch_add(1); x < nitems; x = next.fetch_add(1)) {
          const Unit& first = units[x / hg];
          const int64_t y = x - first.run0 * hg, h = y / first.run_len;
          const Unit& u = units[first.run0 + y % first.run_len];
          attend_item<Isa>(
              p, seqs[u.seq], u, h0 + h, blocks.data(), packed_k + h * columns * kq,
              packed_v + h * columns * nv, w, mine);
        }
      }
      at::native::cpublas::brgemm_release(Isa::kVnni);
      Isa::fence();
      add(mine);
    });
  }
  return used_threads;
}

// The paths of the kernel, best first, as `isa` names them.
enum class Path { kAvx512, kAvx2 };

// Whether this CPU runs the AVX-512 path's vector code (AVX-512 F/BW/VL/DQ and BF16).
bool cpu_has_avx512_bf16() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
         __builtin_cpu_supports("avx512bf16");
}

// Whether this CPU runs the AVX2 path's (AVX2 and FMA).
bool cpu_has_avx2() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

// The paths this CPU runs, best first, by name ("avx512", "avx2"); none where it has neither.
std::vector<std::string> cpu_paths() {
  std::vector<std::string> names;
  if (cpu_has_avx512_bf16()) names.emplace_back("avx512");
  if (cpu_has_avx2()) names.emplace_back("avx2");
  return names;
}

// The path `isa` names ("auto": the best this CPU runs), refused where the CPU lacks it.
Path choose_path(c10::string_view isa) {
  if (isa == "auto") {
    TORCH_CHECK(
        cpu_has_avx512_bf16() || cpu_has_avx2(),
        "zen_mla native: this CPU has neither AVX-512 BF16 nor AVX2 with FMA");
    return cpu_has_avx512_bf16() ? Path::kAvx512 : Path::kAvx2;
  }
  if (isa == "avx512") {
    TORCH_CHECK(cpu_has_avx512_bf16(), "zen_mla native: this CPU lacks AVX-512 BF16");
    return Path::kAvx512;
  }
  if (isa == "avx2") {
    TORCH_CHECK(cpu_has_avx2(), "zen_mla native: this CPU lacks AVX2 with FMA");
    return Path::kAvx2;
  }
  TORCH_CHECK(false, "zen_mla native: isa must be 'auto', 'avx512' or 'avx2', got '", isa, "'");
}

}  // namespace

// The fp32 FMA peak of torch's threads on the AVX2 path's vectors, in FLOP/s: each thread runs
// `avx2::fma_loop` for `iterations` rounds at once, timed by the wall. What the AVX2 path's
// products could reach at most, for the benchmark (no bf16 GEMM gives that limit on such a CPU).
double fma_peak(int64_t iterations) {
  TORCH_CHECK(cpu_has_avx2(), "zen_mla native: this CPU lacks AVX2 with FMA");
  TORCH_CHECK(iterations > 0, "zen_mla native: iterations must be positive");
  const int64_t threads = at::get_num_threads();
  std::atomic<float> sink{0.f};  // the loops' sums stored: the compiler keeps the loops
  const auto start = std::chrono::steady_clock::now();
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) sink.store(avx2::fma_loop(iterations));
  });
  const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return double(threads) * double(iterations) * 192.0 / std::max(wall, 1e-9);
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
    const std::optional<at::Tensor>& parts, c10::string_view isa) {
  const Path path = choose_path(isa);
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

  Ticks ticks{};
  const int64_t used_threads =
      path == Path::kAvx512
          ? run<Avx512>(p, seqs, blocks, units, columns, heads, max_pack_bytes, ticks)
          : run<Avx2>(p, seqs, blocks, units, columns, heads, max_pack_bytes, ticks);
  if (parts_ptr) {
    const double wall =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - wall0).count();
    const double per_tick = wall / double(std::max<uint64_t>(__rdtsc() - tsc0, 1));
    for (int i = 0; i < kParts; ++i) parts_ptr[i] = double(ticks[i]) * per_tick;
    parts_ptr[kParts] = wall;
    parts_ptr[kParts + 1] = double(used_threads);
  }
}


}  // namespace zen_mla_native

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
      "int max_pack_bytes=0, Tensor(c!)? parts=None, str isa=\"auto\") -> ()");
}

TORCH_LIBRARY_IMPL(zen_mla, CPU, m) { m.impl("native_attend", &zen_mla_native::attend); }

// The Python module: importing it registers the operator; `cpu_paths` says which of its paths
// this CPU runs (`isa`'s names, best first).
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "zen-mla's native ragged MLA prefill attention (AVX-512 BF16 / AMX / AVX2 brgemm): "
            "torch.ops.zen_mla.native_attend";
  m.def(
      "fma_peak", &zen_mla_native::fma_peak, py::arg("iterations"),
      "the fp32 FMA peak of torch's threads on AVX2 vectors (FLOP/s), for the benchmark");
  m.def(
      "cpu_paths", &zen_mla_native::cpu_paths,
      "the kernel's paths this CPU runs, best first: 'avx512' (AVX-512 BF16), 'avx2' (AVX2, FMA)");
}

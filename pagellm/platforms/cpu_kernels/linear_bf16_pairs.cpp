// bfloat16 linear layers on CPUs with AVX-512 BF16 (AMD Zen 4 and 5, Intel Cooper Lake; those with AMX take
// linear_amx.cpp): vdpbf16ps multiplies 16 columns' pairs of bfloat16 weights by a pair of x's bfloat16
// values and adds both products to 16 float32 sums, 32 multiply-adds in one instruction, the weights never
// widened. oneDNN's prepacked bfloat16 GEMM, which these CPUs took before, streamed model S's decode-step
// weights at ~18 GB/s of the ~35 GB/s the 2-core AMD EPYC Zen 4 reads; the AVX2 panel kernel, widening
// in registers, at ~26 GB/s.
//
// Layout (packed by platforms/cpu_linear.py, `pack_pairs`): [ceil(N/16), ceil(K/2), 16, 2] bfloat16, panels of
// 16 output columns, in each the weights of input rows 2i and 2i+1 of a column side by side (one 32-bit
// lane), zero-padded past N and K. A call splits the panels between threads in contiguous runs of pairs of
// panels; for each pair of panels every block of up to kRows x rows runs the whole K, two 16-column sums
// per row in registers (the panel pair streams from memory for the first block, which asks for the next
// pair ahead, and from L2 for the next blocks),
// then bias, then rounding to bfloat16. One x row (a decode step) instead splits single panels between
// threads and reads four of each thread's run at once (`one_row`). x must be bfloat16 (an odd K is padded
// with a zero column).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "kernels.h"
#include "panels.h"

#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>
#define PL_BF16_PAIRS 1
#else
#define PL_BF16_PAIRS 0
#endif

namespace {

constexpr int64_t kCols = 16;  // columns per panel
#if PL_BF16_PAIRS
constexpr int kRows = 8;       // x rows per register block: 2 panels x 8 rows = 16 of the 32 zmm registers

// Step i's line (64 bytes: 16 columns' pairs) of the panels a0 and a1 into L2, where a0 is not null: the
// panel pair a thread multiplies next streams in from memory while this one is multiplied, instead of its
// first row block waiting on every load (a few x rows do little work per line: model S's linears at 4 and
// 16 rows took 15-20% less time with it, 2-core AMD EPYC Zen 4).
inline void ask_ahead(const uint16_t* a0, const uint16_t* a1, int64_t i) {
  if (a0 == nullptr) return;
  _mm_prefetch(reinterpret_cast<const char*>(a0 + i * 2 * kCols), _MM_HINT_T1);
  _mm_prefetch(reinterpret_cast<const char*>(a1 + i * 2 * kCols), _MM_HINT_T1);
}

// y[r][0..32) (or [0..16) with one panel) = x[r] . (panel pair) + bias, rounded to bfloat16, `cols` valid;
// a0, a1: the panels to ask for ahead (`ask_ahead`), or null.
template <int R, bool kTwo>
void pair_block(const uint16_t* const* x, const uint16_t* p0, const uint16_t* p1, int64_t pairs, const float* bias,
                uint16_t* const* y, int64_t cols, const uint16_t* a0, const uint16_t* a1) {
  __m512 acc0[R], acc1[R];
  for (int r = 0; r < R; ++r) acc0[r] = _mm512_setzero_ps(), acc1[r] = _mm512_setzero_ps();
  int64_t i = 0;
  if constexpr (R <= 2) {  // few rows: two more chains of sums, so the adds' latency does not set the pace
    __m512 odd0[R], odd1[R];
    for (int r = 0; r < R; ++r) odd0[r] = _mm512_setzero_ps(), odd1[r] = _mm512_setzero_ps();
    for (; i + 2 <= pairs; i += 2) {
      ask_ahead(a0, a1, i), ask_ahead(a0, a1, i + 1);
      const __m512bh w0 = (__m512bh)_mm512_loadu_si512(p0 + i * 2 * kCols);
      const __m512bh v0 = (__m512bh)_mm512_loadu_si512(p0 + (i + 1) * 2 * kCols);
      __m512bh w1, v1;
      if constexpr (kTwo) {
        w1 = (__m512bh)_mm512_loadu_si512(p1 + i * 2 * kCols);
        v1 = (__m512bh)_mm512_loadu_si512(p1 + (i + 1) * 2 * kCols);
      }
      for (int r = 0; r < R; ++r) {
        int32_t both[2];
        std::memcpy(both, x[r] + 2 * i, 8);
        const __m512bh xa = (__m512bh)_mm512_set1_epi32(both[0]), xb = (__m512bh)_mm512_set1_epi32(both[1]);
        acc0[r] = _mm512_dpbf16_ps(acc0[r], xa, w0);
        odd0[r] = _mm512_dpbf16_ps(odd0[r], xb, v0);
        if constexpr (kTwo) {
          acc1[r] = _mm512_dpbf16_ps(acc1[r], xa, w1);
          odd1[r] = _mm512_dpbf16_ps(odd1[r], xb, v1);
        }
      }
    }
    for (int r = 0; r < R; ++r) acc0[r] = _mm512_add_ps(acc0[r], odd0[r]), acc1[r] = _mm512_add_ps(acc1[r], odd1[r]);
  }
  for (; i < pairs; ++i) {
    ask_ahead(a0, a1, i);
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(p0 + i * 2 * kCols);
    __m512bh w1;
    if constexpr (kTwo) w1 = (__m512bh)_mm512_loadu_si512(p1 + i * 2 * kCols);
    for (int r = 0; r < R; ++r) {
      int32_t both;
      std::memcpy(&both, x[r] + 2 * i, 4);
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(both);
      acc0[r] = _mm512_dpbf16_ps(acc0[r], xv, w0);
      if constexpr (kTwo) acc1[r] = _mm512_dpbf16_ps(acc1[r], xv, w1);
    }
  }
  const __m512 b0 = bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
  const __m512 b1 = bias && kTwo ? _mm512_loadu_ps(bias + kCols) : _mm512_setzero_ps();
  for (int r = 0; r < R; ++r) {
    alignas(64) uint16_t out[2 * kCols];
    _mm256_store_si256(reinterpret_cast<__m256i*>(out), (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(acc0[r], b0)));
    if constexpr (kTwo)
      _mm256_store_si256(reinterpret_cast<__m256i*>(out + kCols),
                         (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(acc1[r], b1)));
    std::memcpy(y[r], out, cols * 2);
  }
}

// One x row times kStreams panels at once, from separate places in memory: panel q's 16 sums, bias added,
// rounded to bfloat16 into y[q] (`cols[q]` valid). Each panel is summed as pair_block<1> sums it (even and
// odd pairs apart, added before an odd last pair), so the bits are the same. One row does one vdpbf16ps
// per 64 bytes of weights, and a core reading one or two streams of panels waits on its loads (as the AVX2
// panels do: panels.h, panel_dot_streams).
template <int S>
void pair_streams(const uint16_t* x, const uint16_t* const* panels, int64_t pairs, const float* const* bias,
                  uint16_t* const* y, const int64_t* cols) {
  __m512 acc[S], odd[S];
  for (int q = 0; q < S; ++q) acc[q] = _mm512_setzero_ps(), odd[q] = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 2 <= pairs; i += 2) {
    int32_t both[2];
    std::memcpy(both, x + 2 * i, 8);
    const __m512bh xa = (__m512bh)_mm512_set1_epi32(both[0]), xb = (__m512bh)_mm512_set1_epi32(both[1]);
    for (int q = 0; q < S; ++q) {
      acc[q] = _mm512_dpbf16_ps(acc[q], xa, (__m512bh)_mm512_loadu_si512(panels[q] + i * 2 * kCols));
      odd[q] = _mm512_dpbf16_ps(odd[q], xb, (__m512bh)_mm512_loadu_si512(panels[q] + (i + 1) * 2 * kCols));
    }
  }
  for (int q = 0; q < S; ++q) acc[q] = _mm512_add_ps(acc[q], odd[q]);
  if (i < pairs) {
    int32_t both;
    std::memcpy(&both, x + 2 * i, 4);
    const __m512bh xv = (__m512bh)_mm512_set1_epi32(both);
    for (int q = 0; q < S; ++q)
      acc[q] = _mm512_dpbf16_ps(acc[q], xv, (__m512bh)_mm512_loadu_si512(panels[q] + i * 2 * kCols));
  }
  for (int q = 0; q < S; ++q) {
    const __m512 b = bias[q] ? _mm512_loadu_ps(bias[q]) : _mm512_setzero_ps();
    alignas(32) uint16_t out[kCols];
    _mm256_store_si256(reinterpret_cast<__m256i*>(out), (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(acc[q], b)));
    std::memcpy(y[q], out, cols[q] * 2);
  }
}

constexpr int kStreams = 4;  // panels one x row reads at once per thread

#endif

}  // namespace

#if PL_BF16_PAIRS
// One x row times panels [first, last): the run cut in kStreams equal parts, read side by side, then the
// run's remainder one panel at a time. A thread's share of `one_row`, and of a native decode step's linears
// (native_decoder.cpp), which split the panels the same way inside their own parallel region.
void bf16_pair_row_run(const uint16_t* x, const uint16_t* w, int64_t pairs, const float* b, int64_t n, uint16_t* y,
                       int64_t first, int64_t last) {
  const int64_t panel_elems = pairs * 2 * kCols;
  auto at = [&](int64_t p, const uint16_t** pp, const float** bp, uint16_t** yp, int64_t* cp) {
    *pp = w + p * panel_elems, *bp = b ? b + p * kCols : nullptr, *yp = y + p * kCols;
    *cp = std::min<int64_t>(kCols, n - p * kCols);
  };
  const int64_t part = (last - first) / kStreams;
  const uint16_t* pp[kStreams];
  const float* bp[kStreams];
  uint16_t* yp[kStreams];
  int64_t cp[kStreams];
  for (int64_t j = 0; j < part; ++j) {
    for (int q = 0; q < kStreams; ++q) at(first + q * part + j, pp + q, bp + q, yp + q, cp + q);
    pair_streams<kStreams>(x, pp, pairs, bp, yp, cp);
  }
  for (int64_t p = first + kStreams * part; p < last; ++p) {
    at(p, pp, bp, yp, cp);
    pair_streams<1>(x, pp, pairs, bp, yp, cp);
  }
}
#endif

namespace {

#if PL_BF16_PAIRS
// One x row times every panel: each thread's run of panels (`bf16_pair_row_run`).
void one_row(const uint16_t* x, const uint16_t* w, int64_t pairs, int64_t panels, const float* b, int64_t n,
             uint16_t* y) {
  parallel_runs(panels, [&](int64_t first, int64_t last) { bf16_pair_row_run(x, w, pairs, b, n, y, first, last); });
}

template <bool kTwo>
void rows_block(int rows, const uint16_t* const* x, const uint16_t* p0, const uint16_t* p1, int64_t pairs,
                const float* bias, uint16_t* const* y, int64_t cols, const uint16_t* a0, const uint16_t* a1) {
  switch (rows) {
    case 1: return pair_block<1, kTwo>(x, p0, p1, pairs, bias, y, cols, a0, a1);
    case 2: return pair_block<2, kTwo>(x, p0, p1, pairs, bias, y, cols, a0, a1);
    case 3: return pair_block<3, kTwo>(x, p0, p1, pairs, bias, y, cols, a0, a1);
    case 4: return pair_block<4, kTwo>(x, p0, p1, pairs, bias, y, cols, a0, a1);
    case 5: return pair_block<5, kTwo>(x, p0, p1, pairs, bias, y, cols, a0, a1);
    case 6: return pair_block<6, kTwo>(x, p0, p1, pairs, bias, y, cols, a0, a1);
    case 7: return pair_block<7, kTwo>(x, p0, p1, pairs, bias, y, cols, a0, a1);
    default: return pair_block<8, kTwo>(x, p0, p1, pairs, bias, y, cols, a0, a1);
  }
}
#endif

}  // namespace

#if PL_BF16_PAIRS
// m x rows (x_stride apart; y's rows n apart) times the panel pairs [first, last) (pair u: panels 2u and
// 2u + 1): for each pair every block of up to kRows rows runs the whole K, the first block streaming the pair
// from memory and asking for the next. A thread's share of a batch (`cpu_bf16_pair_linear` splits the pairs
// in contiguous runs), and of a native decode step's batch (native_decoder.cpp), which splits them the same
// way inside its own parallel region: the same blocks, so the same bits.
void bf16_pair_rows_run(const uint16_t* x, int64_t m, int64_t x_stride, const uint16_t* w, int64_t pairs,
                        int64_t panels, const float* b, int64_t n, uint16_t* y, int64_t first, int64_t last) {
  const int64_t panel_elems = pairs * 2 * kCols;
  for (int64_t u = first; u < last; ++u) {
    const int64_t p = 2 * u;
    const bool two = p + 1 < panels;
    const uint16_t* p0 = w + p * panel_elems;
    const uint16_t* p1 = two ? p0 + panel_elems : nullptr;
    const int64_t cols = std::min<int64_t>(two ? 2 * kCols : kCols, n - p * kCols);
    const float* bp = b ? b + p * kCols : nullptr;
    // the first row block streams this pair from memory and asks for the next (this thread's, mostly)
    const bool next = p + 3 < panels;
    const uint16_t* a0 = next ? p0 + 2 * panel_elems : nullptr;
    const uint16_t* a1 = next ? p0 + 3 * panel_elems : nullptr;
    for (int64_t r0 = 0; r0 < m; r0 += kRows, a0 = a1 = nullptr) {
      const int rows = static_cast<int>(std::min<int64_t>(kRows, m - r0));
      const uint16_t* xr[kRows];
      uint16_t* yr[kRows];
      for (int r = 0; r < rows; ++r) xr[r] = x + (r0 + r) * x_stride, yr[r] = y + (r0 + r) * n + p * kCols;
      two ? rows_block<true>(rows, xr, p0, p1, pairs, bp, yr, cols, a0, a1)
          : rows_block<false>(rows, xr, p0, p1, pairs, bp, yr, cols, a0, a1);
    }
  }
}
#endif

bool bf16_pairs_available() { return PL_BF16_PAIRS; }

// x [..., K] bfloat16 @ W^T (+ bias) -> [..., N] bfloat16; W [N, K] packed as the top of this file says,
// bias [N] of any float dtype (added in float32).
at::Tensor cpu_bf16_pair_linear(const at::Tensor& input, const at::Tensor& packed,
                                const c10::optional<at::Tensor>& bias, int64_t out_features) {
  TORCH_CHECK(PL_BF16_PAIRS, "cpu_bf16_pair_linear: this build has no AVX-512 BF16 path");
  TORCH_CHECK(input.dim() >= 1 && input.scalar_type() == at::kBFloat16, "cpu_bf16_pair_linear: bfloat16 x [..., K]");
  const int64_t k = input.size(-1), n = out_features, panels = (n + kCols - 1) / kCols, pairs = (k + 1) / 2;
  TORCH_CHECK(packed.dim() == 4 && packed.size(0) == panels && packed.size(1) == pairs && packed.size(2) == kCols &&
                  packed.size(3) == 2 && packed.is_contiguous() && packed.scalar_type() == at::kBFloat16,
              "cpu_bf16_pair_linear: the weight must be packed by platforms/cpu_linear.py for ", n, " x ", k);
  std::vector<float> bias_f32;  // zero-padded to whole panels: the blocks read 16 or 32
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->numel() == n, "cpu_bf16_pair_linear: a bias of ", n, " values");
    bias_f32.assign(panels * kCols, 0.f);
    if (bias->scalar_type() == at::kBFloat16 && bias->is_contiguous()) {  // the model's dtype: no ATen op
      const auto* src = static_cast<const uint16_t*>(bias->data_ptr());
      for (int64_t c = 0; c < n; ++c) bias_f32[c] = bf16_to_float(src[c]);
    } else {
      const at::Tensor values = bias->to(at::kFloat).contiguous();
      std::copy(values.data_ptr<float>(), values.data_ptr<float>() + n, bias_f32.begin());
    }
  }
  std::vector<int64_t> shape(input.sizes().begin(), input.sizes().end());
  shape.back() = n;
  auto out = input.new_empty(shape);
  const int64_t m = k == 0 ? 0 : input.numel() / k;
  if (m == 0 || n == 0) return out;
  // Plain pointers, not ATen's reshape / contiguous when x is already contiguous: at one row those ops
  // cost about what a small projection's products do.
  const at::Tensor x = input.is_contiguous() ? input : input.contiguous();
#if PL_BF16_PAIRS
  const auto* xs = reinterpret_cast<const uint16_t*>(x.data_ptr());
  std::vector<uint16_t> padded;  // an odd K: each row and a zero, the last pair's second value
  if (k % 2) {
    padded.assign(m * (k + 1), 0);
    for (int64_t r = 0; r < m; ++r) std::copy(xs + r * k, xs + (r + 1) * k, padded.begin() + r * (k + 1));
    xs = padded.data();
  }
  const auto* w = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  auto* ys = reinterpret_cast<uint16_t*>(out.data_ptr());
  const float* b = bias_f32.empty() ? nullptr : bias_f32.data();
  if (m == 1) return one_row(xs, w, pairs, panels, b, n, ys), out;
  const int64_t units = (panels + 1) / 2;
  parallel_runs(units, [&](int64_t first, int64_t last) {
    bf16_pair_rows_run(xs, m, 2 * pairs, w, pairs, panels, b, n, ys, first, last);
  });
#endif
  return out;
}

// Per-head products, x [T, H, K] bfloat16 (K contiguous, even) times each head's own packed W [N, K]
// (packed [H, panels, pairs, 16, 2]) -> [H, T, N] bfloat16: MLA's absorbed query (q_nope_h W_UK_h) and
// expanded output (o_h W_UV_h^T), 16 to 128 small matrices a layer that torch's bmm read at ~14 GB/s at
// one row (2 MiB a layer at model D's sizes in ~150 us, 2-core AMD EPYC Zen 4). The heads' panels (one row)
// or panel pairs (several) are split between the threads in contiguous runs, each head's rows multiplied
// as cpu_bf16_pair_linear multiplies a linear's.
at::Tensor cpu_bf16_pair_heads(const at::Tensor& x, const at::Tensor& packed, int64_t out_features) {
  TORCH_CHECK(PL_BF16_PAIRS, "cpu_bf16_pair_heads: this build has no AVX-512 BF16 path");
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == at::kBFloat16 && x.stride(2) == 1 && x.size(2) % 2 == 0,
              "cpu_bf16_pair_heads: bfloat16 x [T, H, K], K contiguous and even");
  const int64_t t = x.size(0), h = x.size(1), k = x.size(2), n = out_features;
  const int64_t panels = (n + kCols - 1) / kCols, pairs = k / 2;
  TORCH_CHECK(packed.dim() == 5 && packed.size(0) == h && packed.size(1) == panels && packed.size(2) == pairs &&
                  packed.size(3) == kCols && packed.size(4) == 2 && packed.is_contiguous() &&
                  packed.scalar_type() == at::kBFloat16,
              "cpu_bf16_pair_heads: the weights must be packed by platforms/cpu_linear.py for ", h, " heads of ", n,
              " x ", k);
  auto out = x.new_empty({h, t, n});
  if (t == 0 || n == 0) return out;
#if PL_BF16_PAIRS
  const auto* xs = reinterpret_cast<const uint16_t*>(x.data_ptr());
  const auto* w = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  auto* ys = reinterpret_cast<uint16_t*>(out.data_ptr());
  const int64_t head_elems = panels * pairs * 2 * kCols, units = t == 1 ? panels : (panels + 1) / 2;
  parallel_runs(h * units, [&](int64_t first, int64_t last) {
    for (int64_t head = first / units; head * units < last; ++head) {
      const int64_t lo = std::max(first, head * units) - head * units, hi = std::min(last, (head + 1) * units) - head * units;
      const uint16_t* xh = xs + head * x.stride(1);
      const uint16_t* wh = w + head * head_elems;
      uint16_t* yh = ys + head * t * n;
      if (t == 1)
        bf16_pair_row_run(xh, wh, pairs, nullptr, n, yh, lo, hi);
      else
        bf16_pair_rows_run(xh, t, x.stride(0), wh, pairs, panels, nullptr, n, yh, lo, hi);
    }
  });
#endif
  return out;
}

// Dense linear layers on 16-column weight panels (panels.h), for CPUs where neither the AMX kernel nor
// oneDNN multiplies bfloat16 weights fast: AVX2-only CPUs (AMD Zen 2/3, Intel before Cooper Lake), where
// oneDNN cannot prepack bfloat16 and F.linear widens the whole weight every call (~20x slower than this at
// decode batch sizes, measured on an AMD EPYC Zen 3). The weight stays bfloat16 in memory (half of float32's
// bytes to stream), each panel is widened in registers, products are summed in float32. Weight-only int8
// and fp8 (e4m3) layers take the same panels with a byte per weight (half of bfloat16's) and a float32
// scale per output column, applied to the sums.
//
// Layout (packed by platforms/cpu_linear.py): [ceil(N/16), K, 16] panels, as the experts' w2 in
// fused_moe.cpp. A call, per block of up to kChunkRows rows (their float32 copy fits in L2): the panels are
// split between threads in contiguous runs, and each panel is multiplied against the block's rows in
// register blocks of up to kMaxRows rows (from L1 after the first), then bias, then rounding to x's dtype.
//
// fixed_order (batch-invariant mode): a row's sums must not depend on how many rows share its block. Blocks
// of one to three rows keep two accumulator chains per row (even and odd k, added at the end), larger ones
// one, so such a block is widened to kMinFixedRows rows, the extra ones repeating its last row into scratch:
// every row then sums its k products in one chain, in order, whatever the batch.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "kernels.h"
#include "panels.h"

namespace {

constexpr int64_t kChunkRows = 48;  // rows per block: 48 x 4096 float32 inputs are 768 KB
constexpr int kMinFixedRows = 4;    // the smallest register block with one accumulator chain per row
constexpr int64_t kWidenRows = 9;  // from two register blocks on, an int8 or e4m3 panel is widened once
static_assert(kMinFixedRows <= kMaxRows, "a fixed-order block must fit a register block");

#if PL_PANEL_AVX2
// Rounds a register block's float32 sums to bfloat16 rows. Out of line on purpose: inlined after the k loop,
// it made bfloat16 outputs ~1.6x slower than float32 ones of the same shapes (model S's linears and lm_head,
// AVX2 AMD EPYC; likely its constants taking registers the 6-row block needs in the loop); out of line,
// the same speed.
__attribute__((noinline)) void store_bf16_rows(const float (*sums)[kPanel], int rows, void* const* y) {
  for (int r = 0; r < rows; ++r) {
    uint16_t* dst = static_cast<uint16_t*>(y[r]);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), vto_bf16(_mm256_loadu_ps(sums[r])));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + kHalf), vto_bf16(_mm256_loadu_ps(sums[r] + kHalf)));
  }
}
#endif

// The first n of each row's 16 sums to y[r], as float32 or bfloat16.
template <int kRows, bool kOutBf16>
void store_rows(const float (*sums)[kPanel], void* const* y, int64_t n) {
  for (int r = 0; r < kRows; ++r)
    for (int64_t c = 0; c < n; ++c) {
      if constexpr (kOutBf16) {
        static_cast<uint16_t*>(y[r])[c] = float_to_bf16(sums[r][c]);
      } else {
        static_cast<float*>(y[r])[c] = sums[r][c];
      }
    }
}

#if PL_PANEL_AVX2
// A register block's sums (lo, hi: columns 0-7 and 8-15) times the column scales, plus the bias, to y.
template <int kRows, Format kFormat, bool kOutBf16>
void store_sums(__m256* lo, __m256* hi, const float* scale, const float* bias, void* const* y, int64_t n) {
  float sums[kRows][kPanel];
  apply_scale<kRows, kFormat>(lo, scale);
  apply_scale<kRows, kFormat>(hi, scale + kHalf);
  const __m256 b_lo = bias ? _mm256_loadu_ps(bias) : _mm256_setzero_ps();
  const __m256 b_hi = bias ? _mm256_loadu_ps(bias + kHalf) : _mm256_setzero_ps();
  const bool whole = n == kPanel;
  for (int r = 0; r < kRows; ++r) {
    float* dst = !kOutBf16 && whole ? static_cast<float*>(y[r]) : sums[r];
    _mm256_storeu_ps(dst, _mm256_add_ps(lo[r], b_lo));
    _mm256_storeu_ps(dst + kHalf, _mm256_add_ps(hi[r], b_hi));
  }
  if (whole) {
    if constexpr (kOutBf16) store_bf16_rows(sums, kRows, y);
    return;
  }
  store_rows<kRows, kOutBf16>(sums, y, n);
}
#endif

// y[r][0..16) = x[r] . panel (* scale) (+ bias) for `rows` rows, stored as float32 or bfloat16 (`n` columns
// valid); `scale` (int8 and e4m3 panels only): the panel's 16 column scales.
template <int kRows, Format kFormat, bool kOutBf16>
void linear_block(const float* const* x, const void* panel, int64_t k, const float* scale, const float* bias,
                  void* const* y, int64_t n, const void* ahead) {
#if PL_PANEL_AVX2
  __m256 lo[kRows], hi[kRows];
  panel_dot<kRows, kFormat>(x, panel, k, lo, hi, ahead);
  store_sums<kRows, kFormat, kOutBf16>(lo, hi, scale, bias, y, n);
#else
  float sums[kRows][kPanel];
  panel_dot<kRows, kFormat>(x, panel, k, sums);
  for (int r = 0; r < kRows; ++r)
    for (int64_t c = 0; c < kPanel; ++c) sums[r][c] = sums[r][c] * column_scale<kFormat>(scale, c) + (bias ? bias[c] : 0.f);
  store_rows<kRows, kOutBf16>(sums, y, n);
#endif
}

template <Format kFormat, bool kOutBf16>
struct Linear {
  template <int kRows>
  struct Block {
    template <typename... Args>
    static void run(Args&&... args) { linear_block<kRows, kFormat, kOutBf16>(args...); }
  };
};

// The register blocks over one panel's `rows` rows (x rows from `xs`, outputs at `out_base`). Inlined into
// each caller: called from two places (`run`, `bf16_panel_rows_run`), GCC kept it out of line and the
// forward's bfloat16 linears ran 2.8x slower at 16 to 128 rows on an AVX2 EPYC.
template <Format kFormat, bool kOutBf16>
__attribute__((always_inline)) inline void panel_blocks(const float* xs, int64_t rows, int64_t k, const void* panel, const float* scale, const float* bias,
                  uint8_t* out_base, int64_t n, int64_t cols, const void* ahead, bool fixed_order) {
  const int64_t out_elem = kOutBf16 ? 2 : 4;
  for (int64_t s0 = 0; s0 < rows;) {
    const int block = block_rows(rows - s0);
    const float* xr[kMaxRows];
    void* yr[kMaxRows];
    float scratch[kPanel];  // the outputs of a fixed-order block's repeated rows
    for (int r = 0; r < block; ++r) xr[r] = xs + (s0 + r) * k, yr[r] = out_base + (s0 + r) * n * out_elem;
    int width = block;
    for (; fixed_order && width < kMinFixedRows; ++width) xr[width] = xr[block - 1], yr[width] = scratch;
    dispatch_rows<Linear<kFormat, kOutBf16>::template Block>(width, xr, panel, k, scale, bias, yr, cols, ahead);
    s0 += block, ahead = nullptr;
  }
}

// An int8 or e4m3 panel as float32, its column scales folded in. Each register block widens the panel it
// reads again (int8: two instructions per 8 weights, e4m3: three, bfloat16: one), and with many blocks over
// a panel (a prefill's 48-row chunks take 8) that cost as much as the products: widened once per panel and
// chunk, the blocks stream float32 from L1/L2 instead. Measured in one process on an AVX2 AMD EPYC, 384
// rows of model S's [1536 x 576] MLP shape: int8 widened 6.56 ms, in registers 11.66 (8-row calls),
// bfloat16 7.54 (24-row calls). Widening bfloat16 panels the same way measured no faster (4.54 vs 4.58 ms;
// the lm_head 165 vs 152), so bfloat16 keeps its in-register widening.
template <Format kFormat>
void widen_panel(const void* panel, int64_t k, const float* scale, float* out) {
  float s[kPanel];
  for (int64_t c = 0; c < kPanel; ++c) s[c] = column_scale<kFormat>(scale, c);
#if PL_PANEL_AVX2
  if constexpr (kFormat == kFp8) {  // as panel_dot reads e4m3: through a half
    const __m256 s_lo = _mm256_loadu_ps(s), s_hi = _mm256_loadu_ps(s + kHalf);
    const __m128i zero = _mm_setzero_si128(), no_bit_14 = _mm_set1_epi16(static_cast<short>(0xbfff));
    const uint8_t* p = static_cast<const uint8_t*>(panel);
    for (int64_t i = 0; i < k; ++i, p += kPanel, out += kPanel) {
      const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
      const __m256 lo = _mm256_cvtph_ps(_mm_and_si128(_mm_srai_epi16(_mm_unpacklo_epi8(zero, v), 1), no_bit_14));
      const __m256 hi = _mm256_cvtph_ps(_mm_and_si128(_mm_srai_epi16(_mm_unpackhi_epi8(zero, v), 1), no_bit_14));
      _mm256_storeu_ps(out, _mm256_mul_ps(lo, s_lo));
      _mm256_storeu_ps(out + kHalf, _mm256_mul_ps(hi, s_hi));
    }
    return;
  }
#endif
  for (int64_t i = 0; i < k; ++i)
    for (int64_t c = 0; c < kPanel; ++c) {
      const uint8_t byte = static_cast<const uint8_t*>(panel)[i * kPanel + c];
      const float w = kFormat == kI8 ? static_cast<float>(static_cast<int8_t>(byte)) : fp8_to_float_unscaled(byte);
      out[i * kPanel + c] = w * s[c];
    }
}

// x rows [r0, r0 + rows) as float32: float32 x as it is, bfloat16 x widened into `scratch`. Plain loops,
// not ATen's narrow / to / contiguous: at one row those four ops and their allocations cost more than a small
// projection's products (model S's 121 linears a decode step).
inline const float* float_rows(const void* x, bool x_bf16, int64_t r0, int64_t rows, int64_t k,
                               std::vector<float>& scratch) {
  if (!x_bf16) return static_cast<const float*>(x) + r0 * k;
  scratch.resize(rows * k);
  const uint16_t* src = static_cast<const uint16_t*>(x) + r0 * k;
  for (int64_t i = 0; i < rows * k; ++i) scratch[i] = bf16_to_float(src[i]);
  return scratch.data();
}

#if PL_PANEL_AVX2
constexpr int kStreams = 4;  // panels one x row reads at once per thread (panel_dot_streams)

// One x row times panels [first, last): the run cut in kStreams equal parts, read side by side. The same
// sums, bit for bit, as a one-row register block (panel_blocks) gives, for every panel format.
template <Format kFormat, bool kOutBf16>
void one_row_run(const float* x, int64_t k, const uint8_t* packed, const float* scale, const float* bias, int64_t n,
                 uint8_t* out_base, int64_t first, int64_t last) {
  const int64_t panel_bytes = k * kPanel * format_bytes(kFormat), out_elem = kOutBf16 ? 2 : 4;
  auto store = [&](int64_t p, __m256* lo, __m256* hi) {
    const int64_t cols = std::min(kPanel, n - p * kPanel);
    float last_bias[kPanel] = {};  // the last panel's, zero-padded: the kernel reads 16
    const float* b = bias ? bias + p * kPanel : nullptr;
    if (b && cols < kPanel) std::copy(b, b + cols, last_bias), b = last_bias;
    void* y[1] = {out_base + p * kPanel * out_elem};
    store_sums<1, kFormat, kOutBf16>(lo, hi, scale ? scale + p * kPanel : nullptr, b, y, cols);
  };
  const int64_t part = (last - first) / kStreams;
  for (int64_t j = 0; j < part; ++j) {
    const void* at[kStreams];
    __m256 lo[kStreams], hi[kStreams];
    for (int q = 0; q < kStreams; ++q) at[q] = packed + (first + q * part + j) * panel_bytes;
    panel_dot_streams<kStreams, kFormat>(x, at, k, lo, hi);
    for (int q = 0; q < kStreams; ++q) store(first + q * part + j, lo + q, hi + q);
  }
  for (int64_t p = first + kStreams * part; p < last; ++p) {
    const void* at[1] = {packed + p * panel_bytes};
    __m256 lo[1], hi[1];
    panel_dot_streams<1, kFormat>(x, at, k, lo, hi);
    store(p, lo, hi);
  }
}

// One x row times every panel: each thread's run of panels (`one_row_run`).
template <Format kFormat, bool kOutBf16>
void one_row(const float* x, int64_t k, const uint8_t* packed, const float* scale, const float* bias, int64_t n,
             uint8_t* out_base) {
  parallel_runs((n + kPanel - 1) / kPanel, [&](int64_t first, int64_t last) {
    one_row_run<kFormat, kOutBf16>(x, k, packed, scale, bias, n, out_base, first, last);
  });
}
#endif

// x: m rows of k float32 or bfloat16 values, contiguous.
template <Format kFormat, bool kOutBf16>
void run(const void* x, bool x_bf16, int64_t m, int64_t k, const uint8_t* packed, const float* scale,
         const float* bias, int64_t n, at::Tensor& out, bool fixed_order) {
  const int64_t panels = (n + kPanel - 1) / kPanel;
  const int64_t panel_bytes = k * kPanel * format_bytes(kFormat), out_elem = kOutBf16 ? 2 : 4;
  uint8_t* out_base = static_cast<uint8_t*>(out.data_ptr());
  std::vector<float> widened_x;
#if PL_PANEL_AVX2
  if (m == 1 && !fixed_order) {  // a fixed-order row is summed as a 4-row block's (one chain)
    one_row<kFormat, kOutBf16>(float_rows(x, x_bf16, 0, 1, k, widened_x), k, packed, scale, bias, n, out_base);
    return;
  }
#endif
  for (int64_t r0 = 0; r0 < m; r0 += kChunkRows) {
    const int64_t rows = std::min(kChunkRows, m - r0);
    const float* xs = float_rows(x, x_bf16, r0, rows, k, widened_x);
    parallel_balanced(
        panels, [](int64_t) { return int64_t(1); },
        [&](int64_t p) {
          const uint8_t* panel = packed + p * panel_bytes;
          const int64_t cols = std::min(kPanel, n - p * kPanel);
          float last_bias[kPanel] = {};  // the last panel's, zero-padded: the kernel reads 16
          const float* b = bias ? bias + p * kPanel : nullptr;
          if (b && cols < kPanel) std::copy(b, b + cols, last_bias), b = last_bias;
          const float* s = scale ? scale + p * kPanel : nullptr;
          const void* ahead = p + 1 < panels ? panel + panel_bytes : nullptr;  // this thread's next, mostly
          uint8_t* y = out_base + (r0 * n + p * kPanel) * out_elem;
          if constexpr (is_quantized(kFormat)) {
            if (rows >= kWidenRows) {
              thread_local std::vector<float> widened;
              widened.resize(k * kPanel);
              widen_panel<kFormat>(panel, k, s, widened.data());
              panel_blocks<kF32, kOutBf16>(xs, rows, k, widened.data(), nullptr, b, y, n, cols, nullptr, fixed_order);
              return;
            }
          }
          panel_blocks<kFormat, kOutBf16>(xs, rows, k, panel, s, b, y, n, cols, ahead, fixed_order);
        });
  }
}

}  // namespace

// x [..., K] (float32 or bfloat16) @ W^T (+ bias) -> [..., N] in x's dtype; W [N, K] packed as the header
// says (float32, bfloat16, int8 or float8_e4m3fn panels), bias [N] of any float dtype (summed in float32).
// int8 and e4m3 panels take `scale`, float32 [16 * panels]: each output column's (zero-padded), which
// multiplies its sums (weight-only quantization: x stays float, half or a quarter of the bytes stream).
// fixed_order: each row's result is the same bits whatever the number of rows (see the top of this file).
at::Tensor cpu_panel_linear(const at::Tensor& input, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                            int64_t out_features, bool fixed_order, const c10::optional<at::Tensor>& scale) {
  TORCH_CHECK(input.dim() >= 1 && (input.scalar_type() == at::kFloat || input.scalar_type() == at::kBFloat16),
              "cpu_panel_linear: float32 or bfloat16 x [..., K]");
  const int64_t k = input.size(-1), n = out_features, panels = (n + kPanel - 1) / kPanel;
  const auto wtype = packed.scalar_type();
  const bool quantized = wtype == at::kChar || wtype == at::kFloat8_e4m3fn;
  TORCH_CHECK(packed.dim() == 3 && packed.size(0) == panels && packed.size(1) == k && packed.size(2) == kPanel &&
                  packed.is_contiguous() && (wtype == at::kFloat || wtype == at::kBFloat16 || quantized),
              "cpu_panel_linear: the weight must be packed by platforms/cpu_linear.py for ", n, " x ", k);
  const bool has_scale = scale.has_value() && scale->defined();
  TORCH_CHECK(has_scale == quantized, "cpu_panel_linear: int8 and float8_e4m3fn weights take a scale, others none");
  if (has_scale)
    TORCH_CHECK(scale->scalar_type() == at::kFloat && scale->is_contiguous() && scale->numel() == panels * kPanel,
                "cpu_panel_linear: a float32 scale of ", panels * kPanel, " values (one per padded column)");
  const float* s = has_scale ? scale->data_ptr<float>() : nullptr;
  at::Tensor bias_f32;
  std::vector<float> widened_bias;
  const float* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->numel() == n, "cpu_panel_linear: a bias of ", n, " values");
    if (bias->scalar_type() == at::kBFloat16 && bias->is_contiguous()) {  // the model's dtype: no ATen op
      const auto* src = static_cast<const uint16_t*>(bias->data_ptr());
      widened_bias.resize(n);
      for (int64_t c = 0; c < n; ++c) widened_bias[c] = bf16_to_float(src[c]);
      b = widened_bias.data();
    } else {
      bias_f32 = bias->to(at::kFloat).contiguous();
      b = bias_f32.data_ptr<float>();
    }
  }
  std::vector<int64_t> shape(input.sizes().begin(), input.sizes().end());
  shape.back() = n;
  auto out = input.new_empty(shape);
  const int64_t m = k == 0 ? 0 : input.numel() / k;
  if (m == 0 || n == 0) return out;
  const at::Tensor contiguous = input.is_contiguous() ? input : input.contiguous();
  const void* x = contiguous.data_ptr();
  const auto* w = static_cast<const uint8_t*>(packed.data_ptr());
  const bool bf16 = input.scalar_type() == at::kBFloat16;  // x's dtype, and so the output's
  const bool f = fixed_order;
  switch (wtype) {
    case at::kBFloat16:
      bf16 ? run<kBf16, true>(x, bf16, m, k, w, s, b, n, out, f) : run<kBf16, false>(x, bf16, m, k, w, s, b, n, out, f);
      break;
    case at::kFloat:
      bf16 ? run<kF32, true>(x, bf16, m, k, w, s, b, n, out, f) : run<kF32, false>(x, bf16, m, k, w, s, b, n, out, f);
      break;
    case at::kChar:
      bf16 ? run<kI8, true>(x, bf16, m, k, w, s, b, n, out, f) : run<kI8, false>(x, bf16, m, k, w, s, b, n, out, f);
      break;
    default:
      bf16 ? run<kFp8, true>(x, bf16, m, k, w, s, b, n, out, f) : run<kFp8, false>(x, bf16, m, k, w, s, b, n, out, f);
  }
  return out;
}

bool panel_rows_available() { return PL_PANEL_AVX2; }

#if PL_PANEL_AVX2
void bf16_panel_row_run(const float* x, int64_t k, const uint16_t* w, const float* bias, int64_t n, uint16_t* y,
                        int64_t first, int64_t last) {
  one_row_run<kBf16, true>(x, k, reinterpret_cast<const uint8_t*>(w), nullptr, bias, n,
                           reinterpret_cast<uint8_t*>(y), first, last);
}

void bf16_panel_rows_run(const float* x, int64_t m, int64_t k, const uint16_t* w, const float* bias, int64_t n,
                         uint16_t* y, int64_t first, int64_t last) {
  const int64_t panel_bytes = k * kPanel * 2;
  const auto* packed = reinterpret_cast<const uint8_t*>(w);
  for (int64_t r0 = 0; r0 < m; r0 += kChunkRows) {  // as `run` blocks a batch's rows: the same sums
    const int64_t rows = std::min(kChunkRows, m - r0);
    for (int64_t p = first; p < last; ++p) {
      const int64_t cols = std::min(kPanel, n - p * kPanel);
      float last_bias[kPanel] = {};  // the last panel's, zero-padded: the kernel reads 16
      const float* b = bias ? bias + p * kPanel : nullptr;
      if (b && cols < kPanel) std::copy(b, b + cols, last_bias), b = last_bias;
      const void* ahead = p + 1 < last ? packed + (p + 1) * panel_bytes : nullptr;
      panel_blocks<kBf16, true>(x + r0 * k, rows, k, packed + p * panel_bytes, nullptr, b,
                                reinterpret_cast<uint8_t*>(y + r0 * n + p * kPanel), n, cols, ahead, false);
    }
  }
}
#endif

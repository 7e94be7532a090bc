// Fused mixture-of-experts for CPUs: one step's expert MLPs over prepacked weights.
//
// Why: run expert by expert in PyTorch (core/moe.py's reference), a decode step pays a gather, two GEMM
// calls, the activation's temporaries and an index_add per chosen expert, and oneDNN re-reads each weight
// in its own order per call. Here the step's (token, expert) pairs are sorted by expert once (counts, a
// prefix sum, a permutation; experts no token chose are skipped), and each chosen expert's weights are read
// once per step in panels laid out for the loop that multiplies them against all of that expert's tokens.
//
// Layout (packed by platforms/cpu_moe.py; padding is zero):
//   w13 [E, ceil(I/8), H, 16]: panel p holds gate rows 8p..8p+7 and up rows 8p..8p+7 of w13 [E, 2I, H],
//     k-major, so a panel is one sequential read and each k step is 16 weights: 8 gate and 8 up columns.
//   w2  [E, ceil(H/16), I, 16]: panel p holds output rows 16p..16p+15 of w2 [E, H, I], k-major.
//   Within a k step, float32 keeps the columns in order; bfloat16 interleaves them (value 2j is column j,
//   2j + 1 column 8 + j), so that one 256-bit load becomes the two 8-float halves by a shift and a mask.
//   Quantized experts (weight-only) keep one byte per weight, columns in order: int8, or fp8 e4m3fn. Each
//   comes with float32 scales per column (per row of w13/w2), laid out as the biases.
//   Biases are float32: [E, 16 ceil(I/8)] (per panel: 8 gate, then 8 up) and [E, 16 ceil(H/16)].
//
// A step, per chunk of tokens (bounding the float32 buffers): (1) per (expert, w13 panel), every row of the
// expert's tokens times the panel, in float32 registers (up to 6 rows x 16 columns), then in the epilogue
// the bias and the activation, giving 8 activation columns of each row; (2) per (expert, w2 panel), the
// activation rows times the panel, the bias, times the routing weight; (3) per token, the sum of its top-k
// rows in float32, rounded to the output dtype once. A quantized panel's bytes are widened to float32 as they
// are read (int8 by sign extension; e4m3 through a half: see panel_dot) and its scales multiply the sums
// once, after the k reduction, before the bias. Work is split between threads in contiguous runs of
// equal cost (a panel's weight read plus its rows), so each thread streams its panels once and experts
// with many tokens do not leave a thread idle: whole experts (both GEMMs, one parallel region) where there
// are at least 4 chosen experts per thread, else the (expert, panel) items of (1), then of (2).
//
// Products are summed in float32 in k order (the reference rounds gate/up, the activation and the down
// projection to bfloat16 in between; this does not). Built with the other kernels (-march=native): the
// AVX2+FMA(+F16C) path, or plain C++ where the compiler may not use them. AVX-512 and AMX CPUs run the
// AVX2 path, int8 experts included: weight-only, not AMX's int8 tiles (W8A8, as the dense int8 layers run).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "kernels.h"
#include "moe_routing.h"
#include "panels.h"

namespace {

constexpr int64_t kPanelCost = 4;  // a panel's weight read, in rows of compute (for splitting the work)
constexpr int64_t kBufferFloats = int64_t(1) << 23;  // float32 buffers per chunk of tokens (32 MB)
// With at least this many chosen experts per thread, threads take whole experts (one parallel region a
// step: a second region's wake-up and barrier cost more than a decode step's work on a busy machine);
// with fewer, they share each GEMM's panels (two regions).
constexpr int64_t kExpertsPerThread = 4;

#if PL_PANEL_AVX2
// e^x, x clamped to [-87, 88] (beyond, sigmoid is 0 or 1 in float32 anyway); relative error ~1e-7.
inline __m256 vexp(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.f)), _mm256_set1_ps(88.f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.f / 720);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 120));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 24));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

inline __m256 vsigmoid(__m256 x) {
  const __m256 one = _mm256_set1_ps(1.f);
  return _mm256_div_ps(one, _mm256_add_ps(one, vexp(_mm256_sub_ps(_mm256_setzero_ps(), x))));
}

inline __m256 vactivate(__m256 gate, __m256 up, const ActParams& a) {
  switch (a.kind) {
    case kSilu:
      return _mm256_mul_ps(_mm256_mul_ps(gate, vsigmoid(gate)), up);
    case kGeluTanh: {
      const __m256 g3 = _mm256_mul_ps(_mm256_mul_ps(gate, gate), gate);
      const __m256 z = _mm256_mul_ps(_mm256_set1_ps(2.f * kGeluC), _mm256_fmadd_ps(_mm256_set1_ps(0.044715f), g3, gate));
      return _mm256_mul_ps(_mm256_mul_ps(gate, vsigmoid(z)), up);
    }
    case kSwigluOai: {
      const __m256 limit = _mm256_set1_ps(a.limit);
      const __m256 g = _mm256_min_ps(gate, limit);
      const __m256 u = _mm256_min_ps(_mm256_max_ps(up, _mm256_sub_ps(_mm256_setzero_ps(), limit)), limit);
      const __m256 gs = _mm256_mul_ps(g, vsigmoid(_mm256_mul_ps(_mm256_set1_ps(a.alpha), g)));
      return _mm256_mul_ps(_mm256_add_ps(u, _mm256_set1_ps(1.f)), gs);
    }
  }
  return _mm256_setzero_ps();
}
#endif

// ---- the two GEMMs' register blocks with their epilogues -------------------------------------------------

// Gate/up of `rows` rows (x: their float32 inputs) against one w13 panel, then bias and activation:
// act[r][0..8) = activation columns 8p..8p+7 of row r.
template <int kRows, Format kFormat>
void gate_up_block(const float* const* x, const void* panel, int64_t h, const float* scale, const float* bias,
                   const ActParams& a, float* const* act, const void* ahead) {
#if PL_PANEL_AVX2
  __m256 gate[kRows], up[kRows];
  panel_dot<kRows, kFormat>(x, panel, h, gate, up, ahead);
  apply_scale<kRows, kFormat>(gate, scale);
  apply_scale<kRows, kFormat>(up, scale + kHalf);
  const __m256 bg = bias ? _mm256_loadu_ps(bias) : _mm256_setzero_ps();
  const __m256 bu = bias ? _mm256_loadu_ps(bias + kHalf) : _mm256_setzero_ps();
  for (int r = 0; r < kRows; ++r)
    _mm256_storeu_ps(act[r], vactivate(_mm256_add_ps(gate[r], bg), _mm256_add_ps(up[r], bu), a));
#else
  float sums[kRows][kPanel];
  panel_dot<kRows, kFormat>(x, panel, h, sums);
  for (int r = 0; r < kRows; ++r)
    for (int64_t j = 0; j < kHalf; ++j)
      act[r][j] = activate(sums[r][j] * column_scale<kFormat>(scale, j) + (bias ? bias[j] : 0.f),
                           sums[r][kHalf + j] * column_scale<kFormat>(scale, kHalf + j) + (bias ? bias[kHalf + j] : 0.f), a);
#endif
}

// Down projection of `rows` activation rows against one w2 panel, then (sum + bias) * routing weight:
// y[r][0..16) = the weighted output columns 16p..16p+15 of row r.
template <int kRows, Format kFormat>
void down_block(const float* const* act, const void* panel, int64_t inter, const float* scale, const float* bias,
                const float* weight, float* const* y, const void* ahead) {
#if PL_PANEL_AVX2
  __m256 lo[kRows], hi[kRows];
  panel_dot<kRows, kFormat>(act, panel, inter, lo, hi, ahead);
  apply_scale<kRows, kFormat>(lo, scale);
  apply_scale<kRows, kFormat>(hi, scale + kHalf);
  const __m256 b_lo = bias ? _mm256_loadu_ps(bias) : _mm256_setzero_ps();
  const __m256 b_hi = bias ? _mm256_loadu_ps(bias + kHalf) : _mm256_setzero_ps();
  for (int r = 0; r < kRows; ++r) {
    const __m256 w = _mm256_set1_ps(weight[r]);
    _mm256_storeu_ps(y[r], _mm256_mul_ps(_mm256_add_ps(lo[r], b_lo), w));
    _mm256_storeu_ps(y[r] + kHalf, _mm256_mul_ps(_mm256_add_ps(hi[r], b_hi), w));
  }
#else
  float sums[kRows][kPanel];
  panel_dot<kRows, kFormat>(act, panel, inter, sums);
  for (int r = 0; r < kRows; ++r)
    for (int64_t c = 0; c < kPanel; ++c)
      y[r][c] = (sums[r][c] * column_scale<kFormat>(scale, c) + (bias ? bias[c] : 0.f)) * weight[r];
#endif
}

template <Format kFormat>
struct GateUp {
  template <int kRows>
  struct Block {
    template <typename... Args>
    static void run(Args&&... args) { gate_up_block<kRows, kFormat>(args...); }
  };
};

template <Format kFormat>
struct Down {
  template <int kRows>
  struct Block {
    template <typename... Args>
    static void run(Args&&... args) { down_block<kRows, kFormat>(args...); }
  };
};

// A packed per-column float32 vector (bias or scale) of every expert, or nullptr where there is none.
const float* optional_bias(const c10::optional<at::Tensor>& bias, int64_t experts, int64_t width, const char* name) {
  if (!bias.has_value() || !bias->defined()) return nullptr;
  TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->dim() == 2 && bias->size(0) == experts &&
                  bias->size(1) == width,
              "cpu_fused_moe: ", name, " must be packed float32 [", experts, ", ", width, "]");
  return bias->data_ptr<float>();
}

// The packed weights of one layer: panels and, for quantized ones, their column scales; float32 biases.
struct Experts {
  const uint8_t *w13, *w2;
  const float *s13, *s2, *b13, *b2;
};

template <Format kFormat>
void run_chunk(const float* x, int64_t h, const Routing& routing, const Experts& w, int64_t inter,
               const ActParams& act_params, float* act, float* y) {
  const int64_t elem = format_bytes(kFormat);
  const int64_t p13 = (inter + kHalf - 1) / kHalf, p2 = (h + kPanel - 1) / kPanel;
  const int64_t act_stride = p13 * kHalf, y_stride = p2 * kPanel;
  const int64_t w13_panel = h * kPanel * elem, w2_panel = inter * kPanel * elem;
  const int64_t chosen = static_cast<int64_t>(routing.experts.size());

  // gate/up and the activation of chosen expert c's rows against its w13 panel p
  auto gate_up = [&](int64_t c, int64_t p) {
    const int64_t e = routing.experts[c], end = routing.start[c] + routing.count[c];
    const uint8_t* panel = w.w13 + (e * p13 + p) * w13_panel;
    const float* scale = w.s13 ? w.s13 + (e * p13 + p) * kPanel : nullptr;
    const float* bias = w.b13 ? w.b13 + (e * p13 + p) * kPanel : nullptr;
    // read next: the expert's next w13 panel, after the last its first w2 panel
    const void* ahead = p + 1 < p13 ? panel + w13_panel : w.w2 + e * p2 * w2_panel;
    for (int64_t s0 = routing.start[c]; s0 < end;) {
      const int rows = block_rows(end - s0);
      const float* xr[kMaxRows];
      float* out[kMaxRows];
      for (int r = 0; r < rows; ++r) xr[r] = x + routing.token[s0 + r] * h, out[r] = act + (s0 + r) * act_stride + p * kHalf;
      dispatch_rows<GateUp<kFormat>::template Block>(rows, xr, panel, h, scale, bias, act_params, out, ahead);
      s0 += rows, ahead = nullptr;  // the later row blocks find the panel in cache
    }
  };
  // the down projection, bias and routing weight of expert c's activation rows against its w2 panel p
  auto down = [&](int64_t c, int64_t p) {
    const int64_t e = routing.experts[c], end = routing.start[c] + routing.count[c];
    const uint8_t* panel = w.w2 + (e * p2 + p) * w2_panel;
    const float* scale = w.s2 ? w.s2 + (e * p2 + p) * kPanel : nullptr;
    const float* bias = w.b2 ? w.b2 + (e * p2 + p) * kPanel : nullptr;
    // read next: the expert's next w2 panel, after the last the next chosen expert's first w13 panel
    const void* ahead = p + 1 < p2         ? panel + w2_panel
                        : c + 1 < chosen ? w.w13 + routing.experts[c + 1] * p13 * w13_panel
                                         : nullptr;
    for (int64_t s0 = routing.start[c]; s0 < end;) {
      const int rows = block_rows(end - s0);
      const float* ar[kMaxRows];
      float* out[kMaxRows];
      for (int r = 0; r < rows; ++r) ar[r] = act + (s0 + r) * act_stride, out[r] = y + (s0 + r) * y_stride + p * kPanel;
      dispatch_rows<Down<kFormat>::template Block>(rows, ar, panel, inter, scale, bias, routing.weight.data() + s0, out,
                                                   ahead);
      s0 += rows, ahead = nullptr;
    }
  };

  if (chosen >= kExpertsPerThread * at::get_num_threads()) {
    // enough experts to share out whole: one parallel region, each thread both GEMMs of its experts
    parallel_balanced(
        chosen, [&](int64_t c) { return routing.count[c] + kPanelCost; },
        [&](int64_t c) {
          for (int64_t p = 0; p < p13; ++p) gate_up(c, p);
          for (int64_t p = 0; p < p2; ++p) down(c, p);
        });
    return;
  }
  // few experts: share out their panels, gate/up for all of them before any down projection
  parallel_balanced(
      chosen * p13, [&](int64_t i) { return routing.count[i / p13] + kPanelCost; },
      [&](int64_t i) { gate_up(i / p13, i % p13); });
  parallel_balanced(
      chosen * p2, [&](int64_t i) { return routing.count[i / p2] + kPanelCost; },
      [&](int64_t i) { down(i / p2, i % p2); });
}

// out[t] = sum over k of y[position[t, k]], in float32, then rounded to the output dtype.
template <bool kOutBf16>
void sum_top_k(const float* y, int64_t y_stride, const Routing& routing, int64_t tokens, int64_t top_k, int64_t h,
               void* out) {
  at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> row(h);
    for (int64_t t = begin; t < end; ++t) {
      const float* first = y + routing.position[t * top_k] * y_stride;
      std::copy(first, first + h, row.begin());
      for (int64_t k = 1; k < top_k; ++k) {
        const float* src = y + routing.position[t * top_k + k] * y_stride;
        int64_t i = 0;
#if PL_PANEL_AVX2
        for (; i + 8 <= h; i += 8) _mm256_storeu_ps(row.data() + i, _mm256_add_ps(_mm256_loadu_ps(row.data() + i), _mm256_loadu_ps(src + i)));
#endif
        for (; i < h; ++i) row[i] += src[i];
      }
      if constexpr (kOutBf16) {
        uint16_t* dst = static_cast<uint16_t*>(out) + t * h;
        int64_t i = 0;
#if PL_PANEL_AVX2
        for (; i + 8 <= h; i += 8) _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), vto_bf16(_mm256_loadu_ps(row.data() + i)));
#endif
        for (; i < h; ++i) dst[i] = float_to_bf16(row[i]);
      } else {
        std::copy(row.begin(), row.end(), static_cast<float*>(out) + t * h);
      }
    }
  });
}

}  // namespace

// hidden [T, H] (float32 or bfloat16), topk_weights [T, K], topk_ids [T, K], w13/w2/biases packed as the
// header says -> [T, H] in hidden's dtype.
at::Tensor cpu_fused_moe(const at::Tensor& hidden, const at::Tensor& topk_weights, const at::Tensor& topk_ids,
                         const at::Tensor& w13, const at::Tensor& w2, const c10::optional<at::Tensor>& w13_bias,
                         const c10::optional<at::Tensor>& w2_bias, const c10::optional<at::Tensor>& w13_scale,
                         const c10::optional<at::Tensor>& w2_scale, c10::string_view activation, double swiglu_alpha,
                         double swiglu_limit) {
  TORCH_CHECK(hidden.dim() == 2 && (hidden.scalar_type() == at::kFloat || hidden.scalar_type() == at::kBFloat16),
              "cpu_fused_moe: hidden must be float32 or bfloat16 [tokens, hidden]");
  const at::ScalarType wtype = w13.scalar_type();
  const Format format = wtype == at::kFloat ? kF32 : wtype == at::kBFloat16 ? kBf16 : wtype == at::kChar ? kI8 : kFp8;
  TORCH_CHECK(w13.dim() == 4 && w2.dim() == 4 && w13.size(3) == kPanel && w2.size(3) == kPanel && w13.is_contiguous() &&
                  w2.is_contiguous() && w2.scalar_type() == wtype &&
                  (format != kFp8 || wtype == at::kFloat8_e4m3fn),
              "cpu_fused_moe: w13 and w2 must be packed by platforms/cpu_moe.py (float32, bfloat16, int8 or "
              "float8_e4m3fn)");
  const int64_t tokens = hidden.size(0), h = hidden.size(1), num_experts = w13.size(0), inter = w2.size(2);
  const int64_t p13 = (inter + kHalf - 1) / kHalf, p2 = (h + kPanel - 1) / kPanel;
  TORCH_CHECK(w13.size(1) == p13 && w13.size(2) == h && w2.size(0) == num_experts && w2.size(1) == p2,
              "cpu_fused_moe: packed weights do not match hidden size ", h);
  TORCH_CHECK(topk_ids.dim() == 2 && topk_ids.size(0) == tokens && topk_weights.sizes() == topk_ids.sizes(),
              "cpu_fused_moe: topk_weights and topk_ids must both be [tokens, top_k]");
  const float* b13 = optional_bias(w13_bias, num_experts, p13 * kPanel, "w13_bias");
  const float* b2 = optional_bias(w2_bias, num_experts, p2 * kPanel, "w2_bias");
  const float* s13 = optional_bias(w13_scale, num_experts, p13 * kPanel, "w13_scale");
  const float* s2 = optional_bias(w2_scale, num_experts, p2 * kPanel, "w2_scale");
  TORCH_CHECK(is_quantized(format) == (s13 != nullptr) && is_quantized(format) == (s2 != nullptr),
              "cpu_fused_moe: int8 and float8_e4m3fn weights take both scales, float weights none");
  const ActParams act_params{parse_activation(activation, "cpu_fused_moe"), static_cast<float>(swiglu_alpha), static_cast<float>(swiglu_limit)};
  auto out = hidden.new_empty({tokens, h});
  const int64_t top_k = topk_ids.size(1);
  if (tokens == 0 || h == 0) return out;
  if (top_k == 0) return out.zero_();

  const at::Tensor x = hidden.to(at::kFloat).contiguous();
  const at::Tensor ids = topk_ids.to(at::kLong).contiguous();
  const at::Tensor weights = topk_weights.to(at::kFloat).contiguous();
  const int64_t act_stride = p13 * kHalf, y_stride = p2 * kPanel;
  const int64_t chunk = std::max<int64_t>(1, std::min(tokens, kBufferFloats / (top_k * (act_stride + y_stride))));
  // uninitialised: every value read is written first (std::vector would zero megabytes a call)
  std::unique_ptr<float[]> act(new float[chunk * top_k * act_stride]), y(new float[chunk * top_k * y_stride]);
  const Experts experts{static_cast<const uint8_t*>(w13.data_ptr()), static_cast<const uint8_t*>(w2.data_ptr()), s13, s2,
                        b13, b2};
  const int64_t out_elem = out.element_size();
  for (int64_t t0 = 0; t0 < tokens; t0 += chunk) {
    const int64_t n = std::min(chunk, tokens - t0);
    const Routing routing = sort_pairs(ids.data_ptr<int64_t>() + t0 * top_k, weights.data_ptr<float>() + t0 * top_k,
                                       n, top_k, num_experts, "cpu_fused_moe");
    const float* xs = x.data_ptr<float>() + t0 * h;
    switch (format) {
      case kF32: run_chunk<kF32>(xs, h, routing, experts, inter, act_params, act.get(), y.get()); break;
      case kBf16: run_chunk<kBf16>(xs, h, routing, experts, inter, act_params, act.get(), y.get()); break;
      case kI8: run_chunk<kI8>(xs, h, routing, experts, inter, act_params, act.get(), y.get()); break;
      case kFp8: run_chunk<kFp8>(xs, h, routing, experts, inter, act_params, act.get(), y.get()); break;
    }
    void* dst = static_cast<uint8_t*>(out.data_ptr()) + t0 * h * out_elem;
    if (hidden.scalar_type() == at::kBFloat16) {
      sum_top_k<true>(y.get(), y_stride, routing, n, top_k, h, dst);
    } else {
      sum_top_k<false>(y.get(), y_stride, routing, n, top_k, h, dst);
    }
  }
  return out;
}

std::string fused_moe_isa() { return PL_PANEL_AVX2 ? "avx2" : "scalar"; }

// A decode step of a dense Llama-shaped model (Llama, Mistral, SmolLM2, Qwen2, Qwen3) in one native call,
// one request's token or a batch's (a row per request; up to kGgufDirectRows where some linears are GGUF
// blocks), its linears either GGUF blocks on gguf_linear.cpp's products straight from the blocks (any build:
// AVX2, AVX-512, AMX or plain C++; x quantized once per linear, the rows split as gguf_linear splits them,
// so the same bits) or bfloat16 on the pair kernel (linear_bf16_pairs.cpp: builds with AVX-512 BF16, which
// CPUs without AMX use for bfloat16 linears: AMD Zen 4 and 5) or the panel kernel (linear_panels.cpp: AVX2
// builds, the AVX2-only CPUs' layout: AMD Zen 2 and 3).
//
// Why: at one token a step reads the weights once (~8 ms for model S at ~35 GB/s on a 2-core Zen 4) and
// everything around those reads is serial. The compiled graph spent ~2 ms of model S's ~11.5 ms step
// outside the kernels: 151 custom-op calls through the dispatcher from inductor's C++ wrapper, ~150 small
// elementwise kernels and allocations, and an OpenMP region per op, whose start and end wait for the second
// thread. Here a layer's work after its attention and the next layer's before it (o_proj, add and norm,
// gate_up, SiLU and multiply, down, add and norm, qkv, q/k norms, rotary, the cache store) run in one
// parallel region, the threads meeting at a barrier between ops; attention is paged_attention, called
// directly (it splits the context between the threads itself). A batch's rows are multiplied as a batch's
// cpu_bf16_pair_linear or cpu_panel_linear call multiplies them (bf16_pair_rows_run, bf16_panel_rows_run),
// and the rows' norms, SiLU, rotary and cache stores split between the threads a row at a time.
//
// The arithmetic is the eager PyTorch forward's: every op rounds its result to bfloat16 where the model's
// modules do (RMSNorm in float32, scaled in bfloat16; rotary with cos/sin rounded to bfloat16; SiLU rounded
// before the multiply), the linears are the same kernel, so the step's hidden state differs from the
// eager one only where a float32 sum is taken in another order (the norms' sums of squares). The AVX-512
// build takes norms and SiLU 16 values at a time, its e^x within one float32 unit in the last place: over
// every bfloat16 gate value its SiLU rounds to the same bfloat16 as the scalar one's (libm's expf).
//
// The plan (weights, caches, sizes) is handed over once per engine (native_decoder_plan -> a handle); a
// step passes each row's token, position, cache slot and request's block table.

#include <ATen/Parallel.h>
#include <ATen/core/List.h>
#include <ATen/core/Tensor.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <vector>

#include "kernels.h"
#include "panels.h"
#include "avx512_helpers.h"

#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#define PL_NATIVE_PAIRS 1  // bf16_pair_row_run is in this build (linear_bf16_pairs.cpp)
#else
#define PL_NATIVE_PAIRS 0
#endif
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define PL_NATIVE_PANELS 1  // bf16_panel_row_run is in this build (linear_panels.cpp)
#else
#define PL_NATIVE_PANELS 0
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define PL_NATIVE_AVX512 1  // the rows' elementwise ops 16 values at a time
#else
#define PL_NATIVE_AVX512 0
#endif

namespace {

constexpr int64_t kPairCols = 16;  // output columns per panel of the pair layout
constexpr int64_t kCacheBf16 = 1;  // paged_attention's cache kind for bfloat16

struct PairWeight {
  const uint16_t* w = nullptr;
  int64_t n = 0, pairs = 0, panels = 0;
  std::vector<float> bias;  // whole panels, zero-padded; empty: none
  const float* b() const { return bias.empty() ? nullptr : bias.data(); }
};

struct GgufWeight {
  std::vector<const uint8_t*> parts;
  std::vector<int64_t> types, starts;  // starts: each part's first row, then n
  int64_t k = 0;
  const uint16_t* bias = nullptr;  // bfloat16, added after rounding (`gguf_linear(x) + bias`); or null
};

// A bfloat16 weight in 16-column panels (linear_panels.cpp, the AVX2 CPUs' layout), read with x widened
struct PanelWeight {
  const uint16_t* w = nullptr;
  int64_t n = 0, k = 0, panels = 0;
  std::vector<float> bias;  // [n], or empty
};

constexpr int64_t kPairType = -1, kPanelType = -2;  // part_types of the bfloat16 layouts

// A linear layer: pair-packed or panel-packed bfloat16, or GGUF blocks
struct Projection {
  bool gguf = false, panel = false;
  PairWeight pair;
  PanelWeight panels;
  GgufWeight blocks;
};

struct Layer {
  const uint16_t* in_norm = nullptr;
  const uint16_t* post_norm = nullptr;
  const uint16_t* q_norm = nullptr;  // Qwen3's per-head norms, or null
  const uint16_t* k_norm = nullptr;
  Projection qkv, o, gate_up, down;
  at::Tensor k_cache, v_cache;  // [kv_heads, blocks, block_size, head_size] bfloat16
  // routed experts in place of the MLP (top_k > 0): `gate_up` is then the router [experts, hidden], and
  // the experts are GGUF blocks (gate, up, down; gguf_moe) or the fused-MoE kernel's packed w13, w2
  int64_t top_k = 0, num_experts = 0;
  bool renormalize = false;
  std::vector<at::Tensor> experts;
  std::vector<int64_t> expert_types;  // GGML types of gate, up, down; empty: the fused-MoE kernel's
};

struct RowDeleter {
  void operator()(GgufRow* row) const { gguf_row_delete(row); }
};

struct Decoder {
  int64_t hidden = 0, heads = 0, kv_heads = 0, head_dim = 0, inter = 0, block_size = 0, qkv_n = 0;
  int64_t items_per_thread = 0, min_partition = 0, max_experts = 0, max_top_k = 0;
  float eps = 0.f, rope_scaling = 1.f;
  double scale = 1.0;
  bool amx = false;
  // the rows a step may take: any number, or kGgufDirectRows where some projections are GGUF blocks (the rows
  // gguf_linear multiplies straight from the blocks)
  int64_t max_rows = 1;
  std::vector<float> inv_freq;
  const uint8_t* embed = nullptr;  // [vocab, embed_row_bytes]
  int64_t embed_type = -1, embed_row_bytes = 0, vocab = 0;  // GGML type of the rows; -1: bfloat16
  const uint16_t* final_norm = nullptr;
  std::vector<Layer> layers;
  std::vector<at::Tensor> keep;  // the tensors the pointers above read
  // one step's values (bfloat16 bits), a row per request, reused; room for `capacity` rows
  int64_t rows = 0, capacity = 0;
  std::vector<uint16_t> h, residual, normed, qkv, gate_up, act;
  std::vector<float> cos, sin;  // rounded to bfloat16, as apply_rotary rounds them; head_dim / 2 per row
  std::unique_ptr<GgufRow, RowDeleter> xq;  // the next GGUF linear's x, quantized (the step's rows)
  std::vector<float> xf;                    // the next panel linear's x, widened (the step's rows)
  std::vector<uint16_t> router;             // an expert layer's router logits
  // an EAGLE-3 head (native_head_plan): its one layer's q/k/v read [input_layernorm(embeds);
  // hidden_norm(hidden)], 2 * hidden wide; its output, after the final norm, gives logits over its draft
  // vocabulary (lm_head), whose argmax d2t maps to the target's
  bool head = false, norm_before_residual = false;
  const uint16_t* hidden_norm = nullptr;
  Projection lm_head;
  std::vector<int64_t> d2t;
  std::vector<uint16_t> picked, logits;  // the rows drafted from, their logits
  // the kernels' tensors at `capacity` rows, and these step's `rows` of them
  at::Tensor moe_in_all, topk_weights_all, topk_ids_all, q_all, attn_all, seq_lens_all, query_start_all, reqs_all;
  at::Tensor moe_in, topk_weights, topk_ids;  // [rows, hidden] bfloat16, [rows, K] float32, [rows, K] int64
  at::Tensor q, attn, seq_lens, query_start, reqs;

  // room for n rows; the views of this step's
  void reserve(int64_t n) {
    if (n > capacity) {
      capacity = n;
      const int64_t d = head_dim;
      h.resize(n * hidden), residual.resize(n * hidden), normed.resize(n * hidden * (head ? 2 : 1));
      qkv.resize(n * qkv_n), picked.resize(head ? n * hidden : 0), logits.resize(head ? n * d2t.size() : 0);
      gate_up.resize(n * 2 * inter), act.resize(n * inter), router.resize(n * max_experts);
      cos.resize(n * d / 2), sin.resize(n * d / 2);
      const auto bf16 = keep[0].options().dtype(at::kBFloat16), ints = keep[0].options().dtype(at::kInt);
      q_all = keep[0].new_empty({n, heads, d}, bf16), attn_all = keep[0].new_empty({n, heads, d}, bf16);
      seq_lens_all = keep[0].new_empty({n}, ints), query_start_all = keep[0].new_empty({n + 1}, ints), reqs_all = keep[0].new_empty({n}, ints);
      for (int64_t r = 0; r <= n; ++r) query_start_all.data_ptr<int32_t>()[r] = int32_t(r);
      for (int64_t r = 0; r < n; ++r) reqs_all.data_ptr<int32_t>()[r] = int32_t(r);
      moe_in_all = keep[0].new_empty({n, hidden}, bf16);
      topk_weights_all = keep[0].new_empty({n, max_top_k}, keep[0].options().dtype(at::kFloat));
      topk_ids_all = keep[0].new_empty({n, max_top_k}, keep[0].options().dtype(at::kLong));
      rows = 0;
    }
    if (n != rows) {
      rows = n;
      q = q_all.narrow(0, 0, n), attn = attn_all.narrow(0, 0, n), seq_lens = seq_lens_all.narrow(0, 0, n);
      query_start = query_start_all.narrow(0, 0, n + 1), reqs = reqs_all.narrow(0, 0, n);
      moe_in = moe_in_all.narrow(0, 0, n), topk_weights = topk_weights_all.narrow(0, 0, n);
      topk_ids = topk_ids_all.narrow(0, 0, n);
    }
  }
};

std::mutex decoders_lock;
std::vector<std::unique_ptr<Decoder>>& decoders() {
  static std::vector<std::unique_ptr<Decoder>> all;
  return all;
}

inline float bf(uint16_t v) { return bf16_to_float(v); }
inline uint16_t rb(float f) { return float_to_bf16(f); }

const uint16_t* bits(const at::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.data_ptr()); }

#if PL_NATIVE_AVX512
// 16 bfloat16 values widened, and 16 floats rounded to bfloat16 as float_to_bf16 rounds them (to nearest
// even; NaN stays NaN)
inline __m512 load16(const uint16_t* p) {
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}
inline __m256i round16(__m512 f) {
  const __m512i bits = _mm512_castps_si512(f);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q);
  r = _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(bits, 16), _mm512_set1_epi32(0x40));
  return _mm512_cvtepi32_epi16(r);
}
inline void store16(uint16_t* p, __m512 f) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), round16(f)); }
inline __m512 rounded(__m512 f) {  // f rounded to bfloat16 and widened again
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(round16(f)), 16));
}

#endif

// float32 sum of squares of n bfloat16 values, 16 partial sums (a vectorisable order, as torch's is)
float sum_squares(const uint16_t* x, int64_t n) {
  float part[16] = {0.f};
  int64_t j = 0;
#if PL_NATIVE_AVX512
  __m512 acc = _mm512_setzero_ps();
  for (; j + 16 <= n; j += 16) {
    const __m512 v = load16(x + j);
    acc = _mm512_add_ps(acc, _mm512_mul_ps(v, v));
  }
  _mm512_storeu_ps(part, acc);
#else
  for (; j + 16 <= n; j += 16)
    for (int l = 0; l < 16; ++l) {
      const float v = bf(x[j + l]);
      part[l] += v * v;
    }
#endif
  for (; j < n; ++j) part[j % 16] += bf(x[j]) * bf(x[j]);
  float sum = 0.f;
  for (float p : part) sum += p;
  return sum;
}

// out = weight * (x / rms(x)): normalised in float32, rounded to bfloat16, then scaled in bfloat16
// (RMSNorm.forward). out may be x.
void rms_norm(const uint16_t* x, const uint16_t* weight, int64_t n, float eps, uint16_t* out) {
  const float r = 1.f / std::sqrt(sum_squares(x, n) / float(n) + eps);
  int64_t j = 0;
#if PL_NATIVE_AVX512
  const __m512 rv = _mm512_set1_ps(r);
  for (; j + 16 <= n; j += 16) store16(out + j, _mm512_mul_ps(load16(weight + j), rounded(_mm512_mul_ps(load16(x + j), rv))));
#endif
  for (; j < n; ++j) out[j] = rb(bf(weight[j]) * bf(rb(bf(x[j]) * r)));
}

// residual = h + residual (h alone before the first layer), out = rms_norm(residual) (add_and_norm)
void add_and_norm(const uint16_t* h, uint16_t* residual, bool first, const uint16_t* weight, int64_t n, float eps,
                  uint16_t* out) {
  if (first) {
    std::memcpy(residual, h, n * 2);
  } else {
    int64_t j = 0;
#if PL_NATIVE_AVX512
    for (; j + 16 <= n; j += 16) store16(residual + j, _mm512_add_ps(load16(h + j), load16(residual + j)));
#endif
    for (; j < n; ++j) residual[j] = rb(bf(h[j]) + bf(residual[j]));
  }
  rms_norm(residual, weight, n, eps, out);
}

// act[j] = SiLU(gate[j]) * up[j] for j in [first, last), SiLU rounded to bfloat16 before the multiply, as
// the eager ops round
void silu_mul(const uint16_t* gate, const uint16_t* up, uint16_t* act, int64_t first, int64_t last) {
  int64_t j = first;
#if PL_NATIVE_AVX512
  const __m512 one = _mm512_set1_ps(1.f);
  for (; j + 16 <= last; j += 16) {
    const __m512 g = load16(gate + j);
    const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), g));
    store16(act + j, _mm512_mul_ps(rounded(_mm512_div_ps(g, _mm512_add_ps(one, e))), load16(up + j)));
  }
#endif
  for (; j < last; ++j) {
    const float g = bf(gate[j]);
    act[j] = rb(bf(rb(g / (1.f + std::exp(-g)))) * bf(up[j]));
  }
}

// neox rotary of one head in place (apply_rotary in bfloat16: each product and sum rounded)
void rotate(uint16_t* x, const float* cos, const float* sin, int64_t half) {
  for (int64_t j = 0; j < half; ++j) {
    const float a = bf(x[j]), b = bf(x[j + half]), c = cos[j], s = sin[j];
    x[j] = rb(bf(rb(a * c)) - bf(rb(b * s)));
    x[j + half] = rb(bf(rb(b * c)) + bf(rb(a * s)));
  }
}

// Thread t of T's first of n items, taken in contiguous runs; one item goes to thread 0.
inline int64_t share(int64_t n, int t, int T) { return (n * t + T - 1) / T; }
// Thread t's rows [lo, hi) of B: a share, or all of them on thread 0 where `alone` (rows the next linear's
// x is made ready from by thread 0, `prepare`)
struct RowRun {
  int64_t lo, hi;
};
inline RowRun rows_of(int64_t B, int t, int T, bool alone) {
  if (alone) return t == 0 ? RowRun{0, B} : RowRun{B, B};
  return {share(B, t, T), share(B, t + 1, T)};
}

// thread t of T's part of y = x @ W^T (+ bias) for the step's rows: a GGUF weight's rows (as gguf_linear
// splits them) from the rows quantized beforehand into `xq`; at one row a pair- or panel-packed weight's run
// of panels (as parallel_runs splits them; a panel weight reads x widened beforehand into `xf`); at several a
// pair-packed weight's run of panel pairs, as cpu_bf16_pair_linear splits a batch, or a panel-packed one's
// run of panels over every row.
inline void linear(const Projection& w, const uint16_t* x, const Decoder& D, uint16_t* y, int t, int T) {
  if (D.rows > 1 && !w.gguf && !w.panel) {
#if PL_NATIVE_PAIRS
    const PairWeight& p = w.pair;
    const int64_t units = (p.panels + 1) / 2;
    bf16_pair_rows_run(x, D.rows, 2 * p.pairs, p.w, p.pairs, p.panels, p.b(), p.n, y, units * t / T,
                       units * (t + 1) / T);
#endif
    return;
  }
  if (w.gguf) {
    const GgufWeight& g = w.blocks;
    gguf_row_share(D.xq.get(), g.parts.data(), g.types.data(), g.starts.data(), g.parts.size(), g.k, g.bias, y, t,
                   T);
    return;
  }
  if (w.panel) {
#if PL_NATIVE_PANELS
    const PanelWeight& p = w.panels;
    const float* bias = p.bias.empty() ? nullptr : p.bias.data();
    if (D.rows == 1)
      bf16_panel_row_run(D.xf.data(), p.k, p.w, bias, p.n, y, p.panels * t / T, p.panels * (t + 1) / T);
    else
      bf16_panel_rows_run(D.xf.data(), D.rows, p.k, p.w, bias, p.n, y, p.panels * t / T, p.panels * (t + 1) / T);
#endif
    return;
  }
#if PL_NATIVE_PAIRS
  const PairWeight& p = w.pair;
  bf16_pair_row_run(x, p.w, p.pairs, p.b(), p.n, y, p.panels * t / T, p.panels * (t + 1) / T);
#endif
}

// x (the step's rows) made ready for `w` where it is GGUF (quantized) or panel-packed (widened), by
// one thread, before the barrier that precedes the linear
inline bool prepared(const Projection& w) { return w.gguf || w.panel; }
inline void prepare(Decoder& D, const Projection& w, const uint16_t* x, int64_t k) {
  if (w.gguf) gguf_row_quantize(D.xq.get(), x, D.rows, k);
  if (w.panel) {
    D.xf.resize(D.rows * k);
    for (int64_t j = 0; j < D.rows * k; ++j) D.xf[j] = bf(x[j]);
  }
}

template <typename Fn>
void region(Fn fn) {
  const int threads = at::get_num_threads();
#pragma omp parallel num_threads(threads)
  fn(omp_get_thread_num(), omp_get_num_threads());
}

// Layer L after its attention (whose output is in D.attn): o_proj, add and norm, the gated MLP; its output
// in D.h. Row work (norms, SiLU) is split between the threads a row at a time, one row's SiLU by elements.
void after_attention(Decoder& D, const Layer& L, int t, int T) {
  const int64_t B = D.rows, H = D.hidden, I = D.inter;
  linear(L.o, bits(D.attn), D, D.h.data(), t, T);
#pragma omp barrier
  const RowRun mine = rows_of(B, t, T, prepared(L.gate_up));
  for (int64_t r = mine.lo; r < mine.hi; ++r)
    add_and_norm(D.h.data() + r * H, D.residual.data() + r * H, false, L.post_norm, H, D.eps, D.normed.data() + r * H);
  if (t == 0 && prepared(L.gate_up)) prepare(D, L.gate_up, D.normed.data(), H);
#pragma omp barrier
  if (L.top_k > 0) {  // the router's logits; the experts run after the region (`run_experts`)
    linear(L.gate_up, D.normed.data(), D, D.router.data(), t, T);
    return;
  }
  linear(L.gate_up, D.normed.data(), D, D.gate_up.data(), t, T);
#pragma omp barrier
  // SiLU(gate) * up, rounded as the eager ops round; on one thread where the down projection quantizes or
  // widens it next
  const auto row_silu = [&](int64_t r, int64_t first, int64_t last) {
    const uint16_t* gate = D.gate_up.data() + r * 2 * I;
    silu_mul(gate, gate + I, D.act.data() + r * I, first, last);
  };
  if (prepared(L.down)) {
    if (t == 0) {
      for (int64_t r = 0; r < B; ++r) row_silu(r, 0, I);
      prepare(D, L.down, D.act.data(), I);
    }
  } else if (B == 1) {
    row_silu(0, I * t / T, I * (t + 1) / T);
  } else {
    for (int64_t r = share(B, t, T); r < share(B, t + 1, T); ++r) row_silu(r, 0, I);
  }
#pragma omp barrier
  linear(L.down, D.act.data(), D, D.h.data(), t, T);
#pragma omp barrier
}

// One row's routing from its router logits: the top k experts' ids and weights.
void route(const Layer& L, const uint16_t* logits, float* weights, int64_t* ids) {
  const int64_t E = L.num_experts, K = L.top_k;
  std::vector<float> scores(E);
  float top = -std::numeric_limits<float>::infinity(), sum = 0.f;
  for (int64_t e = 0; e < E; ++e) top = std::max(top, bf(logits[e]));
  for (int64_t e = 0; e < E; ++e) sum += scores[e] = std::exp(bf(logits[e]) - top);
  const float inv = 1.f / sum;
  for (float& v : scores) v *= inv;
  // torch.topk's CPU kernel (ATen/native/TopKImpl.h), step for step, so that experts whose bfloat16 logits
  // tie (common among 64) are chosen as the forward chooses them
  using Scored = std::pair<double, int64_t>;
  std::vector<Scored> queue(E);
  for (int64_t e = 0; e < E; ++e) queue[e] = {scores[e], e};
  const auto larger = [](const Scored& x, const Scored& y) {
    return (std::isnan(x.first) && !std::isnan(y.first)) || x.first > y.first;
  };
  if (K * 64 <= E) {
    std::partial_sort(queue.begin(), queue.begin() + K, queue.end(), larger);
  } else {
    std::nth_element(queue.begin(), queue.begin() + K - 1, queue.end(), larger);
    std::sort(queue.begin(), queue.begin() + K - 1, larger);
  }
  float chosen = 0.f;
  for (int64_t k = 0; k < K; ++k) ids[k] = queue[k].second, chosen += weights[k] = scores[queue[k].second];
  if (L.renormalize)
    for (int64_t k = 0; k < K; ++k) weights[k] /= chosen;
}

// An expert layer's MLP, on the calling thread after the region that computed its router logits: softmax
// over the experts in float32, the top k, divided by their sum where
// `renormalize` (select_experts), then the experts' kernel, called directly (it splits its work between
// the threads itself); the output in D.h.
void run_experts(Decoder& D, const Layer& L) {
  const int64_t E = L.num_experts, K = L.top_k;
  for (int64_t r = 0; r < D.rows; ++r) route(L, D.router.data() + r * E, D.topk_weights.data_ptr<float>() + r * K,
                                           D.topk_ids.data_ptr<int64_t>() + r * K);
  std::memcpy(D.moe_in.data_ptr(), D.normed.data(), D.rows * D.hidden * 2);
  const auto& x = L.experts;
  const at::Tensor out =
      L.expert_types.empty()
          ? cpu_fused_moe(D.moe_in, D.topk_weights, D.topk_ids, x[0], x[1], c10::nullopt, c10::nullopt, c10::nullopt,
                          c10::nullopt, "silu", 0.0, 0.0)
          : gguf_moe(D.moe_in, D.topk_weights, D.topk_ids, x[0], x[1], x[2], L.expert_types, c10::nullopt,
                     c10::nullopt, "silu", 0.0, 0.0);
  std::memcpy(D.h.data(), out.data_ptr(), D.rows * D.hidden * 2);
}


void qkv_and_cache(Decoder& D, const Layer& L, const int64_t* slots, int t, int T);

// Layer L up to its attention: add and norm, then `qkv_and_cache`.
void before_attention(Decoder& D, const Layer& L, bool first, const int64_t* slots, int t, int T) {
  const int64_t B = D.rows, H = D.hidden;
  const RowRun mine = rows_of(B, t, T, prepared(L.qkv));
  for (int64_t r = mine.lo; r < mine.hi; ++r)
    add_and_norm(D.h.data() + r * H, D.residual.data() + r * H, first, L.in_norm, H, D.eps, D.normed.data() + r * H);
  if (t == 0 && prepared(L.qkv)) prepare(D, L.qkv, D.normed.data(), H);
#pragma omp barrier
  qkv_and_cache(D, L, slots, t, T);
}

// An EAGLE-3 head's layer up to its attention (Eagle3Layer.forward): each row's q/k/v input
// [input_layernorm(embeds); hidden_norm(hidden)] (the embeddings in D.h, `hidden` [rows, H]) and its residual,
// hidden itself (or, norm_before_residual, hidden_norm(hidden)); then `qkv_and_cache`.
void head_before_attention(Decoder& D, const Layer& L, const uint16_t* hidden, const int64_t* slots, int t, int T) {
  const int64_t B = D.rows, H = D.hidden;
  const RowRun mine = rows_of(B, t, T, prepared(L.qkv));
  for (int64_t r = mine.lo; r < mine.hi; ++r) {
    uint16_t* x = D.normed.data() + r * 2 * H;
    rms_norm(D.h.data() + r * H, L.in_norm, H, D.eps, x);
    rms_norm(hidden + r * H, D.hidden_norm, H, D.eps, x + H);
    std::memcpy(D.residual.data() + r * H, D.norm_before_residual ? x + H : hidden + r * H, H * 2);
  }
  if (t == 0 && prepared(L.qkv)) prepare(D, L.qkv, D.normed.data(), 2 * H);
#pragma omp barrier
  qkv_and_cache(D, L, slots, t, T);
}

// Layer L's qkv of the normed rows in D.normed, q/k norms and rotary, each row's new key and value stored at
// its slot; the queries in D.q.
void qkv_and_cache(Decoder& D, const Layer& L, const int64_t* slots, int t, int T) {
  const int64_t B = D.rows;
  linear(L.qkv, D.normed.data(), D, D.qkv.data(), t, T);
#pragma omp barrier
  const int64_t d = D.head_dim, half = d / 2, blocks = L.k_cache.size(1);
  auto* kc = reinterpret_cast<uint16_t*>(L.k_cache.data_ptr());
  auto* vc = reinterpret_cast<uint16_t*>(L.v_cache.data_ptr());
  for (int64_t r = share(B, t, T); r < share(B, t + 1, T); ++r) {
    uint16_t* q = D.qkv.data() + r * D.qkv_n;
    uint16_t* k = q + D.heads * d;
    const uint16_t* v = k + D.kv_heads * d;
    for (int64_t head = 0; head < D.heads + D.kv_heads; ++head) {
      uint16_t* x = q + head * d;  // q heads, then k heads: contiguous in qkv
      const uint16_t* norm = head < D.heads ? L.q_norm : L.k_norm;
      if (norm != nullptr) rms_norm(x, norm, d, D.eps, x);
      rotate(x, D.cos.data() + r * half, D.sin.data() + r * half, half);
    }
    std::memcpy(static_cast<uint16_t*>(D.q.data_ptr()) + r * D.heads * d, q, D.heads * d * 2);
    const int64_t block = slots[r] / D.block_size, offset = slots[r] % D.block_size;
    for (int64_t g = 0; g < D.kv_heads; ++g) {
      const int64_t row = ((g * blocks + block) * D.block_size + offset) * d;
      std::memcpy(kc + row, k + g * d, d * 2);
      std::memcpy(vc + row, v + g * d, d * 2);
    }
  }
}

// A projection of n outputs and k inputs from its parts: one pair-packed bfloat16 tensor (type -1) or GGUF
// blocks, uint8 [rows, bytes] of GGML type types[p] (rows adding up to n).
Projection projection(const at::Tensor* parts, const int64_t* types, int64_t count,
                      const c10::optional<at::Tensor>& bias, int64_t n, int64_t k, const char* what,
                      std::vector<at::Tensor>& keep) {
  Projection w;
  TORCH_CHECK(count >= 1, "native_decoder_plan: ", what, " has no parts");
  w.gguf = types[0] >= 0, w.panel = types[0] == kPanelType;
  const bool has_bias = bias.has_value() && bias->defined();
  TORCH_CHECK(!has_bias || bias->numel() == n, "native_decoder_plan: ", what, "'s bias must have ", n, " values");
  if (w.panel) {
    TORCH_CHECK(PL_NATIVE_PANELS, "native_decoder_plan: ", what, " is panel-packed, but this build has no AVX2");
    const at::Tensor& packed = parts[0];
    const int64_t panels = (n + kPairCols - 1) / kPairCols;
    TORCH_CHECK(count == 1 && packed.dim() == 3 && packed.size(0) == panels && packed.size(1) == k &&
                    packed.size(2) == kPairCols && packed.is_contiguous() && packed.scalar_type() == at::kBFloat16,
                "native_decoder_plan: ", what, " must be one bfloat16 tensor panel-packed for ", n, " x ", k);
    w.panels.w = bits(packed), w.panels.n = n, w.panels.k = k, w.panels.panels = panels;
    if (has_bias) {
      const at::Tensor values = bias->to(at::kFloat).contiguous();
      w.panels.bias.assign(values.data_ptr<float>(), values.data_ptr<float>() + n);
    }
    keep.push_back(packed);
    return w;
  }
  if (!w.gguf) {
    TORCH_CHECK(PL_NATIVE_PAIRS, "native_decoder_plan: ", what, " is pair-packed, but this build has no AVX-512 BF16");
    TORCH_CHECK(count == 1 && k % 2 == 0, "native_decoder_plan: ", what, " must be one pair-packed tensor of even K");
    const at::Tensor& packed = parts[0];
    const int64_t panels = (n + kPairCols - 1) / kPairCols, pairs = k / 2;
    TORCH_CHECK(packed.dim() == 4 && packed.size(0) == panels && packed.size(1) == pairs &&
                    packed.size(2) == kPairCols && packed.size(3) == 2 && packed.is_contiguous() &&
                    packed.scalar_type() == at::kBFloat16,
                "native_decoder_plan: ", what, " must be pair-packed for ", n, " x ", k);
    w.pair.w = bits(packed), w.pair.n = n, w.pair.pairs = pairs, w.pair.panels = panels;
    if (has_bias) {
      const at::Tensor values = bias->to(at::kFloat).contiguous();
      w.pair.bias.assign(panels * kPairCols, 0.f);
      std::memcpy(w.pair.bias.data(), values.data_ptr<float>(), n * 4);
    }
    keep.push_back(packed);
    return w;
  }
  GgufWeight& g = w.blocks;
  g.k = k, g.starts.push_back(0);
  for (int64_t p = 0; p < count; ++p) {
    const at::Tensor& part = parts[p];
    TORCH_CHECK(types[p] >= 0 && part.scalar_type() == at::kByte && part.dim() == 2 && part.is_contiguous(),
                "native_decoder_plan: ", what, " mixes GGUF blocks with other parts, or a part is not uint8 rows");
    g.parts.push_back(part.data_ptr<uint8_t>()), g.types.push_back(types[p]);
    g.starts.push_back(g.starts.back() + part.size(0));
    keep.push_back(part);
  }
  TORCH_CHECK(g.starts.back() == n, "native_decoder_plan: ", what, "'s parts have ", g.starts.back(), " rows, not ", n);
  if (has_bias) {
    TORCH_CHECK(bias->scalar_type() == at::kBFloat16 && bias->is_contiguous(), "native_decoder_plan: ", what,
                "'s bias must be bfloat16");
    g.bias = bits(*bias), keep.push_back(*bias);
  }
  return w;
}

const uint16_t* vector_of(const at::Tensor& t, int64_t n, const char* what) {
  TORCH_CHECK(t.numel() == n && t.is_contiguous() && t.scalar_type() == at::kBFloat16, "native_decoder_plan: ",
              what, " must be ", n, " contiguous bfloat16 values");
  return bits(t);
}

Decoder& decoder(int64_t handle) {
  std::lock_guard<std::mutex> guard(decoders_lock);
  TORCH_CHECK(handle >= 0 && handle < int64_t(decoders().size()) && decoders()[handle],
              "native_decoder: no plan ", handle);
  return *decoders()[handle];
}

// A plan's sizes and what every plan has: dims hidden, heads, kv_heads, head_dim, intermediate, block_size,
// items_per_thread, min_partition; floats eps, rope scaling, softmax scale; the embedding (bfloat16 [vocab,
// hidden], embed_type -1, or GGUF rows), the final norm and rotary's inverse frequencies.
std::unique_ptr<Decoder> new_decoder(const at::Tensor& embed, int64_t embed_type, const at::Tensor& final_norm,
                                     const at::Tensor& inv_freq, at::IntArrayRef dims, at::ArrayRef<double> floats,
                                     bool use_amx) {
  TORCH_CHECK(dims.size() == 8 && floats.size() == 3, "native_decoder_plan: 8 sizes and 3 floats");
  auto D = std::make_unique<Decoder>();
  D->hidden = dims[0], D->heads = dims[1], D->kv_heads = dims[2], D->head_dim = dims[3], D->inter = dims[4];
  D->block_size = dims[5], D->items_per_thread = dims[6], D->min_partition = dims[7];
  D->eps = float(floats[0]), D->rope_scaling = float(floats[1]), D->scale = floats[2], D->amx = use_amx;
  const int64_t H = D->hidden, d = D->head_dim;
  TORCH_CHECK(d % 2 == 0 && D->heads % D->kv_heads == 0, "native_decoder_plan: head sizes");
  TORCH_CHECK(inv_freq.numel() == d / 2 && inv_freq.scalar_type() == at::kFloat,
              "native_decoder_plan: inv_freq must be head_dim / 2 float32 values");
  const at::Tensor freqs = inv_freq.contiguous();
  D->inv_freq.assign(freqs.data_ptr<float>(), freqs.data_ptr<float>() + d / 2);
  TORCH_CHECK(embed.dim() == 2 && embed.is_contiguous() &&
                  (embed_type < 0 ? embed.scalar_type() == at::kBFloat16 && embed.size(1) == H
                                  : embed.scalar_type() == at::kByte),
              "native_decoder_plan: the embedding must be bfloat16 [vocab, ", H, "] or GGUF rows");
  D->embed = static_cast<const uint8_t*>(embed.data_ptr()), D->embed_type = embed_type, D->vocab = embed.size(0);
  D->embed_row_bytes = embed.size(1) * embed.element_size();
  D->final_norm = vector_of(final_norm, H, "the final norm");
  D->keep = {embed, final_norm};
  D->qkv_n = (D->heads + 2 * D->kv_heads) * d;
  return D;
}

// Layer L's KV cache: bfloat16 [2, kv_heads, blocks, block_size, head_dim] in CPU_ATTN's layout
void set_cache(const Decoder& D, Layer& L, const at::Tensor& cache) {
  TORCH_CHECK(cache.dim() == 5 && cache.size(0) == 2 && cache.size(1) == D.kv_heads && cache.size(3) == D.block_size &&
                  cache.size(4) == D.head_dim && cache.is_contiguous() && cache.scalar_type() == at::kBFloat16,
              "native_decoder_plan: a contiguous bfloat16 cache [2, ", D.kv_heads, ", blocks, ", D.block_size, ", ",
              D.head_dim, "]");
  L.k_cache = cache[0], L.v_cache = cache[1];
}

// The plan's rows a step (`Decoder::max_rows`: any, or as many as GGUF blocks are multiplied straight
// from, kGgufDirectRows), kept under a new handle.
int64_t add_decoder(std::unique_ptr<Decoder> D) {
  bool blocks = D->head && D->lm_head.gguf;
  for (const Layer& L : D->layers)
    for (const Projection* w : {&L.qkv, &L.o, &L.gate_up, &L.down})
      if (w != &L.down || L.top_k == 0) blocks = blocks || w->gguf;
  D->max_rows = blocks ? kGgufDirectRows : std::numeric_limits<int64_t>::max();
  D->xq.reset(gguf_row_new());
  D->reserve(1);
  std::lock_guard<std::mutex> guard(decoders_lock);
  decoders().push_back(std::move(D));
  return int64_t(decoders().size()) - 1;
}

// A step's rows made ready (native_decoder_step's and native_head_step's arguments checked): the
// buffers for them, each row's sequence length, cos and sin and token embedding (in D.h); returns the
// attention's partition (cpu_attn._partition) and the block tables as [rows, blocks].
int64_t begin_rows(Decoder& D, const at::Tensor& tokens, const at::Tensor& positions, const at::Tensor& slots,
                   const at::Tensor& block_tables, at::Tensor* table_out) {
  const int64_t B = tokens.numel(), half = D.head_dim / 2;
  TORCH_CHECK(B >= 1 && tokens.scalar_type() == at::kLong && positions.scalar_type() == at::kLong &&
                  slots.scalar_type() == at::kLong && tokens.is_contiguous() && positions.is_contiguous() &&
                  slots.is_contiguous() && positions.numel() == B && slots.numel() == B,
              "native_decoder_step: tokens, positions and slots must be int64, one per row");
  TORCH_CHECK(B <= D.max_rows, "native_decoder_step: this plan takes at most ", D.max_rows,
              " rows a step (GGUF blocks: ", kGgufDirectRows, ")");
  const at::Tensor table = block_tables.reshape({B, -1});
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && table.is_contiguous(),
              "native_decoder_step: int32 block tables, a row per request");
  const int64_t* token = tokens.data_ptr<int64_t>();
  const int64_t* position = positions.data_ptr<int64_t>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  int64_t longest = 0;
  for (int64_t r = 0; r < B; ++r) {
    TORCH_CHECK(token[r] >= 0 && token[r] < D.vocab, "native_decoder_step: token id ", token[r], " out of range");
    TORCH_CHECK(position[r] >= 0 && table.size(1) * D.block_size > position[r] && slot[r] >= 0,
                "native_decoder_step: an int32 block table covering position ", position[r], " and a slot");
    longest = std::max(longest, position[r] + 1);
  }
  D.reserve(B);
  for (int64_t r = 0; r < B; ++r) {
    D.seq_lens.data_ptr<int32_t>()[r] = int32_t(position[r] + 1);
    for (int64_t j = 0; j < half; ++j) {  // RotaryEmbedding's cos/sin, then apply_rotary's rounding
      const float f = float(position[r]) * D.inv_freq[j];
      D.cos[r * half + j] = bf(rb(std::cos(f) * D.rope_scaling));
      D.sin[r * half + j] = bf(rb(std::sin(f) * D.rope_scaling));
    }
    const uint8_t* row = D.embed + token[r] * D.embed_row_bytes;
    if (D.embed_type < 0)
      std::memcpy(D.h.data() + r * D.hidden, row, D.hidden * 2);
    else
      gguf_bf16_row(D.embed_type, row, D.hidden, D.h.data() + r * D.hidden);
  }
  *table_out = table;
  // the attention backend's partition (cpu_attn._partition) for these requests
  const int64_t wanted = D.items_per_thread * at::get_num_threads(), pairs = B * D.kv_heads;
  const int64_t splits = (wanted + pairs - 1) / pairs;
  return pairs >= wanted ? longest : std::max(D.min_partition, (longest + splits - 1) / splits);
}

}  // namespace

bool native_decoder_pairs() { return PL_NATIVE_PAIRS; }

int64_t native_decoder_max_rows(int64_t handle) { return decoder(handle).max_rows; }
bool native_decoder_panels() { return PL_NATIVE_PANELS; }

// dims: hidden, heads, kv_heads, head_dim, intermediate, block_size, items_per_thread, min_partition (the
// attention backend's partition rule, cpu_attn._partition); floats: eps, rope scaling, softmax scale.
// embed: bfloat16 [vocab, hidden] (embed_type -1) or GGUF rows of GGML type embed_type. Per layer: norms
// (input, post-attention), four projections (qkv, o, gate_up, down) whose part_counts[4 * i + j] parts follow
// one another in `parts` with their `part_types` (-1: one pair-packed bfloat16 tensor; else GGUF blocks),
// their biases, head_norms (q, k) and kv_caches [2, kv_heads, blocks, block_size, head_size].
int64_t native_decoder_plan(const at::Tensor& embed, int64_t embed_type, const at::Tensor& final_norm,
                            const at::Tensor& inv_freq, at::TensorList norms, at::TensorList parts,
                            at::IntArrayRef part_types, at::IntArrayRef part_counts,
                            const c10::List<c10::optional<at::Tensor>>& biases,
                            const c10::List<c10::optional<at::Tensor>>& head_norms, at::TensorList kv_caches,
                            at::IntArrayRef moe, const c10::List<c10::optional<at::Tensor>>& experts,
                            at::IntArrayRef expert_types, at::IntArrayRef dims, at::ArrayRef<double> floats,
                            bool use_amx) {
  auto D = new_decoder(embed, embed_type, final_norm, inv_freq, dims, floats, use_amx);
  const int64_t layers = kv_caches.size(), H = D->hidden, d = D->head_dim;
  TORCH_CHECK(layers > 0 && int64_t(norms.size()) == 2 * layers && int64_t(part_counts.size()) == 4 * layers &&
                  int64_t(biases.size()) == 4 * layers && int64_t(head_norms.size()) == 2 * layers &&
                  parts.size() == part_types.size() && int64_t(moe.size()) == 3 * layers &&
                  int64_t(experts.size()) == 3 * layers && int64_t(expert_types.size()) == 3 * layers,
              "native_decoder_plan: per layer 2 norms, 4 projections, 4 biases, 2 head norms, a cache, 3 expert "
              "sizes, 3 expert tensors and their 3 types");
  const int64_t qkv_n = D->qkv_n;
  const int64_t outs[4] = {qkv_n, H, 2 * D->inter, H}, ins[4] = {H, D->heads * d, H, D->inter};
  const char* names[4] = {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"};
  int64_t next = 0;
  for (int64_t i = 0; i < layers; ++i) {
    Layer L;
    L.in_norm = vector_of(norms[2 * i], H, "an input norm");
    L.post_norm = vector_of(norms[2 * i + 1], H, "a post-attention norm");
    D->keep.push_back(norms[2 * i]), D->keep.push_back(norms[2 * i + 1]);
    L.top_k = moe[3 * i], L.renormalize = moe[3 * i + 1] != 0, L.num_experts = moe[3 * i + 2];
    Projection* projections[4] = {&L.qkv, &L.o, &L.gate_up, &L.down};
    for (int j = 0; j < 4; ++j) {
      const int64_t count = part_counts[4 * i + j];
      if (L.top_k > 0 && j == 3) {  // an expert layer: its router in the gate_up slot, nothing here
        TORCH_CHECK(count == 0, "native_decoder_plan: an expert layer has no down projection");
        continue;
      }
      TORCH_CHECK(count >= 1 && next + count <= int64_t(parts.size()), "native_decoder_plan: part counts");
      const int64_t n_out = L.top_k > 0 && j == 2 ? L.num_experts : outs[j];
      *projections[j] = projection(parts.data() + next, part_types.data() + next, count, biases.get(4 * i + j),
                                   n_out, ins[j], L.top_k > 0 && j == 2 ? "the router" : names[j], D->keep);
      next += count;
    }
    if (L.top_k > 0) {
      TORCH_CHECK(L.top_k <= L.num_experts, "native_decoder_plan: top_k above the experts' number");
      for (int j = 0; j < 3; ++j) {
        const c10::optional<at::Tensor> x = experts.get(3 * i + j);
        if (x.has_value()) L.experts.push_back(*x), D->keep.push_back(*x);
      }
      const bool gguf = expert_types[3 * i] >= 0;
      TORCH_CHECK(int64_t(L.experts.size()) == (gguf ? 3 : 2),
                  "native_decoder_plan: GGUF experts are gate, up and down; packed ones w13 and w2");
      if (gguf) L.expert_types.assign(expert_types.begin() + 3 * i, expert_types.begin() + 3 * i + 3);
      D->max_experts = std::max(D->max_experts, L.num_experts), D->max_top_k = std::max(D->max_top_k, L.top_k);
    }
    const c10::optional<at::Tensor> qn = head_norms.get(2 * i), kn = head_norms.get(2 * i + 1);
    TORCH_CHECK(qn.has_value() == kn.has_value(), "native_decoder_plan: q and k norms come together");
    if (qn.has_value()) {
      L.q_norm = vector_of(*qn, d, "a q norm"), L.k_norm = vector_of(*kn, d, "a k norm");
      D->keep.push_back(*qn), D->keep.push_back(*kn);
    }
    set_cache(*D, L, kv_caches[i]);
    D->layers.push_back(std::move(L));
  }
  TORCH_CHECK(next == int64_t(parts.size()), "native_decoder_plan: parts left over");
  for (const Layer& L : D->layers)
    TORCH_CHECK(L.top_k == 0 || L.top_k == D->max_top_k, "native_decoder_plan: the expert layers' top_k differ");
  return add_decoder(std::move(D));
}

void native_decoder_drop(int64_t handle) {
  std::lock_guard<std::mutex> guard(decoders_lock);
  if (handle >= 0 && handle < int64_t(decoders().size())) decoders()[handle].reset();
}

// out [rows, hidden] bfloat16: the final norm of the step's last hidden states, a row per token: tokens,
// positions and slots (where its key and value go: block * block_size + offset) int64 [rows]; block_tables
// int32 [rows, blocks] (or [blocks] for one row), each its request's. At most `native_decoder_max_rows`. Rows of one request at consecutive positions
// (speculative drafts to verify) are a causal chunk: every row's key and value is stored before any row of
// that layer attends. aux_out [len(aux_layers), rows, hidden] bfloat16 takes the residual stream entering
// each of the layers aux_layers (int64) names, h + residual as the eager layers see it (what an EAGLE-3
// head reads).
void native_decoder_step(int64_t handle, at::Tensor out, const at::Tensor& tokens, const at::Tensor& positions,
                         const at::Tensor& slots, const at::Tensor& block_tables, const at::Tensor& aux_layers,
                         at::Tensor aux_out) {
  Decoder& D = decoder(handle);
  TORCH_CHECK(!D.head, "native_decoder_step: plan ", handle, " is a draft head's (native_head_step)");
  at::Tensor table;
  const int64_t partition = begin_rows(D, tokens, positions, slots, block_tables, &table);
  const int64_t B = D.rows, d = D.head_dim;
  TORCH_CHECK(out.numel() == B * D.hidden && out.is_contiguous() && out.scalar_type() == at::kBFloat16,
              "native_decoder_step: out must be [", B, ", ", D.hidden, "] bfloat16");
  const int64_t aux = aux_layers.numel();
  TORCH_CHECK(aux_layers.scalar_type() == at::kLong && aux_layers.is_contiguous() &&
                  (aux == 0 || (aux_out.numel() == aux * B * D.hidden && aux_out.is_contiguous() &&
                                aux_out.scalar_type() == at::kBFloat16)),
              "native_decoder_step: aux_layers int64, aux_out [", aux, ", ", B, ", ", D.hidden, "] bfloat16");
  const int64_t* aux_layer = aux_layers.data_ptr<int64_t>();
  for (int64_t j = 0; j < aux; ++j)
    TORCH_CHECK(aux_layer[j] >= 0 && aux_layer[j] < int64_t(D.layers.size()), "native_decoder_step: aux layer ",
                aux_layer[j], " is not a layer");
  const int64_t* slot = slots.data_ptr<int64_t>();
  auto* final_out = reinterpret_cast<uint16_t*>(out.data_ptr());
  const int64_t n = D.layers.size();
  for (int64_t i = 0; i <= n; ++i) {
    // the previous layer after its attention (its experts, if any, between two regions), then this one
    // up to its attention, or the final norm
    const Layer* before = i > 0 ? &D.layers[i - 1] : nullptr;
    const Layer* next = i < n ? &D.layers[i] : nullptr;
    if (before != nullptr && prepared(before->o)) prepare(D, before->o, bits(D.attn), D.heads * d);
    const bool experts = before != nullptr && before->top_k > 0;
    if (experts) {
      region([&](int t, int T) { after_attention(D, *before, t, T); });
      run_experts(D, *before);
    }
    region([&](int t, int T) {
      if (before != nullptr && !experts) after_attention(D, *before, t, T);
      if (next != nullptr) {
        before_attention(D, *next, i == 0, slot, t, T);
      } else {
        for (int64_t r = share(B, t, T); r < share(B, t + 1, T); ++r)
          add_and_norm(D.h.data() + r * D.hidden, D.residual.data() + r * D.hidden, false, D.final_norm, D.hidden,
                       D.eps, final_out + r * D.hidden);
      }
    });
    for (int64_t j = 0; j < aux && next != nullptr; ++j)  // the residual stream entering layer i
      if (aux_layer[j] == i)
        std::memcpy(reinterpret_cast<uint16_t*>(aux_out.data_ptr()) + j * B * D.hidden, D.residual.data(),
                    B * D.hidden * 2);
    if (next != nullptr)
      paged_attention(D.attn, D.q, next->k_cache, next->v_cache, table, D.seq_lens, D.query_start, D.reqs,
                      kCacheBf16, D.scale, 0, partition, D.amx, 0.0, c10::nullopt, false);
  }
}

// An EAGLE-3 head's plan (eagle_head.py): the target's embedding (as native_decoder_plan takes it), the head's
// final norm and rotary, norms (input_layernorm, hidden_norm, post_attention_layernorm), five projections
// (qkv over 2 * hidden inputs, o, gate_up, down, lm_head over the draft vocabulary) from `parts` as
// native_decoder_plan reads a layer's, their biases, the head's KV cache and d2t (int64 [draft vocabulary]:
// target id = draft id + d2t[id]); dims and floats as native_decoder_plan's.
int64_t native_head_plan(const at::Tensor& embed, int64_t embed_type, const at::Tensor& final_norm,
                         const at::Tensor& inv_freq, at::TensorList norms, at::TensorList parts,
                         at::IntArrayRef part_types, at::IntArrayRef part_counts,
                         const c10::List<c10::optional<at::Tensor>>& biases, const at::Tensor& kv_cache,
                         const at::Tensor& d2t, at::IntArrayRef dims, at::ArrayRef<double> floats, bool use_amx,
                         bool norm_before_residual) {
  auto D = new_decoder(embed, embed_type, final_norm, inv_freq, dims, floats, use_amx);
  const int64_t H = D->hidden, vocab = d2t.numel();
  TORCH_CHECK(norms.size() == 3 && part_counts.size() == 5 && biases.size() == 5,
              "native_head_plan: 3 norms (input, hidden, post-attention) and 5 projections");
  TORCH_CHECK(d2t.scalar_type() == at::kLong && d2t.is_contiguous() && vocab > 0, "native_head_plan: int64 d2t");
  D->head = true, D->norm_before_residual = norm_before_residual;
  D->d2t.assign(d2t.data_ptr<int64_t>(), d2t.data_ptr<int64_t>() + vocab);
  Layer L;
  L.in_norm = vector_of(norms[0], H, "the input norm");
  D->hidden_norm = vector_of(norms[1], H, "the hidden norm");
  L.post_norm = vector_of(norms[2], H, "the post-attention norm");
  for (const at::Tensor& norm : norms) D->keep.push_back(norm);
  Projection* projections[5] = {&L.qkv, &L.o, &L.gate_up, &L.down, &D->lm_head};
  const int64_t outs[5] = {D->qkv_n, H, 2 * D->inter, H, vocab};
  const int64_t ins[5] = {2 * H, D->heads * D->head_dim, H, D->inter, H};
  const char* names[5] = {"qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head"};
  int64_t next = 0;
  for (int j = 0; j < 5; ++j) {
    const int64_t count = part_counts[j];
    TORCH_CHECK(count >= 1 && next + count <= int64_t(parts.size()), "native_head_plan: part counts");
    *projections[j] = projection(parts.data() + next, part_types.data() + next, count, biases.get(j), outs[j], ins[j],
                                 names[j], D->keep);
    next += count;
  }
  TORCH_CHECK(next == int64_t(parts.size()), "native_head_plan: parts left over");
  set_cache(*D, L, kv_cache);
  D->layers.push_back(std::move(L));
  return add_decoder(std::move(D));
}

// One pass of an EAGLE-3 head (Eagle3Head.forward, then greedy_tokens at the rows `picks`): rows of tokens
// at positions, their keys and values stored at `slots` of the head's cache (block tables as
// native_decoder_step's: rows of one request at consecutive positions are a causal chunk), each with the
// hidden state it reads (`hidden` [rows, hidden] bfloat16: `fc` of the target's, or the head's own of the
// pass before). For each picked row (int64 [P]): its draft, the target's id of its logits' argmax (the
// first largest, as torch's argmax), in drafts (int64 [P]), and its output before the final norm (what the
// next pass reads) in hidden_out [P, hidden].
void native_head_step(int64_t handle, const at::Tensor& tokens, const at::Tensor& positions, const at::Tensor& slots,
                      const at::Tensor& block_tables, const at::Tensor& hidden, const at::Tensor& picks,
                      at::Tensor hidden_out, at::Tensor drafts) {
  Decoder& D = decoder(handle);
  TORCH_CHECK(D.head, "native_head_step: plan ", handle, " is a decoder's (native_decoder_step)");
  at::Tensor table;
  const int64_t partition = begin_rows(D, tokens, positions, slots, block_tables, &table);
  const int64_t B = D.rows, H = D.hidden, P = picks.numel(), V = D.d2t.size();
  TORCH_CHECK(hidden.numel() == B * H && hidden.is_contiguous() && hidden.scalar_type() == at::kBFloat16,
              "native_head_step: hidden must be [", B, ", ", H, "] bfloat16");
  TORCH_CHECK(picks.scalar_type() == at::kLong && picks.is_contiguous() && P <= B,
              "native_head_step: picks, int64, up to ", B, " rows");
  TORCH_CHECK(hidden_out.numel() == P * H && hidden_out.is_contiguous() && hidden_out.scalar_type() == at::kBFloat16 &&
                  drafts.numel() == P && drafts.is_contiguous() && drafts.scalar_type() == at::kLong,
              "native_head_step: hidden_out [", P, ", ", H, "] bfloat16 and drafts [", P, "] int64");
  const int64_t* pick = picks.data_ptr<int64_t>();
  for (int64_t p = 0; p < P; ++p)
    TORCH_CHECK(pick[p] >= 0 && pick[p] < B, "native_head_step: pick ", pick[p], " is not a row");
  const Layer& L = D.layers[0];
  const uint16_t* x = bits(hidden);
  const int64_t* slot = slots.data_ptr<int64_t>();
  region([&](int t, int T) { head_before_attention(D, L, x, slot, t, T); });
  paged_attention(D.attn, D.q, L.k_cache, L.v_cache, table, D.seq_lens, D.query_start, D.reqs, kCacheBf16, D.scale, 0,
                  partition, D.amx, 0.0, c10::nullopt, false);
  if (prepared(L.o)) prepare(D, L.o, bits(D.attn), D.heads * D.head_dim);
  auto* out = reinterpret_cast<uint16_t*>(hidden_out.data_ptr());
  region([&](int t, int T) {
    after_attention(D, L, t, T);
    // the picked rows' final norm (the residual, h added, is what the next pass reads)
    for (int64_t p = share(P, t, T); p < share(P, t + 1, T); ++p) {
      const int64_t r = pick[p];
      add_and_norm(D.h.data() + r * H, D.residual.data() + r * H, false, D.final_norm, H, D.eps, D.picked.data() + p * H);
      std::memcpy(out + p * H, D.residual.data() + r * H, H * 2);
    }
  });
  if (P == 0) return;  // rows whose keys and values were all the pass was for (a prompt's chunk)
  D.reserve(P);  // the lm_head's rows: the picked ones
  if (prepared(D.lm_head)) prepare(D, D.lm_head, D.picked.data(), H);
  region([&](int t, int T) { linear(D.lm_head, D.picked.data(), D, D.logits.data(), t, T); });
  int64_t* draft = drafts.data_ptr<int64_t>();
  for (int64_t p = 0; p < P; ++p) {
    const uint16_t* row = D.logits.data() + p * V;
    int64_t best = 0;
    float top = bf(row[0]);
    for (int64_t j = 1; j < V && !std::isnan(top); ++j) {
      const float v = bf(row[j]);
      if (v > top || std::isnan(v)) top = v, best = j;
    }
    draft[p] = best + D.d2t[best];
  }
}

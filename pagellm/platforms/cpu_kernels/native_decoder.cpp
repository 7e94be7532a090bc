// One user's decode step of a dense Llama-shaped model (Llama, Mistral, SmolLM2, Qwen2, Qwen3) in one
// native call, its linears either GGUF blocks on gguf_linear.cpp's one-row products (any build: AVX2,
// AVX-512, AMX or plain C++; x quantized once per linear, the rows split as gguf_linear splits them, so
// the same bits) or bfloat16 on the pair kernel (linear_bf16_pairs.cpp: builds with AVX-512 BF16, which
// CPUs without AMX use for bfloat16 linears: AMD Zen 4 and 5).
//
// Why: at one token a step reads the weights once (~8 ms for model S at ~35 GB/s on a 2-core Zen 4) and
// everything around those reads is serial. The compiled graph spent ~2 ms of model S's ~11.5 ms step
// outside the kernels: 151 custom-op calls through the dispatcher from inductor's C++ wrapper, ~150 small
// elementwise kernels and allocations, and an OpenMP region per op, whose start and end wait for the second
// thread. Here a layer's work after its attention and the next layer's before it (o_proj, add and norm,
// gate_up, SiLU and multiply, down, add and norm, qkv, q/k norms, rotary, the cache store) run in one
// parallel region, the threads meeting at a barrier between ops; attention is paged_attention, called
// directly (it splits the context between the threads itself).
//
// The arithmetic is the eager PyTorch forward's: every op rounds its result to bfloat16 where the model's
// modules do (RMSNorm in float32, scaled in bfloat16; rotary with cos/sin rounded to bfloat16; SiLU rounded
// before the multiply), the linears are the same kernel, so the step's hidden state differs from the
// eager one only where a float32 sum is taken in another order (the norms' sums of squares).
//
// The plan (weights, caches, sizes) is handed over once per engine (native_decoder_plan -> a handle); a
// step passes the token, its position, its cache slot and its request's block table.

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
  int64_t hidden = 0, heads = 0, kv_heads = 0, head_dim = 0, inter = 0, block_size = 0;
  int64_t items_per_thread = 0, min_partition = 0, max_experts = 0, max_top_k = 0;
  float eps = 0.f, rope_scaling = 1.f;
  double scale = 1.0;
  bool amx = false;
  std::vector<float> inv_freq;
  const uint8_t* embed = nullptr;  // [vocab, embed_row_bytes]
  int64_t embed_type = -1, embed_row_bytes = 0, vocab = 0;  // GGML type of the rows; -1: bfloat16
  const uint16_t* final_norm = nullptr;
  std::vector<Layer> layers;
  std::vector<at::Tensor> keep;  // the tensors the pointers above read
  // one step's values (bfloat16 bits), reused
  std::vector<uint16_t> h, residual, normed, qkv, gate_up, act;
  std::vector<float> cos, sin;  // rounded to bfloat16, as apply_rotary rounds them
  std::unique_ptr<GgufRow, RowDeleter> xq;  // the next GGUF linear's x, quantized
  std::vector<float> xf;                    // the next panel linear's x, widened
  std::vector<uint16_t> router;             // an expert layer's router logits
  at::Tensor moe_in, topk_weights, topk_ids;  // [1, hidden] bfloat16, [1, K] float32, [1, K] int64
  at::Tensor q, attn, seq_lens, query_start, reqs;
};

std::mutex decoders_lock;
std::vector<std::unique_ptr<Decoder>>& decoders() {
  static std::vector<std::unique_ptr<Decoder>> all;
  return all;
}

inline float bf(uint16_t v) { return bf16_to_float(v); }
inline uint16_t rb(float f) { return float_to_bf16(f); }

const uint16_t* bits(const at::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.data_ptr()); }

// float32 sum of squares of n bfloat16 values, 16 partial sums (a vectorisable order, as torch's is)
float sum_squares(const uint16_t* x, int64_t n) {
  float part[16] = {0.f};
  int64_t j = 0;
  for (; j + 16 <= n; j += 16)
    for (int l = 0; l < 16; ++l) {
      const float v = bf(x[j + l]);
      part[l] += v * v;
    }
  for (; j < n; ++j) part[j % 16] += bf(x[j]) * bf(x[j]);
  float sum = 0.f;
  for (float p : part) sum += p;
  return sum;
}

// out = weight * (x / rms(x)): normalised in float32, rounded to bfloat16, then scaled in bfloat16
// (RMSNorm.forward). out may be x.
void rms_norm(const uint16_t* x, const uint16_t* weight, int64_t n, float eps, uint16_t* out) {
  const float r = 1.f / std::sqrt(sum_squares(x, n) / float(n) + eps);
  for (int64_t j = 0; j < n; ++j) out[j] = rb(bf(weight[j]) * bf(rb(bf(x[j]) * r)));
}

// residual = h + residual (h alone before the first layer), out = rms_norm(residual) (add_and_norm)
void add_and_norm(const uint16_t* h, uint16_t* residual, bool first, const uint16_t* weight, int64_t n, float eps,
                  uint16_t* out) {
  for (int64_t j = 0; j < n; ++j) residual[j] = first ? h[j] : rb(bf(h[j]) + bf(residual[j]));
  rms_norm(residual, weight, n, eps, out);
}

// neox rotary of one head in place (apply_rotary in bfloat16: each product and sum rounded)
void rotate(uint16_t* x, const float* cos, const float* sin, int64_t half) {
  for (int64_t j = 0; j < half; ++j) {
    const float a = bf(x[j]), b = bf(x[j + half]), c = cos[j], s = sin[j];
    x[j] = rb(bf(rb(a * c)) - bf(rb(b * s)));
    x[j + half] = rb(bf(rb(b * c)) + bf(rb(a * s)));
  }
}

// thread t of T's rows of y = x @ W^T (+ bias): a pair- or panel-packed weight's run of panels (as
// parallel_runs splits them; a panel weight reads x widened beforehand into `xf`), a GGUF weight's rows
// (as gguf_linear splits them) from x quantized beforehand into `xq`
inline void linear(const Projection& w, const uint16_t* x, const Decoder& D, uint16_t* y, int t, int T) {
  if (w.gguf) {
    const GgufWeight& g = w.blocks;
    gguf_row_share(D.xq.get(), g.parts.data(), g.types.data(), g.starts.data(), g.parts.size(), g.k, g.bias, y, t,
                   T);
    return;
  }
  if (w.panel) {
#if PL_NATIVE_PANELS
    const PanelWeight& p = w.panels;
    bf16_panel_row_run(D.xf.data(), p.k, p.w, p.bias.empty() ? nullptr : p.bias.data(), p.n, y, p.panels * t / T,
                       p.panels * (t + 1) / T);
#endif
    return;
  }
#if PL_NATIVE_PAIRS
  const PairWeight& p = w.pair;
  bf16_pair_row_run(x, p.w, p.pairs, p.b(), p.n, y, p.panels * t / T, p.panels * (t + 1) / T);
#endif
}

// x made ready for `w` where it is GGUF (quantized) or panel-packed (widened), by one thread, before the
// barrier that precedes the linear
inline void prepare(Decoder& D, const Projection& w, const uint16_t* x, int64_t k) {
  if (w.gguf) gguf_row_quantize(D.xq.get(), x, k);
  if (w.panel) {
    D.xf.resize(k);
    for (int64_t j = 0; j < k; ++j) D.xf[j] = bf(x[j]);
  }
}

template <typename Fn>
void region(Fn fn) {
  const int threads = at::get_num_threads();
#pragma omp parallel num_threads(threads)
  fn(omp_get_thread_num(), omp_get_num_threads());
}

// Layer L after its attention (whose output is in D.attn): o_proj, add and norm, the gated MLP; its output
// in D.h.
void after_attention(Decoder& D, const Layer& L, int t, int T) {
  linear(L.o, bits(D.attn), D, D.h.data(), t, T);
#pragma omp barrier
  if (t == 0) {
    add_and_norm(D.h.data(), D.residual.data(), false, L.post_norm, D.hidden, D.eps, D.normed.data());
    prepare(D, L.gate_up, D.normed.data(), D.hidden);
  }
#pragma omp barrier
  if (L.top_k > 0) {  // the router's logits; the experts run after the region (`run_experts`)
    linear(L.gate_up, D.normed.data(), D, D.router.data(), t, T);
    return;
  }
  linear(L.gate_up, D.normed.data(), D, D.gate_up.data(), t, T);
#pragma omp barrier
  // SiLU(gate) * up, rounded as the eager ops round; one thread where the down projection quantizes it next
  const int parts = L.down.gguf || L.down.panel ? 1 : T;
  if (t < parts)
    for (int64_t j = D.inter * t / parts; j < D.inter * (t + 1) / parts; ++j) {
      const float g = bf(D.gate_up[j]);
      D.act[j] = rb(bf(rb(g / (1.f + std::exp(-g)))) * bf(D.gate_up[D.inter + j]));
    }
  if (t == 0) prepare(D, L.down, D.act.data(), D.inter);
#pragma omp barrier
  linear(L.down, D.act.data(), D, D.h.data(), t, T);
#pragma omp barrier
}

// An expert layer's MLP, on the calling thread after the region that computed its router logits: softmax
// over the experts in float32, the top k, divided by their sum where
// `renormalize` (select_experts), then the experts' kernel, called directly (it splits its work between
// the threads itself); the output in D.h.
void run_experts(Decoder& D, const Layer& L) {
  const int64_t E = L.num_experts, K = L.top_k;
  std::vector<float> scores(E);
  float top = -std::numeric_limits<float>::infinity(), sum = 0.f;
  for (int64_t e = 0; e < E; ++e) top = std::max(top, bf(D.router[e]));
  for (int64_t e = 0; e < E; ++e) sum += scores[e] = std::exp(bf(D.router[e]) - top);
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
  auto* weights = D.topk_weights.data_ptr<float>();
  auto* ids = D.topk_ids.data_ptr<int64_t>();
  float chosen = 0.f;
  for (int64_t k = 0; k < K; ++k) ids[k] = queue[k].second, chosen += weights[k] = scores[queue[k].second];
  if (L.renormalize)
    for (int64_t k = 0; k < K; ++k) weights[k] /= chosen;
  std::memcpy(D.moe_in.data_ptr(), D.normed.data(), D.hidden * 2);
  const auto& x = L.experts;
  const at::Tensor out =
      L.expert_types.empty()
          ? cpu_fused_moe(D.moe_in, D.topk_weights, D.topk_ids, x[0], x[1], c10::nullopt, c10::nullopt, c10::nullopt,
                          c10::nullopt, "silu", 0.0, 0.0)
          : gguf_moe(D.moe_in, D.topk_weights, D.topk_ids, x[0], x[1], x[2], L.expert_types, c10::nullopt,
                     c10::nullopt, "silu", 0.0, 0.0);
  std::memcpy(D.h.data(), out.data_ptr(), D.hidden * 2);
}

// Layer L up to its attention: add and norm, qkv, q/k norms and rotary, the new key and value stored at
// `slot`; the queries in D.q.
void before_attention(Decoder& D, const Layer& L, bool first, int64_t slot, int t, int T) {
  if (t == 0) {
    add_and_norm(D.h.data(), D.residual.data(), first, L.in_norm, D.hidden, D.eps, D.normed.data());
    prepare(D, L.qkv, D.normed.data(), D.hidden);
  }
#pragma omp barrier
  linear(L.qkv, D.normed.data(), D, D.qkv.data(), t, T);
#pragma omp barrier
  if (t != 0) return;
  const int64_t d = D.head_dim, half = d / 2;
  uint16_t* q = D.qkv.data();
  uint16_t* k = q + D.heads * d;
  const uint16_t* v = k + D.kv_heads * d;
  for (int64_t head = 0; head < D.heads + D.kv_heads; ++head) {
    uint16_t* x = q + head * d;  // q heads, then k heads: contiguous in qkv
    const uint16_t* norm = head < D.heads ? L.q_norm : L.k_norm;
    if (norm != nullptr) rms_norm(x, norm, d, D.eps, x);
    rotate(x, D.cos.data(), D.sin.data(), half);
  }
  std::memcpy(D.q.data_ptr(), q, D.heads * d * 2);
  const int64_t blocks = L.k_cache.size(1), block = slot / D.block_size, offset = slot % D.block_size;
  auto* kc = reinterpret_cast<uint16_t*>(L.k_cache.data_ptr());
  auto* vc = reinterpret_cast<uint16_t*>(L.v_cache.data_ptr());
  for (int64_t g = 0; g < D.kv_heads; ++g) {
    const int64_t row = ((g * blocks + block) * D.block_size + offset) * d;
    std::memcpy(kc + row, k + g * d, d * 2);
    std::memcpy(vc + row, v + g * d, d * 2);
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

}  // namespace

bool native_decoder_pairs() { return PL_NATIVE_PAIRS; }
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
  TORCH_CHECK(dims.size() == 8 && floats.size() == 3, "native_decoder_plan: 8 sizes and 3 floats");
  auto D = std::make_unique<Decoder>();
  D->hidden = dims[0], D->heads = dims[1], D->kv_heads = dims[2], D->head_dim = dims[3], D->inter = dims[4];
  D->block_size = dims[5], D->items_per_thread = dims[6], D->min_partition = dims[7];
  D->eps = float(floats[0]), D->rope_scaling = float(floats[1]), D->scale = floats[2], D->amx = use_amx;
  const int64_t layers = kv_caches.size(), H = D->hidden, d = D->head_dim;
  TORCH_CHECK(layers > 0 && int64_t(norms.size()) == 2 * layers && int64_t(part_counts.size()) == 4 * layers &&
                  int64_t(biases.size()) == 4 * layers && int64_t(head_norms.size()) == 2 * layers &&
                  parts.size() == part_types.size() && int64_t(moe.size()) == 3 * layers &&
                  int64_t(experts.size()) == 3 * layers && int64_t(expert_types.size()) == 3 * layers,
              "native_decoder_plan: per layer 2 norms, 4 projections, 4 biases, 2 head norms, a cache, 3 expert "
              "sizes, 3 expert tensors and their 3 types");
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
  const int64_t qkv_n = (D->heads + 2 * D->kv_heads) * d;
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
    const at::Tensor& cache = kv_caches[i];
    TORCH_CHECK(cache.dim() == 5 && cache.size(0) == 2 && cache.size(1) == D->kv_heads && cache.size(3) == D->block_size &&
                    cache.size(4) == d && cache.is_contiguous() && cache.scalar_type() == at::kBFloat16,
                "native_decoder_plan: a contiguous bfloat16 cache [2, ", D->kv_heads, ", blocks, ", D->block_size,
                ", ", d, "]");
    L.k_cache = cache[0], L.v_cache = cache[1];
    D->layers.push_back(std::move(L));
  }
  TORCH_CHECK(next == int64_t(parts.size()), "native_decoder_plan: parts left over");
  for (const Layer& L : D->layers)
    TORCH_CHECK(L.top_k == 0 || L.top_k == D->max_top_k, "native_decoder_plan: the expert layers' top_k differ");
  D->h.resize(H), D->residual.resize(H), D->normed.resize(H), D->qkv.resize(qkv_n), D->router.resize(D->max_experts);
  D->gate_up.resize(2 * D->inter), D->act.resize(D->inter), D->cos.resize(d / 2), D->sin.resize(d / 2);
  D->xq.reset(gguf_row_new());
  const auto bf16 = final_norm.options().dtype(at::kBFloat16), ints = final_norm.options().dtype(at::kInt);
  D->q = final_norm.new_empty({1, D->heads, d}, bf16);
  D->attn = final_norm.new_empty({1, D->heads, d}, bf16);
  D->seq_lens = final_norm.new_empty({1}, ints), D->query_start = final_norm.new_empty({2}, ints);
  D->reqs = final_norm.new_empty({1}, ints);
  D->moe_in = final_norm.new_empty({1, H}, bf16);
  D->topk_weights = final_norm.new_empty({1, D->max_top_k}, final_norm.options().dtype(at::kFloat));
  D->topk_ids = final_norm.new_empty({1, D->max_top_k}, final_norm.options().dtype(at::kLong));
  D->query_start.data_ptr<int32_t>()[0] = 0, D->query_start.data_ptr<int32_t>()[1] = 1;
  D->reqs.data_ptr<int32_t>()[0] = 0;
  std::lock_guard<std::mutex> guard(decoders_lock);
  decoders().push_back(std::move(D));
  return int64_t(decoders().size()) - 1;
}

void native_decoder_drop(int64_t handle) {
  std::lock_guard<std::mutex> guard(decoders_lock);
  if (handle >= 0 && handle < int64_t(decoders().size())) decoders()[handle].reset();
}

// out [1, hidden] bfloat16: the final norm of the step's last hidden state. `slot`: where the token's key
// and value go (block * block_size + offset); block_table int32 [1, blocks] (or [blocks]): its request's.
void native_decoder_step(int64_t handle, at::Tensor out, int64_t token, int64_t position, int64_t slot,
                         const at::Tensor& block_table) {
  Decoder& D = decoder(handle);
  TORCH_CHECK(out.numel() == D.hidden && out.is_contiguous() && out.scalar_type() == at::kBFloat16,
              "native_decoder_step: out must be [1, ", D.hidden, "] bfloat16");
  TORCH_CHECK(block_table.scalar_type() == at::kInt && block_table.is_contiguous() &&
                  block_table.numel() * D.block_size > position && slot >= 0,
              "native_decoder_step: an int32 block table covering position ", position, " and a slot");
  TORCH_CHECK(token >= 0 && token < D.vocab, "native_decoder_step: token id ", token, " out of range");
  const int64_t seq_len = position + 1, d = D.head_dim;
  D.seq_lens.data_ptr<int32_t>()[0] = int32_t(seq_len);
  // the attention backend's partition (cpu_attn._partition) for one request
  const int64_t wanted = D.items_per_thread * at::get_num_threads();
  const int64_t splits = (wanted + D.kv_heads - 1) / D.kv_heads;
  const int64_t partition = D.kv_heads >= wanted ? seq_len
                                                 : std::max(D.min_partition, (seq_len + splits - 1) / splits);
  for (int64_t j = 0; j < d / 2; ++j) {  // RotaryEmbedding's cos/sin, then apply_rotary's rounding
    const float f = float(position) * D.inv_freq[j];
    D.cos[j] = bf(rb(std::cos(f) * D.rope_scaling)), D.sin[j] = bf(rb(std::sin(f) * D.rope_scaling));
  }
  const uint8_t* row = D.embed + token * D.embed_row_bytes;
  if (D.embed_type < 0)
    std::memcpy(D.h.data(), row, D.hidden * 2);
  else
    gguf_bf16_row(D.embed_type, row, D.hidden, D.h.data());
  const at::Tensor table = block_table.reshape({1, -1});
  const int64_t n = D.layers.size();
  for (int64_t i = 0; i <= n; ++i) {
    // the previous layer after its attention (its experts, if any, between two regions), then this one
    // up to its attention, or the final norm
    const Layer* before = i > 0 ? &D.layers[i - 1] : nullptr;
    const Layer* next = i < n ? &D.layers[i] : nullptr;
    if (before != nullptr) prepare(D, before->o, bits(D.attn), D.heads * d);
    const bool experts = before != nullptr && before->top_k > 0;
    if (experts) {
      region([&](int t, int T) { after_attention(D, *before, t, T); });
      run_experts(D, *before);
    }
    region([&](int t, int T) {
      if (before != nullptr && !experts) after_attention(D, *before, t, T);
      if (next != nullptr) {
        before_attention(D, *next, i == 0, slot, t, T);
      } else if (t == 0) {
        add_and_norm(D.h.data(), D.residual.data(), false, D.final_norm, D.hidden, D.eps,
                     reinterpret_cast<uint16_t*>(out.data_ptr()));
      }
    });
    if (next != nullptr)
      paged_attention(D.attn, D.q, next->k_cache, next->v_cache, table, D.seq_lens, D.query_start, D.reqs,
                      kCacheBf16, D.scale, 0, partition, D.amx, 0.0, c10::nullopt, false);
  }
}

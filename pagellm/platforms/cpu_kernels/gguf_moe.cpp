// Mixture-of-experts layers on llama.cpp's block formats (GGUF), read in place: each projection's experts
// stay the file's stacked tensor (`ffn_gate_exps` / `ffn_up_exps` uint8 [E, I, bytes per row of H],
// `ffn_down_exps` [E, H, bytes per row of I]), so a Q4_K_M model's experts take their file size instead of
// three times it widened to bfloat16.
//
// A step, per chunk of tokens (bounding the float32 buffers): the (token, expert) pairs sorted by expert
// (moe_routing.h), each pair's x row gathered in that order and quantized once (bfloat16 x: int8 groups of
// 32; float32 x: kept, float products), so the rows sharing an expert are consecutive and each expert
// weight row is multiplied with all of them at once (bfloat16 x: up to four rows straight from the blocks, more
// in tiles of eight, gguf_tiles.h; float32 x: gguf_blocks.h's `row_times_x`, and from kSlabRows pairs, in a
// prefill chunk, slabs of dequantized rows through torch's float32 GEMM, as gguf_linear.cpp does); then
// gate/up (plus their biases, where the experts have them) -> activation in float32, the activations quantized
// the same way, the down projection (plus its bias), and per token the routing-weighted sum of its top-k rows,
// rounded to x's dtype once.
//
// Work split: threads take contiguous runs of output rows, the same rows of every chosen expert (gate and
// up rows begin..end together, so the activation needs no second pass), as gguf_linear.cpp splits a
// linear's rows. An expert with one token (a decode step's) has each projection's run of rows multiplied in
// one call (`run_fn`: four places of the run in turn); an expert with two to four tokens streams its rows in
// memory order, asked into L1 kPrefetchRows ahead (`row_ahead`) where that pays (`rows_asked_ahead`).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "gguf_amx.h"
#include "gguf_blocks.h"
#include "gguf_tiles.h"
#include "kernels.h"
#include "moe_routing.h"

namespace {

constexpr int64_t kRowGrain = 16;                   // output rows per thread at least
constexpr int64_t kPrefetchRows = 4;                // a few tokens' rows: how far ahead rows are asked into L1
constexpr int64_t kChunkFloats = int64_t(1) << 23;  // the activations and down outputs per chunk (32 MB)

// One projection's stacked experts: uint8 [E, rows, bytes per row] of one GGML type, and its row product.
struct Stack {
  const uint8_t* data;
  int64_t type, rows, blocks, row_bytes;
  RowFn fn;
  RunFn run;  // a decode step's one x row against a run of rows (bfloat16 x)
  const uint8_t* row(int64_t expert, int64_t r) const { return data + (expert * rows + r) * row_bytes; }
};

Stack stack_of(const at::Tensor& w, int64_t type, int64_t experts, int64_t columns, bool floats, const char* name) {
  Layout layout;
  TORCH_CHECK(has_kernel(type) && layout_of(type, &layout), "gguf_moe: ", name, "'s GGML type ", type,
              " has no kernel (dequantize it instead)");
  const int64_t row_bytes = columns / layout.block * layout.bytes;
  TORCH_CHECK(w.scalar_type() == at::kByte && w.dim() == 3 && w.is_contiguous() && w.size(0) == experts &&
                  columns % layout.block == 0 && w.size(2) == row_bytes,
              "gguf_moe: ", name, " must be uint8 [", experts, ", rows, ", row_bytes, "] (GGML type ", type, ", ",
              columns, " columns)");
  return {static_cast<const uint8_t*>(w.data_ptr()), type, w.size(1), columns / layout.block, row_bytes,
          floats ? row_fn<true>(type) : row_fn<false>(type), run_fn(type)};
}

// The row kPrefetchRows after row i of the few-token expert small[c] in a thread's order (rows begin..end of
// each expert in turn), or nullptr past the last: an expert's rows are short (E's gate rows 576 bytes) and
// light work for a few tokens, so one core waits on their loads unless they are asked for ahead (model E
// Q4_K_M's decode step 20.2 -> 16.1 ms on the AMX Xeon); nullptr too where the CPU's own prefetchers do
// better (`rows_asked_ahead`).
const uint8_t* row_ahead(const Stack& s, const Routing& routing, const std::vector<int64_t>& small, size_t c,
                         int64_t i, int64_t begin, int64_t end) {
  if (!rows_asked_ahead()) return nullptr;
  const int64_t offset = i - begin + kPrefetchRows, n = end - begin;
  const size_t ahead = c + static_cast<size_t>(offset / n);
  return ahead < small.size() ? s.row(routing.experts[small[ahead]], begin + offset % n) : nullptr;
}

// Rows [m, k] as the row products read them: kept as float32 where `floats` (a float32 step), else quantized
// to int8 groups (a bfloat16 step's x, and its float32 activations).
template <typename In>
void prepare_rows(const In* x, int64_t m, int64_t k, bool floats, Rows& q) {
  if constexpr (std::is_same_v<In, float>) {
    if (floats) return float_rows(x, m, k, q);
  }
  quantize_rows(x, m, k, q);
}

// x tiles (gguf_tiles.h) of the experts in `tiled`: each expert's rows (consecutive in q) in tiles of their
// own, first_tile[i] the first of expert tiled[i]'s; AMX's tiles of sixteen where they run and the experts
// average more than eight rows (`tile_lanes`).
void tile_experts(const Rows& q, const Routing& routing, const std::vector<int64_t>& tiled,
                  std::vector<int64_t>& first_tile, XTiles& x) {
  first_tile.assign(tiled.size(), 0);
  int64_t total = 0, pairs = 0;
  for (const int64_t c : tiled) pairs += routing.count[c];
  const int64_t lanes = tiled.empty() ? kLanes : tile_lanes(pairs / static_cast<int64_t>(tiled.size()));
  for (size_t i = 0; i < tiled.size(); ++i) first_tile[i] = total, total += tiles_for(routing.count[tiled[i]], lanes);
  x.reset(q.k, total, lanes);
  for (size_t i = 0; i < tiled.size(); ++i)
    interleave(q, routing.start[tiled[i]], routing.count[tiled[i]], x, first_tile[i]);
}

// One chunk's experts: y[s] = down(act(gate x_s, up x_s)) of sorted pair s, unweighted, float32 [pairs, h].
// bfloat16 x: an expert's rows in tiles of eight from five rows on (gguf_tiles.h), fewer straight from the
// blocks. float32 x: experts with kSlabRows pairs or more take slabs of dequantized rows through torch's
// GEMM (as gguf_linear.cpp's float32 prefill), one expert at a time, the others the row products. Both
// share one parallel region per projection, threads over output rows.
// Optional float32 biases [E, 2I] (gate's I, then up's) and [E, H]; null where the experts have none.
struct Biases {
  const float* w13;
  const float* w2;
  int64_t inter, h;
  float gate(int64_t e, int64_t i) const { return w13 ? w13[e * 2 * inter + i] : 0.f; }
  float up(int64_t e, int64_t i) const { return w13 ? w13[e * 2 * inter + inter + i] : 0.f; }
};

void run_chunk(const at::Tensor& xs, const Routing& routing, const Stack& gate, const Stack& up, const Stack& down,
               const ActParams& a, const Biases& bias, at::Tensor& act, at::Tensor& y) {
  const int64_t pairs = xs.size(0), h = xs.size(1), inter = gate.rows;
  const bool floats = xs.scalar_type() == at::kFloat;
  const bool tiles = kTiles && !floats;
  std::vector<int64_t> small, large, tiled;
  for (int64_t c = 0; c < static_cast<int64_t>(routing.experts.size()); ++c) {
    if (tiles) {
      (routing.count[c] >= kTileRows ? tiled : small).push_back(c);
    } else {
      (routing.count[c] >= kSlabRows ? large : small).push_back(c);
    }
  }
  float* acts = act.data_ptr<float>();
  for (const int64_t c : large) {
    const int64_t e = routing.experts[c], s0 = routing.start[c], m = routing.count[c];
    const at::Tensor x = xs.narrow(0, s0, m).to(at::kFloat);
    at::Tensor sums = x.new_empty({m, 2 * inter});
    slab_matmul(x, gate.row(e, 0), inter, gate.type, sums.narrow(1, 0, inter));
    slab_matmul(x, up.row(e, 0), inter, up.type, sums.narrow(1, inter, inter));
    const float* gu = sums.data_ptr<float>();
    at::parallel_for(0, m, 16, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r)
        for (int64_t i = 0; i < inter; ++i)
          acts[(s0 + r) * inter + i] =
              activate(gu[r * 2 * inter + i] + bias.gate(e, i), gu[r * 2 * inter + inter + i] + bias.up(e, i), a);
    });
  }
  if (!small.empty() || !tiled.empty()) {
    int64_t most = 0;
    for (const int64_t c : small) most = std::max(most, routing.count[c]);
    for (const int64_t c : tiled) most = std::max(most, routing.count[c]);
    Rows xq;
    if (floats) {
      prepare_rows(xs.data_ptr<float>(), pairs, h, true, xq);
    } else {
      prepare_rows(xs.data_ptr<c10::BFloat16>(), pairs, h, false, xq);
    }
    XTiles xt;
    std::vector<int64_t> first_tile;
    if (!tiled.empty()) tile_experts(xq, routing, tiled, first_tile, xt);
    at::parallel_for(0, inter, kRowGrain, [&](int64_t begin, int64_t end) {
      const int64_t n = end - begin;
      std::vector<float> g(most * n), u(most * n);  // this thread's gate and up sums of one expert's rows
      const auto activate_rows = [&](int64_t e, int64_t s0, int64_t m) {
        for (int64_t r = 0; r < m; ++r)
          for (int64_t i = 0; i < n; ++i)
            acts[(s0 + r) * inter + begin + i] =
                activate(g[r * n + i] + bias.gate(e, begin + i), u[r * n + i] + bias.up(e, begin + i), a);
      };
      for (size_t k = 0; k < small.size(); ++k) {
        const int64_t c = small[k], e = routing.experts[c], s0 = routing.start[c], m = routing.count[c];
        if (m == 1 && !floats) {  // a decode step's token: each projection's rows of this thread in one call
          gate.run(gate.row(e, begin), gate.row_bytes, n, gate.blocks, xq, s0, g.data());
          up.run(up.row(e, begin), up.row_bytes, n, up.blocks, xq, s0, u.data());
          activate_rows(e, s0, m);
          continue;
        }
        for (int64_t i = begin; i < end; ++i) {
          if (const uint8_t* next = row_ahead(gate, routing, small, k, i, begin, end)) {
            prefetch_row(next, gate.row_bytes);
            prefetch_row(row_ahead(up, routing, small, k, i, begin, end), up.row_bytes);
          }
          gate.fn(gate.row(e, i), gate.blocks, xq, s0, m, g.data() + (i - begin), n);
          up.fn(up.row(e, i), up.blocks, xq, s0, m, u.data() + (i - begin), n);
        }
        activate_rows(e, s0, m);
      }
#if GG_AVX2
      for (size_t i = 0; i < tiled.size(); ++i) {
        const int64_t c = tiled[i], e = routing.experts[c], m = routing.count[c];
        tile_fn(gate.type, xt.lanes)(gate.row(e, 0), gate.row_bytes, gate.blocks, begin, end, xt, first_tile[i], m,
                                     g.data(), n);
        tile_fn(up.type, xt.lanes)(up.row(e, 0), up.row_bytes, up.blocks, begin, end, xt, first_tile[i], m, u.data(),
                                   n);
        activate_rows(e, routing.start[c], m);
      }
#endif
    });
  }
  for (const int64_t c : large) {
    const int64_t e = routing.experts[c], s0 = routing.start[c], m = routing.count[c];
    slab_matmul(act.narrow(0, s0, m), down.row(e, 0), h, down.type, y.narrow(0, s0, m));
  }
  if (small.empty() && tiled.empty()) return;
  // the activations are quantized as x is (int8 groups where x is bfloat16), as llama.cpp quantizes them
  Rows aq;
  prepare_rows(acts, pairs, inter, floats, aq);
  XTiles act_tiles;
  std::vector<int64_t> first_tile;
  if (!tiled.empty()) tile_experts(aq, routing, tiled, first_tile, act_tiles);
  float* ys = y.data_ptr<float>();
  at::parallel_for(0, h, kRowGrain, [&](int64_t begin, int64_t end) {
    for (size_t k = 0; k < small.size(); ++k) {
      const int64_t c = small[k], e = routing.experts[c], s0 = routing.start[c], m = routing.count[c];
      if (m == 1 && !floats) {
        down.run(down.row(e, begin), down.row_bytes, end - begin, down.blocks, aq, s0, ys + s0 * h + begin);
        continue;
      }
      for (int64_t j = begin; j < end; ++j) {
        if (const uint8_t* next = row_ahead(down, routing, small, k, j, begin, end)) prefetch_row(next, down.row_bytes);
        down.fn(down.row(e, j), down.blocks, aq, s0, m, ys + s0 * h + j, h);
      }
    }
#if GG_AVX2
    for (size_t i = 0; i < tiled.size(); ++i) {
      const int64_t c = tiled[i], e = routing.experts[c], s0 = routing.start[c];
      tile_fn(down.type, act_tiles.lanes)(down.row(e, 0), down.row_bytes, down.blocks, begin, end, act_tiles,
                                          first_tile[i], routing.count[c], ys + s0 * h + begin, h);
    }
#endif
  });
}

}  // namespace

// hidden [T, H] (float32 or bfloat16), topk_weights [T, K], topk_ids [T, K]; gate and up uint8 [E, I, bytes
// per row of H], down uint8 [E, H, bytes per row of I], of GGML types types[0..2] -> [T, H] in hidden's
// dtype: sum over k of topk_weights[t, k] * down(act(gate x, up x)) of expert topk_ids[t, k].
// w13_bias [E, 2I] and w2_bias [E, H], float32, where the experts have biases (GPT-OSS).
at::Tensor gguf_moe(const at::Tensor& hidden, const at::Tensor& topk_weights, const at::Tensor& topk_ids,
                    const at::Tensor& gate, const at::Tensor& up, const at::Tensor& down, at::IntArrayRef types,
                    const c10::optional<at::Tensor>& w13_bias, const c10::optional<at::Tensor>& w2_bias,
                    c10::string_view activation, double swiglu_alpha, double swiglu_limit) {
  TORCH_CHECK(hidden.dim() == 2 && (hidden.scalar_type() == at::kFloat || hidden.scalar_type() == at::kBFloat16),
              "gguf_moe: hidden must be float32 or bfloat16 [tokens, hidden]");
  TORCH_CHECK(types.size() == 3, "gguf_moe: one GGML type each for gate, up and down");
  TORCH_CHECK(gate.dim() == 3 && down.dim() == 3, "gguf_moe: stacked experts [E, rows, bytes per row]");
  const int64_t tokens = hidden.size(0), h = hidden.size(1), num_experts = gate.size(0), inter = gate.size(1);
  TORCH_CHECK(h % kGroup == 0 && inter % kGroup == 0, "gguf_moe: the hidden and expert widths must be multiples of 32");
  const bool floats = hidden.scalar_type() == at::kFloat;
  const Stack g = stack_of(gate, types[0], num_experts, h, floats, "gate");
  const Stack u = stack_of(up, types[1], num_experts, h, floats, "up");
  const Stack d = stack_of(down, types[2], num_experts, inter, floats, "down");
  TORCH_CHECK(u.rows == inter && d.rows == h, "gguf_moe: up must have gate's ", inter, " rows, down ", h);
  TORCH_CHECK(topk_ids.dim() == 2 && topk_ids.size(0) == tokens && topk_weights.sizes() == topk_ids.sizes(),
              "gguf_moe: topk_weights and topk_ids must both be [tokens, top_k]");
  const auto bias_of = [&](const c10::optional<at::Tensor>& b, int64_t width, const char* name) -> const float* {
    if (!b.has_value() || !b->defined()) return nullptr;
    TORCH_CHECK(b->scalar_type() == at::kFloat && b->is_contiguous() && b->dim() == 2 && b->size(0) == num_experts &&
                    b->size(1) == width,
                "gguf_moe: ", name, " must be contiguous float32 [", num_experts, ", ", width, "]");
    return b->data_ptr<float>();
  };
  const Biases bias{bias_of(w13_bias, 2 * inter, "w13_bias"), bias_of(w2_bias, h, "w2_bias"), inter, h};
  const ActParams a{parse_activation(activation, "gguf_moe"), static_cast<float>(swiglu_alpha),
                    static_cast<float>(swiglu_limit)};
  at::Tensor out = hidden.new_empty({tokens, h});
  const int64_t top_k = topk_ids.size(1);
  if (tokens == 0) return out;
  if (top_k == 0) return out.zero_();
  const at::Tensor x = hidden.contiguous();
  const at::Tensor ids = topk_ids.to(at::kLong).contiguous();
  const at::Tensor weights = topk_weights.to(at::kFloat).contiguous();
  const int64_t chunk = std::max<int64_t>(1, std::min(tokens, kChunkFloats / (top_k * (inter + h))));
  // uninitialised: every value read is written first
  at::Tensor act = weights.new_empty({chunk * top_k, inter}), y = weights.new_empty({chunk * top_k, h});
  for (int64_t t0 = 0; t0 < tokens; t0 += chunk) {
    const int64_t n = std::min(chunk, tokens - t0);
    const Routing routing = sort_pairs(ids.data_ptr<int64_t>() + t0 * top_k, weights.data_ptr<float>() + t0 * top_k, n,
                                       top_k, num_experts, "gguf_moe");
    at::Tensor order = ids.new_empty({n * top_k});
    int64_t* row = order.data_ptr<int64_t>();
    for (int64_t s = 0; s < n * top_k; ++s) row[s] = t0 + routing.token[s];
    run_chunk(x.index_select(0, order), routing, g, u, d, a, bias, act, y);
    at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
      std::vector<float> sum(h);
      for (int64_t t = begin; t < end; ++t) {
        std::fill(sum.begin(), sum.end(), 0.f);
        for (int64_t k = 0; k < top_k; ++k) {
          const int64_t s = routing.position[t * top_k + k];
          const float w = routing.weight[s];
          const float* ys = y.data_ptr<float>() + s * h;
          if (bias.w2 != nullptr) {  // the down projection's bias, then the routing weight, as the reference
            const float* b = bias.w2 + ids.data_ptr<int64_t>()[(t0 + t) * top_k + k] * h;
            for (int64_t j = 0; j < h; ++j) sum[j] += w * (ys[j] + b[j]);
          } else {
            for (int64_t j = 0; j < h; ++j) sum[j] += w * ys[j];
          }
        }
        if (floats) {
          std::copy(sum.begin(), sum.end(), out.data_ptr<float>() + (t0 + t) * h);
        } else {
          c10::BFloat16* dst = out.data_ptr<c10::BFloat16>() + (t0 + t) * h;
          for (int64_t j = 0; j < h; ++j) dst[j] = round_to_bf16(sum[j]);
        }
      }
    });
  }
  return out;
}

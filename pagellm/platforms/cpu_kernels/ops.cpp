// The library's operators: the kernels' entry points (kernels.h) registered with the dispatcher, and the
// native attention step that compiled CPU graphs call.
//
// Registered operators rather than a pybind11 module: <torch/extension.h> alone took ~55 s of the build on
// a 2-core machine, and torch/library.h, which this file needs, ~10 s, so only this file includes it.

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <cstdint>
#include <utility>
#include <vector>

#include "kernels.h"

// pagellm::cpu_attention, the compiled CPU graph's attention op, without Python.
//
// A decode-only step's attention is the same two calls in every layer (store_kv, paged_attention) with the
// step's tables; Python's part of it (the custom op's dispatch and the backend's forward) cost ~4 ms of a
// 75 ms batch-64 decode step. So, per forward, Python hands the step's tables and each layer's cache and
// plan over once (begin_native_step, from CpuAttnMetadata.begin_forward), and the op runs them here; in
// any other step (prefill chunks, caches of another dtype), and outside a forward, it calls
// pagellm::attention, the Python op, through the dispatcher.
namespace {

struct NativeLayer {
  at::Tensor kv_cache;  // [2, kv_heads, blocks, block_size, head_size], the compute dtype
  int64_t kind, window, partition;
  double scale;
  at::Tensor reqs;  // int32 decode requests
  bool amx;
  double soft_cap;                   // 0: none
  c10::optional<at::Tensor> sinks;   // float32 [num_heads]
};

struct NativeStep {
  bool active = false;
  bool fixed_order = false;  // batch-invariant mode (paged_attention's fixed_order)
  at::Tensor block_tables, seq_lens, query_start_loc, slots;
  std::vector<NativeLayer> layers;
};

NativeStep& native_step() {
  static NativeStep step;
  return step;
}

}  // namespace

// Each layer's plan comes as one entry of each list (the schema has no list of tuples).
void begin_native_step(at::Tensor block_tables, at::Tensor seq_lens, at::Tensor query_start_loc, at::Tensor slots,
                       at::TensorList kv_caches, at::IntArrayRef kinds, at::ArrayRef<double> scales,
                       at::IntArrayRef windows, at::TensorList reqs, at::IntArrayRef partitions,
                       const c10::List<bool>& amx, at::ArrayRef<double> soft_caps,
                       const c10::List<c10::optional<at::Tensor>>& sinks, bool fixed_order) {
  const size_t n = kv_caches.size();
  TORCH_CHECK(kinds.size() == n && scales.size() == n && windows.size() == n && reqs.size() == n &&
                  partitions.size() == n && amx.size() == n && soft_caps.size() == n && sinks.size() == n,
              "begin_native_step: one entry per layer in each list");
  NativeStep step;
  step.block_tables = std::move(block_tables);
  step.seq_lens = std::move(seq_lens);
  step.query_start_loc = std::move(query_start_loc);
  step.slots = std::move(slots);
  step.fixed_order = fixed_order;
  for (size_t i = 0; i < n; ++i) {
    const at::Tensor& kv_cache = kv_caches[i];
    TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2, "begin_native_step: a [2, kv_heads, blocks, block_size, head_size] cache");
    step.layers.push_back({kv_cache, kinds[i], windows[i], partitions[i], scales[i], reqs[i], amx.get(i), soft_caps[i],
                           sinks.get(i)});
  }
  step.active = true;
  native_step() = std::move(step);
}

void end_native_step() { native_step() = NativeStep(); }

// layer_index: a one-element int64 tensor on the host (the attention layer's buffer, an input of the graph so
// that one compiled decoder layer serves every layer).
at::Tensor cpu_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                         const at::Tensor& layer_index) {
  TORCH_CHECK(layer_index.numel() == 1 && layer_index.scalar_type() == at::kLong && layer_index.is_cpu(),
              "cpu_attention: layer_index must be one int64 on the CPU");
  const int64_t layer_idx = *layer_index.data_ptr<int64_t>();
  const NativeStep& step = native_step();
  if (step.active && layer_idx >= 0 && layer_idx < int64_t(step.layers.size())) {
    const NativeLayer& layer = step.layers[layer_idx];
    const int64_t num_kv = layer.kv_cache.size(1), d = layer.kv_cache.size(4), tokens = q.size(0);
    const at::Tensor k3 = k.reshape({tokens, num_kv, d}), v3 = v.reshape({tokens, num_kv, d});
    const auto rows_contiguous = [d](const at::Tensor& t) { return t.stride(2) == 1 && t.stride(1) == d; };
    if (k3.scalar_type() == layer.kv_cache.scalar_type() && v3.scalar_type() == layer.kv_cache.scalar_type() &&
        rows_contiguous(k3) && rows_contiguous(v3)) {
      store_kv(layer.kv_cache, k3, v3, step.slots);
      const at::Tensor q3 = q.reshape({tokens, -1, d}).contiguous();
      at::Tensor out = q3.new_empty(q3.sizes());
      paged_attention(out, q3, layer.kv_cache[0], layer.kv_cache[1], step.block_tables, step.seq_lens,
                      step.query_start_loc, layer.reqs, layer.kind, layer.scale, layer.window, layer.partition,
                      layer.amx, layer.soft_cap, layer.sinks, step.fixed_order);
      return out.view({tokens, -1});
    }
  }
  static const auto python_op = c10::Dispatcher::singleton()
                                    .findSchemaOrThrow("pagellm::attention", "")
                                    .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&)>();
  return python_op.call(q, k, v, layer_index);
}

// The compiled graph reaches these through the dispatcher; their schemas, with the fake implementations
// torch.compile traces, are defined in Python (platforms/cpu.py, platforms/cpu_moe.py,
// platforms/cpu_linear.py, platforms/cpu_gguf.py, platforms/cpu_gguf_moe.py, attention_backends/cpu_attn.py), so this build only adds the CPU implementations.
TORCH_LIBRARY_IMPL(pagellm, CPU, m) {
  m.impl("amx_linear", TORCH_FN(amx_linear));
  m.impl("cpu_fused_moe", TORCH_FN(cpu_fused_moe));
  m.impl("cpu_panel_linear", TORCH_FN(cpu_panel_linear));
  m.impl("cpu_bf16_pair_linear", TORCH_FN(cpu_bf16_pair_linear));
  m.impl("cpu_bf16_pair_heads", TORCH_FN(cpu_bf16_pair_heads));
  m.impl("gguf_linear", TORCH_FN(gguf_linear));
  m.impl("gguf_embedding", TORCH_FN(gguf_embedding));
  m.impl("gguf_moe", TORCH_FN(gguf_moe));
  m.impl("cpu_attention", TORCH_FN(cpu_attention));
}

// Python calls the rest as torch.ops.<this build's name>.<op> (cpu_kernels.load binds them). The namespace is
// the build's name, which carries its cache key, so a second build loaded into the same process defines its
// own ops instead of failing on this one's.
TORCH_LIBRARY(TORCH_EXTENSION_NAME, m) {
  m.def("amx_available() -> bool", TORCH_FN(amx_available));
  m.def("amx_pack(Tensor weight) -> Tensor", TORCH_FN(amx_pack));
  m.def("amx_linear(Tensor x, Tensor packed, Tensor? bias, int n) -> Tensor", TORCH_FN(amx_linear));
  m.def("amx_pack_int8(Tensor weight) -> Tensor", TORCH_FN(amx_pack_int8));
  m.def("amx_linear_w8a8(Tensor x, Tensor packed, Tensor w_scale, Tensor? bias, int n) -> Tensor",
        TORCH_FN(amx_linear_w8a8));
  m.def("paged_attention(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor seq_lens, Tensor query_start_loc, Tensor reqs, int cache_kind, float scale, int window, "
        "int partition, bool use_amx, float soft_cap, Tensor? sinks, bool fixed_order=False) -> ()",
        TORCH_FN(paged_attention));
  m.def("argmax_rows(Tensor logits) -> Tensor", TORCH_FN(argmax_rows));
  m.def("store_kv(Tensor(a!) kv_cache, Tensor k, Tensor v, Tensor slots) -> ()", TORCH_FN(store_kv));
  m.def("isa() -> str", TORCH_FN(isa));
  m.def("attention_pair_tiles() -> bool", TORCH_FN(attention_pair_tiles));
  m.def("bf16_pairs_available() -> bool", TORCH_FN(bf16_pairs_available));
  m.def("gguf_dequantize(Tensor raw, int type) -> Tensor", TORCH_FN(gguf_dequantize));
  m.def("gguf_kernel_type(int type) -> bool", TORCH_FN(gguf_kernel_type));
  m.def("gguf_isa() -> str", TORCH_FN(gguf_isa));
  m.def("gguf_rows_asked_ahead() -> bool", TORCH_FN(gguf_rows_asked_ahead));
  m.def("gguf_interleaved_type(int type) -> int", TORCH_FN(gguf_interleaved_type));
  m.def("gguf_interleave(Tensor raw, int type) -> Tensor", TORCH_FN(gguf_interleave));
  m.def("fused_moe_isa() -> str", TORCH_FN(fused_moe_isa));
  m.def("native_decoder_pairs() -> bool", TORCH_FN(native_decoder_pairs));
  m.def("native_decoder_panels() -> bool", TORCH_FN(native_decoder_panels));
  m.def("native_decoder_plan(Tensor embed, int embed_type, Tensor final_norm, Tensor inv_freq, Tensor[] norms, "
        "Tensor[] parts, int[] part_types, int[] part_counts, Tensor?[] biases, Tensor?[] head_norms, "
        "Tensor[] kv_caches, int[] moe, Tensor?[] experts, int[] expert_types, int[] dims, float[] floats, "
        "bool use_amx) -> int",
        TORCH_FN(native_decoder_plan));
  m.def("native_decoder_step(int handle, Tensor(a!) out, Tensor tokens, Tensor positions, Tensor slots, "
        "Tensor block_tables, Tensor aux_layers, Tensor(b!) aux_out) -> ()",
        TORCH_FN(native_decoder_step));
  m.def("native_head_plan(Tensor embed, int embed_type, Tensor final_norm, Tensor inv_freq, Tensor[] norms, "
        "Tensor[] parts, int[] part_types, int[] part_counts, Tensor?[] biases, Tensor kv_cache, Tensor d2t, "
        "int[] dims, float[] floats, bool use_amx, bool norm_before_residual) -> int",
        TORCH_FN(native_head_plan));
  m.def("native_head_step(int handle, Tensor tokens, Tensor positions, Tensor slots, Tensor block_tables, "
        "Tensor hidden, Tensor picks, Tensor(a!) hidden_out, Tensor(b!) drafts) -> ()",
        TORCH_FN(native_head_step));
  m.def("native_decoder_max_rows(int handle) -> int", TORCH_FN(native_decoder_max_rows));
  m.def("native_decoder_drop(int handle) -> ()", TORCH_FN(native_decoder_drop));
  m.def("begin_native_step(Tensor block_tables, Tensor seq_lens, Tensor query_start_loc, Tensor slots, "
        "Tensor[] kv_caches, int[] kinds, float[] scales, int[] windows, Tensor[] reqs, int[] partitions, "
        "bool[] amx, float[] soft_caps, Tensor?[] sinks, bool fixed_order=False) -> ()",
        TORCH_FN(begin_native_step));
  m.def("end_native_step() -> ()", TORCH_FN(end_native_step));
  m.def("gated_delta_rule_update(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor(a!) states, "
        "Tensor slots) -> Tensor",
        TORCH_FN(gated_delta_rule_update));
  m.def("selective_state_update(Tensor x, Tensor dt, Tensor A, Tensor B, Tensor C, Tensor D, Tensor dt_bias, "
        "Tensor(a!) states, Tensor slots) -> Tensor",
        TORCH_FN(selective_state_update));
  m.def("conv1d_update(Tensor x, Tensor weight, Tensor? bias, Tensor(a!) conv_states, Tensor slots, "
        "str? activation) -> Tensor",
        TORCH_FN(conv1d_update));
  m.def("sparse_index_scores(Tensor q, Tensor rows, Tensor slots, Tensor weights, float scale) -> Tensor",
        TORCH_FN(sparse_index_scores));
  m.def("sparse_attend_rows(Tensor q, Tensor rows, Tensor slots, Tensor valid, float scale, int v_size) -> Tensor",
        TORCH_FN(sparse_attend_rows));
}

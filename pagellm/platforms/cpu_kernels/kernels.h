// The kernels' entry points, defined in the source named above each and registered as operators in ops.cpp.
// Their sources include ATen's Tensor and nothing heavier (no torch/library.h, no ATen/ops/*.h): each
// header set costs seconds of compile per file, on every user's first start.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>

// paged_attention.cpp
void paged_attention(at::Tensor out, at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, at::Tensor block_tables,
                     at::Tensor seq_lens, at::Tensor query_start_loc, at::Tensor reqs, int64_t cache_kind, double scale,
                     int64_t window, int64_t partition, bool use_amx, double soft_cap,
                     const c10::optional<at::Tensor>& sinks, bool fixed_order);
void store_kv(at::Tensor kv_cache, const at::Tensor& k, const at::Tensor& v, const at::Tensor& slots);
std::string isa();
// Whether this build multiplies bfloat16 prefill chunks' scores as pair tiles (AVX-512 BF16: `tile_scores`).
bool attention_pair_tiles();

// linear_amx.cpp
bool amx_available();
at::Tensor amx_pack(const at::Tensor& weight);
at::Tensor amx_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                      int64_t n);
at::Tensor amx_pack_int8(const at::Tensor& weight);
at::Tensor amx_linear_w8a8(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& w_scale,
                           const c10::optional<at::Tensor>& bias, int64_t n);

// argmax.cpp
at::Tensor argmax_rows(const at::Tensor& logits);

// fused_moe.cpp
at::Tensor cpu_fused_moe(const at::Tensor& hidden, const at::Tensor& topk_weights, const at::Tensor& topk_ids,
                         const at::Tensor& w13, const at::Tensor& w2, const c10::optional<at::Tensor>& w13_bias,
                         const c10::optional<at::Tensor>& w2_bias, const c10::optional<at::Tensor>& w13_scale,
                         const c10::optional<at::Tensor>& w2_scale, c10::string_view activation, double swiglu_alpha,
                         double swiglu_limit);
std::string fused_moe_isa();

// gguf_linear.cpp
at::Tensor gguf_linear(const at::Tensor& input, at::TensorList parts, at::IntArrayRef types);
at::Tensor gguf_dequantize(const at::Tensor& raw, int64_t type);
bool gguf_kernel_type(int64_t type);
// "avx2+vnni" (the byte products in vpdpbusd), "avx2" or "scalar": the GGUF kernels' path in this build.
std::string gguf_isa();
// Whether the one-row and few-row products prefetch the next weight rows here (`rows_asked_ahead`).
bool gguf_rows_asked_ahead();
int64_t gguf_interleaved_type(int64_t type);
// A decode step's m bfloat16 x rows (at most kDirectRows, 4: what gguf_linear multiplies straight from the
// blocks) quantized once (`gguf_row_quantize`), then each thread's share of a linear's rows
// (`gguf_row_share`: thread t of T, the rows gguf_linear gives it; y [m, n]), rounded to bfloat16, then a
// bfloat16 bias added (or none), as `gguf_linear(x) + bias` in bfloat16: for callers with their own parallel
// region (native_decoder.cpp). Part p of `count` is uint8 rows [starts[p], starts[p + 1]) of GGML type
// types[p] (interleaved or not), K = k.
constexpr int64_t kGgufDirectRows = 4;
struct GgufRow;
GgufRow* gguf_row_new();
void gguf_row_delete(GgufRow* row);
void gguf_row_quantize(GgufRow* row, const uint16_t* x, int64_t m, int64_t k);
void gguf_row_share(const GgufRow* row, const uint8_t* const* parts, const int64_t* types, const int64_t* starts,
                    int64_t count, int64_t k, const uint16_t* bias, uint16_t* y, int t, int T);
// One row of a GGUF table (an embedding) in bfloat16, as gguf_embedding then .to(bfloat16) give it.
void gguf_bf16_row(int64_t type, const uint8_t* src, int64_t k, uint16_t* dst);
at::Tensor gguf_interleave(const at::Tensor& raw, int64_t type);
at::Tensor gguf_embedding(const at::Tensor& ids, const at::Tensor& table, int64_t type);

// gguf_moe.cpp
at::Tensor gguf_moe(const at::Tensor& hidden, const at::Tensor& topk_weights, const at::Tensor& topk_ids,
                    const at::Tensor& gate, const at::Tensor& up, const at::Tensor& down, at::IntArrayRef types,
                    const c10::optional<at::Tensor>& w13_bias, const c10::optional<at::Tensor>& w2_bias,
                    c10::string_view activation, double swiglu_alpha, double swiglu_limit);

// linear_panels.cpp
at::Tensor cpu_panel_linear(const at::Tensor& input, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                            int64_t out_features, bool fixed_order, const c10::optional<at::Tensor>& scale);

// One float32 x row (a bfloat16 row widened) times panels [first, last) of a bfloat16 panel-packed weight
// (bias: float32 [n], or null), rounded to bfloat16: a thread's share, for callers with their own parallel
// region. Only in builds with AVX2 (panel_rows_available).
bool panel_rows_available();
void bf16_panel_row_run(const float* x, int64_t k, const uint16_t* w, const float* bias, int64_t n, uint16_t* y,
                        int64_t first, int64_t last);
// m float32 x rows (k apart; y's n apart) times panels [first, last) of a bfloat16 panel-packed weight, as a
// batch's cpu_panel_linear call multiplies them (the same sums): a thread's share of a batch. AVX2 builds only.
void bf16_panel_rows_run(const float* x, int64_t m, int64_t k, const uint16_t* w, const float* bias, int64_t n,
                         uint16_t* y, int64_t first, int64_t last);

// linear_bf16_pairs.cpp
bool bf16_pairs_available();
at::Tensor cpu_bf16_pair_linear(const at::Tensor& input, const at::Tensor& packed,
                                const c10::optional<at::Tensor>& bias, int64_t out_features);
at::Tensor cpu_bf16_pair_heads(const at::Tensor& x, const at::Tensor& packed, int64_t out_features);
// One bfloat16 x row times panels [first, last) of a pair-packed weight (bias: float32, whole panels, or
// null); a thread's share, for callers with their own parallel region. Only in builds with AVX-512 BF16.
void bf16_pair_row_run(const uint16_t* x, const uint16_t* w, int64_t pairs, const float* b, int64_t n, uint16_t* y,
                       int64_t first, int64_t last);
// m bfloat16 x rows (x_stride apart; y's n apart) times the panel pairs [first, last) (pair u: panels 2u and
// 2u + 1) of a pair-packed weight, as a batch's call multiplies them: a thread's share of a batch, for callers
// with their own parallel region. Only in builds with AVX-512 BF16.
void bf16_pair_rows_run(const uint16_t* x, int64_t m, int64_t x_stride, const uint16_t* w, int64_t pairs,
                        int64_t panels, const float* b, int64_t n, uint16_t* y, int64_t first, int64_t last);

// native_decoder.cpp
int64_t native_decoder_plan(const at::Tensor& embed, int64_t embed_type, const at::Tensor& final_norm,
                            const at::Tensor& inv_freq, at::TensorList norms, at::TensorList parts,
                            at::IntArrayRef part_types, at::IntArrayRef part_counts,
                            const c10::List<c10::optional<at::Tensor>>& biases,
                            const c10::List<c10::optional<at::Tensor>>& head_norms, at::TensorList kv_caches,
                            at::IntArrayRef moe, const c10::List<c10::optional<at::Tensor>>& experts,
                            at::IntArrayRef expert_types, at::IntArrayRef dims, at::ArrayRef<double> floats,
                            bool use_amx);
void native_decoder_step(int64_t handle, at::Tensor out, const at::Tensor& tokens, const at::Tensor& positions,
                         const at::Tensor& slots, const at::Tensor& block_tables, const at::Tensor& aux_layers,
                         at::Tensor aux_out);
int64_t native_head_plan(const at::Tensor& embed, int64_t embed_type, const at::Tensor& final_norm,
                         const at::Tensor& inv_freq, at::TensorList norms, at::TensorList parts,
                         at::IntArrayRef part_types, at::IntArrayRef part_counts,
                         const c10::List<c10::optional<at::Tensor>>& biases, const at::Tensor& kv_cache,
                         const at::Tensor& d2t, at::IntArrayRef dims, at::ArrayRef<double> floats, bool use_amx,
                         bool norm_before_residual);
void native_head_step(int64_t handle, const at::Tensor& tokens, const at::Tensor& positions, const at::Tensor& slots,
                      const at::Tensor& block_tables, const at::Tensor& hidden, const at::Tensor& picks,
                      at::Tensor hidden_out, at::Tensor drafts);
// The rows a plan's step may take: any number, or kGgufDirectRows where some projections are GGUF blocks.
int64_t native_decoder_max_rows(int64_t handle);
void native_decoder_drop(int64_t handle);
// Whether pair-packed bfloat16 projections run here (a build with AVX-512 BF16); GGUF ones run in any.
bool native_decoder_pairs();
// Whether panel-packed bfloat16 projections run here (a build with AVX2).
bool native_decoder_panels();

// recurrent.cpp
at::Tensor gated_delta_rule_update(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                                   const at::Tensor& beta, at::Tensor states, const at::Tensor& slots);
at::Tensor selective_state_update(const at::Tensor& x, const at::Tensor& dt, const at::Tensor& A, const at::Tensor& B,
                                  const at::Tensor& C, const at::Tensor& D, const at::Tensor& dt_bias, at::Tensor states,
                                  const at::Tensor& slots);
at::Tensor conv1d_update(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                         at::Tensor conv_states, const at::Tensor& slots, c10::optional<c10::string_view> activation);

// sparse_attention.cpp: DeepSeek Sparse Attention over cached rows [slots, d] (float32 or bfloat16) read in
// place through slots. The indexer's scores: q [Q, H, d] float32, slots [S], weights [Q, H] float32 ->
// [Q, S] float32, sum_h weights[q, h] * relu(scale * q_h . row[slots[t]]). The attention over each query's
// chosen rows: q [Q, H, d] float32, slots [Q, k], valid [Q, k] -> [Q, H, v_size] float32, softmax(scale *
// q_h . row) over the valid ones times the rows' first v_size values.
at::Tensor sparse_index_scores(const at::Tensor& q, const at::Tensor& rows, const at::Tensor& slots,
                               const at::Tensor& weights, double scale);
at::Tensor sparse_attend_rows(const at::Tensor& q, const at::Tensor& rows, const at::Tensor& slots,
                              const at::Tensor& valid, double scale, int64_t v_size);

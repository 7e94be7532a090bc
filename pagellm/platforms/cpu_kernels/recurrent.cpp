// Decode steps of recurrent layers (Gated DeltaNet, Mamba-2): one token per sequence, each sequence's state
// read from its slot of the state cache and updated there, in place.
//
// Why: the plain-torch references (models/layers/recurrent_ops.py, mamba_ops.py, which define the math) run a
// dozen batched ops, each a pass over every state, and their wrapper gathers the slots' states into a batch
// and scatters them back (two more copies of each). At batch 64 with model H's shape a layer's delta-rule
// states are 64 MiB, so the step is bound by those passes over memory. Here each (sequence, head) state is
// read from memory once and written once:
//
// - gated_delta_rule_update: S [Dk, Dv] per value head (64 KB at Dk = Dv = 128), two passes in row order:
//   the first reads S from memory and sums S^T k, which is all the correction delta = beta (v - exp(g) S^T k)
//   needs; the second, from L2, writes S = exp(g) S + k delta^T and sums o = S^T q from the new values. While
//   the second runs, the thread's next state is prefetched (batch 64, model H's shape: ~1.65x the time of a
//   plain in-place pass over the same states without it, ~1.1-1.35x with it, on a 2-core AMD EPYC).
// - selective_state_update: S [P, N] per head, one pass: each row decays, takes its dt x B^T write and is
//   dotted with C while it is in registers.
// - conv1d_update: the K-1 inputs a channel keeps, shifted by one with the new input appended, and the
//   conv of the K taps, one channel at a time.
//
// Math in float32 whatever the inputs' dtype (float32 or bfloat16, each its own), as the references do;
// outputs in the dtype of the reference's (v's, x's). Loops over contiguous values are written for the
// compiler to vectorise (-O3 -march=native). Work is split over (sequence, head), or sequences for the conv;
// a step's slots are distinct (one per persistent-batch row), so no two threads write one state.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "kernels.h"

namespace {

constexpr float kL2NormEps = 1e-6f;  // recurrent_ops.L2NORM_EPS: inside the root

bool is_float_or_bf16(const at::Tensor& t) {
  return t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16;
}

// bfloat16 as its 16 bits, widened and rounded (to nearest even, NaN kept) without branches, so that loops of
// them vectorise (c10::BFloat16's did not in the conv's loop).
inline float widen(float v) { return v; }
inline float widen(uint16_t v) {
  const uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}
template <typename T>
inline T narrow(float f) {
  if constexpr (std::is_same_v<T, float>) {
    return f;
  } else {
    uint32_t bits;
    std::memcpy(&bits, &f, 4);
    const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
    return static_cast<uint16_t>(f != f ? (bits >> 16) | 0x40u : rounded);
  }
}

// A [rows, heads, n] tensor of float32 or bfloat16 with its last dim contiguous, read and written a row of n
// values at a time as float32.
struct Rows {
  uint8_t* base;
  int64_t row_stride, head_stride, elem;  // bytes; elem is 2 for bfloat16
  int64_t n;

  explicit Rows(const at::Tensor& t)
      : base(static_cast<uint8_t*>(t.data_ptr())),
        row_stride(t.stride(0) * t.element_size()),
        head_stride(t.stride(1) * t.element_size()),
        elem(t.element_size()),
        n(t.size(2)) {}

  void* at(int64_t row, int64_t head) const { return base + row * row_stride + head * head_stride; }

  void load(int64_t row, int64_t head, float* dst) const {
    const void* src = at(row, head);
    if (elem == 2) {
      const auto* p = static_cast<const uint16_t*>(src);
      for (int64_t i = 0; i < n; ++i) dst[i] = widen(p[i]);
    } else {
      std::copy_n(static_cast<const float*>(src), n, dst);
    }
  }

  void store(int64_t row, int64_t head, const float* src) const {
    void* dst = at(row, head);
    if (elem == 2) {
      auto* p = static_cast<uint16_t*>(dst);
      for (int64_t i = 0; i < n; ++i) p[i] = narrow<uint16_t>(src[i]);
    } else {
      std::copy_n(src, n, static_cast<float*>(dst));
    }
  }
};

Rows checked_rows(const at::Tensor& t, int64_t rows, int64_t heads, int64_t n, const char* what) {
  TORCH_CHECK(t.dim() == 3 && t.size(0) == rows && t.size(1) == heads && t.size(2) == n && t.stride(2) == 1 &&
                  is_float_or_bf16(t),
              what, ": float32 or bfloat16 [", rows, ", ", heads, ", ", n, "] with its last dim contiguous");
  return Rows(t);
}

// A small per-row or per-head tensor of the given shape, as contiguous float32 values.
at::Tensor floats(const at::Tensor& t, at::IntArrayRef shape, const char* what) {
  TORCH_CHECK(t.sizes() == shape && is_float_or_bf16(t), what, ": float32 or bfloat16 ", shape);
  return t.to(at::kFloat).contiguous();
}

const int64_t* checked_slots(const at::Tensor& slots, int64_t batch, int64_t num_slots, const char* what) {
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.numel() == batch && slots.is_contiguous(),
              what, ": int64 slots [", batch, "]");
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < batch; ++i)
    TORCH_CHECK(slot[i] >= 0 && slot[i] < num_slots, what, ": slot ", slot[i], " out of range");
  return slot;
}

float dot(const float* a, const float* b, int64_t n) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

// One head's step on its state S [dk, dv] (rows contiguous): S' = decay S + k delta^T with delta =
// beta (v - decay S^T k), then o = S'^T q. `work` holds dv floats. `next`, where not null, is the state the
// thread updates next: while this one is updated from cache, its lines are prefetched into L2, a row's worth
// for each row here, so that memory is kept busy between the reading passes.
inline void delta_rule_head(float* s, int64_t dk, int64_t dv, const float* q, const float* k, const float* v,
                            float decay, float beta, float* work, float* o, const float* next) {
  float* predicted = work;
  std::fill_n(predicted, dv, 0.f);
  for (int64_t i = 0; i < dk; ++i) {
    const float* row = s + i * dv;
    const float ki = k[i];
#pragma omp simd
    for (int64_t j = 0; j < dv; ++j) predicted[j] += ki * row[j];
  }
  float* delta = work;  // in place of predicted
#pragma omp simd
  for (int64_t j = 0; j < dv; ++j) delta[j] = beta * (v[j] - decay * predicted[j]);
  std::fill_n(o, dv, 0.f);
  for (int64_t i = 0; i < dk; ++i) {
    float* row = s + i * dv;
    const float ki = k[i], qi = q[i];
    if (next)
      for (int64_t j = 0; j < dv; j += 16) __builtin_prefetch(next + i * dv + j, 0, 2);
#pragma omp simd
    for (int64_t j = 0; j < dv; ++j) {
      const float updated = decay * row[j] + ki * delta[j];
      row[j] = updated;
      o[j] += qi * updated;
    }
  }
}

// The conv of one sequence: y[d] = w[d] . (its `width` kept inputs, x[d]), the kept inputs shifted by one with
// x[d] appended. kWidth is `width` known at compile time (0: not), which lets the compiler vectorise the loop
// over channels (the kept inputs read and written as unrolled locals).
template <typename T, int kWidth>
inline void conv_sequence(T* state, int64_t width, int64_t channels, const float* x, const float* w, float* y) {
  if constexpr (kWidth > 0) {
#pragma omp simd
    for (int64_t d = 0; d < channels; ++d) {
      T* window = state + d * kWidth;
      const float* taps = w + d * (kWidth + 1);
      float kept[kWidth];
#pragma GCC unroll 8
      for (int t = 0; t < kWidth; ++t) kept[t] = widen(window[t]);
      float sum = x[d] * taps[kWidth];
#pragma GCC unroll 8
      for (int t = 0; t < kWidth; ++t) sum += kept[t] * taps[t];
      y[d] = sum;
#pragma GCC unroll 8
      for (int t = 0; t + 1 < kWidth; ++t) window[t] = narrow<T>(kept[t + 1]);
      window[kWidth - 1] = narrow<T>(x[d]);
    }
  } else {
    for (int64_t d = 0; d < channels; ++d) {
      T* window = state + d * width;
      const float* taps = w + d * (width + 1);
      float sum = x[d] * taps[width];
      for (int64_t t = 0; t < width; ++t) sum += widen(window[t]) * taps[t];
      y[d] = sum;
      for (int64_t t = 0; t + 1 < width; ++t) window[t] = window[t + 1];
      if (width > 0) window[width - 1] = narrow<T>(x[d]);
    }
  }
}

// exp(x) for silu, to about 1 ulp on [-87, 87] (Cephes' expf: 2^n times a degree-6 polynomial on
// |r| <= ln2 / 2) and clamped to that range, in operations a loop of it vectorises with (std::exp is a call
// per value: silu over the conv's 4096 channels a sequence was most of the update's time).
inline float silu_exp(float x) {
  // the clamp on x's bits (|x| orders as an integer): a float compare may trap, which keeps GCC from
  // vectorising the loop
  int32_t x_bits;
  std::memcpy(&x_bits, &x, 4);
  x_bits = std::min(x_bits & 0x7fffffff, 0x42ae0000) | (x_bits & INT32_MIN);  // 0x42ae0000: 87.f
  std::memcpy(&x, &x_bits, 4);
  constexpr float kRound = 12582912.f;  // 1.5 * 2^23: adding it rounds to an integer, kept in the low bits
  const float shifted = x * 1.44269504088896341f + kRound;
  const float n = shifted - kRound;
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;  // x - n ln2, ln2 in two parts
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  int32_t bits, round_bits;
  std::memcpy(&bits, &shifted, 4);
  std::memcpy(&round_bits, &kRound, 4);
  bits = (bits - round_bits + 127) << 23;  // 2^n
  float scale;
  std::memcpy(&scale, &bits, 4);
  return (p * r * r + r + 1.f) * scale;
}

inline float softplus(float x) { return x > 20.f ? x : std::log1p(std::exp(x)); }  // F.softplus, threshold 20

}  // namespace

at::Tensor gated_delta_rule_update(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                                   const at::Tensor& beta, at::Tensor states, const at::Tensor& slots) {
  TORCH_CHECK(states.dim() == 4 && states.scalar_type() == at::kFloat && states.is_contiguous(),
              "gated_delta_rule_update: a contiguous float32 state cache [slots, heads, Dk, Dv]");
  const int64_t heads = states.size(1), dk = states.size(2), dv = states.size(3), batch = v.size(0);
  const Rows q_rows = checked_rows(q, batch, heads, dk, "gated_delta_rule_update: q");
  const Rows k_rows = checked_rows(k, batch, heads, dk, "gated_delta_rule_update: k");
  const Rows v_rows = checked_rows(v, batch, heads, dv, "gated_delta_rule_update: v");
  const at::Tensor g_f = floats(g, {batch, heads}, "gated_delta_rule_update: g");
  const at::Tensor beta_f = floats(beta, {batch, heads}, "gated_delta_rule_update: beta");
  const int64_t* slot = checked_slots(slots, batch, states.size(0), "gated_delta_rule_update");
  at::Tensor out = v.new_empty({batch, heads, dv});
  const Rows o_rows(out);
  float* cache = states.data_ptr<float>();
  const float* gs = g_f.data_ptr<float>();
  const float* betas = beta_f.data_ptr<float>();
  const float q_scale = 1.f / std::sqrt(static_cast<float>(dk));
  at::parallel_for(0, batch * heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> buffer(2 * dk + 3 * dv);
    float *qv = buffer.data(), *kv = qv + dk, *vv = kv + dk, *ov = vv + dv, *work = ov + dv;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / heads, h = item % heads;
      q_rows.load(b, h, qv);
      k_rows.load(b, h, kv);
      v_rows.load(b, h, vv);
      const float q_norm = q_scale / std::sqrt(dot(qv, qv, dk) + kL2NormEps);
      const float k_norm = 1.f / std::sqrt(dot(kv, kv, dk) + kL2NormEps);
#pragma omp simd
      for (int64_t i = 0; i < dk; ++i) qv[i] *= q_norm, kv[i] *= k_norm;
      const float decay = std::exp(gs[item]), strength = betas[item];
      const float* next = nullptr;
      if (item + 1 < end) next = cache + (slot[(item + 1) / heads] * heads + (item + 1) % heads) * dk * dv;
      delta_rule_head(cache + (slot[b] * heads + h) * dk * dv, dk, dv, qv, kv, vv, decay, strength, work, ov, next);
      o_rows.store(b, h, ov);
    }
  });
  return out;
}

at::Tensor selective_state_update(const at::Tensor& x, const at::Tensor& dt, const at::Tensor& A, const at::Tensor& B,
                                  const at::Tensor& C, const at::Tensor& D, const at::Tensor& dt_bias, at::Tensor states,
                                  const at::Tensor& slots) {
  TORCH_CHECK(states.dim() == 4 && states.scalar_type() == at::kFloat && states.is_contiguous(),
              "selective_state_update: a contiguous float32 state cache [slots, heads, P, N]");
  const int64_t heads = states.size(1), p_dim = states.size(2), n = states.size(3), batch = x.size(0);
  TORCH_CHECK(B.dim() == 3 && B.size(1) > 0 && heads % B.size(1) == 0,
              "selective_state_update: B [batch, groups, N] with groups dividing the ", heads, " heads");
  const int64_t groups = B.size(1), per_group = heads / groups;
  const Rows x_rows = checked_rows(x, batch, heads, p_dim, "selective_state_update: x");
  const Rows b_rows = checked_rows(B, batch, groups, n, "selective_state_update: B");
  const Rows c_rows = checked_rows(C, batch, groups, n, "selective_state_update: C");
  const at::Tensor dt_f = floats(dt, {batch, heads}, "selective_state_update: dt");
  const at::Tensor a_f = floats(A, {heads}, "selective_state_update: A");
  const at::Tensor d_f = floats(D, {heads}, "selective_state_update: D");
  const at::Tensor bias_f = floats(dt_bias, {heads}, "selective_state_update: dt_bias");
  const int64_t* slot = checked_slots(slots, batch, states.size(0), "selective_state_update");
  at::Tensor out = x.new_empty({batch, heads, p_dim});
  const Rows y_rows(out);
  float* cache = states.data_ptr<float>();
  const float *dts = dt_f.data_ptr<float>(), *as = a_f.data_ptr<float>(), *ds = d_f.data_ptr<float>(),
              *biases = bias_f.data_ptr<float>();
  at::parallel_for(0, batch * heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> buffer(2 * p_dim + 2 * n);
    float *xv = buffer.data(), *yv = xv + p_dim, *bv = yv + p_dim, *cv = bv + n;
    int64_t loaded = -1;  // the (batch row, group) whose B and C are in bv, cv
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / heads, h = item % heads, group = h / per_group;
      if (loaded != b * groups + group) {
        b_rows.load(b, group, bv);
        c_rows.load(b, group, cv);
        loaded = b * groups + group;
      }
      x_rows.load(b, h, xv);
      const float step = softplus(dts[item] + biases[h]), decay = std::exp(step * as[h]);
      float* s = cache + (slot[b] * heads + h) * p_dim * n;
      for (int64_t p = 0; p < p_dim; ++p) {
        float* row = s + p * n;
        const float write = xv[p] * step;
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < n; ++i) {
          const float updated = decay * row[i] + write * bv[i];
          row[i] = updated;
          sum += updated * cv[i];
        }
        yv[p] = sum + xv[p] * ds[h];
      }
      y_rows.store(b, h, yv);
    }
  });
  return out;
}

at::Tensor conv1d_update(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                         at::Tensor conv_states, const at::Tensor& slots,
                         c10::optional<c10::string_view> activation) {
  TORCH_CHECK(conv_states.dim() == 3 && conv_states.is_contiguous() && is_float_or_bf16(conv_states),
              "conv1d_update: a contiguous float32 or bfloat16 conv state cache [slots, D, K-1]");
  const int64_t channels = conv_states.size(1), width = conv_states.size(2), batch = x.size(0);
  const bool silu = activation.has_value();
  TORCH_CHECK(!silu || *activation == "silu", "conv1d_update: activation silu or none, not ", *activation);
  const Rows x_rows = checked_rows(x.unsqueeze(1), batch, 1, channels, "conv1d_update: x");
  const at::Tensor w_f = floats(weight, {channels, width + 1}, "conv1d_update: weight");
  at::Tensor bias_f;
  if (bias.has_value() && bias->defined()) bias_f = floats(*bias, {channels}, "conv1d_update: bias");
  const int64_t* slot = checked_slots(slots, batch, conv_states.size(0), "conv1d_update");
  at::Tensor out = x.new_empty({batch, channels});
  const Rows y_rows(out.unsqueeze(1));
  const float* w = w_f.data_ptr<float>();
  const float* b_ptr = bias_f.defined() ? bias_f.data_ptr<float>() : nullptr;
  const bool bf16_state = conv_states.scalar_type() == at::kBFloat16;
  auto* cache = static_cast<uint8_t*>(conv_states.data_ptr());
  const int64_t state_bytes = channels * width * conv_states.element_size();
  at::parallel_for(0, batch, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> buffer(2 * channels);
    float *xv = buffer.data(), *yv = xv + channels;
    for (int64_t b = begin; b < end; ++b) {
      x_rows.load(b, 0, xv);
      uint8_t* state = cache + slot[b] * state_bytes;
      if (bf16_state)
        width == 3 ? conv_sequence<uint16_t, 3>(reinterpret_cast<uint16_t*>(state), width, channels, xv, w, yv)
                   : conv_sequence<uint16_t, 0>(reinterpret_cast<uint16_t*>(state), width, channels, xv, w, yv);
      else
        width == 3 ? conv_sequence<float, 3>(reinterpret_cast<float*>(state), width, channels, xv, w, yv)
                   : conv_sequence<float, 0>(reinterpret_cast<float*>(state), width, channels, xv, w, yv);
      if (b_ptr)
#pragma omp simd
        for (int64_t d = 0; d < channels; ++d) yv[d] += b_ptr[d];
      if (silu)
#pragma omp simd
        for (int64_t d = 0; d < channels; ++d) yv[d] = yv[d] / (1.f + silu_exp(-yv[d]));
      y_rows.store(b, 0, yv);
    }
  });
  return out;
}

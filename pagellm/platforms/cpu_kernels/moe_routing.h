// What the CPU mixture-of-experts kernels share (fused_moe.cpp on float and int8/fp8 panels, gguf_moe.cpp on
// GGUF blocks): the experts' activations and a step's (token, expert) pairs sorted by expert.
#pragma once

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

namespace {

enum Activation { kSilu, kSwigluOai, kGeluTanh };

struct ActParams {
  Activation kind;
  float alpha, limit;
};

inline float sigmoid(float x) { return 1.f / (1.f + std::exp(-x)); }

constexpr float kGeluC = 0.7978845608028654f;  // sqrt(2 / pi)

// The activation of one gate/up pair (core/moe.py `activate`). gelu_tanh's 0.5 (1 + tanh(z)) is written
// as sigmoid(2z), the same function.
inline float activate(float gate, float up, const ActParams& a) {
  switch (a.kind) {
    case kSilu:
      return gate * sigmoid(gate) * up;
    case kGeluTanh:
      return gate * sigmoid(2.f * kGeluC * (gate + 0.044715f * gate * gate * gate)) * up;
    case kSwigluOai: {
      const float g = std::min(gate, a.limit), u = std::min(std::max(up, -a.limit), a.limit);
      return (u + 1.f) * g * sigmoid(a.alpha * g);
    }
  }
  return 0.f;
}

// The step's pairs of one chunk of tokens, sorted by expert (stable: token order within an expert).
struct Routing {
  std::vector<int64_t> token;     // [pairs] the token of sorted pair s
  std::vector<float> weight;      // [pairs] its routing weight
  std::vector<int64_t> position;  // [pairs] sorted position of pair (t, k), t local to the chunk
  std::vector<int64_t> experts, start, count;  // the chosen experts, their first sorted pair and pair count
};

Routing sort_pairs(const int64_t* ids, const float* weights, int64_t tokens, int64_t top_k, int64_t num_experts,
                   const char* op) {
  const int64_t pairs = tokens * top_k;
  std::vector<int64_t> offset(num_experts + 1, 0);
  for (int64_t i = 0; i < pairs; ++i) {
    TORCH_CHECK(ids[i] >= 0 && ids[i] < num_experts, op, ": expert id ", ids[i], " out of range [0, ",
                num_experts, ")");
    ++offset[ids[i] + 1];
  }
  Routing r;
  for (int64_t e = 0; e < num_experts; ++e) {
    if (offset[e + 1] > 0) r.experts.push_back(e), r.start.push_back(offset[e]), r.count.push_back(offset[e + 1]);
    offset[e + 1] += offset[e];
  }
  r.token.resize(pairs), r.weight.resize(pairs), r.position.resize(pairs);
  for (int64_t i = 0; i < pairs; ++i) {
    const int64_t s = offset[ids[i]]++;
    r.token[s] = i / top_k, r.weight[s] = weights[i], r.position[i] = s;
  }
  return r;
}

Activation parse_activation(c10::string_view name, const char* op) {
  const std::string s(name.data(), name.size());
  if (s == "silu") return kSilu;
  if (s == "swiglu_oai") return kSwigluOai;
  if (s == "gelu_pytorch_tanh") return kGeluTanh;
  TORCH_CHECK(false, op, ": unknown activation ", s);
  return kSilu;
}

}  // namespace

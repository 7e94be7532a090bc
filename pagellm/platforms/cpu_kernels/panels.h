// Panel GEMM building blocks shared by the CPU kernels that read weights in 16-column panels
// (fused_moe.cpp's experts, linear_panels.cpp's dense layers): the weight formats, the rows x 16 register
// block over one panel (AVX2+FMA+F16C, or plain C++), and the work split between threads.
//
// A panel is k-major: at each k, 16 weights, one per output column. float32 keeps the columns in order;
// bfloat16 interleaves them (value 2j is column j, 2j + 1 column 8 + j), so that one 256-bit load becomes
// the two 8-float halves by a shift and a mask; int8 and fp8 e4m3fn (weight-only, one byte per weight)
// keep them in order and come with float32 scales per column. Products are summed in float32 in k order.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define PL_PANEL_AVX2 1
#else
#define PL_PANEL_AVX2 0
#endif

namespace {

constexpr int64_t kPanel = 16;  // weight columns per panel (w13: 8 gate + 8 up)
constexpr int64_t kHalf = 8;    // half a panel: one 8-float register
constexpr int kMaxRows = 6;     // rows per register block: 6 x 2 accumulators + 2 weights + 1 broadcast

// The packed weights' element format.
enum Format { kF32, kBf16, kI8, kFp8 };

constexpr int64_t format_bytes(Format f) { return f == kF32 ? 4 : f == kBf16 ? 2 : 1; }
constexpr bool is_quantized(Format f) { return f == kI8 || f == kFp8; }

// An e4m3 panel's sums come out 2^-8 times too small (panel_dot reads each byte as a half with the wrong
// exponent bias), so its scales are multiplied by this once per panel instead of every weight.
constexpr float kFp8Unscale = 256.f;

inline float bf16_to_float(uint16_t v) {
  const uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// Round to nearest even, as torch does; NaN stays NaN.
inline uint16_t float_to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if (std::isnan(f)) return static_cast<uint16_t>((bits >> 16) | 0x40);
  return static_cast<uint16_t>((bits + 0x7fff + ((bits >> 16) & 1)) >> 16);
}

// e4m3fn (sign, 4 exponent bits biased by 7, 3 mantissa bits; subnormals below exponent 1) -> its value
// times 2^-8, as the AVX2 path reads it. NaN (0x7f, 0xff) is not handled: quantized weights never hold it.
inline float fp8_to_float_unscaled(uint8_t v) {
  const int e = (v >> 3) & 0xf, m = v & 7;
  const float mag = e ? std::ldexp(1.f + m / 8.f, e - 7 - 8) : std::ldexp(m / 8.f, -6 - 8);
  return (v & 0x80) ? -mag : mag;
}

// ---- the register block: rows x 16 columns over a whole panel --------------------------------------------
// sums[r][c] = sum_k x[r][k] * panel column c at k, columns in logical order (w13: 8 gate, then 8 up).

// `ahead`, where not null, is the panel the caller reads next (the same size): its lines are prefetched into
// L2 one per k step's worth of bytes, so that panel streams in from memory while this one is multiplied.
// Without it, a panel's first row block waits on memory and its FMAs idle (skinny GEMMs: a decode step's
// experts and linears multiply each panel by few rows).

#if PL_PANEL_AVX2
// The 16 weights of a panel's step i as float32: columns 0-7 in w_lo, 8-15 in w_hi (an int8 or e4m3 panel's
// unscaled).
template <Format kFormat>
inline void load_weights(const void* panel, int64_t i, __m256& w_lo, __m256& w_hi) {
  if constexpr (kFormat == kBf16) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(panel) + i * kPanel));
    w_lo = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
    w_hi = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
  } else if constexpr (kFormat == kI8) {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const int8_t*>(panel) + i * kPanel));
    w_lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v));
    w_hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(v, v)));
  } else if constexpr (kFormat == kFp8) {
    // byte b -> 16 bits b << 8, shifted right arithmetically by 1: the sign in bits 15 and 14, the 7
    // exponent and mantissa bits at 13..7. Clearing bit 14 leaves a half (exponent bias 15, not 7) worth
    // the e4m3 value times 2^-8, subnormals included, which F16C widens exactly.
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint8_t*>(panel) + i * kPanel));
    const __m128i zero = _mm_setzero_si128(), no_bit_14 = _mm_set1_epi16(static_cast<short>(0xbfff));
    w_lo = _mm256_cvtph_ps(_mm_and_si128(_mm_srai_epi16(_mm_unpacklo_epi8(zero, v), 1), no_bit_14));
    w_hi = _mm256_cvtph_ps(_mm_and_si128(_mm_srai_epi16(_mm_unpackhi_epi8(zero, v), 1), no_bit_14));
  } else {
    const float* p = static_cast<const float*>(panel) + i * kPanel;
    w_lo = _mm256_loadu_ps(p);
    w_hi = _mm256_loadu_ps(p + kHalf);
  }
}

template <int kRows, Format kFormat>
inline void panel_dot(const float* const* x, const void* panel, int64_t k, __m256* lo, __m256* hi,
                      const void* ahead = nullptr) {
  constexpr int64_t kStepsPerLine = 64 / (kPanel * format_bytes(kFormat));
  // With one to three rows the FMA chains, not the loads, would set the pace: two sets of accumulators
  // (even and odd k) keep 4-12 chains in flight (a 4-cycle FMA latency at 2 a cycle wants 8).
  constexpr int kSets = kRows <= 3 ? 2 : 1;
  __m256 acc_lo[kSets][kRows], acc_hi[kSets][kRows];
  for (int s = 0; s < kSets; ++s)
    for (int r = 0; r < kRows; ++r) acc_lo[s][r] = _mm256_setzero_ps(), acc_hi[s][r] = _mm256_setzero_ps();
  const char* next = static_cast<const char*>(ahead);
  auto step = [&](int64_t i, int s) {
    if (next && i % kStepsPerLine == 0) _mm_prefetch(next + i * kPanel * format_bytes(kFormat), _MM_HINT_T1);
    __m256 w_lo, w_hi;
    load_weights<kFormat>(panel, i, w_lo, w_hi);
    for (int r = 0; r < kRows; ++r) {
      const __m256 b = _mm256_broadcast_ss(x[r] + i);
      acc_lo[s][r] = _mm256_fmadd_ps(w_lo, b, acc_lo[s][r]);
      acc_hi[s][r] = _mm256_fmadd_ps(w_hi, b, acc_hi[s][r]);
    }
  };
  int64_t i = 0;
  if constexpr (kSets == 2) {
    for (; i + 2 <= k; i += 2) step(i, 0), step(i + 1, 1);
  }
  for (; i < k; ++i) step(i, 0);
  for (int r = 0; r < kRows; ++r) {
    lo[r] = kSets == 2 ? _mm256_add_ps(acc_lo[0][r], acc_lo[kSets - 1][r]) : acc_lo[0][r];
    hi[r] = kSets == 2 ? _mm256_add_ps(acc_hi[0][r], acc_hi[kSets - 1][r]) : acc_hi[0][r];
  }
}

// One x row times kStreams panels at once, from separate places in memory: panel q's 16 sums (unscaled)
// into lo[q], hi[q], each summed exactly as panel_dot<1> sums it (even and odd k apart, added at the end),
// so the bits are the same. One row does two FMAs per 16 weights, and a core reading one stream of panels
// waits on its loads: a decode step's bfloat16 linears read 26-33 GB/s on two cores of an AVX2 AMD EPYC
// (Zen 3) where four streams a core read 38 (a microbenchmark of model S's [3072 x 576] panels; a plain sum
// of the same layout, one stream a core, read 32).
template <int kStreams, Format kFormat>
inline void panel_dot_streams(const float* x, const void* const* panels, int64_t k, __m256* lo, __m256* hi) {
  __m256 acc_lo[kStreams][2], acc_hi[kStreams][2];
  for (int q = 0; q < kStreams; ++q)
    for (int s = 0; s < 2; ++s) acc_lo[q][s] = _mm256_setzero_ps(), acc_hi[q][s] = _mm256_setzero_ps();
  auto step = [&](int64_t i, int s) {
    const __m256 b = _mm256_broadcast_ss(x + i);
    for (int q = 0; q < kStreams; ++q) {
      __m256 w_lo, w_hi;
      load_weights<kFormat>(panels[q], i, w_lo, w_hi);
      acc_lo[q][s] = _mm256_fmadd_ps(w_lo, b, acc_lo[q][s]);
      acc_hi[q][s] = _mm256_fmadd_ps(w_hi, b, acc_hi[q][s]);
    }
  };
  int64_t i = 0;
  for (; i + 2 <= k; i += 2) step(i, 0), step(i + 1, 1);
  for (; i < k; ++i) step(i, 0);
  for (int q = 0; q < kStreams; ++q) {
    lo[q] = _mm256_add_ps(acc_lo[q][0], acc_lo[q][1]);
    hi[q] = _mm256_add_ps(acc_hi[q][0], acc_hi[q][1]);
  }
}

// 8 floats to bfloat16, rounding to nearest even; NaN stays NaN.
inline __m128i vto_bf16(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i rounded = _mm256_add_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(0x7fff)), lsb);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  rounded = _mm256_blendv_epi8(rounded, _mm256_or_si256(bits, _mm256_set1_epi32(0x400000)), nan);
  rounded = _mm256_srli_epi32(rounded, 16);
  return _mm_packus_epi32(_mm256_castsi256_si128(rounded), _mm256_extracti128_si256(rounded, 1));
}
#else
template <int kRows, Format kFormat>
inline void panel_dot(const float* const* x, const void* panel, int64_t k, float (*sums)[kPanel],
                      const void* /*ahead*/ = nullptr) {
  for (int r = 0; r < kRows; ++r)
    for (int64_t c = 0; c < kPanel; ++c) sums[r][c] = 0.f;
  for (int64_t i = 0; i < k; ++i) {
    float w[kPanel];
    for (int64_t j = 0; j < kHalf; ++j) {
      if constexpr (kFormat == kBf16) {
        const uint16_t* p = static_cast<const uint16_t*>(panel) + i * kPanel;
        w[j] = bf16_to_float(p[2 * j]), w[kHalf + j] = bf16_to_float(p[2 * j + 1]);
      } else if constexpr (kFormat == kI8) {
        const int8_t* p = static_cast<const int8_t*>(panel) + i * kPanel;
        w[j] = p[j], w[kHalf + j] = p[kHalf + j];
      } else if constexpr (kFormat == kFp8) {
        const uint8_t* p = static_cast<const uint8_t*>(panel) + i * kPanel;
        w[j] = fp8_to_float_unscaled(p[j]), w[kHalf + j] = fp8_to_float_unscaled(p[kHalf + j]);
      } else {
        const float* p = static_cast<const float*>(panel) + i * kPanel;
        w[j] = p[j], w[kHalf + j] = p[kHalf + j];
      }
    }
    for (int r = 0; r < kRows; ++r) {
      const float xv = x[r][i];
      for (int64_t c = 0; c < kPanel; ++c) sums[r][c] += w[c] * xv;
    }
  }
}
#endif

// The column scales of a quantized panel (16 floats: the first 8 columns, then the other 8), with e4m3's
// 2^8 folded in; 1 for float panels.
template <Format kFormat>
inline float column_scale(const float* scale, int64_t c) {
  if constexpr (!is_quantized(kFormat)) return 1.f;
  return kFormat == kFp8 ? scale[c] * kFp8Unscale : scale[c];
}

#if PL_PANEL_AVX2
// sums[r] *= the 8 column scales at `scale` (nothing for float panels).
template <int kRows, Format kFormat>
inline void apply_scale(__m256* sums, const float* scale) {
  if constexpr (is_quantized(kFormat)) {
    __m256 s = _mm256_loadu_ps(scale);
    if constexpr (kFormat == kFp8) s = _mm256_mul_ps(s, _mm256_set1_ps(kFp8Unscale));
    for (int r = 0; r < kRows; ++r) sums[r] = _mm256_mul_ps(sums[r], s);
  }
}
#endif

// The rows of the next register block when `left` rows remain: as many blocks as kMaxRows-row ones would
// take, of equal size (8 rows -> 4 + 4, not 6 + 2): a block of one or two rows does 2-4 FMAs per weight
// load, so the panel it re-reads from cache costs about what a full block would.
inline int block_rows(int64_t left) {
  const int64_t blocks = (left + kMaxRows - 1) / kMaxRows;
  return static_cast<int>((left + blocks - 1) / blocks);
}

// Calls block<rows>(...) for a run-time row count in 1..kMaxRows.
template <template <int> class Block, typename... Args>
void dispatch_rows(int rows, Args&&... args) {
  switch (rows) {
    case 1: return Block<1>::run(args...);
    case 2: return Block<2>::run(args...);
    case 3: return Block<3>::run(args...);
    case 4: return Block<4>::run(args...);
    case 5: return Block<5>::run(args...);
    default: return Block<6>::run(args...);
  }
}

// Runs fn(first, last) once per thread over [0, n) split into equal contiguous runs.
template <typename Fn>
void parallel_runs(int64_t n, Fn fn) {
  if (n == 0) return;
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), n);
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) fn(n * t / threads, n * (t + 1) / threads);
  });
}

// Runs fn(i) for i in [0, n), the items split into one contiguous run per thread of about equal total
// cost (cost(i) >= 1), so each thread reads its items' weights in order and none waits for a heavy expert.
template <typename Cost, typename Fn>
void parallel_balanced(int64_t n, Cost cost, Fn fn) {
  if (n == 0) return;
  std::vector<int64_t> prefix(n + 1, 0);
  for (int64_t i = 0; i < n; ++i) prefix[i + 1] = prefix[i] + cost(i);
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), n), total = prefix[n];
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const auto first = std::lower_bound(prefix.begin(), prefix.end(), total * t / threads) - prefix.begin();
      const auto last = std::lower_bound(prefix.begin(), prefix.end(), total * (t + 1) / threads) - prefix.begin();
      for (int64_t i = first; i < last; ++i) fn(i);
    }
  });
}

}  // namespace

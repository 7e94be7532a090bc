// Paged attention for CPUs that reads K/V in place through the block table.
//
// One work item is (request, KV head, block of query tokens, context partition): it loads each cached key
// and value once for the block's query tokens and all query heads of the KV head's group (GQA), computes
// float32 scores, a softmax over its partition and the weighted sum of values. A decode is one block; a
// prefill chunk's tokens are split into blocks of at most 16 query rows (one AMX tile), which the threads
// claim one at a time. Long contexts are split into partitions (flash-decoding) so that both cores
// stay busy at small batch; a second pass merges the partitions with their maxima and sums. Built at run
// time with -march=native (see __init__.py): the AVX-512 path, the AVX2 path or plain C++ is chosen by
// what the compiler may use on this CPU. On CPUs with AMX, bfloat16 work
// multiplies tiles instead (scores and values as tile products; see "AMX" below); on AVX-512 BF16 without
// them a prefill chunk's scores are taken a tile of 16 keys at a time, the tile turned into bfloat16 pairs
// once for all the block's query rows (`tile_scores`).
//
// Cache layouts: k_cache, v_cache [num_kv_heads, num_blocks, block_size, head_size] of
//   kind 0: float32, 1: bfloat16, 2: float16, 3: fp8 e4m3fn, 4: fp8 e5m2 (uint8 storage for both fp8),
//   5: int8, whose rows are head_size + 4 bytes: the values, then their float32 scale (x = value * scale).
//   The key scale multiplies the score; the value scale is folded into the softmax weight.
//
// Per layer, optionally: a logit soft-cap (score = cap * tanh(score / cap), after the scale and before the
// masks: one extra pass over a work item's scores, so specs without it run exactly the code they ran
// before), and attention sinks (one float32 logit per query head that joins the softmax denominator and
// adds no value: applied when a row's output is normalised, once per row, after all its partitions).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "kernels.h"
#include "avx512_helpers.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#define PL_AVX512 1
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define PL_AMX_ATTN 1
#include "amx_tiles.h"
#endif
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define PL_AVX2 1
#endif

namespace {

enum CacheKind : int64_t { F32 = 0, BF16 = 1, F16 = 2, E4M3 = 3, E5M2 = 4, I8 = 5 };

// ---- scalar conversions (tails and the plain C++ build) ----------------------------------------------

inline float bits_to_float(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline float half_to_float(uint16_t h) {
  uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ffu;
  if (exp == 0) {  // zero or subnormal
    float v = std::ldexp(static_cast<float>(mant), -24);
    return sign ? -v : v;
  }
  if (exp == 31) return bits_to_float(sign | 0x7f800000u | (mant << 13));
  return bits_to_float(sign | ((exp + 112) << 23) | (mant << 13));
}

// e4m3fn's seven exponent-and-mantissa bits placed at float16 bits 13..7 give 2^(e-15) * 1.m (or a
// float16 subnormal for e = 0); multiplying by 2^8 moves the bias from 15 to 7. Exact for every finite
// value, and through float16 rather than float32 so that no float32 subnormal (slow on x86) appears.
constexpr float E4M3_SCALE = 256.f;

inline uint16_t e4m3_to_half_bits(uint32_t b) { return uint16_t(((b & 0x80u) << 8) | ((b & 0x7fu) << 7)); }

template <int64_t K>
inline float load_scalar(const void* base, int64_t i) {
  if constexpr (K == F32) return static_cast<const float*>(base)[i];
  if constexpr (K == BF16) return bits_to_float(uint32_t(static_cast<const uint16_t*>(base)[i]) << 16);
  if constexpr (K == F16) return half_to_float(static_cast<const uint16_t*>(base)[i]);
  if constexpr (K == E4M3) {
    return half_to_float(e4m3_to_half_bits(static_cast<const uint8_t*>(base)[i])) * E4M3_SCALE;
  }
  if constexpr (K == E5M2) return half_to_float(uint16_t(static_cast<const uint8_t*>(base)[i]) << 8);
  if constexpr (K == I8) return static_cast<float>(static_cast<const int8_t*>(base)[i]);
  return 0.f;
}

// ---- vector conversions: W floats at a time ----------------------------------------------------------

#if PL_AVX512
constexpr int W = 16;
using vec = __m512;
inline vec vzero() { return _mm512_setzero_ps(); }
inline vec vset1(float x) { return _mm512_set1_ps(x); }
inline vec vfma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
inline vec vmul(vec a, vec b) { return _mm512_mul_ps(a, b); }
inline float vsum(vec a) { return _mm512_reduce_add_ps(a); }
inline vec vsub(vec a, vec b) { return _mm512_sub_ps(a, b); }
inline vec vadd(vec a, vec b) { return _mm512_add_ps(a, b); }
inline vec vloadf(const float* p) { return _mm512_loadu_ps(p); }
inline void vstoref(float* p, vec a) { _mm512_storeu_ps(p, a); }
template <int64_t K>
inline vec vload(const void* base, int64_t i) {
  if constexpr (K == F32) return _mm512_loadu_ps(static_cast<const float*>(base) + i);
  if constexpr (K == BF16) {
    __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(base) + i));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  if constexpr (K == F16)
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(base) + i)));
  if constexpr (K == E4M3) {
    __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint8_t*>(base) + i)));
    __m256i sign = _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8);
    __m256i rest = _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x7f)), 7);
    return _mm512_mul_ps(_mm512_cvtph_ps(_mm256_or_si256(sign, rest)), _mm512_set1_ps(E4M3_SCALE));
  }
  if constexpr (K == E5M2) {
    __m256i h = _mm256_slli_epi16(_mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint8_t*>(base) + i))), 8);
    return _mm512_cvtph_ps(h);
  }
  if constexpr (K == I8)
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const int8_t*>(base) + i))));
  return _mm512_setzero_ps();
}
#elif PL_AVX2
constexpr int W = 8;
using vec = __m256;
inline vec vzero() { return _mm256_setzero_ps(); }
inline vec vset1(float x) { return _mm256_set1_ps(x); }
inline vec vfma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
inline vec vmul(vec a, vec b) { return _mm256_mul_ps(a, b); }
inline float vsum(vec a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline vec vloadf(const float* p) { return _mm256_loadu_ps(p); }
inline vec vsub(vec a, vec b) { return _mm256_sub_ps(a, b); }
inline vec vadd(vec a, vec b) { return _mm256_add_ps(a, b); }
inline void vstoref(float* p, vec a) { _mm256_storeu_ps(p, a); }
template <int64_t K>
inline vec vload(const void* base, int64_t i) {
  if constexpr (K == F32) return _mm256_loadu_ps(static_cast<const float*>(base) + i);
  if constexpr (K == BF16) {
    __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(base) + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  if constexpr (K == F16)
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(base) + i)));
  if constexpr (K == E4M3) {
    __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(static_cast<const uint8_t*>(base) + i)));
    __m128i sign = _mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x80)), 8);
    __m128i rest = _mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x7f)), 7);
    return _mm256_mul_ps(_mm256_cvtph_ps(_mm_or_si128(sign, rest)), _mm256_set1_ps(E4M3_SCALE));
  }
  if constexpr (K == E5M2) {
    __m128i h = _mm_slli_epi16(_mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(static_cast<const uint8_t*>(base) + i))), 8);
    return _mm256_cvtph_ps(h);
  }
  if constexpr (K == I8)
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(static_cast<const int8_t*>(base) + i))));
  return _mm256_setzero_ps();
}
#else
constexpr int W = 0;  // plain C++: every element goes through the scalar tail
#endif

#if PL_AVX512 || PL_AVX2
// e^x for x <= ~88 (softmax arguments are <= 0), exact 0 for -inf; relative error ~1e-7
inline vec vexp(vec x) {
  const vec log2e = vset1(1.44269504088896341f), ln2_hi = vset1(0.693359375f), ln2_lo = vset1(-2.12194440e-4f);
#if PL_AVX512
  const __mmask16 dead = _mm512_cmp_ps_mask(x, vset1(-87.0f), _CMP_LT_OQ);
  x = _mm512_max_ps(x, vset1(-87.0f));
  vec n = _mm512_roundscale_ps(vmul(x, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  vec r = _mm512_fnmadd_ps(n, ln2_hi, x);
  r = _mm512_fnmadd_ps(n, ln2_lo, r);
#else
  const vec dead = _mm256_cmp_ps(x, vset1(-87.0f), _CMP_LT_OQ);
  x = _mm256_max_ps(x, vset1(-87.0f));
  vec n = _mm256_round_ps(vmul(x, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  vec r = _mm256_fnmadd_ps(n, ln2_hi, x);
  r = _mm256_fnmadd_ps(n, ln2_lo, r);
#endif
  vec p = vset1(1.f / 720);
  p = vfma(p, r, vset1(1.f / 120));
  p = vfma(p, r, vset1(1.f / 24));
  p = vfma(p, r, vset1(1.f / 6));
  p = vfma(p, r, vset1(0.5f));
  p = vfma(p, r, vset1(1.f));
  p = vfma(p, r, vset1(1.f));
#if PL_AVX512
  return _mm512_maskz_mov_ps(static_cast<__mmask16>(~dead), _mm512_scalef_ps(p, n));
#else
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(dead, vmul(p, _mm256_castsi256_ps(e)));
#endif
}
#endif

#if PL_AVX512 || PL_AVX2
// cap * tanh(x / cap), `inv_cap` = 1 / cap. tanh(a) for a = |x / cap|: below 0.55 its Taylor series to a^15
// (truncation < 5e-8 relative), above 1 - 2 / (e^(2a) + 1) (cancellation-free there: tanh >= 0.5), with a
// capped at 9, where tanh is 1 in float32 (and e^(2a) stays finite for the AVX2 exponent trick); the sign
// put back.
inline vec vsoftcap(vec x, vec cap, vec inv_cap) {
  const vec t = vmul(x, inv_cap);
#if PL_AVX512
  const __m512i sign_bit = _mm512_set1_epi32(int(0x80000000u));
  const vec a = _mm512_min_ps(_mm512_abs_ps(t), vset1(9.f));
  const __mmask16 small = _mm512_cmp_ps_mask(a, vset1(0.55f), _CMP_LT_OQ);
#else
  const vec sign_bit = vset1(-0.f);
  const vec a = _mm256_min_ps(_mm256_andnot_ps(sign_bit, t), vset1(9.f));
  const vec small = _mm256_cmp_ps(a, vset1(0.55f), _CMP_LT_OQ);
#endif
  const vec a2 = vmul(a, a);
  vec p = vset1(-929569.f / 638512875.f);
  p = vfma(p, a2, vset1(21844.f / 6081075.f));
  p = vfma(p, a2, vset1(-1382.f / 155925.f));
  p = vfma(p, a2, vset1(62.f / 2835.f));
  p = vfma(p, a2, vset1(-17.f / 315.f));
  p = vfma(p, a2, vset1(2.f / 15.f));
  p = vfma(p, a2, vset1(-1.f / 3.f));
  p = vfma(p, a2, vset1(1.f));
  const vec near = vmul(p, a);
  const vec e = vexp(vadd(a, a));
#if PL_AVX512
  const vec far = _mm512_sub_ps(vset1(1.f), _mm512_div_ps(vset1(2.f), _mm512_add_ps(e, vset1(1.f))));
  const vec r = _mm512_mask_blend_ps(small, far, near);
  const __m512i signed_r = _mm512_or_si512(_mm512_castps_si512(r), _mm512_and_si512(_mm512_castps_si512(t), sign_bit));
  return vmul(_mm512_castsi512_ps(signed_r), cap);
#else
  const vec far = _mm256_sub_ps(vset1(1.f), _mm256_div_ps(vset1(2.f), _mm256_add_ps(e, vset1(1.f))));
  const vec r = _mm256_blendv_ps(far, near, small);
  return vmul(_mm256_or_ps(r, _mm256_and_ps(t, sign_bit)), cap);
#endif
}
#endif

// scores[0 .. n) = cap * tanh(scores / cap)
inline void soft_cap_scores(float* scores, int64_t n, float cap) {
  const float inv_cap = 1.f / cap;
  int64_t i = 0;
#if PL_AVX512 || PL_AVX2
  const vec vcap = vset1(cap), vinv = vset1(inv_cap);
  for (; i + W <= n; i += W) vstoref(scores + i, vsoftcap(vloadf(scores + i), vcap, vinv));
#endif
  for (; i < n; ++i) scores[i] = cap * std::tanh(scores[i] * inv_cap);
}

#if PL_AVX512 || PL_AVX2
// Blocks sit anywhere in memory, so the hardware prefetcher cannot see the next one coming: the score
// passes fetch the keys of a tile ahead into L1 and its values into L2 for the value pass.
constexpr int64_t PREFETCH_AHEAD = 32;  // tokens: two tiles ahead hides more of the memory latency than one
// The thread's next work item's keys asked for into L2 at the end of this item's scores, all of them up to
// this many bytes (half of Zen 3's 512 KiB L2): its softmax and values leave the memory idle, and the next
// item's scores then start from L2 (the AMX path spreads the same over its values pass). 16 requests x 400
// tokens of model S's heads, 30 layers' caches, AMD EPYC Zen 4: ~300 -> ~265 us a layer against its first
// 32 tokens only, at 1,000 tokens 763-1032 -> 585-616 us (the AVX2 build there: 386-469 -> 311-404 and
// 907-1058 -> 732-1014 us); W1 (model S bf16) 941-962 -> 1036-1065 total tok/s, alternated.
constexpr int64_t kNextItemBytes = 256 << 10;

template <int64_t K>
constexpr int64_t elem_size() { return K == F32 ? 4 : (K == BF16 || K == F16) ? 2 : 1; }

template <int Hint>
inline void prefetch_row(const void* base, int64_t at, int64_t bytes, int64_t elem) {
  const char* p = static_cast<const char*>(base) + at * elem;
  for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(p + b, static_cast<_mm_hint>(Hint));
}
#endif

#if PL_AVX2
// lane i of the result = the sum of the 8 lanes of a[i]
inline __m256 reduce8(const __m256* a) {
  const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
  // per 128-bit half: the sums of a[0..3] (u0) and a[4..7] (u1) over that half's four lanes
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// the 8 unreduced partial products of q and one cached row (head_size a multiple of 8)
template <int64_t K>
inline __m256 partial_dot8(const float* q, const void* cache, int64_t at, int64_t d) {
  __m256 acc = _mm256_setzero_ps();
  for (int64_t i = 0; i < d; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), vload<K>(cache, at + i), acc);
  return acc;
}

#endif

#if PL_AVX512
// lane i of the result = the sum of the 16 lanes of a[i]: 16 horizontal sums in 45 instructions
inline __m512 reduce16(const __m512* a) {
  __m512 x[8], y[4], z[2];
  for (int i = 0; i < 8; ++i)
    x[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)
    y[i] = _mm512_add_ps(_mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i)
    z[i] = _mm512_add_ps(_mm512_shuffle_ps(y[2 * i], y[2 * i + 1], 0x88), _mm512_shuffle_ps(y[2 * i], y[2 * i + 1], 0xDD));
  __m512 w = _mm512_add_ps(_mm512_shuffle_ps(z[0], z[1], 0x88), _mm512_shuffle_ps(z[0], z[1], 0xDD));
  // w holds tokens 0 4 8 12 1 5 9 13 2 6 10 14 3 7 11 15
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), w);
}

// the 16 unreduced partial products of q and one cached row (head_size a multiple of 16)
template <int64_t K>
inline __m512 partial_dot(const float* q, const void* cache, int64_t at, int64_t d) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t i = 0; i < d; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + i), vload<K>(cache, at + i), acc);
  return acc;
}

#if defined(__AVX512BF16__)
// bfloat16 query and cache: the products of pairs in one instruction (head_size a multiple of 32)
inline __m512 partial_dot_bf16(const __m512bh* q, const void* cache, int64_t at, int64_t d) {
  __m512 acc = _mm512_setzero_ps();
  const uint16_t* row = static_cast<const uint16_t*>(cache) + at;
  for (int64_t i = 0; i < d; i += 32)
    acc = _mm512_dpbf16_ps(acc, q[i / 32], (__m512bh)_mm512_loadu_si512(row + i));
  return acc;
}

// the 16 tokens' partial products for head size NQ * 32, fully unrolled with the query in registers
template <int NQ>
inline void partial_dots16_bf16(const __m512bh* q, const void* cache, const int64_t* at, __m512* part) {
  __m512bh qv[NQ];
  for (int c = 0; c < NQ; ++c) qv[c] = q[c];
  const uint16_t* base = static_cast<const uint16_t*>(cache);
  for (int i = 0; i < 16; ++i) {
    __m512 acc = _mm512_dpbf16_ps(_mm512_setzero_ps(), qv[0], (__m512bh)_mm512_loadu_si512(base + at[i]));
    for (int c = 1; c < NQ; ++c)
      acc = _mm512_dpbf16_ps(acc, qv[c], (__m512bh)_mm512_loadu_si512(base + at[i] + 32 * c));
    part[i] = acc;
  }
}

inline void partial_dots16_bf16(const __m512bh* q, const void* cache, const int64_t* at, int64_t d, __m512* part) {
  if (d == 64) return partial_dots16_bf16<2>(q, cache, at, part);
  if (d == 128) return partial_dots16_bf16<4>(q, cache, at, part);
  for (int i = 0; i < 16; ++i) part[i] = partial_dot_bf16(q, cache, at[i], d);
}
#endif
#endif

// dot(q, row) over d elements: q is float32, row is `d` elements of the cache starting at element `at`.
template <int64_t K>
inline float dot(const float* q, const void* cache, int64_t at, int64_t d) {
  float s = 0.f;
  int64_t i = 0;
#if PL_AVX512 || PL_AVX2
  vec acc = vzero();
  for (; i + W <= d; i += W) acc = vfma(vloadf(q + i), vload<K>(cache, at + i), acc);
  s = vsum(acc);
#endif
  for (; i < d; ++i) s += q[i] * load_scalar<K>(cache, at + i);
  return s;
}

// the float32 scale stored after an int8 row's d values
inline float row_scale(const void* cache, int64_t at, int64_t d) {
  float s;
  std::memcpy(&s, static_cast<const uint8_t*>(cache) + at + d, 4);
  return s;
}

// element `flat` of the query as float32 (the dtype checked once, not per element)
struct QueryReader {
  at::ScalarType type;
  const void* data;
  explicit QueryReader(const at::Tensor& q) : type(q.scalar_type()), data(q.data_ptr()) {
    TORCH_CHECK(type == at::kFloat || type == at::kBFloat16 || type == at::kHalf, "q must be float32, bfloat16 or float16");
  }
  // elements [flat, flat + n) into dst: a loop the compiler vectorises for bfloat16 and float32
  void row(int64_t flat, int64_t n, float* dst) const {
    if (type == at::kBFloat16) {
      const uint16_t* src = static_cast<const uint16_t*>(data) + flat;
      for (int64_t e = 0; e < n; ++e) dst[e] = bits_to_float(uint32_t(src[e]) << 16);
    } else if (type == at::kFloat) {
      std::memcpy(dst, static_cast<const float*>(data) + flat, n * sizeof(float));
    } else {
      for (int64_t e = 0; e < n; ++e) dst[e] = (*this)(flat + e);
    }
  }
  float operator()(int64_t flat) const {
    if (type == at::kBFloat16) return bits_to_float(uint32_t(static_cast<const uint16_t*>(data)[flat]) << 16);
    if (type == at::kHalf) return half_to_float(static_cast<const uint16_t*>(data)[flat]);
    return static_cast<const float*>(data)[flat];
  }
};

struct Problem {
  int64_t num_heads, num_kv, head_size, group, block_size, num_blocks, max_blocks;
  int64_t row;  // elements per cached row: head_size, or head_size + 4 (int8 values and their scale)
  int64_t window;  // 0: none
  float scale;
  float soft_cap = 0.f;           // 0: none
  const float* sinks = nullptr;   // [num_heads] float32 logits; null: none
  const int32_t* block_tables;
  const int32_t* seq_lens;
  const int32_t* query_start;
  const int32_t* reqs;
  const void* k;
  const void* v;
  bool amx = false;  // the AMX path may run (this build and CPU have it, and the OS granted it)
  bool fixed_order = false;  // batch-invariant: the portable path only (see paged_attention)
};

// Where a work item's keys are: its request's block table, its KV head and its context range.
struct ItemKeys {
  const int32_t* table = nullptr;  // null: no such item
  int64_t r = 0, h = 0;            // request, KV head
  int64_t first = 0, count = 1;    // its query tokens: [first, first + count) of the request's
  bool chunk = false;              // its request's query is a prefill chunk (more than one token)
  int64_t len = 0;                 // the last of them sits at position len - 1
  int64_t head_base = 0, lo = 0, hi = 0;
  int64_t offset(const Problem& P, int64_t t) const {
    return head_base + (int64_t(table[t / P.block_size]) * P.block_size + t % P.block_size) * P.row;
  }
};


#if PL_AVX512
// row_acc[row] = sum over positions i of p[row][i] * V[i] for query rows row0 .. row0 + R - 1 (those below
// `rows`), head size CH * 16: the R x CH accumulators stay in registers, each value row is loaded and
// widened once for all R rows, and positions no row sees (p = 0 for all) are skipped.
template <int64_t K, int CH, int R>
void accumulate_values(const Problem& P, const float* scores, int64_t width, const int64_t* offsets, int64_t row0,
                       int64_t rows, float* row_acc) {
  __m512 acc[R][CH];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < CH; ++c) acc[r][c] = _mm512_setzero_ps();
  const float* s[R];
  for (int r = 0; r < R; ++r) s[r] = row0 + r < rows ? scores + (row0 + r) * width : nullptr;
  for (int64_t i = 0; i < width; ++i) {
    float p[R];
    bool any = false;
    for (int r = 0; r < R; ++r) {
      p[r] = s[r] ? s[r][i] : 0.f;
      any |= p[r] != 0.f;
    }
    if (!any) continue;
    __m512 v[CH];
    for (int c = 0; c < CH; ++c) v[c] = vload<K>(P.v, offsets[i] + c * 16);
    for (int r = 0; r < R; ++r) {
      const __m512 pv = _mm512_set1_ps(p[r]);
      for (int c = 0; c < CH; ++c) acc[r][c] = _mm512_fmadd_ps(pv, v[c], acc[r][c]);
    }
  }
  for (int r = 0; r < R && row0 + r < rows; ++r)
    for (int c = 0; c < CH; ++c) _mm512_storeu_ps(row_acc + (row0 + r) * CH * 16 + c * 16, acc[r][c]);
}
#endif

#if PL_AVX2
// The scores of 8 keys for all `rows` query rows (head size a multiple of 64), scaled, into
// scores[row * stride + 0..8): each key is widened once, 64 elements (8 registers) at a time, for every row,
// where a row-at-a-time tile widens it once per row (a GQA group of 7 rows: a seventh of the widening);
// each row's 8 partial sums of each key wait in `part` ([rows][8 keys][8 lanes]) for one reduce8 per row.
template <int64_t K>
void key_tile_scores8(const float* qf, int64_t rows, const void* cache, const int64_t* at, int64_t d, float scale,
                      float* scores, int64_t stride, float* part) {
  for (int i = 0; i < 8; ++i) {
    for (int64_t e = 0; e < d; e += 64) {
      __m256 kc[8];
      for (int c = 0; c < 8; ++c) kc[c] = vload<K>(cache, at[i] + e + c * 8);
      for (int64_t r = 0; r < rows; ++r) {
        const float* q = qf + r * d + e;
        __m256 a = _mm256_mul_ps(_mm256_loadu_ps(q), kc[0]), b = _mm256_mul_ps(_mm256_loadu_ps(q + 8), kc[1]);
        for (int c = 2; c < 8; c += 2) {
          a = _mm256_fmadd_ps(_mm256_loadu_ps(q + c * 8), kc[c], a);
          b = _mm256_fmadd_ps(_mm256_loadu_ps(q + c * 8 + 8), kc[c + 1], b);
        }
        float* dst = part + (r * 8 + i) * 8;
        a = _mm256_add_ps(a, b);
        _mm256_storeu_ps(dst, e ? _mm256_add_ps(a, _mm256_loadu_ps(dst)) : a);
      }
    }
  }
  const __m256 vscale = _mm256_set1_ps(scale);
  for (int64_t r = 0; r < rows; ++r) {
    __m256 v[8];
    for (int i = 0; i < 8; ++i) v[i] = _mm256_loadu_ps(part + (r * 8 + i) * 8);
    _mm256_storeu_ps(scores + r * stride, _mm256_mul_ps(reduce8(v), vscale));
  }
}

// row_acc[row0 + r] = sum over positions i of p[r][i] * V[i] for R query rows, 16 columns at a time: the
// R x 16 accumulators stay in registers, each value row's 16 columns are loaded and widened once for the R
// rows (a bfloat16 row of 64 is two cache lines: a pass reads half of one, the next pass the other half
// from L1). Only positions [begin, end) are read, those some row sees: a value row's products with a
// weight of 0 add nothing (cached values are finite), and a check per position measured ~10% of the
// loop. Each element sums its products in position order, as the portable loop does.
template <int64_t K, int R>
void accumulate_values8(const Problem& P, const float* scores, int64_t width, const int64_t* offsets, int64_t row0,
                        int64_t begin, int64_t end, float* row_acc) {
  const int64_t d = P.head_size;
  const float* s[R];
  for (int r = 0; r < R; ++r) s[r] = scores + (row0 + r) * width;
  for (int64_t c0 = 0; c0 < d; c0 += 16) {
    __m256 acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = _mm256_setzero_ps(), acc[r][1] = _mm256_setzero_ps();
    for (int64_t i = begin; i < end; ++i) {
      const __m256 v0 = vload<K>(P.v, offsets[i] + c0), v1 = vload<K>(P.v, offsets[i] + c0 + 8);
      for (int r = 0; r < R; ++r) {
        const __m256 pv = _mm256_broadcast_ss(s[r] + i);
        acc[r][0] = _mm256_fmadd_ps(pv, v0, acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(pv, v1, acc[r][1]);
      }
    }
    for (int r = 0; r < R; ++r) {
      _mm256_storeu_ps(row_acc + (row0 + r) * d + c0, acc[r][0]);
      _mm256_storeu_ps(row_acc + (row0 + r) * d + c0 + 8, acc[r][1]);
    }
  }
}
#endif

#if PL_AVX512 && defined(__AVX512BF16__)
// The same sum with bfloat16 weights and values: pairs of positions go through one dot-product
// instruction (two rows of V interleaved, the two weights broadcast as a pair), a third of the
// instructions of the float32 path. For bfloat16 caches and outputs only: the weights are rounded to
// bfloat16 (relative 2^-9, the output's own precision), the sums stay float32. (Widening one-byte caches
// to bfloat16 on the way measured slower than their float32 path.) `pw` holds each row's weights as
// bfloat16, `width` rounded up to even, zero-padded.
template <int CH, int R>
void accumulate_values_pairs(const Problem& P, const uint16_t* pw, int64_t pw_stride, int64_t width,
                             const int64_t* offsets, int64_t row0, float* row_acc) {
  __m512 acc[R][2 * CH];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 2 * CH; ++c) acc[r][c] = _mm512_setzero_ps();
  const uint16_t* v = static_cast<const uint16_t*>(P.v);
  for (int64_t i = 0; i < width; i += 2) {
    const bool two = i + 1 < width;
    __m512i w[R];
    for (int r = 0; r < R; ++r) {
      uint32_t pair;
      std::memcpy(&pair, pw + (row0 + r) * pw_stride + i, 4);
      w[r] = _mm512_set1_epi32(static_cast<int>(pair));
    }
    for (int c = 0; c < CH; ++c) {
      const __m512i x = _mm512_loadu_si512(v + offsets[i] + c * 32);
      const __m512i y = two ? _mm512_loadu_si512(v + offsets[i + 1] + c * 32) : _mm512_setzero_si512();
      // per 128-bit lane L: lo pairs elements 8L..8L+3 of the two rows, hi elements 8L+4..8L+7
      const __m512bh lo = (__m512bh)_mm512_unpacklo_epi16(x, y), hi = (__m512bh)_mm512_unpackhi_epi16(x, y);
      for (int r = 0; r < R; ++r) {
        acc[r][2 * c] = _mm512_dpbf16_ps(acc[r][2 * c], lo, (__m512bh)w[r]);
        acc[r][2 * c + 1] = _mm512_dpbf16_ps(acc[r][2 * c + 1], hi, (__m512bh)w[r]);
      }
    }
  }
  alignas(64) float lo[16], hi[16];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < CH; ++c) {
      _mm512_store_ps(lo, acc[r][2 * c]);
      _mm512_store_ps(hi, acc[r][2 * c + 1]);
      float* dst = row_acc + (row0 + r) * CH * 32 + c * 32;
      for (int L = 0; L < 4; ++L)
        for (int j = 0; j < 4; ++j) dst[8 * L + j] = lo[4 * L + j], dst[8 * L + 4 + j] = hi[4 * L + j];
    }
}

// out[r * stride + 0..16) = scale * (query row r . the tile's 16 keys) for R query rows (bfloat16 pairs,
// `pairs` a row), each score summed over the pairs in order
template <int R>
inline void pair_tile_scores(const uint32_t* q, int64_t pairs, const __m512i* kt, __m512 scale, float* out,
                             int64_t stride) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    const __m512bh keys = (__m512bh)kt[p];
    for (int r = 0; r < R; ++r)
      acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_set1_epi32(static_cast<int>(q[r * pairs + p])), keys);
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * stride, _mm512_mul_ps(acc[r], scale));
}

// A prefill block's scores against one tile of 16 keys: the tile turned into pairs once, then every query
// row 8 at a time (8 sums in registers a pass). Where a row-at-a-time dot product summed each key's
// products in 16 lanes and then across them, a block of 15 rows spent most of its time in those sums.
inline void tile_scores(const uint16_t* qb, int64_t rows, int64_t d, const uint16_t* k, const int64_t* at,
                        __m512 scale, float* out, int64_t stride) {
  alignas(64) __m512i kt[64];  // head size up to 128
  keys_as_pairs(k, at, d, kt);
  const auto* q = reinterpret_cast<const uint32_t*>(qb);
  const int64_t pairs = d / 2;
  for (int64_t row0 = 0; row0 < rows; row0 += 8) {
    const uint32_t* qr = q + row0 * pairs;
    float* o = out + row0 * stride;
    switch (std::min<int64_t>(8, rows - row0)) {
      case 1: pair_tile_scores<1>(qr, pairs, kt, scale, o, stride); break;
      case 2: pair_tile_scores<2>(qr, pairs, kt, scale, o, stride); break;
      case 3: pair_tile_scores<3>(qr, pairs, kt, scale, o, stride); break;
      case 4: pair_tile_scores<4>(qr, pairs, kt, scale, o, stride); break;
      case 5: pair_tile_scores<5>(qr, pairs, kt, scale, o, stride); break;
      case 6: pair_tile_scores<6>(qr, pairs, kt, scale, o, stride); break;
      case 7: pair_tile_scores<7>(qr, pairs, kt, scale, o, stride); break;
      default: pair_tile_scores<8>(qr, pairs, kt, scale, o, stride); break;
    }
  }
}

template <int CH, int RMAX>
void accumulate_rows_pairs(const Problem& P, const float* scores, int64_t width, const int64_t* offsets,
                           int64_t rows, float* row_acc, std::vector<uint16_t>& pw) {
  const int64_t stride = (width + 1) & ~int64_t(1);
  pw.assign(rows * stride, 0);
  for (int64_t row = 0; row < rows; ++row) {
    int64_t i = 0;
    for (; i + 16 <= width; i += 16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(pw.data() + row * stride + i),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(scores + row * width + i)));
    for (; i < width; ++i) {  // round to nearest even, as the instruction does (weights are finite)
      uint32_t bits;
      std::memcpy(&bits, scores + row * width + i, 4);
      pw[row * stride + i] = uint16_t((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
    }
  }
  for (int64_t row0 = 0; row0 < rows;) {
    const int64_t left = rows - row0;
    if (RMAX >= 4 && left >= 4) {
      accumulate_values_pairs<CH, (RMAX >= 4 ? 4 : 1)>(P, pw.data(), stride, width, offsets, row0, row_acc), row0 += 4;
    } else if (left >= 3 && RMAX >= 3) {
      accumulate_values_pairs<CH, (RMAX >= 3 ? 3 : 1)>(P, pw.data(), stride, width, offsets, row0, row_acc), row0 += 3;
    } else if (left >= 2) {
      accumulate_values_pairs<CH, 2>(P, pw.data(), stride, width, offsets, row0, row_acc), row0 += 2;
    } else {
      accumulate_values_pairs<CH, 1>(P, pw.data(), stride, width, offsets, row0, row_acc), row0 += 1;
    }
  }
}
#endif

#if PL_AMX_ATTN
// ---- AMX: the path for bfloat16 caches and queries ------------------------------------------------------
//
// Scores as tile products: a tile of 16 cached keys (16 consecutive rows of one block, as they lie in
// memory) times the group's queries laid out as AMX's B operand gives 16 tokens x up to 16 query rows at
// once, with no horizontal sums; values likewise: the bfloat16 weights [16 rows x 32 tokens] times 32
// value rows interleaved in pairs. Products of bf16 pairs summed in float32, as the AVX-512 path does.
// Needs head size 64 or 128, blocks of a multiple of 16 tokens, partitions starting on a 16-token
// boundary and at most 16 query rows per KV head.

struct alignas(64) AmxScratch {
  uint16_t qt[4][16][32];   // the queries as B tiles, one per 32 elements of the head
  uint16_t vb[4][16][32];   // value rows interleaved in pairs, one tile per 16 output columns
  float c[4][16][16];       // tile results on their way out
  std::vector<float> sc;    // scores as tiles: [token][16 query rows]
  std::vector<uint16_t> pw; // bfloat16 weights [16][stride], each row zero-padded to `stride`
};

inline AmxScratch& amx_scratch() {
  static thread_local AmxScratch s;
  return s;
}

// scores[row * width + i] = scale * q[row] . k[lo + i] for the item's `rows` query rows
inline void amx_scores(const Problem& P, const uint16_t* q, int64_t rows, int64_t lo, int64_t hi,
                       const int64_t* offsets, float* scores, AmxScratch& s) {
  const int64_t d = P.head_size, width = hi - lo, tiles = (width + 15) / 16;
  const int64_t chunks = d / 32;
  std::memset(s.qt, 0, sizeof(s.qt));
  for (int64_t n = 0; n < rows; ++n)
    for (int64_t c = 0; c < chunks; ++c)
      for (int64_t k2 = 0; k2 < 16; ++k2) {
        s.qt[c][k2][2 * n] = q[n * d + 32 * c + 2 * k2];
        s.qt[c][k2][2 * n + 1] = q[n * d + 32 * c + 2 * k2 + 1];
      }
  s.sc.resize(tiles * 256 + 16);
  float* sc = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(s.sc.data()) + 63) & ~uintptr_t(63));
  const uint16_t* k = static_cast<const uint16_t*>(P.k);
  const int64_t stride = P.row * 2;
  _tile_loadd(2, s.qt[0], 64);
  _tile_loadd(3, s.qt[1], 64);
  if (chunks == 4) {
    _tile_loadd(4, s.qt[2], 64);
    _tile_loadd(5, s.qt[3], 64);
  }
  const int64_t row_bytes = P.row * 2;
  for (int64_t tile = 0; tile < tiles; ++tile) {
    const int64_t t = tile * 16;
    // the first rows of the tile two ahead: enough for the hardware prefetcher to stream the rest of its
    // block (every row, as the AVX-512 path does, measured ~8% slower: the fill buffers were the limit)
    if (t + PREFETCH_AHEAD < width) {
      prefetch_row<_MM_HINT_T0>(P.k, offsets[t + PREFETCH_AHEAD], row_bytes, 2);
      prefetch_row<_MM_HINT_T1>(P.v, offsets[t + PREFETCH_AHEAD], row_bytes, 2);
    }
    const uint16_t* rows0 = k + offsets[t];  // 16 consecutive rows of one block
    _tile_zero(0);
    _tile_loadd(1, rows0, stride);
    _tile_dpbf16ps(0, 1, 2);
    _tile_loadd(1, rows0 + 32, stride);
    _tile_dpbf16ps(0, 1, 3);
    if (chunks == 4) {
      _tile_loadd(1, rows0 + 64, stride);
      _tile_dpbf16ps(0, 1, 4);
      _tile_loadd(1, rows0 + 96, stride);
      _tile_dpbf16ps(0, 1, 5);
    }
    _tile_stored(0, sc + tile * 256, 64);
  }
  // [token][row] -> [row][token], scaled: a prefill block's many rows as 16 x 16 transposes (shuffles),
  // a decode's few rows by gathering each row's column (a transpose per tile cost more than those gathers)
  const __m512 scale = _mm512_set1_ps(P.scale);
  if (rows > 4) {
    for (int64_t tile = 0; tile < tiles; ++tile) {
      __m512 r[16];
      for (int i = 0; i < 16; ++i) r[i] = _mm512_load_ps(sc + tile * 256 + i * 16);
      transpose16(r);
      const int64_t t = tile * 16, n = std::min<int64_t>(16, width - t);
      const __mmask16 mask = static_cast<__mmask16>(n == 16 ? 0xffff : (1u << n) - 1);
      for (int64_t row = 0; row < rows; ++row)
        _mm512_mask_storeu_ps(scores + row * width + t, mask, _mm512_mul_ps(r[row], scale));
    }
    return;
  }
  const __m512i column = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                            _mm512_set1_epi32(16));
  for (int64_t row = 0; row < rows; ++row) {
    float* dst = scores + row * width;
    int64_t i = 0;
    for (; i + 16 <= width; i += 16)
      _mm512_storeu_ps(dst + i, _mm512_mul_ps(_mm512_i32gather_ps(column, sc + i * 16 + row, 4), scale));
    for (; i < width; ++i) dst[i] = sc[i * 16 + row] * P.scale;
  }
}

inline uint16_t* amx_weight_rows(AmxScratch& s, int64_t stride) {
  if (s.pw.size() < size_t(16 * stride + 32)) s.pw.resize(16 * stride + 32);
  return reinterpret_cast<uint16_t*>((reinterpret_cast<uintptr_t>(s.pw.data()) + 63) & ~uintptr_t(63));
}

// Each row's softmax (its maximum, the sum of exponentials) with the exponentials rounded to bfloat16
// straight into the value pass's weights: one pass over the scores, not exponentials written back and
// converted after. Only the rows' padding is cleared, not the whole buffer: rows past `rows` feed output
// rows nobody reads, whatever an earlier item left there.
inline void amx_softmax_weights(const float* scores, int64_t rows, int64_t width, float* row_max, float* row_sum,
                                AmxScratch& s) {
  constexpr float NEG_INF = -std::numeric_limits<float>::infinity();
  const int64_t stride = (width + 31) & ~int64_t(31);
  uint16_t* pw = amx_weight_rows(s, stride);
  for (int64_t row = 0; row < rows; ++row) {
    const float* src = scores + row * width;
    uint16_t* dst = pw + row * stride;
    __m512 mv = _mm512_set1_ps(NEG_INF);
    int64_t i = 0;
    // the last partial 16 as masked lanes (-inf for the maximum, 0 for the sum): short rows, as a prefill
    // block's early tokens have, spent most of their time in scalar tails
    const int64_t full = width & ~int64_t(15), padded = (width + 15) & ~int64_t(15);
    const __mmask16 tail = static_cast<__mmask16>((1u << (width - full)) - 1);
    for (; i < full; i += 16) mv = _mm512_max_ps(mv, _mm512_loadu_ps(src + i));
    if (tail) mv = _mm512_max_ps(mv, _mm512_mask_loadu_ps(mv, tail, src + full));
    const float m = _mm512_reduce_max_ps(mv);
    float sum = 0.f;
    if (m == NEG_INF) {  // nothing visible: all weights 0
      std::fill(dst, dst + stride, uint16_t(0));
    } else {
      const __m512 mb = _mm512_set1_ps(m);
      __m512 sv = _mm512_setzero_ps();
      for (i = 0; i < padded; i += 16) {
        const __mmask16 lanes = i < full ? __mmask16(0xffff) : tail;
        const __m512 e = _mm512_maskz_mov_ps(lanes, vexp(_mm512_sub_ps(_mm512_maskz_loadu_ps(lanes, src + i), mb)));
        sv = _mm512_add_ps(sv, e);
        _mm256_store_si256(reinterpret_cast<__m256i*>(dst + i), (__m256i)_mm512_cvtneps_pbh(e));
      }
      sum = _mm512_reduce_add_ps(sv);
      std::fill(dst + padded, dst + stride, uint16_t(0));
    }
    row_max[row] = m;
    row_sum[row] = sum;
  }
}

// row_acc[row] = sum over i of weight[row][i] * v[lo + i], the weights as amx_softmax_weights left them.
// Meanwhile the first key row of every 16 of the thread's next item goes to L2: this pass reads values the
// first pass already fetched, so memory would idle (the hardware prefetcher streams the rest of each block).
inline void amx_values(const Problem& P, int64_t rows, int64_t width, const int64_t* offsets, float* row_acc,
                       AmxScratch& s, const ItemKeys& next) {
  const int64_t d = P.head_size;
  const int64_t stride = (width + 31) & ~int64_t(31);
  const uint16_t* pw = amx_weight_rows(s, stride);
  const uint16_t* v = static_cast<const uint16_t*>(P.v);
  const __m512i zero = _mm512_setzero_si512();
  for (int64_t e0 = 0; e0 < d; e0 += 64) {
    _tile_zero(4);
    _tile_zero(5);
    _tile_zero(6);
    _tile_zero(7);
    const int64_t next_per_32 = next.table && e0 == 0 ? (next.hi - next.lo + width - 1) / width * 32 : 0;
    for (int64_t t = 0; t < width; t += 32) {
      for (int64_t u = next.lo + t / 32 * next_per_32; u < std::min(next.hi, next.lo + (t / 32 + 1) * next_per_32);
           u += 16)
        prefetch_row<_MM_HINT_T1>(P.k, next.offset(P, u), P.row * 2, 2);
      for (int64_t k2 = 0; k2 < 16; ++k2) {
        const int64_t a = t + 2 * k2, b = a + 1;
        // rows past the context are not read: their weights are 0, but 0 x NaN is not
        const __m512i x0 = a < width ? _mm512_loadu_si512(v + offsets[a] + e0) : zero;
        const __m512i x1 = a < width ? _mm512_loadu_si512(v + offsets[a] + e0 + 32) : zero;
        const __m512i y0 = b < width ? _mm512_loadu_si512(v + offsets[b] + e0) : zero;
        const __m512i y1 = b < width ? _mm512_loadu_si512(v + offsets[b] + e0 + 32) : zero;
        _mm512_store_si512(s.vb[0][k2], _mm512_unpacklo_epi16(x0, y0));
        _mm512_store_si512(s.vb[1][k2], _mm512_unpackhi_epi16(x0, y0));
        _mm512_store_si512(s.vb[2][k2], _mm512_unpacklo_epi16(x1, y1));
        _mm512_store_si512(s.vb[3][k2], _mm512_unpackhi_epi16(x1, y1));
      }
      _tile_loadd(1, pw + t, stride * 2);
      _tile_loadd(2, s.vb[0], 64);
      _tile_dpbf16ps(4, 1, 2);
      _tile_loadd(3, s.vb[1], 64);
      _tile_dpbf16ps(5, 1, 3);
      _tile_loadd(2, s.vb[2], 64);
      _tile_dpbf16ps(6, 1, 2);
      _tile_loadd(3, s.vb[3], 64);
      _tile_dpbf16ps(7, 1, 3);
    }
    _tile_stored(4, s.c[0], 64);
    _tile_stored(5, s.c[1], 64);
    _tile_stored(6, s.c[2], 64);
    _tile_stored(7, s.c[3], 64);
    // tile 2c (lo) column n holds element 8 (n / 4) + n % 4 of the 32 at e0 + 32c; tile 2c + 1 (hi) that + 4
    for (int64_t row = 0; row < rows; ++row)
      for (int c = 0; c < 2; ++c) {
        float* dst = row_acc + row * d + e0 + 32 * c;
        for (int L = 0; L < 4; ++L)
          for (int j = 0; j < 4; ++j) dst[8 * L + j] = s.c[2 * c][row][4 * L + j], dst[8 * L + 4 + j] = s.c[2 * c + 1][row][4 * L + j];
      }
  }
}
#endif

// One work item: request `r`, KV head `h`, context positions [lo, hi), for Q query tokens whose last sits at
// position L - 1 (a request's whole query, or one block of a prefill chunk's: see run). Writes, for each
// query token j and query head g of the group, row (j * group + g): the running max, the sum of
// exponentials and the unnormalised weighted sum of values (head_size floats). Rows whose visible range
// does not meet [lo, hi) get max = -inf, sum = 0, acc = 0. `qf` holds the rows' queries in float32 and, when
// the query is bfloat16, `qb` the same bits as bfloat16 pairs for the dot-product instruction.
template <int64_t K>
void attend_partition(const Problem& P, const float* qf, const void* qb, int64_t r, int64_t L, int64_t Q, int64_t h,
                      int64_t lo, int64_t hi, float* row_max, float* row_sum, float* row_acc,
                      std::vector<float>& scores, std::vector<float>& vrow, std::vector<int64_t>& offsets,
                      std::vector<uint16_t>& weights, const ItemKeys& next, bool chunk) {
  constexpr float NEG_INF = -std::numeric_limits<float>::infinity();
  const int64_t d = P.head_size, G = P.group;
  const int64_t rows = Q * G, width = hi - lo;
  scores.resize(rows * width);
  const int32_t* table = P.block_tables + r * P.max_blocks;
  const int64_t head_base = h * P.num_blocks * P.block_size * P.row;
  // each position's element offset in the cache, a block at a time (a branch-free loop the compiler
  // vectorises: per token with a branch it cost ~4% of a decode step's attention)
  offsets.resize(width);
  for (int64_t t = lo, b = lo / P.block_size, i = lo % P.block_size; t < hi; ++b, i = 0) {
    const int64_t n = std::min(P.block_size - i, hi - t), first = head_base + (int64_t(table[b]) * P.block_size + i) * P.row;
    int64_t* dst = offsets.data() + (t - lo);
    for (int64_t j = 0; j < n; ++j) dst[j] = first + j * P.row;
    t += n;
  }
  auto offset = [&](int64_t t) { return offsets[t - lo]; };
  int64_t t = lo;
#if PL_AMX_ATTN
  const bool amx = K == BF16 && P.amx && !P.fixed_order && qb != nullptr && (d == 64 || d == 128) && P.block_size % 16 == 0 &&
                   lo % 16 == 0 && rows <= 16;
  if (amx) {
    amx_scores(P, static_cast<const uint16_t*>(qb), rows, lo, hi, offsets.data(), scores.data(), amx_scratch());
    t = hi;
  }
#endif
#if PL_AVX512
  if (d % 16 == 0 && !P.fixed_order) {
    __m512 part[16];
    int64_t at[16];
    std::vector<uint16_t> tile(16 * d);  // a tile of keys widened to bfloat16
    const __m512 scale = _mm512_set1_ps(P.scale);
    const int64_t row_bytes = P.row * elem_size<K>();
#if defined(__AVX512BF16__)
    // a prefill chunk's blocks (the decodes' rows keep their dot products: a few rows do not repay turning
    // the keys into pairs); by the request's query, not the block's rows, so that a token's scores do not
    // depend on where the chunk's blocks fall
    const bool pair_tiles = K == BF16 && qb != nullptr && d % 32 == 0 && d <= 128 && chunk;
#endif
    // the first two tiles, which the loop's look-ahead never asks for (the previous item asked for its
    // successor's keys into L2 at the end of its own scores, below)
    for (int64_t i = lo; i < std::min(hi, lo + PREFETCH_AHEAD); ++i) {
      prefetch_row<_MM_HINT_T0>(P.k, offset(i), row_bytes, elem_size<K>());
      prefetch_row<_MM_HINT_T1>(P.v, offset(i), row_bytes, elem_size<K>());
    }
    std::vector<float> last_tile(rows * 16);
    for (; t < hi; t += 16) {
      // a last tile of fewer keys repeats its last key, so every key's score is summed as in a whole tile
      // (as the AVX2 path's tiles of 8)
      const int64_t n = std::min<int64_t>(16, hi - t);
      for (int i = 0; i < 16; ++i) at[i] = offset(t + std::min<int64_t>(i, n - 1));
      float* dst = n == 16 ? scores.data() + (t - lo) : last_tile.data();
      const int64_t stride = n == 16 ? width : 16;
      // blocks sit anywhere in memory, so the hardware prefetcher cannot see the next one coming: fetch
      // the keys of a tile ahead into L1 and its values into L2 for the second pass
      for (int64_t i = t + PREFETCH_AHEAD; i < std::min(hi, t + PREFETCH_AHEAD + 16); ++i) {
        prefetch_row<_MM_HINT_T0>(P.k, offset(i), row_bytes, elem_size<K>());
        prefetch_row<_MM_HINT_T1>(P.v, offset(i), row_bytes, elem_size<K>());
      }
#if defined(__AVX512BF16__)
      if (pair_tiles) {
        tile_scores(static_cast<const uint16_t*>(qb), rows, d, static_cast<const uint16_t*>(P.k), at, scale, dst,
                    stride);
      } else
#endif
      {
#if defined(__AVX512BF16__)
        // other cache dtypes with a bfloat16 query: widen the tile's keys to bfloat16 once (exact for fp8,
        // whose 2-3 mantissa bits fit in bfloat16's 7), then every query row uses the pair-product path
        const bool widen = K != BF16 && qb != nullptr && d % 32 == 0 && K != F32;
        if (widen) {
          for (int i = 0; i < 16; ++i)
            for (int64_t e = 0; e < d; e += 32)
              _mm512_storeu_si512(
                  tile.data() + i * d + e,
                  (__m512i)_mm512_cvtne2ps_pbh(vload<K>(P.k, at[i] + e + 16), vload<K>(P.k, at[i] + e)));
        }
#endif
        for (int64_t row = 0; row < rows; ++row) {
#if defined(__AVX512BF16__)
          if (K == BF16 && qb != nullptr && d % 32 == 0) {
            const __m512bh* q = static_cast<const __m512bh*>(qb) + row * (d / 32);
            partial_dots16_bf16(q, P.k, at, d, part);
          } else if (widen) {
            const __m512bh* q = static_cast<const __m512bh*>(qb) + row * (d / 32);
            int64_t tile_at[16];
            for (int i = 0; i < 16; ++i) tile_at[i] = i * d;
            partial_dots16_bf16(q, tile.data(), tile_at, d, part);
          } else
#endif
          {
            for (int i = 0; i < 16; ++i) part[i] = partial_dot<K>(qf + row * d, P.k, at[i], d);
          }
          _mm512_storeu_ps(dst + row * stride, _mm512_mul_ps(reduce16(part), scale));
        }
      }
      if (n < 16)
        for (int64_t row = 0; row < rows; ++row)
          std::memcpy(scores.data() + row * width + (t - lo), dst + row * 16, n * sizeof(float));
    }
    // the thread's next item's keys into L2 while this one's softmax and values run (kNextItemBytes): its
    // blocks sit anywhere, so nothing else fetches them before its first tiles wait on memory
    if (next.table)
      for (int64_t u = next.lo; u < std::min(next.hi, next.lo + kNextItemBytes / row_bytes); ++u)
        prefetch_row<_MM_HINT_T1>(P.k, next.offset(P, u), row_bytes, elem_size<K>());
  }
#elif PL_AVX2
  if (d % 8 == 0 && !P.fixed_order) {  // tiles of 8 keys, as the AVX-512 path's of 16
    __m256 part[8];
    int64_t at[8];
    const __m256 scale = _mm256_set1_ps(P.scale);
    const int64_t row_bytes = P.row * elem_size<K>();
    std::vector<float> key_parts(d % 64 == 0 ? rows * 64 : 0);
    for (int64_t i = lo; i < std::min(hi, lo + PREFETCH_AHEAD); ++i) prefetch_row<_MM_HINT_T0>(P.k, offset(i), row_bytes, elem_size<K>());
    std::vector<float> last_tile(rows * 8);
    for (; t < hi; t += 8) {
      // a last tile of fewer keys repeats its last key, so every key's score is summed as in a whole tile:
      // a token's scores then do not depend on where its block's context ends (a prefill chunk's blocks
      // end at their own last rows)
      const int64_t n = std::min<int64_t>(8, hi - t);
      for (int i = 0; i < 8; ++i) at[i] = offset(t + std::min<int64_t>(i, n - 1));
      for (int64_t i = t + PREFETCH_AHEAD; i < std::min(hi, t + PREFETCH_AHEAD + 8); ++i) {
        prefetch_row<_MM_HINT_T0>(P.k, offset(i), row_bytes, elem_size<K>());
        prefetch_row<_MM_HINT_T1>(P.v, offset(i), row_bytes, elem_size<K>());
      }
      float* dst = n == 8 ? scores.data() + (t - lo) : last_tile.data();
      const int64_t stride = n == 8 ? width : 8;
      if (d % 64 == 0) {
        key_tile_scores8<K>(qf, rows, P.k, at, d, P.scale, dst, stride, key_parts.data());
      } else {
        for (int64_t row = 0; row < rows; ++row) {
          for (int i = 0; i < 8; ++i) part[i] = partial_dot8<K>(qf + row * d, P.k, at[i], d);
          _mm256_storeu_ps(dst + row * stride, _mm256_mul_ps(reduce8(part), scale));
        }
      }
      if (n < 8)
        for (int64_t row = 0; row < rows; ++row)
          std::memcpy(scores.data() + row * width + (t - lo), dst + row * 8, n * sizeof(float));
    }
    // as the AVX-512 path: the next item's keys into L2 (kNextItemBytes)
    if (next.table)
      for (int64_t u = next.lo; u < std::min(next.hi, next.lo + kNextItemBytes / row_bytes); ++u)
        prefetch_row<_MM_HINT_T1>(P.k, next.offset(P, u), row_bytes, elem_size<K>());
  }
#endif
  for (; t < hi; ++t) {
    const int64_t at = offset(t);
    // rows of queries before position t cannot see it (the mask below sets them): a prefill chunk's
    // later keys are skipped for its earlier queries
    const int64_t first_row = std::max<int64_t>(0, (t - (L - Q)) * G);
    for (int64_t row = first_row; row < rows; ++row) scores[row * width + (t - lo)] = dot<K>(qf + row * d, P.k, at, d) * P.scale;
  }
  if constexpr (K == I8) {  // each key's scale
    for (int64_t i = 0; i < width; ++i) {
      const float ks = row_scale(P.k, offsets[i], d);
      for (int64_t row = 0; row < rows; ++row) scores[row * width + i] *= ks;
    }
  }
  if (P.soft_cap > 0.f) soft_cap_scores(scores.data(), rows * width, P.soft_cap);
  // causal and sliding-window masks: query token j sits at position L - Q + j and sees (pos - window, pos]
  for (int64_t row = 0; row < rows; ++row) {
    const int64_t pos = L - Q + row / G;
    const int64_t first = P.window ? std::max<int64_t>(0, pos - P.window + 1) : 0;
    float* s = scores.data() + row * width;
    for (int64_t i = lo; i < std::min(first, hi); ++i) s[i - lo] = NEG_INF;
    for (int64_t i = std::max(pos + 1, lo); i < hi; ++i) s[i - lo] = NEG_INF;
  }
#if PL_AMX_ATTN
  if (amx) {
    amx_softmax_weights(scores.data(), rows, width, row_max, row_sum, amx_scratch());
    amx_values(P, rows, width, offsets.data(), row_acc, amx_scratch(), next);
    return;
  }
#endif
  for (int64_t row = 0; row < rows; ++row) {
    float* s = scores.data() + row * width;
    // the row's sum runs over the positions up to its own, in vector lanes counted from the partition's
    // start: where a longer context (a later query of the same prefill chunk) ends does not move a
    // term between the vector lanes and the scalar tail, so a token's row is the same in any chunk
    const int64_t visible = std::clamp<int64_t>(L - Q + row / G + 1 - lo, 0, width);
    float m = NEG_INF;
    int64_t i0 = 0;
#if PL_AVX512
    __m512 mv16 = _mm512_set1_ps(NEG_INF);
    for (; i0 + 16 <= width; i0 += 16) mv16 = _mm512_max_ps(mv16, _mm512_loadu_ps(s + i0));
    m = _mm512_reduce_max_ps(mv16);
#elif PL_AVX2
    __m256 mv8 = _mm256_set1_ps(NEG_INF);
    for (; i0 + 8 <= width; i0 += 8) mv8 = _mm256_max_ps(mv8, _mm256_loadu_ps(s + i0));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mv8), _mm256_extractf128_ps(mv8, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
#endif
    for (; i0 < width; ++i0) m = std::max(m, s[i0]);
    float sum = 0.f;
    if (m != NEG_INF) {
      int64_t i = 0;
#if PL_AVX512 || PL_AVX2
      const vec mv = vset1(m);
      vec sv = vzero();
      for (; i + W <= visible; i += W) {
        const vec e = vexp(vsub(vloadf(s + i), mv));
        vstoref(s + i, e);
        sv = vadd(sv, e);
      }
      sum = vsum(sv);
#endif
      for (; i < visible; ++i) {
        s[i] = std::exp(s[i] - m);
        sum += s[i];
      }
    }
    std::fill(s + (m == NEG_INF ? 0 : visible), s + width, 0.f);  // masked: weight 0
    row_max[row] = m;
    row_sum[row] = sum;
    std::fill(row_acc + row * d, row_acc + (row + 1) * d, 0.f);
  }
  if constexpr (K == I8) {  // each value's scale, folded into its weights (after the sums above)
    for (int64_t i = 0; i < width; ++i) {
      const float vs = row_scale(P.v, offsets[i], d);
      for (int64_t row = 0; row < rows; ++row) scores[row * width + i] *= vs;
    }
  }
#if PL_AVX512 && defined(__AVX512BF16__)
  if (K == BF16 && qb != nullptr && (d == 64 || d == 128) && !P.fixed_order) {  // bfloat16 cache and output
    if (d == 64)
      accumulate_rows_pairs<2, 4>(P, scores.data(), width, offsets.data(), rows, row_acc, weights);
    else
      accumulate_rows_pairs<4, 2>(P, scores.data(), width, offsets.data(), rows, row_acc, weights);
    return;
  }
#endif
#if PL_AVX512
  if ((d == 64 || d == 128) && !P.fixed_order) {  // the common head sizes: accumulators in registers
    for (int64_t row0 = 0; row0 < rows; row0 += (d == 64 ? 4 : 2)) {
      if (d == 64)
        accumulate_values<K, 4, 4>(P, scores.data(), width, offsets.data(), row0, rows, row_acc);
      else
        accumulate_values<K, 8, 2>(P, scores.data(), width, offsets.data(), row0, rows, row_acc);
    }
    return;
  }
#elif PL_AVX2
  if (d % 16 == 0 && !P.fixed_order) {
    // the positions some row sees: from the first row's window start to the last row's own position
    const int64_t first = P.window ? std::max<int64_t>(0, L - Q - P.window + 1) : 0;
    const int64_t begin = std::clamp<int64_t>(first - lo, 0, width), end = std::clamp<int64_t>(L - lo, 0, width);
    const float* sc = scores.data();
    const int64_t* at = offsets.data();
    for (int64_t row0 = 0; row0 < rows;) {
      const int64_t left = rows - row0;
      if (left >= 4) {
        accumulate_values8<K, 4>(P, sc, width, at, row0, begin, end, row_acc), row0 += 4;
      } else if (left == 3) {
        accumulate_values8<K, 3>(P, sc, width, at, row0, begin, end, row_acc), row0 += 3;
      } else if (left == 2) {
        accumulate_values8<K, 2>(P, sc, width, at, row0, begin, end, row_acc), row0 += 2;
      } else {
        accumulate_values8<K, 1>(P, sc, width, at, row0, begin, end, row_acc), row0 += 1;
      }
    }
    return;
  }
#endif
  vrow.resize(d);
  for (int64_t t = lo; t < hi; ++t) {
    const int64_t at = offset(t);
    bool loaded = false;
    for (int64_t row = 0; row < rows; ++row) {
      const float p = scores[row * width + (t - lo)];
      if (p == 0.f) continue;
      if (!loaded) {  // the value row in float32, once for all query rows
        int64_t i = 0;
#if PL_AVX512 || PL_AVX2
        for (; i + W <= d; i += W) vstoref(vrow.data() + i, vload<K>(P.v, at + i));
#endif
        for (; i < d; ++i) vrow[i] = load_scalar<K>(P.v, at + i);
        loaded = true;
      }
      float* acc = row_acc + row * d;
      int64_t i = 0;
#if PL_AVX512 || PL_AVX2
      const vec pv = vset1(p);
      for (; i + W <= d; i += W) vstoref(acc + i, vfma(pv, vloadf(vrow.data() + i), vloadf(acc + i)));
#endif
      for (; i < d; ++i) acc[i] += p * vrow[i];
    }
  }
}

// 1 / the row's softmax denominator with a sink: its partial max `m` and sum of e^(s - m) (m = -inf, sum = 0
// when it saw nothing) joined by the sink's logit; the weighted sum of values was taken relative to m.
inline float sink_norm(float m, float sum, float sink) {
  const float top = std::max(m, sink);
  if (top == -std::numeric_limits<float>::infinity()) return 0.f;
  const float c = std::exp(m - top);  // 0 when m = -inf
  return c / (sum * c + std::exp(sink - top));
}

template <typename T>
inline void store_out(at::Tensor& out, int64_t flat, const float* src, float inv, int64_t d) {
  T* dst = out.data_ptr<T>() + flat;
  for (int64_t i = 0; i < d; ++i) dst[i] = static_cast<T>(src[i] * inv);
}

inline void write_row(at::Tensor& out, int64_t flat, const float* src, float inv, int64_t d) {
#if PL_AVX512 && defined(__AVX512BF16__)
  if (out.scalar_type() == at::kBFloat16 && d % 16 == 0) {  // rounded to nearest even, as store_out's
    uint16_t* dst = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()) + flat;
    const __m512 scale = _mm512_set1_ps(inv);
    for (int64_t i = 0; i < d; i += 16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(src + i), scale)));
    return;
  }
#endif
  switch (out.scalar_type()) {
    case at::kFloat: store_out<float>(out, flat, src, inv, d); break;
    case at::kBFloat16: store_out<at::BFloat16>(out, flat, src, inv, d); break;
    case at::kHalf: store_out<at::Half>(out, flat, src, inv, d); break;
    default: TORCH_CHECK(false, "out must be float32, bfloat16 or float16");
  }
}

// Query tokens per work item: as many as keep an item's rows (tokens x the group's query heads) within the
// 16 columns of one AMX tile, at least one. A decode's single token is one block; a prefill chunk's tokens
// are many, so its keys are multiplied as tiles and its blocks spread over the threads.
inline int64_t block_tokens(int64_t group) { return std::max<int64_t>(1, 16 / group); }

template <int64_t K>
void run(at::Tensor& out, const at::Tensor& q, const Problem& P, int64_t num_reqs, int64_t partition) {
  const int64_t d = P.head_size, G = P.group, KV = P.num_kv, B = block_tokens(G);
  // work items: (request, KV head, block of query tokens, partition)
  std::vector<int64_t> item_start(num_reqs + 1, 0), parts(num_reqs), blocks(num_reqs);
  int64_t max_rows = 1;
  bool prefill = false;
  for (int64_t i = 0; i < num_reqs; ++i) {
    const int64_t r = P.reqs[i], L = P.seq_lens[r], Q = P.query_start[r + 1] - P.query_start[r];
    parts[i] = std::max<int64_t>(1, (L + partition - 1) / partition);
    blocks[i] = std::max<int64_t>(1, (Q + B - 1) / B);
    item_start[i + 1] = item_start[i] + parts[i] * blocks[i] * KV;
    max_rows = std::max(max_rows, std::min(Q, B) * G);
    prefill = prefill || Q > B;
  }
  const int64_t num_items = item_start[num_reqs];
  // per item: max_rows maxima, sums and accumulators; when no context is split (a busy decode step),
  // each item writes its own output rows and one buffer per thread is enough (no merge pass)
  const int64_t stride = max_rows * (2 + d);
  bool whole = true;
  for (int64_t i = 0; i < num_reqs; ++i) whole = whole && parts[i] == 1;
  std::vector<float> partial(whole ? 0 : num_items * stride);

  const QueryReader q_at(q);
  auto locate = [&](int64_t item) {  // work item -> its request's table, KV head, query block and context range
    const int64_t i = std::upper_bound(item_start.begin(), item_start.end(), item) - item_start.begin() - 1;
    const int64_t r = P.reqs[i], local = item - item_start[i], Q = P.query_start[r + 1] - P.query_start[r];
    ItemKeys keys;
    keys.table = P.block_tables + r * P.max_blocks;
    keys.r = r;
    keys.h = local / (parts[i] * blocks[i]);
    keys.first = local / parts[i] % blocks[i] * B;
    keys.count = std::min(B, Q - keys.first);
    keys.chunk = Q > 1;
    keys.len = P.seq_lens[r] - Q + keys.first + keys.count;
    keys.head_base = keys.h * P.num_blocks * P.block_size * P.row;
    keys.lo = local % parts[i] * partition;
    keys.hi = std::min<int64_t>(keys.len, keys.lo + partition);
    return keys;
  };
  // decode steps: each thread takes its share of the items in order; a prefill chunk's blocks differ in cost
  // (its later tokens see more keys), so the threads claim items one at a time instead
  std::atomic<int64_t> claimed{0};
  const int64_t shares = prefill ? std::min<int64_t>(at::get_num_threads(), num_items) : num_items;
  at::parallel_for(0, shares, 1, [&](int64_t begin, int64_t end) {
#if PL_AMX_ATTN
    if (P.amx) pagellm_amx::configure_full_tiles();
#endif
    std::vector<float> scores, qf, vrow, own(whole ? stride : 0);
    std::vector<int64_t> offsets;
    std::vector<uint16_t> qb, weights;
    const bool bf16_query = q.scalar_type() == at::kBFloat16;
    const int64_t last = prefill ? num_items : end;
    auto next_item = [&](int64_t item) { return prefill ? claimed.fetch_add(1) : item + 1; };
    for (int64_t item = prefill ? claimed.fetch_add(1) : begin; item < last;) {
      const int64_t following = next_item(item);
      const ItemKeys here = locate(item), next = following < last ? locate(following) : ItemKeys{};
      const int64_t r = here.r, h = here.h, q0 = P.query_start[r] + here.first, Q = here.count;
      float* base = whole ? own.data() : partial.data() + item * stride;
      item = following;
      if (here.lo >= here.hi) {  // a partition past the block's last token: it sees nothing there
        std::fill(base, base + Q * G, -std::numeric_limits<float>::infinity());
        std::fill(base + max_rows, base + max_rows + Q * G, 0.f);
        continue;
      }
      // this KV head's query rows, scaled, as float32: [Q, G, d]
      qf.resize(Q * G * d);
      for (int64_t j = 0; j < Q; ++j)
        q_at.row(((q0 + j) * P.num_heads + h * G) * d, G * d, qf.data() + j * G * d);
      if (bf16_query) {  // 64-byte aligned for the vector loads
        qb.resize(Q * G * d + 32);
        uint16_t* aligned = reinterpret_cast<uint16_t*>((reinterpret_cast<uintptr_t>(qb.data()) + 63) & ~uintptr_t(63));
        const uint16_t* bits = reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>());
        for (int64_t j = 0; j < Q; ++j)
          std::memcpy(aligned + j * G * d, bits + ((q0 + j) * P.num_heads + h * G) * d, G * d * 2);
      }
      const void* qbits = bf16_query ? reinterpret_cast<const void*>((reinterpret_cast<uintptr_t>(qb.data()) + 63) & ~uintptr_t(63)) : nullptr;
      attend_partition<K>(P, qf.data(), qbits, r, here.len, Q, h, here.lo, here.hi, base, base + max_rows,
                          base + 2 * max_rows, scores, vrow, offsets, weights, next, here.chunk);
      if (whole) {
        for (int64_t row = 0; row < Q * G; ++row) {
          const float sum = base[max_rows + row];
          const int64_t flat = ((q0 + row / G) * P.num_heads + h * G + row % G) * d;
          const float inv = P.sinks ? sink_norm(base[row], sum, P.sinks[h * G + row % G]) : (sum > 0.f ? 1.f / sum : 0.f);
          write_row(out, flat, base + 2 * max_rows + row * d, inv, d);
        }
      }
    }
#if PL_AMX_ATTN
    if (P.amx) _tile_release();
#endif
  });

  if (whole) return;
  // merge each (request, KV head)'s partitions and write the output rows
  at::parallel_for(0, num_reqs * KV, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(d);
    for (int64_t w = begin; w < end; ++w) {
      const int64_t i = w / KV, h = w % KV, r = P.reqs[i];
      const int64_t q0 = P.query_start[r], Q = P.query_start[r + 1] - q0;
      for (int64_t row = 0; row < Q * G; ++row) {
        // the row's block of query tokens, its row within that block's items, and the block's first item
        const int64_t block = row / G / B, local = row - block * B * G;
        const float* item0 = partial.data() + (item_start[i] + (h * blocks[i] + block) * parts[i]) * stride;
        // a sink is one more logit of the row: it starts the maximum and adds e^(sink - m) to the sum
        const float* sink = P.sinks ? P.sinks + h * G + row % G : nullptr;
        float m = sink ? *sink : -std::numeric_limits<float>::infinity();
        for (int64_t p = 0; p < parts[i]; ++p) m = std::max(m, item0[p * stride + local]);
        float sum = sink && m != -std::numeric_limits<float>::infinity() ? std::exp(*sink - m) : 0.f;
        std::fill(acc.begin(), acc.end(), 0.f);
        for (int64_t p = 0; p < parts[i]; ++p) {
          const float* base = item0 + p * stride;
          if (base[max_rows + local] == 0.f) continue;
          const float c = std::exp(base[local] - m);
          sum += c * base[max_rows + local];
          const float* a = base + 2 * max_rows + local * d;
          for (int64_t e = 0; e < d; ++e) acc[e] += c * a[e];
        }
        const float inv = sum > 0.f ? 1.f / sum : 0.f;
        const int64_t j = row / G, g = row % G;
        write_row(out, ((q0 + j) * P.num_heads + h * G + g) * d, acc.data(), inv, d);
      }
    }
  });
}

}  // namespace

// out, q: [num_tokens, num_heads, head_size], contiguous. k_cache, v_cache: [num_kv_heads, num_blocks,
// block_size, head_size], contiguous. block_tables int32 [num_reqs, max_blocks]; seq_lens int32 [num_reqs];
// query_start_loc int32 [num_reqs + 1]; reqs int32: the requests to compute (others' rows are untouched).
// use_amx: bfloat16 work may take the AMX tile path where this build and CPU have it (false: AVX-512 only).
// soft_cap: 0 for none; sinks: float32 [num_heads] logits, or none.
// fixed_order (batch-invariant mode): every row is computed by the same code in the same order whatever else
// the call holds: no AMX tiles, no AVX-512 tile or pair paths (whose use depends on where a work item's
// context ends), one dot product per key and query row, values summed key by key. With a partition no
// shorter than every context (the caller's part) a prefill chunk's rows equal those of decodes at the same
// positions, bit for bit.
void paged_attention(at::Tensor out, at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, at::Tensor block_tables,
                     at::Tensor seq_lens, at::Tensor query_start_loc, at::Tensor reqs, int64_t cache_kind, double scale,
                     int64_t window, int64_t partition, bool use_amx, double soft_cap,
                     const c10::optional<at::Tensor>& sinks, bool fixed_order) {
  TORCH_CHECK(q.is_contiguous() && out.is_contiguous(), "q and out must be contiguous");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "the caches must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
                  query_start_loc.scalar_type() == at::kInt && reqs.scalar_type() == at::kInt,
              "block_tables, seq_lens, query_start_loc and reqs must be int32");
  TORCH_CHECK(block_tables.is_contiguous() && reqs.is_contiguous(), "block_tables and reqs must be contiguous");
  TORCH_CHECK(partition > 0, "partition must be positive");
  Problem P;
  P.num_heads = q.size(1);
  P.head_size = q.size(2);
  P.num_kv = k_cache.size(0);
  P.num_blocks = k_cache.size(1);
  P.block_size = k_cache.size(2);
  P.row = k_cache.size(3);
  TORCH_CHECK(P.row == P.head_size + (cache_kind == I8 ? 4 : 0), "cache rows must be head_size (+ 4 for int8)");
  TORCH_CHECK(P.num_heads % P.num_kv == 0, "num_heads must be a multiple of num_kv_heads");
  P.group = P.num_heads / P.num_kv;
  P.max_blocks = block_tables.size(1);
  P.window = window;
  P.scale = static_cast<float>(scale);
  TORCH_CHECK(soft_cap >= 0., "soft_cap must be positive (0: none)");
  P.soft_cap = static_cast<float>(soft_cap);
  if (sinks.has_value()) {
    TORCH_CHECK(sinks->scalar_type() == at::kFloat && sinks->is_contiguous() && sinks->dim() == 1 &&
                    sinks->size(0) == P.num_heads,
                "sinks must be contiguous float32 [num_heads]");
    P.sinks = sinks->data_ptr<float>();
  }
  P.block_tables = block_tables.data_ptr<int32_t>();
  P.seq_lens = seq_lens.data_ptr<int32_t>();
  P.query_start = query_start_loc.data_ptr<int32_t>();
  P.reqs = reqs.data_ptr<int32_t>();
  P.k = k_cache.data_ptr();
  P.v = v_cache.data_ptr();
  const int64_t n = reqs.numel();
  if (n == 0) return;
  (void)use_amx;
#if PL_AMX_ATTN
  P.amx = use_amx && !fixed_order && cache_kind == BF16 && q.scalar_type() == at::kBFloat16 && amx_available();
#endif
  P.fixed_order = fixed_order;
  partition = (partition + 15) / 16 * 16;  // tiles of 16 tokens never straddle two partitions
  switch (cache_kind) {
    case F32: run<F32>(out, q, P, n, partition); break;
    case BF16: run<BF16>(out, q, P, n, partition); break;
    case F16: run<F16>(out, q, P, n, partition); break;
    case E4M3: run<E4M3>(out, q, P, n, partition); break;
    case E5M2: run<E5M2>(out, q, P, n, partition); break;
    case I8: run<I8>(out, q, P, n, partition); break;
    default: TORCH_CHECK(false, "unknown cache kind ", cache_kind);
  }
}

// Write the step's new keys and values into the cache at their slots (slot = block * block_size + offset;
// negative: not stored). kv_cache [2, num_kv_heads, num_blocks, block_size, head_size], contiguous; k, v
// [num_tokens, num_kv_heads, head_size] of the cache's dtype, each token's heads contiguous (views of the
// fused qkv projection are). One row copy per token and head: index_copy_ on the transposed rows cost
// ~45 us a layer at batch 64 on a 2-core machine, for 24 KB.
void store_kv(at::Tensor kv_cache, const at::Tensor& k, const at::Tensor& v, const at::Tensor& slots) {
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.is_contiguous(), "store_kv: a contiguous [2, kv_heads, blocks, block_size, head_size] cache");
  TORCH_CHECK(k.scalar_type() == kv_cache.scalar_type() && v.scalar_type() == kv_cache.scalar_type(), "store_kv: k and v of the cache's dtype");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.is_contiguous(), "store_kv: int64 slots");
  const int64_t num_kv = kv_cache.size(1), num_slots = kv_cache.size(2) * kv_cache.size(3), d = kv_cache.size(4);
  const int64_t n = slots.numel();
  for (const at::Tensor* t : {&k, &v})
    TORCH_CHECK(t->dim() == 3 && t->size(0) == n && t->size(1) == num_kv && t->size(2) == d && t->stride(2) == 1 &&
                    t->stride(1) == d,
                "store_kv: k and v [num_tokens, kv_heads, head_size] with each token's heads contiguous");
  const int64_t elem = kv_cache.element_size(), row_bytes = d * elem;
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) TORCH_CHECK(slot[i] < num_slots, "store_kv: slot ", slot[i], " out of range");
  auto* cache = static_cast<uint8_t*>(kv_cache.data_ptr());
  const int64_t half = kv_cache.numel() / 2 * elem, head_stride = num_slots * row_bytes;
  const uint8_t* src[2] = {static_cast<const uint8_t*>(k.data_ptr()), static_cast<const uint8_t*>(v.data_ptr())};
  const int64_t token_stride[2] = {k.stride(0) * elem, v.stride(0) * elem};
  for (int64_t i = 0; i < n; ++i) {
    if (slot[i] < 0) continue;
    for (int kv = 0; kv < 2; ++kv)
      for (int64_t h = 0; h < num_kv; ++h)
        std::memcpy(cache + kv * half + h * head_stride + slot[i] * row_bytes, src[kv] + i * token_stride[kv] + h * row_bytes, row_bytes);
  }
}

bool attention_pair_tiles() {
#if PL_AVX512 && defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

std::string isa() {
#if PL_AMX_ATTN
  return amx_available() ? "avx512+amx" : "avx512";
#elif PL_AVX512
  return "avx512";
#elif PL_AVX2
  return "avx2";
#else
  return "scalar";
#endif
}

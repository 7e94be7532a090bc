// DeepSeek Sparse Attention's two passes over cached rows, read in place through slots (no gathered,
// widened copy of the context): the lightning indexer's scores of every earlier token, and the absorbed MLA
// attention over the tokens the top k chose (models/layers/sparse_attention.py defines the math: its
// `index_scores` and `attend_selected`, which these equal up to float32 summation order, and for bfloat16
// queries and rows up to the attention weights' rounding to bfloat16, as CPU_ATTN's pair path rounds them).
//
// The cached rows are bfloat16 or float32 (a slot-major cache, TORCH_SDPA's layout), products and sums in
// float32 (a bfloat16 value widens exactly). The indexer's pass is split over the keys between the threads,
// each key read once for every query and head (bfloat16 keys of a multiple of 32 values, up to 128, in tiles
// of 16 keys turned into pairs: `index_tile_scores`); the attention's over queries (a decode's over parts of
// its chosen rows, merged as flash-decoding merges partitions), each part's rows in blocks of 64 asked for
// ahead, scored, then summed into the values while in cache under a running softmax (flash attention's),
// bfloat16 rows two at a time per vdpbf16ps with the weights rounded to bfloat16.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "avx512_helpers.h"
#include "kernels.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#define SP_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define SP_AVX2 1
#endif

namespace {

// A row of d values widened to float32 (bfloat16: the bits shifted up, exact).
template <typename T>
inline void widen(const T* src, int64_t d, float* dst);

template <>
inline void widen<float>(const float* src, int64_t d, float* dst) {
  std::memcpy(dst, src, d * sizeof(float));
}

template <>
inline void widen<uint16_t>(const uint16_t* src, int64_t d, float* dst) {
  int64_t i = 0;
#if SP_AVX512
  for (; i + 16 <= d; i += 16) {
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i)));
    _mm512_storeu_ps(dst + i, _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16)));
  }
#elif SP_AVX2
  for (; i + 8 <= d; i += 8) {
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i)));
    _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16)));
  }
#endif
  for (; i < d; ++i) {
    const uint32_t bits = static_cast<uint32_t>(src[i]) << 16;
    std::memcpy(dst + i, &bits, 4);
  }
}

// sum_i a[i] * b[i] in float32.
inline float dot(const float* a, const float* b, int64_t d) {
  int64_t i = 0;
  float total = 0.f;
#if SP_AVX512
  __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
  for (; i + 32 <= d; i += 32) {
    acc0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc0);
    acc1 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i + 16), _mm512_loadu_ps(b + i + 16), acc1);
  }
  for (; i + 16 <= d; i += 16) acc0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc0);
  total = _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
#elif SP_AVX2
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  for (; i + 16 <= d; i += 16) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), acc1);
  }
  for (; i + 8 <= d; i += 8) acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
  const __m256 s = _mm256_add_ps(acc0, acc1);
  const __m128 h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  const __m128 q = _mm_add_ps(h, _mm_movehl_ps(h, h));
  total = _mm_cvtss_f32(_mm_add_ss(q, _mm_shuffle_ps(q, q, 1)));
#endif
  for (; i < d; ++i) total += a[i] * b[i];
  return total;
}

// out[i] += w * x[i]
inline void axpy(float w, const float* x, int64_t d, float* out) {
  int64_t i = 0;
#if SP_AVX512
  const __m512 wv = _mm512_set1_ps(w);
  for (; i + 16 <= d; i += 16)
    _mm512_storeu_ps(out + i, _mm512_fmadd_ps(wv, _mm512_loadu_ps(x + i), _mm512_loadu_ps(out + i)));
#elif SP_AVX2
  const __m256 wv = _mm256_set1_ps(w);
  for (; i + 8 <= d; i += 8)
    _mm256_storeu_ps(out + i, _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + i), _mm256_loadu_ps(out + i)));
#endif
  for (; i < d; ++i) out[i] += w * x[i];
}

#if SP_AVX512
// 16 values of a row from element i, widened.
inline __m512 load16(const float* p, int64_t i) { return _mm512_loadu_ps(p + i); }
inline __m512 load16(const uint16_t* p, int64_t i) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
#endif

// out[r * G + h] = q_h . row_r for G query vectors (q + h * d) and two rows: each 16-value slice of the rows
// loaded once for all G (2 * G sums in registers), each slice of q once for both rows.
template <typename T, int G>
inline void dots2(const float* q, int64_t d, const T* r0, const T* r1, float* out) {
  int64_t i = 0;
#if SP_AVX512
  __m512 a0[G], a1[G];
  for (int h = 0; h < G; ++h) a0[h] = a1[h] = _mm512_setzero_ps();
  for (; i + 16 <= d; i += 16) {
    const __m512 x0 = load16(r0, i), x1 = load16(r1, i);
    for (int h = 0; h < G; ++h) {
      const __m512 qv = _mm512_loadu_ps(q + h * d + i);
      a0[h] = _mm512_fmadd_ps(qv, x0, a0[h]);
      a1[h] = _mm512_fmadd_ps(qv, x1, a1[h]);
    }
  }
  for (int h = 0; h < G; ++h) out[h] = _mm512_reduce_add_ps(a0[h]), out[G + h] = _mm512_reduce_add_ps(a1[h]);
#else
  for (int h = 0; h < G; ++h) out[h] = out[G + h] = 0.f;
#endif
  for (; i < d; i += 256) {  // the tail (all of it without AVX-512), widened 256 values at a time
    float t0[256], t1[256];
    const int64_t n = std::min<int64_t>(256, d - i);
    widen<T>(r0 + i, n, t0), widen<T>(r1 + i, n, t1);
    for (int h = 0; h < G; ++h) out[h] += dot(q + h * d + i, t0, n), out[G + h] += dot(q + h * d + i, t1, n);
  }
}

// out[r * g + h] = q_h . row_r, h < g, for rows r0 and r1 (r1 may equal r0): dots2 in groups of at most 8.
template <typename T>
inline void dots_rows(const float* q, int64_t g, int64_t d, const T* r0, const T* r1, float* out) {
  float part[16];
  for (int64_t h0 = 0; h0 < g; h0 += 8) {
    const int64_t n = std::min<int64_t>(8, g - h0);
    const float* qh = q + h0 * d;
    switch (n) {
      case 8: dots2<T, 8>(qh, d, r0, r1, part); break;
      case 4: dots2<T, 4>(qh, d, r0, r1, part); break;
      case 2: dots2<T, 2>(qh, d, r0, r1, part); break;
      default:
        for (int64_t h = 0; h < n; ++h) {
          dots2<T, 1>(qh + h * d, d, r0, r1, part + 2 * h);
        }
        for (int64_t h = 0; h < n; ++h) out[h0 + h] = part[2 * h], out[g + h0 + h] = part[2 * h + 1];
        continue;
    }
    for (int64_t h = 0; h < n; ++h) out[h0 + h] = part[h], out[g + h0 + h] = part[n + h];
  }
}

#if SP_AVX512
// o[h][c .. c + 32) += sum_j p[h * k + j] * row_j[c .. c + 32) for G heads and rows j0..j1 (valid ones): the
// 2 * G sums in registers, each row slice loaded once for the G heads.
template <typename T, int G>
inline void weighted_slice(const float* p, int64_t k, const T* rows, int64_t d, const int64_t* at, const bool* ok,
                           int64_t j0, int64_t j1, int64_t c, float* o, int64_t v_size) {
  __m512 a0[G], a1[G];
  for (int h = 0; h < G; ++h) a0[h] = _mm512_loadu_ps(o + h * v_size + c), a1[h] = _mm512_loadu_ps(o + h * v_size + c + 16);
  for (int64_t j = j0; j < j1; ++j) {
    if (!ok[j]) continue;
    const T* r = rows + at[j] * d;
    const __m512 x0 = load16(r, c), x1 = load16(r, c + 16);
    for (int h = 0; h < G; ++h) {
      const __m512 w = _mm512_set1_ps(p[h * k + j]);
      a0[h] = _mm512_fmadd_ps(w, x0, a0[h]);
      a1[h] = _mm512_fmadd_ps(w, x1, a1[h]);
    }
  }
  for (int h = 0; h < G; ++h) _mm512_storeu_ps(o + h * v_size + c, a0[h]), _mm512_storeu_ps(o + h * v_size + c + 16, a1[h]);
}
#endif

// `dots_rows` for bfloat16 queries and rows: pairs of products in one vdpbf16ps (exact products, float32
// sums), where the build has AVX-512 BF16; else the queries widened (`dots_rows` over float32 q).
#if defined(__AVX512BF16__)
constexpr bool kBf16Dots = true;
template <int G>
inline void dots2_bf16(const uint16_t* q, int64_t d, const uint16_t* r0, const uint16_t* r1, float* out) {
  __m512 a0[G], a1[G];
  for (int h = 0; h < G; ++h) a0[h] = a1[h] = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 32 <= d; i += 32) {
    const __m512bh x0 = (__m512bh)_mm512_loadu_si512(r0 + i), x1 = (__m512bh)_mm512_loadu_si512(r1 + i);
    for (int h = 0; h < G; ++h) {
      const __m512bh qv = (__m512bh)_mm512_loadu_si512(q + h * d + i);
      a0[h] = _mm512_dpbf16_ps(a0[h], qv, x0);
      a1[h] = _mm512_dpbf16_ps(a1[h], qv, x1);
    }
  }
  for (int h = 0; h < G; ++h) out[h] = _mm512_reduce_add_ps(a0[h]), out[G + h] = _mm512_reduce_add_ps(a1[h]);
  if (i < d) {
    float qf[32], t0[32], t1[32];
    const int64_t rest = d - i;
    widen<uint16_t>(r0 + i, rest, t0), widen<uint16_t>(r1 + i, rest, t1);
    for (int h = 0; h < G; ++h) {
      widen<uint16_t>(q + h * d + i, rest, qf);
      out[h] += dot(qf, t0, rest), out[G + h] += dot(qf, t1, rest);
    }
  }
}
#else
constexpr bool kBf16Dots = false;
template <int G>
inline void dots2_bf16(const uint16_t*, int64_t, const uint16_t*, const uint16_t*, float*) {}
#endif

inline void dots_rows(const uint16_t* q, int64_t g, int64_t d, const uint16_t* r0, const uint16_t* r1, float* out) {
  float part[16];
  for (int64_t h0 = 0; h0 < g; h0 += 8) {
    const int64_t n = std::min<int64_t>(8, g - h0);
    const uint16_t* qh = q + h0 * d;
    if (n == 8) {
      dots2_bf16<8>(qh, d, r0, r1, part);
    } else {
      for (int64_t h = 0; h < n; ++h) {
        float two[2];
        dots2_bf16<1>(qh + h * d, d, r0, r1, two);
        part[h] = two[0], part[n + h] = two[1];
      }
    }
    for (int64_t h = 0; h < n; ++h) out[h0 + h] = part[h], out[g + h0 + h] = part[n + h];
  }
}

#if defined(__AVX512BF16__)
// o[h][c .. c + 32) += sum_j pb_h[j] * row_j[c .. c + 32) for G heads, the rows two at a time: the
// probabilities as bfloat16 (pb: each head's `stride` values, read as pairs p_j, p_j+1), the two rows' 32
// values interleaved within 128-bit lanes (vpunpck{l,h}wd), so one vdpbf16ps adds both rows' products to
// 16 columns' sums (half the instructions of float32 multiply-adds); an invalid row reads as zeros (never
// its values), and the sums' lane-interleaved columns are put back in order at the end.
template <int G>
inline void weighted_slice_pairs(const uint16_t* pb, int64_t stride, const uint16_t* rows, int64_t d,
                                 const int64_t* at, const bool* ok, int64_t j0, int64_t j1, int64_t k, int64_t c,
                                 float* o, int64_t v_size) {
  __m512 lo[G], hi[G];
  for (int h = 0; h < G; ++h) lo[h] = hi[h] = _mm512_setzero_ps();
  const auto* pairs = reinterpret_cast<const uint32_t*>(pb);
  for (int64_t j = j0; j < j1; j += 2) {
    const __m512i zero = _mm512_setzero_si512();
    const __m512i r0 = ok[j] ? _mm512_loadu_si512(rows + at[j] * d + c) : zero;
    const __m512i r1 = j + 1 < k && ok[j + 1] ? _mm512_loadu_si512(rows + at[j + 1] * d + c) : zero;
    const __m512bh a = (__m512bh)_mm512_unpacklo_epi16(r0, r1), b = (__m512bh)_mm512_unpackhi_epi16(r0, r1);
    for (int h = 0; h < G; ++h) {
      const __m512bh w = (__m512bh)_mm512_set1_epi32(static_cast<int>(pairs[(h * stride + j) / 2]));
      lo[h] = _mm512_dpbf16_ps(lo[h], w, a);
      hi[h] = _mm512_dpbf16_ps(hi[h], w, b);
    }
  }
  // lo's 128-bit lane L holds columns 8L..8L+3, hi's 8L+4..8L+7
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int h = 0; h < G; ++h) {
    float* oh = o + h * v_size + c;
    _mm512_storeu_ps(oh, _mm512_add_ps(_mm512_loadu_ps(oh), _mm512_permutex2var_ps(lo[h], first, hi[h])));
    _mm512_storeu_ps(oh + 16, _mm512_add_ps(_mm512_loadu_ps(oh + 16), _mm512_permutex2var_ps(lo[h], second, hi[h])));
  }
}

// p [g, k] rounded to bfloat16 in place (as CPU_ATTN's pair path rounds its probabilities), and the same
// values as bfloat16 into pb, each head's `stride` apart (zero-padded).
void round_probabilities(float* p, int64_t k, int64_t g, uint16_t* pb, int64_t stride) {
  for (int64_t h = 0; h < g; ++h) {
    for (int64_t j = 0; j < k; j += 16) {
      const __mmask16 live = static_cast<__mmask16>(k - j >= 16 ? 0xffff : (1u << (k - j)) - 1);
      const __m256i half = (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(live, p + h * k + j));
      _mm256_mask_storeu_epi16(pb + h * stride + j, live, half);
      const __m512 back = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
      _mm512_mask_storeu_ps(p + h * k + j, live, back);
    }
  }
}

// The first v_size / 32 * 32 columns of `weighted_rows` for bfloat16 rows and queries, p already rounded
// (`round_probabilities`, pb its bfloat16 copy): `weighted_slice_pairs` over blocks of rows that stay in
// cache. Returns the columns done.
int64_t weighted_rows_pairs(const uint16_t* pb, int64_t stride, int64_t k, int64_t g, const uint16_t* rows,
                            int64_t d, const int64_t* at, const bool* ok, int64_t v_size, float* o) {
  const int64_t done = v_size / 32 * 32;
  constexpr int64_t kBlock = 64;
  for (int64_t j0 = 0; j0 < k; j0 += kBlock) {
    const int64_t j1 = std::min(k, j0 + kBlock);
    for (int64_t c = 0; c < done; c += 32)
      for (int64_t h0 = 0; h0 < g; h0 += 8) {
        const uint16_t* ph = pb + h0 * stride;
        float* oh = o + h0 * v_size;
        if (g - h0 >= 8) {
          weighted_slice_pairs<8>(ph, stride, rows, d, at, ok, j0, j1, k, c, oh, v_size);
        } else {
          for (int64_t h = 0; h < g - h0; ++h)
            weighted_slice_pairs<1>(ph + h * stride, stride, rows, d, at, ok, j0, j1, k, c, oh + h * v_size, v_size);
        }
      }
  }
  return done;
}
#endif

#if SP_AVX512
// The first v_size / 32 * 32 columns of `weighted_rows` in float32 products, over blocks of rows that stay
// in cache while each 32-value slice of the output is summed in registers. Returns the columns done.
template <typename T>
int64_t weighted_rows_floats(const float* p, int64_t k, int64_t g, const T* rows, int64_t d, const int64_t* at,
                             const bool* ok, int64_t v_size, float* o) {
  const int64_t done = v_size / 32 * 32;
  constexpr int64_t kBlock = 64;
  for (int64_t j0 = 0; j0 < k; j0 += kBlock) {
    const int64_t j1 = std::min(k, j0 + kBlock);
    for (int64_t c = 0; c < done; c += 32)
      for (int64_t h0 = 0; h0 < g; h0 += 8) {
        const int64_t n = std::min<int64_t>(8, g - h0);
        const float* ph = p + h0 * k;
        float* oh = o + h0 * v_size;
        switch (n) {
          case 8: weighted_slice<T, 8>(ph, k, rows, d, at, ok, j0, j1, c, oh, v_size); break;
          case 4: weighted_slice<T, 4>(ph, k, rows, d, at, ok, j0, j1, c, oh, v_size); break;
          default:
            for (int64_t h = 0; h < n; ++h)
              weighted_slice<T, 1>(ph + h * k, k, rows, d, at, ok, j0, j1, c, oh + h * v_size, v_size);
        }
      }
  }
  return done;
}
#endif

// o[h][:v_size] = sum over the valid chosen rows j of p[h * k + j] * row_j[:v_size], h < g (`row`: scratch of
// d floats for the columns past the vector paths'). `pairs`: bfloat16 rows with bfloat16 queries, whose
// probabilities are rounded to bfloat16 in p first (`round_probabilities`; then `weighted_rows_pairs`, where
// the build has AVX-512 BF16); else float32 products.
template <typename T>
void weighted_rows(float* p, int64_t k, int64_t g, const T* rows, int64_t d, const int64_t* at,
                   const bool* ok, int64_t v_size, float* o, float* row, bool pairs) {
  int64_t done = 0;
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, uint16_t>) {
    if (pairs) {
      const int64_t stride = (k + 1) & ~int64_t(1);  // even: a head's pairs start on a pair
      std::vector<uint16_t> pb(g * stride, 0);
      round_probabilities(p, k, g, pb.data(), stride);
      done = weighted_rows_pairs(pb.data(), stride, k, g, rows, d, at, ok, v_size, o);
    }
  }
#endif
  (void)pairs;
#if SP_AVX512
  if (done == 0) done = weighted_rows_floats<T>(p, k, g, rows, d, at, ok, v_size, o);
#endif
  if (done == v_size) return;
  for (int64_t j = 0; j < k; ++j) {
    if (!ok[j]) continue;
    widen<T>(rows + at[j] * d + done, v_size - done, row);
    for (int64_t h = 0; h < g; ++h) axpy(p[h * k + j], row, v_size - done, o + h * v_size + done);
  }
}

#if defined(__AVX512BF16__)
constexpr int64_t kTileKeys = 16;
constexpr int64_t kMostTilePairs = 64;  // keys of up to 128 values (DeepSeek-V3.2's and GLM-5's: 128)

// out[i * keys + t0 + 0..n) for the tile of keys t0..t0+n (n <= 16): the tile turned into pairs once
// (`keys_as_pairs`), then each query's heads, 8 at a time, broadcast pair by pair against it: 16 keys'
// products in one register per head and no horizontal sums (where a key at a time spent most of its time
// summing 16 lanes per head), then ReLU, the scale and the head's weight.
void index_tile_scores(const uint16_t* q, const uint16_t* rows, const int64_t* at, int64_t n, const float* weights,
                       int64_t queries, int64_t heads, int64_t d, int64_t keys, float scale, float* out) {
  alignas(64) __m512i kt[kMostTilePairs];
  keys_as_pairs(rows, at, d, kt);
  const int64_t pairs = d / 2;
  const __m512 zero = _mm512_setzero_ps(), sc = _mm512_set1_ps(scale);
  for (int64_t i = 0; i < queries; ++i) {
    const auto* qi = reinterpret_cast<const uint32_t*>(q + i * heads * d);
    __m512 total = zero;
    for (int64_t h0 = 0; h0 < heads; h0 += 8) {
      const int64_t g = std::min<int64_t>(8, heads - h0);
      __m512 acc[8];
      for (int h = 0; h < 8; ++h) acc[h] = zero;
      for (int64_t p = 0; p < pairs; ++p) {
        const __m512bh tile = (__m512bh)kt[p];
        for (int h = 0; h < 8; ++h)
          if (h < g)
            acc[h] = _mm512_dpbf16_ps(acc[h], (__m512bh)_mm512_set1_epi32(static_cast<int>(qi[(h0 + h) * pairs + p])),
                                      tile);
      }
      for (int h = 0; h < g; ++h)
        total = _mm512_fmadd_ps(_mm512_set1_ps(weights[i * heads + h0 + h]),
                                _mm512_max_ps(zero, _mm512_mul_ps(sc, acc[h])), total);
    }
    _mm512_mask_storeu_ps(out + i * keys, static_cast<__mmask16>((1u << n) - 1), total);
  }
}

bool index_tiles_fit(int64_t d) { return d % 32 == 0 && d / 2 <= kMostTilePairs; }

// The indexer's pass in tiles of 16 keys split between the threads.
void index_scores_tiles(const uint16_t* q, const uint16_t* rows, const int64_t* slots, const float* weights,
                        int64_t queries, int64_t heads, int64_t d, int64_t keys, float scale, float* out) {
  const int64_t tiles = (keys + kTileKeys - 1) / kTileKeys;
  at::parallel_for(0, tiles, 8, [&](int64_t begin, int64_t end) {
    int64_t at[kTileKeys];
    for (int64_t tile = begin; tile < end; ++tile) {
      const int64_t t0 = tile * kTileKeys, n = std::min(kTileKeys, keys - t0);
      for (int64_t j = 0; j < kTileKeys; ++j) at[j] = slots[t0 + std::min(j, n - 1)] * d;  // past n: the last again
      index_tile_scores(q, rows, at, n, weights, queries, heads, d, keys, scale, out + tile * kTileKeys);
    }
  });
}
#endif

template <typename T, typename Q>
void index_scores_impl(const Q* q, const T* rows, const int64_t* slots, const float* weights, int64_t queries,
                       int64_t heads, int64_t d, int64_t keys, float scale, float* out) {
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, uint16_t> && std::is_same_v<Q, uint16_t>) {
    if (index_tiles_fit(d)) return index_scores_tiles(q, rows, slots, weights, queries, heads, d, keys, scale, out);
  }
#endif
  at::parallel_for(0, (keys + 1) / 2, 128, [&](int64_t begin, int64_t end) {
    std::vector<float> dots(2 * heads);
    for (int64_t pair = begin; pair < end; ++pair) {
      const int64_t t = 2 * pair, t1 = std::min(t + 1, keys - 1);
      const T *k0 = rows + slots[t] * d, *k1 = rows + slots[t1] * d;
      for (int64_t i = 0; i < queries; ++i) {
        dots_rows(q + i * heads * d, heads, d, k0, k1, dots.data());
        float s0 = 0.f, s1 = 0.f;
        for (int64_t h = 0; h < heads; ++h) {
          s0 += weights[i * heads + h] * std::max(0.f, scale * dots[h]);
          s1 += weights[i * heads + h] * std::max(0.f, scale * dots[heads + h]);
        }
        out[i * keys + t] = s0;
        if (t1 != t) out[i * keys + t1] = s1;
      }
    }
  });
}

// Chosen rows asked for this many rows ahead of their scores: they are scattered over the cache, where the
// hardware prefetchers do not follow (a decode at 16k tokens: 2,048 rows of 1,152 bytes a layer).
constexpr int64_t kRowsAhead = 8;

template <typename T>
inline void ask_for_row(const T* row, int64_t d) {
#if SP_AVX512 || SP_AVX2
  const auto* bytes = reinterpret_cast<const char*>(row);
  for (int64_t e = 0; e < d * static_cast<int64_t>(sizeof(T)); e += 64) _mm_prefetch(bytes + e, _MM_HINT_T0);
#else
  (void)row, (void)d;
#endif
}

// s[j] = e^(s[j] - top) where ok[j], else 0; returns their sum (16 at a time where the build has AVX-512)
inline float exponentials(float* s, const bool* ok, int64_t n, float top) {
  int64_t j = 0;
  float total = 0.f;
#if SP_AVX512
  const __m512 t = _mm512_set1_ps(top);
  __m512 sum = _mm512_setzero_ps();
  for (; j + 16 <= n; j += 16) {
    const __mmask16 live = _mm512_test_epi32_mask(
        _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(ok + j))), _mm512_set1_epi32(1));
    const __m512 e = _mm512_maskz_mov_ps(live, exp16(_mm512_sub_ps(_mm512_loadu_ps(s + j), t)));
    _mm512_storeu_ps(s + j, e);
    sum = _mm512_add_ps(sum, e);
  }
  total = _mm512_reduce_add_ps(sum);
#endif
  for (; j < n; ++j) {
    const float e = ok[j] ? std::exp(s[j] - top) : 0.f;
    s[j] = e;
    total += e;
  }
  return total;
}

constexpr int64_t kRowBlock = 64;  // chosen rows scored and summed together (72 KiB of 576-value bf16 rows)

// scores[h * m + j] = scale * q_h . row_j for the block's m rows (`left`: rows from the block's first to the
// item's end, for asking ahead across blocks)
template <typename T, typename Q>
void block_scores(const Q* qi, int64_t heads, int64_t d, const T* rows, const int64_t* at, const bool* ok, int64_t m,
                  int64_t left, float scale, float* scores, float* pair_dots) {
  (void)ok;
  for (int64_t j = 0; j < m; j += 2) {
    const int64_t j1 = std::min(j + 1, m - 1);
    if (j + kRowsAhead + 1 < left)
      ask_for_row(rows + at[j + kRowsAhead] * d, d), ask_for_row(rows + at[j + kRowsAhead + 1] * d, d);
    dots_rows(qi, heads, d, rows + at[j] * d, rows + at[j1] * d, pair_dots);
    for (int64_t h = 0; h < heads; ++h) {
      scores[h * m + j] = scale * pair_dots[h];
      if (j1 != j) scores[h * m + j1] = scale * pair_dots[heads + h];
    }
  }
}

// One head's block in the running softmax (flash attention's): its max over the valid rows raises the
// head's running max `best` if above it, scaling the sums so far (`total` and o's v_size values) by
// e^(old - new); then s becomes e^(s - best) (0 where invalid), added to `total`.
inline void rescale_head(float* s, const bool* ok, int64_t m, float& best, float& total, float* o, int64_t v_size) {
  float top = best;
  for (int64_t j = 0; j < m; ++j)
    if (ok[j]) top = std::max(top, s[j]);
  if (top > best) {
    const float factor = std::exp(best - top);  // 0 for the first valid block (best: -inf)
    total *= factor;
    for (int64_t c = 0; c < v_size; ++c) o[c] *= factor;
    best = top;
  }
  total += exponentials(s, ok, m, best);
}

template <typename T, typename Q>
void attend_rows_impl(const Q* q, const T* rows, const int64_t* slots, const bool* valid, int64_t queries,
                      int64_t heads, int64_t d, int64_t k, int64_t v_size, float scale, float* out) {
  // work items of one query and a part of its chosen rows, every head (each row read once per item: a
  // decode's rows split between the threads, a chunk's queries); the parts' softmax sums merged after
  const int64_t threads = at::get_num_threads();
  const int64_t parts = queries >= threads ? 1 : std::max<int64_t>(1, std::min<int64_t>(threads, k / 64));
  std::vector<float> part_out(parts > 1 ? queries * parts * heads * v_size : 0);
  std::vector<float> part_max(queries * parts * heads), part_sum(queries * parts * heads);
  at::parallel_for(0, queries * parts, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> row(d), score_buf(heads * kRowBlock), pair_dots(2 * heads);
    float* scores = score_buf.data();
    for (int64_t item = begin; item < end; ++item) {
      const int64_t i = item / parts, part = item % parts;
      const int64_t j0 = part * k / parts, n = (part + 1) * k / parts - j0;
      const Q* qi = q + i * heads * d;
      float* best = part_max.data() + item * heads;
      float* total = part_sum.data() + item * heads;
      std::fill(best, best + heads, -std::numeric_limits<float>::infinity());
      std::fill(total, total + heads, 0.f);
      float* o = parts > 1 ? part_out.data() + item * heads * v_size : out + i * heads * v_size;
      std::fill(o, o + heads * v_size, 0.f);
      for (int64_t b0 = 0; b0 < n; b0 += kRowBlock) {  // a block's rows scored, then summed while in cache
        const int64_t m = std::min(kRowBlock, n - b0);
        const bool* ok = valid + i * k + j0 + b0;
        const int64_t* at = slots + i * k + j0 + b0;
        block_scores(qi, heads, d, rows, at, ok, m, n - b0, scale, scores, pair_dots.data());
        for (int64_t h = 0; h < heads; ++h) rescale_head(scores + h * m, ok, m, best[h], total[h], o + h * v_size, v_size);
        weighted_rows<T>(scores, m, heads, rows, d, at, ok, v_size, o, row.data(), std::is_same_v<Q, uint16_t>);
      }
      if (parts > 1) continue;
      for (int64_t h = 0; h < heads; ++h) {
        const float inv = total[h] == 0.f ? 1.f : 1.f / total[h];
        for (int64_t c = 0; c < v_size; ++c) o[h * v_size + c] *= inv;
      }
    }
  });
  if (parts == 1) return;
  for (int64_t i = 0; i < queries; ++i)  // the parts' sums, each scaled by e^(its max - the max)
    for (int64_t h = 0; h < heads; ++h) {
      float top = -std::numeric_limits<float>::infinity(), total = 0.f;
      for (int64_t part = 0; part < parts; ++part) top = std::max(top, part_max[(i * parts + part) * heads + h]);
      float* o = out + (i * heads + h) * v_size;
      std::fill(o, o + v_size, 0.f);
      for (int64_t part = 0; part < parts; ++part) {
        const int64_t at = (i * parts + part) * heads + h;
        if (part_sum[at] == 0.f) continue;
        const float w = std::exp(part_max[at] - top);
        total += w * part_sum[at];
        axpy(w, part_out.data() + at * v_size, v_size, o);
      }
      const float inv = 1.f / total;
      for (int64_t c = 0; c < v_size; ++c) o[c] *= inv;
    }
}

void check_rows(const at::Tensor& rows, const char* what) {
  TORCH_CHECK(rows.dim() == 2 && rows.is_contiguous() &&
                  (rows.scalar_type() == at::kBFloat16 || rows.scalar_type() == at::kFloat),
              what, ": rows must be contiguous float32 or bfloat16 [slots, d]");
}

void check_q(const at::Tensor& q, const at::Tensor& rows, const char* what) {
  TORCH_CHECK(q.dim() == 3 && (q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16) &&
                  q.is_contiguous() && q.size(2) == rows.size(1),
              what, ": q must be contiguous float32 or bfloat16 [Q, H, d]");
}

// Runs `fn(q, rows)` with typed pointers: bfloat16 q straight on bfloat16 rows where the build has the pair
// products, else q widened to float32 (a copy of Q x H x d values).
template <typename Fn>
void with_types(const at::Tensor& q, const at::Tensor& rows, Fn fn) {
  const bool bf16_rows = rows.scalar_type() == at::kBFloat16;
  const auto* rows16 = reinterpret_cast<const uint16_t*>(rows.data_ptr());
  if (q.scalar_type() == at::kBFloat16 && bf16_rows && kBf16Dots) {
    fn(reinterpret_cast<const uint16_t*>(q.data_ptr()), rows16);
    return;
  }
  std::vector<float> widened;
  const float* qf = q.scalar_type() == at::kFloat ? q.data_ptr<float>() : nullptr;
  if (qf == nullptr) {
    widened.resize(q.numel());
    widen<uint16_t>(reinterpret_cast<const uint16_t*>(q.data_ptr()), q.numel(), widened.data());
    qf = widened.data();
  }
  if (bf16_rows)
    fn(qf, rows16);
  else
    fn(qf, rows.data_ptr<float>());
}

}  // namespace

at::Tensor sparse_index_scores(const at::Tensor& q, const at::Tensor& rows, const at::Tensor& slots,
                               const at::Tensor& weights, double scale) {
  check_rows(rows, "sparse_index_scores");
  check_q(q, rows, "sparse_index_scores");
  TORCH_CHECK(weights.scalar_type() == at::kFloat && weights.is_contiguous() && weights.size(0) == q.size(0) &&
                  weights.size(1) == q.size(1),
              "sparse_index_scores: weights must be contiguous float32 [Q, H]");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.is_contiguous(),
              "sparse_index_scores: slots must be int64 [S]");
  const int64_t queries = q.size(0), heads = q.size(1), d = q.size(2), keys = slots.size(0);
  at::Tensor out = q.new_empty({queries, keys}, q.options().dtype(at::kFloat));
  with_types(q, rows, [&](const auto* qp, const auto* rp) {
    index_scores_impl(qp, rp, slots.data_ptr<int64_t>(), weights.data_ptr<float>(), queries, heads, d, keys,
                      static_cast<float>(scale), out.data_ptr<float>());
  });
  return out;
}

at::Tensor sparse_attend_rows(const at::Tensor& q, const at::Tensor& rows, const at::Tensor& slots,
                              const at::Tensor& valid, double scale, int64_t v_size) {
  check_rows(rows, "sparse_attend_rows");
  check_q(q, rows, "sparse_attend_rows");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 2 && slots.is_contiguous() &&
                  slots.size(0) == q.size(0),
              "sparse_attend_rows: slots must be int64 [Q, k]");
  TORCH_CHECK(valid.scalar_type() == at::kBool && valid.is_contiguous() && valid.sizes() == slots.sizes(),
              "sparse_attend_rows: valid must be bool [Q, k]");
  TORCH_CHECK(v_size > 0 && v_size <= rows.size(1), "sparse_attend_rows: v_size must be within d");
  const int64_t queries = q.size(0), heads = q.size(1), d = q.size(2), k = slots.size(1);
  at::Tensor out = q.new_empty({queries, heads, v_size}, q.options().dtype(at::kFloat));
  with_types(q, rows, [&](const auto* qp, const auto* rp) {
    attend_rows_impl(qp, rp, slots.data_ptr<int64_t>(), valid.data_ptr<bool>(), queries, heads, d, k, v_size,
                     static_cast<float>(scale), out.data_ptr<float>());
  });
  return out;
}

// AVX-512 helpers several kernels share: e^x 16 lanes at a time, and 16 cached bfloat16 rows turned into
// pairs (a 16 x 16 transpose of 32-bit lanes) so that one broadcast pair times a tile adds to 16 rows' dot
// products in one vdpbf16ps, with no horizontal sums.
#pragma once

#include <cstdint>

#if defined(__AVX512F__)
#include <immintrin.h>

// e^x within about one float32 unit in the last place (libm's expf, which the scalar SiLU calls, is within
// one half): x = n ln 2 + r, |r| <= ln 2 / 2, e^r by Cephes' expf polynomial (its six terms paired, for
// shorter chains of dependent multiply-adds), times 2^n
inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-104.f)), _mm512_set1_ps(89.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f),
                                    _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x));
  const __m512 r2 = _mm512_mul_ps(r, r);
  const __m512 high = _mm512_fmadd_ps(_mm512_set1_ps(1.9875691500e-4f), r, _mm512_set1_ps(1.3981999507e-3f));
  const __m512 mid = _mm512_fmadd_ps(_mm512_set1_ps(8.3334519073e-3f), r, _mm512_set1_ps(4.1665795894e-2f));
  const __m512 low = _mm512_fmadd_ps(_mm512_set1_ps(1.6666665459e-1f), r, _mm512_set1_ps(5.0000001201e-1f));
  const __m512 poly = _mm512_fmadd_ps(_mm512_fmadd_ps(high, r2, mid), r2, low);
  return _mm512_scalef_ps(_mm512_fmadd_ps(poly, r2, _mm512_add_ps(r, _mm512_set1_ps(1.f))), n);
}

#if defined(__AVX512BF16__)
// r[i][j] -> r[j][i]: four rounds of shuffles within and across 128-bit lanes
inline void transpose16(__m512 r[16]) {
  __m512 t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    const __m512d a = _mm512_castps_pd(t[4 * i]), b = _mm512_castps_pd(t[4 * i + 1]);
    const __m512d c = _mm512_castps_pd(t[4 * i + 2]), e = _mm512_castps_pd(t[4 * i + 3]);
    r[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
    r[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
    r[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, e));
    r[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, e));
  }
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_f32x4(r[i], r[4 + i], 0x88);
    t[4 + i] = _mm512_shuffle_f32x4(r[i], r[4 + i], 0xdd);
    t[8 + i] = _mm512_shuffle_f32x4(r[8 + i], r[12 + i], 0x88);
    t[12 + i] = _mm512_shuffle_f32x4(r[8 + i], r[12 + i], 0xdd);
  }
  for (int i = 0; i < 8; ++i) {
    r[i] = _mm512_shuffle_f32x4(t[i], t[8 + i], 0x88);
    r[8 + i] = _mm512_shuffle_f32x4(t[i], t[8 + i], 0xdd);
  }
}

// A tile of 16 cached bfloat16 keys as pairs: kt[p] holds, for each of the 16 keys, elements 2p and 2p + 1
// of its row (a 32-bit lane per key; the pair kernel's layout, with keys for columns), so one query row's
// pair broadcast times kt[p] adds to all 16 keys' scores in one instruction, with no horizontal sums.
inline void keys_as_pairs(const uint16_t* k, const int64_t* at, int64_t d, __m512i* kt) {
  for (int64_t c = 0; c < d / 32; ++c) {
    __m512 r[16];
    for (int i = 0; i < 16; ++i) r[i] = _mm512_castsi512_ps(_mm512_loadu_si512(k + at[i] + 32 * c));
    transpose16(r);
    for (int j = 0; j < 16; ++j) kt[16 * c + j] = _mm512_castps_si512(r[j]);
  }
}
#endif  // __AVX512BF16__
#endif  // __AVX512F__

// Five or more x rows times GGUF weight rows at once (a batch of decodes, a prefill chunk, an expert's tokens),
// on the int8 codes of gguf_blocks.h: x rows interleaved by eight, so that one 256-bit vector holds four
// consecutive codes of each of eight x rows, and a weight row's four codes, broadcast to every lane, meet all
// eight rows in one maddubs. The vector lanes are x rows: each weight group's float work (the integer sums
// converted, times the weight scale and x's scales, the offsets' term) is one instruction for eight rows
// instead of one per row, which is what held the row-at-a-time products (gguf_blocks.h's `dot_unpacked`) to
// ~1/10 of the integer units' rate.
//
// Each weight row is unpacked once (`unpack_row`: codes, and per half group the scale and offset) and
// multiplied with every tile of x rows, kTileWeightRows weight rows at a time sharing the x loads. The x
// tiles are read from L2: rows are taken kTileBytes of x codes at a time (each weight row unpacked again per
// such run).
#pragma once

#include "gguf_blocks.h"

namespace {

constexpr int64_t kLanes = 8;  // x rows in a tile: the lanes of a 256-bit vector of int32
constexpr int64_t kTileRows = kDirectRows + 1;  // from this many bfloat16 x rows, tiles (fewer: `dot_rows`)
constexpr bool kTiles = GG_AVX2;  // the tiles are AVX2 code; the plain C++ build keeps the row products
constexpr int64_t kTileBytes = int64_t(192) << 10;  // x codes multiplied per pass over the weight rows (L2)
// Weight rows multiplied with each x tile at once, sharing its loads: four where AVX-512's 32 vector
// registers hold their sums (Q8_0 16% and Q4_K 6% faster than two, one thread on the Zen 4), two with AVX2's 16.
#if defined(__AVX512F__)
#define GG_WIDE_TILES 1
constexpr int kTileWeightRows = 4;
#else
#define GG_WIDE_TILES 0
constexpr int kTileWeightRows = 2;
#endif
// Types with a scale and an offset per half group (16 weights), the others' per group (IQ2_XS, IQ2_S and
// IQ1_M: a scale per 16 weights, offsets of 0).
constexpr bool half_scaled(int64_t type) {
  return type == kQ6_K || type == kQ3_K || type == kQ2_K || type == kIQ2_XS || type == kIQ2_S || type == kIQ1_M;
}

// Rows of x interleaved by `lanes` (kLanes for the AVX2 tiles, kAmxLanes for AMX's, gguf_amx.h; the last
// tile of a run padded with zero rows). Per tile: codes [k / 4][lanes rows][4 codes], then per group the
// scales dx [k / 32][lanes] and the offsets' factors: dx times the code sums of each half group
// [k / 16][lanes] and of each group [k / 32][lanes].
struct XTiles {
  int64_t k = 0, lanes = kLanes;
  std::vector<int8_t> codes;
  std::vector<float> dx, halves, wholes;
  void reset(int64_t columns, int64_t tiles, int64_t tile_lanes = kLanes) {
    k = columns, lanes = tile_lanes;
    codes.assign(tiles * k * lanes, 0);
    dx.assign(tiles * (k / kGroup) * lanes, 0.f);
    halves.assign(tiles * (k / 16) * lanes, 0.f);
    wholes.assign(tiles * (k / kGroup) * lanes, 0.f);
  }
  const int8_t* codes_of(int64_t t) const { return codes.data() + t * k * lanes; }
  const float* dx_of(int64_t t) const { return dx.data() + t * (k / kGroup) * lanes; }
  const float* halves_of(int64_t t) const { return halves.data() + t * (k / 16) * lanes; }
  const float* wholes_of(int64_t t) const { return wholes.data() + t * (k / kGroup) * lanes; }
};

inline int64_t tiles_for(int64_t rows, int64_t lanes = kLanes) { return (rows + lanes - 1) / lanes; }

// Quantized rows first..first + m - 1 of q into tiles t0, t0 + 1, ... of x (reset beforehand, so the padding
// rows are zeros).
inline void interleave(const Rows& q, int64_t first, int64_t m, XTiles& x, int64_t t0) {
  const int64_t k = q.k, groups = k / kGroup, lanes = x.lanes;
  for (int64_t r = 0; r < m; ++r) {
    const int64_t t = t0 + r / lanes, lane = r % lanes;
    const int8_t* src = q.row(first + r);
    int8_t* dst = x.codes.data() + t * k * lanes + lane * 4;
    for (int64_t c = 0; c < k / 4; ++c) std::memcpy(dst + c * 4 * lanes, src + 4 * c, 4);
    const float *scale = q.scale(first + r), *half = q.sums(first + r), *whole = q.whole_sums(first + r);
    float* dx = x.dx.data() + t * groups * lanes + lane;
    float* halves = x.halves.data() + t * groups * 2 * lanes + lane;
    float* wholes = x.wholes.data() + t * groups * lanes + lane;
    for (int64_t g = 0; g < groups; ++g) {
      dx[g * lanes] = scale[g], wholes[g * lanes] = whole[g];
      halves[2 * g * lanes] = half[2 * g], halves[(2 * g + 1) * lanes] = half[2 * g + 1];
    }
  }
}

#if GG_AVX2

// One chunk (four codes of a weight row, broadcast, times four codes of each of eight x rows) into the
// int16 pair sums; every kSum chunks the pairs are widened to int32 into `lo`, or `hi` for a group's second
// half where the halves have their own scales. A pair is at most 2 * 127 times the largest code (4-bit 15,
// 5-bit 31, Q6_K 63, MXFP4's 24; Q8_0's |w| up to 128: alone), and kSum of them stay within 32767: the widening madd
// runs on one unit of the AVX2 EPYC (Zen 3) against maddubs' two, so one per chunk halved the rate. With
// VNNI the chunk's products go straight into the int32 sums (`add_byte_products`).
template <int64_t T, int c>
inline void tile_chunk(__m256i w, __m256i xv, __m256i ones, __m256i& pairs, __m256i& lo, __m256i& hi) {
  constexpr bool kSigned = signed_codes(T), kHalves = half_scaled(T);
#if GG_VNNI  // one vpdpbusd a chunk into the int32 sums: no int16 pairs to widen
  // signed codes: xv is x + 128 (`tile_dot`), the unsigned operand, and w the signed one, so no signs are
  // moved; the sums are x . w + 128 sum(w), the second term taken off per group
  const __m256i u = kSigned ? xv : w, s = kSigned ? w : xv;
  if constexpr (kHalves && c >= 4) {
    hi = add_byte_products(hi, u, s);
  } else {
    lo = add_byte_products(lo, u, s);
  }
  (void)ones, (void)pairs;
#else
  constexpr bool kFifthBit = T == kQ5_0 || T == kQ5_1 || T == kQ5_K;
  // Q2_K and Q3_K (codes up to 3 and 7) would allow more, but their halves are summed apart: four
  constexpr int kSum = kSigned ? 1 : T == kQ6_K ? 2 : (kFifthBit || T == kMXFP4 || kHalves) ? 4 : 8;
  const __m256i p =
      kSigned ? _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(xv, w)) : _mm256_maddubs_epi16(w, xv);
  pairs = c % kSum == 0 ? p : _mm256_add_epi16(pairs, p);
  if constexpr (c % kSum == kSum - 1) {
    const __m256i widened = _mm256_madd_epi16(pairs, ones);
    if constexpr (kHalves && c >= 4) {
      hi = _mm256_add_epi32(hi, widened);
    } else {
      lo = _mm256_add_epi32(lo, widened);
    }
  }
#endif
}

// 128 times the sum of signed codes (what x + 128 adds to the integer sums): per group into out[g], or, for
// types scaled per half group, per half into out[2g] and out[2g + 1].
template <bool kHalves>
inline void code_sums(const uint8_t* codes, int64_t groups, int32_t* out) {
  const __m256i ones = _mm256_set1_epi8(1);
  for (int64_t g = 0; g < groups; ++g) {
    const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + g * kGroup));
    const __m256i fours = add_byte_products(_mm256_setzero_si256(), ones, c);  // eight sums of four codes
    // lanes 0-3 of each 128-bit half: the half group's four sums, added up in every lane
    __m256i v = _mm256_add_epi32(fours, _mm256_shuffle_epi32(fours, 0x4e));
    v = _mm256_add_epi32(v, _mm256_shuffle_epi32(v, 0xb1));
    const int32_t first = _mm256_cvtsi256_si32(v), second = _mm256_extract_epi32(v, 4);
    if constexpr (kHalves) {
      out[2 * g] = 128 * first, out[2 * g + 1] = 128 * second;
    } else {
      out[g] = 128 * (first + second);
    }
  }
}

// W unpacked weight rows times tile t of x: out[j] lane r = weight row j . x row r of the tile.
// Q8_0's codes are signed (|w| times x with w's sign, no offsets); Q6_K, Q3_K and Q2_K have a scale and an
// offset per half group, the others one per group.
// With VNNI, signed codes: `shifts[j]` holds what x + 128 adds to weight row j's integer sums per group (or
// half group; `code_sums`); otherwise unused.
template <int W, int64_t T>
inline void tile_dot(const Unpacked* u, const int32_t* const* shifts, int64_t groups, const XTiles& x, int64_t t,
                     __m256* out) {
  constexpr bool kSigned = signed_codes(T), kHalves = half_scaled(T), kShifted = GG_VNNI && kSigned;
  const __m256i offset = _mm256_set1_epi8(static_cast<char>(0x80));
  const int8_t* xc = x.codes_of(t);
  const float* dx = x.dx_of(t);
  const float* sums = kHalves ? x.halves_of(t) : x.wholes_of(t);
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[W];
  for (int j = 0; j < W; ++j) acc[j] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m256i lo[W], hi[W], pairs[W];
    for (int j = 0; j < W; ++j) lo[j] = hi[j] = pairs[j] = _mm256_setzero_si256();
    const int8_t* xg = xc + g * kGroup * kLanes;
    // each half of the group's codes in both 128-bit lanes; a chunk's four codes broadcast from them by
    // vpshufd (a shuffle unit's work, where a broadcast load per chunk made the loads the bottleneck)
    __m256i halves[W][2];
    for (int j = 0; j < W; ++j)
      for (int h = 0; h < 2; ++h)
        halves[j][h] = _mm256_broadcastsi128_si256(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(u[j].codes + g * kGroup + 16 * h)));
#define GG_CHUNK(c)                                                                                                 \
  {                                                                                                                 \
    __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xg + (c) * 4 * kLanes));                       \
    if constexpr (kShifted) xv = _mm256_xor_si256(xv, offset);                                                      \
    for (int j = 0; j < W; ++j) tile_chunk<T, (c)>(_mm256_shuffle_epi32(halves[j][(c) / 4], ((c) % 4) * 0x55), xv,  \
                                                  ones, pairs[j], lo[j], hi[j]);                                  \
  }
    GG_CHUNK(0) GG_CHUNK(1) GG_CHUNK(2) GG_CHUNK(3) GG_CHUNK(4) GG_CHUNK(5) GG_CHUNK(6) GG_CHUNK(7)
#undef GG_CHUNK
    if constexpr (kShifted && kHalves) {
      for (int j = 0; j < W; ++j) {
        lo[j] = _mm256_sub_epi32(lo[j], _mm256_set1_epi32(shifts[j][2 * g]));
        hi[j] = _mm256_sub_epi32(hi[j], _mm256_set1_epi32(shifts[j][2 * g + 1]));
      }
    } else if constexpr (kShifted) {
      for (int j = 0; j < W; ++j) lo[j] = _mm256_sub_epi32(lo[j], _mm256_set1_epi32(shifts[j][g]));
    }
    const __m256 dxv = _mm256_loadu_ps(dx + g * kLanes);
    for (int j = 0; j < W; ++j) {
      const float* a = u[j].a + 2 * g;
      const float* b = u[j].b + 2 * g;
      acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lo[j]), _mm256_mul_ps(_mm256_set1_ps(a[0]), dxv), acc[j]);
      if constexpr (kHalves) {
        acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(hi[j]), _mm256_mul_ps(_mm256_set1_ps(a[1]), dxv), acc[j]);
        acc[j] = _mm256_fmadd_ps(_mm256_set1_ps(b[0]), _mm256_loadu_ps(sums + 2 * g * kLanes), acc[j]);
        acc[j] = _mm256_fmadd_ps(_mm256_set1_ps(b[1]), _mm256_loadu_ps(sums + (2 * g + 1) * kLanes), acc[j]);
      } else if constexpr (!kSigned) {
        acc[j] = _mm256_fmadd_ps(_mm256_set1_ps(b[0]), _mm256_loadu_ps(sums + g * kLanes), acc[j]);
      }
    }
  }
  for (int j = 0; j < W; ++j) out[j] = acc[j];
}

// Weight rows [lo, hi) of w (type T, row_bytes a row) times the m x rows of tiles t0.. of x ->
// out[r * stride + (j - lo)] for x row r and weight row j.
template <int64_t T>
void tile_rows(const uint8_t* w, int64_t row_bytes, int64_t blocks, int64_t lo, int64_t hi, const XTiles& x,
               int64_t t0, int64_t m, float* out, int64_t stride) {
  const int64_t groups = x.k / kGroup;
  std::vector<uint8_t> codes(kTileWeightRows * groups * kGroup + 64);
  std::vector<float> scales(kTileWeightRows * groups * 4);
  Unpacked u[kTileWeightRows];
  for (int p = 0; p < kTileWeightRows; ++p)
    u[p] = {codes.data() + p * groups * kGroup, scales.data() + p * groups * 4,
            scales.data() + p * groups * 4 + groups * 2};
  const int64_t tiles = tiles_for(m);
  const int64_t run = std::max<int64_t>(1, kTileBytes / (x.k * kLanes));  // tiles per pass over the rows
  constexpr bool kHalves = half_scaled(base_of(T));
  const int64_t per_row = kHalves ? 2 * groups : groups;  // `code_sums`' values per weight row
  std::vector<int32_t> shift_values(signed_codes(T) && GG_VNNI ? kTileWeightRows * per_row : 0);
  const int32_t* shifts[kTileWeightRows];
  for (int p = 0; p < kTileWeightRows; ++p)
    shifts[p] = shift_values.empty() ? nullptr : shift_values.data() + p * per_row;
  alignas(32) float lanes[kTileWeightRows][kLanes];
  for (int64_t first = 0; first < tiles; first += run) {
    const int64_t last = std::min(tiles, first + run);
    for (int64_t j = lo; j < hi; j += kTileWeightRows) {
      const int count = static_cast<int>(std::min<int64_t>(kTileWeightRows, hi - j));
      for (int p = 0; p < count; ++p) {
        unpack_row<T>(w + (j + p) * row_bytes, blocks, u[p]);
        if (!shift_values.empty()) code_sums<kHalves>(u[p].codes, groups, shift_values.data() + p * per_row);
      }
      for (int64_t t = first; t < last; ++t) {
        __m256 v[kTileWeightRows];
        switch (count) {
          case 1: tile_dot<1, base_of(T)>(u, shifts, groups, x, t0 + t, v); break;
#if GG_WIDE_TILES
          case 3: tile_dot<3, base_of(T)>(u, shifts, groups, x, t0 + t, v); break;
          case 4: tile_dot<4, base_of(T)>(u, shifts, groups, x, t0 + t, v); break;
#endif
          default: tile_dot<2, base_of(T)>(u, shifts, groups, x, t0 + t, v); break;
        }
        const int64_t rows = std::min(kLanes, m - t * kLanes);
        for (int p = 0; p < count; ++p) {
          _mm256_store_ps(lanes[p], v[p]);
          for (int64_t r = 0; r < rows; ++r) out[(t * kLanes + r) * stride + (j + p - lo)] = lanes[p][r];
        }
      }
    }
  }
}

using TileFn = void (*)(const uint8_t*, int64_t, int64_t, int64_t, int64_t, const XTiles&, int64_t, int64_t, float*,
                        int64_t);

// A tile family's row products of a type: F<T>::fn for each type the kernels read (F: `Avx2TileRows` here,
// gguf_amx.h's `AmxTileRows`).
template <template <int64_t> class F>
TileFn tile_fn_of(int64_t type) {
  switch (type) {
    case kQ4_0: return F<kQ4_0>::fn;
    case kQ4_1: return F<kQ4_1>::fn;
    case kQ5_0: return F<kQ5_0>::fn;
    case kQ5_1: return F<kQ5_1>::fn;
    case kQ8_0: return F<kQ8_0>::fn;
    case kQ2_K: return F<kQ2_K>::fn;
    case kQ3_K: return F<kQ3_K>::fn;
    case kQ4_K: return F<kQ4_K>::fn;
    case kQ5_K: return F<kQ5_K>::fn;
    case kIQ4_NL: return F<kIQ4_NL>::fn;
    case kIQ4_XS: return F<kIQ4_XS>::fn;
    case kQ4_0x4: return F<kQ4_0x4>::fn;
    case kQ4_1x4: return F<kQ4_1x4>::fn;
    case kQ5_0x4: return F<kQ5_0x4>::fn;
    case kQ5_1x4: return F<kQ5_1x4>::fn;
    case kQ8_0x4: return F<kQ8_0x4>::fn;
    case kMXFP4x4: return F<kMXFP4x4>::fn;
    case kIQ4_NLx4: return F<kIQ4_NLx4>::fn;
    case kMXFP4: return F<kMXFP4>::fn;
    case kIQ2_XXS: return F<kIQ2_XXS>::fn;
    case kIQ2_XS: return F<kIQ2_XS>::fn;
    case kIQ2_S: return F<kIQ2_S>::fn;
    case kIQ3_XXS: return F<kIQ3_XXS>::fn;
    case kIQ3_S: return F<kIQ3_S>::fn;
    case kIQ1_S: return F<kIQ1_S>::fn;
    case kIQ1_M: return F<kIQ1_M>::fn;
    default: return F<kQ6_K>::fn;
  }
}

template <int64_t T>
struct Avx2TileRows {
  static constexpr TileFn fn = tile_rows<T>;
};

// The AVX2 tiles' row products of a type (gguf_amx.h's `tile_fn` picks AMX's instead where they run).
inline TileFn avx2_tile_fn(int64_t type) { return tile_fn_of<Avx2TileRows>(type); }

#endif

}  // namespace

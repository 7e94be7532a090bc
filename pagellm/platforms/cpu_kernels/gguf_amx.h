// Five or more x rows times GGUF weight rows on AMX's int8 tiles, where the CPU has them (Intel Xeon from
// Sapphire Rapids on): the same integer sums as gguf_tiles.h's AVX2 tiles, sixteen weight rows by sixteen x
// rows by one (half) group a tile product, so a prefill chunk or a batch of decodes on a quantized file
// runs at the tile unit's rate instead of 256-bit vectors'.
//
// The weights are tile A: sixteen weight rows unpacked once (`unpack_row`: codes, per half group a scale and
// an offset), their codes laid out group by group ([K / 32][16 rows][32]: a tile load reads 512 bytes in
// order; rows K apart measured the same). The x rows are tile B: interleaved sixteen to a tile (`XTiles`
// with kAmxLanes lanes: [K / 4][16 rows][4 codes], AMX's VNNI layout). Per group (or half group, for the
// types whose halves have their own scales) one TDPBUSD (unsigned codes, signed x) or TDPBSSD (Q8_0's and
// IQ4's signed codes) gives the exact int32 sums of the 16 x 16 pairs; they are stored and taken into
// sixteen float32 accumulators, one per weight row, a lane per x row, with the same float operations in the
// same order as the AVX2 tiles (the scale a dx, then the offsets' terms), so both paths give the same
// results bit for bit.
#pragma once

#include "gguf_tiles.h"
#include "kernels.h"

#if GG_AVX2 && defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AVX512F__)
#define GG_AMX 1
#include "amx_tiles.h"
#else
#define GG_AMX 0
#endif

namespace {

constexpr int64_t kAmxLanes = 16;  // x rows in an AMX tile (and weight rows a panel)

// Whether the tiles run on AMX here: built for it and granted by the kernel (amx_available).
inline bool amx_tiles() {
  static const bool on = GG_AMX && amx_available();
  return on;
}

// x rows a tile of `XTiles` holds for products of about `rows` x rows: AMX's sixteen from nine rows where it
// runs (at one AVX2 tile, eight rows or fewer, the AVX2 products were faster: [2048 x 2048] Q4_K at 5 and 8
// rows 0.58 ms against AMX's 0.76-0.93, at 12 rows 1.00 against 0.90), else the AVX2 tiles' eight.
inline int64_t tile_lanes(int64_t rows) { return amx_tiles() && rows > kLanes ? kAmxLanes : kLanes; }

#if GG_AMX

// Two sets, so that one (half) group's products can run while the last one's sums are taken in (on the AMX
// Xeon this measured the same as one set: ~50 ns a product, 16 x 16 x 32, whatever overlaps): tmm0 / tmm3 the
// int32 sums [16 weight rows][16 x rows], tmm1 / tmm4 sixteen weight rows' codes of one (half) group, tmm2 /
// tmm5 the x rows' codes of that (half) group, four at a time.
inline void configure_gguf_tiles(int64_t depth) {
  pagellm_amx::TileConfig config;
  for (int set = 0; set < 2; ++set) {
    config.rows[3 * set] = 16, config.colsb[3 * set] = 64;
    config.rows[3 * set + 1] = 16, config.colsb[3 * set + 1] = static_cast<uint16_t>(depth);
    config.rows[3 * set + 2] = static_cast<uint8_t>(depth / 4), config.colsb[3 * set + 2] = 64;
  }
  _tile_loadconfig(&config);
}

// Sixteen weight rows' (half) group at `w` (rows k apart) times the x tile's at `x`, into tile c (a the
// weights', b x's): literal numbers, which the tile intrinsics need. Stored by the caller one step later,
// so that the tile unit multiplies while the last step's sums are taken in.
#define GG_AMX_PRODUCT(c, a, b, w, x, k, kSigned) \
  do {                                            \
    _tile_zero(c);                                \
    _tile_loadd(a, (w), (k));                     \
    _tile_loadd(b, (x), 64);                      \
    if constexpr (kSigned) {                      \
      _tile_dpbssd(c, a, b);                      \
    } else {                                      \
      _tile_dpbusd(c, a, b);                      \
    }                                             \
  } while (0)

// Weight rows [lo, hi) of w (type T, row_bytes a row) times the m x rows of tiles t0.. of x (kAmxLanes
// lanes) -> out[r * stride + (j - lo)] for x row r and weight row j.
template <int64_t T>
void amx_tile_rows(const uint8_t* w, int64_t row_bytes, int64_t blocks, int64_t lo, int64_t hi, const XTiles& x,
                   int64_t t0, int64_t m, float* out, int64_t stride) {
  constexpr int64_t B = base_of(T);
  constexpr bool kSigned = signed_codes(B), kHalves = half_scaled(B);
  constexpr int64_t kDepth = kHalves ? 16 : kGroup;  // k of one tile product
  const int64_t k = x.k, groups = k / kGroup;
  std::vector<uint8_t> row(k), codes(kAmxLanes * k);  // one row's codes; the panel's, group-major
  std::vector<float> scales(kAmxLanes * groups * 4);
  float* a = scales.data();                            // [16 rows][groups * 2]
  float* b = scales.data() + kAmxLanes * groups * 2;  // [16 rows][groups * 2]
  alignas(64) int32_t sums[2][kAmxLanes][kAmxLanes];
  alignas(64) float lanes[kAmxLanes][kAmxLanes];
  configure_gguf_tiles(kDepth);
  for (int64_t j0 = lo; j0 < hi; j0 += kAmxLanes) {
    const int64_t rows = std::min(kAmxLanes, hi - j0);
    for (int64_t r = 0; r < kAmxLanes; ++r) {
      Unpacked u{row.data(), a + r * groups * 2, b + r * groups * 2};
      if (r < rows) {
        unpack_row<T>(w + (j0 + r) * row_bytes, blocks, u);
      } else {  // a short last panel: zero rows
        std::fill(row.begin(), row.end(), 0);
        std::fill(u.a, u.a + groups * 2, 0.f), std::fill(u.b, u.b + groups * 2, 0.f);
      }
      // group g of the sixteen rows one contiguous [16][32] block: a tile load reads 512 bytes in order
      for (int64_t g = 0; g < groups; ++g)
        std::memcpy(codes.data() + (g * kAmxLanes + r) * kGroup, row.data() + g * kGroup, kGroup);
    }
    for (int64_t t = 0; t * kAmxLanes < m; ++t) {
      const int8_t* xc = x.codes_of(t0 + t);
      const float* dx = x.dx_of(t0 + t);
      const float* offsets = kHalves ? x.halves_of(t0 + t) : x.wholes_of(t0 + t);
      __m512 acc[kAmxLanes];
      for (int64_t r = 0; r < kAmxLanes; ++r) acc[r] = _mm512_setzero_ps();
      // (half) group i's products on tile set i % 2
      const int64_t steps = groups * (kHalves ? 2 : 1);
      const auto product = [&](int64_t i) {
        const int64_t at = kHalves ? (i / 2) * kGroup + (i % 2) * 16 : i * kGroup;  // k of the step
        const uint8_t* wg = codes.data() + (at / kGroup) * kAmxLanes * kGroup + at % kGroup;
        if (i % 2 == 0) {
          GG_AMX_PRODUCT(0, 1, 2, wg, xc + at * kAmxLanes, kGroup, kSigned);
        } else {
          GG_AMX_PRODUCT(3, 4, 5, wg, xc + at * kAmxLanes, kGroup, kSigned);
        }
      };
      // step i's sums into the accumulators (stored from its tiles a step earlier)
      const auto take = [&](int64_t i) {
        const int64_t g = kHalves ? i / 2 : i, h = kHalves ? i % 2 : 0;
        const __m512 dxv = _mm512_loadu_ps(dx + g * kAmxLanes);
#pragma GCC unroll 16
        for (int64_t r = 0; r < kAmxLanes; ++r) {
          const __m512 scale = _mm512_mul_ps(_mm512_set1_ps(a[r * groups * 2 + 2 * g + h]), dxv);
          acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(sums[i % 2][r])), scale, acc[r]);
        }
        if (h == 0 && kHalves) return;
        if constexpr (kHalves) {
          const __m512 lo_sums = _mm512_loadu_ps(offsets + 2 * g * kAmxLanes);
          const __m512 hi_sums = _mm512_loadu_ps(offsets + (2 * g + 1) * kAmxLanes);
#pragma GCC unroll 16
          for (int64_t r = 0; r < kAmxLanes; ++r) {
            acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(b[r * groups * 2 + 2 * g]), lo_sums, acc[r]);
            acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(b[r * groups * 2 + 2 * g + 1]), hi_sums, acc[r]);
          }
        } else if constexpr (!kSigned) {
          const __m512 group_sums = _mm512_loadu_ps(offsets + g * kAmxLanes);
#pragma GCC unroll 16
          for (int64_t r = 0; r < kAmxLanes; ++r)
            acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(b[r * groups * 2 + 2 * g]), group_sums, acc[r]);
        }
      };
      // products issued a step ahead, sums stored a step before they are taken in: the tile unit, the
      // stores and the vector work of three steps overlap
      product(0);
      for (int64_t i = 0; i < steps; ++i) {
        if (i + 1 < steps) product(i + 1);
        if (i % 2 == 0) {
          _tile_stored(0, sums[0], 64);
        } else {
          _tile_stored(3, sums[1], 64);
        }
        if (i > 0) take(i - 1);
      }
      take(steps - 1);
      for (int64_t r = 0; r < kAmxLanes; ++r) _mm512_store_ps(lanes[r], acc[r]);
      const int64_t valid = std::min(kAmxLanes, m - t * kAmxLanes);
      for (int64_t lane = 0; lane < valid; ++lane)
        for (int64_t r = 0; r < rows; ++r) out[(t * kAmxLanes + lane) * stride + (j0 + r - lo)] = lanes[r][lane];
    }
  }
  _tile_release();
}

template <int64_t T>
struct AmxTileRows {
  static constexpr TileFn fn = amx_tile_rows<T>;
};

#endif

#if GG_AVX2
// The tiles' row products for x interleaved with `lanes` lanes (`tile_lanes`): AMX's for kAmxLanes, else
// the AVX2 ones (`avx2_tile_fn`).
inline TileFn tile_fn(int64_t type, int64_t lanes) {
#if GG_AMX
  if (lanes == kAmxLanes) return tile_fn_of<AmxTileRows>(type);
#endif
  return avx2_tile_fn(type);
}
#endif

}  // namespace

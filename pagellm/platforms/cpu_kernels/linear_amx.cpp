// Linear layers on AMX tiles: bf16 (TDPBF16PS) and W8A8 int8 (TDPBSSD).
//
// Why: at 16-64 rows, oneDNN streamed the weights at 13-17 GB/s on a machine that reads 28-31 GB/s, and a
// decode step of a 0.5B model is mostly that stream. Here each thread walks its own contiguous run of
// 16-column weight panels, pre-laid out so that every 1 KB tile is one sequential read, and multiplies
// each tile against all the rows at once (one tile product per 16 rows), so the weights are read once
// per call at close to the machine's read bandwidth. int8 weights halve those bytes again.
//
// Layout of a packed weight W [N, K]: [ceil(N/16)][ceil(K/kt)][16][64 bytes], kt = 32 (bf16) or 64 (int8),
// where tile (n, k) row r holds, for the 16 columns c, the g = 2 (bf16) or 4 (int8) values
// W[16n + c][kt k + g r ... + g - 1] (AMX's VNNI groups); padding is zero. bf16 products are summed in
// float32 (as oneDNN's bf16 GEMM, in another order); int8 ones in int32, exactly. The bias is added in
// float32 and the result rounded to bf16 once.
//
// Built with the other CPU kernels (-march=native); where the compiler or CPU has no AMX the functions
// report it (amx_available() is false) and the caller keeps oneDNN.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "kernels.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AMX_INT8__) && defined(__AVX512F__)
#define PL_AMX 1  // AMX CPUs all have AVX-512 (and BF16)
#include <immintrin.h>
#include <sys/syscall.h>

#include "amx_tiles.h"
#include <unistd.h>
#else
#define PL_AMX 0
#endif

namespace {

constexpr int64_t kTileCols = 16;   // output columns per panel
constexpr int64_t kTileBytes = 1024;  // 16 rows of 64 bytes
constexpr int64_t kRowsPerTile = 16;
constexpr int64_t kCachedBytes = 1 << 20;  // bytes of x kept in cache while a thread's panels pass

#if PL_AMX
bool request_amx() {
  // Linux hands out the AMX register state only on request (once per process).
  constexpr int kArchReqXcompPerm = 0x1023;
  constexpr int kXfeatureXtiledata = 18;
  static const bool ok = syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  return ok;
}

// 16 floats to bf16, rounding to nearest even (as torch does; NaN stays NaN).
inline float bf16_bits_to_float(uint16_t v) {
  const uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline __m256i to_bf16(__m512 v) {
#ifdef __AVX512BF16__
  return (__m256i)_mm512_cvtneps_pbh(v);
#else
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7fff)), lsb);
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  rounded = _mm512_mask_mov_epi32(rounded, nan, _mm512_or_si512(bits, _mm512_set1_epi32(0x400000)));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16));
#endif
}

// tmm[SUM] += tmm[X] . tmm[W]: int8 x int8 into int32, or bf16 pairs into float32. A macro: the tile
// intrinsics take register numbers as literals.
#define PL_TILE_DOT(INT8, SUM, X, W) \
  do {                                \
    if constexpr (INT8) {             \
      _tile_dpbssd(SUM, X, W);        \
    } else {                          \
      _tile_dpbf16ps(SUM, X, W);      \
    }                                 \
  } while (0)

// Sums of kRows row tiles (16 rows each) of x against kPanels 16-column panels, into
// sums[panel][row tile * 16 + r][16] (float32 for bf16, int32 for int8). tmm0-3: sums (row tile i,
// panel j -> tmm 2i + j), tmm4-5: rows of x, tmm6-7: weight tiles. Each x tile loaded serves every
// panel and each weight tile every row tile. Both kinds step 64 bytes of x and 1 KB of weights a tile.
template <int kRows, int kPanels, bool kInt8>
void block(const uint8_t* x, int64_t x_stride_bytes, const uint8_t* w0, const uint8_t* w1, int64_t k_tiles,
           void* sums) {
  static_assert(kRows >= 1 && kRows <= 2 && kPanels >= 1 && kPanels <= 2, "at most 2 x 2 tiles");
  _tile_zero(0);
  if (kPanels > 1) _tile_zero(1);
  if (kRows > 1) _tile_zero(2);
  if (kRows > 1 && kPanels > 1) _tile_zero(3);
  const int64_t row_step = kRowsPerTile * x_stride_bytes;
  for (int64_t k = 0; k < k_tiles; ++k) {
    const uint8_t* t0 = w0 + k * kTileBytes;
    const uint8_t* t1 = w1 + k * kTileBytes;
    const uint8_t* xk = x + k * 64;
    _tile_loadd(4, xk, x_stride_bytes);
    if (kRows > 1) _tile_loadd(5, xk + row_step, x_stride_bytes);
    _tile_loadd(6, t0, 64);
    PL_TILE_DOT(kInt8, 0, 4, 6);
    if (kRows > 1) PL_TILE_DOT(kInt8, 2, 5, 6);
    if (kPanels > 1) {
      _tile_loadd(7, t1, 64);
      PL_TILE_DOT(kInt8, 1, 4, 7);
      if (kRows > 1) PL_TILE_DOT(kInt8, 3, 5, 7);
    }
  }
  auto* out = static_cast<uint8_t*>(sums);
  constexpr int64_t kTileSums = kRowsPerTile * kTileCols * 4;  // bytes of one tile's sums
  _tile_stored(0, out, 64);
  if (kRows > 1) _tile_stored(2, out + kTileSums, 64);
  if (kPanels > 1) {
    _tile_stored(1, out + 2 * kTileSums, 64);
    if (kRows > 1) _tile_stored(3, out + 3 * kTileSums, 64);
  }
}

template <bool kInt8, int kRows>
void run_block(int panels, const uint8_t* x, int64_t x_stride_bytes, const uint8_t* w0, const uint8_t* w1,
               int64_t k_tiles, void* sums) {
  if (panels == 2) {
    block<kRows, 2, kInt8>(x, x_stride_bytes, w0, w1, k_tiles, sums);
  } else {
    block<kRows, 1, kInt8>(x, x_stride_bytes, w0, w1, k_tiles, sums);
  }
}

// The shared loop: threads take contiguous runs of panel pairs, so each pair's weights are read from
// memory once and reused (from cache) by every pair of row tiles; rows go in blocks whose x stays in
// cache (~1 MB) while the thread's panels pass. `store(row0, rows, col0, cols, sums)` writes the output
// of one panel (sums: [32][16] float or int32, row-major).
// m_pad: m rounded up to whole tiles (x padded with zero rows), or m itself below one tile (tiles of m rows).
template <bool kInt8, typename Store>
void run_panels(const uint8_t* xs, int64_t x_stride, int64_t m, int64_t m_pad, const uint8_t* ws,
                int64_t n_panels, int64_t k_tiles, int64_t n, Store store) {
  const int64_t n_pairs = (n_panels + 1) / 2;
  const int64_t block_rows = std::max<int64_t>(32, (kCachedBytes / x_stride) / 32 * 32);
  const int64_t panel_bytes = k_tiles * kTileBytes;
  at::parallel_for(0, n_pairs, 1, [&](int64_t begin, int64_t end) {
    pagellm_amx::configure_tiles(static_cast<int>(std::min(m_pad, kRowsPerTile)));
    alignas(64) int32_t sums[2 * 2 * kRowsPerTile * kTileCols];
    for (int64_t block0 = 0; block0 < m_pad; block0 += block_rows) {
      const int64_t block_end = std::min(m_pad, block0 + block_rows);
      for (int64_t pair = begin; pair < end; ++pair) {
        const int64_t p0 = 2 * pair;
        const int panels = p0 + 1 < n_panels ? 2 : 1;
        const uint8_t* w0 = ws + p0 * panel_bytes;
        const uint8_t* w1 = w0 + (panels > 1 ? panel_bytes : 0);
        for (int64_t row0 = block0; row0 < block_end; row0 += 2 * kRowsPerTile) {
          const int row_tiles = row0 + kRowsPerTile < m_pad ? 2 : 1;
          const uint8_t* xr = xs + row0 * x_stride;
          if (row_tiles == 2) {
            run_block<kInt8, 2>(panels, xr, x_stride, w0, w1, k_tiles, sums);
          } else {
            run_block<kInt8, 1>(panels, xr, x_stride, w0, w1, k_tiles, sums);
          }
          const int64_t rows = std::min<int64_t>(row_tiles * kRowsPerTile, m - row0);
          for (int j = 0; j < panels; ++j) {
            const int64_t col0 = (p0 + j) * kTileCols;
            store(row0, rows, col0, std::min(kTileCols, n - col0), sums + j * 2 * kRowsPerTile * kTileCols);
          }
        }
      }
    }
    _tile_release();
  });
}

// One panel's sums (float32 for bf16; int32 for int8, scaled by w_scale[col] * x_scale[row]) plus the bias,
// rounded to bf16 into out[row0 + r][col0 + c].
template <bool kInt8>
void store_panel(uint16_t* out, int64_t n, int64_t row0, int64_t rows, int64_t col0, int64_t cols,
                 const int32_t* sums, const float* bias, const float* w_scale, const float* x_scale) {
  const __mmask16 mask = static_cast<__mmask16>((1u << cols) - 1u);
  const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + col0) : _mm512_setzero_ps();
  const __m512 sw = kInt8 ? _mm512_maskz_loadu_ps(mask, w_scale + col0) : _mm512_setzero_ps();
  for (int64_t r = 0; r < rows; ++r) {
    __m512 v;
    if constexpr (kInt8) {
      const __m512 sums_f = _mm512_cvtepi32_ps(_mm512_load_si512(sums + r * kTileCols));
      v = _mm512_fmadd_ps(sums_f, _mm512_mul_ps(sw, _mm512_set1_ps(x_scale[row0 + r])), b);
    } else {
      v = _mm512_add_ps(_mm512_load_ps(reinterpret_cast<const float*>(sums) + r * kTileCols), b);
    }
    _mm256_mask_storeu_epi16(out + (row0 + r) * n + col0, mask, to_bf16(v));
  }
}

inline const float* float_bias(const c10::optional<at::Tensor>& bias, at::Tensor& holder) {
  if (!bias.has_value() || !bias->defined()) return nullptr;
  holder = bias->to(at::kFloat).contiguous();
  return holder.data_ptr<float>();
}

inline void check_packed(const at::Tensor& x, const at::Tensor& packed, int64_t n, int64_t k_per_tile,
                         const char* name) {
  TORCH_CHECK(request_amx(), name, ": the kernel cannot get the AMX state on this machine");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, name, ": 2-d bfloat16 input");
  TORCH_CHECK(packed.size(0) == (n + kTileCols - 1) / kTileCols &&
                  packed.size(1) == (x.size(1) + k_per_tile - 1) / k_per_tile,
              name, ": the packed weight does not match the input");
}
#endif

// W [N, K] (bf16: 2 bytes, int8: 1) -> 16-column panels of 1 KB tiles, each tile row holding, for the 16
// columns, the next `group` consecutive k values of that column (AMX's VNNI layout: pairs for bf16,
// quads for int8); zero padding.
at::Tensor pack_tiles(const at::Tensor& weight, int64_t group) {
  const auto w = weight.contiguous();
  const int64_t n = w.size(0), k = w.size(1), elem = w.element_size(), k_per_tile = 64 / elem;
  const int64_t n_panels = (n + kTileCols - 1) / kTileCols, k_tiles = (k + k_per_tile - 1) / k_per_tile;
  auto packed = w.new_zeros({n_panels, k_tiles, kRowsPerTile, 64 / elem});
  const auto* src = static_cast<const uint8_t*>(w.data_ptr());
  auto* dst = static_cast<uint8_t*>(packed.data_ptr());
  // A group (2 bf16 or 4 int8 values) is 4 bytes, so a row's whole groups move as 32-bit words: word u of
  // the row goes to tile u / 16, tile row u % 16, column slot c (an element at a time ran at 0.4 GB/s, 2.5 s
  // of a start for a 0.5B model); the values of a last partial group (an odd K) one by one.
  const int64_t words = k / group;
  at::parallel_for(0, n_panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      uint8_t* panel = dst + p * k_tiles * kTileBytes;
      for (int64_t c = 0; c < kTileCols && p * kTileCols + c < n; ++c) {
        const uint8_t* row = src + (p * kTileCols + c) * k * elem;
        for (int64_t u = 0; u < words; ++u)
          std::memcpy(panel + (u / kRowsPerTile) * kTileBytes + (u % kRowsPerTile) * 64 + c * 4, row + u * 4, 4);
        for (int64_t kk = words * group; kk < k; ++kk) {
          const int64_t t = kk / k_per_tile, r = (kk % k_per_tile) / group, j = kk % group;
          std::memcpy(panel + t * kTileBytes + r * 64 + (c * group + j) * elem, row + kk * elem, elem);
        }
      }
    }
  });
  return packed;
}

}  // namespace

bool amx_available() {
#if PL_AMX
  return request_amx();
#else
  return false;
#endif
}

at::Tensor amx_pack(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16, "amx_pack: a 2-d bfloat16 weight");
  return pack_tiles(weight, 2);
}

at::Tensor amx_pack_int8(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kChar, "amx_pack_int8: a 2-d int8 weight");
  return pack_tiles(weight, 4);
}

// x [..., K] @ W^T (+ bias) -> [..., N] bf16, W packed by amx_pack, with its N; x is rounded to bf16 first.
at::Tensor amx_linear(const at::Tensor& input, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                      int64_t n) {
#if PL_AMX
  TORCH_CHECK(input.dim() >= 1, "amx_linear: x needs a feature dimension");
  if (input.dim() != 2 || input.scalar_type() != at::kBFloat16) {
    std::vector<int64_t> shape(input.sizes().begin(), input.sizes().end());
    shape.back() = n;
    return amx_linear(input.reshape({-1, input.size(-1)}).to(at::kBFloat16), packed, bias, n).view(shape);
  }
  const at::Tensor& x = input;
  check_packed(x, packed, n, 32, "amx_linear");
  const int64_t m = x.size(0), k = x.size(1), k_tiles = packed.size(1);
  auto out = x.new_empty({m, n});
  if (m == 0) return out;
  // Rows padded to whole tiles and k to whole tiles, so every tile load is full (the padding is zero); fewer
  // rows than a tile (a decode step) as they are, in tiles of that many rows, where k fills whole tiles: the
  // padded copy cost a one-row call a fifth of its time on model S's shapes.
  const int64_t k_pad = k_tiles * 32;
  const bool short_rows = m < kRowsPerTile && k_pad == k && x.is_contiguous();
  const int64_t m_pad = short_rows ? m : (m + kRowsPerTile - 1) / kRowsPerTile * kRowsPerTile;
  at::Tensor xp = x;
  if (m_pad != m || k_pad != k || !x.is_contiguous()) {
    xp = x.new_zeros({m_pad, k_pad});
    xp.narrow(0, 0, m).narrow(1, 0, k).copy_(x);
  }
  at::Tensor bias_holder;
  const float* bs = float_bias(bias, bias_holder);
  auto* os = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  run_panels<false>(static_cast<const uint8_t*>(xp.data_ptr()), k_pad * 2, m, m_pad,
                    static_cast<const uint8_t*>(packed.data_ptr()), packed.size(0), k_tiles, n,
                    [&](int64_t row0, int64_t rows, int64_t col0, int64_t cols, const int32_t* sums) {
                      store_panel<false>(os, n, row0, rows, col0, cols, sums, bs, nullptr, nullptr);
                    });
  return out;
#else
  TORCH_CHECK(false, "amx_linear: this build has no AMX (compiler or CPU)");
  return at::Tensor();
#endif
}

// W8A8: x [M, K] bf16 quantized per row on the fly (scale = max |x| / 127, round to nearest), times the
// int8 W packed by amx_pack_int8 with its per-column float32 scales; int32 sums, then
// sum * x_scale * w_scale (+ bias) rounded to bf16 once.
at::Tensor amx_linear_w8a8(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& w_scale,
                           const c10::optional<at::Tensor>& bias, int64_t n) {
#if PL_AMX
  check_packed(x, packed, n, 64, "amx_linear_w8a8");
  TORCH_CHECK(w_scale.numel() == n && w_scale.scalar_type() == at::kFloat, "amx_linear_w8a8: float32 scales, one per column");
  const int64_t m = x.size(0), k = x.size(1), k_tiles = packed.size(1);
  auto out = x.new_empty({m, n});
  if (m == 0) return out;
  const int64_t m_pad = (m + kRowsPerTile - 1) / kRowsPerTile * kRowsPerTile, k_pad = k_tiles * 64;
  auto xq = x.new_zeros({m_pad, k_pad}, at::kChar);
  std::vector<float> x_scale(m);
  const auto xc = x.contiguous();
  const auto* xs = reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>());
  auto* qs = static_cast<int8_t*>(xq.data_ptr());
  at::parallel_for(0, m, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const uint16_t* row = xs + r * k;
      float absmax = 0.0f;
      for (int64_t i = 0; i < k; ++i) absmax = std::max(absmax, std::fabs(bf16_bits_to_float(row[i])));
      const float scale = absmax > 0.0f ? absmax / 127.0f : 1.0f;  // x / scale, as the reference divides
      x_scale[r] = scale;
      int8_t* q = qs + r * k_pad;
      for (int64_t i = 0; i < k; ++i) {
        q[i] = static_cast<int8_t>(std::nearbyint(std::min(127.0f, std::max(-127.0f, bf16_bits_to_float(row[i]) / scale))));
      }
    }
  });
  const auto ws_f = w_scale.contiguous();
  const float* wsc = ws_f.data_ptr<float>();
  at::Tensor bias_holder;
  const float* bs = float_bias(bias, bias_holder);
  auto* os = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  run_panels<true>(reinterpret_cast<const uint8_t*>(qs), k_pad, m, m_pad,
                   static_cast<const uint8_t*>(packed.data_ptr()), packed.size(0), k_tiles, n,
                   [&](int64_t row0, int64_t rows, int64_t col0, int64_t cols, const int32_t* sums) {
                     store_panel<true>(os, n, row0, rows, col0, cols, sums, bs, wsc, x_scale.data());
                   });
  return out;
#else
  TORCH_CHECK(false, "amx_linear_w8a8: this build has no AMX (compiler or CPU)");
  return at::Tensor();
#endif
}

// bf16 linear layers on AMX tiles, for decode-sized batches.
//
// Why: at 16-64 rows, oneDNN streamed the weights at 13-17 GB/s on a machine that reads 28-31 GB/s, and a
// decode step of a 0.5B model is mostly that stream. Here each thread walks its own contiguous run of
// 16-column weight panels, pre-laid out so that every 1 KB tile is one sequential read, and multiplies
// each tile against all the rows at once (one TDPBF16PS per 16 rows), so the weights are read once
// per call at close to the machine's read bandwidth.
//
// Layout of a packed weight W [N, K] (bf16): [ceil(N/16)][ceil(K/32)][16][32] bf16, where tile (n, k) row r
// holds, for the 16 columns c, the pair W[16n + c][32k + 2r], W[16n + c][32k + 2r + 1] (AMX's VNNI pairs);
// padding is zero. Products are bf16 x bf16 summed in float32 (the same as oneDNN's bf16 GEMM, in another
// order), then the bias is added in float32 and the result rounded to bf16 once.
//
// Built with the other CPU kernels (-march=native); where the compiler or CPU has no AMX the functions
// report it (available() is false) and the caller keeps oneDNN.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cstdint>
#include <cstring>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__)
#define PL_AMX 1  // AMX CPUs all have AVX-512 (and BF16)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#else
#define PL_AMX 0
#endif

namespace {

constexpr int64_t kTileCols = 16;   // output columns per panel
constexpr int64_t kTileK = 32;      // k per tile (16 VNNI pairs)
constexpr int64_t kRowsPerTile = 16;
constexpr int64_t kCachedBytes = 1 << 20;  // bytes of x kept in cache while a thread's panels pass

#if PL_AMX
struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

bool request_amx() {
  // Linux hands out the AMX register state only on request (once per process).
  constexpr int kArchReqXcompPerm = 0x1023;
  constexpr int kXfeatureXtiledata = 18;
  static const bool ok = syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  return ok;
}

void configure_tiles() {
  TileConfig config;
  for (int t = 0; t < 8; ++t) {  // tmm0-3: float32 sums, tmm4: rows of x, tmm5: weight tile
    config.rows[t] = kRowsPerTile;
    config.colsb[t] = 64;
  }
  _tile_loadconfig(&config);
}

// 16 floats to bf16, rounding to nearest even (as torch does; NaN stays NaN).
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

// Sums of kRows row tiles (16 rows each) of x against kPanels 16-column panels, into
// sums[panel][row tile * 16 + r][16]. tmm0-3: sums (row tile i, panel j -> tmm 2i + j), tmm4-5: rows of x,
// tmm6-7: weight tiles. Each x tile loaded serves every panel and each weight tile every row tile.
template <int kRows, int kPanels>
void block(const uint16_t* x, int64_t x_stride_bytes, const uint16_t* w0, const uint16_t* w1, int64_t k_tiles,
           float* sums) {
  static_assert(kRows >= 1 && kRows <= 2 && kPanels >= 1 && kPanels <= 2, "at most 2 x 2 tiles");
  _tile_zero(0);
  if (kPanels > 1) _tile_zero(1);
  if (kRows > 1) _tile_zero(2);
  if (kRows > 1 && kPanels > 1) _tile_zero(3);
  const int64_t row_step = kRowsPerTile * x_stride_bytes / 2;
  constexpr int64_t kTileElems = kTileK * kTileCols;
  for (int64_t k = 0; k < k_tiles; ++k) {
    const uint16_t* t0 = w0 + k * kTileElems;
    const uint16_t* t1 = w1 + k * kTileElems;
    const uint16_t* xk = x + k * kTileK;
    _tile_loadd(4, xk, x_stride_bytes);
    if (kRows > 1) _tile_loadd(5, xk + row_step, x_stride_bytes);
    _tile_loadd(6, t0, 64);
    _tile_dpbf16ps(0, 4, 6);
    if (kRows > 1) _tile_dpbf16ps(2, 5, 6);
    if (kPanels > 1) {
      _tile_loadd(7, t1, 64);
      _tile_dpbf16ps(1, 4, 7);
      if (kRows > 1) _tile_dpbf16ps(3, 5, 7);
    }
  }
  constexpr int64_t kPanelSums = 2 * kRowsPerTile * kTileCols;  // floats per panel in `sums`
  _tile_stored(0, sums, 64);
  if (kRows > 1) _tile_stored(2, sums + kRowsPerTile * kTileCols, 64);
  if (kPanels > 1) {
    _tile_stored(1, sums + kPanelSums, 64);
    if (kRows > 1) _tile_stored(3, sums + kPanelSums + kRowsPerTile * kTileCols, 64);
  }
}

template <int kRows>
void run_block(int panels, const uint16_t* x, int64_t x_stride_bytes, const uint16_t* w0, const uint16_t* w1,
               int64_t k_tiles, float* sums) {
  if (panels == 2) {
    block<kRows, 2>(x, x_stride_bytes, w0, w1, k_tiles, sums);
  } else {
    block<kRows, 1>(x, x_stride_bytes, w0, w1, k_tiles, sums);
  }
}
#endif

}  // namespace

bool amx_available() {
#if PL_AMX
  return request_amx();
#else
  return false;
#endif
}

// W [N, K] bf16 -> the tile layout above.
at::Tensor amx_pack(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16, "amx_pack: a 2-d bfloat16 weight");
  const auto w = weight.contiguous();
  const int64_t n = w.size(0), k = w.size(1);
  const int64_t n_panels = (n + kTileCols - 1) / kTileCols, k_tiles = (k + kTileK - 1) / kTileK;
  auto packed = at::zeros({n_panels, k_tiles, kTileK / 2, 2 * kTileCols}, w.options());
  const auto* src = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  auto* dst = reinterpret_cast<uint16_t*>(packed.data_ptr<at::BFloat16>());
  at::parallel_for(0, n_panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      for (int64_t c = 0; c < kTileCols && p * kTileCols + c < n; ++c) {
        const uint16_t* row = src + (p * kTileCols + c) * k;
        for (int64_t kk = 0; kk < k; ++kk) {
          const int64_t t = kk / kTileK, r = (kk % kTileK) / 2, j = kk % 2;
          dst[((p * k_tiles + t) * (kTileK / 2) + r) * (2 * kTileCols) + 2 * c + j] = row[kk];
        }
      }
    }
  });
  return packed;
}

// x [M, K] bf16 @ W^T (+ bias) -> [M, N] bf16, W given packed (amx_pack) with its N.
at::Tensor amx_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                      int64_t n) {
#if PL_AMX
  TORCH_CHECK(request_amx(), "amx_linear: the kernel cannot get the AMX state on this machine");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "amx_linear: 2-d bfloat16 input");
  const int64_t m = x.size(0), k = x.size(1);
  const int64_t n_panels = packed.size(0), k_tiles = packed.size(1);
  TORCH_CHECK(n_panels == (n + kTileCols - 1) / kTileCols && k_tiles == (k + kTileK - 1) / kTileK,
              "amx_linear: the packed weight does not match the input");
  auto out = at::empty({m, n}, x.options());
  if (m == 0) return out;
  // Rows padded to whole tiles and k to whole tiles, so every tile load is full (the padding is zero).
  const int64_t m_pad = (m + kRowsPerTile - 1) / kRowsPerTile * kRowsPerTile, k_pad = k_tiles * kTileK;
  at::Tensor xp = x;
  if (m_pad != m || k_pad != k || !x.is_contiguous()) {
    xp = at::zeros({m_pad, k_pad}, x.options());
    xp.narrow(0, 0, m).narrow(1, 0, k).copy_(x);
  }
  const auto* xs = reinterpret_cast<const uint16_t*>(xp.data_ptr<at::BFloat16>());
  const auto* ws = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  auto* os = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  at::Tensor bias_f;
  const float* bs = nullptr;
  if (bias.has_value() && bias->defined()) {
    bias_f = bias->to(at::kFloat).contiguous();
    bs = bias_f.data_ptr<float>();
  }
  const int64_t x_stride = k_pad * 2;
  // Threads take contiguous runs of panel pairs; each pair's weights are read from memory once and
  // reused (from cache) by every pair of row tiles.
  const int64_t n_pairs = (n_panels + 1) / 2;
  // Rows go in blocks whose x stays in cache (~1 MB) while every panel pair of the thread passes.
  const int64_t block_rows = std::max<int64_t>(32, (kCachedBytes / x_stride) / 32 * 32);
  at::parallel_for(0, n_pairs, 1, [&](int64_t begin, int64_t end) {
    configure_tiles();
    alignas(64) float sums[2 * 2 * kRowsPerTile * kTileCols];
    for (int64_t block0 = 0; block0 < m_pad; block0 += block_rows) {
    for (int64_t pair = begin; pair < end; ++pair) {
      const int64_t p0 = 2 * pair;
      const int panels = p0 + 1 < n_panels ? 2 : 1;
      const uint16_t* w0 = ws + p0 * k_tiles * kTileK * kTileCols;
      const uint16_t* w1 = w0 + (panels > 1 ? k_tiles * kTileK * kTileCols : 0);
      for (int64_t row0 = block0; row0 < std::min(m_pad, block0 + block_rows); row0 += 2 * kRowsPerTile) {
        const int row_tiles = row0 + kRowsPerTile < m_pad ? 2 : 1;
        const uint16_t* xr = xs + row0 * k_pad;
        if (row_tiles == 2) {
          run_block<2>(panels, xr, x_stride, w0, w1, k_tiles, sums);
        } else {
          run_block<1>(panels, xr, x_stride, w0, w1, k_tiles, sums);
        }
        const int64_t rows = std::min<int64_t>(row_tiles * kRowsPerTile, m - row0);
        for (int j = 0; j < panels; ++j) {
          const int64_t col0 = (p0 + j) * kTileCols, cols = std::min(kTileCols, n - col0);
          const float* panel_sums = sums + j * 2 * kRowsPerTile * kTileCols;
          const __mmask16 mask = static_cast<__mmask16>((1u << cols) - 1u);
          const __m512 b = bs ? _mm512_maskz_loadu_ps(mask, bs + col0) : _mm512_setzero_ps();
          for (int64_t r = 0; r < rows; ++r) {
            const __m512 v = _mm512_add_ps(_mm512_load_ps(panel_sums + r * kTileCols), b);
            _mm256_mask_storeu_epi16(os + (row0 + r) * n + col0, mask, to_bf16(v));
          }
        }
      }
    }
    }
    _tile_release();
  });
  return out;
#else
  TORCH_CHECK(false, "amx_linear: this build has no AMX (compiler or CPU)");
  return at::Tensor();
#endif
}

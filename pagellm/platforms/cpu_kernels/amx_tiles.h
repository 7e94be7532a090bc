// The AMX tile configuration both kernels use: all eight tiles 16 rows of 64 bytes (palette 1). Include
// only where the compiler targets AMX (__AMX_TILE__).
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace pagellm_amx {

struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tile state is per thread: call on each thread before its first tile instruction.
inline void configure_full_tiles() {
  TileConfig config;
  for (int t = 0; t < 8; ++t) config.rows[t] = 16, config.colsb[t] = 64;
  _tile_loadconfig(&config);
}

// The same with tiles 0-5 (the sums and the x rows of linear_amx.cpp) `rows` (1-16) rows high, tiles 6-7
// (the weights) full: fewer than 16 x rows are multiplied as they lie, not copied into a padded tile.
inline void configure_tiles(int rows) {
  TileConfig config;
  for (int t = 0; t < 8; ++t) config.rows[t] = t < 6 ? rows : 16, config.colsb[t] = 64;
  _tile_loadconfig(&config);
}

}  // namespace pagellm_amx

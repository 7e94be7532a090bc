// llama.cpp's block formats (GGUF) read in place, the machinery the GGUF kernels share (gguf_linear.cpp's
// linear layers, gguf_moe.cpp's experts): the weight stays the file's bytes, one row of blocks per output
// feature ([N, bytes per row] uint8), and is never widened in memory (the 32-weight block types' rows
// interleaved four blocks at a time at load, the same bytes in another order: `interleave_blocks`).
//
// bfloat16 x is quantized to int8 in groups of 32 (a float32 scale max|x| / 127 per group, as llama.cpp
// quantizes activations for its quantized matmuls; bfloat16 has 8 bits of mantissa to begin with) and
// multiplied with each weight group in integer sums: 32 weights' products in three AVX2 instructions
// (maddubs, madd, convert; two where the CPU has VNNI: vpdpbusd, convert) instead of widening the weights to
// float for FMAs, which at batch 1 made the step
// compute-bound (two cores unpack ~25 G weights/s into floats, against ~30 G/s of Q4 weights that memory
// delivers). float32 x keeps its values and takes the float products (the results of x @ the dequantized
// weights up to the order of the sums), for runs that asked for float32's precision.
//
// Every format is described by the same per-group form, so one loop serves them all:
//
//   sum over a group of 32:  a_lo * S_lo + a_hi * S_hi + b_lo * X_lo + b_hi * X_hi
//
// where S_lo / S_hi are the sums of the weights' codes times x over the group's first and second 16
// elements (int8 x: dx times the integer sums), a_* the weight scales of those halves, b_* the weight
// offsets (a Q4_0 code c means (c - 8) d: b = -8 d; Q4_K's minimum: b = -dmin m) and X_* the sums of x over
// the halves, computed once per call. Q8_0's codes are signed: its integer products take the sign trick
// (|w| times x with w's sign) and no offset. MXFP4's nibbles are looked up as twice their FP4 values plus
// 12 (0-24, unsigned), with an offset of -12 d. IQ4_NL's and IQ4_XS's nibbles are looked up as their grid
// values (kIq4Values, signed like Q8_0's codes: no offset). Q2_K's and Q3_K's 2-bit fields (and Q3_K's
// third bit) are codes 0-3 or 0-7 with a scale and an offset per half group, as Q6_K's. The codebook
// i-quants (IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S) are signed codes with no offset too: each
// 4 or 8 weights an entry of the type's lattice codebook (gguf_iq_grids.h) with their signs, a scale per
// group (per half group for IQ2_XS, IQ2_S and IQ1_M), decoded a group at a time (`iq_group`).
//
// Up to four int8 x rows (a decode step, a few) are multiplied straight from the blocks, one weight row at a
// time, each group decoded once for all of them; the K-quants' per-block scales and minimums are widened
// and multiplied by x's group scales in vectors, eight groups at once (`dot_rows`). One int8 x row against a
// small part's rows in the file's layout (not interleaved: a row of blocks not a multiple of four) goes two
// weight rows at a time (`dot_row_pair`): those rows are short and their epilogue and call were a fifth of
// their time; other rows against one int8 x row go a thread's whole run in one call (`one_row_run`), so
// a short row pays no call through a pointer of its own. Tried and slower on the AVX2 EPYC (Zen 3): four weight rows at a time
// sharing each x group's loads (faster while the weights sit in L3, half the read bandwidth from memory,
// where every decode step's weights come from, software prefetching or not), the 32-weight blocks' scales
// eight blocks at a time in one vector (gathered with vpgatherdd, or loaded one by one and widened at once;
// Q4_0 and Q4_1 lost 20-35%).
//
// A weight row times x rows (`row_times_x`): one int8 x row straight from the blocks (`dot_rows`), else
// the row unpacked once into codes and per-half scales (L1) and multiplied with every x row, kTile x rows
// at a time (float32 x, and int8 x where the AVX2 tiles of gguf_tiles.h are not built); float32 x from
// kSlabRows rows: dequantized slabs of weight rows through torch's GEMM (`slab_matmul`).
// `dequantize_block` widens a block to float32 exactly as gguf-py's numpy code does (the same float32
// operations in the same order, no fused multiply-adds).
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cmath>
#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "gguf_iq_grids.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define GG_AVX2 1
#else
#define GG_AVX2 0
#endif
// VNNI's vpdpbusd for the byte products (AVX-512 VNNI with VL, or AVX-VNNI): `add_byte_products`.
#if GG_AVX2 && ((defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__))
#define GG_VNNI 1
#else
#define GG_VNNI 0
#endif

namespace {

// GGML type numbers (gguf.GGMLQuantizationType), and pagellm's own: the 32-weight block types interleaved by
// four (`interleave_blocks`), numbered kInterleaved + the GGML type.
constexpr int64_t kInterleaved = 1000;
enum Type : int64_t {
  kF32 = 0, kF16 = 1, kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8,
  kQ2_K = 10, kQ3_K = 11, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14, kIQ4_NL = 20, kIQ4_XS = 23, kBF16 = 30, kMXFP4 = 39,
  kQ4_0x4 = kInterleaved + kQ4_0, kQ4_1x4 = kInterleaved + kQ4_1, kQ5_0x4 = kInterleaved + kQ5_0,
  kQ5_1x4 = kInterleaved + kQ5_1, kQ8_0x4 = kInterleaved + kQ8_0, kMXFP4x4 = kInterleaved + kMXFP4,
  kIQ4_NLx4 = kInterleaved + kIQ4_NL,
  // the i-quants on lattice codebooks (gguf_iq_grids.h): 256-weight blocks
  kIQ2_XXS = 16, kIQ2_XS = 17, kIQ3_XXS = 18, kIQ1_S = 19, kIQ3_S = 21, kIQ2_S = 22, kIQ1_M = 29,
};

constexpr bool is_x4(int64_t type) { return type > kInterleaved; }
// The GGML type whose blocks an interleaved type holds (the type itself for the others).
constexpr int64_t base_of(int64_t type) { return is_x4(type) ? type - kInterleaved : type; }
// The i-quants whose weights are codebook entries times signs and a scale (`iq_group`).
constexpr bool is_iq_grid(int64_t type) {
  return type == kIQ2_XXS || type == kIQ2_XS || type == kIQ2_S || type == kIQ3_XXS || type == kIQ3_S ||
         type == kIQ1_S || type == kIQ1_M;
}
constexpr int64_t iq_block_bytes(int64_t type) {
  return type == kIQ2_XXS ? 66 : type == kIQ2_XS ? 74 : type == kIQ2_S ? 82 : type == kIQ3_XXS ? 98
         : type == kIQ3_S ? 110 : type == kIQ1_S ? 50 : 56;
}
// Types whose codes are signed values (no offset): the integer products take the sign trick.
constexpr bool signed_codes(int64_t type) {
  return base_of(type) == kQ8_0 || base_of(type) == kIQ4_NL || type == kIQ4_XS || is_iq_grid(type);
}

// IQ4_NL and IQ4_XS: a nibble n stands for kIq4Values[n] times the scale (a non-linear grid, denser near 0).
// The codes are those values, signed (|v| <= 127: Q8_0's sign trick keeps maddubs' pair sums in range).
constexpr int8_t kIq4Values[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

// IQ4_XS: the eight 6-bit group scales (less 32) of a block: low nibbles from bytes 4-7, high pairs from the
// 16-bit word at byte 2.
inline void iq4_xs_scales(const uint8_t* blk, int out[8]) {
  const int high = blk[2] | blk[3] << 8;
  for (int g = 0; g < 8; ++g) out[g] = (((blk[4 + g / 2] >> (4 * (g % 2))) & 0xf) | ((high >> (2 * g)) & 3) << 4) - 32;
}

// MXFP4 (OCP microscaling FP4, GPT-OSS's experts, in GGML's block): an E8M0 exponent byte e, then 16 bytes
// of E2M1 codes, element l in byte l's low nibble and l + 16 in its high one. A code's value is
// kMxfp4Values[code] (twice its FP4 value, so an integer) times 2^(e - 128), GGML's half of the scale.
constexpr int8_t kMxfp4Values[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
// The products read them shifted by 12, unsigned (maddubs takes them as they are, where signed codes need two
// sign instructions a block), with an offset of -12 d as Q4_0's -8 d.
constexpr uint8_t kMxfp4Codes[16] = {12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0};
constexpr float kMxfp4Offset = -12.f;

// 2^(e - 128) as float32, as GGML's ggml_e8m0_to_fp32_half writes it (subnormal for e < 2).
inline float e8m0_half(uint8_t e) {
  const uint32_t bits = e < 2 ? 0x00200000u << e : static_cast<uint32_t>(e - 1) << 23;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// A weight row's bytes asked into L1 ahead of its products (prefetcht0, a line at a time): at a decode step
// one core otherwise keeps too few of its loads in flight (on the AMX Xeon one thread read ~8 GB/s of
// rows one after another, 11-13 GB/s with the next row prefetched; into L2 only, or non-temporal: slower).
inline void prefetch_row(const uint8_t* p, int64_t bytes) {
  for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(p + b, 0, 3);
}

// Whether the decode-step loops ask for the next weight rows ahead (`prefetch_row`), decided once by the CPU's
// vendor from what was measured: Intel's AMX Xeon read a step's rows 1.2-1.4x faster with it; AMD's Zen 4
// half as fast (two threads over 64 MB of model M's rows: Q4_K 36 -> 21 GB/s, Q6_K 33 -> 16), its own
// prefetchers already following the four streams, and a K-quant row's 40-60 requests at once crowding out
// the loads the products wait on. So AMD CPUs leave it to the hardware.
inline bool rows_asked_ahead() {
#if defined(__x86_64__) || defined(__i386__)
  static const bool intel = [] {
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    if (!__get_cpuid(0, &eax, &ebx, &ecx, &edx)) return false;
    return ebx == 0x756e6547u && edx == 0x49656e69u && ecx == 0x6c65746eu;  // "GenuineIntel"
  }();
  return intel;
#else
  return false;
#endif
}

constexpr int64_t kGroup = 32;  // x is quantized in groups of 32; every block is a whole number of groups
constexpr int kTile = 4;        // x rows that share one unpacking of a weight group
constexpr int64_t kDirectRows = 4;  // int8 x rows multiplied straight from the blocks (`dot_rows`)
// From this many float32 x rows the weights are dequantized to float32, kSlab rows at a time (L2-sized at
// K = 1024: 1 MB), and multiplied by torch's float32 GEMM (`slab_matmul`): at 128 rows of model S's
// [3072 x 576] MLP shape the unpacked-row int8 products ran ~35 GFLOP/s, the GEMM ~70 on the AVX2 EPYC (the
// int8 tiles of gguf_tiles.h, which bfloat16 x takes, ~250).
constexpr int64_t kSlabRows = 32;
constexpr int64_t kSlab = 256;

struct Layout {
  int64_t block;  // weights per block
  int64_t bytes;  // bytes per block
};

bool layout_of(int64_t type, Layout* out) {
  switch (type) {
    case kF32: *out = {1, 4}; return true;
    case kF16: *out = {1, 2}; return true;
    case kBF16: *out = {1, 2}; return true;
    case kQ4_0: *out = {32, 18}; return true;
    case kQ4_1: *out = {32, 20}; return true;
    case kQ5_0: *out = {32, 22}; return true;
    case kQ5_1: *out = {32, 24}; return true;
    case kQ8_0: *out = {32, 34}; return true;
    case kQ2_K: *out = {256, 84}; return true;
    case kQ3_K: *out = {256, 110}; return true;
    case kQ4_K: *out = {256, 144}; return true;
    case kQ5_K: *out = {256, 176}; return true;
    case kQ6_K: *out = {256, 210}; return true;
    case kIQ4_NL: *out = {32, 18}; return true;
    case kIQ4_XS: *out = {256, 136}; return true;
    case kMXFP4: *out = {32, 17}; return true;
    case kIQ2_XXS: *out = {256, 66}; return true;
    case kIQ2_XS: *out = {256, 74}; return true;
    case kIQ2_S: *out = {256, 82}; return true;
    case kIQ3_XXS: *out = {256, 98}; return true;
    case kIQ3_S: *out = {256, 110}; return true;
    case kIQ1_S: *out = {256, 50}; return true;
    case kIQ1_M: *out = {256, 56}; return true;
    case kQ4_0x4: case kQ4_1x4: case kQ5_0x4: case kQ5_1x4: case kQ8_0x4: case kMXFP4x4: case kIQ4_NLx4:
      return layout_of(base_of(type), out);
    default: return false;
  }
}

// Types the integer kernel reads (the float ones are dequantized by the caller instead).
bool has_kernel(int64_t type) {
  switch (type) {
    case kQ4_0: case kQ4_1: case kQ5_0: case kQ5_1: case kQ8_0: return true;
    case kQ2_K: case kQ3_K: case kQ4_K: case kQ5_K: case kQ6_K: case kIQ4_NL: case kIQ4_XS: return true;
    case kQ4_0x4: case kQ4_1x4: case kQ5_0x4: case kQ5_1x4: case kQ8_0x4: case kMXFP4: case kMXFP4x4: return true;
    case kIQ4_NLx4: return true;
    default: return is_iq_grid(type);
  }
}

// ---- four 32-weight blocks interleaved --------------------------------------------------------------------

// Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, MXFP4 and IQ4_NL rows are rewritten at load, four blocks (128 weights) at a time, into a
// layout the one-row products read with fewer instructions; the bytes stay as many. Rows whose blocks are
// not a multiple of four stay as the file has them (model S's 576 weights: a row that short was read no
// faster with its last blocks apart). A super-block:
//
//   the four scales d (float16; MXFP4's four exponent bytes), then (Q4_1, Q5_1) the four minimums m;
//   (Q5_0, Q5_1) the fifth bits, 16 bytes: bit j of byte l is block j's code l, bit 4 + j its code 16 + l;
//   the codes: Q8_0's four blocks of 32 in order; the others' low four bits as two 32-byte vectors, block 2v's
//   code l in byte l's low nibble of vector v and block 2v + 1's in its high nibble.
//
// So the four blocks' scales are one float16 -> float32 conversion and one multiply with x's four group
// scales, a block's codes one or two instructions from a 32-byte load (the file's order, codes 0-15 in the
// low nibbles and 16-31 in the high ones, takes a broadcast, a shift and a mask), and the fifth bits two
// (a shift and a mask, where the file's 32-bit mask per block took six). Rows of 896 weights (Qwen2.5-0.5B's
// width, whose Q4_K_M puts its attention and MLP in Q5_0) were multiplied at 16.7 GB/s from the file's blocks,
// 21.2 GB/s interleaved, with two threads of the AVX2 EPYC (Zen 3); Q8_0, read at ~29 GB/s either way, was
// bound by memory already.
constexpr int64_t kX4Blocks = 4;

// The interleaved type of GGML type `type`, or -1 where it has none.
int64_t interleaved_type(int64_t type) {
  switch (type) {
    case kQ4_0: case kQ4_1: case kQ5_0: case kQ5_1: case kQ8_0: case kMXFP4: case kIQ4_NL: return kInterleaved + type;
    default: return -1;
  }
}

struct X4Parts {
  int64_t block_bytes, codes_at, minimums_at, fifth_at, qs_at;  // offsets in a super-block / a file block
  int64_t scale_bytes = 2;                                       // a block's scale: float16, or MXFP4's byte
};

constexpr X4Parts x4_parts(int64_t base) {
  return base == kQ4_0 || base == kIQ4_NL ? X4Parts{18, 8, -1, -1, 2}
         : base == kQ4_1 ? X4Parts{20, 16, 8, -1, 4}
         : base == kQ5_0 ? X4Parts{22, 24, -1, 8, 6}
         : base == kQ5_1 ? X4Parts{24, 32, 8, 16, 8}
         : base == kMXFP4 ? X4Parts{17, 4, -1, -1, 1, 1}
                         : X4Parts{34, 8, -1, -1, 2};
}

// Four file blocks of GGML type `base` (one after another at `src`) -> one super-block at `dst`, and back.
inline void interleave_blocks(int64_t base, const uint8_t* src, uint8_t* dst) {
  const X4Parts p = x4_parts(base);
  std::memset(dst, 0, kX4Blocks * p.block_bytes);
  for (int j = 0; j < kX4Blocks; ++j) {
    const uint8_t* blk = src + j * p.block_bytes;
    std::memcpy(dst + p.scale_bytes * j, blk, p.scale_bytes);
    if (p.minimums_at >= 0) std::memcpy(dst + p.minimums_at + 2 * j, blk + 2, 2);
    if (base == kQ8_0) {
      std::memcpy(dst + p.codes_at + 32 * j, blk + 2, 32);
      continue;
    }
    uint32_t qh = 0;
    if (p.fifth_at >= 0) std::memcpy(&qh, blk + p.qs_at - 4, 4);
    for (int l = 0; l < 32; ++l) {
      const uint8_t low = l < 16 ? blk[p.qs_at + l] & 0xf : blk[p.qs_at + l - 16] >> 4;
      dst[p.codes_at + 32 * (j / 2) + l] |= static_cast<uint8_t>(low << (4 * (j % 2)));
      if (p.fifth_at >= 0) dst[p.fifth_at + l % 16] |= static_cast<uint8_t>(((qh >> l) & 1) << (j + 4 * (l / 16)));
    }
  }
}

inline void deinterleave_blocks(int64_t base, const uint8_t* src, uint8_t* dst) {
  const X4Parts p = x4_parts(base);
  std::memset(dst, 0, kX4Blocks * p.block_bytes);
  for (int j = 0; j < kX4Blocks; ++j) {
    uint8_t* blk = dst + j * p.block_bytes;
    std::memcpy(blk, src + p.scale_bytes * j, p.scale_bytes);
    if (p.minimums_at >= 0) std::memcpy(blk + 2, src + p.minimums_at + 2 * j, 2);
    if (base == kQ8_0) {
      std::memcpy(blk + 2, src + p.codes_at + 32 * j, 32);
      continue;
    }
    uint32_t qh = 0;
    for (int l = 0; l < 32; ++l) {
      const uint8_t low = (src[p.codes_at + 32 * (j / 2) + l] >> (4 * (j % 2))) & 0xf;
      blk[p.qs_at + l % 16] |= static_cast<uint8_t>(l < 16 ? low : low << 4);
      if (p.fifth_at >= 0) qh |= static_cast<uint32_t>((src[p.fifth_at + l % 16] >> (j + 4 * (l / 16))) & 1) << l;
    }
    if (p.fifth_at >= 0) std::memcpy(blk + p.qs_at - 4, &qh, 4);
  }
}

inline float half_to_float(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  // IEEE half -> float, exact (subnormals, infinities and NaN included)
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1f, mant = h & 0x3ff, bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {
      int e = -1;
      do { ++e, mant <<= 1; } while (!(mant & 0x400));
      bits = sign | static_cast<uint32_t>(127 - 15 - e) << 23 | (mant & 0x3ff) << 13;
    }
  } else if (exp == 0x1f) {
    bits = sign | 0x7f800000u | mant << 13;
  } else {
    bits = sign | (exp + 127 - 15) << 23 | mant << 13;
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline float bf16_bits_to_float(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// Q4_K / Q5_K: the 8 six-bit scales and minimums packed in 12 bytes.
inline void k4_scales(const uint8_t* s, uint8_t sc[8], uint8_t mn[8]) {
  for (int j = 0; j < 4; ++j) {
    sc[j] = s[j] & 63, mn[j] = s[j + 4] & 63;
    sc[j + 4] = (s[j + 8] & 0xf) | ((s[j] >> 6) << 4);
    mn[j + 4] = (s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4);
  }
}

// The same as eight bytes each (byte g: group g's value), from the 12 bytes' three 32-bit words.
inline void k4_scales_packed(const uint8_t* s, uint64_t* sc, uint64_t* mn) {
  uint32_t u[3];
  std::memcpy(u, s, 12);
  const uint32_t low6 = 0x3f3f3f3f, low4 = 0x0f0f0f0f, low2 = 0x03030303;
  const uint32_t sc_lo = u[0] & low6, mn_lo = u[1] & low6;
  const uint32_t sc_hi = (u[2] & low4) | ((u[0] >> 6) & low2) << 4;
  const uint32_t mn_hi = ((u[2] >> 4) & low4) | ((u[1] >> 6) & low2) << 4;
  *sc = sc_lo | static_cast<uint64_t>(sc_hi) << 32;
  *mn = mn_lo | static_cast<uint64_t>(mn_hi) << 32;
}

// Q3_K: 16 six-bit scales (biased by 32) packed in 12 bytes.
inline void k3_scales(const uint8_t* s, int8_t out[16]) {
  for (int j = 0; j < 16; ++j) {
    const int low = (s[j % 8] >> (4 * (j / 8))) & 0xf;
    const int high = (s[8 + j % 4] >> (2 * (j / 4))) & 3;
    out[j] = static_cast<int8_t>((low | high << 4) - 32);
  }
}

// ---- the i-quants' groups ---------------------------------------------------------------------------------

// One group of 32 weights of an i-quant block (IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M; 8
// groups a block): weight l is a[l / 16] times its code, the byte l of `grid` (a codebook value, 8 entries
// of 4 values or 4 of 8 side by side) negated where bit l of `signs` is set. The IQ2 and IQ3 codes are their
// grids' values (8-43, 4-62, 1-15), so signed codes as IQ4_XS's with no offset. IQ1's weights are
// dl (g + delta), g in {-1, 0, 1} and delta +-1/8 (IQ1_S: one sign per group, IQ1_M: one per 8 weights):
// the code 8 g +- 1 (-9..9) with a = dl / 8 gives the same products with no offset, and a code times a is
// dl (g + delta) rounded once, as gguf-py's float32 product is.
struct IqGroup {
  uint64_t grid[4];
  uint32_t signs;
  float a[2];
};

// A float16 as float32: F16C's one instruction where the build has it (the same value: both are exact),
// else `half_to_float`; the one-row products convert a block's scale per group.
inline float iq_half(const uint8_t* p) {
#if GG_AVX2
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
#else
  return half_to_float(p);
#endif
}

// Block `blk` of type T's group g (gguf-py's quants module says where each field lies; the scales are the
// same float32 operations as its numpy code's).
template <int64_t T>
inline void iq_group(const uint8_t* blk, int g, const IqGrids& G, IqGroup* o) {
  if constexpr (T == kIQ2_XXS || T == kIQ3_XXS) {
    // IQ2_XXS: d, then per group 4 index bytes and a 32-bit word: four 7-bit sign indices, a 4-bit scale.
    // IQ3_XXS: d, 64 index bytes (8 a group), then the groups' words.
    const bool three = T == kIQ3_XXS;
    uint32_t word;
    std::memcpy(&word, blk + (three ? 66 + 4 * g : 2 + 8 * g + 4), 4);
    const uint8_t* idx = blk + 2 + 8 * g;
    for (int k = 0; k < 4; ++k) {
      o->grid[k] = three ? G.iq3xxs[idx[2 * k]] | static_cast<uint64_t>(G.iq3xxs[idx[2 * k + 1]]) << 32
                         : G.iq2xxs[idx[k]];
    }
    o->signs = 0;
    for (int k = 0; k < 4; ++k) o->signs |= static_cast<uint32_t>(G.ksigns[(word >> (7 * k)) & 127]) << (8 * k);
    const float a = iq_half(blk) * (0.5f + static_cast<float>(word >> 28)) * (three ? 0.5f : 0.25f);
    o->a[0] = o->a[1] = a;
  } else if constexpr (T == kIQ2_XS) {  // d, 32 16-bit words (9-bit index, 7-bit sign index), 8 scale bytes
    o->signs = 0;
    for (int k = 0; k < 4; ++k) {
      uint16_t q;
      std::memcpy(&q, blk + 2 + 8 * g + 2 * k, 2);
      o->grid[k] = G.iq2xs[q & 511];
      o->signs |= static_cast<uint32_t>(G.ksigns[q >> 9]) << (8 * k);
    }
    const float d = iq_half(blk);
    for (int h = 0; h < 2; ++h) o->a[h] = d * (0.5f + static_cast<float>((blk[66 + g] >> (4 * h)) & 15)) * 0.25f;
  } else if constexpr (T == kIQ2_S) {  // d, 32 index bytes, 32 sign bytes, 8 bytes of index bits 8-9, 8 scales
    for (int k = 0; k < 4; ++k) o->grid[k] = G.iq2s[blk[2 + 4 * g + k] | ((blk[66 + g] >> (2 * k)) & 3) << 8];
    std::memcpy(&o->signs, blk + 34 + 4 * g, 4);
    const float d = iq_half(blk);
    for (int h = 0; h < 2; ++h) o->a[h] = d * (0.5f + static_cast<float>((blk[74 + g] >> (4 * h)) & 15)) * 0.25f;
  } else if constexpr (T == kIQ3_S) {  // d, 64 index bytes, 8 bytes of index bit 8, 32 sign bytes, 4 scale bytes
    const uint8_t *idx = blk + 2 + 8 * g, qh = blk[66 + g];
    for (int k = 0; k < 4; ++k) {
      const uint32_t lo = G.iq3s[idx[2 * k] | ((qh >> (2 * k)) & 1) << 8];
      const uint32_t hi = G.iq3s[idx[2 * k + 1] | ((qh >> (2 * k + 1)) & 1) << 8];
      o->grid[k] = lo | static_cast<uint64_t>(hi) << 32;
    }
    std::memcpy(&o->signs, blk + 74 + 4 * g, 4);
    const int scale = (blk[106 + g / 2] >> (4 * (g % 2))) & 15;
    o->a[0] = o->a[1] = iq_half(blk) * static_cast<float>(1 + 2 * scale);
  } else if constexpr (T == kIQ1_S) {  // d, 32 index bytes, per group a 16-bit word: 4 x 3 index bits, scale, sign
    uint16_t qh;
    std::memcpy(&qh, blk + 34 + 2 * g, 2);
    const uint64_t* grid = G.iq1s[qh >> 15];  // the delta's sign
    for (int k = 0; k < 4; ++k) o->grid[k] = grid[blk[2 + 4 * g + k] | ((qh >> (3 * k)) & 7) << 8];
    o->signs = 0;
    o->a[0] = o->a[1] = iq_half(blk) * static_cast<float>(2 * ((qh >> 12) & 7) + 1) * 0.125f;
  } else {  // IQ1_M: 32 index bytes, 16 bytes (a nibble per 8 weights: 3 index bits, the delta's sign), 4 words
    // of three-bit scales (one per 16 weights) whose top nibbles make d
    uint16_t sc[4];
    std::memcpy(sc, blk + 48, 8);
    const uint16_t d_bits = (sc[0] >> 12) | ((sc[1] >> 8) & 0xf0) | ((sc[2] >> 4) & 0xf00) | (sc[3] & 0xf000);
    uint8_t d_bytes[2];
    std::memcpy(d_bytes, &d_bits, 2);
    const float d = iq_half(d_bytes);
    for (int k = 0; k < 4; ++k) {
      const int nibble = (blk[32 + 2 * g + k / 2] >> (4 * (k % 2))) & 15;
      o->grid[k] = G.iq1s[nibble >> 3][blk[4 * g + k] | (nibble & 7) << 8];
    }
    o->signs = 0;
    for (int h = 0; h < 2; ++h) {
      const int j = 2 * g + h;
      o->a[h] = d * static_cast<float>(2 * ((sc[j / 4] >> (3 * (j % 4))) & 7) + 1) * 0.125f;
    }
  }
}

// The scalar form: the group's 32 signed codes.
inline void iq_codes(const IqGroup& o, uint8_t* codes) {
  uint8_t mags[32];
  std::memcpy(mags, o.grid, 32);
  for (int l = 0; l < 32; ++l) codes[l] = static_cast<uint8_t>((o.signs >> l) & 1 ? -mags[l] : mags[l]);
}

// A block's 256 weights as float32: a times the code, as gguf-py's (d l) g s (IQ2, IQ3; s = +-1) and
// dl (g + delta) (IQ1) round, the same float32 numbers (see IqGroup).
template <int64_t T>
__attribute__((optimize("fp-contract=off"))) void iq_dequantize(const uint8_t* blk, float* y) {
  const IqGrids& grids = iq_grids();
  for (int g = 0; g < 8; ++g) {
    IqGroup o;
    iq_group<T>(blk, g, grids, &o);
    uint8_t codes[32];
    iq_codes(o, codes);
    for (int l = 0; l < 32; ++l) y[32 * g + l] = o.a[l / 16] * static_cast<float>(static_cast<int8_t>(codes[l]));
  }
}

// ---- exact dequantization (gguf-py's numpy order) ---------------------------------------------------------

// One block's weights as float32. The products are kept apart from the sums (volatile temporaries would be
// slower; the attribute stops GCC from fusing them into FMAs, which would round once instead of twice).
__attribute__((optimize("fp-contract=off"))) void dequantize_block(int64_t type, const uint8_t* b, float* y) {
  switch (type) {
    case kF32: std::memcpy(y, b, 4); return;
    case kF16: y[0] = half_to_float(b); return;
    case kBF16: y[0] = bf16_bits_to_float(b); return;
    case kQ4_0: {
      const float d = half_to_float(b);
      for (int l = 0; l < 16; ++l) {
        y[l] = d * static_cast<float>((b[2 + l] & 0xf) - 8);
        y[l + 16] = d * static_cast<float>((b[2 + l] >> 4) - 8);
      }
      return;
    }
    case kQ4_1: {
      const float d = half_to_float(b), m = half_to_float(b + 2);
      for (int l = 0; l < 16; ++l) {
        y[l] = d * static_cast<float>(b[4 + l] & 0xf) + m;
        y[l + 16] = d * static_cast<float>(b[4 + l] >> 4) + m;
      }
      return;
    }
    case kQ5_0: case kQ5_1: {
      const bool q51 = type == kQ5_1;
      const float d = half_to_float(b), m = q51 ? half_to_float(b + 2) : 0.f;
      uint32_t qh;
      std::memcpy(&qh, b + (q51 ? 4 : 2), 4);
      const uint8_t* qs = b + (q51 ? 8 : 6);
      for (int l = 0; l < 16; ++l) {
        const int lo = (qs[l] & 0xf) | ((qh >> l) & 1) << 4, hi = (qs[l] >> 4) | ((qh >> (l + 16)) & 1) << 4;
        if (q51) {
          y[l] = d * static_cast<float>(lo) + m, y[l + 16] = d * static_cast<float>(hi) + m;
        } else {
          y[l] = d * static_cast<float>(lo - 16), y[l + 16] = d * static_cast<float>(hi - 16);
        }
      }
      return;
    }
    case kQ8_0: {
      const float d = half_to_float(b);
      for (int l = 0; l < 32; ++l) y[l] = static_cast<float>(static_cast<int8_t>(b[2 + l])) * d;
      return;
    }
    case kMXFP4: {
      const float d = e8m0_half(b[0]);
      for (int l = 0; l < 16; ++l) {
        y[l] = d * static_cast<float>(kMxfp4Values[b[1 + l] & 0xf]);
        y[l + 16] = d * static_cast<float>(kMxfp4Values[b[1 + l] >> 4]);
      }
      return;
    }
    case kQ2_K: {  // scales[16], qs[64], d, dmin
      const float d = half_to_float(b + 80), dmin = half_to_float(b + 82);
      for (int g = 0; g < 16; ++g) {
        const float dl = d * static_cast<float>(b[g] & 0xf), ml = dmin * static_cast<float>(b[g] >> 4);
        // element 16 g + l: qs byte 32 (g / 8) + 16 (g % 2) + l, bits 2 ((g / 2) % 4)
        const uint8_t* qs = b + 16 + 32 * (g / 8) + 16 * (g % 2);
        const int shift = 2 * ((g / 2) % 4);
        for (int l = 0; l < 16; ++l) y[16 * g + l] = dl * static_cast<float>((qs[l] >> shift) & 3) - ml;
      }
      return;
    }
    case kQ3_K: {  // hmask[32], qs[64], scales[12], d
      const float d = half_to_float(b + 108);
      int8_t sc[16];
      k3_scales(b + 96, sc);
      for (int g = 0; g < 16; ++g) {
        const float dl = d * static_cast<float>(sc[g]);
        const uint8_t* qs = b + 32 + 32 * (g / 8) + 16 * (g % 2);
        const int shift = 2 * ((g / 2) % 4);
        for (int l = 0; l < 16; ++l) {
          const int e = 16 * (g % 2) + l;  // hmask byte; its bit is the element's 32-group
          const int high = (b[e] >> (g / 2)) & 1;
          const int q = ((qs[l] >> shift) & 3) - (high ? 0 : 4);
          y[16 * g + l] = dl * static_cast<float>(q);
        }
      }
      return;
    }
    case kIQ4_NL: {  // d, qs[16]
      const float d = half_to_float(b);
      for (int l = 0; l < 16; ++l) {
        y[l] = d * static_cast<float>(kIq4Values[b[2 + l] & 0xf]);
        y[l + 16] = d * static_cast<float>(kIq4Values[b[2 + l] >> 4]);
      }
      return;
    }
    case kIQ4_XS: {  // d, scales_h (16 bits), scales_l[4], qs[128]: group g's 32 weights from bytes 16 g
      const float d = half_to_float(b);
      int sc[8];
      iq4_xs_scales(b, sc);
      for (int g = 0; g < 8; ++g) {
        const float dl = d * static_cast<float>(sc[g]);
        const uint8_t* qs = b + 8 + 16 * g;
        for (int l = 0; l < 16; ++l) {
          y[32 * g + l] = dl * static_cast<float>(kIq4Values[qs[l] & 0xf]);
          y[32 * g + l + 16] = dl * static_cast<float>(kIq4Values[qs[l] >> 4]);
        }
      }
      return;
    }
    case kQ4_K: case kQ5_K: {  // d, dmin, scales[12], (Q5_K: qh[32]), qs[128]
      const bool q5 = type == kQ5_K;
      const float d = half_to_float(b), dmin = half_to_float(b + 2);
      uint8_t sc[8], mn[8];
      k4_scales(b + 4, sc, mn);
      const uint8_t* qh = b + 16;
      const uint8_t* qs = b + (q5 ? 48 : 16);
      for (int g = 0; g < 8; ++g) {
        const float dl = d * static_cast<float>(sc[g]), ml = dmin * static_cast<float>(mn[g]);
        for (int l = 0; l < 32; ++l) {
          int q = (qs[32 * (g / 2) + l] >> (4 * (g % 2))) & 0xf;
          if (q5) q |= ((qh[l] >> g) & 1) << 4;
          y[32 * g + l] = dl * static_cast<float>(q) - ml;
        }
      }
      return;
    }
    case kIQ2_XXS: iq_dequantize<kIQ2_XXS>(b, y); return;
    case kIQ2_XS: iq_dequantize<kIQ2_XS>(b, y); return;
    case kIQ2_S: iq_dequantize<kIQ2_S>(b, y); return;
    case kIQ3_XXS: iq_dequantize<kIQ3_XXS>(b, y); return;
    case kIQ3_S: iq_dequantize<kIQ3_S>(b, y); return;
    case kIQ1_S: iq_dequantize<kIQ1_S>(b, y); return;
    case kIQ1_M: iq_dequantize<kIQ1_M>(b, y); return;
    case kQ6_K: {  // ql[128], qh[64], scales[16] (int8), d
      const float d = half_to_float(b + 208);
      for (int g = 0; g < 8; ++g) {
        const int h = g / 4, u = g % 4;
        const uint8_t* ql = b + 64 * h + 32 * (u % 2);
        const uint8_t* qh = b + 128 + 32 * h;
        for (int l = 0; l < 32; ++l) {
          const int q = (((ql[l] >> (4 * (u / 2))) & 0xf) | ((qh[l] >> (2 * u)) & 3) << 4) - 32;
          const float dl = d * static_cast<float>(static_cast<int8_t>(b[192 + 2 * g + l / 16]));
          y[32 * g + l] = dl * static_cast<float>(q);
        }
      }
      return;
    }
  }
}

// A row of `blocks` blocks of type `type` as float32 (an interleaved row's super-blocks put back as the
// file's blocks first).
inline void dequantize_row(int64_t type, const uint8_t* row, int64_t blocks, float* y) {
  Layout layout;
  layout_of(type, &layout);
  if (!is_x4(type)) {
    for (int64_t i = 0; i < blocks; ++i) dequantize_block(type, row + i * layout.bytes, y + i * layout.block);
    return;
  }
  uint8_t file_blocks[kX4Blocks * 34];
  for (int64_t i = 0; i < blocks; i += kX4Blocks) {
    deinterleave_blocks(base_of(type), row + i * layout.bytes, file_blocks);
    for (int j = 0; j < kX4Blocks; ++j)
      dequantize_block(base_of(type), file_blocks + j * layout.bytes, y + (i + j) * layout.block);
  }
}

// ---- the weights as codes, scales and offsets, one group of 32 at a time ---------------------------------

// One group's description (see the top of the file): its 32 codes (unsigned, or signed for Q8_0), and the
// scale and offset of each half.
struct Group {
  uint8_t codes[kGroup];
  float a[2], b[2];
};

// A K-quant group g's 32 codes: the `bits`-bit fields at bit bits (g % (8 / bits)) of the 32 bytes at
// qs + 32 (g / (8 / bits)) (Q4_K/Q5_K nibbles, Q2_K/Q3_K pairs), and where `high` is given bit g of its
// byte l as the code's bit `bits` (Q5_K's fifth, Q3_K's third).
inline void field_codes(const uint8_t* qs, int bits, int g, const uint8_t* high, uint8_t* codes) {
  const int per_byte = 8 / bits, mask = (1 << bits) - 1;
  for (int l = 0; l < 32; ++l) {
    int q = (qs[32 * (g / per_byte) + l] >> (bits * (g % per_byte))) & mask;
    if (high != nullptr) q |= ((high[l] >> g) & 1) << bits;
    codes[l] = static_cast<uint8_t>(q);
  }
}

// An i-quant block's eight groups (`iq_group`), as `block_groups` gives them.
template <int64_t T>
int iq_block_groups(const uint8_t* blk, Group* out) {
  const IqGrids& grids = iq_grids();
  for (int g = 0; g < 8; ++g) {
    IqGroup o;
    iq_group<T>(blk, g, grids, &o);
    iq_codes(o, out[g].codes);
    out[g].a[0] = o.a[0], out[g].a[1] = o.a[1], out[g].b[0] = out[g].b[1] = 0.f;
  }
  return 8;
}

// A block's groups, for the plain C++ path (and the reference the AVX2 path follows).
int block_groups(int64_t type, const uint8_t* blk, Group* out) {
  switch (type) {
    case kIQ2_XXS: return iq_block_groups<kIQ2_XXS>(blk, out);
    case kIQ2_XS: return iq_block_groups<kIQ2_XS>(blk, out);
    case kIQ2_S: return iq_block_groups<kIQ2_S>(blk, out);
    case kIQ3_XXS: return iq_block_groups<kIQ3_XXS>(blk, out);
    case kIQ3_S: return iq_block_groups<kIQ3_S>(blk, out);
    case kIQ1_S: return iq_block_groups<kIQ1_S>(blk, out);
    case kIQ1_M: return iq_block_groups<kIQ1_M>(blk, out);
    case kQ4_0: case kQ4_1: {
      const float d = half_to_float(blk), off = type == kQ4_0 ? -8.f * d : half_to_float(blk + 2);
      const uint8_t* qs = blk + (type == kQ4_0 ? 2 : 4);
      for (int l = 0; l < 16; ++l) out->codes[l] = qs[l] & 0xf, out->codes[l + 16] = qs[l] >> 4;
      out->a[0] = out->a[1] = d, out->b[0] = out->b[1] = off;
      return 1;
    }
    case kQ5_0: case kQ5_1: {
      const bool q51 = type == kQ5_1;
      const float d = half_to_float(blk), off = q51 ? half_to_float(blk + 2) : -16.f * d;
      uint32_t qh;
      std::memcpy(&qh, blk + (q51 ? 4 : 2), 4);
      const uint8_t* qs = blk + (q51 ? 8 : 6);
      for (int l = 0; l < 16; ++l) {
        out->codes[l] = (qs[l] & 0xf) | ((qh >> l) & 1) << 4;
        out->codes[l + 16] = (qs[l] >> 4) | ((qh >> (l + 16)) & 1) << 4;
      }
      out->a[0] = out->a[1] = d, out->b[0] = out->b[1] = off;
      return 1;
    }
    case kQ8_0:
      std::memcpy(out->codes, blk + 2, 32);
      out->a[0] = out->a[1] = half_to_float(blk), out->b[0] = out->b[1] = 0.f;
      return 1;
    case kIQ4_NL: case kIQ4_XS: {  // codes are the grid's signed values (see kIq4Values)
      const bool xs = type == kIQ4_XS;
      const float d = half_to_float(blk);
      int sc[8] = {1};
      if (xs) iq4_xs_scales(blk, sc);
      for (int g = 0; g < (xs ? 8 : 1); ++g) {
        const uint8_t* qs = blk + (xs ? 8 + 16 * g : 2);
        for (int l = 0; l < 16; ++l) {
          out[g].codes[l] = static_cast<uint8_t>(kIq4Values[qs[l] & 0xf]);
          out[g].codes[l + 16] = static_cast<uint8_t>(kIq4Values[qs[l] >> 4]);
        }
        out[g].a[0] = out[g].a[1] = xs ? d * sc[g] : d, out[g].b[0] = out[g].b[1] = 0.f;
      }
      return xs ? 8 : 1;
    }
    case kMXFP4:
      for (int l = 0; l < 16; ++l)
        out->codes[l] = kMxfp4Codes[blk[1 + l] & 0xf], out->codes[l + 16] = kMxfp4Codes[blk[1 + l] >> 4];
      out->a[0] = out->a[1] = e8m0_half(blk[0]), out->b[0] = out->b[1] = kMxfp4Offset * out->a[0];
      return 1;
    case kQ4_K: case kQ5_K: {
      const bool q5 = type == kQ5_K;
      const float d = half_to_float(blk), dmin = half_to_float(blk + 2);
      uint8_t sc[8], mn[8];
      k4_scales(blk + 4, sc, mn);
      const uint8_t* qh = blk + 16;
      const uint8_t* qs = blk + (q5 ? 48 : 16);
      for (int g = 0; g < 8; ++g) {
        Group& o = out[g];
        field_codes(qs, 4, g, q5 ? qh : nullptr, o.codes);
        o.a[0] = o.a[1] = d * sc[g], o.b[0] = o.b[1] = -(dmin * mn[g]);
      }
      return 8;
    }
    case kQ2_K: case kQ3_K: {
      // group g: bits 2 (g % 4) of qs bytes 32 (g / 4) + l; Q3_K's third bit is bit g of hmask byte l, and
      // its code c means c - 4 (scale a, offset -4 a); Q2_K's half j has scale d sc and offset -dmin m
      const bool q3 = type == kQ3_K;
      const uint8_t* qs = blk + (q3 ? 32 : 16);
      int8_t sc3[16];
      if (q3) k3_scales(blk + 96, sc3);
      const float d = half_to_float(blk + (q3 ? 108 : 80)), dmin = q3 ? 0.f : half_to_float(blk + 82);
      for (int g = 0; g < 8; ++g) {
        Group& o = out[g];
        field_codes(qs, 2, g, q3 ? blk : nullptr, o.codes);
        for (int half = 0; half < 2; ++half) {
          const int j = 2 * g + half;
          o.a[half] = q3 ? d * sc3[j] : d * (blk[j] & 0xf);
          o.b[half] = q3 ? -4.f * o.a[half] : -(dmin * (blk[j] >> 4));
        }
      }
      return 8;
    }
    case kQ6_K: {
      const float d = half_to_float(blk + 208);
      for (int g = 0; g < 8; ++g) {
        Group& o = out[g];
        const int h = g / 4, u = g % 4;
        const uint8_t* ql = blk + 64 * h + 32 * (u % 2);
        const uint8_t* qh = blk + 128 + 32 * h;
        for (int l = 0; l < 32; ++l)
          o.codes[l] = static_cast<uint8_t>(((ql[l] >> (4 * (u / 2))) & 0xf) | ((qh[l] >> (2 * u)) & 3) << 4);
        for (int half = 0; half < 2; ++half) {
          o.a[half] = d * static_cast<int8_t>(blk[192 + 2 * g + half]);
          o.b[half] = -32.f * o.a[half];
        }
      }
      return 8;
    }
  }
  return 0;
}

// ---- x quantized ------------------------------------------------------------------------------------------

// x's rows as the dot products read them. Quantized (bfloat16 x): int8 codes [m, k], per group the scale dx
// [m, k / 32], and per half group dx times the sum of its codes [m, k / 16] (the offsets' factor). Float
// (float32 x: `floats` set): the rows as they are, and each half group's sum [m, k / 16].
struct Rows {
  int64_t k;
  const float* floats = nullptr;
  std::vector<int8_t> codes;
  std::vector<float> scales, half_sums, group_sums;
  const int8_t* row(int64_t r) const { return codes.data() + r * k; }
  const float* float_row(int64_t r) const { return floats + r * k; }
  const float* scale(int64_t r) const { return scales.data() + r * (k / kGroup); }
  const float* sums(int64_t r) const { return half_sums.data() + r * (k / 16); }
  const float* whole_sums(int64_t r) const { return group_sums.data() + r * (k / kGroup); }  // quantized only
};

inline float to_float(float v) { return v; }
inline float to_float(c10::BFloat16 v) { return static_cast<float>(v); }

// Round to nearest even, as torch does; NaN stays NaN.
inline c10::BFloat16 round_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint16_t bits = (u & 0x7fffffffu) > 0x7f800000u ? (u >> 16) | 0x40 : (u + 0x7fffu + ((u >> 16) & 1)) >> 16;
  return c10::BFloat16(bits, c10::BFloat16::from_bits());
}

#if GG_AVX2
inline __m256 load8(const float* x) { return _mm256_loadu_ps(x); }
inline __m256 load8(const c10::BFloat16* x) {  // bfloat16 is float32's upper half: exact
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}

// One group of 32 x values -> 32 int8 codes, its scale and its halves' code sums: the same numbers as the
// scalar loop in `quantize_rows` (the same float32 products, rounded to nearest even, as std::nearbyint),
// in a few vector instructions instead of ~200 scalar ones a group (the decode step quantizes every
// linear's x: ~1.5 us a call on model S's rows).
template <typename In>
inline void quantize_group(const In* x, int8_t* codes, float* scale, float* half_sums, float* group_sum) {
  __m256 v[4];
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 amax8 = _mm256_setzero_ps();
  for (int j = 0; j < 4; ++j) {
    v[j] = load8(x + 8 * j);
    amax8 = _mm256_max_ps(_mm256_and_ps(v[j], magnitude), amax8);  // a NaN is skipped, as std::max skips it
  }
  __m128 a = _mm_max_ps(_mm256_castps256_ps128(amax8), _mm256_extractf128_ps(amax8, 1));
  a = _mm_max_ps(a, _mm_movehl_ps(a, a));
  const float amax = _mm_cvtss_f32(_mm_max_ss(a, _mm_movehdup_ps(a)));
  const float d = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
  const __m256 scale8 = _mm256_set1_ps(inv);
  __m256i q[4];
  for (int j = 0; j < 4; ++j)
    q[j] = _mm256_cvtps_epi32(
        _mm256_round_ps(_mm256_mul_ps(v[j], scale8), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  // sums of the codes of each half (16 codes: two vectors of eight)
  const __m256i halves = _mm256_hadd_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
  const __m128i h = _mm_add_epi32(_mm256_castsi256_si128(halves), _mm256_extracti128_si256(halves, 1));
  const int first = _mm_extract_epi32(h, 0) + _mm_extract_epi32(h, 1);
  const int second = _mm_extract_epi32(h, 2) + _mm_extract_epi32(h, 3);
  // int32 -> int8 in order: the packs interleave 128-bit lanes, the permute puts them back
  const __m256i words = _mm256_packs_epi32(q[0], q[1]), words2 = _mm256_packs_epi32(q[2], q[3]);
  const __m256i bytes = _mm256_packs_epi16(words, words2);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes),
                      _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  *scale = d;
  half_sums[0] = d * static_cast<float>(first);
  half_sums[1] = d * static_cast<float>(second);
  *group_sum = d * static_cast<float>(first + second);
}
#endif

template <typename In>
void quantize_rows(const In* x, int64_t m, int64_t k, Rows& q) {
  const int64_t groups = k / kGroup;
  q.k = k;
  q.codes.resize(m * k), q.scales.resize(m * groups), q.half_sums.resize(m * groups * 2);
  q.group_sums.resize(m * groups);
  at::parallel_for(0, m * groups, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
#if GG_AVX2
      quantize_group(x + i * kGroup, q.codes.data() + i * kGroup, &q.scales[i], &q.half_sums[2 * i],
                     &q.group_sums[i]);
      continue;
#endif
      float v[kGroup];
      for (int l = 0; l < kGroup; ++l) v[l] = to_float(x[i * kGroup + l]);
      float amax = 0.f;
      for (int l = 0; l < kGroup; ++l) amax = std::max(amax, std::fabs(v[l]));
      const float d = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
      int8_t* c = q.codes.data() + i * kGroup;
      int sums[2] = {0, 0};
      for (int l = 0; l < kGroup; ++l) {
        const int code = static_cast<int>(std::nearbyint(v[l] * inv));
        c[l] = static_cast<int8_t>(code);
        sums[l / 16] += code;
      }
      q.scales[i] = d;
      q.half_sums[2 * i] = d * static_cast<float>(sums[0]);
      q.half_sums[2 * i + 1] = d * static_cast<float>(sums[1]);
      q.group_sums[i] = d * static_cast<float>(sums[0] + sums[1]);
    }
  });
}

void float_rows(const float* x, int64_t m, int64_t k, Rows& q) {
  q.k = k, q.floats = x;
  q.half_sums.resize(m * (k / 16));
  for (int64_t i = 0; i < m * (k / 16); ++i) {
    float sum = 0.f;
    for (int l = 0; l < 16; ++l) sum += x[16 * i + l];
    q.half_sums[i] = sum;
  }
}

// ---- the dot products -------------------------------------------------------------------------------------

// A weight row is first unpacked, group by group, into its 32 codes and the scales and offsets of its
// halves (`Unpacked`, per thread, L1-sized for the K of LLM layers); the dot products then read that for
// every x row, so the unpacking is paid once per weight row whatever the number of x rows.
struct Unpacked {
  uint8_t* codes;  // [groups, 32]
  float* a;        // [groups, 2]
  float* b;        // [groups, 2]
};

// The unpacked row on the stack up to this many groups (K = 16384), else on the heap.
constexpr int64_t kStackGroups = 512;

#if GG_AVX2

inline float half_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

// 16 bytes -> 32 codes: low nibbles, then high nibbles. The bytes loaded into both lanes, the upper lane's
// shifted right by 4 (a bit a byte takes from its neighbour lands above the mask): three instructions where
// splitting the halves and inserting one took five.
inline __m256i nibbles(const uint8_t* qs) {
  const __m256i v = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)));
  return _mm256_and_si256(_mm256_srlv_epi64(v, _mm256_set_epi64x(4, 4, 0, 0)), _mm256_set1_epi8(0x0f));
}

// bit l of `bits` -> 0x10 in byte l (the fifth bit of Q5 codes)
inline __m256i fifth_bits(uint32_t bits) {
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(static_cast<int>(bits)),
      _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0x0000000000000000));
  const __m256i select = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ull));
  const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, select), select);
  return _mm256_and_si256(set, _mm256_set1_epi8(0x10));
}

// An MXFP4 block's 16 code bytes -> the products' 32 codes (kMxfp4Codes): the nibbles looked up.
inline __m256i mxfp4_codes(const uint8_t* qs) {
  const __m256i values = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kMxfp4Codes)));
  return _mm256_shuffle_epi8(values, nibbles(qs));
}

// IQ4_NL / IQ4_XS: 16 code bytes -> 32 signed codes (kIq4Values), the nibbles looked up.
inline __m256i iq4_codes(const uint8_t* qs) {
  const __m256i values = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kIq4Values)));
  return _mm256_shuffle_epi8(values, nibbles(qs));
}

// IQ4_XS: a block's eight group scales (see iq4_xs_scales) as int32 lanes: byte 4 + g / 2's nibble g % 2
// and bits 2g of the 16-bit word at byte 2, less 32.
inline __m256i iq4_xs_scale_vector(const uint8_t* blk) {
  int32_t low_bytes;
  uint16_t high_word;
  std::memcpy(&low_bytes, blk + 4, 4);
  std::memcpy(&high_word, blk + 2, 2);
  const __m256i low = _mm256_and_si256(
      _mm256_srlv_epi32(_mm256_cvtepu8_epi32(_mm_shuffle_epi8(_mm_cvtsi32_si128(low_bytes),
                                                              _mm_setr_epi8(0, 0, 1, 1, 2, 2, 3, 3, -1, -1, -1, -1,
                                                                            -1, -1, -1, -1))),
                        _mm256_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4)),
      _mm256_set1_epi32(0xf));
  const __m256i high = _mm256_and_si256(
      _mm256_srlv_epi32(_mm256_set1_epi32(high_word), _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14)), _mm256_set1_epi32(3));
  return _mm256_sub_epi32(_mm256_or_si256(low, _mm256_slli_epi32(high, 4)), _mm256_set1_epi32(32));
}

// An i-quant group's 32 signed codes (`IqGroup`): the codebook bytes, those whose bit of `signs` is set
// negated as (v ^ m) - m with m = 0xff (bit l of the word spread to byte l as `fifth_bits` does).
inline __m256i iq_group_codes(const IqGroup& o) {
  // from the four words in registers: their stores read back as one 32-byte load could not be forwarded
  const __m256i mags = _mm256_set_epi64x(static_cast<int64_t>(o.grid[3]), static_cast<int64_t>(o.grid[2]),
                                         static_cast<int64_t>(o.grid[1]), static_cast<int64_t>(o.grid[0]));
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(static_cast<int>(o.signs)),
      _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0x0000000000000000));
  const __m256i select = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ull));
  const __m256i negate = _mm256_cmpeq_epi8(_mm256_and_si256(spread, select), select);
  return _mm256_sub_epi8(_mm256_xor_si256(mags, negate), negate);
}

inline void store_codes(uint8_t* dst, __m256i v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), v); }

// Two floats in one 8-byte store: the dot products read them with one 8-byte load, which a store of each
// float apart could not forward (the load would wait for both stores to reach L1).
inline void store_pair(float* dst, float lo, float hi) {
  _mm_store_sd(reinterpret_cast<double*>(dst), _mm_castps_pd(_mm_setr_ps(lo, hi, 0.f, 0.f)));
}

// Q6_K: part `part` (0-3) of a 128-weight half's high bits (2 bits a byte of qh, bits 2 part and up) in
// place as each code's bits 4-5: one shift the right way and a mask, not a shift down, a mask and a shift up.
inline __m256i q6_high(__m256i qh, int part) {
  const __m256i bits = part == 2 ? qh : part < 2 ? _mm256_slli_epi16(qh, 4 - 2 * part) : _mm256_srli_epi16(qh, 2);
  return _mm256_and_si256(bits, _mm256_set1_epi8(0x30));
}

// An interleaved super-block's four blocks of codes (B the GGML type of its blocks), unsigned but for Q8_0's.
template <int64_t B>
inline void x4_codes(const uint8_t* sb, __m256i codes[kX4Blocks]) {
  constexpr X4Parts p = x4_parts(B);
  const uint8_t* qs = sb + p.codes_at;
  if constexpr (B == kQ8_0) {
    for (int j = 0; j < kX4Blocks; ++j) codes[j] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * j));
  } else {
    const __m256i low4 = _mm256_set1_epi8(0x0f);
    for (int v = 0; v < 2; ++v) {
      const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * v));
      codes[2 * v] = _mm256_and_si256(q, low4);
      codes[2 * v + 1] = _mm256_and_si256(_mm256_srli_epi16(q, 4), low4);
    }
    if constexpr (B == kMXFP4 || B == kIQ4_NL) {  // the products' codes (kMxfp4Codes, kIq4Values), looked up
      const auto* table = B == kMXFP4 ? reinterpret_cast<const void*>(kMxfp4Codes) : reinterpret_cast<const void*>(kIq4Values);
      const __m256i values = _mm256_broadcastsi128_si256(_mm_loadu_si128(static_cast<const __m128i*>(table)));
      for (int j = 0; j < kX4Blocks; ++j) codes[j] = _mm256_shuffle_epi8(values, codes[j]);
    }
    if constexpr (p.fifth_at >= 0) {
      // the 16 bytes in both lanes, the upper lane's moved down a nibble: bit j of byte l is block j's fifth
      // bit of code l (lane 0) or 16 + l (lane 1); shifted up to bit 4 and masked (what a byte takes from its
      // neighbour in the 16-bit shift lands below bit 4)
      const __m256i fifth = _mm256_srlv_epi64(
          _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sb + p.fifth_at))),
          _mm256_set_epi64x(4, 4, 0, 0));
      const __m256i bit4 = _mm256_set1_epi8(0x10);
      codes[0] = _mm256_or_si256(codes[0], _mm256_and_si256(_mm256_slli_epi16(fifth, 4), bit4));
      codes[1] = _mm256_or_si256(codes[1], _mm256_and_si256(_mm256_slli_epi16(fifth, 3), bit4));
      codes[2] = _mm256_or_si256(codes[2], _mm256_and_si256(_mm256_slli_epi16(fifth, 2), bit4));
      codes[3] = _mm256_or_si256(codes[3], _mm256_and_si256(_mm256_slli_epi16(fifth, 1), bit4));
    }
  }
}

// A super-block's four float16 values at p -> float32.
inline __m128 x4_halves(const uint8_t* p) {
  return _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}

// A super-block's four block scales (B its blocks' type): float16 values, or MXFP4's exponent bytes as
// 2^(e - 128) (`e8m0_half`: (e - 1) << 23 as float32's bits, a subnormal 0x00200000 << e for e < 2).
template <int64_t B>
inline __m128 x4_scales(const uint8_t* sb) {
  if constexpr (B == kMXFP4) {
    int32_t bytes;
    std::memcpy(&bytes, sb, 4);
    const __m128i e = _mm_cvtepu8_epi32(_mm_cvtsi32_si128(bytes));
    const __m128i normal = _mm_slli_epi32(_mm_sub_epi32(e, _mm_set1_epi32(1)), 23);
    const __m128i subnormal = _mm_sllv_epi32(_mm_set1_epi32(0x00200000), e);
    return _mm_castsi128_ps(_mm_blendv_epi8(normal, subnormal, _mm_cmplt_epi32(e, _mm_set1_epi32(2))));
  } else {
    return x4_halves(sb);
  }
}

// Q2_K / Q3_K: group g's 32 codes (0-3, or 0-7 with Q3_K's bit from hmask `hm`): bits 2 (g % 4) of the 32
// bytes of qs at 32 (g / 4), as Q6_K's nibbles, shifted in 16-bit lanes and masked.
template <int64_t T>
inline __m256i low_bit_codes(const uint8_t* qs, __m256i hm, int g) {
  const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * (g / 4)));
  __m256i codes = _mm256_and_si256(_mm256_srl_epi16(q, _mm_cvtsi32_si128(2 * (g % 4))), _mm256_set1_epi8(3));
  if constexpr (T == kQ3_K) {
    const __m256i bit = _mm256_and_si256(_mm256_srl_epi16(hm, _mm_cvtsi32_si128(g)), _mm256_set1_epi8(1));
    codes = _mm256_or_si256(codes, _mm256_slli_epi16(bit, 2));
  }
  return codes;
}

// Q2_K / Q3_K: the sixteen half groups' scales a and offsets b (a code c is a c + b): Q2_K d times the low
// nibble of scale byte j and -dmin times its high one; Q3_K d times the six-bit scale (less 32), and -4 a.
template <int64_t T>
inline void low_bit_scales(const uint8_t* blk, float* a, float* b) {
  if constexpr (T == kQ3_K) {
    int8_t sc[16];
    k3_scales(blk + 96, sc);
    const float d = half_at(blk + 108);
    for (int j = 0; j < 16; ++j) a[j] = d * sc[j], b[j] = -4.f * a[j];
  } else {
    const float d = half_at(blk + 80), dmin = half_at(blk + 82);
    for (int j = 0; j < 16; ++j) a[j] = d * (blk[j] & 0xf), b[j] = -(dmin * (blk[j] >> 4));
  }
}

// The same sixteen scales and offsets as vectors (half groups 0-7, 8-15) for the one-row products, from
// whole-vector shifts and masks (the scalar loop's stores, read back as vectors, stalled the loads).
template <int64_t T>
inline void low_bit_scale_vectors(const uint8_t* blk, __m256* a_lo, __m256* a_hi, __m256* b_lo, __m256* b_hi) {
  const auto bytes8 = [](const uint8_t* p) {
    int64_t v;
    std::memcpy(&v, p, 8);
    return _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(v));
  };
  const __m256i low4 = _mm256_set1_epi32(0xf);
  if constexpr (T == kQ3_K) {
    const __m256i low = bytes8(blk + 96);  // scales 0-7's low nibbles, 8-15's high ones
    int32_t high_bytes;
    std::memcpy(&high_bytes, blk + 104, 4);
    const __m256i high = _mm256_cvtepu8_epi32(_mm_shuffle_epi8(
        _mm_cvtsi32_si128(high_bytes), _mm_setr_epi8(0, 1, 2, 3, 0, 1, 2, 3, -1, -1, -1, -1, -1, -1, -1, -1)));
    const __m256i three = _mm256_set1_epi32(3), bias = _mm256_set1_epi32(32);
    const __m256i s_lo = _mm256_sub_epi32(
        _mm256_or_si256(_mm256_and_si256(low, low4),
                        _mm256_slli_epi32(_mm256_and_si256(_mm256_srlv_epi32(high, _mm256_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2)), three), 4)),
        bias);
    const __m256i s_hi = _mm256_sub_epi32(
        _mm256_or_si256(_mm256_srli_epi32(low, 4),
                        _mm256_slli_epi32(_mm256_and_si256(_mm256_srlv_epi32(high, _mm256_setr_epi32(4, 4, 4, 4, 6, 6, 6, 6)), three), 4)),
        bias);
    const __m256 d = _mm256_set1_ps(half_at(blk + 108)), minus4 = _mm256_set1_ps(-4.f);
    *a_lo = _mm256_mul_ps(d, _mm256_cvtepi32_ps(s_lo)), *a_hi = _mm256_mul_ps(d, _mm256_cvtepi32_ps(s_hi));
    *b_lo = _mm256_mul_ps(minus4, *a_lo), *b_hi = _mm256_mul_ps(minus4, *a_hi);
  } else {
    const __m256i lo = bytes8(blk), hi = bytes8(blk + 8);
    const __m256 d = _mm256_set1_ps(half_at(blk + 80)), dmin = _mm256_set1_ps(-half_at(blk + 82));
    *a_lo = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_and_si256(lo, low4)));
    *a_hi = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_and_si256(hi, low4)));
    *b_lo = _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(_mm256_srli_epi32(lo, 4)));
    *b_hi = _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(_mm256_srli_epi32(hi, 4)));
  }
}

template <int64_t T>
void unpack_row(const uint8_t* w, int64_t blocks, Unpacked& u) {
  const __m256i low4 = _mm256_set1_epi8(0x0f);
  if constexpr (is_x4(T)) {
    constexpr int64_t B = base_of(T);
    constexpr X4Parts p = x4_parts(B);
    for (int64_t s = 0; s < blocks / kX4Blocks; ++s) {
      const uint8_t* sb = w + s * kX4Blocks * p.block_bytes;
      __m256i codes[kX4Blocks];
      x4_codes<B>(sb, codes);
      alignas(16) float d[4], off[4];
      const __m128 dv = x4_scales<B>(sb);
      _mm_store_ps(d, dv);
      _mm_store_ps(off, p.minimums_at >= 0 ? x4_halves(sb + p.minimums_at)
                                           : _mm_mul_ps(dv, _mm_set1_ps(B == kQ4_0   ? -8.f
                                                                          : B == kQ5_0 ? -16.f
                                                                          : B == kMXFP4 ? kMxfp4Offset
                                                                                        : 0.f)));
      for (int j = 0; j < kX4Blocks; ++j) {
        const int64_t group = s * kX4Blocks + j;
        store_codes(&u.codes[group * kGroup], codes[j]);
        store_pair(&u.a[2 * group], d[j], d[j]), store_pair(&u.b[2 * group], off[j], off[j]);
      }
    }
    return;
  }
  if constexpr (is_iq_grid(T)) {  // each group from the codebook (`iq_group`), no offsets
    const IqGrids& grids = iq_grids();
    for (int64_t i = 0; i < blocks; ++i) {
      const uint8_t* blk = w + i * iq_block_bytes(T);
      for (int g = 0; g < 8; ++g) {
        IqGroup o;
        iq_group<T>(blk, g, grids, &o);
        const int64_t group = i * 8 + g;
        store_codes(&u.codes[group * kGroup], iq_group_codes(o));
        store_pair(&u.a[2 * group], o.a[0], o.a[1]), store_pair(&u.b[2 * group], 0.f, 0.f);
      }
    }
    return;
  }
  for (int64_t i = 0; i < blocks; ++i) {
    if constexpr (T == kMXFP4) {
      const uint8_t* blk = w + i * 17;
      const float d = e8m0_half(blk[0]);
      store_codes(&u.codes[i * kGroup], mxfp4_codes(blk + 1));
      store_pair(&u.a[2 * i], d, d), store_pair(&u.b[2 * i], kMxfp4Offset * d, kMxfp4Offset * d);
    } else if constexpr (T == kIQ4_NL || T == kIQ4_XS) {
      const uint8_t* blk = w + i * (T == kIQ4_XS ? 136 : 18);
      const float d = half_at(blk);
      int sc[8] = {1};
      if constexpr (T == kIQ4_XS) iq4_xs_scales(blk, sc);
      for (int g = 0; g < (T == kIQ4_XS ? 8 : 1); ++g) {
        const int64_t group = i * (T == kIQ4_XS ? 8 : 1) + g;
        const float a = T == kIQ4_XS ? d * sc[g] : d;
        store_codes(&u.codes[group * kGroup], iq4_codes(blk + (T == kIQ4_XS ? 8 + 16 * g : 2)));
        store_pair(&u.a[2 * group], a, a), store_pair(&u.b[2 * group], 0.f, 0.f);
      }
    } else if constexpr (T == kQ4_0 || T == kQ4_1 || T == kQ5_0 || T == kQ5_1 || T == kQ8_0) {
      constexpr int64_t kBytes = T == kQ4_0 ? 18 : T == kQ4_1 ? 20 : T == kQ5_0 ? 22 : T == kQ5_1 ? 24 : 34;
      const uint8_t* blk = w + i * kBytes;
      const float d = half_at(blk);
      float off = 0.f;
      __m256i codes;
      if constexpr (T == kQ4_0) {
        off = -8.f * d, codes = nibbles(blk + 2);
      } else if constexpr (T == kQ4_1) {
        off = half_at(blk + 2), codes = nibbles(blk + 4);
      } else if constexpr (T == kQ5_0 || T == kQ5_1) {
        uint32_t qh;
        std::memcpy(&qh, blk + (T == kQ5_1 ? 4 : 2), 4);
        off = T == kQ5_0 ? -16.f * d : half_at(blk + 2);
        codes = _mm256_or_si256(nibbles(blk + (T == kQ5_1 ? 8 : 6)), fifth_bits(qh));
      } else {
        codes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2));
      }
      store_codes(&u.codes[i * kGroup], codes);
      store_pair(&u.a[2 * i], d, d), store_pair(&u.b[2 * i], off, off);
    } else if constexpr (T == kQ4_K || T == kQ5_K) {
      const uint8_t* blk = w + i * (T == kQ4_K ? 144 : 176);
      const float d = half_at(blk), dmin = half_at(blk + 2);
      uint8_t sc[8], mn[8];
      k4_scales(blk + 4, sc, mn);
      const uint8_t* qs = blk + (T == kQ5_K ? 48 : 16);
      const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 16));
      for (int g = 0; g < 8; ++g) {
        __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * (g / 2)));
        q = _mm256_and_si256(g % 2 ? _mm256_srli_epi16(q, 4) : q, low4);
        if constexpr (T == kQ5_K) {
          const __m256i bit = _mm256_and_si256(_mm256_srli_epi16(qh, g), _mm256_set1_epi8(1));
          q = _mm256_or_si256(q, _mm256_slli_epi16(bit, 4));
        }
        const int64_t group = i * 8 + g;
        store_codes(&u.codes[group * kGroup], q);
        const float a = d * sc[g], b = -(dmin * mn[g]);
        store_pair(&u.a[2 * group], a, a), store_pair(&u.b[2 * group], b, b);
      }
    } else if constexpr (T == kQ2_K || T == kQ3_K) {
      const uint8_t* blk = w + i * (T == kQ3_K ? 110 : 84);
      const uint8_t* qs = blk + (T == kQ3_K ? 32 : 16);
      const __m256i hm = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk));  // Q3_K's hmask
      alignas(32) float a[16], b[16];
      low_bit_scales<T>(blk, a, b);
      for (int g = 0; g < 8; ++g) {
        const int64_t group = i * 8 + g;
        store_codes(&u.codes[group * kGroup], low_bit_codes<T>(qs, hm, g));
        store_pair(&u.a[2 * group], a[2 * g], a[2 * g + 1]), store_pair(&u.b[2 * group], b[2 * g], b[2 * g + 1]);
      }
    } else {  // Q6_K
      const uint8_t* blk = w + i * 210;
      const float d = half_at(blk + 208);
      for (int g = 0; g < 8; ++g) {
        const int h = g / 4, part = g % 4;
        __m256i ql = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * h + 32 * (part % 2)));
        ql = _mm256_and_si256(part / 2 ? _mm256_srli_epi16(ql, 4) : ql, low4);
        const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 128 + 32 * h));
        const int64_t group = i * 8 + g;
        store_codes(&u.codes[group * kGroup], _mm256_or_si256(ql, q6_high(qh, part)));
        const float a0 = d * static_cast<int8_t>(blk[192 + 2 * g]), a1 = d * static_cast<int8_t>(blk[193 + 2 * g]);
        store_pair(&u.a[2 * group], a0, a1), store_pair(&u.b[2 * group], -32.f * a0, -32.f * a1);
      }
    }
  }
}

// The sums of four u8 x s8 products per int32 lane (eight lanes: 32 bytes of each), as int32. With AVX-512
// VNNI (and VL) or AVX-VNNI one vpdpbusd; otherwise maddubs then madd, whose int16 pair sums never saturate
// here (a pair is at most 2 * 128 * 127), so both give the same integers.
inline __m256i add_byte_products(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(acc, u, s);
#elif defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}

// The same from zero, as float32: one 32-weight group's integer sums, eight lanes of four products.
inline __m256 byte_products(__m256i u, __m256i s) {
#if GG_VNNI
  return _mm256_cvtepi32_ps(add_byte_products(_mm256_setzero_si256(), u, s));
#else
  return _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}

// u8 x s8 group products with Q8_0's signed codes: |w| times x with w's sign.
template <bool kSigned>
inline __m256 code_products(__m256i codes, __m256i xv) {
  return kSigned ? byte_products(_mm256_sign_epi8(codes, codes), _mm256_sign_epi8(xv, codes))
                 : byte_products(codes, xv);
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// R x rows times an unpacked weight row. kSigned: Q8_0's signed codes (no offsets); kFloat: float32 x.
// Groups go in pairs onto two accumulator chains per row, so the FMA latency does not set the pace.
template <int R, bool kSigned, bool kFloat>
void dot_unpacked(const Unpacked& u, int64_t groups, const Rows& x, int64_t r0, float* out) {
  __m256 acc[2][R];
  __m128 off[2][R];  // the offsets' sums, two halves a lane
  for (int c = 0; c < 2; ++c)
    for (int r = 0; r < R; ++r) acc[c][r] = _mm256_setzero_ps(), off[c][r] = _mm_setzero_ps();
  auto group_step = [&](int64_t g, int c) {
    const __m256i codes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(&u.codes[g * kGroup]));
    const float* a = &u.a[2 * g];
    const __m128 b = _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(&u.b[2 * g])));
    if constexpr (kFloat) {
      const __m128i lo = _mm256_castsi256_si128(codes), hi = _mm256_extracti128_si256(codes, 1);
      const auto widen = [](__m128i v) {
        return _mm256_cvtepi32_ps(kSigned ? _mm256_cvtepi8_epi32(v) : _mm256_cvtepu8_epi32(v));
      };
      const __m256 w0 = widen(lo), w1 = widen(_mm_srli_si128(lo, 8)), w2 = widen(hi), w3 = widen(_mm_srli_si128(hi, 8));
      const __m256 a_lo = _mm256_broadcast_ss(a), a_hi = _mm256_broadcast_ss(a + 1);
      for (int r = 0; r < R; ++r) {
        const float* xr = x.float_row(r0 + r) + g * kGroup;
        const __m256 s_lo = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xr + 8), _mm256_mul_ps(w0, _mm256_loadu_ps(xr)));
        const __m256 s_hi = _mm256_fmadd_ps(w3, _mm256_loadu_ps(xr + 24), _mm256_mul_ps(w2, _mm256_loadu_ps(xr + 16)));
        acc[c][r] = _mm256_fmadd_ps(s_hi, a_hi, _mm256_fmadd_ps(s_lo, a_lo, acc[c][r]));
        if constexpr (!kSigned) {
          const __m128 hs = _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(x.sums(r0 + r) + 2 * g)));
          off[c][r] = _mm_fmadd_ps(b, hs, off[c][r]);
        }
      }
    } else {
      const __m256 scale = _mm256_set_m128(_mm_broadcast_ss(a + 1), _mm_broadcast_ss(a));
      const __m256i w_abs = kSigned ? _mm256_sign_epi8(codes, codes) : codes;
      for (int r = 0; r < R; ++r) {
        const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.row(r0 + r) + g * kGroup));
        const __m256i xs = kSigned ? _mm256_sign_epi8(xv, codes) : xv;
        const __m256 sums = byte_products(w_abs, xs);
        const __m256 dx = _mm256_broadcast_ss(x.scale(r0 + r) + g);
        acc[c][r] = _mm256_fmadd_ps(sums, _mm256_mul_ps(scale, dx), acc[c][r]);
        if constexpr (!kSigned) {
          const __m128 hs = _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(x.sums(r0 + r) + 2 * g)));
          off[c][r] = _mm_fmadd_ps(b, hs, off[c][r]);
        }
      }
    }
  };
  int64_t g = 0;
  for (; g + 2 <= groups; g += 2) group_step(g, 0), group_step(g + 1, 1);
  if (g < groups) group_step(g, 0);
  for (int r = 0; r < R; ++r) {
    const __m128 o = _mm_add_ps(off[0][r], off[1][r]);
    out[r] = hsum(_mm256_add_ps(acc[0][r], acc[1][r])) + (_mm_cvtss_f32(o) + _mm_cvtss_f32(_mm_movehdup_ps(o)));
  }
}

// One block of a 32-weight type in the file's layout: its 32 codes (unsigned; Q8_0's signed), its scale d
// and its offset b (the code c stands for d c + b; Q8_0 has none).
template <int64_t T>
inline __m256i file_block(const uint8_t* blk, float* d_out, float* b_out) {
  const float d = T == kMXFP4 ? e8m0_half(blk[0]) : half_at(blk);
  __m256i codes;
  float b = 0.f;
  if constexpr (T == kMXFP4) {
    codes = mxfp4_codes(blk + 1), b = kMxfp4Offset * d;
  } else if constexpr (T == kIQ4_NL) {
    codes = iq4_codes(blk + 2);
  } else if constexpr (T == kQ4_0) {
    codes = nibbles(blk + 2), b = -8.f * d;
  } else if constexpr (T == kQ4_1) {
    codes = nibbles(blk + 4), b = half_at(blk + 2);
  } else if constexpr (T == kQ5_0 || T == kQ5_1) {
    uint32_t qh;
    std::memcpy(&qh, blk + (T == kQ5_1 ? 4 : 2), 4);
    codes = _mm256_or_si256(nibbles(blk + (T == kQ5_1 ? 8 : 6)), fifth_bits(qh));
    b = T == kQ5_0 ? -16.f * d : half_at(blk + 2);
  } else {
    codes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2));
  }
  *d_out = d, *b_out = b;
  return codes;
}

constexpr int64_t file_block_bytes(int64_t T) {
  return T == kQ4_0 || T == kIQ4_NL ? 18 : T == kQ4_1 ? 20 : T == kQ5_0 ? 22 : T == kQ5_1 ? 24 : T == kQ8_0 ? 34 : 17;
}

// R int8 x rows (first..first + R - 1) times one weight row, straight from the blocks: the decode step's
// case (R = 1), where unpacking into a buffer first cost about as much as the products (model S's Q4_1
// [49152 x 512]: 6.2 GB/s through the buffer), and two or three rows (a few decodes, an expert's few
// tokens), where each group's codes and scales are decoded once for all R and eight-row tiles would leave
// most lanes empty. Per group and x row: the codes' integer sums with x, one FMA with d * dx, the offset's
// term. One row keeps two accumulator chains (FMA latency), several rows one each.
template <int64_t T, int R>
__attribute__((always_inline)) inline void dot_rows_inline(const uint8_t* w, int64_t blocks, const Rows& x,
                                                           int64_t first, float* out) {
  constexpr int C = R == 1 ? 2 : 1;  // accumulator chains per row
  const int8_t* xq[R];
  const float *dx[R], *whole[R], *halves[R];
  for (int r = 0; r < R; ++r)
    xq[r] = x.row(first + r), dx[r] = x.scale(first + r), whole[r] = x.whole_sums(first + r),
    halves[r] = x.sums(first + r);
  const __m256i ones = _mm256_set1_epi16(1), low4 = _mm256_set1_epi8(0x0f);
  __m256 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
  const auto products = [&](__m256i codes, int r, int64_t g) {
    const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq[r] + g * kGroup));
    return code_products<signed_codes(T)>(codes, xv);
  };
  if constexpr (is_x4(T)) {
    // per super-block: the four blocks' d times x's four group scales in one vector, each block's lane
    // broadcast for its FMA; the offsets' terms (Q4_0: -8 d, Q5_0: -16 d, MXFP4: -12 d, Q4_1/Q5_1: m, each
    // times x's group sum) four at a time, scaled once at the end
    constexpr int64_t B = base_of(T);
    constexpr X4Parts p = x4_parts(B);
    constexpr float kOffset = B == kQ4_0 ? -8.f : B == kQ5_0 ? -16.f : B == kMXFP4 ? kMxfp4Offset : 1.f;
    __m128 offsets[R];
    for (int r = 0; r < R; ++r) offsets[r] = _mm_setzero_ps();
    for (int64_t s = 0; s < blocks / kX4Blocks; ++s) {
      const uint8_t* sb = w + s * kX4Blocks * p.block_bytes;
      const __m128 d = x4_scales<B>(sb);
      alignas(16) float scale[R][kX4Blocks];  // each block's lane broadcast from here (a load, not a shuffle)
      for (int r = 0; r < R; ++r) {
        _mm_store_ps(scale[r], _mm_mul_ps(d, _mm_loadu_ps(dx[r] + kX4Blocks * s)));
        if constexpr (!signed_codes(B))
          offsets[r] = _mm_fmadd_ps(p.minimums_at >= 0 ? x4_halves(sb + p.minimums_at) : d,
                                    _mm_loadu_ps(whole[r] + kX4Blocks * s), offsets[r]);
      }
      __m256i codes[kX4Blocks];
      x4_codes<B>(sb, codes);
#pragma GCC unroll 4
      for (int j = 0; j < kX4Blocks; ++j)
        for (int r = 0; r < R; ++r)
          acc[r][j % C] = _mm256_fmadd_ps(products(codes[j], r, kX4Blocks * s + j),
                                          _mm256_broadcast_ss(&scale[r][j]), acc[r][j % C]);
    }
    for (int r = 0; r < R; ++r) {
      __m256 sum = acc[r][0];
      if constexpr (C == 2) sum = _mm256_add_ps(sum, acc[r][1]);
      __m128 o = _mm_add_ps(offsets[r], _mm_movehl_ps(offsets[r], offsets[r]));
      o = _mm_add_ss(o, _mm_movehdup_ps(o));
      out[r] = hsum(sum) + kOffset * _mm_cvtss_f32(o);
    }
  } else if constexpr (T == kQ4_0 || T == kQ4_1 || T == kQ5_0 || T == kQ5_1 || T == kQ8_0 || T == kMXFP4 ||
                       T == kIQ4_NL) {
    float off[R][C] = {};
    const auto block = [&](int64_t i, int c) {
      float d, b;
      const __m256i codes = file_block<T>(w + i * file_block_bytes(T), &d, &b);
      for (int r = 0; r < R; ++r) {
        acc[r][c] = _mm256_fmadd_ps(products(codes, r, i), _mm256_set1_ps(d * dx[r][i]), acc[r][c]);
        if constexpr (!signed_codes(T)) off[r][c] += b * whole[r][i];
      }
    };
    int64_t i = 0;
    if constexpr (C == 2) {
      for (; i + 2 <= blocks; i += 2) block(i, 0), block(i + 1, 1);
    }
    for (; i < blocks; ++i) block(i, 0);
    for (int r = 0; r < R; ++r) {
      if constexpr (C == 2)
        out[r] = hsum(_mm256_add_ps(acc[r][0], acc[r][1])) + (off[r][0] + off[r][1]);
      else
        out[r] = hsum(acc[r][0]) + off[r][0];
    }
  } else if constexpr (T == kIQ4_XS) {
    // per block, the eight groups' scales d sc[g] dx[g] in a vector; no offsets
    for (int64_t i = 0; i < blocks; ++i) {
      const uint8_t* blk = w + i * 136;
      const __m256 d_sc = _mm256_mul_ps(_mm256_cvtepi32_ps(iq4_xs_scale_vector(blk)), _mm256_set1_ps(half_at(blk)));
      alignas(32) float scale[R][8];  // each group's lane broadcast from here (a load, not a shuffle)
      for (int r = 0; r < R; ++r) _mm256_store_ps(scale[r], _mm256_mul_ps(d_sc, _mm256_loadu_ps(dx[r] + i * 8)));
#pragma GCC unroll 8
      for (int g = 0; g < 8; ++g) {
        const __m256i codes = iq4_codes(blk + 8 + 16 * g);
        for (int r = 0; r < R; ++r)
          acc[r][g % C] = _mm256_fmadd_ps(products(codes, r, i * 8 + g), _mm256_broadcast_ss(&scale[r][g]), acc[r][g % C]);
      }
    }
    for (int r = 0; r < R; ++r) {
      __m256 sum = acc[r][0];
      if constexpr (C == 2) sum = _mm256_add_ps(sum, acc[r][1]);
      out[r] = hsum(sum);
    }
  } else if constexpr (is_iq_grid(T)) {
    // per group: its codes from the codebook (`iq_group`, decoded once for all R rows), each half's scale
    // times x's group scale (lanes 0-3 hold the first half's sums, 4-7 the second's); no offsets
    const IqGrids& grids = iq_grids();
    for (int64_t i = 0; i < blocks; ++i) {
      const uint8_t* blk = w + i * iq_block_bytes(T);
#pragma GCC unroll 2
      for (int g = 0; g < 8; ++g) {
        IqGroup o;
        iq_group<T>(blk, g, grids, &o);
        const __m256i codes = iq_group_codes(o);
        const __m256 a = _mm256_set_m128(_mm_set1_ps(o.a[1]), _mm_set1_ps(o.a[0]));
        for (int r = 0; r < R; ++r)
          acc[r][g % C] = _mm256_fmadd_ps(products(codes, r, i * 8 + g), _mm256_mul_ps(a, _mm256_set1_ps(dx[r][i * 8 + g])),
                                          acc[r][g % C]);
      }
    }
    for (int r = 0; r < R; ++r) {
      __m256 sum = acc[r][0];
      if constexpr (C == 2) sum = _mm256_add_ps(sum, acc[r][1]);
      out[r] = hsum(sum);
    }
  } else if constexpr (T == kQ4_K || T == kQ5_K) {
    // per block, the eight groups' scales d sc[g] dx[g] and offsets -dmin mn[g] (x's sum) in vectors
    __m256 offsets[R];
    for (int r = 0; r < R; ++r) offsets[r] = _mm256_setzero_ps();
    for (int64_t i = 0; i < blocks; ++i) {
      const uint8_t* blk = w + i * (T == kQ4_K ? 144 : 176);
      uint64_t sc, mn;
      k4_scales_packed(blk + 4, &sc, &mn);
      const auto widen = [](uint64_t bytes) {
        return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<int64_t>(bytes))));
      };
      const __m256 d_sc = _mm256_mul_ps(widen(sc), _mm256_set1_ps(half_at(blk)));
      const __m256 dmin_mn = _mm256_mul_ps(widen(mn), _mm256_set1_ps(half_at(blk + 2)));
      alignas(32) float scale[R][8];  // each group's lane broadcast from here (a load, not a shuffle)
      for (int r = 0; r < R; ++r) {
        _mm256_store_ps(scale[r], _mm256_mul_ps(d_sc, _mm256_loadu_ps(dx[r] + i * 8)));
        offsets[r] = _mm256_fnmadd_ps(dmin_mn, _mm256_loadu_ps(whole[r] + i * 8), offsets[r]);
      }
      const uint8_t* qs = blk + (T == kQ5_K ? 48 : 16);
      const __m256i qh = T == kQ5_K ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 16)) : ones;
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) {  // 64 weights: the low nibbles are group 2j, the high ones 2j + 1
        const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * j));
#pragma GCC unroll 2
        for (int h = 0; h < 2; ++h) {
          const int g = 2 * j + h;
          __m256i codes = _mm256_and_si256(h ? _mm256_srli_epi16(q, 4) : q, low4);
          if constexpr (T == kQ5_K)
            codes = _mm256_or_si256(
                codes, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, g), _mm256_set1_epi8(1)), 4));
          for (int r = 0; r < R; ++r) {
            const __m256 a = _mm256_broadcast_ss(&scale[r][g]);
            acc[r][h % C] = _mm256_fmadd_ps(products(codes, r, i * 8 + g), a, acc[r][h % C]);
          }
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      __m256 sum = _mm256_add_ps(acc[r][0], offsets[r]);
      if constexpr (C == 2) sum = _mm256_add_ps(sum, acc[r][1]);
      out[r] = hsum(sum);
    }
  } else {  // Q6_K, Q3_K, Q2_K: a scale and an offset per half group
    // per block, the sixteen half-group scales a in two vectors (groups 0-3, 4-7: lane 2g + half), times dx
    // for the products; the offsets (Q6_K -32 a, Q3_K -4 a, Q2_K -dmin m) times x's half sums, in a vector
    __m256 offsets[R];
    for (int r = 0; r < R; ++r) offsets[r] = _mm256_setzero_ps();
    const __m256i first_halves = _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3);
    const __m256i last_halves = _mm256_setr_epi32(4, 4, 5, 5, 6, 6, 7, 7);
    constexpr int64_t kBytes = T == kQ6_K ? 210 : T == kQ3_K ? 110 : 84;
    for (int64_t i = 0; i < blocks; ++i) {
      const uint8_t* blk = w + i * kBytes;
      __m256 a_lo, a_hi, b_lo, b_hi;
      if constexpr (T == kQ6_K) {
        const __m256 d = _mm256_set1_ps(half_at(blk + 208));
        const __m128i sc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 192));
        a_lo = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc)));
        a_hi = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc, 8))));
        const __m256 minus32 = _mm256_set1_ps(-32.f);
        b_lo = _mm256_mul_ps(minus32, a_lo), b_hi = _mm256_mul_ps(minus32, a_hi);
      } else {
        low_bit_scale_vectors<T>(blk, &a_lo, &a_hi, &b_lo, &b_hi);
      }
      __m256 scales[R][2];
      for (int r = 0; r < R; ++r) {
        offsets[r] = _mm256_fmadd_ps(b_lo, _mm256_loadu_ps(halves[r] + 16 * i), offsets[r]);
        offsets[r] = _mm256_fmadd_ps(b_hi, _mm256_loadu_ps(halves[r] + 16 * i + 8), offsets[r]);
        const __m256 dxv = _mm256_loadu_ps(dx[r] + 8 * i);
        scales[r][0] = _mm256_mul_ps(a_lo, _mm256_permutevar8x32_ps(dxv, first_halves));
        scales[r][1] = _mm256_mul_ps(a_hi, _mm256_permutevar8x32_ps(dxv, last_halves));
      }
      const __m256i hm = T == kQ3_K ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk)) : ones;
      for (int h = 0; h < 2; ++h) {
        __m256i qh = ones, ql0 = ones, ql1 = ones;
        if constexpr (T == kQ6_K) {
          qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 128 + 32 * h));
          ql0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * h));
          ql1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * h + 32));
        }
        for (int part = 0; part < 4; ++part) {
          const int g = 4 * h + part;
          __m256i codes;
          if constexpr (T == kQ6_K) {
            const __m256i ql = part % 2 ? ql1 : ql0;
            const __m256i low = _mm256_and_si256(part / 2 ? _mm256_srli_epi16(ql, 4) : ql, low4);
            codes = _mm256_or_si256(low, q6_high(qh, part));
          } else {
            codes = low_bit_codes<T>(blk + (T == kQ3_K ? 32 : 16), hm, g);
          }
          // lanes 0-3 the group's first half's scale, 4-7 its second's
          const __m256i pick = _mm256_setr_epi32(2 * part, 2 * part, 2 * part, 2 * part, 2 * part + 1, 2 * part + 1,
                                                 2 * part + 1, 2 * part + 1);
          for (int r = 0; r < R; ++r) {
            const __m256 scale = _mm256_permutevar8x32_ps(scales[r][h], pick);
            acc[r][part % C] = _mm256_fmadd_ps(products(codes, r, i * 8 + g), scale, acc[r][part % C]);
          }
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      __m256 sum = _mm256_add_ps(acc[r][0], offsets[r]);
      if constexpr (C == 2) sum = _mm256_add_ps(sum, acc[r][1]);
      out[r] = hsum(sum);
    }
  }
}

// `dot_rows_inline` as a function of its own per row count: inlined together into one caller, one row of
// Q4_K ran 10% slower.
template <int64_t T, int R>
__attribute__((noinline)) void dot_rows(const uint8_t* w, int64_t blocks, const Rows& x, int64_t first, float* out) {
  dot_rows_inline<T, R>(w, blocks, x, first, out);
}

#else

template <int64_t T>
void unpack_row(const uint8_t* w, int64_t blocks, Unpacked& u) {
  Layout layout;
  layout_of(T, &layout);
  Group groups[8];
  if constexpr (is_x4(T)) {  // each super-block's four blocks put back as the file's, then as those
    uint8_t file_blocks[kX4Blocks * 34];
    for (int64_t i = 0; i < blocks; i += kX4Blocks) {
      deinterleave_blocks(base_of(T), w + i * layout.bytes, file_blocks);
      for (int64_t j = i; j < i + kX4Blocks; ++j) {
        block_groups(base_of(T), file_blocks + (j - i) * layout.bytes, groups);
        std::memcpy(&u.codes[j * kGroup], groups[0].codes, kGroup);
        for (int half = 0; half < 2; ++half) u.a[2 * j + half] = groups[0].a[half], u.b[2 * j + half] = groups[0].b[half];
      }
    }
    return;
  }
  for (int64_t i = 0; i < blocks; ++i) {
    const int n = block_groups(T, w + i * layout.bytes, groups);
    for (int g = 0; g < n; ++g) {
      const int64_t group = i * n + g;
      std::memcpy(&u.codes[group * kGroup], groups[g].codes, kGroup);
      for (int half = 0; half < 2; ++half) u.a[2 * group + half] = groups[g].a[half], u.b[2 * group + half] = groups[g].b[half];
    }
  }
}

template <int R, bool kSigned, bool kFloat>
void dot_unpacked(const Unpacked& u, int64_t groups, const Rows& x, int64_t r0, float* out) {
  for (int r = 0; r < R; ++r) {
    float acc = 0.f;
    for (int64_t g = 0; g < groups; ++g) {
      float halves[2] = {0.f, 0.f};
      int sums[2] = {0, 0};
      for (int l = 0; l < kGroup; ++l) {
        const uint8_t byte = u.codes[g * kGroup + l];
        const int code = kSigned ? static_cast<int8_t>(byte) : byte;
        if constexpr (kFloat) {
          halves[l / 16] += static_cast<float>(code) * x.float_row(r0 + r)[g * kGroup + l];
        } else {
          sums[l / 16] += code * x.row(r0 + r)[g * kGroup + l];
        }
      }
      if constexpr (!kFloat) {
        const float dx = x.scale(r0 + r)[g];
        halves[0] = dx * static_cast<float>(sums[0]), halves[1] = dx * static_cast<float>(sums[1]);
      }
      const float* hs = x.sums(r0 + r) + 2 * g;
      acc += u.a[2 * g] * halves[0] + u.a[2 * g + 1] * halves[1];
      if (!kSigned) acc += u.b[2 * g] * hs[0] + u.b[2 * g + 1] * hs[1];
    }
    out[r] = acc;
  }
}

#endif

#if GG_AVX2
// Two weight rows of a 32-weight type in the file's layout times one int8 x row (a decode step): one
// accumulator chain a row, each x group loaded once for both, one horizontal sum for the pair. Model S's rows
// (18 blocks, not interleaved) are short enough that a row's epilogue and call were a fifth of their time.
// The float16 types' headers (d, and Q4_1's / Q5_1's minimum m) of both rows are widened in one vcvtph2ps and
// their offset terms summed in one vector (lanes d0, m0, d1, m1): a block's scalar conversions and multiplies
// were a fifth of the pair's instructions (model S's Q4_1 rows in L2, one thread, the Zen 4 EPYC: 1.18 ->
// 0.95 ns a block). The same products and sums as before, bit for bit.
template <int64_t T>
__attribute__((noinline)) void dot_row_pair(const uint8_t* w0, const uint8_t* w1, int64_t blocks, const Rows& x,
                                            float* out0, float* out1) {
  const int8_t* xq = x.row(0);
  const float *dx = x.scale(0), *whole = x.whole_sums(0);
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  const auto products = [&](__m256i codes, __m256i xv) { return code_products<signed_codes(T)>(codes, xv); };
  float off0 = 0.f, off1 = 0.f;
  if constexpr (T == kMXFP4) {  // an exponent byte, not a float16 header
    for (int64_t i = 0; i < blocks; ++i) {
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + i * kGroup));
      float d0, b0, d1, b1;
      const __m256i c0 = file_block<T>(w0 + i * file_block_bytes(T), &d0, &b0);
      const __m256i c1 = file_block<T>(w1 + i * file_block_bytes(T), &d1, &b1);
      acc0 = _mm256_fmadd_ps(products(c0, xv), _mm256_set1_ps(d0 * dx[i]), acc0);
      acc1 = _mm256_fmadd_ps(products(c1, xv), _mm256_set1_ps(d1 * dx[i]), acc1);
      off0 += b0 * whole[i], off1 += b1 * whole[i];
    }
  } else {
    // lane 1 (3) of the header's pair: row 0's (1's) minimum for Q4_1 and Q5_1, else d again
    constexpr bool kMinimum = T == kQ4_1 || T == kQ5_1;
    constexpr float kOffset = T == kQ4_0 ? -8.f : T == kQ5_0 ? -16.f : 1.f;
    __m128 off = _mm_setzero_ps();
    for (int64_t i = 0; i < blocks; ++i) {
      const uint8_t* b0 = w0 + i * file_block_bytes(T);
      const uint8_t* b1 = w1 + i * file_block_bytes(T);
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + i * kGroup));
      uint32_t h0, h1;
      std::memcpy(&h0, b0, 4);
      std::memcpy(&h1, b1, 4);
      if constexpr (!kMinimum) h0 = (h0 & 0xffffu) * 0x10001u, h1 = (h1 & 0xffffu) * 0x10001u;  // d, d
      const __m128 dm = _mm_cvtph_ps(_mm_unpacklo_epi32(_mm_cvtsi32_si128(static_cast<int>(h0)),
                                                        _mm_cvtsi32_si128(static_cast<int>(h1))));
      const __m128 scaled = _mm_mul_ps(dm, _mm_set1_ps(dx[i]));
      float unused_d, unused_b;
      const __m256i c0 = file_block<T>(b0, &unused_d, &unused_b);
      const __m256i c1 = file_block<T>(b1, &unused_d, &unused_b);
      acc0 = _mm256_fmadd_ps(products(c0, xv), _mm256_broadcastss_ps(scaled), acc0);
      acc1 = _mm256_fmadd_ps(products(c1, xv), _mm256_broadcastss_ps(_mm_movehl_ps(scaled, scaled)), acc1);
      if constexpr (!signed_codes(T)) off = _mm_add_ps(off, _mm_mul_ps(dm, _mm_set1_ps(whole[i])));  // as b * whole[i] was
    }
    // the offsets b whole[i] summed as before: the minimum's lanes, or kOffset times d's (-8 d summed as d)
    off0 = kOffset * _mm_cvtss_f32(_mm_movehdup_ps(off));
    off1 = kOffset * _mm_cvtss_f32(_mm_shuffle_ps(off, off, 3));
  }
  const __m256 h = _mm256_hadd_ps(acc0, acc1);  // row 0's pairs in lanes 0, 1 (and 4, 5), row 1's in 2, 3
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  s = _mm_hadd_ps(s, s);
  *out0 = _mm_cvtss_f32(s) + off0, *out1 = _mm_cvtss_f32(_mm_movehdup_ps(s)) + off1;
}
#endif

using PairFn = void (*)(const uint8_t*, const uint8_t*, int64_t, const Rows&, float*, float*);

constexpr int64_t kPairedPartBytes = 4 << 20;  // the largest part (bytes) whose rows go in pairs (gguf_linear)

// `dot_row_pair` for a type in the file's layout, else nullptr (the interleaved and K-quant rows: one at a time).
inline PairFn pair_fn(int64_t type) {
#if GG_AVX2
  switch (type) {
    case kQ4_0: return dot_row_pair<kQ4_0>;
    case kQ4_1: return dot_row_pair<kQ4_1>;
    case kQ5_0: return dot_row_pair<kQ5_0>;
    case kQ5_1: return dot_row_pair<kQ5_1>;
    case kIQ4_NL: return dot_row_pair<kIQ4_NL>;
    case kQ8_0: return dot_row_pair<kQ8_0>;
    case kMXFP4: return dot_row_pair<kMXFP4>;
    default: return nullptr;
  }
#else
  (void)type;
  return nullptr;
#endif
}

// A weight row against x rows first..first + m - 1 (out[r * stride] for row first + r): unpacked once, then
// in tiles of x rows.
template <int64_t T, bool kFloat>
void row_times_x(const uint8_t* w, int64_t blocks, const Rows& x, int64_t first, int64_t m, float* out,
                 int64_t stride) {
  constexpr bool kSigned = signed_codes(T);
#if GG_AVX2
  if constexpr (!kFloat) {
    if (m <= kDirectRows) {
      float sums[kDirectRows];
      switch (m) {
        case 1: dot_rows<T, 1>(w, blocks, x, first, sums); break;
        case 2: dot_rows<T, 2>(w, blocks, x, first, sums); break;
        case 3: dot_rows<T, 3>(w, blocks, x, first, sums); break;
        default: dot_rows<T, 4>(w, blocks, x, first, sums);
      }
      for (int64_t r = 0; r < m; ++r) out[r * stride] = sums[r];
      return;
    }
  }
#endif
  const int64_t groups = x.k / kGroup;
  alignas(64) uint8_t codes[kStackGroups * kGroup];
  alignas(64) float a[kStackGroups * 2], b[kStackGroups * 2];
  std::vector<uint8_t> heap_codes;
  std::vector<float> heap_scales;
  Unpacked u{codes, a, b};
  if (groups > kStackGroups) {
    heap_codes.resize(groups * kGroup), heap_scales.resize(groups * 4);
    u = {heap_codes.data(), heap_scales.data(), heap_scales.data() + groups * 2};
  }
  unpack_row<T>(w, blocks, u);
  float tile[kTile];
  for (int64_t r0 = 0; r0 < m;) {
    const int64_t rows = std::min<int64_t>(kTile, m - r0);
    switch (rows) {
      case 1: dot_unpacked<1, kSigned, kFloat>(u, groups, x, first + r0, tile); break;
      case 2: dot_unpacked<2, kSigned, kFloat>(u, groups, x, first + r0, tile); break;
      case 3: dot_unpacked<3, kSigned, kFloat>(u, groups, x, first + r0, tile); break;
      default: dot_unpacked<4, kSigned, kFloat>(u, groups, x, first + r0, tile);
    }
    for (int64_t r = 0; r < rows; ++r) out[(r0 + r) * stride] = tile[r];
    r0 += rows;
  }
}

// x float32 [m, K] times `rows` weight rows from `w` (GGML type `type`) -> out [m, rows] (a view): slabs of
// kSlab rows dequantized (threads over their blocks), each through torch's float32 GEMM.
inline void slab_matmul(const at::Tensor& x, const uint8_t* w, int64_t rows, int64_t type, at::Tensor out) {
  Layout layout;
  layout_of(type, &layout);
  const int64_t k = x.size(1), blocks = k / layout.block, row_bytes = blocks * layout.bytes;
  at::Tensor slab = x.new_empty({std::min(kSlab, rows), k});
  for (int64_t r0 = 0; r0 < rows; r0 += kSlab) {
    const int64_t count = std::min(kSlab, rows - r0);
    float* dst = slab.data_ptr<float>();
    at::parallel_for(0, count, 8, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) dequantize_row(type, w + (r0 + i) * row_bytes, blocks, dst + i * k);
    });
    out.narrow(1, r0, count).copy_(x.mm(slab.narrow(0, 0, count).t()));
  }
}

using RowFn = void (*)(const uint8_t*, int64_t, const Rows&, int64_t, int64_t, float*, int64_t);

// f(std::integral_constant<int64_t, T>{}) for the kernel type `type` (Q6_K for any other): one switch for
// the per-type function tables below.
template <typename F>
decltype(auto) with_type(int64_t type, F&& f) {
  switch (type) {
    case kQ4_0: return f(std::integral_constant<int64_t, kQ4_0>{});
    case kQ4_1: return f(std::integral_constant<int64_t, kQ4_1>{});
    case kQ5_0: return f(std::integral_constant<int64_t, kQ5_0>{});
    case kQ5_1: return f(std::integral_constant<int64_t, kQ5_1>{});
    case kQ8_0: return f(std::integral_constant<int64_t, kQ8_0>{});
    case kQ2_K: return f(std::integral_constant<int64_t, kQ2_K>{});
    case kQ3_K: return f(std::integral_constant<int64_t, kQ3_K>{});
    case kQ4_K: return f(std::integral_constant<int64_t, kQ4_K>{});
    case kQ5_K: return f(std::integral_constant<int64_t, kQ5_K>{});
    case kIQ4_NL: return f(std::integral_constant<int64_t, kIQ4_NL>{});
    case kIQ4_XS: return f(std::integral_constant<int64_t, kIQ4_XS>{});
    case kQ4_0x4: return f(std::integral_constant<int64_t, kQ4_0x4>{});
    case kQ4_1x4: return f(std::integral_constant<int64_t, kQ4_1x4>{});
    case kQ5_0x4: return f(std::integral_constant<int64_t, kQ5_0x4>{});
    case kQ5_1x4: return f(std::integral_constant<int64_t, kQ5_1x4>{});
    case kQ8_0x4: return f(std::integral_constant<int64_t, kQ8_0x4>{});
    case kMXFP4x4: return f(std::integral_constant<int64_t, kMXFP4x4>{});
    case kIQ4_NLx4: return f(std::integral_constant<int64_t, kIQ4_NLx4>{});
    case kMXFP4: return f(std::integral_constant<int64_t, kMXFP4>{});
    case kIQ2_XXS: return f(std::integral_constant<int64_t, kIQ2_XXS>{});
    case kIQ2_XS: return f(std::integral_constant<int64_t, kIQ2_XS>{});
    case kIQ2_S: return f(std::integral_constant<int64_t, kIQ2_S>{});
    case kIQ3_XXS: return f(std::integral_constant<int64_t, kIQ3_XXS>{});
    case kIQ3_S: return f(std::integral_constant<int64_t, kIQ3_S>{});
    case kIQ1_S: return f(std::integral_constant<int64_t, kIQ1_S>{});
    case kIQ1_M: return f(std::integral_constant<int64_t, kIQ1_M>{});
    default: return f(std::integral_constant<int64_t, kQ6_K>{});
  }
}

template <bool kFloat>
RowFn row_fn(int64_t type) {
  return with_type(type, [](auto t) -> RowFn { return row_times_x<decltype(t)::value, kFloat>; });
}

constexpr int64_t kRowStreams = 4;  // places of a thread's run of rows one x row reads in turn

// Item t of `count` visited from `streams` (1 or kRowStreams) equal parts in turn (item 0 of each part, then
// item 1, ...), the remainder after in order: a decode step's one x row is light work per weight byte, and a
// thread walking one stream of rows waits on its loads (as the panel linears' one-row path found). Shifts
// and masks, the parts' length divided once: three integer divisions a row were ~10 ns of a Q8_0 row's 45.
class StreamOrder {
 public:
  StreamOrder(int64_t count, int64_t streams)
      : part_(count / streams), whole_(part_ * streams), shift_(streams == kRowStreams ? 2 : 0) {
    static_assert(kRowStreams == 4, "the shift assumes four streams");
  }
  int64_t operator()(int64_t t) const {
    return t < whole_ ? (t & ((int64_t{1} << shift_) - 1)) * part_ + (t >> shift_) : t;
  }

 private:
  int64_t part_, whole_;
  int shift_;
};

// One int8 x row (row `first` of x) times `count` weight rows of one type, row_bytes apart from w: out[i]
// row i's sum. The rows visited from kRowStreams parts in turn (`StreamOrder`) and, where that pays
// (`rows_asked_ahead`), the next row of the same part asked into L1 while this one is multiplied. A decode
// step's rows in one call with the product inlined in the loop: through `row_fn` (a call through a pointer,
// the row count's switch, a noinline product) each short row paid 5-8 ns more (one thread, rows in L2, the
// Zen 4 EPYC: model E's interleaved Q8_0 expert rows 19 -> 13 ns, its Q6_K output rows 41 -> 36, model M's
// interleaved Q4_0 / Q5_0 rows of 28 blocks 31-33 -> 23-27).
using RunFn = void (*)(const uint8_t*, int64_t, int64_t, int64_t, const Rows&, int64_t, float*);

template <int64_t T>
__attribute__((noinline)) void one_row_run(const uint8_t* w, int64_t row_bytes, int64_t count, int64_t blocks,
                                           const Rows& x, int64_t first, float* out) {
  const StreamOrder order(count, kRowStreams);
  const bool ahead = rows_asked_ahead();
  for (int64_t t = 0; t < count; ++t) {
    const int64_t i = order(t);
    if (ahead && t + kRowStreams < count) prefetch_row(w + order(t + kRowStreams) * row_bytes, row_bytes);
#if GG_AVX2
    if constexpr (T == kQ4_K || T == kQ5_K) {  // inlined here, model E's Q4_K rows ran 18% slower (Zen 4)
      dot_rows<T, 1>(w + i * row_bytes, blocks, x, first, out + i);
    } else {
      dot_rows_inline<T, 1>(w + i * row_bytes, blocks, x, first, out + i);
    }
#else
    row_times_x<T, false>(w + i * row_bytes, blocks, x, first, 1, out + i, 1);
#endif
  }
}

inline RunFn run_fn(int64_t type) {
  return with_type(type, [](auto t) -> RunFn { return one_row_run<decltype(t)::value>; });
}

}  // namespace

// Linear layers on llama.cpp's block formats (GGUF), read in place (gguf_blocks.h says how a weight row
// is multiplied).
//
// Work split: output features in one contiguous run per thread (each thread streams its rows of blocks in
// memory order; for a few x rows, from four places of its run at once, each place's next row prefetched);
// each weight row is multiplied with every x row. bfloat16 x: up to four rows straight from
// the blocks (a decode step, a few), more in tiles of eight (gguf_tiles.h: a batch, a prefill chunk). float32
// x: from kSlabRows rows, slabs of dequantized rows through torch's float32 GEMM.
//
// `gguf_dequantize` widens rows to float32 exactly as gguf-py's numpy code does, for the tests and for
// layers that need the float weight; `gguf_embedding` the rows a step looks up.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "gguf_amx.h"
#include "gguf_blocks.h"
#include "gguf_tiles.h"
#include "kernels.h"

bool gguf_kernel_type(int64_t type) { return has_kernel(type); }

std::string gguf_isa() {
  const std::string vectors = GG_AVX2 ? (GG_VNNI ? "avx2+vnni" : "avx2") : "scalar";
  return amx_tiles() ? "amx-int8+" + vectors : vectors;
}

bool gguf_rows_asked_ahead() { return rows_asked_ahead(); }

// x [..., K] (float32 or bfloat16) times the weights `parts` (each uint8 [N_i, bytes per row] of GGML type
// types[i], K columns) -> [..., sum N_i] in x's dtype: the parts' outputs side by side (a fused q/k/v or
// gate/up layer whose checkpoint tensors have their own types), x quantized once for all of them.
namespace {

// One quantized x row times rows [begin, end) of the parts' concatenation (part p's rows start at starts[p]):
// a small part's rows in pairs, then the rest in one run (`run_fn`); float32 sums into sums[0 .. end - begin).
void one_row_share(const Rows& q, const uint8_t* const* parts, const int64_t* types, const int64_t* starts,
                   size_t count, int64_t k, int64_t begin, int64_t end, float* sums) {
  for (size_t p = 0; p < count; ++p) {
    const int64_t lo = std::max(begin, starts[p]), hi = std::min(end, starts[p + 1]);
    if (lo >= hi) continue;
    Layout layout;
    layout_of(types[p], &layout);
    const int64_t row_bytes = k / layout.block * layout.bytes, blocks = k / layout.block;
    const auto row_at = [&](int64_t i) { return parts[p] + (i - starts[p]) * row_bytes; };
    const PairFn pair = (starts[p + 1] - starts[p]) * row_bytes <= kPairedPartBytes ? pair_fn(types[p]) : nullptr;
    int64_t j = lo;
    if (pair != nullptr) {
      const int64_t pairs = (hi - lo) / 2, streams = kRowStreams;
      const bool ahead = rows_asked_ahead();
      const StreamOrder order(pairs, streams);
      for (int64_t t = 0; t < pairs; ++t) {
        const int64_t i = lo + 2 * order(t);
        if (ahead && t + streams < pairs) prefetch_row(row_at(lo + 2 * order(t + streams)), 2 * row_bytes);
        pair(row_at(i), row_at(i) + row_bytes, blocks, q, sums + (i - begin), sums + (i + 1 - begin));
      }
      j = lo + 2 * pairs;
    }
    run_fn(types[p])(row_at(j), row_bytes, hi - j, blocks, q, 0, sums + (j - begin));
  }
}

// The m quantized x rows of q (bfloat16 x: `bf16`; else float32 values) times rows [begin, end) of the
// parts' concatenation, each weight row with every x row (up to kDirectRows rows from four places of the run
// at once, each place's next row prefetched): out[r * stride + i] for x row r and weight row i (out points
// at weight row `begin`'s column).
void rows_share(const Rows& q, int64_t m, bool bf16, const uint8_t* const* parts, const int64_t* types,
                const int64_t* starts, size_t count, int64_t k, int64_t begin, int64_t end, float* out,
                int64_t stride) {
  for (size_t p = 0; p < count; ++p) {
    const int64_t lo = std::max(begin, starts[p]), hi = std::min(end, starts[p + 1]);
    if (lo >= hi) continue;
    Layout layout;
    layout_of(types[p], &layout);
    const int64_t row_bytes = k / layout.block * layout.bytes, blocks = k / layout.block;
    const RowFn fn = bf16 ? row_fn<false>(types[p]) : row_fn<true>(types[p]);
    const bool direct = m <= kDirectRows, ahead = direct && rows_asked_ahead();
    const int64_t streams = direct ? kRowStreams : 1;
    const auto row_at = [&](int64_t i) { return parts[p] + (i - starts[p]) * row_bytes; };
    const StreamOrder order(hi - lo, streams);
    for (int64_t t = 0, n = hi - lo; t < n; ++t) {
      const int64_t i = lo + order(t);
      if (ahead && t + streams < n) prefetch_row(row_at(lo + order(t + streams)), row_bytes);
      fn(row_at(i), blocks, q, 0, m, out + (i - begin), stride);
    }
  }
}

}  // namespace

static_assert(kGgufDirectRows == kDirectRows, "the native step's GGUF rows are gguf_linear's direct rows");

struct GgufRow {
  Rows q;
  int64_t m = 1;  // x rows quantized in q
};

GgufRow* gguf_row_new() { return new GgufRow; }
void gguf_row_delete(GgufRow* row) { delete row; }

void gguf_row_quantize(GgufRow* row, const uint16_t* x, int64_t m, int64_t k) {
  quantize_rows(reinterpret_cast<const c10::BFloat16*>(x), m, k, row->q);
  row->m = m;
}

void gguf_row_share(const GgufRow* row, const uint8_t* const* parts, const int64_t* types, const int64_t* starts,
                    int64_t count, int64_t k, const uint16_t* bias, uint16_t* y, int t, int T) {
  // the rows at::parallel_for(0, n, 16) gives thread t (gguf_linear's split: the same pairs, the same bits)
  const int64_t n = starts[count], used = std::min<int64_t>(T, (n + 15) / 16), chunk = (n + used - 1) / used;
  const int64_t begin = t * chunk, end = std::min(n, begin + chunk), m = row->m, width = end - begin;
  if (t >= used || begin >= end) return;
  thread_local std::vector<float> sums;
  sums.resize(m * width);
  if (m == 1) {
    one_row_share(row->q, parts, types, starts, count, k, begin, end, sums.data());
  } else {
    rows_share(row->q, m, true, parts, types, starts, count, k, begin, end, sums.data(), width);
  }
  for (int64_t r = 0; r < m; ++r)
    for (int64_t j = begin; j < end; ++j) {
      const c10::BFloat16 v = round_to_bf16(sums[r * width + j - begin]);
      y[r * n + j] =
          bias ? round_to_bf16(static_cast<float>(v) + static_cast<float>(c10::BFloat16(bias[j], c10::BFloat16::from_bits()))).x
               : v.x;
    }
}

void gguf_bf16_row(int64_t type, const uint8_t* src, int64_t k, uint16_t* dst) {
  Layout layout;
  layout_of(type, &layout);
  thread_local std::vector<float> values;
  values.resize(k);
  dequantize_row(type, src, k / layout.block, values.data());
  for (int64_t j = 0; j < k; ++j) dst[j] = round_to_bf16(values[j]).x;
}

at::Tensor gguf_linear(const at::Tensor& input, at::TensorList parts, at::IntArrayRef types) {
  TORCH_CHECK(input.scalar_type() == at::kFloat || input.scalar_type() == at::kBFloat16,
              "gguf_linear: float32 or bfloat16 x [..., K]");
  TORCH_CHECK(parts.size() == types.size() && !parts.empty(), "gguf_linear: one type per weight part");
  const int64_t k = input.size(-1);
  TORCH_CHECK(k % kGroup == 0, "gguf_linear: K must be a multiple of 32, not ", k);
  std::vector<int64_t> starts(parts.size() + 1, 0);
  for (size_t p = 0; p < parts.size(); ++p) {
    Layout layout;
    TORCH_CHECK(has_kernel(types[p]) && layout_of(types[p], &layout), "gguf_linear: GGML type ", types[p],
                " has no kernel (dequantize it instead)");
    const at::Tensor& w = parts[p];
    TORCH_CHECK(w.scalar_type() == at::kByte && w.dim() == 2 && w.is_contiguous() && k % layout.block == 0 &&
                    w.size(1) == k / layout.block * layout.bytes,
                "gguf_linear: part ", p, " must be uint8 [N, ", k / layout.block * layout.bytes, "] (GGML type ",
                types[p], ", K ", k, ")");
    starts[p + 1] = starts[p] + w.size(0);
  }
  const int64_t n = starts.back();
  std::vector<int64_t> shape(input.sizes().begin(), input.sizes().end());
  shape.back() = n;
  const at::Tensor rows_in = input.reshape({-1, k}).contiguous();
  const int64_t m = rows_in.size(0);
  const bool bf16 = input.scalar_type() == at::kBFloat16;
  if (m == 0 || n == 0) return input.new_empty(shape);
  const bool tiles = kTiles && bf16 && m >= kTileRows;
  if (m >= kSlabRows && !tiles) {  // float32 x of a prefill chunk or a large batch: slabs through sgemm
    const at::Tensor x = rows_in.to(at::kFloat);
    at::Tensor out = x.new_empty({m, n});
    for (size_t p = 0; p < parts.size(); ++p)
      slab_matmul(x, static_cast<const uint8_t*>(parts[p].data_ptr()), parts[p].size(0), types[p],
                  out.narrow(1, starts[p], parts[p].size(0)));
    out = out.view(shape);
    return bf16 ? out.to(at::kBFloat16) : out;
  }
  // float32 x keeps its values (float products: the same sums as x @ the dequantized weights, up to their
  // order); bfloat16 x, already rounded to 8 bits of mantissa, is quantized to int8 groups, read and written
  // in bfloat16 here (no float32 copies of x and of the output around the call), up to four rows straight
  // from the blocks, more in tiles of eight
  Rows q;
  if (bf16) {
    quantize_rows(rows_in.data_ptr<c10::BFloat16>(), m, k, q);
  } else {
    float_rows(rows_in.data_ptr<float>(), m, k, q);
  }
  at::Tensor out = input.new_empty({m, n});
#if GG_AVX2
  if (tiles) {
    XTiles xt;
    const int64_t lanes = tile_lanes(m);
    xt.reset(k, tiles_for(m, lanes), lanes);
    interleave(q, 0, m, xt, 0);
    at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
      std::vector<float> sums((end - begin) * m);
      for (size_t p = 0; p < parts.size(); ++p) {
        const int64_t lo = std::max(begin, starts[p]), hi = std::min(end, starts[p + 1]);
        if (lo >= hi) continue;
        Layout layout;
        layout_of(types[p], &layout);
        const int64_t blocks = k / layout.block;
        tile_fn(types[p], lanes)(static_cast<const uint8_t*>(parts[p].data_ptr()), blocks * layout.bytes, blocks,
                          lo - starts[p], hi - starts[p], xt, 0, m, sums.data() + (lo - begin), end - begin);
      }
      c10::BFloat16* y = out.data_ptr<c10::BFloat16>();
      for (int64_t r = 0; r < m; ++r)
        for (int64_t j = begin; j < end; ++j) y[r * n + j] = round_to_bf16(sums[r * (end - begin) + j - begin]);
    });
    return out.view(shape);
  }
#endif
  std::vector<const uint8_t*> pointers(parts.size());
  for (size_t p = 0; p < parts.size(); ++p) pointers[p] = static_cast<const uint8_t*>(parts[p].data_ptr());
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> sums(bf16 ? (end - begin) * m : 0);  // this thread's outputs before rounding
    if (bf16 && m == 1) {
      one_row_share(q, pointers.data(), types.data(), starts.data(), parts.size(), k, begin, end, sums.data());
    } else {
      float* dst = bf16 ? sums.data() : out.data_ptr<float>() + begin;
      rows_share(q, m, bf16, pointers.data(), types.data(), starts.data(), parts.size(), k, begin, end, dst,
                 bf16 ? end - begin : n);
    }
    if (bf16) {
      c10::BFloat16* y = out.data_ptr<c10::BFloat16>();
      for (int64_t r = 0; r < m; ++r)
        for (int64_t j = begin; j < end; ++j) y[r * n + j] = round_to_bf16(sums[r * (end - begin) + j - begin]);
    }
  });
  return out.view(shape);
}

int64_t gguf_interleaved_type(int64_t type) { return interleaved_type(type); }

// uint8 [..., bytes per row] of GGML type `type`, rows of a multiple of four blocks -> the same bytes
// interleaved four blocks at a time (gguf_blocks.h), of type gguf_interleaved_type(type).
at::Tensor gguf_interleave(const at::Tensor& raw, int64_t type) {
  const int64_t to = interleaved_type(type);
  TORCH_CHECK(to >= 0, "gguf_interleave: GGML type ", type, " has no interleaved layout");
  const int64_t bytes = kX4Blocks * x4_parts(type).block_bytes;
  TORCH_CHECK(raw.scalar_type() == at::kByte && raw.dim() >= 1 && raw.is_contiguous() && raw.size(-1) % bytes == 0,
              "gguf_interleave: uint8 [..., a multiple of ", bytes, " bytes] (four blocks of GGML type ", type,
              " a super-block)");
  at::Tensor out = raw.new_empty(raw.sizes());
  const uint8_t* src = raw.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, raw.numel() / bytes, 1024, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) interleave_blocks(type, src + i * bytes, dst + i * bytes);
  });
  return out;
}

// uint8 [rows, bytes per row] of GGML type `type` -> float32 [rows, columns], bit for bit gguf-py's values.
at::Tensor gguf_dequantize(const at::Tensor& raw, int64_t type) {
  Layout layout;
  TORCH_CHECK(layout_of(type, &layout), "gguf_dequantize: GGML type ", type, " is not supported");
  TORCH_CHECK(raw.scalar_type() == at::kByte && raw.dim() == 2 && raw.is_contiguous() &&
                  raw.size(1) % layout.bytes == 0,
              "gguf_dequantize: uint8 [rows, a multiple of ", layout.bytes, " bytes]");
  const int64_t rows = raw.size(0), blocks = raw.size(1) / layout.bytes;
  at::Tensor out = raw.new_empty({rows, blocks * layout.block}, raw.options().dtype(at::kFloat));
  const uint8_t* src = raw.data_ptr<uint8_t>();
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)
      dequantize_row(type, src + i * raw.size(1), blocks, dst + i * blocks * layout.block);
  });
  return out;
}

// The rows `ids` of a GGUF table (uint8 [V, bytes per row] of type `type`, a token embedding kept as the file
// has it) as float32 [..., columns]: each looked-up row dequantized as `gguf_dequantize` does.
at::Tensor gguf_embedding(const at::Tensor& ids, const at::Tensor& table, int64_t type) {
  Layout layout;
  TORCH_CHECK(layout_of(type, &layout), "gguf_embedding: GGML type ", type, " is not supported");
  TORCH_CHECK(table.scalar_type() == at::kByte && table.dim() == 2 && table.is_contiguous() &&
                  table.size(1) % layout.bytes == 0,
              "gguf_embedding: a uint8 [rows, a multiple of ", layout.bytes, " bytes] table");
  TORCH_CHECK(ids.scalar_type() == at::kLong || ids.scalar_type() == at::kInt, "gguf_embedding: integer ids");
  const at::Tensor flat = ids.reshape({-1}).to(at::kLong).contiguous();
  const int64_t n = flat.numel(), vocab = table.size(0), row_bytes = table.size(1);
  const int64_t blocks = row_bytes / layout.bytes, columns = blocks * layout.block;
  std::vector<int64_t> shape(ids.sizes().begin(), ids.sizes().end());
  shape.push_back(columns);
  at::Tensor out = table.new_empty(shape, table.options().dtype(at::kFloat));
  const int64_t* id = flat.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(id[i] >= 0 && id[i] < vocab, "gguf_embedding: id ", id[i], " outside the table's ", vocab, " rows");
  const uint8_t* src = table.data_ptr<uint8_t>();
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, n, 4, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) dequantize_row(type, src + id[row] * row_bytes, blocks, dst + row * columns);
  });
  return out;
}

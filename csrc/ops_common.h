// Argument checking and small conversions shared by the CPU and CUDA op implementations.
// Every check names the argument and the problem, so bad input never turns into a crash or into
// silently wrong bytes.
#pragma once
#include <torch/library.h>
#include <ATen/ATen.h>

#include <algorithm>
#include <cctype>
#include <string>
#include <vector>

#include "core/codec.h"
#include "core/exact.h"

namespace flatcomm {
namespace ops {

// The names of the codecs c for which pred(c) holds, in id order: "a, b and c" (or "a, b, c").
template <class Pred>
std::string codec_names(Pred pred, const char* last_sep) {
  std::string out;
  int32_t left = 0;
  for (int32_t c = 0; c < core::kNumCodecs; ++c) left += pred(c) ? 1 : 0;
  for (int32_t c = 0; c < core::kNumCodecs; ++c) {
    if (!pred(c)) continue;
    out += core::kCodecNames[c];
    --left;
    if (left > 0) out += left == 1 ? last_sep : ", ";
  }
  return out;
}

inline int32_t parse_codec(const std::string& name) {
  for (int32_t i = 0; i < core::kNumCodecs; ++i)
    if (name == core::kCodecNames[i]) return i;
  // Names match exactly; another case gets the hint the Python API gives (flatcomm/ops/codecs.py).
  std::string lower(name);
  for (char& ch : lower) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  std::string hint;
  for (int32_t i = 0; i < core::kNumCodecs; ++i)
    if (lower == core::kCodecNames[i]) hint = std::string(" (did you mean '") + lower + "'? codec names are lower case)";
  TORCH_CHECK(false, "flatcomm: unknown codec '", name, "'; expected one of ",
              codec_names([](int32_t) { return true; }, ", "), hint);
}

// The second-stage codec of decode_sum_encode: anything that encodes block by block.
inline int32_t parse_reencode_codec(const std::string& name) {
  const int32_t codec = parse_codec(name);
  TORCH_CHECK(codec != core::kCodecTopK,
              "flatcomm: decode_sum_encode cannot re-encode as topk (it needs the whole sum); "
              "use decode_sum and encode");
  TORCH_CHECK(!core::is_chunk_sparse(codec), "flatcomm: decode_sum_encode cannot re-encode as ", name,
              " (a chunk's selection needs the chunk's whole sum); use decode_sum and encode");
  return codec;
}

inline int32_t dtype_code(at::ScalarType t, const char* what) {
  switch (t) {
    case at::kFloat: return core::kF32;
    case at::kBFloat16: return core::kBF16;
    case at::kHalf: return core::kF16;
    default:
      TORCH_CHECK(false, "flatcomm: ", what, " must be float32, bfloat16 or float16, got ", t);
  }
}

// Chunked sparse codecs (core/sparse.h): chunk = block_size, k values kept per chunk.
inline void check_sparse_args(int32_t codec, int64_t block, int64_t k) {
  if (!core::is_chunk_sparse(codec)) return;
  TORCH_CHECK(block >= 32 && block <= core::kSparseMaxChunk && block % 32 == 0, "flatcomm: ",
              core::kCodecNames[codec], " needs a chunk (block_size) that is a multiple of 32 in [32, ",
              core::kSparseMaxChunk, "], got ", block);
  TORCH_CHECK(k >= 1 && k <= block, "flatcomm: ", core::kCodecNames[codec],
              " needs 1 <= kept values per chunk (k) <= chunk size, got k = ", k, " for chunk ", block);
}

inline void check_block(int32_t codec, int64_t block) {
  if (!core::is_blockwise(codec)) return;
  TORCH_CHECK(block >= core::kMinBlock && block <= core::kMaxBlock && block % 32 == 0,
              "flatcomm: block_size must be a multiple of 32 in [", core::kMinBlock, ", ",
              core::kMaxBlock, "], got ", block);
}

inline void check_topk(int32_t codec, int64_t n, int64_t k) {
  if (codec != core::kCodecTopK) return;
  TORCH_CHECK(n <= core::kMaxTopkNumel, "flatcomm: topk supports up to 2^32 - 1 elements, got ", n);
  TORCH_CHECK(n == 0 ? k == 0 : (k >= 1 && k <= n),
              "flatcomm: topk needs 1 <= k <= numel (k = ", k, ", numel = ", n, ")");
}

inline void check_numel(int64_t n) {
  TORCH_CHECK(n >= 0, "flatcomm: numel must be >= 0, got ", n);
  TORCH_CHECK(n <= core::kMaxNumel, "flatcomm: numel ", n, " is larger than the supported 2^56");
}

// Every size the ops compute comes from here, after the checks that keep layout() from overflowing.
inline int64_t wire_bytes(int32_t codec, int64_t n, int64_t block, int64_t k) {
  check_numel(n);
  check_block(codec, block);
  check_topk(codec, n, k);
  check_sparse_args(codec, block, k);
  TORCH_INTERNAL_ASSERT(core::layout_ok(codec, n, block, k));
  return core::layout(codec, n, block, k).total;
}

// A topk payload's indices must be strictly ascending and below numel: one pass over the k indices
// of each row (about 1% of the decode's own traffic at the default ratio). Only where the payload
// is host memory: a CUDA check would need a host sync, so the CUDA kernels give defined values
// instead (csrc/cuda/README.md).
inline void check_topk_indices(const uint8_t* payloads, int64_t rows, int64_t row_stride, int64_t n,
                               int64_t k) {
  for (int64_t r = 0; r < rows; ++r) {
    const uint32_t* idx = reinterpret_cast<const uint32_t*>(payloads + r * row_stride);
    const int64_t e = core::topk_first_bad(idx, k, n);
    if (e == k) continue;
    TORCH_CHECK(idx[e] < static_cast<uint64_t>(n), "flatcomm: invalid topk payload (row ", r,
                "): index ", idx[e], " at entry ", e, " is out of range for numel ", n);
    TORCH_CHECK(false, "flatcomm: invalid topk payload (row ", r, "): indices must be strictly "
                "ascending, but entry ", e, " is ", idx[e], " after ", idx[e - 1]);
  }
}

// A chunked sparse payload must parse (core/sparse.h sparse_parse_chunk): every chunk's table
// finite and >= 0 (or all NaN: a non-finite chunk), exactly `kept` positions, strictly ascending,
// inside the chunk. One pass over the positions of each row, host memory only (as topk's check).
inline void check_sparse_payload(const uint8_t* payloads, int64_t rows, int64_t row_stride, int32_t codec,
                                 int64_t n, int64_t block, int64_t k) {
  if (!core::is_chunk_sparse(codec) || n == 0) return;
  static const char* const kWhy[] = {"", "", "a level table entry is inf, negative or NaN beside finite ones",
                                     "the position bit vector does not hold exactly the kept count",
                                     "a position is beyond the chunk", "positions are not strictly ascending"};
  const core::Layout L = core::layout(codec, n, block, k);
  const core::SparseGeom g = core::sparse_geom(core::code_bits(codec), block, k);
  std::vector<uint16_t> pos(static_cast<size_t>(k));
  std::vector<float> val(static_cast<size_t>(k));
  for (int64_t r = 0; r < rows; ++r) {
    const uint8_t* p = payloads + r * row_stride;
    const float* tables = reinterpret_cast<const float*>(p);
    for (int64_t c = 0; c < L.nblocks; ++c) {
      const core::SparseParse sp = core::sparse_parse_chunk(
          tables + c * g.levels, p + L.codes_offset + c * g.rec_bytes, std::min(block, n - c * block), g,
          pos.data(), val.data());
      TORCH_CHECK(sp.status >= 0, "flatcomm: invalid ", core::kCodecNames[codec], " payload (row ", r,
                  ", chunk ", c, ", entry ", sp.entry, "): ", kWhy[1 - sp.status]);
    }
  }
}

inline void check_contiguous(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.is_contiguous(), "flatcomm: ", what, " must be contiguous");
}

inline void check_same_device(const at::Tensor& a, const at::Tensor& b, const char* what) {
  TORCH_CHECK(a.device() == b.device(), "flatcomm: ", what, " is on ", b.device(),
              " but the input is on ", a.device());
}

inline void check_residual(const at::Tensor& x, const c10::optional<at::Tensor>& residual) {
  if (!residual) return;
  const at::Tensor& r = *residual;
  check_same_device(x, r, "residual");
  TORCH_CHECK(r.scalar_type() == at::kFloat, "flatcomm: residual must be float32, got ",
              r.scalar_type());
  check_contiguous(r, "residual");
  TORCH_CHECK(r.numel() == x.numel(), "flatcomm: residual has ", r.numel(),
              " elements but the input has ", x.numel());
}

inline void check_stochastic(int32_t codec, bool stochastic) {
  TORCH_CHECK(!stochastic || core::has_stochastic(codec), "flatcomm: stochastic rounding is available for ",
              codec_names(core::has_stochastic, " and "), " only");
}

inline void check_payload(const at::Tensor& p, int64_t rows_dim, int64_t expected_bytes,
                          const std::string& codec, int64_t n) {
  TORCH_CHECK(p.scalar_type() == at::kByte, "flatcomm: payload must be uint8, got ",
              p.scalar_type());
  TORCH_CHECK(p.dim() == rows_dim, "flatcomm: payload must be ", rows_dim,
              "-D, got shape ", p.sizes());
  check_contiguous(p, "payload");
  const int64_t got = p.size(p.dim() - 1);
  TORCH_CHECK(got == expected_bytes, "flatcomm: payload has ", got, " bytes per row but codec '",
              codec, "' with numel ", n, " needs ", expected_bytes);
}

// decode_rows: the codec id and the bytes of each row. Every codec whose payload size follows from
// its numel, so not topk (whose size depends on k).
struct RowsLayout {
  int32_t codec;
  int64_t row_bytes;
};

inline RowsLayout decode_rows_layout(const std::string& name, int64_t row_numel, int64_t block) {
  const int32_t codec = parse_codec(name);
  TORCH_CHECK(codec != core::kCodecTopK && !core::is_chunk_sparse(codec), "flatcomm: decode_rows does not take ",
              name, " payloads (their size depends on k); decode each row with decode");
  TORCH_CHECK(row_numel >= 1 && row_numel <= core::kMaxNumel, "flatcomm: row_numel must be in [1, 2^56], got ",
              row_numel);
  return RowsLayout{codec, wire_bytes(codec, row_numel, block, 0)};
}

// decode_rows: `rows` rows of row_numel values fill out (out_numel values), the last one perhaps
// cut short, i.e. ceil(out_numel / row_numel) == rows (no product that could overflow).
inline void check_rows_cover(int64_t rows, int64_t row_numel, int64_t out_numel) {
  TORCH_CHECK(rows >= 1, "flatcomm: decode_rows needs at least one row in payloads, got 0");
  const int64_t needed = core::ceil_div(out_numel, row_numel);
  TORCH_CHECK(needed == rows, "flatcomm: out has ", out_numel, " elements, which is ", needed,
              " rows of row_numel ", row_numel, ", but payloads has ", rows, " rows (out must hold more than ",
              "(rows - 1) * row_numel and at most rows * row_numel elements)");
}

// A caller-provided output: right device, dtype and size, contiguous.
inline void check_out(const at::Tensor& ref, const at::Tensor& out, int64_t numel,
                      const char* what) {
  check_same_device(ref, out, what);
  check_contiguous(out, what);
  TORCH_CHECK(out.numel() == numel, "flatcomm: ", what, " has ", out.numel(),
              " elements but ", numel, " are needed");
}

inline int32_t precision_of(int64_t headroom) {
  TORCH_CHECK(headroom >= 1 && headroom <= 38, "flatcomm: headroom must be in [1, 38], got ",
              headroom);
  return static_cast<int32_t>(62 - headroom);
}

inline void check_exact_block(int64_t block) {
  TORCH_CHECK(block >= 1 && block <= core::kMaxBlock, "flatcomm: block_size must be in [1, ",
              core::kMaxBlock, "], got ", block);
}

inline void check_exponents(const at::Tensor& x, const at::Tensor& e, int64_t n, int64_t block) {
  check_same_device(x, e, "exponents");
  TORCH_CHECK(e.scalar_type() == at::kInt, "flatcomm: exponents must be int32, got ",
              e.scalar_type());
  check_contiguous(e, "exponents");
  TORCH_CHECK(e.numel() == core::ceil_div(n, block), "flatcomm: exponents has ", e.numel(),
              " entries but numel ", n, " with block_size ", block, " needs ",
              core::ceil_div(n, block));
}

// Exponents come from exact_exponents, often MAX-reduced across ranks: a corrupt one would decode
// to NaN (csrc/core/exact.h); on the host it is reported instead (one pass over n / block ints).
inline void check_exponent_values(const at::Tensor& e) {
  const int32_t* p = e.data_ptr<int32_t>();
  for (int64_t i = 0; i < e.numel(); ++i)
    TORCH_CHECK(core::exp_valid(p[i]), "flatcomm: exponents[", i, "] = ", p[i], " is not a block exponent "
                "(expected ", core::kMinExp, "..", core::kMaxExp, ", or ", core::kExpZero, " for zero, ",
                core::kExpNonFinite, " for non-finite blocks; take them from exact_exponents)");
}

// [W, n] view of a stack of rows (1-D means W = 1).
inline void rows_of(const at::Tensor& x, int64_t& rows, int64_t& n) {
  TORCH_CHECK(x.dim() == 1 || x.dim() == 2, "flatcomm: expected a 1-D or 2-D [rows, n] tensor, got shape ",
              x.sizes());
  rows = x.dim() == 2 ? x.size(0) : 1;
  n = x.size(x.dim() - 1);
}

}  // namespace ops
}  // namespace flatcomm

// Shared parts of the decoder fuzz targets (tests/fuzz/README.md): how an input's bytes become the
// arguments of one decoder call, exactly-sized heap buffers (so AddressSanitizer sees any access
// past them), and scalar reference decoders that the kernels must match bit for bit on every
// input the ops accept.
//
// Input layout (little endian, read front to back; missing bytes read as 0):
//   u8 isa, u8 codec, u8 dtype, u8 numel mode, u64 numel, u16 block, u32 k, u8 rows,
//   f32 scale, u8 out codec, u16 out block, u8 flags, u64 seed, then the payload bytes (repeated
//   cyclically over all rows, or zeros when none are left).
// The numel mode decides whether numel is small (the kernels run) or any int64 (only the size
// arithmetic runs: huge and negative sizes must be rejected or computed without overflow).
#pragma once
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <vector>

#include "core/codec.h"
#include "core/exact.h"
#include "cpu/kernels.h"

namespace fuzz {

using namespace flatcomm;
using namespace flatcomm::core;

constexpr int64_t kMaxFuzzNumel = 4500;  // kernels run below this; sizes are checked at any numel
constexpr int64_t kMaxRows = 4;

[[noreturn]] inline void finding(const char* what, long long a = 0, long long b = 0) {
  fprintf(stderr, "FUZZ FINDING: %s (%lld, %lld)\n", what, a, b);
  abort();
}
#define FUZZ_CHECK(cond, ...) \
  do {                        \
    if (!(cond)) ::fuzz::finding("check failed: " #cond, ##__VA_ARGS__); \
  } while (0)

struct Reader {
  const uint8_t* p;
  size_t left;
  template <typename T>
  T get() {
    T v{};
    const size_t n = left < sizeof(T) ? left : sizeof(T);
    if (n) memcpy(&v, p, n);
    p += n;
    left -= n;
    return v;
  }
};

struct Args {
  int32_t codec, dtype;
  int64_t n, block, k, rows;
  float scale;
  int32_t out_codec;
  int64_t out_block;
  bool residual, stochastic;
  uint64_t seed;
  bool small;  // numel small enough to run the kernels
  std::vector<uint8_t> rest;
};

inline Args parse(const uint8_t* data, size_t size) {
  Reader r{data, size};
  Args a;
  const uint8_t isa = r.get<uint8_t>();
  static const char* kIsas[] = {"baseline", "avx2", "avx512"};
  cpu::select_kernels(kIsas[isa % 3]);  // unsupported: the previous table stays
  a.codec = r.get<uint8_t>() % (kNumCodecs + 1);  // kNumCodecs is no codec: must be rejected
  a.dtype = r.get<uint8_t>() % kNumDTypes;
  const uint8_t mode = r.get<uint8_t>();
  const uint64_t raw_n = r.get<uint64_t>();
  a.small = mode % 8 != 0;
  // Small sizes most of the time (more inputs per second), up to kMaxFuzzNumel (several topk tiles).
  const int64_t cap = mode & 0x20 ? kMaxFuzzNumel : 300;
  a.n = a.small ? static_cast<int64_t>(raw_n % (cap + 1)) : static_cast<int64_t>(raw_n);
  a.block = r.get<uint16_t>();
  if (mode & 0x80) a.block = (a.block % 128 + 1) * 32;  // mostly valid block sizes
  const uint32_t raw_k = r.get<uint32_t>();
  a.k = (mode & 0x40) ? static_cast<int64_t>(raw_k) : (a.n > 0 ? 1 + static_cast<int64_t>(raw_k % a.n) : 0);
  a.rows = r.get<uint8_t>() % (kMaxRows + 1);
  a.scale = r.get<float>();
  // re-encode: any codec but topk and the chunked sparse codecs (decode_sum_encode refuses them)
  static constexpr int32_t kReencodable[] = {kCodecF32, kCodecBF16, kCodecF16, kCodecInt8, kCodecInt4, kCodecSign};
  static_assert(sizeof(kReencodable) / sizeof(kReencodable[0]) == kNumCodecs - 4, "a new codec: re-encodable?");
  a.out_codec = kReencodable[r.get<uint8_t>() % (kNumCodecs - 4)];
  a.out_block = (r.get<uint16_t>() % 128 + 1) * 32;
  const uint8_t flags = r.get<uint8_t>();
  a.residual = flags & 1;
  a.stochastic = (flags & 2) && has_stochastic(a.out_codec);
  a.seed = r.get<uint64_t>();
  a.rest.assign(r.p, r.p + r.left);
  return a;
}

// `bytes` bytes on the heap with nothing after them.
struct Buf {
  std::vector<uint8_t> v;
  explicit Buf(size_t n) : v(n) {}
  uint8_t* p() { return v.empty() ? nullptr : v.data(); }
  float* f() { return reinterpret_cast<float*>(p()); }
};

// The payload bytes: the input's remaining bytes repeated over every row.
inline Buf payload_rows(const Args& a, int64_t row_bytes, int64_t rows) {
  Buf b(static_cast<size_t>(row_bytes * rows));
  if (!a.rest.empty())
    for (size_t i = 0; i < b.v.size(); ++i) b.v[i] = a.rest[i % a.rest.size()];
  return b;
}

// The size arithmetic, for any numel: layout_ok must accept exactly the arguments whose sizes fit,
// and then layout() must equal the same formulas evaluated in 128-bit integers.
inline void check_layout(int32_t codec, int64_t n, int64_t block, int64_t k) {
  if (!layout_ok(codec, n, block, k)) {
    FUZZ_CHECK(n < 0 || n > kMaxNumel || !valid_codec_id(codec) || is_blockwise(codec) || codec == kCodecTopK ||
                   is_chunk_sparse(codec), n, k);
    return;
  }
  using i128 = __int128;
  auto cdiv = [](i128 x, i128 y) { return (x + y - 1) / y; };
  auto rup = [&](i128 x, i128 y) { return cdiv(x, y) * y; };
  i128 total, offset = 0, nblocks = 0;
  if (n == 0) {
    total = 0;
  } else if (is_cast(codec)) {
    total = rup(i128(n) * cast_bytes(codec), kAlign);
  } else if (codec == kCodecTopK) {
    offset = rup(i128(4) * k, kAlign);
    total = rup(offset + i128(4) * k, kAlign);
  } else if (is_chunk_sparse(codec)) {  // core/sparse.h: tables, then fixed-size records
    int low = 0;
    while ((i128(k) << (low + 1)) <= block) ++low;
    const i128 rec = cdiv(i128(k) * low + k + ((block - 1) >> low) + 1, 8) + cdiv(i128(k) * code_bits(codec), 8);
    nblocks = cdiv(n, block);
    offset = rup(4 * (i128(1) << (code_bits(codec) - 1)) * nblocks, kAlign);
    total = rup(offset + rec * nblocks, kAlign);
  } else {
    nblocks = cdiv(n, block);
    offset = rup(4 * nblocks, kAlign);
    total = rup(offset + cdiv(i128(n) * code_bits(codec), 8), kAlign);
  }
  const Layout L = layout(codec, n, block, k);
  FUZZ_CHECK(total < (i128(1) << 62), n, codec);
  FUZZ_CHECK(L.total == static_cast<int64_t>(total) && L.codes_offset == static_cast<int64_t>(offset) &&
                 L.nblocks == static_cast<int64_t>(nblocks), n, L.total);
}

// ---- references ----------------------------------------------------------------------------------

// Every element of one payload, written from the format description (core/codec.h), not the
// kernels. `present` says whether a topk row holds the element (an absent one is 0 and adds nothing).
inline void ref_decode(const uint8_t* p, int32_t codec, int64_t n, int64_t block, int64_t k,
                       std::vector<float>& out, std::vector<char>& present) {
  const Layout L = layout(codec, n, block, k);
  out.assign(n, 0.0f);
  present.assign(n, codec != kCodecTopK && !is_chunk_sparse(codec));
  auto f32_at = [&](int64_t byte) { float f; memcpy(&f, p + byte, 4); return f; };
  if (codec == kCodecTopK) {
    for (int64_t e = 0; e < k; ++e) {
      uint32_t j;
      memcpy(&j, p + 4 * e, 4);
      if (j < n) { out[j] = f32_at(L.codes_offset + 4 * e); present[j] = 1; }
    }
    return;
  }
  if (is_chunk_sparse(codec)) {  // only for payloads that parse (sparse_row_valid)
    const int bits = code_bits(codec), levels = 1 << (bits - 1);
    int low = 0;
    while ((k << (low + 1)) <= block) ++low;
    const int64_t high = k + ((block - 1) >> low) + 1, idx_bytes = (k * low + high + 7) / 8;
    const int64_t rec = idx_bytes + (k * bits + 7) / 8;
    auto bit = [&](const uint8_t* b, int64_t i) { return (b[i / 8] >> (i % 8)) & 1; };
    for (int64_t c = 0; c * block < n; ++c) {
      const int64_t c0 = c * block, m = n - c0 < block ? n - c0 : block;
      if (f32_at(4 * c * levels) != f32_at(4 * c * levels)) {  // non-finite chunk: NaN everywhere
        for (int64_t j = 0; j < m; ++j) { out[c0 + j] = f32_at(4 * c * levels); present[c0 + j] = 1; }
        continue;
      }
      const uint8_t* r = p + L.codes_offset + c * rec;
      int64_t e = 0;
      for (int64_t q = 0; q < high; ++q) {
        if (!bit(r, k * low + q)) continue;
        int64_t lo = 0, code = 0;
        for (int b = 0; b < low; ++b) lo |= int64_t(bit(r, e * low + b)) << b;
        for (int b = 0; b < bits; ++b) code |= int64_t(bit(r + idx_bytes, e * bits + b)) << b;
        const int64_t j = c0 + (((q - e) << low) | lo);
        const float a = f32_at(4 * (c * levels + (code >> 1)));
        out[j] = (code & 1) ? -a : a;
        present[j] = 1;
        ++e;
      }
    }
    return;
  }
  for (int64_t i = 0; i < n; ++i) {
    if (codec == kCodecF32) { out[i] = f32_at(4 * i); continue; }
    if (codec == kCodecBF16 || codec == kCodecF16) {
      uint16_t h;
      memcpy(&h, p + 2 * i, 2);
      out[i] = codec == kCodecBF16 ? bf16_to_f32(h) : f16_to_f32(h);
      continue;
    }
    const float s = f32_at(4 * (i / block));
    const uint8_t* c = p + L.codes_offset;
    if (codec == kCodecInt8) out[i] = static_cast<float>(static_cast<int8_t>(c[i])) * s;
    else if (codec == kCodecInt4) out[i] = static_cast<float>(((c[i / 2] >> (4 * (i & 1))) & 15) - 8) * s;
    else if (codec == kCodecSign) out[i] = ((c[i / 8] >> (i & 7)) & 1) ? -s : s;
  }
}
static_assert(kNumCodecs == 10, "ref_decode: a new codec needs its branch above");

// Same value, or both NaN (the one documented freedom: which NaN).
inline bool same_float(float a, float b) {
  return f2u(a) == f2u(b) || (a != a && b != b);
}

// Splits [0, n) into ranges of whole `unit`s, as the CPU ops do across threads, from seed bits.
template <typename Fn>
inline void in_ranges(int64_t n, int64_t unit, uint64_t bits, const Fn& fn) {
  for (int64_t i = 0; i < n;) {
    const int64_t units = 1 + static_cast<int64_t>(bits % 5);
    bits = bits * 6364136223846793005ull + 1442695040888963407ull;
    const int64_t e = i + units * unit < n ? i + units * unit : n;
    fn(i, e);
    i = e;
  }
}

inline int64_t unit_of(int32_t codec, int64_t block) {
  return is_blockwise(codec) || is_chunk_sparse(codec) ? block : cpu::kTile;
}

// The arguments of the decoder targets: false when there is nothing to run (the size arithmetic,
// checked first, is all an input with a huge numel or arguments the ops reject exercises).
inline bool decodable(const Args& a) {
  check_layout(a.codec, a.n, a.block, a.k);
  return a.small && a.n > 0 && layout_ok(a.codec, a.n, a.block, a.k);
}

// from_exact / to_exact inputs: int64 sums (reread as floats for to_exact) on one int32 exponent
// per block, from the payload bytes -- the zero and non-finite markers, in-range exponents and
// arbitrary int32s -- with any block size and headroom.
struct ExactInput {
  int64_t n, block;
  int32_t precision;
  std::vector<int32_t> E;
  Buf fixed;
  ExactArgs args(float* out) {
    ExactArgs x{};
    x.n = n;
    x.block = block;
    x.precision = precision;
    x.exponents = E.data();
    x.fixed = reinterpret_cast<int64_t*>(fixed.p());
    x.out = out;
    return x;
  }
};

inline ExactInput exact_input(const Args& a, int64_t n) {
  ExactInput in{n, 1 + (a.block + kMaxBlock - 1) % kMaxBlock, 62 - (1 + static_cast<int32_t>(a.seed % 38)), {},
                Buf(static_cast<size_t>(8 * n))};
  const int64_t nb = ceil_div(n, in.block);
  Buf raw = payload_rows(a, 4 * nb + 8 * n, 1);
  in.E.resize(nb);
  for (int64_t b = 0; b < nb; ++b) {
    int32_t v;
    memcpy(&v, raw.p() + 4 * b, 4);
    const uint32_t sel = static_cast<uint32_t>(v) >> 29;
    in.E[b] = sel == 0 ? kExpZero : sel == 1 ? kExpNonFinite
              : sel < 6 ? kMinExp + static_cast<int32_t>(static_cast<uint32_t>(v) % 277) : v;
  }
  memcpy(in.fixed.p(), raw.p() + 4 * nb, 8 * n);
  return in;
}

// Whether the ops accept this topk row (CPU: an error otherwise; CUDA: NaN tiles).
inline bool topk_row_valid(const uint8_t* row, int64_t n, int64_t k) {
  return topk_first_bad(reinterpret_cast<const uint32_t*>(row), k, n) == k;
}

// Whether the ops accept this chunked sparse row (CPU: an error otherwise; CUDA: NaN chunks).
inline bool sparse_row_valid(const uint8_t* row, int32_t codec, int64_t n, int64_t block, int64_t k) {
  const Layout L = layout(codec, n, block, k);
  const SparseGeom g = sparse_geom(code_bits(codec), block, k);
  std::vector<uint16_t> pos(k);
  std::vector<float> val(k);
  for (int64_t c = 0; c < L.nblocks; ++c) {
    const SparseParse sp = sparse_parse_chunk(reinterpret_cast<const float*>(row) + c * g.levels,
                                              row + L.codes_offset + c * g.rec_bytes,
                                              n - c * block < block ? n - c * block : block, g, pos.data(), val.data());
    if (sp.status < 0) return false;
  }
  return true;
}

// Whether the ops accept row r of a payload stack (topk and chunked sparse rows are checked).
inline bool row_valid(const uint8_t* row, int32_t codec, int64_t n, int64_t block, int64_t k) {
  if (codec == kCodecTopK) return topk_row_valid(row, n, k);
  if (is_chunk_sparse(codec)) return sparse_row_valid(row, codec, n, block, k);
  return true;
}

}  // namespace fuzz

// Each target defines this (tests/fuzz/fuzz_*.cpp); the standalone driver or libFuzzer calls it.
extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);

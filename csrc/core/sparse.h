// The chunked sparse codecs ("sparse": 2-bit values, "sparse4": 4-bit, "sparse1": the sign and one
// level, the kept values' mean magnitude): per chunk of `block`
// values keep the `k` largest |v| (SparseLoCo's scheme), quantize them against a per-chunk table of
// magnitude levels, code their positions with Elias-Fano, and leave everything not sent (the
// unsent values and the quantization error) in the error-feedback residual. One chunk is one unit of
// work for the CPU and the CUDA kernels alike: both call the functions below, so both produce the
// same bytes and the same residual bits.
//
// Payload (see layout() in codec.h):
//   [fp32 table: `levels` magnitudes per chunk, chunk-major, padded to 16 B][record per chunk]
// A record is `rec_bytes` bytes, the same for every chunk (the last, shorter chunk included):
//   [Elias-Fano positions: kept * low_bits low bits, then a high-part bit vector][codes]
// Positions p_0 < p_1 < ... (in-chunk, ascending): entry e stores p_e's low `low_bits` bits at bit
// e * low_bits, and sets bit (p_e >> low_bits) + e of the high vector, which starts at bit
// k * low_bits and is `high_bits` = k + ((block - 1) >> low_bits) + 1 bits long. With low_bits =
// floor(log2(block / k)) that is at most 2 + log2(block / k) bits per position, a fixed size: 8 bits
// per position at 4096 / 64 against 12 for plain in-chunk indices (SparseLoCo's packing).
// Codes start at byte idx_bytes of the record: entry e's `bits`-bit code at bit e * bits, bit 0 the
// sign (1 = negative), the rest the level j; the value decodes to +-table[j].
// Bits are numbered little endian: bit b of a stream is bit (b & 7) of byte b >> 3.
//
// Levels: the kept magnitudes are split into `levels` = 2^(bits - 1) bins, evenly in their fp32 bit
// patterns between the smallest and the largest kept |v| (roughly logarithmic in |v|, integer math,
// so every device agrees), and table[j] is the mean of bin j's magnitudes (summed in double in
// ascending position order, so it lies between the bin's extremes and is finite). Kept values are
// far from zero (they are the chunk's largest), which is why a sign and a magnitude level per value
// beat levels spread symmetrically over +-several sigma around zero.
//
// Selection: exact, the k largest |v| bit patterns; ties go to the lower position.
//
// Non-finite rule (as the blockwise codecs): if v = x + residual holds an inf or NaN anywhere in a
// chunk, every table entry of the chunk is NaN, the chunk decodes to NaN everywhere, and its
// residual keeps its previous contents. The record then holds positions 0..kept-1 and zero codes.
//
// Decoding validates everything it reads (sparse_parse_chunk): a record whose positions are not
// strictly ascending, out of the chunk, or whose bit vector has the wrong number of set bits, and
// a table with inf, negative or partly-NaN entries, are reported, never followed out of bounds.
#pragma once
#include "dispatch.h"

namespace flatcomm {
namespace core {

constexpr int64_t kSparseMaxChunk = 4096;  // positions fit 12 bits; scratch arrays of this size

struct SparseGeom {
  int64_t chunk;      // values per chunk (the codec's block size)
  int64_t keep;       // kept values per full chunk (the op's k)
  int32_t bits;       // bits per code (sign + level)
  int32_t levels;     // magnitude levels per chunk: 2^(bits - 1)
  int32_t low_bits;   // Elias-Fano low part per position
  int64_t high_bits;  // Elias-Fano high bit vector
  int64_t idx_bytes;  // positions' bytes in a record
  int64_t rec_bytes;  // one record: positions + codes
};

FC_HD SparseGeom sparse_geom(int32_t bits, int64_t chunk, int64_t keep) {
  SparseGeom g;
  g.chunk = chunk;
  g.keep = keep;
  g.bits = bits;
  g.levels = 1 << (bits - 1);
  int32_t l = 0;
  while ((keep << (l + 1)) <= chunk) ++l;  // floor(log2(chunk / keep))
  g.low_bits = l;
  g.high_bits = keep + ((chunk - 1) >> l) + 1;
  g.idx_bytes = ceil_div(keep * l + g.high_bits, 8);
  g.rec_bytes = g.idx_bytes + ceil_div(keep * bits, 8);
  return g;
}

// Whether (block, k) describe a chunked sparse payload: block a multiple of 32 in [32, 4096],
// 1 <= k <= block.
FC_HD bool sparse_args_ok(int64_t block, int64_t k) {
  return block >= 32 && block <= kSparseMaxChunk && block % 32 == 0 && k >= 1 && k <= block;
}

// ---- bit streams ---------------------------------------------------------------------------------

// ORs the w (<= 24) low bits of v into the stream at bit pos (the stream is zeroed beforehand).
FC_HD void put_bits(uint8_t* p, int64_t pos, uint32_t v, int32_t w) {
  const uint32_t shifted = (v & ((1u << w) - 1u)) << (pos & 7);
  const int32_t nbytes = static_cast<int32_t>(((pos & 7) + w + 7) >> 3);
  for (int32_t j = 0; j < nbytes; ++j) p[(pos >> 3) + j] |= static_cast<uint8_t>(shifted >> (8 * j));
}

FC_HD uint32_t get_bits(const uint8_t* p, int64_t pos, int32_t w) {
  uint32_t v = 0;
  for (int32_t b = 0; b < w; ++b) v |= static_cast<uint32_t>((p[(pos + b) >> 3] >> ((pos + b) & 7)) & 1u) << b;
  return v;
}

FC_HD int32_t popcount32(uint32_t v) {
#if defined(__CUDA_ARCH__)
  return __popc(v);
#else
  return __builtin_popcount(v);
#endif
}
FC_HD int32_t ctz32(uint32_t v) {  // v != 0
#if defined(__CUDA_ARCH__)
  return __ffs(static_cast<int>(v)) - 1;
#else
  return __builtin_ctz(v);
#endif
}

// ---- encoding one chunk --------------------------------------------------------------------------

// The kept set's threshold: the k-th largest |v| bit pattern of a chunk and how many values equal
// to it are kept (the lowest positions first), by radix select over the 31 bits in digits of 8, 8,
// 8 and 7 bits. `top` is the histogram of the first digit (bits 23..30) over the whole chunk; `s`
// `d0` is the threshold's first digit (bits 23..30, the exponent), `need` how many to take among
// the values of that digit, `cv` the ns values whose first digit is at least d0 (in position
// order; usually a few hundred of 4,096): the later digits count only those still tied with the
// threshold's prefix.
struct SparseThreshold {
  uint32_t bits;
  int64_t ties;  // values with |v| bits == `bits` to keep
};

FC_HD SparseThreshold sparse_threshold(uint32_t d0, int64_t need, const float* cv, int64_t ns) {
  uint32_t prefix = d0 << 23, mask = 0xffu << 23;
  uint32_t hist[256];
  for (int32_t pass = 0; pass < 3; ++pass) {
    const int32_t sh = pass == 0 ? 15 : (pass == 1 ? 7 : 0);
    const uint32_t digits = pass == 2 ? 128u : 256u;
    for (uint32_t d = 0; d < digits; ++d) hist[d] = 0;
    for (int64_t c = 0; c < ns; ++c) {
      const uint32_t ab = abs_bits(cv[c]);
      if ((ab & mask) == prefix) ++hist[(ab >> sh) & (digits - 1)];
    }
    uint32_t d = digits - 1;
    for (; d > 0 && hist[d] < need; --d) need -= static_cast<int64_t>(hist[d]);  // the prefix holds >= need
    prefix |= d << sh;
    mask |= (digits - 1) << sh;
  }
  return SparseThreshold{prefix, need};
}

// sparse_encode_chunk (below) with or without a residual, as a template parameter.
template <int DT, bool HAS_R>
FC_HD void sparse_encode_chunk_t(const typename Elem<DT>::T* x, float* r, int64_t m, const SparseGeom& g,
                                 float* table, uint8_t* rec, uint16_t* cand, uint16_t* pos, float* val) {
  const int64_t kk = m < g.keep ? m : g.keep;
  for (int64_t b = 0; b < g.rec_bytes; ++b) rec[b] = 0;
  // v = x + r, recomputed where needed (the same fp32 add gives the same bits each time): the chunk
  // stays in cache, and no chunk-sized float buffer is needed (a GPU thread's local memory).
  auto v_at = [&](int64_t i) { return HAS_R ? Elem<DT>::load(x[i]) + r[i] : Elem<DT>::load(x[i]); };
  auto abs_at = [&](int64_t i) { return abs_bits(v_at(i)); };
  float* cv = val;  // the candidates' values; the kept ones are compacted into its front
  uint32_t mx = 0;  // the largest |v| bits: the non-finite test (a loop that vectorises)
  for (int64_t i = 0; i < m; ++i) mx = umax(mx, abs_at(i));
  const int64_t high0 = g.keep * g.low_bits;  // the high bit vector's first bit
  if (!bits_finite(mx)) {  // non-finite rule: NaN table, canonical positions 0..kk-1, residual kept
    for (int32_t j = 0; j < g.levels; ++j) table[j] = u2f(0x7fc00000u);
    for (int64_t e = 0; e < kk; ++e) {
      put_bits(rec, e * g.low_bits, static_cast<uint32_t>(e) & ((1u << g.low_bits) - 1u), g.low_bits);
      put_bits(rec, high0 + (e >> g.low_bits) + e, 1u, 1);
    }
    return;
  }
  // The threshold's first digit d0 (bits 23..30, the exponent): the largest d with at least kk
  // values at or above it. The kept values usually share the top exponent or two, so a pass from
  // the top digit usually finds enough candidates (values of digit >= d0); otherwise the next digit
  // down, and after three tries a histogram of the digit picks d0. Each pass marks the candidates
  // in a bit mask, 32 positions per word (a compare-shift-OR loop that vectorises); only the
  // marked few (typically 3-10%) are then read again, in position order.
  uint32_t marks[kSparseMaxChunk / 32];
  const int64_t words = (m + 31) / 32;
  auto mark = [&](uint32_t d) {
    int64_t count = 0;
    for (int64_t w = 0; w < words; ++w) {
      uint32_t bits = 0;
      if ((w + 1) * 32 <= m) {
        for (int32_t j = 0; j < 32; ++j) bits |= ((abs_at(32 * w + j) >> 23) >= d ? 1u : 0u) << j;
      } else {
        for (int32_t j = 0; 32 * w + j < m; ++j) bits |= ((abs_at(32 * w + j) >> 23) >= d ? 1u : 0u) << j;
      }
      marks[w] = bits;
      count += popcount32(bits);
    }
    return count;
  };
  uint32_t d0 = mx >> 23;
  int64_t ns = mark(d0);
  for (int32_t tries = 1; ns < kk && tries < 3; ++tries) ns = mark(--d0);
  if (ns < kk) {
    // Four interleaved histograms keep consecutive increments off one counter (most values share
    // a few exponents: a store-to-load chain per value otherwise).
    uint32_t sub[4][256];
    for (int32_t d = 0; d < 256; ++d) sub[0][d] = sub[1][d] = sub[2][d] = sub[3][d] = 0;
    for (int64_t i = 0; i < m; ++i) ++sub[i & 3][abs_at(i) >> 23];
    int64_t at_or_above = ns;  // values of digit >= d0 (fewer than kk)
    while (d0 > 0) {
      --d0;
      at_or_above += sub[0][d0] + sub[1][d0] + sub[2][d0] + sub[3][d0];
      if (at_or_above >= kk) break;
    }
    ns = mark(d0);
  }
  // The candidates' positions and values, ascending, and how many lie above d0's digit.
  int64_t above = 0, nc = 0;
  for (int64_t w = 0; w < words; ++w) {
    for (uint32_t bits = marks[w]; bits; bits &= bits - 1u) {
      const int64_t i = 32 * w + ctz32(bits);
      const float v = v_at(i);
      cand[nc] = static_cast<uint16_t>(i);
      cv[nc] = v;
      above += (abs_bits(v) >> 23) > d0 ? 1 : 0;
      ++nc;
    }
  }
  const SparseThreshold t = sparse_threshold(d0, kk - above, cv, ns);
  // The kept set in ascending position order, compacted in place (nk <= c): everything above the
  // threshold, and the first t.ties values equal to it.
  int64_t ties = t.ties, nk = 0;
  uint32_t lo = 0xffffffffu, hi = 0;
  for (int64_t c = 0; c < ns && nk < kk; ++c) {
    const float v = cv[c];
    const uint32_t ab = abs_bits(v);
    const bool take = ab > t.bits || (ab == t.bits && ties > 0);
    if (!take) continue;
    if (ab == t.bits) --ties;
    pos[nk] = cand[c];
    val[nk] = v;
    ++nk;
    lo = ab < lo ? ab : lo;
    hi = umax(hi, ab);
  }
  // Levels: bin j of magnitude bits in [lo, hi], table[j] = the bin's mean |v|.
  const uint64_t span = static_cast<uint64_t>(hi - lo) + 1;
  double sum[8] = {0, 0, 0, 0, 0, 0, 0, 0};  // levels <= 8 (bits <= 4)
  int64_t cnt[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (int64_t e = 0; e < nk; ++e) {
    const uint32_t ab = abs_bits(val[e]);
    const int32_t j = static_cast<int32_t>((static_cast<uint64_t>(ab - lo) * g.levels) / span);
    sum[j] += static_cast<double>(u2f(ab));
    ++cnt[j];
  }
  for (int32_t j = 0; j < g.levels; ++j)
    table[j] = cnt[j] ? static_cast<float>(sum[j] / static_cast<double>(cnt[j])) : 0.0f;
  if (HAS_R)
    for (int64_t i = 0; i < m; ++i) r[i] = Elem<DT>::load(x[i]) + r[i];  // r = v: nothing sent yet
  const uint32_t low_mask = (1u << g.low_bits) - 1u;
  uint8_t* codes = rec + g.idx_bytes;
  for (int64_t e = 0; e < nk; ++e) {
    const uint32_t ab = abs_bits(val[e]);
    const uint32_t j = static_cast<uint32_t>((static_cast<uint64_t>(ab - lo) * g.levels) / span);
    const uint32_t neg = f2u(val[e]) >> 31;
    const float d = neg ? -table[j] : table[j];
    put_bits(rec, e * g.low_bits, pos[e] & low_mask, g.low_bits);
    put_bits(rec, high0 + (pos[e] >> g.low_bits) + e, 1u, 1);
    put_bits(codes, e * g.bits, neg | (j << 1), g.bits);
    if (HAS_R) r[pos[e]] = val[e] - d;
  }
}

// Encodes one chunk of m (<= g.chunk) values: x (dtype DT) plus r (fp32, or nullptr). Writes the
// chunk's table (g.levels floats) and record (g.rec_bytes bytes, zeroed here) and, with r, leaves
// r = v - decoded (unsent values: v). Scratch: cand and val (g.chunk entries each), pos (g.keep).
template <int DT>
FC_HD void sparse_encode_chunk(const typename Elem<DT>::T* x, float* r, int64_t m, const SparseGeom& g,
                               float* table, uint8_t* rec, uint16_t* cand, uint16_t* pos, float* val) {
  if (r) sparse_encode_chunk_t<DT, true>(x, r, m, g, table, rec, cand, pos, val);
  else sparse_encode_chunk_t<DT, false>(x, r, m, g, table, rec, cand, pos, val);
}

// ---- decoding one chunk --------------------------------------------------------------------------

enum SparseStatus : int32_t {
  kSparseOk = 0,
  kSparseNonFinite = 1,     // the chunk decodes to NaN everywhere (all table entries NaN)
  kSparseBadTable = -1,     // an inf, negative or partly-NaN table entry
  kSparseBadCount = -2,     // the high bit vector does not hold exactly `kept` set bits
  kSparseOutOfRange = -3,   // a position beyond the chunk
  kSparseNotAscending = -4  // positions not strictly ascending
};

struct SparseParse {
  int32_t status;
  int64_t count;  // entries decoded into pos / val (kSparseOk)
  int64_t entry;  // the offending entry (errors)
};

// Reads one chunk of m values: positions into pos, values into val (each g.keep long). Reads only
// table[0, levels) and rec[0, rec_bytes), whatever their contents.
FC_HD SparseParse sparse_parse_chunk(const float* table, const uint8_t* rec, int64_t m, const SparseGeom& g,
                                     uint16_t* pos, float* val) {
  const int64_t kk = m < g.keep ? m : g.keep;
  int32_t nans = 0;
  for (int32_t j = 0; j < g.levels; ++j) {
    const uint32_t b = f2u(table[j]);
    if ((b & kAbsMask) > kInfBits) ++nans;
    else if (b == kInfBits || (b >> 31 && (b & kAbsMask) != 0)) return SparseParse{kSparseBadTable, 0, j};
  }
  if (nans == g.levels) return SparseParse{kSparseNonFinite, 0, 0};
  if (nans) return SparseParse{kSparseBadTable, 0, 0};
  const int64_t high0 = g.keep * g.low_bits;
  const uint8_t* codes = rec + g.idx_bytes;
  int64_t e = 0, prev = -1;
  for (int64_t q = 0; q < g.high_bits; ++q) {
    if (!((rec[(high0 + q) >> 3] >> ((high0 + q) & 7)) & 1u)) continue;
    if (e >= kk) return SparseParse{kSparseBadCount, 0, e};
    const int64_t p = ((q - e) << g.low_bits) | get_bits(rec, e * g.low_bits, g.low_bits);
    if (p >= m) return SparseParse{kSparseOutOfRange, 0, e};
    if (p <= prev) return SparseParse{kSparseNotAscending, 0, e};
    const uint32_t code = get_bits(codes, e * g.bits, g.bits);
    const float a = table[code >> 1];
    pos[e] = static_cast<uint16_t>(p);
    val[e] = (code & 1u) ? -a : a;
    prev = p;
    ++e;
  }
  if (e != kk) return SparseParse{kSparseBadCount, 0, e};
  return SparseParse{kSparseOk, kk, 0};
}

}  // namespace core
}  // namespace flatcomm

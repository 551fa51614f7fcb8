// The payload layout and the per-element / per-block math of every codec (the codec list, ids and
// properties: dispatch.h).
//
// Payload layout (one contiguous byte buffer, total size a multiple of 16):
//   cast codecs (fp32, bf16, fp16):  values, element i at byte i * esize
//   blockwise (int8, int4, sign):    [fp32 scale per block, padded to 16 B][codes]
//                                    int8: byte i; int4: nibble (i & 1) of byte i / 2 (low first),
//                                    stored as q + 8; sign: bit (i & 7) of byte i / 8, 1 = negative
//   topk:                            [uint32 index x k, padded to 16 B][fp32 value x k]
//                                    indices strictly ascending
//   sparse, sparse4 (chunked):       [fp32 level table per chunk, padded to 16 B][record per chunk]
//                                    k = kept per chunk of `block` values (core/sparse.h)
// A block is elements [b * B, min((b + 1) * B, n)). B is a multiple of 32, so every block starts on
// a byte boundary of the codes.
//
// Non-finite rule (blockwise codecs): if v = x + residual has an inf or NaN anywhere in a block, the
// block's scale is stored as NaN, so every value of that block decodes to NaN, and the block's
// residual keeps its previous (finite) contents. Cast codecs and topk apply the same rule per
// element: an element whose encoded value is not finite keeps its previous residual.
#pragma once
#include "dispatch.h"
#include "sparse.h"

namespace flatcomm {
namespace core {

constexpr int64_t kMinBlock = 32;
constexpr int64_t kMaxBlock = 4096;
constexpr int64_t kAlign = 16;

// The largest numel any op accepts: far beyond any tensor that fits in memory, and small enough
// that every size derived from it (n * 4 bytes, n * 8 code bits, their sums and roundings) fits in
// int64. Arguments that pass layout_ok never overflow layout(); the ops check it before any size
// is used (a peer's numel is untrusted input too).
constexpr int64_t kMaxNumel = int64_t(1) << 56;
constexpr int64_t kMaxTopkNumel = (int64_t(1) << 32) - 1;  // indices are uint32

// Whether (codec, n, block, k) describe a payload: block a multiple of 32 in [kMinBlock, kMaxBlock]
// for blockwise codecs, 1 <= k <= n < 2^32 for topk (k = 0 when n = 0), 0 <= n <= kMaxNumel.
FC_HD bool layout_ok(int32_t codec, int64_t n, int64_t block, int64_t k) {
  if (!valid_codec_id(codec) || n < 0 || n > kMaxNumel) return false;
  if (is_blockwise(codec)) return block >= kMinBlock && block <= kMaxBlock && block % 32 == 0;
  if (codec == kCodecTopK) return n <= kMaxTopkNumel && (n == 0 ? k == 0 : (k >= 1 && k <= n));
  if (is_chunk_sparse(codec)) return sparse_args_ok(block, k);
  return true;
}

struct Layout {
  int64_t nblocks;       // blockwise: number of scale blocks; chunked sparse: of chunks
  int64_t codes_offset;  // byte offset of codes (blockwise), values (topk) or records (chunked sparse)
  int64_t total;         // payload bytes, a multiple of 16
  int64_t record_bytes;  // chunked sparse: bytes of one chunk's record (else 0)
};

// `block` is the block size for blockwise codecs, `k` the kept count for topk. Only for arguments
// that pass layout_ok (others may overflow).
FC_HD Layout layout(int32_t codec, int64_t n, int64_t block, int64_t k) {
  Layout l{0, 0, 0, 0};
  if (n <= 0) return l;
  if (is_cast(codec)) {
    l.total = round_up(n * cast_bytes(codec), kAlign);
  } else if (codec == kCodecTopK) {
    l.codes_offset = round_up(4 * k, kAlign);
    l.total = round_up(l.codes_offset + 4 * k, kAlign);
  } else if (is_chunk_sparse(codec)) {
    const SparseGeom g = sparse_geom(code_bits(codec), block, k);
    l.nblocks = ceil_div(n, block);
    l.codes_offset = round_up(4 * g.levels * l.nblocks, kAlign);
    l.record_bytes = g.rec_bytes;
    l.total = round_up(l.codes_offset + g.rec_bytes * l.nblocks, kAlign);
  } else {
    l.nblocks = ceil_div(n, block);
    l.codes_offset = round_up(4 * l.nblocks, kAlign);
    l.total = round_up(l.codes_offset + ceil_div(n * code_bits(codec), 8), kAlign);
  }
  return l;
}

// The bytes of a payload that carry data: [0, head_end) (block scales or topk indices) and
// [codes_offset, data_end) (codes or values; cast codecs: [0, data_end)). Every other byte up to
// `total` is padding, which goes on the wire as zeros.
struct DataEnds {
  int64_t head_end;
  int64_t data_end;
};

FC_HD DataEnds data_ends(int32_t codec, int64_t n, int64_t k, const Layout& l) {
  DataEnds d{0, 0};
  if (n <= 0) return d;
  if (is_cast(codec)) {
    d.data_end = n * cast_bytes(codec);
  } else if (codec == kCodecTopK) {
    d.head_end = 4 * k;
    d.data_end = l.codes_offset + 4 * k;
  } else if (is_chunk_sparse(codec)) {
    d.head_end = 4 * (int64_t(1) << (code_bits(codec) - 1)) * l.nblocks;
    d.data_end = l.codes_offset + l.record_bytes * l.nblocks;
  } else {
    d.head_end = 4 * l.nblocks;
    d.data_end = l.codes_offset + ceil_div(n * code_bits(codec), 8);
  }
  return d;
}

// Validity of a topk index list (strictly ascending, every index < n): k when valid, else the
// first entry that breaks it. The common, valid case is one branch-free pass that vectorises (an
// OR of compares); only an invalid list is walked again to find the entry.
FC_HD int64_t topk_first_bad(const uint32_t* idx, int64_t k, int64_t n) {
  if (k <= 0) return k;
  const uint64_t last = static_cast<uint64_t>(n) - 1;  // n >= k >= 1
  uint32_t bad = static_cast<uint32_t>(idx[0] > last);
  for (int64_t e = 1; e < k; ++e)
    bad |= static_cast<uint32_t>(idx[e] <= idx[e - 1]) | static_cast<uint32_t>(idx[e] > last);
  if (!bad) return k;
  for (int64_t e = 0; e < k; ++e)
    if (static_cast<uint64_t>(idx[e]) > last || (e > 0 && idx[e] <= idx[e - 1])) return e;
  return k;
}

// ---- blockwise integer codecs (int8, int4) -------------------------------------------------------

// The largest code of a scaled integer codec: 2^(bits - 1) - 1 (127 for int8, 7 for int4).
FC_HD constexpr float int_qmax(int32_t c) { return static_cast<float>((1 << (code_bits(c) - 1)) - 1); }

// Everything the element loop needs for one block, derived from the block's max |v| bits.
struct BlockParams {
  float scale;  // decoded value = code * scale; NaN marks a non-finite block
  float pre;    // exact power of two that lifts subnormal blocks into the normal range
  float inv;    // 1 / (scale * pre), 0 for an all-zero block
  bool finite;
};

FC_HD BlockParams int_block_params(uint32_t max_abs_bits, float qmax) {
  BlockParams p;
  p.finite = bits_finite(max_abs_bits);
  if (!p.finite) {
    p.scale = u2f(0x7fc00000u);
    p.pre = 1.0f;
    p.inv = 0.0f;
    return p;
  }
  float s = u2f(max_abs_bits) / qmax;
  // qmax * s rounds up past FLT_MAX when max|v| is near it: step s down one ulp.
  if (!(s * qmax <= kFloatMax)) s = u2f(f2u(s) - 1u);
  // A subnormal scale is coarsely rounded: round it up instead, so that qmax * s still covers
  // max|v| and every value stays within half a step of its code.
  if (s < kFloatMinNormal && s * qmax < u2f(max_abs_bits)) s = u2f(f2u(s) + 1u);
  p.scale = s;
  // Subnormal scale: 1/s would overflow. Multiplying v and s by 2^64 is exact for such tiny values.
  p.pre = s < kFloatMinNormal ? 18446744073709551616.0f : 1.0f;
  p.inv = s > 0.0f ? 1.0f / (s * p.pre) : 0.0f;
  return p;
}

// Code in [-qmax, qmax]. `u` is the stochastic-rounding offset in [0, 1), or < 0 for nearest.
FC_HD float int_quantize(float v, const BlockParams& p, float qmax) {
  float t = (v * p.pre) * p.inv;
  t = fmax_(fmin_(t, qmax), -qmax);  // NaN (only in non-finite blocks) becomes qmax
  return round_half_even(t);
}

FC_HD float int_quantize_stochastic(float v, const BlockParams& p, float qmax, float u) {
  float t = (v * p.pre) * p.inv;
  t = fmax_(fmin_(t, qmax), -qmax);
  float q = floor_small(t + u);
  return fmin_(q, qmax);
}

FC_HD float int_dequantize(float q, float scale) { return q * scale; }

// ---- code packing: codes to payload bytes and back (the layout above) ----------------------------
// The CPU loops (cpu/kernels_impl.h) and the CUDA kernels (cuda/device.cuh) read and write codes
// only through these, so both produce the same bytes. Codes are whole numbers held in floats, in
// [-qmax, qmax]; multi-byte groups are little endian (the hosts' and the GPUs' byte order).

// int8: one byte per value, two's complement.
FC_HD uint8_t int8_pack(float q) { return static_cast<uint8_t>(static_cast<int32_t>(q)); }
FC_HD float int8_code(uint8_t b) { return static_cast<float>(static_cast<int8_t>(b)); }
// Four consecutive int8 codes as one word: value e in byte e.
FC_HD uint32_t int8_pack4(const float q[4]) {
  uint32_t w = 0;
  for (int e = 0; e < 4; ++e) w |= static_cast<uint32_t>(int8_pack(q[e])) << (8 * e);
  return w;
}

// int4: two values per byte, low nibble first, each stored as q + 8.
FC_HD uint8_t int4_pack(float q_lo, float q_hi) {
  return static_cast<uint8_t>((static_cast<int32_t>(q_lo) + 8) |
                              ((static_cast<int32_t>(q_hi) + 8) << 4));
}
FC_HD float int4_lo(uint8_t b) { return static_cast<float>(static_cast<int32_t>(b & 15) - 8); }
FC_HD float int4_hi(uint8_t b) { return static_cast<float>(static_cast<int32_t>(b >> 4) - 8); }
// The code of element i of a block's codes (i counted from an even element).
FC_HD float int4_code(const uint8_t* codes, int64_t i) {
  const uint8_t b = codes[i >> 1];
  return (i & 1) ? int4_hi(b) : int4_lo(b);
}
// Four consecutive int4 codes as two bytes.
FC_HD uint16_t int4_pack4(const float q[4]) {
  return static_cast<uint16_t>(int4_pack(q[0], q[1]) | (static_cast<uint32_t>(int4_pack(q[2], q[3])) << 8));
}

// ---- sign codec: 1 bit + scale = mean |v| of the block ----------------------------------------
// The mean is summed in a fixed order: lane j (0..31) adds elements j, j+32, j+64, ... in turn,
// then lanes are folded pairwise (j with j+16, then j+8, ...). A CUDA warp reproduces this order.

constexpr int kSignLanes = 32;
constexpr uint32_t kSignHugeBits = 0x6f800000u;  // 2^96: sum |v| * 2^-32 above this to avoid overflow

FC_HD float sign_sum_pre(uint32_t max_abs_bits) {
  return max_abs_bits >= kSignHugeBits ? 2.3283064365386963e-10f : 1.0f;  // 2^-32
}

FC_HD float fold_lanes(float* lanes) {
  for (int w = kSignLanes / 2; w > 0; w /= 2)
    for (int j = 0; j < w; ++j) lanes[j] = lanes[j] + lanes[j + w];
  return lanes[0];
}

FC_HD BlockParams sign_block_params(uint32_t max_abs_bits, float folded_sum, int64_t count) {
  BlockParams p;
  p.finite = bits_finite(max_abs_bits);
  p.pre = 1.0f;
  p.inv = 0.0f;
  if (!p.finite) {
    p.scale = u2f(0x7fc00000u);
    return p;
  }
  float mean = folded_sum / static_cast<float>(count);
  p.scale = mean / sign_sum_pre(max_abs_bits);  // exact: a power of two
  return p;
}

FC_HD uint32_t sign_bit(float v) { return v < 0.0f ? 1u : 0u; }
// The sign bits of `count` <= 32 consecutive values as one word: value j in bit j, i.e. bit (i & 7)
// of byte i / 8 once stored little endian.
FC_HD uint32_t sign_pack(const float* v, int64_t count) {
  uint32_t word = 0;
  for (int64_t j = 0; j < count; ++j) word |= sign_bit(v[j]) << j;
  return word;
}
// The bit of element i of a block's codes (i counted from a multiple of 8).
FC_HD uint32_t sign_code(const uint8_t* codes, int64_t i) { return (codes[i >> 3] >> (i & 7)) & 1u; }
// The first `nbytes` (<= 4) bytes of a word of codes, little endian: a block's partial last word.
FC_HD void store_code_bytes(uint8_t* c, uint32_t word, int64_t nbytes) {
  for (int64_t q = 0; q < nbytes; ++q) c[q] = static_cast<uint8_t>(word >> (8 * q));
}
// Flipping the sign bit is exactly IEEE negation; as integer math it vectorises without selects.
FC_HD float sign_dequantize(uint32_t bit, float scale) { return u2f(f2u(scale) ^ (bit << 31)); }

// ---- error feedback --------------------------------------------------------------------------

// New residual for one element: what was not transmitted, unless the block/element is non-finite.
FC_HD float ef_residual(float v, float decoded, float old_residual, bool finite) {
  return finite ? v - decoded : old_residual;
}

// ---- topk ordering key ---------------------------------------------------------------------------
// Larger |v| first; NaN and inf rank above every finite value; ties go to the lower index.
FC_HD uint64_t topk_key(float v, uint64_t index) {
  return (static_cast<uint64_t>(abs_bits(v)) << 32) | (0xffffffffull - (index & 0xffffffffull));
}

}  // namespace core
}  // namespace flatcomm

// The CPU kernel loops. Included by each kernels_<isa>.cpp inside its own namespace, after the
// core headers, with that ISA's target pragma in force; never included anywhere else.
//
// Loops are written so that GCC and Clang vectorise them without reassociating float math: every
// reduction is either an integer max or an explicit fixed-lane sum.

using namespace ::flatcomm::core;

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "flatcomm's CPU kernels pack sign codes as little-endian words"
#endif

template <typename T>
static inline T min_(T a, T b) { return a < b ? a : b; }

#ifndef FC_ISA_VARIABLE_SHIFTS
#define FC_ISA_VARIABLE_SHIFTS 0  // the ISA has per-lane variable shifts (AVX2 and up)
#endif

// Sign-bit masks of the 8 values packed in each possible sign-codec byte.
struct SignMaskTable {
  uint32_t m[256][8];
};
static constexpr SignMaskTable make_sign_masks() {
  SignMaskTable t{};
  for (int byte = 0; byte < 256; ++byte)
    for (int bit = 0; bit < 8; ++bit) t.m[byte][bit] = ((byte >> bit) & 1) ? 0x80000000u : 0u;
  return t;
}
alignas(32) static constexpr SignMaskTable kSignMasks = make_sign_masks();

// ---- chunked sparse (core/sparse.h): one chunk at a time ----------------------------------------

// Decodes [i0, i1) of a chunked sparse payload: each chunk touched is parsed whole (positions are
// coded, not indexable), then its entries inside the range are scattered. The ops validate host
// payloads first (check_sparse_payload); a chunk that fails here anyway decodes to NaN.
template <int C, bool ACC>
static void decode_range_sparse(const uint8_t* payload, int64_t n, int64_t block, int64_t k, int64_t i0,
                                int64_t i1, float* out) {
  const Layout L = layout(C, n, block, k);
  const SparseGeom g = sparse_geom(code_bits(C), block, k);
  const float* tables = reinterpret_cast<const float*>(payload);
  uint16_t pos[kSparseMaxChunk];
  float val[kSparseMaxChunk];
  for (int64_t i = i0; i < i1;) {
    const int64_t c = i / block, c0 = c * block;
    const int64_t e = min_(i1, c0 + block);
    const SparseParse sp = sparse_parse_chunk(tables + c * g.levels, payload + L.codes_offset + c * g.rec_bytes,
                                              min_(block, n - c0), g, pos, val);
    if (sp.status != kSparseOk) {
      for (int64_t j = i; j < e; ++j) out[j - i0] = u2f(0x7fc00000u);  // NaN: non-finite chunk
    } else {
      if (!ACC)
        for (int64_t j = i; j < e; ++j) out[j - i0] = 0.0f;
      for (int64_t t = 0; t < sp.count; ++t) {
        const int64_t j = c0 + pos[t];
        if (j < i || j >= e) continue;
        if (ACC) out[j - i0] = add_in_order(out[j - i0], val[t]); else out[j - i0] = val[t];
      }
    }
    i = e;
  }
}

// Encodes the whole chunks of [i0, i1) (i0 a multiple of the chunk size): select, quantize and
// update the residual chunk by chunk, while the chunk is in cache.
template <int DT, int C>
static void encode_range_sparse(const EncodeArgs& a, int64_t i0, int64_t i1) {
  const Layout L = layout(C, a.n, a.block, a.k);
  const SparseGeom g = sparse_geom(code_bits(C), a.block, a.k);
  const auto* x = static_cast<const typename Elem<DT>::T*>(a.x);
  float* tables = reinterpret_cast<float*>(a.payload);
  uint16_t cand[kSparseMaxChunk], pos[kSparseMaxChunk];
  float val[kSparseMaxChunk];
  for (int64_t i = i0; i < i1; i += a.block) {
    const int64_t c = i / a.block;
    sparse_encode_chunk<DT>(x + i, a.residual ? a.residual + i : nullptr, min_(a.block, a.n - i), g,
                            tables + c * g.levels, a.payload + L.codes_offset + c * g.rec_bytes, cand, pos, val);
  }
}

// ---- decoding any 32-aligned element range ----------------------------------------------------

// out[j - i0] = decode(i) (ACC = false) or out[j - i0] + decode(i) (ACC = true, core add_in_order),
// i in [i0, i1).
template <int C, bool ACC>
static void decode_range(const uint8_t* payload, int64_t n, int64_t block, int64_t k, int64_t i0,
                         int64_t i1, float* out) {
  static_assert(!is_blockwise(C) || C == kCodecInt8 || C == kCodecInt4 || C == kCodecSign,
                "a blockwise codec without its branch below");
  const Layout L = layout(C, n, block, k);
  if constexpr (is_cast(C)) {
    using E = Elem<cast_dtype(C)>;
    const auto* values = reinterpret_cast<const typename E::T*>(payload);
    for (int64_t i = i0; i < i1; ++i) {
      const float d = E::load(values[i]);
      if (ACC) out[i - i0] = add_in_order(out[i - i0], d); else out[i - i0] = d;
    }
    return;
  }
  if constexpr (is_chunk_sparse(C)) {
    decode_range_sparse<C, ACC>(payload, n, block, k, i0, i1, out);
    return;
  }
  if (C == kCodecTopK) {
    const uint32_t* idx = reinterpret_cast<const uint32_t*>(payload);
    const float* val = reinterpret_cast<const float*>(payload + L.codes_offset);
    if (!ACC)
      for (int64_t i = i0; i < i1; ++i) out[i - i0] = 0.0f;
    int64_t lo = 0, hi = k;  // first entry with idx >= i0
    while (lo < hi) {
      int64_t mid = (lo + hi) / 2;
      if (static_cast<int64_t>(idx[mid]) < i0) lo = mid + 1; else hi = mid;
    }
    for (int64_t e = lo; e < k && static_cast<int64_t>(idx[e]) < i1; ++e) {
      // The ops reject non-ascending indices before any kernel runs; this test keeps a payload that
      // skipped them (a direct kernel call) from writing before the range.
      const int64_t j = static_cast<int64_t>(idx[e]) - i0;
      if (j < 0) continue;
      if (ACC) out[j] = add_in_order(out[j], val[e]); else out[j] = val[e];
    }
    return;
  }
  const float* scales = reinterpret_cast<const float*>(payload);
  const uint8_t* codes = payload + L.codes_offset;
  for (int64_t i = i0; i < i1;) {
    const int64_t b = i / block;
    const int64_t e = min_(i1, (b + 1) * block);
    const float s = scales[b];
    float* o = out + (i - i0);
    const int64_t len = e - i;
    if (C == kCodecInt8) {
      const uint8_t* q = codes + i;
      for (int64_t j = 0; j < len; ++j) {
        float d = int_dequantize(int8_code(q[j]), s);
        if (ACC) o[j] = add_in_order(o[j], d); else o[j] = d;
      }
    } else if (C == kCodecInt4) {
      const uint8_t* q = codes + i / 2;  // i is even: blocks and ranges are 32-aligned
      const int64_t pairs = len / 2;
      for (int64_t j = 0; j < pairs; ++j) {
        float d0 = int_dequantize(int4_lo(q[j]), s), d1 = int_dequantize(int4_hi(q[j]), s);
        if (ACC) {
          o[2 * j] = add_in_order(o[2 * j], d0);
          o[2 * j + 1] = add_in_order(o[2 * j + 1], d1);
        } else {
          o[2 * j] = d0;
          o[2 * j + 1] = d1;
        }
      }
      if (len & 1) {
        float d = int_dequantize(int4_lo(q[pairs]), s);
        if (ACC) o[len - 1] = add_in_order(o[len - 1], d); else o[len - 1] = d;
      }
    } else {  // sign (i is a multiple of 32)
      const uint8_t* q = codes + i / 8;
      const uint32_t sbits = f2u(s);
      int64_t j = 0;
#if FC_ISA_VARIABLE_SHIFTS
      // 32 values per little-endian word, each a sign-bit flip of the scale as integer math (same
      // bits as sign_dequantize): per-lane variable shifts make this a few vector ops per 8 values.
      for (; j + 32 <= len; j += 32) {
        uint32_t word;
        memcpy(&word, q + j / 8, 4);
        for (int bit = 0; bit < 32; ++bit) {
          float d = u2f(sbits ^ (((word >> bit) & 1u) << 31));
          if (ACC) o[j + bit] = add_in_order(o[j + bit], d); else o[j + bit] = d;
        }
      }
#else
      // Without per-lane shifts: the 8 sign masks of each byte from a table, one xor per value.
      for (; j + 8 <= len; j += 8) {
        const uint32_t* mask = kSignMasks.m[q[j / 8]];
        for (int bit = 0; bit < 8; ++bit) {
          float d = u2f(sbits ^ mask[bit]);
          if (ACC) o[j + bit] = add_in_order(o[j + bit], d); else o[j + bit] = d;
        }
      }
#endif
      for (; j < len; ++j) {
        float d = sign_dequantize(sign_code(q, j), s);
        if (ACC) o[j] = add_in_order(o[j], d); else o[j] = d;
      }
    }
    i = e;
  }
}

template <bool ACC>
static void decode_range_any(int32_t codec, const uint8_t* p, int64_t n, int64_t block, int64_t k,
                             int64_t i0, int64_t i1, float* out) {
  by_codec(codec, [&](auto c) { decode_range<decltype(c)::value, ACC>(p, n, block, k, i0, i1, out); });
}

// ---- encoding one block (or cast tile) --------------------------------------------------------

// Encodes elements [i0, i0 + len) taken from xb (len values, dtype DT); rb is the matching
// residual slice (or nullptr). For blockwise codecs [i0, i0 + len) is exactly block i0 / block.
template <int DT, int C, bool HAS_R, bool STOCH>
static void encode_block(const typename Elem<DT>::T* xb, float* rb, int64_t i0, int64_t len,
                         const EncodeArgs& a, const Layout& L, uint64_t key) {
  static_assert(!is_blockwise(C) || C == kCodecInt8 || C == kCodecInt4 || C == kCodecSign,
                "a blockwise codec without its branch below");
  float v[kMaxBlock > kTile ? kMaxBlock : kTile];
  uint32_t m = 0;
  for (int64_t j = 0; j < len; ++j) {
    float t = Elem<DT>::load(xb[j]);
    if (HAS_R) t = t + rb[j];
    v[j] = t;
    m = umax(m, abs_bits(t));
  }
  if constexpr (is_cast(C)) {
    using E = Elem<cast_dtype(C)>;
    auto* values = reinterpret_cast<typename E::T*>(a.payload);
    for (int64_t j = 0; j < len; ++j) {
      typename E::T h;
      if constexpr (STOCH) h = E::store_stochastic(v[j], random_u32(key, i0 + j));
      else h = E::store(v[j]);
      values[i0 + j] = h;
      const float d = E::load(h);
      if (HAS_R) rb[j] = ef_residual(v[j], d, rb[j], bits_finite(abs_bits(d)));
    }
    return;
  }
  const int64_t b = i0 / a.block;
  float* scales = reinterpret_cast<float*>(a.payload);
  uint8_t* codes = a.payload + L.codes_offset;
  if (codec_kind(C) == CodecKind::kScaledInt) {
    const float qmax = int_qmax(C);
    const BlockParams p = int_block_params(m, qmax);
    scales[b] = p.scale;
    float q[kMaxBlock];
    for (int64_t j = 0; j < len; ++j)
      q[j] = STOCH ? int_quantize_stochastic(v[j], p, qmax, random_unit(key, i0 + j))
                   : int_quantize(v[j], p, qmax);
    if (C == kCodecInt8) {
      uint8_t* c = codes + i0;
      for (int64_t j = 0; j < len; ++j) c[j] = int8_pack(q[j]);
    } else {
      uint8_t* c = codes + i0 / 2;
      const int64_t pairs = len / 2;
      for (int64_t j = 0; j < pairs; ++j) c[j] = int4_pack(q[2 * j], q[2 * j + 1]);
      if (len & 1) c[pairs] = int4_pack(q[len - 1], 0.0f);
    }
    if (HAS_R && p.finite)
      for (int64_t j = 0; j < len; ++j) rb[j] = v[j] - int_dequantize(q[j], p.scale);
    return;
  }
  // sign: scale = mean |v| summed in the fixed lane order of core/codec.h
  const float pre = sign_sum_pre(m);
  float lanes[kSignLanes];
  for (int l = 0; l < kSignLanes; ++l) lanes[l] = 0.0f;
  int64_t j = 0;
  for (; j + kSignLanes <= len; j += kSignLanes)
    for (int l = 0; l < kSignLanes; ++l) lanes[l] = lanes[l] + fabs_(v[j + l]) * pre;
  for (int l = 0; j + l < len; ++l) lanes[l] = lanes[l] + fabs_(v[j + l]) * pre;
  const BlockParams p = sign_block_params(m, fold_lanes(lanes), len);
  scales[b] = p.scale;
  uint8_t* c = codes + i0 / 8;
  // 32 values at a time into one little-endian word (byte t = values 8t..8t+7, low bit first:
  // the payload layout on little-endian hosts): a compare, shift and OR reduction that
  // vectorises, where a byte at a time with a bounds test does not. The tail's partial word is
  // stored byte by byte, only the bytes that hold its values.
  const int64_t words = len / 32;
  for (int64_t w = 0; w < words; ++w) {
    const uint32_t word = sign_pack(v + 32 * w, 32);
    memcpy(c + 4 * w, &word, 4);
  }
  if (const int64_t rest = len - 32 * words; rest > 0)
    store_code_bytes(c + 4 * words, sign_pack(v + 32 * words, rest), (rest + 7) / 8);
  if (HAS_R && p.finite)
    for (int64_t e = 0; e < len; ++e) rb[e] = v[e] - sign_dequantize(sign_bit(v[e]), p.scale);
}

// x element i is at a.x[i - origin] (origin = 0 except for the fused re-encode).
template <int DT, int C, bool HAS_R, bool STOCH>
static void encode_range_t(const EncodeArgs& a, int64_t i0, int64_t i1, int64_t origin) {
  const Layout L = layout(C, a.n, a.block, a.k);
  const int64_t step = is_blockwise(C) ? a.block : kTile;
  const uint64_t key = seed_key(a.seed);
  const auto* x = static_cast<const typename Elem<DT>::T*>(a.x);
  for (int64_t i = i0; i < i1; i += step) {
    const int64_t len = min_(step, i1 - i);
    encode_block<DT, C, HAS_R, STOCH>(x + (i - origin), HAS_R ? a.residual + i : nullptr, i, len, a, L, key);
  }
}

template <int DT, int C>
static void encode_range_c(const EncodeArgs& a, int64_t i0, int64_t i1, int64_t origin) {
  const bool r = a.residual != nullptr;
  constexpr bool kCanStoch = has_stochastic(C);  // a.stochastic for other codecs: checked by the caller
  if (kCanStoch && a.stochastic) {
    if (r) encode_range_t<DT, C, true, kCanStoch>(a, i0, i1, origin);
    else encode_range_t<DT, C, false, kCanStoch>(a, i0, i1, origin);
  } else {
    if (r) encode_range_t<DT, C, true, false>(a, i0, i1, origin);
    else encode_range_t<DT, C, false, false>(a, i0, i1, origin);
  }
}

// Every codec but topk, which selects over the whole tensor (encode_topk_impl). The chunked sparse
// codecs are not re-encoded fused (decode_sum_encode refuses them), so origin is 0 for them.
template <int DT>
static void encode_range_d(const EncodeArgs& a, int64_t i0, int64_t i1, int64_t origin) {
  by_codec(a.codec, [&](auto c) {
    constexpr int C = decltype(c)::value;
    if constexpr (is_chunk_sparse(C)) encode_range_sparse<DT, C>(a, i0, i1);
    else if constexpr (C != kCodecTopK) encode_range_c<DT, C>(a, i0, i1, origin);
  });
}

static void encode_impl(const EncodeArgs& a, int64_t i0, int64_t i1) {
  by_dtype(a.x_dtype, [&](auto dt) { encode_range_d<decltype(dt)::value>(a, i0, i1, 0); });
}

// ---- topk: exact selection by radix select on |v| bits, ties to the lower index ---------------

template <int DT>
static void topk_fill(const EncodeArgs& a, float* v) {
  const auto* x = static_cast<const typename Elem<DT>::T*>(a.x);
  if (a.residual)
    for (int64_t i = 0; i < a.n; ++i) v[i] = Elem<DT>::load(x[i]) + a.residual[i];
  else
    for (int64_t i = 0; i < a.n; ++i) v[i] = Elem<DT>::load(x[i]);
}

static void encode_topk_impl(const EncodeArgs& a) {
  const int64_t n = a.n, k = a.k;
  if (n == 0) return;
  float* v = a.scratch;
  by_dtype(a.x_dtype, [&](auto dt) { topk_fill<decltype(dt)::value>(a, v); });
  // Find the k-th largest |v| bit pattern, 31 bits in three digit passes (11, 11, 9 bits).
  static const int kShift[3] = {20, 9, 0};
  static const uint32_t kDigits[3] = {2048, 2048, 512};
  uint32_t prefix = 0, prefix_mask = 0;
  int64_t need = k;  // how many still to take at or below the current prefix
  int64_t hist[2048];
  for (int pass = 0; pass < 3; ++pass) {
    for (uint32_t d = 0; d < kDigits[pass]; ++d) hist[d] = 0;
    for (int64_t i = 0; i < n; ++i) {
      const uint32_t ab = abs_bits(v[i]);
      if ((ab & prefix_mask) == prefix) ++hist[(ab >> kShift[pass]) & (kDigits[pass] - 1)];
    }
    uint32_t d = kDigits[pass] - 1;
    for (;; --d) {
      if (hist[d] >= need) break;
      need -= hist[d];
    }
    prefix |= d << kShift[pass];
    prefix_mask |= (kDigits[pass] - 1) << kShift[pass];
  }
  // prefix is now the threshold bit pattern: take everything above it, and the first `need`
  // indices equal to it.
  uint32_t* idx = reinterpret_cast<uint32_t*>(a.payload);
  float* val = reinterpret_cast<float*>(a.payload + layout(kCodecTopK, n, 0, k).codes_offset);
  int64_t out = 0;
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t ab = abs_bits(v[i]);
    bool take = ab > prefix || (ab == prefix && need > 0);
    if (ab == prefix && take) --need;
    if (take) {
      idx[out] = static_cast<uint32_t>(i);
      val[out] = v[i];
      ++out;
    }
    // Sent values leave a zero residual, unsent ones carry over, non-finite keeps the old one.
    if (a.residual && bits_finite(ab)) a.residual[i] = take ? 0.0f : v[i];
  }
}

// ---- decode / decode_sum / fused re-encode ----------------------------------------------------

// fp32 output is decoded in place; other dtypes through an fp32 tile.
template <int DT>
static void decode_to(const DecodeArgs& a, int64_t i0, int64_t i1) {
  if constexpr (DT == kF32) {
    decode_range_any<false>(a.codec, a.payload, a.n, a.block, a.k, i0, i1, static_cast<float*>(a.out) + i0);
  } else {
    auto* out = static_cast<typename Elem<DT>::T*>(a.out);
    float tile[kTile];
    for (int64_t i = i0; i < i1; i += kTile) {
      const int64_t e = min_(i1, i + kTile);
      decode_range_any<false>(a.codec, a.payload, a.n, a.block, a.k, i, e, tile);
      for (int64_t j = 0; j < e - i; ++j) out[i + j] = Elem<DT>::store(tile[j]);
    }
  }
}

static void decode_impl(const DecodeArgs& a, int64_t i0, int64_t i1) {
  by_dtype(a.out_dtype, [&](auto dt) { decode_to<decltype(dt)::value>(a, i0, i1); });
}

// Units [u0, u1) of decode_rows (kernels.h): each row's stretch of units is one decode of that row.
static void decode_rows_impl(const DecodeRowsArgs& a, int64_t u0, int64_t u1) {
  const int64_t unit = decode_rows_unit(a), per_row = ceil_div(a.row_numel, unit);
  const int64_t esize = dtype_bytes(a.out_dtype);
  for (int64_t u = u0; u < u1;) {
    const int64_t r = u / per_row, row_end = min_(u1, (r + 1) * per_row);
    const int64_t len = min_(a.row_numel, a.n - r * a.row_numel);  // the last row may be cut short
    const int64_t j0 = (u - r * per_row) * unit, j1 = min_(len, (row_end - r * per_row) * unit);
    if (j0 < j1) {
      const DecodeArgs d{a.payloads + r * a.row_stride, a.row_numel, a.codec, a.block, 0,
                         static_cast<uint8_t*>(a.out) + r * a.row_numel * esize, a.out_dtype};
      decode_impl(d, j0, j1);
    }
    u = row_end;
  }
}

// Sum of the decoded rows over [i0, i1) into out (fp32), in ascending row order, then scaled.
static void decode_sum_tile(const DecodeSumArgs& a, int64_t i0, int64_t i1, float* out) {
  for (int64_t r = 0; r < a.rows; ++r) {
    const uint8_t* p = a.payloads + r * a.row_stride;
    if (r == 0) decode_range_any<false>(a.codec, p, a.n, a.block, a.k, i0, i1, out);
    else decode_range_any<true>(a.codec, p, a.n, a.block, a.k, i0, i1, out);
  }
  if (a.rows == 0)
    for (int64_t j = 0; j < i1 - i0; ++j) out[j] = 0.0f;
  if (a.scale != 1.0f)
    for (int64_t j = 0; j < i1 - i0; ++j) out[j] = out[j] * a.scale;
}

static void decode_sum_impl(const DecodeSumArgs& a, int64_t i0, int64_t i1) {
  for (int64_t i = i0; i < i1; i += kTile) decode_sum_tile(a, i, min_(i1, i + kTile), a.out + i);
}

static void decode_sum_encode_impl(const DecodeSumArgs& a, const EncodeArgs& enc, int64_t i0,
                                   int64_t i1) {
  const int64_t step = is_blockwise(enc.codec) ? enc.block : kTile;
  float acc[kMaxBlock > kTile ? kMaxBlock : kTile];
  for (int64_t i = i0; i < i1; i += step) {
    const int64_t e = min_(i1, i + step);
    decode_sum_tile(a, i, e, acc);
    EncodeArgs sub = enc;
    sub.x = acc;
    sub.x_dtype = kF32;
    encode_range_d<kF32>(sub, i, e, i);
  }
}

// ---- ordered and exact sums ---------------------------------------------------------------------

template <int DT>
static void ordered_sum_t(const OrderedSumArgs& a, int64_t i0, int64_t i1) {
  const auto* x = static_cast<const typename Elem<DT>::T*>(a.x);
  for (int64_t t = i0; t < i1; t += kTile) {
    const int64_t e = min_(i1, t + kTile);
    float* o = a.out;
    for (int64_t i = t; i < e; ++i) o[i] = a.rows ? Elem<DT>::load(x[i]) : 0.0f;
    for (int64_t r = 1; r < a.rows; ++r) {
      const auto* xr = x + r * a.row_stride;
      for (int64_t i = t; i < e; ++i) o[i] = add_in_order(o[i], Elem<DT>::load(xr[i]));
    }
  }
}

static void ordered_sum_impl(const OrderedSumArgs& a, int64_t i0, int64_t i1) {
  by_dtype(a.dtype, [&](auto dt) { ordered_sum_t<decltype(dt)::value>(a, i0, i1); });
}

// Per-block exponent, the max over all rows (i0 a multiple of the block size).
template <int DT>
static void exact_exponents_t(const ExactArgs& a, int64_t i0, int64_t i1) {
  const auto* x = static_cast<const typename Elem<DT>::T*>(a.x);
  for (int64_t i = i0; i < i1; i += a.block) {
    const int64_t e = min_(i1, i + a.block);
    uint32_t m = 0;
    for (int64_t r = 0; r < a.rows; ++r)
      for (int64_t j = i; j < e; ++j) m = umax(m, abs_bits(Elem<DT>::load(x[r * a.row_stride + j])));
    a.exponents[i / a.block] = exponent_of_abs_bits(m);
  }
}

static void exact_exponents_impl(const ExactArgs& a, int64_t i0, int64_t i1) {
  by_dtype(a.dtype, [&](auto dt) { exact_exponents_t<decltype(dt)::value>(a, i0, i1); });
}

template <int DT>
static int64_t to_fixed_t(const ExactArgs& a, int64_t i0, int64_t i1) {
  const auto* x = static_cast<const typename Elem<DT>::T*>(a.x);
  int64_t bad = 0;
  for (int64_t b0 = i0; b0 < i1; b0 += a.block) {  // i0 is a multiple of the block size
    const int64_t e = min_(i1, b0 + a.block);
    const int32_t E = a.exponents[b0 / a.block];
    // The plain to_fixed here: its branches are predictable within a block, and measured faster
    // than to_fixed_in_block in this loop (5.3 vs 8.9 ms for 2M values, one thread), unlike in
    // exact_sum below.
    for (int64_t i = b0; i < e; ++i) {
      const float v = Elem<DT>::load(x[i]);
      // A value above its block's bound would overflow the fixed point; a non-finite value in a
      // block not marked non-finite would vanish. Both are reported, never silently mangled.
      bad += (E != kExpNonFinite && (exponent_of_abs_bits(abs_bits(v)) > E || !exp_valid(E))) ? 1 : 0;
      a.fixed[i] = to_fixed(v, E, a.precision);
    }
  }
  return bad;
}

static int64_t to_fixed_impl(const ExactArgs& a, int64_t i0, int64_t i1) {
  return by_dtype(a.dtype, [&](auto dt) { return to_fixed_t<decltype(dt)::value>(a, i0, i1); });
}

// Decodes one block's integers into out (from_fixed with the block's constants hoisted).
static void from_fixed_block(const int64_t* m, int64_t count, int32_t E, int32_t precision, float* out) {
  if (!exp_in_range(E)) {  // zero, non-finite, or an invalid exponent (NaN, as from_fixed)
    const float v = E == kExpZero ? 0.0f : u2f(0x7fc00000u);
    for (int64_t j = 0; j < count; ++j) out[j] = v;
    return;
  }
  const FixedScale sc = fixed_scale(E, precision);
  for (int64_t j = 0; j < count; ++j) out[j] = from_fixed_in_block(m[j], sc);
}

static void from_fixed_impl(const ExactArgs& a, int64_t i0, int64_t i1) {
  for (int64_t b0 = i0; b0 < i1; b0 += a.block)  // i0 is a multiple of the block size
    from_fixed_block(a.fixed + b0, min_(i1, b0 + a.block) - b0, a.exponents[b0 / a.block], a.precision,
                     a.out + b0);
}

// rows: row r at rows[r] (exact_sum_rows), or nullptr: at a.x + r * a.row_stride (exact_sum).
template <int DT>
static void exact_sum_t(const ExactArgs& a, const void* const* rows, int64_t i0, int64_t i1) {
  using T = typename Elem<DT>::T;
  const auto* x = static_cast<const T*>(a.x);
  auto row = [&](int64_t r) { return rows ? static_cast<const T*>(rows[r]) : x + r * a.row_stride; };
  int64_t acc[kMaxBlock];
  for (int64_t i = i0; i < i1; i += a.block) {
    const int64_t e = min_(i1, i + a.block);
    uint32_t m = 0;
    for (int64_t r = 0; r < a.rows; ++r) {
      const T* xr = row(r);
      for (int64_t j = i; j < e; ++j) m = umax(m, abs_bits(Elem<DT>::load(xr[j])));
    }
    const int32_t E = exponent_of_abs_bits(m);
    if (a.exponents) a.exponents[i / a.block] = E;
    for (int64_t j = i; j < e; ++j) acc[j - i] = 0;
    if (!exp_is_special(E)) {
      const ToFixedScale sc = to_fixed_scale(E, a.precision);  // every value is below the block's max
      for (int64_t r = 0; r < a.rows; ++r) {
        const T* xr = row(r);
        for (int64_t j = i; j < e; ++j)  // wrapping unsigned adds: the bits of the int64 sum
          acc[j - i] = static_cast<int64_t>(static_cast<uint64_t>(acc[j - i]) +
                                            static_cast<uint64_t>(to_fixed_scaled(Elem<DT>::load(xr[j]), sc)));
      }
    }
    from_fixed_block(acc, e - i, E, a.precision, a.out + i);
  }
}

static void exact_sum_impl(const ExactArgs& a, int64_t i0, int64_t i1) {
  by_dtype(a.dtype, [&](auto dt) { exact_sum_t<decltype(dt)::value>(a, nullptr, i0, i1); });
}

static void exact_sum_rows_impl(const ExactArgs& a, const void* const* rows, int64_t i0, int64_t i1) {
  by_dtype(a.dtype, [&](auto dt) { exact_sum_t<decltype(dt)::value>(a, rows, i0, i1); });
}

static constexpr KernelTable kTable = {
    FC_ISA_NAME,        encode_impl,       encode_topk_impl,     decode_impl,          decode_rows_impl,
    decode_sum_impl,    decode_sum_encode_impl, ordered_sum_impl, exact_exponents_impl,
    to_fixed_impl,      from_fixed_impl,   exact_sum_impl,       exact_sum_rows_impl,
};

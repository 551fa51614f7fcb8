// Fuzz target: decode_sum with reencode (the fused second stage of an all-reduce), every source
// codec, every re-encode codec, with and without residual and stochastic rounding. The fused
// result must equal decode_sum followed by encode, payload and residual, bit for bit.
#include "fuzz_harness.h"

using namespace fuzz;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const Args a = parse(data, size);
  check_layout(a.out_codec, a.n, a.out_block, 0);
  if (!decodable(a) || is_chunk_sparse(a.codec)) return 0;  // the op refuses chunked sparse sources
  const Layout L = layout(a.codec, a.n, a.block, a.k), O = layout(a.out_codec, a.n, a.out_block, 0);
  Buf payloads = payload_rows(a, L.total, a.rows);
  DecodeSumArgs s{payloads.p(), L.total, a.rows, a.n, a.codec, a.block, a.k, a.scale, nullptr};
  // The residual's initial values come from the seed: finite, zero, huge and non-finite ones.
  Buf res0(static_cast<size_t>(4 * a.n));
  uint64_t bits = a.seed | 1;
  for (int64_t i = 0; i < a.n; ++i) {
    bits ^= bits << 13; bits ^= bits >> 7; bits ^= bits << 17;
    res0.f()[i] = (bits & 0xf00) == 0 ? u2f(static_cast<uint32_t>(bits >> 32)) : static_cast<float>(static_cast<int32_t>(bits >> 40)) * 1e-6f;
  }
  Buf fused(static_cast<size_t>(O.total)), res(static_cast<size_t>(4 * a.n));
  res.v = res0.v;
  EncodeArgs e{nullptr, kF32, a.residual ? res.f() : nullptr, fused.p(), a.n, a.out_codec, a.out_block, 0,
                    a.stochastic, a.seed, nullptr};
  in_ranges(a.n, unit_of(a.out_codec, a.out_block), a.seed,
            [&](int64_t i0, int64_t i1) { cpu::kernels().decode_sum_encode(s, e, i0, i1); });
  if (a.codec == kCodecTopK)
    for (int64_t r = 0; r < a.rows; ++r)
      if (!topk_row_valid(payloads.p() + r * L.total, a.n, a.k)) return 0;
  // Reference: the unfused ops (each fuzzed on its own).
  Buf sum(static_cast<size_t>(4 * a.n)), plain(static_cast<size_t>(O.total)), res2(static_cast<size_t>(4 * a.n));
  s.out = sum.f();
  cpu::kernels().decode_sum(s, 0, a.n);
  res2.v = res0.v;
  EncodeArgs e2{sum.p(), kF32, a.residual ? res2.f() : nullptr, plain.p(), a.n, a.out_codec, a.out_block, 0,
                     a.stochastic, a.seed, nullptr};
  cpu::kernels().encode(e2, 0, a.n);
  // Both start zeroed, so padding compares too (the op zeroes it; neither kernel may touch it).
  for (int64_t b = 0; b < O.total; ++b) FUZZ_CHECK(fused.v[b] == plain.v[b], b, fused.v[b]);
  if (a.residual)
    for (int64_t i = 0; i < a.n; ++i) FUZZ_CHECK(same_float(res.f()[i], res2.f()[i]), i, f2u(res.f()[i]));
  return 0;
}

// Fuzz target: decode_sum (W rows, any scale incl. NaN / inf) over arbitrary payload bytes, numel,
// block size and k. The sum must be the rows' reference values added in ascending row order.
#include "fuzz_harness.h"

using namespace fuzz;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const Args a = parse(data, size);
  if (!decodable(a)) return 0;
  const Layout L = layout(a.codec, a.n, a.block, a.k);
  Buf payloads = payload_rows(a, L.total, a.rows);
  Buf out(static_cast<size_t>(4 * a.n));
  DecodeSumArgs s{payloads.p(), L.total, a.rows, a.n, a.codec, a.block, a.k, a.scale, out.f()};
  in_ranges(a.n, cpu::kTile, a.seed, [&](int64_t i0, int64_t i1) { cpu::kernels().decode_sum(s, i0, i1); });
  for (int64_t r = 0; r < a.rows; ++r)
    if (!row_valid(payloads.p() + r * L.total, a.codec, a.n, a.block, a.k)) return 0;
  std::vector<float> acc(a.n, 0.0f), d;
  std::vector<char> present;
  for (int64_t r = 0; r < a.rows; ++r) {
    ref_decode(payloads.p() + r * L.total, a.codec, a.n, a.block, a.k, d, present);
    for (int64_t i = 0; i < a.n; ++i) {
      if (r == 0) acc[i] = d[i];
      else if (present[i]) acc[i] = acc[i] + d[i];  // topk / sparse: an absent element gets no "+ 0" (keeps -0)
    }
  }
  for (int64_t i = 0; i < a.n; ++i) {
    const float want = a.scale != 1.0f ? acc[i] * a.scale : acc[i];
    FUZZ_CHECK(same_float(out.f()[i], want), i, f2u(out.f()[i]));
  }
  return 0;
}

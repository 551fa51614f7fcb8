// Fuzz target: the exact-sum decoders that take data from other ranks: from_exact (int64 sums +
// per-block exponents, both arbitrary) and to_exact (arbitrary values on arbitrary exponents).
// Any int32 exponent must give defined values (NaN for invalid ones, csrc/core/exact.h) with no
// undefined behaviour, and the per-block kernels must equal the scalar core functions.
#include "fuzz_harness.h"

using namespace fuzz;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const Args a = parse(data, size);
  const int64_t n = a.small ? a.n : 0;
  const int64_t block = a.block >= 1 && a.block <= kMaxBlock ? a.block : 1 + a.block % kMaxBlock;
  const int32_t precision = 62 - (1 + static_cast<int32_t>(a.seed % 38));  // headroom 1..38
  if (n == 0) return 0;
  const int64_t nb = ceil_div(n, block);
  // Exponents: special, in range and arbitrary, from the payload bytes.
  Buf raw = payload_rows(a, 4 * nb + 8 * n, 1);
  std::vector<int32_t> E(nb);
  for (int64_t b = 0; b < nb; ++b) {
    int32_t v;
    memcpy(&v, raw.p() + 4 * b, 4);
    const uint32_t sel = static_cast<uint32_t>(v) >> 29;
    E[b] = sel == 0 ? kExpZero : sel == 1 ? kExpNonFinite : sel < 6 ? kMinExp + static_cast<int32_t>(static_cast<uint32_t>(v) % 277) : v;
  }
  Buf fixed(static_cast<size_t>(8 * n)), out(static_cast<size_t>(4 * n));
  memcpy(fixed.p(), raw.p() + 4 * nb, 8 * n);
  cpu::ExactArgs x{};
  x.n = n;
  x.block = block;
  x.precision = precision;
  x.exponents = E.data();
  x.fixed = reinterpret_cast<int64_t*>(fixed.p());
  x.out = out.f();
  in_ranges(n, block, a.seed, [&](int64_t i0, int64_t i1) { cpu::kernels().from_fixed(x, i0, i1); });
  for (int64_t i = 0; i < n; ++i) {
    const int32_t e = E[i / block];
    const float want = from_fixed(x.fixed[i], e, precision);
    FUZZ_CHECK(same_float(out.f()[i], want), i, e);
    if (!exp_valid(e)) FUZZ_CHECK(want != want, i, e);
  }
  // to_exact: the int64 bytes reread as floats (any bit pattern) on the same exponents.
  Buf xs(static_cast<size_t>(4 * n)), q(static_cast<size_t>(8 * n));
  memcpy(xs.p(), fixed.p(), 4 * n);
  x.x = xs.p();
  x.dtype = kF32;
  x.rows = 1;
  x.row_stride = n;
  x.fixed = reinterpret_cast<int64_t*>(q.p());
  int64_t bad = 0;
  in_ranges(n, block, a.seed >> 7, [&](int64_t i0, int64_t i1) { bad += cpu::kernels().to_fixed(x, i0, i1); });
  int64_t want_bad = 0;
  for (int64_t i = 0; i < n; ++i) {
    const int32_t e = E[i / block];
    const float v = xs.f()[i];
    FUZZ_CHECK(x.fixed[i] == to_fixed(v, e, precision), i, e);
    want_bad += (e != kExpNonFinite && (exponent_of_abs_bits(abs_bits(v)) > e || !exp_valid(e))) ? 1 : 0;
  }
  FUZZ_CHECK(bad == want_bad, bad, want_bad);
  return 0;
}

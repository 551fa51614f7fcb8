// Fuzz target: the exact-sum decoders that take data from other ranks: from_exact (int64 sums +
// per-block exponents, both arbitrary) and to_exact (arbitrary values on arbitrary exponents).
// Any int32 exponent must give defined values (NaN for invalid ones, csrc/core/exact.h) with no
// undefined behaviour, and the per-block kernels must equal the scalar core functions.
#include "fuzz_harness.h"

using namespace fuzz;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const Args a = parse(data, size);
  const int64_t n = a.small ? a.n : 0;
  if (n == 0) return 0;
  ExactInput in = exact_input(a, n);
  const int64_t block = in.block;
  const int32_t precision = in.precision;
  const std::vector<int32_t>& E = in.E;
  Buf out(static_cast<size_t>(4 * n));
  ExactArgs x = in.args(out.f());
  in_ranges(n, block, a.seed, [&](int64_t i0, int64_t i1) { cpu::kernels().from_fixed(x, i0, i1); });
  for (int64_t i = 0; i < n; ++i) {
    const int32_t e = E[i / block];
    const float want = from_fixed(x.fixed[i], e, precision);
    FUZZ_CHECK(same_float(out.f()[i], want), i, e);
    if (!exp_valid(e)) FUZZ_CHECK(want != want, i, e);
  }
  // to_exact: the int64 bytes reread as floats (any bit pattern) on the same exponents.
  Buf xs(static_cast<size_t>(4 * n)), q(static_cast<size_t>(8 * n));
  memcpy(xs.p(), in.fixed.p(), 4 * n);
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

// Exact, order-independent accumulation on int64 fixed point with a shared per-block exponent.
//
// For a block of values (all contributions to the same elements), E is chosen so that |v| < 2^E for
// every contribution (the max of the contributors' exponents: agree on it first, e.g. with a MAX
// all-reduce). Each value becomes the integer m = round_half_even(v * 2^(P - E)), P = 62 - headroom,
// so |m| <= 2^P, and up to 2^headroom contributions add without overflow. Integer addition is
// associative, so the sum is the same in any order and any grouping.
//
// Guarantee: when every contribution is a multiple of 2^(E - P) (true for any fp32 value within
// P - 23 binades of the block bound, i.e. 27 binades for the default headroom 12) the integer sum is
// the exact sum, and from_fixed returns it correctly rounded to fp32 (unless the result is
// subnormal, where it may be rounded twice). Smaller values are first rounded to that grid, each
// with error <= 2^(E - P - 1); the result is still order- and grouping-independent.
//
// Special exponents: kExpZero marks an all-zero block, kExpNonFinite a block with inf/NaN
// (it decodes to NaN). Both survive a MAX reduction in the right way.
#pragma once
#include "common.h"

namespace flatcomm {
namespace core {

constexpr int32_t kExpZero = -200;
constexpr int32_t kExpNonFinite = 1 << 20;
constexpr int32_t kDefaultHeadroom = 12;

// Smallest E with |a| < 2^E, from the bits of |a| (works for subnormals).
FC_HD int32_t exponent_of_abs_bits(uint32_t abs) {
  if (!bits_finite(abs)) return kExpNonFinite;
  if (abs == 0) return kExpZero;
  int32_t biased = static_cast<int32_t>(abs >> 23);
  if (biased > 0) return biased - 126;  // a = 1.m * 2^(biased-127) < 2^(biased-126)
  // subnormal: a = mant * 2^-149, mant < 2^23
  int32_t bits = 0;
  uint32_t mant = abs;
  while (mant) { ++bits; mant >>= 1; }
  return bits - 149;
}

FC_HD double pow2_double(int32_t e) {  // exact for -1022 <= e <= 1023
  uint64_t u = static_cast<uint64_t>(e + 1023) << 52;
  double d;
#if defined(__CUDA_ARCH__)
  d = __longlong_as_double(static_cast<long long>(u));
#else
  memcpy(&d, &u, 8);
#endif
  return d;
}

FC_HD float pow2_float(int32_t e) { return u2f(static_cast<uint32_t>(e + 127) << 23); }  // -126..127

// v * 2^(P - E) rounded half-to-even; exact in double since |v * 2^(P-E)| < 2^62 and the product is
// a power-of-two rescaling of a 24-bit mantissa. Returns 0 for zero / non-finite blocks.
FC_HD int64_t to_fixed(float v, int32_t E, int32_t precision) {
  if (E == kExpNonFinite || E == kExpZero) return 0;
  double t = static_cast<double>(v) * pow2_double(precision - E);
  // Round half to even: for 0 <= a < 2^52, (a + 2^52) - 2^52 does it in the FPU's default mode;
  // from 2^52 up every double is already an integer.
  double a = t < 0 ? -t : t;
  if (a < 4503599627370496.0) {  // 2^52
    const double magic = 4503599627370496.0;
    double r = (a + magic) - magic;
    t = t < 0 ? -r : r;
  }
  return static_cast<int64_t>(t);
}

// Correctly rounded m * 2^(E - P) in fp32 (see the subnormal caveat above).
FC_HD float from_fixed(int64_t m, int32_t E, int32_t precision) {
  if (E == kExpNonFinite) return u2f(0x7fc00000u);
  if (E == kExpZero || m == 0) return 0.0f;
  float f = static_cast<float>(m);  // int64 -> fp32 conversion rounds to nearest even
  int32_t e = E - precision;        // in [-200 - 62, 128 - 50]
  // Scale in at most three exact power-of-two steps; only a subnormal result rounds again.
  while (e > 127) { f = f * pow2_float(127); e -= 127; }
  while (e < -126) { f = f * pow2_float(-126); e += 126; }
  return f * pow2_float(e);
}

}  // namespace core
}  // namespace flatcomm

// C++ tests of the torch-free core and CPU kernels (run by ctest). Fresh random inputs every run;
// FLATCOMM_TEST_SEED pins them to reproduce a failure.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "core/codec.h"
#include "core/exact.h"
#include "core/rng.h"
#include "cpu/kernels.h"

using namespace flatcomm;
using namespace flatcomm::core;

static int g_passed = 0, g_failed = 0;
#define CHECK(cond, ...)                                          \
  do {                                                            \
    if (cond) {                                                   \
      ++g_passed;                                                 \
    } else {                                                      \
      ++g_failed;                                                 \
      std::printf("FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond); \
      std::printf(__VA_ARGS__);                                   \
      std::printf("\n");                                          \
    }                                                             \
  } while (0)

static std::mt19937_64 rng;

static std::vector<float> random_values(int64_t n, float scale) {
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

// Every fp16 bit pattern survives f16 -> f32 -> f16; f32 -> f16 rounds to nearest even.
static void test_half_conversions() {
  int bad = 0;
  for (uint32_t h = 0; h < 65536; ++h) {
    float f = f16_to_f32(static_cast<uint16_t>(h));
    uint16_t back = f32_to_f16(f);
    bool nan = (h & 0x7c00) == 0x7c00 && (h & 0x3ff);
    if (nan ? (back & 0x7c00) != 0x7c00 || !(back & 0x3ff) : back != h) ++bad;
  }
  CHECK(bad == 0, "%d fp16 patterns do not round-trip", bad);
  CHECK(f32_to_f16(65520.0f) == 0x7c00, "65520 must round to inf");
  CHECK(f32_to_f16(65519.0f) == 0x7bff, "65519 must round to 65504");
  CHECK(f32_to_f16(1.0f + 1.0f / 2048) == 0x3c00, "tie rounds to even");
  CHECK(f32_to_bf16(1.0f + 1.0f / 256) == 0x3f80, "bf16 tie rounds to even");
  CHECK(f32_to_bf16(u2f(0x7fc00001u)) >= 0x7fc0, "bf16 keeps NaN");
  CHECK(bf16_to_f32(f32_to_bf16(3.0f)) == 3.0f, "bf16 exact value");
}

static void test_block_params() {
  BlockParams zero = int_block_params(0, 127.0f);
  CHECK(zero.scale == 0.0f && zero.inv == 0.0f && zero.finite, "all-zero block");
  BlockParams huge = int_block_params(f2u(kFloatMax), 127.0f);
  CHECK(std::isfinite(127.0f * huge.scale), "qmax * scale must stay finite near FLT_MAX");
  BlockParams inf = int_block_params(kInfBits, 127.0f);
  CHECK(!inf.finite && std::isnan(inf.scale), "inf block scale is NaN");
  BlockParams tiny = int_block_params(1u, 127.0f);  // max |v| = smallest subnormal
  CHECK(tiny.finite && int_quantize(u2f(1u), tiny, 127.0f) >= 0.0f, "subnormal block");
  BlockParams sub = int_block_params(f2u(1e-40f), 127.0f);
  float q = int_quantize(1e-40f, sub, 127.0f);
  CHECK(q == 127.0f, "subnormal max maps to qmax, got %g", q);
  CHECK(std::fabs(int_dequantize(q, sub.scale) - 1e-40f) <= sub.scale, "subnormal round trip");
}

static void test_exponents_and_fixed() {
  CHECK(exponent_of_abs_bits(f2u(1.0f)) == 1, "1 < 2^1");
  CHECK(exponent_of_abs_bits(f2u(0.75f)) == 0, "0.75 < 2^0");
  CHECK(exponent_of_abs_bits(1u) == -148, "smallest subnormal 2^-149 < 2^-148");
  CHECK(exponent_of_abs_bits(0u) == kExpZero, "zero");
  CHECK(exponent_of_abs_bits(kInfBits) == kExpNonFinite, "inf");
  const int32_t P = 62 - kDefaultHeadroom;
  // Random values whose block dynamic range fits: integer sum equals the exact sum.
  for (int t = 0; t < 1000; ++t) {
    std::vector<float> v = random_values(16, 1.0f);
    uint32_t m = 0;
    for (float x : v) m = umax(m, abs_bits(x));
    int32_t E = exponent_of_abs_bits(m);
    int64_t fwd = 0, rev = 0;
    for (size_t i = 0; i < v.size(); ++i) fwd += to_fixed(v[i], E, P);
    for (size_t i = v.size(); i-- > 0;) rev += to_fixed(v[i], E, P);
    CHECK(fwd == rev, "integer sums agree");
    for (float x : v) {
      double back = static_cast<double>(to_fixed(x, E, P)) * std::ldexp(1.0, E - P);
      if (std::fabs(x) >= std::ldexp(1.0f, E - 27)) CHECK(back == x, "exact within 27 binades");
    }
  }
  CHECK(from_fixed(to_fixed(-3.5f, 2, P), 2, P) == -3.5f, "round trip");
  CHECK(std::isnan(from_fixed(0, kExpNonFinite, P)), "non-finite block decodes to NaN");
  CHECK(to_fixed(2.5f * std::ldexp(1.0f, -P), 0, P) == 2, "half to even (2.5 -> 2)");
  CHECK(to_fixed(3.5f * std::ldexp(1.0f, -P), 0, P) == 4, "half to even (3.5 -> 4)");
}

// The per-block forms the CPU loops use equal to_fixed / from_fixed on every input: random bit patterns (NaN, inf, subnormals, zeros included), every block exponent the
// kernels can see plus out-of-range ones, every precision of headroom 0..62.
static void test_fixed_in_block() {
  std::uniform_int_distribution<uint32_t> bits;
  int bad_fixed = 0, bad_from = 0, bad_scaled = 0;
  const uint32_t edge[] = {0u, 0x80000000u, 1u, 0x007fffffu, 0x00800000u, 0x7f7fffffu, kInfBits, 0xff800000u,
                           0x7fc00000u, 0xffffffffu, 0x3f800000u, 0x3fc00000u};
  for (int32_t E = -160; E <= 140; ++E) {
    if (exp_is_special(E)) continue;
    for (int32_t P = 0; P <= 62; P += (E % 7 == 0 ? 1 : 13)) {
      const int64_t off = fixed_shift_offset(E, P);
      const FixedScale sc = fixed_scale(E, P);
      for (int t = 0; t < 300; ++t) {
        uint32_t u = t < 12 ? edge[t] : bits(rng);
        if (t % 3 == 0 && t >= 12) {  // near the block bound, where the shift changes sign
          const int32_t e = std::max(1, std::min(254, E + 126 - static_cast<int32_t>(bits(rng) % 40)));
          u = (u & 0x807fffffu) | (static_cast<uint32_t>(e) << 23);
        }
        const float v = u2f(u);
        bad_fixed += to_fixed_in_block(v, off) != to_fixed(v, E, P);
        if (std::isfinite(v) && exponent_of_abs_bits(abs_bits(v)) <= E)  // within the block's bound
          bad_scaled += to_fixed_scaled(v, to_fixed_scale(E, P)) != to_fixed(v, E, P);
        const int64_t m = static_cast<int64_t>((uint64_t{bits(rng)} << 32 | bits(rng)) >> (bits(rng) % 64));
        const float a = from_fixed_in_block(t % 2 ? m : -m, sc), b = from_fixed(t % 2 ? m : -m, E, P);
        bad_from += f2u(a) != f2u(b);
      }
    }
  }
  CHECK(bad_fixed == 0, "%d to_fixed_in_block results differ from to_fixed", bad_fixed);
  CHECK(bad_scaled == 0, "%d to_fixed_scaled results differ from to_fixed", bad_scaled);
  CHECK(bad_from == 0, "%d from_fixed_in_block results differ from from_fixed", bad_from);
}

// The same bytes and residuals from every instruction set this CPU supports.
static void test_isa_agreement() {
  const char* isas[] = {"baseline", "avx2", "avx512"};
  const int64_t n = 10007, block = 256;
  std::vector<float> x = random_values(n, 3.0f);
  x[5] = 0.0f;
  x[300] = std::numeric_limits<float>::infinity();  // block 1 is non-finite
  for (int64_t i = 512; i < 768; ++i) x[i] = 0.0f;  // block 2 is all zero
  for (int32_t codec = 0; codec < kNumCodecs; ++codec) {
    if (codec == kCodecTopK) continue;  // not encoded block by block
    const int64_t kc = is_chunk_sparse(codec) ? 16 : 0;  // chunked sparse: kept per chunk of `block`
    for (int stoch = 0; stoch < 2; ++stoch) {
      if (stoch && !has_stochastic(codec)) continue;
      std::vector<uint8_t> ref_payload;
      std::vector<float> ref_res;
      const std::vector<float> res_old = random_values(n, 0.01f);
      for (const char* isa : isas) {
        if (!cpu::select_kernels(isa)) continue;
        Layout L = layout(codec, n, block, kc);
        std::vector<uint8_t> payload(L.total, 0);
        std::vector<float> res = res_old;
        EncodeArgs a{};
        a.x = x.data(); a.x_dtype = kF32; a.residual = res.data(); a.payload = payload.data();
        a.n = n; a.codec = codec; a.block = block; a.k = kc; a.stochastic = stoch; a.seed = 7;
        cpu::kernels().encode(a, 0, n);
        if (ref_payload.empty()) {
          ref_payload = payload;
          ref_res = res;
          // Error feedback identity, checked in float64, and the non-finite rule.
          std::vector<float> dec(n);
          DecodeArgs d{payload.data(), n, codec, block, kc, dec.data(), kF32};
          cpu::kernels().decode(d, 0, n);
          int bad = 0;
          for (int64_t i = 0; i < n; ++i) {
            double lhs = double(x[i]) + res_old[i], rhs = double(dec[i]) + res[i];
            bool block_finite = is_blockwise(codec) || is_chunk_sparse(codec) ? (i / block != 1) : std::isfinite(dec[i]);
            if (!block_finite) {
              if (res[i] != res_old[i] || std::isfinite(dec[i])) ++bad;
            } else if (std::fabs(lhs - rhs) >
                       1e-6 * (std::fabs(x[i]) + std::fabs(res_old[i]) + std::fabs(dec[i]) +
                               std::fabs(res[i]) + 1e-30)) {
              ++bad;
            }
          }
          CHECK(bad == 0, "codec %d: %d elements break the EF identity / non-finite rule", codec, bad);
        } else {
          CHECK(payload == ref_payload, "codec %d stoch %d: %s payload differs from baseline", codec,
                stoch, isa);
          CHECK(std::memcmp(res.data(), ref_res.data(), n * 4) == 0,
                "codec %d: %s residual differs from baseline", codec, isa);
        }
      }
    }
  }
  cpu::select_kernels("baseline");
}

// decode_sum adds rows in ascending order: compare against a plain sequential loop.
static void test_decode_sum_order() {
  const int64_t n = 777, block = 64, rows = 3;
  Layout L = layout(kCodecInt8, n, block, 0);
  std::vector<uint8_t> payloads(rows * L.total, 0);
  std::vector<std::vector<float>> dec(rows, std::vector<float>(n));
  for (int64_t r = 0; r < rows; ++r) {
    std::vector<float> x = random_values(n, float(r + 1));
    EncodeArgs a{};
    a.x = x.data(); a.x_dtype = kF32; a.payload = payloads.data() + r * L.total;
    a.n = n; a.codec = kCodecInt8; a.block = block;
    cpu::kernels().encode(a, 0, n);
    DecodeArgs d{a.payload, n, kCodecInt8, block, 0, dec[r].data(), kF32};
    cpu::kernels().decode(d, 0, n);
  }
  std::vector<float> out(n);
  DecodeSumArgs s{payloads.data(), L.total, rows, n, kCodecInt8, block, 0, 0.5f, out.data()};
  cpu::kernels().decode_sum(s, 0, n);
  int bad = 0;
  for (int64_t i = 0; i < n; ++i) {
    float acc = dec[0][i];
    for (int64_t r = 1; r < rows; ++r) acc = acc + dec[r][i];
    if (out[i] != acc * 0.5f) ++bad;
  }
  CHECK(bad == 0, "%d decode_sum elements differ from the sequential sum", bad);
}

static void test_random_counter() {
  uint64_t key = seed_key(42);
  CHECK(random_u32(key, 5) == random_u32(seed_key(42), 5), "pure function of (seed, index)");
  CHECK(random_u32(key, 5) != random_u32(key, 6), "differs across indices");
  double mean = 0;
  for (int i = 0; i < 100000; ++i) mean += random_unit(key, i);
  mean /= 100000;
  CHECK(std::fabs(mean - 0.5) < 0.005, "uniform mean %g", mean);
}

// by_codec / by_dtype reach the template of each id and nothing for other ids; the properties the
// layouts are computed from are those of the payload format (core/codec.h).
static void test_dispatch() {
  for (int32_t c = -1; c <= kNumCodecs; ++c) {
    const int got = by_codec(c, [](auto t) { return decltype(t)::value + 100; });
    CHECK(got == (valid_codec_id(c) ? c + 100 : 0), "by_codec(%d) reached %d", c, got);
  }
  for (int32_t dt = -1; dt <= kNumDTypes; ++dt) {
    const int64_t got = by_dtype(dt, [](auto t) { return static_cast<int64_t>(sizeof(typename Elem<decltype(t)::value>::T)); });
    CHECK(got == dtype_bytes(dt) && (got != 0) == valid_dtype(dt), "by_dtype(%d) gave %lld bytes", dt, (long long)got);
  }
  CHECK(cast_bytes(kCodecF32) == 4 && cast_bytes(kCodecBF16) == 2 && cast_bytes(kCodecF16) == 2, "cast widths");
  CHECK(code_bits(kCodecInt8) == 8 && code_bits(kCodecInt4) == 4 && code_bits(kCodecSign) == 1, "code widths");
  CHECK(int_qmax(kCodecInt8) == 127.0f && int_qmax(kCodecInt4) == 7.0f, "qmax");
  int blockwise = 0, cast = 0;
  for (int32_t c = 0; c < kNumCodecs; ++c) {
    blockwise += is_blockwise(c);
    cast += is_cast(c);
    CHECK(!is_cast(c) || valid_dtype(cast_dtype(c)), "cast codec %s stores no dtype", kCodecNames[c]);
  }
  CHECK(blockwise == 3 && cast == 3 && !valid_codec_id(kNumCodecs) && !valid_codec_id(-1), "codec kinds");
}

int main() {
  const char* s = std::getenv("FLATCOMM_TEST_SEED");
  uint64_t seed = s ? std::strtoull(s, nullptr, 10) : std::random_device{}();
  rng.seed(seed);
  std::printf("seed %llu, kernels available: %s\n", (unsigned long long)seed, cpu::supported_isas());
  test_half_conversions();
  test_block_params();
  test_exponents_and_fixed();
  test_fixed_in_block();
  test_isa_agreement();
  test_decode_sum_order();
  test_random_counter();
  test_dispatch();
  std::printf("%d passed, %d failed\n", g_passed, g_failed);
  return g_failed == 0 ? 0 : 1;
}

// Torch-free building blocks shared by the CPU and CUDA kernels.
//
// Everything here is `static inline` (internal linkage) on purpose: the CPU kernels are compiled
// several times with different instruction sets (baseline, AVX2, AVX-512) and linked into one
// library; internal linkage keeps an AVX-512 copy of a helper from being picked by the linker for
// the baseline kernels.
//
// Numerics contract: all float math is plain IEEE-754 binary32 with round-to-nearest-even and NO
// contraction into fused multiply-adds (build with -ffp-contract=off on the host, -fmad=false with
// nvcc). That is what makes CPU and GPU results bitwise identical.
#pragma once

#if defined(__CUDACC_RTC__)
// NVRTC (the optional cupy path, see csrc/cuda/README.md) compiles device code only and has no C
// library headers: the fixed-width types come from here. The generated source drops the
// <stdint.h> / <string.h> includes of these headers (flatcomm/cupy_backend.py), and memcpy is only
// used by host code below. Widths are the same as the host's (LP64 and LLP64 alike).
typedef signed char int8_t;
typedef unsigned char uint8_t;
typedef short int16_t;
typedef unsigned short uint16_t;
typedef int int32_t;
typedef unsigned int uint32_t;
typedef long long int64_t;
typedef unsigned long long uint64_t;
typedef unsigned long long uintptr_t;
static_assert(sizeof(void*) == 8 && sizeof(int64_t) == 8, "flatcomm: 64-bit targets only");
#else
#include <stdint.h>
#include <string.h>
#endif

#if defined(__CUDACC__)
#define FC_HD static __host__ __device__ __forceinline__
#else
#define FC_HD static inline __attribute__((always_inline))
#endif

namespace flatcomm {
namespace core {

constexpr uint32_t kAbsMask = 0x7fffffffu;
constexpr uint32_t kInfBits = 0x7f800000u;  // |x| bits >= this <=> x is inf or NaN
constexpr float kFloatMax = 3.40282347e+38f;
constexpr float kFloatMinNormal = 1.17549435e-38f;

FC_HD uint32_t f2u(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
#endif
}

FC_HD float u2f(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  memcpy(&f, &u, 4);
  return f;
#endif
}

FC_HD uint32_t abs_bits(float f) { return f2u(f) & kAbsMask; }
FC_HD bool bits_finite(uint32_t abs) { return abs < kInfBits; }
FC_HD float fabs_(float f) { return u2f(abs_bits(f)); }
// acc + v, where a NaN acc keeps its own payload (quieted) whatever v is: x86's rule for the first
// operand of an add, made explicit because a compiler may swap the operands of + (it does in some
// vector loops and not in their scalar tails), which picks v's payload when both are NaN. The
// fixed-order CPU sums add through it, so a sum's NaN is its first NaN row's on every path, tile
// position and instruction set.
FC_HD float add_in_order(float acc, float v) {
  const float s = acc + v;
  return acc != acc ? u2f(f2u(acc) | 0x00400000u) : s;
}
FC_HD uint32_t umax(uint32_t a, uint32_t b) { return a > b ? a : b; }
FC_HD float fmin_(float a, float b) { return a < b ? a : b; }
FC_HD float fmax_(float a, float b) { return a > b ? a : b; }
FC_HD int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
FC_HD int64_t round_up(int64_t a, int64_t b) { return ceil_div(a, b) * b; }

// Round to the nearest integer, ties to even, for |v| < 2^22 (callers clamp to far less).
// The magic-number form needs no SSE4.1 and gives the same bits as rintf() on every target.
FC_HD float round_half_even(float v) {
  const float magic = 12582912.0f;  // 1.5 * 2^23
  return (v + magic) - magic;
}

// Largest integer <= v for |v| < 2^22.
FC_HD float floor_small(float v) {
  float r = round_half_even(v);
  return r > v ? r - 1.0f : r;
}

// ---- bf16 / fp16 <-> fp32, round-to-nearest-even, identical on host and device ----------------

FC_HD float bf16_to_f32(uint16_t h) { return u2f(static_cast<uint32_t>(h) << 16); }

FC_HD uint16_t f32_to_bf16(float f) {
  uint32_t u = f2u(f);
  if ((u & kAbsMask) > kInfBits) return static_cast<uint16_t>((u >> 16) | 0x40);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// Stochastic rounding to bf16: add 16 random bits below the kept mantissa, then truncate.
FC_HD uint16_t f32_to_bf16_stochastic(float f, uint32_t rand16) {
  uint32_t u = f2u(f);
  if ((u & kAbsMask) >= kInfBits) return f32_to_bf16(f);
  u += rand16 & 0xffffu;
  return static_cast<uint16_t>(u >> 16);
}

// fp16 conversions after the public-domain FP16 library (M. Dukhan), written with bit operations
// and exactly-rounded float arithmetic so that every target gives the same bits.
FC_HD float f16_to_f32(uint16_t h) {
  const uint32_t w = static_cast<uint32_t>(h) << 16;
  const uint32_t sign = w & 0x80000000u;
  const uint32_t two_w = w + w;
  const uint32_t exp_offset = 0xE0u << 23;
  const float exp_scale = u2f(0x7800000u);  // 2^-112
  const float normalized = u2f((two_w >> 4) + exp_offset) * exp_scale;
  const uint32_t magic_mask = 126u << 23;
  const float magic_bias = 0.5f;
  const float denormalized = u2f((two_w >> 17) | magic_mask) - magic_bias;
  const uint32_t denormalized_cutoff = 1u << 27;
  const uint32_t result =
      sign | (two_w < denormalized_cutoff ? f2u(denormalized) : f2u(normalized));
  return u2f(result);
}

FC_HD uint16_t f32_to_f16(float f) {
  const float scale_to_inf = u2f(0x77800000u);   // 2^112
  const float scale_to_zero = u2f(0x08800000u);  // 2^-110
  float base = (fabs_(f) * scale_to_inf) * scale_to_zero;
  const uint32_t w = f2u(f);
  const uint32_t shl1_w = w + w;
  const uint32_t sign = w & 0x80000000u;
  uint32_t bias = shl1_w & 0xFF000000u;
  if (bias < 0x71000000u) bias = 0x71000000u;
  base = u2f((bias >> 1) + 0x07800000u) + base;
  const uint32_t bits = f2u(base);
  const uint32_t exp_bits = (bits >> 13) & 0x00007C00u;
  const uint32_t mantissa_bits = bits & 0x00000FFFu;
  const uint32_t nonsign = exp_bits + mantissa_bits;
  return static_cast<uint16_t>((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
}

}  // namespace core
}  // namespace flatcomm

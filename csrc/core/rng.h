// Counter-based random numbers for stochastic rounding: a pure function of (seed, element index),
// so results never depend on thread count, block scheduling or device.
#pragma once
#include "common.h"

namespace flatcomm {
namespace core {

FC_HD uint64_t splitmix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// Mix the seed once per call; then each element costs one splitmix64 round.
FC_HD uint64_t seed_key(uint64_t seed) { return splitmix64(seed + 0x9E3779B97F4A7C15ull); }

FC_HD uint32_t random_u32(uint64_t key, uint64_t index) {
  return static_cast<uint32_t>(splitmix64(key + index * 0x9E3779B97F4A7C15ull) >> 32);
}

// Uniform in [0, 1) with 24 random bits (exactly representable in binary32).
FC_HD float random_unit(uint64_t key, uint64_t index) {
  return static_cast<float>(random_u32(key, index) >> 8) * 5.9604644775390625e-08f;  // 2^-24
}

}  // namespace core
}  // namespace flatcomm

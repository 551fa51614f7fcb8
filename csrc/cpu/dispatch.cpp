// Runtime choice of the CPU kernel build: the best instruction set this CPU (and OS) supports,
// unless the environment variable FLATCOMM_SIMD names another ("baseline", "avx2", "avx512").
#include <cstdlib>
#include <cstring>
#include <string>

#include "kernels.h"

namespace flatcomm {
namespace cpu {
namespace {

bool has_avx2() {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
         __builtin_cpu_supports("f16c") && __builtin_cpu_supports("bmi2");
#else
  return false;
#endif
}

bool has_avx512() {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  return has_avx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
#else
  return false;
#endif
}

const KernelTable* table_for(const char* isa) {
  if (std::strcmp(isa, "baseline") == 0) return &kBaselineKernels;
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  if (std::strcmp(isa, "avx2") == 0 && has_avx2()) return &kAvx2Kernels;
  if (std::strcmp(isa, "avx512") == 0 && has_avx512()) return &kAvx512Kernels;
#endif
  return nullptr;
}

const KernelTable* best() {
  const char* forced = std::getenv("FLATCOMM_SIMD");
  if (forced && *forced) {
    if (const KernelTable* t = table_for(forced)) return t;
  }
  if (has_avx512()) return table_for("avx512");
  if (has_avx2()) return table_for("avx2");
  return &kBaselineKernels;
}

const KernelTable*& current() {
  static const KernelTable* t = best();
  return t;
}

}  // namespace

const KernelTable& kernels() { return *current(); }

bool select_kernels(const char* isa) {
  const KernelTable* t = table_for(isa);
  if (!t) return false;
  current() = t;
  return true;
}

const char* supported_isas() {
  static const std::string names = std::string("baseline") + (has_avx2() ? ",avx2" : "") +
                                   (has_avx512() ? ",avx512" : "");
  return names.c_str();
}

}  // namespace cpu
}  // namespace flatcomm

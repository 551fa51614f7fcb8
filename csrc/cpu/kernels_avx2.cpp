// The AVX2 build of the CPU kernels, chosen at run time when the CPU has it (see dispatch.cpp).
// The target is set by pragma, not by a compiler flag, so the rest of the library stays portable;
// every function here has internal linkage so none of this code can leak into the baseline path.
// FMA contraction stays off (-ffp-contract=off), so the results equal the baseline's bit for bit.
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c,bmi2"))), apply_to = function)
#else
#pragma GCC target("avx2,fma,f16c,bmi2")
#endif
#include "../core/codec.h"
#include "../core/exact.h"
#include "../core/rng.h"
#include "kernels.h"

#define FC_ISA_NAME "avx2"
#define FC_ISA_VARIABLE_SHIFTS 1
namespace flatcomm {
namespace cpu {
namespace isa_avx2 {
#include "kernels_impl.h"
}  // namespace isa_avx2
const KernelTable kAvx2Kernels = isa_avx2::kTable;
}  // namespace cpu
}  // namespace flatcomm
#if defined(__clang__)
#pragma clang attribute pop
#endif
#endif

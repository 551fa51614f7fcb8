// The portable build of the CPU kernels: whatever the compiler's baseline target allows (SSE2 on
// x86-64, NEON on aarch64).
#include "../core/codec.h"
#include "../core/exact.h"
#include "../core/rng.h"
#include "kernels.h"

#define FC_ISA_NAME "baseline"
namespace flatcomm {
namespace cpu {
namespace isa_baseline {
#include "kernels_impl.h"
}  // namespace isa_baseline
const KernelTable kBaselineKernels = isa_baseline::kTable;
}  // namespace cpu
}  // namespace flatcomm

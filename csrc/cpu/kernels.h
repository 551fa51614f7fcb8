// Torch-free CPU kernels: plain structs of raw pointers in, work on an element range out.
//
// The kernels are compiled once per instruction set (kernels_baseline.cpp, kernels_avx2.cpp,
// kernels_avx512.cpp) from the same source (kernels_impl.h); `kernels()` picks the best one the CPU
// supports at load time. Every variant computes the same bits: the math is in csrc/core with a fixed
// order of operations and no FMA contraction.
//
// Ranges: a kernel handles elements [i0, i1). i0 must be a multiple of the codec's block size (or of
// kTile for cast codecs and sums) so that ranges never share a block; the caller splits the work
// into such ranges across threads, which is why results never depend on the thread count.
#pragma once
#include <stdint.h>

namespace flatcomm {
namespace cpu {

constexpr int64_t kTile = 2048;  // elements per cache tile for casts, sums and exact ops

struct EncodeArgs {
  const void* x;       // n values of x_dtype
  int32_t x_dtype;     // core::DType
  float* residual;     // n fp32 values updated in place, or nullptr (no error feedback)
  uint8_t* payload;    // layout(codec, n, block, k).total bytes
  int64_t n;
  int32_t codec;
  int64_t block;       // block size (blockwise codecs)
  int64_t k;           // kept count (topk)
  bool stochastic;
  uint64_t seed;
  float* scratch;      // topk only: n floats
};

struct DecodeArgs {
  const uint8_t* payload;
  int64_t n;
  int32_t codec;
  int64_t block;
  int64_t k;
  void* out;           // n values of out_dtype
  int32_t out_dtype;
};

// Decode `rows` payloads (row r at payloads + r * row_stride) and sum them in ascending row order.
struct DecodeSumArgs {
  const uint8_t* payloads;
  int64_t row_stride;
  int64_t rows;
  int64_t n;
  int32_t codec;
  int64_t block;
  int64_t k;
  float scale;         // applied once to the final sum (1 = none)
  float* out;          // n fp32 values (decode_sum only)
};

struct OrderedSumArgs {
  const void* x;       // rows x n values of dtype, row r at x + r * row_stride elements
  int32_t dtype;
  int64_t rows;
  int64_t row_stride;
  int64_t n;
  float* out;
};

struct ExactArgs {
  const void* x;       // rows x n values of dtype (exponents, to_fixed, exact_sum)
  int32_t dtype;
  int64_t rows;
  int64_t row_stride;
  int64_t n;
  int64_t block;
  int32_t precision;   // P = 62 - headroom
  int32_t* exponents;  // one per block
  int64_t* fixed;      // n values (to_fixed output, from_fixed input)
  float* out;          // n values (from_fixed, exact_sum)
};

struct KernelTable {
  const char* isa;
  void (*encode)(const EncodeArgs&, int64_t i0, int64_t i1);       // not topk
  void (*encode_topk)(const EncodeArgs&);                          // whole tensor
  void (*decode)(const DecodeArgs&, int64_t i0, int64_t i1);
  void (*decode_sum)(const DecodeSumArgs&, int64_t i0, int64_t i1);
  // decode_sum, then encode the sum with `enc` (its x is ignored); i0 multiple of enc.block
  void (*decode_sum_encode)(const DecodeSumArgs&, const EncodeArgs& enc, int64_t i0, int64_t i1);
  void (*ordered_sum)(const OrderedSumArgs&, int64_t i0, int64_t i1);
  void (*exact_exponents)(const ExactArgs&, int64_t i0, int64_t i1);
  // returns the number of values that do not fit their block's exponent (0 when all is well)
  int64_t (*to_fixed)(const ExactArgs&, int64_t i0, int64_t i1);
  void (*from_fixed)(const ExactArgs&, int64_t i0, int64_t i1);
  void (*exact_sum)(const ExactArgs&, int64_t i0, int64_t i1);
};

extern const KernelTable kBaselineKernels;
extern const KernelTable kAvx2Kernels;    // x86-64 only
extern const KernelTable kAvx512Kernels;  // x86-64 only

// The table in use: the best supported by this CPU, unless FLATCOMM_SIMD names another.
const KernelTable& kernels();
// Select a table by name ("baseline", "avx2", "avx512"); returns false if unsupported here.
bool select_kernels(const char* isa);
// Names of the tables this CPU supports, best last, separated by commas.
const char* supported_isas();

}  // namespace cpu
}  // namespace flatcomm

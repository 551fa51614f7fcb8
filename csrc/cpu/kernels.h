// Torch-free CPU kernels: argument structs (core/kernel_args.h) in, work on an element range out.
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

#include "../core/dispatch.h"
#include "../core/kernel_args.h"

namespace flatcomm {
namespace cpu {

constexpr int64_t kTile = 2048;  // elements per cache tile for casts, sums and exact ops

// decode_rows works in units: unit u is the stretch [t * U, (t + 1) * U) of row u / per_row, with
// t = u % per_row, per_row = ceil(row_numel / U), U whole codec blocks (cast codecs: kTile values),
// cut at the row's end and at n. So a unit never spans two rows or shares a codec block.
inline int64_t decode_rows_unit(const DecodeRowsArgs& a) {
  return core::is_blockwise(a.codec) ? a.block : kTile;
}
inline int64_t decode_rows_units(const DecodeRowsArgs& a) {
  return a.rows * core::ceil_div(a.row_numel, decode_rows_unit(a));
}

struct KernelTable {
  const char* isa;
  void (*encode)(const EncodeArgs&, int64_t i0, int64_t i1);       // not topk
  void (*encode_topk)(const EncodeArgs&);                          // whole tensor
  void (*decode)(const DecodeArgs&, int64_t i0, int64_t i1);
  void (*decode_rows)(const DecodeRowsArgs&, int64_t u0, int64_t u1);  // units [u0, u1), see above
  void (*decode_sum)(const DecodeSumArgs&, int64_t i0, int64_t i1);
  // decode_sum, then encode the sum with `enc` (its x is ignored); i0 multiple of enc.block
  void (*decode_sum_encode)(const DecodeSumArgs&, const EncodeArgs& enc, int64_t i0, int64_t i1);
  void (*ordered_sum)(const OrderedSumArgs&, int64_t i0, int64_t i1);
  void (*exact_exponents)(const ExactArgs&, int64_t i0, int64_t i1);
  // returns the number of values that do not fit their block's exponent (0 when all is well)
  int64_t (*to_fixed)(const ExactArgs&, int64_t i0, int64_t i1);
  void (*from_fixed)(const ExactArgs&, int64_t i0, int64_t i1);
  void (*exact_sum)(const ExactArgs&, int64_t i0, int64_t i1);
  // exact_sum of rows that lie apart (row r at rows[r]; a.x and a.row_stride unused), so a lane's
  // own piece and its peers' are summed without a copy; a.out may be one of the rows
  void (*exact_sum_rows)(const ExactArgs&, const void* const* rows, int64_t i0, int64_t i1);
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

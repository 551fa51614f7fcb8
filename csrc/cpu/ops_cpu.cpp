// CPU backend of the flatcomm ops (see ops_impl.h): the work is split into fixed ranges (whole
// blocks or tiles) run by ATen's thread pool. The ranges are a fixed function of the sizes and no
// two threads share a block, so the thread count never changes a bit.
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>

#include "../ops_impl.h"
#include "kernels.h"

namespace flatcomm {
namespace ops {
namespace {

constexpr int64_t kGrainElems = 1 << 15;  // small inputs stay on one thread

// Run fn(i0, i1) over [0, n) in ranges aligned to `unit` elements.
template <typename Fn>
void parallel_ranges(int64_t n, int64_t unit, const Fn& fn) {
  if (n <= 0) return;
  const int64_t units = core::ceil_div(n, unit);
  const int64_t grain = std::max<int64_t>(1, kGrainElems / unit);
  at::parallel_for(0, units, grain, [&](int64_t u0, int64_t u1) {
    fn(u0 * unit, std::min(n, u1 * unit));
  });
}

int64_t unit_of(int32_t codec, int64_t block) {
  return core::is_blockwise(codec) || core::is_chunk_sparse(codec) ? block : cpu::kTile;
}

struct CpuBackend {
  struct Guard {
    explicit Guard(const at::Tensor&) {}
  };
  static constexpr bool kHostMemory = true;
  static const cpu::KernelTable& K() { return cpu::kernels(); }
  static int64_t topk_scratch_bytes(int64_t n) { return 4 * n; }

  static void encode(const EncodeArgs& a) {
    parallel_ranges(a.n, unit_of(a.codec, a.block), [&](int64_t i0, int64_t i1) { K().encode(a, i0, i1); });
  }
  static void encode_topk(const EncodeArgs& a) { K().encode_topk(a); }
  static void decode(const DecodeArgs& a) {
    parallel_ranges(a.n, unit_of(a.codec, a.block), [&](int64_t i0, int64_t i1) { K().decode(a, i0, i1); });
  }
  // Whole units of one row each (kernels.h): any thread count gives the same bytes.
  static void decode_rows(const DecodeRowsArgs& a) {
    const int64_t grain = std::max<int64_t>(1, kGrainElems / cpu::decode_rows_unit(a));
    at::parallel_for(0, cpu::decode_rows_units(a), grain,
                     [&](int64_t u0, int64_t u1) { K().decode_rows(a, u0, u1); });
  }
  // Tiles of the output, each fed by all rows: a rank-order sum per element, any thread count.
  static void decode_sum(const DecodeSumArgs& a) {
    parallel_ranges(a.n, cpu::kTile, [&](int64_t i0, int64_t i1) { K().decode_sum(a, i0, i1); });
  }
  static void decode_sum_encode(const DecodeSumArgs& a, const EncodeArgs& e) {
    parallel_ranges(a.n, unit_of(e.codec, e.block),
                    [&](int64_t i0, int64_t i1) { K().decode_sum_encode(a, e, i0, i1); });
  }
  static void ordered_sum(const OrderedSumArgs& a) {
    parallel_ranges(a.n, cpu::kTile, [&](int64_t i0, int64_t i1) { K().ordered_sum(a, i0, i1); });
  }
  static void exact_exponents(const ExactArgs& a) {
    parallel_ranges(a.n, a.block, [&](int64_t i0, int64_t i1) { K().exact_exponents(a, i0, i1); });
  }
  static void to_fixed(const ExactArgs& a, const at::Tensor&) {
    std::atomic<int64_t> bad{0};
    parallel_ranges(a.n, a.block, [&](int64_t i0, int64_t i1) { bad += K().to_fixed(a, i0, i1); });
    TORCH_CHECK(bad.load() == 0, "flatcomm: to_exact: ", bad.load(),
                " values exceed their block's exponent (|v| must be < 2^exponent; take the "
                "exponents from exact_exponents, reduced with MAX over all contributors)");
  }
  static void from_fixed(const ExactArgs& a) {
    parallel_ranges(a.n, a.block, [&](int64_t i0, int64_t i1) { K().from_fixed(a, i0, i1); });
  }
  static void exact_sum(const ExactArgs& a) {
    parallel_ranges(a.n, a.block, [&](int64_t i0, int64_t i1) { K().exact_sum(a, i0, i1); });
  }
};

}  // namespace
}  // namespace ops
}  // namespace flatcomm

FLATCOMM_REGISTER_OPS(CPU, flatcomm::ops::CpuBackend)

// The native lossless fp32 all-reduce of a CPU group (p2p_all_reduce.cpp), for the lane that runs
// it off Python's threads (lane.cpp), and its fixed-order sum, for the small one (slot_all_reduce.cpp).
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <vector>

namespace flatcomm {
namespace ops {

// rows[0] + rows[1] + ... in ascending order, then times scale, into out (which may be one of the
// rows): decode_sum's fp32 arithmetic (cpu/kernels_impl.h decode_sum_tile), one tile at a time so
// that every value is read before it is overwritten.
void ordered_sum(const std::vector<const float*>& rows, float scale, int64_t n, float* out);

// Exact mode's sum of `rows` (n values of into's dtype each, any of them may be `into` itself): the
// exact_sum kernel over them in rank order (block `block`, headroom `headroom`), times scale where it
// is not 1, into `into`: the bits of what flatcomm/comm/exact.py and small.py do (the op on the
// stacked rows, torch's mul, copy_). fp32 rows are read where they lie; bf16 / fp16 ones are stacked.
void exact_sum_into(const std::vector<const void*>& rows, int64_t n, double scale, int64_t block, int64_t headroom,
                    at::Tensor& into);

// The op's arguments checked, its transfers posted on the group's CPU backend `backend`. The sum
// of each piece: ordered_sum, or exact_sum_into where exact_block > 0 (exact mode).
void p2p_sum_all_reduce_(const at::Tensor& flat, const at::Tensor& scratch,
                         const c10::intrusive_ptr<c10d::Backend>& backend, at::IntArrayRef pieces, int64_t chunks,
                         double scale, int64_t tag_base, int64_t exact_block = 0, int64_t headroom = 0);

}  // namespace ops
}  // namespace flatcomm

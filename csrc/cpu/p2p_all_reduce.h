// The native lossless fp32 all-reduce of a CPU group (p2p_all_reduce.cpp), for the lane that runs
// it off Python's threads (lane.cpp).
#pragma once

#include <ATen/ATen.h>

namespace flatcomm {
namespace ops {

void p2p_sum_all_reduce_(const at::Tensor& flat, const at::Tensor& scratch, c10::string_view group,
                         at::IntArrayRef pieces, int64_t chunks, double scale, int64_t tag_base);

}  // namespace ops
}  // namespace flatcomm

// CUDA backend of the flatcomm ops (see ops_impl.h): each op is one or a few kernel launches on
// the current stream, under a device guard, with no host synchronisation. Built only when torch has
// CUDA (setup.py); the kernels themselves (kernels.cu) are torch-free and compile with plain nvcc.
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>

#include "../ops_impl.h"
#include "kernels.cuh"

namespace flatcomm {
namespace ops {
namespace {

void check_launch(int err, const char* op) {
  TORCH_CHECK(err == 0, "flatcomm: CUDA ", op, " failed: ",
              cudaGetErrorString(static_cast<cudaError_t>(err)));
}

cudaStream_t stream() { return c10::cuda::getCurrentCUDAStream(); }

struct CudaBackend {
  struct Guard {
    c10::cuda::CUDAGuard guard;
    explicit Guard(const at::Tensor& t) : guard(t.device()) {}
  };
  static constexpr bool kHostMemory = false;
  static int64_t topk_scratch_bytes(int64_t n) { return gpu::topk_scratch_bytes(n); }
  static void encode(const EncodeArgs& a) { check_launch(gpu::launch_encode(a, stream()), "encode"); }
  static void encode_topk(const EncodeArgs& a) {
    check_launch(gpu::launch_encode_topk(a, stream()), "encode (topk)");
  }
  static void decode(const DecodeArgs& a) { check_launch(gpu::launch_decode(a, stream()), "decode"); }
  static void decode_rows(const DecodeRowsArgs& a) {
    check_launch(gpu::launch_decode_rows(a, stream()), "decode_rows");
  }
  static void decode_sum(const DecodeSumArgs& a) {
    check_launch(gpu::launch_decode_sum(a, stream()), "decode_sum");
  }
  static void decode_sum_encode(const DecodeSumArgs& a, const EncodeArgs& e) {
    check_launch(gpu::launch_decode_sum_encode(a, e, stream()), "decode_sum_encode");
  }
  static void ordered_sum(const OrderedSumArgs& a) {
    check_launch(gpu::launch_ordered_sum(a, stream()), "ordered_sum");
  }
  static void exact_exponents(const ExactArgs& a) {
    check_launch(gpu::launch_exact_exponents(a, stream()), "exact_exponents");
  }
  // The overflow count stays on the device: an asynchronous assert reports it without a sync.
  static void to_fixed(const ExactArgs& a, const at::Tensor& like) {
    at::Tensor bad = at::empty({1}, like.options().dtype(at::kLong));
    check_launch(gpu::launch_to_fixed(a, bad.data_ptr<int64_t>(), stream()), "to_exact");
    at::_assert_async(bad.eq(0).squeeze(),
                      "flatcomm: to_exact: values exceed their block's exponent (take the "
                      "exponents from exact_exponents, reduced with MAX over all contributors)");
  }
  static void from_fixed(const ExactArgs& a) {
    check_launch(gpu::launch_from_fixed(a, stream()), "from_exact");
  }
  static void exact_sum(const ExactArgs& a) {
    check_launch(gpu::launch_exact_sum(a, stream()), "exact_sum");
  }
};

}  // namespace
}  // namespace ops
}  // namespace flatcomm

FLATCOMM_REGISTER_OPS(CUDA, flatcomm::ops::CudaBackend)

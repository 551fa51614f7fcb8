// Every op schema of flatcomm, in one place, plus the small non-tensor helpers exposed through
// pybind11 (build information, payload sizes, kernel selection for tests).
#include <torch/extension.h>
#include <torch/library.h>
#include <ATen/Parallel.h>

#include "cpu/kernels.h"
#include "ops_common.h"

TORCH_LIBRARY(flatcomm, m) {
  m.def("encode(Tensor x, str codec, int block_size, int k, Tensor(a!)? residual, bool stochastic, "
        "int seed) -> Tensor");
  m.def("decode(Tensor payload, str codec, int numel, int block_size, int k, ScalarType dtype) "
        "-> Tensor");
  m.def("decode_sum(Tensor payloads, str codec, int numel, int block_size, int k, float scale) "
        "-> Tensor");
  m.def("decode_sum_encode(Tensor payloads, str codec, int numel, int block_size, int k, "
        "float scale, str out_codec, int out_block_size, Tensor(a!)? residual, bool stochastic, "
        "int seed) -> Tensor");
  // Out variants: write into caller-owned buffers (e.g. slots of a collective's send buffer), so
  // the hot path allocates nothing. The functional ops above are these plus an allocation.
  m.def("encode_into(Tensor x, str codec, int block_size, int k, Tensor(a!)? residual, "
        "bool stochastic, int seed, Tensor(b!) payload) -> ()");
  m.def("decode_into(Tensor payload, str codec, int numel, int block_size, int k, Tensor(a!) out) "
        "-> ()");
  m.def("decode_sum_into(Tensor payloads, str codec, int numel, int block_size, int k, float scale, "
        "Tensor(a!) out) -> ()");
  m.def("decode_sum_encode_into(Tensor payloads, str codec, int numel, int block_size, int k, "
        "float scale, str out_codec, int out_block_size, Tensor(a!)? residual, bool stochastic, "
        "int seed, Tensor(b!) payload) -> ()");
  m.def("ordered_sum(Tensor x) -> Tensor");
  m.def("exact_exponents(Tensor x, int block_size) -> Tensor");
  m.def("to_exact(Tensor x, Tensor exponents, int block_size, int headroom) -> Tensor");
  m.def("from_exact(Tensor acc, Tensor exponents, int block_size, int headroom) -> Tensor");
  m.def("exact_sum(Tensor x, int block_size, int headroom) -> Tensor");
}

namespace {

pybind11::dict build_info() {
  pybind11::dict d;
  pybind11::list devices;
  devices.append("cpu");
#ifdef FLATCOMM_WITH_CUDA
  devices.append("cuda");
  d["cuda_arch_list"] = FLATCOMM_CUDA_ARCHS;
#endif
  d["devices"] = devices;
  d["simd"] = flatcomm::cpu::kernels().isa;
  d["simd_supported"] = flatcomm::cpu::supported_isas();
  d["threads"] = at::get_num_threads();
#ifdef _OPENMP
  d["openmp"] = true;
#else
  d["openmp"] = false;
#endif
#if defined(__clang__)
  d["compiler"] = std::string("clang ") + __clang_version__;
#elif defined(__GNUC__)
  d["compiler"] = std::string("gcc ") + __VERSION__;
#endif
  d["fp_contract"] = "off";
  return d;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "flatcomm native kernels (ops live in torch.ops.flatcomm)";
  m.def("build_info", &build_info, "What this build of flatcomm was compiled with and uses.");
  m.def(
      "wire_bytes",
      [](const std::string& codec, int64_t n, int64_t block, int64_t k) {
        return flatcomm::ops::wire_bytes(flatcomm::ops::parse_codec(codec), n, block, k);
      },
      "Payload bytes for numel values.");
  m.def(
      "set_simd", [](const std::string& isa) { return flatcomm::cpu::select_kernels(isa.c_str()); },
      "Select the CPU kernel build ('baseline', 'avx2', 'avx512'); False if unsupported here.");
  m.def("max_block_size", [] { return flatcomm::core::kMaxBlock; });
  m.def("default_headroom", [] { return flatcomm::core::kDefaultHeadroom; });
}

// CPU implementations of the flatcomm ops: argument checks, output allocation, and a split of the
// work into fixed ranges (whole blocks or tiles) run by ATen's thread pool. The ranges are a fixed
// function of the sizes, and no two threads share a block, so the thread count never changes a bit.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <atomic>
#include <cstring>

#include "../ops_common.h"
#include "kernels.h"

namespace flatcomm {
namespace ops {
namespace {

using cpu::kernels;
using cpu::kTile;

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

int64_t unit_of(int32_t codec, int64_t block) { return core::is_blockwise(codec) ? block : kTile; }

// Padding bytes go on the wire too: make them zero, without a pass over the whole payload.
void zero_padding(at::Tensor& payload, int32_t codec, int64_t n, int64_t block, int64_t k) {
  const core::Layout L = core::layout(codec, n, block, k);
  uint8_t* p = payload.data_ptr<uint8_t>();
  int64_t head_end = 0, data_end = 0;
  if (core::is_cast(codec)) {
    data_end = n * core::cast_bytes(codec);
  } else if (codec == core::kCodecTopK) {
    head_end = 4 * k;
    data_end = L.codes_offset + 4 * k;
  } else {
    head_end = 4 * L.nblocks;
    data_end = L.codes_offset + core::ceil_div(n * core::code_bits(codec), 8);
  }
  if (L.codes_offset > head_end) std::memset(p + head_end, 0, L.codes_offset - head_end);
  if (L.total > data_end) std::memset(p + data_end, 0, L.total - data_end);
}

cpu::EncodeArgs encode_args(const at::Tensor& x, int32_t codec, int64_t block, int64_t k,
                            const c10::optional<at::Tensor>& residual, bool stochastic, int64_t seed,
                            at::Tensor& payload) {
  cpu::EncodeArgs a{};
  a.x = x.data_ptr();
  a.x_dtype = dtype_code(x.scalar_type(), "x");
  a.residual = residual ? residual->data_ptr<float>() : nullptr;
  a.payload = payload.data_ptr<uint8_t>();
  a.n = x.numel();
  a.codec = codec;
  a.block = block;
  a.k = k;
  a.stochastic = stochastic;
  a.seed = static_cast<uint64_t>(seed);
  return a;
}

void encode_into_cpu(const at::Tensor& x, c10::string_view codec_name, int64_t block, int64_t k,
                     const c10::optional<at::Tensor>& residual, bool stochastic, int64_t seed,
                     at::Tensor& payload) {
  const std::string name(codec_name);
  const int32_t codec = parse_codec(name);
  dtype_code(x.scalar_type(), "x");
  check_contiguous(x, "x");
  check_residual(x, residual);
  check_stochastic(codec, stochastic);
  const int64_t n = x.numel();
  check_same_device(x, payload, "payload");
  check_payload(payload, 1, wire_bytes(codec, n, block, k), name, n);
  if (n == 0) return;
  zero_padding(payload, codec, n, block, k);
  cpu::EncodeArgs a = encode_args(x, codec, block, k, residual, stochastic, seed, payload);
  if (codec == core::kCodecTopK) {
    at::Tensor scratch = at::empty({n}, x.options().dtype(at::kFloat));
    a.scratch = scratch.data_ptr<float>();
    kernels().encode_topk(a);
    return;
  }
  const auto& K = kernels();
  parallel_ranges(n, unit_of(codec, block), [&](int64_t i0, int64_t i1) { K.encode(a, i0, i1); });
}

at::Tensor encode_cpu(const at::Tensor& x, c10::string_view codec_name, int64_t block, int64_t k,
                      const c10::optional<at::Tensor>& residual, bool stochastic, int64_t seed) {
  const int32_t codec = parse_codec(std::string(codec_name));
  at::Tensor payload =
      at::empty({wire_bytes(codec, x.numel(), block, k)}, x.options().dtype(at::kByte));
  encode_into_cpu(x, codec_name, block, k, residual, stochastic, seed, payload);
  return payload;
}

void decode_into_cpu(const at::Tensor& payload, c10::string_view codec_name, int64_t n,
                     int64_t block, int64_t k, at::Tensor& out) {
  const std::string name(codec_name);
  const int32_t codec = parse_codec(name);
  const int32_t out_dt = dtype_code(out.scalar_type(), "out");
  check_payload(payload, 1, wire_bytes(codec, n, block, k), name, n);
  check_out(payload, out, n, "out");
  cpu::DecodeArgs a{payload.data_ptr<uint8_t>(), n, codec, block, k, out.data_ptr(), out_dt};
  const auto& K = kernels();
  parallel_ranges(n, unit_of(codec, block), [&](int64_t i0, int64_t i1) { K.decode(a, i0, i1); });
}

at::Tensor decode_cpu(const at::Tensor& payload, c10::string_view codec_name, int64_t n,
                      int64_t block, int64_t k, at::ScalarType dtype) {
  dtype_code(dtype, "dtype");
  TORCH_CHECK(n >= 0, "flatcomm: numel must be >= 0, got ", n);
  at::Tensor out = at::empty({n}, payload.options().dtype(dtype));
  decode_into_cpu(payload, codec_name, n, block, k, out);
  return out;
}

cpu::DecodeSumArgs decode_sum_args(const at::Tensor& payloads, int32_t codec, int64_t n,
                                   int64_t block, int64_t k, double scale, const std::string& name) {
  check_payload(payloads, 2, wire_bytes(codec, n, block, k), name, n);
  cpu::DecodeSumArgs a{};
  a.payloads = payloads.data_ptr<uint8_t>();
  a.row_stride = payloads.size(1);
  a.rows = payloads.size(0);
  a.n = n;
  a.codec = codec;
  a.block = block;
  a.k = k;
  a.scale = static_cast<float>(scale);
  return a;
}

void decode_sum_into_cpu(const at::Tensor& payloads, c10::string_view codec_name, int64_t n,
                         int64_t block, int64_t k, double scale, at::Tensor& out) {
  const std::string name(codec_name);
  const int32_t codec = parse_codec(name);
  cpu::DecodeSumArgs a = decode_sum_args(payloads, codec, n, block, k, scale, name);
  TORCH_CHECK(out.scalar_type() == at::kFloat, "flatcomm: out must be float32, got ",
              out.scalar_type());
  check_out(payloads, out, n, "out");
  a.out = out.data_ptr<float>();
  const auto& K = kernels();
  // Tiles of the output, each fed by all rows: a rank-order sum per element, any thread count.
  parallel_ranges(n, kTile, [&](int64_t i0, int64_t i1) { K.decode_sum(a, i0, i1); });
}

at::Tensor decode_sum_cpu(const at::Tensor& payloads, c10::string_view codec_name, int64_t n,
                          int64_t block, int64_t k, double scale) {
  TORCH_CHECK(n >= 0, "flatcomm: numel must be >= 0, got ", n);
  at::Tensor out = at::empty({n}, payloads.options().dtype(at::kFloat));
  decode_sum_into_cpu(payloads, codec_name, n, block, k, scale, out);
  return out;
}

void decode_sum_encode_into_cpu(const at::Tensor& payloads, c10::string_view codec_name, int64_t n,
                                int64_t block, int64_t k, double scale,
                                c10::string_view out_codec_name, int64_t out_block,
                                const c10::optional<at::Tensor>& residual, bool stochastic,
                                int64_t seed, at::Tensor& payload) {
  const std::string name(codec_name), out_name(out_codec_name);
  const int32_t codec = parse_codec(name), out_codec = parse_reencode_codec(out_name);
  check_stochastic(out_codec, stochastic);
  cpu::DecodeSumArgs a = decode_sum_args(payloads, codec, n, block, k, scale, name);
  if (residual) {
    check_same_device(payloads, *residual, "residual");
    TORCH_CHECK(residual->scalar_type() == at::kFloat, "flatcomm: residual must be float32, got ",
                residual->scalar_type());
    check_out(payloads, *residual, n, "residual");
  }
  check_same_device(payloads, payload, "payload");
  check_payload(payload, 1, wire_bytes(out_codec, n, out_block, 0), out_name, n);
  if (n == 0) return;
  zero_padding(payload, out_codec, n, out_block, 0);
  cpu::EncodeArgs e{};
  e.x_dtype = core::kF32;
  e.residual = residual ? residual->data_ptr<float>() : nullptr;
  e.payload = payload.data_ptr<uint8_t>();
  e.n = n;
  e.codec = out_codec;
  e.block = out_block;
  e.stochastic = stochastic;
  e.seed = static_cast<uint64_t>(seed);
  const auto& K = kernels();
  parallel_ranges(n, unit_of(out_codec, out_block),
                  [&](int64_t i0, int64_t i1) { K.decode_sum_encode(a, e, i0, i1); });
}

at::Tensor decode_sum_encode_cpu(const at::Tensor& payloads, c10::string_view codec_name, int64_t n,
                                 int64_t block, int64_t k, double scale,
                                 c10::string_view out_codec_name, int64_t out_block,
                                 const c10::optional<at::Tensor>& residual, bool stochastic,
                                 int64_t seed) {
  const int32_t out_codec = parse_reencode_codec(std::string(out_codec_name));
  at::Tensor payload =
      at::empty({wire_bytes(out_codec, n, out_block, 0)}, payloads.options().dtype(at::kByte));
  decode_sum_encode_into_cpu(payloads, codec_name, n, block, k, scale, out_codec_name, out_block,
                             residual, stochastic, seed, payload);
  return payload;
}

at::Tensor ordered_sum_cpu(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2, "flatcomm: ordered_sum expects a 2-D [rows, n] tensor, got shape ",
              x.sizes());
  check_contiguous(x, "x");
  cpu::OrderedSumArgs a{};
  a.x = x.data_ptr();
  a.dtype = dtype_code(x.scalar_type(), "x");
  a.rows = x.size(0);
  a.row_stride = x.size(1);
  a.n = x.size(1);
  at::Tensor out = at::empty({a.n}, x.options().dtype(at::kFloat));
  a.out = out.data_ptr<float>();
  const auto& K = kernels();
  parallel_ranges(a.n, kTile, [&](int64_t i0, int64_t i1) { K.ordered_sum(a, i0, i1); });
  return out;
}

cpu::ExactArgs exact_args(const at::Tensor& x, int64_t block) {
  check_exact_block(block);
  check_contiguous(x, "x");
  cpu::ExactArgs a{};
  rows_of(x, a.rows, a.n);
  a.x = x.data_ptr();
  a.dtype = dtype_code(x.scalar_type(), "x");
  a.row_stride = a.n;
  a.block = block;
  return a;
}

at::Tensor exact_exponents_cpu(const at::Tensor& x, int64_t block) {
  cpu::ExactArgs a = exact_args(x, block);
  at::Tensor e = at::empty({core::ceil_div(a.n, block)}, x.options().dtype(at::kInt));
  a.exponents = e.data_ptr<int32_t>();
  const auto& K = kernels();
  parallel_ranges(a.n, block, [&](int64_t i0, int64_t i1) { K.exact_exponents(a, i0, i1); });
  return e;
}

at::Tensor to_exact_cpu(const at::Tensor& x, const at::Tensor& exponents, int64_t block,
                        int64_t headroom) {
  TORCH_CHECK(x.dim() == 1, "flatcomm: to_exact expects a 1-D tensor, got shape ", x.sizes());
  cpu::ExactArgs a = exact_args(x, block);
  a.precision = precision_of(headroom);
  check_exponents(x, exponents, a.n, block);
  a.exponents = const_cast<int32_t*>(exponents.data_ptr<int32_t>());
  at::Tensor out = at::empty({a.n}, x.options().dtype(at::kLong));
  a.fixed = out.data_ptr<int64_t>();
  const auto& K = kernels();
  std::atomic<int64_t> bad{0};
  parallel_ranges(a.n, block, [&](int64_t i0, int64_t i1) { bad += K.to_fixed(a, i0, i1); });
  TORCH_CHECK(bad.load() == 0, "flatcomm: to_exact: ", bad.load(),
              " values exceed their block's exponent (|v| must be < 2^exponent; take the exponents "
              "from exact_exponents, reduced with MAX over all contributors)");
  return out;
}

at::Tensor from_exact_cpu(const at::Tensor& acc, const at::Tensor& exponents, int64_t block,
                          int64_t headroom) {
  check_exact_block(block);
  TORCH_CHECK(acc.scalar_type() == at::kLong && acc.dim() == 1,
              "flatcomm: from_exact expects a 1-D int64 tensor, got ", acc.scalar_type(), " of shape ",
              acc.sizes());
  check_contiguous(acc, "acc");
  const int64_t n = acc.numel();
  check_exponents(acc, exponents, n, block);
  cpu::ExactArgs a{};
  a.n = n;
  a.block = block;
  a.precision = precision_of(headroom);
  a.exponents = const_cast<int32_t*>(exponents.data_ptr<int32_t>());
  a.fixed = const_cast<int64_t*>(acc.data_ptr<int64_t>());
  at::Tensor out = at::empty({n}, acc.options().dtype(at::kFloat));
  a.out = out.data_ptr<float>();
  const auto& K = kernels();
  parallel_ranges(n, block, [&](int64_t i0, int64_t i1) { K.from_fixed(a, i0, i1); });
  return out;
}

at::Tensor exact_sum_cpu(const at::Tensor& x, int64_t block, int64_t headroom) {
  TORCH_CHECK(x.dim() == 2, "flatcomm: exact_sum expects a 2-D [rows, n] tensor, got shape ",
              x.sizes());
  cpu::ExactArgs a = exact_args(x, block);
  a.precision = precision_of(headroom);
  TORCH_CHECK(a.rows <= (int64_t(1) << headroom), "flatcomm: exact_sum of ", a.rows,
              " rows needs headroom >= log2(rows); got headroom ", headroom);
  at::Tensor out = at::empty({a.n}, x.options().dtype(at::kFloat));
  a.out = out.data_ptr<float>();
  const auto& K = kernels();
  parallel_ranges(a.n, block, [&](int64_t i0, int64_t i1) { K.exact_sum(a, i0, i1); });
  return out;
}

}  // namespace
}  // namespace ops
}  // namespace flatcomm

TORCH_LIBRARY_IMPL(flatcomm, CPU, m) {
  using namespace flatcomm::ops;
  m.impl("encode", &encode_cpu);
  m.impl("encode_into", &encode_into_cpu);
  m.impl("decode_into", &decode_into_cpu);
  m.impl("decode_sum_into", &decode_sum_into_cpu);
  m.impl("decode_sum_encode_into", &decode_sum_encode_into_cpu);
  m.impl("decode", &decode_cpu);
  m.impl("decode_sum", &decode_sum_cpu);
  m.impl("decode_sum_encode", &decode_sum_encode_cpu);
  m.impl("ordered_sum", &ordered_sum_cpu);
  m.impl("exact_exponents", &exact_exponents_cpu);
  m.impl("to_exact", &to_exact_cpu);
  m.impl("from_exact", &from_exact_cpu);
  m.impl("exact_sum", &exact_sum_cpu);
}

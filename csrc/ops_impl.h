// The flatcomm ops, written once for every device: argument checks, output allocation and the
// argument structs. A backend B (CPU: ops_cpu.cpp, CUDA: ops_cuda.cpp) supplies the kernel calls:
//   struct B {
//     struct Guard { explicit Guard(const at::Tensor&); };   // device guard (no-op on CPU)
//     static constexpr bool kHostMemory;  // tensors are host memory: payloads can be validated
//     static int64_t topk_scratch_bytes(int64_t n);
//     static void encode(const EncodeArgs&), encode_topk(const EncodeArgs&),
//         decode(const DecodeArgs&), decode_rows(const DecodeRowsArgs&), decode_sum(const DecodeSumArgs&),
//         decode_sum_encode(const DecodeSumArgs&, const EncodeArgs&),
//         ordered_sum(const OrderedSumArgs&), exact_exponents(const ExactArgs&),
//         to_fixed(const ExactArgs&, const at::Tensor& like),  // raises on overflow
//         from_fixed(const ExactArgs&), exact_sum(const ExactArgs&);
//   };
// FLATCOMM_REGISTER_OPS(DispatchKey, B) registers every op for that dispatch key.
#pragma once
#include <torch/library.h>

#include <string>

#include "core/kernel_args.h"
#include "ops_common.h"

namespace flatcomm {
namespace ops {

template <class B>
struct OpsImpl {
  // Padding bytes go on the wire too: make them zero, without a pass over the whole payload.
  static void zero_padding(at::Tensor& payload, int32_t codec, int64_t n, int64_t block, int64_t k) {
    const core::Layout L = core::layout(codec, n, block, k);
    const core::DataEnds d = core::data_ends(codec, n, k, L);
    if (L.codes_offset > d.head_end) payload.narrow(0, d.head_end, L.codes_offset - d.head_end).zero_();
    if (L.total > d.data_end) payload.narrow(0, d.data_end, L.total - d.data_end).zero_();
  }

  static EncodeArgs encode_args(const at::Tensor& x, int32_t codec, int64_t block, int64_t k,
                              const c10::optional<at::Tensor>& residual, bool stochastic, int64_t seed,
                              at::Tensor& payload) {
    EncodeArgs a{};
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

  static void encode_into(const at::Tensor& x, c10::string_view codec_name, int64_t block, int64_t k,
                       const c10::optional<at::Tensor>& residual, bool stochastic, int64_t seed,
                       at::Tensor& payload) {
    typename B::Guard guard(x);
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
    EncodeArgs a = encode_args(x, codec, block, k, residual, stochastic, seed, payload);
    if (codec == core::kCodecTopK) {
      at::Tensor scratch = at::empty({B::topk_scratch_bytes(n)}, x.options().dtype(at::kByte));
      a.scratch = reinterpret_cast<float*>(scratch.data_ptr<uint8_t>());
      B::encode_topk(a);
    } else {
      B::encode(a);
    }
  }

  static at::Tensor encode(const at::Tensor& x, c10::string_view codec_name, int64_t block, int64_t k,
                        const c10::optional<at::Tensor>& residual, bool stochastic, int64_t seed) {
    typename B::Guard guard(x);
    const int32_t codec = parse_codec(std::string(codec_name));
    at::Tensor payload =
        at::empty({wire_bytes(codec, x.numel(), block, k)}, x.options().dtype(at::kByte));
    encode_into(x, codec_name, block, k, residual, stochastic, seed, payload);
    return payload;
  }

  static void decode_into(const at::Tensor& payload, c10::string_view codec_name, int64_t n,
                       int64_t block, int64_t k, at::Tensor& out) {
    typename B::Guard guard(payload);
    const std::string name(codec_name);
    const int32_t codec = parse_codec(name);
    const int32_t out_dt = dtype_code(out.scalar_type(), "out");
    check_payload(payload, 1, wire_bytes(codec, n, block, k), name, n);
    check_out(payload, out, n, "out");
    if (B::kHostMemory && codec == core::kCodecTopK) check_topk_indices(payload.data_ptr<uint8_t>(), 1, 0, n, k);
    if (B::kHostMemory) check_sparse_payload(payload.data_ptr<uint8_t>(), 1, 0, codec, n, block, k);
    DecodeArgs a{payload.data_ptr<uint8_t>(), n, codec, block, k, out.data_ptr(), out_dt};
    B::decode(a);
  }

  static at::Tensor decode(const at::Tensor& payload, c10::string_view codec_name, int64_t n,
                        int64_t block, int64_t k, at::ScalarType dtype) {
    typename B::Guard guard(payload);
    dtype_code(dtype, "dtype");
    check_numel(n);
    at::Tensor out = at::empty({n}, payload.options().dtype(dtype));
    decode_into(payload, codec_name, n, block, k, out);
    return out;
  }

  // Row r of payloads ([rows, row_bytes], each row a whole payload) into out[r * row_numel, ...), cut at
  // out's end: one pass, no fp32 copy, for an all-gather of shards decoded into the full tensor.
  static void decode_rows_into(const at::Tensor& payloads, c10::string_view codec_name, int64_t row_numel,
                               int64_t block, at::Tensor& out) {
    typename B::Guard guard(payloads);
    const std::string name(codec_name);
    const RowsLayout L = decode_rows_layout(name, row_numel, block);
    const int32_t out_dt = dtype_code(out.scalar_type(), "out");
    check_payload(payloads, 2, L.row_bytes, name, row_numel);
    check_same_device(payloads, out, "out");
    check_contiguous(out, "out");
    check_rows_cover(payloads.size(0), row_numel, out.numel());
    DecodeRowsArgs a{payloads.data_ptr<uint8_t>(), L.row_bytes, payloads.size(0), row_numel, L.codec, block,
                     out.data_ptr(), out_dt, out.numel()};
    B::decode_rows(a);
  }

  static DecodeSumArgs decode_sum_args(const at::Tensor& payloads, int32_t codec, int64_t n,
                                     int64_t block, int64_t k, double scale, const std::string& name) {
    check_payload(payloads, 2, wire_bytes(codec, n, block, k), name, n);
    DecodeSumArgs a{};
    a.payloads = payloads.data_ptr<uint8_t>();
    a.row_stride = payloads.size(1);
    a.rows = payloads.size(0);
    a.n = n;
    a.codec = codec;
    a.block = block;
    a.k = k;
    a.scale = static_cast<float>(scale);
    if (B::kHostMemory && codec == core::kCodecTopK) check_topk_indices(a.payloads, a.rows, a.row_stride, n, k);
    if (B::kHostMemory) check_sparse_payload(a.payloads, a.rows, a.row_stride, codec, n, block, k);
    return a;
  }

  static void decode_sum_into(const at::Tensor& payloads, c10::string_view codec_name, int64_t n,
                           int64_t block, int64_t k, double scale, at::Tensor& out) {
    typename B::Guard guard(payloads);
    const std::string name(codec_name);
    const int32_t codec = parse_codec(name);
    DecodeSumArgs a = decode_sum_args(payloads, codec, n, block, k, scale, name);
    TORCH_CHECK(out.scalar_type() == at::kFloat, "flatcomm: out must be float32, got ",
                out.scalar_type());
    check_out(payloads, out, n, "out");
    a.out = out.data_ptr<float>();
    B::decode_sum(a);
  }

  static at::Tensor decode_sum(const at::Tensor& payloads, c10::string_view codec_name, int64_t n,
                            int64_t block, int64_t k, double scale) {
    typename B::Guard guard(payloads);
    check_numel(n);
    at::Tensor out = at::empty({n}, payloads.options().dtype(at::kFloat));
    decode_sum_into(payloads, codec_name, n, block, k, scale, out);
    return out;
  }

  static void decode_sum_encode_into(const at::Tensor& payloads, c10::string_view codec_name, int64_t n,
                                  int64_t block, int64_t k, double scale,
                                  c10::string_view out_codec_name, int64_t out_block,
                                  const c10::optional<at::Tensor>& residual, bool stochastic,
                                  int64_t seed, at::Tensor& payload) {
    typename B::Guard guard(payloads);
    const std::string name(codec_name), out_name(out_codec_name);
    const int32_t codec = parse_codec(name), out_codec = parse_reencode_codec(out_name);
    TORCH_CHECK(!core::is_chunk_sparse(codec), "flatcomm: decode_sum_encode does not take ", name,
                " payloads yet; use decode_sum and encode");
    check_stochastic(out_codec, stochastic);
    DecodeSumArgs a = decode_sum_args(payloads, codec, n, block, k, scale, name);
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
    EncodeArgs e{};
    e.x_dtype = core::kF32;
    e.residual = residual ? residual->data_ptr<float>() : nullptr;
    e.payload = payload.data_ptr<uint8_t>();
    e.n = n;
    e.codec = out_codec;
    e.block = out_block;
    e.stochastic = stochastic;
    e.seed = static_cast<uint64_t>(seed);
    B::decode_sum_encode(a, e);
  }

  static at::Tensor decode_sum_encode(const at::Tensor& payloads, c10::string_view codec_name, int64_t n,
                                   int64_t block, int64_t k, double scale,
                                   c10::string_view out_codec_name, int64_t out_block,
                                   const c10::optional<at::Tensor>& residual, bool stochastic,
                                   int64_t seed) {
    typename B::Guard guard(payloads);
    const int32_t out_codec = parse_reencode_codec(std::string(out_codec_name));
    at::Tensor payload =
        at::empty({wire_bytes(out_codec, n, out_block, 0)}, payloads.options().dtype(at::kByte));
    decode_sum_encode_into(payloads, codec_name, n, block, k, scale, out_codec_name, out_block,
                               residual, stochastic, seed, payload);
    return payload;
  }

  static at::Tensor ordered_sum(const at::Tensor& x) {
    typename B::Guard guard(x);
    TORCH_CHECK(x.dim() == 2, "flatcomm: ordered_sum expects a 2-D [rows, n] tensor, got shape ",
                x.sizes());
    check_contiguous(x, "x");
    OrderedSumArgs a{};
    a.x = x.data_ptr();
    a.dtype = dtype_code(x.scalar_type(), "x");
    a.rows = x.size(0);
    a.row_stride = x.size(1);
    a.n = x.size(1);
    at::Tensor out = at::empty({a.n}, x.options().dtype(at::kFloat));
    a.out = out.data_ptr<float>();
    B::ordered_sum(a);
    return out;
  }

  static ExactArgs exact_args(const at::Tensor& x, int64_t block) {
    check_exact_block(block);
    check_contiguous(x, "x");
    ExactArgs a{};
    rows_of(x, a.rows, a.n);
    a.x = x.data_ptr();
    a.dtype = dtype_code(x.scalar_type(), "x");
    a.row_stride = a.n;
    a.block = block;
    return a;
  }

  static at::Tensor exact_exponents(const at::Tensor& x, int64_t block) {
    typename B::Guard guard(x);
    ExactArgs a = exact_args(x, block);
    at::Tensor e = at::empty({core::ceil_div(a.n, block)}, x.options().dtype(at::kInt));
    a.exponents = e.data_ptr<int32_t>();
    B::exact_exponents(a);
    return e;
  }

  static at::Tensor to_exact(const at::Tensor& x, const at::Tensor& exponents, int64_t block,
                          int64_t headroom) {
    typename B::Guard guard(x);
    TORCH_CHECK(x.dim() == 1, "flatcomm: to_exact expects a 1-D tensor, got shape ", x.sizes());
    ExactArgs a = exact_args(x, block);
    a.precision = precision_of(headroom);
    check_exponents(x, exponents, a.n, block);
    if (B::kHostMemory) check_exponent_values(exponents);
    a.exponents = const_cast<int32_t*>(exponents.data_ptr<int32_t>());
    at::Tensor out = at::empty({a.n}, x.options().dtype(at::kLong));
    a.fixed = out.data_ptr<int64_t>();
    B::to_fixed(a, x);
    return out;
  }

  static at::Tensor from_exact(const at::Tensor& acc, const at::Tensor& exponents, int64_t block,
                            int64_t headroom) {
    typename B::Guard guard(acc);
    check_exact_block(block);
    TORCH_CHECK(acc.scalar_type() == at::kLong && acc.dim() == 1,
                "flatcomm: from_exact expects a 1-D int64 tensor, got ", acc.scalar_type(), " of shape ",
                acc.sizes());
    check_contiguous(acc, "acc");
    const int64_t n = acc.numel();
    check_exponents(acc, exponents, n, block);
    if (B::kHostMemory) check_exponent_values(exponents);
    ExactArgs a{};
    a.n = n;
    a.block = block;
    a.precision = precision_of(headroom);
    a.exponents = const_cast<int32_t*>(exponents.data_ptr<int32_t>());
    a.fixed = const_cast<int64_t*>(acc.data_ptr<int64_t>());
    at::Tensor out = at::empty({n}, acc.options().dtype(at::kFloat));
    a.out = out.data_ptr<float>();
    B::from_fixed(a);
    return out;
  }

  static at::Tensor exact_sum(const at::Tensor& x, int64_t block, int64_t headroom) {
    typename B::Guard guard(x);
    TORCH_CHECK(x.dim() == 2, "flatcomm: exact_sum expects a 2-D [rows, n] tensor, got shape ",
                x.sizes());
    ExactArgs a = exact_args(x, block);
    a.precision = precision_of(headroom);
    TORCH_CHECK(a.rows <= (int64_t(1) << headroom), "flatcomm: exact_sum of ", a.rows,
                " rows needs headroom >= log2(rows); got headroom ", headroom);
    at::Tensor out = at::empty({a.n}, x.options().dtype(at::kFloat));
    a.out = out.data_ptr<float>();
    B::exact_sum(a);
    return out;
  }

};

}  // namespace ops
}  // namespace flatcomm

#define FLATCOMM_REGISTER_OPS(KEY, BACKEND)                                  \
  TORCH_LIBRARY_IMPL(flatcomm, KEY, m) {                                     \
    using Impl = ::flatcomm::ops::OpsImpl<BACKEND>;                          \
    m.impl("encode", &Impl::encode);                                         \
    m.impl("encode_into", &Impl::encode_into);                               \
    m.impl("decode", &Impl::decode);                                         \
    m.impl("decode_into", &Impl::decode_into);                               \
    m.impl("decode_rows_into", &Impl::decode_rows_into);                     \
    m.impl("decode_sum", &Impl::decode_sum);                                 \
    m.impl("decode_sum_into", &Impl::decode_sum_into);                       \
    m.impl("decode_sum_encode", &Impl::decode_sum_encode);                   \
    m.impl("decode_sum_encode_into", &Impl::decode_sum_encode_into);         \
    m.impl("ordered_sum", &Impl::ordered_sum);                               \
    m.impl("exact_exponents", &Impl::exact_exponents);                       \
    m.impl("to_exact", &Impl::to_exact);                                     \
    m.impl("from_exact", &Impl::from_exact);                                 \
    m.impl("exact_sum", &Impl::exact_sum);                                   \
  }

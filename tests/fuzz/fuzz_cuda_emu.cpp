// Fuzz target: the same inputs through the real CUDA kernels (csrc/cuda/kernels.cu + device.cuh)
// on the CPU emulator (tests/cuda_emu): decode, decode_rows, decode_sum, decode_sum with reencode,
// from_exact and to_exact. Any byte string must stay inside the buffers; where the ops accept the input the
// result must equal the CPU kernels' (any NaN equals any NaN); an invalid topk row, which only the
// CPU ops can reject, must give NaN in the tile(s) where it breaks (csrc/cuda/README.md).
#include "fuzz_harness.h"
#include "cuda/kernels.cuh"
#include "cuda_emu.h"

using namespace fuzz;

namespace {

constexpr int64_t kMaxEmuNumel = 5000;  // the emulator runs one fiber per thread: keep inputs small

bool rows_valid(const Buf& p, const Args& a, int64_t row_bytes) {
  for (int64_t r = 0; r < a.rows; ++r)
    if (!row_valid(p.v.data() + r * row_bytes, a.codec, a.n, a.block, a.k)) return false;
  return true;
}

bool any_nan(const float* v, int64_t n) {
  for (int64_t i = 0; i < n; ++i)
    if (v[i] != v[i]) return true;
  return false;
}

void decode_case(const Args& a, int64_t n) {
  const Layout L = layout(a.codec, n, a.block, a.k);
  Buf payload = payload_rows(a, L.total, 1);
  Buf gpu(static_cast<size_t>(4 * n)), cpu_out(static_cast<size_t>(4 * n));
  DecodeArgs d{payload.p(), n, a.codec, a.block, a.k, gpu.p(), kF32};
  FUZZ_CHECK(gpu::launch_decode(d, nullptr) == 0, n);
  Args one = a;
  one.rows = 1;
  if (!rows_valid(payload, one, L.total)) {
    FUZZ_CHECK(any_nan(gpu.f(), n), n, a.k);
    return;
  }
  d.out = cpu_out.p();
  cpu::kernels().decode(d, 0, n);
  for (int64_t i = 0; i < n; ++i) FUZZ_CHECK(same_float(gpu.f()[i], cpu_out.f()[i]), i, f2u(gpu.f()[i]));
}

// Rows of row numel m into an output that ends exactly at its last value (the last row cut short).
void decode_rows_case(const Args& a, int64_t m) {
  if (a.codec == kCodecTopK || is_chunk_sparse(a.codec)) return;  // decode_rows refuses both
  const int64_t rows = a.rows > 0 ? a.rows : 1;
  const int64_t n = (rows - 1) * m + 1 + static_cast<int64_t>(a.seed % static_cast<uint64_t>(m));
  const Layout L = layout(a.codec, m, a.block, 0);
  Buf payloads = payload_rows(a, L.total, rows);
  const int64_t es = dtype_bytes(a.dtype);
  Buf gpu(static_cast<size_t>(n * es)), cpu_out(static_cast<size_t>(n * es));
  DecodeRowsArgs d{payloads.p(), L.total, rows, m, a.codec, a.block, gpu.p(), a.dtype, n};
  FUZZ_CHECK(gpu::launch_decode_rows(d, nullptr) == 0, n);
  d.out = cpu_out.p();
  cpu::kernels().decode_rows(d, 0, cpu::decode_rows_units(d));
  for (int64_t i = 0; i < n; ++i) {
    if (es == 4) {
      FUZZ_CHECK(same_float(gpu.f()[i], cpu_out.f()[i]), i, f2u(gpu.f()[i]));
    } else {
      uint16_t x, y;
      memcpy(&x, gpu.p() + 2 * i, 2);
      memcpy(&y, cpu_out.p() + 2 * i, 2);
      const uint16_t inf = a.dtype == kBF16 ? 0x7f80 : 0x7c00;
      FUZZ_CHECK(x == y || ((x & 0x7fff) > inf && (y & 0x7fff) > inf), i, x);
    }
  }
}

void decode_sum_case(const Args& a, int64_t n) {
  const Layout L = layout(a.codec, n, a.block, a.k);
  Buf payloads = payload_rows(a, L.total, a.rows);
  Buf gpu(static_cast<size_t>(4 * n)), cpu_out(static_cast<size_t>(4 * n));
  DecodeSumArgs s{payloads.p(), L.total, a.rows, n, a.codec, a.block, a.k, a.scale, gpu.f()};
  FUZZ_CHECK(gpu::launch_decode_sum(s, nullptr) == 0, n);
  if (!rows_valid(payloads, a, L.total)) {
    FUZZ_CHECK(any_nan(gpu.f(), n), n, a.k);
    return;
  }
  s.out = cpu_out.f();
  cpu::kernels().decode_sum(s, 0, n);
  for (int64_t i = 0; i < n; ++i) FUZZ_CHECK(same_float(gpu.f()[i], cpu_out.f()[i]), i, f2u(gpu.f()[i]));
}

void decode_sum_encode_case(const Args& a, int64_t n) {
  if (is_chunk_sparse(a.codec)) return;  // refused as a source (not fused yet)
  const Layout L = layout(a.codec, n, a.block, a.k), O = layout(a.out_codec, n, a.out_block, 0);
  Buf payloads = payload_rows(a, L.total, a.rows);
  auto run = [&](bool on_gpu, Buf& out, Buf& res) {
    for (int64_t i = 0; i < n; ++i) res.f()[i] = static_cast<float>(i % 7) - 3.0f;
    DecodeSumArgs s{payloads.p(), L.total, a.rows, n, a.codec, a.block, a.k, a.scale, nullptr};
    EncodeArgs e{nullptr, kF32, a.residual ? res.f() : nullptr, out.p(), n, a.out_codec, a.out_block, 0,
                      a.stochastic, a.seed, nullptr};
    if (on_gpu) FUZZ_CHECK(gpu::launch_decode_sum_encode(s, e, nullptr) == 0, n);
    else cpu::kernels().decode_sum_encode(s, e, 0, n);
  };
  Buf g(static_cast<size_t>(O.total)), gr(static_cast<size_t>(4 * n));
  run(true, g, gr);
  if (!rows_valid(payloads, a, L.total)) {  // defined: the same bytes on every run
    Buf g2(static_cast<size_t>(O.total)), gr2(static_cast<size_t>(4 * n));
    run(true, g2, gr2);
    FUZZ_CHECK(g.v == g2.v && gr.v == gr2.v, n);
    return;
  }
  Buf c(static_cast<size_t>(O.total)), cr(static_cast<size_t>(4 * n));
  run(false, c, cr);
  // Cast payloads hold values (NaN bits may differ), the rest is bytes: scales are NaN-compared too.
  const int64_t values_end = is_cast(a.out_codec) ? n * cast_bytes(a.out_codec) : 4 * O.nblocks;
  const int64_t es = a.out_codec == kCodecF32 || !is_cast(a.out_codec) ? 4 : 2;
  for (int64_t b = 0; b < O.total; b += (b < values_end ? es : 1)) {
    if (b < values_end && es == 4) {
      float x, y;
      memcpy(&x, g.p() + b, 4);
      memcpy(&y, c.p() + b, 4);
      FUZZ_CHECK(same_float(x, y), b, f2u(x));
    } else if (b < values_end) {
      uint16_t x, y;
      memcpy(&x, g.p() + b, 2);
      memcpy(&y, c.p() + b, 2);
      const bool nan = a.out_codec == kCodecBF16 ? (x & 0x7fff) > 0x7f80 && (y & 0x7fff) > 0x7f80
                                                 : (x & 0x7fff) > 0x7c00 && (y & 0x7fff) > 0x7c00;
      FUZZ_CHECK(x == y || nan, b, x);
    } else {
      FUZZ_CHECK(g.v[b] == c.v[b], b, g.v[b]);
    }
  }
  if (a.residual)
    for (int64_t i = 0; i < n; ++i) FUZZ_CHECK(same_float(gr.f()[i], cr.f()[i]), i, f2u(gr.f()[i]));
}

void exact_case(const Args& a, int64_t n) {
  ExactInput in = exact_input(a, n);
  const int64_t block = in.block;
  const std::vector<int32_t>& E = in.E;
  Buf g(static_cast<size_t>(4 * n)), c(static_cast<size_t>(4 * n));
  ExactArgs x = in.args(g.f());
  FUZZ_CHECK(gpu::launch_from_fixed(x, nullptr) == 0, n);
  x.out = c.f();
  cpu::kernels().from_fixed(x, 0, n);
  for (int64_t i = 0; i < n; ++i) FUZZ_CHECK(same_float(g.f()[i], c.f()[i]), i, E[i / block]);
  // to_exact on the same exponents: the int64 bytes reread as floats.
  Buf xs(static_cast<size_t>(4 * n)), qg(static_cast<size_t>(8 * n)), qc(static_cast<size_t>(8 * n));
  memcpy(xs.p(), in.fixed.p(), 4 * n);
  x.x = xs.p();
  x.dtype = kF32;
  x.rows = 1;
  x.row_stride = n;
  x.fixed = reinterpret_cast<int64_t*>(qg.p());
  int64_t bad_gpu = -1;
  FUZZ_CHECK(gpu::launch_to_fixed(x, &bad_gpu, nullptr) == 0, n);
  x.fixed = reinterpret_cast<int64_t*>(qc.p());
  const int64_t bad_cpu = cpu::kernels().to_fixed(x, 0, n);
  FUZZ_CHECK(qg.v == qc.v && bad_gpu == bad_cpu, bad_gpu, bad_cpu);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const Args a = parse(data, size);
  const int op = static_cast<int>((a.seed >> 58) % 5);
  if (a.small && a.n > 0 && a.n <= kMaxEmuNumel && op == 3) exact_case(a, a.n);
  if (op == 3 || !decodable(a) || a.n > kMaxEmuNumel) return 0;
  if (op == 0) decode_case(a, a.n);
  else if (op == 1) decode_sum_case(a, a.n);
  else if (op == 2) decode_sum_encode_case(a, a.n);
  else decode_rows_case(a, a.n);
  return 0;
}

// Fuzz target: decode (every codec, fp32 / bf16 / fp16 output) over arbitrary payload bytes, numel,
// block size and k. See fuzz_harness.h for the input layout and tests/fuzz/README.md for running it.
#include "fuzz_harness.h"

using namespace fuzz;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const Args a = parse(data, size);
  if (!decodable(a)) return 0;
  const Layout L = layout(a.codec, a.n, a.block, a.k);
  Buf payload = payload_rows(a, L.total, 1);
  const int64_t es = a.dtype == kF32 ? 4 : 2;
  Buf out(static_cast<size_t>(a.n * es));
  DecodeArgs d{payload.p(), a.n, a.codec, a.block, a.k, out.p(), a.dtype};
  // Memory safety holds for every byte string, even one the op would reject (an invalid topk row).
  in_ranges(a.n, unit_of(a.codec, a.block), a.seed, [&](int64_t i0, int64_t i1) { cpu::kernels().decode(d, i0, i1); });
  if (!row_valid(payload.p(), a.codec, a.n, a.block, a.k)) return 0;
  std::vector<float> want;
  std::vector<char> present;
  ref_decode(payload.p(), a.codec, a.n, a.block, a.k, want, present);
  for (int64_t i = 0; i < a.n; ++i) {
    if (a.dtype == kF32) {
      float got;
      memcpy(&got, out.p() + 4 * i, 4);
      FUZZ_CHECK(same_float(got, want[i]), i, f2u(got));
    } else {  // the output conversion of the reference value, or a NaN for a NaN
      uint16_t h;
      memcpy(&h, out.p() + 2 * i, 2);
      const uint16_t w = a.dtype == kBF16 ? f32_to_bf16(want[i]) : f32_to_f16(want[i]);
      const float back = a.dtype == kBF16 ? bf16_to_f32(h) : f16_to_f32(h);
      FUZZ_CHECK(h == w || (want[i] != want[i] && back != back), i, h);
    }
  }
  return 0;
}

// Fuzz target: decode_rows (1-4 rows of arbitrary payload bytes, every codec but topk, fp32 / bf16 /
// fp16 out, the last row cut at a random length) over arbitrary row numels and block sizes. The
// output buffer ends exactly at the last value, so a write past it is an AddressSanitizer finding;
// each value must be the reference decoder's, converted to the output dtype.
#include "fuzz_harness.h"

using namespace fuzz;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  Args a = parse(data, size);
  if (a.codec == kCodecTopK || is_chunk_sparse(a.codec)) return 0;  // the op refuses both (size depends on k)
  a.k = 0;
  if (!decodable(a)) return 0;
  const int64_t m = a.n, rows = a.rows > 0 ? a.rows : 1;
  const int64_t n = (rows - 1) * m + 1 + static_cast<int64_t>(a.seed % static_cast<uint64_t>(m));
  const Layout L = layout(a.codec, m, a.block, 0);
  Buf payloads = payload_rows(a, L.total, rows);
  const int64_t es = dtype_bytes(a.dtype);
  Buf out(static_cast<size_t>(n * es));
  DecodeRowsArgs d{payloads.p(), L.total, rows, m, a.codec, a.block, out.p(), a.dtype, n};
  // Units split across "threads" as the op does, in pieces drawn from the seed.
  in_ranges(cpu::decode_rows_units(d), 1, a.seed >> 7, [&](int64_t u0, int64_t u1) { cpu::kernels().decode_rows(d, u0, u1); });
  std::vector<float> want;
  std::vector<char> present;
  for (int64_t r = 0; r < rows; ++r) {
    ref_decode(payloads.p() + r * L.total, a.codec, m, a.block, 0, want, present);
    for (int64_t j = 0; j < m && r * m + j < n; ++j) {
      const int64_t i = r * m + j;
      if (a.dtype == kF32) {
        float got;
        memcpy(&got, out.p() + 4 * i, 4);
        FUZZ_CHECK(same_float(got, want[j]), i, f2u(got));
      } else {
        uint16_t h;
        memcpy(&h, out.p() + 2 * i, 2);
        const uint16_t w = a.dtype == kBF16 ? f32_to_bf16(want[j]) : f32_to_f16(want[j]);
        const float back = a.dtype == kBF16 ? bf16_to_f32(h) : f16_to_f32(h);
        FUZZ_CHECK(h == w || (want[j] != want[j] && back != back), i, h);
      }
    }
  }
  return 0;
}

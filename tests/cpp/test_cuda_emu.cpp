// The real CUDA kernels (csrc/cuda/kernels.cu + device.cuh, through tests/cuda_emu) run on the CPU
// emulator and must match the CPU kernels bit for bit: codes, scales, residuals, sums, and the set
// of bytes each one writes (every output is poisoned twice, with 0x00 and 0xff, so a byte one side
// leaves unwritten shows up). Fresh random inputs each run (odd sizes, zero blocks, huge values,
// inf, NaN, -0, subnormals), aligned and misaligned buffers (the vector and the scalar paths);
// FLATCOMM_TEST_SEED pins them. Built with AddressSanitizer when the compiler has it, so a kernel
// that reads or writes outside its buffers fails here too.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "core/codec.h"
#include "core/exact.h"
#include "cpu/kernels.h"
#include "cuda/kernels.cuh"
#include "cuda_emu.h"

using namespace flatcomm;
using namespace flatcomm::core;

static int g_passed = 0, g_failed = 0;
static std::mt19937_64 rng;

static void fail(const std::string& what) {
  ++g_failed;
  if (g_failed <= 20) std::printf("FAIL %s\n", what.c_str());
}

// ---- buffers ---------------------------------------------------------------------------------
// `bytes` bytes at `offset` bytes past a 16-byte boundary; the allocation ends exactly at the end
// of the buffer, so AddressSanitizer catches any access past it.
struct Buf {
  std::vector<uint8_t> mem;
  size_t offset = 0, bytes = 0;
  Buf() = default;
  Buf(size_t n, size_t off = 0) : mem(n + off), offset(off), bytes(n) {}
  uint8_t* p() { return bytes ? mem.data() + offset : nullptr; }
  std::vector<uint8_t> data() const { return {mem.begin() + offset, mem.end()}; }
  void fill(uint8_t v) {
    if (bytes) std::memset(mem.data() + offset, v, bytes);
  }
  void set(const std::vector<uint8_t>& d) {
    if (bytes) std::memcpy(mem.data() + offset, d.data(), bytes);
  }
};

static int64_t esize(int32_t dt) { return dt == kF32 ? 4 : 2; }
static const char* dname(int32_t dt) { return dt == kF32 ? "f32" : dt == kBF16 ? "bf16" : "f16"; }
static const char* cname(int32_t c) { return kCodecNames[c]; }

// n random floats: normal values at a random scale, with zero blocks, huge values, inf, NaN, -0
// and subnormals sprinkled in (each kind only sometimes, so clean inputs are covered as well).
static std::vector<float> random_floats(int64_t n, bool specials) {
  static const float scales[] = {1e-3f, 1.0f, 3e4f};
  std::normal_distribution<float> normal(0.0f, scales[rng() % 3]);
  std::vector<float> v(n);
  for (auto& x : v) x = normal(rng);
  if (!specials || n == 0) return v;
  std::uniform_int_distribution<int64_t> at(0, n - 1);
  if (rng() % 2) {  // an all-zero run
    int64_t s = at(rng), len = 1 + static_cast<int64_t>(rng() % 300);
    for (int64_t i = s; i < std::min(n, s + len); ++i) v[i] = (rng() % 4) ? 0.0f : -0.0f;
  }
  const float special[] = {3.0e38f, -3.0e38f, INFINITY, -INFINITY, NAN, -0.0f, 1e-40f, -3e-39f, 65504.0f, 7e4f};
  const int count = static_cast<int>(rng() % 4);
  for (int i = 0; i < count; ++i) v[at(rng)] = special[rng() % 10];
  return v;
}

static std::vector<uint8_t> as_dtype(const std::vector<float>& f, int32_t dt) {
  std::vector<uint8_t> out(f.size() * esize(dt));
  for (size_t i = 0; i < f.size(); ++i) {
    if (dt == kF32) {
      std::memcpy(out.data() + 4 * i, &f[i], 4);
    } else {
      uint16_t h = dt == kBF16 ? f32_to_bf16(f[i]) : f32_to_f16(f[i]);
      std::memcpy(out.data() + 2 * i, &h, 2);
    }
  }
  return out;
}

static std::vector<uint8_t> bytes_of(const std::vector<float>& f) {
  std::vector<uint8_t> b(f.size() * 4);
  if (!f.empty()) std::memcpy(b.data(), f.data(), b.size());
  return b;
}

// ---- comparison ------------------------------------------------------------------------------
// An output buffer and how to compare it: bytes, or floating elements (f32 / bf16 / f16), where any
// NaN equals any NaN. That is the one documented exception to bitwise equality (csrc/cuda/README.md):
// a GPU writes the canonical NaN 0x7fffffff for every NaN that arithmetic produces, while x86 keeps
// an operand's sign and payload, so the NaN's bits differ, never its position.
enum Kind { kRaw = -1 };  // otherwise a core::DType
struct Seg {
  size_t offset, bytes;
  int kind;
};
struct Out {
  std::vector<uint8_t> b;
  std::vector<Seg> segs;
};
static Out raw(std::vector<uint8_t> b) { return Out{b, {Seg{0, b.size(), kRaw}}}; }
static Out floats(std::vector<uint8_t> b, int32_t dt = kF32) { return Out{b, {Seg{0, b.size(), dt}}}; }
// A payload: cast codecs hold values of their dtype, topk fp32 values after its indices; the rest
// (indices, codes, block scales) is compared byte for byte.
static Out payload_out(std::vector<uint8_t> b, int32_t codec, int64_t n, int64_t block, int64_t k) {
  const Layout L = layout(codec, n, block, k);
  if (is_cast(codec)) return floats(b, cast_dtype(codec));
  if (codec == kCodecTopK)
    return Out{b, {Seg{0, static_cast<size_t>(L.codes_offset), kRaw},
                   Seg{static_cast<size_t>(L.codes_offset), b.size() - static_cast<size_t>(L.codes_offset), kF32}}};
  if (is_chunk_sparse(codec))  // fp32 level tables (NaN for a non-finite chunk), then records
    return Out{b, {Seg{0, static_cast<size_t>(L.codes_offset), kF32},
                   Seg{static_cast<size_t>(L.codes_offset), b.size() - static_cast<size_t>(L.codes_offset), kRaw}}};
  return raw(b);
}
using Outputs = std::vector<Out>;

static bool is_nan(const uint8_t* p, int kind) {
  if (kind == kF32) {
    uint32_t u;
    std::memcpy(&u, p, 4);
    return (u & 0x7fffffffu) > 0x7f800000u;
  }
  uint16_t h;
  std::memcpy(&h, p, 2);
  return kind == kBF16 ? (h & 0x7fff) > 0x7f80 : (h & 0x7fff) > 0x7c00;
}

// run(gpu, poison) fills the outputs with `poison`, runs one side and returns its outputs. Both
// sides must write the same elements (a byte left as the poison in one run and not the other is
// unwritten) with the same values.
static void compare(const std::string& what, const std::function<Outputs(bool, uint8_t)>& run) {
  const Outputs c0 = run(false, 0x00), c1 = run(false, 0xff);
  const Outputs g0 = run(true, 0x00), g1 = run(true, 0xff);
  for (size_t o = 0; o < c0.size(); ++o) {
    for (const Seg& sg : c0[o].segs) {
      const size_t es = sg.kind == kRaw ? 1 : esize(sg.kind);
      for (size_t i = sg.offset; i + es <= sg.offset + sg.bytes; i += es) {
        const uint8_t *a0 = &c0[o].b[i], *a1 = &c1[o].b[i], *b0 = &g0[o].b[i], *b1 = &g1[o].b[i];
        const bool cw = !std::memcmp(a0, a1, es), gw = !std::memcmp(b0, b1, es);
        const bool same = !std::memcmp(a0, b0, es) || (sg.kind != kRaw && is_nan(a0, sg.kind) && is_nan(b0, sg.kind));
        if (cw != gw || (cw && !same)) {
          char buf[200];
          std::snprintf(buf, sizeof buf, " output %zu byte %zu: cpu %s 0x%02x, gpu %s 0x%02x", o, i,
                        cw ? "wrote" : "left", a0[es - 1], gw ? "wrote" : "left", b0[es - 1]);
          fail(what + buf);
          return;
        }
      }
    }
  }
  ++g_passed;
}

static void expect_ok(int err, const std::string& what) {
  if (err != 0) fail(what + ": launch returned cudaError " + std::to_string(err));
}

// ---- cases -----------------------------------------------------------------------------------
static const int64_t kSizes[] = {1, 2, 3, 31, 32, 33, 97, 255, 1000, 1031, 4096, 4099, 9001, 20011};
static int64_t pick_size(bool large) {
  const int64_t* b = kSizes;
  const size_t n = sizeof(kSizes) / sizeof(kSizes[0]);
  return large ? b[n - 1 - rng() % 4] : b[rng() % (n - 3)];
}
static int64_t pick_block(int32_t codec) {
  static const int64_t blocks[] = {32, 64, 96, 256, 1024, 4096};
  return is_blockwise(codec) || is_chunk_sparse(codec) ? blocks[rng() % 6] : 0;
}
// The k of a codec: topk's kept count (its own draw, below) or a chunked sparse codec's kept values
// per chunk of `block`; 0 for the rest.
static int64_t pick_sparse_k(int32_t codec, int64_t block) {
  if (!is_chunk_sparse(codec)) return 0;
  return rng() % 4 == 0 ? block : 1 + static_cast<int64_t>(rng() % (block < 96 ? block : 96));
}
static const cpu::KernelTable& K() { return cpu::kernels(); }

static std::string describe(const char* op, int32_t codec, int32_t dt, int64_t n, int64_t block, int64_t k,
                            const std::string& extra = "") {
  char buf[300];
  std::snprintf(buf, sizeof buf, "%s codec=%s dtype=%s n=%lld block=%lld k=%lld%s", op, cname(codec), dname(dt),
                (long long)n, (long long)block, (long long)k, extra.c_str());
  return buf;
}

// Payload of CPU-encoded random values (decode inputs).
static std::vector<uint8_t> cpu_payload(int32_t codec, int64_t n, int64_t block, int64_t k) {
  const std::vector<float> x = random_floats(n, true);
  const Layout L = layout(codec, n, block, k);
  std::vector<uint8_t> payload(L.total, 0);
  std::vector<float> scratch(n);
  EncodeArgs a{x.data(), kF32, nullptr, payload.data(), n, codec, block, k, false, 0, scratch.data()};
  if (codec == kCodecTopK) K().encode_topk(a); else K().encode(a, 0, n);
  return payload;
}

static void test_encode(int32_t codec, int32_t dt, int64_t n, bool with_residual, bool stochastic, bool misalign) {
  const int64_t block = pick_block(codec);
  const int64_t k = codec == kCodecTopK ? (rng() % 4 == 0 ? (rng() % 2 ? 0 : n) : static_cast<int64_t>(rng() % (n + 1)))
                                        : pick_sparse_k(codec, block);
  const Layout L = layout(codec, n, block, k);
  const size_t off = misalign ? static_cast<size_t>(esize(dt)) : 0;
  Buf x(n * esize(dt), off);
  x.set(as_dtype(random_floats(n, true), dt));
  const std::vector<uint8_t> res0 = bytes_of(random_floats(n, rng() % 4 == 0));
  const uint64_t seed = rng();
  const std::string what = describe("encode", codec, dt, n, block, k,
                                    std::string(with_residual ? " +EF" : "") + (stochastic ? " stochastic" : "") +
                                        (misalign ? " misaligned" : ""));
  compare(what, [&](bool gpu, uint8_t poison) {
    Buf payload(L.total), residual(with_residual ? 4 * n : 0, misalign ? 4 : 0);
    payload.fill(poison);
    residual.set(res0);
    EncodeArgs a{x.p(), dt, reinterpret_cast<float*>(residual.p()), payload.p(), n, codec, block, k,
                      stochastic, seed, nullptr};
    if (!gpu) {
      std::vector<float> scratch(n);
      a.scratch = scratch.data();
      if (codec == kCodecTopK) K().encode_topk(a); else K().encode(a, 0, n);
    } else {
      Buf scratch(codec == kCodecTopK ? gpu::topk_scratch_bytes(n) : 0);
      scratch.fill(static_cast<uint8_t>(rng()));  // its contents on entry must not matter
      a.scratch = reinterpret_cast<float*>(scratch.p());
      expect_ok(gpu::launch_encode(a, nullptr), what);
    }
    return Outputs{payload_out(payload.data(), codec, n, block, k), floats(residual.data())};
  });
}

static void test_decode(int32_t codec, int32_t odt, int64_t n, bool misalign) {
  const int64_t block = pick_block(codec);
  const int64_t k = codec == kCodecTopK ? static_cast<int64_t>(rng() % (n + 1)) : pick_sparse_k(codec, block);
  const std::vector<uint8_t> payload0 = cpu_payload(codec, n, block, k);
  const std::string what = describe("decode", codec, odt, n, block, k, misalign ? " misaligned" : "");
  compare(what, [&](bool gpu, uint8_t poison) {
    Buf payload(payload0.size()), out(n * esize(odt), misalign ? esize(odt) : 0);
    payload.set(payload0);
    out.fill(poison);
    DecodeArgs a{payload.p(), n, codec, block, k, out.p(), odt};
    if (gpu) expect_ok(gpu::launch_decode(a, nullptr), what); else K().decode(a, 0, n);
    return Outputs{floats(out.data(), odt)};
  });
}

// Rows of CPU payloads at a row stride that is (or is not) a multiple of 16.
static std::vector<uint8_t> payload_rows(int32_t codec, int64_t n, int64_t block, int64_t k, int64_t rows,
                                         int64_t stride) {
  std::vector<uint8_t> all(rows * stride, 0x5a);
  for (int64_t r = 0; r < rows; ++r) {
    const std::vector<uint8_t> p = cpu_payload(codec, n, block, k);
    if (!p.empty()) std::memcpy(all.data() + r * stride, p.data(), p.size());  // topk k = 0: empty
  }
  return all;
}

// Rows of payloads into one output, the last row cut short; the poisoned output extends past n, so a
// write beyond it shows (the CPU writes nothing there). Row sizes that keep every output row 16-byte
// aligned (the vector path) and odd ones.
static void test_decode_rows(int32_t codec, int32_t odt, int64_t m, int64_t rows, bool misalign) {
  const int64_t block = pick_block(codec);
  const int64_t stride = layout(codec, m, block, 0).total;
  const std::vector<uint8_t> rows0 = payload_rows(codec, m, block, 0, rows, stride);
  const int64_t n = (rows - 1) * m + 1 + static_cast<int64_t>(rng() % m);
  const std::string what = describe("decode_rows", codec, odt, n, block, 0,
                                    " rows=" + std::to_string(rows) + " row_numel=" + std::to_string(m) +
                                        (misalign ? " misaligned" : ""));
  compare(what, [&](bool gpu, uint8_t poison) {
    Buf payloads(rows0.size()), out((n + 9) * esize(odt), misalign ? esize(odt) : 0);
    payloads.set(rows0);
    out.fill(poison);
    DecodeRowsArgs a{payloads.p(), stride, rows, m, codec, block, out.p(), odt, n};
    if (gpu) expect_ok(gpu::launch_decode_rows(a, nullptr), what);
    else K().decode_rows(a, 0, cpu::decode_rows_units(a));
    return Outputs{floats(out.data(), odt)};
  });
}

static void test_decode_sum(int32_t codec, int64_t n, int64_t rows, bool odd_stride) {
  const int64_t block = pick_block(codec);
  const int64_t k = codec == kCodecTopK ? static_cast<int64_t>(rng() % (n + 1)) : pick_sparse_k(codec, block);
  const int64_t stride = layout(codec, n, block, k).total + (odd_stride ? 4 : 16);
  const std::vector<uint8_t> rows0 = payload_rows(codec, n, block, k, rows, stride);
  static const float scales[] = {1.0f, 0.5f, 1.0f / 3.0f};
  const float scale = scales[rng() % 3];
  const std::string what = describe("decode_sum", codec, kF32, n, block, k,
                                    " rows=" + std::to_string(rows) + " stride=" + std::to_string(stride));
  compare(what, [&](bool gpu, uint8_t poison) {
    Buf payloads(rows0.size()), out(4 * n);
    payloads.set(rows0);
    out.fill(poison);
    DecodeSumArgs a{payloads.p(), stride, rows, n, codec, block, k, scale, reinterpret_cast<float*>(out.p())};
    if (gpu) expect_ok(gpu::launch_decode_sum(a, nullptr), what); else K().decode_sum(a, 0, n);
    return Outputs{floats(out.data())};
  });
}

static void test_decode_sum_encode(int32_t src, int32_t enc_codec, int64_t n, int64_t rows, bool with_residual) {
  const int64_t block = pick_block(src), eblock = pick_block(enc_codec);
  const int64_t k = src == kCodecTopK ? static_cast<int64_t>(rng() % (n + 1)) : 0;
  const int64_t stride = layout(src, n, block, k).total + (rng() % 2 ? 4 : 0);
  const std::vector<uint8_t> rows0 = payload_rows(src, n, block, k, rows, stride);
  const std::vector<uint8_t> res0 = bytes_of(random_floats(n, false));
  const float scale = rng() % 2 ? 1.0f : 0.25f;
  const bool stochastic = rng() % 3 == 0;
  const uint64_t seed = rng();
  const Layout EL = layout(enc_codec, n, eblock, 0);
  char extra[120];
  std::snprintf(extra, sizeof extra, " -> %s block=%lld rows=%lld%s%s", cname(enc_codec), (long long)eblock,
                (long long)rows, with_residual ? " +EF" : "", stochastic ? " stochastic" : "");
  const std::string what = describe("decode_sum_encode", src, kF32, n, block, k, extra);
  compare(what, [&](bool gpu, uint8_t poison) {
    Buf payloads(rows0.size()), out(EL.total), residual(with_residual ? 4 * n : 0);
    payloads.set(rows0);
    out.fill(poison);
    residual.set(res0);
    DecodeSumArgs a{payloads.p(), stride, rows, n, src, block, k, scale, nullptr};
    EncodeArgs e{nullptr, kF32, reinterpret_cast<float*>(residual.p()), out.p(), n, enc_codec, eblock, 0,
                      stochastic, seed, nullptr};
    if (gpu) expect_ok(gpu::launch_decode_sum_encode(a, e, nullptr), what); else K().decode_sum_encode(a, e, 0, n);
    return Outputs{payload_out(out.data(), enc_codec, n, eblock, 0), floats(residual.data())};
  });
}

// The chunked sparse kernels (a CTA per chunk, selection by block-wide counts, ranks by a block
// scan) on inputs full of ties: values from a few magnitudes, zeros and -0, so the kept set ends
// inside a run of equal |v| and position order decides; k from 1 to the whole chunk, short last
// chunks, and now and then a non-finite chunk. The encode, then decode_sum of two such rows.
static void test_sparse_ties(int32_t codec) {
  static const int64_t blocks[] = {32, 64, 544, 4096};
  const int64_t block = blocks[rng() % 4];
  const int64_t n = 1 + static_cast<int64_t>(rng() % static_cast<uint64_t>(2 * block + 40));
  const int64_t ks[] = {1, 2, block / 2 + 1, block - 1, block};
  const int64_t k = std::max<int64_t>(1, ks[rng() % 5]);
  const int32_t dt = static_cast<int32_t>(rng() % kNumDTypes);
  static const float pool[] = {0.0f, -0.0f, 1.0f, -1.0f, 2.0f, -2.0f, 1.5f, -0.75f, 3.0e38f, 1e-40f};
  const int spread = 2 + static_cast<int>(rng() % 9);  // how many of the pool's values appear
  std::vector<float> xf(n);
  for (auto& v : xf) v = pool[rng() % spread];
  if (rng() % 4 == 0) xf[rng() % n] = rng() % 2 ? INFINITY : NAN;
  Buf x(n * esize(dt));
  x.set(as_dtype(xf, dt));
  std::vector<float> r0(n);
  const bool with_residual = rng() % 2;
  for (auto& v : r0) v = rng() % 3 ? 0.0f : pool[rng() % spread];
  const Layout L = layout(codec, n, block, k);
  const std::string what = describe("sparse ties encode", codec, dt, n, block, k, with_residual ? " +EF" : "");
  std::vector<uint8_t> cpu_payload;
  compare(what, [&](bool gpu, uint8_t poison) {
    Buf payload(L.total), residual(with_residual ? 4 * n : 0);
    payload.fill(poison);
    residual.set(bytes_of(r0));
    EncodeArgs a{x.p(), dt, reinterpret_cast<float*>(residual.p()), payload.p(), n, codec, block, k, false, 0, nullptr};
    if (gpu) expect_ok(gpu::launch_encode(a, nullptr), what); else K().encode(a, 0, n);
    if (!gpu && poison == 0) cpu_payload = payload.data();
    return Outputs{payload_out(payload.data(), codec, n, block, k), floats(residual.data())};
  });
  // Any padding bytes as the ops leave them (zeros), then the same row twice.
  std::vector<uint8_t> rows = cpu_payload;
  rows.insert(rows.end(), cpu_payload.begin(), cpu_payload.end());
  const std::string swhat = describe("sparse ties decode_sum", codec, kF32, n, block, k, " rows=2");
  compare(swhat, [&](bool gpu, uint8_t poison) {
    Buf payloads(rows.size()), out(4 * n);
    payloads.set(rows);
    out.fill(poison);
    DecodeSumArgs a{payloads.p(), L.total, 2, n, codec, block, k, 0.5f, reinterpret_cast<float*>(out.p())};
    if (gpu) expect_ok(gpu::launch_decode_sum(a, nullptr), swhat); else K().decode_sum(a, 0, n);
    return Outputs{floats(out.data())};
  });
}

// topk on inputs full of ties (a few magnitudes, zeros and -0, now and then inf or NaN): the
// threshold falls inside a run of equal |v| and the lower indices must win, across topk_write's
// 4,096-value chunks and their pieces; k from 0 to n.
static void test_topk_ties() {
  static const float pool[] = {0.0f, -0.0f, 1.0f, -1.0f, 2.0f, -2.0f, 0.5f, 3.0e38f, 1e-40f};
  const int64_t n = 1 + static_cast<int64_t>(rng() % 12000);
  const int spread = 2 + static_cast<int>(rng() % 8);
  std::vector<float> xf(n);
  for (auto& v : xf) v = pool[rng() % spread];
  if (rng() % 4 == 0) xf[rng() % n] = rng() % 2 ? -INFINITY : NAN;
  const int64_t k = rng() % 4 == 0 ? n : static_cast<int64_t>(rng() % (n + 1));
  const int32_t dt = static_cast<int32_t>(rng() % kNumDTypes);
  Buf x(n * esize(dt));
  x.set(as_dtype(xf, dt));
  std::vector<float> r0(n);
  for (auto& v : r0) v = rng() % 3 ? 0.0f : pool[rng() % spread];
  const bool with_residual = rng() % 2;
  const Layout L = layout(kCodecTopK, n, 0, k);
  const std::string what = describe("topk ties encode", kCodecTopK, dt, n, 0, k, with_residual ? " +EF" : "");
  compare(what, [&](bool gpu, uint8_t poison) {
    Buf payload(L.total), residual(with_residual ? 4 * n : 0);
    payload.fill(poison);
    residual.set(bytes_of(r0));
    EncodeArgs a{x.p(), dt, reinterpret_cast<float*>(residual.p()), payload.p(), n, kCodecTopK, 0, k, false, 0, nullptr};
    if (!gpu) {
      std::vector<float> scratch(n);
      a.scratch = scratch.data();
      K().encode_topk(a);
    } else {
      Buf scratch(gpu::topk_scratch_bytes(n));
      scratch.fill(static_cast<uint8_t>(rng()));
      a.scratch = reinterpret_cast<float*>(scratch.p());
      expect_ok(gpu::launch_encode(a, nullptr), what);
    }
    return Outputs{payload_out(payload.data(), kCodecTopK, n, 0, k), floats(residual.data())};
  });
}

static void test_ordered_sum(int32_t dt, int64_t n, int64_t rows, int64_t pad, bool misalign) {
  const int64_t stride = n + pad;
  const size_t off = misalign ? esize(dt) : 0;
  Buf x(rows * stride * esize(dt), off);
  x.set(as_dtype(random_floats(rows * stride, true), dt));
  const std::string what = describe("ordered_sum", kCodecF32, dt, n, 0, 0,
                                    " rows=" + std::to_string(rows) + " stride=" + std::to_string(stride) +
                                        (misalign ? " misaligned" : ""));
  compare(what, [&](bool gpu, uint8_t poison) {
    Buf out(4 * n);
    out.fill(poison);
    OrderedSumArgs a{x.p(), dt, rows, stride, n, reinterpret_cast<float*>(out.p())};
    if (gpu) expect_ok(gpu::launch_ordered_sum(a, nullptr), what); else K().ordered_sum(a, 0, n);
    return Outputs{floats(out.data())};
  });
}

static void test_exact(int32_t dt, int64_t n, int64_t rows, int64_t block, bool misalign) {
  static const int32_t headrooms[] = {kDefaultHeadroom, 1, 30};
  const int32_t precision = 62 - headrooms[rng() % 3];
  const int64_t stride = n + (rng() % 2 ? 0 : 4);
  const size_t off = misalign ? esize(dt) : 0, off32 = misalign ? 4 : 0;  // fp32 stays 4-byte aligned
  const int64_t nblocks = ceil_div(n, block);
  Buf x(rows * stride * esize(dt), off);
  x.set(as_dtype(random_floats(rows * stride, true), dt));
  char extra[100];
  std::snprintf(extra, sizeof extra, " rows=%lld stride=%lld P=%d%s", (long long)rows, (long long)stride, precision,
                misalign ? " misaligned" : "");
  const std::string base = describe("", kCodecF32, dt, n, block, 0, extra);
  auto args = [&](Buf& exps, Buf& fixed, Buf& out) {
    return ExactArgs{x.p(), dt, rows, stride, n, block, precision, reinterpret_cast<int32_t*>(exps.p()),
                          reinterpret_cast<int64_t*>(fixed.p()), reinterpret_cast<float*>(out.p())};
  };
  // exponents
  std::vector<uint8_t> exps0;
  compare("exact_exponents" + base, [&](bool gpu, uint8_t poison) {
    Buf exps(4 * nblocks), fixed, out;
    exps.fill(poison);
    ExactArgs a = args(exps, fixed, out);
    if (gpu) expect_ok(gpu::launch_exact_exponents(a, nullptr), "exact_exponents" + base);
    else K().exact_exponents(a, 0, n);
    if (!gpu) exps0 = exps.data();
    return Outputs{raw(exps.data())};
  });
  // to_fixed of row 0, with the true exponents or (sometimes) lowered ones so that values overflow
  std::vector<uint8_t> exps_used = exps0;
  if (rng() % 3 == 0) {
    for (int64_t b = 0; b < nblocks; ++b) {
      int32_t e;
      std::memcpy(&e, exps_used.data() + 4 * b, 4);
      if (e != kExpZero && e != kExpNonFinite) e -= 1 + static_cast<int32_t>(rng() % 3);
      std::memcpy(exps_used.data() + 4 * b, &e, 4);
    }
  }
  compare("to_fixed" + base, [&](bool gpu, uint8_t poison) {
    Buf exps(4 * nblocks), fixed(8 * n, misalign ? 8 : 0), out, bad(8);
    exps.set(exps_used);
    fixed.fill(poison);
    bad.fill(poison);
    ExactArgs a = args(exps, fixed, out);
    int64_t count = 0;
    if (gpu) expect_ok(gpu::launch_to_fixed(a, reinterpret_cast<int64_t*>(bad.p()), nullptr), "to_fixed" + base);
    else count = K().to_fixed(a, 0, n);
    if (!gpu) std::memcpy(bad.p(), &count, 8);
    return Outputs{raw(fixed.data()), raw(bad.data())};
  });
  // from_fixed of random integers within the precision
  std::vector<uint8_t> fixed0(8 * n);
  for (int64_t i = 0; i < n; ++i) {
    int64_t m = static_cast<int64_t>(rng() >> (64 - precision)) * (rng() % 2 ? 1 : -1);
    if (rng() % 8 == 0) m = 0;
    std::memcpy(fixed0.data() + 8 * i, &m, 8);
  }
  compare("from_fixed" + base, [&](bool gpu, uint8_t poison) {
    Buf exps(4 * nblocks), fixed(8 * n), out(4 * n, off32);
    exps.set(exps0);
    fixed.set(fixed0);
    out.fill(poison);
    ExactArgs a = args(exps, fixed, out);
    if (gpu) expect_ok(gpu::launch_from_fixed(a, nullptr), "from_fixed" + base); else K().from_fixed(a, 0, n);
    return Outputs{floats(out.data())};
  });
  // exact_sum over the rows (exponents written too)
  compare("exact_sum" + base, [&](bool gpu, uint8_t poison) {
    Buf exps(4 * nblocks), fixed, out(4 * n, off32);
    exps.fill(poison);
    out.fill(poison);
    ExactArgs a = args(exps, fixed, out);
    if (gpu) expect_ok(gpu::launch_exact_sum(a, nullptr), "exact_sum" + base); else K().exact_sum(a, 0, n);
    return Outputs{floats(out.data()), raw(exps.data())};
  });
}

// Arguments the GPU launches reject (cudaErrorInvalidValue = 1) without launching anything.
static void test_rejections() {
  std::vector<float> x(64, 1.0f);
  std::vector<uint8_t> payload(4096, 0x77);
  const auto before = fc_emu::stats().launches;
  auto enc = [&](int32_t codec, int64_t block, int32_t dt, float* scratch, int64_t k) {
    EncodeArgs a{x.data(), dt, nullptr, payload.data(), 64, codec, block, k, false, 0, scratch};
    return gpu::launch_encode(a, nullptr);
  };
  auto dec = [&](int64_t n) {
    DecodeArgs a{payload.data(), n, kCodecF32, 0, 0, x.data(), kF32};
    return gpu::launch_decode(a, nullptr);
  };
  auto dsum = [&](int64_t n) {
    DecodeSumArgs a{payload.data(), 16, 1, n, kCodecInt8, 256, 0, 1.0f, x.data()};
    return gpu::launch_decode_sum(a, nullptr);
  };
  auto drows = [&](int32_t codec, int64_t rows, int64_t m, int64_t n, int32_t dt) {
    DecodeRowsArgs a{payload.data(), 64, rows, m, codec, 32, x.data(), dt, n};
    return gpu::launch_decode_rows(a, nullptr);
  };
  const struct {
    const char* what;
    int err;
  } cases[] = {
      {"int8 block 48 (not a multiple of 32)", enc(kCodecInt8, 48, kF32, nullptr, 0)},
      {"int4 block 16 (below 32)", enc(kCodecInt4, 16, kF32, nullptr, 0)},
      {"sign block 8192 (above 4096)", enc(kCodecSign, 8192, kF32, nullptr, 0)},
      {"x dtype 7", enc(kCodecInt8, 64, 7, nullptr, 0)},
      {"codec 9", enc(9, 64, kF32, nullptr, 0)},
      {"topk without scratch", enc(kCodecTopK, 0, kF32, nullptr, 3)},
      {"topk k > n", enc(kCodecTopK, 0, kF32, x.data(), 65)},
      {"decode numel 2^62 + 4 (wire size overflows)", dec((int64_t{1} << 62) + 4)},
      {"decode_sum numel 2^57", dsum(int64_t{1} << 57)},
      {"decode_rows topk", drows(kCodecTopK, 2, 10, 20, kF32)},
      {"decode_rows codec 9", drows(9, 2, 10, 20, kF32)},
      {"decode_rows out dtype 5", drows(kCodecInt8, 2, 10, 20, 5)},
      {"decode_rows 0 rows", drows(kCodecInt8, 0, 10, 0, kF32)},
      {"decode_rows row_numel 0", drows(kCodecInt8, 2, 0, 1, kF32)},
      {"decode_rows out shorter than the rows", drows(kCodecInt8, 3, 10, 20, kF32)},
      {"decode_rows out longer than the rows", drows(kCodecInt8, 2, 10, 21, kF32)},
      {"decode_rows row_numel 2^57", drows(kCodecInt8, 1, int64_t{1} << 57, 5, kF32)},
  };
  for (const auto& c : cases)
    if (c.err != cudaErrorInvalidValue) fail(std::string("rejection: ") + c.what + " returned " + std::to_string(c.err));
    else ++g_passed;
  if (fc_emu::stats().launches != before) fail("rejected arguments launched a kernel");
  bool untouched = true;
  for (uint8_t b : payload) untouched &= b == 0x77;
  if (!untouched) fail("rejected arguments wrote the payload");
}

// A topk row whose indices are not strictly ascending or reach n (a faulty peer): the kernels write
// only inside the output and the tile(s) where the list breaks are NaN (csrc/cuda/README.md); the
// CPU ops reject such rows before their kernels run.
static void test_invalid_topk() {
  for (int variant = 0; variant < 4; ++variant) {
    const int64_t n = 4096 + 3 * 2048 + 17, k = 41;
    const int64_t total = layout(kCodecTopK, n, 0, k).total, co = layout(kCodecTopK, n, 0, k).codes_offset;
    std::vector<uint8_t> p(total, 0);
    auto idx = reinterpret_cast<uint32_t*>(p.data());
    auto val = reinterpret_cast<float*>(p.data() + co);
    for (int64_t e = 0; e < k; ++e) { idx[e] = static_cast<uint32_t>(100 * e); val[e] = 1.0f + e; }
    int64_t bad_elem;  // an element of the tile that must be NaN
    if (variant == 0) {  // [0]*m + [n-1] + [0]*m (issue 13)
      for (int64_t e = 0; e < k; ++e) idx[e] = 0;
      idx[k / 2] = static_cast<uint32_t>(n - 1);
      bad_elem = 0;
    } else if (variant == 1) {  // a duplicate in tile 1
      idx[25] = idx[24];
      bad_elem = idx[24];
    } else if (variant == 2) {  // past numel: only the last tile can see it
      idx[k - 1] = static_cast<uint32_t>(n);
      bad_elem = n - 1;
    } else {  // 0xffffffff
      idx[k - 1] = 0xffffffffu;
      bad_elem = n - 1;
    }
    for (int out_dt = 0; out_dt < kNumDTypes; ++out_dt) {
      Buf out(n * esize(out_dt));
      DecodeArgs a{p.data(), n, kCodecTopK, 0, k, out.p(), out_dt};
      expect_ok(gpu::launch_decode(a, nullptr), "decode of an invalid topk row");
      const bool nan = is_nan(out.p() + bad_elem * esize(out_dt), out_dt);
      if (!nan) fail("invalid topk row variant " + std::to_string(variant) + ": element " + std::to_string(bad_elem) + " is not NaN");
      else ++g_passed;
    }
    Buf sum(4 * n);
    std::vector<uint8_t> rows(p);
    rows.insert(rows.end(), p.begin(), p.end());
    DecodeSumArgs s{rows.data(), total, 2, n, kCodecTopK, 0, k, 0.5f, reinterpret_cast<float*>(sum.p())};
    expect_ok(gpu::launch_decode_sum(s, nullptr), "decode_sum of an invalid topk row");
    if (!is_nan(sum.p() + 4 * bad_elem, kF32)) fail("decode_sum: invalid topk row gave no NaN"); else ++g_passed;
    Buf enc(layout(kCodecInt8, n, 256, 0).total), res(4 * n);
    EncodeArgs e{nullptr, kF32, reinterpret_cast<float*>(res.p()), enc.p(), n, kCodecInt8, 256, 0, false, 0, nullptr};
    expect_ok(gpu::launch_decode_sum_encode(s, e, nullptr), "decode_sum_encode of an invalid topk row");
    if (!is_nan(enc.p() + 4 * (bad_elem / 256), kF32)) fail("decode_sum_encode: invalid topk row gave a finite scale");
    else ++g_passed;
  }
}

int main(int argc, char** argv) {
  const char* s = std::getenv("FLATCOMM_TEST_SEED");
  const uint64_t seed = s ? std::strtoull(s, nullptr, 10) : std::random_device{}();
  // test_cuda_emu [rounds] [--large]
  const int rounds = argc > 1 && std::atoi(argv[1]) > 0 ? std::atoi(argv[1]) : 1;
  bool large = false;
  for (int i = 1; i < argc; ++i) large |= std::strcmp(argv[i], "--large") == 0;
  std::setvbuf(stdout, nullptr, _IOLBF, 0);  // progress survives a crash
  rng.seed(seed);
  fc_emu::seed(seed);
  std::printf("seed %llu, CPU kernels: %s\n", (unsigned long long)seed, K().isa);
  const auto t0 = std::chrono::steady_clock::now();
  test_rejections();
  test_invalid_topk();
  for (int round = 0; round < rounds; ++round) {
    for (int32_t codec = 0; codec < kNumCodecs; ++codec) {
      for (int32_t dt = 0; dt < kNumDTypes; ++dt) {
        for (bool large : {false, true}) {
          const bool stoch = has_stochastic(codec) && rng() % 2;
          test_encode(codec, dt, pick_size(large), rng() % 2, stoch, rng() % 3 == 0);
        }
        test_decode(codec, dt, pick_size(rng() % 2), rng() % 3 == 0);
        if (codec != kCodecTopK && !is_chunk_sparse(codec)) {  // decode_rows refuses both
          static const int64_t kRowSizes[] = {1, 3, 33, 96, 97, 256, 1000, 1031};
          test_decode_rows(codec, dt, kRowSizes[rng() % 8], 1 + static_cast<int64_t>(rng() % 4), rng() % 3 == 0);
        }
      }
      for (int64_t rows : {1, 3})
        test_decode_sum(codec, pick_size(rows == 1), rows, rng() % 2);
      test_decode_sum(codec, pick_size(false), rng() % 2 ? 0 : 6, false);
      for (int32_t enc = 0; enc < kNumCodecs; ++enc)
        if (enc != kCodecTopK && !is_chunk_sparse(enc) && !is_chunk_sparse(codec)) test_decode_sum_encode(codec, enc, pick_size(rng() % 4 == 0), 1 + rng() % 3, rng() % 2);
    }
    for (int32_t codec = 0; codec < kNumCodecs; ++codec)
      if (is_chunk_sparse(codec))
        for (int i = 0; i < 3; ++i) test_sparse_ties(codec);
    for (int i = 0; i < 3; ++i) test_topk_ties();
    for (int32_t dt = 0; dt < kNumDTypes; ++dt) {
      test_ordered_sum(dt, pick_size(true), 1 + rng() % 4, rng() % 2 ? 0 : 1 + rng() % 5, rng() % 3 == 0);
      test_ordered_sum(dt, pick_size(false), 1 + rng() % 4, rng() % 2 ? 0 : 4, false);
      static const int64_t blocks[] = {1, 3, 32, 100, 256, 4096};
      // exact_sum holds up to 16 rows of small blocks in registers (1 to 16 rows of 128, 8 of 256,
      // 4 of 512), the rest in two passes: rows on both sides of each limit.
      static const int64_t exact_rows[] = {1, 2, 3, 4, 5, 8, 9, 16, 17};
      test_exact(dt, pick_size(rng() % 2), exact_rows[rng() % 9], blocks[rng() % 6], rng() % 3 == 0);
      test_exact(dt, pick_size(true), 2, 256, false);
      test_exact(dt, pick_size(false), exact_rows[rng() % 9], rng() % 2 ? 128 : 512, rng() % 3 == 0);
    }
  }
  // topk past 1024 chunks of 4096 (4.2M values): the scan kernel carries across its 1024-thread
  // steps and the histogram kernels (capped at 1024 CTAs) stride through the grid; no other case
  // reaches either. Several minutes under ASan, so only on request (`test_cuda_emu 1 --large`).
  if (large)
    test_encode(kCodecTopK, static_cast<int32_t>(rng() % 3), 1025 * gpu::kTopkChunk + 77, true, false, false);
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const fc_emu::Stats st = fc_emu::stats();
  std::printf("emulated %llu launches, %llu CTAs, %llu threads, %llu barriers, %llu warp operations in %.1f s\n",
              (unsigned long long)st.launches, (unsigned long long)st.ctas, (unsigned long long)st.threads,
              (unsigned long long)st.barriers, (unsigned long long)st.warp_ops, secs);
  std::printf("%d checks passed, %d failed (seed %llu)\n", g_passed, g_failed, (unsigned long long)seed);
  return g_failed ? 1 : 0;
}

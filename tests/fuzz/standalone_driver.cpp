// A small driver for the fuzz targets where libFuzzer is not available (gcc: CI and make test).
//
//   fuzz_<target> [--seconds S] [--runs N] [--seed X] [FILE...]
//
// With files it runs each one as an input (reproducing a finding, as libFuzzer would). Otherwise it
// generates inputs until N runs or S seconds (FLATCOMM_FUZZ_SECONDS / FLATCOMM_FUZZ_RUNS override):
// random bytes, and structured ones in the layout of fuzz_harness.h -- valid payloads (encoded by
// the CPU kernels) with flipped bytes, NaN / inf / huge / subnormal scales, huge and negative
// numels, and topk index lists that are not ascending, repeat or run past numel. On a finding the
// input is written to fuzz-finding-<target>.bin before the process dies.
#include <signal.h>
#include <unistd.h>
#include <fcntl.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <random>
#include <string>
#include <vector>

#include "fuzz_harness.h"

using namespace fuzz;

namespace {

std::vector<uint8_t> g_current;
char g_dump_path[256] = "fuzz-finding.bin";

void dump_current() {
  const int fd = open(g_dump_path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd < 0) return;
  if (!g_current.empty() && write(fd, g_current.data(), g_current.size()) < 0) {}
  close(fd);
  const char msg[] = "fuzz driver: the input is saved (rerun the target with its path)\n";
  if (write(2, msg, sizeof msg - 1) < 0) {}
}

// AddressSanitizer and UBSan end the process through their own exit path, not a signal.
extern "C" void __sanitizer_set_death_callback(void (*callback)(void)) __attribute__((weak));

extern "C" void on_signal(int sig) {
  dump_current();
  signal(sig, SIG_DFL);
  raise(sig);
}

struct Writer {
  std::vector<uint8_t> b;
  template <typename T>
  void put(T v) {
    const uint8_t* p = reinterpret_cast<const uint8_t*>(&v);
    b.insert(b.end(), p, p + sizeof(T));
  }
};

float special_float(std::mt19937_64& rng) {
  static const uint32_t bits[] = {0x7fc00000u, 0xffc00001u, 0x7f800000u, 0xff800000u, 0x7f7fffffu,
                                  0x00000001u, 0x80000000u, 0x00000000u, 0x3f800000u, 0x4b000000u};
  return u2f(bits[rng() % 10]);
}

std::vector<float> random_floats(std::mt19937_64& rng, int64_t n) {
  std::normal_distribution<float> normal(0.0f, std::pow(10.0f, static_cast<float>(rng() % 9) - 4.0f));
  std::vector<float> v(n);
  for (auto& x : v) x = normal(rng);
  for (int i = rng() % 4; i > 0 && n > 0; --i) v[rng() % n] = special_float(rng);
  if (rng() % 4 == 0 && n > 0) {  // a zero run
    const int64_t s = rng() % n;
    for (int64_t i = s; i < std::min<int64_t>(n, s + 300); ++i) v[i] = 0.0f;
  }
  return v;
}

// One valid payload of the codec (the CPU encoder's output).
std::vector<uint8_t> valid_payload(std::mt19937_64& rng, int32_t codec, int64_t n, int64_t block, int64_t k) {
  const Layout L = layout(codec, n, block, k);
  std::vector<uint8_t> p(L.total);
  std::vector<float> x = random_floats(rng, n), scratch(n);
  EncodeArgs e{x.data(), kF32, nullptr, p.data(), n, codec, block, k, false, rng(), scratch.data()};
  if (codec == kCodecTopK) cpu::kernels().encode_topk(e);
  else cpu::kernels().encode(e, 0, n);
  return p;
}

void mutate_topk(std::mt19937_64& rng, std::vector<uint8_t>& p, int64_t n, int64_t k) {
  if (k == 0) return;
  auto at = [&](int64_t e) { return reinterpret_cast<uint32_t*>(p.data()) + e; };
  const int64_t e = rng() % k;
  switch (rng() % 7) {
    case 0: {  // [0]*m + [n-1] + [0]*m
      for (int64_t j = 0; j < k; ++j) *at(j) = 0;
      *at(k / 2) = static_cast<uint32_t>(n - 1);
      break;
    }
    case 1: if (e + 1 < k) std::swap(*at(e), *at(e + 1)); break;
    case 2: if (e > 0) *at(e) = *at(e - 1); break;
    case 3: *at(e) = static_cast<uint32_t>(n + rng() % 3); break;
    case 4: *at(e) = 0xffffffffu; break;
    case 5: for (int64_t j = 0; j < k; ++j) *at(j) = static_cast<uint32_t>(k - 1 - j); break;
    default: *at(e) = static_cast<uint32_t>(rng() % (n + 1)); break;
  }
}

std::vector<uint8_t> structured_input(std::mt19937_64& rng) {
  Writer w;
  const int32_t codec = static_cast<int32_t>(rng() % kNumCodecs);
  const bool huge = rng() % 16 == 0;
  // Mostly small sizes (speed), sometimes several 2048-element topk tiles and their edges.
  static const int64_t kSizes[] = {1, 2, 3, 31, 32, 33, 63, 64, 65, 100, 255, 256, 257, 300};
  static const int64_t kLarge[] = {1000, 2047, 2048, 2049, 4095, 4096, 4097, kMaxFuzzNumel};
  const int64_t n = huge ? 0
                    : rng() % 8 == 0 ? (rng() % 2 ? kLarge[rng() % 8] : static_cast<int64_t>(rng() % (kMaxFuzzNumel + 1)))
                    : rng() % 3 ? kSizes[rng() % 14] : static_cast<int64_t>(1 + rng() % 300);
  const int64_t block = 32 * (1 + static_cast<int64_t>(rng() % 128));
  const int64_t k = n > 0 ? 1 + static_cast<int64_t>(rng() % (rng() % 2 ? n : std::max<int64_t>(1, n / 16))) : 0;
  const int64_t rows = static_cast<int64_t>(rng() % (kMaxRows + 1));
  w.put<uint8_t>(static_cast<uint8_t>(rng()));
  w.put<uint8_t>(static_cast<uint8_t>(codec));
  w.put<uint8_t>(static_cast<uint8_t>(rng()));
  w.put<uint8_t>(huge ? 0x80 : 0xa1);  // small numel (up to kMaxFuzzNumel), valid block, k in [1, n]
  if (huge) {
    static const uint64_t kHuge[] = {1ull << 61, 1ull << 62, (1ull << 62) + 4, ~0ull >> 1, ~0ull, 1ull << 63,
                                     1ull << 56, (1ull << 56) + 1, (1ull << 56) - 1, 1ull << 32, (1ull << 32) - 1};
    w.put<uint64_t>(rng() % 4 ? kHuge[rng() % 11] : rng());
  } else {
    w.put<uint64_t>(static_cast<uint64_t>(n));
  }
  w.put<uint16_t>(static_cast<uint16_t>(block / 32 - 1));
  w.put<uint32_t>(static_cast<uint32_t>(k > 0 ? k - 1 : 0));
  w.put<uint8_t>(static_cast<uint8_t>(rows));
  const int sc = static_cast<int>(rng() % 4);
  w.put<float>(sc == 0 ? 1.0f : sc == 1 ? 0.5f : sc == 2 ? special_float(rng) : static_cast<float>(rng() % 1000) / 7.0f);
  w.put<uint8_t>(static_cast<uint8_t>(rng()));
  w.put<uint16_t>(static_cast<uint16_t>(rng()));
  w.put<uint8_t>(static_cast<uint8_t>(rng()));
  w.put<uint64_t>(rng());
  if (huge || n == 0) return w.b;
  for (int64_t r = 0; r < std::max<int64_t>(rows, 1); ++r) {
    std::vector<uint8_t> p = valid_payload(rng, codec, n, block, k);
    const int m = static_cast<int>(rng() % 4);  // 0: untouched
    for (int i = 0; i < m && !p.empty(); ++i) {
      switch (rng() % 3) {
        case 0: p[rng() % p.size()] ^= static_cast<uint8_t>(1u << (rng() % 8)); break;
        case 1: {  // a special float at a 4-byte slot (a scale, a topk value, a cast value)
          const size_t at = 4 * (rng() % (p.size() / 4));
          const float f = special_float(rng);
          memcpy(p.data() + at, &f, 4);
          break;
        }
        default: if (codec == kCodecTopK) mutate_topk(rng, p, n, k); break;
      }
    }
    w.b.insert(w.b.end(), p.begin(), p.end());
  }
  return w.b;
}

std::vector<uint8_t> random_input(std::mt19937_64& rng) {
  std::vector<uint8_t> b(rng() % 512);
  for (auto& c : b) c = static_cast<uint8_t>(rng());
  return b;
}

double env_or(const char* name, double fallback) {
  const char* v = getenv(name);
  return v && *v ? atof(v) : fallback;
}

}  // namespace

int main(int argc, char** argv) {
  double seconds = 10, runs = 1e18;
  uint64_t seed = std::random_device{}();
  std::vector<std::string> files;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--seconds" && i + 1 < argc) seconds = atof(argv[++i]);
    else if (a == "--runs" && i + 1 < argc) runs = atof(argv[++i]);
    else if (a == "--seed" && i + 1 < argc) seed = strtoull(argv[++i], nullptr, 0);
    else files.push_back(a);
  }
  seconds = env_or("FLATCOMM_FUZZ_SECONDS", seconds);
  runs = env_or("FLATCOMM_FUZZ_RUNS", runs);
  if (const char* s = getenv("FLATCOMM_TEST_SEED")) seed = strtoull(s, nullptr, 0);
  const char* slash = strrchr(argv[0], '/');
  snprintf(g_dump_path, sizeof g_dump_path, "fuzz-finding-%s.bin", slash ? slash + 1 : argv[0]);
  signal(SIGABRT, on_signal);  // a failed FUZZ_CHECK
  if (__sanitizer_set_death_callback) {
    __sanitizer_set_death_callback(dump_current);  // the sanitizers report SEGV themselves
  } else {
    signal(SIGSEGV, on_signal);
    signal(SIGBUS, on_signal);
    signal(SIGFPE, on_signal);
  }
  if (!files.empty()) {
    for (const std::string& f : files) {
      std::ifstream in(f, std::ios::binary);
      g_current.assign(std::istreambuf_iterator<char>(in), {});
      LLVMFuzzerTestOneInput(g_current.data(), g_current.size());
      printf("ran %s (%zu bytes): no finding\n", f.c_str(), g_current.size());
    }
    return 0;
  }
  std::mt19937_64 rng(seed);
  const auto t0 = std::chrono::steady_clock::now();
  uint64_t n = 0;
  double elapsed = 0;
  while (n < runs) {
    g_current = rng() % 4 == 0 ? random_input(rng) : structured_input(rng);
    LLVMFuzzerTestOneInput(g_current.data(), g_current.size());
    ++n;
    if ((n & 63) == 0) {
      elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (elapsed >= seconds) break;
    }
  }
  elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  printf("%s: %llu inputs in %.1f s (%.0f/s), seed %llu, isa %s: no finding\n", slash ? slash + 1 : argv[0],
         (unsigned long long)n, elapsed, n / (elapsed > 0 ? elapsed : 1), (unsigned long long)seed,
         cpu::kernels().isa);
  return 0;
}

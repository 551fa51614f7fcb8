// The fiber scheduler behind cuda_emu.h: one ucontext fiber per CUDA thread, one CTA at a time.
#include "cuda_emu.h"

#include <ucontext.h>

#include <algorithm>
#include <cstdio>
#include <random>
#include <vector>

#if defined(__SANITIZE_ADDRESS__)
#define FC_EMU_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define FC_EMU_ASAN 1
#endif
#endif
#ifdef FC_EMU_ASAN
#include <sanitizer/common_interface_defs.h>
#endif

uint3 threadIdx, blockIdx;
dim3 blockDim, gridDim;

namespace fc_emu {
namespace {

// sm80 / sm90 limits.
constexpr unsigned kMaxThreadsPerCta = 1024;
constexpr uint64_t kMaxGridX = 0x7fffffffu, kMaxGridYZ = 65535;
constexpr size_t kDefaultDynamicSmem = 48 * 1024;  // more needs cudaFuncSetAttribute (not emulated)
constexpr size_t kStackBytes = 256 * 1024;

enum State { kReady, kAtBarrier, kAtWarpOp, kDone };

struct Fiber {
  ucontext_t ctx;
  std::vector<char> stack;
  uint3 tid;
  State state = kReady;
  // the pending warp operation
  WarpOp op{};
  unsigned mask = 0;
  uint64_t in = 0, out = 0;
  int arg = 0, width = 32;
};

struct Scheduler {
  std::vector<Fiber> fibers;
  ucontext_t main_ctx;
  Fiber* current = nullptr;
  void (*thunk)(void*) = nullptr;
  void* thunk_ctx = nullptr;
  std::vector<unsigned char> smem;
  uint64_t epoch = 0;
  std::mt19937_64 rng{0x5eed};
  Stats stats{};
  int last_error = 0;
#ifdef FC_EMU_ASAN
  void* fake_stack = nullptr;
#endif
} S;

void switch_to_main(Fiber& f) {
#ifdef FC_EMU_ASAN
  void* fake = nullptr;
  __sanitizer_start_switch_fiber(f.state == kDone ? nullptr : &fake, nullptr, 0);
  swapcontext(&f.ctx, &S.main_ctx);
  __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#else
  swapcontext(&f.ctx, &S.main_ctx);
#endif
}

void switch_to_fiber(Fiber& f) {
  S.current = &f;
  threadIdx = f.tid;
#ifdef FC_EMU_ASAN
  void* fake = nullptr;
  __sanitizer_start_switch_fiber(&fake, f.stack.data(), f.stack.size());
  swapcontext(&S.main_ctx, &f.ctx);
  __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#else
  swapcontext(&S.main_ctx, &f.ctx);
#endif
  S.current = nullptr;
}

void fiber_main() {
#ifdef FC_EMU_ASAN
  __sanitizer_finish_switch_fiber(nullptr, nullptr, nullptr);
#endif
  S.thunk(S.thunk_ctx);
  S.current->state = kDone;
  switch_to_main(*S.current);  // never resumed
}

Fiber& self() {
  if (S.current == nullptr) {
    std::fprintf(stderr, "cuda_emu: a device function ran outside a kernel launch\n");
    std::abort();
  }
  return *S.current;
}

const char* op_name(WarpOp op) {
  switch (op) {
    case kShflUp: return "__shfl_up_sync";
    case kShflDown: return "__shfl_down_sync";
    case kShfl: return "__shfl_sync";
    case kReduceMax: return "__reduce_max_sync";
    case kBallot: return "__ballot_sync";
  }
  return "?";
}

// Completes the pending warp operation of warp w if every lane of its mask has arrived at it.
// Returns 1 when released, 0 when still waiting, -1 on a contract violation (message printed).
int try_release_warp(size_t first, size_t lanes) {
  Fiber* lead = nullptr;
  for (size_t l = 0; l < lanes; ++l)
    if (S.fibers[first + l].state == kAtWarpOp) { lead = &S.fibers[first + l]; break; }
  if (lead == nullptr) return 0;
  const unsigned mask = lead->mask;
  for (size_t l = 0; l < lanes; ++l) {
    if (!(mask >> l & 1u)) continue;
    const Fiber& f = S.fibers[first + l];
    if (f.state == kReady) return 0;  // still running towards it
    if (f.state == kDone || f.state == kAtBarrier) {
      std::fprintf(stderr,
                   "cuda_emu: block (%u,%u,%u) warp %zu: %s with mask 0x%08x, but lane %zu %s\n",
                   blockIdx.x, blockIdx.y, blockIdx.z, first / 32, op_name(lead->op), mask, l,
                   f.state == kDone ? "has exited" : "waits at __syncthreads");
      return -1;
    }
    if (f.op != lead->op || f.mask != mask) {
      std::fprintf(stderr, "cuda_emu: block (%u,%u,%u) warp %zu: lanes disagree (%s mask 0x%08x vs %s mask 0x%08x)\n",
                   blockIdx.x, blockIdx.y, blockIdx.z, first / 32, op_name(lead->op), mask, op_name(f.op), f.mask);
      return -1;
    }
  }
  for (size_t l = 0; l < lanes; ++l) {
    if (!(mask >> l & 1u)) continue;  // not taking part (may wait at an op of another mask)
    Fiber& f = S.fibers[first + l];
    if (f.op == kShflUp || f.op == kShflDown || f.op == kShfl) {
      // A source outside the lane's width-wide segment leaves the lane its own value; __shfl_sync
      // reads lane arg % width of the lane's segment.
      const int lane = static_cast<int>(l), sub = lane % f.width;
      const int src = f.op == kShfl     ? lane - sub + f.arg % f.width
                      : f.op == kShflUp ? (sub - f.arg >= 0 ? lane - f.arg : lane)
                                        : (sub + f.arg < f.width ? lane + f.arg : lane);
      if (src >= static_cast<int>(lanes) || !(mask >> src & 1u)) {
        std::fprintf(stderr, "cuda_emu: block (%u,%u,%u) warp %zu: lane %zu reads lane %d outside the mask 0x%08x\n",
                     blockIdx.x, blockIdx.y, blockIdx.z, first / 32, l, src, mask);
        return -1;
      }
      f.out = S.fibers[first + src].in;
    } else {
      uint64_t acc = 0;
      for (size_t m = 0; m < lanes; ++m) {
        if (!(mask >> m & 1u)) continue;
        const uint64_t v = S.fibers[first + m].in;
        switch (f.op) {
          case kReduceMax: acc = std::max(acc, v & 0xffffffffu); break;
          case kBallot: acc |= (v ? 1ull : 0ull) << m; break;
          default: break;
        }
      }
      f.out = acc;
    }
  }
  for (size_t l = 0; l < lanes; ++l)
    if (mask >> l & 1u) S.fibers[first + l].state = kReady;
  ++S.stats.warp_ops;
  return 1;
}

// Runs one CTA to completion. Returns 0 or cudaErrorLaunchFailure (message printed).
int run_cta(size_t nthreads) {
  ++S.epoch;
  std::fill(S.smem.begin(), S.smem.end(), static_cast<unsigned char>(0xff));
  for (size_t t = 0; t < nthreads; ++t) {
    Fiber& f = S.fibers[t];
    f.tid = uint3{static_cast<unsigned>(t % blockDim.x), static_cast<unsigned>(t / blockDim.x % blockDim.y),
                  static_cast<unsigned>(t / (blockDim.x * blockDim.y))};
    f.state = kReady;
    getcontext(&f.ctx);
    f.ctx.uc_stack.ss_sp = f.stack.data();
    f.ctx.uc_stack.ss_size = f.stack.size();
    f.ctx.uc_link = nullptr;
    makecontext(&f.ctx, fiber_main, 0);
  }
  std::vector<size_t> order(nthreads);
  for (;;) {
    // Run every ready fiber, in a fresh random order, to its next synchronisation point.
    order.clear();
    for (size_t t = 0; t < nthreads; ++t)
      if (S.fibers[t].state == kReady) order.push_back(t);
    if (!order.empty()) {
      std::shuffle(order.begin(), order.end(), S.rng);
      for (size_t t : order) switch_to_fiber(S.fibers[t]);
      continue;
    }
    size_t done = 0, at_barrier = 0;
    for (size_t t = 0; t < nthreads; ++t) {
      done += S.fibers[t].state == kDone;
      at_barrier += S.fibers[t].state == kAtBarrier;
    }
    if (done == nthreads) return 0;
    bool released = false;
    for (size_t w = 0; w < nthreads; w += 32) {
      const int r = try_release_warp(w, std::min<size_t>(32, nthreads - w));
      if (r < 0) return cudaErrorLaunchFailure;
      released |= r > 0;
    }
    if (released) continue;
    if (at_barrier + done == nthreads && done == 0) {
      for (size_t t = 0; t < nthreads; ++t) S.fibers[t].state = kReady;
      ++S.stats.barriers;
      continue;
    }
    std::fprintf(stderr,
                 "cuda_emu: block (%u,%u,%u) cannot continue: %zu threads wait at __syncthreads, %zu have exited, "
                 "%zu wait at a warp operation (a barrier not reached by every thread of the CTA)\n",
                 blockIdx.x, blockIdx.y, blockIdx.z, at_barrier, done, nthreads - at_barrier - done);
    return cudaErrorLaunchFailure;
  }
}

}  // namespace

uint64_t warp_op(WarpOp op, unsigned mask, uint64_t value, int arg, int width) {
  Fiber& f = self();
  const unsigned lane = static_cast<unsigned>((&f - S.fibers.data()) % 32);
  if (!(mask >> lane & 1u)) {
    std::fprintf(stderr, "cuda_emu: lane %u calls %s with mask 0x%08x that excludes it\n", lane, op_name(op), mask);
    std::abort();
  }
  f.op = op;
  f.mask = mask;
  f.in = value;
  f.arg = arg;
  f.width = width;
  f.state = kAtWarpOp;
  switch_to_main(f);
  return f.out;
}

void syncthreads() {
  Fiber& f = self();
  f.state = kAtBarrier;
  switch_to_main(f);
}

void* dynamic_shared() { return S.smem.data(); }
uint64_t cta_epoch() { return S.epoch; }

int run_grid(dim3 grid, dim3 block, size_t dynamic_smem, void (*thunk)(void*), void* ctx) {
  const uint64_t nthreads = uint64_t{block.x} * block.y * block.z;
  if (nthreads == 0 || nthreads > kMaxThreadsPerCta || block.z > 64 || grid.x == 0 || grid.y == 0 ||
      grid.z == 0 || grid.x > kMaxGridX || grid.y > kMaxGridYZ || grid.z > kMaxGridYZ) {
    std::fprintf(stderr, "cuda_emu: invalid launch configuration grid (%u,%u,%u) block (%u,%u,%u)\n", grid.x,
                 grid.y, grid.z, block.x, block.y, block.z);
    return cudaErrorInvalidConfiguration;
  }
  if (dynamic_smem > kDefaultDynamicSmem) {
    std::fprintf(stderr, "cuda_emu: %zu bytes of dynamic shared memory exceed the 48 KiB a launch gets without "
                 "cudaFuncSetAttribute(cudaFuncAttributeMaxDynamicSharedMemorySize)\n", dynamic_smem);
    return cudaErrorInvalidValue;
  }
  ++S.stats.launches;
  if (S.fibers.size() < nthreads) {
    S.fibers.resize(nthreads);
    for (Fiber& f : S.fibers)
      if (f.stack.empty()) f.stack.resize(kStackBytes);
  }
  S.smem.assign(dynamic_smem, 0xff);
  S.thunk = thunk;
  S.thunk_ctx = ctx;
  gridDim = grid;
  blockDim = block;
  // CTAs in a random order: a kernel must not depend on it.
  const uint64_t nctas = uint64_t{grid.x} * grid.y * grid.z;
  std::vector<uint64_t> ctas(nctas);
  for (uint64_t i = 0; i < nctas; ++i) ctas[i] = i;
  std::shuffle(ctas.begin(), ctas.end(), S.rng);
  for (uint64_t c : ctas) {
    blockIdx = uint3{static_cast<unsigned>(c % grid.x), static_cast<unsigned>(c / grid.x % grid.y),
                     static_cast<unsigned>(c / (uint64_t{grid.x} * grid.y))};
    ++S.stats.ctas;
    S.stats.threads += nthreads;
    const int err = run_cta(static_cast<size_t>(nthreads));
    if (err) return err;
  }
  return 0;
}

void set_last_error(int err) {
  if (err != 0 && S.last_error == 0) S.last_error = err;
}
Stats stats() { return S.stats; }
void seed(uint64_t s) { S.rng.seed(s); }

}  // namespace fc_emu

cudaError_t cudaGetLastError() {
  const int e = fc_emu::S.last_error;
  fc_emu::S.last_error = 0;
  return static_cast<cudaError_t>(e);
}

cudaError_t cudaMemsetAsync(void* p, int value, size_t bytes, cudaStream_t) {
  memset(p, value, bytes);
  return cudaSuccess;
}

// A CUDA emulator for the CPU: just enough of the CUDA language and runtime to run flatcomm's real
// kernels (csrc/cuda/kernels.cu + device.cuh, translated by translate.py) on machines without a GPU.
//
// Why: CI has no GPU, and a kernel bug (an index, a tail, a missing __syncthreads, a lane that skips a
// shuffle, a launch over the shared-memory limit) would otherwise first show on a scarce GPU run.
// Here every CTA runs as fibers (one per CUDA thread) on one OS thread:
//   * __syncthreads and the warp intrinsics are real synchronisation points: a fiber stops there
//     until every thread that must take part has arrived; fibers run in a fresh random order
//     between synchronisation points, so a read that is not ordered by a barrier sees different
//     data on different runs (and fails the bitwise comparison with the CPU kernels);
//   * a barrier that can never complete (a thread exited or waits elsewhere) is reported, where a
//     GPU would hang or be undefined;
//   * __shared__ arrays are per CTA and filled with garbage (0xff bytes: NaN / all ones) at the start
//     of every CTA, like uninitialised shared memory;
//   * launches check the configuration limits of sm80/sm90 (threads per CTA, grid dimensions, 48 KiB
//     of dynamic shared memory without an opt-in attribute).
// The arithmetic is the host's IEEE fp32 with no contraction (-ffp-contract=off), which is what nvcc
// produces with -fmad=false and its default (IEEE) division.
#pragma once

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <tuple>
#include <type_traits>
#include <utility>

// ---- language ----------------------------------------------------------------------------------
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
// __shared__ is deliberately not defined: translate.py rewrites every shared declaration, so one it
// missed fails to compile instead of silently becoming a per-thread local.

struct uint3 {
  unsigned x, y, z;
};
struct dim3 {
  unsigned x, y, z;
  dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
struct alignas(16) float4 {
  float x, y, z, w;
};
struct alignas(8) uint2 {
  unsigned x, y;
};
struct alignas(16) uint4 {
  unsigned x, y, z, w;
};
struct alignas(16) longlong2 {
  long long x, y;
};
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }
inline uint2 make_uint2(unsigned x, unsigned y) { return {x, y}; }
inline longlong2 make_longlong2(long long x, long long y) { return {x, y}; }

// The built-in variables of the thread that is running (set by the scheduler before every switch).
extern uint3 threadIdx;
extern uint3 blockIdx;
extern dim3 blockDim;
extern dim3 gridDim;

inline int __popc(unsigned x) { return __builtin_popcount(x); }

// Atomics: the fibers of a launch share one OS thread, so a plain read-modify-write is atomic.
template <class T>
T atomicAdd(T* p, T v) {
  const T old = *p;
  *p = static_cast<T>(old + v);
  return old;
}

template <class T>
T atomicOr(T* p, T v) {
  const T old = *p;
  *p = static_cast<T>(old | v);
  return old;
}

namespace fc_emu {

// The warp intrinsics device.cuh uses (add others here and in cuda_emu.cpp when it needs them).
enum WarpOp { kShflUp = 1, kShflDown, kShfl, kReduceMax, kBallot };
// One warp-wide operation of the calling fiber: blocks until every lane of `mask` has called the
// same operation with the same mask, then returns this lane's result.
uint64_t warp_op(WarpOp op, unsigned mask, uint64_t value, int arg, int width);
void syncthreads();
void* dynamic_shared();  // this CTA's dynamic shared memory (the launch's byte count)
// A per-CTA __shared__ variable: one object per declaration (and template instantiation), garbage at
// the start of every CTA.
uint64_t cta_epoch();
template <class T, int Line>
T& shared_var() {
  alignas(16) static unsigned char storage[sizeof(T)];
  static uint64_t epoch = 0;
  if (epoch != cta_epoch()) {
    memset(storage, 0xff, sizeof(T));
    epoch = cta_epoch();
  }
  return *reinterpret_cast<T*>(storage);
}

template <class T>
uint64_t to_bits(T v) {
  static_assert(sizeof(T) <= 8 && std::is_trivially_copyable<T>::value, "warp value");
  uint64_t u = 0;
  memcpy(&u, &v, sizeof(T));
  return u;
}
template <class T>
T from_bits(uint64_t u) {
  T v;
  memcpy(&v, &u, sizeof(T));
  return v;
}

// Runs body() once per thread of every CTA of the grid; checks the configuration first.
// Returns a cudaError_t value (0 = success).
int run_grid(dim3 grid, dim3 block, size_t dynamic_smem, void (*thunk)(void*), void* ctx);

}  // namespace fc_emu

inline void __syncthreads() { fc_emu::syncthreads(); }
template <class T>
T __shfl_up_sync(unsigned mask, T v, unsigned delta, int width = 32) {
  return fc_emu::from_bits<T>(fc_emu::warp_op(fc_emu::kShflUp, mask, fc_emu::to_bits(v), delta, width));
}
template <class T>
T __shfl_sync(unsigned mask, T v, int src_lane, int width = 32) {
  return fc_emu::from_bits<T>(fc_emu::warp_op(fc_emu::kShfl, mask, fc_emu::to_bits(v), src_lane, width));
}
template <class T>
T __shfl_down_sync(unsigned mask, T v, unsigned delta, int width = 32) {
  return fc_emu::from_bits<T>(fc_emu::warp_op(fc_emu::kShflDown, mask, fc_emu::to_bits(v), delta, width));
}
inline unsigned __reduce_max_sync(unsigned mask, unsigned v) {
  return static_cast<unsigned>(fc_emu::warp_op(fc_emu::kReduceMax, mask, v, 0, 32));
}
inline unsigned __ballot_sync(unsigned mask, int pred) {
  return static_cast<unsigned>(fc_emu::warp_op(fc_emu::kBallot, mask, pred != 0, 0, 32));
}

// ---- runtime -----------------------------------------------------------------------------------
typedef struct CUstream_st* cudaStream_t;
enum cudaError {
  cudaSuccess = 0,
  cudaErrorInvalidValue = 1,
  cudaErrorInvalidConfiguration = 9,
  cudaErrorLaunchFailure = 719,
};
typedef enum cudaError cudaError_t;

cudaError_t cudaGetLastError();
cudaError_t cudaMemsetAsync(void* p, int value, size_t bytes, cudaStream_t stream);

namespace fc_emu {
void set_last_error(int err);

// kernel<<<grid, block, smem, stream>>>(args...)  ==  launch(kernel, grid, block, smem, stream)(args...)
// (translate.py rewrites the first into the second). Arguments are converted to the kernel's
// parameter types and copied, as a real launch does.
template <class... P>
struct Launcher {
  void (*kernel)(P...);
  dim3 grid, block;
  size_t smem;
  template <class... A>
  void operator()(A&&... args) const {
    std::tuple<std::decay_t<P>...> params(static_cast<P>(std::forward<A>(args))...);
    struct Ctx {
      void (*kernel)(P...);
      std::tuple<std::decay_t<P>...>* params;
    } ctx{kernel, &params};
    auto thunk = [](void* c) {
      Ctx* x = static_cast<Ctx*>(c);
      std::tuple<std::decay_t<P>...> copy = *x->params;  // each thread gets its own parameter copy
      std::apply(x->kernel, copy);
    };
    set_last_error(run_grid(grid, block, smem, thunk, &ctx));
  }
};
template <class... P>
Launcher<P...> launch(void (*kernel)(P...), dim3 grid, dim3 block, size_t smem = 0, cudaStream_t = nullptr) {
  return Launcher<P...>{kernel, grid, block, smem};
}

// Statistics and the scheduling seed, for the tests.
struct Stats {
  uint64_t launches, ctas, threads, barriers, warp_ops;
};
Stats stats();
void seed(uint64_t s);

}  // namespace fc_emu

// The device code of the CUDA kernels: every __global__ kernel and the device helpers they use.
//
// Two compilers build it from this one file, so the kernels cannot diverge:
//   * nvcc, through kernels.cu (the host launch code, linked into flatcomm._C);
//   * NVRTC at run time (the optional cupy path, for builds without CUDA): flatcomm/cupy_backend.py
//     inlines this header's includes into one source and instantiates the same templates by name.
// Only kernels.cu may include it (its non-template kernels are defined here, not just declared).
// So this header includes no host header and nothing from the CUDA runtime: only csrc/core (whose
// common.h supplies the fixed-width integer types under NVRTC) and the plain-C++ kernels.cuh for
// the argument structs (core/kernel_args.h) and the launch shapes (kThreads, ...). Kernel
// parameters and shared-memory sizes are part of the launch contract with kernels.cu and
// cupy_backend.py; change them in all three places (tests/test_nvrtc.py checks the struct layouts
// and the kernel names).
//
// Shapes used throughout:
//   * elementwise kernels: each thread takes chunks of 4 consecutive elements (i % 4 == 0), with one
//     16-byte (fp32) or 8-byte (16-bit) access when the chunk is full and the launch found every
//     pointer 16-byte aligned (`vec`); otherwise element by element. Grid-stride loops.
//   * blockwise encode: int8 / int4 / sign blocks of up to kRegMaxBlock (512) values: one warp per
//     codec block, held in registers (8 blocks per CTA, no shared memory, no barrier); larger blocks
//     (and sign re-encoded from rows): a "group" of W warps (W = min(8, block / 32)) encodes one
//     codec block held in shared memory; a 256-thread CTA holds 8 / W groups.
#pragma once

#include "../core/codec.h"
#include "../core/exact.h"
#include "../core/rng.h"
#include "kernels.cuh"

namespace flatcomm {
namespace gpu {
namespace kern {

using namespace ::flatcomm::core;
constexpr unsigned kFull = 0xffffffffu;

__device__ __forceinline__ int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
__device__ __forceinline__ int mini(int a, int b) { return a < b ? a : b; }

// ---- 4-element loads and stores ----------------------------------------------------------------
// Elements [i, i + cnt), cnt <= 4, i % 4 == 0. One vector access when vec && cnt == 4 (the caller
// checked the base pointer's alignment), else element by element; missing elements read as 0.

__device__ __forceinline__ void ld4f(const float* p, int64_t i, int cnt, bool vec, float v[4]) {
  if (vec && cnt == 4) {
    const float4 f = *reinterpret_cast<const float4*>(p + i);
    v[0] = f.x; v[1] = f.y; v[2] = f.z; v[3] = f.w;
  } else {
#pragma unroll
    for (int e = 0; e < 4; ++e) v[e] = e < cnt ? p[i + e] : 0.0f;
  }
}

__device__ __forceinline__ void st4f(float* p, int64_t i, int cnt, bool vec, const float v[4]) {
  if (vec && cnt == 4) {
    *reinterpret_cast<float4*>(p + i) = make_float4(v[0], v[1], v[2], v[3]);
  } else {
#pragma unroll
    for (int e = 0; e < 4; ++e)
      if (e < cnt) p[i + e] = v[e];
  }
}

__device__ __forceinline__ void ld4h(const uint16_t* p, int64_t i, int cnt, bool vec, uint16_t h[4]) {
  if (vec && cnt == 4) {
    const uint2 u = *reinterpret_cast<const uint2*>(p + i);  // little endian: element i in u.x low
    h[0] = static_cast<uint16_t>(u.x); h[1] = static_cast<uint16_t>(u.x >> 16);
    h[2] = static_cast<uint16_t>(u.y); h[3] = static_cast<uint16_t>(u.y >> 16);
  } else {
#pragma unroll
    for (int e = 0; e < 4; ++e) h[e] = e < cnt ? p[i + e] : static_cast<uint16_t>(0);
  }
}

__device__ __forceinline__ void st4h(uint16_t* p, int64_t i, int cnt, bool vec, const uint16_t h[4]) {
  if (vec && cnt == 4) {
    *reinterpret_cast<uint2*>(p + i) = make_uint2(static_cast<uint32_t>(h[0]) | (static_cast<uint32_t>(h[1]) << 16),
                                                  static_cast<uint32_t>(h[2]) | (static_cast<uint32_t>(h[3]) << 16));
  } else {
#pragma unroll
    for (int e = 0; e < 4; ++e)
      if (e < cnt) p[i + e] = h[e];
  }
}

__device__ __forceinline__ void ld4i(const int64_t* p, int64_t i, int cnt, bool vec, int64_t v[4]) {
  if (vec && cnt == 4) {
    const longlong2 a = *reinterpret_cast<const longlong2*>(p + i);
    const longlong2 b = *reinterpret_cast<const longlong2*>(p + i + 2);
    v[0] = a.x; v[1] = a.y; v[2] = b.x; v[3] = b.y;
  } else {
#pragma unroll
    for (int e = 0; e < 4; ++e) v[e] = e < cnt ? p[i + e] : 0;
  }
}

__device__ __forceinline__ void st4i(int64_t* p, int64_t i, int cnt, bool vec, const int64_t v[4]) {
  if (vec && cnt == 4) {
    *reinterpret_cast<longlong2*>(p + i) = make_longlong2(v[0], v[1]);
    *reinterpret_cast<longlong2*>(p + i + 2) = make_longlong2(v[2], v[3]);
  } else {
#pragma unroll
    for (int e = 0; e < 4; ++e)
      if (e < cnt) p[i + e] = v[e];
  }
}

// Typed element access (core::Elem conversions).
template <int DT>
__device__ __forceinline__ void load4(const void* x, int64_t i, int cnt, bool vec, float v[4]) {
  if constexpr (DT == kF32) {
    ld4f(static_cast<const float*>(x), i, cnt, vec, v);
  } else {
    uint16_t h[4];
    ld4h(static_cast<const uint16_t*>(x), i, cnt, vec, h);
#pragma unroll
    for (int e = 0; e < 4; ++e) v[e] = Elem<DT>::load(h[e]);
  }
}

template <int DT>
__device__ __forceinline__ void store4(void* o, int64_t i, int cnt, bool vec, const float v[4]) {
  if constexpr (DT == kF32) {
    st4f(static_cast<float*>(o), i, cnt, vec, v);
  } else {
    uint16_t h[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) h[e] = Elem<DT>::store(v[e]);
    st4h(static_cast<uint16_t*>(o), i, cnt, vec, h);
  }
}

// Shared-memory chunk access; v + j is 16-byte aligned for j % 4 == 0.
__device__ __forceinline__ void get4(const float* v, int j, int cnt, float f[4]) { ld4f(v, j, cnt, true, f); }
__device__ __forceinline__ void put4(float* v, int j, int cnt, const float f[4]) { st4f(v, j, cnt, true, f); }

// ---- decoding (non-topk codecs) -----------------------------------------------------------------

// Element i of one payload (any codec but topk), exactly as kernels_impl.h decode_range.
template <int C>
__device__ __forceinline__ float decode1(const uint8_t* p, int64_t codes_offset, int64_t block, int64_t i) {
  if constexpr (is_cast(C)) {
    using E = Elem<cast_dtype(C)>;
    return E::load(reinterpret_cast<const typename E::T*>(p)[i]);
  } else {
    const float s = reinterpret_cast<const float*>(p)[i / block];
    const uint8_t* codes = p + codes_offset;
    if constexpr (C == kCodecInt8) {
      return int_dequantize(int8_code(codes[i]), s);
    } else if constexpr (C == kCodecInt4) {
      return int_dequantize(int4_code(codes, i), s);
    } else {
      static_assert(C == kCodecSign, "topk is decoded by scatter, not per element");
      return sign_dequantize(sign_code(codes, i), s);
    }
  }
}

// Elements [i, i + cnt) of one payload. i % 4 == 0 and the block size is a multiple of 32, so the
// chunk lies in one codec block; with vec the payload start is 16-byte aligned.
template <int C>
__device__ __forceinline__ void decode4(const uint8_t* p, int64_t codes_offset, int64_t block, int64_t i,
                                        int cnt, bool vec, float d[4]) {
  if (!(vec && cnt == 4)) {
#pragma unroll
    for (int e = 0; e < 4; ++e) d[e] = e < cnt ? decode1<C>(p, codes_offset, block, i + e) : 0.0f;
    return;
  }
  if constexpr (is_cast(C)) {
    load4<cast_dtype(C)>(p, i, 4, true, d);
  } else {
    const float s = reinterpret_cast<const float*>(p)[i / block];
    const uint8_t* codes = p + codes_offset;  // codes_offset % 16 == 0
    if constexpr (C == kCodecInt8) {
      const uint32_t w = *reinterpret_cast<const uint32_t*>(codes + i);
#pragma unroll
      for (int e = 0; e < 4; ++e)
        d[e] = int_dequantize(int8_code(static_cast<uint8_t>(w >> (8 * e))), s);
    } else if constexpr (C == kCodecInt4) {
      const uint32_t w = *reinterpret_cast<const uint16_t*>(codes + (i >> 1));
      const uint8_t b0 = static_cast<uint8_t>(w), b1 = static_cast<uint8_t>(w >> 8);
      d[0] = int_dequantize(int4_lo(b0), s);
      d[1] = int_dequantize(int4_hi(b0), s);
      d[2] = int_dequantize(int4_lo(b1), s);
      d[3] = int_dequantize(int4_hi(b1), s);
    } else {
      static_assert(C == kCodecSign, "topk is decoded by scatter, not per element");
      const uint32_t bits = codes[i >> 3] >> (i & 7);  // i & 7 is 0 or 4
#pragma unroll
      for (int e = 0; e < 4; ++e) d[e] = sign_dequantize((bits >> e) & 1u, s);
    }
  }
}

// Elements [i, i + 16) of one payload, i % 16 == 0, all inside the tensor, the payload 16-byte
// aligned: each codec's codes in one load as wide as they allow (16 int8 codes in 16 bytes, 16 int4
// codes in 8, 16 sign bits in 2; values 16 bytes at a time), so a warp's load moves 512 bytes of
// int8 codes, not 128. The same values as four decode4 calls (16 | block: one scale).
template <int C>
__device__ __forceinline__ void decode16(const uint8_t* p, int64_t codes_offset, int64_t block, int64_t i,
                                         float d[16]) {
  if constexpr (is_cast(C)) {
#pragma unroll
    for (int q = 0; q < 4; ++q) load4<cast_dtype(C)>(p, i + 4 * q, 4, true, d + 4 * q);
  } else {
    const float s = reinterpret_cast<const float*>(p)[i / block];
    const uint8_t* codes = p + codes_offset;  // codes_offset % 16 == 0
    if constexpr (C == kCodecInt8) {
      const uint4 w = *reinterpret_cast<const uint4*>(codes + i);
      const uint32_t ws[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
      for (int e = 0; e < 16; ++e) d[e] = int_dequantize(int8_code(static_cast<uint8_t>(ws[e / 4] >> (8 * (e % 4)))), s);
    } else if constexpr (C == kCodecInt4) {
      const uint2 w = *reinterpret_cast<const uint2*>(codes + i / 2);
      const uint32_t ws[2] = {w.x, w.y};
#pragma unroll
      for (int b = 0; b < 8; ++b) {
        const uint8_t byte = static_cast<uint8_t>(ws[b / 4] >> (8 * (b % 4)));
        d[2 * b] = int_dequantize(int4_lo(byte), s);
        d[2 * b + 1] = int_dequantize(int4_hi(byte), s);
      }
    } else {
      static_assert(C == kCodecSign, "topk is decoded by scatter, not per element");
      const uint32_t bits = *reinterpret_cast<const uint16_t*>(codes + i / 8);
#pragma unroll
      for (int e = 0; e < 16; ++e) d[e] = sign_dequantize((bits >> e) & 1u, s);
    }
  }
}

// Decoded sum of all rows at elements [i, i + cnt): row 0 assigns, later rows add in ascending
// order, then the scale (kernels_impl.h decode_sum_tile).
template <int C>
__device__ __forceinline__ void decode_sum4(const DecodeSumArgs& a, int64_t codes_offset, int64_t i, int cnt,
                                            bool vec, float acc[4]) {
#pragma unroll
  for (int e = 0; e < 4; ++e) acc[e] = 0.0f;
  if (vec && cnt == 4) {
    // A whole aligned chunk: the row loop has no branch, and unrolled it keeps several rows' loads
    // in flight (the H200 timed decode_sum of 4 int8 rows at 0.46x copy_, one row's decode at
    // 0.86x). The adds keep their order.
#pragma unroll 4
    for (int64_t r = 0; r < a.rows; ++r) {
      float d[4];
      decode4<C>(a.payloads + r * a.row_stride, codes_offset, a.block, i, 4, true, d);
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[e] = r == 0 ? d[e] : acc[e] + d[e];
    }
  } else {
    for (int64_t r = 0; r < a.rows; ++r) {
      float d[4];
      decode4<C>(a.payloads + r * a.row_stride, codes_offset, a.block, i, cnt, vec, d);
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[e] = r == 0 ? d[e] : acc[e] + d[e];
    }
  }
  if (a.scale != 1.0f) {
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[e] = acc[e] * a.scale;
  }
}

// Elementwise kernels over 16-element chunks (decode16) when the launch found everything 16-byte
// aligned, then the rest (all of it otherwise) in 4-element chunks. Grid-stride loops.
template <int C, int ODT>
__global__ void __launch_bounds__(kThreads)
decode_kernel(const uint8_t* p, int64_t codes_offset, int64_t block, int64_t n, void* out, bool vec) {
  const int64_t tid = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t done = vec ? n / 16 * 16 : 0;
  for (int64_t i = 16 * tid; i < done; i += 16 * step) {
    float d[16];
    decode16<C>(p, codes_offset, block, i, d);
#pragma unroll
    for (int q = 0; q < 4; ++q) store4<ODT>(out, i + 4 * q, 4, true, d + 4 * q);
  }
  for (int64_t i = done + 4 * tid; i < n; i += 4 * step) {
    const int cnt = static_cast<int>(min64(4, n - i));
    float d[4];
    decode4<C>(p, codes_offset, block, i, cnt, vec, d);
    store4<ODT>(out, i, cnt, vec, d);
  }
}

// Row r of `rows` payloads (row_stride bytes apart, row_numel values each) into out elements
// [r * row_numel, ...), n in all: the last row may be cut short. Chunks of 4 lie in one row (chunk
// c: row c / per_row); with vec every row of out starts 16-byte aligned (the launch checks).
template <int C, int ODT>
__global__ void __launch_bounds__(kThreads)
decode_rows_kernel(const uint8_t* payloads, int64_t row_stride, int64_t rows, int64_t row_numel, int64_t n,
                   int64_t codes_offset, int64_t block, void* out, bool vec) {
  const int64_t per_row = ceil_div(row_numel, 4);
  const int64_t chunks = rows * per_row;
  for (int64_t c = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; c < chunks;
       c += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = c / per_row, i = 4 * (c - r * per_row);
    const int64_t len = min64(row_numel, n - r * row_numel);
    if (i >= len) continue;  // past the end of a cut last row
    const int cnt = static_cast<int>(min64(4, len - i));
    float d[4];
    decode4<C>(payloads + r * row_stride, codes_offset, block, i, cnt, vec, d);
    store4<ODT>(static_cast<char*>(out) + r * row_numel * dtype_bytes(ODT), i, cnt, vec, d);
  }
}

template <int C>
__global__ void __launch_bounds__(kThreads)
decode_sum_kernel(DecodeSumArgs a, int64_t codes_offset, bool vec) {
  const int64_t tid = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t done = vec ? a.n / 16 * 16 : 0;
  for (int64_t i = 16 * tid; i < done; i += 16 * step) {
    // decode_sum4's operations on 16 elements: row 0 assigns, later rows add in order (unrolled,
    // several rows' loads in flight), then the scale.
    float acc[16];
#pragma unroll
    for (int e = 0; e < 16; ++e) acc[e] = 0.0f;
#pragma unroll 4
    for (int64_t r = 0; r < a.rows; ++r) {
      float d[16];
      decode16<C>(a.payloads + r * a.row_stride, codes_offset, a.block, i, d);
#pragma unroll
      for (int e = 0; e < 16; ++e) acc[e] = r == 0 ? d[e] : acc[e] + d[e];
    }
    if (a.scale != 1.0f) {
#pragma unroll
      for (int e = 0; e < 16; ++e) acc[e] = acc[e] * a.scale;
    }
#pragma unroll
    for (int q = 0; q < 4; ++q) st4f(a.out, i + 4 * q, 4, true, acc + 4 * q);
  }
  for (int64_t i = done + 4 * tid; i < a.n; i += 4 * step) {
    const int cnt = static_cast<int>(min64(4, a.n - i));
    float acc[4];
    decode_sum4<C>(a, codes_offset, i, cnt, vec, acc);
    st4f(a.out, i, cnt, vec, acc);
  }
}

// ---- decoding topk: scatter into a shared-memory tile ----------------------------------------

// First entry e of the ascending index list with idx[e] >= target.
__device__ __forceinline__ int64_t lower_bound_idx(const uint32_t* idx, int64_t k, int64_t target) {
  int64_t lo = 0, hi = k;
  while (lo < hi) {
    const int64_t mid = (lo + hi) / 2;
    if (static_cast<int64_t>(idx[mid]) < target) lo = mid + 1; else hi = mid;
  }
  return lo;
}

// v[j] = (sum over rows of the topk payloads at element i0 + j) * scale for j < len, with the CPU's
// operations: zero, row 0 assigns its entries, later rows add theirs in ascending row order (an
// element absent from a row gets no "+ 0", which would turn -0 into +0).
// Called by every thread of the CTA (it synchronises); the threads [t, nt) of a group own v and
// range[0..2]; a group with len == 0 only takes part in the barriers.
//
// An invalid row (indices not strictly ascending, or not below n) is a peer's fault that only a
// host sync could report. Instead the tile is NaN: each entry in the tile's window [lo, hi) is
// checked against the tile and against its predecessor, and the last tile checks that no entry is
// left beyond n. lower_bound is monotone in its target for any array, so consecutive tiles' windows
// partition [0, k): every entry of every row is checked by exactly one tile, and nothing is ever
// written outside v[0, len). range[2] is the tile's sticky "bad" flag (NaN stays NaN in a sum).
__device__ __forceinline__ void topk_accumulate(float* v, int64_t i0, int len, int t, int nt, int64_t* range,
                                const uint8_t* payloads, int64_t row_stride, int64_t rows, int64_t n,
                                int64_t k, int64_t codes_offset, float scale) {
  for (int j = t; j < len; j += nt) v[j] = 0.0f;
  if (t == 0 && len > 0) range[2] = 0;
  for (int64_t r = 0; r < rows; ++r) {
    const uint8_t* p = payloads + r * row_stride;
    const uint32_t* idx = reinterpret_cast<const uint32_t*>(p);
    const float* val = reinterpret_cast<const float*>(p + codes_offset);
    if (t < 2 && len > 0) range[t] = lower_bound_idx(idx, k, i0 + (t == 0 ? 0 : len));
    __syncthreads();  // also orders the zeroing before the first scatter
    if (len > 0) {
      const int64_t lo = range[0], hi = range[1];
      // The window must be strictly ascending (from its predecessor on) and inside the tile before
      // anything is scattered: a neighbour check alone passes a garbage row such as 5, 3, 5 and two
      // threads would then write the same element (compute-sanitizer racecheck saw it).
      bool bad = t == 0 && i0 + len == n && hi != k;
      for (int64_t e = lo + t; e < hi; e += nt) {
        const int64_t j = static_cast<int64_t>(idx[e]) - i0;
        if (!(j >= 0 && j < len && (e == 0 || idx[e - 1] < idx[e]))) bad = true;
      }
      if (bad) range[2] = 1;  // every writer stores the same value
    }
    __syncthreads();  // the window checked; range[2] is final for this row
    if (len > 0 && range[2] == 0) {
      // Distinct indices: the threads of a row never touch the same element. A bad tile ends NaN
      // below whatever was scattered, so it skips the scatter.
      const int64_t lo = range[0], hi = range[1];
      for (int64_t e = lo + t; e < hi; e += nt) {
        const int64_t j = static_cast<int64_t>(idx[e]) - i0;
        v[j] = r == 0 ? val[e] : v[j] + val[e];
      }
    }
    __syncthreads();  // row r complete before row r + 1 (and before range is rewritten)
  }
  if (len > 0 && rows > 0 && range[2] != 0)
    for (int j = t; j < len; j += nt) v[j] = u2f(0x7fffffffu);
  else if (scale != 1.0f)
    for (int j = t; j < len; j += nt) v[j] = v[j] * scale;
}

template <int ODT>
__global__ void __launch_bounds__(kThreads)
topk_decode_kernel(const uint8_t* payloads, int64_t row_stride, int64_t rows, int64_t n, int64_t k,
                   int64_t codes_offset, float scale, void* out) {
  __shared__ float tile[kTopkTile];
  __shared__ int64_t range[3];
  auto* o = static_cast<typename Elem<ODT>::T*>(out);
  for (int64_t t0 = blockIdx.x * static_cast<int64_t>(kTopkTile); t0 < n;
       t0 += static_cast<int64_t>(gridDim.x) * kTopkTile) {
    const int len = static_cast<int>(min64(kTopkTile, n - t0));
    topk_accumulate(tile, t0, len, threadIdx.x, blockDim.x, range, payloads, row_stride, rows, n, k,
                    codes_offset, scale);
    __syncthreads();
    for (int j = threadIdx.x; j < len; j += blockDim.x) o[t0 + j] = Elem<ODT>::store(tile[j]);
    __syncthreads();  // the tile is reused by the next step
  }
}

// ---- chunked sparse (sparse, sparse4): one CTA per chunk ------------------------------------------
// Thread t of the CTA (sparse_threads(block) threads: 32 to 256) holds in-chunk positions
// [16 t, 16 t + 16) in registers, so each value is read once and written once. The selection is
// the CPU's (core/sparse.h sparse_encode_chunk): the k largest |v| bit patterns, ties to the lower
// position. The threshold comes from block-wide counts (a compare per value and a warp shuffle sum
// per round: no shared-memory histogram, whose atomics would pile onto the few bins that most
// values share); which method finds the k-th largest pattern does not change it. Kept values are
// ranked in position order by one packed block scan, the record's bits are ORed into shared memory
// and copied out, and the level table is the CPU's: each level's mean summed in double, in
// ascending position order, by one lane.

// Block-wide reductions for a CTA of whole warps. `sh` holds kWarps words; callers alternate
// between two such buffers, so one barrier per call suffices (a buffer is rewritten only after
// every thread has passed the next call's barrier, i.e. after it read the buffer).
__device__ __forceinline__ uint32_t cta_sum(uint32_t x, uint32_t* sh) {
#pragma unroll
  for (int w = 16; w > 0; w /= 2) x += __shfl_down_sync(kFull, x, w);
  if (threadIdx.x % 32 == 0) sh[threadIdx.x / 32] = x;
  __syncthreads();
  uint32_t s = 0;
  for (int w = 0; w < static_cast<int>(blockDim.x / 32); ++w) s += sh[w];
  return s;
}

__device__ __forceinline__ uint32_t cta_max(uint32_t x, uint32_t* sh) {
  x = __reduce_max_sync(kFull, x);
  if (threadIdx.x % 32 == 0) sh[threadIdx.x / 32] = x;
  __syncthreads();
  uint32_t m = 0;
  for (int w = 0; w < static_cast<int>(blockDim.x / 32); ++w) m = umax(m, sh[w]);
  return m;
}

// Exclusive prefix sum of x over the threads in index order; total = the sum over all.
__device__ __forceinline__ uint32_t cta_scan(uint32_t x, uint32_t* sh, uint32_t& total) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  uint32_t inc = x;
#pragma unroll
  for (int o = 1; o < 32; o *= 2) {
    const uint32_t y = __shfl_up_sync(kFull, inc, o);
    if (lane >= o) inc += y;
  }
  if (lane == 31) sh[warp] = inc;
  __syncthreads();
  uint32_t before = 0;
  total = 0;
  for (int w = 0; w < static_cast<int>(blockDim.x / 32); ++w) {
    if (w < warp) before += sh[w];
    total += sh[w];
  }
  return before + inc - x;
}

// ORs the w (<= 24) low bits of v into a zeroed little-endian bit stream of shared words at bit
// pos (core/sparse.h put_bits, word-wise: entries of different threads share words).
__device__ __forceinline__ void or_bits(uint32_t* words, int64_t pos, uint32_t v, int32_t w) {
  const uint64_t x = static_cast<uint64_t>(v & ((1u << w) - 1u)) << (pos & 31);
  if (static_cast<uint32_t>(x)) atomicOr(&words[pos >> 5], static_cast<uint32_t>(x));
  if (x >> 32) atomicOr(&words[(pos >> 5) + 1], static_cast<uint32_t>(x >> 32));
}

// The w (<= 32) bits of a little-endian byte stream at bit pos (core/sparse.h get_bits), reading
// only the bytes that hold them.
__device__ __forceinline__ uint32_t read_bits(const uint8_t* p, int64_t pos, int32_t w) {
  if (w <= 0) return 0;
  const int64_t b0 = pos >> 3, b1 = (pos + w - 1) >> 3;
  uint64_t x = 0;
  for (int64_t b = b1; b >= b0; --b) x = (x << 8) | p[b];
  x >>= (pos & 7);
  return static_cast<uint32_t>(w == 32 ? x : x & ((uint64_t{1} << w) - 1u));
}

// A record is built in shared memory: at most 3,072 bytes (chunk 4096, kept 4096, 4-bit codes).
constexpr int kSparseRecWords = 768;

template <int DT>
__global__ void __launch_bounds__(kThreads) sparse_encode_kernel(const void* xv, float* residual, uint8_t* payload,
                                                                 int64_t n, int32_t codec, int64_t block, int64_t k,
                                                                 int64_t codes_offset) {
  __shared__ float sval[kSparseMaxChunk];  // the kept values in position order
  __shared__ uint32_t recw[kSparseRecWords];
  __shared__ uint32_t red[2][kWarps];
  __shared__ float table[8];
  const SparseGeom g = sparse_geom(code_bits(codec), block, k);
  const int64_t nchunks = ceil_div(n, block);
  const int t = threadIdx.x;
  const int rec_words = static_cast<int>(ceil_div(g.rec_bytes, 4));
  const int64_t high0 = g.keep * g.low_bits;
  const uint32_t low_mask = (1u << g.low_bits) - 1u;
  // Chunks start at multiples of 32 elements and threads at multiples of 16: whole 4-element chunks
  // are 16-byte aligned when the bases are.
  const bool vec = ((reinterpret_cast<uintptr_t>(xv) | reinterpret_cast<uintptr_t>(residual)) & 15u) == 0;
  for (int64_t c = blockIdx.x; c < nchunks; c += gridDim.x) {  // CTA-uniform
    const int64_t c0 = c * block;
    const int m = static_cast<int>(min64(block, n - c0));
    const int kk = m < g.keep ? m : static_cast<int>(g.keep);
    const int j0 = kSparsePerThread * t;
    float* tables = reinterpret_cast<float*>(payload) + c * g.levels;
    uint8_t* rec = payload + codes_offset + c * g.rec_bytes;
    for (int w = t; w < rec_words; w += blockDim.x) recw[w] = 0;
    // v = x + residual (the CPU's v_at), all loads first; positions past the chunk read as 0.
    float v[kSparsePerThread];
#pragma unroll
    for (int q = 0; q < kSparsePerThread / 4; ++q) {
      const int j = j0 + 4 * q;
      const int cnt = j < m ? mini(4, m - j) : 0;
      if (cnt > 0) {
        load4<DT>(xv, c0 + j, cnt, vec, v + 4 * q);
        if (residual) {
          float r[4];
          ld4f(residual, c0 + j, cnt, vec, r);
#pragma unroll
          for (int e = 0; e < 4; ++e) v[4 * q + e] = v[4 * q + e] + r[e];
        }
      } else {
#pragma unroll
        for (int e = 0; e < 4; ++e) v[4 * q + e] = 0.0f;
      }
    }
    uint32_t ab[kSparsePerThread], tmax = 0;
#pragma unroll
    for (int e = 0; e < kSparsePerThread; ++e) {
      ab[e] = abs_bits(v[e]);
      tmax = umax(tmax, ab[e]);
    }
    const uint32_t mx = cta_max(tmax, red[0]);  // also orders the record's zeroing before any OR
    int buf = 1;
    if (!bits_finite(mx)) {  // non-finite rule: NaN table, positions 0..kk-1, zero codes, residual kept
      if (t < g.levels) tables[t] = u2f(0x7fc00000u);
      for (int e = t; e < kk; e += blockDim.x) {
        or_bits(recw, static_cast<int64_t>(e) * g.low_bits, static_cast<uint32_t>(e) & low_mask, g.low_bits);
        or_bits(recw, high0 + (e >> g.low_bits) + e, 1u, 1);
      }
    } else {
      // The threshold by bisection on the bit pattern: count(|v| bits >= lo) >= kk > count(>= hi).
      // It ends at hi = lo + 1 (T = lo, the kk-th largest pattern; `above` values lie above it and
      // the first kk - above equal to it are kept) or early, at a lo with exactly kk values at or
      // above it (all kept; T is then their smallest pattern).
      uint32_t lo = 0, hi = mx + 1, above = 0;
      bool exact = false;
      while (hi - lo > 1) {  // CTA-uniform: every thread computes the same bounds
        const uint32_t mid = lo + (hi - lo) / 2;  // >= 1: positions past the chunk (0) never count
        uint32_t cnt = 0;
#pragma unroll
        for (int e = 0; e < kSparsePerThread; ++e) cnt += ab[e] >= mid ? 1u : 0u;
        const uint32_t total = cta_sum(cnt, red[buf]);
        buf ^= 1;
        if (total == static_cast<uint32_t>(kk)) {
          lo = mid;
          exact = true;
          break;
        }
        if (total > static_cast<uint32_t>(kk)) {
          lo = mid;
        } else {
          hi = mid;
          above = total;
        }
      }
      // Kept: ab > gt, plus the first `ties` (in position order) with ab == gt.
      const uint32_t gt = exact ? lo - 1 : lo;
      const uint32_t ties = exact ? 0u : static_cast<uint32_t>(kk) - above;
      uint32_t T = lo;  // the smallest kept pattern: the levels' lower bound
      if (exact) {
        uint32_t x = 0;
#pragma unroll
        for (int e = 0; e < kSparsePerThread; ++e) x = umax(x, ab[e] >= lo ? ~ab[e] : 0u);
        T = ~cta_max(x, red[buf]);
        buf ^= 1;
      }
      // Ranks in position order: values above gt and values equal to it before this thread's first,
      // packed in one scan (each count <= 4096).
      uint32_t na = 0, nq = 0;
#pragma unroll
      for (int e = 0; e < kSparsePerThread; ++e) {
        const bool in = j0 + e < m;
        na += in && ab[e] > gt ? 1u : 0u;
        nq += in && ties && ab[e] == gt ? 1u : 0u;
      }
      uint32_t tot;
      const uint32_t before = cta_scan(na | (nq << 16), red[buf], tot);
      buf ^= 1;
      uint32_t kept = 0;  // bit e: position j0 + e is kept
      uint16_t rank[kSparsePerThread];
      {
        uint32_t ra = before & 0xffffu, rq = before >> 16;
        for (int e = 0; e < kSparsePerThread; ++e) {
          const bool in = j0 + e < m;
          const bool is_a = in && ab[e] > gt, is_q = in && ties && ab[e] == gt;
          rank[e] = static_cast<uint16_t>(ra + (rq < ties ? rq : ties));
          if (is_a || (is_q && rq < ties)) {
            kept |= 1u << e;
            sval[rank[e]] = v[e];
          }
          ra += is_a ? 1u : 0u;
          rq += is_q ? 1u : 0u;
        }
      }
      __syncthreads();  // sval complete
      // Levels: bin j of the kept patterns in [T, mx]; table[j] = the bin's mean, summed in double
      // in position order (sparse_encode_chunk), one level per lane.
      const uint64_t span = static_cast<uint64_t>(mx - T) + 1;
      if (t < g.levels) {
        double sum = 0.0;
        int64_t cnt = 0;
        for (int e = 0; e < kk; ++e) {
          const uint32_t b = abs_bits(sval[e]);
          if (static_cast<int32_t>((static_cast<uint64_t>(b - T) * g.levels) / span) == t) {
            sum += static_cast<double>(u2f(b));
            ++cnt;
          }
        }
        const float tv = cnt ? static_cast<float>(sum / static_cast<double>(cnt)) : 0.0f;
        table[t] = tv;
        tables[t] = tv;
      }
      __syncthreads();  // table complete
      // Record bits and the new residual: r = v - decoded for kept values, v for the rest.
      const int64_t code0 = 8 * g.idx_bytes;
      for (int e = 0; e < kSparsePerThread; ++e) {
        if (!((kept >> e) & 1u)) continue;
        const uint32_t pos = static_cast<uint32_t>(j0 + e), re = rank[e];
        const uint32_t j = static_cast<uint32_t>((static_cast<uint64_t>(ab[e] - T) * g.levels) / span);
        const uint32_t neg = f2u(v[e]) >> 31;
        const float d = neg ? -table[j] : table[j];
        or_bits(recw, static_cast<int64_t>(re) * g.low_bits, pos & low_mask, g.low_bits);
        or_bits(recw, high0 + (pos >> g.low_bits) + re, 1u, 1);
        or_bits(recw, code0 + static_cast<int64_t>(re) * g.bits, neg | (j << 1), g.bits);
        v[e] = v[e] - d;
      }
      if (residual) {
#pragma unroll
        for (int q = 0; q < kSparsePerThread / 4; ++q) {
          const int j = j0 + 4 * q;
          if (j < m) st4f(residual, c0 + j, mini(4, m - j), vec, v + 4 * q);
        }
      }
    }
    __syncthreads();  // the record's bits complete
    for (int64_t b = t; b < g.rec_bytes; b += blockDim.x) rec[b] = static_cast<uint8_t>(recw[b >> 2] >> (8 * (b & 3)));
    __syncthreads();  // shared memory is reused by the next chunk
  }
}

// out (n values of ODT) = the sum of `rows` payloads' chunks, row 0 assigned and later rows added in
// ascending order at their kept positions, then times `scale` (kernels_impl.h decode_sum_tile and
// decode_range_sparse). One CTA per chunk, summed in a shared tile: each row's record is parsed in
// parallel (thread t counts the set bits of its words of the high vector, a block scan gives each
// bit's entry number) and checked whole -- exactly `kept` entries, positions inside the chunk and
// strictly ascending, a valid table -- before anything is scattered (sparse_parse_chunk's rules).
// A chunk with a row that fails decodes to NaN (the CUDA ops cannot raise without a host sync:
// defined values instead, as topk); a non-finite chunk's NaN table fails the same way.
template <int ODT>
__global__ void __launch_bounds__(kThreads) sparse_decode_kernel(const uint8_t* payloads, int64_t row_stride,
                                                                 int64_t rows, int64_t n, int32_t codec, int64_t block,
                                                                 int64_t k, int64_t codes_offset, float scale,
                                                                 void* out) {
  using E = Elem<ODT>;
  __shared__ float tile[kSparseMaxChunk];
  __shared__ uint16_t spos[kSparseMaxChunk];
  __shared__ uint32_t red[2][kWarps];
  const SparseGeom g = sparse_geom(code_bits(codec), block, k);
  const int64_t nchunks = ceil_div(n, block);
  const int t = threadIdx.x, nt = blockDim.x;
  const int64_t high0 = g.keep * g.low_bits;
  const int words = static_cast<int>(ceil_div(g.high_bits, 32));
  const int wpt = static_cast<int>(ceil_div(words, nt));  // high-vector words per thread
  int buf = 0;
  for (int64_t c = blockIdx.x; c < nchunks; c += gridDim.x) {  // CTA-uniform
    const int64_t c0 = c * block;
    const int m = static_cast<int>(min64(block, n - c0));
    const int kk = m < g.keep ? m : static_cast<int>(g.keep);
    for (int j = t; j < m; j += nt) tile[j] = 0.0f;
    bool bad = false;  // CTA-uniform: from block reductions only
    for (int64_t r = 0; r < rows; ++r) {
      const uint8_t* p = payloads + r * row_stride;
      const float* table = reinterpret_cast<const float*>(p) + c * g.levels;
      const uint8_t* rec = p + codes_offset + c * g.rec_bytes;
      // Any NaN, inf or negative table entry fails the row (a non-finite chunk's all-NaN table too).
      uint32_t x = 0;
      if (t < g.levels) {
        const uint32_t b = f2u(table[t]);
        x = ((b & kAbsMask) >= kInfBits || (b >> 31 && (b & kAbsMask) != 0)) ? 1u << 16 : 0u;
      }
      const int w0 = t * wpt, w1 = mini(words, w0 + wpt);
      for (int w = w0; w < w1; ++w)
        x += static_cast<uint32_t>(popcount32(read_bits(rec, high0 + 32 * w, static_cast<int32_t>(min64(32, g.high_bits - 32 * w)))));
      uint32_t tot;
      uint32_t e = cta_scan(x, red[buf], tot) & 0xffffu;  // set bits before this thread's words (<= 8193)
      buf ^= 1;
      bool row_bad = (tot >> 16) != 0 || (tot & 0xffffu) != static_cast<uint32_t>(kk);
      if (!row_bad) {  // exactly kk entries: e < kk below
        uint32_t outside = 0;
        for (int w = w0; w < w1; ++w) {
          for (uint32_t bits = read_bits(rec, high0 + 32 * w, static_cast<int32_t>(min64(32, g.high_bits - 32 * w)));
               bits; bits &= bits - 1u) {
            const int64_t q = 32 * w + ctz32(bits);
            const int64_t pos = ((q - e) << g.low_bits) | read_bits(rec, static_cast<int64_t>(e) * g.low_bits, g.low_bits);
            if (pos < m) spos[e] = static_cast<uint16_t>(pos); else outside = 1;
            ++e;
          }
        }
        row_bad = cta_sum(outside, red[buf]) != 0;  // also: spos complete
        buf ^= 1;
        if (!row_bad) {
          uint32_t descending = 0;
          for (int i = t + 1; i < kk; i += nt) descending |= spos[i - 1] >= spos[i] ? 1u : 0u;
          row_bad = cta_sum(descending, red[buf]) != 0;
          buf ^= 1;
        }
      }
      if (row_bad) {  // sticky: the chunk ends NaN, whatever later rows hold
        bad = true;
        continue;
      }
      // Distinct positions: the threads of a row never touch the same element. Row r + 1's scans
      // (barriers) come before its scatter, so rows never overlap.
      const uint8_t* codes = rec + g.idx_bytes;
      for (int i = t; i < kk; i += nt) {
        const uint32_t code = read_bits(codes, static_cast<int64_t>(i) * g.bits, g.bits);
        const float a = table[code >> 1];
        const float val = (code & 1u) ? -a : a;
        float& o = tile[spos[i]];
        o = E::load(E::store(r == 0 ? val : o + val));  // out holds ODT values after every row
      }
    }
    __syncthreads();  // the tile complete
    auto* o = static_cast<typename E::T*>(out) + c0;
    for (int j = t; j < m; j += nt) {
      float val = bad ? u2f(0x7fc00000u) : tile[j];
      if (!bad && scale != 1.0f) val = val * scale;
      o[j] = E::store(val);
    }
    __syncthreads();  // shared memory is reused by the next chunk
  }
}

// ---- encoding (all codecs but topk) -----------------------------------------------------------

struct EncodeParams {
  uint8_t* payload;
  float* residual;        // or nullptr
  int64_t n;
  int64_t block;          // codec block (blockwise) or kCastTile (cast codecs)
  int64_t codes_offset;
  uint64_t key;           // seed_key(seed)
  int warps_per_group;    // W
  int groups;             // codec blocks per CTA step, 8 / W
  bool stochastic;        // only set for codecs with has_stochastic
  bool vec;               // x / payload rows, residual and payload are 16-byte aligned
};

// Where the values to encode come from: fill(v, ...) writes elements [i0, i0 + len) to v (shared).
// Every thread of the CTA calls fill; the group's threads [t, nt) share the work.
template <int DT>
struct XSource {  // encode: x
  const void* x;
  static constexpr bool kChunked = true;  // has chunk(): encode_kernel's register path can read it
  static constexpr bool kScalar = true;   // has one(): the sign register path reads element by element
  __device__ __forceinline__ float one(int64_t i) const {
    float f[4];
    load4<DT>(x, i, 1, false, f);
    return f[0];
  }
  // Elements [i, i + cnt), cnt <= 4, i % 4 == 0 (missing elements read as 0).
  __device__ __forceinline__ void chunk(float f[4], int64_t i, int cnt, bool vec) const {
    load4<DT>(x, i, cnt, vec, f);
  }
  __device__ __forceinline__ void fill(float* v, int64_t i0, int len, int t, int nt, int64_t*, bool vec) const {
    for (int j = 4 * t; j < len; j += 4 * nt) {
      const int cnt = mini(4, len - j);
      float f[4];
      load4<DT>(x, i0 + j, cnt, vec, f);
      put4(v, j, cnt, f);
    }
  }
};

template <int C>
struct SumSource {  // decode_sum_encode: the decoded sum of the rows
  DecodeSumArgs a;
  int64_t codes_offset;  // of the rows' layout
  static constexpr bool kChunked = C != kCodecTopK;  // topk rows only decode a whole window at once
  static constexpr bool kScalar = C != kCodecTopK;   // so sign re-encodes in registers too
  // Element i of the sum: decode_sum4's operations for one element (its unaligned form decodes
  // element by element through decode1 too).
  __device__ __forceinline__ float one(int64_t i) const {
    float acc = 0.0f;
    if constexpr (C != kCodecTopK) {
      for (int64_t r = 0; r < a.rows; ++r) {
        const float d = decode1<C>(a.payloads + r * a.row_stride, codes_offset, a.block, i);
        acc = r == 0 ? d : acc + d;
      }
      if (a.scale != 1.0f) acc = acc * a.scale;
    }
    return acc;
  }
  __device__ __forceinline__ void chunk(float f[4], int64_t i, int cnt, bool vec) const {
    decode_sum4<C>(a, codes_offset, i, cnt, vec, f);
  }
  __device__ __forceinline__ void fill(float* v, int64_t i0, int len, int t, int nt, int64_t* range,
                                       bool vec) const {
    if constexpr (C == kCodecTopK) {
      topk_accumulate(v, i0, len, t, nt, range, a.payloads, a.row_stride, a.rows, a.n, a.k, codes_offset,
                      a.scale);
    } else {
      for (int j = 4 * t; j < len; j += 4 * nt) {
        const int cnt = mini(4, len - j);
        float f[4];
        decode_sum4<C>(a, codes_offset, i0 + j, cnt, vec, f);
        put4(v, j, cnt, f);
      }
    }
  }
};

// Scaled-int codecs: the codes and new residual of v = source + residual at elements
// [i, i + cnt) of the tensor (cnt <= 4, i % 4 == 0; i counted from a block start), given its block's
// params. Mirrors kernels_impl.h encode_block.
template <int C>
__device__ __forceinline__ void int_encode4(const EncodeParams& p, const BlockParams& bp, int64_t i, int cnt,
                                            const float f[4]) {
  const float qmax = int_qmax(C);
  uint8_t* codes = p.payload + p.codes_offset;
  float q[4];
#pragma unroll
  for (int e = 0; e < 4; ++e)
    q[e] = p.stochastic ? int_quantize_stochastic(f[e], bp, qmax, random_unit(p.key, i + e))
                        : int_quantize(f[e], bp, qmax);
  if constexpr (C == kCodecInt8) {
    uint8_t* c = codes + i;  // 4-byte aligned
    if (p.vec && cnt == 4) {
      *reinterpret_cast<uint32_t*>(c) = int8_pack4(q);
    } else {
      for (int e = 0; e < cnt; ++e) c[e] = int8_pack(q[e]);
    }
  } else {
    static_assert(C == kCodecInt4, "a scaled integer codec without its packing here");
    uint8_t* c = codes + i / 2;  // 2-byte aligned
    if (p.vec && cnt == 4) {
      *reinterpret_cast<uint16_t*>(c) = int4_pack4(q);
    } else {
      // Only the block's (and tensor's) last chunk can be partial: an odd tail element pairs with
      // code 0, as on the CPU.
      for (int e = 0; e < cnt; e += 2) c[e / 2] = int4_pack(q[e], e + 1 < cnt ? q[e + 1] : 0.0f);
    }
  }
  if (p.residual && bp.finite) {
    float r[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) r[e] = f[e] - int_dequantize(q[e], bp.scale);
    st4f(p.residual, i, cnt, p.vec, r);
  }
}

// The sign code word of elements [i, i + 32) (i % 32 == 0, so 4-byte aligned), of which `rem` are
// in the block: a whole word when the launch found the payload aligned, else exactly the bytes the
// CPU writes.
__device__ __forceinline__ void store_sign_word(uint8_t* codes, int64_t i, int rem, uint32_t word, bool vec) {
  uint8_t* c = codes + i / 8;
  if (vec && rem >= 32) {
    *reinterpret_cast<uint32_t*>(c) = word;
  } else {
    store_code_bytes(c, word, rem >= 32 ? 4 : (rem + 7) / 8);
  }
}

// ---- encode_kernel's register path -------------------------------------------------------------
// Scaled-int codecs with blocks of up to kRegMaxBlock values and a source that reads in chunks: one
// warp per codec block, held in registers (lane l takes the 4-element chunks l, l + 32, ...). Every
// lane issues all its source and residual loads before using any (up to 2 x 4 x 16 bytes in
// flight), the block max is one __reduce_max_sync, and there is no shared memory and no
// __syncthreads: the shared-memory path costs 2-3 CTA barriers per block and, for block < 1024,
// leaves most of its threads idle (a thread takes 4 elements, the group has block / 32 threads).
// Sign blocks of up to kRegMaxBlock values read from x take a register path too (below).
// The launch (kernels.cu run_encode, cupy launches.py) gives both W = 1, groups = kWarps, no shared
// memory; they are correct for any groups (warps >= groups idle) and never read W.
template <int C, class Src>
FC_HD constexpr bool encode_in_registers(int64_t block) {
  return block <= kRegMaxBlock &&
         ((codec_kind(C) == CodecKind::kScaledInt && Src::kChunked) || (C == kCodecSign && Src::kScalar));
}

template <int C, class Src>
__device__ __forceinline__ void encode_blocks_in_registers(const EncodeParams& p, const Src& src) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  float* scales = reinterpret_cast<float*>(p.payload);
  const int64_t nblk = ceil_div(p.n, p.block);
  if (warp >= p.groups) return;  // no barrier below: a warp may leave
  // Warp-uniform loop (b depends on the warp only): every lane reaches the kFull reduction.
  for (int64_t b = blockIdx.x * static_cast<int64_t>(p.groups) + warp; b < nblk;
       b += static_cast<int64_t>(gridDim.x) * p.groups) {
    const int64_t i0 = b * p.block;
    const int len = static_cast<int>(min64(p.block, p.n - i0));
    float f[kRegChunks][4], r[kRegChunks][4];
    int cnt[kRegChunks];  // elements of the lane's chunk k; 0 past the block's end
#pragma unroll
    for (int k = 0; k < kRegChunks; ++k) {
      const int j = 4 * (lane + 32 * k);
      cnt[k] = j < len ? mini(4, len - j) : 0;
    }
    // All loads first, so they are in flight together.
#pragma unroll
    for (int k = 0; k < kRegChunks; ++k) {
      const int64_t i = i0 + 4 * (lane + 32 * k);
      if (cnt[k] > 0) {
        src.chunk(f[k], i, cnt[k], p.vec);
        if (p.residual) ld4f(p.residual, i, cnt[k], p.vec, r[k]);
      }
    }
    // v = source + residual (the CPU's `t = load(x); t = t + rb[j]`), and max |v| bits.
    uint32_t m = 0;
#pragma unroll
    for (int k = 0; k < kRegChunks; ++k) {
      if (cnt[k] > 0) {
        if (p.residual) {
#pragma unroll
          for (int e = 0; e < 4; ++e) f[k][e] = f[k][e] + r[k][e];
        }
#pragma unroll
        for (int e = 0; e < 4; ++e)
          if (e < cnt[k]) m = umax(m, abs_bits(f[k][e]));
      }
    }
    m = __reduce_max_sync(kFull, m);  // lanes without elements add 0
    const BlockParams bp = int_block_params(m, int_qmax(C));
    if (lane == 0) scales[b] = bp.scale;
#pragma unroll
    for (int k = 0; k < kRegChunks; ++k)
      if (cnt[k] > 0) int_encode4<C>(p, bp, i0 + 4 * (lane + 32 * k), cnt[k], f[k]);
  }
}

// Sign: one warp per block, lane l holding elements l, l + 32, ... (coalesced scalar loads, all
// issued before any is used). That is the CPU's fixed-order sum (core/codec.h): lane l adds its
// elements in turn, then lanes fold pairwise (lane j takes lane j + w, w = 16 ... 1); and the k-th
// ballot is the code word of elements [32k, 32k + 32). The same operations as the shared-memory
// path below, in the same order: the same bytes and residual bits.
template <class Src>
__device__ __forceinline__ void sign_blocks_in_registers(const EncodeParams& p, const Src& src) {
  constexpr int kPerLane = static_cast<int>(kRegMaxBlock / 32);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  float* scales = reinterpret_cast<float*>(p.payload);
  uint8_t* codes = p.payload + p.codes_offset;
  const int64_t nblk = ceil_div(p.n, p.block);
  if (warp >= p.groups) return;  // no barrier below: a warp may leave
  for (int64_t b = blockIdx.x * static_cast<int64_t>(p.groups) + warp; b < nblk;
       b += static_cast<int64_t>(gridDim.x) * p.groups) {  // warp-uniform, as above
    const int64_t i0 = b * p.block;
    const int len = static_cast<int>(min64(p.block, p.n - i0));
    float v[kPerLane], r[kPerLane];
#pragma unroll
    for (int k = 0; k < kPerLane; ++k) {
      const int j = lane + 32 * k;
      if (j < len) {
        v[k] = src.one(i0 + j);
        if (p.residual) r[k] = p.residual[i0 + j];
      }
    }
    uint32_t m = 0;
#pragma unroll
    for (int k = 0; k < kPerLane; ++k) {
      if (lane + 32 * k < len) {
        if (p.residual) v[k] = v[k] + r[k];
        m = umax(m, abs_bits(v[k]));
      }
    }
    m = __reduce_max_sync(kFull, m);
    const float pre = sign_sum_pre(m);
    float acc = 0.0f;
#pragma unroll
    for (int k = 0; k < kPerLane; ++k)
      if (lane + 32 * k < len) acc = acc + fabs_(v[k]) * pre;
#pragma unroll
    for (int w = 16; w > 0; w /= 2) acc = acc + __shfl_down_sync(kFull, acc, w);
    const BlockParams bp = sign_block_params(m, __shfl_sync(kFull, acc, 0), len);
    if (lane == 0) scales[b] = bp.scale;
#pragma unroll
    for (int k = 0; k < kPerLane; ++k) {
      const int w0 = 32 * k;
      if (w0 >= len) break;  // warp-uniform
      const bool in = lane + w0 < len;
      const uint32_t bit = in ? sign_bit(v[k]) : 0u;
      const uint32_t word = __ballot_sync(kFull, bit != 0u);
      if (lane == 0) store_sign_word(codes, i0 + w0, len - w0, word, p.vec);
      if (in && p.residual && bp.finite) p.residual[i0 + w0 + lane] = v[k] - sign_dequantize(bit, bp.scale);
    }
  }
}

// One CTA step encodes `groups` consecutive codec blocks (cast codecs: one tile of kCastTile).
// Passes over the block in shared memory: source + residual and max |v| bits; (sign) the fixed-order
// lane sum; codes, scale and new residual. Mirrors kernels_impl.h encode_block. Small scaled-int
// and sign blocks take the register paths above instead (uniform per launch).
template <int C, class Src>
__global__ void __launch_bounds__(kThreads) encode_kernel(EncodeParams p, Src src) {
  if constexpr (encode_in_registers<C, Src>(kRegMaxBlock)) {
    if (encode_in_registers<C, Src>(p.block)) {
      if constexpr (C == kCodecSign) {
        sign_blocks_in_registers(p, src);
      } else {
        encode_blocks_in_registers<C>(p, src);
      }
      return;
    }
  }
  extern __shared__ float4 smem_f4[];  // groups * block floats
  __shared__ uint32_t warp_max[kWarps];
  __shared__ float group_sum[kWarps];
  __shared__ int64_t ranges[3 * kWarps];  // per group: topk window and bad flag (topk_accumulate)

  constexpr bool kBlockwise = is_blockwise(C);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int W = p.warps_per_group;
  const int nt = 32 * W;  // threads per group
  const int g = warp / W;  // g >= p.groups: spare warps (8 % W of them) that only join barriers
  const int t = threadIdx.x - g * nt;
  const int gs = g < p.groups ? g : 0;  // a valid slot index for the spare warps
  float* v = reinterpret_cast<float*>(smem_f4) + gs * p.block;
  float* scales = reinterpret_cast<float*>(p.payload);
  uint8_t* codes = p.payload + p.codes_offset;
  const int64_t nblk = ceil_div(p.n, p.block);

  // The trip count is the same for all threads of the CTA, so the barriers inside are safe.
  for (int64_t first = blockIdx.x * static_cast<int64_t>(p.groups); first < nblk;
       first += static_cast<int64_t>(gridDim.x) * p.groups) {
    const int64_t b = first + g;
    const bool active = g < p.groups && b < nblk;
    const int64_t i0 = b * p.block;
    const int len = active ? static_cast<int>(min64(p.block, p.n - i0)) : 0;

    src.fill(v, i0, len, t, nt, ranges + 3 * gs, p.vec);
    __syncthreads();

    // v = source + residual (the CPU's `t = load(x); t = t + rb[j]`), and max |v| bits.
    uint32_t m = 0;
    for (int j = 4 * t; j < len; j += 4 * nt) {
      const int cnt = mini(4, len - j);
      float f[4];
      get4(v, j, cnt, f);
      if (p.residual) {
        float r[4];
        ld4f(p.residual, i0 + j, cnt, p.vec, r);
#pragma unroll
        for (int e = 0; e < 4; ++e) f[e] = f[e] + r[e];
        put4(v, j, cnt, f);
      }
#pragma unroll
      for (int e = 0; e < 4; ++e)
        if (e < cnt) m = umax(m, abs_bits(f[e]));
    }

    if constexpr (kBlockwise) {
      m = __reduce_max_sync(kFull, m);
      if (lane == 0) warp_max[warp] = m;
      __syncthreads();  // also makes every thread's v writes visible to the whole group
      if (g < p.groups)
        for (int w = 0; w < W; ++w) m = umax(m, warp_max[g * W + w]);
    } else {
      __syncthreads();
    }

    float sum = 0.0f;
    if constexpr (C == kCodecSign) {
      // Lane l of the group's first warp adds elements l, l + 32, ... in turn; then lanes fold
      // pairwise, lane j taking lane j + w for w = 16, 8, 4, 2, 1: the CPU's order (core/codec.h).
      if (t < 32) {  // warp-uniform: groups are whole warps
        const float pre = sign_sum_pre(m);
        float acc = 0.0f;
        for (int j = t; j < len; j += 32) acc = acc + fabs_(v[j]) * pre;
#pragma unroll
        for (int w = 16; w > 0; w /= 2) acc = acc + __shfl_down_sync(kFull, acc, w);
        if (t == 0 && g < p.groups) group_sum[g] = acc;
      }
      __syncthreads();
      if (g < p.groups) sum = group_sum[g];
    }

    if (active) {  // group-uniform
      if constexpr (codec_kind(C) == CodecKind::kScaledInt) {
        const BlockParams bp = int_block_params(m, int_qmax(C));
        if (t == 0) scales[b] = bp.scale;
        for (int j = 4 * t; j < len; j += 4 * nt) {
          const int cnt = mini(4, len - j);
          float f[4];
          get4(v, j, cnt, f);
          int_encode4<C>(p, bp, i0 + j, cnt, f);
        }
      } else if constexpr (C == kCodecSign) {
        const BlockParams bp = sign_block_params(m, sum, len);
        if (t == 0) scales[b] = bp.scale;
        const int wg = t / 32;  // warp within the group
        // One ballot per warp gives the 32 sign bits of elements [w0, w0 + 32): bit l is element
        // w0 + l, i.e. bit (i & 7) of byte i / 8 once stored little endian.
        for (int jj = 0; jj < len; jj += nt) {
          const int j = jj + t;
          const bool in = j < len;
          const float x = in ? v[j] : 0.0f;
          const uint32_t bit = in ? sign_bit(x) : 0u;
          const uint32_t word = __ballot_sync(kFull, bit != 0u);
          const int w0 = jj + 32 * wg;
          if (lane == 0 && w0 < len) store_sign_word(codes, i0 + w0, len - w0, word, p.vec);
          if (in && p.residual && bp.finite) p.residual[i0 + j] = x - sign_dequantize(bit, bp.scale);
        }
      } else {  // cast codecs, element by element (kernels_impl.h encode_block, first branch)
        for (int j = 4 * t; j < len; j += 4 * nt) {
          const int cnt = mini(4, len - j);
          float f[4], d[4], r[4];
          get4(v, j, cnt, f);
          using E = Elem<cast_dtype(C)>;
          if constexpr (cast_dtype(C) == kF32) {
#pragma unroll
            for (int e = 0; e < 4; ++e) d[e] = f[e];
            st4f(reinterpret_cast<float*>(p.payload), i0 + j, cnt, p.vec, d);
          } else {
            uint16_t h[4];
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              if constexpr (has_stochastic(C)) {
                h[e] = p.stochastic ? E::store_stochastic(f[e], random_u32(p.key, i0 + j + e)) : E::store(f[e]);
              } else {
                h[e] = E::store(f[e]);
              }
              d[e] = E::load(h[e]);
            }
            st4h(reinterpret_cast<uint16_t*>(p.payload), i0 + j, cnt, p.vec, h);
          }
          if (p.residual) {
            ld4f(p.residual, i0 + j, cnt, p.vec, r);  // the old residual, kept where d is not finite
#pragma unroll
            for (int e = 0; e < 4; ++e) r[e] = ef_residual(f[e], d[e], r[e], bits_finite(abs_bits(d[e])));
            st4f(p.residual, i0 + j, cnt, p.vec, r);
          }
        }
      }
    }
    __syncthreads();  // shared memory is reused by the next step
  }
}

// ---- topk encode: radix select on |v| bits, then an ordered compaction ---------------------------

struct TopkState {
  uint32_t prefix;  // the selected high bits so far
  uint32_t mask;    // which bits prefix covers
  long long need;   // how many still to take at or below prefix
  long long ncand;  // candidates appended by topk_compact (zeroed with the histograms)
};

// The CPU's three digit passes over the 31 bits of |v|: 11, 11 and 9 bits.
__host__ __device__ __forceinline__ int topk_shift(int pass) { return pass == 0 ? 20 : pass == 1 ? 9 : 0; }
__host__ __device__ __forceinline__ uint32_t topk_digits(int pass) { return pass == 2 ? 512u : 2048u; }

// Flushes a CTA's shared histogram into the global one.
__device__ __forceinline__ void flush_hist(const uint32_t* sh, unsigned long long* hist, uint32_t digits) {
  for (uint32_t d = threadIdx.x; d < digits; d += blockDim.x)
    if (sh[d]) atomicAdd(hist + d, static_cast<unsigned long long>(sh[d]));
}

// v = x + residual into scratch, and the histogram of pass 0 (bits 20..30 of |v|).
template <int DT>
__global__ void __launch_bounds__(kThreads)
topk_fill_kernel(const void* x, const float* residual, int64_t n, float* vout, unsigned long long* hist,
                 bool vec) {
  __shared__ uint32_t sh[kTopkBins];
  for (int d = threadIdx.x; d < kTopkBins; d += blockDim.x) sh[d] = 0;
  __syncthreads();
  const int64_t chunks = ceil_div(n, 4);
  for (int64_t c = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; c < chunks;
       c += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t i = 4 * c;
    const int cnt = static_cast<int>(min64(4, n - i));
    float f[4];
    load4<DT>(x, i, cnt, vec, f);
    if (residual) {
      float r[4];
      ld4f(residual, i, cnt, vec, r);
#pragma unroll
      for (int e = 0; e < 4; ++e) f[e] = f[e] + r[e];
    }
    st4f(vout, i, cnt, vec, f);
#pragma unroll
    for (int e = 0; e < 4; ++e)
      if (e < cnt) atomicAdd(&sh[abs_bits(f[e]) >> 20], 1u);
  }
  __syncthreads();
  flush_hist(sh, hist, kTopkBins);
}

// One CTA: the digit of this pass, as the CPU's scan from the top digit down: the largest d with
// S(d) = sum of hist[d'] for d' >= d at least `need`; then need -= S(d + 1).
__global__ void __launch_bounds__(kThreads)
topk_select_kernel(const unsigned long long* hist, int pass, long long k, TopkState* st) {
  __shared__ unsigned long long part[kThreads];
  const int shift = topk_shift(pass);
  const uint32_t digits = topk_digits(pass);
  uint32_t prefix = 0, mask = 0;
  long long need = k, ncand = 0;
  if (pass > 0) { prefix = st->prefix; mask = st->mask; need = st->need; ncand = st->ncand; }
  const uint32_t per = digits / kThreads;  // 8 or 2 bins per thread
  const uint32_t lo = threadIdx.x * per;
  unsigned long long local = 0;
  for (uint32_t d = lo; d < lo + per; ++d) local += hist[d];
  part[threadIdx.x] = local;
  __syncthreads();  // also: every thread has read st before it is rewritten below
  unsigned long long above = 0;  // count in the bins of the threads above this one
  for (int u = threadIdx.x + 1; u < kThreads; ++u) above += part[u];
  // The thread whose bins hold the chosen digit: S(lo + per) < need <= S(lo). With need == 0 the CPU
  // stops at the top digit, i.e. in the last thread.
  const long long A = static_cast<long long>(above);
  const bool mine = (A < need || threadIdx.x == kThreads - 1) && A + static_cast<long long>(local) >= need;
  if (mine) {
    long long s = A;  // S(d + 1)
    uint32_t d = lo + per - 1;
    for (;; --d) {
      const long long h = static_cast<long long>(hist[d]);
      if (s + h >= need || d == lo) break;
      s += h;
    }
    TopkState out;
    out.prefix = prefix | (d << shift);
    out.mask = mask | ((digits - 1) << shift);
    out.need = need - s;
    out.ncand = ncand;  // pass 0: 0, as the memset left it
    *st = out;
  }
}

__device__ __forceinline__ unsigned long long warp_sum_u64(unsigned long long x) {
#pragma unroll
  for (int w = 16; w > 0; w /= 2) x += __shfl_down_sync(kFull, x, w);
  return x;
}

// One CTA of 1024 threads: exclusive prefix sums of the per-chunk counts, in place.
__global__ void __launch_bounds__(kScanThreads) topk_scan_kernel(unsigned long long* counts, int64_t nchunks) {
  __shared__ unsigned long long sh[2][kScanThreads / 32];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  unsigned long long carry_gt = 0, carry_eq = 0;
  for (int64_t base = 0; base < nchunks; base += kScanThreads) {
    const int64_t c = base + threadIdx.x;
    const unsigned long long gt = c < nchunks ? counts[2 * c] : 0, eq = c < nchunks ? counts[2 * c + 1] : 0;
    unsigned long long x = gt, y = eq;  // inclusive scans within the warp
#pragma unroll
    for (int o = 1; o < 32; o *= 2) {
      const unsigned long long xs = __shfl_up_sync(kFull, x, o), ys = __shfl_up_sync(kFull, y, o);
      if (lane >= o) { x += xs; y += ys; }
    }
    if (lane == 31) { sh[0][warp] = x; sh[1][warp] = y; }
    __syncthreads();
    if (warp == 0) {  // inclusive scan of the 32 warp totals
      unsigned long long sx = sh[0][lane], sy = sh[1][lane];
#pragma unroll
      for (int o = 1; o < 32; o *= 2) {
        const unsigned long long xs = __shfl_up_sync(kFull, sx, o), ys = __shfl_up_sync(kFull, sy, o);
        if (lane >= o) { sx += xs; sy += ys; }
      }
      sh[0][lane] = sx;
      sh[1][lane] = sy;
    }
    __syncthreads();
    const unsigned long long wx = warp > 0 ? sh[0][warp - 1] : 0, wy = warp > 0 ? sh[1][warp - 1] : 0;
    if (c < nchunks) {
      counts[2 * c] = carry_gt + wx + x - gt;
      counts[2 * c + 1] = carry_eq + wy + y - eq;
    }
    carry_gt += sh[0][kScanThreads / 32 - 1];
    carry_eq += sh[1][kScanThreads / 32 - 1];
    __syncthreads();  // sh is rewritten by the next step
  }
}

// Per chunk of kTopkChunk elements: take every |v| above the threshold T and the first `need` (by
// index) equal to it, write them in index order at their global rank, and update the residual
// (kernels_impl.h encode_topk_impl, last loop). Thread t holds the 4-element pieces t, t + 256,
// t + 512 and t + 768 of the chunk (coalesced 16-byte loads); one block scan of the four pieces'
// packed (above, equal) counts ranks every element, so a chunk costs two barriers, not the four
// per 256 values of a rank per element.
constexpr int kTopkPieces = static_cast<int>(kTopkChunk / (4 * kThreads));
static_assert(kTopkPieces * 4 * kThreads == kTopkChunk, "a topk chunk is whole pieces of every thread");

__global__ void __launch_bounds__(kThreads)
topk_write_kernel(const float* v, int64_t n, const TopkState* st, const unsigned long long* counts,
                  uint32_t* idx, float* val, float* residual) {
  __shared__ uint32_t sh[kTopkPieces][kWarps];
  const uint32_t T = st->prefix;
  const long long need = st->need;
  const int64_t nchunks = ceil_div(n, kTopkChunk);
  const int t = threadIdx.x, lane = t % 32, warp = t / 32;
  const bool rvec = (reinterpret_cast<uintptr_t>(residual) & 15u) == 0;  // v (scratch) is aligned
  for (int64_t c = blockIdx.x; c < nchunks; c += gridDim.x) {
    const long long eq_before = static_cast<long long>(counts[2 * c + 1]);
    const long long taken_before = static_cast<long long>(counts[2 * c]) + (eq_before < need ? eq_before : need);
    const long long take_eq = need - eq_before;  // this chunk's equal values below it are taken
    const int64_t c0 = c * kTopkChunk, c1 = min64(n, c0 + kTopkChunk);
    float f[kTopkPieces][4];
    int cnt[kTopkPieces];
    uint32_t inc[kTopkPieces], mine[kTopkPieces];
#pragma unroll
    for (int q = 0; q < kTopkPieces; ++q) {
      const int64_t i = c0 + 4 * (t + kThreads * q);
      cnt[q] = i < c1 ? static_cast<int>(min64(4, c1 - i)) : 0;
      ld4f(v, i, cnt[q], true, f[q]);  // nothing read when cnt is 0
      uint32_t gt = 0, eq = 0;
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const uint32_t ab = abs_bits(f[q][e]);
        gt += e < cnt[q] && ab > T ? 1u : 0u;
        eq += e < cnt[q] && ab == T ? 1u : 0u;
      }
      mine[q] = gt | (eq << 16);  // each at most kTopkChunk
      inc[q] = mine[q];
#pragma unroll
      for (int o = 1; o < 32; o *= 2) {
        const uint32_t y = __shfl_up_sync(kFull, inc[q], o);
        if (lane >= o) inc[q] += y;
      }
      if (lane == 31) sh[q][warp] = inc[q];
    }
    __syncthreads();
    // Exclusive (above, equal) counts before each piece of this thread: the chunk's earlier pieces
    // (all of pieces q' < q, then warps before this one, then lanes).
    uint32_t base = 0;
#pragma unroll
    for (int q = 0; q < kTopkPieces; ++q) {
      uint32_t before = base + inc[q] - mine[q];
      for (int w = 0; w < kWarps; ++w) {
        if (w < warp) before += sh[q][w];
        base += sh[q][w];
      }
      long long na = before & 0xffffu, nq = before >> 16;
      const int64_t i = c0 + 4 * (t + kThreads * q);
      float r[4];
      bool all_finite = true;
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const uint32_t ab = abs_bits(f[q][e]);
        const bool in = e < cnt[q], is_gt = in && ab > T, is_eq = in && ab == T;
        const bool take = is_gt || (is_eq && nq < take_eq);
        if (take) {
          const long long pos = taken_before + na + (nq < take_eq ? nq : (take_eq > 0 ? take_eq : 0));
          idx[pos] = static_cast<uint32_t>(i + e);
          val[pos] = f[q][e];
        }
        // Sent values leave a zero residual, unsent ones carry over, non-finite keeps the old one.
        r[e] = take ? 0.0f : f[q][e];
        all_finite = all_finite && (!in || bits_finite(ab));
        na += is_gt ? 1 : 0;
        nq += is_eq ? 1 : 0;
      }
      if (residual && cnt[q] > 0) {
        if (all_finite) {
          st4f(residual, i, cnt[q], rvec, r);
        } else {
#pragma unroll
          for (int e = 0; e < 4; ++e)
            if (e < cnt[q] && bits_finite(abs_bits(f[q][e]))) residual[i + e] = r[e];
        }
      }
    }
    __syncthreads();  // sh is rewritten by the next chunk
  }
}

// After pass 0, one read of v: per chunk, how many values lie above the selected first digit (bits
// 20..30 of |v|; all of them are taken: the chunk's `above` count, its `equal` count zeroed), and
// the indices of the values in that digit (the candidates, appended in any order: they are only
// counted below) with the pass-1 histogram of their next 11 bits. Passes 1 and 2 and the per-chunk
// counts then read the candidates alone (hist0[d0] of them), not all of v twice more. Thread t holds
// the chunk's 4-element pieces t, t + 256, ... (as topk_write).
__global__ void __launch_bounds__(kThreads)
topk_compact_kernel(const float* v, int64_t n, TopkState* st, unsigned long long* counts, uint32_t* cand,
                    unsigned long long* hist) {
  __shared__ uint32_t sh[kTopkBins];
  __shared__ uint32_t part[kWarps];
  const uint32_t d0 = st->prefix >> 20;
  auto* ncand = reinterpret_cast<unsigned long long*>(&st->ncand);
  const int t = threadIdx.x, lane = t % 32, warp = t / 32;
  for (int d = t; d < kTopkBins; d += blockDim.x) sh[d] = 0;
  __syncthreads();
  const int64_t nchunks = ceil_div(n, kTopkChunk);
  for (int64_t c = blockIdx.x; c < nchunks; c += gridDim.x) {  // CTA-uniform
    const int64_t c0 = c * kTopkChunk, c1 = min64(n, c0 + kTopkChunk);
    uint32_t above = 0;
#pragma unroll
    for (int q = 0; q < kTopkPieces; ++q) {
      const int64_t i = c0 + 4 * (t + kThreads * q);
      const int cnt = i < c1 ? static_cast<int>(min64(4, c1 - i)) : 0;
      float f[4];
      ld4f(v, i, cnt, true, f);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const uint32_t ab = abs_bits(f[e]);
        above += e < cnt && (ab >> 20) > d0 ? 1u : 0u;
        const bool is_c = e < cnt && (ab >> 20) == d0;
        if (is_c) atomicAdd(&sh[(ab >> 9) & (kTopkBins - 1)], 1u);
        // One reservation per warp and value slot: the leader adds the warp's count.
        const uint32_t bal = __ballot_sync(kFull, is_c);
        if (bal) {  // warp-uniform
          unsigned long long at = 0;
          if (lane == 0) at = atomicAdd(ncand, static_cast<unsigned long long>(__popc(bal)));
          at = __shfl_sync(kFull, at, 0);
          if (is_c) cand[at + __popc(bal & ((1u << lane) - 1u))] = static_cast<uint32_t>(i + e);
        }
      }
    }
#pragma unroll
    for (int w = 16; w > 0; w /= 2) above += __shfl_down_sync(kFull, above, w);
    if (lane == 0) part[warp] = above;
    __syncthreads();
    if (t == 0) {
      unsigned long long total = 0;
      for (int w = 0; w < kWarps; ++w) total += part[w];
      counts[2 * c] = total;
      counts[2 * c + 1] = 0;
    }
    __syncthreads();  // part is rewritten by the next chunk
  }
  flush_hist(sh, hist, kTopkBins);  // the loop ended on a barrier: sh is complete
}

// Pass 2's histogram (bits 0..8) over the candidates that match the 22-bit prefix of pass 1.
__global__ void __launch_bounds__(kThreads)
topk_cand_hist_kernel(const float* v, const TopkState* st, const uint32_t* cand, unsigned long long* hist) {
  __shared__ uint32_t sh[kTopkBins];
  const uint32_t prefix = st->prefix, mask = st->mask;
  const int64_t m = st->ncand;
  const uint32_t digits = topk_digits(2);
  for (uint32_t d = threadIdx.x; d < digits; d += blockDim.x) sh[d] = 0;
  __syncthreads();
  for (int64_t j = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; j < m;
       j += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const uint32_t ab = abs_bits(v[cand[j]]);
    if ((ab & mask) == prefix) atomicAdd(&sh[ab & (digits - 1)], 1u);
  }
  __syncthreads();
  flush_hist(sh, hist, digits);
}

// The candidates' share of the per-chunk counts: above or equal to the final threshold T (values
// above the first digit were counted by topk_compact, values below it are below T).
__global__ void __launch_bounds__(kThreads)
topk_cand_count_kernel(const float* v, const TopkState* st, const uint32_t* cand, unsigned long long* counts) {
  const uint32_t T = st->prefix;
  const int64_t m = st->ncand;
  for (int64_t j = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; j < m;
       j += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const uint32_t i = cand[j];
    const uint32_t ab = abs_bits(v[i]);
    if (ab >= T) atomicAdd(counts + 2 * (i / kTopkChunk) + (ab == T ? 1 : 0), 1ull);
  }
}

// ---- ordered and exact sums -------------------------------------------------------------------

template <int DT>
__global__ void __launch_bounds__(kThreads) ordered_sum_kernel(OrderedSumArgs a, bool vec) {
  const int64_t chunks = ceil_div(a.n, 4);
  const int64_t esize = dtype_bytes(DT);
  const char* x = static_cast<const char*>(a.x);
  for (int64_t c = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; c < chunks;
       c += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t i = 4 * c;
    const int cnt = static_cast<int>(min64(4, a.n - i));
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int64_t r = 0; r < a.rows; ++r) {
      float f[4];
      load4<DT>(x + r * a.row_stride * esize, i, cnt, vec, f);
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[e] = r == 0 ? f[e] : acc[e] + f[e];
    }
    st4f(a.out, i, cnt, vec, acc);
  }
}

// Max |x| bits over all rows of codec block b (one warp).
template <int DT>
__device__ __forceinline__ uint32_t block_max_bits(const ExactArgs& a, int64_t i0, int len, int lane, bool vec) {
  const int64_t esize = dtype_bytes(DT);
  const char* x = static_cast<const char*>(a.x);
  uint32_t m = 0;
  for (int64_t r = 0; r < a.rows; ++r)
    for (int j = 4 * lane; j < len; j += 128) {
      const int cnt = mini(4, len - j);
      float f[4];
      load4<DT>(x + r * a.row_stride * esize, i0 + j, cnt, vec, f);
#pragma unroll
      for (int e = 0; e < 4; ++e)
        if (e < cnt) m = umax(m, abs_bits(f[e]));
    }
  return __reduce_max_sync(kFull, m);
}

// One warp per block (warp-uniform loop).
template <int DT>
__global__ void __launch_bounds__(kThreads) exact_exponents_kernel(ExactArgs a, bool vec) {
  const int lane = threadIdx.x % 32;
  const int64_t nblk = ceil_div(a.n, a.block);
  for (int64_t b = blockIdx.x * static_cast<int64_t>(kWarps) + threadIdx.x / 32; b < nblk;
       b += static_cast<int64_t>(gridDim.x) * kWarps) {
    const int64_t i0 = b * a.block;
    const uint32_t m = block_max_bits<DT>(a, i0, static_cast<int>(min64(a.block, a.n - i0)), lane, vec);
    if (lane == 0) a.exponents[b] = exponent_of_abs_bits(m);
  }
}

// exact_sum's output for elements [i, i + cnt) of a block from their int64 sums (kernels_impl.h
// from_fixed_block): 0 for an all-zero block, NaN for a non-finite one, else the hoisted from_fixed.
__device__ __forceinline__ void exact_out4(float* out, int64_t i, int cnt, bool vec, int32_t E, const FixedScale& sc,
                                           const uint64_t acc[4]) {
  float o[4];
#pragma unroll
  for (int e = 0; e < 4; ++e)
    o[e] = !exp_in_range(E) ? (E == kExpZero ? 0.0f : u2f(0x7fc00000u))
                            : from_fixed_in_block(static_cast<int64_t>(acc[e]), sc);
  st4f(out, i, cnt, vec, o);
}

// One codec block of exact_sum with every row's values in registers, so each value is read once
// (the H200 timed the two-pass form, which reads the block's rows again for the sums, at 0.48x
// copy_). Lane l holds chunk l + 32 k (k < CPL) of every row r < MAXR; CPL * 128 >= block and
// MAXR >= rows (the kernel checks). The same integer max, the same to_fixed_scaled terms and the
// same wrapping int64 sums as kernels_impl.h exact_sum_t: integer sums, so their order is free.
template <int DT, int MAXR, int CPL>
__device__ __forceinline__ void exact_block_in_registers(const ExactArgs& a, int64_t b, int64_t i0, int len,
                                                         int lane, bool vec) {
  const int64_t esize = dtype_bytes(DT);
  const char* x = static_cast<const char*>(a.x);
  float f[MAXR][CPL][4];
  int cnt[CPL];
#pragma unroll
  for (int k = 0; k < CPL; ++k) {
    const int j = 4 * (lane + 32 * k);
    cnt[k] = j < len ? mini(4, len - j) : 0;
  }
  // All loads first, so they are in flight together; missing elements read as 0 (no effect on max).
  uint32_t m = 0;
#pragma unroll
  for (int r = 0; r < MAXR; ++r)
#pragma unroll
    for (int k = 0; k < CPL; ++k) {
      if (r < a.rows && cnt[k] > 0) {
        load4<DT>(x + r * a.row_stride * esize, i0 + 4 * (lane + 32 * k), cnt[k], vec, f[r][k]);
      } else {
#pragma unroll
        for (int e = 0; e < 4; ++e) f[r][k][e] = 0.0f;
      }
    }
#pragma unroll
  for (int r = 0; r < MAXR; ++r)
#pragma unroll
    for (int k = 0; k < CPL; ++k)
#pragma unroll
      for (int e = 0; e < 4; ++e) m = umax(m, abs_bits(f[r][k][e]));
  m = __reduce_max_sync(kFull, m);
  const int32_t E = exponent_of_abs_bits(m);
  if (lane == 0 && a.exponents) a.exponents[b] = E;
  const bool special = exp_is_special(E);
  const ToFixedScale ts = to_fixed_scale(special ? 0 : E, a.precision);  // every value is below 2^E
  const FixedScale fs = fixed_scale(E, a.precision);
#pragma unroll
  for (int k = 0; k < CPL; ++k) {
    if (cnt[k] == 0) continue;
    uint64_t acc[4] = {0, 0, 0, 0};
    if (!special) {
#pragma unroll
      for (int r = 0; r < MAXR; ++r)
        if (r < a.rows) {
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[e] += static_cast<uint64_t>(to_fixed_scaled(f[r][k][e], ts));
        }
    }
    exact_out4(a.out, i0 + 4 * (lane + 32 * k), cnt[k], vec, E, fs, acc);
  }
}

// One warp per block (warp-uniform loop). Blocks of up to 512 values with few enough rows to fit
// 64 values per lane take the one-pass register form above; others read the rows twice (the max,
// then the sums).
template <int DT>
__global__ void __launch_bounds__(kThreads) exact_sum_kernel(ExactArgs a, bool vec) {
  const int lane = threadIdx.x % 32;
  const int64_t esize = dtype_bytes(DT);
  const char* x = static_cast<const char*>(a.x);
  const int64_t nblk = ceil_div(a.n, a.block);
  for (int64_t b = blockIdx.x * static_cast<int64_t>(kWarps) + threadIdx.x / 32; b < nblk;
       b += static_cast<int64_t>(gridDim.x) * kWarps) {
    const int64_t i0 = b * a.block;
    const int len = static_cast<int>(min64(a.block, a.n - i0));
    // Launch-uniform choices (block and rows are the same for every block).
    if (a.block <= 128 && a.rows <= 16) { exact_block_in_registers<DT, 16, 1>(a, b, i0, len, lane, vec); continue; }
    if (a.block <= 256 && a.rows <= 8) { exact_block_in_registers<DT, 8, 2>(a, b, i0, len, lane, vec); continue; }
    if (a.block <= 512 && a.rows <= 4) { exact_block_in_registers<DT, 4, 4>(a, b, i0, len, lane, vec); continue; }
    const int32_t E = exponent_of_abs_bits(block_max_bits<DT>(a, i0, len, lane, vec));
    if (lane == 0 && a.exponents) a.exponents[b] = E;
    const bool special = exp_is_special(E);
    const ToFixedScale ts = to_fixed_scale(special ? 0 : E, a.precision);
    const FixedScale fs = fixed_scale(E, a.precision);
    for (int j = 4 * lane; j < len; j += 128) {
      const int cnt = mini(4, len - j);
      // Integer sums: any order gives the same bits. Unsigned so that overflow (more than 2^headroom
      // rows) wraps as it does on the CPU instead of being undefined.
      uint64_t acc[4] = {0, 0, 0, 0};
      for (int64_t r = 0; !special && r < a.rows; ++r) {
        float f[4];
        load4<DT>(x + r * a.row_stride * esize, i0 + j, cnt, vec, f);
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[e] += static_cast<uint64_t>(to_fixed_scaled(f[e], ts));
      }
      exact_out4(a.out, i0 + j, cnt, vec, E, fs, acc);
    }
  }
}

template <int DT>
__global__ void __launch_bounds__(kThreads) to_fixed_kernel(ExactArgs a, unsigned long long* bad, bool vec) {
  const int64_t chunks = ceil_div(a.n, 4);
  unsigned long long nbad = 0;
  for (int64_t c = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; c < chunks;
       c += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t i = 4 * c;
    const int cnt = static_cast<int>(min64(4, a.n - i));
    float f[4];
    load4<DT>(a.x, i, cnt, vec, f);
    int64_t q[4] = {0, 0, 0, 0};
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      if (e < cnt) {
        const int32_t E = a.exponents[(i + e) / a.block];
        const int32_t ev = exponent_of_abs_bits(abs_bits(f[e]));
        nbad += (E != kExpNonFinite && (ev > E || !exp_valid(E))) ? 1 : 0;
        q[e] = to_fixed(f[e], E, a.precision);
      }
    }
    st4i(a.fixed, i, cnt, vec, q);
  }
  nbad = warp_sum_u64(nbad);
  if (threadIdx.x % 32 == 0 && nbad) atomicAdd(bad, nbad);
}

__global__ void __launch_bounds__(kThreads) from_fixed_kernel(ExactArgs a, bool vec) {
  const int64_t chunks = ceil_div(a.n, 4);
  for (int64_t c = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; c < chunks;
       c += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t i = 4 * c;
    const int cnt = static_cast<int>(min64(4, a.n - i));
    int64_t q[4];
    ld4i(a.fixed, i, cnt, vec, q);
    float o[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) o[e] = e < cnt ? from_fixed(q[e], a.exponents[(i + e) / a.block], a.precision) : 0.0f;
    st4f(a.out, i, cnt, vec, o);
  }
}

}  // namespace kern
}  // namespace gpu
}  // namespace flatcomm

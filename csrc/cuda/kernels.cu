// The CUDA kernels: torch-free, compiled by plain nvcc with -fmad=false.
//
// Every value is computed by the same csrc/core functions as on the CPU (kernels_impl.h), with the
// same operands in the same order, so the results are bitwise equal. Where the CPU reduces, the GPU
// either reduces integers (max of |v| bits, int64 fixed-point sums: order does not matter) or
// reproduces the CPU's order exactly (the sign codec's 32 lanes, ordered row sums). See README.md.
//
// This file is the host side: argument checks, launch shapes and the <<<>>> launches. The kernels
// themselves live in device.cuh, which NVRTC also compiles for the cupy path (see README.md).
#include <cuda_runtime.h>
#include <stdint.h>

#include "device.cuh"
#include "kernels.cuh"

namespace flatcomm {
namespace gpu {
namespace {

using namespace ::flatcomm::core;
using namespace ::flatcomm::gpu::kern;

// ---- host side ------------------------------------------------------------------------------------

bool al16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

unsigned grid_for(int64_t items, int64_t per_cta) {
  const int64_t g = ceil_div(items, per_cta);
  return static_cast<unsigned>(g < 1 ? 1 : g > kMaxGrid ? kMaxGrid : g);
}

bool valid_block(int32_t codec, int64_t block) {
  return !is_blockwise(codec) || (block >= kMinBlock && block <= kMaxBlock && block % 32 == 0);
}
// Chunked sparse codecs: the chunk (block) and the kept count k (core/sparse.h).
bool valid_sparse(int32_t codec, int64_t block, int64_t k) { return !is_chunk_sparse(codec) || sparse_args_ok(block, k); }
bool valid_topk(int64_t n, int64_t k) { return k >= 0 && k <= n && n <= kMaxTopkNumel; }
// Sizes beyond kMaxNumel would overflow layout() (the ops reject them first; so does every launch).
bool valid_numel(int64_t n) { return n <= kMaxNumel; }

template <int C, class Src>
cudaError_t run_encode(const EncodeArgs& a, const Src& src, bool vec, cudaStream_t s) {
  EncodeParams p;
  p.payload = a.payload;
  p.residual = a.residual;
  p.n = a.n;
  p.codes_offset = layout(C, a.n, a.block, a.k).codes_offset;
  p.key = seed_key(a.seed);
  p.stochastic = a.stochastic && has_stochastic(C);
  p.vec = vec && al16(a.payload) && (a.residual == nullptr || al16(a.residual));
  // encode_kernel's register path (small scaled-int blocks): one warp per codec block, no shared
  // memory. Otherwise W warps per block in shared memory.
  const bool regs = encode_in_registers<C, Src>(a.block);
  if (is_blockwise(C)) {
    p.block = a.block;
    p.warps_per_group = regs ? 1 : static_cast<int>(a.block / 32 < kWarps ? a.block / 32 : kWarps);
  } else {
    p.block = kCastTile;
    p.warps_per_group = kWarps;
  }
  p.groups = kWarps / p.warps_per_group;
  const size_t smem = regs ? 0 : static_cast<size_t>(p.groups) * p.block * sizeof(float);  // <= 16 KiB
  encode_kernel<C, Src><<<grid_for(ceil_div(a.n, p.block), p.groups), kThreads, smem, s>>>(p, src);
  return cudaGetLastError();
}

cudaError_t encode_topk(const EncodeArgs& a, cudaStream_t s) {
  if (!valid_dtype(a.x_dtype) || !valid_topk(a.n, a.k)) return cudaErrorInvalidValue;
  if (a.n == 0) return cudaSuccess;
  if (a.scratch == nullptr || !al16(a.scratch)) return cudaErrorInvalidValue;
  const TopkScratchLayout sl = topk_scratch_layout(a.n);
  uint8_t* base = reinterpret_cast<uint8_t*>(a.scratch);
  float* v = reinterpret_cast<float*>(base + sl.v);
  auto* hist = reinterpret_cast<unsigned long long*>(base + sl.hist);
  auto* st = reinterpret_cast<TopkState*>(base + sl.state);
  auto* counts = reinterpret_cast<unsigned long long*>(base + sl.counts);
  const int64_t nchunks = ceil_div(a.n, kTopkChunk);
  // The histograms and the state are contiguous: one memset clears them.
  cudaError_t err = cudaMemsetAsync(hist, 0, static_cast<size_t>(sl.counts - sl.hist), s);
  if (err != cudaSuccess) return err;
  const bool vec = al16(a.x) && (a.residual == nullptr || al16(a.residual));
  // Histogram kernels: few CTAs, so that few shared histograms are flushed with global atomics.
  const unsigned hist_grid = grid_for(a.n, 4 * kThreads) < 1024 ? grid_for(a.n, 4 * kThreads) : 1024;
  err = by_dtype(a.x_dtype, [&](auto dt) {
    topk_fill_kernel<decltype(dt)::value><<<hist_grid, kThreads, 0, s>>>(a.x, a.residual, a.n, v, hist, vec);
    return cudaGetLastError();
  });
  if (err != cudaSuccess) return err;
  // Pass 0 over v; then the candidates (the values in pass 0's digit) alone for passes 1 and 2 and
  // their share of the per-chunk counts, so v is read once more here and once by topk_write.
  auto* cand = reinterpret_cast<uint32_t*>(base + sl.cand);
  topk_select_kernel<<<1, kThreads, 0, s>>>(hist, 0, a.k, st);
  topk_compact_kernel<<<grid_for(nchunks, 1), kThreads, 0, s>>>(v, a.n, st, counts, cand, hist + kTopkBins);
  topk_select_kernel<<<1, kThreads, 0, s>>>(hist + kTopkBins, 1, a.k, st);
  topk_cand_hist_kernel<<<hist_grid, kThreads, 0, s>>>(v, st, cand, hist + 2 * kTopkBins);
  topk_select_kernel<<<1, kThreads, 0, s>>>(hist + 2 * kTopkBins, 2, a.k, st);
  topk_cand_count_kernel<<<hist_grid, kThreads, 0, s>>>(v, st, cand, counts);
  topk_scan_kernel<<<1, kScanThreads, 0, s>>>(counts, nchunks);
  const Layout L = layout(kCodecTopK, a.n, 0, a.k);
  topk_write_kernel<<<grid_for(nchunks, 1), kThreads, 0, s>>>(
      v, a.n, st, counts, reinterpret_cast<uint32_t*>(a.payload),
      reinterpret_cast<float*>(a.payload + L.codes_offset), a.residual);
  return cudaGetLastError();
}

cudaError_t encode(const EncodeArgs& a, cudaStream_t s) {
  if (a.codec == kCodecTopK) return encode_topk(a, s);
  if (!valid_dtype(a.x_dtype) || !valid_codec_id(a.codec) || !valid_block(a.codec, a.block) || !valid_numel(a.n))
    return cudaErrorInvalidValue;
  if (!valid_sparse(a.codec, a.block, a.k)) return cudaErrorInvalidValue;
  if (a.n <= 0) return cudaSuccess;
  const bool vec = al16(a.x);
  return by_dtype(a.x_dtype, [&](auto dt) {
    return by_codec(a.codec, [&](auto c) -> cudaError_t {
      constexpr int C = decltype(c)::value;
      if constexpr (C == kCodecTopK) {
        return cudaErrorInvalidValue;  // handled above
      } else if constexpr (is_chunk_sparse(C)) {
        const int64_t co = layout(C, a.n, a.block, a.k).codes_offset;
        sparse_encode_kernel<decltype(dt)::value><<<grid_for(ceil_div(a.n, a.block), 1), sparse_threads(a.block), 0, s>>>(
            a.x, a.residual, a.payload, a.n, C, a.block, a.k, co);
        return cudaGetLastError();
      } else {
        return run_encode<C>(a, XSource<decltype(dt)::value>{a.x}, vec, s);
      }
    });
  });
}

cudaError_t decode(const DecodeArgs& a, cudaStream_t s) {
  if (!valid_numel(a.n)) return cudaErrorInvalidValue;
  if (!valid_dtype(a.out_dtype) || !valid_codec_id(a.codec) || !valid_block(a.codec, a.block))
    return cudaErrorInvalidValue;
  if (a.codec == kCodecTopK && !valid_topk(a.n, a.k)) return cudaErrorInvalidValue;
  if (!valid_sparse(a.codec, a.block, a.k)) return cudaErrorInvalidValue;
  if (a.n <= 0) return cudaSuccess;
  const int64_t co = layout(a.codec, a.n, a.block, a.k).codes_offset;
  const bool vec = al16(a.payload) && al16(a.out);
  return by_dtype(a.out_dtype, [&](auto odt) {
    constexpr int ODT = decltype(odt)::value;
    return by_codec(a.codec, [&](auto c) -> cudaError_t {
      constexpr int C = decltype(c)::value;
      if constexpr (C == kCodecTopK) {
        topk_decode_kernel<ODT><<<grid_for(a.n, kTopkTile), kThreads, 0, s>>>(a.payload, 0, 1, a.n, a.k, co,
                                                                              1.0f, a.out);
      } else if constexpr (is_chunk_sparse(C)) {
        sparse_decode_kernel<ODT><<<grid_for(ceil_div(a.n, a.block), 1), sparse_threads(a.block), 0, s>>>(
            a.payload, 0, 1, a.n, C, a.block, a.k, co, 1.0f, a.out);
      } else {
        decode_kernel<C, ODT><<<grid_for(a.n, 16 * kThreads), kThreads, 0, s>>>(a.payload, co, a.block, a.n,
                                                                               a.out, vec);
      }
      return cudaGetLastError();
    });
  });
}

cudaError_t decode_rows(const DecodeRowsArgs& a, cudaStream_t s) {
  if (!valid_dtype(a.out_dtype) || !valid_codec_id(a.codec) || a.codec == kCodecTopK || is_chunk_sparse(a.codec) ||
      !valid_block(a.codec, a.block) || a.row_numel < 1 || !valid_numel(a.row_numel) || a.rows < 1 ||
      a.n < 1 || !valid_numel(a.n) || ceil_div(a.n, a.row_numel) != a.rows)
    return cudaErrorInvalidValue;
  const int64_t co = layout(a.codec, a.row_numel, a.block, 0).codes_offset;
  const bool vec = al16(a.payloads) && a.row_stride % 16 == 0 && al16(a.out) &&
                   (a.row_numel * dtype_bytes(a.out_dtype)) % 16 == 0;
  const unsigned grid = grid_for(a.rows * ceil_div(a.row_numel, 4), kThreads);
  return by_dtype(a.out_dtype, [&](auto odt) {
    constexpr int ODT = decltype(odt)::value;
    return by_codec(a.codec, [&](auto c) -> cudaError_t {
      constexpr int C = decltype(c)::value;
      if constexpr (C == kCodecTopK || is_chunk_sparse(C)) {
        return cudaErrorInvalidValue;  // rejected above
      } else {
        decode_rows_kernel<C, ODT><<<grid, kThreads, 0, s>>>(a.payloads, a.row_stride, a.rows, a.row_numel, a.n,
                                                            co, a.block, a.out, vec);
        return cudaGetLastError();
      }
    });
  });
}

bool rows_aligned(const DecodeSumArgs& a) { return al16(a.payloads) && a.row_stride % 16 == 0; }

cudaError_t decode_sum(const DecodeSumArgs& a, cudaStream_t s) {
  if (!valid_numel(a.n)) return cudaErrorInvalidValue;
  if (!valid_codec_id(a.codec) || !valid_block(a.codec, a.block) || a.rows < 0) return cudaErrorInvalidValue;
  if (a.codec == kCodecTopK && !valid_topk(a.n, a.k)) return cudaErrorInvalidValue;
  if (!valid_sparse(a.codec, a.block, a.k)) return cudaErrorInvalidValue;
  if (a.n <= 0) return cudaSuccess;
  const int64_t co = layout(a.codec, a.n, a.block, a.k).codes_offset;
  const bool vec = rows_aligned(a) && al16(a.out);
  return by_codec(a.codec, [&](auto c) -> cudaError_t {
    constexpr int C = decltype(c)::value;
    if constexpr (C == kCodecTopK) {
      topk_decode_kernel<kF32><<<grid_for(a.n, kTopkTile), kThreads, 0, s>>>(a.payloads, a.row_stride, a.rows,
                                                                             a.n, a.k, co, a.scale, a.out);
    } else if constexpr (is_chunk_sparse(C)) {
      sparse_decode_kernel<kF32><<<grid_for(ceil_div(a.n, a.block), 1), sparse_threads(a.block), 0, s>>>(
          a.payloads, a.row_stride, a.rows, a.n, C, a.block, a.k, co, a.scale, a.out);
    } else {
      decode_sum_kernel<C><<<grid_for(a.n, 16 * kThreads), kThreads, 0, s>>>(a, co, vec);
    }
    return cudaGetLastError();
  });
}

cudaError_t decode_sum_encode(const DecodeSumArgs& a, const EncodeArgs& enc, cudaStream_t s) {
  if (!valid_numel(a.n)) return cudaErrorInvalidValue;
  if (!valid_codec_id(a.codec) || !valid_block(a.codec, a.block) || a.rows < 0) return cudaErrorInvalidValue;
  if (a.codec == kCodecTopK && !valid_topk(a.n, a.k)) return cudaErrorInvalidValue;
  if (!valid_codec_id(enc.codec) || enc.codec == kCodecTopK || !valid_block(enc.codec, enc.block) || enc.n != a.n)
    return cudaErrorInvalidValue;
  if (is_chunk_sparse(a.codec) || is_chunk_sparse(enc.codec)) return cudaErrorInvalidValue;  // not fused yet
  if (a.n <= 0) return cudaSuccess;
  const int64_t co = layout(a.codec, a.n, a.block, a.k).codes_offset;
  const bool vec = rows_aligned(a);
  return by_codec(a.codec, [&](auto src_c) {
    constexpr int SC = decltype(src_c)::value;
    return by_codec(enc.codec, [&](auto c) -> cudaError_t {
      constexpr int C = decltype(c)::value;
      if constexpr (C == kCodecTopK || is_chunk_sparse(C) || is_chunk_sparse(SC)) {
        return cudaErrorInvalidValue;  // rejected above
      } else {
        return run_encode<C>(enc, SumSource<SC>{a, co}, vec, s);
      }
    });
  });
}

cudaError_t ordered_sum(const OrderedSumArgs& a, cudaStream_t s) {
  if (!valid_dtype(a.dtype) || a.rows < 0) return cudaErrorInvalidValue;
  if (a.n <= 0) return cudaSuccess;
  const bool vec = al16(a.x) && (a.row_stride * dtype_bytes(a.dtype)) % 16 == 0 && al16(a.out);
  return by_dtype(a.dtype, [&](auto dt) {
    ordered_sum_kernel<decltype(dt)::value><<<grid_for(a.n, 4 * kThreads), kThreads, 0, s>>>(a, vec);
    return cudaGetLastError();
  });
}

// Blocked x reads: the rows and the block starts must keep 16-byte alignment.
bool exact_x_aligned(const ExactArgs& a) {
  return al16(a.x) && (a.row_stride * dtype_bytes(a.dtype)) % 16 == 0 && a.block % 4 == 0;
}

cudaError_t exact_exponents(const ExactArgs& a, cudaStream_t s) {
  if (!valid_dtype(a.dtype) || a.block <= 0 || a.rows < 0) return cudaErrorInvalidValue;
  if (a.n <= 0) return cudaSuccess;
  const bool vec = exact_x_aligned(a);
  return by_dtype(a.dtype, [&](auto dt) {
    exact_exponents_kernel<decltype(dt)::value>
        <<<grid_for(ceil_div(a.n, a.block), kWarps), kThreads, 0, s>>>(a, vec);
    return cudaGetLastError();
  });
}

cudaError_t to_fixed_launch(const ExactArgs& a, int64_t* bad, cudaStream_t s) {
  if (!valid_dtype(a.dtype) || a.block <= 0 || bad == nullptr) return cudaErrorInvalidValue;
  cudaError_t err = cudaMemsetAsync(bad, 0, sizeof(int64_t), s);
  if (err != cudaSuccess || a.n <= 0) return err;
  const bool vec = al16(a.x) && al16(a.fixed);
  return by_dtype(a.dtype, [&](auto dt) {
    to_fixed_kernel<decltype(dt)::value><<<grid_for(a.n, 4 * kThreads), kThreads, 0, s>>>(
        a, reinterpret_cast<unsigned long long*>(bad), vec);
    return cudaGetLastError();
  });
}

cudaError_t from_fixed_launch(const ExactArgs& a, cudaStream_t s) {
  if (a.block <= 0) return cudaErrorInvalidValue;
  if (a.n <= 0) return cudaSuccess;
  const bool vec = al16(a.fixed) && al16(a.out);
  from_fixed_kernel<<<grid_for(a.n, 4 * kThreads), kThreads, 0, s>>>(a, vec);
  return cudaGetLastError();
}

cudaError_t exact_sum(const ExactArgs& a, cudaStream_t s) {
  if (!valid_dtype(a.dtype) || a.block <= 0 || a.rows < 0) return cudaErrorInvalidValue;
  if (a.n <= 0) return cudaSuccess;
  const bool vec = exact_x_aligned(a) && al16(a.out);
  return by_dtype(a.dtype, [&](auto dt) {
    exact_sum_kernel<decltype(dt)::value><<<grid_for(ceil_div(a.n, a.block), kWarps), kThreads, 0, s>>>(a, vec);
    return cudaGetLastError();
  });
}

}  // namespace

int launch_encode(const EncodeArgs& a, cudaStream_t s) { return static_cast<int>(encode(a, s)); }
int launch_encode_topk(const EncodeArgs& a, cudaStream_t s) {
  return static_cast<int>(a.codec == kCodecTopK ? encode_topk(a, s) : cudaErrorInvalidValue);
}
int launch_decode(const DecodeArgs& a, cudaStream_t s) { return static_cast<int>(decode(a, s)); }
int launch_decode_rows(const DecodeRowsArgs& a, cudaStream_t s) { return static_cast<int>(decode_rows(a, s)); }
int launch_decode_sum(const DecodeSumArgs& a, cudaStream_t s) {
  return static_cast<int>(decode_sum(a, s));
}
int launch_decode_sum_encode(const DecodeSumArgs& a, const EncodeArgs& enc, cudaStream_t s) {
  return static_cast<int>(decode_sum_encode(a, enc, s));
}
int launch_ordered_sum(const OrderedSumArgs& a, cudaStream_t s) {
  return static_cast<int>(ordered_sum(a, s));
}
int launch_exact_exponents(const ExactArgs& a, cudaStream_t s) {
  return static_cast<int>(exact_exponents(a, s));
}
int launch_to_fixed(const ExactArgs& a, int64_t* bad_count, cudaStream_t s) {
  return static_cast<int>(to_fixed_launch(a, bad_count, s));
}
int launch_from_fixed(const ExactArgs& a, cudaStream_t s) {
  return static_cast<int>(from_fixed_launch(a, s));
}
int launch_exact_sum(const ExactArgs& a, cudaStream_t s) { return static_cast<int>(exact_sum(a, s)); }

}  // namespace gpu
}  // namespace flatcomm

// Launch functions of the CUDA kernels (kernels.cu).
//
// This header is plain C++: it includes no CUDA header, so any .cpp compiled by g++ can include it
// (cudaStream_t is forward-declared exactly as the CUDA runtime declares it, which C++ allows to
// repeat). Every function launches whole-tensor work on stream `s`, never synchronises with the
// host and never allocates; it returns a cudaError_t value as an int (0 = cudaSuccess,
// 1 = cudaErrorInvalidValue for arguments it rejects, else the launch error).
//
// The argument structs are the CPU kernels' (csrc/core/kernel_args.h) with device pointers in
// them. The results are bitwise equal to the CPU kernels' on the same inputs (see README.md beside
// this file).
#pragma once
#include <stdint.h>

#include "../core/kernel_args.h"

typedef struct CUstream_st* cudaStream_t;

namespace flatcomm {
namespace gpu {

// ---- launch shapes ---------------------------------------------------------------------------
// Shared by the kernels (device.cuh), their launches (kernels.cu) and the cupy path's launches,
// which read them through flatcomm._C.constants().
constexpr int kThreads = 256;        // threads per CTA of every kernel but the topk scan
constexpr int kWarps = kThreads / 32;
constexpr int64_t kCastTile = 1024;  // elements per CTA step of the cast encoders (any size: same bits)
constexpr int kTopkTile = 2048;      // elements per CTA step of the topk decoders
constexpr int64_t kMaxGrid = 0x7fffffff;
constexpr int kScanThreads = 1024;   // the topk scan's single CTA
constexpr int kRegChunks = 4;        // 4-element chunks per lane on encode_kernel's register path
constexpr int64_t kRegMaxBlock = 32 * 4 * kRegChunks;  // its largest codec block: 512
constexpr int kSparsePerThread = 16;  // chunked sparse kernels: values per thread, one CTA per chunk

// Threads of a chunked sparse kernel's CTA for chunks of `block` values: whole warps, 16 values
// each, so 32 up to a chunk of 512 and 256 for the largest chunk (4096).
inline int sparse_threads(int64_t block) {
  const int64_t warps = (block + 32 * kSparsePerThread - 1) / (32 * kSparsePerThread);
  return static_cast<int>(32 * (warps < 1 ? 1 : warps));
}

// ---- topk scratch ----------------------------------------------------------------------------
// encode with codec topk needs EncodeArgs::scratch to point at topk_scratch_bytes(n) bytes of device
// memory, 16-byte aligned (any cudaMalloc / caching-allocator block is). Its contents on entry do not
// matter. Layout (each part starts on a 256-byte boundary):
//   v       n fp32: x + residual
//   hist    3 x 2048 uint64: the radix-select histograms
//   state   32 bytes: the select state (prefix, mask, need, candidate count)
//   counts  2 x uint64 per chunk of kTopkChunk elements
//   cand    n uint32: indices of the values in pass 0's selected digit (usually far fewer than n)
constexpr int64_t kTopkChunk = 4096;
constexpr int64_t kTopkBins = 2048;

struct TopkScratchLayout {
  int64_t v, hist, state, counts, cand, total;  // byte offsets, total size
};

inline TopkScratchLayout topk_scratch_layout(int64_t n) {
  auto up = [](int64_t b) { return (b + 255) / 256 * 256; };
  TopkScratchLayout l;
  l.v = 0;
  l.hist = up(4 * n);
  l.state = l.hist + 3 * kTopkBins * 8;
  l.counts = l.state + 256;
  l.cand = l.counts + up(16 * ((n + kTopkChunk - 1) / kTopkChunk));
  l.total = l.cand + up(4 * n);
  return l;
}

inline int64_t topk_scratch_bytes(int64_t n) { return topk_scratch_layout(n).total; }

// ---- launches --------------------------------------------------------------------------------
// Requirements beyond the CPU kernels' (a violation returns cudaErrorInvalidValue, launching nothing):
//   blockwise codecs: 32 <= block <= 4096, block % 32 == 0 (as the CPU assumes);
//   topk: 0 <= k <= n <= 2^32.

// Encode x (+ residual) into payload; any codec, topk included (then with the scratch above).
int launch_encode(const EncodeArgs& a, cudaStream_t s);
// Encode with codec topk only (launch_encode forwards to it).
int launch_encode_topk(const EncodeArgs& a, cudaStream_t s);
// Decode one payload into out (out_dtype f32, bf16 or f16).
int launch_decode(const DecodeArgs& a, cudaStream_t s);
// Row r of a.payloads into a.out elements [r * row_numel, min((r + 1) * row_numel, n)), one launch for
// all rows (out_dtype f32, bf16 or f16; not topk). Needs 1 <= row_numel, ceil(n / row_numel) == rows.
int launch_decode_rows(const DecodeRowsArgs& a, cudaStream_t s);
// Sum of the decoded rows in ascending row order, times scale, into out (fp32).
int launch_decode_sum(const DecodeSumArgs& a, cudaStream_t s);
// decode_sum, then encode the sum with `enc` (enc.x is ignored, a.out is not written);
// enc.codec must not be topk, and enc.n must equal a.n.
int launch_decode_sum_encode(const DecodeSumArgs& a, const EncodeArgs& enc,
                             cudaStream_t s);
// out = x[0] + x[1] + ... in ascending row order (fp32).
int launch_ordered_sum(const OrderedSumArgs& a, cudaStream_t s);
// exponents[b] = exponent of the max |x| over all rows of block b.
int launch_exact_exponents(const ExactArgs& a, cudaStream_t s);
// fixed[i] = to_fixed(x[i], exponents[i / block]) for row 0; *bad_count (device int64) is
// overwritten with the number of values that exceed their block's exponent.
int launch_to_fixed(const ExactArgs& a, int64_t* bad_count, cudaStream_t s);
// out[i] = from_fixed(fixed[i], exponents[i / block]).
int launch_from_fixed(const ExactArgs& a, cudaStream_t s);
// Exact sum over rows per block (exponents written too when a.exponents is not null).
int launch_exact_sum(const ExactArgs& a, cudaStream_t s);

}  // namespace gpu
}  // namespace flatcomm

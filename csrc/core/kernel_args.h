// The kernels' argument structs: one contract for every backend.
//
// Each op fills one of these once (csrc/ops_impl.h) and hands it to its device's kernels: the CPU
// loops (csrc/cpu), the CUDA launches (csrc/cuda/kernels.cu) and, through the same device.cuh, the
// NVRTC path (flatcomm/cupy_backend.py packs DecodeSumArgs, OrderedSumArgs and ExactArgs byte for
// byte; tests/test_nvrtc.py checks their offsets against the device). So they hold only pointers
// (host or device memory, whichever the backend uses), sizes and codec / dtype ids: no torch, no
// threads, nothing one backend alone needs.
#pragma once
#include "common.h"

namespace flatcomm {

struct EncodeArgs {
  const void* x;       // n values of x_dtype
  int32_t x_dtype;     // core::DType
  float* residual;     // n fp32 values updated in place, or nullptr (no error feedback)
  uint8_t* payload;    // layout(codec, n, block, k).total bytes
  int64_t n;
  int32_t codec;
  int64_t block;       // block size (blockwise codecs)
  int64_t k;           // kept count (topk)
  bool stochastic;
  uint64_t seed;
  float* scratch;      // topk only: the backend's scratch (CPU: n floats; CUDA: topk_scratch_bytes(n))
};

struct DecodeArgs {
  const uint8_t* payload;
  int64_t n;
  int32_t codec;
  int64_t block;
  int64_t k;
  void* out;           // n values of out_dtype
  int32_t out_dtype;
};

// Decode `rows` payloads (row r at payloads + r * row_stride bytes, each a whole payload of
// row_numel values) into consecutive stretches of one output: row r fills out elements
// [r * row_numel, min((r + 1) * row_numel, n)). n is in ((rows - 1) * row_numel, rows * row_numel]:
// the last row may be cut short (FSDP pads the last shard), and nothing past n is written.
struct DecodeRowsArgs {
  const uint8_t* payloads;
  int64_t row_stride;
  int64_t rows;
  int64_t row_numel;
  int32_t codec;       // not topk: every row's size must follow from row_numel
  int64_t block;
  void* out;           // n values of out_dtype
  int32_t out_dtype;
  int64_t n;
};

// Decode `rows` payloads (row r at payloads + r * row_stride) and sum them in ascending row order.
struct DecodeSumArgs {
  const uint8_t* payloads;
  int64_t row_stride;
  int64_t rows;
  int64_t n;
  int32_t codec;
  int64_t block;
  int64_t k;
  float scale;         // applied once to the final sum (1 = none)
  float* out;          // n fp32 values (decode_sum only)
};

struct OrderedSumArgs {
  const void* x;       // rows x n values of dtype, row r at x + r * row_stride elements
  int32_t dtype;
  int64_t rows;
  int64_t row_stride;
  int64_t n;
  float* out;
};

struct ExactArgs {
  const void* x;       // rows x n values of dtype (exponents, to_fixed, exact_sum)
  int32_t dtype;
  int64_t rows;
  int64_t row_stride;
  int64_t n;
  int64_t block;
  int32_t precision;   // P = 62 - headroom
  int32_t* exponents;  // one per block
  int64_t* fixed;      // n values (to_fixed output, from_fixed input)
  float* out;          // n values (from_fixed, exact_sum)
};

}  // namespace flatcomm

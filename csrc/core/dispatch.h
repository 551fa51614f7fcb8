// What the kernels and the ops know about each codec and each floating dtype, in one place: the
// two lists, their properties as constexpr functions of the id (usable on host and device, and as
// template arguments), and the dispatch from a runtime id to a template instance.
//
// FLATCOMM_CODECS is the codec list. Every id, name, property and switch over codec ids in csrc
// comes from it: the CPU loops (cpu/kernels_impl.h) and the CUDA launches (cuda/kernels.cu)
// dispatch with by_codec / by_dtype, the ops parse names with kCodecNames, and flatcomm._C's
// constants() hands the list to Python. What a codec computes is not here: its per-block math is in
// codec.h, its loops in cpu/kernels_impl.h and cuda/device.cuh.
//
// Torch-free and without a C++ library header: nvcc, NVRTC (the cupy path) and g++ compile it.
#pragma once
#include "common.h"

namespace flatcomm {
namespace core {

// ---- dtypes: what tensors hold -------------------------------------------------------------------

#define FLATCOMM_DTYPES(X) X(kF32) X(kBF16) X(kF16)

#define FC_DTYPE_ENUM(id) id,
enum DType : int32_t { kNoDType = -1, FLATCOMM_DTYPES(FC_DTYPE_ENUM) kNumDTypes };
#undef FC_DTYPE_ENUM

// Element loads and stores of each dtype: to and from fp32, round to nearest even.
template <int DT> struct Elem;
template <> struct Elem<kF32> {
  using T = float;
  FC_HD float load(T v) { return v; }
  FC_HD T store(float v) { return v; }
};
template <> struct Elem<kBF16> {
  using T = uint16_t;
  FC_HD float load(T v) { return bf16_to_f32(v); }
  FC_HD T store(float v) { return f32_to_bf16(v); }
  FC_HD T store_stochastic(float v, uint32_t rand) { return f32_to_bf16_stochastic(v, rand); }
};
template <> struct Elem<kF16> {
  using T = uint16_t;
  FC_HD float load(T v) { return f16_to_f32(v); }
  FC_HD T store(float v) { return f32_to_f16(v); }
};

FC_HD constexpr bool valid_dtype(int32_t dt) { return dt >= 0 && dt < kNumDTypes; }

FC_HD constexpr int64_t dtype_bytes(int32_t dt) {
  switch (dt) {
#define FC_DTYPE_BYTES(id) case id: return sizeof(Elem<id>::T);
    FLATCOMM_DTYPES(FC_DTYPE_BYTES)
#undef FC_DTYPE_BYTES
  }
  return 0;
}

// ---- codecs: what goes on the wire -----------------------------------------------------------------

enum class CodecKind : int32_t {
  kNone,        // not a codec id
  kCast,        // each value stored as `dtype` (payload: the values)
  kScaledInt,   // symmetric integer codes of `bits` bits times one fp32 scale per block
  kScaledSign,  // 1 bit per value (the sign) times the block's mean |v|
  kSparse,      // topk: the k largest |v|, as uint32 index + fp32 value
  kChunkSparse, // per chunk of `block` values the k largest |v|: coded positions + `bits`-bit codes
};

// One row per codec, in id order. The id is the row's position and goes on the wire (the
// collectives' consistency check), so a new codec is appended, never inserted.
//   bits:       cast: bits per value (its dtype's); scaled and chunked sparse: bits per code;
//               topk: per entry
//   stochastic: encode accepts stochastic=true (stochastic rounding)
//   dtype:      cast codecs: the DType of the stored values; others kNoDType
//  X(id,        name,   kind,        bits, stochastic, dtype)
#define FLATCOMM_CODECS(X)                                 \
  X(kCodecF32,  "fp32", kCast,        32,   false,      kF32)  \
  X(kCodecBF16, "bf16", kCast,        16,   true,       kBF16) \
  X(kCodecF16,  "fp16", kCast,        16,   false,      kF16)  \
  X(kCodecInt8, "int8", kScaledInt,    8,   true,       kNoDType) \
  X(kCodecInt4, "int4", kScaledInt,    4,   true,       kNoDType) \
  X(kCodecSign, "sign", kScaledSign,   1,   false,      kNoDType) \
  X(kCodecTopK, "topk", kSparse,      64,   false,      kNoDType) \
  X(kCodecSparse,  "sparse",  kChunkSparse, 2, false,   kNoDType) \
  X(kCodecSparse4, "sparse4", kChunkSparse, 4, false,   kNoDType) \
  X(kCodecSparse1, "sparse1", kChunkSparse, 1, false,   kNoDType)

#define FC_CODEC_ENUM(id, ...) id,
enum Codec : int32_t { FLATCOMM_CODECS(FC_CODEC_ENUM) kNumCodecs };
#undef FC_CODEC_ENUM

// The names users pass, indexed by id (host code: the ops and flatcomm._C).
#define FC_CODEC_NAME(id, name, ...) name,
constexpr const char* kCodecNames[] = {FLATCOMM_CODECS(FC_CODEC_NAME)};
#undef FC_CODEC_NAME

struct CodecInfo {
  CodecKind kind;
  int32_t bits;
  bool stochastic;
  int32_t dtype;
};

FC_HD constexpr CodecInfo codec_info(int32_t c) {
  switch (c) {
#define FC_CODEC_INFO(id, name, kind, bits, stochastic, dtype) \
  case id: return CodecInfo{CodecKind::kind, bits, stochastic, dtype};
    FLATCOMM_CODECS(FC_CODEC_INFO)
#undef FC_CODEC_INFO
  }
  return CodecInfo{CodecKind::kNone, 0, false, kNoDType};
}

FC_HD constexpr CodecKind codec_kind(int32_t c) { return codec_info(c).kind; }
FC_HD constexpr bool valid_codec_id(int32_t c) { return codec_kind(c) != CodecKind::kNone; }
FC_HD constexpr bool is_cast(int32_t c) { return codec_kind(c) == CodecKind::kCast; }
// One fp32 scale per block of `block_size` values (the block size is a parameter of the payload).
FC_HD constexpr bool is_blockwise(int32_t c) {
  return codec_kind(c) == CodecKind::kScaledInt || codec_kind(c) == CodecKind::kScaledSign;
}
// Per chunk of `block` values the k largest |v| (core/sparse.h): "sparse", "sparse4", "sparse1".
FC_HD constexpr bool is_chunk_sparse(int32_t c) { return codec_kind(c) == CodecKind::kChunkSparse; }
FC_HD constexpr bool has_stochastic(int32_t c) { return codec_info(c).stochastic; }
FC_HD constexpr int32_t code_bits(int32_t c) { return codec_info(c).bits; }      // scaled codecs
FC_HD constexpr int64_t cast_bytes(int32_t c) { return codec_info(c).bits / 8; }  // cast codecs
FC_HD constexpr int32_t cast_dtype(int32_t c) { return codec_info(c).dtype; }     // cast codecs

#define FC_CODEC_CHECK(id, name, kind, bits, stochastic, dtype)                                    \
  static_assert(CodecKind::kind != CodecKind::kCast || (valid_dtype(dtype) && bits == 8 * dtype_bytes(dtype)), \
                "a cast codec stores a dtype, of its width");                                    \
  static_assert(CodecKind::kind == CodecKind::kCast || dtype == kNoDType, "only cast codecs store a dtype");
FLATCOMM_CODECS(FC_CODEC_CHECK)
#undef FC_CODEC_CHECK

// ---- dispatch: a runtime id to a template instance ---------------------------------------------------
// by_codec(c, f) calls f(IdC<C>()) for the codec id c (by_dtype likewise for a dtype id), so f can
// instantiate templates on decltype(arg)::value. An id that is not in the list calls nothing and
// returns a value-initialised result: callers check valid_codec_id / valid_dtype first. Host code
// (the CPU kernels and the CUDA launches); device code is instantiated per codec already.

template <int V>
struct IdC {
  static constexpr int value = V;
};

template <class F>
static inline decltype(auto) by_codec(int32_t c, F&& f) {
  switch (c) {
#define FC_CODEC_CASE(id, ...) case id: return f(IdC<id>());
    FLATCOMM_CODECS(FC_CODEC_CASE)
#undef FC_CODEC_CASE
  }
  return decltype(f(IdC<0>()))();
}

template <class F>
static inline decltype(auto) by_dtype(int32_t dt, F&& f) {
  switch (dt) {
#define FC_DTYPE_CASE(id) case id: return f(IdC<id>());
    FLATCOMM_DTYPES(FC_DTYPE_CASE)
#undef FC_DTYPE_CASE
  }
  return decltype(f(IdC<0>()))();
}

}  // namespace core
}  // namespace flatcomm

// Every op schema of flatcomm, in one place, plus the small non-tensor helpers exposed through
// pybind11 (build information, payload sizes and layouts, kernel selection for tests, and the
// constants and layout math that flatcomm/cupy_backend.py launches the CUDA kernels with, so that
// Python never keeps a copy of them).
#include <torch/extension.h>
#include <torch/library.h>
#include <ATen/Parallel.h>

#include "core/rng.h"
#include "cpu/kernels.h"
#include "comm/lane.h"
#include "comm/native_work.h"
#include "cuda/kernels.cuh"  // plain C++: the launch shapes and the topk scratch layout
#include "ops_common.h"

TORCH_LIBRARY(flatcomm, m) {
  m.def("encode(Tensor x, str codec, int block_size, int k, Tensor(a!)? residual, bool stochastic, "
        "int seed) -> Tensor");
  m.def("decode(Tensor payload, str codec, int numel, int block_size, int k, ScalarType dtype) "
        "-> Tensor");
  m.def("decode_sum(Tensor payloads, str codec, int numel, int block_size, int k, float scale) "
        "-> Tensor");
  m.def("decode_sum_encode(Tensor payloads, str codec, int numel, int block_size, int k, "
        "float scale, str out_codec, int out_block_size, Tensor(a!)? residual, bool stochastic, "
        "int seed) -> Tensor");
  // Out variants: write into caller-owned buffers (e.g. slots of a collective's send buffer), so
  // the hot path allocates nothing. The functional ops above are these plus an allocation.
  m.def("encode_into(Tensor x, str codec, int block_size, int k, Tensor(a!)? residual, "
        "bool stochastic, int seed, Tensor(b!) payload) -> ()");
  m.def("decode_into(Tensor payload, str codec, int numel, int block_size, int k, Tensor(a!) out) "
        "-> ()");
  // Row r of payloads (a [rows, bytes] stack of whole payloads of row_numel values, e.g. gathered
  // shards) decoded into out[r * row_numel, ...) in out's dtype, cut at out's end; not topk.
  m.def("decode_rows_into(Tensor payloads, str codec, int row_numel, int block_size, Tensor(a!) out) -> ()");
  m.def("decode_sum_into(Tensor payloads, str codec, int numel, int block_size, int k, float scale, "
        "Tensor(a!) out) -> ()");
  m.def("decode_sum_encode_into(Tensor payloads, str codec, int numel, int block_size, int k, "
        "float scale, str out_codec, int out_block_size, Tensor(a!)? residual, bool stochastic, "
        "int seed, Tensor(b!) payload) -> ()");
  m.def("ordered_sum(Tensor x) -> Tensor");
  m.def("exact_exponents(Tensor x, int block_size) -> Tensor");
  m.def("to_exact(Tensor x, Tensor exponents, int block_size, int headroom) -> Tensor");
  m.def("from_exact(Tensor acc, Tensor exponents, int block_size, int headroom) -> Tensor");
  m.def("exact_sum(Tensor x, int block_size, int headroom) -> Tensor");
  // The lossless fp32 all-reduce of a CPU group's point-to-point path (comm/p2p_all_reduce.cpp):
  // the registered process group `group`, chunk j of rank d's shard at
  // flat[pieces[d * (chunks + 1) + j], pieces[d * (chunks + 1) + j + 1]), the peers' pieces of
  // this rank's shard received into scratch; its transfers tagged tag_base + 1, + 2, ... CPU only.
  // Each piece summed in rank order, or (exact_block > 0: exact mode) with exact_sum.
  m.def("p2p_sum_all_reduce_(Tensor(a!) flat, Tensor(b!) scratch, str group, int[] pieces, int chunks, "
        "float scale, int tag_base=0, int exact_block=0, int headroom=0) -> ()");
  // An early call's header (comm/header_watch.cpp): once `work` completes, when the first `width`
  // values of a row of `table` differ from `mine`, flatcomm.comm.header.on_disagreement(token).
  m.def("watch_header(__torch__.torch.classes.c10d.Work work, Tensor table, Tensor mine, int width, int token) -> ()");
  // A call header's exchange (comm/header_watch.cpp): this rank's row `mine` gathered from every rank
  // of `group` into `table` (one row per rank), on the group's CPU backend, through tensors made in C++.
  m.def("gather_header(__torch__.torch.classes.c10d.ProcessGroup group, Tensor(a!) table, Tensor mine) -> "
        "__torch__.torch.classes.c10d.Work");
  // An agreed early all-reduce on the group's native lane `lane` (comm/lane.cpp): p2p_sum_all_reduce_'s
  // arguments (the scratch is the lane's), then the call header: this rank's row `mine`, gathered
  // into `table` (posted here) and watched as watch_header's. The Work completes with [out] once the
  // op ran and the rows agreed.
  m.def("lane_all_reduce(Tensor(a!) flat, Tensor out, str group, int[] pieces, int chunks, float scale, "
        "int tag_base, Tensor(b!) table, Tensor mine, int width, int token, int lane, int exact_block=0, "
        "int headroom=0) -> __torch__.torch.classes.c10d.Work");
  // A small all-reduce in one exchange (comm/slot_all_reduce.cpp): flat's values copied into this
  // rank's row `mine` at byte slot_offset, every rank's row gathered into `table`; once the rows agree
  // (their first `width` values), the payloads summed into flat, times scale: in rank order in fp32
  // (fp32, bf16, fp16 values: each in its dtype on the wire), or with exact_sum(block exact_block,
  // headroom) where exact_block > 0 (fp32, bf16, fp16). The Work completes with [out].
  m.def("slot_all_reduce(Tensor(a!) flat, Tensor out, str group, Tensor(b!) table, Tensor(c!) mine, int width, "
        "int slot_offset, float scale, int token, int lane, int exact_block=0, int headroom=0) -> "
        "__torch__.torch.classes.c10d.Work");
}

#define FLATCOMM_STRINGIFY_(x) #x
#define FLATCOMM_STRINGIFY(x) FLATCOMM_STRINGIFY_(x)

namespace {

pybind11::dict build_info() {
  pybind11::dict d;
  pybind11::list devices;
  devices.append("cpu");
#ifdef FLATCOMM_WITH_CUDA
  devices.append("cuda");
  d["cuda_arch_list"] = FLATCOMM_STRINGIFY(FLATCOMM_CUDA_ARCHS);
#endif
  d["devices"] = devices;
  d["simd"] = flatcomm::cpu::kernels().isa;
  d["simd_supported"] = flatcomm::cpu::supported_isas();
  d["threads"] = at::get_num_threads();
#ifdef _OPENMP
  d["openmp"] = true;
#else
  d["openmp"] = false;
#endif
#if defined(__clang__)
  d["compiler"] = std::string("clang ") + __clang_version__;
#elif defined(__GNUC__)
  d["compiler"] = std::string("gcc ") + __VERSION__;
#endif
  d["fp_contract"] = "off";
  return d;
}

namespace core = flatcomm::core;
namespace gpu = flatcomm::gpu;

// Arguments every launch accepts (kernels.cu checks the same): within them no size overflows.
bool launchable(int32_t codec, int64_t n, int64_t block, int64_t k) {
  if (!core::valid_codec_id(codec) || n < 0 || n > core::kMaxNumel) return false;
  if (core::is_blockwise(codec))
    return block >= core::kMinBlock && block <= core::kMaxBlock && block % 32 == 0;
  if (codec == core::kCodecTopK) return k >= 0 && k <= n && n <= core::kMaxTopkNumel;
  if (core::is_chunk_sparse(codec)) return core::sparse_args_ok(block, k);
  return true;
}

pybind11::dict wire_layout(int32_t codec, int64_t n, int64_t block, int64_t k) {
  if (!launchable(codec, n, block, k))
    throw pybind11::value_error("flatcomm: no payload layout for codec id " + std::to_string(codec) +
                                ", numel " + std::to_string(n) + ", block_size " +
                                std::to_string(block) + ", k " + std::to_string(k));
  const core::Layout l = core::layout(codec, n, block, k);
  const core::DataEnds d = core::data_ends(codec, n, k, l);
  pybind11::dict r;
  r["nblocks"] = l.nblocks;
  r["codes_offset"] = l.codes_offset;
  r["total"] = l.total;
  r["head_end"] = d.head_end;
  r["data_end"] = d.data_end;
  return r;
}

pybind11::dict topk_scratch_layout(int64_t n) {
  if (n < 0 || n > core::kMaxTopkNumel)
    throw pybind11::value_error("flatcomm: topk scratch for numel " + std::to_string(n) +
                                " (expected 0 <= numel < 2^32)");
  const gpu::TopkScratchLayout l = gpu::topk_scratch_layout(n);
  pybind11::dict r;
  r["v"] = l.v;
  r["hist"] = l.hist;
  r["state"] = l.state;
  r["counts"] = l.counts;
  r["cand"] = l.cand;
  r["total"] = l.total;
  return r;
}

// The kind of a codec as flatcomm.ops.codecs names it.
const char* codec_kind_name(int32_t c) {
  switch (core::codec_kind(c)) {
    case core::CodecKind::kCast: return "cast";
    case core::CodecKind::kScaledInt: return "scaled_int";
    case core::CodecKind::kScaledSign: return "scaled_sign";
    case core::CodecKind::kSparse: return "sparse";
    case core::CodecKind::kChunkSparse: return "chunk_sparse";
    case core::CodecKind::kNone: break;
  }
  return "none";
}

pybind11::dict constants() {
  pybind11::dict d;
  pybind11::list names, blockwise, stochastic, rows;
  for (int32_t c = 0; c < core::kNumCodecs; ++c) {
    names.append(core::kCodecNames[c]);
    if (core::is_blockwise(c)) blockwise.append(c);
    if (core::has_stochastic(c)) stochastic.append(c);
    // FLATCOMM_CODECS's row, from which flatcomm.ops.codecs builds its codec table.
    pybind11::dict row;
    row["id"] = c;
    row["name"] = core::kCodecNames[c];
    row["kind"] = codec_kind_name(c);
    row["bits"] = core::code_bits(c);
    row["stochastic"] = core::has_stochastic(c);
    row["dtype"] = core::cast_dtype(c);  // a dtype id for cast codecs, else -1
    rows.append(row);
  }
  d["codecs"] = rows;  // index = codec id
  d["codec_names"] = names;  // index = codec id
  d["blockwise_codecs"] = blockwise;
  d["stochastic_codecs"] = stochastic;
  d["dtype_f32"] = static_cast<int>(core::kF32);
  d["dtype_bf16"] = static_cast<int>(core::kBF16);
  d["dtype_f16"] = static_cast<int>(core::kF16);
  d["min_block"] = core::kMinBlock;
  d["max_block"] = core::kMaxBlock;
  d["align"] = core::kAlign;
  d["max_numel"] = core::kMaxNumel;
  d["max_topk_numel"] = core::kMaxTopkNumel;
  d["max_sparse_chunk"] = core::kSparseMaxChunk;
  d["exp_nonfinite"] = core::kExpNonFinite;
  d["threads"] = gpu::kThreads;
  d["warps"] = gpu::kWarps;
  d["cast_tile"] = gpu::kCastTile;
  d["topk_tile"] = gpu::kTopkTile;
  d["max_grid"] = gpu::kMaxGrid;
  d["scan_threads"] = gpu::kScanThreads;
  d["reg_max_block"] = gpu::kRegMaxBlock;
  d["sparse_per_thread"] = gpu::kSparsePerThread;
  d["topk_chunk"] = gpu::kTopkChunk;
  d["topk_bins"] = gpu::kTopkBins;
  return d;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "flatcomm native kernels (ops live in torch.ops.flatcomm)";
  m.def("build_info", &build_info, "What this build of flatcomm was compiled with and uses.");
  m.def(
      "wire_bytes",
      [](const std::string& codec, int64_t n, int64_t block, int64_t k) {
        return flatcomm::ops::wire_bytes(flatcomm::ops::parse_codec(codec), n, block, k);
      },
      "Payload bytes for numel values.");
  m.def(
      "wire_bytes",
      [](int32_t codec, int64_t n, int64_t block, int64_t k) {
        TORCH_CHECK(core::valid_codec_id(codec), "flatcomm: unknown codec id ", codec);
        return flatcomm::ops::wire_bytes(codec, n, block, k);
      },
      "Payload bytes for numel values, the codec given by its id.");
  m.def("wire_layout", &wire_layout,
        "core::layout of a payload (codec id): nblocks, codes_offset, total, and where its data ends "
        "(head_end, data_end; the rest is padding). ValueError for arguments no launch accepts.");
  m.def(
      "decode_rows_layout",
      [](const std::string& codec, int64_t row_numel, int64_t block) {
        const flatcomm::ops::RowsLayout l = flatcomm::ops::decode_rows_layout(codec, row_numel, block);
        return std::make_pair(l.codec, l.row_bytes);
      },
      "decode_rows' codec id and bytes per row, with the op's errors (topk, row_numel, block_size).");
  m.def("check_rows_cover", &flatcomm::ops::check_rows_cover,
        "decode_rows' check that the rows fill out exactly (the last one perhaps cut short).");
  m.def(
      "parse_codec", [](const std::string& name) { return flatcomm::ops::parse_codec(name); },
      "The id of a codec name, with the ops' error for an unknown one.");
  m.def(
      "precision_of", [](int64_t headroom) { return flatcomm::ops::precision_of(headroom); },
      "Fixed-point precision bits for a headroom, with the ops' error for a bad one.");
  m.def(
      "seed_key", [](uint64_t seed) { return core::seed_key(seed); },
      "core::seed_key: the stochastic-rounding key of a seed (uint64).");
  m.def("topk_scratch_layout", &topk_scratch_layout,
        "gpu::topk_scratch_layout: byte offsets of the CUDA topk encoder's scratch parts and its size.");
  m.def("constants", &constants,
        "Codec names and ids, size limits and the CUDA launch shapes, as the C++ sources define them.");
  m.def(
      "set_simd", [](const std::string& isa) { return flatcomm::cpu::select_kernels(isa.c_str()); },
      "Select the CPU kernel build ('baseline', 'avx2', 'avx512'); False if unsupported here.");
  m.def("lane_drain", &flatcomm::ops::lane_drain, pybind11::call_guard<pybind11::gil_scoped_release>(),
        "Wait until every call posted to a group's native lane has finished (comm/lane.h).");
  m.def("native_finished", &flatcomm::ops::native_finished,
        "The tokens of the native calls completed since the last call (comm/native_work.h).");
  m.def("lane_completed", &flatcomm::ops::lane_completed, "How many calls of a native lane have finished.");
  m.def("lane_in_flight", &flatcomm::ops::lane_in_flight,
        "How many native calls of a group were posted and have not finished (comm/lane.h).");
  m.def("set_callback", &flatcomm::ops::set_callback,
        "Install the Python function a native call's failure calls back (comm/native_work.h).");
  m.def("lane_close", &flatcomm::ops::lane_close, pybind11::call_guard<pybind11::gil_scoped_release>(),
        "End a native lane (its group was destroyed).");
  m.def("max_block_size", [] { return flatcomm::core::kMaxBlock; });
  m.def("default_headroom", [] { return flatcomm::core::kDefaultHeadroom; });
}

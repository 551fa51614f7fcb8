// The watch on an early call's header (flatcomm/comm/agreed.py): when the header exchange
// completes, compare every rank's row with this rank's, without the GIL, and only when they differ
// call Python, which posts the transfers the early peers wait for. (A failed exchange has no table
// to read: the call raises its error when it waits for the exchange.)
//
// Why not a Python callback on the exchange's future: it would take the GIL on gloo's thread at
// every call, while that thread holds its queue (the hazard flatcomm/comm/header.py keeps the row
// alive for). A DDP step on 2 ranks measured the same either way (docs/backend.md).
//
// Also what the native calls (lane.cpp, slot_all_reduce.cpp) do with their rows: the checks of a
// table and a row, and the rows' all-gather.
#include <ATen/ATen.h>
#include <pybind11/pybind11.h>
#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <torch/library.h>

#include <string>

#include "header_rows.h"
#include "native_work.h"

namespace flatcomm {
namespace ops {

void check_rows(const at::Tensor& table, const at::Tensor& mine, int64_t width, const char* op) {
  TORCH_CHECK(table.device().is_cpu() && table.scalar_type() == at::kLong && table.dim() == 2 && table.is_contiguous(),
              "flatcomm: ", op, ": the table must be a contiguous 2-d CPU int64 tensor, got ", table.toString(), " ",
              table.sizes());
  TORCH_CHECK(mine.device().is_cpu() && mine.scalar_type() == at::kLong && mine.dim() == 1 && mine.is_contiguous(),
              "flatcomm: ", op, ": the row must be a contiguous 1-d CPU int64 tensor, got ", mine.toString(), " ",
              mine.sizes());
  TORCH_CHECK(0 <= width && width <= mine.numel() && width <= table.size(1), "flatcomm: ", op, ": width ", width,
              " is outside the rows of ", mine.numel(), " and ", table.size(1), " values");
}

c10::intrusive_ptr<c10d::Work> gather_rows(const c10::intrusive_ptr<c10d::Backend>& backend, const at::Tensor& table,
                                           const at::Tensor& mine, const char* op) {
  TORCH_CHECK(table.size(0) == backend->getSize() && table.size(1) == mine.numel(), "flatcomm: ", op,
              ": the table must hold one row of ", mine.numel(), " values per rank (", backend->getSize(), "), got ",
              table.sizes());
  // Aliases made here (header_rows.h): gloo's thread drops a finished exchange's tensors.
  at::Tensor rows = alias_of(table).view({-1}), row = alias_of(mine).view({-1});
  return backend->_allgather_base(rows, row, c10d::AllgatherOptions());
}

void watch_rows(const c10::intrusive_ptr<c10d::Work>& work, const at::Tensor& table, const at::Tensor& mine,
                int64_t width, int64_t token, const char* on_disagreement) {
  // (aliases: the callback is dropped on gloo's thread once it ran)
  work->getFuture()->addCallback([table = alias_of(table), mine = alias_of(mine), width, token,
                                  on_disagreement](c10::ivalue::Future& done) {
    if (done.hasError() || rows_agree(table, mine, width)) return;  // the common case: no Python
    if (!python_alive()) return;  // (exiting: nobody is left to wait for the fills)
    pybind11::gil_scoped_acquire gil;
    try {
      callback(on_disagreement)(token);
    } catch (pybind11::error_already_set& e) {
      e.discard_as_unraisable("flatcomm: settling a call header that disagreed");
    }
  });
}

namespace {

// Every rank's row gathered into the table, on the group's CPU backend (a Python call header's
// exchange: flatcomm/comm/header.py).
c10::intrusive_ptr<c10d::Work> gather_header(const c10::intrusive_ptr<c10d::ProcessGroup>& group,
                                             const at::Tensor& table, const at::Tensor& mine) {
  check_rows(table, mine, 0, "gather_header");
  return gather_rows(group->getBackend(c10::DeviceType::CPU), table, mine, "gather_header");
}

void watch_header(const c10::intrusive_ptr<c10d::Work>& work, const at::Tensor& table, const at::Tensor& mine,
                  int64_t width, int64_t token) {
  check_rows(table, mine, width, "watch_header");
  watch_rows(work, table, mine, width, token, kHeaderDisagreement);
}

}  // namespace

TORCH_LIBRARY_IMPL(flatcomm, CPU, m) {
  m.impl("watch_header", &watch_header);
  m.impl("gather_header", &gather_header);
}

}  // namespace ops
}  // namespace flatcomm

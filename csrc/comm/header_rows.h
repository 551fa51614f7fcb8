// The rows of a call header (flatcomm/comm/header.py), compared without the GIL, and the watch that
// compares them when their exchange completes (header_watch.cpp).
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <cstring>

namespace flatcomm {
namespace ops {

// Whether every rank's row agrees with this rank's: the first `width` values of each row of
// `table` equal those of `mine`.
inline bool rows_agree(const at::Tensor& table, const at::Tensor& mine, int64_t width) {
  const int64_t world = table.size(0), length = table.size(1);
  const int64_t* rows = table.data_ptr<int64_t>();
  const int64_t* own = mine.data_ptr<int64_t>();
  for (int64_t r = 0; r < world; ++r)
    if (std::memcmp(rows + r * length, own, width * sizeof(int64_t)) != 0) return false;
  return true;
}

// A tensor on `t`'s memory that never had a Python object and holds no reference to `t` (a view
// would: its base). What C++ threads keep of a tensor Python made: dropping the second-to-last
// reference to a tensor with a Python object takes the GIL (torch 2.13's decref_pyobject), and a
// lane or gloo thread that waits for the GIL stalls every exchange of the group behind whichever
// thread holds it. (Storage has no Python object unless Python asked for it.)
inline at::Tensor alias_of(const at::Tensor& t) {
  return at::empty({0}, t.options()).set_(t.storage(), t.storage_offset(), t.sizes(), t.strides());
}

// The op `op`'s checks of a table, a row and a width (named in its errors).
void check_rows(const at::Tensor& table, const at::Tensor& mine, int64_t width, const char* op);

// This rank's row `mine` gathered from every rank of a group into `table` (one row per rank,
// checked: the op `op` names it in its error), posted on the group's CPU backend `backend`.
c10::intrusive_ptr<c10d::Work> gather_rows(const c10::intrusive_ptr<c10d::Backend>& backend, const at::Tensor& table,
                                           const at::Tensor& mine, const char* op);

// Once `work` (the rows' exchange) completes, when the rows disagree: the callback installed under
// `on_disagreement` (native_work.h, a static string) called with `token`, with the GIL.
void watch_rows(const c10::intrusive_ptr<c10d::Work>& work, const at::Tensor& table, const at::Tensor& mine,
                int64_t width, int64_t token, const char* on_disagreement);

}  // namespace ops
}  // namespace flatcomm

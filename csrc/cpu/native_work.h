// What flatcomm's native calls share (lane.cpp, slot_all_reduce.cpp): the c10d Work they complete,
// and the one way back into Python, taken only when a call failed.
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <chrono>
#include <exception>
#include <string>
#include <vector>

namespace flatcomm {
namespace ops {

// The Python module a native call's failure goes to (flatcomm/comm/native_calls.py: on_disagreement,
// verdict).
constexpr const char* kNativeCalls = "flatcomm.comm.native_calls";

// The Work of a native all-reduce, completed by whoever runs it; its future holds [out], as gloo's
// allreduce's does (DDP's reducer reads it in C++). `token`: the call's, in native_finished() once
// it completed.
class NativeWork : public c10d::Work {
 public:
  NativeWork(at::Tensor out, int64_t token);
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return future_; }
  std::vector<at::Tensor> result() override { return {out_}; }
  // As Work::wait, with a timeout that names what is still in flight (which it stays: wait again).
  bool wait(std::chrono::milliseconds timeout = ::kNoTimeout) override;
  // Complete it: nullptr, with [out]; else failed with `error` (a C++ error DDP's reducer rethrows).
  void settle(const std::exception_ptr& error);

 private:
  at::Tensor out_;
  int64_t token_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

// The tokens of the native calls completed since the last call (Python drops their records).
std::vector<int64_t> native_finished();

// An exception of the c10 type Python raises as `kind` ("ValueError", "TypeError", else RuntimeError).
std::exception_ptr error_named(const std::string& kind, const std::string& message);

// What a native call that failed raises, from flatcomm.comm.native_calls.verdict (nullptr: the
// header agreed after all): the header's error, the same on every rank, once settled (its fills
// made); or the op's own (`failed`), once the header is settled. `exchange`: the header exchange's
// own error, if any. Takes the GIL.
std::exception_ptr verdict(int64_t token, const std::exception_ptr& failed, const std::exception_ptr& exchange);

}  // namespace ops
}  // namespace flatcomm

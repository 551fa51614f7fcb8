// What flatcomm's native calls share (lane.cpp, slot_all_reduce.cpp): the c10d Work they complete,
// and the one way back into Python, taken only when a call failed.
#pragma once

#include <ATen/ATen.h>
#include <pybind11/pybind11.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <chrono>
#include <exception>
#include <functional>
#include <string>
#include <vector>

namespace flatcomm {
namespace ops {

// The Python functions C++ calls back, only when a call failed, installed by Python at import
// (set_callback, from flatcomm/comm/native_calls.py and flatcomm/comm/header.py): C++ imports no
// module by name. Keys: kVerdict(token, failed, exchange), kNativeDisagreement(token) and
// kHeaderDisagreement(token).
constexpr const char* kVerdict = "native_calls.verdict";
constexpr const char* kNativeDisagreement = "native_calls.on_disagreement";
constexpr const char* kHeaderDisagreement = "header.on_disagreement";
void set_callback(const std::string& key, pybind11::object fn);
// The callback installed under `key` (the GIL held); raises if none was.
pybind11::object callback(const char* key);

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
  // The future first, then `counted()` (the call counted finished on its lane), then the Work: a
  // waiter whom wait() let go finds the future completed and the lane free for its next call.
  void settle(const std::exception_ptr& error, const std::function<void()>& counted);

 private:
  at::Tensor out_;
  int64_t token_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

// Whether the interpreter is up and not finalizing: the GIL may be taken.
bool python_alive();

// Drops the caller's reference to a completed native call's Work. Where it is the last one (nobody
// waits on the Work: DDP keeps only its future), the Work is kept for native_finished() to drop on
// a Python thread: it holds the caller's tensor, and dropping the last C++ reference to a tensor
// Python made takes the GIL (torch 2.13's decref_pyobject), which must never happen on the lane's
// or gloo's thread (header_rows.h alias_of).
void release_work(c10::intrusive_ptr<NativeWork>& work);

// The tokens of the native calls completed since the last call (Python drops their records); also
// drops the Works release_work kept. Called from Python.
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

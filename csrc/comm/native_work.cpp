// NativeWork and the way back into Python of a failed native call (native_work.h).
#include "native_work.h"

#include <Python.h>
#include <pybind11/pybind11.h>

#include <mutex>
#include <unordered_map>
#include <utility>

namespace flatcomm {
namespace ops {

namespace {

// Never destroyed: Python objects must not be dropped after the interpreter is gone.
auto* callbacks = new std::unordered_map<std::string, pybind11::object>();  // (guarded by the GIL)

std::mutex finished_mutex;
std::vector<int64_t> finished;  // (guarded by finished_mutex)
// Works of completed calls nobody else held (guarded by finished_mutex). Never destroyed: a Work
// left at exit is dropped with the process, not after the interpreter is gone.
auto* unheld = new std::vector<c10::intrusive_ptr<NativeWork>>();

// Run by the interpreter's main thread, with the GIL, soon after release_work asked for it: the
// Works kept hold the caller's tensor (the future's value), which must not wait for the next
// native call to be let go (a 1 GB gradient kept alive by a call that finished long ago).
int drop_unheld(void*) {
  std::vector<c10::intrusive_ptr<NativeWork>> drop;
  std::lock_guard<std::mutex> lock(finished_mutex);
  drop.swap(*unheld);
  return 0;  // (`drop` goes after the lock)
}

}  // namespace

NativeWork::NativeWork(at::Tensor out, int64_t token)
    : c10d::Work(-1, c10d::OpType::ALLREDUCE),
      out_(std::move(out)),
      token_(token),
      future_(c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()))) {}

void NativeWork::settle(const std::exception_ptr& error, const std::function<void()>& counted) {
  {
    std::lock_guard<std::mutex> lock(finished_mutex);
    finished.push_back(token_);
  }
  // The future first: a waiter whom wait() let go finds it completed too (as gloo's works do).
  if (error)
    future_->setError(error);
  else
    future_->markCompleted(c10::IValue(c10::List<at::Tensor>({out_})));
  counted();
  finish(error);
}

bool NativeWork::wait(std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(mutex_);
  const auto done = [&] { return completed_; };
  if (timeout == ::kNoTimeout)
    cv_.wait(lock, done);  // (each native call is bounded by its group's timeout)
  else
    TORCH_CHECK(cv_.wait_for(lock, timeout, done), "flatcomm: all_reduce of ", out_.numel(),
                " values did not finish within ", timeout.count(),
                " ms (still in flight: wait again; the group's own timeout fails it if a peer never joins)");
  if (exception_) std::rethrow_exception(exception_);
  return true;
}

void release_work(c10::intrusive_ptr<NativeWork>& work) {
  bool first = false;
  if (work && work.use_count() == 1) {  // (a waiter dropping its own at this moment: the GIL taken here, rarely)
    std::lock_guard<std::mutex> lock(finished_mutex);
    first = unheld->empty();
    unheld->push_back(std::move(work));
  }
  work.reset();
  // Py_AddPendingCall needs no GIL. A full queue (-1) leaves them to the next native_finished().
  if (first && python_alive()) Py_AddPendingCall(&drop_unheld, nullptr);
}

std::vector<int64_t> native_finished() {
  std::vector<c10::intrusive_ptr<NativeWork>> drop;
  std::lock_guard<std::mutex> lock(finished_mutex);
  drop.swap(*unheld);
  return std::exchange(finished, {});  // (`drop` goes after the lock, on this Python thread)
}

void set_callback(const std::string& key, pybind11::object fn) { (*callbacks)[key] = std::move(fn); }

pybind11::object callback(const char* key) {
  auto it = callbacks->find(key);
  if (it == callbacks->end()) {  // (raised as the callers' handlers expect a Python error)
    const std::string what = std::string("flatcomm: no callback installed for ") + key;
    PyErr_SetString(PyExc_RuntimeError, what.c_str());
    throw pybind11::error_already_set();
  }
  return it->second;
}

std::exception_ptr error_named(const std::string& kind, const std::string& message) {
  try {
    if (kind == "ValueError") TORCH_CHECK_VALUE(false, message);
    if (kind == "TypeError") TORCH_CHECK_TYPE(false, message);
    TORCH_CHECK(false, message);
  } catch (...) {
    return std::current_exception();
  }
  return nullptr;
}

bool python_alive() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsInitialized() && !Py_IsFinalizing();
#else
  return Py_IsInitialized() && !_Py_IsFinalizing();
#endif
}

namespace {

std::string message_of(const std::exception_ptr& error) {
  try {
    std::rethrow_exception(error);
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  } catch (const std::exception& e) {
    return e.what();
  } catch (...) {
    return "unknown error";
  }
}

pybind11::object text_or_none(const std::exception_ptr& error) {
  return error ? pybind11::object(pybind11::str(message_of(error))) : pybind11::none();
}

}  // namespace

std::exception_ptr verdict(int64_t token, const std::exception_ptr& failed, const std::exception_ptr& exchange) {
  if (!python_alive())
    return failed ? failed : exchange ? exchange : error_named("RuntimeError", "flatcomm: the call header disagreed");
  pybind11::gil_scoped_acquire gil;
  try {
    pybind11::object said =
        callback(kVerdict)(token, text_or_none(failed), text_or_none(exchange));
    if (failed) return failed;
    if (said.is_none()) return nullptr;
    auto kind_message = said.cast<std::pair<std::string, std::string>>();
    return error_named(kind_message.first, kind_message.second);
  } catch (pybind11::error_already_set& e) {
    const std::string what = e.what();
    return failed ? failed : error_named("RuntimeError", "flatcomm: settling a native call's header: " + what);
  }
}

}  // namespace ops
}  // namespace flatcomm

// The native lane of a CPU group: the flatcomm backend's agreed early all-reduces
// (flatcomm/comm/lane.py) run here, one after another, on a C++ thread, and complete a c10d Work
// whose future DDP's reducer reads in C++. A call costs Python only while it is posted.
//
// Why: run by the group's Python worker, a DDP bucket's all-reduce waited ~0.8 ms for the worker
// to wake and take the GIL, ~0.5 ms for the Python around the op, and the next bucket waited for
// the previous one's future callbacks, all on 2 cores the backward pass keeps busy.
//
// A call: the native all-reduce (p2p_all_reduce.cpp, without waiting for the call header, which
// was posted with the call: flatcomm/comm/agreed.py), then the header's rows compared. Only a
// failure calls Python: the header's error (the same on every rank), or the op's own error once
// the header is settled. A call starts only once every native call posted before it finished
// (lane calls and small slot calls, counted together here); the group's Python worker drains the
// lane before each of its own calls (flatcomm/comm/worker.py), so the group's calls run one at a
// time, in call order. Nothing here takes the GIL on success: the transfers go to the group's CPU
// backend (gloo) directly, and every tensor a call holds was made in C++ or is held by Python too.
#include "lane.h"

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <torch/library.h>

#include "header_rows.h"
#include "native_work.h"
#include "p2p_all_reduce.h"

#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <chrono>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

namespace flatcomm {
namespace ops {

namespace {

struct Call {
  at::Tensor flat;
  c10::intrusive_ptr<c10d::Backend> backend;
  std::vector<int64_t> pieces;
  int64_t chunks = 0;
  double scale = 1.0;
  int64_t tag_base = 0;
  int64_t exact_block = 0, headroom = 0;  // exact mode's grid (0: ordered)
  int64_t seq = 0;  // native calls of the group posted before this one
  c10::intrusive_ptr<c10d::Work> header;
  at::Tensor table, mine;
  int64_t width = 0, token = 0;
  c10::intrusive_ptr<NativeWork> work;
};

}  // namespace

class Lane : public std::enable_shared_from_this<Lane> {
 public:
  int64_t admit(const std::function<void()>& post_exchange) {
    std::lock_guard<std::mutex> lock(mutex_);
    TORCH_CHECK(!closing_, "flatcomm: the process group was destroyed; its collectives cannot run");
    post_exchange();
    return posted_++;
  }

  void enqueue(Call call) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      queue_.push_back(std::move(call));
      if (!thread_.joinable()) thread_ = std::thread([self = shared_from_this()] { self->loop(); });
    }
    wake_.notify_all();
  }

  void finished() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      ++done_;
    }
    wake_.notify_all();
    idle_.notify_all();
  }

  void drain(double timeout_s) {
    std::unique_lock<std::mutex> lock(mutex_);
    const auto limit = std::chrono::duration<double>(timeout_s);
    while (done_ < posted_) {
      const int64_t before = done_;
      // Each call is bounded by the group's timeout (its transfers and header): time out only
      // when none finishes within it.
      if (!idle_.wait_for(lock, limit, [&] { return done_ != before; }))
        TORCH_CHECK(false, "flatcomm: no call of the group's native lane finished within ", timeout_s, " s (",
                    posted_ - done_, " in flight)");
    }
  }

  int64_t completed() {
    std::lock_guard<std::mutex> lock(mutex_);
    return ran_;
  }

  int64_t in_flight() {
    std::lock_guard<std::mutex> lock(mutex_);
    return posted_ - done_;
  }

  void close() {
    bool join;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      closing_ = true;
      join = !running_ && queue_.empty();
    }
    wake_.notify_all();
    if (!thread_.joinable()) return;
    if (join && std::this_thread::get_id() != thread_.get_id())
      thread_.join();
    else  // (a call still running ends by its own timeout; the thread holds the lane until then)
      thread_.detach();
  }

 private:
  void loop() {
    for (;;) {
      Call call;
      bool skip;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        wake_.wait(lock, [&] { return closing_ || !queue_.empty(); });
        if (queue_.empty()) return;
        // In call order: the native calls posted before this one (small ones complete on gloo's
        // thread) finish first; a closed lane stops waiting and fails what is left.
        wake_.wait(lock, [&] { return closing_ || done_ >= queue_.front().seq; });
        call = std::move(queue_.front());
        queue_.pop_front();
        skip = closing_;
        running_ = true;
      }
      const std::exception_ptr error =
          skip ? error_named("RuntimeError",
                             "flatcomm: the process group was destroyed before this all-reduce ran (its calls were "
                             "not drained)")
               : run(call);
      {  // counted before the Work completes: a waiter that saw it complete sees it counted
        std::lock_guard<std::mutex> lock(mutex_);
        running_ = false;
        ++ran_;
      }
      call.work->settle(error, [this] { finished(); });  // (DDP's callbacks run here, in C++)
      release_work(call.work);
    }
  }

  // The call's error, or nullptr.
  std::exception_ptr run(Call& call) {
    std::exception_ptr failed, exchange;
    try {
      p2p_sum_all_reduce_(call.flat, scratch(scratch_numel(call)), call.backend, call.pieces, call.chunks,
                          call.scale, call.tag_base, call.exact_block, call.headroom);
    } catch (...) {
      failed = std::current_exception();
    }
    bool agreed = false;
    try {  // (bounded by the group's timeout, as the op's transfers)
      call.header->wait();
      agreed = rows_agree(call.table, call.mine, call.width);
    } catch (...) {
      exchange = std::current_exception();
    }
    return failed || !agreed ? verdict(call.token, failed, exchange) : nullptr;
  }

  // Enough for the peers' pieces of this rank's shard, whichever rank it is (the op checks it).
  static int64_t scratch_numel(const Call& call) {
    const int64_t world = call.table.size(0), stride = call.chunks + 1;
    int64_t widest = 0;
    for (int64_t d = 0; d < world && call.chunks; ++d)
      widest = std::max(widest, call.pieces[d * stride + call.chunks] - call.pieces[d * stride]);
    return (world - 1) * widest;
  }

  // The lane's receive rows, grown as needed (its calls run one at a time).
  at::Tensor scratch(int64_t numel) {
    if (scratch_.numel() < numel) scratch_ = at::empty({numel}, at::kFloat);
    return scratch_;
  }

  std::mutex mutex_;
  std::condition_variable wake_, idle_;
  std::deque<Call> queue_;
  int64_t posted_ = 0, done_ = 0;  // every native call of the group
  int64_t ran_ = 0;                 // the calls this lane's thread ran
  bool closing_ = false, running_ = false;
  at::Tensor scratch_ = at::empty({0}, at::kFloat);
  std::thread thread_;
};

namespace {

// Never destroyed: a lane's thread may still be waiting when the process exits. A closed lane
// stays listed (as nullptr): its id is never reused, and a post racing the close must fail, not
// start a lane nobody closes.
std::mutex registry_mutex;
auto* registry = new std::unordered_map<int64_t, std::shared_ptr<Lane>>();

std::shared_ptr<Lane> existing_lane(int64_t id) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  auto it = registry->find(id);
  return it == registry->end() ? nullptr : it->second;
}

c10::intrusive_ptr<c10d::Work> lane_all_reduce(const at::Tensor& flat, const at::Tensor& out, c10::string_view group,
                                               at::IntArrayRef pieces, int64_t chunks, double scale, int64_t tag_base,
                                               const at::Tensor& table, const at::Tensor& mine, int64_t width,
                                               int64_t token, int64_t lane, int64_t exact_block, int64_t headroom) {
  check_rows(table, mine, width, "lane_all_reduce");
  TORCH_CHECK(chunks >= 0 && static_cast<int64_t>(pieces.size()) == table.size(0) * (chunks + 1),
              "flatcomm: lane_all_reduce: pieces must hold world * (chunks + 1) = ", table.size(0) * (chunks + 1),
              " bounds, got ", pieces.size());
  auto target = lane_for_post(lane);
  Call call;
  call.flat = alias_of(flat).view({-1});  // (aliases: dropped on the lane's thread without the GIL)
  call.backend = cpu_backend(group);
  call.pieces = pieces.vec();
  call.chunks = chunks;
  call.scale = scale;
  call.tag_base = tag_base;
  call.exact_block = exact_block;
  call.headroom = headroom;
  call.table = alias_of(table);
  call.mine = alias_of(mine);
  call.width = width;
  call.token = token;
  call.work = c10::make_intrusive<NativeWork>(out, token);
  // The call header, posted here, in call order, and watched: an early peer's transfers may be
  // waiting for the ones its disagreement calls for.
  call.seq = lane_admit(*target, [&] {
    call.header = gather_rows(call.backend, call.table, call.mine, "lane_all_reduce");
    watch_rows(call.header, call.table, call.mine, width, token, kNativeDisagreement);
  });
  c10::intrusive_ptr<c10d::Work> work = call.work;
  target->enqueue(std::move(call));
  return work;
}

}  // namespace

std::shared_ptr<Lane> lane_for_post(int64_t id) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  auto it = registry->find(id);
  if (it == registry->end()) it = registry->emplace(id, std::make_shared<Lane>()).first;
  TORCH_CHECK(it->second, "flatcomm: the process group was destroyed; its collectives cannot run");
  return it->second;
}

int64_t lane_admit(Lane& lane, const std::function<void()>& post_exchange) { return lane.admit(post_exchange); }

void lane_finished(Lane& lane) { lane.finished(); }

c10::intrusive_ptr<c10d::Backend> cpu_backend(c10::string_view group) {
  return c10d::resolve_process_group(std::string(group))->getBackend(c10::DeviceType::CPU);
}

void lane_drain(int64_t lane, double timeout_s) {
  if (auto l = existing_lane(lane)) l->drain(timeout_s);
}

int64_t lane_completed(int64_t lane) {
  auto l = existing_lane(lane);
  return l ? l->completed() : 0;
}

int64_t lane_in_flight(int64_t lane) {
  auto l = existing_lane(lane);
  return l ? l->in_flight() : 0;
}

void lane_close(int64_t lane) {
  std::shared_ptr<Lane> l;
  {
    std::lock_guard<std::mutex> lock(registry_mutex);
    auto& slot = (*registry)[lane];
    l = std::exchange(slot, nullptr);
  }
  if (l) l->close();
}

TORCH_LIBRARY_IMPL(flatcomm, CPU, m) {
  m.impl("lane_all_reduce", &lane_all_reduce);
}

}  // namespace ops
}  // namespace flatcomm

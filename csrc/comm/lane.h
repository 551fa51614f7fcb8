// The native calls of a CPU group (lane.cpp): the flatcomm backend's agreed all-reduces, run one
// after another on the group's lane thread, and its small ordered all-reduces (slot_all_reduce.cpp),
// which complete on gloo's thread. Both are counted here, in call order, so that every native call
// of a group starts only once the calls posted before it finished, and Python can ask whether any
// is in flight. Lanes are named by the id Python gives them (the group's worker key,
// flatcomm/comm/lane.py).
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <cstdint>
#include <functional>

namespace flatcomm {
namespace ops {

class Lane;

// The lane of id `lane`, made on first use. Raises once the lane was closed (its group destroyed):
// a call posted then must fail on its own, before it posts any exchange.
std::shared_ptr<Lane> lane_for_post(int64_t lane);
// Counts a native call in: runs `post_exchange` (its header exchange, issued in call order) under
// the lane's lock, so that a refused call issues nothing. Returns how many calls came before it.
int64_t lane_admit(Lane& lane, const std::function<void()>& post_exchange);
// A call admitted by lane_admit finished (NativeWork::settle calls it between its future and its Work).
void lane_finished(Lane& lane);

// Blocks until every call posted to the lane so far has finished; raises when none finished for
// timeout_s seconds. A lane never posted to has nothing to wait for.
void lane_drain(int64_t lane, double timeout_s);
// How many calls the lane's thread ran (counted before their Works complete).
int64_t lane_completed(int64_t lane);
// How many calls of the lane were posted and have not finished.
int64_t lane_in_flight(int64_t lane);
// Ends the lane: no call is admitted any more. Calls already queued still run (every rank posted
// them: failing them here would leave a peer waiting for their transfers) unless the lane was not
// drained, where those not started fail; the thread is joined when idle, else let go.
void lane_close(int64_t lane);

// The CPU backend of a registered group (the inner gloo of a flatcomm group): what the native calls
// post their transfers on, from C++, without the Python group's methods and so without the GIL.
c10::intrusive_ptr<c10d::Backend> cpu_backend(c10::string_view group);

}  // namespace ops
}  // namespace flatcomm

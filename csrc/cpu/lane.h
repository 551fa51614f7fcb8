// The native lane of a CPU group (lane.cpp): where the flatcomm backend's agreed all-reduces run,
// one after another, without Python. Lanes are named by the id Python gives them (the worker key
// of the group, flatcomm/comm/lane.py).
#pragma once

#include <cstdint>

namespace flatcomm {
namespace ops {

// Blocks until every call posted to the lane so far has finished; raises when none finished for
// timeout_s seconds. A lane never posted to has nothing to wait for.
void lane_drain(int64_t lane, double timeout_s);
// How many calls of the lane have finished (they finish in the order they were posted).
int64_t lane_completed(int64_t lane);
// Ends the lane: its running call finishes, its queued ones fail; its thread is joined (detached
// when called from that thread).
void lane_close(int64_t lane);

}  // namespace ops
}  // namespace flatcomm

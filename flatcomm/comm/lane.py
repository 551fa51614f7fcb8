"""The native lane of a CPU group: where the flatcomm backend's agreed all-reduces run, in C++.

A prepared all-reduce (:mod:`flatcomm.comm.prepared`) on an agreed plan that runs natively
(:mod:`flatcomm.comm.agreed`) is posted here from the caller's thread, with its call header's row:
one op (csrc/comm/lane.cpp) posts the header exchange, watches it as an early call's, and queues the
call on the group's lane thread, which runs the native all-reduce, checks the rows and completes a
``dist.Work`` that DDP's reducer reads in C++. A call costs Python only while it is posted: no
worker thread to wake, no Python between one bucket's op and the next, no Python callbacks.

Order: a call is posted to the lane only while nothing is queued or running on the group's Python
worker and no small call posted from a caller's thread is unfinished
(:func:`flatcomm.comm.worker.post_to_lane_if_idle`); the lane starts it once every native call
posted before it finished (a small native one completes on gloo's thread), and the worker drains
the lane before each of its own calls. So the group's calls take effect one at a time, in call
order, as on the worker alone, and each rank issues its exchanges in the same order.

Failures: only then does Python see a call (:mod:`flatcomm.comm.native_calls`): its
:class:`~flatcomm.comm.header.CallHeader` is built from the row and table the call kept, and
settled as an early call's (its fills made, :func:`flatcomm.comm.agreed.fill`); the call raises the
header's error, the same on every rank, or the op's own error once the header is settled.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from . import agreed, groups, header, native_calls
from .args import Call
from .layout import CommStats
from .spec import CallSpec
from ..ops.native import ops

__all__ = ["post"]


def post(group, a: Call, spec: CallSpec, tensor: torch.Tensor, name: str) -> Optional[dist.Work]:
    """Post the all-reduce of ``tensor`` (its checked arguments ``a``, a call that
    :func:`flatcomm.comm.flat.runs_natively`; ``name``: its group's name in torch's registry) to
    the lane, or None where it must take the worker's path (no agreed plan yet, no header
    exchange). Called under :func:`flatcomm.comm.worker.post_to_lane_if_idle`."""
    plan = agreed.plan_id(group, a.fields)
    if plan == 0 or a.plan is None or not groups.exchanges(group):
        return None
    lane = native_calls.lane_of(group)
    fields = list(a.fields) + [agreed.count_field(group)]
    token, mine, table = native_calls.record(group, a.fields, fields, plan, a.world)
    p = a.plan
    pieces = [p.bounds[d] + x for d in range(p.world) for x in p.chunk_bounds[d]]
    # (the tensor itself: the op makes its flat view, which the lane thread then drops without the GIL)
    grid = (a.exact_block, a.headroom) if spec.mode == "exact" else (0, 0)
    work = native_calls.launched(group, token, lambda: ops.lane_all_reduce(
        tensor, tensor, name, pieces, a.chunks, a.scale, agreed.tag_base(plan), table, mine, header.WIDTH, token, lane,
        *grid))
    if isinstance(spec.stats, CommStats):  # (exchange_s is not timed on the lane: that would take Python)
        shard = p.bounds[p.rank + 1] - p.bounds[p.rank]
        spec.stats.calls += 1
        spec.stats.wire_bytes += (tensor.numel() - shard + shard * (p.world - 1)) * tensor.element_size()
    return work

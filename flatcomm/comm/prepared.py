"""An all-reduce checked once and posted again for every tensor of the same numel and dtype.

The flatcomm backend's reductions repeat their shapes step after step (a loss, a metric, each DDP
bucket), and everything the argument layers check (codec, mode, op, sizes, the shard plan, the call
header's fields) depends on the shape, not on the values: ~100 us of Python per call, on the
caller's thread (for DDP, the autograd thread, with the backward pass waiting). A :class:`Prepared`
call keeps the first call's checked :class:`flatcomm.comm.args.Call` and runs each later call from
it, on the same paths, rows, checks and kernels as :func:`flatcomm.comm.route.all_reduce`, so with
the same bits and errors:

* on its route (:mod:`flatcomm.comm.route`, decided once for the shape): the native lane once its
  plan is agreed, or the small call in C++, each returning a C++ ``dist.Work``; the small call in
  Python; else the gathered, pipelined or exact path, queued on the group's worker;
* posted from the caller's thread only where call order allows (:mod:`flatcomm.comm.worker`).
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Union, cast

import torch
import torch.distributed as dist

from . import args, lane, p2p, route, small_native, worker
from .route import Route
from .spec import CallSpec

__all__ = ["Prepared", "prepare_all_reduce"]


class Prepared:
    """The checked all-reduce ``a`` on ``group`` (a private group), posted again by :meth:`post`
    on its :attr:`route` (:func:`flatcomm.comm.route.of`, decided once)."""

    def __init__(self, group, a: args.Call, spec: CallSpec):
        self.group, self.spec = group, spec
        self.key = worker.key_of(group)  # (the group's for its lifetime: a destroyed one drops its calls)
        self.route = route.of(group, a, spec.mode)
        self.what = f"all_reduce of {a.src.numel()} values ({a.codec.name})"
        self.name = p2p.native_name(group)  # what the native ops resolve the group by
        self.slot_call = (small_native.SlotCall(group, a, spec, a.src.numel(), cast(str, self.name))
                          if self.route is Route.SMALL_NATIVE else None)
        none = a.src.new_empty(0)  # each post gives its tensor: the first one is not kept alive here
        self.a = dataclasses.replace(a, src=none, out=none)

    def post(self, tensor: torch.Tensor) -> Union[worker.Handle, dist.Work]:
        """Start the all-reduce of ``tensor`` (contiguous, the prepared numel and dtype). The native
        routes return a C++ ``dist.Work``, posted from this thread where the group's calls in flight
        allow it (:mod:`flatcomm.comm.worker`: call order); else, and on the other routes, the
        call goes through :func:`flatcomm.comm.route.run`, with the same exchanges and bits."""
        work = None
        if self.slot_call is not None:  # reads the values now: only with nothing in flight
            slot_call = self.slot_call
            work = worker.post_if_idle(self.key, lambda: slot_call.post(tensor))
        elif self.route is Route.NATIVE:  # declines until the ranks agreed the plan
            work = worker.post_to_lane_if_idle(self.key, lambda: lane.post(self.group, self.a, self.spec, tensor,
                                                                      cast(str, self.name)))
        if work is not None:
            return work
        flat_ = tensor.view(-1)
        handle = route.run(self.route, self.group, dataclasses.replace(self.a, src=flat_, out=flat_), self.spec, tensor)
        assert handle is not None  # (an asynchronous spec)
        return handle


def prepare_all_reduce(group, tensor: torch.Tensor, spec: CallSpec) -> Optional[Prepared]:
    """A :class:`Prepared` all-reduce of tensors like ``tensor`` on ``group`` (a private group), or
    None where a call must take the full path each time: not on the CPU, error feedback (its
    residuals are the caller's per call), a synchronous spec, or arguments that are wrong (the full
    path then reports that on every rank)."""
    try:
        a = args.all_reduce_call(group, tensor, spec)
    except Exception:  # noqa: BLE001 - raised again, in step on every rank, by the full path
        return None
    if a.src.device.type != "cpu" or a.feedback is not None or spec.async_op is not True:
        return None
    return Prepared(group, a, spec)

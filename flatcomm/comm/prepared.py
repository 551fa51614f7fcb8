"""An all-reduce checked once and posted again for every tensor of the same numel and dtype.

The flatcomm backend's reductions repeat their shapes step after step (a loss, a metric, each DDP
bucket), and everything the argument layers check (codec, mode, op, sizes, the shard plan, the call
header's fields) depends on the shape, not on the values: ~100 us of Python per call, on the
caller's thread (for DDP, the autograd thread, with the backward pass waiting). A :class:`Prepared`
call keeps the first call's checked :class:`flatcomm.comm.args.Call` and runs each later call from
it, on the same paths, rows, checks and kernels as :func:`flatcomm.comm.flat.all_reduce`, so with
the same bits and errors:

* a native call on an agreed plan: on the group's native lane (:mod:`flatcomm.comm.lane`), posted
  from the caller's thread while the group's worker is idle, returning a C++ ``dist.Work``;
* in the header's payload slot (:mod:`flatcomm.comm.small`), posted from the caller's thread: the
  call number, the payload copied into the row, the exchange (an ordered fp32 one as one op,
  :mod:`flatcomm.comm.small_native`, returning a C++ ``dist.Work``);
* else the gathered or the pipelined path, queued on the group's worker.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Optional, Tuple, Union, cast

import torch
import torch.distributed as dist

from . import args, flat, lane, p2p, small, small_native, worker
from .spec import CallSpec

__all__ = ["Prepared", "prepare_all_reduce"]


class Prepared:
    """The checked all-reduce ``a`` on ``group`` (a private group), posted again by :meth:`post`."""

    def __init__(self, group, a: args.Call, spec: CallSpec):
        self.group, self.spec = group, spec
        self.in_slot = small.fits_all_reduce(group, a, spec.mode) and small.in_slot(group, a, spec.mode)
        self.what = f"all_reduce of {a.src.numel()} values ({a.codec.name})"
        self.native = self._native_post(group, a, spec.mode)
        none = a.src.new_empty(0)  # each post gives its tensor: the first one is not kept alive here
        self.a = dataclasses.replace(a, src=none, out=none)

    @staticmethod
    def _native_post(group, a: args.Call, mode: str) -> Optional[Tuple[Callable, str]]:
        """(post, the group's name in torch's registry) of the native path the call takes, if any:
        the small ordered call in the slot, else the lane (a small call takes the small path first,
        as flat.checked_all_reduce does); the lane's post may still decline (no agreed plan yet)."""
        if small.fits_all_reduce(group, a, mode):
            name = small_native.name_if_native(group, a, mode, small.in_slot(group, a, mode))
            return (small_native.post, name) if name is not None else None
        return (lane.post, cast(str, p2p.native_name(group))) if flat.runs_natively(group, a, mode) else None

    def post(self, tensor: torch.Tensor) -> Union[worker.Handle, dist.Work]:
        """Start the all-reduce of ``tensor`` (contiguous, the prepared numel and dtype): natively
        while the group's worker is idle (a ``dist.Work``: the small call in the slot,
        :mod:`flatcomm.comm.small_native`, or the lane once it is an agreed plan,
        :mod:`flatcomm.comm.lane`); else in the slot through :func:`flatcomm.comm.small.run`
        (posted from this thread while the group's worker is idle, else queued there in order);
        any other through :func:`flatcomm.comm.flat.checked_all_reduce`."""
        flat_ = tensor.view(-1)
        if self.native is not None:  # posted from this thread while the group's worker is idle
            post, name = self.native
            work = worker.post_if_idle(worker.key_of(self.group),
                                       lambda: post(self.group, self.a, self.spec, tensor, name))
            if work is not None:
                return work
        if self.in_slot:
            handle = small.run(self.group, self.a, True, small.all_reduce_parts(self.a, self.spec.mode, flat_),
                               self.spec, (flat_,), self.what, tensor)
        else:
            handle = flat.checked_all_reduce(self.group, dataclasses.replace(self.a, src=flat_, out=flat_),
                                             self.spec, tensor)
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

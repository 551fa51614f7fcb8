"""The small path's commonest calls in C++: an all-reduce whose values fit the call header's payload
slot (:mod:`flatcomm.comm.small`), ordered or exact, of fp32, bf16 or fp16 values, posted as one op
(csrc/comm/slot_all_reduce.cpp).

The op copies the values into this rank's row, posts the rows' all-gather, and when it completes
compares the rows and sums the payloads into the tensor, on gloo's thread (ordered: in ascending
rank order in fp32, rounded once into a bf16 / fp16 tensor; exact: the ``exact_sum`` op and the Python path's ATen ops after it), then completes a
C++ ``dist.Work``: the same exchange, checks and bits as the Python small path, without the Python
that took ~150 us of a 4 KB call on the caller's thread and ~80 us more to complete it. A
disagreement goes to :mod:`flatcomm.comm.native_calls` for the header's error, the same on every
rank.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from . import groups, header, native_calls, p2p
from .args import Call
from .layout import CommStats
from .small import payload_bytes
from .spec import CallSpec
from ..ops.native import ops

__all__ = ["SlotCall", "name_if_native"]

_DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}  # the codec of each


def name_if_native(group, a: Call, mode: str, in_slot: bool) -> Optional[str]:
    """The group's name in torch's registry (what the op resolves it by) when an all-reduce with
    these checked arguments runs natively here: in the slot on fp32, bf16 or fp16 CPU values, no
    error feedback, a group that exchanges, and either exact mode or ordered with the codec of the
    values' own dtype (no conversion on the wire); else None."""
    ordered = mode == "ordered" and a.codec.name == _DTYPES.get(a.src.dtype)
    exact = mode == "exact" and a.src.dtype in _DTYPES
    if not (in_slot and (ordered or exact) and a.src.device.type == "cpu" and a.feedback is None
            and groups.exchanges(group)):
        return None
    return p2p.native_name(group)


class SlotCall:
    """A prepared all-reduce on the small-native route (:func:`name_if_native`): what every call of
    its shape posts the same (the group's lane and name, this rank's header row with call number 0,
    the exact grid, the bytes it sends) kept from the first call, so a call is its number, its row
    and the op."""

    def __init__(self, group, a: Call, spec: CallSpec, numel: int, name: str):
        self.group, self.name, self.fields, self.world = group, name, a.fields, a.world
        self.lane = native_calls.lane_of(group)
        self.template = native_calls.template_row(group, a.fields)
        self.scale, self.headroom = a.scale, a.headroom
        self.block = a.exact_block if spec.mode == "exact" else 0
        self.stats = spec.stats if isinstance(spec.stats, CommStats) else None
        self.wire_bytes = payload_bytes(a, spec.mode, numel) * (a.world - 1)

    def post(self, tensor: torch.Tensor) -> dist.Work:
        """Post the all-reduce of ``tensor`` (contiguous, the prepared numel and dtype). Called under
        :func:`flatcomm.comm.worker.post_if_idle` (nothing of the group in flight): it reads the values
        now and writes the sum when the rows are in, in call order. Counted on the group's lane, which
        the worker and later lane calls wait for."""
        group = self.group
        token, mine, table = native_calls.record(group, None, self.fields, 0, self.world, self.template)
        work = native_calls.launched(group, token, lambda: ops.slot_all_reduce(
            tensor, tensor, self.name, table, mine, header.WIDTH, header.SLOT_OFFSET, self.scale, token, self.lane,
            self.block, self.headroom))
        if self.stats is not None:  # (the exchange is not timed: that would take Python)
            self.stats.calls += 1
            self.stats.wire_bytes += self.wire_bytes
        return work

"""The native lane of a CPU group: where the flatcomm backend's agreed all-reduces run, in C++.

A prepared all-reduce (:mod:`flatcomm.comm.prepared`) on an agreed plan that runs natively
(:mod:`flatcomm.comm.agreed`) is posted here from the caller's thread, with its call header's row:
one op (csrc/cpu/lane.cpp) posts the header exchange, watches it as an early call's, and queues the
call on the group's lane thread, which runs the native all-reduce, checks the rows and completes a
``dist.Work`` that DDP's reducer reads in C++. A call costs Python only while it is posted: no
worker thread to wake, no Python between one bucket's op and the next, no Python callbacks.

Order: a call is posted to the lane only while nothing is queued or running on the group's Python
worker (:func:`flatcomm.comm.worker.post_if_idle`), and the worker drains the lane before each of
its own calls. So the group's calls still run one at a time, in call order, as on the worker
alone, and each rank issues its exchanges in the same order.

Failures: only then does Python see a call (:func:`on_disagreement`, :func:`verdict`): its
:class:`~flatcomm.comm.header.CallHeader` is built from the row and table the call kept, and
settled as an early call's (its fills made, :func:`flatcomm.comm.agreed.fill`); the call raises the
header's error, the same on every rank, or the op's own error once the header is settled.
"""
from __future__ import annotations

import collections
import itertools
import threading
import weakref
from typing import Deque, Dict, Optional, Tuple

import torch
import torch.distributed as dist

from . import agreed, context, groups, header, worker
from .args import Call
from .header_table import OK, row, set_early
from .pipeline import CommStats
from .spec import CallSpec
from ..ops.native import extension, ops

__all__ = ["on_disagreement", "post", "verdict"]

_POSTED = "lane posts"  # context slot: the lane's calls Python may still have to settle
_tokens = itertools.count(1)
_lock = threading.Lock()  # _CALLS and _HEADERS: the callers', gloo's and the lanes' threads
# token -> what the call's header is built from, until the lane is seen past the call
_CALLS: Dict[int, tuple] = {}
_HEADERS: Dict[int, header.CallHeader] = {}  # token -> its header, once built


class _Posted:
    """A lane's posted calls (sequence number, token), dropped once the lane finished them."""

    def __init__(self, key: int):
        self.key, self.count = key, 0
        self.tokens: Deque[Tuple[int, int]] = collections.deque()

    def prune(self, done: Optional[int] = None) -> None:
        """Forget the calls the lane finished (``done``: how many; default, ask it)."""
        done = extension.lane_completed(self.key) if done is None else done
        with _lock:
            while self.tokens and self.tokens[0][0] < done:
                token = self.tokens.popleft()[1]
                _CALLS.pop(token, None)
                _HEADERS.pop(token, None)

    def close(self) -> None:
        """The group is destroyed: end its lane, forget every call."""
        extension.lane_close(self.key)
        self.prune(done=self.count)


def _posted(group, ctx: context.GroupContext) -> _Posted:
    def make() -> _Posted:
        posted = _Posted(ctx.token)
        timeout = groups.group_timeout(group) or dist.distributed_c10d.default_pg_timeout
        ctx.set(worker.LANE_TIMEOUT, timeout.total_seconds())
        ctx.on_close(posted.close)
        return posted

    return ctx.slot(_POSTED, make)


def post(group, a: Call, spec: CallSpec, tensor: torch.Tensor, name: str) -> Optional[dist.Work]:
    """Post the all-reduce of ``tensor`` (its checked arguments ``a``, a call that
    :func:`flatcomm.comm.flat.runs_natively`; ``name``: its group's name in torch's registry) to
    the lane, or None where it must take the worker's path (no agreed plan yet, no header
    exchange). Called under :func:`flatcomm.comm.worker.post_if_idle`."""
    plan = agreed.plan_id(group, a.fields)
    if plan == 0 or a.plan is None or not groups.exchanges(group):
        return None
    posted = _posted(group, context.of(group))
    posted.prune()
    fields = list(a.fields) + [("agreed plans", agreed.count(group))]
    call = header.next_call(group)
    mine = row(call, OK, fields, header.FIELDS, "", header.slot_of(group))
    set_early(mine, len(header.FIELDS), plan)
    table = torch.empty(a.world, mine.numel(), dtype=torch.int64)
    token = next(_tokens)
    with _lock:
        _CALLS[token] = (weakref.ref(group), a.fields, fields, call, mine, table, plan)
    p, flat = a.plan, tensor.view(-1)
    pieces = [p.bounds[d] + x for d in range(p.world) for x in p.chunk_bounds[d]]
    if isinstance(spec.stats, CommStats):  # (exchange_s is not timed on the lane: that would take Python)
        shard = p.bounds[p.rank + 1] - p.bounds[p.rank]
        spec.stats.calls += 1
        spec.stats.wire_bytes += (flat.numel() - shard + shard * (p.world - 1)) * flat.element_size()
    try:
        work = ops.lane_all_reduce(flat, tensor, name, pieces, a.chunks, a.scale, agreed.tag_base(plan), table, mine,
                                   header.WIDTH, token, posted.key)
    except BaseException:
        with _lock:
            _CALLS.pop(token, None)
        raise
    posted.tokens.append((posted.count, token))
    posted.count += 1
    return dist.Work.unbox(work)


def _header(token: int, failed: Optional[str] = None) -> Optional[header.CallHeader]:
    """The header of a lane call, built the first time Python needs it (None: its group is gone)."""
    with _lock:
        h = _HEADERS.get(token)
        if h is None and token in _CALLS:
            ref, agree, fields, call, mine, table, plan = _CALLS[token]
            group = ref()
            if group is None:
                return None
            h = _HEADERS[token] = header.CallHeader.exchanged(group, agree, fields, call, mine, table, plan, failed)
        return h


def on_disagreement(token: int) -> None:
    """Called from C++ (gloo's thread) when a lane call's rows disagree: settle its header now
    (its fills go out, which an early peer's transfers may be waiting for)."""
    h = _header(token)
    if h is not None:
        h.settle()  # (no wait here, on gloo's thread: the call waits for the fills)


def verdict(token: int, failed: Optional[str], exchange: Optional[str]) -> Optional[Tuple[str, str]]:
    """Called from C++ (the lane's thread) when a call failed, its header exchange settled: the
    (exception type, message) its Work fails with; None: the rows agreed after all. ``failed``:
    the op's own error (raised as it is, once the header is settled); ``exchange``: the header
    exchange's error."""
    h = _header(token, exchange)
    if h is None:
        return ("RuntimeError", "flatcomm: the process group of a lane call was destroyed before its header was checked")
    if failed is not None:
        h.abandoned()
        return None
    try:
        h.finish()
    except Exception as e:  # noqa: BLE001 - the header's error, raised by the lane's Work
        return (type(e).__name__, str(e))
    return None

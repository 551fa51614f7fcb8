"""The way back into Python of flatcomm's native calls (csrc/comm/native_work.h): the lane's agreed
all-reduces (:mod:`flatcomm.comm.lane`) and the small ones in one exchange
(:mod:`flatcomm.comm.small_native`), and the id of the group's lane both post to (:func:`lane_of`).

A native call posts its call header from C++ and checks it there; Python keeps only what its
:class:`~flatcomm.comm.header.CallHeader` would be built from (:func:`record`, then
:func:`launched`). Only when the call
fails does C++ call back: :func:`on_disagreement` (gloo's thread, the rows arrived and differ: the
header is settled at once, so an early peer's transfers get their fills) and :func:`verdict` (what
the call's Work fails with). A record holds the row and the table, never the caller's tensor; it is
dropped once :data:`KEEP` more calls finished (a finished exchange's tensors freed last on gloo's
thread would take the GIL there), or with its group.
"""
from __future__ import annotations

import collections
import itertools
import threading
import weakref
from typing import Callable, Deque, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from . import context, groups, header, worker
from .header_table import OK, row, set_early
from ..ops.native import extension

__all__ = ["KEEP", "lane_of", "launched", "on_disagreement", "record", "template_row", "verdict"]

KEEP = 8  # finished calls whose records stay (see the module's docstring)
_TRACKED = "native calls"  # context slot: True once the group's records go when it is destroyed
_tokens = itertools.count(1)
_lock = threading.Lock()  # _CALLS and _HEADERS: the callers', gloo's and the lanes' threads
_CALLS: Dict[int, tuple] = {}  # token -> what the call's header is built from
_HEADERS: Dict[int, header.CallHeader] = {}  # token -> its header, once built


def lane_of(group) -> int:
    """The id of the group's lane: its worker key. The first time, the group's timeout is kept for
    the worker's drains (which marks the group as having a lane) and the lane closes with it."""
    ctx = context.of(group)
    if ctx.get(worker.LANE_TIMEOUT) is None:
        timeout = groups.group_timeout(group) or dist.distributed_c10d.default_pg_timeout
        ctx.set(worker.LANE_TIMEOUT, timeout.total_seconds())
        key = ctx.token
        ctx.on_close(lambda: extension.lane_close(key))
    return ctx.token


def template_row(group, fields: Sequence[Tuple[str, int]]) -> torch.Tensor:
    """This rank's header row of ``fields`` with call number 0: what :func:`record` copies for a
    prepared call instead of building the row each time."""
    return row(0, OK, fields, header.FIELDS, "", header.slot_of(group))


def record(group, agree: Optional[Sequence[Tuple[str, int]]], fields: Sequence[Tuple[str, int]], early: int,
           world: int, template: Optional[torch.Tensor] = None) -> Tuple[int, torch.Tensor, torch.Tensor]:
    """A native call's header: its number (taken in call order, under the group's idle worker),
    this rank's row of ``fields`` (``early``: the plan it runs on before its check, else 0; a
    ``template`` from :func:`template_row`: copied) and the table for every rank's, kept under a new
    token. Returns (token, row, table)."""
    call = header.next_call(group)
    if template is not None:
        mine = template.clone()
        mine[1] = call  # (the call number's place in a row: header_table.row)
    else:
        mine = row(call, OK, fields, header.FIELDS, "", header.slot_of(group))
    if early:
        set_early(mine, len(header.FIELDS), early)
    table = torch.empty(world, mine.numel(), dtype=torch.int64)
    token = next(_tokens)
    with _lock:
        _CALLS[token] = (weakref.ref(group), agree, list(fields), call, mine, table, early)
    return token, mine, table


def launched(group, token: int, launch: Callable[[], torch.ScriptObject]) -> dist.Work:
    """``launch()``, the op that posts the call of ``token``, as a ``dist.Work`` (the record is
    dropped if it raises); then the records of the calls that finished before the last
    :data:`KEEP` are dropped."""
    try:
        work = launch()
    except BaseException:
        _drop([token])
        raise
    _track(group)
    finished = extension.native_finished()
    with _lock:
        _FINISHED.extend(finished)
        while len(_FINISHED) > KEEP:
            _forget_locked(_FINISHED.popleft())
    return dist.Work.unbox(work)


_FINISHED: Deque[int] = collections.deque()  # tokens of finished calls whose records still stay


def _forget_locked(token: int) -> None:
    _CALLS.pop(token, None)
    _HEADERS.pop(token, None)


def _drop(tokens: List[int]) -> None:
    with _lock:
        for token in tokens:
            _forget_locked(token)


def _track(group) -> None:
    """The first time: drop the group's records when it is destroyed (and those of groups gone)."""
    ctx = context.of(group)
    if not ctx.get(_TRACKED):
        ctx.set(_TRACKED, True)
        ref = weakref.ref(group)

        def closing() -> None:
            with _lock:
                gone = [t for t, rec in _CALLS.items() if rec[0]() is None or rec[0]() is ref()]
            _drop(gone)

        ctx.on_close(closing)


def _header(token: int, failed: Optional[str] = None) -> Optional[header.CallHeader]:
    """The header of a native call, built the first time Python needs it (None: its group is gone)."""
    with _lock:
        h = _HEADERS.get(token)
        if h is None and token in _CALLS:
            ref, agree, fields, call, mine, table, early = _CALLS[token]
            group = ref()
            if group is None:
                return None
            h = _HEADERS[token] = header.CallHeader.exchanged(group, agree, fields, call, mine, table, early, failed)
        return h


def on_disagreement(token: int) -> None:
    """Called from C++ (gloo's thread) when a native call's rows disagree: settle its header now
    (its fills go out, which an early peer's transfers may be waiting for)."""
    h = _header(token)
    if h is not None:
        h.settle()  # (no wait here, on gloo's thread: the call waits for the fills)


def verdict(token: int, failed: Optional[str], exchange: Optional[str]) -> Optional[Tuple[str, str]]:
    """Called from C++ when a native call failed, its header exchange settled: the (exception
    type, message) its Work fails with; None: the rows agreed after all. ``failed``: the op's own
    error (raised as it is, once the header is settled); ``exchange``: the header exchange's."""
    h = _header(token, exchange)
    if h is None:
        return ("RuntimeError", "flatcomm: the process group of a native call was destroyed before its header was "
                                "checked")
    if failed is not None:
        h.abandoned()
        return None
    try:
        h.finish()
    except Exception as e:  # noqa: BLE001 - the header's error, raised by the call's Work
        return (type(e).__name__, str(e))
    return None


# What C++ calls back on a failure (csrc/comm/native_work.h): installed here, not imported by name.
extension.set_callback("native_calls.verdict", verdict)
extension.set_callback("native_calls.on_disagreement", on_disagreement)

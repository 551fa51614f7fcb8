"""flatcomm's own process groups: one private copy of every group a caller names, with its timeout.

flatcomm's collectives run on a worker thread, several exchanges per call, while the caller keeps
issuing its own collectives (a loss all-reduce, DDP's bucket rebuild, FSDP's all-gathers). Two
threads issuing collectives on one group interleave them in a different order on different ranks,
and a backend pairs collectives by issue order: a deadlock, or garbage, until the timeout. So the
traffic of a group G runs on a private group with G's ranks, created once per G and cached.

``dist.new_group`` is itself a collective of G's members (all ranks when G is the world), so the
private group is made on the caller's thread at the first flatcomm call that names G: a point
every rank reaches in the same order, as torch requires of group creation. Never on a worker.

The private group inherits G's timeout (``dist.new_group`` would otherwise use torch's 30-minute
default, far above the ``init_process_group`` timeout a user chose), or takes ``timeout=``.

The private group lives in the parent's context (:mod:`flatcomm.comm.context`, held weakly) and is
destroyed (unregistered from torch, its worker joined) when the parent is destroyed: at once through
the ``flatcomm`` backend's ``shutdown`` (:func:`forget`), else when the next group gets a context
(``destroy_process_group`` of a plain gloo group calls no hook of ours). At exit it is let go of: a gloo group's worker threads are joined only by its destructor, and a
thread still dropping a finished op's tensors needs the GIL, which it cannot take once the
interpreter is finalizing (torch 2.13 aborts the process: "terminate called without an active
exception"). So flatcomm keeps no group alive past ``destroy_process_group`` or the atexit handlers.
"""
from __future__ import annotations

import atexit
import gc
import threading
import time
import weakref
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

from . import context, standalone, wire

__all__ = ["EXCHANGE_ALONE", "exchanges", "forget", "generation", "has_private", "group_timeout", "is_private", "private_group",
           "settle_at_exit", "SMALL_SLOT"]

_lock = threading.Lock()
_PRIVATE = "private group"  # the slot of a parent's context that holds its private group
SMALL_SLOT = "small slot"  # context slot of a private group: its call header rows carry a payload slot
_owned: "weakref.WeakSet" = weakref.WeakSet()  # the private groups
_used = False  # whether this process made a private group (settle_at_exit has work to do)
on_worker = context.on_worker  # .key and .active set on flatcomm's worker threads (flatcomm.comm.worker)
# Tests only: exchange through torch.distributed even with one rank (normally a local copy), so a
# one-GPU machine runs the NCCL calls and their stream hand-offs (benchmarks/gpu_check.py).
EXCHANGE_ALONE = False


def exchanges(group) -> bool:
    """Whether a call on ``group`` moves data through the backend (more than one rank)."""
    return dist.get_world_size(group) > 1 or EXCHANGE_ALONE


def _parent(group):
    return group if group is not None else dist.group.WORLD


def group_timeout(group=None) -> Optional[timedelta]:
    """The operation timeout of ``group`` (default: the world), None where the backend hides it.

    torch 2.13 exposes it as ``group._get_backend(device).options._timeout`` (what
    ``init_process_group(timeout=)`` / ``new_group(timeout=)`` set); there is no public getter.
    """
    pg = _parent(group)
    for dev in (torch.device("cpu"), torch.device("cuda")):
        try:
            t = pg._get_backend(dev).options._timeout
        except Exception:  # noqa: BLE001 - no backend for that device, or another backend kind
            continue
        if isinstance(t, timedelta):
            return t
    return None


def _alive(pg) -> bool:
    try:  # a destroyed group (destroy_process_group) is no longer registered
        dist.get_process_group_ranks(pg)
        return True
    except Exception:  # noqa: BLE001
        return False


def is_private(group) -> bool:
    return group is not None and (group in _owned or (standalone.is_standalone(group) and
                                                      standalone.private_of(group) is group))


def has_private(group) -> bool:
    """Whether flatcomm already made its private copy of ``group`` (default: the world)."""
    ctx = context.existing(_parent(group))
    cached = ctx.get(_PRIVATE) if ctx is not None else None
    return cached is not None and _alive(cached)


def forget(group) -> None:
    """Drop what flatcomm keeps for ``group``, its private group destroyed (called when ``group`` is
    destroyed)."""
    _bump()
    context.drop(group)


_generation = 0  # bumped whenever a private group is made or dropped (see generation())


def generation() -> int:
    """A number that changes whenever any private group is made or dropped: what a lookup cached
    per call shape compares instead of asking :func:`private_group` again on every call."""
    return _generation


def _bump() -> None:
    global _generation
    _generation += 1


def settle_at_exit() -> None:
    """Before finalization: drop every cached private group and give gloo's threads the GIL.

    Groups only flatcomm referenced are destroyed here (their destructors release the GIL and join
    the threads); a thread of a group the program still holds that is finishing an op's clean-up
    gets the GIL while this sleeps. Plain gloo has the same exit race (1 of 40 torchrun runs of a
    DDP script aborted here); 20 ms at exit closes it for the threads already waiting."""
    if not _used:
        return
    context.close_all()
    gc.collect()
    time.sleep(0.02)


atexit.register(settle_at_exit)


def private_group(group=None, *, timeout: Optional[timedelta] = None):
    """flatcomm's own group for ``group`` (default: the world): the same ranks, created on the
    first call (a collective of ``group``'s members: call it where every member does, in the same
    order as their other group creations), then cached. A group this function returned is its own
    private group. ``timeout``: its operation timeout (default: ``group``'s own); given for an
    existing group, it replaces that group's timeout on this rank.

    With one rank nothing is exchanged and ``group`` itself is returned."""
    if standalone.is_standalone(group):  # made with its private copy (flatcomm.comm.standalone)
        group = standalone.private_of(group)
    if is_private(group):
        if timeout is not None:
            group.set_timeout(timeout)
        return group
    parent = _parent(group)
    if dist.get_world_size(parent) == 1:
        return group
    global _used
    ctx = context.of(parent)
    with _lock:
        cached = ctx.get(_PRIVATE)
        if cached is not None and _alive(cached):
            if timeout is not None:
                cached.set_timeout(timeout)
            return cached
        if getattr(on_worker, "active", False):
            raise RuntimeError(
                "flatcomm: the private group of a process group must be created on the caller's thread "
                "(a collective), not inside a flatcomm callback: make one flatcomm call on that group "
                "first, or pass flatcomm.comm.private_group(group) explicitly")
        ranks = dist.get_process_group_ranks(parent)
        t = timeout if timeout is not None else group_timeout(parent)
        # Members only synchronise when the parent is a subgroup: non-members never get here.
        pg = dist.new_group(ranks, timeout=t, use_local_synchronization=len(ranks) != dist.get_world_size(),
                            group_desc="flatcomm")
        try:
            wire.handshake(pg, len(ranks))  # before any call header travels on it
        except Exception:
            dist.destroy_process_group(pg)
            raise
        ctx.set(_PRIVATE, pg)
        _bump()
        # The flatcomm backend's groups carry small reductions in their call headers (a payload slot
        # in every row, flatcomm.comm.header); elsewhere those bytes would go with every large call.
        context.of(pg).set(SMALL_SLOT, dist.get_backend(parent) == "flatcomm")
        def close_private() -> None:
            _bump()
            context.destroy(pg, wait=ctx.waits)

        ctx.on_close(close_private)
        _owned.add(pg)
        _used = True
        return pg

"""``flatcomm`` as a torch.distributed backend: ``import flatcomm.backend``, then
``dist.init_process_group("flatcomm")`` (or ``"cpu:flatcomm"``) and every float sum the program makes
(DDP, FSDP2, DTensor, functional collectives, its own ``dist.all_reduce``) is flatcomm's ordered or
exact sum; everything else runs on the inner gloo / NCCL. Guarantees, costs and limits:
``docs/backend.md``; settings: :mod:`flatcomm.backend.settings`.
"""
from __future__ import annotations

import torch.distributed as dist

from . import reduce as _reduce
from .group import NAME, FlatcommGroup, create
from .settings import Settings, configure, settings_for
from .._snapshot import Snapshot

__all__ = ["NAME", "FlatcommGroup", "Settings", "configure", "route", "settings_for", "stats"]


def route(tensor, op=dist.ReduceOp.SUM, group=None) -> str:
    """The route an all-reduce of ``tensor`` with ``op`` takes on ``group`` (default: the world)
    under its current settings, without running it: ``"small-native"``, ``"small"``,
    ``"gathered"``, ``"native"``, ``"pipelined"``, ``"exact"``, ``"passed-through"`` or
    ``"full"`` (docs/backend.md, "Routes"; ``stats(group)["routes"]`` counts the calls by route).
    A collective of the group's members (the first call makes flatcomm's private group)."""
    return _reduce.route(_group(group, "route"), tensor, op)


def _group(group, what: str) -> FlatcommGroup:
    pg = group if group is not None else dist.group.WORLD
    if not isinstance(pg, FlatcommGroup):
        got = "no default group (init_process_group not called)" if pg is None else type(pg).__name__
        raise TypeError(f"flatcomm.backend.{what}: not a group of the flatcomm backend: {got}")
    return pg


def stats(group=None) -> Snapshot:
    """What flatcomm's reductions on ``group`` (default: the world) sent and took so far: the
    group's :attr:`FlatcommGroup.stats` snapshot, the same type as DDP's, FSDP's and DiLoCo's.

    Args:
        group: a group made with the ``flatcomm`` backend (default: the world).

    Example::

        dist.init_process_group("flatcomm")
        dist.all_reduce(torch.ones(1000))
        flatcomm.backend.stats().wire_bytes
    """
    return _group(group, "stats").stats

if NAME.upper() not in dist.Backend._plugins:
    dist.Backend.register_backend(NAME, create, extended_api=True, devices=["cpu", "cuda"])

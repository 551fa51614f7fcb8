"""The checks of :class:`~flatcomm.elastic.ElasticDiLoCo`'s arguments that need more than a line."""
from __future__ import annotations

import math
import numbers
from typing import Any

from .group import QuorumGroup
from .island import Island

__all__ = ["check_manager", "positive"]


def positive(v: Any, what: str, integer: bool = False) -> Any:
    ok = not isinstance(v, bool) and isinstance(v, numbers.Integral if integer else numbers.Real)
    if not ok or not math.isfinite(float(v)) or v < (1 if integer else 0):
        raise ValueError(f"flatcomm.elastic: {what} must be {'an int >= 1' if integer else 'a finite number >= 0'}, "
                         f"got {v!r}")
    return int(v) if integer else float(v)


def check_manager(manager, island: Island) -> QuorumGroup:
    pg = getattr(manager, "_pg", None)  # torchft 0.2 has no public getter for it
    if not isinstance(pg, QuorumGroup):
        raise TypeError(f"flatcomm.elastic: the manager's process group must be a flatcomm.elastic.QuorumGroup "
                        f"(torchft.Manager(pg=QuorumGroup(timeout=...), ...), or flatcomm.elastic.make_manager), "
                        f"got {type(pg).__name__}")
    if getattr(manager, "_use_async_quorum", True):
        raise ValueError("flatcomm.elastic: the manager must be made with use_async_quorum=False: a replica "
                         "heals before its sync's exchange, not during it")
    made = (getattr(manager, "_group_rank", 0), getattr(manager, "_group_world_size", 1))
    if made != (island.rank, island.size):
        raise ValueError(f"flatcomm.elastic: the manager was made for rank {made[0]} of an island of {made[1]}, "
                         f"but this rank is {island.rank} of {island.size} in the island's group "
                         f"(make_manager(..., island=group))")
    return pg

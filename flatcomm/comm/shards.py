"""How a flat tensor is cut: into contiguous shards across ranks (and a shard into chunks), each
starting on a multiple of the codec's alignment. Every rank derives the same cuts from the call's
signature, so both ends of a transfer agree on its size (:mod:`flatcomm.comm.pipeline`,
:mod:`flatcomm.comm.agreed`)."""
from __future__ import annotations

import math
from typing import List

__all__ = ["shard_bounds"]


def shard_bounds(numel: int, world: int, align: int = 1) -> List[int]:
    """Boundaries of ``world`` contiguous shards of ``numel`` values, starting on multiples of
    ``align`` (so codec blocks and exact-mode blocks line up with the global tensor)."""
    units = math.ceil(numel / align) if numel else 0
    per, extra = divmod(units, world)
    bounds = [0]
    for r in range(world):
        bounds.append(min(numel, bounds[-1] + (per + (1 if r < extra else 0)) * align))
    return bounds

"""Two-level (hierarchical) collectives: inside the node, then across nodes, over a
:class:`flatcomm.Topology`. How they work: :mod:`flatcomm.comm.two_level`. These entry points
are :func:`flatcomm.all_reduce` and friends with ``topology=`` first (``codec="auto"`` included);
the sizes of a two-level residual come from :func:`shard_numel` / :func:`shard_range`.
"""
from __future__ import annotations

from typing import Optional

import torch

from . import collectives
from .comm.topology import Topology
from .comm.two_level import (
    SEGMENT_BYTES,
    SEGMENT_PIECE,
    TieredFeedback,
    TierStats,
    default_segments,
    padded_shard,
    segments_of,
    shard_numel,
    shard_range,
    submit,
)
from .comm.worker import Handle

__all__ = ["SEGMENT_BYTES", "SEGMENT_PIECE", "TierStats", "TieredFeedback", "all_gather", "all_reduce",
           "default_segments", "padded_shard", "reduce_scatter", "segments_of", "shard_numel", "shard_range",
           "submit"]


def all_reduce(tensor: torch.Tensor, topology: Topology, **kwargs) -> Optional[Handle]:
    """Two-level all-reduce of ``tensor`` in place: ``flatcomm.all_reduce(tensor, topology=topology,
    **kwargs)`` (``codec``: across nodes, ``intra_codec``: inside the node)."""
    return collectives.all_reduce(tensor, topology=_two_level(topology), **kwargs)


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, topology: Topology, **kwargs) -> Optional[Handle]:
    """Two-level reduce-scatter: rank r gets shard r of the sum, as the flat one."""
    return collectives.reduce_scatter(output, input, topology=_two_level(topology), **kwargs)


def all_gather(output: torch.Tensor, input: torch.Tensor, topology: Topology, **kwargs) -> Optional[Handle]:
    """Two-level all-gather: across nodes with ``codec``, then inside the node with ``intra_codec``."""
    return collectives.all_gather(output, input, topology=_two_level(topology), **kwargs)


def _two_level(topology) -> Topology:
    if not isinstance(topology, Topology):
        raise TypeError(f"flatcomm: topology must be a flatcomm.Topology, got {type(topology).__name__}")
    if topology.flat:
        raise ValueError(f"flatcomm: {topology!r} is flat; call the flat collective on topology.group")
    return topology

"""The communication machinery, one layer above the kernels: flatcomm's private process groups,
the worker threads that run every collective in order, the call header every rank checks before
a payload moves, the chunk pipeline, and the flat (one-hop) and two-level (node, then across nodes)
collectives for a named codec, each taking its options as one frozen ``CallSpec``. The public
entry points, which build that spec, resolve ``codec="auto"`` and choose between the flat and
two-level paths, are in :mod:`flatcomm.collectives`, one layer up.
"""
from __future__ import annotations

from .args import ErrorFeedback, OpLike
from .groups import group_timeout, private_group
from .header import MODES
from .layout import CommStats
from .shards import shard_bounds
from .spec import CallSpec
from .topology import Topology
from .two_level import TieredFeedback, TierStats
from .worker import Handle

__all__ = ["CallSpec", "CommStats", "ErrorFeedback", "Handle", "MODES", "OpLike", "TierStats", "TieredFeedback", "Topology",
           "group_timeout", "private_group", "shard_bounds"]

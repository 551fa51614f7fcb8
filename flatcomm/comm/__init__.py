"""The communication machinery, one layer above the kernels: flatcomm's private process groups,
the worker threads that run every collective in order, the call header every rank checks before
a payload moves, the chunk pipeline, and the flat (one-hop) and two-level (node, then across nodes)
collectives for a named codec, each taking its options as one frozen ``CallSpec``. The public
entry points, which build that spec, resolve ``codec="auto"`` and choose between the flat and
two-level paths, are in :mod:`flatcomm.collectives`, one layer up.

Its own floors, bottom first (a module imports lower floors, or earlier modules of its own floor;
no import chain is longer than 8 modules: ``tests/test_layering.py``, ``COMM_FLOORS``):

1. **runtime**: per-group state (``context``), the version handshake (``wire``), standalone and
   private groups (``standalone``, ``groups``), profiler labels, CUDA streams, the worker threads
   (``worker``), the topology's groups and point-to-point transfers (``p2p``);
2. **fields**: what a call is, with no process group: its header's fields (``fields``), a row's
   layout and checks (``header_table``), its signature, its shards and chunks (``layout``) and its
   options (``spec``);
3. **header**: the call header's exchange and check (``header``) and the plans the ranks agreed
   through it (``agreed``);
4. **checks**: the argument checks (``args``) and a rejected call kept in step (``rejected``);
5. **algorithms**: the one-hop collectives in Python: the chunk pipeline, exact mode, the small
   path and the flat collectives (``flat``);
6. **native**: the calls C++ runs: the native lane and the small all-reduce in one op;
7. **route**: which route an all-reduce takes (``route``) and a call prepared once on it;
8. **two-level**: the node tier and the two-level collectives, on top of the one-hop ones.
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

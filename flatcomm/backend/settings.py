"""How the ``flatcomm`` backend reduces: one :class:`Settings` per process group, in one place.

Resolution order for a group: :func:`configure` on that group, else :func:`configure` with no group
(the default for every group), else the environment, read when the group's first reduction runs:

* ``FLATCOMM_BACKEND_MODE``: ``ordered`` (default: fixed rank order, the same bits whatever the
  message size, offset, bucketing or chunking) or ``exact`` (int64 fixed point: also independent
  of the ranks' order and of flat vs two-level);
* ``FLATCOMM_BACKEND_CODEC``: the wire codec of float reductions. Default: the tensor's own dtype
  (``fp32`` / ``bf16`` / ``fp16``, lossless). A lossy codec (``int8``...) is for gradients only, and a
  backend cannot tell gradients from a loss average, so set it per group with :func:`configure`;
* ``FLATCOMM_BACKEND_LOCAL_SIZE``: ranks per node; with more than one node the default group's
  reductions are two-level (inside the node, then across nodes).
"""
from __future__ import annotations

import dataclasses
import os
import threading
from typing import Any, Dict, Optional

from ..collectives import MODES
from ..comm import context
from ..comm.topology import Topology

__all__ = ["Settings", "configure", "entries", "settings_for", "topology_for"]

_ENV_MODE, _ENV_CODEC, _ENV_LOCAL = "FLATCOMM_BACKEND_MODE", "FLATCOMM_BACKEND_CODEC", "FLATCOMM_BACKEND_LOCAL_SIZE"


@dataclasses.dataclass(frozen=True)
class Settings:
    """``mode``: "ordered" or "exact"; ``codec``: None (each tensor's own dtype, lossless) or a
    flatcomm codec name; ``topology``: a :class:`flatcomm.Topology` over the group, or None (flat);
    ``local_size``: build that topology on the group's first reduction (the default group only)."""
    mode: str = "ordered"
    codec: Optional[str] = None
    topology: Optional[Topology] = None
    local_size: Optional[int] = None

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"flatcomm.backend: mode must be one of {MODES}, got {self.mode!r}")
        if self.codec is not None and not isinstance(self.codec, str):
            raise TypeError(f"flatcomm.backend: codec must be a codec name or None, got {self.codec!r}")
        if self.codec == "auto":
            raise ValueError("flatcomm.backend: codec='auto' is not offered: the tuner's choice may be lossy")
        if self.topology is not None and not isinstance(self.topology, Topology):
            raise TypeError(f"flatcomm.backend: topology must be a flatcomm.Topology, got {type(self.topology).__name__}")
        if self.local_size is not None and (isinstance(self.local_size, bool) or not isinstance(self.local_size, int)
                                            or self.local_size < 1):
            raise ValueError(f"flatcomm.backend: local_size must be a positive int, got {self.local_size!r}")


_lock = threading.Lock()
_SETTINGS, _TOPOLOGY = "backend settings", "backend topology"  # slots of a group's context
_default: Optional[Settings] = None  # configure() with no group: every group's default


_env_seen: Dict[Any, Settings] = {}  # the environment's values -> their Settings (read at every reduction)


def _from_env() -> Settings:
    key = (os.environ.get(_ENV_MODE), os.environ.get(_ENV_CODEC), os.environ.get(_ENV_LOCAL))
    if key not in _env_seen:
        _env_seen.clear()
        _env_seen[key] = _parse_env()
    return _env_seen[key]


def _parse_env() -> Settings:
    local = os.environ.get(_ENV_LOCAL)
    try:
        local_size = int(local) if local else None
    except ValueError:
        raise ValueError(f"flatcomm.backend: {_ENV_LOCAL} must be an int, got {local!r}") from None
    return Settings(mode=os.environ.get(_ENV_MODE, "ordered"), codec=os.environ.get(_ENV_CODEC) or None,
                    local_size=local_size)


def configure(group=None, *, mode: Optional[str] = None, codec: Optional[str] = None,
              topology: Optional[Topology] = None, local_size: Optional[int] = None) -> Settings:
    """Set how the flatcomm backend reduces on ``group`` (None: the default for every group that
    has no settings of its own). Unset keywords keep the group's current value (a group without
    settings of its own starts from the default's). Call it at a point
    every rank reaches, with the same values on every rank (a mismatch raises at the next reduction,
    on every rank: the call header compares mode and codec). Returns the group's new settings."""
    with _lock:
        old = _lookup(group)
        changes: Dict[str, Any] = {k: v for k, v in dict(mode=mode, codec=codec, topology=topology, local_size=local_size).items()
                   if v is not None}
        new = dataclasses.replace(old, **changes)
        if group is None:
            global _default
            _default = new
        else:  # kept in the group's context (flatcomm.comm.context): dropped when it is destroyed
            ctx = context.of(group)
            ctx.set(_SETTINGS, new)
            ctx.pop(_TOPOLOGY)
        return new


def _lookup(group) -> Settings:
    ctx = context.existing(group) if group is not None else None
    own = ctx.get(_SETTINGS) if ctx is not None else None
    if own is not None:
        return own
    return _default if _default is not None else _from_env()


def entries() -> int:
    """How many groups have settings of their own, plus the default if set (tests: destroyed
    groups leave none behind)."""
    return context.count_with(_SETTINGS) + (_default is not None)


def settings_for(group) -> Settings:
    """The settings of ``group`` (its own, else the default set with ``configure()``, else the env)."""
    with _lock:
        return _lookup(group)


def topology_for(group, settings: Settings, is_default: bool) -> Optional[Topology]:
    """The topology a reduction on ``group`` runs over: the configured one, else one built from
    ``local_size`` on the default group (its first reduction, which every rank reaches), else None."""
    if settings.topology is not None:
        return settings.topology
    if settings.local_size is None or not is_default:
        return None
    # Built once, under the context's lock (Topology creates groups: a collective every rank makes
    # once); dropped with the group.
    local_size = settings.local_size
    return context.of(group).slot(_TOPOLOGY, lambda: Topology(local_size, group=group))

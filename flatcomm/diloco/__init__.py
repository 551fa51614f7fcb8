"""DiLoCo and Streaming DiLoCo: data-parallel training across slow links.

Each replica takes ``sync_every`` (H) inner optimizer steps alone; then the replicas average the
*pseudo-gradient* (the weights at the last sync minus the weights now) with a compressed flatcomm
all-reduce with error feedback, and an outer SGD with Nesterov momentum, in fp32 on a master copy,
applies it (Douillard et al. 2023, "DiLoCo"). With ``fragments=k`` the model syncs in k parts, one
every H / k steps, each overlapped with ``fragment_sync_delay`` inner steps (Douillard et al. 2025,
"Streaming DiLoCo"). A training loop gains one line::

    outer = flatcomm.diloco.DiLoCo(model, opt, sync_every=50)   # hooks opt.step()

See docs/diloco.md for when it pays off, the options and the measurements.
"""
from .checkpoint import STATE_DICT_VERSION
from .outer import DiLoCo, FragmentStats
from .replica_state import ReplicaState
from .schedule import Schedule, split

__all__ = ["DiLoCo", "FragmentStats", "ReplicaState", "STATE_DICT_VERSION", "Schedule", "split"]

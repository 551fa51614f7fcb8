"""DiLoCo's options (:class:`Options`, as given to :class:`flatcomm.diloco.DiLoCo`) and the checks
of single options that need no configuration around them."""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch

from ..comm.topology import Topology
from . import replicas

__all__ = ["Options", "check_no_ddp"]


@dataclasses.dataclass(frozen=True)
class Options:
    """:class:`~flatcomm.diloco.DiLoCo`'s keyword options as given (checked when the DiLoCo is built); see DiLoCo's
    docstring for each."""

    sync_every: int
    codec: Any = "int4"
    mode: Optional[str] = None
    outer_lr: Optional[float] = None
    outer_momentum: Optional[float] = None
    nesterov: bool = True
    fragments: Any = 1
    fragment_sync_delay: int = 0
    fragment_update_alpha: float = 0.0
    group: Any = None
    error_feedback: bool = True
    residual_dtype: torch.dtype = torch.float32
    verify_every: int = 0
    topology: Optional[Topology] = None
    allow_ddp: bool = False
    error_decay: Optional[float] = None


def check_no_ddp(model: torch.nn.Module, group, allow_ddp: bool) -> None:
    """Refuse a DistributedDataParallel over ``model`` whose all-reduce spans replicas."""
    if not isinstance(allow_ddp, bool):
        raise TypeError(f"flatcomm.diloco: allow_ddp must be True or False, got {allow_ddp!r}")
    ranks = [] if allow_ddp else replicas.ddp_across_replicas(model, group)
    if ranks:
        raise ValueError(
            f"flatcomm.diloco: the model is wrapped in DistributedDataParallel over ranks {ranks}, which "
            f"hold several DiLoCo replicas: DDP would all-reduce every gradient at every inner step and "
            f"DiLoCo would sync on top, so the replicas never train alone (all the traffic of DDP, plus "
            f"DiLoCo's). Remove DDP: build DiLoCo on the bare module (model = ddp.module, the same "
            f"optimizer) and call that module in the training loop. Or make DDP run inside one replica "
            f"only (DDP(process_group=the ranks of one replica), DiLoCo(group=the ranks across replicas)). "
            f"If DDP's all-reduce is replaced by a hook that keeps the local gradient, pass allow_ddp=True")

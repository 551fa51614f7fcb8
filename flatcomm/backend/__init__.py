"""``flatcomm`` as a torch.distributed backend: ``import flatcomm.backend``, then
``dist.init_process_group("flatcomm")`` (or ``"cpu:flatcomm"``) and every float sum the program makes
(DDP, FSDP2, DTensor, functional collectives, its own ``dist.all_reduce``) is flatcomm's ordered or
exact sum; everything else runs on the inner gloo / NCCL. Guarantees, costs and limits:
``docs/backend.md``; settings: :mod:`flatcomm.backend.settings`.
"""
from __future__ import annotations

import torch.distributed as dist

from .group import NAME, FlatcommGroup, create
from .settings import Settings, configure, settings_for

__all__ = ["NAME", "FlatcommGroup", "Settings", "configure", "settings_for"]

if NAME.upper() not in dist.Backend._plugins:
    dist.Backend.register_backend(NAME, create, extended_api=True, devices=["cpu", "cuda"])

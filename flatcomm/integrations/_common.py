"""What the framework adapters share: registering flatcomm on the model a framework wrapped."""
from __future__ import annotations

from typing import Any, Dict, Optional

import torch


def fsdp_root(model: torch.nn.Module) -> Optional[torch.nn.Module]:
    """``model`` when it (or a submodule) was ``fully_shard``-ed, else None."""
    from torch.distributed.fsdp import FSDPModule

    return model if any(isinstance(m, FSDPModule) for m in model.modules()) else None


def register(model: torch.nn.Module, codec: Any, options: Dict[str, Any], fsdp_model: Optional[torch.nn.Module] = None):
    """flatcomm.ddp.register on a DistributedDataParallel ``model``, flatcomm.fsdp.apply on an
    FSDP2 model (``fsdp_model``: the root whose parameter names to use, default ``model``)."""
    import flatcomm.ddp
    import flatcomm.fsdp

    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return flatcomm.ddp.register(model, codec, **options)
    root = fsdp_root(fsdp_model if fsdp_model is not None else model)
    if root is not None:
        return flatcomm.fsdp.apply(root, codec, **options)
    raise TypeError(f"flatcomm: the framework's model is a {type(model).__name__}, neither "
                    f"DistributedDataParallel nor fully_shard-ed (FSDP2): nothing to register on. Run with "
                    f"more than one process and a DDP or FSDP2 strategy")

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


def _local_gradients(_, bucket):
    # Each rank is its own DiLoCo replica: DDP keeps this rank's gradient (no all-reduce, no division).
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def check_diloco_options(options: Dict[str, Any]) -> Dict[str, Any]:
    """``options`` for a DiLoCo of an adapter, checked when the adapter is made (not at the fit)."""
    if "sync_every" not in options:
        raise TypeError("flatcomm: DiLoCo needs sync_every= (inner steps between two syncs)")
    if "allow_ddp" in options:
        raise ValueError("flatcomm: the framework adapters replace DDP's all-reduce themselves; allow_ddp= is for "
                         "flatcomm.diloco.DiLoCo used directly")
    if "group" in options:
        raise ValueError("flatcomm: the framework adapters make every rank a DiLoCo replica of the world; "
                         "group= is for flatcomm.diloco.DiLoCo used directly (topology= is taken)")
    return options


def diloco_replica(wrapped: torch.nn.Module, module: torch.nn.Module, optimizer: Any, options: Dict[str, Any]):
    """A :class:`flatcomm.diloco.ReplicaState` of a new DiLoCo on ``module`` (the model a framework
    wrapped as ``wrapped``) trained by ``optimizer``: every rank is one replica. A
    ``DistributedDataParallel`` ``wrapped`` keeps its local gradients from now on (DiLoCo syncs
    every ``sync_every`` steps instead of DDP every step)."""
    from .. import diloco

    if fsdp_root(module) is not None:
        raise TypeError("flatcomm: the framework adapters run DiLoCo with every rank its own replica (a DDP or "
                        "plain model); an FSDP2 replica syncs its shards over a group of its own: build "
                        "flatcomm.diloco.DiLoCo(model, opt, group=mesh['replicate'].get_group(), ...) yourself "
                        "and save each rank's own model and optimizer shards (docs/diloco.md, Frameworks)")
    inner = getattr(optimizer, "optimizer", optimizer)  # Accelerate's AcceleratedOptimizer wraps the torch one
    if not isinstance(inner, torch.optim.Optimizer):
        raise TypeError(f"flatcomm: DiLoCo needs the framework's torch optimizer, got {type(optimizer).__name__}")
    check_diloco_options(options)
    # allow_ddp: DDP's all-reduce is replaced below by a hook that keeps the local gradient.
    outer = diloco.DiLoCo(module, inner, **options, allow_ddp=True)  # a configuration error raises before DDP changes
    if isinstance(wrapped, torch.nn.parallel.DistributedDataParallel):
        try:
            wrapped.register_comm_hook(None, _local_gradients)
        except BaseException:
            outer.close()  # (DDP takes one hook: e.g. flatcomm's own DDP hook is registered already)
            raise
    return diloco.ReplicaState(outer, module, inner)


def missing_diloco_state(what: str, entry: str, opt_in: str) -> ValueError:
    """The one error of the three adapters for a resume whose checkpoint lacks DiLoCo's state."""
    return ValueError(
        f"flatcomm: the {what} being resumed has no DiLoCo state ({entry} is missing: it was saved without "
        f"flatcomm's DiLoCo adapter). Resuming DiLoCo from step 0 would put its syncs out of step with the "
        f"restored training. To start DiLoCo afresh from the restored weights anyway, pass {opt_in}")

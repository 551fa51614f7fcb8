"""Hugging Face Accelerate: flatcomm on the model ``accelerator.prepare`` returned.

::

    from flatcomm.integrations.accelerate import register

    accelerator = Accelerator(cpu=True)                 # torchrun --nproc-per-node 2 ...
    model, opt = accelerator.prepare(model, opt)        # a DistributedDataParallel
    state = register(accelerator, model, "int8")        # flatcomm.ddp.State
    ...
    accelerator.save_state("ckpt")                      # every rank's flatcomm state included
    accelerator.load_state("ckpt")                      # each rank gets its own part back

Accelerate's ``DistributedDataParallelKwargs(comm_hook=)`` takes only its own enum of torch hooks,
so :func:`register` calls :func:`flatcomm.ddp.register` on the prepared model itself (or
:func:`flatcomm.fsdp.apply` on a ``fully_shard``-ed one). ``register_for_checkpointing`` saves a
custom object's ``state_dict()`` from the main process only; the object registered here returns
every rank's state (:func:`flatcomm.rank_states.gathered_state_dict`: ``save_state`` calls it on every
rank) and loads this rank's part (same world size: bit for bit; DDP at another world size: resharded).
Register flatcomm before ``load_state``, and in the same order among the other registered objects
as in the run that saved (Accelerate matches custom objects by position).

**DiLoCo.** :func:`register_diloco` makes every rank its own DiLoCo replica::

    model, opt = accelerator.prepare(model, opt)
    outer = register_diloco(accelerator, model, opt, sync_every=50)   # a flatcomm.diloco.DiLoCo

A prepared ``DistributedDataParallel`` keeps its local gradients from then on (DiLoCo syncs every
``sync_every`` steps instead; an unprepared model needs nothing). Accelerate saves the model and the
optimizer from the main process only and between syncs every replica's differ, so the registered
object is every rank's :class:`flatcomm.diloco.ReplicaState` (DiLoCo state, weights, optimizer
state); ``load_state`` loads custom objects after the model and the optimizer, so each replica
ends with its own and continues bit for bit.
"""
from __future__ import annotations

from typing import Any, Dict

import accelerate  # noqa: F401  (this adapter needs Accelerate; fail here with its ImportError)
import torch

from .. import rank_states
from . import _common

__all__ = ["RankStates", "register", "register_diloco"]


class RankStates:
    """A flatcomm state as an Accelerate checkpointing object: ``state_dict()`` is a collective
    that gathers every rank's state; ``load_state_dict()`` loads this rank's part."""

    def __init__(self, state: Any, accelerator: Any = None, missing_ok: bool = False) -> None:
        self.state = state
        self.accelerator = accelerator
        self.missing_ok = missing_ok

    def state_dict(self) -> Dict[str, Any]:
        # save_state writes custom objects from the main process (global rank 0) only: gather
        # there; with save_on_each_node every node's main process writes, so every rank gets it.
        config = getattr(self.accelerator, "project_configuration", None)
        dst = None if getattr(config, "save_on_each_node", False) else 0
        return rank_states.gathered_state_dict(self.state, dst=dst) or {}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        if not state_dict and rank_states.kind_of(self.state) == "diloco":  # saved before DiLoCo's state existed
            if self.missing_ok:
                return
            raise _common.missing_diloco_state("Accelerate checkpoint", "its custom checkpoint is empty",
                                               "register_diloco(..., missing_ok=True)")
        rank_states.load_gathered_state_dict(self.state, state_dict)


def register(accelerator: Any, model: torch.nn.Module, codec: Any = "int8", **options: Any) -> Any:
    """Run ``model``'s gradient traffic through flatcomm and checkpoint it with ``accelerator``.

    model: what ``accelerator.prepare`` returned (a ``DistributedDataParallel``; or a model with
        ``fully_shard``-ed modules for FSDP2).
    codec, options: as :func:`flatcomm.ddp.register` (DDP) or :func:`flatcomm.fsdp.apply` (FSDP2).

    Returns the :class:`flatcomm.ddp.State` / :class:`flatcomm.fsdp.ReduceScatter`.
    """
    state = _common.register(model, codec, options)
    accelerator.register_for_checkpointing(RankStates(state, accelerator))
    return state


def register_diloco(accelerator: Any, model: torch.nn.Module, optimizer: Any, *, missing_ok: bool = False,
                    **options: Any) -> Any:
    """A :class:`flatcomm.diloco.DiLoCo` on ``model`` (as ``accelerator.prepare`` returned it, or
    unprepared) trained by ``optimizer`` (prepared or not), every rank a replica, checkpointed with
    ``accelerator``.

    Args:
        missing_ok: ``load_state`` of a checkpoint with an empty DiLoCo entry raises unless True
            (a checkpoint without the entry at all is refused by Accelerate itself: it counts
            the registered objects).
        **options: :class:`flatcomm.diloco.DiLoCo`'s (``sync_every=`` required), not ``group=``.
    """
    module = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
    replica = _common.diloco_replica(model, module, optimizer, options)
    accelerator.register_for_checkpointing(RankStates(replica, accelerator, missing_ok))
    return replica.outer

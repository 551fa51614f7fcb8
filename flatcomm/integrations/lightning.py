"""PyTorch Lightning: a ``Callback`` that runs the model's gradient traffic through flatcomm.

::

    from flatcomm.integrations.lightning import FlatcommCallback

    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=DDPStrategy(process_group_backend="gloo"),
                        callbacks=[FlatcommCallback("int8")])
    trainer.fit(model)                       # flatcomm's int8 DDP hook on the wrapped model
    trainer.fit(model, ckpt_path="last.ckpt")  # resumes flatcomm's state too

**When.** ``on_fit_start`` runs after the strategy wrapped the model: with ``DDPStrategy`` the
callback calls :func:`flatcomm.ddp.register` on the ``DistributedDataParallel`` the strategy built
(Lightning's own ``ddp_comm_hook=`` registers on CUDA only and is silently dropped on CPU; do not
pass both on CUDA: DDP refuses a second hook). With ``ModelParallelStrategy`` (FSDP2: the
LightningModule calls ``fully_shard`` in ``configure_model``) it calls :func:`flatcomm.fsdp.apply`
on the LightningModule. ``callback.state`` is the :class:`flatcomm.ddp.State` /
:class:`flatcomm.fsdp.ReduceScatter` (``stats``, ``decisions``) during and after the fit.

**Checkpoints.** Lightning writes callback state from rank 0 only, and flatcomm's state differs per
rank, so :meth:`FlatcommCallback.state_dict` gathers every rank's state
(:func:`flatcomm.rank_states.gathered_state_dict`, a collective: Lightning builds the checkpoint
dict on every rank) into the checkpoint. On ``fit(ckpt_path=...)`` each rank takes its own part
(same world size: the run continues bit for bit) or, for DDP at another world size, the
resharded total (:func:`flatcomm.rank_states.load_gathered_state_dict`). Lightning restores
callbacks before ``DDPStrategy`` wraps the model, so the state is kept until ``on_fit_start``
registers flatcomm and loaded then; ``ModelParallelStrategy`` restores after, and it loads at once.

**DiLoCo.** :class:`DiLoCoCallback` trains every rank as its own DiLoCo replica
(:class:`flatcomm.diloco.DiLoCo` on the LightningModule and its one optimizer, made at
``on_fit_start``): DDP's gradient all-reduce is replaced by a hook that keeps the local gradient,
and the replicas sync every ``sync_every`` steps. Lightning saves the model and the optimizer from
rank 0 only, and between syncs each replica's differ, so the callback's checkpoint state is every
rank's :class:`flatcomm.diloco.ReplicaState` (DiLoCo state, weights, optimizer state), loaded at
``on_train_start``, after Lightning restored rank 0's model and optimizer: every replica resumes bit
for bit, also from a checkpoint taken with a fragment's sync in flight. ``DDPStrategy`` only (an
FSDP2 replica needs a group of its own: use :class:`flatcomm.diloco.DiLoCo` directly).
"""
from __future__ import annotations

from typing import Any, Dict, Optional

import lightning.pytorch as pl

from .. import rank_states
from . import _common

__all__ = ["DiLoCoCallback", "FlatcommCallback"]


class FlatcommCallback(pl.Callback):
    """Register flatcomm on the strategy's wrapped model and checkpoint every rank's flatcomm state.

    codec: any codec :func:`flatcomm.ddp.register` / :func:`flatcomm.fsdp.apply` takes (default
        ``"int8"`` with error feedback, as the DDP hook's default; ``"fp32"`` gives DDP's bits).
    **options: passed on to :func:`flatcomm.ddp.register` (DDP) or :func:`flatcomm.fsdp.apply`
        (FSDP2), e.g. ``start_step=``, ``keep_fp32=``, ``block_size=``.
    """

    def __init__(self, codec: Any = "int8", **options: Any) -> None:
        self.codec = codec
        self.options = options
        self.state: Optional[Any] = None  # flatcomm's DDP State or FSDP ReduceScatter, from on_fit_start
        self._pending: Optional[Dict[str, Any]] = None  # a checkpoint's state, until registered

    @property
    def state_key(self) -> str:
        return "flatcomm"

    def on_fit_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        wrapped = trainer.strategy.model
        if wrapped is None:
            raise RuntimeError("flatcomm: the strategy holds no model at on_fit_start")
        self.state = _common.register(wrapped, self.codec, self.options, fsdp_model=pl_module)
        if self._pending is not None:
            pending, self._pending = self._pending, None
            rank_states.load_gathered_state_dict(self.state, pending)

    def state_dict(self) -> Dict[str, Any]:
        # Called on every rank while Lightning builds the checkpoint (rank 0 writes it).
        if self.state is None:
            return {}
        return {"gathered": rank_states.gathered_state_dict(self.state)}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        gathered = rank_states.check_gathered(state_dict.get("gathered"))
        if self.state is None:
            self._pending = gathered
        else:
            rank_states.load_gathered_state_dict(self.state, gathered)

    def teardown(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        if self.state is not None and hasattr(self.state, "wait"):
            self.state.wait()  # nothing of the hook in flight once fit returns


class DiLoCoCallback(pl.Callback):
    """Every rank a DiLoCo replica of the fit; checkpoints every replica's whole state.

    Args:
        missing_ok: resuming from a checkpoint without this callback's state raises unless True
            (then DiLoCo starts afresh at inner step 0 from the restored weights).
        **options: :class:`flatcomm.diloco.DiLoCo`'s (``sync_every=`` is required; ``codec=``,
            ``fragments=``, ``fragment_sync_delay=``, ``verify_every=``, ...), but not ``group=``.

    ``callback.outer`` is the DiLoCo (``stats``) from ``on_fit_start`` on.
    """

    def __init__(self, *, missing_ok: bool = False, **options: Any) -> None:
        self.options = _common.check_diloco_options(options)
        self.missing_ok = missing_ok
        self.replica: Optional[Any] = None  # flatcomm.diloco.ReplicaState, from on_fit_start
        self._pending: Optional[Dict[str, Any]] = None
        self._resumed = False  # a checkpoint was restored (with or without this callback's entry)

    @property
    def outer(self) -> Optional[Any]:
        return self.replica.outer if self.replica is not None else None

    @property
    def state_key(self) -> str:
        return "flatcomm_diloco"

    def on_fit_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if len(trainer.optimizers) != 1:
            raise ValueError(f"flatcomm: DiLoCoCallback needs exactly one optimizer, the LightningModule "
                             f"configured {len(trainer.optimizers)}")
        wrapped = trainer.strategy.model
        self.replica = _common.diloco_replica(wrapped if wrapped is not None else pl_module, pl_module,
                                              trainer.optimizers[0], self.options)

    def on_load_checkpoint(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule",
                           checkpoint: Dict[str, Any]) -> None:
        self._resumed = True

    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if self._resumed and self._pending is None and not self.missing_ok:
            raise _common.missing_diloco_state("Lightning checkpoint", f"callbacks[{self.state_key!r}]",
                                               "DiLoCoCallback(missing_ok=True, ...)")
        # After Lightning restored rank 0's model and optimizer: each replica takes its own back.
        if self._pending is not None and self.replica is not None:
            pending, self._pending = self._pending, None
            rank_states.load_gathered_state_dict(self.replica, pending)

    def state_dict(self) -> Dict[str, Any]:
        if self.replica is None:
            return {}
        # Lightning writes the checkpoint from global rank 0 only: gather there, not to every rank.
        gathered = rank_states.gathered_state_dict(self.replica, dst=0)
        return {} if gathered is None else {"gathered": gathered}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        self._pending = rank_states.check_gathered(state_dict.get("gathered"))

    def teardown(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        if self.replica is not None:
            self.replica.outer.close()  # a sync in flight finished; the optimizer's hook removed

"""The Hugging Face ``Trainer``: flatcomm on the model the Trainer wrapped, saved with its checkpoints.

::

    from flatcomm.integrations.transformers import register

    trainer = Trainer(model=model, args=TrainingArguments(..., use_cpu=True), train_dataset=ds)
    callback = register(trainer, "int8")                 # torchrun --nproc-per-node 2 ...
    # or: callback = register_diloco(trainer, sync_every=50)  # DiLoCo replicas, see below
    trainer.train()                                      # flatcomm's int8 DDP hook
    trainer.train(resume_from_checkpoint=True)           # flatcomm's state resumes too

**When.** Callbacks receive the unwrapped model; the ``DistributedDataParallel`` is
``trainer.model_wrapped``, built before ``on_train_begin``. :func:`register` adds a
:class:`FlatcommCallback` that knows the trainer, and its ``on_train_begin`` calls
:func:`flatcomm.ddp.register` on ``trainer.model_wrapped`` (:func:`flatcomm.fsdp.apply` on an FSDP2
model). ``callback.state`` is the flatcomm state (``stats``).

**Checkpoints.** The Trainer writes its checkpoint folder (``checkpoint-<step>``) from rank 0 and
``trainer_state.json`` is JSON, so flatcomm's tensors go to a file of their own in that folder,
``flatcomm_state.pt``: at ``on_save`` (every rank) every rank's state is gathered
(:func:`flatcomm.rank_states.gathered_state_dict`) and rank 0 writes it (to a temporary name, then
renamed). A resume loads it on every rank (``torch.load(weights_only=True)``), each rank taking its
own part (same world size: the run continues bit for bit; DDP at another world size: resharded).
Callbacks are not told which checkpoint a resume uses, so :func:`register` also wraps this
trainer's ``train`` to note its ``resume_from_checkpoint`` (``True``: the last checkpoint in
``output_dir``, as the Trainer picks it). A resumed checkpoint without the file raises; pass
``missing_ok=True`` to start flatcomm's state from zero instead.

**DiLoCo.** :func:`register_diloco` makes every rank its own DiLoCo replica
(:class:`flatcomm.diloco.DiLoCo` on ``trainer.model`` and the Trainer's optimizer, at
``on_train_begin``; DDP's all-reduce replaced by a hook that keeps the local gradient). The Trainer
saves the model and the optimizer from rank 0 only, and between syncs each replica's differ, so
every rank's :class:`flatcomm.diloco.ReplicaState` (DiLoCo state, weights, optimizer state) goes
to ``flatcomm_diloco.pt``; a resume loads it at ``on_train_begin``, after the Trainer loaded rank
0's model and optimizer, and every replica continues bit for bit.
"""
from __future__ import annotations

import functools
import os
from typing import Any, Optional

import torch
import torch.distributed as dist
from transformers import TrainerCallback
from transformers.trainer_utils import get_last_checkpoint

from .. import rank_states
from . import _common

__all__ = ["DILOCO_FILE", "DiLoCoCallback", "FILE", "FlatcommCallback", "register", "register_diloco"]

FILE = "flatcomm_state.pt"  # in each checkpoint-<step> folder
DILOCO_FILE = "flatcomm_diloco.pt"


class _SavedPerRank(TrainerCallback):
    """Builds a flatcomm state at ``on_train_begin`` (:meth:`build`) and saves / resumes every
    rank's part of it with the Trainer's checkpoints, in ``checkpoint-<step>/<file>``."""

    file = FILE

    def __init__(self, trainer: Any, *, missing_ok: bool = False) -> None:
        self.trainer = trainer
        self.missing_ok = missing_ok
        self.state: Optional[Any] = None
        self.resume_from: Optional[str] = None  # set by the train() wrapper of register()

    def build(self) -> Any:
        raise NotImplementedError

    def on_train_begin(self, args, state, control, **kwargs):
        if self.resume_from is not None and self.file == FILE and \
                os.path.isfile(os.path.join(self.resume_from, DILOCO_FILE)):
            raise ValueError(
                    f"flatcomm: {self.resume_from} holds {DILOCO_FILE}: it was saved by a DiLoCo run. Resuming it "
                    f"with flatcomm.integrations.transformers.register (DDP every step) would drop every "
                    f"replica's DiLoCo state; resume with register_diloco(trainer, ...) and the options it was "
                    f"saved with")
        self.state = self.build()
        if self.resume_from is not None:
            path = os.path.join(self.resume_from, self.file)
            if not os.path.isfile(path):
                if self.missing_ok:
                    return
                if self.file == DILOCO_FILE:
                    raise _common.missing_diloco_state("Trainer checkpoint", path, "register_diloco(trainer, "
                                                       "missing_ok=True, ...)")
                raise FileNotFoundError(
                    f"flatcomm: {path} does not exist: this checkpoint was saved without flatcomm's state. "
                    f"Resume with missing_ok=True to start flatcomm's state from zero")
            rank_states.load_gathered_state_dict(self.state, torch.load(path, weights_only=True, map_location="cpu"))

    def on_save(self, args, state, control, **kwargs):
        if self.state is None:
            return
        gathered = rank_states.gathered_state_dict(self.state, dst=0)  # every rank calls it
        if gathered is not None:
            folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
            if not os.path.isdir(folder):
                raise FileNotFoundError(f"flatcomm: the Trainer's checkpoint folder {folder} does not exist "
                                        f"(a hyperparameter search's run folder is not supported)")
            tmp = os.path.join(folder, self.file + ".tmp")
            torch.save(gathered, tmp)
            os.replace(tmp, os.path.join(folder, self.file))
        if dist.is_initialized():
            dist.barrier()  # the file is complete before any rank goes on (and may stop)


class FlatcommCallback(_SavedPerRank):
    """Registers flatcomm at ``on_train_begin`` and saves / resumes its state with the Trainer's
    checkpoints. Create it with :func:`register` (it needs the trainer)."""

    def __init__(self, trainer: Any, codec: Any = "int8", *, missing_ok: bool = False, **options: Any) -> None:
        super().__init__(trainer, missing_ok=missing_ok)
        self.codec = codec
        self.options = options

    def build(self) -> Any:
        return _common.register(self.trainer.model_wrapped, self.codec, self.options, fsdp_model=self.trainer.model)

    def on_train_end(self, args, state, control, **kwargs):
        if self.state is not None and hasattr(self.state, "wait"):
            self.state.wait()


class DiLoCoCallback(_SavedPerRank):
    """Every rank a DiLoCo replica of the training; saves / resumes every replica's whole state.
    Create it with :func:`register_diloco`; ``callback.outer`` is the DiLoCo (``stats``)."""

    file = DILOCO_FILE

    def __init__(self, trainer: Any, *, missing_ok: bool = False, **options: Any) -> None:
        super().__init__(trainer, missing_ok=missing_ok)
        self.options = _common.check_diloco_options(options)

    @property
    def outer(self) -> Optional[Any]:
        return self.state.outer if self.state is not None else None

    def build(self) -> Any:
        t = self.trainer
        return _common.diloco_replica(t.model_wrapped, t.model, t.optimizer, self.options)

    def on_train_end(self, args, state, control, **kwargs):
        if self.state is not None:
            self.state.outer.close()  # a sync in flight finished; the optimizer's hook removed


def _add(trainer: Any, cb: _SavedPerRank) -> None:
    """Add ``cb`` to ``trainer`` and wrap its ``train`` to tell ``cb`` which checkpoint it resumes
    (callbacks are not told; ``True``: the last one in ``output_dir``, as the Trainer picks it)."""
    trainer.add_callback(cb)
    train = trainer.train

    @functools.wraps(train)
    def train_noting_resume(resume_from_checkpoint=None, *args, **kwargs):
        where = resume_from_checkpoint
        if where is True:
            where = get_last_checkpoint(trainer.args.output_dir)
        cb.resume_from = where if isinstance(where, (str, os.PathLike)) else None
        return train(resume_from_checkpoint, *args, **kwargs)

    trainer.train = train_noting_resume


def register(trainer: Any, codec: Any = "int8", *, missing_ok: bool = False, **options: Any) -> FlatcommCallback:
    """Add a :class:`FlatcommCallback` to ``trainer`` and return it.

    codec, options: as :func:`flatcomm.ddp.register` (DDP) or :func:`flatcomm.fsdp.apply` (FSDP2).
    missing_ok: resuming from a checkpoint without flatcomm's file starts its state from zero
        instead of raising.
    """
    cb = FlatcommCallback(trainer, codec, missing_ok=missing_ok, **options)
    _add(trainer, cb)
    return cb


def register_diloco(trainer: Any, *, missing_ok: bool = False, **options: Any) -> DiLoCoCallback:
    """Add a :class:`DiLoCoCallback` to ``trainer`` (a DDP or single-process Trainer) and return it.

    options: :class:`flatcomm.diloco.DiLoCo`'s (``sync_every=`` required), but not ``group=``.
    missing_ok: resuming from a checkpoint without ``flatcomm_diloco.pt`` starts DiLoCo afresh from
        the loaded weights (its step count from zero) instead of raising.
    """
    cb = DiLoCoCallback(trainer, missing_ok=missing_ok, **options)
    _add(trainer, cb)
    return cb

"""The Hugging Face ``Trainer``: flatcomm on the model the Trainer wrapped, saved with its checkpoints.

::

    from flatcomm.integrations.transformers import register

    trainer = Trainer(model=model, args=TrainingArguments(..., use_cpu=True), train_dataset=ds)
    callback = register(trainer, "int8")                 # torchrun --nproc-per-node 2 ...
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

__all__ = ["FILE", "FlatcommCallback", "register"]

FILE = "flatcomm_state.pt"  # in each checkpoint-<step> folder


class FlatcommCallback(TrainerCallback):
    """Registers flatcomm at ``on_train_begin`` and saves / resumes its state with the Trainer's
    checkpoints. Create it with :func:`register` (it needs the trainer)."""

    def __init__(self, trainer: Any, codec: Any = "int8", *, missing_ok: bool = False, **options: Any) -> None:
        self.trainer = trainer
        self.codec = codec
        self.options = options
        self.missing_ok = missing_ok
        self.state: Optional[Any] = None
        self.resume_from: Optional[str] = None  # set by the train() wrapper of register()

    def on_train_begin(self, args, state, control, **kwargs):
        self.state = _common.register(self.trainer.model_wrapped, self.codec, self.options,
                                      fsdp_model=self.trainer.model)
        if self.resume_from is not None:
            path = os.path.join(self.resume_from, FILE)
            if not os.path.isfile(path):
                if self.missing_ok:
                    return
                raise FileNotFoundError(
                    f"flatcomm: {path} does not exist: this checkpoint was saved without flatcomm's state. "
                    f"Resume with register(trainer, ..., missing_ok=True) to start error feedback from zero")
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
            tmp = os.path.join(folder, FILE + ".tmp")
            torch.save(gathered, tmp)
            os.replace(tmp, os.path.join(folder, FILE))
        if dist.is_initialized():
            dist.barrier()  # the file is complete before any rank goes on (and may stop)

    def on_train_end(self, args, state, control, **kwargs):
        if self.state is not None and hasattr(self.state, "wait"):
            self.state.wait()


def register(trainer: Any, codec: Any = "int8", *, missing_ok: bool = False, **options: Any) -> FlatcommCallback:
    """Add a :class:`FlatcommCallback` to ``trainer`` and return it.

    codec, options: as :func:`flatcomm.ddp.register` (DDP) or :func:`flatcomm.fsdp.apply` (FSDP2).
    missing_ok: resuming from a checkpoint without flatcomm's file starts its state from zero
        instead of raising.
    """
    cb = FlatcommCallback(trainer, codec, missing_ok=missing_ok, **options)
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
    return cb

"""Checks shared by the checkpoint loaders of :mod:`flatcomm.ddp` and :mod:`flatcomm.fsdp`, and the
one-hook check of the DDP registrations (:func:`register_ddp_hook`).

A residual is added to every later gradient, so a bad one (wrong size, integers, a NaN) silently
ruins the run: everything a checkpoint brings is checked when it is loaded, and the error names the
parameter and says what to do. Nothing here communicates.
"""
from __future__ import annotations

from typing import Any, Iterable, Mapping, Sequence

import torch

__all__ = ["field", "keys", "register_ddp_hook", "residual"]


def residual(name: str, t: Any, shape: Sequence[int], what: str = "residual") -> torch.Tensor:
    """``t`` checked to be a finite float32 tensor of exactly ``shape`` (no broadcasting)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"flatcomm: checkpoint {what} for {name!r} is a {type(t).__name__}, not a tensor")
    if t.dtype != torch.float32:
        raise TypeError(f"flatcomm: checkpoint {what} for {name!r} is {t.dtype}; flatcomm residuals are "
                        f"float32 (was this entry written by flatcomm's state_dict()?)")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"flatcomm: checkpoint {what} for {name!r} has shape {tuple(t.shape)}, this run "
                         f"needs {tuple(shape)} (the model or the world size differs from the saved run)")
    bad = int((~torch.isfinite(t)).sum())
    if bad:
        raise ValueError(f"flatcomm: checkpoint {what} for {name!r} holds {bad} inf/NaN values; every later "
                         f"gradient would be non-finite. Load a checkpoint from before the overflow or "
                         f"drop flatcomm's state to restart error feedback from zero")
    return t.detach()


def keys(have: Iterable[str], need: Iterable[str], what: str) -> None:
    """``have`` must be exactly ``need``: a missing entry would silently drop a residual."""
    have, need = set(have), set(need)
    unknown, missing = sorted(have - need), sorted(need - have)
    if unknown:
        raise KeyError(f"flatcomm: checkpoint {what} for parameters this model does not have: "
                       f"{unknown[:5]}{' ...' if len(unknown) > 5 else ''}")
    if missing:
        raise KeyError(f"flatcomm: checkpoint {what} is missing parameters: {missing[:5]}"
                       f"{' ...' if len(missing) > 5 else ''} (was it saved from another model?)")


def field(sd: Mapping[str, Any], name: str, kinds) -> Any:
    """``sd[name]``, checked to exist and have one of ``kinds``."""
    if not isinstance(sd, Mapping):
        raise TypeError(f"flatcomm: a flatcomm state dict is a dict, got {type(sd).__name__}")
    if name not in sd:
        raise KeyError(f"flatcomm: checkpoint has no {name!r} field (not a flatcomm state dict, "
                       f"or from an older version)")
    v = sd[name]
    if not isinstance(v, kinds):
        raise TypeError(f"flatcomm: checkpoint field {name!r} is a {type(v).__name__}")
    return v


def register_ddp_hook(ddp_model: Any, state: Any, hook: Any, who: str) -> None:
    """``ddp_model.register_comm_hook(state, hook)``, with a flatcomm error when the model has a hook
    already (DDP takes one, once; torch's own message names neither hook nor the way out).

    Args:
        ddp_model: a ``DistributedDataParallel``.
        state, hook: what to register.
        who: the caller, for the message (``flatcomm.ddp.register``).
    """
    existing = getattr(ddp_model, "_comm_hooks", None) or []  # torch appends (hook, state) per registration
    if existing:
        old_hook, old_state = existing[0]
        what = getattr(old_hook, "__qualname__", repr(old_hook))
        if type(old_state).__module__.startswith("flatcomm."):
            what = f"flatcomm's ({type(old_state).__name__}; its stats and state_dict() stay on that object)"
        raise RuntimeError(f"{who}: this DistributedDataParallel model has a communication hook already: {what}. "
                           f"DDP takes one hook, once: keep the object the first registration returned, or wrap "
                           f"the module in a new DistributedDataParallel to register another")
    try:
        ddp_model.register_comm_hook(state, hook)
    except RuntimeError as e:
        if "only be called once" not in str(e):  # a builtin hook (register_builtin_comm_hook) is not listed
            raise
        raise RuntimeError(f"{who}: this DistributedDataParallel model has a communication hook already "
                           f"(DDP takes one, once): wrap the module in a new DistributedDataParallel") from e

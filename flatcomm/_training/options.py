"""The options every flatcomm integration takes (DDP hook, FSDP backends), checked once.

``codec`` (a name, ``"auto"`` or a :class:`flatcomm.Codec`), ``mode``, ``error_feedback``,
``start_step`` (lossless warm-up), ``keep_fp32`` (per-parameter exceptions) and ``backoff``
(``auto`` moving to a more precise codec on measured error) mean the same in
:class:`flatcomm.ddp.State` and :mod:`flatcomm.fsdp`; :func:`resolve` turns them into one
:class:`Options` or raises an error that names the bad value.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Optional

import torch

from . import adapt as _adapt
from ..autotune import Tuner
from ..comm.header import MODES
from ..ops.codecs import Codec, resolve as resolve_codec

__all__ = ["Options", "resolve"]


@dataclasses.dataclass(frozen=True)
class Options:
    codec: Codec  # the fixed codec; with auto, the lossless placeholder (the tuner picks per collective)
    auto: bool
    open: bool  # auto and mode not given: the backend's own all-reduce may compete (DDP)
    mode: str
    block_size: Optional[int]  # as given (auto resolves each chosen codec with it)
    error_feedback: bool
    start_step: int
    keep_fn: Optional[Callable[[str, torch.Tensor], bool]]  # None: no exceptions (or all lossless anyway)
    backoff: Optional[_adapt.Backoff]  # auto only
    tuner: Any  # auto only: a flatcomm.autotune.Tuner


def resolve(codec: Any, *, error_feedback: bool = True, mode: Optional[str] = None,
            block_size: Optional[int] = None, ratio: Optional[float] = None, tuner: Any = None,
            start_step: Optional[int] = None, keep_fp32: Any = None, backoff: Any = None,
            defaults: Mapping[str, Mapping[str, Any]] = {}) -> Options:
    """Check the options; ``defaults[codec name]`` fills ``block_size`` / ``start_step`` not given."""
    auto = isinstance(codec, str) and codec == "auto"
    # mode None: the caller did not ask for determinism; fixed codecs run ordered
    open_ = mode is None and auto
    mode = "ordered" if mode is None else mode
    if mode not in MODES:
        raise ValueError(f"flatcomm: mode must be one of {MODES}, got {mode!r}")
    given = defaults.get(codec, {}) if isinstance(codec, str) else {}
    block_size = given.get("block_size") if block_size is None else block_size
    start_step = given.get("start_step", 0) if start_step is None else start_step
    if auto:
        if mode != "ordered":
            raise ValueError("flatcomm: codec='auto' needs mode='ordered'")
        tuner = tuner if tuner is not None else Tuner()
    else:
        tuner = None
    c = resolve_codec("fp32" if auto else codec, block_size, ratio)
    if mode == "exact" and not c.lossless:
        raise ValueError("flatcomm: mode='exact' sums exact fixed point of the values; use codec='fp32' with it")
    if isinstance(start_step, bool) or not isinstance(start_step, int) or start_step < 0:
        raise ValueError(f"flatcomm: start_step must be an int >= 0, got {start_step!r}")
    keep_fn = _adapt.keep_predicate(keep_fp32)
    if c.lossless and not auto:
        keep_fn = None  # everything is lossless already: no need to split
    if backoff is not None and backoff is not False and not isinstance(backoff, _adapt.Backoff):
        raise TypeError(f"flatcomm: backoff must be a flatcomm.ddp.Backoff or False, got {backoff!r}")
    backoff = None if backoff is False or not auto else (backoff or _adapt.Backoff())
    # (exact mode implies fp32, and auto implies ordered: error feedback only runs ordered)
    ef = bool(error_feedback) and (auto or not c.lossless)
    return Options(c, auto, open_, mode, block_size, ef, start_step, keep_fn, backoff, tuner)

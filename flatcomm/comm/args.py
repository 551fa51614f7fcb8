"""Argument types and checks shared by the collectives (flat and two-level)."""
from __future__ import annotations

import dataclasses
from typing import Any, Optional, Union

import torch
import torch.distributed as dist

from . import groups
from .header import DTYPES, MODES
from ..ops.codecs import Codec, CodecLike, resolve

__all__ = ["ErrorFeedback", "OpLike", "align_of", "alone", "as_flat", "check_residual", "one_stage_residual",
           "reduce_scale", "setup", "two_stage_residual"]

OpLike = Union[str, "dist.ReduceOp", "dist.ReduceOp.RedOpType"]


@dataclasses.dataclass
class ErrorFeedback:
    """Residuals for a lossy all-reduce of one flat tensor of ``numel`` values.

    ``client`` holds what this rank's first-stage encoding did not send; ``server`` (full size too,
    each rank uses the range of the shard it reduces) what the re-encoding of its reduced shard did
    not send. Both are fp32. Nothing is dropped: it is sent on a later step.
    """

    client: torch.Tensor
    server: torch.Tensor

    @classmethod
    def zeros(cls, numel: int, device: Optional[torch.device] = None) -> "ErrorFeedback":
        return cls(torch.zeros(numel, device=device), torch.zeros(numel, device=device))


def reduce_scale(op: OpLike, world: int) -> float:
    """The factor a reduction applies to the sum: 1 for ``sum``, 1 / world for ``avg``."""
    if isinstance(op, str):
        name = op.lower()
    elif op == dist.ReduceOp.SUM:  # == (not a dict lookup): ReduceOp objects hash differently
        name = "sum"
    elif op == dist.ReduceOp.AVG:
        name = "avg"
    else:
        name = str(op)
    if name == "sum":
        return 1.0
    if name == "avg":
        return 1.0 / world
    raise ValueError(f"flatcomm: op must be 'avg' or 'sum', got {op!r}")


def as_flat(t: torch.Tensor, what: str) -> torch.Tensor:
    """``t`` as a 1-D view, after checking its dtype and layout."""
    if t.dtype not in DTYPES:
        raise TypeError(f"flatcomm: {what} must be float32, bfloat16 or float16, got {t.dtype}")
    if not t.is_contiguous():
        raise ValueError(f"flatcomm: {what} must be contiguous")
    return t.view(-1)


def one_stage_residual(residual: Union[None, torch.Tensor, ErrorFeedback], what: str) -> Optional[torch.Tensor]:
    """The residual of a one-stage collective (reduce-scatter, all-gather): a Tensor, or an
    :class:`ErrorFeedback` whose ``client`` is used (its ``server`` has no role there)."""
    if residual is None or isinstance(residual, torch.Tensor):
        return residual
    if isinstance(residual, ErrorFeedback):
        return residual.client
    raise TypeError(f"flatcomm: {what} residual must be an fp32 Tensor or a flatcomm.ErrorFeedback, "
                    f"got {type(residual).__name__}")


def two_stage_residual(residual: Any, topology) -> None:
    """all_reduce's residual has two parts (client and server): a plain Tensor cannot hold both."""
    if residual is None or isinstance(residual, ErrorFeedback):
        return
    if isinstance(residual, torch.Tensor):
        raise TypeError("flatcomm: all_reduce's residual is a flatcomm.ErrorFeedback (client and server "
                        "residuals, both fp32 of the tensor's numel), not a Tensor: pass "
                        "flatcomm.ErrorFeedback.zeros(tensor.numel(), tensor.device) and keep it across steps")
    if topology is None or type(residual).__name__ != "TieredFeedback":
        raise TypeError(f"flatcomm: all_reduce's residual must be a flatcomm.ErrorFeedback"
                        f"{' (or a TieredFeedback with a topology)' if topology is not None else ''}, "
                        f"got {type(residual).__name__}")


def check_residual(r: Optional[torch.Tensor], numel: int, ref: torch.Tensor, what: str) -> None:
    if r is None:
        return
    if r.dtype != torch.float32 or not r.is_contiguous() or r.numel() != numel:
        raise ValueError(
            f"flatcomm: {what} must be a contiguous float32 tensor of {numel} values, "
            f"got {r.dtype} with {r.numel()} values"
        )
    if r.device != ref.device:
        raise ValueError(f"flatcomm: {what} is on {r.device} but the data is on {ref.device}")


def setup(group, codec: CodecLike, mode: str, op: OpLike):
    """(codec, world, rank, scale) of a call, after checking mode and codec."""
    if mode not in MODES:
        raise ValueError(f"flatcomm: mode must be one of {MODES}, got {mode!r}")
    c = resolve(codec)
    if mode == "exact" and c.name != "fp32":
        raise ValueError("flatcomm: mode='exact' sums exact fixed point of the values; use codec='fp32' with it")
    world = dist.get_world_size(group)
    return c, world, dist.get_rank(group), reduce_scale(op, world)


def alone(c: Codec, world: int, dtype: torch.dtype) -> Codec:
    """With one rank nothing moves, so nothing is compressed: the lossless codec of the data's
    own dtype, and the result is exact (a residual is added once and zeroed)."""
    if world != 1 or groups.EXCHANGE_ALONE or c.lossless:
        return c
    return resolve({torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, "fp32"))


def align_of(codec: Codec, mode: str, exact_block: int) -> int:
    """Shards start on multiples of this many values (codec blocks or exact-mode blocks)."""
    return exact_block if mode == "exact" else codec.align

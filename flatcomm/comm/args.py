"""The argument layer of the collectives: every argument checked by type and range before anything
is sent (no process group is touched here: a rejected call is kept in step by
:func:`flatcomm.comm.rejected.in_step`, which runs these checks).

The checks of the one-hop collectives are here (:func:`all_reduce_call`, :func:`reduce_scatter_call`,
:func:`all_gather_call`); the two-level ones (:mod:`flatcomm.comm.two_level`) build on the same
pieces. Every field that decides a payload's size or layout goes into the header
(:func:`flatcomm.comm.signature.signature`), exactly.
"""
from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any, List, Optional, Tuple, Union

import torch
import torch.distributed as dist

from . import groups, signature, standalone
from .fields import DTYPES, KIND_IDS, MODES
from .layout import CommStats, Plan, default_chunks, plan
from .shards import shard_bounds
from .spec import CallSpec
from ..ops.codecs import MAX_BLOCK, Codec, CodecLike, resolve

__all__ = ["Call", "ErrorFeedback", "MAX_EXACT_BLOCK", "MAX_HEADROOM", "OpLike", "align_of", "all_gather_call",
           "all_reduce_call", "alone", "as_flat", "bool_arg", "capped_chunks", "check_residual", "chunks_arg", "common_args",
           "exact_args", "gather_shapes", "int_arg", "one_stage_residual", "premultiplied", "reduce_op",
           "reduce_scale",
           "reduce_scatter_call", "scatter_shapes", "setup", "stats_arg", "tensor_arg", "two_stage_residual"]

OpLike = Union[str, "dist.ReduceOp", "dist.ReduceOp.RedOpType"]

MAX_EXACT_BLOCK = MAX_BLOCK  # csrc/ops_common.h: exact-mode block sizes in [1, kMaxBlock]
MAX_HEADROOM = 38  # csrc/ops_common.h: headroom bits in [1, 38]


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


# ---- single arguments -------------------------------------------------------------------------------


def int_arg(v: Any, what: str, lo: int, hi: Optional[int] = None) -> int:
    """``v`` as an int in [lo, hi] (bools and floats refused: 2.5 chunks is a mistake, not 2)."""
    if isinstance(v, bool) or not isinstance(v, numbers.Integral):
        raise TypeError(f"flatcomm: {what} must be an int, got {v!r}")
    v = int(v)
    if v < lo or (hi is not None and v > hi):
        raise ValueError(f"flatcomm: {what} must be in [{lo}, {hi if hi is not None else 'inf'}], got {v}")
    return v


def bool_arg(v: Any, what: str) -> bool:
    if not isinstance(v, bool):
        raise TypeError(f"flatcomm: {what} must be True or False, got {v!r}")
    return v


def stats_arg(stats: Any, kinds: Tuple[type, ...] = (CommStats,)) -> None:
    if stats is not None and not isinstance(stats, kinds):
        raise TypeError(f"flatcomm: stats must be a {' or '.join(k.__name__ for k in kinds)} (or None), "
                        f"got {type(stats).__name__}")


def chunks_arg(chunks: Any) -> Optional[int]:
    """None (the collective picks) or a positive int."""
    return None if chunks is None else int_arg(chunks, "chunks", 1)


def capped_chunks(chunks: int, longest: int, align: int) -> int:
    """No more chunks than aligned pieces in the longest shard: more would only add empty exchanges."""
    return max(1, min(chunks, math.ceil(longest / align)))


def tensor_arg(t: Any, what: str, written: bool = False) -> torch.Tensor:
    """``t`` as a 1-D view, after checking type, dtype, layout and device. ``written``: the
    collective writes it in place, which autograd must not be tracking."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"flatcomm: {what} must be a torch.Tensor, got {type(t).__name__}")
    if t.layout != torch.strided:
        raise TypeError(f"flatcomm: {what} must be a dense tensor, got layout {t.layout}")
    if t.dtype not in DTYPES:
        raise TypeError(f"flatcomm: {what} must be float32, bfloat16 or float16, got {t.dtype}")
    if t.device.type == "meta":
        raise ValueError(f"flatcomm: {what} is a meta tensor (it holds no values to send)")
    if not t.is_contiguous():
        raise ValueError(f"flatcomm: {what} must be contiguous")
    if written and t.requires_grad and torch.is_grad_enabled():
        raise ValueError(f"flatcomm: {what} requires grad and the collective writes it in place: call it under "
                         f"torch.no_grad(), or pass {what}.detach()")
    return t.view(-1)


as_flat = tensor_arg


def exact_args(mode: str, exact_block: Any, headroom: Any, world: int) -> Tuple[int, int]:
    """The exact-mode grid (checked whatever the mode: a bad value is a bug either way)."""
    block = int_arg(exact_block, "exact_block", 1, MAX_EXACT_BLOCK)
    room = int_arg(headroom, "headroom", 1, MAX_HEADROOM)
    if mode == "exact" and world > (1 << room):
        raise ValueError(f"flatcomm: exact mode with headroom {room} supports up to {1 << room} ranks, got {world}")
    return block, room


def mode_arg(mode: Any) -> str:
    if not isinstance(mode, str) or mode not in MODES:
        raise ValueError(f"flatcomm: mode must be one of {MODES}, got {mode!r}")
    return mode


def codec_arg(codec: Any, mode: str, what: str = "codec") -> Codec:
    if isinstance(codec, str) and codec == "auto":
        raise ValueError(f"flatcomm: {what}='auto' needs mode='ordered' and is chosen by the tuner (call "
                         f"flatcomm.all_reduce / reduce_scatter)" if mode != "ordered" else
                         f"flatcomm: {what}='auto' is resolved by flatcomm.collectives, not here")
    return resolve(codec)


def reduce_op(op: Any) -> Optional[Tuple[str, Optional[float]]]:
    """The one translation of torch's ``ReduceOp`` (or "sum" / "avg") into a flatcomm sum.

    Returns ``(flatcomm op, pre-factor)``: ``("sum", None)``, ``("avg", None)`` (the sum divided by
    the group size once, after it), ``("sum", f)`` for ``PREMUL_SUM(f)`` (NCCL's rule: each input is
    multiplied by ``f`` first, see :func:`premultiplied`, then summed); None for every other op
    (MAX, MIN, PRODUCT, bitwise: not a sum). The collectives, the FSDP backends and the ``flatcomm``
    torch backend all read ops through this function, so one op gives the same bits everywhere.
    """
    if isinstance(op, str):
        name = op.lower()
        return (name, None) if name in ("sum", "avg") else None
    if op == dist.ReduceOp.SUM:  # == (not a dict lookup): ReduceOp objects hash differently
        return "sum", None
    if op == dist.ReduceOp.AVG:
        return "avg", None
    if op == dist.ReduceOp.PREMUL_SUM:
        factor = getattr(op, "factor", None)
        if factor is None:
            raise ValueError("flatcomm: PREMUL_SUM without a factor")
        return "sum", float(factor.item() if isinstance(factor, torch.Tensor) else factor)
    return None


def premultiplied(t: torch.Tensor, factor: float, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """PREMUL_SUM's input, as NCCL computes it: ``factor`` rounded to ``t``'s dtype, then ``t`` times
    it, rounded to ``t``'s dtype once (into ``out`` if given, else a new tensor)."""
    f = torch.tensor(factor, dtype=t.dtype)  # 0-dim: a scalar operand of t's own dtype
    return torch.mul(t, f, out=out) if out is not None else torch.mul(t, f)


def reduce_scale(op: OpLike, world: int) -> float:
    """The factor a reduction applies to the sum: 1 for ``sum``, 1 / world for ``avg``."""
    how = reduce_op(op)
    if how is not None and how[1] is not None:
        raise ValueError("flatcomm: PREMUL_SUM(f) is not taken here: multiply the input first "
                         "(flatcomm.comm.args.premultiplied, NCCL's rule) and pass op='sum'")
    if how is None:
        raise ValueError(f"flatcomm: op must be 'avg' or 'sum', got {op!r}")
    return 1.0 if how[0] == "sum" else 1.0 / world


def one_stage_residual(residual: object, what: str) -> Optional[torch.Tensor]:
    """The residual of a one-stage collective (reduce-scatter, all-gather): a Tensor, or an
    :class:`ErrorFeedback` whose ``client`` is used (its ``server`` has no role there)."""
    if residual is None or isinstance(residual, torch.Tensor):
        return residual
    if isinstance(residual, ErrorFeedback):
        if not isinstance(residual.client, torch.Tensor):
            raise TypeError(f"flatcomm: {what} residual.client must be a Tensor, got {type(residual.client).__name__}")
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


def check_residual(r: Any, numel: int, ref: torch.Tensor, what: str, why: str = "") -> None:
    """``r`` (None: no residual) is a contiguous fp32 tensor of ``numel`` values on ``ref``'s device."""
    if r is None:
        return
    if not isinstance(r, torch.Tensor):
        raise TypeError(f"flatcomm: {what} must be a Tensor, got {type(r).__name__}")
    if r.dtype != torch.float32 or not r.is_contiguous() or r.numel() != numel or r.layout != torch.strided:
        raise ValueError(
            f"flatcomm: {what} must be a contiguous float32 tensor of {numel} values{why}, "
            f"got {r.dtype} with {r.numel()} values"
        )
    if r.device != ref.device:
        raise ValueError(f"flatcomm: {what} is on {r.device} but the data is on {ref.device}")
    if r.requires_grad and torch.is_grad_enabled():
        raise ValueError(f"flatcomm: {what} requires grad and the collective updates it in place")


def feedback_parts(residual: ErrorFeedback, numel: int, ref: torch.Tensor, what: str = "residual",
                   why: str = "") -> None:
    """Both parts of an :class:`ErrorFeedback` (neither may be None)."""
    for part in ("client", "server"):
        t = getattr(residual, part)
        if t is None:
            raise TypeError(f"flatcomm: {what}.{part} must be a Tensor, got None")
        check_residual(t, numel, ref, f"{what}.{part}", why)


def setup(group, codec: CodecLike, mode: str, op: OpLike):
    """(codec, world, rank, scale) of a call, after checking mode and codec."""
    mode = mode_arg(mode)
    c = codec_arg(codec, mode)
    if mode == "exact" and not c.lossless:
        raise ValueError("flatcomm: mode='exact' sums exact fixed point of the values; use codec='fp32' with it")
    world = dist.get_world_size(group)
    return c, world, standalone.rank(group), reduce_scale(op, world)


def alone(c: Codec, world: int, dtype: torch.dtype) -> Codec:
    """With one rank nothing moves, so nothing is compressed: the lossless codec of the data's
    own dtype, and the result is exact (a residual is added once and zeroed)."""
    if world != 1 or groups.EXCHANGE_ALONE or c.lossless:
        return c
    return resolve({torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, "fp32"))


def align_of(codec: Codec, mode: str, exact_block: int) -> int:
    """Shards start on multiples of this many values (codec blocks or exact-mode blocks)."""
    return exact_block if mode == "exact" else codec.align


# ---- the one-hop collectives' checks ---------------------------------------------------------------


@dataclasses.dataclass
class Call:
    """A one-hop collective's checked arguments and layout (what its body needs)."""

    codec: Codec
    world: int
    rank: int
    scale: float
    src: torch.Tensor  # the input, 1-D (all_reduce: the tensor itself)
    out: torch.Tensor  # the output, 1-D (all_reduce: the tensor itself)
    fields: List[Tuple[str, int]]  # the call header's
    plan: Optional[Plan] = None
    chunks: int = 1
    residual: Optional[torch.Tensor] = None  # one-stage collectives
    feedback: Optional[ErrorFeedback] = None  # all_reduce
    exact_block: int = 0
    headroom: int = 0


def common_args(spec: CallSpec, stats_kinds: Tuple[type, ...] = (CommStats,)) -> None:
    """The fields every collective takes: ``async_op``, ``validate``, ``stats``."""
    bool_arg(spec.async_op, "async_op")
    bool_arg(spec.validate, "validate")
    stats_arg(spec.stats, stats_kinds)


def scatter_shapes(src: torch.Tensor, out: torch.Tensor, world: int) -> None:
    """A reduce-scatter's input holds ``world`` outputs, on the output's device."""
    if src.numel() != world * out.numel():
        raise ValueError(f"flatcomm: reduce_scatter input has {src.numel()} values; it must be "
                         f"world size ({world}) x output ({out.numel()})")
    if out.device != src.device:
        raise ValueError(f"flatcomm: output is on {out.device} but input on {src.device}")


def gather_shapes(src: torch.Tensor, out: torch.Tensor, world: int) -> None:
    """An all-gather's output holds ``world`` inputs, on the input's device."""
    if out.numel() != world * src.numel():
        raise ValueError(f"flatcomm: all_gather output has {out.numel()} values; it must be "
                         f"world size ({world}) x input ({src.numel()})")
    if out.device != src.device:
        raise ValueError(f"flatcomm: output is on {out.device} but input on {src.device}")


def all_reduce_call(group, tensor, spec: CallSpec) -> Call:
    common_args(spec)
    mode = spec.mode
    c, world, rank, scale = setup(group, spec.codec, mode, spec.op)
    block, room = exact_args(mode, spec.exact_block, spec.headroom, world)
    flat = tensor_arg(tensor, "tensor", written=True)
    two_stage_residual(spec.residual, None)  # None or an ErrorFeedback past this line
    residual = spec.residual if isinstance(spec.residual, ErrorFeedback) else None
    k = chunks_arg(spec.chunks)
    c = alone(c, world, flat.dtype)
    n = flat.numel()
    if residual is not None:
        feedback_parts(residual, n, flat)
    align = align_of(c, mode, block)
    bounds = shard_bounds(n, world, align)
    longest = max(bounds[d + 1] - bounds[d] for d in range(world))
    nchunks = capped_chunks(k or default_chunks(max(1, n // world), c, world, mode, flat.dtype), longest, align)
    fields = signature.signature(KIND_IDS["all_reduce"], n, c, mode, scale, flat.dtype, nchunks,
                              signature.exact_fields(mode, block, room) + [signature.device_field(flat.device)])
    return Call(c, world, rank, scale, flat, flat, fields, plan(bounds, nchunks, align, rank), nchunks,
                feedback=residual, exact_block=block, headroom=room)


def reduce_scatter_call(group, output, input, spec: CallSpec) -> Call:
    common_args(spec)
    mode = spec.mode
    r = one_stage_residual(spec.residual, "reduce_scatter's")
    c, world, rank, scale = setup(group, spec.codec, mode, spec.op)
    block, room = exact_args(mode, spec.exact_block, spec.headroom, world)
    src, out = tensor_arg(input, "input"), tensor_arg(output, "output", written=True)
    k = chunks_arg(spec.chunks)
    c = alone(c, world, src.dtype)
    scatter_shapes(src, out, world)
    check_residual(r, src.numel(), src, "residual")
    align = align_of(c, mode, block)
    nchunks = capped_chunks(k or default_chunks(out.numel(), c, world, mode, src.dtype, "reduce_scatter"),
                            out.numel(), align)
    fields = signature.signature(KIND_IDS["reduce_scatter"], src.numel(), c, mode, scale, src.dtype, nchunks,
                              signature.exact_fields(mode, block, room) + [signature.device_field(src.device)])
    p = plan([d * out.numel() for d in range(world + 1)], nchunks, align, rank)
    return Call(c, world, rank, scale, src, out, fields, p, nchunks, residual=r, exact_block=block, headroom=room)


def all_gather_call(group, output, input, spec: CallSpec) -> Call:
    """(``spec``'s op, mode, chunks and exact grid have no role in a gather.)"""
    common_args(spec)
    r = one_stage_residual(spec.residual, "all_gather's")
    world = dist.get_world_size(group)
    src, out = tensor_arg(input, "input"), tensor_arg(output, "output", written=True)
    c = alone(codec_arg(spec.codec, "ordered"), world, src.dtype)
    n = src.numel()
    gather_shapes(src, out, world)
    check_residual(r, n, src, "residual")
    fields = signature.signature(KIND_IDS["all_gather"], n, c, "ordered", 1.0, src.dtype, 1,
                              [signature.device_field(src.device)])
    return Call(c, world, standalone.rank(group), 1.0, src, out, fields, residual=r)

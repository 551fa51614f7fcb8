"""Deterministic and compressed collectives over torch.distributed (gloo on CPU, NCCL on GPU).

The public entry points. Each call resolves ``codec="auto"`` with the tuner
(:mod:`flatcomm.autotune`) and, given a ``topology``, chooses between the flat one-hop path
(:mod:`flatcomm.comm.flat`) and the two-level path (:mod:`flatcomm.comm.two_level`); both lie below
this module, which only calls down. How the paths work, what every rank agrees on before a payload
moves, and the CUDA stream discipline: the docstrings of those modules and ``docs/semantics.md``.
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Tuple, Union

import torch
import torch.distributed as dist

from .autotune import Decision, tuner_for
from .comm import flat, route, two_level
from .comm.args import ErrorFeedback, OpLike
from .comm.rejected import in_step
from .comm.groups import group_timeout, private_group
from .comm.header import KIND_IDS, MODES
from .comm.layout import CommStats
from .comm.shards import shard_bounds
from .comm.spec import CallSpec
from .comm.worker import Handle
from .ops.codecs import Codec, CodecLike, resolve
from .ops.sums import DEFAULT_EXACT_BLOCK, DEFAULT_HEADROOM

__all__ = [
    "CommStats", "ErrorFeedback", "Handle", "MODES", "OpLike", "all_gather", "all_reduce", "group_timeout",
    "private_group", "reduce_scatter", "shard_bounds"
]

def all_reduce(
    tensor: torch.Tensor,
    *,
    codec: CodecLike = "fp32",
    op: OpLike = "avg",
    mode: str = "ordered",
    group=None,
    async_op: bool = False,
    residual: Optional[ErrorFeedback] = None,
    chunks: Optional[int] = None,
    stats: Optional[CommStats] = None,
    validate: bool = True,
    exact_block: int = DEFAULT_EXACT_BLOCK,
    headroom: int = DEFAULT_HEADROOM,
    tuner=None,
    topology=None,
    intra_codec: CodecLike = "fp32",
) -> Optional[Handle]:
    """All-reduce ``tensor`` in place: reduce-scatter, then all-gather of the reduced shards.

    Every rank ends with the same bits. ``residual`` (an :class:`ErrorFeedback` of the tensor's
    numel) makes a lossy codec lose nothing over time: client and server residuals carry what a
    step did not send into the next. ``codec="auto"``: ``tuner`` (default one per group) picks the
    codec and chunks per numel, the same on every rank (``Handle.decision``); a residual works
    with any choice (an fp32 choice adds the client residual once and zeroes it; with bf16/fp16
    data, what rounding the result to that dtype drops stays in the server residual).
    ``topology`` (a :class:`flatcomm.Topology`): reduce inside the node with ``intra_codec``,
    exchange ``codec`` across nodes (``residual``: that tier's, see :mod:`flatcomm.hierarchical`).
    A plain Tensor as ``residual`` raises ``TypeError``: an all-reduce has two residuals.

    Args:
        tensor: the values, reduced in place (fp32, bf16 or fp16; any shape, contiguous).
        codec: ``"fp32"`` (default, lossless), ``"bf16"``, ``"fp16"``, ``"int8"``, ``"int4"``,
            ``"sign"``, ``"topk"``, ``"auto"`` or a :class:`flatcomm.Codec`.
        op: ``"avg"`` (default), ``"sum"`` or a ``torch.distributed.ReduceOp`` (SUM, AVG, PREMUL_SUM).
        mode: ``"ordered"`` (default: fixed order, same bits every run) or ``"exact"`` (fp32:
            bits independent of the rank count).
        group: the process group (default: the world; flatcomm uses a private copy).
        async_op: return a :class:`Handle` to ``wait()`` on instead of blocking.
        residual: an :class:`ErrorFeedback` for a lossy codec.
        chunks: pipeline chunks (default: automatic).
        stats: a :class:`CommStats` the call adds its bytes and seconds to.
        validate: check the call's header against every rank's (default True).
        exact_block: ``mode="exact"``'s block of values sharing one exponent.
        headroom: ``mode="exact"``'s bits of headroom for the integer sum.
        tuner: ``codec="auto"``'s :class:`flatcomm.autotune.Tuner`.
        topology: a :class:`flatcomm.Topology` for the two-level path.
        intra_codec: the node tier's codec with ``topology`` (default ``"fp32"``).

    Example::

        >>> ef = flatcomm.ErrorFeedback.zeros(grad.numel())
        >>> flatcomm.all_reduce(grad, codec="int8", residual=ef)      # the average, int8 on the wire
        >>> h = flatcomm.all_reduce(t, codec="fp32", op="sum", async_op=True); h.wait()
    """
    spec = CallSpec(codec=codec, op=op, mode=mode, async_op=async_op, residual=residual, chunks=chunks, stats=stats,
                    validate=validate, exact_block=exact_block, headroom=headroom, intra_codec=intra_codec)
    decision = None
    if topology is not None:
        group = _topology_group(topology, group)
        if not topology.flat:
            decision = _tiered_auto(spec, tuner, tensor, topology)
            if decision is None or decision.path == "hierarchical":
                if decision is not None:  # and its pipeline segments (unless the caller gave some)
                    spec = dataclasses.replace(spec, codec=decision.codec, intra_codec=decision.intra_codec,
                                               chunks=chunks or decision.chunks)
                return _with_decision(two_level.all_reduce(tensor, topology, spec, _chooser(tuner)), decision)
            spec = dataclasses.replace(spec, codec=decision.codec)  # the flat path was predicted faster here
    group = private_group(group)
    if decision is None:
        resolved, decision = _flat_auto(spec, tuner, tensor, group, "all_reduce")
        if isinstance(resolved, Handle):  # the tuner failed somewhere: every rank's wait() raises why
            return resolved
        spec = resolved
    return _with_decision(route.all_reduce(tensor, spec, group), decision)


def reduce_scatter(
    output: torch.Tensor,
    input: torch.Tensor,
    *,
    codec: CodecLike = "fp32",
    op: OpLike = "avg",
    mode: str = "ordered",
    group=None,
    async_op: bool = False,
    residual: Union[None, torch.Tensor, ErrorFeedback] = None,
    chunks: Optional[int] = None,
    stats: Optional[CommStats] = None,
    validate: bool = True,
    exact_block: int = DEFAULT_EXACT_BLOCK,
    headroom: int = DEFAULT_HEADROOM,
    tuner=None,
    topology=None,
    intra_codec: CodecLike = "fp32",
) -> Optional[Handle]:
    """Reduce ``input`` (world x ``output.numel()`` values) across ranks; rank r gets shard r.

    ``residual`` (fp32, input's numel) turns on error feedback for a lossy ``codec``.
    ``codec="auto"``: ``tuner`` (a :class:`flatcomm.autotune.Tuner`, default one per group) picks
    the codec and chunks per input size, the same on every rank (``Handle.decision``).
    ``topology`` (a :class:`flatcomm.Topology`): two levels, see :mod:`flatcomm.hierarchical`.
    ``residual`` may also be an :class:`ErrorFeedback` (its ``client`` is used).

    Args:
        output: this rank's shard of the result (``input.numel() / world`` values).
        input: the values to reduce, ``world`` shards one after another.
        codec: the wire codec (as :func:`all_reduce`; default ``"fp32"``).
        op: ``"avg"`` (default), ``"sum"`` or a ``torch.distributed.ReduceOp``.
        mode: ``"ordered"`` (default) or ``"exact"``.
        group: the process group (default: the world).
        async_op: return a :class:`Handle` instead of blocking.
        residual: error feedback: an fp32 tensor of ``input``'s numel or an :class:`ErrorFeedback`.
        chunks: pipeline chunks (default: automatic).
        stats: a :class:`CommStats` to add to.
        validate: check the call's header against every rank's (default True).
        exact_block: ``mode="exact"``'s block size.
        headroom: ``mode="exact"``'s headroom bits.
        tuner: ``codec="auto"``'s tuner.
        topology: a :class:`flatcomm.Topology` for the two-level path.
        intra_codec: the node tier's codec with ``topology``.

    Example::

        >>> shard = torch.empty(grad.numel() // world)
        >>> flatcomm.reduce_scatter(shard, grad, codec="int8", residual=torch.zeros_like(grad))
    """
    spec = CallSpec(codec=codec, op=op, mode=mode, async_op=async_op, residual=residual, chunks=chunks, stats=stats,
                    validate=validate, exact_block=exact_block, headroom=headroom, intra_codec=intra_codec)
    if topology is not None:
        group = _topology_group(topology, group)
        if not topology.flat:
            return two_level.reduce_scatter(output, input, topology, spec, _chooser(tuner))
    group = private_group(group)
    resolved, decision = _flat_auto(spec, tuner, input, group, "reduce_scatter")
    if isinstance(resolved, Handle):
        return resolved
    return _with_decision(flat.reduce_scatter(output, input, resolved, group), decision)


def all_gather(
    output: torch.Tensor,
    input: torch.Tensor,
    *,
    codec: CodecLike = "fp32",
    group=None,
    async_op: bool = False,
    residual: Union[None, torch.Tensor, ErrorFeedback] = None,
    stats: Optional[CommStats] = None,
    validate: bool = True,
    topology=None,
    intra_codec: CodecLike = "fp32",
) -> Optional[Handle]:
    """Gather every rank's ``input`` into ``output`` (world x input numel), in rank order.

    With a lossy ``codec`` each rank's input is sent encoded (``residual`` keeps what was not
    sent) and every rank, the sender included, receives the decoded values.
    ``topology`` (a :class:`flatcomm.Topology`): two levels, see :mod:`flatcomm.hierarchical`.
    ``residual`` may also be an :class:`ErrorFeedback` (its ``client`` is used).

    Args:
        output: the gathered values, ``world`` x ``input.numel()``, rank 0's first.
        input: this rank's values.
        codec: the wire codec (as :func:`all_reduce`; default ``"fp32"``).
        group: the process group (default: the world).
        async_op: return a :class:`Handle` instead of blocking.
        residual: error feedback for a lossy codec (fp32, ``input``'s numel, or an :class:`ErrorFeedback`).
        stats: a :class:`CommStats` to add to.
        validate: check the call's header against every rank's (default True).
        topology: a :class:`flatcomm.Topology` for the two-level path.
        intra_codec: the node tier's codec with ``topology``.

    Example::

        >>> out = torch.empty(world * w.numel())
        >>> flatcomm.all_gather(out, w, codec="bf16")
    """
    spec = CallSpec(codec=codec, async_op=async_op, residual=residual, stats=stats, validate=validate,
                    intra_codec=intra_codec)
    if topology is not None:
        group = _topology_group(topology, group)
        if not topology.flat:
            return two_level.all_gather(output, input, topology, spec)
    return flat.all_gather(output, input, spec, group)


# ---- auto and topology ------------------------------------------------------------------------------


def _is_auto(codec: CodecLike) -> bool:
    return isinstance(codec, str) and codec == "auto"


def _topology_group(topology, group):
    """The group a flat topology runs on (the caller's ``group`` must not contradict it)."""
    def same(a, b):
        return (a if a is not None else dist.group.WORLD) is (b if b is not None else dist.group.WORLD)

    if group is not None and not same(group, topology.group):
        raise ValueError("flatcomm: pass either group= or topology= (the topology has its own group)")
    return topology.group


def _flat_auto(spec: CallSpec, tuner, tensor, group, kind: str) -> Tuple[Union[CallSpec, Handle], Optional[Decision]]:
    """``codec="auto"`` on one group: (spec with the tuner's codec, decision) (default tuner: one
    per group), the same on every rank; other codecs pass through with decision None, and so does
    ``"auto"`` with a tensor or mode it cannot take (the collective's argument layer rejects them on
    every rank). The tuner's own errors reach every rank of the call too (its header still goes
    out): then (a Handle that raises them, None)."""
    if not _is_auto(spec.codec) or spec.mode != "ordered" or not isinstance(tensor, torch.Tensor):
        return spec, None
    t = tuner if tuner is not None else tuner_for(group)
    d = in_step(group, KIND_IDS[kind], spec.async_op,
                lambda: t.choose(tensor.numel(), group=group, device=tensor.device, kind=kind))
    if isinstance(d, Handle):
        return d, None
    return dataclasses.replace(spec, codec=d.codec), d  # d.chunks: what the collective's default picks


def _chooser(tuner) -> two_level.Chooser:
    """The inter tier's ``codec="auto"`` for the two-level path: the tuner of that tier's group."""
    def choose(numel: int, group, device: torch.device, kind: str) -> Codec:
        t = tuner if tuner is not None else tuner_for(group)
        return resolve(t.choose(numel, group=group, device=device, kind=kind).codec)

    return choose


def _tiered_auto(spec: CallSpec, tuner, tensor: torch.Tensor, topology) -> Optional[Decision]:
    """``codec="auto"`` with a hierarchical topology: the tuner of the topology's group picks the
    path and a codec per tier (a Decision), or None for a named codec. A residual is laid out
    for the hierarchical path (the inter tier's shard), so with one only that path competes."""
    if not _is_auto(spec.codec) or spec.mode != "ordered" or not isinstance(tensor, torch.Tensor):
        return None  # the two-level call's argument layer rejects what "auto" cannot take
    t = tuner if tuner is not None else tuner_for(topology.group)
    paths = ("hierarchical",) if spec.residual is not None else None
    return t.choose(tensor.numel(), group=topology.group, device=tensor.device, topology=topology, paths=paths)


def _with_decision(handle: Optional[Handle], decision) -> Optional[Handle]:
    if handle is not None:
        handle.decision = decision
    return handle

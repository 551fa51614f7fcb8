"""The two-level path's argument layer and shard layout (:mod:`flatcomm.comm.two_level` runs the
collectives).

**One argument layer for all W ranks.** A two-level call runs on three groups: the node's, the
local rank's across nodes, and the parent group of all W ranks. Its arguments are checked here,
every one by type and range, through :func:`flatcomm.comm.rejected.in_step` on the *parent* group: a
rank whose arguments are rejected posts its header there, marked failed. Ranks whose arguments
pass post theirs (:func:`agreement`: every field that decides a payload's size or layout in either
tier, exactly) on the same group's worker, in order with the flat calls on it, and every tier waits
for that exchange before it moves a byte. So a failure on any rank of any node, or a disagreement
between nodes that the node tier alone cannot see (numels that pad to the same shard, another
inter codec), raises the same error on every rank of the call at once, naming global ranks, and
the next call works everywhere.

**Layout.** Every intra-node shard has :func:`padded_shard` values, a multiple of both codecs'
blocks; :func:`shard_numel` of them hold data on this rank (the size of the inter tier's residual).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable, List, Optional, Tuple, Union

import torch
import torch.distributed as dist

from . import args, groups, header, rejected, signature, worker
from .args import ErrorFeedback
from .layout import CommStats
from .spec import CallSpec
from .topology import Topology
from ..ops.codecs import Codec, CodecLike, resolve
from ..ops.sums import DEFAULT_EXACT_BLOCK

__all__ = ["ALL_GATHER", "ALL_REDUCE", "REDUCE_SCATTER", "Call", "TierStats", "TieredFeedback", "agreement",
           "shard_align", "all_gather_call", "all_reduce_call", "hierarchical", "in_step", "padded_shard",
           "reduce_scatter_call", "shard_numel", "shard_range", "wait_agreed"]


@dataclasses.dataclass
class TierStats:
    """Per-tier counters of hierarchical collectives (pass one as ``stats=``)."""

    intra: CommStats = dataclasses.field(default_factory=CommStats)
    inter: CommStats = dataclasses.field(default_factory=CommStats)

    def total(self) -> CommStats:
        out = CommStats()
        out.add(self.intra)
        out.add(self.inter)
        return out


@dataclasses.dataclass
class TieredFeedback:
    """Error-feedback state of both tiers of a hierarchical all-reduce.

    ``inter``: :func:`shard_numel` values (client and server). ``intra`` (only for a lossy
    ``intra_codec``): client of ``G x m`` values (the node reduce-scatter's encoding of the padded
    tensor), server of ``m`` (the node all-gather's encoding), m = :func:`padded_shard`."""

    inter: Optional[ErrorFeedback] = None
    intra: Optional[ErrorFeedback] = None

    @classmethod
    def zeros(cls, numel: int, topology: Topology, codec: CodecLike = "fp32",
              intra_codec: CodecLike = "fp32", device: Optional[torch.device] = None) -> "TieredFeedback":
        real = shard_numel(numel, topology, codec, intra_codec)
        m = padded_shard(numel, topology.local_size, shard_align(codec, intra_codec, "ordered", DEFAULT_EXACT_BLOCK))
        z = lambda k: torch.zeros(k, device=device)  # noqa: E731
        intra = None if resolve(intra_codec).lossless else ErrorFeedback(z(topology.local_size * m), z(m))
        return cls(ErrorFeedback(z(real), z(real)), intra)


def shard_align(codec: CodecLike, intra_codec: CodecLike, mode: str, exact_block: int) -> int:
    if mode == "exact":
        return exact_block
    inter = Codec("int8") if isinstance(codec, str) and codec == "auto" else resolve(codec)
    return math.lcm(args.align_of(inter, mode, exact_block), args.align_of(resolve(intra_codec), mode, exact_block))


def padded_shard(numel: int, local_size: int, align: int) -> int:
    """Width m of every intra-node shard: ``ceil(numel / (G x align)) x align``; local rank l's
    shard is ``[l*m, (l+1)*m)`` of the tensor zero-padded to G x m values."""
    return math.ceil(numel / (local_size * align)) * align


def shard_numel(numel: int, topology: Topology, codec: CodecLike = "fp32", intra_codec: CodecLike = "fp32",
                mode: str = "ordered", exact_block: int = DEFAULT_EXACT_BLOCK) -> int:
    """Values of this rank's intra-node shard that hold data (the padding is not sent across
    nodes) in a hierarchical all-reduce of ``numel`` values: the size of the ``ErrorFeedback`` to
    pass. Shards start on multiples of the codecs' block; the last local ranks' may be shorter
    (or empty for tiny tensors)."""
    m = padded_shard(numel, topology.local_size, shard_align(codec, intra_codec, mode, exact_block))
    return max(0, min(m, numel - topology.local_rank * m))


def shard_range(numel: int, topology: Topology, codec: CodecLike = "fp32",
                intra_codec: CodecLike = "fp32") -> tuple:
    """(start, end) of this rank's data in its intra-node shard, in the tensor's indices: where an
    integration keeping full-size residual buffers holds the inter tier's state."""
    m = padded_shard(numel, topology.local_size, shard_align(codec, intra_codec, "ordered", DEFAULT_EXACT_BLOCK))
    lo = min(numel, topology.local_rank * m)
    return lo, lo + shard_numel(numel, topology, codec, intra_codec)


REDUCE_SCATTER, ALL_GATHER, ALL_REDUCE = (header.KIND_IDS[f"two-level {k}"]
                                          for k in ("reduce_scatter", "all_gather", "all_reduce"))


# ---- the argument layer ---------------------------------------------------------------------------


@dataclasses.dataclass
class Call:
    """A two-level collective's checked arguments (what its body needs) and its header fields."""

    fields: List[Tuple[str, int]]
    src: torch.Tensor
    out: torch.Tensor
    inter: Union[str, Codec]  # "auto": chosen per tier group
    intra: Codec
    scale: float = 1.0
    m: int = 0
    align: int = 1
    chunks: Optional[int] = None
    residual: Optional[torch.Tensor] = None
    inter_fb: Optional[ErrorFeedback] = None
    intra_fb: Optional[ErrorFeedback] = None
    exact_block: int = 0
    headroom: int = 0


def hierarchical(topology) -> Topology:
    if not isinstance(topology, Topology):
        raise TypeError(f"flatcomm: topology must be a flatcomm.Topology, got {type(topology).__name__}")
    if topology.flat:
        raise ValueError(f"flatcomm: {topology!r} is flat; call the flat collective on topology.group")
    # The private groups, made here on the caller's thread: creating a group is a collective of its
    # members, which must not happen on a worker (flatcomm.comm.groups).
    groups.private_group(topology.intra_group)
    groups.private_group(topology.inter_group)
    parent = _parent(topology)
    if parent is not _UNKNOWN:
        groups.private_group(parent)
    return topology


_UNKNOWN = object()


def _parent(topo: Topology):
    """The group of all W ranks (where the call's header goes), or _UNKNOWN: a topology from a
    DeviceMesh that does not span the default group has no such group."""
    if topo.group is not None or dist.get_world_size() == topo.world:
        return topo.group
    return _UNKNOWN


def in_step(topo: Topology, kind: int, async_op, checks: Callable[[], Call]):
    """The two-level argument layer: :func:`flatcomm.comm.rejected.in_step` on the private group of
    all W ranks, so that a rejected argument on any rank of any node is every rank's error."""
    parent = _parent(topo)
    if parent is _UNKNOWN:
        return checks()
    return rejected.in_step(groups.private_group(parent), kind, async_op, checks)


def agreement(topo: Topology, a: Call, validate: bool):
    """The call header among all W ranks, on that group's worker (in order with the flat calls
    there), before any tier moves a byte: a disagreement between nodes, or a failure on any rank,
    raises on every rank at once, naming global ranks. A future (None: no such group)."""
    parent = _parent(topo)
    if parent is _UNKNOWN:
        return None
    pg = groups.private_group(parent)
    where = header.header_device(pg, a.src.device, validate)
    if where is None:
        return None

    def agree() -> None:
        header.CallHeader(pg, a.fields, where).finish()

    return worker.in_order(worker.key_of(pg), agree)


def wait_agreed(agreed) -> None:
    if agreed is not None:
        agreed.result()


def _inter_arg(codec, mode: str, choose) -> Union[str, Codec]:
    if isinstance(codec, str) and codec == "auto":
        if mode != "ordered":
            raise ValueError("flatcomm: codec='auto' needs mode='ordered'")
        if choose is None:
            raise ValueError("flatcomm: codec='auto' on the two-level path is chosen by the tuner: call "
                             "flatcomm.all_reduce / reduce_scatter with topology=")
        return "auto"
    return resolve(codec)


_STATS = (CommStats, TierStats)  # what stats= may be


@dataclasses.dataclass(frozen=True)
class _Reduction:
    """A two-level call's checked codecs, mode, op scale and exact-mode grid."""

    inter: Union[str, Codec]
    intra: Codec
    mode: str = "ordered"
    scale: float = 1.0
    block: int = 0
    room: int = 0

    def fields(self, kind: int, n: int, t: torch.Tensor, chunks: Optional[int]) -> List[Tuple[str, int]]:
        extra = (signature.exact_fields(self.mode, self.block, self.room) + [signature.device_field(t.device)]
                 + signature.codec_fields(self.intra, intra=True))
        return signature.signature(kind, n, self.inter, self.mode, self.scale, t.dtype, chunks or 0, extra)


def _reduction(topo: Topology, spec: CallSpec, choose) -> _Reduction:
    """The reduction fields of ``spec``, checked."""
    mode = args.mode_arg(spec.mode)
    inter = _inter_arg(spec.codec, mode, choose)
    ci = args.codec_arg(spec.intra_codec, mode, "intra_codec")
    if mode == "exact" and (not ci.lossless or not (isinstance(inter, Codec) and inter.lossless)):
        raise ValueError("flatcomm: mode='exact' sums exact fixed point of the values; use codec='fp32' "
                         "and intra_codec='fp32' with it")
    block, room = args.exact_args(mode, spec.exact_block, spec.headroom, topo.world)
    return _Reduction(inter, ci, mode, args.reduce_scale(spec.op, topo.world), block, room)


def all_reduce_call(topo, tensor, spec: CallSpec, choose) -> Call:
    args.common_args(spec, _STATS)
    r = _reduction(topo, spec, choose)
    flat = args.tensor_arg(tensor, "tensor", written=True)
    args.two_stage_residual(spec.residual, topo)
    k = args.chunks_arg(spec.chunks)
    n = flat.numel()
    align = shard_align(r.inter, r.intra, r.mode, r.block)
    m = padded_shard(n, topo.local_size, align)
    inter_fb, intra_fb = _tiers(spec.residual, m, shard_numel(n, topo, r.inter, r.intra, r.mode, r.block),
                                topo.local_size, not r.intra.lossless, flat)
    k = args.capped_chunks(k, m, align) if k else None
    return Call(r.fields(ALL_REDUCE, n, flat, k), flat, flat, r.inter, r.intra, scale=r.scale, m=m, align=align,
                chunks=k, inter_fb=inter_fb, intra_fb=intra_fb, exact_block=r.block, headroom=r.room)


def reduce_scatter_call(topo, output, input, spec: CallSpec, choose) -> Call:
    args.common_args(spec, _STATS)
    res = args.one_stage_residual(spec.residual, "reduce_scatter's")
    r = _reduction(topo, spec, choose)
    src, out = args.tensor_arg(input, "input"), args.tensor_arg(output, "output", written=True)
    k = args.chunks_arg(spec.chunks)
    width = out.numel()
    args.scatter_shapes(src, out, topo.world)
    args.check_residual(res, topo.nodes * width, src, "hierarchical residual",
                        " (the inter-node tier's: input numel / local_size)")
    k = args.capped_chunks(k, width, shard_align(r.inter, r.intra, r.mode, r.block)) if k else None
    return Call(r.fields(REDUCE_SCATTER, src.numel(), src, k), src, out, r.inter, r.intra, scale=r.scale,
                chunks=k, residual=res, exact_block=r.block, headroom=r.room)


def all_gather_call(topo, output, input, spec: CallSpec) -> Call:
    """(``spec``'s op, mode, chunks and exact grid have no role in a gather.)"""
    args.common_args(spec, _STATS)
    res = args.one_stage_residual(spec.residual, "all_gather's")
    r = _Reduction(args.codec_arg(spec.codec, "ordered"), args.codec_arg(spec.intra_codec, "ordered", "intra_codec"))
    src, out = args.tensor_arg(input, "input"), args.tensor_arg(output, "output", written=True)
    n = src.numel()
    args.gather_shapes(src, out, topo.world)
    args.check_residual(res, n, src, "hierarchical residual", " (the input's numel)")
    return Call(r.fields(ALL_GATHER, n, src, None), src, out, r.inter, r.intra, residual=res)


def _tiers(residual, m: int, real: int, local_size: int, intra_lossy: bool, ref: torch.Tensor):
    """(inter ErrorFeedback, intra ErrorFeedback) from ``residual``, sizes checked."""
    if residual is None:
        return None, None
    if isinstance(residual, ErrorFeedback):
        residual = TieredFeedback(inter=residual)
    if not isinstance(residual, TieredFeedback):
        raise TypeError(f"flatcomm: hierarchical residual must be an ErrorFeedback or TieredFeedback, "
                        f"got {type(residual).__name__}")
    inter, intra = residual.inter, residual.intra
    why = " (this rank's intra-node shard: flatcomm.hierarchical.shard_numel(numel, topology, codec))"
    if inter is not None:
        args.feedback_parts(inter, real, ref, "hierarchical residual", why)
    if intra is not None:
        if not intra_lossy:
            raise ValueError("flatcomm: hierarchical residual has an intra-node state but the intra_codec is lossless")
        for part, size, why in (("client", local_size * m, "local_size x padded_shard"), ("server", m, "padded_shard")):
            t = getattr(intra, part)
            if t is None:
                raise TypeError(f"flatcomm: hierarchical intra residual.{part} must be a Tensor, got None")
            args.check_residual(t, size, ref, f"hierarchical intra residual.{part}", f" ({why})")
    return inter, intra

"""Two-level (hierarchical) collectives over a :class:`flatcomm.Topology` of N nodes x G ranks.

All-reduce of n values, on every rank:

1. inside the node, a lossless reduce-scatter (``intra_codec``, default fp32, summed in ascending
   local-rank order): local rank l holds the node's sum of shard l (``m`` values, see
   :func:`shard_numel`);
2. across nodes, the one-hop chunked all-reduce of that shard with ``codec`` (and error feedback)
   among the N ranks of local rank l: only compressed bytes leave the node, ~2*c*S per node
   instead of the flat path's ~2*G*c*S;
3. inside the node, an all-gather of the reduced shards: with the default fp32 ``intra_codec``, of
   the compressed payloads that crossed the nodes (every rank decodes all of them: c x the bytes
   of an fp32 gather, the same bits; :mod:`flatcomm.comm.two_level_ordered`).

The shard is cut into segments (``chunks``, :func:`segments_of`) that flow through the three
steps as a pipeline: the tiers' steps run on their groups' worker threads, so the node
reduce-scatter of segment j+1 and the node all-gather of segment j-1 overlap the exchange of
segment j across nodes. Each step sums in a fixed order: the result is
the same bits on every rank and every run, for a given topology (not the same bits as the flat
path: the grouping of the sum differs). ``mode="exact"`` agrees per-block exponents over all W
ranks, sums fixed-point integers inside the node, sends the *integer* partial sums across nodes and
converts once at the end: integer addition is associative, so the result is the same bits as the
flat exact all-reduce for any N x G.

Error feedback: ``residual`` is the inter-node tier's state for this rank's intra-node shard, an
:class:`~flatcomm.ErrorFeedback` of :func:`shard_numel` values (client: what the shard's
first-stage encoding did not send; server: what the re-encoding of the piece of it that this rank
reduces across nodes did not send). A lossy ``intra_codec`` takes a :class:`TieredFeedback` with an
intra-node state as well. Shards start on multiples of the codecs' blocks, so blocks line up with
the global tensor; when n is not a multiple of G x block the tensor is zero-padded to G x m.

Reduce-scatter (rank r = node k x G + l gets shard r) reduces inside the node the N shards destined
to local rank l of every node, then reduce-scatters that across nodes; all-gather gathers across
nodes first (compressed), then inside the node (lossless), so each value crosses the network once.

The calls of one topology run in submission order on one worker thread (``async_op=True`` returns
a :class:`~flatcomm.comm.worker.Handle` at once), and each tier's collectives on that tier group's
own worker, so every rank issues every group's collectives in the same order.
"""
from __future__ import annotations

from typing import Callable, List, Optional

import torch
import torch.distributed as dist

from . import context, flat as one_hop, node as _node, route, two_level_args as _args, two_level_ordered as _ordered, worker
from .two_level_args import TierStats, TieredFeedback, padded_shard, shard_numel, shard_range
from .layout import CommStats
from .pipeline import BufferPool
from .shards import shard_bounds
from .spec import CallSpec
from .topology import Topology
from ..ops.codecs import Codec, CodecLike, resolve
from ..ops.sums import exact_exponents, from_exact, to_exact

# codec="auto" for the inter-node tier: choose(numel, group, device, kind) -> Codec, given by the
# caller (flatcomm.collectives resolves it with the tuner, a layer above this one).
Chooser = Callable[[int, object, torch.device, str], Codec]

__all__ = [
    "TierStats", "TieredFeedback", "all_gather", "all_reduce", "default_segments", "padded_shard",
    "reduce_scatter", "segments_of", "shard_numel", "shard_range", "submit"
]


# ---- one worker per topology ---------------------------------------------------------------------

def _key(topo: Topology) -> int:
    """The worker key of a topology: the token of its two tiers' context (closed with either)."""
    return context.pair(topo.intra_group, topo.inter_group).token


def _run(topo: Topology, body: Callable[[], None], value: torch.Tensor, async_op: bool) -> Optional[worker.Handle]:
    # CUDA: the body runs on the topology's side stream after the caller's current stream, and the
    # caller's stream (or the Handle's future) then waits for it, as the flat calls do; the tiers'
    # jobs inside hand their work over with events (flatcomm.comm.node.Job).
    return worker.run(_key(topo), body, value, async_op, (value,), "two-level collective", topo.group)


def submit(topology: Topology, fn: Callable[[], None], reads: Optional[torch.Tensor] = None) -> None:
    """Queue ``fn`` (no collective) on the topology's worker, in order with its collectives (the
    DDP hook's norms, which read a bucket before the all-reduce rewrites it). ``reads``: the
    tensor ``fn`` reads (CUDA: ``fn`` then runs on the topology's side stream, after the caller's
    stream and before the collectives queued after it)."""
    _run(topology, fn, reads if reads is not None else torch.empty(0), async_op=True)


# ---- argument handling ---------------------------------------------------------------------------


def _stats_of(stats) -> TierStats:
    return stats if isinstance(stats, TierStats) else TierStats()


def _report(stats, tiers: TierStats) -> None:
    if isinstance(stats, CommStats):
        total = tiers.total()
        total.calls = 1
        stats.add(total)


def _padded(flat: torch.Tensor, total: int) -> torch.Tensor:
    if flat.numel() == total:
        return flat
    out = torch.zeros(total, dtype=flat.dtype, device=flat.device)
    out[:flat.numel()].copy_(flat)
    return out


# ---- all-reduce ----------------------------------------------------------------------------------


def all_reduce(tensor: torch.Tensor, topology: Topology, spec: CallSpec = CallSpec(),
               choose: Optional[Chooser] = None) -> Optional[worker.Handle]:
    """Hierarchical all-reduce of ``tensor`` in place (see the module docstring). ``spec.codec``:
    the inter-node codec (``"auto"``: chosen by ``choose``, see :data:`Chooser`);
    ``spec.intra_codec``: the node's. ``spec.chunks``: pipeline segments (:func:`segments_of`; keep
    it the same from call to call with error feedback). ``spec.stats``: a CommStats (totals) or a
    :class:`TierStats`."""
    topo = _args.hierarchical(topology)
    a = _args.in_step(topo, _args.ALL_REDUCE, spec.async_op, lambda: _args.all_reduce_call(topo, tensor, spec, choose))
    if isinstance(a, worker.Handle):
        return a
    agreed = _args.agreement(topo, a, spec.validate)
    tiers = _stats_of(spec.stats)

    def body():
        _args.wait_agreed(agreed)
        if spec.mode == "exact":
            _exact_all_reduce(topo, a, tiers)
        else:
            _ordered_all_reduce(topo, a, spec.validate, tiers, choose)
        _report(spec.stats, tiers)

    return _run(topo, body, tensor, spec.async_op)


SEGMENT_BYTES = 4 << 20  # fp32 bytes of a shard per pipeline segment, by default
SEGMENT_PIECE = 1 << 18  # and at least this many values per node's piece of a segment


def segments_of(m: int, align: int, chunks: Optional[int] = None, *, nodes: int) -> List[int]:
    """Boundaries of the pipeline segments within a shard of ``m`` values (aligned): the node
    reduce-scatter of segment j+1 and the all-gather of j-1 run while j crosses nodes. Default
    (:func:`default_segments`): by size; ``codec="auto"`` picks by the cost model
    (:func:`flatcomm.autotune.costmodel.best_segments`). Keep it the same on every rank and every call for
    a given numel (which node re-encodes which values, and so holds their server residual,
    depends on it)."""
    k = chunks if chunks else default_segments(m, nodes)
    bounds = shard_bounds(m, k, align)
    return [a for i, a in enumerate(bounds) if i == 0 or a > bounds[i - 1]]  # no empty segments


def default_segments(m: int, nodes: int) -> int:
    """Segments of a shard of ``m`` values across ``nodes`` when the caller names none: one per
    :data:`SEGMENT_BYTES`, 1 to 8, while every node's piece keeps :data:`SEGMENT_PIECE` values
    (each segment is one exchange across nodes, whose all-gather costs N - 1 latencies)."""
    k = min(round(4 * m / SEGMENT_BYTES), m // (nodes * SEGMENT_PIECE))
    return int(min(8, max(1, k)))


def _ordered_all_reduce(topo: Topology, a: _args.Call, validate: bool, tiers: TierStats,
                        choose: Optional[Chooser]) -> None:
    flat, m, align = a.src, a.m, a.align
    # Staging buffers come from a pool kept per topology: a fresh buffer of this size is fresh
    # pages, and first-touch page faults cost as much as the node's transfers on a CPU host.
    pool = context.by_token(_key(topo)).slot("staging buffers", BufferPool)
    taken: List[torch.Tensor] = []

    def empty(numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        t = pool.take(numel, dtype, flat.device)
        taken.append(t)
        return t

    if _ordered.forwards_payloads(a.inter, a.intra, flat.dtype):
        seg = segments_of(m, align, a.chunks, nodes=topo.nodes)
        _ordered.all_reduce(topo, a, seg, validate, tiers, empty)
    else:  # every segment past one costs the staged path two copies of the tensor
        seg = segments_of(m, align, a.chunks or 1, nodes=topo.nodes)
        _ordered.staged(topo, a, seg, _ordered.InterHop(inter_codec(a.inter, choose), route.all_reduce), validate, tiers,
                        empty)
    for t in taken:  # not after a failure: a collective still in flight may write to them
        pool.give(t)


def _agreed_exponents(topo: Topology, x: torch.Tensor, block: int, tiers: TierStats) -> torch.Tensor:
    """Per-block exponents of ``x`` (1-D), the MAX over all W ranks (node, then across nodes)."""
    return _agree_max(topo, exact_exponents(x, block), tiers)


def _exact_node_sum(topo: Topology, rows_out: torch.Tensor, send: torch.Tensor, exps: torch.Tensor,
                    width: int, block: int, headroom: int, tiers: TierStats) -> torch.Tensor:
    """All-to-all ``send`` (G pieces of ``width`` values) inside the node and sum what arrives as
    fixed-point integers on ``exps`` (this rank's piece): the node's int64 partial sum."""
    g = topo.local_size
    _node.timed(tiers.intra, topo.intra_group, send.device,
           lambda: dist.all_to_all_single(rows_out, send, group=topo.intra_group))
    tiers.intra.wire_bytes += (g - 1) * width * send.element_size()
    rows = rows_out.view(g, width)
    acc = to_exact(rows[0], exps, block, headroom)
    for s in range(1, g):
        acc += to_exact(rows[s], exps, block, headroom)
    return acc


def _exact_all_reduce(topo: Topology, a: _args.Call, tiers: TierStats) -> None:
    flat, m, scale, block, headroom = a.src, a.m, a.scale, a.exact_block, a.headroom
    g, lr = topo.local_size, topo.local_rank
    src = _padded(flat, g * m)
    exps = _agreed_exponents(topo, src, block, tiers)
    mine = exps[lr * (m // block):(lr + 1) * (m // block)].contiguous()
    recv = torch.empty(g * m, dtype=src.dtype, device=src.device)
    acc = _exact_node_sum(topo, recv, src, mine, m, block, headroom, tiers)
    # Partial sums cross nodes as integers: converting them to fp32 first would round per node.
    _node.timed(tiers.inter, topo.inter_group, acc.device,
           lambda: dist.all_reduce(acc, dist.ReduceOp.SUM, group=topo.inter_group))
    tiers.inter.wire_bytes += 2 * (topo.nodes - 1) * acc.numel() * 8 // topo.nodes
    val = from_exact(acc, mine, block, headroom)
    if scale != 1.0:
        val = val * scale
    gathered = torch.empty(g * m, dtype=torch.float32, device=flat.device)
    _node.timed(tiers.intra, topo.intra_group, val.device, lambda: _node.gather(topo, gathered, val))
    tiers.intra.wire_bytes += (g - 1) * m * 4
    flat.copy_(gathered[:flat.numel()])


# ---- reduce-scatter and all-gather ---------------------------------------------------------------


def _by_local_rank(x: torch.Tensor, topo: Topology, width: int) -> torch.Tensor:
    """[W, width] in rank order -> [G, N, width]: the rows destined to each local rank together."""
    return x.view(topo.nodes, topo.local_size, width).transpose(0, 1).contiguous()


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, topology: Topology, spec: CallSpec = CallSpec(),
                   choose: Optional[Chooser] = None) -> Optional[worker.Handle]:
    """Hierarchical reduce-scatter: rank r gets shard r of the sum, as the flat one. ``spec.residual``
    (the inter-node tier's, fp32): input numel / G values (the N shards this rank reduces)."""
    topo = _args.hierarchical(topology)
    a = _args.in_step(topo, _args.REDUCE_SCATTER, spec.async_op,
                      lambda: _args.reduce_scatter_call(topo, output, input, spec, choose))
    if isinstance(a, worker.Handle):
        return a
    validate = spec.validate
    agreed = _args.agreement(topo, a, validate)
    src, out, ci, scale, residual = a.src, a.out, a.intra, a.scale, a.residual
    width = out.numel()
    tiers = _stats_of(spec.stats)

    def body():
        _args.wait_agreed(agreed)
        grouped = _by_local_rank(src, topo, width).view(-1)
        if spec.mode == "exact":
            _exact_reduce_scatter(topo, a, grouped, tiers)
        else:
            part = torch.empty(topo.nodes * width, dtype=torch.float32, device=src.device)
            one_hop.reduce_scatter(part, grouped, CallSpec(codec=ci, op="sum", validate=validate, stats=tiers.intra),
                                   topo.intra_group)
            mine = out if (scale == 1.0 and out.dtype == torch.float32) else torch.empty(
                width, dtype=torch.float32, device=src.device)
            c = inter_codec(a.inter, choose)(part.numel(), topo.inter_group, part.device, "reduce_scatter")
            one_hop.reduce_scatter(mine, part, CallSpec(codec=c, op="sum", residual=residual, chunks=a.chunks,
                                                        validate=validate, stats=tiers.inter), topo.inter_group)
            if mine is not out:
                out.copy_(mine * scale if scale != 1.0 else mine)
        _report(spec.stats, tiers)

    return _run(topo, body, output, spec.async_op)


def _exact_reduce_scatter(topo: Topology, a: _args.Call, grouped: torch.Tensor, tiers: TierStats) -> None:
    src, out, width, scale, block, headroom = a.src, a.out, a.out.numel(), a.scale, a.exact_block, a.headroom
    g, nodes, lr = topo.local_size, topo.nodes, topo.local_rank
    # Exponents per destination shard (blocks start at each shard's start, as in the flat path).
    rows = src.view(topo.world, width)
    exps = torch.stack([exact_exponents(rows[r], block) for r in range(topo.world)])
    nb = exps.shape[1]
    exps = _agree_max(topo, exps, tiers)
    mine = _by_local_rank(exps, topo, nb)[lr]  # [N, nb]: the exponents of the shards I reduce
    recv = torch.empty(g * nodes * width, dtype=src.dtype, device=src.device)
    _node.timed(tiers.intra, topo.intra_group, recv.device,
           lambda: dist.all_to_all_single(recv, grouped, group=topo.intra_group))
    tiers.intra.wire_bytes += (g - 1) * nodes * width * src.element_size()
    arrived = recv.view(g, nodes, width)
    acc = torch.empty(nodes, width, dtype=torch.int64, device=src.device)
    for k in range(nodes):
        acc[k] = to_exact(arrived[0, k], mine[k], block, headroom)
        for s in range(1, g):
            acc[k] += to_exact(arrived[s, k], mine[k], block, headroom)
    # Integer partial sums cross nodes: node k' gets row k' from every node and adds integers.
    got = torch.empty_like(acc)
    _node.timed(tiers.inter, topo.inter_group, acc.device,
           lambda: dist.all_to_all_single(got.view(-1), acc.view(-1), group=topo.inter_group))
    tiers.inter.wire_bytes += (nodes - 1) * width * 8
    total = got.sum(dim=0)
    val = from_exact(total, mine[topo.node].contiguous(), block, headroom)
    out.copy_(val * scale if scale != 1.0 else val)


def _agree_max(topo: Topology, e: torch.Tensor, tiers: TierStats) -> torch.Tensor:
    """``e`` (int32 exponents) replaced by its MAX over all W ranks: inside the node, then across."""
    for grp, st in ((topo.intra_group, tiers.intra), (topo.inter_group, tiers.inter)):
        _node.timed(st, grp, e.device, lambda: dist.all_reduce(e, dist.ReduceOp.MAX, group=grp))
        st.wire_bytes += e.numel() * 4
    return e


def all_gather(output: torch.Tensor, input: torch.Tensor, topology: Topology,
               spec: CallSpec = CallSpec()) -> Optional[worker.Handle]:
    """Hierarchical all-gather: across nodes with ``spec.codec`` (each rank's input crosses the
    network once, ``spec.residual`` = the sender's, input numel), then inside the node with
    ``spec.intra_codec``. Every rank receives the decoded values, the same as the flat all-gather's."""
    topo = _args.hierarchical(topology)
    a = _args.in_step(topo, _args.ALL_GATHER, spec.async_op, lambda: _args.all_gather_call(topo, output, input, spec))
    if isinstance(a, worker.Handle):
        return a
    validate = spec.validate
    agreed = _args.agreement(topo, a, validate)
    src, out, n = a.src, a.out, a.src.numel()
    tiers = _stats_of(spec.stats)

    def body():
        _args.wait_agreed(agreed)
        across = torch.empty(topo.nodes * n, dtype=out.dtype, device=out.device)
        one_hop.all_gather(across, src, CallSpec(codec=a.inter, residual=a.residual, validate=validate,
                                                 stats=tiers.inter), topo.inter_group)
        inside = torch.empty(topo.world * n, dtype=out.dtype, device=out.device)
        one_hop.all_gather(inside, across, CallSpec(codec=a.intra, validate=validate, stats=tiers.intra),
                           topo.intra_group)
        out.view(topo.nodes, topo.local_size, n).copy_(inside.view(topo.local_size, topo.nodes, n).transpose(0, 1))
        _report(spec.stats, tiers)

    return _run(topo, body, output, spec.async_op)


def inter_codec(codec: CodecLike, choose: Optional[Chooser]) -> Chooser:
    """The inter tier's codec for a call of ``numel`` values on ``group``: ``codec`` itself, or
    ``choose``'s pick for ``codec="auto"``."""
    if isinstance(codec, str) and codec == "auto":
        if choose is None:
            raise ValueError("flatcomm: codec='auto' on the two-level path is chosen by the tuner: call "
                             "flatcomm.all_reduce / reduce_scatter with topology=")
        return choose
    c = resolve(codec)
    return lambda numel, group, device, kind: c

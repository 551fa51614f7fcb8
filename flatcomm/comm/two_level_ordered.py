"""The ordered two-level all-reduce (:func:`flatcomm.comm.two_level.all_reduce`, ``mode="ordered"``).

Per pipeline segment j of the node's G shards (:func:`flatcomm.comm.two_level.segments_of`):

1. the node's lossless reduce-scatter (fp32, ascending local-rank order) of the segment's columns:
   this rank's shard segment holds the node's sum;
2. across nodes, among the N ranks of this local rank, the one-hop exchange of that segment with
   ``codec``: every rank decodes-and-sums its piece from the N payloads and re-encodes it (server
   residual), and the re-encoded payloads are all-gathered across nodes;
3. the node all-gathers those *payloads* (N per local rank) and every rank decodes all G x N.

Step 3 forwards the compressed bytes rather than decoded fp32 values: the node tier's gather
moves c x the bytes, and every rank still ends with the same bits (all decode the same payloads).
Steps run on their groups' worker threads, so while segment j crosses nodes the node reduces
segment j+1.

A lossy ``intra_codec``, another dtype or an inter codec left ``"auto"`` take the staged path
(:func:`staged`): the node's steps are flatcomm's codec collectives and the inter tier is the
one-hop all-reduce on the shard (with a per-inter-group ``auto``, local ranks may pick
different codecs, so they cannot decode each other's payloads).
"""
from __future__ import annotations

import concurrent.futures
import functools
import time
from typing import Any, Callable, List, cast

import torch

from . import flat as one_hop, header, node as _node, signature
from .args import ErrorFeedback
from . import pipeline
from .pipeline import CommStats, Pipeline, Plan, drain, shard_bounds
from .spec import CallSpec
from .two_level_args import Call
from .topology import Topology
from ..ops.codecs import Codec, decode_sum, reencode_sum

__all__ = ["all_reduce", "forwards_payloads", "staged"]


_NO_EXACT = signature.exact_fields("ordered", 0, 0)
_ALL_REDUCE = header.KIND_IDS["all_reduce"]  # each tier's own header: a one-hop all-reduce's


def forwards_payloads(codec, intra: Codec, dtype: torch.dtype) -> bool:
    """Whether :func:`all_reduce` (payload forwarding) applies, else :func:`staged`."""
    return isinstance(codec, Codec) and intra.lossless and dtype == torch.float32


def _plan(numel: int, topo: Topology, align: int) -> Plan:
    return pipeline.plan(shard_bounds(numel, topo.nodes, align), 1, align, topo.node)


def _padded_src(flat: torch.Tensor, g: int, m: int, empty: Callable) -> torch.Tensor:
    n = flat.numel()
    if n == g * m:
        return flat
    src = empty(g * m, flat.dtype)
    src[:n].copy_(flat)
    src[n:].zero_()
    return src


def all_reduce(topo: Topology, call: Call, seg: List[int], validate: bool, tiers, empty: Callable) -> None:
    """Ordered two-level all-reduce of ``call.src`` in place, forwarding payloads (module docstring).
    ``seg``: segment boundaries within the shard; ``empty(numel, dtype)``: pooled staging."""
    flat, m, align, scale, inter_fb = call.src, call.m, call.align, call.scale, call.inter_fb
    codec = cast(Codec, call.inter)  # forwards_payloads: a named inter codec, not "auto"
    g, n, nodes, me, dev = topo.local_size, flat.numel(), topo.nodes, topo.local_rank, flat.device
    k = len(seg) - 1
    if k == 0:  # no values (every rank agreed on numel 0 in the call's header): nothing to exchange
        return
    rows = _padded_src(flat, g, m, empty).view(g, m)
    shard = empty(m, torch.float32)
    real = [max(0, min(m, n - lr * m)) for lr in range(g)]  # each local rank's data in its shard
    # Per segment, every local rank's plan across nodes (real data only: padding in a block would
    # change sign's scale) and one payload row width for the whole node (the gathers move equal sizes).
    plans = [[_plan(max(0, min(seg[j + 1], real[lr]) - seg[j]), topo, align) for lr in range(g)]
             for j in range(k)]
    width = [max(codec.wire_bytes(b - a) for p in plans[j] for a, b in (p.piece(d, 0) for d in range(nodes)))
             for j in range(k)]
    scratch = [empty(g * (seg[j + 1] - seg[j]), torch.float32) for j in range(k)]
    payloads = [empty(g * nodes * width[j], torch.uint8) for j in range(k)]
    client = inter_fb.client if inter_fb is not None else None
    server = inter_fb.server if inter_fb is not None and not codec.lossless else None
    if inter_fb is not None and codec.lossless:  # nothing re-encodes: the server residual goes out now
        inter_fb.client.add_(inter_fb.server)
        inter_fb.server.zero_()
    fields = signature.signature(_ALL_REDUCE, n, codec, "ordered", scale, flat.dtype, k, _NO_EXACT)

    node_agrees: concurrent.futures.Future = concurrent.futures.Future()

    def node_reduce(j: int) -> None:
        if j == 0:  # the node agrees on the call before the first payload byte moves
            try:
                Pipeline(topo.intra_group, tiers.intra, fields, dev, validate).release()
            except BaseException as e:
                node_agrees.set_exception(e)
                raise
            node_agrees.set_result(None)
        a, b = seg[j], seg[j + 1]
        _node.reduce(topo, shard[a:b], rows[:, a:b], scratch[j])
        tiers.intra.wire_bytes += (g - 1) * (b - a) * 4

    def across() -> None:
        """The inter tier of every segment, pipelined like a chunked all-reduce: segment j+1's
        payloads go out while j is re-encoded and its result gathered."""
        # The node agreed before anything moves (an argument error anywhere was already every
        # rank's error, in the call's header among all ranks); a failure here is a broken node.
        node_agrees.result()
        pipe = Pipeline(topo.inter_group, tiers.inter,
                        signature.signature(_ALL_REDUCE, real[me], codec, "ordered", 1.0, torch.float32, k, _NO_EXACT), dev,
                        validate)
        tiers.inter.calls += 1

        def send(j):
            reduced[j].wait()  # CUDA: this side stream waits for the node's sum
            plan, a = plans[j][me], seg[j]
            w = plan.bounds[-1]
            if w == 0:  # every rank of this inter group has the same shard: all skip
                return None
            buf, sizes = pipe.encode_pieces(shard[a:a + w], plan, 0, codec,
                                            client[a:a + w] if client is not None else None)
            pa, pb = plan.piece(topo.node, 0)
            return pipe.all_to_all(buf, sizes, codec.wire_bytes(pb - pa), nodes)

        def reduce(j, state):
            if state is None:
                return None
            work, recv = state
            pipe.wait(work)
            a = seg[j]
            pa, pb = plans[j][me].piece(topo.node, 0)
            nbytes = codec.wire_bytes(pb - pa)
            out = pipe.empty(width[j], torch.uint8, dev)  # padding past nbytes is never read
            r = server[a + pa:a + pb] if server is not None else None

            pipe.timed("decode_s", lambda: reencode_sum(recv.view(nodes, -1), codec, pb - pa, residual=r,
                                                        out=out[:nbytes]))
            per_rank = nodes * width[j]
            tiers.inter.wire_bytes += width[j] * (nodes - 1)
            return header.all_gather_single(payloads[j][me * per_rank:(me + 1) * per_rank], out,
                                            group=topo.inter_group, async_op=True)

        def finish(j, work):
            pipe.wait(work)
            spread.append(_node.queued(tiers.intra, topo.intra_group, dev, functools.partial(node_spread, j)))

        pipe.run(k, send, reduce, finish)
        pipe.release()

    def node_spread(j: int) -> None:
        per_rank = nodes * width[j]
        _node.gather(topo, payloads[j], payloads[j][me * per_rank:(me + 1) * per_rank])
        tiers.intra.wire_bytes += (g - 1) * per_rank
        got = payloads[j].view(g, nodes, width[j])

        def decode():
            for lr in range(g):
                base = lr * m + seg[j]
                for d in range(nodes):
                    pa, pb = plans[j][lr].piece(d, 0)
                    if pb > pa:
                        decode_sum(got[lr, d, :codec.wire_bytes(pb - pa)].view(1, -1), codec, pb - pa,
                                   scale=scale, out=flat[base + pa:base + pb])

        _timed_into(tiers.intra, "decode_s", decode)

    spread: List[_node.Job] = []
    reduced = [_node.queued(tiers.intra, topo.intra_group, dev, functools.partial(node_reduce, j)) for j in range(k)]
    try:
        _node.queued(None, topo.inter_group, dev, across).wait()  # its pipeline counts its own time
        for job in spread:
            job.wait()
    except BaseException:
        _settle(reduced + spread)
        raise


def _settle(pending) -> None:
    """After a failure: cancel the call's jobs and handles that have not started (each would start
    exchanges that wait a whole timeout for peers that gave up too), then wait for the others,
    ignoring their errors. The call raises only once none of its transfers is in flight, within
    about one timeout of the failure."""
    items = [item[1] if isinstance(item, tuple) else item for item in pending]  # (out, handle) pairs
    items = [h for h in items if h is not None]
    for h in items:
        h.cancel()
    drain(items)


def _timed_into(st: CommStats, field: str, fn: Callable[[], None]) -> None:
    t0 = time.perf_counter()
    fn()
    setattr(st, field, getattr(st, field) + time.perf_counter() - t0)


def staged(topo: Topology, call: Call, seg: List[int], codec: Callable, validate: bool, tiers,
           empty: Callable) -> None:
    """The two-level all-reduce with codec collectives in the node and the one-hop all-reduce
    across nodes (any intra codec, dtype, and ``codec="auto"``): ``codec`` is the chooser of
    :func:`flatcomm.comm.two_level.inter_codec`, asked per segment."""
    flat, m, ci, scale, inter_fb, intra_fb = call.src, call.m, call.intra, call.scale, call.inter_fb, call.intra_fb
    g, n = topo.local_size, flat.numel()
    src = _padded_src(flat, g, m, empty)
    rows = src.view(g, m)
    shard = empty(m, torch.float32)
    k = len(seg) - 1
    real = max(0, min(m, n - topo.local_rank * m))
    rs: List[Any] = []
    ar: List[Any] = []
    ag: List[Any] = []
    try:  # every handle of the call settles before it raises (see _settle)
        for j in range(k):  # the intra client residual is laid out segment by segment (G x width each)
            a, b = seg[j], seg[j + 1]
            piece = src if k == 1 else empty(g * (b - a), src.dtype).view(g, b - a).copy_(rows[:, a:b]).view(-1)
            res = intra_fb.client[g * a:g * b] if intra_fb is not None else None
            rs.append(one_hop.reduce_scatter(shard[a:b], piece, CallSpec(
                codec=ci, op="sum", validate=validate, residual=res, stats=tiers.intra, async_op=True),
                topo.intra_group))
        for j in range(k):
            rs[j].wait()
            a, b = seg[j], min(seg[j + 1], real)
            if b > a:
                fb = ErrorFeedback(inter_fb.client[a:b], inter_fb.server[a:b]) if inter_fb is not None else None
                c = codec(b - a, topo.inter_group, shard.device, "all_reduce")
                ar.append(one_hop.all_reduce(shard[a:b], CallSpec(
                    codec=c, op="sum", residual=fb, validate=validate, stats=tiers.inter, async_op=True),
                    topo.inter_group))
            else:
                ar.append(None)
        whole = k == 1 and src is flat
        for j in range(k):
            if ar[j] is not None:
                ar[j].wait()
            a, b = seg[j], seg[j + 1]
            if scale != 1.0:
                shard[a:b].mul_(scale)
            hi = min(b, real)
            if inter_fb is not None and flat.dtype != torch.float32 and topo.node == 0 and hi > a:
                # what rounding to the data's dtype drops, kept once (every node holds this
                # shard; node 0's rank keeps it): the inter tier's next encode adds it
                lost = empty(hi - a)
                one_hop.rounding_into(shard[a:hi], flat.dtype, lost)
                inter_fb.client[a:hi].add_(lost, alpha=1.0 / scale)
            out = flat if whole else empty(g * (b - a), flat.dtype)
            if ci.lossless and flat.dtype == torch.float32:
                tiers.intra.wire_bytes += (g - 1) * (b - a) * 4
                ag.append((out, _node.queued(tiers.intra, topo.intra_group, flat.device,
                                             functools.partial(_node.gather, topo, out, shard[a:b]))))
                continue
            res = intra_fb.server[a:b] if intra_fb is not None else None
            ag.append((out, one_hop.all_gather(out, shard[a:b], CallSpec(
                codec=ci, validate=validate, residual=res, stats=tiers.intra, async_op=True), topo.intra_group)))
        for j, (out, h) in enumerate(ag):
            h.wait()  # a Handle or a node Job
            if whole:
                continue
            a, b = seg[j], seg[j + 1]
            if src is flat:
                rows[:, a:b].copy_(out.view(g, b - a))
            else:  # padded: write back the part that holds data
                for lr in range(g):
                    lo, hi = lr * m + a, min(lr * m + b, n)
                    if hi > lo:
                        flat[lo:hi].copy_(out[lr * (b - a):lr * (b - a) + hi - lo])
    except BaseException:
        _settle(rs + ar + ag)
        raise

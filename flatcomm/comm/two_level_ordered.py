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
from typing import Any, Callable, List, NamedTuple, cast

import torch

from . import flat as one_hop, header, node as _node, signature
from .args import ErrorFeedback
from . import layout
from .layout import CommStats, Plan
from .p2p import drain
from .pipeline import Pipeline
from .shards import shard_bounds
from .spec import CallSpec
from .two_level_args import Call
from .topology import Topology
from ..ops.codecs import Codec, decode_sum, reencode_sum

__all__ = ["InterHop", "all_reduce", "forwards_payloads", "staged"]


_NO_EXACT = signature.exact_fields("ordered", 0, 0)
_ALL_REDUCE = header.KIND_IDS["all_reduce"]  # each tier's own header: a one-hop all-reduce's


def forwards_payloads(codec, intra: Codec, dtype: torch.dtype) -> bool:
    """Whether :func:`all_reduce` (payload forwarding) applies, else :func:`staged`."""
    return isinstance(codec, Codec) and intra.lossless and dtype == torch.float32


def _plan(numel: int, topo: Topology, align: int) -> Plan:
    return layout.plan(shard_bounds(numel, topo.nodes, align), 1, align, topo.node)


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
    if len(seg) - 1 == 0:  # no values (every rank agreed on numel 0 in the call's header): nothing to exchange
        return
    _Forwarding(topo, call, seg, validate, tiers, empty).run()


class _Forwarding:
    """One call of :func:`all_reduce`: its buffers and plans, and a method per phase. The node's
    phases (:meth:`node_reduce`, :meth:`node_spread`) run as jobs on the node group's worker; the
    inter tier (:meth:`across`: :meth:`send`, :meth:`reduce`, :meth:`finish` per segment) on the
    inter group's."""

    def __init__(self, topo: Topology, call: Call, seg: List[int], validate: bool, tiers, empty: Callable) -> None:
        flat, m, align = call.src, call.m, call.align
        codec = cast(Codec, call.inter)  # forwards_payloads: a named inter codec, not "auto"
        g, n, nodes = topo.local_size, flat.numel(), topo.nodes
        self.topo, self.seg, self.validate, self.tiers, self.codec = topo, seg, validate, tiers, codec
        self.flat, self.m, self.scale, self.k = flat, m, call.scale, len(seg) - 1
        self.rows = _padded_src(flat, g, m, empty).view(g, m)
        self.shard = empty(m, torch.float32)
        self.real = [max(0, min(m, n - lr * m)) for lr in range(g)]  # each local rank's data in its shard
        # Per segment, every local rank's plan across nodes (real data only: padding in a block would
        # change sign's scale) and one payload row width for the whole node (the gathers move equal sizes).
        self.plans = [[_plan(max(0, min(seg[j + 1], self.real[lr]) - seg[j]), topo, align) for lr in range(g)]
                      for j in range(self.k)]
        self.width = [max(codec.wire_bytes(b - a) for p in self.plans[j]
                          for a, b in (p.piece(d, 0) for d in range(nodes))) for j in range(self.k)]
        self.scratch = [empty(g * (seg[j + 1] - seg[j]), torch.float32) for j in range(self.k)]
        self.payloads = [empty(g * nodes * self.width[j], torch.uint8) for j in range(self.k)]
        inter_fb = call.inter_fb
        self.client = inter_fb.client if inter_fb is not None else None
        self.server = inter_fb.server if inter_fb is not None and not codec.lossless else None
        if inter_fb is not None and codec.lossless:  # nothing re-encodes: the server residual goes out now
            inter_fb.client.add_(inter_fb.server)
            inter_fb.server.zero_()
        self.fields = signature.signature(_ALL_REDUCE, n, codec, "ordered", self.scale, flat.dtype, self.k, _NO_EXACT)
        self.node_agrees: concurrent.futures.Future = concurrent.futures.Future()
        self.spread: List[_node.Job] = []
        self.reduced: List[_node.Job] = []
        self.pipe: Pipeline

    def run(self) -> None:
        topo, dev = self.topo, self.flat.device
        self.reduced = [_node.queued(self.tiers.intra, topo.intra_group, dev, functools.partial(self.node_reduce, j))
                        for j in range(self.k)]
        try:
            _node.queued(None, topo.inter_group, dev, self.across).wait()  # its pipeline counts its own time
            for job in self.spread:
                job.wait()
        except BaseException:
            _settle(self.reduced + self.spread)
            raise

    def node_reduce(self, j: int) -> None:
        """Segment j's lossless reduce-scatter in the node (at j == 0, first the node's agreement)."""
        if j == 0:  # the node agrees on the call before the first payload byte moves
            try:
                Pipeline(self.topo.intra_group, self.tiers.intra, self.fields, self.flat.device, self.validate).release()
            except BaseException as e:
                self.node_agrees.set_exception(e)
                raise
            self.node_agrees.set_result(None)
        a, b = self.seg[j], self.seg[j + 1]
        _node.reduce(self.topo, self.shard[a:b], self.rows[:, a:b], self.scratch[j])
        self.tiers.intra.wire_bytes += (self.topo.local_size - 1) * (b - a) * 4

    def across(self) -> None:
        """The inter tier of every segment, pipelined like a chunked all-reduce: segment j+1's
        payloads go out while j is re-encoded and its result gathered."""
        # The node agreed before anything moves (an argument error anywhere was already every
        # rank's error, in the call's header among all ranks); a failure here is a broken node.
        self.node_agrees.result()
        fields = signature.signature(_ALL_REDUCE, self.real[self.topo.local_rank], self.codec, "ordered", 1.0,
                                  torch.float32, self.k, _NO_EXACT)
        self.pipe = Pipeline(self.topo.inter_group, self.tiers.inter, fields, self.flat.device, self.validate)
        self.tiers.inter.calls += 1
        self.pipe.run(self.k, self.send, self.reduce, self.finish)
        self.pipe.release()

    def send(self, j: int):
        """Segment j's piece of this rank's shard, encoded, to every node (its all-to-all)."""
        self.reduced[j].wait()  # CUDA: this side stream waits for the node's sum
        plan, a, codec = self.plans[j][self.topo.local_rank], self.seg[j], self.codec
        w = plan.bounds[-1]
        if w == 0:  # every rank of this inter group has the same shard: all skip
            return None
        buf, sizes = self.pipe.encode_pieces(self.shard[a:a + w], plan, 0, codec,
                                             self.client[a:a + w] if self.client is not None else None)
        pa, pb = plan.piece(self.topo.node, 0)
        return self.pipe.all_to_all(buf, sizes, codec.wire_bytes(pb - pa), self.topo.nodes)

    def reduce(self, j: int, state):
        """This rank's piece of segment j: decoded, summed, re-encoded; its payload all-gathered."""
        if state is None:
            return None
        work, recv = state
        self.pipe.wait(work)
        topo, codec, a, width = self.topo, self.codec, self.seg[j], self.width[j]
        pa, pb = self.plans[j][topo.local_rank].piece(topo.node, 0)
        nbytes = codec.wire_bytes(pb - pa)
        out = self.pipe.empty(width, torch.uint8, self.flat.device)  # padding past nbytes is never read
        r = self.server[a + pa:a + pb] if self.server is not None else None
        self.pipe.timed("decode_s", lambda: reencode_sum(recv.view(topo.nodes, -1), codec, pb - pa, residual=r,
                                                         out=out[:nbytes]))
        per_rank = topo.nodes * width
        self.tiers.inter.wire_bytes += width * (topo.nodes - 1)
        me = topo.local_rank
        return header.all_gather_single(self.payloads[j][me * per_rank:(me + 1) * per_rank], out,
                                        group=topo.inter_group, async_op=True)

    def finish(self, j: int, work) -> None:
        self.pipe.wait(work)
        self.spread.append(_node.queued(self.tiers.intra, self.topo.intra_group, self.flat.device,
                                        functools.partial(self.node_spread, j)))

    def node_spread(self, j: int) -> None:
        """The node all-gathers segment j's payloads; every rank decodes all of them."""
        topo, me = self.topo, self.topo.local_rank
        per_rank = topo.nodes * self.width[j]
        _node.gather(topo, self.payloads[j], self.payloads[j][me * per_rank:(me + 1) * per_rank])
        self.tiers.intra.wire_bytes += (topo.local_size - 1) * per_rank
        _timed_into(self.tiers.intra, "decode_s", functools.partial(self.decode, j))

    def decode(self, j: int) -> None:
        topo, codec = self.topo, self.codec
        got = self.payloads[j].view(topo.local_size, topo.nodes, self.width[j])
        for lr in range(topo.local_size):
            base = lr * self.m + self.seg[j]
            for d in range(topo.nodes):
                pa, pb = self.plans[j][lr].piece(d, 0)
                if pb > pa:
                    decode_sum(got[lr, d, :codec.wire_bytes(pb - pa)].view(1, -1), codec, pb - pa,
                               scale=self.scale, out=self.flat[base + pa:base + pb])


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


class InterHop(NamedTuple):
    """The hop across nodes of a staged call: ``codec``, the chooser of
    :func:`flatcomm.comm.two_level.inter_codec` (asked per segment), and ``all_reduce``, the one-hop
    all-reduce on its route (:func:`flatcomm.comm.route.all_reduce`, given by the caller: the route
    floor lies above what this module may import)."""
    codec: Callable
    all_reduce: Callable


def staged(topo: Topology, call: Call, seg: List[int], inter: InterHop, validate: bool, tiers,
           empty: Callable) -> None:
    """The two-level all-reduce with codec collectives in the node and the one-hop all-reduce
    across nodes (any intra codec, dtype, and ``codec="auto"``)."""
    _Staged(topo, call, seg, inter, validate, tiers, empty).run()


class _Staged:
    """One call of :func:`staged`, a method per phase: the node's reduce-scatter of every segment
    (:meth:`scatter`), the one-hop all-reduce across nodes (:meth:`across`), the node's all-gather
    (:meth:`gather`) and the copy back into the caller's tensor (:meth:`write_back`)."""

    def __init__(self, topo: Topology, call: Call, seg: List[int], inter: InterHop, validate: bool, tiers,
                 empty: Callable) -> None:
        self.topo, self.call, self.seg, self.inter, self.validate, self.tiers = topo, call, seg, inter, validate, tiers
        self.empty = empty
        flat, m = call.src, call.m
        self.g, self.n = topo.local_size, flat.numel()
        self.src = _padded_src(flat, self.g, m, empty)
        self.rows = self.src.view(self.g, m)
        self.shard = empty(m, torch.float32)
        self.k = len(seg) - 1
        self.real = max(0, min(m, self.n - topo.local_rank * m))
        self.whole = self.k == 1 and self.src is flat  # the gather writes the caller's tensor itself
        self.rs: List[Any] = []
        self.ar: List[Any] = []
        self.ag: List[Any] = []

    def run(self) -> None:
        try:  # every handle of the call settles before it raises (see _settle)
            self.scatter()
            self.across()
            self.gather()
            self.write_back()
        except BaseException:
            _settle(self.rs + self.ar + self.ag)
            raise

    def scatter(self) -> None:
        call, g = self.call, self.g
        for j in range(self.k):  # the intra client residual is laid out segment by segment (G x width each)
            a, b = self.seg[j], self.seg[j + 1]
            piece = self.src if self.k == 1 else \
                self.empty(g * (b - a), self.src.dtype).view(g, b - a).copy_(self.rows[:, a:b]).view(-1)
            res = call.intra_fb.client[g * a:g * b] if call.intra_fb is not None else None
            self.rs.append(one_hop.reduce_scatter(self.shard[a:b], piece, CallSpec(
                codec=call.intra, op="sum", validate=self.validate, residual=res, stats=self.tiers.intra,
                async_op=True), self.topo.intra_group))

    def across(self) -> None:
        inter_fb = self.call.inter_fb
        for j in range(self.k):
            self.rs[j].wait()
            a, b = self.seg[j], min(self.seg[j + 1], self.real)
            if b <= a:
                self.ar.append(None)
                continue
            fb = ErrorFeedback(inter_fb.client[a:b], inter_fb.server[a:b]) if inter_fb is not None else None
            c = self.inter.codec(b - a, self.topo.inter_group, self.shard.device, "all_reduce")
            self.ar.append(self.inter.all_reduce(self.shard[a:b], CallSpec(
                codec=c, op="sum", residual=fb, validate=self.validate, stats=self.tiers.inter, async_op=True),
                self.topo.inter_group))

    def gather(self) -> None:
        for j in range(self.k):
            if self.ar[j] is not None:
                self.ar[j].wait()
            a, b = self.seg[j], self.seg[j + 1]
            self._rounded(a, b)
            self.ag.append(self._gather_one(a, b))

    def _rounded(self, a: int, b: int) -> None:
        """Segment [a, b) of the shard scaled; with error feedback into another dtype, what rounding
        to the data's dtype drops, kept once (every node holds this shard; node 0's rank keeps it):
        the inter tier's next encode adds it."""
        flat, scale, inter_fb = self.call.src, self.call.scale, self.call.inter_fb
        if scale != 1.0:
            self.shard[a:b].mul_(scale)
        hi = min(b, self.real)
        if inter_fb is not None and flat.dtype != torch.float32 and self.topo.node == 0 and hi > a:
            lost = self.empty(hi - a)
            one_hop.rounding_into(self.shard[a:hi], flat.dtype, lost)
            inter_fb.client[a:hi].add_(lost, alpha=1.0 / scale)

    def _gather_one(self, a: int, b: int) -> tuple:
        """(where the node's gather of segment [a, b) lands, its handle or node job)."""
        call, topo, g = self.call, self.topo, self.g
        flat = call.src
        out = flat if self.whole else self.empty(g * (b - a), flat.dtype)
        if call.intra.lossless and flat.dtype == torch.float32:
            self.tiers.intra.wire_bytes += (g - 1) * (b - a) * 4
            return out, _node.queued(self.tiers.intra, topo.intra_group, flat.device,
                                     functools.partial(_node.gather, topo, out, self.shard[a:b]))
        res = call.intra_fb.server[a:b] if call.intra_fb is not None else None
        return out, one_hop.all_gather(out, self.shard[a:b], CallSpec(
            codec=call.intra, validate=self.validate, residual=res, stats=self.tiers.intra, async_op=True),
            topo.intra_group)

    def write_back(self) -> None:
        flat, g, m = self.call.src, self.g, self.call.m
        for j, (out, h) in enumerate(self.ag):
            h.wait()  # a Handle or a node Job
            if self.whole:
                continue
            a, b = self.seg[j], self.seg[j + 1]
            if self.src is flat:
                self.rows[:, a:b].copy_(out.view(g, b - a))
                continue
            for lr in range(g):  # padded: write back the part that holds data
                lo, hi = lr * m + a, min(lr * m + b, self.n)
                if hi > lo:
                    flat[lo:hi].copy_(out[lr * (b - a):lr * (b - a) + hi - lo])

"""The one-hop collectives on one process group, for a named codec (``"auto"`` is resolved above,
in :mod:`flatcomm.collectives`).

Reduce-scatter is one hop: every rank encodes the piece of its input destined to each peer, one
``all_to_all_single`` moves the payloads, and one fused kernel decodes them and accumulates in fp32
in ascending *source rank* order, so every rank and every run computes the same bits whatever the
backend's algorithm or the arrival order. All-reduce is that reduce-scatter plus an all-gather; with
a lossy codec the reduced shard is re-encoded with a second, per-shard residual (server-side error
feedback) and every rank, the owner included, uses the decoded shard, so all ranks hold equal bits.
``mode="exact"``: :mod:`flatcomm.comm.exact`. Large inputs are split into chunks: the exchange of
chunk j+1 is in flight while chunk j is decoded (:mod:`flatcomm.comm.pipeline`).

**Groups and headers.** Each call runs on flatcomm's private copy of the named group
(:mod:`flatcomm.comm.groups`: the caller's own collectives never interleave with flatcomm's; the
parent's timeout), on that group's worker thread (:mod:`flatcomm.comm.worker`), and first
all-gathers a fixed-size header per rank (:mod:`flatcomm.comm.header`): the call's fields, its
number on the group and, for a rank whose arguments were rejected, the reason. Every rank checks the
same table before any payload moves, so mismatches raise on every rank (also with
``validate=False``, kept for compatibility) and argument errors keep the group in step.

**CUDA streams** (:mod:`flatcomm.comm.streams`; untested on a GPU so far). With CUDA tensors a call
records an event on the caller's current stream at submission; the group's worker runs the
collective's kernels on a side stream per (group, device) that waits on that event, and NCCL
issues each exchange on its own stream after waiting for the side stream, so the worker only
enqueues: no host synchronisation (the call header travels on the group's CPU backend; on an
NCCL-only group it is read back from the GPU, so it runs there only with ``validate=True``, which
the DDP hook passes once per bucket layout). A synchronous call returns once the work is enqueued,
with the caller's current stream made to wait for it; ``Handle.wait()`` does the same;
``Handle.get_future()`` is a CUDA-aware ``torch.futures.Future`` whose ``wait()`` makes the
consumer's current stream wait (DDP's reducer does that). ``CommStats`` times are host times, i.e.
of enqueueing the work on CUDA (``exchange_s`` is then about 0). CPU tensors take none of this.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.distributed as dist

from . import args, exact, groups, p2p, rejected, small, worker
from .args import ErrorFeedback
from . import pipeline
from .fields import KIND_IDS
from .layout import Plan
from .pipeline import Pipeline, zero_copy
from .small import rounding_into
from .spec import CallSpec
from ..ops.codecs import Codec, decode, encode, reencode_sum
from ..ops.native import ops

__all__ = ["all_gather", "checked_all_reduce", "reduce_scatter", "rounding_into", "runs_natively"]


def checked_all_reduce(group, a: args.Call, spec: CallSpec, tensor: torch.Tensor, native: bool) -> Optional[worker.Handle]:
    """The all-reduce of ``tensor`` with its checked arguments ``a`` (``group``: a private group) on
    the pipelined, exact or (``native``: :func:`runs_natively`) native route, on the group's worker
    (:func:`flatcomm.comm.route.run` chose it)."""
    flat, c, n = a.src, a.codec, a.src.numel()
    mode, residual, stats, validate = spec.mode, a.feedback, spec.stats, spec.validate

    def body():
        with Pipeline(group, stats, a.fields, flat.device, validate, early=native) as pipe:
            pipe.stats.calls += 1
            if native:  # (ordered or exact: the same transfers, exact_sum per piece in exact mode)
                grid = (a.exact_block, a.headroom) if mode == "exact" else (0, 0)
                _raw_all_reduce_p2p(pipe, flat, a.plan, c, a.scale, a.chunks, grid)
            elif mode == "exact":
                exact.all_reduce(pipe, flat, a.plan, a.chunks, a.scale, a.exact_block, a.headroom)
            else:
                _ordered_all_reduce(pipe, flat, a.plan, a.chunks, c, a.scale, residual)


    keep = (flat,) if residual is None else (flat, residual.client, residual.server)
    return worker.run(worker.key_of(group), body, tensor, spec.async_op, keep,
                      f"all_reduce of {n} values ({c.name})", group)


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, spec: CallSpec = CallSpec(),
                   group=None) -> Optional[worker.Handle]:
    """Reduce ``input`` across ranks; rank r gets shard r (see :func:`flatcomm.collectives.reduce_scatter`)."""
    group = groups.private_group(group)
    a = rejected.in_step(group, KIND_IDS["reduce_scatter"], spec.async_op,
                     lambda: args.reduce_scatter_call(group, output, input, spec))
    if isinstance(a, worker.Handle):
        return a
    if small.fits_reduce_scatter(group, a, spec.mode):
        return small.reduce_scatter(group, a, spec, output)
    src, out, c, r = a.src, a.out, a.codec, a.residual
    mode, stats, validate = spec.mode, spec.stats, spec.validate

    def body():
        with Pipeline(group, stats, a.fields, src.device, validate) as pipe:
            pipe.stats.calls += 1
            if mode == "exact":
                exact.reduce_scatter(pipe, src, out, a.plan, a.chunks, a.scale, a.exact_block, a.headroom)
            else:
                _ordered_reduce_scatter(pipe, src, out, a.plan, a.chunks, c, a.scale, r)

    return worker.run(worker.key_of(group), body, output, spec.async_op, (src, out, r),
                      f"reduce_scatter of {src.numel()} values ({c.name})", group)


def all_gather(output: torch.Tensor, input: torch.Tensor, spec: CallSpec = CallSpec(),
               group=None) -> Optional[worker.Handle]:
    """Gather every rank's ``input`` into ``output`` (see :func:`flatcomm.collectives.all_gather`)."""
    group = groups.private_group(group)
    a = rejected.in_step(group, KIND_IDS["all_gather"], spec.async_op,
                     lambda: args.all_gather_call(group, output, input, spec))
    if isinstance(a, worker.Handle):
        return a
    src, out, c, r, world = a.src, a.out, a.codec, a.residual, a.world
    stats, validate = spec.stats, spec.validate
    n = src.numel()

    def body():
        with Pipeline(group, stats, a.fields, src.device, validate) as pipe:
            pipe.stats.calls += 1
            payload = pipe.empty(c.wire_bytes(n), torch.uint8, src.device)
            if r is not None:  # encoding updates the residual: never for a call that then fails its check
                pipe.checked()
            pipe.timed("encode_s", lambda: encode(src, c, residual=r, out=payload))
            work, recv = pipe.all_gather(payload, world)
            pipe.wait(work)
            rows = recv.view(world, -1)

            def dec():
                for d in range(world):
                    decode(rows[d], c, n, out=out[d * n:(d + 1) * n])

            pipe.timed("decode_s", dec)

    return worker.run(worker.key_of(group), body, output, spec.async_op, (src, out, r),
                      f"all_gather of {n} values ({c.name})", group)


# ---- ordered (fixed source-rank order) -----------------------------------------------------------


def _ordered_reduce_scatter(pipe: Pipeline, src: torch.Tensor, out: torch.Tensor, p: Plan, chunks: int,
                            codec: Codec, scale: float, residual: Optional[torch.Tensor]) -> None:
    me = p.rank
    base = p.bounds[me]
    if zero_copy(codec, src.dtype, p, chunks, residual):
        _raw_reduce(pipe, src, p, codec, scale, out)
        return

    def send(j):
        buf, sizes = pipe.encode_pieces(src, p, j, codec, residual)
        a, b = p.piece(me, j)
        return pipe.all_to_all(buf, sizes, codec.wire_bytes(b - a), p.world)

    def reduce(j, state):
        work, recv = state
        pipe.wait(work)
        a, b = p.piece(me, j)
        pipe.decode_sum_to(recv, p.world, codec, b - a, scale, out[a - base:b - base])

    pipe.run(chunks, send, reduce, None)


def _raw_reduce(pipe: Pipeline, src: torch.Tensor, p: Plan, codec: Codec, scale: float, dst: torch.Tensor) -> None:
    """Zero-copy one-hop reduce: ``src`` itself is the all-to-all's send buffer (its shards are
    the raw payloads, in destination order) and the received rows are summed in source-rank
    order into ``dst`` (this rank's shard)."""
    sizes = [p.bounds[d + 1] - p.bounds[d] for d in range(p.world)]
    mine = sizes[p.rank]
    work, recv = pipe.all_to_all(src, sizes, mine, p.world)
    pipe.wait(work)
    pipe.decode_sum_to(recv.view(torch.uint8).view(p.world, -1), p.world, codec, mine, scale, dst)


def _ordered_all_reduce(pipe: Pipeline, flat: torch.Tensor, p: Plan, chunks: int, c: Codec, scale: float,
                        residual: Optional[ErrorFeedback]) -> None:
    client = residual.client if residual is not None else None
    server = residual.server if residual is not None and not c.lossless else None
    if residual is not None and c.lossless:
        # Nothing re-encodes the reduced shard, so a server residual left by an earlier lossy call
        # (codec="auto" switching to fp32, one rank) would never be sent: fold it into the client
        # residual (the next step adds scale * client), which this encode sends and zeroes.
        residual.client.add_(residual.server, alpha=1.0 / scale)
        residual.server.zero_()
    # bf16/fp16 data: the output rounds the fp32 sum; what that drops is kept, in the server
    # residual of the shard's owner (the next step adds it once), as a lossy codec keeps its error.
    keeps_rounding = residual is not None and c.lossless and flat.dtype != torch.float32
    on_cpu = p2p.used_for(flat)
    if zero_copy(c, flat.dtype, p, chunks, client, gathers=True, on_cpu=on_cpu):
        if on_cpu:
            _raw_all_reduce_p2p(pipe, flat, p, c, scale, chunks)
        else:
            _raw_all_reduce(pipe, flat, p, c, scale)
        return

    kept = residual.server if keeps_rounding and residual is not None else None
    _Ordered(pipe, flat, p, c, scale, (client, server, kept), on_cpu).run(chunks)


class _Ordered:
    """The staged ordered all-reduce of :func:`_ordered_all_reduce`, a method per pipeline phase
    of a chunk: :meth:`send` (encode, all-to-all), :meth:`reduce` (decode-sum-re-encode this
    rank's piece, all-gather it), :meth:`finish` (decode every rank's piece into ``flat``).
    ``residuals``: (client, server, where the bf16/fp16 rounding is kept), each or None."""

    def __init__(self, pipe: Pipeline, flat: torch.Tensor, p: Plan, c: Codec, scale: float,
                 residuals: Tuple[Optional[torch.Tensor], ...], on_cpu: bool) -> None:
        self.pipe, self.flat, self.p, self.c, self.scale, self.on_cpu = pipe, flat, p, c, scale, on_cpu
        self.client, self.server, self.kept = residuals

    def run(self, chunks: int) -> None:
        self.pipe.run(chunks, self.send, self.reduce, self.finish)

    def send(self, j: int):
        p, c = self.p, self.c
        buf, sizes = self.pipe.encode_pieces(self.flat, p, j, c, self.client)
        a, b = p.piece(p.rank, j)
        return self.pipe.all_to_all(buf, sizes, c.wire_bytes(b - a), p.world)

    def reduce(self, j: int, state):
        work, recv = state
        pipe, p, c, flat = self.pipe, self.p, self.c, self.flat
        pipe.wait(work)
        a, b = p.piece(p.rank, j)
        rows = recv.view(p.world, -1)
        # Every rank sends a payload as large as the largest shard's for this chunk (padding),
        # because all_gather_into_tensor moves equal sizes.
        width = max(c.wire_bytes(y - x) for x, y in (p.piece(d, j) for d in range(p.world)))
        send_buf = pipe.empty(width, torch.uint8, flat.device)  # padding past nbytes is never read
        nbytes = c.wire_bytes(b - a)
        r = self.server[a:b] if self.server is not None else None

        pipe.timed("decode_s", lambda: reencode_sum(rows, c, b - a, scale=self.scale, residual=r, out=send_buf[:nbytes]))
        if self.kept is not None:  # (the fp32 payload is the sum itself)
            rounding_into(send_buf[:nbytes].view(torch.float32), flat.dtype, self.kept[a:b])
        if not self.on_cpu:
            return pipe.all_gather(send_buf, p.world)
        # CPU: each piece at its own size, as the zero-copy path of a peer sends it
        recv = pipe.empty(p.world * width, torch.uint8, flat.device)
        rows_out = recv.view(p.world, width)
        sizes = [c.wire_bytes(y - x) for x, y in (p.piece(d, j) for d in range(p.world))]
        outs = [rows_out[d, :sizes[d]] for d in range(p.world)]
        outs[p.rank].copy_(send_buf[:nbytes])
        return pipe.gather_pieces(send_buf[:nbytes], outs), recv

    def finish(self, j: int, state) -> None:
        work, recv = state
        self.pipe.wait(work)
        rows = recv.view(self.p.world, -1)

        def dec():
            for d in range(self.p.world):
                a, b = self.p.piece(d, j)
                if b > a:
                    decode(rows[d, :self.c.wire_bytes(b - a)], self.c, b - a, out=self.flat[a:b])

        self.pipe.timed("decode_s", dec)


def runs_natively(group, a: args.Call, mode: str) -> bool:
    """Whether an all-reduce takes the native op of :func:`_raw_all_reduce_p2p` (which may run
    before the call's check: :mod:`flatcomm.comm.agreed`): ordered, or exact mode (whose pieces
    :mod:`flatcomm.comm.exact` sends on the same transfers)."""
    flat = a.src  # (the tests of _ordered_all_reduce's zero-copy branch, then of _native_name)
    return (mode in ("ordered", "exact") and a.feedback is None and p2p.used_for(flat) and a.plan is not None
            and zero_copy(a.codec, flat.dtype, a.plan, a.chunks, None, gathers=True, on_cpu=True)
            and _native_name(group, flat) is not None)


def _native_name(group, flat: torch.Tensor):
    return p2p.native_name(group) if flat.dtype == torch.float32 else None


def _raw_all_reduce_p2p(pipe: Pipeline, flat: torch.Tensor, p: Plan, c: Codec, scale: float, chunks: int,
                        grid: Tuple[int, int] = (0, 0)) -> None:
    """Lossless all-reduce on point-to-point transfers (CPU), chunk by chunk, without staging:
    each destination's piece of ``flat`` is sent as it is, the sum lands in this rank's own
    piece (its values were copied into the receive rows when the exchange was posted) and the
    peers' pieces gather in place. fp32 on a group in torch's registry: the same transfers and
    sum in one native op, without the GIL (csrc/comm/p2p_all_reduce.cpp); on an agreed plan it
    runs before the call's check (``pipe.early``: :mod:`flatcomm.comm.agreed`). ``grid``: exact
    mode's (block, headroom), whose sum only the native op makes here; (0, 0): ordered."""
    me, world = p.rank, p.world
    name = _native_name(pipe.group, flat)
    if name is not None:
        shard = p.bounds[me + 1] - p.bounds[me]
        scratch = pipe.empty((world - 1) * shard, torch.float32, flat.device)
        pieces = [p.bounds[d] + x for d in range(world) for x in p.chunk_bounds[d]]
        pipe.stats.wire_bytes += (flat.numel() - shard + shard * (world - 1)) * flat.element_size()
        if not pipe.early:  # (an early call's header is checked when the pipeline is released)
            pipe.checked()
        pipe.timed("exchange_s", lambda: ops.p2p_sum_all_reduce_(flat, scratch, name, pieces, chunks, scale, pipe.tags,
                                                                 *grid), "flatcomm.comm.p2p_all_reduce")
        return

    assert not pipe.early, "an early call runs natively (its row told the peers so)"
    assert grid == (0, 0), "exact mode's native route needs the native op"

    def send(j):
        a, b = p.piece(me, j)
        return pipe.all_to_all_pieces([flat[slice(*p.piece(d, j))] for d in range(world)], b - a, world)

    def reduce(j, state):
        work, recv = state
        pipe.wait(work)
        a, b = p.piece(me, j)
        pipe.decode_sum_to(recv.view(torch.uint8).view(world, -1), world, c, b - a, scale, flat[a:b])
        return pipe.gather_pieces(flat[a:b], [flat[slice(*p.piece(d, j))] for d in range(world)])

    pipe.run(chunks, send, reduce, lambda j, work: pipe.wait(work))


def _raw_all_reduce(pipe: Pipeline, flat: torch.Tensor, p: Plan, c: Codec, scale: float) -> None:
    """Lossless all-reduce without staging copies: the one-hop reduce reads ``flat`` directly,
    sums into the all-gather's send buffer, and the gather lands in ``flat`` (only the pieces past
    a shorter shard's end go through scratch)."""
    me, world = p.rank, p.world
    sizes = [p.bounds[d + 1] - p.bounds[d] for d in range(world)]
    width = max(sizes)
    send_buf = pipe.empty(width, flat.dtype, flat.device)  # padding past this shard is never read
    _raw_reduce(pipe, flat, p, c, scale, send_buf[:sizes[me]])
    # The all-to-all has completed, so flat may be overwritten: gather straight into it, in pieces
    # (gloo's all-gather slows down on large single calls: docs/benchmarks.md, Collectives).
    # zero_copy keeps it to one piece, and one gather even of nothing: the staged path of a peer
    # holding a residual makes exactly that exchange.
    pipe.stats.wire_bytes += width * flat.element_size() * (world - 1)
    step = max(1, pipeline.GATHER_PIECE_BYTES // (world * flat.element_size()))
    for off in range(0, max(width, 1), step):
        m = min(step, width - off)
        outs, tails = [], []
        for d in range(world):
            a = p.bounds[d] + off
            keep = max(0, min(m, sizes[d] - off))
            if keep == m:
                outs.append(flat[a:a + m])
            else:  # this rank's shard ends inside the piece: land in scratch, keep its prefix
                scratch = pipe.empty(m, flat.dtype, flat.device)
                outs.append(scratch)
                tails.append((flat[a:a + keep], scratch[:keep]))
        if not groups.exchanges(pipe.group):
            outs[0].copy_(send_buf[off:off + m])
        else:
            pipe.wait(dist.all_gather(outs, send_buf[off:off + m], group=pipe.group, async_op=True))
        for dst, src in tails:
            dst.copy_(src)

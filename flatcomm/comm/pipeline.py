"""The pipeline that runs a collective's layout (:mod:`flatcomm.comm.layout`) chunk by chunk: while
chunk j is exchanged, chunk j-1 is decoded. Staging buffers come from a pool per group."""
from __future__ import annotations

import time
from typing import Callable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from . import agreed, context, groups, header, p2p, standalone
from .labels import label
from .layout import CommStats, Plan, sends_raw
from .p2p import drain
from .shards import shard_bounds
from ..ops.codecs import Codec, decode_sum, encode

__all__ = ["GATHER_PIECE_BYTES", "BufferPool", "Pipeline", "forget_pool", "shard_bounds", "zero_copy"]

GATHER_PIECE_BYTES = 8 << 20


def zero_copy(codec: Codec, dtype: torch.dtype, p: Plan, chunks: int, residual, gathers: bool = False,
              on_cpu: bool = False) -> bool:
    """Send and receive without staging: one chunk, raw payload, no error feedback (a residual
    would change what is sent), and every piece a whole payload (16-byte multiple), so the
    received rows are valid payload rows for the fused decode-sum.

    Whether a rank holds a residual may differ between ranks (a checkpoint restores only nonzero
    ones), so both paths must make the same exchanges with the same sizes: one all-to-all and, for
    an all-reduce (``gathers``), one all-gather of the widest shard, which the zero-copy path does
    only while that gather fits one piece of :data:`GATHER_PIECE_BYTES`. ``on_cpu`` (an all-reduce
    on point-to-point transfers, :mod:`flatcomm.comm.p2p`): any size and chunk count, every piece
    sent and gathered at its own size, on the staged path too."""
    if residual is not None or not sends_raw(codec, dtype, "ordered"):
        return False
    if gathers and on_cpu:  # any chunk count: every piece goes as it is, point to point
        return all((b - a) * dtype.itemsize % 16 == 0
                   for d in range(p.world) for a, b in (p.piece(d, j) for j in range(chunks)))
    if chunks != 1:
        return False
    sizes = [p.bounds[d + 1] - p.bounds[d] for d in range(p.world)]
    if gathers and max(sizes) * dtype.itemsize * p.world > GATHER_PIECE_BYTES:
        return False
    return all(n * dtype.itemsize % 16 == 0 for n in sizes)


class BufferPool:
    """Staging buffers reused across calls of one group. Fresh large allocations are page-faulted
    on first touch, which on CPU costs as much as the copy itself; collectives of a group run one
    at a time on its worker thread, so a buffer taken by a call is free again when the call ends.
    CUDA: the call's kernels may still be queued then, but every call of the group runs on the
    same side stream (after waiting for its NCCL work), so a later user of the buffer is ordered
    after them (see flatcomm/comm/streams.py)."""

    MAX_BYTES = 1 << 31

    def __init__(self):
        self.free: dict = {}
        self.bytes = 0

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        key = (numel, dtype, str(device))
        stack = self.free.get(key)
        if stack:
            t = stack.pop()
            self.bytes -= t.numel() * t.element_size()
            return t
        return torch.empty(numel, dtype=dtype, device=device)

    def give(self, t: torch.Tensor) -> None:
        size = t.numel() * t.element_size()
        if self.bytes + size > self.MAX_BYTES:
            self.free.clear()
            self.bytes = 0
        self.free.setdefault((t.numel(), t.dtype, str(t.device)), []).append(t)
        self.bytes += size


_LABELS = {"encode_s": "flatcomm.comm.encode", "exchange_s": "flatcomm.comm.exchange",
           "decode_s": "flatcomm.comm.decode_sum"}
_POOL = "staging buffers"  # the context slot of a group's BufferPool


def forget_pool(group) -> None:
    """Drop the staging buffers of ``group`` (the tuner's timing runs leave large ones behind)."""
    ctx = context.existing(group)
    if ctx is not None:
        ctx.pop(_POOL)


class Pipeline:
    """Runs one collective chunk by chunk: while chunk j is exchanged, j-1 is decoded.

    A call on an agreed plan (:mod:`flatcomm.comm.agreed`) tags its transfers with the plan;
    ``early``: the call may then run without waiting for its check (``self.early``), which
    happens when the pipeline is released."""

    def __init__(self, group, stats: Optional[CommStats], fields: Sequence[Tuple[str, int]],
                 device: torch.device, validate: bool = True, early: bool = False):
        self.group = group
        self.stats = stats if stats is not None else CommStats()
        self.pool = context.of(group).slot(_POOL, BufferPool)
        self.taken: List[torch.Tensor] = []
        self.header: Optional[header.CallHeader] = None
        may_agree = agreed.capable(fields)
        self.plan = agreed.plan_id(group, fields) if may_agree else 0
        self.tags = agreed.tag_base(self.plan)  # of this call's point-to-point exchanges (flatcomm.comm.p2p)
        self.early = False  # whether it runs before its check
        if groups.exchanges(group):
            where = header.header_device(group, device, validate)
            if where is not None:
                self.early = early and self.plan > 0 and where.type == "cpu"
                self.header = header.CallHeader(group, fields, where, agree=may_agree,
                                                early=self.plan if self.early else 0)
                if self.early:
                    self.header.settle_on_arrival()

    def __enter__(self) -> "Pipeline":
        return self

    def __exit__(self, kind, err, tb) -> None:
        """``with Pipeline(...) as pipe``: release on success; after a failure, settle the header
        exchange if it is still in flight (nothing pending when the group is torn down)."""
        if kind is None:
            self.release()
        elif self.header is not None:
            self.header.abandoned()
            self.header = None

    def checked(self) -> None:
        """Wait for the call's header exchange and check it: before any payload byte is sent (an
        early call: after its transfers)."""
        if self.header is not None:
            h, self.header = self.header, None
            self.timed("exchange_s", h.finish, "flatcomm.comm.verify")

    def empty(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        t = self.pool.take(numel, dtype, device)
        self.taken.append(t)
        return t

    def release(self) -> None:
        """Return this call's buffers to the pool (the call's collectives have all completed)."""
        self.checked()  # a call that exchanged nothing (zero values) still checks its header
        for t in self.taken:
            self.pool.give(t)
        self.taken = []

    def timed(self, field: str, fn: Callable[[], object], name: Optional[str] = None):
        """``fn()``, its time added to ``stats.<field>``, under the profiler label of the phase."""
        t0 = time.perf_counter()
        with label(name or _LABELS[field]):
            out = fn()
        setattr(self.stats, field, getattr(self.stats, field) + time.perf_counter() - t0)
        return out

    def wait(self, work) -> None:
        if work is not None:
            self.timed("exchange_s", work.wait)

    def next_tag(self) -> int:
        self.tags += 1
        return self.tags

    def all_to_all(self, send: torch.Tensor, send_sizes: List[int], recv_row: int, world: int):
        if p2p.used_for(send) and groups.exchanges(self.group):
            return self.all_to_all_pieces(list(torch.split(send, send_sizes)), recv_row, world)
        self.checked()
        recv = self.empty(world * recv_row, send.dtype, send.device)
        self.stats.wire_bytes += (send.numel() - send_sizes[standalone.rank(self.group)]) * send.element_size()
        if not groups.exchanges(self.group):
            recv.copy_(send)
            return None, recv
        work = dist.all_to_all_single(recv, send, [recv_row] * world, send_sizes, group=self.group,
                                      async_op=True)
        return work, recv

    def all_to_all_pieces(self, pieces: List[torch.Tensor], recv_row: int, world: int):
        """:meth:`all_to_all` of ``pieces[d]`` to rank d: sent as they are on CPU, else staged."""
        if p2p.used_for(pieces[0]) and groups.exchanges(self.group):
            self.checked()
            recv = self.empty(world * recv_row, pieces[0].dtype, pieces[0].device)
            me = standalone.rank(self.group)
            self.stats.wire_bytes += sum(t.numel() for d, t in enumerate(pieces) if d != me) * pieces[0].element_size()
            return p2p.all_to_all(self.group, pieces, recv, recv_row, self.next_tag()), recv
        buf = self.timed("encode_s", lambda: torch.cat(pieces))
        return self.all_to_all(buf, [t.numel() for t in pieces], recv_row, world)

    def all_gather(self, send: torch.Tensor, world: int):
        self.checked()
        recv = self.empty(world * send.numel(), send.dtype, send.device)
        if not groups.exchanges(self.group):
            recv.copy_(send)
            return None, recv
        if p2p.used_for(send):
            n, me = send.numel(), standalone.rank(self.group)
            outs = [recv[r * n:(r + 1) * n] for r in range(world)]
            outs[me].copy_(send)
            return self.gather_pieces(send, outs), recv
        self.stats.wire_bytes += send.numel() * send.element_size() * (world - 1)
        return header.all_gather_single(recv, send, group=self.group, async_op=True), recv

    def gather_pieces(self, send: torch.Tensor, outs: Sequence[Optional[torch.Tensor]]) -> p2p.Exchange:
        """Point-to-point (CPU) all-gather with a size per rank, posted: ``send`` (this rank's
        piece) to every other rank, rank r's piece into ``outs[r]`` (``outs[me]`` is not read).
        Both ends take the sizes from the call's plan."""
        self.checked()
        self.stats.wire_bytes += send.numel() * send.element_size() * (len(outs) - 1)
        return p2p.all_gather(self.group, send, outs, self.next_tag())

    def run(self, chunks: int, send: Callable, reduce: Callable, finish: Optional[Callable]) -> None:
        """send(j) -> state; reduce(j, state) -> state2; finish(j, state2). Stages overlap.

        CUDA: send(j + 1) enqueues the exchange of chunk j + 1 on NCCL's stream before reduce(j)
        makes the side stream wait for exchange j and enqueues its decode, so the GPU runs the
        exchange of j + 1 (NCCL stream) while it decodes j (side stream), with no host wait."""
        sent: dict = {}
        reduced: dict = {}
        try:
            if chunks:
                sent[0] = send(0)
            for j in range(chunks):
                if j + 1 < chunks:
                    sent[j + 1] = send(j + 1)
                reduced[j] = reduce(j, sent.pop(j))
                if finish is not None and j >= 1:
                    finish(j - 1, reduced.pop(j - 1))
            if finish is not None and chunks:
                finish(chunks - 1, reduced.pop(chunks - 1))
        except BaseException:
            drain(list(sent.values()) + list(reduced.values()))
            raise

    def encode_pieces(self, src: torch.Tensor, p: Plan, j: int, codec: Codec,
                      residual: Optional[torch.Tensor]) -> Tuple[torch.Tensor, List[int]]:
        """Chunk j of every destination's shard of ``src``, encoded into one send buffer."""
        if residual is not None:  # encoding updates the residual: never for a call that then fails its check
            self.checked()
        sizes = [codec.wire_bytes(b - a) for a, b in (p.piece(d, j) for d in range(p.world))]
        buf = self.empty(sum(sizes), torch.uint8, src.device)

        def enc():
            off = 0
            for d in range(p.world):
                a, b = p.piece(d, j)
                r = residual[a:b] if residual is not None else None
                encode(src[a:b], codec, residual=r, out=buf[off:off + sizes[d]])
                off += sizes[d]

        self.timed("encode_s", enc)
        return buf, sizes

    def decode_sum_to(self, recv: torch.Tensor, world: int, codec: Codec, n: int, scale: float,
                      dst: torch.Tensor) -> None:
        """The received rows decoded and summed in source-rank order into ``dst`` (any dtype)."""
        def dec():
            if dst.dtype == torch.float32:
                decode_sum(recv.view(world, -1), codec, n, scale=scale, out=dst)
            else:
                dst.copy_(decode_sum(recv.view(world, -1), codec, n, scale=scale))

        self.timed("decode_s", dec)

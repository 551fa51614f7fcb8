"""``mode="exact"`` on one hop: per-block exponents agreed with a MAX all-reduce, the values sent as
they are, and the receiving rank turns every row into int64 fixed point on those exponents and sums
integers (associative): the result does not depend on the order or grouping of contributions. (The
conversion happens at the receiver so that the wire carries 4 bytes per fp32 value, not the 8 of the
integers; same integers, same bits.)"""
from __future__ import annotations

import math
from typing import List

import torch
import torch.distributed as dist

from . import groups
from .pipeline import Pipeline, Plan
from ..ops.sums import exact_exponents, from_exact, to_exact

__all__ = ["all_reduce", "reduce_scatter"]


def _agreed_exponents(pipe: Pipeline, src: torch.Tensor, p: Plan, block: int) -> List[torch.Tensor]:
    """Per shard, per-block exponents agreed by every rank (MAX all-reduce)."""
    parts = [exact_exponents(src[p.bounds[d]:p.bounds[d + 1]], block) for d in range(p.world)]
    sizes = [t.numel() for t in parts]
    allp = torch.cat(parts) if parts else torch.empty(0, dtype=torch.int32)
    pipe.checked()
    if groups.exchanges(pipe.group) and allp.numel():
        pipe.timed("exchange_s", lambda: dist.all_reduce(allp, dist.ReduceOp.MAX, group=pipe.group))
    return list(torch.split(allp, sizes))


def _write(dst: torch.Tensor, value: torch.Tensor) -> None:
    if dst.data_ptr() != value.data_ptr():
        dst.copy_(value)


def reduce_scatter(pipe: Pipeline, src: torch.Tensor, out: torch.Tensor, p: Plan, chunks: int,
                   scale: float, block: int, headroom: int) -> None:
    if p.world > (1 << headroom):
        raise ValueError(f"flatcomm: exact mode with headroom {headroom} supports up to "
                         f"{1 << headroom} ranks, got {p.world}")
    me = p.rank
    base = p.bounds[me]
    exps = _agreed_exponents(pipe, src, p, block)

    def chunk_exps(d, j):
        cb = p.chunk_bounds[d]
        return exps[d][cb[j] // block: math.ceil(cb[j + 1] / block)]

    def send(j):
        def stage():
            pieces = [src[slice(*p.piece(d, j))] for d in range(p.world)]
            return torch.cat(pieces), [t.numel() for t in pieces]

        buf, sizes = pipe.timed("encode_s", stage)
        a, b = p.piece(me, j)
        return pipe.all_to_all(buf, sizes, b - a, p.world)

    def reduce(j, state):
        work, recv = state
        pipe.wait(work)
        a, b = p.piece(me, j)

        def dec():
            # Every sender's values on the agreed exponents, as integers (the integers the sender
            # would have made: same values, same exponents); integer addition is associative, so
            # any order gives the same sum.
            e = chunk_exps(me, j).contiguous()
            rows = recv.view(p.world, b - a)
            acc = to_exact(rows[0], e, block, headroom)
            for r in range(1, p.world):
                acc += to_exact(rows[r], e, block, headroom)
            val = from_exact(acc, e, block, headroom)
            if scale != 1.0:
                val = val * scale
            _write(out[a - base:b - base], val)

        pipe.timed("decode_s", dec)

    pipe.run(chunks, send, reduce, None)


def all_reduce(pipe: Pipeline, flat: torch.Tensor, p: Plan, chunks: int, scale: float,
               block: int, headroom: int) -> None:
    me, world = p.rank, p.world
    # The reduced shards are already final and identical everywhere: reduce straight into the
    # all-gather's send buffer (padded to the widest shard; padding is never read) and gather fp32.
    width = max(p.bounds[d + 1] - p.bounds[d] for d in range(world))
    send_buf = pipe.empty(width, torch.float32, flat.device)
    shard = send_buf[:p.bounds[me + 1] - p.bounds[me]]
    reduce_scatter(pipe, flat, shard, p, chunks, scale, block, headroom)
    work, recv = pipe.all_gather(send_buf, world)
    pipe.wait(work)
    rows = recv.view(world, width)
    for d in range(world):
        a, b = p.bounds[d], p.bounds[d + 1]
        flat[a:b].copy_(rows[d, :b - a])

"""``mode="exact"`` on one hop: the values are sent as they are (4 bytes per fp32 value, not the 8
of the integers) and the receiving rank sums each piece in int64 fixed point (associative), so the
result does not depend on the order or grouping of contributions.

The receiver holds every rank's values of its piece, and pieces are whole exact blocks (shard and
chunk bounds are multiples of the block), so the per-block exponent it takes, the max over the
received rows, is the one every rank would agree on with a MAX all-reduce of its own exponents
(what the two-level path does, :mod:`flatcomm.comm.two_level`): the same integers, the same bits,
in one fused pass (:func:`flatcomm.ops.sums.exact_sum`) and without that extra exchange."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from . import p2p
from .layout import Plan
from ..ops.sums import exact_sum

if TYPE_CHECKING:  # (the one-hop collectives hand their pipeline in: this module runs on it, below it)
    from .pipeline import Pipeline

__all__ = ["all_reduce", "reduce_scatter"]


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

    def send(j):
        a, b = p.piece(me, j)
        return pipe.all_to_all_pieces([src[slice(*p.piece(d, j))] for d in range(p.world)], b - a, p.world)

    def reduce(j, state):
        work, recv = state
        pipe.wait(work)
        a, b = p.piece(me, j)

        def dec():
            val = exact_sum(recv.view(p.world, b - a), block, headroom)
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
    # On CPU (fp32) that buffer is this rank's own shard of ``flat`` (each chunk's own piece is
    # copied into the receive rows when its exchange is posted) and the shards gather in place,
    # each at its own size.
    shards = [flat[p.bounds[d]:p.bounds[d + 1]] for d in range(world)]
    if p2p.used_for(flat) and flat.dtype == torch.float32:
        reduce_scatter(pipe, flat, shards[me], p, chunks, scale, block, headroom)
        pipe.wait(pipe.gather_pieces(shards[me], shards))
        return
    width = max(t.numel() for t in shards)
    send_buf = pipe.empty(width, torch.float32, flat.device)
    reduce_scatter(pipe, flat, send_buf[:shards[me].numel()], p, chunks, scale, block, headroom)
    work, recv = pipe.all_gather(send_buf, world)
    pipe.wait(work)
    rows = recv.view(world, width)
    for d in range(world):
        shards[d].copy_(rows[d, :shards[d].numel()])

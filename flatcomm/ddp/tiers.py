"""The DDP hook's residuals when a :class:`flatcomm.Topology` makes the all-reduce hierarchical.

The hook keeps one full-size :class:`~flatcomm.collectives.ErrorFeedback` per bucket either way
(keyed by parameter, see :mod:`flatcomm.ddp`). Hierarchical, only this rank's intra-node shard
(:func:`flatcomm.hierarchical.shard_range`) is used: there it holds the inter-node tier's client and
server residuals, zeros elsewhere. What they are worth differs from the flat path: the inter tier
sums node partials and the average's scale is applied after it, so the next step adds
``T = scale * sum_r (client_r + server_r)`` (flat: ``scale * sum_r client_r + sum_r server_r``).

A parameter whose bucket changes (DDP's rebuild) or that comes from a checkpoint cannot be placed
in the new shard layout locally (it would need the other ranks' residuals), so its residual goes
to the bucket's ``carry`` and is added once to the next gradient: the (lossless) node tier sums
it over the ranks, so the average gains ``scale * sum_r carry_r = T``, and the inter tier's error
feedback keeps what the codec does not send.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from .. import collectives as C
from ..comm import two_level as H
from ..comm.topology import Topology

__all__ = [
    "add_carry", "all_reduce", "carry_slice", "fold", "new_carry", "nonzero_or_none", "resolve_topology",
    "submit", "total"
]


def resolve_topology(arg, group) -> Topology:
    """The hook's topology: ``None`` -> from the environment (torchrun), ``"flat"``, or a Topology
    spanning the hook's group."""
    if arg is None:
        return Topology.from_env(group=group)
    if isinstance(arg, str) and arg == "flat":
        return Topology(1, group=group)
    if not isinstance(arg, Topology):
        raise TypeError(f"flatcomm: topology must be a flatcomm.Topology, 'flat' or None, got {arg!r}")
    if arg.world != dist.get_world_size(group):
        raise ValueError(f"flatcomm: the topology spans {arg.world} ranks but the DDP group has "
                         f"{dist.get_world_size(group)}")
    return arg


def new_carry(numel: int, device) -> torch.Tensor:
    return torch.zeros(numel, device=device)


def carry_slice(carry: torch.Tensor, off: int, ln: int) -> torch.Tensor:
    return carry[off:off + ln]


def nonzero_or_none(carry: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """Keep a carry only if something was brought in (it costs a pass over the bucket once)."""
    return carry if carry is not None and bool(carry.any()) else None


def fold(buf, off: int, ln: int, scale: float, tiered: bool, out: torch.Tensor) -> None:
    """What a parameter's residual contributes per rank once moved to another layout: the client
    plus the server residual in client units (flat: server / scale; hierarchical: server), plus
    any carry not yet sent."""
    client, server = buf.ef.client[off:off + ln], buf.ef.server[off:off + ln]
    torch.add(client, server, alpha=1.0 if tiered else 1.0 / scale, out=out)
    if buf.carry is not None:
        out.add_(buf.carry[off:off + ln])


def total(buf, off: int, ln: int, scale: float, tiered: bool) -> torch.Tensor:
    """This rank's share of ``T`` for a parameter's range (summed over ranks by the checkpoint)."""
    client, server = buf.ef.client[off:off + ln], buf.ef.server[off:off + ln]
    if not tiered:
        return client * scale + server
    t = client + server
    if buf.carry is not None:
        t = t + buf.carry[off:off + ln]
    return t * scale


def submit(topology: Topology, fn, reads: torch.Tensor) -> None:
    H.submit(topology, fn, reads)


def add_carry(tensor: torch.Tensor, buf) -> None:
    """Residual brought in by a rebuild or a checkpoint: sent once, with this step's gradient."""
    if buf is not None and buf.carry is not None:
        tensor.view(-1).add_(buf.carry.to(tensor.dtype))
        buf.carry = None


def all_reduce(tensor: torch.Tensor, topology: Topology, codec, mode: str, buf, chunks, stats, kwargs):
    """The hook's hierarchical all-reduce (average, asynchronous) of one bucket."""
    residual = None
    if buf is not None:
        lo, hi = H.shard_range(tensor.numel(), topology, codec)
        residual = C.ErrorFeedback(buf.ef.client[lo:hi], buf.ef.server[lo:hi])
    return C.all_reduce(tensor, codec=codec, op="avg", mode=mode, topology=topology, residual=residual,
                        chunks=chunks, stats=stats, async_op=True, **kwargs)

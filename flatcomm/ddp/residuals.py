"""The DDP hook's error-feedback residuals, one flat buffer per bucket, owned by parameters.

Each distinct bucket (key = the tuple of ``id(p)`` of its parameters, in ``bucket.parameters()``
order, which is the buffer layout: :func:`bucket_layout` reads the offsets from the
``bucket.gradients()`` views and checks them) owns one :class:`Buf`: a flat
:class:`~flatcomm.collectives.ErrorFeedback` (client + server residual, fp32, bucket numel). The
:class:`flatcomm._training.residual_store.Store` remembers where each parameter's residual lives; when a new key
appears (DDP's rebuild, a ``keep_fp32`` split) its buffer is assembled once from the old ones,
parameter by parameter. The server residual is only valid for the shard layout it was made with,
so it is folded into the client residual on that copy: ``client += server / scale`` (what the next
step adds is unchanged, see :mod:`flatcomm.ddp`). Hierarchical: see :mod:`flatcomm.ddp.tiers`.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from .. import collectives as C
from . import tiers as _tiers
from .._training.residual_store import Store

__all__ = ["Buf", "Residuals", "bucket_layout"]

Key = Tuple[Any, ...]  # the id(p) of a bucket's parameters
NameOf = Callable[[Any], Optional[str]]


@dataclasses.dataclass
class Buf:
    ef: C.ErrorFeedback
    layout: List[Tuple[Any, int, int]]  # (id(p), offset, numel) in buffer order
    client_sq: Any = 0.0  # ||client||^2 after the last step, a float64 0-dim tensor once measured
    carry: Optional[torch.Tensor] = None  # hierarchical: residual brought in, added to the next gradient


def bucket_layout(bucket) -> List[Tuple[Any, int, int]]:
    """(id(p), offset, numel) of a DDP bucket's parameters, checked against its gradient views."""
    buf = bucket.buffer()
    out: List[Tuple[Any, int, int]] = []
    off = 0
    base = buf.data_ptr()
    esz = buf.element_size()
    for p, g in zip(bucket.parameters(), bucket.gradients()):
        n = p.numel()
        goff = (g.data_ptr() - base) // esz
        if g.numel() != n or goff != off:
            raise RuntimeError(f"flatcomm: DDP bucket layout is not the cumulative parameter order "
                               f"(parameter of {n} values at offset {goff}, expected {off})")
        out.append((id(p), off, n))
        off += n
    if off != buf.numel():
        raise RuntimeError(f"flatcomm: DDP bucket parameters hold {off} values, buffer {buf.numel()}")
    return out


class Residuals:
    """Per-bucket buffers, addressable per parameter (see the module docstring)."""

    def __init__(self, track_norms: bool) -> None:
        self.store: Store[Buf] = Store()
        self.track_norms = track_norms

    @property
    def bufs(self) -> Dict[Tuple[Any, ...], Buf]:
        return self.store.slots

    def buffer_for(self, key: Key, layout, n: int, dev: torch.device, *, scale: float, tiered: bool,
                   name_of: NameOf) -> Buf:
        """The bucket's buffer, assembled from its parameters' residuals the first time."""
        b = self.store.get(key)
        if b is not None:
            return b
        ef = C.ErrorFeedback.zeros(n, device=dev)
        carry = _tiers.new_carry(n, dev) if tiered else None

        def dst(off: int, ln: int) -> torch.Tensor:
            return _tiers.carry_slice(carry, off, ln) if carry is not None else ef.client[off:off + ln]

        def move(old: Buf, ooff: int, oln: int, off: int, ln: int) -> None:
            _tiers.fold(old, ooff, oln, scale, tiered, out=dst(off, ln))  # server folded in

        def load(t: torch.Tensor, name: str, off: int, ln: int) -> None:
            # a per-rank client residual (server folded in): the next step adds scale * sum_r of it
            dst(off, ln).copy_(t.reshape(-1).to(device=dev))

        b = self.store.place(key, Buf(ef, layout), move, load, name_of)
        b.client_sq = float(ef.client.square().sum()) if self.track_norms else 0.0
        b.carry = _tiers.nonzero_or_none(carry)
        return b

    def carries(self, params: Sequence[torch.Tensor], name_of: NameOf) -> bool:
        """Whether a parameter of this bucket still has a residual (from a lossy bucket or a checkpoint)."""
        pids = [id(p) for p in params]
        return self.store.holds(pids, [name_of(pid) for pid in pids] if self.store.pending else ())

    def flush_into_lossless(self, key: Key, layout, n: int, dev: torch.device, *, scale: float,
                            tiered: bool, name_of: NameOf) -> Buf:
        """A lossless codec for a bucket whose parameters carry residuals: assemble them once
        (server folded into client, so the buffer holds ``T / scale`` per rank) and forget them.
        The fp32 encode adds the client residual to the gradient and zeroes it, so the averaged
        result gains ``scale * sum_r client_r = T``: nothing is lost, nothing is kept."""
        b = self.buffer_for(key, layout, n, dev, scale=scale, tiered=tiered, name_of=name_of)
        self.store.forget(key)
        b.ef.client.add_(b.ef.server, alpha=1.0 / scale)  # a fresh buffer's server is zero
        b.ef.server.zero_()
        return b

    def rescale(self, f: float) -> None:
        """Multiply every residual by ``f`` (the GradScaler's scale changed)."""
        for b in self.store.slots.values():
            b.ef.client.mul_(f)
            b.ef.server.mul_(f)
            b.client_sq = b.client_sq * (f * f)  # rebind: the old tensor is in a stats record

    def of(self, name: str, p: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """(client, server) of one parameter on this rank, fp32 views or fresh zeros."""
        loc = self.store.locate(id(p))
        if loc is not None:
            b, off, ln = loc
            return b.ef.client[off:off + ln], b.ef.server[off:off + ln]
        z = torch.zeros(p.numel(), dtype=torch.float32, device=p.device)
        pending = self.store.pending
        return (pending[name].to(p.device) if name in pending else z), z

    def bucket_names(self, names: Dict[int, str]) -> List[List[str]]:
        return [[names[pid] for pid, _, _ in b.layout] for b in self.store.slots.values()]

    def restore(self, params: Dict[str, torch.nn.Parameter], client: Dict[str, torch.Tensor],
                server: Dict[str, torch.Tensor], buckets: Any, world: int, tiered: bool) -> List[Key]:
        """Load checked residuals: the saved buckets as they were (returned, for the first step's
        replay), every other parameter's residual pending until its bucket forms."""
        # ``buckets`` was checked by the loader (each name once, each with residuals): nothing
        # below raises, so the store is never left half restored.
        self.store.clear()
        placed: set = set()
        for names in buckets:
            placed.update(names)
            ps = [params[n] for n in names]
            key = tuple(id(p) for p in ps)
            c = torch.cat([client[n].reshape(-1) for n in names]).to(ps[0].device)
            s = torch.cat([server[n].reshape(-1) for n in names]).to(ps[0].device)
            layout, off = [], 0
            for p in ps:
                layout.append((id(p), off, p.numel()))
                off += p.numel()
            self.store.adopt(key, Buf(C.ErrorFeedback(c, s), layout,
                                      float(c.square().sum()) if self.track_norms else 0.0))
        for n, c in client.items():
            if n in placed:
                continue
            # Not in a buffer: fold the server residual into the client one (client + server / scale).
            # (hierarchical: the server residual is already in client units, see ddp_tiers)
            t = (c.reshape(-1) + server[n].reshape(-1) * (1 if tiered else world) if n in server
                 else c.reshape(-1).clone())
            if t.any():
                self.store.pending[n] = t
        return list(self.store.slots)

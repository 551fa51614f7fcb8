"""Which parameters form each fragment, and at which inner step each fragment syncs.

With ``H = sync_every`` inner steps per round and ``k`` fragments, fragment ``i`` starts its outer
all-reduce after inner step ``t`` (counted from 1) when ``t > 0`` and ``t = i * H / k (mod H)``:
fragment 1 first (at ``H / k``), fragment 0 last (at ``H``), one fragment every ``H / k`` steps.
With ``fragment_sync_delay = tau`` the all-reduce runs in the background during the next ``tau``
inner steps and its result is applied after step ``t + tau``; ``tau < H / k`` keeps at most one
fragment in flight. ``k = 1, tau = 0`` is plain DiLoCo: the whole model syncs every ``H`` steps.
Nothing here communicates.
"""
from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any, List, NamedTuple, Optional, Sequence, Tuple

import torch

__all__ = ["Piece", "Schedule", "local_tensor", "number", "split"]

Named = List[Tuple[str, torch.nn.Parameter]]


def _int(v: Any, what: str, lo: int) -> int:
    if isinstance(v, bool) or not isinstance(v, numbers.Integral) or int(v) < lo:
        raise ValueError(f"flatcomm.diloco: {what} must be an int >= {lo}, got {v!r}")
    return int(v)


def number(v: Any, what: str, lo: float, hi: float, hi_open: bool = False) -> float:
    if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v) or float(v) < lo \
            or float(v) > hi or (hi_open and float(v) == hi):
        raise ValueError(f"flatcomm.diloco: {what} must be a finite number in [{lo}, {hi}{')' if hi_open else ']'}, "
                         f"got {v!r}")
    return float(v)


@dataclasses.dataclass(frozen=True)
class Schedule:
    """The round: ``sync_every`` inner steps, ``fragments`` fragments, applied ``delay`` steps late."""

    sync_every: int
    fragments: int
    delay: int

    def __post_init__(self) -> None:
        h = _int(self.sync_every, "sync_every", 1)
        k = _int(self.fragments, "fragments", 1)
        tau = _int(self.delay, "fragment_sync_delay", 0)
        if h % k:
            raise ValueError(f"flatcomm.diloco: sync_every ({h}) must be a multiple of fragments ({k}): "
                             f"one fragment syncs every sync_every / fragments inner steps")
        if tau >= h // k:
            raise ValueError(f"flatcomm.diloco: fragment_sync_delay ({tau}) must be < sync_every / fragments "
                             f"({h // k}): a fragment's sync must be applied before the next one starts")

    @property
    def period(self) -> int:
        """Inner steps between two fragments' syncs."""
        return self.sync_every // self.fragments

    def starts(self, step: int) -> Optional[int]:
        """The fragment whose all-reduce starts after inner step ``step`` (from 1), or None."""
        if step <= 0 or step % self.period:
            return None
        return (step // self.period) % self.fragments

    def applies(self, step: int) -> Optional[int]:
        """The fragment whose synced weights are applied after inner step ``step``, or None."""
        return self.starts(step - self.delay)


def local_tensor(p: torch.Tensor) -> torch.Tensor:
    """This rank's values of a parameter: a DTensor's local shard (written in place), else itself."""
    local = getattr(p, "_local_tensor", None)  # torch.distributed.tensor.DTensor
    return local if isinstance(local, torch.Tensor) else p


class Piece(NamedTuple):
    """Values ``start:stop`` of parameter ``name`` (in flattened order) in one fragment."""
    name: str
    param: torch.nn.Parameter
    start: int
    stop: int

    @property
    def label(self) -> str:
        """The name, with the range when the fragment holds part of the parameter."""
        whole = self.start == 0 and self.stop == local_tensor(self.param).numel()
        return self.name if whole else f"{self.name}[{self.start}:{self.stop}]"


SNAP = 16  # a cut moves to a parameter boundary within 1/SNAP of a fragment's share


def split(named: Named, fragments: Any) -> List[List[Piece]]:
    """The fragments' parameter values: ``fragments`` an int k (k runs of equal numel of the model's
    values, in registration order: a cut falls inside a parameter unless a boundary is near) or a
    list of modules (each module's parameters, whole; every parameter of the model in exactly one).

    Equal runs, not whole parameters: a model of a few large matrices split at parameter
    boundaries gives fragments of very different sizes, and the largest one's transfer sets how
    long an inner step may wait (an MLP of 26.6M parameters split in 4: 10.6M, 4.6K, 10.6M, 5.3M)."""
    if not named:
        raise ValueError("flatcomm.diloco: the model has no parameters that require grad")
    if isinstance(fragments, (list, tuple)):
        return _by_modules(named, fragments)
    k = _int(fragments, "fragments", 1)
    sizes = [local_tensor(p).numel() for _, p in named]
    total = sum(sizes)
    if k > total:
        raise ValueError(f"flatcomm.diloco: fragments={k} but the model has only {total} values")
    edges = [0]
    for n in sizes:
        edges.append(edges[-1] + n)
    cuts = [0]
    for j in range(1, k):
        cut = (j * total) // k
        q = min(range(len(edges)), key=lambda e: abs(edges[e] - cut))  # the nearest parameter boundary
        owner = max(e for e in range(len(sizes)) if edges[e] <= cut)
        forced = edges[owner] != cut and not local_tensor(named[owner][1]).is_contiguous()  # no flat view to cut
        if (forced or abs(edges[q] - cut) * SNAP * k <= total) and cuts[-1] < edges[q] < total:
            cut = edges[q]
        elif forced:
            raise ValueError(f"flatcomm.diloco: fragments={k} would cut the non-contiguous parameter "
                             f"{named[owner][0]!r}; pass fewer fragments or a list of modules")
        if cut <= cuts[-1]:
            raise ValueError(f"flatcomm.diloco: fragments={k} leaves an empty fragment; pass fewer fragments")
        cuts.append(cut)
    cuts.append(total)
    out: List[List[Piece]] = []
    for lo, hi in zip(cuts, cuts[1:]):
        out.append([Piece(name, p, max(lo, a) - a, min(hi, b) - a)
                    for (name, p), a, b in zip(named, edges, edges[1:]) if a < hi and b > lo])
    return out


def _by_modules(named: Named, modules: Sequence[Any]) -> List[List[Piece]]:
    if not modules:
        raise ValueError("flatcomm.diloco: fragments is an empty list")
    owner = {id(p): n for n, p in named}
    out: List[List[Piece]] = []
    where: dict = {}
    for i, m in enumerate(modules):
        if not isinstance(m, torch.nn.Module):
            raise TypeError(f"flatcomm.diloco: fragments[{i}] must be a torch.nn.Module, got {type(m).__name__}")
        frag: List[Piece] = []
        for p in m.parameters():
            if id(p) not in owner:
                continue  # frozen (requires_grad=False): not synced
            if id(p) in where:
                raise ValueError(f"flatcomm.diloco: parameter {owner[id(p)]!r} is in fragments {where[id(p)]} "
                                 f"and {i}: a module (or parameter) may be in one fragment only")
            where[id(p)] = i
            frag.append(Piece(owner[id(p)], p, 0, local_tensor(p).numel()))
        if not frag:
            raise ValueError(f"flatcomm.diloco: fragments[{i}] holds no trainable parameter of the model")
        out.append(frag)
    left = [n for n, p in named if id(p) not in where]
    if left:
        raise ValueError(f"flatcomm.diloco: parameters in no fragment: {left[:5]}{' ...' if len(left) > 5 else ''} "
                         f"(every trainable parameter must be synced, or replicas drift apart)")
    return out

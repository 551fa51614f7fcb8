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
import numbers
from typing import Any, List, Optional, Sequence, Tuple

import torch

__all__ = ["Schedule", "split"]

Named = List[Tuple[str, torch.nn.Parameter]]


def _int(v: Any, what: str, lo: int) -> int:
    if isinstance(v, bool) or not isinstance(v, numbers.Integral) or int(v) < lo:
        raise ValueError(f"flatcomm.diloco: {what} must be an int >= {lo}, got {v!r}")
    return int(v)


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


def split(named: Named, fragments: Any) -> List[Named]:
    """The fragments' parameters: ``fragments`` an int k (k contiguous runs of the model's
    parameters, in registration order, of about equal numel) or a list of modules (each module's
    parameters; every parameter of the model in exactly one)."""
    if not named:
        raise ValueError("flatcomm.diloco: the model has no parameters that require grad")
    if isinstance(fragments, (list, tuple)):
        return _by_modules(named, fragments)
    k = _int(fragments, "fragments", 1)
    if k > len(named):
        raise ValueError(f"flatcomm.diloco: fragments={k} but the model has only {len(named)} parameters")
    total = sum(p.numel() for _, p in named)
    out: List[Named] = [[]]
    seen = 0
    for j, (name, p) in enumerate(named):
        # next fragment when this parameter's middle lies past the current one's share of the
        # numel, or when every later fragment needs one of the parameters left
        past = (seen + p.numel() / 2) * k > len(out) * total
        if out[-1] and len(out) < k and (past or len(named) - j <= k - len(out)):
            out.append([])
        out[-1].append((name, p))
        seen += p.numel()
    return out


def _by_modules(named: Named, modules: Sequence[Any]) -> List[Named]:
    if not modules:
        raise ValueError("flatcomm.diloco: fragments is an empty list")
    owner = {id(p): n for n, p in named}
    out: List[Named] = []
    where: dict = {}
    for i, m in enumerate(modules):
        if not isinstance(m, torch.nn.Module):
            raise TypeError(f"flatcomm.diloco: fragments[{i}] must be a torch.nn.Module, got {type(m).__name__}")
        frag: Named = []
        for p in m.parameters():
            if id(p) not in owner:
                continue  # frozen (requires_grad=False): not synced
            if id(p) in where:
                raise ValueError(f"flatcomm.diloco: parameter {owner[id(p)]!r} is in fragments {where[id(p)]} "
                                 f"and {i}: a module (or parameter) may be in one fragment only")
            where[id(p)] = i
            frag.append((owner[id(p)], p))
        if not frag:
            raise ValueError(f"flatcomm.diloco: fragments[{i}] holds no trainable parameter of the model")
        out.append(frag)
    left = [n for n, p in named if id(p) not in where]
    if left:
        raise ValueError(f"flatcomm.diloco: parameters in no fragment: {left[:5]}{' ...' if len(left) > 5 else ''} "
                         f"(every trainable parameter must be synced, or replicas drift apart)")
    return out

"""``DiLoCo(codec="auto")``: the densest outer-sync codec whose sync fits the link and the inner step.

Before the first sync every replica times its inner steps (steps 2 to H: the first is warm-up) and
the link (an all-gather of a small and of a larger probe over the outer group, best of 3 each);
the replicas take the maximum of each measurement (one all-reduce), so every replica computes the
same choice from the same numbers. The candidates, densest first: int4, then ``sparse`` keeping 512,
256, 128, 64 and 32 of every 4,096 values. Not fp32 or int8: int4 with error feedback ends within
0.01% of fp32 DiLoCo's loss per sync for 1/8 of its bytes, so at a fixed wall-clock it reached the
lowest held-out loss of every row at 10 and 100 Mbit/s (docs/diloco.md, "The user's number"), where
a rule taking the densest codec that fits took int8 at 100 Mbit/s (second) and, with a 5% budget,
``sparse`` at 10 Mbit/s (last but one). A fragment's sync costs ``latency +
bytes / bandwidth``, where ``bytes`` is what this rank sends for it: the codec's payload size
(:meth:`flatcomm.Codec.wire_bytes`) times ``2 (R - 1) / R`` for the two-stage sum, ``R - 1`` for the
gathered one (``mode="exact"``, and by default a sparse candidate on up to 4 replicas), R replicas.
The sync *fits* when

* with ``fragment_sync_delay`` = tau > 0 (the transfer overlaps tau inner steps): it takes at most
  ``headroom`` (0.8) of tau inner steps;
* without a delay (the training loop waits for it): all fragments' syncs together take at most
  ``overhead`` (0.25) of the H inner steps between two syncs (int4's ~9% at 10 Mbit/s paid for
  itself there against the sparse codec's ~2%).

The densest candidate that fits is taken; when none fits, the sparsest. The choice and its
measurements are recorded in the checkpoint (a resume keeps the codec) and in ``outer.stats``.

A sparse codec needs its own outer recipe: with DiLoCo's (outer lr 0.7, Nesterov 0.9, plain error
feedback) top-64 ended +32.6% over fp32 DiLoCo, with SparseLoCo's at outer lr 2.0 (no momentum, the
residual decayed by 0.95 per sync) +7.0% (docs/diloco.md, "Convergence against SparseLoCo"). So when
auto takes ``sparse`` its outer step runs :data:`SPARSE_RECIPE` in place of the configured outer lr,
momentum and error decay (``Auto(sparse_recipe=None)`` keeps the configured ones). The recipe follows
from the recorded choice, so a resume runs it too.
"""
from __future__ import annotations

import dataclasses
import math
import time
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import torch
import torch.distributed as dist

from ..comm.header import all_gather_single
from ..ops.codecs import Codec
from .schedule import number

__all__ = ["Auto", "CANDIDATES", "Choice", "DILOCO_RECIPE", "Recipe", "SPARSE_RECIPE", "choose", "default_recipe",
           "recipe_of", "sync_bytes"]

# (codec name, values kept per 4,096 or None), densest first.
CANDIDATES: Tuple[Tuple[str, Optional[int]], ...] = (
    ("int4", None), ("sparse", 512), ("sparse", 256), ("sparse", 128), ("sparse", 64), ("sparse", 32))
# What a checkpoint's choice may name: also what earlier releases chose (a resume keeps the codec).
RECORDED = (("fp32", None), ("int8", None)) + CANDIDATES
PLACEHOLDER = Codec("int4")  # lossy: the residuals' shapes of a flat sync, the same for every lossy candidate


@dataclasses.dataclass(frozen=True)
class Recipe:
    """An outer step's recipe: the outer SGD's lr and momentum, the error-feedback residual's decay."""

    outer_lr: float = 2.0
    outer_momentum: float = 0.0
    error_decay: float = 0.95

    def check(self) -> None:
        """Raise ValueError for a value out of range (the ranges of DiLoCo's own options)."""
        number(self.outer_lr, "Recipe outer_lr", 0.0, math.inf)
        number(self.outer_momentum, "Recipe outer_momentum", 0.0, 1.0, hi_open=True)
        number(self.error_decay, "Recipe error_decay", 0.0, 1.0)


# SparseLoCo's recipe (decayed error feedback in place of outer momentum) at the outer lr that ended
# lowest for the sparse rows of the frontier (docs/diloco.md).
SPARSE_RECIPE = Recipe()
# DiLoCo's own (outer lr 0.7, Nesterov momentum 0.9, plain error feedback).
DILOCO_RECIPE = Recipe(outer_lr=0.7, outer_momentum=0.9, error_decay=1.0)


def default_recipe(codec: Codec) -> Recipe:
    """The outer recipe DiLoCo runs for ``codec`` where none is given: SparseLoCo's for a chunked
    sparse codec (with DiLoCo's, top-64 ended +32.6% over fp32 DiLoCo, with this one +7.0%:
    docs/diloco.md, "Convergence against SparseLoCo"), DiLoCo's for the others."""
    return SPARSE_RECIPE if codec.chunked else DILOCO_RECIPE


@dataclasses.dataclass(frozen=True, repr=False)
class Auto:
    """``codec="auto"`` with its knobs; a measurement given here is used instead of measured
    (``step_s``: seconds per inner step, ``latency_s`` and ``bytes_per_s``: the link's);
    ``sparse_recipe``: the outer recipe run when a sparse codec is taken (None: the configured one)."""

    headroom: float = 0.8
    overhead: float = 0.25
    step_s: Optional[float] = None
    latency_s: Optional[float] = None
    bytes_per_s: Optional[float] = None
    sparse_recipe: Optional[Recipe] = SPARSE_RECIPE

    def __repr__(self) -> str:
        # The repr enters the checkpoint's fingerprint: the recipe shows only when not the default,
        # so checkpoints of earlier releases keep theirs.
        shown = [f for f in dataclasses.fields(self) if f.name != "sparse_recipe" or self.sparse_recipe != SPARSE_RECIPE]
        return f"Auto({', '.join(f'{f.name}={getattr(self, f.name)!r}' for f in shown)})"

    def check(self) -> None:
        """Raise ValueError for a knob out of range (DiLoCo checks on every replica at construction)."""
        if self.sparse_recipe is not None:
            if not isinstance(self.sparse_recipe, Recipe):
                raise TypeError(f"flatcomm.diloco: Auto sparse_recipe must be a Recipe or None, "
                                f"got {type(self.sparse_recipe).__name__}")
            self.sparse_recipe.check()
        for name in ("headroom", "overhead", "step_s", "latency_s", "bytes_per_s"):
            v = getattr(self, name)
            if v is None and name not in ("headroom", "overhead"):
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < float("inf") or \
                    (name in ("headroom", "overhead") and v > 1):
                raise ValueError(f"flatcomm.diloco: Auto {name} must be a number > 0"
                                 f"{' and <= 1' if name in ('headroom', 'overhead') else ''}, got {v!r}")


@dataclasses.dataclass(frozen=True)
class Choice:
    """What ``auto`` took and from which measurements (the same on every replica)."""

    codec: str
    keep: int  # 0 for a codec without a keep
    step_s: float
    latency_s: float
    bytes_per_s: float
    sync_s: float  # the predicted time of the largest fragment's sync
    budget_s: float
    fits: bool

    def to_codec(self) -> Codec:
        return Codec(self.codec, keep=self.keep) if self.keep else Codec(self.codec)

    def as_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Any) -> "Choice":
        """A checked Choice from a checkpoint's record (raises ValueError on anything else)."""
        if not isinstance(d, dict) or set(d) != {f.name for f in dataclasses.fields(cls)}:
            raise ValueError(f"flatcomm.diloco: checkpoint's auto codec record is malformed: {d!r}")
        if (d["codec"], d["keep"] or None) not in RECORDED:
            raise ValueError(f"flatcomm.diloco: checkpoint's auto codec {d['codec']!r} (keep {d['keep']!r}) "
                             f"is not one of auto's candidates")
        return cls(**d)


def sync_bytes(codec: Codec, numel: int, world: int, gathered: bool) -> float:
    """Bytes one rank sends in a sync of ``numel`` values with ``codec`` among ``world`` replicas."""
    if gathered and not codec.lossless:
        return float((world - 1) * codec.wire_bytes(numel))
    shard = -(-numel // world)
    return float(2 * (world - 1) * codec.wire_bytes(shard))


def choose(*, numel: int, fragments: int, world: int, gathered: Union[bool, Callable[[Codec], bool]],
           sync_every: int, delay: int, step_s: float, latency_s: float, bytes_per_s: float,
           auto: Auto = Auto()) -> Choice:
    """The densest candidate whose sync of the largest fragment (``numel`` values) fits (see the
    module's docstring), or the sparsest when none does. ``gathered``: whether a candidate's sync
    is all-gathered (a bool for every candidate, or the DiLoCo plan's rule per codec)."""
    if delay > 0:
        budget, per = auto.headroom * delay * step_s, 1
    else:
        budget, per = auto.overhead * sync_every * step_s, fragments
    best: Optional[Choice] = None
    for name, keep in CANDIDATES:
        codec = Codec(name, keep=keep) if keep else Codec(name)
        gathers = gathered(codec) if callable(gathered) else gathered
        t = latency_s + sync_bytes(codec, numel, world, gathers and not codec.lossless) / bytes_per_s
        best = Choice(name, keep or 0, step_s, latency_s, bytes_per_s, t, budget, per * t <= budget)
        if best.fits:
            return best
    assert best is not None
    return best


def recipe_of(knobs: Optional[Auto], choice: Optional[Choice]) -> Optional[Recipe]:
    """The recipe the outer step runs in place of the configured one for ``choice``, or None."""
    if knobs is None or choice is None or choice.codec != "sparse":
        return None
    return knobs.sparse_recipe


class StepClock:
    """Times the inner steps before the first sync (the first step is warm-up and not counted)."""

    def __init__(self) -> None:
        self.first: Optional[float] = None
        self.last: Optional[float] = None
        self.steps = 0

    def tick(self) -> None:
        now = time.perf_counter()
        if self.first is None:
            self.first = now
        else:
            self.steps += 1
        self.last = now

    def step_s(self) -> float:
        if not self.steps or self.first is None or self.last is None:
            return 0.0
        return (self.last - self.first) / self.steps


def _probe(group, device: torch.device, nbytes: int, world: int) -> float:
    """Best of 3 all-gathers of ``nbytes`` per rank over ``group``, seconds."""
    src = torch.zeros(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty(world * nbytes, dtype=torch.uint8, device=device)
    best = float("inf")
    for _ in range(3):
        dist.barrier(group=group)
        t0 = time.perf_counter()
        all_gather_single(dst, src, group=group)
        best = min(best, time.perf_counter() - t0)
    return best


def measure(group, device: torch.device, world: int, step_s: float, auto: Auto,
            small: int = 1 << 12, large: int = 1 << 18) -> Tuple[float, float, float]:
    """(step_s, latency_s, bytes_per_s) agreed by every replica: the maximum of each time over the
    replicas (the slowest step, the slowest link)."""
    t_small = _probe(group, device, small, world) if auto.latency_s is None else 0.0
    t_large = _probe(group, device, large, world) if auto.bytes_per_s is None else 0.0
    t = torch.tensor([step_s, t_small, t_large], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    step, ts, tl = (float(x) for x in t.cpu())
    step = auto.step_s if auto.step_s is not None else step
    latency = auto.latency_s if auto.latency_s is not None else ts
    bw = auto.bytes_per_s if auto.bytes_per_s is not None else \
        (world - 1) * (large - small) / max(tl - ts, 1e-9)
    return step, latency, bw


def candidates() -> List[str]:
    """The candidates as text, densest first (for messages and docs)."""
    return [f"{n}" + (f" keep {k}" if k else "") for n, k in CANDIDATES]

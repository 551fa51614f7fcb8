"""Per-parameter exceptions and a measured error check for :mod:`flatcomm.ddp`.

**Exceptions** (``keep_fp32=``): parameters sent losslessly whatever the codec, e.g. embeddings,
norms and biases, whose gradients are small to send and sensitive to error. Given as a predicate
``f(name, param) -> bool``, a list of ``fnmatch`` name patterns, or ``"small"`` (:func:`small`:
every parameter with fewer than 2 dimensions, and every one whose name holds ``embed``).

**Backoff** (``codec="auto"``): the error budget is checked against the compression error measured
during training. Every ``every`` steps, per bucket, the sums over the window and over the ranks of
||client residual||^2, ||g + old residual||^2 and ||g||^2 (one fp32 ordered SUM all-reduce, so
every rank sees the same bits and decides the same) give ``rel_error`` and ``residual_ratio``
(||residual|| / ||g||). A bucket whose ``rel_error`` exceeds ``rel_error_limit`` (default: the
budget codec's error on Gaussian values times ``margin``) or whose residual outgrows its gradient
(``residual_ratio > residual_limit``: error feedback falls behind) moves one codec up
:data:`flatcomm.ops.PRECISION`. The residual stays (keyed by parameters): the next codec
sends it. :class:`Monitor` keeps the windows, the measured errors and the moves; the DDP hook and
the FSDP backends (:mod:`flatcomm.fsdp`) both use it.
"""
from __future__ import annotations

import dataclasses
import fnmatch
import math
import threading
from typing import Any, Callable, Dict, Hashable, List, Optional, Sequence, Tuple

import torch

from ..autotune import Decision
from ..ops.codecs import NOMINAL_REL_ERROR, PRECISION

__all__ = ["Backoff", "Monitor", "small", "keep_predicate", "NOMINAL_REL_ERROR"]



def small(name: str, p: torch.Tensor) -> bool:
    """Biases, norm weights (fewer than 2 dimensions) and embeddings (``embed`` in the name)."""
    return p.dim() < 2 or "embed" in name.lower()


def keep_predicate(spec: Any) -> Optional[Callable[[str, torch.Tensor], bool]]:
    """``keep_fp32=`` as a predicate (None: no exceptions); a clear error for anything else."""
    if spec is None:
        return None
    if callable(spec):
        return spec
    if spec == "small":
        return small
    if isinstance(spec, str) or not isinstance(spec, (list, tuple, set, frozenset)) or \
            not all(isinstance(s, str) for s in spec):
        raise TypeError(f"flatcomm: keep_fp32 must be a predicate f(name, param) -> bool, a list of name "
                        f"patterns (fnmatch) or 'small', got {spec!r}")
    pats = tuple(spec)
    return lambda name, p: any(fnmatch.fnmatchcase(name, pat) for pat in pats)


@dataclasses.dataclass
class Backoff:
    """When ``codec="auto"`` moves a bucket to a more precise codec (see the module docs).

    every: steps per check (0: never). rel_error_limit: None = the budget codec's nominal error
    times ``margin``. residual_limit: largest tolerated ||residual|| / ||g||.
    """
    every: int = 50
    rel_error_limit: Optional[float] = None
    margin: float = 3.0
    residual_limit: float = 2.0

    def __post_init__(self):
        if isinstance(self.every, bool) or not isinstance(self.every, int) or self.every < 0:
            raise ValueError(f"flatcomm: Backoff.every must be an int >= 0, got {self.every!r}")
        for k in ("rel_error_limit", "margin", "residual_limit"):
            v = getattr(self, k)
            if v is not None and not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise ValueError(f"flatcomm: Backoff.{k} must be a finite number > 0, got {v!r}")

    def limit(self, budget: str) -> float:
        if self.rel_error_limit is not None:
            return float(self.rel_error_limit)
        return NOMINAL_REL_ERROR[budget] * self.margin

    def judge(self, codec: str, budget: str, c_sq: float, v_sq: float, g_sq: float,
              precision: Sequence[str]) -> Optional[Dict[str, Any]]:
        """The move for one bucket from its agreed sums, or None to stay. Pure: same input, same answer."""
        if codec not in precision or precision.index(codec) == 0:
            return None
        rel = math.sqrt(c_sq / v_sq) if v_sq > 0 else 0.0
        ratio = math.sqrt(c_sq / g_sq) if g_sq > 0 else (0.0 if c_sq == 0 else math.inf)
        lim = self.limit(budget)
        if rel > lim:
            why = f"rel_error {rel:.4g} > {lim:.4g} (budget {budget})"
        elif ratio > self.residual_limit:
            why = f"residual/gradient {ratio:.4g} > {self.residual_limit:.4g}"
        elif not (math.isfinite(rel) and math.isfinite(ratio)):
            why = "non-finite error measure"
        else:
            return None
        to = precision[precision.index(codec) - 1]
        return {"from": codec, "to": to, "rel_error": rel, "residual_ratio": ratio, "why": why}


def agreed_sums(window: List[List[Any]], all_reduce_sum, device=None) -> List[List[float]]:
    """Every rank's [c_sq, v_sq, g_sq] per bucket summed over the ranks (``all_reduce_sum`` of one
    fp32 tensor, flatcomm's ordered sum: the same bits on every rank)."""
    if not window:
        return []
    flat = torch.tensor([float(x) for row in window for x in row], dtype=torch.float32, device=device)
    all_reduce_sum(flat)
    vals = flat.tolist()
    return [vals[i:i + 3] for i in range(0, len(vals), 3)]


class Monitor:
    """A :class:`Backoff` at work: per decision key, the window of ``[c_sq, v_sq, g_sq]`` since the
    last check, the last measured errors, and every move made (``adaptations``)."""

    def __init__(self, backoff: Backoff):
        self.backoff = backoff
        self.adaptations: List[dict] = []
        self.measured: Dict[Hashable, Tuple[float, float]] = {}  # key -> (rel_error, residual ratio)
        self._window: Dict[Hashable, List[Any]] = {}
        self._lock = threading.Lock()  # accumulate runs on collective worker threads

    def due(self, count: int) -> bool:
        """Whether the ``count``-th step / call (from 0) is a check point."""
        every = self.backoff.every
        return bool(every) and count > 0 and count % every == 0

    def accumulate(self, key: Hashable, c_sq: Any, v_sq: Any, g_sq: Any) -> None:
        """Add one step's ||client residual||^2, ||g + old residual||^2, ||g||^2 of ``key`` (floats or
        0-dim tensors: no host sync until :meth:`check` reads them)."""
        with self._lock:
            w = self._window.get(key)
            new = [c_sq, v_sq, g_sq]
            self._window[key] = new if w is None else [a + b for a, b in zip(w, new)]

    def check(self, decisions: Dict[Any, Any], keys: Sequence[Any], budget: str, step: int,
              all_reduce_sum: Callable[[torch.Tensor], Any], device=None,
              where: Callable[[Any], dict] = lambda key: {}, unit: str = "steps") -> List[dict]:
        """Sum the windows of ``keys`` over the ranks (one collective: call it at the same point,
        with the same keys in the same order, on every rank) and move each key whose error is over
        the budget one codec up, in ``decisions`` (a :class:`flatcomm.autotune.Decision` each).
        Returns this check's moves (also appended to ``adaptations``, with ``where(key)``)."""
        with self._lock:
            rows = [self._window.pop(k, [0.0, 0.0, 0.0]) for k in keys]
        sums = agreed_sums(rows, all_reduce_sum, device)
        moves = []
        for k, (c, v, g) in zip(keys, sums):
            d = decisions[k]
            move = self.backoff.judge(d.codec, budget, c, v, g, PRECISION)
            if v > 0:  # (a collective not run since the last check sends nothing)
                self.measured[k] = (math.sqrt(c / v), math.sqrt(c / g) if g > 0 else 0.0)
            if move is None:
                continue
            reason = (f"backed off from {move['from']} at step {step}: {move['why']} over the last "
                      f"{self.backoff.every} {unit}, all ranks")
            decisions[k] = Decision(move["to"], d.chunks, reason, {})
            rec = {"step": step, **where(k), **move}
            self.adaptations.append(rec)
            moves.append(rec)
        return moves

    def clear(self) -> None:
        """Forget every window (a check of all keys at once starts the next windows from zero)."""
        with self._lock:
            self._window.clear()

    def measured_fields(self, key: Hashable) -> dict:
        m = self.measured.get(key)
        return {} if m is None else {"measured_rel_error": m[0], "measured_residual_ratio": m[1]}

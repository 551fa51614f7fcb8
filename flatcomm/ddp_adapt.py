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
:data:`flatcomm.autotune.PRECISION`. The residual stays (keyed by parameters): the next codec
sends it.
"""
from __future__ import annotations

import dataclasses
import fnmatch
import math
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

__all__ = ["Backoff", "small", "keep_predicate", "NOMINAL_REL_ERROR"]

# ||x - decode(encode(x))|| / ||x|| for Gaussian x with flatcomm's default blocks (absmax scaling:
# int8 step max/127, int4 max/7, sign at the block's mean magnitude: sqrt(1 - 2/pi)).
NOMINAL_REL_ERROR = {"fp32": 0.0, "bf16": 0.0023, "int8": 0.0065, "int4": 0.12, "sign": 0.60}


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

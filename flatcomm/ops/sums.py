"""Ordered and exact (order-independent) sums of stacked contributions.

``ordered_sum`` adds rows in ascending order: deterministic for a fixed row order.

The exact family works on int64 fixed point with one shared exponent per block of elements:
``exact_exponents`` gives each block's exponent E (smallest with |v| < 2^E; reduce it with MAX
across all contributors), ``to_exact`` turns values into integers m = round(v * 2^(P - E)) with
P = 62 - headroom, integers add exactly in any order or grouping (e.g. an int64 all-reduce), and
``from_exact`` turns the integer sum back into fp32. Guarantee: if every contribution is within
P - 23 binades of its block's bound (27 for the default headroom 12) the result is the exact sum
correctly rounded to fp32 (a subnormal result may be rounded twice); otherwise each contribution is
first rounded to the grid 2^(E - P), and the result is still independent of order and grouping. Up
to 2^headroom contributions add without overflow. A block holding inf or NaN has exponent
``NONFINITE_EXPONENT`` and decodes to NaN.
"""
from __future__ import annotations

import torch

from .native import extension as _C, ops

__all__ = [
    "DEFAULT_EXACT_BLOCK", "DEFAULT_HEADROOM", "NONFINITE_EXPONENT", "ZERO_EXPONENT", "exact_exponents",
    "exact_sum", "from_exact", "ordered_sum", "to_exact"
]

DEFAULT_EXACT_BLOCK = 256
DEFAULT_HEADROOM = _C.default_headroom()
ZERO_EXPONENT = -200
NONFINITE_EXPONENT = 1 << 20


def ordered_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum of the rows of ``x`` ([W, n], fp32/bf16/fp16) in ascending row order, as fp32 [n]."""
    return ops.ordered_sum(x)


def exact_exponents(x: torch.Tensor, block_size: int = DEFAULT_EXACT_BLOCK) -> torch.Tensor:
    """Per-block exponents (int32) of ``x`` ([n] or [W, n]: the max over rows)."""
    return ops.exact_exponents(x, block_size)


def to_exact(x: torch.Tensor, exponents: torch.Tensor, block_size: int = DEFAULT_EXACT_BLOCK,
             headroom: int = DEFAULT_HEADROOM) -> torch.Tensor:
    """Fixed-point int64 image of ``x`` (1-D) on the given per-block exponents."""
    return ops.to_exact(x, exponents, block_size, headroom)


def from_exact(acc: torch.Tensor, exponents: torch.Tensor, block_size: int = DEFAULT_EXACT_BLOCK,
               headroom: int = DEFAULT_HEADROOM) -> torch.Tensor:
    """fp32 value of a fixed-point int64 sum (correctly rounded, see the module docstring)."""
    return ops.from_exact(acc, exponents, block_size, headroom)


def exact_sum(x: torch.Tensor, block_size: int = DEFAULT_EXACT_BLOCK,
              headroom: int = DEFAULT_HEADROOM) -> torch.Tensor:
    """Order-independent sum of the rows of ``x`` ([W, n]): the same bits for any row order."""
    return ops.exact_sum(x, block_size, headroom)

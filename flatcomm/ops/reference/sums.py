"""The reference ordered and exact sums, and exact rational helpers for small tests (see
:mod:`flatcomm.ops.reference`)."""
from __future__ import annotations

import math
from fractions import Fraction
from typing import Optional, Tuple

import torch

from .bits import *  # noqa: F401,F403
from .bits import _blocked

__all__ = [
    "ordered_sum", "exponent_of_abs_bits", "exact_exponents", "to_fixed", "from_fixed", "to_exact",
    "from_exact", "exact_sum", "round_to_f32", "exact_sum_exact", "dequant_error_bound",
    "ef_identity_error"
]


# ---- ordered and exact sums ---------------------------------------------------------------------------


def ordered_sum(x: torch.Tensor) -> torch.Tensor:
    """fp32 sum of the rows of x ([W, n]) in ascending row order (a plain sequential loop)."""
    out = torch.zeros(x.shape[-1], dtype=torch.float32)
    for r in range(x.shape[0]):
        row = x[r].to(torch.float32)
        out = row.clone() if r == 0 else out + row
    return out


def exponent_of_abs_bits(ab: torch.Tensor) -> torch.Tensor:
    """Smallest E with |a| < 2^E (EXP_ZERO for 0, EXP_NONFINITE for inf/NaN), as int64."""
    biased = ab >> 23
    _, bitlen = torch.frexp(ab.to(torch.float64))  # subnormal: a = ab * 2^-149, ab < 2^23
    e = torch.where(biased > 0, biased - 126, bitlen.to(torch.int64) - 149)
    e = torch.where(ab == 0, torch.full_like(e, EXP_ZERO), e)
    return torch.where(ab >= INF_BITS, torch.full_like(e, EXP_NONFINITE), e)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """[W, n] fp32 view of x ([n] means W = 1)."""
    v = x.to(torch.float32)
    return v if v.dim() == 2 else v.reshape(1, -1)


def exact_exponents(x: torch.Tensor, block_size: int = 256) -> torch.Tensor:
    """Per-block exponent (int32) of x ([n] or [W, n]), the max over rows."""
    v = _rows(x)
    n = v.shape[1]
    if n == 0:
        return torch.zeros(0, dtype=torch.int32)
    nb = -(-n // block_size)
    ab = torch.nn.functional.pad(abs_bits(v), (0, nb * block_size - n)).reshape(v.shape[0], nb, block_size)
    return exponent_of_abs_bits(ab.amax(dim=(0, 2))).to(torch.int32)


def _per_elem(e: torch.Tensor, n: int, block_size: int) -> torch.Tensor:
    return e.to(torch.int64).repeat_interleave(block_size)[:n]


def to_fixed(v: torch.Tensor, E: torch.Tensor, precision: int) -> torch.Tensor:
    """round_half_even(v * 2^(P - E)) as int64 (exact in float64); 0 for zero/non-finite blocks."""
    special = (E == EXP_ZERO) | (E == EXP_NONFINITE)
    shift = torch.where(special, torch.zeros_like(E), precision - E)
    t = v.to(torch.float64) * torch.pow(2.0, shift.to(torch.float64))
    t = torch.where(special, torch.zeros_like(t), t)
    return torch.round(t).to(torch.int64)


def from_fixed(m: torch.Tensor, E: torch.Tensor, precision: int) -> torch.Tensor:
    """fp32(m) (RNE) times 2^(E - P), applied in exact power-of-two steps, as core::from_fixed."""
    f = m.to(torch.float32)  # int64 -> fp32 rounds to nearest even (checked in the tests)
    e = E - precision
    for _ in range(3):
        big, small = e > 127, e < -126
        f = torch.where(big, f * 2.0**127, torch.where(small, f * 2.0**-126, f))
        e = torch.where(big, e - 127, torch.where(small, e + 126, e))
    f = f * torch.pow(2.0, e.to(torch.float32))  # exact: -126 <= e <= 127
    f = torch.where((E == EXP_ZERO) | (m == 0), torch.zeros_like(f), f)
    nan = f32_from_bits(torch.full_like(m, QNAN_BITS))
    return torch.where(E == EXP_NONFINITE, nan, f)


def to_exact(x: torch.Tensor, exponents: torch.Tensor, block_size: int = 256,
             headroom: int = DEFAULT_HEADROOM) -> torch.Tensor:
    v = load_f32(x)
    return to_fixed(v, _per_elem(exponents, v.numel(), block_size), 62 - headroom)


def from_exact(acc: torch.Tensor, exponents: torch.Tensor, block_size: int = 256,
               headroom: int = DEFAULT_HEADROOM) -> torch.Tensor:
    return from_fixed(acc, _per_elem(exponents, acc.numel(), block_size), 62 - headroom)


def exact_sum(x: torch.Tensor, block_size: int = 256, headroom: int = DEFAULT_HEADROOM) -> torch.Tensor:
    """``flatcomm.exact_sum`` (bit-exact): shared exponent per block, int64 fixed-point sum."""
    v = _rows(x)
    n = v.shape[1]
    E = _per_elem(exact_exponents(v, block_size), n, block_size)
    P = 62 - headroom
    acc = torch.zeros(n, dtype=torch.int64)
    for r in range(v.shape[0]):
        acc = acc + to_fixed(v[r], E, P)
    return from_fixed(acc, E, P)


# ---- exact rational helpers (Python integers; for small tests) -------------------------------------------


def round_to_f32(q: Fraction) -> float:
    """The exact rational q rounded to the nearest fp32 (ties to even), as a Python float."""
    if q == 0:
        return 0.0
    sign = -1.0 if q < 0 else 1.0
    a = abs(q)
    e = a.numerator.bit_length() - a.denominator.bit_length()  # 2^e <= a < 2^(e+2)
    if Fraction(2) ** e > a:
        e -= 1
    if Fraction(2) ** (e + 1) <= a:
        e += 1
    quantum = Fraction(2) ** (max(e, -126) - 23)  # spacing of fp32 around a (subnormals: 2^-149)
    m = round(a / quantum)  # Fraction.__round__: half to even
    r = m * quantum
    if r > Fraction(FLT_MAX):
        return sign * math.inf
    return sign * float(r)


def exact_sum_exact(x: torch.Tensor) -> torch.Tensor:
    """Correctly rounded fp32 of the EXACT column sums of x ([W, n]); NaN where a column is non-finite."""
    v = _rows(x).to(torch.float64)
    out = []
    for col in v.t().tolist():
        if not all(math.isfinite(c) for c in col):
            out.append(math.nan)
            continue
        out.append(round_to_f32(sum((Fraction(c) for c in col), Fraction(0))))
    return torch.tensor(out, dtype=torch.float32)


# ---- float64 error bounds ------------------------------------------------------------------------------------


def dequant_error_bound(x: torch.Tensor, codec: str, block_size: int = 256, *,
                        residual: Optional[torch.Tensor] = None, stochastic: bool = False) -> torch.Tensor:
    """Per-element float64 bound on |v - decode(encode(v))| with v = x (+ residual) in fp32.

    int8/int4: a round-to-nearest step is scale / 2; fp32 rounding of t = v * (1 / scale) and of
    code * scale adds a few ulps of the code (qmax * 2^-21 of a step), and a subnormal scale is
    itself rounded by up to 2^-150, which moves the largest code by up to qmax * 2^-150. Stochastic
    rounding: one whole step. bf16/fp16: half an ulp (2^-8 / 2^-11 relative, 2^-134 / 2^-25 absolute
    for subnormals). fp32: 0. inf where the value or its block is non-finite. Not for sign/topk
    (their decoded values are checked directly).
    """
    v = load_f32(x)
    if residual is not None:
        v = v + residual.reshape(-1)
    n = v.numel()
    v64 = v.to(torch.float64)
    if codec == "fp32":
        b = torch.zeros(n, dtype=torch.float64)
    elif codec == "bf16":
        b = torch.maximum(v64.abs() * 2.0**-8, torch.full_like(v64, 2.0**-134))
        if stochastic:
            b = 2 * b
    elif codec == "fp16":
        b = torch.maximum(v64.abs() * 2.0**-11, torch.full_like(v64, 2.0**-25))
        b = torch.where(v64.abs() >= 65520.0, torch.full_like(v64, math.inf), b)
    elif codec in ("int8", "int4"):
        qmax = QMAX[codec]
        mab = abs_bits(_blocked(v, block_size)).amax(dim=1)
        scale, _, _, _ = int_block_params(mab, qmax)
        s = scale.to(torch.float64).repeat_interleave(block_size)[:n]
        step = 1.0 if stochastic else 0.5
        b = s * (step + qmax * 2.0**-21) + qmax * 2.0**-149
    else:
        raise ValueError(f"reference: no simple error bound for codec {codec!r}")
    return torch.where(torch.isnan(b) | ~torch.isfinite(v64), torch.full_like(b, math.inf), b)


def ef_identity_error(x: torch.Tensor, r_old: torch.Tensor, decoded: torch.Tensor,
                      r_new: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(|x + r_old - (decoded + r_new)|, allowed) in float64 for error feedback.

    v = fl(x + r_old) is one fp32 rounding away from x + r_old, and r_new = fl(v - decoded) one more
    (exact for int8/int4/casts by Sterbenz's lemma, not always for sign), so the gap is at most half
    an ulp of each: 2^-24 (|v| + |r_new|), plus the subnormal quantum.
    """
    x64 = load_f32(x).to(torch.float64)
    r0 = r_old.reshape(-1).to(torch.float64)
    d = decoded.reshape(-1).to(torch.float64)
    r1 = r_new.reshape(-1).to(torch.float64)
    gap = ((x64 + r0) - (d + r1)).abs()
    allowed = 2.0**-24 * ((x64 + r0).abs() + r1.abs()) * (1 + 2.0**-20) + 2.0**-149
    return gap, allowed

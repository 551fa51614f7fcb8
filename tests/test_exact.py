"""Exact sums: exact_sum / to_exact / from_exact are order- and grouping-independent, bitwise equal
to the reference, and equal to the correctly rounded exact sum within the documented range."""
from __future__ import annotations

import math
import random

import pytest
import torch

import flatcomm
from flatcomm.ops import reference as R

from _support.kernels import DTYPES, assert_bits_equal, make_input

HEADROOM = flatcomm.ops.sums.DEFAULT_HEADROOM


def _rows(gen, W, n, dtype=torch.float32, kind="mixed"):
    return torch.stack([make_input(gen, n, dtype, kind) for _ in range(W)]) if W else torch.zeros(0, n, dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("W,n,b", [(1, 1, 1), (2, 33, 32), (3, 257, 256), (5, 4099, 64), (8, 1000, 4096),
                                   (4, 65537, 256), (3, 97, 7), (2, 0, 256)])
def test_exact_sum_matches_reference(gen, dtype, W, n, b):
    x = _rows(gen, W, n, dtype, "wide" if dtype == torch.float32 else "mixed")
    got = flatcomm.exact_sum(x, b)
    assert got.dtype == torch.float32 and got.shape == (n,)
    assert_bits_equal(got, R.exact_sum(x, b))
    assert_bits_equal(flatcomm.exact_exponents(x, b), R.exact_exponents(x, b), "exponents")


@pytest.mark.parametrize("W", [2, 3, 5, 8, 16])
def test_exact_sum_invariant_under_row_permutations(gen, W):
    n = 3000
    x = _rows(gen, W, n, kind="wide")
    base = flatcomm.exact_sum(x)
    for _ in range(5):
        perm = torch.randperm(W, generator=gen)
        assert_bits_equal(flatcomm.exact_sum(x[perm]), base, f"perm {perm.tolist()}")


@pytest.mark.parametrize("W,b,headroom", [(4, 256, 12), (7, 32, 12), (6, 100, 3), (9, 4096, 38), (5, 1, 20)])
def test_grouping_independence_via_to_exact(gen, W, b, headroom):
    n = 2000
    x = _rows(gen, W, n, kind="wide")
    want = flatcomm.exact_sum(x, b, headroom)
    E = flatcomm.exact_exponents(x, b)
    assert_bits_equal(E, torch.stack([flatcomm.exact_exponents(x[r], b) for r in range(W)]).amax(0), "MAX reduce")
    parts = [flatcomm.to_exact(x[r], E, b, headroom) for r in range(W)]
    for r in range(W):
        assert torch.equal(parts[r], R.to_exact(x[r], E, b, headroom))
    rng = random.Random(int(torch.randint(0, 1 << 30, (1,), generator=gen)))
    for _ in range(4):  # random groupings: sum random subsets, then sum the subtotals
        order = list(range(W))
        rng.shuffle(order)
        cuts = sorted(rng.sample(range(1, W), rng.randint(0, W - 1)))
        groups = [order[i:j] for i, j in zip([0] + cuts, cuts + [W])]
        subtotals = [sum(parts[i] for i in g) for g in groups]
        total = subtotals[0]
        for s in subtotals[1:]:
            total = total + s
        got = flatcomm.from_exact(total, E, b, headroom)
        assert_bits_equal(got, want, f"groups {groups}")
        assert_bits_equal(got, R.from_exact(total, E, b, headroom))


def _within_range(gen, W, n, b, binades, top):
    """Rows whose nonzero values lie in [2^(top - binades), 2^top) per block (top varies per block)."""
    nb = -(-n // b)
    tops = (top + torch.randint(-20, 21, (nb,), generator=gen)).repeat_interleave(b)[:n]
    e = tops - 1 - torch.randint(0, binades, (W, n), generator=gen)  # |v| in [2^e, 2^(e+1))
    m = 1 + torch.rand(W, n, generator=gen)
    sign = torch.where(torch.rand(W, n, generator=gen) < 0.5, -1.0, 1.0)
    x = (sign * torch.ldexp(m, e.float())).float()
    x[torch.rand(W, n, generator=gen) < 0.1] = 0.0
    return x


@pytest.mark.parametrize("W,b,headroom", [(2, 256, 12), (5, 32, 12), (16, 64, 12), (3, 128, 20), (4, 256, 4)])
def test_correctly_rounded_within_documented_range(gen, W, b, headroom):
    # Guarantee: values within P - 23 binades of the block bound (27 for headroom 12) sum exactly.
    n = 600
    binades = 62 - headroom - 23
    x = _within_range(gen, W, n, b, binades, top=0)
    got = flatcomm.exact_sum(x, b, headroom)
    assert_bits_equal(got, R.exact_sum_exact(x), "correctly rounded exact sum")


def test_beyond_range_still_order_independent(gen):
    W, n, b = 6, 800, 64
    x = _within_range(gen, W, n, b, 60, top=10)  # 60 binades: small values are rounded to the grid
    base = flatcomm.exact_sum(x, b)
    assert_bits_equal(base, R.exact_sum(x, b))
    for _ in range(5):
        assert_bits_equal(flatcomm.exact_sum(x[torch.randperm(W, generator=gen)], b), base)
    # each contribution is off by at most half a grid step 2^(E - P)
    E = R.exact_exponents(x, b).double().repeat_interleave(b)[:n]
    truth = x.double().sum(0)
    grid = torch.ldexp(torch.ones(n, dtype=torch.float64), (E - (62 - HEADROOM)).long())
    assert ((base.double() - truth).abs() <= W * grid / 2 + truth.abs() * 2.0**-24).all()


def test_exact_sum_cancellation():
    # 2^25 + 1 - 2^25: an fp32 loop loses the 1 (ulp of 2^25 is 4); the fixed-point sum keeps it
    x = torch.tensor([[2.0**25, 3.0], [1.0, -3.0], [-(2.0**25), 0.0]])
    assert flatcomm.ordered_sum(x).tolist() == [0.0, 0.0]
    assert flatcomm.exact_sum(x, 1).tolist() == [1.0, 0.0]
    # 1e20 + 1 - 1e20: the 1 is 67 binades below the block bound, beyond the documented 27, so it is
    # rounded to the grid 2^(E - P) = 2^17 first (documented behaviour, not a bug)
    y = torch.tensor([[1e20], [1.0], [-1e20]])
    assert flatcomm.exact_sum(y, 1).item() == 0.0


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
def test_nonfinite_block_gives_nan(gen, bad):
    x = _rows(gen, 3, 200)
    x[1, 70] = bad
    got = flatcomm.exact_sum(x, 64)
    assert torch.isnan(got[64:128]).all()
    assert torch.isfinite(got[:64]).all() and torch.isfinite(got[128:]).all()
    E = flatcomm.exact_exponents(x, 64)
    assert E[1].item() == flatcomm.ops.sums.NONFINITE_EXPONENT
    # to_exact of the finite rows with the reduced exponents, then from_exact: NaN block too
    acc = flatcomm.to_exact(x[0], E, 64) + flatcomm.to_exact(x[2], E, 64)
    out = flatcomm.from_exact(acc, E, 64)
    assert torch.isnan(out[64:128]).all() and torch.isfinite(out[:64]).all()
    # the row holding the non-finite value converts with its block marked non-finite
    assert (flatcomm.to_exact(x[1], E, 64)[64:128] == 0).all()


def test_zero_blocks_and_exponents():
    x = torch.zeros(2, 100)
    x[0, 50] = 0.75
    E = flatcomm.exact_exponents(x, 32)
    assert E.tolist() == [flatcomm.ops.sums.ZERO_EXPONENT, 0, flatcomm.ops.sums.ZERO_EXPONENT, flatcomm.ops.sums.ZERO_EXPONENT]
    got = flatcomm.exact_sum(x, 32)
    assert_bits_equal(got, x.sum(0))


def test_to_exact_raises_when_exponent_too_small(gen):
    x = make_input(gen, 100) + 3.0
    E = flatcomm.exact_exponents(x, 32)
    with pytest.raises(RuntimeError, match="exceed their block's exponent"):
        flatcomm.to_exact(x, E - 1, 32)
    y = x.clone()
    y[5] = math.inf  # a non-finite value in a block not marked non-finite
    with pytest.raises(RuntimeError, match="exceed their block's exponent"):
        flatcomm.to_exact(y, E, 32)


@pytest.mark.parametrize("headroom", [1, 5, 12, 38])
def test_headroom_capacity(headroom):
    # 2^headroom rows of the block's largest magnitude add without overflow
    W = min(1 << headroom, 4096)
    x = torch.full((W, 64), 0.99999994)
    x[:, 1::2] *= -1
    got = flatcomm.exact_sum(x, 32, headroom)
    assert_bits_equal(got, R.exact_sum_exact(x[:, :4]).repeat(16), "exact")
    if W < 4096:
        with pytest.raises(RuntimeError, match="headroom"):
            flatcomm.exact_sum(torch.zeros(W + 1, 4), 32, headroom)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_exact_low_precision_rows(gen, dtype):
    x = _rows(gen, 5, 1000, dtype)
    got = flatcomm.exact_sum(x, 64)
    assert_bits_equal(got, R.exact_sum(x, 64))
    assert_bits_equal(got, R.exact_sum_exact(x), "bf16/fp16 inputs span < 27 binades here")


def test_exact_1d_input(gen):
    x = make_input(gen, 300)
    assert_bits_equal(flatcomm.exact_exponents(x, 64), R.exact_exponents(x, 64))
    assert_bits_equal(flatcomm.exact_sum(x.reshape(1, -1), 64), R.exact_sum(x, 64))

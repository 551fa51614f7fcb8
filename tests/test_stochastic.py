"""Stochastic rounding (int8, int4, bf16): bit-exact with the reference, reproducible per seed,
different across seeds, unbiased, error below one step, independent of the thread count."""
from __future__ import annotations

import pytest
import torch

import flatcomm
from flatcomm.ops import reference as R

from _support.kernels import BLOCK_SIZES, DTYPES, assert_bits_equal, make_input

SCODECS = ["int8", "int4", "bf16"]


@pytest.mark.parametrize("codec", SCODECS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 31, 257, 4099])
def test_stochastic_matches_reference(gen, codec, dtype, n):
    b = BLOCK_SIZES[n % 4]
    seed = int(torch.randint(-(1 << 62), 1 << 62, (1,), generator=gen))
    x = make_input(gen, n, dtype)
    r = torch.randn(n, generator=gen) * 1e-3
    r_ref = r.clone()
    p = flatcomm.encode(x, codec, residual=r, block_size=b, stochastic=True, seed=seed)
    assert_bits_equal(p, R.encode(x, codec, residual=r_ref, block_size=b, stochastic=True, seed=seed))
    assert_bits_equal(r, r_ref)


@pytest.mark.parametrize("codec", SCODECS)
def test_seed_reproducible_and_varies(gen, codec):
    x = make_input(gen, 4099)
    p1 = flatcomm.encode(x, codec, stochastic=True, seed=7)
    p2 = flatcomm.encode(x, codec, stochastic=True, seed=7)
    p3 = flatcomm.encode(x, codec, stochastic=True, seed=8)
    assert_bits_equal(p1, p2, "same seed")
    assert not torch.equal(p1, p3), "another seed gives other bits"
    assert not torch.equal(p1, flatcomm.encode(x, codec)), "stochastic differs from nearest"


@pytest.mark.parametrize("codec", SCODECS)
def test_stochastic_error_below_one_step(gen, codec):
    n = 4096
    x = make_input(gen, n)
    for seed in range(5):
        p = flatcomm.encode(x, codec, stochastic=True, seed=seed, block_size=64)
        d = flatcomm.decode(p, codec, n, block_size=64).double()
        err = (x.double() - d).abs()
        if codec == "bf16":  # below one bf16 ulp: 2^-7 relative to the value's binade
            assert (err < x.double().abs() * 2.0**-7 + 2.0**-133).all()
        else:
            s = R.block_scales(p, codec, n, 64).double().repeat_interleave(64)
            assert (err <= s * (1 + 1e-4) + 2.0**-140).all()
            assert (err <= R.dequant_error_bound(x, codec, 64, stochastic=True)).all()


@pytest.mark.parametrize("codec", SCODECS)
def test_stochastic_is_unbiased(gen, codec):
    n, seeds = 256, 1500
    x = torch.randn(n, generator=gen)
    x[0] = x.abs().max() * 1.01  # fix the int scale well above most values
    acc = torch.zeros(n, dtype=torch.float64)
    base = int(torch.randint(0, 1 << 40, (1,), generator=gen))
    for s in range(seeds):
        d = flatcomm.decode(flatcomm.encode(x, codec, stochastic=True, seed=base + s), codec, n).double()
        acc += d
    mean = acc / seeds
    x64 = x.double()
    if codec == "bf16":  # one step = one bf16 ulp of the value's binade
        step = torch.ldexp(torch.ones_like(x64), torch.frexp(x64)[1] - 8)
    else:
        step = R.block_scales(flatcomm.encode(x, codec), codec, n).double().repeat_interleave(256)[:n]
    # per element: the rounding is a Bernoulli draw of std <= step / 2, so the mean of `seeds`
    # draws is within 6 of its standard errors of x
    ok = (mean - x64).abs() <= 6 * step * 0.5 / seeds**0.5
    i = (~ok).nonzero().flatten()
    assert ok.all(), f"{i.tolist()} x={x64[i].tolist()} mean={mean[i].tolist()}"
    # in aggregate (std <= 0.5 / sqrt(seeds * n) ~ 8e-4 steps): no bias
    assert abs(((mean - x64) / step).mean().item()) < 0.006
    # and nearest rounding is biased where stochastic is not: sanity check of the test's power
    if codec != "bf16":
        dn = flatcomm.decode(flatcomm.encode(x, codec), codec, n).double()
        assert ((dn - x64) / step).abs().max() > 0.4


@pytest.mark.parametrize("codec", SCODECS)
def test_stochastic_thread_count_independent(codec, restore_threads):
    g = torch.Generator().manual_seed(123)
    n = (1 << 20) + 4099
    x = torch.randn(n, generator=g)
    res = []
    for threads in (1, 2):
        torch.set_num_threads(threads)
        r = torch.full((n,), 1e-3)
        p = flatcomm.encode(x, codec, residual=r, stochastic=True, seed=99, block_size=64)
        res.append((p, r))
    assert_bits_equal(res[0][0], res[1][0], "payload")
    assert_bits_equal(res[0][1], res[1][1], "residual")


def test_negative_and_large_seeds_are_valid():
    x = torch.randn(1000)
    for seed in (-1, -(1 << 63), (1 << 63) - 1):
        p = flatcomm.encode(x, "int8", stochastic=True, seed=seed)
        assert_bits_equal(p, R.encode(x, "int8", stochastic=True, seed=seed))

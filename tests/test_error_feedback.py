"""Error feedback: x + r_old == decode(payload) + r_new (to fp32 rounding), residual updated in place,
bitwise equal to the reference, and unbiased over many steps (the telescoping sum)."""
from __future__ import annotations

import math

import pytest
import torch

import flatcomm
from flatcomm.ops import reference as R

from _support.kernels import BLOCK_SIZES, CODECS, DTYPES, assert_bits_equal, make_input


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 33, 257, 4099])
def test_ef_identity_and_in_place(gen, codec, dtype, n):
    b = BLOCK_SIZES[(n + len(codec)) % 4]
    x = make_input(gen, n, dtype)
    r = torch.randn(n, generator=gen) * 0.01
    r_old, r_ref = r.clone(), r.clone()
    ptr = r.data_ptr()
    p = flatcomm.encode(x, codec, residual=r, block_size=b, ratio=0.1)
    assert r.data_ptr() == ptr and r.dtype == torch.float32 and r.shape == (n,)
    assert_bits_equal(p, R.encode(x, codec, residual=r_ref, block_size=b, ratio=0.1), "payload")
    assert_bits_equal(r, r_ref, "residual")
    d = flatcomm.decode(p, codec, n, block_size=b, ratio=0.1)
    gap, allowed = R.ef_identity_error(x, r_old, d, r)
    assert (gap <= allowed).all(), f"max gap {(gap - allowed).max().item()}"
    if codec == "fp32":
        assert (r == 0).all()
    v = x.float() + r_old
    assert_bits_equal(r, v - d, "r_new = fp32(v - decode)")
    # and that subtraction is exact (Sterbenz) for all codecs but sign and the chunked sparse ones,
    # whose decoded level (a mean magnitude) may be more than 2x away from v
    if codec != "sign" and codec not in R.CHUNKED:
        assert torch.equal(r.double(), v.double() - d.double())


@pytest.mark.parametrize("codec", ["int8", "int4", "sign", "topk", "bf16", "fp16"])
def test_ef_residual_shape_any(gen, codec):
    x = make_input(gen, 8 * 40).reshape(8, 40)
    r = torch.zeros(8, 40)
    p = flatcomm.encode(x, codec, residual=r, block_size=32, ratio=0.1)
    r2 = torch.zeros(320)
    p2 = flatcomm.encode(x.reshape(-1), codec, residual=r2, block_size=32, ratio=0.1)
    assert_bits_equal(p, p2)
    assert_bits_equal(r.reshape(-1), r2)


@pytest.mark.parametrize("codec", ["int8", "int4", "sign", "topk", "bf16"])
def test_ef_telescopes_over_steps(gen, codec):
    # sum_t decode_t = sum_t x_t + r_0 - r_T: what is not sent is carried, never lost.
    n, steps = 1000, 20
    r = torch.zeros(n)
    sent = torch.zeros(n, dtype=torch.float64)
    total = torch.zeros(n, dtype=torch.float64)
    slack = torch.zeros(n, dtype=torch.float64)
    for t in range(steps):
        x = make_input(gen, n)
        r_old = r.clone()
        p = flatcomm.encode(x, codec, residual=r, block_size=64, ratio=0.05)
        d = flatcomm.decode(p, codec, n, block_size=64, ratio=0.05)
        gap, allowed = R.ef_identity_error(x, r_old, d, r)
        assert (gap <= allowed).all()
        sent += d.double()
        total += x.double()
        slack += allowed
    assert ((sent + r.double() - total).abs() <= slack).all()


@pytest.mark.parametrize("codec", ["int8", "int4", "sign"])
def test_ef_zero_block_residual_stays_zero(codec):
    x = torch.zeros(512)
    x[:64] = torch.linspace(-3, 3, 64)
    r = torch.zeros(512)
    flatcomm.encode(x, codec, residual=r, block_size=64)
    assert_bits_equal(r[64:], torch.zeros(448))


@pytest.mark.parametrize("codec", ["int8", "int4", "sign"])
@pytest.mark.parametrize("where", ["x", "residual"])
def test_ef_nonfinite_block_keeps_old_residual(gen, codec, where):
    n, b = 256, 32
    x = make_input(gen, n)
    r = torch.randn(n, generator=gen) * 0.1
    if where == "x":
        x[40] = math.inf
    else:
        x[40] = 3e38
        r[40] = 3e38  # both finite, but v = x + r = inf in fp32
    r_old = r.clone()
    r_ref = r.clone()
    p = flatcomm.encode(x, codec, residual=r, block_size=b)
    assert_bits_equal(p, R.encode(x, codec, residual=r_ref, block_size=b))
    assert_bits_equal(r, r_ref)
    assert_bits_equal(r[32:64], r_old[32:64], "block 1 keeps its residual")
    d = flatcomm.decode(p, codec, n, block_size=b)
    assert torch.isnan(d[32:64]).all()
    assert torch.isfinite(d[:32]).all() and torch.isfinite(d[64:]).all()
    assert not torch.equal(r[:32], r_old[:32])

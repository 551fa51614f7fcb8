"""decode_sum: bitwise equal to the reference (ascending row order, one scale multiply), within a
float64 error bound of the true sum; fused re-encode equals encode(decode_sum) with the residual."""
from __future__ import annotations

import itertools

import pytest
import torch

import flatcomm
from flatcomm.ops import reference as R

from _support.kernels import BLOCK_SIZES, CODECS, assert_bits_equal, make_input

RATIO = 0.05


def _payloads(gen, codec, n, W, b, dtype=torch.float32):
    xs = [make_input(gen, n, dtype) for _ in range(W)]
    ps = [flatcomm.encode(x, codec, block_size=b, ratio=RATIO) for x in xs]
    return xs, torch.stack(ps) if ps else torch.zeros(0, R.wire_bytes(codec, n, b, RATIO), dtype=torch.uint8)


CASES = [
    pytest.param(codec, W, n, BLOCK_SIZES[i % 4], id=f"{codec}-W{W}-{n}-B{BLOCK_SIZES[i % 4]}")
    for i, (codec, W, n) in enumerate(itertools.product(CODECS, (1, 2, 3, 5), (0, 33, 257, 4099, 65537)))
]


@pytest.mark.parametrize("codec,W,n,b", CASES)
def test_decode_sum_matches_reference(gen, codec, W, n, b):
    xs, P = _payloads(gen, codec, n, W, b)
    scale = 1.0 if W % 2 else 1.0 / W
    got = flatcomm.decode_sum(P, codec, n, block_size=b, ratio=RATIO, scale=scale)
    assert got.dtype == torch.float32 and got.shape == (n,)
    assert_bits_equal(got, R.decode_sum(P, codec, n, block_size=b, ratio=RATIO, scale=scale))
    # vs the float64 sum of the decoded rows: W - 1 additions and one multiply, each <= 2^-24 relative
    ds = torch.stack([R.decode_f32(P[r], codec, n, block_size=b, ratio=RATIO).double() for r in range(W)])
    exact = ds.sum(0) * scale
    bound = W * 2.0**-24 * ds.abs().sum(0) * abs(scale) + 2.0**-149
    assert ((got.double() - exact).abs() <= bound).all()
    # vs the float64 sum of the inputs, for codecs with a per-element bound
    if codec in ("fp32", "bf16", "fp16", "int8", "int4"):
        eb = torch.stack([R.dequant_error_bound(x, codec, b) for x in xs]).sum(0) * abs(scale)
        truth = torch.stack([x.double() for x in xs]).sum(0) * scale
        assert ((got.double() - truth).abs() <= eb + bound).all()


def test_decode_sum_zero_rows():
    for codec in CODECS:
        P = torch.zeros(0, R.wire_bytes(codec, 100, 64, RATIO), dtype=torch.uint8)
        got = flatcomm.decode_sum(P, codec, 100, block_size=64, ratio=RATIO)
        assert_bits_equal(got, torch.zeros(100))


def test_decode_sum_order_is_ascending_rows():
    # 1e8 + 1 - 1e8 in fp32: ((1e8 + 1) - 1e8) = 0, not 1
    x = torch.tensor([[1e8], [1.0], [-1e8]])
    P = torch.stack([flatcomm.encode(r, "fp32") for r in x])
    assert flatcomm.decode_sum(P, "fp32", 1).item() == 0.0
    P2 = torch.stack([flatcomm.encode(r, "fp32") for r in x[[0, 2, 1]]])
    assert flatcomm.decode_sum(P2, "fp32", 1).item() == 1.0


@pytest.mark.parametrize("codec", ["int8", "topk", "bf16"])
@pytest.mark.parametrize("scale", [0.5, 0.1, 1.0 / 3, 3.0, -2.0])
def test_decode_sum_scale(gen, codec, scale):
    n = 1000
    _, P = _payloads(gen, codec, n, 3, 64)
    got = flatcomm.decode_sum(P, codec, n, block_size=64, ratio=RATIO, scale=scale)
    unscaled = flatcomm.decode_sum(P, codec, n, block_size=64, ratio=RATIO)
    assert_bits_equal(got, unscaled * torch.tensor(scale, dtype=torch.float32), "one multiply by fp32(scale)")
    assert_bits_equal(got, R.decode_sum(P, codec, n, block_size=64, ratio=RATIO, scale=scale))


def test_decode_sum_topk_negative_zero():
    # a kept -0.0 in row 0 is not turned into +0.0 by rows that do not send that index
    x0 = torch.tensor([-0.0, 0.0, 0.0, 0.0])
    x1 = torch.tensor([0.0, 5.0, 0.0, 0.0])
    P = torch.stack([flatcomm.encode(x, "topk", ratio=0.25) for x in (x0, x1)])
    got = flatcomm.decode_sum(P, "topk", 4, ratio=0.25)
    assert_bits_equal(got, R.decode_sum(P, "topk", 4, ratio=0.25))


REENCODE = [
    pytest.param(codec, out, W, n, id=f"{codec}-{out}-W{W}-{n}")
    for (codec, out), W, n in zip(
        itertools.product(CODECS, ("fp32", "bf16", "fp16", "int8", "int4", "sign")),
        itertools.cycle((1, 2, 3, 5)),
        itertools.cycle((33, 4099, 257, 2048, 65537, 1000, 97)),
    )
]


@pytest.mark.parametrize("codec,out,W,n", REENCODE)
def test_decode_sum_reencode_matches_reference(gen, codec, out, W, n):
    b = BLOCK_SIZES[(n + W) % 4]
    ob = BLOCK_SIZES[(n + 2 * W) % 4]
    _, P = _payloads(gen, codec, n, W, b)
    scale = 1.0 / W
    r = torch.randn(n, generator=gen) * 1e-3
    r_ref = r.clone()
    stoch = out in ("int8", "int4", "bf16") and n % 2 == 1
    got = flatcomm.decode_sum(P, codec, n, block_size=b, ratio=RATIO, scale=scale, reencode=out,
                              residual=r, reencode_block_size=ob, stochastic=stoch, seed=n)
    assert got.numel() == R.wire_bytes(out, n, ob)
    summed = R.decode_sum(P, codec, n, block_size=b, ratio=RATIO, scale=scale)
    want = R.encode(summed, out, residual=r_ref, block_size=ob, stochastic=stoch, seed=n)
    assert_bits_equal(got, want, "payload")
    assert_bits_equal(r, r_ref, "residual")


@pytest.mark.parametrize("out", ["int8", "sign", "bf16"])
def test_decode_sum_reencode_equals_unfused(gen, out):
    n = 5000
    _, P = _payloads(gen, "int8", n, 3, 64)
    r1 = torch.randn(n, generator=gen) * 1e-2
    r2 = r1.clone()
    fused = flatcomm.decode_sum(P, "int8", n, block_size=64, scale=0.25, reencode=out, residual=r1,
                                reencode_block_size=32)
    s = flatcomm.decode_sum(P, "int8", n, block_size=64, scale=0.25)
    unfused = flatcomm.encode(s, out, residual=r2, block_size=32)
    assert_bits_equal(fused, unfused)
    assert_bits_equal(r1, r2)


def test_decode_sum_reencode_without_residual(gen):
    n = 777
    _, P = _payloads(gen, "int4", n, 2, 32)
    got = flatcomm.decode_sum(P, "int4", n, block_size=32, reencode="int8")
    assert_bits_equal(got, R.encode(R.decode_sum(P, "int4", n, block_size=32), "int8"))

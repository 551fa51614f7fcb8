"""Self-checks of flatcomm.ops.reference: the oracle's building blocks against independent Python math."""
from __future__ import annotations

import math
import struct
from fractions import Fraction

import pytest
import torch

import flatcomm
from flatcomm.ops import reference as R

from _support.kernels import SIZES, BLOCK_SIZES


def test_splitmix64_tensor_matches_python_ints(gen):
    vals = [0, 1, 2, (1 << 63) - 1, 1 << 63, (1 << 64) - 1, 0x9E3779B97F4A7C15]
    vals += [int(v) & ((1 << 64) - 1) for v in torch.randint(-(1 << 62), 1 << 62, (200,), generator=gen).tolist()]
    t = torch.tensor([R.bits._s64(v) for v in vals], dtype=torch.int64)
    got = [v & ((1 << 64) - 1) for v in R.splitmix64_t(t).tolist()]
    assert got == [R.splitmix64_int(v) for v in vals]


def test_random_u32_matches_python_ints():
    for seed in (0, 1, 12345, (1 << 63) - 1, -1):
        key = R.seed_key(seed & ((1 << 64) - 1))
        idx = torch.tensor([0, 1, 2, 1000, (1 << 32) + 5, (1 << 40) - 1])
        want = [R.splitmix64_int(key + i * 0x9E3779B97F4A7C15) >> 32 for i in idx.tolist()]
        assert R.random_u32(seed & ((1 << 64) - 1), idx).tolist() == want


def test_int64_to_f32_is_correctly_rounded(gen):
    # from_fixed relies on torch's int64 -> fp32 conversion being a single RNE rounding (not via
    # double, which would round twice).
    ms = [(1 << 60) + (1 << 36) + 1, -((1 << 60) + (1 << 36) + 1), (1 << 62), -(1 << 62), 3, 0,
          (1 << 24) + 1, (1 << 24) + 3, (1 << 53) + 1]
    ms += torch.randint(-(1 << 62), 1 << 62, (500,), generator=gen).tolist()
    got = torch.tensor(ms, dtype=torch.int64).to(torch.float32).tolist()
    assert got == [R.round_to_f32(Fraction(m)) for m in ms]


def test_round_to_f32_matches_struct(gen):
    xs = (torch.randn(300, generator=gen, dtype=torch.float64) * torch.exp2(
        torch.randint(-160, 130, (300,), generator=gen).double())).tolist()
    xs += [2.0**-149 * 0.5, 2.0**-149 * 1.5, 2.0**-150 * 3, 3.4028235677973366e38, 3.5e38, -1e-46]
    for x in xs:
        try:
            want = struct.unpack("f", struct.pack("f", x))[0]  # C double -> float cast: RNE
        except OverflowError:
            want = math.copysign(math.inf, x)
        assert R.round_to_f32(Fraction(x)) == want or (want == 0 and R.round_to_f32(Fraction(x)) == 0), x


@pytest.mark.parametrize("codec", R.CODECS)
def test_layout_matches_wire_bytes(codec):
    for n in SIZES:
        for b in BLOCK_SIZES:
            for ratio in (0.01, 0.3, 1.0):
                want = flatcomm.wire_bytes(codec, n, block_size=b, ratio=ratio)
                assert R.wire_bytes(codec, n, b, ratio) == want
                assert want % 16 == 0


def test_bf16_fp16_conversions_match_torch_for_finite(gen):
    x = torch.randn(10000, generator=gen) * torch.exp2(torch.randint(-140, 128, (10000,), generator=gen).float())
    x = torch.cat([x, torch.tensor([0.0, -0.0, 65504.0, 65520.0, 65519.99, 6e-8, 3e-8, 1e-45, 3.4e38])])
    x = x[torch.isfinite(x)]
    assert torch.equal(R.store_as(x, torch.bfloat16).view(torch.int16), x.to(torch.bfloat16).view(torch.int16))
    assert torch.equal(R.store_as(x, torch.float16).view(torch.int16), x.to(torch.float16).view(torch.int16))


def test_exponent_of_abs_bits():
    cases = {0.0: -200, 1.0: 1, 0.75: 0, 2.0: 2, 2.0**-149: -148, 2.0**-126: -125, 3 * 2.0**-149: -147,
             3.4e38: 128, math.inf: 1 << 20, math.nan: 1 << 20}
    v = torch.tensor(list(cases), dtype=torch.float32)
    assert R.exponent_of_abs_bits(R.abs_bits(v)).tolist() == list(cases.values())

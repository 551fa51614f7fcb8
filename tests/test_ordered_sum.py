"""ordered_sum: bitwise equal to a sequential fp32 loop over rows, for fp32/bf16/fp16 rows."""
from __future__ import annotations

import pytest
import torch

import flatcomm
from flatcomm.ops import reference as R

from _support.kernels import DTYPES, assert_bits_equal, make_input


def _loop(x: torch.Tensor) -> torch.Tensor:
    """The plainest possible spec: acc = row0; acc = acc + row_r, one fp32 add at a time."""
    W, n = x.shape
    out = []
    for j in range(n):
        acc = torch.tensor(0.0)
        for r in range(W):
            v = x[r, j].float()
            acc = v.clone() if r == 0 else acc + v
        out.append(acc)
    return torch.stack(out) if out else torch.zeros(0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("W", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("n", [0, 1, 33, 257, 2049, 65537])
def test_ordered_sum_matches_reference(gen, dtype, W, n):
    x = torch.stack([make_input(gen, n, dtype) for _ in range(W)])
    got = flatcomm.ordered_sum(x)
    assert got.dtype == torch.float32 and got.shape == (n,)
    assert_bits_equal(got, R.ordered_sum(x))


@pytest.mark.parametrize("dtype", DTYPES)
def test_ordered_sum_matches_scalar_loop(gen, dtype):
    x = torch.stack([make_input(gen, 40, dtype, kind="mixed") * (10.0 if dtype != torch.float16 else 1.0) for _ in range(4)])
    assert_bits_equal(flatcomm.ordered_sum(x), _loop(x))


def test_ordered_sum_is_order_sensitive():
    x = torch.tensor([[1e8], [1.0], [-1e8]])
    assert flatcomm.ordered_sum(x).item() == 0.0
    assert flatcomm.ordered_sum(x[[0, 2, 1]]).item() == 1.0


def test_ordered_sum_zero_rows_and_nonfinite():
    assert_bits_equal(flatcomm.ordered_sum(torch.zeros(0, 5)), torch.zeros(5))
    x = torch.tensor([[1.0, float("inf"), float("nan"), -0.0], [2.0, 1.0, 1.0, -0.0]])
    got = flatcomm.ordered_sum(x)
    assert got[0] == 3 and torch.isinf(got[1]) and torch.isnan(got[2]) and got[3].signbit()


def test_ordered_sum_thread_independent(restore_threads):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, (1 << 20) + 33, generator=g)
    outs = []
    for t in (1, 2):
        torch.set_num_threads(t)
        outs.append(flatcomm.ordered_sum(x))
    assert_bits_equal(outs[0], outs[1])

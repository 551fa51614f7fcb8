"""flatcomm's kernels under pytest-benchmark: encode with error feedback, decode and decode_sum per codec,
and the ordered and exact sums, at 64K and 1M values.

    make microbench                                   # the table: min, max, mean, median, IQR per op
    .venv/bin/python -m pytest benchmarks/test_microbench.py --benchmark-only --benchmark-autosave
    .venv/bin/python -m pytest benchmarks/test_microbench.py --benchmark-only --benchmark-compare

(autosave / compare keep runs under .benchmarks/ and diff them: a kernel change shows its effect.)
A benchmark whose max / min exceeds flatcomm.tools.bench.kernels.NOISY_SPREAD also warns: other load
disturbed it. Outside tests/ on purpose: ``make test`` does not run it.
"""
from __future__ import annotations

import warnings

import pytest
import torch

import flatcomm
from flatcomm.tools.bench.kernels import NOISY_SPREAD, WORLD

SIZES = {"64K": 1 << 16, "1M": 1 << 20}
CODECS = ("fp32", "bf16", "int8", "int4", "sign")


class NoisyTiming(UserWarning):
    pass


@pytest.fixture
def timed(benchmark):
    def run(fn):
        benchmark(fn)
        stats = getattr(benchmark.stats, "stats", None)  # None under --benchmark-disable
        if stats is not None and stats.min > 0 and stats.max / stats.min > NOISY_SPREAD:
            warnings.warn(f"{benchmark.name}: max/min {stats.max / stats.min:.1f} > {NOISY_SPREAD}: timings "
                          f"disturbed by other load", NoisyTiming)

    return run


@pytest.fixture(params=list(SIZES), scope="module")
def data(request):
    n = SIZES[request.param]
    gen = torch.Generator().manual_seed(n)
    return n, torch.randn(n, generator=gen), torch.randn(n, generator=gen) * 0.01


@pytest.mark.parametrize("codec", CODECS)
def test_encode_ef(timed, data, codec):
    n, x, residual = data
    payload = torch.empty(flatcomm.wire_bytes(codec, n), dtype=torch.uint8)
    timed(lambda: flatcomm.encode(x, codec, residual=residual, out=payload))


@pytest.mark.parametrize("codec", CODECS)
def test_decode(timed, data, codec):
    n, x, _ = data
    payload, out = flatcomm.encode(x, codec), torch.empty(n)
    timed(lambda: flatcomm.decode(payload, codec, n, out=out))


@pytest.mark.parametrize("codec", CODECS)
def test_decode_sum(timed, data, codec):
    n, x, _ = data
    rows, out = flatcomm.encode(x, codec).unsqueeze(0).repeat(WORLD, 1), torch.empty(n)
    timed(lambda: flatcomm.decode_sum(rows, codec, n, out=out))


def test_ordered_sum(timed, data):
    n, x, _ = data
    xs = x.unsqueeze(0).repeat(WORLD, 1)
    timed(lambda: flatcomm.ordered_sum(xs))


def test_exact_sum(timed, data):
    n, x, _ = data
    xs = x.unsqueeze(0).repeat(WORLD, 1)
    timed(lambda: flatcomm.exact_sum(xs))

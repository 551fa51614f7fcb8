"""What rounding to the output dtype drops stays in the residual (all_reduce on bf16/fp16 data).

The invariant (docs/semantics.md, "Error feedback"), for an averaging all-reduce with a residual:

    output + T_new == mean_r(input_r) + T_old

in float64, where ``T`` is what the residuals add to the next step's average: flat,
``scale * sum_r client_r + sum_r server_r``; two-level, ``scale * sum_r (client_r + server_r)`` at
each rank's shard (``flatcomm.hierarchical.shard_range``). It holds up to the fp32 arithmetic of
the sum itself (a few fp32 ulps of the summed magnitudes); the output's rounding to bf16 / fp16 is
~2^-9 / 2^-12 of it and must not be lost. For the lossless codecs: fp32 on bf16/fp16 data (the
issue: its result was rounded and its residual zeroed) and the casts of the data's own dtype
(bf16 on bf16, fp16 on fp16). Flat (world 1 and 2) and two-level (2 nodes x 2 ranks).
On the flat path the fp32 codec is also compared exactly with the same call on fp32 copies of
the data: its output and new residual add up to that result, bit for bit in float64.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import flatcomm as fc
from flatcomm.tools import spawn

CASES = [(torch.bfloat16, "fp32"), (torch.float16, "fp32"), (torch.bfloat16, "bf16"), (torch.float16, "fp16")]
SIZES = (1, 33, 1000, 4099)
CALLS = 3  # the later calls start from the residual the earlier ones left


def _gather(t: torch.Tensor, world: int) -> list:
    out = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(out, t.contiguous())
    return out


def _total(ef, n, world, topo, codec) -> torch.Tensor:
    """T (float64, full size) from every rank's residual."""
    scale = 1.0 / world
    if topo is None:
        return scale * sum(_gather(ef.client.double(), world)) + sum(_gather(ef.server.double(), world))
    lo, hi = fc.hierarchical.shard_range(n, topo, codec)
    mine = torch.zeros(n, dtype=torch.float64)  # this rank's shard, placed (shards differ in size)
    mine[lo:hi] = scale * (ef.client.double() + ef.server.double())
    return sum(_gather(mine, world))


def _inputs(rank, n, dtype, seed):
    g = torch.Generator().manual_seed(seed * 100 + rank)
    x = torch.randn(n, generator=g) * torch.exp2(torch.randint(-10, 11, (n,), generator=g).float())
    x[torch.rand(n, generator=g) < 0.05] = 0.0
    r = torch.randn(n, generator=g) * x.abs() * 2.0 ** -7  # a residual's size: what a codec dropped
    return x.to(dtype), r


def _check(rank, world, dtype, codec, n, topo) -> dict:
    size = n if topo is None else fc.hierarchical.shard_numel(n, topo, codec)
    ef = fc.ErrorFeedback.zeros(size)
    worst, exact, finite = 0.0, True, True
    for call in range(CALLS):
        x, r = _inputs(rank, n, dtype, call)
        lo, hi = (0, n) if topo is None else fc.hierarchical.shard_range(n, topo, codec)
        ef.client.add_(r[lo:hi])  # a residual that is there before the call
        t_old = _total(ef, n, world, topo, codec)
        t_mag = _total(fc.ErrorFeedback(ef.client.abs(), ef.server.abs()), n, world, topo, codec)
        want = sum(xs.double() for xs in _gather(x.double(), world)) / world + t_old
        ref_x, ref_ef = x.float(), fc.ErrorFeedback(ef.client.clone(), ef.server.clone())
        y = x.clone()
        kw = {"topology": topo} if topo is not None else {}
        fc.all_reduce(y, codec=codec, op="avg", residual=ef, **kw)
        got = y.double() + _total(ef, n, world, topo, codec)
        # the fp32 arithmetic of the sums: a few ulps of every magnitude that went in (each rank's
        # residual by itself: ranks' residuals that cancel in T were still added in fp32)
        mags = sum(v.double().abs() for v in _gather(x.double(), world)) / world + t_mag + y.double().abs()
        bound = 2.0 ** -21 * mags
        worst = max(worst, float(((got - want).abs() - bound).max()) if n else 0.0)
        finite = finite and bool(torch.isfinite(ef.client).all() and torch.isfinite(ef.server).all())
        if topo is None and codec == "fp32":
            fc.all_reduce(ref_x, codec="fp32", op="avg", residual=ref_ef)
            exact = exact and torch.equal(got, ref_x.double() + _total(ref_ef, n, world, None, codec))
    return {"excess": worst, "exact": exact, "finite": finite}


def _w(rank, world, two_level):
    topo = fc.Topology(local_size=2) if two_level else None
    return {(str(dtype), codec, n): _check(rank, world, dtype, codec, n, topo)
            for dtype, codec in CASES for n in SIZES}


def _w_overflow(rank, world):
    """fp16 data whose sum overflows: the output is inf (the overflow's signal), the residual stays finite."""
    x = torch.full((64,), 60000.0, dtype=torch.float16)
    ef = fc.ErrorFeedback.zeros(64)
    fc.all_reduce(x, codec="fp32", op="sum", residual=ef)
    return bool(torch.isinf(x).all()), bool(torch.isfinite(ef.client).all() and torch.isfinite(ef.server).all())


@pytest.fixture(scope="module")
def ranks():
    return {"world 1": spawn.run(1, _w, False, timeout_s=120), "world 2": spawn.run(2, _w, False, timeout_s=120),
            "two-level 2x2": spawn.run(4, _w, True, timeout_s=180)}


@pytest.mark.parametrize("where", ["world 1", "world 2", "two-level 2x2"])
@pytest.mark.parametrize("dtype,codec", [(str(d), c) for d, c in CASES])
def test_output_plus_residual_is_input_plus_residual(ranks, where, dtype, codec):
    for r in ranks[where]:
        for n in SIZES:
            got = r[dtype, codec, n]
            assert got["finite"], (where, dtype, codec, n)
            assert got["excess"] <= 0.0, f"{where} {dtype} {codec} n={n}: the residual lost {got['excess']:.3g} " \
                                         "beyond the fp32 sum's rounding"
            assert got["exact"], f"{where} {dtype} {codec} n={n}: not the fp32 call's result bit for bit"


def test_overflow_keeps_the_residual_finite():
    for inf, finite in spawn.run(2, _w_overflow, timeout_s=60):
        assert inf and finite

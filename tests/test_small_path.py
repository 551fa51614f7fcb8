"""Small collectives in one exchange (flatcomm.comm.small): the data rides in the call header's
payload slot. The results must be the large path's bits, for every dtype, odd sizes, zeros,
huge values, inf/NaN, both modes, sum and avg, 2 and 3 ranks; a rank on the small path and one
on the large path must both raise the header's named error; the small path must really be taken
(one exchange, no point-to-point transfer)."""
from __future__ import annotations

import pytest
import torch

from flatcomm.tools import spawn

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
SIZES = (1, 3, 7, 33, 1000, 4093, 30001)  # 30001: over the slot, the two-exchange path


def _inputs(rank: int, n: int, dtype: torch.dtype, kind: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + n)
    spread = 20 if kind != "narrow" else 6  # narrow: within exact mode's 27 binades of a block's bound
    x = torch.randn(n, generator=g) * torch.exp2(torch.randint(-spread, spread, (n,), generator=g).float())
    if kind == "zeros":
        x.zero_()
    elif kind == "huge":  # sums that overflow the dtype
        x = torch.full((n,), torch.finfo(dtype).max * (0.75 if rank % 2 == 0 else 0.5))
    elif kind == "nonfinite":
        x[::5] = float("inf") if rank == 0 else 1.0
        x[1::7] = float("nan")
        x[2::11] = -float("inf")
    return x.to(dtype)


CASES = [(dt, n, kind) for dt in DTYPES for n in SIZES for kind in ("random",)] + \
        [(dt, 33, kind) for dt in DTYPES for kind in ("zeros", "huge", "nonfinite")]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32).clone()


def _run_all(rank: int, world: int, mode: str) -> dict:
    """Every case's all-reduce (sum, avg) and reduce-scatter results (as bits)."""
    import flatcomm

    out = {}
    for dt, n, kind in CASES:
        for op in ("sum", "avg"):
            x = _inputs(rank, n, dt, kind)
            flatcomm.all_reduce(x, op=op, mode=mode, codec="fp32" if mode == "exact" else
                                {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[dt])
            out[("all_reduce", dt, n, kind, op)] = _bits(x)
        src = torch.cat([_inputs(rank, n, dt, kind) for _ in range(world)])
        dst = torch.empty(n, dtype=dt)
        flatcomm.reduce_scatter(dst, src, op="sum", mode=mode, codec="fp32")
        out[("reduce_scatter", dt, n, kind, "sum")] = _bits(dst)
    return out


def _small_vs_large(rank: int, world: int, mode: str) -> dict:
    from flatcomm.comm import header, small

    taken = []

    class Spy(small.Posted):  # counts the calls that took the slot (this process only)
        def __init__(self, *args, **kwargs):
            taken.append("slot")
            super().__init__(*args, **kwargs)

    small.Posted = Spy
    gathered = small._gathered
    small._gathered = lambda *args: taken.append("gathered") or gathered(*args)  # the two-exchange path
    fast = _run_all(rank, world, mode)
    calls = list(taken)
    header.SLOT_MAX_BYTES = 0  # every rank: no slot and no gathering, so every call takes the large path
    small.GATHER_TABLE_BYTES = 0
    slow = _run_all(rank, world, mode)
    return {"fast": fast, "slow": slow, "slot_calls": calls.count("slot"), "gathered_calls": calls.count("gathered"),
            "large_calls": len(taken) - len(calls)}


# The slot rides in the call headers of the flatcomm backend's groups only; on gloo's a small call
# gathers its payloads after the header (two exchanges). Both paths, both modes, 2 and 3 ranks.
@pytest.fixture(scope="module", params=[(2, "ordered", "flatcomm"), (2, "exact", "gloo"), (3, "ordered", "gloo"),
                                        (3, "exact", "flatcomm")], ids=lambda p: f"{p[0]}ranks-{p[1]}-{p[2]}")
def results(request):
    world, mode, backend = request.param
    return world, backend, spawn.run(world, _small_vs_large, mode, timeout_s=60, backend=backend)


def test_small_path_is_taken_for_every_case(results):
    world, backend, res = results
    over_slot = sum(1 for dt, n, _ in CASES if n * dt.itemsize > 16 << 10)  # 30001 values
    for r in res:
        assert r["slot_calls"] + r["gathered_calls"] == len(CASES) * 3, r  # 2 all-reduces + 1 reduce-scatter per case
        assert r["large_calls"] == 0
        if backend == "flatcomm":  # (the reduce-scatter's payload is every rank's shards: world times n)
            assert r["gathered_calls"] >= 3 * over_slot and r["slot_calls"] > 0, r
        else:
            assert r["slot_calls"] == 0, r


def test_small_path_gives_the_large_paths_bits(results):
    world, backend, res = results
    for r in res:
        assert r["fast"].keys() == r["slow"].keys()
        for key, bits in r["fast"].items():
            assert torch.equal(bits, r["slow"][key]), (world, key, bits[:8], r["slow"][key][:8])
    for key in res[0]["fast"]:  # and every rank holds the same all-reduce result
        if key[0] == "all_reduce":
            assert all(torch.equal(r["fast"][key], res[0]["fast"][key]) for r in res), key


def _two_rank_sum(rank: int, world: int, mode: str) -> list:
    import flatcomm

    outs = []
    for dt in DTYPES:
        x = _inputs(rank, 4093, dt, "narrow")
        flatcomm.all_reduce(x, op="sum", mode=mode, codec="fp32")
        outs.append(x)
    return outs


@pytest.mark.parametrize("mode", ["ordered", "exact"])
def test_small_path_sum_is_the_float64_sum_rounded_once(mode):
    """Two finite values: the fp32 sum is the correctly rounded one, so both modes give the float64
    sum rounded once to fp32, then to the tensor's dtype (a reference, not the path itself)."""
    got = spawn.run(2, _two_rank_sum, mode, timeout_s=60)
    for i, dt in enumerate(DTYPES):
        ref = (_inputs(0, 4093, dt, "narrow").double() + _inputs(1, 4093, dt, "narrow").double()).float().to(dt)
        assert torch.equal(_bits(got[0][i]), _bits(ref)), dt
        assert torch.equal(_bits(got[1][i]), _bits(ref)), dt


def _small_meets_large(rank: int, world: int) -> list:
    import flatcomm

    seen = []
    for n in ((10, 100_000), (100_000, 10)):
        try:
            flatcomm.all_reduce(torch.ones(n[rank]), op="sum")
            seen.append(None)
        except ValueError as e:
            seen.append(str(e))
    flatcomm.all_reduce(x := torch.ones(5), op="sum")  # the group is still in step
    seen.append(x.tolist())
    return seen


@pytest.mark.parametrize("backend", ["flatcomm", "gloo"])
def test_small_and_large_ranks_both_raise_the_named_error(backend):
    for r in spawn.run(2, _small_meets_large, timeout_s=30, backend=backend):
        assert r[0] is not None and "disagree on numel: rank 0 10, rank 1 100000" in r[0], r[0]
        assert r[1] is not None and "disagree on numel: rank 0 100000, rank 1 10" in r[1], r[1]
        assert r[2] == [2.0] * 5

"""Ranks of a flatcomm group that disagree on a reduction (float vs integer dtype, the op, the size)
get the call header's named error on every rank at once, not a wait for the group's timeout: the
reductions the backend passes through to gloo are checked by a call header too
(flatcomm.backend.reduce.guard), on the same private group as flatcomm's own sums."""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from flatcomm.tools import spawn

TIMEOUT_S = 60  # the group's: a mismatch must be named long before it


def _caught(fn) -> object:
    t0 = time.monotonic()
    try:
        fn()
        return None
    except Exception as e:  # noqa: BLE001 - the probe reports it
        return type(e).__name__, str(e), time.monotonic() - t0


def _mismatches(rank: int, world: int) -> dict:
    other = rank == 1
    res = {
        "float_vs_int": _caught(lambda: dist.all_reduce(torch.ones(6, dtype=torch.int64) if other else torch.ones(6))),
        "int_vs_float": _caught(lambda: dist.all_reduce(torch.ones(6) if other else torch.ones(6, dtype=torch.int32))),
        "big_float_vs_int": _caught(lambda: dist.all_reduce(
            torch.ones(100_000, dtype=torch.int64) if other else torch.ones(100_000))),
        "sum_vs_max": _caught(lambda: dist.all_reduce(torch.ones(6), op=dist.ReduceOp.MAX if other else dist.ReduceOp.SUM)),
        "int_sizes": _caught(lambda: dist.all_reduce(torch.ones(7 if other else 5, dtype=torch.int64),
                                                     op=dist.ReduceOp.MAX)),
        "reduce_scatter": _caught(lambda: dist.reduce_scatter_tensor(
            torch.empty(3, dtype=torch.int64 if other else torch.float32),
            torch.ones(3 * world, dtype=torch.int64 if other else torch.float32))),
    }
    ints = torch.tensor([rank + 1, 10 * rank], dtype=torch.int64)  # the group is still in step, and right
    dist.all_reduce(ints)
    floats = torch.full((3,), float(rank + 1))
    dist.all_reduce(floats)
    top = torch.tensor([rank], dtype=torch.int32)
    dist.all_reduce(top, op=dist.ReduceOp.MAX)
    res["after"] = (ints.tolist(), floats.tolist(), top.tolist())
    return res


def test_disagreeing_ranks_get_the_named_error_at_once():
    res = spawn.run(2, _mismatches, backend="flatcomm", timeout_s=TIMEOUT_S, run_s=TIMEOUT_S)
    expect = {"float_vs_int": ["disagree on dtype: rank 0 torch.float32, rank 1 torch.int64"],
              "int_vs_float": ["disagree on dtype: rank 0 torch.int32, rank 1 torch.float32"],
              "big_float_vs_int": ["disagree on dtype: rank 0 torch.float32, rank 1 torch.int64"],
              "sum_vs_max": ["disagree on reduce op: rank 0 a flatcomm sum, rank 1 MAX"],
              "int_sizes": ["disagree on numel: rank 0 5, rank 1 7"],
              "reduce_scatter": ["disagree on dtype: rank 0 torch.float32, rank 1 torch.int64"]}
    for r in res:
        for case, parts in expect.items():
            got = r[case]
            assert got is not None, f"{case}: no error"
            kind, msg, took = got
            assert kind == "ValueError", (case, got)
            for part in parts:
                assert part in msg, (case, msg)
            assert took < TIMEOUT_S / 4, (case, took)  # named at once, not at the timeout
        assert r["after"] == ([3, 10], [3.0, 3.0, 3.0], [1])

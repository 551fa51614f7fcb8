"""The small path's all-reduce in C++ (flatcomm/comm/small_native.py, csrc/comm/slot_all_reduce.cpp),
what the flatcomm backend's small float sums take: ordered and exact, on fp32, bf16 and fp16. What
must hold:

* it is taken (a C++ ``dist.Work``), with the Python small path's bits (flatcomm.all_reduce on the
  same group: decode_sum's order; exact_sum), for odd sizes, zeros, huge values, inf/NaN, sum and
  avg, 2 and 3 ranks; its ``get_future()`` completes with the tensor; sums of finite values are
  near a float64 reference;
* ranks whose calls disagree (another size on the slot, a call of the lane, an integer reduction,
  another op) all raise the same named error at once, and the group's next calls are right.
"""
from __future__ import annotations

import time

import pytest
import torch

from flatcomm.tools import spawn

TIMEOUT_S = 60.0
SIZES = (1, 3, 7, 33, 1024, 4093)
KINDS = ("random", "zeros", "huge", "nonfinite")


def _inputs(rank: int, n: int, kind: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + n)
    x = torch.randn(n, generator=g) * torch.exp2(torch.randint(-20, 20, (n,), generator=g).float())
    if kind == "zeros":
        x.zero_()
    elif kind == "huge":  # sums that overflow
        x = torch.full((n,), torch.finfo(torch.float32).max * (0.75 if rank % 2 == 0 else 0.5))
    elif kind == "nonfinite":
        x[::5] = float("inf") if rank == 0 else 1.0
        x[1::7] = float("nan")
        x[2::11] = -float("inf")
    return x


def _near_reference(got: torch.Tensor, rank_inputs: list, op: str, world: int) -> bool:
    """Finite inputs' sum (or average) against float64's, rounded to the result's dtype."""
    if not all(bool(x.isfinite().all()) for x in rank_inputs):
        return True
    ref = sum(x.double() for x in rank_inputs) / (world if op == "avg" else 1)
    return bool(torch.allclose(got.double(), ref.to(got.dtype).double(), rtol=1e-2, atol=1e-30))


_CODECS = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def _compare(rank: int, world: int, mode: str) -> dict:
    """Each case on the backend (the native call) and through flatcomm.all_reduce on the same group
    (the Python small path: ordered with the dtype's own codec, or exact)."""
    import torch.distributed as dist

    import flatcomm
    import flatcomm.backend as fb

    fb.configure(mode=mode)
    out = {}
    for dtype, codec in _CODECS.items():
        how = {"mode": "exact"} if mode == "exact" else {"codec": codec}
        for n in SIZES:
            for kind in KINDS:
                for op, dist_op in (("sum", dist.ReduceOp.SUM), ("avg", dist.ReduceOp.AVG)):
                    native = _inputs(rank, n, kind).to(dtype)
                    work = dist.all_reduce(native, op=dist_op, async_op=True)
                    got = work.get_future().wait()[0]
                    python = _inputs(rank, n, kind).to(dtype)
                    flatcomm.all_reduce(python, op=op, **how)
                    # (exact mode keeps 62 - headroom bits below each block's largest value; a
                    # block with a non-finite value is NaN, so fp16's overflows are left out)
                    near = kind != "random" or _near_reference(
                        native, [_inputs(r, n, kind).to(dtype) for r in range(world)], op, world)
                    out[(str(dtype), n, kind, op)] = (type(work).__name__, got is native, near,
                                                      torch.equal(native.view(torch.uint8), python.view(torch.uint8)))
    return out


@pytest.mark.parametrize("mode", ["ordered", "exact"])
@pytest.mark.parametrize("world", [2, 3])
def test_native_small_all_reduce_has_the_python_paths_bits(world, mode):
    for res in spawn.run(world, _compare, mode, backend="flatcomm", timeout_s=TIMEOUT_S):
        for case, (kind, same_tensor, near, same_bits) in res.items():
            assert kind == "Work" and same_tensor and near and same_bits, (case, kind, same_tensor, near, same_bits)


def _disagree(rank: int, world: int, case: str) -> dict:
    import torch.distributed as dist

    big = 1_200_096  # native at 2 and 3 ranks: its second call runs on the lane
    for seed in (0, 1):
        dist.all_reduce(_inputs(rank, big, "random"))
    t0 = time.monotonic()
    err = None
    try:
        if rank == 0 or case == "same":
            dist.all_reduce(_inputs(rank, 1024, "random"))
        elif case == "size":
            dist.all_reduce(_inputs(rank, 1000, "random"))
        elif case == "lane":
            dist.all_reduce(_inputs(rank, big, "random"))  # early on the lane
        elif case == "integer":
            dist.all_reduce(torch.ones(1024, dtype=torch.int64))
        elif case == "op":
            dist.all_reduce(_inputs(rank, 1024, "random"), op=dist.ReduceOp.MAX)
    except (RuntimeError, ValueError, TypeError) as e:
        err = f"{type(e).__name__}: {e}"
    elapsed = time.monotonic() - t0
    right = []
    for k in range(3):
        t = _inputs(rank, 33, "random") * (k + 1)
        ref = _inputs(0, 33, "random") * (k + 1)
        for r in range(1, world):
            ref += _inputs(r, 33, "random") * (k + 1)
        dist.all_reduce(t)
        right.append(torch.equal(t, ref))
    return {"err": err, "s": elapsed, "right": right}


@pytest.mark.parametrize("world,case,says", [
    (2, "size", "ValueError: flatcomm: ranks disagree on numel"),
    (2, "lane", "ValueError: flatcomm: ranks disagree on numel"),
    (2, "integer", "ValueError: flatcomm: ranks disagree on"),
    (2, "op", "ValueError: flatcomm: ranks disagree on"),
    (3, "size", "ValueError: flatcomm: ranks disagree on numel"),
])
def test_disagreeing_native_small_calls_raise_everywhere_and_the_group_goes_on(world, case, says):
    res = spawn.run(world, _disagree, case, backend="flatcomm", timeout_s=TIMEOUT_S)
    errors = {r["err"] for r in res}
    assert len(errors) == 1 and None not in errors, errors
    assert errors.pop().startswith(says)
    for r in res:
        assert r["s"] < TIMEOUT_S / 3, r["s"]
        assert r["right"] == [True] * 3


def test_agreeing_native_small_calls_raise_nothing():
    for r in spawn.run(2, _disagree, "same", backend="flatcomm", timeout_s=TIMEOUT_S):
        assert r["err"] is None and r["right"] == [True] * 3


def _late_peer(rank: int, world: int) -> tuple:
    import datetime

    import torch.distributed as dist

    dist.all_reduce(torch.ones(16))  # prepared: the next call is native
    t = torch.full((16,), float(rank + 1))
    if rank == 1:
        time.sleep(1.0)
    work = dist.all_reduce(t, async_op=True)
    early = None
    if rank == 0:
        try:
            work.wait(datetime.timedelta(seconds=0.2))
        except RuntimeError as e:
            early = str(e)
    work.wait()  # the peer joined: done
    return type(work).__name__, early, t.tolist()


def test_a_native_calls_wait_with_a_timeout_names_it_and_the_call_stays_in_flight():
    (r0, r1) = spawn.run(2, _late_peer, backend="flatcomm", timeout_s=TIMEOUT_S)
    assert r0[0] == r1[0] == "Work"
    assert r0[1] is not None and "did not finish within 200 ms (still in flight" in r0[1], r0[1]
    assert r0[2] == r1[2] == [3.0] * 16

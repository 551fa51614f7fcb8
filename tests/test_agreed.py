"""Agreed plans (flatcomm/comm/agreed.py): a lossless fp32 all-reduce the ranks agreed on once runs
its next calls before its header is checked. What must hold:

* it does run early (from the second call of a signature on), with the fixed-order sum's bits;
* when the ranks' calls then disagree, in any way (two early calls of different sizes or chunk
  counts, an early call against a call on no plan, a small call, another collective, a rank whose
  arguments were rejected, 3 ranks with two plans), every rank raises the header's named error at
  once (well before the group's timeout), no process dies, and the group's next calls are right
  again and still early (the plans survive a failed check);
* ranks whose plans drifted apart (one forgot them) get a named error, then start over together.
"""
from __future__ import annotations

import time

import pytest
import torch

from flatcomm.tools import spawn

TIMEOUT_S = 60.0
N1, N2 = 1_200_096, 600_032  # two signatures, each native at 2 and 3 ranks (16-byte pieces)


def _values(rank: int, n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(1000 * seed + rank))


def _ordered_sum(world: int, n: int, seed: int) -> torch.Tensor:
    """The fixed-order fp32 sum of every rank's values (rank 0 first), as every rank must hold it."""
    acc = _values(0, n, seed).clone()
    for r in range(1, world):
        acc += _values(r, n, seed)
    return acc


def _early_calls():
    """Counts the calls that ran early: their native op ran while the header was unchecked."""
    import flatcomm.comm.pipeline as P

    seen = []
    real = P.Pipeline.__init__

    def init(self, *a, **k):
        real(self, *a, **k)
        seen.append(self.early)

    P.Pipeline.__init__ = init
    return seen


def _right_again(rank: int, world: int, seed: int, seen: list, dropped: bool = False) -> bool:
    """Three agreeing calls after the failure: right sums, all early (the ranks' plans survive a
    failed check), or the later ones early again when the plans were ``dropped`` (drifted)."""
    import flatcomm.collectives as C

    before = len(seen)
    for k in range(3):
        t = _values(rank, N1, seed + k)
        C.all_reduce(t, op="sum")
        if not torch.equal(t, _ordered_sum(world, N1, seed + k)):
            return False
    # Dropped plans: the first call agrees N1's anew, the next ones run early.
    return seen[before:] == [not dropped, True, True]


def _disagree(rank: int, world: int, case: str) -> dict:
    import flatcomm.collectives as C

    seen = _early_calls()
    for k in range(2):  # N1, N2 and N1 in 3 chunks become plans
        for n, chunks in ((N1, None), (N2, None), (N1, 3)):
            C.all_reduce(_values(rank, n, k), op="sum", chunks=chunks)
    early_before = seen[-3:] == [True, True, True]

    t0 = time.monotonic()
    try:
        if rank == 0 or case == "same" or (case == "3 ranks" and rank == 1):
            C.all_reduce(_values(rank, N1, 7), op="sum")  # early on N1's plan
        elif case in ("two plans", "3 ranks"):
            C.all_reduce(_values(rank, N2, 7), op="sum")  # early on N2's plan
        elif case == "chunks":
            C.all_reduce(_values(rank, N1, 7), op="sum", chunks=3)  # early on the 3-chunk plan
        elif case == "no plan":
            C.all_reduce(_values(rank, 333_344, 7), op="sum")  # a size never agreed: checks first
        elif case == "small":
            C.all_reduce(_values(rank, 100, 7), op="sum")  # the data rides in the header
        elif case == "reduce_scatter":
            C.reduce_scatter(torch.empty(N1 // world), _values(rank, N1, 7), op="sum")
        elif case == "rejected":
            C.all_reduce(torch.zeros(N1, dtype=torch.int32), op="sum")  # rejected: fails in step
        err = None
    except (RuntimeError, ValueError, TypeError) as e:
        err = f"{type(e).__name__}: {e}"
    return {"err": err, "s": time.monotonic() - t0, "early_before": early_before,
            "right_again": _right_again(rank, world, 20, seen)}


@pytest.mark.parametrize("world,case,says", [
    (2, "two plans", "numel"),
    (2, "chunks", "chunks"),
    (2, "no plan", "numel"),
    (2, "small", "numel"),
    (2, "reduce_scatter", "collective"),
    (2, "rejected", "rank 1 failed"),
    (3, "3 ranks", "numel"),
])
def test_a_disagreeing_call_after_early_ones_raises_everywhere_and_the_group_recovers(world, case, says):
    res = spawn.run(world, _disagree, case, timeout_s=TIMEOUT_S)
    errors = {r["err"] for r in res}
    assert len(errors) == 1 and None not in errors, errors  # the same error on every rank
    assert says in errors.pop()
    for r in res:
        assert r["early_before"]  # the agreed calls had run early
        assert r["s"] < TIMEOUT_S / 3, r["s"]  # named at once, not after the group's timeout
        assert r["right_again"]


def test_agreeing_calls_run_early_with_the_fixed_order_sums_bits():
    (a, b) = spawn.run(2, _disagree, "same", timeout_s=TIMEOUT_S)
    for r in (a, b):
        assert r["err"] is None and r["early_before"] and r["right_again"]


def _drifted(rank: int, world: int) -> dict:
    import flatcomm.collectives as C
    import flatcomm.comm.agreed as A
    from flatcomm.comm import groups

    seen = _early_calls()
    for k in range(2):
        C.all_reduce(_values(rank, N1, k), op="sum")
    if rank == 1:  # as if this rank had missed the table that agreed the plan
        A.forget(groups.private_group(None))
    try:
        C.all_reduce(_values(rank, N1, 5), op="sum")
        err = None
    except (RuntimeError, ValueError) as e:
        err = str(e)
    return {"err": err, "right_again": _right_again(rank, world, 30, seen, dropped=True)}


def test_ranks_whose_plans_drifted_apart_are_told_and_start_over():
    a, b = spawn.run(2, _drifted, timeout_s=TIMEOUT_S)
    assert a["err"] is not None and a["err"] == b["err"] and "agreed plans" in a["err"], (a["err"], b["err"])
    assert a["right_again"] and b["right_again"]


def test_a_plans_header_ids_are_the_headers_own():
    """agreed.py names what a plan is by the header's ids (it sits below flatcomm.comm.header)."""
    import flatcomm.comm.agreed as A
    from flatcomm.comm import header as H

    assert A._ALL_REDUCE == H.KIND_IDS["all_reduce"] and A._FP32 == H.DTYPES.index(torch.float32)
    assert A._MODES == (H.MODES.index("ordered"), H.MODES.index("exact")) and A._CPU == H.DEVICE_TYPES.index("cpu")
    assert A._FP32_CODEC == H.CODECS.index("fp32")


def _queued_after_a_mismatch(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from flatcomm.comm import agreed, groups

    for _ in range(2):  # N1 and N2 become plans: their next calls run on the native lane, early
        for n in (N1, N2):
            dist.all_reduce(torch.ones(n))
    plans = agreed.count(groups.private_group(dist.group.WORLD))
    # The mismatch: rank 0 on N1's plan, the others on N2's. Rank 0 (late) settles it before it
    # posts the next calls; the others post theirs behind it at once, before the mismatch is known.
    if rank == 0:
        time.sleep(0.3)
    w = dist.all_reduce(_values(rank, N1 if rank == 0 else N2, 40), async_op=True)
    errors = []
    if rank == 0:
        try:
            w.wait()
        except Exception as e:  # noqa: BLE001 - reported
            errors.append(str(e).splitlines()[0])
    tensors = [_values(rank, N1, 41 + k) for k in range(3)]
    works = [dist.all_reduce(t, async_op=True) for t in tensors]
    if rank != 0:
        try:
            w.wait()
        except Exception as e:  # noqa: BLE001 - reported
            errors.append(str(e).splitlines()[0])
    queued = []
    for k, (t, wk) in enumerate(zip(tensors, works)):
        try:
            wk.wait()
            queued.append(bool(torch.equal(t, _ordered_sum(world, N1, 41 + k))))
        except Exception as e:  # noqa: BLE001 - reported
            queued.append(str(e).splitlines()[0])
    return {"plans": plans, "errors": errors, "queued": queued}


@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [2, 3])
def test_correct_calls_queued_behind_a_mismatch_succeed(world):
    """Once, the plans were dropped at every failed check: a rank that settled the mismatch before
    posting its next call posted it on no plan, its peer on the plan, and that correct call failed
    with "ranks disagree on agreed plans"."""
    res = spawn.run(world, _queued_after_a_mismatch, timeout_s=TIMEOUT_S, backend="flatcomm")
    for r in res:
        assert r["plans"] >= 2
        assert len(r["errors"]) == 1 and "numel" in r["errors"][0], r["errors"]
        assert r["queued"] == [True, True, True], r["queued"]

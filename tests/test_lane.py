"""The native lane (flatcomm/comm/lane.py, csrc/comm/lane.cpp): the flatcomm backend's agreed
all-reduces run in C++ and return a C++ ``dist.Work``. What must hold:

* an agreed all-reduce does run there (from its second call on), with the fixed-order sum's bits;
* lane calls and calls on the group's Python worker, posted without waiting, complete in call order
  with the right sums (the worker drains the lane first);
* when the ranks' calls then disagree (two lane calls of different sizes, a lane call against a call
  on no plan, a small call, an integer reduction, 3 ranks), every rank raises the same named error
  at once, no process dies, and the group's next calls are right and on the lane again.
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
    acc = _values(0, n, seed).clone()
    for r in range(1, world):
        acc += _values(r, n, seed)
    return acc


def _lane_done() -> int:
    import torch.distributed as dist

    from flatcomm.comm import groups, worker
    from flatcomm.ops.native import extension

    return extension.lane_completed(worker.key_of(groups.private_group(dist.group.WORLD)))


def _reduced(rank: int, world: int, n: int, seed: int) -> tuple:
    """(bits right, whether it ran on the lane)."""
    import torch.distributed as dist

    t = _values(rank, n, seed)
    before = _lane_done()
    work = dist.all_reduce(t, async_op=True)
    work.wait()
    return torch.equal(t, _ordered_sum(world, n, seed)), _lane_done() == before + 1


def _disagree(rank: int, world: int, case: str) -> dict:
    import torch.distributed as dist

    firsts = [_reduced(rank, world, n, 0) for n in (N1, N2)]  # agreed: plans from now on
    seconds = [_reduced(rank, world, n, 1) for n in (N1, N2)]
    t0 = time.monotonic()
    err = None
    try:
        if rank == 0 or case == "same" or (case == "3 ranks" and rank == 1):
            dist.all_reduce(_values(rank, N1, 7))  # on the lane, N1's plan
        elif case in ("two plans", "3 ranks"):
            dist.all_reduce(_values(rank, N2, 7))  # on the lane, N2's plan
        elif case == "no plan":
            dist.all_reduce(_values(rank, 333_344, 7))  # never agreed: the worker, checked first
        elif case == "small":
            dist.all_reduce(_values(rank, 100, 7))  # the data rides in the header
        elif case == "integer":
            dist.all_reduce(torch.ones(N1, dtype=torch.int64))  # passed through, its header checked
    except (RuntimeError, ValueError, TypeError) as e:
        err = f"{type(e).__name__}: {e}"
    elapsed = time.monotonic() - t0
    again = [_reduced(rank, world, N1, 20 + k) for k in range(3)]  # agreed anew, then the lane
    return {"err": err, "s": elapsed, "firsts": firsts, "seconds": seconds, "again": again}


@pytest.mark.parametrize("world,case,says", [
    (2, "two plans", "numel"),
    (2, "no plan", "numel"),
    (2, "small", "numel"),
    (2, "integer", ""),
    (3, "3 ranks", "numel"),
])
def test_a_disagreeing_call_after_lane_calls_raises_everywhere_and_the_group_recovers(world, case, says):
    res = spawn.run(world, _disagree, case, backend="flatcomm", timeout_s=TIMEOUT_S)
    errors = {r["err"] for r in res}
    assert len(errors) == 1 and None not in errors, errors  # the same error on every rank
    assert says in errors.pop()
    for r in res:
        assert r["firsts"] == [(True, False)] * 2  # the first call of a size agrees it: the worker
        assert r["seconds"] == [(True, True)] * 2  # then the lane, with the fixed-order sum's bits
        assert r["s"] < TIMEOUT_S / 3, r["s"]  # named at once, not after the group's timeout
        assert r["again"] == [(True, True)] * 3  # every rank read the same table: the plans stay


def test_agreeing_lane_calls_keep_the_fixed_order_sums_bits():
    for r in spawn.run(2, _disagree, "same", backend="flatcomm", timeout_s=TIMEOUT_S):
        assert r["err"] is None and r["seconds"] == [(True, True)] * 2
        assert r["again"] == [(True, True)] * 3  # nothing failed: N1 stays a plan


def _interleaved(rank: int, world: int) -> list:
    """Lane calls and worker calls posted without waiting, then waited for: all right."""
    import torch.distributed as dist

    for seed in (0, 1):
        for n in (N1, N2):
            dist.all_reduce(_values(rank, n, seed))
    posted = []
    for k in range(3):
        for n in (N1, 333_344, N2, 100, N1):  # lane, worker, lane, header slot, lane
            t = _values(rank, n, 10 * k + n % 7)
            posted.append((t, n, 10 * k + n % 7, dist.all_reduce(t, async_op=True)))
        out = torch.empty(N1 // world)
        posted.append((out, -1, 0, dist.reduce_scatter_single(out, _values(rank, N1, 99), async_op=True)))
    right = []
    for t, n, seed, work in posted:
        work.wait()
        if n > 0:
            right.append(torch.equal(t, _ordered_sum(world, n, seed)))
        else:  # the reduce-scatter's shard of the fixed-order sum
            right.append(torch.equal(t, _ordered_sum(world, N1, 99).chunk(world)[rank]))
    return right + [_lane_done() >= 1]  # (a call finding the worker busy queues there)


@pytest.mark.parametrize("world", [2, 3])
def test_lane_calls_and_worker_calls_posted_together_all_complete_right(world):
    for r in spawn.run(world, _interleaved, backend="flatcomm", timeout_s=TIMEOUT_S):
        assert all(r), [i for i, ok in enumerate(r) if not ok]


def _ddp_failure(rank: int, world: int) -> dict:
    """DDP's buckets on the lane; then rank 0's bucket meets rank 1's call of another size."""
    import torch.distributed as dist

    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(1024, 1024))  # one native bucket
    x = torch.randn(4, 1024, generator=torch.Generator().manual_seed(rank))

    def step():
        model.zero_grad()
        model(x).square().mean().backward()
        return model.module.weight.grad.clone()

    before = _lane_done()
    step(), step()
    on_lane = _lane_done() - before
    err = None
    try:
        if rank == 0:
            step()
        else:
            dist.all_reduce(_values(rank, 333_344, 7))
    except (RuntimeError, ValueError, TypeError) as e:
        err = f"{type(e).__name__}: {e}"
    grads = [step() for _ in range(3)]
    ref = torch.nn.Linear(1024, 1024)
    ref.load_state_dict(model.module.state_dict())
    both = torch.cat([torch.randn(4, 1024, generator=torch.Generator().manual_seed(r)) for r in range(world)])
    ref(both).square().sum().div(4 * 1024).backward()  # each rank's mean loss, averaged over ranks
    return {"on_lane": on_lane, "err": err, "grads": grads, "ref": ref.weight.grad / world}


def test_a_failed_lane_call_inside_ddps_backward_raises_and_ddp_goes_on():
    res = spawn.run(2, _ddp_failure, backend="flatcomm", timeout_s=TIMEOUT_S)
    errors = {r["err"] for r in res}
    assert len(errors) == 1 and None not in errors and "numel" in errors.pop(), errors
    for r in res:
        assert r["on_lane"] == 1  # the second step's bucket (the first agreed its plan)
        for g in r["grads"]:
            torch.testing.assert_close(g, r["ref"])
    assert all(torch.equal(a, b) for a, b in zip(res[0]["grads"], res[1]["grads"]))


def _exact_reference(world: int, n: int, seed: int, scale: float) -> torch.Tensor:
    from flatcomm.ops.sums import DEFAULT_EXACT_BLOCK, DEFAULT_HEADROOM, exact_sum

    rows = torch.stack([_special(_values(r, n, seed), r) for r in range(world)])
    val = exact_sum(rows, DEFAULT_EXACT_BLOCK, DEFAULT_HEADROOM)  # order-free: one call or per piece, the same
    return val * scale if scale != 1.0 else val


def _special(x: torch.Tensor, rank: int) -> torch.Tensor:
    x[:4096] *= 1e30  # (huge blocks: their small neighbours' bits go)
    x[5000] = float("inf") if rank == 0 else 1.0  # a non-finite block
    x[9000] = float("nan")
    x[20000:20512] = 0.0
    return x


def _exact_calls(rank: int, world: int) -> list:
    import torch.distributed as dist

    import flatcomm.backend as fb

    fb.configure(mode="exact")
    out = []
    for op, scale in ((dist.ReduceOp.SUM, 1.0), (dist.ReduceOp.AVG, 1.0 / world)):
        for n in (N1, N2, 777_777):  # (the odd size's pieces are not 16-byte multiples: the exact route)
            for seed in (0, 1, 2):  # the first on the worker, the next on the lane
                t = _special(_values(rank, n, seed), rank)
                before = _lane_done()
                dist.all_reduce(t, op=op, async_op=True).wait()
                ref = _exact_reference(world, n, seed, scale)
                out.append((n, seed, str(op), torch.equal(t.view(torch.int32), ref.view(torch.int32)),
                            _lane_done() == before + 1, fb.route(t, op)))
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_exact_mode_all_reduces_run_natively_with_the_exact_sums_bits(world):
    for res in spawn.run(world, _exact_calls, backend="flatcomm", timeout_s=TIMEOUT_S):
        for n, seed, op, same_bits, on_lane, route in res:
            assert same_bits, (n, seed, op)
            assert route == ("exact" if n == 777_777 else "native"), (n, route)
            if n != 777_777 and seed > 0:
                assert on_lane, (n, seed, op)

"""flatcomm.backend keeps torch's ProcessGroup contract: failures raise (never a signal), the
overloads torch binds, gloo's meaning and checks of multi-tensor calls, tensors that require grad.

One spawn of 2 ranks per configuration runs every probe and returns what it saw; the tests assert
on that. A rank that dies by a signal makes ``spawn.run`` raise ("exited abnormally"), so every test
of a configuration fails if any probe of it crashes a process.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from flatcomm.tools import spawn

W = 2


def _caught(fn) -> object:
    """``fn()``'s result, or ``(type name, message)`` of what it raised."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - the probe reports it
        return (type(e).__name__, str(e))


def _ddp_step(model, x) -> torch.Tensor:
    model.zero_grad()
    model(x).sum().backward()
    return model.module.weight.grad.clone()


def _fsdp2_backward(rank: int) -> None:
    from torch.distributed.fsdp import fully_shard

    model = fully_shard(torch.nn.Linear(8, 6))
    model(torch.randn(3, 8, generator=torch.Generator().manual_seed(rank))).sum().backward()


def _failures(rank: int, world: int) -> dict:
    """Reductions that fail (ranks configured with different modes) on each path torch calls."""
    import flatcomm.backend as fb

    res: dict = {}
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(6, 5))
    x = torch.randn(3, 6)
    fb.configure(None, mode="exact" if rank == 1 else "ordered")  # the forced failure
    res["ddp"] = _caught(lambda: _ddp_step(model, x))
    res["async"] = _caught(lambda: dist.all_reduce(torch.ones(7), async_op=True).wait())
    res["future"] = _caught(lambda: dist.all_reduce(torch.ones(7), async_op=True).get_future().wait())
    res["funcol"] = _caught(lambda: funcol.wait_tensor(funcol.all_reduce(torch.ones(7), "sum", dist.group.WORLD)))
    res["fsdp2"] = _caught(lambda: _fsdp2_backward(rank))
    fb.configure(None, mode="ordered")  # agreed again: the group is still usable
    res["ddp_after"] = _caught(lambda: _ddp_step(model, x))
    ref = torch.nn.Linear(6, 5)
    ref.load_state_dict(model.module.state_dict())
    ref(torch.cat([x, x])).sum().backward()  # both ranks' batches: the mean gradient is the same
    res["ddp_ref"] = ref.weight.grad / world
    return res


@pytest.fixture(scope="module")
def failures():
    return spawn.run(W, _failures, backend="flatcomm", timeout_s=30)


@pytest.mark.parametrize("path", ["ddp", "async", "future", "funcol", "fsdp2"])
def test_failed_reduction_raises_on_every_rank(failures, path):
    for r in failures:
        got = r[path]
        assert isinstance(got, tuple), f"{path}: no error raised, got {got!r}"
        assert "disagree on mode" in got[1], got


def test_group_usable_after_failures(failures):
    for r in failures:
        assert isinstance(r["ddp_after"], torch.Tensor), r["ddp_after"]
        torch.testing.assert_close(r["ddp_after"], r["ddp_ref"])


def _rank_values(rank: int, n: int = 5, dtype=torch.float32) -> torch.Tensor:
    return (torch.arange(n, dtype=torch.float64) * 0.37 + rank * 1.9 + 0.11).to(dtype)


def _surface(rank: int, world: int) -> dict:
    """Every form of every method torch's ProcessGroup binds, called on the flatcomm group."""
    from datetime import timedelta

    pg = dist.group.WORLD
    res: dict = {}

    def done(work, value):
        work.wait()
        return value

    x = _rank_values(rank)
    calls = {
        "allreduce(t)": lambda t: done(pg.allreduce(t), t),
        "allreduce(t, op=MAX)": lambda t: done(pg.allreduce(t, op=dist.ReduceOp.MAX), t),
        "allreduce(t, op, timeout)": lambda t: done(pg.allreduce(t, dist.ReduceOp.SUM, timedelta(seconds=9)), t),
        "allreduce([t], op=PREMUL)": lambda t: done(pg.allreduce([t], op=dist._make_nccl_premul_sum(0.5)), t),
        "allreduce([t], opts)": lambda t: done(pg.allreduce([t], dist.AllreduceOptions()), t),
        "allreduce([t], opts=)": lambda t: done(pg.allreduce([t], opts=dist.AllreduceOptions()), t),
        "reduce(t, root=0)": lambda t: done(pg.reduce(t, root=0), t),
        "reduce(t, 1, op=AVG)": lambda t: done(pg.reduce(t, 1, op=dist.ReduceOp.AVG), t),
        "broadcast(t, root=1)": lambda t: done(pg.broadcast(t, root=1), t),
        "broadcast(t, 0)": lambda t: done(pg.broadcast(t, 0), t),
    }
    for name, call in calls.items():
        res[name] = _caught(lambda: call(x.clone()))
    outs = [torch.empty(5) for _ in range(world)]
    res["allgather(outs, t)"] = _caught(lambda: done(pg.allgather(outs, x.clone()), outs))
    out = torch.empty(5)
    res["reduce_scatter(out, ins)"] = _caught(
        lambda: done(pg.reduce_scatter(out, [x.clone() * (d + 1) for d in range(world)]), out))
    res["barrier(timeout=)"] = _caught(lambda: done(pg.barrier(timeout=timedelta(seconds=9)), True))
    res["gather(outs, t, root=0)"] = _caught(
        lambda: done(pg.gather(outs if rank == 0 else [], x.clone(), root=0), outs if rank == 0 else None))
    sc = torch.empty(5)
    res["scatter(t, ins, root=1)"] = _caught(
        lambda: done(pg.scatter(sc, [x * (d + 1) for d in range(world)] if rank == 1 else [], root=1), sc))
    a2a = torch.empty(2 * world)
    res["all_to_all_single(timeout)"] = _caught(
        lambda: done(pg.all_to_all_single(a2a, torch.full((2 * world,), float(rank)), [], [],
                                          timeout=timedelta(seconds=9)), a2a))
    # coalesced calls passed through as several inner calls: one Python Work, waited or chained on
    ints = [torch.arange(2 * world, dtype=torch.int64) * (rank + 1), torch.full((3 * world,), rank, dtype=torch.int64)]
    rs_outs = [torch.empty(2, dtype=torch.int64), torch.empty(3, dtype=torch.int64)]
    work = pg.reduce_scatter_tensor_coalesced(rs_outs, ints, dist.ReduceScatterOptions())
    res["reduce_scatter_tensor_coalesced future"] = str(_caught(work.get_future))  # none, as gloo's own
    res["reduce_scatter_tensor_coalesced"] = _caught(lambda: done(work, rs_outs))
    ag_outs = [torch.empty(world * 5), torch.empty(world * 2, dtype=torch.int64)]
    work = pg.allgather_into_tensor_coalesced(ag_outs, [x.clone(), torch.full((2,), rank, dtype=torch.int64)])
    res["allgather_into_tensor_coalesced"] = _caught(lambda: work.get_future().wait())
    res["allgather_into_tensor_coalesced done"] = [work.is_completed(), work.is_success(), work.exception()]
    import flatcomm.backend
    res["stats"] = flatcomm.backend.stats()
    return res


def _checks(rank: int, world: int) -> dict:
    """gloo's argument checks, the multi-tensor refusal, tensors that require grad."""
    pg = dist.group.WORLD
    res: dict = {}
    z = torch.zeros
    probes = {
        "sizes": lambda: pg.allreduce([z(1), z(2)]),
        "dtypes": lambda: pg.allreduce([z(2), z(2, dtype=torch.float16)]),
        "empty": lambda: pg.allreduce([]),
        "empty_coalesced": lambda: pg.allreduce_coalesced([]),
        "two_sum": lambda: pg.allreduce([z(2), z(2)]),
        "two_max": lambda: pg.allreduce([z(2), z(2)], op=dist.ReduceOp.MAX),
        "two_int": lambda: pg.allreduce([z(2, dtype=torch.int32), z(2, dtype=torch.int32)]),
        "reduce_two": lambda: pg.reduce([z(2), z(2)], dist.ReduceOptions()),
        "rs_two": lambda: pg.reduce_scatter([z(1), z(1)], [[z(1)] * world, [z(1)] * world]),
    }
    for name, probe in probes.items():
        res[name] = _caught(lambda: probe().wait())
    leaf = _rank_values(rank).requires_grad_()
    res["grad_leaf"] = _caught(lambda: (dist.all_reduce(leaf), leaf.detach().clone())[1])
    inner = leaf * 2
    res["grad_nonleaf"] = _caught(lambda: (dist.all_reduce(inner, op=dist.ReduceOp.AVG), inner.detach().clone())[1])

    class Square(torch.nn.Module):  # torch's test_ddp_create_graph
        def __init__(self):
            super().__init__()
            self.p = torch.nn.Parameter(torch.tensor(1.0 + rank))

        def forward(self):
            return self.p.pow(2)

    ddp = torch.nn.parallel.DistributedDataParallel(Square())

    def create_graph():
        for _ in range(3):
            ddp().backward(create_graph=True)
        return ddp.module.p.grad.detach().clone()
    res["create_graph"] = _caught(create_graph)
    return res


@pytest.fixture(scope="module")
def surface():
    return spawn.run(W, _surface, backend="flatcomm", timeout_s=30)


@pytest.fixture(scope="module")
def checks():
    return spawn.run(W, _checks, backend="flatcomm", timeout_s=30)


def test_every_torch_form_runs(surface):
    rows = [_rank_values(r).double() for r in range(W)]
    total = (rows[0] + rows[1]).float()
    want = {
        "allreduce(t)": total, "allreduce(t, op, timeout)": total, "allreduce([t], opts)": total,
        "allreduce([t], opts=)": total, "allreduce(t, op=MAX)": torch.maximum(rows[0], rows[1]).float(),
        "allreduce([t], op=PREMUL)": (rows[0].float() * 0.5).double() + (rows[1].float() * 0.5).double(),
        "broadcast(t, root=1)": rows[1].float(), "broadcast(t, 0)": rows[0].float(),
    }
    for rank, r in enumerate(surface):
        for name, value in r.items():
            assert not isinstance(value, tuple), f"rank {rank} {name}: {value}"
        for name, ref in want.items():
            assert torch.equal(r[name], ref.float()), (rank, name, r[name], ref)
    assert torch.equal(surface[0]["reduce(t, root=0)"], total)
    assert torch.equal(surface[1]["reduce(t, 1, op=AVG)"], (total.double() / 2).float())
    assert torch.equal(surface[0]["reduce_scatter(out, ins)"], total)
    assert torch.equal(surface[1]["reduce_scatter(out, ins)"], (total.double() * 2).float())
    assert torch.equal(torch.stack(surface[1]["allgather(outs, t)"]), torch.stack([x.float() for x in rows]))
    assert torch.equal(torch.stack(surface[0]["gather(outs, t, root=0)"]), torch.stack([x.float() for x in rows]))
    assert torch.equal(surface[0]["scatter(t, ins, root=1)"], rows[1].float())
    assert torch.equal(surface[1]["scatter(t, ins, root=1)"], rows[1].float() * 2)
    assert torch.equal(surface[0]["all_to_all_single(timeout)"], torch.tensor([0.0, 0, 1, 1]))
    for rank, r in enumerate(surface):
        first = torch.arange(2 * W, dtype=torch.int64) * sum(range(1, W + 1))
        assert torch.equal(r["reduce_scatter_tensor_coalesced"][0], first[2 * rank:2 * rank + 2])
        assert torch.equal(r["reduce_scatter_tensor_coalesced"][1], torch.full((3,), sum(range(W))))
        assert "has no future" in r["reduce_scatter_tensor_coalesced future"] and "wait()" in \
            r["reduce_scatter_tensor_coalesced future"], r["reduce_scatter_tensor_coalesced future"]
        gathered = r["allgather_into_tensor_coalesced"]
        assert torch.equal(gathered[0], torch.cat([x.float() for x in rows]))
        assert torch.equal(gathered[1], torch.arange(W).repeat_interleave(2))
        assert r["allgather_into_tensor_coalesced done"] == [True, True, None]


def test_stats_count_flatcomms_reductions(surface):
    """The backend's snapshot: the 8 float SUM / AVG / PREMUL_SUM reductions above (MAX and the
    rest pass through, uncounted), one collective each, their payload bytes; the exporters take it."""
    import flatcomm.backend
    from flatcomm import stats as fs

    for r in surface:
        snap = r["stats"]
        assert snap.source == "backend" and snap["reductions"] == 8 and snap.calls == 8, snap
        assert 8 * 5 * 4 <= snap.wire_bytes <= 8 * 64, snap  # 5 fp32 values to the other rank, padded to 16
        assert fs.from_snapshot(snap)[0].wire_bytes == snap.wire_bytes
    with pytest.raises(TypeError, match="not a group of the flatcomm backend"):
        flatcomm.backend.stats(object())


@pytest.mark.parametrize("probe,words", [
    ("sizes", "invalid tensor size at index 1"), ("dtypes", "invalid tensor type at index 1"),
    ("empty", "empty list"), ("empty_coalesced", "empty list"),
    ("two_sum", "one tensor per rank"), ("two_max", "one tensor per rank"), ("two_int", "one tensor per rank"),
    ("reduce_two", "one tensor per rank"), ("rs_two", "one tensor per rank"),
])
def test_gloo_checks_and_one_meaning_of_lists(checks, probe, words):
    for r in checks:
        assert isinstance(r[probe], tuple) and words in r[probe][1], r[probe]


def test_requires_grad_reduced_in_place_as_gloo(checks):
    rows = [_rank_values(r).double() for r in range(W)]
    for r in checks:
        assert torch.equal(r["grad_leaf"], (rows[0] + rows[1]).float()), r["grad_leaf"]
        # inner = 2 * the reduced leaf on both ranks; its average is itself
        assert torch.equal(r["grad_nonleaf"], 2 * (rows[0] + rows[1]).float()), r["grad_nonleaf"]
        # DDP broadcast rank 0's p = 1: d/dp p^2 = 2 on both ranks, averaged, accumulated 3 times
        assert isinstance(r["create_graph"], torch.Tensor), r["create_graph"]
        assert torch.equal(r["create_graph"], torch.tensor(6.0)), r["create_graph"]


def _premul(rank: int, world: int) -> dict:
    """An FSDP2 step with a gradient divide factor (FSDP2 passes PREMUL_SUM(1/3)), through
    flatcomm.fsdp.apply and through the flatcomm backend (this world's group)."""
    from torch.distributed.fsdp import FSDPModule

    from _support.fsdp import _grads, _loss, _Tiny, _wrap
    from flatcomm.fsdp import apply

    def step(via_apply: bool) -> dict:
        torch.manual_seed(0)
        model = _wrap(_Tiny())
        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.set_gradient_divide_factor(3.0)
        if via_apply:
            apply(model, "fp32", error_feedback=False)
        _loss(model, rank, 0).backward()
        return _grads(model)

    x = torch.randn(1000, generator=torch.Generator().manual_seed(rank)) * 1e3
    pre = x.clone()
    dist.all_reduce(pre, op=dist._make_nccl_premul_sum(1 / 3))
    return {"apply": step(True), "backend": step(False), "x": x, "premul": pre}


@pytest.fixture(scope="module")
def premul():
    return spawn.run(W, _premul, backend="flatcomm", timeout_s=60)


def test_premul_sum_same_bits_through_fsdp_apply_and_backend(premul):
    for r in premul:
        assert r["apply"].keys() == r["backend"].keys() and r["apply"]
        for name in r["apply"]:
            assert torch.equal(r["apply"][name].view(torch.int32), r["backend"][name].view(torch.int32)), name


def test_premul_sum_is_nccls_rule(premul):
    """Each input times the factor rounded to its dtype, rounded once; then the fp32 sum."""
    f = torch.tensor(1 / 3, dtype=torch.float32)
    want = (premul[0]["x"] * f) + (premul[1]["x"] * f)
    post = (premul[0]["x"] + premul[1]["x"]) * f
    assert not torch.equal(want, post), "the inputs do not tell the two rules apart"
    for r in premul:
        assert torch.equal(r["premul"], want)


class _InnerPart:
    """An inner backend's work as ReductionWork sees it: wait() times out (gloo raises a
    RuntimeError) while in flight, then finishes with ``error`` or the value."""

    def __init__(self, error=None):
        self.done, self.error = False, error

    def wait(self, timeout=None):
        if not self.done:
            raise RuntimeError("Timed out waiting for the operation to complete")
        if self.error is not None:
            raise self.error
        return True

    def is_completed(self):
        return self.done


@pytest.mark.parametrize("error", [None, ValueError("the inner call failed")])
def test_a_work_of_inner_parts_waits_for_every_part(error):
    from flatcomm.backend.work import ReductionWork

    parts = [_InnerPart(), _InnerPart(error)]
    parts[0].done = True
    work = ReductionWork(parts, [torch.zeros(1)], None, None)
    with pytest.raises(RuntimeError, match="Timed out"):  # a part still in flight: not settled
        work.wait()
    assert not work.is_completed() and work.exception() is None
    parts[1].done = True
    if error is None:
        assert work.wait() and work.is_success()
    else:
        with pytest.raises(ValueError, match="inner call failed"):
            work.wait()
        assert work.is_completed() and not work.is_success() and work.exception() is error

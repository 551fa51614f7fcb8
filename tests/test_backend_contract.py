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


@pytest.mark.parametrize("path", ["ddp", "async", "future", "funcol"])
def test_failed_reduction_raises_on_every_rank(failures, path):
    for r in failures:
        got = r[path]
        assert isinstance(got, tuple), f"{path}: no error raised, got {got!r}"
        assert "disagree on mode" in got[1], got


def test_group_usable_after_failures(failures):
    for r in failures:
        assert isinstance(r["ddp_after"], torch.Tensor), r["ddp_after"]
        torch.testing.assert_close(r["ddp_after"], r["ddp_ref"])

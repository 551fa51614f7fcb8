"""flatcomm's phases are named ranges in a torch.profiler trace (issue 38, item 7).

One spawn of 2 ranks profiles a DDP step with flatcomm's hook, a DiLoCo sync and a ``flatcomm``
backend all_reduce, once with torch's default profiler (the labels on the caller's and autograd's
threads) and once with ``profile_all_threads`` (also the phases on flatcomm's worker threads).
"""
from __future__ import annotations

from flatcomm.tools import spawn

CALLER = {"flatcomm.ddp.hook", "flatcomm.all_reduce", "flatcomm.diloco.sync_start",
          "flatcomm.diloco.outer_step", "flatcomm.diloco.verify"}
WORKER = {"flatcomm.comm.verify", "flatcomm.comm.encode", "flatcomm.comm.exchange", "flatcomm.comm.decode_sum"}


def _steps(backend_group) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import flatcomm.ddp
    from flatcomm.diloco import DiLoCo

    torch.manual_seed(0)  # the same weights on every rank
    net = torch.nn.Linear(8, 4)
    model = DDP(net)
    flatcomm.ddp.register(model, codec="int8")
    model(torch.randn(3, 8)).sum().backward()  # the hook runs on autograd's thread

    inner = torch.nn.Linear(8, 4)
    opt = torch.optim.SGD(inner.parameters(), lr=0.1)
    outer = DiLoCo(inner, opt, sync_every=1, codec="int8", verify_every=1)
    inner(torch.randn(3, 8)).sum().backward()
    opt.step()  # one inner step: the outer sync, its step and the verify
    outer.close()

    x = torch.ones(5)
    dist.all_reduce(x, group=backend_group)  # the backend's sum: a flatcomm all_reduce
    assert x.tolist() == [2.0] * 5


def _labels(rank: int, world: int) -> dict:
    import torch
    import torch.distributed as dist
    from torch.profiler import profile

    import flatcomm.backend  # noqa: F401 - registers the backend

    g = dist.new_group(backend="flatcomm")
    _steps(g)  # warm-up: private groups made, first calls settled
    out = {}
    with profile() as prof:
        _steps(g)
    out["default"] = sorted({e.key for e in prof.key_averages() if e.key.startswith("flatcomm.")})
    every = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
    with profile(experimental_config=every) as prof:
        _steps(g)
    out["all threads"] = sorted({e.key for e in prof.key_averages() if e.key.startswith("flatcomm.")})
    return out


def test_phases_are_labelled_in_a_profile() -> None:
    for r in spawn.run(2, _labels, timeout_s=60):
        assert CALLER <= set(r["default"]), r
        assert CALLER | WORKER <= set(r["all threads"]), r


def test_a_label_costs_nothing_without_a_profiler() -> None:
    from flatcomm.comm.labels import label

    with label("flatcomm.comm.test") as a, label("flatcomm.comm.other") as b:
        assert a is None and b is None  # the shared no-op: no record_function made

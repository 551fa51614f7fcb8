"""Creating and destroying process groups leaves nothing of flatcomm's behind (issue 38, item 4).

flatcomm keeps per-group state (a private copy of the group, a worker thread, the call counter of
the header, staging buffers, the tuner, the backend's settings) in one context per group, dropped
when the group is destroyed. A job that creates a subgroup per phase (or per sweep point) must not
grow its threads, open files or the groups registered with torch with every group it destroys.
"""
from __future__ import annotations

import pytest

from flatcomm.tools import spawn

ROUNDS = 200
SLACK = {"torch_groups": 2, "settings": 1, "contexts": 3, "py_threads": 2, "native_threads": 8, "fds": 8}


def _counts() -> dict:
    import gc
    import os
    import threading

    import torch.distributed.distributed_c10d as c10d

    from flatcomm.backend import settings
    from flatcomm.comm import context

    gc.collect()
    return {"torch_groups": len(c10d._world.pg_map), "settings": settings.entries(),
            "contexts": context.count(), "py_threads": threading.active_count(),
            "native_threads": len(os.listdir("/proc/self/task")), "fds": len(os.listdir("/proc/self/fd"))}


def _cycle(kind: str) -> None:
    import torch
    import torch.distributed as dist

    from flatcomm import collectives as C
    from flatcomm.backend import configure

    if kind == "flatcomm":
        g = dist.new_group(backend="flatcomm")
        configure(g, mode="exact")
        x = torch.ones(5)
        dist.all_reduce(x, group=g)  # flatcomm's sum: on the private copy, on its worker
        assert x.tolist() == [2.0] * 5
    else:
        g = dist.new_group(backend="gloo")
    y = torch.ones(3)
    C.all_reduce(y, group=g)  # a flatcomm collective names the group: its private copy, its worker
    assert y.tolist() == [1.0] * 3  # the average
    dist.destroy_process_group(g)


def _churn(rank: int, world: int, rounds: int) -> dict:
    import flatcomm.backend  # noqa: F401 - registers the backend

    for kind in ("flatcomm", "gloo"):  # warm-up: torch's and flatcomm's one-off state
        _cycle(kind)
    before = _counts()
    for i in range(rounds):
        _cycle("flatcomm" if i % 2 == 0 else "gloo")
    return {"before": before, "after": _counts()}


def test_destroyed_groups_leave_nothing_behind() -> None:
    for r in spawn.run(2, _churn, ROUNDS, timeout_s=60, run_s=360):
        before, after = r["before"], r["after"]
        grown = {k: after[k] - before[k] for k in before}
        assert all(grown[k] <= SLACK[k] for k in SLACK), (before, after)

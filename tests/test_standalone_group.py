"""flatcomm's collectives on a standalone gloo group (made from a store prefix, not listed by
torch.distributed, as torchft makes one per quorum) give the same bits as on the listed world, for
ordered int4 with error feedback, exact fp32 and an int4 all-gather; a bad call is refused on
every rank; a bad group set-up is refused. (A member that dies: tests/test_elastic.py.)"""
from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import flatcomm
from flatcomm.comm import standalone
from flatcomm.tools import spawn

N = 1013  # odd: uneven shards


def _cases(group, rank):
    out = []
    for codec, mode in (("int4", "ordered"), ("fp32", "exact"), ("sign", "ordered")):
        g = torch.Generator().manual_seed(10 * rank + len(out))
        t = torch.randn(N, generator=g) * 10.0 ** (rank - 1)
        t[::97] = 0.0
        fb = flatcomm.ErrorFeedback.zeros(N) if codec != "fp32" else None
        for _ in range(2):  # the second call uses the first one's residuals
            flatcomm.all_reduce(t, group=group, codec=codec, mode=mode, op="sum", residual=fb)
        out.append(t.clone())
        if fb is not None:
            out += [fb.client.clone(), fb.server.clone()]
    rows = torch.empty(dist.get_world_size(group) * 7)
    flatcomm.all_gather(rows, torch.arange(7.0) * (rank + 1), codec="int4", group=group)
    out.append(rows)
    return out


def _both(rank, world):
    store = dist.PrefixStore("standalone-test", dist.distributed_c10d._get_default_store())
    group = standalone.gloo_group(store, rank, world, timedelta(seconds=20))
    assert standalone.is_standalone(group) and standalone.rank(group) == rank
    assert standalone.ranks(group) == list(range(world))
    mine, listed = _cases(group, rank), _cases(None, rank)
    refused = None
    try:  # a mismatched call: every rank raises, naming the difference
        flatcomm.all_reduce(torch.zeros(5 + rank), group=group, codec="int4")
    except ValueError as e:
        refused = str(e)
    return mine, listed, refused


def test_standalone_group_matches_the_listed_world():
    for mine, listed, refused in spawn.run(3, _both, timeout_s=60):
        assert len(mine) == len(listed)
        for a, b in zip(mine, listed):
            assert torch.equal(a, b)
        assert refused is not None and "disagree on numel" in refused


def test_gloo_group_refuses_bad_arguments():
    store = dist.HashStore()
    with pytest.raises(ValueError, match="timeout"):
        standalone.gloo_group(store, 0, 1, timedelta(0))
    with pytest.raises(ValueError, match="rank"):
        standalone.gloo_group(store, 2, 2, timedelta(seconds=1))
    with pytest.raises(ValueError, match="connect_timeout"):
        standalone.gloo_group(store, 0, 1, timedelta(seconds=1), connect_timeout=timedelta(seconds=-1))


def _connect_then_operate(rank, world):
    import time
    base = dist.distributed_c10d._get_default_store()
    took = None
    if rank == 0:  # rank 1 never joins this one: the set-up fails within connect_timeout
        t0 = time.monotonic()
        with pytest.raises(Exception, match="timeout"):
            standalone.gloo_group(dist.PrefixStore("absent", base), 0, 2, timedelta(seconds=30),
                                  connect_timeout=timedelta(seconds=0.5))
        took = time.monotonic() - t0
    group = standalone.gloo_group(dist.PrefixStore("late", base), rank, world, timedelta(seconds=30),
                                  connect_timeout=timedelta(seconds=5))
    if rank == 1:
        time.sleep(1.5)  # an operation may wait longer than the set-up's bound
    t = torch.full((9,), float(rank + 1))
    flatcomm.all_reduce(t, group=group, codec="fp32", mode="exact", op="sum")
    return took, t


def test_connect_timeout_bounds_the_set_up_not_the_operations():
    (took, t0), (_, t1) = spawn.run(2, _connect_then_operate, timeout_s=60)
    assert 0.4 < took < 3.0, took
    assert torch.equal(t0, torch.full((9,), 3.0)) and torch.equal(t1, t0)


def _many(rank, world):
    import gc
    import threading
    counts = []
    for i in range(12):
        store = dist.PrefixStore(f"many/{i}", dist.distributed_c10d._get_default_store())
        group = standalone.gloo_group(store, rank, world, timedelta(seconds=20))
        t = torch.ones(33)
        flatcomm.all_reduce(t, group=group, codec="int4")
        assert torch.equal(t, torch.ones(33))
        del group
        gc.collect()
        counts.append((len(standalone._adopted), threading.active_count()))
    return counts


def test_groups_let_go_of_take_their_state_with_them():
    for counts in spawn.run(2, _many, timeout_s=60):
        assert max(c[0] for c in counts) <= 2 * 2, counts  # at most the last one's (and one being closed)
        assert counts[-1][1] <= counts[2][1] + 2, counts  # no thread per group left behind

"""Errors of the backend's native calls, each the clear error on every rank of the call, at 2 and 3
ranks, with the group right again afterwards:

* a peer's header row whose ``reduce op`` field names no op (300): every rank raises the named
  disagreement (it once raised a TypeError inside the check and kept the header unsettled and its
  plans; with an early peer, that peer waited for fills until the timeout);
* a rank outside a group calling a collective on it (it once got "cannot create weak reference to
  'int' object");
* a meta tensor on one rank only: every rank raises at once (its peers once waited the timeout);
* a call cut off by its group's destruction says so (it once raised an empty ``CancelledError``).
"""
from __future__ import annotations

import time

import pytest
import torch

from flatcomm.tools import spawn

N_LANE = 1_200_096


def _tampered_op(rank: int, world: int, value: int, n: int) -> list:
    import torch.distributed as dist

    from flatcomm.comm import agreed, groups, header, native_calls

    priv = groups.private_group(dist.group.WORLD)
    for size in (N_LANE, 64):  # a plan, and the small call prepared
        for _ in range(2):
            dist.all_reduce(torch.ones(size), async_op=True).wait()
    plans_before = agreed.count(priv)
    orig = native_calls.record
    if rank == world - 1:
        def tampered(group, agree, fields, early, w, template=None):
            token, mine, table = orig(group, agree, fields, early, w, template)
            mine[3 + header.FIELDS.index("reduce op")] = value
            return token, mine, table
        native_calls.record = tampered
    t0 = time.monotonic()
    try:
        dist.all_reduce(torch.ones(n), async_op=True).wait()
        err = None
    except Exception as e:  # noqa: BLE001 - reported
        err = f"{type(e).__name__}: {e}"
    took = time.monotonic() - t0
    native_calls.record = orig
    plans_after = agreed.count(priv)
    unsettled = sum(1 for h in native_calls._HEADERS.values() if not h._settled)
    t = torch.ones(n)
    dist.all_reduce(t, async_op=True).wait()
    return [err, took, plans_before, plans_after, unsettled, bool((t == world).all())]


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("n", [64, N_LANE], ids=["small", "lane"])
def test_a_reduce_op_field_no_op_has_is_the_named_disagreement(world, n):
    for err, took, before, after, unsettled, right in spawn.run(world, _tampered_op, 300, n, timeout_s=30,
                                                                 backend="flatcomm"):
        assert err is not None and err.startswith("ValueError"), err
        assert "ranks disagree on reduce op" in err and "300" in err, err
        assert took < 10.0
        assert before >= 1 and after == before  # every rank read the same table: the plans stay
        assert unsettled == 0
        assert right


def _outside(rank: int, world: int) -> list:
    import torch.distributed as dist

    import flatcomm

    sub = dist.new_group([0, 1])
    if rank >= 2:
        try:
            flatcomm.all_reduce(torch.ones(4), group=sub, op="sum")
            out = ["no error"]
        except Exception as e:  # noqa: BLE001 - reported
            out = [f"{type(e).__name__}: {e}"]
    else:
        t = torch.ones(4)
        flatcomm.all_reduce(t, group=sub, op="sum")
        out = [t.tolist()]
    dist.barrier()  # (no rank leaves while the others still connect their groups)
    return out


def test_a_rank_outside_the_group_gets_a_clear_error():
    out = spawn.run(3, _outside, timeout_s=30)
    assert out[0] == out[1] == [[2.0] * 4]
    assert out[2][0].startswith("ValueError") and "rank 2 is not a member" in out[2][0], out[2]


def _meta_on_one(rank: int, world: int) -> list:
    import torch.distributed as dist

    t = torch.ones(64, device="meta") if rank == 1 else torch.ones(64)
    t0 = time.monotonic()
    try:
        dist.all_reduce(t)
        err = None
    except Exception as e:  # noqa: BLE001 - reported
        err = f"{type(e).__name__}: {e}"
    took = time.monotonic() - t0
    x = torch.full((64,), float(rank + 1))
    dist.all_reduce(x)
    return [err, took, x[0].item()]


@pytest.mark.parametrize("world", [2, 3])
def test_a_meta_tensor_on_one_rank_fails_every_rank_at_once(world):
    for err, took, after in spawn.run(world, _meta_on_one, timeout_s=30, backend="flatcomm"):
        assert err is not None and "rank 1 failed" in err and "meta" in err, err
        assert took < 10.0
        assert after == sum(range(1, world + 1))


def test_a_cancelled_call_says_why():
    import concurrent.futures

    from flatcomm.comm import worker

    future: concurrent.futures.Future = concurrent.futures.Future()
    future.cancel()
    handle = worker.Handle(future, torch.empty(0), what="all_reduce of 4 values (fp32)")
    with pytest.raises(concurrent.futures.CancelledError, match="all_reduce of 4 values.*destroyed"):
        handle.wait()
    with pytest.raises(concurrent.futures.CancelledError, match="all_reduce of 4 values.*destroyed"):
        handle.get_future().wait()

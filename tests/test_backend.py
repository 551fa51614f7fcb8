"""flatcomm.backend: init_process_group("flatcomm") reduces with flatcomm's sums and passes the rest through.

Process start-up dominates, so each configuration is ONE spawn of 4 ranks that runs every check and
returns what it saw; the tests below assert on those results. 4 ranks, because with 2 a + b is the
same in either order. Every float result is compared bit for bit with a float64 (or fp32 sequential,
rank-ordered) reference built from all ranks' inputs.
"""
from __future__ import annotations

import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from _support.collectives import spread_values
from _support.kernels import assert_bits_equal
from flatcomm.tools import spawn

W = 4
N = 1001  # odd: no shard boundary lines up with a power of two


def _gathered(x: torch.Tensor, group=None):
    out = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, x, group=group)
    return out


def _invariance(x: torch.Tensor, group) -> dict:
    """all_reduce of x alone, embedded at an offset, in pieces, coalesced; reduce_scatter forms."""
    out = {}
    a = x.clone()
    dist.all_reduce(a, group=group)
    out["alone"] = a
    big = torch.randn(3 * N + 5)
    big[37:37 + N] = x
    dist.all_reduce(big, group=group)
    out["offset"] = big[37:37 + N].clone()
    p = x.clone()
    w = dist.all_reduce(p[:1], group=group, async_op=True)
    dist.all_reduce(p[1:500], group=group)
    w.wait()
    dist.all_reduce(p[500:], group=group)
    out["pieces"] = p
    c = [torch.randn(13), x.clone(), torch.randn(5)]
    dist.all_reduce_coalesced(c, group=group)
    out["coalesced"] = c[1]
    m = 250
    pad = torch.cat([x, torch.zeros(W * m - N + 3)])[:W * m] if N < W * m else x[:W * m].clone()
    sh = torch.empty(m)
    dist.reduce_scatter_single(sh, pad, group=group)
    out["rs_tensor"] = _gathered(sh, group)  # the shards in rank order
    lst = torch.empty(m)
    dist.reduce_scatter(lst, list(pad.split(m)), group=group)
    out["rs_list"] = _gathered(lst, group)
    return out


def _ops(rank: int, world: int) -> dict:
    import flatcomm.backend as fb

    res: dict = {"backend": dist.get_backend(), "group_type": type(dist.group.WORLD).__name__}
    x = spread_values(rank)
    res["inputs"] = _gathered(x)
    res["flat"] = _invariance(x, None)
    gl = dist.new_group(backend="gloo")  # gloo's own run of the same calls
    res["gloo"] = _invariance(x, gl)
    # Functional collectives (what DTensor and torch.compile'd code call), reduce.
    res["funcol_ar"] = funcol.wait_tensor(funcol.all_reduce(x.clone(), "sum", dist.group.WORLD))
    res["funcol_rs"] = _gathered(funcol.wait_tensor(funcol.reduce_scatter_single(x[:1000].clone(), "sum", 0,
                                                                                    dist.group.WORLD)))
    r = x.clone()
    dist.reduce(r, dst=2)
    res["reduce"] = r
    # Ops and dtypes.
    for name, op in (("avg", dist.ReduceOp.AVG), ("premul", dist._make_nccl_premul_sum(0.375))):
        t = x.clone()
        dist.all_reduce(t, op=op)
        res[name] = t
    for dt in (torch.bfloat16, torch.float16):
        t = x.clamp(-6e4, 6e4).to(dt)
        big = torch.zeros(N + 9, dtype=dt)
        big[9:] = t
        dist.all_reduce(t)
        dist.all_reduce(big)
        res[f"dtype_{dt}"] = (t, big[9:].clone())
    special = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 3e38, -3e38, 1e-45, 1.0])
    special = special[torch.randperm(9, generator=torch.Generator().manual_seed(rank))]
    res["special_in"] = _gathered(special)
    dist.all_reduce(special)
    res["special"] = special
    for n in (0, 1):
        t = torch.full((n,), float(rank + 1))
        dist.all_reduce(t)
        res[f"numel_{n}"] = t
    # Passed through: integers, MAX, broadcast, gathers, all-to-all, p2p, barrier.
    i = torch.tensor([rank, 2 ** 40 + rank], dtype=torch.int64)
    dist.all_reduce(i)
    res["int_sum"] = i
    mx = x.clone()
    dist.all_reduce(mx, op=dist.ReduceOp.MAX)
    res["max"] = mx
    b = x.clone()
    dist.broadcast(b, src=1)
    res["broadcast"] = b
    agt = torch.empty(W * N)
    dist.all_gather_single(agt, x)
    res["all_gather_into_tensor"] = agt
    a2a = torch.empty(W * 3)
    dist.all_to_all_single(a2a, torch.arange(W * 3, dtype=torch.float32) + 100 * rank)
    res["all_to_all"] = a2a
    got = torch.zeros(2)
    if rank == 0:
        dist.send(torch.tensor([5.0, 6.0]), dst=3)
    elif rank == 3:
        dist.recv(got, src=0)
    res["p2p"] = got
    dist.barrier()
    # Work objects.
    t = x.clone()
    w = dist.all_reduce(t, async_op=True)
    res["work_wait"] = w.wait(timeout=timedelta(seconds=30))
    res["work_future"] = w.get_future().wait()[0].clone()
    res["work_done"] = w.is_completed() and w.is_success()
    # new_group on the flatcomm backend.
    sub = dist.new_group([1, 3])
    res["sub_type"] = type(sub).__name__
    if rank in (1, 3):
        t = x.clone()
        dist.all_reduce(t, group=sub)
        res["sub"] = t
    # Bad input: mismatched sizes, then dtypes, across ranks -> the same error on every rank.
    for label, t in (("size", torch.zeros(10 + (rank == 2))),
                     ("dtype", torch.zeros(10, dtype=torch.bfloat16 if rank == 1 else torch.float32))):
        try:
            dist.all_reduce(t)
            res[f"bad_{label}"] = None
        except Exception as e:  # noqa: BLE001 - the test compares the messages
            res[f"bad_{label}"] = f"{type(e).__name__}: {e}"
    dist.all_reduce(torch.ones(3))  # the group still works after a refused call
    # A peer that never joins: raise within the group's timeout on the others.
    slow = dist.new_group(timeout=timedelta(seconds=3))
    dist.all_reduce(torch.ones(4), group=slow)  # creates flatcomm's private group of it
    t0 = time.monotonic()
    if rank != 3:
        try:
            dist.all_reduce(torch.ones(4), group=slow)
            res["dead"] = None
        except Exception as e:  # noqa: BLE001
            res["dead"] = (type(e).__name__, str(e)[:200], time.monotonic() - t0)
    else:
        time.sleep(4.5)  # past the 3 s timeout: the others raise first
    dist.barrier(group=gl)
    res["settings"] = fb.settings_for(dist.group.WORLD)
    return res


@pytest.fixture(scope="module")
def ops():
    return spawn.run(W, _ops, backend="flatcomm", timeout_s=60)


def _seq_sum(rows, dtype=torch.float32):
    """Rows summed in ascending rank order in fp32, rounded to ``dtype`` once: the ordered sum."""
    acc = rows[0].float().clone()
    for r in rows[1:]:
        acc = acc + r.float()
    return acc.to(dtype)


def test_registered_and_world_is_flatcomm(ops):
    assert ops[0]["backend"] == "flatcomm" and ops[0]["group_type"] == "FlatcommGroup"
    assert ops[1]["sub_type"] == "FlatcommGroup"
    assert ops[0]["settings"].mode == "ordered" and ops[0]["settings"].codec is None


def test_ordered_sum_is_the_rank_ordered_fp32_sum(ops):
    rows = ops[0]["inputs"]
    want = _seq_sum(rows)
    ref64 = sum(r.double() for r in rows)
    assert (want.double() - ref64).abs().max() <= 4 * 2 ** -23 * sum(r.double().abs() for r in rows).max()
    for r in ops:
        assert_bits_equal(r["flat"]["alone"], want, "all_reduce")


@pytest.mark.parametrize("form", ["offset", "pieces", "coalesced"])
def test_all_reduce_batch_invariant(ops, form):
    for r in ops:
        assert_bits_equal(r["flat"][form], r["flat"]["alone"], form)
    assert_bits_equal(ops[0]["funcol_ar"], ops[0]["flat"]["alone"], "functional all_reduce")


@pytest.mark.parametrize("form", ["rs_tensor", "rs_list"])
def test_reduce_scatter_matches_all_reduce(ops, form):
    rows = ops[0]["inputs"]
    want = _seq_sum([torch.cat([x, torch.zeros(3)])[:1000] for x in rows])
    assert_bits_equal(torch.cat(ops[0]["flat"][form]), want, form)
    assert_bits_equal(torch.cat(ops[0]["funcol_rs"]), want, "functional reduce_scatter_tensor")


def test_gloo_differs_where_flatcomm_does_not(ops):
    """The same calls on a gloo group: its sums change with offset, pieces or coalescing."""
    differs = [form for form in ("offset", "pieces", "coalesced")
               if not torch.equal(ops[0]["gloo"][form], ops[0]["gloo"]["alone"])]
    assert differs, "gloo's sums did not depend on the layout here: the invariance test proves nothing"


def test_ops_dtypes_and_special_values(ops):
    rows = ops[0]["inputs"]
    s = _seq_sum(rows)
    assert_bits_equal(ops[0]["avg"], s * (1.0 / W), "AVG")
    assert_bits_equal(ops[0]["premul"], _seq_sum([x * 0.375 for x in rows]), "PREMUL_SUM")
    assert_bits_equal(ops[2]["reduce"], s, "reduce at dst")
    assert_bits_equal(ops[0]["reduce"], rows[0], "reduce leaves non-root tensors")
    for dt in (torch.bfloat16, torch.float16):
        alone, offset = ops[1][f"dtype_{dt}"]
        assert_bits_equal(alone, _seq_sum([x.clamp(-6e4, 6e4).to(dt) for x in rows], dt), str(dt))
        assert_bits_equal(offset, alone, f"{dt} at an offset")
    want = _seq_sum(ops[0]["special_in"])
    got = ops[3]["special"]
    assert torch.equal(got.isnan(), want.isnan())
    assert_bits_equal(got[~got.isnan()], want[~want.isnan()], "inf/NaN/huge/subnormal")
    assert ops[0]["numel_0"].numel() == 0
    assert ops[0]["numel_1"].item() == 10.0


def test_passed_through_ops(ops):
    rows = ops[0]["inputs"]
    for rank, r in enumerate(ops):
        assert r["int_sum"].tolist() == [6, 4 * 2 ** 40 + 6]
        assert torch.equal(r["max"], torch.stack(rows).max(0).values)
        assert torch.equal(r["broadcast"], rows[1])
        assert torch.equal(r["all_gather_into_tensor"], torch.cat(rows))
        want = torch.cat([torch.arange(3 * rank, 3 * rank + 3, dtype=torch.float32) + 100 * s for s in range(W)])
        assert torch.equal(r["all_to_all"], want)
    assert ops[3]["p2p"].tolist() == [5.0, 6.0]
    assert_bits_equal(ops[1]["sub"], _seq_sum([rows[1], rows[3]]), "new_group([1, 3])")


def test_work_objects(ops):
    for r in ops:
        assert r["work_wait"] is True and r["work_done"]
        assert_bits_equal(r["work_future"], r["flat"]["alone"], "get_future")


@pytest.mark.parametrize("label,field", [("size", "numel"), ("dtype", "dtype")])
def test_mismatch_same_clear_error_everywhere(ops, label, field):
    msgs = [r[f"bad_{label}"] for r in ops]
    assert all(m is not None for m in msgs), msgs
    assert len(set(msgs)) == 1, msgs
    assert field in msgs[0]


def test_dead_peer_raises_within_timeout(ops):
    for r in ops[:3]:
        assert r["dead"] is not None, "a call whose peer never joined returned"
        assert r["dead"][2] < 3 + 10, r["dead"]

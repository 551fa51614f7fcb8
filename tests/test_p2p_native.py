"""The native point-to-point all-reduce (csrc/comm/p2p_all_reduce.cpp, ``flatcomm::p2p_sum_all_reduce_``):
the lossless fp32 all-reduce of a CPU group in one op, run by flatcomm.comm.flat where the Python
point-to-point path ran. It must give that path's bits (NaN payloads that differ between ranks,
infinities, signed zeros, subnormals; sum and avg; one chunk and several; 2 and 3 ranks), meet a peer
still on the Python path or on the staged path transfer for transfer, raise when a peer never sends
(after the group's timeout, the process alive), and name every bad argument."""
from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from flatcomm.tools import spawn


def _values(rank: int, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1009 * rank + seed)
    x = torch.randn(n, generator=g) * torch.exp2(torch.randint(-60, 60, (n,), generator=g).float())
    specials = torch.tensor([float("inf"), -float("inf"), -0.0, 0.0, 1e-45, -1e-40, 3.4e38])
    x[torch.randint(0, n, (64,), generator=g)] = specials.repeat(10)[:64]
    x[3::1001].view(torch.int32)[:] = 0x7FC00001 + rank  # NaNs whose payloads differ between ranks
    x[5::997].view(torch.int32)[:] = -0x400000 + 7 * rank
    return x


def _count_native_calls():
    """Wraps the op flatcomm.comm.flat calls; returns the list each call appends its tag base to."""
    import flatcomm.comm.flat as F

    calls = []
    real = F.ops

    class Counting:
        def __getattr__(self, name):
            def call(*a):
                calls.append(a[6] if len(a) > 6 else 0)
                return getattr(real, name)(*a)
            return call

    F.ops = Counting()
    return calls


def _native_and_python(rank: int, world: int, n: int, op: str, chunks) -> dict:
    import flatcomm.collectives as C
    import flatcomm.comm.p2p as Q

    calls = _count_native_calls()
    out = {}
    for path in ("native", "python"):
        if path == "python":
            Q.native_name = lambda group: None
        for rep in range(2):  # fresh values each time: nothing of the last call may leak in
            t = _values(rank, n, seed=rep)
            C.all_reduce(t, op=op, chunks=chunks)
            out[(path, rep)] = t.view(torch.int32).clone()
    out["native_calls"] = [bool(tag_base) for tag_base in calls]
    return out


@pytest.mark.parametrize("world,n,op,chunks", [
    (2, 1_500_000, "sum", None),   # the automatic chunk count (2 here)
    (2, 1_500_000, "avg", 1),
    (3, 1_200_096, "sum", 3),      # every piece a 16-byte multiple: the unstaged path at 3 ranks
    (3, 1_200_096, "avg", None),
])
def test_native_all_reduce_has_the_python_paths_bits(world, n, op, chunks):
    res = spawn.run(world, _native_and_python, n, op, chunks)
    for r in res:
        # The two native calls ran natively, the Python ones did not; the second ran on the plan
        # the first agreed (its tags carry it: flatcomm.comm.agreed), as did the Python path's.
        assert r["native_calls"] == [False, True]
        for rep in range(2):
            assert torch.equal(r[("native", rep)], r[("python", rep)]), f"rep {rep}"
            assert torch.equal(r[("native", rep)], res[0][("native", rep)])  # every rank the same bits


def _mixed_peers(rank: int, world: int, n: int, peer: str) -> dict:
    import flatcomm.collectives as C
    import flatcomm.comm.p2p as Q

    calls = _count_native_calls()
    residual = None
    if rank == 1 and peer == "python":
        Q.native_name = lambda group: None
    if rank == 1 and peer == "staged":  # an (empty) error-feedback residual: the staged path
        residual = C.ErrorFeedback.zeros(n)
    x = _values(rank, n, seed=11)
    t = x.clone()
    C.all_reduce(t, op="sum", chunks=3, residual=residual)
    return {"x": x, "t": t.view(torch.int32), "native_calls": len(calls)}


@pytest.mark.parametrize("peer", ["python", "staged"])
def test_native_rank_meets_a_peer_on_the_python_or_staged_path(peer):
    """Rank 0 native, rank 1 on the Python path (or staged, holding a residual): the same transfers
    and tags, so no hang and no garbage, and both get the fused kernel's sum."""
    from flatcomm.ops.codecs import decode_sum, encode, resolve

    n = 1_500_000
    a, b = spawn.run(2, _mixed_peers, n, peer)
    assert (a["native_calls"], b["native_calls"]) == (1, 0)
    c = resolve("fp32")
    want = decode_sum(torch.stack([encode(a["x"], c), encode(b["x"], c)]), c, n).view(torch.int32)
    assert torch.equal(a["t"], want) and torch.equal(b["t"], want)


def _silent_peer(rank: int, world: int) -> dict:
    import flatcomm.collectives as C
    import flatcomm.comm.flat as F

    if rank == 1:
        class Silent:  # passes the header check, then never sends
            def __getattr__(self, name):
                def fail(*a):
                    raise RuntimeError("rank 1 sends nothing")
                return fail
        F.ops = Silent()
    t = torch.randn(1_500_000)
    t0 = time.monotonic()
    try:
        C.all_reduce(t)
        err = None
    except RuntimeError as e:
        err = str(e)
    return {"err": err, "s": time.monotonic() - t0}


def test_a_peer_that_never_sends_raises_after_the_timeout():
    a, b = spawn.run(2, _silent_peer, timeout_s=4.0)
    assert b["err"] is not None and "rank 1 sends nothing" in b["err"]
    assert a["err"] is not None and a["s"] < 30  # the recv's wait is bounded by the group's timeout


def _bad_arguments(rank: int, world: int) -> dict:
    from flatcomm.ops.native import ops

    name = dist.new_group(backend="gloo").group_name
    ok = torch.arange(8, dtype=torch.float32)
    ops.p2p_sum_all_reduce_(ok, torch.empty(0), name, [0, 4, 8], 2, 0.5)  # one rank: the scaled values
    errors = {}
    for why, args in {
        "dtype": (torch.zeros(8, dtype=torch.float64), torch.empty(0), name, [0, 8], 1, 1.0),
        "bounds": (torch.zeros(8), torch.empty(0), name, [0, 4, 8], 1, 1.0),
        "outside": (torch.zeros(8), torch.empty(0), name, [0, 9], 1, 1.0),
        "backwards": (torch.zeros(8), torch.empty(0), name, [5, 2], 1, 1.0),
        "chunks": (torch.zeros(8), torch.empty(0), name, [0], -1, 1.0),
        "group": (torch.zeros(8), torch.empty(0), "no such group", [0, 8], 1, 1.0),
        "tags": (torch.zeros(8), torch.empty(0), name, [0, 8], 1, 1.0, (1 << 31) - 2),
    }.items():
        try:
            ops.p2p_sum_all_reduce_(*args)
            errors[why] = None
        except RuntimeError as e:
            errors[why] = str(e)
    return {"ok": ok, "errors": errors}


def test_bad_arguments_are_named():
    (r,) = spawn.run(1, _bad_arguments)
    assert torch.equal(r["ok"], torch.arange(8, dtype=torch.float32) * 0.5)
    e = r["errors"]
    assert "fp32" in e["dtype"]
    assert "world * (chunks + 1)" in e["bounds"]
    assert "outside the tensor" in e["outside"] and "outside the tensor" in e["backwards"]
    assert "chunks must be >= 0" in e["chunks"]
    assert "leaves no room" in e["tags"]
    assert e["group"] is not None

"""No hidden hangs: timeouts, flatcomm's private groups, call headers that catch mismatches that
validate=False used to let through, and argument errors that keep the group in step (2 gloo ranks,
short process-group timeouts so that a regression fails fast instead of hanging)."""
from __future__ import annotations

import os
import tempfile
import time
from datetime import timedelta
from typing import Dict

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import flatcomm
from flatcomm import collectives as C
from flatcomm.comm import context, header, worker
from flatcomm.tools import spawn

PG_TIMEOUT_S = 15.0


def _expect(fn, exc: type, *words: str) -> str:
    """Run fn; return '' when it raised ``exc`` with every word in its message, else what happened."""
    try:
        fn()
    except exc as e:
        msg = str(e)
        missing = [w for w in words if w not in msg]
        return f"missing {missing} in: {msg}" if missing else ""
    except Exception as e:  # noqa: BLE001
        return f"wrong exception {e!r}"
    return "no exception"


def _sum_ok(world: int, n: int = 777) -> bool:
    t = torch.full((n,), 1.0)
    C.all_reduce(t, op="sum")
    return bool((t == world).all())


def _same_wire_numels() -> tuple:
    """Two int8 sizes with the same payload size (a payload decoded with the wrong numel fits)."""
    for n in range(1000, 2000):
        if flatcomm.wire_bytes("int8", n) == flatcomm.wire_bytes("int8", n + 1):
            return n, n + 1
    raise AssertionError("no two int8 sizes share a wire size")


def _timeouts(rank: int, world: int) -> Dict[str, str]:
    out = {}
    want = timedelta(seconds=PG_TIMEOUT_S)
    out["world group timeout read back"] = "" if C.group_timeout() == want else str(C.group_timeout())
    g = C.private_group()
    out["private group inherits the timeout"] = "" if C.group_timeout(g) == want else str(C.group_timeout(g))
    out["private group is cached"] = "" if C.private_group() is g and C.private_group(g) is g else "new group"
    t = C.group_timeout(flatcomm.ddp.State("int8").ensure_group())  # what the hook's first call makes
    out["DDP hook group inherits the timeout"] = "" if t == want else f"{t}"
    # Handle.wait(timeout) raises a TimeoutError that names the call, and the call still completes.
    x = torch.full((1 << 12,), float(rank + 1))
    if rank == 1:
        time.sleep(1.0)
    h = C.all_reduce(x, op="sum", async_op=True)
    if rank == 0:
        out["wait(timeout) names the collective"] = _expect(lambda: h.wait(timeout=0.05), TimeoutError,
                                                            "all_reduce", "4096")
    h.wait()
    out["late wait() completes"] = "" if bool((x == world * (world + 1) / 2).all()) else "wrong sum"
    return out


def _headers(rank: int, world: int) -> Dict[str, str]:
    """validate=False (what DDP and FSDP pass after their first call) still fails cleanly."""
    out = {}
    out["all_reduce numel differs"] = _expect(
        lambda: C.all_reduce(torch.zeros(1000 + 300 * rank), codec="int8", validate=False), ValueError,
        "ranks disagree on numel: rank 0 1000, rank 1 1300")
    out["reduce_scatter numel differs"] = _expect(
        lambda: C.reduce_scatter(torch.zeros(100 + rank), torch.zeros(world * (100 + rank)), validate=False),
        ValueError, "numel")
    out["all_gather numel differs"] = _expect(
        lambda: C.all_gather(torch.zeros(world * (64 + 64 * rank)), torch.zeros(64 + 64 * rank), validate=False),
        ValueError, "numel")
    a, b = _same_wire_numels()
    n = a if rank == 0 else b
    out["same wire size, other numel"] = _expect(
        lambda: C.all_gather(torch.zeros(world * n), torch.zeros(n), codec="int8", validate=False),
        ValueError, f"numel: rank 0 {a}, rank 1 {b}")
    dt = torch.bfloat16 if rank == 0 else torch.float16
    out["dtype bf16 vs fp16 (names)"] = _expect(
        lambda: C.all_reduce(torch.zeros(512, dtype=dt), validate=False), ValueError,
        "ranks disagree on dtype: rank 0 torch.bfloat16, rank 1 torch.float16")
    ef = C.ErrorFeedback.zeros(512)
    out["failed check leaves the residual untouched"] = _expect(
        lambda: C.all_reduce(torch.randn(512).to(dt), codec="int8", residual=ef, validate=False), ValueError,
        "dtype") or ("" if not ef.client.any() and not ef.server.any() else "residual changed")
    out["codec bf16 vs fp16 (names)"] = _expect(
        lambda: C.all_reduce(torch.zeros(512), codec="bf16" if rank == 0 else "fp16", validate=False),
        ValueError, "ranks disagree on codec: rank 0 bf16, rank 1 fp16")
    out["block size differs"] = _expect(
        lambda: C.all_reduce(torch.zeros(1024), codec=flatcomm.Codec("int8", 64 if rank == 0 else 128),
                             validate=False), ValueError, "block_size: rank 0 64, rank 1 128")
    out["group usable afterwards"] = "" if _sum_ok(world) else "wrong sum"
    return out


def _in_step(rank: int, world: int) -> Dict[str, str]:
    """An argument error on one rank: every rank raises the same error ('rank r failed: ...', of
    the failed rank's exception type), and the next (different) call works on every rank."""
    out = {}
    res = C.ErrorFeedback.zeros(1000 - rank)  # wrong size on rank 1
    if rank == 1:
        out["failing rank raises its own error"] = _expect(
            lambda: C.all_reduce(torch.zeros(1000), codec="int8", residual=res), ValueError,
            "residual.client must be", "999")
    else:
        out["peer hears why"] = _expect(
            lambda: C.all_reduce(torch.zeros(1000), codec="int8", residual=res), ValueError,
            "rank 1 failed", "residual.client")
    out["next call (another codec and size) works"] = "" if _sum_ok(world, 333) else "wrong sum"
    bad = torch.zeros(64, dtype=torch.int32 if rank == 0 else torch.float32)
    if rank == 0:
        out["local TypeError"] = _expect(lambda: C.all_reduce(bad), TypeError, "float32")
    else:
        h = C.all_reduce(bad, async_op=True)
        out["async peer hears why on wait()"] = _expect(lambda: h.wait(timeout=PG_TIMEOUT_S), TypeError,
                                                        "rank 0 failed", "TypeError")
    out["group usable after a TypeError"] = "" if _sum_ok(world, 4099) else "wrong sum"
    # Out of step (a rank that issued one call more): caught by the call numbers on every rank,
    # and the numbering resumes together.
    g = C.private_group()
    if rank == 1:
        ctx = context.of(g)  # the header's call counter of that group: one call ahead
        worker.call(worker.key_of(g), lambda: ctx.set(header._CALLS, ctx.get(header._CALLS) + 1))
    out["out of step is named"] = _expect(lambda: C.all_reduce(torch.zeros(10)), RuntimeError,
                                          "out of step", "call number")
    out["in step again afterwards"] = "" if _sum_ok(world, 10) else "wrong sum"
    return out


def _own_group(rank: int, world: int) -> Dict[str, str]:
    """A user's collective on the default group while a flatcomm call is in flight, issued at
    different points of it on different ranks: flatcomm's traffic is on its own group."""
    n = 1 << 18
    x = torch.full((n,), float(rank + 1))
    y = torch.full((5,), float(rank + 1))
    if rank == 0:
        h = C.all_reduce(x, op="sum", chunks=4, async_op=True)
        dist.all_reduce(y)  # in flight on rank 0 while rank 1 has not even started its flatcomm call
        h.wait(timeout=PG_TIMEOUT_S)
    else:
        time.sleep(0.5)
        h = C.all_reduce(x, op="sum", chunks=4, async_op=True)
        h.wait(timeout=PG_TIMEOUT_S)
        dist.all_reduce(y)
    total = world * (world + 1) / 2
    ok = bool((x == total).all()) and bool((y == total).all())
    return {"user all_reduce during an async flatcomm call": "" if ok else "wrong values"}


SECTIONS = {"timeouts": _timeouts, "headers": _headers, "in_step": _in_step, "own_group": _own_group}


def _rank_main(rank: int, world: int) -> Dict[str, Dict[str, str]]:
    return {name: fn(rank, world) for name, fn in SECTIONS.items()}


_RESULTS: dict = {}


def _results():
    if "r" not in _RESULTS:
        try:
            _RESULTS["r"] = spawn.run(2, _rank_main, timeout_s=PG_TIMEOUT_S)
        except Exception as e:  # noqa: BLE001 - report in every item
            _RESULTS["r"] = e
    return _RESULTS["r"]


@pytest.mark.parametrize("section", list(SECTIONS))
def test_hangs(section: str) -> None:
    res = _results()
    if isinstance(res, Exception):
        pytest.fail(f"run failed: {str(res)[-3000:]}")
    failed = [f"rank {r}: {name}: {msg}" for r, per in enumerate(res) for name, msg in per[section].items() if msg]
    assert not failed, "\n".join(failed)


# ---- a stopped peer: the DDP hook fails at the process-group timeout -----------------------------

STOP_TIMEOUT_S = 4.0


def _stopped_peer(rank: int, world: int, flag: str) -> float:
    torch.manual_seed(0)
    ddp = DDP(torch.nn.Linear(16, 4))  # slow on a loaded machine (imports): under the long timeout
    # The hook's group is made at its first call and inherits the timeout the group has then.
    dist.group.WORLD.set_timeout(timedelta(seconds=STOP_TIMEOUT_S))
    flatcomm.ddp.register(ddp, "int8")
    for _ in range(2):
        ddp(torch.randn(8, 16)).sum().backward()
    loss = ddp(torch.randn(8, 16)).sum()
    if rank == 1:  # stops: never joins the third backward's all-reduce, stays alive
        deadline = time.monotonic() + 6 * STOP_TIMEOUT_S
        while not os.path.exists(flag) and time.monotonic() < deadline:
            time.sleep(0.1)
        return 0.0
    t0 = time.monotonic()
    try:
        loss.backward()
        elapsed = -1.0  # no error at all
    except RuntimeError:
        elapsed = time.monotonic() - t0
    open(flag, "w").close()
    return elapsed


def test_stopped_peer_fails_at_the_group_timeout() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        elapsed = spawn.run(2, _stopped_peer, os.path.join(tmp, "done"), timeout_s=60)[0]
    assert elapsed >= 0, "backward did not raise although a peer stopped"
    assert elapsed < 2.5 * STOP_TIMEOUT_S, f"raised after {elapsed:.1f} s, process-group timeout {STOP_TIMEOUT_S} s"

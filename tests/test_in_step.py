"""Every argument error keeps the group in step, on the flat path (2 and 4 ranks) and the two-level
path (2 x 2): the same exception, with the same message, on every rank of the call, raised without
waiting for a timeout, and the next call works everywhere. Also: a peer's header never crashes us
(exact topk ratio), and one rank returns the exact input for every codec.

One spawn per world size runs every case in order on every rank (start-up dominates on a small
machine); a case that broke the group shows up in the cases after it too. Rank ``P`` (the last) is
the perturbed one, so that on 4 ranks the messages must name global rank 3, not a rank of an inner
group.
"""
from __future__ import annotations

import time
from typing import Callable, Dict, List, Tuple

import pytest
import torch
import torch.distributed as dist

import flatcomm
from flatcomm import Topology
from flatcomm import collectives as C
from flatcomm import hierarchical as H
from flatcomm.comm import pipeline
from flatcomm.tools import spawn

PG_TIMEOUT_S = 20.0
SLOW_S = 8.0  # a case that took longer than this waited for a timeout somewhere

Case = Callable[[int, int, int, object], None]  # (rank, world, perturbed rank, topology)


def _pick(rank: int, p: int, good, bad):
    return bad if rank == p else good


# ---- flat cases -----------------------------------------------------------------------------------

FLAT: Dict[str, Case] = {
    "exact_block 0": lambda r, w, p, t: C.all_reduce(torch.ones(1000), mode="exact", exact_block=_pick(r, p, 256, 0)),
    "exact_block 256.5": lambda r, w, p, t: C.all_reduce(torch.ones(1000), mode="exact",
                                                         exact_block=_pick(r, p, 256, 256.5)),
    "chunks -1": lambda r, w, p, t: C.all_reduce(torch.ones(1000), codec="int8", chunks=_pick(r, p, None, -1)),
    "chunks 2.5": lambda r, w, p, t: C.all_reduce(torch.ones(1000), codec="int8", chunks=_pick(r, p, 2, 2.5)),
    "chunks 0": lambda r, w, p, t: C.all_reduce(torch.ones(1000), codec="int8", chunks=_pick(r, p, 1, 0)),
    "chunks True": lambda r, w, p, t: C.all_reduce(torch.ones(1000), codec="int8", chunks=_pick(r, p, 1, True)),
    "headroom -1": lambda r, w, p, t: C.all_reduce(torch.ones(1000), mode="exact", headroom=_pick(r, p, 8, -1)),
    "headroom 0": lambda r, w, p, t: C.all_reduce(torch.ones(1000), mode="exact", headroom=_pick(r, p, 8, 0)),
    "reduce_scatter chunks -1": lambda r, w, p, t: C.reduce_scatter(
        torch.zeros(100), torch.ones(100 * w), codec="int8", chunks=_pick(r, p, None, -1)),
    "reduce_scatter exact_block 0": lambda r, w, p, t: C.reduce_scatter(
        torch.zeros(100), torch.ones(100 * w), mode="exact", exact_block=_pick(r, p, 256, 0)),
    "requires_grad leaf (int8)": lambda r, w, p, t: C.all_reduce(
        torch.ones(1000, requires_grad=r == p), codec="int8"),
    "requires_grad leaf (fp32)": lambda r, w, p, t: C.all_reduce(torch.ones(1000, requires_grad=r == p)),
    "requires_grad all_gather output": lambda r, w, p, t: C.all_gather(
        torch.zeros(10 * w, requires_grad=r == p), torch.ones(10), codec="int8"),
    "meta tensor": lambda r, w, p, t: C.all_reduce(torch.ones(1000, device=_pick(r, p, "cpu", "meta")),
                                                   codec="int8"),
    "not a tensor": lambda r, w, p, t: C.all_reduce(_pick(r, p, torch.ones(10), [1.0] * 10)),
    "op max": lambda r, w, p, t: C.all_reduce(torch.ones(10), op=_pick(r, p, "sum", "max")),
    "codec 8": lambda r, w, p, t: C.all_reduce(torch.ones(10), codec=_pick(r, p, "int8", 8)),
    "codec unknown": lambda r, w, p, t: C.all_reduce(torch.ones(10), codec=_pick(r, p, "int8", "int2")),
    "mode list": lambda r, w, p, t: C.all_reduce(torch.ones(10), mode=_pick(r, p, "ordered", ["exact"])),
    "async_op 'yes'": lambda r, w, p, t: C.all_reduce(torch.ones(10), async_op=_pick(r, p, False, "yes")),
    "stats 5": lambda r, w, p, t: C.all_reduce(torch.ones(10), stats=_pick(r, p, None, 5)),
    "residual float64": lambda r, w, p, t: C.all_reduce(
        torch.ones(100), codec="int8",
        residual=C.ErrorFeedback.zeros(100) if r != p else C.ErrorFeedback(torch.zeros(100, dtype=torch.float64),
                                                                           torch.zeros(100))),
    "residual client None": lambda r, w, p, t: C.all_reduce(
        torch.ones(100), codec="int8",
        residual=C.ErrorFeedback.zeros(100) if r != p else C.ErrorFeedback(None, torch.zeros(100))),  # type: ignore[arg-type]
    "all_gather residual a list": lambda r, w, p, t: C.all_gather(
        torch.zeros(10 * w), torch.ones(10), codec="int8", residual=_pick(r, p, None, [0.0] * 10)),
    "codec auto, exact mode": lambda r, w, p, t: C.all_reduce(torch.ones(100), codec=_pick(r, p, "fp32", "auto"),
                                                              mode="exact"),
    "async: every rank fails on wait": lambda r, w, p, t: C.all_reduce(
        torch.ones(100), codec="int8", chunks=_pick(r, p, 1, -3), async_op=True).wait(timeout=PG_TIMEOUT_S),
}

# ---- two-level cases (2 x 2) ------------------------------------------------------------------------


def _two_level_residual_long(r, w, p, t):
    n = 5000
    ef = C.ErrorFeedback.zeros(H.shard_numel(n, t, "int8") + (r == p))
    C.all_reduce(torch.ones(n), codec="int8", topology=t, residual=ef)


def _numel_across_nodes(codec):
    # 4096 and 4095 pad to the same intra-node shard (2048): the node tier alone cannot tell.
    return lambda r, w, p, t: C.all_reduce(torch.ones(4096 - t.node), codec=codec, topology=t)


TWO_LEVEL: Dict[str, Case] = {
    "2L residual one too long": _two_level_residual_long,
    "2L float64 tensor": lambda r, w, p, t: C.all_reduce(
        torch.ones(1000, dtype=_pick(r, p, torch.float32, torch.float64)), topology=t),
    "2L numel differs across nodes (fp32)": _numel_across_nodes("fp32"),
    "2L numel differs across nodes (int8)": _numel_across_nodes("int8"),
    "2L inter codec differs across nodes, lossy intra": lambda r, w, p, t: C.all_reduce(
        torch.ones(4096), codec="int8" if t.node == 0 else "int4", intra_codec="bf16", topology=t),
    "2L chunks -1": lambda r, w, p, t: C.all_reduce(torch.ones(5000), codec="int8", topology=t,
                                                    chunks=_pick(r, p, None, -1)),
    "2L exact_block 0": lambda r, w, p, t: C.all_reduce(torch.ones(5000), mode="exact", topology=t,
                                                        exact_block=_pick(r, p, 256, 0)),
    "2L mode unknown": lambda r, w, p, t: C.all_reduce(torch.ones(5000), mode=_pick(r, p, "ordered", "fast"),
                                                       topology=t),
    "2L reduce_scatter residual size": lambda r, w, p, t: C.reduce_scatter(
        torch.zeros(64), torch.ones(64 * w), codec="int8", topology=t,
        residual=torch.zeros(64 * t.nodes + (r == p))),
    "2L all_gather residual size": lambda r, w, p, t: C.all_gather(
        torch.zeros(64 * w), torch.ones(64), codec="int8", topology=t, residual=torch.zeros(64 + (r == p))),
    "2L all_gather float64 on one rank": lambda r, w, p, t: C.all_gather(
        torch.zeros(64 * w), torch.ones(64, dtype=_pick(r, p, torch.float32, torch.float64)), topology=t),
    "2L residual a Tensor": lambda r, w, p, t: C.all_reduce(
        torch.ones(1000), codec="int8", topology=t, residual=_pick(r, p, None, torch.zeros(1000))),
    "2L auto with exact mode": lambda r, w, p, t: C.all_reduce(
        torch.ones(1000), codec=_pick(r, p, "fp32", "auto"), mode="exact", topology=t),
    "2L on all ranks but one (flat there)": lambda r, w, p, t: C.all_reduce(
        torch.ones(1000), codec="int8", topology=_pick(r, p, t, None)),
}


# ---- the per-rank driver ------------------------------------------------------------------------------


def _next_call_ok(world: int, topo) -> bool:
    t = torch.full((333,), 1.0)
    C.all_reduce(t, op="sum")
    ok = bool((t == world).all())
    if topo is not None:
        u = torch.full((1000,), 1.0)
        C.all_reduce(u, op="sum", codec="int8", topology=topo)
        ok = ok and bool((u == world).all())
    return ok


def _run_cases(rank: int, world: int, cases: Dict[str, Case], topo) -> Dict[str, Tuple[str, str, float, bool]]:
    out = {}
    p = world - 1
    for name, case in cases.items():
        t0 = time.monotonic()
        try:
            case(rank, world, p, topo)
            kind, msg = "no error", ""
        except Exception as e:  # noqa: BLE001 - every outcome is recorded
            kind, msg = type(e).__name__, str(e)
        took = time.monotonic() - t0
        try:
            nxt = _next_call_ok(world, topo)
        except Exception:  # noqa: BLE001
            nxt = False
        out[name] = (kind, msg, took, nxt)
    return out


def _chunk_exchanges(rank: int, world: int) -> int:
    """How many all-to-alls a call with 20000 chunks of a 1000-value tensor makes."""
    count = [0]
    real = pipeline.Pipeline.all_to_all

    def counting(*a, **k):
        count[0] += 1
        return real(*a, **k)

    pipeline.Pipeline.all_to_all = counting  # type: ignore[method-assign]
    try:
        x = torch.full((1000,), float(rank + 1))
        C.all_reduce(x, codec="int8", chunks=20000, op="sum")
        if not torch.allclose(x, torch.full((1000,), world * (world + 1) / 2), rtol=0.01):
            return -1
    finally:
        pipeline.Pipeline.all_to_all = real  # type: ignore[method-assign]
    return count[0]


def _zero_values(topo) -> List[str]:
    """Two-level calls of no values on every rank (a zero-segment pipeline used to wait forever)."""
    done = []
    for codec, intra in (("int8", "fp32"), ("fp32", "fp32"), ("topk", "fp32"), ("int8", "bf16")):
        x = torch.zeros(0)
        C.all_reduce(x, codec=codec, intra_codec=intra, topology=topo, residual=C.ErrorFeedback.zeros(0))
        C.reduce_scatter(torch.zeros(0), torch.zeros(0), codec=codec, intra_codec=intra, topology=topo)
        C.all_gather(torch.zeros(0), torch.zeros(0), codec=codec, intra_codec=intra, topology=topo)
        done.append(codec)
    C.all_reduce(torch.zeros(0), mode="exact", topology=topo)
    return done


def _rank_main(rank: int, world: int) -> dict:
    topo = Topology(local_size=2) if world == 4 else None
    res = {"flat": _run_cases(rank, world, FLAT, None)}
    if topo is not None:
        res["two_level"] = _run_cases(rank, world, TWO_LEVEL, topo)
        res["zero values"] = _zero_values(topo)
    try:
        res["chunk exchanges"] = _chunk_exchanges(rank, world)
    except Exception:  # noqa: BLE001 - a broken group from an earlier case
        res["chunk exchanges"] = -2
    return res


_RESULTS: dict = {}


def _results(world: int):
    if world not in _RESULTS:
        try:
            _RESULTS[world] = spawn.run(world, _rank_main, timeout_s=PG_TIMEOUT_S)
        except Exception as e:  # noqa: BLE001 - reported by every test of that world size
            _RESULTS[world] = e
    res = _RESULTS[world]
    if isinstance(res, Exception):
        pytest.fail(f"run failed: {str(res)[-3000:]}")
    return res


def _problems(per_rank: List[dict], name: str, world: int) -> List[str]:
    got = [r[name] for r in per_rank]
    out = []
    kinds = {(k, m) for k, m, _, _ in got}
    if len(kinds) != 1:
        out.append("ranks raised different errors:\n  " + "\n  ".join(f"rank {r}: {k}: {m}" for r, (k, m, _, _)
                                                                      in enumerate(got)))
    kind, msg = got[-1][0], got[-1][1]
    if kind == "no error":
        out.append("no error raised")
    elif not msg.startswith("flatcomm: "):
        out.append(f"not a flatcomm message: {kind}: {msg}")
    elif f"rank {world - 1}" not in msg:
        out.append(f"the message does not name global rank {world - 1}: {msg}")
    slow = [f"rank {r} {t:.1f} s" for r, (_, _, t, _) in enumerate(got) if t > SLOW_S]
    if slow:
        out.append("waited for a timeout: " + ", ".join(slow))
    broken = [r for r, (_, _, _, ok) in enumerate(got) if not ok]
    if broken:
        out.append(f"the next call failed on ranks {broken}")
    return out


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("name", list(FLAT))
def test_flat_in_step(world: int, name: str) -> None:
    problems = _problems([r["flat"] for r in _results(world)], name, world)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("name", list(TWO_LEVEL))
def test_two_level_in_step(name: str) -> None:
    problems = _problems([r["two_level"] for r in _results(4)], name, 4)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("world", [2, 4])
def test_chunks_capped(world: int) -> None:
    """A chunks count far above the data makes no empty exchanges (1000 int8 values: 4 blocks)."""
    counts = [r["chunk exchanges"] for r in _results(world)]
    assert all(0 < c <= 4 for c in counts), counts


def test_two_level_zero_values() -> None:
    assert all(r["zero values"] == ["int8", "fp32", "topk", "int8"] for r in _results(4))


# ---- a header that rounds would let a peer crash us -------------------------------------------------


def _topk_ratio(rank: int, world: int) -> dict:
    out = {}
    # 0.01 and 0.0100004 round to the same millionths, and keep 1000 vs 1001 of 100000 values.
    ratio = 0.01 if rank == 0 else 0.0100004
    for kind in ("all_reduce", "reduce_scatter", "all_gather"):
        c = flatcomm.Codec("topk", ratio=ratio)
        try:
            if kind == "all_reduce":
                C.all_reduce(torch.randn(200000), codec=c)
            elif kind == "reduce_scatter":
                C.reduce_scatter(torch.zeros(100000), torch.randn(100000 * world), codec=c)
            else:
                C.all_gather(torch.zeros(100000 * world), torch.randn(100000), codec=c)
            out[kind] = ("no error", "")
        except Exception as e:  # noqa: BLE001
            out[kind] = (type(e).__name__, str(e))
        out[kind + " next"] = _next_call_ok(world, None)
    return out


def test_topk_ratio_is_exact_in_the_header() -> None:
    try:
        res = spawn.run(2, _topk_ratio, timeout_s=PG_TIMEOUT_S)
    except Exception as e:  # noqa: BLE001
        pytest.fail(f"a peer's topk ratio crashed or hung the run: {str(e)[-2000:]}")
    for kind in ("all_reduce", "reduce_scatter", "all_gather"):
        a, b = res[0][kind], res[1][kind]
        assert a == b and a[0] == "ValueError" and "topk ratio" in a[1], (a, b)
        assert res[0][kind + " next"] and res[1][kind + " next"]


# ---- one rank: the exact input, every codec ----------------------------------------------------------


def _alone(rank: int, world: int) -> List[str]:
    bad = []
    g = torch.Generator().manual_seed(7)
    for codec in flatcomm.CODECS:
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            x = (torch.randn(1000, generator=g) * 3).to(dtype)
            for kind in ("all_reduce", "reduce_scatter", "all_gather"):
                for with_residual in (False, True):
                    r = torch.randn(1000, generator=g) if with_residual else None
                    want = x if r is None else (x.float() + r).to(dtype)
                    out = torch.empty_like(x)
                    if kind == "all_reduce":
                        out.copy_(x)
                        ef = None if r is None else C.ErrorFeedback(r.clone(), torch.zeros(1000))
                        C.all_reduce(out, codec=codec, residual=ef)
                        left = None if ef is None else ef.client
                    elif kind == "reduce_scatter":
                        left = None if r is None else r.clone()
                        C.reduce_scatter(out, x, codec=codec, residual=left)
                    else:
                        left = None if r is None else r.clone()
                        C.all_gather(out, x, codec=codec, residual=left)
                    if not torch.equal(out.view(torch.int16 if dtype != torch.float32 else torch.int32),
                                       want.view(torch.int16 if dtype != torch.float32 else torch.int32)):
                        err = (out.double() - want.double()).abs().max().item()
                        bad.append(f"{kind} {codec} {dtype} residual={with_residual}: max error {err}")
                    elif left is not None and dtype == torch.float32 and left.any():
                        bad.append(f"{kind} {codec} {dtype}: the residual was not sent (still nonzero)")
    return bad


def test_one_rank_returns_the_exact_input() -> None:
    bad = spawn.run(1, _alone, timeout_s=PG_TIMEOUT_S)[0]
    assert not bad, "\n".join(bad[:20])

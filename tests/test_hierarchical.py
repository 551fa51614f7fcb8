"""Topology and the two-level collectives on 4 gloo ranks (2 "nodes" x 2 ranks on one machine).

One spawn runs every section on every rank (start-up dominates on a small machine); each pytest
item asserts one section. Oracles: bitwise single-process plans of the two tiers built from the
flatcomm kernels (ordered fp32), float64 references with codec bounds (lossy), ``exact_sum`` and the
flat collectives themselves (exact mode: the same bits flat or hierarchical, any N x G).
"""
from __future__ import annotations

import random
import time
from typing import Dict, List, Tuple

import pytest
import torch
import torch.distributed as dist

import flatcomm
from flatcomm.comm import node as _node
from flatcomm import collectives as C
from flatcomm import hierarchical as H
from flatcomm.tools import spawn
from flatcomm import Topology

from _support.collectives import _with_delays, bits, same_bits
from _support import collectives as TC

WORLD = 4
G = 2
SECTIONS = ("topology", "ordered", "lossy", "determinism", "exact", "reduce_scatter", "all_gather",
            "error_feedback", "async", "bad_input")
Checks = List[Tuple[str, str, bool, str]]


def inputs(tag: str, n: int, dtype: torch.dtype = torch.float32, kind: str = "mixed") -> List[torch.Tensor]:
    return TC.inputs(tag, WORLD, n, dtype, kind)


def gather(t: torch.Tensor) -> List[torch.Tensor]:
    t = t.reshape(-1).float().contiguous()
    out = [torch.empty_like(t) for _ in range(WORLD)]
    dist.all_gather(out, t)
    return out


def node_sums(xs: List[torch.Tensor]) -> List[torch.Tensor]:
    """Each node's fp32 sum in ascending local-rank order (the intra tier, lossless)."""
    return [flatcomm.ordered_sum(torch.stack(xs[k * G:(k + 1) * G]).float()) for k in range(WORLD // G)]


def plan_all_reduce_fp32(xs: List[torch.Tensor], scale: float) -> torch.Tensor:
    """The documented two-level fp32 plan, bit for bit: node sums, their sum in node order, x scale."""
    total = flatcomm.ordered_sum(torch.stack(node_sums(xs)))
    return (total * scale if scale != 1.0 else total).to(xs[0].dtype)


_Log = TC._Log
_expect = TC._expect


# ---- sections -------------------------------------------------------------------------------------


def _topology(log: _Log, rank: int, topo: Topology) -> None:
    s = "topology"
    log.add(s, "2 x 2 shape", (topo.nodes, topo.local_size, topo.node, topo.local_rank, topo.flat)
            == (2, 2, rank // 2, rank % 2, False), repr(topo))
    intra = dist.get_process_group_ranks(topo.intra_group)
    inter = dist.get_process_group_ranks(topo.inter_group)
    log.add(s, "intra group = my node", intra == [rank // 2 * 2, rank // 2 * 2 + 1], str(intra))
    log.add(s, "inter group = my local rank", inter == [rank % 2, rank % 2 + 2], str(inter))
    again = Topology(local_size=2)
    log.add(s, "groups created once (cached)", again.intra_group is topo.intra_group
            and again.inter_group is topo.inter_group)
    log.add(s, "timeout inherited from the parent group", topo.timeout is not None
            and abs(topo.timeout.total_seconds() - 60.0) < 1e-6, str(topo.timeout))
    for g, why in ((1, "G = 1"), (4, "N = 1")):
        t = Topology(local_size=g)
        log.add(s, f"local_size={g} is flat and says so", t.flat and why in t.reason
                and t.describe()["hierarchical"] is False and t.intra_group is None, repr(t))
    env = Topology.from_env(env={"LOCAL_WORLD_SIZE": "2", "LOCAL_RANK": str(rank % 2)})
    log.add(s, "from_env LOCAL_WORLD_SIZE=2", not env.flat and env.intra_group is topo.intra_group)
    none = Topology.from_env(env={})
    log.add(s, "from_env without LOCAL_WORLD_SIZE is flat", none.flat and "LOCAL_WORLD_SIZE" in none.reason)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    mt = Topology.from_mesh(mesh, inter_dim="replicate", intra_dim="shard")
    log.add(s, "from_mesh 2 x 2", (mt.nodes, mt.local_size, mt.node, mt.local_rank, mt.flat)
            == (2, 2, rank // 2, rank % 2, False), repr(mt))
    x = inputs("mesh", 3000)[rank]
    a, b = x.clone(), x.clone()
    C.all_reduce(a, topology=mt)
    C.all_reduce(b, topology=topo)
    log.bitwise(s, "mesh topology == local_size topology", a, b)


def _ordered(log: _Log, rank: int, topo: Topology) -> None:
    """fp32 (and bf16 data) hierarchical all_reduce == the two-tier plan, bit for bit."""
    s = "ordered"
    for n in (1, 7, 1000, 5003, 40000):
        for op, scale in (("avg", 0.25), ("sum", 1.0)):
            for dtype in (torch.float32, torch.bfloat16):
                xs = inputs(f"ord/{n}/{dtype}", n, dtype)
                t = xs[rank].clone()
                C.all_reduce(t, op=op, topology=topo, chunks=2 if n > 1000 else None)
                log.bitwise(s, f"n={n} {op} {dtype} == plan", t, plan_all_reduce_fp32(xs, scale))
    xs = inputs("ord/zeros", 3000)
    t = torch.zeros(3000)
    C.all_reduce(t, topology=topo)
    log.add(s, "zeros stay zeros", bool((bits(t) == 0).all()))
    xs = inputs("ord/nan", 3000)
    xs[1][17] = float("nan")
    xs[2][2900] = float("inf")
    t = xs[rank].clone()
    C.all_reduce(t, topology=topo)
    log.add(s, "nan and inf propagate to their element only", bool(t[17].isnan()) and bool(t[2900].isinf())
            and int((~torch.isfinite(t)).sum()) == 2)


def _bound(parts: List[torch.Tensor], qmax: int, block: int) -> torch.Tensor:
    """float64 bound for two quantisation stages of the inter tier (first stage: each node's sum,
    second: the reduced shard), plus fp32 rounding."""
    n = parts[0].numel()
    mag = sum(p.double().abs() for p in parts)
    nb = -(-n // block)
    bm = torch.nn.functional.pad(mag, (0, nb * block - n)).view(nb, block).amax(1).repeat_interleave(block)[:n]
    return (len(parts) + 1) * bm / qmax * 0.5 * (1 + 2.0**-10) + mag * 2.0**-20 + 2.0**-140


def _lossy(log: _Log, rank: int, topo: Topology) -> None:
    s = "lossy"
    for codec, qmax in (("int8", 127), ("int4", 7)):
        for n in (1000, 9000):
            xs = inputs(f"lossy/{codec}/{n}", n)
            t = xs[rank].clone()
            st = H.TierStats()
            C.all_reduce(t, codec=codec, op="sum", topology=topo, stats=st)
            ref = sum(x.double() for x in xs)
            err = (t.double() - ref).abs()
            bound = _bound(node_sums(xs), qmax, 256)
            bad = ~(err <= bound)
            log.add(s, f"{codec} n={n} within the two-stage bound", not bool(bad.any()),
                    f"{int(bad.sum())} outside; max err/bound {float((err / bound).max()):.3f}")
            TC._identical_across_ranks(log, s, f"{codec} n={n} same bits on every rank", t)
            # one-hop across 2 nodes: the other node's piece, then the widest reduced piece
            b = C.shard_bounds(H.shard_numel(n, topo, codec), 2, 256)
            pieces = [flatcomm.wire_bytes(codec, b[k + 1] - b[k]) for k in range(2)]
            wire = pieces[1 - topo.node] + max(pieces)
            log.add(s, f"{codec} n={n} inter tier moves compressed bytes only",
                    st.inter.wire_bytes == wire and st.inter.calls == 1,
                    f"inter {st.inter.wire_bytes} B, expected {wire}")
            # the node: the fp32 reduce-scatter, then a gather of the payloads (one width for the node)
            m = H.padded_shard(n, G, 256)
            width = max(flatcomm.wire_bytes(codec, hi - lo) for lr in range(G)
                        for bb in [C.shard_bounds(max(0, min(m, n - lr * m)), 2, 256)]
                        for lo, hi in zip(bb, bb[1:]))
            node = (G - 1) * m * 4 + (G - 1) * 2 * width
            log.add(s, f"{codec} n={n} node tier gathers payloads, not fp32", st.intra.wire_bytes == node,
                    f"intra {st.intra.wire_bytes} B, expected {node}")
    # bf16 as the intra codec: lossy inside the node too, still the same bits on every rank
    xs = inputs("lossy/intra", 5000)
    t = xs[rank].clone()
    C.all_reduce(t, codec="int8", intra_codec="bf16", topology=topo)
    TC._identical_across_ranks(log, s, "intra bf16 + inter int8: same bits on every rank", t)
    ref = sum(x.double() for x in xs) / WORLD
    rel = float((t.double() - ref).abs().max() / ref.abs().max())
    log.add(s, "intra bf16 + inter int8: close to the mean", rel < 0.05, f"rel err {rel:.3g}")


def _node_delays(seed: int, max_s: float):
    """Every node-tier transfer (the two-level path's direct sends) starts after a random delay."""
    rng = random.Random(seed)
    orig = _node._exchange

    def exchange(ops):
        time.sleep(rng.random() * max_s)
        orig(ops)

    _node._exchange = exchange
    return lambda: setattr(_node, "_exchange", orig)


def _determinism(log: _Log, rank: int, topo: Topology) -> None:
    """Same bits every repeat, with random per-rank delays before calls and between chunks."""
    s = "determinism"
    n = 20000
    rng = random.Random(7 + rank)
    runs: Dict[str, List[torch.Tensor]] = {}
    for rep in range(3):
        undo = _with_delays(rep * 31 + rank, 0.003)
        undo_node = _node_delays(rep * 37 + rank, 0.003)
        try:
            for codec in ("fp32", "int8", "sign"):
                x = inputs(f"det/{codec}", n)[rank]
                ef = C.ErrorFeedback.zeros(H.shard_numel(n, topo, codec)) if codec != "fp32" else None
                for step in range(2):  # the second step sends residuals: still the same bits
                    time.sleep(rng.random() * 0.005)
                    t = x.clone()
                    C.all_reduce(t, codec=codec, residual=ef, chunks=3, topology=topo)
                    runs.setdefault(f"{codec} step {step}", []).append(t)
            x = inputs("det/exact", n)[rank]
            t = x.clone()
            C.all_reduce(t, mode="exact", topology=topo)
            runs.setdefault("exact", []).append(t)
        finally:
            undo()
            undo_node()
    for k, v in runs.items():
        log.add(s, f"{k}: same bits in 3 delayed runs", all(same_bits(v[0], u) for u in v[1:]))
        TC._identical_across_ranks(log, s, f"{k}: same bits on every rank", v[0])
    log.bitwise(s, "fp32 == plan", runs["fp32 step 0"][0], plan_all_reduce_fp32(inputs("det/fp32", n), 0.25))


def _exact(log: _Log, rank: int, topo: Topology) -> None:
    """Exact mode: the same bits flat and hierarchical, for 1x4, 2x2 and 4x1, and == exact_sum."""
    s = "exact"
    shapes = {"flat": None, "1x4": Topology(local_size=4), "2x2": topo, "4x1": Topology(local_size=1)}
    for kind in ("mixed", "wide"):
        for dtype in (torch.float32, torch.bfloat16):
            for n in (7, 5003, 3 * 256 * 4):
                xs = inputs(f"exact/{kind}/{dtype}/{n}", n, dtype)
                if kind == "wide":  # heavy cancellation across nodes: rank 2 holds -x0 + tiny
                    xs[2] = (-xs[0].float() + xs[2].float() * 2.0**-20).to(dtype)
                for op, scale in (("sum", 1.0), ("avg", 0.25)):
                    got = {}
                    for name, t in shapes.items():
                        y = xs[rank].clone()
                        C.all_reduce(y, mode="exact", op=op, topology=t)
                        got[name] = y
                    ref = flatcomm.exact_sum(torch.stack(xs))
                    ref = (ref * scale if scale != 1.0 else ref).to(dtype)
                    tag = f"{kind} {dtype} n={n} {op}"
                    for name in ("1x4", "2x2", "4x1"):
                        log.bitwise(s, f"{tag}: {name} == flat", got[name], got["flat"])
                    log.bitwise(s, f"{tag}: == exact_sum", got["2x2"], ref)
    # permuting which rank holds which input does not change the bits either
    xs = inputs("exact/perm", 4000)
    a, b = xs[rank].clone(), xs[[2, 0, 3, 1][rank]].clone()
    C.all_reduce(a, mode="exact", topology=topo)
    C.all_reduce(b, mode="exact", topology=topo)
    log.bitwise(s, "rank permutation: same bits", a, b)
    xs = inputs("exact/nan", 1000)
    xs[3][5] = float("inf")
    y = xs[rank].clone()
    C.all_reduce(y, mode="exact", topology=topo)
    log.add(s, "inf: its block is NaN, others finite", bool(y[5].isnan()) and bool(torch.isfinite(y[256:]).all()))


def _reduce_scatter(log: _Log, rank: int, topo: Topology) -> None:
    s = "reduce_scatter"
    for width in (1, 300, 1024):
        xs = inputs(f"rs/{width}", WORLD * width)
        out = torch.empty(width)
        C.reduce_scatter(out, xs[rank].clone(), topology=topo)
        piece = [x[rank * width:(rank + 1) * width] for x in xs]
        log.bitwise(s, f"fp32 width={width} == plan", out, plan_all_reduce_fp32(piece, 0.25))
        for dtype in (torch.float32, torch.bfloat16):
            ys = [x.to(dtype) for x in inputs(f"rs/exact/{width}", WORLD * width, kind="wide")]
            outs = []
            for t in (None, topo, Topology(local_size=4)):
                o = torch.empty(width, dtype=dtype)
                C.reduce_scatter(o, ys[rank].clone(), mode="exact", op="sum", topology=t)
                outs.append(o)
            log.bitwise(s, f"exact {dtype} width={width}: 2x2 == flat", outs[1], outs[0])
            log.bitwise(s, f"exact {dtype} width={width}: 1x4 == flat", outs[2], outs[0])
            ref = flatcomm.exact_sum(torch.stack([y[rank * width:(rank + 1) * width] for y in ys])).to(dtype)
            log.bitwise(s, f"exact {dtype} width={width}: == exact_sum", outs[1], ref)
    width = 2048
    xs = inputs("rs/int8", WORLD * width)
    out = torch.empty(width)
    res = torch.zeros(2 * width)
    C.reduce_scatter(out, xs[rank].clone(), codec="int8", op="sum", topology=topo, residual=res)
    ref = sum(x[rank * width:(rank + 1) * width].double() for x in xs)
    err = float((out.double() - ref).abs().max() / ref.abs().max())
    log.add(s, "int8 with residual close to the sum", err < 0.02 and bool(res.abs().sum() > 0), f"rel err {err:.3g}")


def _all_gather(log: _Log, rank: int, topo: Topology) -> None:
    """Hierarchical all-gather == flat all-gather, bit for bit (same payloads decoded)."""
    s = "all_gather"
    for codec in ("fp32", "int8", "sign"):
        for n in (5, 1000):
            x = inputs(f"ag/{codec}/{n}", n)[rank]
            flat, hier = torch.empty(WORLD * n), torch.empty(WORLD * n)
            C.all_gather(flat, x.clone(), codec=codec)
            C.all_gather(hier, x.clone(), codec=codec, topology=topo)
            log.bitwise(s, f"{codec} n={n}: hierarchical == flat", hier, flat)
    x = inputs("ag/bf16", 500, torch.bfloat16)
    out = torch.empty(WORLD * 500, dtype=torch.bfloat16)
    C.all_gather(out, x[rank].clone(), topology=topo)
    log.bitwise(s, "bf16 rows in rank order", out, torch.cat(x))


def _error_feedback(log: _Log, rank: int, topo: Topology) -> None:
    """Nothing is lost: sum of outputs + every tier residual == steps x the true sum."""
    s = "error_feedback"
    # n = 3000 is not a multiple of G x 256: the padded tail takes part too; in 3 segments the last
    # local rank's data ends inside the last one; at n = 200 it has none
    for codec, steps, n, chunks in (("int8", 30, 3000, None), ("int8", 30, 3000, 3), ("int8", 30, 200, 2),
                                    (flatcomm.Codec("sign", 32), 60, 3000, None)):
        name = codec if isinstance(codec, str) else codec.name
        name += f" n={n} chunks={chunks}"
        xs = inputs(f"ef/{name}", n, kind="normal")
        m = H.padded_shard(n, G, 256 if codec == "int8" else 32)
        real = H.shard_numel(n, topo, codec)
        log.add(s, f"{name}: residual covers this rank's data", real == max(0, min(m, n - topo.local_rank * m)),
                str(real))
        ef = C.ErrorFeedback.zeros(real)
        acc = torch.zeros(n, dtype=torch.float64)
        for _ in range(steps):
            y = xs[rank].clone()
            C.all_reduce(y, codec=codec, op="sum", residual=ef, topology=topo, chunks=chunks)
            acc += y.double()
        # rank r's residuals cover shard r % G of its node's sum
        held = gather(torch.nn.functional.pad(ef.client + ef.server, (0, m - real)))
        total = torch.zeros(G * m, dtype=torch.float64)
        for r in range(WORLD):
            lr = r % G
            total[lr * m:(lr + 1) * m] += held[r].double()
        truth = steps * sum(x.double() for x in xs)
        gap = float((acc + total[:n] - truth).abs().max() / truth.abs().max())
        log.add(s, f"{name}: outputs + residuals == steps x sum", gap < 1e-5, f"rel gap {gap:.3g}")
        plain = xs[rank].clone()
        C.all_reduce(plain, codec=codec, op="sum", topology=topo, chunks=chunks)
        e_avg = float((acc / steps - truth / steps).abs().max())
        e_one = float((plain.double() - truth / steps).abs().max())
        log.add(s, f"{name}: time average beats one step", e_avg < e_one / 3, f"{e_avg:.3g} vs {e_one:.3g}")
    # a lossy intra codec with its own tier state
    xs = inputs("ef/tiered", 2000, kind="normal")
    fb = H.TieredFeedback.zeros(2000, topo, "int8", "bf16")
    for _ in range(3):
        y = xs[rank].clone()
        C.all_reduce(y, codec="int8", intra_codec="bf16", residual=fb, topology=topo, chunks=2)
    log.add(s, "TieredFeedback: both tiers hold residuals",
            bool(fb.intra.client.abs().sum() > 0) and bool(fb.inter.client.abs().sum() > 0))


def _async(log: _Log, rank: int, topo: Topology) -> None:
    s = "async"
    xs = [inputs(f"async/{i}", 6000)[rank].clone() for i in range(3)]
    hs = [C.all_reduce(xs[0], codec="int8", topology=topo, async_op=True),
          C.all_reduce(xs[1], mode="exact", topology=topo, async_op=True)]
    C.all_reduce(xs[2], topology=topo)
    for h in hs:
        h.wait(timeout=60)
    log.add(s, "handles complete", all(h.is_completed() for h in hs))
    got = hs[0].get_future().wait()
    log.add(s, "future gives the tensor", got is xs[0])
    log.bitwise(s, "sync after async == plan", xs[2], plan_all_reduce_fp32(inputs("async/2", 6000), 0.25))
    ref = flatcomm.exact_sum(torch.stack(inputs("async/1", 6000))) * 0.25
    log.bitwise(s, "async exact == exact_sum / world", xs[1], ref)


def _bad_input(log: _Log, rank: int, topo: Topology) -> None:
    _expect(log, "uneven nodes", ValueError, lambda: Topology(local_size=3), ("uneven", "local_size=3"))
    _expect(log, "ranks disagree on LOCAL_WORLD_SIZE", ValueError,
            lambda: Topology.from_env(env={"LOCAL_WORLD_SIZE": "2" if rank else "4"}), ("LOCAL_WORLD_SIZE",))
    _expect(log, "LOCAL_RANK against the numbering", ValueError,
            lambda: Topology.from_env(env={"LOCAL_WORLD_SIZE": "2", "LOCAL_RANK": str(1 - rank % 2)}),
            ("LOCAL_RANK",))
    _expect(log, "local_size 0", ValueError, lambda: Topology(local_size=0), ("local_size",))
    n = 1000
    m = H.shard_numel(n, topo, "int8")
    _expect(log, "full-size ErrorFeedback", ValueError,
            lambda: C.all_reduce(torch.zeros(n), codec="int8", residual=C.ErrorFeedback.zeros(n), topology=topo),
            ("shard", str(m)))
    _expect(log, "residual not an ErrorFeedback", TypeError,
            lambda: C.all_reduce(torch.zeros(n), codec="int8", residual=torch.zeros(m), topology=topo))
    _expect(log, "intra state with a lossless intra codec", ValueError,
            lambda: C.all_reduce(torch.zeros(n), codec="int8", topology=topo,
                                 residual=H.TieredFeedback.zeros(n, topo, "int8", "bf16")), ("lossless",))
    _expect(log, "exact reduce_scatter past the headroom", ValueError,
            lambda: C.reduce_scatter(torch.zeros(256), torch.zeros(1024), mode="exact", headroom=1,
                                     topology=topo), ("headroom",))
    _expect(log, "exact with int8", ValueError,
            lambda: C.all_reduce(torch.zeros(n), codec="int8", mode="exact", topology=topo), ("exact",))
    _expect(log, "group and topology both", ValueError,
            lambda: C.all_reduce(torch.zeros(n), group=topo.intra_group, topology=topo), ("topology",))
    _expect(log, "topology of the wrong type", TypeError,
            lambda: H.all_reduce(torch.zeros(n), 2), ("Topology",))
    _expect(log, "reduce_scatter sizes", ValueError,
            lambda: C.reduce_scatter(torch.zeros(10), torch.zeros(41), topology=topo), ("world size",))
    _expect(log, "reduce_scatter residual size", ValueError,
            lambda: C.reduce_scatter(torch.zeros(10), torch.zeros(40), codec="int8", topology=topo,
                                     residual=torch.zeros(40)), ("20",))
    _expect(log, "all_gather sizes", ValueError,
            lambda: C.all_gather(torch.zeros(41), torch.zeros(10), topology=topo), ("world size",))
    _expect(log, "int64 tensor", TypeError,
            lambda: C.all_reduce(torch.zeros(n, dtype=torch.int64), topology=topo))
    # ranks that disagree on numel fail on every rank (the tier's consistency check), no hang
    _expect(log, "numel differs across nodes", ValueError,
            lambda: C.all_reduce(torch.zeros(4096 + 512 * (rank // 2)), topology=topo), ("numel",))
    # one node's ranks disagree on the codec: every rank of both nodes sees it in the call's
    # header among all ranks (global ranks named), instead of waiting for payloads
    _expect(log, "codec differs inside one node", ValueError,
            lambda: C.all_reduce(torch.zeros(4096), codec="int4" if rank == 1 else "int8", topology=topo),
            ("ranks disagree on codec: rank 0 int8, rank 1 int4, rank 2 int8, rank 3 int8",))
    t = torch.full((1000,), float(rank + 1))
    C.all_reduce(t, op="sum", topology=topo)
    log.add("bad_input", f"rank {rank}: usable afterwards", bool((t == 10).all()))


_SECTIONS = {
    "topology": _topology, "ordered": _ordered, "lossy": _lossy, "determinism": _determinism,
    "exact": _exact, "reduce_scatter": _reduce_scatter, "all_gather": _all_gather,
    "error_feedback": _error_feedback, "async": _async, "bad_input": _bad_input,
}


def _rank_main(rank: int, world: int) -> Checks:
    from flatcomm.comm import streams as _streams

    def boom(*a, **k):
        raise AssertionError("CallStreams built for CPU tensors")

    _streams.CallStreams = boom  # the two-level path's CUDA stream handling stays off the CPU path
    log = _Log(rank)
    topo = Topology(local_size=G)
    for section, fn in _SECTIONS.items():
        t0 = time.perf_counter()
        try:
            fn(log, rank, topo)
        except Exception as e:  # noqa: BLE001 - report it; the other sections still run
            import traceback

            log.add(section, "raised", False, traceback.format_exc()[-2000:])
            raise
        log.add(section, "__time__", True, f"{time.perf_counter() - t0:.2f}")
    return log.checks


_RESULTS: Checks = []


def _results() -> Checks:
    if not _RESULTS:
        try:
            per_rank = spawn.run(WORLD, _rank_main, timeout_s=60.0)
        except Exception as e:  # noqa: BLE001
            _RESULTS.extend((s, "spawn", False, str(e)[-4000:]) for s in SECTIONS)
        else:
            _RESULTS.extend(c for checks in per_rank for c in checks)
    return _RESULTS


@pytest.mark.parametrize("section", SECTIONS)
def test_hierarchical(section: str) -> None:
    checks = [c for c in _results() if c[0] == section and c[1] != "__time__"]
    assert checks, f"no checks ran for {section}"
    failed = [f"{name}: {msg}" for _, name, ok, msg in checks if not ok]
    assert not failed, f"{len(failed)} of {len(checks)} checks failed:\n" + "\n".join(failed[:30])


def test_shard_numel() -> None:
    """The inter-tier EF size: G shards of whole codec blocks covering numel (no process group)."""
    topo = Topology.__new__(Topology)
    topo.local_size, topo.local_rank = 4, 0
    assert H.shard_numel(1, topo, "int8") == 1
    assert H.shard_numel(4 * 256, topo, "int8") == 256
    assert H.shard_numel(4 * 256 + 1, topo, "int8") == 512
    assert H.shard_numel(1000, topo, "fp32") == 256  # fp32: 32-value alignment
    assert H.shard_numel(1000, topo, flatcomm.Codec("int4", 1024)) == 1000
    assert H.shard_numel(1000, topo, mode="exact", exact_block=128) == 256
    topo.local_rank = 3
    assert H.shard_numel(4 * 256 + 1, topo, "int8") == 0  # 2 x 512 hold it all: nothing left here
    assert H.shard_numel(1000, topo, "fp32") == 1000 - 3 * 256
    assert H.padded_shard(4 * 256 + 1, 4, 256) == 512

"""``python -m flatcomm.bench backend``: the flatcomm backend against its inner gloo, in one run.

    python -m flatcomm.bench backend [--ranks 4] [--sizes 4K,1M,100M] [--reps 5] [--ops all_reduce]
                                     [--steps 0] [--json PATH] [--routes-off small-native,native]
                                     [--dtype bf16]

One spawn of ``--ranks`` ranks on ``init_process_group("flatcomm")``. Per message size (bytes of
``--dtype`` values, fp32 by default) and op (all_reduce, reduce_scatter, all_gather) it times gloo's own call (on a gloo group
made beside it), the backend's ordered sum and its exact sum, interleaved rep by rep (each in every
place of the order in turn) so that a load change on a shared machine hits all three alike; then a
DDP step and an FSDP2 step on each. Times
are rank 0's, each rep after a barrier; the table gives the median, the ratio to gloo's median and
the spread of the per-rep ratios (min..max). all_gather is passed through (its ratio is the cost of
the Python dispatch). ``--ops`` narrows the ops, ``--steps 0`` leaves out the training steps: e.g. the
small-message latency alone, ``--ranks 2 --sizes 4K,64K,1M --ops all_reduce --reps 200 --steps 0``.
``--routes-off`` runs the backend with those routes turned off (``FLATCOMM_ROUTES_OFF``,
:mod:`flatcomm.comm.route`): a run with and one without are a route's A/B, each against gloo in its
own run.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Dict, List

from flatcomm.tools._cli import format_size, parse_size, say

OPS = ("all_reduce", "reduce_scatter", "all_gather")
VARIANTS = ("gloo", "ordered", "exact")


def _reps_for(nbytes: int, reps: int) -> int:
    return max(reps, min(50, (4 << 20) // max(nbytes, 1)))


def _call(op: str, group, x, out):
    import torch.distributed as dist

    if op == "all_reduce":
        dist.all_reduce(x, group=group)
    elif op == "reduce_scatter":
        dist.reduce_scatter_single(out, x, group=group)
    else:
        dist.all_gather_single(out, x, group=group)


def _rotated(i: int) -> tuple:
    """The variants in rep i's order: each takes every place in turn. With a fixed order the
    variant timed third came out ~0.5 ms faster per DDP step than the one timed second, whichever
    it was (2 ranks on 2 cores): a fixed order biases the ratios."""
    k = i % len(VARIANTS)
    return VARIANTS[k:] + VARIANTS[:k]


DTYPES = ("fp32", "bf16", "fp16")


def _ops(groups: dict, sizes: List[int], reps: int, world: int, ops=OPS, dtype_name: str = "fp32") -> List[dict]:
    import torch
    import torch.distributed as dist

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype_name]
    size = torch.finfo(dtype).bits // 8
    rows = []
    for nbytes in sizes:
        n = max(world, nbytes // size // world * world)
        for op in ops:
            if dist.get_rank() == 0:
                say("bench", f"backend: {op} {format_size(size * n)}B {dtype_name} ...")
            x = torch.randn(n).to(dtype)
            out = torch.empty(n // world if op == "reduce_scatter" else n, dtype=dtype)
            src = x[:n // world].clone() if op == "all_gather" else x  # all_gather: n values out
            times: Dict[str, List[float]] = {v: [] for v in VARIANTS}
            k = _reps_for(nbytes, reps)
            for rep in range(k + 1):  # rep 0: warm-up (private groups, buffers)
                for v in _rotated(rep):
                    dist.barrier(group=groups["gloo"])
                    t0 = time.perf_counter()
                    _call(op, groups[v], src if op == "all_gather" else x.clone() if op == "all_reduce" else x, out)
                    if rep:
                        times[v].append(time.perf_counter() - t0)
            rows.append({"kind": "op", "op": op, "bytes": n * size, "dtype": dtype_name, "reps": k, "times": times})
    return rows


def _steps(groups: dict, rank: int, steps: int) -> List[dict]:
    import torch
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    def mlp():
        torch.manual_seed(0)
        return torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(4)])  # 4.2M params

    rows = []
    x = torch.randn(16, 1024, generator=torch.Generator().manual_seed(rank))
    for kind in ("ddp", "fsdp2"):
        if rank == 0:
            say("bench", f"backend: {kind} steps ...")
        runs = {}
        for v in VARIANTS:
            model = mlp()
            if kind == "ddp":
                model = torch.nn.parallel.DistributedDataParallel(model, process_group=groups[v])
            else:
                mesh = DeviceMesh.from_group(groups[v], "cpu")
                for layer in model:
                    fully_shard(layer, mesh=mesh)
                fully_shard(model, mesh=mesh)
            runs[v] = (model, torch.optim.SGD(model.parameters(), lr=1e-3))
        times: Dict[str, List[float]] = {v: [] for v in VARIANTS}
        for s in range(steps + 1):
            for v in _rotated(s):  # interleaved step by step, as the ops rep by rep
                model, opt = runs[v]
                torch.distributed.barrier(group=groups["gloo"])
                t0 = time.perf_counter()
                model(x).square().mean().backward()
                opt.step()
                opt.zero_grad()
                if s:
                    times[v].append(time.perf_counter() - t0)
        rows.append({"kind": "step", "op": kind, "bytes": 4 * sum(p.numel() for p in mlp().parameters()),
                     "reps": steps, "times": times})
    return rows


def _rank_main(rank: int, world: int, sizes: List[int], reps: int, steps: int, ops=OPS,
               routes_off: str = "", dtype_name: str = "fp32") -> List[dict]:
    import os

    import torch.distributed as dist

    import flatcomm.backend as fb
    from flatcomm.comm.route import ROUTES_OFF_ENV

    os.environ[ROUTES_OFF_ENV] = routes_off  # (before any call decides a route)
    groups = {"gloo": dist.new_group(backend="gloo"), "ordered": dist.new_group(), "exact": dist.new_group()}
    fb.configure(groups["ordered"], mode="ordered")
    fb.configure(groups["exact"], mode="exact")
    rows = _ops(groups, sizes, reps, world, ops, dtype_name) + (_steps(groups, rank, steps) if steps else [])
    return rows if rank == 0 else []


def _summary(row: dict) -> dict:
    base = row["times"]["gloo"]
    out = dict(kind=row["kind"], op=row["op"], bytes=row["bytes"], dtype=row.get("dtype", "fp32"), reps=row["reps"])
    for v in VARIANTS:
        t = row["times"][v]
        ratios = [a / b for a, b in zip(t, base)]
        q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
        out[v] = {"median_s": statistics.median(t), "ratio": statistics.median(t) / statistics.median(base),
                  "ratio_min": min(ratios), "ratio_max": max(ratios), "ratio_q1": q[0], "ratio_q3": q[-1],
                  "gbps": row["bytes"] / statistics.median(t) / 1e9}
    return out


def table(summaries: List[dict]) -> str:
    lines = [f"{'op':<15}{'size':>10}  {'gloo':>10}  {'ordered':>24}  {'exact':>24}"]
    for s in summaries:
        size = f"{s['bytes'] / 1e6:.3g} MB" if s["bytes"] >= 1e6 else f"{s['bytes'] / 1e3:.3g} KB"
        cells = [f"{s['gloo']['median_s'] * 1e3:8.2f}ms"]
        for v in ("ordered", "exact"):
            c = s[v]
            cells.append(f"{c['median_s'] * 1e3:8.2f}ms {c['ratio']:4.2f}x [{c['ratio_q1']:.2f}..{c['ratio_q3']:.2f}]")
        lines.append(f"{s['op']:<15}{size:>10}  {cells[0]:>10}  {cells[1]:>24}  {cells[2]:>24}")
    return "\n".join(lines)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The options of ``bench backend`` (on its own parser, or on ``bench --help``'s subparser).

    Args:
        ap: the parser to add them to.
    """
    from flatcomm.tools._cli import positive

    ap.add_argument("--ranks", type=positive(int), default=4, help="ranks on the flatcomm backend (default 4)")
    ap.add_argument("--sizes", default="4K,1M,100M", help="message bytes, comma separated (K/M suffixes; "
                                                          "default 4K,1M,100M)")
    ap.add_argument("--reps", type=positive(int), default=5,
                    help="timed reps per op at least (small sizes: more; default 5)")
    ap.add_argument("--steps", type=int, default=10,
                    help="timed DDP / FSDP2 steps per backend (default 10: 3 gave medians 0.1x apart; 0: none)")
    ap.add_argument("--ops", default=",".join(OPS), help=f"ops to time, comma separated (default {','.join(OPS)})")
    ap.add_argument("--json", metavar="PATH", help="write the summaries and every rep's times here")
    ap.add_argument("--routes-off", default="", metavar="ROUTES",
                    help="routes to turn off, comma separated (an A/B against a run without; default none)")
    ap.add_argument("--dtype", choices=DTYPES, default="fp32", help="the values' dtype (default fp32)")
    ap.add_argument("--timeout", type=positive(float), default=900.0,
                    help="the process group's timeout, s (the whole run may take 60 s more; default 900)")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m flatcomm.bench backend", description=__doc__.split("\n")[0])
    add_arguments(ap)
    return ap


def main(argv: List[str]) -> int:
    from flatcomm.comm.route import parse_routes_off
    from flatcomm.tools import spawn

    a = build_parser().parse_args(argv)
    sizes = [parse_size(s) for s in a.sizes.split(",") if s]
    ops = tuple(o for o in a.ops.split(",") if o)
    if a.steps < 0 or not ops or any(o not in OPS for o in ops):
        raise SystemExit(f"bench backend: --steps must be >= 0 and --ops some of {','.join(OPS)}")
    try:
        parse_routes_off(a.routes_off)
    except ValueError as e:
        raise SystemExit(f"bench backend: --routes-off: {e}") from None
    t0 = time.perf_counter()
    say("bench", f"backend: {a.ranks} ranks, {len(sizes)} sizes x {len(ops)} ops x {len(VARIANTS)} variants"
                 f"{', then DDP and FSDP2 steps' if a.steps else ''} (progress from rank 0)")
    rows = spawn.run(a.ranks, _rank_main, sizes, a.reps, a.steps, ops, a.routes_off, a.dtype, backend="flatcomm",
                     timeout_s=a.timeout, run_s=a.timeout + 60)[0]
    summaries = [_summary(r) for r in rows]
    off = f", routes off: {a.routes_off}" if a.routes_off else ""
    print(f"flatcomm.bench backend: {a.ranks} ranks over loopback, {a.dtype}{off}; median time, ratio to gloo's median "
          f"[quartiles of the per-rep ratios]")
    print(table(summaries), flush=True)
    say("bench", f"{time.perf_counter() - t0:.0f} s")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"command": "backend", "world": a.ranks, "results": summaries, "raw": rows,
                       "elapsed_s": time.perf_counter() - t0}, fh, indent=1)
    return 0

"""Benchmark flatcomm's collectives against gloo's own, on N local ranks (loopback).

For every size, codec and mode: flatcomm reduce_scatter and all_reduce time (median over reps of
the slowest rank's time), algbw and busbw with the nccl-tests definitions (S = full un-scattered
fp32 input in bytes; algbw = S / t; busbw = algbw * 2(n-1)/n for all-reduce, * (n-1)/n for
reduce-scatter), the bytes one rank puts on the wire (flatcomm's CommStats; gloo's nominal ring
volume), and the ratio to gloo's dist.all_reduce / dist.reduce_scatter_tensor (fp32, SUM) on the
same data in the same run. A chunks=1 vs automatic chunking comparison shows the overlap gain.

    python -m flatcomm.tools.bench.collectives                    # 2 ranks, 1M and 25M values
    python -m flatcomm.tools.bench.collectives --world 3 --sizes 4M --codecs fp32,int8 --json out.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from flatcomm import collectives as C
from flatcomm.comm import layout
from flatcomm.ops.codecs import CODECS, Codec
from flatcomm.tools import spawn


# torch 2.13 renamed reduce_scatter_tensor to reduce_scatter_single (the old name warns).
_gloo_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

def parse_size(s: str) -> int:
    s = s.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(s[-1:], 1)
    return int(float(s[:-1] if s[-1:] in "KMG" else s) * mult)


def _timed(fn, reps: int, warmup: int, prepare=None) -> List[float]:
    """Per rep, the slowest rank's time (every rank returns the same list)."""
    out = []
    for i in range(warmup + reps):
        if prepare is not None:
            prepare()
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)
        if i >= warmup:
            out.append(float(dt))
    return out


def _rank_main(rank: int, world: int, cfg: dict) -> Optional[list]:
    rows: List[Dict] = []

    def say(msg: str) -> None:
        if rank == 0:
            print(msg, file=sys.stderr, flush=True)

    for numel in cfg["sizes"]:
        m = numel // world
        n = m * world  # full size: a multiple of the world size for reduce_scatter
        g = torch.Generator().manual_seed(1234 + rank)
        x = torch.randn(n, generator=g)
        S = 4 * n
        work = torch.empty_like(x)
        shard = torch.empty(m)
        reps, warmup = cfg["reps"], cfg["warmup"]

        def copy_in():
            work.copy_(x)

        def add(coll, impl, codec, mode, chunks, times, wire):
            t = statistics.median(times)
            algbw = S / t / 1e9
            bus = algbw * (2 * (world - 1) / world if coll == "all_reduce" else (world - 1) / world)
            row = dict(collective=coll, impl=impl, codec=codec, mode=mode, chunks=chunks, numel=n,
                       bytes=S, world=world, time_ms=t * 1e3, min_ms=min(times) * 1e3, algbw_GBps=algbw,
                       busbw_GBps=bus, wire_MB=wire / 1e6)
            rows.append(row)
            say(f"  {coll:14s} {impl:8s} {codec:5s} {mode:7s} chunks={str(chunks):4s} "
                f"{t * 1e3:9.2f} ms  busbw {bus:6.2f} GB/s  wire {wire / 1e6:8.2f} MB")
            return row

        say(f"[{n} values = {S / 1e6:.0f} MB fp32, {world} ranks]")
        # gloo baselines (fp32, SUM; nominal ring volume per rank)
        add("reduce_scatter", "gloo", "fp32", "-", "-",
            _timed(lambda: _gloo_reduce_scatter(shard, x, op=dist.ReduceOp.SUM), reps, warmup),
            S * (world - 1) / world)
        add("all_reduce", "gloo", "fp32", "-", "-",
            _timed(lambda: dist.all_reduce(work), reps, warmup, copy_in), 2 * S * (world - 1) / world)

        configs = [(c, "ordered") for c in cfg["codecs"]]
        if "fp32" in cfg["codecs"] and cfg["exact"]:
            configs.append(("fp32", "exact"))
        for codec, mode in configs:
            if codec == "auto":  # the tuner picks (error budget sign: any codec the other rows try)
                _auto_rows(cfg, x, work, shard, copy_in, add, world)
                continue
            auto_rs = layout.default_chunks(m, Codec(codec), world, mode, x.dtype, "reduce_scatter")
            auto_ar = layout.default_chunks(max(1, n // world), Codec(codec), world, mode, x.dtype)
            chunk_opts = [None]
            if (cfg["chunk_compare"] and codec in cfg["chunk_codecs"] and mode == "ordered"
                    and max(auto_rs, auto_ar) > 1):
                chunk_opts = [None, 1]
            for chunks in chunk_opts:
                st = C.CommStats()
                C.reduce_scatter(shard, x, codec=codec, mode=mode, chunks=chunks, stats=st)
                add("reduce_scatter", "flatcomm", codec, mode, chunks or f"a{auto_rs}",
                    _timed(lambda: C.reduce_scatter(shard, x, codec=codec, mode=mode, chunks=chunks),
                           reps, warmup), st.wire_bytes)
                st = C.CommStats()
                copy_in()
                C.all_reduce(work, codec=codec, mode=mode, chunks=chunks, stats=st)
                add("all_reduce", "flatcomm", codec, mode, chunks or f"a{auto_ar}",
                    _timed(lambda: C.all_reduce(work, codec=codec, mode=mode, chunks=chunks),
                           reps, warmup, copy_in), st.wire_bytes)
        del x, work, shard
    return rows if rank == 0 else None


def _auto_rows(cfg, x, work, shard, copy_in, add, world) -> None:
    from flatcomm.autotune import Tuner

    tuner = Tuner("sign")
    reps, warmup = cfg["reps"], cfg["warmup"]
    st = C.CommStats()
    h = C.reduce_scatter(shard, x, codec="auto", tuner=tuner, stats=st, async_op=True)
    h.wait()
    row = add("reduce_scatter", "flatcomm", "auto", "ordered", f"a{h.decision.chunks}",
              _timed(lambda: C.reduce_scatter(shard, x, codec="auto", tuner=tuner), reps, warmup), st.wire_bytes)
    row["chosen"], row["reason"] = h.decision.codec, h.decision.reason
    st = C.CommStats()
    copy_in()
    h = C.all_reduce(work, codec="auto", tuner=tuner, stats=st, async_op=True)
    h.wait()
    row = add("all_reduce", "flatcomm", "auto", "ordered", f"a{h.decision.chunks}",
              _timed(lambda: C.all_reduce(work, codec="auto", tuner=tuner), reps, warmup, copy_in), st.wire_bytes)
    row["chosen"], row["reason"] = h.decision.codec, h.decision.reason


def _table(rows: List[Dict]) -> str:
    base = {(r["collective"], r["numel"]): r["time_ms"] for r in rows if r["impl"] == "gloo"}
    auto = {(r["collective"], r["numel"], r["codec"], r["mode"]): r["time_ms"] for r in rows
            if r["impl"] == "flatcomm" and str(r["chunks"]).startswith("a")}
    hdr = (f"{'size':>6s} {'collective':14s} {'impl':8s} {'codec':5s} {'mode':7s} {'chunks':>6s} "
           f"{'time ms':>9s} {'algbw':>7s} {'busbw':>7s} {'wire MB':>8s} {'vs gloo':>8s} {'overlap':>8s}")
    lines = [hdr, "-" * len(hdr)]
    for r in rows:
        ratio = r["time_ms"] / base[(r["collective"], r["numel"])]
        r["ratio_vs_gloo"] = ratio
        gain = ""
        if r["impl"] == "flatcomm" and r["chunks"] == 1 and (r["collective"], r["numel"], r["codec"], r["mode"]) in auto:
            r["overlap_gain"] = r["time_ms"] / auto[(r["collective"], r["numel"], r["codec"], r["mode"])]
            gain = f"{r['overlap_gain']:.2f}x"
        size = f"{r['bytes'] / 1e6:.3g}MB"
        lines.append(f"{size:>6s} {r['collective']:14s} {r['impl']:8s} {r['codec']:5s} {r['mode']:7s} "
                     f"{str(r['chunks']):>6s} {r['time_ms']:9.2f} {r['algbw_GBps']:7.2f} {r['busbw_GBps']:7.2f} "
                     f"{r['wire_MB']:8.2f} {ratio:7.2f}x {gain:>8s}")
    lines.append("algbw/busbw in GB/s (nccl-tests definitions, S = full fp32 input); time = median over reps of "
                 "the slowest rank; wire = bytes one rank sends (gloo: nominal ring volume); 'vs gloo' = time / "
                 "gloo's fp32 collective of the same kind; chunks aN = automatic (N chunks); 'overlap' = "
                 "time(chunks=1) / time(auto).")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=2, help="ranks (default 2)")
    ap.add_argument("--sizes", default="1M,25M", help="fp32 element counts, comma separated (K/M suffixes)")
    ap.add_argument("--codecs", default=",".join(CODECS) + ",auto", help="codecs (default: all, and auto)")
    ap.add_argument("--no-exact", action="store_true", help="skip mode='exact'")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--chunk-codecs", default="fp32,int8",
                    help="codecs to also run with chunks=1 (overlap gain); '' for none")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--json", help="write the rows here")
    a = ap.parse_args(argv)
    cfg = dict(sizes=[parse_size(s) for s in a.sizes.split(",") if s], codecs=[c for c in a.codecs.split(",") if c],
               exact=not a.no_exact, reps=a.reps, warmup=a.warmup,
               chunk_codecs=[c for c in a.chunk_codecs.split(",") if c], chunk_compare=bool(a.chunk_codecs))
    for c in cfg["codecs"]:
        if c not in CODECS and c != "auto":
            ap.error(f"unknown codec {c}")
    t0 = time.time()
    rows = spawn.run(a.world, _rank_main, cfg, timeout_s=600, threads=a.threads)[0]
    print(_table(rows))
    print(f"({time.time() - t0:.0f} s)", file=sys.stderr)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(world=a.world, config=cfg, torch=torch.__version__, rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

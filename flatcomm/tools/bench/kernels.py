"""Kernel throughput: flatcomm ops vs Tensor.copy_ (memory bandwidth) and the pure-torch reference.

For each op and size: median time, effective GB/s (the bytes the op must read and write), the ratio
to copy_'s GB/s measured in the same run at the same size, and the speedup over the pure-torch
composition in flatcomm.reference. Outputs are preallocated, as in the collectives.

    python -m flatcomm.tools.bench.kernels                 # full table, 1M..64M elements
    python -m flatcomm.tools.bench.kernels --quick         # the demo: a few ops at 1M and 25M
    python -m flatcomm.tools.bench.kernels --block-sizes   # int8 encode+EF speed and error by block size
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Callable, List, Optional

import torch

import flatcomm
from flatcomm import reference

WORLD = 4  # rows for the sums


def median_time(fn: Callable[[], object], reps: int, min_time: float = 0.2) -> float:
    fn()  # warm up (page faults, thread pool)
    times: List[float] = []
    start = time.perf_counter()
    while len(times) < reps or (time.perf_counter() - start < min_time and len(times) < 50):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def gbps(nbytes: float, seconds: float) -> float:
    return nbytes / seconds / 1e9


def run_case(name, n, nbytes, fn, ref_fn, copy_gbps, reps, rows):
    t = median_time(fn, reps)
    row = {"op": name, "numel": n, "ms": t * 1e3, "GB/s": gbps(nbytes, t)}
    row["x copy"] = row["GB/s"] / copy_gbps
    row["vs torch ref"] = None
    if ref_fn is not None:
        row["vs torch ref"] = median_time(ref_fn, max(2, reps // 3), min_time=0.0) / t
    rows.append(row)
    ref = f"{row['vs torch ref']:7.1f}x" if row["vs torch ref"] else "      -"
    print(f"  {name:<22} {n / 1e6:6.0f}M {row['ms']:9.2f} ms {row['GB/s']:7.1f} GB/s "
          f"{row['x copy']:6.2f}x copy {ref}", flush=True)


def bench_size(n: int, codecs: List[str], reps: int, with_ref: bool, rows: list) -> None:
    gen = torch.Generator().manual_seed(n)
    x = torch.randn(n, generator=gen)
    residual = torch.randn(n, generator=gen) * 0.01
    src, dst = torch.randn(n, generator=gen), torch.empty(n)
    t_copy = median_time(lambda: dst.copy_(src), reps)
    copy_gbps = gbps(8 * n, t_copy)
    rows.append({"op": "copy_", "numel": n, "ms": t_copy * 1e3, "GB/s": copy_gbps, "x copy": 1.0})
    print(f"  {'Tensor.copy_':<22} {n / 1e6:6.0f}M {t_copy * 1e3:9.2f} ms {copy_gbps:7.1f} GB/s "
          f"{1.0:6.2f}x copy", flush=True)
    out = torch.empty(n)
    for codec in codecs:
        c = flatcomm.resolve(codec)
        payload = torch.empty(c.wire_bytes(n), dtype=torch.uint8)
        wire = payload.numel()
        ref_ok = with_ref and (codec != "topk" or n <= 4_000_000)
        # encode + error feedback: read x and residual, write residual and payload
        run_case(f"encode+EF {codec}", n, 12 * n + wire,
                 lambda: flatcomm.encode(x, c, residual=residual, out=payload),
                 (lambda: reference.encode(x, codec, residual=residual.clone())) if ref_ok else None,
                 copy_gbps, reps, rows)
        run_case(f"decode {codec}", n, 4 * n + wire,
                 lambda: flatcomm.decode(payload, c, n, out=out),
                 (lambda: reference.decode(payload, codec, n)) if ref_ok else None,
                 copy_gbps, reps, rows)
        stacked = payload.unsqueeze(0).repeat(WORLD, 1)
        run_case(f"decode_sum {codec} W={WORLD}", n, 4 * n + WORLD * wire,
                 lambda: flatcomm.decode_sum(stacked, c, n, out=out),
                 (lambda: reference.decode_sum(stacked, codec, n)) if ref_ok else None,
                 copy_gbps, reps, rows)
    xs = torch.randn(WORLD, n, generator=gen)
    run_case(f"ordered_sum W={WORLD}", n, 4 * n * (WORLD + 1), lambda: flatcomm.ordered_sum(xs),
             (lambda: reference.ordered_sum(xs)) if with_ref else None, copy_gbps, reps, rows)
    run_case(f"exact_sum W={WORLD}", n, 4 * n * (WORLD + 1), lambda: flatcomm.exact_sum(xs), None,
             copy_gbps, reps, rows)


def bench_block_sizes(n: int, reps: int, rows: list) -> None:
    """int8 encode+EF time and relative error by block size: the data behind the default."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(n, generator=gen) * torch.rand(n, generator=gen).pow(4)  # uneven magnitudes
    print(f"  {'block':>6} {'ms':>8} {'wire/fp32':>10} {'rel. error':>11}")
    for b in (32, 64, 128, 256, 512, 1024, 4096):
        residual = torch.zeros(n)
        payload = torch.empty(flatcomm.wire_bytes("int8", n, block_size=b), dtype=torch.uint8)
        t = median_time(lambda: flatcomm.encode(x, "int8", block_size=b, out=payload), reps)
        dec = flatcomm.decode(flatcomm.encode(x, "int8", block_size=b), "int8", n, block_size=b)
        err = ((dec.double() - x.double()).norm() / x.double().norm()).item()
        rows.append({"op": "int8 block sweep", "block_size": b, "ms": t * 1e3,
                     "wire_ratio": payload.numel() / (4 * n), "rel_error": err})
        print(f"  {b:>6} {t * 1e3:8.2f} {payload.numel() / (4 * n):10.4f} {err:11.2e}", flush=True)
        del residual


def main(argv: Optional[List[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="the demo: fewer ops and sizes")
    ap.add_argument("--sizes", type=str, default=None, help="comma-separated element counts")
    ap.add_argument("--codecs", type=str, default=None)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--no-ref", action="store_true", help="skip the pure-torch reference timings")
    ap.add_argument("--block-sizes", action="store_true", help="sweep int8 block sizes")
    ap.add_argument("--json", type=str, default=None, help="write the results here")
    args = ap.parse_args(argv)

    info = flatcomm.build_info()
    print(f"flatcomm {info['version']} kernels: simd={info['simd']} threads={info['threads']} "
          f"torch={info['torch']}")
    rows: list = []
    if args.block_sizes:
        bench_block_sizes(25_000_000, args.reps, rows)
    else:
        if args.quick:
            sizes, codecs, reps = [1 << 20, 25_000_000], ["int8", "int4", "sign", "bf16"], 5
        else:
            sizes = [1 << 20, 1 << 22, 1 << 24, 1 << 26]
            codecs, reps = ["fp32", "bf16", "fp16", "int8", "int4", "sign", "topk"], args.reps
        if args.sizes:
            sizes = [int(float(s)) for s in args.sizes.split(",")]
        if args.codecs:
            codecs = args.codecs.split(",")
        print(f"  {'op':<22} {'numel':>7} {'time':>12} {'GB/s':>12} {'vs copy':>11} {'vs torch':>8}")
        for n in sizes:
            bench_size(n, codecs, reps, not args.no_ref, rows)
    if args.json:
        Path(args.json).write_text(json.dumps({"build": info, "results": rows}, indent=1))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()

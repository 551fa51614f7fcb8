"""Kernel throughput: flatcomm ops vs Tensor.copy_ (memory bandwidth) and the pure-torch reference.

For each op and size: min, median and max time per call (torch.utils.benchmark's Timer), effective
GB/s (the bytes the op must read and write), the ratio to copy_'s GB/s measured in the same run at
the same size, and the speed-up over the pure-torch composition in flatcomm.ops.reference; throughput
and ratios come from the fastest sample. Outputs are preallocated, as in the collectives.
Run by ``python -m flatcomm.bench kernels [--quick] [--block-sizes]``.
"""
from __future__ import annotations

import statistics
import sys
import time
from typing import Callable, List, Optional

import torch
import torch.utils.benchmark as benchmark

import flatcomm
from flatcomm.ops import reference
from flatcomm.tools._cli import format_size

WORLD = 4  # rows for the sums


# A run's max / min above this: other load disturbed it (shared machine, frequency changes); its
# numbers are flagged and a warning says so.
NOISY_SPREAD = 1.5


def measure(fn: Callable[[], object], reps: int, min_time: float = 0.2, max_time: float = 2.0) -> dict:
    """Seconds per call of ``fn``: min, median and max over at least ``reps`` samples (more while under
    ``min_time`` s, at most 50; on a machine so disturbed that ``max_time`` s pass first, 3). torch's
    benchmark Timer runs it (torch's thread count, CUDA synchronized); a sample repeats ``fn`` until it
    lasts ~1 ms, so fast ops at small sizes are not lost in timer resolution and scheduler noise."""
    timer = benchmark.Timer(stmt="fn()", globals={"fn": fn}, num_threads=torch.get_num_threads())
    timer.timeit(1)  # warm-up (page faults, thread pool)
    once = min(timer.timeit(1).mean for _ in range(3))
    number = max(1, min(1000, int(1e-3 / max(once, 1e-9))))
    times: List[float] = []
    start = time.perf_counter()
    while len(times) < reps or (time.perf_counter() - start < min_time and len(times) < 50):
        times.append(timer.timeit(number).mean)
        if len(times) >= 3 and time.perf_counter() - start > max_time:
            break
    return {"min_s": min(times), "median_s": statistics.median(times), "max_s": max(times),
            "samples": len(times), "calls_per_sample": number}


def gbps(nbytes: float, seconds: float) -> float:
    return nbytes / seconds / 1e9


def _row(op: str, codec: Optional[str], n: int, nbytes: float, t: dict) -> dict:
    """Throughput and ratios use the fastest sample: the one least disturbed by other load."""
    return {"op": op, "codec": codec, "numel": n, **t, "gbps": gbps(nbytes, t["min_s"]),
            "spread": t["max_s"] / t["min_s"], "x_copy": 1.0, "vs_torch": None}


def _progress(op: str, codec: Optional[str], n: int) -> None:
    """What is being measured now (stderr); the results go to the table only, once."""
    print(f"  {' '.join(filter(None, (op, codec, format_size(n))))} ...", file=sys.stderr, flush=True)


def run_case(op, codec, n, nbytes, fn, ref_fn, copy_gbps, reps, rows):
    _progress(op, codec, n)
    row = _row(op, codec, n, nbytes, measure(fn, reps))
    row["x_copy"] = row["gbps"] / copy_gbps
    if ref_fn is not None:
        ref = measure(ref_fn, max(3, reps // 2), min_time=0.0)
        row["vs_torch"] = ref["min_s"] / row["min_s"]
        row["spread"] = max(row["spread"], ref["max_s"] / ref["min_s"])  # the ratio is as noisy as either
    rows.append(row)


def bench_size(n: int, codecs: List[str], reps: int, with_ref: bool, rows: list) -> None:
    gen = torch.Generator().manual_seed(n)
    x = torch.randn(n, generator=gen)
    residual = torch.randn(n, generator=gen) * 0.01
    src, dst = torch.randn(n, generator=gen), torch.empty(n)
    _progress("copy_", None, n)
    copy = _row("copy_", None, n, 8 * n, measure(lambda: dst.copy_(src), reps))
    rows.append(copy)
    copy_gbps = copy["gbps"]
    out = torch.empty(n)
    for codec in codecs:
        c = flatcomm.resolve(codec)
        payload = torch.empty(c.wire_bytes(n), dtype=torch.uint8)
        wire = payload.numel()
        # the chunked sparse reference loops over chunks in Python: small sizes only
        ref_ok = with_ref and (codec != "topk" or n <= 4_000_000) and (not c.chunked or n <= 100_000)
        # encode + error feedback: read x and residual, write residual and payload
        run_case("encode+EF", codec, n, 12 * n + wire,
                 lambda: flatcomm.encode(x, c, residual=residual, out=payload),
                 (lambda: reference.encode(x, codec, residual=residual.clone())) if ref_ok else None,
                 copy_gbps, reps, rows)
        run_case("decode", codec, n, 4 * n + wire,
                 lambda: flatcomm.decode(payload, c, n, out=out),
                 (lambda: reference.decode(payload, codec, n)) if ref_ok else None,
                 copy_gbps, reps, rows)
        stacked = payload.unsqueeze(0).repeat(WORLD, 1)
        run_case(f"decode_sum W={WORLD}", codec, n, 4 * n + WORLD * wire,
                 lambda: flatcomm.decode_sum(stacked, c, n, out=out),
                 (lambda: reference.decode_sum(stacked, codec, n)) if ref_ok else None,
                 copy_gbps, reps, rows)
    xs = torch.randn(WORLD, n, generator=gen)
    run_case(f"ordered_sum W={WORLD}", None, n, 4 * n * (WORLD + 1), lambda: flatcomm.ordered_sum(xs),
             (lambda: reference.ordered_sum(xs)) if with_ref else None, copy_gbps, reps, rows)
    run_case(f"exact_sum W={WORLD}", None, n, 4 * n * (WORLD + 1), lambda: flatcomm.exact_sum(xs), None,
             copy_gbps, reps, rows)


def bench_block_sizes(n: int, reps: int) -> List[dict]:
    """int8 encode+EF time and relative error by block size: the data behind the default."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(n, generator=gen) * torch.rand(n, generator=gen).pow(4)  # uneven magnitudes
    residual = torch.zeros(n)
    rows = []
    for b in (32, 64, 128, 256, 512, 1024, 4096):
        print(f"  block {b:>5} ...", file=sys.stderr, flush=True)
        payload = torch.empty(flatcomm.wire_bytes("int8", n, block_size=b), dtype=torch.uint8)
        t = measure(lambda: flatcomm.encode(x, "int8", block_size=b, residual=residual, out=payload), reps)
        dec = flatcomm.decode(flatcomm.encode(x, "int8", block_size=b), "int8", n, block_size=b)
        err = ((dec.double() - x.double()).norm() / x.double().norm()).item()
        rows.append({"op": "encode+EF", "codec": "int8", "numel": n, "block_size": b, **t, "spread": t["max_s"] / t["min_s"],
                     "wire_bytes": payload.numel(), "rel_error": err})
    return rows

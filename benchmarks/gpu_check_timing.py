"""benchmarks/gpu_check.py's timing: each op and codec against Tensor.copy_ bandwidth (CUDA events,
`reps` repetitions: the median and the spread, min and max) and the speed targets at the largest
size."""
from __future__ import annotations

import statistics
import time
from typing import Callable, Dict, List, Sequence, Tuple

import torch

import flatcomm as fc
from gpu_check_common import CODECS, SPARSE, Interrupted, STOCHASTIC

# The speed targets of the second GPU round (docs/gpu.md): x copy_'s bandwidth with error feedback
# at 64M values (the largest timing size), in the same run. The op names are the table's rows.
TARGETS: Dict[str, float] = {
    "encode+EF int8": 0.8, "encode+EF int4": 0.8, "encode+EF sign": 0.8,
    "encode+EF sparse": 0.5, "encode+EF sparse4": 0.5, "encode+EF topk": 0.4,
    "decode_sum int8 W=4": 0.8, "ordered_sum W=4": 0.8, "exact_sum W=4": 0.7,
}


class Timer:
    def __init__(self, device: torch.device, reps: int) -> None:
        self.dev = device
        self.cuda = device.type == "cuda"
        self.reps = reps

    def times_ms(self, fn: Callable[[], object]) -> List[float]:
        """Every repetition's time, after 3 warm-up calls."""
        for _ in range(3):
            fn()
        if self.cuda:
            torch.cuda.synchronize(self.dev)
            ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(self.reps)]
            for s, e in ev:
                s.record()
                fn()
                e.record()
            torch.cuda.synchronize(self.dev)
            return [s.elapsed_time(e) for s, e in ev]
        times = []
        for _ in range(self.reps):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return times

    def median_ms(self, fn: Callable[[], object]) -> float:
        return statistics.median(self.times_ms(fn))


def run_timing(device: torch.device, sizes: Sequence[int], reps: int, W: int = 4) -> Tuple[List[dict], List[dict]]:
    """The table's rows and, for the largest size, one verdict per speed target."""
    timer = Timer(device, reps)
    rows: List[dict] = []
    print(f"  {'op':<34} {'numel':>6} {'ms':>9} {'min':>8} {'max':>8} {'GB/s':>8} {'x copy':>7} {'spread':>11}",
          flush=True)
    for n in sizes:
        g = torch.Generator(device=device).manual_seed(n)
        x = torch.randn(n, device=device, generator=g)
        residual = torch.randn(n, device=device, generator=g) * 0.01
        out = torch.empty(n, device=device)
        src, dst = torch.randn(n, device=device, generator=g), torch.empty(n, device=device)
        label = f"{n / (1 << 20):.0f}M" if n >= 1 << 20 else f"{n / 1024:.0f}K"
        copy_gbps = 0.0

        def row(name: str, nbytes: int, fn: Callable[[], object]) -> dict:
            """One op: the median and the spread (min, max) of its repetitions, as GB/s and x copy_."""
            nonlocal copy_gbps
            try:
                t = timer.times_ms(fn)
            except (Interrupted, KeyboardInterrupt):
                raise
            except Exception as e:  # noqa: BLE001  (recorded; a broken context stops the table)
                text = str(e).strip()
                rr = {"op": name, "numel": n, "error": f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"}
                rows.append(rr)
                print(f"  {name:<34} {label:>6}   ERROR {rr['error']}", flush=True)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)  # raises if the context is gone
                return rr
            ms, lo, hi = statistics.median(t), min(t), max(t)
            gbps = nbytes / ms / 1e6
            copy_gbps = copy_gbps or gbps  # the first row is the copy_ baseline
            rr = {"op": name, "numel": n, "ms": ms, "ms_min": lo, "ms_max": hi, "reps": len(t), "bytes": nbytes,
                  "GB/s": gbps, "x_copy": gbps / copy_gbps,
                  "x_copy_spread": [nbytes / hi / 1e6 / copy_gbps, nbytes / lo / 1e6 / copy_gbps]}
            rows.append(rr)
            s0, s1 = rr["x_copy_spread"]
            print(f"  {name:<34} {label:>6} {ms:9.3f} {lo:8.3f} {hi:8.3f} {gbps:8.1f} {rr['x_copy']:7.2f} "
                  f"{s0:5.2f}-{s1:<5.2f}", flush=True)
            return rr

        row("copy_ (baseline, 8 B/elem)", 8 * n, lambda: dst.copy_(src))
        for codec in CODECS:
            c = fc.resolve(codec)
            wire = c.wire_bytes(n)
            payload = torch.empty(wire, dtype=torch.uint8, device=device)
            row(f"encode+EF {codec}", 12 * n + wire, lambda: fc.encode(x, c, residual=residual, out=payload))
            if codec in STOCHASTIC:
                row(f"encode+EF {codec} stochastic", 12 * n + wire,
                    lambda: fc.encode(x, c, residual=residual, stochastic=True, seed=1, out=payload))
            row(f"encode {codec}", 4 * n + wire, lambda: fc.encode(x, c, out=payload))
            row(f"decode {codec} -> f32", wire + 4 * n, lambda: fc.decode(payload, c, n, out=out))
            P = payload.unsqueeze(0).repeat(W, 1)
            row(f"decode_sum {codec} W={W}", W * wire + 4 * n, lambda: fc.decode_sum(P, c, n, out=out))
            if codec != "topk" and codec not in SPARSE:  # neither is fused into decode_sum's re-encode
                res2 = torch.zeros(n, device=device)
                row(f"decode_sum_encode+EF {codec} W={W}", W * wire + 8 * n + wire,
                    lambda: fc.decode_sum(P, c, n, reencode=c, residual=res2, out=payload))
                del res2
            del payload, P
        # encode_kernel takes blocks of up to 512 values in registers (a warp per block), larger
        # ones through shared memory: both sides of that boundary, in the same run
        for codec, block in (("int8", 512), ("int8", 544), ("sign", 512), ("sign", 544)):
            c = fc.resolve(codec, block)
            payload = torch.empty(c.wire_bytes(n), dtype=torch.uint8, device=device)
            row(f"encode+EF {codec} block {block}", 12 * n + c.wire_bytes(n),
                lambda: fc.encode(x, c, residual=residual, out=payload))
            del payload
        X = torch.randn(W, n, device=device, generator=g)
        row(f"ordered_sum W={W}", 4 * W * n + 4 * n, lambda: fc.ordered_sum(X))
        nb = -(-n // 256)
        row(f"exact_exponents W={W}", 4 * W * n + 4 * nb, lambda: fc.exact_exponents(X))
        E = fc.exact_exponents(X)
        row("to_exact", 4 * n + 4 * nb + 8 * n, lambda: fc.to_exact(X[0], E))
        acc = fc.to_exact(X[0], E)
        row("from_exact", 8 * n + 4 * nb + 4 * n, lambda: fc.from_exact(acc, E))
        row(f"exact_sum W={W}", 4 * W * n + 4 * n, lambda: fc.exact_sum(X))
        del x, residual, out, src, dst, X, E, acc
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows, targets_of(rows, max(sizes) if sizes else 0)


def targets_of(rows: List[dict], n: int) -> List[dict]:
    """The targets' verdicts from the rows of size n: met when the median's x copy_ reaches the target."""
    out = []
    for op, need in TARGETS.items():
        rr = next((r for r in rows if r.get("op") == op and r.get("numel") == n), None)
        ratio = rr.get("x_copy", 0.0) if rr else 0.0
        out.append({"op": op, "numel": n, "x_copy": ratio, "spread": rr.get("x_copy_spread") if rr else None,
                    "required": need, "ok": ratio >= need, "error": rr.get("error") if rr else "not timed"})
    return out

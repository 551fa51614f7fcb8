"""benchmarks/gpu_check.py's timing: each op and codec against Tensor.copy_ bandwidth (CUDA events,
median of the repetitions) and the fused int8 encode + EF target."""
from __future__ import annotations

import statistics
import time
from typing import Callable, List, Optional, Sequence, Tuple

import torch

import flatcomm as fc
from gpu_check_common import CODECS, Interrupted, STOCHASTIC


class Timer:
    def __init__(self, device: torch.device, reps: int) -> None:
        self.dev = device
        self.cuda = device.type == "cuda"
        self.reps = reps

    def median_ms(self, fn: Callable[[], object]) -> float:
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
            return statistics.median(s.elapsed_time(e) for s, e in ev)
        times = []
        for _ in range(self.reps):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)


def run_timing(device: torch.device, sizes: Sequence[int], reps: int, W: int = 4) -> Tuple[List[dict], Optional[dict]]:
    timer = Timer(device, reps)
    rows: List[dict] = []
    target = None
    print(f"  {'op':<34} {'numel':>6} {'ms':>9} {'moved MB':>9} {'GB/s':>8} {'x copy':>7}", flush=True)
    for n in sizes:
        g = torch.Generator(device=device).manual_seed(n)
        x = torch.randn(n, device=device, generator=g)
        residual = torch.randn(n, device=device, generator=g) * 0.01
        out = torch.empty(n, device=device)
        src, dst = torch.randn(n, device=device, generator=g), torch.empty(n, device=device)
        label = f"{n / (1 << 20):.0f}M" if n >= 1 << 20 else f"{n / 1024:.0f}K"
        copy_gbps = 0.0

        def row(name: str, nbytes: int, fn: Callable[[], object]) -> dict:
            nonlocal copy_gbps
            try:
                ms = timer.median_ms(fn)
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
            gbps = nbytes / ms / 1e6
            copy_gbps = copy_gbps or gbps  # the first row is the copy_ baseline
            rr = {"op": name, "numel": n, "ms": ms, "bytes": nbytes, "GB/s": gbps, "x_copy": gbps / copy_gbps}
            rows.append(rr)
            print(f"  {name:<34} {label:>6} {ms:9.3f} {nbytes / 1e6:9.1f} {gbps:8.1f} {rr['x_copy']:7.2f}",
                  flush=True)
            return rr

        row("copy_ (baseline, 8 B/elem)", 8 * n, lambda: dst.copy_(src))
        for codec in CODECS:
            c = fc.resolve(codec)
            wire = c.wire_bytes(n)
            payload = torch.empty(wire, dtype=torch.uint8, device=device)
            rr = row(f"encode+EF {codec}", 12 * n + wire, lambda: fc.encode(x, c, residual=residual, out=payload))
            if codec == "int8" and n == max(sizes):
                ratio = rr.get("x_copy", 0.0)
                target = {"op": rr["op"], "numel": n, "x_copy": ratio, "required": 0.8, "ok": ratio >= 0.8,
                          "error": rr.get("error")}
            if codec in STOCHASTIC:
                row(f"encode+EF {codec} stochastic", 12 * n + wire,
                    lambda: fc.encode(x, c, residual=residual, stochastic=True, seed=1, out=payload))
            row(f"encode {codec}", 4 * n + wire, lambda: fc.encode(x, c, out=payload))
            row(f"decode {codec} -> f32", wire + 4 * n, lambda: fc.decode(payload, c, n, out=out))
            P = payload.unsqueeze(0).repeat(W, 1)
            row(f"decode_sum {codec} W={W}", W * wire + 4 * n, lambda: fc.decode_sum(P, c, n, out=out))
            if codec != "topk":
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
    return rows, target

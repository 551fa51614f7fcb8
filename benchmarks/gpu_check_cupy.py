"""benchmarks/gpu_check.py --cupy: the NVRTC kernels of flatcomm/cupy_backend.py against the CPU and
the compiled CUDA kernels, bit for bit, and the int8 encode + EF time of both paths."""
from __future__ import annotations

import dataclasses
import time

import torch

import flatcomm as fc
from gpu_check_common import CODECS, DTYPES, OPS, STOCHASTIC, Checker, Config, ContextBroken, bits
from gpu_check_correctness import Sweep
from gpu_check_timing import Timer

CUPY_CFG = Config(sizes=(1, 97, 4099, 65537), blocks=(32, 256), exact_blocks=(7, 256), dtypes=DTYPES,
                  topk_ratios=(0.3,), variants=("nonfinite",), big_n=1 << 62, full_reencode_max_n=97,
                  timing_sizes=(), reps=0)


def cupy_section(device: torch.device, seed: int, max_seconds: float, reps: int, timing_n: int,
                 self_test: bool = False) -> dict:
    """NVRTC kernels vs the CPU (the sweep, with the NVRTC ops registered over the compiled CUDA
    kernels for the time of it), vs the compiled kernels directly (every codec's encode + EF and
    decode on one input), and the int8 encode + EF time of both. With self_test (CPU, no cupy) both
    "paths" are the CPU kernels: it exercises this code, not the NVRTC kernels."""
    import flatcomm
    from flatcomm.ops import cupy_backend as cb

    out: dict = {"cuda_path": flatcomm.cuda_path(), "kernels": len(cb.kernel_names())}
    t0 = time.monotonic()
    if self_test:
        nvrtc_ops = None
        print("   self-test: no cupy / GPU here, both paths are the CPU kernels", flush=True)
    else:
        nvrtc_ops = cb.make_ops()
        launcher = nvrtc_ops.k.run.__self__
        nk = launcher.precompile(device.index or 0)
        out["compile_seconds"] = round(time.monotonic() - t0, 1)
        print(f"   NVRTC compiled {nk} kernels in {out['compile_seconds']} s (cupy caches them on disk)",
              flush=True)

    # 1. the sweep, CPU reference vs the NVRTC ops on the device
    lib = None
    if nvrtc_ops is not None:
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # overriding the compiled CUDA kernels on purpose
            lib = cb.register(nvrtc_ops, "CUDA")
    ck = Checker(device, max_seconds, verbose=False)
    try:
        try:
            Sweep(ck, dataclasses.replace(CUPY_CFG), seed).run()
        except ContextBroken:
            pass
    finally:
        if lib is not None:
            lib._destroy()  # the compiled kernels take the CUDA key back
    npass, nfail = sum(ck.passed.values()), sum(ck.failed.values())
    out.update(sweep_passed=npass, sweep_failed=nfail, sweep_skipped=ck.skipped_cases,
               sweep_unchecked=[op for op in OPS if ck.passed[op] + ck.failed[op] == 0],
               failures=ck.failures[:50])
    print(f"   sweep, NVRTC vs cpu: {npass} passed, {nfail} failed ({ck.cases} cases)", flush=True)

    # 2. NVRTC vs compiled on the same device tensors, every codec
    compiled = torch.ops.flatcomm
    nv = nvrtc_ops if nvrtc_ops is not None else compiled
    g = torch.Generator().manual_seed(seed)
    n = 100_003
    x = torch.randn(n, generator=g).to(device)
    r0 = (torch.randn(n, generator=g) * 0.01).to(device)
    diffs = []
    for codec in CODECS:
        c = fc.resolve(codec, 256, 0.05)
        k = c.k(n)
        for stoch in ((False, True) if codec in STOCHASTIC else (False,)):
            ra, rb = r0.clone(), r0.clone()
            pa = compiled.encode(x, codec, 256, k, ra, stoch, 11)
            pb = nv.encode(x, codec, 256, k, rb, stoch, 11)
            da = compiled.decode(pa, codec, n, 256, k, torch.float32)
            db = nv.decode(pb, codec, n, 256, k, torch.float32)
            for what, a, b in (("payload", pa, pb), ("residual", ra, rb), ("decoded", da, db)):
                if not torch.equal(bits(a.cpu()), bits(b.cpu())):
                    diffs.append(f"{codec}{' stochastic' if stoch else ''} {what}")
    out["vs_compiled_diffs"] = diffs
    print(f"   NVRTC vs compiled kernels, encode+EF and decode of every codec: "
          f"{'bitwise equal' if not diffs else 'DIFFER: ' + ', '.join(diffs)}", flush=True)

    # 3. int8 encode + EF, both paths
    timer = Timer(device, max(reps, 2))
    xt = torch.randn(timing_n, device=device)
    rt = torch.zeros(timing_n, device=device)
    pt = torch.empty(fc.wire_bytes("int8", timing_n), dtype=torch.uint8, device=device)
    src, dst = torch.randn(timing_n, device=device), torch.empty(timing_n, device=device)
    ms_copy = timer.median_ms(lambda: dst.copy_(src))
    ms_a = timer.median_ms(lambda: compiled.encode_into(xt, "int8", 256, 0, rt, False, 0, pt))
    ms_b = timer.median_ms(lambda: nv.encode_into(xt, "int8", 256, 0, rt, False, 0, pt))
    nbytes = 12 * timing_n + pt.numel()
    out["timing"] = {"numel": timing_n, "copy_ms": ms_copy, "compiled_ms": ms_a, "nvrtc_ms": ms_b,
                     "compiled_x_copy": nbytes / ms_a / (8 * timing_n / ms_copy),
                     "nvrtc_x_copy": nbytes / ms_b / (8 * timing_n / ms_copy)}
    print(f"   int8 encode+EF at {timing_n}: compiled {ms_a:.3f} ms, NVRTC {ms_b:.3f} ms "
          f"(copy_ {ms_copy:.3f} ms; x copy: {out['timing']['compiled_x_copy']:.2f} / "
          f"{out['timing']['nvrtc_x_copy']:.2f})", flush=True)
    out["ok"] = not nfail and not diffs and not ck.broken
    out["seconds"] = round(time.monotonic() - t0, 1)
    return out

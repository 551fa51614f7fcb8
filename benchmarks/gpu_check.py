"""GPU check of flatcomm: CUDA results bitwise equal to the CPU kernels, plus CUDA throughput.

Correctness: every op of torch.ops.flatcomm (encode, encode_into, decode, decode_into, decode_sum,
decode_sum_into, decode_sum_encode, decode_sum_encode_into, ordered_sum, exact_exponents, to_exact,
from_exact, exact_sum), called through the public API (flatcomm.encode / decode / decode_sum and
flatcomm.ops.sums), for every codec, input dtype, decode output dtype, block size and size of the sweep,
on fresh random inputs (seed printed) with an all-zero block, subnormal and near-max blocks, and
inf / NaN blocks. The same inputs run on the CPU (the reference) and on the device; payloads,
residuals, decoded values and sums must match BIT FOR BIT (stochastic rounding included: the RNG is
counter-based). Device outputs of the *_into variants are poisoned first (all bytes 0xFF, a NaN for
floats) so an element the kernel forgets to write shows; functional outputs get the same poison
through the caching allocator (a poisoned block of the output's size is freed just before the call,
best effort). About a third of the cases use device tensors at a 4-byte (uint8 payloads) or
one-element offset, so the kernels' non-vectorised paths run too.

Timing (CUDA events, warm-up, median and min-max of --reps, default 20): Tensor.copy_ as the
bandwidth baseline, then each op and codec at 64M fp32 elements, with the bytes the op must move,
GB/s and the ratio to copy_. Speed targets (with error feedback): int8 / int4 / sign encode
>= 0.8x copy_, sparse >= 0.5x, topk >= 0.4x, decode_sum of 4 int8 rows and ordered_sum >= 0.8x,
exact_sum >= 0.7x; each printed as a TARGET MET / MISSED line. Bytes per fp32 element:
copy_ 8; encode+EF 12 (x, residual in and out) + payload; encode 4 + payload; decode payload + 4;
decode_sum W payloads + 4; decode_sum_encode+EF W payloads + 8 + payload; ordered_sum / exact_sum
4 W + 4; exact_exponents 4 W; to_exact 4 + 8; from_exact 8 + 4 (+ exponents).

    python3 benchmarks/gpu_check.py                     # full check + timing (CUDA), ~1-2 min on an H200
    python3 benchmarks/gpu_check.py --json out.json
    python3 benchmarks/gpu_check.py --sanitize          # tiny sizes, every op once (compute-sanitizer)
    python3 benchmarks/gpu_check.py --cupy              # the cupy / NVRTC path vs CPU and compiled kernels
    python3 benchmarks/gpu_check.py --collectives       # collectives over NCCL (world size 1) vs gloo on CPU
    python3 benchmarks/gpu_check.py --self-test         # CPU vs CPU, small sizes: tests this script
    python3 benchmarks/gpu_check.py --device cpu        # CPU vs CPU, the full sweep

cupy / NVRTC (--cupy; the self-test runs it CPU against CPU): the kernels of flatcomm/cupy_backend.py,
compiled at run time, registered over the compiled CUDA kernels for a short sweep against the CPU,
then compared directly with the compiled kernels (encode + EF and decode, every codec), and the int8
encode + EF timed on both. On a build without CUDA kernels where flatcomm uses the NVRTC path, the
plain full check tests that path against the CPU.

Collectives (--collectives; the self-test runs it with gloo on CPU): flatcomm.collectives on CUDA
tensors over a world-size-1 NCCL group vs the same calls on CPU tensors over gloo, bitwise: all_reduce
fp32 / int8 / sign with error feedback at 1 and 3 chunks, fp32 (zero-copy, staged, exact mode),
reduce_scatter fp32 / int8, all_gather int8, results of async_op=True consumed on another stream after
get_future().wait() / Handle.wait(), inputs written behind a busy caller stream, and three DDP steps
with flatcomm.ddp.register(model, "int8"); each also with the exchange forced through NCCL.

The check is split by job: gpu_check_common.py (configurations, inputs, the bitwise comparison),
gpu_check_correctness.py (the sweep and the harness's negative controls), gpu_check_timing.py,
gpu_check_cupy.py and gpu_check_collectives.py; this file is the command line and the report.

Exit status: 0 all equal, 1 failures (or interrupted), 2 no CUDA device / flatcomm built without CUDA.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import List, Optional

import torch

from gpu_check_common import DT_NAME, FULL, OPS, SANITIZE, SELF_TEST, Checker, ContextBroken, Interrupted

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

fc = None  # flatcomm, imported in main() so this file imports without a built extension


def environment(device: torch.device) -> dict:
    info = {"python": platform.python_version(), "torch": torch.__version__,
            "torch_cuda": torch.version.cuda, "device": str(device)}
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        info.update(gpu=p.name, capability=f"{p.major}.{p.minor}", gpu_memory_gib=round(p.total_memory / 2**30, 1))
    try:
        info["flatcomm"] = {k: (list(v) if isinstance(v, (list, tuple)) else v) for k, v in fc.build_info().items()}
    except Exception as e:  # noqa: BLE001
        info["flatcomm"] = f"build_info failed: {e}"
    return info


def main(argv: Optional[List[str]] = None) -> int:
    global fc
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", help="device checked against the CPU (default cuda)")
    ap.add_argument("--self-test", action="store_true",
                    help="CPU vs CPU on small sizes (tests this script, < 1 min)")
    ap.add_argument("--sanitize", action="store_true",
                    help="tiny sizes, every op once, no timing (for compute-sanitizer)")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--seed", type=int, default=None, help="input seed (default: random, printed)")
    ap.add_argument("--max-seconds", type=float, default=1e9,
                    help="correctness time budget: cases after it are skipped (and counted)")
    ap.add_argument("--no-timing", action="store_true")
    ap.add_argument("--no-correctness", action="store_true")
    ap.add_argument("--sizes", default=None, help="correctness sizes, comma-separated (overrides)")
    ap.add_argument("--timing-sizes", default=None, help="timing sizes, comma-separated (overrides)")
    ap.add_argument("--reps", type=int, default=None, help="timed repetitions per op (median)")
    ap.add_argument("--cupy", action="store_true",
                    help="only the cupy / NVRTC section (needs cupy and a CUDA build; the self-test runs it too)")
    ap.add_argument("--collectives", action="store_true",
                    help="only the collectives section: CUDA tensors over a world-size-1 NCCL group vs CPU "
                         "over gloo, streams, futures, a DDP step (the self-test runs it with gloo)")
    ap.add_argument("-v", "--verbose", action="store_true", help="tracebacks for exceptions")
    args = ap.parse_args(argv)

    if args.self_test:
        args.device = "cpu"
        cfg = dataclasses.replace(SELF_TEST)
    elif args.cupy or args.collectives:
        cfg = dataclasses.replace(SANITIZE)
        args.no_timing = args.no_correctness = True
    elif args.sanitize:
        cfg = dataclasses.replace(SANITIZE)
        args.no_timing = True
    else:
        cfg = dataclasses.replace(FULL)
    if args.device == "cpu" and not args.self_test and not args.timing_sizes:
        cfg.timing_sizes = (1 << 20,)
    if args.sizes:
        cfg.sizes = tuple(int(float(s)) for s in args.sizes.split(","))
    if args.timing_sizes:
        cfg.timing_sizes = tuple(int(float(s)) for s in args.timing_sizes.split(","))
    if args.reps:
        cfg.reps = args.reps

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print(f"gpu_check: no CUDA device (torch {torch.__version__}, torch.version.cuda="
              f"{torch.version.cuda}, torch.cuda.is_available() is False). This check needs a GPU; "
              "on a CPU-only machine run `python benchmarks/gpu_check.py --self-test` instead.",
              file=sys.stderr)
        return 2
    try:
        import flatcomm as _fc
    except ImportError as e:
        print(f"gpu_check: cannot import flatcomm: {e}", file=sys.stderr)
        return 2
    fc = _fc
    # The sections import flatcomm: only now that it imports.
    from gpu_check_collectives import collectives_section
    from gpu_check_correctness import Sweep, negative_controls
    from gpu_check_cupy import cupy_section
    from gpu_check_timing import run_timing

    env = environment(device)
    built = env["flatcomm"].get("devices", []) if isinstance(env["flatcomm"], dict) else []
    nvrtc_only = False
    try:
        nvrtc_only = fc.cuda_path().startswith("nvrtc")
    except AttributeError:
        pass
    if device.type == "cuda" and "cuda" not in built and not (nvrtc_only and not args.cupy):
        print(f"gpu_check: flatcomm was built without CUDA kernels (build_info devices = {built}); "
              "rebuild with FLATCOMM_CUDA=1 python3 setup.py build_ext --inplace", file=sys.stderr)
        return 2

    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "little")
    mode = ("self-test" if args.self_test else "sanitize" if args.sanitize else "cupy" if args.cupy
            else "collectives" if args.collectives else "full")
    print(f"== gpu_check ({mode}): {device} vs cpu, seed {seed} (rerun with --seed {seed})", flush=True)
    print("   " + json.dumps(env), flush=True)

    result: dict = {"mode": mode, "seed": seed, "env": env, "config": {
        k: (list(v) if isinstance(v, tuple) else v) for k, v in dataclasses.asdict(cfg).items()
        if k != "dtypes"}}
    result["config"]["dtypes"] = [DT_NAME[d] for d in cfg.dtypes]

    def on_term(signum, frame):  # timeout(1) sends SIGTERM: stop, but still write the JSON
        raise Interrupted(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_term)
    ck = Checker(device, args.max_seconds, args.verbose)
    t_start = time.monotonic()
    status = 0
    try:
        if args.self_test:
            problems = negative_controls(device)
            print(f"\n== harness negative controls: {'ok' if not problems else problems}", flush=True)
            result["negative_controls"] = problems or "ok"
            if problems:
                status = 1
        if not args.no_correctness:
            print(f"\n== correctness: {device} bitwise vs cpu; sizes {list(cfg.sizes)}, blocks "
                  f"{list(cfg.blocks)}, dtypes {[DT_NAME[d] for d in cfg.dtypes]}", flush=True)
            try:
                Sweep(ck, cfg, seed).run()
            except ContextBroken:
                pass
            result["correctness_seconds"] = round(time.monotonic() - t_start, 1)
        if not args.no_timing and cfg.timing_sizes and not ck.broken:
            clock = "CUDA events" if device.type == "cuda" else "perf_counter"
            print(f"\n== timing on {device}: median of {cfg.reps} ({clock}), bytes the op must move; "
                  "x copy = GB/s / copy_ GB/s", flush=True)
            try:
                rows, targets = run_timing(device, cfg.timing_sizes, cfg.reps)
            except (Interrupted, KeyboardInterrupt):
                raise
            except Exception as e:  # noqa: BLE001
                print(f"timing aborted: {type(e).__name__}: {e}", flush=True)
                rows, targets = [{"error": f"timing aborted: {type(e).__name__}: {e}"}], []
                status = 1
            result["timing"] = rows
            result["targets"] = targets
            if targets:
                note = "" if device.type == "cuda" else " (informational: the targets are for CUDA)"
                print(f"\n   speed targets at {targets[0]['numel']} elements, x copy_ (median; min-max of "
                      f"{cfg.reps}){note}:", flush=True)
                for t in targets:
                    spread = f" ({t['spread'][0]:.2f}-{t['spread'][1]:.2f})" if t["spread"] else ""
                    why = f" [{t['error']}]" if t.get("error") else ""
                    print(f"   TARGET {'MET   ' if t['ok'] else 'MISSED'} {t['op']:<24} {t['x_copy']:.2f}x{spread}"
                          f", required >= {t['required']}{why}", flush=True)
        if args.cupy or args.self_test:
            print("\n== cupy / NVRTC path vs the CPU and the compiled kernels", flush=True)
            try:
                cres = cupy_section(device, seed, max(args.max_seconds - (time.monotonic() - t_start), 20),
                                    cfg.reps, 1 << 26 if device.type == "cuda" else 1 << 16,
                                    self_test=args.self_test)
            except (Interrupted, KeyboardInterrupt):
                raise
            except ImportError as e:
                cres = {"skipped": f"{type(e).__name__}: {e}"}
                print(f"   skipped: {cres['skipped']}", flush=True)
            except Exception as e:  # noqa: BLE001
                cres = {"ok": False, "error": f"{type(e).__name__}: {e}"}
                print(f"   FAILED: {cres['error']}", flush=True)
                if args.verbose:
                    traceback.print_exc()
            result["cupy"] = cres
            if cres.get("ok") is False:
                status = 1
            if args.cupy:
                print(f"\ncupy: {'ok' if cres.get('ok') else cres.get('skipped') or 'FAILED'}", flush=True)
        if args.collectives or args.self_test:
            print("\n== collectives: streams, CUDA-aware futures, DDP hook, DiLoCo (world size 1)", flush=True)
            try:
                kres = collectives_section(device, seed, max(args.max_seconds - (time.monotonic() - t_start), 20),
                                           self_test=args.self_test)
            except (Interrupted, KeyboardInterrupt):
                raise
            except Exception as e:  # noqa: BLE001
                kres = {"ok": False, "error": f"{type(e).__name__}: {e}"}
                print(f"   FAILED: {kres['error']}", flush=True)
                if args.verbose:
                    traceback.print_exc()
            if "skipped" in kres:
                print(f"   skipped: {kres['skipped']}", flush=True)
            result["collectives"] = kres
            if kres.get("ok") is False:
                status = 1
            if args.collectives:
                print(f"\ncollectives: {'ok' if kres.get('ok') else kres.get('skipped') or 'FAILED'}", flush=True)
    except (Interrupted, KeyboardInterrupt) as e:
        print(f"\ngpu_check: interrupted ({e}); writing what was done", flush=True)
        result["interrupted"] = str(e)
        status = 1

    n_pass, n_fail = sum(ck.passed.values()), sum(ck.failed.values())
    result.update(passed=n_pass, failed=n_fail, cases=ck.cases, skipped_cases=ck.skipped_cases,
                  per_op={op: {"passed": ck.passed.get(op, 0), "failed": ck.failed.get(op, 0)} for op in OPS},
                  failures=ck.failures[:1000], context_broken=ck.broken,
                  seconds=round(time.monotonic() - t_start, 1))
    if not args.no_correctness:
        print("\n== correctness summary (checks per op: passed / failed)")
        for op in OPS:
            print(f"   {op:<24} {ck.passed.get(op, 0):6d} / {ck.failed.get(op, 0)}")
        missing = [op for op in OPS if ck.passed.get(op, 0) + ck.failed.get(op, 0) == 0]
        if missing and not result.get("interrupted") and not ck.skipped_cases:
            print(f"   ops never checked: {missing}")
            result["unchecked_ops"] = missing
            status = 1
        if ck.skipped_cases:
            why = "CUDA context broken" if ck.broken else "--max-seconds budget"
            print(f"   {ck.skipped_cases} cases skipped ({why})")
        print(f"\n{n_pass} passed, {n_fail} failed  ({ck.cases} cases, seed {seed}, "
              f"{result['seconds']} s)", flush=True)
        if n_fail or ck.broken:
            status = 1
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1, default=str))
        print(f"wrote {args.json}")
    return status


if __name__ == "__main__":
    sys.exit(main())

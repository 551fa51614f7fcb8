"""Hardening runs: a random-argument fuzz of the collectives and SIGKILLs of a peer mid call.

``python -m flatcomm.tools.hardening fuzz --calls 2000``: calls of every collective (flat on 2 and
4 gloo ranks, two-level on 2 x 2) with random sizes, dtypes, codecs, ops, modes, chunks, residuals,
async or not, one rank's arguments perturbed at a time (types, ranges, per-rank differences).
Every call must end the same way on every rank (the same result, or the same exception with the
same message), within the group's timeout, and the call after it must work everywhere. A rank
killed by a signal fails the run.

``python -m flatcomm.tools.hardening kills --count 200``: 4 ranks (2 x 2) loop two-level
all-reduces; one is SIGKILLed at a random moment; every survivor must raise within the group's
timeout and exit cleanly (exit code 0, nothing like ``terminate called`` on stderr).

Both print a summary and exit non-zero on any failure. Loopback only.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import zlib
from datetime import timedelta
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from ..ops.codecs import BLOCKWISE, CODECS, PRECISION, Codec

__all__ = ["fuzz", "kills", "main"]

# The fuzz draws from every codec of the codec table (flatcomm.ops.codecs); an intra-node codec is
# one of the two most precise lossy ones.
INTRA_CODECS = PRECISION[1:3]
SIZES = (0, 1, 7, 100, 1000, 4099, 30011)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# ---- the fuzz -------------------------------------------------------------------------------------


def _spec(rng: random.Random, world: int, two_level: bool) -> Dict[str, Any]:
    """One call as every rank would make it before the perturbation."""
    kind = rng.choice(("all_reduce", "all_reduce", "reduce_scatter", "all_gather"))
    mode = "exact" if kind != "all_gather" and rng.random() < 0.15 else "ordered"
    codec: Any = "fp32" if mode == "exact" else rng.choice(CODECS)
    if codec in BLOCKWISE and rng.random() < 0.3:
        codec = ("codec", codec, rng.choice((32, 64, 512)), None)
    elif Codec(codec).sparse and rng.random() < 0.5:
        codec = ("codec", codec, 256, rng.choice((0.001, 0.05, 0.3)))
    s = {"kind": kind, "numel": rng.choice(SIZES), "dtype": rng.randrange(3) if mode == "ordered" else 0,
         "codec": codec, "op": rng.choice(("avg", "sum")), "mode": mode,
         "chunks": rng.choice((None, None, 1, 3)), "residual": rng.random() < 0.4 and mode == "ordered",
         "async_op": rng.random() < 0.3, "two_level": two_level and rng.random() < 0.5,
         "intra_codec": "fp32" if mode == "exact" or rng.random() < 0.7 else rng.choice(INTRA_CODECS)}
    return s


# Perturbations of one rank's arguments: name -> spec edit (a new value for one entry).
PERTURB: Dict[str, Callable[[Dict[str, Any], random.Random], Tuple[str, Any]]] = {
    "numel+1": lambda s, r: ("numel", s["numel"] + 1),
    "numel x2": lambda s, r: ("numel", s["numel"] * 2 + 64),
    "numel 0": lambda s, r: ("numel", 0),
    "dtype other": lambda s, r: ("dtype", (s["dtype"] + 1) % 3),
    "dtype float64": lambda s, r: ("dtype", "float64"),
    "dtype int32": lambda s, r: ("dtype", "int32"),
    "codec other": lambda s, r: ("codec", r.choice([c for c in CODECS if c != s["codec"]])),
    "codec unknown": lambda s, r: ("codec", "int2"),
    "codec 8": lambda s, r: ("codec", 8),
    "block 64": lambda s, r: ("codec", ("codec", "int8", 64, None)),
    "topk ratio nudged": lambda s, r: ("codec", ("codec", "topk", 256, 0.01 + 4e-7)),
    "op other": lambda s, r: ("op", "sum" if s["op"] == "avg" else "avg"),
    "op max": lambda s, r: ("op", "max"),
    "mode other": lambda s, r: ("mode", "exact" if s["mode"] == "ordered" else "ordered"),
    "mode unknown": lambda s, r: ("mode", "fast"),
    "chunks -1": lambda s, r: ("chunks", -1),
    "chunks 0": lambda s, r: ("chunks", 0),
    "chunks 2.5": lambda s, r: ("chunks", 2.5),
    "chunks True": lambda s, r: ("chunks", True),
    "chunks 10^6": lambda s, r: ("chunks", 10 ** 6),
    "chunks other": lambda s, r: ("chunks", 2 if s["chunks"] != 2 else 5),
    "exact_block 0": lambda s, r: ("exact_block", 0),
    "exact_block 128": lambda s, r: ("exact_block", 128),
    "exact_block 256.5": lambda s, r: ("exact_block", 256.5),
    "headroom 0": lambda s, r: ("headroom", 0),
    "headroom -1": lambda s, r: ("headroom", -1),
    "headroom 40": lambda s, r: ("headroom", 40),
    "headroom 12": lambda s, r: ("headroom", 12),
    "residual +1": lambda s, r: ("residual", "long"),
    "residual float64": lambda s, r: ("residual", "float64"),
    "residual a list": lambda s, r: ("residual", "list"),
    "residual toggled": lambda s, r: ("residual", not s["residual"]),
    "tensor non-contiguous": lambda s, r: ("layout", "strided"),
    "tensor meta": lambda s, r: ("layout", "meta"),
    "tensor requires grad": lambda s, r: ("layout", "grad"),
    "tensor a list": lambda s, r: ("layout", "list"),
    "async_op 'yes'": lambda s, r: ("async_op", "yes"),
    "async toggled": lambda s, r: ("async_op", not s["async_op"]),
    "stats 5": lambda s, r: ("stats", 5),
    "validate 'no'": lambda s, r: ("validate", "no"),
    "flat on this rank": lambda s, r: ("two_level", not s["two_level"]),
    "intra codec other": lambda s, r: ("intra_codec", "int4" if s["intra_codec"] != "int4" else "bf16"),
}


def _codec_of(c):
    import flatcomm

    if isinstance(c, tuple):
        _, name, block, ratio = c
        return flatcomm.Codec(name, block, ratio if ratio is not None else 0.01)
    return c


def _residual_numel(kind: str, n: int, world: int, topology, codec, intra) -> int:
    from flatcomm import hierarchical as H

    if kind == "reduce_scatter":
        return n * world // (topology.local_size if topology is not None else 1)
    if kind == "all_reduce" and topology is not None:
        try:
            return H.shard_numel(n, topology, codec, intra)
        except Exception:  # noqa: BLE001 - a perturbed codec: any size (the call rejects the codec)
            return n
    return n


def _call(s: Dict[str, Any], rank: int, world: int, topo) -> Optional[torch.Tensor]:
    """Run one (possibly perturbed) call; the output, or raises."""
    from flatcomm import collectives as C

    g = torch.Generator().manual_seed(hash((s["numel"], rank)) & 0xFFFF)
    dtype = {"float64": torch.float64, "int32": torch.int32}.get(s["dtype"]) if isinstance(s["dtype"], str) \
        else DTYPES[s["dtype"]]
    n, kind = s["numel"], s["kind"]
    topology = topo if s["two_level"] else None
    codec, intra = _codec_of(s["codec"]), s["intra_codec"]
    shape = {"all_reduce": n, "reduce_scatter": n * world, "all_gather": n}[kind]
    x = (torch.randn(shape, generator=g) * 4).to(dtype)
    layout = s.get("layout")
    if layout == "strided":
        x = torch.stack([x, x], 1)[:, 0] if x.numel() > 1 else torch.empty(2, dtype=dtype)[::2]
    elif layout == "meta":
        x = x.to("meta")
    elif layout == "grad" and x.is_floating_point():
        x.requires_grad_(True)
    elif layout == "list":
        x = x.tolist()  # type: ignore[assignment]
    kw: Dict[str, Any] = {"codec": codec, "async_op": s["async_op"]}
    for k in ("stats", "validate"):
        if k in s:
            kw[k] = s[k]
    if topology is not None:
        kw["topology"] = topology
        kw["intra_codec"] = intra
    if kind != "all_gather":
        kw.update(op=s["op"], mode=s["mode"], chunks=s["chunks"])
        for k in ("exact_block", "headroom"):
            if k in s:
                kw[k] = s[k]
    res = s["residual"]
    if res:
        size = _residual_numel(kind, n, world, topology, codec, intra) + (1 if res == "long" else 0)
        t: Any = torch.zeros(size, dtype=torch.float64 if res == "float64" else torch.float32)
        if res == "list":
            t = [0.0] * size
        kw["residual"] = C.ErrorFeedback(t, torch.zeros(size)) if kind == "all_reduce" and res != "list" else t
    if kind == "all_reduce":
        h = C.all_reduce(x, **kw)
        out = x
    elif kind == "reduce_scatter":
        out = torch.empty(n, dtype=dtype)
        h = C.reduce_scatter(out, x, **kw)
    else:
        out = torch.empty(n * world, dtype=dtype)
        h = C.all_gather(out, x, **kw)
    if h is not None and hasattr(h, "wait"):
        h.wait(timeout=120.0)
    return out if isinstance(out, torch.Tensor) else None


def _fuzz_rank(rank: int, world: int, calls: int, seed: int, pg_timeout: float, progress: bool = False,
               trace: str = "") -> List[tuple]:
    from flatcomm import Topology
    from flatcomm import collectives as C

    topo = Topology(local_size=2) if world == 4 else None
    rng = random.Random(seed * 1000 + world)  # the same on every rank
    out = []
    for i in range(calls):
        s = _spec(rng, world, topo is not None)
        name = rng.choice(sorted(PERTURB)) if rng.random() < 0.85 else None
        p = rng.randrange(world)
        if name is not None:
            key, value = PERTURB[name](s, rng)
            if rank == p:
                s = dict(s, **{key: value})
        if trace:  # which call each rank is in, for a run that hangs
            with open(os.path.join(trace, f"rank{rank}.txt"), "a") as f:
                f.write(f"{i} {name} on {p}: {s}\n")
        t0 = time.monotonic()
        result: Tuple[str, ...]
        try:
            y = _call(s, rank, world, topo)
            result = ("ok", _digest(y, s["kind"]))
        except Exception as e:  # noqa: BLE001 - every outcome is compared across ranks
            result = (type(e).__name__, str(e)[:400])
        took = time.monotonic() - t0
        try:  # the next call works on every rank
            t = torch.full((333,), 1.0)
            C.all_reduce(t, op="sum")
            nxt = bool((t == world).all())
        except Exception as e:  # noqa: BLE001
            nxt = False
            result = result + (f"next call: {e!r}"[:300],)
        out.append((i, name, p, s["kind"], s["two_level"], result[0], result[1], took, nxt))
        if progress and rank == 0 and (i + 1) % 100 == 0:
            print(f"world {world}: {i + 1}/{calls} calls", file=sys.stderr, flush=True)
    return out


def _digest(y: Optional[torch.Tensor], kind: str) -> str:
    """What must agree across ranks: an all-reduce's bits (every rank holds the same), else the size."""
    if y is None:
        return ""
    if kind != "all_reduce":
        return f"{y.numel()} values"
    return f"{y.numel()} values, crc {zlib.crc32(y.detach().clone(memory_format=torch.contiguous_format).view(torch.uint8).numpy().tobytes()):08x}"


def fuzz(calls: int = 2000, worlds=(2, 4), seed: int = 0, pg_timeout: float = 30.0, progress: bool = False,
         trace: str = "") -> dict:
    """Run the fuzz (``calls`` split over ``worlds``); a summary dict with the failures."""
    from flatcomm.tools import spawn

    per_world = max(1, calls // len(worlds))
    failures: List[str] = []
    counts: Dict[str, int] = {"calls": 0, "errors raised": 0, "succeeded": 0}
    slowest = 0.0
    t0 = time.monotonic()
    for world in worlds:
        try:
            ranks = spawn.run(world, _fuzz_rank, per_world, seed, pg_timeout, progress, trace, timeout_s=pg_timeout,
                              run_s=60 + per_world * 2.0)
        except Exception as e:  # noqa: BLE001 - a rank died (signal) or hung: the run failed
            failures.append(f"world {world}: the run failed: {str(e)[-1500:]}")
            continue
        for rows in zip(*ranks):
            i, name, p, kind, two, *_ = rows[0]
            counts["calls"] += 1
            what = f"world {world} call {i} ({kind}{' two-level' if two else ''}, {name or 'no perturbation'} " \
                   f"on rank {p})"
            outcomes = {(r[5], r[6]) for r in rows}
            if len(outcomes) != 1:
                failures.append(f"{what}: ranks differ: " + " | ".join(f"rank {k}: {r[5]}: {r[6][:160]}"
                                                                       for k, r in enumerate(rows)))
            counts["errors raised" if rows[0][5] != "ok" else "succeeded"] += 1
            slowest = max(slowest, *(r[7] for r in rows))
            if any(r[7] > pg_timeout for r in rows):
                failures.append(f"{what}: took {max(r[7] for r in rows):.1f} s (group timeout {pg_timeout} s)")
            if not all(r[8] for r in rows):
                failures.append(f"{what}: the next call failed on ranks {[k for k, r in enumerate(rows) if not r[8]]}")
    return {**counts, "failures": failures, "slowest call s": round(slowest, 3),
            "wall s": round(time.monotonic() - t0, 1)}


# ---- the kills --------------------------------------------------------------------------------------


def _kill_rank(rank: int, world: int, init: str, pg_timeout: float, calls: int) -> None:
    """A rank of the kill run (a subprocess): loop two-level all-reduces until a peer dies."""
    import flatcomm
    from flatcomm import Topology
    from flatcomm import collectives as C

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                            timeout=timedelta(seconds=pg_timeout))
    topo = Topology(local_size=2)
    n = 1 << 16
    ef = C.ErrorFeedback.zeros(flatcomm.hierarchical.shard_numel(n, topo, "int8"))
    x = torch.randn(n)

    def call(i: int) -> None:
        v = i % 3
        if v == 0:
            C.all_reduce(x, codec="int8", topology=topo, residual=ef, chunks=2)
        elif v == 1:
            C.all_reduce(x, codec="fp32", topology=topo)
        else:
            h = C.all_reduce(x, codec="int8", intra_codec="bf16", topology=topo, async_op=True)
            assert h is not None
            h.wait()
        x.mul_(0.5).add_(1.0)

    # Each kind of call once before the kills: the first call on a group makes gloo connect it,
    # and a peer killed then leaves the others in gloo's connect timeout (5 x the group's), not
    # in a flatcomm call.
    for i in range(3):
        call(i)
    print("ready", flush=True)
    status = "finished"
    i = 0
    try:
        for i in range(3, calls):
            call(i)
    except Exception as e:  # noqa: BLE001 - expected once the peer dies
        why = " ".join(str(e).split())[:300]
        status = f"raised {type(e).__name__} at {time.time():.3f} after call {i}: {why}"
    print(status, flush=True)
    dist.destroy_process_group()
    print("exited", flush=True)


def kills(count: int = 200, pg_timeout: float = 5.0, seed: int = 0, log=None) -> dict:
    """``count`` runs of 4 ranks, each with one rank SIGKILLed mid call; a summary dict."""
    rng = random.Random(seed)
    failures: List[str] = []
    raise_s: List[float] = []
    t_start = time.monotonic()
    for trial in range(count):
        with tempfile.TemporaryDirectory() as tmp:
            init = f"file://{os.path.join(tmp, 'rendezvous')}"
            procs = [subprocess.Popen(
                [sys.executable, "-m", "flatcomm.tools.hardening", "_kill_rank", str(r), "4", init,
                 str(pg_timeout)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                for r in range(4)]
            try:
                ok = all((p.stdout.readline().strip() == "ready") for p in procs)  # type: ignore[union-attr]
                if not ok:
                    failures.append(f"trial {trial}: a rank did not start")
                    continue
                time.sleep(rng.uniform(0.0, 1.0))
                victim = rng.randrange(4)
                procs[victim].send_signal(signal.SIGKILL)
                killed_at = time.time()
                deadline = time.monotonic() + 3 * pg_timeout + 20
                for r, p in enumerate(procs):
                    if r == victim:
                        p.wait()
                        continue
                    try:
                        out, err = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
                    except subprocess.TimeoutExpired:
                        p.kill()
                        out, err = p.communicate()
                        failures.append(f"trial {trial}: rank {r} still running {3 * pg_timeout + 20:.0f} s after the kill")
                        continue
                    why = []
                    if p.returncode != 0:
                        why.append(f"exit code {p.returncode}")
                    if "terminate called" in err or "Aborted" in err or "Segmentation" in err:
                        why.append("stderr: " + err.strip()[-300:])
                    if "exited" not in out:
                        why.append("did not exit cleanly")
                    if "raised" not in out:
                        why.append("did not raise" if "finished" not in out else "finished all calls (killed too late)")
                    else:
                        t = float(out.split(" at ")[1].split()[0])
                        raise_s.append(t - killed_at)
                        if t - killed_at > pg_timeout + 2.0:
                            said = out[out.index("raised"):].splitlines()[0]
                            why.append(f"raised {t - killed_at:.1f} s after the kill (timeout {pg_timeout} s): {said}")
                    if why:
                        failures.append(f"trial {trial}: rank {r} (victim {victim}): " + "; ".join(why))
            finally:
                for p in procs:
                    if p.poll() is None:
                        p.kill()
                        p.wait()
        if log is not None:
            log(f"trial {trial + 1}/{count}: {len(failures)} failures so far"
                + (f" (last: {failures[-1][:400]})" if failures else ""))
    raise_s.sort()
    return {"kills": count, "survivors": 3 * count, "failures": failures,
            "raise s median": round(raise_s[len(raise_s) // 2], 2) if raise_s else None,
            "raise s max": round(raise_s[-1], 2) if raise_s else None,
            "wall s": round(time.monotonic() - t_start, 1)}


# ---- command line -----------------------------------------------------------------------------------


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "_kill_rank":  # a rank of the kill run
        _kill_rank(int(argv[1]), int(argv[2]), argv[3], float(argv[4]), 10 ** 6)
        return 0
    ap = argparse.ArgumentParser(prog="python -m flatcomm.tools.hardening", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("fuzz", help="random-argument fuzz of the collectives")
    f.add_argument("--calls", type=int, default=2000)
    f.add_argument("--worlds", default="2,4")
    f.add_argument("--seed", type=int, default=0)
    f.add_argument("--trace", default="", help="a folder: each rank appends the call it is in to rank<r>.txt")
    k = sub.add_parser("kills", help="SIGKILL a peer mid two-level call")
    k.add_argument("--count", type=int, default=200)
    k.add_argument("--timeout", type=float, default=5.0, help="process-group timeout, seconds")
    k.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    if a.cmd == "fuzz":
        res = fuzz(a.calls, tuple(int(w) for w in a.worlds.split(",")), a.seed, progress=True, trace=a.trace)
    else:
        res = kills(a.count, a.timeout, a.seed, log=lambda m: print(m, file=sys.stderr, flush=True))
    shown = dict(res, failures=len(res["failures"]))
    print(json.dumps(shown, indent=1))
    for line in res["failures"][:50]:
        print("FAIL", line)
    return 1 if res["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())

"""Host memory of the DDP hook: process RSS of 2 gloo ranks training a 263K-parameter MLP, plain
DDP against flatcomm's hook, each run in fresh processes, alternated (docs/ddp.md, "Host memory").

    python -m flatcomm.tools.bench.host_memory --steps 300 --hooks plain,int8 --repeat 2

Prints one JSON line per run: VmRSS (MiB, from /proc/self/status) of every rank every 50 steps,
and after ``malloc_trim(0)`` at the end (what glibc then hands back is memory it kept after free).
"""
from __future__ import annotations

import argparse
import ctypes
import json
import sys
import time

import torch

from flatcomm.tools import spawn


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _rank(rank: int, world: int, hook: str, steps: int) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    import flatcomm.ddp as fddp

    torch.manual_seed(0)
    ddp = DDP(torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 256)))
    state = fddp.register(ddp, hook) if hook != "plain" else None
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    x = torch.randn(32, 256, generator=torch.Generator().manual_seed(rank))
    rss = {}
    for step in range(steps + 1):
        if step % 50 == 0:
            if state is not None:
                state.wait()
            rss[step] = round(_rss_mib(), 1)
        opt.zero_grad()
        ddp(x).square().mean().backward()
        opt.step()
    if state is not None:
        state.wait()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        trimmed = round(_rss_mib(), 1)
    except OSError:  # not glibc
        trimmed = None
    return {"rss_mib": rss, "after_malloc_trim_mib": trimmed}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--hooks", default="plain,int8")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=300.0)
    a = ap.parse_args(argv)
    for _ in range(a.repeat):
        for hook in a.hooks.split(","):
            t0 = time.perf_counter()
            ranks = spawn.run(2, _rank, hook, a.steps, timeout_s=a.timeout)
            print(json.dumps({"hook": hook, "steps": a.steps, "ranks": ranks,
                              "seconds": round(time.perf_counter() - t0, 1)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Step time and memory of flatcomm.reproducible vs plain DDP (fp32 all-reduce), on gloo ranks.

    python -m flatcomm.tools.bench.reproducible                 # 2 ranks, the example's model
    python -m flatcomm.tools.bench.reproducible --dim 256 --steps 10 [--example PATH]

The model and data are those of examples/reproducible_train.py (a byte-level transformer), loaded
from the source checkout (or ``--example PATH``: the example is not installed with the package). Modes
(same global batch and optimizer):

* ``reproducible``: ExactGradAccumulator, M micro-batches, exact int64 accumulation and reduction;
* ``ddp-micro``: DDP with the same micro-batches (no_sync for all but the last, loss / (M / W)),
  the like-for-like baseline: same forward/backward work, one fp32 all-reduce per step;
* ``ddp``: DDP with one forward/backward of the rank's whole share per step (what people run when
  they do not need micro-batches), for reference.

The modes run interleaved, step by step, in the same processes (load from other work on a shared
machine then hits all of them alike). Per step, the time is the max over ranks; the table shows the
median over the timed steps (after warm-up steps, which include the reproducible mode's first-step
replay). Memory: the accumulator's own buffers (flat grads, int64 accumulator, the transient
to_exact result) against the parameter bytes, and each mode's max RSS (a short separate run each).
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import resource
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

from flatcomm import reproducible
from flatcomm.tools import spawn

# The checkout's example, next to flatcomm/ (flatcomm/tools/bench/reproducible.py -> 3 levels up).
EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "reproducible_train.py"


def _load_example(path: str):
    spec = importlib.util.spec_from_file_location("reproducible_train", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _Mode:
    def __init__(self, mode: str, rank: int, world: int, args: dict, ex):
        self.mode, self.rank, self.world, self.args, self.ex = mode, rank, world, args, ex
        torch.manual_seed(0)
        self.model = ex.TinyLM(args["ctx"], dim=args["dim"], dropout=0.0)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.times: list = []
        self.split = {"compute_s": 0.0, "accumulate_s": 0.0, "reduce_s": 0.0}
        if mode == "reproducible":
            self.acc = reproducible.ExactGradAccumulator(self.model, micro_batches=args["micro_batches"],
                                                         digest=args["digest"])
        else:
            self.net = torch.nn.parallel.DistributedDataParallel(self.model)

    def step(self, x: torch.Tensor, y: torch.Tensor, timed: bool) -> None:
        ex, M, rank, world = self.ex, self.args["micro_batches"], self.rank, self.world
        mb = self.args["batch"] // M
        dist.barrier()
        t0 = time.perf_counter()
        if self.mode == "reproducible":
            for i in self.acc.micro_batches():
                ex.lm_loss(self.model, x[i * mb:(i + 1) * mb], y[i * mb:(i + 1) * mb]).backward()
            if self.acc.stats.applied:
                self.opt.step()
        elif self.mode == "ddp-micro":
            self.opt.zero_grad(set_to_none=True)
            mine = list(range(rank, M, world))
            for k, i in enumerate(mine):
                loss = ex.lm_loss(self.net, x[i * mb:(i + 1) * mb], y[i * mb:(i + 1) * mb]) / len(mine)
                if k + 1 < len(mine):
                    with self.net.no_sync():
                        loss.backward()
                else:
                    loss.backward()
            self.opt.step()
        else:
            self.opt.zero_grad(set_to_none=True)
            share = self.args["batch"] // world
            ex.lm_loss(self.net, x[rank * share:(rank + 1) * share], y[rank * share:(rank + 1) * share]).backward()
            self.opt.step()
        dt = time.perf_counter() - t0
        if timed:
            self.times.append(dt)
            if self.mode == "reproducible":
                for k in self.split:
                    self.split[k] += getattr(self.acc.stats, k)


def _rank(rank: int, world: int, modes: list, args: dict) -> dict:
    """Runs the modes interleaved step by step (load changes on a shared machine hit all alike)."""
    ex = _load_example(args["example"])  # the example's model and data

    reproducible.configure()
    data = ex.corpus()
    runs = [_Mode(m, rank, world, args, ex) for m in modes]
    for step in range(args["warmup"] + args["steps"]):
        x, y = ex.global_batch(data, step, args["batch"], args["ctx"])
        for r in runs:
            r.step(x, y, step >= args["warmup"])
    out = {r.mode: {"times": r.times} for r in runs}
    for r in runs:
        if r.mode == "reproducible":
            out[r.mode].update(memory=r.acc.memory_bytes(), split=r.split, wire_bytes=r.acc.stats.wire_bytes)
    out["params"] = sum(p.numel() for p in runs[0].model.parameters())
    out["maxrss_kib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--ctx", type=int, default=32)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--micro-batches", type=int, default=8)
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--no-digest", dest="digest", action="store_false", help="skip the per-step sha256")
    ap.add_argument("--no-rss", dest="rss", action="store_false", help="skip the per-mode max-RSS runs")
    ap.add_argument("--modes", default="reproducible,ddp-micro,ddp")
    ap.add_argument("--example", default=str(EXAMPLE), help="path of examples/reproducible_train.py")
    a = ap.parse_args()
    if not os.path.isfile(a.example):
        ap.error(f"--example {a.example}: not found (the source checkout's examples/reproducible_train.py)")
    args = vars(a)
    modes = a.modes.split(",")
    per_rank = spawn.run(a.world, _rank, modes, args, timeout_s=600)
    med = {m: statistics.median(max(r[m]["times"][s] for r in per_rank) for s in range(a.steps)) for m in modes}
    rss = {}
    if a.rss:  # each mode alone, a few steps: its own max RSS
        for m in modes:
            short = dict(args, steps=2, warmup=1)
            rss[m] = max(r["maxrss_kib"] for r in spawn.run(a.world, _rank, [m], short, timeout_s=600))
    print(f"# {a.world} ranks (gloo, 1 thread each), model dim {a.dim}: {per_rank[0]['params']:,} params, "
          f"global batch {a.batch} = {a.micro_batches} micro-batches, {a.steps} timed steps (interleaved)")
    base = med.get("ddp-micro")
    print(f"{'mode':14s} {'step ms':>9s} {'vs ddp-micro':>13s} {'max RSS MiB':>12s}")
    for m in modes:
        ratio = f"{med[m] / base:.2f}x" if base else "-"
        shown = f"{rss[m] / 1024:12.1f}" if m in rss else f"{'-':>12s}"
        print(f"{m:14s} {med[m] * 1e3:9.1f} {ratio:>13s} {shown}")
    if "reproducible" in modes:
        r0 = per_rank[0]["reproducible"]
        mem = r0["memory"]
        p = mem["parameters"]
        print("reproducible buffers (bytes, x parameter bytes): " + ", ".join(
            f"{k} {v:,} ({v / p:.2f}x)" for k, v in mem.items() if k != "parameters") + f"; parameters {p:,}")
        s = r0["split"]
        tot = sum(s.values())
        print("reproducible time split (rank 0): " + ", ".join(f"{k[:-2]} {v / tot:.0%}" for k, v in s.items())
              + f"; wire bytes per step {r0['wire_bytes']:,}")


if __name__ == "__main__":
    main()

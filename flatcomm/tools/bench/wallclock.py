"""The user's number: held-out loss at a fixed wall-clock budget over a slow link (a tool).

    python -m flatcomm.bench diloco --wallclock 10mbit,100mbit [--wallclock-seconds 150]
        [--wallclock-seeds 3] [--wallclock-rows ddp,fp32,int4,top64,top256,auto,sparseloco,torchft]
        [--wallclock-size 100k] [--wallclock-sync-every 15] [--wallclock-points docs/bench/wallclock.jsonl]
        [--wallclock-doc docs/diloco.md] [--json PATH]

Every run is 2 replicas, one gloo rank each, each in its own network namespace of a
:class:`flatcomm.tools.netlink.Link` (tc tbf at the link's rate), each pinned to a core of its own
(``--pin``). A run trains the ``lm_diloco`` char LM (``--wallclock-size``, the frontier's sizes:
AdamW (0.9, 0.95), weight decay 0.1, clipping at 1, accumulation over 2 micro-batches) for the
same wall-clock budget, everything counted: compute, syncs, waits for the other replica. The
learning-rate schedule runs on that clock: linear warm-up over the first tenth of the budget,
cosine to a tenth at its end (a user with H hours sets the schedule to H hours). Rows:

* ``ddp``: torch's DDP, gloo all-reduce of the gradients every step;
* ``fp32``, ``int4``: DiLoCo every H steps (outer lr 0.7, Nesterov 0.9, error feedback);
* ``top<k>``: flatcomm's ``sparse`` keeping k of 4,096 with the frontier's recipe (gathered sum,
  error decay 0.95, no momentum, outer lr 2.0);
* ``auto``: ``DiLoCo(codec="auto")`` (it times the steps before the first sync and the link);
* ``sparseloco``: SparseLoCo's outer sync as Templar runs it (:mod:`.sparseloco`);
* ``torchft``: torchft's DiLoCo, fp32 pseudo-gradients, a lighthouse on replica 0.

DiLoCo runs with one fragment and no delay (the sync blocks, as torchft's), so after a sync both
replicas hold the same weights. The replicas decide together when to stop and when to evaluate: a
tiny all-reduce of their clocks (maximum) every step for DDP, after every sync for the others; the
run ends at the first such point past the budget. There the clock stops for a held-out evaluation
(about every tenth of the budget, at the start and at the end; both replicas wait for it). The
loss *at the budget* and the time to reach a target loss are read from this held-out curve by
linear interpolation (:mod:`.wallclock_report`); the target is int4 DiLoCo's loss at the budget,
same seed. Each finished run appends a JSON line to ``--wallclock-points`` (a rerun skips it).
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import time
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist

from .convergence_workloads import forward_backward, held_out_loss, parse_row
from .diloco import _my_address, _pin, _progress, _tx
from .frontier import SizedLM, row_spec

ROWS = ("ddp", "fp32", "int4", "top64", "top256", "auto", "sparseloco", "torchft")
EVALS = 10  # held-out evaluations over the budget (and one at the start, one at the end)
CURVE_POINTS = 30  # train-loss points kept per run (the JSON stays small)


class Clock:
    """Seconds of training since the start; the held-out evaluations are taken off it."""

    def __init__(self) -> None:
        self.t0, self.off_s = time.perf_counter(), 0.0

    def now(self) -> float:
        return time.perf_counter() - self.t0 - self.off_s

    @contextlib.contextmanager
    def stopped(self):
        t = time.perf_counter()
        try:
            yield
        finally:
            self.off_s += time.perf_counter() - t


def lr_factor(progress: float) -> float:
    """Warm-up over the first tenth of the budget, then cosine to a tenth at the budget."""
    if progress < 0.1:
        return max(progress, 1e-3) / 0.1
    return 0.1 + 0.45 * (1.0 + math.cos(math.pi * min(1.0, (progress - 0.1) / 0.9)))


def _set_lr(opt, base: List[float], progress: float) -> None:
    for g, lr in zip(opt.param_groups, base):
        g["lr"] = lr * lr_factor(progress)


def _outer(row: str, h: int, model, opt):
    """The row's outer sync (None for DDP)."""
    from .convergence_diloco import build_outer

    if row == "ddp":
        return None
    if row == "auto":
        from flatcomm.diloco import DiLoCo

        return DiLoCo(model, opt, sync_every=h, codec="auto")
    if row == "sparseloco":
        return build_outer("sparseloco", {"H": h}, model, opt)
    name, opts = parse_row(row_spec(row, h))
    return build_outer(name, opts, model, opt)


def _torchft_outer(rank: int, world: int, cfg: Dict[str, Any], model, opt):
    """torchft's DiLoCo as in diloco.py's ``_torchft_rank``: one lighthouse on replica 0, a Manager
    per replica (fp32 pseudo-gradients: its quantized path needs triton/CUDA). Returns the context."""
    from datetime import timedelta

    from torchft import Manager, ProcessGroupGloo
    from torchft._torchft import LighthouseServer
    from torchft.local_sgd import DiLoCo as TorchftDiLoCo

    from flatcomm.elastic.replica import HostTransport  # torchft's advertises the host's name: not routable

    port = cfg["port"]  # a fresh port per run: the namespaces outlive the runs
    addrs: List[str] = [""] * world
    dist.all_gather_object(addrs, _my_address())
    keep = [LighthouseServer(bind=f"[::]:{port}", min_replicas=world)] if rank == 0 else []
    dist.barrier()
    keep.append(torch.distributed.TCPStore(addrs[rank], port + 1, is_master=True, wait_for_workers=False))
    t = timedelta(seconds=300)
    manager = Manager(pg=ProcessGroupGloo(timeout=t), min_replica_size=world, use_async_quorum=False,
                      load_state_dict=lambda sd: None, state_dict=lambda: {}, replica_id=str(rank),
                      store_addr=addrs[rank], store_port=port + 1, rank=0, world_size=1,
                      lighthouse_addr=f"http://{addrs[0]}:{port}", hostname=addrs[rank], port=port + 2,
                      timeout=t, quorum_timeout=t, checkpoint_transport=HostTransport(addrs[rank], t))
    outer_opt = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    ctx = TorchftDiLoCo(manager, [model], opt, outer_opt, sync_every=cfg["H"], backup_device=torch.device("cpu"),
                        fragment_sync_delay=0)
    return ctx, manager, keep


def run_rank(rank: int, world: int, cfg: Dict[str, Any]) -> Dict[str, Any]:
    """One replica of one run: train for ``cfg["seconds"]`` of wall-clock, evaluate on the way."""
    if cfg["pin"]:
        _pin(rank)
    torch.set_num_threads(1)
    row, h, budget = cfg["row"], cfg["H"], cfg["seconds"]
    w = SizedLM(cfg["seed"], cfg["size"], steps=1)  # steps unused: the schedule runs on the clock
    torch.manual_seed(1000 + cfg["seed"])  # every row's init per seed
    model = w.model()
    opt, _ = w.make_optimizer(model.parameters())
    base = [g["lr"] for g in opt.param_groups]
    ctl = dist.new_group(backend="gloo")  # the replicas' clock agreement, apart from the syncs' traffic
    net, pause, outer, ctx, extra = model, contextlib.nullcontext, None, contextlib.nullcontext(), ()
    if row == "ddp":
        net = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=25)
        pause = net.no_sync
    elif row == "torchft":
        ctx, *extra = _torchft_outer(rank, world, cfg, model, opt)
    else:
        outer = _outer(row, h, model, opt)

    def agree(t: float) -> float:
        x = torch.tensor([t], dtype=torch.float64)
        dist.all_reduce(x, op=dist.ReduceOp.MAX, group=ctl)
        return float(x)

    def evaluate(t: float) -> None:
        evals.append([round(t, 3), round(held_out_loss(w, model), 5)])
        model.train()
        dist.barrier(group=ctl)

    evals: List[List[float]] = []
    train: List[List[float]] = []
    evaluate(0.0)
    n = sum(p.numel() for p in model.parameters())
    dist.barrier()
    b0, clock, step, t, next_eval = _tx(), Clock(), 0, 0.0, budget / EVALS
    with ctx:
        while True:
            _set_lr(opt, base, t / budget)
            opt.zero_grad(set_to_none=True)
            loss = forward_backward(w, net, step, rank, pause)
            w.before_step(model.parameters())
            opt.step()  # DiLoCo's (SparseLoCo's, torchft's) hook: the outer sync every H steps
            step += 1
            train.append([clock.now(), float(loss)])
            if row == "ddp" or step % h == 0:
                t = agree(clock.now())  # the slower replica's clock: both decide the same
                if t >= budget:
                    break
                if t >= next_eval:
                    with clock.stopped():
                        evaluate(t)
                    next_eval += budget / EVALS
            else:
                t = clock.now()  # between syncs each replica's schedule follows its own clock
    tx = _tx() - b0
    evaluate(t)
    res = {"row": row, "seed": cfg["seed"], "link": cfg["link"], "seconds": budget, "end_s": round(t, 3),
           "steps": step, "syncs": step // h if row != "ddp" else step, "params": n, "H": h,
           "final_val": evals[-1][1], "evals": evals, "train": _thin(train), "tx_bytes": tx,
           "tx_bytes_per_param_per_sync": tx / n / max(1, step // h if row != "ddp" else step),
           "step_s": t / max(1, step)}
    if outer is not None:
        st = outer.stats
        res["syncs"] = st["syncs"]
        res["wire_bytes_per_param_per_sync"] = st["wire_bytes"] / max(1, st["syncs"]) / n
        choice = getattr(outer, "auto_choice", None)
        if choice is not None:
            res["auto"] = choice.as_dict()
        outer.close()
    if extra:
        extra[0].shutdown(wait=False)
    return res


def _thin(curve: List[List[float]]) -> List[List[float]]:
    """``CURVE_POINTS`` means of consecutive (time, loss) points."""
    k = max(1, math.ceil(len(curve) / CURVE_POINTS))
    return [[round(sum(p[0] for p in curve[i:i + k]) / len(curve[i:i + k]), 2),
             round(sum(p[1] for p in curve[i:i + k]) / len(curve[i:i + k]), 4)] for i in range(0, len(curve), k)]


def _skip_reason(row: str) -> Optional[str]:
    if row == "torchft":
        try:
            import torchft.local_sgd  # noqa: F401
        except Exception as e:  # noqa: BLE001 - the row is reported as skipped, with the reason
            return f"torchft does not import: {type(e).__name__}: {e}"
    return None


def _load(path: Optional[str]) -> List[Dict[str, Any]]:
    if not path or not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def run_bench(a) -> Dict[str, Any]:
    """Every (link, seed, row) run not yet in ``--wallclock-points``; then the summary and the doc."""
    from flatcomm.tools.netlink import Link

    from . import wallclock_report as rep

    links = [x for x in a.wallclock.split(",") if x]
    rows = [x for x in a.wallclock_rows.split(",") if x]
    points = _load(a.wallclock_points)
    done = {(p["link"], p["row"], p["seed"], p["seconds"], p.get("size")) for p in points}
    port = 29700
    for link in links:
        with Link(2, link) as lk:
            for seed in range(a.wallclock_seeds):
                for row in rows:  # rows interleaved per seed: the box's load drifts over the hour
                    if (link, row, seed, a.wallclock_seconds, a.wallclock_size) in done:
                        continue
                    port += 10
                    cfg = {"row": row, "seed": seed, "link": link, "seconds": a.wallclock_seconds, "H": a.wallclock_sync_every,
                           "size": a.wallclock_size, "pin": a.pin, "port": port}
                    _progress(f"wallclock: {link}, seed {seed}, {row}, {a.wallclock_seconds:g} s ...")
                    why = _skip_reason(row)
                    p: Dict[str, Any]
                    if why is None:
                        try:
                            p = lk.run(2, run_rank, cfg, timeout_s=a.wallclock_seconds * 3 + 300)[0]
                        except Exception as e:  # noqa: BLE001 - a row that cannot run is reported, not dropped
                            p = {"skipped": f"{type(e).__name__}: {str(e)[-500:]}"}
                    else:
                        p = {"skipped": why}
                    p.update({k: cfg[k] for k in ("row", "seed", "link", "seconds", "size")})
                    points.append(p)
                    if a.wallclock_points:
                        with open(a.wallclock_points, "a") as f:
                            f.write(json.dumps(p) + "\n")
    pts = [p for p in points if p["seconds"] == a.wallclock_seconds and p.get("size") == a.wallclock_size]
    summary = rep.summarize(pts)
    print("\n" + rep.markdown(summary))
    if a.wallclock_doc:
        rep.render(summary, a.wallclock_doc, a.wallclock_plot)
    return {"summary": summary, "points": pts}


def add_arguments(ap) -> None:
    """The ``--wallclock*`` options of ``bench diloco``."""
    ap.add_argument("--wallclock", default="", metavar="RATES",
                    help="the user's number: loss at a fixed wall-clock, per link (e.g. 10mbit,100mbit), "
                         "instead of the rest (flatcomm.tools.bench.wallclock)")
    ap.add_argument("--wallclock-seconds", type=float, default=150.0, help="wall-clock budget per run (150)")
    ap.add_argument("--wallclock-sync-every", type=int, default=15, help="H of the DiLoCo rows (15)")
    ap.add_argument("--wallclock-seeds", type=int, default=3, help="seeds per row and link (3)")
    ap.add_argument("--wallclock-rows", default=",".join(ROWS), help=f"rows (default {','.join(ROWS)})")
    ap.add_argument("--wallclock-size", default="100k", help="lm_diloco model size: 100k, 1m, 4m (100k)")
    ap.add_argument("--wallclock-points", default=None, metavar="PATH",
                    help="append each run as a JSON line; a rerun skips the runs already there")
    ap.add_argument("--wallclock-doc", default=None, metavar="PATH",
                    help="render the table between <!-- wallclock:begin/end --> of this markdown file")
    ap.add_argument("--wallclock-plot", default=None, metavar="PATH", help="the picture (PNG; needs matplotlib)")

"""Goodput of elastic DiLoCo over islands under injected failures (a tool).

    python -m flatcomm.bench diloco --islands 2x2 [--islands-impls flatcomm,torchft] [--islands-link 100mbit]
        [--islands-fail-every 10] [--sync-every 10] [--islands-seeds 3] [--islands-step-s 0]
        [--churn-codec int4] [--churn-heartbeat 1.0] [--islands-logs DIR] [--json PATH]

``--islands NxW``: N islands of W ranks each, every island in its own network namespace of a
:class:`~flatcomm.tools.netlink.Link` (``--islands-link``, 100 Mbit/s by default; needs root; "" for
loopback): the islands' ranks talk over the namespace's loopback (fast), the islands over the shaped
link. Inside an island the ranks train one replica of ``lm_diloco`` (the char LM of the convergence
bench, AdamW, warm-up + cosine over 300 inner steps) with DDP, each rank on its own batches; the
islands sync every H inner steps through :class:`flatcomm.elastic.ElasticDiLoCo` (each rank its
1/W share, int4 + error feedback, ordered), torchft's lighthouse in the first namespace (a
majority of the islands commits: 1 of 2, 2 of 3; join timeout 3 s). ``--islands-impls torchft``
runs torchft's own DiLoCo on the same islands (:mod:`flatcomm.tools.bench.islands_torchft`).

Per seed two runs: without failures, and with one failure every ``--islands-fail-every`` committed
syncs, alternating a rank SIGKILLed mid-interval and a whole island SIGKILLed (the last island, then
the one before, ...). The launcher here does what torchrun does: a rank that died takes its island
down (its other ranks are killed) and the island is started again at once (a warm forkserver stands
in for torchrun's restart, which costs a Python start on top: ~10 s on this box, measured by
tests/test_islands_torchrun.py). Reported per run:

* **goodput**: committed inner steps per second (an island's interval counts when its island
  contributed to a sync that committed), over the failure-free run's of the same seed;
* **failure -> next commit**: from each failure to the survivors' next committed sync;
* **heal**: per rank, the transfer's time and bytes (its part of master + momentum), and the time
  from the island's restart to its healed, committed sync;
* **held-out loss** of the final model against the failure-free run's.
"""
from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import statistics
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Dict, List, Tuple

import torch

from . import islands_torchft
from .churn import TIMEOUT_S, _events, _inner_step, _lighthouse, _Log, _place, _workload


def island_rank(cfg: Dict[str, Any], k: int, r: int, inc: int, log_path: str) -> None:
    """Rank ``r`` of island ``k`` (incarnation ``inc``): DDP inside, ElasticDiLoCo across."""
    import logging

    import torch.distributed as dist

    import flatcomm.elastic as elastic
    from .convergence_workloads import held_out_loss

    host = _place(cfg, f"r{k}")
    logging.getLogger("torchft").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    w, W = _workload(cfg), cfg["W"]
    log = _Log(log_path, f"i{k}r{r}")
    log("phase", island=k, rank=r, inc=inc, phase="start")
    timeout = timedelta(seconds=TIMEOUT_S)
    store = dist.FileStore(os.path.join(cfg["tmp"], f"{cfg['run']}-island{k}.{inc}.store"), W)
    dist.init_process_group("gloo", store=store, rank=r, world_size=W, timeout=timeout)
    torch.manual_seed(1000 + cfg["seed"])  # every island starts from the same weights
    model = torch.nn.parallel.DistributedDataParallel(w.model())
    opt, sched = w.make_optimizer(model.parameters())
    log("phase", island=k, rank=r, inc=inc, phase="model")
    manager = elastic.make_manager(f"island{k}", cfg["lighthouse"], timeout=timeout, min_replicas=_majority(cfg["N"]),
                                   quorum_timeout=timedelta(seconds=120), hostname=host, island=dist.group.WORLD)
    log("phase", island=k, rank=r, inc=inc, phase="manager")
    outer = elastic.ElasticDiLoCo(model, opt, manager=manager, sync_every=cfg["H"], codec=cfg["codec"],
                                  island=dist.group.WORLD)
    seen = 0
    while True:
        for rd in list(outer.rounds)[seen:]:
            log("round", island=k, rank=r, inc=inc, mstep=manager.current_step(), step=rd.step,
                committed=rd.committed, quorum=rd.quorum, contributors=rd.contributors, healed=rd.healed,
                healed_to=rd.healed_to,
                heal_s=rd.heal_s, heal_bytes=rd.heal_bytes, part=outer.fragment.numel, hash=outer.master_hash())
        seen = len(outer.rounds)
        if outer.step >= w.steps:
            break
        if outer.step % cfg["H"] == cfg["H"] // 2:
            log("mid", island=k, rank=r, inc=inc, mstep=manager.current_step(), step=outer.step)
        t = time.perf_counter()
        _inner_step(w, model, opt, sched, outer.step, k * W + r)
        time.sleep(max(0.0, cfg["step_s"] - (time.perf_counter() - t)))  # a larger model's compute
    log("done", island=k, rank=r, inc=inc, step=outer.step, heldout=held_out_loss(w, model.module))
    log.f.close()
    outer.shutdown()  # waits for the island: rank 0 serves its should_commit
    os._exit(0)


class _Launcher:
    """Islands of W processes; a dead rank takes its island down and the island is started again."""

    def __init__(self, cfg: Dict[str, Any], log: Path, ctx) -> None:
        self.cfg, self.log, self.ctx = cfg, log, ctx
        self.procs: Dict[Tuple[int, int], Any] = {}
        self.inc = [0] * cfg["N"]
        self.restarts: List[Tuple[int, float]] = []
        for k in range(cfg["N"]):
            self.start(k)

    def start(self, k: int) -> None:
        self.inc[k] += 1
        for r in range(self.cfg["W"]):
            target = island_rank if self.cfg["impl"] == "flatcomm" else islands_torchft.torchft_island_rank
            p = self.ctx.Process(target=target, args=(self.cfg, k, r, self.inc[k], str(self.log)), daemon=True)
            p.start()
            self.procs[(k, r)] = p

    def kill(self, k: int, ranks) -> float:
        now = time.time()
        for r in ranks:
            os.kill(self.procs[(k, r)].pid, signal.SIGKILL)
        return now

    def watch(self, finished: bool) -> None:
        for k in range(self.cfg["N"]):
            ps = [self.procs[(k, r)] for r in range(self.cfg["W"])]
            dead = [p.exitcode for p in ps if p.exitcode not in (None, 0)]
            if not dead:
                continue
            if -signal.SIGKILL not in dead:
                raise RuntimeError(f"islands bench: island {k} exited with {dead}, none killed; log {self.log}")
            for p in ps:
                if p.exitcode is None:
                    p.kill()
                p.join(30)
            if not finished:
                self.restarts.append((k, time.time()))
                self.start(k)

    def stop_unhealed(self, ev: List[Dict[str, Any]]) -> None:
        """Kill the islands whose current incarnation has not committed a sync with another island:
        the others are done, so it would train the run again from the start, alone."""
        for k in range(self.cfg["N"]):
            if self.inc[k] > 1 and not any(e["event"] == "round" and e.get("island") == k and e["inc"] == self.inc[k]
                                           and e["committed"] and e["quorum"] > 1 for e in ev):
                for r in range(self.cfg["W"]):
                    if self.procs[(k, r)].exitcode is None:
                        self.procs[(k, r)].kill()
                        self.procs[(k, r)].join(30)

    def alive(self) -> bool:
        return any(p.exitcode is None for p in self.procs.values())

    def close(self) -> None:
        for p in self.procs.values():
            if p.exitcode is None:
                p.kill()
                p.join(30)


JOIN_TIMEOUT_MS = 3000


def _majority(n: int) -> int:
    return 1 if n <= 2 else n // 2 + 1


def run_once(cfg: Dict[str, Any], fail_every: int, tmp: Path, timeout_s: float = 1800) -> Dict[str, Any]:
    """One run; ``fail_every``: a failure every this many committed syncs (0: none)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torchft", "torchft.local_sgd", "flatcomm.elastic",
                                "flatcomm.tools.bench.convergence_workloads"])
    log = tmp / f"islands-{cfg['impl']}-{cfg['seed']}-{fail_every}.jsonl"
    # a majority of the islands commits (one island cut off never does), but of 2 one goes on alone;
    # the join timeout above the islands' drift on this box (a straggler left out would heal: H lost)
    with _lighthouse({**cfg, "min_replicas": _majority(cfg["N"]), "join_timeout_ms": JOIN_TIMEOUT_MS}) as address:
        run_cfg = {**cfg, "lighthouse": address, "tmp": str(tmp), "run": log.stem}
        launcher = _Launcher(run_cfg, log, ctx)
        fails: List[Dict[str, Any]] = []
        t0, last_step = time.time(), _workload(cfg).steps - 4 * cfg["H"]
        try:
            while launcher.alive():
                if time.time() - t0 > timeout_s:
                    raise TimeoutError(f"islands bench: seed {cfg['seed']} ran past {timeout_s} s; log {log}")
                ev = _events(log)
                top = max([e["mstep"] for e in ev if e["event"] == "round" and e["committed"]] or [0])
                n = len(fails)
                victim = cfg["N"] - 1 - (n // 2) % cfg["N"]
                if fail_every and top >= (n + 1) * fail_every and all(e["t"] < t0 or True for e in ev):
                    since = fails[-1]["t"] if fails else 0.0
                    mid = [e for e in ev if e["event"] == "mid" and e.get("island") == victim and e["t"] > since
                           and e["mstep"] >= top and e["step"] < last_step and e.get("inc") == launcher.inc[victim]]
                    if mid:
                        ranks = [cfg["W"] - 1] if n % 2 == 0 else list(range(cfg["W"]))
                        fails.append({"t": launcher.kill(victim, ranks), "island": victim,
                                      "kind": "rank" if len(ranks) == 1 else "island"})
                finished = any(e["event"] == "done" for e in ev)
                launcher.watch(finished)
                if finished:  # an incarnation that came up after the others finished has no donor
                    launcher.stop_unhealed(ev)
                time.sleep(0.05)
        finally:
            launcher.close()
    return summarize(_events(log), fails, launcher.restarts, cfg)


def summarize(ev: List[Dict[str, Any]], fails: List[Dict[str, Any]], restarts, cfg: Dict[str, Any]) -> dict:
    rounds = [e for e in ev if e["event"] == "round"]
    r0 = [e for e in rounds if e["rank"] == 0]
    done = [e for e in ev if e["event"] == "done"]
    full = [e["t"] for e in r0 if e["committed"] and e["quorum"] == cfg["N"]]
    t_start, t_end = min(full), max(e["t"] for e in done)
    # an island's interval counts when it contributed to a sync that committed
    good = [e for e in r0 if e["committed"] and not e["healed"] and e["contributors"] > 0 and e["step"] > 0
            and e["t"] >= t_start]
    by_step: Dict[Tuple[int, int], set] = {}
    for e in rounds:
        if e["committed"]:
            by_step.setdefault((e["mstep"], e["rank"]), set()).add(e["hash"])
    after = []
    for f in fails:
        nxt = [min([e["t"] for e in r0 if e["island"] == k and e["committed"] and e["t"] > f["t"]] or [float("nan")])
               for k in range(cfg["N"]) if k != f["island"]]
        after.append(max(nxt) - f["t"])
    heals = [e for e in rounds if e["healed"] and e["committed"] and e["inc"] > 1]
    to_heal = []
    for k, when in restarts:
        got = [e["t"] for e in heals if e["island"] == k and e["t"] > when]
        if got:
            to_heal.append(min(got) - when)
    return {"committed_steps_per_s": len(good) * cfg["H"] / (t_end - t_start), "fails": fails,
            "fail_to_commit_s": after, "heal_s": [e["heal_s"] for e in heals],
            "heal_bytes": [e["heal_bytes"] for e in heals], "part_bytes": [8 * e["part"] for e in heals],
            "restart_to_heal_s": to_heal, "parts_equal": all(len(h) == 1 for h in by_step.values()),
            "heldout": [e for e in done if e["rank"] == 0][0]["heldout"],
            "wall_s": t_end - t_start}


def _span(xs: List[float], fmt: str = "{:.2f}") -> str:
    xs = [x for x in xs if x == x]
    return f"{fmt.format(min(xs))}-{fmt.format(max(xs))}" if xs else "-"


def run_bench(a) -> Dict[str, Any]:
    """``bench diloco --islands NxW``: every implementation of ``--islands-impls``, ``--islands-seeds``
    seeds, without and with failures; prints the table and returns every run."""
    n, w = (int(x) for x in a.islands.lower().split("x"))
    impls = [i for i in a.islands_impls.split(",") if i]
    cfg: Dict[str, Any] = {"N": n, "W": w, "H": a.sync_every, "codec": a.churn_codec, "heartbeat": a.churn_heartbeat,
                           "scale": a.islands_scale, "step_s": a.islands_step_s}
    runs: Dict[str, List[Dict[str, Any]]] = {f"{i}/{c}": [] for i in impls for c in ("none", "failures")}
    with contextlib.ExitStack() as stack:
        tmp = a.islands_logs or stack.enter_context(tempfile.TemporaryDirectory())
        os.makedirs(tmp, exist_ok=True)
        if a.islands_link:
            from flatcomm.tools.netlink import Link

            link = stack.enter_context(Link(n, a.islands_link))
            cfg.update(netns=link.namespaces, addrs=link.addresses)
        for seed in range(a.islands_seeds):
            for impl in (impls if seed % 2 == 0 else impls[::-1]):
                for name, every in (("none", 0), ("failures", a.islands_fail_every)):
                    r = run_once({**cfg, "seed": seed, "impl": impl}, every, Path(tmp))
                    runs[f"{impl}/{name}"].append(r)
                    print(f"[bench] islands {a.islands} {impl} seed {seed} {name}: {r['committed_steps_per_s']:.2f} "
                          f"committed steps/s, held-out {r['heldout']:.4f}, failures {len(r['fails'])}, "
                          f"parts equal {r['parts_equal']}", flush=True)
    where = f"{a.islands_link} between islands (namespaces)" if a.islands_link else "loopback"
    print(f"\nIslands {a.islands} on {where}: lm_diloco (300 inner steps, each >= {a.islands_step_s} s), DDP inside, "
          f"H={a.sync_every}, one failure every {a.islands_fail_every} syncs (a rank, then a whole island, ...), "
          f"heartbeat timeout {a.churn_heartbeat} s, {a.islands_seeds} seeds; flatcomm {a.churn_codec}+EF ordered "
          f"(each rank its 1/W share), torchft fp32 (every rank the whole model)")
    print("| run | goodput | failure -> next commit (s) | heal transfer per rank (s) | heal bytes per rank "
          "| restart -> healed commit (s) | held-out vs no failures | parts equal |")
    print("|---|---|---|---|---|---|---|---|")
    out: Dict[str, Any] = {}
    for impl in impls:
        base, churned = runs[f"{impl}/none"], runs[f"{impl}/failures"]
        good = [c["committed_steps_per_s"] / b["committed_steps_per_s"] for c, b in zip(churned, base)]
        loss = [c["heldout"] / b["heldout"] - 1 for c, b in zip(churned, base)]
        out[impl] = {"goodput": good, "heldout_rel": loss}
        print(f"| {impl} | {statistics.fmean(good):.3f} [{min(good):.3f}, {max(good):.3f}] "
              f"| {_span([x for r in churned for x in r['fail_to_commit_s']])} "
              f"| {_span([x for r in churned for x in r['heal_s']], '{:.3f}')} "
              f"| {_span([x for r in churned for x in r['heal_bytes']], '{:.0f}')} B "
              f"| {_span([x for r in churned for x in r['restart_to_heal_s']])} "
              f"| {100 * statistics.fmean(loss):+.2f}% [{100 * min(loss):+.2f}, {100 * max(loss):+.2f}] "
              f"| {all(r['parts_equal'] for r in base + churned)} |")
    return {"config": {**{k: v for k, v in cfg.items() if k not in ("netns", "addrs")},
                       "link": a.islands_link or "loopback", "fail_every": a.islands_fail_every,
                       "seeds": a.islands_seeds, "impls": impls}, "runs": runs, "summary": out}


def add_arguments(ap) -> None:
    """``bench diloco``'s islands options."""
    ap.add_argument("--islands", default="", metavar="NxW",
                    help="run the islands goodput bench instead: N islands of W ranks (DDP inside), e.g. 2x2")
    ap.add_argument("--islands-link", default="100mbit", metavar="RATE",
                    help="the link between islands (namespaces, needs root; '' for loopback; default 100mbit)")
    ap.add_argument("--islands-fail-every", type=int, default=10, metavar="SYNCS",
                    help="one failure every this many committed syncs (default 10)")
    ap.add_argument("--islands-seeds", type=int, default=3, help="seeds of the islands bench (default 3)")
    ap.add_argument("--islands-impls", default="flatcomm", help="flatcomm, torchft or both (default flatcomm)")
    ap.add_argument("--islands-step-s", type=float, default=0.0, metavar="S",
                    help="pad every inner step to at least S seconds (a larger model's compute; default 0)")
    ap.add_argument("--islands-logs", default="", metavar="DIR", help="keep the runs' event logs in DIR")
    ap.add_argument("--islands-scale", type=float, default=1.0, help="the workload's length (its 300 inner steps times this; default 1.0)")

"""DiLoCo under churn on a torchft lighthouse: flatcomm.elastic beside torchft's own DiLoCo (a tool).

    python -m flatcomm.bench diloco --churn 5 [--churn-seeds 3] [--churn-impls flatcomm,torchft]
        [--sync-every 10] [--churn-heartbeat 1.0] [--churn-codec int4] [--churn-link 100mbit] [--json PATH]

One lighthouse (torchft's, in this process, loopback) and 3 replica processes of one CPU rank each,
started from a warm forkserver. With ``--churn-link RATE`` every replica moves into a network
namespace of a :class:`~flatcomm.tools.netlink.Link` at RATE (needs root), the lighthouse
(``torchft_lighthouse``) runs in the first, and the bytes each node sent come from its fc0 counter.
The workload is ``lm_diloco`` of the convergence bench (the char LM, AdamW (0.9, 0.95), weight
decay, clipping, gradient accumulation, warm-up + cosine over 300 inner steps), every replica on
its own batches. Per implementation and seed, two runs: without
churn, and with the last replica SIGKILLed mid-interval every ``--churn`` syncs and restarted at
once with the same id. Reported per run: the survivors' inner steps per second, the time from each
death to the survivors' next committed sync, the restarted process's time to its healed, committed
sync, whether every committed sync left the replicas' masters bitwise equal, and the final model's
held-out loss (r0's; the same on every replica when they are equal).

* ``flatcomm``: :class:`flatcomm.elastic.ElasticDiLoCo` (``--churn-codec``, ordered, error
  feedback; outer SGD lr 0.7, Nesterov 0.9). A restarted replica heals when it joins (before its
  first inner step) and gets the schedule position (the step) with the master.
* ``torchft``: torchft 0.2's ``DiLoCo`` (fp32 pseudo-gradients: its quantized path needs triton),
  the same outer optimizer, a ``Manager`` per replica (``use_async_quorum=False``, ``init_sync=False``,
  model, inner optimizer and step in its state dict so that a heal is complete). A restarted replica
  trains from its fresh weights until its first sync, where it heals.

Both on the same lighthouse settings (``min_replicas`` 2, heartbeat timeout ``--churn-heartbeat``,
join timeout 500 ms) and collective timeout (10 s). The machine is shared: compare the two within
one invocation (the runs alternate implementation by seed).
"""
from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import multiprocessing as mp
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Dict, Iterator, List

import torch

REPLICAS = 3
TIMEOUT_S = 10.0  # collectives, should_commit, heal transfers
JOIN_TIMEOUT_MS = 500


def _workload(cfg: Dict[str, Any]):
    from .convergence_workloads import LMDiLoCo

    return LMDiLoCo(cfg["seed"], cfg.get("scale", 1.0))


def _set_lr(opt, sched, step: int) -> None:
    """The warm-up + cosine rate at ``step`` (a healed replica resumes the schedule where the donor is)."""
    for g, base in zip(opt.param_groups, sched.base_lrs):
        g["lr"] = base * sched.lr_lambdas[0](step)


def _inner_step(w, model, opt, sched, step: int, rank: int) -> None:
    _set_lr(opt, sched, step)
    opt.zero_grad(set_to_none=True)
    for x, y in w.batches(step, rank):
        (w.loss(model(x), y) / w.ACCUM).backward()
    w.before_step(model.parameters())
    opt.step()  # both DiLoCos sync from the inner optimizer's post-step hook


def _weights_hash(model) -> int:
    h = hashlib.blake2b(digest_size=8)
    for p in model.parameters():
        h.update(p.detach().contiguous().numpy().tobytes())
    return int.from_bytes(h.digest(), "little")


def _place(cfg: Dict[str, Any], rid: str) -> str:
    """With ``--churn-link``: move this process (just forked, one thread) into its replica's network
    namespace, so that its sockets and gloo's use that node's shaped ``fc0``; its address there
    (loopback's name without a link)."""
    if not cfg.get("netns"):
        return "localhost"
    import ctypes

    i = int(rid[1:])
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/run/netns/{cfg['netns'][i]}", os.O_RDONLY)
    try:
        if libc.setns(fd, 0x40000000) != 0:  # CLONE_NEWNET
            raise OSError(ctypes.get_errno(), f"setns into {cfg['netns'][i]}")
    finally:
        os.close(fd)
    os.environ["GLOO_SOCKET_IFNAME"] = "fc0"
    return cfg["addrs"][i]


class _Log:
    def __init__(self, path: str, rid: str):
        self.f, self.rid, self.started = open(path, "a", buffering=1), rid, time.time()

    def __call__(self, event: str, **kw: Any) -> None:
        self.f.write(json.dumps({"event": event, "id": self.rid, "t": time.time(), "started": self.started,
                                 **kw}) + "\n")


def _finish(log: _Log, w, model, step: int) -> None:
    from .convergence_workloads import held_out_loss

    log("done", step=step, heldout=held_out_loss(w, model), hash=_weights_hash(model))
    log.f.close()


def flatcomm_replica(cfg: Dict[str, Any], rid: str, lighthouse: str, log_path: str) -> None:
    import flatcomm.elastic as elastic

    host = _place(cfg, rid)
    torch.set_num_threads(1)
    log, w = _Log(log_path, rid), _workload(cfg)
    torch.manual_seed(1000 + cfg["seed"])  # every replica starts from the same weights
    model = w.model()
    opt, sched = w.make_optimizer(model.parameters())
    manager = elastic.make_manager(rid, lighthouse, timeout=timedelta(seconds=TIMEOUT_S),
                                   quorum_timeout=timedelta(seconds=120), hostname=host)
    outer = elastic.ElasticDiLoCo(model, opt, manager=manager, sync_every=cfg["H"], codec=cfg["codec"])
    rank, seen = int(rid[1:]), 0
    while True:
        for r in list(outer.rounds)[seen:]:
            log("round", mstep=manager.current_step(), step=outer.step, committed=r.committed, quorum=r.quorum,
                contributors=r.contributors, healed=r.healed, hash=outer.master_hash())
        seen = len(outer.rounds)
        if outer.step >= w.steps:
            break
        if outer.step % cfg["H"] == cfg["H"] // 2:
            log("mid", mstep=manager.current_step(), step=outer.step)
        _inner_step(w, model, opt, sched, outer.step, rank)
    _finish(log, w, model, outer.step)
    outer.shutdown()
    os._exit(0)


def _torchft_replica(model, opt):
    """torchft's DiLoCo side of a replica: its outer optimizer, the step state, and the state_dict
    callbacks its Manager heals with (a heal marks the state healed)."""
    outer_opt = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    state = {"step": 0, "healed": False}

    def load(sd):
        model.load_state_dict(sd["model"])
        opt.load_state_dict(sd["opt"])
        state.update(step=sd["step"], healed=True)

    def save():
        return {"model": model.state_dict(), "opt": opt.state_dict(), "step": state["step"]}

    return outer_opt, state, load, save


def torchft_replica(cfg: Dict[str, Any], rid: str, lighthouse: str, log_path: str) -> None:
    import logging

    from torchft import Manager, ProcessGroupGloo
    from torchft.local_sgd import DiLoCo as TorchftDiLoCo

    from flatcomm.elastic.replica import HostTransport

    host = _place(cfg, rid)
    logging.getLogger("torchft").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    log, w = _Log(log_path, rid), _workload(cfg)
    torch.manual_seed(1000 + cfg["seed"])
    model = w.model()
    opt, sched = w.make_optimizer(model.parameters())
    outer_opt, state, load, save = _torchft_replica(model, opt)

    store = torch.distributed.TCPStore(host, 0, is_master=True, wait_for_workers=False)
    timeout = timedelta(seconds=TIMEOUT_S)
    manager = Manager(pg=ProcessGroupGloo(timeout=timeout), min_replica_size=2,
                      use_async_quorum=False, init_sync=False, load_state_dict=load, state_dict=save,
                      replica_id=rid, store_addr=host, store_port=store.port, rank=0, world_size=1,
                      lighthouse_addr=lighthouse, hostname=host, timeout=timeout,
                      quorum_timeout=timedelta(seconds=120),
                      checkpoint_transport=HostTransport(host, timeout))
    rank, h = int(rid[1:]), cfg["H"]
    with TorchftDiLoCo(manager, [model], opt, outer_opt, sync_every=h, backup_device=torch.device("cpu")):
        while state["step"] < w.steps:
            if state["step"] % h == h // 2:
                log("mid", mstep=manager.current_step(), step=state["step"])
            before = manager.current_step()
            state["healed"] = False
            _inner_step(w, model, opt, sched, state["step"], rank)
            state["step"] += 1  # a heal in this step's sync loaded the donor's count (already past it)
            if state["step"] % h == 0:
                committed = manager.current_step() > before
                log("round", mstep=manager.current_step(), step=state["step"], committed=committed,
                    quorum=manager.num_participants(), contributors=manager.num_participants(),
                    healed=state["healed"], hash=_weights_hash(model))
    _finish(log, w, model, state["step"])
    manager.shutdown(wait=False)
    os._exit(0)


def _events(log: Path) -> List[Dict[str, Any]]:
    if not log.exists():
        return []
    out = []
    for line in log.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:  # a line cut by a SIGKILL mid-write
            pass
    return out


_ports = itertools.count(29510)  # a fresh lighthouse port per run on a link (no wait for TIME_WAIT)


@contextlib.contextmanager
def _lighthouse(cfg: Dict[str, Any]) -> Iterator[str]:
    """torchft's lighthouse: in this process on loopback, or torchft_lighthouse in the first
    replica's namespace on a link; yields its address."""
    flags = {"min_replicas": cfg.get("min_replicas", 2), "join_timeout_ms": cfg.get("join_timeout_ms", JOIN_TIMEOUT_MS),
             "heartbeat_timeout_ms": int(cfg["heartbeat"] * 1000)}
    if not cfg.get("netns"):
        from torchft._torchft import LighthouseServer

        lh = LighthouseServer(bind="127.0.0.1:0", **flags)
        try:
            yield lh.address()
        finally:
            lh.shutdown()
        return
    exe = shutil.which("torchft_lighthouse") or str(Path(sys.executable).parent / "torchft_lighthouse")
    bind = f"{cfg['addrs'][0]}:{next(_ports)}"
    p = subprocess.Popen(["ip", "netns", "exec", cfg["netns"][0], exe, "--bind", bind,
                          *[f"--{k}={v}" for k, v in flags.items()]],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        yield f"http://{bind}"
    finally:
        p.kill()
        p.wait(10)


def run_once(impl: str, seed: int, churn: int, cfg: Dict[str, Any], tmp: Path, link=None,
             timeout_s: float = 1800) -> dict:
    """One run of ``impl`` (``flatcomm`` or ``torchft``); ``churn``: kill + restart the last replica
    every this many committed syncs (0: never). ``link``: the :class:`~flatcomm.tools.netlink.Link`
    whose namespaces ``cfg`` names (its fc0 counters are read)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torchft", "flatcomm.elastic", "flatcomm.tools.bench.convergence_workloads"])
    with _lighthouse(cfg) as address:
        tx = [link.tx_bytes(i) for i in range(REPLICAS)] if link else []
        res = _replicas(impl, seed, churn, cfg, tmp, address, ctx, timeout_s)
        if link:
            res["tx_bytes"] = [link.tx_bytes(i) - b for i, b in enumerate(tx)]
            res["bytes_per_sync_r0"] = res["tx_bytes"][0] / max(1, res["syncs"])
    return res


def _replicas(impl: str, seed: int, churn: int, cfg: Dict[str, Any], tmp: Path, lighthouse: str, ctx,
              timeout_s: float) -> dict:
    log = tmp / f"{impl}-{seed}-{churn}.jsonl"
    target = flatcomm_replica if impl == "flatcomm" else torchft_replica
    run_cfg = {**cfg, "seed": seed}
    ids = [f"r{i}" for i in range(REPLICAS)]
    victim, last_step = ids[-1], _workload(run_cfg).steps - 2 * cfg["H"]

    def start(rid):
        p = ctx.Process(target=target, args=(run_cfg, rid, lighthouse, str(log)), daemon=True)
        p.start()
        return p
    procs, left = {rid: start(rid) for rid in ids}, 0.0
    kills: List[float] = []
    t0 = time.time()
    try:
        while any(p.exitcode is None for p in procs.values()):
            if time.time() - t0 > timeout_s:
                raise TimeoutError(f"churn bench: {impl} seed {seed} churn {churn} ran past {timeout_s} s")
            if all(procs[r].exitcode is not None for r in ids[:-1]):
                # the others finished: a restarted victim still waiting for a sync (torchft's heals at
                # its first sync, H steps after its restart) waits for nobody
                left = left or time.time()
                if time.time() - left > 15:
                    procs[victim].kill()
                    procs[victim].join(30)
                    break
            ev = _events(log)
            top = max([e["mstep"] for e in ev if e["event"] == "round" and e["committed"]] or [0])
            due = churn and top >= (len(kills) + 1) * churn and procs[victim].exitcode is None
            restarted = kills[-1] if kills else 0.0  # a mid-interval of this incarnation, after its heal
            if due and any(e["event"] == "mid" and e["id"] == victim and e["mstep"] >= top
                           and e["step"] < last_step and e["t"] > restarted for e in ev):
                kills.append(time.time())
                os.kill(procs[victim].pid, signal.SIGKILL)
                procs[victim].join(30)
                procs[victim] = start(victim)
            time.sleep(0.05)
        bad = {rid: p.exitcode for rid, p in procs.items() if p.exitcode != 0 and not (left and rid == victim)}
        if bad:
            raise RuntimeError(f"churn bench: {impl} replicas exited with {bad}; log {log}")
    finally:
        for p in procs.values():
            if p.exitcode is None:
                p.kill()
    return summarize(_events(log), kills, ids[:-1] if churn else ids, victim)


def summarize(ev: List[Dict[str, Any]], kills: List[float], survivors: List[str], victim: str) -> dict:
    done = {e["id"]: e for e in ev if e["event"] == "done"}
    rounds = [e for e in ev if e["event"] == "round"]
    committed = [e for e in rounds if e["committed"]]
    by_step: Dict[int, set] = {}
    for e in committed:
        by_step.setdefault(e["mstep"], set()).add(e["hash"])
    full = [e["t"] for e in committed if e["quorum"] >= 2]
    t_start, t_end = min(full), max(done[s]["t"] for s in survivors)
    steps = [done[s]["step"] - min(e["step"] for e in rounds if e["id"] == s and e["t"] >= t_start)
             for s in survivors]
    after = [min([e["t"] for e in committed if e["id"] == survivors[0] and e["t"] > k] or [float("nan")]) - k
             for k in kills]
    heals = [e for e in committed if e["healed"] and e["id"] == victim and kills and e["started"] > kills[0]]
    return {"steps_per_s": statistics.fmean(steps) / (t_end - t_start), "kills": len(kills),
            "death_to_commit_s": after, "start_to_heal_s": [e["t"] - e["started"] for e in heals],
            "masters_equal": all(len(h) == 1 for h in by_step.values()),
            "final_equal": len({d["hash"] for d in done.values()}) == 1,
            "syncs": len(by_step), "heldout": done["r0"]["heldout"]}


def run_bench(a) -> Dict[str, Any]:
    """``bench diloco --churn N``: every implementation of ``--churn-impls``, ``--churn-seeds`` seeds,
    without and with churn; prints the table and returns every run."""
    impls = [i for i in a.churn_impls.split(",") if i]
    cfg: Dict[str, Any] = {"H": a.sync_every, "codec": a.churn_codec, "heartbeat": a.churn_heartbeat}
    runs: Dict[str, List[Dict[str, Any]]] = {f"{i}/{c}": [] for i in impls for c in ("none", "churn")}
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        link = None
        if a.churn_link:
            from flatcomm.tools.netlink import Link

            link = stack.enter_context(Link(REPLICAS, a.churn_link))
            cfg.update(netns=link.namespaces, addrs=link.addresses)
        for seed in range(a.churn_seeds):
            for impl in (impls if seed % 2 == 0 else impls[::-1]):
                for churn in (0, a.churn):
                    r = run_once(impl, seed, churn, cfg, Path(tmp), link)
                    runs[f"{impl}/{'churn' if churn else 'none'}"].append(r)
                    print(f"[bench] churn: {impl} seed {seed} churn {churn}: {r['steps_per_s']:.2f} steps/s, "
                          f"held-out {r['heldout']:.4f}, kills {r['kills']}, equal {r['masters_equal']}", flush=True)
    where = f"a {a.churn_link} link (namespaces)" if a.churn_link else "loopback"
    print(f"\nDiLoCo under churn on {where}: {REPLICAS} replicas, lm_diloco (300 inner steps), H={a.sync_every}, "
          f"one kill + restart every {a.churn} syncs, heartbeat timeout {a.churn_heartbeat} s, "
          f"{a.churn_seeds} seeds; flatcomm {a.churn_codec}+EF ordered, torchft fp32")
    print("| run | survivors' steps/s | vs no churn | held-out loss | vs no churn | death -> next commit (s) "
          "| restart -> healed commit (s) | masters equal | r0's bytes off its node per sync |")
    print("|---|---|---|---|---|---|---|---|---|")
    for impl in impls:
        base, churned = runs[f"{impl}/none"], runs[f"{impl}/churn"]
        for name, rs in (("none", base), ("churn", churned)):
            sps = [r["steps_per_s"] for r in rs]
            loss = [r["heldout"] for r in rs]
            rel_s = [r["steps_per_s"] / b["steps_per_s"] for r, b in zip(rs, base)]
            rel_l = [r["heldout"] / b["heldout"] - 1 for r, b in zip(rs, base)]
            deaths = [x for r in rs for x in r["death_to_commit_s"]]
            heals = [x for r in rs for x in r["start_to_heal_s"]]
            span = (lambda xs: f"{min(xs):.2f}-{max(xs):.2f}" if xs else "-")
            print(f"| {impl} {name} | {statistics.fmean(sps):.2f} [{min(sps):.2f}, {max(sps):.2f}] "
                  f"| {statistics.fmean(rel_s):.2f}x | {statistics.fmean(loss):.4f} "
                  f"| {100 * statistics.fmean(rel_l):+.2f}% [{100 * min(rel_l):+.2f}, {100 * max(rel_l):+.2f}] "
                  f"| {span(deaths)} | {span(heals)} | {all(r['masters_equal'] and r['final_equal'] for r in rs)} "
                  f"| {statistics.fmean(r.get('bytes_per_sync_r0', 0.0) for r in rs) / 1e6:.2f} MB |")
    return {"config": {**cfg, "link": a.churn_link or "loopback", "churn_every": a.churn, "seeds": a.churn_seeds,
                       "replicas": REPLICAS}, "runs": runs}


def add_arguments(ap) -> None:
    """``bench diloco``'s churn options."""
    ap.add_argument("--churn", type=int, default=0, metavar="N",
                    help="run the churn bench instead: kill + restart one of 3 replicas every N syncs (loopback, "
                         "torchft's lighthouse; needs torchft)")
    ap.add_argument("--churn-seeds", type=int, default=3, help="seeds of the churn bench (default 3)")
    ap.add_argument("--churn-impls", default="flatcomm,torchft", help="flatcomm, torchft or both (default)")
    ap.add_argument("--churn-codec", default="int4", help="flatcomm's codec in the churn bench (default int4)")
    ap.add_argument("--churn-link", default="", metavar="RATE",
                    help="the churn bench's replicas each in a network namespace joined at RATE, e.g. 100mbit "
                         "(needs root; default: loopback)")
    ap.add_argument("--churn-heartbeat", type=float, default=1.0,
                    help="the lighthouse's heartbeat timeout in the churn bench, seconds (default 1.0)")

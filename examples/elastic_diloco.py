"""Elastic DiLoCo under churn: replicas SIGKILLed mid-interval and restarted, survivors training on.

    python examples/elastic_diloco.py --replicas 3 --syncs 30 --churn-every 5 --sync-every 20

Starts a torchft lighthouse on a free loopback port and ``--replicas`` replica processes (one CPU
process each, a small MLP, int4 with error feedback by default). Each replica runs
``flatcomm.elastic.ElasticDiLoCo`` on a ``torchft.Manager`` made by ``flatcomm.elastic.make_manager``.
Two runs: without churn, then with replica r{last} killed (SIGKILL, mid-interval) every
``--churn-every`` syncs and restarted with the same id from a warm process (a forkserver that has
imported torch). Prints, per run: the survivors' inner steps per second, the time from each death
to the survivors' next committed sync, the restarted replica's time from start to its heal and its
heal size, whether every replica's fp32 master was bitwise equal after every committed sync, and
the final model's loss on held-out data (the same on every replica).
"""
from __future__ import annotations

import argparse
import json
import logging
import multiprocessing as mp
import os
import signal
import tempfile
import time
import zlib
from datetime import timedelta
from pathlib import Path


def replica(a, rid: str, lighthouse: str, log: str, stop: str) -> None:
    """One replica: train until torchft's step reaches the number in ``stop``."""
    import torch
    import flatcomm.elastic as elastic
    logging.getLogger("torchft").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    out = open(log, "a", buffering=1)
    torch.manual_seed(0)  # every replica starts from the same weights
    net = torch.nn.Sequential(torch.nn.Linear(64, a.hidden), torch.nn.GELU(), torch.nn.Linear(a.hidden, a.hidden),
                              torch.nn.GELU(), torch.nn.Linear(a.hidden, 64))
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    started = time.time()
    manager = elastic.make_manager(rid, lighthouse, timeout=timedelta(seconds=a.timeout),
                                   quorum_timeout=timedelta(seconds=120), hostname="localhost")
    outer = elastic.ElasticDiLoCo(net, opt, manager=manager, sync_every=a.sync_every, codec=a.codec, mode=a.mode)
    numel, seen, data = outer.fragment.numel, 0, torch.Generator().manual_seed(zlib.crc32(rid.encode()))
    while True:
        for r in list(outer.rounds)[seen:]:
            out.write(json.dumps({"id": rid, "t": time.time(), "started": started, "mstep": manager.current_step(),
                                  "step": outer.step, "committed": r.committed, "quorum": r.quorum,
                                  "contributors": r.contributors, "healed": r.healed, "hash": outer.master_hash(),
                                  "heal_bytes": 8 * numel if r.healed else 0, "mid": False}) + "\n")
        seen = len(outer.rounds)
        if outer.step % a.sync_every == 0 and manager.current_step() >= int(Path(stop).read_text() or 1 << 30):
            break
        if outer.step % a.sync_every == a.sync_every // 2:
            out.write(json.dumps({"id": rid, "t": time.time(), "mid": True, "mstep": manager.current_step()}) + "\n")
        x = torch.randn(a.batch, 64, generator=data)
        opt.zero_grad()
        (net(x) - x.roll(1, dims=1)).pow(2).mean().backward()
        opt.step()
    with torch.no_grad():  # the weights are the master after the last committed sync
        x = torch.randn(1024, 64, generator=torch.Generator().manual_seed(12345))
        loss = float((net(x) - x.roll(1, dims=1)).pow(2).mean())
    out.write(json.dumps({"id": rid, "t": time.time(), "mid": False, "done": True, "heldout": loss}) + "\n")
    out.close()
    outer.shutdown()  # waits for the island: rank 0 serves its should_commit
    os._exit(0)


def _events(log: Path) -> list:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def run(a, churn: int, tmp: Path) -> dict:
    """One run; ``churn``: kill + restart the last replica every this many syncs (0: never)."""
    from torchft._torchft import LighthouseServer
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "flatcomm.elastic"])
    lh = LighthouseServer(bind="127.0.0.1:0", min_replicas=2, join_timeout_ms=500,
                          heartbeat_timeout_ms=int(a.heartbeat * 1000))
    log, stop = tmp / f"log{churn}.jsonl", tmp / f"stop{churn}"
    stop.write_text("")
    ids = [f"r{i}" for i in range(a.replicas)]

    def start(rid):
        p = ctx.Process(target=replica, args=(a, rid, lh.address(), str(log), str(stop)), daemon=True)
        p.start()
        return p
    procs, kills, victim = {rid: start(rid) for rid in ids}, [], ids[-1]
    try:
        while True:
            ev = _events(log)
            top = max([e["mstep"] for e in ev if not e["mid"] and e["committed"]] or [0])
            if top >= a.syncs:
                break
            due = churn and top >= (len(kills) + 1) * churn and procs[victim].exitcode is None
            if due and any(e["mid"] and e["id"] == victim and e["mstep"] >= top for e in ev):
                kills.append(time.time())
                os.kill(procs[victim].pid, signal.SIGKILL)
                procs[victim].join(30)
                time.sleep(a.down)
                procs[victim] = start(victim)
            time.sleep(0.05)
        stop.write_text(str(a.syncs + 2))
        for p in procs.values():
            p.join(60)
    finally:
        for p in procs.values():
            if p.exitcode is None:
                p.kill()
        lh.shutdown()
    return summarize(_events(log), kills, ids[:-1] if churn else ids, victim)


def summarize(ev: list, kills: list, survivors: list, victim: str) -> dict:
    heldout = [e["heldout"] for e in ev if e.get("done")]
    ev = [e for e in ev if not e.get("done")]
    rounds = [e for e in ev if not e["mid"]]
    committed = [e for e in rounds if e["committed"]]
    by_step: dict = {}
    for e in committed:
        by_step.setdefault(e["mstep"], set()).add(e["hash"])
    full = [e["t"] for e in committed if e["quorum"] >= 2 and e["contributors"] >= 2]
    t0, t1 = min(full), max(e["t"] for e in committed)
    steps = [max(e["step"] for e in rounds if e["id"] == s) - min(e["step"] for e in rounds if e["id"] == s
                                                                   and e["t"] >= t0) for s in survivors]
    after = [min([e["t"] for e in committed if e["id"] == survivors[0] and e["t"] > k] or [float("nan")]) - k
             for k in kills]
    heals = [e for e in committed if e["healed"] and e["id"] == victim and e["started"] > kills[0]] if kills else []
    return {"steps_per_s": sum(steps) / len(steps) / (t1 - t0), "death_to_commit_s": after,
            "start_to_heal_s": [e["t"] - e["started"] for e in heals],
            "heal_bytes": heals[0]["heal_bytes"] if heals else 0,
            "all_equal": all(len(h) == 1 for h in by_step.values()) and len(set(heldout)) == 1,
            "syncs": len(by_step), "heldout": sum(heldout) / max(1, len(heldout))}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--replicas", type=int, default=3)
    ap.add_argument("--syncs", type=int, default=30, help="committed syncs per run")
    ap.add_argument("--sync-every", type=int, default=20, help="inner steps per sync (H)")
    ap.add_argument("--churn-every", type=int, default=5, help="kill + restart one replica every N syncs")
    ap.add_argument("--codec", default="int4")
    ap.add_argument("--mode", default="ordered", choices=["ordered", "exact"])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--heartbeat", type=float, default=1.0, help="the lighthouse's heartbeat timeout (s)")
    ap.add_argument("--timeout", type=float, default=10.0, help="collective / commit timeout (s)")
    ap.add_argument("--down", type=float, default=0.0, help="seconds a killed replica stays down")
    ap.add_argument("--logdir", help="keep the replicas' JSON-lines logs here (default: a temporary folder)")
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        where = Path(a.logdir or tmp)
        where.mkdir(parents=True, exist_ok=True)
        base = run(a, 0, where)
        churn = run(a, a.churn_every, where)
    print(f"{'':24}{'no churn':>12}{'churn':>12}")
    print(f"{'survivor steps/s':24}{base['steps_per_s']:12.1f}{churn['steps_per_s']:12.1f}"
          f"   ratio {churn['steps_per_s'] / base['steps_per_s']:.2f}")
    print(f"{'syncs, masters equal':24}{base['syncs']:>8} {base['all_equal']!s:>3}{churn['syncs']:>8} "
          f"{churn['all_equal']!s:>3}")
    print(f"{'held-out loss':24}{base['heldout']:12.4f}{churn['heldout']:12.4f}")
    print("death -> survivors' next commit (s):", " ".join(f"{x:.2f}" for x in churn["death_to_commit_s"]))
    print("restart -> healed commit (s):", " ".join(f"{x:.2f}" for x in churn["start_to_heal_s"]),
          f" heal size {churn['heal_bytes'] / 1e6:.2f} MB (master + momentum)")


if __name__ == "__main__":
    main()

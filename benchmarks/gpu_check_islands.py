"""flatcomm.elastic with CUDA parameters: two islands of one rank on the same GPU (step 6 of
benchmarks/gpu_check.sh; ``--device cpu`` runs the same harness on CPU parameters).

A torchft lighthouse in this process, two island processes (spawned: CUDA after fork is not safe),
each a small MLP on ``--device``, AdamW inside, ElasticDiLoCo every H steps with int4 + error
feedback, ordered. Run twice: master and momentum in pinned host memory (the default for CUDA
parameters) and on the device (``state_device="device"``). Checked per run and island:

* every round committed with both islands in the quorum, the masters' hashes equal across the
  islands after every round (ElasticDiLoCo's verify_every=1 raises otherwise; the hashes are
  compared here too);
* where the state lives: master and momentum pinned on the host (host mode) or on the device
  (device mode); the residuals on the host, pinned (the exchange runs on gloo from host buffers);
* after the last sync the parameters on the device equal the master (rounded to their dtype).

Prints one line per run and ``islands: N passed, M failed``; exit status 1 on a failure.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time
from datetime import timedelta

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def island(k: int, device: str, state: str, lighthouse: str, steps: int, sync_every: int, out) -> None:
    import torch

    import flatcomm.elastic as elastic
    torch.manual_seed(0)
    dev = torch.device(device)
    net = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64)).to(dev)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    manager = elastic.make_manager(f"gpu-island{k}", lighthouse, timeout=timedelta(seconds=30), min_replicas=2,
                                   hostname="localhost")
    outer = elastic.ElasticDiLoCo(net, opt, manager=manager, sync_every=sync_every, codec="int4", state_device=state)
    f = outer.fragment
    g = torch.Generator(device=dev).manual_seed(100 + k)
    hashes = []
    while outer.step < steps:
        x = torch.randn(32, 64, device=dev, generator=g)
        opt.zero_grad()
        (net(x) - x.flip(1)).pow(2).mean().backward()
        opt.step()
        if outer.step % sync_every == 0:
            r = outer.rounds[-1]
            hashes.append([r.committed, r.quorum, outer.master_hash()])
    flat = torch.cat([p.detach().reshape(-1).float().cpu() for p in net.parameters()])
    placed = {"master": str(f.master.device), "master_pinned": bool(f.master.is_pinned()) if f.master.device.type == "cpu" else None,
              "momentum": str(f.momentum.device), "residuals": sorted({str(r.device) for r in f.residuals}),
              "residuals_pinned": all(r.is_pinned() for r in f.residuals) if dev.type == "cuda" else None,
              "params": str(f.device)}
    out.put({"island": k, "hashes": hashes, "placed": placed,
             "weights_are_master": bool(torch.equal(flat, f.master.detach().cpu()))})
    outer.shutdown()  # waits for the island: rank 0 serves its should_commit


def run(device: str, state: str, steps: int, sync_every: int) -> list:
    from torchft._torchft import LighthouseServer
    lh = LighthouseServer(bind="127.0.0.1:0", min_replicas=2, join_timeout_ms=2000, heartbeat_timeout_ms=2000)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=island, args=(k, device, state, lh.address(), steps, sync_every, q), daemon=True)
             for k in range(2)]
    try:
        for p in procs:
            p.start()
        got = [q.get(timeout=240) for _ in procs]
        for p in procs:
            p.join(30)
        return sorted(got, key=lambda r: r["island"])
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        lh.shutdown()


def check(device: str, state: str, res: list) -> list:
    """What failed in one run (empty: passed)."""
    bad = []
    a, b = res
    if not a["hashes"] or [h[2] for h in a["hashes"]] != [h[2] for h in b["hashes"]]:
        bad.append("the islands' masters differ after a sync")
    if not all(h[0] and h[1] == 2 for r in res for h in r["hashes"]):
        bad.append(f"a round did not commit with both islands: {[r['hashes'] for r in res]}")
    for r in res:
        pl = r["placed"]
        want = "cpu" if state == "host" or device == "cpu" else device
        if not pl["master"].startswith(want) or not pl["momentum"].startswith(want):
            bad.append(f"island {r['island']}: master/momentum on {pl['master']}/{pl['momentum']}, want {want}")
        if device.startswith("cuda") and state == "host" and not pl["master_pinned"]:
            bad.append(f"island {r['island']}: the host master is not pinned")
        if pl["residuals"] != ["cpu"] or (device.startswith("cuda") and not pl["residuals_pinned"]):
            bad.append(f"island {r['island']}: residuals {pl['residuals']} (pinned {pl['residuals_pinned']}), want "
                       f"pinned host buffers")
        if not r["weights_are_master"]:
            bad.append(f"island {r['island']}: the parameters after the last sync are not the master")
    return bad


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda:0", help="the parameters' device (cpu: the harness on CPU)")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--sync-every", type=int, default=10)
    ap.add_argument("--json", default="")
    a = ap.parse_args(argv)
    import torch
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        print("islands: skipped: no CUDA device")
        return 0
    passed, failed, report = 0, 0, []
    for state in ("host", "device"):
        t0 = time.perf_counter()
        res = run(a.device, state, a.steps, a.sync_every)
        bad = check(a.device, state, res)
        passed, failed = passed + (not bad), failed + bool(bad)
        report.append({"state": state, "ok": not bad, "problems": bad, "results": res})
        print(f"islands on {a.device}, state_device={state}: {'ok' if not bad else 'FAILED: ' + '; '.join(bad)} "
              f"({len(res[0]['hashes'])} syncs, {time.perf_counter() - t0:.1f} s)", flush=True)
    print(f"islands: {passed} passed, {failed} failed")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

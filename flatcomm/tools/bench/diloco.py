"""DiLoCo over a slow link: bytes off a node per sync, inner-step time, DDP every step (a tool).

    python -m flatcomm.bench diloco [--link 100mbit] [--params 25e6] [--sync-every 40] [--rounds 2]
        [--bytes-params 5e6] [--replicas 2,4] [--codecs fp32,int8,int4,sign] [--json PATH]
        [--time-codecs int4,sparse] [--ddp-steps 0]

Every run is on :class:`flatcomm.tools.netlink.Link` (network namespaces, tc tbf at ``--link``;
this machine's kernel has no netem, so no delay): each replica is a node of one gloo rank.

* **bytes**: per codec and replica count, ``DiLoCo(fragments=1, sync_every=1)`` on an MLP of
  ``--bytes-params``; the node's ``fc0`` tx counter (kernel, headers included) over ``--syncs``
  syncs, divided by syncs x parameters: the bytes per parameter that left a node per sync. Beside
  it the payload bytes counted by the sync itself and the format's formula (two-stage: ``2 (R-1)/R``
  payloads; gathered ``sparse:exact`` and SparseLoCo: ``R-1``). ``sparseloco`` is SparseLoCo's outer
  sync as Templar runs it (:mod:`flatcomm.tools.bench.sparseloco`), ``sparseloco:flat`` its format on
  flatcomm's 4,096-value runs of the flat model.
* **time** (2 replicas, MLP of ``--params``, AdamW inner, batch ``--batch``): the same model's
  compute-only step (no communication at all), DiLoCo with each codec of ``--time-codecs``
  (default int4; error feedback on) with ``fragments=4, fragment_sync_delay=1`` (mean wall time
  per inner step over whole rounds of ``--sync-every``
  steps, the syncs included), and DDP every step (torch's default gloo all-reduce) over the same
  link. A round's time is the slower replica's (both start it at a barrier): replicas that drift
  apart wait for each other at DiLoCo's syncs, and a compute-only run, never synced, would
  otherwise be timed by whichever replica got the faster core. Compute-only and DiLoCo alternate
  round by round and each keeps its fastest round (the machine is shared); the spread over rounds
  is reported. With ``--pin`` (the default when the machine has a core per replica) every thread
  of replica r runs on core r, as a node has CPUs of its own: unpinned, the two replicas' compute
  and comm threads share both cores and their steps drift apart by up to a second per 10 steps,
  which DiLoCo's syncs turn into waits.
* **torchft** (when ``import torchft`` works, e.g. ``PYTHONPATH`` holding torchft 0.2 and its
  opentelemetry dependencies): torchft's ``DiLoCo`` on the same link and model, fp32 pseudo-
  gradients (its ``should_quantize`` path imports triton, i.e. needs CUDA), one fragment, one
  lighthouse on replica 0, a Manager per replica; step time and bytes off a node per sync.
* **churn** (``--churn N``, instead of the rest; loopback, no root): 3 replicas on torchft's
  lighthouse, one killed and restarted every N syncs, flatcomm.elastic beside torchft's DiLoCo
  (:mod:`flatcomm.tools.bench.churn`).
* **islands** (``--islands NxW``, instead of the rest): N islands of W ranks (DDP inside), 100 Mbit/s
  between islands, a rank or a whole island killed and restarted on a schedule: goodput, failure to
  next commit, heal time and bytes per rank, held-out loss (:mod:`flatcomm.tools.bench.islands`).
* **wallclock** (``--wallclock 10mbit,100mbit``, instead of the rest): held-out loss at a fixed
  wall-clock budget, DDP and every DiLoCo row, per link (:mod:`flatcomm.tools.bench.wallclock`).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any, Dict, List, Tuple

import torch
import torch.distributed as dist

from . import churn, islands
from .ddp import mlp


def _tx() -> int:
    from flatcomm.tools import netlink

    return netlink.interface_bytes()[0]


def _model(params: float, seed: int = 0):
    torch.manual_seed(seed)
    return mlp(params)


def _batch(model, rank: int, step: int, batch: int):
    g = torch.Generator().manual_seed(7919 * rank + step)
    w = model[0].in_features
    return torch.randn(batch, w, generator=g), torch.randn(batch, w, generator=g)


def _step(model, opt, rank, step, batch):
    x, y = _batch(model, rank, step, batch)
    opt.zero_grad(set_to_none=False)
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()


def _codec(name: str):
    """``sparse1@184``: the codec keeping 184 values of every chunk; else the name itself."""
    from flatcomm.ops.codecs import Codec

    base, _, keep = name.partition("@")
    return Codec(base, keep=int(keep)) if keep else Codec(base)


def _outer(spec: str, model, opt):
    """The outer sync of a bytes row: ``int4`` (any codec; ``sparse1@184`` names the kept values),
    ``sparse:exact`` (DiLoCo's gathered exact sum), ``sparseloco`` / ``sparseloco:flat`` (the
    SparseLoCo baseline, Templar's tiles or flat 4,096-value runs)."""
    codec, _, variant = spec.partition(":")
    if codec == "sparseloco":
        from .sparseloco import SparseLoCo

        return SparseLoCo(model, opt, sync_every=1, chunking=variant or "tiles")
    from flatcomm.diloco import DiLoCo

    return DiLoCo(model, opt, sync_every=1, codec=_codec(codec), mode="exact" if variant == "exact" else "ordered",
                  verify_every=0)


def formula(spec: str, model, world: int) -> Tuple[float, str]:
    """Bytes a node should send per parameter per sync, from the format, and how."""
    from flatcomm.ops.codecs import wire_bytes

    codec, _, variant = spec.partition(":")
    n = sum(p.numel() for p in model.parameters())
    if codec == "sparseloco":
        from .sparseloco import nominal_bytes_per_param

        return (nominal_bytes_per_param(model, world, chunking=variant or "tiles"),
                "(R-1) x payload (all-gather); payload = chunks x 64 x 14 bits + 24 B per tensor")
    payload = wire_bytes(_codec(codec), n) / n
    if variant == "exact":
        return (world - 1) * payload, f"(R-1) x payload (all-gather), payload {payload:.4f} B/param"
    return 2 * (world - 1) / world * payload, f"2 (R-1)/R x payload (two-stage), payload {payload:.4f} B/param"


def _bytes_rank(rank: int, world: int, cfg: Dict[str, Any]) -> List[Dict[str, Any]]:
    out = []
    for codec in cfg["codecs"]:
        model = _model(cfg["bytes_params"])
        n = sum(p.numel() for p in model.parameters())
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        outer = _outer(codec, model, opt)
        _step(model, opt, rank, 0, 8)  # the first sync: groups and buffers made
        dist.barrier()
        tx0 = _tx()
        for s in range(cfg["syncs"]):
            _step(model, opt, rank, 1 + s, 8)
        dist.barrier()
        tx = _tx() - tx0
        want, how = formula(codec, model, world)
        out.append({"codec": codec, "params": n, "syncs": cfg["syncs"], "tx_bytes": tx,
                    "bytes_per_param": tx / (cfg["syncs"] * n),
                    "flatcomm_wire_bytes_per_sync": outer.stats["wire_bytes"] / outer.syncs,
                    "formula_bytes_per_param": want, "formula": how})
        outer.close()
    return out


def _pin(rank: int) -> None:
    """Every thread of this process (gloo's included) onto core ``rank``; new threads inherit it."""
    for tid in os.listdir("/proc/self/task"):
        os.sched_setaffinity(int(tid), {rank % (os.cpu_count() or 1)})


def _time_rank(rank: int, world: int, cfg: Dict[str, Any]) -> Dict[str, Any]:
    from flatcomm.diloco import DiLoCo

    if cfg["pin"]:
        _pin(rank)
    h, batch = cfg["sync_every"], cfg["batch"]
    names = ["compute"] + list(cfg["codecs"])
    models, outers = {}, {}
    for name in names:
        m = _model(cfg["params"])
        opt = torch.optim.AdamW(m.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)
        models[name] = (m, opt)
        if name != "compute":
            outers[name] = DiLoCo(m, opt, sync_every=h, codec=name, fragments=4, fragment_sync_delay=1)
    rounds: Dict[str, List[float]] = {n: [] for n in names}
    tx: Dict[str, List[int]] = {n: [] for n in names}
    step = {n: 0 for n in names}
    for name in names:  # warm-up (page faults, first sync's buffers), then round boundaries at multiples of H
        for _ in range(2):
            _step(*models[name], rank, step[name], batch)
            step[name] += 1
        while name in outers and outers[name].step % h:
            _step(*models[name], rank, step[name], batch)
            step[name] += 1
    for r in range(cfg["rounds"]):
        for name in (names if r % 2 == 0 else names[::-1]):  # alternate: the box's load drifts
            dist.barrier()
            t0, b0 = time.perf_counter(), _tx()
            for _ in range(h):
                _step(*models[name], rank, step[name], batch)
                step[name] += 1
            rounds[name].append((time.perf_counter() - t0) / h)
            _drain(outers.get(name), world)  # untimed: a transfer in flight must not load the next round
            tx[name].append(_tx() - b0)
    res = {"params": sum(p.numel() for p in models["compute"][0].parameters()), "rounds": rounds, "tx": tx,
           "diloco_stats": {n: o.stats.as_dict() for n, o in outers.items()}}
    for o in outers.values():
        o.close()
    del models, outers
    res["ddp"] = _ddp_times(rank, cfg) if cfg["ddp_steps"] else []
    return res


def _drain(outer, world: int) -> None:
    """Finish the sync ``outer`` has in flight (applied later on schedule, as usual), off the clock."""
    p = outer.pending if outer is not None else None
    if p is not None and not p.finished:
        waited = p.waited_s
        p.wait(world)
        p.waited_s = waited  # the drain is the bench's, not a wait of the training


def _ddp_times(rank: int, cfg: Dict[str, Any]) -> List[float]:
    """DDP every step (torch's gloo all-reduce) on the same model and link: seconds per step."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    ddp = DDP(_model(cfg["params"]), bucket_cap_mb=25)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)
    times = []
    for s in range(cfg["ddp_steps"] + 1):
        dist.barrier()
        t0 = time.perf_counter()
        x, y = _batch(ddp.module, rank, s, cfg["batch"])
        opt.zero_grad(set_to_none=False)
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
        if s:  # the first step builds DDP's buckets
            times.append(time.perf_counter() - t0)
    return times


def _torchft_rank(rank: int, world: int, cfg: Dict[str, Any]) -> Dict[str, Any]:
    """torchft's DiLoCo (0.2, fp32 path: its quantization needs triton/CUDA) on the same link and
    model: one lighthouse on replica 0, a TCPStore and a Manager per replica (group of one rank)."""
    from datetime import timedelta

    from torchft import Manager, ProcessGroupGloo
    from torchft._torchft import LighthouseServer
    from torchft.local_sgd import DiLoCo as TorchftDiLoCo

    from flatcomm.elastic.replica import HostTransport  # (torchft's advertises the host's name: not routable here)

    addrs: List[str] = [""] * world  # filled by the all-gather
    dist.all_gather_object(addrs, _my_address())
    lighthouse = LighthouseServer(bind="[::]:29610", min_replicas=world) if rank == 0 else None
    dist.barrier()
    store = torch.distributed.TCPStore(addrs[rank], 29620, is_master=True, wait_for_workers=False)
    model = _model(cfg["params"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)
    outer_opt = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    manager = Manager(pg=ProcessGroupGloo(timeout=timedelta(seconds=300)), min_replica_size=world,
                      use_async_quorum=False, load_state_dict=lambda sd: None, state_dict=lambda: {},
                      replica_id=str(rank), store_addr=addrs[rank], store_port=29620, rank=0, world_size=1,
                      lighthouse_addr=f"http://{addrs[0]}:29610", hostname=addrs[rank], port=29630,
                      timeout=timedelta(seconds=300), quorum_timeout=timedelta(seconds=300),
                      checkpoint_transport=HostTransport(addrs[rank], timedelta(seconds=300)))
    h = cfg["sync_every"]
    times, tx = [], []
    with TorchftDiLoCo(manager, [model], opt, outer_opt, sync_every=h, backup_device=torch.device("cpu"),
                       fragment_sync_delay=0):
        step = 0
        for r in range(cfg["rounds"] + 1):
            t0, b0 = time.perf_counter(), _tx()
            for _ in range(h):
                _step(model, opt, rank, step, cfg["batch"])
                step += 1
            if r:  # the first round: quorum, recovery
                times.append((time.perf_counter() - t0) / h)
                tx.append(_tx() - b0)
    manager.shutdown(wait=False)
    del store, lighthouse
    return {"step_s": times, "tx": tx, "params": sum(p.numel() for p in model.parameters())}


def _my_address() -> str:
    """This rank's address on the link (fc0), from the kernel."""
    import fcntl
    import socket
    import struct

    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", b"fc0"))  # SIOCGIFADDR
    return socket.inet_ntoa(packed[20:24])


def _progress(msg: str) -> None:
    print(f"[bench] diloco: {msg}", file=sys.stderr, flush=True)


def _spread(xs: List[float]) -> str:
    return f"{min(xs) * 1e3:.0f}-{max(xs) * 1e3:.0f}"


def _torchft(a, Link) -> Dict[str, Any]:
    """torchft 0.2's DiLoCo on the same link and model (fp32: its quantized path imports triton)."""
    try:
        import torchft.local_sgd  # noqa: F401
    except Exception as e:  # noqa: BLE001 - report why, keep the rest of the run
        print(f"\ntorchft: not run: {type(e).__name__}: {e}")
        return {"failed": f"{type(e).__name__}: {e}"}
    cfg = {"params": a.params, "batch": a.batch, "sync_every": a.sync_every, "rounds": 1}
    _progress("torchft's DiLoCo, 2 replicas ...")
    with Link(2, a.link) as link:
        res = link.run(2, _torchft_rank, cfg, timeout_s=1800)
    r0 = res[0]
    bpp = statistics.mean(r0["tx"]) / r0["params"]
    print(f"\ntorchft 0.2 DiLoCo (fp32 pseudo-gradients, 1 fragment, H={a.sync_every}), {r0['params'] / 1e6:.1f}M "
          f"params, {a.link}: {min(r0['step_s']) * 1e3:.1f} ms per inner step, {bpp:.3f} B/param per sync off a node "
          f"(fc0 tx)")
    return {**r0, "bytes_per_param_per_sync": bpp}


def _time(a, Link) -> Dict[str, Any]:
    """The time runs: compute-only and DiLoCo with each of ``--time-codecs``, rounds alternating."""
    codecs = [c for c in a.time_codecs.split(",") if c]
    cfg = {"params": a.params, "batch": a.batch, "sync_every": a.sync_every, "rounds": a.rounds,
           "ddp_steps": a.ddp_steps, "pin": a.pin, "codecs": codecs}
    _progress(f"inner-step time, 2 replicas, {a.rounds} rounds of {a.sync_every} steps per variant ...")
    with Link(2, a.link) as link:
        res = link.run(2, _time_rank, cfg, timeout_s=3600)
    r0 = res[0]
    r0["rounds_per_replica"] = [r["rounds"] for r in res]
    r0["rounds"] = {k: [max(r["rounds"][k][i] for r in res) for i in range(len(r0["rounds"][k]))]
                    for k in r0["rounds"]}  # the slower replica's time, round by round
    comp = min(r0["rounds"]["compute"])
    ddp = statistics.median(r0["ddp"]) if r0["ddp"] else None
    print(f"\ninner step, {r0['params'] / 1e6:.1f}M params, 2 replicas, {a.link}, AdamW, batch {a.batch}, "
          f"H={a.sync_every}, fragments=4, delay 1{', a core per replica' if a.pin else ''} (the slower "
          f"replica's time, best of {a.rounds} rounds, spread in ms):")
    print(f"  compute only      {comp * 1e3:8.1f} ms   ({_spread(r0['rounds']['compute'])})")
    out = {**r0, "compute_s": comp, "ddp_s": ddp, "codecs": {}}
    for c in codecs:
        dl = min(r0["rounds"][c])
        median = statistics.median(r0["rounds"][c]) / statistics.median(r0["rounds"]["compute"])
        waits = [r["diloco_stats"][c]["wait_s"] for r in res]
        st = r0["diloco_stats"][c]
        out["codecs"][c] = {"diloco_s": dl, "diloco_vs_compute": dl / comp, "diloco_vs_compute_median": median,
                            "diloco_vs_ddp": dl / ddp if ddp else None, "wait_s_per_replica": waits}
        print(f"  DiLoCo {c:10s} {dl * 1e3:8.1f} ms   ({_spread(r0['rounds'][c])})   x{dl / comp:.3f} of "
              f"compute-only (medians: x{median:.3f}); the replicas waited "
              f"{' and '.join(f'{w:.2f}' for w in waits)} s over {st['syncs']} fragment syncs; "
              f"{[round(f['bytes_per_sync'] / f['numel'], 4) for f in st['fragments']]} B/param per fragment sync; "
              f"tx per round {statistics.mean(r0['tx'][c]) / r0['params']:.4f} B/param")
    if ddp:
        print(f"  DDP every step    {ddp * 1e3:8.1f} ms   ({_spread(r0['ddp'])})")
    if codecs:  # the first codec's numbers under the keys of earlier JSON files
        out.update({k: out["codecs"][codecs[0]][k] for k in ("diloco_s", "diloco_vs_compute",
                                                               "diloco_vs_compute_median", "diloco_vs_ddp",
                                                               "wait_s_per_replica")})
    return out


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The options of ``bench diloco`` (on its own parser, or on ``bench --help``'s subparser).

    Args:
        ap: the parser to add them to.
    """
    ap.add_argument("--link", default="100mbit", metavar="RATE",
                    help="the shaped link between replicas, e.g. 100mbit (needs root; default 100mbit)")
    ap.add_argument("--params", type=float, default=27e6,  # the MLP rounds down: 26.6M
                    help="MLP parameters of the time runs (default 27e6, rounded down by the MLP)")
    ap.add_argument("--batch", type=int, default=16, help="samples per inner step in the time runs (default 16)")
    ap.add_argument("--sync-every", type=int, default=40, help="inner steps between outer syncs, H (default 40)")
    ap.add_argument("--rounds", type=int, default=2,
                    help="rounds of --sync-every steps per variant; the fastest is kept (default 2)")
    ap.add_argument("--ddp-steps", type=int, default=2, help="timed DDP-every-step steps (default 2; 0: none)")
    ap.add_argument("--time-codecs", default="int4",
                    help="DiLoCo codecs of the time runs, comma separated (default int4; e.g. int4,sparse)")
    ap.add_argument("--bytes-params", type=float, default=5e6,
                    help="MLP parameters of the bytes runs (default 5e6)")
    ap.add_argument("--syncs", type=int, default=2, help="outer syncs per codec in the bytes runs (default 2)")
    ap.add_argument("--replicas", default="2,4", help="replica counts of the bytes runs, comma separated (default 2,4)")
    ap.add_argument("--codecs", default="fp32,int8,int4,sign",
                    help="codecs of the bytes runs, comma separated (default fp32,int8,int4,sign); sparse1@184 "
                         "keeps 184 values per chunk; sparse:exact "
                         "is the gathered exact sum; sparseloco, sparseloco:flat the SparseLoCo baseline "
                         "(flatcomm.tools.bench.sparseloco)")
    ap.add_argument("--pin", action=argparse.BooleanOptionalAction, default=(os.cpu_count() or 1) >= 2,
                    help="each replica's threads on a core of its own (time runs; default on with 2+ cores)")
    ap.add_argument("--skip", default="", help="comma-separated parts to skip: bytes, time, torchft")
    ap.add_argument("--json", metavar="PATH", help="write every measurement as JSON")
    churn.add_arguments(ap)
    islands.add_arguments(ap)
    from . import wallclock  # (it imports this module's helpers)

    wallclock.add_arguments(ap)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m flatcomm.bench diloco", description=__doc__.split("\n")[0])
    add_arguments(ap)
    return ap


def main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    if a.churn or a.islands or a.wallclock:
        from . import wallclock

        runs = churn.run_bench(a) if a.churn else islands.run_bench(a) if a.islands else wallclock.run_bench(a)
        if a.json:
            with open(a.json, "w") as f:
                json.dump(runs, f, indent=1)
        return 0
    from flatcomm.tools.netlink import Link

    t0 = time.perf_counter()
    skip = set(a.skip.split(","))
    out: Dict[str, Any] = {"link": a.link, "bytes": {}, "note": "timings on a shared (loaded) 2-core box"}
    codecs = [c for c in a.codecs.split(",") if c]
    if "bytes" not in skip:
        for w in [int(x) for x in a.replicas.split(",") if x]:
            _progress(f"bytes per sync, {w} replicas, codecs {','.join(codecs)} ...")
            with Link(w, a.link) as link:
                cfg = {"codecs": codecs, "bytes_params": a.bytes_params, "syncs": a.syncs}
                rows = link.run(w, _bytes_rank, cfg, timeout_s=900)
            out["bytes"][w] = rows
            print(f"\nbytes off a node per parameter per sync, {w} replicas x 1 rank, {a.link} (fc0 tx counter, "
                  f"mean over nodes):")
            for i, c in enumerate(codecs):
                per_node = [rows[r][i]["bytes_per_param"] for r in range(w)]
                r0 = rows[0][i]
                print(f"  {c:15s} {statistics.mean(per_node):7.4f} B/param (nodes {min(per_node):.4f}-"
                      f"{max(per_node):.4f}; payload count {r0['flatcomm_wire_bytes_per_sync'] / r0['params']:.4f}; "
                      f"formula {r0['formula_bytes_per_param']:.4f} = {r0['formula']})", flush=True)
    if "time" not in skip:
        out["time"] = _time(a, Link)
    if "torchft" not in skip:
        out["torchft"] = _torchft(a, Link)
    out["seconds"] = time.perf_counter() - t0
    print(f"\n(timings taken on a shared, loaded box; {out['seconds']:.0f} s)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())

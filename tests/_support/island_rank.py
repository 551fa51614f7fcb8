"""One rank of an island for tests/test_islands.py (forked from a warm forkserver by
tests/_support/island_cluster.py): W ranks of an island train one MLP replica with DDP, FSDP2 or
(W = 1) plain, reading their batches from a :class:`flatcomm.elastic.BatchStream`, and sync with
the same rank of the other islands through :class:`flatcomm.elastic.ElasticDiLoCo`.

Writes one JSON line per event to ``--log``: ``batch`` (the inner step it trains, the sample
indices it read), ``round`` after every sync round (torchft step, committed, quorum, contributors,
healed, heal time and bytes, the master part's hash), ``mid`` in the middle of every interval,
``done``. Stops after the round where torchft's step reaches the number in ``--stop-file``.
``--die-file F``: SIGKILL itself at its next mid-interval point once F exists. ``--die-in-sync F``:
at the start of its next sum once F exists (a death during a sync's transfer). ``--die-healing F``:
while it receives a heal once F exists (the healing island dies mid-heal). ``--die-serving M``: when
it serves its part to a healing island once M.armed exists (a donor dies mid-heal; one donor of all).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import time
import zlib
from datetime import timedelta

import torch
import torch.distributed as dist

import flatcomm.elastic as elastic
from flatcomm.elastic import exchange, replica

SAMPLES, BATCH = 4096, 4


def _args(argv):
    ap = argparse.ArgumentParser()
    for name in ("--island", "--rank", "--size", "--islands", "--store-port"):
        ap.add_argument(name, type=int, required=True)
    for name in ("--lighthouse", "--log", "--stop-file"):
        ap.add_argument(name, required=True)
    ap.add_argument("--kind", default="ddp", choices=("ddp", "fsdp", "plain"))
    ap.add_argument("--codec", default="int4")
    ap.add_argument("--mode", default="ordered")
    ap.add_argument("--sync-every", type=int, default=4)
    ap.add_argument("--step-sleep", type=float, default=0.02)
    ap.add_argument("--timeout", type=float, default=10.0)
    ap.add_argument("--incarnation", type=int, default=0)
    ap.add_argument("--die-file", default="")
    ap.add_argument("--die-in-sync", default="")
    ap.add_argument("--die-healing", default="")
    ap.add_argument("--die-serving", default="")
    return ap.parse_args(argv)


def _die_in_sync(path: str, emit) -> None:
    real = exchange.sum_over

    def dying(*a, **kw):
        if os.path.exists(path):
            os.remove(path)
            emit("dying", where="sync")
            os.kill(os.getpid(), signal.SIGKILL)
        return real(*a, **kw)
    exchange.sum_over = dying


def _die_healing(path: str, emit) -> None:
    real = replica.HostTransport.recv_checkpoint

    def dying(self, *a, **kw):
        if os.path.exists(path):
            os.remove(path)
            emit("dying", where="heal")
            os.kill(os.getpid(), signal.SIGKILL)
        return real(self, *a, **kw)
    replica.HostTransport.recv_checkpoint = dying


def _die_serving(marker: str, emit) -> None:
    """SIGKILL this rank when a healing island asks it for its part, once the test armed it
    (MARKER.armed exists): the first donor to rename it to MARKER dies, the others serve."""
    from flatcomm.elastic import heal
    real = heal.state

    def dying(*a, **kw):
        try:
            os.rename(marker + ".armed", marker)
        except FileNotFoundError:
            return real(*a, **kw)
        emit("dying", where="serving")
        os.kill(os.getpid(), signal.SIGKILL)
    heal.state = dying


def _model(kind: str, group):
    torch.manual_seed(0)  # every island starts from the same weights
    net = torch.nn.Sequential(torch.nn.Linear(13, 37), torch.nn.Tanh(), torch.nn.Linear(37, 5))
    if kind == "ddp":
        return torch.nn.parallel.DistributedDataParallel(net, process_group=group)
    if kind == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh("cpu", (dist.get_world_size(group),))
        for layer in net:
            if any(p.requires_grad for p in layer.parameters()):
                fully_shard(layer, mesh=mesh)
        return fully_shard(net, mesh=mesh)
    return net


def run(argv, output: str) -> None:
    fd = os.open(output, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.environ["RUST_LOG"] = "warn"
    main(argv)


def main(argv=None) -> None:
    a = _args(argv)
    torch.set_num_threads(1)
    log = open(a.log, "a", buffering=1)
    iid = f"i{a.island}"

    def emit(event, **kw):
        log.write(json.dumps({"event": event, "island": a.island, "rank": a.rank, "inc": a.incarnation,
                              "pid": os.getpid(), "t": time.time(), **kw}) + "\n")

    if a.die_in_sync:
        _die_in_sync(a.die_in_sync, emit)
    if a.die_healing:
        _die_healing(a.die_healing, emit)
    if a.die_serving:
        _die_serving(a.die_serving, emit)
    timeout = timedelta(seconds=a.timeout)
    group = None
    if a.size > 1:
        store = dist.TCPStore("127.0.0.1", a.store_port, is_master=False, timeout=timeout)
        dist.init_process_group("gloo", store=store, rank=a.rank, world_size=a.size, timeout=timeout)
        group = dist.group.WORLD
    model = _model(a.kind, group)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(7)
    data_x, data_w = torch.randn(SAMPLES, 13, generator=g), torch.randn(13, 5, generator=g)
    stream = elastic.BatchStream(SAMPLES, BATCH, a.islands, a.size, seed=3)
    manager = elastic.make_manager(iid, a.lighthouse, timeout=timeout, quorum_timeout=timedelta(seconds=60),
                                   hostname="localhost", rendezvous_timeout=timedelta(seconds=2), min_replicas=1,
                                   island=group)
    outer = elastic.ElasticDiLoCo(model, opt, manager=manager, sync_every=a.sync_every, codec=a.codec, mode=a.mode,
                                  island=group, data=stream)
    seen = 0
    while True:
        while seen < len(outer.rounds):
            r = outer.rounds[seen]
            seen += 1
            emit("round", mstep=manager.current_step(), step=r.step, committed=r.committed, quorum=r.quorum,
                 contributors=r.contributors, healed=r.healed, healed_to=r.healed_to, heal_s=r.heal_s,
                 heal_bytes=r.heal_bytes,
                 hash=outer.master_hash(), part=outer.fragment.numel, quorum_s=r.quorum_s,
                 exchange_s=r.exchange_s, error=r.error)
        if outer.step % a.sync_every == 0 and manager.current_step() >= _stop_at(a.stop_file):
            break
        if outer.step % a.sync_every == a.sync_every // 2:
            emit("mid", mstep=manager.current_step(), step=outer.step)
            if a.die_file and os.path.exists(a.die_file):
                os.remove(a.die_file)
                emit("dying", where="mid", step=outer.step)
                os.kill(os.getpid(), signal.SIGKILL)
        idx = stream.next(a.island, a.rank)
        emit("batch", step=outer.step + 1, crc=zlib.crc32(idx.numpy().tobytes()))
        x = data_x[idx]
        opt.zero_grad()
        (model(x) - x @ data_w).pow(2).mean().backward()
        time.sleep(a.step_sleep)
        opt.step()
    emit("done", stats=outer.stats)
    log.close()
    outer.shutdown()  # waits for the island: rank 0 serves its should_commit
    os._exit(0)


def _stop_at(path: str) -> int:
    try:
        with open(path) as f:
            return int(f.read().strip() or 1 << 30)
    except (OSError, ValueError):
        return 1 << 30

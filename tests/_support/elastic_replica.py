"""One ElasticDiLoCo replica process for tests/test_elastic.py (``python elastic_replica.py ...``,
or :func:`run` in a process forked from a warm forkserver: a restart takes ~0.1 s, not an import).

Trains a small MLP on its own seeded batches and writes one JSON line per event to ``--log``:
``round`` after every sync round (torchft step, inner step, committed, quorum, contributors,
healed, the master's hash, timings, error), ``mid`` in the middle of every interval (where the test
kills it), ``done`` at the end. It stops after the round where torchft's step reaches the number in
``--stop-file`` (all replicas read the same number, so they stop after the same round).
``--die-in-sync N``: SIGKILL itself at the start of its N-th sum (after the round's quorum and
agreement: a death during the sync's transfer). ``--die-serving-heal F``: SIGKILL itself when a
peer asks for its heal state (a donor dying mid-heal), once: the first donor that creates the file F.
``--die-at-rendezvous F``: SIGKILL itself on entering a new quorum's group set-up once F exists
(between the quorum's forming and its rendezvous).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
import zlib
from datetime import timedelta

import torch

import flatcomm.elastic as elastic
from flatcomm.elastic import exchange


def _args(argv=None):
    ap = argparse.ArgumentParser()
    for name in ("--id", "--lighthouse", "--log", "--stop-file"):
        ap.add_argument(name, required=True)
    ap.add_argument("--codec", default="int4")
    ap.add_argument("--mode", default="ordered")
    ap.add_argument("--sync-every", type=int, default=4)
    ap.add_argument("--step-sleep", type=float, default=0.02)
    ap.add_argument("--timeout", type=float, default=10.0)
    ap.add_argument("--rendezvous-timeout", type=float, default=2.0)
    ap.add_argument("--die-at-rendezvous", default="")
    ap.add_argument("--die-in-sync", type=int, default=0)
    ap.add_argument("--die-file", default="", help="SIGKILL itself at the next mid-interval once this file exists")
    ap.add_argument("--seed-offset", type=int, default=0)
    ap.add_argument("--die-serving-heal", default="", help="a file: SIGKILL itself when asked for its heal state "
                    "once the test armed it (FILE.armed exists); the first donor renames FILE.armed to FILE, so "
                    "one donor of several dies")
    return ap.parse_args(argv)


def _die_in_sync(n: int) -> None:
    real, count = exchange.sum_over, [0]

    def dying(*a, **kw):
        count[0] += 1
        if count[0] == n:
            os.kill(os.getpid(), signal.SIGKILL)
        return real(*a, **kw)
    exchange.sum_over = dying


def _die_serving_heal(marker: str) -> None:
    from flatcomm.elastic import heal
    real = heal.state

    def dying(*a, **kw):
        # armed by the test, never by timing: a late starter's first heal must not kill its donor
        try:
            os.rename(marker + ".armed", marker)  # atomic: only one donor wins
        except FileNotFoundError:
            return real(*a, **kw)
        os.kill(os.getpid(), signal.SIGKILL)  # a donor dying while another replica heals from it
    heal.state = dying


def _die_at_rendezvous(path: str, emit) -> None:
    real = elastic.QuorumGroup._create_pg

    def dying(self, *a, **kw):
        if os.path.exists(path):  # the quorum is formed; this replica never reaches its rendezvous
            os.remove(path)
            emit("dying-at-rendezvous")
            os.kill(os.getpid(), signal.SIGKILL)
        return real(self, *a, **kw)
    elastic.QuorumGroup._create_pg = dying


def _stop_at(path: str) -> int:
    try:
        with open(path) as f:
            return int(f.read().strip() or 1 << 30)
    except (OSError, ValueError):
        return 1 << 30


def run(argv, output: str) -> None:
    """:func:`main` in a process forked from a warm forkserver, its output into the file ``output``."""
    fd = os.open(output, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.environ["RUST_LOG"] = "warn"
    main(argv)


def main(argv=None) -> None:
    a = _args(argv)
    torch.set_num_threads(1)
    log = open(a.log, "a", buffering=1)

    def emit(event, **kw):
        log.write(json.dumps({"event": event, "id": a.id, "pid": os.getpid(), "t": time.time(), **kw}) + "\n")

    if a.die_in_sync:
        _die_in_sync(a.die_in_sync)
    torch.manual_seed(0)  # every replica starts from the same weights
    net = torch.nn.Sequential(torch.nn.Linear(13, 37), torch.nn.Tanh(), torch.nn.Linear(37, 5))
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    if a.die_serving_heal:
        _die_serving_heal(a.die_serving_heal)
    if a.die_at_rendezvous:
        _die_at_rendezvous(a.die_at_rendezvous, emit)
    manager = elastic.make_manager(a.id, a.lighthouse, timeout=timedelta(seconds=a.timeout),
                                   quorum_timeout=timedelta(seconds=60), hostname="localhost",
                                   rendezvous_timeout=timedelta(seconds=a.rendezvous_timeout))
    outer = elastic.ElasticDiLoCo(net, opt, manager=manager, sync_every=a.sync_every, codec=a.codec, mode=a.mode)
    seen = 0
    while True:
        while seen < len(outer.rounds):
            r = outer.rounds[seen]
            seen += 1
            emit("round", mstep=manager.current_step(), step=r.step, committed=r.committed, quorum=r.quorum,
                 contributors=r.contributors, healed=r.healed, hash=outer.master_hash(), quorum_s=r.quorum_s,
                 exchange_s=r.exchange_s, error=r.error, syncs=outer.syncs)
        if outer.step % a.sync_every == 0 and manager.current_step() >= _stop_at(a.stop_file):
            break
        if outer.step % a.sync_every == a.sync_every // 2:
            emit("mid", mstep=manager.current_step(), step=outer.step)
            if a.die_file and os.path.exists(a.die_file):  # truly mid-interval: no sync in flight
                os.remove(a.die_file)
                emit("dying", mstep=manager.current_step(), step=outer.step)
                os.kill(os.getpid(), signal.SIGKILL)
        g = torch.Generator().manual_seed(zlib.crc32(f"{a.id}/{outer.step}/{a.seed_offset}".encode()))
        x = torch.randn(16, 13, generator=g)
        opt.zero_grad()
        net(x).pow(2).mean().backward()
        time.sleep(a.step_sleep)
        opt.step()
    emit("done", stats=outer.stats)
    log.close()
    outer.shutdown()  # waits for the island: rank 0 serves its should_commit
    os._exit(0)  # torchft's threads: exit without waiting for them


if __name__ == "__main__":
    sys.exit(main())

"""examples/islands.py as docs/elastic.md launches it: a torchft lighthouse and one torchrun per
island (2 islands x 2 ranks, DDP inside), ``--max-restarts`` on. A worker of island 1 is SIGKILLed
mid-run: torchrun stops the island's other worker and starts both again; the new incarnation heals
(each rank its part, from the same rank of island 0) and both islands end with the same held-out
loss, after every island committed its last sync with both islands in the quorum."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

pytest.importorskip("torchft", reason="flatcomm.elastic needs torchft (pip install 'flatcomm[elastic]')")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "islands.py")
TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _lines(path: str) -> list:
    out = []
    for line in open(path, errors="replace"):
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
    return out


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists(TORCHRUN), reason="torchrun not installed next to this python")
def test_torchrun_restarts_a_killed_island_which_heals(tmp_path):
    from torchft._torchft import LighthouseServer

    lh = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=1000, heartbeat_timeout_ms=1000)
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1",
           "RUST_LOG": "warn"}
    procs, logs = [], []
    try:
        for k in range(2):
            logs.append(str(tmp_path / f"island{k}.log"))
            cmd = [TORCHRUN, "--nproc-per-node", "2", "--max-restarts", "2", "--monitor-interval", "0.2",
                   "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{_free_port()}", EXAMPLE,
                   "--island", str(k), "--islands", "2", "--lighthouse", lh.address().split("://")[-1],
                   "--steps", "6000", "--sync-every", "10", "--hidden", "128", "--timeout", "20"]
            procs.append(subprocess.Popen(cmd, env=env, stdout=open(logs[-1], "w"), stderr=subprocess.STDOUT))
        deadline = time.monotonic() + 180
        victim = None
        while victim is None:  # a worker of island 1, once both islands synced together
            assert time.monotonic() < deadline, open(logs[1]).read()[-3000:]
            ev = _lines(logs[1])
            both = [e for e in ev if e.get("committed") and e.get("quorum") == 2 and e.get("step", 0) >= 100]
            victim = both[-1]["pid"] if both else None
            time.sleep(0.2)
        os.kill(victim, signal.SIGKILL)
        killed = time.time()
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
        assert [p.returncode for p in procs] == [0, 0], open(logs[1]).read()[-3000:]
        ev1 = _lines(logs[1])
        healed = [e for e in ev1 if e.get("healed") and e.get("committed") and e["t"] > killed]
        assert {e["rank"] for e in healed} == {0, 1}, ev1[-6:]  # both ranks healed their part
        assert all(e["pid"] != victim for e in healed)
        done = [e for log in logs for e in _lines(log) if e.get("done")]
        assert len(done) == 4 and len({e["heldout"] for e in done}) == 1, done
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(30)
        lh.shutdown()

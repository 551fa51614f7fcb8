"""A torchft lighthouse on a free loopback port and ElasticDiLoCo replica processes
(tests/_support/elastic_replica.py) that a test starts, kills and restarts, reading their logs."""
from __future__ import annotations

import json
import multiprocessing as mp
import signal
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional

from . import elastic_replica

_PRELOAD = ["torch", "torch.distributed", "flatcomm", "flatcomm.elastic", "_support.elastic_replica"]
_context = None


def _forkserver():
    """One forkserver that has imported torch, flatcomm and torchft: a replica (re)starts in ~0.1 s."""
    global _context
    if _context is None:
        _context = mp.get_context("forkserver")
        _context.set_forkserver_preload(_PRELOAD)
    return _context


class Cluster:
    """Replicas r0 .. r{n-1} under one lighthouse; every wait has a deadline."""

    def __init__(self, tmp: Path, n: int, heartbeat_ms: int = 1000, **replica_args: object) -> None:
        from torchft._torchft import LighthouseServer
        self.lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=2, join_timeout_ms=2000,
                                           heartbeat_timeout_ms=heartbeat_ms)
        self.tmp, self.log, self.stop = tmp, tmp / "log.jsonl", tmp / "stop"
        self.args = {k.replace("_", "-"): v for k, v in replica_args.items()}
        self.procs: Dict[str, mp.process.BaseProcess] = {}
        self.starts = 0
        for i in range(n):
            self.start(f"r{i}")

    def start(self, rid: str, **extra) -> None:
        args = ["--id", rid, "--lighthouse", self.lighthouse.address(), "--log", str(self.log),
                "--stop-file", str(self.stop), "--die-file", str(self.tmp / f"{rid}.die")]
        for k, v in {**self.args, **{k.replace("_", "-"): v for k, v in extra.items()}}.items():
            args += [f"--{k}", str(v)]
        self.starts += 1
        out = str(self.tmp / f"{rid}.{self.starts}.stderr")
        self.procs[rid] = _forkserver().Process(target=elastic_replica.run, args=(args, out), daemon=True)
        self.procs[rid].start()

    def exitcode(self, rid: str) -> Optional[int]:
        return self.procs[rid].exitcode

    def kill_mid_interval(self, rid: str) -> float:
        """Make ``rid`` SIGKILL itself at its next mid-interval point (a kill from outside may land in
        its next sync instead); returns when it died (time.time())."""
        (self.tmp / f"{rid}.die").touch()
        self.procs[rid].join(timeout=30)
        assert self.procs[rid].exitcode == -signal.SIGKILL, f"{rid} did not die mid-interval"
        return max(e["t"] for e in self.events("dying") if e["id"] == rid)

    def events(self, event: Optional[str] = None) -> List[dict]:
        if not self.log.exists():
            return []
        out = []
        for line in self.log.read_text().splitlines():
            try:
                e = json.loads(line)
            except ValueError:  # a line being written
                continue
            if event is None or e["event"] == event:
                out.append(e)
        return out

    def wait_for(self, what: str, pred: Callable[[List[dict]], object], timeout: float = 60.0):
        """Poll the log until ``pred(events)`` is truthy (returned); raise naming ``what``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            got = pred(self.events())
            if got:
                return got
            dead = {r: p.exitcode for r, p in self.procs.items() if p.exitcode not in (None, 0, -9)}
            if dead:
                raise AssertionError(f"replicas exited abnormally {dead} while waiting for {what}: {self.stderr()}")
            time.sleep(0.1)
        raise AssertionError(f"timed out after {timeout} s waiting for {what}; last events "
                             f"{self.events()[-6:]}; {self.stderr()}")

    def stderr(self) -> str:
        return " | ".join(f"{p.name}: {p.read_text()[-600:]}" for p in sorted(self.tmp.glob("*.stderr")))

    def finish(self, extra_rounds: int = 2, timeout: float = 60.0) -> None:
        """Every live replica stops after the same round (a few rounds from now)."""
        top = max(e["mstep"] for e in self.events("round"))
        self.stop.write_text(str(top + extra_rounds))
        deadline = time.monotonic() + timeout
        for rid, p in self.procs.items():
            p.join(timeout=max(1.0, deadline - time.monotonic()))
            assert p.exitcode in (0, -9), f"{rid} exited with {p.exitcode}: {self.stderr()}"

    def close(self) -> None:
        for p in self.procs.values():
            if p.exitcode is None:
                p.kill()
                p.join(timeout=30)
        self.lighthouse.shutdown()

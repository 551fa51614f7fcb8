"""A torchft lighthouse on a free loopback port and islands of W rank processes
(tests/_support/island_rank.py) that a test kills and that come back the way torchrun brings them
back: when one rank of an island dies, the launcher stops the island's other ranks and, if asked,
starts the whole island again (a fresh island group on a fresh store). Every wait has a deadline."""
from __future__ import annotations

import json
import multiprocessing as mp
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import torch.distributed as dist

from . import island_rank

_PRELOAD = ["torch", "torch.distributed", "torch.distributed.fsdp", "flatcomm", "flatcomm.elastic",
            "_support.island_rank"]
_context = None


def _forkserver():
    global _context
    if _context is None:
        _context = mp.get_context("forkserver")
        _context.set_forkserver_preload(_PRELOAD)
    return _context


class Islands:
    """Islands i0 .. i{n-1} of ``size`` ranks each under one lighthouse (``min_replicas`` 1: an
    island alone goes on). ``restart``: bring an island back at once after one of its ranks died."""

    def __init__(self, tmp: Path, n: int, size: int, heartbeat_ms: int = 1000, restart: bool = True,
                 **rank_args: object) -> None:
        from torchft._torchft import LighthouseServer
        self.lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=1000,
                                           heartbeat_timeout_ms=heartbeat_ms)
        self.tmp, self.log, self.stop = tmp, tmp / "log.jsonl", tmp / "stop"
        self.n, self.size, self.restart = n, size, restart
        self.args = {k.replace("_", "-"): v for k, v in rank_args.items()}
        self.procs: Dict[Tuple[int, int], mp.process.BaseProcess] = {}
        self.incarnations = [0] * n
        self.downs: List[Tuple[int, float]] = []  # (island, when the launcher saw it die)
        self._stores: list = []
        self._extra: Dict[int, dict] = {}
        for k in range(n):
            self.start(k)

    def start(self, k: int, **extra) -> None:
        """Start island ``k`` (every rank; ``extra``: flags for this incarnation, e.g. die_in_sync)."""
        self.incarnations[k] += 1
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        self._stores.append(store)  # alive while its island may still rendezvous
        for r in range(self.size):
            args = ["--island", str(k), "--rank", str(r), "--size", str(self.size), "--islands", str(self.n),
                    "--store-port", str(store.port), "--lighthouse", self.lighthouse.address(),
                    "--log", str(self.log), "--stop-file", str(self.stop), "--incarnation", str(self.incarnations[k]),
                    "--die-file", str(self.tmp / f"i{k}r{r}.die"), "--die-in-sync", str(self.tmp / f"i{k}r{r}.sync"),
                    "--die-healing", str(self.tmp / f"i{k}r{r}.heal"), "--die-serving", str(self.tmp / "donor")]
            flags = {**self.args, **{kk.replace("_", "-"): v for kk, v in extra.get(r, extra.get("all", {})).items()}}
            for kk, v in flags.items():
                args += [f"--{kk}", str(v)]
            out = str(self.tmp / f"i{k}r{r}.{self.incarnations[k]}.stderr")
            p = _forkserver().Process(target=island_rank.run, args=(args, out), daemon=True)
            p.start()
            self.procs[(k, r)] = p

    def arm(self, k: int, r: int, name: str) -> Path:
        """Make rank ``r`` of island ``k`` SIGKILL itself at its next ``name``: "die" (mid-interval),
        "sync" (in a sync's transfer) or "heal" (while it receives a heal), in whichever incarnation
        gets there first."""
        path = self.tmp / f"i{k}r{r}.{name}"
        path.touch()
        return path

    def kill_island(self, k: int) -> float:
        """SIGKILL every rank of island ``k`` now (a whole site lost); returns when."""
        now = time.time()
        for r in range(self.size):
            self.procs[(k, r)].kill()
        for r in range(self.size):
            self.procs[(k, r)].join(timeout=30)
        self._after_death(k, now)
        return now

    def _after_death(self, k: int, when: float) -> None:
        self.downs.append((k, when))
        if self.restart:
            self.start(k, **self._extra.pop(k, {}))

    def next_incarnation(self, k: int, **extra) -> None:
        """Flags for island ``k``'s next start (by rank, or "all")."""
        self._extra[k] = extra

    def watch(self) -> None:
        """The launcher's part: a rank of an island exited -> stop its other ranks -> restart."""
        for k in range(self.n):
            ps = [self.procs[(k, r)] for r in range(self.size)]
            dead = [p.exitcode for p in ps if p.exitcode not in (None, 0)]
            if not dead:
                continue
            if -9 not in dead:
                raise AssertionError(f"island {k} exited abnormally {dead} with no rank killed: {self.stderr()}")
            for p in ps:
                if p.exitcode is None:
                    p.kill()
                    p.join(timeout=30)
            self._after_death(k, time.time())

    def events(self, event: Optional[str] = None) -> List[dict]:
        if not self.log.exists():
            return []
        out = []
        for line in self.log.read_text().splitlines():
            try:
                e = json.loads(line)
            except ValueError:
                continue
            if event is None or e["event"] == event:
                out.append(e)
        return out

    def wait_for(self, what: str, pred: Callable[[List[dict]], object], timeout: float = 60.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.watch()
            got = pred(self.events())
            if got:
                return got
            time.sleep(0.05)
        raise AssertionError(f"timed out after {timeout} s waiting for {what}; last events "
                             f"{self.events()[-6:]}; {self.stderr()}")

    def stderr(self) -> str:
        return " | ".join(f"{p.name}: {p.read_text()[-500:]}" for p in sorted(self.tmp.glob("*.stderr")))

    def finish(self, extra_rounds: int = 2, timeout: float = 60.0) -> None:
        """Every live rank stops after the same round (a few rounds from now)."""
        self.restart = False
        top = max(e["mstep"] for e in self.events("round"))
        self.stop.write_text(str(top + extra_rounds))
        deadline = time.monotonic() + timeout
        for key, p in self.procs.items():
            p.join(timeout=max(1.0, deadline - time.monotonic()))
            assert p.exitcode == 0, f"{key} exited with {p.exitcode}: {self.stderr()}"

    def close(self) -> None:
        for p in self.procs.values():
            if p.exitcode is None:
                p.kill()
                p.join(timeout=30)
        self.lighthouse.shutdown()

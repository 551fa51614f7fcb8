"""Confirm a measured ``codec="auto"`` decision by racing it against the safe choice at its size.

The cost model predicts from a few timed collectives at one size; on a host whose cores also move
the bytes (CPU ranks, loopback) its error can exceed the margin between two candidates, and one run
of a script may then compress where that costs twice the backend's all-reduce. So before a decision
made from *measured* costs is used, the candidate and the safe choice (the backend's own
all-reduce where determinism was not asked, else lossless fp32) run alternately at the collective's
real size, each run's time the slowest rank's (a MAX all-reduce, so every rank sees the same numbers
and makes the same choice), until they separate beyond their spread: every run of the candidate at
least :data:`MARGIN` faster than every run of the safe choice (the candidate is kept), or the
candidate's best run no faster than the safe choice's worst (the safe choice is kept). When they
have not separated after :data:`MAX_ROUNDS`, the safe choice is kept. Decisions from a profile or
from costs the caller gave are never raced: they are the same every run by design.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Callable, List, Optional

import torch
import torch.distributed as dist

from ..comm import flat, route
from ..comm.args import ErrorFeedback
from ..comm.spec import CallSpec
from ..ops.codecs import Codec

__all__ = ["MARGIN", "MAX_NUMEL", "MAX_ROUNDS", "MIN_ROUNDS", "Race", "race", "safe_choice"]

BACKEND = "backend"  # as in flatcomm.autotune.tuner
MARGIN = 0.05
MIN_ROUNDS = 3
MAX_ROUNDS = 8
MAX_NUMEL = 1 << 25  # larger collectives are raced at this size: both sides scale alike


@dataclasses.dataclass
class Race:
    candidate: str
    safe: str
    candidate_s: List[float]  # the slowest rank's seconds, per round
    safe_s: List[float]
    winner: str

    def describe(self) -> str:
        def ms(ts: List[float]) -> str:
            return f"{min(ts) * 1e3:.3g}-{max(ts) * 1e3:.3g} ms"

        verdict = ("faster beyond the spread" if self.winner == self.candidate
                   else "not faster beyond the spread: kept " + self.safe)
        return (f"raced {len(self.candidate_s)} rounds: {self.candidate} {ms(self.candidate_s)}, "
                f"{self.safe} {ms(self.safe_s)}; {self.candidate} {verdict}")


def safe_choice(deterministic: bool, kind: str) -> str:
    """What auto keeps when it cannot tell: the backend's own all-reduce where the caller did not
    ask for determinism, else the most precise codec."""
    return BACKEND if not deterministic and kind == "all_reduce" else "fp32"


def _runner(codec: str, kind: str, numel: int, world: int, group, device: torch.device) -> Callable[[], object]:
    x = torch.randn(numel, generator=torch.Generator().manual_seed(0)).to(device)
    if codec == BACKEND:
        return lambda: dist.all_reduce(x, group=group)
    lossy = not Codec(codec).lossless
    if kind == "all_reduce":
        ef = ErrorFeedback.zeros(numel, device) if lossy else None
        return lambda: route.all_reduce(x, CallSpec(codec=codec, residual=ef, validate=False), group)
    shard = torch.empty(numel // world, device=device)
    src = x[:shard.numel() * world]
    r = torch.zeros(src.numel(), device=device) if lossy else None
    return lambda: flat.reduce_scatter(shard, src, CallSpec(codec=codec, residual=r, validate=False), group)


def _timed(fn: Callable[[], object], device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0


def _verdict(cand: List[float], safe: List[float], candidate: str, safe_name: str) -> Optional[str]:
    if len(cand) < MIN_ROUNDS:
        return None
    if max(cand) * (1.0 + MARGIN) < min(safe):
        return candidate
    if min(cand) >= max(safe):
        return safe_name
    return safe_name if len(cand) >= MAX_ROUNDS else None


def race(candidate: str, safe: str, numel: int, group, device: Optional[torch.device] = None,
         kind: str = "all_reduce") -> Race:
    """Time ``candidate`` against ``safe`` (see the module docstring). A collective on ``group``:
    call it on every rank at the same point, on the group's worker thread."""
    device = torch.device(device) if device is not None else torch.device("cpu")
    world = dist.get_world_size(group)
    n = max(world, min(numel, MAX_NUMEL))
    run_c = _runner(candidate, kind, n, world, group, device)
    run_s = _runner(safe, kind, n, world, group, device)
    run_c()  # warm-up: buffers, pools, connections
    run_s()
    cand: List[float] = []
    safe_s: List[float] = []
    winner = None
    while winner is None:
        # Alternate which goes first, so that drift over the race hits both alike.
        first, second = (run_c, run_s) if len(cand) % 2 == 0 else (run_s, run_c)
        a, b = _timed(first, device), _timed(second, device)
        tc, ts = (a, b) if first is run_c else (b, a)
        t = torch.tensor([tc, ts], dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)  # the slowest rank, the same on every rank
        cand.append(float(t[0]))
        safe_s.append(float(t[1]))
        winner = _verdict(cand, safe_s, candidate, safe)
    return Race(candidate, safe, cand, safe_s, winner)

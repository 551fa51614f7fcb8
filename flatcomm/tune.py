"""Pick a codec per all-reduce from a measured cost model.

Precision order (most precise first): ``fp32 > bf16 > int8 > int4 > sign``. An ``error_budget``
names the least precise codec allowed: ``error_budget="int4"`` allows fp32, bf16, int8 and int4.

Cost model, for an all-reduce of ``numel`` fp32 values over ``W`` ranks with codec ``c``::

    time(c) = 2 * 4 * numel / compute_Bps[c]                  # encode + decode(-sum), both stages
            + 2 * wire_bytes(c, numel) * (W - 1) / W / link_Bps  # what one rank sends
            + 2 * chunks(c) * latency_s                       # one all_to_all + one all_gather per chunk

``compute_Bps[c]`` is fp32 input bytes per second of one ``encode`` + one ``decode_sum`` (a local
microbenchmark on 1M values, cached per device). ``link_Bps`` and ``latency_s`` are fitted from
timed ``all_to_all_single`` calls of two sizes on the group. Every measured time is MAX-reduced
over the group (the slowest rank), so every rank holds the same :class:`CostModel` and
:func:`decide` (a pure function) makes the same choice everywhere.

Rule: the fastest predicted codec within the budget, except that any codec within 5% of the
fastest time wins if it is more precise (so plain fp32 is kept when compression does not pay).

    tuner = Tuner(error_budget="int4", pinned={"0-65536": "fp32"})
    d = tuner.choose(numel, group=group)      # a collective the first time (measures)
    all_reduce(t, codec=d.codec, chunks=d.chunks, group=group)
"""
from __future__ import annotations

import dataclasses
import math
import re
import time
from typing import Dict, Mapping, Optional, Tuple

import torch
import torch.distributed as dist

from . import collectives as C
from .codecs import Codec, decode_sum, encode

__all__ = ["PRECISION", "CostModel", "Decision", "Tuner", "allowed", "decide", "measure", "predict"]

PRECISION = ("fp32", "bf16", "int8", "int4", "sign")  # most precise first
NEAR_TIE = 0.05
BENCH_NUMEL = 1 << 20
_compute_cache: Dict[Tuple[str, str], float] = {}


@dataclasses.dataclass(frozen=True)
class CostModel:
    """link_Bps: link bandwidth (bytes/s one rank sends); latency_s: per collective;
    compute_Bps: codec -> fp32 bytes/s of encode + decode_sum (``inf`` = free)."""

    link_Bps: float
    latency_s: float
    compute_Bps: Mapping[str, float]


@dataclasses.dataclass(frozen=True)
class Decision:
    codec: str
    chunks: int
    reason: str
    predicted_s: Dict[str, float]


def allowed(error_budget: str) -> Tuple[str, ...]:
    """Codecs at least as precise as ``error_budget`` (see :data:`PRECISION`)."""
    if error_budget not in PRECISION:
        raise ValueError(f"flatcomm: error_budget must be one of {PRECISION}, got {error_budget!r}")
    return PRECISION[:PRECISION.index(error_budget) + 1]


def _chunks(codec: str, numel: int, world: int) -> int:
    return C._auto_chunks(max(1, numel // world), Codec(codec), world, "ordered")


def predict(costs: CostModel, codec: str, numel: int, world: int) -> float:
    """Predicted seconds of an ordered all-reduce of ``numel`` fp32 values with ``codec``."""
    bps = costs.compute_Bps[codec]
    compute = 0.0 if math.isinf(bps) else 2.0 * 4.0 * numel / bps
    wire = 2.0 * Codec(codec).wire_bytes(numel) * (world - 1) / world / costs.link_Bps if world > 1 else 0.0
    lat = 2.0 * _chunks(codec, numel, world) * costs.latency_s if world > 1 else 0.0
    return compute + wire + lat


def decide(costs: CostModel, numel: int, world: int, error_budget: str = "int8") -> Decision:
    """Pure: the codec for ``numel`` values on ``world`` ranks under ``costs`` and the budget."""
    cands = [c for c in allowed(error_budget) if c in costs.compute_Bps]
    if "fp32" not in cands:
        cands.insert(0, "fp32")
    pred = {c: predict(costs, c, numel, world) for c in cands}
    fastest = min(cands, key=lambda c: pred[c])
    best = next(c for c in cands if pred[c] <= pred[fastest] * (1.0 + NEAR_TIE))  # most precise near-tie
    times = ", ".join(f"{c}={pred[c] * 1e3:.3g}ms" for c in cands)
    if best == fastest:
        why = f"{best} fastest"
    else:
        why = f"{best} within {NEAR_TIE:.0%} of fastest {fastest} and more precise"
    reason = (f"{why} for numel={numel} W={world} budget={error_budget} "
              f"(link {costs.link_Bps / 1e9:.3g} GB/s, latency {costs.latency_s * 1e6:.3g}us); predicted: {times}")
    return Decision(best, _chunks(best, numel, world), reason, pred)


# ---- measurement ----------------------------------------------------------------------------------

def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _compute_Bps(codec: str, device: torch.device, numel: int = BENCH_NUMEL, reps: int = 3) -> float:
    key = (codec, str(device))
    if key not in _compute_cache:
        x = torch.randn(numel, generator=torch.Generator().manual_seed(0)).to(device)
        best = math.inf
        for _ in range(reps + 1):  # the first is a warm-up
            _sync(device)
            t0 = time.perf_counter()
            p = encode(x, codec)
            decode_sum(p.view(1, -1), codec, numel)
            _sync(device)
            best = min(best, time.perf_counter() - t0)
        _compute_cache[key] = 4.0 * numel / max(best, 1e-9)
    return _compute_cache[key]


def _time_a2a(nbytes: int, world: int, group, device: torch.device, reps: int = 3) -> float:
    per = max(1, nbytes // world)
    send = torch.zeros(per * world, dtype=torch.uint8, device=device)
    recv = torch.empty_like(send)
    best = math.inf
    for _ in range(reps + 1):
        _sync(device)
        t0 = time.perf_counter()
        dist.all_to_all_single(recv, send, group=group)
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return best


def _on_worker(group, fn):
    """Run ``fn`` on flatcomm's worker thread of ``group`` (keeps the collective order)."""
    if getattr(C._worker, "key", object()) == C._group_key(group):
        return fn()
    return C._executor(group).submit(fn).result()


def measure(group=None, *, device: Optional[torch.device] = None, codecs=PRECISION,
            small: int = 4 << 10, large: int = 4 << 20) -> CostModel:
    """Measure a :class:`CostModel` on ``group`` (a collective: call on every rank, same args)."""
    device = torch.device(device) if device is not None else torch.device("cpu")
    world = dist.get_world_size(group) if dist.is_initialized() else 1

    def body():
        secs = [4.0 * BENCH_NUMEL / _compute_Bps(c, device) for c in codecs]
        t_small = _time_a2a(small, world, group, device) if world > 1 else 0.0
        t_large = _time_a2a(large, world, group, device) if world > 1 else 0.0
        t = torch.tensor(secs + [t_small, t_large], dtype=torch.float64, device=device)
        if world > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)  # the slowest rank, on every rank
        return t.cpu().tolist()

    vals = _on_worker(group, body) if world > 1 else body()
    compute = {c: 4.0 * BENCH_NUMEL / max(s, 1e-12) for c, s in zip(codecs, vals)}
    t_small, t_large = vals[-2], vals[-1]
    frac = (world - 1) / world if world > 1 else 1.0
    b_small, b_large = small * frac, large * frac  # bytes one rank sends
    dt = t_large - t_small
    link = (b_large - b_small) / dt if dt > 0 else math.inf
    lat = max(0.0, t_small - b_small / link) if math.isfinite(link) else t_small
    if not math.isfinite(link):  # the large call was no slower: bound it by the large call alone
        link = b_large / max(t_large, 1e-9)
    return CostModel(link_Bps=link, latency_s=lat, compute_Bps=compute)


_RANGE = re.compile(r"^\s*(\d*)\s*-\s*(\d*)\s*$")


class Tuner:
    """Chooses a codec per all-reduce: pinned entries first, else :func:`decide` on measured costs.

    error_budget: least precise codec allowed (see :data:`PRECISION`).
    pinned: ``{key: codec}`` where key is an exact bucket key string (the ``key=`` passed to
        :meth:`choose`; flatcomm.ddp passes ``"bucket<index>"``) or a numel range ``"lo-hi"``
        (lo inclusive, hi exclusive, either side may be empty). Pinned codecs bypass the budget.
    codec: a codec name other than ``"auto"`` pins every choice.
    costs: a :class:`CostModel` to use instead of measuring.
    """

    def __init__(self, error_budget: str = "int8", *, pinned: Optional[Mapping[str, str]] = None,
                 codec: str = "auto", costs: Optional[CostModel] = None):
        allowed(error_budget)
        self.error_budget = error_budget
        self.codec = codec
        if codec != "auto":
            Codec(codec)
        self.pinned = dict(pinned or {})
        for v in self.pinned.values():
            Codec(v)
        self.costs = costs

    def _pin(self, numel: int, key: Optional[str]) -> Optional[Tuple[str, str]]:
        if self.codec != "auto":
            return self.codec, "codec="
        if key is not None and key in self.pinned:
            return self.pinned[key], f"pinned[{key!r}]"
        for k, v in self.pinned.items():
            m = _RANGE.match(k)
            if m and (not m.group(1) or numel >= int(m.group(1))) and (not m.group(2) or numel < int(m.group(2))):
                return v, f"pinned[{k!r}]"
        return None

    def choose(self, numel: int, *, error_budget: Optional[str] = None, key: Optional[str] = None,
               group=None, device: Optional[torch.device] = None) -> Decision:
        """The codec for ``numel`` values. The first unpinned call measures (a collective on ``group``)."""
        world = dist.get_world_size(group) if dist.is_initialized() else 1
        pin = self._pin(numel, key)
        if pin is not None:
            return Decision(pin[0], _chunks(pin[0], numel, world), f"{pin[0]} by {pin[1]}", {})
        if self.costs is None:
            self.costs = measure(group, device=device)
        return decide(self.costs, numel, world, error_budget or self.error_budget)

"""Pick a codec per collective from a measured cost model (the engine behind ``codec="auto"``).

Precision order (most precise first): ``fp32 > bf16 > int8 > int4 > sign``. An ``error_budget``
names the least precise codec allowed: ``error_budget="int4"`` allows fp32, bf16, int8 and int4.

Cost model, for a collective of ``numel`` fp32 input values over ``W`` ranks with codec ``c``::

    all_reduce:     time(c) = numel / ar_compute[c] + 2 wire(c) + 2 chunks(c) latency
    reduce_scatter: time(c) = numel / rs_compute[c] +   wire(c) +   chunks(c) latency
    wire(c) = wire_bytes(c, numel) * (W - 1) / W / link_Bps      # what one rank sends per stage

``link_Bps`` and ``latency_s`` are fitted from timed ``all_to_all_single`` calls of two sizes
(every rank sends and receives at once, as in the collectives). ``ar_compute`` / ``rs_compute``
(fp32 input bytes per second) cover everything else the collective does on this rank: the real
collective is timed once per codec on ``BENCH_NUMEL`` values, with error feedback for lossy codecs
(encode + residual, decode-and-sum with the re-encode and server residual, decode of the gathered
shards, staging copies, thread hand-off), and the modelled wire and latency time is subtracted.
Every measured time is MAX-reduced over the group (the slowest rank), so every rank holds the same
:class:`CostModel` and :func:`decide` (a pure function) makes the same choice everywhere.

Rule: the fastest predicted codec within the budget, except that any codec within 5% of the
fastest time wins if it is more precise (so plain fp32 is kept when compression does not pay).

    tuner = Tuner(error_budget="int4", pinned={"0-65536": "fp32"})
    d = tuner.choose(numel, group=group)      # a collective the first time (measures)
    all_reduce(t, codec=d.codec, chunks=d.chunks, group=group)
    all_reduce(t, codec="auto", tuner=tuner, group=group)    # the same, inside the collective

This module sits above :mod:`flatcomm.collectives` and registers :func:`tuner_for` there for
``codec="auto"`` (``import flatcomm`` imports it);
:mod:`flatcomm.tools.tune` (``python -m flatcomm.tune``) is the command-line tool built on it.
"""
from __future__ import annotations

import dataclasses
import math
import re
import threading
import time
from typing import Callable, Dict, Mapping, Optional, Tuple

import torch
import torch.distributed as dist

from . import collectives as C
from .codecs import Codec

__all__ = ["PRECISION", "KINDS", "CostModel", "Decision", "Tuner", "allowed", "decide", "measure",
           "predict", "tuner_for"]

PRECISION = ("fp32", "bf16", "int8", "int4", "sign")  # most precise first
KINDS = ("all_reduce", "reduce_scatter")
NEAR_TIE = 0.05
BENCH_NUMEL = 1 << 23  # 32 MB: past the caches, so per-value costs are those of large buckets


@dataclasses.dataclass(frozen=True)
class CostModel:
    """link_Bps: link bandwidth (bytes/s one rank sends); latency_s: per collective call;
    compute_Bps: codec -> fp32 input bytes/s of this rank's all-reduce pipeline (``inf`` = free);
    rs_compute_Bps: the same for the reduce-scatter pipeline (default: twice ``compute_Bps``)."""

    link_Bps: float
    latency_s: float
    compute_Bps: Mapping[str, float]
    rs_compute_Bps: Optional[Mapping[str, float]] = None


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


def _check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"flatcomm: kind must be one of {KINDS}, got {kind!r}")


def _chunks(codec: str, numel: int, world: int, kind: str = "all_reduce") -> int:
    """The chunk count the collective picks by itself for this codec and size (fp32 data)."""
    return C._default_chunks(max(1, numel // world), Codec(codec), world, "ordered", torch.float32, kind)


def predict(costs: CostModel, codec: str, numel: int, world: int, kind: str = "all_reduce") -> float:
    """Predicted seconds of an ordered ``kind`` of ``numel`` fp32 input values with ``codec``."""
    _check_kind(kind)
    compute, wire = _parts(costs, codec, numel, world, kind)
    if world <= 1:
        return compute
    stages = 2.0 if kind == "all_reduce" else 1.0
    return compute + wire + stages * _chunks(codec, numel, world, kind) * costs.latency_s


def _parts(costs: CostModel, codec: str, numel: int, world: int, kind: str) -> Tuple[float, float]:
    """(compute, wire) seconds of ``kind`` on ``numel`` values with ``codec``."""
    stages = 2.0 if kind == "all_reduce" else 1.0
    if kind == "all_reduce" or costs.rs_compute_Bps is None:
        bps = costs.compute_Bps[codec] * (1.0 if kind == "all_reduce" else 2.0)
    else:
        bps = costs.rs_compute_Bps[codec]
    compute = 0.0 if math.isinf(bps) else 4.0 * numel / bps
    wire = stages * Codec(codec).wire_bytes(numel) * (world - 1) / world / costs.link_Bps if world > 1 else 0.0
    return compute, wire


def decide(costs: CostModel, numel: int, world: int, error_budget: str = "int8",
           kind: str = "all_reduce") -> Decision:
    """Pure: the codec for ``numel`` values on ``world`` ranks under ``costs`` and the budget."""
    cands = [c for c in allowed(error_budget) if c in costs.compute_Bps]
    if "fp32" not in cands:
        cands.insert(0, "fp32")
    pred = {c: predict(costs, c, numel, world, kind) for c in cands}
    fastest = min(cands, key=lambda c: pred[c])
    best = next(c for c in cands if pred[c] <= pred[fastest] * (1.0 + NEAR_TIE))  # most precise near-tie
    times = ", ".join(f"{c}={pred[c] * 1e3:.3g}ms" for c in cands)
    if best == fastest:
        why = f"{best} fastest"
    else:
        why = f"{best} within {NEAR_TIE:.0%} of fastest {fastest} and more precise"
    op = "" if kind == "all_reduce" else f" {kind}"
    reason = (f"{why} for{op} numel={numel} W={world} budget={error_budget} "
              f"(link {costs.link_Bps / 1e9:.3g} GB/s, latency {costs.latency_s * 1e6:.3g}us); predicted: {times}")
    chunks = _chunks(best, numel, world, kind)
    compute, wire = _parts(costs, best, numel, world, kind)
    if best == "fp32" and chunks > 1 and wire < compute:
        # fp32 goes out of the caller's tensor in one chunk, without a staging copy; that wins when
        # the wire is not the bottleneck (loopback: 28% faster), chunks win on slow links.
        chunks = 1
        reason += "; one zero-copy chunk (the wire is faster than the compute)"
    return Decision(best, chunks, reason, pred)


# ---- measurement ----------------------------------------------------------------------------------

def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _best_of(fn: Callable[[], None], device: torch.device, reps: int) -> float:
    best = math.inf
    for _ in range(reps + 1):  # the first is a warm-up
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return max(best, 1e-9)


def _time_a2a(nbytes: int, world: int, group, device: torch.device, reps: int = 3) -> float:
    per = max(1, nbytes // world)
    send = torch.zeros(per * world, dtype=torch.uint8, device=device)
    recv = torch.empty_like(send)
    return _best_of(lambda: dist.all_to_all_single(recv, send, group=group), device, reps)


def _on_worker(group, fn):
    """Run ``fn`` on flatcomm's worker thread of ``group`` (keeps the collective order)."""
    if getattr(C._worker, "key", object()) == C._group_key(group):
        return fn()
    return C._executor(group).submit(fn).result()


def _time_codecs(codecs, numel: int, world: int, group, device: torch.device, reps: int) -> list:
    """Per kind and codec, seconds of the real collective on ``numel`` values (lossy codecs with
    error feedback, as the integrations run them). Called on the group's worker thread."""
    x = torch.randn(numel, generator=torch.Generator().manual_seed(0)).to(device)
    shard = torch.empty(numel // world, device=device)
    src = x[:shard.numel() * world]
    out = []
    for kind in KINDS:
        for c in codecs:
            lossy = not Codec(c).lossless
            if kind == "all_reduce":
                ef = C.ErrorFeedback.zeros(numel, device) if lossy else None
                fn = lambda: C.all_reduce(x, codec=c, residual=ef, group=group, validate=False)  # noqa: E731
            else:
                r = torch.zeros(src.numel(), device=device) if lossy else None
                fn = lambda: C.reduce_scatter(shard, src, codec=c, residual=r, group=group,  # noqa: E731
                                              validate=False)
            out.append(_best_of(fn, device, reps))
    return out


def measure(group=None, *, device: Optional[torch.device] = None, codecs=PRECISION,
            small: int = 4 << 10, large: int = 4 << 20, numel: int = BENCH_NUMEL, reps: int = 2) -> CostModel:
    """Measure a :class:`CostModel` on ``group`` (a collective: call on every rank, same args)."""
    device = torch.device(device) if device is not None else torch.device("cpu")
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    if world == 1:  # nothing to send: compression never pays
        return CostModel(math.inf, 0.0, {c: math.inf for c in codecs}, {c: math.inf for c in codecs})
    group = C.private_group(group)  # time the group the collectives will use, on its worker

    def body():
        t = [_time_a2a(small, world, group, device), _time_a2a(large, world, group, device)]
        t += _time_codecs(codecs, numel, world, group, device, reps)
        t = torch.tensor(t, dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)  # the slowest rank, on every rank
        # The timed runs' staging buffers (BENCH_NUMEL-sized) must not stay pooled next to the
        # real ones: drop them (the group's pool is refilled by its next collective).
        C._pools.pop(C._group_key(group), None)
        return t.cpu().tolist()

    vals = _on_worker(group, body)
    t_small, t_large = vals[0], vals[1]
    frac = (world - 1) / world
    b_small, b_large = small * frac, large * frac  # bytes one rank sends
    dt = t_large - t_small
    link = (b_large - b_small) / dt if dt > 0 else math.inf
    lat = max(0.0, t_small - b_small / link) if math.isfinite(link) else t_small
    if not math.isfinite(link):  # the large call was no slower: bound it by the large call alone
        link = b_large / max(t_large, 1e-9)
    # Compute = measured collective - its modelled wire and latency time (at least 1% of it).
    net = CostModel(link, lat, {c: math.inf for c in codecs}, {c: math.inf for c in codecs})
    bps = []
    for i, (kind, c) in enumerate((k, c) for k in KINDS for c in codecs):
        t = vals[2 + i]
        local = max(t - predict(net, c, numel, world, kind), 0.01 * t)
        bps.append(4.0 * numel / local)
    n = len(codecs)
    return CostModel(link_Bps=link, latency_s=lat, compute_Bps=dict(zip(codecs, bps[:n])),
                     rs_compute_Bps=dict(zip(codecs, bps[n:])))


_RANGE = re.compile(r"^\s*(\d*)\s*-\s*(\d*)\s*$")


class Tuner:
    """Chooses a codec per collective: pinned entries first, else :func:`decide` on measured costs.

    error_budget: least precise codec allowed (see :data:`PRECISION`).
    pinned: ``{key: codec}`` where key is an exact bucket key string (the ``key=`` passed to
        :meth:`choose`; flatcomm.ddp passes ``"bucket<index>"``) or a numel range ``"lo-hi"``
        (lo inclusive, hi exclusive, either side may be empty). Pinned codecs bypass the budget.
    codec: a codec name other than ``"auto"`` pins every choice.
    costs: a :class:`CostModel` to use instead of measuring.

    ``decisions`` maps ``(kind, numel)`` to the unpinned :class:`Decision` made for it (decided once,
    then reused; the cost model is measured once, at the first unpinned choice).
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
        self.decisions: Dict[Tuple[str, int], Decision] = {}  # unpinned choices, by (kind, numel)

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
               group=None, device: Optional[torch.device] = None, kind: str = "all_reduce") -> Decision:
        """The codec for ``numel`` values. The first unpinned call measures (a collective on ``group``:
        every rank must make its first unpinned choice at the same point)."""
        _check_kind(kind)
        world = dist.get_world_size(group) if dist.is_initialized() else 1
        pin = self._pin(numel, key)
        if pin is not None:
            return Decision(pin[0], _chunks(pin[0], numel, world, kind), f"{pin[0]} by {pin[1]}", {})
        budget = error_budget or self.error_budget
        d = self.decisions.get((kind, numel)) if budget == self.error_budget else None
        if d is None:
            if self.costs is None:
                self.costs = measure(group, device=device)
            d = decide(self.costs, numel, world, budget, kind)
            if budget == self.error_budget:
                self.decisions[(kind, numel)] = d
        return d


_default_tuners: Dict[object, Tuner] = {}
_default_lock = threading.Lock()


def tuner_for(group=None) -> Tuner:
    """The process-wide default :class:`Tuner` of ``group`` (error budget int8), created on first use."""
    key = C._group_key(group)
    with _default_lock:
        t = _default_tuners.get(key)
        if t is None:
            t = _default_tuners[key] = Tuner()
        return t


C._default_tuner_for = tuner_for  # codec="auto" in the collectives (which cannot import this module)

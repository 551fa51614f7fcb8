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

The backend's own all-reduce (``"backend"``: ``dist.all_reduce``, gloo's or NCCL's algorithm, fp32)
is a candidate only where the caller did not ask for determinism (``choose(..., deterministic=
False)``; the DDP hook's ``codec="auto"`` without an explicit ``mode``). It is modelled from two timed
all-reduces (latency + bytes / bandwidth) and ranks first among near ties: compression has to beat
it by more than 5% to be chosen, so ``auto`` does not lose to the default hook by more than the
model's error.

Reproducible decisions: a :class:`CostModel` saved with :func:`save_profile` (``python -m
flatcomm.tune --save profile.json``) and loaded with ``Tuner(profile=...)`` gives the same decisions
on every run (:func:`decide` is pure). Without one, the model is measured (MAX-agreed, so the same
on every rank); either way each new decision is checked across the group (a tiny all-reduce of its
hash: ranks that loaded different profiles get a ``ValueError``, not a hang) and logged once, on
rank 0, to the ``flatcomm.autotune`` logger.

    tuner = Tuner(error_budget="int4", pinned={"0-65536": "fp32"})
    d = tuner.choose(numel, group=group)      # a collective the first time (measures)
    all_reduce(t, codec=d.codec, chunks=d.chunks, group=group)
    all_reduce(t, codec="auto", tuner=tuner, group=group)    # the same, inside the collective

This package sits above the machinery (:mod:`flatcomm.comm`: it times those collectives) and below
:mod:`flatcomm.collectives`, which asks :func:`tuner_for` for ``codec="auto"``;
:mod:`flatcomm.tools.tune` (``python -m flatcomm.tune``) is the command-line tool built on it.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import re
import threading
import time
import zlib
from typing import Any, Callable, Dict, Mapping, Optional, Tuple

import torch
import torch.distributed as dist

from . import race as R, tiers as T
from .costs import CostModel, Decision
from .profiles import ProfileLike, load_profile, save_profile
from ..comm import flat, pipeline, worker
from ..comm.args import ErrorFeedback
from ..comm.groups import private_group
from ..comm.two_level import default_segments
from ..ops.codecs import PRECISION, Codec

__all__ = ["BACKEND", "PRECISION", "KINDS", "CostModel", "Decision", "Tuner", "allowed", "decide",
           "load_profile", "measure", "predict", "save_profile", "tuner_for"]

log = logging.getLogger("flatcomm.autotune")

BACKEND = "backend"  # the backend's own fp32 all-reduce (not deterministic by flatcomm's standard)
KINDS = ("all_reduce", "reduce_scatter")
NEAR_TIE = 0.05
BENCH_NUMEL = 1 << 23  # 32 MB: past the caches, so per-value costs are those of large buckets


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
    return pipeline.default_chunks(max(1, numel // world), Codec(codec), world, "ordered", torch.float32, kind)


def predict(costs: CostModel, codec: str, numel: int, world: int, kind: str = "all_reduce") -> float:
    """Predicted seconds of an ordered ``kind`` of ``numel`` fp32 input values with ``codec``
    (or of the backend's own all-reduce for ``codec="backend"``)."""
    _check_kind(kind)
    if codec == BACKEND:
        if kind != "all_reduce" or costs.backend_Bps is None or costs.backend_latency_s is None:
            raise ValueError(f"flatcomm: no backend cost for {kind} in this CostModel")
        return 0.0 if world <= 1 else costs.backend_latency_s + 4.0 * numel / costs.backend_Bps
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
           kind: str = "all_reduce", deterministic: bool = True, *, paths: Optional[Tuple[str, ...]] = None,
           intra_budget: str = "fp32", segments: Optional[int] = None) -> Decision:
    """Pure: the codec for ``numel`` values on ``world`` ranks under ``costs`` and the budget;
    ``deterministic=False`` adds the backend's own all-reduce (first among near ties).

    ``paths`` (a Topology's all-reduce: some of ``("flat", "hierarchical")``): with per-tier costs
    in ``costs`` the path and a codec per tier are chosen as well, by :mod:`flatcomm.autotune.costmodel`
    (see :mod:`flatcomm.autotune.tiers`); ``intra_budget`` is the least precise node-tier codec
    allowed (default lossless), never less precise than ``error_budget``; ``segments``: the
    hierarchical pipeline's segment count (default: the model's best)."""
    if paths is not None and kind == "all_reduce" and T.tiered(costs):
        return _decide_tiered(costs, numel, world, error_budget, deterministic, paths, intra_budget, segments)
    cands = [c for c in allowed(error_budget) if c in costs.compute_Bps]
    if "fp32" not in cands:
        cands.insert(0, "fp32")
    if not deterministic and kind == "all_reduce" and costs.backend_Bps is not None and world > 1:
        cands.insert(0, BACKEND)
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
    if best == BACKEND:
        return Decision(best, 1, reason + "; the backend's own all-reduce (not flatcomm's same-bits sum)", pred)
    chunks = _chunks(best, numel, world, kind)
    compute, wire = _parts(costs, best, numel, world, kind)
    if best == "fp32" and chunks > 1 and wire < compute:
        # fp32 goes out of the caller's tensor in one chunk, without a staging copy; that wins when
        # the wire is not the bottleneck (loopback: 28% faster), chunks win on slow links.
        chunks = 1
        reason += "; one zero-copy chunk (the wire is faster than the compute)"
    return Decision(best, chunks, reason, pred)


def _decide_tiered(costs: CostModel, numel: int, world: int, error_budget: str, deterministic: bool,
                   paths: Tuple[str, ...], intra_budget: str, segments: Optional[int] = None) -> Decision:
    if costs.nodes * costs.ranks_per_node != world:
        raise ValueError(f"flatcomm auto: the costs were measured on {costs.nodes} nodes x "
                         f"{costs.ranks_per_node} ranks but the group has {world} ranks")
    bad = set(paths) - set(T.PATHS)
    if bad or not paths:
        raise ValueError(f"flatcomm: paths must be some of {T.PATHS}, got {paths!r}")
    inter = [c for c in allowed(error_budget) if c in costs.compute_Bps]
    intra = [c for c in allowed(intra_budget) if c in allowed(error_budget) and c in costs.compute_Bps] or ["fp32"]
    pred = {T.name(k): (k, v) for k, v in T.predict(costs, numel, inter or ["fp32"], intra, paths, segments).items()}
    if not deterministic and costs.backend_Bps is not None:
        pred = {BACKEND: ((BACKEND, "fp32", "fp32"), predict(costs, BACKEND, numel, world)), **pred}
    times = {n: t for n, (_, t) in pred.items()}
    fastest = min(times, key=times.__getitem__)
    best = next(n for n in times if times[n] <= times[fastest] * (1.0 + NEAR_TIE))  # most precise near-tie
    why = f"{best} fastest" if best == fastest else \
        f"{best} within {NEAR_TIE:.0%} of fastest {fastest} and more precise"
    listed = ", ".join(f"{n}={t * 1e3:.3g}ms" for n, t in times.items())
    reason = (f"{why} for numel={numel} on {costs.nodes}x{costs.ranks_per_node} budget={error_budget} "
              f"intra budget={intra_budget} (inter {(costs.inter_Bps or 0.0) / 1e9:.3g} GB/s/node, intra "
              f"{(costs.intra_Bps or 0.0) / 1e9:.3g} GB/s/rank); predicted: {listed}")
    path, c, ci = pred[best][0]
    if path == BACKEND:
        return Decision(BACKEND, 1, reason + "; the backend's own all-reduce (not flatcomm's same-bits sum)",
                        times, path=BACKEND)
    if path == "flat":
        return Decision(c, _chunks(c, numel, world), reason, times, path="flat")
    return Decision(c, T.segments(numel, costs, c, ci, segments), reason, times, path="hierarchical",
                    intra_codec=ci)


# ---- measurement ----------------------------------------------------------------------------------

def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _best_of(fn: Callable[[], object], device: torch.device, reps: int) -> float:
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
    return worker.call(worker.key_of(group), fn)


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
                ef = ErrorFeedback.zeros(numel, device) if lossy else None
                fn = lambda: flat.all_reduce(x, codec=c, residual=ef, group=group, validate=False)  # noqa: E731
            else:
                r = torch.zeros(src.numel(), device=device) if lossy else None
                fn = lambda: flat.reduce_scatter(shard, src, codec=c, residual=r, group=group,  # noqa: E731
                                                 validate=False)
            out.append(_best_of(fn, device, reps))
    return out


def _time_tiers(topology, device: torch.device, small: int, large: int) -> list:
    """[intra small, intra large, inter small, inter large] seconds: all-to-alls inside every node
    at once, then among same-local-rank ranks of every node at once (the G exchanges of a node
    share its link, as in the hierarchical all-reduce), each on its tier group's worker."""
    out = []
    for sub, members in ((topology.intra_group, topology.local_size), (topology.inter_group, topology.nodes)):
        pg = private_group(sub)
        out += _on_worker(pg, lambda: [_time_a2a(b, members, pg, device) for b in (small, large)])
    return out


def _tier_costs(topology, vals: list, small: int, large: int) -> dict:
    g, n = topology.local_size, topology.nodes
    intra = _fit(small * (g - 1) / g, vals[0], large * (g - 1) / g, vals[1])  # bytes one rank sends
    inter = _fit(small * g * (n - 1) / n, vals[2], large * g * (n - 1) / n, vals[3])  # bytes one node sends
    return {"nodes": n, "ranks_per_node": g, "intra_latency_s": intra[0], "intra_Bps": intra[1],
            "inter_latency_s": inter[0], "inter_Bps": inter[1]}


def measure(group=None, *, device: Optional[torch.device] = None, codecs=PRECISION,
            small: int = 4 << 10, large: int = 4 << 20, numel: int = BENCH_NUMEL, reps: int = 2,
            topology=None) -> CostModel:
    """Measure a :class:`CostModel` on ``group`` (a collective: call on every rank, same args).
    ``topology`` (a hierarchical :class:`flatcomm.Topology` over ``group``): also the per-tier link
    costs, for topology-aware decisions."""
    device = torch.device(device) if device is not None else torch.device("cpu")
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    if world == 1:  # nothing to send: compression never pays
        return CostModel(math.inf, 0.0, {c: math.inf for c in codecs}, {c: math.inf for c in codecs})
    two_level = topology is not None and not topology.flat
    tier_t = _time_tiers(topology, device, small, large) if two_level else []
    group = private_group(group)  # time the group the collectives will use, on its worker

    def body():
        t = [_time_a2a(small, world, group, device), _time_a2a(large, world, group, device)]
        t += [_time_backend(small // 4, group, device), _time_backend(numel, group, device, reps)]
        t += _time_codecs(codecs, numel, world, group, device, reps) + tier_t
        t = torch.tensor(t, dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)  # the slowest rank, on every rank
        # The timed runs' staging buffers (BENCH_NUMEL-sized) must not stay pooled next to the
        # real ones: drop them (the group's pool is refilled by its next collective).
        pipeline.forget_pool(group)
        return t.cpu().tolist()

    vals = _on_worker(group, body)
    tiers = {}
    if two_level:  # MAX-agreed with the rest: every rank holds the same costs
        tiers = _tier_costs(topology, vals[-4:], small, large)
        tiers["shared_cores"] = device.type == "cpu"
        vals = vals[:-4]
    t_small, t_large = vals[0], vals[1]
    b_lat, b_bps = _fit(4 * (small // 4), vals[2], 4 * numel, vals[3])
    vals = vals[:2] + vals[4:]
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
                     rs_compute_Bps=dict(zip(codecs, bps[n:])), backend_Bps=b_bps, backend_latency_s=b_lat,
                     **tiers)


def _time_backend(numel: int, group, device: torch.device, reps: int = 3) -> float:
    x = torch.zeros(max(1, numel), device=device)
    return _best_of(lambda: dist.all_reduce(x, group=group), device, reps)


def _fit(b_small: float, t_small: float, b_large: float, t_large: float) -> Tuple[float, float]:
    """(latency s, bytes/s) of ``t = latency + bytes / rate`` through two timed sizes."""
    dt = t_large - t_small
    rate = (b_large - b_small) / dt if dt > 0 else b_large / max(t_large, 1e-9)
    return max(0.0, min(t_small, t_large - b_large / rate)), rate


_RANGE = re.compile(r"^\s*(\d*)\s*-\s*(\d*)\s*$")


class Tuner:
    """Chooses a codec per collective: pinned entries first, else :func:`decide` on measured costs.

    error_budget: least precise codec allowed (see :data:`PRECISION`).
    pinned: ``{key: codec}`` where key is an exact bucket key string (the ``key=`` passed to
        :meth:`choose`; flatcomm.ddp passes ``"bucket<index>"``) or a numel range ``"lo-hi"``
        (lo inclusive, hi exclusive, either side may be empty). Pinned codecs bypass the budget.
    codec: a codec name other than ``"auto"`` pins every choice.
    costs: a :class:`CostModel` to use instead of measuring.
    profile: a saved profile (path or document, see :func:`save_profile`) to take ``costs`` from:
        the same decisions on every run.

    race: confirm each decision made from *measured* costs by timing it against the safe choice
        at its size until they separate (:mod:`flatcomm.autotune.race`); without separation the
        safe choice is kept. Decisions from ``costs``/``profile`` are never raced.
    verbose: log each new decision once, on rank 0: at WARNING (shown by default) the first one of
        each outcome (path and codecs), at INFO the rest; False: all at INFO.

    ``decisions`` maps ``(kind, numel)`` to the unpinned :class:`Decision` made for it (decided once,
    agreed across the group, logged once, then reused; without ``costs``/``profile`` the cost model
    is measured once, at the first unpinned choice); ``open_decisions`` holds those made with
    ``deterministic=False`` (the backend's all-reduce a candidate). For the same choice on every
    run, pin it: ``Tuner(profile="profile.json")`` (``python -m flatcomm.tune --save profile.json``).
    """

    def __init__(self, error_budget: str = "int8", *, pinned: Optional[Mapping[str, str]] = None,
                 codec: str = "auto", costs: Optional[CostModel] = None, profile: Optional[ProfileLike] = None,
                 intra_budget: str = "fp32", race: bool = True, verbose: bool = True):
        allowed(error_budget)
        allowed(intra_budget)
        self.intra_budget = intra_budget
        if profile is not None:
            if costs is not None:
                raise ValueError("flatcomm: Tuner takes costs= or profile=, not both")
            costs = load_profile(profile)
        self.error_budget = error_budget
        self.codec = codec
        if codec != "auto":
            Codec(codec)
        self.pinned = dict(pinned or {})
        for v in self.pinned.values():
            Codec(v)
        self.costs = costs
        self.race = race
        self.verbose = verbose
        self._measured = False  # the costs were measured here (not given): decisions are raced
        self._announced: set = set()  # the outcomes logged at WARNING (see _level)
        # unpinned choices, by (kind, numel) (+ the paths with a topology)
        self.decisions: Dict[Tuple[Any, ...], Decision] = {}
        self.open_decisions: Dict[Tuple[Any, ...], Decision] = {}  # the same with deterministic=False

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
               group=None, device: Optional[torch.device] = None, kind: str = "all_reduce",
               deterministic: bool = True, topology=None, paths: Optional[Tuple[str, ...]] = None) -> Decision:
        """The codec for ``numel`` values. Every new unpinned decision is a collective on ``group``
        (the first one also measures, unless costs were given): every rank must make its unpinned
        choices in the same order. ``deterministic=False`` lets the backend's own all-reduce compete.
        ``topology`` (a hierarchical :class:`flatcomm.Topology` over ``group``): the path (flat or
        hierarchical, or only those in ``paths``) and a codec per tier are chosen too (the costs
        are then measured with the tiers' link costs; a profile must hold them)."""
        _check_kind(kind)
        world = dist.get_world_size(group) if dist.is_initialized() else 1
        two_level = topology is not None and not topology.flat and kind == "all_reduce"
        paths = (tuple(paths) if paths is not None else T.PATHS) if two_level else None
        pin = self._pin(numel, key)
        if pin is not None:
            return Decision(pin[0], _chunks(pin[0], numel, world, kind), f"{pin[0]} by {pin[1]}", {})
        budget = error_budget or self.error_budget
        cache = self.decisions if deterministic else self.open_decisions
        ck = (kind, numel) if paths is None else (kind, numel, paths)  # flat keys as before
        d = cache.get(ck) if budget == self.error_budget else None
        if d is None:
            if self.costs is None:
                self.costs = measure(group, device=device, topology=topology if two_level else None)
                self._measured = True
            if two_level and not T.tiered(self.costs):
                raise ValueError(f"flatcomm auto: {topology!r} needs per-tier link costs, and this tuner's "
                                 "costs (profile) have none: measure them with the topology (`python -m "
                                 "flatcomm.tune --save` under torchrun sets LOCAL_WORLD_SIZE)")
            # On CPU the two-level path keeps its own segment count (by size; one where a lossy intra
            # codec may be picked, whose segments cost staging copies): the node tier's transfers
            # compete with the kernels for the same cores, which the model's overlap does not see.
            cpu = device is None or torch.device(device).type == "cpu"
            segments = None
            if cpu and two_level:
                segments = (default_segments(math.ceil(numel / topology.local_size), topology.nodes)
                            if self.intra_budget == "fp32" else 1)
            d = decide(self.costs, numel, world, budget, kind, deterministic, paths=paths,
                       intra_budget=self.intra_budget, segments=segments)
            if self.race and self._measured and world > 1:
                d = self._raced(d, numel, world, group, device, kind, deterministic)
            _agree(d, group, device)
            if budget == self.error_budget:
                cache[ck] = d
            if world <= 1 or dist.get_rank(group) == 0:
                log.log(self._level(d), "flatcomm auto: %s: %s (%s, chunks %d)",
                        key or f"numel {numel}", d.reason, d.path, d.chunks)
        return d

    def _level(self, d: Decision) -> int:
        """WARNING for the first decision of each outcome (path, codec per tier), INFO for the
        rest: a DDP model's buckets (and DDP's first-iteration layout) mostly decide alike, and a
        run should print what auto chose, not one line per bucket size."""
        outcome = (d.path, d.codec, d.intra_codec)
        if not self.verbose or outcome in self._announced:
            return logging.INFO
        self._announced.add(outcome)
        return logging.WARNING

    def _raced(self, d: Decision, numel: int, world: int, group, device, kind: str, deterministic: bool) -> Decision:
        """``d``, or the safe choice where ``d`` did not beat it beyond the spread (module race)."""
        safe = R.safe_choice(deterministic, kind)
        if d.path != "flat" or d.codec == safe or (safe == BACKEND and getattr(self.costs, "backend_Bps", None) is None):
            return d
        return self._race(d.codec, safe, d, numel, world, group, device, kind)

    def _race(self, candidate: str, safe: str, model: Decision, numel: int, world: int, group, device,
              kind: str) -> Decision:
        r = _on_worker(group, lambda: R.race(candidate, safe, numel, group, device, kind))
        if r.winner == model.codec:
            return dataclasses.replace(model, reason=f"{model.reason}; {r.describe()}", raced=(candidate, safe))
        reason = f"{r.describe()} (the model had predicted {model.codec}: {model.reason})"
        chunks = 1 if r.winner == BACKEND else _chunks(r.winner, numel, world, kind)
        return Decision(r.winner, chunks, reason, model.predicted_s, raced=(candidate, safe))

    def revisit(self, d: Decision, numel: int, *, group=None, device: Optional[torch.device] = None,
                kind: str = "all_reduce", key: Optional[str] = None) -> Decision:
        """Race a raced decision's two candidates again (a collective on ``group``: every rank at
        the same point) and return the winner's decision, ``d`` itself when it wins again."""
        if not d.raced:
            return d
        world = dist.get_world_size(group) if dist.is_initialized() else 1
        new = self._race(d.raced[0], d.raced[1], d, numel, world, group, device, kind)
        if new.codec != d.codec and (world <= 1 or dist.get_rank(group) == 0):
            log.log(logging.WARNING if self.verbose else logging.INFO, "flatcomm auto: %s revisited: %s",
                    key or f"numel {numel}", new.reason)
        return new


def _agree(d: Decision, group, device: Optional[torch.device]) -> None:
    """Check that every rank of ``group`` made decision ``d`` (one tiny all-reduce on the group's
    worker thread); ranks that disagree, e.g. with different profiles, get a ValueError."""
    if not dist.is_initialized() or dist.get_world_size(group) <= 1:
        return
    h = zlib.crc32(f"{d.codec}/{d.chunks}/{d.path}/{d.intra_codec}".encode())
    dev = torch.device(device) if device is not None else torch.device("cpu")

    def body():
        t = torch.tensor([h, -h], dtype=torch.int64, device=dev)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        return t.tolist()

    hi, neg_lo = _on_worker(group, body)
    if hi != h or -neg_lo != h:
        raise ValueError(f"flatcomm auto: ranks disagree on the decision ({d.codec}, chunks {d.chunks} here): "
                         f"were they given different profiles or costs? {d.reason}")


_default_tuners: Dict[object, Tuner] = {}
_default_lock = threading.Lock()


def tuner_for(group=None) -> Tuner:
    """The process-wide default :class:`Tuner` of ``group`` (error budget int8), created on first use."""
    key = worker.key_of(group)
    with _default_lock:
        t = _default_tuners.get(key)
        if t is None:
            t = _default_tuners[key] = Tuner()
        return t


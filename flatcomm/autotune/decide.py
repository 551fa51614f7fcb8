"""Price and pick: the cost model's prediction (:func:`predict`) and the pure rule (:func:`decide`)
behind ``codec="auto"``.

Precision order (most precise first): ``fp32 > bf16 > int8 > int4 > sign``. An ``error_budget``
names the least precise codec allowed: ``error_budget="int4"`` allows fp32, bf16, int8 and int4.

Cost model, for a collective of ``numel`` fp32 input values over ``W`` ranks with codec ``c``::

    all_reduce:     time(c) = numel / ar_compute[c] + 2 wire(c) + 2 chunks(c) latency
    reduce_scatter: time(c) = numel / rs_compute[c] +   wire(c) +   chunks(c) latency
    wire(c) = wire_bytes(c, numel) * (W - 1) / W / link_Bps      # what one rank sends per stage

``link_Bps``, ``latency_s`` and the per-codec compute rates ``ar_compute`` / ``rs_compute`` (fp32
input bytes per second) are measured by :mod:`flatcomm.autotune.measure`.

Rule: the fastest predicted codec within the budget, except that any codec within 5% of the
fastest time wins if it is more precise (so plain fp32 is kept when compression does not pay).

The backend's own all-reduce (``"backend"``: ``dist.all_reduce``, gloo's or NCCL's algorithm, fp32)
is a candidate only where the caller did not ask for determinism (``choose(..., deterministic=
False)``; the DDP hook's ``codec="auto"`` without an explicit ``mode``). It is modelled from two timed
all-reduces (latency + bytes / bandwidth) and ranks first among near ties: compression has to beat
it by more than 5% to be chosen, so ``auto`` does not lose to the default hook by more than the
model's error.
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

from . import tiers as T
from .costs import CostModel, Decision
from ..comm import layout
from ..ops.codecs import PRECISION, Codec

__all__ = ["BACKEND", "KINDS", "NEAR_TIE", "allowed", "check_kind", "chunks_for", "decide", "predict"]

BACKEND = "backend"  # the backend's own fp32 all-reduce (not deterministic by flatcomm's standard)
KINDS = ("all_reduce", "reduce_scatter")
NEAR_TIE = 0.05

def allowed(error_budget: str) -> Tuple[str, ...]:
    """Codecs at least as precise as ``error_budget`` (see :data:`PRECISION`)."""
    if error_budget not in PRECISION:
        raise ValueError(f"flatcomm: error_budget must be one of {PRECISION}, got {error_budget!r}")
    return PRECISION[:PRECISION.index(error_budget) + 1]


def check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"flatcomm: kind must be one of {KINDS}, got {kind!r}")


def chunks_for(codec: str, numel: int, world: int, kind: str = "all_reduce") -> int:
    """The chunk count the collective picks by itself for this codec and size (fp32 data)."""
    return layout.default_chunks(max(1, numel // world), Codec(codec), world, "ordered", torch.float32, kind)


def predict(costs: CostModel, codec: str, numel: int, world: int, kind: str = "all_reduce") -> float:
    """Predicted seconds of an ordered ``kind`` of ``numel`` fp32 input values with ``codec``
    (or of the backend's own all-reduce for ``codec="backend"``)."""
    check_kind(kind)
    if codec == BACKEND:
        if kind != "all_reduce" or costs.backend_Bps is None or costs.backend_latency_s is None:
            raise ValueError(f"flatcomm: no backend cost for {kind} in this CostModel")
        return 0.0 if world <= 1 else costs.backend_latency_s + 4.0 * numel / costs.backend_Bps
    compute, wire = _parts(costs, codec, numel, world, kind)
    if world <= 1:
        return compute
    stages = 2.0 if kind == "all_reduce" else 1.0
    return compute + wire + stages * chunks_for(codec, numel, world, kind) * costs.latency_s


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
    chunks = chunks_for(best, numel, world, kind)
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
        return Decision(c, chunks_for(c, numel, world), reason, times, path="flat")
    return Decision(c, T.segments(numel, costs, c, ci, segments), reason, times, path="hierarchical",
                    intra_codec=ci)

"""Topology-aware candidates of ``codec="auto"``: flat or hierarchical, a codec per tier.

Priced by :mod:`flatcomm.autotune.costmodel` (the model ``python -m flatcomm.bench scale`` validates and
projects with), from a :class:`flatcomm.autotune.CostModel` that holds per-tier link costs
(``nodes``, ``ranks_per_node``, ``inter_*``: what one node sends per second, its ranks sharing it;
``intra_*``: what one rank sends inside its node). The per-value compute of each codec is the
tuner's measured ``compute_Bps`` (already on this machine's shared cores, so ``compute_share`` 1).

Candidates, most precise first (:func:`flatcomm.autotune.decide` keeps the most precise of the
near ties): per inter codec, flat, then hierarchical with each allowed intra codec. The intra
tier is lossless unless the caller allows a lossy one (``intra_budget``), and never less precise
than the inter codec (the node sum is what crosses the network: losing more inside the node than
across it buys little wire and adds error where the link is fast).
"""
from __future__ import annotations

import math
from typing import Dict, Iterable, Optional, Tuple

from . import costmodel as M
from ..comm import two_level

__all__ = ["PATHS", "cluster", "name", "predict", "segments", "tiered"]

PATHS = ("flat", "hierarchical")
Candidate = Tuple[str, str, str]  # (path, inter codec, intra codec)


def tiered(costs) -> bool:
    """Whether ``costs`` hold per-tier link costs of a real two-level shape (N > 1 and G > 1)."""
    return (costs.nodes > 1 and costs.ranks_per_node > 1 and costs.inter_Bps is not None
            and costs.intra_Bps is not None)


def cluster(costs) -> M.Cluster:
    """The :class:`flatcomm.autotune.costmodel.Cluster` of a tiered CostModel."""
    codec_s = {c: 0.0 if math.isinf(b) else 4.0 / b for c, b in costs.compute_Bps.items()}
    return M.Cluster(costs.nodes, costs.ranks_per_node, M.Tier(costs.inter_latency_s, costs.inter_Bps),
                     M.Tier(costs.intra_latency_s, costs.intra_Bps), codec_s, codec_s.get("fp32", 0.0), 1.0,
                     costs.shared_cores)


def predict(costs, numel: int, inter_codecs: Iterable[str], intra_codecs: Iterable[str],
            paths: Iterable[str] = PATHS, segments: Optional[int] = None) -> Dict[Candidate, float]:
    """Seconds per candidate, in precision order (see the module docstring); hierarchical ones with
    ``segments`` pipeline segments (default: the model's best)."""
    order = list(intra_codecs)
    cl = cluster(costs)
    out: Dict[Candidate, float] = {}
    for c in inter_codecs:
        if "flat" in paths:
            out[("flat", c, c)] = M.flat(cl, numel, c)
        if "hierarchical" in paths:
            for ci in order:
                if ci in cl.codec_s and order.index(ci) <= _rank(c, order):
                    k = segments or M.best_segments(cl, numel, c, ci)
                    out[("hierarchical", c, ci)] = M.hierarchical(cl, numel, c, ci, k)
    return out


def _rank(codec: str, order) -> int:
    """Position of ``codec`` in the precision order (past the end: any intra codec allowed)."""
    return order.index(codec) if codec in order else len(order)


def segments(numel: int, costs, codec: str, intra_codec: str, fixed: Optional[int] = None) -> int:
    """The hierarchical pipeline's segment count with the least predicted time (a function of the
    shard size and the tiers: more where the tiers' times are comparable and copies are cheap), or
    ``fixed`` (cut as flatcomm.hierarchical will cut it)."""
    k = fixed or M.best_segments(cluster(costs), numel, codec, intra_codec)
    return len(two_level.segments_of(math.ceil(numel / costs.ranks_per_node), 1, k, nodes=costs.nodes)) - 1


def name(cand: Candidate) -> str:
    path, c, ci = cand
    return c if path == "flat" else f"hier:{c}/{ci}"

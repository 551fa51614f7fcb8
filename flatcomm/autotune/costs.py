"""What the tuner knows and decides: the measured :class:`CostModel` and a :class:`Decision`."""
from __future__ import annotations

import dataclasses
from typing import Dict, Mapping, Optional, Tuple

__all__ = ["CostModel", "Decision"]


@dataclasses.dataclass(frozen=True)
class CostModel:
    """link_Bps: link bandwidth (bytes/s one rank sends); latency_s: per collective call;
    compute_Bps: codec -> fp32 input bytes/s of this rank's all-reduce pipeline (``inf`` = free);
    rs_compute_Bps: the same for the reduce-scatter pipeline (default: twice ``compute_Bps``);
    backend_Bps / backend_latency_s: the backend's own fp32 all-reduce, ``latency + 4 numel / Bps``
    (None: not measured, never a candidate)."""

    link_Bps: float
    latency_s: float
    compute_Bps: Mapping[str, float]
    rs_compute_Bps: Optional[Mapping[str, float]] = None
    backend_Bps: Optional[float] = None
    backend_latency_s: Optional[float] = None
    # Per-tier link costs (a Topology's, see flatcomm.autotune.tiers): measured with measure(...,
    # topology=...) and saved in profiles, so hierarchical decisions replay too. None: flat only.
    nodes: int = 1
    ranks_per_node: int = 1
    inter_latency_s: Optional[float] = None
    inter_Bps: Optional[float] = None  # bytes one node sends per second (its ranks share the link)
    intra_latency_s: Optional[float] = None
    intra_Bps: Optional[float] = None  # bytes one rank sends per second inside its node
    shared_cores: bool = False  # the node's transfers are CPU work on the kernels' cores (CPU hosts)


@dataclasses.dataclass(frozen=True)
class Decision:
    codec: str
    chunks: int
    reason: str
    predicted_s: Dict[str, float]
    path: str = "flat"  # "flat", "hierarchical" (inter codec = codec), or "backend"
    intra_codec: str = "fp32"  # hierarchical: the node tier's codec
    raced: Tuple[str, ...] = ()  # (candidate, safe) when a race confirmed or overruled the model

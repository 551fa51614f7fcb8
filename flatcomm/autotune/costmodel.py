"""An alpha-beta cost model of an all-reduce on N nodes x G ranks: the backend's fp32 ring, flatcomm's
flat one-hop path and its two-level (hierarchical) path, per codec. Pure arithmetic (it runs no
collective): the inputs are measured elsewhere (link probes, the kernels benchmark) or stated.

Per tier a latency and a bandwidth: ``inter`` is a node's network link(s) (every rank of the node
shares it: bytes that leave the node / ``inter.Bps``), ``intra`` is what one rank sends to the
ranks of its own node per second (NVLink; loopback TCP on one machine). ``codec_s[c]`` is the
compute one rank spends per fp32 value of a flat all-reduce with codec c (encode with error
feedback, decode-and-sum with the re-encode, decode of the gathered shards; for fp32 the ordered
sum), ``reduce_s`` a plain add per value (the ring's reduction), and ``compute_share`` the fraction
of a processor each rank gets (1 on a GPU; cores / ranks when ranks share a machine's cores).
``shared_cores``: the node tier's transfers are CPU work on the cores that run the kernels (a CPU
host's loopback TCP), so in the two-level path they add to the codec work instead of overlapping it.

Bytes, S = 4 numel, W = N G, c = wire bytes / fp32 bytes of the codec:

- ring (torch's all-reduce): 2(W-1) steps of S/W; one ring edge per node crosses the network,
  so a node sends 2(W-1)/W S (intra edges carry the same per rank).
- flat: the reduce-scatter is one all-to-all: a node sends G (W-G)/W c S, a rank (G-1)/W c S
  inside; the all-gather is a ring: (W-1)/W c S per node and per rank inside.
- hierarchical: node reduce-scatter (fp32, (G-1)/G S per rank inside), flat all-reduce of the
  S/G shard among the N ranks of one local rank (the node's G ranks share the link:
  2 (N-1)/N c S per node), node all-gather: with an fp32 intra codec of the compressed payloads
  ((G-1)/G c S per rank inside, then a decode of the other (G-1) shards), else of the values
  ((G-1)/G S, the intra codec's ratio).

Overlap: a phase moves its bytes on both tiers at once (time = the slower tier); a flat call of k
chunks overlaps compute and wire: max(a, b) + min(a, b) / k; the hierarchical path's k segments
overlap its three steps the same way (a node-tier latency per segment and step; with a lossy
intra codec two copies of the tensor when k > 1). Latency per chunk: one for the all-to-all,
W - 1 for the ring all-gather.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, Mapping, Optional

import torch

from ..comm import layout, two_level
from ..ops.codecs import Codec

__all__ = ["Cluster", "Tier", "flat", "hierarchical", "predict", "ring", "PATHS"]

PATHS = ("torch", "flat", "hierarchical")


@dataclasses.dataclass(frozen=True)
class Tier:
    latency_s: float
    Bps: float


@dataclasses.dataclass(frozen=True)
class Cluster:
    nodes: int
    ranks_per_node: int
    inter: Tier
    intra: Tier
    codec_s: Mapping[str, float]
    reduce_s: float
    compute_share: float = 1.0
    shared_cores: bool = False  # the node tier's transfers run on the cores that run the kernels

    @property
    def world(self) -> int:
        return self.nodes * self.ranks_per_node

    def describe(self) -> Dict[str, object]:
        return {"nodes": self.nodes, "ranks_per_node": self.ranks_per_node,
                "inter_latency_s": self.inter.latency_s, "inter_GBps": self.inter.Bps / 1e9,
                "intra_latency_s": self.intra.latency_s, "intra_GBps": self.intra.Bps / 1e9,
                "codec_ns_per_value": {k: v * 1e9 for k, v in self.codec_s.items()},
                "reduce_ns_per_value": self.reduce_s * 1e9, "compute_share": self.compute_share,
                "shared_cores": self.shared_cores}


def _ratio(codec: str, numel: int) -> float:
    return Codec(codec).wire_bytes(numel) / (4.0 * numel)


def _phase(cl: Cluster, node_bytes: float, rank_bytes: float) -> float:
    """Seconds to move ``node_bytes`` off every node and ``rank_bytes`` per rank inside it."""
    t = 0.0
    if cl.nodes > 1 and node_bytes > 0:
        t = max(t, node_bytes / cl.inter.Bps)
    if cl.ranks_per_node > 1 and rank_bytes > 0:
        t = max(t, rank_bytes / cl.intra.Bps)
    return t


def _latency(cl: Cluster) -> float:
    return cl.inter.latency_s if cl.nodes > 1 else cl.intra.latency_s


def _overlap(a: float, b: float, k: int) -> float:
    return max(a, b) + min(a, b) / max(1, k)


def ring(cl: Cluster, numel: int) -> float:
    """The backend's fp32 ring all-reduce."""
    w = cl.world
    if w <= 1:
        return 0.0
    s = 4.0 * numel
    wire = _phase(cl, 2 * (w - 1) / w * s, 2 * (w - 1) / w * s)
    add = (w - 1) / w * numel * cl.reduce_s / cl.compute_share
    return wire + add + 2 * (w - 1) * _latency(cl)


def _chunks(numel: int, codec: str, world: int) -> int:
    """The pipeline chunks flatcomm.collectives picks by itself for this all-reduce."""
    return layout.default_chunks(max(1, numel // world), Codec(codec), world, "ordered", torch.float32, "all_reduce")


def flat(cl: Cluster, numel: int, codec: str, chunks: Optional[int] = None) -> float:
    """flatcomm's one-hop all-reduce over all W ranks (all-to-all reduce-scatter, ring all-gather)."""
    w, g = cl.world, cl.ranks_per_node
    if w <= 1:
        return numel * cl.codec_s[codec] / cl.compute_share
    cs = _ratio(codec, numel) * 4.0 * numel
    rs = _phase(cl, g * (w - g) / w * cs, (g - 1) / w * cs)
    ag = _phase(cl, (w - 1) / w * cs, (w - 1) / w * cs)
    k = chunks or _chunks(numel, codec, w)
    compute = numel * cl.codec_s[codec] / cl.compute_share
    return _overlap(compute, rs + ag, k) + k * _steps(w) * _latency(cl)


def _steps(world: int) -> int:
    """Latencies per chunk of a flat all-reduce: one all-to-all, then the backend's ring all-gather
    (gloo's and NCCL's: W - 1 steps one after another, each waiting for the previous hop)."""
    return 1 + (world - 1)


SEGMENT_CHOICES = (1, 2, 4, 8)


def hierarchical(cl: Cluster, numel: int, codec: str, intra_codec: str = "fp32",
                 segments: Optional[int] = None) -> float:
    """Node reduce-scatter, compressed all-reduce across nodes, node all-gather (flat when N or G is 1).
    ``segments``: the pipeline's (default: what flatcomm.hierarchical picks by itself)."""
    n, g = cl.nodes, cl.ranks_per_node
    if n == 1 or g == 1:
        return flat(cl, numel, codec)
    if not Codec(intra_codec).lossless:  # the node stages compress too
        return _staged(cl, numel, codec, intra_codec, segments)
    s, m, share = 4.0 * numel, numel / g, cl.compute_share
    k = len(two_level.segments_of(int(m), 1, segments, nodes=n)) - 1  # the segments flatcomm.hierarchical cuts
    cs = _ratio(codec, max(1, int(m))) * 4.0 * m
    node_rs = (g - 1) / g * s / cl.intra.Bps + (g - 1) * m * cl.reduce_s / share
    # Across nodes each segment is one chunk of a one-hop all-reduce (its exchange overlaps the
    # neighbouring segments' re-encoding), the node's G ranks sharing its link.
    across_wire = 2 * (n - 1) / n * cs * g / cl.inter.Bps
    across = _overlap(m * cl.codec_s[codec] / share, across_wire, k) + k * _steps(n) * cl.inter.latency_s
    # The node gathers the payloads and decodes the other ranks' shards (a third of codec_s: it
    # covers encode, decode-sum with re-encode, and decode).
    node_ag = (g - 1) * cs / cl.intra.Bps + (g - 1) * m * cl.codec_s[codec] / 3 / share
    if cl.shared_cores:
        # The node's transfers are CPU work (loopback TCP) on the cores that run the kernels: the
        # node tier and the codec work add up, and only the network overlaps them.
        cpu = node_rs + node_ag + m * cl.codec_s[codec] / share + 2 * k * cl.intra.latency_s
        wire = across_wire + k * _steps(n) * cl.inter.latency_s
        return max(cpu, wire) + min(cpu, wire) / k
    steps = (node_rs + k * cl.intra.latency_s, across, node_ag + k * cl.intra.latency_s)
    return max(steps) + (sum(steps) - max(steps)) / k


def _staged(cl: Cluster, numel: int, codec: str, intra_codec: str, segments: Optional[int]) -> float:
    """The two-level path with a lossy intra codec: codec collectives inside the node, the shard's
    flat all-reduce across nodes, the node all-gather of decoded values."""
    n, g = cl.nodes, cl.ranks_per_node
    s = 4.0 * numel
    m = numel / g
    ci = _ratio(intra_codec, numel)
    share = cl.compute_share
    intra_rs = (g - 1) / g * ci * s / cl.intra.Bps + numel * cl.codec_s[intra_codec] / 2 / share
    cs = _ratio(codec, max(1, int(m))) * 4.0 * m
    across_wire = 2 * (n - 1) / n * cs * g / cl.inter.Bps  # the node's G ranks share its link
    k_in = _chunks(int(m), codec, n)
    across = _overlap(m * cl.codec_s[codec] / share, across_wire, k_in) + k_in * _steps(n) * cl.inter.latency_s
    intra_ag = (g - 1) / g * ci * s / cl.intra.Bps + numel * cl.codec_s[intra_codec] / 2 / share
    k = segments or 1
    # Every segment is one node reduce-scatter and one node all-gather call (a latency each); the
    # cross-node call chunks itself by size, so its latencies do not grow with k.
    steps = (intra_rs + k * cl.intra.latency_s, across, intra_ag + k * cl.intra.latency_s)
    # k > 1 gathers each segment's G strided rows into a staging buffer and writes the gathered
    # result back: two copies of the tensor, at the cost of a plain add per value (memory bound).
    copies = 0.0 if k == 1 else 2.0 * numel * cl.reduce_s / share
    return max(steps) + (sum(steps) - max(steps)) / k + copies


def best_segments(cl: Cluster, numel: int, codec: str, intra_codec: str = "fp32") -> int:
    """The pipeline segment count (of :data:`SEGMENT_CHOICES`) with the least predicted time: more
    segments overlap the tiers better, each costs node-tier latencies, and any split costs copies."""
    return min(SEGMENT_CHOICES, key=lambda k: (hierarchical(cl, numel, codec, intra_codec, k), k))


def predict(cl: Cluster, path: str, numel: int, codec: str = "fp32", segments: Optional[int] = None) -> float:
    """Seconds of one all-reduce of ``numel`` fp32 values by ``path`` (one of :data:`PATHS`);
    ``segments`` of the hierarchical path (default: flatcomm.hierarchical's own)."""
    if path == "torch":
        return ring(cl, numel)
    if path == "flat":
        return flat(cl, numel, codec)
    if path == "hierarchical":
        return hierarchical(cl, numel, codec, segments=segments)
    raise ValueError(f"flatcomm: path must be one of {PATHS}, got {path!r}")

"""Measure a :class:`~flatcomm.autotune.costs.CostModel` on a group (a collective).

``link_Bps`` and ``latency_s`` are fitted from timed ``all_to_all_single`` calls of two sizes
(every rank sends and receives at once, as in the collectives). ``ar_compute`` / ``rs_compute``
(fp32 input bytes per second) cover everything else the collective does on this rank: the real
collective is timed once per codec on ``BENCH_NUMEL`` values, with error feedback for lossy codecs
(encode + residual, decode-and-sum with the re-encode and server residual, decode of the gathered
shards, staging copies, thread hand-off), and the modelled wire and latency time is subtracted.
Every measured time is MAX-reduced over the group (the slowest rank), so every rank holds the same
:class:`CostModel` and :func:`decide` (a pure function) makes the same choice everywhere.
"""
from __future__ import annotations

import math
import time
from typing import Callable, Optional, Tuple

import torch
import torch.distributed as dist

from .costs import CostModel
from .decide import KINDS, predict
from ..comm import flat, pipeline, route, worker
from ..comm.args import ErrorFeedback
from ..comm.groups import private_group
from ..comm.spec import CallSpec
from ..ops.codecs import PRECISION, Codec

__all__ = ["BENCH_NUMEL", "measure", "on_worker"]

BENCH_NUMEL = 1 << 23  # 32 MB: past the caches, so per-value costs are those of large buckets


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


def on_worker(group, fn):
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
                fn = lambda: route.all_reduce(x, CallSpec(codec=c, residual=ef, validate=False), group)  # noqa: E731
            else:
                r = torch.zeros(src.numel(), device=device) if lossy else None
                fn = lambda: flat.reduce_scatter(shard, src, CallSpec(codec=c, residual=r, validate=False),  # noqa: E731
                                                 group)
            out.append(_best_of(fn, device, reps))
    return out


def _time_tiers(topology, device: torch.device, small: int, large: int) -> list:
    """[intra small, intra large, inter small, inter large] seconds: all-to-alls inside every node
    at once, then among same-local-rank ranks of every node at once (the G exchanges of a node
    share its link, as in the hierarchical all-reduce), each on its tier group's worker."""
    out = []
    for sub, members in ((topology.intra_group, topology.local_size), (topology.inter_group, topology.nodes)):
        pg = private_group(sub)
        out += on_worker(pg, lambda: [_time_a2a(b, members, pg, device) for b in (small, large)])
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

    vals = on_worker(group, body)
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

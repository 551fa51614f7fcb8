"""All-reduce on N "nodes" x G ranks (flatcomm.tools.netlink with ranks_per_node): time and the bytes that
left a node, read from the kernel's counters of the node's link interface (not self-reported).

Rows, all in one run and on the same data: torch's fp32 ``dist.all_reduce`` (gloo's ring), flatcomm
flat one-hop (``path="flat"``) and, when this flatcomm has it, two-level (``path="hierarchical"``:
``all_reduce(..., topology=flatcomm.Topology(G))``), for fp32 (ordered) and the lossy codecs with
error feedback. Run it through ``python -m flatcomm.bench collectives --nodes N --ranks-per-node G
--link 1gbit``.

Bytes per all-reduce: after a barrier the first rank of every node reads its ``fc0`` tx counter,
the call runs, and after the timing's MAX all-reduce it reads again; the difference, minus what the
same bracket measures around an empty call (the barrier and the MAX all-reduce themselves), is what
the node sent. The record keeps the median over reps of the busiest node.
"""
from __future__ import annotations

import inspect
import os
import statistics
import sys
import time
from typing import Callable, Dict, List, Optional

import torch
import torch.distributed as dist

from flatcomm import collectives as C
from flatcomm.ops.codecs import Codec
from flatcomm.tools.netlink import interface_bytes


def hierarchical_available() -> bool:
    """Whether this flatcomm has the two-level all-reduce (``topology=`` and ``flatcomm.Topology``)."""
    import flatcomm

    return hasattr(flatcomm, "Topology") and "topology" in inspect.signature(C.all_reduce).parameters


def _residual_numel(numel: int, codec: str, topology) -> int:
    """Error feedback covers the whole tensor flat, this rank's intra-node shard hierarchical."""
    if topology is None:
        return numel
    from flatcomm import hierarchical

    return hierarchical.shard_numel(numel, topology, codec)


def _bracket(fn: Callable[[], None], nodes: int, local_rank: int, node: int) -> tuple:
    """(slowest rank's seconds, bytes each node sent) for one call of ``fn``."""
    dist.barrier()
    tx0 = interface_bytes()[0] if local_rank == 0 else 0
    t0 = time.perf_counter()
    fn()
    dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(dt, op=dist.ReduceOp.MAX)
    sent = torch.zeros(nodes, dtype=torch.float64)
    if local_rank == 0:
        sent[node] = interface_bytes()[0] - tx0
    dist.all_reduce(sent)  # every rank learns every node's count (this sum is after the reading)
    return float(dt), sent.tolist()


def _measure(fn, reps: int, warmup: int, prepare, nodes: int, local_rank: int, node: int,
             overhead: float) -> Dict:
    times, sent = [], []
    for i in range(warmup + reps):
        if prepare is not None:
            prepare()
        t, b = _bracket(fn, nodes, local_rank, node)
        if i >= warmup:
            times.append(t)
            sent.append(max(b) - overhead)
    return {"time_s": statistics.median(times), "min_s": min(times), "times_s": times,
            "cross_node_bytes": max(0.0, statistics.median(sent)), "cross_node_bytes_all": sent}


def _rank_main(rank: int, world: int, cfg: dict) -> Optional[List[Dict]]:
    g = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if world % g:
        raise ValueError(f"bench_nodes: world {world} is not a multiple of LOCAL_WORLD_SIZE {g}")
    nodes, node, local_rank = world // g, rank // g, rank % g
    paths = list(cfg["paths"])
    topology = None
    if "hierarchical" in paths:
        if hierarchical_available():
            import flatcomm

            topology = flatcomm.Topology(local_size=g)
        else:
            paths.remove("hierarchical")
    reps, warmup = cfg["reps"], cfg["warmup"]
    rows: List[Dict] = []

    def say(msg: str) -> None:
        if rank == 0:
            print(msg, file=sys.stderr, flush=True)

    # What the bracket itself (barrier, MAX and SUM all-reduces, TCP ACKs) costs in bytes.
    empty = [max(_bracket(lambda: None, nodes, local_rank, node)[1]) for _ in range(5)]
    overhead = statistics.median(empty)
    for numel in cfg["sizes"]:
        x = torch.randn(numel, generator=torch.Generator().manual_seed(1000 + rank))
        work = torch.empty_like(x)

        def copy_in():
            work.copy_(x)

        def add(path: str, codec: str, fn, extra: Optional[Dict] = None) -> None:
            m = _measure(fn, reps, warmup, copy_in, nodes, local_rank, node, overhead)
            rec = dict(path=path, codec=codec, numel=numel, bytes=4 * numel, nodes=nodes, ranks_per_node=g,
                       world=world, overhead_bytes=overhead, **m, **(extra or {}))
            rows.append(rec)
            say(f"  {path:12s} {codec:5s} {m['time_s'] * 1e3:9.1f} ms  {m['cross_node_bytes'] / 1e6:8.2f} MB "
                f"left a node")

        say(f"[{numel} values = {4 * numel / 1e6:.0f} MB fp32, {nodes} nodes x {g} ranks]")
        if "torch" in paths:
            add("torch", "fp32", lambda: dist.all_reduce(work))
        for path in ("flat", "hierarchical"):
            if path not in paths:
                continue
            for codec in cfg["codecs"]:
                lossy = not Codec(codec).lossless
                kw = {"topology": topology} if path == "hierarchical" else {}
                ef = C.ErrorFeedback.zeros(_residual_numel(numel, codec, topology if kw else None)) if lossy else None
                st = C.CommStats()
                copy_in()
                C.all_reduce(work, codec=codec, residual=ef, stats=st, **kw)  # also warms the pools
                add(path, codec, lambda: C.all_reduce(work, codec=codec, residual=ef, validate=False, **kw),
                    {"error_feedback": lossy, "self_reported_wire_bytes": st.wire_bytes})
        del x, work
    return rows if rank == 0 else None


# ---- probes for the scaling model (flatcomm.autotune.costmodel) ------------------------------------------


def _fit(sizes, times):
    """(latency s, bytes/s) of ``t = latency + bytes / rate`` through the smallest and largest size."""
    (b0, t0), (b1, t1) = (sizes[0], times[0]), (sizes[-1], times[-1])
    rate = (b1 - b0) / (t1 - t0) if t1 > t0 else b1 / max(t1, 1e-9)
    return max(0.0, t0 - b0 / rate), rate


def _a2a_time(nbytes: int, group, members: int, reps: int) -> float:
    per = max(1, nbytes // 4 // members)
    send, recv = torch.zeros(per * members), torch.empty(per * members)
    best = float("inf")
    for _ in range(reps + 1):
        dist.barrier()
        t0 = time.perf_counter()
        if group is not None:
            dist.all_to_all_single(recv, send, group=group)
        dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)
        best = min(best, float(dt))
    return best


def _tier_fit(group, members: int, small: int, reps: int, cfg: dict) -> tuple:
    """(latency, bytes/s, small bytes sent, small seconds) of one tier from all-to-alls of ``small`` bytes and of a size doubled
    from 16 MB until it takes ``min_s`` (a short transfer on a shaped link measures TCP's ramp-up,
    not the link: 16 MB over 1 Gbit/s read half the rate). Every rank takes the same branch: the
    times are the slowest rank's."""
    t_small = _a2a_time(small, group, members, reps)
    large, cap, min_s = cfg.get("large", 16 << 20), cfg.get("max_bytes", 256 << 20), cfg.get("min_s", 0.25)
    t_large = _a2a_time(large, group, members, reps)
    while t_large < min_s and large < cap:
        large *= 2
        t_large = _a2a_time(large, group, members, reps)
    sent = [b * (members - 1) / members for b in (small, large)]
    return (*_fit(sent, [t_small, t_large]), sent[0], t_small)


def probe_rank(rank: int, world: int, cfg: dict) -> Optional[Dict]:
    """Tier latency and bandwidth on this harness. Inter: an all-to-all among the first rank of every
    node (the others idle), bytes = what one node sends. Intra: an all-to-all inside every node at
    once (each rank sends (G-1)/G of the buffer), bytes = what one rank sends."""
    g = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    nodes, node, lr = world // g, rank // g, rank % g
    leaders = dist.new_group(list(range(0, world, g)))
    mine = None
    for k in range(nodes):
        grp = dist.new_group(list(range(k * g, (k + 1) * g))) if g > 1 else None
        if k == node:
            mine = grp
    small, reps = cfg.get("small", 64 << 10), cfg.get("reps", 3)
    out = {}
    if nodes > 1:
        out["inter"] = _tier_fit(leaders if lr == 0 else None, nodes, small, reps, cfg)
    if g > 1:
        out["intra"] = _tier_fit(mine, g, small, reps, cfg)
    if cfg.get("codecs"):
        # The compute, timed on every rank at once (the slowest rank's): the ranks share this
        # machine's cores as they do in the collectives, and under the load of the moment, where a
        # probe in the parent process assumed a perfect share (cores / ranks) and missed both.
        dist.barrier()
        kern = kernel_costs(cfg["codecs"], cfg.get("kernel_numel", 1 << 22), world)
        vals = torch.tensor([kern["codec_s"][c] for c in cfg["codecs"]] + [kern["reduce_s"]], dtype=torch.float64)
        dist.all_reduce(vals, op=dist.ReduceOp.MAX)
        out["kernels"] = {"codec_s": dict(zip(cfg["codecs"], vals[:-1].tolist())), "reduce_s": float(vals[-1]),
                          "numel": kern["numel"], "threads": 1, "concurrent_ranks": world}
    return out if rank == 0 else None


def kernel_costs(codecs, numel: int = 1 << 22, world: int = 2, reps: int = 3) -> Dict:
    """Seconds per fp32 value, one thread, of the compute in one rank's flat all-reduce per codec
    (encode + error feedback of the input, decode-sum of ``world`` rows of a shard with the re-encode
    and its residual, decode of the gathered payloads), and of a plain add (the ring's reduction)."""
    import flatcomm

    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(numel, generator=gen)
    shard = numel // world

    def best(fn):
        b = float("inf")
        for _ in range(reps + 1):
            t0 = time.perf_counter()
            fn()
            b = min(b, time.perf_counter() - t0)
        return b

    out = {}
    for c in codecs:
        lossy = not Codec(c).lossless
        r, rs = torch.zeros(numel), torch.zeros(shard)
        payload = flatcomm.encode(x, c, residual=r if lossy else None)
        srows = flatcomm.encode(x[:shard], c).unsqueeze(0).expand(world, -1).contiguous()
        t = best(lambda: flatcomm.decode_sum(srows, c, shard, scale=1.0 / world))
        if lossy:  # fp32 sends the input as it is and gathers into the tensor: the sum is all
            t += best(lambda: flatcomm.encode(x, c, residual=r))
            t += best(lambda: flatcomm.encode(x[:shard], c, residual=rs))
            t += best(lambda: flatcomm.decode(payload, c, numel))
        out[c] = t / numel
    a, b = torch.randn(numel, generator=gen), torch.randn(numel, generator=gen)
    out_add = best(lambda: torch.add(a, b, out=a)) / numel
    return {"codec_s": out, "reduce_s": out_add, "numel": numel, "threads": 1}

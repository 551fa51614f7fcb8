"""All-reduce on N "nodes" x G ranks (flatcomm.netlink with ranks_per_node): time and the bytes that
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

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from flatcomm import collectives as C  # noqa: E402
from flatcomm.codecs import Codec  # noqa: E402
from flatcomm.netlink import interface_bytes  # noqa: E402


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

"""Node-tier transfers of the two-level collectives: lossless all-gather and reduce-scatter among
the ranks of one node, straight between the caller's tensors, queued on the node group's worker.

Every rank sends its pieces directly to each peer (``batch_isend_irecv``): inside a node that moves
the same bytes per rank as a ring, and it needs neither contiguous inputs (a pipeline segment of
the node's G shards is G separate ranges: a collective would need a staging copy of them) nor
gloo's result staging (gloo's all-gather lands in a freshly allocated buffer and copies it out;
first-touch page faults cost as much as the loopback transfer). NCCL's all-gather is already
direct and is used for the gather on CUDA.
"""
from __future__ import annotations

import concurrent.futures
import time
from typing import Callable, List, Optional, cast

import torch
import torch.distributed as dist

from . import header, worker
from .labels import label
from .layout import CommStats
from .p2p import drain
from .topology import Topology

__all__ = ["Job", "after", "gather", "mark", "queued", "reduce", "timed"]


class Job:
    """A node-tier exchange queued on its group's worker (:func:`queued`)."""

    def __init__(self) -> None:
        self.future: Optional["concurrent.futures.Future"] = None
        self.done: Optional["torch.cuda.Event"] = None  # CUDA: recorded after the job's kernels

    def cancel(self) -> bool:
        """Drop the job if its worker has not started it (after a failure of the call)."""
        return self.future is not None and self.future.cancel()

    def wait(self) -> None:
        """Block until the job has run (re-raising its error); with CUDA tensors the current stream
        is then made to wait for its kernels, which ran on the worker's side stream."""
        assert self.future is not None
        self.future.result()
        after(self.done)


def queued(st: Optional[CommStats], group, device: torch.device, fn: Callable[[], object]) -> Job:
    """Queue one exchange of ``group`` on that group's worker (so it keeps its place among the
    group's other flatcomm collectives on every rank), counting its time in ``st.exchange_s``
    (unless None: ``fn`` counts its own).
    CUDA: it runs on the group's side stream after the caller's current stream (see
    :mod:`flatcomm.comm.streams`)."""
    job = Job()

    def call():
        t0 = time.perf_counter()
        fn()
        if st is not None:
            st.exchange_s += time.perf_counter() - t0
        job.done = mark(device)

    job.future = worker.submit(worker.key_of(group), device, call)
    return job


def timed(st: CommStats, group, device: torch.device, fn: Callable[[], object], name: str = "flatcomm.comm.exchange") -> None:
    with label(name):
        queued(st, group, device, fn).wait()


def mark(device: torch.device) -> Optional["torch.cuda.Event"]:
    """CUDA: an event on the current stream, for work on another stream to wait for; else None."""
    if device.type != "cuda":
        return None
    ev = torch.cuda.Event()
    ev.record()
    return ev


def after(event: Optional["torch.cuda.Event"]) -> None:
    """Make the current stream wait for ``event`` (no host sync); nothing without one."""
    if event is not None:
        torch.cuda.current_stream().wait_event(event)


def _exchange(ops: List[dist.P2POp]) -> None:
    works = dist.batch_isend_irecv(ops) if ops else []
    for i, w in enumerate(works):
        try:
            w.wait()
        except BaseException:
            # A peer died or timed out: wait for the other transfers too (they fail or finish
            # within the timeout), so that none is pending when the group is torn down.
            drain(works[i + 1:])
            raise


def gather(topo: Topology, out: torch.Tensor, shard: torch.Tensor) -> None:
    """``out`` (G x shard.numel()) = every local rank's ``shard`` in local-rank order. ``shard``
    may be this rank's slice of ``out``."""
    n, me = shard.numel(), topo.local_rank
    mine = out[me * n:(me + 1) * n]
    if shard.is_cuda or topo.local_size == 1:
        header.all_gather_single(out, shard, group=topo.intra_group)
        return
    grp = cast(dist.ProcessGroup, topo.intra_group)
    ops = []
    for peer in range(topo.local_size):
        if peer != me:
            ops.append(dist.P2POp(dist.isend, shard, group=grp, group_peer=peer))
            ops.append(dist.P2POp(dist.irecv, out[peer * n:(peer + 1) * n], group=grp, group_peer=peer))
    if mine.data_ptr() != shard.data_ptr():
        mine.copy_(shard)
    _exchange(ops)


def reduce(topo: Topology, out: torch.Tensor, rows: torch.Tensor, scratch: torch.Tensor) -> None:
    """Lossless fp32 reduce-scatter: ``out`` (w values) = the sum over local ranks s, in ascending
    order (``((r0 + r1) + r2) + ...``), of rank s's ``rows[me]``. ``rows``: [G, w] fp32, each row
    contiguous (a column range of the node's shards); ``scratch``: G x w fp32 values (this
    rank's own row is summed from ``rows``, not copied)."""
    g, me = topo.local_size, topo.local_rank
    got = scratch.view(g, rows.shape[1])
    grp = cast(dist.ProcessGroup, topo.intra_group)
    ops = []
    for peer in range(g):
        if peer != me:
            ops.append(dist.P2POp(dist.isend, rows[peer], group=grp, group_peer=peer))
            ops.append(dist.P2POp(dist.irecv, got[peer], group=grp, group_peer=peer))
    _exchange(ops)
    part = [rows[me] if s == me else got[s] for s in range(g)]
    torch.add(part[0], part[1], out=out)
    for p in part[2:]:
        out.add_(p)

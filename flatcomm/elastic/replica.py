"""A torchft Manager set up for :class:`~flatcomm.elastic.ElasticDiLoCo`, for a replica of one
process or for one rank of an island (a replica group of several ranks).

torchft needs, per replica group, a TCPStore (its ranks and quorum groups rendezvous there), a
reconfigurable process group and a Manager per rank that talks to the lighthouse (the island's
rank 0 runs the group's manager server). :func:`make_manager` makes all three with the settings
ElasticDiLoCo needs: the store fresh for every incarnation of the island (rank 0 makes it and sends
its address over the island's group: a store that outlives a restart still holds the last
incarnation's manager address, which a restarted rank would read),
``use_async_quorum=False`` (heal before the exchange), ``init_sync=False`` (replicas seeded alike
start together; the join round checks that their weights are equal) and a
:class:`~flatcomm.elastic.QuorumGroup`.
"""
from __future__ import annotations

import weakref
from datetime import timedelta
import time
from typing import Any, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_flatten
from torchft import Manager
from torchft.checkpointing.http_transport import HTTPTransport

from .group import RENDEZVOUS_TIMEOUT, QuorumGroup

__all__ = ["HostTransport", "island_store", "make_manager"]

_stores: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # manager -> the store it needs alive


class HostTransport(HTTPTransport):
    """torchft's HTTP heal transport, advertised at ``hostname``: torchft's own advertises
    ``socket.gethostname()``, which a peer on another host or network namespace may not resolve to
    this replica (None: that name). For a Manager made by hand on a host or namespace of its own
    (the benchmarks'). ``last_recv``: (seconds, tensor bytes) of the last heal this rank received."""

    def __init__(self, hostname: Optional[str], timeout: timedelta) -> None:
        self._hostname = hostname  # before torchft's __init__, which calls address()
        self.last_recv: Tuple[float, int] = (0.0, 0)
        super().__init__(timeout=timeout, num_chunks=0)

    def address(self) -> str:
        if self._hostname is None:
            return super().address()
        port = self._server.socket.getsockname()[1]  # torchft 0.2 keeps its server there
        return f"http://{self._hostname}:{port}/checkpoint/"

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta) -> Any:
        t0 = time.perf_counter()
        got = super().recv_checkpoint(src_rank, metadata, step, timeout)
        size = sum(x.numel() * x.element_size() for x in tree_flatten(got)[0] if isinstance(x, torch.Tensor))
        self.last_recv = (time.perf_counter() - t0, size)
        return got


def island_store(island: Optional[dist.ProcessGroup], host: str, timeout: timedelta) -> Tuple[Any, str, int]:
    """(the store, its host, its port): made by the island's rank 0 on a free port of ``host`` and
    joined by the other ranks, who learn where over ``island`` (one small broadcast)."""
    rank = 0 if island is None else dist.get_rank(island)
    store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=timeout) if rank == 0 else None
    if island is not None and dist.get_world_size(island) > 1:
        box: List[Any] = [(host, store.port) if store is not None else None]
        dist.broadcast_object_list(box, group=island, group_src=0)
        host, port = box[0]
        if store is None:
            store = dist.TCPStore(host, port, is_master=False, wait_for_workers=False, timeout=timeout)
    assert store is not None
    return store, host, store.port


def make_manager(replica_id: str, lighthouse: str, *, timeout: timedelta = timedelta(seconds=30),
                 quorum_timeout: timedelta = timedelta(seconds=300), min_replicas: int = 2,
                 heartbeat_interval: timedelta = timedelta(milliseconds=100),
                 hostname: Optional[str] = None, rendezvous_timeout: timedelta = RENDEZVOUS_TIMEOUT,
                 island: Optional[dist.ProcessGroup] = None) -> Manager:
    """A torchft Manager for a one-process replica, or for this rank of an island (``island``: the
    island's process group; its rank and size are the Manager's), with a fresh TCPStore.

    Args:
        replica_id: this replica's name, the same when it restarts (torchft appends a uuid).
        lighthouse: the lighthouse's address (``torchft_lighthouse``'s, e.g. ``http://host:29510``).
        timeout: the bound of every collective, of ``should_commit`` and of a heal's transfer.
        quorum_timeout: how long a sync waits for a quorum (longer than an interval: a restarted
            replica waits here for the others' next sync).
        min_replicas: the fewest replicas a sync commits with.
        heartbeat_interval: how often this replica tells the lighthouse it is alive.
        hostname: the address peers reach this replica at (default: this host's name, and the
            store and heal transport on loopback, i.e. every replica on this host). Given, the
            replica's TCPStore (where a quorum's group may rendezvous) and its heal transport are
            advertised there too: replicas on several hosts need it.
        rendezvous_timeout: the bound of a quorum group's set-up (:class:`QuorumGroup`): a
            replica that dies between a quorum's forming and its rendezvous costs the others this.
        island: the group of this island's ranks (all of them call make_manager together), or
            None for an island of one process. Rank i of every island meets rank i of the others
            in the quorum; ``replica_id`` names the island (the same on its ranks).
    """
    if not isinstance(replica_id, str) or not replica_id or ":" in replica_id:
        raise ValueError(f"flatcomm.elastic: replica_id must be a non-empty str without ':', got {replica_id!r}")
    if isinstance(min_replicas, bool) or not isinstance(min_replicas, int) or min_replicas < 1:
        raise ValueError(f"flatcomm.elastic: min_replicas must be an int >= 1, got {min_replicas!r}")
    if island is not None and not isinstance(island, dist.ProcessGroup):
        raise TypeError(f"flatcomm.elastic: island must be a torch.distributed ProcessGroup or None, "
                        f"got {type(island).__name__}")
    store, host, port = island_store(island, "127.0.0.1" if hostname is None else hostname, timeout)
    kw = {} if hostname is None else {"hostname": hostname}
    rank, size = (0, 1) if island is None else (dist.get_rank(island), dist.get_world_size(island))
    manager = Manager(pg=QuorumGroup(timeout, rendezvous_timeout), load_state_dict=None, state_dict=None,
                      min_replica_size=min_replicas, use_async_quorum=False, timeout=timeout,
                      quorum_timeout=quorum_timeout, connect_timeout=timeout, store_addr=host,
                      store_port=port, rank=rank, world_size=size, lighthouse_addr=lighthouse,
                      replica_id=replica_id, heartbeat_interval=heartbeat_interval, init_sync=False,
                      checkpoint_transport=HostTransport(hostname, timeout), **kw)
    _stores[manager] = store
    return manager

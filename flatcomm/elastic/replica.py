"""A torchft Manager set up for :class:`~flatcomm.elastic.ElasticDiLoCo` (one process per replica).

torchft needs, per replica group, a TCPStore (its ranks and quorum groups rendezvous there), a
reconfigurable process group and a Manager that talks to the lighthouse. For a replica of one
process, :func:`make_manager` makes all three with the settings ElasticDiLoCo needs:
``use_async_quorum=False`` (heal before the exchange), ``init_sync=False`` (replicas seeded alike
start together; the join round checks that their weights are equal) and a
:class:`~flatcomm.elastic.QuorumGroup`.
"""
from __future__ import annotations

import weakref
from datetime import timedelta
from typing import Optional

import torch.distributed as dist
from torchft import Manager
from torchft.checkpointing.http_transport import HTTPTransport

from .group import RENDEZVOUS_TIMEOUT, QuorumGroup

__all__ = ["HostTransport", "make_manager"]

_stores: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # manager -> the store it needs alive


class HostTransport(HTTPTransport):
    """torchft's HTTP heal transport, advertised at ``hostname``: torchft's own advertises
    ``socket.gethostname()``, which a peer on another host or network namespace may not resolve to
    this replica. For a Manager made by hand on a host or namespace of its own (the benchmarks')."""

    def __init__(self, hostname: str, timeout: timedelta) -> None:
        self._hostname = hostname  # before torchft's __init__, which calls address()
        super().__init__(timeout=timeout, num_chunks=0)

    def address(self) -> str:
        port = self._server.socket.getsockname()[1]  # torchft 0.2 keeps its server there
        return f"http://{self._hostname}:{port}/checkpoint/"


def make_manager(replica_id: str, lighthouse: str, *, timeout: timedelta = timedelta(seconds=30),
                 quorum_timeout: timedelta = timedelta(seconds=300), min_replicas: int = 2,
                 heartbeat_interval: timedelta = timedelta(milliseconds=100),
                 hostname: Optional[str] = None, rendezvous_timeout: timedelta = RENDEZVOUS_TIMEOUT) -> Manager:
    """A torchft Manager for a one-process replica, with its own TCPStore on a free port.

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
    """
    if not isinstance(replica_id, str) or not replica_id or ":" in replica_id:
        raise ValueError(f"flatcomm.elastic: replica_id must be a non-empty str without ':', got {replica_id!r}")
    if isinstance(min_replicas, bool) or not isinstance(min_replicas, int) or min_replicas < 1:
        raise ValueError(f"flatcomm.elastic: min_replicas must be an int >= 1, got {min_replicas!r}")
    host = "127.0.0.1" if hostname is None else hostname
    store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=timeout)
    kw = {} if hostname is None else {"hostname": hostname, "checkpoint_transport": HostTransport(hostname, timeout)}
    manager = Manager(pg=QuorumGroup(timeout, rendezvous_timeout), load_state_dict=None, state_dict=None,
                      min_replica_size=min_replicas, use_async_quorum=False, timeout=timeout,
                      quorum_timeout=quorum_timeout, connect_timeout=timeout, store_addr=host,
                      store_port=store.port, rank=0, world_size=1, lighthouse_addr=lighthouse,
                      replica_id=replica_id, heartbeat_interval=heartbeat_interval, init_sync=False, **kw)
    _stores[manager] = store
    return manager

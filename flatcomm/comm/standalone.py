"""Standalone process groups: groups made straight from a store, that torch.distributed does not list.

torchft (and any elastic runner) builds a new gloo group for each quorum from a store prefix, outside
the default world: ``dist.get_rank(group)``, ``dist.get_process_group_ranks(group)`` and
``dist.new_group`` do not know it (there may be no default group at all). flatcomm's collectives
run on such a group once it is *adopted* here with what the comm layer needs:

* its **private copy**: a second group with the same members, made from the same store under
  another prefix (flatcomm's worker thread runs its exchanges there, never interleaved with the
  caller's own calls on the group; :mod:`flatcomm.comm.groups`);
* its **store**: where a rank leaves an error reason too long for the call header.

Ranks are the group's own (0 .. size-1); nothing else is needed: the point-to-point pieces and
all-gathers take the group object and group ranks. :func:`gloo_group` makes both groups and adopts
them. Everything here is keyed weakly: a group the program lets go of takes its entry with it.
"""
from __future__ import annotations

import threading
import weakref
from datetime import timedelta
from typing import List, NamedTuple, Optional

import torch
import torch.distributed as dist

from . import wire

__all__ = ["adopt", "check_timeout", "gloo_group", "is_standalone", "private_of", "rank", "ranks", "store_of"]

PRIVATE_PREFIX = "flatcomm/private"  # the private copy's store prefix, under the group's own store


class _Entry(NamedTuple):
    private: object
    store: Optional[dist.Store]


_lock = threading.Lock()
_adopted: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # group -> _Entry


def adopt(group, private, store: Optional[dist.Store] = None) -> None:
    """Let flatcomm's collectives run on ``group``, a process group torch does not list.

    Args:
        group: the group the caller names in flatcomm calls.
        private: a second group of the same members and ranks (flatcomm's own traffic); it is
            adopted too, as its own private copy.
        store: the store the groups were made from (error reasons too long for a call header).
    """
    if group.size() != private.size() or group.rank() != private.rank():
        raise ValueError(f"flatcomm: a standalone group's private copy must have its ranks: group rank "
                         f"{group.rank()} of {group.size()}, private copy rank {private.rank()} of {private.size()}")
    with _lock:  # (a value must not hold its own key, or the weak dict never lets go of it)
        _adopted[group] = _Entry(private, store)
        _adopted[private] = _Entry(None, store)


def is_standalone(group) -> bool:
    """Whether ``group`` was adopted by :func:`adopt` (None, the world: never)."""
    return group is not None and group in _adopted


def private_of(group):
    """The private copy adopted with the standalone ``group`` (a private copy: itself)."""
    private = _adopted[group].private
    return group if private is None else private


def store_of(group) -> Optional[dist.Store]:
    """The store of a standalone group, else the default group's (None when there is none)."""
    if is_standalone(group):
        return _adopted[group].store
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - torch.distributed not initialised
        return None


def rank(group) -> int:
    """This process's rank in ``group`` (a standalone group's own numbering)."""
    return group.rank() if is_standalone(group) else dist.get_rank(group)


def ranks(group) -> List[int]:
    """The global rank of each of ``group``'s ranks; a standalone group's are its own 0 .. size-1."""
    if is_standalone(group):
        return list(range(group.size()))
    return dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)


def _gloo(store: dist.Store, rank: int, size: int, connect: timedelta, timeout: timedelta):
    pg = dist.ProcessGroup(store, rank, size)
    pg._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
    backend = dist.ProcessGroupGloo(store, rank, size, connect)  # the rendezvous waits at most `connect`
    backend.set_timeout(timeout)  # each operation from now on: `timeout`
    pg._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, backend)
    return pg


def check_timeout(name: str, value) -> None:
    """Refuse ``value`` unless it is a positive timedelta (``name``: the argument, for the message)."""
    if not isinstance(value, timedelta) or value.total_seconds() <= 0:
        raise ValueError(f"flatcomm: {name} must be a positive timedelta, got {value!r}")


def gloo_group(store: dist.Store, rank: int, size: int, timeout: timedelta,
               connect_timeout: Optional[timedelta] = None):
    """A gloo group of ``size`` ranks on ``store`` (every member calls it with its ``rank``), with
    its private copy under ``store``/:data:`PRIVATE_PREFIX`, adopted: ready for flatcomm's
    collectives (CPU tensors). Every operation waits at most ``timeout``.

    Args:
        store: a store every member reaches (e.g. a ``PrefixStore`` over a ``TCPStore``), fresh for
            this group (a prefix used once).
        rank: this member's rank, 0 .. size-1.
        size: the number of members.
        timeout: the bound of every operation on the groups.
        connect_timeout: the bound of the set-up (each group's rendezvous), default ``timeout``.
            Shorter is how a caller that knows every member is already on its way (an elastic
            quorum) fails fast when one died before it connected.
    """
    connect = timeout if connect_timeout is None else connect_timeout
    check_timeout("timeout", timeout)
    check_timeout("connect_timeout", connect)
    if not (0 <= rank < size):
        raise ValueError(f"flatcomm: rank must be in [0, {size}), got {rank}")
    group = _gloo(store, rank, size, connect, timeout)
    private = _gloo(dist.PrefixStore(PRIVATE_PREFIX, store), rank, size, connect, timeout)
    wire.handshake(private, size)  # before any call header travels on it
    adopt(group, private, store)
    return group

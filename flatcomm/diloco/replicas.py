"""What the replicas agree on: a step every replica takes or none does, and equal masters.

:func:`agree` runs local checks on every replica, then one small flatcomm all-gather of a
fingerprint: a replica whose checks raised posts the all-gather's header marked failed
(:func:`flatcomm.comm.rejected.in_step`), so every replica raises the same error naming it, before
anything changed anywhere; and replicas whose fingerprints differ (another configuration, another
model) all raise naming them. :func:`master_hash` is the 64-bit hash ``verify_every`` gathers.
"""
from __future__ import annotations

import gc
import hashlib
import os
import socket
from typing import Callable, List, Sequence, TypeVar, cast

import torch
import torch.distributed as dist

from .. import collectives as C
from .._bytes import tensor_bytes
from ..comm.rejected import in_step
from ..comm.header import KIND_IDS

__all__ = ["agree", "announce", "ddp_across_replicas", "differing", "exited", "master_hash", "save_key",
           "saves_ahead", "verify"]

T = TypeVar("T")
_ALL_GATHER = KIND_IDS["all_gather"]  # the kind of the call a failed check stands in for
_PARTS = 4  # a 64-bit value travels as four 16-bit parts, each exact in fp32


def master_hash(masters: Sequence[torch.Tensor]) -> int:
    """64-bit BLAKE2b of the bytes of the fp32 masters, in order."""
    h = hashlib.blake2b(digest_size=8)
    for m in masters:
        h.update(tensor_bytes(m))
    return int.from_bytes(h.digest(), "little")


def _gather64(value: int, group, device: torch.device) -> List[int]:
    """Every replica's 64-bit ``value``, in rank order (one flat fp32 all-gather on ``device``)."""
    mine = torch.tensor([(value >> (16 * i)) & 0xFFFF for i in range(_PARTS)], dtype=torch.float32, device=device)
    rows = torch.empty(dist.get_world_size(group) * _PARTS, dtype=torch.float32, device=device)
    C.all_gather(rows, mine, codec="fp32", group=group)
    parts = rows.view(-1, _PARTS).to(torch.int64).tolist()
    return [sum(int(p) << (16 * i) for i, p in enumerate(row)) for row in parts]


def agree(group, device: torch.device, checks: Callable[[], T], fingerprint: Callable[[T], int], what: str) -> T:
    """``checks()``'s result on every replica, or the same error on every replica: a check that
    raised on some replica, or fingerprints that differ (``what`` names the compared thing)."""
    private = C.private_group(group)
    result = cast(T, in_step(private, _ALL_GATHER, False, checks))  # synchronous: never a Handle
    values = _gather64(fingerprint(result), group, device)
    differing(values, what)
    return result


def differing(values: List[int], what: str) -> None:
    """Raise naming the replicas (ranks of the outer group) unless every value is the same."""
    if len(set(values)) <= 1:
        return
    by_value: dict = {}
    for r, v in enumerate(values):
        by_value.setdefault(v, []).append(r)
    sets = sorted(by_value.values(), key=lambda rs: (-len(rs), rs))
    desc = "; ".join(f"replicas {rs} have {v:016x}" for v, rs in sorted(by_value.items(), key=lambda kv: kv[1]))
    raise RuntimeError(f"flatcomm.diloco: the replicas disagree on {what}: {desc} "
                       f"(replicas {sorted(r for rs in sets[1:] for r in rs)} differ from replicas {sets[0]})")


def verify(group, device: torch.device, masters: Sequence[torch.Tensor], what: str) -> int:
    """Gather every replica's master hash; raise on every replica if any differs (``what``: which
    master, for the message). Returns the hash."""
    h = master_hash(masters)
    differing(_gather64(h, group, device), what)
    return h


def _ddp_wrappers(model: torch.nn.Module) -> list:
    """The live DistributedDataParallel modules that share a parameter with ``model`` (``model``
    itself, one that wraps it, or one that wraps a part of it). A module does not know what wraps
    it: one pass over the objects the garbage collector tracks finds them (once, at construction)."""
    ddp_type = torch.nn.parallel.DistributedDataParallel
    mine = {id(p) for p in model.parameters()}
    found = [o for o in gc.get_objects() if issubclass(type(o), ddp_type)]  # type(): no __class__ lookups
    return [d for d in found if any(id(p) in mine for p in d.parameters())]


def ddp_across_replicas(model: torch.nn.Module, group) -> List[int]:
    """The global ranks of a DistributedDataParallel over ``model`` whose process group holds more
    than one replica of the outer ``group`` (its all-reduce would average the replicas' gradients
    at every inner step); ``[]`` when there is none. A DDP inside one replica (its group the ranks
    of that replica, as docs/diloco.md sets it up) is fine: it meets the outer group in one rank."""
    if not dist.is_initialized():
        return []
    outer = set(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))
    for ddp in _ddp_wrappers(model):
        ranks = dist.get_process_group_ranks(ddp.process_group)
        if len(outer.intersection(ranks)) > 1:
            return sorted(ranks)
    return []


def _key(global_rank: int) -> str:
    return f"flatcomm/diloco/process/{global_rank}"


def announce() -> None:
    """Write where this rank's process runs (host, pid) to the process group's store, so that a
    replica whose sync fails can tell which peers have exited (:func:`exited`). No collective."""
    try:
        dist.distributed_c10d._get_default_store().set(_key(dist.get_rank()), f"{socket.gethostname()} {os.getpid()}")
    except Exception:  # noqa: BLE001 - no store: a failed sync names no replica
        pass


def _pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited
    except OSError:
        return False


def exited(group) -> List[int]:
    """The replicas (ranks of the outer ``group``) on this host whose process has exited, as far as
    the store says (a replica on another host, or without an entry, is not listed)."""
    out = []
    try:
        store = dist.distributed_c10d._get_default_store()
        host = socket.gethostname()
        for r, g in enumerate(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)):
            if g == dist.get_rank() or not store.check([_key(g)]):
                continue
            where, pid = store.get(_key(g)).decode().rsplit(" ", 1)
            if where == host and not _pid_alive(int(pid)):
                out.append(r)
    except Exception:  # noqa: BLE001 - the store went with a dead rank 0: nothing to name
        pass
    return out


def save_key(group, global_rank: int) -> str:
    """The store key where a rank counts the checkpoint saves (``rank_states`` gathers) it entered
    on ``group``: a replica whose sync fails can see that a peer waits in a save it did not make."""
    name = getattr(group if group is not None else dist.group.WORLD, "group_name", "")
    return f"flatcomm/saves/{name}/{global_rank}"


def saves_ahead(group) -> List[int]:
    """Ranks of the outer ``group`` that entered more checkpoint saves (on the world or on
    ``group``) than this rank: they wait in a save this rank never called."""
    def count(store, g, rank: int) -> int:
        key = save_key(g, rank)
        return int(store.get(key).decode()) if store.check([key]) else 0

    try:
        store = dist.distributed_c10d._get_default_store()
        ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
        ahead: set = set()
        for g in {None, group}:  # the world's saves (the adapters') and the outer group's
            mine = count(store, g, dist.get_rank())
            ahead.update(r for r, x in enumerate(ranks) if count(store, g, x) > mine)
        return sorted(ahead)
    except Exception:  # noqa: BLE001 - no store: nothing to tell
        return []

"""Which ranks share a node, and the process groups of the two tiers.

A :class:`Topology` splits the W ranks of a parent group into N nodes of G ranks each. With
``Topology(local_size=G)`` ranks ``[k*G, (k+1)*G)`` form node k (torchrun's numbering); with
:meth:`Topology.from_mesh` the two dimensions of a 2-D ``DeviceMesh`` say it. Each rank belongs to
two subgroups: its node (``intra_group``, ordered by local rank) and the N ranks with its local rank
(``inter_group``, ordered by node). The hierarchical collectives (:mod:`flatcomm.hierarchical`)
reduce inside the node over ``intra_group`` and exchange compressed payloads over ``inter_group``.

With one node (N = 1) or one rank per node (G = 1) there is nothing to split: the topology is
*flat* (``topo.flat``, with ``topo.reason`` saying why) and the collectives run their one-hop path
on the parent group.

Subgroups are created once per (parent group, G, timeout), kept in the parent's context
(:mod:`flatcomm.comm.context`) and destroyed with it: ``dist.new_group`` is itself
a collective that every rank of the job must enter in the same order, so build topologies at a
point every rank reaches (not inside a callback), and build them before the first collective that
uses them.
"""
from __future__ import annotations

import datetime
import os
from typing import List, Mapping, Optional, Tuple

import torch
import torch.distributed as dist

from . import context

__all__ = ["Topology", "group_timeout"]



def group_timeout(group=None) -> Optional[datetime.timedelta]:
    """The timeout the caller gave ``group`` (the default group when None), or None if unknown."""
    pg = group if group is not None else dist.group.WORLD
    for device in ("cpu", "cuda"):
        try:
            return pg._get_backend(torch.device(device)).options._timeout  # type: ignore[union-attr]
        except Exception:  # noqa: BLE001 - no such backend on this group, or a private API change
            continue
    return None


def _alive(group) -> bool:
    try:
        dist.get_world_size(group)
        return True
    except Exception:  # noqa: BLE001 - destroyed with its process group
        return False


def _subgroups(parent, ranks: List[int], local_size: int,
               timeout: Optional[datetime.timedelta]) -> Tuple[object, object]:
    """(my node's group, my local rank's group), created once. Every rank of the job creates every
    subgroup, in the same order (nodes, then local ranks): new_group's contract."""
    ctx = context.of(parent)  # the subgroups are destroyed with the parent
    key = ("topology", local_size, timeout.total_seconds() if timeout is not None else None)
    cached = ctx.get(key)
    if cached is not None and _alive(cached[0]) and _alive(cached[1]):
        return cached
    made = _make_subgroups(parent, ranks, local_size, timeout)
    ctx.set(key, made)
    ctx.on_close(lambda: _destroy(made, ctx.waits))
    return made


def _destroy(made: Tuple[object, object], wait: bool) -> None:
    for g in made:
        context.destroy(g, wait)


def _make_subgroups(parent, ranks: List[int], local_size: int,
                    timeout: Optional[datetime.timedelta]) -> Tuple[object, object]:
    me = dist.get_rank(parent)
    nodes = len(ranks) // local_size
    intra = inter = None
    for k in range(nodes):
        g = dist.new_group(ranks[k * local_size:(k + 1) * local_size], timeout=timeout)
        if me // local_size == k:
            intra = g
    for lr in range(local_size):
        g = dist.new_group(ranks[lr::local_size], timeout=timeout)
        if me % local_size == lr:
            inter = g
    return intra, inter


class Topology:
    """N nodes x G ranks over ``group`` (default: the default group).

    Attributes: ``world`` (W = N*G), ``rank`` (in the parent group), ``local_size`` (G),
    ``nodes`` (N), ``node`` (this rank's node), ``local_rank``, ``flat`` (True when N = 1 or
    G = 1: the collectives then run flat on ``group``), ``reason`` (why flat, else ""),
    ``intra_group`` / ``inter_group`` (None when flat). ``timeout`` (default: the parent
    group's own) is given to the subgroups.
    """

    def __init__(self, local_size: int, *, group=None, timeout: Optional[datetime.timedelta] = None,
                 check: bool = True):
        if not dist.is_initialized():
            raise RuntimeError("flatcomm: Topology needs an initialised torch.distributed process group")
        if isinstance(local_size, bool) or not isinstance(local_size, int) or local_size < 1:
            raise ValueError(f"flatcomm: Topology local_size must be a positive int, got {local_size!r}")
        world = dist.get_world_size(group)
        if world % local_size:
            raise ValueError(
                f"flatcomm: uneven nodes: {world} ranks do not split into nodes of local_size="
                f"{local_size} ({world} = {world // local_size} x {local_size} + {world % local_size}); "
                "every node must hold the same number of ranks")
        if check:
            _agree(group, "local_size", local_size)
        self.group = group
        self.world = world
        self.rank = dist.get_rank(group)
        self.local_size = local_size
        self.nodes = world // local_size
        self.node, self.local_rank = divmod(self.rank, local_size)
        self.timeout = timeout if timeout is not None else group_timeout(group)
        self.flat = self.nodes == 1 or local_size == 1
        self.reason = ("one node (N = 1)" if self.nodes == 1 else
                       "one rank per node (G = 1)" if local_size == 1 else "")
        self.intra_group = self.inter_group = None
        if not self.flat:
            ranks = dist.get_process_group_ranks(group) if group is not None else list(range(world))
            self.intra_group, self.inter_group = _subgroups(group, ranks, local_size, self.timeout)

    @classmethod
    def from_env(cls, *, group=None, timeout: Optional[datetime.timedelta] = None,
                 env: Optional[Mapping[str, str]] = None) -> "Topology":
        """From torchrun's ``LOCAL_WORLD_SIZE`` (ranks numbered node by node); flat when it is not
        set. Every rank must agree (checked: a clear error on every rank, never a hang)."""
        env = os.environ if env is None else env
        raw = env.get("LOCAL_WORLD_SIZE")
        if raw is None:
            topo = cls(1, group=group, timeout=timeout)
            topo.reason = "LOCAL_WORLD_SIZE not set (one rank per node assumed)"
            return topo
        try:
            g = int(raw)
        except ValueError:
            raise ValueError(f"flatcomm: LOCAL_WORLD_SIZE must be an int, got {raw!r}") from None
        _agree(group, "LOCAL_WORLD_SIZE", g)
        local_rank = env.get("LOCAL_RANK")
        rank = dist.get_rank(group)
        if local_rank is not None and g > 0 and int(local_rank) != rank % g:
            raise ValueError(
                f"flatcomm: rank {rank} has LOCAL_RANK={local_rank} but nodes of {g} consecutive "
                f"ranks would make it local rank {rank % g}; build the Topology from a DeviceMesh instead")
        return cls(g, group=group, timeout=timeout, check=False)

    @classmethod
    def from_mesh(cls, mesh, *, inter_dim=0, intra_dim=1) -> "Topology":
        """From a 2-D ``DeviceMesh`` (e.g. HSDP's ``("replicate", "shard")``): ``intra_dim`` spans
        the ranks of a node, ``inter_dim`` the nodes. Uses the mesh's own groups."""
        if mesh.ndim != 2:
            raise ValueError(f"flatcomm: Topology.from_mesh needs a 2-D DeviceMesh, got {mesh.ndim}-D")
        self = cls.__new__(cls)
        self.group = None
        self.local_size = mesh.size(_dim_index(mesh, intra_dim))
        self.nodes = mesh.size(_dim_index(mesh, inter_dim))
        self.world = self.local_size * self.nodes
        self.local_rank = mesh.get_local_rank(intra_dim)
        self.node = mesh.get_local_rank(inter_dim)
        self.rank = self.node * self.local_size + self.local_rank
        self.intra_group = mesh.get_group(intra_dim)
        self.inter_group = mesh.get_group(inter_dim)
        self.timeout = group_timeout(self.intra_group)
        self.flat = self.nodes == 1 or self.local_size == 1
        self.reason = ("one node (N = 1)" if self.nodes == 1 else
                       "one rank per node (G = 1)" if self.local_size == 1 else "")
        if self.flat:
            # The flat path needs one group over all W ranks: the mesh's non-trivial dimension.
            self.group = self.intra_group if self.nodes == 1 else self.inter_group
            self.intra_group = self.inter_group = None
        return self

    def describe(self) -> dict:
        """What stats and logs report: shape, and whether (and why not) hierarchical."""
        return {"nodes": self.nodes, "local_size": self.local_size, "hierarchical": not self.flat,
                "reason": self.reason}

    def __repr__(self) -> str:
        how = f"flat: {self.reason}" if self.flat else "hierarchical"
        return f"Topology({self.nodes} nodes x {self.local_size} ranks, {how})"


def _dim_index(mesh, dim) -> int:
    if isinstance(dim, int):
        return dim
    names = mesh.mesh_dim_names or ()
    if dim not in names:
        raise ValueError(f"flatcomm: DeviceMesh has no dimension {dim!r} (dimensions: {names})")
    return names.index(dim)


def _agree(group, what: str, value: int) -> None:
    """Every rank has the same ``value``, else a ValueError on every rank listing them."""
    world = dist.get_world_size(group)
    if world == 1:
        return
    device = _device_of(group)
    mine = torch.tensor([value], dtype=torch.int64, device=device)
    every = [torch.empty(1, dtype=torch.int64, device=device) for _ in range(world)]
    dist.all_gather(every, mine, group=group)
    values = [int(v) for v in every]
    if len(set(values)) != 1:
        raise ValueError(f"flatcomm: uneven nodes: ranks disagree on {what}: "
                         + ", ".join(f"rank {r}: {v}" for r, v in enumerate(values)))


def _device_of(group) -> torch.device:
    """Where a small tensor must live to be exchanged on ``group`` (NCCL: the current GPU)."""
    if "nccl" in str(dist.get_backend(group)) and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")

"""Hybrid sharding with a compressed cross-node all-reduce: shard inside the node, replicate across.

FSDP2 (HSDP on a 2-D ``DeviceMesh`` of ``("replicate", "shard")``)::

    mesh = init_device_mesh("cuda", (nodes, gpus_per_node), mesh_dim_names=("replicate", "shard"))
    for block in model.blocks: fully_shard(block, mesh=mesh["shard"])
    fully_shard(model, mesh=mesh["shard"])
    hsdp = flatcomm.fsdp.hybrid.apply(model, mesh, "int8")     # cross-node codec

Each module is sharded over its node (the mesh's ``shard`` dimension), so FSDP's reduce-scatter
runs inside the node (flatcomm's lossless ordered reduce-scatter, ``intra_codec``), and the
all-reduce hook (``FSDPModule.set_all_reduce_hook``) averages the reduced shard across nodes with a
flatcomm all-reduce over the ``replicate`` group: ``codec`` with error feedback, the same bits on
every rank. Native HSDP (``fully_shard(mesh=mesh)`` with the 2-D mesh) runs torch's uncompressed
all-reduce *before* the hook, so it is refused with an error that says what to do. As in any
replicated setup, every node must start from the same parameters (same seed, or a broadcast).

FSDP1: ``FullyShardedDataParallel(model, process_group=topology.intra_group, ...)`` (FULL_SHARD
inside the node; torch refuses comm hooks for its HYBRID_SHARD strategies), then
``fsdp.register_comm_hook(HybridFSDP1State("int8", topology=topo, model=fsdp), hybrid_fsdp1_hook)``:
the node reduce-scatter as :func:`flatcomm.fsdp.fsdp1_hook` with ``intra_codec``, then the shard
averaged across nodes with ``codec``. (NO_SHARD units: the whole gradient, two levels, via the
hierarchical all-reduce.)

**Error feedback per tier.** The cross-node tier keeps one :class:`~flatcomm.collectives.ErrorFeedback`
per reduced shard layout (FSDP2: module name and shard size; FSDP1: unit name), full shard size
(this is the flat one-hop all-reduce among the N ranks of one local rank). ``state_dict()`` has
the node tier's residuals (as :mod:`flatcomm.fsdp`, ``rank{r}.{param}``) and this tier's under
``rank{r}.inter.{key}.client`` / ``.server``: every rank's own, for a restart at the same topology.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Optional

import torch
import torch.distributed as dist

from .. import collectives as C
from . import fsdp2 as F
from .fsdp1 import FSDP1State
from .backend import wire_codec
from ..comm import two_level as H
from ..ops.codecs import resolve
from ..comm.topology import Topology

__all__ = ["CrossNode", "HSDP", "apply", "HybridFSDP1State", "hybrid_fsdp1_hook"]


class CrossNode:
    """The cross-node tier: average a reduced shard over ``group`` with ``codec`` + error feedback."""

    def __init__(self, group, codec: Any = "int8", *, error_feedback: bool = True,
                 chunks: Optional[int] = None, block_size: Optional[int] = None):
        self.group = group
        self.codec = resolve(codec, block_size)
        self.error_feedback = bool(error_feedback) and not self.codec.lossless
        self.chunks = chunks
        self.stats = C.CommStats()
        self.ef: Dict[str, C.ErrorFeedback] = {}
        self._validated: set = set()

    def __call__(self, key: str, shard: torch.Tensor) -> None:
        flat = shard.view(-1) if shard.is_contiguous() else None
        if flat is None:
            raise ValueError("flatcomm: the reduced shard must be contiguous")
        ef = None
        if self.error_feedback:
            ef = self.ef.get(key)
            if ef is None or ef.client.numel() != flat.numel():
                ef = self.ef[key] = C.ErrorFeedback.zeros(flat.numel(), flat.device)
        sig = (key, flat.numel(), flat.dtype)
        validate = sig not in self._validated  # the consistency round trip once per layout
        self._validated.add(sig)
        C.all_reduce(flat, codec=wire_codec(self.codec, flat.dtype), op="avg", group=self.group,
                     residual=ef, chunks=self.chunks, stats=self.stats, validate=validate)

    def state_dict(self, prefix: str) -> Dict[str, torch.Tensor]:
        sd = {}
        for key, ef in self.ef.items():
            sd[f"{prefix}inter.{key}.client"] = ef.client.clone()
            sd[f"{prefix}inter.{key}.server"] = ef.server.clone()
        return sd

    def load_state_dict(self, sd: Dict[str, torch.Tensor], prefix: str) -> Dict[str, torch.Tensor]:
        """Take this tier's entries (this rank's); return the others."""
        head = f"{prefix}inter."
        rest, ef = {}, {}
        for k, v in sd.items():
            if k.startswith(head) and k.endswith(".client"):
                key = k[len(head):-len(".client")]
                server = sd.get(f"{head}{key}.server")
                if server is None:
                    raise KeyError(f"flatcomm: checkpoint has {k} without its .server")
                ef[key] = C.ErrorFeedback(v.detach().float().clone(), server.detach().float().clone())
            elif not k.startswith(head):  # other ranks' entries are ignored downstream too
                rest[k] = v
        if self.error_feedback:
            self.ef = ef
        return rest


def _prefix() -> str:
    return f"rank{dist.get_rank()}." if dist.is_initialized() else "rank0."


# ---- FSDP2 ---------------------------------------------------------------------------------------


class HSDP:
    """What :func:`apply` returns: ``rs`` (the node tier, a :class:`flatcomm.fsdp.ReduceScatter`),
    ``cross`` (the cross-node tier), ``topology``, and the checkpoint of both tiers."""

    def __init__(self, rs: F.ReduceScatter, cross: CrossNode, topology: Topology):
        self.rs, self.cross, self.topology = rs, cross, topology

    def hook_for(self, name: str) -> Callable[[torch.Tensor], None]:
        def hook(reduce_output: torch.Tensor) -> None:
            self.cross(f"{name or '<root>'}.{reduce_output.numel()}", reduce_output)

        return hook

    def state_dict(self) -> Dict[str, torch.Tensor]:
        return {**self.rs.state_dict(), **self.cross.state_dict(_prefix())}

    def load_state_dict(self, sd: Dict[str, torch.Tensor]) -> None:
        self.rs.load_state_dict(self.cross.load_state_dict(sd, _prefix()))


def apply(model: torch.nn.Module, mesh, codec: Any = "int8", *, intra_codec: Any = "fp32",
          error_feedback: bool = True, chunks: Optional[int] = None, block_size: Optional[int] = None,
          replicate_dim: Any = "replicate", shard_dim: Any = "shard", weights: Any = None,
          keep_fp32: Any = None) -> HSDP:
    """Node reduce-scatter with ``intra_codec`` and cross-node all-reduce with ``codec`` on every
    ``FSDPModule`` of ``model`` (sharded over ``mesh[shard_dim]``; see the module docstring).
    ``weights`` / ``keep_fp32``: quantized weight all-gathers (inside the node), as in
    :func:`flatcomm.fsdp.apply`."""
    from torch.distributed.fsdp import FSDPModule

    topo = Topology.from_mesh(mesh, inter_dim=replicate_dim, intra_dim=shard_dim)
    mods = [(n, m) for n, m in model.named_modules() if isinstance(m, FSDPModule)]
    if not mods:
        raise ValueError("flatcomm.fsdp.hybrid.apply: no FSDPModule in the model (call fully_shard first)")
    for name, m in mods:
        # from the sharded parameters' DTensor placements (public), as flatcomm.fsdp lays them out
        for p in F.managed_params(m):
            lay = F.shard_layout(p)
            if lay is None:
                continue
            if lay[2]:
                raise ValueError(
                    f"flatcomm: module {name or '<root>'} uses native HSDP (fully_shard with the 2-D mesh), "
                    "whose uncompressed all-reduce runs before any hook; shard it with "
                    f"fully_shard(module, mesh=mesh[{shard_dim!r}]) and let flatcomm replicate across nodes")
            if lay[1] != topo.local_size:
                raise ValueError(f"flatcomm: module {name or '<root>'} is sharded over "
                                 f"{lay[1]} ranks, not the mesh's {topo.local_size} "
                                 f"(its {shard_dim!r} dimension)")
    rs = F.apply(model, intra_codec, error_feedback=error_feedback, weights=weights, keep_fp32=keep_fp32)
    # One node: nothing to replicate. One rank per node: the replicate group is the topology's.
    group = topo.inter_group if not topo.flat else topo.group
    cross = CrossNode(group, codec, error_feedback=error_feedback, chunks=chunks, block_size=block_size)
    out = HSDP(rs, cross, topo)
    if topo.nodes > 1:
        for name, m in mods:
            m.set_all_reduce_hook(out.hook_for(name))
    return out


# ---- FSDP1 ---------------------------------------------------------------------------------------


class HybridFSDP1State(FSDP1State):
    """:class:`flatcomm.fsdp.FSDP1State` for FSDP1 sharded over ``topology.intra_group``, plus the
    cross-node tier (``codec``; the node tier uses ``intra_codec``, default lossless)."""

    def __init__(self, codec: Any = "int8", *, topology: Topology, intra_codec: Any = "fp32",
                 error_feedback: bool = True, chunks: Optional[int] = None, block_size: Optional[int] = None,
                 model: Optional[torch.nn.Module] = None):
        if topology.flat:
            raise ValueError(f"flatcomm: {topology!r} is flat; use flatcomm.fsdp.FSDP1State")
        super().__init__(intra_codec, error_feedback=error_feedback, chunks=chunks, model=model,
                         group=topology.intra_group)
        self.topology = topology
        self.cross = CrossNode(topology.inter_group, codec, error_feedback=error_feedback, chunks=chunks,
                               block_size=block_size)
        self.inter_codec = self.cross.codec

    def state_dict(self) -> Dict[str, torch.Tensor]:
        return {**super().state_dict(), **self.cross.state_dict(self._prefix())}

    def load_state_dict(self, state_dict: Dict[str, torch.Tensor]) -> None:
        super().load_state_dict(self.cross.load_state_dict(state_dict, self._prefix()))

    def communicate(self, grad: torch.Tensor, output: Optional[torch.Tensor] = None) -> None:
        """The node tier as :meth:`FSDP1State.communicate`, then the cross-node tier."""
        name, _ = self._unit(grad.numel())
        if output is None:  # NO_SHARD: the whole gradient, two levels (the residual: this rank's shard's)
            flat = grad if grad.is_contiguous() else grad.contiguous()
            ef = None
            if self.cross.error_feedback:
                m = H.shard_numel(flat.numel(), self.topology, self.inter_codec)
                ef = self.cross.ef.get(name)
                if ef is None or ef.client.numel() != m:
                    ef = self.cross.ef[name] = C.ErrorFeedback.zeros(m, flat.device)
            C.all_reduce(flat, codec=self.inter_codec, topology=self.topology, residual=ef, stats=self.counters)
            if flat is not grad:
                grad.copy_(flat)
            return None
        super().communicate(grad, output)
        self.cross(name, output)
        return None


def hybrid_fsdp1_hook(state: HybridFSDP1State, grad: torch.Tensor, output: Optional[torch.Tensor] = None) -> None:
    """FSDP1 comm hook: node tier as :func:`flatcomm.fsdp.fsdp1_hook`, then the cross-node tier."""
    state.communicate(grad, output)

"""An island: the ranks of one site that train one replica of the model together (DDP, FSDP2, or a
plain module) over fast links, and meet the *same rank* of every other island in the quorum.

What rank ``i`` of an island of ``W`` ranks syncs with rank ``i`` of the other islands, its *part*:

* **FSDP2** (the trainable parameters are DTensors, ``fully_shard``): its local shards, whole. They
  are already a disjoint part of the model; after a sync the rank writes its new master into its
  shards and nothing moves inside the island.
* **DDP, or a module replicated on the island's ranks**: share ``i`` of the ``W`` equal runs of the
  flat parameters (:func:`flatcomm.diloco.split`: registration order, a cut moves to a parameter
  boundary when one is near). After every round the ranks all-gather their new master shares on
  the island's group (:meth:`Island.gather`, before the commit, so that a failure there commits
  nothing) and every rank writes the whole model: the island's replicas stay equal, and DDP's
  next all-reduce starts from equal weights.

An island of one rank (``group=None``) is the one-process replica of
:class:`~flatcomm.elastic.ElasticDiLoCo`'s first release: its part is the whole model.

The island's group is the user's (torchrun's default group, typically): gloo for CPU parameters,
NCCL for CUDA ones. The gather waits at most the manager's timeout; a rank that dies makes its
island's peers fail (in DDP's or FSDP's next collective, or in this gather) and the launcher
(torchrun: every worker of a failed agent is stopped and restarted) takes the whole island out:
never half of it.
"""
from __future__ import annotations

from datetime import timedelta
from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ..comm.header import all_gather_single
from ..diloco.schedule import Piece, local_tensor, split

__all__ = ["Island"]

Named = List[Tuple[str, torch.nn.Parameter]]


def _is_dtensor(p: torch.Tensor) -> bool:
    return isinstance(getattr(p, "_local_tensor", None), torch.Tensor)


def write(pieces: Sequence[Piece], flat: torch.Tensor) -> None:
    """Set the values of ``pieces`` from ``flat`` (their values in order, fp32, any device)."""
    for p, src in zip(pieces, flat.split([x.stop - x.start for x in pieces])):
        t = local_tensor(p.param)
        with torch.no_grad():
            if t.is_contiguous():
                t.detach().view(-1)[p.start:p.stop].copy_(src, non_blocking=True)
            else:  # whole (split never cuts a non-contiguous parameter): write through its shape
                t.copy_(src.view(t.shape))


class Island:
    """The island this rank belongs to: its group (None: an island of one rank), its rank and
    size in it, and which part of the model the rank syncs (:meth:`part`)."""

    def __init__(self, group: Optional[dist.ProcessGroup] = None) -> None:
        if group is not None and not isinstance(group, dist.ProcessGroup):
            raise TypeError(f"flatcomm.elastic: island must be a torch.distributed ProcessGroup (the island's "
                            f"ranks) or None, got {type(group).__name__}")
        self.group = group
        self.rank = 0 if group is None else dist.get_rank(group)
        self.size = 1 if group is None else dist.get_world_size(group)
        self.kind = "single"  # set by part(): "single", "fsdp" or "replicated"
        self._shares: List[List[Piece]] = []

    def part(self, named: Named) -> List[Piece]:
        """This rank's part of the trainable parameters ``named`` (see the module's doc)."""
        if not named:
            raise ValueError("flatcomm.elastic: the model has no parameters that require grad")
        sharded = [_is_dtensor(p) for _, p in named]
        if any(sharded):
            if not all(sharded):
                plain = [n for (n, _), s in zip(named, sharded) if not s][:3]
                raise ValueError(f"flatcomm.elastic: some parameters are FSDP2 shards and some are not ({plain}); "
                                 f"shard the whole model with fully_shard, or none of it")
            self.kind = "fsdp"
            return split(named, 1)[0]
        if self.size == 1:
            self.kind = "single"
            return split(named, 1)[0]
        self.kind = "replicated"
        self._shares = split(named, self.size)
        return self._shares[self.rank]

    @property
    def gathers(self) -> bool:
        """Whether a round ends with an all-gather of the new master inside the island."""
        return self.kind == "replicated"

    def gather(self, share: torch.Tensor, timeout: timedelta) -> torch.Tensor:
        """Every rank's ``share`` (its new master part), concatenated in rank order: the whole
        model's flat master, on the device the island's group works on."""
        sizes = [sum(p.stop - p.start for p in s) for s in self._shares]
        width = max(sizes)
        device = torch.device("cpu")  # gloo: from host buffers; NCCL: on the parameters' device
        if dist.get_backend(self.group) == "nccl":
            device = local_tensor(self._shares[0][0].param).device
        mine = torch.zeros(width, dtype=torch.float32, device=device)
        mine[:share.numel()].copy_(share)
        rows = torch.empty(self.size * width, dtype=torch.float32, device=device)
        work = all_gather_single(rows, mine, group=self.group, async_op=True)
        if not work.wait(timeout):
            raise TimeoutError(f"flatcomm.elastic: the island's all-gather of the new master took over {timeout}")
        return torch.cat([rows[r * width:r * width + n] for r, n in enumerate(sizes)])

    def barrier(self, timeout: timedelta) -> bool:
        """Whether every rank of the island reached this call within ``timeout`` (False on an error)."""
        if self.group is None:
            return True
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(self.group) == "nccl" \
            else torch.device("cpu")
        try:
            return bool(dist.all_reduce(torch.ones(1, device=device), group=self.group, async_op=True).wait(timeout))
        except Exception:  # noqa: BLE001 - a rank of the island is gone: the caller is leaving anyway
            return False

    def write_all(self, full: torch.Tensor) -> None:
        """Set every parameter of the model from the island's whole flat master ``full``."""
        for share, flat in zip(self._shares, full.split([sum(p.stop - p.start for p in s) for s in self._shares])):
            write(share, flat)

    def describe(self) -> Tuple[int, int, str]:
        """(rank, size, kind): what a heal state and the configuration's fingerprint carry."""
        return self.rank, self.size, self.kind

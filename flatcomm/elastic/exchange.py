"""One outer sync's exchange over a quorum: who contributes, the residuals' fold, the sum, the check.

Every member of the quorum takes part in every exchange (a collective), but only the replicas that
trained since the last sync *contribute*: a replica that healed in this quorum (or joined) sends
zeros and is not counted. The average is ``sum / contributors``, so a joiner neither dilutes the
survivors' pseudo-gradients nor doubles its donor's (torchft 0.2's DiLoCo sends the donor's
mid-interval weights and counts those steps twice).

The sum is flatcomm's ``op="sum"`` with the plan's codec and error feedback (ordered: a two-stage
all-reduce; exact with a lossy codec: an all-gather of the encoded payloads, summed in exact fixed
point; exact fp32: the exact all-reduce), so every member gets the same bits. The residual rule
under membership change (docs/semantics.md, "Error feedback when replicas come and go"):
the server residual of a two-stage sum covers the shard this replica reduced, which depends on its
rank and the quorum's size; when either changed since its last committed sync it is folded into the
client residual (``client += server; server = 0``): the next sum adds the same total.
"""
from __future__ import annotations

import dataclasses
from typing import List, Optional, Tuple

import torch

from .. import collectives as C
from ..diloco import replicas
from ..ops.codecs import Codec
from ..ops.sums import exact_sum

__all__ = ["Layout", "Mismatch", "Plan", "agree", "contributors", "fold", "sum_over", "verify"]

Layout = Tuple[int, int]  # (rank, size) in the quorum of a sync: which shard the server residual covers


class Mismatch(RuntimeError):
    """A disagreement between replicas that no retry fixes: raised, never reported to torchft."""


@dataclasses.dataclass(frozen=True)
class Plan:
    """How every sync of a run is summed (the same on every replica; the quorum's size is not
    part of it: it changes)."""
    codec: Codec
    mode: str
    error_feedback: bool

    @property
    def feedback(self) -> bool:
        return self.error_feedback and not self.codec.lossless

    @property
    def gathered(self) -> bool:
        """exact mode with a lossy codec: all-gather the encoded payloads, sum them exactly."""
        return self.mode == "exact" and not self.codec.lossless

    def residual_shapes(self, numel: int) -> List[int]:
        """The residuals a replica keeps: client (+ server of a two-stage sum), or none."""
        if not self.feedback:
            return []
        return [numel] if self.gathered else [numel, numel]


def contributors(group, contributes: bool) -> int:
    """How many members of ``group`` contribute to this sync (a small all-gather: agreed by all)."""
    rows = torch.empty(group.size(), dtype=torch.float32)
    C.all_gather(rows, torch.tensor([1.0 if contributes else 0.0]), codec="fp32", group=group)
    return int(rows.sum().item())


def fold(plan: Plan, residuals: List[torch.Tensor], before: Optional[Layout], now: Layout) -> bool:
    """Fold the server residual into the client one when this member's shard moved; returns
    whether it did. ``before``: the layout of the last committed sync (None: none yet)."""
    if len(residuals) != 2 or before == now:
        return False
    residuals[0].add_(residuals[1])
    residuals[1].zero_()
    return True


def sum_over(plan: Plan, group, delta: torch.Tensor, residuals: List[torch.Tensor],
             stats: C.CommStats) -> torch.Tensor:
    """The sum over ``group`` of every member's ``delta`` (consumed), with the working
    ``residuals`` updated in place; the same bits on every member."""
    if plan.gathered:
        rows = torch.empty(group.size() * delta.numel(), dtype=torch.float32, device=delta.device)
        C.all_gather(rows, delta, codec=plan.codec, residual=residuals[0] if residuals else None,
                     group=group, stats=stats)
        return exact_sum(rows.view(group.size(), -1))
    fb = C.ErrorFeedback(residuals[0], residuals[1]) if residuals else None
    C.all_reduce(delta, codec=plan.codec, op="sum", mode=plan.mode, residual=fb, group=group, stats=stats)
    return delta


def agree(group, contributes: bool, ok: bool, fingerprint: int, step: int) -> int:
    """The number of contributors of this round; raises on every member if a member could not join
    it (a transient failure) or if the configurations' fingerprints differ (:class:`Mismatch`)."""
    parts = [float(contributes), float(ok)] + [float((fingerprint >> (16 * i)) & 0xFFFF) for i in range(3)]
    rows = torch.empty(group.size() * 5, dtype=torch.float32)
    C.all_gather(rows, torch.tensor(parts), codec="fp32", group=group)
    table = rows.view(-1, 5).to(torch.int64).tolist()
    try:
        replicas.differing([sum(v << (16 * i) for i, v in enumerate(row[2:])) for row in table],
                           "the elastic DiLoCo configuration")
    except RuntimeError as e:
        raise Mismatch(str(e)) from None
    failed = [i for i, row in enumerate(table) if not row[1]]
    if failed:
        raise RuntimeError(f"flatcomm.elastic: replica(s) {failed} of the quorum could not join the sync after "
                           f"inner step {step} (healing or the group's set-up failed): nothing is committed")
    return sum(row[0] for row in table)


def verify(group, tensors: List[torch.Tensor], step: int) -> None:
    """Raise :class:`Mismatch` on every member unless ``tensors`` (the new master part, the data
    position) hash equal across ``group``."""
    try:
        replicas.verify(group, torch.device("cpu"), tensors, f"the fp32 master after inner step {step}")
    except RuntimeError as e:
        if "disagree" in str(e):
            raise Mismatch(str(e)) from None
        raise

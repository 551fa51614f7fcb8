"""The outer all-reduce of one fragment's pseudo-gradient, through :mod:`flatcomm.collectives`.

``mode="ordered"``: one all-reduce (avg) with ``codec``, flat on ``group`` or two-level on a
``topology``, with error feedback (:class:`flatcomm.ErrorFeedback`; a two-level call's is the
inter tier's, :class:`flatcomm.hierarchical.TieredFeedback`): the same bits on every replica.

``mode="exact"``: the average must not depend on the replicas' order. fp32 runs flatcomm's exact
all-reduce (int64 fixed point). A lossy codec cannot be re-encoded mid-way without depending on
who reduces what, so each replica's payload is all-gathered encoded (its client residual keeps
what was not sent), every replica decodes every payload and sums the rows in exact fixed point
(:func:`flatcomm.ops.sums.exact_sum`): any permutation of the replicas gives the same bits.

The call works on copies (the pseudo-gradient is fresh, the residuals are fp32 copies) and returns
a :class:`Pending`; nothing of the fragment's state changes until the caller commits the result.
"""
from __future__ import annotations

import time
from typing import Any, List, Optional

import torch
import torch.distributed as dist

from .. import collectives as C
from .. import hierarchical as H
from ..ops.codecs import Codec
from ..ops.sums import exact_sum

__all__ = ["GATHERED_UP_TO", "Pending", "Plan", "default_mode", "launch"]

# DiLoCo's default sum (``mode=None``), as the frontier measured it (docs/diloco.md, "Which sum to
# use"): a chunked sparse codec (sparse, sparse4, sparse1) is gathered and summed exactly on a flat
# group of up to this many replicas (at 2 the same bytes as the two-stage sum and a lower loss; at 4
# the gathered sum led at equal bytes); other codecs, two-level syncs and more replicas (where the
# gathered bytes grow as R - 1) take the two-stage ordered sum.
GATHERED_UP_TO = 4


def default_mode(codec: Codec, world: int, two_level: bool) -> str:
    """The sum ``mode=None`` runs for ``codec`` among ``world`` replicas."""
    return "exact" if codec.chunked and not two_level and world <= GATHERED_UP_TO else "ordered"


class Plan:
    """How every outer all-reduce of this run is made (codec, mode, where, error feedback)."""

    def __init__(self, codec: Codec, mode: Optional[str], group, topology, error_feedback: bool,
                 error_decay: float = 1.0) -> None:
        self.codec, self.topology = codec, topology
        self.requested_mode = mode  # None: default_mode(), per codec (codec="auto" may change it)
        # SparseLoCo's decayed accumulator: the client residual is scaled by this before each sync
        # (1.0: plain error feedback).
        self.error_decay = float(error_decay)
        self.group = topology.group if topology is not None else group
        self.two_level = topology is not None and not topology.flat
        self.error_feedback = bool(error_feedback)
        self.world = dist.get_world_size(self.group)
        # the mode as configured (checkpoints match it): as asked, else the configured codec's default
        self.config_mode = self.mode_for(codec)
        self.auto: Optional[Any] = None  # codec="auto": its knobs (flatcomm.diloco.auto.Auto); the codec is its choice
        self.set_codec(codec)

    def set_codec(self, codec: Codec, error_decay: Optional[float] = None) -> None:
        """Sync with ``codec`` from the next launch on (``codec="auto"``'s choice: every candidate
        keeps the residuals of a flat sync in the same shapes; fp32 keeps none in use), decaying the
        residual by ``error_decay`` (None: the configured decay; auto's sparse recipe has its own)."""
        self.codec = codec
        self.decay = self.error_decay if error_decay is None else float(error_decay)
        self.feedback = self.error_feedback and not codec.lossless
        self.mode = self.mode_for(codec)
        self.gathered = self.gathers(codec)

    def mode_for(self, codec: Codec) -> str:
        """The sum a sync with ``codec`` runs: as asked, else :func:`default_mode`."""
        return self.requested_mode or default_mode(codec, self.world, self.two_level)

    def gathers(self, codec: Codec) -> bool:
        """Whether a sync with ``codec`` is all-gathered and summed exactly (else all-reduced)."""
        return self.mode_for(codec) == "exact" and not codec.lossless

    def where(self) -> dict:
        return {"topology": self.topology} if self.topology is not None else {"group": self.group}

    def residual_shapes(self, numel: int) -> List[int]:
        """Numels of the residual tensors one fragment of ``numel`` values keeps."""
        if not self.feedback:
            return []
        if self.gathered:
            return [numel]  # the sender's encoding only
        if self.two_level:
            n = H.shard_numel(numel, self.topology, self.codec)
            return [n, n]
        return [numel, numel]

    def feedback_of(self, residuals: List[torch.Tensor]):
        if not residuals:
            return None
        if self.gathered:
            return residuals[0]
        fb = C.ErrorFeedback(residuals[0], residuals[1])
        return H.TieredFeedback(fb, None) if self.two_level else fb


class Pending:
    """One fragment's outer all-reduce in flight (or finished and held, e.g. after a checkpoint)."""

    def __init__(self, fragment: int, started: int, handle, delta: torch.Tensor, residuals: List[torch.Tensor],
                 rows: Optional[torch.Tensor], stats: C.CommStats) -> None:
        self.fragment, self.started = fragment, started
        self._handle, self._delta, self.residuals = handle, delta, residuals
        self._rows, self.stats = rows, stats
        self.launched = time.perf_counter()
        self.waited_s = 0.0

    @classmethod
    def done(cls, fragment: int, started: int, delta: torch.Tensor, residuals: List[torch.Tensor]) -> "Pending":
        """A finished all-reduce (restored from a checkpoint)."""
        return cls(fragment, started, None, delta, residuals, None, C.CommStats())

    @property
    def finished(self) -> bool:
        return self._handle is None

    def wait(self, world: int) -> torch.Tensor:
        """The averaged pseudo-gradient (raises the collective's error on every replica)."""
        if self._handle is not None:
            t0 = time.perf_counter()
            try:
                self._handle.wait()
            finally:
                self.waited_s += time.perf_counter() - t0
            self._handle = None
            if self._rows is not None:  # exact mode, lossy codec: sum the decoded rows
                self._delta = exact_sum(self._rows.view(world, -1)).div_(world)
                self._rows = None
        return self._delta


def launch(plan: Plan, fragment: int, started: int, delta: torch.Tensor, residuals: List[torch.Tensor]) -> Pending:
    """Start the all-reduce of ``delta`` (consumed) with the fp32 working ``residuals``."""
    stats = C.CommStats()
    if residuals and plan.decay != 1.0:
        residuals[0].mul_(plan.decay)  # a working copy: committed only if the sync succeeds
    fb = plan.feedback_of(residuals)
    if plan.gathered:
        rows = torch.empty(plan.world * delta.numel(), dtype=torch.float32, device=delta.device)
        h = C.all_gather(rows, delta, codec=plan.codec, residual=fb, async_op=True, stats=stats, **plan.where())
        return Pending(fragment, started, h, delta, residuals, rows, stats)
    h = C.all_reduce(delta, codec=plan.codec, mode=plan.mode, residual=fb, async_op=True, stats=stats,
                     **plan.where())
    return Pending(fragment, started, h, delta, residuals, None, stats)

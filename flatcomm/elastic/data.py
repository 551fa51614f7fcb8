"""Where the data stream is, so that a healed island resumes at the batch the schedule says.

:class:`BatchStream` is the run's *global* batch order, the same on every island: each epoch is
a permutation of the sample indices drawn from a generator; global batch ``n`` of the epoch holds
``islands x ranks x batch`` samples, and rank ``r`` of island ``k`` reads its slice of it
(:meth:`BatchStream.next`). Every rank of every island calls ``next`` once per inner step, so the
stream's state (``epoch``, ``position``: global batches read in this epoch, ``generator``: the
generator's state when this epoch's permutation was drawn) is the same everywhere at a sync.
:class:`~flatcomm.elastic.ElasticDiLoCo` (``data=``) saves it with every committed sync and hands
it to a healing island with the master, so the island's next batch is the schedule's next one.

**The global batch while an island is out.** The schedule is a function of the inner step: at step
``t`` the global batch is the same whoever is alive. An island that is out reads nothing: its
slices of those steps are skipped (never read by anyone, never re-read later); the survivors'
inner steps keep their per-rank batch size, and the outer average divides by the islands that
contributed (the sync's ``contributors``). So while an island is out the effective global batch
shrinks by its share, the learning rates are unchanged, and no sample is seen twice.

**The lost interval.** An island that dies between two syncs loses its slices from its last
committed sync to its death (read and trained, never committed), and skips those from its death to
the sync it heals at; it reads the next step's slice after the heal. Its batches are the
failure-free schedule's minus that interval, in order, none twice (``tests/test_islands.py``).

Any object with ``state_dict()`` / ``load_state_dict()`` whose state is the same on every island
at a sync can be passed as ``data=`` instead (e.g. a stateful loader over the global order).
"""
from __future__ import annotations

from typing import Any, Dict, Iterator, Tuple

import torch

__all__ = ["BatchStream"]


def _count(v: Any, what: str, lo: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise ValueError(f"flatcomm.elastic: {what} must be an int >= {lo}, got {v!r}")
    return v


class BatchStream:
    """The global batch order of ``samples`` samples for ``islands`` islands of ``ranks`` ranks
    reading ``batch`` samples each per inner step, reshuffled every epoch (seeded by ``seed``)."""

    def __init__(self, samples: int, batch: int, islands: int, ranks: int = 1, seed: int = 0) -> None:
        self.batch, self.islands, self.ranks = (_count(batch, "batch", 1), _count(islands, "islands", 1),
                                                _count(ranks, "ranks", 1))
        self.samples, self.seed = _count(samples, "samples", 1), _count(seed, "seed", 0)
        self.per_epoch = self.samples // self.global_batch
        if self.per_epoch < 1:
            raise ValueError(f"flatcomm.elastic: {samples} samples do not fill one global batch of "
                             f"{self.global_batch} ({islands} islands x {ranks} ranks x {batch})")
        self._generator = torch.Generator().manual_seed(seed)
        self.epoch, self.position = 0, 0
        self._start_epoch(self._generator.get_state())

    @property
    def global_batch(self) -> int:
        return self.batch * self.islands * self.ranks

    def _start_epoch(self, state: torch.Tensor) -> None:
        self._epoch_state = state.clone()  # what the state_dict carries: the permutation is redrawn from it
        self._generator.set_state(state)
        self._order = torch.randperm(self.samples, generator=self._generator)

    def next(self, island: int, rank: int = 0) -> torch.Tensor:
        """The sample indices island ``island``'s rank ``rank`` reads at this inner step; advances
        the stream by one global batch (every rank of every live island calls it once a step)."""
        if not (0 <= island < self.islands and 0 <= rank < self.ranks):
            raise ValueError(f"flatcomm.elastic: island {island} rank {rank} is outside the stream's "
                             f"{self.islands} islands x {self.ranks} ranks")
        if self.position == self.per_epoch:
            self.epoch, self.position = self.epoch + 1, 0
            self._start_epoch(self._generator.get_state())
        base = self.position * self.global_batch + (island * self.ranks + rank) * self.batch
        self.position += 1
        return self._order[base:base + self.batch].clone()

    def state_dict(self) -> Dict[str, Any]:
        return {"epoch": self.epoch, "position": self.position, "generator": self._epoch_state.clone(),
                "shape": [self.samples, self.batch, self.islands, self.ranks, self.seed]}

    def load_state_dict(self, sd: Dict[str, Any]) -> None:
        shape = [self.samples, self.batch, self.islands, self.ranks, self.seed]
        if not isinstance(sd, dict) or sorted(sd) != ["epoch", "generator", "position", "shape"]:
            raise ValueError(f"flatcomm.elastic: a BatchStream state has epoch, position, generator and shape, "
                             f"got {sorted(sd) if isinstance(sd, dict) else type(sd).__name__}")
        if list(sd["shape"]) != shape:
            raise ValueError(f"flatcomm.elastic: the stream state is of samples/batch/islands/ranks/seed "
                             f"{list(sd['shape'])}, this stream's are {shape}")
        if not (isinstance(sd["generator"], torch.Tensor) and sd["generator"].dtype == torch.uint8):
            raise ValueError("flatcomm.elastic: the stream state's generator must be a uint8 tensor")
        epoch, position = _count(sd["epoch"], "epoch", 0), _count(sd["position"], "position", 0)
        if position > self.per_epoch:
            raise ValueError(f"flatcomm.elastic: stream position {position} past the epoch's {self.per_epoch}")
        self._start_epoch(sd["generator"])
        self.epoch, self.position = epoch, position


def schedule(stream_args: Tuple[int, int, int, int, int], steps: int, island: int,
             rank: int = 0) -> Iterator[Tuple[int, torch.Tensor]]:
    """(inner step from 1, indices) of island ``island``'s rank ``rank`` over ``steps`` failure-free
    steps of a fresh ``BatchStream(*stream_args)``: the reference a run's batches are checked against."""
    s = BatchStream(*stream_args)
    for t in range(1, steps + 1):
        yield t, s.next(island, rank)

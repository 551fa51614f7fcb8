"""The process group torchft reconfigures for each quorum, made so flatcomm's collectives run on it.

torchft's ``ProcessGroupGloo`` makes, at every new quorum, a plain gloo group on a fresh store prefix
(``<store>/torchft/<quorum_id>/<group_rank>``), outside the default world: torch.distributed does
not list it, so ``dist.get_rank(group)`` and ``dist.new_group`` cannot serve flatcomm. A
:class:`QuorumGroup` is that same torchft group, except that each quorum's gloo group is made by
:func:`flatcomm.comm.standalone.gloo_group`: with flatcomm's private copy beside it (under the
quorum's prefix + ``flatcomm/private``) and adopted, so ``flatcomm.all_reduce(..., group=
quorum_group.current())`` runs there. Both groups wait at most ``timeout`` for anything.
"""
from __future__ import annotations

from datetime import timedelta

from torchft.process_group import ProcessGroupGloo

from ..comm import standalone

__all__ = ["QuorumGroup"]


class QuorumGroup(ProcessGroupGloo):
    """torchft's reconfigurable gloo group (pass it as ``Manager(pg=...)``) whose quorum groups
    flatcomm's collectives can use (:meth:`current`).

    Args:
        timeout: the bound of every operation on a quorum's group and of its set-up.
    """

    def __init__(self, timeout: timedelta = timedelta(seconds=60)) -> None:
        if not isinstance(timeout, timedelta) or timeout.total_seconds() <= 0:
            raise ValueError(f"flatcomm.elastic: timeout must be a positive timedelta, got {timeout!r}")
        super().__init__(timeout=timeout)

    def _create_pg(self, store, rank: int, world_size: int):
        # Called by torchft's configure() for each new quorum, on the manager's quorum thread.
        return standalone.gloo_group(store, rank, world_size, self._timeout)

    def current(self):
        """The gloo group of the current quorum (adopted by flatcomm)."""
        if self._pg is None:
            raise RuntimeError("flatcomm.elastic: no quorum yet (or its group was aborted): call "
                               "manager.start_quorum() first")
        return self._pg

    def getBackendName(self) -> str:
        return "flatcomm-torchft-gloo"

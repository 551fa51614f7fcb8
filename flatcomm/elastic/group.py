"""The process group torchft reconfigures for each quorum, made so flatcomm's collectives run on it.

torchft's ``ProcessGroupGloo`` makes, at every new quorum, a plain gloo group on a fresh store prefix
(``<store>/torchft/<quorum_id>/<group_rank>``), outside the default world: torch.distributed does
not list it, so ``dist.get_rank(group)`` and ``dist.new_group`` cannot serve flatcomm. A
:class:`QuorumGroup` is that same torchft group, except that each quorum's gloo group is made by
:func:`flatcomm.comm.standalone.gloo_group`: with flatcomm's private copy beside it (under the
quorum's prefix + ``flatcomm/private``) and adopted, so ``flatcomm.all_reduce(..., group=
quorum_group.current())`` runs there. Both groups' operations wait at most ``timeout``; their set-up
at most ``rendezvous_timeout``: every member of a quorum heads for the rendezvous the moment the
lighthouse issues it, so a member missing after a few seconds has died (killed between the quorum's
forming and its rendezvous), and the survivors fail this round then, not after a collective's timeout.
"""
from __future__ import annotations

from datetime import timedelta

from torchft.process_group import ProcessGroupGloo

from ..comm import standalone

__all__ = ["QuorumGroup", "RENDEZVOUS_TIMEOUT"]

# Members reach a new quorum's rendezvous within a second of each other on a loaded host; five
# seconds leaves room for a stalled one and is still far below a collective's timeout.
RENDEZVOUS_TIMEOUT = timedelta(seconds=5)


class QuorumGroup(ProcessGroupGloo):
    """torchft's reconfigurable gloo group (pass it as ``Manager(pg=...)``) whose quorum groups
    flatcomm's collectives can use (:meth:`current`).

    Args:
        timeout: the bound of every operation on a quorum's group.
        rendezvous_timeout: the bound of a quorum group's set-up (at most ``timeout``).
    """

    def __init__(self, timeout: timedelta = timedelta(seconds=60),
                 rendezvous_timeout: timedelta = RENDEZVOUS_TIMEOUT) -> None:
        standalone.check_timeout("timeout", timeout)  # refused here, not at the first quorum
        standalone.check_timeout("rendezvous_timeout", rendezvous_timeout)
        super().__init__(timeout=timeout)
        self.op_timeout = timeout
        self.rendezvous_timeout = min(rendezvous_timeout, timeout)

    def _create_pg(self, store, rank: int, world_size: int):
        # Called by torchft's configure() for each new quorum, on the manager's quorum thread.
        return standalone.gloo_group(store, rank, world_size, self._timeout, connect_timeout=self.rendezvous_timeout)

    def current(self):
        """The gloo group of the current quorum (adopted by flatcomm)."""
        if self._pg is None:
            raise RuntimeError("flatcomm.elastic: no quorum yet (or its group was aborted): call "
                               "manager.start_quorum() first")
        return self._pg

    def getBackendName(self) -> str:
        return "flatcomm-torchft-gloo"

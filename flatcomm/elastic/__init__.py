"""Fault-tolerant DiLoCo: replicas that die, restart and heal, on torchft's quorum.

torchft (``pip install flatcomm[elastic]``, torchft 0.2) is the membership engine: its lighthouse
forms a quorum from heartbeats, its Manager reconfigures a process group per quorum and heals a
replica that is behind from a peer. flatcomm brings the sync: its codecs with error feedback, its
ordered or exact sums, on each quorum's group (:class:`QuorumGroup`), committed only when torchft's
``should_commit`` agrees::

    manager = flatcomm.elastic.make_manager("replica-0", "http://lighthouse:29510")
    outer = flatcomm.elastic.ElasticDiLoCo(model, opt, manager=manager, sync_every=50, codec="int4")

An island of several ranks (DDP or FSDP2 inside, torchrun's group) passes its group to both::

    manager = flatcomm.elastic.make_manager("island-0", lighthouse, island=dist.group.WORLD)
    outer = flatcomm.elastic.ElasticDiLoCo(ddp_model, opt, manager=manager, sync_every=50,
                                           island=dist.group.WORLD, data=stream)

See docs/elastic.md (set-up, what happens when a replica dies or joins, measurements) and
docs/semantics.md for the rule of error feedback when the replicas change.
"""
try:
    import torchft  # noqa: F401
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("flatcomm.elastic needs torchft (pip install 'flatcomm[elastic]' or torchft==0.2.0)") from e

from .data import BatchStream
from .diloco import ElasticDiLoCo, Round
from .group import QuorumGroup
from .island import Island
from .replica import make_manager

__all__ = ["BatchStream", "ElasticDiLoCo", "Island", "QuorumGroup", "Round", "make_manager"]

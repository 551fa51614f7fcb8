"""The one-hop exchanges of a CPU group as point-to-point transfers, posted together.

gloo's own all-gather is slow on large messages: on 2 ranks over loopback, gathering 50 MB per
rank took 198 ms where one isend/irecv pair of the same 50 MB took 54-67 ms and gloo's whole
100 MB all-reduce 114 ms. Point-to-point transfers also send views of the caller's tensors and
land in place, without staging. CUDA tensors keep NCCL's collectives (:func:`used_for`).

Both ends of every transfer derive its size from the same plan, and the transfers of one call
carry tags that count up within the call (the group's calls run one at a time, each waiting for
all of its transfers), so a send always meets the receive meant for it.
"""
from __future__ import annotations

from typing import List, Optional, Sequence

import torch
import torch.distributed as dist

from . import context, standalone

__all__ = ["Exchange", "all_gather", "all_to_all", "drain", "native_name", "used_for"]


def used_for(t: torch.Tensor) -> bool:
    return t.device.type == "cpu"


_NATIVE_NAME = "native name"  # context slot: the name C++ resolves the group by, or None


def native_name(group) -> Optional[str]:
    """The name under which torch's group registry holds ``group`` (what a C++ op resolves it
    by), None when the registry does not hold it (a group adopted with
    :func:`flatcomm.comm.standalone.adopt`)."""
    ctx = context.of(group)
    if not ctx.has(_NATIVE_NAME):
        try:
            name = group.group_name
            held = torch._C._distributed_c10d._resolve_process_group(name) is group
        except Exception:  # noqa: BLE001 - not registered, or no name
            held = False
        ctx.set(_NATIVE_NAME, name if held else None)
    return ctx.get(_NATIVE_NAME)


class Exchange:
    """The transfers of one exchange, waited for together (what :meth:`Pipeline.wait` and
    :func:`drain` expect of a Work)."""

    def __init__(self, works: List[dist.Work]):
        self.works = works

    def wait(self, timeout=None) -> bool:
        for w in self.works:  # each bounded by the group's timeout
            w.wait()
        return True


def _post(group, tag: int, sends: Sequence, recvs: Sequence) -> Exchange:
    works = [dist.irecv(t, group=group, group_src=peer, tag=tag) for peer, t in recvs if t.numel()]
    works += [dist.isend(t, group=group, group_dst=peer, tag=tag) for peer, t in sends if t.numel()]
    return Exchange([w for w in works if w is not None])


def all_to_all(group, pieces: Sequence[torch.Tensor], recv: torch.Tensor, recv_row: int, tag: int) -> Exchange:
    """``pieces[d]`` to rank d; row r of ``recv`` (``recv_row`` values each) from rank r. This
    rank's own piece is copied into its row now, so it may be overwritten once this returns."""
    me, world = standalone.rank(group), dist.get_world_size(group)
    rows = [recv[r * recv_row:(r + 1) * recv_row] for r in range(world)]
    rows[me].copy_(pieces[me])
    others = [r for r in range(world) if r != me]
    return _post(group, tag, [(d, pieces[d]) for d in others], [(r, rows[r]) for r in others])


def all_gather(group, send: torch.Tensor, outs: Sequence[Optional[torch.Tensor]], tag: int) -> Exchange:
    """``send`` to every other rank; rank r's into ``outs[r]`` (``send``'s size; this rank's own
    entry is left to the caller)."""
    me, world = standalone.rank(group), dist.get_world_size(group)
    others = [r for r in range(world) if r != me]
    return _post(group, tag, [(d, send) for d in others], [(r, outs[r]) for r in others])


def drain(pending) -> None:
    """Wait for every exchange in ``pending`` (Works, or tuples holding them), ignoring their
    errors: a call that fails mid-way leaves none in flight, so a group torn down afterwards has
    no transfer pending (gloo then ends the process with ``terminate called``). Each wait is
    bounded by the group's timeout; a dead peer fails them at once."""
    for item in pending:
        for w in (item if isinstance(item, (tuple, list)) else (item,)):
            if w is not None and hasattr(w, "wait") and not isinstance(w, torch.Tensor):
                try:
                    w.wait()
                except Exception:  # noqa: BLE001 - the call's own error is the one to raise
                    pass

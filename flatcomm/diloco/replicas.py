"""What the replicas agree on: a step every replica takes or none does, and equal masters.

:func:`agree` runs local checks on every replica, then one small flatcomm all-gather of a
fingerprint: a replica whose checks raised posts the all-gather's header marked failed
(:func:`flatcomm.comm.args.in_step`), so every replica raises the same error naming it, before
anything changed anywhere; and replicas whose fingerprints differ (another configuration, another
model) all raise naming them. :func:`master_hash` is the 64-bit hash ``verify_every`` gathers.
"""
from __future__ import annotations

import hashlib
from typing import Callable, List, Sequence, TypeVar, cast

import torch
import torch.distributed as dist

from .. import collectives as C
from ..comm.args import in_step
from ..comm.header import KIND_IDS

__all__ = ["agree", "differing", "master_hash", "verify"]

T = TypeVar("T")
_ALL_GATHER = KIND_IDS["all_gather"]  # the kind of the call a failed check stands in for
_PARTS = 4  # a 64-bit value travels as four 16-bit parts, each exact in fp32


def master_hash(masters: Sequence[torch.Tensor]) -> int:
    """64-bit BLAKE2b of the bytes of the fp32 masters, in order."""
    h = hashlib.blake2b(digest_size=8)
    for m in masters:
        h.update(m.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return int.from_bytes(h.digest(), "little")


def _gather64(value: int, group, device: torch.device) -> List[int]:
    """Every replica's 64-bit ``value``, in rank order (one flat fp32 all-gather on ``device``)."""
    mine = torch.tensor([(value >> (16 * i)) & 0xFFFF for i in range(_PARTS)], dtype=torch.float32, device=device)
    rows = torch.empty(dist.get_world_size(group) * _PARTS, dtype=torch.float32, device=device)
    C.all_gather(rows, mine, codec="fp32", group=group)
    parts = rows.view(-1, _PARTS).to(torch.int64).tolist()
    return [sum(int(p) << (16 * i) for i, p in enumerate(row)) for row in parts]


def agree(group, device: torch.device, checks: Callable[[], T], fingerprint: Callable[[T], int], what: str) -> T:
    """``checks()``'s result on every replica, or the same error on every replica: a check that
    raised on some replica, or fingerprints that differ (``what`` names the compared thing)."""
    private = C.private_group(group)
    result = cast(T, in_step(private, _ALL_GATHER, False, checks))  # synchronous: never a Handle
    values = _gather64(fingerprint(result), group, device)
    differing(values, what)
    return result


def differing(values: List[int], what: str) -> None:
    """Raise naming the replicas (ranks of the outer group) unless every value is the same."""
    if len(set(values)) <= 1:
        return
    by_value: dict = {}
    for r, v in enumerate(values):
        by_value.setdefault(v, []).append(r)
    sets = sorted(by_value.values(), key=lambda rs: (-len(rs), rs))
    desc = "; ".join(f"replicas {rs} have {v:016x}" for v, rs in sorted(by_value.items(), key=lambda kv: kv[1]))
    raise RuntimeError(f"flatcomm.diloco: {what} differs between replicas: {desc} "
                       f"(replicas {sorted(r for rs in sets[1:] for r in rs)} differ from replicas {sets[0]})")


def verify(group, device: torch.device, masters: Sequence[torch.Tensor], what: str) -> int:
    """Gather every replica's master hash; raise on every replica if any differs (``what``: which
    master, for the message). Returns the hash."""
    h = master_hash(masters)
    differing(_gather64(h, group, device), what)
    return h

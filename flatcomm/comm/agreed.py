"""Agreed plans: a call the ranks have already agreed on runs without waiting for its call header's
check, which takes the header's round trip off its critical path.

Why: every call checks the ranks' call headers before its payload moves, because gloo aborts the
process when a peer sends more bytes than the receive posted for it. On 2 CPU ranks under DDP's
backward the header completed 1-6 ms after both ranks had posted it (the threads that carry it
wait for a core), and a DDP step took 1.13-1.18x gloo's; with no header at all, 1.01-1.06x.

How it stays safe:

* **Plans.** A lossless fp32 all-reduce (:func:`capable`) whose header every rank's table agreed
  on becomes a plan of its group, numbered 1, 2, ... in the order the group agreed them. Every rank
  updates its plans from the same table at the same call (:meth:`CallHeader.error
  <flatcomm.comm.header.CallHeader.error>`), so the ranks' plans stay equal, also through a failed
  check (every rank read the same table). A row carries its rank's count of plans (the ``agreed
  plans`` field): a rank that missed an update (its header exchange failed) raises a named error
  at the next such call, and every rank starts over (:func:`drifted`). So two ranks' plan p is
  always the same signature. (Dropping the plans at every failed check made the next correct call
  fail too when one rank had posted it on a plan before it settled the failure and its peer after.)
* **Tags.** The point-to-point transfers of a call on plan p carry tags ``p << 16`` + 1, + 2, ...
  (:func:`tag_base`; 0 for a call on no plan). Ranks making calls of different signatures
  therefore never match each other's transfers: no receive meets a send of another size.
* **Early calls.** A rank whose call is on a plan and runs natively
  (:func:`flatcomm.comm.flat._raw_all_reduce_p2p`) makes all of the call's transfers and its sum
  without waiting for the header, says so in its row (:func:`early_of`), and checks the header
  when the call is done: its header is settled on arrival, by a callback
  (:meth:`CallHeader.settle_on_arrival <flatcomm.comm.header.CallHeader.settle_on_arrival>`).
* **A failed check.** Every rank not early on an early rank's plan then makes that rank's
  transfers with it (:func:`fill`, sizes from the early rank's own row; an early rank does so from
  its header's callback, since its own call may be waiting for another early rank). So every
  call completes, nothing stays posted to match a later one, and every rank raises the header's
  error. The tensor of an early call whose check failed holds unspecified values.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from . import context, standalone
from .fields import DEVICE_TYPES, DTYPES, KIND_IDS, MODES, HeaderFields, name
from .header_table import _FIXED, MAGIC, early_of
from .shards import shard_bounds
from ..ops.codecs import CODECS, resolve

__all__ = ["MAX_PLANS", "TAG_SHIFT", "agree", "capable", "count", "count_field", "drifted", "failed", "fill", "forget",
           "plan_id", "tag_base"]

TAG_SHIFT = 16  # a call's own tags count up below this bit (MAX_CHUNKS keeps them there)
MAX_PLANS = (1 << (31 - TAG_SHIFT)) - 1  # tags stay non-negative int32s
MAX_CHUNKS = (1 << (TAG_SHIFT - 1)) - 1  # a call takes two tags per chunk
FILL_LIMIT = 1 << 26  # values of a call a rank answers (fill) on a peer's word alone: 256 MB of fp32
_PLANS = "agreed plans"  # context slot: {signature: plan number}
_COUNT = name("agreed_plans")  # the header field: a row's count of plans

# The header's ids of what a plan is.
_ALL_REDUCE, _FP32_CODEC = KIND_IDS["all_reduce"], CODECS.index("fp32")
_FP32, _CPU = DTYPES.index(torch.float32), DEVICE_TYPES.index("cpu")
_MODES = (MODES.index("ordered"), MODES.index("exact"))
_ALIGN = resolve("fp32").align


def capable(fields: Sequence[Tuple[str, int]]) -> bool:
    """Whether a call with these header fields may become a plan: a lossless fp32 all-reduce,
    ordered or exact, on CPU tensors (what the native point-to-point path runs)."""
    f = HeaderFields.of(fields)  # (a field not given is 0: a capable call's signature gives them all)
    return (f.collective == _ALL_REDUCE and f.codec == _FP32_CODEC and f.dtype == _FP32
            and f.mode in _MODES and f.device == _CPU and 1 <= f.chunks <= MAX_CHUNKS)


def _plans(group) -> Dict[tuple, int]:
    return context.of(group).slot(_PLANS, dict)


def plan_id(group, fields: Sequence[Tuple[str, int]]) -> int:
    """The plan number of a call with these fields on ``group``; 0 when the group has none."""
    return _plans(group).get(tuple(fields), 0)


def count(group) -> int:
    return len(_plans(group))


def count_field(group) -> Tuple[str, int]:
    """The header field of a row that may agree a plan: 1 + this rank's count of plans (0 is a row
    that carries no count)."""
    return _COUNT, 1 + count(group)


def agree(group, fields: Sequence[Tuple[str, int]]) -> None:
    """Every rank's row agreed on ``fields`` (a :func:`capable` call): a plan of its own, if new."""
    plans = _plans(group)
    key = tuple(fields)
    if key not in plans and len(plans) < MAX_PLANS:
        plans[key] = len(plans) + 1


def forget(group) -> None:
    """The ranks' plans drifted apart: they start over (on every rank, which all saw the table)."""
    _plans(group).clear()


def drifted(table: torch.Tensor, names: Sequence[str]) -> bool:
    """Whether a failed check's ``table`` says the ranks' plans differ: the rows that could agree a
    plan carry different counts of plans (a rank missed a table that agreed one), or a row is not
    a header. Any other failure leaves the plans alone: every rank read the same table and agreed
    nothing new from it, so their plans are still equal, and a call posted before this rank
    settled the failure (on a plan) pairs with a peer's posted after it (on the same plan)."""
    counts = set()
    for r in range(table.shape[0]):
        if int(table[r, 0]) != MAGIC:
            return True
        f = HeaderFields.of(zip(names, table[r, _FIXED:_FIXED + len(names)].tolist()))
        if f.agreed_plans > 0:  # (a row that could agree a plan)
            counts.add(f.agreed_plans)
    return len(counts) > 1


def tag_base(plan: int) -> int:
    return plan << TAG_SHIFT


def _exchanges(numel: int, chunks: int, world: int, q: int, me: int) -> List[Tuple[int, int, int]]:
    """(tag offset, values rank q sends this rank, values q receives from it) of each exchange of
    q's native all-reduce of ``numel`` fp32 values (csrc/comm/p2p_all_reduce.cpp, in its order)."""
    bounds = shard_bounds(numel, world, _ALIGN)
    cuts = [shard_bounds(bounds[d + 1] - bounds[d], chunks, _ALIGN) for d in range(world)]
    n = [[cuts[d][j + 1] - cuts[d][j] for j in range(chunks)] for d in range(world)]
    send = [(n[me][j], n[q][j]) for j in range(chunks)]  # q's piece of this rank's shard out, this rank's in
    gather = [(n[q][j], n[me][j]) for j in range(chunks)]  # q's summed piece out, this rank's in
    order = [send[0]]  # send(0), then send(j + 1) before reduce(j)
    for j in range(chunks):
        order += ([send[j + 1]] if j + 1 < chunks else []) + [gather[j]]
    return [(k + 1, incoming, outgoing) for k, (incoming, outgoing) in enumerate(order)]


def fill(group, table: torch.Tensor, names: Sequence[str], mine: int) -> List[dist.Work]:
    """After a failed check: post the transfers of the ranks early on another plan than this
    rank's (``mine``, 0: none) with this rank, as the peers of their call (zeros out, whatever
    comes in dropped; one piece's memory each way). Returns them, for the caller to wait for. A
    row is read as untrusted: only a well-formed row of a :func:`capable` call is answered, sized
    by this rank's own plan of that number (the ranks' plans are equal) where it has one, else
    by the row (a rank whose plans drifted) only up to the larger of this rank's largest plan and
    :data:`FILL_LIMIT` values: a peer's word never sizes a larger buffer here."""
    me, world = standalone.rank(group), table.shape[0]
    nfields = len(names)
    works: List[Optional[dist.Work]] = []
    known = {p: HeaderFields.of(key) for key, p in _plans(group).items()}
    largest = max([f.numel for f in known.values()] + [FILL_LIMIT])
    for q in range(world):
        plan = early_of(table, q, nfields)
        if q == me or plan == mine or not 0 < plan <= MAX_PLANS:
            continue
        row = list(zip(names, table[q, _FIXED:_FIXED + nfields].tolist()))
        f = HeaderFields.of(row)
        if int(table[q, 0]) != MAGIC or not capable(row) or not 0 <= f.numel <= largest:
            continue  # (early_of: status OK)
        f = known.get(plan, f)
        exchanges = _exchanges(f.numel, f.chunks, world, q, me)
        try:  # one buffer each way, for every exchange (what comes in is dropped)
            sink = torch.empty(max(n for _, n, _ in exchanges))
            zeros = torch.zeros(max(n for _, _, n in exchanges))
        except RuntimeError:  # a row naming more values than this host holds: nothing posted
            continue
        for offset, incoming, outgoing in exchanges:
            if incoming:
                works.append(dist.irecv(sink[:incoming], group=group, group_src=q, tag=tag_base(plan) + offset))
            if outgoing:
                works.append(dist.isend(zeros[:outgoing], group=group, group_dst=q, tag=tag_base(plan) + offset))
    return [w for w in works if w is not None]


def failed(group, table: torch.Tensor, names: Sequence[str], mine: int) -> List[dist.Work]:
    """A check of ``table`` failed: :func:`fill` the early peers' transfers (returned, to wait
    for), and :func:`forget` the plans where they :func:`drifted`."""
    works = fill(group, table, names, mine)
    if drifted(table, names):
        forget(group)
    return works

"""The call header every rank exchanges before a collective moves any payload.

Why a separate, fixed-size exchange and not a header inside the payloads: gloo aborts the process
(SIGABRT) when a peer sends more bytes than the receiver posted, and the payload sizes come from
the very fields that may disagree (numel, codec, block size, chunks). So the fields travel first,
in a message whose size depends on nothing (an all-gather of one int64 row per rank), issued
asynchronously and waited for just before the first payload exchange (it overlaps encoding).

A row: magic, call number on the group, status (0 ok; 1 or 2: the call's arguments were rejected
with a ValueError or a TypeError), the signature fields (every one that decides a payload's size
or layout, exactly: floats as their float64 bits), and for a failed call the reason (UTF-8). Every
rank checks the same table, so every rank raises the same error, naming global ranks, at the same
call, and the group stays in step: a rank whose arguments were rejected still sends its row
(:func:`flatcomm.comm.rejected.fail_in_step`) and every rank, that one included, raises "rank r failed: <reason>" (a
TypeError if rank r's was one; ranks with the same reason named once: "rank 1 and rank 3 failed").

A reason longer than the row's :data:`REASON_BYTES` travels whole through the process group's
store (no collective): the failing rank writes it there before it sends its row, whose marker byte
tells the others to read it (the row's size never depends on a reason).

A lossless fp32 all-reduce the ranks agreed on before runs without waiting for its check, which
then comes after the call (:mod:`flatcomm.comm.agreed`: why that stays safe).

On the flatcomm backend's groups (:func:`slot_of`, a property of the group: rows stay equal in
size) every row ends in a payload slot: a small collective (:mod:`flatcomm.comm.small`) sends its
data there, other calls leave it zeroed, and ranks on either path still raise on disagreeing. Other
groups' rows carry none: its bytes would go with every large call on a slow link.
"""
from __future__ import annotations

import itertools
import threading
import weakref
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from . import agreed, context, groups, standalone
from .fields import ALL_DTYPES, AUTO_CODEC, DEVICE_TYPES, DTYPES, FIELDS, KINDS, KIND_IDS, MODES
from .header_table import (FAILED_TYPE, FAILED_VALUE, MAGIC, OK, REASON_BYTES, _FIXED, _MORE, _float_of, _reason,
                           _reason_bytes, _reason_of, call_numbers, check, error_of, float_bits, length, row, set_early)
from ..ops.codecs import CODECS
from ..ops.native import extension, ops

__all__ = ["ALL_DTYPES", "AUTO_CODEC", "CallHeader", "DTYPES", "FIELDS", "KINDS", "KIND_IDS", "MAGIC", "MODES", "REASON_BYTES",
           "SLOT_MAX_BYTES", "call_numbers", "check", "check_consistent", "error_of", "on_disagreement",
           "float_bits", "header_device", "length", "next_call", "row", "slot_of", "SLOT_OFFSET", "WIDTH"]

# torch 2.13 renamed all_gather_into_tensor to all_gather_single (the old name warns).
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

SLOT_MAX_BYTES, SLOT_TABLE_BYTES = 16 << 10, 64 << 10  # a row's slot; every rank's (docs/backend.md)


def slot_of(group) -> int:
    """Bytes of ``group``'s header slot (a multiple of 16): on a flatcomm backend's private group
    :data:`SLOT_MAX_BYTES`, at most :data:`SLOT_TABLE_BYTES` for every rank's; elsewhere 0."""
    if not context.of(group).get(groups.SMALL_SLOT):
        return 0
    world = group.size() if group is not None else dist.get_world_size()
    return min(SLOT_MAX_BYTES, SLOT_TABLE_BYTES // world) // 16 * 16


def _store_key(group, call: int, global_rank: int) -> str:
    name = "standalone" if standalone.is_standalone(group) else \
        getattr(group if group is not None else dist.group.WORLD, "group_name", "")
    return f"flatcomm/reason/{name}/{call}/{global_rank}"


def _store(group):
    # every listed group's store is a prefix of the default one; a standalone group has its own
    store = standalone.store_of(group)
    if store is None:
        raise RuntimeError("no store")
    return store


def _global_rank(group) -> int:
    return standalone.rank(group) if standalone.is_standalone(group) else dist.get_rank()


def _publish(group, call: int, reason: str) -> None:
    """Put a reason too long for a row where the peers read it (before the row is sent)."""
    if len(reason.encode("utf-8", "replace")) <= REASON_BYTES:
        return
    try:
        _store(group).set(_store_key(group, call, _global_rank(group)), reason.encode("utf-8", "replace"))
    except Exception:  # noqa: BLE001 - no store: the peers show the row's start, marked as cut
        pass


def _whole_reasons(group, table: torch.Tensor, nfields: int, ranks: Sequence[int]) -> dict:
    """Row -> the whole reason, for the failed rows whose reason continues in the store."""
    out = {}
    for r in range(table.shape[0]):
        if int(table[r, 2]) == OK or not _reason_bytes(_reason_of(table, r, nfields)).endswith(bytes([_MORE])):
            continue
        key = _store_key(group, int(table[r, 1]), ranks[r])
        try:  # the failing rank wrote it before sending its row: check() sees it, get() does not wait
            if _store(group).check([key]):
                out[r] = _store(group).get(key).decode("utf-8", "replace")
        except Exception:  # noqa: BLE001 - the row's start, marked as cut, stands in
            pass
    return out


# ---- the call header of a collective --------------------------------------------------------------

# The fields of every call, in this order: comm.fields' HeaderFields.
WIDTH = _FIXED + len(FIELDS)  # values at the head of a row that every rank's must equal
SLOT_OFFSET = WIDTH * 8 + REASON_BYTES  # the byte a row's payload slot starts at
_CALLS = "header calls"  # context slot: number of the next call on that group (advanced on its worker, in order)


def _shown(name: str, v: int):
    """A signature field's value as a user wrote it (names, not numbers) for error messages."""
    try:
        if name == "collective":
            return KINDS[v]
        if name in ("codec", "intra codec"):
            return "auto" if v == AUTO_CODEC else CODECS[v]
        if name == "mode":
            return MODES[v]
        if name == "dtype":
            return str(ALL_DTYPES[v]) if v < len(ALL_DTYPES) else "another dtype"
        if name == "reduce op":  # 0: a flatcomm sum (its op is the scale); else a passed-through op + 1
            return "a flatcomm sum" if v == 0 else dist.ReduceOp.RedOpType(v - 1).name
        if name == "device":
            return DEVICE_TYPES[v]
        if name == "agreed plans":  # (agreed.count_field)
            return v - 1 if v > 0 else "none"
    except Exception:  # noqa: BLE001 - a peer's row is untrusted: a value no name fits is shown as it is
        return v
    if name in ("topk ratio", "intra topk ratio", "op scale"):
        return repr(_float_of(v))
    return v


def has_cpu_backend(group) -> bool:
    try:
        (group if group is not None else dist.group.WORLD)._get_backend(  # type: ignore[union-attr]
            torch.device("cpu"))  # no group: WORLD, which exists once torch.distributed is initialised
        return True
    except Exception:  # noqa: BLE001 - e.g. an NCCL-only group
        return False


def _exchange_table(group, mine: torch.Tensor, device: torch.device, async_op: bool):
    if async_op and group is not None and device.type == "cpu":
        # Straight to the CPU backend, through aliases made in C++ (header_rows.h alias_of).
        world = group.size()
        table = torch.empty(world, mine.numel(), dtype=torch.int64)
        return dist.Work.unbox(ops.gather_header(group.boxed(), table, mine)), table
    world = dist.get_world_size(group)
    allv = torch.empty(world * mine.numel(), dtype=torch.int64, device=device)
    return all_gather_single(allv, mine.to(device), group=group, async_op=async_op), allv.view(world, -1)


def _ranks_of(group) -> List[int]:
    """The global rank of each of ``group``'s ranks, for messages (a subgroup's rank 1 may be rank 3)."""
    try:
        return standalone.ranks(group)
    except Exception:  # noqa: BLE001 - e.g. a group torch does not list: its own numbering
        return list(range(dist.get_world_size(group)))


def check_consistent(group, fields: Sequence[Tuple[str, int]], device: torch.device) -> None:
    """One tiny all-gather of ``fields`` so that mismatched calls fail on every rank with a clear
    message instead of hanging or exchanging garbage (used where no call header runs, e.g. by
    :mod:`flatcomm.reproducible`)."""
    if not groups.exchanges(group):
        return
    names = [n for n, _ in fields]
    _, table = _exchange_table(group, row(0, OK, fields, names), device, False)
    err = error_of(table, fields, _shown, _ranks_of(group))
    if err is not None:
        raise err


def next_call(group) -> int:
    """The number of the group's next call (advanced in call order: on its worker, or on a
    caller's thread while the worker is idle)."""
    ctx = context.of(group)
    call = ctx.get(_CALLS, 0)
    ctx.set(_CALLS, call + 1)
    return call


class _Exchanged:
    """The completed exchange of a header C++ made: ``wait()`` raises its error, if any."""

    def __init__(self, failed: Optional[str]):
        self.failed = failed

    def wait(self) -> bool:
        if self.failed is not None:
            raise RuntimeError(self.failed)
        return True


_WATCHED: Dict[int, "CallHeader"] = {}  # watched headers not yet settled, by token
_tokens = itertools.count(1)


def on_disagreement(token: int) -> None:
    """Called from C++ (gloo's thread, csrc/comm/header_watch.cpp) when a watched header's rows
    disagree: settle it now (its fills go out), unless its call already did."""
    h = _WATCHED.get(token)
    if h is not None:
        h.settle()


class CallHeader:
    """The header exchange of one call, started at once and checked by :meth:`finish` before the
    first payload byte moves (an early call on an agreed plan, :mod:`flatcomm.comm.agreed`: once
    it ran). ``agree``: the call may become a plan (its row then carries the group's count of
    plans); ``early``: the plan this rank's call runs on before the check (0: none)."""

    def __init__(self, group, fields: Sequence[Tuple[str, int]], device: torch.device,
                 reason: Optional[str] = None, status: int = FAILED_VALUE, payload: Optional[torch.Tensor] = None,
                 agree: bool = False, early: int = 0):
        self.agree: Optional[List[Tuple[str, int]]] = list(fields) if agree else None
        if agree:
            fields = list(fields) + [agreed.count_field(group)]
        self._start(group, fields, early, next_call(group))
        if reason is not None:
            _publish(group, self.call, reason)
        # Kept here: the exchange must not hold the row's last reference, or gloo's thread frees it,
        # which takes the GIL while it holds its queue lock and stalls the next call's enqueue.
        self.mine = row(self.call, OK if reason is None else status, fields, FIELDS, reason or "", self.slot, payload)
        if early:
            set_early(self.mine, len(FIELDS), early)
        self.ok = reason is None
        self.work, self.table = _exchange_table(group, self.mine, device, True)

    def _start(self, group, fields: Sequence[Tuple[str, int]], early: int, call: int) -> None:
        self.early, self._settled, self.call = early, False, call
        self._error: Optional[Exception] = None
        self._lock = threading.Lock()  # settle: the worker's and, for a watched header, gloo's thread
        self._token = 0  # in _WATCHED while a watched header is unsettled
        self._fills: List[dist.Work] = []
        # The group held weakly: a callback on gloo's thread may drop this header last, and a group
        # freed there would join that very thread (std::system_error, the process aborted).
        self._group, self.fields = (weakref.ref(group) if group is not None else None), list(fields)
        self.slot = slot_of(group)

    @classmethod
    def exchanged(cls, group, agree: Optional[Sequence[Tuple[str, int]]], fields: Sequence[Tuple[str, int]], call: int,
                  mine: torch.Tensor, table: torch.Tensor, early: int, failed: Optional[str]) -> "CallHeader":
        """The header of a native call whose exchange C++ made (:mod:`flatcomm.comm.native_calls`),
        built only when Python must settle it: ``mine``, this rank's row (``fields``, the call number
        ``call``), ``table``, every rank's; ``failed``: the exchange's error, if it failed."""
        h = cls.__new__(cls)
        h._start(group, fields, early, call)
        h.agree = list(agree) if agree is not None else None
        h.mine, h.table, h.ok, h.work = mine, table, True, _Exchanged(failed)
        return h

    def payloads(self, nbytes: int) -> torch.Tensor:
        """The first ``nbytes`` of every rank's payload slot, [world, nbytes] uint8 (contiguous),
        once :meth:`finish` passed."""
        return self.table.cpu().view(torch.uint8)[:, SLOT_OFFSET:SLOT_OFFSET + nbytes].contiguous()

    def finish(self) -> None:
        """Wait for every rank's row; raise the call's error (the same on every rank) if any."""
        try:
            self.work.wait()
        finally:
            _WATCHED.pop(self._token, None)
        err = self.error()
        if err is not None:
            raise err

    def settle_on_arrival(self) -> None:
        """Settle the table as soon as it is in, if it disagrees: for an early call, whose own
        transfers may be waiting for those the table tells this rank to make
        (:func:`flatcomm.comm.agreed.fill`). The rows are compared in C++ on gloo's thread
        (csrc/comm/header_watch.cpp); only a disagreement calls back into Python
        (:func:`on_disagreement`)."""
        self._token = next(_tokens)
        _WATCHED[self._token] = self
        ops.watch_header(self.work.boxed(), self.table, self.mine, WIDTH, self._token)

    def abandoned(self) -> None:
        """The call failed on this rank before its check: settle the exchange, and if it completed,
        what the table means for the group's plans (the peers read the same table)."""
        try:
            self.finish()
        except Exception:  # noqa: BLE001 - the call's own error is the one to raise
            pass

    def error(self) -> Optional[Exception]:
        """The call's error, from the table the exchange completed (every rank holds the same).
        The first time, also what the table means for the group's agreed plans: a new one, or, on
        an error, none, once this rank made the transfers of the peers that ran early
        (:mod:`flatcomm.comm.agreed`)."""
        self.settle()
        fills, self._fills = self._fills, []
        for w in fills:
            try:
                w.wait()
            except Exception:  # noqa: BLE001 - the header's error is the one to raise
                pass
        return self._error

    def settle(self) -> None:
        """Read the table once it is in: an error, or the plan the table agreed (on every rank the
        same), without waiting for anything."""
        with self._lock:
            if not self._settled:
                self._settle_once()

    def _settle_once(self) -> None:
        try:
            self._error = self._checked()
        except Exception as e:  # noqa: BLE001 - a table this rank cannot read still fails the call
            self._error = RuntimeError(f"flatcomm: the call header's rows could not be checked ({type(e).__name__}: "
                                       f"{e}); the ranks' calls do not match")
        self._settled = True
        group = self._group() if self._group is not None else None
        if self._group is not None and group is None:
            return
        if self._error is not None:
            self._fills = agreed.failed(group, self.table.cpu(), FIELDS, self.early)
        elif self.agree is not None:
            agreed.agree(group, self.agree)

    def _checked(self) -> Optional[Exception]:
        table = self.table.cpu()
        width = WIDTH
        if self.ok and torch.equal(table[:, :width], self.mine[:width].expand(table.shape[0], width)):
            return None  # every row is this (valid) row's head: the common case, checked in one pass
        group = self._group() if self._group is not None else None
        if self._group is not None and group is None:
            return RuntimeError("flatcomm: the call's process group was destroyed before its header was checked")
        ranks = _ranks_of(group)
        whole = _whole_reasons(group, table, len(FIELDS), ranks) if bool((table[:, 2] != OK).any()) else {}
        err = error_of(table, [(n, 0) for n in FIELDS], _shown, ranks, whole)
        if isinstance(err, RuntimeError) and "out of step" in str(err):
            # Every rank saw the same table: resume numbering together, so that the next calls
            # (if the ranks' programs agree again) are in step.
            context.of(group).set(_CALLS, max(call_numbers(table)) + 1)
        return err


def header_device(group, device: torch.device, validate: bool) -> Optional[torch.device]:
    """Where the header travels: on the CPU when the group has a CPU backend (no host sync for
    CUDA data); on an NCCL-only group on the data's device, which reads it back on the host, so
    only with ``validate=True`` there."""
    if device.type == "cpu" or has_cpu_backend(group):
        return torch.device("cpu")
    return device if validate else None


extension.set_callback("header.on_disagreement", on_disagreement)  # (csrc/comm/header_watch.cpp)

"""A call header's row and the checks of a table of rows (every rank's row of one call): the
layout, how a row is built (from a cached template), what error a table means. No process group
and no exchange here: those are :mod:`flatcomm.comm.header`'s, which re-exports these names.

A row, int64: magic, call number on the group, status (:data:`OK`, or the call's arguments were
rejected with a ValueError / TypeError), the signature fields, the reason (UTF-8,
:data:`REASON_BYTES`; in an OK row its last word names the plan the rank's call ran on before the
check: :func:`early_of`), then the payload slot, if the group's rows have one.
"""
from __future__ import annotations

import struct
from typing import Dict, List, Optional, Sequence, Tuple

import torch

__all__ = ["FAILED_TYPE", "FAILED_VALUE", "MAGIC", "OK", "REASON_BYTES", "call_numbers", "check", "early_of",
           "error_of", "float_bits", "length", "row", "set_early"]

MAGIC = 0x666C6174  # "flat"
REASON_BYTES = 128
_FIXED = 3  # magic, call number, status
# Status of a row: the call's arguments passed, or were rejected with a ValueError / TypeError (every
# rank then raises the first failed rank's kind of error, with every failed rank's reason).
OK, FAILED_VALUE, FAILED_TYPE = 0, 1, 2


def float_bits(x: float) -> int:
    """``x``'s float64 bit pattern as an int64: equal fields mean exactly equal values (a rounded
    field would let two ranks agree on a topk ratio that keeps a different number of values)."""
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


def _float_of(bits: int) -> float:
    return struct.unpack("<d", struct.pack("<q", int(bits)))[0]


_MORE = 0xFF  # the last reason byte of a row whose reason continues in the store (never in UTF-8)


# Rows without a reason, by (status, fields, names, slot), with call number 0 and an empty slot: a
# call's row is a copy with its number and payload written in (building one field by field cost
# ~30 us of Python per call, more than a small exchange's whole share of it).
_TEMPLATES: Dict[tuple, torch.Tensor] = {}
_TEMPLATES_MAX = 256


def row(call: int, status: int, fields: Sequence[Tuple[str, int]], names: Sequence[str], reason: str = "",
        slot: int = 0, payload: Optional[torch.Tensor] = None) -> torch.Tensor:
    """One rank's header: ``names``' fields in that order (a field not in ``fields`` is 0), so its
    length depends only on ``names`` and ``slot``. A reason over :data:`REASON_BYTES` keeps its
    start and the :data:`_MORE` marker (the whole of it goes through the store: :mod:`flatcomm.comm.header`). ``slot``:
    bytes of the payload slot after the reason (a multiple of 8); ``payload``: uint8 bytes placed
    at its start (the rest is zero)."""
    if reason:
        return _built(call, status, fields, names, reason, slot, payload)
    key = (int(status), tuple(fields), tuple(names), slot)
    template = _TEMPLATES.get(key)
    if template is None:
        if len(_TEMPLATES) >= _TEMPLATES_MAX:
            _TEMPLATES.clear()
        template = _TEMPLATES[key] = _built(0, status, fields, names, "", slot, None)
    out = template.clone()
    out[1] = call
    if payload is not None:
        _into_slot(out, len(names), slot, payload)
    return out


def _into_slot(out: torch.Tensor, nfields: int, slot: int, payload: torch.Tensor) -> None:
    assert payload.numel() <= slot, f"a payload of {payload.numel()} bytes in a slot of {slot}"
    start = (_FIXED + nfields) * 8 + REASON_BYTES
    out.view(torch.uint8)[start:start + payload.numel()].copy_(payload)  # (copy_: a third of setitem's cost)


def _built(call: int, status: int, fields: Sequence[Tuple[str, int]], names: Sequence[str], reason: str,
           slot: int, payload: Optional[torch.Tensor]) -> torch.Tensor:
    """:func:`row`, field by field."""
    given = dict(fields)
    unknown = set(given) - set(names)
    assert not unknown, f"header fields {unknown} are not in {names}"
    vals = [MAGIC, call, int(status)] + [int(given.get(n, 0)) for n in names]
    raw = reason.encode("utf-8", "replace")
    if len(raw) > REASON_BYTES:
        raw = raw[:REASON_BYTES - 1] + bytes([_MORE])
    out = torch.zeros(length(len(names), slot), dtype=torch.int64)
    out[:len(vals)] = torch.tensor(vals, dtype=torch.int64)
    tail = out[len(vals):].view(torch.uint8)  # the reason, then the slot
    if raw:
        tail[:len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    if payload is not None:
        _into_slot(out, len(names), slot, payload)
    return out


def length(nfields: int, slot: int = 0) -> int:
    return _FIXED + nfields + (REASON_BYTES + slot) // 8


def _early_index(nfields: int) -> int:
    # An OK row carries no reason: the last word of its reason holds the plan its rank's call ran
    # on before the check (flatcomm.comm.agreed); a failed row's reason may end there.
    return _FIXED + nfields + REASON_BYTES // 8 - 1


def set_early(out: torch.Tensor, nfields: int, plan: int) -> None:
    """Mark an OK row: its rank's call runs on ``plan`` before the check."""
    out[_early_index(nfields)] = plan


def early_of(table: torch.Tensor, r: int, nfields: int) -> int:
    """The plan row ``r``'s rank ran its call on before the check; 0: none."""
    if int(table[r, 2]) != OK:
        return 0
    return int(table[r, _early_index(nfields)])


def _reason_of(table: torch.Tensor, r: int, nfields: int) -> torch.Tensor:
    return table[r, _FIXED + nfields:_FIXED + nfields + REASON_BYTES // 8]


def _reason_bytes(r: torch.Tensor) -> bytes:
    return bytes(r.view(torch.uint8).tolist()).rstrip(b"\0")


def _reason(r: torch.Tensor) -> str:
    raw = _reason_bytes(r)
    if raw.endswith(bytes([_MORE])):  # the rest could not be read from the store: say it is cut
        return raw[:-1].decode("utf-8", "replace") + " [...]"
    return raw.decode("utf-8", "replace")


def _failed_ranks(failed: Sequence[int], reasons: Sequence[str], ranks: Sequence[int]) -> List[str]:
    """One problem per distinct reason, naming every rank that failed with it, in rank order."""
    by_reason: dict = {}
    for r, text in zip(failed, reasons):
        by_reason.setdefault(text, []).append(f"rank {ranks[r]}")
    out = []
    for text, who in by_reason.items():
        names = who[0] if len(who) == 1 else ", ".join(who[:-1]) + " and " + who[-1]
        out.append(f"{names} failed: {text}")
    return out


def check(table: torch.Tensor, fields: Sequence[Tuple[str, int]], shown=None,
          ranks: Optional[Sequence[int]] = None, whole: Optional[dict] = None) -> List[str]:
    """Problems with a [world, length] header table, in the order that explains them best: out of
    step first (the rows belong to different calls), then failed ranks, then disagreements.
    ``shown(name, value)`` renders a field value for the message (names, not numbers); ``ranks``:
    the global rank of each row (default: the row index); ``whole``: row -> whole reason, for
    the rows whose reason continues in the store."""
    table = table.cpu()
    world = table.shape[0]
    ranks = list(ranks) if ranks is not None else list(range(world))
    if any(int(v) != MAGIC for v in table[:, 0]):
        return ["received a header that is not flatcomm's: another collective on flatcomm's group "
                "(its private group is meant for flatcomm's traffic only)"]
    calls = table[:, 1].tolist()
    if len(set(calls)) != 1:
        return ["ranks are out of step: call number " + _per_rank(calls, ranks)
                + " (a rank skipped or added a collective, or an earlier call failed on some ranks only)"]
    failed = [r for r in range(world) if int(table[r, 2]) != OK]
    if failed:
        nf, whole = len(fields), whole or {}
        texts = [whole[r] if r in whole else _reason(_reason_of(table, r, nf)) for r in failed]
        return _failed_ranks(failed, texts, ranks)
    out = []
    for i, (name, _) in enumerate(fields):
        col = table[:, _FIXED + i].tolist()
        if len(set(col)) != 1:
            vals = [shown(name, v) if shown else v for v in col]
            out.append(f"ranks disagree on {name}: {_per_rank(vals, ranks)}")
    return out


def error_of(table: torch.Tensor, fields: Sequence[Tuple[str, int]], shown=None,
             ranks: Optional[Sequence[int]] = None, whole: Optional[dict] = None) -> Optional[Exception]:
    """The error every rank raises for this table (the same on every rank: they all hold it), or
    None when the call may go ahead."""
    problems = check(table, fields, shown, ranks, whole)
    if not problems:
        return None
    text = "flatcomm: " + "; ".join(problems)
    if problems[0].startswith(("ranks are out of step", "received a header")):
        return RuntimeError(text)
    status = [int(s) for s in table.cpu()[:, 2].tolist() if int(s) != OK]
    return TypeError(text) if status and status[0] == FAILED_TYPE else ValueError(text)


def call_numbers(table: torch.Tensor) -> List[int]:
    return table[:, 1].tolist()


def _per_rank(vals, ranks: Sequence[int]) -> str:
    return ", ".join(f"rank {r} {v}" for r, v in zip(ranks, vals))

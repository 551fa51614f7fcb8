"""The call header every rank exchanges before a collective moves any payload.

Why a separate, fixed-size exchange and not a header inside the payloads: gloo aborts the process
(SIGABRT) when a peer sends more bytes than the receiver posted, and the payload sizes are computed
from the very fields that may disagree (numel, codec, block size, chunks). So the fields travel
first in a message whose size depends on nothing (an all-gather of one int64 row per rank), and no
size-dependent byte is sent before every rank has checked every row. It is issued asynchronously
and waited for only just before the first payload exchange, so it overlaps with encoding.

A row: magic, call number on the group, status (0 ok, 1 failed), the signature fields, and for a
failed call the reason (UTF-8, truncated). Every rank checks the same table, so every rank raises
the same error at the same call and the group stays in step: a rank whose arguments were rejected
still sends its row (status 1) and its peers raise "rank r failed: <reason>".
"""
from __future__ import annotations

from typing import List, Sequence, Tuple

import torch

__all__ = ["KINDS", "MAGIC", "REASON_BYTES", "call_numbers", "check", "length", "row"]

MAGIC = 0x666C6174  # "flat"
REASON_BYTES = 128
_FIXED = 3  # magic, call number, status
KINDS = {1: "reduce_scatter", 2: "all_gather", 3: "all_reduce"}


def row(call: int, failed: bool, fields: Sequence[Tuple[str, int]], nfields: int, reason: str = "") -> torch.Tensor:
    """One rank's header: a fixed length for ``nfields`` fields (missing fields are 0)."""
    vals = [MAGIC, call, 1 if failed else 0] + [v for _, v in fields] + [0] * (nfields - len(fields))
    raw = reason.encode("utf-8", "replace")[:REASON_BYTES]
    text = torch.zeros(REASON_BYTES, dtype=torch.uint8)
    if raw:
        text[:len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    return torch.cat([torch.tensor(vals, dtype=torch.int64), text.view(torch.int64)])


def length(nfields: int) -> int:
    return _FIXED + nfields + REASON_BYTES // 8


def _reason(r: torch.Tensor) -> str:
    raw = bytes(r.view(torch.uint8).tolist()).rstrip(b"\0")
    return raw.decode("utf-8", "replace")


def check(table: torch.Tensor, fields: Sequence[Tuple[str, int]], shown=None) -> List[str]:
    """Problems with a [world, length] header table, in the order that explains them best: out of
    step first (the rows belong to different calls), then failed ranks, then disagreements.
    ``shown(name, value)`` renders a field value for the message (names, not numbers)."""
    table = table.cpu()
    world = table.shape[0]
    if any(int(v) != MAGIC for v in table[:, 0]):
        return ["received a header that is not flatcomm's: another collective on flatcomm's group "
                "(its private group is meant for flatcomm's traffic only)"]
    calls = table[:, 1].tolist()
    if len(set(calls)) != 1:
        return ["ranks are out of step: call number " + _per_rank(calls)
                + " (a rank skipped or added a collective, or an earlier call failed on some ranks only)"]
    failed = [r for r in range(world) if int(table[r, 2]) != 0]
    if failed:
        nf = len(fields)
        return [f"rank {r} failed: {_reason(table[r, _FIXED + nf:])}" for r in failed]
    out = []
    for i, (name, _) in enumerate(fields):
        col = table[:, _FIXED + i].tolist()
        if len(set(col)) != 1:
            vals = [shown(name, v) if shown else v for v in col]
            out.append(f"ranks disagree on {name}: {_per_rank(vals)}")
    return out


def call_numbers(table: torch.Tensor) -> List[int]:
    return table[:, 1].tolist()


def _per_rank(vals) -> str:
    return ", ".join(f"rank {r} {v}" for r, v in enumerate(vals))

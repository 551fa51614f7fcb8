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

Each call on a group first all-gathers such a header (:class:`CallHeader`), started at once and
checked before the first payload byte moves. A rank whose arguments were rejected takes part in the
exchange with status failed (:func:`fail_in_step`).
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from . import groups, worker
from ..ops.codecs import CODECS, Codec

__all__ = ["CallHeader", "DTYPES", "FIELDS", "KINDS", "MAGIC", "MODES", "REASON_BYTES", "call_numbers",
           "check", "check_consistent", "exact_fields", "fail_in_step", "header_device", "length", "row",
           "signature"]

# torch 2.13 renamed all_gather_into_tensor to all_gather_single (the old name warns).
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
MODES = ("ordered", "exact")
DTYPES = (torch.float32, torch.bfloat16, torch.float16)

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


# ---- the call header of a collective --------------------------------------------------------------

# The fields of every call, in this order (a failed call sends only the first and zeros).
FIELDS = ("collective", "numel", "codec", "block_size", "topk ratio", "mode", "op scale", "dtype",
          "chunks", "exact_block", "headroom")
_calls: dict = {}  # worker key -> number of the next call on that group (advanced on its worker, in order)


def _shown(name: str, v: int):
    """A signature field's value as a user wrote it (names, not numbers) for error messages."""
    try:
        if name == "collective":
            return KINDS[v]
        if name == "codec":
            return CODECS[v]
        if name == "mode":
            return MODES[v]
        if name == "dtype":
            return str(DTYPES[v])
    except (IndexError, KeyError):
        return v
    if name == "topk ratio":
        return v / 1e6
    if name == "op scale":
        return v / 1e9
    return v


def has_cpu_backend(group) -> bool:
    try:
        (group if group is not None else dist.group.WORLD)._get_backend(  # type: ignore[union-attr]
            torch.device("cpu"))  # no group: WORLD, which exists once torch.distributed is initialised
        return True
    except Exception:  # noqa: BLE001 - e.g. an NCCL-only group
        return False


def _exchange_table(group, mine: torch.Tensor, device: torch.device, async_op: bool):
    world = dist.get_world_size(group)
    allv = torch.empty(world * mine.numel(), dtype=torch.int64, device=device)
    work = all_gather_single(allv, mine.to(device), group=group, async_op=async_op)
    return work, allv.view(world, -1)


def check_consistent(group, fields: Sequence[Tuple[str, int]], device: torch.device) -> None:
    """One tiny all-gather of ``fields`` so that mismatched calls fail on every rank with a clear
    message instead of hanging or exchanging garbage (used where no call header runs, e.g. by
    :mod:`flatcomm.reproducible`)."""
    if not groups.exchanges(group):
        return
    _, table = _exchange_table(group, row(0, False, fields, len(fields)), device, False)
    problems = check(table, fields, _shown)
    if problems:
        raise ValueError("flatcomm: " + "; ".join(problems))


class CallHeader:
    """The header exchange of one call, started at once and checked by :meth:`finish` before the
    first payload byte moves."""

    def __init__(self, group, fields: Sequence[Tuple[str, int]], device: torch.device,
                 reason: Optional[str] = None):
        key = worker.key_of(group)
        self.call = _calls.get(key, 0)
        _calls[key] = self.call + 1
        self.group, self.fields = group, list(fields)
        mine = row(self.call, reason is not None, fields, len(FIELDS), reason or "")
        self.work, self.table = _exchange_table(group, mine, device, True)

    def finish(self) -> None:
        self.work.wait()
        names = [(n, 0) for n in FIELDS]
        problems = check(self.table, names, _shown)
        if not problems:
            return
        if problems[0].startswith("ranks are out of step"):
            # Every rank saw the same table: resume numbering together, so that the next calls
            # (if the ranks' programs agree again) are in step.
            _calls[worker.key_of(self.group)] = max(call_numbers(self.table.cpu())) + 1
            raise RuntimeError("flatcomm: " + problems[0])
        raise ValueError("flatcomm: " + "; ".join(problems))


def header_device(group, device: torch.device, validate: bool) -> Optional[torch.device]:
    """Where the header travels: on the CPU when the group has a CPU backend (no host sync for
    CUDA data); on an NCCL-only group on the data's device, which reads it back on the host, so
    only with ``validate=True`` there."""
    if device.type == "cpu" or has_cpu_backend(group):
        return torch.device("cpu")
    return device if validate else None


def fail_in_step(group, kind: int, err: BaseException) -> None:
    """A rank whose arguments were rejected still takes part in the call's header exchange (status
    failed, the reason), so its peers raise "rank r failed: ..." instead of waiting, and every
    rank's next call pairs with the peers' next call. Not waited for: the caller raises at once."""
    try:
        if not groups.exchanges(group):
            return
        device = torch.device("cpu") if has_cpu_backend(group) else torch.device("cuda", torch.cuda.current_device())
    except Exception:  # noqa: BLE001 - no usable group: nothing to keep in step
        return
    reason = f"{type(err).__name__}: {str(err).removeprefix('flatcomm: ')}"

    def body():
        CallHeader(group, [("collective", kind)], device, reason).finish()

    key = worker.key_of(group)
    if worker.is_on(key):
        try:
            body()
        except Exception:  # noqa: BLE001 - the caller's own error is the one to report
            pass
        return
    worker.submit(key, torch.device("cpu"), body)


def signature(kind: int, numel: int, codec: Codec, mode: str, scale: float, dtype: torch.dtype,
              chunks: int, extra: Sequence[Tuple[str, int]] = ()) -> List[Tuple[str, int]]:
    return [
        ("collective", kind),
        ("numel", numel),
        ("codec", CODECS.index(codec.name)),
        ("block_size", codec.block_size),
        ("topk ratio", int(round(codec.ratio * 1e6))),
        ("mode", MODES.index(mode)),
        ("op scale", int(round(scale * 1e9))),
        ("dtype", DTYPES.index(dtype)),
        ("chunks", chunks),
    ] + list(extra)


def exact_fields(mode: str, block: int, headroom: int) -> List[Tuple[str, int]]:
    # Ranks that disagree on the exact-mode grid would exchange exponent lists of different sizes.
    # Always the same number of fields: the check itself must move equal sizes on every rank.
    exact = mode == "exact"
    return [("exact_block", block if exact else 0), ("headroom", headroom if exact else 0)]
